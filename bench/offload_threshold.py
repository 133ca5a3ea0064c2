"""Where does blasx start beating numpy? The measurement behind blasx.offload's default threshold.

    python -m bench.offload_threshold                      # default devices, float64, 32..2048
    python -m bench.offload_threshold --devices cpu --dtypes d,s --runs 5
    python -m bench.offload_threshold --devices cuda --sizes 256,512,1024,2048,4096,8192
    python -m bench.offload_threshold --offload --dtypes s,d,c,z --rounds 40

For each square size N it times numpy's own ``a @ b`` and ``blasx.matmul(a, b)`` on the same
host arrays (best of ``--runs`` after one untimed warm-up call each, the two interleaved),
checks blasx's result, and prints the ratio. The crossover is the flop count 2 N^3 (8 N^3
for complex types) of the smallest N from which blasx is faster at every measured size; the
offload threshold should be set there (``blasx.offload(threshold=...)``,
``$BLASX_OFFLOAD_THRESHOLD``, or ``DEFAULT_THRESHOLDS`` in blasx/offload.py per device kind).

``--offload`` measures the other side: what offload costs the calls it leaves alone. For each
size (16..512 by default) it times ``a @ b``, ``np.dot(a, b)`` and ``scipy.linalg.blas.?gemm(1.0,
a, b)`` outside offload and inside ``blasx.offload(threshold=--threshold)`` (default 1e15 flops:
above every size, and finite, so that the wrappers work out their size bound), interleaved
(rounds alternate which side goes first; one timing runs ``number`` calls, calibrated to
``--target-ms``), and reports per call the best and median time of each side, their ratios, and
the median of the per-round ratios ("paired": the two timings of a round are next to each other
in time, so drift and one lucky timing matter least; the 5% verdict uses it).
It checks that nothing was offloaded and that both sides give the same result. Each round also
times the outside once more (the six orders of the three timings in turn, ``ORDERS``): ``noise``
is the median over the rounds of |outside again / outside - 1|, how far apart two back-to-back
timings of the very same numpy / scipy call typically are, and each row's verdict says whether
offload's paired cost is within it ("noise"), above it ("SLOWER") or below minus it ("faster").
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import platform
import shlex
import statistics
import sys
import time
import timeit

import numpy as np

from blasx.precision import tolerance

DTYPES = {"s": np.float32, "d": np.float64, "c": np.complex64, "z": np.complex128}
# the six orders of three timings in a round (ours, the peer, the peer again): each is first, second
# and last equally often (also bench.cpu_overhead's)
ORDERS = ((0, 1, 2), (1, 2, 0), (2, 0, 1), (0, 2, 1), (2, 1, 0), (1, 0, 2))
DEFAULT_SIZES = (32, 64, 128, 256, 512, 1024, 2048)
OFFLOAD_SIZES = (16, 32, 64, 128, 256, 512)


def flops(n: int, dtype) -> float:
    return (8.0 if np.dtype(dtype).kind == "c" else 2.0) * n ** 3


def best_time(fn, runs: int) -> float:
    best = math.inf
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(sizes, dtype, runs: int) -> list[dict]:
    import blasx

    rng = np.random.default_rng(0)
    rows = []
    for n in sizes:
        a = rng.standard_normal((n, n)).astype(dtype)
        b = rng.standard_normal((n, n)).astype(dtype)
        if np.dtype(dtype).kind == "c":
            a = a + 1j * rng.standard_normal((n, n)).astype(dtype)
            b = b + 1j * rng.standard_normal((n, n)).astype(dtype)
        ref = a @ b  # warm-up, and the reference
        got = blasx.matmul(a, b)  # warm-up: starts the engine, fills caches
        err = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300))
        # interleave the contenders so that drifts (clock, other load) hit both alike
        reps = max(1, runs if n >= 512 else runs * 4)
        t_np, t_bx = math.inf, math.inf
        for _ in range(reps):
            t_np = min(t_np, best_time(lambda: a @ b, 1))
            t_bx = min(t_bx, best_time(lambda: blasx.matmul(a, b), 1))
        got = blasx.matmul(a, b)  # (a call after the timed ones checked too: the engine's steady state)
        err = max(err, float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300)))
        tol = 2 * tolerance(dtype, n)  # (both sides round: twice one gemm's bound against the exact product)
        rows.append({"n": n, "flops": flops(n, dtype), "numpy_s": t_np, "blasx_s": t_bx,
                     "speedup": t_np / t_bx, "rel_err": err, "tolerance": tol, "ok": bool(err <= tol)})
    return rows


def _operands(n: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    if np.dtype(dtype).kind == "c":
        a = a + 1j * rng.standard_normal((n, n)).astype(dtype)
        b = b + 1j * rng.standard_normal((n, n)).astype(dtype)
    return a, b


def offload_calls(a, b, matmul: bool = True) -> dict:
    """The unmodified calls offload may redirect. Attributes are looked up at each call, so inside
    offload they reach its replacements (numpy's matmul loops, numpy.dot, scipy's ?gemm)."""
    import scipy.linalg.blas as spblas
    gemm = {"f": "sgemm", "d": "dgemm", "F": "cgemm", "D": "zgemm"}[a.dtype.char]
    calls = {"a @ b": lambda: a @ b} if matmul else {}
    return {**calls, "np.dot": lambda: np.dot(a, b), f"scipy {gemm}": lambda: getattr(spblas, gemm)(1.0, a, b)}


def measure_offload(sizes, dtype, rounds: int, threshold: float, target_s: float, matmul: bool = True) -> list[dict]:
    """Per size and call: best and median per-call time outside and inside blasx.offload(threshold)."""
    import importlib

    import blasx
    off = importlib.import_module("blasx.offload")  # the module (blasx.offload is the context manager)

    rows = []
    for n in sizes:
        a, b = _operands(n, dtype)
        calls = offload_calls(a, b, matmul)
        outside = {name: fn() for name, fn in calls.items()}
        with blasx.offload(threshold=threshold, matmul=matmul):
            before = off.offload_stats()
            inside = {name: fn() for name, fn in calls.items()}
        for name in calls:
            if not np.array_equal(inside[name], outside[name]):
                raise AssertionError(f"{name}, N={n}: the result inside offload differs from the one outside")
        number = {name: max(1, int(target_s / max(timeit.Timer(fn).timeit(3) / 3, 1e-9))) for name, fn in calls.items()}
        sides = ("in", "out", "again")  # "again": outside once more, the A/A pair of "out"
        times = {(name, side): [] for name in calls for side in sides}

        def time_side(side):
            for name, fn in calls.items():
                times[(name, side)].append(timeit.Timer(fn).timeit(number[name]) / number[name])

        for r in range(rounds):
            for side in (sides[i] for i in ORDERS[r % len(ORDERS)]):
                if side == "in":
                    with blasx.offload(threshold=threshold, matmul=matmul):
                        time_side("in")
                else:
                    time_side(side)
        after = off.offload_stats()
        moved = {k: after[k] - before[k] for k in ("matmul", "dot", "scipy")}
        if any(moved.values()):
            raise AssertionError(f"N={n}: calls below the threshold were offloaded: {moved}")
        for name in calls:
            t_out, t_in, t_again = times[(name, "out")], times[(name, "in")], times[(name, "again")]
            rows.append({"n": n, "call": name, "number": number[name],
                         "out_best": min(t_out), "out_med": statistics.median(t_out),
                         "in_best": min(t_in), "in_med": statistics.median(t_in),
                         "ratio_best": min(t_in) / min(t_out),
                         "ratio_med": statistics.median(t_in) / statistics.median(t_out),
                         # each round's two timings are next to each other in time: the median of
                         # their ratios is the least sensitive to drift and to one lucky timing
                         "ratio_pair": statistics.median(i / o for i, o in zip(t_in, t_out)),
                         "noise": statistics.median(abs(g / o - 1.0) for g, o in zip(t_again, t_out))})
    return rows


def verdict(ratio_pair: float, noise: float) -> str:
    """'SLOWER' when the paired ratio exceeds 1 + noise, 'faster' when it is below 1 - noise, else 'noise'."""
    return "SLOWER" if ratio_pair - 1.0 > noise else "faster" if 1.0 - ratio_pair > noise else "noise"


def print_offload(rows: list[dict], dtype) -> None:
    print(f"\n{np.dtype(dtype).name} (per-call us; ratio = inside / outside):")
    print(f"{'N':>5} {'call':<12} {'out best':>9} {'out med':>9} {'in best':>9} {'in med':>9} "
          f"{'ratio best':>10} {'ratio med':>9} {'paired':>7} {'noise':>6} {'verdict':>7}")
    for r in rows:
        print(f"{r['n']:>5} {r['call']:<12} {r['out_best'] * 1e6:>9.2f} {r['out_med'] * 1e6:>9.2f} "
              f"{r['in_best'] * 1e6:>9.2f} {r['in_med'] * 1e6:>9.2f} {r['ratio_best']:>10.3f} {r['ratio_med']:>9.3f} "
              f"{r['ratio_pair']:>7.3f} {r['noise']:>6.3f} {verdict(r['ratio_pair'], r['noise']):>7}")
    name = np.dtype(dtype).name
    worst_best = max(rows, key=lambda r: r["ratio_best"])
    worst = max(rows, key=lambda r: r["ratio_pair"])
    print(f"worst best-ratio ({name}): {worst_best['ratio_best']:.3f} ({worst_best['call']}, N={worst_best['n']}); "
          f"worst paired ratio: {worst['ratio_pair']:.3f} ({worst['call']}, N={worst['n']}); "
          f"within 5% (paired): {'yes' if worst['ratio_pair'] <= 1.05 else 'NO'}; "
          f"beyond the noise: {sum(verdict(r['ratio_pair'], r['noise']) == 'SLOWER' for r in rows)} of {len(rows)}")


def _offload_mode(args, sizes) -> int:
    import threadpoolctl

    from blasx.offload import matmul_available

    threads = ", ".join(f"{i.get('version')} x{i.get('num_threads')}" for i in threadpoolctl.threadpool_info()
                        if i.get("user_api") == "blas")
    ext = matmul_available()
    print(f"# offload: C extension blasx._matmul_loops: {'yes' if ext else 'no (a @ b not measured)'}; "
          f"threshold inside {args.threshold:g} flops; {args.rounds} rounds, {args.target_ms} ms a timing; "
          f"BLAS threads while timing: {threads}")
    for code in args.dtypes.split(","):
        dtype = DTYPES[code.strip()]
        print_offload(measure_offload(sizes, dtype, args.rounds, args.threshold, args.target_ms / 1e3, ext), dtype)
    return 0


def crossover(rows: list[dict]) -> float:
    """Flops of the smallest size from which blasx wins at every larger measured size (inf: never)."""
    best = math.inf
    for row in reversed(rows):
        if row["speedup"] > 1.0:
            best = row["flops"]
        else:
            break
    return best


def add_blas_threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blas-threads", type=int, default=None,
                   help="limit every BLAS library (numpy's and scipy's) to this many threads while timing "
                        "(default: as they are). On a 2-core VM, numpy's and scipy's OpenBLAS each keep 2 threads "
                        "spinning after a call, and calls that alternate between the two libraries then take "
                        "ms instead of us from N ~ 64 on: 1 gives repeatable timings")


def blas_thread_limits(threads: int | None):
    """A context limiting every BLAS library to ``threads`` (None or 0: left as they are)."""
    import threadpoolctl
    return threadpoolctl.threadpool_limits(threads, user_api="blas") if threads else contextlib.nullcontext()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", default=None, help="blasx devices spec (default: blasx's default: all GPUs, else cpu)")
    p.add_argument("--tile", type=int, default=None, help="blasx tile size (default: chosen per call)")
    p.add_argument("--dtypes", default="d", help="comma list of s,d,c,z (default d)")
    p.add_argument("--sizes", default=None, help=f"comma list of N (default {','.join(map(str, DEFAULT_SIZES))}; "
                                                  f"with --offload {','.join(map(str, OFFLOAD_SIZES))})")
    p.add_argument("--runs", type=int, default=3, help="timed runs per contender and size (x4 below N=512)")
    p.add_argument("--offload", action="store_true",
                   help="instead: time a @ b, np.dot and scipy ?gemm below the threshold inside blasx.offload() "
                        "against the same calls outside it")
    p.add_argument("--threshold", type=float, default=1e15, help="--offload: the threshold inside the block "
                   "(default 1e15 flops: above every size, finite so that the wrappers work out their bound)")
    p.add_argument("--rounds", type=int, default=30, help="--offload: interleaved rounds per size (default 30)")
    p.add_argument("--target-ms", type=float, default=2.0, help="--offload: length of one timing in ms (default 2)")
    add_blas_threads_option(p)
    args = p.parse_args(argv)
    if args.sizes is None:
        args.sizes = ",".join(map(str, OFFLOAD_SIZES if args.offload else DEFAULT_SIZES))

    import blasx
    import threadpoolctl

    blasx.configure(devices=args.devices, tile=args.tile)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    eng = blasx.engine()
    devices = ", ".join(d.name for d in eng.devices)
    blas = threadpoolctl.threadpool_info()
    blas_txt = ", ".join(f"{i.get('internal_api')} {i.get('version')} x{i.get('num_threads')}" for i in blas
                         if i.get("user_api") == "blas")
    print(f"# command: python -m bench.offload_threshold {shlex.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, numpy {np.__version__} "
          f"({blas_txt}), blasx devices: {devices}")
    limits = blas_thread_limits(args.blas_threads)
    try:
        with limits:
            if args.offload:
                return _offload_mode(args, sizes)
            return _threshold_mode(args, sizes)
    finally:
        blasx.shutdown()


def _threshold_mode(args, sizes) -> int:
    """The timing table per dtype, each blasx result checked against numpy's: 1 (WRONG printed) if one is off."""
    wrong = 0
    for code in args.dtypes.split(","):
        dtype = DTYPES[code.strip()]
        rows = measure(sizes, dtype, args.runs)
        print(f"\n{np.dtype(dtype).name}:")
        print(f"{'N':>6} {'flops':>10} {'numpy ms':>10} {'blasx ms':>10} {'speedup':>8} {'rel err':>9} check")
        for r in rows:
            print(f"{r['n']:>6} {r['flops']:>10.3g} {r['numpy_s'] * 1e3:>10.3f} {r['blasx_s'] * 1e3:>10.3f} "
                  f"{r['speedup']:>8.2f} {r['rel_err']:>9.1e} {'ok' if r['ok'] else 'WRONG'}")
            wrong += not r["ok"]
        x = crossover(rows)
        if math.isinf(x):
            print(f"crossover ({np.dtype(dtype).name}): blasx never wins at these sizes -> threshold inf")
        else:
            print(f"crossover ({np.dtype(dtype).name}): blasx wins from {x:.3g} flops on")
    if wrong:
        print(f"WRONG: {wrong} result(s) off numpy's by more than the tolerance", file=sys.stderr)
    return 1 if wrong else 0

if __name__ == "__main__":
    raise SystemExit(main())
