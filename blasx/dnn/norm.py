"""Normalisation layers with torch.nn.functional's names, arguments and results: ``batch_norm``
(per-activation for (N, C) input, spatial otherwise; training with batch statistics and momentum-updated
running statistics, or inference with the running ones), ``layer_norm`` and ``group_norm``, each with a
``*_backward`` returning (grad_input, grad_weight, grad_bias).

Inputs are numpy (host) or CuPy arrays (the work runs on that array's GPU as CuPy kernels, norm_kernels.py),
NCHW or channels-last (kept by batch_norm and group_norm, as torch does; layer_norm's output is C-contiguous,
as torch's), of float64, float32, float16 or bfloat16. Statistics and arithmetic run in float32 for the half
types (float64 for float64), the variance in two passes (mean, then mean squared deviation); each result is
rounded once. Parameters (weight, bias, running statistics) have the input's type or -- for float16/bfloat16
input -- all float32, torch's mixed-type rule. Statistics handed to backward are in the compute type.
"""

from __future__ import annotations

import math

import numpy as np

from .args import (check_array, check_count, check_flag, check_kind, check_like, check_out, check_real,
                   check_same_device, check_shape)
from .arrays import compute_dtype, on_device_of, xp_of
from .geometry import layout
from .norm_kernels import ops, store, to_compute

__all__ = ["batch_norm", "batch_norm_backward", "layer_norm", "layer_norm_backward", "group_norm",
           "group_norm_backward"]

_SHAPES = "(N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W)"


# ---------------------------------------------------------------- validation

def _input(x, min_ndim: int, what: str) -> np.dtype:
    dt = check_array("input", x)
    if x.ndim < min_ndim:
        raise ValueError(f"input: expected {what}, got shape {tuple(x.shape)}")
    return dt


def _is_half(dt) -> bool:
    return dt.itemsize == 2


def _params(xdt: np.dtype, **params) -> None:
    """Each given parameter (name=(array, expected shape)) has its shape; all have x's type or, for half x,
    all float32 (torch's rule)."""
    dts = {}
    for name, (a, shape) in params.items():
        if a is None:
            continue
        check_kind(name, a)
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")
        dts[name] = np.dtype(a.dtype)
    if _is_half(xdt) and dts and all(d == np.float32 for d in dts.values()):
        return
    for name, d in dts.items():
        if d != xdt:
            allowed = xdt.name + (" (or float32 for every parameter)" if _is_half(xdt) else "")
            raise TypeError(f"{name}: dtype {d.name} does not match input's {xdt.name}; parameters given "
                            f"({', '.join(dts)}) must all be {allowed}")


def _stats(name: str, a, size: int, shape):
    """A statistic saved by forward: ``size`` values of a float type, returned reshaped to ``shape``."""
    if a is None:
        raise ValueError(f"{name}: expected an array, got None")
    check_array(name, a)
    if a.size != size:
        raise ValueError(f"{name}: expected {size} values (shape {tuple(shape)}), got shape {tuple(a.shape)}")
    return a


def _prepared(xp, x):
    """x itself when NCHW or channels-last (results keep its layout), else a C-contiguous copy."""
    return x if layout(x) is not None else xp.ascontiguousarray(x)


def _cast(xp, src, dtype):
    """A new array of ``dtype`` holding the compute-type ``src`` (rounded once)."""
    dst = xp.empty(src.shape, dtype=dtype)
    store(dst, src)
    return dst


def _moments(k, x, axes, count: int):
    """(mean, sum of squared deviations) over ``axes`` (keepdims, compute type): a two-pass variance."""
    mean = k.scaled_sum(x, 1.0, axes) / count
    return mean, k.sqdev_sum(x, mean, axes)


def _vec(v, shape, unit: float):
    """A parameter in the compute type shaped to broadcast, or ``unit`` where absent."""
    return unit if v is None else to_compute(v).reshape(shape)


# ---------------------------------------------------------------- batch_norm

