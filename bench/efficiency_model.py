"""Parallel efficiency in the 2x H200 timing model: ``python -m bench.efficiency --model h200``.

A PREDICTION, NOT A MEASUREMENT. Each (dtype, GPU count, N) is one GEMM call on fresh data-free
timing sims (``bench.scaling_sim``: the real scheduler, kernels and copies replaced by their
cost-model times), with the tile the cuda rule of ``blasx.tile.default_tile`` picks under
``$BLASX_KNOBS`` (so ``BLASX_KNOBS=small_n_tiles=1`` is the A/B). Host costs are the part the
large-N calibration does not pin down, so they are modelled from measurements of their own:

- launches: ``--issue`` seconds of host time per kernel or copy launch (default 50 us), and
  the launches of all GPUs take turns (one lock, as the workers' launches take one GIL). Fitted
  to the one issue-bound measurement, HGEMM N = 32768 on 2x H200 with 2048-tiles, 0.374 s
  (NOTES.md): modelled as 700 TFLOPS kernels on 4-byte tiles, it gives 0.351 s (25 us, each GPU
  launching on its own, as ``bench.scaling_sim``: 0.142 s). DGEMM with 4096-tiles is not slowed.
- ``--call-cost``: host seconds per call outside the engine (dispatch, planning, profile), added
  to every predicted time (default 0; the efficiency it gives is printed for 1 and 2 ms too).

Efficiency = T(1) / (g T(g)), T the best of ``--runs`` predicted calls (thread timing makes a
call's prediction vary, most where a GPU has few tasks). ``--measured`` adds a measured
efficiency report's figures beside the predictions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time

from blasx import tile as tile_rules
from blasx.runtime.knobs import Knobs

from . import scaling_sim as S

PREDICTION = ("PREDICTION, NOT A MEASUREMENT: simulated GPUs (blasx `sim` backend, data-free timing mode) "
              "with the 2x H200 cost model of bench.scaling_sim; no GPU was used.")
#: host seconds per launch, serialised across GPUs (fitted to HGEMM 2048-tiles, see the module doc)
ISSUE = 50e-6
CALL_COSTS = (1e-3, 2e-3)  # extra per-call host seconds shown as a sensitivity


def model(beta: float, alpha: float, issue: float) -> S.Model:
    """The 2x H200 model with fitted host links and serialised launches."""
    m = S.MODEL
    return dataclasses.replace(m, h2d=S.FITTED_LINK, d2h=S.FITTED_LINK, alpha=alpha, beta=beta, issue=issue,
                               serial_issue=True)


def run_knobs(args) -> Knobs:
    """``$BLASX_KNOBS``, with small_n_tiles on where ``--small-n`` gives a rule."""
    knobs = Knobs.from_env()
    return dataclasses.replace(knobs, small_n_tiles=True) if getattr(args, "small_n", None) else knobs


@contextlib.contextmanager
def small_n_rule(rule):
    """``blasx.tile.SMALL_N["cuda"]`` set to ``rule`` (granule, least, per_stream) inside, if given."""
    if not rule:
        yield
        return
    old = tile_rules.SMALL_N["cuda"]
    tile_rules.SMALL_N["cuda"] = tuple(rule)
    try:
        yield
    finally:
        tile_rules.SMALL_N["cuda"] = old


def predict(args, log, knobs: Knobs | None = None) -> list[dict]:
    """One record per predicted call, in bench.efficiency's record form (seconds, dtype, n, gpus, ...)."""
    knobs = run_knobs(args) if knobs is None else knobs
    mo = model(args.beta, args.alpha, args.issue)
    records = []
    for dt in args.dtypes:
        for g in args.gpus:
            for n in args.n:
                for k in range(args.runs):
                    t0 = time.perf_counter()
                    r = S.run_one(n, g, dt, mo, args.beta, "independent", args.dilate, knobs=knobs)
                    rec = {"dtype": dt, "n": n, "gpus": g, "run": k, "warmup": False, "ok": True,
                           "seconds": r["time"] + args.call_cost, "engine_seconds": r["time"], "tile": r["tile"],
                           **{x: r[x] for x in ("busy", "comm", "idle", "busy_inflation", "tries_busy_inflation",
                                                "h2d_per_gpu", "p2p_per_gpu")},
                           "tasks": [d["tasks"] for d in r["devices"]]}
                    records.append(rec)
                    log(f"   {dt} N={n:<6} g={g} run {k + 1}: tile {r['tile']}, {rec['seconds'] * 1e3:8.2f} ms "
                        f"(busy {r['busy'] * 1e3:.1f} comm {r['comm'] * 1e3:.1f} idle {r['idle'] * 1e3:.1f} ms, "
                        f"kernels x{r['busy_inflation']:.3f}; {time.perf_counter() - t0:.1f} s)")
    return records


def measured_efficiency(path: str | None) -> dict:
    """(dtype, n, g) -> (efficiency, best seconds) of a bench.efficiency JSON report; {} without one."""
    if not path:
        return {}
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    return {(r["dtype"], r["n"], int(g)): (e.get("efficiency"), e.get("best"))
            for r in doc.get("summary", []) for g, e in r["per_g"].items()}


def with_call_cost(rows: list[dict], cost: float) -> dict:
    """dtype -> g -> mean efficiency if every call took ``cost`` more host seconds."""
    out: dict = {}
    for r in rows:
        base = r["per_g"].get(1, {}).get("best")
        for g, e in r["per_g"].items():
            if g != 1 and base and e.get("best"):
                out.setdefault(r["dtype"], {}).setdefault(g, []).append((base + cost) / (g * (e["best"] + cost)))
    return {d: {g: statistics.fmean(v) for g, v in per.items()} for d, per in out.items()}


