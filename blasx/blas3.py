"""SYMM, HEMM, SYRK, HERK, SYR2K, HER2K, TRMM and TRSM with scipy.linalg.blas semantics, through :mod:`blasx.dispatch`.

The generic functions pick the BLAS type as scipy's find_best_blas_type (the Hermitian routines: the
complex type of the same precision), the prefixed ones (``dsyrk``, ...) cast every array to theirs;
the rest is as docs/usage.md says. Input errors name the parameter, the value and what is allowed,
before anything is written.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .checks import (aligned, check_matrix, check_no_alias, check_scalar, check_trans, compute_dtype, finite_scalar,
                     same_place, writable)
from . import dispatch, session, shortcut
from .dispatch import array_module, as_operand, written
from .operands import canonical, column_major_view, is_cupy
from .runtime import dtypes, hostmem, hostpool
from .runtime.plans import inverse_shape, plan_symm, plan_syr2k, plan_syrk, plan_trmm, plan_trsm
from .runtime.tiling import OP_C, OP_N, OP_T


# ---------------------------------------------------------------- checks

def check_flag(name: str, value, meaning: tuple[str, str]) -> int:
    """A 0/1 flag (bools allowed): side, lower, diag, overwrite_c / overwrite_b (a truthy string or 2 refused:
    it would write the caller's array where it was not asked to)."""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if not isinstance(value, numbers.Integral) or int(value) not in (0, 1):
        raise ValueError(f"{name}: got {value!r}, allowed: 0 ({meaning[0]}) or 1 ({meaning[1]})")
    return int(value)


SIDE = ("left: op(a) on the left of b", "right: b on the left of op(a)")
LOWER = ("upper triangle of a is used", "lower triangle is used")
LOWER_C = ("upper triangle of c is written", "lower triangle is written")
DIAG = ("non-unit diagonal, read from a", "unit diagonal, a's diagonal is not read")
OVERWRITE = ("a new array is returned", "written in place where it can be")


def _check_real(name: str, value, routine: str):
    """HERK's alpha and beta, HER2K's beta: real numbers (a complex with zero imaginary part is fine)."""
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        if value.imag != 0:
            raise TypeError(f"{name}: got complex {value!r}; {routine} takes a real {name}")
        value = value.real
    return value


def _dtype(forced, *arrays) -> np.dtype:
    return forced if forced is not None else compute_dtype(*[x for x in arrays if x is not None])


def _check_shape(name: str, x, shape: tuple[int, int], why) -> None:
    """``why``: the rule, or a function that words it (called only on error)."""
    if tuple(x.shape) != shape:
        raise ValueError(f"{name}: got shape {tuple(x.shape)}, expected {shape} ({why if type(why) is str else why()})")


# ---------------------------------------------------------------- operands and outputs

def written_in_place(x, dtype, overwrite) -> bool:
    """f2py's rule: x is written in place when asked to, if it is F-contiguous, aligned, writable, of ``dtype``."""
    return (x is not None and bool(overwrite) and x.dtype == dtype and x.flags.f_contiguous and aligned(x)
            and writable(x))


def new_array(xp, shape, dtype, like, zeros=False, order="F"):
    """A new array (F-ordered unless asked; on ``like``'s device for cupy). A large numpy result of
    an engine with GPUs is page-locked memory from the result pool (runtime/hostpool.py): its
    write-back needs no locking of fresh pages."""
    make = xp.zeros if zeros else xp.empty
    if xp is np:
        if (math.prod(shape) * np.dtype(dtype).itemsize >= hostmem.MIN_REGISTER_BYTES and session.on_cuda()
                and (out := hostpool.POOL.array(shape, dtype, order, zeros)) is not None):
            return out
    elif like is not None and is_cupy(like):
        with like.device:
            return make(shape, dtype=dtype, order=order)
    return make(shape, dtype=dtype, order=order)


def _output_c(c, dtype, shape, overwrite_c, keep_other, xp, like, **inputs):
    """The c the routine writes: c itself (overwrite_c, F-contiguous, right dtype; aliasing none
    of ``inputs``), else a new F-ordered array holding c's values where they survive
    (``keep_other``: the whole of c, for triangle-only routines or beta != 0), or zeros when c is None."""
    if written_in_place(c, dtype, overwrite_c):
        check_no_alias("c", c, **inputs)
        return c
    if c is None:
        return new_array(xp, shape, dtype, like, zeros=True)
    out = new_array(xp, shape, dtype, like)
    if keep_other:
        dispatch.fill_from(out, c)
    return out


def _f_view(x, xp, dtype=None):
    """x (of ``dtype``, if given) as a column-major, non-transposed view: x itself when it is
    one, else one F-ordered copy (converted and reordered at once)."""
    if dtype is not None and x.dtype != dtype:
        return x.astype(dtype, order="F")
    cm = column_major_view(x)
    return x if cm is not None and not cm[1] else xp.asfortranarray(x)


def _tri_view(a, op: int, lower: int):
    """(V, op', lower'): op'(V) == op(a), V column-major, lower' the triangle of V holding a's."""
    cm = column_major_view(a)
    v, op2 = canonical(a, op, False, cm)  # (an a of other strides: an F copy)
    # a C-ordered a is V^T (or conj(V^T) materialised): its lower triangle is V's upper one.
    return v, op2, (1 - lower) if cm is not None and cm[1] else lower


def _rank_view(x, trans: int, allowed: tuple[int, ...], xp):
    """(V, op) with op(V) == op_trans(x) and op in ``allowed``; falls back to an F copy."""
    v, op = canonical(x, trans, False)
    return (v, op) if op in allowed else (_f_view(x, xp), trans)


# ---------------------------------------------------------------- SYMM / HEMM

@dispatch.front_end
def _symm(alpha, a, b, beta, c, side, lower, overwrite_c, *, hermitian, name, dtype=None):
    overwrite_c = check_flag("overwrite_c", overwrite_c, OVERWRITE)
    check_matrix("a", a)
    check_matrix("b", b)
    if c is not None:
        check_matrix("c", c)
    on_gpu = same_place(a=a, b=b, c=c)
    side = check_flag("side", side, SIDE)
    lower = check_flag("lower", lower, LOWER)
    dtype = _dtype(dtype, a, b, c)
    if hermitian:
        dtype = dtypes.BY_DTYPE[dtype].complex
    alpha = check_scalar("alpha", alpha, dtype)
    beta = check_scalar("beta", beta, dtype)
    m, n = b.shape
    s_dim = m if side == 0 else n
    which = "hermitian" if hermitian else "symmetric"  # (named in a shape error)
    _check_shape("a", a, (s_dim, s_dim),
                 lambda: f"the square {which} factor: with side={side} it has b's "
                         f"{'rows' if side == 0 else 'columns'}, b.shape={tuple(b.shape)}")
    if c is not None:
        _check_shape("c", c, (m, n), "c has b's shape")
    xp = array_module(on_gpu)
    if c is None and finite_scalar(beta):  # (f2py's c is zeros: an inf or NaN beta makes the result NaN)
        beta = 0
    out = _output_c(c, dtype, (m, n), overwrite_c, beta != 0, xp, a, a=a, b=b)
    if m == 0 or n == 0 or (alpha == 0 and beta == 1):
        return out
    a = as_operand(a, dtype)
    cm = column_major_view(a)
    if cm is not None and cm[1] and not hermitian:
        va, lower = a.T, 1 - lower  # a = V^T and S = S^T: V's other triangle defines the same S
    else:
        va = _f_view(a, xp)  # (a Hermitian S from a C-ordered a would need a conjugate copy anyway)
    vb = _f_view(b, xp, dtype)
    is_complex = dtype.kind == "c"
    routine = "hemm" if hermitian else "symm"
    with dispatch.whole(out is c):
        dispatch.run(name, [va, vb, out],
            lambda tile, block: plan_symm(m, n, tile, side, lower, hermitian=hermitian, alpha_zero=(alpha == 0),
                                          beta_zero=(beta == 0), is_complex=is_complex, block=block),
            dtype, alpha, beta, (m, n, s_dim),
            host=lambda: written(out, dispatch.blas_routine(routine, dtype)(alpha, va, vb, beta, out, side, lower, 1)),
            flops=2.0 * m * n * s_dim if alpha != 0 else float(m * n))
    return out


def symm(alpha, a, b, beta=0.0, c=None, side=0, lower=0, overwrite_c=False):
    """c = alpha S b + beta c (side=0) or alpha b S + beta c (side=1), as scipy.linalg.blas.?symm.

    S is the symmetric matrix defined by the ``lower`` (else upper) triangle of the square a (m x m
    for side 0, n x n for side 1, b and c being m x n); the other triangle of a is not read.
    """
    if (res := _plain("symm", a, alpha, a, b, beta, c, side, lower, overwrite_c)) is not shortcut.NO:
        return res
    return _symm(alpha, a, b, beta, c, side, lower, overwrite_c, hermitian=False, name="symm")


def hemm(alpha, a, b, beta=0.0, c=None, side=0, lower=0, overwrite_c=False):
    """As :func:`symm` with S Hermitian (scipy.linalg.blas.?hemm): the other triangle of a and
    the imaginary part of its diagonal are not read."""
    if (res := _plain("hemm", a, alpha, a, b, beta, c, side, lower, overwrite_c)) is not shortcut.NO:
        return res
    return _symm(alpha, a, b, beta, c, side, lower, overwrite_c, hermitian=True, name="hemm")


# ---------------------------------------------------------------- SYRK / HERK / SYR2K / HER2K

def _check_rank_trans(trans, dtype, hermitian: bool, routine: str) -> int:
    if hermitian:
        if not isinstance(trans, (numbers.Integral, np.bool_)) or int(trans) not in (0, 2):  # (a bool as 0 / 1)
            raise ValueError(f"trans: got {trans!r}; {routine} allows 0 (N: op(a) = a) or 2 (C: op(a) = a^H); "
                             f"1 (T) is not a Hermitian update")
        return int(trans)
    trans = check_trans("trans", trans)
    if dtype.kind == "c" and trans == 2:
        raise ValueError(f"trans: got 2 (C) for complex {routine}; allowed: 0 (N) or 1 (T) "
                         f"(the conjugate transpose update is her{routine[3:]})")
    return 1 if trans == 2 else trans  # real: C is T


@dispatch.front_end
def _rank(alpha, a, b, beta, c, trans, lower, overwrite_c, *, hermitian, two, name, dtype=None):
    overwrite_c = check_flag("overwrite_c", overwrite_c, OVERWRITE)
    check_matrix("a", a)
    if two:
        check_matrix("b", b)
    if c is not None:
        check_matrix("c", c)
    on_gpu = same_place(a=a, b=b, c=c)
    lower = check_flag("lower", lower, LOWER_C)
    dtype = _dtype(dtype, a, b, c)
    if hermitian:
        dtype = dtypes.BY_DTYPE[dtype].complex
    routine = ("her2k" if two else "herk") if hermitian else ("syr2k" if two else "syrk")
    trans = _check_rank_trans(trans, dtype, hermitian, routine)
    if hermitian and not two:
        alpha = _check_real("alpha", alpha, routine)
    alpha = check_scalar("alpha", alpha, dtype)
    if hermitian:
        beta = _check_real("beta", beta, routine)
    beta = check_scalar("beta", beta, dtype)
    n, k = a.shape if trans == OP_N else a.shape[::-1]
    if two and tuple(b.shape) != tuple(a.shape):
        raise ValueError(f"b: got shape {tuple(b.shape)}, expected {tuple(a.shape)} (the shape of a)")
    if c is not None:
        _check_shape("c", c, (n, n), lambda: f"n x n with n = rows of op(a), a.shape={tuple(a.shape)}, trans={trans}")
    xp = array_module(on_gpu)
    if c is None and finite_scalar(beta):  # (f2py's c is zeros: an inf or NaN beta makes the result NaN)
        beta = 0
    out = _output_c(c, dtype, (n, n), overwrite_c, True, xp, a, a=a, b=b)
    if n == 0 or ((alpha == 0 or k == 0) and beta == 1):
        return out  # BLAS quick return: c untouched (also HERK's imaginary diagonal)
    if k == 0:  # only beta C: an n x 0 operand in op N (a 0 x n one gives BLAS a leading dimension of 0)
        a = b = xp.zeros((n, 0), dtype=dtype, order="F")
        trans = OP_N
    a = as_operand(a, dtype)
    allowed = (OP_N, OP_C) if hermitian else (OP_N, OP_T)
    va, op = _rank_view(a, trans, allowed, xp)
    views = [va]
    if two:
        b = as_operand(b, dtype)
        vb, op_b = _rank_view(b, trans, allowed, xp)
        if op_b != op:  # a and b in different layouts: one op for both, through F views
            va, op, vb = _f_view(a, xp), trans, _f_view(b, xp)
            views = [va]
        views.append(vb)
    views.append(out)
    planner = plan_syr2k if two else plan_syrk
    is_complex = dtype.kind == "c"
    flops = (2.0 if two else 1.0) * n * (n + 1.0) * k if alpha != 0 else 0.0
    with dispatch.whole(out is c):
        dispatch.run(name, views,
            lambda tile, block: planner(n, k, tile, op, lower, hermitian=hermitian, alpha_zero=(alpha == 0),
                                        beta_zero=(beta == 0), is_complex=is_complex, block=block),
            dtype, alpha, beta, (n, n, k),
            host=lambda: written(out, dispatch.blas_routine(routine, dtype)(alpha, *views[:-1], beta, out, op, lower, 1)),
            flops=flops)
    return out


def syrk(alpha, a, beta=0.0, c=None, trans=0, lower=0, overwrite_c=False):
    """c = alpha op(a) op(a)^T + beta c on the ``lower`` (else upper) triangle, as scipy.linalg.blas.?syrk.

    op(a) = a (trans=0) or a^T (trans=1; 2 means 1 for real types and is an error for complex ones).
    The other triangle of c keeps its values (zeros if c is None).
    """
    if (res := _plain("syrk", a, alpha, a, beta, c, trans, lower, overwrite_c)) is not shortcut.NO:
        return res
    return _rank(alpha, a, None, beta, c, trans, lower, overwrite_c, hermitian=False, two=False, name="syrk")


def herk(alpha, a, beta=0.0, c=None, trans=0, lower=0, overwrite_c=False):
    """c = alpha op(a) op(a)^H + beta c on the ``lower`` (else upper) triangle, as scipy.linalg.blas.?herk.

    alpha and beta are real; trans is 0 (op(a) = a) or 2 (op(a) = a^H), 1 raises ValueError. The
    diagonal's imaginary part is set to 0 (unless alpha == 0 and beta == 1: c is untouched, as in BLAS).
    """
    if (res := _plain("herk", a, alpha, a, beta, c, trans, lower, overwrite_c)) is not shortcut.NO:
        return res
    return _rank(alpha, a, None, beta, c, trans, lower, overwrite_c, hermitian=True, two=False, name="herk")


def syr2k(alpha, a, b, beta=0.0, c=None, trans=0, lower=0, overwrite_c=False):
    """c = alpha op(a) op(b)^T + alpha op(b) op(a)^T + beta c on the ``lower`` (else upper)
    triangle, as scipy.linalg.blas.?syr2k (a and b have the same shape; trans as for :func:`syrk`)."""
    if (res := _plain("syr2k", a, alpha, a, b, beta, c, trans, lower, overwrite_c)) is not shortcut.NO:
        return res
    return _rank(alpha, a, b, beta, c, trans, lower, overwrite_c, hermitian=False, two=True, name="syr2k")


def her2k(alpha, a, b, beta=0.0, c=None, trans=0, lower=0, overwrite_c=False):
    """c = alpha op(a) op(b)^H + conj(alpha) op(b) op(a)^H + beta c on the ``lower`` (else upper)
    triangle, as scipy.linalg.blas.?her2k: beta real, trans 0 or 2 (as for :func:`herk`)."""
    if (res := _plain("her2k", a, alpha, a, b, beta, c, trans, lower, overwrite_c)) is not shortcut.NO:
        return res
    return _rank(alpha, a, b, beta, c, trans, lower, overwrite_c, hermitian=True, two=True, name="her2k")


# ---------------------------------------------------------------- TRMM / TRSM

@dispatch.front_end
def _tri(alpha, a, b, side, lower, trans_a, diag, overwrite_b, *, solve, name, dtype=None):
    overwrite_b = check_flag("overwrite_b", overwrite_b, OVERWRITE)
    check_matrix("a", a)
    check_matrix("b", b)
    on_gpu = same_place(a=a, b=b)
    side = check_flag("side", side, SIDE)
    lower = check_flag("lower", lower, LOWER)
    trans_a = check_trans("trans_a", trans_a)
    diag = check_flag("diag", diag, DIAG)
    dtype = _dtype(dtype, a, b)
    alpha = check_scalar("alpha", alpha, dtype)
    m, n = b.shape
    s_dim = m if side == 0 else n
    _check_shape("a", a, (s_dim, s_dim),
                 lambda: f"the square triangular factor: with side={side} it has b's "
                         f"{'rows' if side == 0 else 'columns'}, b.shape={tuple(b.shape)}")
    xp = array_module(on_gpu)
    in_place = written_in_place(b, dtype, overwrite_b)
    if in_place:
        check_no_alias("b", b, a=a)
    if m == 0 or n == 0:
        return b if in_place else new_array(xp, (m, n), dtype, a)
    a = as_operand(a, dtype)
    vb = b if in_place else _f_view(b, xp, dtype)
    va, op, lower_v = _tri_view(a, trans_a, lower)
    # In place, both write over B tile by tile, ordered by dependencies (TRSM: a tile is read
    # once solved; TRMM: a tile is overwritten once its old value has been read by every task).
    # Otherwise both write a new array (TRMM with no dependencies; TRSM starts each tile from B's).
    out = b if in_place else new_array(xp, (m, n), dtype, a)
    is_complex = dtype.kind == "c"

    def plan(tile, block, inverse=False):
        if solve:
            return plan_trsm(m, n, tile, side, lower_v, op, diag, alpha_zero=(alpha == 0), is_complex=is_complex,
                             inverse=inverse)
        return plan_trmm(m, n, tile, side, lower_v, op, diag, alpha_zero=(alpha == 0), is_complex=is_complex,
                         block=block, in_place=in_place)

    def inverses(eng, tile):
        """TRSM's scratch for the diagonal blocks' inverses (Knobs.trsm_inverse), on engines with
        a stream device: a multiply by a block's inverse has no row-to-row dependence, so a GPU runs it
        faster than a triangular solve (not a solve numerically: docs/design.md, TRSM by inverses)."""
        if (not solve or alpha == 0 or s_dim <= tile or not eng.config.knobs.trsm_inverse
                or not any(d.streamed for d in eng.devices)):
            return None  # (a single level solves with trsm steps: nothing to invert)
        return inverse_shape(s_dim, tile)

    def host():
        if vb is not out:
            out[...] = vb
        written(out, dispatch.blas_routine("trsm" if solve else "trmm", dtype)(alpha, va, out, side, lower_v, op, diag, 1))

    with dispatch.whole(in_place):
        dispatch.run(name, [va, vb, out], plan, dtype, alpha, 0, (m, n, s_dim), host=host,
            flops=1.0 * m * n * s_dim if alpha != 0 else float(m * n), scratch=inverses)
    return out


def trmm(alpha, a, b, side=0, lower=0, trans_a=0, diag=0, overwrite_b=False):
    """b = alpha op(A) b (side=0) or alpha b op(A) (side=1), as scipy.linalg.blas.?trmm.

    A is the ``lower`` (else upper) triangle of the square a, with a unit diagonal (not read) if
    ``diag``; op is N, T or C for ``trans_a`` 0, 1, 2. With ``overwrite_b`` and b F-contiguous of
    the right dtype, the product is written over b tile by tile; otherwise into a new array.
    """
    if (res := _plain("trmm", a, alpha, a, b, side, lower, trans_a, diag, overwrite_b)) is not shortcut.NO:
        return res
    return _tri(alpha, a, b, side, lower, trans_a, diag, overwrite_b, solve=False, name="trmm")


def trsm(alpha, a, b, side=0, lower=0, trans_a=0, diag=0, overwrite_b=False):
    """x with op(A) x = alpha b (side=0) or x op(A) = alpha b (side=1), as scipy.linalg.blas.?trsm.

    A and ``overwrite_b`` as for :func:`trmm`. No singularity check is made (BLAS semantics: a zero
    pivot gives inf/nan).
    """
    if (res := _plain("trsm", a, alpha, a, b, side, lower, trans_a, diag, overwrite_b)) is not shortcut.NO:
        return res
    return _tri(alpha, a, b, side, lower, trans_a, diag, overwrite_b, solve=True, name="trsm")


# ---------------------------------------------------------------- prefixed names (s/d/c/z)

_ALL = dtypes.PREFIXES
_COMPLEX = "".join(t.prefix for t in dtypes.TYPES if t.is_complex)  # the Hermitian routines'

#: routine -> (generic function, its implementation, keyword arguments of the implementation, prefixes)
_TABLE = {
    "symm": (symm, _symm, {"hermitian": False}, _ALL),
    "hemm": (hemm, _symm, {"hermitian": True}, _COMPLEX),
    "syrk": (syrk, _rank, {"hermitian": False, "two": False}, _ALL),
    "herk": (herk, _rank, {"hermitian": True, "two": False}, _COMPLEX),
    "syr2k": (syr2k, _rank, {"hermitian": False, "two": True}, _ALL),
    "her2k": (her2k, _rank, {"hermitian": True, "two": True}, _COMPLEX),
    "trmm": (trmm, _tri, {"solve": False}, _ALL),
    "trsm": (trsm, _tri, {"solve": True}, _ALL),
}

#: routine -> the prefixes it has (scipy's set)
ROUTINE_PREFIXES = {r: prefixes for r, (*_, prefixes) in _TABLE.items()}

#: routine -> dtype -> its plain-call shortcut (blasx.shortcut)
_FAST = {r: {dtypes.BY_PREFIX[p].dtype: shortcut.make(r, dtypes.BY_PREFIX[p].dtype) for p in ps}
         for r, ps in ROUTINE_PREFIXES.items()}


def _plain(routine: str, a, *args):
    """A generic routine's call in the plain form of a's dtype, run by its shortcut, else NO."""
    fast = _FAST[routine].get(getattr(a, "dtype", None))
    return shortcut.NO if fast is None else fast(*args)


def _prefixed(prefix: str, routine: str):
    """``prefix + routine`` (e.g. ``dsyrk``): the generic routine's signature, every array cast to the prefix's type."""
    generic, impl, kw, _ = _TABLE[routine]
    dtype = dtypes.BY_PREFIX[prefix].dtype
    name = prefix + routine
    fast, no = _FAST[routine][dtype], shortcut.NO
    if impl is _symm:
        def f(alpha, a, b, beta=0.0, c=None, side=0, lower=0, overwrite_c=False):
            if (res := fast(alpha, a, b, beta, c, side, lower, overwrite_c)) is not no:
                return res
            return _symm(alpha, a, b, beta, c, side, lower, overwrite_c, dtype=dtype, name=name, **kw)
    elif impl is _tri:
        def f(alpha, a, b, side=0, lower=0, trans_a=0, diag=0, overwrite_b=False):
            if (res := fast(alpha, a, b, side, lower, trans_a, diag, overwrite_b)) is not no:
                return res
            return _tri(alpha, a, b, side, lower, trans_a, diag, overwrite_b, dtype=dtype, name=name, **kw)
    elif kw["two"]:
        def f(alpha, a, b, beta=0.0, c=None, trans=0, lower=0, overwrite_c=False):
            if (res := fast(alpha, a, b, beta, c, trans, lower, overwrite_c)) is not no:
                return res
            return _rank(alpha, a, b, beta, c, trans, lower, overwrite_c, dtype=dtype, name=name, **kw)
    else:
        def f(alpha, a, beta=0.0, c=None, trans=0, lower=0, overwrite_c=False):
            if (res := fast(alpha, a, beta, c, trans, lower, overwrite_c)) is not no:
                return res
            return _rank(alpha, a, None, beta, c, trans, lower, overwrite_c, dtype=dtype, name=name, **kw)
    f.__name__ = f.__qualname__ = name
    f.__doc__ = (f"{routine.upper()} in {dtype.name} (scipy.linalg.blas.{name}): every array is cast to "
                 f"{dtype.name} first.\n\n" + (generic.__doc__ or ""))
    return f


PREFIXED = {p + r: _prefixed(p, r) for r, ps in ROUTINE_PREFIXES.items() for p in ps}
globals().update(PREFIXED)

__all__ = list(_TABLE) + sorted(PREFIXED)
