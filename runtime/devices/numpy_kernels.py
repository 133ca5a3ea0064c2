"""Tile kernels on numpy views, shared by the ``sim`` and ``cpu`` backends: the tile-kernel contract
the CUDA backend mirrors with cuBLAS (named in each docstring).

Each kernel updates the C tile in place from tiles ``a`` and ``b`` with the call's scalars (BLAS
rules: ``beta == 0`` overwrites C unread). Op codes 0 N, 1 T, 2 C apply to the tile as stored;
``uplo`` 1 = lower, ``side`` 0 = left, ``diag`` 1 = unit. Only the triangle a kernel reads or writes
is touched, so NaNs elsewhere neither leak in nor get overwritten. Mixed calls (half, bfloat16,
int8 A and B) take the product in float32, or exactly in float64 for int8, into C's accumulation
type; TF32 math first rounds float32 A and B to 10 mantissa bits. gemm's product warns as numpy's
matmul does in the thread running it (the cpu device's: the caller's; a sim's stream threads ignore them, as
GPUs); every other kernel runs under ``np.errstate(all="ignore")``, as BLAS reports no floating-point
exceptions.
"""

from __future__ import annotations

import functools

import numpy as np
from scipy.linalg import blas as _blas
from scipy.linalg.lapack import get_lapack_funcs

OPS = (lambda x: x, lambda x: x.T, lambda x: x.conj().T)  # indexed by op code N, T, C


def _quiet(kernel):
    """``kernel`` with numpy's floating-point warnings off (a BLAS routine signals none)."""
    @functools.wraps(kernel)
    def run(*args, **kwargs):
        with np.errstate(all="ignore"):
            return kernel(*args, **kwargs)
    return run


def _accumulate(c, prod, alpha, beta) -> None:
    """c = alpha prod + beta c in place (``prod`` is a temporary it may scale); beta 0: C not read."""
    if alpha != 1:
        prod *= alpha
    if beta == 0:
        c[...] = prod
    else:
        if beta != 1:
            c *= beta
        c += prod


def gemm(step, scalars, a, b, c) -> None:
    """c = alpha op_a(a) op_b(b) + beta c in place."""
    op_a, op_b, alpha, beta = step.op_a, step.op_b, scalars[step.alpha], scalars[step.beta]
    if a.dtype != c.dtype:
        # Inputs narrower than C: the product, alpha and beta in float32 (float64 for integers: exact),
        # stored once to C's type.
        wide = np.float64 if a.dtype.kind in "iu" else np.float32
        with np.errstate(all="ignore"):  # (the host BLAS's kernels flag lanes no result reads; GPUs raise none)
            prod = OPS[op_a](a).astype(wide) @ OPS[op_b](b).astype(wide)
        if c.dtype.kind in "iu":  # int32 arithmetic: the (exact) float64 sum times alpha, plus beta c, in int64,
            prod = prod.astype(np.int64) * np.int64(alpha)  # wrapping past int32's range as cuBLAS's does
            if beta != 0:
                prod += np.int64(beta) * c.astype(np.int64)
            c[...] = (prod + 2 ** 31) % 2 ** 32 - 2 ** 31
            return
        with np.errstate(all="ignore"):
            if alpha != 1:
                prod *= wide(alpha)
            if beta != 0:
                prod += wide(beta) * c.astype(wide)
        c[...] = prod
        return
    if beta == 0:  # straight into c: no temporary the size of C
        np.matmul(OPS[op_a](a), OPS[op_b](b), out=c)
        if alpha != 1:
            with np.errstate(all="ignore"):
                c *= alpha
        return
    prod = OPS[op_a](a) @ OPS[op_b](b)
    with np.errstate(all="ignore"):
        _accumulate(c, prod, alpha, beta)


