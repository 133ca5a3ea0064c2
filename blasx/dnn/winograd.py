"""Winograd's minimal filtering F(m x m, 3x3) as a forward form of the device route (``winograd``): a 3x3
stride-1 2-D convolution (groups 1, dilation 1) as a^2 GEMMs (a = m + 2) over a x a input tiles taken every m
pixels (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", CVPR 2016):

    U[xi] (K x C)  = (G g G^T)[xi]   per output and input channel: the filter transform, once a call
    V[xi] (C x Pc) = (B^T d B)[xi]   per input channel and tile d of a chunk's Pc tiles: the input transform
    M[xi] (K x Pc) = U[xi] V[xi]     a^2 GEMMs at k = C, one strided-batched cuBLAS call a chunk
    y's m x m tile = A^T M[.] A      per output channel and tile: the output transform

The weight gradient is the forward's transpose (dL/dU = A dY A^T * V, summed over tiles, then dW = G^T (.) G):

    E[xi] (K x Pc) = (A e A^T)[xi]   per output channel and m x m tile e of dY: the gradient transform
    M[xi] (K x C) += E[xi] V[xi]^T   a^2 GEMMs at k = Pc, summed over the chunks
    dW's 3x3       = G^T M[.] G      per output and input channel: the weight transform

F(2x2) makes 2.25 times fewer multiplications than im2col's GEMM at k = 9C, F(4x4) 4 times, for three passes
over memory; for strict float32 and float64, whose GEMMs have no tensor cores (the tensor-core types keep
im2col and the implicit kernel). The transforms add to the direct sum's rounding error, a small constant for
F(2x2), more for F(4x4) (its 1/6 and 1/24 and sums of up to 5 terms: several times im2col's error, within the
ieee tolerance). ``conv_direct.WINOGRAD_TILE`` picks one (4 by default: the fewer multiplications).

Pure plan (steps as plain data; CudaOps.wino runs a step by :func:`launch`, the tests' numpy stand-in by
its own form and by the kernels compiled for the host). Buffers: ``x``, ``w`` (the (K, CRS) weight matrix,
reduction order (c, r, s), or (r, s, c) channels-last), ``y``; scratch ``u``, ``v``, ``m``: a^2 column-major
matrices each, xi-major (``u`` K x C, ``v`` C x Pc, ``m`` K x Pc). The transforms' code is generated from the
matrices (``MATRICES``), a line per output value with its nonzero terms.
"""

from __future__ import annotations

from math import prod
from typing import NamedTuple

import numpy as np

from . import conv_direct, gather_kernel
from .conv_direct import OP_N, OP_T, Gemm
from .geometry import ConvGeometry

TYPES = {"float32": ("float", "float"), "float64": ("double", "double")}  # element and accumulation types

# (B^T, G, A^T) of F(m x m, 3x3): a x a, a x 3, m x a (Lavin and Gray's, a = m + 2).
MATRICES = {
    2: (((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1)),
        ((1, 0, 0), (1 / 2, 1 / 2, 1 / 2), (1 / 2, -1 / 2, 1 / 2), (0, 0, 1)),
        ((1, 1, 1, 0), (0, 1, -1, -1))),
    4: (((4, 0, -5, 0, 1, 0), (0, -4, -4, 1, 1, 0), (0, 4, -4, -1, 1, 0), (0, -2, -1, 2, 1, 0), (0, 2, -1, -2, 1, 0),
         (0, 4, 0, -5, 0, 1)),
        ((1 / 4, 0, 0), (-1 / 6, -1 / 6, -1 / 6), (-1 / 6, 1 / 6, -1 / 6), (1 / 24, 1 / 12, 1 / 6),
         (1 / 24, -1 / 12, 1 / 6), (0, 0, 1)),
        ((1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0), (0, 1, -1, 8, -8, 1))),
}


