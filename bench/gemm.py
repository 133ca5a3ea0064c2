"""GEMM benchmark: blasx against cuBLAS-XT, in-core CuPy (cuBLAS on one GPU) and NumPy.

    python -m bench.gemm --n 16384 --dtypes d,s --gpus 2 --runs 3 \\
        --modes registered,pageable --out bench/results

Every contender runs on the same host arrays in one process, its runs shuffled together with
the other contenders' runs; every result is checked against a higher-precision reference.
See bench/README.md for the contenders, the modes and how to read the output. CuPy is only
imported inside the functions that need a GPU, so this module imports (and its formatting
functions run) on a machine without one.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as _dt
import functools
import gc
import json
import math
import os
import platform
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from typing import Callable, Iterable, Sequence

import numpy as np

from blasx.runtime.dtypes import GEMM_BY_PREFIX as BY_PREFIX
from blasx.runtime.dtypes import GEMM_PREFIXES as PREFIXES
from blasx.runtime.dtypes import MATH_MODES

from . import gemm_lp
from .level3 import _parallel
from .cublasxt import CublasXt, cublas_version, find_libcublas, registered

# --------------------------------------------------------------------------- constants

MODES = ("registered", "pageable", "fresh")
DEFAULT_MODES = ("registered", "pageable")
CONTENDER_ORDER = ("blasx", "cublasxt", "cupy", "numpy")

DEFAULT_N = (16384,)
DEFAULT_RUNS = 3
DEFAULT_XT_BLOCKS = (2048, 4096, 8192)
QUICK_N = (1024, 2048)
QUICK_RUNS = 2
QUICK_XT_BLOCKS = (512, 1024)

log = functools.partial(print, file=sys.stderr, flush=True)

# --------------------------------------------------------------------------- arguments


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _choice_list(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [x.strip().lower() for x in text.split(",") if x.strip()]
        bad = [v for v in values if v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {bad or text!r}; choose from {','.join(choices)}")
        return list(dict.fromkeys(values))
    return parse


def _gpu_list(text: str) -> list[int]:
    """'2' -> the first two GPUs [0, 1]; '0,1' or '1,' -> exactly those ids."""
    try:
        if "," in text:
            ids = [int(x) for x in text.split(",") if x.strip()]
            if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
                raise ValueError
            return ids
        count = int(text)
        if count < 1:
            raise ValueError
        return list(range(count))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--gpus takes a count ('2') or a comma list of device ids ('0,1', '1,'), not {text!r}")


def _complex(text: str) -> complex:
    try:
        return complex(text.replace(" ", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.gemm",
        description="GEMM C = alpha*A@B + beta*C on host arrays: blasx vs cuBLAS-XT vs in-core "
                    "CuPy vs NumPy, all in one process, runs shuffled, every result checked.")
    size = p.add_argument_group("problem")
    size.add_argument("--n", type=_int_list, default=None,
                      help=f"comma list of N (default {','.join(map(str, DEFAULT_N))}; "
                           f"--quick: {','.join(map(str, QUICK_N))})")
    size.add_argument("--m", type=int, default=None, help="M for every N (default: N)")
    size.add_argument("--k", type=int, default=None, help="K for every N (default: N)")
    size.add_argument("--dtypes", type=_choice_list(tuple(PREFIXES), "dtype"), default=["d", "s"],
                      help=f"comma list of {','.join(PREFIXES)} (default d,s); h, b accumulate in "
                           f"float32 and return their type, i8 returns int32 (alpha, beta rounded)")
    size.add_argument("--math", choices=MATH_MODES, default="ieee",
                      help="float32's math: ieee (default) or tf32 (TF32 tensor cores; s only)")
    size.add_argument("--check-rows", type=int, default=None,
                      help="check this many rows of C against a float64 CPU reference (default: "
                           "all of C for s,d,c,z in IEEE math, 256 rows for h,b,i8 and TF32)")
    size.add_argument("--alpha", type=_complex, default=complex(1.5),
                      help="alpha (default 1.5; complex like 1.5+0.5j for c,z only)")
    size.add_argument("--beta", type=_complex, default=complex(0.5),
                      help="beta (default 0.5; 0 poisons C with NaN before every run)")
    size.add_argument("--seed", type=int, default=0, help="seed of the arrays and the run order")
    run = p.add_argument_group("runs")
    run.add_argument("--gpus", type=_gpu_list, default=None,
                     help="GPU count ('2' = devices 0,1) or id list ('0,1'); default: all visible")
    run.add_argument("--runs", type=int, default=None,
                     help=f"timed runs per contender (default {DEFAULT_RUNS}; "
                          f"--quick: {QUICK_RUNS})")
    run.add_argument("--warmup", type=int, default=1,
                     help="untimed, unchecked calls per contender and mode before the timed runs "
                          "(default 1)")
    run.add_argument("--modes", type=_choice_list(MODES, "mode"), default=list(DEFAULT_MODES),
                     help="comma list of registered,pageable,fresh (default registered,pageable); fresh: "
                          "A and B copied into new arrays before every run, blasx returning a new C")
    run.add_argument("--contenders", type=_choice_list(CONTENDER_ORDER, "contender"),
                     default=list(CONTENDER_ORDER),
                     help=f"comma list of {','.join(CONTENDER_ORDER)} (default all)")
    run.add_argument("--tile", type=int, default=None, help="blasx tile size (default: blasx's)")
    run.add_argument("--xt-blocks", type=_int_list, default=None,
                     help=f"cuBLAS-XT block dims (default {','.join(map(str, DEFAULT_XT_BLOCKS))}; "
                          f"--quick: {','.join(map(str, QUICK_XT_BLOCKS))})")
    run.add_argument("--xt-pinning", choices=("auto", "on", "off"), default="auto",
                     help="cuBLAS-XT pinning mode: auto = on for pageable and fresh, off for "
                          "registered arrays")
    run.add_argument("--numpy-max-n", type=int, default=8192,
                     help="run numpy only when max(M,N,K) <= this (default 8192)")
    run.add_argument("--quick", action="store_true",
                     help="smoke run: small N, fewer runs, small cuBLAS-XT blocks")
    out = p.add_argument_group("output")
    out.add_argument("--out", default=os.path.join("bench", "results"),
                     help="directory of the JSON and markdown results (default bench/results)")
    out.add_argument("--tag", default=None, help="name in the result files (default: hostname)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and complete the options: --quick defaults, sizes, scalar/dtype checks."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.n = args.n or list(QUICK_N if args.quick else DEFAULT_N)
    args.runs = args.runs if args.runs is not None else (QUICK_RUNS if args.quick else DEFAULT_RUNS)
    args.xt_blocks = args.xt_blocks or list(QUICK_XT_BLOCKS if args.quick else DEFAULT_XT_BLOCKS)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    for name in ("m", "k", "tile", "numpy_max_n"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if (args.alpha.imag or args.beta.imag) and any(d not in "cz" for d in args.dtypes):
        parser.error("complex --alpha/--beta need complex --dtypes (c,z) only")
    args.sizes = [(args.m or n, n, args.k or n) for n in args.n]
    args.tag = _safe_name(args.tag or socket.gethostname())
    return args


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "host"


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


def gib(nbytes: float) -> float:
    return nbytes / 2**30


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
    ref_rows: int | None = None    # the reference covers these first rows of C (None: all)
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
                   list(gpus), tolerance(dtype, k, args.math), ref_rows=None if rows is None else min(rows, m),
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


# --------------------------------------------------------------------------- GPU helpers


def _to_device(host: np.ndarray):
    """A device copy of a contiguous host array, same layout (synchronous cudaMemcpy)."""
    import cupy
    d = cupy.empty(host.shape, host.dtype, order="F" if host.flags.f_contiguous else "C")
    _h2d(d, host)
    return d


def _h2d(dev, host: np.ndarray) -> None:
    assert dev.nbytes == host.nbytes and dev.dtype == host.dtype
    dev.data.copy_from_host(ctypes.c_void_p(host.ctypes.data), host.nbytes)


def _d2h(host: np.ndarray, dev) -> None:
    assert dev.nbytes == host.nbytes and dev.dtype == host.dtype
    assert dev.flags.f_contiguous == host.flags.f_contiguous or host.ndim < 2
    dev.data.copy_to_host(ctypes.c_void_p(host.ctypes.data), host.nbytes)


def _free_device_pool() -> None:
    with contextlib.suppress(Exception):
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()


def device_free_bytes(device: int) -> int:
    import cupy
    _free_device_pool()
    with cupy.cuda.Device(device):
        free, _total = cupy.cuda.runtime.memGetInfo()
    return free


def _reference_gpu(p: Problem, ref_dtype: np.dtype, device: int) -> np.ndarray:
    import cupy
    from cupy import cublas

    def up(host):
        d = _to_device(host)
        return d if d.dtype == ref_dtype else d.astype(ref_dtype, order="F")

    def compute() -> np.ndarray:        # device arrays live only in this frame
        d_a, d_b = up(p.a), up(p.b)
        if p.c_init is not None:
            d_c = up(p.c_init)
        else:
            d_c = cupy.empty((p.m, p.n), ref_dtype, order="F")
        cublas.gemm("N", "N", d_a, d_b, out=d_c, alpha=p.alpha, beta=p.beta)
        cupy.cuda.Device(device).synchronize()
        ref = np.empty((p.m, p.n), dtype=ref_dtype, order="F")
        _d2h(ref, d_c)
        return ref

    try:
        with cupy.cuda.Device(device):
            return compute()
    finally:
        _free_device_pool()


def _reference_cpu(p: Problem, ref_dtype: np.dtype) -> np.ndarray:
    ref = p.a.astype(ref_dtype) @ p.b.astype(ref_dtype)
    ref *= p.alpha
    if p.c_init is not None:
        ref += p.beta * p.c_init.astype(ref_dtype)
    return np.asfortranarray(ref)


def compute_reference(p: Problem) -> tuple[np.ndarray, dict]:
    """The reference result in higher precision: cuBLAS on the first GPU when A, B, C fit in
    its free memory at the reference precision, else NumPy on the CPU."""
    ref_dtype = BY_PREFIX[p.dtype].wide
    if p.ref_rows is not None:  # a row sample, in float64 on the CPU
        t0 = time.perf_counter()
        ref = gemm_lp.sample_reference(p.a, p.b, p.ref_rows, p.alpha, p.beta, p.c_init)
        return ref, {"dtype": "float64", "where": "cpu", "rows": p.ref_rows,
                     "seconds": time.perf_counter() - t0}
    device = p.gpus[0]
    need = (p.m * p.k + p.k * p.n + p.m * p.n) * ref_dtype.itemsize + max(p.a.nbytes, p.b.nbytes)
    info: dict = {"dtype": str(ref_dtype)}
    t0 = time.perf_counter()
    ref = None
    try:
        free = device_free_bytes(device)
        if need < 0.9 * free:
            ref = _reference_gpu(p, ref_dtype, device)
            info["where"] = f"cuda:{device}"
        else:
            info["gpu_skipped"] = f"needs {gib(need):.1f} GiB, {gib(free):.1f} GiB free"
    except Exception as e:          # no GPU, or it failed: fall back to the CPU
        info["gpu_error"] = _describe(e)
    if ref is None:
        ref = _reference_cpu(p, ref_dtype)
        info["where"] = "cpu"
    info["seconds"] = time.perf_counter() - t0
    return ref, info


# --------------------------------------------------------------------------- contenders


@dataclass
class Outcome:
    """One run: seconds per label (a run may time several things), the result array."""
    times: dict[str, float]
    result: np.ndarray | None
    extra: dict = field(default_factory=dict)


class Contender:
    """One implementation under test. Subclasses set `name` and implement `run`."""
    name = "?"

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def variants(self, p: Problem) -> list:
        return [None]

    def labels(self, variant) -> list[str]:
        return [self.name]

    def skip_reason(self, p: Problem) -> str | None:
        return None

    def run(self, p: Problem, variant) -> Outcome:
        raise NotImplementedError

    def end_mode(self) -> None:
        """Release what was held for one (problem, mode)."""

    def close(self) -> None:
        """Release everything (end of the benchmark)."""


class BlasxContender(Contender):
    """blasx.gemm (scipy.linalg.blas semantics) over all benchmark GPUs."""
    name = "blasx"

    def __init__(self, args):
        super().__init__(args)
        self._blasx = None
        self._error: str | None = None

    def _module(self, p: Problem):
        if self._error:
            raise RuntimeError(self._error)
        if self._blasx is None:
            try:
                import blasx
                blasx.configure(devices="cuda:" + ",".join(map(str, p.gpus)),
                                tile=self.args.tile or None)
            except Exception as e:
                self._error = f"blasx import/configure failed: {_describe(e)}"
                raise RuntimeError(self._error) from e
            self._blasx = blasx
        return self._blasx

    def run(self, p, variant):
        bx = self._module(p)
        t0 = time.perf_counter()
        if p.mode == "fresh":  # as a caller writes it: a new result (C's values in it where beta != 0)
            result = bx.gemm(p.alpha, p.a, p.b, beta=p.beta, c=None if p.c_init is None else p.c_out, math=p.math)
        else:
            result = bx.gemm(p.alpha, p.a, p.b, beta=p.beta, c=p.c_out, overwrite_c=True, math=p.math)
        seconds = time.perf_counter() - t0
        extra = {"result_is_c": result is p.c_out}
        try:
            extra["profile"] = bx.last_profile().summary()
        except Exception as e:
            extra["profile_error"] = _describe(e)
        return Outcome({"blasx": seconds}, result, extra)

    def close(self):
        if self._blasx is not None:
            self._blasx, bx = None, self._blasx
            bx.shutdown()


class CublasXtContender(Contender):
    """cuBLAS-XT over all benchmark GPUs, one variant per block dim; a handle per
    (block, pinning) lives for one mode (its creation is not timed)."""
    name = "cublasxt"

    def __init__(self, args):
        super().__init__(args)
        self._handles: dict[tuple, CublasXt] = {}

    def variants(self, p):
        return list(self.args.xt_blocks)

    def skip_reason(self, p):
        if gemm_lp.reduced(p.dtype, p.math):
            return "cuBLAS-XT has no half, bfloat16, int8 or TF32 gemm"
        return None

    def labels(self, block):
        return [f"cublasxt[b={block}]"]

    def pinning(self, mode: str) -> bool:
        return {"on": True, "off": False}.get(self.args.xt_pinning, mode != "registered")

    def _handle(self, p: Problem, block: int) -> CublasXt:
        key = (tuple(p.gpus), block, self.pinning(p.mode))
        if key not in self._handles:
            self._handles[key] = CublasXt(p.gpus, block_dim=block, pinning=key[2])
        return self._handles[key]

    def run(self, p, block):
        xt = self._handle(p, block)
        t0 = time.perf_counter()
        xt.gemm(p.alpha, p.a, p.b, p.beta, p.c_out)
        seconds = time.perf_counter() - t0
        return Outcome({self.labels(block)[0]: seconds}, p.c_out,
                       {"block": block, "pinning": xt.pinning})

    def end_mode(self):
        handles, self._handles = list(self._handles.values()), {}
        for h in handles:
            h.close()

    close = end_mode


class CupyContender(Contender):
    """In-core cuBLAS gemm through CuPy on the first benchmark GPU: "cupy" times the kernel
    alone with CUDA events (the in-core ceiling), "cupy+copies" adds the host->device copies
    of A, B (and C when beta != 0) and the device->host copy of C (perf_counter)."""
    name = "cupy"

    def labels(self, variant):
        return ["cupy", "cupy+copies"]

    def skip_reason(self, p):
        need = p.a.nbytes + p.b.nbytes + p.c_out.nbytes
        free = device_free_bytes(p.gpus[0])
        if need > 0.95 * free:
            return (f"A, B, C need {gib(need):.1f} GiB on cuda:{p.gpus[0]}, "
                    f"{gib(free):.1f} GiB free")
        return None

    def run(self, p, variant):
        import cupy
        dev = cupy.cuda.Device(p.gpus[0])
        try:
            with dev:
                if gemm_lp.reduced(p.dtype, p.math):  # cublasGemmEx (CuPy has no bfloat16 type)
                    kernel, total = gemm_lp.incore_gemm_ex(p, dev.id, p.math)
                else:
                    kernel, total = self._timed(p, dev)
        finally:
            _free_device_pool()         # the device arrays died with _timed's frame
        return Outcome({"cupy": kernel, "cupy+copies": total}, p.c_out, {"device": dev.id})

    @staticmethod
    def _timed(p: Problem, dev) -> tuple[float, float]:
        import cupy
        from cupy import cublas
        d_a, d_b, d_c = (cupy.empty(x.shape, x.dtype, order="F") for x in (p.a, p.b, p.c_out))
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        dev.synchronize()
        t0 = time.perf_counter()
        _h2d(d_a, p.a)
        _h2d(d_b, p.b)
        if p.c_init is not None:
            _h2d(d_c, p.c_out)          # the poisoned output holds the pristine C
        start.record()
        cublas.gemm("N", "N", d_a, d_b, out=d_c, alpha=p.alpha, beta=p.beta)
        end.record()
        end.synchronize()
        _d2h(p.c_out, d_c)
        total = time.perf_counter() - t0
        return cupy.cuda.get_elapsed_time(start, end) / 1e3, total

    def end_mode(self):
        _free_device_pool()

    close = end_mode


class NumpyContender(Contender):
    """numpy a @ b on the CPU (its BLAS, all cores), with alpha and beta applied."""
    name = "numpy"

    def skip_reason(self, p):
        if gemm_lp.reduced(p.dtype, p.math):
            return "numpy has no fast half, bfloat16, int8 or TF32 matmul"
        if max(p.m, p.n, p.k) > self.args.numpy_max_n:
            return f"max(M,N,K) > --numpy-max-n {self.args.numpy_max_n}"
        return None

    def run(self, p, variant):
        t0 = time.perf_counter()
        if p.c_init is None:
            np.matmul(p.a, p.b, out=p.c_out)
            if p.alpha != 1:
                p.c_out *= p.alpha
        else:
            prod = p.a @ p.b
            prod *= p.alpha
            p.c_out *= p.beta
            p.c_out += prod
            del prod
        return Outcome({"numpy": time.perf_counter() - t0}, p.c_out)


CONTENDERS: dict[str, type[Contender]] = {
    "blasx": BlasxContender,
    "cublasxt": CublasXtContender,
    "cupy": CupyContender,
    "numpy": NumpyContender,
}

# --------------------------------------------------------------------------- running


@dataclass
class Record:
    """One timed (or failed) run of one label."""
    label: str
    contender: str
    variant: object
    mode: str
    dtype: str
    m: int
    n: int
    k: int
    run: int
    seconds: float | None
    error: float | None
    ok: bool
    failure: str | None = None
    warmup: bool = False
    extra: dict = field(default_factory=dict)


def _describe(e: BaseException) -> str:
    where = ""
    tb = traceback.extract_tb(e.__traceback__) if e.__traceback__ else []
    if tb:
        where = f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno})"
    return f"{type(e).__name__}: {e}{where}"


def schedule(contenders: Sequence[Contender], p: Problem, runs: int, seed: int) -> list[tuple]:
    """All (contender, variant, run) triples in a random order fixed by the seed and the case."""
    items = [(c, v, r) for c in contenders for v in c.variants(p) for r in range(runs)]
    random.Random(f"{seed}:{p.dtype}:{p.m}:{p.n}:{p.k}:{p.mode}").shuffle(items)
    return items


def _records(c: Contender, variant, p: Problem, run: int, warmup: bool, **fields) -> list[Record]:
    times = fields.pop("times", None) or {label: None for label in c.labels(variant)}
    return [Record(label, c.name, variant, p.mode, p.dtype, p.m, p.n, p.k, run, seconds,
                   warmup=warmup, **fields) for label, seconds in times.items()]


def release_blasx_pins(p: Problem) -> None:
    """Pageable mode measures one-shot calls: whatever blasx page-locked in an earlier run is
    unregistered (untimed) before every run, so blasx pays its pinning or staging each time and
    no other contender reads memory that blasx left pinned."""
    try:
        from blasx.runtime.hostmem import REGISTRY
    except ImportError:                 # blasx not installed: it pinned nothing
        return
    for x in (p.a, p.b, p.c_init, p.c_out):
        if x is not None:
            REGISTRY.release(x)


def refresh_inputs(p: Problem) -> None:
    """Fresh mode: A and B become new arrays of the same values (untimed), their pages written and
    never page-locked: a caller's one-shot arrays. The old ones go (and blasx's registrations with them)."""
    for name in ("a", "b"):
        old = getattr(p, name)
        new = np.empty_like(old, order="K")
        np.copyto(new, old)
        setattr(p, name, new)
        del old


def execute(c: Contender, variant, p: Problem, run: int, warmup: bool = False) -> list[Record]:
    """Poison C, run once, check the result (not for warm-ups); failures become records."""
    p.poison()
    if p.mode in ("pageable", "fresh"):
        release_blasx_pins(p)
    if p.mode == "fresh":
        refresh_inputs(p)
    try:
        out = c.run(p, variant)
    except Exception as e:
        failure, extra = _describe(e), {"traceback": traceback.format_exc()[-4000:]}
        del e
        _free_device_pool()             # e.g. after an out-of-memory error
        return _records(c, variant, p, run, warmup, error=None, ok=False,
                        failure=failure, extra=extra)
    if warmup:
        return _records(c, variant, p, run, True, times=out.times, error=None, ok=True,
                        extra=out.extra)
    result = out.result if p.ref_rows is None or out.result is None else np.asarray(out.result)[:p.ref_rows]
    err = rel_error(result, p.ref, p.ref_norm)
    ok = bool(err <= p.tolerance)
    return _records(c, variant, p, run, False, times=out.times, error=err, ok=ok,
                    extra=out.extra)


def _log_records(p: Problem, recs: list[Record], total: int | None = None) -> None:
    for r in recs:
        head = f"[{p.mode} {p.dtype} {p.size}] {r.label:<18}"
        which = "warm-up" if r.warmup else f"run {r.run + 1}/{total}"
        if r.failure:
            log(f"{head} {which}: FAILED {r.failure}")
        elif r.warmup:
            log(f"{head} {which}: {r.seconds:.4f} s")
        else:
            tf = tflops(p.dtype, p.m, p.n, p.k, r.seconds) or 0.0
            log(f"{head} {which}: {r.seconds:.4f} s {tf:8.2f} TFLOPS  err {r.error:.1e} "
                f"{'ok' if r.ok else 'WRONG'}")


def run_mode(p: Problem, contenders: Sequence[Contender], args) -> tuple[list[Record], dict]:
    """Warm-ups, then the shuffled timed runs, of every applicable contender in one mode.
    A contender variant that raises is not run again in this mode."""
    records: list[Record] = []
    skipped: dict[str, str] = {}
    active = []
    for c in contenders:
        try:
            reason = c.skip_reason(p)
        except Exception as e:
            reason = f"cannot check: {_describe(e)}"
        if reason:
            skipped[c.name] = reason
            log(f"[{p.mode} {p.dtype} {p.size}] {c.name}: skipped ({reason})")
        else:
            active.append(c)
    failed: set[tuple[str, object]] = set()

    def do(c, v, run, warmup):
        recs = execute(c, v, p, run, warmup)
        _log_records(p, recs, args.runs)
        if any(r.failure for r in recs):
            failed.add((c.name, v))
        records.extend(recs)

    for c in active:
        for v in c.variants(p):
            for i in range(args.warmup):
                if (c.name, v) not in failed:
                    do(c, v, i, True)
    for c, v, r in schedule(active, p, args.runs, args.seed):
        if (c.name, v) not in failed:
            do(c, v, r, False)
    return records, skipped


def _registration_info(reg) -> dict:
    return {"gib": gib(reg.nbytes), "seconds": reg.seconds,
            "seconds_per_gib": reg.seconds_per_gib,
            "unregister_seconds": reg.unregister_seconds}


def run_problem(args, dtype: str, size: tuple[int, int, int], gpus: list[int],
                contenders: Sequence[Contender], report: dict) -> None:
    m, n, k = size
    need = host_bytes_needed(dtype, m, n, k, typed_scalar(args.beta, dtype), args.check_rows, "fresh" in args.modes)
    log(f"== {dtype} {size_label(m, n, k)}: host arrays {gib(need):.1f} GiB")
    _warn_host_memory(need)
    t0 = time.perf_counter()
    p = make_problem(args, dtype, m, n, k, gpus)
    case = {"dtype": dtype, "m": m, "n": n, "k": k, "alpha": p.alpha, "beta": p.beta,
            "tolerance": p.tolerance, "host_gib": gib(need), "math": p.math,
            "generate_seconds": time.perf_counter() - t0, "modes": {}}
    rates = report.setdefault("link_rates", None)
    if rates is None and "blasx" in args.contenders:
        rates = report["link_rates"] = gemm_lp.link_rates(gpus)
    in_bytes = p.a.nbytes + p.b.nbytes + (p.c_init.nbytes if p.c_init is not None else 0)
    case["link_bound"] = gemm_lp.link_bound(rates or {}, in_bytes, p.c_out.nbytes)
    if case["link_bound"]:
        log("   " + gemm_lp.format_bound(case, None))
    ref, case["reference"] = compute_reference(p)
    p.ref, p.ref_norm = ref, frobenius(ref)
    log(f"   reference on {case['reference']['where']} in {case['reference']['seconds']:.1f} s")
    report["cases"].append(case)
    for mode in args.modes:
        pm = replace(p, mode=mode)
        info: dict = {}
        if mode == "registered":
            hold = registered(pm.a, pm.b, pm.c_out)
        else:
            hold = contextlib.nullcontext()
        try:
            with hold as reg:
                if reg is not None:
                    log(f"   registered {gib(reg.nbytes):.1f} GiB in {reg.seconds:.2f} s "
                        f"({reg.seconds_per_gib:.3f} s/GiB)")
                try:
                    records, info["skipped"] = run_mode(pm, contenders, args)
                finally:
                    for c in contenders:
                        with contextlib.suppress(Exception):
                            c.end_mode()
            if reg is not None:
                info["registration"] = _registration_info(reg)
        except Exception as e:          # registration failed: note it, go on with other modes
            info["error"] = _describe(e)
            log(f"   mode {mode} failed: {info['error']}")
            records = []
        case["modes"][mode] = info
        report["records"].extend(records)
    del p, ref
    gc.collect()


def _warn_host_memory(need: int) -> None:
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemAvailable"))
    except (OSError, StopIteration, ValueError):
        return
    if need > 0.9 * avail:
        log(f"   WARNING: needs {gib(need):.1f} GiB of host memory, {gib(avail):.1f} GiB available")


# --------------------------------------------------------------------------- summary


@dataclass
class Row:
    """The runs of one label in one (mode, dtype, size): best/median and the check."""
    label: str
    contender: str
    variant: object
    mode: str
    dtype: str
    m: int
    n: int
    k: int
    runs: int
    best: float | None
    median: float | None
    tflops_best: float | None
    tflops_median: float | None
    error: float | None
    status: str                     # "ok" | "WRONG" | "FAILED"
    failure: str | None = None
    best_extra: dict = field(default_factory=dict)

    @property
    def size(self) -> str:
        return size_label(self.m, self.n, self.k)


def _row(recs: list[Record]) -> Row:
    r0 = recs[0]
    timed = [r for r in recs if r.seconds is not None and not r.warmup]
    failures = [r.failure for r in recs if r.failure]
    times = [r.seconds for r in timed]
    best_rec = min(timed, key=lambda r: r.seconds) if timed else None
    errors = [r.error for r in timed if r.error is not None]
    error = (math.nan if any(math.isnan(e) for e in errors) else max(errors)) if errors else None
    if failures:
        status = "FAILED"
    elif any(not r.ok for r in timed):
        status = "WRONG"
    else:
        status = "ok"
    best = min(times) if times else None
    median = statistics.median(times) if times else None
    args = (r0.dtype, r0.m, r0.n, r0.k)
    return Row(r0.label, r0.contender, r0.variant, r0.mode, r0.dtype, r0.m, r0.n, r0.k,
               len(times), best, median, tflops(*args, best), tflops(*args, median), error,
               status, failures[0] if failures else None,
               dict(best_rec.extra) if best_rec else {})


def _row_order(row: Row, dtype_rank: dict[str, int]) -> tuple:
    def index(seq, x):
        return seq.index(x) if x in seq else len(seq)
    variant = row.variant if isinstance(row.variant, (int, float)) else -1
    return (dtype_rank[row.dtype], row.m * row.n * row.k, row.m, row.n, row.k,
            index(MODES, row.mode), index(CONTENDER_ORDER, row.contender), variant, row.label)


def summarize(records: Iterable[Record]) -> list[Row]:
    """One row per (mode, dtype, size, label), from the timed runs (and any failure);
    dtypes in the order they were run, then size, mode, contender, block."""
    groups: dict[tuple, list[Record]] = {}
    dtype_rank: dict[str, int] = {}
    for r in records:
        if r.warmup and not r.failure:
            continue
        dtype_rank.setdefault(r.dtype, len(dtype_rank))
        groups.setdefault((r.mode, r.dtype, r.m, r.n, r.k, r.label), []).append(r)
    return sorted((_row(recs) for recs in groups.values()),
                  key=lambda row: _row_order(row, dtype_rank))


def _group_rows(rows: Iterable[Row]) -> dict[tuple, list[Row]]:
    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        groups.setdefault((row.mode, row.dtype, row.m, row.n, row.k), []).append(row)
    return groups


def best_of(rows: Iterable[Row], contender: str) -> Row | None:
    """The fastest correct row of a contender (e.g. the best cuBLAS-XT block)."""
    good = [r for r in rows if r.contender == contender and r.status == "ok" and r.best]
    return min(good, key=lambda r: r.best) if good else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def compute_ratios(rows: Sequence[Row], n_gpus: int) -> list[dict]:
    """Same-run ratios per (mode, dtype, size), correct rows only:
    blasx speed over the best cuBLAS-XT block's, and blasx TFLOPS over
    (in-core cupy TFLOPS x GPUs), the fraction of the in-core ceiling reached."""
    out = []
    for (mode, dtype, m, n, k), group in _group_rows(rows).items():
        bx = next((r for r in group if r.label == "blasx" and r.status == "ok" and r.best), None)
        if bx is None:
            continue
        entry: dict = {"mode": mode, "dtype": dtype, "m": m, "n": n, "k": k, "gpus": n_gpus}
        xt = best_of(group, "cublasxt")
        if xt is not None:
            entry.update(xt_label=xt.label,
                         blasx_over_xt_best=_ratio(xt.best, bx.best),
                         blasx_over_xt_median=_ratio(xt.median, bx.median))
        cp = next((r for r in group if r.label == "cupy" and r.status == "ok" and r.best), None)
        if cp is not None:
            entry.update(blasx_over_cupy_x_gpus_best=_ratio(bx.tflops_best,
                                                            (cp.tflops_best or 0) * n_gpus),
                         blasx_over_cupy_x_gpus_median=_ratio(bx.tflops_median,
                                                              (cp.tflops_median or 0) * n_gpus))
        if len(entry) > 6:
            out.append(entry)
    return out


# --------------------------------------------------------------------------- formatting


def _num(value) -> str:
    """A scalar as typed on the command line: 1.5, 0, (1.5+0.5j)."""
    if isinstance(value, complex) and not value.imag:
        value = value.real
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _f(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan" if isinstance(value, float) else "-"
    return format(value, spec)


def _best_xt_labels(rows: Sequence[Row]) -> set[tuple]:
    marks = set()
    for key, group in _group_rows(rows).items():
        xt = best_of(group, "cublasxt")
        if xt is not None:
            marks.add((*key, xt.label))
    return marks


TABLE_COLUMNS: tuple[tuple[str, Callable[[Row], str], str], ...] = (
    ("contender", lambda r: r.label, "<"),
    ("mode", lambda r: r.mode, "<"),
    ("dtype", lambda r: r.dtype, "<"),
    ("N", lambda r: r.size, ">"),
    ("best s", lambda r: _f(r.best, ".4f"), ">"),
    ("median s", lambda r: _f(r.median, ".4f"), ">"),
    ("TFLOPS best", lambda r: _f(r.tflops_best, ".2f"), ">"),
    ("TFLOPS median", lambda r: _f(r.tflops_median, ".2f"), ">"),
    ("rel. error", lambda r: _f(r.error, ".1e"), ">"),
    ("ok", lambda r: r.status, "<"),
)


def _cells(rows: Sequence[Row]) -> list[list[str]]:
    marks = _best_xt_labels(rows)
    out = []
    for r in rows:
        cells = [fn(r) for _, fn, _ in TABLE_COLUMNS]
        if (r.mode, r.dtype, r.m, r.n, r.k, r.label) in marks:
            cells[0] += " *"
        out.append(cells)
    return out


def format_table(rows: Sequence[Row]) -> str:
    """Aligned text table; '*' marks the best cuBLAS-XT block of each case."""
    header = [h for h, _, _ in TABLE_COLUMNS]
    body = _cells(rows)
    widths = [max(len(x) for x in col) for col in zip(header, *body)]

    def line(cells):
        return "  ".join(format(c, f"{al}{w}") for c, (_, _, al), w
                         in zip(cells, TABLE_COLUMNS, widths)).rstrip()
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(c) for c in body)])


def format_markdown_table(rows: Sequence[Row]) -> str:
    header = [h for h, _, _ in TABLE_COLUMNS]
    align = [":--" if al == "<" else "--:" for _, _, al in TABLE_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
              for cells in _cells(rows)]
    return "\n".join(lines)


def format_ratios(ratios: Sequence[dict]) -> list[str]:
    lines = []
    for e in ratios:
        parts = []
        if "xt_label" in e:
            block = e["xt_label"].removeprefix("cublasxt[").removesuffix("]")
            parts.append(f"blasx / cuBLAS-XT ({block}): "
                         f"{_f(e['blasx_over_xt_best'], '.2f')}x best, "
                         f"{_f(e['blasx_over_xt_median'], '.2f')}x median")
        if "blasx_over_cupy_x_gpus_best" in e:
            parts.append(f"blasx / (in-core cupy x {e['gpus']} GPUs): "
                         f"{_f(e['blasx_over_cupy_x_gpus_best'], '.2f')} best, "
                         f"{_f(e['blasx_over_cupy_x_gpus_median'], '.2f')} median")
        lines.append(f"{e['mode']} {e['dtype']} {size_label(e['m'], e['n'], e['k'])}: "
                     + "; ".join(parts))
    return lines


def format_bounds(cases: Sequence[dict], rows: Sequence[Row]) -> list[str]:
    """Per case: the host-link bound from the measured H2D/D2H rates, and blasx's best correct
    time over it (any mode)."""
    lines = []
    for case in cases:
        bx = [r.best for r in rows if r.contender == "blasx" and r.status == "ok" and r.best
              and (r.dtype, r.m, r.n, r.k) == (case["dtype"], case["m"], case["n"], case["k"])]
        line = gemm_lp.format_bound(case, min(bx) if bx else None)
        if line:
            lines.append(line)
    return lines


def format_failures(rows: Sequence[Row]) -> list[str]:
    return [f"{r.label} ({r.mode} {r.dtype} {r.size}): {r.failure}"
            for r in rows if r.status == "FAILED"]


def format_profiles(rows: Sequence[Row]) -> list[str]:
    """One line per blasx row: the best run's time against the engine's own wall (what the call spent
    outside it: a new result, copies of C) and its page-locking time, traffic, cache and steals, and per
    device busy/comm/idle (from blasx.last_profile().summary())."""
    lines = []
    for r in rows:
        prof = r.best_extra.get("profile") if r.contender == "blasx" else None
        if not prof:
            continue
        t = prof.get("totals", {})
        wall, pin = prof.get("wall"), prof.get("host", {}).get("pin_seconds")
        timing = "" if r.best is None or wall is None else (
            f"call {r.best:.3f} s, engine {wall:.3f} s (outside it {max(r.best - wall, 0.0):.3f} s)"
            + ("" if pin is None else f", registering {pin:.3f} s") + "; ")
        devs = ", ".join(
            f"{d.get('name', i)}: {d.get('tasks', 0):.0f} tasks busy {_f(d.get('busy'), '.3f')} "
            f"comm {_f(d.get('comm'), '.3f')} idle {_f(d.get('idle'), '.3f')} s"
            for i, d in enumerate(prof.get("devices", [])))
        lines.append(
            f"{r.mode} {r.dtype} {r.size}: {timing}H2D {gib(t.get('bytes_h2d', 0)):.2f} GiB, "
            f"D2H {gib(t.get('bytes_d2h', 0)):.2f} GiB, P2P {gib(t.get('bytes_p2p', 0)):.2f} GiB; "
            f"L1 hits {t.get('l1_hits', 0):.0f}, L2 hits {t.get('l2_hits', 0):.0f}, "
            f"misses {t.get('misses', 0):.0f}, steals {t.get('steals', 0):.0f}; {devs}")
    return lines


def format_registration(cases: Sequence[dict]) -> list[str]:
    lines = []
    for case in cases:
        reg = case.get("modes", {}).get("registered", {}).get("registration")
        if reg:
            lines.append(f"{case['dtype']} {size_label(case['m'], case['n'], case['k'])}: "
                         f"registered {reg['gib']:.2f} GiB in {reg['seconds']:.3f} s "
                         f"({reg['seconds_per_gib']:.4f} s/GiB), "
                         f"unregistered in {reg['unregister_seconds']:.3f} s")
    return lines


def format_machine(env: dict) -> list[str]:
    gpus = env.get("gpus") or []
    names = ", ".join(f"cuda:{g.get('id')} {g.get('name')} ({_f(g.get('mem_gib'), '.0f')} GiB)"
                      for g in gpus) or env.get("cupy_error", "no GPU information")
    return [
        f"host: {env.get('host', '?')} ({env.get('cpu', '?')}, {env.get('cpus', '?')} CPUs, "
        f"{_f(env.get('host_mem_gib'), '.0f')} GiB)",
        f"GPUs: {names}",
        f"CUDA driver {env.get('cuda_driver', '?')}, runtime {env.get('cuda_runtime', '?')}, "
        f"cuBLAS {env.get('cublas', '?')} ({env.get('libcublas', '?')})",
        f"python {env.get('python', '?')}, numpy {env.get('numpy', '?')}, "
        f"cupy {env.get('cupy', '?')}, scipy {env.get('scipy', '?')}, "
        f"blasx {env.get('blasx', '?')} (git {env.get('git_commit', '?')})",
    ]


def format_markdown(report: dict) -> str:
    """The markdown summary: command, machine, date, table, ratios, costs, profiles."""
    rows = [r if isinstance(r, Row) else Row(**r) for r in report.get("summary", [])]
    cfg = report.get("config", {})
    md = [f"# GEMM benchmark: {report.get('tag', '')} {report.get('date', '')}", "",
          "```", report.get("command", ""), "```", "",
          "## Machine", "", *(f"- {x}" for x in format_machine(report.get("env", {}))), "",
          "## Settings", "",
          f"- alpha {_num(cfg.get('alpha'))}, beta {_num(cfg.get('beta'))}, "
          f"seed {cfg.get('seed')}, "
          f"{cfg.get('runs')} timed runs + {cfg.get('warmup')} warm-up per contender, "
          f"shuffled; modes {cfg.get('modes')}; GPUs {cfg.get('gpus')}",
          f"- cuBLAS-XT blocks {cfg.get('xt_blocks')} (pinning {cfg.get('xt_pinning')}); "
          f"blasx tile {cfg.get('tile') or 'default'}",
          "- tolerance on ||C - ref||_F / ||ref||_F: 1e-4 (s, c), 1e-10 (d, z), "
          "x sqrt(K/8192) above K = 8192", "",
          "## Results", "", format_markdown_table(rows), "",
          "`*` best cuBLAS-XT block; `cupy` = in-core kernel time on one GPU, "
          "`cupy+copies` includes the host<->device copies.", ""]
    for title, lines in (("Same-run ratios", format_ratios(report.get("ratios", []))),
                         ("Host registration cost", format_registration(report.get("cases", []))),
                         ("blasx profile of the best run", format_profiles(rows)),
                         ("Failures", format_failures(rows))):
        if lines:
            md += [f"## {title}", "", *(f"- {x}" for x in lines), ""]
    return "\n".join(md).rstrip() + "\n"


def format_text_report(report: dict) -> str:
    rows = [r if isinstance(r, Row) else Row(**r) for r in report.get("summary", [])]
    out = [format_table(rows), "(* = best cuBLAS-XT block)"]
    for title, lines in (("ratios", format_ratios(report.get("ratios", []))),
                         ("host-link bounds", format_bounds(report.get("cases", []), rows)),
                         ("registration", format_registration(report.get("cases", []))),
                         ("failures", format_failures(rows))):
        if lines:
            out += ["", f"{title}:", *(f"  {x}" for x in lines)]
    return "\n".join(out)


# --------------------------------------------------------------------------- environment


def _run_text(cmd: list[str], timeout: float = 20) -> str | None:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _host_mem_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return gib(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return None


def resolve_gpus(requested: list[int] | None) -> list[int]:
    """The benchmark's device ids: all visible ones by default; exits on unknown ids."""
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        raise SystemExit(f"cannot list the GPUs through CuPy: {_describe(e)}")
    gpus = list(range(count)) if requested is None else requested
    bad = [g for g in gpus if g >= count]
    if not gpus or bad:
        raise SystemExit(f"--gpus {gpus}: {count} GPU(s) visible")
    return gpus


