"""The CPU alone: level-3 calls of the scipy signature run scipy's own routine.

With the CPU as the only device (``session.host_device`` set: the engine runs every call in its
caller's thread on the host BLAS, no fixed tile), blasx's kernel is the host BLAS, so a call
whose arguments scipy's routine treats exactly as blasx does can run scipy's routine on them,
for scipy's own cost plus a few checks. Two lanes, tried in turn:

* the plain call: the routine's required arguments positionally (``alpha, a, b``; ``alpha, a``
  for ``?syrk`` / ``?herk``), alpha other than 0 of the routine's scalar types (``SCALAR_TYPES``:
  Python's and numpy's numbers, complex ones where BLAS reads alpha complex), the arrays 2-D
  ``numpy.ndarray`` of the routine's dtype, only int flags by keyword; scipy's routine gets
  the arguments unchanged. Checked in C where blasx._hostcall's library is built, else here;
* any other call that binds to the signature (``c``, ``beta``, ``overwrite_*``, alpha == 0,
  arrays of another BLAS type that the routine converts; nested lists for blasx.linalg.blas,
  made arrays first): the arguments are checked and handed to scipy's routine in the form that
  makes it do what blasx does (``LANES``: one function per family; see the comment above them).
  Checked in C too where the library is built (blasx._hostcall: the same checks and the same call
  of scipy's routine, for arrays, not nested lists); what C does not take comes here.

Both need int flags within what blasx allows (blasx raises where scipy hands a bad flag to
BLAS, e.g. ``zherk(trans=1)``, ``zsyrk(trans=2)``) and shapes that fit with every dimension > 0
(blasx raises on shapes scipy may pass to BLAS, and returns early on empty ones). Anything else
(0-d or 1-D arrays, complex scalars where BLAS reads a real one, bools, bad input, outputs
that may alias an input) takes the general path, with its checks and messages. The call is
recorded for :func:`blasx.last_profile` as one host task (two clock reads and a tuple).

Verified against scipy (its OpenBLAS), and kept by tests/test_host_paths.py: with alpha == 0
scipy's routines read neither a nor b, with beta == 0 not the written part of c (NaNs there do
not leak), and ``?herk`` / ``?her2k`` treat the diagonal's imaginary part as blasx does.
"""

from __future__ import annotations

import itertools

import numpy as np
import scipy.linalg.blas as _sp

from . import _hostcall, level3, session
from .level3 import end_clock
from .runtime.stats import clock

DTYPE_OF_PREFIX = {"s": np.dtype(np.float32), "d": np.dtype(np.float64),
                   "c": np.dtype(np.complex64), "z": np.dtype(np.complex128)}

_BOOL = frozenset((0, 1))
_TRANS = frozenset((0, 1, 2))
_TRANS_NT = frozenset((0, 1))   # complex ?syrk / ?syr2k: trans 2 is ?herk's
_TRANS_NC = frozenset((0, 2))   # ?herk / ?her2k: trans 1 is not a Hermitian update

#: routine -> (flags taken by keyword -> allowed values) for the real prefixes, for the complex ones
FAST_FLAGS = {
    "gemm": ({"trans_a": _TRANS, "trans_b": _TRANS},) * 2,
    "symm": ({"side": _BOOL, "lower": _BOOL},) * 2,
    "hemm": ({"side": _BOOL, "lower": _BOOL},) * 2,
    "syrk": ({"trans": _TRANS, "lower": _BOOL}, {"trans": _TRANS_NT, "lower": _BOOL}),
    "syr2k": ({"trans": _TRANS, "lower": _BOOL}, {"trans": _TRANS_NT, "lower": _BOOL}),
    "herk": ({"trans": _TRANS_NC, "lower": _BOOL},) * 2,
    "her2k": ({"trans": _TRANS_NC, "lower": _BOOL},) * 2,
    "trmm": ({"side": _BOOL, "lower": _BOOL, "trans_a": _TRANS, "diag": _BOOL},) * 2,
    "trsm": ({"side": _BOOL, "lower": _BOOL, "trans_a": _TRANS, "diag": _BOOL},) * 2,
}


