"""Recurrent layers on the engine: ``lstm``, ``gru``, ``rnn`` and their backward passes (torch's conventions).

``params`` is a mapping with torch's names (``nn.LSTM(...).state_dict()`` as it is; rnn_params.py). Per layer and
direction (MIOpen eq. 11-21): the input projection of all T steps is one engine GEMM (``blasx.matmul``, over every
device); the step loop runs one recurrent GEMM and one fused cell kernel per step (rnn_layer.py, rnn_cells.py; on
CUDA captured once per shape into a graph and replayed, rnn_graph.py); backward runs the per-step gradient
kernels, then the input and weight gradients of all steps as single GEMMs on the engine. Layers and directions
are placed on devices by rnn_plan.py (a unidirectional stack runs diagonally, rnn_diag.py: all its layers advance
together, one batched GEMM and one fused kernel per step; directions run side by side).

Inputs: numpy (host) or CuPy arrays of float64, float32 (``math="tf32"`` for TF32 GEMMs), float16 or bfloat16
(numpy only: CuPy has no bfloat16); with GPUs a host call runs on them (rnn_host.py). Half types accumulate and
keep the cell state in float32 and store y and h in their own type. ``lengths`` (as ``pack_padded_sequence``:
sorted decreasing, each in 1..T) ends each sequence at its length: later outputs are zero and its final state is
taken at its last step. A training forward's saved state keeps its own copies of x and of numpy / CuPy weights (a
torch tensor weight's version counter is checked by the backward instead, as torch's autograd does), so the caller
may write into its arrays before the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import precision
from ..operands import array_module, is_cupy
from . import rnn_exec, rnn_graph, rnn_host, rnn_params, rnn_replay, rnn_replay_backward
from .args import check_dtype, check_flag, check_kind, dtype_text

__all__ = ["lstm", "gru", "rnn", "lstm_backward", "gru_backward", "rnn_backward"]

_MODES = ("lstm", "gru", "rnn_tanh", "rnn_relu")


@dataclass
class Problem:
    """A validated call: the stack's Spec, time-major x, the initial states and the per-step batch sizes."""
    spec: rnn_params.Spec
    xp: object
    x: object  # (T, B, in), time-major
    h0: object  # (L*D, B, out) or None
    c0: object  # (L*D, B, H) or None
    bs: tuple  # active rows per time step
    lengths: tuple | None
    batch_first: bool
    unbatched: bool
    math: str
    graphs: bool = True  # CUDA: replay each step loop from a captured graph (rnn_graph.py)


@dataclass
class Saved:
    """The opaque training state ``*_backward`` takes."""
    problem: Problem
    layers: list  # per layer: [rnn_multi.Kept per direction] (or rnn_diag.Saved)
    versions: tuple = ()  # rnn_params.versions of the call's torch weights, checked by the backward


# ---------------------------------------------------------------- validation

def _check_x(x):
    check_kind("x", x)
    if x.ndim not in (2, 3):
        raise ValueError(f"x: expected 3 dimensions (T, B, input_size), (B, T, input_size) with batch_first, "
                         f"or 2 (T, input_size) unbatched; got shape {tuple(x.shape)}")
    check_dtype("x", x)
    if 0 in x.shape:
        raise ValueError(f"x: got shape {tuple(x.shape)}; every dimension must be positive")


def _like_x(v, xp) -> bool:
    """Whether ``v`` is an array of x's kind (a numpy x takes numpy arrays only: no tensors)."""
    return is_cupy(v) if xp is not np else isinstance(v, np.ndarray)


def _check_state(name: str, v, shape: tuple, xp, dtype, unbatched: bool):
    if v is None:
        return None
    want = shape[:1] + shape[2:] if unbatched else shape
    if not _like_x(v, xp):
        raise TypeError(f"{name}: expected a {'cupy' if xp is not np else 'numpy'} array like x, got "
                        f"{type(v).__name__}")
    if tuple(v.shape) != want:
        raise ValueError(f"{name}: expected shape {want} (num_layers*num_directions, "
                         f"{'' if unbatched else 'batch, '}features), got {tuple(v.shape)}")
    if v.dtype != dtype:
        raise TypeError(f"{name}: dtype {dtype_text(v.dtype)} differs from x's {dtype}")
    return v[:, None] if unbatched else v