def _gpu_env(gpus: Sequence[int]) -> dict:
    import cupy
    rt = cupy.cuda.runtime
    # load CuPy's libcublas now, so that find_libcublas (which prefers a loaded one) binds
    # cuBLAS-XT from that same library rather than from a second copy
    with contextlib.suppress(Exception), cupy.cuda.Device(gpus[0]):
        cupy.cuda.device.get_cublas_handle()
    env: dict = {"cupy": cupy.__version__,
                 "cuda_driver": _cuda_version(rt.driverGetVersion()),
                 "cuda_runtime": _cuda_version(rt.runtimeGetVersion()),
                 "gpus": [], "peer_access": {}}
    for d in gpus:
        props = rt.getDeviceProperties(d)
        name = props.get("name", b"?")
        env["gpus"].append({
            "id": d, "name": name.decode() if isinstance(name, bytes) else str(name),
            "mem_gib": gib(props.get("totalGlobalMem", 0)),
            "cc": f"{props.get('major', '?')}.{props.get('minor', '?')}",
            "sms": props.get("multiProcessorCount"),
            "pci_bus": props.get("pciBusID")})
    for i in gpus:
        for j in gpus:
            if i != j:
                env["peer_access"][f"{i}->{j}"] = bool(rt.deviceCanAccessPeer(i, j))
    return env


