"""A repeated recurrent call on CuPy arrays replayed from one CUDA graph of the whole forward.

A recurrent call issues tens to hundreds of launches (projections, step loops or their graphs, copies between
GPUs, final states) from Python, and at small sizes, or with layers spread over GPUs, the host's issue time
sets the call's time. A call signature (:func:`signature`: mode, the params mapping, x's shape and type and GPU,
hx's, the flags, training or not, the math mode and the caller's stream) gets an entry on its first call; from
its second the forward is captured into a graph (a *slot*) on a stream of its own, over every GPU it uses,
reading the slot's copies of x and hx and writing outputs and activations the graph owns; a call then copies x
and hx in, launches the graph on the caller's stream and copies the outputs out (fresh arrays, as the general
path returns). An inference entry has one slot. A training call returns a saved state that reads its slot's
activations (and x) in place, so its slot is leased until that state is collected: an entry has up to
:data:`MAX_LEASES` slots (a training loop holds the previous step's state while it calls the next forward);
with every slot out the call takes the general path. The backward reads the slot's buffers, by the general path
or, from a slot's second backward of one gradients' signature, from a graph of its own (rnn_replay_backward.py);
:func:`touched` after it: the slot's next replay waits for those reads, on whichever stream they ran.

Invariants:
- a graph reads only its slot's x and hx buffers, the parameters' arrays (held by the entry's Spec, which
  rnn_params.parse returns again only for the same arrays unchanged) and memory of its own pool and workspaces;
  each call checks the Spec, the math mode, the configured GPUs and the device before replaying (else the general
  path);
- nothing of a captured call runs outside its graph: engine GEMMs and uncaptured streams refuse or fail the
  capture (rnn_layer.whole_call_capture, rnn_multi._Issued), and a slot is kept only after its graph, run on
  another input (x negated), matched the general path's outputs there (:data:`CHECK_TOL`) and, for training,
  the backward from its activations matched the backward from the general path's;
- one call at a time uses a slot's buffers: inference calls take its lock around copy-in, launch and copy-out,
  and the next caller's stream waits for the last one's event; a training slot is leased to one saved state.

Policy: the first call of a signature runs the general path; the second captures; a capture that fails or does
not match is tried again on later calls, :data:`TRIES` in all, then the signature stays on the general path
(``stats()`` says why). At most :data:`MAX_ENTRIES` signatures and :data:`MAX_BYTES` of graph memory (pools,
workspaces, input buffers) are kept, the least recently used dropped first once its last replay has finished
(a leased slot's memory lives on with its saved state); a signature whose graphs alone would pass
:data:`MAX_BYTES` stays on the general path. A dropped slot's or failed capture's private pool is retired: its
blocks go back to the GPU once nothing uses them (a pool let go with its blocks split among arrays would keep
them for good). ``BLASX_RNN_REPLAY=0`` turns the path off.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import OrderedDict

import numpy as np

from ..runtime.config import env_switch

ENABLED = env_switch("BLASX_RNN_REPLAY")
TRIES = 3  # failed captures per signature after which it stays on the general path
MAX_LEASES = 2  # slots of a training signature (saved states alive at once that replay)
MAX_ENTRIES = 16  # signatures kept (their graphs and buffers); the least recently used dropped ...
MAX_BYTES = 4 << 30  # ... also while the graphs' memory in all is over this
CHECK_TOL = {np.dtype(np.float16): 3e-2, np.dtype(np.float32): 1e-3, np.dtype(np.float64): 1e-9}

_lock = threading.Lock()
_entries: OrderedDict = OrderedDict()  # key -> _Entry, least recently used first
_retired: list = []  # pools of dropped slots and failed captures whose blocks are not all handed back yet
_stats = {"captured": 0, "replayed": 0, "failures": 0, "failed": "", "backward_captured": 0, "backward_replayed": 0}


def stats() -> dict:
    """Counts of captures, replays and failed captures, and the last failure's message."""
    with _lock:
        return dict(_stats)


