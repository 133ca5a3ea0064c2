"""SYRK / HERK and SYR2K / HER2K's planners (Eq. 1c, 1d): the written triangle's tiles only."""

from __future__ import annotations

from ..tasks import SC_ALPHA, SC_ALPHA_CONJ, SC_BETA, SC_ONE, SC_ZERO, Step, Task
from ..tiling import OP_C, OP_N, OP_T, n_tiles, op_tile, tile_ref
from .common import SYR2K_A, SYR2K_B, SYR2K_C, SYRK_A, SYRK_C, _scale, _width, task_flops
from .gemm import tile_order

def _plan_rank_k(n: int, k: int, tile: int, op: int, lower: int, kernel: str, c_slot: int,
                 diag_slots: tuple[int, int | None], terms: tuple[tuple[int, int, int], ...], *,
                 hermitian: bool, alpha_zero: bool, beta_zero: bool, is_complex: bool,
                 block: tuple[int, int]) -> list[Task]:
    """The loop :func:`plan_syrk` and :func:`plan_syr2k` share: tasks of the ``lower`` (else upper)
    triangle of the n x n C in slot ``c_slot``, op(X) being n x k for every operand. A diagonal tile
    runs one ``kernel`` step per k tile on the tiles (i, kk) of the ``diag_slots`` (a, b) operands (b
    None: no b tile, op_b N); an off-diagonal one, per k tile, one gemm step ``alpha_s op(X)_ik
    op(Y)_jk^T`` per (X, Y, alpha_s) of ``terms``. A task's first step takes its beta. With ``alpha
    == 0`` or ``k == 0`` a diagonal tile gets one ``kernel`` step with ``k == 0`` and no tiles, the
    others a ``scale``."""
    a_slot, b_slot = diag_slots
    op_b = OP_N if b_slot is None else op
    # A gemm step's right factor op(Y)_jk^T (^H) is Y's stored tile of op(Y) tile (j, kk) too: for op
    # N, Y(j, kk) with op T (C); for op T (C), op(Y)_jk = Y(kk, j)^T (^H), so Y(kk, j) with op N.
    op2 = (OP_C if hermitian else OP_T) if op == OP_N else OP_N
    rows, cols = (n, k) if op == OP_N else (k, n)  # every operand as stored
    tn, tk = n_tiles(n, tile), n_tiles(k, tile)
    first = SC_ZERO if beta_zero else SC_BETA
    skip = alpha_zero or k == 0

    def x_tile(slot, i, kk):  # the stored tile of op(X) tile (i, kk)
        return None if slot is None else op_tile(slot, op, i, kk, rows, cols, tile)

    tasks: list[Task] = []
    for i, j in tile_order(tn, tn, block):
        if not (i >= j if lower else i <= j):
            continue  # a tile of the triangle not written
        c = tile_ref(c_slot, i, j, n, n, tile)
        diag = i == j
        if skip:
            steps = ((Step(kernel, None, None, op, op_b, c.rows, c.cols, 0, SC_ALPHA, first, 0, lower),)
                     if diag else (_scale(c, first),))
        elif diag:
            steps = tuple(
                Step(kernel, x_tile(a_slot, i, kk), x_tile(b_slot, i, kk), op, op_b,
                     c.rows, c.cols, _width(kk, k, tile), SC_ALPHA, first if kk == 0 else SC_ONE, 0, lower)
                for kk in range(tk))
        else:
            steps = tuple(
                Step("gemm", x_tile(x, i, kk), x_tile(y, j, kk), op, op2, c.rows, c.cols, _width(kk, k, tile),
                     alpha_ix, first if kk == 0 and t == 0 else SC_ONE)
                for kk in range(tk) for t, (x, y, alpha_ix) in enumerate(terms))
        # A diagonal tile's other triangle is written back as loaded: always load_c, and no
        # rotation (the late-C fold adds beta * old C over the whole tile).
        tasks.append(Task(len(tasks), c, diag or not beta_zero, steps, task_flops(steps, is_complex),
                          rotatable=(not diag) and len(steps) > 1))
    return tasks


def plan_syrk(n: int, k: int, tile: int, op: int, lower: int, *, hermitian: bool = False,
              alpha_zero: bool = False, beta_zero: bool = True, is_complex: bool = False,
              block: tuple[int, int] = (1, 1)) -> list[Task]:
    """Tasks of ``C = alpha op(A) op(A)^T + beta C`` (``hermitian``: ^H, real alpha, beta) on the
    ``lower`` (else upper) triangle of the n x n C (Eq. 1b); op(A) is n x k; diagonal tiles run
    ``syrk``/``herk`` steps (with ``k == 0`` HERK still zeroes the diagonal's imaginary part)."""
    return _plan_rank_k(n, k, tile, op, lower, "herk" if hermitian else "syrk", SYRK_C, (SYRK_A, None),
                        ((SYRK_A, SYRK_A, SC_ALPHA),), hermitian=hermitian, alpha_zero=alpha_zero,
                        beta_zero=beta_zero, is_complex=is_complex, block=block)


def plan_syr2k(n: int, k: int, tile: int, op: int, lower: int, *, hermitian: bool = False,
               alpha_zero: bool = False, beta_zero: bool = True, is_complex: bool = False,
               block: tuple[int, int] = (1, 1)) -> list[Task]:
    """Tasks of ``C = alpha op(A) op(B)^T + alpha op(B) op(A)^T + beta C`` (Eq. 1e) on the ``lower``
    (else upper) triangle; ``hermitian``: ``alpha op(A) op(B)^H + conj(alpha) op(B) op(A)^H``, beta
    real. Diagonal tiles run ``syr2k``/``her2k`` steps, the others two gemm steps per k tile."""
    alpha2 = SC_ALPHA_CONJ if hermitian else SC_ALPHA
    return _plan_rank_k(n, k, tile, op, lower, "her2k" if hermitian else "syr2k", SYR2K_C, (SYR2K_A, SYR2K_B),
                        ((SYR2K_A, SYR2K_B, SC_ALPHA), (SYR2K_B, SYR2K_A, alpha2)), hermitian=hermitian,
                        alpha_zero=alpha_zero, beta_zero=beta_zero, is_complex=is_complex, block=block)
