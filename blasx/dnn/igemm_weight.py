"""The implicit-GEMM form of the device route's weight gradient: one kernel computes
``dW[K, T*R*S*C] = dY[N*O*P*Q, K]^T im2col(X)[N*O*P*Q, T*R*S*C]`` on Hopper's warpgroup tensor-core
instructions (wgmma, sm_90a), gathering each im2col tile from channels-last X straight into shared memory, so
no col buffer is written or read (the im2col form's round trip of col through memory bounds it on 3x3s).

The kernel (igemm_weight_kernel.cu): a block computes a (64 WGM) x BN tile of dW with WGM warpgroups (64 rows
each), reducing over k-tiles of 64 output pixels. A k-tile's operands are pixel rows of 64 channels (128 bytes:
dY's K channels, X's C channels at a kernel tap) in 64 x 64 chunks, each in the 128-byte swizzle; both operands
are MN-major (channels contiguous), which wgmma transposes for 2-byte types only, so float16 and bfloat16 run
here and TF32 keeps the GEMM. cp.async fills a ``stages``-deep ring; ``PIPE`` wgmma groups stay in flight. A
split (``Config.split`` > 1) covers a run of pixel k-tiles and writes float32 partials that a second kernel sums
in split order (deterministic) into dW; without one the block rounds its sums into dW.

``config`` (pure) picks the tile and split; ``plan_launch`` (pure) the grid and arguments.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import gather_kernel, igemm
from .geometry import ConvGeometry

CHANNELS = 64  # a chunk's channels (128 bytes of a 2-byte type), and pixels a k-tile
CHUNK_BYTES = CHANNELS * 128
TYPES = ("float16", "bfloat16")
PIPE = 1
SMEM_MAX = 227 * 1024  # dynamic shared memory a block may take (sm_90)
MIN_KTILES = 8  # pixel k-tiles a split covers at least


class Config(NamedTuple):
    wgm: int  # warpgroups along dW's rows (64 rows each): 1 or 2
    bn: int  # dW columns a block computes: a multiple of 64 up to 256
    stages: int  # shared-memory ring depth
    split: int  # pixel splits (1: dW written directly)


def type_name(dtype) -> str | None:
    """The kernel's type for operands of ``dtype``, or None."""
    name = np.dtype(dtype).name
    return name if name in TYPES else None


def applies(geo: ConvGeometry, dtype, cl: bool) -> bool:
    """Whether the kernel runs ``geo``'s weight gradient: channels-last 2-byte operands, one group, no zero
    insertion, C and K whole chunks, fewer than 2^31 output pixels."""
    return (cl and type_name(dtype) is not None and geo.groups == 1 and all(z == 1 for z in geo.insert)
            and geo.c % CHANNELS == 0 and geo.k % CHANNELS == 0 and geo.n * geo.p < 2 ** 31)


