"""GEMM on operands given as grids of pieces (separate arrays), in one engine call with no joined copy.

blasx.dask's GPU tasks hold an output block's row panel of A and column panel of B as dask blocks; joining
them into two matrices first would copy both panels and hold the copies while the call runs. Here each
piece is an operand of the call and each tile is read from the piece holding it (``runtime/plans/pieces.py``),
the tile chosen to divide the pieces' bounds.
"""

from __future__ import annotations

import itertools

import numpy as np

from .dispatch import gemm_split, submit_planned
from .operands import canonical, column_major_view, is_cupy
from .runtime import dtypes
from .runtime.plans import partial_shape, plan_gemm
from .runtime.plans.pieces import common_divisor, on_pieces, pieces_tile
from .runtime.tiling import OP_N

#: The least common divisor of the pieces' interior bounds taken in place (a smaller one would force
#: tiles too small to run at speed): :func:`gemm_pieces` declines below it.
LEAST_TILE = 512


class _Untiled(Exception):
    """The engine's tile for the call is over twice the largest that divides the pieces' bounds."""


def _bounds(sizes) -> tuple[int, ...]:
    return tuple(itertools.accumulate(sizes, initial=0))


def _layouts(p) -> dict:
    """The column-major views of piece ``p``: {transposed: (V, transposed)} (a row or a column has both)."""
    out = {}
    for x, flip in ((p, False), (p.T, True)):
        cm = column_major_view(x)
        if cm is not None:
            out[cm[1] != flip] = (cm[0], cm[1] != flip)
    return out


def _stored(grid, op_flag: int):
    """(canonical views in the stored operand's grid, row-major; its op; its row and column bounds) of
    the grid ``grid[r][c]`` of stored pieces whose op_flag(piece) is the logical operand's piece (r, c);
    None where the pieces have no layout in common (or one has none: arbitrary strides)."""
    layouts = [[_layouts(p) for p in row] for row in grid]
    common = set.intersection(*(set(x) for row in layouts for x in row))
    if not common:
        return None
    t = min(common)  # (False first: both layouts of every piece only where all are rows or columns)
    views = [[canonical(p, op_flag, False, cm=x[t]) for p, x in zip(prow, lrow)] for prow, lrow in zip(grid, layouts)]
    ops = {op for row in views for _, op in row}
    if len(ops) != 1:  # (one layout t gives every piece the same op: a guard)
        return None
    (op,) = ops
    rows = _bounds(v.shape[0] if op == OP_N else v.shape[1] for v, _ in (row[0] for row in views))
    cols = _bounds(v.shape[1] if op == OP_N else v.shape[0] for v, _ in views[0])
    if op != OP_N:  # the stored operand is the logical one transposed: so is its grid
        views = [list(col) for col in zip(*views)]
        rows, cols = cols, rows
    return [v for row in views for v, _ in row], op, (rows, cols)


def _extents(bounds, op: int) -> tuple[int, int]:
    """(rows, columns) of the logical operand op(stored) from the stored operand's bounds."""
    rows, cols = bounds[0][-1], bounds[1][-1]
    return (rows, cols) if op == OP_N else (cols, rows)


def gemm_pieces(alpha, a_grid, trans_a: int, b_grid, trans_b: int, beta, c, *, least: int | None = None) -> bool:
    """c = alpha op(A) op(B) + beta c, where op(A)'s piece (i, k) is ``op(a_grid[i][k])`` and op(B)'s
    piece (k, j) is ``op(b_grid[k][j])`` (op: ``trans_a`` / ``trans_b`` as BLAS, the pieces' shapes
    lining up), in one engine call that reads each tile from its piece. ``c``: F-contiguous, aliasing
    no piece; every piece and c of one BLAS type and one array kind. Returns False, having done
    nothing, where the pieces cannot be read in place: their canonical forms differ in op, c is not
    F-contiguous, or the pieces' interior bounds have no common divisor of at least ``least`` (LEAST_TILE)
    and at least half the tile the engine chooses for the call (smaller tiles run slower than a join)."""
    pieces = [p for row in a_grid for p in row] + [p for row in b_grid for p in row]
    dtype = np.dtype(c.dtype)
    if dtype not in dtypes.BY_DTYPE or any(p.dtype != dtype or is_cupy(p) != is_cupy(c) for p in pieces):
        return False
    cm = column_major_view(c)
    if cm is None or cm[1]:
        return False
    a, b = _stored(a_grid, trans_a), _stored(b_grid, trans_b)
    if a is None or b is None:
        return False
    (a_views, opa, a_bounds), (b_views, opb, b_bounds) = a, b
    (m, ka), (kb, n) = _extents(a_bounds, opa), _extents(b_bounds, opb)
    if (m, n) != c.shape or ka != kb:
        raise ValueError(f"gemm_pieces: op(A) {m}x{ka} and op(B) {kb}x{n} pieces do not make c's {c.shape}")
    k = ka
    every = (*a_bounds, *b_bounds)
    g = common_divisor(every)
    if 0 < g < (LEAST_TILE if least is None else least):
        return False
    if m == 0 or n == 0:
        return True
    product = alpha != 0 and k != 0
    split = [1]

    def partials(eng, tile):  # split-k's scratch, as dispatch.gemm makes it
        split[0] = gemm_split(eng, m, n, k, tile, dtype) if product else 1
        return partial_shape(m, n, split[0]) if split[0] > 1 else None

    def plan(tile, block, scratch=False):
        return on_pieces(plan_gemm(m, n, k, tile, opa, opb, alpha_zero=(alpha == 0), beta_zero=(beta == 0),
                                   is_complex=dtype.kind == "c", block=block, split=split[0] if scratch else 1),
                         a_bounds, b_bounds, tile)

    def fit(tile):  # the engine's tile, cut to divide the bounds; declined (before any work) if over halved
        t = pieces_tile(tile, every)
        if 2 * t < tile:
            raise _Untiled
        return t

    try:
        submit_planned("gemm", [*a_views, *b_views, c], plan, dtype, alpha, beta, (m, n, k), partials, tile_fit=fit)
    except _Untiled:
        return False
    return True
