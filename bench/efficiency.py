"""Parallel efficiency of blasx GEMM over N and the GPU count (issue 3).

    python -m bench.efficiency --n 4096:40960:4096 --dtypes d --gpus 1,2 --runs 2 --out bench/results

A, B and C are allocated once, at the largest N: F-ordered, standard normal, drawn in float64
(float32 is the float64 draws cast once; when both dtypes run, double runs first and its arrays
are freed as they are cast). They are page-locked once per dtype, and every N uses compact
F-ordered N x N arrays made of the first N*N elements of those buffers (``--layout views``: the
top-left views A[:n, :n], ..., with leading dimension N_max, as before 2026-11-22). The loop runs
by GPU count g (the engine is configured once per g: devices ``cuda:0``, ``cuda:0,1``, ...), then
by N: one warm-up, then ``--runs`` timed calls of C := alpha A B + beta C (alpha 1.5, beta 0.5)
with ``overwrite_c=True``.

C is not reset between calls (a reset of a 13 GB view would take longer than the call): each call
starts from the C the previous call left, and every call, warm-ups too, is checked. The sampled
rows of C are negated (a call writing nothing fails even near C's fixed point) and saved before the
call; after it they must equal alpha (A B)[rows] + beta C_before[rows]
computed by numpy in float64 ((A B)[rows] once per N and dtype); tolerance on the relative error
1e-9 (d) / 1e-4 (s), x sqrt(N / 8192) above 8192. C stays bounded: its fixed point is
alpha / (1 - beta) A B.

Efficiency(N, g) = g0 T(N, g0) / (g T(N, g)), T the best timed run and g0 the smallest GPU
count asked for (1: the usual T1 / (g Tg)). ``--backend sim`` (devices ``sim:g``, no page-locking)
runs the whole loop on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import time

import numpy as np

from blasx.runtime.dtypes import BY_PREFIX

from .level3 import ArgError, parse_dtypes, parse_positive_list, positive_int
from .level3_check import (
    CHECK_ROWS, _column_chunks, _parallel, random_matrix, rows64, rows_times, sample_rows, tolerance,
)
from .level3_contenders import blasx_routine
from .level3_table import DTYPE_NAMES, dtype_words
from .machine import gpu_tag, machine_name
from .result_files import command_line, finite, utc_stamp, write_json_md

BACKENDS = ("cuda", "sim", "cpu")
PIN_MODES = ("auto", "on", "off")
DEFAULT_TAG = {"sim": "sim", "cpu": "cpu"}  # cuda: the GPU model and count, machine.gpu_tag
#: seed offsets of A, B, C
_WHICH = {"a": 0, "b": 1, "c": 2}


# --------------------------------------------------------------------------- arguments


def parse_sizes(text: str, option: str = "--n") -> list[int]:
    """'4096:40960:4096' (start:stop:step, stop included) or '4096,8192' -> sorted distinct sizes."""
    text = str(text).strip()
    allowed = "start:stop:step (stop included) or a comma list of positive integers"
    try:
        if ":" in text:
            parts = [int(x) for x in text.split(":")]
            if len(parts) != 3:
                raise ValueError
            start, stop, step = parts
            if start <= 0 or step <= 0 or stop < start:
                raise ValueError
            values = list(range(start, stop + 1, step))
        else:
            values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise ArgError(f"{option}: got {text!r}; allowed: {allowed}")
    return sorted(set(values))


def parse_counts(text: str, option: str = "--gpus") -> list[int]:
    """'1,2' -> [1, 2]: distinct positive GPU counts, ascending."""
    try:
        return sorted(parse_positive_list(text, option))
    except ArgError:
        raise ArgError(f"{option}: got {text!r}; allowed: a comma list of positive GPU counts, e.g. 1,2") from None


def parse_scalar(option: str):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v):
            raise ArgError(f"{option}: got {text!r}; allowed: a finite real number")
        return v
    return parse


def device_spec(backend: str, g: int, template: str | None = None) -> str:
    """The blasx device spec for g GPUs: cuda -> 'cuda:0,..,g-1', sim -> 'sim:g', cpu -> 'cpu'
    (g = 1 only); a template ('sim:{g},slow=2', 'cuda:{ids}') overrides the backend's."""
    ids = ",".join(str(i) for i in range(g))
    if template is not None:
        if "{g}" not in template and "{ids}" not in template:
            raise ArgError(f"--devices-spec: got {template!r}; allowed: a blasx device spec with {{g}} (the GPU "
                           f"count) or {{ids}} (0,..,g-1) in it, e.g. 'sim:{{g}}' or 'cuda:{{ids}}'")
        try:
            return template.format(g=g, ids=ids)
        except (KeyError, IndexError, ValueError) as e:
            raise ArgError(f"--devices-spec: got {template!r}; only {{g}} and {{ids}} may appear in braces "
                           f"({type(e).__name__}: {e})") from None
    if backend == "cuda":
        return "cuda:" + ids
    if backend == "sim":
        return f"sim:{g}"
    if backend == "cpu":
        if g != 1:
            raise ArgError(f"--gpus: got a count of {g} with --backend cpu; allowed: 1 only (one CPU device)")
        return "cpu"
    raise ArgError(f"--backend: got {backend!r}; allowed: {', '.join(BACKENDS)}")


