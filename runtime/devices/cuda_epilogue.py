"""The ``cuda`` backend's fused epilogue kernel: ``y = act(tile * scale + shift)`` in place on a
column-major C tile, one CuPy ElementwiseKernel per (tile type, activation), made on first use; and
the standalone activation kernels of blasx.dnn (``y = act(x)`` and its gradient) from the same forms.

The tile is read in its own type, computed in float32 (float64 for float64 tiles) and rounded
once; scale and shift are vectors of the compute type broadcast along the tile's rows
``(rows, 1)`` or columns ``(1, cols)`` (a ``(1, 1)`` one and zero where the epilogue has none).
The activations are those of ``runtime/activations.py``, written here as CUDA expressions (forward
and gradient, the same names).
"""

from __future__ import annotations

import numpy as np

from .. import dtypes
from .cuda_lowp import device_view
from .cupy_streams import on_stream

# The activation of ``v`` (type F; parameter ``p``) as a CUDA expression; {exp} etc. name the
# math function of F. Same formulas as the host's, NaN passing through each.
EXPRESSIONS = {
    None: "v",
    "relu": "v < (F)0 ? (F)0 : v",
    "relu6": "v < (F)0 ? (F)0 : (v > (F)6 ? (F)6 : v)",
    "leaky_relu": "v < (F)0 ? v * p : v",
    "elu": "v > (F)0 ? v : p * {expm1}(v)",
    "sigmoid": "(F)1 / ((F)1 + {exp}(-v))",
    "tanh": "{tanh}(v)",
    "gelu": "(F)0.5 * v * ((F)1 + {erf}(v * (F)0.70710678118654752440))",
    "gelu_tanh": "(F)0.5 * v * ((F)1 + {tanh}((F)0.79788456080286535588 * (v + (F)0.044715 * v * v * v)))",
    "hardswish": "v * (v + (F)3 < (F)0 ? (F)0 : (v + (F)3 > (F)6 ? (F)6 : v + (F)3)) / (F)6",
    "silu": "v / ((F)1 + {exp}(-v))",
    "hardsigmoid": "(v + (F)3 < (F)0 ? (F)0 : (v + (F)3 > (F)6 ? (F)6 : v + (F)3)) / (F)6",
}

# The gradient of the input from the output's gradient ``g`` and the saved value ``v`` (the input
# or the output, as ``Activation.saves`` says) as a CUDA expression: torch's backward formulas.
GRADIENTS = {
    "relu": "v <= (F)0 ? (F)0 : g",
    "relu6": "(v > (F)0 && v < (F)6) ? g : (F)0",
    "leaky_relu": "v > (F)0 ? g : g * p",
    "elu": "v > (F)0 ? g : g * p * {exp}(v)",
    "sigmoid": "g * ((F)1 - v) * v",
    "tanh": "g * ((F)1 - v * v)",
    "gelu": "g * ((F)0.5 * ((F)1 + {erf}(v * (F)0.70710678118654752440))"
            " + v * {exp}((F)-0.5 * v * v) * (F)0.39894228040143267794)",
    "gelu_tanh": "g * ((F)0.5 * ((F)1 + {tanh}((F)0.79788456080286535588 * (v + (F)0.044715 * v * v * v)))"
                 " + (F)0.5 * v * ((F)1 - {tanh}((F)0.79788456080286535588 * (v + (F)0.044715 * v * v * v))"
                 " * {tanh}((F)0.79788456080286535588 * (v + (F)0.044715 * v * v * v)))"
                 " * (F)0.79788456080286535588 * ((F)1 + (F)0.134145 * v * v))",
    "hardswish": "v <= (F)-3 ? (F)0 : (v >= (F)3 ? g : g * (v / (F)3 + (F)0.5))",
    "silu": "g / ((F)1 + {exp}(-v)) * ((F)1 + v * ((F)1 - (F)1 / ((F)1 + {exp}(-v))))",
    "hardsigmoid": "(v > (F)-3 && v < (F)3) ? g / (F)6 : (F)0",
}

