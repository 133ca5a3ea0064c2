"""The level-3 routines that the benchmarks run: the dtypes each exists for, its flop count, its scalars, and
whether it updates C (and only C's upper triangle)."""

from __future__ import annotations

#: routine -> the dtype letters it exists for (cublasXt<letter><routine>, blasx.<letter><routine>)
ROUTINE_DTYPES = {"gemm": "sdcz", "symm": "sdcz", "hemm": "cz", "syrk": "sdcz", "herk": "cz",
                  "syr2k": "sdcz", "her2k": "cz", "trmm": "sdcz", "trsm": "sdcz"}
ALPHA, BETA = 1.5, 0.5
COMPLEX_ALPHA, COMPLEX_BETA = 1.5 - 0.5j, 0.5 + 0.25j
#: dtype letter -> (alpha, beta) of its routines
SCALARS = {"s": (ALPHA, BETA), "d": (ALPHA, BETA), "c": (COMPLEX_ALPHA, COMPLEX_BETA),
           "z": (COMPLEX_ALPHA, COMPLEX_BETA)}
#: routine -> (alpha is real, beta is real) where BLAS takes real scalars whatever the dtype
REAL_SCALARS = {"herk": (True, True), "her2k": (False, True)}
FLOPS = {"gemm": 2, "symm": 2, "hemm": 2, "syrk": 1, "herk": 1, "syr2k": 2, "her2k": 2,
         "trmm": 1, "trsm": 1}  # real flops x N^3, times the type's flop_factor (complex: 4)
#: every routine, in table order
ALL_ROUTINES = tuple(ROUTINE_DTYPES)
#: the routines of every dtype (the default --routines for s and d)
ROUTINES = tuple(r for r in ALL_ROUTINES if ROUTINE_DTYPES[r] == "sdcz")
#: the complex-only ones (HEMM, HERK, HER2K)
HERMITIAN = tuple(r for r in ALL_ROUTINES if r not in ROUTINES)
#: the routines that update C (out starts as C0); the others (TRMM, TRSM) start from B
C_ROUTINES = ("gemm", "symm", "hemm", "syrk", "herk", "syr2k", "her2k")
#: the routines that write only the upper triangle of C (checked there only)
UPPER_ONLY = ("syrk", "herk", "syr2k", "her2k")


def routines_for(dtype: str, routines) -> list[str]:
    """The routines of `routines` that exist for `dtype` (order kept): 'd' drops hemm, herk, her2k."""
    return [r for r in routines if dtype in ROUTINE_DTYPES[r]]


def scalars(dtype: str, routine: str) -> tuple:
    """(alpha, beta) of `routine` in `dtype`: SCALARS[dtype], with the real part only where BLAS
    takes a real scalar (HERK's alpha and beta, HER2K's beta)."""
    alpha, beta = SCALARS[dtype]
    real_alpha, real_beta = REAL_SCALARS.get(routine, (False, False))
    return (alpha.real if real_alpha else alpha), (beta.real if real_beta else beta)
