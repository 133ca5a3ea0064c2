"""blasx.dask's super-blocks without a cluster: the grouping of boundaries by exact value, a grid step's pieces
joined as its operand stores them (every transpose), and grid steps joined along k for GPU blocks."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("distributed")

from blasx.dask import worker as W  # noqa: E402
from blasx.dask.graph import group_bounds, inside  # noqa: E402
from blasx.dask.worker import Ref  # noqa: E402


@pytest.mark.parametrize("b, extent, want", [
    ((0, 7, 30, 31, 60), 20, (0, 30, 60)),
    ((0, 7, 30, 31, 60), 100, (0, 60)),
    ((0, 15, 30, 45, 60), 15, (0, 15, 30, 45, 60)),
    ((0, 15, 30, 45, 60), 16, (0, 30, 60)),
    ((0, 10, 20, 30, 40, 45), 20, (0, 20, 45)),  # a short last group joins the one before
    ((0, 60), 20, (0, 60)),
    ((0, 7, 30), 0, (0, 7, 30)),
    ((0,), 5, (0,)),
])
def test_group_bounds(b, extent, want):
    assert group_bounds(b, extent) == want
    assert set(want) <= set(b)


def test_inside_lists_the_fine_intervals_of_a_group():
    assert inside((0, 7, 30, 31, 60), (0, 30)) == [(0, 7), (7, 30)]
    assert inside((0, 7, 30, 31, 60), (30, 60)) == [(30, 31), (31, 60)]


@pytest.mark.parametrize("ta, tb", [(0, 0), (1, 0), (0, 1), (2, 2), (1, 2)])
def test_a_grid_step_multiplies_the_joined_pieces(ta, tb):
    """acc += alpha op(A) op(B) with A's pieces xs[k][i] and B's ys[k][j], each stored as its operand stores it;
    two grid steps of one k each, joined into one (as for GPU blocks), give the same."""
    rng = np.random.default_rng(0)
    rows, ks, cols = (3, 5), (4, 2, 6), (7, 2)
    A = rng.standard_normal((sum(rows), sum(ks))) + 1j * rng.standard_normal((sum(rows), sum(ks)))
    B = rng.standard_normal((sum(ks), sum(cols))) + 1j * rng.standard_normal((sum(ks), sum(cols)))
    sa = A if ta == 0 else (A.T if ta == 1 else A.conj().T)  # what the operand stores
    sb = B if tb == 0 else (B.T if tb == 1 else B.conj().T)
    r0 = np.cumsum((0,) + rows)
    k0 = np.cumsum((0,) + ks)
    c0 = np.cumsum((0,) + cols)

    def piece_a(k, i):
        x = A[r0[i]:r0[i + 1], k0[k]:k0[k + 1]]
        return x if ta == 0 else (x.T if ta == 1 else x.conj().T)

    def piece_b(k, j):
        y = B[k0[k]:k0[k + 1], c0[j]:c0[j + 1]]
        return y if tb == 0 else (y.T if tb == 1 else y.conj().T)
    assert sa.shape[0] > 0 and sb.shape[0] > 0
    alpha = 0.5 - 1j
    want = alpha * A @ B
    held = W.memory_stats()["held"]  # (other tests' blocks may still be alive in this process)
    per_k = [("gemm_grid", alpha, ((Ref(0, 0, 0, 0, 0),) * len(rows),), ta, ((Ref(1, 0, 0, 0, 0),) * len(cols),), tb)
             for _ in ks]
    joined = W._join_runs(per_k, True)  # GPU blocks: one step over every k
    assert len(joined) == 1 and len(joined[0][2]) == len(ks) and len(joined[0][4]) == len(ks)
    for steps in (per_k, joined):
        acc = np.zeros((sum(rows), sum(cols)), dtype=complex, order="F")
        pieces = iter([piece_a(k, i) for k in range(len(ks)) for i in range(len(rows))]
                      + [piece_b(k, j) for k in range(len(ks)) for j in range(len(cols))])
        for idx, st in enumerate(steps):
            n_refs = len(W.refs_of(st))
            got = [next(pieces) for _ in range(n_refs)] if len(steps) == 1 else None
            if got is None:  # per-k steps: that k's pieces of A, then of B
                got = [piece_a(idx, i) for i in range(len(rows))] + [piece_b(idx, j) for j in range(len(cols))]
            acc = W._apply(st, got, acc, np)
        assert np.abs(acc - want).max() < 1e-12
    assert W.memory_stats()["held"] == held  # joined copies counted only while they live


def test_a_join_keeps_its_pieces_layout():
    """C-contiguous pieces join into a C-ordered matrix (whole-row copies); any other mix into an F-ordered one."""
    rng = np.random.default_rng(1)
    whole = rng.standard_normal((7, 9))
    grid = [[whole[:3, :4].copy(), whole[:3, 4:].copy()], [whole[3:, :4].copy(), whole[3:, 4:].copy()]]
    got = W._joined(np, grid)
    assert W.join_order(grid) == "C" and got.flags.c_contiguous and np.array_equal(got, whole)
    grid[1][0] = np.asfortranarray(grid[1][0])
    got = W._joined(np, grid)
    assert W.join_order(grid) == "F" and got.flags.f_contiguous and np.array_equal(got, whole)
    assert W.join_order([[whole[:, :1].copy()]]) == "F"  # a column is both: F, as before


def test_grid_steps_reading_storage_are_not_joined():
    st = ("gemm_grid", 1.0, ((Ref(-1, 0, 1, 0, 1),),), 0, ((Ref(0, 0, 1, 0, 1),),), 0)
    assert W._join_runs([st, st], True) == [st, st]


@pytest.mark.parametrize("op", ["gemm", "gemm_grid"])
def test_a_fresh_accumulator_is_overwritten_not_read(op):
    """A block whose init is zeros starts from uninitialised memory: its first gemm step overwrites it (beta 0),
    so whatever the memory held (NaN here) never reaches the result."""
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((5, 4)), rng.standard_normal((4, 3))
    plan = W.Block((5, 3), "<f8", ("zeros",), ())
    acc = W._init(plan, [], np, fresh=True)
    acc[...] = np.nan
    ref = (Ref(0, 0, 5, 0, 4), Ref(1, 0, 4, 0, 3))
    step = (("gemm", 2.0, ref[0], 0, ref[1], 0, 1.0) if op == "gemm"
            else ("gemm_grid", 2.0, ((ref[0],),), 0, ((ref[1],),), 0))
    got = W._apply(step, [x, y], acc, np, fresh=True)
    np.testing.assert_allclose(got, 2.0 * x @ y, rtol=1e-13)
    assert not W._init(plan, [], np).any()  # not fresh: zeros
