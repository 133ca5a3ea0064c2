"""Input checks shared by the front ends: every error names the parameter,
the value received and what is allowed. Nothing here writes to an array."""

from __future__ import annotations

import numbers

import numpy as np

from .operands import is_cupy

BLAS_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.complex64), np.dtype(np.complex128))
PREFIX_OF = {np.dtype(np.float32): "s", np.dtype(np.float64): "d",
             np.dtype(np.complex64): "c", np.dtype(np.complex128): "z"}
TRANS_ALLOWED = (0, 1, 2)


def check_matrix(name: str, x) -> None:
    if not (isinstance(x, np.ndarray) or is_cupy(x)):
        raise TypeError(f"{name}: got {type(x).__name__}, expected a numpy or cupy array")
    if x.ndim != 2:
        raise ValueError(f"{name}: got a {x.ndim}-D array of shape {x.shape}, expected a 2-D matrix")


def check_trans(name: str, value) -> int:
    if type(value) is int and value in TRANS_ALLOWED:  # the common case, without the abc checks
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral,)) or int(value) not in TRANS_ALLOWED:
        raise ValueError(f"{name}: got {value!r}, allowed: 0 (N), 1 (T), 2 (C, conjugate transpose)")
    return int(value)


def check_scalar(name: str, value, dtype: np.dtype):
    if type(value) is float or type(value) is int:  # the common case, without the abc checks
        return value
    if not isinstance(value, numbers.Number) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: got {value!r} of type {type(value).__name__}, expected a number")
    if dtype.kind != "c" and isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        if value.imag != 0:
            raise TypeError(f"{name}: got complex {value!r} for a real {dtype.name} computation")
        value = value.real
    return value


def compute_dtype(*arrays) -> np.dtype:
    """The BLAS type for these arrays, as scipy's find_best_blas_type picks it."""
    try:
        dt = np.result_type(*[a.dtype for a in arrays])
    except TypeError:  # numpy's DTypePromotionError (datetimes, mixed incompatible types)
        got = ", ".join(str(a.dtype) for a in arrays)
        raise TypeError(f"dtype: got {got}, which have no common BLAS type; "
                        f"allowed: float32, float64, complex64, complex128") from None
    if dt.kind in "biu":
        return np.dtype(np.float64)
    if dt == np.float16:
        return np.dtype(np.float32)
    if dt.kind == "c" and dt.itemsize > 16 or dt.kind == "f" and dt.itemsize > 8:
        raise TypeError(f"dtype: {dt} has no BLAS type; allowed: float32, float64, complex64, complex128")
    if dt not in BLAS_DTYPES:
        raise TypeError(f"dtype: {dt} is not supported; allowed: float32, float64, complex64, complex128")
    return dt


def same_place(**arrays) -> bool:
    """True if all given arrays are CuPy arrays, False if all are numpy; mixed is an error."""
    kinds = {name: is_cupy(x) for name, x in arrays.items() if x is not None}
    if len(set(kinds.values())) > 1:
        where = ", ".join(f"{n}={'cupy' if v else 'numpy'}" for n, v in kinds.items())
        raise TypeError(f"operands: got {where}; pass all numpy arrays (host) or all cupy arrays (GPU)")
    return next(iter(kinds.values()), False)


def shares_memory(x, y) -> bool:
    if is_cupy(x) or is_cupy(y):
        import cupy
        return bool(cupy.shares_memory(x, y))
    try:
        return bool(np.shares_memory(x, y, max_work=100_000))
    except np.exceptions.TooHardError:
        return True  # too hard to prove disjoint: treat as aliasing
