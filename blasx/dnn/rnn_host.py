"""A recurrent call on host (numpy) arrays when the engine's devices are GPUs: the inputs go to the first GPU,
the CuPy path runs there (rnn_exec with every placement it has, so a stack or the directions still spread over
the other GPUs) and the outputs come back as numpy arrays. Without this the step loops of a host call would run
on the host, one small product at a time.

Policy (:func:`applies`): x of a type CuPy holds (float16, float32, float64; bfloat16 stays on the host path).
A call whose estimated device footprint (:func:`footprint`) exceeds the budget (free device memory /
``BUDGET_FRACTION``) runs in batch chunks, the rows being independent (:func:`batch_chunks`): inference only;
a training call keeps every chunk's saved state, so one that does not fit one GPU stays on the host path.

Training: the forward returns a :class:`HostSaved`; the backward takes host gradients, runs on the device and
returns host arrays. Errors: the arguments were checked on the host (rnn._problem) before anything moved.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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


def applies(pb) -> bool:
    """Whether a host call runs on the GPUs (see the module docstring)."""
    return pb.xp is np and np.dtype(pb.x.dtype).name in DEVICE_TYPES and bool(gpus())


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


def run(again, pb, x, hx, params, lengths, training: bool):
    """The call on the first GPU: ``again(x, hx, params, lengths)`` is rnn._run's CuPy path with the call's
    other arguments; returns its result with every array on the host (and a HostSaved in training)."""
    import cupy
    dev = gpus()[0]
    T, B = pb.x.shape[:2]
    with cupy.cuda.Device(dev):
        pd = {k: cupy.asarray(rnn_params.as_array(k, params[k], np)) for k in rnn_params.names(pb.spec)}
        free = cupy.cuda.runtime.memGetInfo()[0] + cupy.get_default_memory_pool().free_bytes()
        row = max(1, footprint(pb.spec, T, 1, pb.x.dtype.itemsize, training))
        per = max(1, free // BUDGET_FRACTION // row)
        if per >= B or pb.unbatched:
            return _host(again(cupy.asarray(x), _to(hx), pd, lengths), dev)
        if training:
            return None  # the caller keeps the host path
        return _chunked(again, pb, x, hx, pd, lengths, batch_chunks(B, per))


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


def _chunked(again, pb, x, hx, pd, lengths, spans):
    """Inference in batch chunks: each chunk's rows of x, hx and lengths through the device, its outputs into
    host arrays of the call's shapes."""
    import cupy
    axis = 0 if pb.batch_first else 1
    out = None
    for lo, hi in spans:
        xs = x[lo:hi] if axis == 0 else x[:, lo:hi]
        hs = None if hx is None else (tuple(v[:, lo:hi] for v in hx) if isinstance(hx, (tuple, list))
                                      else hx[:, lo:hi])
        y, state = again(cupy.asarray(xs), _to(hs), pd, None if lengths is None else list(lengths)[lo:hi])
        states = state if isinstance(state, tuple) else (state,)
        if out is None:
            B = x.shape[axis]
            out = (np.empty(y.shape[:axis] + (B,) + y.shape[axis + 1:], dtype=y.dtype),
                   [np.empty(s.shape[:1] + (B,) + s.shape[2:], dtype=s.dtype) for s in states])
        (out[0][lo:hi] if axis == 0 else out[0][:, lo:hi])[...] = cupy.asnumpy(y)
        for dst, s in zip(out[1], states):
            dst[:, lo:hi] = cupy.asnumpy(s)
    y, states = out
    return y, (tuple(states) if isinstance(state, tuple) else states[0])
