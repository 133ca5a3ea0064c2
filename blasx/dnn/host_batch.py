"""Host batches on the GPUs: a forward convolution of a numpy batch, its images cut into chunks dealt to the
engine's GPUs in turn. Each GPU keeps ``SLOTS`` chunks in flight, one a stream: the chunk copied in (straight
from page-locked memory, else through the slot's page-locked staging), convolved by the device route
(conv_direct: the forms and kernels of CuPy operands), copied out. So on every GPU both directions of its host
link and its compute overlap, and the GPUs' links add up. The weights go to each GPU once a call. The calling
thread issues everything (all of it asynchronous): no thread hand-offs, no GIL contention between issuers.

Chosen for numpy operands when the engine's devices are GPUs and one image's input and output fit a chunk
(:func:`applies`); the engine's tile tasks (im2col as derived tiles) stay the route for sims, the CPU and
larger images.

Policy: chunks of equal size, enough for every slot of every GPU to run ``CHUNKS_PER_SLOT`` (the first fills
the pipeline), of ``MIN_CHUNK_BYTES`` to ``CHUNK_BYTES`` of input and output (:func:`plan`). Host operands of
at least ``hostmem.MIN_REGISTER_BYTES`` (weights: ``WEIGHT_REGISTER_BYTES``) are page-locked in place by the
engine's registration cache (kept while the array lives; a one-shot batch too: registered in place, it needs
no copy through a pooled page-locked buffer); a caller's page-locked memory is copied from as it is;
anything else goes through a slot's staging. Outputs blasx allocates are page-locked (CuPy's pinned pool) up
to ``PINNED_OUT_BYTES``.

Graphs (``GRAPHS``, where the caller names its body: ``body_key``): a chunk's device work between its copies
(layout conversions, the convolution, its epilogue) is captured into a CUDA graph on its slot's stream and
replayed for later chunks and later calls with the same key, one launch instead of the body's Python. The
key holds the body's key (everything the body depends on besides the arrays it is given: geometry, types,
math, epilogue values, the route's switches), the batch's layout and the device layout (the layout copies
around the body), the chunk's images and the addresses of the slot buffers the copies fill and empty (x,
residual, y, the weight), so a replay reads and writes where this chunk's copies do; what the graph uses
inside (layout copies, scratch, channel vectors) it keeps (direct_cache.capturing); weights' transforms are
made inside the graph from the weight buffer, refilled each call (direct_cache.weights_in_graph). A key's
first chunk runs eagerly (kernels compiled, scratch sized, vectors uploaded), the next is captured; a capture
that fails leaves the key eager after chunk_graph.TRIES. A graph holding a scratch buffer its slot's
Workspace has replaced is dropped at the slot's next capture.

State: a :class:`Slot` (stream, Workspace, staging, graphs) belongs to one call at a time: a call takes idle
slots from ``_IDLE`` and puts them back. A slot's staging is reused only after its last chunk's event
(:meth:`Slot.drain`); a graph it drops (beyond ``GRAPHS_KEPT`` keys) only after its stream is synchronized.

Failure: the first exception (Ctrl-C included) stops the issuing; every slot is synchronized and drained
before the call re-raises it, so no copy still reads or writes the caller's arrays when it returns.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import OrderedDict
from math import prod

import numpy as np

from ..operands import is_cupy
from ..runtime.config import env_switch
from ..runtime.devices.cupy_streams import on_stream
from ..runtime.latch import wait_through
from . import chunk_graph, conv_direct, direct_cache, transpose_kernel

SLOTS = 2  # streams a GPU keeps chunks in flight on
CHUNKS_PER_SLOT = 4  # chunks each slot runs at least where the batch allows
CHUNK_BYTES = 64 << 20  # a chunk's input + output bytes at most (each slot's staging and device buffers)
MIN_CHUNK_BYTES = 32 << 20  # ... and at least, where the batch allows: each chunk costs the issuing thread host time
PINNED_OUT_BYTES = 4 << 30  # outputs blasx allocates are page-locked up to this size
WEIGHT_REGISTER_BYTES = 1 << 20  # weights from this size are page-locked in place (kept while they live)
GRAPHS = env_switch("BLASX_HOST_BATCH_GRAPHS")  # off: every chunk's body runs eagerly
GRAPHS_KEPT = 32  # keys a slot keeps graphs of (a network's layers in turn, some with their last chunk's size)


# ---------------------------------------------------------------- the plan (pure)

def plan(n: int, image_bytes: int, gpus: int, slots: int = SLOTS) -> list[tuple[int, int]]:
    """Spans [lo, hi) of the batch's ``n`` images (``image_bytes`` of input and output an image), of equal
    size (the last may be smaller): as many as every slot of every GPU needs to run ``CHUNKS_PER_SLOT``, but
    chunks of at least ``MIN_CHUNK_BYTES`` while every GPU still gets one, and of at most ``CHUNK_BYTES``. Evened
    out by rounding the count down (to a multiple of the GPUs where there are that many), not the size."""
    if n <= 0:
        return []
    image_bytes = max(1, image_bytes)
    most = max(1, min(-(-n // gpus), CHUNK_BYTES // image_bytes))
    per = max(1, min(max(-(-n // (gpus * slots * CHUNKS_PER_SLOT)), -(-MIN_CHUNK_BYTES // image_bytes)), most))
    count = max(1, n // per)
    if count >= gpus:
        count -= count % gpus
    while -(-n // count) > most:
        count += 1
    per = -(-n // count)
    return [(lo, min(n, lo + per)) for lo in range(0, n, per)]


def gpus() -> tuple:
    """The engine's GPUs (configured, not started): the route's devices; empty where it has none."""
    from .. import session
    return session.cuda_ordinals()


def applies(x, image_bytes: int) -> bool:
    """Whether a forward convolution of host array ``x`` takes this route (``image_bytes``: one image's
    input and output): GPUs configured, the route not forced to the engine, an image within a chunk."""
    if is_cupy(x) or conv_direct.ROUTE == "engine" or image_bytes > CHUNK_BYTES:
        return False
    return bool(gpus())


# ---------------------------------------------------------------- host memory

def pinned(nbytes: int, dtype=np.uint8) -> np.ndarray:
    """A page-locked host array of ``nbytes`` bytes viewed as ``dtype`` (CuPy's pinned pool)."""
    import cupy
    dt = np.dtype(dtype)
    mem = cupy.cuda.alloc_pinned_memory(max(1, nbytes))
    return np.frombuffer(mem, dtype=dt, count=max(1, nbytes // dt.itemsize))


def empty(shape: tuple, dtype, lay: str) -> np.ndarray:
    """An output for this route in layout ``lay``: page-locked up to ``PINNED_OUT_BYTES``, else numpy's."""
    dt = np.dtype(dtype)
    stored = tuple(shape) if lay == "nchw" else (shape[0], *shape[2:], shape[1])
    nbytes = prod(stored) * dt.itemsize
    flat = pinned(nbytes, dt)[:prod(stored)] if 0 < nbytes <= PINNED_OUT_BYTES else np.empty(prod(stored), dt)
    return in_layout(flat.reshape(stored) if lay == "nchw" else flat, shape, lay)


def in_layout(flat, shape: tuple, lay: str):
    """A compact array's memory ``flat`` viewed as the NC(spatial)-shaped array in layout ``lay``."""
    if lay == "nchw":
        return flat.reshape(shape)
    moved = flat.reshape(shape[0], *shape[2:], shape[1])
    return moved.transpose(0, moved.ndim - 1, *range(1, moved.ndim - 1))


def memory_bytes(a, lay: str) -> np.ndarray:
    """The bytes of a compact host array in layout ``lay``, in memory order (a view: never a copy, which would
    take the route's writes)."""
    stored = a if lay == "nchw" else a.transpose(0, *range(2, a.ndim), 1)
    if not stored.flags.c_contiguous:
        raise RuntimeError(f"host_batch: an array of strides {a.strides} is not compact in layout {lay!r}")
    return stored.reshape(-1).view(np.uint8)


def pinned_copy(dev_ptr: int, host_ptr: int, nbytes: int, pinning, to_device: bool, stream_ptr: int) -> None:
    """``nbytes`` between device memory and (partly) page-locked host memory, asynchronous on the stream, in
    pieces that each lie in one registered (or pageable) region (hostmem: CUDA refuses a copy over a partly
    registered range), once those regions are ready."""
    from cupy.cuda import runtime as rt
    for _, _, b0, b1 in pinning.pieces(host_ptr, nbytes, nbytes, 1):
        if to_device:
            rt.memcpyAsync(dev_ptr + b0, host_ptr + b0, b1 - b0, rt.memcpyHostToDevice, stream_ptr)
        else:
            rt.memcpyAsync(host_ptr + b0, dev_ptr + b0, b1 - b0, rt.memcpyDeviceToHost, stream_ptr)


def pinnings(arrays: list, min_bytes: int | None = None) -> tuple[list, object]:
    """(each host array's hostmem.Pinning or None, the registration job or None): an array whose root is
    at most twice its size (and at least ``min_bytes``, default hostmem's) is page-locked in place (the
    registration cache; memory pinned by others is used as it is); a part of a larger array is staged
    (locking its whole root would cost more than the copy)."""
    from ..runtime import hostmem
    picked = [a for a in arrays if a is not None and hostmem.root_of(a).nbytes <= 2 * a.nbytes]
    if not picked:
        return [None] * len(arrays), None
    got, job = hostmem.REGISTRY.pin(picked, min_bytes)
    of = {id(a): p for a, p in zip(picked, got)}
    return [of.get(id(a)) if a is not None else None for a in arrays], job


# ---------------------------------------------------------------- one stream of one GPU

class Slot:
    """One stream of one GPU and what it keeps between calls: a Workspace (weight transforms, scratch, the
    cuBLAS handle bound to this stream), page-locked staging, and its last chunk (``event``; ``staged``: it
    used the staging, so the next must wait for it; ``owed``: the host copy out of staging its output still
    needs). Chunks copied straight from and into page-locked memory never wait: the stream orders them."""

    def __init__(self, device: int):
        import cupy
        self.device = device
        with cupy.cuda.Device(device):
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.event = cupy.cuda.Event(disable_timing=True)
        self.workspace = direct_cache.Workspace()
        self.staging: dict = {}
        self.staged = False
        self.owed = None
        self.graphs: OrderedDict = OrderedDict()  # chunk key -> chunk_graph.ChunkGraph, least recently used first

    def stage(self, name: str, nbytes: int) -> np.ndarray:
        buf = self.staging.get(name)
        if buf is None or buf.size < nbytes:
            buf = self.staging[name] = pinned(nbytes)
        return buf[:nbytes]

    def device_array(self, name: str, shape: tuple, dtype, lay: str):
        import cupy
        flat = self.workspace.scratch("host_batch_" + name, prod(shape), dtype,
                                      lambda size, dt: cupy.empty(size, dtype=dt))
        return in_layout(flat, shape, lay)

    def converted(self, dev, name: str, lay: str, to: str):
        """The device array ``dev`` (layout ``lay``) in layout ``to``: itself, or a copy in scratch ``name``."""
        if to == lay:
            return dev
        out = self.device_array(name, dev.shape, dev.dtype, to)
        transpose_kernel.copy(out, dev, to == "cl")
        return out

    def copy_in(self, dev, host: np.ndarray, pinning, name: str) -> None:
        """``host`` (bytes in memory order) into the device array ``dev`` (compact) on this stream."""
        if pinning is None:
            st = self.stage(name, host.nbytes)
            np.copyto(st, host)
            self.staged = True
            host, pinning = st, hostmem_whole(st)
        pinned_copy(dev.data.ptr, host.ctypes.data, host.nbytes, pinning, True, self.stream.ptr)

    def copy_out(self, host: np.ndarray, dev, pinning) -> None:
        """The device array ``dev`` into ``host`` (bytes in memory order) on this stream; through staging
        the host copy is owed until :meth:`drain`."""
        if pinning is None:
            st = self.stage("out", host.nbytes)
            self.owed = (host, st)
            self.staged = True
            host, pinning = st, hostmem_whole(st)
        pinned_copy(dev.data.ptr, host.ctypes.data, host.nbytes, pinning, False, self.stream.ptr)

    def compute(self, segment, key) -> None:
        """``segment()`` (a chunk's device work on this slot's buffers) on this stream: replayed from the graph of
        ``key``, captured first where its key ran eagerly before; eagerly where ``key`` is None or captures
        fail."""
        if key is None:
            segment()
            return
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = chunk_graph.ChunkGraph()
            if len(self.graphs) > GRAPHS_KEPT:
                self.stream.synchronize()  # (the dropped graph may be in flight on it)
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        if g.graph is None and not (g.wants_capture() and self._captured(g, segment)):
            segment()
            g.eager += 1
            return
        g.replay(self.stream)

    def _captured(self, g, segment) -> bool:
        """``segment`` captured into ``g``; then the graphs holding a scratch buffer the Workspace has since
        replaced (grown) are dropped, so old buffers are not kept alive by graphs (each is captured again)."""
        if not g.capture(_cupy(), self.stream, segment, fresh_weights=True):
            return False
        live = {id(b): b for b in self.workspace.buffers.values()}
        g.buffers = [b for b in g.keep if live.get(id(b)) is b]
        stale = [k for k, o in self.graphs.items() if any(live.get(id(b)) is not b for b in o.buffers)]
        if stale:
            self.stream.synchronize()  # (a dropped graph may be in flight on it)
            for k in stale:
                del self.graphs[k]
        return True

    def issued(self) -> None:
        self.event.record(self.stream)

    def drain(self) -> None:
        """Where its last chunk used the staging: wait for it and make its owed host copy."""
        if not self.staged:
            return
        self.event.synchronize()
        self.staged = False
        if self.owed is not None:
            dst, st = self.owed
            self.owed = None
            np.copyto(dst, st)


_IDLE: dict = {}  # device -> idle Slots
_lock = threading.Lock()


def take(device: int, count: int) -> list:
    """``count`` slots of ``device``: idle ones first, in the order they were given back (so a call's chunks
    meet the slots, and their graphs, of the last call in the same roles), then new ones."""
    with _lock:
        idle = _IDLE.setdefault(device, [])
        got = idle[:count]
        del idle[:count]
    return got + [Slot(device) for _ in range(count - len(got))]


def give_back(slots: list) -> None:
    for s in slots:
        s.workspace.weights.clear()  # this call's weights: never found again, not kept alive
        s.owed, s.staged = None, False
    with _lock:
        for s in slots:
            _IDLE.setdefault(s.device, []).append(s)


def release() -> None:
    """Drop the idle slots (their streams, staging and scratch): blasx.shutdown, tests."""
    with _lock:
        _IDLE.clear()


# ---------------------------------------------------------------- a call

@dataclasses.dataclass
class Batch:
    """A forward call's host operands in layout ``lay`` (compact): x, the output y, a residual or None;
    ``device_lay``: the layout the chunks are convolved in on the GPUs (None: ``lay``), each chunk converted
    there after its copy in and back before its copy out (the link carries the host layout)."""

    x: np.ndarray
    y: np.ndarray
    residual: np.ndarray | None
    lay: str
    device_lay: str | None = None




_BODY_IDS = direct_cache.table(4096)  # a body's key -> a small number naming it in chunk keys (never reused)
_body_numbers = itertools.count()


def body_id(body_key) -> int | None:
    """The number naming ``body_key`` in the slots' graph keys (None: no graphs for it)."""
    if body_key is None or not GRAPHS:
        return None
    return _BODY_IDS.get(body_key, lambda: next(_body_numbers))


def _cupy():
    import cupy
    return cupy


def run(batch: Batch, weight: np.ndarray, body, devices: tuple | None = None, body_key=None) -> None:
    """y = body per chunk, on every GPU: ``body(xd, wd, yd, rd)`` computes a chunk's output ``yd`` from its
    input ``xd`` (and residual ``rd`` or None) and the weight on that GPU ``wd``, on the current device and
    stream (CuPy arrays in the batch's layout). Everything is issued from the calling thread, chunk k to GPU
    k mod G (every operation is asynchronous; only staging waits). ``body_key``: a hashable value naming all
    that ``body`` depends on besides its arrays, where its chunks may replay CUDA graphs (see the module's
    docstring); None: eager."""
    import cupy
    devices = tuple(devices or gpus())
    bid = body_id(body_key)
    x, y, res, lay = batch.x, batch.y, batch.residual, batch.lay
    dlay = batch.device_lay or lay
    n = x.shape[0]
    image = (x.nbytes + y.nbytes + (res.nbytes if res is not None else 0)) // max(1, n)
    spans = plan(n, image, len(devices))
    job = w_job = failed = None
    used = {}  # device -> the slots taken (each given back, or dropped, however the call ends)
    views = {}  # (slot, buffer, images) -> its device array: a slot's buffers keep their size within a call

    def view(s, name, shape, dtype, lay):
        got = views.get((s, name, shape[0]))
        if got is None:
            got = views[s, name, shape[0]] = s.device_array(name, shape, dtype, lay)
        return got
    try:
        (px, pr, py), job = pinnings([x, res, y])
        w_host, pw = weight, None
        if weight.flags.c_contiguous:  # copied from in place, once page-locked (kept while the weight lives)
            (pw,), w_job = pinnings([weight], WEIGHT_REGISTER_BYTES)
        if pw is None:  # staged once for every GPU
            w_host = pinned(weight.nbytes, weight.dtype)[:weight.size].reshape(weight.shape)
            np.copyto(w_host, weight)
            pw = hostmem_whole(w_host)
        for d in devices[:len(spans)]:
            used[d] = take(d, min(SLOTS, -(-len(spans) // len(devices))))
        weights = {}
        for d, slots in used.items():
            with cupy.cuda.Device(d):
                first = slots[0]
                with on_stream(first.stream):  # the weight in this GPU's own buffer: one address call after call
                    wd = weights[d] = first.device_array("w", w_host.shape, w_host.dtype, "nchw")
                    first.copy_in(wd, w_host.reshape(-1).view(np.uint8), pw, "w")
                first.event.record(first.stream)
                for s in slots[1:]:
                    s.stream.wait_event(first.event)
        for k, (lo, hi) in enumerate(spans):
            d = devices[k % len(devices)]
            slots = used[d]
            s = slots[(k // len(devices)) % len(slots)]
            s.drain()
            with cupy.cuda.Device(d), on_stream(s.stream), conv_direct.on_own_gpu(), direct_cache.using(s.workspace):
                xd = view(s, "x", (hi - lo, *x.shape[1:]), x.dtype, lay)
                s.copy_in(xd, memory_bytes(x[lo:hi], lay), px, "x")
                rd = None
                if res is not None:
                    rd = view(s, "r", (hi - lo, *res.shape[1:]), res.dtype, lay)
                    s.copy_in(rd, memory_bytes(res[lo:hi], lay), pr, "r")
                yd = view(s, "y", (hi - lo, *y.shape[1:]), y.dtype, lay)
                wd = weights[d]
                key = None if bid is None else (bid, lay, dlay, hi - lo, xd.data.ptr,  # (_chunk_body's layouts)
                                                None if rd is None else rd.data.ptr, yd.data.ptr, wd.data.ptr)
                s.compute(lambda: _chunk_body(s, body, lay, dlay, xd, wd, yd, rd), key)
                s.copy_out(memory_bytes(y[lo:hi], lay), yd, py)
                s.issued()
    except BaseException as exc:  # noqa: BLE001 -- re-raised once nothing is in flight
        failed = exc
    finally:
        for slots in used.values():
            done = []
            for s in slots:
                usable, exc = _settle(s)
                failed = failed or exc
                if usable:
                    done.append(s)
            give_back(done)
        for j in (job, w_job):
            if j is not None:
                try:
                    j.join()  # no registration outlives the call (a Ctrl-C there waits for it, then is raised)
                except BaseException as exc:  # noqa: BLE001 -- raised after the other job is joined too
                    failed = failed or exc
    if failed is not None:
        raise failed


def _chunk_body(s: Slot, body, lay: str, dlay: str, xd, wd, yd, rd) -> None:
    """A chunk's device work on slot ``s``: x (and the residual) into the device layout, ``body``, y back."""
    xc = s.converted(xd, "xc", lay, dlay)
    rc = None if rd is None else s.converted(rd, "rc", lay, dlay)
    yc = yd if dlay == lay else s.device_array("yc", yd.shape, yd.dtype, dlay)
    body(xc, wd, yc, rc)
    if yc is not yd:
        transpose_kernel.copy(yd, yc, lay == "cl")


def _settle(s) -> tuple:
    """Wait for slot ``s``'s work, a Ctrl-C held back until it is done (a chunk cut short has copies in flight,
    into and out of its page-locked buffers): (whether the slot can be reused, the exception to raise or None)."""
    kept = []

    def wait():
        s.stream.synchronize()
        s.drain()
    try:
        return True, wait_through(wait, on_first=kept.append, held=KeyboardInterrupt)
    except BaseException as exc:  # noqa: BLE001 -- a slot that fails here is not reused
        return False, kept[0] if kept else exc


def hostmem_whole(a: np.ndarray):
    """The Pinning of page-locked memory blasx allocated (one region)."""
    from ..runtime import hostmem
    return hostmem.Pinning.whole(a.ctypes.data, a.ctypes.data + a.nbytes)


def chunk_geometry(geo, n: int):
    """The geometry of a chunk of ``n`` images."""
    return dataclasses.replace(geo, n=n)