def add_common_options(p: argparse.ArgumentParser, *, n_default: str, gpus_default: str, runs_default: int,
                       dtypes: bool = True) -> None:
    """The options of the efficiency bench (sizes, GPU counts, runs, scalars, devices, layout, output)."""
    p.add_argument("--n", type=parse_sizes, default=parse_sizes(n_default),
                   help=f"sizes: start:stop:step (stop included) or a comma list (default {n_default})")
    if dtypes:
        p.add_argument("--dtypes", type=parse_dtypes, default=["d"], help="comma list of s,d (default d)")
    p.add_argument("--gpus", type=parse_counts, default=parse_counts(gpus_default),
                   help=f"comma list of GPU counts (default {gpus_default})")
    p.add_argument("--runs", type=positive_int("--runs"), default=runs_default,
                   help=f"timed calls per case (default {runs_default})")
    p.add_argument("--alpha", type=parse_scalar("--alpha"), default=1.5, help="alpha (default 1.5)")
    p.add_argument("--beta", type=parse_scalar("--beta"), default=0.5,
                   help="beta (default 0.5; C is not reset between calls, see the module doc)")
    p.add_argument("--tile", type=positive_int("--tile"), default=None,
                   help="blasx tile size (blasx.configure(tile=...); default: blasx's choice)")
    p.add_argument("--backend", choices=BACKENDS, default="cuda",
                   help="cuda: devices cuda:0..g-1 (default); sim: sim:g; cpu: the host (g = 1)")
    p.add_argument("--devices-spec", default=None,
                   help="blasx device spec template overriding --backend's, with {g} or {ids}: 'sim:{g},slow=2'")
    p.add_argument("--pin", choices=PIN_MODES, default="auto",
                   help="page-lock the host arrays once (auto: when the devices are CUDA and CuPy imports)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrays (and of the run order)")
    p.add_argument("--layout", choices=LAYOUTS, default="contiguous",
                   help="operands of each N: compact N x N arrays in the N_max buffers (contiguous, default) "
                        "or their top-left N x N views (leading dimension N_max)")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="result directory (default bench/results)")
    p.add_argument("--tag", default=None, help="name in the result files (default: GPU model and largest --gpus, h200x2; sim / cpu backends: sim / cpu)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.efficiency", description=__doc__.split("\n\n")[0])
    add_common_options(p, n_default="4096:40960:4096", gpus_default="1,2", runs_default=2)
    p.add_argument("--warmup", type=int, default=1, help="untimed (but checked) calls per (g, N) first (default 1)")
    m = p.add_argument_group("--model: a PREDICTION in the 2x H200 timing model (bench/efficiency_model.py)")
    m.add_argument("--model", choices=["h200"], default=None, help="predict on data-free timing sims, no GPU")
    m.add_argument("--issue", type=float, default=None, help="host seconds per launch, serialised (default 50e-6)")
    m.add_argument("--call-cost", type=float, default=0.0, help="host seconds per call outside the engine (default 0)")
    m.add_argument("--dilate", type=float, default=8.0, help="time dilation of the sims (default 8)")
    m.add_argument("--small-n", default=None, metavar="G:L:P",
                   help="small_n_tiles on, with granule G, least tile L, P tasks per stream (blasx.tile.SMALL_N)")
    m.add_argument("--measured", default=None, help="a bench.efficiency JSON report to set beside the predictions")
    return p


