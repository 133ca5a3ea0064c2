"""The steal rule, A/B in the 2-GPU sim (timing mode, bench.level3_sim's model), in one process.

    python -m bench.scripts.steal_rule_ab_sim [--speeds 1/1.06] [--n 32768] [--repeats 3] [--cases gemm,trsm]

``engine``: blasx's rule (a worker whose station is empty steals the newest task of the most
loaded station that it can run, whether or not it can start it now). ``start-now``: it steals
only a ready task it can start at once (below its cap of tasks in flight and within
``Knobs.commit_steps``), which ends the back-and-forth of a call's last tasks between two full
stations seen on 2 H200s, but leaves the tail's tasks to whichever device frees a stream first.
Cases alternate run by run; prints each run and the medians (TFLOPS, ratio to the same rule's
GEMM, idle ms per GPU, steals per call).
A PREDICTION, NOT A MEASUREMENT.
"""

from __future__ import annotations

import argparse
import statistics

from blasx.runtime import worker as W
from blasx.runtime.station import most_loaded

from .. import level3_sim as L

CASES = ("gemm", "syrk", "syr2k", "trsm", "trmm")  # the default --cases


def start_now_steal(self) -> None:
    """The variant: steal only a ready task this stream worker can start at once."""
    victim = most_loaded(self.engine.stations_for(self), self.idx)
    if victim is None:
        return
    t = victim.steal(lambda task: self.engine.can_run(self, task.call) and self._may_steal(task)
                     and self.ready(task) and self.inflight < self.max_inflight
                     and self._within_horizon(task, self.committed()))
    if t is not None:
        self.station.push(t)
        t.call.stats.count(self.idx, "steals")


def _use(fn) -> None:
    """Make ``fn`` the stream workers' steal method (None: the engine's own again)."""
    if fn is None:
        if "_steal" in vars(W.StreamWorker):
            del W.StreamWorker._steal
    else:
        W.StreamWorker._steal = fn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speeds", default="", help="per-GPU slowdowns joined by '/', e.g. 1/1.06 (level3_sim's)")
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES), help="comma list (bench.level3_sim's cases)")
    args = ap.parse_args(argv)
    cases = L.parse_cases(args.cases)
    model = L.sim_model()
    rules = {"engine": None, "start-now": start_now_steal}  # None: the engine's own (inherited) method
    res: dict = {}
    try:
        for _ in range(args.repeats):
            for c in cases:
                for name, fn in rules.items():
                    _use(fn)
                    r = L.run_one(c, args.n, 2, 4096, model, L.DEFAULT_KRATE, 8.0, args.speeds)
                    steals = sum(d["steals"] for d in r["devices"])
                    res.setdefault((c, name), []).append((r["tflops"], r["idle"] * 1e3, steals))
                    print(f"{c:6s} {name:9s} {r['tflops']:6.1f} TFLOPS idle {r['idle'] * 1e3:5.1f} ms "
                          f"steals {steals}", flush=True)
    finally:
        _use(None)
    med = lambda c, name, i: statistics.median(x[i] for x in res[(c, name)])  # noqa: E731
    print(f"speeds={args.speeds or 'even'} N={args.n}: medians, TFLOPS (ratio to the rule's GEMM), idle, steals")
    for name in rules:
        g = med("gemm", name, 0)
        print(f"{name:9s} " + "  ".join(f"{c} {med(c, name, 0):.1f} ({med(c, name, 0) / g:.3f}) idle "
                                       f"{med(c, name, 1):.1f} steals {med(c, name, 2):.0f}" for c in cases))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
