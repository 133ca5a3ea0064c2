"""The level-3 benchmark's tables: the best run per (N, dtype, routine, contender), blasx against cuBLAS-XT
and its own GEMM, where blasx's time went per device, and the markdown report with its words for dtypes
and scalars."""

from __future__ import annotations

import math

from blasx.runtime.dtypes import BY_PREFIX, TYPES

from .level3_check import CHECK_ROWS, base_tolerance
from .level3_routines import REAL_SCALARS, ROUTINE_DTYPES, SCALARS, routines_for, scalars

#: dtype letter -> words for tables ("double complex"), from the BLAS type table
DTYPE_NAMES = {t.prefix: ("single" if t.real.itemsize == 4 else "double") + (" complex" if t.is_complex else "")
               for t in TYPES}


# --------------------------------------------------------------------------- tables


def summarize(results: list[dict]) -> dict:
    """(n, dtype, routine, who) -> its fastest run (or its failure, when no run finished), with
    all_ok over every run of that key and the first failure message, if any."""
    groups: dict = {}
    for r in results:
        groups.setdefault((r["n"], r["dtype"], r["routine"], r["who"]), []).append(r)
    table = {}
    for key, recs in groups.items():
        timed = [r for r in recs if r.get("seconds") is not None]
        best = dict(min(timed, key=lambda r: r["seconds"]) if timed else recs[0])
        best["all_ok"] = all(r["ok"] for r in recs)
        best["failure"] = next((r["failure"] for r in recs if r.get("failure")), None)
        table[key] = best
    return table


def worst_share(results: list[dict]) -> dict:
    """(n, dtype, routine) -> the lowest, over run numbers both have, of blasx's TFLOPS in run r over blasx
    GEMM's in run r (issue 24 asks for a share in each run, not the best one); a failed run counts as 0."""
    runs: dict = {}
    for r in results:
        if r["who"] == "blasx" and r.get("run") is not None:
            runs[(r["n"], r["dtype"], r["routine"], r["run"])] = (r.get("tflops") or 0.0) if r.get("ok") else 0.0
    worst: dict = {}
    for (n, d, rt, k), tf in runs.items():
        g = runs.get((n, d, "gemm", k))
        if g:
            worst[(n, d, rt)] = min(worst.get((n, d, rt), math.inf), tf / g)
    return worst


def _tf(e) -> str:
    return f"{e['tflops']:.1f}" if e and e.get("tflops") else "-"


def format_table(results: list[dict], routines, dtypes) -> str:
    """Markdown table: one row per (N, dtype, routine), best run of each contender, and blasx's lowest
    share of its GEMM over the runs (``worst_share``)."""
    table, worst = summarize(results), worst_share(results)
    lines = ["| N | dtype | routine | blasx TFLOPS | cuBLAS-XT TFLOPS | blasx / XT | blasx / blasx GEMM "
             "| worst run / GEMM | checked |",
             "| --: | :-- | :-- | --: | --: | --: | --: | --: | :-- |"]
    for n in sorted({k[0] for k in table}):
        for d in dtypes:
            g = table.get((n, d, "gemm", "blasx"))
            for rt in routines:
                b, x = table.get((n, d, rt, "blasx")), table.get((n, d, rt, "cublasxt"))
                if not b and not x:
                    continue
                here = [e for e in (b, x) if e]
                if any(e["failure"] for e in here):
                    status = "FAILED (" + ", ".join(w for w, e in (("blasx", b), ("cuBLAS-XT", x))
                                                    if e and e["failure"]) + ")"
                else:
                    status = "ok" if all(e["all_ok"] for e in here) else "WRONG"
                ratio = f"{b['tflops'] / x['tflops']:.2f}x" if b and x and b.get("tflops") and x.get("tflops") else "-"
                share = f"{b['tflops'] / g['tflops']:.2f}" if b and g and b.get("tflops") and g.get("tflops") else "-"
                low = f"{worst[(n, d, rt)]:.2f}" if (n, d, rt) in worst else "-"
                lines.append(f"| {n} | {d} | {d}{rt} | {_tf(b)} | {_tf(x)} | {ratio} | {share} | {low} | {status} |")
    return "\n".join(lines)


def device_times(profile) -> list[dict] | None:
    """Where a blasx call's time went on each device (fractions of the call's wall time): busy computing,
    copying with nothing computing, idle before its first operation (lead), after its last (tail) and in
    between; tasks it ran. None without a profile."""
    if profile is None or profile.wall <= 0:
        return None
    w = profile.wall
    return [{"name": b.name, "tasks": b.tasks, "busy": b.busy / w, "comm": b.comm / w, "lead": b.lead / w,
             "tail": b.tail / w, "gaps": max(b.idle - b.lead - b.tail, 0.0) / w}
            for b in profile.breakdown()]