def _check_lengths(lengths, T: int, B: int):
    if lengths is None:
        return None
    if type(lengths).__module__.startswith("torch"):
        lengths = lengths.cpu().numpy()
    if is_cupy(lengths):
        lengths = lengths.get()
    arr = np.asarray(lengths)
    if arr.ndim != 1 or arr.shape[0] != B or arr.dtype.kind not in "iu":
        raise ValueError(f"lengths: expected {B} integers (one per sequence), got "
                         f"{arr.shape if arr.ndim != 1 or arr.shape[0] != B else arr.dtype}")
    arr = arr.astype(np.int64)  # (unsigned lengths: their differences below would wrap)
    if arr.min() < 1 or arr.max() > T:
        raise ValueError(f"lengths: each must be in 1..{T} (T, x's time dimension), got {arr.tolist()}")
    if np.any(np.diff(arr) > 0):
        raise ValueError(f"lengths: must be sorted in decreasing order (as pack_padded_sequence with "
                         f"enforce_sorted=True), got {arr.tolist()}")
    return tuple(int(v) for v in arr)


def _problem(mode, x, hx, params, num_layers, bidirectional, batch_first, lengths, proj_size, math) -> Problem:
    if mode not in _MODES:
        raise ValueError(f"mode: got {mode!r}, allowed: {_MODES}")
    if params is None:
        raise TypeError("params: required (a mapping of torch's parameter names to arrays, e.g. a state_dict)")
    _check_x(x)
    if isinstance(x, np.matrix):  # (2-D whatever it is indexed with): its plain array
        x = np.asarray(x)
    math = precision.check_math(math)
    bidirectional, batch_first = check_flag("bidirectional", bidirectional), check_flag("batch_first", batch_first)
    xp = array_module(is_cupy(x))
    unbatched = x.ndim == 2
    xt = x[:, None] if unbatched else (x.transpose(1, 0, 2) if batch_first else x)
    T, B, n_in = xt.shape
    spec = rnn_params.parse(params, mode, n_in, num_layers=num_layers, bidirectional=bool(bidirectional),
                            proj_size=proj_size, xp=xp, dtype=x.dtype,
                            resident=xp is np and rnn_host.possible(x.dtype))
    ld = spec.num_layers * spec.num_dirs
    h0 = c0 = None
    if mode == "lstm" and hx is not None:
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            raise TypeError(f"hx: expected a pair (h0, c0) for lstm, got {type(hx).__name__}")
        h0 = _check_state("hx[0] (h0)", hx[0], (ld, B, spec.out_size), xp, x.dtype, unbatched)
        c0 = _check_state("hx[1] (c0)", hx[1], (ld, B, spec.hidden_size), xp, x.dtype, unbatched)
    elif hx is not None:
        h0 = _check_state("hx", hx, (ld, B, spec.out_size), xp, x.dtype, unbatched)
    if lengths is not None and unbatched:
        raise ValueError("lengths: not allowed for an unbatched (2-D) x")
    lens = _check_lengths(lengths, T, B)
    bs = (B,) * T if lens is None else tuple(int(sum(1 for v in lens if v > t)) for t in range(T))
    from . import rnn_graph
    return Problem(spec, xp, xt, h0, c0, bs, lens, bool(batch_first), unbatched, math,
                   rnn_graph.enabled() if xp is np else rnn_graph.usable(xp))


# ---------------------------------------------------------------- forward

def _finish(pb: Problem, y, h_n, c_n):
    if pb.unbatched:
        y, h_n = y[:, 0], h_n[:, 0]
        c_n = c_n[:, 0] if c_n is not None else None
    elif pb.batch_first:
        y = pb.xp.ascontiguousarray(y.transpose(1, 0, 2))
    return y, h_n, c_n


def _retrying(fn, *args):
    """``fn(*args)``, run once more if a GPU ran out of memory in it while the recurrent caches (idle step-loop
    graphs, whole-call graphs, CuPy's cached blocks) held memory: those are handed back first, so what was kept for
    earlier shapes never fails a new one. A call writes only fresh arrays, so running it again is safe."""
    try:
        return fn(*args)
    except MemoryError:  # (CuPy's OutOfMemoryError is one)
        if not _release_caches():
            raise
    return fn(*args)


def _release_caches() -> bool:
    """Drops the recurrent caches and frees CuPy's cached blocks on this GPU and the engine's; whether any of it
    held memory."""
    import sys
    cupy = sys.modules.get("cupy")
    if cupy is None or cupy.cuda.get_current_stream().is_capturing():  # (a caller's capture is broken already)
        return False
    held = rnn_graph.held_bytes() + rnn_replay.held_bytes()
    rnn_graph.clear()
    rnn_replay.clear()
    from .. import session
    pool = cupy.get_default_memory_pool()
    for d in {cupy.cuda.runtime.getDevice(), *session.cuda_ordinals()}:
        with cupy.cuda.Device(d):
            held += pool.free_bytes()
            pool.free_all_blocks()
    return held > 0


def _run(*args):
    return _retrying(_run_once, *args)


