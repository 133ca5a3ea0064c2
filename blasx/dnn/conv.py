"""blasx.dnn's front end: torch.nn.functional-style convolutions lowered to GEMM tile tasks on the engine,
or, for CuPy operands of one GPU, to a few cuBLAS calls there (conv_direct.py; depthwise ones to one
kernel, depthwise.py).

Every function validates everything first (geometry.py; nothing is computed or written on error, the
caller's arrays are never modified), lays the operands out as the planners want them (runtime/plans/conv.py)
and submits one engine call for all groups (transposed convolutions and backward-data:
conv_transpose.py). Weights are small: they are reshaped, permuted (channels-last:
reduction order (r, s, c)) or flipped (transposed convolutions) on the host side
of the call; activations are only read, through the derived im2col operand (im2col.py).
"""

from __future__ import annotations

from functools import partial
from math import prod

import numpy as np

from .. import dispatch, perfdb, precision
from ..operands import array_module, is_cupy
from ..runtime import dtypes
from ..runtime.plans import plan_conv_forward, plan_conv_weight
from ..runtime.activations import parse_activation
from ..runtime.tiling import n_tiles
from . import conv_direct, conv_memo, depthwise, direct_cache, direct_epilogue, host_batch, transpose_kernel
from .args import check_count, check_dtype, check_kind, check_out, check_shape
from .arrays import on_device_of as _on_device_of, xp_of as _xp
from .epilogue import Affine, device_affine, make_epilogue
from .geometry import ConvGeometry, call_layout, conv_geometry, is_layout, layout
from .im2col import Im2col

MAX_ROWS_HINT = 2048  # pixel columns the tile choice sees at most where the CPU alone runs (one tile a call)


# ---------------------------------------------------------------- helpers

def _batched(x, nd: int):
    """(x with a batch dim, whether it was added)."""
    return (x[None], True) if x.ndim == nd + 1 else (x, False)


def _x_view(x, lay: str):
    """X's memory as a compact column-major 2-D view (the im2col source)."""
    n, c = x.shape[:2]
    size = prod(x.shape[2:])
    if lay == "cl":
        return x.transpose(0, *range(2, x.ndim), 1).reshape(n * size, c).T
    return x.reshape(n * c, size).T


def _empty(xp, shape, dtype, lay: str):
    return _empty_maker(xp, shape, dtype, lay)()


def _empty_maker(xp, shape, dtype, lay: str):
    """A function returning a new uninitialised array of ``shape`` in layout ``lay`` (shapes worked out once:
    a replayed call makes its output with it)."""
    if lay == "nchw":
        return partial(xp.empty, shape, dtype)
    moved, axes = (shape[0], *shape[2:], shape[1]), (0, len(shape) - 1, *range(1, len(shape) - 1))
    return lambda: xp.empty(moved, dtype).transpose(axes)


def _channel_vector(name: str, v, k: int, dtype, xp):
    """A per-output-channel vector, checked: numpy, or a CuPy array for CuPy x (kept on its device: the device
    route reads it there with no wait for the GPU)."""
    if v is None:
        return None
    if not hasattr(v, "shape") or tuple(v.shape) != (k,):
        raise ValueError(f"{name}: expected shape ({k},) (one value per output channel), got "
                         f"{getattr(v, 'shape', type(v).__name__)}")
    if is_cupy(v):
        if xp is np:
            raise TypeError(f"{name}: got a cupy array; x is numpy (a numpy vector serves a cupy x too)")
        if not dtypes.is_real(v.dtype):
            raise TypeError(f"{name}: got a cupy array of {v.dtype.name}; allowed: a real (integer or floating) vector")
        return v
    a = np.asarray(v)
    if not dtypes.is_real(a.dtype):
        raise TypeError(f"{name}: got an array of {a.dtype}; allowed: a real (integer or floating) vector")
    return a


_VECTORS = ("bias", "scale", "shift")


