"""Argument checks of every blasx.dnn front end: arrays and their element types, flags, reals, ints and
int tuples, shapes, dims, a ``dtype=``, an ``out=`` array, devices. Each raises an exception naming the
parameter, what it got and what is allowed, and none writes anything."""

from __future__ import annotations

import math
import numbers

import numpy as np

from ..checks import elements_share_memory, shares_memory, writable
from ..operands import is_cupy
from ..runtime import dtypes

# ---------------------------------------------------------------- element types


def allowed_dtypes() -> dict:
    """blasx.dnn's element types and their names: float64, float32, float16, bfloat16 (with ml_dtypes)."""
    out = {np.dtype(np.float64): "float64", np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}
    bf = dtypes.GEMM_BY_PREFIX.get("b")
    if bf is not None:
        out[bf.dtype] = "bfloat16"
    return out


def dtype_text(dt) -> str:
    """A dtype as errors name it: a non-native byte order said so (``float64 in non-native byte order ('>f8');
    .astype('=f8') converts it``), which its name alone hides."""
    dt = np.dtype(dt)
    if dt.isnative:
        return str(dt)
    native = dt.newbyteorder("=")
    return f"{native} in non-native byte order ({dt.str!r}; .astype({native.str!r}) converts it)"


def check_dtype(name: str, x) -> np.dtype:
    """x's dtype, one of :func:`allowed_dtypes`."""
    dt = np.dtype(x.dtype)
    allowed = allowed_dtypes()
    if dt not in allowed:
        raise TypeError(f"{name}: dtype {dtype_text(dt)} is not supported; allowed: {', '.join(allowed.values())}")
    return dt


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


# ---------------------------------------------------------------- arrays

def check_kind(name: str, x):
    """x is a numpy or CuPy array (of any dtype), not a masked one (its mask would be ignored); x."""
    if not (isinstance(x, np.ndarray) or is_cupy(x)):
        raise TypeError(f"{name}: got {type(x).__name__}, expected a numpy or cupy array")
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name}: got a masked array, whose mask blasx.dnn would ignore; pass x.filled(value) or "
                        f"x.data")
    return x


def check_array(name: str, x) -> np.dtype:
    """x is a numpy or CuPy array of a type blasx.dnn takes; its dtype."""
    return check_dtype(name, check_kind(name, x))


def check_like(name: str, a, ref_name: str, ref) -> None:
    """a is an array of the same kind (numpy/CuPy), shape and dtype as ``ref``."""
    check_array(name, a)
    if type(a) is not type(ref):
        raise TypeError(f"{name}: got a {type(a).__module__} array; {ref_name} is a {type(ref).__module__} array")
    if tuple(a.shape) != tuple(ref.shape):
        raise ValueError(f"{name}: expected {ref_name}'s shape {tuple(ref.shape)}, got {tuple(a.shape)}")
    if np.dtype(a.dtype) != np.dtype(ref.dtype):
        raise TypeError(f"{name}: expected {ref_name}'s dtype {np.dtype(ref.dtype)}, got {np.dtype(a.dtype)}")


def check_same_device(x, **arrays) -> None:
    """Every given CuPy array (None: not given) lives on x's GPU."""
    if not is_cupy(x):
        return
    for name, a in arrays.items():
        if a is not None and a.device != x.device:
            raise ValueError(f"{name}: is on GPU {a.device.id} but input is on GPU {x.device.id}")


def same_view(a, b) -> bool:
    """Whether a and b view the same memory with the same shape and strides."""
    ptr = (lambda v: v.data.ptr) if is_cupy(a) else (lambda v: v.__array_interface__["data"][0])
    return a.shape == b.shape and a.strides == b.strides and ptr(a) == ptr(b)


def check_out(out, shape, dtype, like, *inputs, alias: bool = True, name: str = "out", write: bool = True) -> None:
    """``out`` (None: not given) is a writable array of ``like``'s kind with this shape and dtype that
    overlaps none of ``inputs`` -- except, with ``alias``, by being one of them exactly (a result that is
    written element by element after reading the same element may go back into its input). ``write=False``:
    an extra operand only read (read-only allowed)."""
    if out is None:
        return
    if not (isinstance(out, np.ndarray) or is_cupy(out)) or is_cupy(out) != is_cupy(like) \
            or isinstance(out, np.ma.MaskedArray):  # (an ndarray subclass, np.memmap say, is host memory as any)
        raise TypeError(f"{name}: got a {type(out).__module__}.{type(out).__name__}; the input is a "
                        f"{type(like).__module__}.{type(like).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    if np.dtype(out.dtype) != np.dtype(dtype):
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype)}, got {np.dtype(out.dtype)}")
    if write and not writable(out):
        raise ValueError(f"{name}: is read-only")
    if write and elements_share_memory(out):
        raise ValueError(f"{name}: more than one of its elements refers to a single memory location (strides "
                         f"{tuple(out.strides)} for shape {tuple(out.shape)})")
    for x in inputs:
        if x is not None and hasattr(x, "shape") and shares_memory(out, x) and not (alias and same_view(out, x)):
            raise ValueError(f"{name}: overlaps an input array{' (it may only be one exactly)' if alias else ''}")


