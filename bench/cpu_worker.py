"""Does the CPU worker help beside the GPUs? (the question of Fig. 9 of the BLASX paper)

    python -m bench.cpu_worker --n 2048,4096,8192,16384 --gpus 1,2 --runs 3 --out bench/results

blasx DGEMM C := alpha A B + beta C (alpha 1.5, beta 0.5) on host arrays in three modes
(``--modes``, default all): the GPU workers alone (``off``: ``blasx.configure(devices="cuda:0[,1]",
cpu=False)``), the CPU worker beside them taking tasks by demand (``on``: ``cpu=True``, one more
worker that solves whole tasks with numpy's BLAS on every core but one per GPU worker), and the CPU
worker in auto mode (``auto``: ``cpu="auto"``, what ``cpu=None`` gives beside CUDA GPUs: it takes a
task only when the admission rule of ``runtime/admission.py`` predicts it done before the GPUs
would finish the rest of the call). A, B, C are allocated once at the largest N (F-ordered,
standard normal), page-locked once, and every N uses compact N x N arrays in their buffers
(``--layout``, as bench.efficiency).

Per N, the ``--runs`` timed calls of every configuration (GPU count x mode) run in one shuffled
order; the engine is reconfigured whenever the configuration changes, and every (re)configured
engine, and every new N, gets one untimed warm-up call first (so auto mode starts each N with the
rates its warm-up measured). C is not reset between calls; every call is checked on sampled rows
as in ``bench.efficiency`` (C after == alpha (A B)[rows] + beta C before, in float64). The CPU
worker's share of the tasks and of the flops comes from the call's blasx profile
(``blasx.last_profile().summary()``: the device of kind ``cpu``). ``--backend sim`` runs the whole
loop on sim devices (no GPU, no page-locking; ``--devices-spec 'sim:{g},rate=1e9'`` sets their
speed).
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


#: The modes, in table order, and what each passes to ``blasx.configure(cpu=...)``.
MODES = ("off", "on", "auto")
CPU_ARG = {"off": False, "on": True, "auto": "auto"}
MODE_TEXT = {"off": "GPUs only", "on": "+ CPU (cpu=True)", "auto": "+ CPU auto"}


def parse_modes(text: str) -> list[str]:
    modes = [x.strip() for x in text.split(",") if x.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"--modes: got {text!r}; allowed: a comma list of distinct "
                                         f"{', '.join(MODES)}")
    return sorted(modes, key=MODES.index)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_worker", description=__doc__.split("\n\n")[0])
    add_common_options(p, n_default="2048,4096,8192,16384", gpus_default="1,2", runs_default=3)
    p.add_argument("--modes", type=parse_modes, default=list(MODES),
                   help="comma list of off (GPUs only), on (cpu=True), auto (cpu='auto') (default all)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    return finish_args(p, p.parse_args(argv))


def mode_of(record: dict) -> str:
    """A record's mode; records of the two-mode version have ``cpu`` False / True."""
    cpu = record["cpu"]
    return cpu if isinstance(cpu, str) else ("on" if cpu else "off")