def smem_bytes(wgm: int, bn: int, stages: int) -> int:
    """The main kernel's dynamic shared memory: the stages, and room to align them to 1024 bytes."""
    return stages * (wgm + bn // CHANNELS) * CHUNK_BYTES + 1024


def k_tiles(geo: ConvGeometry) -> int:
    """The reduction's k-tiles: output pixels of the batch, 64 a tile."""
    return -(-geo.n * geo.p // CHANNELS)


def config(geo: ConvGeometry, sms: int) -> Config:
    """The tile and split for ``geo`` on a GPU of ``sms`` multiprocessors (one block each, the tiles'
    registers and shared memory allow no more): two warpgroups (128 rows) where K allows, with 192 columns (one
    warpgroup: 256, the tuned widths); then as many pixel splits as fill one wave of blocks, each at least
    MIN_KTILES k-tiles."""
    wgm = 2 if geo.k % 128 == 0 else 1
    bn = 192 if wgm == 2 else 256
    tiles = -(-geo.crs // bn) * (geo.k // (64 * wgm))
    split = max(1, min(sms // tiles, k_tiles(geo) // MIN_KTILES))
    return Config(wgm, bn, 4, split)


class Launch(NamedTuple):
    """One call's launches: the main kernel's grid, block, shared memory and integer arguments (the k-tiles a
    split covers and the divisions' multipliers last), the partials' float32 elements (0: none), and the
    reduce kernel's grid and arguments."""

    type: str
    config: Config
    grid: tuple
    threads: int
    smem: int
    ints: tuple
    part: int
    reduce_grid: tuple
    reduce_ints: tuple


def plan_launch(geo: ConvGeometry, type_: str, cfg: Config) -> Launch:
    """The launches for ``geo`` in kernel type ``type_`` with ``cfg`` (pure)."""
    kts = k_tiles(geo)
    per = -(-kts // cfg.split)
    split = -(-kts // per)
    d, h, w = igemm._dims3(geo.in_size, 1)
    t, r, s = igemm._dims3(geo.kernel, 1)
    o, p, q = igemm._dims3(geo.out_size, 1)
    (mq, sq), (mp, sp), (mo, so) = (gather_kernel.fast_divisor(v) for v in (q, p, o))
    ints = (geo.n, d, h, w, geo.c, geo.k, t, r, s, o, p, q, *igemm._dims3(geo.stride, 1),
            *igemm._dims3(geo.pad_lo, 0), *igemm._dims3(geo.dilation, 1), per, mq, sq, mp, sp, mo, so)
    mk = geo.k * geo.crs
    return Launch(type_, cfg._replace(split=split), (-(-geo.crs // cfg.bn), geo.k // (64 * cfg.wgm), split),
                  128 * cfg.wgm, smem_bytes(cfg.wgm, cfg.bn, cfg.stages), ints, split * mk if split > 1 else 0,
                  (-(-mk // 4 // 256),), (mk, split))


def kernel_source(type_: str, cfg: Config) -> str:
    """The CUDA source of the main and reduce kernels for ``type_`` and ``cfg``'s tile."""
    defines = {"WGM": cfg.wgm, "BN": cfg.bn, "STAGES": cfg.stages, "PIPE": PIPE, "ELEM_BYTES": 2,
               "OUT_BF16": int(type_ == "bfloat16")}
    wgmma = igemm.wgmma_source(cfg.bn, igemm.TYPES[type_], transpose=True)
    return igemm.source(defines, gather_kernel.HELPERS + wgmma, "igemm_weight_kernel.cu", cfg.bn)


def kernels(type_: str, cfg: Config):
    """(main, reduce) CuPy functions for ``type_`` and ``cfg``'s tile."""
    return igemm.compiled(("wgrad", type_, cfg.wgm, cfg.bn, cfg.stages), lambda: kernel_source(type_, cfg),
                          "blasx_igemm_wgrad")


class Launcher(igemm.Pair):
    """``launch``'s kernels on the current device, ready: ``(x, dy, dw, part)`` pointers in."""

    def __init__(self, launch: Launch) -> None:
        import ctypes
        n_signed = 22  # the geometry and k-tiles a split; then (multiplier unsigned, shift) pairs (fast_divisor)
        tail = tuple(ctypes.c_int32(int(v)) if i < n_signed or i % 2 else ctypes.c_uint32(int(v))
                     for i, v in enumerate(launch.ints))
        super().__init__(*kernels(launch.type, launch.config), launch, launch.threads, tail)


def run(launch: Launch, x, dy, dw, part) -> None:
    """The launches on the current device and stream: x, dy, dw CuPy arrays (compact, 16-byte aligned; dw
    ``(K, T*R*S*C)`` in x's type), ``part`` float32 scratch of ``launch.part`` elements (None: no split)."""
    import cupy
    igemm.launcher(launch, Launcher)(cupy.cuda.get_current_stream().ptr, x.data.ptr, dy.data.ptr, dw.data.ptr,
                                     0 if part is None else part.data.ptr)