def collect_env(gpus: Sequence[int]) -> dict:
    """Machine and software versions; every probe is optional."""
    env: dict = {"host": socket.gethostname(), "platform": platform.platform(),
                 "python": platform.python_version(), "numpy": np.__version__,
                 "cpu": _cpu_model(), "cpus": os.cpu_count(), "host_mem_gib": _host_mem_gib()}
    with contextlib.suppress(Exception):
        import scipy
        env["scipy"] = scipy.__version__
    try:
        env.update(_gpu_env(gpus))
    except Exception as e:
        env["cupy_error"] = _describe(e)
    try:
        env["libcublas"] = find_libcublas()
        env["cublas"] = cublas_version()
    except Exception as e:
        env["libcublas_error"] = _describe(e)
    try:
        import blasx
        env["blasx"] = getattr(blasx, "__version__", "?")
    except Exception as e:
        env["blasx_error"] = _describe(e)
    here = os.path.dirname(os.path.abspath(__file__))
    env["git_commit"] = _run_text(["git", "-C", here, "rev-parse", "--short", "HEAD"])
    env["git_dirty"] = bool(_run_text(["git", "-C", here, "status", "--porcelain"]))
    env["nvidia_smi"] = _run_text(["nvidia-smi", "--query-gpu=index,name,driver_version,"
                                   "pci.bus_id,clocks.max.sm,clocks.max.mem,power.limit",
                                   "--format=csv"])
    env["nvidia_smi_topo"] = _run_text(["nvidia-smi", "topo", "-m"])
    return env