# The real flops of a call whose shapes fit (the conventions of runtime.call.STEP_FLOPS), 0.0 when
# they do not or a dimension is 0 (then the general path raises or returns early). ``kw``: the
# flags given by keyword (often none: no dict look-ups then).

def _gemm_flops(a, b, kw) -> float:
    m, k = a.shape[::-1] if kw and kw.get("trans_a", 0) else a.shape
    kb, n = b.shape[::-1] if kw and kw.get("trans_b", 0) else b.shape
    return 2.0 * m * n * k if k == kb else 0.0


def _symm_flops(a, b, kw) -> float:
    m, n = b.shape
    s = n if kw and kw.get("side", 0) else m
    return 2.0 * m * n * s if a.shape == (s, s) else 0.0


def _syrk_flops(a, b, kw) -> float:
    n, k = a.shape[::-1] if kw and kw.get("trans", 0) else a.shape
    return n * (n + 1.0) * k


def _syr2k_flops(a, b, kw) -> float:
    return 2.0 * _syrk_flops(a, None, kw) if b.shape == a.shape else 0.0


def _tri_flops(a, b, kw) -> float:
    m, n = b.shape
    s = n if kw and kw.get("side", 0) else m
    return 1.0 * m * n * s if a.shape == (s, s) else 0.0


#: routine -> (the flops function above, whether the routine takes b)
FAST_SHAPES = {"gemm": (_gemm_flops, True), "symm": (_symm_flops, True), "hemm": (_symm_flops, True),
               "syrk": (_syrk_flops, False), "herk": (_syrk_flops, False),
               "syr2k": (_syr2k_flops, True), "her2k": (_syr2k_flops, True),
               "trmm": (_tri_flops, True), "trsm": (_tri_flops, True)}


# ---------------------------------------------------------------- the second lane

# One function per family with scipy's signature: Python binds the arguments in C (binding
# them in Python costs ~10x more), and the shapes and scipy's parameter order are written out
# (each call level costs ~70 ns). A call that does not bind raises TypeError and takes the
# general path, which raises blasx's own message. Each returns scipy's result, or None when it
# cannot prove that scipy's routine does what blasx does (then the general path runs).
#
# What blasx does, and how scipy is made to do it:
#
# * c (b for trmm/trsm) is written in place when ``overwrite_*`` is set and it is F-contiguous,
#   writable and of the routine's dtype; scipy would also write into a read-only c and copy a
#   misaligned one: it is given overwrite 0 for the first, the second takes the general path;
# * an output written in place must not alias an input (``?gemm``: c, whenever given), else
#   blasx raises: a possible alias takes the general path, which raises or runs;
# * without c, beta is ignored (scipy would scale its zero c by it: a NaN beta would leak);
# * arrays of another BLAS type are converted to the routine's (``convert``; the generic
#   functions pick their dtype from all the arrays and take no conversion here): scipy
#   converts them, as numpy's astype in both general paths does (the same cast, bit for bit,
#   and in C: astype from Python costs ~0.4 us more an array), into a new array: an output of
#   another type is never written in place, by blasx nor by scipy given overwrite 0.

#: numpy scalars f2py and blasx convert alike: real ones as float() (complex() for a complex
#: routine), complex ones as complex(); not bool (blasx.gemm rejects it), not longdouble
NUMPY_REAL = frozenset((np.float64, np.float32, np.int64, np.int32))
NUMPY_COMPLEX = frozenset((np.complex128, np.complex64))
_REAL = frozenset((float, int)) | NUMPY_REAL
_ANY = _REAL | {complex} | NUMPY_COMPLEX
_OVERWRITE_TYPES = frozenset((int, bool))  # f2py and blasx read overwrite_* by truth value

