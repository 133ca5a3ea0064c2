"""``scipy.linalg.blas`` with the level-3 routines running on blasx: ``from blasx.linalg import blas``.

The level-3 functions (``?gemm ?symm ?hemm ?syrk ?herk ?syr2k ?her2k ?trmm ?trsm``) take scipy's
signatures, convert their arguments as f2py does and return what scipy returns; where scipy hands a
bad value to BLAS (``zherk(trans=1)``, inconsistent shapes) blasx raises ValueError naming it. Every
other name (level 1 and 2, ``HAS_ILP64``, ...) is scipy's own object. docs/usage.md has the details.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import operator
import warnings

import numpy as np
import scipy.linalg.blas as _sp

from .. import blas3, level3, shortcut
from ..checks import BY_SCORE, TYPE_SCORE
from ..operands import is_cupy
from ..runtime import dtypes

MODULE_NAME = "blasx"

#: routine -> the prefixes scipy.linalg.blas has for it
LEVEL3 = {"gemm": dtypes.PREFIXES, **blas3.ROUTINE_PREFIXES}

# scipy's parameter order per routine family: (name, default or REQUIRED)
REQUIRED = inspect.Parameter.empty
_PARAMS = {
    "gemm": (("alpha", REQUIRED), ("a", REQUIRED), ("b", REQUIRED), ("beta", 0.0), ("c", None),
             ("trans_a", 0), ("trans_b", 0), ("overwrite_c", 0)),
    "symm": (("alpha", REQUIRED), ("a", REQUIRED), ("b", REQUIRED), ("beta", 0.0), ("c", None),
             ("side", 0), ("lower", 0), ("overwrite_c", 0)),
    "syrk": (("alpha", REQUIRED), ("a", REQUIRED), ("beta", 0.0), ("c", None), ("trans", 0), ("lower", 0),
             ("overwrite_c", 0)),
    "syr2k": (("alpha", REQUIRED), ("a", REQUIRED), ("b", REQUIRED), ("beta", 0.0), ("c", None), ("trans", 0),
              ("lower", 0), ("overwrite_c", 0)),
    "trmm": (("alpha", REQUIRED), ("a", REQUIRED), ("b", REQUIRED), ("side", 0), ("lower", 0), ("trans_a", 0),
             ("diag", 0), ("overwrite_b", 0)),
}
_FAMILY = {"gemm": "gemm", "symm": "symm", "hemm": "symm", "syrk": "syrk", "herk": "syrk",
           "syr2k": "syr2k", "her2k": "syr2k", "trmm": "trmm", "trsm": "trmm"}
_FLAG_MAX = {"trans_a": 2, "trans_b": 2, "trans": 2, "side": 1, "lower": 1, "diag": 1}  # f2py's checks


def signature_of(routine: str) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
                              for n, d in _PARAMS[_FAMILY[routine]]])


# ---------------------------------------------------------------- f2py-style conversions

def _scalar(name: str, value, dtype: np.dtype, real: bool):
    """alpha / beta as f2py converts them: a number of the routine's type (see :func:`_number`)."""
    value = _number(name, value, dtype)
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        if real or dtype.kind != "c":
            if value.imag != 0:
                what = f"a {dtype.name} routine" if dtype.kind != "c" else "this routine, which reads it as real"
                warnings.warn(f"{name}: complex {value!r} for {what}: the imaginary part is discarded (as scipy does)",
                              np.exceptions.ComplexWarning, stacklevel=4)
            return float(value.real)
        return complex(value)
    return complex(value) if dtype.kind == "c" and not real else float(value)


