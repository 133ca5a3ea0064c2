"""A recurrent call on host (numpy) arrays when the engine's devices are GPUs: the inputs go to the first GPU,
the CuPy path runs there (rnn_exec with every placement it has, so a stack or the directions still spread over
the other GPUs) and the outputs come back as numpy arrays. Without this the step loops of a host call would run
on the host, one small product at a time.

Policy (:func:`applies`): x of a type CuPy holds (float16, float32, float64; bfloat16 stays on the host path).
A call whose estimated device footprint (:func:`footprint`) exceeds the budget (free device memory /
``BUDGET_FRACTION``) runs in chunks (:func:`plan`): batch chunks, the rows being independent; where not even
one whole row fits, a unidirectional stack in time chunks with its states carried. Inference only: a training
call keeps every chunk's saved state, so one that does not fit one GPU stays on the host path.

Parameters may be host arrays (uploaded each call) or stay resident on a GPU (CuPy arrays or CUDA torch tensors,
as a torch model's on its device: nothing moves; rnn_params.py), the usual case for a model applied to host batches.

Training: the forward returns a :class:`HostSaved`; the backward takes host gradients, runs on the device and
returns host arrays (the parameters' gradients too). Errors: the arguments were checked on the host (rnn._problem) before anything moved.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..operands import is_cupy
from . import rnn_params

BUDGET_FRACTION = 2  # a call (or a chunk) takes at most free device memory / this
DEVICE_TYPES = ("float16", "float32", "float64")


@dataclass
class HostSaved:
    """A host call's training state: the device call's own (rnn.Saved) and its GPU."""
    saved: object
    device: int


def gpus() -> tuple:
    from .. import session
    return session.cuda_ordinals()


def possible(dtype) -> bool:
    """Whether a host call of ``dtype`` may run on the GPUs (the parameters may then stay resident on one)."""
    return np.dtype(dtype).name in DEVICE_TYPES and bool(gpus())


def applies(pb) -> bool:
    """Whether a host call runs on the GPUs (see the module docstring)."""
    return pb.xp is np and possible(pb.x.dtype)


def footprint(spec, T: int, B: int, itemsize: int, training: bool) -> int:
    """Bytes a call of B rows holds on the device, an upper estimate (pure): per layer-direction the projection
    and the loop's states in float32 (gx, gates, S, C, and a graph entry's copies of them), plus x and y."""
    f = 4 if itemsize <= 4 else 8
    per_row_step = spec.num_layers * spec.num_dirs * (2 * spec.gates * spec.hidden_size + 3 * spec.hidden_size
                                                      + 2 * spec.out_size) * f * (2 if training else 1)
    io = (spec.input_size + spec.num_dirs * spec.out_size) * itemsize
    return T * B * (per_row_step + io)


def batch_chunks(B: int, per: int) -> list[tuple[int, int]]:
    """Rows [lo, hi) of chunks of at most ``per`` rows, of equal size but the last (pure)."""
    per = max(1, min(per, B))
    count = -(-B // per)
    per = -(-B // count)
    return [(lo, min(B, lo + per)) for lo in range(0, B, per)]


def plan(spec, T: int, B: int, itemsize: int, training: bool, budget: int) -> tuple[str, int]:
    """How a call of T steps and B rows runs within ``budget`` device bytes (pure): ("whole", 0); ("rows", n):
    batch chunks of n rows; ("steps", n): time chunks of n steps over every row, the states carried
    (unidirectional inference); ("host", 0): the host path (training, or a bidirectional row that does not fit)."""
    room = budget // max(1, footprint(spec, 1, 1, itemsize, training))  # row-steps that fit
    if room >= T * B:
        return "whole", 0
    if training:
        return "host", 0
    if room >= T:
        return "rows", room // T
    if spec.num_dirs == 1:
        return "steps", max(1, room // B)
    return "host", 0


def run(again, pb, x, hx, lengths, training: bool):
    """The call on the first GPU: ``again(x, hx, params, lengths, batch_first)`` is rnn._run's CuPy path with
    the call's other arguments; returns its result with every array on the host (a HostSaved in training), or
    None where the host path must run (:func:`plan`)."""
    import cupy
    dev = gpus()[0]
    T, B = pb.x.shape[:2]
    with cupy.cuda.Device(dev):
        budget = (cupy.cuda.runtime.memGetInfo()[0] + cupy.get_default_memory_pool().free_bytes()) // BUDGET_FRACTION
        kind, n = ("whole", 0) if pb.unbatched else plan(pb.spec, T, B, pb.x.dtype.itemsize, training, budget)
        if kind == "host":
            return None
        pd = {k: _on(a, dev) for k, a in rnn_params.arrays(pb.spec).items()}
        if kind == "whole":
            return _host(again(cupy.asarray(x), _to(hx), pd, lengths, pb.batch_first), dev)

        def call(xs, hs, ls, batch_first):
            return again(cupy.asarray(xs), _to(hs), pd, ls, batch_first)
        if kind == "rows":
            return by_rows(call, pb, x, hx, lengths, batch_chunks(B, n), cupy.asnumpy)
        return by_time(call, pb, x, hx, lengths, n, cupy.asnumpy)


def _on(a, dev: int):
    """A parameter on GPU ``dev``: a host one uploaded, a resident one as it is (copied from another GPU)."""
    import cupy
    if not is_cupy(a):
        return cupy.asarray(a)
    return a if a.device.id == dev else a.copy()  # (copy(): onto the current device)


def _to(a):
    """hx (None, an array or LSTM's pair) on the current device."""
    import cupy
    if a is None:
        return None
    if isinstance(a, (tuple, list)):
        return tuple(None if v is None else cupy.asarray(v) for v in a)
    return cupy.asarray(a)


def _host(res, dev):
    """A device call's result with its arrays on the host; its saved state wrapped (training)."""
    import cupy
    from .rnn import Saved
    if isinstance(res, Saved):
        return HostSaved(res, dev)
    if isinstance(res, tuple):
        return tuple(_host(v, dev) for v in res)
    if isinstance(res, dict):
        return {k: _host(v, dev) for k, v in res.items()}
    return cupy.asnumpy(res) if res is not None else None


def by_rows(call, pb, x, hx, lengths, spans, down):
    """Inference in batch chunks: ``call(x, hx, lengths, batch_first)`` on each span's rows of x, hx and lengths,
    its outputs (``down``: to the host) into host arrays of the call's shapes."""
    axis = 0 if pb.batch_first else 1
    out = None
    for lo, hi in spans:
        xs = x[lo:hi] if axis == 0 else x[:, lo:hi]
        hs = None if hx is None else (tuple(None if v is None else v[:, lo:hi] for v in hx)
                                      if isinstance(hx, (tuple, list)) else hx[:, lo:hi])
        y, state = call(xs, hs, None if lengths is None else [int(v) for v in lengths][lo:hi], pb.batch_first)
        states = state if isinstance(state, tuple) else (state,)
        if out is None:
            B = x.shape[axis]
            out = (np.empty(y.shape[:axis] + (B,) + y.shape[axis + 1:], dtype=y.dtype),
                   [np.empty(s.shape[:1] + (B,) + s.shape[2:], dtype=s.dtype) for s in states])
        (out[0][lo:hi] if axis == 0 else out[0][:, lo:hi])[...] = down(y)
        for dst, s in zip(out[1], states):
            dst[:, lo:hi] = down(s)
    y, states = out
    return y, (tuple(states) if isinstance(state, tuple) else states[0])


def by_time(call, pb, x, hx, lengths, steps: int, down):
    """Unidirectional inference in time chunks of ``steps``: each chunk runs from the states the last one left,
    on the rows still active (lengths sort decreasing, so a prefix) with their lengths clipped to the chunk;
    finished rows keep their final states and zero outputs. Half types round the carried cell state to x's
    type at each chunk boundary (as c_n is returned)."""
    spec = pb.spec
    T, B = pb.x.shape[:2]
    lstm = spec.mode == "lstm"
    dt = pb.x.dtype
    h0, c0 = (hx if hx is not None else (None, None)) if lstm else (hx, None)
    h = np.zeros((spec.num_layers, B, spec.out_size), dt) if h0 is None else np.array(h0, dtype=dt)
    c = (np.zeros((spec.num_layers, B, spec.hidden_size), dt) if c0 is None else np.array(c0, dtype=dt)) \
        if lstm else None
    lens = None if lengths is None else [int(v) for v in lengths]
    y = np.zeros((T, B, spec.out_size), dt)
    for t0 in range(0, T, steps):
        t1 = min(T, t0 + steps)
        a = B if lens is None else sum(1 for v in lens if v > t0)
        if a == 0:
            break
        ls = None if lens is None else [min(v - t0, t1 - t0) for v in lens[:a]]
        ys, st = call(pb.x[t0:t1, :a], (h[:, :a], c[:, :a]) if lstm else h[:, :a], ls, False)
        y[t0:t1, :a] = down(ys)
        if lstm:
            h[:, :a], c[:, :a] = down(st[0]), down(st[1])
        else:
            h[:, :a] = down(st)
    if pb.batch_first:
        y = np.ascontiguousarray(y.transpose(1, 0, 2))
    return y, ((h, c) if lstm else h)
