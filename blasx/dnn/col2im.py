"""Strided transposed convolutions (and so strided backward-data) on the device route as GEMMs into columns and
one col2im kernel, the lowering the issue names ("the transposed GEMM followed by col2im"). For
y = conv_transpose(x, w) with stride s, padding p, dilation d (backward-data: x = dY, w the forward weight),
per chunk of images:

    col[(g, co, t), (n, i)] = sum over ci of group g of w[ci, co, t] x[n, ci, i]     one GEMM a group (cuBLAS)
    y[n, co, h] = sum over taps t and input pixels i with h = i*s - p + t*d of col[(g, co, t), (n, i)]

The weight is read where it lies (no flipped copy) and no zero-inserted input exists: each output element adds
the few taps that reach it (per dim, those with (h + p - t*d) divisible by s). The phase decomposition
(phases.py) needs s^dims convolutions, copies and scratch per call; this needs one GEMM a group and one kernel.

Pure plans (steps and kernel arguments as plain data; the CUDA side is direct_cuda.CudaOps.col2im). Buffers:
``x`` (x's compact memory), ``w`` (the weight's, (Cin, Cout/g, k...) row-major, or its channels-last form
(Cin, k..., Cout/g) where ``Col2im.wcl``), ``col`` (scratch: Cout*taps rows, a chunk's input pixels as columns,
column-major), ``y``, and an optional ``bias``. ``geo`` is transpose_geometry's (c = Cin, k = Cout, in_size =
x's spatial size, insert = the stride, pad_lo = d*(k-1) - p).
"""

from __future__ import annotations

from math import prod
from typing import NamedTuple

import numpy as np

from . import conv_direct
from .conv_direct import OP_N, OP_T, Gemm
from .geometry import ConvGeometry

TYPES = ("float16", "float32", "float64")  # element types the kernel is made for (CuPy has no bfloat16)


class Col2im(NamedTuple):
    """y's images n0 .. n0 + nb - 1 from col (its columns: those images' input pixels); ``wcl``: col's rows
    of a group are (tap, co) (a channels-last weight), else (co, tap)."""

    n0: int
    nb: int
    wcl: bool


conv_direct._OPS[Col2im] = "col2im"  # the executors' method for these steps


def applies(geo: ConvGeometry, dtype) -> bool:
    """Whether this form runs ``geo``: a strided transposed convolution of a type the kernel is made for."""
    return any(z > 1 for z in geo.insert) and np.dtype(dtype).name in TYPES


def scratch_per_image(geo: ConvGeometry) -> int:
    """col's elements per image: Cout * taps rows, the image's input pixels as columns."""
    return geo.k * prod(geo.kernel) * prod(geo.in_size)


def steps(geo: ConvGeometry, cl: bool, wcl: bool, parts: list) -> list:
    """Per chunk (first image, images) of ``parts``: one GEMM per group into col, then Col2im."""
    G, cg, kg, taps = geo.groups, geo.cg, geo.kg, prod(geo.kernel)
    rows, pin, cin = geo.k * taps, prod(geo.in_size), geo.c
    out: list = []
    for n0, nb in parts:
        for g in range(G):
            a = ("w", g * cg * kg * taps)  # w_g: (kg*taps x cg), column-major, ld kg*taps
            if cl:  # x's chunk as (Cin x nb*Pin), ld Cin
                out.append(Gemm(a, ("x", n0 * pin * cin + g * cg), ("col", g * kg * taps), OP_N, OP_N, kg * taps,
                                nb * pin, cg, kg * taps, cin, rows, 0, 0, 0, 1, 0.0))
            else:  # per image, x_n as (Cin x Pin) through op T of its (Pin x Cin) memory
                out.append(Gemm(a, ("x", (n0 * cin + g * cg) * pin), ("col", g * kg * taps), OP_N, OP_T, kg * taps,
                                pin, cg, kg * taps, pin, rows, 0, cin * pin, rows * pin, nb, 0.0))
        out.append(Col2im(n0, nb, wcl))
    return out


def _three(t, fill):
    return (*t, *(fill,) * (3 - len(t)))


ARG_NAMES = ("K KG RS LD OUT O1 O2 I0 I1 I2 PIN K0 K1 K2 s0 s1 s2 d0 d1 d2 p0 p1 p2 cl wcl ybase").split()
DIVISORS = ("K", "OUT", "O1", "O2", "KG", "s0", "s1", "s2")  # the ARG_NAMES the index arithmetic divides by