def finish_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if getattr(args, "warmup", 0) < 0:
        p.error(f"--warmup: got {args.warmup}; allowed: an integer >= 0")
    try:
        args.specs = {g: device_spec(args.backend, g, args.devices_spec) for g in args.gpus}
    except ArgError as e:
        p.error(str(e))
    if getattr(args, "model", None):
        from .efficiency_model import ISSUE
        args.issue = ISSUE if args.issue is None else args.issue
        if not (0 <= args.issue < 1e-2 and 0 <= args.call_cost < 1 and args.dilate >= 1):
            p.error(f"--issue / --call-cost / --dilate: got {args.issue} / {args.call_cost} / {args.dilate}; "
                    f"allowed: seconds from 0 to 0.01, seconds from 0 to 1, a dilation >= 1")
        if args.small_n is not None:
            try:
                args.small_n = tuple(int(x) for x in args.small_n.split(":"))
            except ValueError:
                args.small_n = ()
            if len(args.small_n) != 3 or min(args.small_n) < 1:
                p.error(f"--small-n: got {args.small_n!r}; allowed: G:L:P, three ints >= 1, e.g. 512:2048:2")
        args.tag = args.tag or f"{args.model}x{max(args.gpus)}"
    args.tag = args.tag or DEFAULT_TAG.get(args.backend) or gpu_tag(max(args.gpus))
    if hasattr(args, "dtypes"):  # double first: the float32 arrays are cast from its arrays
        args.dtypes = sorted(args.dtypes, key="ds".index)
    return args


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    return finish_args(p, p.parse_args(argv))


# --------------------------------------------------------------------------- arrays


def allocate(nmax: int, dtype: str, seed: int) -> dict[str, np.ndarray]:
    """A, B, C at N_max in `dtype` (float32: the float64 draws of the same seed, cast by chunks)."""
    return {k: random_matrix(nmax, nmax, BY_PREFIX[dtype].dtype, [seed, nmax, i]) for k, i in _WHICH.items()}


