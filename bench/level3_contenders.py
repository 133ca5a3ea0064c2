"""The two contenders of the level-3 benchmarks, one call each: cublasXt<S|D|C|Z><routine> through ctypes
(its argument lists and host scalars) and blasx.<dtype><routine> with scipy's signature."""

from __future__ import annotations

import ctypes as C

from blasx.runtime.dtypes import BY_PREFIX, PREFIXES

from .cublasxt import _check, scalar_ctype
from .level3_routines import ALL_ROUTINES, REAL_SCALARS, ROUTINE_DTYPES

UPPER_XT, LEFT, NOTRANS, NONUNIT = 1, 0, 0, 0  # cuBLAS enums: FILL_MODE_UPPER = 1
S, P, I = C.c_size_t, C.c_void_p, C.c_int

#: routine -> argtypes of cublasXt<S|D|C|Z><routine> (alpha/beta are pointers, so one layout per
#: routine: HEMM's is SYMM's, HERK's SYRK's, HER2K's SYR2K's; only the scalars' types differ)
XT_ARGTYPES = {
    "gemm": [P, I, I, S, S, S, P, P, S, P, S, P, P, S],
    "symm": [P, I, I, S, S, P, P, S, P, S, P, P, S],
    "hemm": [P, I, I, S, S, P, P, S, P, S, P, P, S],
    "syrk": [P, I, I, S, S, P, P, S, P, P, S],
    "herk": [P, I, I, S, S, P, P, S, P, P, S],
    "syr2k": [P, I, I, S, S, P, P, S, P, S, P, P, S],
    "her2k": [P, I, I, S, S, P, P, S, P, S, P, P, S],
    "trmm": [P, I, I, I, I, S, S, P, P, S, P, S, P, S],
    "trsm": [P, I, I, I, I, S, S, P, P, S, P, S],
}
#: routine -> the routine whose cuBLAS-XT argument order it shares
XT_LAYOUT = {"hemm": "symm", "herk": "syrk", "her2k": "syr2k"}
#: routine -> blasx's operands before alpha (the C routines; TRMM/TRSM take (A, B) in place)
BLASX_OPERANDS = {"gemm": ("A", "B"), "symm": ("A", "B"), "hemm": ("A", "B"), "syrk": ("A",), "herk": ("A",),
                  "syr2k": ("A", "B"), "her2k": ("A", "B")}


# --------------------------------------------------------------------------- cuBLAS-XT


def xt_symbol(dtype: str, routine: str) -> str:
    """'s', 'gemm' -> 'cublasXtSgemm'; 'z', 'her2k' -> 'cublasXtZher2k' (HEMM, HERK, HER2K: c and z only)."""
    if dtype not in BY_PREFIX:
        raise ValueError(f"dtype: got {dtype!r}; allowed: {', '.join(PREFIXES)}")
    if routine not in XT_ARGTYPES:
        raise ValueError(f"routine: got {routine!r}; allowed: {', '.join(XT_ARGTYPES)}")
    if dtype not in ROUTINE_DTYPES[routine]:
        raise ValueError(f"routine: got {routine!r} for dtype {dtype!r}; {routine} exists for dtypes "
                         f"{', '.join(ROUTINE_DTYPES[routine])} only")
    return f"cublasXt{dtype.upper()}{routine}"


def xt_scalar_types(dtype: str, routine: str = "gemm") -> tuple:
    """The ctypes types of the scalars that cublasXt<dtype><routine> reads through its alpha and
    beta pointers: the dtype's own (float, double, cuComplex, cuDoubleComplex), or its real type
    where BLAS takes a real scalar (HERK: both; HER2K: beta)."""
    real_alpha, real_beta = REAL_SCALARS.get(routine, (False, False))
    t = BY_PREFIX[dtype]
    return scalar_ctype(t, real_alpha), scalar_ctype(t, real_beta)