# --------------------------------------------------------------------------- output


def jsonable(obj):
    """JSON-safe copy: numpy scalars to Python, NaN/inf to None, complex to str."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(asdict(obj))
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, complex):
        return str(obj) if obj.imag else jsonable(obj.real)
    if isinstance(obj, np.ndarray):
        return f"<array {obj.shape} {obj.dtype}>"
    return repr(obj)


def output_paths(out_dir: str, tag: str, stamp: str) -> tuple[str, str]:
    base = os.path.join(out_dir, f"gemm-{tag}-{stamp}")
    return base + ".json", base + ".md"


def write_outputs(report: dict, out_dir: str) -> tuple[str, str]:
    rows = summarize(Record(**r) if isinstance(r, dict) else r for r in report["records"])
    report["summary"] = rows
    report["ratios"] = compute_ratios(rows, len(report["config"].get("gpus") or []))
    os.makedirs(out_dir, exist_ok=True)
    json_path, md_path = output_paths(out_dir, report["tag"], report["stamp"])
    tmp = json_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(jsonable(report), f, indent=1)
    os.replace(tmp, json_path)
    with open(md_path, "w") as f:
        f.write(format_markdown(report))
    return json_path, md_path


def new_report(args: argparse.Namespace, argv: Sequence[str], env: dict) -> dict:
    now = _dt.datetime.now(_dt.timezone.utc).astimezone()
    config = {k: v for k, v in vars(args).items() if k not in ("sizes",)}
    config["sizes"] = [list(s) for s in args.sizes]
    return {"schema": "blasx-bench-gemm/1", "tag": args.tag,
            "date": now.isoformat(timespec="seconds"), "stamp": now.strftime("%Y%m%d-%H%M%S"),
            "command": shlex.join([os.path.basename(sys.executable), "-m", "bench.gemm", *argv]),
            "argv": list(argv), "cwd": os.getcwd(), "config": config, "env": env,
            "cases": [], "records": [], "summary": [], "ratios": []}


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.gpus = resolve_gpus(args.gpus)
    env = collect_env(args.gpus)
    report = new_report(args, argv, env)
    for line in format_machine(env):
        log(line)
    contenders = [CONTENDERS[name](args) for name in args.contenders]
    paths = None
    try:
        for dtype in args.dtypes:
            for size in args.sizes:
                run_problem(args, dtype, size, args.gpus, contenders, report)
                paths = write_outputs(report, args.out)
    except KeyboardInterrupt:
        log("interrupted: writing what was measured")
    finally:
        for c in contenders:
            try:
                c.close()
            except Exception as e:
                log(f"closing {c.name}: {_describe(e)}")
        paths = write_outputs(report, args.out)
    print(format_text_report(report))
    print(f"\nwrote {paths[0]}\n      {paths[1]}")
    return 1 if any(r.status == "WRONG" for r in report["summary"]) else 0


if __name__ == "__main__":
    sys.exit(main())