def _check_layout(out, lay: str) -> None:
    """A batched ``out`` has x's layout (results are written in place, never copied back)."""
    if not is_layout(out, lay):
        want = "C-contiguous (NCHW)" if lay == "nchw" else "channels-last (an NCHW-shaped view of NHWC memory)"
        raise ValueError(f"out: must be {want}, like x; got strides {out.strides}")


def _rows_hint(rows: int) -> int:
    """The pixel extent the tile choice sees: all of it where the engine has streamed devices (their
    tiles should be large: each task costs the engine a fixed time), capped for the CPU alone."""
    from .. import session
    if any(d.streamed for d in session.engine().devices):
        return rows
    return min(rows, MAX_ROWS_HINT)


def _name(dtype, fn: str) -> str:
    return dtypes.prefix(dtype) + fn


_GEOMETRIES = direct_cache.table(1024)
_ACTIVATIONS = direct_cache.table(64)


def _plain(v):
    """``v`` where it is an int, a str or a tuple of ints (a key part that equals only itself), else None."""
    if type(v) is int or type(v) is str or (type(v) is tuple and all(type(e) is int for e in v)):
        return v
    return None


def _geometry(fn: str, nd: int, x, weight, stride, padding, dilation, groups) -> ConvGeometry:
    """conv_geometry's result, kept per arguments where they are plain (a repeat passed its checks)."""
    args = (stride, padding, dilation, groups)
    if any(_plain(a) is None for a in args):
        return conv_geometry(fn, nd, x, weight, *args)
    key = (fn, nd, tuple(x.shape), tuple(weight.shape), np.dtype(x.dtype), np.dtype(weight.dtype),
           *((type(a), a) for a in args))
    return _GEOMETRIES.get(key, lambda: conv_geometry(fn, nd, x, weight, *args))


def _activation(activation):
    """parse_activation's result, kept per name."""
    if type(activation) is not str:
        return parse_activation(activation)
    return _ACTIVATIONS.get(activation, lambda: parse_activation(activation))


# ---------------------------------------------------------------- the one engine call

