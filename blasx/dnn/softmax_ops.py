"""softmax and log_softmax along any dim (torch.nn.functional's semantics) and their gradients.

Numerically stable: the row maximum is subtracted before exp. ``dtype=`` casts the input first (as
torch does); half types compute in float32 and round once. The same array code runs on numpy (host)
and CuPy (its reductions and elementwise kernels on the input's device). The result is C-contiguous,
as torch's is for any input layout.
"""

from __future__ import annotations

import warnings

import numpy as np

from .args import check_array, check_dim, check_dtype_arg, check_like, check_out
from .arrays import compute_dtype, on_device_of, xp_of

__all__ = ["softmax", "log_softmax", "softmax_backward", "log_softmax_backward"]


def _dim(name: str, dim, ndim: int) -> int:
    if dim is None:  # torch's deprecated implicit choice, with its warning
        warnings.warn(f"Implicit dimension choice for {name} has been deprecated. "
                      "Change the call to include dim=X as an argument.", UserWarning, stacklevel=4)
        return 0 if ndim in (0, 1, 3) else 1
    return check_dim("dim", dim, ndim)


def _result(xp, r, shape, dtype, out):
    """``r`` (compute type) rounded to ``dtype`` as a C-contiguous array of ``shape``, or into ``out``."""
    r = r.reshape(shape)
    if out is not None:
        out[...] = r
        return out
    return r.astype(dtype, order="C", copy=False)


def _forward(name: str, log: bool, input, dim, dtype, out):
    check_array("input", input)
    xp = xp_of(input, out)
    dim = _dim(name, dim, input.ndim)
    dt = np.dtype(input.dtype) if dtype is None else check_dtype_arg("dtype", dtype)
    check_out(out, input.shape, dt, input, input)
    with on_device_of(input):
        if input.size == 0:
            return out if out is not None else xp.empty(input.shape, dtype=dt)
        x = input.astype(dt, copy=False).astype(compute_dtype(dt), copy=False)
        x = x.reshape(1) if x.ndim == 0 else x
        r = x - x.max(axis=dim, keepdims=True)  # a new array: the input is never written
        if log:
            r -= xp.log(xp.exp(r).sum(axis=dim, keepdims=True))
        else:
            xp.exp(r, out=r)
            r /= r.sum(axis=dim, keepdims=True)
        return _result(xp, r, input.shape, dt, out)


def softmax(input, dim=None, dtype=None, *, out=None):
    """exp(x) / sum(exp(x)) along ``dim`` (None: torch's deprecated implicit choice, with its warning:
    dim 0 for 0-, 1- and 3-D input, else 1). ``dtype``: cast the input to it first; the result's type.
    Backward: :func:`softmax_backward` takes the result."""
    return _forward("softmax", False, input, dim, dtype, out)


def log_softmax(input, dim=None, dtype=None, *, out=None):
    """x - log(sum(exp(x))) along ``dim`` (as :func:`softmax`). Backward: :func:`log_softmax_backward`
    takes the result."""
    return _forward("log_softmax", True, input, dim, dtype, out)


def _backward(log: bool, grad_output, output, dim, input_dtype, out):
    check_array("grad_output", grad_output)
    check_like("output", output, "grad_output", grad_output)
    xp = xp_of(grad_output, output, out)
    dim = check_dim("dim", dim, grad_output.ndim)
    dt = np.dtype(grad_output.dtype) if input_dtype is None else check_dtype_arg("input_dtype", input_dtype)
    check_out(out, grad_output.shape, dt, grad_output, grad_output, output)
    with on_device_of(grad_output):
        if grad_output.size == 0:
            return out if out is not None else xp.empty(grad_output.shape, dtype=dt)
        ct = compute_dtype(grad_output.dtype)
        g, y = (a.astype(ct, copy=False) for a in (grad_output, output))
        g, y = (a.reshape(1) if a.ndim == 0 else a for a in (g, y))
        if log:  # g - exp(y) * sum(g)
            r = xp.exp(y)
            r *= g.sum(axis=dim, keepdims=True)
            r = g - r
        else:  # y * (g - sum(g * y))
            r = g * y
            r = y * (g - r.sum(axis=dim, keepdims=True))
        return _result(xp, r, grad_output.shape, dt, out)


def softmax_backward(grad_output, output, dim, *, input_dtype=None, out=None):
    """The input's gradient ``output * (grad_output - sum(grad_output * output, dim))`` from softmax's
    ``output`` (torch's _softmax_backward_data). ``input_dtype``: the forward input's type when
    ``dtype=`` cast it (the gradient's type; default grad_output's)."""
    return _backward(False, grad_output, output, dim, input_dtype, out)


def log_softmax_backward(grad_output, output, dim, *, input_dtype=None, out=None):
    """The input's gradient ``grad_output - exp(output) * sum(grad_output, dim)`` from log_softmax's
    ``output`` (torch's _log_softmax_backward_data); ``input_dtype`` as in :func:`softmax_backward`."""
    return _backward(True, grad_output, output, dim, input_dtype, out)
