"""Level-3 routines beside GEMM: blasx against cuBLAS-XT, in one process, on the same arrays.

    python -m bench.level3 --n 8192,16384 --dtypes d,s --gpus 2 --runs 3 --xt-block 8192 --out bench/results

Single (s) and double (d) precision, F-ordered host arrays page-locked before timing (the
"registered" case), alpha 1.5 / beta 0.5, upper triangle, no transpose, left side, non-unit
diagonal. Every result is checked on a sample of rows spread over the matrix against a float64
reference computed by numpy (for TRSM: the residual op(A) X - alpha B on those rows); the
tolerance on the relative error is 1e-9 (d) or 1e-4 (s), times sqrt(N / 8192) above N = 8192.
Rates use each routine's flop count (GEMM 2N^3, SYMM 2N^3, SYRK N^3, SYR2K 2N^3, TRMM N^3,
TRSM N^3), so a routine at GEMM's rate means GEMM-like efficiency.

The arrays of one (N, dtype) exist only while that case runs; float32 arrays are made from
float64 random numbers cast chunk by chunk (never a full float64 copy). The pure pieces (argument
parsing, array generation, the checks, the tables) are also used by ``bench.efficiency`` and
``bench.cpu_worker``; CuPy and cuBLAS-XT are only touched inside :func:`main`'s run loop.
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

from .cublasxt import CublasXt, _check, registered

UPPER_XT, LEFT, NOTRANS, NONUNIT = 1, 0, 0, 0  # cuBLAS enums: FILL_MODE_UPPER = 1
S, P, I = C.c_size_t, C.c_void_p, C.c_int

#: dtype letter -> numpy dtype
DTYPES = {"s": np.dtype(np.float32), "d": np.dtype(np.float64)}
DTYPE_NAMES = {"s": "single", "d": "double"}
#: relative-error tolerance of the checks at N <= 8192 (grows as sqrt(N / 8192) above)
BASE_TOLERANCE = {"s": 1e-4, "d": 1e-9}
#: dtype letter -> ctypes type of the host scalars alpha and beta that cuBLAS-XT reads through pointers
XT_SCALAR = {"s": C.c_float, "d": C.c_double}
#: routine -> argtypes of cublasXt<S|D><routine> (the S and D layouts are the same; alpha/beta are pointers)
XT_ARGTYPES = {
    "gemm": [P, I, I, S, S, S, P, P, S, P, S, P, P, S],
    "symm": [P, I, I, S, S, P, P, S, P, S, P, P, S],
    "syrk": [P, I, I, S, S, P, P, S, P, P, S],
    "syr2k": [P, I, I, S, S, P, P, S, P, S, P, P, S],
    "trmm": [P, I, I, I, I, S, S, P, P, S, P, S, P, S],
    "trsm": [P, I, I, I, I, S, S, P, P, S, P, S],
}
ALPHA, BETA = 1.5, 0.5
FLOPS = {"gemm": 2, "symm": 2, "syrk": 1, "syr2k": 2, "trmm": 1, "trsm": 1}  # x N^3
ROUTINES = tuple(FLOPS)
#: sampled rows per check
CHECK_ROWS = 64
#: column chunk of generation and copies (fixed, so that the random numbers do not depend on threads)
CHUNK_COLS = 256


class ArgError(argparse.ArgumentTypeError, ValueError):
    """A bad option value. argparse shows its message as is; callers outside argparse may catch
    it as a ValueError."""


# --------------------------------------------------------------------------- arguments


def parse_dtypes(text: str, option: str = "--dtypes") -> list[str]:
    """'d,s' -> ['d', 's'] (order kept, duplicates dropped)."""
    values = [x.strip().lower() for x in str(text).split(",") if x.strip()]
    bad = [v for v in values if v not in DTYPES]
    if not values or bad:
        raise ArgError(f"{option}: got {text!r}; allowed: a comma list of {', '.join(DTYPES)} "
                       f"(s = float32, d = float64)")
    return list(dict.fromkeys(values))


def parse_positive_list(text: str, option: str) -> list[int]:
    """'8192,16384' -> [8192, 16384]: positive integers, order kept, duplicates dropped."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise ArgError(f"{option}: got {text!r}; allowed: a comma list of positive integers")
    return list(dict.fromkeys(values))