def _number(name: str, value, dtype: np.dtype):
    """The number f2py reads from a scalar argument: a number as it is; of a sequence or array, its
    first element (any size); for real routines also a numeric string (float()). Raises f2py's
    exception types: TypeError (None, other objects, strings for complex routines), ValueError (a
    string float() rejects), IndexError (an empty sequence, and for real routines a 0-d complex array)."""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, numbers.Number):
        return value
    if isinstance(value, (str, bytes)):
        if dtype.kind == "c":
            raise TypeError(f"{name}: got the string {value!r}; expected a number (scipy converts strings "
                            f"for real routines only)")
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{name}: cannot convert the string {value!r} to a number") from None
    if is_cupy(value):
        value = value.get()
    if isinstance(value, np.ndarray):
        if type(value) is not np.ndarray:  # (a masked array's element of a masked one is itself again)
            value = np.asarray(value.filled(np.nan) if isinstance(value, np.ma.MaskedArray) else value)
        if value.size == 0:
            raise IndexError(f"{name}: got an empty array; expected a number (or an array holding one)")
        if value.ndim == 0 and value.dtype.kind == "c" and dtype.kind != "c":
            raise IndexError(f"{name}: got a 0-d complex array for a {dtype.name} routine (scipy rejects it); "
                             f"pass a number")
        first = value.reshape(-1)[:1]
        return _number(name, first.astype(np.complex128)[0] if dtype.kind == "c" and first.dtype.kind in "SUO"
                       else first[0], dtype)
    if isinstance(value, (list, tuple)):
        if not value:
            raise IndexError(f"{name}: got an empty {type(value).__name__}; expected a number")
        return _number(name, value[0], dtype)
    for method, convert in (("__index__", operator.index), ("__float__", float), ("__complex__", complex)):
        if hasattr(value, method):  # (an object that says it is a number, as f2py asks it)
            return convert(value)
    raise TypeError(f"{name}: got {value!r} of type {type(value).__name__}; expected a number")


_INT_MAX = 2**31 - 1


def _c_int(name: str, value: int) -> int:
    if not -_INT_MAX - 1 <= value <= _INT_MAX:
        raise OverflowError(f"{name}: {value} does not fit a C int")
    return value


def _flag(name: str, value) -> int:
    """An int flag as f2py converts it: int() of a number or numeric string, a complex's real part,
    a sequence's first element (None, meaning the default, is handled by the caller)."""
    return _c_int(name, value if type(value) is int else _int_of(name, value))


def _int_of(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_, numbers.Integral)):
        return int(value)
    if isinstance(value, (numbers.Real, str, bytes)) or (isinstance(value, np.ndarray) and value.ndim == 0
                                                        and value.dtype.kind in "biuf"):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name}: cannot convert {value!r} to an int") from None
        except TypeError:
            pass
    if isinstance(value, numbers.Complex):
        return _int_of(name, value.real)
    if isinstance(value, (list, tuple, np.ndarray)):
        if not len(value):
            raise IndexError(f"{name}: got an empty {type(value).__name__}; expected an int")
        return _int_of(name, value[0])
    if hasattr(value, "__index__"):  # (an object that says it is an int, as f2py asks it)
        return operator.index(value)
    raise TypeError(f"{name}: got {value!r} of type {type(value).__name__}; expected an int")


def _overwrite(name: str, value) -> int:
    """``overwrite_*`` as f2py reads it: an int by ``__index__`` (no floats, no None)."""
    try:
        return _c_int(name, operator.index(value))
    except TypeError:
        raise TypeError(f"{name}: got {value!r} of type {type(value).__name__}; expected an int") from None


def _array(name: str, x, dtype: np.dtype):
    """An array argument as f2py takes it: an array of numbers not yet converted to ``dtype`` (the
    routine converts it once the call is valid; no copy), anything else made an array of ``dtype``
    as f2py makes it (a list of complex numbers for a real routine is a TypeError, as there)."""
    if is_cupy(x):
        return x
    if isinstance(x, np.ma.MaskedArray):  # f2py reads (and writes) its data, the mask left alone
        x = x.data
    if not isinstance(x, np.ndarray):
        try:
            return np.asarray(x, dtype=dtype)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: cannot make a {dtype.name} array of {type(x).__name__}: {e}") from None
    if x.dtype.kind in "OSU":  # numbers in an object or string array: converted here (f2py converts them too)
        try:
            x = x.astype(dtype)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: cannot convert the {x.dtype} array to {dtype.name}: {e}") from None
    elif x.dtype.kind not in "biufc":
        raise TypeError(f"{name}: got a {x.dtype} array; allowed: numbers (converted to {dtype.name})")
    return x


