"""What the blasx.dnn tests share: host copies, relative errors, channels-last views, float64 torch tensors.

Works on numpy, CuPy and torch arrays alike (CuPy and torch are imported only where an array of theirs
is given), so the CPU and the GPU test files use the same helpers."""

from __future__ import annotations

import contextlib

import numpy as np

try:
    from ml_dtypes import bfloat16
except ImportError:
    bfloat16 = None

#: the element types of the elementwise tests, and their tolerances
DTYPES = [np.float64, np.float32, np.float16] + ([bfloat16] if bfloat16 is not None else [])
TOL = {"float64": 1e-13, "float32": 3e-6, "float16": 2e-3, "bfloat16": 1.6e-2}

#: standalone activation -> (extra arguments for ours and torch's, the activation table's name)
ACTS = {
    "relu": ({}, "relu"), "relu6": ({}, "relu6"), "leaky_relu": ({"negative_slope": 0.2}, "leaky_relu"),
    "elu": ({"alpha": 0.7}, "elu"), "gelu": ({"approximate": "none"}, "gelu"),
    "gelu_tanh": ({"approximate": "tanh"}, "gelu_tanh"), "silu": ({}, "silu"), "sigmoid": ({}, "sigmoid"),
    "tanh": ({}, "tanh"), "hardswish": ({}, "hardswish"), "hardsigmoid": ({}, "hardsigmoid"),
}


def geometry(n, c, k, size, kernel, stride=1, padding=0, dilation=1, dtype=np.float16):
    """The ConvGeometry of a one-group convolution of (n, c, *size) by (k, c, *kernel), from broadcast zeros."""
    from blasx.dnn.geometry import conv_geometry
    x = np.broadcast_to(np.zeros((), dtype), (n, c, *size))
    w = np.broadcast_to(np.zeros((), dtype), (k, c, *kernel))
    return conv_geometry("conv", len(size), x, w, stride, padding, dilation, 1)


def act_fn(name: str) -> str:
    """The blasx.dnn / torch function of an ACTS entry (gelu_tanh is gelu with approximate="tanh")."""
    return "gelu" if name == "gelu_tanh" else name


def dtype_name(t) -> str:
    return np.dtype(t).name


def host(x):
    """x as a numpy array: a CuPy array copied to the host, a torch tensor detached."""
    mod = type(x).__module__
    if mod.startswith("cupy"):
        return x.get()
    if mod.startswith("torch"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def rel(x, ref) -> float:
    """Relative-norm error of x against ref, in float64; their shapes must agree."""
    x, ref = np.asarray(host(x), np.float64), np.asarray(host(ref), np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-300))


def cl(x):
    """x as channels-last (an NCHW-shaped view of N...C memory), on x's device."""
    xp = __import__("cupy") if type(x).__module__.startswith("cupy") else np
    return xp.ascontiguousarray(xp.moveaxis(x, 1, -1)).transpose(0, x.ndim - 1, *range(1, x.ndim - 1))


def is_cl(y) -> bool:
    """Whether y is channels-last."""
    return y.transpose(0, *range(2, y.ndim), 1).flags.c_contiguous


def wide(x, grad: bool = False):
    """A float64 torch tensor of x's values (a copy), tracking gradients when ``grad``."""
    import torch
    t = torch.from_numpy(np.asarray(host(x), np.float64).copy())
    return t.requires_grad_() if grad else t


def rand(rng, shape, dtype=np.float64, loc=0.0):
    """Standard normal values (shifted by ``loc``) of ``dtype``."""
    return (loc + rng.standard_normal(shape)).astype(dtype)


def check_norm_stats_cast(to_device=lambda a: a) -> None:
    """Statistics handed back in another float type (float64 for float32 data) are cast to the compute type:
    batch, group and layer norm backward give the gradients they give with the forward's own statistics."""
    from blasx import dnn
    rng = np.random.default_rng(9)
    x, g = to_device(rand(rng, (3, 4, 5), np.float32)), to_device(rand(rng, (3, 4, 5), np.float32))
    w = to_device(rand(rng, (4,), np.float32))
    for fwd, bwd in ((lambda: dnn.batch_norm(x, None, None, w, training=True, return_stats=True),
                      lambda m, s: dnn.batch_norm_backward(g, x, w, m, s)),
                     (lambda: dnn.group_norm(x, 2, w, return_stats=True),
                      lambda m, s: dnn.group_norm_backward(g, x, 2, w, m, s)),
                     (lambda: dnn.layer_norm(x, 5, return_stats=True),
                      lambda m, s: dnn.layer_norm_backward(g, x, 5, None, m, s))):
        _, m, s = fwd()
        ref = bwd(m, s)
        got = bwd(m.astype(np.float64), s.astype(np.float64))
        assert all(r is None and q is None or (q.dtype == r.dtype and rel(q, r) < 1e-6) for q, r in zip(got, ref))


def memory(a, cl: bool):
    """An (N, C, ...) array's memory in the layout, flat: NCHW, or N(spatial)C for channels-last."""
    return np.ascontiguousarray(np.moveaxis(a, 1, -1) if cl else a).ravel()


def from_memory(flat, shape, cl: bool):
    """The (N, C, ...) array of ``shape`` whose memory in the layout is ``flat`` (memory's inverse)."""
    if not cl:
        return flat.reshape(shape)
    return np.moveaxis(flat.reshape(shape[0], *shape[2:], shape[1]), -1, 1)


def leaves(r, path="result"):
    """(path, leaf) of every non-container value in nested dicts, tuples and lists (dict keys sorted)."""
    if isinstance(r, dict):
        for k in sorted(r, key=str):
            yield from leaves(r[k], f"{path}[{k!r}]")
    elif isinstance(r, (tuple, list)):
        for i, v in enumerate(r):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, r


@contextlib.contextmanager
def poisoned_empty(module, poison):
    """``module.empty`` / ``module.empty_like`` (numpy's or CuPy's) return ``poison(array)`` while it lasts."""
    real, real_like = module.empty, module.empty_like
    module.empty = lambda *a, **k: poison(real(*a, **k))
    module.empty_like = lambda *a, **k: poison(real_like(*a, **k))
    try:
        yield
    finally:
        module.empty, module.empty_like = real, real_like
