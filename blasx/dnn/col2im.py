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
column-major for channels-last x and y; for NCHW, per image, the transpose: pixels contiguous, in y's order),
``y``, and an optional ``bias``. ``geo`` is transpose_geometry's (c = Cin, k = Cout, in_size =
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


class WeightOrder(NamedTuple):
    """``wt`` = the weight in its channels-last order (Cin, k..., Cout/g): for channels-last x and y, whose
    col2im threads read a run of channels per tap, contiguous only in col's (tap, co) rows."""


conv_direct._OPS[Col2im] = "col2im"  # the executors' methods for these steps
conv_direct._OPS[WeightOrder] = "weight_order"


def applies(geo: ConvGeometry, dtype) -> bool:
    """Whether this form runs ``geo``: a strided transposed convolution of a type the kernel is made for."""
    return any(z > 1 for z in geo.insert) and np.dtype(dtype).name in TYPES


def scratch_per_image(geo: ConvGeometry) -> int:
    """col's elements per image: Cout * taps rows, the image's input pixels as columns."""
    return geo.k * prod(geo.kernel) * prod(geo.in_size)


def reorders(geo: ConvGeometry, cl: bool, wcl: bool) -> bool:
    """Whether the plan puts the weight in its channels-last order first (WeightOrder): channels-last x and y
    with a weight of another order and a window (a 1x1's orders are the same)."""
    return cl and not wcl and prod(geo.kernel) > 1


def steps(geo: ConvGeometry, cl: bool, wcl: bool, parts: list) -> list:
    """Per chunk (first image, images) of ``parts``: one GEMM per group into col, then Col2im; the weight
    reordered once first where ``reorders`` (the GEMMs read ``wt``)."""
    G, cg, kg, taps = geo.groups, geo.cg, geo.kg, prod(geo.kernel)
    rows, pin, cin = geo.k * taps, prod(geo.in_size), geo.c
    out: list = []
    wname = "w"
    if reorders(geo, cl, wcl):
        out.append(WeightOrder())
        wname, wcl = "wt", True
    for n0, nb in parts:
        for g in range(G):
            a = (wname, g * cg * kg * taps)  # w_g: (kg*taps x cg), column-major, ld kg*taps
            if cl:  # x's chunk as (Cin x nb*Pin), ld Cin
                out.append(Gemm(a, ("x", n0 * pin * cin + g * cg), ("col", g * kg * taps), OP_N, OP_N, kg * taps,
                                nb * pin, cg, kg * taps, cin, rows, 0, 0, 0, 1, 0.0))
            else:  # per image, col_n^T (Pin x rows, pixels contiguous) = x_n^T w_g, so col2im's reads coalesce
                out.append(Gemm(("x", (n0 * cin + g * cg) * pin), a, ("col", g * kg * taps * pin), OP_N, OP_T, pin,
                                kg * taps, cg, pin, kg * taps, pin, cin * pin, 0, rows * pin, nb, 0.0))
        out.append(Col2im(n0, nb, wcl))
    return out


def _three(t, fill):
    """``t`` right-aligned in three dims (the innermost last), ``fill`` before it."""
    return (*(fill,) * (3 - len(t)), *t)


ARG_NAMES = ("K KG RS LD OUT O1 O2 I0 I1 I2 PIN K0 K1 K2 s0 s1 s2 d0 d1 d2 p0 p1 p2 cl wcl ybase").split()
DIVISORS = ("K", "OUT", "O1", "O2", "KG", "s0", "s1", "s2")  # the ARG_NAMES the index arithmetic divides by


def kernel_args(geo: ConvGeometry, cl: bool, s: Col2im) -> tuple[int, ...]:
    """The kernel's integer arguments (ARG_NAMES) for step ``s``; spatial ones right-aligned (_three)."""
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


def vector(geo: ConvGeometry, cl: bool, dtype) -> int:
    """y elements a thread writes, consecutive along y's contiguous dim (channels within a group for
    channels-last, the innermost spatial dim for NCHW): the most, up to 16 bytes, that divide that dim."""
    n, v = geo.kg if cl else geo.out_size[-1], 16 // np.dtype(dtype).itemsize
    while n % v:
        v //= 2
    return v


def threads(geo: ConvGeometry, s: Col2im, vec: int = 1) -> int:
    return s.nb * geo.k * prod(geo.out_size) // vec


def index_type(geo: ConvGeometry, s: Col2im, col_size: int) -> str:
    """"int32" where every index of the launch (y's, col's) fits, else "int64"."""
    return "int32" if max(s.n0 * geo.k * prod(geo.out_size) + threads(geo, s), col_size) < 2**31 else "int64"


