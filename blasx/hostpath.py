"""The CPU alone: level-3 calls of the scipy signature run scipy's own routine as is.

With the CPU as the only device (``session.host_device`` set: the engine runs every call in its
caller's thread on the host BLAS, no fixed tile), blasx's kernel is the host BLAS, so a call
whose arguments scipy's routine treats exactly as blasx does can run scipy's routine on them
unchanged, for scipy's own cost plus a few checks. That is a call with

* the routine's required arguments given positionally (``alpha, a, b``; ``alpha, a`` for
  ``?syrk`` / ``?herk``): alpha a Python float or int other than 0 (with alpha == 0 blasx
  reads neither a nor b), the arrays 2-D ``numpy.ndarray`` of the routine's dtype;
* only int flags by keyword, within what blasx allows (blasx raises where scipy hands a bad
  flag to BLAS, e.g. ``zherk(trans=1)``, ``zsyrk(trans=2)``);
* shapes that fit, every dimension > 0 (blasx raises on shapes scipy may pass to BLAS).

Anything else (``c``, ``beta``, ``overwrite_*``, conversions, bad input) takes the general path,
with its checks and messages. The call is recorded for :func:`blasx.last_profile` as one host
task (two clock reads and a tuple).
"""

from __future__ import annotations

import numpy as np
import scipy.linalg.blas as _sp

from . import level3, session
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


def with_host_path(prefix: str, routine: str, general):
    """``prefix + routine`` with scipy's signature: scipy's own routine (from scipy.linalg._fblas
    through get_blas_funcs, never the module attribute blasx.offload may replace) for a plain
    call while the CPU is the only device (see the module docstring), else
    ``general(*args, **kwargs)``. The checks are written out in one function: each call level
    costs ~70 ns, a tenth of what the whole path adds."""
    dtype = DTYPE_OF_PREFIX[prefix]
    native = _sp.get_blas_funcs(routine, dtype=dtype)
    flags = FAST_FLAGS[routine][prefix in "cz"]
    flops_of, two = FAST_SHAPES[routine]
    n_args = 3 if two else 2  # alpha, a(, b): b is args[n_args - 1], so a itself for ?syrk / ?herk
    last = level3.last_call
    ndarray = np.ndarray

    def flags_ok(kwargs) -> bool:
        for k, v in kwargs.items():
            ok = flags.get(k)
            if ok is None or type(v) is not int or v not in ok:
                return False
        return True

    def f(*args, **kwargs):
        dev = session.host_device
        if dev is not None and len(args) == n_args:
            alpha, a, b = args[0], args[1], args[n_args - 1]
            # ``is`` for the dtype: numpy's dtypes of the builtin types are singletons; an equal
            # dtype that is another object (byte order spelled out, metadata) takes the general path
            if ((type(alpha) is float or type(alpha) is int) and alpha != 0
                    and type(a) is ndarray and type(b) is ndarray and a.dtype is dtype and b.dtype is dtype
                    and a.ndim == 2 and b.ndim == 2 and (not kwargs or flags_ok(kwargs))
                    and (flops := flops_of(a, b, kwargs))):
                t0 = clock()
                res = native(*args, **kwargs)
                last.stats = (dev, t0, clock(), dtype, flops)
                return res
        return general(*args, **kwargs)

    return f
