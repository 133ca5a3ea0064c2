"""Level-3 routines beside GEMM: blasx against cuBLAS-XT, in one process, on the same arrays.

    python -m bench.level3 --n 8192,16384 --dtypes d,s --gpus 2 --runs 3 --xt-block 8192 --out bench/results
    python -m bench.level3 --n 16384,32768 --dtypes z,c --gpus 1 --runs 1 \\
        --routines gemm,symm,hemm,syrk,herk,syr2k,her2k,trmm,trsm

Single (s), double (d), single complex (c) and double complex (z) precision, F-ordered host
arrays page-locked before timing (the "registered" case), upper triangle, no transpose, left side,
non-unit diagonal. alpha 1.5 / beta 0.5 for s and d; alpha 1.5-0.5j / beta 0.5+0.25j for c and z,
except where BLAS takes real scalars: HERK (alpha 1.5, beta 0.5) and HER2K (beta 0.5). The
Hermitian routines (HEMM, HERK, HER2K) exist for c and z only. Every result is checked on a
sample of rows spread over the matrix against a float64 (complex128 for c and z) reference
computed by numpy (for TRSM: the residual op(A) X - alpha B on those rows); the tolerance on the
relative error is 1e-9 (d, z) or 1e-4 (s, c), times sqrt(N / 8192) above N = 8192. Rates use each
routine's flop count (GEMM, SYMM, HEMM 2N^3, SYRK, HERK N^3, SYR2K, HER2K 2N^3, TRMM, TRSM N^3;
x4 for complex types, whose multiply-add is 8 real flops against 2), so a routine at GEMM's rate
means GEMM-like efficiency.

The arrays of one (N, dtype) exist only while that case runs; float32 and complex arrays are made
from float64 random numbers cast chunk by chunk (never a full float64 copy). The pure pieces
(argument parsing, array generation, the checks, the tables) are also used by ``bench.efficiency``
and ``bench.ab``; CuPy and cuBLAS-XT are only touched inside :func:`main`'s run loop.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes as C
import datetime as dt
import gc
import json
import math
import os
import re
import random
import shlex
import socket
import subprocess
import sys
import time

import numpy as np

from blasx.runtime.dtypes import BY_PREFIX, PREFIXES, TYPES, of

from .cublasxt import CublasXt, _check, registered, scalar_ctype

UPPER_XT, LEFT, NOTRANS, NONUNIT = 1, 0, 0, 0  # cuBLAS enums: FILL_MODE_UPPER = 1
S, P, I = C.c_size_t, C.c_void_p, C.c_int


#: dtype letter -> words for tables ("double complex"), from the BLAS type table
DTYPE_NAMES = {t.prefix: ("single" if t.real.itemsize == 4 else "double") + (" complex" if t.is_complex else "")
               for t in TYPES}
#: the dtypes that :func:`parse_dtypes` allows by default (bench.efficiency's --dtypes: real only)
REAL_DTYPES = tuple(t.prefix for t in TYPES if not t.is_complex)


def base_tolerance(dtype: str) -> float:
    """Relative-error tolerance of the checks at N <= 8192: 1e-4 in single, 1e-9 in double precision."""
    return 1e-4 if BY_PREFIX[dtype].real.itemsize == 4 else 1e-9


#: routine -> the dtype letters it exists for (cublasXt<letter><routine>, blasx.<letter><routine>)
ROUTINE_DTYPES = {"gemm": "sdcz", "symm": "sdcz", "hemm": "cz", "syrk": "sdcz", "herk": "cz",
                  "syr2k": "sdcz", "her2k": "cz", "trmm": "sdcz", "trsm": "sdcz"}
#: routine -> argtypes of cublasXt<S|D|C|Z><routine> (alpha/beta are pointers, so one layout per
#: routine: HEMM's is SYMM's, HERK's SYRK's, HER2K's SYR2K's; only the scalars' types differ)
XT_ARGTYPES = {
    "gemm": [P, I, I, S, S, S, P, P, S, P, S, P, P, S],
    "symm": [P, I, I, S, S, P, P, S, P, S, P, P, S],
    "hemm": [P, I, I, S, S, P, P, S, P, S, P, P, S],
    "syrk": [P, I, I, S, S, P, P, S, P, P, S],
    "herk": [P, I, I, S, S, P, P, S, P, P, S],
    "syr2k": [P, I, I, S, S, P, P, S, P, S, P, P, S],
    "her2k": [P, I, I, S, S, P, P, S, P, S, P, P, S],
    "trmm": [P, I, I, I, I, S, S, P, P, S, P, S, P, S],
    "trsm": [P, I, I, I, I, S, S, P, P, S, P, S],
}
#: routine -> the routine whose cuBLAS-XT argument order it shares
XT_LAYOUT = {"hemm": "symm", "herk": "syrk", "her2k": "syr2k"}
ALPHA, BETA = 1.5, 0.5
COMPLEX_ALPHA, COMPLEX_BETA = 1.5 - 0.5j, 0.5 + 0.25j
#: dtype letter -> (alpha, beta) of its routines
SCALARS = {"s": (ALPHA, BETA), "d": (ALPHA, BETA), "c": (COMPLEX_ALPHA, COMPLEX_BETA),
           "z": (COMPLEX_ALPHA, COMPLEX_BETA)}
#: routine -> (alpha is real, beta is real) where BLAS takes real scalars whatever the dtype
REAL_SCALARS = {"herk": (True, True), "her2k": (False, True)}
FLOPS = {"gemm": 2, "symm": 2, "hemm": 2, "syrk": 1, "herk": 1, "syr2k": 2, "her2k": 2,
         "trmm": 1, "trsm": 1}  # real flops x N^3, times the type's flop_factor (complex: 4)
#: every routine, in table order
ALL_ROUTINES = tuple(ROUTINE_DTYPES)
#: the routines of every dtype (the default --routines for s and d)
ROUTINES = tuple(r for r in ALL_ROUTINES if ROUTINE_DTYPES[r] == "sdcz")
#: the complex-only ones (HEMM, HERK, HER2K)
HERMITIAN = tuple(r for r in ALL_ROUTINES if r not in ROUTINES)
#: the routines that update C (out starts as C0); the others (TRMM, TRSM) start from B
C_ROUTINES = ("gemm", "symm", "hemm", "syrk", "herk", "syr2k", "her2k")
#: the routines that write only the upper triangle of C (checked there only)
UPPER_ONLY = ("syrk", "herk", "syr2k", "her2k")
#: routine -> blasx's operands before alpha (the C routines; TRMM/TRSM take (A, B) in place)
BLASX_OPERANDS = {"gemm": ("A", "B"), "symm": ("A", "B"), "hemm": ("A", "B"), "syrk": ("A",), "herk": ("A",),
                  "syr2k": ("A", "B"), "her2k": ("A", "B")}
#: sampled rows per check
CHECK_ROWS = 64
#: column chunk of generation and copies (fixed, so that the random numbers do not depend on threads)
CHUNK_COLS = 256


class ArgError(argparse.ArgumentTypeError, ValueError):
    """A bad option value. argparse shows its message as is; callers outside argparse may catch
    it as a ValueError."""


# --------------------------------------------------------------------------- arguments


def parse_dtypes(text: str, option: str = "--dtypes", allowed=REAL_DTYPES) -> list[str]:
    """'d,s' -> ['d', 's'] (order kept, duplicates dropped), each letter one of `allowed`. The
    default is s and d, the dtypes of bench.efficiency (which takes this parser); bench.level3's
    own --dtypes allows c and z too (:func:`parse_level3_dtypes`)."""
    values = [x.strip().lower() for x in str(text).split(",") if x.strip()]
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise ArgError(f"{option}: got {text!r}; allowed: a comma list of {', '.join(allowed)} "
                       f"({', '.join(f'{d} = {BY_PREFIX[d].dtype.name}' for d in allowed)})")
    return list(dict.fromkeys(values))


def parse_level3_dtypes(text: str) -> list[str]:
    """bench.level3's --dtypes: 'z,c' -> ['z', 'c'], any of s, d, c, z."""
    return parse_dtypes(text, "--dtypes", tuple(PREFIXES))


