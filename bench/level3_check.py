"""The level-3 benchmarks' arrays and checks: random F-ordered matrices made on a thread pool, sampled rows,
their float64 (complex128) reference and a result's relative error on them, and the tolerance."""

from __future__ import annotations

import concurrent.futures
import math
import os

import numpy as np

from blasx.runtime.dtypes import BY_PREFIX, of

from .level3_routines import ALL_ROUTINES, UPPER_ONLY

#: sampled rows per check
CHECK_ROWS = 64
#: column chunk of generation and copies (fixed, so that the random numbers do not depend on threads)
CHUNK_COLS = 256


def base_tolerance(dtype: str) -> float:
    """Relative-error tolerance of the checks at N <= 8192: 1e-4 in single, 1e-9 in double precision."""
    return 1e-4 if BY_PREFIX[dtype].real.itemsize == 4 else 1e-9


def tolerance(dtype: str, n: int) -> float:
    return base_tolerance(dtype) * max(1.0, math.sqrt(n / 8192))


# --------------------------------------------------------------------------- arrays


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


# --------------------------------------------------------------------------- sampled rows and checks


def sample_rows(n: int, count: int = CHECK_ROWS, seed: int = 0) -> np.ndarray:
    """Sorted distinct row indices spread over [0, n): the first and last row and random ones
    (so that every block row of tiles is likely to be checked); all rows when n <= count."""
    if n <= count or count < 2:  # (fewer than two: the first rows)
        return np.arange(min(n, max(count, 0)))
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