def _forward_call(fn: str, geo: ConvGeometry, x, lay: str, wconv, y, residual, epilogue_args, math,
                  user_weight: bool = False):
    """y = conv(x, wconv) on the engine: x (N, C, ...) in layout ``lay``, wconv (K, Cg, k...) in the
    forward form, y (and residual) in layout ``lay``; ``epilogue_args`` = (bias, scale, shift, act);
    ``user_weight``: wconv is the caller's weight array (its transforms may be kept, direct_cache).
    Returns (the device route's plan, the weight matrix it read) where that was the whole work (conv_memo
    may replay it), else None."""
    xp = array_module(is_cupy(x))
    dt = np.dtype(x.dtype)
    cl = lay == "cl"
    G, kg, crs, n, p = geo.groups, geo.kg, geo.crs, geo.n, geo.p
    bias, scale, shift, act = epilogue_args
    if residual is not None and scale is not None:
        # the residual starts the C tile, and a scale folded into the weights would round (bfloat16: 2**-8), overflow
        # or make inf * 0: the conv with its affine map first, then the residual and activation (torch's roundings)
        with dispatch.overflow_unreported():  # (judged on the result)
            _forward_call(fn, geo, x, lay, wconv, y, None, (bias, scale, shift, None), math, user_weight)
        _add_residual(geo, cl, y, residual, act, dt != np.float16 or xp is not np  # (the host path counts)
                      or (bool(np.isfinite(x).all()) and bool(np.isfinite(wconv).all())))
        return None
    direct_route = conv_direct.applies(x, 2.0 * n * p * geo.k * crs) and is_layout(y, lay)
    if direct_route and depthwise.applies(geo):
        depthwise.forward(geo, x, cl, wconv, y, residual, epilogue_args)  # one kernel, epilogue included
        return
    if direct_route:
        epi = device_affine(bias, scale, shift, act)
        if user_weight:  # a matrix of the weight alone: kept where the caller allows
            wrows = direct_cache.derived(wconv, ("rows", cl), lambda: conv_direct.weight_rows(xp, wconv, cl, geo.k, crs))
        else:
            wrows = conv_direct.weight_rows(xp, wconv, cl, geo.k, crs)
        plan = conv_direct.forward(geo, x, cl, wrows, y, residual, epi, math)
        return (plan, wrows) if plan is not None else None
    if cl:
        wconv = wconv.transpose(0, *range(2, wconv.ndim), 1)
    wmat = xp.ascontiguousarray(wconv).reshape(geo.k, crs).T
    ws = [wmat[:, g * kg:(g + 1) * kg] for g in range(G)]
    xs = _x_view(x, lay)
    direct = conv_direct.pointwise(geo)  # col(X) is X itself: plain GEMMs on X's memory, nothing derived
    if direct and cl:  # col_g: X's rows g*Cg.. (Cg x N*P)
        cols = [xs[g * geo.cg:(g + 1) * geo.cg] for g in range(G)]
    elif direct:  # col_g's image n (transposed): X's P x Cg block of image n, group g
        cols = [xs[:, (i * G + g) * geo.cg:(i * G + g + 1) * geo.cg] for i in range(n) for g in range(G)]
    else:
        cols = [Im2col(geo, g, cl, not cl, xs, len(ws) + G + (G if cl else 1)) for g in range(G)]
    y0 = G + len(cols)

    def ys_of(arr):
        if cl:
            mat = arr.transpose(0, *range(2, arr.ndim), 1).reshape(n * p, geo.k).T
            return [mat[g * kg:(g + 1) * kg] for g in range(G)]
        return [arr.reshape(n * geo.k, p).T]
    slots = {y0 + g: (0, g * kg, kg) for g in range(G)} if cl else {y0: (1, 0, geo.k)}
    epi = make_epilogue(bias, scale, shift, act, slots)
    views = [*ws, *cols, *ys_of(y), xs]
    res0 = None
    if residual is not None:
        res0 = len(views)
        views += ys_of(residual)
    plan = lambda tile, block: plan_conv_forward(n, p, kg, crs, G, tile, cl, w0=0, col0=G, y0=y0,  # noqa: E731
                                                 res0=res0, direct=direct and not cl)
    dispatch.submit_planned(_name(dt, fn), views, plan, dt, 1.0, 1.0 if residual is not None else 0.0,
                            (_rows_hint(n * p), geo.k, crs), math=math, epilogue=epi)


def _check_kinds(x, weight, out) -> None:
    """x, weight (and out) are numpy or CuPy arrays, named where not (before any attribute is read)."""
    check_kind("x", x)
    check_kind("weight", weight)
    if out is not None:
        check_kind("out", out)


def _add_residual(geo: ConvGeometry, cl: bool, y, residual, act, finite_sources: bool = True) -> None:
    """y = act(y + residual), computed in y's compute type (float32 for the 2-byte types) and rounded once into y
    (on y's device); float16 results beyond its range are reported as the engine reports them: an inf from a
    finite residual where the conv's inputs were finite (``finite_sources``; y's own inf was then an overflow)."""
    if is_cupy(y):
        direct_epilogue.epilogue(geo, cl, y, None if act is None else Affine(None, None, act), residual)
        return
    row = dtypes.gemm_of(y.dtype)
    v = y.astype(row.compute if row is not None else y.dtype)
    v += residual
    if act is not None:
        v = act.host(v)
    with np.errstate(over="ignore"):
        y[...] = v
    if y.dtype == np.float16:
        over = np.isinf(y) & np.isfinite(residual) & (True if finite_sources else np.isfinite(v))
        dispatch.warn_overflow(int(np.count_nonzero(over)), y.size)


