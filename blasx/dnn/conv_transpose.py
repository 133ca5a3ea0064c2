"""blasx.dnn's transposed convolutions and backward-data (conv{1,2,3}d_input: the transposed convolution of
dY with the forward weight), on conv.py's front end: validated first, then on CuPy operands of one GPU
col2im's plan (GEMMs into columns, one kernel; col2im.py) or, for a strided call, its phases (stride-1
convolutions of the sub-kernels, phases.py) where forced or the find-db says so; else a convolution of x
with the flipped weight (strided ones as phases: on the engine, the zero-inserted input's zeros skipped).
Replayed like the forward (conv_memo.py).
"""

from __future__ import annotations

from math import prod

import numpy as np

from .. import dispatch, precision
from . import col2im, conv_direct, conv_memo, depthwise, direct_cache, direct_cuda, finddb, phases, transpose_kernel
from .arrays import on_device_of as _on_device_of, xp_of as _xp
from .args import check_out, check_shape
from .conv import (check_backward, _batched, _channel_vector, _check_kinds, _check_layout, _empty, _empty_maker,
                   _forward_call, _replay_epilogue)
from .geometry import ConvGeometry, call_layout, is_layout, layout, transpose_geometry

# Strided transposed convolutions and backward-data (dilation 1) run as stride^d stride-1 phase
# convolutions (phases.py) that skip the zero-inserted input's zeros; False: one zero-inserted gather.
PHASES = True


