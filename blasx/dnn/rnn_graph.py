"""A layer-direction's CUDA step loop captured once per shape into a CUDA graph and replayed.

The loop (rnn_layer.forward_loop) is T recurrent GEMMs and T cell kernels; launched from Python each costs a few
microseconds of interpreter and launch time, more than the work itself at small sizes. A graph is keyed by
everything the loop's launches depend on (device, mode, shapes, dtypes, active rows per step, direction, math) and
owns the buffers its launches were captured with: a call writes its inputs there (a forward layer projects straight
into the entry's gx, ``run(fill=)``; the weights are copied in), replays the graph on the current stream and copies
the states out (in inference only h and the last cell state). A small input is copied into the entry instead, and
the weights' copies, its projection, the bias sum and zero first states replay from a second graph captured for the
parameters' addresses (``run(prologue=)``). The first call of a key runs the loop eagerly on those buffers (which
also compiles the kernels, so the capture allocates nothing) and then captures it; a capture that fails (another
thread's device-wide synchronisation invalidates it: its cudaDeviceSynchronize, or its end destroying its CuPy
cuBLAS handle) is tried again on the key's next calls, :data:`CAPTURE_TRIES` times in all, then the key stays eager
(``stats()`` says why). An entry belongs to one call at a time: a call takes an idle entry of its key (or makes
one) and gives it back with an event on its stream that the next taker's stream waits for, so concurrent calls of
one shape never share buffers. A training forward on x's device (``run(lease=True)``) copies out only S: its
Forward keeps the entry's cell states and gates, holding the entry until the Forward is collected (at most
:data:`MAX_LEASES` of a key at once), and the backward replays its own graph on that same entry's buffers (no
copies of the saved activations either way). Both runs issue their GEMMs through ctypes with the entry's own cuBLAS
workspace (rnn_layer.CudaOps.workspace): CuPy's cuBLAS wrappers refuse a capturing stream, and the graph keeps
using that workspace at every replay.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque

import numpy as np

from ..threadlocal import setting
from ..runtime.config import env_switch
from ..runtime.devices.cupy_streams import on_stream
from . import rnn_layer

MAX_GRAPHS = 16  # idle entries kept per process (least recently used dropped) ...
MAX_IDLE_BYTES = 8 << 30  # ... also while their buffers in all are over this (a sweep of large shapes)
MAX_LEASES = 2  # entries of one key out on lease at once (a training loop's current and previous saved state);
#                 more saved states alive copy their activations out as before (an entry holds more than they do)
# forward loops of float32 (IEEE) layers at most this small run their GEMMs without split-k: cuBLAS splits those
# skinny products and adds a reduction launch a step, which costs more than it saves there
NO_SPLIT_ROWS, NO_SPLIT_K = 16, 512
CAPTURE_TRIES = 3  # captures tried per loop part before it stays eager
PROLOGUES = 4  # prologue graphs an entry keeps (one per set of parameter addresses; hx given or not counts too)
# off: every thread's step loops launch from Python (a capture fails another thread's device-wide synchronisation)
ENABLED = env_switch("BLASX_RNN_GRAPHS")

_lock = threading.Lock()
_cache: OrderedDict = OrderedDict()  # key -> its idle entries
_returned: deque = deque()  # leased entries whose Forward was collected (appended by its finalizer, lock-free)
_leased: dict = {}  # key -> its entries out on lease
_draining: list = []  # dropped entries whose last user's work may still run: kept until their event is done
_stats = {"captured": 0, "replayed": 0, "eager": 0, "failures": 0, "failed": "", "leased": 0}


_local = threading.local()


def enabled() -> bool:
    """Whether this thread's recurrent calls replay graphs (:data:`ENABLED` by default; see :func:`eager`)."""
    return getattr(_local, "on", ENABLED)