def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5,
               *, num_batches_tracked=None, return_stats=False, out=None):
    """torch.nn.functional.batch_norm: per channel of ``input`` (N, C, *) (per activation for (N, C)),
    ``(x - mean) / sqrt(var + eps) * weight + bias``.

    training=True normalises with the batch's mean and biased variance and, where running_mean/var are given
    (both or neither), updates them in place as torch does: ``r = (1 - f) * r + f * stat`` with the unbiased
    variance and ``f = momentum``. ``num_batches_tracked`` (keyword-only; a one-element integer array like
    torch's BatchNorm buffer) is incremented in place on every training call with them (an empty batch too,
    which updates nothing, as torch's BatchNorm), and momentum=None then means
    torch's cumulative average ``f = 1 / num_batches_tracked``; momentum=None without it is an error.
    training=False normalises with the running statistics (required).

    Returns the output (``out`` if given), or with return_stats=True ``(out, save_mean, save_invstd)``: the
    (C,) mean and 1/sqrt(var + eps) used (the batch's when training, the running ones otherwise), in the
    compute type, for :func:`batch_norm_backward`.
    """
    x = input
    xdt = _input(x, 2, _SHAPES)
    c = x.shape[1]
    _params(xdt, weight=(weight, (c,)), bias=(bias, (c,)), running_mean=(running_mean, (c,)),
            running_var=(running_var, (c,)))
    xp = xp_of(x, running_mean, running_var, weight, bias, num_batches_tracked, out)
    training = check_flag("training", training)
    return_stats = check_flag("return_stats", return_stats)
    eps = check_real("eps", eps, 0.0, finite=True)
    if training and eps <= 0:  # (a constant channel would divide by zero; torch refuses it too)
        raise ValueError(f"eps: must be positive during training, got {eps}")
    if momentum is not None:
        momentum = check_real("momentum", momentum, finite=True)
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean, running_var: must either both be None or neither be None")
    if not training and running_mean is None:
        raise ValueError("running_mean: must be given in evaluation mode (training=False)")
    count = x.size // c if c else 0
    if training and count == 1:
        raise ValueError(f"input: expected more than 1 value per channel when training, got shape {tuple(x.shape)}")
    if num_batches_tracked is not None:
        check_kind("num_batches_tracked", num_batches_tracked)
        if num_batches_tracked.dtype.kind not in "iu" or num_batches_tracked.size != 1:
            raise TypeError(f"num_batches_tracked: expected a one-element integer array, got dtype "
                            f"{num_batches_tracked.dtype} shape {tuple(num_batches_tracked.shape)}")
    updating = training and running_mean is not None and count > 0  # (torch leaves them for an empty batch)
    if updating and momentum is None and num_batches_tracked is None:
        raise ValueError("momentum: None (cumulative average) needs num_batches_tracked (a one-element integer "
                         "array, incremented in place) to count the batches")
    if training and running_mean is not None:  # (updated in place: all writable before any is written)
        for name, v in (("running_mean", running_mean), ("running_var", running_var),
                        ("num_batches_tracked", num_batches_tracked)):
            if v is not None and not getattr(v.flags, "writeable", True):
                raise ValueError(f"{name}: is read-only; batch_norm updates it in place when training")
    check_out(out, x.shape, x.dtype, x, x)
    check_same_device(x, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias,
                 num_batches_tracked=num_batches_tracked, out=out)
    with on_device_of(x):
        x = _prepared(xp, x)
        y = out if out is not None else xp.empty_like(x)
        axes, bshape = (0, *range(2, x.ndim)), (1, c) + (1,) * (x.ndim - 2)
        k = ops(xp)
        if training:
            mean, sqdev = _moments(k, x, axes, max(count, 1))
            invstd = 1.0 / xp.sqrt(sqdev / max(count, 1) + eps)
            if running_mean is not None and num_batches_tracked is not None:
                num_batches_tracked += 1  # as torch's BatchNorm: on every training call, an empty batch too
            if updating:
                f = momentum if momentum is not None else 1.0 / num_batches_tracked.astype(compute_dtype(xdt))
                f = f.reshape(()) if not isinstance(f, float) else f
                store(running_mean, f * mean.reshape(c) + (1 - f) * to_compute(running_mean))
                unbiased = sqdev.reshape(c) / (count - 1)
                store(running_var, f * unbiased + (1 - f) * to_compute(running_var))
        else:
            mean = to_compute(running_mean).reshape(bshape).copy()
            invstd = 1.0 / xp.sqrt(to_compute(running_var).reshape(bshape) + eps)
        k.affine(x, mean, invstd, _vec(weight, bshape, 1.0), _vec(bias, bshape, 0.0), y)
    return (y, mean.reshape(c), invstd.reshape(c)) if return_stats else y


