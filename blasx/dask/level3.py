"""SYMM, HEMM, SYRK, HERK, SYR2K, HER2K, TRMM and TRSM on dask arrays (scipy.linalg.blas signatures).

The square operand's dimension is cut at the union of every operand's boundaries on it, so its
diagonal pieces are square: a diagonal piece is one call of the routine itself (symm, syrk, trmm,
trsm ... on the worker's engine) and every other piece one gemm on a piece of a or of its
transpose. The rank-k routines copy c's blocks of the triangle they do not write. TRSM's block
(i, j) depends on the solved blocks (k, j) before it; a right-side TRMM/TRSM is the left-side
one on the transposed problem.
"""

from __future__ import annotations

from .graph import Operand, as_dask, build, spans, union
from .routines import _blas_type, _c_init, _finish, _flag, _op, _scalar, _shape


def _empty(shape):
    return ("empty",) + tuple(shape)


# ---------------------------------------------------------------- SYMM / HEMM

def symm(alpha, a, b, beta=0.0, c=None, side=0, lower=0, overwrite_c=False, *, progress=False):
    """C = alpha a b + beta c (side 0) or alpha b a + beta c (side 1), a symmetric, its ``lower``
    (else upper) triangle read (scipy.linalg.blas.?symm)."""
    return _finish(_symm("symm", alpha, a, b, beta, c, side, lower), progress)


def hemm(alpha, a, b, beta=0.0, c=None, side=0, lower=0, overwrite_c=False, *, progress=False):
    """symm with a Hermitian a (scipy.linalg.blas.?hemm)."""
    return _finish(_symm("hemm", alpha, a, b, beta, c, side, lower), progress)


def _symm(routine, alpha, a, b, beta, c, side, lower):
    side, lower = _flag("side", side), _flag("lower", lower)
    a, b = as_dask("a", a), as_dask("b", b)
    c = as_dask("c", c) if c is not None else None
    dtype = _blas_type(a, b, c, hermitian=routine == "hemm")
    alpha, beta = _scalar("alpha", alpha, dtype), _scalar("beta", beta, dtype)
    n = b.shape[side]
    _shape("a", a, (n, n), f"a square matrix of b's {'columns' if side else 'rows'}")
    _shape("c", c, b.shape, "b's shape")
    A, B = Operand("a", a), Operand("b", b)
    C = Operand("c", c) if c is not None else None
    cb = (C.rows, C.cols) if C else ((), ())
    u = union(A.rows, A.cols, (B.rows, B.cols)[side], cb[side])
    o = union((B.rows, B.cols)[1 - side], cb[1 - side])
    us = [] if alpha == 0 else spans(u)
    herm = 2 if routine == "hemm" else 1

    def block(i, j, r, cc, bb, name):
        steps = []
        d = (r, i) if side == 0 else (cc, j)  # the interval of the square dimension, and its index
        for kk in us:
            if kk == d[0]:
                x = bb.piece(A, kk[0], kk[1], kk[0], kk[1])
                y = bb.piece(B, kk[0], kk[1], cc[0], cc[1]) if side == 0 else bb.piece(B, r[0], r[1], kk[0], kk[1])
                steps.append((routine, alpha, x, y, 1.0, side, lower))
                continue
            # the piece (d, kk) of a (side 0) or (kk, d) (side 1), from the stored triangle
            p, q = (d[0], kk) if side == 0 else (kk, d[0])
            stored = (p[0] > q[0]) == bool(lower)
            x, t = (bb.piece(A, p[0], p[1], q[0], q[1]), 0) if stored else (bb.piece(A, q[0], q[1], p[0], p[1]), herm)
            if side == 0:
                steps.append(("gemm", alpha, x, t, bb.piece(B, kk[0], kk[1], cc[0], cc[1]), 0, 1.0))
            else:
                steps.append(("gemm", alpha, bb.piece(B, r[0], r[1], kk[0], kk[1]), 0, x, t, 1.0))
        return _c_init(bb, C, r, cc, beta, beta != 0), steps

    rows, cols = (u, o) if side == 0 else (o, u)
    return build(routine, rows, cols, dtype, (A, B, C), block,
                 (alpha, beta, side, lower, a.name, b.name, c.name if c is not None else None))


