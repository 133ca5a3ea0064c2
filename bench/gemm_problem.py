"""One case of bench.gemm: its numbers (flop count, tolerance, typed scalars, random host arrays, relative
error) and the Problem, the host arrays that every contender uses in one mode."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np

from blasx.runtime.dtypes import GEMM_BY_PREFIX as BY_PREFIX
from blasx.runtime.dtypes import GEMM_PREFIXES as PREFIXES

from . import gemm_lp
from .level3_check import _parallel, sample_rows

#: how a Problem's host arrays are held while the contenders run (bench/README.md)
MODES = ("registered", "pageable", "fresh")


# --------------------------------------------------------------------------- numbers


def flop_count(dtype: str, m: int, n: int, k: int) -> float:
    """2MNK real flops; a complex multiply-add is 4 real ones (the type's flop_factor)."""
    return 2.0 * m * n * k * BY_PREFIX[dtype].flop_factor


def tflops(dtype: str, m: int, n: int, k: int, seconds: float | None) -> float | None:
    if not seconds or seconds <= 0:
        return None
    return flop_count(dtype, m, n, k) / seconds / 1e12


def tolerance(dtype: str, k: int, math_mode: str = "ieee") -> float:
    """||C - ref||_F / ||ref||_F allowed: 1e-4 in single, 1e-10 in double precision, times
    sqrt(K / 8192) above K = 8192; h, b and TF32: 4x blasx.precision.tolerance (from the
    accumulation length); i8: 0 (exact)."""
    if gemm_lp.reduced(dtype, math_mode):
        from blasx.precision import tolerance as lp_tolerance
        return 4.0 * lp_tolerance(BY_PREFIX[dtype].dtype, k, math=math_mode)
    base = 1e-4 if BY_PREFIX[dtype].real.itemsize == 4 else 1e-10
    return base * max(1.0, math.sqrt(k / 8192))


def typed_scalar(value: complex, dtype: str):
    if BY_PREFIX[dtype].dtype.kind in "iu":
        return int(round(complex(value).real))  # int8 gemm's scalars are int32
    return complex(value) if BY_PREFIX[dtype].is_complex else float(complex(value).real)


def _column_chunks(rows: int, cols: int, elements: int = 1 << 22) -> list[tuple[int, int]]:
    step = max(1, elements // max(1, rows))
    return [(j, min(cols, j + step)) for j in range(0, cols, step)]


def sum_squares(x: np.ndarray, ref: np.ndarray | None = None) -> float:
    """sum |x - ref|^2 (or sum |x|^2), in float64, by column chunks (bounded temporaries)."""
    wide = np.result_type(x.dtype, np.float64) if ref is None else ref.dtype

    def part(cols: tuple[int, int]) -> float:
        d = x[:, cols[0]:cols[1]].astype(wide)
        if ref is not None:
            np.subtract(d, ref[:, cols[0]:cols[1]], out=d)
        flat = d.ravel(order="K")
        return float(np.vdot(flat, flat).real)

    return sum(_parallel(part, _column_chunks(*x.shape)))


def frobenius(x: np.ndarray) -> float:
    return math.sqrt(sum_squares(x))


def rel_error(result, ref: np.ndarray, ref_norm: float) -> float:
    """||result - ref||_F / ||ref||_F; inf when result is missing or of the wrong shape."""
    if result is None:
        return math.inf
    result = np.asarray(result)
    if result.shape != ref.shape:
        return math.inf
    diff = math.sqrt(sum_squares(result, ref))
    return diff / ref_norm if ref_norm > 0 else diff


def random_matrix(rng: np.random.Generator, rows: int, cols: int, dtype) -> np.ndarray:
    """F-ordered matrix of uniform(-1, 1) entries (real and imaginary parts), made by column chunks on a
    thread pool, chunk i from the i-th generator ``rng`` spawns (the values do not depend on the thread
    count), so that no full-size float64 temporary exists and a 65536^2 matrix takes seconds."""
    dtype = np.dtype(dtype)
    out = np.empty((rows, cols), dtype=dtype, order="F")
    chunks = _column_chunks(rows, cols)

    def fill(item):
        g, (j0, j1) = item
        shape = (rows, j1 - j0)
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            out[:, j0:j1] = g.integers(max(info.min, -128), min(info.max, 127) + 1, shape)
        elif dtype.kind == "c":
            out[:, j0:j1].real = g.uniform(-1.0, 1.0, shape)
            out[:, j0:j1].imag = g.uniform(-1.0, 1.0, shape)
        elif dtype.itemsize == 2:  # float16, bfloat16: float32 draws rounded once (a float64 cast is slow)
            x = g.random(shape, dtype=np.float32)
            x *= 2
            x -= 1
            out[:, j0:j1] = x if dtype == np.float16 else _bfloat16_bits(x).view(dtype)
        else:
            out[:, j0:j1] = g.uniform(-1.0, 1.0, shape)

    _parallel(fill, zip(rng.spawn(len(chunks)), chunks))
    return out


def _bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """The bfloat16 bits of finite float32 values, rounded to nearest even (ml_dtypes' rounding)."""
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


# --------------------------------------------------------------------------- the problem


@dataclass
class Problem:
    """One (dtype, M, N, K) problem in one mode: the host arrays every contender uses."""
    dtype: str
    m: int
    n: int
    k: int
    alpha: object
    beta: object
    a: np.ndarray
    b: np.ndarray
    c_init: np.ndarray | None      # pristine C; None when beta == 0
    c_out: np.ndarray              # the one output every contender writes
    gpus: list[int]
    tolerance: float
    ref: np.ndarray | None = None
    ref_norm: float = 0.0
    mode: str = ""
    ref_rows: np.ndarray | None = None  # the rows of C the reference covers (sample_rows; None: all)
    math: str = "ieee"

    @property
    def size(self) -> str:
        return size_label(self.m, self.n, self.k)

    def poison(self) -> None:
        """Make a stale result detectable: NaN when beta == 0, else the pristine C."""
        if self.c_init is None:
            self.c_out.fill(np.iinfo(self.c_out.dtype).min if self.c_out.dtype.kind in "iu" else np.nan)
        else:
            np.copyto(self.c_out, self.c_init)


def size_label(m: int, n: int, k: int) -> str:
    return str(n) if m == n == k else f"{m}x{n}x{k}"


def make_problem(args: argparse.Namespace, dtype: str, m: int, n: int, k: int,
                 gpus: list[int]) -> Problem:
    rng = np.random.default_rng([args.seed, PREFIXES.index(dtype), m, n, k])
    row = BY_PREFIX[dtype]
    dt, out = row.dtype, row.out
    beta = typed_scalar(args.beta, dtype)
    a = random_matrix(rng, m, k, dt)
    b = random_matrix(rng, k, n, dt)
    c_init = random_matrix(rng, m, n, out) if beta != 0 else None
    c_out = np.empty((m, n), dtype=out, order="F")
    lp = gemm_lp.reduced(dtype, args.math)
    rows = args.check_rows if args.check_rows is not None else (256 if lp else None)
    return Problem(dtype, m, n, k, typed_scalar(args.alpha, dtype), beta, a, b, c_init, c_out,
                   list(gpus), tolerance(dtype, k, args.math),
                   ref_rows=None if rows is None else sample_rows(m, min(rows, m), args.seed),
                   math=args.math)


def host_bytes_needed(dtype: str, m: int, n: int, k: int, beta, ref_rows: int | None = None,
                      fresh: bool = False) -> int:
    """Host bytes of one problem: A, B, C (and pristine C), the reference rows; ``fresh`` mode adds the new
    copies of A and B and blasx's own result."""
    row = BY_PREFIX[dtype]
    out_item, ref_item = row.out.itemsize, row.wide.itemsize
    inputs = (m * k + k * n) * row.itemsize
    return (inputs + m * n * out_item * (2 if beta != 0 else 1) + (m if ref_rows is None else ref_rows) * n * ref_item
            + (inputs + m * n * out_item if fresh else 0))
