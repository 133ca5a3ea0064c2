"""A repeated recurrent inference call on CuPy arrays replayed from one CUDA graph of the whole call.

A recurrent call issues tens to hundreds of launches (projections, step loops or their graphs, copies between
GPUs, final states) from Python, and at small sizes, or with layers spread over GPUs, the host's issue time
sets the call's time. A call signature (:func:`signature`: mode, the params mapping, x's shape and type and GPU,
hx's, the flags, the math mode and the caller's stream) gets an entry on its second call: the call is captured
once into a graph on the entry's own stream, over every GPU it uses, reading the entry's copies of x and hx and
writing outputs the graph owns; later calls copy x and hx in, launch the graph on the caller's stream and copy
the outputs out (a fresh array each, as the general path returns).

Invariants:
- a graph reads only the entry's x and hx buffers, the parameters' arrays (held by the entry's Spec, which
  rnn_params.parse returns again only for the same arrays unchanged) and memory of its own pool and workspaces;
  each call checks the Spec, the math mode, the engine and the device before replaying (else the general path);
- nothing of a captured call runs outside its graph: engine GEMMs and uncaptured streams refuse or fail the
  capture (rnn_layer.whole_call_capture, rnn_multi._Issued), and a capture is kept only after its graph, run on
  another input (x negated), matched the general path's result on that input (:data:`CHECK_TOL`);
- one call at a time uses an entry's buffers: its lock covers the issue of copy-in, launch and copy-out, and the
  next caller's stream waits for the last one's event.

Policy: the first call of a signature runs the general path; the second captures; a capture that fails or does
not match is tried again on later calls, :data:`TRIES` in all, then the signature stays on the general path
(``stats()`` says why). At most :data:`MAX_ENTRIES` signatures and :data:`MAX_BYTES` of graph memory (pools,
workspaces, input buffers) are kept, the least recently used dropped first once its last replay has finished.
``BLASX_RNN_REPLAY=0`` turns the path off.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import numpy as np

ENABLED = os.environ.get("BLASX_RNN_REPLAY", "1") != "0"
TRIES = 3  # captures tried per signature
MAX_ENTRIES = 16  # signatures kept (their graphs and buffers); the least recently used dropped ...
MAX_BYTES = 4 << 30  # ... also while the graphs' memory in all is over this
CHECK_TOL = {np.dtype(np.float16): 3e-2, np.dtype(np.float32): 1e-3, np.dtype(np.float64): 1e-9}

_lock = threading.Lock()
_entries: OrderedDict = OrderedDict()  # key -> _Entry, least recently used first
_stats = {"captured": 0, "replayed": 0, "failures": 0, "failed": ""}


def stats() -> dict:
    """Counts of captures, replays and failed captures, and the last failure's message."""
    with _lock:
        return dict(_stats)


def clear() -> None:
    """Drops every entry (their graphs, pools and buffers) once its last replay has finished."""
    with _lock:
        gone = list(_entries.values())
        _entries.clear()
    for e in gone:
        _drop(e)


def _drop(e) -> None:
    """Frees e's graph and memory after the GPU is done with them (its last replay's event)."""
    with e.lock:
        if e.done is not None:
            e.done.synchronize()
        e.graph = e.out = e.x = e.hx = e.done = None
        e.keep, e.nbytes = [], 0


def _admit(key, e) -> None:
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


def _sig(a):
    return None if a is None else (tuple(a.shape), a.dtype.str, type(a).__module__.split(".")[0])


def signature(mode, x, hx, params, num_layers, bidirectional, batch_first, lengths, proj_size, training, math):
    """The entry's key of a call, or None where this path never applies (host x, training, off, or a capture of
    the caller's under way)."""
    if training or not ENABLED or type(x).__module__.split(".")[0] != "cupy":
        return None
    import cupy
    stream = cupy.cuda.get_current_stream()
    if stream.is_capturing():
        return None
    hs = tuple(_sig(h) for h in hx) if isinstance(hx, (tuple, list)) else _sig(hx)
    return (mode, id(params), tuple(x.shape), x.dtype.str, x.device.id, int(num_layers), bool(bidirectional),
            bool(batch_first), None if lengths is None else tuple(int(v) for v in lengths), int(proj_size), hs, math,
            stream.ptr)


class _Entry:
    def __init__(self, spec, engine, math) -> None:
        self.lock = threading.Lock()
        self.spec, self.engine, self.math = spec, engine, math
        self.seen = 0  # general-path calls so far
        self.fails = 0
        self.graph = None
        self.keep: list = []  # the graph's pool, workspaces, stream and buffers
        self.x = self.hx = self.out = self.done = self.run = None
        self.nbytes = 0  # graph memory held (pool, workspaces, input buffers)


def call(key, x, hx, params, general):
    """The call's result from its graph, or None (the general path runs it). ``general(x, hx)``: the general
    path on other arrays (for the capture and its check)."""
    import cupy

    from .. import precision, session
    from . import rnn_params
    with _lock:
        e = _entries.get(key)
        if e is not None:
            _entries.move_to_end(key)
    spec = _spec(key, x, params)
    if spec is None or cupy.cuda.runtime.getDevice() != x.device.id:
        return None
    if e is None or e.spec is not spec or e.engine is not session.engine() or \
            e.math != precision.check_math(key[11]):
        e = _Entry(spec, session.engine(), precision.check_math(key[11]))
        _admit(key, e)
    if e.graph is None:
        if e.seen == 0 or e.fails >= TRIES:
            e.seen += 1
            return None
        with e.lock:
            if e.graph is None and not _capture(e, x, hx, params, general):
                return None
        _admit(key, e)  # (its memory counted now)
    return _replay(e, x, hx)


