"""cuBLAS routines that CuPy's bindings lack, called through ctypes.

CuPy 14's ``cupy_backends.cuda.libs.cublas`` has gemm, syrk and trsm but not
symm, hemm, syr2k, her2k, herk or trmm (nor, in some versions, GemmEx). These are
taken from the very libcublas CuPy loaded (found in ``/proc/self/maps``), so a
handle CuPy created is valid here. ctypes releases the GIL during the call.
Argument types are declared per routine: pointers must not be truncated to C ints.
"""

from __future__ import annotations

import ctypes
import functools

P, I = ctypes.c_void_p, ctypes.c_int
_CODES = {"P": P, "i": I, "z": ctypes.c_size_t}
# handle, then the routine's arguments (P: pointer, i: int), as in cublas_api.h (v2 API)
SIGNATURES = {
    "symm": "PiiiiPPiPiPPi", "hemm": "PiiiiPPiPiPPi",
    "syr2k": "PiiiiPPiPiPPi", "her2k": "PiiiiPPiPiPPi",
    "syrk": "PiiiiPPiPPi", "herk": "PiiiiPPiPPi",
    "trmm": "PiiiiiiPPiPiPi", "trsm": "PiiiiiiPPiPi",
    "gemm": "PiiiiiPPiPiPPi",
    # cublasGemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta,
    #              C, Ctype, ldc, computeType, algo)
    "GemmEx": "PiiiiiPPiiPiiPPiiii",
    # handle settings (host-side only, so allowed while a stream captures)
    "SetStream": "PP", "SetWorkspace": "PPz", "SetPointerMode": "Pi",
}


@functools.lru_cache(maxsize=1)
def libcublas() -> ctypes.CDLL:
    """The libcublas already mapped into this process (CuPy loads it first)."""
    from cupy_backends.cuda.libs import cublas  # noqa: F401 - makes sure it is loaded
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libcublas.so" in path:
                return ctypes.CDLL(path)
    raise OSError("libcublas is not loaded in this process (looked in /proc/self/maps)")


@functools.lru_cache(maxsize=None)
def routine(prefix: str, name: str):
    """cublas<prefix><name>_v2 (cublas<prefix><name> for routines without a v2 form, such as
    GemmEx) with its argument types, returning a checked callable."""
    lib = libcublas()
    sym = f"cublas{prefix.upper()}{name}_v2"
    if not hasattr(lib, sym):
        sym = sym[:-3]
    fn = getattr(lib, sym)
    fn.argtypes = [_CODES[c] for c in SIGNATURES[name]]
    fn.restype = I

    def call(*args):
        status = fn(*args)
        if status != 0:
            raise RuntimeError(f"{sym} failed with cublasStatus_t {status}")
    call.__name__ = sym
    return call


def gemm_ex():
    """cublasGemmEx (mixed-precision gemm: element types and compute type as arguments)."""
    return routine("", "GemmEx")


def set_stream(handle: int, stream: int) -> None:
    """cublasSetStream; unlike CuPy's wrapper it works while ``stream`` captures. It also resets the handle's
    workspace to cuBLAS's own pool, so :func:`set_workspace` comes after it."""
    routine("", "SetStream")(handle, stream)


def set_workspace(handle: int, ptr: int, nbytes: int) -> None:
    """cublasSetWorkspace: the handle's GEMMs use this device buffer (256-byte aligned) until the next
    set_stream; a captured GEMM keeps using it at every replay, so it must outlive the graph."""
    routine("", "SetWorkspace")(handle, ptr, nbytes)


def set_pointer_mode(handle: int, mode: int) -> None:
    """cublasSetPointerMode (0: alpha and beta on the host, read when the call is made or captured)."""
    routine("", "SetPointerMode")(handle, mode)


def workspace_bytes(cc_major: int) -> int:
    """cuBLAS's default workspace pool size (and its recommended size for a user workspace): 32 MiB from
    Hopper on, 4 MiB before. A workspace of this size keeps its algorithm choices those of the default pool."""
    return (32 if cc_major >= 9 else 4) << 20