def _run_once(mode, x, hx, params, num_layers, bidirectional, batch_first, lengths, proj_size, training, math,
              owned=False):
    """The forward; ``owned``: x is the call's own copy (a training state may keep it as it is)."""
    key = rnn_replay.signature(mode, x, hx, params, num_layers, bidirectional, batch_first, lengths, proj_size,
                               training, math)
    res = None
    if key is not None:  # a repeated call on CuPy arrays: one graph of the whole forward (rnn_replay.py)
        res = rnn_replay.call(key, x, hx, params, lambda xc, hc: _general(
            mode, xc, hc, params, num_layers, bidirectional, batch_first, lengths, proj_size, training, math, True),
            (lambda s, gy: _backward((mode,), s, gy, None, None)) if training else None)
    if res is None:
        res = _general(mode, x, hx, params, num_layers, bidirectional, batch_first, lengths, proj_size, training,
                       math, owned)
    if training and isinstance(res[2], Saved):
        res[2].versions = rnn_params.versions(params, res[2].problem.spec)
    return res


def _general(mode, x, hx, params, num_layers, bidirectional, batch_first, lengths, proj_size, training, math,
             owned=False):
    training = check_flag("training", training)
    pb = _problem(mode, x, hx, params, num_layers, bidirectional, batch_first, lengths, proj_size, math)
    if rnn_host.applies(pb):  # host arrays, GPUs: the CuPy path on the first GPU (None: keep the host path)
        res = rnn_host.run(lambda xd, hd, pd, lens, bf: _run_once(mode, xd, hd, pd, num_layers, bidirectional, bf,
                                                             lens, proj_size, training, math, True),
                           pb, x, hx, lengths, bool(training))
        if res is not None:
            return res
        pb.spec = rnn_params.on_host(pb.spec)  # the host path after all: GPU-resident parameters read back
    if training:  # the saved state keeps what this forward reads, not the caller's arrays (rnn_params.stash)
        pb.spec = rnn_params.stash(pb.spec, params)
        pb.x = pb.x if owned else pb.x.copy()
        _zero_padding(pb)
    y, h_n, c_n, layers = rnn_exec.forward(pb, keep=bool(training))
    y, h_n, c_n = _finish(pb, y, h_n, c_n)
    state = (h_n, c_n) if mode == "lstm" else h_n
    if training:
        return y, state, Saved(pb, layers)
    return y, state


def _zero_padding(pb: Problem) -> None:
    """Zeros in the saved x's rows past each sequence's end (the call's own copy; torch's packed sequences
    never read them): the input weights' gradient multiplies x by gate gradients that are zero there, and a
    NaN or inf left in the padding would make it NaN. One fill per run of steps with the same active rows."""
    T, B = len(pb.bs), pb.x.shape[1]
    t = 0
    while t < T:
        end = t
        while end < T and pb.bs[end] == pb.bs[t]:
            end += 1
        if pb.bs[t] < B:
            pb.x[t:end, pb.bs[t]:] = 0
        t = end


def lstm(x, hx=None, params=None, *, num_layers=1, bidirectional=False, batch_first=False, lengths=None,
         proj_size=0, training=False, math=None):
    """``torch.nn.LSTM``'s forward: returns ``(y, (h_n, c_n))`` (and the saved state with ``training=True``).

    x: (T, B, in), (B, T, in) with batch_first, or (T, in); hx: (h0, c0) of shapes (L*D, B, P or H) and
    (L*D, B, H), or None for zeros (either of the pair may be None: zeros; torch wants both); params: torch's
    names (biases optional, ``weight_hr_l*`` with proj_size)."""
    return _run("lstm", x, hx, params, num_layers, bidirectional, batch_first, lengths, proj_size, training, math)


def gru(x, hx=None, params=None, *, num_layers=1, bidirectional=False, batch_first=False, lengths=None,
        training=False, math=None):
    """``torch.nn.GRU``'s forward: returns ``(y, h_n)`` (and the saved state with ``training=True``)."""
    return _run("gru", x, hx, params, num_layers, bidirectional, batch_first, lengths, 0, training, math)


def rnn(x, hx=None, params=None, *, nonlinearity="tanh", num_layers=1, bidirectional=False, batch_first=False,
        lengths=None, training=False, math=None):
    """``torch.nn.RNN``'s forward (``nonlinearity`` "tanh" or "relu"): returns ``(y, h_n)`` (and the saved
    state with ``training=True``)."""
    if nonlinearity not in ("tanh", "relu"):
        raise ValueError(f"nonlinearity: got {nonlinearity!r}, allowed: 'tanh', 'relu'")
    return _run("rnn_" + nonlinearity, x, hx, params, num_layers, bidirectional, batch_first, lengths, 0,
                training, math)


# ---------------------------------------------------------------- backward

