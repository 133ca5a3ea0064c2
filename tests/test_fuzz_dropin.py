"""Hypothesis fuzz of the drop-ins: ``blasx.linalg.blas`` against ``scipy.linalg.blas`` and
``blasx.matmul / dot / tensordot`` against numpy, on the CPU device and on two sims.

Each example builds the same arguments twice (fresh objects: array types, layouts, views, lists,
scalars, 0-size dimensions, flags by position or keyword, overwrite flags, read-only outputs),
calls the reference and blasx, and requires the same outcome: the same exception type (or a
subclass; ``ERROR_EQUIVALENTS`` for the reference's private classes), or a result of the same
type, shape and dtype whose values agree within a bound from the dtype, k and the operands'
norms, the same answer to "is the result the output argument itself", and the same set of
arguments written. ``ACCEPTED_DIFFERENCES`` lists where blasx may differ (scipy's behaviour
undefined, or a bug of f2py's) and what is checked there instead.

``BLASX_FUZZ_EXAMPLES=N`` sets every property's max_examples (100 a run; each run draws new examples);
``--hypothesis-seed=N`` reproduces a run; ``--hypothesis-show-statistics`` prints the outcome counts
(``event``) of each property.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import tempfile
import warnings

import numpy as np
import pytest
import scipy.linalg.blas as sp_blas
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import blasx
from blasx.linalg import blas as bx_blas

DEVICES = {"cpu": dict(devices="cpu"), "sim2": dict(devices="sim:2", tile=3)}

settings.register_profile(
    "blasx-fuzz", deadline=None, database=None, print_blob=True, derandomize=False,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


def fuzz_settings(examples: int):
    """The profile with ``examples`` (or $BLASX_FUZZ_EXAMPLES) examples."""
    n = int(os.environ.get("BLASX_FUZZ_EXAMPLES", "0")) or examples
    return settings(settings.get_profile("blasx-fuzz"), max_examples=n)


@pytest.fixture(params=list(DEVICES))
def device(request):
    """The engine on this device set; conftest puts the settings back and shuts it down after."""
    blasx.configure(**DEVICES[request.param])
    return request.param


# ---------------------------------------------------------------- outcomes

class Outcome:
    """What one call did: its result or exception, and what BLAS printed (an illegal argument)."""

    def __init__(self, result=None, error=None, printed=""):
        self.result, self.error, self.printed = result, error, printed

    @property
    def illegal(self) -> bool:
        return "illegal value" in self.printed


try:
    _LIBC = ctypes.CDLL(None)  # for fflush(NULL): xerbla writes with C stdio
except OSError:
    _LIBC = None
_SINK = tempfile.TemporaryFile()
atexit.register(_SINK.close)


def call(fn, *args, **kwargs) -> Outcome:
    """``fn(*args, **kwargs)`` with C-level stdout / stderr captured (BLAS's xerbla prints there)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    _SINK.seek(0)
    _SINK.truncate()
    os.dup2(_SINK.fileno(), 1)
    os.dup2(_SINK.fileno(), 2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = Outcome(result=fn(*args, **kwargs))
    except Exception as e:  # noqa: BLE001 - the exception is the outcome compared
        out = Outcome(error=e)
    finally:
        if _LIBC is not None:
            _LIBC.fflush(None)
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    _SINK.seek(0)
    out.printed = _SINK.read().decode(errors="replace")
    return out


def _public_base(t: type) -> type:
    """The first class of t's MRO that users can name (numpy's private exception classes, f2py's)."""
    for c in t.__mro__:
        if c.__module__ in ("builtins", "numpy.exceptions", "numpy"):
            return c
    return Exception


#: reference exception classes that blasx cannot raise itself, and what it raises instead
ERROR_EQUIVALENTS = {
    # f2py's module-private ``_fblas.error`` (a bad shape or flag value): ValueError naming the parameter
    "_fblas.error": ValueError,
}


def assert_same_error(ref: BaseException, got: Outcome, what: str):
    assert got.error is not None, f"{what}: the reference raised {ref!r}, blasx returned {got.result!r}"
    name = f"{type(ref).__module__}.{type(ref).__qualname__}".removeprefix("builtins.")
    allowed = ERROR_EQUIVALENTS.get(name) or _public_base(type(ref))
    assert isinstance(got.error, allowed), (
        f"{what}: the reference raised {type(ref).__name__}({ref}), blasx raised "
        f"{type(got.error).__name__}({got.error}); expected a {allowed.__name__}")


def wide(x) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.complex128 if x.dtype.kind == "c" else np.float64)


def assert_close(got, ref, bound: float, what: str):
    """Same type, shape and dtype; values within ``bound`` in the Frobenius norm (exact for
    integer and bool results); NaN and inf where the reference has them."""
    assert type(got) is type(ref), f"{what}: result type {type(got).__name__}, reference {type(ref).__name__}"
    g, r = np.asarray(got), np.asarray(ref)
    assert g.shape == r.shape, f"{what}: shape {g.shape}, reference {r.shape}"
    assert g.dtype == r.dtype, f"{what}: dtype {g.dtype}, reference {r.dtype}"
    if r.dtype.kind in "biu":
        assert np.array_equal(g, r), f"{what}: values differ from the reference's"
        return
    gw, rw = wide(g), wide(r)
    fin = np.isfinite(rw)
    assert np.array_equal(np.isfinite(gw), fin), f"{what}: NaN / inf differ from the reference's"
    err = float(np.linalg.norm(gw[fin] - rw[fin])) if fin.any() else 0.0
    assert err <= bound, f"{what}: ||blasx - ref||_F = {err:.3g} > {bound:.3g}"


# ---------------------------------------------------------------- operands

INPUT_DTYPES = ("float32", "float64", "complex64", "complex128", "float16", "longdouble", "clongdouble",
                "int8", "int32", "int64", "uint8", "uint16", "bool")
BLAS_INPUT_DTYPES = ("float32", "float64", "complex64", "complex128")


def _values(rng, shape, dtype: np.dtype, diag_boost: float = 0.0) -> np.ndarray:
    """Random entries of ``dtype`` (small ints for integer types); ``diag_boost`` strengthens the diagonal."""
    if dtype.kind == "b":
        x = rng.random(shape) < 0.5
    elif dtype.kind == "u":
        x = rng.integers(0, 5, shape)
    elif dtype.kind == "i":
        x = rng.integers(-3, 4, shape)
    elif dtype.kind == "c":
        x = rng.uniform(-1, 1, shape) + 1j * rng.uniform(-1, 1, shape)
    else:
        x = rng.uniform(-1, 1, shape)
    if diag_boost and dtype.kind != "b" and len(shape) == 2:
        i = np.arange(min(shape))
        x[i, i] = np.where(np.real(x[i, i]) < 0, -1, 1) * diag_boost + x[i, i]
    return np.asarray(x).astype(dtype)


def f2py_shape(shape) -> tuple | None:
    """The matrix shape f2py makes of an argument of this shape: 0-d 1x1, 1-D a column ((0,) is
    1x0), N-D its non-unit dimensions padded with 1s (None: f2py raises ValueError)."""
    shape = tuple(shape)
    if len(shape) == 2:
        return shape
    if len(shape) == 1:
        return (shape[0], 1) if shape[0] else (1, 0)
    if len(shape) > 2 and 0 in shape:
        return None
    rest = [d for d in shape if d != 1]
    if len(rest) > 2:
        return None
    return tuple(rest + [1] * (2 - len(rest)))


class Operand:
    """A recipe for one array argument: ``make()`` builds a fresh (object, buffer) pair each time;
    the buffer is the ndarray whose memory the argument uses (None for lists and scalars)."""

    def __init__(self, shape, dtype, form, seed, diag_boost=0.0, axis=0):
        self.shape, self.dtype, self.form, self.seed = tuple(shape), np.dtype(dtype), form, seed
        self.diag_boost, self.axis = diag_boost, axis

    def __repr__(self):
        return f"Operand({self.shape}, {self.dtype.name}, {self.form})"

    def make(self):
        rng = np.random.default_rng(self.seed)
        shape, dt, form = self.shape, self.dtype, self.form
        x = _values(rng, shape, dt, self.diag_boost)
        if x.ndim == 0 and form not in ("list", "zero_d", "scalar"):
            x = np.array(x)
            if form == "readonly":
                x.flags.writeable = False
            return x, x
        if form == "F":
            x = np.asfortranarray(x)
            return x, x
        if form == "C":
            x = np.ascontiguousarray(x)
            return x, x
        if form == "strided":
            base = _values(rng, tuple(2 * d + 1 for d in shape), dt)
            view = base[tuple(slice(1, 2 * d + 1, 2) for d in shape)]
            view[...] = x
            return view, base
        if form == "T":
            base = np.ascontiguousarray(np.swapaxes(x, -1, -2)) if x.ndim >= 2 else x.copy()
            return (np.swapaxes(base, -1, -2) if x.ndim >= 2 else base), base
        if form == "neg":
            base = np.flip(x).copy()
            return np.flip(base), base
        if form == "readonly":
            x = np.asfortranarray(x)
            x.flags.writeable = False
            return x, x
        if form == "bcast":
            row = x[..., :1, :].copy() if x.ndim >= 2 else x[:1].copy()
            return np.broadcast_to(row, shape), row
        if form == "list":
            return x.tolist(), None
        if form == "vector":  # a column as 1-D
            v = x.reshape(-1).copy()
            return v, v
        if form == "zero_d":
            z = np.asarray(x.reshape(-1)[0] if x.size else dt.type(0), dtype=dt)
            return z, z
        if form == "scalar":
            return (x.reshape(-1)[0].item() if x.size else 0.0), None
        if form == "unit_axis":
            base = np.asfortranarray(x)
            return np.expand_dims(base, self.axis), base
        raise AssertionError(form)


def form_shape(shape, form, axis=0) -> tuple:
    """The shape of the object an Operand of this shape and form makes."""
    if form == "list":
        return np.asarray(np.zeros(shape).tolist()).shape
    if form == "vector":
        return (int(np.prod(shape)),)
    if form in ("zero_d", "scalar"):
        return ()
    if form == "unit_axis":
        return np.expand_dims(np.zeros(shape), axis).shape
    return tuple(shape)


def forms_for(shape) -> list[str]:
    """The forms of an argument meaning a matrix of this shape (some f2py reads as another shape)."""
    forms = ["F", "C", "strided", "T", "neg", "readonly", "bcast", "list"]
    if shape[1] == 1:
        forms.append("vector")
    if shape == (1, 1):
        forms += ["zero_d", "scalar"]
    forms.append("unit_axis")
    return forms


# ---------------------------------------------------------------- blasx.linalg.blas vs scipy.linalg.blas

LEVEL3 = {"gemm": "sdcz", "symm": "sdcz", "hemm": "cz", "syrk": "sdcz", "herk": "cz",
          "syr2k": "sdcz", "her2k": "cz", "trmm": "sdcz", "trsm": "sdcz"}
PREFIX_DTYPE = {"s": np.dtype(np.float32), "d": np.dtype(np.float64),
                "c": np.dtype(np.complex64), "z": np.dtype(np.complex128)}
FAMILY = {"gemm": "gemm", "symm": "symm", "hemm": "symm", "syrk": "syrk", "herk": "syrk",
          "syr2k": "syr2k", "her2k": "syr2k", "trmm": "trmm", "trsm": "trmm"}
#: scipy's parameters per family, in order: (name, default)
PARAMS = {
    "gemm": (("alpha", None), ("a", None), ("b", None), ("beta", 0.0), ("c", None), ("trans_a", 0),
             ("trans_b", 0), ("overwrite_c", 0)),
    "symm": (("alpha", None), ("a", None), ("b", None), ("beta", 0.0), ("c", None), ("side", 0), ("lower", 0),
             ("overwrite_c", 0)),
    "syrk": (("alpha", None), ("a", None), ("beta", 0.0), ("c", None), ("trans", 0), ("lower", 0),
             ("overwrite_c", 0)),
    "syr2k": (("alpha", None), ("a", None), ("b", None), ("beta", 0.0), ("c", None), ("trans", 0), ("lower", 0),
              ("overwrite_c", 0)),
    "trmm": (("alpha", None), ("a", None), ("b", None), ("side", 0), ("lower", 0), ("trans_a", 0), ("diag", 0),
             ("overwrite_b", 0)),
}
FLAG_NAMES = ("trans_a", "trans_b", "trans", "side", "lower", "diag")

#: Calls where blasx differs from scipy on purpose, each checked as described.
ACCEPTED_DIFFERENCES = {
    # scipy hands BLAS a value it rejects (xerbla prints "parameter number N had an illegal value" and
    # scipy returns c or zeros unchanged): zherk / zher2k trans=1, zsyrk / zsyr2k trans=2, a leading
    # dimension of 0 (a 0 x n operand); found by what BLAS prints during scipy's call. blasx may raise
    # ValueError or return; where scipy's result is empty and only a leading dimension was rejected,
    # it must return that result
    "blas_illegal_value": "BLAS rejected an argument scipy passed through",
    # f2py checks only some dimensions: ?symm / ?hemm take m from a (not b) and accept a non-square
    # a or a b with more rows, ?syr2k / ?her2k accept a and b of different shapes; BLAS then reads a
    # leading block through the leading dimension. blasx takes these as the shape errors they are.
    "leading_block": "scipy's BLAS reads a leading block of a mismatched operand",
    # ?syr2k / ?her2k with trans != 0 and b with fewer columns than a: BLAS reads past b's end
    # (nothing checks it); scipy is not called (it may crash), blasx must raise
    "out_of_bounds": "scipy's BLAS would read past the end of b",
    # an array argument that is no ndarray and that numpy cannot make an array of the routine's dtype
    # (a list of complex numbers, or a complex Python scalar, for a real routine): f2py raises numpy's
    # TypeError but drops a reference to the routine's dtype on every such call (scipy 1.17), which
    # crashes the process after a few thousand; scipy is not called, blasx must raise numpy's error
    "conversion_fails": "f2py leaks a dtype reference on a failed conversion",
    # f2py's handling of a c of size 0 is erratic: it rejects one of the result's shape ("unexpected
    # array size: new_size=1, got array with arr_size=0") and takes a 1-D one of length 0 for a 2 x 0
    # result; blasx takes a c of size 0 as any other c: either may raise ValueError where the other
    # returns an empty result
    "empty_c": "f2py mishandles a c of size 0",
    # with overwrite_c (overwrite_b), f2py writes into a read-only c (b) and returns it; blasx leaves
    # it unwritten and returns a new array of the same values (issue 19: a read-only c is copied)
    "readonly_in_place": "scipy writes into a read-only output",
}


def _flag_int(v) -> int:
    """The value f2py gives an int flag (0 for what it would reject: the shapes then do not matter)."""
    if isinstance(v, list):
        v = v[0]
    if isinstance(v, complex):
        v = v.real
    try:
        return int(v) if v is not None else 0
    except (TypeError, ValueError):
        return 0


@st.composite
def scalars(draw, optional=False, odd=False, real=False):
    """alpha / beta as users write them: Python and numpy numbers, 0-d and 1-element arrays, bools,
    complex values (real routines discard the imaginary part), None (the default); with ``odd``
    what f2py also converts or rejects (strings, sequences, arrays of other sizes)."""
    kind = draw(st.sampled_from(["zero", "one", "real", "int", "complex"]))
    v = {"zero": 0.0, "one": 1.0, "int": draw(st.integers(-3, 3)),
         "real": draw(st.sampled_from([0.5, -1.25, 2.0, 1e-3])),
         "complex": draw(st.sampled_from([0.5 - 1.5j, 1j, 2 + 0j]))}[kind]
    forms = ["py"] * 4 + ["np", "zero_d", "one_elem", "bool"] + (["none"] if optional else [])
    form = draw(st.sampled_from(forms + ["str", "bad_str", "two_elem", "empty", "list", "none"] if odd else forms))
    if form == "np":
        t = np.complex128 if isinstance(v, complex) else draw(st.sampled_from([np.float32, np.float64, np.int64]))
        return t(v) if not (t is np.int64 and isinstance(v, float)) else np.float64(v)
    if form == "zero_d":  # (complex for a real routine: an IndexError in scipy, so odd)
        return np.asarray(v) if odd or not real or not isinstance(v, complex) else np.asarray([v])
    if form == "one_elem":
        return np.asarray([v])
    if form == "bool":
        return bool(v)
    if form == "none":
        return None
    if form == "str":
        return str(v)
    if form == "bad_str":
        return "one"
    if form == "two_elem":
        return np.asarray([v, 2 * v])
    if form == "empty":
        return np.zeros(0)
    if form == "list":
        return [v]
    return v


@st.composite
def flags(draw, name, odd=False):
    """An int flag as users write it: ints, bools, numpy ints and 0-d arrays, floats, numeric
    strings, complex numbers, one-element lists (f2py takes them all), None (the default); with
    ``odd`` out-of-range values and what f2py rejects."""
    if name.startswith("overwrite"):
        if odd:
            return draw(st.sampled_from([1.0, None, "1", [1], 2**40]))
        return draw(st.sampled_from([0, 1, True, np.int64(1), np.asarray(1)]))
    hi = 2 if name.startswith("trans") else 1
    if odd:
        return draw(st.sampled_from([-1, hi + 1, "x", 2**40, np.int64(-1)]))
    v = draw(st.integers(0, hi))
    form = draw(st.sampled_from(["int"] * 6 + ["bool", "np", "zero_d", "float", "str", "complex", "list", "none"]))
    if form == "bool" and v in (0, 1):
        return bool(v)
    return {"np": np.int32(v), "zero_d": np.asarray(v), "float": v + 0.25, "str": str(v), "complex": complex(v),
            "list": [v], "none": None}.get(form, v)


def _shapes(routine, fl, m, n, k):
    """The matrix shapes of a consistent call: {operand: shape}."""
    fam = FAMILY[routine]
    if fam == "gemm":
        ta, tb = _flag_int(fl.get("trans_a")), _flag_int(fl.get("trans_b"))
        return {"a": (k, m) if ta else (m, k), "b": (n, k) if tb else (k, n), "c": (m, n)}
    if fam == "symm":
        s = n if _flag_int(fl.get("side")) else m
        return {"a": (s, s), "b": (m, n), "c": (m, n)}
    if fam in ("syrk", "syr2k"):
        a = (k, n) if _flag_int(fl.get("trans")) else (n, k)
        return {"a": a, "b": a, "c": (n, n)} if fam == "syr2k" else {"a": a, "c": (n, n)}
    s = n if _flag_int(fl.get("side")) else m
    return {"a": (s, s), "b": (m, n)}


@st.composite
def blas_calls(draw, name):
    """One call of ``name`` (e.g. 'dgemm'): (positional args recipe, keyword args recipe, info)."""
    prefix, routine = name[0], name[1:]
    fam = FAMILY[routine]
    params = PARAMS[fam]
    # at most one kind of odd argument per call, so that the error each library raises first is the same one
    odd = draw(st.sampled_from(["none"] * 6 + ["shape", "scalar", "flag", "cast"]))
    given = {}
    flag_names = [p for p, _ in params if p in FLAG_NAMES or p.startswith("overwrite")]
    odd_flag = draw(st.sampled_from(flag_names)) if odd == "flag" else None
    for p in flag_names:
        if p == odd_flag or draw(st.booleans()):
            given[p] = draw(flags(p, odd=p == odd_flag))
    odd_scalar = draw(st.sampled_from(["alpha", "beta"] if "beta" in dict(params) else ["alpha"])) \
        if odd == "scalar" else None
    real = prefix in "sd"
    given["alpha"] = draw(scalars(odd=odd_scalar == "alpha", real=real))
    if "beta" in dict(params) and (odd_scalar == "beta" or draw(st.booleans())):
        given["beta"] = draw(scalars(optional=True, odd=odd_scalar == "beta", real=real))
    m, n, k = (draw(st.integers(0, 6)) for _ in range(3))
    size = draw(st.integers(0, 9))
    if size == 0:
        m, n, k = (draw(st.sampled_from([0, 1])) for _ in range(3))
    elif size == 1:  # up to 4 x 4 tiles on the sims
        m, n, k = (draw(st.integers(7, 12)) for _ in range(3))
    shapes = _shapes(routine, given, m, n, k)
    if "c" not in dict(params) or not draw(st.booleans()):
        shapes.pop("c", None)
    if routine == "trmm" and draw(st.integers(0, 4)) == 0:  # scipy's wrapper takes a larger a (its leading block)
        s = shapes["a"][0]
        r = s + draw(st.integers(0, 2))
        shapes["a"] = (r, draw(st.integers(s, r)))
    if odd == "shape":  # one operand of a random shape: mostly a shape error
        op = draw(st.sampled_from(sorted(shapes)))
        shapes[op] = (draw(st.integers(0, 5)), draw(st.integers(0, 5)))
    ops = {}
    cast_op = draw(st.sampled_from(sorted(shapes))) if odd == "cast" and prefix in "sd" else None
    for op, shape in shapes.items():
        dt = draw(st.sampled_from(INPUT_DTYPES if draw(st.integers(0, 2)) == 0 else
                                  (PREFIX_DTYPE[prefix].name,) * 3 + BLAS_INPUT_DTYPES))
        axis = draw(st.integers(0, 2))
        forms = forms_for(shape)
        if odd != "shape":  # forms f2py reads as a matrix of another shape are odd too
            forms = [f for f in forms if f2py_shape(form_shape(shape, f, axis)) == shape]
        form = draw(st.sampled_from(forms))
        if op == cast_op:  # complex numbers in no array: a TypeError for a real routine
            dt, form = draw(st.sampled_from(["complex64", "complex128"])), draw(st.sampled_from(["list", "scalar"]
                                                                                                 if shape == (1, 1) else ["list"]))
        elif form in ("list", "scalar") and np.dtype(dt).kind == "c" and prefix in "sd":
            dt = "float64"
        boost = float(max(shape) + 1) if (routine == "trsm" and op == "a") else 0.0
        ops[op] = Operand(shape, dt, form, draw(st.integers(0, 2**31)), boost, axis)
    if "c" in dict(params) and "c" not in ops and draw(st.integers(0, 5)) == 0:
        given["c"] = None  # the default spelled out
    values = dict(given)
    values.update(ops)
    names = [p for p, _ in params]
    last = max(names.index(p) for p in values)
    required = 3 if fam in ("gemm", "symm", "syr2k", "trmm") else 2
    npos = draw(st.integers(required, last + 1))
    pos = [values.get(p, d) for p, d in params[:npos]]
    kw = {p: v for p, v in values.items() if names.index(p) >= npos}
    return pos, kw, dict(prefix=prefix, routine=routine, ops=ops, values=values)


def _operand_name(info, v):
    for name, op in info["ops"].items():
        if op is v:
            return name
    return None


def build_call(pos, kw, info):
    made = {}

    def one(v):
        name = _operand_name(info, v) if isinstance(v, Operand) else None
        if name is not None:
            made[name] = v.make()
            return made[name][0]
        return v.copy() if isinstance(v, np.ndarray) else v
    return [one(v) for v in pos], {p: one(v) for p, v in kw.items()}, made


def _as_matrix(x, dtype):
    """The matrix f2py makes of an argument (for the error bound)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
        a = np.asarray(x).astype(dtype)
    return a.reshape(f2py_shape(a.shape))


def _scalar_abs(v) -> float:
    try:
        return abs(complex(np.asarray(v).reshape(-1)[0])) if v is not None else 0.0
    except (TypeError, ValueError, IndexError):
        return 0.0


def blas_bound(info, made, ref) -> float | None:
    """The error bound of a call's result: 64 eps (k + 2) times (||ref|| + |alpha| ||a|| ||b|| (2x for
    rank-2k) + |beta| ||c||), and for ?trsm ||ref|| cond(op(a)); None where that is not a useful bound."""
    dt = PREFIX_DTYPE[info["prefix"]]
    eps = float(np.finfo(dt).eps)
    mats = {o: _as_matrix(made[o][0], dt) for o in made}
    k = max([max(mt.shape) for mt in mats.values()] + [1])
    r = wide(ref)
    if info["routine"] == "trsm":
        a = wide(mats["a"])
        t = np.tril(a) if _flag_int(info["values"].get("lower")) else np.triu(a)
        if _flag_int(info["values"].get("diag")):
            np.fill_diagonal(t, 1)
        if t.size == 0:
            return 0.0
        with np.errstate(all="ignore"):
            cond = float(np.linalg.cond(t))
        if not np.isfinite(cond) or cond * eps > 1e-3:
            return None
        return 64 * eps * (k + 2) * cond * (float(np.linalg.norm(r)) + 1.0)
    na = float(np.linalg.norm(wide(mats["a"])))
    nb = float(np.linalg.norm(wide(mats["b"]))) if "b" in mats else na
    nc = float(np.linalg.norm(wide(mats["c"]))) if "c" in mats else 0.0
    two = 2.0 if FAMILY[info["routine"]] == "syr2k" else 1.0
    scale = (float(np.linalg.norm(r)) + two * _scalar_abs(info["values"]["alpha"]) * na * nb
             + _scalar_abs(info["values"].get("beta")) * nc)
    return 64 * eps * (k + 2) * scale


def _scipy_case(info, made) -> str | None:
    """The ACCEPTED_DIFFERENCES key a call has by its arguments (known before calling scipy), else None."""
    routine, v = info["routine"], info["values"]
    for obj, _ in made.values():
        if not isinstance(obj, np.ndarray):
            try:
                np.asarray(obj, dtype=PREFIX_DTYPE[info["prefix"]])
            except (TypeError, ValueError):
                return "conversion_fails"
    shapes = {o: f2py_shape(np.shape(obj)) for o, (obj, _) in made.items()}
    if any(s is None for s in shapes.values()):
        return None
    fam = FAMILY[routine]
    if fam == "syr2k" and _flag_int(v.get("trans")) and shapes["b"][1] < shapes["a"][1]:
        return "out_of_bounds"
    if fam == "symm":
        a, b = shapes["a"], shapes["b"]
        side = _flag_int(v.get("side"))
        if a[0] != a[1] or (b[1] if side else b[0]) != a[0]:
            return "leading_block"
    if fam == "syr2k" and shapes["a"] != shapes["b"]:
        return "leading_block"
    return None


#: the positions of lda, ldb, ldc in each family's BLAS parameter list (xerbla names the position)
LEADING_DIMENSIONS = {"gemm": (8, 10, 13), "symm": (7, 9, 12), "syrk": (7, 10), "syr2k": (7, 9, 12), "trmm": (9, 11)}


def _bad_parameter(printed: str) -> int | None:
    """The parameter number in BLAS's "parameter number N had an illegal value"."""
    words = printed.split("parameter number", 1)
    try:
        return int(words[1].split()[0]) if len(words) == 2 else None
    except (ValueError, IndexError):
        return None


