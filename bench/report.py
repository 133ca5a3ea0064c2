"""Write docs/performance.md from the latest result files in bench/results.

    python -m bench.report                       # bench/results -> docs/performance.md
    python -m bench.report --results DIR --out FILE

One section per benchmark, one table per result file: the machine, the date, the command
that reproduces it and the figures, blasx beside its peer (cuBLAS-XT, in-core cuBLAS through
CuPy, numpy). Of several runs of one command on one machine only the latest is shown. A
benchmark is one entry of READERS: a file pattern and a function from a file to its table.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import Callable

from blasx.runtime.dtypes import GEMM_BY_PREFIX, PREFIXES

from .level3_routines import ALL_ROUTINES
from .level3_table import worst_share


@dataclass
class Table:
    """One result file as a table: where and how it was measured, and its rows."""
    machine: str
    date: str
    command: str
    header: list
    rows: list
    notes: list = field(default_factory=list)
    file: str = ""


@dataclass(frozen=True)
class Reader:
    title: str
    pattern: str  # glob in the results folder
    read: Callable[[str], Table]
    about: str


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _machine(text: str) -> str:
    """'vm: 2x NVIDIA H200' -> '2x NVIDIA H200' (the host name says nothing to a reader)."""
    return text.split(": ", 1)[1] if ": " in text else text


def _dtype(d: str) -> str:
    return f"{GEMM_BY_PREFIX[d].dtype.name} ({d})"


def _load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _checks_note(bad: list[str], total: int) -> str:
    """One line saying every timed result was checked and right, or listing those that were not (a failed or
    wrong result is never left out of the page without a word)."""
    if not bad:
        return f"Every timed result checked against its reference: {total} ok."
    return f"NOT ok ({len(bad)} of {total}, left out of the figures above): " + "; ".join(bad) + "."


#: Benchmarks whose checks were completed on 2026-11-29 (commit 7b1011f): a file made before says what its older
#: check missed, so the page never calls it checked without a word (a rerun is owed: NOTES, Runs owed).
CHECKS_COMPLETED = "2026-11-29T15:02"
OLDER_CHECK = {
    "network": "images of the first GPU's chunk alone (the second GPU's output unchecked)",
    "dask": "the summed C by its checksum, or blasx.dask against dask.array's own result",
    "convhost": "sampled images that never included the last one",
}


def _older_check(kind: str, date: str) -> list[str]:
    """The note for a ``kind`` table made before its checks were completed (``date``: ISO or stamp), else none."""
    iso = date if "T" in date or "-" in date[:8] else f"{date[:4]}-{date[4:6]}-{date[6:8]}T{date[9:11]}:{date[11:13]}"
    if iso.replace(" ", "T")[:16] >= CHECKS_COMPLETED:
        return []
    return [f"Checked by the older check of this benchmark ({OLDER_CHECK[kind]}); a rerun with today's checks is "
            "owed."]


# --------------------------------------------------------------------------- readers


def read_gemm(path: str) -> Table:
    doc = _load(path)
    gpus = doc["env"].get("gpus") or []
    machine = f"{len(doc['config']['gpus'])}x {gpus[0]['name']}" if gpus else doc["env"].get("host", "?")
    best: dict = {}
    for s in doc["summary"]:
        key = (s["dtype"], s["mode"], s["m"], s["n"], s["k"])
        if s["status"] == "ok":
            best.setdefault(key, {})[s["label"]] = s
    ratios = {(r["dtype"], r["mode"], r["m"], r["n"], r["k"]): r for r in doc.get("ratios", [])}
    rows = []
    for key, by in best.items():
        xt = max((s for lb, s in by.items() if lb.startswith("cublasxt")), key=lambda s: s["tflops_best"] or 0,
                 default=None)
        bx, cp, np_ = by.get("blasx"), by.get("cupy"), by.get("numpy")
        g = len(doc["config"]["gpus"])
        d, mode, m, n, k = key
        size = str(n) if m == n == k else f"{m}x{n}x{k}"
        rows.append([_dtype(d), mode, size, _f(bx and bx["tflops_best"]),
                     f"{_f(xt['tflops_best'])} ({xt['label'].partition('=')[2].rstrip(']')})" if xt else "-",
                     _f(ratios.get(key, {}).get("blasx_over_xt_best"), 2),
                     _f(cp and cp["tflops_best"]),
                     _f(bx["tflops_best"] / (g * cp["tflops_best"]), 2) if bx and cp else "-",
                     _f(np_ and np_["tflops_best"], 2)])
    bad = [f"{s['label']} {s['dtype']} {s['mode']} {s['n']}: {s['status']}" for s in doc["summary"]
           if s["status"] != "ok"]
    refs = [c.get("reference") for c in doc.get("cases", [])]
    first_rows = [r["rows"] for r in refs if isinstance(r, dict) and "rows" in r and "sampled" not in r]
    return Table(machine, doc["date"][:16].replace("T", " "), doc["command"],
                 ["dtype", "mode", "N", "blasx", "cuBLAS-XT (block)", "blasx / XT", "cupy in-core, 1 GPU",
                  "blasx / (cupy x GPUs)", "numpy"], rows,
                 [f"TFLOPS of the best of {doc['config']['runs']} run(s); alpha {doc['config']['alpha']}, "
                  f"beta {doc['config']['beta']}.", _checks_note(bad, len(doc["summary"]))]
                 + ([f"(The older check: C's first {max(first_rows)} rows only, not rows spread over C; a rerun is "
                     "owed.)"] if first_rows else [])
                 + (["fresh: inputs never seen before; blasx's new result comes from its page-locked pool (locked "
                     "at the first call), while cuBLAS-XT page-locks and unlocks the caller's C in every call."]
                    if any(s["mode"] == "fresh" for s in doc["summary"]) else []))


def read_level3(path: str) -> Table:
    doc = _load(path)
    best: dict = {}
    for r in doc["results"]:
        if r.get("ok") and r.get("tflops"):
            key = (r["n"], r["dtype"], r["routine"], r["who"])
            best[key] = max(best.get(key, 0.0), r["tflops"])
    worst, rows = worst_share(doc["results"]), []
    order = sorted((k for k in best if k[3] == "blasx"),
                   key=lambda k: (PREFIXES.index(k[1]), k[0], ALL_ROUTINES.index(k[2])))
    for n, d, rt, _ in order:
        tf, xt, gemm = best[(n, d, rt, "blasx")], best.get((n, d, rt, "cublasxt")), best.get((n, d, "gemm", "blasx"))
        rows.append([_dtype(d), n, rt, _f(tf), _f(xt), _f(tf / xt, 2) if xt else "-",
                     _f(tf / gemm, 2) if gemm else "-", _f(worst.get((n, d, rt)), 2)])
    return Table(_machine(doc["machine"]), doc["date"][:16], doc["command"],
                 ["dtype", "N", "routine", "blasx", "cuBLAS-XT", "blasx / XT", "of blasx GEMM", "worst run"], rows,
                 [f"TFLOPS of the best of {doc['runs']} run(s) (complex: 4x the real flops); upper, left, "
                  f"no transpose, TRMM and TRSM in place; worst run: the lowest over run numbers of the run's "
                  f"TFLOPS over the same run's GEMM.",
                  _checks_note([f"{r['who']} {r['dtype']}{r['routine']} {r['n']}" for r in doc["results"]
                                if not r.get("ok")], len(doc["results"]))])


def read_efficiency(path: str) -> Table:
    doc = _load(path)
    gs = sorted(int(g) for g in doc["gpus"])
    rows = [[_dtype(s["dtype"]), s["n"]]
            + [x for g in gs for x in (_f(s["per_g"].get(str(g), {}).get("tflops")),)]
            + [_f(s["per_g"].get(str(g), {}).get("efficiency"), 2) for g in gs[1:]] for s in doc["summary"]]
    notes = [f"{_dtype(d)}, {g} GPUs: mean efficiency {v['mean']:.3f} over {v['sizes']} sizes"
             for d, per in doc.get("averages", {}).items() for g, v in per.items()]
    records = doc.get("records", [])
    notes.append(_checks_note([f"{r.get('dtype')} N={r.get('n')} {r.get('gpus')} GPU(s)" for r in records
                               if not r.get("ok")], len(records)))
    return Table(_machine(doc["machine"]), doc["date"][:16], doc["command"],
                 ["dtype", "N"] + [f"TFLOPS, {g} GPU{'s' * (g > 1)}" for g in gs]
                 + [f"efficiency, {g} GPUs" for g in gs[1:]], rows, notes)


def read_cpu_worker(path: str) -> Table:
    doc = _load(path)
    modes = [m for m in doc.get("modes", ["off", "on"]) if m != "off"]  # the first version ran off and on
    key = {"on": ("on", "with_cpu"), "auto": ("auto",)}
    rows = []
    for s in doc["summary"]:
        base = s.get("gpus_only") or {}
        row = [_dtype(s["dtype"]), s["n"], s["gpus"], _f(base.get("tflops"))]
        for m in modes:
            r = next((s[k] for k in key[m] if s.get(k)), {})
            row += [_f(r.get("tflops")), _f(100 * r["cpu_flop_share"], 1) if "cpu_flop_share" in r else "-"]
        rows.append(row)
    return Table(_machine(doc["machine"]), doc["date"][:16], doc["command"],
                 ["dtype", "N", "GPUs", "GPUs only"]
                 + [x for m in modes for x in (f"+ CPU ({m})", f"CPU flops % ({m})")],
                 rows, ["TFLOPS of the best run; `bench.cpu_worker`, the command above, is retired: the CPU worker "
                        "is now compared with `python -m bench.ab --a cpu=False --b cpu=auto`."])


def read_scaling_sim(path: str) -> Table:
    doc = _load(path)
    pts = [p for p in doc["points"] if p["scenario"] == "independent" and p.get("model") in (None, "fitted")]
    rows = [[_dtype(p["dtype"]), p["n"], p["gpus"], _f(p["tflops"]), _f(p.get("efficiency"), 2)] for p in pts]
    stamp = doc["stamp"]
    return Table("simulated H200s (timing mode)", f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]}", doc["command"],
                 ["dtype", "N", "GPUs", "TFLOPS", "efficiency"], rows, [doc["statement"]])


def read_offload_threshold(path: str) -> Table:
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    command = next((x.partition("# command: ")[2] for x in lines if x.startswith("# command: ")),
                   "python -m bench.offload_threshold ...")
    devices = next((x.partition("blasx devices: ")[2] for x in lines if "blasx devices: " in x), "?")
    rows, dtype = [], None
    for x in lines:
        if re.fullmatch(r"(float|complex)\d+:", x.strip()):
            dtype = x.strip()[:-1]
        elif dtype and re.match(r"\s+\d+\s+\S+e[+-]\d+", x):
            n, _, numpy_ms, blasx_ms, speedup = x.split()[:5]
            rows.append([dtype, n, numpy_ms, blasx_ms, speedup])
    return Table(_devices(devices), _file_date(path), command, ["dtype", "N", "numpy ms", "blasx ms", "numpy / blasx"],
                 rows, [x for x in lines if x.startswith("crossover")])


def read_ab(path: str) -> Table:
    doc = _load(path)
    rows = [[r["n"], r["routine"], r["config"], f"{r['median_s']:.4f}", _f(r["tflops"]), _f(r["vs_a"], 3),
             _f(r["of_gemm"], 3)] for r in doc["summary"]]
    notes = ["Configurations: " + "; ".join(f"{c['label']} = `{c['text'] or 'defaults'}`" for c in doc["configs"])]
    if doc.get("prediction"):
        notes.append("A timing-model prediction (no GPU ran): nothing to check.")
    else:
        notes.append(_checks_note([f"{r['config']} {r['routine']} {r['n']} round {r['round']}" for r in doc["records"]
                                   if not r.get("ok")], len(doc["records"])))
    measured = doc.get("host") and not doc.get("prediction")
    where = f"{_machine(doc['host'])}, {doc['where']}" if measured else doc["where"]
    return Table(where, doc["date"][:16], doc["command"],
                 ["N", "routine", "config", "median s", "TFLOPS", "vs A", "of GEMM"], rows, notes)


def read_conv(path: str) -> Table:
    doc = _load(path)
    rows = [[g["mode"], g["direction"], g["set"], _f(g["geomean"], 2), f"{g['ok']} / {g['layers']}",
             "met" if g["goal_met"] else "NOT met"] for g in doc["geomeans"]]
    short = [f"- {r['mode']} {r['direction']} {r['layer']} ({r['shape']}): "
             + (f"{r['ratio']:.2f}x, {r['limit']}" if r["status"] == "ok" else f"{r['status']} {r.get('error', '')}")
             for r in doc["rows"] if r["status"] != "ok" or r["limit"]]
    notes = [f"Geometric mean of blasx / cuDNN throughput over checked layers; batch {doc['batch']}, layout "
             f"{doc['layout']}, devices `{doc['devices']}`, peer {doc['peer']}. Per-layer table: "
             f"`{os.path.splitext(os.path.basename(path))[0]}.md`."]
    if short:
        notes += ["", "Layers short of 0.8x (what limits them), and failed checks:", "", *short]
    return Table(_machine(doc["machine"]), doc["date"][:16], doc["command"],
                 ["mode", "direction", "set", "blasx / cuDNN", "checked / layers", "goal 0.8x"], rows, notes)


def read_convhost(path: str) -> Table:
    doc = _load(path)
    rows = [[s["mode"], s["host_mode"], _f(s["set_ratio"], 2), _f(s["geomean"], 2), f"{s['ok']} / {s['layers']}",
             "met" if s["goal_met"] else "NOT met"] for s in doc["summary"]]
    return Table(_machine(doc["machine"]), doc["date"][:16], doc["command"],
                 ["mode", "host memory", "set: torch s / blasx s", "geomean blasx / torch", "checked / layers",
                  "goal 1.6x"], rows,
                 [f"Forward, batch {doc['batch']}, blasx on `{doc['devices']}` against torch: {doc['peer']}."]
                 + _older_check("convhost", doc["date"]))


def read_tallskinny(path: str) -> Table:
    doc = _load(path)
    rows = []
    for r in doc["rows"]:
        if r["who"] != "blasx":
            continue
        peer = next((p for p in doc["rows"] if p["who"] == "cupy" and
                     (p["dtype"], p["n"], p["mode"]) == (r["dtype"], r["n"], r["mode"])), None)
        b = r["bound"]
        rows.append([_dtype(r["dtype"]), r["n"], r["mode"], _f(r["median_s"], 3), _f(b and b["seconds"], 3),
                     _f(r["of_bound"], 2), _f(peer and peer["median_s"], 3),
                     _f(peer["median_s"] / r["median_s"], 2) if peer and peer["median_s"] and r["median_s"] else "-",
                     r["status"]])
    return Table(_machine(doc["machine"]), doc["date"][:16], doc["command"],
                 ["dtype", "n", "host memory", "blasx s", "host-link bound s", "blasx / bound", "cupy 1 GPU s",
                  "cupy / blasx", "check"], rows,
                 [f"C = X^T X, X n x {doc['cols']} in host memory; goal: blasx within 1.2x of the bound."])


def read_rnn(path: str) -> Table:
    doc = _load(path)
    gpus = doc["env"].get("gpus") or []
    used = str(doc.get("devices") or "")
    count = len(used.split(",")) if used.startswith("cuda:") else len(gpus)  # the GPUs the run used, not all seen
    machine = f"{count}x {gpus[0]['name']}" if gpus else "CPU only"
    rows = [[r["mode"], r["hidden"], r["batch"], r["steps"], r["layers"], 2 if r["bidirectional"] else 1,
             r["dtype"], r["math"], r["phase"], _f(r["blasx_s"] * 1e3, 2), _f(r["peer_s"] * 1e3, 2),
             _f(r["ratio"], 2), "ok" if r["ok"] else "FAIL"] for r in doc["results"]]
    notes = ["ratio = blasx time / torch (cuDNN) time; goal <= 1.2 on one GPU."]
    groups: dict = {}
    for r in doc["results"]:
        if r["ok"]:  # (a failed row's ratio counts toward no goal)
            groups.setdefault((r["dtype"], r["math"], r["phase"]), []).append(r["ratio"])
    if len(doc["results"]) > len(groups):  # a table of shapes: how many meet the goal, per math mode and phase
        notes.append("Within 1.2x (geometric mean of the ratios): " + "; ".join(
            f"{d} {m} {ph} {sum(x <= 1.2 for x in v)} of {len(v)} ({math.prod(v) ** (1 / len(v)):.2f})"
            for (d, m, ph), v in groups.items()) + ".")
    o = doc.get("overhead")
    if o:
        from bench.rnn import step_costs
        notes.append(f"Per-step cost (H={o['hidden']}, B={o['batch']}, T={o['steps']}): {step_costs(o)}.")
    return Table(machine, doc["date"][:16], doc["command"],
                 ["mode", "H", "B", "T", "layers", "dirs", "dtype", "math", "phase", "blasx ms", "cuDNN ms",
                  "ratio", "check"], rows, notes)


def read_network(path: str) -> Table:
    doc = _load(path)
    gpus = doc["machine"].get("gpus") or []
    used = (doc.get("args") or {}).get("gpus") if (doc.get("args") or {}).get("gpu") else None
    machine = f"{len(gpus)}x {gpus[0]}" if gpus else (f"{len(used)} GPUs (names not recorded)" if used else "CPU only")
    rows = []
    for r in doc["rows"]:
        checks = {c["name"]: c for c in r.get("checks", [])}
        for run in r["runs"]:
            c = checks.get(run["name"], {})
            rows.append([r["model"], r["mode"], r["batch"], run["name"], _f(run.get("images_per_s"), 0),
                         _f(run.get("vs_torch"), 2), "ok" if c.get("ok") else ("FAIL" if c else "-")])
        for name, c in checks.items():
            if "exception" in c and not any(run["name"] == name for run in r["runs"]):
                rows.append([r["model"], r["mode"], r["batch"], name, "-", "-", "ERROR " + c["exception"]])
    return Table(machine, _stamp_date(doc["date"]), doc["command"],
                 ["model", "mode", "batch", "contender", "images/s", "x torch", "check"], rows,
                 ["torch: one GPU, the host batch streamed in chunks with its copies; goal: blasx on two GPUs "
                  ">= 1.7x torch, on one >= 0.85x."] + _older_check("network", doc["date"]))


def read_dask(path: str) -> Table:
    doc = _load(path)
    a, res = doc["args"], doc["results"]
    gpus = doc.get("gpus")
    if gpus:
        machine = f"{len(gpus)}x {gpus[0]}"
    else:
        machine = "CPU only" if a["devices"] == "cpu" else f"devices {a['devices']} (GPU names not recorded)"
    command = doc.get("command") or ("python -m bench.dask " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in a.items() if k in ("n", "block", "devices", "workers", "threads",
                                                                      "layout", "sink"))
        + (" --gpu-chunks" if a.get("gpu_chunks") else ""))
    rows = [[name, _f(r["seconds"], 2), _f(r["gflops"] / 1e3, 1),
             "-" if r.get("peak_worker_bytes") is None else _f(r["peak_worker_bytes"] / 2**20, 0),
             "-" if r.get("peak_worker_gpu_pool_bytes") is None else _f(r["peak_worker_gpu_pool_bytes"] / 2**20, 0),
             f"{r['rel_err']:.1e}", "ok" if r.get("ok", r["rel_err"] < 1e-10) else "WRONG"] for name, r in res.items()]
    notes = []
    bx, da_, one = (r if r and r.get("ok", r["rel_err"] < 1e-10) else None  # (ratios of checked results only)
                    for r in (res.get(k) for k in ("blasx.dask", "dask.array", "blasx (one process)")))
    notes += _older_check("dask", doc["date"])
    if bx and da_:
        notes.append(f"blasx.dask / dask.array: {da_['seconds'] / bx['seconds']:.2f}x the speed "
                     "(goal >= 3x, peak worker memory <= 1/2).")
    if bx and one:
        notes.append(f"Dask layer cost against blasx in one process: {bx['seconds'] / one['seconds'] - 1:+.0%} "
                     "(goal <= 10%).")
    return Table(machine, doc["date"][:16], command,
                 ["contender", "seconds", "TFLOPS", "peak worker host MiB", "peak worker GPU pool MiB", "rel. error",
                  "check (<= 1e-10)"],
                 rows, notes)


def read_first_call(path: str) -> Table:
    doc = _load(path)
    rows = [[r.get("contender", "blasx"), _dtype(r["dtype"]), r["n"], _f(r["first_median"], 3),
             _f(r["warm_best_median"], 3), _f(r["ratio_median"], 2), _f(r["ratio_worst"], 2),
             "yes" if r["ok"] else "NO"] for r in doc["results"]]
    return Table(_devices(doc["devices"]), doc["date"][:16], doc["command"],
                 ["contender", "dtype", "N", "first call s", "best warm call s", "first / warm", "worst sample",
                  "checked"],
                 rows, ["Medians over fresh processes; goal (issue 24): first / warm <= 1.5 at N = 8192. The cupy "
                        "row, where present, is the same GEMM by CuPy on GPU 0 in fresh processes of its own."])


def _devices(text: str) -> str:
    """'cuda:0 NVIDIA H200, cuda:1 NVIDIA H200' -> '2x NVIDIA H200'; 'cpu' -> 'CPU only'."""
    names = [re.sub(r"^\S+:\d+\s*", "", d.strip()) for d in text.split(",")]
    if text.strip() == "cpu":
        return "CPU only"
    return f"{len(names)}x {names[0]}" if names and names[0] else text


def _stamp_date(stamp: str) -> str:
    """A "YYYYMMDD-HHMMSS" stamp as "YYYY-MM-DD HH:MM" (an ISO date passes through, to the minute)."""
    m = re.fullmatch(r"(\d{4})(\d{2})(\d{2})-(\d{2})(\d{2})\d*", stamp)
    return f"{m[1]}-{m[2]}-{m[3]} {m[4]}:{m[5]}" if m else stamp[:16].replace("T", " ")


def _file_date(path: str) -> str:
    m = re.search(r"(\d{4})(\d{2})(\d{2})", os.path.basename(path))
    return "-".join(m.groups()) if m else "?"


READERS = [
    Reader("GEMM on host arrays", "gemm-*.json", read_gemm,
           "`bench.gemm`: C = alpha A B + beta C on numpy arrays, blasx beside cuBLAS-XT (its best block), "
           "in-core cuBLAS on one GPU (CuPy, operands already on the GPU) and numpy; every result checked."),
    Reader("Level 3 beside GEMM", "level3-*.json", read_level3,
           "`bench.level3`: every level-3 routine, blasx beside cuBLAS-XT, and its share of blasx's own GEMM rate."),
    Reader("Parallel efficiency of GEMM", "efficiency-[!m]*.json", read_efficiency,  # not efficiency-model-*
           "`bench.efficiency`: T(1) / (g T(g)) per N."),
    Reader("Offload threshold", "offload-threshold-*.log", read_offload_threshold,
           "`bench.offload_threshold`: where blasx starts beating numpy on the same call."),
    Reader("CPU worker beside the GPUs", "cpu-worker-*.json", read_cpu_worker,
           "The BLASX paper's Fig. 9 question: GPUs only against the CPU worker by demand or in auto mode."),
    Reader("Knob A/Bs", "ab-*.json", read_ab, "`bench.ab`: engine configurations alternating on one set of arrays."),
    Reader("Convolution against cuDNN", "conv-*.json", read_conv,
           "`bench.conv`: blasx.dnn forward, backward-data and backward-weight beside cuDNN through torch on "
           "one GPU, ResNet-50's conv shapes and others, per math mode; every result checked."),
    Reader("Convolution from host memory", "convhost-*.json", read_convhost,
           "`bench.conv --host`: a numpy batch in host memory on the GPUs beside torch on one GPU with copies."),
    Reader("Tall-skinny GEMM from host memory", "tallskinny-*.json", read_tallskinny,
           "`bench.tallskinny`: X^T X through blasx.gemm (split-k) beside the host-link bound and CuPy on one GPU."),
    Reader("Recurrent layers against cuDNN", "rnn-*.json", read_rnn,
           "`bench.rnn`: blasx.dnn LSTM / GRU beside cuDNN through torch, inference and training; every result "
           "checked."),
    Reader("Whole networks from host memory", "network-*.json", read_network,
           "`bench.network`: blasx.dnn.from_torch(...).compile() on 1 and 2 GPUs beside torch (cuDNN) on one GPU, "
           "the same host batch, every output checked against float64 torch."),
    Reader("Dask distributed", "dask-*.json", read_dask,
           "`bench.dask`: blasx.dask beside dask.array's own matmul and blasx in one process, each on a fresh "
           "LocalCluster; results checked on random rows."),
    Reader("The first call of a process", "first-call-*.json", read_first_call,
           "`bench.first_call`: a fresh process's first blasx.gemm (engine start-up included, operands page-locked "
           "beforehand) against its warm calls; every result checked."),
    Reader("Predicted scaling (sim)", "scaling-sim-*.json", read_scaling_sim,
           "`bench.scaling_sim`: a PREDICTION from timing sims calibrated to 2x H200, not a measurement."),
]


# --------------------------------------------------------------------------- the page


def _same_run_key(table: Table) -> tuple:
    """(machine, command without --out / --tag): runs of one command on one machine."""
    words = shlex.split(table.command.replace("python3 ", "python ", 1))
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w in ("--out", "--tag"):
            skip = True
        elif not w.startswith(("--out=", "--tag=")):
            out.append(w)
    return table.machine, tuple(out)


def _align(rows: list, col: int) -> str:
    """Markdown alignment of a column: right for numbers, left for words."""
    try:
        [float(str(r[col]).split()[0]) for r in rows if str(r[col]) != "-"]
    except (ValueError, IndexError):
        return ":--"
    return "--:"


def latest(tables: list[Table]) -> list[Table]:
    """The newest table of each (machine, command), newest first."""
    keep: dict = {}
    for t in sorted(tables, key=lambda t: (t.date, t.file), reverse=True):
        keep.setdefault(_same_run_key(t), t)
    return list(keep.values())


def render(results: str, readers=READERS) -> str:
    lines = ["# Performance", "",
             "Generated by `python -m bench.report` from the result files in `bench/results/` "
             "(do not edit by hand). TFLOPS are 1e12 flops per second. Each table names the machine, "
             "the date and the command that reproduces it; `bench/results/NOTES.md` says what each "
             "scheduling choice gained.", ""]
    for rd in readers:
        files = sorted(glob.glob(os.path.join(results, rd.pattern)))
        tables = []
        for path in files:
            t = rd.read(path)
            t.file = os.path.basename(path)
            tables.append(t)
        if not tables:
            continue
        lines += [f"## {rd.title}", "", rd.about, ""]
        for t in latest(tables):
            lines += [f"**{t.machine}**, {t.date} (`{t.file}`):", "", "```", t.command, "```", "",
                      "| " + " | ".join(t.header) + " |",
                      "| " + " | ".join(_align(t.rows, i) for i in range(len(t.header))) + " |"]
            lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in t.rows]
            lines += [""] + [f"{n}" for n in t.notes] + ([""] if t.notes else [])
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=os.path.join("bench", "results"), help="folder of result files")
    p.add_argument("--out", default=os.path.join("docs", "performance.md"), help="the page to write ('-': stdout)")
    args = p.parse_args(argv)
    if not os.path.isdir(args.results):
        p.error(f"--results: got {args.results!r}, which is not a folder")
    page = render(args.results)
    if args.out == "-":
        sys.stdout.write(page)
        return 0
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(page)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