def parse_routines(text: str) -> list[str]:
    values = [x.strip().lower() for x in str(text).split(",") if x.strip()]
    bad = [v for v in values if v not in FLOPS]
    if not values or bad:
        raise ArgError(f"--routines: got {text!r}; allowed: a comma list of {', '.join(ROUTINES)}")
    return list(dict.fromkeys(values))


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
    p.add_argument("--dtypes", type=parse_dtypes, default=["d", "s"],
                   help="comma list of s,d (default d,s)")
    p.add_argument("--gpus", type=positive_int("--gpus"), default=2, help="GPU count (devices 0..count-1)")
    p.add_argument("--runs", type=positive_int("--runs"), default=3, help="timed runs per routine and contender")
    p.add_argument("--xt-block", type=positive_int("--xt-block"), default=8192, help="cuBLAS-XT block dim")
    p.add_argument("--routines", type=parse_routines, default=list(ROUTINES),
                   help=f"comma list of {','.join(ROUTINES)} (default all)")
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
    return build_parser().parse_args(argv)


# --------------------------------------------------------------------------- arrays


def tolerance(dtype: str, n: int) -> float:
    return BASE_TOLERANCE[dtype] * max(1.0, math.sqrt(n / 8192))


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
    of the same seed, rounded: there is never a full-size float64 temporary."""
    dtype = np.dtype(dtype)
    seed = [int(x) for x in seed] if isinstance(seed, (list, tuple)) else [int(seed)]
    out = np.empty((rows, cols), dtype=dtype, order="F")

    def fill(chunk):
        index, (j0, j1) = chunk
        rng = np.random.default_rng([*seed, index])
        block = out[:, j0:j1]
        if dtype == np.float64:
            rng.standard_normal(out=block)
            if scale != 1.0:
                block *= scale
        else:
            tmp = np.empty((rows, j1 - j0), order="F")  # same memory order as the float64 fill
            rng.standard_normal(out=tmp)
            if scale != 1.0:
                tmp *= scale
            block[...] = tmp

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


def rows64(x: np.ndarray, rows) -> np.ndarray:
    """x[rows] in float64."""
    return np.asarray(x[rows], dtype=np.float64)


def _cast64(block: np.ndarray, threads: int | None = None) -> np.ndarray:
    """block in float64: itself if it is float64, else a copy in its own memory order, made by
    slabs on a thread pool (a chunk of a multi-GiB float32 matrix)."""
    if block.dtype == np.float64:
        return block
    f_order = block.flags.f_contiguous or (not block.flags.c_contiguous and block.strides[0] <= block.strides[1])
    buf = np.empty(block.shape, dtype=np.float64, order="F" if f_order else "C")
    along = 1 if f_order else 0            # slabs along the axis that is outer in memory
    size = block.shape[along]
    step = max(1, -(-size // (2 * _threads())))

    def part(i0):
        sl = (slice(None), slice(i0, i0 + step)) if along else (slice(i0, i0 + step), slice(None))
        np.copyto(buf[sl], block[sl])

    _parallel(part, range(0, size, step), threads)
    return buf


def rows_times(left64: np.ndarray, right: np.ndarray, width: int | None = None) -> np.ndarray:
    """left64 @ right in float64, `right` (any dtype, any strides, e.g. a transposed view) cast by
    column chunks so that no full-size float64 copy of it is made."""
    n = right.shape[1]
    width = width or max(1, (1 << 25) // max(1, right.shape[0]))
    out = np.empty((left64.shape[0], n), dtype=np.float64)
    for j0 in range(0, n, width):
        j1 = min(n, j0 + width)
        np.matmul(left64, _cast64(right[:, j0:j1]), out=out[:, j0:j1])
    return out


def _upper_mask(rows, n: int) -> np.ndarray:
    """mask[i, j] = column j is in the upper triangle of row rows[i] (j >= rows[i])."""
    return np.arange(n)[None, :] >= np.asarray(rows)[:, None]


def symmetric_rows(a: np.ndarray, rows) -> np.ndarray:
    """Rows of the symmetric matrix whose upper triangle is a's, in float64, without forming it."""
    mask = _upper_mask(rows, a.shape[1])
    return np.where(mask, rows64(a, rows), np.asarray(a[:, rows], dtype=np.float64).T)


def triu_rows(a: np.ndarray, rows) -> np.ndarray:
    """Rows of triu(a) in float64."""
    return np.where(_upper_mask(rows, a.shape[1]), rows64(a, rows), 0.0)


def rel_err(got, ref) -> float:
    got = np.asarray(got, dtype=np.float64)
    den = float(np.linalg.norm(ref))
    num = float(np.linalg.norm(got - ref))
    return num / den if den > 0 else num


