"""The device route's im2col gather kernel (conv_direct.Gather steps): its CUDA source and the divisors'
multipliers. A thread writes one col element (i < nb * CRS * P); x and col are element bits (type U: 2, 4,
8 bytes, or 16 where a thread moves several channels: more bytes in flight a thread),
indices signed of type I, the index arithmetic unsigned (UI). ND (1-3) and INSERT (a transposed convolution's
zero insertion) are constants of each compiled kernel; the dimensions past ND are trivial (arguments 1 or 0).
The run gather (``run_source``) writes a run of a padded col row a thread instead (an image's first layer).

With 32-bit indices every quotient is a multiply-high and a shift by the divisor's multiplier
(``fast_divisor``, passed with the arguments): a hardware-less integer division costs some twenty
instructions, and a 2-D gather does five of them an element, which made the kernel compute-bound.
"""

from __future__ import annotations

ARG_NAMES = ("P CRS KS Cg cl pf goff K1 K2 O1 O2 st0 st1 st2 dl0 dl1 dl2 pl0 pl1 pl2 z0 z1 z2 I0 I1 I2 "
             "sn sc s0 s1 s2 n0 on orr op").split()
DIVISORS = ("P", "CRS", "KS", "Cg", "K1", "K2", "O1", "O2")  # the ARG_NAMES the index arithmetic divides by
MAGIC_NAMES = [f"{d}_{v}" for d in DIVISORS for v in ("m", "s")]

HELPERS = """#ifndef BLASX_GATHER_QUO
#define BLASX_GATHER_QUO
__device__ __forceinline__ unsigned int blasx_quo(unsigned int a, unsigned int d, unsigned int m, unsigned int s)
{ return m ? __umulhi(a, m) >> s : a; }
__device__ __forceinline__ unsigned long long blasx_quo(unsigned long long a, unsigned long long d, unsigned int,
                                                        unsigned int)
{ return a / d; }
#endif
"""

_BODY = """
UI ii = (UI)i, p, r, j, t;
if (pf) { t = Q(ii, P); p = ii - t * (UI)P; j = Q(t, CRS); r = t - j * (UI)CRS; }
else { t = Q(ii, CRS); r = ii - t * (UI)CRS; j = Q(t, P); p = t - j * (UI)P; }
UI c, k;
if (cl) { k = Q(r, Cg); c = r - k * (UI)Cg; } else { c = Q(r, KS); k = r - c * (UI)KS; }
UI k0 = k, k1 = 0, k2 = 0, o0 = p, o1 = 0, o2 = 0;
if (ND == 2) { k0 = Q(k, K1); k1 = k - k0 * (UI)K1; o0 = Q(p, O1); o1 = p - o0 * (UI)O1; }
if (ND == 3) { t = Q(k, K2); k2 = k - t * (UI)K2; k0 = Q(t, K1); k1 = t - k0 * (UI)K1;
               t = Q(p, O2); o2 = p - t * (UI)O2; o0 = Q(t, O1); o1 = t - o0 * (UI)O1; }
I u0 = (I)(o0 * (UI)st0 + k0 * (UI)dl0) - pl0;
I u1 = ND >= 2 ? (I)(o1 * (UI)st1 + k1 * (UI)dl1) - pl1 : 0;
I u2 = ND == 3 ? (I)(o2 * (UI)st2 + k2 * (UI)dl2) - pl2 : 0;
bool ok = u0 >= 0 && u1 >= 0 && u2 >= 0;
if (INSERT) {
  ok = ok && u0 % z0 == 0 && u1 % z1 == 0 && u2 % z2 == 0;
  u0 /= z0; u1 /= z1; u2 /= z2;
}
ok = ok && u0 < I0 && u1 < I1 && u2 < I2;
col[(I)(j * (UI)on + r * (UI)orr + p * (UI)op)] =
    ok ? x[(I)((n0 + (I)j) * sn + (goff + (I)c) * sc) + u0 * s0 + u1 * s1 + u2 * s2] : zero;
"""

_CTYPES = {2: "unsigned short", 4: "unsigned int", 8: "unsigned long long", 16: "ulonglong2"}  # unit -> type


