"""Winograd's minimal filtering F(2x2, 3x3) as a forward form of the device route (``winograd``): a 3x3
stride-1 2-D convolution (groups 1, dilation 1) as 16 GEMMs over 4x4 input tiles taken every 2 pixels
(Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", CVPR 2016):

    U[xi] (K x C)  = (G g G^T)[xi]   per output and input channel: the filter transform, once a call
    V[xi] (C x Pc) = (B^T d B)[xi]   per input channel and tile d of a chunk's Pc tiles: the input transform
    M[xi] (K x Pc) = U[xi] V[xi]     16 GEMMs at k = C, one strided-batched cuBLAS call a chunk
    y's 2x2 tile   = A^T M[.] A      per output channel and tile: the output transform

2.25 times fewer multiplications than im2col's GEMM at k = 9C, for three passes over memory; for strict float32
and float64, whose GEMMs have no tensor cores (the tensor-core types keep im2col and the implicit kernel). The
transforms add a small constant to the direct sum's rounding error (their halves and sums).

Pure plan (steps as plain data; CudaOps.wino runs a step by :func:`launch`, the tests' numpy stand-in by
its own form and by the kernels compiled for the host). Buffers: ``x``, ``w`` (the (K, CRS) weight matrix,
reduction order (c, r, s), or (r, s, c) channels-last), ``y``; scratch ``u``, ``v``, ``m``: 16 column-major
matrices each, xi-major (``u`` K x C, ``v`` C x Pc, ``m`` K x Pc).
"""

from __future__ import annotations

from math import prod
from typing import NamedTuple

import numpy as np

from . import conv_direct, gather_kernel
from .conv_direct import OP_N, Gemm
from .geometry import ConvGeometry

TYPES = {"float32": ("float", "float"), "float64": ("double", "double")}  # element and accumulation types
THREADS = 256
MAX_BLOCKS = 1 << 20  # past this the grid-stride loops take the rest


class Wino(NamedTuple):
    """A transform: ``kind`` "filter" (u from w), "input" (v from images n0 .. n0 + nb - 1 of x) or "output"
    (those images of y from m)."""

    kind: str
    n0: int = 0
    nb: int = 0


conv_direct._OPS[Wino] = "wino"


def applies(geo: ConvGeometry, dtype, math: str | None) -> bool:
    """Whether this form runs ``geo``: 2-D, 3x3, stride 1, dilation 1, no zero insertion, one group, strict
    float32 (not TF32) or float64."""
    name = np.dtype(dtype).name
    return geo.nd == 2 and geo.kernel == (3, 3) and geo.groups == 1 and \
        all(v == 1 for v in (*geo.stride, *geo.dilation, *geo.insert)) and \
        (name == "float64" or (name == "float32" and math != "tf32"))


