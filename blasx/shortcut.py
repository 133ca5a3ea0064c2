"""The CPU alone: a level-3 call in its plain form is one call of scipy's own routine.

A call is plain when its arrays are numpy matrices of the routine's dtype in column-major layout
(gemm also takes row-major operands, as transposes, and blocks of larger arrays, through gilfree.py),
the shapes agree and are non-empty, alpha is a nonzero Python number, beta a Python number (real
where BLAS reads it as real), the flags are ints in range and an output written in place aliases no
input. Its result is scipy's, so :func:`make` hands it to scipy's function as it is, with nothing
built per call, and records it for ``last_profile()``. Any other call gets :data:`NO` and takes the
full path (:mod:`blasx.dispatch`), which converts, checks and raises.
"""

from __future__ import annotations

from threading import get_ident

import numpy as np

from . import dispatch, gilfree, session
from .checks import finite_scalar
from .operands import column_major_view
from .runtime.stats import clock

NO = object()  # "not a plain call": the caller takes the full path

_nd = np.ndarray
_may_share = np.may_share_memory
_FLAG = (int, bool)  # overwrite_*: 0 or 1, False or True
_REALS = frozenset((float, int, np.float64, np.float32))  # alpha and beta: what f2py takes as it is
_NUMBERS = _REALS | {complex, np.complex128, np.complex64}
GIL_FREE_SIZE = 1 << 24  # m*n*k from which gemm lets go of the GIL where threads share it (gilfree.py): N >= 256
SHARED_SECONDS = 1.0  # a thread whose last large gemm is older than this no longer counts as a caller
_callers: dict = {}  # thread ident -> clock of its last large plain gemm


def _shared(now: float) -> bool:
    """Whether other threads call large gemms too (one did within SHARED_SECONDS). Only then is the GIL-free
    call (gilfree.py) worth its few microseconds of ctypes: a single-threaded caller has no one to let run."""
    _callers[get_ident()] = now
    if len(_callers) < 2:
        return False
    for ident, t in list(_callers.items()):
        if now - t > SHARED_SECONDS:
            _callers.pop(ident, None)
    return len(_callers) > 1


def _out_ok(c, dtype, shape, overwrite, *inputs) -> bool:
    """c may be handed to scipy as the output: of ``dtype`` and ``shape``; written in place only
    where blasx writes it in place too (F-contiguous, aligned, writable) and aliasing no input."""
    if type(c) is not _nd or c.dtype is not dtype or c.shape != shape:
        return False
    if not overwrite:
        return True
    flags = c.flags
    if not flags.f_contiguous:
        return False  # blasx.gemm writes such a c in place, scipy would copy it
    return flags.aligned and flags.writeable and not any(_may_share(c, x) for x in inputs)


