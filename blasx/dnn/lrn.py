"""Local response normalisation across channels (AlexNet's LRN) with torch.nn.functional's formula,
and its gradient.

``y = x / d^beta``, ``d = k + alpha * mean(x^2 over the size-window of channels)``: the window of channel
c is c - size//2 .. c + (size-1)//2, zero-padded at the ends and always divided by ``size`` (torch's
avg_pool with count_include_pad). Input (N, C, ...) of 3 or more dims, C-contiguous or channels-last
(the result keeps it); any other strides are computed on a C-contiguous copy. The window sum is
``size`` shifted adds of the padded squares along the channel axis; the same array code runs on numpy
(host) and CuPy (the input's device). Half types compute in float32 and round once.
"""

from __future__ import annotations

import numpy as np

from .args import check_array, check_int, check_like, check_out, check_real
from .arrays import compute_dtype, on_device_of, xp_of
from .geometry import layout

__all__ = ["local_response_norm", "local_response_norm_backward"]


def _check(x, size, alpha, beta, k):
    check_array("input", x)
    if x.ndim < 3:
        raise ValueError(f"input: expected 3D or higher dimensionality input (N, C, ...), got shape "
                         f"{tuple(x.shape)} ({x.ndim} dimensions)")
    return check_int("size", size, 1), check_real("alpha", alpha), check_real("beta", beta), check_real("k", k)


def _channels_last(xp, a):
    """(a's view with channels as the last axis, C-contiguous where possible; whether a is channels-last)."""
    lay = layout(a)
    if lay is None:
        a = xp.ascontiguousarray(a)
    if lay == "cl":
        return a.transpose(0, *range(2, a.ndim), 1), True
    return a, False


def _window_sum(xp, s, size: int, before: int, axis: int):
    """Sum over channels c - before .. c - before + size - 1 of ``s`` along ``axis``, zero-padded."""
    c = s.shape[axis]
    pad_shape = list(s.shape)
    pad_shape[axis] = c + size - 1
    padded = xp.zeros(pad_shape, dtype=s.dtype)
    index = [slice(None)] * s.ndim
    index[axis] = slice(before, before + c)
    padded[tuple(index)] = s
    index[axis] = slice(0, c)
    acc = padded[tuple(index)].copy()
    for off in range(1, size):
        index[axis] = slice(off, off + c)
        acc += padded[tuple(index)]
    return acc


def _denominator(xp, x, size, alpha, k, axis):
    """d = k + alpha / size * window sum of x^2 (x in the compute type)."""
    d = _window_sum(xp, x * x, size, size // 2, axis)
    d *= x.dtype.type(alpha / size)
    d += x.dtype.type(k)
    return d


def _store(xp, r, cl: bool, dtype, out):
    """r (channels on ``cl``'s axis) rounded to ``dtype``, in the input's layout, or into ``out``."""
    if cl:
        r = r.transpose(0, r.ndim - 1, *range(1, r.ndim - 1))
    if out is not None:
        out[...] = r
        return out
    return r.astype(dtype, copy=False)


def local_response_norm(input, size, alpha=1e-4, beta=0.75, k=1.0, *, out=None):
    """torch.nn.functional.local_response_norm: ``input / (k + alpha * avg of input^2 over the
    size-window of channels) ** beta``. Backward: :func:`local_response_norm_backward` takes the input."""
    size, alpha, beta, k = _check(input, size, alpha, beta, k)
    xp = xp_of(input, out)
    check_out(out, input.shape, input.dtype, input, input)
    dt = np.dtype(input.dtype)
    with on_device_of(input):
        if input.size == 0:  # torch returns the input itself
            return input if out is None else out
        v, cl = _channels_last(xp, input)
        axis = v.ndim - 1 if cl else 1
        x = v.astype(compute_dtype(dt), order="C")  # a copy: the input is never written
        d = _denominator(xp, x, size, alpha, k, axis)
        xp.power(d, x.dtype.type(beta), out=d)
        x /= d
        return _store(xp, x, cl, dt, out)


def local_response_norm_backward(grad_output, input, size, alpha=1e-4, beta=0.75, k=1.0, *, out=None):
    """The input's gradient of :func:`local_response_norm`: with ``d`` its denominator base,
    ``g * d^-beta - 2 * alpha * beta / size * x * sum over the windows holding x of g * x * d^(-beta-1)``."""
    size, alpha, beta, k = _check(input, size, alpha, beta, k)
    check_like("grad_output", grad_output, "input", input)
    xp = xp_of(grad_output, input, out)
    check_out(out, input.shape, input.dtype, input, input, grad_output)
    dt = np.dtype(input.dtype)
    with on_device_of(input):
        if input.size == 0:
            return xp.empty_like(input) if out is None else out
        v, cl = _channels_last(xp, input)
        gv = grad_output.transpose(0, *range(2, input.ndim), 1) if cl else grad_output  # the same axes
        axis = v.ndim - 1 if cl else 1
        ct = compute_dtype(dt)
        x = v.astype(ct, order="C")
        g = gv.astype(ct, order="C")  # in x's memory order
        d = _denominator(xp, x, size, alpha, k, axis)
        dpow = xp.power(d, ct.type(-beta))  # d^-beta
        t = g * x
        t *= dpow
        t /= d  # g x d^(-beta-1)
        back = _window_sum(xp, t, size, (size - 1) // 2, axis)  # the windows that hold each channel
        back *= x
        back *= ct.type(2 * alpha * beta / size)
        g *= dpow
        g -= back
        return _store(xp, g, cl, dt, out)
