"""The tensor plumbing of a network: ``add`` (residual sums; torch.add's broadcasting and alpha), ``cat``
(torch.cat) and ``flatten`` (torch.flatten), with their gradients.

Mixed element types promote as torch's do (float16 with bfloat16 gives float32); half types compute in
float32 and round once. ``add`` on CuPy arrays is one ElementwiseKernel, ``cat`` one concatenate on the
inputs' device. Layouts follow torch: add's result takes the layout of the first operand of the full
shape, cat's is channels-last where every input is (4-D and 5-D), flatten returns a view where the
strides allow one.
"""

from __future__ import annotations

import numbers
from math import prod

import numpy as np

from .args import check_array, check_dim, check_dtype_arg, check_out, check_real, check_shape
from .arrays import compute_dtype, on_device_of, xp_of
from .geometry import layout

__all__ = ["add", "add_backward", "cat", "cat_backward", "flatten", "flatten_backward"]

_RANK = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}


def promote(*dtypes) -> np.dtype:
    """torch's result type of floating arrays of these types (float16 with bfloat16: float32)."""
    out = np.dtype(dtypes[0])
    for dt in map(np.dtype, dtypes[1:]):
        if dt != out:
            ra, rb = _RANK[out.name], _RANK[dt.name]
            out = out if ra > rb else dt if rb > ra else np.dtype(np.float32)
    return out


def _shape(name: str, value) -> tuple[int, ...]:
    return check_shape(name, value, bad_element=TypeError)


# ---------------------------------------------------------------- add

_ADD = {}  # compute type -> its kernel


def add(input, other, *, alpha=1, out=None):
    """``input + alpha * other`` with broadcasting (torch.add); ``other`` an array or a real number.
    Backward: :func:`add_backward`."""
    dt = check_array("input", input)
    if isinstance(other, numbers.Real) and not isinstance(other, (bool, np.bool_)):
        scalar = True
    else:
        scalar = False
        dt_other = check_array("other", other)
        if other.ndim == 0 and input.ndim:  # (torch: a 0-d tensor of the same kind promotes no dimensioned one)
            pass
        elif input.ndim == 0 and other.ndim:
            dt = dt_other
        else:
            dt = promote(dt, dt_other)
    alpha = check_real("alpha", alpha)
    xp = xp_of(input, None if scalar else other, out)
    try:
        shape = tuple(np.broadcast_shapes(input.shape, () if scalar else other.shape))
    except ValueError:
        raise ValueError(f"other: shape {tuple(other.shape)} does not broadcast with input's "
                         f"{tuple(input.shape)}") from None
    check_out(out, shape, dt, input, input, None if scalar else other)
    ct = compute_dtype(dt)
    with on_device_of(input):
        if out is None:
            like = next((a for a in ((input,) if scalar else (input, other)) if tuple(a.shape) == shape), None)
            out = xp.empty_like(like, dtype=dt) if like is not None else xp.empty(shape, dtype=dt)
        b = ct.type(other) if scalar else other
        if xp is np:
            b = b.astype(ct, copy=False) if not scalar else b
            r = b * ct.type(alpha) if alpha != 1 else b
            if out.dtype == ct:
                np.add(input.astype(ct, copy=False), r, out=out)
            else:
                out[...] = input.astype(ct, copy=False) + r
            return out
        # the compute type is spelled out: CuPy cannot infer a type placeholder used by scalars only
        ftype, cname = ("float64", "double") if ct == np.float64 else ("float32", "float")
        if ftype not in _ADD:
            _ADD[ftype] = xp.ElementwiseKernel(f"T x, U o, {ftype} a", "R y",
                                               f"y = (R)(({cname})x + a * ({cname})o)", f"blasx_add_{ftype}")
        _ADD[ftype](input, xp.asarray(b) if scalar else b, ct.type(alpha), out)  # a 0-d array: U is inferred
        return out


def _sum_to(xp, g, shape):
    """g summed over the dims broadcasting added to ``shape`` (in float32 for half types)."""
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1)
    if not axes:
        return g
    return g.astype(compute_dtype(g.dtype), copy=False).sum(axis=axes).reshape(shape).astype(g.dtype)


def add_backward(grad_output, input_shape, other_shape=None, alpha=1, *, input_dtype=None, other_dtype=None):
    """(grad of input, grad of other) of :func:`add`: grad_output summed to each operand's shape, times
    ``alpha`` for other (None where ``other_shape`` is None: a scalar). Where no sum nor scaling is
    needed the grad is grad_output itself, as in torch. ``input_dtype``/``other_dtype``: the operands'
    types where they differed from the result's (each grad is returned in it)."""
    check_array("grad_output", grad_output)
    ishape = _shape("input_shape", input_shape)
    oshape = None if other_shape is None else _shape("other_shape", other_shape)
    alpha = check_real("alpha", alpha)
    idt = None if input_dtype is None else check_dtype_arg("input_dtype", input_dtype)
    odt = None if other_dtype is None else check_dtype_arg("other_dtype", other_dtype)
    for name, s in (("input_shape", ishape), ("other_shape", oshape)):
        if s is not None and (len(s) > grad_output.ndim
                              or any(a not in (1, b) for a, b in zip(s[::-1], grad_output.shape[::-1]))):
            raise ValueError(f"{name}: {s} does not broadcast to grad_output's shape {tuple(grad_output.shape)}")
    xp = xp_of(grad_output)

    def cast(a, dt):
        return a if dt is None or dt == a.dtype else a.astype(dt)
    with on_device_of(grad_output):
        gi = cast(_sum_to(xp, grad_output, ishape), idt)
        if oshape is None:
            return gi, None
        go = _sum_to(xp, grad_output, oshape)
        if alpha != 1:
            ct = compute_dtype(go.dtype)
            go = (go.astype(ct, copy=False) * ct.type(alpha)).astype(go.dtype, copy=False)
        return gi, cast(go, odt)


