"""The one table of BLAS types: prefix (``s d c z``), numpy dtype, type names a user types (``float64``,
``double``), precision, flop factor, cuBLAS/CUDA type ids.

:data:`TYPES`: the level-3 types ``s d c z``; :data:`GEMM_TYPES` adds the reduced-precision types ``h``
(float16), ``b`` (bfloat16, where ``ml_dtypes`` imports) and ``i8`` (int8), which have gemm alone and
accumulate in a wider type. :data:`GEMM_OUT` lists each input type's output types.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

try:  # optional: bfloat16 exists only where ml_dtypes does
    from ml_dtypes import bfloat16 as _bfloat16
except ImportError:  # pragma: no cover - depends on the environment
    _bfloat16 = None

# cudaDataType_t (library_types.h) of the element types the engine moves or computes in.
CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_8I, CUDA_C_32F, CUDA_C_64F = 0, 1, 2, 3, 4, 5
CUDA_R_32I, CUDA_R_16BF = 10, 14
# cublasComputeType_t (cublas_api.h): the accumulation type and math of cublasGemmEx.
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F, CUBLAS_COMPUTE_32I, CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 70, 72, 77
CUBLAS_GEMM_DEFAULT = -1  # cublasGemmAlgo_t: cuBLAS picks the algorithm

#: Math modes of float32 GEMM: IEEE float32 products (the default), or TF32 tensor cores
#: (inputs rounded to 10 mantissa bits, float32 accumulation).
MATH_MODES = ("ieee", "tf32")


class BlasType(NamedTuple):
    prefix: str          # BLAS/cuBLAS routine prefix: s, d, c, z; h, b, i8 (gemm only)
    dtype: np.dtype      # the array type
    real: np.dtype       # the real type of the same precision (herk's alpha/beta, norms)
    complex: np.dtype    # the complex type of the same precision (hemm/herk on real input)
    wide: np.dtype       # the reference type tests and benchmarks check results in
    flop_factor: float   # real flops per flop of the real-arithmetic count (complex multiply-add: 4)
    cuda_type: int       # cudaDataType of the elements (CUDA_R_32F = 0, ...)
    names: tuple         # other names a user may type for it (CLI, tune)
    compute: np.dtype = None   # accumulation type: the C tile's type on a device, and alpha/beta's
    out: np.dtype = None       # default output type of gemm
    cuda_compute: int = 0      # cublasComputeType_t of cublasGemmEx (IEEE math)
    level3: bool = True        # has every level-3 routine (False: gemm only)

    @property
    def is_complex(self) -> bool:
        return self.dtype.kind == "c"

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def reduced(self) -> bool:
        """Accumulates in a wider type than its inputs (h, b, i8)."""
        return self.compute != self.dtype


def _t(prefix, dtype, real, cplx, wide, factor, cuda, names, compute=None, out=None, cuda_compute=0,
       level3=True) -> BlasType:
    dt = np.dtype(dtype)
    return BlasType(prefix, dt, np.dtype(real), np.dtype(cplx), np.dtype(wide), factor, cuda, tuple(names),
                    np.dtype(compute or dt), np.dtype(out or dt), cuda_compute, level3)


_ROWS = [
    _t("s", np.float32, np.float32, np.complex64, np.float64, 1.0, CUDA_R_32F, ("float32", "single", "f4"),
       cuda_compute=CUBLAS_COMPUTE_32F),
    _t("d", np.float64, np.float64, np.complex128, np.float64, 1.0, CUDA_R_64F, ("float64", "double", "f8"),
       cuda_compute=CUBLAS_COMPUTE_64F),
    _t("c", np.complex64, np.float32, np.complex64, np.complex128, 4.0, CUDA_C_32F, ("complex64", "c8"),
       cuda_compute=CUBLAS_COMPUTE_32F),
    _t("z", np.complex128, np.float64, np.complex128, np.complex128, 4.0, CUDA_C_64F, ("complex128", "c16"),
       cuda_compute=CUBLAS_COMPUTE_64F),
    _t("h", np.float16, np.float16, np.complex64, np.float64, 1.0, CUDA_R_16F, ("float16", "half", "f2"),
       compute=np.float32, cuda_compute=CUBLAS_COMPUTE_32F, level3=False),
]
if _bfloat16 is not None:
    _ROWS.append(_t("b", _bfloat16, _bfloat16, np.complex64, np.float64, 1.0, CUDA_R_16BF, ("bfloat16", "bf16"),
                    compute=np.float32, cuda_compute=CUBLAS_COMPUTE_32F, level3=False))
_ROWS.append(_t("i8", np.int8, np.int8, np.complex64, np.int64, 1.0, CUDA_R_8I, ("int8", "i1"),
                compute=np.int32, out=np.int32, cuda_compute=CUBLAS_COMPUTE_32I, level3=False))

#: Every row: the level-3 types, then the GEMM-only reduced-precision types.
GEMM_TYPES: tuple[BlasType, ...] = tuple(_ROWS)
#: The level-3 types, in BLAS order (s, d, c, z).
TYPES: tuple[BlasType, ...] = tuple(t for t in GEMM_TYPES if t.level3)

PREFIXES = "".join(t.prefix for t in TYPES)
BY_PREFIX: dict[str, BlasType] = {t.prefix: t for t in TYPES}
BY_DTYPE: dict[np.dtype, BlasType] = {t.dtype: t for t in TYPES}
DTYPES: tuple[np.dtype, ...] = tuple(t.dtype for t in TYPES)
ALLOWED = ", ".join(t.dtype.name for t in TYPES)

GEMM_PREFIXES: tuple[str, ...] = tuple(t.prefix for t in GEMM_TYPES)
GEMM_BY_PREFIX: dict[str, BlasType] = {t.prefix: t for t in GEMM_TYPES}
GEMM_BY_DTYPE: dict[np.dtype, BlasType] = {t.dtype: t for t in GEMM_TYPES}
GEMM_ALLOWED = ", ".join(t.dtype.name for t in GEMM_TYPES)

#: gemm's output types per input type (the first is the default): half and bfloat16 round the
#: float32 accumulation to their own type or keep it; int8 accumulates exactly in int32.
GEMM_OUT: dict[np.dtype, tuple[np.dtype, ...]] = {
    t.dtype: (t.out, t.compute) if t.reduced and t.out != t.compute else (t.out,) for t in GEMM_TYPES}

_BY_NAME: dict[str, BlasType] = {**GEMM_BY_PREFIX, **{n: t for t in GEMM_TYPES for n in t.names}}

#: cudaDataType of every element type a tile may hold (inputs, accumulators, outputs).
CUDA_TYPE: dict[np.dtype, int] = {**{t.dtype: t.cuda_type for t in GEMM_TYPES}, np.dtype(np.int32): CUDA_R_32I}


def native(dtype) -> np.dtype:
    """``dtype`` in this machine's byte order (a byte-swapped array holds the same type: its row of the table)."""
    dt = np.dtype(dtype)
    return dt if dt.isnative else dt.newbyteorder("=")