def source(unit: int, index: str, nd: int, insert: bool) -> tuple[str, str]:
    """(code, name) of the gather over ``unit``-byte elements (2, 4, 8 or 16) with indices ``index`` ("int32"
    where every index fits, else "int64"): ``(x, col, ARG_NAMES, MAGIC_NAMES, total)``."""
    ctype = _CTYPES[unit]
    name = f"blasx_conv_gather_u{8 * unit}_{index}_{nd}d{'_z' if insert else ''}"
    head = (f"typedef {ctype} U; const int ND = {nd}; const bool INSERT = {str(insert).lower()}; "
            "const U zero = {};")
    return grid_kernel(name, f"const {ctype}* __restrict__ x, {ctype}* __restrict__ col", ARG_NAMES, DIVISORS,
                       index, head, _BODY), name


RUN_ARG_NAMES = [*ARG_NAMES, "RU", "NPIX"]  # RU: runs in a col row (its length op = RU * V); NPIX: the pixels
RUN_DIVISORS = ("P", "RU", "Cg", "K1", "K2", "O1", "O2")
RUN_MAGIC_NAMES = [f"{d}_{v}" for d in RUN_DIVISORS for v in ("m", "s")]
RUN_BYTES = 16  # what a thread of the run gather stores at once
RUN_PIXELS = 4  # pixels a thread of the run gather writes its run of

# A thread takes run (r .. r + V - 1) of RUN_PIXELS consecutive pixels: the run's taps (x offsets, window
# displacements and their extremes) are worked out once; a pixel whose window holds all of them reads without
# bounds checks.
_RUN_BODY = """
UI ii = (UI)i;
UI pg = Q(ii, RU), r = (ii - pg * (UI)RU) * (UI)V;
UI k = Q(r, Cg), c = r - k * (UI)Cg, k0 = k, k1 = 0, k2 = 0, t;
if (ND == 2) { k0 = Q(k, K1); k1 = k - k0 * (UI)K1; }
if (ND == 3) { t = Q(k, K2); k2 = k - t * (UI)K2; k0 = Q(t, K1); k1 = t - k0 * (UI)K1; }
const int rem = (int)((UI)CRS - r);  // the run's real elements (the rest are padding: zero)
I off[V], d0[V], d1[V], d2[V];
I lo0 = 0, hi0 = 0, lo1 = 0, hi1 = 0, lo2 = 0, hi2 = 0;
#pragma unroll
for (int e = 0; e < V; ++e) {
  d0[e] = (I)(k0 * (UI)dl0); d1[e] = (I)(k1 * (UI)dl1); d2[e] = (I)(k2 * (UI)dl2);
  off[e] = (I)c * sc + d0[e] * s0 + d1[e] * s1 + d2[e] * s2;
  if (e == 0) { lo0 = hi0 = d0[0]; lo1 = hi1 = d1[0]; lo2 = hi2 = d2[0]; }
  else if (e < rem) { lo0 = d0[e] < lo0 ? d0[e] : lo0; hi0 = d0[e] > hi0 ? d0[e] : hi0;
                      lo1 = d1[e] < lo1 ? d1[e] : lo1; hi1 = d1[e] > hi1 ? d1[e] : hi1;
                      lo2 = d2[e] < lo2 ? d2[e] : lo2; hi2 = d2[e] > hi2 ? d2[e] : hi2; }
  if (++c == (UI)Cg) {
    c = 0;
    if (ND == 1) { ++k0; }
    else if (ND == 2) { if (++k1 == (UI)K1) { k1 = 0; ++k0; } }
    else if (++k2 == (UI)K2) { k2 = 0; if (++k1 == (UI)K1) { k1 = 0; ++k0; } }
  }
}
for (int q = 0; q < PIXELS; ++q) {
  UI tp = pg * (UI)PIXELS + (UI)q;
  if (tp >= (UI)NPIX) break;
  UI j = Q(tp, P), p = tp - j * (UI)P, o0 = p, o1 = 0, o2 = 0;
  if (ND == 2) { o0 = Q(p, O1); o1 = p - o0 * (UI)O1; }
  if (ND == 3) { t = Q(p, O2); o2 = p - t * (UI)O2; o0 = Q(t, O1); o1 = t - o0 * (UI)O1; }
  I a0 = (I)(o0 * (UI)st0) - pl0, a1 = (I)(o1 * (UI)st1) - pl1, a2 = (I)(o2 * (UI)st2) - pl2;
  const E* xp = x + ((n0 + (I)j) * sn + goff * sc + a0 * s0 + a1 * s1 + a2 * s2);
  bool inside = a0 + lo0 >= 0 && a0 + hi0 < I0 && a1 + lo1 >= 0 && a1 + hi1 < I1 && a2 + lo2 >= 0 && a2 + hi2 < I2;
  union { U u; E e[V]; } out;
  if (inside) {
#pragma unroll
    for (int e = 0; e < V; ++e) out.e[e] = e < rem ? xp[off[e]] : (E)0;
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      I u0 = a0 + d0[e], u1 = a1 + d1[e], u2 = a2 + d2[e];
      bool ok = e < rem && u0 >= 0 && u1 >= 0 && u2 >= 0 && u0 < I0 && u1 < I1 && u2 < I2;
      out.e[e] = ok ? xp[off[e]] : (E)0;
    }
  }
  *(U*)(col + (I)(j * (UI)on + r + p * (UI)op)) = out.u;
}
"""