# Thread i writes the V y elements from e = i * V of the chunk in y's memory order (y's index ybase + e), a run
# along y's contiguous dim: channels (cl) share their pixel's taps, NCHW pixels of one row share the outer dims'.
# A tap reaches an output where (h + p - t*d) >= 0 is a multiple of the stride (Q: gather_kernel.grid_kernel).
_KERNEL_BODY = """
UI e = (UI)i * (UI)V, co, o, j, t;
if (cl) { t = Q(e, K); co = e - t * (UI)K; j = Q(t, OUT); o = t - j * (UI)OUT; }
else { t = Q(e, OUT); o = e - t * (UI)OUT; j = Q(t, K); co = t - j * (UI)K; }
UI h0 = 0, h1 = 0, h2 = o;
if (ND == 2) { h1 = Q(o, O2); h2 = o - h1 * (UI)O2; }
if (ND == 3) { t = Q(o, O2); h2 = o - t * (UI)O2; h0 = Q(t, O1); h1 = t - h0 * (UI)O1; }
UI gq = Q(co, KG), cg = co - gq * (UI)KG, rowbase = gq * (UI)KG * (UI)RS;
A acc[V];
for (int v = 0; v < V; ++v) acc[v] = 0;
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
      UI tap = ((UI)r0 * (UI)K1 + (UI)r1) * (UI)K2 + (UI)r2;
      if (cl) {  // col's rows of the run's channels at the tap's input pixel
        I n2 = (I)h2 + p2 - r2 * d2;
        if (n2 < 0) continue;
        UI i2 = Q(n2, s2);
        if ((UI)n2 != i2 * (UI)s2 || i2 >= (UI)I2) continue;
        UI base = (j * (UI)PIN + (i0 * (UI)I1 + i1) * (UI)I2 + i2) * (UI)LD + rowbase;
        for (int v = 0; v < V; ++v)
          acc[v] += (A)col[(I)(base + (wcl ? tap * (UI)KG + cg + (UI)v : (cg + (UI)v) * (UI)RS + tap))];
      } else {  // the tap's row of col, pixels contiguous: each output of the run reads its own
        UI base = (j * (UI)LD + rowbase + (wcl ? tap * (UI)KG + cg : cg * (UI)RS + tap)) * (UI)PIN +
                  (i0 * (UI)I1 + i1) * (UI)I2;
        for (int v = 0; v < V; ++v) {
          I n2 = (I)(h2 + (UI)v) + p2 - r2 * d2;
          if (n2 < 0) continue;
          UI i2 = Q(n2, s2);
          if ((UI)n2 != i2 * (UI)s2 || i2 >= (UI)I2) continue;
          acc[v] += (A)col[(I)(base + i2)];
        }
      }
    }
  }
}
__align__(16) T out[V];
for (int v = 0; v < V; ++v) out[v] = (T)(bias ? acc[v] + (A)bias[co + (cl ? (UI)v : 0)] : acc[v]);
T* dst = y + ybase + (I)e;
unsigned long long at = (unsigned long long)dst, width = V * sizeof(T);  // one store where y's memory allows
if (width == 16 && at % 16 == 0) *(ulonglong2*)dst = *(const ulonglong2*)out;
else if (width == 8 && at % 8 == 0) *(unsigned long long*)dst = *(const unsigned long long*)out;
else if (width == 4 && at % 4 == 0) *(unsigned int*)dst = *(const unsigned int*)out;
else for (int v = 0; v < V; ++v) dst[v] = out[v];
"""

_CTYPE = {"float16": ("__half", "float"), "float32": ("float", "float"), "float64": ("double", "double")}


def source(dtype, nd: int, index: str, vec: int = 1) -> tuple[str, str]:
    """(code, name) of the col2im kernel for ``dtype`` (TYPES), ``nd`` spatial dimensions, ``index``
    ("int32" where every index fits, else "int64") and ``vec`` y elements a thread (vector): ``(col, bias
    (0: none), y, ARG_NAMES of the index type, the divisors' multipliers and shifts (unsigned int), total
    threads)``, sums in float32 (float64 for float64)."""
    from .gather_kernel import grid_kernel
    name = np.dtype(dtype).name
    ctype, acc = _CTYPE[name]
    kname = f"blasx_col2im_{name}_{index}_{nd}d_v{vec}"
    code = grid_kernel(kname, f"const {ctype}* __restrict__ col, const {ctype}* __restrict__ bias, {ctype}* "
                       "__restrict__ y", ARG_NAMES, DIVISORS, index, f"typedef {ctype} T; typedef {acc} A; "
                       f"const int ND = {nd}; const int V = {vec};", _KERNEL_BODY)
    return ("#include <cuda_fp16.h>\n" if name == "float16" else "") + code, kname
