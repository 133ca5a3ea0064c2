"""cublasGemmStridedBatchedEx for blasx.dnn's device routes (convolutions, RNN steps): one callable,
``strided_batched_ex()(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb,
strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo)`` returning the cublasStatus_t.

It is the C extension ``blasx._cublas_call`` where the package build made it (the arguments cross in one
C call), else ctypes (the same function; its conversion of 23 arguments costs several microseconds a
call). Either way the function is the libcublas CuPy loaded, and the GIL is released during the call.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def strided_batched_ex(use_extension: bool = True):
    """The callable (pointers as ints, alpha and beta host pointers); ``use_extension=False``: the ctypes one."""
    from ..runtime.devices import cublas_ctypes as cc
    return bind(cc.libcublas().cublasGemmStridedBatchedEx, use_extension)


def bind(fn, use_extension: bool = True):
    """The callable for ``fn``, a ctypes function with cublasGemmStridedBatchedEx's signature (its argument
    types are set here): through the C extension where ``use_extension`` and it is built, else ``fn``."""
    import ctypes
    P, I, Q = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    fn.argtypes = [P, I, I, I, I, I, P, P, I, I, Q, P, I, I, Q, P, P, I, I, Q, I, I, I]
    fn.restype = I
    ext = _extension() if use_extension else None
    if ext is None:
        return fn
    return functools.partial(ext.gemm_strided_batched_ex, ctypes.cast(fn, ctypes.c_void_p).value)


def _extension():
    try:
        from .. import _cublas_call
    except ImportError:  # built without a C compiler
        return None
    return _cublas_call


def check(status: int, what=None) -> None:
    """Raise where a call returned a cuBLAS error (``what``: the call, for the message)."""
    if status != 0:
        raise RuntimeError(f"cublasGemmStridedBatchedEx failed with cublasStatus_t {status}"
                           + (f" ({what})" if what is not None else ""))