def batch_norm_backward(grad_output, input, weight, save_mean, save_invstd, training=True, eps=1e-5, *,
                        running_mean=None, running_var=None):
    """The gradients of :func:`batch_norm`: ``(grad_input, grad_weight, grad_bias)``.

    ``save_mean``/``save_invstd`` are what batch_norm(..., return_stats=True) returned. training=False
    (the statistics were constants) uses running_mean and 1/sqrt(running_var + eps) where they are given,
    as torch does, else save_mean/save_invstd. grad_input has input's type and layout; grad_weight
    (None without weight) and grad_bias (the sum of grad_output per channel) have weight's type, or
    input's without weight.
    """
    x = input
    xdt = _input(x, 2, _SHAPES)
    c = x.shape[1]
    check_like("grad_output", grad_output, "input", x)
    _params(xdt, weight=(weight, (c,)), running_mean=(running_mean, (c,)), running_var=(running_var, (c,)))
    training = check_flag("training", training)
    eps = check_real("eps", eps, 0.0, finite=True)
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean, running_var: must either both be None or neither be None")
    use_running = not training and running_mean is not None
    if not use_running:
        _stats("save_mean", save_mean, c, (c,))
        _stats("save_invstd", save_invstd, c, (c,))
    xp = xp_of(grad_output, x, weight, running_mean, running_var, *(() if use_running else (save_mean, save_invstd)))
    check_same_device(x, grad_output=grad_output, weight=weight, running_mean=running_mean, running_var=running_var,
                 save_mean=None if use_running else save_mean, save_invstd=None if use_running else save_invstd)
    count = max(x.size // c if c else 0, 1)
    with on_device_of(x):
        x = _prepared(xp, x)
        axes, bshape = (0, *range(2, x.ndim)), (1, c) + (1,) * (x.ndim - 2)
        if use_running:
            m = to_compute(running_mean).reshape(bshape)
            s = 1.0 / xp.sqrt(to_compute(running_var).reshape(bshape) + eps)
        else:
            m, s = to_compute(save_mean, xdt).reshape(bshape), to_compute(save_invstd, xdt).reshape(bshape)
        k = ops(xp)
        w = _vec(weight, bshape, 1.0)
        sum_g = k.scaled_sum(grad_output, 1.0, axes)
        sum_gx = k.dot_sum(grad_output, x, m, s, 1.0, axes)
        a, cc = (w * sum_g / count, w * sum_gx / count) if training else (0.0, 0.0)
        grad_input = xp.empty_like(x)
        k.grad_input(grad_output, x, m, s, w, a, cc, grad_input)
        pdt = weight.dtype if weight is not None else x.dtype
        grad_weight = None if weight is None else _cast(xp, sum_gx.reshape(c), pdt)
        return grad_input, grad_weight, _cast(xp, sum_g.reshape(c), pdt)


# ---------------------------------------------------------------- layer_norm

def _normalized_shape(value) -> tuple[int, ...]:
    shape = check_shape("normalized_shape", value, allowed="an int or a tuple of non-negative ints", scalar=True)
    if not shape:
        raise ValueError("normalized_shape: got (); it must contain at least one dimension")
    return shape


def _layer_shape(x, normalized_shape):
    """(normalized_shape, the reduced trailing axes, the count reduced) after torch's checks."""
    shape = _normalized_shape(normalized_shape)
    _input(x, len(shape), f"at least {len(shape)} dimensions (normalized_shape={shape})")
    if tuple(x.shape[x.ndim - len(shape):]) != shape:
        raise ValueError(f"input: normalized_shape={shape} expects input of shape (*, {', '.join(map(str, shape))}), "
                         f"got {tuple(x.shape)}")
    return shape, tuple(range(x.ndim - len(shape), x.ndim)), max(math.prod(shape), 1)


def _affine_norm_args(x, weight, bias, shape, eps, return_stats, out) -> tuple:
    """(array module, eps, return_stats) of layer_norm / group_norm, every argument checked before any work:
    weight and bias of ``shape``, eps a finite real (torch's take a negative one too: where var + eps < 0, NaN),
    out x's shape and type overlapping no input, all on x's device."""
    _params(np.dtype(x.dtype), weight=(weight, shape), bias=(bias, shape))
    xp = xp_of(x, weight, bias, out)
    eps = check_real("eps", eps, finite=True)
    return_stats = check_flag("return_stats", return_stats)
    check_out(out, x.shape, x.dtype, x, x)
    check_same_device(x, weight=weight, bias=bias, out=out)
    return xp, eps, return_stats


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, *, return_stats=False, out=None):
    """torch.nn.functional.layer_norm: ``(x - mean) / sqrt(var + eps) * weight + bias`` with the statistics
    over the trailing ``normalized_shape`` dimensions of each sample; weight and bias have that shape.

    Returns the output (C-contiguous; ``out`` if given), or with return_stats=True ``(out, mean, rstd)``: the
    statistics of shape ``input.shape[:-k] + (1,) * k`` (torch's), compute type, for
    :func:`layer_norm_backward`.
    """
    x = input
    shape, axes, count = _layer_shape(x, normalized_shape)
    xp, eps, return_stats = _affine_norm_args(x, weight, bias, shape, eps, return_stats, out)
    with on_device_of(x):
        x = xp.ascontiguousarray(x)
        y = out if out is not None else xp.empty(x.shape, dtype=x.dtype)
        k = ops(xp)
        mean, sqdev = _moments(k, x, axes, count)
        rstd = 1.0 / xp.sqrt(sqdev / count + eps)
        k.affine(x, mean, rstd, _vec(weight, shape, 1.0), _vec(bias, shape, 0.0), y)
    return (y, mean, rstd) if return_stats else y