def _flipped_transposed(xp, weight, groups: int):
    """conv_transpose's weight (Cin, Cout/g, k...) as the forward weight (Cout, Cin/g, flipped k...)."""
    cin, coutg, *k = weight.shape
    w = weight.reshape(groups, cin // groups, coutg, *k).swapaxes(1, 2)
    w = w[(slice(None),) * 3 + (slice(None, None, -1),) * len(k)]
    return xp.ascontiguousarray(w).reshape(groups * coutg, cin // groups, *k)


def _strided_form(geo: ConvGeometry, dt, lay: str, math) -> str:
    """A strided transposed call's form on the device route: "col2im" or "phases", forced
    (conv_direct.FORM), else the find-db's (the backward-data problem it is), else phases.preferred's."""
    if conv_direct.FORM in ("col2im", "phases"):
        return conv_direct.FORM
    stored = finddb.stored_form(geo, dt, lay, math)
    if stored in ("col2im", "phases"):
        return stored
    return "phases" if phases.preferred(geo) else "col2im"


def _phase_calls(fn: str, geo: ConvGeometry, xp, x, lay: str, wf, y, bias, math) -> None:
    """y = the transposed convolution ``geo`` (forward weight ``wf``) by its phases: each a stride-1
    convolution into a compact temporary copied to its strided view of y (so the bias lands once per
    pixel); a phase with no taps gets the bias, or zeros. float16 overflow is warned of once, for the call."""
    with dispatch.overflow_tallied():
        _phases_into(fn, geo, xp, x, lay, wf, y, bias, math)


def _phases_into(fn: str, geo: ConvGeometry, xp, x, lay: str, wf, y, bias, math) -> None:
    for ph in phases.phases(geo):
        view = y[(slice(None), slice(None), *(slice(r, None, s) for r, s in zip(ph.offset, geo.insert)))]
        if ph.geo is None:
            view[...] = 0 if bias is None else xp.asarray(bias, dtype=y.dtype).reshape(-1, *(1,) * geo.nd)
            continue
        w = xp.ascontiguousarray(wf[(slice(None), slice(None), *ph.taps)])
        tmp = _empty(xp, (geo.n, geo.k, *ph.out_size), y.dtype, lay)
        _forward_call(fn, ph.geo, x, lay, w, tmp, None, (bias, None, None, None), math)
        _copy_into(xp, view, tmp, lay)


def _copy_into(xp, dst, src, lay: str) -> None:
    """``dst[...] = src``; CuPy channels-last arrays with the channels as the last axis, so that the copy
    moves several channels a thread where they allow (direct_cuda.copy)."""
    if xp is np:
        dst[...] = src
        return
    from . import direct_cuda
    if lay == "cl":
        dst, src = (a.transpose(0, *range(2, a.ndim), 1) for a in (dst, src))
    direct_cuda.copy(dst, src)


def _transpose(nd: int, fn: str, x, weight, bias, stride, padding, output_padding, groups, dilation,
               output_size=None, out=None, math=None):
    if out is None:  # (the replayed calls' path: no handler to install)
        return _transpose_steps(nd, fn, x, weight, bias, stride, padding, output_padding, groups, dilation,
                                output_size, out, math)
    with dispatch.whole(True, steps=True):  # (Ctrl-C: the caller's out is written whole first)
        return _transpose_steps(nd, fn, x, weight, bias, stride, padding, output_padding, groups, dilation,
                                output_size, out, math)


def _transpose_steps(nd: int, fn: str, x, weight, bias, stride, padding, output_padding, groups, dilation,
                     output_size, out, math):
    _check_kinds(x, weight, out)
    if output_size is None and isinstance(padding, str):  # (backward-data takes its forward's padding)
        raise TypeError(f"padding: got {padding!r}; {fn} takes an int or a tuple of {nd} ints (as torch)")
    memo = None
    if out is None and getattr(x, "ndim", 0) == nd + 2:
        memo = conv_memo.key(fn, nd, x, weight, (stride, padding, output_padding, groups, dilation, output_size),
                             math, (conv_memo.operand_kind(bias),))
    y = conv_memo.replay(memo, x, weight, (bias, None, None, None))
    if y is not None:
        return y
    xp = _xp(x, weight, out)
    geo = transpose_geometry(fn, nd, x, weight, stride, padding, output_padding, groups, dilation, output_size)
    math = precision.check_math(math)
    dt = np.dtype(x.dtype)
    b = _channel_vector("bias", bias, geo.k, dt, xp)
    xb, unbatched = _batched(x, nd)
    lay = call_layout(xb, out if out is not None and out.ndim == nd + 2 else None)
    shape = (geo.n, geo.k, *geo.out_size)
    check_out(out, shape[1:] if unbatched else shape, dt, x, x, weight, bias, alias=False)
    if out is not None and out.ndim == nd + 2:
        _check_layout(out, lay)
    dlay = lay
    with _on_device_of(x):
        if xp is not np:
            dlay = conv_direct.run_layout(lay, geo, dt, (xb.size + prod(shape)) * dt.itemsize)
        converted, cl = dlay != lay, dlay == "cl"
        xb = transpose_kernel.to_layout(xp, xb, lay)
        given = _batched(out, nd)[0] if out is not None else None
        direct = given is not None and is_layout(given, lay)  # (else through a buffer: the routes write compact y)
        y = given if direct else _empty(xp, shape, dt, lay)
        xd, yd = xb, y  # what the route reads and writes: in dlay, converted on the device before and after
        if converted:
            xd, yd = conv_direct.in_layout(xb, "x_in_layout", dlay), conv_direct.layout_scratch("y_in_layout", shape,
                                                                                                 dt, dlay)
        flops = 2.0 * geo.n * prod(geo.in_size) * geo.c * geo.kg * prod(geo.kernel)
        plan = ran = None
        phased = PHASES and phases.applies(geo)
        if col2im.applies(geo, dt) and not depthwise.applies(geo) and conv_direct.applies(xb, flops) and \
                is_layout(yd, dlay) and not (phased and _strided_form(geo, dt, dlay, math) == "phases"):
            # one GEMM a group into columns and the col2im kernel, the weight as it lies
            wl = layout(weight)
            w = weight if wl is not None else xp.ascontiguousarray(weight)
            plan = direct_cuda.transposed(geo, xd, cl, w, wl == "cl", yd, b, math)
            if memo is not None and xb is x and w is weight:
                bias_of = None if b is None else (  # the col2im kernel adds it: checked and made as above
                    lambda extras, k=geo.k: direct_cache.device_vector(_channel_vector("bias", extras[0], k, dt, xp),
                                                                       dt))
                conv_memo.keep(memo, conv_memo.forward_replay(geo, cl, dt, math, plan, _empty_maker(xp, shape, dt, lay),
                                                              flops=flops, converted=converted, bias_of=bias_of))
        else:
            wf = _flipped_transposed(xp, weight, geo.groups)
            if phased:
                _phase_calls(fn, geo, xp, xd, dlay, wf, yd, b, math)
                if memo is not None and xb is x and b is None and xp is not np:  # the same calls, in a graph
                    def launch(xr, w, yr, g=geo, run_lay=dlay):
                        _phase_calls(fn, g, xp, xr, run_lay, _flipped_transposed(xp, w, g.groups), yr, None, math)
                    conv_memo.keep(memo, conv_memo.call_replay(launch, _empty_maker(xp, shape, dt, lay), flops,
                                                               converted))
            else:
                ran = _forward_call(fn, geo, xd, dlay, wf, yd, None, (b, None, None, None), math)
        if converted:
            transpose_kernel.copy(y, yd, False)
        if given is not None and not direct:
            given[...] = y
    if memo is not None and ran is not None and xb is x:  # replays flip the weight anew (it changes per step)
        def rows(w, g=geo):
            return conv_direct.weight_rows(xp, _flipped_transposed(xp, w, g.groups), cl, g.k, g.crs)
        epilogue = None if b is None else _replay_epilogue(geo, lay == "cl", dt, xp, None)  # the bias, on y
        conv_memo.keep(memo, conv_memo.forward_replay(geo, cl, dt, math, ran[0], _empty_maker(xp, shape, dt, lay),
                                                      rows, epilogue, converted=converted))
    if out is not None:
        return out
    return y[0] if unbatched else y


def conv_transpose1d(x, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1, *,
                     out=None, math=None):
    """torch.nn.functional.conv_transpose1d on the engine (weight (in, out/groups, k))."""
    return _transpose(1, "conv_transpose1d", x, weight, bias, stride, padding, output_padding, groups, dilation,
                      out=out, math=math)


def conv_transpose2d(x, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1, *,
                     out=None, math=None):
    """torch.nn.functional.conv_transpose2d on the engine (weight (in, out/groups, kh, kw))."""
    return _transpose(2, "conv_transpose2d", x, weight, bias, stride, padding, output_padding, groups, dilation,
                      out=out, math=math)


def conv_transpose3d(x, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1, *,
                     out=None, math=None):
    """torch.nn.functional.conv_transpose3d on the engine (weight (in, out/groups, kd, kh, kw))."""
    return _transpose(3, "conv_transpose3d", x, weight, bias, stride, padding, output_padding, groups, dilation,
                      out=out, math=math)


def _input_grad(nd: int, input_size, weight, grad_output, stride, padding, dilation, groups, math):
    fn = f"conv{nd}d_input"
    size = check_shape("input_size", input_size)
    if len(size) not in (nd + 1, nd + 2):
        raise ValueError(f"input_size: expected {nd + 2} sizes (N, C, spatial...), got {tuple(input_size)}")
    check_backward(fn, nd, size, grad_output, groups, weight=weight)
    y = _transpose(nd, fn, grad_output, weight, None, stride, padding, 0, groups, dilation, output_size=size,
                   math=math)
    if tuple(y.shape) != size:
        raise ValueError(f"input_size: got {size}, but grad_output {tuple(grad_output.shape)} gives {tuple(y.shape)}")
    return y


def conv1d_input(input_size, weight, grad_output, stride=1, padding=0, dilation=1, groups=1, *, math=None):
    """torch.nn.grad.conv1d_input: the gradient of conv1d with respect to its input."""
    return _input_grad(1, input_size, weight, grad_output, stride, padding, dilation, groups, math)


def conv2d_input(input_size, weight, grad_output, stride=1, padding=0, dilation=1, groups=1, *, math=None):
    """torch.nn.grad.conv2d_input: the gradient of conv2d with respect to its input."""
    return _input_grad(2, input_size, weight, grad_output, stride, padding, dilation, groups, math)


def conv3d_input(input_size, weight, grad_output, stride=1, padding=0, dilation=1, groups=1, *, math=None):
    """torch.nn.grad.conv3d_input: the gradient of conv3d with respect to its input."""
    return _input_grad(3, input_size, weight, grad_output, stride, padding, dilation, groups, math)