def check_inplace(inplace, x, out) -> bool:
    """``inplace=`` (torch's: write into the input and return it): a flag, x writable, no ``out``."""
    inplace = check_flag("inplace", inplace)
    if inplace and out is not None:
        raise ValueError("out: inplace=True writes into the input; pass out=None")
    if inplace and not writable(x):
        raise ValueError("input: is read-only (inplace=True writes into it)")
    return inplace


# ---------------------------------------------------------------- scalars

def is_int(v) -> bool:
    """An int or numpy integer, not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def check_flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: got {value!r} of type {type(value).__name__}, expected True or False")
    return bool(value)


def check_real(name: str, value, minimum: float | None = None, *, finite: bool = False) -> float:
    """A real number (not a bool; with ``finite`` not inf or NaN, a TypeError too) >= ``minimum``, as a float."""
    what = "a finite real number" if finite else "a real number"
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real)
            or (finite and not math.isfinite(value))):
        raise TypeError(f"{name}: got {value!r} of type {type(value).__name__}, expected {what}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: got {value!r}, expected {what} >= {minimum}")
    return float(value)


def check_int(name: str, value, minimum: int | None = None) -> int:
    if not is_int(value):
        raise TypeError(f"{name}: got {value!r} of type {type(value).__name__}, expected an int")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: got {value!r}, expected an int >= {minimum}")
    return int(value)


def check_count(name: str, value) -> int:
    """A positive int (a count: groups); anything else, a bool or a float too, is a ValueError (torch's)."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name}: got {value!r}, expected a positive int")
    return int(value)


def check_dim(name: str, dim, ndim: int) -> int:
    """``dim`` of a ``ndim``-D array as torch wraps it (a 0-D array has dims -1 and 0), in [0, ndim)."""
    dim = check_int(name, dim)
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"{name}: got {dim}, expected an int in [{-n}, {n - 1}] for a {ndim}-D input")
    return dim % n


# ---------------------------------------------------------------- int tuples and shapes

def ints(name: str, value, nd: int, minimum: int, *, one: bool = False, single: bool = False) -> tuple[int, ...]:
    """An int or a sequence of ``nd`` ints, each >= ``minimum``, as ``nd`` ints. ``one``: torch's pooling
    form -- also a 1-element tuple or list, and a value that is neither an int, a tuple nor a list is a
    ValueError like every other malformed one (without ``one`` a non-iterable is a TypeError). ``single``:
    torch's convolution form -- also a 1-element sequence, for every dim."""
    vals = (value,) * (1 if one else nd) if isinstance(value, numbers.Integral) else value
    allowed = f"an int or a tuple of {'1 or ' if (one or single) and nd > 1 else ''}{nd} int{'s' if nd > 1 else ''}"
    if one:
        if not isinstance(vals, (tuple, list)):
            raise ValueError(f"{name}: got {value!r}, expected {allowed}")
    else:
        try:
            vals = tuple(vals)
        except TypeError:
            raise TypeError(f"{name}: got {value!r}, expected {allowed}") from None
    if len(vals) not in ((1, nd) if one or single else (nd,)) or not all(is_int(v) for v in vals):
        raise ValueError(f"{name}: got {value!r}, expected {allowed}")
    vals = tuple(int(v) for v in vals) * (nd // len(vals))
    if any(v < minimum for v in vals):
        what = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"{name}: got {value!r}; each value must be {what} (>= {minimum})")
    return vals


def check_shape(name: str, value, *, allowed: str = "a tuple of non-negative ints", scalar: bool = False,
                bad_element=ValueError) -> tuple[int, ...]:
    """A shape: an iterable of non-negative ints (``scalar``: or one int, a 1-D shape), as a tuple. Not
    iterable: TypeError; an element that is not a non-negative int: ``bad_element`` (the type each front
    end has always raised)."""
    try:
        shape = (value,) if scalar and isinstance(value, numbers.Integral) else tuple(value)
    except TypeError:
        raise TypeError(f"{name}: got {value!r}, expected {allowed}") from None
    if not all(is_int(s) and s >= 0 for s in shape):
        raise bad_element(f"{name}: got {value!r}, expected {allowed}")
    return tuple(int(s) for s in shape)
