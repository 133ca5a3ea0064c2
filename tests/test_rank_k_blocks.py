"""runtime/rank_k_blocks.py: exact op lists, and the ops run with numpy give scipy's result."""

import itertools

import numpy as np
import pytest
import scipy.linalg.blas as sblas

from blasx.runtime.rank_k_blocks import Rect, Tri, rank_k_tile_ops


def test_hand_computed():
    assert rank_k_tile_ops(8, 1, 4) == [Tri(0, 4), Rect(4, 0, 4, 4), Tri(4, 4)]
    assert rank_k_tile_ops(8, 0, 4) == [Tri(0, 4), Rect(0, 4, 4, 4), Tri(4, 4)]
    assert rank_k_tile_ops(10, 1, 2) == [
        Tri(0, 2), Rect(2, 0, 2, 2), Tri(2, 2), Rect(4, 0, 6, 4),
        Tri(4, 2), Rect(6, 4, 4, 2), Tri(6, 2), Rect(8, 6, 2, 2), Tri(8, 2)]
    assert rank_k_tile_ops(3, 1, 4) == [Tri(0, 3)] and rank_k_tile_ops(0, 1, 4) == []
    with pytest.raises(ValueError, match="leaf: got 0"):
        rank_k_tile_ops(8, 1, 0)


@pytest.mark.parametrize("n,leaf", [(1, 1), (7, 2), (16, 4), (13, 3), (9, 8)])
def test_blocks_cover_the_triangle_once(n, leaf):
    for lower in (0, 1):
        cover = np.zeros((n, n), int)
        for o in rank_k_tile_ops(n, lower, leaf):
            if type(o) is Tri:
                t = np.tril if lower else np.triu
                cover[o.d0:o.d0 + o.size, o.d0:o.d0 + o.size] += t(np.ones((o.size, o.size), int))
            else:
                cover[o.r0:o.r0 + o.rows, o.c0:o.c0 + o.cols] += 1
        want = np.tril(np.ones((n, n), int)) if lower else np.triu(np.ones((n, n), int))
        assert np.array_equal(cover, want)


def _run(ops, x, y, alpha, beta, c, lower, herm):
    """C's triangle = alpha x y^T (^H) + beta C, block by block, as a backend would."""
    t = (lambda v: v.conj().T) if herm else (lambda v: v.T)
    for o in ops:
        if type(o) is Tri:
            s = slice(o.d0, o.d0 + o.size)
            blk = alpha * x[s] @ t(y[s]) + beta * c[s, s]
            mask = np.tril(np.ones(blk.shape, bool)) if lower else np.triu(np.ones(blk.shape, bool))
            c[s, s][mask] = blk[mask]
        else:
            r, q = slice(o.r0, o.r0 + o.rows), slice(o.c0, o.c0 + o.cols)
            c[r, q] = alpha * x[r] @ t(y[q]) + beta * c[r, q]


@pytest.mark.parametrize("lower,herm", list(itertools.product((0, 1), (False, True))))
def test_ops_run_with_numpy_match_scipy(lower, herm):
    rng = np.random.default_rng(3)
    n, k, leaf = 23, 5, 4
    dt = np.complex128 if herm else np.float64
    a = (rng.standard_normal((n, k)) + (1j * rng.standard_normal((n, k)) if herm else 0)).astype(dt)
    c0 = (rng.standard_normal((n, n)) + (1j * rng.standard_normal((n, n)) if herm else 0)).astype(dt)
    if herm:
        c0 = c0 + c0.conj().T
    alpha, beta = 0.75, -0.5
    c = c0.copy(order="F")
    _run(rank_k_tile_ops(n, lower, leaf), a, a, alpha, beta, c, lower, herm)
    ref = (sblas.zherk if herm else sblas.dsyrk)(alpha, a, beta=beta, c=c0, lower=lower)
    mask = np.tril(np.ones((n, n), bool)) if lower else np.triu(np.ones((n, n), bool))
    if herm:  # herk keeps the diagonal real; our numpy stand-in computes it exactly real too
        np.fill_diagonal(c, c.diagonal().real)
    assert np.linalg.norm((c - ref)[mask]) <= 1e-13 * np.linalg.norm(ref[mask])
