"""The ``cuda`` backend's fused epilogue kernel: ``y = act(tile * scale + shift)`` in place on a
column-major C tile, one CuPy ElementwiseKernel per (tile type, activation), made on first use.

The tile is read in its own type, computed in float32 (float64 for float64 tiles) and rounded
once; scale and shift are vectors of the compute type broadcast along the tile's rows
``(rows, 1)`` or columns ``(1, cols)`` (a ``(1, 1)`` one and zero where the epilogue has none).
The activations are those of ``runtime/activations.py``, written here as CUDA expressions.
"""

from __future__ import annotations

import numpy as np

from .. import dtypes
from .cuda_lowp import device_view

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
}

_MATH = {  # compute type -> CUDA's math functions of it
    "float": {"exp": "expf", "expm1": "expm1f", "erf": "erff", "tanh": "tanhf"},
    "double": {"exp": "exp", "expm1": "expm1", "erf": "erf", "tanh": "tanh"},
}

# tile type -> (its CuPy parameter type, compute type, load of y as F, store of r to y)
_TILE = {
    "float64": ("float64", "double", "y", "y = r"),
    "float32": ("float32", "float", "y", "y = r"),
    "float16": ("float16", "float", "(float)y", "y = (float16)r"),
    # bfloat16 as its bits: widened exactly; rounded to nearest even, NaN kept a (quiet) NaN
    "bfloat16": ("uint16", "float", "__uint_as_float(((unsigned int)y) << 16)",
                 "unsigned int u = __float_as_uint(r);"
                 " y = isnan(r) ? (unsigned short)((u >> 16) | 0x40u)"
                 " : (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)"),
}


def tile_type(dtype) -> str:
    """The name of a tile element type in ``_TILE`` (TypeError for any other)."""
    dt = np.dtype(dtype)
    bf = dtypes.GEMM_BY_PREFIX.get("b")
    name = "bfloat16" if bf is not None and dt == bf.dtype else dt.name
    if name not in _TILE:
        raise TypeError(f"epilogue: a C tile of type {dt.name} has no affine/activation kernel; "
                        f"allowed: {', '.join(_TILE)}")
    return name


def kernel_source(dtype, activation: str | None) -> tuple[str, str, str, str]:
    """(in_params, out_params, operation, name) of the ElementwiseKernel for tiles of ``dtype``."""
    tname = tile_type(dtype)
    ptype, ctype, load, store = _TILE[tname]
    vtype = "float64" if ctype == "double" else "float32"
    expr = EXPRESSIONS[activation].format(**_MATH[ctype])
    op = f"typedef {ctype} F; F v = ({load}) * sc + sh; F r = {expr}; {store}"
    return (f"{vtype} sc, {vtype} sh, {vtype} p", f"{ptype} y", op,
            f"blasx_affine_{tname}_{activation or 'none'}")


_KERNELS: dict = {}


def _kernel(dtype, activation):
    key = (tile_type(dtype), activation)
    k = _KERNELS.get(key)
    if k is None:  # two threads may both make it: the same kernel, either kept
        import cupy
        k = _KERNELS[key] = cupy.ElementwiseKernel(*kernel_source(dtype, activation))
    return k


def affine_activation(stream, loc, rows: int, cols: int, dtype, scale, shift, activation, param) -> None:
    """``y = act(y * scale + shift)`` on the ``rows x cols`` tile at ``loc = (pointer, ld)`` of
    element type ``dtype``, on ``stream``. ``scale``/``shift``: CuPy vectors of the compute type
    shaped to broadcast, ``(rows, 1)``, ``(1, cols)`` or ``(1, 1)``; ``param``: the activation's
    parameter (0 where it has none)."""
    y = device_view(loc[0], rows, cols, loc[1], dtype)
    with stream:
        _kernel(dtype, activation)(scale, shift, scale.dtype.type(param), y)
