"""A small ctypes binding of cuBLAS-XT GEMM, the multi-GPU baseline of the benchmarks.

cuBLAS-XT (``cublasXt.h``, shipped inside libcublas) is NVIDIA's host-memory, multi-GPU,
tiled level-3 BLAS: the baseline the BLASX paper compares against. Only what the GEMM
benchmark needs is bound here::

    with CublasXt(devices=[0, 1], block_dim=4096) as xt:
        xt.gemm(1.0, a, b, 0.0, c)          # c := 1.0 * a @ b + 0.0 * c, in place

Also here: :func:`find_libcublas` and the host-registration helpers
(:func:`register_host`, :func:`unregister_host`, :func:`registered`) used by the
"registered host arrays" benchmark mode. Nothing imports CuPy at module import time.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
import re
import site
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from blasx.runtime.dtypes import ALLOWED, TYPES, BlasType

__all__ = [
    "CublasXt", "find_libcublas", "load_libcublas", "cublas_version", "plan_gemm", "GemmPlan",
    "register_host", "unregister_host", "registered", "Registration",
    "CUBLAS_OP_N", "CUBLAS_OP_T", "CUBLAS_OP_C",
]

# --------------------------------------------------------------------------- constants

#: cublasOperation_t
CUBLAS_OP_N, CUBLAS_OP_T, CUBLAS_OP_C = 0, 1, 2

#: cublasXtPinnedMemMode_t
CUBLASXT_PINNING_DISABLED, CUBLASXT_PINNING_ENABLED = 0, 1

#: cublasStatus_t values -> names (cublas_api.h)
CUBLAS_STATUS = {
    0: "CUBLAS_STATUS_SUCCESS",
    1: "CUBLAS_STATUS_NOT_INITIALIZED",
    3: "CUBLAS_STATUS_ALLOC_FAILED",
    7: "CUBLAS_STATUS_INVALID_VALUE",
    8: "CUBLAS_STATUS_ARCH_MISMATCH",
    11: "CUBLAS_STATUS_MAPPING_ERROR",
    13: "CUBLAS_STATUS_EXECUTION_FAILED",
    14: "CUBLAS_STATUS_INTERNAL_ERROR",
    15: "CUBLAS_STATUS_NOT_SUPPORTED",
    16: "CUBLAS_STATUS_LICENSE_ERROR",
}

#: libraryPropertyType (library_types.h), for cublasGetProperty
_MAJOR_VERSION, _MINOR_VERSION, _PATCH_LEVEL = 0, 1, 2


class _CuComplex(ctypes.Structure):
    """cuComplex: float2."""
    _fields_ = [("x", ctypes.c_float), ("y", ctypes.c_float)]


class _CuDoubleComplex(ctypes.Structure):
    """cuDoubleComplex: double2."""
    _fields_ = [("x", ctypes.c_double), ("y", ctypes.c_double)]


@dataclass(frozen=True)
class _GemmEntry:
    symbol: str
    scalar: type          # ctypes type of alpha and beta
    is_complex: bool


def scalar_ctype(t: BlasType, real: bool = False) -> type:
    """The ctypes type cuBLAS reads a scalar of BLAS type ``t`` as (``real``: its real type's, as
    HERK's alpha and beta)."""
    base = ctypes.c_float if t.real.itemsize == 4 else ctypes.c_double
    if real or not t.is_complex:
        return base
    return _CuComplex if base is ctypes.c_float else _CuDoubleComplex


#: numpy dtype -> cuBLAS-XT gemm routine and its scalar type
GEMM_TABLE = {t.dtype: _GemmEntry(f"cublasXt{t.prefix.upper()}gemm", scalar_ctype(t), t.is_complex) for t in TYPES}

# --------------------------------------------------------------------------- finding libcublas

_WHEEL_DIRS = ("nvidia/cu13/lib", "nvidia/cublas/lib")
_SYSTEM_GLOBS = ("/usr/local/cuda*/lib64", "/usr/local/cuda*/targets/*/lib")
_ENV_OVERRIDE = "BLASX_LIBCUBLAS"
_LIBNAME = re.compile(r"libcublas\.so(?:\.(\d+))?(?:\.[\d.]+)?$")


def _site_dirs() -> list[str]:
    dirs: list[str] = []
    with contextlib.suppress(Exception):
        dirs += site.getsitepackages()
    with contextlib.suppress(Exception):
        dirs.append(site.getusersitepackages())
    dirs += [p for p in sys.path if p]
    seen: set[str] = set()
    return [d for d in dirs if not (d in seen or seen.add(d))]


def _best(paths: Sequence[str]) -> str | None:
    """The preferred libcublas among candidates: the highest major soname, real files first."""
    def key(p: str) -> tuple[int, int, str]:
        m = _LIBNAME.search(os.path.basename(p))
        major = int(m.group(1)) if m and m.group(1) else -1
        return (major, 0 if os.path.islink(p) else 1, p)
    found = [p for p in paths if _LIBNAME.search(os.path.basename(p)) and os.path.exists(p)]
    return max(found, key=key) if found else None


def _loaded_libcublas() -> str | None:
    """A libcublas already mapped into this process (CuPy loads one), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            fields = [line.split(None, 5) for line in f]
    except OSError:
        return None
    paths = {x[5].strip() for x in fields if len(x) == 6}
    return _best([p for p in paths if "/libcublas.so" in p])


def _force_cupy_cublas() -> None:
    """Make CuPy load its libcublas (so that it shows in /proc/self/maps)."""
    with contextlib.suppress(Exception):
        import cupy
        cupy.cuda.device.get_cublas_handle()


def find_libcublas() -> str:
    """Path of the libcublas to bind cuBLAS-XT from.

    Search order: ``$BLASX_LIBCUBLAS``; a libcublas already loaded in this process (the one
    CuPy uses, so that one process does not hold two copies of cuBLAS); the pip wheels
    (``site-packages/nvidia/cu13/lib``, ``nvidia/cublas/lib``); ``/usr/local/cuda*/lib64``;
    finally CuPy is imported and made to load its libcublas, and /proc/self/maps is read again.
    Raises FileNotFoundError listing every place looked at.
    """
    looked: list[str] = []
    env = os.environ.get(_ENV_OVERRIDE)
    if env:
        if os.path.exists(env):
            return env
        looked.append(f"${_ENV_OVERRIDE}={env} (does not exist)")

    hit = _loaded_libcublas()
    looked.append("/proc/self/maps (libcublas already loaded)")
    if hit:
        return hit

    for d in _site_dirs():
        for sub in _WHEEL_DIRS:
            pattern = os.path.join(d, sub, "libcublas.so*")
            looked.append(pattern)
            hit = _best(glob.glob(pattern))
            if hit:
                return hit

    for g in _SYSTEM_GLOBS:
        pattern = os.path.join(g, "libcublas.so*")
        looked.append(pattern)
        hit = _best(glob.glob(pattern))
        if hit:
            return hit

    _force_cupy_cublas()
    looked.append("/proc/self/maps after import cupy; cupy.cuda.device.get_cublas_handle()")
    hit = _loaded_libcublas()
    if hit:
        return hit
    raise FileNotFoundError(
        "libcublas not found; set $BLASX_LIBCUBLAS to its path. Looked in:\n  "
        + "\n  ".join(looked))


# --------------------------------------------------------------------------- loading

_c = ctypes
_SIZE = _c.c_size_t
_PTR = _c.c_void_p
_INT = _c.c_int

#: symbol -> argtypes (all return cublasStatus_t, an int)
_SIGNATURES = {
    "cublasXtCreate": [_PTR],                               # cublasXtHandle_t*
    "cublasXtDestroy": [_PTR],
    "cublasXtDeviceSelect": [_PTR, _INT, _c.POINTER(_INT)],
    "cublasXtSetBlockDim": [_PTR, _INT],
    "cublasXtGetBlockDim": [_PTR, _c.POINTER(_INT)],
    "cublasXtSetPinningMemMode": [_PTR, _INT],
    "cublasXtGetPinningMemMode": [_PTR, _c.POINTER(_INT)],
}
# cublasXt?gemm(handle, transa, transb, m, n, k, alpha*, A*, lda, B*, ldb, beta*, C*, ldc)
_GEMM_ARGTYPES = [_PTR, _INT, _INT, _SIZE, _SIZE, _SIZE,
                  _PTR, _PTR, _SIZE, _PTR, _SIZE, _PTR, _PTR, _SIZE]
for _entry in GEMM_TABLE.values():
    _SIGNATURES[_entry.symbol] = _GEMM_ARGTYPES


@functools.lru_cache(maxsize=None)
def load_libcublas(path: str | None = None) -> ctypes.CDLL:
    """Load libcublas (found by :func:`find_libcublas` when `path` is None) and declare the
    cuBLAS-XT prototypes used here."""
    path = path or find_libcublas()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise OSError(f"cannot load libcublas from {path}: {e}") from e
    for name, argtypes in _SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as e:
            raise OSError(f"{path} has no symbol {name}: not a cuBLAS with cuBLAS-XT") from e
        fn.argtypes = argtypes
        fn.restype = _INT
    lib._blasx_path = path
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        name = CUBLAS_STATUS.get(status, f"unknown cublasStatus_t {status}")
        raise RuntimeError(f"{what} failed: {name} ({status})")


def cublas_version(lib: ctypes.CDLL | None = None) -> str | None:
    """cuBLAS version "major.minor.patch" through cublasGetProperty, or None."""
    try:
        lib = lib or load_libcublas()
        fn = lib.cublasGetProperty
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [_INT, _c.POINTER(_INT)], _INT
    parts = []
    for prop in (_MAJOR_VERSION, _MINOR_VERSION, _PATCH_LEVEL):
        v = _INT()
        if fn(prop, _c.byref(v)) != 0:
            return None
        parts.append(str(v.value))
    return ".".join(parts)


# --------------------------------------------------------------------------- layout planning

_OPS = {0: CUBLAS_OP_N, 1: CUBLAS_OP_T, 2: CUBLAS_OP_C,
        "n": CUBLAS_OP_N, "t": CUBLAS_OP_T, "c": CUBLAS_OP_C, "h": CUBLAS_OP_C}
#: cublasOperation_t <-> (transpose, conjugate)
_OP_BITS = {CUBLAS_OP_N: (False, False), CUBLAS_OP_T: (True, False), CUBLAS_OP_C: (True, True)}
_BITS_OP = {v: k for k, v in _OP_BITS.items()}


def _op(trans) -> int:
    key = trans.lower() if isinstance(trans, str) else trans
    if isinstance(key, (bool, np.bool_)):
        key = int(key)
    try:
        return _OPS[key]
    except (KeyError, TypeError):
        raise ValueError(f"trans must be 0/1/2 or 'N'/'T'/'C', not {trans!r}") from None


def _storage(arr: np.ndarray, what: str) -> tuple[bool, int]:
    """How a 2-D array lies in memory, seen column-major: (transposed, leading dimension).

    transposed=False: the memory is the matrix itself, column-major with leading dim ld.
    transposed=True:  the memory is the matrix's transpose, column-major (a row-major array).
    """
    rows, cols = arr.shape
    item = arr.itemsize
    s0, s1 = arr.strides
    if arr.flags.f_contiguous:
        return False, max(1, rows)
    if arr.flags.c_contiguous:
        return True, max(1, cols)
    if s0 == item and s1 > 0 and s1 % item == 0 and s1 // item >= max(1, rows):
        return False, s1 // item
    if s1 == item and s0 > 0 and s0 % item == 0 and s0 // item >= max(1, cols):
        return True, s0 // item
    raise ValueError(
        f"{what}: unsupported memory layout (shape {arr.shape}, strides {arr.strides}); cuBLAS-XT "
        "needs one unit stride and one positive leading-dimension stride: pass a C- or "
        "F-ordered copy (numpy.asfortranarray)")


def _effective_op(trans: int, stored_transposed: bool, flip: bool, is_complex: bool,
                  what: str) -> int:
    """cuBLAS op to apply to the column-major memory of an operand so as to get op(X)
    (or op(X)^T when `flip`)."""
    t, conj = _OP_BITS[trans]
    if not is_complex:
        conj = False
    t = t ^ stored_transposed ^ flip
    if conj and not t:
        raise ValueError(
            f"{what}: conjugate-without-transpose would be needed for this memory order; "
            "cuBLAS has no such op: pass the operand in the other order (C vs F) or "
            "conjugate it yourself")
    return _BITS_OP[(t, conj)]


@dataclass(frozen=True)
class GemmPlan:
    """The column-major call computing C = alpha op(A) op(B) + beta C on numpy arrays.

    ``first``/``second`` name which numpy operand ("a" or "b") goes into the routine's A and
    B slots: ("b", "a") when C is row-major and the transposed problem
    C^T = op(B)^T op(A)^T is computed instead.
    """
    transa: int
    transb: int
    m: int
    n: int
    k: int
    first: str
    second: str
    lda: int
    ldb: int
    ldc: int


def plan_gemm(a: np.ndarray, b: np.ndarray, c: np.ndarray, trans_a=0, trans_b=0) -> GemmPlan:
    """Check shapes/dtypes/layouts and map the row/column-major numpy problem onto one
    column-major cuBLAS call (no copies). Raises TypeError/ValueError on what cannot be done."""
    for name, arr in (("a", a), ("b", b), ("c", c)):
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray in host memory, not {type(arr)}")
        if arr.ndim != 2:
            raise ValueError(f"{name} must be 2-D, got shape {arr.shape}")
    if not (a.dtype == b.dtype == c.dtype):
        raise TypeError(f"dtypes differ: a {a.dtype}, b {b.dtype}, c {c.dtype}")
    if a.dtype not in GEMM_TABLE:
        raise TypeError(f"unsupported dtype {a.dtype}: one of {ALLOWED}")
    if not a.dtype.isnative:
        raise TypeError(f"non-native byte order {a.dtype.str}")
    if not c.flags.writeable:
        raise ValueError("c is read-only")
    op_a, op_b = _op(trans_a), _op(trans_b)
    m, k = a.shape[::-1] if op_a != CUBLAS_OP_N else a.shape
    kb, n = b.shape[::-1] if op_b != CUBLAS_OP_N else b.shape
    if kb != k or c.shape != (m, n):
        raise ValueError(f"shape mismatch: op(a) {m}x{k}, op(b) {kb}x{n}, c {c.shape}")
    cplx = GEMM_TABLE[a.dtype].is_complex
    ta, lda = _storage(a, "a")
    tb, ldb = _storage(b, "b")
    tc, ldc = _storage(c, "c")
    if not tc:      # C column-major: C = op(A) op(B)
        return GemmPlan(_effective_op(op_a, ta, False, cplx, "a"),
                        _effective_op(op_b, tb, False, cplx, "b"),
                        m, n, k, "a", "b", lda, ldb, ldc)
    # C row-major: its memory is C^T column-major, and C^T = op(B)^T op(A)^T
    return GemmPlan(_effective_op(op_b, tb, True, cplx, "b"),
                    _effective_op(op_a, ta, True, cplx, "a"),
                    n, m, k, "b", "a", ldb, lda, ldc)


def _scalar(entry: _GemmEntry, value, what: str):
    v = complex(value)
    if entry.is_complex:
        return entry.scalar(v.real, v.imag)
    if v.imag != 0:
        raise TypeError(f"{what}={value!r} is complex but the dtype is real")
    return entry.scalar(v.real)


# --------------------------------------------------------------------------- the handle

class CublasXt:
    """A cuBLAS-XT handle over `devices`, with square tiles of `block_dim` and, when
    `pinning`, cuBLAS-XT page-locking pageable host matrices itself on every call."""

    def __init__(self, devices: Sequence[int], block_dim: int = 4096, pinning: bool = False,
                 library: str | None = None):
        devices = [int(d) for d in devices]
        if not devices:
            raise ValueError("devices must name at least one GPU")
        if block_dim <= 0:
            raise ValueError(f"block_dim must be positive, got {block_dim}")
        self._lib = load_libcublas(library)
        self.devices, self.block_dim, self.pinning = tuple(devices), int(block_dim), bool(pinning)
        self._handle = _c.c_void_p()
        _check(self._lib.cublasXtCreate(_c.byref(self._handle)), "cublasXtCreate")
        try:
            ids = (_INT * len(devices))(*devices)
            _check(self._lib.cublasXtDeviceSelect(self._handle, len(devices), ids),
                   f"cublasXtDeviceSelect({devices})")
            _check(self._lib.cublasXtSetBlockDim(self._handle, self.block_dim),
                   f"cublasXtSetBlockDim({self.block_dim})")
            mode = CUBLASXT_PINNING_ENABLED if self.pinning else CUBLASXT_PINNING_DISABLED
            _check(self._lib.cublasXtSetPinningMemMode(self._handle, mode),
                   f"cublasXtSetPinningMemMode({mode})")
        except BaseException:
            self.close()
            raise

    @property
    def library(self) -> str:
        return self._lib._blasx_path

    @property
    def closed(self) -> bool:
        return not self._handle.value

    def gemm(self, alpha, a: np.ndarray, b: np.ndarray, beta, c: np.ndarray,
             trans_a=0, trans_b=0) -> None:
        """c := alpha * op(a) @ op(b) + beta * c, in place, on host numpy arrays (C- or
        F-ordered, or strided with one unit stride). Blocks until c holds the result."""
        if self.closed:
            raise RuntimeError("CublasXt handle is closed")
        plan = plan_gemm(a, b, c, trans_a, trans_b)
        if plan.m == 0 or plan.n == 0:
            return
        entry = GEMM_TABLE[a.dtype]
        al, be = _scalar(entry, alpha, "alpha"), _scalar(entry, beta, "beta")
        ops = {"a": a, "b": b}
        first, second = ops[plan.first], ops[plan.second]
        fn = getattr(self._lib, entry.symbol)
        status = fn(self._handle, plan.transa, plan.transb, plan.m, plan.n, plan.k,
                    _c.addressof(al), first.ctypes.data, plan.lda,
                    second.ctypes.data, plan.ldb,
                    _c.addressof(be), c.ctypes.data, plan.ldc)
        _check(status, f"{entry.symbol}(m={plan.m}, n={plan.n}, k={plan.k})")

    def close(self) -> None:
        if self._handle.value:
            h, self._handle = self._handle, _c.c_void_p()
            _check(self._lib.cublasXtDestroy(h), "cublasXtDestroy")

    def __enter__(self) -> CublasXt:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (f"CublasXt(devices={list(self.devices)}, block_dim={self.block_dim}, "
                f"pinning={self.pinning}, {state})")


# --------------------------------------------------------------------------- host registration

def _extent(arr: np.ndarray) -> tuple[int, int]:
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise ValueError("only contiguous (C or F) arrays can be registered whole")
    return arr.ctypes.data, arr.nbytes


def register_host(arr: np.ndarray) -> None:
    """Page-lock a contiguous numpy array with cudaHostRegister (flags 0: on UVA systems the
    memory is then mapped and portable to all devices)."""
    import cupy
    ptr, nbytes = _extent(arr)
    if nbytes:
        cupy.cuda.runtime.hostRegister(ptr, nbytes, 0)


def unregister_host(arr: np.ndarray) -> None:
    """Undo :func:`register_host`."""
    import cupy
    ptr, nbytes = _extent(arr)
    if nbytes:
        cupy.cuda.runtime.hostUnregister(ptr)


@dataclass
class Registration:
    """What :func:`registered` did: bytes page-locked and seconds spent doing and undoing it."""
    nbytes: int = 0
    seconds: float = 0.0
    unregister_seconds: float = 0.0
    arrays: list = field(default_factory=list, repr=False)

    @property
    def seconds_per_gib(self) -> float:
        return self.seconds / (self.nbytes / 2**30) if self.nbytes else 0.0


@contextlib.contextmanager
def registered(*arrays: np.ndarray) -> Iterator[Registration]:
    """Page-lock `arrays` (each buffer once; None entries skipped) for the duration of the
    block, unregistering in reverse order even on errors. Yields a :class:`Registration`."""
    reg = Registration()
    seen: set[int] = set()
    try:
        for arr in arrays:
            if arr is None or arr.ctypes.data in seen or not arr.nbytes:
                continue
            t0 = time.perf_counter()
            register_host(arr)
            reg.seconds += time.perf_counter() - t0
            seen.add(arr.ctypes.data)
            reg.arrays.append(arr)
            reg.nbytes += arr.nbytes
        yield reg
    finally:
        t0 = time.perf_counter()
        errors = []
        for arr in reversed(reg.arrays):
            try:
                unregister_host(arr)
            except Exception as e:      # keep unregistering the others
                errors.append(e)
        reg.unregister_seconds = time.perf_counter() - t0
        reg.arrays.clear()
        if errors and sys.exc_info()[0] is None:   # never mask the body's own exception
            raise errors[0]