def to_tf32(x):
    """float32 ``x`` rounded to TF32 (10 mantissa bits, nearest, ties away from zero), as
    tensor cores read it; inf and NaN unchanged."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(np.isfinite(x), rounded, x).reshape(np.shape(x))


def gemm_tf32(step, scalars, a, b, c) -> None:
    """gemm under TF32 math: A and B rounded to TF32, products accumulated in float32."""
    gemm(step, scalars, to_tf32(a), to_tf32(b), c)


def round_into(dst, src) -> int:
    """``dst[...] = src``, rounding to ``dst``'s type (a mixed call's write-back); returns the
    float16 overflows: results that became inf from a finite ``src`` (inf and NaN already in
    ``src`` are propagated values, not counted)."""
    with np.errstate(over="ignore", invalid="ignore"):
        dst[...] = src
    if dst.dtype != np.float16 or src.dtype == np.float16:
        return 0
    inf = np.isinf(dst)
    return int(np.count_nonzero(inf & np.isfinite(src))) if inf.any() else 0


def scale(step, scalars, a, b, c) -> None:
    scale_views(c, scalars[step.beta])


@_quiet
def scale_views(c, beta) -> None:
    """c = beta c in place; beta 0: c is not read (NaNs do not survive); beta 1: c is left as it is."""
    if beta == 0:
        c[...] = 0
    elif beta != 1:
        c *= beta


@_quiet
def axpby(step, scalars, a, b, c) -> None:
    """c += beta * b: folds the old C tile (b) into a product computed with beta = 0 (beta 1: b itself, not
    1 * b, which turns a complex infinity into inf+nanj)."""
    beta = scalars[step.beta]
    c += b if beta == 1 else beta * b


@_quiet
def add(step, scalars, a, b, c) -> None:
    """c = alpha a + beta c in c's type (split-k's reduction: a is a partial sum); beta 0: c not
    read; b is not used. (cuBLAS geam, in place on c; int32 tiles: a CuPy kernel)"""
    alpha, beta = scalars[step.alpha], scalars[step.beta]
    if beta == 0:
        c[...] = a
        if alpha != 1:
            c *= alpha
        return
    if beta != 1:
        c *= beta
    c += a if alpha == 1 else alpha * a


# ---------------------------------------------------------------- rank-k updates (diagonal tiles)

def _rank(step, c, a, b, alpha, alpha2, beta, herm: bool) -> None:
    """c = alpha op(a) op(b)^T (+ alpha2 op(b) op(a)^T when b is given) + beta c on the ``uplo`` triangle
    of the square c (beta == 0: c not read); ``herm``: ^H, and the diagonal's imaginary part set to 0.
    k == 0 (a is None): c_tri = beta c_tri."""
    if step.k == 0 or a is None:
        prod = np.zeros_like(c)
    else:
        x = OPS[step.op_a](a)
        y = x if b is None else OPS[step.op_a](b)
        t = (lambda z: z.conj().T) if herm else (lambda z: z.T)
        prod = x @ t(y)
        prod *= alpha
        if b is not None:
            prod += alpha2 * (y @ t(x))
    idx = np.tril_indices(c.shape[0]) if step.uplo else np.triu_indices(c.shape[0])
    if herm and beta != 0:  # the diagonal's imaginary part is not read (BLAS: assumed zero)
        d = np.arange(c.shape[0])
        c[d, d] = c[d, d].real
    if beta == 0:
        c[idx] = prod[idx]
    elif beta == 1:  # (not scaled: 1 * (inf + 0j) is inf + nanj)
        c[idx] = c[idx] + prod[idx]
    else:
        c[idx] = beta * c[idx] + prod[idx]
    if herm:
        d = np.arange(c.shape[0])
        c[d, d] = c[d, d].real


@_quiet
def syrk(step, scalars, a, b, c) -> None:
    """c = alpha op(a) op(a)^T + beta c on the uplo triangle; op_a in {N, T}; n = step.n, k = step.k.
    k == 0 (a is None): c_tri = beta c_tri. (cublasXsyrk(uplo, trans=op_a, n, k, alpha, a, lda, beta, c, ldc))"""
    _rank(step, c, a, None, scalars[step.alpha], 0, scalars[step.beta], False)


@_quiet
def herk(step, scalars, a, b, c) -> None:
    """c = alpha op(a) op(a)^H + beta c on the uplo triangle, op_a in {N, C}, alpha and beta
    real (the real parts of the scalars); the diagonal's imaginary part is set to 0.
    k == 0 (a is None): c_tri = beta c_tri, imaginary diagonal zeroed. (cublasXherk)"""
    _rank(step, c, a, None, scalars[step.alpha].real, 0, scalars[step.beta].real, True)


@_quiet
def syr2k(step, scalars, a, b, c) -> None:
    """c = alpha op(a) op(b)^T + alpha op(b) op(a)^T + beta c on the uplo triangle, op_a in {N, T}
    (for both a and b). k == 0: c_tri = beta c_tri.
    (cublasXsyr2k(uplo, trans=op_a, n, k, alpha, a, lda, b, ldb, beta, c, ldc))"""
    alpha = scalars[step.alpha]
    _rank(step, c, a, b, alpha, alpha, scalars[step.beta], False)


@_quiet
def her2k(step, scalars, a, b, c) -> None:
    """c = alpha op(a) op(b)^H + conj(alpha) op(b) op(a)^H + beta c on the uplo triangle, op_a in
    {N, C}, beta real; the diagonal's imaginary part is set to 0. k == 0: c_tri = beta c_tri.
    (cublasXher2k)"""
    alpha = scalars[step.alpha]
    _rank(step, c, a, b, alpha, np.conj(alpha), scalars[step.beta].real, True)


# ---------------------------------------------------------------- symmetric / Hermitian multiply

def _symm(step, scalars, a, b, c, hermitian: bool) -> None:
    """symm/hemm with S the symmetric (Hermitian) matrix of the uplo triangle of the square a; the other
    triangle is not read, nor (Hermitian) the diagonal's imaginary part (BLAS: assumed 0)."""
    strict = np.tril(a, -1) if step.uplo else np.triu(a, 1)
    s = (np.tril(a) if step.uplo else np.triu(a)) + (strict.conj().T if hermitian else strict.T)
    if hermitian:
        np.fill_diagonal(s, a.diagonal().real)
    _accumulate(c, s @ b if step.side == 0 else b @ s, scalars[step.alpha], scalars[step.beta])