def _replay_epilogue(geo: ConvGeometry, cl: bool, dt, xp, act):
    """A replay's epilogue (conv_memo.Epilogue) from the call's (bias, scale, shift, residual): the vectors checked
    as the full path checks them, then made on the device; applied on y in its layout (``cl``)."""
    def epilogue(extras):
        b, sc, sh = (_channel_vector(nm, v, geo.k, dt, xp) for nm, v in zip(_VECTORS, extras[:3]))
        res = extras[3]
        vectors = direct_epilogue.epilogue_vectors(geo, cl, dt, device_affine(b, sc, sh, act))
        return conv_memo.Epilogue(lambda y: direct_epilogue.launch_epilogue(geo, cl, y, vectors, res),
                                  (*(v.data.ptr for v in vectors[:2]), 0 if res is None else res.data.ptr))
    return epilogue


# ---------------------------------------------------------------- forward

_CONV_NAMES = {1: "conv1d", 2: "conv2d", 3: "conv3d"}
_PLAIN = (None, None, None, None, None)  # a call's activation and epilogue operands: none


def _conv(nd: int, x, weight, bias, stride, padding, dilation, groups, activation, scale, shift, residual, out,
          math):
    if out is None:  # (the replayed calls' path: no handler to install)
        return _conv_steps(nd, x, weight, bias, stride, padding, dilation, groups, activation, scale, shift,
                           residual, out, math)
    with dispatch.whole(True, steps=True):  # (Ctrl-C: the caller's out is written whole first)
        return _conv_steps(nd, x, weight, bias, stride, padding, dilation, groups, activation, scale, shift,
                           residual, out, math)


def _chunk_key(fn: str, geo: ConvGeometry, dt, dlay: str, vecs: list, act, math: str) -> tuple:
    """All that a host batch's chunk body depends on besides its arrays (host_batch.run's ``body_key``): the
    geometry but for the batch size, the type, device layout, math, the epilogue's values, the route's switches."""
    return ("conv", fn, host_batch.chunk_geometry(geo, 0), dt.str, dlay, math, act,
            tuple(None if v is None else (v.dtype.str, v.shape, v.tobytes()) for v in vecs),
            conv_direct.switches(), perfdb.generation())


