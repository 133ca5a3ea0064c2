"""Where numpy's and scipy's own BLAS routines are: the addresses the C entry points call directly
(``_hostcall``, "Direct BLAS").

numpy's matmul and dot spend ~0.7 us around their BLAS call on a 16 x 16 product (the ufunc /
dot machinery: ~0.8 us for 2 x 2), scipy's wrappers ~0.1-0.25 (f2py's parsing). A 2-D call of
``blasx.matmul`` / ``dot`` / ``gemm`` or of a ``blasx.linalg.blas`` routine on the CPU calls the
same BLAS routine with the same arguments instead, so it gets the same bits for less. What is
read here:

* numpy's ``cblas_?gemm``: the names numpy's ``_multiarray_umath`` imports (its ELF dynamic symbol
  table: ``scipy_cblas_dgemm64_`` for numpy's wheels, ``cblas_dgemm`` for a build on a system
  BLAS), resolved through that module's own handle, so the search runs over its dependencies:
  the library numpy loaded, not another BLAS of the process (scipy's, MKL's). The C code passes
  every integer argument as 64 bits, which an LP64 and an ILP64 ``cblas_?gemm`` read alike on
  x86-64 and AArch64 Linux (registers, 8-byte stack slots, little endian), so the index width
  need not be known; elsewhere, or for a module that is not ELF, there is no direct matmul.
* scipy's level-3 routines from ``scipy.linalg.cython_blas`` (its ``__pyx_capi__`` capsules: the
  routines scipy's own wrappers call), taken only where the capsule's signature is the one the C
  code calls (Fortran arguments, 32-bit integers: ``int``, or scipy 1.18's ``blas_int`` where a
  safe call shows it is 32 bits, as in scipy's wheels).
* numpy's ``PyArray_NewFromDescr``, ``PyArray_CopyInto`` and ``PyArray_FromAny``: slots 94, 50 and 69 of numpy's C-API
  table (the ``_ARRAY_API`` capsule), where every numpy since 1.x has them
  (``numpy/__multiarray_api.h``; a test reads them there).

_hostcall checks the outcome when it loads: a direct call must give numpy's / scipy's bits on a
few products of every type and order, else that family is left to numpy / scipy.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import re
import struct
import sys

#: numpy's C-API table slots of the functions the C code calls (numpy/__multiarray_api.h)
API_SLOTS = {"PyArray_NewFromDescr": 94, "PyArray_CopyInto": 50, "PyArray_FromAny": 69}
PREFIXES = "sdcz"  # the order of _hostcall.BLAS: float32, float64, complex64, complex128
#: a cblas gemm's name: any prefix and one of the suffixes BLAS builds give (scipy-openblas: 64_,
#: MKL's ILP64: _64); not cblas_dgemm_batch and the like
_CBLAS = re.compile(r"^(\w*?)cblas_([sdcz])gemm(64_|_64)?$")

_held = []  # the handles whose symbols are in use (never closed)


def supported() -> bool:
    """A platform where a 64-bit argument reads as a 32-bit one (x86-64 / AArch64 Linux)."""
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64", "arm64")


def elf_imports(path: str) -> list[str] | None:
    """The undefined symbols of the 64-bit little-endian ELF file ``path`` (its .dynsym), or None
    for anything else."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for _name, kind, _fl, _addr, off, size, link, _info, _align, entsize in sections:
        if kind != 11:  # SHT_DYNSYM
            continue
        stroff = sections[link][4]
        names = []
        for p in range(off, off + size, entsize or 24):
            st_name, _st_info, _other, shndx = struct.unpack_from("<IBBH", data, p)
            if shndx == 0 and st_name:
                end = data.index(b"\0", stroff + st_name)
                names.append(data[stroff + st_name:end].decode("ascii", "replace"))
        return names
    return None


def cblas_names(imports) -> tuple[str, ...] | None:
    """numpy's four cblas gemm names (s, d, c, z) among ``imports``, or None unless each is there once."""
    found = {}
    for name in imports or ():
        m = _CBLAS.match(name)
        if m:
            if m.group(2) in found:
                return None
            found[m.group(2)] = name
    return tuple(found[p] for p in PREFIXES) if len(found) == 4 else None


def numpy_gemm() -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """(names, addresses) of the cblas gemm routines numpy's matmul and dot call, or None."""
    if not supported():
        return None
    try:
        from numpy._core import _multiarray_umath as umath
    except ImportError:  # numpy 1.x
        from numpy.core import _multiarray_umath as umath
    names = cblas_names(elf_imports(umath.__file__))
    if names is None:
        return None
    try:
        handle = ctypes.CDLL(umath.__file__)  # (loaded already: its handle, whose search runs over its dependencies)
        addrs = tuple(ctypes.cast(getattr(handle, n), ctypes.c_void_p).value for n in names)
    except (OSError, AttributeError):
        return None
    _held.append(handle)
    return names, addrs


