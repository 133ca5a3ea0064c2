"""A repeated small recurrent inference call on one GPU, issued without the general path's layers of Python.

A one-layer, one-direction inference call on one GPU is a few launches (the input projection's GEMM, then
rnn_persist's loop kernel or the step loop's graph with its inputs and outputs), yet the general path (validation,
placement, the layer and direction machinery) costs the host several times their launch time, and a small call
waits for it. After a general call that :func:`eligible` accepts, the signature's entry keeps what the general path
derived from it (the parameters' Spec, the rows per step, the placement); a later call with the same signature
(:func:`signature`: mode, the params mapping, x's shape, strides, type and GPU, hx given or not, the flags) runs
rnn_exec.direction_forward on it straight away, as the general path would with one device.

What can change between calls of one signature is checked on each: the parameters through rnn_params.parse
(its cache: the same tensors, of unchanged storage; anything else parses anew, and a new Spec sends the call back
to the general path), hx's shapes and types (rnn._check_state), the math mode, the configured GPUs (a reconfigured one
goes back too), the current device and the graph switch (rnn_graph.usable(): on, and no capture under way).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

MAX_ENTRIES = 64
_entries: dict = {}
_lock = threading.Lock()
hits = [0]  # calls run by this path (tests)


@dataclass(frozen=True)
class Entry:
    """What a signature's calls share; the Spec by weak reference (an entry keeps no parameters' memory alive), the
    GPUs configured (session.cuda_ordinals(): the engine itself is never started for this path)."""
    spec: weakref.ref  # to the rnn_params.Spec of the params
    math: str
    gpus: tuple
    bs: tuple  # active rows per step (all B)
    placement: object  # rnn_plan.Placement, for rnn_multi.last_run()


def signature(mode, x, params, num_layers, bidirectional, batch_first, lengths, proj_size, training, hx, math):
    """The entry's key of a call, or None where this path never applies (host x, training, lengths, several
    layers or directions, a projection, unbatched x)."""
    if training or lengths is not None or num_layers != 1 or bidirectional or proj_size or \
            type(x).__module__.split(".")[0] != "cupy" or x.ndim != 3:
        return None
    return (mode, id(params), x.shape, x.strides, x.dtype, x.device.id, bool(batch_first), hx is None, math)


def eligible(pb) -> bool:
    """Whether the general path ran ``pb``, a call with a :func:`signature` (one layer and direction, CuPy,
    inference, no lengths), as one direction_forward on x's GPU alone, the current device, with graphs on
    (rnn_multi.run_forward with one device, or a placement kept local to it: its projection a local GEMM)."""
    from . import rnn_multi
    home = pb.x.device.id
    pl = rnn_multi.last_run().get("placement")
    alone = rnn_multi.devices_for(pb) == [home] or (pl is not None and pl.local)
    return pb.graphs and pb.xp.cuda.runtime.getDevice() == home and alone


def remember(key, pb, params) -> None:
    """Keep ``pb``'s entry under ``key`` (a general call just ran it; see :func:`eligible`), where rnn_params.parse
    keeps its Spec for ``params`` (CUDA torch tensors: a later call's check is a lookup)."""
    from .. import session
    from . import rnn_params, rnn_plan
    T, B, n_in = pb.x.shape
    if rnn_params.parse(params, pb.spec.mode, n_in, num_layers=1, bidirectional=False, proj_size=0, xp=pb.xp,
                        dtype=pb.x.dtype) is not pb.spec:
        return
    entry = Entry(weakref.ref(pb.spec), pb.math, session.cuda_ordinals(), pb.bs, rnn_plan.plan(1, 1, B, T, 1))
    with _lock:
        if len(_entries) >= MAX_ENTRIES:
            _entries.clear()
        _entries[key] = entry


def call(key, x, hx, params, math):
    """The call's result through its entry, or None (no entry, or something it was made from changed: the
    general path runs the call)."""
    entry = _entries.get(key)
    if entry is None:
        return None
    import cupy

    from .. import precision, session
    from . import rnn_graph, rnn_params
    from .rnn import _check_state
    mode, batch_first = key[0], key[6]
    xt = x.transpose(1, 0, 2) if batch_first else x
    spec = rnn_params.parse(params, mode, xt.shape[2], num_layers=1, bidirectional=False, proj_size=0, xp=cupy,
                            dtype=x.dtype)
    if spec is not entry.spec() or precision.check_math(math) != entry.math or session.cuda_ordinals() != entry.gpus \
            or not rnn_graph.usable(cupy) or cupy.cuda.runtime.getDevice() != x.device.id:
        return None
    h0 = c0 = None
    if hx is not None:
        state = (1, xt.shape[1], spec.hidden_size)
        if mode != "lstm":
            h0 = _check_state("hx", hx, state, cupy, x.dtype, False)
        elif isinstance(hx, (tuple, list)) and len(hx) == 2:
            h0 = _check_state("hx[0] (h0)", hx[0], state, cupy, x.dtype, False)
            c0 = _check_state("hx[1] (c0)", hx[1], state, cupy, x.dtype, False)
        else:
            return None  # the general path says what is wrong with it
    hits[0] += 1
    return _run(entry, spec, mode, xt, h0, c0, batch_first)


def _run(entry: Entry, spec, mode: str, xt, h0, c0, batch_first: bool):
    """rnn_exec.forward's work for one layer-direction on one device (direction_forward with a local projection
    GEMM, the final states), then rnn.py's finish."""
    import cupy

    from . import rnn_exec, rnn_layer, rnn_multi
    from .rnn import Problem
    T, B = xt.shape[:2]
    H, store = spec.hidden_size, xt.dtype
    pb = Problem(spec, cupy, xt, h0, c0, entry.bs, None, batch_first, False, entry.math, True)
    h_n = cupy.empty((1, B, H), dtype=store)
    c_n = cupy.empty((1, B, H), dtype=store) if mode == "lstm" else None
    written: set = set()
    st = rnn_exec.direction_forward(pb, rnn_layer.CudaOps(entry.math), 0, 0, xt, keep=False,
                                    mm=rnn_multi.local_mm(cupy, rnn_layer.compute_type(store), entry.math),
                                    finals=(h_n, c_n, written))
    if not written:  # (the graph loop: its final states are S's and C's last)
        h_n[0] = st.S[T]
        if c_n is not None:
            c_n[0] = st.C[-1]
    y = st.S[1:] if not batch_first else cupy.ascontiguousarray(st.S[1:].transpose(1, 0, 2))
    rnn_multi._last.run = {"placement": entry.placement, "ran_on": {(0, 0): xt.device.id}}
    return (y, (h_n, c_n)) if mode == "lstm" else (y, h_n)