def layer_norm_backward(grad_output, input, normalized_shape, weight, mean, rstd):
    """The gradients of :func:`layer_norm`: ``(grad_input, grad_weight, grad_bias)`` from the ``mean`` and
    ``rstd`` that layer_norm(..., return_stats=True) returned. grad_input is C-contiguous of input's type;
    grad_weight (None without weight) and grad_bias have normalized_shape and weight's type (input's
    without weight)."""
    x = input
    shape, axes, count = _layer_shape(x, normalized_shape)
    check_like("grad_output", grad_output, "input", x)
    _params(np.dtype(x.dtype), weight=(weight, shape))
    lead = tuple(range(x.ndim - len(shape)))
    keep = tuple(x.shape[:len(lead)]) + (1,) * len(shape)
    _stats("mean", mean, math.prod(keep), keep)
    _stats("rstd", rstd, math.prod(keep), keep)
    xp = xp_of(grad_output, x, weight, mean, rstd)
    check_same_device(x, grad_output=grad_output, weight=weight, mean=mean, rstd=rstd)
    with on_device_of(x):
        grad_input = xp.empty(x.shape, dtype=x.dtype)
        # one leading unit axis: the per-element sums reduce over at least one axis
        x, g, gi = xp.ascontiguousarray(x)[None], grad_output[None], grad_input[None]
        axes, lead = tuple(a + 1 for a in axes), (0, *(a + 1 for a in lead))
        m, s = to_compute(mean, x.dtype).reshape((1, *keep)), to_compute(rstd, x.dtype).reshape((1, *keep))
        k = ops(xp)
        w = _vec(weight, shape, 1.0)
        a = k.scaled_sum(g, w, axes) / count
        c = k.dot_sum(g, x, m, s, w, axes) / count
        k.grad_input(g, x, m, s, w, a, c, gi)
        pdt = weight.dtype if weight is not None else x.dtype
        grad_weight = None if weight is None else _cast(xp, k.dot_sum(g, x, m, s, 1.0, lead).reshape(shape), pdt)
        return grad_input, grad_weight, _cast(xp, k.scaled_sum(g, 1.0, lead).reshape(shape), pdt)


# ---------------------------------------------------------------- group_norm