def gemm_of(dtype) -> BlasType | None:
    """The row of a dtype gemm takes (level-3 and reduced types, either byte order; anything np.dtype takes),
    None otherwise."""
    try:
        return GEMM_BY_DTYPE.get(native(dtype))
    except TypeError:
        return None


def is_real(dtype) -> bool:
    """A real number type: numpy's integers and floats, or a real reduced type of the table (bfloat16)."""
    dt = np.dtype(dtype)
    row = gemm_of(dt)
    return dt.kind in "fiu" or (row is not None and not row.is_complex)


def of(dtype) -> BlasType | None:
    """The level-3 row of a numpy dtype (or anything np.dtype takes), None if it is no level-3 type."""
    row = gemm_of(dtype)
    return row if row is not None and row.level3 else None


def parse(text: str, gemm: bool = False) -> BlasType:
    """The row named by a prefix (``d``) or a type name (``float64``, ``double``); ValueError
    otherwise. With ``gemm`` the reduced types (``h``, ``b``, ``i8``) are accepted too."""
    t = _BY_NAME.get(str(text).strip().lower())
    if t is None or not (t.level3 or gemm):
        names = GEMM_PREFIXES if gemm else PREFIXES
        raise ValueError(f"dtype: got {text!r}, allowed: {', '.join(names)} ({GEMM_ALLOWED if gemm else ALLOWED})")
    return t


def prefix(dtype) -> str:
    """The prefix of a dtype of the table (KeyError for another type)."""
    return GEMM_BY_DTYPE[np.dtype(dtype)].prefix


def compute_type(row: BlasType, math: str = "ieee") -> int:
    """cublasGemmEx's compute type for ``row`` under ``math`` (TF32 applies to float32 alone)."""
    return CUBLAS_COMPUTE_32F_FAST_TF32 if math == "tf32" and row.prefix == "s" else row.cuda_compute


def gemm_combinations() -> str:
    """Every (input, output) type pair gemm takes, for error messages."""
    return "; ".join(f"{t.dtype.name} -> {' or '.join(o.name for o in GEMM_OUT[t.dtype])}" for t in GEMM_TYPES)