def held_bytes() -> int:
    """Bytes of the kept entries' graph memory (pools, workspaces, input buffers) and of dropped slots' pools
    that saved states still read."""
    _sweep()
    with _lock:
        return sum(e.nbytes for e in _entries.values()) + sum(_pool_bytes(*p) for p in _retired)


def clear() -> None:
    """Drops every entry (their graphs, pools and buffers) once its last replay has finished."""
    with _lock:
        gone = list(_entries.values())
        _entries.clear()
    for e in gone:
        _drop(e)
    _sweep()


def _pool_bytes(pool, devices) -> int:
    """A private pool's bytes on ``devices`` (CuPy's pool counts the current device's alone)."""
    import cupy
    total = 0
    for d in devices:
        with cupy.cuda.Device(d):
            total += pool.total_bytes()
    return total


def _retire(pool, devices) -> None:
    """``pool`` is no slot's any more: its blocks are handed back by :func:`_sweep` once nothing uses them (CuPy
    frees a pool's blocks only when asked, and a pool let go with blocks split among arrays never frees them)."""
    with _lock:
        _retired.append((pool, tuple(devices)))


def _sweep() -> None:
    """Hands the retired pools' unused blocks back to the GPU; a pool goes once it holds nothing."""
    import cupy
    with _lock:
        pools = list(_retired)
    done = []
    for item in pools:
        pool, devices = item
        for d in devices:
            with cupy.cuda.Device(d):
                pool.free_all_blocks()
        if _pool_bytes(pool, devices) == 0:
            done.append(item)
    with _lock:
        _retired[:] = [p for p in _retired if not any(p is q for q in done)]


def _sig(a):
    return None if a is None else (tuple(a.shape), a.dtype.str, type(a).__module__.split(".")[0])


def signature(mode, x, hx, params, num_layers, bidirectional, batch_first, lengths, proj_size, training, math):
    """The entry's key of a call, or None where this path never applies (host x, off, or a capture of the
    caller's under way)."""
    if not ENABLED or type(x).__module__.split(".")[0] != "cupy" or not (
            lengths is None or isinstance(lengths, (list, tuple))):
        return None
    import cupy
    stream = cupy.cuda.get_current_stream()
    if stream.is_capturing():
        return None
    hs = tuple(_sig(h) for h in hx) if isinstance(hx, (tuple, list)) else _sig(hx)
    return (mode, id(params), tuple(x.shape), x.dtype.str, x.device.id, int(num_layers), bool(bidirectional),
            bool(batch_first), None if lengths is None else tuple(int(v) for v in lengths), int(proj_size), hs, math,
            stream.ptr, bool(training))


