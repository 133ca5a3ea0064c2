"""cuSOLVER's triangle inversion (``cusolverDnXtrtri``), called through ctypes.

CuPy 14 does not bind ``cusolverDnXtrtri`` (its generic 64-bit API). It is taken from the
libcusolver CuPy loads (found in ``/proc/self/maps`` after importing CuPy's binding), else from
the CUDA wheels' path finder. One :class:`Trtri` per device and stream owns a cuSOLVER handle
bound to that stream and a device workspace, so inversions on different streams never share
scratch memory; ctypes releases the GIL during each call.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

P, I, I64, SZ = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_size_t

#: cudaDataType of each BLAS type.
CUDA_TYPE = {np.dtype(np.float32): 0, np.dtype(np.float64): 1,
             np.dtype(np.complex64): 4, np.dtype(np.complex128): 5}


def _mapped(name: str) -> list[str]:
    paths = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if f"/{name}.so" in path and path not in paths:
                paths.append(path)
    return paths


@functools.lru_cache(maxsize=1)
def libcusolver() -> ctypes.CDLL:
    """The libcusolver of this process: CuPy's, else the one the CUDA path finder names."""
    try:
        from cupy_backends.cuda.libs import cusolver  # noqa: F401 - loads it where CuPy links it
    except ImportError:
        pass
    paths = _mapped("libcusolver")
    if not paths:
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib
            paths = [load_nvidia_dynamic_lib("cusolver").abs_path]
        except Exception as exc:  # noqa: BLE001 - any failure means: not available here
            raise OSError(f"libcusolver is not loaded in this process and the CUDA path finder "
                          f"could not find it: {exc!r}") from exc
    lib = ctypes.CDLL(paths[0])
    for name, args in (("cusolverDnCreate", [P]), ("cusolverDnDestroy", [P]), ("cusolverDnSetStream", [P, P]),
                       ("cusolverDnXtrtri_bufferSize", [P, I, I, I64, I, P, I64, P, P]),
                       ("cusolverDnXtrtri", [P, I, I, I64, I, P, I64, P, SZ, P, SZ, P])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, I
    return lib


def available() -> bool:
    try:
        libcusolver()
    except (OSError, AttributeError):
        return False
    return True


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cusolverStatus_t {status}")


class Trtri:
    """In-place inversion of triangles on one CUDA stream (of the current device)."""

    def __init__(self, stream_ptr: int) -> None:
        import cupy
        lib = libcusolver()
        self._lib = lib
        self.handle = P()
        _check(lib.cusolverDnCreate(ctypes.byref(self.handle)), "cusolverDnCreate")
        _check(lib.cusolverDnSetStream(self.handle, P(stream_ptr)), "cusolverDnSetStream")
        self._work = None  # CuPy buffer, grown on demand
        self._host = None  # numpy buffer, if cuSOLVER asks for host workspace
        self._info = cupy.zeros(1, dtype=np.int32)

    def invert(self, ptr: int, n: int, ld: int, lower: int, unit: int, dtype) -> None:
        """Replace the ``lower`` (else upper) triangle of the n x n column-major matrix at ``ptr``
        (leading dimension ``ld``) by its inverse; ``unit``: its diagonal is taken as ones. Queued
        on the stream; a singular triangle is not reported (as cuBLAS trsm does not)."""
        import cupy
        lib, h, ctype = self._lib, self.handle, CUDA_TYPE[np.dtype(dtype)]
        uplo = 0 if lower else 1  # cublasFillMode_t: 0 lower, 1 upper
        dev_bytes, host_bytes = SZ(), SZ()
        _check(lib.cusolverDnXtrtri_bufferSize(h, uplo, int(unit), n, ctype, P(ptr), ld, ctypes.byref(dev_bytes),
                                               ctypes.byref(host_bytes)), "cusolverDnXtrtri_bufferSize")
        if self._work is None or self._work.nbytes < dev_bytes.value:
            self._work = cupy.empty(max(1, dev_bytes.value), dtype=np.uint8)
        if host_bytes.value and (self._host is None or self._host.nbytes < host_bytes.value):
            self._host = np.empty(host_bytes.value, dtype=np.uint8)
        host_ptr = self._host.ctypes.data if host_bytes.value else None
        _check(lib.cusolverDnXtrtri(h, uplo, int(unit), n, ctype, P(ptr), ld, P(self._work.data.ptr), dev_bytes,
                                    P(host_ptr), host_bytes, P(self._info.data.ptr)), "cusolverDnXtrtri")

    def close(self) -> None:
        if self.handle:
            self._lib.cusolverDnDestroy(self.handle)
            self.handle = P()
        self._work = self._host = self._info = None