# ---------------------------------------------------------------- cat

def cat(tensors, dim=0, *, out=None):
    """torch.cat: the arrays joined along ``dim`` (all other sizes equal; 1-D empty arrays skipped, as
    torch's legacy rule). Backward: :func:`cat_backward`."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise TypeError(f"tensors: got {tensors!r:.80}, expected a non-empty list or tuple of arrays")
    dts = [check_array(f"tensors[{i}]", t) for i, t in enumerate(tensors)]
    xp = xp_of(*tensors, out)
    dt = promote(*dts)
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:
        check_out(out, (0,), dt, tensors[0], *tensors, alias=False)
        return out if out is not None else xp.empty((0,), dtype=dt)
    first = kept[0]
    for i, t in enumerate(tensors):
        if t.ndim == 0:
            raise ValueError(f"tensors[{i}]: a zero-dimensional array cannot be concatenated")
    dim = check_dim("dim", dim, first.ndim)
    for i, t in enumerate(tensors):
        if t is first or (t.ndim == 1 and t.shape[0] == 0):
            continue
        if t.ndim != first.ndim or any(a != b for j, (a, b) in enumerate(zip(t.shape, first.shape)) if j != dim):
            raise ValueError(f"tensors[{i}]: sizes must match except in dimension {dim}; got shape "
                             f"{tuple(t.shape)}, the first array's is {tuple(first.shape)}")
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in kept)
    check_out(out, shape, dt, first, *tensors, alias=False)
    with on_device_of(first):
        if out is None:
            if first.ndim in (4, 5) and all(layout(t) == "cl" for t in kept):
                moved = xp.empty((shape[0], *shape[2:], shape[1]), dtype=dt)
                out = moved.transpose(0, first.ndim - 1, *range(1, first.ndim - 1))
            else:
                out = xp.empty(shape, dtype=dt)
        xp.concatenate([t.astype(dt, copy=False) for t in kept], axis=dim, out=out)
    return out


def cat_backward(grad_output, sizes, dim=0, *, dtypes=None):
    """The inputs' grads of :func:`cat`: views of grad_output, one per input, of ``sizes[i]`` along
    ``dim`` (as torch's narrow); ``dtypes``: each input's type where it differed (that grad is cast)."""
    check_array("grad_output", grad_output)
    dim = check_dim("dim", dim, grad_output.ndim)
    sizes = _shape("sizes", sizes)
    if sum(sizes) != grad_output.shape[dim]:
        raise ValueError(f"sizes: {sizes} add up to {sum(sizes)}, not grad_output's size "
                         f"{grad_output.shape[dim]} in dimension {dim}")
    if dtypes is not None and len(dtypes) != len(sizes):
        raise ValueError(f"dtypes: got {len(dtypes)} types for {len(sizes)} sizes")
    dts = [None if d is None else check_dtype_arg(f"dtypes[{i}]", d)
           for i, d in enumerate(dtypes or [None] * len(sizes))]
    grads, start = [], 0
    with on_device_of(grad_output):
        for size, dt in zip(sizes, dts):
            index = [slice(None)] * grad_output.ndim
            index[dim] = slice(start, start + size)
            g = grad_output[tuple(index)]
            grads.append(g if dt is None or dt == g.dtype else g.astype(dt))
            start += size
    return grads


# ---------------------------------------------------------------- flatten

def flatten(input, start_dim=0, end_dim=-1):
    """torch.flatten: dims start_dim .. end_dim merged into one; a view where the strides allow one
    (input itself where nothing merges), else a copy; a 0-D input gives a 1-element 1-D array.
    Backward: :func:`flatten_backward`."""
    check_array("input", input)
    start = check_dim("start_dim", start_dim, input.ndim)
    end = check_dim("end_dim", end_dim, input.ndim)
    if start > end:
        raise ValueError(f"start_dim: {start_dim} (dim {start}) cannot come after end_dim {end_dim} (dim {end})")
    if input.ndim == 0:
        return input.reshape(1)
    if start == end:
        return input
    shape = input.shape
    with on_device_of(input):
        return input.reshape(*shape[:start], prod(shape[start:end + 1]), *shape[end + 1:])


def flatten_backward(grad_output, input_shape):
    """The input's grad of :func:`flatten`: grad_output reshaped to ``input_shape`` (a view where possible)."""
    check_array("grad_output", grad_output)
    shape = _shape("input_shape", input_shape)
    if prod(shape) != grad_output.size:
        raise ValueError(f"input_shape: {shape} has {prod(shape)} elements; grad_output has {grad_output.size}")
    with on_device_of(grad_output):
        return grad_output.reshape(shape)