def make(routine: str, dtype: np.dtype):
    """The plain-call shortcut of ``routine`` ("gemm", "syrk", ...) in ``dtype``: a function with
    scipy's positional signature returning the result, or :data:`NO`."""
    fn = dispatch.blas_routine(routine, dtype)
    real = dtype.kind != "c"
    nums = _REALS if real else _NUMBERS
    tls = dispatch._tls

    if routine == "gemm":
        def call(alpha, a, b, beta=0.0, c=None, trans_a=0, trans_b=0, overwrite_c=0):
            dev = session.host_device
            if (dev is None or type(a) is not _nd or type(b) is not _nd or a.dtype is not dtype or b.dtype is not dtype
                    or a.ndim != 2 or b.ndim != 2 or type(alpha) not in nums or not alpha or type(beta) not in nums
                    or type(trans_a) is not int or type(trans_b) is not int or not 0 <= trans_a <= 2
                    or not 0 <= trans_b <= 2 or type(overwrite_c) not in _FLAG or not 0 <= overwrite_c <= 1):
                return NO
            m, k = a.shape if trans_a == 0 else a.shape[::-1]
            kb, n = b.shape if trans_b == 0 else b.shape[::-1]
            if k != kb or not (m and n and k):
                return NO
            strided = False  # an operand with a leading dimension (a block of a larger array): gilfree.py only
            if not a.flags.f_contiguous:  # a row-major x is V^T, V = x.T column-major (real: C is T)
                v = (a.T, True) if a.flags.c_contiguous else column_major_view(a) if a.flags.aligned else None
                if v is None or (v[1] and trans_a == 2 and not real):
                    return NO
                a, strided = v[0], strided or not a.flags.c_contiguous
                trans_a = (1 if trans_a == 0 else 0) if v[1] else trans_a
            if not b.flags.f_contiguous:
                v = (b.T, True) if b.flags.c_contiguous else column_major_view(b) if b.flags.aligned else None
                if v is None or (v[1] and trans_b == 2 and not real):
                    return NO
                b, strided = v[0], strided or not b.flags.c_contiguous
                trans_b = (1 if trans_b == 0 else 0) if v[1] else trans_b
            if c is None:
                if not finite_scalar(beta):  # (f2py's c is zeros: the full path makes the result NaN)
                    return NO
                beta = 0.0
            elif not _out_ok(c, dtype, (m, n), overwrite_c, a, b):  # (a, b: the same memory as given)
                return NO
            t0 = clock()
            free = gilfree.routine(dtype) if (m * n * k >= GIL_FREE_SIZE and _shared(t0)) or strided else None
            if free is None and strided:
                return NO
            if free is not None:
                # the same BLAS routine with the GIL let go (scipy's wrapper holds it, and copies a strided
                # operand): other callers run meanwhile; the output as scipy makes it (c itself in place, else
                # a copy of c, else a new array)
                res = c if c is not None and overwrite_c else np.array(c, order="F") if c is not None else \
                    np.empty((m, n), dtype, order="F")
                free(trans_a, trans_b, m, n, k, alpha, a, b, beta, res)
            else:
                res = fn(alpha, a, b, beta, c, trans_a, trans_b, overwrite_c)
            tls.stats = (dev, t0, clock(), dtype, 2.0 * m * n * k)
            return res
        return call

    if routine in ("symm", "hemm"):
        def call(alpha, a, b, beta=0.0, c=None, side=0, lower=0, overwrite_c=0):
            dev = session.host_device
            if (dev is None or type(a) is not _nd or type(b) is not _nd or a.dtype is not dtype or b.dtype is not dtype
                    or type(alpha) not in nums or not alpha or type(beta) not in nums or type(side) is not int
                    or type(lower) is not int or not 0 <= side <= 1 or not 0 <= lower <= 1
                    or type(overwrite_c) not in _FLAG or not 0 <= overwrite_c <= 1 or b.ndim != 2
                    or not a.flags.f_contiguous or not b.flags.f_contiguous):
                return NO
            m, n = b.shape
            s = m if side == 0 else n
            if a.shape != (s, s) or not (m and n) or (c is not None and not _out_ok(c, dtype, (m, n), overwrite_c, a, b)):
                return NO
            if c is None and not finite_scalar(beta):
                return NO
            t0 = clock()
            res = fn(alpha, a, b, 0.0 if c is None else beta, c, side, lower, overwrite_c)
            tls.stats = (dev, t0, clock(), dtype, 2.0 * m * n * s)
            return res
        return call

    hermitian = routine in ("herk", "her2k")
    trans_ok = (0, 2) if hermitian else (0, 1, 2) if real else (0, 1)
    alpha_types = _REALS if routine == "herk" else nums
    beta_types = _REALS if hermitian else nums

    if routine in ("syrk", "herk", "syr2k", "her2k"):
        two = routine.endswith("2k")

        def rank(alpha, a, b, beta, c, trans, lower, overwrite_c):
            dev = session.host_device
            if (dev is None or type(a) is not _nd or a.dtype is not dtype or a.ndim != 2
                    or type(alpha) not in alpha_types or not alpha or type(beta) not in beta_types
                    or type(trans) is not int or trans not in trans_ok or type(lower) is not int
                    or not 0 <= lower <= 1 or type(overwrite_c) not in _FLAG or not 0 <= overwrite_c <= 1 or not a.flags.f_contiguous):
                return NO
            if two and (type(b) is not _nd or b.dtype is not dtype or b.shape != a.shape or not b.flags.f_contiguous):
                return NO
            n, k = a.shape if trans == 0 else a.shape[::-1]
            if not (n and k) or (c is not None and not _out_ok(c, dtype, (n, n), overwrite_c, a, b)) or (
                    c is None and not finite_scalar(beta)):
                return NO
            op = 1 if trans == 2 and real else trans
            t0 = clock()
            if two:
                res = fn(alpha, a, b, 0.0 if c is None else beta, c, op, lower, overwrite_c)
            else:
                res = fn(alpha, a, 0.0 if c is None else beta, c, op, lower, overwrite_c)
            tls.stats = (dev, t0, clock(), dtype, (2.0 if two else 1.0) * n * (n + 1.0) * k)
            return res

        if two:
            def call(alpha, a, b, beta=0.0, c=None, trans=0, lower=0, overwrite_c=0):
                return rank(alpha, a, b, beta, c, trans, lower, overwrite_c)
        else:
            def call(alpha, a, beta=0.0, c=None, trans=0, lower=0, overwrite_c=0):
                return rank(alpha, a, None, beta, c, trans, lower, overwrite_c)
        return call

    def call(alpha, a, b, side=0, lower=0, trans_a=0, diag=0, overwrite_b=0):  # trmm, trsm
        dev = session.host_device
        if (dev is None or type(a) is not _nd or type(b) is not _nd or a.dtype is not dtype or b.dtype is not dtype
                or b.ndim != 2 or type(alpha) not in nums or not alpha or type(side) is not int
                or type(lower) is not int or type(trans_a) is not int or type(diag) is not int
                or not 0 <= side <= 1 or not 0 <= lower <= 1 or not 0 <= trans_a <= 2 or not 0 <= diag <= 1
                or type(overwrite_b) not in _FLAG or not 0 <= overwrite_b <= 1 or not a.flags.f_contiguous):
            return NO
        m, n = b.shape
        s = m if side == 0 else n
        if a.shape != (s, s) or not (m and n):
            return NO
        if overwrite_b and b.flags.f_contiguous and not _out_ok(b, dtype, (m, n), overwrite_b, a):
            return NO  # (a b that is not F-contiguous is copied, by blasx and scipy alike)
        t0 = clock()
        res = fn(alpha, a, b, side, lower, trans_a, diag, overwrite_b)
        tls.stats = (dev, t0, clock(), dtype, 1.0 * m * n * s)
        return res
    return call
