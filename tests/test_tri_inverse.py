"""In-place inversion of a triangular tile (runtime/tri_inverse.py): its ops, run with numpy/scipy
as the cuda backend runs them with cuBLAS, give the inverse of the stored triangle for every
triangle, diagonal, dtype and split, read nothing outside it; plus exact op lists."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import scipy.linalg.blas as sb

from blasx.runtime.tri_inverse import Leaf, Product, tri_inverse_ops


def run_ops(ops, w, lower, diag):
    """Execute the ops on w in place: leaves by a solve against the identity (cuBLAS trsm),
    products by scipy's trmm with alpha +-1 (in place, as cuBLAS trmm with C = B)."""
    trsm = sb.get_blas_funcs("trsm", dtype=w.dtype)
    trmm = sb.get_blas_funcs("trmm", dtype=w.dtype)
    for o in ops:
        if isinstance(o, Leaf):
            blk = w[o.d0:o.d0 + o.size, o.d0:o.d0 + o.size]
            inv = trsm(1.0, blk, np.eye(o.size, dtype=w.dtype, order="F"), lower=lower, diag=diag)
            tri = np.tril_indices(o.size) if lower else np.triu_indices(o.size)
            blk[tri] = inv[tri]
        else:
            a = w[o.a0:o.a0 + o.a_size, o.a0:o.a0 + o.a_size]
            r0, c0, rows, cols = o.blk
            b = w[r0:r0 + rows, c0:c0 + cols]
            b[...] = trmm(-1.0 if o.negate else 1.0, a, b, side=o.side, lower=lower, diag=diag)


def triangle(a, lower, diag):
    t = np.tril(a) if lower else np.triu(a)
    if diag:
        np.fill_diagonal(t, 1)
    return t


@pytest.mark.parametrize("dtype", [np.float64, np.complex128, np.float32])
@pytest.mark.parametrize("lower,diag,size,leaf", list(itertools.product((0, 1), (0, 1), (1, 7, 37, 64), (1, 4, 16))))
def test_inverse_of_the_stored_triangle(dtype, lower, diag, size, leaf):
    rng = np.random.default_rng(size * 10 + leaf + lower * 1000 + diag * 7)
    a = rng.standard_normal((size, size)) / size + 2 * np.eye(size)
    if np.dtype(dtype).kind == "c":
        a = a + 1j * rng.standard_normal((size, size)) / size
    a = np.asfortranarray(a.astype(dtype))
    w = a.copy(order="F")
    run_ops(tri_inverse_ops(size, lower, leaf), w, lower, diag)
    want = np.linalg.inv(triangle(a.astype(np.complex128), lower, diag))
    got = triangle(w.astype(np.complex128), lower, diag)
    tol = 1e-5 if dtype in (np.float32, np.complex64) else 1e-12
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol
    # the other strict triangle is not read: garbage there changes nothing
    other = np.triu_indices(size, 1) if lower else np.tril_indices(size, -1)
    w2 = a.copy(order="F")
    w2[other] = np.nan
    if diag:
        np.fill_diagonal(w2, np.nan)
    run_ops(tri_inverse_ops(size, lower, leaf), w2, lower, diag)
    assert np.array_equal(triangle(w2, lower, diag), triangle(w, lower, diag))


def test_exact_ops_lower_and_upper():
    assert tri_inverse_ops(8, 1, 4) == [Leaf(0, 4), Product(1, 0, 4, (4, 0, 4, 4), False),
                                        Leaf(4, 4), Product(0, 4, 4, (4, 0, 4, 4), True)]
    assert tri_inverse_ops(8, 0, 4) == [Leaf(0, 4), Product(0, 0, 4, (0, 4, 4, 4), True),
                                        Leaf(4, 4), Product(1, 4, 4, (0, 4, 4, 4), False)]
    # splits at a multiple of the leaf where the size allows; the middle otherwise
    assert [o for o in tri_inverse_ops(12, 1, 4) if isinstance(o, Leaf)] == [Leaf(0, 4), Leaf(4, 4), Leaf(8, 4)]
    assert tri_inverse_ops(3, 1, 1)[0] == Leaf(0, 1)
    assert tri_inverse_ops(5, 0, 8) == [Leaf(0, 5)] and tri_inverse_ops(0, 0, 8) == []


@pytest.mark.parametrize("bad", [{"leaf": 0}, {"size": -1}])
def test_bad_arguments_name_the_parameter(bad):
    args = {"size": 8, "lower": 1, "leaf": 4, **bad}
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        tri_inverse_ops(**args)
