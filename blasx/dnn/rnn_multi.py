"""Executes a :class:`rnn_plan.Placement`: the step loops placed on each device.

Host arrays: one thread per device used (the threads stand for the sims or the CPU; all buffers in host memory).
CuPy arrays: the calling thread issues each device's work on that device's own stream (parameters and inputs
copied there, outputs copied back to x's device, the caller's streams ordered after it by events); batch splits
(their projections are engine calls, which block) keep a thread per device; a wavefront's time pieces are issued
from the calling thread in piece order. The devices' streams are kept per caller's stream (:func:`_stream`: the
arrays a job makes are freed after reads on that stream). A job's exception is re-raised in the caller once no
queued work touches a buffer.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from ..runtime.devices.cupy_streams import PER_THREAD, on_stream, stream_key
from ..tile import wide_class
from . import lanes, rnn_layer, rnn_plan
from .rnn_layer import compute_type

_last = threading.local()


def last_run() -> dict:
    """This thread's last forward placement: ``{"placement": Placement, "ran_on": {(layer, dir): device}}``, and
    after a backward of a non-diagonal stack ``"backward_on": {(layer, dir): device}`` and ``"weights_beside"``
    (how many layers' weight gradients went to a side stream, rnn_exec._side_weights)."""
    if not hasattr(_last, "run"):
        _last.run = {}
    return _last.run


@dataclasses.dataclass
class Kept:
    """One layer-direction's forward as training keeps it: the device its loop ran on, its input there (None
    without training) and its states (rnn_layer.Forward) there; ``local``: its backward's GEMMs stay on that
    device (not engine calls over every device)."""
    dev: object
    inp: object
    st: rnn_layer.Forward
    local: bool = False
    pieces: tuple = ()  # a wavefront layer's time pieces ((t0, t1), ...), which its backward may run in too
    lane: int = 0  # the wavefront's stream of ``dev`` that the layer ran on (rnn_plan.Placement.lanes)


def devices_for(pb) -> list:
    """Device labels the step loops may use: CUDA ordinals (x's first) for CuPy x, the engine's sims for host
    x, else one (None)."""
    from .. import session
    if pb.xp is not np:
        return cuda_devices(pb.x.device.id)
    sims = [d.index for d in session.engine().devices if getattr(d, "kind", "") == "sim"]
    return sims or [None]


def cuda_devices(home: int) -> list:
    """The CUDA ordinals a call on device ``home`` may use: ``home``, then the engine's other GPUs (as configured: the
    engine is not started for it, nor its tile cache, which takes most of a GPU's free memory)."""
    from .. import session
    return [home] + [o for o in session.cuda_ordinals() if o != home]


_streams: dict = {}  # (device, k, caller) -> the non-blocking stream of a pool's k-th job on that device
_callers: dict = {}  # the callers' streams (_caller) that have pool streams -> the stream (held: its handle kept)
_streams_lock = threading.Lock()
MAX_CALLERS = 64  # callers' streams given pool streams; a later caller's jobs run on its own stream


def _caller(xp) -> tuple:
    """The current device's current stream as a key: its handle (and the thread, for the per-thread stream)."""
    return stream_key(xp.cuda.get_current_stream().ptr)


def _stream(xp, dev, k: int, caller):
    """The non-blocking stream of ``dev`` for the k-th job forked from the caller's stream ``caller``
    (:func:`_caller`), kept for the process (never destroyed, so its handle is never another stream's); None
    past :data:`MAX_CALLERS`. One set per caller's stream: CuPy's pool gives a freed block back to the stream
    that allocated it, and a job's arrays are read on the caller's stream after the join, so only jobs ordered
    after that stream (forked from it again) may have them next."""
    with _streams_lock:
        key = (dev, k, caller)
        if key not in _streams:
            if caller not in _callers:
                if len(_callers) >= MAX_CALLERS:
                    return None
                cur = xp.cuda.get_current_stream()
                _callers[caller] = cur if cur.ptr == caller[0] else None
            _streams[key] = xp.cuda.Stream(non_blocking=True)
        return _streams[key]


class _Threads:
    """Runs callables on lanes (lanes.py: long-lived threads), each inside its device's context: ``start`` adds one,
    ``join`` runs them all (a Ctrl-C held while they start) and waits; re-raises the first failure.

    CuPy: each thread issues its work on its own non-blocking stream, ordered after what the caller had queued
    on ``devs`` (events recorded at construction), so loops on different devices never meet in a legacy default
    stream or behind another thread's synchronising call; each job synchronises its stream before it ends."""

    def __init__(self, pb, devs=()) -> None:
        self.pb = pb
        self.errors: list = []
        self.jobs: list = []  # the callables start() added, run by join()
        self.ready: list = []
        self.count: dict = {}
        if pb.xp is not np:
            for d in dict.fromkeys(devs):
                with pb.xp.cuda.Device(d):
                    self.ready.append(pb.xp.cuda.get_current_stream().record())

    def start(self, dev, fn, *args) -> None:
        xp = self.pb.xp
        k = self.count[dev] = self.count.get(dev, -1) + 1
        st = None
        if xp is not np:  # past MAX_CALLERS the caller's stream (for the per-thread one, which is another stream in
            with xp.cuda.Device(dev):  # the job's thread, the legacy stream, which it is ordered with)
                cur = xp.cuda.get_current_stream()
                st = _stream(xp, dev, k, _caller(xp)) or (xp.cuda.Stream.null if cur.ptr in PER_THREAD else cur)

        def body():
            try:
                if xp is not np:
                    with xp.cuda.Device(dev):
                        for ev in self.ready:
                            st.wait_event(ev)
                        with on_stream(st):
                            fn(*args)
                        st.synchronize()
                else:
                    fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller in join()
                self.errors.append(exc)
        self.jobs.append(body)

    def join(self, prefer=None) -> None:
        """Runs the started callables, each on a lane, and waits for them all; re-raises the first error (the first
        one ``prefer`` accepts, if any)."""
        lanes.run_all(self.jobs)  # (a Ctrl-C waits for the loops, which run to their end)
        if self.errors:
            raise next((e for e in self.errors if prefer is None or prefer(e)), self.errors[0])


class _Issued:
    """:class:`_Threads`' interface for CuPy work that only issues (loops replayed from graphs, local GEMMs, copies):
    each job is issued at once from the calling thread on its device's pool stream (the caller's stream's,
    :func:`_stream`), ordered after what the caller had queued on ``devs``; ``join()`` orders the caller's
    streams on ``devs`` after every job. The devices run their jobs side by side without a thread each (threads
    fought over the GIL and each ended in a synchronize).
    A job's error synchronises every stream used so far, then is raised: no queued work then touches a buffer."""

    def __init__(self, pb, devs=()) -> None:
        self.xp = pb.xp
        self.devs = list(dict.fromkeys(devs))
        self.count: dict = {}
        self.done: list = []
        self.used: list = []
        self.ready = []
        cur = self.xp.cuda.get_current_stream()
        # inside a capture every device's work forks from, and joins back into, the capturing stream (work ordered
        # after another stream would run outside the graph)
        self.capture = cur if cur.is_capturing() else None
        if self.capture is not None:
            self.ready.append(cur.record())
            return
        for d in self.devs:
            with self.xp.cuda.Device(d):
                self.ready.append(self.xp.cuda.get_current_stream().record())

    def start(self, dev, fn, *args) -> None:
        xp = self.xp
        k = self.count[dev] = self.count.get(dev, -1) + 1
        with xp.cuda.Device(dev):
            # (a capture takes in every launch onto its streams, another thread's too: this thread's own then)
            if self.capture is None:  # (past MAX_CALLERS the caller's own stream: the jobs one after another)
                st = _stream(xp, dev, k, _caller(xp)) or xp.cuda.get_current_stream()
            else:
                st = rnn_layer._side_stream(dev, ("issued", k))
                if k and rnn_layer.capturing_whole_call():  # (beside the device's first job in the graph: a cuBLAS
                    with on_stream(st):  # workspace of its own, as fork_streams gives a lane)
                        rnn_layer.lane_workspace(st)
            self.used.append(st)
            for ev in self.ready:
                st.wait_event(ev)
            try:
                with on_stream(st):
                    fn(*args)
            except BaseException:
                for s in self.used if self.capture is None else ():  # (a capture ran nothing)
                    s.synchronize()
                raise
            self.done.append(st.record())

    def join(self, prefer=None) -> None:
        if self.capture is not None:
            for ev in self.done:
                self.capture.wait_event(ev)
            return
        for d in self.devs:
            with self.xp.cuda.Device(d):
                cur = self.xp.cuda.get_current_stream()
                for ev in self.done:
                    cur.wait_event(ev)


def _pool(pb, devs):
    """The runner of per-device jobs: issued from this thread for CuPy, threads for host arrays (sims)."""
    return _Threads(pb, devs) if pb.xp is np else _Issued(pb, devs)


def _local(pb, dev, home, only=None):
    """pb with its parameters and initial states on ``dev`` (CuPy: copies when dev is not x's device); ``only``: the
    (layer, direction) pairs whose parameters the caller reads (the others are left where they are)."""
    if pb.xp is np or dev == home:
        return pb
    spec = pb.spec

    def moved(c, at):
        if only is not None and at not in only:
            return c
        return dataclasses.replace(c, **{k: (None if getattr(c, k) is None else _here(pb.xp, getattr(c, k)))
                                         for k in ("w_ih", "w_hh", "b_ih", "b_hh", "w_hr")})
    cells = tuple(tuple(moved(c, (layer, d)) for d, c in enumerate(row)) for layer, row in enumerate(spec.cells))
    return dataclasses.replace(pb, spec=dataclasses.replace(spec, cells=cells),
                               h0=None if pb.h0 is None else _here(pb.xp, pb.h0),
                               c0=None if pb.c0 is None else _here(pb.xp, pb.c0))


def _here(xp, a):
    """``a`` on the current device (a copy when it lives elsewhere; inside a capture one cudaMemcpyAsync, which
    a capture takes in where CuPy's peer copy is refused)."""
    if xp is np or a.device.id == xp.cuda.Device().id:
        return a
    stream = xp.cuda.get_current_stream()
    if not stream.is_capturing():
        return a.copy()
    if not a.flags.c_contiguous:
        raise rnn_layer.NotCapturable(f"a strided copy between devices (shape {a.shape}, strides {a.strides})")
    out = xp.empty(a.shape, dtype=a.dtype)
    if a.nbytes:
        xp.cuda.runtime.memcpyAsync(out.data.ptr, a.data.ptr, a.nbytes, 4, stream.ptr)  # 4: cudaMemcpyDefault
    return out


def at(xp, a, dev):
    """``a`` on device ``dev`` (a copy there, on dev's current stream, when it lives elsewhere)."""
    if xp is np or a.device.id == dev:
        return a
    with xp.cuda.Device(dev):
        return _here(xp, a)


def placement(pb, training: bool = True):
    """(the plan of ``pb``'s stack, the device labels it indexes), recorded for :func:`last_run`."""
    spec = pb.spec
    T, B = pb.x.shape[:2]
    devs = devices_for(pb)
    pl = rnn_plan.plan(spec.num_layers, spec.num_dirs, B, T, len(devs), projection=bool(spec.proj_size),
                       wide=wide_class(pb.x.dtype, pb.math), training=training,
                       captured=rnn_layer.capturing_whole_call(), hidden=spec.hidden_size)
    _last.run = {"placement": pl, "ran_on": {}}
    return pl, devs


def local_mm(xp, f, math: str = "ieee"):
    """A GEMM on the calling thread's device and stream (CuPy), its result in F: a direction's own projections,
    so no thread waits on an engine call that spans the other devices, and with one device no engine round trip
    at all. C- or F-contiguous operands of one type go to cublasGemmEx as they are (half inputs, float32 result;
    TF32 where ``math`` says), others through a cast to F and CuPy's matmul. ``out``: a C-contiguous F array
    to write (the GEMM writes it directly)."""
    from .rnn_layer import CudaOps
    ops = CudaOps(math)

    def mm(a, b, out_dtype=None, out=None):
        if a.dtype == b.dtype and all(x.flags.c_contiguous or x.flags.f_contiguous for x in (a, b)):
            out = xp.empty((a.shape[0], b.shape[1]), dtype=f) if out is None else out
            ops.matmul(a, b, out)
            return out
        y = xp.matmul(a if a.dtype == f else a.astype(f), b if b.dtype == f else b.astype(f))
        if out is None:
            return y
        out[...] = y
        return out
    return mm


def run_forward(pb, pl, devs, direction_forward, direction_output, keep: bool = True):
    """(:class:`Kept` of every layer-direction (``[layer][d]``), the last layer's y), per the plan; on CuPy each
    thread projects its own direction's input on its device. Directions on two devices: in training each
    direction's states and input stay on its device (backward runs there, :func:`run_backward`) and only S comes
    home for y; ``keep=False``: only S and the last cell state come home."""
    from .rnn_exec import ops_for
    xp, spec = pb.xp, pb.spec
    ran_on = _last.run["ran_on"]
    home = devs[0]
    if pl.kind == "wavefront":
        return _wavefront(pb, pl, devs, ran_on, direction_forward, keep)
    mm = None if xp is np else local_mm(xp, compute_type(pb.x.dtype), pb.math)
    alone = len(devs) == 1 or pl.local  # one device (or kept on one): projections local, no engine round trip
    layers, inp = [], pb.x
    for layer in range(spec.num_layers):
        states = [None] * spec.num_dirs
        if pl.kind == "batch":
            states[0] = _batch_split(pb, pl, devs, layer, inp, direction_forward, ran_on, keep)
            kept = [Kept(home, inp if keep else None, states[0])]
        else:
            used = [devs[pl.cells[layer][d]] for d in range(spec.num_dirs)]
            inputs = [None] * spec.num_dirs
            inline = xp is not np and used == [home]  # one direction on x's device: the caller's thread and stream
            lease = xp is not np and set(used) == {home}  # saved states left in their graph entries (rnn_graph.run)

            def one(d, dev, inp=inp, layer=layer, states=states, inputs=inputs, lease=lease):
                lp = _local(pb, dev, home, only=((layer, d),))
                inputs[d] = _here(xp, inp)
                states[d] = direction_forward(lp, ops_for(xp, pb.math), layer, d, inputs[d],
                                              mm if len(set(used)) > 1 or alone else None, lease=lease)
                ran_on[(layer, d)] = dev
            if inline:
                with xp.cuda.Device(home):
                    one(0, home)
            else:
                pool = _pool(pb, used)
                for d in range(spec.num_dirs):
                    pool.start(used[d], one, d, used[d])
                pool.join()
            if keep:
                kept = [Kept(used[d], inputs[d], states[d], alone) for d in range(spec.num_dirs)]
                states = [_home_s(xp, st, home) for st in states]
            else:
                states = [_home(xp, st, home, keep) for st in states]
                kept = [Kept(home, None, st, alone) for st in states]
        layers.append(kept)
        inp = _layer_output(pb, states, direction_output, keep)
    return layers, inp


def _home_s(xp, st, home):
    """A Forward holding only ``st``'s S on the home device (what the layer's output needs)."""
    if xp is np or st.S.device.id == home:
        return st
    return rnn_layer.Forward(at(xp, st.S, home), None, None, None)


def run_backward(pb, layer: int, kept, direction_backward) -> list:
    """``direction_backward(lp, ops, d, kept[d], mm)`` of each direction of ``layer``, on the device its forward
    ran on (``kept[d].dev``): at once on threads when those differ (each on its device and stream, ``lp`` with
    the parameters there, ``mm`` a GEMM on that device), else in order on the caller's. Returns the results by
    direction; each direction's device goes to ``last_run()["backward_on"]``."""
    from .rnn_exec import ops_for
    xp = pb.xp
    devs = [k.dev for k in kept]
    home = None if xp is np else pb.x.device.id
    on = last_run().setdefault("backward_on", {})
    out = [None] * len(kept)
    mm = None if xp is np else local_mm(xp, compute_type(pb.x.dtype), pb.math)
    if len(set(devs)) == 1 and (xp is np or devs[0] == home):
        # no other device the engine could spread the GEMMs over, or the forward kept them local
        alone = len(devices_for(pb)) == 1 or all(k.local for k in kept)
        for d, k in enumerate(kept):
            out[d] = direction_backward(pb, ops_for(xp, pb.math), d, k,
                                        mm if alone or rnn_layer.capturing_whole_call() else None)
            on[(layer, d)] = k.dev
        return out

    def one(d, k):
        out[d] = direction_backward(_local(pb, k.dev, home, only=((layer, d),)), ops_for(xp, pb.math), d, k, mm)
        on[(layer, d)] = k.dev
    pool = _pool(pb, devs if xp is np else devs + [home])  # (CuPy: ordered after, and home after, x's stream)
    for d, k in enumerate(kept):
        pool.start(k.dev, one, d, k)
    pool.join()
    return out


def _home(xp, st, home, keep: bool = True):
    """``st`` on the home device; without keep only S and, as C, the last cell state (1, B, H) (the rest is
    unwritten)."""
    if not keep:
        st = rnn_layer.Forward(st.S, None if st.C is None else st.C[-1:], None, None)
    if xp is np or st.S.device.id == home:
        return st
    with xp.cuda.Device(home):
        return rnn_layer.Forward(*(None if a is None else a.copy() for a in (st.S, st.C, st.gates, st.R)))


def _layer_output(pb, states, direction_output, keep: bool = True):
    """The layer's y (T, B, D*out): the directions' outputs side by side; one forward direction without lengths in
    inference is a view of its S, which nothing else keeps."""
    out = pb.spec.out_size
    T, B = pb.x.shape[:2]
    if not keep and len(states) == 1 and pb.lengths is None:
        return direction_output(pb, states[0], False)
    y = pb.xp.empty((T, B, len(states) * out), dtype=pb.x.dtype)
    for d, st in enumerate(states):
        y[..., d * out:(d + 1) * out] = direction_output(pb, st, d == 1)
    return y


def _sub_problem(pb, lo: int, hi: int):
    bs = tuple(max(0, min(a, hi) - lo) for a in pb.bs)
    return dataclasses.replace(pb, x=pb.x[:, lo:hi], h0=None if pb.h0 is None else pb.h0[:, lo:hi],
                               c0=None if pb.c0 is None else pb.c0[:, lo:hi], bs=bs,
                               lengths=None if pb.lengths is None else pb.lengths[lo:hi])


def _batch_split(pb, pl, devs, layer, inp, direction_forward, ran_on, keep: bool = True):
    """One unidirectional layer over contiguous batch ranges, one per device; the states stitched together
    (``keep=False``: S and the last cell state only)."""
    from .rnn_exec import ops_for
    xp, home = pb.xp, devs[0]
    parts = [None] * pl.devices

    def one(i, dev):
        lo, hi = pl.rows[i]
        lp = _local(_sub_problem(pb, lo, hi), dev, home)
        parts[i] = direction_forward(lp, ops_for(xp, pb.math), layer, 0, _here(xp, inp[:, lo:hi]))
    pool = _Threads(pb, devs[:pl.devices])
    for i in range(pl.devices):
        pool.start(devs[i], one, i, devs[i])
    pool.join()
    ran_on[(layer, 0)] = tuple(devs[:pl.devices])
    parts = [_home(xp, st, home, keep) for st in parts]

    def cat(name):
        arrs = [getattr(st, name) for st in parts]
        return None if arrs[0] is None else xp.concatenate(arrs, axis=1)
    return rnn_layer.Forward(cat("S"), cat("C"), cat("gates"), cat("R"))


def _wavefront(pb, pl, devs, ran_on, direction_forward, keep: bool):
    """A unidirectional stack as a wavefront over pieces of time: the layers in contiguous groups (group g on device
    g), each layer's loop cut into pieces of ``pl.chunk`` steps, each piece a one-layer loop (replayed from its graph
    on CUDA) from the states the piece before left; layer l's piece p is issued once layer l-1's piece p is, so group
    g works on piece p while group g+1 works on piece p-1. Pieces write views of their layer's whole buffers on its
    device, so nothing is stitched after. CuPy: issued from this thread, one pool stream a device, events where a
    piece's input comes from another device; host arrays: in order on this thread."""
    from .rnn_exec import ops_for
    xp, spec = pb.xp, pb.spec
    T, B = pb.x.shape[:2]
    home, cuda = devs[0], xp is not np
    store, f = pb.x.dtype, compute_type(pb.x.dtype)
    pieces = [(t0, min(T, t0 + pl.chunk)) for t0 in range(0, T, pl.chunk)]
    on = [devs[pl.cells[layer][0]] for layer in range(spec.num_layers)]
    lanes = [(pl.lanes[layer] if pl.lanes else 0, on[layer]) for layer in range(spec.num_layers)]
    streams, cap = fork_streams(xp, list(dict.fromkeys(lanes)), "wave") if cuda else ({}, None)
    mm = local_mm(xp, f, pb.math) if cuda else None
    gates = keep or not cuda or not pb.graphs  # (an eager loop writes them even in inference)
    lps, sts, inps, events = [], [], [], {}

    def setup(layer, dev):
        lp = _local(pb, dev, home, only=((layer, 0),))
        st = rnn_layer.forward_buffers(xp, spec.mode, T, B, spec.hidden_size, spec.out_size, bool(spec.proj_size),
                                       store, f, gates=gates)
        if layer == 0:
            inp = _here(xp, pb.x)
        elif on[layer - 1] == dev:
            inp = sts[layer - 1].S[1:]
        else:
            inp = xp.empty((T, B, spec.out_size), dtype=store)
        return lp, st, inp

    def piece(layer, p, t0, t1):
        dev, lp, st, inp = on[layer], lps[layer], sts[layer], inps[layer]
        if layer and lanes[layer - 1] != lanes[layer] and cuda:
            streams[lanes[layer]].wait_event(events[(layer - 1, p)])
        if layer and on[layer - 1] != dev:
            inp[t0:t1] = _here(xp, sts[layer - 1].S[t0 + 1:t1 + 1])
        view = piece_view(st, t0, t1)
        # the piece's h0[k] and c0[k]: the call's for the first, else the states the piece before left
        h0 = lp.h0 if p == 0 else {layer: st.S[t0]}
        c0 = lp.c0 if p == 0 else (None if st.C is None else {layer: st.C[t0]})
        sub = dataclasses.replace(lp, x=inp[t0:t1], bs=tuple(pb.bs[t0:t1]), lengths=None, h0=h0, c0=c0)
        direction_forward(sub, ops_for(xp, pb.math), layer, 0, inp[t0:t1], mm=mm, into=view)
        if cuda and layer + 1 < spec.num_layers and lanes[layer + 1] != lanes[layer]:
            events[(layer, p)] = streams[lanes[layer]].record()

    try:
        for layer, dev in enumerate(on):
            lp, st, inp = issue_on(xp, streams, lanes[layer], lambda layer=layer, dev=dev: setup(layer, dev))
            lps.append(lp)
            sts.append(st)
            inps.append(inp)
            ran_on[(layer, 0)] = dev
        for p, (t0, t1) in enumerate(pieces):
            for layer, dev in enumerate(on):
                issue_on(xp, streams, lanes[layer], lambda layer=layer: piece(layer, p, t0, t1))
    except BaseException:
        for st in streams.values() if cap is None else ():  # (a capture ran nothing)
            st.synchronize()
        raise
    if cuda:
        join_streams(xp, streams, cap)
    from .rnn_exec import direction_output
    y = _layer_output(pb, [_home_s(xp, sts[-1], home)], direction_output, keep)
    return [[Kept(on[layer], inps[layer] if keep else None, sts[layer], True, tuple(pieces), lanes[layer][0])]
            for layer in range(spec.num_layers)], y


def piece_view(st, t0: int, t1: int):
    """The Forward of steps t0..t1-1 as views of a whole layer's (S and C with the state before t0)."""
    return rnn_layer.Forward(*(None if a is None else a[t0:t1 + (i < 2)]
                               for i, a in enumerate((st.S, st.C, st.gates, st.R))))


def issue_on(xp, streams, lane, fn):
    """``fn()`` with ``lane``'s device and stream of ``streams`` current (CuPy), or as it is (host arrays)."""
    if xp is np:
        return fn()
    with xp.cuda.Device(lane[1]), on_stream(streams[lane]):
        return fn()


def fork_streams(xp, used, key):
    """(a stream per lane (index, device) of ``used``, the capture under way or None): pool streams after every
    device's current work; inside a capture this thread's side streams ``key``, forked from it (as _Issued), the
    second and later lanes of a device each with a cuBLAS workspace of its own (rnn_layer.lane_workspace)."""
    cap = xp.cuda.get_current_stream()
    cap = cap if cap.is_capturing() else None
    streams, ready, forked = {}, [], set()
    for lane in used:
        i, dev = lane
        with xp.cuda.Device(dev):
            if cap is None:  # (past MAX_CALLERS the caller's own stream)
                streams[lane] = _stream(xp, dev, i, _caller(xp)) or xp.cuda.get_current_stream()
            else:
                streams[lane] = rnn_layer._side_stream(dev, (key, i))
            if cap is None and dev not in forked:  # (each device's current work once)
                forked.add(dev)
                ready.append(xp.cuda.get_current_stream().record())
            if cap is not None and i:
                with on_stream(streams[lane]):
                    rnn_layer.lane_workspace(streams[lane])
    if cap is not None:
        ready.append(cap.record())
    for st in streams.values():
        for ev in ready:
            st.wait_event(ev)
    return streams, cap


def join_streams(xp, streams, cap) -> None:
    """The capture (or every device's current stream) ordered after each of ``streams``."""
    done = []
    for (_, dev), st in streams.items():
        with xp.cuda.Device(dev):
            done.append(st.record())
    if cap is not None:
        for ev in done:
            cap.wait_event(ev)
        return
    for dev in dict.fromkeys(d for _, d in streams):
        with xp.cuda.Device(dev):
            for ev in done:
                xp.cuda.get_current_stream().wait_event(ev)