def reference(routine, A, B, C0, alpha, beta, rows) -> np.ndarray:
    """What `check` compares with, on the sampled rows, in float64: the routine's result (C
    routines, TRMM), or alpha B[rows] (TRSM, checked by its residual). It depends on the inputs
    only, so a case computes it once for all its runs and contenders."""
    r = np.asarray(rows)
    if routine == "gemm":
        return alpha * rows_times(rows64(A, r), B) + beta * rows64(C0, r)
    if routine == "symm":
        return alpha * rows_times(symmetric_rows(A, r), B) + beta * rows64(C0, r)
    if routine == "syrk":
        return alpha * rows_times(rows64(A, r), A.T) + beta * rows64(C0, r)
    if routine == "syr2k":
        return alpha * (rows_times(rows64(A, r), B.T) + rows_times(rows64(B, r), A.T)) + beta * rows64(C0, r)
    if routine == "trmm":
        return alpha * rows_times(triu_rows(A, r), B)
    if routine == "trsm":
        return alpha * rows64(B, r)
    raise ValueError(f"routine: got {routine!r}; allowed: {', '.join(ROUTINES)}")


def compare(routine, A, out, rows, ref) -> float:
    """Relative error (float64) of the result `out` on `rows` against reference(...); NaN if the
    rows hold NaN. SYRK/SYR2K: upper triangle only. TRSM: the residual triu(A) X - alpha B."""
    r = np.asarray(rows)
    if routine in ("syrk", "syr2k"):
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
    """A (scaled, diagonal + 4: well conditioned for TRSM), B, C0 (pristine C) and out, F-ordered."""
    dt_ = DTYPES[dtype]
    A = random_matrix(n, n, dt_, [seed, n, 0], scale=1.0 / math.sqrt(n))
    A[np.diag_indices(n)] += 4.0
    B = random_matrix(n, n, dt_, [seed, n, 1])
    C0 = random_matrix(n, n, dt_, [seed, n, 2])
    out = np.empty((n, n), dtype=dt_, order="F")
    return A, B, C0, out


# --------------------------------------------------------------------------- the two contenders


def xt_symbol(dtype: str, routine: str) -> str:
    """'s', 'gemm' -> 'cublasXtSgemm'."""
    if dtype not in XT_SCALAR:
        raise ValueError(f"dtype: got {dtype!r}; allowed: {', '.join(XT_SCALAR)}")
    if routine not in XT_ARGTYPES:
        raise ValueError(f"routine: got {routine!r}; allowed: {', '.join(XT_ARGTYPES)}")
    return f"cublasXt{dtype.upper()}{routine}"


def xt_scalars(dtype: str, alpha: float, beta: float):
    """alpha and beta as host scalars of the routine's precision (cuBLAS-XT reads them through
    pointers: a double where a float is expected would be read as garbage)."""
    ctype = XT_SCALAR[dtype]
    return ctype(alpha), ctype(beta)


def xt_args(routine: str, n: int, ra: int, pa: int, pb: int, rb: int, pc: int) -> tuple:
    """The cuBLAS-XT arguments after the handle (ra, rb: addresses of alpha, beta)."""
    if routine == "gemm":
        return NOTRANS, NOTRANS, n, n, n, ra, pa, n, pb, n, rb, pc, n
    if routine == "symm":
        return LEFT, UPPER_XT, n, n, ra, pa, n, pb, n, rb, pc, n
    if routine == "syrk":
        return UPPER_XT, NOTRANS, n, n, ra, pa, n, rb, pc, n
    if routine == "syr2k":
        return UPPER_XT, NOTRANS, n, n, ra, pa, n, pb, n, rb, pc, n
    if routine == "trmm":  # out-of-place: C = alpha A B
        return LEFT, UPPER_XT, NOTRANS, NONUNIT, n, n, ra, pa, n, pb, n, pc, n
    if routine == "trsm":  # in place on out (= B)
        return LEFT, UPPER_XT, NOTRANS, NONUNIT, n, n, ra, pa, n, pc, n
    raise ValueError(f"routine: got {routine!r}; allowed: {', '.join(ROUTINES)}")


def _xt_call(xt, name, routine, *args):
    fn = getattr(xt._lib, name)
    fn.argtypes, fn.restype = XT_ARGTYPES[routine], C.c_int
    _check(fn(xt._handle, *args), name)


