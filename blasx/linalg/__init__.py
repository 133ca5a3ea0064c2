"""scipy.linalg-compatible modules on blasx: :mod:`blasx.linalg.blas` stands in for scipy.linalg.blas."""

from . import blas
from .blas import find_best_blas_type, get_blas_funcs

__all__ = ["blas", "get_blas_funcs", "find_best_blas_type"]