def _groups(x, num_groups, forward: bool = False) -> int:
    _input(x, 2, "(N, C, *)")
    g = check_count("num_groups", num_groups)
    if forward and x.shape[0] * x.shape[1] // g * math.prod(x.shape[2:]) == 1:  # F.group_norm's check, first
        raise ValueError(f"input: expected more than 1 value per channel when training (N * C // num_groups "
                         f"* spatial size must not be 1), got shape {tuple(x.shape)} with num_groups={g}")
    if x.shape[1] % g:
        raise ValueError(f"num_groups: input's {x.shape[1]} channels (shape {tuple(x.shape)}) are not divisible "
                         f"by num_groups={g}")
    return g


def _split(a, g: int):
    """(N, C, *) as the view (N, G, C/G, *)."""
    n, c = a.shape[:2]
    return a.reshape(n, g, c // g, *a.shape[2:])


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, *, return_stats=False, out=None):
    """torch.nn.functional.group_norm: the C channels of ``input`` (N, C, *) in ``num_groups`` groups, each
    (sample, group) normalised by its own mean and variance, then ``* weight + bias`` per channel.

    Returns the output (input's layout; ``out`` if given), or with return_stats=True ``(out, mean, rstd)``:
    the (N, num_groups) statistics, compute type, for :func:`group_norm_backward`.
    """
    x = input
    g = _groups(x, num_groups, forward=True)
    n, c = x.shape[:2]
    xp, eps, return_stats = _affine_norm_args(x, weight, bias, (c,), eps, return_stats, out)
    with on_device_of(x):
        x = _prepared(xp, x)
        y = out if out is not None else xp.empty_like(x)
        v, yv = _split(x, g), _split(y, g)
        axes, wshape = tuple(range(2, v.ndim)), (1, g, c // g) + (1,) * (x.ndim - 2)
        count = max((x.size // n) // g if n else 0, 1)
        k = ops(xp)
        mean, sqdev = _moments(k, v, axes, count)
        rstd = 1.0 / xp.sqrt(sqdev / count + eps)
        k.affine(v, mean, rstd, _vec(weight, wshape, 1.0), _vec(bias, wshape, 0.0), yv)
    return (y, mean.reshape(n, g), rstd.reshape(n, g)) if return_stats else y


def group_norm_backward(grad_output, input, num_groups, weight, mean, rstd):
    """The gradients of :func:`group_norm`: ``(grad_input, grad_weight, grad_bias)`` from the (N, num_groups)
    ``mean`` and ``rstd`` that group_norm(..., return_stats=True) returned. grad_input has input's type and
    layout; grad_weight (None without weight) and grad_bias are (C,) of weight's type (input's without)."""
    x = input
    g = _groups(x, num_groups)
    n, c = x.shape[:2]
    check_like("grad_output", grad_output, "input", x)
    _params(np.dtype(x.dtype), weight=(weight, (c,)))
    _stats("mean", mean, n * g, (n, g))
    _stats("rstd", rstd, n * g, (n, g))
    xp = xp_of(grad_output, x, weight, mean, rstd)
    check_same_device(x, grad_output=grad_output, weight=weight, mean=mean, rstd=rstd)
    with on_device_of(x):
        x = _prepared(xp, x)
        v, gv = _split(x, g), _split(grad_output, g)
        axes, wshape = tuple(range(2, v.ndim)), (1, g, c // g) + (1,) * (x.ndim - 2)
        per_channel = (0, *range(3, v.ndim))
        count = max((x.size // n) // g if n else 0, 1)
        keep = (n, g) + (1,) * (v.ndim - 2)
        m, s = to_compute(mean, x.dtype).reshape(keep), to_compute(rstd, x.dtype).reshape(keep)
        k = ops(xp)
        w = _vec(weight, wshape, 1.0)
        a = k.scaled_sum(gv, w, axes) / count
        cc = k.dot_sum(gv, v, m, s, w, axes) / count
        grad_input = xp.empty_like(x)
        k.grad_input(gv, v, m, s, w, a, cc, _split(grad_input, g))
        pdt = weight.dtype if weight is not None else x.dtype
        grad_weight = None if weight is None else _cast(xp, k.dot_sum(gv, v, m, s, 1.0, per_channel).reshape(c), pdt)
        return grad_input, grad_weight, _cast(xp, k.scaled_sum(gv, 1.0, per_channel).reshape(c), pdt)