#: (routine, complex prefix) -> (types of alpha, types of beta) taken as they are. A complex
#: scalar where BLAS reads a real one (every real routine; herk's alpha, herk's and her2k's
#: beta) is a warning or an error, depending on the front end: the general path.
_REAL_ALPHA = frozenset(("herk",))
_REAL_BETA = frozenset(("herk", "her2k"))
SCALAR_TYPES = {(r, cplx): (_ANY if cplx and r not in _REAL_ALPHA else _REAL,
                            _ANY if cplx and r not in _REAL_BETA else _REAL)
                for r in FAST_FLAGS for cplx in (False, True)}

#: prefix -> the array dtypes its routines convert on the fast path; complex to real
#: discards the imaginary part with a warning: the general path
CONVERTIBLE = {p: frozenset(d for k, d in DTYPE_OF_PREFIX.items() if k != p and (p in "cz" or k in "sd"))
               for p in DTYPE_OF_PREFIX}

#: routine -> the flags of its family, in scipy's order
FLAG_ORDER = {"gemm": ("trans_a", "trans_b"), "symm": ("side", "lower"), "hemm": ("side", "lower"),
              "syrk": ("trans", "lower"), "herk": ("trans", "lower"), "syr2k": ("trans", "lower"),
              "her2k": ("trans", "lower"), "trmm": ("side", "lower", "trans_a", "diag"),
              "trsm": ("side", "lower", "trans_a", "diag")}


def _in_place(out, dtype, overwrite, a, b, always_checked: bool = False):
    """True when blasx writes ``out`` in place, False when it returns a new array, None when
    the fast path cannot take the call: a misaligned output (blasx writes in place, scipy would
    copy), or one that may alias a or b (None: no b) where blasx checks (written in place, or
    ``always_checked``: ?gemm's c). No alias is proven cheaply for arrays that each own their
    buffer (the common case, ~0.1 us), else by numpy's bounds test (``np.may_share_memory``,
    0.2 us a pair); a maybe is not a proof: the general path then runs its exact test, and
    raises (or finds them disjoint after all). One function: a call level costs ~70 ns."""
    in_place = False
    fl = None
    if overwrite and out.dtype is dtype:
        fl = out.flags
        if fl.f_contiguous and fl.writeable:
            if not fl.aligned:
                return None
            in_place = True
    if in_place or always_checked:
        if a is out or b is out:
            return None
        if not ((fl or out.flags).owndata and a.flags.owndata and (b is None or b.flags.owndata)) and (
                np.may_share_memory(out, a) or (b is not None and np.may_share_memory(out, b))):
            return None
    return in_place


def _constants(prefix: str, routine: str, convert: bool):
    """(dtype, scipy's routine, alpha types, beta types, valid flag tuples, convertible dtypes)."""
    dtype = DTYPE_OF_PREFIX[prefix]
    allowed = FAST_FLAGS[routine][prefix in "cz"]
    valid = frozenset(itertools.product(*(sorted(allowed[n]) for n in FLAG_ORDER[routine])))  # one hashed look-up
    return (dtype, _sp.get_blas_funcs(routine, dtype=dtype), *SCALAR_TYPES[(routine, prefix in "cz")], valid,
            CONVERTIBLE[prefix] if convert else frozenset())


# Each lane below: the checks (written out: a helper costs ~60 ns an array), the shapes (every
# dimension > 0, c's shape), the output, the call, its record.