def usable(xp) -> bool:
    """Whether a call on ``xp``'s current stream may replay entries: :func:`enabled` and that stream not capturing
    (inside a caller's capture, a network chunk's graph, the loop's launches are captured into it instead; an
    entry's events and graphs cannot cross into another capture)."""
    return enabled() and not xp.cuda.get_current_stream().is_capturing()


def eager():
    """``with rnn_graph.eager():`` runs this thread's CUDA step loops from Python, launch by launch (to compare
    or measure the per-step overhead a graph removes)."""
    return setting(_local, "on", False)


def stats() -> dict:
    """Counts of captures, replays, eager runs, failed captures and leases, and the last failure's message."""
    with _lock:
        return dict(_stats)


def held_bytes() -> int:
    """Bytes of the buffers that idle entries hold (the least recently used go past :data:`MAX_IDLE_BYTES`)."""
    with _lock:
        return sum(e.nbytes for idle in _cache.values() for e in idle)


def buffer_bytes(obj, _seen=None, _depth: int = 0) -> int:
    """Bytes of the distinct device arrays that ``obj`` holds: through its attributes (blasx objects), tuples,
    lists and dicts, a few levels down (an entry's buffers, its backward's, a Forward's)."""
    seen = set() if _seen is None else _seen
    if hasattr(obj, "nbytes") and hasattr(obj, "data") and hasattr(obj, "device"):
        base = obj.base if getattr(obj, "base", None) is not None else obj
        if id(base) in seen:
            return 0
        seen.add(id(base))
        return int(base.nbytes)
    if _depth > 4:
        return 0
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (tuple, list)):
        items = obj
    elif (type(obj).__module__ or "").startswith("blasx") and hasattr(obj, "__dict__"):
        items = vars(obj).values()
    else:
        return 0
    return sum(buffer_bytes(v, seen, _depth + 1) for v in items)


def clear() -> None:
    """Drops every idle entry (those out on lease come back when their Forward is collected)."""
    with _lock:
        _take_back()
        for idle in _cache.values():
            for e in idle:
                _drop(e)
        _cache.clear()


Like = rnn_layer.Like  # the shape and dtype of a buffer an entry holds, where the caller has no array of it


def _sig(a):
    return None if a is None else (tuple(a.shape), a.dtype)


def _like(xp, a, zeros: bool = False):
    """A buffer shaped as ``a`` (None for None); ``zeros``: zero-filled."""
    if a is None:
        return None
    return (xp.zeros if zeros else xp.empty)(a.shape, dtype=a.dtype)


def _forward_like(xp, st):
    """An entry's forward buffers shaped as ``st``'s; R zeroed (rows past a step's active ones are never written,
    and weight_hr's gradient reads them)."""
    return rnn_layer.Forward(_like(xp, st.S), _like(xp, st.C), _like(xp, st.gates), _like(xp, st.R, True))


class _Entry:
    """A key's buffers, cuBLAS workspace and graphs (one per part of the loop: a diagonal loop's chunks)."""

    def __init__(self, xp, parts: int = 1) -> None:
        from .cublas_call import device_workspace
        self.xp = xp
        self.workspace = device_workspace(xp, parts)  # parts: one default-sized piece per GEMM branch
        self.graphs: dict = {}
        self.ph: dict = {}  # part -> the placeholders its graph's launches point at (kept alive with the graph)
        self.fails: dict = {}  # part -> captures that failed
        self.key = None
        self.done = None  # event after the last call's work on the buffers (recorded when it gave the entry back)
        self.lock = threading.Lock()  # a leased entry's backward calls, one at a time
        self.backs: dict = {}  # a leased forward entry's backward buffers (:class:`_Back`) by backward key
        self.nbytes = 0  # its buffers' bytes (counted when it goes idle)


class Diag(_Entry):
    """A diagonal group's entry (rnn_diag.py): its buffers ``b`` (and, backward, the weights in F ``w``); a
    workspace piece per layer (CudaOps.gemm_layers)."""

    def __init__(self, xp, b, w=None) -> None:
        super().__init__(xp, 1 if b is None else b.O.shape[0])
        self.b, self.w = b, w