def kernel_args(geo: ConvGeometry, cl: bool, s: Col2im) -> tuple[int, ...]:
    """The kernel's integer arguments (ARG_NAMES) for step ``s``."""
    taps = prod(geo.kernel)
    out, ins = _three(geo.out_size, 1), _three(geo.in_size, 1)
    pad = tuple(d * (k - 1) - lo for d, k, lo in zip(geo.dilation, geo.kernel, geo.pad_lo))
    return (geo.k, geo.kg, taps, geo.k * taps, prod(geo.out_size), out[1], out[2], *ins, prod(geo.in_size),
            *_three(geo.kernel, 1), *_three(geo.insert, 1), *_three(geo.dilation, 1), *_three(pad, 0), int(cl),
            int(s.wcl), s.n0 * geo.k * prod(geo.out_size))


def magic_args(args: tuple) -> tuple:
    """The DIVISORS' (multiplier, shift) pairs (gather_kernel.fast_divisor) for the ARG_NAMES values ``args``."""
    from . import gather_kernel
    return gather_kernel.magic_args(args, ARG_NAMES, DIVISORS)


def threads(geo: ConvGeometry, s: Col2im) -> int:
    return s.nb * geo.k * prod(geo.out_size)


def index_type(geo: ConvGeometry, s: Col2im, col_size: int) -> str:
    """"int32" where every index of the launch (y's, col's) fits, else "int64"."""
    return "int32" if max(s.n0 * geo.k * prod(geo.out_size) + threads(geo, s), col_size) < 2**31 else "int64"


# One y element per thread (i < nb * Cout * OUT of the chunk), in y's memory order, so y's index is ybase + i.
# A tap reaches an output where (h + p - t*d) >= 0 is a multiple of the stride (Q: gather_kernel.grid_kernel).
_KERNEL_BODY = """
UI ii = (UI)i, co, o, j, t;
if (cl) { t = Q(ii, K); co = ii - t * (UI)K; j = Q(t, OUT); o = t - j * (UI)OUT; }
else { t = Q(ii, OUT); o = ii - t * (UI)OUT; j = Q(t, K); co = t - j * (UI)K; }
UI h0 = o, h1 = 0, h2 = 0;
if (ND == 2) { h0 = Q(o, O1); h1 = o - h0 * (UI)O1; }
if (ND == 3) { t = Q(o, O2); h2 = o - t * (UI)O2; h0 = Q(t, O1); h1 = t - h0 * (UI)O1; }
UI gq = Q(co, KG), cg = co - gq * (UI)KG, rowbase = gq * (UI)KG * (UI)RS;
A acc = 0;
for (I r0 = 0; r0 < K0; ++r0) {
  I n0 = (I)h0 + p0 - r0 * d0;
  if (n0 < 0) continue;
  UI i0 = Q(n0, s0);
  if ((UI)n0 != i0 * (UI)s0 || i0 >= (UI)I0) continue;
  for (I r1 = 0; r1 < K1; ++r1) {
    I n1 = (I)h1 + p1 - r1 * d1;
    if (n1 < 0) continue;
    UI i1 = Q(n1, s1);
    if ((UI)n1 != i1 * (UI)s1 || i1 >= (UI)I1) continue;
    for (I r2 = 0; r2 < K2; ++r2) {
      I n2 = (I)h2 + p2 - r2 * d2;
      if (n2 < 0) continue;
      UI i2 = Q(n2, s2);
      if ((UI)n2 != i2 * (UI)s2 || i2 >= (UI)I2) continue;
      UI tap = ((UI)r0 * (UI)K1 + (UI)r1) * (UI)K2 + (UI)r2;
      UI row = rowbase + (wcl ? tap * (UI)KG + cg : cg * (UI)RS + tap);
      acc += (A)col[(I)((j * (UI)PIN + (i0 * (UI)I1 + i1) * (UI)I2 + i2) * (UI)LD + row)];
    }
  }
}
if (bias) acc += (A)bias[co];
y[ybase + (I)ii] = (T)acc;
"""

_CTYPE = {"float16": ("__half", "float"), "float32": ("float", "float"), "float64": ("double", "double")}


def source(dtype, nd: int, index: str) -> tuple[str, str]:
    """(code, name) of the col2im kernel for ``dtype`` (TYPES), ``nd`` spatial dimensions and ``index``
    ("int32" where every index fits, else "int64"): ``(col, bias (0: none), y, ARG_NAMES of the index type,
    the divisors' multipliers and shifts (unsigned int), total)``, sums in float32 (float64 for float64)."""
    from .gather_kernel import grid_kernel
    name = np.dtype(dtype).name
    ctype, acc = _CTYPE[name]
    kname = f"blasx_col2im_{name}_{index}_{nd}d"
    code = grid_kernel(kname, f"const {ctype}* __restrict__ col, const {ctype}* __restrict__ bias, {ctype}* "
                       "__restrict__ y", ARG_NAMES, DIVISORS, index, f"typedef {ctype} T; typedef {acc} A; "
                       f"const int ND = {nd};", _KERNEL_BODY)
    return ("#include <cuda_fp16.h>\n" if name == "float16" else "") + code, kname
