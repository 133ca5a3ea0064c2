"""The one table of BLAS types: prefix, numpy dtype, precision, flop factor, cuBLAS type ids.

Every module that maps between a BLAS prefix (``s d c z``), a numpy dtype, a type name a user
types (``float64``, ``double``) or a cuBLAS/CUDA type id reads it from here. New types (half,
bfloat16, int8) are new rows.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class BlasType(NamedTuple):
    prefix: str          # BLAS/cuBLAS routine prefix: s, d, c, z
    dtype: np.dtype      # the array type
    real: np.dtype       # the real type of the same precision (herk's alpha/beta, norms)
    complex: np.dtype    # the complex type of the same precision (hemm/herk on real input)
    wide: np.dtype       # the reference type tests and benchmarks check results in
    flop_factor: float   # real flops per flop of the real-arithmetic count (complex multiply-add: 4)
    cuda_type: int       # cudaDataType of the elements (CUDA_R_32F = 0, ...)
    names: tuple         # other names a user may type for it (CLI, tune)

    @property
    def is_complex(self) -> bool:
        return self.dtype.kind == "c"

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


def _t(prefix, dtype, real, cplx, wide, factor, cuda, *names) -> BlasType:
    return BlasType(prefix, np.dtype(dtype), np.dtype(real), np.dtype(cplx), np.dtype(wide), factor, cuda, names)


#: In BLAS order (s, d, c, z).
TYPES: tuple[BlasType, ...] = (
    _t("s", np.float32, np.float32, np.complex64, np.float64, 1.0, 0, "float32", "single", "f4"),
    _t("d", np.float64, np.float64, np.complex128, np.float64, 1.0, 1, "float64", "double", "f8"),
    _t("c", np.complex64, np.float32, np.complex64, np.complex128, 4.0, 4, "complex64", "c8"),
    _t("z", np.complex128, np.float64, np.complex128, np.complex128, 4.0, 5, "complex128", "c16"),
)

PREFIXES = "".join(t.prefix for t in TYPES)
BY_PREFIX: dict[str, BlasType] = {t.prefix: t for t in TYPES}
BY_DTYPE: dict[np.dtype, BlasType] = {t.dtype: t for t in TYPES}
DTYPES: tuple[np.dtype, ...] = tuple(t.dtype for t in TYPES)
_BY_NAME: dict[str, BlasType] = {**BY_PREFIX, **{n: t for t in TYPES for n in t.names}}

ALLOWED = ", ".join(t.dtype.name for t in TYPES)


def of(dtype) -> BlasType | None:
    """The row of a numpy dtype (or anything np.dtype takes), None if it is no BLAS type."""
    try:
        return BY_DTYPE.get(np.dtype(dtype))
    except TypeError:
        return None


def parse(text: str) -> BlasType:
    """The row named by a prefix (``d``) or a type name (``float64``, ``double``); ValueError otherwise."""
    t = _BY_NAME.get(str(text).strip().lower())
    if t is None:
        raise ValueError(f"dtype: got {text!r}, allowed: {', '.join(PREFIXES)} ({ALLOWED})")
    return t


def prefix(dtype) -> str:
    """The BLAS prefix of a BLAS dtype (KeyError for another type)."""
    return BY_DTYPE[np.dtype(dtype)].prefix
