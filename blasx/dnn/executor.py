"""The network executor: a batch in chunks through a graph, on the host (numpy layers on the engine: sims,
the CPU) or on GPUs (one thread per worker, ``workers`` per GPU each on its own stream and buffers; the
weights uploaded once per GPU and dtype; a chunk crosses the host link once in (through page-locked
staging) and its output once out). Workers take chunks from one shared counter, so faster GPUs take more;
a worker's exception stops the others and is raised in the caller. Per node and chunk the time is taken
(host clock, or CUDA events on the worker's stream) into a :class:`NetworkProfile`."""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..operands import is_cupy
from ..runtime.devices.cupy_streams import on_stream
from . import chunk_graph, direct_cache, host_batch, lanes, layers, transpose_kernel
from .direct_cache import Workspace
from .graph import Graph, flops, infer_shapes
from .passes import BufferPlan


# ---------------------------------------------------------------- profile

GRAPH_ENTRY = "(cuda graph)"  # the profile's entry for chunks replayed from CUDA graphs

@dataclass
class LayerStat:
    """One node on one device over a run: total seconds, flops, the nodes fused into it and, for a
    convolution, its algorithm (Network.algos: the device route's form, or "engine")."""

    name: str
    op: str
    device: str
    seconds: float = 0.0
    flops: float = 0.0
    fused: tuple = ()
    algo: str = ""

    @property
    def tflops(self) -> float:
        return self.flops / self.seconds / 1e12 if self.seconds > 0 else 0.0


@dataclass
class NetworkProfile:
    """A run of a Network: wall seconds, images, chunks, per-layer stats (per device) and the events
    (device, chunk, node name, start, end in seconds from the run's start) for the Chrome trace."""

    wall: float
    images: int
    chunks: int
    devices: tuple
    layers: list
    events: list = field(default_factory=list)
    graphs: dict | None = None  # chunk_graph.summary over the workers (graphs on), counted since they were made

    @property
    def images_per_s(self) -> float:
        return self.images / self.wall if self.wall > 0 else 0.0

    def by_layer(self) -> list:
        """Stats summed over devices, in the graph's order."""
        out: dict = {}
        for s in self.layers:
            t = out.setdefault(s.name, LayerStat(s.name, s.op, "all", fused=s.fused, algo=s.algo))
            t.seconds += s.seconds
            t.flops += s.flops
        return list(out.values())

    def summary(self) -> dict:
        return {"wall": self.wall, "images": self.images, "chunks": self.chunks, "images_per_s": self.images_per_s,
                "devices": list(self.devices),
                "layers": [{"name": s.name, "op": s.op, "device": s.device, "seconds": s.seconds, "flops": s.flops,
                            "tflops": s.tflops, "fused": list(s.fused), "algo": s.algo} for s in self.layers]}

    def report(self, top: int | None = None) -> str:
        """A text table, one row per layer (devices summed): seconds, share, TFLOPS, algorithm, what it fused."""
        rows = self.by_layer()
        total = sum(r.seconds for r in rows) or 1.0
        rows_shown = sorted(rows, key=lambda r: -r.seconds)[:top] if top else rows
        lines = [f"network: {self.images} images in {self.wall:.4f} s ({self.images_per_s:.1f} images/s), "
                 f"{self.chunks} chunks on {', '.join(self.devices)}",
                 f"{'layer':<28}{'op':<18}{'seconds':>10}{'share':>8}{'TFLOPS':>9}  {'algo':<10}fused"]
        if self.graphs is not None:
            g = self.graphs
            lines.insert(1, f"CUDA graphs: {g['captured']} chunk shapes captured, {g['replays']} replays, "
                            f"{g['eager']} eager chunks, {g['failures']} failed captures"
                            + (f" (last: {g['error']})" if g["error"] else ""))
        for r in rows_shown:
            lines.append(f"{r.name[:27]:<28}{r.op:<18}{r.seconds:>10.5f}{r.seconds / total:>8.1%}{r.tflops:>9.2f}  "
                         f"{r.algo or '-':<10}{'+'.join(r.fused) if r.fused else '-'}")
        return "\n".join(lines)

    def to_chrome_trace(self, path=None) -> dict:
        """Chrome trace-event JSON: pid = device, tid = chunk worker lane, one "X" event per node and chunk."""
        import json
        pids = {d: i for i, d in enumerate(self.devices)}
        events = [{"name": name, "cat": "layer", "ph": "X", "pid": pids.get(dev, 0), "tid": lane,
                   "ts": s * 1e6, "dur": max(e - s, 0.0) * 1e6, "args": {"chunk": chunk}}
                  for dev, lane, chunk, name, s, e in self.events]
        meta = [{"name": "process_name", "ph": "M", "pid": i, "tid": 0, "args": {"name": d}}
                for d, i in pids.items()]
        trace = {"traceEvents": meta + events, "displayTimeUnit": "ms"}
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(trace, f)
        return trace