def _capsule_name(capsule) -> bytes | None:
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    return get_name(capsule)


def _capsule_pointer(capsule) -> int:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return get(capsule, _capsule_name(capsule))


def capsule_signature(capsule) -> str:
    """A Cython capsule's name: the C signature of the function it holds."""
    return (_capsule_name(capsule) or b"").decode()


#: routine -> its Fortran arguments as the C code passes them (c: char *, i: int *, p: a scalar's or
#: an array's pointer): what scipy.linalg.cython_blas's capsule must declare
F77_ARGS = {"gemm": "cciiippipippi", "symm": "cciippipippi", "hemm": "cciippipippi", "syrk": "cciippippi",
            "herk": "cciippippi", "syr2k": "cciippipippi", "her2k": "cciippipippi", "trmm": "cccciippipi",
            "trsm": "cccciippipi"}


def f77_args(signature: str, int_bits: int | None = 32) -> str:
    """A capsule's C signature (``void (char *, int *, double *, ...)``) as F77_ARGS spells it; "?"
    for anything else. scipy >= 1.18 declares its integers ``blas_int`` (a Cython typedef, int in
    scipy's wheels, int64_t in an ILP64 build): "i" where ``int_bits`` (blas_int_bits()) is 32."""
    m = re.fullmatch(r"void \((.*)\)", signature)
    if m is None:
        return "?"
    out = []
    for arg in m.group(1).split(","):
        arg = arg.strip()
        out.append("c" if arg == "char *" else "i" if arg == "int *" or (arg.endswith("blas_int *") and int_bits == 32)
                   else "?" if re.search(r"int|long|short|size|void", arg) or not re.fullmatch(r"\w+ \*", arg)
                   else "p")
    return "".join(out)


@functools.lru_cache(maxsize=None)
def blas_int_bits() -> int | None:
    """The width of scipy.linalg.cython_blas's integers: 32 where its capsules declare ``int *``; for
    a ``blas_int`` typedef, found by a call of its dnrm2 that is safe at either width: n given as
    the 32-bit ints (3, -1) is 3 to a 32-bit read (the norm of 3, 4, 12: 13) and negative to a
    64-bit one (BLAS returns 0 at once, reading nothing). None: not known."""
    try:
        from scipy.linalg import cython_blas
        capsule = cython_blas.__pyx_capi__["dnrm2"]
    except (ImportError, AttributeError, KeyError):
        return None
    sig = capsule_signature(capsule)
    if "(int *," in sig:
        return 32
    if not re.fullmatch(r"\w+ \((\w*blas_int) \*, \w+ \*, \1 \*\)", sig):
        return None
    nrm2 = ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(_capsule_pointer(capsule))
    n, inc = (ctypes.c_int32 * 2)(3, -1), (ctypes.c_int32 * 2)(1, 0)
    x = (ctypes.c_double * 3)(3.0, 4.0, 12.0)
    got = nrm2(n, x, inc)
    return 32 if got == 13.0 else 64 if got == 0.0 else None


def scipy_routine(prefix: str, routine: str) -> int | None:
    """The address of scipy.linalg.cython_blas's ``prefix + routine`` where its capsule declares the
    arguments the C code passes (F77_ARGS), else None."""
    try:
        from scipy.linalg import cython_blas
        capsule = cython_blas.__pyx_capi__[prefix + routine]
    except (ImportError, AttributeError, KeyError):
        return None
    sig = capsule_signature(capsule)
    if f77_args(sig, blas_int_bits() if "blas_int" in sig else 32) != F77_ARGS.get(routine):
        return None
    return _capsule_pointer(capsule)


def scipy_gemm() -> tuple[int, ...] | None:
    """The addresses of scipy.linalg.cython_blas's sgemm, dgemm, cgemm, zgemm, or None."""
    addrs = tuple(scipy_routine(p, "gemm") for p in PREFIXES)
    return None if None in addrs else addrs


def numpy_api() -> tuple[int, int, int] | None:
    """The addresses of numpy's API_SLOTS functions (its C-API table), in that order, or None."""
    try:
        from numpy._core import _multiarray_umath as umath
    except ImportError:
        from numpy.core import _multiarray_umath as umath
    capsule = getattr(umath, "_ARRAY_API", None)
    if capsule is None:
        return None
    table = _capsule_pointer(capsule)
    slots = tuple(ctypes.c_void_p.from_address(table + k * ctypes.sizeof(ctypes.c_void_p)).value for k in API_SLOTS.values())
    return None if None in slots else slots