def diag_entry(key, make) -> Diag:
    """An idle entry of ``key`` (made by ``make()`` when there is none), the caller's until :func:`release`;
    its buffers are the caller's to fill."""
    return _entry(key, make)


def run_part(ops, e: _Entry, part, f, loop, use_graph: bool = True) -> None:
    """Part ``part`` of e's loop (``loop()`` on e's buffers): replayed from its graph, captured on first use."""
    _execute(ops, e, f, use_graph, loop, part)


class _Fwd(_Entry):
    def __init__(self, xp, gx, w_hh, w_hr, bias, st, gh, x=None) -> None:
        super().__init__(xp)
        self.gx, self.w_hh, self.w_hr, self.bias, self.gh = (_like(xp, a) for a in (gx, w_hh, w_hr, bias, gh))
        self.st = _forward_like(xp, st)
        self.x = _like(xp, x)  # the layer's input, copied in (a captured prologue projects it)
        self.moved = 0  # prologue graphs dropped for parameters at new addresses (see _prologue_part)


class _Back:
    """A backward loop's own buffers (weights, dy, results, scratch) over the forward buffers ``st`` it reads."""

    def __init__(self, ops, mode, st, w_hh, w_hr, dy, H) -> None:
        xp = ops.xp
        self.st = st
        self.w_hh, self.w_hr, self.dy = _like(xp, w_hh), _like(xp, w_hr), _like(xp, dy)
        self.bw, self.scratch = rnn_layer.backward_buffers(ops, mode, st, self.w_hh, H,
                                                           rnn_layer.compute_type(w_hh.dtype), None, None,
                                                           rnn_layer.half_of(w_hh))


class _Bwd(_Entry):
    def __init__(self, ops, mode, st, w_hh, w_hr, dy, H) -> None:
        super().__init__(ops.xp)
        self.back = _Back(ops, mode, _forward_like(ops.xp, st), w_hh, w_hr, dy, H)


def _entry(key, make) -> _Entry:
    """Takes an idle entry of ``key`` (or makes one); the current stream waits for its last user's work."""
    with _lock:
        _take_back()
        idle = _cache.get(key)
        e = idle.pop() if idle else None
    if e is None:
        e = make()
        e.key = key
    elif e.done is not None:
        e.xp.cuda.get_current_stream().wait_event(e.done)
    return e


def release(e: _Entry) -> None:
    """Gives ``e`` back (after the work queued on the current stream); least recently used idle entries beyond
    :data:`MAX_GRAPHS` are dropped."""
    e.done = e.xp.cuda.get_current_stream().record()
    with _lock:
        _take_back()
        _idle(e)


def _idle(e: _Entry) -> None:
    """(under _lock) ``e`` idle in the cache, the least recently used beyond :data:`MAX_GRAPHS` dropped."""
    e.nbytes = buffer_bytes(e)
    _cache.setdefault(e.key, []).append(e)
    _cache.move_to_end(e.key)
    count = sum(len(v) for v in _cache.values())
    held = sum(i.nbytes for v in _cache.values() for i in v)
    while count > MAX_GRAPHS or (count > 1 and held > MAX_IDLE_BYTES):
        key, idle = next(iter(_cache.items()))
        if not idle:  # (a key whose entries are all taken)
            del _cache[key]
            continue
        old = idle.pop(0)
        held -= old.nbytes
        count -= 1
        _drop(old)
        if not idle:
            del _cache[key]


def _drop(e) -> None:
    """(under _lock) ``e`` leaves the cache; its buffers are freed once its last user's work is done, checked
    now and at each later drop (freed at once they would go back to the stream that allocated them, free for its
    next allocation while another stream's last use may still run). ``None``: only the check."""
    if e is not None and e.done is not None:
        _draining.append(e)
    _draining[:] = [d for d in _draining if not d.done.done]