def _written(made, before) -> set:
    return {o for o, (_, buf) in made.items()
            if buf is not None and not np.array_equal(buf, before[o], equal_nan=True)}


def _output_name(info) -> str:
    return "b" if FAMILY[info["routine"]] == "trmm" else "c"


def check_blas_call(name, pos, kw, info):
    note(f"{name}(*{pos!r}, **{kw!r})")
    sp_fn, bx_fn = getattr(sp_blas, name), getattr(bx_blas, name)
    out_name = _output_name(info)
    bargs, bkw, bmade = build_call(pos, kw, info)
    case = _scipy_case(info, bmade)
    bbefore = {o: buf.copy() for o, (_, buf) in bmade.items() if buf is not None}
    if case in ("out_of_bounds", "conversion_fails"):
        got = call(bx_fn, *bargs, **bkw)
        event(f"{name}: {case}: blasx raises")
        assert got.error is not None, f"{name}: {ACCEPTED_DIFFERENCES[case]}; blasx gave {got.result!r}"
        if case == "conversion_fails":
            assert isinstance(got.error, (TypeError, ValueError)), f"{name}: {got.error!r}"
        assert not _written(bmade, bbefore), f"{name}: a rejected call wrote {_written(bmade, bbefore)}"
        return
    sargs, skw, smade = build_call(pos, kw, info)
    sbefore = {o: buf.copy() for o, (_, buf) in smade.items() if buf is not None}
    ref = call(sp_fn, *sargs, **skw)
    got = call(bx_fn, *bargs, **bkw)
    assert not got.illegal, f"{name}: blasx handed BLAS an illegal value: {got.printed}"
    bwritten = _written(bmade, bbefore)
    if ref.illegal and ref.error is None and np.size(ref.result) == 0 and case != "leading_block" \
            and _bad_parameter(ref.printed) in LEADING_DIMENSIONS[FAMILY[info["routine"]]]:
        # BLAS rejects a leading dimension of 0 (m = 0) before doing nothing: the result is defined
        event(f"{name}: empty result, BLAS rejects lda = 0")
        assert got.error is None, f"{name}: scipy returned an empty {ref.result.shape} result, blasx raised {got.error!r}"
        assert (got.result.shape, got.result.dtype) == (ref.result.shape, ref.result.dtype), name
        return
    if ref.illegal:
        event(f"{name}: scipy passes an illegal value to BLAS; blasx "
              f"{'raises ' + type(got.error).__name__ if got.error else 'returns'}")
        assert got.error is None or isinstance(got.error, ValueError), f"{name}: {got.error!r}"
        if got.error is not None:
            assert not bwritten, f"{name}: a rejected call wrote {bwritten}"
        return
    empty_c = "c" in bmade and np.size(bmade["c"][0]) == 0
    if empty_c and ref.error is not None and got.error is None and isinstance(ref.error, ValueError):
        event(f"{name}: empty_c: blasx returns")
        assert np.size(got.result) == 0, f"{name}: result {np.shape(got.result)}"
        return
    if empty_c and ref.error is None and isinstance(got.error, ValueError):
        event(f"{name}: empty_c: blasx raises")
        assert np.size(ref.result) == 0 and not bwritten, name
        return
    if ref.error is not None:
        event(f"{name}: both raise")
        assert_same_error(ref.error, got, name)
        assert not bwritten, f"{name}: a rejected call wrote {bwritten}"
        return
    if got.error is not None and case == "leading_block" and isinstance(got.error, ValueError):
        event(f"{name}: {case}: blasx raises ValueError")
        assert not bwritten, f"{name}: a rejected call wrote {bwritten}"
        return
    assert got.error is None, (f"{name}: scipy returned a {ref.result.dtype} {ref.result.shape} result, "
                               f"blasx raised {type(got.error).__name__}: {got.error}")
    event(f"{name}: both return")
    bound = blas_bound(info, smade, ref.result)
    if bound is None:  # a singular or ill-conditioned triangle: where the infs and NaNs land is BLAS's own
        event(f"{name}: singular triangle: shapes and dtypes compared")
        assert (np.shape(got.result), got.result.dtype) == (np.shape(ref.result), ref.result.dtype), name
    else:
        assert_close(got.result, ref.result, bound, name)
    assert got.result.flags.f_contiguous == ref.result.flags.f_contiguous, f"{name}: F-order differs"
    s_is = out_name in smade and ref.result is smade[out_name][0]
    b_is = out_name in bmade and got.result is bmade[out_name][0]
    swritten = _written(smade, sbefore)
    if s_is and not b_is and not getattr(smade[out_name][0].flags, "writeable", True):
        event(f"{name}: readonly_in_place: blasx copies")
        s_is = False
        swritten.discard(out_name)
    assert s_is == b_is, f"{name}: the result is {out_name}: scipy {s_is}, blasx {b_is}"
    assert bwritten == swritten, f"{name}: wrote {sorted(bwritten)}, scipy wrote {sorted(swritten)}"