class Wino(NamedTuple):
    """A transform of F(m x m, 3x3): ``kind`` "filter" (u from w), "input" (v from images n0 .. n0 + nb - 1 of
    x), "output" (those images of y from m); the weight gradient's "dy" (e from those images of dY) and "weight"
    (dw from u)."""

    kind: str
    n0: int = 0
    nb: int = 0
    m: int = 2  # F(m x m, 3x3)


conv_direct._OPS[Wino] = "wino"


def applies(geo: ConvGeometry, dtype, math: str | None) -> bool:
    """Whether this form runs ``geo``: 2-D, 3x3, stride 1, dilation 1, no zero insertion, one group, strict
    float32 (not TF32) or float64."""
    name = np.dtype(dtype).name
    return geo.nd == 2 and geo.kernel == (3, 3) and geo.groups == 1 and \
        all(v == 1 for v in (*geo.stride, *geo.dilation, *geo.insert)) and \
        (name == "float64" or (name == "float32" and math != "tf32"))


MIN_CHANNELS = {"fwd": 16, "bwd-weight": 64}  # C and K from which the heuristics take this form (forms' docs)
MIN_CHANNELS_F64 = 16  # float64 (no tensor cores for im2col's GEMM either): every direction from here


def pays(geo: ConvGeometry, dtype, direction: str = "fwd") -> bool:
    """The heuristics' rule where the form applies: C and K at least MIN_CHANNELS[direction] (fewer input
    channels leave the a^2 GEMMs too thin for the transforms' passes; the float32 weight gradient's GEMMs, k =
    tiles, m and n = K and C, need more of both), MIN_CHANNELS_F64 for float64."""
    least = MIN_CHANNELS_F64 if np.dtype(dtype) == np.float64 else MIN_CHANNELS[direction]
    return min(geo.c, geo.k) >= least


def tile(m: int | None = None) -> int:
    """``m``, else ``conv_direct.WINOGRAD_TILE``: one of MATRICES'."""
    m = m or conv_direct.WINOGRAD_TILE
    if m not in MATRICES:
        raise ValueError(f"conv_direct.WINOGRAD_TILE (m): got {m}; allowed: {', '.join(map(str, MATRICES))}")
    return m


