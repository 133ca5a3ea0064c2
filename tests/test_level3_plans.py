"""Exact-value tests of the level-3 planners (runtime/plans.py) and of the numpy tile kernels.

Hand-computed plans pin the conventions (slots, op codes of mirrored tiles,
scalar indices, load_c / c_init / keep_c / deps, flops); property tests check
every plan against invariants (triangle-only tasks, total flops, dependency
order); and a tiny sequential executor runs plans with the numpy tile kernels,
in random dependency-respecting orders and with NaN-poisoned unread data,
against scipy.linalg.blas. Nothing here starts an engine.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import scipy.linalg.blas as sblas

from blasx.runtime.devices.numpy_kernels import KERNELS
from blasx.runtime.plans import (
    SYMM_A, SYMM_B, SYMM_C, SYR2K_A, SYR2K_B, SYR2K_C, SYRK_A, SYRK_C, TRMM_A, TRMM_B, TRMM_C, TRSM_A,
    TRSM_B, TRSM_V, TRSM_X, AUTO_LEVELS_MAX_TILES, effective_lower, inverse_ref, inverse_shape, plan_symm,
    plan_syr2k, plan_syrk, plan_trmm, plan_trsm, step_flops, trmm_levels, trmm_order, trsm_levels,
)
from blasx.runtime.tasks import (
    N_SCALARS, SC_ALPHA, SC_ALPHA_CONJ, SC_BETA, SC_MINUS_ONE, SC_ONE, SC_ZERO, Step, rotated_steps,
)
from blasx.runtime.tiling import OP_C, OP_N, OP_T, TileRef, n_tiles, tile_ref

PREFIX = {np.dtype(np.float32): "s", np.dtype(np.float64): "d",
          np.dtype(np.complex64): "c", np.dtype(np.complex128): "z"}


def R(slot, bi, bj, rows, cols, T):
    return tile_ref(slot, bi, bj, rows, cols, T)


# =========================================================================== hand-computed plans

def test_plan_syrk_lower_hand_computed():
    # C 5x5 (tiles 4 + 1), op N: A stored 5x3, T = 4, beta == 0
    tasks = plan_syrk(5, 3, 4, OP_N, 1, beta_zero=True)
    assert [t.c for t in tasks] == [TileRef(SYRK_C, 0, 0, 0, 0, 4, 4), TileRef(SYRK_C, 1, 0, 4, 0, 1, 4),
                                    TileRef(SYRK_C, 1, 1, 4, 4, 1, 1)]
    t0, t1, t2 = tasks
    assert [t.tid for t in tasks] == [0, 1, 2]
    # diagonal tiles: one syrk step per k tile, C loaded (its upper triangle is written back as is)
    assert t0.steps == (Step("syrk", TileRef(SYRK_A, 0, 0, 0, 0, 4, 3), None, OP_N, OP_N, 4, 4, 3,
                             SC_ALPHA, SC_ZERO, 0, 1, 0),)
    assert t0.load_c and not t0.rotatable and t0.flops == 4 * 5 * 3
    # off-diagonal: gemm A(1, 0) A(0, 0)^T, C not read
    assert t1.steps == (Step("gemm", TileRef(SYRK_A, 1, 0, 4, 0, 1, 3), TileRef(SYRK_A, 0, 0, 0, 0, 4, 3),
                             OP_N, OP_T, 1, 4, 3, SC_ALPHA, SC_ZERO),)
    assert not t1.load_c and t1.flops == 2 * 1 * 4 * 3
    assert t2.steps == (Step("syrk", TileRef(SYRK_A, 1, 0, 4, 0, 1, 3), None, OP_N, OP_N, 1, 1, 3,
                             SC_ALPHA, SC_ZERO, 0, 1, 0),)
    assert t2.load_c and t2.flops == 1 * 2 * 3
    assert all(t.deps == () and not t.keep_c and t.c_init is None for t in tasks)
    assert sum(t.flops for t in tasks) == 5 * 6 * 3  # n (n + 1) k, the whole SYRK


def test_plan_herk_upper_conjugate_hand_computed():
    # op C: A stored k x n = 6x5, k tiles 4 + 2, upper triangle, beta != 0, complex
    tasks = plan_syrk(5, 6, 4, OP_C, 0, hermitian=True, beta_zero=False, is_complex=True)
    assert [(t.c.bi, t.c.bj) for t in tasks] == [(0, 0), (0, 1), (1, 1)]
    t0, t1, _ = tasks
    assert t0.steps == (
        Step("herk", TileRef(SYRK_A, 0, 0, 0, 0, 4, 4), None, OP_C, OP_N, 4, 4, 4, SC_ALPHA, SC_BETA, 0, 0),
        Step("herk", TileRef(SYRK_A, 1, 0, 4, 0, 2, 4), None, OP_C, OP_N, 4, 4, 2, SC_ALPHA, SC_ONE, 0, 0),
    )
    assert not t0.rotatable  # partly written: no late-C fold, no rotation
    # C_01 = sum_k A(k, 0)^H A(k, 1): the right factor is stored as is (op N)
    assert t1.steps == (
        Step("gemm", TileRef(SYRK_A, 0, 0, 0, 0, 4, 4), TileRef(SYRK_A, 0, 1, 0, 4, 4, 1),
             OP_C, OP_N, 4, 1, 4, SC_ALPHA, SC_BETA),
        Step("gemm", TileRef(SYRK_A, 1, 0, 4, 0, 2, 4), TileRef(SYRK_A, 1, 1, 4, 4, 2, 1),
             OP_C, OP_N, 4, 1, 2, SC_ALPHA, SC_ONE),
    )
    assert t1.load_c and t1.rotatable
    assert t1.flops == 4 * 2 * 4 * 1 * 6  # complex: 4x the real 2 m n k
    assert sum(t.flops for t in tasks) == 4 * 5 * 6 * 6


def test_plan_her2k_off_diagonal_uses_conj_alpha():
    tasks = plan_syr2k(6, 3, 4, OP_N, 1, hermitian=True, beta_zero=False, is_complex=True)
    assert [(t.c.bi, t.c.bj) for t in tasks] == [(0, 0), (1, 0), (1, 1)]
    d, off, _ = tasks
    assert d.c == TileRef(SYR2K_C, 0, 0, 0, 0, 4, 4) and off.c == TileRef(SYR2K_C, 1, 0, 4, 0, 2, 4)
    assert d.steps == (Step("her2k", TileRef(SYR2K_A, 0, 0, 0, 0, 4, 3), TileRef(SYR2K_B, 0, 0, 0, 0, 4, 3),
                            OP_N, OP_N, 4, 4, 3, SC_ALPHA, SC_BETA, 0, 1),)
    # C_10 = alpha A_1 B_0^H + conj(alpha) B_1 A_0^H + beta C_10
    assert off.steps == (
        Step("gemm", TileRef(SYR2K_A, 1, 0, 4, 0, 2, 3), TileRef(SYR2K_B, 0, 0, 0, 0, 4, 3),
             OP_N, OP_C, 2, 4, 3, SC_ALPHA, SC_BETA),
        Step("gemm", TileRef(SYR2K_B, 1, 0, 4, 0, 2, 3), TileRef(SYR2K_A, 0, 0, 0, 0, 4, 3),
             OP_N, OP_C, 2, 4, 3, SC_ALPHA_CONJ, SC_ONE),
    )
    assert off.rotatable and d.load_c and not d.rotatable
    assert sum(t.flops for t in tasks) == 4 * 2 * 6 * 7 * 3  # 2 n (n + 1) k, complex
    # syr2k: both products with alpha, transposes with T
    s = plan_syr2k(6, 3, 4, OP_N, 1)[1]
    assert [(st.op_b, st.alpha) for st in s.steps] == [(OP_T, SC_ALPHA), (OP_T, SC_ALPHA)]


def test_plan_symm_left_lower_hand_computed():
    # C, B 5x3; S 5x5 from A's lower triangle; T = 4
    tasks = plan_symm(5, 3, 4, 0, 1, beta_zero=True)
    assert [t.c for t in tasks] == [TileRef(SYMM_C, 0, 0, 0, 0, 4, 3), TileRef(SYMM_C, 1, 0, 4, 0, 1, 3)]
    t0, t1 = tasks
    assert t0.steps == (
        Step("symm", TileRef(SYMM_A, 0, 0, 0, 0, 4, 4), TileRef(SYMM_B, 0, 0, 0, 0, 4, 3),
             OP_N, OP_N, 4, 3, 4, SC_ALPHA, SC_ZERO, 0, 1),
        # S_01 is not stored: the mirror A(1, 0) with op T
        Step("gemm", TileRef(SYMM_A, 1, 0, 4, 0, 1, 4), TileRef(SYMM_B, 1, 0, 4, 0, 1, 3),
             OP_T, OP_N, 4, 3, 1, SC_ALPHA, SC_ONE),
    )
    assert t1.steps == (
        Step("gemm", TileRef(SYMM_A, 1, 0, 4, 0, 1, 4), TileRef(SYMM_B, 0, 0, 0, 0, 4, 3),
             OP_N, OP_N, 1, 3, 4, SC_ALPHA, SC_ZERO),
        Step("symm", TileRef(SYMM_A, 1, 1, 4, 4, 1, 1), TileRef(SYMM_B, 1, 0, 4, 0, 1, 3),
             OP_N, OP_N, 1, 3, 1, SC_ALPHA, SC_ONE, 0, 1),
    )
    assert all(t.rotatable and not t.load_c for t in tasks)
    assert [t.flops for t in tasks] == [2 * 4 * 3 * 5, 2 * 1 * 3 * 5]


def test_plan_hemm_right_upper_mirror_is_conjugated():
    # C, B 3x5; S 5x5 from A's upper triangle, side 1: C_0j = sum_k B_0k S_kj
    tasks = plan_symm(3, 5, 4, 1, 0, hermitian=True, beta_zero=False, is_complex=True)
    t0, t1 = tasks
    assert t0.steps == (
        Step("hemm", TileRef(SYMM_A, 0, 0, 0, 0, 4, 4), TileRef(SYMM_B, 0, 0, 0, 0, 3, 4),
             OP_N, OP_N, 3, 4, 4, SC_ALPHA, SC_BETA, 1, 0),
        # S_10 (k=1 > j=0) is below the diagonal, unstored: A(0, 1) with op C
        Step("gemm", TileRef(SYMM_B, 0, 1, 0, 4, 3, 1), TileRef(SYMM_A, 0, 1, 0, 4, 4, 1),
             OP_N, OP_C, 3, 4, 1, SC_ALPHA, SC_ONE),
    )
    assert t1.steps[0] == Step("gemm", TileRef(SYMM_B, 0, 0, 0, 0, 3, 4), TileRef(SYMM_A, 0, 1, 0, 4, 4, 1),
                               OP_N, OP_N, 3, 1, 4, SC_ALPHA, SC_BETA)
    assert t1.steps[1].kernel == "hemm" and t1.steps[1].a == TileRef(SYMM_A, 1, 1, 4, 4, 1, 1)
    assert all(t.load_c for t in tasks)


def test_plan_trmm_left_lower_hand_computed():
    # B, C 6x3 (row tiles 4 + 2); A 6x6 lower, op N: C_1j = trmm(A_11) B_1j + A_10 B_0j
    tasks = plan_trmm(6, 3, 4, 0, 1, OP_N, 1)
    assert [t.c for t in tasks] == [TileRef(TRMM_C, 0, 0, 0, 0, 4, 3), TileRef(TRMM_C, 1, 0, 4, 0, 2, 3)]
    t0, t1 = tasks
    assert t0.steps == (Step("trmm", TileRef(TRMM_A, 0, 0, 0, 0, 4, 4), TileRef(TRMM_B, 0, 0, 0, 0, 4, 3),
                             OP_N, OP_N, 4, 3, 4, SC_ALPHA, SC_ZERO, 0, 1, 1),)
    assert t1.steps == (
        Step("trmm", TileRef(TRMM_A, 1, 1, 4, 4, 2, 2), TileRef(TRMM_B, 1, 0, 4, 0, 2, 3),
             OP_N, OP_N, 2, 3, 2, SC_ALPHA, SC_ZERO, 0, 1, 1),
        Step("gemm", TileRef(TRMM_A, 1, 0, 4, 0, 2, 4), TileRef(TRMM_B, 0, 0, 0, 0, 4, 3),
             OP_N, OP_N, 2, 3, 4, SC_ALPHA, SC_ONE),
    )
    assert not any(t.load_c or t.rotatable or t.deps for t in tasks)
    assert t0.flops == 4 * 4 * 3 and t1.flops == 2 * 2 * 3 + 2 * 2 * 3 * 4
    # op T turns the stored lower triangle into an upper op(A): row 0 now has the gemm
    t0, t1 = plan_trmm(6, 3, 4, 0, 1, OP_T, 0)
    assert [s.kernel for s in t0.steps] == ["trmm", "gemm"] and [s.kernel for s in t1.steps] == ["trmm"]
    assert t0.steps[1].a == TileRef(TRMM_A, 1, 0, 4, 0, 2, 4) and t0.steps[1].op_a == OP_T


def test_plan_trmm_in_place_orders_writes_after_reads():
    # B 6x5 (row tiles 4 + 2, column tiles 4 + 1), A lower, op N, left: C_1j reads B_0j and B_1j,
    # so row 1 is written first and row 0 waits for the task of its column in row 1
    tasks = plan_trmm(6, 5, 4, 0, 1, OP_N, 0, in_place=True)
    assert [(t.c.bi, t.c.bj) for t in tasks] == [(1, 0), (1, 1), (0, 0), (0, 1)]
    assert [t.deps for t in tasks] == [(), (), (0,), (1,)]
    assert [t.line for t in tasks] == [(0, 2), (1, 2), (0, 2), (1, 2)]  # (column, columns): the gated lines
    assert trmm_levels(6, 5, 4, 0, 1, OP_N) == [1, 0] and trmm_levels(6, 5, 4, 0, 1, OP_T) == [0, 1]
    # right side, lower op(A): C_ij reads B_ik for k >= j, so the left column is written first
    assert trmm_levels(5, 9, 4, 1, 1, OP_N) == [0, 1, 2] and trmm_levels(5, 9, 4, 1, 0, OP_N) == [2, 1, 0]
    tasks = plan_trmm(5, 9, 4, 1, 0, OP_N, 0, in_place=True)  # upper: right column first
    assert [(t.c.bi, t.c.bj) for t in tasks] == [(0, 2), (1, 2), (0, 1), (1, 1), (0, 0), (1, 0)]
    assert [t.deps for t in tasks] == [(), (), (0,), (1,), (0, 2), (1, 3)]
    assert [t.line for t in tasks] == [(0, 2), (1, 2)] * 3  # right side: (row, rows)
    # the same steps as out of place, and alpha == 0 needs no order
    flat = {(t.c.bi, t.c.bj): t.steps for t in plan_trmm(5, 9, 4, 1, 0, OP_N, 0)}
    assert {(t.c.bi, t.c.bj): t.steps for t in tasks} == flat
    assert not any(t.line for t in plan_trmm(5, 9, 4, 1, 0, OP_N, 0))
    assert not any(t.deps for t in plan_trmm(5, 9, 4, 1, 0, OP_N, 0, alpha_zero=True, in_place=True))


def test_plan_trmm_in_place_wave_order_hand_computed():
    # B 10x8 in 2x2 tiles: 5 block rows (levels; upper op(A), left: row 0 first) x 4 block columns
    # (lines). The wave: cell (depth d, line l) sorts by d + l, then by line.
    tasks = plan_trmm(10, 8, 2, 0, 0, OP_N, 0, in_place=True, order="wave")
    assert [(t.c.bi, t.c.bj) for t in tasks] == [
        (0, 0),
        (1, 0), (0, 1),
        (2, 0), (1, 1), (0, 2),
        (3, 0), (2, 1), (1, 2), (0, 3),
        (4, 0), (3, 1), (2, 2), (1, 3),
        (4, 1), (3, 2), (2, 3),
        (4, 2), (3, 3),
        (4, 3)]
    # write after read: a tile waits for the tasks of the rows above it in its column
    assert [t.deps for t in tasks] == [
        (),
        (0,), (),
        (0, 1), (2,), (),
        (0, 1, 3), (2, 4), (5,), (),
        (0, 1, 3, 6), (2, 4, 7), (5, 8), (9,),
        (2, 4, 7, 11), (5, 8, 12), (9, 13),
        (5, 8, 12, 15), (9, 13, 16),
        (9, 13, 16, 18)]
    # only the write-back waits: row i has 5 - i steps, then the gate
    assert all(t.gates == ((),) * (5 - t.c.bi) + (t.deps,) and len(t.steps) == 5 - t.c.bi for t in tasks)
    # the same tasks and the same dependencies (as tiles) as level by level
    levels = plan_trmm(10, 8, 2, 0, 0, OP_N, 0, in_place=True, order="levels")
    assert [(t.c.bi, t.c.bj) for t in levels] == [(i, j) for i in range(5) for j in range(4)]

    def by_tile(ts):
        tile = {t.tid: (t.c.bi, t.c.bj) for t in ts}
        return {tile[t.tid]: (t.steps, {tile[d] for d in t.deps}) for t in ts}
    assert by_tile(tasks) == by_tile(levels)


def test_trmm_order_hand_computed():
    # right side, upper op(A): lines are block rows, the right column is written first
    # (levels [2, 1, 0]); wave: (d, l) = (0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (2, 1)
    assert trmm_order(6, 9, 3, 1, 0, OP_N, "wave") == [(0, 2), (0, 1), (1, 2), (0, 0), (1, 1), (1, 0)]
    assert trmm_order(6, 9, 3, 1, 0, OP_N, "levels") == [(0, 2), (1, 2), (0, 1), (1, 1), (0, 0), (1, 0)]
    # left, lower op(A) (upper stored, transposed): the bottom row first; edge tiles count as tiles
    assert trmm_levels(7, 5, 3, 0, 0, OP_T) == [2, 1, 0]
    assert trmm_order(7, 5, 3, 0, 0, OP_T, "wave") == [(2, 0), (1, 0), (2, 1), (0, 0), (1, 1), (0, 1)]
    # wave2: a line starts 2 levels after the previous one
    assert trmm_order(9, 9, 3, 0, 0, OP_N, "wave2") == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1),
                                                        (0, 2), (1, 2), (2, 2)]


def test_trmm_order_auto():
    # up to AUTO_LEVELS_MAX_TILES tiles level by level, above them blocks of 2 x 2
    assert AUTO_LEVELS_MAX_TILES == 16
    for m, n in ((16, 16), (8, 32), (32, 8), (20, 16)):
        want = "levels" if n_tiles(m, 4) * n_tiles(n, 4) <= 16 else "blocks"
        for side, lower, op in itertools.product((0, 1), (0, 1), (OP_N, OP_T, OP_C)):
            assert trmm_order(m, n, 4, side, lower, op) == trmm_order(m, n, 4, side, lower, op, want)
    assert trmm_order(20, 16, 4, 0, 0, OP_N)[:5] == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2)]


def test_plan_trmm_in_place_blocks_order_hand_computed():
    # B 10x8 in 2x2 tiles: 5 levels (rows, top first) x 4 lines (columns). Blocks of 2 levels x 2
    # lines, (D, L) by D + L then D; level by level inside; the last level is a block of its own
    # height 1.
    tasks = plan_trmm(10, 8, 2, 0, 0, OP_N, 0, in_place=True, order="blocks")
    assert [(t.c.bi, t.c.bj) for t in tasks] == [
        (0, 0), (0, 1), (1, 0), (1, 1),          # block (0, 0)
        (0, 2), (0, 3), (1, 2), (1, 3),          # (0, 1): rows 0-1 of A again, new lines
        (2, 0), (2, 1), (3, 0), (3, 1),          # (1, 0)
        (2, 2), (2, 3), (3, 2), (3, 3),          # (1, 1)
        (4, 0), (4, 1),                          # (2, 0)
        (4, 2), (4, 3)]                          # (2, 1)
    assert trmm_order(10, 8, 2, 0, 0, OP_N, "blocks") == trmm_order(10, 8, 2, 0, 0, OP_N, "blocks2")
    # every task is listed after its dependencies, in every blocks size and flag combination
    for b, side, lower, op in itertools.product((1, 2, 3), (0, 1), (0, 1), (OP_N, OP_T)):
        ts = plan_trmm(14, 10, 2, side, lower, op, 0, in_place=True, order=f"blocks{b}")
        assert all(d < t.tid for t in ts for d in t.deps)


def test_plan_trmm_gemm_steps_rotate_after_the_diagonal_step():
    # the diagonal trmm step initialises C and stays first (fixed=1); the gemm steps rotate
    for in_place in (False, True):
        tasks = plan_trmm(8, 6, 2, 0, 0, OP_N, 0, in_place=in_place)
        for t in tasks:
            assert t.steps[0].kernel == "trmm" and t.fixed == 1
            assert t.rotatable == (len(t.steps) > 2)
    t = next(t for t in plan_trmm(8, 6, 2, 0, 0, OP_N, 0) if len(t.steps) == 4)
    head, body = t.steps[:t.fixed], t.steps[t.fixed:]
    rotated = head + rotated_steps(body, 2)
    assert [s.kernel for s in rotated] == ["trmm", "gemm", "gemm", "gemm"]
    assert [s.b for s in rotated] == [t.steps[0].b, t.steps[3].b, t.steps[1].b, t.steps[2].b]
    assert all(s.beta == SC_ONE for s in rotated[1:])


@pytest.mark.parametrize("order", ["wave-1", "wave0", "blocks1.5", "lines", "bands3", "work4", "levels2", "auto3",
                                   "zigzag", ""])
def test_trmm_order_rejects_bad_names(order, expect):
    expect(ValueError, "order:", repr(order), "allowed: auto, levels, wave[S], blocks[B]",
           call=lambda: plan_trmm(8, 8, 2, 0, 0, OP_N, 0, in_place=True, order=order))


@pytest.mark.parametrize("order", ["auto", "levels", "wave", "wave2", "wave0.5", "blocks", "blocks3"])
@pytest.mark.parametrize("m,n,T", [(9, 5, 4), (4, 13, 4), (13, 13, 3), (17, 11, 2)])
def test_plan_trmm_in_place_every_reader_precedes_the_writer(m, n, T, order):
    for side, lower, op in itertools.product((0, 1), (0, 1), (OP_N, OP_T, OP_C)):
        tasks = plan_trmm(m, n, T, side, lower, op, 0, in_place=True, order=order)
        assert all(d < t.tid for t in tasks for d in t.deps)  # listed after its dependencies
        writer = {(t.c.bi, t.c.bj): t for t in tasks}
        for t in tasks:
            for s in t.steps:
                ref = s.b if side == 0 else s.a if s.kernel == "gemm" else s.b
                if ref.slot != TRMM_B or (ref.bi, ref.bj) == (t.c.bi, t.c.bj):
                    continue
                assert t.tid in writer[(ref.bi, ref.bj)].deps, (side, lower, op, t.c, ref)


def test_plan_trsm_left_lower_hand_computed():
    # op(A) X = alpha B, A 6x6 lower (tiles 4 + 2), B, X 6x5 (column tiles 4 + 1)
    tasks = plan_trsm(6, 5, 4, 0, 1, OP_N, 0)
    # level by level: block row 0 for every column, then block row 1
    assert [(t.c.bi, t.c.bj) for t in tasks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    t0, t1, t2, t3 = tasks
    assert t0.c == TileRef(TRSM_X, 0, 0, 0, 0, 4, 4)
    assert t0.c_init == TileRef(TRSM_B, 0, 0, 0, 0, 4, 4)
    # no update: the diagonal solve scales B by alpha itself
    assert t0.steps == (Step("trsm", TileRef(TRSM_A, 0, 0, 0, 0, 4, 4), None, OP_N, OP_N, 4, 4, 4,
                             SC_ALPHA, SC_ONE, 0, 1, 0),)
    assert t0.deps == () and t0.keep_c and t0.load_c and not t0.rotatable
    assert t2.c == TileRef(TRSM_X, 1, 0, 4, 0, 2, 4) and t2.c_init == TileRef(TRSM_B, 1, 0, 4, 0, 2, 4)
    assert t2.steps == (
        Step("gemm", TileRef(TRSM_A, 1, 0, 4, 0, 2, 4), TileRef(TRSM_X, 0, 0, 0, 0, 4, 4),
             OP_N, OP_N, 2, 4, 4, SC_MINUS_ONE, SC_ALPHA),
        Step("trsm", TileRef(TRSM_A, 1, 1, 4, 4, 2, 2), None, OP_N, OP_N, 2, 4, 2, SC_ONE, SC_ONE, 0, 1, 0),
    )
    assert t2.deps == (0,) and t3.deps == (1,)
    assert not t2.keep_c and not t3.keep_c  # nobody reads the last level
    assert t3.steps[0].b == TileRef(TRSM_X, 0, 1, 0, 4, 4, 1)
    assert t2.flops == 2 * 2 * 4 * 4 + 2 * 2 * 4
    assert sum(t.flops for t in tasks) == 6 * 6 * 5  # m^2 n, the whole TRSM
    assert [t.line for t in tasks] == [(0, 2), (1, 2), (0, 2), (1, 2)]  # (column, columns): independent solves


def test_plan_trsm_with_inverses_hand_computed():
    # A 10x10 lower in tiles 4 + 4 + 2, B 10x5 (column tiles 4 + 1): levels 0, 1, 2
    tasks = plan_trsm(10, 5, 4, 0, 1, OP_N, 0, inverse=True)
    assert inverse_shape(10, 4) == (4, 10)
    v1, v2 = inverse_ref(1, 10, 4), inverse_ref(2, 10, 4)
    assert v1 == TileRef(TRSM_V, 0, 1, 0, 4, 4, 4) and v2 == TileRef(TRSM_V, 0, 2, 0, 8, 2, 2)
    # the inversions of levels 1 and 2 first (level 0 solves with trsm steps), then the levels
    kinds = [(t.steps[0].kernel, t.c.bi, t.c.bj) if t.steps[0].kernel == "trtri" else ("x", t.c.bi, t.c.bj)
             for t in tasks]
    assert kinds == [("trtri", 0, 1), ("trtri", 0, 2), ("x", 0, 0), ("x", 0, 1), ("x", 1, 0), ("x", 1, 1),
                     ("x", 2, 0), ("x", 2, 1)]
    i1, i2, t00, t01, t10, t11, t20, t21 = tasks
    assert i1.steps == (Step("trtri", None, None, OP_N, OP_N, 4, 4, 4, SC_ONE, SC_ONE, 0, 1, 0),)
    assert i1.c == v1 and i1.c_init == TileRef(TRSM_A, 1, 1, 4, 4, 4, 4)
    assert i1.load_c and i1.keep_c and i1.urgent and i1.deps == () and i1.flops == 4 ** 3 / 3
    assert i2.c_init == TileRef(TRSM_A, 2, 2, 8, 8, 2, 2) and i2.flops == 2 ** 3 / 3
    assert t00.steps == (Step("trsm", TileRef(TRSM_A, 0, 0, 0, 0, 4, 4), None, OP_N, OP_N, 4, 4, 4,
                              SC_ALPHA, SC_ONE, 0, 1, 0),) and t00.deps == ()
    assert t10.steps[1] == Step("invmm", v1, None, OP_N, OP_N, 4, 4, 4, SC_ONE, SC_ONE, 0, 1, 0)
    assert t10.deps == (2, 0) and t10.gates == ((2,), (0,), ())
    assert t21.steps[-1] == Step("invmm", v2, None, OP_N, OP_N, 2, 1, 2, SC_ONE, SC_ONE, 0, 1, 0)
    assert t21.deps == (3, 5, 1) and t21.gates == ((3,), (5,), (1,), ())
    assert not any(t.urgent for t in tasks[2:])
    assert i1.line == i2.line == () and [t.line for t in tasks[2:]] == [(0, 2), (1, 2)] * 3  # inversions: shared
    # the solve's flops, plus n^3 / 3 per inverted block
    assert sum(t.flops for t in tasks) == 10 * 10 * 5 + (4 ** 3 + 2 ** 3) / 3


def test_plan_trsm_inversions_run_two_levels_ahead():
    tasks = plan_trsm(10, 2, 2, 0, 0, OP_N, 1, inverse=True)  # upper: levels 4, 3, 2, 1, 0
    order = [("V", t.c.bj) if t.steps[0].kernel == "trtri" else ("X", t.c.bi) for t in tasks]
    assert order == [("V", 3), ("V", 2), ("V", 1), ("X", 4), ("V", 0), ("X", 3), ("X", 2), ("X", 1),
                     ("X", 0)]
    assert all(t.deps[-1] < t.tid for t in tasks if t.deps)
    one_level = [plan_trsm(3, 9, 4, 0, 1, OP_N, 0, inverse=inv) for inv in (True, False)]
    assert [[(t.c, t.steps, t.deps, t.gates) for t in p] for p in one_level] == \
        [[(t.c, t.steps, t.deps, t.gates) for t in one_level[1]]] * 2  # a single level: nothing to invert


def test_plan_trsm_right_upper_transposed_is_backward():
    # X op(A) = alpha B with A upper, op T: op(A) is lower, so columns are solved last to first
    tasks = plan_trsm(3, 9, 4, 1, 0, OP_T, 1, is_complex=True)
    assert trsm_levels(3, 9, 4, 1, 0, OP_T) == [2, 1, 0]
    assert [(t.c.bi, t.c.bj) for t in tasks] == [(0, 2), (0, 1), (0, 0)]
    first, mid, last = tasks
    assert first.steps == (Step("trsm", TileRef(TRSM_A, 2, 2, 8, 8, 1, 1), None, OP_T, OP_N, 3, 1, 1,
                                SC_ALPHA, SC_ONE, 1, 0, 1),)
    # X_00 = (alpha B_00 - X_02 op(A)_20 - X_01 op(A)_10) op(A)_00^-1, op(A)_k0 = A(0, k)^T
    assert last.steps == (
        Step("gemm", TileRef(TRSM_X, 0, 2, 0, 8, 3, 1), TileRef(TRSM_A, 0, 2, 0, 8, 4, 1),
             OP_N, OP_T, 3, 4, 1, SC_MINUS_ONE, SC_ALPHA),
        Step("gemm", TileRef(TRSM_X, 0, 1, 0, 4, 3, 4), TileRef(TRSM_A, 0, 1, 0, 4, 4, 4),
             OP_N, OP_T, 3, 4, 4, SC_MINUS_ONE, SC_ONE),
        Step("trsm", TileRef(TRSM_A, 0, 0, 0, 0, 4, 4), None, OP_T, OP_N, 3, 4, 4, SC_ONE, SC_ONE, 1, 0, 1),
    )
    assert mid.deps == (0,) and last.deps == (0, 1)
    assert [t.line for t in tasks] == [(0, 1)] * 3  # right side: rows
    assert [t.keep_c for t in tasks] == [True, True, False]


def test_alpha_zero_plans_read_nothing():
    for tasks in (plan_trsm(9, 5, 4, 0, 1, OP_N, 0, alpha_zero=True),
                  plan_trmm(9, 5, 4, 1, 0, OP_C, 1, alpha_zero=True)):
        assert len(tasks) == 3 * 2
        for t in tasks:
            assert t.steps == (Step("scale", None, None, OP_N, OP_N, t.c.rows, t.c.cols, 0, SC_ALPHA, SC_ZERO),)
            assert not t.load_c and t.deps == () and t.c_init is None and t.input_tiles() == []
    for beta_zero in (True, False):
        first = SC_ZERO if beta_zero else SC_BETA
        tasks = plan_symm(9, 5, 4, 0, 1, alpha_zero=True, beta_zero=beta_zero)
        assert all(t.steps == (Step("scale", None, None, OP_N, OP_N, t.c.rows, t.c.cols, 0, SC_ALPHA, first),)
                   for t in tasks)
        for planner, kernel in ((plan_syrk, "herk"), (plan_syr2k, "her2k")):
            for alpha_zero, k in ((True, 7), (False, 0)):
                tasks = planner(9, k, 4, OP_N, 1, hermitian=True, alpha_zero=alpha_zero, beta_zero=beta_zero)
                assert len(tasks) == 6
                for t in tasks:
                    assert t.input_tiles() == []
                    if t.c.bi == t.c.bj:  # the triangle is scaled (and HERK's diagonal made real) by the kernel
                        assert t.steps == (Step(kernel, None, None, OP_N, OP_N, t.c.rows, t.c.cols, 0,
                                                SC_ALPHA, first, 0, 1),)
                        assert t.load_c
                    else:
                        assert t.steps[0].kernel == "scale" and t.load_c is not beta_zero


def test_block_order_keeps_the_triangle():
    tasks = plan_syrk(40, 8, 4, OP_N, 1, block=(2, 2))
    tiles = [(t.c.bi, t.c.bj) for t in tasks]
    assert sorted(tiles) == sorted((i, j) for i in range(10) for j in range(i + 1))
    assert tiles[:4] == [(0, 0), (1, 0), (1, 1), (2, 0)]  # block (0, 0) then block (0, 1) (empty), (1, 0)...
    assert [t.tid for t in tasks] == list(range(len(tasks)))


def test_empty_plans():
    assert plan_syrk(0, 5, 4, OP_N, 1) == [] and plan_syr2k(0, 3, 4, OP_T, 0) == []
    assert plan_symm(0, 5, 4, 0, 1) == [] and plan_symm(5, 0, 4, 1, 1) == []
    assert plan_trmm(0, 5, 4, 0, 1, OP_N, 0) == [] and plan_trsm(5, 0, 4, 0, 1, OP_N, 0) == []


# =========================================================================== invariants of every plan

FLAGS_TRI = list(itertools.product((0, 1), (0, 1), (OP_N, OP_T, OP_C), (0, 1)))  # side, lower, op, unit


@pytest.mark.parametrize("m,n,T", [(1, 1, 4), (9, 5, 4), (4, 13, 4), (13, 4, 3), (8, 8, 4)])
def test_trsm_plan_invariants(m, n, T):
    for side, lower, op, unit in FLAGS_TRI:
        for is_complex in (False, True):
            tasks = plan_trsm(m, n, T, side, lower, op, unit, is_complex=is_complex)
            assert sorted((t.c.bi, t.c.bj) for t in tasks) == sorted(itertools.product(range(n_tiles(m, T)),
                                                                                       range(n_tiles(n, T))))
            by_tile = {(t.c.bi, t.c.bj): t for t in tasks}
            read_later = set()
            for t in tasks:
                assert all(d < t.tid for d in t.deps)  # deps come first in the queue
                gemms, last = t.steps[:-1], t.steps[-1]
                assert last.kernel == "trsm" and (last.side, last.uplo, last.diag, last.op_a) == (side, lower, unit, op)
                assert last.alpha == (SC_ONE if gemms else SC_ALPHA)
                assert [s.beta for s in gemms] == ([SC_ALPHA] + [SC_ONE] * len(gemms))[:len(gemms)]
                assert all(s.kernel == "gemm" and s.alpha == SC_MINUS_ONE for s in gemms)
                x_read = [s.b if side == 0 else s.a for s in gemms]
                assert all(x.slot == TRSM_X for x in x_read)
                # the X tiles read are exactly those solved by the deps
                assert sorted(tasks[d].c for d in t.deps) == sorted(x_read)
                read_later |= {(x.bi, x.bj) for x in x_read}
                assert t.c_init == t.c._replace(slot=TRSM_B) and t.load_c
                assert t.flops == sum(step_flops(s, is_complex) for s in t.steps)
            assert {k for k, t in by_tile.items() if t.keep_c} == read_later
            s_dim = m if side == 0 else n
            assert sum(t.flops for t in tasks) == (4 if is_complex else 1) * s_dim * m * n


@pytest.mark.parametrize("n,k,T", [(1, 1, 4), (9, 5, 4), (4, 13, 4), (13, 4, 3), (8, 8, 4)])
def test_rank_k_plan_invariants(n, k, T):
    for planner, two in ((plan_syrk, False), (plan_syr2k, True)):
        for hermitian, lower, beta_zero in itertools.product((False, True), (0, 1), (False, True)):
            for op in ((OP_N, OP_C) if hermitian else (OP_N, OP_T)):
                tasks = planner(n, k, T, op, lower, hermitian=hermitian, beta_zero=beta_zero)
                tn = n_tiles(n, T)
                want = {(i, j) for i in range(tn) for j in range(tn) if (i >= j if lower else i <= j)}
                assert {(t.c.bi, t.c.bj) for t in tasks} == want and len(tasks) == len(want)
                for t in tasks:
                    diag = t.c.bi == t.c.bj
                    assert t.load_c == (diag or not beta_zero)
                    assert t.rotatable == (not diag and len(t.steps) > 1)
                    kernels = {s.kernel for s in t.steps}
                    assert kernels == ({("her2k" if two else "herk") if hermitian else ("syr2k" if two else "syrk")}
                                       if diag else {"gemm"})
                    assert t.steps[0].beta == (SC_ZERO if beta_zero else SC_BETA)
                    assert all(s.beta == SC_ONE for s in t.steps[1:])
                    # every tile read is a stored tile of A (or B) of the right size
                    for s in t.steps:
                        for ref in (s.a, s.b):
                            if ref is not None:
                                rows, cols = (n, k) if op == OP_N else (k, n)
                                assert ref == tile_ref(ref.slot, ref.bi, ref.bj, rows, cols, T)
                assert sum(t.flops for t in tasks) == (2 if two else 1) * n * (n + 1) * k


@pytest.mark.parametrize("m,n,T", [(1, 1, 4), (9, 5, 4), (4, 13, 4), (13, 4, 3)])
def test_symm_and_trmm_plan_flops_add_up(m, n, T):
    for side, lower in itertools.product((0, 1), (0, 1)):
        s_dim = m if side == 0 else n
        tasks = plan_symm(m, n, T, side, lower)
        assert sum(t.flops for t in tasks) == 2 * m * n * s_dim
        for op, unit in itertools.product((OP_N, OP_T, OP_C), (0, 1)):
            tasks = plan_trmm(m, n, T, side, lower, op, unit)
            assert sum(t.flops for t in tasks) == m * n * s_dim
            for t in tasks:
                assert t.steps[0].kernel == "trmm" and all(s.kernel == "gemm" and s.beta == SC_ONE
                                                             for s in t.steps[1:])
                # op(A) tiles used are in op(A)'s nonzero triangle
                for s in t.steps[1:]:
                    ref = s.a if side == 0 else s.b
                    i, k = (ref.bi, ref.bj) if op == OP_N else (ref.bj, ref.bi)
                    assert (i > k) == effective_lower(lower, op)


# =========================================================================== plans executed with the numpy kernels

def _scalars(dtype, alpha, beta):
    s = np.zeros(N_SCALARS, dtype=dtype)
    s[SC_ALPHA], s[SC_BETA], s[SC_ZERO], s[SC_ONE], s[SC_MINUS_ONE] = alpha, beta, 0, 1, -1
    s[SC_ALPHA_CONJ] = np.conj(s[SC_ALPHA])
    return s


def execute(tasks, operands, scalars, seed=0):
    """Run the tasks one at a time in a random order that respects their deps, as the engine may."""
    rng = random.Random(seed)
    pending = list(tasks)
    done: set[int] = set()

    def view(ref):
        return operands[ref.slot][ref.r0:ref.r0 + ref.rows, ref.c0:ref.c0 + ref.cols]

    while pending:
        ready = [t for t in pending if set(t.deps) <= done]
        t = rng.choice(ready)
        pending.remove(t)
        if t.load_c:
            acc = np.array(view(t.c_init or t.c), order="F")
        else:  # not loaded: poison, so a kernel that reads C would show
            acc = np.full((t.c.rows, t.c.cols), np.nan, dtype=scalars.dtype, order="F")
        for s in t.steps:
            KERNELS[s.kernel](s, scalars, None if s.a is None else view(s.a), None if s.b is None else view(s.b), acc)
        view(t.c)[...] = acc
        done.add(t.tid)


def _rand(shape, dtype, rng):
    x = rng.uniform(-1, 1, shape)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.uniform(-1, 1, shape)
    return np.asfortranarray(x.astype(dtype))


def _poison_triangle(a, lower, unit):
    """a copy of a with the unread triangle (and the diagonal if unit) set to NaN."""
    p = a.copy(order="F")
    mask = np.triu(np.ones(a.shape, bool), 1) if lower else np.tril(np.ones(a.shape, bool), -1)
    p[mask] = np.nan
    if unit:
        np.fill_diagonal(p, np.nan)
    return p


DTYPES = (np.float32, np.float64, np.complex64, np.complex128)


def _tol(dtype):
    return 2e-4 if np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.complex64)) else 1e-11


def _err(x, ref):
    ref = np.asarray(ref, np.complex128)
    return np.linalg.norm(np.asarray(x, np.complex128) - ref) / max(np.linalg.norm(ref), 1e-300)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_executed_trsm_and_trmm_plans_match_scipy(dtype):
    rng = np.random.default_rng(1)
    p = PREFIX[np.dtype(dtype)]
    alpha = np.asarray(0.75 - 0.25j if np.dtype(dtype).kind == "c" else 0.75, dtype)[()]
    m, n, T = 11, 7, 4
    for side, lower, op, unit in FLAGS_TRI:
        s_dim = m if side == 0 else n
        a = _rand((s_dim, s_dim), dtype, rng) / s_dim + np.eye(s_dim, dtype=dtype) * 2
        b = _rand((m, n), dtype, rng)
        pa = _poison_triangle(a, lower, unit)
        sc = _scalars(dtype, alpha, 0)
        ref = getattr(sblas, p + "trsm")(alpha, a, b, side=side, lower=lower, trans_a=op, diag=unit)
        for seed, inverse in itertools.product(range(2), (False, True)):
            x = np.full((m, n), np.nan, dtype=dtype, order="F")  # unsolved X tiles poison their readers
            v = np.full(inverse_shape(s_dim, T), np.nan, dtype=dtype, order="F")  # as are unmade inverses
            execute(plan_trsm(m, n, T, side, lower, op, unit, inverse=inverse), [pa, b, x, v], sc, seed)
            assert _err(x, ref) < _tol(dtype), ("trsm", side, lower, op, unit, seed, inverse)
        c = np.full((m, n), np.nan, dtype=dtype, order="F")
        execute(plan_trmm(m, n, T, side, lower, op, unit), [pa, b, c], sc)
        ref = getattr(sblas, p + "trmm")(alpha, a, b, side=side, lower=lower, trans_a=op, diag=unit)
        assert _err(c, ref) < _tol(dtype), ("trmm", side, lower, op, unit)
        for seed in range(3):  # in place: any order the deps allow reads every B tile before it is written
            bb = b.copy(order="F")
            execute(plan_trmm(m, n, T, side, lower, op, unit, in_place=True), [pa, bb, bb], sc, seed)
            assert _err(bb, ref) < _tol(dtype), ("trmm in place", side, lower, op, unit, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_executed_symm_and_rank_k_plans_match_scipy(dtype):
    rng = np.random.default_rng(2)
    p = PREFIX[np.dtype(dtype)]
    cplx = np.dtype(dtype).kind == "c"
    alpha = np.asarray(0.75 - 0.25j if cplx else 0.75, dtype)[()]
    beta = np.asarray(-0.5 + 0.5j if cplx else -0.5, dtype)[()]
    m, n, k, T = 11, 7, 6, 4
    for side, lower, beta_zero in itertools.product((0, 1), (0, 1), (False, True)):
        s_dim = m if side == 0 else n
        a = _rand((s_dim, s_dim), dtype, rng)
        b = _rand((m, n), dtype, rng)
        c0 = _rand((m, n), dtype, rng)
        for herm in ((False, True) if cplx else (False,)):
            pa = _poison_triangle(a, lower, False)
            if herm:
                d = np.arange(s_dim)
                pa.imag[d, d] = np.nan  # hemm does not read the imaginary part of the diagonal
            bb = 0 if beta_zero else beta
            c = c0.copy(order="F")
            if beta_zero:
                c[...] = np.nan
            execute(plan_symm(m, n, T, side, lower, hermitian=herm, beta_zero=beta_zero, is_complex=cplx),
                    [pa, b, c], _scalars(dtype, alpha, bb))
            ref = getattr(sblas, p + ("hemm" if herm else "symm"))(alpha, a, b, bb, c0, side=side, lower=lower)
            assert _err(c, ref) < _tol(dtype), ("symm", herm, side, lower, beta_zero)
    for lower, beta_zero, two in itertools.product((0, 1), (False, True), (False, True)):
        for herm in ((False, True) if cplx else (False,)):
            for op in ((OP_N, OP_C) if herm else (OP_N, OP_T)):
                shape = (n, k) if op == OP_N else (k, n)
                a, b = _rand(shape, dtype, rng), _rand(shape, dtype, rng)
                c0 = _rand((n, n), dtype, rng)
                al = alpha.real if (herm and not two) else alpha
                bb = 0 if beta_zero else (beta.real if herm else beta)
                c = c0.copy(order="F")
                written = np.tril(np.ones((n, n), bool)) if lower else np.triu(np.ones((n, n), bool))
                if beta_zero:
                    c[written] = np.nan
                planner = plan_syr2k if two else plan_syrk
                ops = [a, b, c] if two else [a, c]
                execute(planner(n, k, T, op, lower, hermitian=herm, beta_zero=beta_zero, is_complex=cplx),
                        ops, _scalars(dtype, al, bb))
                name = p + ("her" if herm else "syr") + ("2k" if two else "k")
                args = (al, a, b) if two else (al, a)
                ref = getattr(sblas, name)(*args, bb, c0, trans=op, lower=lower)
                assert _err(c[written], ref[written]) < _tol(dtype), (name, op, lower, beta_zero)
                assert np.array_equal(c[~written], c0[~written])  # the other triangle as loaded
