"""Virtual tiling of column-major matrices (the paper's Section III-A): pure integer arithmetic.

A stored ``rows x cols`` matrix is cut into ``T x T`` tiles, edge tiles smaller. ``op(A)`` tile ``(i, k)`` is
the stored tile ``(i, k)`` for op N and ``(k, i)`` for T or C: the kernel transposes it (Section III-C).
"""

from __future__ import annotations

from typing import NamedTuple

# op codes, as in BLAS and scipy.linalg.blas: 0 = N, 1 = T, 2 = C (conjugate transpose)
OP_N, OP_T, OP_C = 0, 1, 2


class TileRef(NamedTuple):
    """One tile of a stored operand: which operand, which tile, which elements."""

    slot: int  # index of the operand in the call (planner convention: 0 A, 1 B, 2 C)
    bi: int  # tile row index in the stored matrix
    bj: int  # tile column index in the stored matrix
    r0: int  # first row (elements)
    c0: int  # first column (elements)
    rows: int
    cols: int


def n_tiles(extent: int, tile: int) -> int:
    """Number of tiles along one dimension: ceil(extent / tile)."""
    return -(-extent // tile)


def tile_span(index: int, extent: int, tile: int) -> tuple[int, int]:
    """(start, length) of tile ``index`` along a dimension of ``extent`` elements."""
    start = index * tile
    return start, min(tile, extent - start)


def tile_ref(slot: int, bi: int, bj: int, rows: int, cols: int, tile: int) -> TileRef:
    """The TileRef of stored tile (bi, bj) of a ``rows x cols`` operand."""
    r0, nr = tile_span(bi, rows, tile)
    c0, nc = tile_span(bj, cols, tile)
    return TileRef(slot, bi, bj, r0, c0, nr, nc)


def op_tile(slot: int, op: int, i: int, k: int, stored_rows: int, stored_cols: int, tile: int) -> TileRef:
    """Stored tile holding tile (i, k) of op(X), where X is stored_rows x stored_cols."""
    bi, bj = (i, k) if op == OP_N else (k, i)
    return tile_ref(slot, bi, bj, stored_rows, stored_cols, tile)


def effective_lower(lower: int, op: int) -> bool:
    """True if op(A) is lower triangular (A's stored triangle, transposed by T / C)."""
    return bool(lower) != (op != OP_N)