def tiles(geo: ConvGeometry) -> tuple[int, int]:
    """The 2x2 output tiles of an image, per dim."""
    return tuple(-(-o // 2) for o in geo.out_size)


def scratch_per_image(geo: ConvGeometry) -> int:
    """v's and m's elements per image: 16 values a tile for each input and each output channel."""
    return 16 * (geo.c + geo.k) * prod(tiles(geo))


def plan(geo: ConvGeometry, dtype, budget: int, beta: float = 0.0) -> tuple[list, dict]:
    """(steps, scratch buffer name -> elements) with v and m of at most ``budget`` bytes (one image at least):
    the filter transform, then per chunk of images the input transform, the 16 GEMMs, the output transform.
    The output transform writes y: ``beta`` (a sum into y) must be 0 (direct_cuda.forward_plan takes im2col)."""
    if beta:
        raise ValueError(f"winograd.plan: beta must be 0 (the output transform writes y), got {beta}")
    parts = conv_direct.chunks(geo.n, scratch_per_image(geo) * np.dtype(dtype).itemsize, budget)
    t, K, C = prod(tiles(geo)), geo.k, geo.c
    steps: list = [Wino("filter")]
    for n0, nb in parts:
        pc = nb * t  # M[xi] (K x Pc, ld K) = U[xi] (K x C, ld K) V[xi] (C x Pc, ld C), xi < 16
        steps += [Wino("input", n0, nb),
                  Gemm(("u", 0), ("v", 0), ("m", 0), OP_N, OP_N, K, pc, C, K, C, K, K * C, C * pc, K * pc, 16, 0.0),
                  Wino("output", n0, nb)]
    nb = max(nb for _, nb in parts)
    return steps, {"u": 16 * K * C, "v": 16 * C * nb * t, "m": 16 * K * nb * t}


ARG_NAMES = {"filter": ("K", "C", "cl"),
             "input": ("C", "H", "W", "TH", "TW", "PC", "P0", "P1", "n0", "sn", "sc", "sh", "sw"),
             "output": ("K", "OH", "OW", "TH", "TW", "PC", "n0", "sn", "sc", "sh", "sw")}
DIVISORS = {"filter": ("K",), "input": ("C", "TW", "TH"), "output": ("K", "TW", "TH")}


def _strides(n_channels: int, size: tuple, cl: bool) -> tuple[int, int, int, int]:
    """(image, channel, row, column) element strides of a compact (N, channels, H, W) array in its layout."""
    h, w = size
    return (n_channels * h * w, 1, w * n_channels, n_channels) if cl else (n_channels * h * w, h * w, w, 1)


def kernel_args(geo: ConvGeometry, cl: bool, s: Wino) -> tuple[int, ...]:
    """The kernel's integer arguments (ARG_NAMES[s.kind]) for step ``s``."""
    th, tw = tiles(geo)
    if s.kind == "filter":
        return geo.k, geo.c, int(cl)
    if s.kind == "input":
        return (geo.c, *geo.in_size, th, tw, s.nb * th * tw, *geo.pad_lo, s.n0,
                *_strides(geo.c, geo.in_size, cl))
    return (geo.k, *geo.out_size, th, tw, s.nb * th * tw, s.n0, *_strides(geo.k, geo.out_size, cl))


def threads(geo: ConvGeometry, s: Wino) -> int:
    """One a (output, input) channel pair, a (channel, tile) or an (output channel, tile)."""
    pc = s.nb * prod(tiles(geo))
    return {"filter": geo.k * geo.c, "input": geo.c * pc, "output": geo.k * pc}[s.kind]


def index_type(geo: ConvGeometry, s: Wino) -> str:
    """"int32" where every index of the launch fits (x's, y's, the scratch's), else "int64"."""
    pc = s.nb * prod(tiles(geo))
    largest = max(geo.n * geo.c * prod(geo.in_size), geo.n * geo.k * geo.p, 16 * geo.c * max(pc, geo.k),
                  16 * geo.k * pc)
    return "int32" if largest < 2**31 else "int64"


# The transforms, per thread; Q(a, D) is a / D (gather_kernel.grid_kernel). Index 4a + b is row a, column b.
_BODIES = {
    "filter": """
UI c = Q(i, K), k = (UI)i - c * (UI)K;
A g[9], t[12];
for (int r = 0; r < 9; ++r) g[r] = (A)w[(I)(k * 9 * (UI)C + (cl ? (UI)r * (UI)C + c : c * 9 + (UI)r))];
for (int s = 0; s < 3; ++s) {  // t = G g: rows g0, (g0 + g1 + g2) / 2, (g0 - g1 + g2) / 2, g2
  A a0 = g[s], a1 = g[3 + s], a2 = g[6 + s];
  t[s] = a0; t[3 + s] = (a0 + a1 + a2) * (A)0.5; t[6 + s] = (a0 - a1 + a2) * (A)0.5; t[9 + s] = a2;
}
for (int a = 0; a < 4; ++a) {  // U = t G^T
  A b0 = t[3 * a], b1 = t[3 * a + 1], b2 = t[3 * a + 2];
  A r4[4] = {b0, (b0 + b1 + b2) * (A)0.5, (b0 - b1 + b2) * (A)0.5, b2};
  for (int b = 0; b < 4; ++b) u[(I)(((UI)(4 * a + b) * (UI)C + c) * (UI)K + k)] = (T)r4[b];
}
""",
    "input": """
UI p = Q(i, C), c = (UI)i - p * (UI)C, t0 = Q(p, TW), tw = p - t0 * (UI)TW, j = Q(t0, TH), th = t0 - j * (UI)TH;
I h0 = 2 * (I)th - P0, w0 = 2 * (I)tw - P1;
A d[16], t[16];
for (int a = 0; a < 4; ++a)
  for (int b = 0; b < 4; ++b) {
    I h = h0 + a, x1 = w0 + b;
    d[4 * a + b] = (h >= 0 && h < H && x1 >= 0 && x1 < W) ?
        (A)x[((I)n0 + (I)j) * sn + (I)c * sc + h * sh + x1 * sw] : (A)0;
  }
for (int b = 0; b < 4; ++b) {  // t = B^T d: rows d0 - d2, d1 + d2, d2 - d1, d1 - d3
  t[b] = d[b] - d[8 + b]; t[4 + b] = d[4 + b] + d[8 + b]; t[8 + b] = d[8 + b] - d[4 + b];
  t[12 + b] = d[4 + b] - d[12 + b];
}
for (int a = 0; a < 4; ++a) {  // V = t B: the same on the columns
  A e0 = t[4 * a], e1 = t[4 * a + 1], e2 = t[4 * a + 2], e3 = t[4 * a + 3];
  A r4[4] = {e0 - e2, e1 + e2, e2 - e1, e1 - e3};
  for (int b = 0; b < 4; ++b) v[(I)(((UI)(4 * a + b) * (UI)PC + p) * (UI)C + c)] = (T)r4[b];
}
""",
    "output": """
UI p = Q(i, K), k = (UI)i - p * (UI)K, t0 = Q(p, TW), tw = p - t0 * (UI)TW, j = Q(t0, TH), th = t0 - j * (UI)TH;
A q[16], t[8];
for (int e = 0; e < 16; ++e) q[e] = (A)m[(I)(((UI)e * (UI)PC + p) * (UI)K + k)];
for (int b = 0; b < 4; ++b) {  // t = A^T q: rows q0 + q1 + q2, q1 - q2 - q3
  t[b] = q[b] + q[4 + b] + q[8 + b]; t[4 + b] = q[4 + b] - q[8 + b] - q[12 + b];
}
for (int a = 0; a < 2; ++a) {  // y's tile = t A: the same on the columns, where it lies in y
  A r2[2] = {t[4 * a] + t[4 * a + 1] + t[4 * a + 2], t[4 * a + 1] - t[4 * a + 2] - t[4 * a + 3]};
  I h = 2 * (I)th + a;
  for (int b = 0; b < 2; ++b) {
    I x1 = 2 * (I)tw + b;
    if (h < OH && x1 < OW) y[((I)n0 + (I)j) * sn + (I)k * sc + h * sh + x1 * sw] = (T)r2[b];
  }
}
""",
}
_POINTERS = {"filter": ("w", "u"), "input": ("x", "v"), "output": ("m", "y")}  # (read, written)


def source(kind: str, dtype, index: str) -> tuple[str, str]:
    """(code, name) of the ``kind`` transform for ``dtype`` (TYPES) and ``index`` ("int32" or "int64"):
    ``(read, written, ARG_NAMES[kind] of the index type, the divisors' multipliers and shifts, total)``."""
    name = np.dtype(dtype).name
    ctype, acc = TYPES[name]
    src, dst = _POINTERS[kind]
    kname = f"blasx_winograd_{kind}_{name}_{index}"
    code = gather_kernel.grid_kernel(kname, f"const {ctype}* __restrict__ {src}, {ctype}* __restrict__ {dst}",
                                     ARG_NAMES[kind], DIVISORS[kind], index, f"typedef {ctype} T; typedef {acc} A;",
                                     _BODIES[kind])
    return code, kname


_KERNELS: dict = {}


def launch(ops, s: Wino) -> None:
    """Step ``s`` on the current stream for ``ops`` (direct_cuda.CudaOps: its geometry, layout, type and
    buffers)."""
    import cupy
    geo, index = ops.geo, index_type(ops.geo, s)
    key = (s.kind, ops.dtype.name, index)
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = cupy.RawKernel(*source(*key))
    args = kernel_args(geo, ops.cl, s)
    total = threads(geo, s)
    it = np.int32 if index == "int32" else np.int64
    blocks = max(1, min(-(-total // THREADS), MAX_BLOCKS))
    k((blocks,), (THREADS,), (*(ops.bufs[b] for b in _POINTERS[s.kind]), *(it(a) for a in args),
                              *(np.uint32(v) for v in gather_kernel.magic_args(args, ARG_NAMES[s.kind],
                                                                                DIVISORS[s.kind])),
                              np.int64(total)))