def _conv_steps(nd: int, x, weight, bias, stride, padding, dilation, groups, activation, scale, shift, residual,
                out, math):
    fn = _CONV_NAMES[nd]
    _check_kinds(x, weight, out)
    extras = (bias, scale, shift, residual)
    memo = None
    if out is None and getattr(x, "ndim", 0) == nd + 2 and (activation is None or type(activation) is str) and \
            (scale is None or residual is None):  # (a scale with a residual runs in two passes: not replayed)
        plain = activation is None and bias is None and scale is None and shift is None and residual is None
        memo = conv_memo.key(fn, nd, x, weight, (stride, padding, dilation, groups), math,
                             _PLAIN if plain else (activation, *(conv_memo.operand_kind(v) for v in extras)))
    y = conv_memo.replay(memo, x, weight, extras)
    if y is not None:
        return y
    xp = _xp(x, weight, residual, out)  # bias, scale, shift: see _channel_vector
    geo = _geometry(fn, nd, x, weight, stride, padding, dilation, groups)
    act = _activation(activation)
    math = precision.check_math(math)
    dt = np.dtype(x.dtype)
    vecs = [_channel_vector(nm, v, geo.k, dt, xp) for nm, v in zip(_VECTORS, (bias, scale, shift))]
    xb, unbatched = _batched(x, nd)
    lay = call_layout(xb, out if out is not None and out.ndim == nd + 2 else None)
    shape = (geo.n, geo.k, *geo.out_size)
    user_shape = shape[1:] if unbatched else shape
    given_residual = residual
    if residual is not None:
        check_out(residual, user_shape, dt, x, name="residual", write=False)  # (only read: may be read-only)
        residual = transpose_kernel.to_layout(xp, _batched(residual, nd)[0], lay)
    check_out(out, user_shape, dt, x, x, weight, given_residual, residual, bias, scale, shift,  # (vectors are read
              alias=False)  # after out's first tiles are written; any layout of residual)
    if out is not None and out.ndim == nd + 2:
        _check_layout(out, lay)
    image_bytes = (prod(xb.shape[1:]) + prod(shape[1:]) * (1 if residual is None else 2)) * dt.itemsize
    # the routes write compact memory: an unbatched out not compact in x's layout gets the result through a buffer
    given = _batched(out, nd)[0] if out is not None else None
    direct = given is not None and is_layout(given, lay)
    if xp is np and host_batch.applies(xb, image_bytes):  # a host batch on the GPUs: chunks on the device route
        y = given if direct else host_batch.empty(shape, dt, lay)
        dlay = conv_direct.device_layout(lay, geo, dt)
        # (a scale with a residual runs in two passes, judging overflow on the host: never in a CUDA graph)
        key = None if scale is not None and residual is not None else _chunk_key(fn, geo, dt, dlay, vecs, act, math)
        host_batch.run(host_batch.Batch(transpose_kernel.to_layout(np, xb, lay), y, residual, lay, dlay), weight,
                       lambda xd, wd, yd, rd: _forward_call(fn, host_batch.chunk_geometry(geo, xd.shape[0]), xd, dlay,
                                                            wd, yd, rd, (*vecs, act), math, user_weight=True),
                       body_key=key)
        if given is not None and not direct:
            np.copyto(given, y)
        return out if out is not None else (y[0] if unbatched else y)
    dlay = lay
    with _on_device_of(x):
        if xp is not np and (scale is None or residual is None):  # (a scale with a residual: two passes, not converted)
            dlay = conv_direct.run_layout(lay, geo, dt, (xb.size + prod(shape)) * dt.itemsize)
        xb = transpose_kernel.to_layout(xp, xb, lay)
        y = given if direct else _empty(xp, shape, dt, lay)
        if dlay == lay:
            ran = _forward_call(fn, geo, xb, lay, weight, y, residual, (*vecs, act), math, user_weight=True)
        else:  # convolved in dlay, x converted on the device before and y after, then the epilogue on y
            yc = conv_direct.layout_scratch("y_in_layout", shape, dt, dlay)
            ran = _forward_call(fn, geo, conv_direct.in_layout(xb, "x_in_layout", dlay), dlay, weight, yc, None,
                                _PLAIN[:4], math, user_weight=True)
            transpose_kernel.copy(y, yc, False)
            conv_direct.finish(geo, False, y, device_affine(*vecs, act), residual, False)
        if given is not None and not direct:
            given[...] = y
    # kept where x and a residual were read where they lie; the weight too, or its matrix made from it again
    converted = dlay != lay
    if memo is not None and ran is not None and xb is x and (residual is None or residual is extras[3]):
        cl, k = lay == "cl", geo.k
        plain = act is None and all(v is None for v in extras)
        rows = None
        if converted or ran[1].data.ptr != weight.data.ptr:  # the caller's weight as the matrix the plan read
            rcl = cl or converted  # (kept beside the weight in a Workspace, direct_cache; made in the graph else)
            rows = lambda w: direct_cache.derived(w, ("rows", rcl), lambda: conv_direct.weight_rows(  # noqa: E731
                xp, w, rcl, k, geo.crs))
        epilogue = None if plain else _replay_epilogue(geo, cl, dt, xp, act)
        conv_memo.keep(memo, conv_memo.forward_replay(geo, cl or converted, dt, math, ran[0],
                                                      _empty_maker(xp, shape, dt, lay), weight_of=rows,
                                                      epilogue=epilogue, converted=converted))
    if out is not None:
        return out
    return y[0] if unbatched else y


def conv1d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, activation=None, scale=None,
           shift=None, residual=None, out=None, math=None):
    """torch.nn.functional.conv1d on the engine, with the fused epilogue (see :mod:`blasx.dnn`)."""
    return _conv(1, x, weight, bias, stride, padding, dilation, groups, activation, scale, shift, residual, out, math)


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, activation=None, scale=None,
           shift=None, residual=None, out=None, math=None):
    """torch.nn.functional.conv2d on the engine, with the fused epilogue (see :mod:`blasx.dnn`)."""
    return _conv(2, x, weight, bias, stride, padding, dilation, groups, activation, scale, shift, residual, out, math)