def markdown(report: dict, rows: list[dict], E) -> str:
    gpus = report["gpus"]
    md = [f"# Parallel efficiency of blasx GEMM, 2x H200 timing model ({report['date']} UTC)", "",
          f"**{PREDICTION}**", "", "```", report["command"], "```", "",
          f"- model: `bench.scaling_sim`'s 2x H200 model, host links at the fitted {S.FITTED_LINK / 1e9:g} GB/s "
          f"each way, DGEMM {S.MODEL.rate['d'] / 1e12:g} / SGEMM {S.MODEL.rate['s'] / 1e12:g} TFLOPS per GPU, "
          f"{S.MODEL.streams} streams; {report['issue'] * 1e6:g} us of host time per launch, launches of all GPUs "
          f"serialised (one GIL); {report['call_cost'] * 1e3:g} ms per call outside the engine",
          f"- knobs: `{report['knobs_text'] or 'defaults'}`, small_n_tiles {report['knobs']['small_n_tiles']} "
          f"(granule, least tile, tasks per stream: {tuple(report['small_n_rule'])}); tile: the cuda rule of "
          "`blasx.tile.default_tile`",
          f"- alpha {report['alpha']:g}, beta {report['beta']:g}; time dilation {report['dilate']:g}; "
          f"T = best of {report['runs']} predicted calls",
          "", "## Predicted results", "", E.format_table(rows, gpus), ""]
    avg = E.format_averages(report["averages"], gpus)
    md += ["## Average efficiency over the sizes", "", *(f"- {x}" for x in avg)]
    for cost, per in report["call_cost_sensitivity"].items():
        md.append(f"- with {float(cost) * 1e3:g} ms more host time per call: "
                  + ", ".join(f"{d} {g} GPUs {v:.3f}" for d, x in per.items() for g, v in x.items()))
    md += ["", "## Tiles and tasks per GPU", "", "| dtype | N | " + " | ".join(f"{g} GPU tile (tasks)" for g in gpus)
           + (" | measured eff. | predicted eff. |" if report["measured"] else " |"),
           "| :-- | --: | " + " | ".join("--:" for _ in gpus) + (" | --: | --: |" if report["measured"] else " |")]
    meas = {tuple(k): v for k, v in report["measured"]}
    for r in rows:
        cells = []
        for g in gpus:
            rec = next((x for x in report["records"]
                        if (x["dtype"], x["n"], x["gpus"]) == (r["dtype"], r["n"], g)), None)
            cells.append("-" if rec is None else f"{rec['tile']} ({'/'.join(map(str, rec['tasks']))})")
        line = f"| {r['dtype']} | {r['n']} | " + " | ".join(cells)
        if report["measured"]:
            g2 = max(gpus)
            m = meas.get((r["dtype"], r["n"], g2))
            p = r["per_g"].get(g2, {}).get("efficiency")
            line += f" | {'-' if not m or m[0] is None else f'{m[0]:.3f}'} | {'-' if p is None else f'{p:.3f}'}"
        md.append(line + " |")
    if report["measured"]:
        md += ["", f"Measured: `{report['measured_path']}`."]
    hot = [x for x in report["records"] if x["busy_inflation"] > S.MAX_INFLATION]
    if hot:
        md += ["", "Kernels over their modelled time after retries (this host was busy): " + ", ".join(
            f"{x['dtype']} N={x['n']} {x['gpus']} GPU x{x['busy_inflation']:.3f}" for x in hot) + "."]
    return "\n".join(md).rstrip() + "\n"


def run(args, argv, E) -> int:
    """The sweep in the model; writes efficiency-model-<tag>-<stamp>.{json,md}. ``E``: bench.efficiency."""
    from .result_files import command_line, utc_stamp, write_json_md
    stamp, date = utc_stamp()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # the simulated GPUs' threads interleave finely
    try:
        with small_n_rule(args.small_n):
            records = predict(args, E.log)
    finally:
        sys.setswitchinterval(old)
    rows = E.summarize(records, args.gpus)
    knobs = run_knobs(args)
    report = {"kind": "prediction", "statement": PREDICTION, "tag": args.tag, "date": date, "stamp": stamp,
              "command": command_line("bench.efficiency", argv), "dtypes": args.dtypes, "sizes": args.n,
              "gpus": args.gpus, "runs": args.runs, "alpha": args.alpha, "beta": args.beta, "issue": args.issue,
              "call_cost": args.call_cost, "dilate": args.dilate, "knobs": vars(knobs),
              "small_n_rule": list(args.small_n or tile_rules.SMALL_N["cuda"]),
              "knobs_text": os.environ.get("BLASX_KNOBS", ""), "records": records,
              "summary": [r | {"per_g": {str(g): v for g, v in r["per_g"].items()}} for r in rows],
              "averages": E.average_efficiency(rows, args.gpus),
              "call_cost_sensitivity": {str(c): with_call_cost(rows, c) for c in CALL_COSTS},
              "measured_path": args.measured,
              "measured": [[list(k), v] for k, v in measured_efficiency(args.measured).items()]}
    E.log(E.format_table(rows, args.gpus))
    for line in E.format_averages(report["averages"], args.gpus):
        E.log(line)
    md = markdown(report, rows, E)
    report["averages"] = {d: {str(g): v for g, v in per.items()} for d, per in report["averages"].items()}
    report["call_cost_sensitivity"] = {c: {d: {str(g): v for g, v in per.items()} for d, per in x.items()}
                                       for c, x in report["call_cost_sensitivity"].items()}
    paths = write_json_md(os.path.join(args.out, f"efficiency-model-{args.tag}-{stamp}"), report, md)
    E.log(f"wrote {paths[0]}\n      {paths[1]}")
    return 0