# ---------------------------------------------------------------- SYRK / HERK / SYR2K / HER2K

def syrk(alpha, a, beta=0.0, c=None, trans=0, lower=0, overwrite_c=False, *, progress=False):
    """C = alpha op(a) op(a)^T + beta c on the ``lower`` (else upper) triangle (scipy's ?syrk)."""
    return _finish(_rank("syrk", alpha, a, None, beta, c, trans, lower), progress)


def herk(alpha, a, beta=0.0, c=None, trans=0, lower=0, overwrite_c=False, *, progress=False):
    """C = alpha op(a) op(a)^H + beta c, real alpha and beta, trans 0 or 2 (scipy's ?herk)."""
    return _finish(_rank("herk", alpha, a, None, beta, c, trans, lower), progress)


def syr2k(alpha, a, b, beta=0.0, c=None, trans=0, lower=0, overwrite_c=False, *, progress=False):
    """C = alpha (op(a) op(b)^T + op(b) op(a)^T) + beta c on one triangle (scipy's ?syr2k)."""
    return _finish(_rank("syr2k", alpha, a, b, beta, c, trans, lower), progress)


def her2k(alpha, a, b, beta=0.0, c=None, trans=0, lower=0, overwrite_c=False, *, progress=False):
    """C = alpha op(a) op(b)^H + conj(alpha) op(b) op(a)^H + beta c, real beta (scipy's ?her2k)."""
    return _finish(_rank("her2k", alpha, a, b, beta, c, trans, lower), progress)


def _rank(routine, alpha, a, b, beta, c, trans, lower):
    herm = routine.startswith("he")
    two = routine.endswith("2k")
    lower = _flag("lower", lower)
    a = as_dask("a", a)
    b = as_dask("b", b) if two else None
    c = as_dask("c", c) if c is not None else None
    dtype = _blas_type(a, b, c, hermitian=herm)
    allowed = (0, 2) if herm else (0, 1) if dtype.kind == "c" else (0, 1, 2)
    trans = _flag("trans", trans, allowed)
    alpha = _scalar("alpha", alpha, dtype, real=routine == "herk")
    beta = _scalar("beta", beta, dtype, real=herm)
    n = a.shape[0] if trans == 0 else a.shape[1]
    _shape("b", b, a.shape, "a's shape")
    _shape("c", c, (n, n), "square, op(a)'s rows")
    A = Operand("a", a)
    B = Operand("b", b) if two else None
    C = Operand("c", c) if c is not None else None
    ops = (A, B) if two else (A,)
    u = union(*[X.rows if trans == 0 else X.cols for X in ops], *([C.rows, C.cols] if C else []))
    ks = [] if alpha == 0 else spans(union(*[X.cols if trans == 0 else X.rows for X in ops]))
    t = (2 if herm else 1) if trans == 0 else 0  # the flag of the right-hand factor of a gemm
    ta = 0 if trans == 0 else (2 if herm else 1)
    alpha2 = alpha.conjugate() if herm and isinstance(alpha, complex) else alpha

    def block(i, j, r, cc, bb, name):
        if (i < j) if lower else (i > j):  # the triangle not written: c's values
            return _c_init(bb, C, r, cc, 1.0, True), []
        if i == j:
            steps, first = [], beta
            for kk in ks or [None]:
                x = _op(bb, A, trans, r, kk) if kk else _empty((r[1] - r[0], 0) if trans == 0 else (0, r[1] - r[0]))
                if two:
                    y = _op(bb, B, trans, r, kk) if kk else x
                    steps.append((routine, alpha, x, y, first, trans, lower))
                else:
                    steps.append((routine, alpha, x, first, trans, lower))
                first = 1.0
            return _c_init(bb, C, r, cc, 1.0, True), steps
        steps = []
        for kk in ks:
            steps.append(("gemm", alpha, _op(bb, A, trans, r, kk), ta, _op(bb, B if two else A, trans, cc, kk), t, 1.0))
            if two:
                steps.append(("gemm", alpha2, _op(bb, B, trans, r, kk), ta, _op(bb, A, trans, cc, kk), t, 1.0))
        return _c_init(bb, C, r, cc, beta, beta != 0), steps

    return build(routine, u, u, dtype, (A, B, C), block,
                 (alpha, beta, trans, lower, a.name, b.name if b is not None else None, c.name if c is not None else None))