def run_xt(xt, dtype, routine, n, A, B, C0, out, alpha, beta):
    al, be = xt_scalars(dtype, alpha, beta)  # kept alive in this frame during the call
    args = xt_args(routine, n, C.addressof(al), A.ctypes.data, B.ctypes.data, C.addressof(be), out.ctypes.data)
    _xt_call(xt, xt_symbol(dtype, routine), routine, *args)


def blasx_routine(blasx, dtype: str, routine: str):
    """blasx.<dtype><routine> (scipy names); GEMM falls back to the generic blasx.gemm, which
    keeps the operands' dtype, where the package has no prefixed gemm."""
    fn = getattr(blasx, dtype + routine, None)
    if fn is None and routine == "gemm":
        fn = blasx.gemm
    if fn is None:
        raise AttributeError(f"blasx has no {dtype + routine}")
    return fn


def run_blasx(blasx, dtype, routine, n, A, B, C0, out, alpha, beta):
    fn = blasx_routine(blasx, dtype, routine)
    if routine in ("gemm", "symm", "syrk", "syr2k"):
        args = {"gemm": (A, B), "symm": (A, B), "syrk": (A,), "syr2k": (A, B)}[routine]
        fn(alpha, *args, beta=beta, c=out, overwrite_c=True)
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


def format_failures(results: list[dict]) -> list[str]:
    return [f"{r['who']} {r['dtype']}{r['routine']} N={r['n']}: {r['failure']}" for r in results if r.get("failure")]


def dtype_words(dtypes) -> str:
    return ", ".join(f"{DTYPE_NAMES[d]} ({d})" for d in dtypes)


def format_markdown(report: dict) -> str:
    dtypes = report["dtypes"]
    tol = ", ".join(f"{BASE_TOLERANCE[d]:g} ({d})" for d in dtypes)
    return (f"# Level-3 routines: blasx vs cuBLAS-XT ({report['tag']}, {report['date']} UTC), "
            f"dtypes: {dtype_words(dtypes)}\n\n"
            f"```\n{report['command']}\n```\n\n"
            f"Machine: {report.get('machine', '?')}\n\n"
            f"Best of {report['runs']} shuffled runs after one warm-up each; {dtype_words(dtypes)} "
            f"precision, registered host arrays, upper / no transpose / left / non-unit, alpha "
            f"{report['alpha']:g}, beta {report['beta']:g}, blasx tile "
            f"{report.get('tile') or 'chosen per call'}. Checked on {CHECK_ROWS} sampled rows "
            f"against float64 numpy; tolerance on the relative error {tol} x max(1, sqrt(N/8192)).\n\n"
            f"{report['table']}\n"
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
    alpha, beta = ALPHA, BETA
    rows = sample_rows(n, CHECK_ROWS, args.seed)
    order = [(who, rt, k) for rt in args.routines for who in ("blasx", "cublasxt") for k in range(args.runs + 1)]
    random.Random(f"{args.seed}:{n}:{dtype}").shuffle(order)
    order.sort(key=lambda x: x[2] > 0)  # warm-ups first, then the shuffled timed runs
    failed: set = set()
    refs: dict = {}  # routine -> its reference rows, computed at its first check
    for who, rt, k in order:
        if (who, rt) in failed:
            continue
        parallel_copy(out, C0 if rt in ("gemm", "symm", "syrk", "syr2k") else B)  # untimed reset
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
        tf = FLOPS[rt] * n**3 / t / 1e12
        print(f"   {who:<8} {dtype}{rt:<6} run {k}: {t:.4f} s {tf:7.2f} TFLOPS err {err:.1e} "
              f"{'ok' if ok else 'WRONG'}", flush=True)
        results.append({"who": who, "routine": rt, "dtype": dtype, "n": n, "run": k, "seconds": t,
                        "rel_err": finite(err), "tflops": tf, "ok": ok})


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
                  "table": text, "failures": problems + format_failures(results)}
        base = os.path.join(args.out, f"level3-{args.tag}-{stamp}")
        data = {**{k: v for k, v in report.items() if k != "table"},
                "argv": sys.argv[1:] if argv is None else list(argv), "routines": args.routines, "n": args.n,
                "xt_block": args.xt_block, "gpus": args.gpus, "devices": devices,
                "tolerance": {d: BASE_TOLERANCE[d] for d in args.dtypes}, "registration": registration,
                "results": results}
        paths = write_json_md(base, data, format_markdown(report))
        print("wrote", paths[0], "and", paths[1])
    return 0 if results and all(r["ok"] for r in results) and not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
