"""Level-3 routines at N=32768 on the GPUs beside DGEMM, under several knob settings, in one process.

    python -m bench.scripts.level3_knobs_ab [--n 32768] [--runs 2] \
        [--cases gemm,trsm,trsm@trsm_inverse=0,trmm,syrk] [--tile 4096] [--streams 4]

A case is ``ROUTINE`` or ``ROUTINE@KNOBS`` (``BLASX_KNOBS`` syntax, ``+`` between knobs); TRMM
takes ``trmm%ORDER[:norot][@KNOBS]`` too (``plans.trmm_order``'s orders, e.g. ``trmm%blocks``;
``:norot``: the gemm steps of every task in k order, not rotated per device). Knobs
read per call or step (``LIVE_KNOBS``) are switched on the running engine; others get a new
engine for the case. Registered host arrays, double,
upper / no transpose / left / non-unit, alpha 1.5, beta 0.5 (gemm, syrk); TRSM and TRMM in place
(``overwrite_b``, B restored untimed before each run). Cases alternate run by run after one
warm-up round; each timed run prints TFLOPS (GEMM 2n^3, SYRK n^3 + n^2, TRSM/TRMM n^3), the ratio
to the best GEMM so far, and the per-device busy / unoverlapped comm / idle of its profile.
The first round is untimed: it warms every case and checks its result on 64 sampled rows
against float64 numpy.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

FLOPS = {"gemm": lambda n: 2.0 * n ** 3, "syrk": lambda n: float(n) ** 3 + n * n,
         "trsm": lambda n: float(n) ** 3, "trmm": lambda n: float(n) ** 3}


def parse_case(text: str) -> tuple[str, str]:
    routine, _, knobs = text.partition("@")
    routine = routine.partition("%")[0]
    if routine not in FLOPS:
        raise SystemExit(f"--cases: got {text!r}; routines: {sorted(FLOPS)}")
    return routine, knobs.replace("+", ",")


#: Knobs read per call or per step, which a running engine may change between calls; any other
#: knob is read by the workers when they start and needs a new engine.
LIVE_KNOBS = {"trsm_inverse", "block_order", "commit_steps", "invmm_new_block"}


def use_knobs(blasx, text: str, tile, streams=None) -> None:
    """Run the next calls under the knobs ``text``: on the running engine when they differ from
    its own in LIVE_KNOBS only, else on a new one (its first call then opens the devices, ~70 ms:
    each case's first round is untimed)."""
    from blasx.runtime.knobs import Knobs
    knobs = Knobs.from_env(text)
    os.environ["BLASX_KNOBS"] = text
    cur = blasx.session.settings()
    eng = blasx.session.engine() if (cur.tile, cur.streams) == (tile, streams) else None
    if eng is None or any(getattr(knobs, k) != getattr(eng.config.knobs, k) for k in vars(knobs)
                          if k not in LIVE_KNOBS):
        blasx.configure(tile=tile, streams=streams)
        eng = blasx.session.engine()
    eng.config.knobs = knobs
    for d in eng.devices:
        d.knobs = knobs


def use_trmm_order(order: str) -> None:
    """Plan the next TRMM calls with ``order`` (``plans.trmm_order``; None: blasx's own planner)."""
    import functools

    from blasx import blas3
    from blasx.runtime import plans
    if order is None:
        blas3.plan_trmm = plans.plan_trmm
        return
    order, _, flag = order.partition(":")
    if flag not in ("", "norot"):
        raise SystemExit(f"--cases: got trmm%{order}:{flag}; allowed: trmm%ORDER or trmm%ORDER:norot")

    def plan(*args, **kw):
        tasks = plans.plan_trmm(*args, **{**kw, "order": order})
        for t in tasks:  # norot: the gemm steps in k order on every device, as before rotation
            t.rotatable = t.rotatable and flag != "norot"
        return tasks
    blas3.plan_trmm = plan


def breakdown(profile) -> str:
    rows = profile.summary()["devices"] if profile is not None else []
    return "  ".join(f"dev{r['device']} busy {r['busy'] * 1e3:5.1f} comm {r['comm'] * 1e3:5.1f} "
                     f"idle {r['idle'] * 1e3:5.1f} ms" for r in rows)


#: (time, station owner, "push" | "pop" | "steal", task id) of every station operation, when
#: --trace is given (``log_stations``): when each task entered and left which station.
STATION_LOG: list = []


def log_stations() -> None:
    """Record every push / pop_best / steal of the reservation stations in STATION_LOG (a wrapper
    around the class's methods, for this process only: a diagnostic)."""
    from blasx.runtime import station
    cls = station.ReservationStation
    clock = time.perf_counter

    def wrap(name):
        orig = getattr(cls, name)

        def method(self, *args, **kw):
            out = orig(self, *args, **kw)
            task = args[0] if name == "push" else out
            if task is not None and hasattr(task, "tid"):
                STATION_LOG.append((clock(), self.owner, name, task.tid))
            return out
        setattr(cls, name, method)
    for name in ("push", "pop_best", "steal"):
        wrap(name)


def save_profile(profile, path: str) -> None:
    """The profile's window, devices, counters, records (OpRecord fields, one list per record)
    and the station operations of its window (STATION_LOG) as gzipped JSON: the input of
    bench/scripts/trace_study.py."""
    import dataclasses
    import gzip
    import json
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fields = [f.name for f in dataclasses.fields(profile.records[0])] if profile.records else []
    doc = {"start": profile.start, "finish": profile.finish, "devices": [str(d) for d in profile.devices],
           "fields": fields, "records": [[getattr(r, f) for f in fields] for r in profile.records],
           "counters": {str(k): v for k, v in profile.counters.items()},
           "stations": [e for e in STATION_LOG if profile.start - 0.01 <= e[0] <= profile.finish + 0.01]}
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--cases", default="gemm,trsm,trsm@trsm_inverse=0,trmm,syrk")
    ap.add_argument("--tile", type=int, default=None)
    ap.add_argument("--streams", type=int, default=None, help="streams per GPU (configure's; default blasx's)")
    ap.add_argument("--trace", metavar="DIR", default=None,
                    help="write each case's last timed profile there (records as JSON, gzip) for offline study")
    args = ap.parse_args(argv)
    import blasx
    from bench.cublasxt import registered
    from bench.level3 import check, make_arrays, parallel_copy, run_blasx, sample_rows

    n = args.n
    cases = [parse_case(c) for c in args.cases.split(",")]
    if args.trace:
        log_stations()
    a, b0, c0, c = make_arrays(n, "d")  # as bench.level3: A well conditioned for TRSM
    b = np.empty_like(b0, order="F")
    rows = sample_rows(n)
    best: dict[str, float] = {}
    old_knobs = os.environ.get("BLASX_KNOBS")
    try:
        with registered(a, b, c):
            for run in range(args.runs + 1):
                for text, (routine, knobs) in zip(args.cases.split(","), cases):
                    use_knobs(blasx, knobs, args.tile, args.streams or blasx.session.DEFAULT_STREAMS)
                    use_trmm_order(text.partition("@")[0].partition("%")[2] or "auto")
                    parallel_copy(b, b0)
                    parallel_copy(c, c0)
                    t0 = time.perf_counter()
                    if routine == "gemm":  # b is read only: a GEMM of A and B
                        run_blasx(blasx, "d", routine, n, a, b, c0, c, 1.5, 0.5)
                    else:
                        run_blasx(blasx, "d", routine, n, a, b, c0, c if routine == "syrk" else b, 1.5, 0.5)
                    dt = time.perf_counter() - t0
                    prof = blasx.last_profile()
                    if not run:
                        out = c if routine in ("gemm", "syrk") else b
                        err = check(routine, a, b0, c0, out, 1.5, 0.5, rows)
                        print(f"check {text}: rel err {err:.1e}", flush=True)
                        continue
                    best[text] = min(best.get(text, dt), dt)
                    if args.trace and prof is not None:
                        save_profile(prof, os.path.join(args.trace, f"{text.replace('@', '_')}-run{run}.json.gz"))
                    tf = FLOPS[routine](n) / dt / 1e12
                    ratio = (FLOPS["gemm"](n) / best["gemm"]) if "gemm" in best else None
                    print(f"run {run} {text:>24}: {dt:.4f} s {tf:6.1f} TFLOPS"
                          f"{f' ({tf * 1e12 / ratio:.3f} of GEMM)' if ratio else ''}  {breakdown(prof)}", flush=True)
    finally:
        use_trmm_order(None)
        if old_knobs is None:
            os.environ.pop("BLASX_KNOBS", None)
        else:
            os.environ["BLASX_KNOBS"] = old_knobs
        blasx.shutdown()
    g = best.get("gemm")
    for text, dt in best.items():
        routine = parse_case(text)[0]
        tf = FLOPS[routine](n) / dt / 1e12
        rel = f"  {tf / (FLOPS['gemm'](n) / g / 1e12):.3f} of GEMM" if g else ""
        print(f"best {text:>24}: {dt:.4f} s {tf:6.1f} TFLOPS{rel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