def conv3d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, activation=None, scale=None,
           shift=None, residual=None, out=None, math=None):
    """torch.nn.functional.conv3d on the engine, with the fused epilogue (see :mod:`blasx.dnn`)."""
    return _conv(3, x, weight, bias, stride, padding, dilation, groups, activation, scale, shift, residual, out, math)


def linear(x, weight, bias=None, *, activation=None, math=None):
    """torch.nn.functional.linear (y = x W^T + b) with an optional activation: a 1-wide conv1d. As torch's: a 1-D
    weight gives one output feature, dropped from y's shape; a bias of one value (shape () or (1,)) is every
    feature's."""
    dt = check_dtype("input", check_kind("input", x))
    if check_dtype("weight", check_kind("weight", weight)) != dt:
        raise TypeError(f"linear: input is {dt} but weight is {np.dtype(weight.dtype)}; they must match")
    if x.ndim < 1 or weight.ndim not in (1, 2):
        raise ValueError(f"linear: x must be at least 1-D and weight 1-D or 2-D, got shapes {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if weight.ndim == 1:
        y = linear(x, weight[None], bias, activation=activation, math=math)
        return y[..., 0]
    if bias is not None and hasattr(bias, "shape") and tuple(bias.shape) in ((), (1,)) and weight.shape[0] != 1:
        bias = array_module(is_cupy(bias)).broadcast_to(bias.reshape(1), (weight.shape[0],))
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x's last dimension ({x.shape[-1]}) must equal weight's in-features "
                         f"(weight.shape[1] = {weight.shape[1]}); got shapes {tuple(x.shape)}, {tuple(weight.shape)}")
    lead = x.shape[:-1]
    if weight.shape[0] == 0:  # no outputs (a convolution takes none); its other arguments checked all the same
        xp = _xp(x, weight)
        _activation(activation), precision.check_math(math), _channel_vector("bias", bias, 0, dt, xp)
        return xp.empty((*lead, 0), dtype=x.dtype)
    if x.shape[-1] == 0:  # an empty sum: one zero input feature gives torch's result (bias, activation)
        xp = _xp(x, weight)
        x, weight = xp.zeros((*lead, 1), dtype=x.dtype), xp.zeros((weight.shape[0], 1), dtype=weight.dtype)
    x2 = x.reshape(-1, x.shape[-1])[:, :, None]
    y = conv1d(x2, weight[:, :, None], bias, activation=activation, math=math)
    return y[:, :, 0].reshape(*lead, weight.shape[0])


# ---------------------------------------------------------------- the backwards' arguments

def check_backward(fn: str, nd: int, sizes: tuple, grad_output, groups, *, weight=None,
                   x=None) -> None:
    """torch.nn.grad's checks of a backward, named as its arguments, before any work: ``grad_output`` and the
    array given (``weight`` for the input gradient, ``input`` x for the weight gradient) arrays of one type,
    ``groups`` a count, and the ranks and channels of ``sizes`` (``input_size`` or ``weight_size``), the array
    and grad_output agreeing. (Geometry, stride, padding: conv_geometry's checks.)"""
    given = weight is not None  # (the input gradient: weight given, input_size; else input given, weight_size)
    arr, arr_name = (weight, "weight") if given else (x, "input")
    data_name, w_name = ("input_size", "weight") if given else ("input", "weight_size")
    dt = check_dtype(arr_name, check_kind(arr_name, arr))
    if check_dtype("grad_output", check_kind("grad_output", grad_output)) != dt:
        raise TypeError(f"{fn}: {arr_name} is {dt} but grad_output is {np.dtype(grad_output.dtype)}; they must match")
    groups = check_count("groups", groups)
    go = tuple(grad_output.shape)
    data, w = (tuple(sizes), tuple(weight.shape)) if given else (tuple(x.shape), tuple(sizes))
    if len(data) not in (nd + 1, nd + 2) or len(go) != len(data):
        raise ValueError(f"{fn}: {data_name} {data} and grad_output {go} must both be {nd + 2}-D (batched) or both "
                         f"{nd + 1}-D (unbatched)")
    if len(data) == nd + 2 and data[0] != go[0]:
        raise ValueError(f"{data_name}: batch {data[0]} differs from grad_output's {go[0]} (shape {go})")
    if len(w) != nd + 2:
        raise ValueError(f"{w_name}: expected {nd + 2} sizes (out, in/groups, k...), got {w}")
    if w[0] % groups or data[-nd - 1] != w[1] * groups:
        raise ValueError(f"{w_name} {w} with groups={groups} takes {w[1] * groups} input channels ({w[0]} outputs, "
                         f"a multiple of groups); the input {data} has {data[-nd - 1]}")
    if go[-nd - 1] != w[0]:
        raise ValueError(f"grad_output: {go} has {go[-nd - 1]} channels; the weight {w} gives {w[0]}")