MATH_FUNCTIONS = {  # compute type -> CUDA's math functions of it
    "float": {"exp": "expf", "expm1": "expm1f", "erf": "erff", "tanh": "tanhf"},
    "double": {"exp": "exp", "expm1": "expm1", "erf": "erf", "tanh": "tanh"},
}

# tile type -> (its CuPy parameter type, compute type, load of {0} as F, store of F {1} to {0})
TILE_TYPES = {
    "float64": ("float64", "double", "{0}", "{0} = {1}"),
    "float32": ("float32", "float", "{0}", "{0} = {1}"),
    "float16": ("float16", "float", "(float){0}", "{0} = (float16){1}"),
    # bfloat16 as its bits: widened exactly; rounded to nearest even, NaN kept a (quiet) NaN
    "bfloat16": ("uint16", "float", "__uint_as_float(((unsigned int){0}) << 16)",
                 "unsigned int u = __float_as_uint({1});"
                 " {0} = isnan({1}) ? (unsigned short)((u >> 16) | 0x40u)"
                 " : (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)"),
}


_NAMES: dict = {}  # dtype -> tile_type's answer (per call it cost a dtype name lookup)


def tile_type(dtype) -> str:
    """The name of a tile element type in ``TILE_TYPES`` (TypeError for any other)."""
    dt = np.dtype(dtype)
    name = _NAMES.get(dt)
    if name is None:
        bf = dtypes.GEMM_BY_PREFIX.get("b")
        name = "bfloat16" if bf is not None and dt == bf.dtype else dt.name
        if name not in TILE_TYPES:
            raise TypeError(f"epilogue: a C tile of type {dt.name} has no affine/activation kernel; "
                            f"allowed: {', '.join(TILE_TYPES)}")
        _NAMES[dt] = name
    return name


def kernel_source(dtype, activation: str | None, residual: bool = False) -> tuple[str, str, str, str]:
    """(in_params, out_params, operation, name) of the ElementwiseKernel for tiles of ``dtype``; ``residual``:
    the operation adds the element ``rr`` (of the tile's type, a variable the flat forms declare) before the
    activation, ``y = act(y * scale + shift + rr)``."""
    tname = tile_type(dtype)
    ptype, ctype, load, store = TILE_TYPES[tname]
    vtype = "float64" if ctype == "double" else "float32"
    expr = EXPRESSIONS[activation].format(**MATH_FUNCTIONS[ctype])
    add = f" + ({load.format('rr')})" if residual else ""
    op = f"typedef {ctype} F; F v = ({load.format('y')}) * sc + sh{add}; F r = {expr}; {store.format('y', 'r')}"
    return (f"{vtype} sc, {vtype} sh, {vtype} p", f"{ptype} y", op,
            f"blasx_affine_{tname}_{activation or 'none'}{'_res' if residual else ''}")


def flat_kernel_source(dtype, activation: str | None, residual: bool = False) -> tuple[str, str, str, str]:
    """:func:`kernel_source`'s operation over a contiguous block (``ld == rows``) as a flat array: element u's
    scale is ``scv[(u / sd) % sm]`` (shift likewise with hd, hm), so one index, no per-dimension division;
    ``residual``: element u of the array ``rv`` (laid out as the block) added."""
    _, out, op, name = kernel_source(dtype, activation, residual)
    ptype, ctype = TILE_TYPES[tile_type(dtype)][:2]
    vtype = "float64" if ctype == "double" else "float32"
    res = (f", raw {ptype} rv", f"{C_NAMES[ptype]} rr = rv[i]; ") if residual else ("", "")
    return (f"raw {vtype} scv, raw {vtype} shv, {vtype} p, uint32 sd, uint32 sm, uint32 hd, uint32 hm{res[0]}", out,
            f"unsigned int ui = (unsigned int)i; {ctype} sc = scv[(ui / sd) % sm], sh = shv[(ui / hd) % hm]; "
            f"{res[1]}{op}", name + "_flat")


VECTOR_BYTES = 16  # what a thread of the vector form loads and stores at once
C_NAMES = {"float64": "double", "float32": "float", "float16": "float16", "uint16": "unsigned short"}