BLAS_NAMES = [p + r for r, ps in LEVEL3.items() for p in ps]
ROUTINES = list(LEVEL3)


@pytest.mark.parametrize("routine", ROUTINES)
@fuzz_settings(100)
@given(data=st.data())
def test_linalg_blas_matches_scipy(routine, device, data):
    """Every prefix of one level-3 routine, random argument forms, against scipy.linalg.blas."""
    name = data.draw(st.sampled_from([p + routine for p in LEVEL3[routine]]), label="name")
    pos, kw, info = data.draw(blas_calls(name), label="call")
    check_blas_call(name, pos, kw, info)


# ---------------------------------------------------------------- blasx.matmul / dot / tensordot vs numpy

NUMPY_DTYPES = ("float32", "float64", "complex64", "complex128", "float16", "int32", "int64", "uint8", "bool")
ARRAY_FORMS = ("F", "C", "strided", "T", "neg", "readonly", "bcast", "list")


@st.composite
def arrays(draw, shape, dtype=None):
    """An operand of this shape: a random dtype (a BLAS one mostly) and layout, or a nested list."""
    dt = dtype or draw(st.sampled_from(BLAS_INPUT_DTYPES * 2 + NUMPY_DTYPES))
    forms = [f for f in ARRAY_FORMS if len(shape) >= 2 or f not in ("T", "bcast")]
    if len(shape) == 0:
        forms = ["C", "zero_d", "scalar"]
    return Operand(shape, dt, draw(st.sampled_from(forms)), draw(st.integers(0, 2**31)))


