"""Level-3 routines at N=32768 on the GPUs beside DGEMM, under several knob settings, in one process.

    python -m bench.scripts.level3_knobs_ab [--n 32768] [--runs 2] \
        [--cases gemm,trsm,trsm@trsm_inverse=0,trmm,syrk] [--tile 4096]

A case is ``ROUTINE`` or ``ROUTINE@KNOBS`` (``BLASX_KNOBS`` syntax, ``+`` between knobs). Knobs
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
    if routine not in FLOPS:
        raise SystemExit(f"--cases: got {text!r}; routines: {sorted(FLOPS)}")
    return routine, knobs.replace("+", ",")


#: Knobs read per call or per step, which a running engine may change between calls; any other
#: knob is read by the workers when they start and needs a new engine.
LIVE_KNOBS = {"trsm_inverse", "block_order"}


def use_knobs(blasx, text: str, tile) -> None:
    """Run the next calls under the knobs ``text``: on the running engine when they differ from
    its own in LIVE_KNOBS only, else on a new one (its first call then opens the devices, ~70 ms:
    each case's first round is untimed)."""
    from blasx.runtime.knobs import Knobs
    knobs = Knobs.from_env(text)
    os.environ["BLASX_KNOBS"] = text
    eng = blasx.session.engine() if blasx.session.settings().tile == tile else None
    if eng is None or any(getattr(knobs, k) != getattr(eng.config.knobs, k) for k in vars(knobs)
                          if k not in LIVE_KNOBS):
        blasx.configure(tile=tile)
        eng = blasx.session.engine()
    eng.config.knobs = knobs
    for d in eng.devices:
        d.knobs = knobs


def breakdown(profile) -> str:
    rows = profile.summary()["devices"] if profile is not None else []
    return "  ".join(f"dev{r['device']} busy {r['busy'] * 1e3:5.1f} comm {r['comm'] * 1e3:5.1f} "
                     f"idle {r['idle'] * 1e3:5.1f} ms" for r in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--cases", default="gemm,trsm,trsm@trsm_inverse=0,trmm,syrk")
    ap.add_argument("--tile", type=int, default=None)
    args = ap.parse_args(argv)
    import blasx
    from bench.cublasxt import registered
    from bench.level3 import check, make_arrays, parallel_copy, run_blasx, sample_rows

    n = args.n
    cases = [parse_case(c) for c in args.cases.split(",")]
    a, b0, c0, c = make_arrays(n, "d")  # as bench.level3: A well conditioned for TRSM
    b = np.empty_like(b0, order="F")
    rows = sample_rows(n)
    best: dict[str, float] = {}
    old_knobs = os.environ.get("BLASX_KNOBS")
    try:
        with registered(a, b, c):
            for run in range(args.runs + 1):
                for text, (routine, knobs) in zip(args.cases.split(","), cases):
                    use_knobs(blasx, knobs, args.tile)
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
                    tf = FLOPS[routine](n) / dt / 1e12
                    ratio = (FLOPS["gemm"](n) / best["gemm"]) if "gemm" in best else None
                    print(f"run {run} {text:>24}: {dt:.4f} s {tf:6.1f} TFLOPS"
                          f"{f' ({tf * 1e12 / ratio:.3f} of GEMM)' if ratio else ''}  {breakdown(prof)}", flush=True)
    finally:
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
