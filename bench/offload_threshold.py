"""Where does blasx start beating numpy? The measurement behind blasx.offload's default threshold.

    python -m bench.offload_threshold                      # default devices, float64, 32..2048
    python -m bench.offload_threshold --devices cpu --dtypes d,s --runs 5
    python -m bench.offload_threshold --devices cuda --sizes 256,512,1024,2048,4096,8192

For each square size N it times numpy's own ``a @ b`` and ``blasx.matmul(a, b)`` on the same
host arrays (best of ``--runs`` after one untimed warm-up call each, the two interleaved),
checks blasx's result, and prints the ratio. The crossover is the flop count 2 N^3 (8 N^3
for complex types) of the smallest N from which blasx is faster at every measured size; the
offload threshold should be set there (``blasx.offload(threshold=...)``,
``$BLASX_OFFLOAD_THRESHOLD``, or ``DEFAULT_THRESHOLDS`` in blasx/offload.py per device kind).
"""

from __future__ import annotations

import argparse
import math
import platform
import time

import numpy as np

DTYPES = {"s": np.float32, "d": np.float64, "c": np.complex64, "z": np.complex128}
DEFAULT_SIZES = (32, 64, 128, 256, 512, 1024, 2048)


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
        rows.append({"n": n, "flops": flops(n, dtype), "numpy_s": t_np, "blasx_s": t_bx,
                     "speedup": t_np / t_bx, "rel_err": err})
    return rows


def crossover(rows: list[dict]) -> float:
    """Flops of the smallest size from which blasx wins at every larger measured size (inf: never)."""
    best = math.inf
    for row in reversed(rows):
        if row["speedup"] > 1.0:
            best = row["flops"]
        else:
            break
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default=None, help="blasx devices spec (default: blasx's default: all GPUs, else cpu)")
    p.add_argument("--tile", type=int, default=None, help="blasx tile size (default: chosen per call)")
    p.add_argument("--dtypes", default="d", help="comma list of s,d,c,z (default d)")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma list of N")
    p.add_argument("--runs", type=int, default=3, help="timed runs per contender and size (x4 below N=512)")
    args = p.parse_args(argv)

    import blasx
    import threadpoolctl

    blasx.configure(devices=args.devices, tile=args.tile)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    eng = blasx.engine()
    devices = ", ".join(d.name for d in eng.devices)
    blas = threadpoolctl.threadpool_info()
    blas_txt = ", ".join(f"{i.get('internal_api')} {i.get('version')} x{i.get('num_threads')}" for i in blas
                         if i.get("user_api") == "blas")
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, numpy {np.__version__} "
          f"({blas_txt}), blasx devices: {devices}")
    try:
        for code in args.dtypes.split(","):
            dtype = DTYPES[code.strip()]
            rows = measure(sizes, dtype, args.runs)
            print(f"\n{np.dtype(dtype).name}:")
            print(f"{'N':>6} {'flops':>10} {'numpy ms':>10} {'blasx ms':>10} {'speedup':>8} {'rel err':>9}")
            for r in rows:
                print(f"{r['n']:>6} {r['flops']:>10.3g} {r['numpy_s'] * 1e3:>10.3f} {r['blasx_s'] * 1e3:>10.3f} "
                      f"{r['speedup']:>8.2f} {r['rel_err']:>9.1e}")
            x = crossover(rows)
            if math.isinf(x):
                print(f"crossover ({np.dtype(dtype).name}): blasx never wins at these sizes -> threshold inf")
            else:
                print(f"crossover ({np.dtype(dtype).name}): blasx wins from {x:.3g} flops on")
    finally:
        blasx.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