def _ref_bound(ref, *xs) -> float:
    """64 eps (k + 2) (||ref|| + prod ||x||): the error bound of a product of these operands."""
    r = np.asarray(ref)
    if r.dtype.kind not in "fc":
        return 0.0
    eps = float(np.finfo(r.dtype).eps)
    k = max([max(np.shape(x) or (1,)) for x in xs] + [1])
    prod = 1.0
    for x in xs:
        prod *= float(np.linalg.norm(wide(x).reshape(-1)))
    return 64 * eps * (k + 2) * (float(np.linalg.norm(wide(r).reshape(-1))) + prod)


def _make_all(recipes: dict):
    made = {n: r.make() for n, r in recipes.items()}
    return made, {n: buf.copy() for n, (_, buf) in made.items() if buf is not None}


@st.composite
def out_arrays(draw, shape, dtype):
    """``out=``: right (C, F or a strided view), or wrong (shape, dtype that cannot be cast, read-only)."""
    kind = draw(st.sampled_from(["C", "F", "strided", "C", "wrong_shape", "wrong_dtype", "narrow_dtype",
                                 "readonly"]))
    dt = np.dtype(dtype)
    if kind == "wrong_shape":
        shape = tuple(shape) + (2,) if draw(st.booleans()) or not shape else tuple(shape[:-1]) + (shape[-1] + 1,)
    if kind == "wrong_dtype":
        dt = np.dtype(np.int32) if dt.kind in "fc" else np.dtype(np.bool_)
    if kind == "narrow_dtype":
        dt = {"f": np.dtype(np.float16), "c": np.dtype(np.complex64)}.get(dt.kind, np.dtype(np.float32))
    form = {"F": "F", "strided": "strided", "readonly": "readonly"}.get(kind, "C")
    if len(shape) < 2 and form == "F":
        form = "C"
    return Operand(shape, dt, form, draw(st.integers(0, 2**31)))