# A 16-byte unit of elements, loaded into and stored from an aligned local array (kernel text, any element type)
UNIT_STRUCT = f"struct alignas({VECTOR_BYTES}) U {{ unsigned int w[{VECTOR_BYTES // 4}]; }}; "


def unit_load(et: str, v: int, var: str, src: str, at: str) -> str:
    """Kernel text: a local array ``var`` of ``v`` elements of C type ``et``, loaded from ``src[at]`` (aligned)."""
    return (f"alignas({VECTOR_BYTES}) {et} {var}[{v}]; "
            f"*reinterpret_cast<U*>({var}) = *reinterpret_cast<const U*>(&{src}[{at}]); ")


def unit_store(dst: str, at: str, var: str) -> str:
    """Kernel text: the local array ``var`` stored to ``dst[at]`` (aligned)."""
    return f"*reinterpret_cast<U*>(&{dst}[{at}]) = *reinterpret_cast<const U*>({var});"


def vector_kernel_source(dtype, activation: str | None, residual: bool = False) -> tuple[str, str, str, str]:
    """:func:`flat_kernel_source`'s operation over units of VECTOR_BYTES, one aligned load and store a thread
    (the flat form moves 2 or 4 bytes a thread, with two divisions each): unit i holds elements b + j,
    b = i * V; their scale entries are ``scv[s0 + j * ss]``, s0 = (b / sd) % sm, ss 1 (consecutive entries)
    or 0 (one entry) (shift likewise: hd, hm, hs), as :func:`vector_index` sets them."""
    _, _, op, name = kernel_source(dtype, activation, residual)
    tname = tile_type(dtype)
    ptype, ctype = TILE_TYPES[tname][:2]
    vtype = "float64" if ctype == "double" else "float32"
    et, v = C_NAMES[ptype], VECTOR_BYTES // np.dtype(dtype).itemsize
    body = (UNIT_STRUCT + f"unsigned int b = (unsigned int)i * {v}u, s0 = (b / sd) % sm, h0 = (b / hd) % hm; "
            + unit_load(et, v, "e", "yv", "b") + (unit_load(et, v, "er", "rv", "b") if residual else "")
            + f"for (int j = 0; j < {v}; ++j) {{ {et}& y = e[j]; {ctype} sc = scv[s0 + j * ss], sh = shv[h0 + j * hs]; "
            + (f"{et} rr = er[j]; " if residual else "")
            + f"{op}; }} " + unit_store("yv", "b", "e"))
    return (f"raw {vtype} scv, raw {vtype} shv, {vtype} p, uint32 sd, uint32 sm, uint32 ss, uint32 hd, uint32 hm, "
            f"uint32 hs{f', raw {ptype} rv' if residual else ''}", f"raw {ptype} yv", body, name + "_vec")


def vector_index(v, rows: int, per: int) -> tuple | None:
    """(divisor, modulus, step) of the vector ``v`` (as :func:`_flat_index`) for units of ``per`` elements of a
    column-major tile with ``rows`` rows; None where a unit's entries are neither consecutive nor one."""
    d, m = _flat_index(v, rows)
    if m == 1:
        return d, m, np.uint32(0)
    if d == 1 and m % per == 0:
        return d, m, np.uint32(1)
    if d % per == 0:
        return d, m, np.uint32(0)
    return None


_KERNELS: dict = {}
_FORMS = {"tile": kernel_source, "flat": flat_kernel_source, "vector": vector_kernel_source}


def _kernel(dtype, activation, form: str = "tile", residual: bool = False):
    key = (tile_type(dtype), activation, form, residual)
    k = _KERNELS.get(key)
    if k is None:  # two threads may both make it: the same kernel, either kept
        import cupy
        k = _KERNELS[key] = cupy.ElementwiseKernel(*_FORMS[form](dtype, activation, residual))
    return k