def _check_grad(name: str, g, shape: tuple, pb: Problem, dtype):
    if g is None:
        return None
    if not _like_x(g, pb.xp):
        raise TypeError(f"{name}: expected a {'cupy' if pb.xp is not np else 'numpy'} array like x, got "
                        f"{type(g).__name__}")
    if tuple(g.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape} (the forward output's), got {tuple(g.shape)}")
    if g.dtype != dtype:
        raise TypeError(f"{name}: dtype {dtype_text(g.dtype)} differs from the forward's {dtype}")
    return g


def _backward(modes, saved, grad_y, grad_h_n, grad_c_n):
    if isinstance(saved, rnn_host.HostSaved):  # a host call run on a GPU: host gradients in and out
        for name, g in (("grad_y", grad_y), ("grad_h_n", grad_h_n), ("grad_c_n", grad_c_n)):
            if g is not None and not isinstance(g, np.ndarray):
                raise TypeError(f"{name}: expected a numpy array like x, got {type(g).__name__}")
        import cupy
        with cupy.cuda.Device(saved.device):
            grads = _backward(modes, saved.saved, *(None if g is None else cupy.asarray(g)
                                                    for g in (grad_y, grad_h_n, grad_c_n)))
            return {k: cupy.asnumpy(v) for k, v in grads.items()}
    if not isinstance(saved, Saved):
        raise TypeError(f"saved: expected the state a forward with training=True returned, got {type(saved).__name__}")
    if saved.problem.spec.mode not in modes:
        raise ValueError(f"saved: comes from a {saved.problem.spec.mode} forward; use the matching *_backward")
    rnn_params.check_versions(saved.versions)
    grads = (grad_y, grad_h_n, grad_c_n)
    try:
        res = rnn_replay_backward.call(saved, grads, lambda sv, g: _backward_general(sv, *g))
        if res is None:  # (a replayed forward's saved state: one graph of its backward, rnn_replay_backward.py)
            res = _backward_general(saved, *grads)
    finally:  # (an error too: what was queued may still read them)
        rnn_replay.touched(saved)  # (a replayed forward's graph buffers: read until now on this stream)
    return res


def _backward_general(saved, grad_y, grad_h_n, grad_c_n):
    pb = saved.problem
    spec, (T, B, _) = pb.spec, pb.x.shape
    dtype = pb.x.dtype
    ld = spec.num_layers * spec.num_dirs
    ys = (T, spec.num_dirs * spec.out_size)
    y_shape = ys if pb.unbatched else ((B, T, ys[1]) if pb.batch_first else (T, B, ys[1]))
    h_shape = (ld, spec.out_size) if pb.unbatched else (ld, B, spec.out_size)
    c_shape = (ld, spec.hidden_size) if pb.unbatched else (ld, B, spec.hidden_size)
    gy = _check_grad("grad_y", grad_y, y_shape, pb, dtype)
    gh = _check_grad("grad_h_n", grad_h_n, h_shape, pb, dtype)
    gc = _check_grad("grad_c_n", grad_c_n, c_shape, pb, dtype) if spec.mode == "lstm" else None
    if pb.unbatched:
        gy = gy[:, None] if gy is not None else None
        gh = gh[:, None] if gh is not None else None
        gc = gc[:, None] if gc is not None else None
    elif gy is not None and pb.batch_first:
        gy = gy.transpose(1, 0, 2)
    grads = rnn_exec.backward(pb, saved.layers, gy, gh, gc)
    if pb.unbatched:
        grads["input"] = grads["input"][:, 0]
        grads["h0"] = grads["h0"][:, 0]
        if "c0" in grads:
            grads["c0"] = grads["c0"][:, 0]
    elif pb.batch_first:
        grads["input"] = pb.xp.ascontiguousarray(grads["input"].transpose(1, 0, 2))
    return grads


def lstm_backward(saved, grad_y, grad_h_n=None, grad_c_n=None) -> dict:
    """Gradients of an :func:`lstm` forward run with ``training=True``: a dict with ``"input"``, ``"h0"``,
    ``"c0"`` and every parameter under torch's name, in x's dtype. A None gradient counts as zeros."""
    return _retrying(_backward, ("lstm",), saved, grad_y, grad_h_n, grad_c_n)


def gru_backward(saved, grad_y, grad_h_n=None) -> dict:
    """Gradients of a :func:`gru` forward run with ``training=True`` (``"input"``, ``"h0"``, parameters)."""
    return _retrying(_backward, ("gru",), saved, grad_y, grad_h_n, None)


def rnn_backward(saved, grad_y, grad_h_n=None) -> dict:
    """Gradients of an :func:`rnn` forward run with ``training=True`` (``"input"``, ``"h0"``, parameters)."""
    return _retrying(_backward, ("rnn_tanh", "rnn_relu"), saved, grad_y, grad_h_n, None)
