"""Does the CPU worker help beside the GPUs? (the question of Fig. 9 of the BLASX paper)

    python -m bench.cpu_worker --n 2048,4096,8192,16384 --gpus 1,2 --runs 3 --out bench/results

blasx DGEMM C := alpha A B + beta C (alpha 1.5, beta 0.5) on host arrays, with the GPU workers
alone (``blasx.configure(devices="cuda:0[,1]", cpu=False)``) and with the CPU worker beside them
(``cpu=True``: one more worker that solves whole tasks with numpy's BLAS on every core but one per
GPU worker). A, B, C are allocated once at the largest N (F-ordered, standard normal), page-locked
once, and every N uses compact N x N arrays in their buffers (``--layout``, as bench.efficiency).

Per N, the ``--runs`` timed calls of the four configurations (1 or 2 GPUs, with or without the CPU
worker) run in one shuffled order; the engine is reconfigured whenever the configuration changes,
and every (re)configured engine, and every new N, gets one untimed warm-up call first. C is not
reset between calls; every call is checked on sampled rows as in ``bench.efficiency`` (C after ==
alpha (A B)[rows] + beta C before, in float64). The CPU worker's share of the tasks and of the
flops comes from the call's blasx profile (``blasx.last_profile().summary()``: the device of kind
``cpu``). ``--backend sim`` runs the whole loop on sim devices (no GPU, no page-locking).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics

from .efficiency import (
    _cell, add_common_options, checked_gemm, finish_args, finish_markdown, gemm_tflops, log, new_report,
    pin_context, product_rows, run_dtypes, views, CHECK_TEXT, LAYOUT_TEXT,
)
from .level3 import CHECK_ROWS, dtype_words, sample_rows, tolerance, write_json_md


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_worker", description=__doc__.split("\n\n")[0])
    add_common_options(p, n_default="2048,4096,8192,16384", gpus_default="1,2", runs_default=3)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    return finish_args(p, p.parse_args(argv))


def schedule(gpus: list[int], runs: int, seed: int, dtype: str, n: int) -> list[tuple[int, bool, int]]:
    """All (gpus, cpu, run) of one (dtype, N), in a shuffled order fixed by the seed and the case."""
    items = [(g, cpu, k) for g in gpus for cpu in (False, True) for k in range(runs)]
    random.Random(f"{seed}:{dtype}:{n}").shuffle(items)
    return items


def cpu_share(profile: dict | None) -> tuple[float | None, float | None, int | None]:
    """(task share, flop share, tasks) of the CPU device(s) in a compact profile; Nones without one."""
    if not profile:
        return None, None, None
    cpus = [d for d in profile.get("devices", []) if d.get("kind") == "cpu"]
    if not cpus:
        return 0.0, 0.0, 0
    return (sum(d.get("share") or 0.0 for d in cpus), sum(d.get("flops_share") or 0.0 for d in cpus),
            int(sum(d.get("tasks") or 0 for d in cpus)))


def summarize(records: list[dict], gpus: list[int]) -> list[dict]:
    """One row per (dtype, N, g): best and median seconds without / with the CPU worker, the
    ratio of the best times, the CPU's mean task and flop shares over the timed runs with it."""
    out = []
    keys = sorted({(r["dtype"], r["n"], r["gpus"]) for r in records}, key=lambda k: ("ds".index(k[0]), k[1], k[2]))
    for dtype, n, g in keys:
        row: dict = {"dtype": dtype, "n": n, "gpus": g}
        for cpu in (False, True):
            mine = [r for r in records if (r["dtype"], r["n"], r["gpus"], r["cpu"]) == (dtype, n, g, cpu)]
            timed = [r for r in mine if not r["warmup"]]
            best = min((r["seconds"] for r in timed), default=None)
            e = {"best": best, "median": statistics.median([r["seconds"] for r in timed]) if timed else None,
                 "tflops": gemm_tflops(dtype, n, best) if best else None,
                 "ok": all(r["ok"] for r in mine), "calls": len(mine)}
            if cpu:
                shares = [cpu_share(r.get("profile")) for r in timed]
                tasks = [s[0] for s in shares if s[0] is not None]
                flops = [s[1] for s in shares if s[1] is not None]
                e["cpu_task_share"] = sum(tasks) / len(tasks) if tasks else None
                e["cpu_flop_share"] = sum(flops) / len(flops) if flops else None
                e["cpu_tasks"] = [s[2] for s in shares]
            row["with_cpu" if cpu else "gpus_only"] = e
        a, b = row["gpus_only"]["best"], row["with_cpu"]["best"]
        row["speedup"] = a / b if a and b else None  # > 1: the CPU worker helps
        row["ok"] = row["gpus_only"]["ok"] and row["with_cpu"]["ok"]
        out.append(row)
    return out