def _gemm_lane(prefix: str, routine: str, convert: bool):
    dtype, native, alpha_types, beta_types, valid, convertible = _constants(prefix, routine, convert)
    last = level3.last_call
    ndarray = np.ndarray

    def lane(alpha, a, b, beta=0.0, c=None, trans_a=0, trans_b=0, overwrite_c=0):
        if not (type(alpha) in alpha_types and type(beta) in beta_types and type(overwrite_c) in _OVERWRITE_TYPES
                and type(trans_a) is int is type(trans_b) and (trans_a, trans_b) in valid
                and type(a) is ndarray and a.ndim == 2 and ((d := a.dtype) is dtype or d in convertible)
                and type(b) is ndarray and b.ndim == 2 and ((d := b.dtype) is dtype or d in convertible)
                and (c is None or (type(c) is ndarray and c.ndim == 2 and ((d := c.dtype) is dtype or d in convertible)))):
            return None
        m, k = a.shape
        if trans_a:
            m, k = k, m
        k2, n = b.shape
        if trans_b:
            k2, n = n, k2
        if not (k == k2 and m and n and k and (c is None or c.shape == (m, n))):
            return None
        in_place = False
        if c is not None:  # blasx.gemm checks c against a and b even when it copies c
            in_place = _in_place(c, dtype, overwrite_c, a, b, True)
            if in_place is None:
                return None
        dev = session.host_device
        if dev is None:
            return None
        t0 = clock()
        if alpha == 0:  # never scipy's ?gemm (_hostcall's HC_GEMM_ALPHA0): C = beta C, a and b unread
            res = level3.host_scale(beta, c, in_place, (m, n), dtype)
            last.stats = (dev, t0, end_clock(), dtype, 0.0)
            return res
        res = native(alpha, a, b, beta if c is not None else 0.0, c, trans_a, trans_b, in_place)
        last.stats = (dev, t0, end_clock(), dtype, 2.0 * m * n * k)
        return res

    return lane


def _symm_lane(prefix: str, routine: str, convert: bool):
    dtype, native, alpha_types, beta_types, valid, convertible = _constants(prefix, routine, convert)
    last = level3.last_call
    ndarray = np.ndarray

    def lane(alpha, a, b, beta=0.0, c=None, side=0, lower=0, overwrite_c=0):
        if not (type(alpha) in alpha_types and type(beta) in beta_types and type(overwrite_c) in _OVERWRITE_TYPES
                and type(side) is int is type(lower) and (side, lower) in valid
                and type(a) is ndarray and a.ndim == 2 and ((d := a.dtype) is dtype or d in convertible)
                and type(b) is ndarray and b.ndim == 2 and ((d := b.dtype) is dtype or d in convertible)
                and (c is None or (type(c) is ndarray and c.ndim == 2 and ((d := c.dtype) is dtype or d in convertible)))):
            return None
        m, n = b.shape
        s = n if side else m
        if not (m and n and a.shape == (s, s) and (c is None or c.shape == (m, n))):
            return None
        in_place = False
        if overwrite_c and c is not None:
            in_place = _in_place(c, dtype, overwrite_c, a, b)
            if in_place is None:
                return None
        dev = session.host_device
        if dev is None:
            return None
        t0 = clock()
        res = native(alpha, a, b, beta if c is not None else 0.0, c, side, lower, in_place)
        # alpha == 0: the general path's plan records C = beta C, m n flops
        last.stats = (dev, t0, end_clock(), dtype, 2.0 * m * n * s if alpha != 0 else float(m * n))
        return res

    return lane


def _rank_lane(prefix: str, routine: str, convert: bool):
    dtype, native, alpha_types, beta_types, valid, convertible = _constants(prefix, routine, convert)
    last = level3.last_call
    ndarray = np.ndarray

    def lane(alpha, a, beta=0.0, c=None, trans=0, lower=0, overwrite_c=0):
        if not (type(alpha) in alpha_types and type(beta) in beta_types and type(overwrite_c) in _OVERWRITE_TYPES
                and type(trans) is int is type(lower) and (trans, lower) in valid
                and type(a) is ndarray and a.ndim == 2 and ((d := a.dtype) is dtype or d in convertible)
                and (c is None or (type(c) is ndarray and c.ndim == 2 and ((d := c.dtype) is dtype or d in convertible)))):
            return None
        n, k = a.shape
        if trans:
            n, k = k, n
        if not (n and k and (c is None or c.shape == (n, n))):
            return None
        in_place = False
        if overwrite_c and c is not None:
            in_place = _in_place(c, dtype, overwrite_c, a, None)
            if in_place is None:
                return None
        dev = session.host_device
        if dev is None:
            return None
        t0 = clock()
        res = native(alpha, a, beta if c is not None else 0.0, c, trans, lower, in_place)
        last.stats = (dev, t0, end_clock(), dtype, n * (n + 1.0) * k if alpha != 0 else 0.0)
        return res

    return lane


