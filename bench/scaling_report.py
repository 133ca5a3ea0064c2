"""The markdown report of ``bench.scaling_sim`` (model, predicted table, measured anchors) and the limits of its
prediction."""

from __future__ import annotations

def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def find_point(points, **kw):
    """The first point (a dict) with all of ``kw``'s values, or None."""
    return next((p for p in points if all(p.get(k) == v for k, v in kw.items())), None)


def markdown(doc: dict) -> str:
    """The report of a ``bench.scaling_sim`` run (its JSON document) as markdown."""
    from .scaling_sim import MAX_INFLATION, PREDICTION, RETRIES  # (here: scaling_sim imports this module)
    m = doc["model"]
    L = [f"# GEMM scaling prediction (sim, timing mode): {doc['stamp']}", "",
         f"**{PREDICTION}**", "", "```", doc["command"], "```", "",
         "## Model and assumptions", ""]
    L += [f"- compute: DGEMM {m['rate']['d'] / 1e12:g} TFLOPS, SGEMM {m['rate']['s'] / 1e12:g} TFLOPS per GPU "
          f"(in-core rates behind the 2x H200 measurement; every tile kernel runs at this rate, no size effects)",
          "- host links, two model variants:"]
    for name in doc["models"]:
        rate, desc = doc["variants"][name]
        L.append(f"  - `{name}`: {rate / 1e9:g} GB/s H2D and D2H per GPU; {desc}")
    L += [f"  - D2H = H2D is an **assumption** (only H2D was measured); H2D, D2H and peer copies overlap "
          f"each other and compute",
          f"- peer links: {m['p2p'] / 1e9:g} GB/s per GPU (NVLink, as measured between the two H200s), every pair "
          f"connected (NVSwitch assumed for 4 and 8 GPUs); one peer-copy engine per reading GPU",
          f"- GPU memory {m['gpu_mem'] / 1e9:g} GB; tile-cache heap {doc['heap_bytes'] / 1e9:.2f} GB per GPU, "
          f"sized as the cuda backend does (half the free memory, >= 2 GiB left)",
          f"- tile {doc['tiles']} (the cuda default path of `choose_tile`; perf-db entries ignored), "
          f"{m['streams']} streams, knobs {doc['knobs']}",
          f"- alpha {m['alpha']}, beta {m['beta']} (C read and written), square N x N x N, host-resident "
          f"operands, fresh tokens per call (a cold cache, as with writeable numpy arrays)",
          f"- time dilation: every simulated duration x {doc['dilate']:g}; all times below are measured wall "
          f"times / {doc['dilate']:g}. `sys.setswitchinterval({doc['switch_interval']:g})` so the Python "
          f"threads of all simulated GPUs interleave finely on this {doc['host']['cpus']}-core host",
          f"- launch cost: {m['issue'] * 1e6:g} us of host time per kernel or copy launch (slept by the issuing "
          f"worker, dilated too), ~50-100 us per k-step as on the real host; without it the dilated scheduler "
          f"issues unrealistically far ahead and the 2-GPU result swings +-20% with thread races",
          f"- a run whose simulated kernels took > {MAX_INFLATION:g}x their cost-model time (this shared 2-core "
          f"host was busy) is run again, up to {RETRIES} times; the JSON keeps every try's ratio",
          f"- repeats: multi-GPU points run {doc['repeats']} times (per N in order; later N use the last count), "
          f"1-GPU points once (no peers, no races); tables show the median time, the TFLOPS range, and the "
          f"other columns of the median run",
          "- shared-host scenarios (run with the "
          + ", ".join(f"`{x}`" for x in doc["shared_models"]) + " model, DGEMM: twice SGEMM's bytes per flop):"]
    for name, info in doc["scenarios"].items():
        L.append(f"  - `{name}`: {info['description']}")
    L += ["", "## Calibration (2x H200 measurement vs this model, N = 16384, independent links)", "",
          "| model | case | measured TFLOPS | predicted median | predicted range | error | busy / comm / idle "
          "ms per GPU, measured | predicted | source |",
          "| :-- | :-- | --: | --: | --: | --: | :-- | :-- | :-- |"]
    for c in doc["calibration"]:
        parts = lambda x: "-" if x is None else " / ".join(f"{v * 1e3:.1f}" for v in x)  # noqa: E731
        L.append(f"| {c['model']} | {c['dtype']}gemm, {c['gpus']} GPU, beta {c['beta']:g} | "
                 f"{c['measured_tflops']:.1f} | {c['predicted_tflops_median']:.1f} | "
                 f"{c['predicted_min']:.1f}-{c['predicted_max']:.1f} | {c['error']:+.1%} | "
                 f"{parts(c['measured_busy_comm_idle'])} | {parts(c['predicted_busy_comm_idle'])} | {c['source']} |")
    if doc["calibration"]:
        L += ["", "Compute time (busy) matches the measured profiles in both variants. With the nominal 55 GB/s "
              "links the model leaves less communication unoverlapped than the real GPUs did (comm), so it is "
              "optimistic; with 45 GB/s links (`fitted`) comm and the totals match. The fitted variant is the "
              "best estimate below; the nominal one is the issue's model, an upper bound."]
    # summary: TFLOPS and efficiency per (model, scenario, dtype) column
    cols = [(mo, sc, dt) for mo in doc["models"] for sc in doc["scenarios"] for dt in doc["dtypes"]
            if find_point(doc["points"], model=mo, scenario=sc, dtype=dt)]
    L += ["", "## Summary: predicted TFLOPS (parallel efficiency vs 1 GPU)", "",
          "| N | GPUs | " + " | ".join(f"{dt.upper()}GEMM {mo}, {sc}" for mo, sc, dt in cols) + " |",
          "| --: | --: | " + " | ".join("--:" for _ in cols) + " |"]
    for n in doc["n"]:
        for g in doc["gpus"]:
            cells = []
            for mo, sc, dt in cols:
                p = find_point(doc["points"], model=mo, scenario=sc, dtype=dt, n=n, gpus=g)
                star = " *" if p is not None and p["busy_inflation"] > MAX_INFLATION else ""
                cells.append("-" if p is None else f"{p['tflops']:.0f} ({p['efficiency']:.0%}){star}")
            L.append(f"| {n} | {g} | " + " | ".join(cells) + " |")
    notes = []
    starved = [p for p in doc["points"] if p["gpus_without_tasks"] and not p.get("reused")]
    for n, g in sorted({(p["n"], p["gpus"]) for p in starved}):
        tile = next(p["tile"] for p in starved if p["n"] == n and p["gpus"] == g)
        ntasks = (-(-n // tile)) ** 2
        idle = sorted({p["gpus_without_tasks"] for p in starved if p["n"] == n and p["gpus"] == g})
        notes.append(f"N = {n} on {g} GPUs: {ntasks} tasks (C tiles of {tile}), and {'/'.join(map(str, idle))} "
                     f"GPUs get none. A worker takes up to `streams` ({doc['model']['streams']}) tasks into its "
                     f"station at once and starts them all, so the first {ntasks // doc['model']['streams']} "
                     f"workers to wake take every task and nothing is left to steal. `choose_tile` keeps "
                     f"T = {tile}: its tile rule asks for fewer tasks per device than that.")
    hot = [p for p in doc["points"] if p["busy_inflation"] > MAX_INFLATION and not p.get("reused")]
    if hot:
        notes.append("Marked `*`: the run shown still had kernels over "
                     f"{MAX_INFLATION:g}x their modelled time after {RETRIES} retries (this host was busy), "
                     "so its TFLOPS are low by up to that much: "
                     + ", ".join(f"{p['dtype']} {p['model']} {p['scenario']} N={p['n']} {p['gpus']} GPUs "
                                 f"({p['busy_inflation']:.3f}x)" for p in hot) + ".")
    if notes:
        L += ["", "Notes:", ""] + [f"- {x}" for x in notes]
    L += ["", "## Predicted scaling, in detail", "",
          "time = median predicted wall time of one call; speedup and efficiency against 1 GPU of the same "
          "model, scenario and dtype; floor = max(compute, host-traffic lower bounds) as TFLOPS; H2D / P2P = "
          "bytes per GPU; L2 = tile reads served by a peer / all tile reads; busy / comm / idle = per-GPU mean "
          "(compute, unoverlapped copies, nothing), ms; no-task GPUs = GPUs that got no task at all.", ""]
    for mo, sc, dt in cols:
        rows = [r for r in doc["points"] if r["model"] == mo and r["scenario"] == sc and r["dtype"] == dt]
        L += [f"### {dt.upper()}GEMM, `{mo}` model, `{sc}`", "",
              "| N | GPUs | time s | TFLOPS | range | speedup | efficiency | floor TFLOPS | H2D GB/GPU | "
              "P2P GB/GPU | L2 hit | busy ms | comm ms | idle ms | no-task GPUs | runs |",
              "| --: | --: | --: | --: | :-- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |"]
        for r in rows:
            note = " (=independent)" if r.get("reused") else ""
            if r["busy_inflation"] > MAX_INFLATION and not r.get("reused"):
                note += " *"
            L.append(f"| {r['n']} | {r['gpus']} | {r['time']:.4f} | {r['tflops']:.1f} | "
                     f"{r['tflops_min']:.1f}-{r['tflops_max']:.1f} | {r['speedup']:.2f} | "
                     f"{r['efficiency']:.0%} | {r['floor_tflops']:.1f} | {_gb(r['h2d_per_gpu'])} | "
                     f"{_gb(r['p2p_per_gpu'])} | {r['l2_hit_rate']:.2f} | {r['busy'] * 1e3:.1f} | "
                     f"{r['comm'] * 1e3:.1f} | {r['idle'] * 1e3:.1f} | {r['gpus_without_tasks']} | "
                     f"{r['runs']}{note} |")
        L.append("")
    L += ["## Limits of the model", ""] + [f"- {x}" for x in LIMITS] + [
        "", f"Host: {doc['host']['machine']}, {doc['host']['cpus']} CPUs, python {doc['host']['python']}; "
        f"the run took {doc['elapsed_s']:.0f} s of wall time.", ""]
    return "\n".join(L)


LIMITS = [
    "Kernels run at one flat rate: no tile-size, wave-quantisation or clock effects, and copies do not slow "
    "kernels down (on the real GPU they share HBM bandwidth).",
    "Copies run at fixed link rates with no latency or ramp. The real links deliver less when H2D, D2H and "
    "peer copies run together; the `fitted` variant folds that into one lower rate (45 GB/s), fitted at "
    "N = 16384 on 1 and 2 GPUs only. D2H = H2D is an assumption. Peer copies assume an NVSwitch: any pair at "
    "396 GB/s, no contention between pairs or with host copies.",
    "The shared-host scenarios are assumptions about a machine that was not measured; the cap is modelled as "
    "FIFO reservations on one channel (aggregate rate exact, per-copy fairness approximate).",
    "The scheduler is the real one, but its host-side timing is modelled, not reproduced: a fixed launch "
    "cost per kernel/copy, and the Python scheduler's own time, which dilation makes smaller than on "
    "the real host (8 simulated GPUs also share 2 cores here). Which GPU reads which tile from a peer is "
    "decided by thread timing; the remaining run-to-run spread shows in the range column, largest where "
    "there are few tasks per GPU.",
    "Each kernel's length is exact; launch latency and event costs are not modelled beyond the launch "
    "cost, and kernels of one GPU run one at a time (one compute engine, as with chained kernels).",
    "No engine start, host registration, CUDA context or first-call costs: a warm engine and already pinned "
    "operands, as in the best-of-3 measurement.",
    "Square problems, one call at a time, the tile the cuda default rule picks (`blasx.tile.default_tile`); "
    "a perf-db tuned on the target machine could choose differently.",
]
