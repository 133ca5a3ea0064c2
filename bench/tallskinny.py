"""Tall-skinny GEMM from host memory: C = X^T X with X n x 1024, against the host-link bound.

    python -m bench.tallskinny --n 10000000 --dtypes d,s            # every GPU found, both host modes
    python -m bench.tallskinny --n 1000000,4000000 --devices cuda:0,1 --modes registered --runs 3
    python -m bench.tallskinny --devices sim:2 --n 4096 --cols 64 --out /tmp/r   # CPU: sims, no bound

X is a numpy array in host memory (C order: one row per sample, ``--order F`` for column-major),
far larger than the output: the GEMM's k dimension is n, so the engine's split-k spreads it over
the GPUs and reduces the partial C tiles. ``blasx.gemm(1, X, X, trans_a=1)`` (``--blasx-kw``
passes keywords such as split=4) is timed by the wall clock, in ``registered`` mode (X page-locked
before timing) and ``pageable`` mode (blasx's own registrations released before every run). The
host-link bound is X crossing the host links once at the H2D rate measured in the same run
(bench.gemm_lp.link_rates: each GPU alone and all together) and C coming back; the goal is
blasx within 1.2x of it. The peer is CuPy on the first GPU with its copies: X in row chunks on
two streams (one chunk's copy beside the other's GEMM), partial C summed on the GPU. Every result
is checked on a sampled block of C against float64 on the CPU (all n rows).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import statistics
import sys
import time

import numpy as np

from blasx.runtime import dtypes

from . import gemm_lp
from .level3 import parse_dtypes, parse_positive_list
from .level3_check import random_matrix
from .machine import machine_name
from .result_files import command_line, utc_stamp, write_json_md

GOAL = 1.2  # the issue's goal: blasx within 1.2x of the host-link bound
MODES = ("registered", "pageable")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.tallskinny", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--n", default="1000000", help="rows of X, comma list (default 1000000; the issue's case: 10000000)")
    p.add_argument("--cols", type=int, default=1024, help="columns of X (default 1024)")
    p.add_argument("--dtypes", default="d,s", help="comma list of d, s (default d,s)")
    p.add_argument("--order", choices=("C", "F"), default="C", help="X's memory order (default C)")
    p.add_argument("--devices", default="cuda", help="blasx devices: cuda (every GPU, default), cuda:0,1, sim:N")
    p.add_argument("--modes", default="registered,pageable", help="comma list of registered, pageable")
    p.add_argument("--runs", type=int, default=3, help="timed runs per contender and mode (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--check", type=int, default=64, help="sampled block of C checked: CHECK x CHECK (default 64)")
    p.add_argument("--chunk-rows", type=int, default=1 << 18, help="CuPy peer: rows per chunk (default 262144)")
    p.add_argument("--no-cupy", action="store_true", help="skip the CuPy peer")
    p.add_argument("--cache-gib", type=float, default=None,
                   help="blasx tile cache per GPU (default: half the free memory, leaving room for the CuPy peer)")
    p.add_argument("--blasx-kw", default="", help="keywords for blasx.gemm, NAME=INT comma list (e.g. split=4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="", help="name part of the output files: tallskinny-TAG-STAMP")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="directory of the .json and .md")
    p.add_argument("--quiet", action="store_true")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.n = parse_positive_list(args.n, "--n")
        args.dtypes = parse_dtypes(args.dtypes, "--dtypes", allowed=("d", "s"))
        args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if not args.modes or any(m not in MODES for m in args.modes):
            raise ValueError(f"--modes: got {','.join(args.modes)!r}; allowed: {', '.join(MODES)}")
        for name in ("cols", "runs", "check", "chunk_rows"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: got {getattr(args, name)}; need an int >= 1")
        if args.warmup < 0:
            raise ValueError(f"--warmup: got {args.warmup}; need an int >= 0")
        args.gpu = args.devices.startswith("cuda")
        if not (args.gpu or args.devices.startswith("sim")):
            raise ValueError(f"--devices: got {args.devices!r}; allowed: cuda, cuda:IDS, sim:N[,...]")
        args.kw = {}
        for item in filter(None, (x.strip() for x in args.blasx_kw.split(","))):
            name, eq, value = item.partition("=")
            if not eq or not name.isidentifier() or not value.lstrip("-").isdigit():
                raise ValueError(f"--blasx-kw: got {item!r}; expected NAME=INT")
            args.kw[name] = int(value)
    except (ValueError, argparse.ArgumentTypeError) as e:
        p.error(str(e))
    args.check = min(args.check, args.cols)
    return args


def gpu_ids(devices: str) -> list[int]:
    """The CUDA device ids of a blasx spec ('cuda': every one found); [] for sims."""
    if not devices.startswith("cuda"):
        return []
    ids = devices.partition(":")[2]
    if ids:
        return [int(i) for i in ids.split(",") if i.strip()]
    import cupy
    return list(range(cupy.cuda.runtime.getDeviceCount()))


def cache_bytes(gpus: list, gib: float | None) -> int | None:
    """blasx's tile cache per GPU: ``gib``, else half the smallest free memory (None on sims)."""
    if not gpus:
        return None
    if gib:
        return int(gib * 2**30)
    import cupy
    free = []
    for g in gpus:
        with cupy.cuda.Device(g):
            cupy.get_default_memory_pool().free_all_blocks()  # what link_rates held
            free.append(cupy.cuda.runtime.memGetInfo()[0])
    return min(free) // 2


