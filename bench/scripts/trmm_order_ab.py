"""In-place DTRMM at N=32768 on the GPUs: task order and write-back rule, A/B in one process.

    python -m bench.scripts.trmm_order_ab [--n 32768] [--runs 3] [--variants levels,wave,wave:fin]

A variant is ``ORDER`` (``plans.trmm_order``: levels, wave, ...) with the write-after-read gates
of ``Task.war`` (a tile is overwritten once its readers' kernels are done), or ``ORDER:fin`` with
the rule before them (once its readers have *finished*, their own write-backs included).
Registered host arrays (left, upper, no transpose, alpha 1.5, overwrite_b); the variants alternate
run by run; B is restored (untimed) before each run; TFLOPS of n^3. Each timed run prints the
per-device busy / unoverlapped comm / idle of its blasx profile.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def parse_variant(text: str) -> tuple[str, bool]:
    order, _, rule = text.partition(":")
    if rule not in ("", "fin"):
        raise SystemExit(f"--variants: got {text!r}; allowed: ORDER or ORDER:fin")
    return order, rule == ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--variants", "--orders", dest="variants", default="levels,wave,wave:fin")
    args = ap.parse_args(argv)
    import blasx
    from blasx import blas3
    from bench.cublasxt import registered
    from bench.scripts.level3_knobs_ab import breakdown

    n = args.n
    rng = np.random.default_rng(0)
    a = np.asfortranarray(rng.standard_normal((n, n)) / np.sqrt(n))
    b0 = np.asfortranarray(rng.standard_normal((n, n)))
    b = b0.copy(order="F")
    orig = blas3.plan_trmm

    def planner(order, war):
        def plan(*p, **k):
            tasks = orig(*p, **{**k, "order": order})
            for t in tasks:
                t.war = t.war and war
            return tasks
        return plan

    best = {}
    variants = args.variants.split(",")
    try:
        with registered(a, b):
            for run in range(args.runs + 1):
                for v in variants:
                    blas3.plan_trmm = planner(*parse_variant(v))
                    np.copyto(b, b0)
                    t0 = time.perf_counter()
                    blasx.dtrmm(1.5, a, b, overwrite_b=True)
                    dt = time.perf_counter() - t0
                    if run:
                        best[v] = min(best.get(v, dt), dt)
                        print(f"run {run} {v:>10}: {dt:.4f} s {n ** 3 / dt / 1e12:6.1f} TFLOPS  "
                              f"{breakdown(blasx.last_profile())}", flush=True)
    finally:
        blas3.plan_trmm = orig
    for v, dt in best.items():
        print(f"best {v:>10}: {dt:.4f} s {n ** 3 / dt / 1e12:6.1f} TFLOPS")
    blasx.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