def format_breakdown(results: list[dict], routines, dtypes) -> str:
    """Markdown table of the best blasx run of each (N, dtype, routine): per device, percent of the call busy /
    copying alone / idle at the start, in gaps, at the end, and its tasks."""
    table = summarize(results)
    lines = ["| N | routine | device | busy | copy only | idle: start | gaps | end | tasks |",
             "| --: | :-- | :-- | --: | --: | --: | --: | --: | --: |"]
    for n in sorted({k[0] for k in table}):
        for d in dtypes:
            for rt in routines:
                b = table.get((n, d, rt, "blasx"))
                for dev in (b or {}).get("devices") or []:
                    lines.append(f"| {n} | {d}{rt} | {dev['name']} | " + " | ".join(
                        f"{100 * dev[k]:.0f}%" for k in ("busy", "comm", "lead", "gaps", "tail")) + f" | {dev['tasks']} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def format_failures(results: list[dict]) -> list[str]:
    return [f"{r['who']} {r['dtype']}{r['routine']} N={r['n']}: {r['failure']}" for r in results if r.get("failure")]


# --------------------------------------------------------------------------- words and the report


def dtype_words(dtypes) -> str:
    return ", ".join(f"{DTYPE_NAMES[d]} ({d})" for d in dtypes)


def _scalar_text(v) -> str:
    return f"{v:g}"


def scalar_words(dtypes) -> str:
    """'alpha 1.5, beta 0.5' for s and d; with c or z: each group of dtypes with its scalars, and
    the Hermitian routines' real ones ('herk: alpha 1.5, beta 0.5; her2k: beta 0.5')."""
    groups: dict = {}
    for d in dtypes:
        groups.setdefault(SCALARS[d], []).append(d)
    parts = []
    for (alpha, beta), ds in groups.items():
        text = f"alpha {_scalar_text(alpha)}, beta {_scalar_text(beta)}"
        real = [f"{r}: " + ", ".join(f"{w} {_scalar_text(v)}" for w, v, flag in
                                     zip(("alpha", "beta"), scalars(ds[0], r), REAL_SCALARS[r]) if flag)
                for r in REAL_SCALARS if any(d in ROUTINE_DTYPES[r] for d in ds)]
        notes = ([", ".join(ds)] if len(groups) > 1 else []) + real
        parts.append(text + (f" ({'; '.join(notes)})" if notes else ""))
    return "; ".join(parts)


def scalar_table(dtypes, routines) -> dict:
    """{dtype: {routine: [alpha, beta]}} of the routines run, for the JSON (a complex value as
    [real, imaginary])."""
    def js(v):
        return [v.real, v.imag] if isinstance(v, complex) else v
    return {d: {r: [js(v) for v in scalars(d, r)] for r in routines_for(d, routines)} for d in dtypes}


def format_markdown(report: dict) -> str:
    dtypes = report["dtypes"]
    tol = ", ".join(f"{base_tolerance(d):g} ({d})" for d in dtypes)
    ref = "float64" + (" / complex128" if any(BY_PREFIX[d].is_complex for d in dtypes) else "")
    return (f"# Level-3 routines: blasx vs cuBLAS-XT ({report['tag']}, {report['date']} UTC), "
            f"dtypes: {dtype_words(dtypes)}\n\n"
            f"```\n{report['command']}\n```\n\n"
            f"Machine: {report.get('machine', '?')}\n\n"
            f"Best of {report['runs']} shuffled runs after one warm-up each; {dtype_words(dtypes)} "
            f"precision, registered host arrays, upper / no transpose / left / non-unit, "
            f"{scalar_words(dtypes)}, blasx tile "
            f"{report.get('tile') or 'chosen per call'}. Checked on {CHECK_ROWS} sampled rows "
            f"against {ref} numpy; tolerance on the relative error {tol} x max(1, sqrt(N/8192)). "
            f"TFLOPS count real flops (complex: 4x the real routine's).\n\n"
            f"{report['table']}\n"
            + (f"\n## Where blasx's time went (best run, per device)\n\n{report['breakdown']}\n"
               if report.get("breakdown") else "")
            + ("\n## Failures\n\n" + "".join(f"- {x}\n" for x in report["failures"]) if report.get("failures") else ""))