# ---------------------------------------------------------------- backward-weights

def _weight_grad(nd: int, x, weight_size, grad_output, stride, padding, dilation, groups, math):
    fn = f"conv{nd}d_weight"
    plain = type(weight_size) is tuple and getattr(x, "ndim", 0) == nd + 2
    memo = conv_memo.key(fn, nd, x, grad_output, (weight_size, stride, padding, dilation, groups), math) \
        if plain else None
    dw = conv_memo.replay(memo, x, grad_output)
    if dw is not None:
        return dw
    wsize = check_shape("weight_size", weight_size)
    check_backward(fn, nd, wsize, grad_output, groups, x=x)
    xp = _xp(x, grad_output)
    dt = np.dtype(x.dtype)
    geo = conv_geometry(fn, nd, x, np.broadcast_to(np.zeros((), dt), wsize), stride, padding, dilation, groups)
    math = precision.check_math(math)
    xb, unbatched = _batched(x, nd)
    want = (geo.n, geo.k, *geo.out_size)
    dy = grad_output[None] if unbatched and grad_output.ndim == nd + 1 else grad_output
    if tuple(dy.shape) != want:
        raise ValueError(f"grad_output: expected shape {want[1:] if unbatched else want}, "
                         f"got {tuple(grad_output.shape)}")
    with _on_device_of(x):
        return _weight_call(fn, geo, xp, xb, dy, wsize, dt, math, memo)


