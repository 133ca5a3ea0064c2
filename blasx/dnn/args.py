"""Argument checks of blasx.dnn's elementwise-family primitives (activations, softmax, LRN, dropout, add,
cat): arrays, flags, reals, dims, a ``dtype=`` and an ``out=`` array. Each raises an exception naming the
parameter, what it got and what is allowed, and none writes anything."""

from __future__ import annotations

import numbers

import numpy as np

from ..checks import shares_memory, writable
from ..operands import is_cupy
from .geometry import allowed_dtypes, check_dtype


def check_array(name: str, x) -> np.dtype:
    """x is a numpy or CuPy array of a type blasx.dnn takes; its dtype."""
    if not (isinstance(x, np.ndarray) or is_cupy(x)):
        raise TypeError(f"{name}: got {type(x).__name__}, expected a numpy or cupy array")
    return check_dtype(name, x)


def check_like(name: str, a, ref_name: str, ref) -> None:
    """a is an array of the same kind (numpy/CuPy), shape and dtype as ``ref``."""
    check_array(name, a)
    if type(a) is not type(ref):
        raise TypeError(f"{name}: got a {type(a).__module__} array; {ref_name} is a {type(ref).__module__} array")
    if tuple(a.shape) != tuple(ref.shape):
        raise ValueError(f"{name}: expected {ref_name}'s shape {tuple(ref.shape)}, got {tuple(a.shape)}")
    if np.dtype(a.dtype) != np.dtype(ref.dtype):
        raise TypeError(f"{name}: expected {ref_name}'s dtype {np.dtype(ref.dtype)}, got {np.dtype(a.dtype)}")


def check_flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: got {value!r} of type {type(value).__name__}, expected True or False")
    return bool(value)


def check_real(name: str, value) -> float:
    """A real number (not a bool), as a float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: got {value!r} of type {type(value).__name__}, expected a real number")
    return float(value)


def check_int(name: str, value, minimum: int | None = None) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: got {value!r} of type {type(value).__name__}, expected an int")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: got {value!r}, expected an int >= {minimum}")
    return int(value)


def check_dim(name: str, dim, ndim: int) -> int:
    """``dim`` of a ``ndim``-D array as torch wraps it (a 0-D array has dims -1 and 0), in [0, ndim)."""
    dim = check_int(name, dim)
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"{name}: got {dim}, expected an int in [{-n}, {n - 1}] for a {ndim}-D input")
    return dim % n


def check_dtype_arg(name: str, value) -> np.dtype:
    """A ``dtype=`` argument (anything np.dtype takes) that is one of blasx.dnn's types."""
    allowed = allowed_dtypes()
    try:
        dt = np.dtype(value)
    except TypeError:
        dt = None
    if dt not in allowed:
        raise TypeError(f"{name}: got {value!r}; allowed: {', '.join(allowed.values())}")
    return dt


def _same_view(a, b) -> bool:
    ptr = (lambda v: v.data.ptr) if is_cupy(a) else (lambda v: v.__array_interface__["data"][0])
    return a.shape == b.shape and a.strides == b.strides and ptr(a) == ptr(b)


def check_out(out, shape, dtype, like, *inputs, alias: bool = True) -> None:
    """``out`` (None: not given) is a writable array of ``like``'s kind with this shape and dtype that
    overlaps none of ``inputs`` -- except, with ``alias``, by being one of them exactly (a result that is
    written element by element after reading the same element may go back into its input)."""
    if out is None:
        return
    if type(out) is not type(like):
        raise TypeError(f"out: got {type(out).__module__}.{type(out).__name__}; the input is a "
                        f"{type(like).__module__}.{type(like).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    if np.dtype(out.dtype) != np.dtype(dtype):
        raise TypeError(f"out: expected dtype {np.dtype(dtype)}, got {np.dtype(out.dtype)}")
    if not writable(out):
        raise ValueError("out: is read-only")
    for x in inputs:
        if x is not None and hasattr(x, "shape") and shares_memory(out, x) and not (alias and _same_view(out, x)):
            raise ValueError(f"out: overlaps an input array{' (it may only be one exactly)' if alias else ''}")


def check_inplace(inplace, x, out) -> bool:
    """``inplace=`` (torch's: write into the input and return it): a flag, x writable, no ``out``."""
    inplace = check_flag("inplace", inplace)
    if inplace and out is not None:
        raise ValueError("out: inplace=True writes into the input; pass out=None")
    if inplace and not writable(x):
        raise ValueError("input: is read-only (inplace=True writes into it)")
    return inplace
