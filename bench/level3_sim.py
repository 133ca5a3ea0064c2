"""Level-3 routines on 2 simulated H200s (timing mode), each beside DGEMM in the same run.

    python -m bench.level3_sim --out bench/results            # ~1.5 min on a 2-core machine
    python -m bench.level3_sim --n 32768 --cases gemm,trmm:levels,trmm:wave --krate none

A PREDICTION, NOT A MEASUREMENT. The routine's own planner (``runtime/plans.py``) makes the
tasks, on operands that do not exist (``Operand`` objects with ``array=None``, fake addresses),
and the real scheduler runs them on ``sim:G,timing=1`` devices with the 2x H200 cost model of
``bench/scaling_sim.py`` (``fitted`` variant: 59 TFLOPS per GPU, host links at 45 GB/s each way,
P2P 396 GB/s, a heap sized as the cuda backend sizes it, 25 us per launch, dilation 8), the
configuration that bench.level3 measures on the real GPUs: double, alpha 1.5, beta 0.5, upper,
left side, no transpose, non-unit diagonal, registered host arrays, TRMM and TRSM in place
(``overwrite_b=True``: slot 2 is B itself).

Cases (``--cases``): ``gemm``, ``symm``, ``syrk``, ``syr2k``, ``trsm`` (in place), ``trmm``
(in place, the planner's default order), ``trsm-blocked`` (in place, diagonal tiles solved by
the blocked trsm kernel instead of the inverses' tasks), ``trmm:ORDER`` (in place, an order that
``runtime.plans.trmm_order`` takes: ``levels``, ``wave``, ``lines2``, ...), ``trmm-oop`` (out of
place, into a separate C). Rates use bench.level3's flop counts (GEMM, SYMM, SYR2K 2N^3; SYRK,
TRMM, TRSM N^3), and every case is also given as a ratio to the GEMM of the same N in the same
run. ``--gpus`` changes the number of simulated GPUs (the model stays one H200's). Any case
may end in ``@KNOBS`` (``syrk@commit_steps=0``; ``+`` between knobs): its engine runs with those
``runtime.knobs.Knobs``, so an A/B of a scheduling choice runs round robin in one process
(compare ``gemm@...`` with ``gemm`` for the knob's cost on GEMM itself). ``--speeds 1/1.06``
slows the second GPU by 6% (kernels and copies): two GPUs of one model differ run to run (on
H200s, 52-60 TFLOPS sustained, dips to 43), which the demand-driven balance absorbs except in
what each GPU has already committed when the queues run dry.

Per-kernel rates (``--krate``, the sim's ``krate=`` option): a factor of the GEMM rate for a
tile kernel. Measured on H200 inside level-3 calls
(``bench/results/l3-kernel-rates-h200x2-20261122/README.md``): GEMM steps 60 TFLOPS, the 4096
DTRMM diagonal step 54 (factor 0.9), DTRSM 21 (0.35) with one cuBLAS call, 23.5 (0.39) with the
recursive blocking the cuda backend runs now; with TRSM's inverses
(``bench/results/tri-inverse-rate-h200x2-20261123.log``) the 4096 inversion 3.2 ms, i.e. 7.2
TFLOPS of its n^3/3 flops (``trtri`` 0.12), and the diagonal multiply as the cuda backend runs
it on host operands (out of place into a fresh heap block, ``Knobs.invmm_new_block``) 54.1
(``invmm`` 0.9; ``tri-inverse-rate-h200x1-20261123-copyback.log``; with the copy back of the
knob's off setting 48.0, 0.8). Default: ``trmm:0.9/trsm:0.39/invmm:0.9/trtri:0.12`` (as measured);
``--krate none``: every kernel at the GEMM rate, as scaling_sim.

Repeats run round robin over the cases (all cases once, then again), so a busy spell of this
host hits every case alike; a run whose kernels took over 5% more than their modelled time is
run again (as scaling_sim). Tables show the median run and the TFLOPS range.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import statistics
import sys
import time

import numpy as np

from blasx import operands as _operands
from blasx.dispatch import block_shape
from blasx.runtime.call import Call, Operand
from blasx.runtime.config import parse_krate
from blasx.runtime.knobs import Knobs
from blasx.runtime.plans import inverse_shape, plan_symm, plan_syr2k, plan_syrk, plan_trmm, plan_trsm, trmm_order
from blasx.runtime.stats import CallStats, DeviceInfo
from blasx.runtime.switching import SwitchInterval
from blasx.runtime.plans import plan_gemm
from blasx.runtime.tiling import OP_N

from .scaling_sim import (FITTED_LINK, MAX_INFLATION, MODEL, RETRIES, Model, _ints, cuda_heap_bytes, retried,
                          spec_for, submit_on_sims, write_report)

PREDICTION = ("PREDICTION, NOT A MEASUREMENT: simulated GPUs (blasx `sim` backend, data-free timing mode) "
              "with the cost model fitted to the 2x H200 GEMM measurement; no GPU was used.")

#: flops of each routine in units of N^3 (bench.level3's counts)
FLOPS = {"gemm": 2, "symm": 2, "syrk": 1, "syr2k": 2, "trmm": 1, "trsm": 1}
ALPHA, BETA = 1.5, 0.5
UPPER, LEFT, NONUNIT = 0, 0, 0
BASE_CASES = ("gemm", "symm", "syrk", "syr2k", "trmm", "trmm-oop", "trsm", "trsm-blocked")
DEFAULT_CASES = "gemm,symm,syrk,syr2k,trmm,trsm"
#: tile-kernel rates / the GEMM step rate, measured in level-3 calls on H200 (see the module docstring)
DEFAULT_KRATE = "trmm:0.9/trsm:0.39/invmm:0.9/trtri:0.12"


def parse_cases(text: str) -> list[str]:
    """'gemm,trmm:wave' -> ['gemm', 'trmm:wave']; gemm is added first when missing (the ratio's base)."""
    cases = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [c for c in cases if (base_of(c) not in BASE_CASES and not _is_trmm_order(base_of(c)))
           or not _knobs_ok(c)]
    if bad or not cases:
        raise SystemExit(f"--cases: got {text!r}; allowed (comma list): {', '.join(BASE_CASES)}, or trmm:ORDER "
                         f"with ORDER one of auto, levels, wave[S], lines[Q], work[Q], bands[B] "
                         f"(runtime.plans.trmm_order); any of them may end in @KNOBS, e.g. syrk@commit_steps=0 "
                         f"(runtime.knobs.Knobs, '+' between knobs: the engine of that case runs with them)")
    return cases if "gemm" in cases else ["gemm"] + cases


def base_of(case: str) -> str:
    """'syrk@commit_steps=0' -> 'syrk'."""
    return case.partition("@")[0]


def knobs_of(case: str) -> str:
    """'syrk@commit_steps=0+late_c=0' -> 'commit_steps=0,late_c=0' (BLASX_KNOBS' syntax)."""
    return case.partition("@")[2].replace("+", ",")


def _knobs_ok(case: str) -> bool:
    try:
        Knobs.from_env(knobs_of(case))
    except ValueError:
        return False
    return True


def _is_trmm_order(case: str) -> bool:
    name, _, order = case.partition(":")
    if name != "trmm" or not order:
        return False
    try:
        trmm_order(4, 4, 1, LEFT, UPPER, OP_N, order)
    except ValueError:
        return False
    return True


def routine_of(case: str) -> str:
    return base_of(case).split(":")[0].removesuffix("-oop").removesuffix("-blocked")


def plan_case(case: str, n: int, tile: int, block: tuple[int, int]) -> tuple[list, list[int]]:
    """(tasks, operand slot -> operand index) of ``case`` on N x N operands; in-place cases map
    their output slot to B's operand."""
    case = base_of(case)
    r = routine_of(case)
    if r == "gemm":
        return plan_gemm(n, n, n, tile, OP_N, OP_N, beta_zero=False, block=block), [0, 1, 2]
    if r == "symm":
        return plan_symm(n, n, tile, LEFT, UPPER, beta_zero=False, block=block), [0, 1, 2]
    if r == "syrk":
        return plan_syrk(n, n, tile, OP_N, UPPER, beta_zero=False, block=block), [0, 2]
    if r == "syr2k":
        return plan_syr2k(n, n, tile, OP_N, UPPER, beta_zero=False, block=block), [0, 1, 2]
    if r == "trsm":  # in place; with the inverses of the diagonal blocks (operand 3) unless -blocked
        inverse = case == "trsm"
        return plan_trsm(n, n, tile, LEFT, UPPER, OP_N, NONUNIT, inverse=inverse), [0, 1, 1] + [3] * inverse
    if case == "trmm-oop":
        return plan_trmm(n, n, tile, LEFT, UPPER, OP_N, NONUNIT, block=block), [0, 1, 2]
    kw = {"order": case.split(":")[1]} if ":" in case else {}
    return plan_trmm(n, n, tile, LEFT, UPPER, OP_N, NONUNIT, block=block, in_place=True, **kw), [0, 1, 1]


def sim_model(link: float = FITTED_LINK, issue: float = MODEL.issue) -> Model:
    """The 2x H200 cost model these runs use (``bench/scaling_sim.py``'s fitted one), with this
    bench's alpha / beta; ``link``: H2D = D2H bytes/s per GPU, ``issue``: seconds per launch."""
    return Model(rate=MODEL.rate, h2d=link, d2h=link, p2p=MODEL.p2p, gpu_mem=MODEL.gpu_mem,
                 streams=MODEL.streams, alpha=ALPHA, beta=BETA, issue=issue)


def run_once(case: str, n: int, gpus: int, tile: int, model: Model, krate: str, dilate: float,
             speeds: str = "") -> dict:
    """One simulated call of ``case`` on a fresh engine of ``gpus`` timing sims; times undilated."""
    dtype = np.dtype(np.float64)
    heap = cuda_heap_bytes(model.gpu_mem)
    spec = (spec_for(gpus, "d", model, heap, dilate, "independent") + (f",krate={krate}" if krate else "")
            + (f",speeds={speeds}" if speeds else ""))

    def make_call(eng, devs):
        tasks, slots = plan_case(case, n, tile, block_shape(eng))
        base = next(_operands._call_bases)
        # fake, distinct addresses: never dereferenced; an in-place output is B's operand itself
        # (the same token, so the cache and the write-after-read rules see one array)
        shapes = [(n, n)] * 3 + [inverse_shape(n, tile)]  # A, B, C; TRSM's inverses
        made = [Operand(None, r, c, r, (1 + i) << 44, -1, (base - 1000 * i, r, c, r, dtype.str, tile))
                for i, (r, c) in enumerate(shapes)]
        ops = [made[i] for i in slots]
        stats = CallStats([DeviceInfo(d.index, d.name, d.kind) for d in devs], keep_records=True)
        call = Call(routine_of(case), ops, tasks, dtype, ALPHA, BETA, stats)  # TRMM/TRSM plans read no beta
        call.tile = tile
        return call

    old_knobs = os.environ.get("BLASX_KNOBS")
    if "@" in case:  # this case's engine runs with its own knobs (read from the environment)
        os.environ["BLASX_KNOBS"] = knobs_of(case)
    try:
        devs, call, sim_wall = submit_on_sims(spec, model.streams, make_call)
    finally:
        if old_knobs is None:
            os.environ.pop("BLASX_KNOBS", None)
        else:
            os.environ["BLASX_KNOBS"] = old_knobs
    if call.error is not None:
        raise call.error
    stats, tasks = call.stats, call.tasks
    prof = stats.profile()
    flops = FLOPS[routine_of(case)] * float(n) ** 3
    wall = prof.wall / dilate
    per = []
    for b in prof.breakdown():
        recs = [r for r in prof.records if r.device == b.device and r.kind == "kernel"]
        c = b.counters
        per.append({"device": b.name, "tasks": b.tasks, "busy": b.busy / dilate, "comm": b.comm / dilate,
                    "idle": b.idle / dilate,
                    "first_kernel": (min(r.start for r in recs) - prof.start) / dilate if recs else None,
                    "after_last_kernel": (prof.finish - max(r.end for r in recs)) / dilate if recs else None,
                    "bytes_h2d": c["bytes_h2d"], "bytes_d2h": c["bytes_d2h"], "bytes_p2p": c["bytes_p2p"],
                    "l2_hits": c["l2_hits"], "misses": c["misses"], "steals": c["steals"]})
    # the kernels' cost-model time, per GPU: what busy would be with no host disturbance
    ideal_busy = sum(devs[0].model.kernel_time(call.step_flops(st), st.kernel)
                     for t in tasks for st in t.steps) / gpus / dilate
    mean = lambda k: statistics.fmean(p[k] for p in per)  # noqa: E731
    return {"case": case, "n": n, "gpus": gpus, "tile": tile, "time": wall, "tflops": flops / wall / 1e12,
            "sim_wall_s": sim_wall, "busy": mean("busy"), "comm": mean("comm"), "idle": mean("idle"),
            "first_kernel": mean("first_kernel"), "after_last_kernel": mean("after_last_kernel"),
            "ideal_busy": ideal_busy, "busy_inflation": mean("busy") / ideal_busy, "devices": per}


def run_one(case, n, gpus, tile, model, krate, dilate, speeds="") -> dict:
    """``run_once``, retried while the host disturbed it (scaling_sim.retried)."""
    return retried(lambda: run_once(case, n, gpus, tile, model, krate, dilate, speeds))


def aggregate(runs: list[dict]) -> dict:
    """The median run's figures (upper median), with the TFLOPS range of all runs."""
    med = sorted(runs, key=lambda r: r["time"])[len(runs) // 2]
    out = {k: med[k] for k in ("case", "n", "gpus", "tile", "time", "tflops", "busy", "comm", "idle",
                               "first_kernel", "after_last_kernel", "ideal_busy", "busy_inflation")}
    tf = sorted(r["tflops"] for r in runs)
    out.update(tflops_min=tf[0], tflops_max=tf[-1], tflops_all=[r["tflops"] for r in runs], runs=len(runs),
               h2d_per_gpu=statistics.fmean(d["bytes_h2d"] for d in med["devices"]),
               d2h_per_gpu=statistics.fmean(d["bytes_d2h"] for d in med["devices"]),
               p2p_per_gpu=statistics.fmean(d["bytes_p2p"] for d in med["devices"]))
    return out


def markdown(doc: dict) -> str:
    L = [f"# Level 3 beside DGEMM on {doc['gpus']} simulated H200s (timing mode): {doc['stamp']}", "",
         f"**{PREDICTION}**", "", "```", doc["command"], "```", "",
         f"Model: `{doc['spec_example']}` (the `fitted` variant of bench/scaling_sim.py: "
         f"{doc['rate'] / 1e12:g} TFLOPS per GPU, host links {doc['link'] / 1e9:g} GB/s each way, "
         f"P2P {doc['p2p'] / 1e9:g} GB/s, heap {doc['heap_bytes'] / 1e9:.1f} GB per GPU, "
         f"{doc['issue'] * 1e6:g} us per launch, dilation {doc['dilate']:g}); per-kernel rate factors: "
         f"{doc['krate'] or 'none (every kernel at the GEMM rate)'}; per-GPU slowdowns: "
         f"{doc.get('speeds') or 'none'}. Double, alpha {ALPHA}, beta {BETA} "
         f"(GEMM, SYMM, SYRK, SYR2K), upper, left, no transpose, non-unit; TRMM and TRSM in place "
         f"unless `-oop`. Tile {doc['tile']}, {doc['streams']} streams, knobs {doc['knobs']}. "
         f"{doc['repeats']} run(s) per case, round robin.", "",
         "time / TFLOPS: median run; range: all runs; ratio: median TFLOPS / the same run's DGEMM median; "
         "busy / comm / idle: per-GPU mean of the median run, ms (comm: copies not under a kernel); ideal: "
         "the kernels' cost-model time per GPU; first: first kernel's start; tail: last kernel's end to "
         "the call's end (ms); H2D / D2H / P2P: GB per GPU.", "",
         "| N | case | time ms | TFLOPS | range | ratio | busy | comm | idle | ideal | first | tail | "
         "H2D | D2H | P2P | inflation |",
         "| --: | :-- | --: | --: | :-- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |"]
    for p in doc["points"]:
        ms = lambda x: f"{x * 1e3:.1f}"  # noqa: E731
        gb = lambda x: f"{x / 1e9:.2f}"  # noqa: E731
        star = " *" if p["busy_inflation"] > MAX_INFLATION else ""
        L.append(f"| {p['n']} | {p['case']} | {ms(p['time'])} | {p['tflops']:.1f} | "
                 f"{p['tflops_min']:.1f}-{p['tflops_max']:.1f} | {p['ratio']:.3f} | {ms(p['busy'])} | "
                 f"{ms(p['comm'])} | {ms(p['idle'])} | {ms(p['ideal_busy'])} | {ms(p['first_kernel'])} | "
                 f"{ms(p['after_last_kernel'])} | {gb(p['h2d_per_gpu'])} | {gb(p['d2h_per_gpu'])} | "
                 f"{gb(p['p2p_per_gpu'])} | {p['busy_inflation']:.3f}{star} |")
    if any(p["busy_inflation"] > MAX_INFLATION for p in doc["points"]):
        L += ["", f"`*`: the median run's kernels took over {MAX_INFLATION:g}x their model time after "
              f"{RETRIES} retries (this host was busy): its TFLOPS are low by up to that much."]
    L += ["", f"Host: {doc['host']['machine']}, {doc['host']['cpus']} CPUs, python {doc['host']['python']}; "
          f"the run took {doc['elapsed_s']:.0f} s.", ""]
    return "\n".join(L)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.level3_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="16384,32768", help="matrix sizes N (every operand N x N)")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma list (see the module docstring); gemm is "
                    "always run, as the ratio's base")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--tile", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3, help="runs per case and N")
    ap.add_argument("--krate", default=DEFAULT_KRATE,
                    help=f"per-kernel rate factors (sim krate=), default {DEFAULT_KRATE}; 'none': all at the GEMM rate")
    ap.add_argument("--speeds", default="",
                    help="per-GPU slowdown factors joined by '/', e.g. 1/1.06 (one GPU's clock 6%% lower: GPUs "
                         "of one model differ run to run); default: all alike")
    ap.add_argument("--link", type=float, default=FITTED_LINK, help="H2D = D2H bytes/s per GPU")
    ap.add_argument("--dilate", type=float, default=8.0, help="time dilation factor (>= 1)")
    ap.add_argument("--issue", type=float, default=MODEL.issue, help="host seconds per kernel/copy launch")
    ap.add_argument("--switch-interval", type=float, default=1e-4, help="sys.setswitchinterval for the run")
    ap.add_argument("--tag", default="", help="name part of the output files: level3-sim-TAG-STAMP")
    ap.add_argument("--out", default=None, help="directory for level3-sim-[TAG-]STAMP.{json,md}")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    ns = _ints(args.n, "n")
    cases = parse_cases(args.cases)
    if args.gpus < 1:
        raise SystemExit(f"--gpus: got {args.gpus}, need >= 1")
    if args.tile < 1 or args.repeats < 1:
        raise SystemExit(f"--tile / --repeats: got {args.tile} / {args.repeats}, need ints >= 1")
    if args.krate == "none":
        args.krate = ""
    if args.krate:
        try:
            parse_krate(args.krate)
        except ValueError:
            raise SystemExit(f"--krate: got {args.krate!r}; expected KERNEL:FACTOR pairs joined by '/', "
                             f"factors > 0, e.g. trmm:0.9/trsm:0.35") from None
    if args.speeds:
        try:
            factors = [float(x) for x in args.speeds.split("/")]
        except ValueError:
            factors = []
        if len(factors) != args.gpus or not all(f >= 1 for f in factors):
            raise SystemExit(f"--speeds: got {args.speeds!r}; expected {args.gpus} factors >= 1 joined by '/', "
                             f"one per GPU, e.g. {'/'.join(['1'] * (args.gpus - 1) + ['1.06'])}")
    if not args.dilate >= 1:
        raise SystemExit(f"--dilate: got {args.dilate}, need a number >= 1")
    if not args.link > 0:
        raise SystemExit(f"--link: got {args.link}, need bytes/s > 0")
    if args.tag and not args.tag.replace("-", "").replace("_", "").isalnum():
        raise SystemExit(f"--tag: got {args.tag!r}; letters, digits, '-' and '_' only")
    model = sim_model(args.link, args.issue)

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, flush=True)

    t_start = time.perf_counter()
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    runs: dict = {(n, c): [] for n in ns for c in cases}
    with SwitchInterval(args.switch_interval):  # put back afterwards, even on errors
        for n in ns:
            for rep in range(args.repeats):
                for c in cases:
                    r = run_one(c, n, args.gpus, args.tile, model, args.krate, args.dilate, args.speeds)
                    runs[(n, c)].append(r)
                    log(f"N={n:6d} {c:14s} run {rep + 1}: {r['tflops']:6.1f} TFLOPS  busy {r['busy'] * 1e3:6.1f} "
                        f"comm {r['comm'] * 1e3:5.1f} idle {r['idle'] * 1e3:5.1f} ms  ({r['sim_wall_s']:.1f} s)")
    points = []
    for n in ns:
        gemm = aggregate(runs[(n, "gemm")])
        for c in cases:
            p = aggregate(runs[(n, c)])
            p["ratio"] = p["tflops"] / gemm["tflops"]
            points.append(p)
    heap = cuda_heap_bytes(model.gpu_mem)
    doc = {
        "kind": "prediction", "statement": PREDICTION, "stamp": stamp,
        "command": "python -m bench.level3_sim " + " ".join(shlex.quote(a) for a in
                                                            (sys.argv[1:] if argv is None else argv)),
        "spec_example": spec_for(args.gpus, "d", model, heap, args.dilate, "independent")
        + (f",krate={args.krate}" if args.krate else "") + (f",speeds={args.speeds}" if args.speeds else ""),
        "speeds": args.speeds, "gpus": args.gpus, "rate": model.rate["d"], "link": args.link, "p2p": model.p2p, "heap_bytes": heap,
        "issue": args.issue, "dilate": args.dilate, "krate": args.krate, "tile": args.tile,
        "streams": model.streams, "knobs": dict(vars(Knobs.from_env())), "repeats": args.repeats,
        "switch_interval": args.switch_interval, "cases": cases, "n": ns, "points": points,
        "runs": [r for n in ns for c in cases for r in runs[(n, c)]],
        "host": {"machine": platform.node() or "unknown", "cpus": os.cpu_count(), "python": platform.python_version()},
        "elapsed_s": time.perf_counter() - t_start,
    }
    write_report(args.out, "level3-sim-" + (f"{args.tag}-" if args.tag else "") + stamp, doc, markdown(doc), log)
    return doc


if __name__ == "__main__":
    main()
