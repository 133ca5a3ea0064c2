"""Dropout (torch.nn.functional.dropout's semantics) with a seeded keep-mask returned for backward.

Training keeps each element with probability 1 - p (a Bernoulli mask drawn from numpy's Generator on the
host, CuPy's RandomState on the array's device; the same seed gives the same mask on the same array
module) and scales kept values by 1 / (1 - p): ``y = x * mask * scale``, so a NaN stays NaN even where
dropped, as in torch. Half types compute in float32 and round once.
"""

from __future__ import annotations

import numpy as np

from .args import check_array, check_flag, check_inplace, check_int, check_out, check_real
from .arrays import compute_dtype, on_device_of, xp_of

__all__ = ["dropout", "dropout_backward"]


def _p(p) -> float:
    p = check_real("p", p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p: dropout probability has to be between 0 and 1, but got {p}")
    return p


def _scale(p: float, dt) -> np.generic:
    """1 / (1 - p) in the compute type (0 for p = 1), as torch divides its mask by 1 - p."""
    ct = compute_dtype(dt).type
    return ct(0) if p == 1 else ct(1) / ct(1 - p)


def _mask(xp, shape, p: float, seed):
    """Keep (True) with probability 1 - p: a uniform draw >= p."""
    if p == 0:
        return xp.ones(shape, dtype=bool)
    if p == 1:
        return xp.zeros(shape, dtype=bool)
    if xp is np:
        u = np.random.default_rng(seed).random(shape, dtype=np.float32)
    else:
        u = xp.random.RandomState(seed).random_sample(shape, dtype=np.float32)
    return xp.asarray(u >= np.float32(p))  # an array for 0-d input too (numpy compares to a scalar)


_KERNEL = {}  # compute type -> its kernel


def _apply(xp, x, mask, scale, y):
    """y = x * mask * scale (computed in scale's type, rounded once to y's)."""
    if xp is np:
        r = x.astype(compute_dtype(x.dtype), copy=False) * mask
        r *= scale
        y[...] = r
        return y
    ct = compute_dtype(x.dtype)
    # the compute type is spelled out: CuPy cannot infer a type placeholder used by scalars only
    ftype, cname = ("float64", "double") if ct == np.float64 else ("float32", "float")
    if ftype not in _KERNEL:
        _KERNEL[ftype] = xp.ElementwiseKernel(f"T x, bool m, {ftype} s", "T y",
                                              f"y = (T)(({cname})x * ({cname})m * s)", f"blasx_dropout_{ftype}")
    _KERNEL[ftype](x, mask, ct.type(scale), y)
    return y


def dropout(input, p=0.5, training=True, inplace=False, *, seed=None, return_mask=False, out=None):
    """torch.nn.functional.dropout: in training, ``input * mask / (1 - p)`` with a Bernoulli(1 - p) mask;
    with ``training=False`` or p = 0 the input itself is returned (as torch does; copied into ``out``
    where given). p = 1 gives ``input * 0``. ``seed`` (an int >= 0, or None for fresh entropy) seeds the
    mask. ``return_mask=True`` returns ``(result, mask)``, the boolean keep-mask of the input's shape (all
    True without training) that :func:`dropout_backward` takes."""
    check_array("input", input)
    p = _p(p)
    training = check_flag("training", training)
    inplace = check_inplace(inplace, input, out)
    return_mask = check_flag("return_mask", return_mask)
    if seed is not None:
        check_int("seed", seed, 0)
    xp = xp_of(input, out)
    check_out(out, input.shape, input.dtype, input, input)
    with on_device_of(input):
        if not training or p == 0 or input.size == 0:
            mask = xp.ones(input.shape, dtype=bool) if return_mask else None
            y = input
            if out is not None:
                out[...] = input
                y = out
        else:
            mask = _mask(xp, input.shape, p, seed)
            y = input if inplace else out if out is not None else xp.empty_like(input)
            _apply(xp, input, mask, _scale(p, input.dtype), y)
    return (y, mask) if return_mask else y


def dropout_backward(grad_output, mask, p, training=True, *, out=None):
    """The input's gradient ``grad_output * mask / (1 - p)`` (0 * grad_output for p = 1), from the mask
    :func:`dropout` returned; with ``training=False`` or p = 0 (dropout was the identity) grad_output
    itself (copied into ``out`` where given)."""
    check_array("grad_output", grad_output)
    p = _p(p)
    training = check_flag("training", training)
    if type(mask) is not type(grad_output) or np.dtype(getattr(mask, "dtype", None)) != np.bool_:
        raise TypeError(f"mask: got {type(mask).__name__} of dtype {getattr(mask, 'dtype', None)}; expected "
                        f"the boolean {type(grad_output).__module__} array dropout returned")
    if tuple(mask.shape) != tuple(grad_output.shape):
        raise ValueError(f"mask: expected grad_output's shape {tuple(grad_output.shape)}, got {tuple(mask.shape)}")
    xp = xp_of(grad_output, mask, out)
    check_out(out, grad_output.shape, grad_output.dtype, grad_output, grad_output)
    with on_device_of(grad_output):
        if not training or p == 0:
            if out is None:
                return grad_output
            out[...] = grad_output
            return out
        y = out if out is not None else xp.empty_like(grad_output)
        return _apply(xp, grad_output, mask, _scale(p, grad_output.dtype), y)
