"""SYMM / HEMM's planner (Eq. 1b)."""

from __future__ import annotations

from ..tasks import SC_ALPHA, SC_BETA, SC_ONE, SC_ZERO, Step, Task
from ..tiling import OP_C, OP_N, OP_T, n_tiles, tile_ref
from .common import SIDE_LEFT, SYMM_A, SYMM_B, SYMM_C, _scale, _width, task_flops
from .gemm import tile_order

def plan_symm(m: int, n: int, tile: int, side: int, lower: int, *, hermitian: bool = False,
              alpha_zero: bool = False, beta_zero: bool = True, is_complex: bool = False,
              block: tuple[int, int] = (1, 1)) -> list[Task]:
    """Tasks of ``C = alpha S B + beta C`` (side 0) or ``C = alpha B S + beta C`` (side 1).

    C and B are m x n; S is the symmetric (``hermitian``: Hermitian) matrix defined by the ``lower``
    (else upper) triangle of the stored square A (m x m for side 0, n x n for side 1). Eq. 1f: C_ij
    sums S_ik B_kj over k; the diagonal S_ii is a ``symm``/``hemm`` step on A(i, i), a stored S_ik a
    gemm on A(i, k) with op N, an unstored one a gemm on the mirror A(k, i) with op T (C). Steps run
    in k order; the first takes the task's beta.
    """
    kernel = "hemm" if hermitian else "symm"
    mirror = OP_C if hermitian else OP_T
    s_dim = m if side == SIDE_LEFT else n
    tm, tn, ts = n_tiles(m, tile), n_tiles(n, tile), n_tiles(s_dim, tile)
    first = SC_ZERO if beta_zero else SC_BETA
    tasks: list[Task] = []
    for i, j in tile_order(tm, tn, block):
        c = tile_ref(SYMM_C, i, j, m, n, tile)
        if alpha_zero:
            steps = (_scale(c, first),)
        else:
            steps = []
            left = side == SIDE_LEFT
            for k in range(ts):
                beta_ix = first if k == 0 else SC_ONE
                kw = _width(k, s_dim, tile)
                b = tile_ref(SYMM_B, k, j, m, n, tile) if left else tile_ref(SYMM_B, i, k, m, n, tile)
                r, q = (i, k) if left else (k, j)  # S_ik B_kj (left) or B_ik S_kj (right)
                if r == q:
                    steps.append(Step(kernel, tile_ref(SYMM_A, r, r, s_dim, s_dim, tile), b, OP_N, OP_N,
                                      c.rows, c.cols, kw, SC_ALPHA, beta_ix, side, lower))
                    continue
                stored = (r > q) == bool(lower)
                a = tile_ref(SYMM_A, r, q, s_dim, s_dim, tile) if stored else tile_ref(SYMM_A, q, r, s_dim, s_dim, tile)
                op = OP_N if stored else mirror
                steps.append(Step("gemm", a, b, op, OP_N, c.rows, c.cols, kw, SC_ALPHA, beta_ix) if left
                             else Step("gemm", b, a, OP_N, op, c.rows, c.cols, kw, SC_ALPHA, beta_ix))
            steps = tuple(steps)
        tasks.append(Task(len(tasks), c, not beta_zero, steps, task_flops(steps, is_complex),
                          rotatable=len(steps) > 1))
    return tasks
