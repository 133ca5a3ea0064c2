"""Do two GPUs split the tiles they both need at a call's start? A/B in the 2-GPU sim, one process.

    python -m bench.scripts.start_order_ab_sim --cases trmm,gemm --n 32768 --repeats 3 [--variants base,rev,split]

Variants: ``base``, blasx as it is (each device starts a rotatable task's gemm steps at its own
share of k, so the two devices' first host loads differ); ``rev``, devices of odd rank also fill
their streams from the last, so the tasks they interleave are issued (and their tiles loaded) in
the reverse order of an even-rank device's; ``norot``, no rotation; ``split``, ``norot`` +
``rev`` (both devices at the same k, loading the shared tiles from opposite ends and reading the
rest from the peer). Prints each run and the medians (TFLOPS, comm ms per GPU). A PREDICTION, NOT
A MEASUREMENT: bench.level3_sim's model of 2 H200s, which reproduces the measured start within a
few percent per 10 ms bin (bench/results/NOTES.md, tenth session).
"""

from __future__ import annotations

import argparse
import statistics

from blasx.runtime import worker as W

from .. import level3_sim as L

VARIANTS = ("base", "rev", "norot", "split")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="trmm,gemm")
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="base,rev,split")
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        raise SystemExit(f"--variants: got {args.variants!r}; allowed (comma list): {', '.join(VARIANTS)}")
    mode = {"v": "base"}
    plan_case, assign = L.plan_case, W.StreamWorker.assign

    def planned(*a, **k):
        tasks, slots = plan_case(*a, **k)
        if mode["v"] in ("norot", "split"):
            for t in tasks:
                t.rotatable = False
        return tasks, slots

    def reversed_assign(self):
        if mode["v"] not in ("rev", "split") or self.rank % 2 == 0:
            return assign(self)
        self.slots.reverse()  # assign fills the free slots from the last
        try:
            assign(self)
        finally:
            self.slots.reverse()

    model = L.sim_model()
    cases = L.parse_cases(args.cases)
    res: dict = {}
    L.plan_case, W.StreamWorker.assign = planned, reversed_assign
    try:
        for _ in range(args.repeats):
            for c in cases:
                for v in variants:
                    mode["v"] = v
                    r = L.run_one(c, args.n, 2, 4096, model, L.DEFAULT_KRATE, 8.0)
                    res.setdefault((c, v), []).append(r)
                    print(f"{c:6s} {v:6s} {r['tflops']:6.1f} TFLOPS comm {r['comm'] * 1e3:5.1f} "
                          f"idle {r['idle'] * 1e3:5.1f} ms", flush=True)
    finally:
        L.plan_case, W.StreamWorker.assign = plan_case, assign
    print(f"N={args.n}: medians of {args.repeats}, TFLOPS and comm ms per GPU")
    for c in cases:
        print(f"{c:6s} " + "  ".join(f"{v} {statistics.median(x['tflops'] for x in res[(c, v)]):.1f} comm "
                                    f"{statistics.median(x['comm'] for x in res[(c, v)]) * 1e3:.1f}"
                                    for v in variants))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