def check_numpy_call(what, np_fn, bx_fn, recipes, kwargs, bound_of=None):
    """Both functions on fresh operands: same error, or same result and writes (out included)."""
    note(f"{what}({recipes!r}, {kwargs!r})")
    smade, sbefore = _make_all(recipes)
    bmade, bbefore = _make_all(recipes)
    names = list(recipes)
    pos = [n for n in names if n != "out"]
    ref = call(np_fn, *[smade[n][0] for n in pos], **kwargs, **({"out": smade["out"][0]} if "out" in smade else {}))
    got = call(bx_fn, *[bmade[n][0] for n in pos], **kwargs, **({"out": bmade["out"][0]} if "out" in bmade else {}))
    bwritten = _written(bmade, bbefore)
    if ref.error is not None:
        event(f"{what}: both raise")
        assert_same_error(ref.error, got, what)
        assert not bwritten - {"out"}, f"{what}: a rejected call wrote {bwritten}"
        return
    assert got.error is None, f"{what}: numpy returned {ref.result!r}, blasx raised {got.error!r}"
    event(f"{what}: both return{' into out' if 'out' in recipes else ''}")
    bound = _ref_bound(ref.result, *[smade[n][0] for n in pos])
    assert_close(got.result, ref.result, bound, what)
    if "out" in recipes:
        assert (got.result is bmade["out"][0]) == (ref.result is smade["out"][0]), f"{what}: result is out differs"
    swritten = _written(smade, sbefore)
    assert bwritten == swritten, f"{what}: wrote {sorted(bwritten)}, numpy wrote {sorted(swritten)}"
    if "out" in recipes:
        assert_close(bmade["out"][1], smade["out"][1], bound, f"{what}: out")


