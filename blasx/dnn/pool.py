"""blasx.dnn pooling: torch.nn.functional's max, average and adaptive pools over 1-3 spatial dims, and their
backward passes.

Inputs are numpy (computed on the host, vectorised) or CuPy arrays (one CUDA kernel on the array's GPU, the
result there), batched ``(N, C, *spatial)`` or unbatched ``(C, *spatial)``, C-contiguous or channels-last (an
NCHW-shaped view of N(spatial)C memory; results keep the layout; other strides are copied to C-contiguous), of
float64, float32, float16 or bfloat16 (numpy only: CuPy has no bfloat16); half types compute in float32 and
round once. Results equal torch's: output sizes and checks, ceil_mode, the average's divisor, the max pools'
indices (int64 flat positions in the input's spatial plane of each (n, c)) and NaN handling (NaN wins).

Forwards take a keyword-only ``out`` (written and returned; with ``return_indices`` an array for the values or a
(values, indices) pair).
Backward passes take what forward took plus, for max pools, the indices it returned (call forward with
``return_indices=True``); ``input_shape`` is the forward input's shape or the input itself (its values are not
read). They return the input's gradient in the input's layout where the input is given, else in grad_output's.
A max-pool window over padding alone (possible with ceil_mode, dilation and padding) has no input position: its
gradient goes nowhere (torch adds it at the wrapped index its forward gave).
"""

from __future__ import annotations

from math import prod

import numpy as np

from ..checks import shares_memory
from . import pool_kernels as kernels
from .args import check_array, check_flag, check_out, check_shape
from .arrays import on_device_of, xp_of
from .geometry import is_layout, layout
from .pool_geometry import adaptive, check_input, empty_windows, shape_of, window

__all__ = [f"{p}{nd}d{s}" for p in ("max_pool", "avg_pool", "adaptive_avg_pool", "adaptive_max_pool")
           for nd in (1, 2, 3) for s in ("", "_backward")]


# ---------------------------------------------------------------- layouts

def _work_shape(n: int, c: int, size, lay: str) -> tuple[int, ...]:
    """The working form's shape (pool_kernels.py): (N*C, S1, S2, S3, 1) or (N, S1, S2, S3, C)."""
    s3 = (1,) * (3 - len(size)) + tuple(size)
    return (n, *s3, c) if lay == "cl" else (n * c, *s3, 1)


def _view(a, nd: int, lay: str):
    """The batched array ``a``, which is in layout ``lay``, as its working form (a view)."""
    n, c, *size = a.shape
    if lay == "cl":
        a = a.transpose(0, *range(2, nd + 2), 1)
    return a.reshape(_work_shape(n, c, size, lay))


def _working(xp, a, nd: int, lay: str):
    """The batched array ``a`` in layout ``lay`` (copied if it is not) as its working form."""
    if not is_layout(a, lay):
        moved = a.transpose(0, *range(2, nd + 2), 1) if lay == "cl" else a
        a = xp.ascontiguousarray(moved)
        a = a.transpose(0, nd + 1, *range(1, nd + 1)) if lay == "cl" else a
    return _view(a, nd, lay)


def _unwork(w, n: int, c: int, size, lay: str):
    """A working-form array as the (N, C, *size) array it holds, in layout ``lay``."""
    nd = len(size)
    if lay == "cl":
        return w.reshape(n, *size, c).transpose(0, nd + 1, *range(1, nd + 1))
    return w.reshape(n, c, *size)


def _batched(a, unbatched: bool):
    return None if a is None else (a[None] if unbatched else a)


# ---------------------------------------------------------------- checks

def _outs(out, with_indices: bool, shape, dtype, x):
    """(values, indices) destinations of a forward's ``out`` (each None where not given), checked."""
    if out is None:
        return None, None
    if with_indices and isinstance(out, (tuple, list)):
        if len(out) != 2:
            raise ValueError(f"out: with return_indices, expected an array or a (values, indices) pair, got "
                             f"{len(out)} items")
        if out[0] is None or out[1] is None:
            raise TypeError("out: with return_indices, expected an array or a (values, indices) pair of arrays, "
                            "got a None in the pair")
        check_out(out[0], shape, dtype, x, x, alias=False, name="out[0]")
        check_out(out[1], shape, np.int64, x, x, alias=False, name="out[1]")
        if shares_memory(out[0], out[1]):
            raise ValueError("out: the values array out[0] and the indices array out[1] overlap")
        return out[0], out[1]
    check_out(out, shape, dtype, x, x, alias=False)
    return out, None


def _shape_arg(value) -> tuple[int, ...]:
    """``input_shape``: a shape or the input array (its shape)."""
    return check_shape("input_shape", getattr(value, "shape", value),
                       allowed="a shape (a tuple of non-negative ints) or the input array")


# ---------------------------------------------------------------- the two passes