def parse_positive_list(text: str, option: str) -> list[int]:
    """'8192,16384' -> [8192, 16384]: positive integers, order kept, duplicates dropped."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise ArgError(f"{option}: got {text!r}; allowed: a comma list of positive integers")
    return list(dict.fromkeys(values))


def _only_for(routines) -> str:
    """'hemm, herk: c, z only' for the routines of some dtypes only ('' if none)."""
    groups: dict[str, list[str]] = {}
    for r in routines:
        if ROUTINE_DTYPES[r] != PREFIXES:
            groups.setdefault(ROUTINE_DTYPES[r], []).append(r)
    return "; ".join(f"{', '.join(rs)}: {', '.join(ds)} only" for ds, rs in groups.items())


def parse_routines(text: str) -> list[str]:
    values = [x.strip().lower() for x in str(text).split(",") if x.strip()]
    bad = [v for v in values if v not in FLOPS]
    if not values or bad:
        raise ArgError(f"--routines: got {text!r}; allowed: a comma list of {', '.join(ALL_ROUTINES)} "
                       f"({_only_for(ALL_ROUTINES)})")
    return list(dict.fromkeys(values))


def routines_for(dtype: str, routines) -> list[str]:
    """The routines of `routines` that exist for `dtype` (order kept): 'd' drops hemm, herk, her2k."""
    return [r for r in routines if dtype in ROUTINE_DTYPES[r]]


def resolve_routines(routines, dtypes) -> list[str]:
    """--routines against --dtypes. None (the default) -> every routine of at least one selected
    dtype, in table order (s, d: the six of every dtype; with c or z also hemm, herk, her2k).
    A list keeps its order; a routine of no selected dtype (hemm with --dtypes d,s) is an error."""
    if routines is None:
        return [r for r in ALL_ROUTINES if any(routines_for(d, [r]) for d in dtypes)]
    orphans = [r for r in routines if not any(routines_for(d, [r]) for d in dtypes)]
    if orphans:
        raise ArgError(f"--routines: got {','.join(routines)!r}; {_only_for(orphans)}, and --dtypes is "
                       f"{','.join(dtypes)!r}: add one of those dtypes to --dtypes or drop "
                       f"{', '.join(orphans)} from --routines")
    return list(routines)


def positive_int(option: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = 0
        if v <= 0:
            raise ArgError(f"{option}: got {text!r}; allowed: a positive integer")
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.level3", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=lambda t: parse_positive_list(t, "--n"), default=[8192, 16384],
                   help="comma list of N (default 8192,16384)")
    p.add_argument("--dtypes", type=parse_level3_dtypes, default=["d", "s"],
                   help="comma list of s,d,c,z (float32, float64, complex64, complex128; default d,s)")
    p.add_argument("--gpus", type=positive_int("--gpus"), default=2, help="GPU count (devices 0..count-1)")
    p.add_argument("--runs", type=positive_int("--runs"), default=3, help="timed runs per routine and contender")
    p.add_argument("--xt-block", type=positive_int("--xt-block"), default=8192, help="cuBLAS-XT block dim")
    p.add_argument("--routines", type=parse_routines, default=None,
                   help=f"comma list of {','.join(ALL_ROUTINES)}. Each dtype runs those that exist for it: "
                        f"{','.join(HERMITIAN)} for c and z only (with --dtypes d,z they run for z alone); one "
                        f"that exists for no selected dtype is an error. Default: every routine of a selected "
                        f"dtype ({','.join(ROUTINES)} for s and d; for c and z the Hermitian ones too)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrays and of the run order")
    p.add_argument("--devices", default=None,
                   help="blasx device spec (default cuda:0,..,gpus-1); cuBLAS-XT still needs the GPUs (the CPU "
                        "tests run the loop with sim:2 and cuBLAS-XT replaced by numpy)")
    p.add_argument("--tile", type=positive_int("--tile"), default=None,
                   help="blasx tile size for every routine (default: blasx's choice per call)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tag", default=None, help="name in the result files (default: GPU model and --gpus, 'h200x2')")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.routines = resolve_routines(args.routines, args.dtypes)
    except ArgError as e:
        p.error(str(e))
    return args


# --------------------------------------------------------------------------- arrays


def tolerance(dtype: str, n: int) -> float:
    return base_tolerance(dtype) * max(1.0, math.sqrt(n / 8192))


def _threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def _column_chunks(cols: int, width: int = CHUNK_COLS) -> list[tuple[int, int]]:
    return [(j, min(cols, j + width)) for j in range(0, cols, width)]


def _parallel(fn, items, threads: int | None = None) -> list:
    """fn over items on a thread pool (numpy's random fills and copies drop the GIL)."""
    items = list(items)
    workers = min(threads or _threads(), len(items))
    if workers <= 1:
        return [fn(x) for x in items]
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        return list(ex.map(fn, items))


def random_matrix(rows: int, cols: int, dtype, seed, scale: float = 1.0, threads: int | None = None) -> np.ndarray:
    """F-ordered standard normal matrix (times `scale`) in `dtype`, drawn in float64 by column
    chunks on a thread pool. Chunk j uses the generator seeded with (*seed, j), so the values do
    not depend on the thread count, and a float32 matrix holds the same draws as the float64 one
    of the same seed, rounded: there is never a full-size float64 temporary. A complex matrix
    draws its real parts, then its imaginary parts, from each chunk's generator (both standard
    normal: never zero; complex64 holds complex128's draws rounded)."""
    dtype = np.dtype(dtype)
    seed = [int(x) for x in seed] if isinstance(seed, (list, tuple)) else [int(seed)]
    out = np.empty((rows, cols), dtype=dtype, order="F")

    def fill(chunk):
        index, (j0, j1) = chunk
        rng = np.random.default_rng([*seed, index])
        block = out[:, j0:j1]
        for part in (block.real, block.imag) if np.iscomplexobj(block) else (block,):
            if part.dtype == np.float64 and part.flags.f_contiguous:
                rng.standard_normal(out=part)
                if scale != 1.0:
                    part *= scale
            else:
                tmp = np.empty((rows, j1 - j0), order="F")  # same memory order as the float64 fill
                rng.standard_normal(out=tmp)
                if scale != 1.0:
                    tmp *= scale
                part[...] = tmp

    _parallel(fill, enumerate(_column_chunks(cols)), threads)
    return out


def parallel_copy(dst: np.ndarray, src: np.ndarray, threads: int | None = None) -> None:
    """dst[...] = src by column chunks on a thread pool (a reset of a multi-GiB array)."""
    if dst.shape != src.shape:
        raise ValueError(f"parallel_copy: dst shape {dst.shape} != src shape {src.shape}")
    if dst.ndim != 2:
        np.copyto(dst, src)
        return
    _parallel(lambda c: np.copyto(dst[:, c[0]:c[1]], src[:, c[0]:c[1]]),
              _column_chunks(dst.shape[1], 1024), threads)


def sample_rows(n: int, count: int = CHECK_ROWS, seed: int = 0) -> np.ndarray:
    """Sorted distinct row indices spread over [0, n): the first and last row and random ones
    (so that every block row of tiles is likely to be checked); all rows when n <= count."""
    if n <= count:
        return np.arange(n)
    rng = np.random.default_rng([seed, n])
    inner = rng.choice(np.arange(1, n - 1), size=count - 2, replace=False)
    return np.sort(np.concatenate([[0, n - 1], inner])).astype(np.intp)


def wide(dtype) -> np.dtype:
    """The dtype of the references of `dtype`'s results: its row's `wide` type (float64 or complex128)."""
    return of(dtype).wide


def rows64(x: np.ndarray, rows) -> np.ndarray:
    """x[rows] in float64 (complex128 for a complex x)."""
    return np.asarray(x[rows], dtype=wide(x.dtype))


def _cast64(block: np.ndarray, threads: int | None = None) -> np.ndarray:
    """block in float64 (complex128 if complex): itself if it is so already, else a copy in its own
    memory order, made by slabs on a thread pool (a chunk of a multi-GiB float32 matrix)."""
    target = wide(block.dtype)
    if block.dtype == target:
        return block
    f_order = block.flags.f_contiguous or (not block.flags.c_contiguous and block.strides[0] <= block.strides[1])
    buf = np.empty(block.shape, dtype=target, order="F" if f_order else "C")
    along = 1 if f_order else 0            # slabs along the axis that is outer in memory
    size = block.shape[along]
    step = max(1, -(-size // (2 * _threads())))

    def part(i0):
        sl = (slice(None), slice(i0, i0 + step)) if along else (slice(i0, i0 + step), slice(None))
        np.copyto(buf[sl], block[sl])

    _parallel(part, range(0, size, step), threads)
    return buf


def rows_times(left64: np.ndarray, right: np.ndarray, width: int | None = None) -> np.ndarray:
    """left64 @ right in float64 (complex128 if either is complex), `right` (any dtype, any
    strides, e.g. a transposed view) cast by column chunks of at most 256 MiB so that no full-size
    copy of it is made."""
    n = right.shape[1]
    dtype = np.promote_types(wide(left64.dtype), wide(right.dtype))
    width = width or max(1, (1 << 28) // (dtype.itemsize * max(1, right.shape[0])))
    out = np.empty((left64.shape[0], n), dtype=dtype)
    for j0 in range(0, n, width):
        j1 = min(n, j0 + width)
        np.matmul(left64, _cast64(right[:, j0:j1]), out=out[:, j0:j1])
    return out


def rows_times_h(left64: np.ndarray, right: np.ndarray, width: int | None = None) -> np.ndarray:
    """left64 @ right^H (conjugate transpose) in float64 / complex128, as conj(conj(left64) @ right^T):
    no conjugated copy of `right` is made."""
    return np.conj(rows_times(np.conj(left64), right.T, width))


def _upper_mask(rows, n: int) -> np.ndarray:
    """mask[i, j] = column j is in the upper triangle of row rows[i] (j >= rows[i])."""
    return np.arange(n)[None, :] >= np.asarray(rows)[:, None]


def _real_diagonal(x: np.ndarray, rows) -> np.ndarray:
    """x (the rows `rows` of a square matrix) with the imaginary part of its diagonal entries
    x[i, rows[i]] dropped, in place; x returned."""
    if np.iscomplexobj(x):
        i, r = np.arange(len(rows)), np.asarray(rows)
        x[i, r] = x[i, r].real
    return x


def symmetric_rows(a: np.ndarray, rows, hermitian: bool = False) -> np.ndarray:
    """Rows of the symmetric (`hermitian`: Hermitian) matrix whose upper triangle is a's, in float64
    (complex128), without forming it: below the diagonal a's transposed (conjugated) upper part;
    a Hermitian matrix's diagonal is the real part of a's (BLAS does not read its imaginary part)."""
    mask = _upper_mask(rows, a.shape[1])
    lower = np.asarray(a[:, rows], dtype=wide(a.dtype)).T
    full = np.where(mask, rows64(a, rows), np.conj(lower) if hermitian else lower)
    return _real_diagonal(full, rows) if hermitian else full


def triu_rows(a: np.ndarray, rows) -> np.ndarray:
    """Rows of triu(a) in float64 (complex128)."""
    return np.where(_upper_mask(rows, a.shape[1]), rows64(a, rows), 0.0)


def rel_err(got, ref) -> float:
    got = np.asarray(got)
    got = np.asarray(got, dtype=wide(got.dtype))
    den = float(np.linalg.norm(ref))
    num = float(np.linalg.norm(got - ref))
    return num / den if den > 0 else num


def reference(routine, A, B, C0, alpha, beta, rows) -> np.ndarray:
    """What `check` compares with, on the sampled rows, in float64 (complex128 for complex
    arrays): the routine's result (C routines, TRMM), or alpha B[rows] (TRSM, checked by its
    residual). HEMM reads A's upper triangle as a Hermitian matrix (the diagonal's imaginary part
    ignored); HERK / HER2K give a real diagonal (BLAS sets its imaginary part to 0). It depends
    on the inputs only, so a case computes it once for all its runs and contenders."""
    r = np.asarray(rows)
    if routine == "gemm":
        return alpha * rows_times(rows64(A, r), B) + beta * rows64(C0, r)
    if routine in ("symm", "hemm"):
        return alpha * rows_times(symmetric_rows(A, r, routine == "hemm"), B) + beta * rows64(C0, r)
    if routine == "syrk":
        return alpha * rows_times(rows64(A, r), A.T) + beta * rows64(C0, r)
    if routine == "herk":
        return _real_diagonal(alpha * rows_times_h(rows64(A, r), A) + beta * rows64(C0, r), r)
    if routine == "syr2k":
        return alpha * (rows_times(rows64(A, r), B.T) + rows_times(rows64(B, r), A.T)) + beta * rows64(C0, r)
    if routine == "her2k":
        return _real_diagonal(alpha * rows_times_h(rows64(A, r), B) + np.conj(alpha) * rows_times_h(rows64(B, r), A)
                              + beta * rows64(C0, r), r)
    if routine == "trmm":
        return alpha * rows_times(triu_rows(A, r), B)
    if routine == "trsm":
        return alpha * rows64(B, r)
    raise ValueError(f"routine: got {routine!r}; allowed: {', '.join(ALL_ROUTINES)}")


def compare(routine, A, out, rows, ref) -> float:
    """Relative error (float64) of the result `out` on `rows` against reference(...); NaN if the
    rows hold NaN. SYRK/HERK/SYR2K/HER2K: upper triangle only. TRSM: the residual triu(A) X - alpha B."""
    r = np.asarray(rows)
    if routine in UPPER_ONLY:
        mask = _upper_mask(r, A.shape[0])  # only the upper triangle is defined
        return rel_err(rows64(out, r)[mask], ref[mask])
    if routine == "trsm":
        return rel_err(rows_times(triu_rows(A, r), out), ref)
    return rel_err(rows64(out, r), ref)


def check(routine, A, B, C0, out, alpha, beta, rows) -> float:
    """Relative error (float64) of routine's result `out` on the sampled `rows`; NaN if the
    result holds NaN. A, B, C0 are the inputs (C0: C before the call, B: b before TRMM/TRSM)."""
    return compare(routine, A, out, rows, reference(routine, A, B, C0, alpha, beta, rows))


def make_arrays(n: int, dtype: str, seed: int = 0):
    """A (scaled, diagonal + 4: well conditioned for TRSM), B, C0 (pristine C) and out, F-ordered
    (complex types: standard normal real and imaginary parts, the diagonal's real part + 4)."""
    dt_ = BY_PREFIX[dtype].dtype
    A = random_matrix(n, n, dt_, [seed, n, 0], scale=1.0 / math.sqrt(n))
    A[np.diag_indices(n)] += 4.0
    B = random_matrix(n, n, dt_, [seed, n, 1])
    C0 = random_matrix(n, n, dt_, [seed, n, 2])
    out = np.empty((n, n), dtype=dt_, order="F")
    return A, B, C0, out


# --------------------------------------------------------------------------- the two contenders


def xt_symbol(dtype: str, routine: str) -> str:
    """'s', 'gemm' -> 'cublasXtSgemm'; 'z', 'her2k' -> 'cublasXtZher2k' (HEMM, HERK, HER2K: c and z only)."""
    if dtype not in BY_PREFIX:
        raise ValueError(f"dtype: got {dtype!r}; allowed: {', '.join(PREFIXES)}")
    if routine not in XT_ARGTYPES:
        raise ValueError(f"routine: got {routine!r}; allowed: {', '.join(XT_ARGTYPES)}")
    if dtype not in ROUTINE_DTYPES[routine]:
        raise ValueError(f"routine: got {routine!r} for dtype {dtype!r}; {routine} exists for dtypes "
                         f"{', '.join(ROUTINE_DTYPES[routine])} only")
    return f"cublasXt{dtype.upper()}{routine}"


def scalars(dtype: str, routine: str) -> tuple:
    """(alpha, beta) of `routine` in `dtype`: SCALARS[dtype], with the real part only where BLAS
    takes a real scalar (HERK's alpha and beta, HER2K's beta)."""
    alpha, beta = SCALARS[dtype]
    real_alpha, real_beta = REAL_SCALARS.get(routine, (False, False))
    return (alpha.real if real_alpha else alpha), (beta.real if real_beta else beta)


def xt_scalar_types(dtype: str, routine: str = "gemm") -> tuple:
    """The ctypes types of the scalars that cublasXt<dtype><routine> reads through its alpha and
    beta pointers: the dtype's own (float, double, cuComplex, cuDoubleComplex), or its real type
    where BLAS takes a real scalar (HERK: both; HER2K: beta)."""
    real_alpha, real_beta = REAL_SCALARS.get(routine, (False, False))
    t = BY_PREFIX[dtype]
    return scalar_ctype(t, real_alpha), scalar_ctype(t, real_beta)


def _xt_value(ctype, value, what: str, dtype: str, routine: str):
    """value as a `ctype` host scalar: a complex struct gets (real, imaginary); a real type refuses
    a value with an imaginary part."""
    z = complex(value)
    if issubclass(ctype, C.Structure):
        return ctype(z.real, z.imag)
    if z.imag != 0:
        raise ValueError(f"{what}: got {value!r}; allowed: a real value for {dtype}{routine} "
                         f"(cuBLAS-XT reads a {ctype.__name__} there)")
    return ctype(z.real)


def xt_scalars(dtype: str, alpha, beta, routine: str = "gemm"):
    """alpha and beta as host scalars of the routine's precision and kind (cuBLAS-XT reads them
    through pointers: a double where a float is expected, or a real where a complex is, would be
    read as garbage)."""
    ta, tb = xt_scalar_types(dtype, routine)
    return _xt_value(ta, alpha, "alpha", dtype, routine), _xt_value(tb, beta, "beta", dtype, routine)


def xt_args(routine: str, n: int, ra: int, pa: int, pb: int, rb: int, pc: int) -> tuple:
    """The cuBLAS-XT arguments after the handle (ra, rb: addresses of alpha, beta)."""
    layout = XT_LAYOUT.get(routine, routine)  # hemm as symm, herk as syrk, her2k as syr2k
    if layout == "gemm":
        return NOTRANS, NOTRANS, n, n, n, ra, pa, n, pb, n, rb, pc, n
    if layout == "symm":
        return LEFT, UPPER_XT, n, n, ra, pa, n, pb, n, rb, pc, n
    if layout == "syrk":
        return UPPER_XT, NOTRANS, n, n, ra, pa, n, rb, pc, n
    if layout == "syr2k":
        return UPPER_XT, NOTRANS, n, n, ra, pa, n, pb, n, rb, pc, n
    if layout == "trmm":  # out-of-place: C = alpha A B
        return LEFT, UPPER_XT, NOTRANS, NONUNIT, n, n, ra, pa, n, pb, n, pc, n
    if layout == "trsm":  # in place on out (= B)
        return LEFT, UPPER_XT, NOTRANS, NONUNIT, n, n, ra, pa, n, pc, n
    raise ValueError(f"routine: got {routine!r}; allowed: {', '.join(ALL_ROUTINES)}")


def _xt_call(xt, name, routine, *args):
    fn = getattr(xt._lib, name)
    fn.argtypes, fn.restype = XT_ARGTYPES[routine], C.c_int
    _check(fn(xt._handle, *args), name)


def run_xt(xt, dtype, routine, n, A, B, C0, out, alpha, beta):
    al, be = xt_scalars(dtype, alpha, beta, routine)  # kept alive in this frame during the call
    args = xt_args(routine, n, C.addressof(al), A.ctypes.data, B.ctypes.data, C.addressof(be), out.ctypes.data)
    _xt_call(xt, xt_symbol(dtype, routine), routine, *args)


def blasx_routine(blasx, dtype: str, routine: str):
    """blasx.<dtype><routine> (scipy names: dsyrk, zherk, ...); GEMM falls back to the generic
    blasx.gemm, which keeps the operands' dtype, where the package has no prefixed gemm."""
    fn = getattr(blasx, dtype + routine, None)
    if fn is None and routine == "gemm":
        fn = blasx.gemm
    if fn is None:
        raise AttributeError(f"blasx has no {dtype + routine}")
    return fn


def run_blasx(blasx, dtype, routine, n, A, B, C0, out, alpha, beta):
    """One blasx call, scipy's signature: the C routines update `out` in place (HERK / HER2K with
    trans 0, their real scalars as given), TRMM / TRSM overwrite `out` (= B)."""
    fn = blasx_routine(blasx, dtype, routine)
    if routine in BLASX_OPERANDS:
        operands = {"A": A, "B": B}
        fn(alpha, *(operands[x] for x in BLASX_OPERANDS[routine]), beta=beta, c=out, overwrite_c=True)
    else:
        fn(alpha, A, out, overwrite_b=True)


# --------------------------------------------------------------------------- tables


def summarize(results: list[dict]) -> dict:
    """(n, dtype, routine, who) -> its fastest run (or its failure, when no run finished), with
    all_ok over every run of that key and the first failure message, if any."""
    groups: dict = {}
    for r in results:
        groups.setdefault((r["n"], r["dtype"], r["routine"], r["who"]), []).append(r)
    table = {}
    for key, recs in groups.items():
        timed = [r for r in recs if r.get("seconds") is not None]
        best = dict(min(timed, key=lambda r: r["seconds"]) if timed else recs[0])
        best["all_ok"] = all(r["ok"] for r in recs)
        best["failure"] = next((r["failure"] for r in recs if r.get("failure")), None)
        table[key] = best
    return table


def _tf(e) -> str:
    return f"{e['tflops']:.1f}" if e and e.get("tflops") else "-"


def format_table(results: list[dict], routines, dtypes) -> str:
    """Markdown table: one row per (N, dtype, routine), best run of each contender."""
    table = summarize(results)
    lines = ["| N | dtype | routine | blasx TFLOPS | cuBLAS-XT TFLOPS | blasx / XT | blasx / blasx GEMM | checked |",
             "| --: | :-- | :-- | --: | --: | --: | --: | :-- |"]
    for n in sorted({k[0] for k in table}):
        for d in dtypes:
            g = table.get((n, d, "gemm", "blasx"))
            for rt in routines:
                b, x = table.get((n, d, rt, "blasx")), table.get((n, d, rt, "cublasxt"))
                if not b and not x:
                    continue
                here = [e for e in (b, x) if e]
                if any(e["failure"] for e in here):
                    status = "FAILED (" + ", ".join(w for w, e in (("blasx", b), ("cuBLAS-XT", x))
                                                    if e and e["failure"]) + ")"
                else:
                    status = "ok" if all(e["all_ok"] for e in here) else "WRONG"
                ratio = f"{b['tflops'] / x['tflops']:.2f}x" if b and x and b.get("tflops") and x.get("tflops") else "-"
                share = f"{b['tflops'] / g['tflops']:.2f}" if b and g and b.get("tflops") and g.get("tflops") else "-"
                lines.append(f"| {n} | {d} | {d}{rt} | {_tf(b)} | {_tf(x)} | {ratio} | {share} | {status} |")
    return "\n".join(lines)


def device_times(profile) -> list[dict] | None:
    """Where a blasx call's time went on each device (fractions of the call's wall time): busy computing,
    copying with nothing computing, idle before its first operation (lead), after its last (tail) and in
    between; tasks it ran. None without a profile."""
    if profile is None or profile.wall <= 0:
        return None
    w = profile.wall
    return [{"name": b.name, "tasks": b.tasks, "busy": b.busy / w, "comm": b.comm / w, "lead": b.lead / w,
             "tail": b.tail / w, "gaps": max(b.idle - b.lead - b.tail, 0.0) / w}
            for b in profile.breakdown()]


def format_breakdown(results: list[dict], routines, dtypes) -> str:
    """Markdown table of the best blasx run of each (N, dtype, routine): per device, percent of the call busy /
    copying alone / idle at the start, in gaps, at the end, and its tasks."""
    table = summarize(results)
    lines = ["| N | routine | device | busy | copy only | idle: start | gaps | end | tasks |",
             "| --: | :-- | :-- | --: | --: | --: | --: | --: | --: |"]
    for n in sorted({k[0] for k in table}):
        for d in dtypes:
            for rt in routines:
                b = table.get((n, d, rt, "blasx"))
                for dev in (b or {}).get("devices") or []:
                    lines.append(f"| {n} | {d}{rt} | {dev['name']} | " + " | ".join(
                        f"{100 * dev[k]:.0f}%" for k in ("busy", "comm", "lead", "gaps", "tail")) + f" | {dev['tasks']} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def format_failures(results: list[dict]) -> list[str]:
    return [f"{r['who']} {r['dtype']}{r['routine']} N={r['n']}: {r['failure']}" for r in results if r.get("failure")]


def dtype_words(dtypes) -> str:
    return ", ".join(f"{DTYPE_NAMES[d]} ({d})" for d in dtypes)


def _scalar_text(v) -> str:
    return f"{v:g}"


def scalar_words(dtypes) -> str:
    """'alpha 1.5, beta 0.5' for s and d; with c or z: each group of dtypes with its scalars, and
    the Hermitian routines' real ones ('herk: alpha 1.5, beta 0.5; her2k: beta 0.5')."""
    groups: dict = {}
    for d in dtypes:
        groups.setdefault(SCALARS[d], []).append(d)
    parts = []
    for (alpha, beta), ds in groups.items():
        text = f"alpha {_scalar_text(alpha)}, beta {_scalar_text(beta)}"
        real = [f"{r}: " + ", ".join(f"{w} {_scalar_text(v)}" for w, v, flag in
                                     zip(("alpha", "beta"), scalars(ds[0], r), REAL_SCALARS[r]) if flag)
                for r in REAL_SCALARS if any(d in ROUTINE_DTYPES[r] for d in ds)]
        notes = ([", ".join(ds)] if len(groups) > 1 else []) + real
        parts.append(text + (f" ({'; '.join(notes)})" if notes else ""))
    return "; ".join(parts)


def scalar_table(dtypes, routines) -> dict:
    """{dtype: {routine: [alpha, beta]}} of the routines run, for the JSON (a complex value as
    [real, imaginary])."""
    def js(v):
        return [v.real, v.imag] if isinstance(v, complex) else v
    return {d: {r: [js(v) for v in scalars(d, r)] for r in routines_for(d, routines)} for d in dtypes}


def format_markdown(report: dict) -> str:
    dtypes = report["dtypes"]
    tol = ", ".join(f"{base_tolerance(d):g} ({d})" for d in dtypes)
    ref = "float64" + (" / complex128" if any(BY_PREFIX[d].is_complex for d in dtypes) else "")
    return (f"# Level-3 routines: blasx vs cuBLAS-XT ({report['tag']}, {report['date']} UTC), "
            f"dtypes: {dtype_words(dtypes)}\n\n"
            f"```\n{report['command']}\n```\n\n"
            f"Machine: {report.get('machine', '?')}\n\n"
            f"Best of {report['runs']} shuffled runs after one warm-up each; {dtype_words(dtypes)} "
            f"precision, registered host arrays, upper / no transpose / left / non-unit, "
            f"{scalar_words(dtypes)}, blasx tile "
            f"{report.get('tile') or 'chosen per call'}. Checked on {CHECK_ROWS} sampled rows "
            f"against {ref} numpy; tolerance on the relative error {tol} x max(1, sqrt(N/8192)). "
            f"TFLOPS count real flops (complex: 4x the real routine's).\n\n"
            f"{report['table']}\n"
            + (f"\n## Where blasx's time went (best run, per device)\n\n{report['breakdown']}\n"
               if report.get("breakdown") else "")
            + ("\n## Failures\n\n" + "".join(f"- {x}\n" for x in report["failures"]) if report.get("failures") else ""))


def gpu_names() -> list[str]:
    """The GPUs' names from `nvidia-smi -L` (['NVIDIA H200', ...]); [] where there is none."""
    names: list[str] = []
    try:
        res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        if res.returncode == 0:
            for line in res.stdout.splitlines():
                if line.startswith("GPU "):
                    names.append(line.split(":", 1)[1].split("(UUID")[0].strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return names


def gpu_tag(count: int, names: list[str] | None = None) -> str:
    """The default result-file tag: 'h200x2' for 2 GPUs named 'NVIDIA H200', 'gpux2' if unnamed."""
    names = gpu_names() if names is None else names
    found = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", names[0]) if names else None  # H200, A100, L40S
    model = found.group(1).lower() if found else "gpu"
    return f"{model}x{count}"


def machine_name() -> str:
    """'2x NVIDIA H200' from `nvidia-smi -L`, else from CuPy, else the host name and 'no GPU'."""
    names = gpu_names()
    if not names and "cupy" in sys.modules:  # only if CuPy is already in use: never start CUDA here
        try:
            rt = sys.modules["cupy"].cuda.runtime
            for i in range(rt.getDeviceCount()):
                name = rt.getDeviceProperties(i).get("name", b"?")
                names.append(name.decode() if isinstance(name, bytes) else str(name))
        except Exception:  # noqa: BLE001 - no driver / no GPU: fall through
            names = []
    host = socket.gethostname()
    if not names:
        return f"{host} (no GPU found)"
    groups: dict[str, int] = {}
    for nm in names:
        groups[nm] = groups.get(nm, 0) + 1
    return f"{host}: " + ", ".join(f"{k}x {nm}" for nm, k in groups.items())


def utc_stamp() -> tuple[str, str]:
    now = dt.datetime.now(dt.timezone.utc)
    return now.strftime("%Y%m%d-%H%M%S"), now.strftime("%Y-%m-%d %H:%M:%S")


def command_line(module: str, argv) -> str:
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else list(argv))])


def write_json_md(base: str, data: dict, markdown: str) -> tuple[str, str]:
    """base.json (strict JSON: NaN and inf become null) and base.md."""
    os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
    with open(base + ".json", "w") as f:
        json.dump(jsonable(data), f, indent=1, allow_nan=False)
    with open(base + ".md", "w") as f:
        f.write(markdown)
    return base + ".json", base + ".md"


def jsonable(x):
    """A JSON-safe copy: numpy scalars and arrays to Python, NaN / inf to None, keys to str."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


def finite(x):
    """NaN / inf -> None (strict JSON)."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


# --------------------------------------------------------------------------- main


def run_case(blasx, xt, args, n: int, dtype: str, A, B, C0, out, results: list) -> None:
    """The warm-ups, then the shuffled timed runs, of every routine and contender on one
    (N, dtype). A call that raises is recorded as a failure and its (contender, routine) is not
    run again in this case."""
    rows = sample_rows(n, CHECK_ROWS, args.seed)
    routines = routines_for(dtype, args.routines)  # d: no hemm, herk, her2k
    order = [(who, rt, k) for rt in routines for who in ("blasx", "cublasxt") for k in range(args.runs + 1)]
    random.Random(f"{args.seed}:{n}:{dtype}").shuffle(order)
    order.sort(key=lambda x: x[2] > 0)  # warm-ups first, then the shuffled timed runs
    failed: set = set()
    refs: dict = {}  # routine -> its reference rows, computed at its first check
    for who, rt, k in order:
        if (who, rt) in failed:
            continue
        alpha, beta = scalars(dtype, rt)
        parallel_copy(out, C0 if rt in C_ROUTINES else B)  # untimed reset
        t = time.perf_counter()
        try:
            if who == "blasx":
                run_blasx(blasx, dtype, rt, n, A, B, C0, out, alpha, beta)
            else:
                run_xt(xt, dtype, rt, n, A, B, C0, out, alpha, beta)
        except Exception as e:  # noqa: BLE001 - recorded; the other routines go on
            failed.add((who, rt))
            msg = f"{type(e).__name__}: {e}"
            print(f"   {who:<8} {dtype}{rt:<6} {'warm-up' if k == 0 else f'run {k}'}: FAILED {msg}", flush=True)
            results.append({"who": who, "routine": rt, "dtype": dtype, "n": n, "run": k, "seconds": None,
                            "rel_err": None, "tflops": None, "ok": False, "failure": msg})
            continue
        t = time.perf_counter() - t
        if k == 0:
            continue  # warm-up
        if rt not in refs:
            refs[rt] = reference(rt, A, B, C0, alpha, beta, rows)
        err = compare(rt, A, out, rows, refs[rt])
        ok = bool(err <= tolerance(dtype, n))
        tf = FLOPS[rt] * BY_PREFIX[dtype].flop_factor * n**3 / t / 1e12
        print(f"   {who:<8} {dtype}{rt:<6} run {k}: {t:.4f} s {tf:7.2f} TFLOPS err {err:.1e} "
              f"{'ok' if ok else 'WRONG'}", flush=True)
        results.append({"who": who, "routine": rt, "dtype": dtype, "n": n, "run": k, "seconds": t,
                        "rel_err": finite(err), "tflops": tf, "ok": ok,
                        **({"devices": device_times(blasx.last_profile())} if who == "blasx" else {})})


def main(argv=None):
    args = parse_args(argv)
    import blasx
    gpus = list(range(args.gpus))
    devices = args.devices or "cuda:" + ",".join(map(str, gpus))
    results: list[dict] = []
    registration = []
    problems: list[str] = []
    try:
        for n in args.n:
            for dtype in args.dtypes:
                t0 = time.perf_counter()
                A, B, C0, out = make_arrays(n, dtype, args.seed)
                print(f"== N={n} {DTYPE_NAMES[dtype]}: arrays {4 * A.nbytes / 2**30:.1f} GiB made in "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
                try:
                    blasx.configure(devices=devices, tile=args.tile)
                    with registered(A, B, C0, out) as reg, CublasXt(gpus, block_dim=args.xt_block) as xt:
                        print(f"   registered {reg.nbytes / 2**30:.1f} GiB in {reg.seconds:.1f} s", flush=True)
                        run_case(blasx, xt, args, n, dtype, A, B, C0, out, results)
                    registration.append({"n": n, "dtype": dtype, "gib": reg.nbytes / 2**30, "seconds": reg.seconds,
                                         "unregister_seconds": reg.unregister_seconds})
                finally:
                    blasx.shutdown()
                    del A, B, C0, out
                    gc.collect()
    except KeyboardInterrupt:
        problems.append("interrupted: the table holds what was measured")
    except Exception as e:
        problems.append(f"{type(e).__name__}: {e}")
        raise
    finally:
        text = format_table(results, args.routines, args.dtypes)
        print(text)
        stamp, date = utc_stamp()
        args.tag = args.tag or gpu_tag(args.gpus)
        report = {"tag": args.tag, "date": date, "stamp": stamp, "command": command_line("bench.level3", argv),
                  "machine": machine_name(), "dtypes": args.dtypes, "runs": args.runs, "alpha": ALPHA, "beta": BETA,
                  "tile": args.tile,
                  "table": text, "breakdown": format_breakdown(results, args.routines, args.dtypes),
                  "failures": problems + format_failures(results)}
        base = os.path.join(args.out, f"level3-{args.tag}-{stamp}")
        data = {**{k: v for k, v in report.items() if k not in ("table", "breakdown")},
                "argv": sys.argv[1:] if argv is None else list(argv), "routines": args.routines, "n": args.n,
                "xt_block": args.xt_block, "gpus": args.gpus, "devices": devices,
                "scalars": scalar_table(args.dtypes, args.routines),
                "flop_factor": {d: BY_PREFIX[d].flop_factor for d in args.dtypes},
                "tolerance": {d: base_tolerance(d) for d in args.dtypes}, "registration": registration,
                "results": results}
        paths = write_json_md(base, data, format_markdown(report))
        print("wrote", paths[0], "and", paths[1])
    return 0 if results and all(r["ok"] for r in results) and not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