# ---------------------------------------------------------------- progress

def progress_line(done: int, total: int, images: int, elapsed: float) -> str:
    """``network [######------]  3/8 chunks  1234 images/s  2.1 s`` (no ``\\r``)."""
    width = 24
    fill = int(round(width * done / total)) if total else width
    rate = f"{images / elapsed:.0f} images/s" if elapsed > 0 else ""
    return f"network [{'#' * fill}{'-' * (width - fill)}]  {done}/{total} chunks  {rate}  {elapsed:.1f} s"


class _Progress:
    def __init__(self, enabled: bool, total: int, stream=None):
        self.enabled, self.total, self.stream = enabled, total, stream or sys.stderr
        self.done, self.images, self.t0 = 0, 0, time.perf_counter()
        self.lock = threading.Lock()

    def chunk_done(self, images: int) -> None:
        with self.lock:
            self.done += 1
            self.images += images
            if self.enabled:
                try:
                    self.stream.write("\r" + progress_line(self.done, self.total, self.images,
                                                           time.perf_counter() - self.t0))
                    if self.done == self.total:
                        self.stream.write("\n")
                    self.stream.flush()
                except (ValueError, OSError):
                    self.enabled = False


# ---------------------------------------------------------------- one worker

class Worker:
    """Runs chunks on one device (``device`` None: the host) with its own buffers and, on a GPU, its own stream."""

    def __init__(self, graph: Graph, plan: BufferPlan, chunk_shape: tuple, dtype, math, weights: dict,
                 device: int | None, lane: int, lay: str, graphs: bool = False):
        self.graph, self.plan, self.dtype, self.math, self.weights = graph, plan, np.dtype(dtype), math, weights
        self.device, self.lane, self.layout = device, lane, lay
        self.graphs = graphs and device is not None  # chunks replayed from CUDA graphs (chunk_graph.py)
        self.chunk_graphs: OrderedDict = OrderedDict()  # chunk shape -> ChunkGraph, least recently used first
        self.label = "host" if device is None else f"cuda:{device}"
        self.stats: dict = {}
        if device is None:
            self.xp, self.stream = np, None
            self.buffers = [np.empty(s, dtype=self.dtype) for s in plan.sizes]
        else:
            import cupy
            self.xp = cupy
            with cupy.cuda.Device(device):
                self.stream = cupy.cuda.Stream(non_blocking=True)
                self.buffers = [cupy.empty(s, dtype=self.dtype) for s in plan.sizes]
                self.x_dev = cupy.empty(math_prod(chunk_shape), dtype=self.dtype)
                # (blocks of the current stream's pool, whose last users there may still be queued)
                self.stream.wait_event(cupy.cuda.get_current_stream().record())
            self.pinned_in = _pinned(math_prod(chunk_shape), self.dtype)
            self.pinned_out = None
        self.workspace = Workspace()  # this worker's (stream's) weight transforms and scratch
        self.last = _last_reads(graph)
        self.shapes: dict = {}  # chunk shape -> (shapes, flops per node, out= view per node)
        self.events: list = []
        self._timing_events: list = []  # CUDA events reused chunk after chunk (read back before reuse)

    def _view(self, buf, shape):
        return host_batch.in_layout(buf[:math_prod(shape)], shape, self.layout if len(shape) >= 4 else "nchw")

    def _per_shape(self, shape: tuple) -> tuple:
        """(shapes, flops, out=) per node for chunks of ``shape``, made once (views of this worker's buffers)."""
        got = self.shapes.get(shape)
        if got is None:
            graph = self.graph
            shapes = infer_shapes(graph, shape)
            outs, fl = {}, {}
            for node in graph.nodes[1:]:
                b = self.plan.buffer.get(node.name)
                outs[node.name] = self._view(self.buffers[b], shapes[node.name]) \
                    if b is not None and layers.takes_out(node) else None
                fl[node.name] = flops(node, shapes)
            got = self.shapes[shape] = (shapes, fl, outs)
        return got

    def forward(self, x, chunk: int, t_origin: float):
        """The graph's output for the chunk ``x`` (an array on this worker's device)."""
        marks = [self._mark(0)]  # mark i: the end of node i - 1 and the start of node i
        y = self._nodes(x, marks)
        fl = self._per_shape(tuple(x.shape))[1]
        self._account([(n.name, n.op, tuple(n.attrs.get("fused", ())), fl[n.name]) for n in self.graph.nodes[1:]],
                      marks, chunk, t_origin)
        return y

    def _nodes(self, x, marks: list | None = None):
        """The nodes on ``x`` in order (a timing mark after each where ``marks`` is a list)."""
        graph = self.graph
        _, _, outs = self._per_shape(tuple(x.shape))
        values = {graph.nodes[0].name: x}
        last = self.last
        for i, node in enumerate(graph.nodes[1:], 1):
            values[node.name] = layers.run_node(node, [values[n] for n in node.inputs], self.weights.get(node.name, {}),
                                                outs[node.name], self.math)
            if marks is not None:
                marks.append(self._mark(i))
            for n in last.get(i, ()):
                if n != graph.output:
                    values.pop(n, None)
        return values[graph.output]

    def _forward_staged(self, xd, chunk: int, t_origin: float):
        """The output for the chunk in this worker's input buffer ``xd``: from the shape's CUDA graph where
        there is one (captured on the shape's second chunk), else eagerly."""
        if not self.graphs:
            return self.forward(self._prepared(xd), chunk, t_origin)
        g = chunk_graph.lookup(self.chunk_graphs, tuple(xd.shape))
        if g.wants_capture():
            g.capture(self.xp, self.stream, lambda: self._nodes(self._prepared(xd)))
        if g.graph is None:
            g.eager += 1
            return self.forward(self._prepared(xd), chunk, t_origin)
        marks = [self._mark(0)]
        y = g.replay(self.stream)
        marks.append(self._mark(1))  # a replayed chunk is one profile entry: its layers are not timed apart
        self._account([(GRAPH_ENTRY, "graph", (), sum(self._per_shape(tuple(xd.shape))[1].values()))], marks,
                      chunk, t_origin)
        return y

    def _mark(self, i: int):
        if self.device is None:
            return time.perf_counter()
        import cupy
        if i == len(self._timing_events):
            self._timing_events.append(cupy.cuda.Event())
        ev = self._timing_events[i]
        ev.record(self.stream)
        return ev

    def _account(self, entries: list, marks: list, chunk: int, t_origin: float) -> None:
        """The profile's entries (name, op, fused, flops), entry i timed from mark i to mark i + 1."""
        if self.device is None:
            at = [m - t_origin for m in marks]
        else:
            import cupy
            self.stream.synchronize()
            end_host = time.perf_counter()
            since = [cupy.cuda.get_elapsed_time(marks[0], m) / 1e3 for m in marks]
            start_host = end_host - since[-1] - t_origin
            at = [start_host + t for t in since]
        for i, (name, op, fused, work) in enumerate(entries):
            s, e = at[i], at[i + 1]
            st = self.stats.get(name)
            if st is None:
                st = self.stats[name] = LayerStat(name, op, self.label, fused=fused)
            st.seconds += e - s
            st.flops += work
            self.events.append((self.label, self.lane, chunk, name, s, e))

    def reset(self) -> None:
        self.stats, self.events = {}, []

    def context(self):
        """This worker's device and stream as the current ones (the host: nothing)."""
        if self.device is None:
            return contextlib.nullcontext()
        import cupy
        from .conv_direct import on_own_gpu
        stack = contextlib.ExitStack()
        stack.enter_context(cupy.cuda.Device(self.device))
        stack.enter_context(on_stream(self.stream))
        stack.enter_context(on_own_gpu())  # the chunk's convolutions stay on this GPU
        stack.enter_context(direct_cache.using(self.workspace))  # its weights never change; one stream
        return stack

    def _prepared(self, x):
        """x in the run's type and layout (copied only where it is not)."""
        if x.dtype != self.dtype:
            x = x.astype(self.dtype)
        if self.layout == "cl" and x.ndim >= 4:
            return transpose_kernel.to_layout(self.xp, x, "cl")
        return self.xp.ascontiguousarray(x)

    def run_chunk(self, xc, chunk: int, t_origin: float, host_in: bool, pinning=None):
        """A chunk through the graph on this worker, its output returned (on the host where ``host_in``):
        a host chunk for a GPU worker is copied in straight from the batch where blasx has page-locked it
        (``pinning``, a hostmem.Pinning of the batch: see :func:`_pin_batch`), else cast through page-locked
        staging; its output goes out through staging."""
        if self.device is None or not (host_in or self.graphs):
            with self.context():
                return self.forward(self._prepared(xc), chunk, t_origin)
        import cupy
        with self.context():
            xd = self.x_dev[:xc.size].reshape(xc.shape)
            if not host_in:  # a graph reads its chunk from this worker's own buffer
                xd[...] = xc
                return self._forward_staged(xd, chunk, t_origin)
            if pinning is not None:
                host_batch.pinned_copy(xd.data.ptr, xc.ctypes.data, xc.nbytes, pinning, True, self.stream.ptr)
            else:
                stage = self.pinned_in[:xc.size].reshape(xc.shape)
                np.copyto(stage, xc, casting="unsafe")
                xd.set(stage, stream=self.stream)
            y = self._forward_staged(xd, chunk, t_origin)
            if self.pinned_out is None or self.pinned_out.size < y.size:
                self.pinned_out = _pinned(y.size, y.dtype)
            host = self.pinned_out[:y.size].reshape(y.shape)
            transpose_kernel.to_layout(cupy, y, "nchw").get(stream=self.stream, out=host)
            self.stream.synchronize()
            return host