# ---------------------------------------------------------------- TRMM / TRSM

def trmm(alpha, a, b, side=0, lower=0, trans_a=0, diag=0, overwrite_b=False, *, progress=False):
    """B = alpha op(a) b (side 0) or alpha b op(a) (side 1), a triangular (scipy's ?trmm)."""
    return _finish(_tri("trmm", alpha, a, b, side, lower, trans_a, diag), progress)


def trsm(alpha, a, b, side=0, lower=0, trans_a=0, diag=0, overwrite_b=False, *, progress=False):
    """X with op(a) X = alpha b (side 0) or X op(a) = alpha b (side 1), a triangular (scipy's ?trsm)."""
    return _finish(_tri("trsm", alpha, a, b, side, lower, trans_a, diag), progress)


def _tri(routine, alpha, a, b, side, lower, trans_a, diag):
    side, lower, diag = _flag("side", side), _flag("lower", lower), _flag("diag", diag)
    t = _flag("trans_a", trans_a, (0, 1, 2))
    a, b = as_dask("a", a), as_dask("b", b)
    dtype = _blas_type(a, b)
    alpha = _scalar("alpha", alpha, dtype)
    n = b.shape[side]
    _shape("a", a, (n, n), f"a square matrix of b's {'columns' if side else 'rows'}")
    if side == 0:
        return _tri_left(routine, alpha, a, b, lower, t, diag, dtype)
    # X op(a) = alpha b  <=>  op(a)^T X^T = alpha b^T; op(a)^T is a^T, a, or conj(a) (= conj of the left form)
    if t == 2 and dtype.kind == "c":
        x = _tri_left(routine, alpha.conjugate(), a, b.conj().T, lower, 0, diag, dtype)
        return x.conj().T
    return _tri_left(routine, alpha, a, b.T, lower, 1 if t == 0 else 0, diag, dtype).T


def _tri_left(routine, alpha, a, b, lower, t, diag, dtype):
    A, B = Operand("a", a), Operand("b", b)
    u = union(A.rows, A.cols, B.rows)
    us = spans(u)
    eff_lower = bool(lower) == (t == 0)  # op(a) is lower triangular

    def before(k, i):  # op(a)'s piece (i, k) off the diagonal is nonzero
        return k < i if eff_lower else k > i

    def block(i, j, r, cc, bb, name):
        if alpha == 0:
            return ("zeros",), []
        diag_piece = bb.piece(A, r[0], r[1], r[0], r[1])
        if routine == "trmm":
            steps = [("gemm", alpha, _op(bb, A, t, r, kk), t, bb.piece(B, kk[0], kk[1], cc[0], cc[1]), 0, 1.0)
                     for k, kk in enumerate(us) if before(k, i)]
            steps.append(("trmm", alpha, diag_piece, bb.piece(B, r[0], r[1], cc[0], cc[1]), lower, t, diag))
            return ("zeros",), steps
        X = Operand.output(name, u, union(B.cols), dtype)
        steps = [("gemm", -1.0, _op(bb, A, t, r, kk), t, bb.piece(X, kk[0], kk[1], cc[0], cc[1]), 0, 1.0)
                 for k, kk in enumerate(us) if before(k, i)]
        steps.append(("trsm", diag_piece, lower, t, diag))
        return ("copy", bb.piece(B, r[0], r[1], cc[0], cc[1]), alpha), steps

    return build(routine, u, union(B.cols), dtype, (A, B), block, (alpha, lower, t, diag, a.name, b.name))