def _forward(fn: str, nd: int, x, geo_of, with_indices: bool, out):
    """The pool ``geo_of(spatial size)`` of ``x``: its values, and indices where ``with_indices``."""
    n, c, size, unbatched = check_input(fn, nd, x)
    geo = geo_of(size)
    with_indices = check_flag("return_indices", with_indices)
    dt = np.dtype(x.dtype)
    shape = (n, c, *geo.out_size)
    y_out, i_out = _outs(out, with_indices, shape[1:] if unbatched else shape, dt, x)
    xp = xp_of(x, y_out, i_out)
    xb = _batched(x, unbatched)
    lay = layout(xb) or "nchw"
    with on_device_of(x):
        xw = _working(xp, xb, nd, lay)
        yw, y_copy = _dest(xp, _batched(y_out, unbatched), n, c, geo.out_size, lay, dt)
        iw, i_copy = _dest(xp, _batched(i_out, unbatched), n, c, geo.out_size, lay, np.int64) if with_indices \
            else (None, None)
        kernels.forward(geo.lifted(), xw, yw, iw)
        y = _finish(yw, y_out, y_copy, n, c, geo.out_size, lay, unbatched)
        if not with_indices:
            return y
        return y, _finish(iw, i_out, i_copy, n, c, geo.out_size, lay, unbatched)


def _dest(xp, dest, n, c, size, lay, dtype):
    """(the working array a result is written to, whether it must then be copied to ``dest``): ``dest``'s own
    memory where it is in layout ``lay``, else a new array."""
    if dest is not None and is_layout(dest, lay):
        return _view(dest, len(size), lay), False
    return xp.empty(_work_shape(n, c, size, lay), dtype=dtype), dest is not None


def _finish(w, dest, copy: bool, n, c, size, lay, unbatched):
    """The result held by the working array ``w``: ``dest`` (the caller's out) where given, written if ``copy``."""
    arr = _unwork(w, n, c, size, lay)
    if dest is None:
        return arr[0] if unbatched else arr
    if copy:
        dest[...] = arr[0] if unbatched else arr
    return dest


def _backward(fn: str, nd: int, grad_output, input_shape, geo_of, indices=None):
    """The input's gradient of the pool ``geo_of(spatial size)`` for ``grad_output`` (max pools: scattered
    at ``indices``)."""
    dt = check_array("grad_output", grad_output)
    n, c, size, unbatched = shape_of(fn, nd, "input_shape", _shape_arg(input_shape))
    geo = geo_of(size)
    want = (n, c, *geo.out_size)[1 if unbatched else 0:]
    if tuple(grad_output.shape) != want:
        raise ValueError(f"grad_output: expected shape {want} (the pool of input_shape "
                         f"{_shape_arg(input_shape)}), got {tuple(grad_output.shape)}")
    xp = xp_of(grad_output, indices)
    if geo.reduce == "max" and indices is None:
        raise TypeError(f"{fn}: indices is required (forward's, returned with return_indices=True)")
    if indices is not None:
        if tuple(getattr(indices, "shape", ())) != want:
            raise ValueError(f"indices: expected shape {want} (grad_output's), got "
                             f"{tuple(getattr(indices, 'shape', ()))}")
        if np.dtype(indices.dtype).kind not in "iu":
            raise TypeError(f"indices: expected an integer array (int64, as forward returns), got {indices.dtype}")
        plane = prod(size)
        empty = empty_windows(geo)  # windows over padding alone: their index is past the plane, unread
        with on_device_of(indices):  # the reduction runs on the indices' GPU, not the current one
            if empty is not None:
                keep = xp.asarray(~empty)
                indices = xp.where(keep, indices, 0)
                cleared = xp.empty_like(grad_output)  # (its layout kept; zeros put, not multiplied: inf * 0 is NaN)
                cleared[...] = grad_output
                xp.copyto(cleared, grad_output.dtype.type(0), where=~keep)
                grad_output = cleared
            lo, hi = (int(indices.min()), int(indices.max())) if indices.size else (0, 0)
        if indices.size and not (0 <= lo and hi < plane):
            raise ValueError(f"indices: values must lie in [0, {plane}) (positions in the input's spatial plane "
                             f"{size}), got [{lo}, {hi}]")
    gb = _batched(grad_output, unbatched)
    given = _batched(input_shape, unbatched) if hasattr(input_shape, "flags") else None
    lay = (given is not None and layout(given)) or layout(gb) or "nchw"
    with on_device_of(grad_output):
        gw = _working(xp, gb, nd, lay)
        giw = xp.empty(_work_shape(n, c, size, lay), dtype=dt)
        if indices is None:
            kernels.avg_backward(geo.lifted(), gw, giw)
        else:
            iw = _working(xp, _batched(indices, unbatched).astype(np.int64, copy=False), nd, lay)
            kernels.max_backward(geo.lifted(), gw, iw, giw)
        gi = _unwork(giw, n, c, size, lay)
    return gi[0] if unbatched else gi