def run_source(itemsize: int, index: str, nd: int) -> tuple[str, str]:
    """(code, name) of the run gather: a thread writes V = RUN_BYTES / ``itemsize`` consecutive elements of a col
    row (reduction order (r..., c), x read by its strides in either layout, no zero insertion) in one 16-byte store, for RUN_PIXELS
    consecutive pixels, reading the elements one by one: for a few input channels, whose rows are padded with
    zeros to a whole number of runs (their length ``op``, a multiple of V; elements past CRS are zero).
    Arguments ``(x, col, RUN_ARG_NAMES, RUN_MAGIC_NAMES, total)``, total = ceil(NPIX / RUN_PIXELS) * RU; col's
    offset of every run is a multiple of V."""
    ctype = _CTYPES[itemsize]
    v = RUN_BYTES // itemsize
    name = f"blasx_conv_gather_run{v}_e{8 * itemsize}_{index}_{nd}d"
    head = (f"typedef {ctype} E; typedef ulonglong2 U; const int ND = {nd}; const int V = {v}; "
            f"const int PIXELS = {RUN_PIXELS};")
    return grid_kernel(name, f"const {ctype}* __restrict__ x, {ctype}* __restrict__ col", RUN_ARG_NAMES,
                       RUN_DIVISORS, index, head, _RUN_BODY), name


def grid_kernel(name: str, pointers: str, names, divisors, index: str, head: str, body: str) -> str:
    """The code of raw kernel ``name(pointers, names (of the index type), each divisor's D_m and D_s (unsigned
    int), long long total)``: ``head``, then ``body`` for every i < total in a grid-stride loop; I and UI are
    the index type signed and unsigned, and Q(a, D) is a / D for an a >= 0 (32-bit indices: by D's multiplier
    and shift, fast_divisor; 64-bit: a division)."""
    i, ui = ("int", "unsigned int") if index == "int32" else ("long long", "unsigned long long")
    params = ", ".join([*(f"{i} {n}" for n in names), *(f"unsigned int {d}_{v}" for d in divisors
                                                       for v in ("m", "s"))])
    return (f"{HELPERS}extern \"C\" __global__ void {name}({pointers}, {params}, long long total) {{\n"
            f"typedef {i} I; typedef {ui} UI; {head}\n#define Q(a, D) blasx_quo((UI)(a), (UI)D, D##_m, D##_s)\n"
            f"for (I i = (I)(blockIdx.x * blockDim.x + threadIdx.x); i < (I)total; i += (I)(gridDim.x * blockDim.x))"
            f" {{{body}}}\n#undef Q\n}}\n")


def fast_divisor(d: int) -> tuple[int, int]:
    """(multiplier, shift) with ``a // d == (a * multiplier >> 32) >> shift`` for every 0 <= a < 2**31
    (multiplier 0: d is 1, the quotient is a)."""
    if not 1 <= d < 2**31:
        raise ValueError(f"d: got {d}, need 1 <= d < 2**31")
    if d == 1:
        return 0, 0
    log = (d - 1).bit_length()  # ceil(log2 d)
    p = 31 + log
    return ((1 << p) + d - 1) // d, p - 32


def magic_args(args: tuple, names=ARG_NAMES, divisors=DIVISORS) -> tuple:
    """The (multiplier, shift) pairs of ``divisors`` (the MAGIC_NAMES values) for the ``names`` values ``args``."""
    named = dict(zip(names, args))
    return tuple(v for d in divisors for v in divisor_pair(int(named[d])))


def divisor_pair(d: int) -> tuple[int, int]:
    """fast_divisor(d) where a 32-bit launch can divide by d, else (0, 0) (only a 64-bit launch has such a d)."""
    return fast_divisor(max(1, d)) if d < 2**31 else (0, 0)
