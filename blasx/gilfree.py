"""scipy's own BLAS ?gemm called through ctypes, which lets go of the GIL for the call.

scipy.linalg.blas's wrappers hold the GIL while the BLAS runs, so threads of one process (a Dask worker's
task threads, a thread pool of callers) that call large gemms run one at a time. The same routine, taken
from ``scipy.linalg.cython_blas``'s exported function pointers, computes the same result with the GIL
released, and takes a column-major operand with any leading dimension (a block of a larger array) where
scipy's wrapper would copy it. The caller (shortcut.py) checks the operands: column-major, aligned, c
F-contiguous.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from .operands import leading_dim

_P = ctypes.c_void_p
_FLAGS = (b"N", b"T", b"C")  # trans 0, 1, 2


@functools.cache
def routine(dtype):
    """``gemm(trans_a, trans_b, m, n, k, alpha, a, b, beta, c)`` for ``dtype`` (float32/64, complex64/128):
    c = alpha op(a) op(b) + beta c written into ``c`` with the GIL released, every matrix column-major with its
    leading dimension; None where scipy exports no such pointer."""
    dt = np.dtype(dtype)
    prefix = {"f": "s", "d": "d", "F": "c", "D": "z"}.get(dt.char)
    try:
        from scipy.linalg import cython_blas
        capsule = cython_blas.__pyx_capi__[prefix + "gemm"]
    except (ImportError, AttributeError, KeyError, TypeError):
        return None
    api = ctypes.PyDLL(ctypes.pythonapi._name)  # our own prototypes: ctypes.pythonapi's are shared with others
    api.PyCapsule_GetName.restype, api.PyCapsule_GetName.argtypes = ctypes.c_char_p, [ctypes.py_object]
    api.PyCapsule_GetPointer.restype, api.PyCapsule_GetPointer.argtypes = _P, [ctypes.py_object, ctypes.c_char_p]
    address = api.PyCapsule_GetPointer(capsule, api.PyCapsule_GetName(capsule))
    if not address:
        return None
    fn = ctypes.CFUNCTYPE(None, *[_P] * 13)(address)  # Fortran's convention: every argument by address
    scalar = np.dtype(dt)

    def gemm(trans_a, trans_b, m, n, k, alpha, a, b, beta, c) -> None:
        ints = (ctypes.c_int * 6)(m, n, k, leading_dim(a), leading_dim(b), leading_dim(c))
        s = np.array([alpha, beta], dtype=scalar)
        ip, sp = ctypes.addressof(ints), s.ctypes.data
        fn(_FLAGS[trans_a], _FLAGS[trans_b], ip, ip + 4, ip + 8, sp, a.ctypes.data, ip + 12, b.ctypes.data,
           ip + 16, sp + scalar.itemsize, c.ctypes.data, ip + 20)
    return gemm
