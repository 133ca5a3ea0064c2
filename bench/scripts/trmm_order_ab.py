"""In-place DTRMM at N=32768 on the GPUs, task order A/B in one process (levels vs wave).

    python -m bench.scripts.trmm_order_ab [--n 32768] [--runs 3]

Registered host arrays (left, upper, no transpose, alpha 1.5, overwrite_b); the orders alternate
run by run (``plans.trmm_order``); B is restored (untimed) before each run; TFLOPS of n^3.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--orders", default="levels,wave")
    args = ap.parse_args(argv)
    import blasx
    from blasx import blas3
    from bench.cublasxt import registered

    n = args.n
    rng = np.random.default_rng(0)
    a = np.asfortranarray(rng.standard_normal((n, n)) / np.sqrt(n))
    b0 = np.asfortranarray(rng.standard_normal((n, n)))
    b = b0.copy(order="F")
    orig = blas3.plan_trmm
    best = {}
    with registered(a, b):
        for run in range(args.runs + 1):
            for order in args.orders.split(","):
                blas3.plan_trmm = lambda *p, _o=order, **k: orig(*p, **{**k, "order": _o})
                np.copyto(b, b0)
                t0 = time.perf_counter()
                blasx.dtrmm(1.5, a, b, overwrite_b=True)
                dt = time.perf_counter() - t0
                if run:
                    best[order] = min(best.get(order, dt), dt)
                    print(f"run {run} {order:>6}: {dt:.4f} s {n ** 3 / dt / 1e12:6.1f} TFLOPS", flush=True)
    blas3.plan_trmm = orig
    for order, dt in best.items():
        print(f"best {order:>6}: {dt:.4f} s {n ** 3 / dt / 1e12:6.1f} TFLOPS")
    blasx.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