def cast_arrays(arrays: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """The arrays cast to `dtype`, one at a time, each source dropped from `arrays` (and freed, if
    nothing else holds it) as soon as it is cast: the peak is the old arrays plus one new one."""
    out = {}
    for k in list(arrays):
        src = arrays.pop(k)
        dst = np.empty(src.shape, dtype=BY_PREFIX[dtype].dtype, order="F")
        _parallel(lambda c: np.copyto(dst[:, c[0]:c[1]], src[:, c[0]:c[1]], casting="unsafe"),
                  _column_chunks(src.shape[1], 1024))
        out[k] = dst
        del src
        gc.collect()
    return out


def arrays_for(dtype: str, nmax: int, seed: int, previous: dict | None) -> dict[str, np.ndarray]:
    """The arrays of `dtype`: cast from the previous dtype's arrays when there are some (emptying
    that dict), else drawn afresh."""
    if previous:
        return cast_arrays(previous, dtype)
    return allocate(nmax, dtype, seed)


def pin_context(arrays, mode: str, spec: str):
    """(context manager, note): registered(...) over the arrays when pinning applies, else a
    null context and the reason it does not."""
    if mode == "off":
        return contextlib.nullcontext(None), "off (--pin off)"
    if mode == "auto" and not spec.startswith("cuda"):
        return contextlib.nullcontext(None), f"skipped: devices {spec} are not CUDA"
    try:
        import cupy  # noqa: F401
    except Exception as e:  # noqa: BLE001
        if mode == "on":
            raise RuntimeError(f"--pin on: CuPy does not import ({type(e).__name__}: {e})") from e
        return contextlib.nullcontext(None), f"skipped: CuPy does not import ({type(e).__name__})"
    from .cublasxt import registered
    return registered(*arrays), None


LAYOUTS = ("contiguous", "views")
LAYOUT_TEXT = {"contiguous": "compact F-ordered N x N arrays in the first N*N elements of those buffers",
               "views": "the top-left N x N views (leading dimension N_max)"}


def views(arrays: dict[str, np.ndarray], n: int, layout: str = "views"):
    """A, B, C for size ``n``, sharing the N_max arrays' memory (so registered once).

    ``views``: the top-left N x N blocks (leading dimension N_max); ``contiguous``: the first
    N*N elements of each array's column-major buffer, as a compact F-ordered N x N array (what
    a user's own arrays are). Host copies of strided tiles are slower (2-D copies with a long
    pitch: 34 vs 51 GB/s measured on H200 for 2048-tiles at ld = 4N), which the views layout
    charges to small N.
    """
    if layout == "views":
        return arrays["a"][:n, :n], arrays["b"][:n, :n], arrays["c"][:n, :n]
    return tuple(arrays[k].ravel(order="F")[:n * n].reshape((n, n), order="F") for k in "abc")


def product_rows(a: np.ndarray, b: np.ndarray, rows) -> np.ndarray:
    """(a @ b)[rows] in float64."""
    return rows_times(rows64(a, rows), b)


# --------------------------------------------------------------------------- one checked call


def compact_profile(summary: dict) -> dict:
    """The parts of blasx.last_profile().summary() worth keeping per run."""
    devs = []
    flops_total = sum(d.get("flops", 0.0) for d in summary.get("devices", [])) or 0.0
    for d in summary.get("devices", []):
        devs.append({k: d.get(k) for k in ("name", "kind", "tasks", "flops", "busy", "comm", "idle",
                                           "overlapped_comm", "share", "tflops")}
                    | {"flops_share": (d.get("flops", 0.0) / flops_total) if flops_total else 0.0})
    totals = summary.get("totals", {})
    return {"wall": summary.get("wall"), "tflops": summary.get("tflops"), "tasks": summary.get("tasks"),
            "totals": {k: totals.get(k) for k in ("bytes_h2d", "bytes_d2h", "bytes_p2p", "l1_hits", "l2_hits",
                                                  "misses", "steals")},
            "devices": devs}


def checked_gemm(blasx, dtype: str, a, b, c, alpha: float, beta: float, rows, ab_rows, tol: float) -> dict:
    """One timed call C := alpha A B + beta C in place on the views, checked on `rows` against
    alpha ab_rows + beta C_before[rows] (float64). The sampled rows are negated first (untimed): C is never
    reset, so repeated calls approach alpha AB / (1 - beta), where a call writing nothing would pass.
    Returns seconds, rel_err, ok, in_place, profile."""
    fn = blasx_routine(blasx, dtype, "gemm")
    c[rows] *= -1
    before = rows64(c, rows)
    t0 = time.perf_counter()
    res = fn(alpha, a, b, beta=beta, c=c, overwrite_c=True)
    seconds = time.perf_counter() - t0
    in_place = res is c or (isinstance(res, np.ndarray) and res.ctypes.data == c.ctypes.data
                            and res.shape == c.shape and res.strides == c.strides)
    ref = alpha * ab_rows + beta * before
    got = rows64(c, rows)
    den = float(np.linalg.norm(ref))
    err = float(np.linalg.norm(got - ref)) / den if den > 0 else float(np.linalg.norm(got - ref))
    ok = bool(in_place and err <= tol)  # NaN fails
    out = {"seconds": seconds, "rel_err": finite(err), "ok": ok, "in_place": bool(in_place)}
    try:
        out["profile"] = compact_profile(blasx.last_profile().summary())
    except Exception as e:  # noqa: BLE001 - a profile is a bonus
        out["profile_error"] = f"{type(e).__name__}: {e}"
    return out


def gemm_tflops(dtype: str, n: int, seconds: float) -> float | None:
    return 2.0 * n**3 / seconds / 1e12 if seconds and seconds > 0 else None


# --------------------------------------------------------------------------- summary and tables


def summarize(records: list[dict], gpus: list[int]) -> list[dict]:
    """One row per (dtype, N): per g the best / median timed seconds, best TFLOPS, efficiency
    against the smallest g (None where a call of either was wrong), and whether every call (warm-ups
    included) was correct."""
    g0 = min(gpus)
    keys = sorted({(r["dtype"], r["n"]) for r in records}, key=lambda k: ("ds".index(k[0]), k[1]))
    rows = []
    for dtype, n in keys:
        row = {"dtype": dtype, "n": n, "per_g": {}}
        for g in gpus:
            mine = [r for r in records if (r["dtype"], r["n"], r["gpus"]) == (dtype, n, g)]
            timed = [r["seconds"] for r in mine if not r["warmup"]]
            if not mine:
                continue
            best = min(timed) if timed else None
            row["per_g"][g] = {"best": best, "median": statistics.median(timed) if timed else None,
                               "tflops": gemm_tflops(dtype, n, best) if best else None,
                               "ok": all(r["ok"] for r in mine), "calls": len(mine)}
        base = row["per_g"].get(g0, {})
        base = base.get("best") if base.get("ok") else None
        for g, e in row["per_g"].items():  # (a wrong call anywhere in a pair: no efficiency, not in the mean)
            e["efficiency"] = (g0 * base) / (g * e["best"]) if base and e["best"] and e["ok"] else None
        row["ok"] = all(e["ok"] for e in row["per_g"].values())
        rows.append(row)
    return rows


def average_efficiency(rows: list[dict], gpus: list[int]) -> dict:
    """dtype -> g -> mean efficiency over the N with a value (g > smallest g)."""
    out: dict = {}
    g0 = min(gpus)
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for g in gpus:
            if g == g0:
                continue
            vals = [r["per_g"][g]["efficiency"] for r in rows
                    if r["dtype"] == dtype and g in r["per_g"] and r["per_g"][g]["efficiency"] is not None]
            if vals:
                out.setdefault(dtype, {})[g] = {"mean": sum(vals) / len(vals), "min": min(vals),
                                                "max": max(vals), "sizes": len(vals)}
    return out


def _cell(x, spec):
    return "-" if x is None else format(x, spec)


def format_table(rows: list[dict], gpus: list[int]) -> str:
    g0 = min(gpus)
    head = ["dtype", "N"]
    for g in gpus:
        head += [f"{g} GPU s", f"{g} GPU TFLOPS"] + ([f"eff. {g} GPUs"] if g != g0 else [])
    head.append("checked")
    lines = ["| " + " | ".join(head) + " |",
             "| " + " | ".join([":--", "--:"] + ["--:"] * (len(head) - 3) + [":--"]) + " |"]
    for r in rows:
        cells = [r["dtype"], str(r["n"])]
        for g in gpus:
            e = r["per_g"].get(g, {})
            cells += [_cell(e.get("best"), ".4f"), _cell(e.get("tflops"), ".2f")]
            if g != g0:
                cells.append(_cell(e.get("efficiency"), ".3f"))
        cells.append("ok" if r["ok"] else "WRONG")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_averages(avg: dict, gpus: list[int]) -> list[str]:
    g0 = min(gpus)
    return [f"{DTYPE_NAMES[d]} ({d}), {g} GPUs vs {g0}: mean {v['mean']:.3f} over {v['sizes']} sizes "
            f"(min {v['min']:.3f}, max {v['max']:.3f})"
            for d, per in avg.items() for g, v in per.items()]


def format_profiles(records: list[dict]) -> list[str]:
    """Per (dtype, N, g): the per-device breakdown of the best timed run."""
    best: dict = {}
    for r in records:
        if r["warmup"] or "profile" not in r:
            continue
        key = (r["dtype"], r["n"], r["gpus"])
        if key not in best or r["seconds"] < best[key]["seconds"]:
            best[key] = r
    lines = []
    for (d, n, g), r in sorted(best.items(), key=lambda kv: ("ds".index(kv[0][0]), kv[0][2], kv[0][1])):
        prof = r["profile"]
        t = prof.get("totals", {})
        devs = "; ".join(f"{x['name']}: {x['tasks']} tasks, busy {_cell(x.get('busy'), '.3f')} comm "
                         f"{_cell(x.get('comm'), '.3f')} idle {_cell(x.get('idle'), '.3f')} s"
                         for x in prof.get("devices", []))
        lines.append(f"{d} N={n} {g} GPU(s), {r['seconds']:.4f} s: H2D {(t.get('bytes_h2d') or 0) / 1e9:.2f} GB, "
                     f"D2H {(t.get('bytes_d2h') or 0) / 1e9:.2f} GB, P2P {(t.get('bytes_p2p') or 0) / 1e9:.2f} GB; "
                     f"{devs}")
    return lines


def efficiency_formula(g0: int) -> str:
    return "T(1) / (g T(g))" if g0 == 1 else f"{g0} T({g0}) / (g T(g))"


CHECK_TEXT = ("C is not reset between calls: each call computes C := alpha A B + beta C on the C the previous "
              "call left. Every call (warm-ups too) is checked: the {rows} sampled rows of C are negated and saved "
              "before it and must afterwards equal alpha (A B)[rows] + beta C_before[rows], computed by numpy in "
              "float64 (relative error <= {tol} x max(1, sqrt(N/8192))).")


def format_markdown(report: dict) -> str:
    gpus = report["gpus"]
    tol = ", ".join(f"{'1e-4' if d == 's' else '1e-9'} ({d})" for d in report["dtypes"])
    md = [f"# Parallel efficiency of blasx GEMM ({report['tag']}, {report['date']} UTC)", "",
          "```", report["command"], "```", "",
          f"- machine: {report['machine']}",
          f"- dtypes: {dtype_words(report['dtypes'])}; alpha {report['alpha']:g}, beta {report['beta']:g}; "
          f"sizes {report['sizes'][0]}..{report['sizes'][-1]} ({len(report['sizes'])}); tile "
          f"{report['tile'] or 'blasx default'}",
          f"- devices per GPU count: " + ", ".join(f"{g}: `{s}`" for g, s in report["specs"].items()),
          f"- A, B, C allocated once at N = {report['sizes'][-1]} (F-ordered); each N uses "
          f"{LAYOUT_TEXT[report.get('layout', 'views')]}; page-locking: {report['pinning']}",
          f"- per (GPU count, N): {report['warmup']} warm-up + {report['runs']} timed calls; T = best timed call; "
          f"efficiency = {efficiency_formula(min(gpus))}",
          "- " + CHECK_TEXT.format(rows=CHECK_ROWS, tol=tol), "",
          "## Results", "", report["table"], ""]
    avg = format_averages(report["averages"], gpus)
    if avg:
        md += ["## Average efficiency over the sizes", "", *(f"- {x}" for x in avg), ""]
    return finish_markdown(md, format_profiles(report["records"]), report.get("failures"))


def finish_markdown(md: list[str], prof: list[str], failures) -> str:
    """The sections every sweep report ends with (each bench's profile lines, failures), joined."""
    if prof:
        md += ["## Per-device breakdown of the best call (blasx profile)", "", *(f"- {x}" for x in prof), ""]
    if failures:
        md += ["## Failures", "", *(f"- {x}" for x in failures), ""]
    return "\n".join(md).rstrip() + "\n"


# --------------------------------------------------------------------------- main


def log(*a):
    print(*a, flush=True)


def sweep_dtype(blasx, args, dtype: str, arrays: dict[str, np.ndarray], report: dict) -> None:
    """Every (g, N) of one dtype on `arrays` (page-locked for the sweep). Nothing made here
    outlives the call (no view, no registration handle), so the caller can free the arrays."""
    hold, note = pin_context(list(arrays.values()), args.pin, args.specs[args.gpus[0]])
    ab_cache: dict[int, np.ndarray] = {}
    with hold as reg:
        if reg is not None:
            note = f"{reg.nbytes / 2**30:.1f} GiB registered once per dtype in {reg.seconds:.2f} s"
            log(f"   {note}")
        report["pinning"] = note
        for g in args.gpus:
            blasx.configure(devices=args.specs[g], tile=args.tile, cpu=False)
            try:
                for n in args.n:
                    a, b, c = views(arrays, n, args.layout)
                    rows = sample_rows(n, CHECK_ROWS, args.seed)
                    if n not in ab_cache:
                        ab_cache[n] = product_rows(a, b, rows)
                    tol = tolerance(dtype, n)
                    for k in range(args.warmup + args.runs):
                        warm = k < args.warmup
                        r = checked_gemm(blasx, dtype, a, b, c, args.alpha, args.beta, rows, ab_cache[n], tol)
                        r.update(dtype=dtype, n=n, gpus=g, devices=args.specs[g], run=k, warmup=warm,
                                 tflops=gemm_tflops(dtype, n, r["seconds"]))
                        report["records"].append(r)
                        log(f"   {dtype} N={n:<6} g={g} {'warm-up' if warm else f'run {k - args.warmup + 1}'}: "
                            f"{r['seconds']:.4f} s {_cell(r['tflops'], '8.2f')} TFLOPS err "
                            f"{_cell(r['rel_err'], '.1e')} {'ok' if r['ok'] else 'WRONG'}")
            finally:
                blasx.shutdown()
    if reg is not None:
        report["registration"].append({"dtype": dtype, "gib": reg.nbytes / 2**30, "seconds": reg.seconds,
                                       "unregister_seconds": reg.unregister_seconds})


def new_report(args, argv, module: str) -> dict:
    stamp, date = utc_stamp()
    return {"tag": args.tag, "date": date, "stamp": stamp, "command": command_line(module, argv),
            "argv": sys.argv[1:] if argv is None else list(argv), "machine": machine_name(),
            "dtypes": args.dtypes, "sizes": args.n, "gpus": args.gpus, "runs": args.runs,
            "warmup": getattr(args, "warmup", 1), "alpha": args.alpha, "beta": args.beta, "tile": args.tile,
            "layout": args.layout,
            "backend": args.backend, "specs": {str(g): s for g, s in args.specs.items()}, "pinning": "",
            "registration": [], "generate_seconds": {}, "records": [], "failures": []}


def run_dtypes(args, report: dict, sweep, write) -> int:
    """For each dtype: the arrays at N_max (double first; float32 cast from it, each float64 array
    freed as it is cast), then sweep(blasx, args, dtype, arrays, report). The report is written
    at the end, also after an error or ^C. Exit status 1 if any call was wrong or anything failed."""
    import blasx
    nmax = args.n[-1]
    log(f"machine: {report['machine']}")
    arrays: dict | None = None
    try:
        for dtype in args.dtypes:
            t0 = time.perf_counter()
            arrays = arrays_for(dtype, nmax, args.seed, arrays)
            report["generate_seconds"][dtype] = time.perf_counter() - t0
            log(f"== {DTYPE_NAMES[dtype]}: A, B, C at N={nmax}: {3 * arrays['a'].nbytes / 2**30:.1f} GiB in "
                f"{report['generate_seconds'][dtype]:.1f} s")
            sweep(blasx, args, dtype, arrays, report)
    except KeyboardInterrupt:
        report["failures"].append("interrupted: the results below are what was measured")
    except Exception as e:
        report["failures"].append(f"{type(e).__name__}: {e}")
        raise
    finally:
        arrays = None
        gc.collect()
        paths = write(report, args.out)
        log(f"wrote {paths[0]}\n      {paths[1]}")
    ok = all(r["ok"] for r in report["records"]) and not report["failures"]
    return 0 if ok else 1


def run(args, argv) -> int:
    if getattr(args, "model", None):
        from . import efficiency_model
        return efficiency_model.run(args, argv, sys.modules[__name__])
    return run_dtypes(args, new_report(args, argv, "bench.efficiency"), sweep_dtype, write_report)


def write_report(report: dict, out_dir: str) -> tuple[str, str]:
    gpus = report["gpus"]
    rows = summarize(report["records"], gpus)
    report["summary"] = [r | {"per_g": {str(g): v for g, v in r["per_g"].items()}} for r in rows]
    report["table"] = format_table(rows, gpus)
    report["averages"] = average_efficiency(rows, gpus)
    log(report["table"])
    for line in format_averages(report["averages"], gpus):
        log(line)
    md = format_markdown(report)
    data = dict(report)
    data["averages"] = {d: {str(g): v for g, v in per.items()} for d, per in report["averages"].items()}
    base = os.path.join(out_dir, f"efficiency-{report['tag']}-{report['stamp']}")
    return write_json_md(base, data, md)


def main(argv=None) -> int:
    args = parse_args(argv)
    return run(args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