def _pin_batch(workers: list, x):
    """(the batch's hostmem.Pinning or None, the job registering it or None): a host batch for GPU workers, of
    the run's type, C contiguous and large enough, is page-locked in place by the engine's registration cache
    (kept while the array lives, so later calls on it copy straight from it). The cache locks a batch's whole
    root array: a batch that is a small part of a larger array (a slice of a data set) is staged instead."""
    from ..runtime import hostmem
    if is_cupy(x) or x.nbytes < hostmem.MIN_REGISTER_BYTES or not x.flags.c_contiguous:
        return None, None
    if workers[0].device is None or x.dtype != workers[0].dtype or hostmem.root_of(x).nbytes > 2 * x.nbytes:
        return None, None
    (pinning,), job = hostmem.REGISTRY.pin([x])
    return pinning, job


def math_prod(shape) -> int:
    return int(math.prod(shape))


def _pinned(n: int, dtype):
    """``n`` elements of ``dtype`` in page-locked host memory."""
    return host_batch.pinned(max(1, n) * np.dtype(dtype).itemsize, dtype)


def _last_reads(graph: Graph) -> dict:
    """index -> names whose last reader is the node at that index (values dropped after it)."""
    last = {}
    for i, n in enumerate(graph.nodes):
        for src in n.inputs:
            last[src] = i
    out: dict = {}
    for name, i in last.items():
        out.setdefault(i, []).append(name)
    return out