def _take_back() -> None:
    """(under _lock) Leased entries whose Forward was collected become idle; their ``done`` is their last user's."""
    while _returned:
        e = _returned.popleft()
        _leased[e.key] -= 1
        _idle(e)
    if _draining:
        _drop(None)


def _lend(e: _Entry) -> bool:
    """Whether ``e`` may go out on lease (fewer than :data:`MAX_LEASES` of its key are); counts it if so."""
    with _lock:
        _take_back()
        if _leased.get(e.key, 0) >= MAX_LEASES:
            return False
        _leased[e.key] = _leased.get(e.key, 0) + 1
        _stats["leased"] += 1
        return True


def touched(st) -> None:
    """The current stream's work so far reads a leased Forward's buffers: the entry's next user waits for it."""
    e = getattr(st, "lease", None)
    if e is not None:
        e.done = e.xp.cuda.get_current_stream().record()


def run(ops, mode, gx, w_hh, w_hr, bias, st, gh, bs, reverse: bool, *, fill, use_graph: bool = True,
        keep: bool = True, lease: bool = False, x=None, prologue=None, sources=None) -> None:
    """rnn_layer.forward_loop's effect on ``st``, through the graph of this shape (captured on first use).
    ``fill(e)`` writes the entry's inputs itself: ``e.gx`` (a projection straight into it, no copy), ``e.bias``,
    ``e.st.S[0]`` and ``e.st.C[0]``; ``gx``, ``bias`` and ``gh`` give only their shapes and dtypes (:class:`Like`
    or arrays). ``keep=False`` (inference): only ``st.S`` and ``st.C[T]`` are written back (gates, R and the other
    cell states are left as they were). ``lease`` (with keep): only ``st.S`` is written; ``st.C``, ``st.gates``
    and ``st.R`` become the entry's own, which ``st`` holds (``st.lease``) until it is collected; whoever reads
    them later on another call's stream calls :func:`touched` after.

    ``prologue(e)`` (with ``x``, the layer's input, and ``sources``, the addresses of the parameters it reads):
    what ``fill`` would do besides the first states given, on e's buffers through ``ops`` and allocating nothing:
    x is copied into ``e.x``, then the weights' copies and the prologue replay from a graph of their own, captured
    for those addresses (see :func:`_prologue_part`), so a small call issues two graph launches and a few
    copies."""
    xp = ops.xp
    key = ("fwd", xp.cuda.Device().id, mode, _sig(gx), _sig(w_hh), _sig(w_hr), _sig(bias), _sig(st.S), _sig(st.C),
           _sig(st.gates), _sig(st.R), tuple(bs), reverse, ops.math, _sig(x))
    e = _entry(key, lambda: _Fwd(xp, gx, w_hh, w_hr, bias, st, gh, x))
    leased = False
    try:
        def weights():
            for dst, src in ((e.w_hh, w_hh), (e.w_hr, w_hr)):
                if src is not None:
                    ops.copy(dst, src)
        if prologue is None:
            weights()
        else:
            e.x[...] = x
        fill(e)
        if prologue is not None:
            part, ok = _prologue_part(e, sources)
            _execute(ops, e, e.gx.dtype, use_graph and ok, lambda: (weights(), prologue(e)), part)
        _execute(ops, e, e.gx.dtype, use_graph,
                 lambda: rnn_layer.forward_loop(ops, mode, e.gx, e.w_hh, e.w_hr, e.bias, e.st, e.gh, bs, reverse),
                 split=split_k(ops, e.gx, w_hh))
        if keep and lease and _lend(e):
            try:
                st.S[...] = e.st.S
                st.C, st.gates, st.R, st.lease = e.st.C, e.st.gates, e.st.R, e
                touched(st)
                weakref.finalize(st, _returned.append, e)
            except BaseException:  # (Ctrl-C too) the entry goes back below, its lease uncounted
                with _lock:
                    _leased[e.key] -= 1
                raise
            leased = True
            return
        if lease:  # (no lease to be had: the caller's lean buffers made here, then copied into as below)
            st.C, st.gates, st.R = (_like(xp, a) for a in (st.C, st.gates, st.R))
        outs = ((st.S, e.st.S), (st.C, e.st.C), (st.gates, e.st.gates), (st.R, e.st.R)) if keep else (
            (st.S, e.st.S), (None if st.C is None else st.C[-1], None if st.C is None else e.st.C[-1]))
        for dst, src in outs:
            if dst is not None:
                dst[...] = src
    finally:
        if not leased:
            release(e)