def _spec(key, x, params):
    """The call's Spec from rnn_params.parse (its cache: the same one for the same unchanged arrays), or None
    when parsing fails (the general path says why)."""
    import cupy

    from . import rnn_params
    mode, num_layers, bidirectional, batch_first, proj_size = key[0], key[5], key[6], key[7], key[9]
    n_in = x.shape[-1]
    try:
        return rnn_params.parse(params, mode, n_in, num_layers=num_layers, bidirectional=bidirectional,
                                proj_size=proj_size, xp=cupy, dtype=x.dtype)
    except (KeyError, ValueError, TypeError):
        return None


def _copy_in(e, x, hx) -> None:
    e.x[...] = x
    if hx is None:
        return
    if isinstance(hx, (tuple, list)):
        for buf, h in zip(e.hx, hx):
            buf[...] = h
    else:
        e.hx[...] = hx


def _copy_out(out):
    return tuple(_copy_out(o) if isinstance(o, tuple) else (None if o is None else o.copy()) for o in out)


def _capture(e: _Entry, x, hx, params, general) -> bool:
    """Captures the call into e's graph on a stream of its own, then checks it (module docstring); False when
    either failed (counted; the call runs the general path)."""
    import cupy

    from . import rnn_layer, rnn_multi, rnn_params
    from ..runtime.devices.cublas_ctypes import workspace_bytes
    dev = x.device.id
    caller = cupy.cuda.get_current_stream()
    stream = cupy.cuda.Stream(non_blocking=True)
    e.x = cupy.empty_like(x)
    e.hx = None if hx is None else (tuple(cupy.empty_like(h) for h in hx) if isinstance(hx, (tuple, list))
                                     else cupy.empty_like(hx))
    devs = rnn_multi.cuda_devices(dev)
    workspaces = {}
    for d in devs:  # made before the capture (no allocation or handle creation inside it)
        with cupy.cuda.Device(d):
            cc = int(cupy.cuda.Device(d).compute_capability) // 10
            workspaces[d] = cupy.empty(workspace_bytes(cc), dtype=cupy.uint8)
            rnn_layer._shared_handle(d)
    pool = cupy.cuda.MemoryPool()
    stream.wait_event(caller.record())
    try:
        with stream:
            _copy_in(e, x, hx)
            with cupy.cuda.using_allocator(pool.malloc), rnn_layer.whole_call_capture(workspaces), \
                    rnn_params.given(params, e.spec):
                stream.begin_capture()
                try:
                    out = general(e.x, e.hx)
                except BaseException:
                    _end_quietly(stream)  # (its error would hide the first one)
                    raise
                graph = stream.end_capture()  # an invalidated capture ends with an error
        run = dict(rnn_multi.last_run())
        # the check: the graph on another input against the general path's result there
        probe = _probe(x)
        want = general(probe, hx)
        with stream:
            stream.wait_event(caller.record())
            _copy_in(e, probe, hx)
            graph.launch(stream)
        caller.wait_event(stream.record())
        tol = CHECK_TOL.get(np.dtype(x.dtype), 1e-3)
        err = _worst(out, want)
        if not err <= tol:
            raise rnn_layer.NotCapturable(f"the replayed graph differs from the general path by {err:.2e}")
    except Exception as exc:  # noqa: BLE001 - the call runs the general path; the reason is kept
        e.fails += 1
        e.x = e.hx = None
        tb, where = exc.__traceback__, ""
        while tb is not None:  # the innermost blasx frame
            name = tb.tb_frame.f_code.co_filename
            if "blasx" in name or "/dnn/" in name:
                where = f" ({name.rsplit('/', 1)[-1]}:{tb.tb_lineno})"
            tb = tb.tb_next
        with _lock:
            _stats["failures"] += 1
            _stats["failed"] = f"{type(exc).__name__}: {exc}{where}"
        return False
    e.graph, e.out, e.run = graph, out, run
    e.keep = [pool, workspaces, stream]
    ins = [e.x, *(e.hx if isinstance(e.hx, tuple) else (e.hx,) if e.hx is not None else ())]
    e.nbytes = pool.total_bytes() + sum(w.nbytes for w in workspaces.values()) + sum(a.nbytes for a in ins)
    e.done = caller.record()
    with _lock:
        _stats["captured"] += 1
    return True


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
    (once per capture)."""
    import cupy
    worst = 0.0
    for g, w in zip(got, want):
        if isinstance(g, tuple):
            worst = max(worst, _worst(g, w))
        elif g is not None:
            g64, w64 = cupy.asnumpy(g).astype(np.float64), cupy.asnumpy(w).astype(np.float64)
            den = float(np.linalg.norm(w64)) or 1.0
            worst = max(worst, float(np.linalg.norm(g64 - w64)) / den)
    return worst


def _replay(e: _Entry, x, hx):
    """Copy in, launch, copy out on the caller's stream (after the entry's previous user)."""
    import cupy

    from . import rnn_multi
    stream = cupy.cuda.get_current_stream()
    with e.lock:
        if e.graph is None:  # dropped meanwhile (the bounds, clear()): the general path runs the call
            return None
        stream.wait_event(e.done)
        _copy_in(e, x, hx)
        e.graph.launch(stream)
        res = _copy_out(e.out)
        e.done = stream.record()
    rnn_multi._last.run = dict(e.run)
    with _lock:
        _stats["replayed"] += 1
    return res
