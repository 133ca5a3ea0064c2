"""GEMM's planner: one task per C tile, one k-step per tile of the inner dimension (Eq. 1a)."""

from __future__ import annotations

from ..tasks import SC_ALPHA, SC_ONE, Step, Task
from ..tiling import OP_N, n_tiles, op_tile, tile_ref
from .common import _first_beta, _scale, _width

# Operand slots of the GEMM planner.
SLOT_A, SLOT_B, SLOT_C = 0, 1, 2


def gemm_flops(m: int, n: int, k: int, is_complex: bool) -> float:
    """Floating-point operations of an m x n x k product (a complex FMA is 8 real flops)."""
    return (8.0 if is_complex else 2.0) * m * n * k


def plan_gemm(m: int, n: int, k: int, tile: int, op_a: int, op_b: int, *, alpha_zero: bool = False,
              beta_zero: bool = True, is_complex: bool = False, block: tuple[int, int] = (1, 1)) -> list[Task]:
    """Tasks of ``C = alpha op_a(A) op_b(B) + beta C`` in canonical (column-major) form.

    ``C`` is ``m x n``; ``A`` is stored ``m x k`` when ``op_a`` is N, else ``k x m``; likewise
    ``B``. With ``alpha == 0`` or ``k == 0`` only ``C = beta C`` remains (A and B not read, as in
    BLAS); with ``beta == 0`` C is never read, so NaNs in C do not leak into the result. Tasks are
    listed by ``tile_order``: ``block = (bm, bn)`` lists C tiles in blocks of bm x bn tiles, so a
    device that pulls one block shares A row panels and B column panels (bm + bn panels a round).
    """
    a_rows, a_cols = (m, k) if op_a == OP_N else (k, m)
    b_rows, b_cols = (k, n) if op_b == OP_N else (n, k)
    tm, tn, tk = n_tiles(m, tile), n_tiles(n, tile), n_tiles(k, tile)
    first = _first_beta(beta_zero)
    tasks: list[Task] = []
    for i, j in tile_order(tm, tn, block):
        c = tile_ref(SLOT_C, i, j, m, n, tile)
        if alpha_zero or k == 0:
            steps, flops = (_scale(c, first),), 0.0
        else:
            steps = tuple(Step("gemm", op_tile(SLOT_A, op_a, i, kk, a_rows, a_cols, tile),
                               op_tile(SLOT_B, op_b, kk, j, b_rows, b_cols, tile), op_a, op_b, c.rows, c.cols,
                               _width(kk, k, tile), SC_ALPHA, first if kk == 0 else SC_ONE) for kk in range(tk))
            flops = gemm_flops(c.rows, c.cols, k, is_complex)
        tasks.append(Task(len(tasks), c, not beta_zero, steps, flops, rotatable=len(steps) > 1))
    return tasks


def tile_order(tm: int, tn: int, block: tuple[int, int] = (1, 1)) -> list[tuple[int, int]]:
    """C tiles (i, j) of a tm x tn grid, in blocks of block[0] x block[1] tiles."""
    bm, bn = max(1, block[0]), max(1, block[1])
    return [(i, j)
            for i0 in range(0, tm, bm) for j0 in range(0, tn, bn)
            for i in range(i0, min(i0 + bm, tm)) for j in range(j0, min(j0 + bn, tn))]