def _prologue_part(e: _Fwd, sources) -> tuple:
    """(e's graph part of a prologue reading the parameters at ``sources``, whether it may replay or be captured):
    at most :data:`PROLOGUES` such graphs an entry, the oldest dropped for a new one :data:`CAPTURE_TRIES` times;
    after that, parameters at addresses without a graph run the prologue eagerly."""
    part = ("pro", sources)
    if part in e.graphs:
        return part, True
    pros = [p for p in e.graphs if isinstance(p, tuple) and p[0] == "pro"]  # (a leased entry's backward keys too)
    if len(pros) < PROLOGUES:
        return part, True
    if e.moved >= CAPTURE_TRIES:
        return part, False
    e.moved += 1
    del e.graphs[pros[0]]
    e.ph.pop(pros[0], None)
    return part, True


def split_k(ops, gx, w_hh) -> bool:
    """Whether a forward loop's GEMMs may split k (see NO_SPLIT_ROWS)."""
    return not (gx.dtype == np.float32 and ops.math == "ieee" and gx.shape[1] <= NO_SPLIT_ROWS
                and w_hh.shape[1] <= NO_SPLIT_K)


def run_eager(ops, mode, gx, w_hh, w_hr, bias, st, gh, bs, reverse: bool) -> None:
    """rnn_layer.forward_loop launched from Python with the GEMM settings of its graph (a workspace, split-k or
    not), so an eager run gives the bits a replay gives."""
    from .cublas_call import device_workspace
    xp = ops.xp
    old = ops.workspace, ops.split_k
    ops.workspace = device_workspace(xp)
    ops.split_k = split_k(ops, gx, w_hh)
    try:
        rnn_layer.forward_loop(ops, mode, gx, w_hh, w_hr, bias, st, gh, bs, reverse)
    finally:
        ops.workspace, ops.split_k = old


def run_backward(ops, mode, st, w_hh_f, w_hr_f, dy, dh_n, dc_n, bs, reverse: bool, H: int,
                 use_graph: bool = True, use=None):
    """rnn_layer.backward_loop's result through the graph of this shape (captured on first use); the arrays
    returned are the caller's own. ``use(bw)``: consumes the entry's own result buffers before the entry goes
    back (its GEMMs read them in place, no copies) and its return value is returned instead. A Forward leased
    from a forward entry (``run(lease=True)``) is read in place: the backward's graph and buffers are that
    entry's."""
    key = ("bwd", st.S.device.id, mode, _sig(st.S), _sig(st.C), _sig(st.gates), _sig(st.R), _sig(w_hh_f),
           _sig(w_hr_f), _sig(dy), tuple(bs), reverse, H, ops.math)
    e = getattr(st, "lease", None)
    if e is not None and use_graph:
        with e.lock:
            if e.done is not None:
                ops.xp.cuda.get_current_stream().wait_event(e.done)
            b = e.backs.get(key)
            if b is None:
                b = e.backs[key] = _Back(ops, mode, e.st, w_hh_f, w_hr_f, dy, H)
            try:
                return _backward(ops, mode, e, b, key, w_hh_f, w_hr_f, dy, dh_n, dc_n, bs, reverse, use)
            finally:
                touched(st)
    e = _entry(key, lambda: _Bwd(ops, mode, st, w_hh_f, w_hr_f, dy, H))
    try:
        b = e.back
        for dst, src in ((b.st.S, st.S), (b.st.C, st.C), (b.st.gates, st.gates), (b.st.R, st.R)):
            if src is not None:
                dst[...] = src
        return _backward(ops, mode, e, b, 0, w_hh_f, w_hr_f, dy, dh_n, dc_n, bs, reverse, use, use_graph)
    finally:
        release(e)