def _rank2_lane(prefix: str, routine: str, convert: bool):
    dtype, native, alpha_types, beta_types, valid, convertible = _constants(prefix, routine, convert)
    last = level3.last_call
    ndarray = np.ndarray

    def lane(alpha, a, b, beta=0.0, c=None, trans=0, lower=0, overwrite_c=0):
        if not (type(alpha) in alpha_types and type(beta) in beta_types and type(overwrite_c) in _OVERWRITE_TYPES
                and type(trans) is int is type(lower) and (trans, lower) in valid
                and type(a) is ndarray and a.ndim == 2 and ((d := a.dtype) is dtype or d in convertible)
                and type(b) is ndarray and b.ndim == 2 and ((d := b.dtype) is dtype or d in convertible)
                and (c is None or (type(c) is ndarray and c.ndim == 2 and ((d := c.dtype) is dtype or d in convertible)))):
            return None
        n, k = a.shape
        if trans:
            n, k = k, n
        if not (n and k and b.shape == a.shape and (c is None or c.shape == (n, n))):
            return None
        in_place = False
        if overwrite_c and c is not None:
            in_place = _in_place(c, dtype, overwrite_c, a, b)
            if in_place is None:
                return None
        dev = session.host_device
        if dev is None:
            return None
        t0 = clock()
        res = native(alpha, a, b, beta if c is not None else 0.0, c, trans, lower, in_place)
        last.stats = (dev, t0, end_clock(), dtype, 2.0 * n * (n + 1.0) * k if alpha != 0 else 0.0)
        return res

    return lane


def _tri_lane(prefix: str, routine: str, convert: bool):
    dtype, native, alpha_types, _, valid, convertible = _constants(prefix, routine, convert)
    last = level3.last_call
    ndarray = np.ndarray

    def lane(alpha, a, b, side=0, lower=0, trans_a=0, diag=0, overwrite_b=0):
        if not (type(alpha) in alpha_types and type(overwrite_b) in _OVERWRITE_TYPES
                and type(side) is int is type(lower) is type(trans_a) is type(diag)
                and (side, lower, trans_a, diag) in valid
                and type(a) is ndarray and a.ndim == 2 and ((d := a.dtype) is dtype or d in convertible)
                and type(b) is ndarray and b.ndim == 2 and ((d := b.dtype) is dtype or d in convertible)):
            return None
        m, n = b.shape
        s = n if side else m
        if not (m and n and a.shape == (s, s)):
            return None
        in_place = False
        if overwrite_b:
            in_place = _in_place(b, dtype, overwrite_b, a, None)
            if in_place is None:
                return None
        dev = session.host_device
        if dev is None:
            return None
        t0 = clock()
        res = native(alpha, a, b, side, lower, trans_a, diag, in_place)
        # alpha == 0: the general path's plan records B = 0, m n flops
        last.stats = (dev, t0, end_clock(), dtype, 1.0 * m * n * s if alpha != 0 else float(m * n))
        return res

    return lane


#: routine -> the factory of its second lane
LANES = {"gemm": _gemm_lane, "symm": _symm_lane, "hemm": _symm_lane, "syrk": _rank_lane, "herk": _rank_lane,
         "syr2k": _rank2_lane, "her2k": _rank2_lane, "trmm": _tri_lane, "trsm": _tri_lane}