def schedule(gpus: list[int], runs: int, seed: int, dtype: str, n: int,
             modes=MODES) -> list[tuple[int, str, int]]:
    """All (gpus, mode, run) of one (dtype, N), in a shuffled order fixed by the seed and the case."""
    items = [(g, m, k) for g in gpus for m in modes for k in range(runs)]
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
    """One row per (dtype, N, g): per mode present (``gpus_only``, ``with_cpu``, ``auto``) the best
    and median seconds, and for the CPU modes its mean task and flop shares over the timed runs;
    ``speedup`` = best off / best on and ``auto_speedup`` = best off / best auto (> 1: faster)."""
    out = []
    keys = sorted({(r["dtype"], r["n"], r["gpus"]) for r in records}, key=lambda k: ("ds".index(k[0]), k[1], k[2]))
    for dtype, n, g in keys:
        row: dict = {"dtype": dtype, "n": n, "gpus": g}
        for mode, name in (("off", "gpus_only"), ("on", "with_cpu"), ("auto", "auto")):
            mine = [r for r in records if (r["dtype"], r["n"], r["gpus"]) == (dtype, n, g) and mode_of(r) == mode]
            if not mine:
                continue
            timed = [r for r in mine if not r["warmup"]]
            best = min((r["seconds"] for r in timed), default=None)
            e = {"best": best, "median": statistics.median([r["seconds"] for r in timed]) if timed else None,
                 "tflops": gemm_tflops(dtype, n, best) if best else None,
                 "ok": all(r["ok"] for r in mine), "calls": len(mine)}
            if mode != "off":
                shares = [cpu_share(r.get("profile")) for r in timed]
                tasks = [s[0] for s in shares if s[0] is not None]
                flops = [s[1] for s in shares if s[1] is not None]
                e["cpu_task_share"] = sum(tasks) / len(tasks) if tasks else None
                e["cpu_flop_share"] = sum(flops) / len(flops) if flops else None
                e["cpu_tasks"] = [s[2] for s in shares]
            row[name] = e
        base = row.get("gpus_only", {}).get("best")
        for name, key in (("with_cpu", "speedup"), ("auto", "auto_speedup")):
            other = row.get(name, {}).get("best")
            row[key] = base / other if base and other else None
        row["ok"] = all(row[name]["ok"] for name in ("gpus_only", "with_cpu", "auto") if name in row)
        out.append(row)
    return out


def _times(x) -> str:
    return "-" if x is None else f"{x:.3f}x"


def _pct(x) -> str:
    cell = _cell(x * 100 if x is not None else None, ".1f")
    return cell + ("%" if cell != "-" else "")


def format_table(rows: list[dict]) -> str:
    lines = ["| dtype | N | GPUs | TFLOPS GPUs only | TFLOPS + CPU (cpu=True) | TFLOPS + CPU auto | on / off | "
             "auto / off | CPU task share on | CPU task share auto | CPU flop share on | CPU flop share auto | "
             "checked |",
             "| :-- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | :-- |"]
    for r in rows:
        w, c, a = r.get("gpus_only", {}), r.get("with_cpu", {}), r.get("auto", {})
        lines.append(f"| {r['dtype']} | {r['n']} | {r['gpus']} | {_cell(w.get('tflops'), '.2f')} | "
                     f"{_cell(c.get('tflops'), '.2f')} | {_cell(a.get('tflops'), '.2f')} | "
                     f"{_times(r['speedup'])} | {_times(r['auto_speedup'])} | "
                     f"{_pct(c.get('cpu_task_share'))} | {_pct(a.get('cpu_task_share'))} | "
                     f"{_pct(c.get('cpu_flop_share'))} | {_pct(a.get('cpu_flop_share'))} | "
                     f"{'ok' if r['ok'] else 'WRONG'} |")
    return "\n".join(lines)


def format_profiles(records: list[dict]) -> list[str]:
    """Per (dtype, N, g, mode): the per-device tasks and busy / idle of the best timed call."""
    best: dict = {}
    for r in records:
        if r["warmup"] or "profile" not in r:
            continue
        key = (r["dtype"], r["n"], r["gpus"], MODES.index(mode_of(r)))
        if key not in best or r["seconds"] < best[key]["seconds"]:
            best[key] = r
    lines = []
    for (d, n, g, m), r in sorted(best.items(), key=lambda kv: ("ds".index(kv[0][0]), *kv[0][1:])):
        devs = "; ".join(f"{x['name']}: {x['tasks']} tasks ({_cell((x.get('share') or 0) * 100, '.1f')}%), "
                         f"busy {_cell(x.get('busy'), '.3f')} comm {_cell(x.get('comm'), '.3f')} "
                         f"idle {_cell(x.get('idle'), '.3f')} s" for x in r["profile"].get("devices", []))
        lines.append(f"{d} N={n} {g} GPU(s) {MODE_TEXT[MODES[m]]}, {r['seconds']:.4f} s: {devs}")
    return lines