def _backward(ops, mode, e, b: _Back, part, w_hh_f, w_hr_f, dy, dh_n, dc_n, bs, reverse, use, use_graph=True):
    """run_backward on entry ``e``'s graph ``part`` over the buffers ``b`` (its forward states already there)."""
    for dst, src in ((b.w_hh, w_hh_f), (b.w_hr, w_hr_f), (b.dy, dy)):
        if src is not None:
            dst[...] = src
    bw = b.bw
    bw.dh[...] = 0 if dh_n is None else dh_n
    if bw.dc is not None:
        bw.dc[...] = 0 if dc_n is None else dc_n
    _execute(ops, e, w_hh_f.dtype, use_graph,
             lambda: rnn_layer.backward_steps(ops, mode, b.st, b.w_hh, b.w_hr, b.dy, bs, reverse, bw, b.scratch),
             part)
    if use is not None:
        return use(bw)

    def cp(a):
        return None if a is None else a.copy()
    dgx = cp(bw.dgx)
    return rnn_layer.Backward(dgx, dgx if bw.dgh is bw.dgx else cp(bw.dgh), cp(bw.dhs), bw.dh.copy(), cp(bw.dc),
                              cp(bw.g16), cp(bw.x16))


def _execute(ops, e: _Entry, f, use_graph: bool, loop, part=0, split: bool = True) -> None:
    """Replays e's graph of ``part``, or runs ``loop`` (on e's buffers) eagerly with e's workspace (``split``
    False: none, see NO_SPLIT_ROWS) and then, while fewer than CAPTURE_TRIES captures of it failed, captures it."""
    stream = ops.xp.cuda.get_current_stream()
    graph = e.graphs.get(part)
    if graph is not None and use_graph:
        graph.launch(stream)
        _count("replayed")
        return
    ph = ops.placeholder(f)  # made outside any capture
    old, ops.workspace = ops.workspace, e.workspace
    old_split, ops.split_k = getattr(ops, "split_k", True), split
    try:
        loop()
        _count("eager")
        if use_graph and e.fails.get(part, 0) < CAPTURE_TRIES:
            _capture(ops, e, loop, stream, ph, part)
    finally:
        ops.workspace = old
        ops.split_k = old_split


def _count(what: str, failure: str = "") -> None:
    with _lock:
        _stats[what] += 1
        if failure:
            _stats["failed"] = failure


def _capture(ops, e: _Entry, loop, stream, ph, part=0) -> None:
    """The loop captured on a side stream (ordered after ``stream``'s work); its first error kept in stats."""
    cap = ops.xp.cuda.Stream(non_blocking=True)
    cap.wait_event(stream.record())
    graph, err = None, None
    with on_stream(cap, ops.xp):
        cap.begin_capture()
        try:
            loop()
        except Exception as exc:  # noqa: BLE001 - the key stays eager; the reason is kept for stats()
            err = exc
        finally:  # (Ctrl-C too: the capture ends before it propagates)
            try:
                graph = cap.end_capture()
            except Exception as exc:  # noqa: BLE001 - as above (an invalidated capture ends with an error)
                err = err or exc
    if err is None:
        e.graphs[part], e.ph[part] = graph, (ph, dict(getattr(ops, "_ph", {})))  # (every type's: a cell's too)
        _count("captured")
    else:
        e.fails[part] = e.fails.get(part, 0) + 1
        _count("failures", f"{type(err).__name__}: {err}")
    stream.wait_event(cap.record())