def format_table(rows: list[dict]) -> str:
    lines = ["| dtype | N | GPUs | TFLOPS GPUs only | TFLOPS with CPU worker | with / without | CPU task share | "
             "CPU flop share | checked |",
             "| :-- | --: | --: | --: | --: | --: | --: | --: | :-- |"]
    for r in rows:
        w, c = r["gpus_only"], r["with_cpu"]
        share_t = _cell(c.get("cpu_task_share") * 100 if c.get("cpu_task_share") is not None else None, ".1f")
        share_f = _cell(c.get("cpu_flop_share") * 100 if c.get("cpu_flop_share") is not None else None, ".1f")
        lines.append(f"| {r['dtype']} | {r['n']} | {r['gpus']} | {_cell(w['tflops'], '.2f')} | "
                     f"{_cell(c['tflops'], '.2f')} | {_cell(r['speedup'], '.3f')}x | "
                     f"{share_t}{'%' if share_t != '-' else ''} | {share_f}{'%' if share_f != '-' else ''} | "
                     f"{'ok' if r['ok'] else 'WRONG'} |")
    return "\n".join(lines)


def format_profiles(records: list[dict]) -> list[str]:
    """Per (dtype, N, g, cpu): the per-device tasks and busy / idle of the best timed call."""
    best: dict = {}
    for r in records:
        if r["warmup"] or "profile" not in r:
            continue
        key = (r["dtype"], r["n"], r["gpus"], r["cpu"])
        if key not in best or r["seconds"] < best[key]["seconds"]:
            best[key] = r
    lines = []
    for (d, n, g, cpu), r in sorted(best.items(), key=lambda kv: ("ds".index(kv[0][0]), *kv[0][1:])):
        devs = "; ".join(f"{x['name']}: {x['tasks']} tasks ({_cell((x.get('share') or 0) * 100, '.1f')}%), "
                         f"busy {_cell(x.get('busy'), '.3f')} comm {_cell(x.get('comm'), '.3f')} "
                         f"idle {_cell(x.get('idle'), '.3f')} s" for x in r["profile"].get("devices", []))
        lines.append(f"{d} N={n} {g} GPU(s) {'+ CPU' if cpu else 'only'}, {r['seconds']:.4f} s: {devs}")
    return lines


def format_markdown(report: dict) -> str:
    tol = ", ".join(f"{'1e-4' if d == 's' else '1e-9'} ({d})" for d in report["dtypes"])
    md = [f"# The CPU worker beside the GPUs ({report['tag']}, {report['date']} UTC)", "",
          "```", report["command"], "```", "",
          f"- machine: {report['machine']}",
          f"- dtypes: {dtype_words(report['dtypes'])}; GEMM alpha {report['alpha']:g}, beta {report['beta']:g}; "
          f"tile {report['tile'] or 'blasx default'}",
          "- devices: " + ", ".join(f"{g} GPU(s): `{s}` (+ `cpu=True`)" for g, s in report["specs"].items()),
          f"- A, B, C allocated once at N = {report['sizes'][-1]}, each N uses "
          f"{LAYOUT_TEXT[report.get('layout', 'views')]}; "
          f"page-locking: {report['pinning']}",
          f"- per N: {report['runs']} timed calls of each configuration in one shuffled order; one untimed warm-up "
          f"after every reconfiguration and at every new N; TFLOPS = 2 N^3 / best time",
          "- CPU task share: the CPU worker's fraction of the tasks (mean over the timed runs); flop share: of "
          "the flops",
          "- " + CHECK_TEXT.format(rows=CHECK_ROWS, tol=tol), "",
          "## Results", "", report["table"], "",
          "`with / without` > 1 means the CPU worker made the call faster.", ""]
    return finish_markdown(md, format_profiles(report["records"]), report.get("failures"))