@_quiet
def symm(step, scalars, a, b, c) -> None:
    """side 0: c = alpha S b + beta c; side 1: c = alpha b S + beta c; S symmetric, defined by the
    uplo triangle of the square a; m = step.m, n = step.n are c's dims.
    (cublasXsymm(side, uplo, m, n, alpha, a, lda, b, ldb, beta, c, ldc))"""
    _symm(step, scalars, a, b, c, False)


@_quiet
def hemm(step, scalars, a, b, c) -> None:
    """As ``symm`` with S Hermitian (the imaginary part of a's diagonal is not read). (cublasXhemm)"""
    _symm(step, scalars, a, b, c, True)


# ---------------------------------------------------------------- triangular multiply / solve

def _tri_product(step, scalars, a, x):
    """alpha op(T) x (side 0) or alpha x op(T) (side 1), a new array; T the uplo triangle of the square a
    (unit diagonal, a's not read, if diag)."""
    if step.diag:
        t = np.tril(a, -1) if step.uplo else np.triu(a, 1)
        np.fill_diagonal(t, 1)
    else:
        t = np.tril(a) if step.uplo else np.triu(a)
    t = OPS[step.op_a](t)
    prod = t @ x if step.side == 0 else x @ t
    prod *= scalars[step.alpha]
    return prod


@_quiet
def trmm(step, scalars, a, b, c) -> None:
    """side 0: c = alpha op(T) b; side 1: c = alpha b op(T); T the uplo triangle of a (unit
    diagonal if diag). Overwrites c: no beta, c not read.
    (cublasXtrmm(side, uplo, trans=op_a, diag, m, n, alpha, a, lda, b, ldb, c, ldc), out of place)"""
    c[...] = _tri_product(step, scalars, a, b)


_trsm_of = functools.cache(lambda dtype: _blas.get_blas_funcs("trsm", dtype=dtype))  # scipy's, per dtype


@_quiet
def trsm(step, scalars, a, b, c) -> None:
    """side 0: c = alpha op(T)^-1 c; side 1: c = alpha c op(T)^-1, in place; T the uplo triangle
    of a (unit diagonal if diag); b is not used. No singularity check (BLAS semantics).
    (cublasXtrsm(side, uplo, trans=op_a, diag, m, n, alpha, a, lda, c, ldc))"""
    res = _trsm_of(c.dtype)(scalars[step.alpha], a, c, side=step.side, lower=step.uplo, trans_a=step.op_a,
                            diag=step.diag, overwrite_b=1)
    if res is not c:
        c[...] = res


@_quiet
def invmm(step, scalars, a, b, c, out=None) -> None:
    """side 0: c = alpha op(T) c; side 1: c = alpha c op(T), in place, or into ``out`` (c then
    only read); T the uplo triangle of a (unit diagonal if diag), here a diagonal block's inverse
    made by ``trtri``; b is not used. (cublasXtrmm out of place: into ``out``, or into a scratch
    tile copied back)"""
    (c if out is None else out)[...] = _tri_product(step, scalars, a, c)


_trtri_of = functools.cache(lambda dtype: get_lapack_funcs("trtri", dtype=dtype))  # LAPACK's, per dtype


@_quiet
def trtri(step, scalars, a, b, c) -> None:
    """Replace the uplo triangle of the square c by its inverse (unit diagonal, not read or
    written, if diag); the other triangle is left as it is. a and b are not used. No
    singularity check (as trsm): a zero pivot gives inf / NaN (LAPACK ?trtri stops there, leaving the block; then
    the inverse is solved for), spreading over the block's rows further than a direct solve's may. (LAPACK ?trtri; on GPUs runtime.devices.cuda_kernels.invert_triangle)"""
    inv, info = _trtri_of(c.dtype)(c, lower=step.uplo, unitdiag=step.diag)
    if info > 0:  # singular: T^-1 = T \ I, dividing by the zero pivot
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            inv = _trsm_of(c.dtype)(1.0, c, np.eye(c.shape[0], dtype=c.dtype), lower=step.uplo, diag=step.diag)
    keep = np.tril(np.ones(c.shape, dtype=bool), -1 if step.diag else 0)
    if not step.uplo:
        keep = keep.T
    c[keep] = inv[keep]


KERNELS = {"gemm": gemm, "scale": scale, "axpby": axpby, "add": add,
           "syrk": syrk, "herk": herk, "syr2k": syr2k, "her2k": her2k,
           "symm": symm, "hemm": hemm, "trmm": trmm, "trsm": trsm,
           "invmm": invmm, "trtri": trtri}


def kernel_for(step, call, kernels=KERNELS):
    """The tile kernel of ``kernels`` that runs ``step`` of ``call`` (TF32 math runs gemm as
    ``gemm_tf32``), None if there is none."""
    if step.kernel == "gemm" and call.math == "tf32":
        return gemm_tf32
    return kernels.get(step.kernel)