def _unlisted(args: tuple, n_args: int):
    """``args`` with the nested lists among a (and b) made arrays as the general paths make them
    (``np.asarray``; F-ordered, as scipy would copy them), or None when there are none or numpy
    cannot make one (the general path says why)."""
    if not any(type(x) is list for x in args[1:n_args]):
        return None
    try:
        return (args[0], *(np.asarray(x, order="F") if type(x) is list else x for x in args[1:n_args]),
                *args[n_args:])
    except Exception:  # noqa: BLE001 - the general path converts again and raises its own message
        return None


def with_host_path(prefix: str, routine: str, general, convert: bool = True, lists: bool = False):
    """``prefix + routine`` with scipy's signature: scipy's own routine (from scipy.linalg._fblas
    through get_blas_funcs, never the module attribute blasx.offload may replace) for a call of
    either lane while the CPU is the only device (see the module docstring), else
    ``general(*args, **kwargs)``. ``convert``: arrays of another BLAS type are converted to the
    prefix's (the prefixed functions), else they take ``general`` (the generic ones). ``lists``:
    nested lists as a and b are made arrays first, as ``general`` makes them (blasx.linalg.blas,
    which takes what scipy takes; blasx's own functions reject lists). The plain call's checks
    run in C where blasx._hostcall's library is built (the function returned is then its C
    callable, whose ``__wrapped__`` is the Python function below), else in Python, written out:
    each call level costs ~70 ns."""
    dtype = DTYPE_OF_PREFIX[prefix]
    native = _sp.get_blas_funcs(routine, dtype=dtype)
    flags = FAST_FLAGS[routine][prefix in "cz"]
    flops_of, two = FAST_SHAPES[routine]
    n_args = 3 if two else 2  # alpha, a(, b): b is args[n_args - 1], so a itself for ?syrk / ?herk
    plain_alpha = SCALAR_TYPES[(routine, prefix in "cz")][0]
    last = level3.last_call
    ndarray = np.ndarray
    lane = LANES[routine](prefix, routine, convert)

    def flags_ok(kwargs) -> bool:
        for k, v in kwargs.items():
            ok = flags.get(k)
            if ok is None or type(v) is not int or v not in ok:
                return False
        return True

    def second(*args, **kwargs):
        """A call the plain call's checks did not take: the second lane (again with lists made
        arrays, where ``lists``), else the general path."""
        if session.host_device is not None:
            try:
                res = lane(*args, **kwargs)
            except TypeError as e:
                if e.__traceback__.tb_next is not None:
                    raise  # raised inside the lane, not by binding its arguments (one frame only)
                res = None  # the arguments do not bind: the general path says how
            if res is None and lists and (listed := _unlisted(args, n_args)) is not None:
                try:
                    res = lane(*listed, **kwargs)
                except TypeError as e:
                    if e.__traceback__.tb_next is not None:
                        raise
            if res is not None:
                return res
        return general(*args, **kwargs)

    def f(*args, **kwargs):
        dev = session.host_device
        if dev is not None and len(args) == n_args:
            alpha, a, b = args[0], args[1], args[n_args - 1]
            # ``is`` for the dtype: numpy's dtypes of the builtin types are singletons; an equal
            # dtype that is another object (byte order spelled out, metadata) takes the second lane
            # (keywords first: one that is not a flag, e.g. overwrite_b, sends the call there at once)
            if ((not kwargs or flags_ok(kwargs)) and type(alpha) in plain_alpha and alpha != 0
                    and type(a) is ndarray and type(b) is ndarray and a.dtype is dtype and b.dtype is dtype
                    and a.ndim == 2 and b.ndim == 2 and (flops := flops_of(a, b, kwargs))):
                t0 = clock()
                res = native(*args, **kwargs)
                last.stats = (dev, t0, end_clock(), dtype, flops)
                return res
        return second(*args, **kwargs)

    return _hostcall.lane(second, f, native, routine, dtype, plain_alpha, flags, n_args, lane,
                          SCALAR_TYPES[(routine, prefix in "cz")][1], CONVERTIBLE[prefix] if convert else frozenset(),
                          lists)
