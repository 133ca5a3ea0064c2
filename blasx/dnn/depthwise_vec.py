"""The forward depthwise kernel over 16-byte units of channels: a channels-last 2-D depthwise convolution
(one input and one output channel a group, no zero insertion) whose channel count fills whole units. Each
thread computes V consecutive channels of one output pixel (V = 16 bytes over the element size): per tap one
aligned 16-byte load of x and one of the tap-major weight (taps, K), V accumulators in the compute type, then
the epilogue ``act(acc * scale + shift (+ residual))`` per channel, rounded once, and one 16-byte store.
depthwise.py's one-element-a-thread kernel does the same sums in the same order (taps row-major), with its index
arithmetic per element and element-sized loads.
"""

from __future__ import annotations

import numpy as np

from ..runtime.devices import cuda_epilogue
from .geometry import ConvGeometry

UNIT = cuda_epilogue.VECTOR_BYTES
NAMES = ["KV", "K", "O0", "O1", "R0", "R1", "S0", "S1", "D0", "D1", "L0", "L1", "I0", "I1", "X0", "XN"]


def per_unit(dtype) -> int:
    """Elements of ``dtype`` in one unit."""
    return UNIT // np.dtype(dtype).itemsize


def applies(geo: ConvGeometry, cl: bool, dtype) -> bool:
    """Whether this kernel runs ``geo`` (the arrays' alignment is checked at the launch)."""
    v = per_unit(dtype)
    return cl and geo.nd == 2 and geo.cg == 1 and geo.kg == 1 and v > 1 and geo.k % v == 0 and \
        all(z == 1 for z in geo.insert)


def params(geo: ConvGeometry, dtype) -> dict:
    """The integer parameters (element strides of channels-last x; KV units of channels a pixel)."""
    (o0, o1), (r0, r1), (s0, s1), (d0, d1), (l0, l1), (i0, i1) = (geo.out_size, geo.kernel, geo.stride,
                                                                   geo.dilation, geo.pad_lo, geo.in_size)
    k = geo.k
    return dict(zip(NAMES, (k // per_unit(dtype), k, o0, o1, r0, r1, s0, s1, d0, d1, l0, l1, i0, i1, i1 * k,
                            i0 * i1 * k)))


def source(dtype, activation, residual: bool, index: str) -> dict:
    """The ElementwiseKernel's arguments (one thread a unit: ``size`` = N * O0 * O1 * KV at the launch)."""
    tname = cuda_epilogue.tile_type(dtype)
    ptype, ctype, load, store = cuda_epilogue.TILE_TYPES[tname]
    et, v = cuda_epilogue.C_NAMES[ptype], per_unit(dtype)
    vtype = "float64" if ctype == "double" else "float32"
    act = cuda_epilogue.EXPRESSIONS[activation].format(**cuda_epilogue.MATH_FUNCTIONS[ctype])
    it = "int" if index == "int32" else "long long"

    unit = cuda_epilogue.unit_load
    body = [
        f"typedef {it} I; typedef {ctype} F; " + cuda_epilogue.UNIT_STRUCT,
        "const I e = (I)i; const I kv = e % KV; I t = e / KV; const I o1 = t % O1; t /= O1;",
        "const I o0 = t % O0; const I n = t / O0; const I k0 = kv * " + str(v) + ";",
        f"F acc[{v}]; for (int j = 0; j < {v}; ++j) acc[j] = (F)0;",
        "for (I r0 = 0; r0 < R0; ++r0) { const I u0 = o0 * S0 - L0 + r0 * D0; if (u0 < 0 || u0 >= I0) continue;",
        "  for (I r1 = 0; r1 < R1; ++r1) { const I u1 = o1 * S1 - L1 + r1 * D1; if (u1 < 0 || u1 >= I1) continue;",
        "    " + unit(et, v, "xe", "x", "n * XN + u0 * X0 + u1 * K + k0")
        + unit(et, v, "we", "wt", "(r0 * R1 + r1) * K + k0"),
        f"    for (int j = 0; j < {v}; ++j) {{ {et}& y = xe[j]; F a = {load.format('y')}; {et}& yw = we[j]; "
        f"acc[j] += a * ({load.format('yw')}); }} }} }}",
        f"const I yo = ((n * O0 + o0) * O1 + o1) * K + k0; alignas({UNIT}) {et} ye[{v}];",
        *([unit(et, v, "re", "res", "yo")] if residual else []),
        f"for (int j = 0; j < {v}; ++j) {{ F v = acc[j] * sc[k0 + j] + sh[k0 + j];"
        + (f" {et}& yr = re[j]; v += {load.format('yr')};" if residual else "")
        + f" F r = {act}; {et}& y = ye[j]; {store.format('y', 'r')}; }}",
        cuda_epilogue.unit_store("yv", "yo", "ye")]
    ps = [f"raw {ptype} x", f"raw {ptype} wt", f"raw {vtype} sc", f"raw {vtype} sh",
          *([f"raw {ptype} res"] if residual else []), f"{vtype} p", *(f"{index} {n}" for n in NAMES)]
    return {"in_params": ", ".join(ps), "out_params": f"raw {ptype} yv", "operation": "\n".join(body),
            "name": f"blasx_depthwise_vec_{tname}_{activation or 'none'}{'_res' if residual else ''}_{index}"}