def _matrix(name: str, x):
    """An array as f2py reads a matrix (views): 0-d -> 1x1; 1-D -> a column ((0,) -> 1x0); N-D ->
    its dimensions other than 1, padded with 1s, when at most two are other than 1 and none is 0."""
    if x.ndim == 2:
        return x
    if x.ndim == 0:
        return x.reshape(1, 1)
    if x.ndim == 1:
        return x.reshape(-1, 1) if x.shape[0] else x.reshape(1, 0)
    rest = [d for d in x.shape if d != 1]
    if len(rest) > 2 or 0 in rest:
        raise ValueError(f"{name}: got a {x.ndim}-D array of shape {tuple(x.shape)}; allowed: a matrix "
                         f"(0-, 1- or 2-D, or N-D with at most two dimensions other than 1, none of them 0)")
    return x.reshape(*rest, *(1,) * (2 - len(rest)))


# ---------------------------------------------------------------- the routines

def _make(prefix: str, routine: str):
    sig = signature_of(routine)
    dtype = dtypes.BY_PREFIX[prefix].dtype
    name = prefix + routine
    hermitian = routine in ("herk", "her2k")
    impl = (level3.PREFIXED if routine == "gemm" else blas3.PREFIXED)[name]
    out_name = "b" if _FAMILY[routine] == "trmm" else "c"
    flags = tuple((k, top) for k, top in _FLAG_MAX.items() if k in sig.parameters)
    overwrite = "overwrite_" + out_name
    arrays = tuple(k for k in ("a", "b", "c") if k in sig.parameters)
    real_alpha = routine == "herk"
    fast, no = shortcut.make(routine, dtype), shortcut.NO

    def f(*args, **kwargs):
        try:
            res = fast(*args, **kwargs)
        except TypeError as e:
            if e.__traceback__.tb_next is not None:
                raise
            res = no  # the arguments do not bind: the full path says why
        if res is not no:
            return res
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{name}(): {e}; the signature is {name}{sig}") from None
        bound.apply_defaults()
        v = dict(bound.arguments)
        for k, top in flags:  # first, with f2py's range checks, as f2py does; a plain int in range is kept
            x = v[k]
            if type(x) is not int or not 0 <= x <= top:
                x = 0 if x is None else _flag(k, x)  # None: the default, as f2py takes it
                if not 0 <= x <= top:
                    raise ValueError(f"{k}: got {x}; allowed: 0 to {top}")
                v[k] = x
        v[overwrite] = int(_overwrite(overwrite, v[overwrite]) != 0)  # (f2py: any nonzero int asks for it)
        v["alpha"] = _scalar("alpha", v["alpha"], dtype, real_alpha)
        if "beta" in v:
            v["beta"] = _scalar("beta", 0.0 if v["beta"] is None else v["beta"], dtype, hermitian)
        out = None
        given = v.get(out_name)
        taken = []  # (name, shape given, matrix shape taken) of arguments of another rank
        for k in arrays:
            if v[k] is not None or k in ("a", "b"):  # (a and b are required: None is no array)
                x = _array(k, v[k], dtype)
                v[k] = _matrix(k, x)
                if x.ndim != 2:
                    taken.append(f"{k} of shape {x.shape} taken as {v[k].shape}")
                if k == out_name:
                    out = x
        if routine == "gemm":  # blasx.dgemm writes into a c of any layout: scipy only into an F one
            v["overwrite_c"] = blas3.written_in_place(out, dtype, v["overwrite_c"])
        if routine == "trmm":
            a, b = v["a"], v["b"]
            need = b.shape[0] if v["side"] == 0 else b.shape[1]
            if a.shape != (need, need) and need <= a.shape[1] <= a.shape[0]:
                v["a"] = a[:need, :need]  # scipy's wrapper: the leading block of a larger a
        if _FAMILY[routine] == "syr2k":  # scipy's wrapper: the leading block of a b with more rows (trans=0), or
            a, b = v["a"], v["b"]  # with more columns (trans != 0), than a
            longer = (b.shape[1] == a.shape[1] and b.shape[0] > a.shape[0]) if v["trans"] == 0 else (
                b.shape[0] == a.shape[0] and b.shape[1] > a.shape[1])
            if longer:
                v["b"] = b[:a.shape[0], :a.shape[1]]
        try:
            res = impl(*v.values())  # (v is in the signature's order, which impl's positional one is)
        except ValueError as e:  # (raised before any work) the shapes it names are the matrices taken
            if not taken:
                raise
            raise ValueError(f"{e} ({'; '.join(taken)}, as f2py takes them)") from None
        if isinstance(given, np.ma.MaskedArray) and res is v[out_name]:
            return given  # its data written in place: the caller's masked array back, as f2py gives it
        if out is None or out.ndim == 2:
            return res
        # f2py gives an output argument of another rank back in its own shape (itself when written in place)
        return out if res is v[out_name] else res.reshape(out.shape)

    f.__name__ = f.__qualname__ = name
    f.__signature__ = sig
    f.__doc__ = (f"{name} on blasx, with scipy.linalg.blas.{name}'s signature and conversions "
                 f"(see blasx.linalg.blas).\n\n" + (getattr(getattr(_sp, name, None), "__doc__", None) or ""))
    f.typecode = f.prefix = prefix
    f.dtype = dtype
    f.int_dtype = np.dtype(np.intc)
    f.module_name = MODULE_NAME
    return f