# ---------------------------------------------------------------- a whole run

def run(workers: list, x, batch_axis: int, chunk: int, progress: bool):
    """``x`` (host numpy, or one GPU's CuPy array with that GPU's workers) through ``workers`` in chunks of
    ``chunk`` images; returns (output, NetworkProfile). Chunks go along ``batch_axis`` (not 0: one chunk);
    the output is on the host for a host x, else on x's GPU."""
    host_in = not is_cupy(x)
    n = x.shape[batch_axis]
    spans = [(i, min(i + chunk, n)) for i in range(0, n, chunk)] if batch_axis == 0 else [(0, n)]
    bar = _Progress(progress, len(spans))
    state = {"next": 0, "error": None, "out": None}
    lock = threading.Lock()
    for w in workers:
        w.reset()
    t0 = time.perf_counter()
    pinning, pin_job = _pin_batch(workers, x) if batch_axis == 0 else (None, None)
    caller = None
    if not host_in:  # the workers read x after the caller's queued work; the output is made on its stream
        with workers[0].xp.cuda.Device(x.device.id):
            caller = workers[0].xp.cuda.get_current_stream()
            ready = caller.record()
        for w in workers:
            w.stream.wait_event(ready)

    def put(w: Worker, k: int, y) -> None:
        lo, hi = spans[k]
        xp = np if host_in else w.xp
        with lock:
            if state["out"] is None:
                with w.context(), on_stream(caller) if caller is not None else contextlib.nullcontext():
                    state["out"] = xp.empty((n if batch_axis == 0 else y.shape[0], *y.shape[1:]), dtype=y.dtype)
        if batch_axis == 0 and y.shape[0] != hi - lo:  # (an op across the batch: refused by from_torch)
            raise RuntimeError(f"a chunk of {hi - lo} images gave {y.shape[0]} outputs: the network mixes its "
                               f"batch's images")
        with w.context():
            if batch_axis == 0:
                state["out"][lo:hi] = y
            else:
                state["out"][...] = y
            if w.stream is not None:
                w.stream.synchronize()

    def loop(w: Worker) -> None:
        try:
            while True:
                with lock:
                    k = state["next"]
                    if k >= len(spans) or state["error"] is not None:
                        return
                    state["next"] += 1
                lo, hi = spans[k]
                y = w.run_chunk(x[lo:hi] if batch_axis == 0 else x, k, t0, host_in, pinning)
                put(w, k, y)
                bar.chunk_done(hi - lo)
        except BaseException as e:  # noqa: BLE001 -- a worker never leaks: the caller re-raises the first
            if w.stream is not None:  # (its queued work done before the caller may drop its buffers)
                try:
                    w.stream.synchronize()
                except Exception:  # noqa: BLE001 -- a broken device: the first error is the one raised
                    pass
            with lock:
                if state["error"] is None:
                    state["error"] = e
    try:
        if len(workers) == 1:
            loop(workers[0])
        else:
            def stop(exc) -> None:  # the workers take no more chunks
                with lock:
                    if state["error"] is None:
                        state["error"] = exc
            lanes.run_all([lambda w=w: loop(w) for w in workers], stop)
    finally:
        if pin_job is not None:
            pin_job.join()  # no registration outlives the call
    if state["error"] is not None:
        raise state["error"]
    wall = time.perf_counter() - t0
    stats = [s for w in workers for s in w.stats.values()]
    events = sorted((e for w in workers for e in w.events), key=lambda e: e[4])
    devices = tuple(dict.fromkeys(w.label for w in workers))
    graphs = chunk_graph.summary(g for w in workers for g in w.chunk_graphs.values()) \
        if any(w.graphs for w in workers) else None
    return state["out"], NetworkProfile(wall, n, len(spans), devices, stats, events, graphs)