# ---------------------------------------------------------------- max pools

def _max_geo(fn, nd, kernel_size, stride, padding, dilation, ceil_mode):
    return lambda size: window(fn, nd, size, "max", kernel_size, stride, padding, dilation, ceil_mode)


def max_pool1d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False, *,
               out=None):
    """torch.nn.functional.max_pool1d; with ``return_indices`` also the indices max_pool1d_backward takes."""
    return _forward("max_pool1d", 1, input, _max_geo("max_pool1d", 1, kernel_size, stride, padding, dilation,
                                                     ceil_mode), return_indices, out)


def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False, *,
               out=None):
    """torch.nn.functional.max_pool2d; with ``return_indices`` also the indices max_pool2d_backward takes."""
    return _forward("max_pool2d", 2, input, _max_geo("max_pool2d", 2, kernel_size, stride, padding, dilation,
                                                     ceil_mode), return_indices, out)


def max_pool3d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False, *,
               out=None):
    """torch.nn.functional.max_pool3d; with ``return_indices`` also the indices max_pool3d_backward takes."""
    return _forward("max_pool3d", 3, input, _max_geo("max_pool3d", 3, kernel_size, stride, padding, dilation,
                                                     ceil_mode), return_indices, out)


def max_pool1d_backward(grad_output, input_shape, indices, kernel_size, stride=None, padding=0, dilation=1,
                        ceil_mode=False):
    """The input's gradient of max_pool1d: grad_output added at forward's ``indices`` (overlaps accumulate)."""
    return _backward("max_pool1d_backward", 1, grad_output, input_shape,
                     _max_geo("max_pool1d_backward", 1, kernel_size, stride, padding, dilation, ceil_mode), indices)


def max_pool2d_backward(grad_output, input_shape, indices, kernel_size, stride=None, padding=0, dilation=1,
                        ceil_mode=False):
    """The input's gradient of max_pool2d: grad_output added at forward's ``indices`` (overlaps accumulate)."""
    return _backward("max_pool2d_backward", 2, grad_output, input_shape,
                     _max_geo("max_pool2d_backward", 2, kernel_size, stride, padding, dilation, ceil_mode), indices)


def max_pool3d_backward(grad_output, input_shape, indices, kernel_size, stride=None, padding=0, dilation=1,
                        ceil_mode=False):
    """The input's gradient of max_pool3d: grad_output added at forward's ``indices`` (overlaps accumulate)."""
    return _backward("max_pool3d_backward", 3, grad_output, input_shape,
                     _max_geo("max_pool3d_backward", 3, kernel_size, stride, padding, dilation, ceil_mode), indices)


# ---------------------------------------------------------------- average pools

def _avg_geo(fn, nd, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return lambda size: window(fn, nd, size, "avg", kernel_size, stride, padding, 1, ceil_mode, count_include_pad,
                               divisor_override)


def avg_pool1d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True, *, out=None):
    """torch.nn.functional.avg_pool1d (which has no divisor_override)."""
    return _forward("avg_pool1d", 1, input, _avg_geo("avg_pool1d", 1, kernel_size, stride, padding, ceil_mode,
                                                     count_include_pad, None), False, out)


def avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None, *, out=None):
    """torch.nn.functional.avg_pool2d."""
    return _forward("avg_pool2d", 2, input, _avg_geo("avg_pool2d", 2, kernel_size, stride, padding, ceil_mode,
                                                     count_include_pad, divisor_override), False, out)


def avg_pool3d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None, *, out=None):
    """torch.nn.functional.avg_pool3d."""
    return _forward("avg_pool3d", 3, input, _avg_geo("avg_pool3d", 3, kernel_size, stride, padding, ceil_mode,
                                                     count_include_pad, divisor_override), False, out)


def avg_pool1d_backward(grad_output, input_shape, kernel_size, stride=None, padding=0, ceil_mode=False,
                        count_include_pad=True):
    """The input's gradient of avg_pool1d (forward's arguments; nothing saved)."""
    return _backward("avg_pool1d_backward", 1, grad_output, input_shape,
                     _avg_geo("avg_pool1d_backward", 1, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              None))


def avg_pool2d_backward(grad_output, input_shape, kernel_size, stride=None, padding=0, ceil_mode=False,
                        count_include_pad=True, divisor_override=None):
    """The input's gradient of avg_pool2d (forward's arguments; nothing saved)."""
    return _backward("avg_pool2d_backward", 2, grad_output, input_shape,
                     _avg_geo("avg_pool2d_backward", 2, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              divisor_override))