#: every level-3 function of this module, by scipy name
FUNCTIONS = {p + r: _make(p, r) for r, ps in LEVEL3.items() for p in ps}
globals().update(FUNCTIONS)


# ---------------------------------------------------------------- prefix selection

def _fortran(x) -> bool:
    flags = x.flags
    try:
        return bool(flags["FORTRAN"])
    except (KeyError, TypeError):
        return bool(flags.f_contiguous)


def find_best_blas_type(arrays=(), dtype=None):
    """(prefix, dtype, prefer_fortran) for these arrays (with none, ``dtype`` decides), by scipy's type
    scores (``checks.TYPE_SCORE``), as scipy.linalg.blas.find_best_blas_type."""
    dtype = np.dtype(dtype)
    max_score = TYPE_SCORE.get(dtype.char, 5)
    prefer_fortran = False
    if arrays:
        scores = [TYPE_SCORE.get(x.dtype.char, 5) for x in arrays]
        max_score = max(scores)
        prefer_fortran = _fortran(arrays[scores.index(max_score)])
        if max_score == 3 and 2 in scores:
            max_score = 4
    dt = BY_SCORE.get(max_score, dtypes.BY_PREFIX["d"].dtype)  # (scipy's fallback for other types: d)
    return dtypes.prefix(dt), dt, prefer_fortran


def get_blas_funcs(names, arrays=(), dtype=None, ilp64=False):
    """BLAS functions by name without prefix, as scipy.linalg.blas.get_blas_funcs: the level-3 ones
    blasx's, the others scipy's (which raises ValueError for unknown names)."""
    if isinstance(ilp64, str):
        if ilp64 != "preferred":
            raise ValueError(f"ilp64: got {ilp64!r}; allowed: True, False or 'preferred'")
        ilp64 = _sp.HAS_ILP64
    if ilp64 and not _sp.HAS_ILP64:
        raise RuntimeError("ilp64: BLAS ILP64 routine requested, but scipy was compiled only with 32-bit BLAS "
                           "(scipy.linalg.blas.HAS_ILP64 is False)")
    unpack = isinstance(names, str)
    names = (names,) if unpack else names
    prefix, _, _ = find_best_blas_type(arrays, dtype)
    ours = _ILP64 if ilp64 else FUNCTIONS
    funcs = [ours[prefix + name] if name in LEVEL3 and prefix in LEVEL3[name]
             else _sp.get_blas_funcs(name, arrays, dtype, ilp64=ilp64) for name in names]
    return funcs[0] if unpack else funcs


def _with_int64(fn):
    @functools.wraps(fn)  # (its attributes too: signature, typecode, prefix, dtype, module_name)
    def g(*args, **kwargs):
        return fn(*args, **kwargs)
    g.int_dtype = np.dtype(np.int64)
    return g


#: the level-3 functions an ILP64 request gets (``int_dtype`` int64)
_ILP64 = {name: _with_int64(fn) for name, fn in FUNCTIONS.items()}


# ---------------------------------------------------------------- everything else: scipy's

def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return getattr(_sp, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (nor has scipy.linalg.blas)") from None


def __dir__():
    return sorted(set(globals()) | {n for n in dir(_sp) if not n.startswith("__")})


__all__ = ["get_blas_funcs", "find_best_blas_type", *sorted(FUNCTIONS)]
