"""GEMM with scipy.linalg.blas ``?gemm`` semantics: ``blasx.gemm`` and ``blasx.sgemm/dgemm/cgemm/zgemm``.

``blasx.gemm`` computes in the type scipy's find_best_blas_type picks (or :mod:`blasx.precision`'s
for two operands of one reduced type, or an ``out_dtype``); the prefixed functions cast every array
to their type. Both run through :func:`blasx.dispatch.gemm`.
"""

from __future__ import annotations

from . import blas3, dispatch, precision, shortcut
from .checks import (check_matrix, check_no_alias, check_scalar, check_trans, finite_scalar, overlaps_itself,
                     same_place, writable)
from .dispatch import last_profile, running_call  # noqa: F401 - blasx.last_profile, progress displays
from .runtime import dtypes
from .runtime.tiling import OP_N


def gemm(alpha, a, b, beta=0.0, c=None, trans_a=0, trans_b=0, overwrite_c=False, *, out_dtype=None, math=None):
    """C = alpha op(a) op(b) + beta c, as scipy.linalg.blas.?gemm, on every configured device.

    numpy arrays give an F-ordered host result, cupy arrays one on a's device. With ``overwrite_c``
    and a writable c of the call's dtype, the result is written into c (whatever its layout) and c is
    returned; else into a new array. Nothing is written when the arguments are rejected.

    Reduced precision (:mod:`blasx.precision`): a and b both float16, both bfloat16 or both int8
    (int8: integer alpha and beta), ``out_dtype``; ``math="tf32"`` runs float32 on TF32 tensor cores.
    """
    if out_dtype is None and math is None and (fast := _FAST.get(getattr(a, "dtype", None))) is not None:
        if (res := fast(alpha, a, b, beta, c, trans_a, trans_b, overwrite_c)) is not shortcut.NO:
            return res
    return _gemm(alpha, a, b, beta, c, trans_a, trans_b, overwrite_c, None, "gemm", out_dtype, math)


@dispatch.front_end
def _gemm(alpha, a, b, beta, c, trans_a, trans_b, overwrite_c, dtype, name, out_dtype=None, math=None):
    """gemm in ``dtype`` (None: the arrays' type by :func:`blasx.precision.gemm_types`, with
    ``out_dtype``): validate, make the output, dispatch."""
    check_matrix("a", a)
    check_matrix("b", b)
    if c is not None:
        check_matrix("c", c)
    on_gpu = same_place(a=a, b=b, c=c)
    trans_a = check_trans("trans_a", trans_a)
    trans_b = check_trans("trans_b", trans_b)
    overwrite_c = blas3.check_flag("overwrite_c", overwrite_c, blas3.OVERWRITE)
    math = precision.check_math(math)
    dtype, out_type = precision.gemm_types(a, b, c, out_dtype) if dtype is None else (dtype, dtype)
    alpha = precision.check_gemm_scalar("alpha", check_scalar("alpha", alpha, dtype), dtype)
    beta = precision.check_gemm_scalar("beta", check_scalar("beta", beta, dtype), dtype)
    m, ka = a.shape if trans_a == OP_N else a.shape[::-1]
    kb, n = b.shape if trans_b == OP_N else b.shape[::-1]
    if ka != kb:
        raise ValueError(f"a, b: op(a) is {m}x{ka} (a.shape={a.shape}, trans_a={trans_a}) but op(b) is "
                         f"{kb}x{n} (b.shape={b.shape}, trans_b={trans_b}); their inner dimensions must match")
    if c is not None and c.shape != (m, n):
        raise ValueError(f"c: got shape {c.shape}, expected ({m}, {n}) = rows of op(a) x columns of op(b)")
    # c itself is written (any layout) when asked to and writable, of the result type, with no two elements
    # sharing memory; else a new array (as f2py copies such a c)
    in_place = c is not None and bool(overwrite_c) and c.dtype == out_type and writable(c) and not overlaps_itself(c)
    if in_place:
        check_no_alias("c", c, a=a, b=b)
    if c is None and finite_scalar(beta):  # (f2py's c is zeros: an inf or NaN beta makes the result NaN)
        beta = 0
    out = c if in_place else blas3.new_array(dispatch.array_module(on_gpu), (m, n), out_type, a if on_gpu else None,
                                             zeros=c is None and beta != 0)
    c_src = c if c is not None and out is not c and beta != 0 else None  # a new result starting from c's values
    with dispatch.whole(out is c):
        dispatch.gemm(alpha, dispatch.as_operand(a, dtype), dispatch.as_operand(b, dtype), beta, out,
                      trans_a, trans_b, dtype, ka, name, math=math, c_src=c_src)
    return out


def _prefixed(prefix: str):
    """``?gemm`` for one prefix: scipy's signature, every array cast to the prefix's type."""
    dtype = dtypes.BY_PREFIX[prefix].dtype
    name = prefix + "gemm"
    fast = _FAST[dtype]

    def f(alpha, a, b, beta=0.0, c=None, trans_a=0, trans_b=0, overwrite_c=False):
        if (res := fast(alpha, a, b, beta, c, trans_a, trans_b, overwrite_c)) is not shortcut.NO:
            return res
        return _gemm(alpha, a, b, beta, c, trans_a, trans_b, overwrite_c, dtype, name)

    f.__name__ = f.__qualname__ = name
    f.__doc__ = (f"GEMM in {dtype.name} (scipy.linalg.blas.{name}): every array is cast to {dtype.name} first; "
                 f"no out_dtype or math (the math mode is blasx.configure's).\n\n"
                 + (gemm.__doc__ or "").split("\n\n    Reduced precision")[0] + "\n    ")
    return f


#: dtype -> its gemm's plain-call shortcut (blasx.shortcut)
_FAST = {t.dtype: shortcut.make("gemm", t.dtype) for t in dtypes.TYPES}

#: sgemm, dgemm, cgemm, zgemm
PREFIXED = {p + "gemm": _prefixed(p) for p in dtypes.PREFIXES}
globals().update(PREFIXED)  # (module attributes: pickle finds them by name)
