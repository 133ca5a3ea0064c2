"""A batched tiled transpose on the device: the copy between a compact NCHW array and its channels-last twin
(per image, the C x P matrix to P x C, or back), where the device route convolves NCHW operands in
channels-last (conv_direct.device_layout). CuPy's copy of a transposed view indexes every element through
its strides and runs far below the memory's speed; a block here moves a 32 x 32 tile through shared memory,
so both its reads and its writes are coalesced. The vector kernel (2- and 4-byte elements, both dimensions whole
16-byte vectors, both arrays on 16-byte boundaries) moves a tile of 8 vectors a side in 16-byte units through a
swizzled tile (no bank conflicts either way); else the paired kernel (2-byte elements, both dimensions even)
moves a 64 x 64 tile in 4-byte units, two elements a thread on each side. Each is taken where its switch
(``VECTOR``, ``PAIRED``) is on.
"""

from __future__ import annotations

from math import prod

import numpy as np

TILE = 32  # a tile's side; a block is TILE x ROWS threads, each moving TILE / ROWS elements
ROWS = 8
MAX_BATCH_BLOCKS = 65535  # grid y: images; more loop

_CTYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}

# The frame both kernels share: SIDE x SIDE tiles of each of ``batch`` matrices, DECL the shared tile, BODY the
# moves of one tile (src's rows ``s`` into the tile, then dst's ``d`` out of it).
_FRAME = """
extern "C" __global__ void NAME(const U* __restrict__ src, U* __restrict__ dst, long long batch, int rows, int cols)
{
  DECL
  const int tiles_c = (cols + SIDE - 1) / SIDE;
  const int r0 = (blockIdx.x / tiles_c) * SIDE, c0 = (blockIdx.x % tiles_c) * SIDE;
  const long long size = (long long)rows * cols;
  for (long long n = blockIdx.y; n < batch; n += gridDim.y) {
    const U* s = src + n * size;
    U* d = dst + n * size;
BODY    __syncthreads();
  }
}
"""

_CODE = _FRAME.replace("DECL", "__shared__ U tile[TILE][TILE + 1];").replace("SIDE", "TILE").replace("BODY", """\
    for (int j = threadIdx.y; j < TILE; j += ROWS) {
      int r = r0 + j, c = c0 + threadIdx.x;
      if (r < rows && c < cols) tile[j][threadIdx.x] = s[(long long)r * cols + c];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < TILE; j += ROWS) {
      int c = c0 + j, r = r0 + threadIdx.x;
      if (r < rows && c < cols) d[(long long)c * rows + r] = tile[threadIdx.x][j];
    }
""")


def source(itemsize: int) -> tuple[str, str]:
    """(code, name) of the transpose of ``itemsize``-byte elements: ``(src, dst, batch, rows, cols)`` makes
    each of ``batch`` row-major ``rows x cols`` matrices of src into the ``cols x rows`` matrix in dst."""
    name = f"blasx_transpose_u{8 * itemsize}"
    head = f"typedef {_CTYPES[itemsize]} U; const int TILE = {TILE}; const int ROWS = {ROWS};"
    return head + _CODE.replace("NAME", name), name