def tiles(geo: ConvGeometry, m: int | None = None) -> tuple[int, int]:
    """The m x m output tiles of an image, per dim (m: :func:`tile`)."""
    m = tile(m)
    return tuple(-(-o // m) for o in geo.out_size)


def scratch_per_image(geo: ConvGeometry, m: int | None = None) -> int:
    """v's and m's elements per image: a^2 values a tile for each input and each output channel."""
    a = tile(m) + 2
    return a * a * (geo.c + geo.k) * prod(tiles(geo, m))


def plan(geo: ConvGeometry, dtype, budget: int, beta: float = 0.0, m: int | None = None) -> tuple[list, dict]:
    """(steps, scratch buffer name -> elements) with v and m of at most ``budget`` bytes (one image at least):
    the filter transform, then per chunk of images the input transform, the a^2 GEMMs, the output transform.
    The output transform writes y: ``beta`` (a sum into y) must be 0 (direct_cuda.forward_plan takes im2col)."""
    if beta:
        raise ValueError(f"winograd.plan: beta must be 0 (the output transform writes y), got {beta}")
    m = tile(m)
    parts = conv_direct.chunks(geo.n, scratch_per_image(geo, m) * np.dtype(dtype).itemsize, budget)
    t, K, C, aa = prod(tiles(geo, m)), geo.k, geo.c, (m + 2) ** 2
    steps: list = [Wino("filter", m=m)]
    for n0, nb in parts:
        pc = nb * t  # M[xi] (K x Pc, ld K) = U[xi] (K x C, ld K) V[xi] (C x Pc, ld C), xi < a^2
        steps += [Wino("input", n0, nb, m),
                  Gemm(("u", 0), ("v", 0), ("m", 0), OP_N, OP_N, K, pc, C, K, C, K, K * C, C * pc, K * pc, aa, 0.0),
                  Wino("output", n0, nb, m)]
    nb = max(nb for _, nb in parts)
    return steps, {"u": aa * K * C, "v": aa * C * nb * t, "m": aa * K * nb * t}


def weight_plan(geo: ConvGeometry, dtype, budget: int, m: int | None = None) -> tuple[list, dict]:
    """The weight gradient's (steps, scratch): per chunk of images the input and gradient transforms and the
    a^2 GEMMs summing into u (beta 1 after the first chunk), then the weight transform into ``dw``."""
    m = tile(m)
    parts = conv_direct.chunks(geo.n, scratch_per_image(geo, m) * np.dtype(dtype).itemsize, budget)
    t, K, C, aa = prod(tiles(geo, m)), geo.k, geo.c, (m + 2) ** 2
    steps: list = []
    for i, (n0, nb) in enumerate(parts):
        pc = nb * t  # M[xi] (K x C, ld K) (+)= E[xi] (K x Pc, ld K) V[xi]^T (V: C x Pc, ld C)
        steps += [Wino("input", n0, nb, m), Wino("dy", n0, nb, m),
                  Gemm(("e", 0), ("v", 0), ("u", 0), OP_N, OP_T, K, C, pc, K, C, K, K * pc, C * pc, K * C, aa,
                       0.0 if i == 0 else 1.0)]
    nb = max(nb for _, nb in parts)
    return steps + [Wino("weight", m=m)], {"u": aa * K * C, "v": aa * C * nb * t, "e": aa * K * nb * t}


ARG_NAMES = {"filter": ("K", "C", "cl"),
             "input": ("C", "H", "W", "TH", "TW", "PC", "P0", "P1", "n0", "sn", "sc", "sh", "sw"),
             "output": ("K", "OH", "OW", "TH", "TW", "PC", "n0", "sn", "sc", "sh", "sw")}
DIVISORS = {"filter": ("K",), "input": ("C", "TW", "TH"), "output": ("K", "TW", "TH")}
ARG_NAMES["dy"], ARG_NAMES["weight"] = ARG_NAMES["output"], ARG_NAMES["filter"]  # dY read as y is written
DIVISORS["dy"], DIVISORS["weight"] = DIVISORS["output"], DIVISORS["filter"]


def _strides(n_channels: int, size: tuple, cl: bool) -> tuple[int, int, int, int]:
    """(image, channel, row, column) element strides of a compact (N, channels, H, W) array in its layout."""
    h, w = size
    return (n_channels * h * w, 1, w * n_channels, n_channels) if cl else (n_channels * h * w, h * w, w, 1)


def kernel_args(geo: ConvGeometry, cl: bool, s: Wino) -> tuple[int, ...]:
    """The kernel's integer arguments (ARG_NAMES[s.kind]) for step ``s``."""
    th, tw = tiles(geo, s.m)
    if s.kind in ("filter", "weight"):
        return geo.k, geo.c, int(cl)
    if s.kind == "input":
        return (geo.c, *geo.in_size, th, tw, s.nb * th * tw, *geo.pad_lo, s.n0,
                *_strides(geo.c, geo.in_size, cl))
    return (geo.k, *geo.out_size, th, tw, s.nb * th * tw, s.n0, *_strides(geo.k, geo.out_size, cl))


def threads(geo: ConvGeometry, s: Wino) -> int:
    """One a (output, input) channel pair (filter, weight), an (input channel, tile) or an (output channel,
    tile)."""
    pc = s.nb * prod(tiles(geo, s.m))
    return {"filter": geo.k * geo.c, "input": geo.c * pc, "output": geo.k * pc, "dy": geo.k * pc,
            "weight": geo.k * geo.c}[s.kind]


def index_type(geo: ConvGeometry, s: Wino) -> str:
    """"int32" where every index of the launch fits (x's, y's, the scratch's), else "int64"."""
    aa, pc = (s.m + 2) ** 2, s.nb * prod(tiles(geo, s.m))
    largest = max(geo.n * geo.c * prod(geo.in_size), geo.n * geo.k * geo.p, aa * geo.c * max(pc, geo.k),
                  aa * geo.k * pc)
    return "int32" if largest < 2**31 else "int64"


def _sum(coeffs, terms) -> str:
    """C for sum(c * t) over the nonzero coefficients (+- 1 without a product); "(A)0" where all are zero."""
    out = ""
    for c, t in zip(coeffs, terms):
        if c == 0:
            continue
        sign = "-" if c < 0 else "+" if out else ""
        out += f" {sign} {t}" if abs(c) == 1 else f" {sign} {t} * (A){float(abs(c))!r}"
    return out.strip() or "(A)0"


def _sandwich(left, names: list) -> tuple[str, list]:
    """(C declaring z = L S, the expressions of z L^T) for the matrix ``left`` L (r x n) and S (n x n) named
    ``names`` (row-major): every transform is one (U = G g G^T, V = B^T d B, y = A^T q A)."""
    n = len(left[0])
    z = [_sum(row, [names[r * n + j] for r in range(n)]) for row in left for j in range(n)]
    out = [_sum(left[j], [f"z{i * n + r}" for r in range(n)]) for i in range(len(left)) for j in range(len(left))]
    return "".join(f"A z{e} = {x};\n" for e, x in enumerate(z)), out


def _body(kind: str, m: int) -> str:
    """The transform ``kind`` of F(m x m, 3x3) for one thread; Q(a, D) is a / D (gather_kernel.grid_kernel)."""
    bt, g, at = MATRICES[m]
    a = m + 2
    pair = "UI c = Q(i, K), k = (UI)i - c * (UI)K;\n"  # (output, input) channel pair, and its tap rs in w / dw
    tap = "(I)(k * 9 * (UI)C + (cl ? (UI){rs} * (UI)C + c : c * 9 + (UI){rs}))"
    if kind == "filter":
        load = f"{pair}A g[9];\nfor (int r = 0; r < 9; ++r) g[r] = (A)w[{tap.format(rs='r')}];\n"
        z, out = _sandwich(g, [f"g[{e}]" for e in range(9)])
        return load + z + "".join(f"u[(I)(((UI){e} * (UI)C + c) * (UI)K + k)] = (T)({x});\n" for e, x in enumerate(out))
    if kind == "weight":  # dW's 3x3 = G^T M G
        load = (f"{pair}A q[{a * a}];\nfor (int e = 0; e < {a * a}; ++e) "
                "q[e] = (A)u[(I)(((UI)e * (UI)C + c) * (UI)K + k)];\n")
        z, out = _sandwich([list(col) for col in zip(*g)], [f"q[{e}]" for e in range(a * a)])
        return load + z + "".join(f"dw[{tap.format(rs=e)}] = (T)({x});\n" for e, x in enumerate(out))
    decode = "t0 = Q(p, TW), tw = p - t0 * (UI)TW, j = Q(t0, TH), th = t0 - j * (UI)TH;\n"
    per_k = (f"UI p = Q(i, K), k = (UI)i - p * (UI)K, {decode}I h0 = {m} * (I)th, w0 = {m} * (I)tw;\n"
             "const I at = ((I)n0 + (I)j) * sn + (I)k * sc;\n")  # (output channel, tile): its image and channel
    if kind == "dy":  # E = A e A^T, e dY's m x m tile (zero past its end)
        load = (f"{per_k}const T* dn = dy + at;\nA q[{m * m}];\n"
                f"for (int r = 0; r < {m}; ++r)\n  for (int s = 0; s < {m}; ++s)\n"
                f"    q[{m} * r + s] = (h0 + r < OH && w0 + s < OW) ? (A)dn[(h0 + r) * sh + (w0 + s) * sw] : (A)0;\n")
        z, out = _sandwich([list(col) for col in zip(*at)], [f"q[{e}]" for e in range(m * m)])
        return load + z + "".join(f"e[(I)(((UI){e} * (UI)PC + p) * (UI)K + k)] = (T)({x});\n"
                                  for e, x in enumerate(out))
    if kind == "input":
        load = (f"UI p = Q(i, C), c = (UI)i - p * (UI)C, {decode}"
                f"I h0 = {m} * (I)th - P0, w0 = {m} * (I)tw - P1;\nA d[{a * a}];\n"
                f"for (int r = 0; r < {a}; ++r)\n  for (int s = 0; s < {a}; ++s) {{\n"
                "    I h = h0 + r, x1 = w0 + s;\n"
                f"    d[{a} * r + s] = (h >= 0 && h < H && x1 >= 0 && x1 < W) ?\n"
                "        (A)x[((I)n0 + (I)j) * sn + (I)c * sc + h * sh + x1 * sw] : (A)0;\n  }\n")
        z, out = _sandwich(bt, [f"d[{e}]" for e in range(a * a)])
        return load + z + "".join(f"v[(I)(((UI){e} * (UI)PC + p) * (UI)C + c)] = (T)({x});\n"
                                  for e, x in enumerate(out))
    load = (f"{per_k}T* yn = y + at;\nA q[{a * a}];\n"
            f"for (int e = 0; e < {a * a}; ++e) q[e] = (A)m[(I)(((UI)e * (UI)PC + p) * (UI)K + k)];\n")
    z, out = _sandwich(at, [f"q[{e}]" for e in range(a * a)])  # y's tile, where it lies in y
    return load + z + "".join(f"if (h0 + {e // m} < OH && w0 + {e % m} < OW) "
                              f"yn[(h0 + {e // m}) * sh + (w0 + {e % m}) * sw] = (T)({x});\n"
                              for e, x in enumerate(out))


_POINTERS = {"filter": ("w", "u"), "input": ("x", "v"), "output": ("m", "y"), "dy": ("dy", "e"),
             "weight": ("u", "dw")}  # (read, written)


def source(kind: str, dtype, index: str, m: int | None = None) -> tuple[str, str]:
    """(code, name) of the ``kind`` transform of F(m x m, 3x3) for ``dtype`` (TYPES) and ``index`` ("int32" or
    "int64"): ``(read, written, ARG_NAMES[kind] of the index type, the divisors' multipliers and shifts,
    total)``."""
    m = tile(m)
    name = np.dtype(dtype).name
    ctype, acc = TYPES[name]
    src, dst = _POINTERS[kind]
    kname = f"blasx_winograd{m}_{kind}_{name}_{index}"
    code = gather_kernel.grid_kernel(kname, f"const {ctype}* __restrict__ {src}, {ctype}* __restrict__ {dst}",
                                     ARG_NAMES[kind], DIVISORS[kind], index, f"typedef {ctype} T; typedef {acc} A;",
                                     _body(kind, m))
    return code, kname


class Launch(NamedTuple):
    """A transform's kernel arguments (ARG_NAMES[kind]), the divisors' multipliers, index type and threads: what
    direct_cuda's packed launch of a grid-stride kernel takes."""

    args: tuple
    magic: tuple
    index: str
    total: int


_KERNELS: dict = {}
_LAUNCHES: dict = {}


def launch(ops, s: Wino) -> None:
    """Step ``s`` on the current stream for ``ops`` (direct_cuda.CudaOps: its geometry, layout, type and
    buffers), through direct_cuda's packed driver launch (as col2im's), packed once per launch and device."""
    from . import direct_cuda
    args = kernel_args(ops.geo, ops.cl, s)
    g = Launch(args, gather_kernel.magic_args(args, ARG_NAMES[s.kind], DIVISORS[s.kind]), index_type(ops.geo, s),
               threads(ops.geo, s))
    key = (s.kind, ops.dtype.name, g.index, s.m)
    packed = _LAUNCHES.get((key, g, ops.device))
    if packed is None:
        k = _KERNELS.get(key)
        if k is None:
            import cupy
            k = _KERNELS[key] = cupy.RawKernel(*source(*key))
        packed = _LAUNCHES[(key, g, ops.device)] = direct_cuda._packed(k, g, 2)
    packed(ops.stream.ptr, *(ops._ptr(b) for b in _POINTERS[s.kind]))