def format_markdown(report: dict) -> str:
    tol = ", ".join(f"{'1e-4' if d == 's' else '1e-9'} ({d})" for d in report["dtypes"])
    md = [f"# The CPU worker beside the GPUs ({report['tag']}, {report['date']} UTC)", "",
          "```", report["command"], "```", "",
          f"- machine: {report['machine']}",
          f"- dtypes: {dtype_words(report['dtypes'])}; GEMM alpha {report['alpha']:g}, beta {report['beta']:g}; "
          f"tile {report['tile'] or 'blasx default'}",
          "- devices: " + ", ".join(f"{g} GPU(s): `{s}`" for g, s in report["specs"].items())
          + "; modes: " + ", ".join(f"{m} (`cpu={CPU_ARG[m]!r}`)" for m in report.get("modes", ["off", "on"])),
          f"- A, B, C allocated once at N = {report['sizes'][-1]}, each N uses "
          f"{LAYOUT_TEXT[report.get('layout', 'views')]}; "
          f"page-locking: {report['pinning']}",
          f"- per N: {report['runs']} timed calls of each configuration in one shuffled order; one untimed warm-up "
          f"after every reconfiguration and at every new N; TFLOPS = 2 N^3 / best time",
          "- CPU task share: the CPU worker's fraction of the tasks (mean over the timed runs); flop share: of "
          "the flops",
          "- " + CHECK_TEXT.format(rows=CHECK_ROWS, tol=tol), "",
          "## Results", "", report["table"], "",
          "`on / off`, `auto / off` > 1: the CPU worker (by demand, auto) made the call faster.", ""]
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
                for g, mode, k in schedule(args.gpus, args.runs, args.seed, dtype, n, args.modes):
                    if (g, mode) != current:
                        blasx.configure(devices=args.specs[g], tile=args.tile, cpu=CPU_ARG[mode])
                        current, warmed = (g, mode), set()
                    for warm in ([True] if (g, mode) not in warmed else []) + [False]:
                        r = checked_gemm(blasx, dtype, a, b, c, args.alpha, args.beta, rows, ab, tol)
                        r.update(dtype=dtype, n=n, gpus=g, cpu=mode, devices=args.specs[g], run=k,
                                 warmup=warm, tflops=gemm_tflops(dtype, n, r["seconds"]))
                        report["records"].append(r)
                        share = cpu_share(r.get("profile"))
                        log(f"   {dtype} N={n:<6} g={g} {mode:<4} "
                            f"{'warm-up' if warm else f'run {k + 1}'}: {r['seconds']:.4f} s "
                            f"{_cell(r['tflops'], '8.2f')} TFLOPS err {_cell(r['rel_err'], '.1e')} "
                            f"{'ok' if r['ok'] else 'WRONG'}"
                            + (f"  cpu tasks {share[2]} ({_cell((share[0] or 0) * 100, '.1f')}%)"
                               if mode != "off" and share[2] is not None else ""))
                    warmed.add((g, mode))
        finally:
            blasx.shutdown()
    if reg is not None:
        report["registration"].append({"dtype": dtype, "gib": reg.nbytes / 2**30, "seconds": reg.seconds,
                                       "unregister_seconds": reg.unregister_seconds})


def run(args, argv) -> int:
    if importlib.util.find_spec("threadpoolctl") is None:  # the CPU worker limits numpy's BLAS threads with it
        raise SystemExit("bench.cpu_worker: the CPU worker needs threadpoolctl, which does not import here; "
                         "python3 -m pip install threadpoolctl")
    report = new_report(args, argv, "bench.cpu_worker")
    report["modes"] = args.modes
    return run_dtypes(args, report, compare_dtype, write_report)


def main(argv=None) -> int:
    return run(parse_args(argv), argv)


if __name__ == "__main__":
    raise SystemExit(main())