def _core(draw, n):
    return [draw(st.integers(0, 4)) for _ in range(n)]


@fuzz_settings(100)
@given(data=st.data())
def test_matmul_matches_numpy(device, data):
    """blasx.matmul vs np.matmul: 1-D..4-D operands, broadcast batches, dtypes, layouts, 0-size, out=."""
    d = data.draw
    m, k, n = _core(d, 3)
    batch = tuple(_core(d, d(st.integers(0, 2))))
    nda, ndb = d(st.integers(1, 4)), d(st.integers(1, 4))

    def shape(nd, core):
        if nd == 1:
            return (core[1],) if core is ak else (core[0],)
        b = batch[len(batch) - min(nd - 2, len(batch)):] if nd > 2 else ()
        b = tuple(x if d(st.integers(0, 3)) else 1 for x in b)
        return (1,) * (nd - 2 - len(b)) + b + tuple(core)
    ak, bk = (m, k), (k, n)
    sa, sb = shape(nda, ak), shape(ndb, bk)
    if d(st.integers(0, 6)) == 0:  # a mismatch
        sb = tuple(x + 1 if i == len(sb) - (2 if len(sb) > 1 else 1) else x for i, x in enumerate(sb))
    recipes = {"a": d(arrays(sa)), "b": d(arrays(sb))}
    kwargs = {}
    if d(st.integers(0, 4)) == 0:  # the ufunc keywords that pick the computation type
        kwargs["dtype"] = d(st.sampled_from([np.float32, "float64", np.dtype(np.complex64), complex, np.int64]))
    if d(st.integers(0, 4)) == 0:
        kwargs["casting"] = d(st.sampled_from(["same_kind", "unsafe", "safe", "no"]))
    if d(st.integers(0, 2)) == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                probe = np.matmul(recipes["a"].make()[0], recipes["b"].make()[0], **kwargs)
                recipes["out"] = d(out_arrays(np.shape(probe), np.result_type(probe)))
            except (TypeError, ValueError):
                recipes["out"] = d(out_arrays((m, n), np.float64))
    check_numpy_call("matmul", np.matmul, blasx.matmul, recipes, kwargs)


