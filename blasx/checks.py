"""Input checks shared by the front ends: every error names the parameter,
the value received and what is allowed. Nothing here writes to an array."""

from __future__ import annotations

import numbers

import numpy as np
import scipy.linalg.blas as _sp

from .operands import is_cupy
from .runtime import dtypes


def check_matrix(name: str, x) -> None:
    if not (isinstance(x, np.ndarray) or is_cupy(x)):
        raise TypeError(f"{name}: got {type(x).__name__}, expected a numpy or cupy array")
    if x.ndim != 2:
        raise ValueError(f"{name}: got a {x.ndim}-D array of shape {x.shape}, expected a 2-D matrix")
    if x.dtype.kind in "OUS":  # objects and strings: taken where they convert to numbers, as scipy casts them
        try:
            x.astype(np.complex128)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name}: got an array of dtype: {x.dtype} that does not convert to numbers ({e}); "
                            f"allowed: float32, float64, complex64, complex128 (and the other numeric types, "
                            f"converted as scipy converts them)") from None


def check_trans(name: str, value) -> int:
    """0, 1 or 2 (a bool as 0 or 1, as scipy's drop-in and the other flags take it)."""
    if not isinstance(value, (numbers.Integral, np.bool_)) or int(value) not in (0, 1, 2):
        raise ValueError(f"{name}: got {value!r}, allowed: 0 (N), 1 (T), 2 (C, conjugate transpose)")
    return int(value)


def check_scalar(name: str, value, dtype: np.dtype):
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iufc":  # (scipy takes a 0-d array)
        value = value[()]
    if not isinstance(value, numbers.Number) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: got {value!r} of type {type(value).__name__}, expected a number")
    if type(value) is int and value.bit_length() > 1000:
        try:
            float(value)
        except OverflowError:  # (as scipy's: no float64 holds it)
            raise OverflowError(f"{name}: got an int of {value.bit_length()} bits; it cannot be converted to a "
                                f"float (at most about 1.8e308 in magnitude)") from None
    if dtype.kind != "c" and isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        if value.imag != 0:
            raise TypeError(f"{name}: got complex {value!r} for a real {dtype.name} computation")
        value = value.real
    return value


# scipy.linalg.blas's type scores (its find_best_blas_type): bool, int8/16, uint8/16, float16 and
# float32 -> s; larger integers, float64 and longdouble -> d; complex64 -> c; complex128 and
# clongdouble -> z; float64 (or a larger integer) with complex64 -> z. From the installed scipy.
TYPE_SCORE = dict(getattr(_sp, "_type_score", None) or {
    "?": 1, "b": 1, "B": 1, "h": 1, "H": 1, "e": 1, "f": 1, "i": 2, "I": 2, "l": 2, "L": 2, "q": 2, "Q": 2,
    "d": 2, "F": 3, "D": 4, "g": 2, "G": 4})
BY_SCORE = {1: dtypes.BY_PREFIX["s"].dtype, 2: dtypes.BY_PREFIX["d"].dtype,
            3: dtypes.BY_PREFIX["c"].dtype, 4: dtypes.BY_PREFIX["z"].dtype}


def compute_dtype(*arrays) -> np.dtype:
    """The BLAS type of a scipy-signature call on these arrays, as scipy's find_best_blas_type
    picks it: the highest score wins, complex64 with float64 gives complex128. Non-numeric
    arrays (object, strings, datetimes) raise TypeError naming ``dtype``."""
    scores = []
    bf16 = dtypes.GEMM_BY_PREFIX.get("b")
    for a in arrays:  # unlisted numeric (bfloat16 too): as float64, scipy's fallback
        numeric = a.dtype.kind in "biuf" or (bf16 is not None and a.dtype == bf16.dtype)
        score = TYPE_SCORE.get(a.dtype.char, 2 if numeric else None)
        if score is None:
            got = ", ".join(str(x.dtype) for x in arrays)
            raise TypeError(f"dtype: got {got}; allowed: float32, float64, complex64, complex128 (and the "
                            f"other numeric types, converted as scipy converts them)")
        scores.append(score)
    best = max(scores)
    if best == 3 and 2 in scores:
        best = 4
    return BY_SCORE[best]


def writable(x) -> bool:
    """Whether x may be written in place (numpy's flag; a CuPy array always may)."""
    return getattr(x.flags, "writeable", True)


def finite_scalar(x) -> bool:
    """Whether the number x is finite (a complex one in both parts)."""
    return x == x and abs(x) != float("inf")


def aligned(x) -> bool:
    """Whether x's elements are aligned (numpy's flag; a CuPy array's pointer on its type's alignment)."""
    flag = getattr(x.flags, "aligned", None)
    return flag if flag is not None else x.data.ptr % x.dtype.alignment == 0


def elements_share_memory(x, exact_up_to: int = 1 << 20) -> bool:
    """Whether two elements of x share memory: :func:`overlaps_itself`'s test, then, for at most ``exact_up_to``
    elements, the elements' byte offsets compared (interleaved strides may be disjoint); beyond that, conservative."""
    if not overlaps_itself(x):
        return False
    if x.size > exact_up_to:
        return True
    offsets = sum(np.arange(n, dtype=np.int64).reshape((-1,) + (1,) * (x.ndim - 1 - d)) * s
                  for d, (n, s) in enumerate(zip(x.shape, x.strides)))
    starts = np.unique(np.ravel(offsets))
    return starts.size < x.size or bool((np.diff(starts) < x.dtype.itemsize).any())


def overlaps_itself(x) -> bool:
    """Whether two elements of x may share memory (``as_strided`` views): a conservative test on the strides,
    each dimension's stride past the bytes spanned by the smaller ones."""
    if 0 in x.shape:
        return False
    reach = x.dtype.itemsize
    for stride, n in sorted((abs(s), n) for s, n in zip(x.strides, x.shape) if n > 1):
        if stride < reach:
            return True
        reach += stride * (n - 1)
    return False


def same_place(a=None, b=None, c=None) -> bool:
    """True if the given arrays (None: not given) are all CuPy arrays, False if all are numpy;
    mixed is an error."""
    if type(a) is np.ndarray and (b is None or type(b) is np.ndarray) and (c is None or type(c) is np.ndarray):
        return False
    kinds = {name: is_cupy(x) for name, x in (("a", a), ("b", b), ("c", c)) if x is not None}
    if len(set(kinds.values())) > 1:
        where = ", ".join(f"{n}={'cupy' if v else 'numpy'}" for n, v in kinds.items())
        raise TypeError(f"operands: got {where}; pass all numpy arrays (host) or all cupy arrays (GPU)")
    return next(iter(kinds.values()), False)


def check_no_alias(out_name: str, out, **inputs) -> None:
    """An output written in place shares no memory with the ``inputs`` (name=array; None: not given)."""
    for name, x in inputs.items():
        if x is not None and shares_memory(out, x):
            raise ValueError(f"{out_name}: shares memory with {name}; the output written in place must not "
                             f"alias an input")


def shares_memory(x, y) -> bool:
    if is_cupy(x) != is_cupy(y):
        return False  # device memory and host memory
    if is_cupy(x):
        import cupy
        # Bounds first (host arithmetic): CuPy's exact test sorts a pointer per element of both arrays on the GPU.
        return bool(cupy.may_share_memory(x, y)) and bool(cupy.shares_memory(x, y))
    try:
        return bool(np.shares_memory(x, y, max_work=100_000))
    except np.exceptions.TooHardError:
        return True  # too hard to prove disjoint: treat as aliasing