def write_report(report: dict, out_dir: str) -> tuple[str, str]:
    rows = summarize(report["records"], report["gpus"])
    report["summary"] = rows
    report["table"] = format_table(rows)
    log(report["table"])
    base = os.path.join(out_dir, f"cpu-worker-{report['tag']}-{report['stamp']}")
    return write_json_md(base, report, format_markdown(report))


def compare_dtype(blasx, args, dtype: str, arrays: dict, report: dict) -> None:
    """Every N of one dtype: the four configurations' calls in a shuffled order (see the module
    doc). Nothing made here outlives the call, so the caller can free the arrays."""
    hold, note = pin_context(list(arrays.values()), args.pin, args.specs[args.gpus[0]])
    with hold as reg:
        if reg is not None:
            note = f"{reg.nbytes / 2**30:.1f} GiB registered once in {reg.seconds:.2f} s"
            log(f"   {note}")
        report["pinning"] = note
        current = None
        try:
            for n in args.n:
                a, b, c = views(arrays, n, args.layout)
                rows = sample_rows(n, CHECK_ROWS, args.seed)
                ab = product_rows(a, b, rows)
                tol = tolerance(dtype, n)
                warmed = set()  # configurations warmed up at this N on the current engine
                for g, cpu, k in schedule(args.gpus, args.runs, args.seed, dtype, n):
                    if (g, cpu) != current:
                        blasx.configure(devices=args.specs[g], tile=args.tile, cpu=cpu)
                        current, warmed = (g, cpu), set()
                    for warm in ([True] if (g, cpu) not in warmed else []) + [False]:
                        r = checked_gemm(blasx, dtype, a, b, c, args.alpha, args.beta, rows, ab, tol)
                        r.update(dtype=dtype, n=n, gpus=g, cpu=cpu, devices=args.specs[g], run=k,
                                 warmup=warm, tflops=gemm_tflops(dtype, n, r["seconds"]))
                        report["records"].append(r)
                        share = cpu_share(r.get("profile"))
                        log(f"   {dtype} N={n:<6} g={g} {'+cpu' if cpu else '    '} "
                            f"{'warm-up' if warm else f'run {k + 1}'}: {r['seconds']:.4f} s "
                            f"{_cell(r['tflops'], '8.2f')} TFLOPS err {_cell(r['rel_err'], '.1e')} "
                            f"{'ok' if r['ok'] else 'WRONG'}"
                            + (f"  cpu tasks {share[2]} ({_cell((share[0] or 0) * 100, '.1f')}%)"
                               if cpu and share[2] is not None else ""))
                    warmed.add((g, cpu))
        finally:
            blasx.shutdown()
    if reg is not None:
        report["registration"].append({"dtype": dtype, "gib": reg.nbytes / 2**30, "seconds": reg.seconds,
                                       "unregister_seconds": reg.unregister_seconds})


def run(args, argv) -> int:
    if importlib.util.find_spec("threadpoolctl") is None:  # the CPU worker limits numpy's BLAS threads with it
        raise SystemExit("bench.cpu_worker: the CPU worker needs threadpoolctl, which does not import here; "
                         "python3 -m pip install threadpoolctl")
    return run_dtypes(args, new_report(args, argv, "bench.cpu_worker"), compare_dtype, write_report)


def main(argv=None) -> int:
    return run(parse_args(argv), argv)


if __name__ == "__main__":
    raise SystemExit(main())