@fuzz_settings(100)
@given(data=st.data())
def test_dot_matches_numpy(device, data):
    """blasx.dot vs np.dot: 0-D..4-D operands (N-D . M-D), dtypes, layouts, 0-size, out=."""
    d = data.draw
    nda, ndb = d(st.integers(0, 4)), d(st.integers(0, 3))
    k = d(st.integers(0, 4))
    sa = tuple(_core(d, nda - 1)) + (k,) if nda else ()
    sb = () if ndb == 0 else (k,) if ndb == 1 else tuple(_core(d, ndb - 2)) + (k, d(st.integers(0, 4)))
    if d(st.integers(0, 6)) == 0 and sb:  # a mismatch
        sb = (sb[0] + 1,) + sb[1:]
    recipes = {"a": d(arrays(sa)), "b": d(arrays(sb))}
    if d(st.integers(0, 2)) == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                probe = np.dot(recipes["a"].make()[0], recipes["b"].make()[0])
                if np.ndim(probe):
                    recipes["out"] = d(out_arrays(np.shape(probe), probe.dtype))
            except ValueError:
                pass
    check_numpy_call("dot", np.dot, blasx.dot, recipes, {})


@fuzz_settings(100)
@given(data=st.data())
def test_tensordot_matches_numpy(device, data):
    """blasx.tensordot vs np.tensordot: 0-D..4-D operands, axes as an int, a pair of ints or of
    sequences (negative axes included), dtypes, layouts, 0-size."""
    d = data.draw
    nda, ndb = d(st.integers(0, 4)), d(st.integers(0, 4))
    sa = tuple(_core(d, nda))
    nc = d(st.integers(0, min(nda, ndb)))
    ax_a = d(st.permutations(range(nda)))[:nc] if nda else []
    free_b = _core(d, ndb - nc)
    ax_b = d(st.permutations(range(ndb)))[:nc] if ndb else []
    sb = [0] * ndb
    it = iter(free_b)
    for i in range(ndb):
        sb[i] = sa[ax_a[ax_b.index(i)]] if i in ax_b else next(it)
    sb = tuple(sb)
    form = d(st.sampled_from(["int", "pair_lists", "pair_ints", "negative", "tuple"]))
    if form == "int" or (form == "pair_ints" and nc != 1):
        # the last nc axes of a against the first nc of b
        sb = sa[nda - nc:] + tuple(free_b)
        axes = nc
    elif form == "pair_ints":
        axes = (ax_a[0], ax_b[0])
    elif form == "negative":
        axes = ([x - nda for x in ax_a], [x - ndb for x in ax_b])
    elif form == "tuple":
        axes = (tuple(ax_a), tuple(ax_b))
    else:
        axes = [list(ax_a), list(ax_b)]
    if d(st.integers(0, 6)) == 0 and sb:  # a mismatch, or an axis out of range
        if d(st.booleans()):
            sb = (sb[0] + 1,) + sb[1:]
        else:
            axes = (list(ax_a) + [nda], list(ax_b) + [0]) if not isinstance(axes, int) else nda + 1
    recipes = {"a": d(arrays(sa)), "b": d(arrays(sb))}
    check_numpy_call("tensordot", np.tensordot, blasx.tensordot, recipes, {"axes": axes})