class _Slot:
    """One captured graph with the buffers it reads and writes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.graph = self.out = self.saved = self.x = self.hx = self.done = None
        self.keep: list = []  # the graph's pool, workspaces and stream
        self.nbytes = 0
        self.devices: list = []  # the GPUs its pool may hold memory on
        self.leased = False  # a training call's saved state reads this slot's buffers (set and cleared atomically)
        self.reads: list = []  # events after backwards that read the slot's buffers (the next replay waits for them)
        self.backs: dict = {}  # gradients' signature -> its captured backward (rnn_replay_backward._Back)
        self.back_seen: dict = {}  # gradients' signature -> backward calls of it seen
        self.back_fails: dict = {}  # gradients' signature -> its failed backward captures


class _Entry:
    def __init__(self, spec, gpus: tuple, math, training: bool) -> None:
        self.lock = threading.Lock()  # one capture at a time
        self.spec, self.gpus, self.math, self.training = spec, gpus, math, training  # gpus: session.cuda_ordinals()
        self.seen = 0  # general-path calls before the first capture
        self.fails = 0
        self.slots: list = []
        self.run = None  # rnn_multi.last_run() of the captured call

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


def _drop(e: _Entry) -> None:
    """Frees e's graphs and memory after the GPU is done with them (each slot's last replay); a leased slot's
    memory stays with its saved state."""
    for s in e.slots:
        with s.lock:
            for ev in [s.done, *s.reads, *(b.done for b in s.backs.values())]:  # (reads: backwards elsewhere)
                if ev is not None:
                    ev.synchronize()
            s.graph = s.out = s.saved = s.x = s.hx = s.done = None
            for pool in ([s.keep[0]] if s.keep else []) + [b.keep[0] for b in s.backs.values()]:
                _retire(pool, s.devices)
            s.keep, s.nbytes, s.backs = [], 0, {}


def _admit(key, e: _Entry) -> None:
    """``e`` under ``key``, most recently used; the least recently used others dropped while over the bounds."""
    gone = []
    with _lock:
        old = _entries.pop(key, None)
        if old is not None and old is not e:
            gone.append(old)
        _entries[key] = e
        while len(_entries) > MAX_ENTRIES or (len(_entries) > 1 and
                                              sum(v.nbytes for v in _entries.values()) > MAX_BYTES):
            gone.append(_entries.popitem(last=False)[1])
    for g in gone:
        _drop(g)
    if gone:
        _sweep()


def call(key, x, hx, params, general, backward=None):
    """The call's result from a graph, or None (the general path runs it). ``general(x, hx)``: the general path
    on other arrays (for the capture and its check); ``backward(saved, grad_y)`` (training): the general
    backward, for the check."""
    import cupy

    from .. import precision, session
    with _lock:
        e = _entries.get(key)
        if e is not None:
            _entries.move_to_end(key)
    spec = _spec(key, x, params)
    if spec is None or cupy.cuda.runtime.getDevice() != x.device.id:
        return None
    math = precision.check_math(key[11])
    gpus = session.cuda_ordinals()  # (not the engine: a call that needs none must not start it, nor its cache)
    if e is None or e.spec is not spec or e.gpus != gpus or e.math != math:
        e = _Entry(spec, gpus, math, key[13])
        _admit(key, e)
    slot = _take(e)
    if slot is None:
        if len(e.slots) >= (MAX_LEASES if e.training else 1) or e.seen == 0 or e.fails >= TRIES:
            e.seen += 1
            return None
        with e.lock:
            slot = _capture(e, x, hx, params, general, backward)
        if slot is None:
            _sweep()  # (the failed capture's pool, its arrays gone with its frames)
            return None
        _admit(key, e)  # (its memory counted now)
    try:
        return _replay(e, slot, x, hx)
    except BaseException:  # (out of memory copying out, an interrupt): no saved state holds the slot
        slot.leased = False
        raise


def _take(e: _Entry):
    """A slot of e ready to replay (training: one not on lease, leased now), or None."""
    with _lock:
        for s in e.slots:
            if s.graph is not None and not s.leased:
                s.leased = e.training
                return s
    return None


def _give_back(slot: _Slot) -> None:
    slot.leased = False  # (a finalizer: no lock taken)


def touched(saved) -> None:
    """The current stream's work so far read ``saved``'s buffers (its backward): if they are a slot's, the slot's
    next replay, on whichever stream, waits for it."""
    s = getattr(saved, "replay_slot", None)
    if s is not None:
        import cupy
        ev = cupy.cuda.get_current_stream().record()
        with s.lock:
            s.reads.append(ev)


def _spec(key, x, params):
    """The call's Spec from rnn_params.parse (its cache: the same one for the same unchanged arrays), or None
    when parsing fails (the general path says why)."""
    import cupy

    from . import rnn_params
    mode, num_layers, bidirectional, proj_size = key[0], key[5], key[6], key[9]
    try:
        return rnn_params.parse(params, mode, x.shape[-1], num_layers=num_layers, bidirectional=bidirectional,
                                proj_size=proj_size, xp=cupy, dtype=x.dtype)
    except (KeyError, ValueError, TypeError):
        return None


def _copy_in(s: _Slot, x, hx) -> None:
    s.x[...] = x
    if hx is None:
        return
    if isinstance(hx, (tuple, list)):
        for buf, h in zip(s.hx, hx):
            buf[...] = h
    else:
        s.hx[...] = hx


def _copy_out(out):
    return tuple(_copy_out(o) if isinstance(o, tuple) else (None if o is None else o.copy()) for o in out)


def _workspaces(devices) -> dict:
    """A graph's own cuBLAS workspace on each of ``devices``, and their workspace handles, made before a capture
    (nothing is made inside one)."""
    import cupy

    from . import rnn_layer
    from .cublas_call import device_workspace
    out = {}
    for d in devices:
        with cupy.cuda.Device(d):
            out[d] = device_workspace(cupy)
            rnn_layer._shared_handle(d)
    return out


def _own_bytes(workspaces: dict) -> int:
    """Bytes of the workspaces made before a capture (a lane's, keyed by (device, stream), is in its pool)."""
    return sum(w.nbytes for k, w in workspaces.items() if not isinstance(k, tuple))


def _capture(e: _Entry, x, hx, params, general, backward):
    """A new slot of e: the call captured on a stream of its own, then checked (module docstring); None when
    either failed (counted; the call runs the general path). A training slot comes back leased."""
    import cupy

    from . import rnn_layer, rnn_multi, rnn_params
    s = _Slot()
    caller = cupy.cuda.get_current_stream()
    stream = cupy.cuda.Stream(non_blocking=True)
    s.x = cupy.empty_like(x)
    s.hx = None if hx is None else (tuple(cupy.empty_like(h) for h in hx) if isinstance(hx, (tuple, list))
                                     else cupy.empty_like(hx))
    s.devices = rnn_multi.cuda_devices(x.device.id)
    workspaces = _workspaces(s.devices)
    pool = cupy.cuda.MemoryPool()
    stream.wait_event(caller.record())
    try:
        with stream:
            _copy_in(s, x, hx)
            with cupy.cuda.using_allocator(pool.malloc), rnn_layer.whole_call_capture(workspaces), \
                    rnn_params.given(params, e.spec):
                stream.begin_capture()
                try:
                    out = general(s.x, s.hx)
                except BaseException:
                    _end_quietly(stream)  # (its error would hide the first one)
                    raise
                graph = stream.end_capture()  # an invalidated capture ends with an error
        run = dict(rnn_multi.last_run())
        _check(e, s, graph, stream, caller, out, x, hx, general, backward)
    except Exception as exc:  # noqa: BLE001 - the call runs the general path; the reason is kept
        caller.wait_event(stream.record())  # (s.x, of the caller's stream, freed now: after the copy queued into it)
        e.fails += 1
        _failed(exc)
        _retire(pool, s.devices)
        return None
    s.graph, s.out, s.saved = graph, out[:2], (_saved(out[2]) if e.training else None)
    s.keep = [pool, workspaces, stream]
    ins = [s.x, *(s.hx if isinstance(s.hx, tuple) else (s.hx,) if s.hx is not None else ())]
    s.nbytes = _pool_bytes(pool, s.devices) + _own_bytes(workspaces) + sum(a.nbytes for a in ins)
    if e.nbytes + s.nbytes > MAX_BYTES:  # kept, it would hold more than all entries may: the general path for good
        e.fails = TRIES
        _failed(MemoryError(f"the graph's memory ({s.nbytes} bytes) would pass MAX_BYTES ({MAX_BYTES})"))
        caller.synchronize()  # (its check ran on this memory)
        s.graph = s.out = s.saved = None
        _retire(pool, s.devices)
        return None
    s.done = caller.record()
    s.leased = e.training
    e.run = run
    with _lock:
        e.slots.append(s)
        _stats["captured"] += 1
    return s


def _check(e: _Entry, s: _Slot, graph, stream, caller, out, x, hx, general, backward) -> None:
    """The graph on another input against the general path there (outputs; for training also the backward
    from the slot's activations against the backward from the general path's); raises when they differ."""
    from . import rnn_layer
    probe = _probe(x)
    want = general(probe, hx)
    with stream:
        stream.wait_event(caller.record())
        _copy_in(s, probe, hx)
        graph.launch(stream)
    caller.wait_event(stream.record())
    tol = CHECK_TOL.get(np.dtype(x.dtype), 1e-3)
    err = _worst(out[:2], want[:2])
    if e.training and backward is not None and err <= tol:
        gy = want[0]
        got_g = backward(_saved(out[2]), gy)
        want_g = backward(want[2], gy)
        names = sorted(want_g)
        err = max(err, _worst(tuple(got_g[k] for k in names), tuple(want_g[k] for k in names)) / 10)
    if not err <= tol:
        raise rnn_layer.NotCapturable(f"the replayed graph differs from the general path by {err:.2e}")


def _saved(saved):
    """The captured call's saved state as a backward should see it: graph loops on (the capture had them off)."""
    from . import rnn_graph
    return dataclasses.replace(saved, problem=dataclasses.replace(saved.problem, graphs=rnn_graph.enabled()))


def _failed(exc) -> None:
    tb, where = exc.__traceback__, ""
    while tb is not None:  # the innermost blasx frame
        name = tb.tb_frame.f_code.co_filename
        if "blasx" in name or "/dnn/" in name:
            where = f" ({name.rsplit('/', 1)[-1]}:{tb.tb_lineno})"
        tb = tb.tb_next
    with _lock:
        _stats["failures"] += 1
        _stats["failed"] = f"{type(exc).__name__}: {exc}{where}"


def _end_quietly(stream) -> None:
    try:
        stream.end_capture()
    except Exception:  # noqa: BLE001 - the capture failed already
        pass


def _probe(x):
    """The check's input: another call's x (negated: every output changes)."""
    import cupy
    return cupy.negative(x)


def _worst(got, want) -> float:
    """The largest relative-norm difference over the outputs (nested tuples of arrays), in float64 on the host
    (once per capture); infinite where either holds a NaN or an infinity (no check passes on those)."""
    import cupy
    worst = 0.0
    for g, w in zip(got, want):
        if isinstance(g, tuple):
            worst = max(worst, _worst(g, w))
        elif g is not None:
            g64, w64 = cupy.asnumpy(g).astype(np.float64), cupy.asnumpy(w).astype(np.float64)
            if not (np.isfinite(g64).all() and np.isfinite(w64).all()):
                return float("inf")
            den = float(np.linalg.norm(w64)) or 1.0
            worst = max(worst, float(np.linalg.norm(g64 - w64)) / den)
    return worst


def _replay(e: _Entry, s: _Slot, x, hx):
    """Copy in, launch, copy out on the caller's stream (after the slot's previous user); a training call's
    saved state holds the slot (and its memory) until it is collected."""
    import cupy

    from . import rnn_multi
    stream = cupy.cuda.get_current_stream()
    with s.lock:
        if s.graph is None:  # dropped meanwhile (the bounds, clear()): the general path runs the call
            s.leased = False
            return None
        stream.wait_event(s.done)
        for ev in s.reads:
            stream.wait_event(ev)
        s.reads.clear()
        _copy_in(s, x, hx)
        s.graph.launch(stream)
        res = _copy_out(s.out)
        s.done = stream.record()
        if e.training:
            saved = dataclasses.replace(s.saved)  # (a new object: its own lease)
            saved.replay_memory = s.keep  # the slot's pool outlives a drop of the entry while this state lives
            saved.replay_slot = s  # (touched)
            weakref.finalize(saved, _give_back, s)
            res = (*res, saved)
    rnn_multi._last.run = dict(e.run)
    with _lock:
        _stats["replayed"] += 1
    return res