def pointwise_source(dtype, activation: str, grad: bool = False) -> tuple[str, str, str, str]:
    """(in_params, out_params, operation, name) of the standalone ElementwiseKernel for arrays of
    ``dtype``: ``yout = act(xin)`` (params ``xin, p``), or with ``grad`` the input's gradient
    ``yout = act'(gin, saved)`` from the output's gradient ``gin`` and the saved array ``saved``
    (params ``gin, saved, p``); computed in F (float32 for half types) and rounded once."""
    tname = tile_type(dtype)
    ptype, ctype, load, store = TILE_TYPES[tname]
    vtype = "float64" if ctype == "double" else "float32"
    math = MATH_FUNCTIONS[ctype]
    if grad:
        expr = GRADIENTS[activation].format(**math)
        return (f"{ptype} gin, {ptype} saved, {vtype} p", f"{ptype} yout",
                f"typedef {ctype} F; F g = {load.format('gin')}; F v = {load.format('saved')}; F r = {expr}; "
                f"{store.format('yout', 'r')}", f"blasx_{activation}_grad_{tname}")
    expr = EXPRESSIONS[activation].format(**math)
    return (f"{ptype} xin, {vtype} p", f"{ptype} yout",
            f"typedef {ctype} F; F v = {load.format('xin')}; F r = {expr}; {store.format('yout', 'r')}",
            f"blasx_{activation}_{tname}")


def pointwise_kernel(dtype, activation: str, grad: bool = False):
    """The CuPy ElementwiseKernel of :func:`pointwise_source` (made on first use, kept)."""
    key = (tile_type(dtype), activation, "grad" if grad else "pointwise")
    k = _KERNELS.get(key)
    if k is None:
        import cupy
        k = _KERNELS[key] = cupy.ElementwiseKernel(*pointwise_source(dtype, activation, grad))
    return k


def affine_activation(stream, loc, rows: int, cols: int, dtype, scale, shift, activation, param,
                      residual: int | None = None) -> None:
    """``y = act(y * scale + shift)`` on the ``rows x cols`` tile at ``loc = (pointer, ld)`` of
    element type ``dtype``, on ``stream``. ``scale``/``shift``: CuPy vectors of the compute type
    shaped to broadcast, ``(rows, 1)``, ``(1, cols)`` or ``(1, 1)``; ``param``: the activation's
    parameter (0 where it has none); ``residual``: the address of a block laid out as the tile, added before
    the activation (contiguous tiles only). The threads walk the tile down its columns (memory order): a
    contiguous tile as one flat array (in aligned 16-byte units where its size and vectors allow), any other
    as the transposed (row-major) view."""
    p = scale.dtype.type(param)
    n = rows * cols
    res = residual is not None
    with on_stream(stream):
        if loc[1] == rows and n < 1 << 32:
            y = device_view(loc[0], n, 1, n, dtype)[:, 0]
            extra = (device_view(residual, n, 1, n, dtype)[:, 0],) if res else ()
            per = VECTOR_BYTES // y.dtype.itemsize
            idx = (vector_index(scale, rows, per), vector_index(shift, rows, per))
            if n % per == 0 and (loc[0] | (residual or 0)) % VECTOR_BYTES == 0 and None not in idx:
                _kernel(dtype, activation, "vector", res)(scale.reshape(-1), shift.reshape(-1), p, *idx[0], *idx[1],
                                                          *extra, y, size=n // per)
                return
            _kernel(dtype, activation, "flat", res)(scale.reshape(-1), shift.reshape(-1), p, *_flat_index(scale, rows),
                                                    *_flat_index(shift, rows), *extra, y)
        elif res:
            raise ValueError(f"affine_activation: residual: a tile with ld {loc[1]} != rows {rows} takes none")
        else:
            y = device_view(loc[0], rows, cols, loc[1], dtype)
            _kernel(dtype, activation)(scale.T, shift.T, p, y.T)


def _flat_index(v, rows: int) -> tuple:
    """(divisor, modulus) taking a column-major element's flat index to its entry of the vector ``v`` shaped
    ``(rows, 1)`` (its row), ``(1, cols)`` (its column) or ``(1, 1)``."""
    if v.shape[0] > 1:
        return np.uint32(1), np.uint32(v.shape[0])
    return (np.uint32(rows), np.uint32(v.shape[1])) if v.shape[1] > 1 else (np.uint32(1), np.uint32(1))