def avg_pool3d_backward(grad_output, input_shape, kernel_size, stride=None, padding=0, ceil_mode=False,
                        count_include_pad=True, divisor_override=None):
    """The input's gradient of avg_pool3d (forward's arguments; nothing saved)."""
    return _backward("avg_pool3d_backward", 3, grad_output, input_shape,
                     _avg_geo("avg_pool3d_backward", 3, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              divisor_override))


# ---------------------------------------------------------------- adaptive pools

def _adaptive_geo(fn, nd, reduce, output_size):
    return lambda size: adaptive(fn, nd, size, reduce, output_size)


def adaptive_avg_pool1d(input, output_size, *, out=None):
    """torch.nn.functional.adaptive_avg_pool1d."""
    return _forward("adaptive_avg_pool1d", 1, input, _adaptive_geo("adaptive_avg_pool1d", 1, "avg", output_size),
                    False, out)


def adaptive_avg_pool2d(input, output_size, *, out=None):
    """torch.nn.functional.adaptive_avg_pool2d (an output_size of None keeps that dim's size)."""
    return _forward("adaptive_avg_pool2d", 2, input, _adaptive_geo("adaptive_avg_pool2d", 2, "avg", output_size),
                    False, out)


def adaptive_avg_pool3d(input, output_size, *, out=None):
    """torch.nn.functional.adaptive_avg_pool3d (an output_size of None keeps that dim's size)."""
    return _forward("adaptive_avg_pool3d", 3, input, _adaptive_geo("adaptive_avg_pool3d", 3, "avg", output_size),
                    False, out)


def adaptive_max_pool1d(input, output_size, return_indices=False, *, out=None):
    """torch.nn.functional.adaptive_max_pool1d; with ``return_indices`` also the indices its backward takes."""
    return _forward("adaptive_max_pool1d", 1, input, _adaptive_geo("adaptive_max_pool1d", 1, "max", output_size),
                    return_indices, out)


def adaptive_max_pool2d(input, output_size, return_indices=False, *, out=None):
    """torch.nn.functional.adaptive_max_pool2d; with ``return_indices`` also the indices its backward takes."""
    return _forward("adaptive_max_pool2d", 2, input, _adaptive_geo("adaptive_max_pool2d", 2, "max", output_size),
                    return_indices, out)


def adaptive_max_pool3d(input, output_size, return_indices=False, *, out=None):
    """torch.nn.functional.adaptive_max_pool3d; with ``return_indices`` also the indices its backward takes."""
    return _forward("adaptive_max_pool3d", 3, input, _adaptive_geo("adaptive_max_pool3d", 3, "max", output_size),
                    return_indices, out)


def adaptive_avg_pool1d_backward(grad_output, input_shape):
    """The input's gradient of adaptive_avg_pool1d (the output size is grad_output's)."""
    return _adaptive_backward("adaptive_avg_pool1d_backward", 1, "avg", grad_output, input_shape)


def adaptive_avg_pool2d_backward(grad_output, input_shape):
    """The input's gradient of adaptive_avg_pool2d (the output size is grad_output's)."""
    return _adaptive_backward("adaptive_avg_pool2d_backward", 2, "avg", grad_output, input_shape)


def adaptive_avg_pool3d_backward(grad_output, input_shape):
    """The input's gradient of adaptive_avg_pool3d (the output size is grad_output's)."""
    return _adaptive_backward("adaptive_avg_pool3d_backward", 3, "avg", grad_output, input_shape)


def adaptive_max_pool1d_backward(grad_output, input_shape, indices):
    """The input's gradient of adaptive_max_pool1d: grad_output added at forward's ``indices``."""
    return _adaptive_backward("adaptive_max_pool1d_backward", 1, "max", grad_output, input_shape, indices)


def adaptive_max_pool2d_backward(grad_output, input_shape, indices):
    """The input's gradient of adaptive_max_pool2d: grad_output added at forward's ``indices``."""
    return _adaptive_backward("adaptive_max_pool2d_backward", 2, "max", grad_output, input_shape, indices)


def adaptive_max_pool3d_backward(grad_output, input_shape, indices):
    """The input's gradient of adaptive_max_pool3d: grad_output added at forward's ``indices``."""
    return _adaptive_backward("adaptive_max_pool3d_backward", 3, "max", grad_output, input_shape, indices)


def _adaptive_backward(fn, nd, reduce, grad_output, input_shape, indices=None):
    check_array("grad_output", grad_output)
    if grad_output.ndim not in (nd + 1, nd + 2):
        raise ValueError(f"{fn}: grad_output must be {nd + 1}-D or {nd + 2}-D (the pool's output, unbatched or "
                         f"batched), got shape {tuple(grad_output.shape)}")
    out_size = tuple(grad_output.shape)[-nd:]
    return _backward(fn, nd, grad_output, input_shape, _adaptive_geo(fn, nd, reduce, out_size), indices)