def make_x(n: int, cols: int, dtype: str, order: str, seed: int) -> np.ndarray:
    """Standard normal X (n x cols) in ``order``, drawn in parallel without a float64 copy."""
    dt = dtypes.BY_PREFIX[dtype].dtype
    if order == "F":
        return random_matrix(n, cols, dt, [seed, n])
    return random_matrix(cols, n, dt, [seed, n]).T  # C order: the transpose of an F-ordered matrix


def sample_block(cols: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two sorted samples of ``size`` columns (the block C[ia, ib]), each with column 0 and the last."""
    rng = np.random.default_rng(seed)

    def pick():
        inner = rng.choice(np.arange(1, cols - 1), max(0, min(size, cols) - 2), replace=False)
        return np.unique(np.r_[0, inner, cols - 1])
    return pick(), pick()


def block_error(got: np.ndarray, ref: np.ndarray, off: np.ndarray) -> float:
    """The larger of the block's relative error and that of its entries off C's diagonal (``off``)."""
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    if off.any():
        err = max(err, float(np.linalg.norm((got - ref)[off]) / np.linalg.norm(ref[off])))
    return err


def reference_block(x: np.ndarray, ia, ib, rows: int = 1 << 16) -> np.ndarray:
    """float64 X[:, ia]^T X[:, ib] over every row, by row chunks on a thread pool."""
    spans = [(r, min(x.shape[0], r + rows)) for r in range(0, x.shape[0], rows)]

    def part(span):
        block = x[span[0]:span[1]]
        return block[:, ia].astype(np.float64).T @ block[:, ib].astype(np.float64)
    with concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as ex:
        return sum(ex.map(part, spans))


def cupy_xtx(x: np.ndarray, device: int, chunk_rows: int) -> np.ndarray:
    """X^T X on one GPU with CuPy: row chunks copied in on two streams, partial C summed there."""
    import cupy
    from cupy.cuda import runtime
    n, cols = x.shape
    item = x.itemsize
    with cupy.cuda.Device(device):
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
        parts = [cupy.zeros((cols, cols), x.dtype) for _ in range(2)]
        order = "C" if x.flags.c_contiguous else "F"
        bufs = [cupy.empty((min(n, chunk_rows), cols), x.dtype, order=order) for _ in range(2)]
        for i, r0 in enumerate(range(0, n, chunk_rows)):
            j, rows = i % 2, min(n, r0 + chunk_rows) - r0
            with streams[j]:
                buf = bufs[j] if rows == bufs[j].shape[0] else cupy.empty((rows, cols), x.dtype, order=order)
                if x.flags.c_contiguous:
                    runtime.memcpyAsync(buf.data.ptr, x.ctypes.data + r0 * cols * item, rows * cols * item,
                                        runtime.memcpyHostToDevice, streams[j].ptr)
                else:  # F order: one strided piece per column
                    runtime.memcpy2DAsync(buf.data.ptr, rows * item, x.ctypes.data + r0 * item, n * item, rows * item,
                                          cols, runtime.memcpyHostToDevice, streams[j].ptr)
                parts[j] += buf.T @ buf
        for s in streams:
            s.synchronize()
        return cupy.asnumpy(parts[0] + parts[1])


def _release(x) -> None:
    with contextlib.suppress(ImportError):
        from blasx.runtime.hostmem import REGISTRY
        REGISTRY.release(x)


def _hold(mode: str, x, gpu: bool):
    if mode != "registered" or not gpu:
        return contextlib.nullcontext()
    from .cublasxt import registered
    return registered(x)


def timed(fn, warmup: int, runs: int, before=None) -> tuple[list, object]:
    for _ in range(warmup):
        if before:
            before()
        fn()
    times, out = [], None
    for _ in range(runs):
        if before:
            before()
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return times, out


def traffic(blasx, before=None) -> dict:
    """Bytes over the host links and between GPUs in blasx's last call, and its task count ({}
    when the last profile is still ``before``: no call reached the engine)."""
    prof = blasx.last_profile()
    if prof is None or prof is before:
        return {}
    t = prof.summary()["totals"]
    return {"h2d_bytes": t.get("bytes_h2d"), "d2h_bytes": t.get("bytes_d2h"), "p2p_bytes": t.get("bytes_p2p"),
            "tasks": t.get("tasks")}


def run_case(args, blasx, dtype: str, n: int, rates: dict, gpus: list, log) -> list[dict]:
    cols = args.cols
    t = time.perf_counter()
    x = make_x(n, cols, dtype, args.order, args.seed)
    made = time.perf_counter() - t
    ia, ib = sample_block(cols, args.check, args.seed)
    ref = reference_block(x, ia, ib)
    off = ia[:, None] != ib[None, :]  # (X^T X's diagonal, ~n each, would hide the ~sqrt(n) entries off it)
    from .gemm_problem import tolerance
    tol = tolerance(dtype, n)
    c_bytes = cols * cols * x.itemsize
    bound = gemm_lp.link_bound(rates, x.nbytes, c_bytes)
    base = {"dtype": dtype, "n": n, "cols": cols, "order": args.order, "x_gib": x.nbytes / 2**30,
            "flops": 2.0 * cols * cols * n, "tolerance": tol, "bound": bound, "generate_s": made}
    if bound:
        log(gemm_lp.format_bound({"dtype": dtype, "n": n, "link_bound": bound}, None))
    contenders = [("blasx", lambda: blasx.gemm(1.0, x, x, trans_a=1, **args.kw))]
    if args.gpu and not args.no_cupy:
        contenders.append(("cupy", lambda: cupy_xtx(x, gpus[0], args.chunk_rows)))
    rows = []
    for mode in args.modes:
        try:
            with _hold(mode, x, args.gpu):
                for who, fn in contenders:
                    before = (lambda: _release(x)) if mode == "pageable" and who == "blasx" else None
                    row = dict(base, mode=mode, who=who, pinned=args.gpu and mode == "registered")
                    try:
                        times, c = timed(fn, args.warmup, args.runs, before)
                        err = block_error(np.asarray(c)[np.ix_(ia, ib)], ref, off)
                        row.update(median_s=statistics.median(times), best_s=min(times), times=times, rel_err=err,
                                   status="ok" if err <= tol else "FAIL")
                    except Exception as e:  # noqa: BLE001 - reported, the run goes on
                        row.update(median_s=None, best_s=None, rel_err=None, status="ERROR",
                                   error=f"{type(e).__name__}: {e}"[:300])
                    if who == "blasx" and row["status"] != "ERROR":
                        row.update(traffic(blasx))
                    s = row["median_s"]
                    row["tflops"] = row["flops"] / s / 1e12 if s else None
                    row["gb_s"] = x.nbytes / s / 1e9 if s else None
                    row["of_bound"] = s / bound["seconds"] if s and bound else None
                    rows.append(row)
                    log(line(row))
        finally:
            _release(x)
    del x
    return rows


def line(r: dict) -> str:
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    return (f"{r['dtype']} n={r['n']} {r['mode']:<10} {r['who']:<5} {f(r['median_s'], '.4f')} s "
            f"{f(r['tflops'], '.2f')} TFLOPS {f(r['gb_s'], '.1f')} GB/s of X, {f(r['of_bound'], '.2f')}x the bound, "
            f"err {f(r['rel_err'], '.1e')} {r['status']}" + (f" {r['error']}" if r.get("error") else ""))


def markdown(doc: dict) -> str:
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    rates = doc.get("link_rates") or {}
    lines = [f"# Tall-skinny X^T X from host memory: {doc['machine']}, {doc['date']}", "", "```", doc["command"], "```", "",
             f"blasx devices `{doc['devices']}`, X n x {doc['cols']} ({doc['order']} order); median of {doc['runs']} "
             f"after {doc['warmup']} warm-up(s); blasx.gemm keywords {doc['blasx_kw'] or 'none'}. Measured H2D GB/s per "
             f"GPU: {', '.join(f'{r / 1e9:.1f}' for r in rates.get('h2d', [])) or '-'}, all together: "
             f"{f(rates.get('h2d_together') and rates['h2d_together'] / 1e9, '.1f')}.", "",
             "| dtype | n | X GiB | host memory | contender | median s | TFLOPS | GB/s of X | bound s | of bound "
             "| goal 1.2x | H2D / X | tasks | rel err | check |",
             "| :-- | --: | --: | :-- | :-- | --: | --: | --: | --: | --: | :-- | --: | --: | :-- | :-- |"]
    for r in doc["rows"]:
        b = r["bound"]
        h2d = r["h2d_bytes"] / (r["x_gib"] * 2**30) if r.get("h2d_bytes") else None
        goal = "-" if r["who"] != "blasx" or not r["of_bound"] else ("met" if r["of_bound"] <= GOAL else "NOT met")
        lines.append(f"| {r['dtype']} | {r['n']} | {r['x_gib']:.2f} | {r['mode']} | {r['who']} | {f(r['median_s'], '.4f')} | "
                     f"{f(r['tflops'], '.2f')} | {f(r['gb_s'], '.1f')} | {f(b and b['seconds'], '.4f')} | "
                     f"{f(r['of_bound'], '.2f')} | {goal} | {f(h2d, '.2f')} | {r.get('tasks') or '-'} | "
                     f"{f(r['rel_err'], '.1e')} | {r['status']} |")
    errors = [f"- {r['dtype']} n={r['n']} {r['mode']} {r['who']}: {r['error']}" for r in doc["rows"] if r.get("error")]
    lines += ["", "bound: X's bytes over the measured aggregate H2D rate (the smaller of the GPUs' sum and all "
              "copying together), or C's over D2H if longer; of bound: median / bound. cupy: one GPU, X in row "
              "chunks on two streams. H2D / X: bytes blasx copied in over X's bytes (1: X crossed once), tasks: its "
              "task count, both of the last run. rel err: the sampled block of C against float64 over all rows.", ""]
    return "\n".join(lines + (["## Errors", "", *errors, ""] if errors else []))


def main(argv=None) -> int:
    args = parse_args(argv)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))  # noqa: E731
    import blasx
    gpus = gpu_ids(args.devices)
    rates = gemm_lp.link_rates(gpus) if gpus else {}
    stamp, date = utc_stamp()
    blasx.configure(devices=args.devices, cache_bytes=cache_bytes(gpus, args.cache_gib))
    rows = []
    try:
        for dtype in args.dtypes:
            for n in args.n:
                rows += run_case(args, blasx, dtype, n, rates, gpus, log)
    finally:
        blasx.shutdown()
    doc = {"kind": "tallskinny", "stamp": stamp, "date": date, "command": command_line("bench.tallskinny", argv),
           "machine": machine_name() if args.gpu else f"{args.devices} (CPU)", "devices": args.devices,
           "cols": args.cols, "order": args.order, "runs": args.runs, "warmup": args.warmup, "blasx_kw": args.kw,
           "link_rates": rates, "rows": rows}
    base = os.path.join(args.out, "tallskinny-" + (f"{args.tag}-" if args.tag else "") + stamp)
    for path in write_json_md(base, doc, markdown(doc)):
        log(f"wrote {path}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
