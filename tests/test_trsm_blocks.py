"""The recursive blocking of a triangular-solve tile (runtime/trsm_blocks.py): its ops, run with
numpy, equal scipy's trsm for every side, triangle, op, diagonal, dtype and split; plus exact
op lists for a hand-checked case."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import scipy.linalg.blas as sb

from blasx.runtime.trsm_blocks import Solve, Update, stored_block, trsm_tile_ops

OPS = (lambda x: x, lambda x: x.T, lambda x: x.conj().T)


def run_ops(ops, alpha, a, b, side, lower, op, diag):
    """Execute the ops with numpy/scipy on b in place (the backend contract)."""
    trsm = sb.get_blas_funcs("trsm", dtype=b.dtype)
    for o in ops:
        s = alpha if o.first else 1
        if isinstance(o, Solve):
            blk = a[o.d0:o.d0 + o.size, o.d0:o.d0 + o.size]
            rhs = b[o.b_r0:o.b_r0 + o.b_rows, o.b_c0:o.b_c0 + o.b_cols]
            rhs[...] = trsm(s, blk, rhs, side=side, lower=lower, trans_a=op, diag=diag)
        else:
            r0, c0, rows, cols = stored_block(o.a, op)
            ab = OPS[op](a[r0:r0 + rows, c0:c0 + cols])
            xr, xc, xrows, xcols = o.x
            cr, cc, crows, ccols = o.c
            x = b[xr:xr + xrows, xc:xc + xcols]
            c = b[cr:cr + crows, cc:cc + ccols]
            c[...] = s * c - (ab @ x if side == 0 else x @ ab)


@pytest.mark.parametrize("dtype", [np.float64, np.complex128, np.float32])
@pytest.mark.parametrize("side,lower,op,diag", list(itertools.product((0, 1), (0, 1), (0, 1, 2), (0, 1))))
def test_blocked_solve_equals_scipy(dtype, side, lower, op, diag):
    rng = np.random.default_rng(side * 100 + lower * 10 + op * 3 + diag)
    m, n = 37, 23
    size = m if side == 0 else n
    a = rng.standard_normal((size, size)) + size * np.eye(size)
    b = rng.standard_normal((m, n))
    if np.dtype(dtype).kind == "c":
        a = a + 1j * rng.standard_normal((size, size))
        b = b + 1j * rng.standard_normal((m, n))
    a, b = np.asfortranarray(a.astype(dtype)), np.asfortranarray(b.astype(dtype))
    alpha = dtype(1.5) if np.dtype(dtype).kind != "c" else dtype(1.5 - 0.5j)
    want = sb.get_blas_funcs("trsm", dtype=b.dtype)(alpha, a, b, side=side, lower=lower, trans_a=op, diag=diag)
    tol = 1e-4 if np.dtype(dtype) == np.float32 else 1e-12
    for leaf in (1, 4, 8, 16, size, 2 * size):
        ops = trsm_tile_ops(m, n, side, lower, op, leaf)
        assert sum(o.size for o in ops if isinstance(o, Solve)) == size  # every row/column solved once
        assert all(o.size <= max(leaf, 1) for o in ops if isinstance(o, Solve))
        x = b.copy(order="F")
        run_ops(ops, alpha, a, x, side, lower, op, diag)
        assert np.linalg.norm(x - want) / np.linalg.norm(want) < tol, leaf


def test_hand_checked_ops_left_lower():
    """Left side, lower, no transpose, 8 x 3 with leaf 4: solve rows 0..3, update rows 4..7
    with A[4:8, 0:4] X[0:4], solve rows 4..7 (alpha once, on the first solve and the update)."""
    assert trsm_tile_ops(8, 3, 0, 1, 0, 4) == [
        Solve(0, 4, 0, 0, 4, 3, True),
        Update((4, 0, 4, 4), (0, 0, 4, 3), (4, 0, 4, 3), True),
        Solve(4, 4, 4, 0, 4, 3, False),
    ]
    # upper with a transpose is lower in op terms: the same order; the A block is stored at (0, 4)
    ops = trsm_tile_ops(8, 3, 0, 0, 1, 4)
    assert ops[1].a == (4, 0, 4, 4) and stored_block(ops[1].a, 1) == (0, 4, 4, 4)
    # right side, upper, no transpose: forward over columns
    assert trsm_tile_ops(3, 8, 1, 0, 0, 4) == [
        Solve(0, 4, 0, 0, 3, 4, True),
        Update((0, 4, 4, 4), (0, 0, 3, 4), (0, 4, 3, 4), True),
        Solve(4, 4, 0, 4, 3, 4, False),
    ]


def test_splits_are_aligned_to_the_leaf_and_bad_leaf_rejected():
    ops = trsm_tile_ops(4096, 4096, 0, 1, 0, 1024)
    assert [o.d0 for o in ops if isinstance(o, Solve)] == [0, 1024, 2048, 3072]
    assert sum(isinstance(o, Update) for o in ops) == 3
    assert trsm_tile_ops(0, 5, 0, 1, 0, 4) == []
    with pytest.raises(ValueError, match="leaf"):
        trsm_tile_ops(8, 8, 0, 1, 0, 0)