def _xt_value(ctype, value, what: str, dtype: str, routine: str):
    """value as a `ctype` host scalar: a complex struct gets (real, imaginary); a real type refuses
    a value with an imaginary part."""
    z = complex(value)
    if issubclass(ctype, C.Structure):
        return ctype(z.real, z.imag)
    if z.imag != 0:
        raise ValueError(f"{what}: got {value!r}; allowed: a real value for {dtype}{routine} "
                         f"(cuBLAS-XT reads a {ctype.__name__} there)")
    return ctype(z.real)


def xt_scalars(dtype: str, alpha, beta, routine: str = "gemm"):
    """alpha and beta as host scalars of the routine's precision and kind (cuBLAS-XT reads them
    through pointers: a double where a float is expected, or a real where a complex is, would be
    read as garbage)."""
    ta, tb = xt_scalar_types(dtype, routine)
    return _xt_value(ta, alpha, "alpha", dtype, routine), _xt_value(tb, beta, "beta", dtype, routine)


def xt_args(routine: str, n: int, ra: int, pa: int, pb: int, rb: int, pc: int) -> tuple:
    """The cuBLAS-XT arguments after the handle (ra, rb: addresses of alpha, beta)."""
    layout = XT_LAYOUT.get(routine, routine)  # hemm as symm, herk as syrk, her2k as syr2k
    if layout == "gemm":
        return NOTRANS, NOTRANS, n, n, n, ra, pa, n, pb, n, rb, pc, n
    if layout == "symm":
        return LEFT, UPPER_XT, n, n, ra, pa, n, pb, n, rb, pc, n
    if layout == "syrk":
        return UPPER_XT, NOTRANS, n, n, ra, pa, n, rb, pc, n
    if layout == "syr2k":
        return UPPER_XT, NOTRANS, n, n, ra, pa, n, pb, n, rb, pc, n
    if layout == "trmm":  # out-of-place: C = alpha A B
        return LEFT, UPPER_XT, NOTRANS, NONUNIT, n, n, ra, pa, n, pb, n, pc, n
    if layout == "trsm":  # in place on out (= B)
        return LEFT, UPPER_XT, NOTRANS, NONUNIT, n, n, ra, pa, n, pc, n
    raise ValueError(f"routine: got {routine!r}; allowed: {', '.join(ALL_ROUTINES)}")


def _xt_call(xt, name, routine, *args):
    fn = getattr(xt._lib, name)
    fn.argtypes, fn.restype = XT_ARGTYPES[routine], C.c_int
    _check(fn(xt._handle, *args), name)


def run_xt(xt, dtype, routine, n, A, B, C0, out, alpha, beta):
    al, be = xt_scalars(dtype, alpha, beta, routine)  # kept alive in this frame during the call
    args = xt_args(routine, n, C.addressof(al), A.ctypes.data, B.ctypes.data, C.addressof(be), out.ctypes.data)
    _xt_call(xt, xt_symbol(dtype, routine), routine, *args)


# --------------------------------------------------------------------------- blasx


def blasx_routine(blasx, dtype: str, routine: str):
    """blasx.<dtype><routine> (scipy names: dsyrk, zherk, ...); GEMM falls back to the generic
    blasx.gemm, which keeps the operands' dtype, where the package has no prefixed gemm."""
    fn = getattr(blasx, dtype + routine, None)
    if fn is None and routine == "gemm":
        fn = blasx.gemm
    if fn is None:
        raise AttributeError(f"blasx has no {dtype + routine}")
    return fn


def run_blasx(blasx, dtype, routine, n, A, B, C0, out, alpha, beta):
    """One blasx call, scipy's signature: the C routines update `out` in place (HERK / HER2K with
    trans 0, their real scalars as given), TRMM / TRSM overwrite `out` (= B)."""
    fn = blasx_routine(blasx, dtype, routine)
    if routine in BLASX_OPERANDS:
        operands = {"A": A, "B": B}
        fn(alpha, *(operands[x] for x in BLASX_OPERANDS[routine]), beta=beta, c=out, overwrite_c=True)
    else:
        fn(alpha, A, out, overwrite_b=True)
