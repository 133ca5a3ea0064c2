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


ARG_NAMES = ("K KG RS LD OUT O1 O2 I0 I1 I2 PIN K0 K1 K2 s0 s1 s2 d0 d1 d2 p0 p1 p2 cl wcl ybase has_bias").split()


def kernel_args(geo: ConvGeometry, cl: bool, s: Col2im, has_bias: bool) -> tuple[int, ...]:
    """The kernel's integer arguments (ARG_NAMES) for step ``s``."""
    taps = prod(geo.kernel)
    out, ins = _three(geo.out_size, 1), _three(geo.in_size, 1)
    pad = tuple(d * (k - 1) - lo for d, k, lo in zip(geo.dilation, geo.kernel, geo.pad_lo))
    return (geo.k, geo.kg, taps, geo.k * taps, prod(geo.out_size), out[1], out[2], *ins, prod(geo.in_size),
            *_three(geo.kernel, 1), *_three(geo.insert, 1), *_three(geo.dilation, 1), *_three(pad, 0), int(cl),
            int(s.wcl), s.n0 * geo.k * prod(geo.out_size), int(has_bias))


def threads(geo: ConvGeometry, s: Col2im) -> int:
    return s.nb * geo.k * prod(geo.out_size)


# One y element per thread (i < nb * Cout * OUT of the chunk), in y's memory order, so y's index is ybase + i.
_KERNEL_BODY = """
typedef long long L;
L ii = (L)i, co, o, j, t;
if (cl) { co = ii % K; t = ii / K; o = t % OUT; j = t / OUT; }
else { o = ii % OUT; t = ii / OUT; co = t % K; j = t / K; }
L h0 = o, h1 = 0, h2 = 0;
if (ND == 2) { h1 = o % O1; h0 = o / O1; }
if (ND == 3) { h2 = o % O2; t = o / O2; h1 = t % O1; h0 = t / O1; }
L cg = co % KG, rowbase = (co / KG) * KG * RS;
A acc = 0;
for (L r0 = 0; r0 < K0; ++r0) {
  L n0 = h0 + p0 - r0 * d0;
  if (n0 < 0 || n0 % s0) continue;
  L i0 = n0 / s0;
  if (i0 >= I0) continue;
  for (L r1 = 0; r1 < K1; ++r1) {
    L n1 = h1 + p1 - r1 * d1;
    if (n1 < 0 || n1 % s1) continue;
    L i1 = n1 / s1;
    if (i1 >= I1) continue;
    for (L r2 = 0; r2 < K2; ++r2) {
      L n2 = h2 + p2 - r2 * d2;
      if (n2 < 0 || n2 % s2) continue;
      L i2 = n2 / s2;
      if (i2 >= I2) continue;
      L tap = (r0 * K1 + r1) * K2 + r2;
      L row = rowbase + (wcl ? tap * KG + cg : cg * RS + tap);
      acc += (A)col[(j * PIN + (i0 * I1 + i1) * I2 + i2) * LD + row];
    }
  }
}
if (has_bias) acc += (A)bias[co];
y[ybase + ii] = (T)acc;
"""

_CTYPE = {"float16": ("float16", "float"), "float32": ("float", "float"), "float64": ("double", "double")}


def kernel_source(dtype, nd: int) -> tuple[str, str, str, str]:
    """(in_params, out_params, operation, name) of the col2im ElementwiseKernel for ``dtype`` (TYPES) and ``nd``
    spatial dimensions: sums in float32 (float64 for float64)."""
    name = np.dtype(dtype).name
    ctype, acc = _CTYPE[name]
    head = f"typedef {ctype} T; typedef {acc} A; const int ND = {nd};"
    params = f"raw {name} col, raw {name} bias, " + ", ".join(f"int64 {a}" for a in ARG_NAMES)
    return params, f"raw {name} y", head + _KERNEL_BODY, f"blasx_col2im_{name}_{nd}d"
