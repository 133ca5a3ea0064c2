"""A layer-direction's CUDA step loop captured once per shape into a CUDA graph and replayed.

The loop (rnn_layer.forward_loop) is T recurrent GEMMs and T cell kernels; launched from Python each costs a
few microseconds of interpreter and launch time, more than the work itself at small sizes. A graph is keyed by
everything the loop's launches depend on (device, mode, shapes, dtypes, active rows per step, direction, math)
and owns the buffers its launches were captured with: a call copies its inputs in, replays the graph on the
current stream and copies the states out (in inference only h and the last cell state). The first call of a
key runs the loop eagerly on those buffers (which also compiles the kernels, so the capture allocates nothing)
and then captures it; a capture that fails leaves the key eager (``stats()`` says why). Both runs issue their
GEMMs through ctypes with the entry's own cuBLAS workspace (rnn_layer.CudaOps.workspace): CuPy's cuBLAS
wrappers refuse a capturing stream, and the graph keeps using that workspace at every replay.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from . import rnn_layer

MAX_GRAPHS = 16  # graphs kept per process (least recently used dropped)

_lock = threading.Lock()
_cache: OrderedDict = OrderedDict()
_stats = {"captured": 0, "replayed": 0, "eager": 0, "failed": ""}


_local = threading.local()


def enabled() -> bool:
    """Whether this thread's recurrent calls replay graphs (on by default; see :func:`eager`)."""
    return getattr(_local, "on", True)


class eager:
    """``with rnn_graph.eager():`` runs this thread's CUDA step loops from Python, launch by launch (to compare
    or measure the per-step overhead a graph removes)."""

    def __enter__(self):
        self.old = enabled()
        _local.on = False

    def __exit__(self, *exc):
        _local.on = self.old


def stats() -> dict:
    """Counts of captures, replays and eager runs, and the last capture failure."""
    return dict(_stats)


def clear() -> None:
    with _lock:
        _cache.clear()


class _Entry:
    def __init__(self, xp, gx, w_hh, w_hr, bhn, st, gh) -> None:
        from ..runtime.devices.cublas_ctypes import workspace_bytes
        like = (lambda a: None if a is None else xp.empty_like(a))
        self.gx, self.w_hh, self.w_hr, self.bhn, self.gh = (like(a) for a in (gx, w_hh, w_hr, bhn, gh))
        self.st = rnn_layer.Forward(*(like(a) for a in (st.S, st.C, st.gates, st.R)))
        self.workspace = xp.empty(workspace_bytes(int(xp.cuda.Device().compute_capability) // 10), dtype=xp.uint8)
        self.graph = None
        self.runs = 0


def _key(ops, mode, gx, w_hh, w_hr, bhn, st, bs, reverse):
    def sig(a):
        return None if a is None else (tuple(a.shape), str(a.dtype))
    return (gx.device.id, mode, sig(gx), sig(w_hh), sig(w_hr), sig(bhn), sig(st.S), sig(st.C), sig(st.gates),
            sig(st.R), tuple(bs), reverse, ops.math)


def run(ops, mode, gx, w_hh, w_hr, bhn, st, gh, bs, reverse: bool, use_graph: bool = True, keep: bool = True) -> None:
    """rnn_layer.forward_loop's effect on ``st``, through the graph of this shape (captured on first use).
    ``keep=False`` (inference): only ``st.S`` and ``st.C[T]`` are written back (gates, R and the other cell states
    are left as they were)."""
    xp = ops.xp
    key = _key(ops, mode, gx, w_hh, w_hr, bhn, st, bs, reverse)
    with _lock:
        e = _cache.get(key)
        if e is None:
            e = _cache[key] = _Entry(xp, gx, w_hh, w_hr, bhn, st, gh)
            while len(_cache) > MAX_GRAPHS:
                _cache.popitem(last=False)
        _cache.move_to_end(key)
    for dst, src in ((e.gx, gx), (e.w_hh, w_hh), (e.w_hr, w_hr), (e.bhn, bhn)):
        if src is not None:
            dst[...] = src
    e.st.S[0] = st.S[0]
    if st.C is not None:
        e.st.C[0] = st.C[0]
    stream = xp.cuda.get_current_stream()
    if e.graph is not None and use_graph:
        e.graph.launch(stream)
        _stats["replayed"] += 1
    else:
        ops.placeholder(gx.dtype)  # made outside any capture
        old, ops.workspace = ops.workspace, e.workspace
        try:
            rnn_layer.forward_loop(ops, mode, e.gx, e.w_hh, e.w_hr, e.bhn, e.st, e.gh, bs, reverse)
            _stats["eager"] += 1
            if use_graph and e.runs == 0:
                _capture(ops, mode, e, bs, reverse, stream)
        finally:
            ops.workspace = old
    e.runs += 1
    outs = ((st.S, e.st.S), (st.C, e.st.C), (st.gates, e.st.gates), (st.R, e.st.R)) if keep else (
        (st.S, e.st.S), (None if st.C is None else st.C[-1], None if st.C is None else e.st.C[-1]))
    for dst, src in outs:
        if dst is not None:
            dst[...] = src


def _capture(ops, mode, e: _Entry, bs, reverse, stream) -> None:
    """The loop captured on a side stream (ordered after ``stream``'s work); its first error kept in stats."""
    xp = ops.xp
    cap = xp.cuda.Stream(non_blocking=True)
    cap.wait_event(stream.record())
    graph, err = None, None
    with cap:
        cap.begin_capture()
        try:
            rnn_layer.forward_loop(ops, mode, e.gx, e.w_hh, e.w_hr, e.bhn, e.st, e.gh, bs, reverse)
        except Exception as exc:  # noqa: BLE001 - the key stays eager; the reason is kept for stats()
            err = exc
        try:
            graph = cap.end_capture()
        except Exception as exc:  # noqa: BLE001 - as above (an invalidated capture ends with an error)
            err = err or exc
    if err is None:
        e.graph = graph
        _stats["captured"] += 1
    else:
        _stats["failed"] = f"{type(err).__name__}: {err}"
    stream.wait_event(cap.record())