def grid(batch: int, rows: int, cols: int) -> tuple:
    """The launch's grid: x over the tiles of one matrix, y over the images (at most MAX_BATCH_BLOCKS)."""
    tiles = -(-rows // TILE) * -(-cols // TILE)
    return (max(1, tiles), max(1, min(batch, MAX_BATCH_BLOCKS)), 1)


def matrices(shape: tuple, to_channels_last: bool) -> tuple[int, int, int]:
    """(batch, rows, cols) of the transpose between an NC(spatial)-shaped array's NCHW memory and its
    channels-last memory: per image C x P to P x C (``to_channels_last``), or back."""
    n, c, p = shape[0], shape[1], prod(shape[2:])
    return (n, c, p) if to_channels_last else (n, p, c)


PAIRED = True  # 2-byte elements through the paired kernel where both dimensions are even

_PAIRED_CODE = """
extern "C" __global__ void blasx_transpose_pair16(const unsigned int* __restrict__ src, unsigned int* __restrict__ dst,
                                                  long long batch, int rows, int cols)
{
  __shared__ unsigned short tile[64][66];
  const int tiles_c = (cols + 63) / 64;
  const int r0 = (blockIdx.x / tiles_c) * 64, c0 = (blockIdx.x % tiles_c) * 64;
  const long long half = (long long)rows * cols / 2;  // a matrix's 4-byte units
  for (long long n = blockIdx.y; n < batch; n += gridDim.y) {
    const unsigned int* s = src + n * half;
    unsigned int* d = dst + n * half;
    for (int j = threadIdx.y; j < 64; j += 8) {  // rows of src: two columns a thread
      int r = r0 + j, c = c0 + 2 * threadIdx.x;
      if (r < rows && c < cols) {
        unsigned int v = s[((long long)r * cols + c) / 2];
        tile[j][2 * threadIdx.x] = (unsigned short)(v & 0xffffu);
        tile[j][2 * threadIdx.x + 1] = (unsigned short)(v >> 16);
      }
    }
    __syncthreads();
    for (int j = threadIdx.y; j < 64; j += 8) {  // rows of dst (columns of src): two of src's rows a thread
      int c = c0 + j, r = r0 + 2 * threadIdx.x;
      if (r < rows && c < cols)
        d[((long long)c * rows + r) / 2] = (unsigned int)tile[2 * threadIdx.x][j] |
                                           ((unsigned int)tile[2 * threadIdx.x + 1][j] << 16);
    }
    __syncthreads();
  }
}
"""


def paired(itemsize: int, rows: int, cols: int, pointers: tuple) -> bool:
    """Whether the paired kernel moves this copy: ``PAIRED`` on, 2-byte elements, both dimensions even and
    both arrays on 4-byte boundaries."""
    return PAIRED and itemsize == 2 and rows % 2 == 0 and cols % 2 == 0 and all(p % 4 == 0 for p in pointers)


def paired_grid(batch: int, rows: int, cols: int) -> tuple:
    """The paired launch's grid: x over the 64 x 64 tiles of one matrix, y over the images."""
    tiles = -(-rows // 64) * -(-cols // 64)
    return (max(1, tiles), max(1, min(batch, MAX_BATCH_BLOCKS)), 1)


VECTOR = True  # 2- and 4-byte elements through the vector kernel where it applies (vectored)
VECTOR_THREADS = 256

# A tile is T = 8 vectors of E elements a side, stored with vector j of row r at slot j ^ ((r + r / E) & 7): a
# row's 8 vectors land in 8 slots (reads), and the 8 row groups a warp gathers one column from too (writes).
_VECTOR_CODE = _FRAME.replace("DECL", "__shared__ __align__(16) U tile[T * T];").replace("SIDE", "T").replace("BODY", """\
    for (int q = threadIdx.x; q < 8 * T; q += blockDim.x) {  // src's tile row q / 8, its vector q % 8
      int r = q >> 3, v = q & 7, gr = r0 + r, gc = c0 + v * E;
      if (gr < rows && gc < cols)
        *(uint4*)(tile + r * T + (v ^ ((r + r / E) & 7)) * E) = *(const uint4*)(s + (long long)gr * cols + gc);
    }
    __syncthreads();
    for (int q = threadIdx.x; q < 8 * T; q += blockDim.x) {  // dst's row: tile column q / 8, its vector q % 8
      int c = q >> 3, g = q & 7, gc = c0 + c, gr = r0 + g * E;
      if (gc < cols && gr < rows) {  // E elements packed into four words in registers
        unsigned int w[4];
#pragma unroll
        for (int k = 0; k < E; ++k) {
          int r = g * E + k;
          unsigned int u = tile[r * T + ((c / E) ^ ((r + r / E) & 7)) * E + c % E];
          if (E == 4) w[k] = u; else if (k % 2) w[k / 2] |= u << 16; else w[k / 2] = u;
        }
        *(uint4*)(d + (long long)gc * rows + gr) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
""")


def vectored(itemsize: int, rows: int, cols: int, pointers: tuple) -> bool:
    """Whether the vector kernel moves this copy: ``VECTOR`` on, 2- or 4-byte elements, both dimensions whole
    16-byte vectors and both arrays on 16-byte boundaries."""
    e = 16 // itemsize
    return VECTOR and itemsize in (2, 4) and rows % e == 0 and cols % e == 0 and all(p % 16 == 0 for p in pointers)


def vector_source(itemsize: int) -> tuple[str, str]:
    """(code, name) of the vector kernel for ``itemsize``-byte elements (arguments as :func:`source`'s)."""
    e = 16 // itemsize
    name = f"blasx_transpose_v{8 * itemsize}"
    head = f"typedef {_CTYPES[itemsize]} U; const int E = {e}; const int T = {8 * e};"
    return head + _VECTOR_CODE.replace("NAME", name), name


def vector_grid(batch: int, rows: int, cols: int, itemsize: int) -> tuple:
    """The vector launch's grid: x over the tiles (8 vectors a side) of one matrix, y over the images."""
    t = 8 * (16 // itemsize)
    return (max(1, -(-rows // t) * -(-cols // t)), max(1, min(batch, MAX_BATCH_BLOCKS)), 1)


_KERNELS: dict = {}


def copy(dst, src, to_channels_last: bool) -> None:
    """``dst[...] = src`` on the current stream for compact CuPy arrays of one shape and type in opposite
    layouts: src NCHW and dst channels-last (``to_channels_last``), or the other way."""
    import cupy
    itemsize = src.dtype.itemsize
    batch, rows, cols = matrices(src.shape, to_channels_last)
    if not (batch and rows and cols):
        return
    pointers = (src.data.ptr, dst.data.ptr)
    if vectored(itemsize, rows, cols, pointers):
        key, at, block = ("vector", itemsize), vector_grid(batch, rows, cols, itemsize), (VECTOR_THREADS, 1, 1)
    elif paired(itemsize, rows, cols, pointers):
        key, at, block = "pair16", paired_grid(batch, rows, cols), (TILE, ROWS, 1)
    else:
        key, at, block = itemsize, grid(batch, rows, cols), (TILE, ROWS, 1)
    k = _KERNELS.get(key)
    if k is None:
        code = (vector_source(itemsize) if key == ("vector", itemsize) else
                (_PAIRED_CODE, "blasx_transpose_pair16") if key == "pair16" else source(itemsize))
        k = _KERNELS[key] = cupy.RawKernel(*code)
    k(at, block, (src, dst, np.int64(batch), np.int32(rows), np.int32(cols)))


def to_layout(xp, x, lay: str):
    """x (N, C, spatial...) in layout ``lay`` ("nchw" C-contiguous, "cl" channels-last), copied only if it is not:
    a CuPy x compact in the other layout by :func:`copy`, anything else by the array module's copy."""
    from .geometry import is_layout
    if is_layout(x, lay):
        return x
    to_cl = lay == "cl"
    if xp is not np and x.ndim >= 3 and is_layout(x, "nchw" if to_cl else "cl"):
        moved = (x.shape[0], *x.shape[2:], x.shape[1]) if to_cl else x.shape
        out = xp.empty(moved, dtype=x.dtype)
        out = out.transpose(0, x.ndim - 1, *range(1, x.ndim - 1)) if to_cl else out
        copy(out, x, to_cl)
        return out
    if not to_cl:
        return xp.ascontiguousarray(x)
    return xp.ascontiguousarray(x.transpose(0, *range(2, x.ndim), 1)).transpose(0, x.ndim - 1, *range(1, x.ndim - 1))
