"""The arithmetic of the normalisation layers (norm.py), as twin implementations with one signature: numpy
(host) and CuPy kernels on the arrays' GPU (ElementwiseKernel / ReductionKernel, made on first use per element
type).

Every function works on arrays of the layer's logical shape in any strides (channels-last included), with the
statistics (``m`` mean, ``s`` inverse standard deviation), the affine parameters ``w``, ``b`` and the
reduction results shaped to broadcast against it (``keepdims``). Data arrays hold the storage type (float64,
float32, float16, bfloat16); everything else, and all arithmetic, is in the compute type F (float64 for
float64 data, float32 otherwise), and each result is rounded to the storage type once. ``w``/``b`` may be
Python floats (1 and 0 where a layer has no affine part).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np

from ..operands import is_cupy
from .arrays import compute_dtype

# ---------------------------------------------------------------- numpy


def _f(a):
    return a if isinstance(a, (int, float)) else a.astype(compute_dtype(a.dtype), copy=False)


def np_scaled_sum(x, w, axes):
    """sum(x * w) over ``axes`` (keepdims)."""
    xf = _f(x)
    return (xf * w).sum(axis=axes, keepdims=True, dtype=xf.dtype)


def np_sqdev_sum(x, m, axes):
    """sum((x - m)^2) over ``axes`` (keepdims): the second pass of a two-pass variance."""
    d = _f(x) - m
    return (d * d).sum(axis=axes, keepdims=True)


def np_dot_sum(g, x, m, s, w, axes):
    """sum(g * w * (x - m) * s) over ``axes`` (keepdims): g against the normalised x."""
    return (_f(g) * w * ((_f(x) - m) * s)).sum(axis=axes, keepdims=True)


def np_affine(x, m, s, w, b, y) -> None:
    """y = (x - m) * s * w + b."""
    y[...] = (_f(x) - m) * s * w + b


def np_grad_input(g, x, m, s, w, a, c, y) -> None:
    """y = s * (g * w - a - (x - m) * s * c): the input gradient of a normalisation whose group means of
    ``g * w`` and ``g * w * xhat`` are ``a`` and ``c`` (both 0: the statistics are constants)."""
    xhat = (_f(x) - m) * s
    y[...] = s * (_f(g) * w - a - xhat * c)


# ---------------------------------------------------------------- CuPy

_REDUCE = {  # name -> (input parameters, map expression); {ld_x} etc. load a data value as F
    "scaled": ("{P} x, {V} w", "{ld_x} * w"),
    "sqdev": ("{P} x, {V} m", "({ld_x} - m) * ({ld_x} - m)"),
    "dot": ("{P} g, {P} x, {V} m, {V} s, {V} w", "{ld_g} * w * (({ld_x} - m) * s)"),
}

_ELEMENTWISE = {  # name -> (input parameters, body computing F r); the store writes r to y
    "affine": ("{P} x, {V} m, {V} s, {V} w, {V} b", "F r = ({ld_x} - m) * s * w + b;"),
    "grad_input": ("{P} g, {P} x, {V} m, {V} s, {V} w, {V} a, {V} c",
                   "F xh = ({ld_x} - m) * s; F r = s * ({ld_g} * w - a - xh * c);"),
}

_KERNELS: dict = {}


def _types(dtype):
    """(storage parameter type, compute C type, compute parameter type, load of ``y``, store of r to y)."""
    from ..runtime.devices.cuda_epilogue import TILE_TYPES, tile_type
    ptype, ctype, load, store = TILE_TYPES[tile_type(dtype)]
    load, store = load.format("y"), store.format("y", "r")  # the table's templates, on y and r
    return ptype, ctype, "float64" if ctype == "double" else "float32", load, store


def _kernel(kind: str, name: str, dtype):
    """The CuPy kernel ``name`` of ``kind`` ("reduce" or "elementwise") for data of ``dtype`` (cached)."""
    key = (kind, name, np.dtype(dtype).name)
    k = _KERNELS.get(key)
    if k is None:  # two threads may both make it: the same kernel, either kept
        import cupy
        ptype, ctype, vtype, load, store = _types(dtype)

        def ld(var):
            return "(" + re.sub(r"\by\b", var, load) + ")"
        table = _REDUCE if kind == "reduce" else _ELEMENTWISE
        params, expr = table[name]
        fmt = dict(P=ptype, V=vtype, ld_x=ld("x"), ld_g=ld("g"))
        params, expr = params.format(**fmt), expr.format(**fmt)
        kname = f"blasx_norm_{name}_{key[2]}"
        if kind == "reduce":
            k = cupy.ReductionKernel(params, f"{vtype} y", expr, "a + b", "y = a", "0", kname,
                                     reduce_type=ctype)
        else:
            k = cupy.ElementwiseKernel(params, f"{ptype} y", f"typedef {ctype} F; {expr} {store};", kname)
        _KERNELS[key] = k
    return k


def _bits(a):
    """A bfloat16 CuPy array as its uint16 bits (the kernels' storage parameter type); others as they are."""
    from ..runtime.devices.cuda_epilogue import tile_type
    return a.view(np.uint16) if tile_type(a.dtype) == "bfloat16" else a


def _scalar(v, dtype):
    return compute_dtype(dtype).type(v) if isinstance(v, (int, float)) else v


def _zero_d(v, dtype):
    """A Python float as a 0-d device array of the compute type (broadcast like any operand)."""
    import cupy
    return cupy.full((), v, dtype=compute_dtype(dtype)) if isinstance(v, (int, float)) else v


def cupy_scaled_sum(x, w, axes):
    return _kernel("reduce", "scaled", x.dtype)(_bits(x), _zero_d(w, x.dtype), axis=axes, keepdims=True)


def cupy_sqdev_sum(x, m, axes):
    return _kernel("reduce", "sqdev", x.dtype)(_bits(x), m, axis=axes, keepdims=True)


def cupy_dot_sum(g, x, m, s, w, axes):
    return _kernel("reduce", "dot", x.dtype)(_bits(g), _bits(x), m, s, _zero_d(w, x.dtype), axis=axes,
                                             keepdims=True)


def cupy_affine(x, m, s, w, b, y) -> None:
    f = x.dtype
    _kernel("elementwise", "affine", f)(_bits(x), m, s, _scalar(w, f), _scalar(b, f), _bits(y))


def cupy_grad_input(g, x, m, s, w, a, c, y) -> None:
    f = x.dtype
    _kernel("elementwise", "grad_input", f)(_bits(g), _bits(x), m, s, _scalar(w, f), _scalar(a, f), _scalar(c, f),
                                            _bits(y))


# ---------------------------------------------------------------- small arrays (parameters, running stats)

def to_compute(a, data_dtype=None):
    """A parameter or statistic (numpy or CuPy, any storage type) in the compute type of ``data_dtype`` (the
    layer's input type; default: a's own)."""
    ct = compute_dtype(a.dtype if data_dtype is None else data_dtype)
    if is_cupy(a) and _bits(a) is not a:  # CuPy bfloat16: widened from its bits
        from ..runtime.devices.cuda_lowp import kernels
        a = kernels()["bf16_to_f32"](a.view(np.uint16))
    return a.astype(ct, copy=False)


def store(dst, src) -> None:
    """dst[...] = src (compute type), rounded once to dst's type."""
    if not is_cupy(dst) or _bits(dst) is dst:
        dst[...] = src
    else:  # CuPy bfloat16: rounded to nearest even into its bits
        from ..runtime.devices.cuda_lowp import kernels
        kernels()["f32_to_bf16"](src.astype(np.float32, copy=False), dst.view(np.uint16))


_NAMES = ("scaled_sum", "sqdev_sum", "dot_sum", "affine", "grad_input")
_OPS = {pre: SimpleNamespace(**{n: globals()[pre + n] for n in _NAMES}) for pre in ("np_", "cupy_")}


def ops(xp) -> SimpleNamespace:
    """The implementation for arrays of ``xp`` (numpy or cupy): the five functions above without prefix."""
    return _OPS["np_" if xp is np else "cupy_"]