def _weight_call(fn, geo: ConvGeometry, xp, xb, dy, wsize, dt, math, memo=None):
    """dW = conv's weight gradient on the engine (arguments checked); a device-route call is kept under
    ``memo`` (conv_memo) where it can be replayed."""
    nd = geo.nd
    lay = layout(xb) or "nchw"
    xb_in, dy_in = xb, dy
    xb = transpose_kernel.to_layout(xp, xb, lay)
    dy = transpose_kernel.to_layout(xp, dy, lay)
    cl = lay == "cl"
    G, kg, crs, n, p = geo.groups, geo.kg, geo.crs, geo.n, geo.p
    if n * p == 0:  # an empty batch: a sum of nothing (no route would write the result)
        dw = xp.zeros((geo.k, *geo.kernel, geo.cg) if cl else wsize, dtype=dt)
        return dw.transpose(0, nd + 1, *range(1, nd + 1)) if cl else dw
    if conv_direct.applies(xb, 2.0 * n * p * geo.k * crs):
        if depthwise.applies(geo):
            return depthwise.weight(geo, xb, dy, cl)
        converted = conv_direct.run_layout(lay, geo, dt, (xb.size + dy.size) * dt.itemsize,  # x, dY in; dW back
                                           "bwd-weight") != lay

        def finish(dwm):  # the (K, CRS) matrix as the weight's shape, in the operands' layout
            if cl or converted:
                dwm = dwm.reshape(geo.k, *geo.kernel, geo.cg).transpose(0, nd + 1, *range(1, nd + 1))
            if converted:
                dw = xp.empty(wsize, dtype=dwm.dtype)
                transpose_kernel.copy(dw, dwm, False)
                return dw
            return dwm if cl else dwm.reshape(wsize)
        kept = memo is not None and xb is xb_in and dy is dy_in
        if converted:
            xb, dy = conv_direct.in_layout(xb, "x_in_layout", "cl"), conv_direct.in_layout(dy, "dy_in_layout", "cl")
        dwm, plan = conv_direct.weight(geo, xb, dy, cl or converted, math)
        if kept and plan is not None:
            conv_memo.keep(memo, conv_memo.weight_replay(geo, cl or converted, dt, math, plan,
                                                         (lambda dw: dw.reshape(wsize)) if converted else finish,
                                                         converted))
        return finish(dwm)
    if cl:
        dyv = dy.transpose(0, *range(2, dy.ndim), 1).reshape(n * p, geo.k).T
        dys = [dyv[g * kg:(g + 1) * kg] for g in range(G)]
        dwm = xp.empty((geo.k, *geo.kernel, geo.cg), dtype=dt)
    else:
        dys = [dy[i].reshape(geo.k, p).T[:, g * kg:(g + 1) * kg] for i in range(n) for g in range(G)]
        dwm = xp.empty(wsize, dtype=dt)
    wmat = dwm.reshape(geo.k, crs).T
    dws = [wmat[:, g * kg:(g + 1) * kg] for g in range(G)]
    xs = _x_view(xb, lay)
    x_slot = G + len(dys) + G
    cols = [Im2col(geo, g, cl, False, xs, x_slot) for g in range(G)]
    views = [*cols, *dys, *dws, xs]
    split = [1]

    def partials(eng, tile):  # split-k's scratch: S partial dW's of every group side by side
        steps = n_tiles(n * p, tile) if cl else n * n_tiles(p, tile)
        split[0] = min(dispatch.gemm_split(eng, crs, geo.k, n * p, tile, dt), steps)
        return (crs, split[0] * geo.k) if split[0] > 1 else None

    def plan(tile, block, scratch=False):
        return plan_conv_weight(n, p, kg, crs, G, tile, cl, col0=0, dy0=G, dw0=G + len(dys),
                                split=split[0] if scratch else 1, p0=len(views))
    dispatch.submit_planned(_name(dt, fn), views, plan, dt, 1.0, 0.0, (crs, geo.k, _rows_hint(n * p)),
                            scratch=partials, math=math)
    if cl:  # a channels-last weight, as torch gives for channels-last operands
        return dwm.transpose(0, nd + 1, *range(1, nd + 1))
    return dwm


def conv1d_weight(input, weight_size, grad_output, stride=1, padding=0, dilation=1, groups=1, *, math=None):
    """torch.nn.grad.conv1d_weight: the gradient of conv1d with respect to its weight."""
    return _weight_grad(1, input, weight_size, grad_output, stride, padding, dilation, groups, math)


def conv2d_weight(input, weight_size, grad_output, stride=1, padding=0, dilation=1, groups=1, *, math=None):
    """torch.nn.grad.conv2d_weight: the gradient of conv2d with respect to its weight."""
    return _weight_grad(2, input, weight_size, grad_output, stride, padding, dilation, groups, math)


def conv3d_weight(input, weight_size, grad_output, stride=1, padding=0, dilation=1, groups=1, *, math=None):
    """torch.nn.grad.conv3d_weight: the gradient of conv3d with respect to its weight."""
    return _weight_grad(3, input, weight_size, grad_output, stride, padding, dilation, groups, math)


def conv_bias_grad(grad_output):
    """The gradient of a convolution's bias: grad_output summed over every dim but the channels (1). An unbatched
    convolution's (K, spatial...) grad_output is read as batched: pass ``grad_output[None]``."""
    dt = check_dtype("grad_output", check_kind("grad_output", grad_output))
    if grad_output.ndim < 3:
        raise ValueError(f"grad_output: expected (N, K, spatial...), got shape {tuple(grad_output.shape)}")
    acc = dtypes.gemm_of(dt).compute
    axes = (0, *range(2, grad_output.ndim))
    return grad_output.astype(acc).sum(axis=axes).astype(dt)
