"""What bench.gemm measured, summed up: a Record per run, a Row per label and case, the same-run ratios,
and the text and markdown of a report."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from . import gemm_lp
from .gemm_contenders import CONTENDER_ORDER
from .gemm_problem import MODES, size_label, tflops
from .machine import gib


# --------------------------------------------------------------------------- records


@dataclass
class Case:
    """Which label ran on which problem: the fields a run and a summary row share."""
    label: str
    contender: str
    variant: object
    mode: str
    dtype: str
    m: int
    n: int
    k: int


@dataclass
class Record(Case):
    """One timed (or failed) run of one label."""
    run: int
    seconds: float | None
    error: float | None
    ok: bool
    failure: str | None = None
    warmup: bool = False
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- summary


@dataclass
class Row(Case):
    """The runs of one label in one (mode, dtype, size): best/median and the check."""
    runs: int
    best: float | None
    median: float | None
    tflops_best: float | None
    tflops_median: float | None
    error: float | None
    status: str                     # "ok" | "WRONG" | "FAILED"
    failure: str | None = None
    best_extra: dict = field(default_factory=dict)

    @property
    def size(self) -> str:
        return size_label(self.m, self.n, self.k)


def _row(recs: list[Record]) -> Row:
    r0 = recs[0]
    timed = [r for r in recs if r.seconds is not None and not r.warmup]
    failures = [r.failure for r in recs if r.failure]
    times = [r.seconds for r in timed]
    best_rec = min(timed, key=lambda r: r.seconds) if timed else None
    errors = [r.error for r in timed if r.error is not None]
    error = (math.nan if any(math.isnan(e) for e in errors) else max(errors)) if errors else None
    if failures:
        status = "FAILED"
    elif any(not r.ok for r in timed):
        status = "WRONG"
    else:
        status = "ok"
    best = min(times) if times else None
    median = statistics.median(times) if times else None
    args = (r0.dtype, r0.m, r0.n, r0.k)
    return Row(r0.label, r0.contender, r0.variant, r0.mode, r0.dtype, r0.m, r0.n, r0.k,
               len(times), best, median, tflops(*args, best), tflops(*args, median), error,
               status, failures[0] if failures else None,
               dict(best_rec.extra) if best_rec else {})


def _row_order(row: Row, dtype_rank: dict[str, int]) -> tuple:
    def index(seq, x):
        return seq.index(x) if x in seq else len(seq)
    variant = row.variant if isinstance(row.variant, (int, float)) else -1
    return (dtype_rank[row.dtype], row.m * row.n * row.k, row.m, row.n, row.k,
            index(MODES, row.mode), index(CONTENDER_ORDER, row.contender), variant, row.label)


def summarize(records: Iterable[Record]) -> list[Row]:
    """One row per (mode, dtype, size, label), from the timed runs (and any failure);
    dtypes in the order they were run, then size, mode, contender, block."""
    groups: dict[tuple, list[Record]] = {}
    dtype_rank: dict[str, int] = {}
    for r in records:
        if r.warmup and not r.failure:
            continue
        dtype_rank.setdefault(r.dtype, len(dtype_rank))
        groups.setdefault((r.mode, r.dtype, r.m, r.n, r.k, r.label), []).append(r)
    return sorted((_row(recs) for recs in groups.values()),
                  key=lambda row: _row_order(row, dtype_rank))


def _group_rows(rows: Iterable[Row]) -> dict[tuple, list[Row]]:
    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        groups.setdefault((row.mode, row.dtype, row.m, row.n, row.k), []).append(row)
    return groups


def best_of(rows: Iterable[Row], contender: str) -> Row | None:
    """The fastest correct row of a contender (e.g. the best cuBLAS-XT block)."""
    good = [r for r in rows if r.contender == contender and r.status == "ok" and r.best]
    return min(good, key=lambda r: r.best) if good else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def compute_ratios(rows: Sequence[Row], n_gpus: int) -> list[dict]:
    """Same-run ratios per (mode, dtype, size), correct rows only:
    blasx speed over the best cuBLAS-XT block's, and blasx TFLOPS over
    (in-core cupy TFLOPS x GPUs), the fraction of the in-core ceiling reached."""
    out = []
    for (mode, dtype, m, n, k), group in _group_rows(rows).items():
        bx = next((r for r in group if r.label == "blasx" and r.status == "ok" and r.best), None)
        if bx is None:
            continue
        entry: dict = {"mode": mode, "dtype": dtype, "m": m, "n": n, "k": k, "gpus": n_gpus}
        xt = best_of(group, "cublasxt")
        if xt is not None:
            entry.update(xt_label=xt.label,
                         blasx_over_xt_best=_ratio(xt.best, bx.best),
                         blasx_over_xt_median=_ratio(xt.median, bx.median))
        cp = next((r for r in group if r.label == "cupy" and r.status == "ok" and r.best), None)
        if cp is not None:
            entry.update(blasx_over_cupy_x_gpus_best=_ratio(bx.tflops_best,
                                                            (cp.tflops_best or 0) * n_gpus),
                         blasx_over_cupy_x_gpus_median=_ratio(bx.tflops_median,
                                                              (cp.tflops_median or 0) * n_gpus))
        if len(entry) > 6:
            out.append(entry)
    return out


# --------------------------------------------------------------------------- formatting


def _num(value) -> str:
    """A scalar as typed on the command line: 1.5, 0, (1.5+0.5j)."""
    if isinstance(value, complex) and not value.imag:
        value = value.real
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _f(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan" if isinstance(value, float) else "-"
    return format(value, spec)


def _best_xt_labels(rows: Sequence[Row]) -> set[tuple]:
    marks = set()
    for key, group in _group_rows(rows).items():
        xt = best_of(group, "cublasxt")
        if xt is not None:
            marks.add((*key, xt.label))
    return marks


TABLE_COLUMNS: tuple[tuple[str, Callable[[Row], str], str], ...] = (
    ("contender", lambda r: r.label, "<"),
    ("mode", lambda r: r.mode, "<"),
    ("dtype", lambda r: r.dtype, "<"),
    ("N", lambda r: r.size, ">"),
    ("best s", lambda r: _f(r.best, ".4f"), ">"),
    ("median s", lambda r: _f(r.median, ".4f"), ">"),
    ("TFLOPS best", lambda r: _f(r.tflops_best, ".2f"), ">"),
    ("TFLOPS median", lambda r: _f(r.tflops_median, ".2f"), ">"),
    ("rel. error", lambda r: _f(r.error, ".1e"), ">"),
    ("ok", lambda r: r.status, "<"),
)


def _cells(rows: Sequence[Row]) -> list[list[str]]:
    marks = _best_xt_labels(rows)
    out = []
    for r in rows:
        cells = [fn(r) for _, fn, _ in TABLE_COLUMNS]
        if (r.mode, r.dtype, r.m, r.n, r.k, r.label) in marks:
            cells[0] += " *"
        out.append(cells)
    return out


def format_table(rows: Sequence[Row]) -> str:
    """Aligned text table; '*' marks the best cuBLAS-XT block of each case."""
    header = [h for h, _, _ in TABLE_COLUMNS]
    body = _cells(rows)
    widths = [max(len(x) for x in col) for col in zip(header, *body)]

    def line(cells):
        return "  ".join(format(c, f"{al}{w}") for c, (_, _, al), w
                         in zip(cells, TABLE_COLUMNS, widths)).rstrip()
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(c) for c in body)])


def format_markdown_table(rows: Sequence[Row]) -> str:
    header = [h for h, _, _ in TABLE_COLUMNS]
    align = [":--" if al == "<" else "--:" for _, _, al in TABLE_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
              for cells in _cells(rows)]
    return "\n".join(lines)


def format_ratios(ratios: Sequence[dict]) -> list[str]:
    lines = []
    for e in ratios:
        parts = []
        if "xt_label" in e:
            block = e["xt_label"].removeprefix("cublasxt[").removesuffix("]")
            parts.append(f"blasx / cuBLAS-XT ({block}): "
                         f"{_f(e['blasx_over_xt_best'], '.2f')}x best, "
                         f"{_f(e['blasx_over_xt_median'], '.2f')}x median")
        if "blasx_over_cupy_x_gpus_best" in e:
            parts.append(f"blasx / (in-core cupy x {e['gpus']} GPUs): "
                         f"{_f(e['blasx_over_cupy_x_gpus_best'], '.2f')} best, "
                         f"{_f(e['blasx_over_cupy_x_gpus_median'], '.2f')} median")
        lines.append(f"{e['mode']} {e['dtype']} {size_label(e['m'], e['n'], e['k'])}: "
                     + "; ".join(parts))
    return lines


def format_bounds(cases: Sequence[dict], rows: Sequence[Row]) -> list[str]:
    """Per case: the host-link bound from the measured H2D/D2H rates, and blasx's best correct
    time over it (any mode)."""
    lines = []
    for case in cases:
        bx = [r.best for r in rows if r.contender == "blasx" and r.status == "ok" and r.best
              and (r.dtype, r.m, r.n, r.k) == (case["dtype"], case["m"], case["n"], case["k"])]
        line = gemm_lp.format_bound(case, min(bx) if bx else None)
        if line:
            lines.append(line)
    return lines


def format_failures(rows: Sequence[Row]) -> list[str]:
    return [f"{r.label} ({r.mode} {r.dtype} {r.size}): {r.failure}"
            for r in rows if r.status == "FAILED"]


def format_profiles(rows: Sequence[Row]) -> list[str]:
    """One line per blasx row: the best run's time against the engine's own wall (what the call spent
    outside it: a new result, copies of C) and its page-locking time, traffic, cache and steals, and per
    device busy/comm/idle (from blasx.last_profile().summary())."""
    lines = []
    for r in rows:
        prof = r.best_extra.get("profile") if r.contender == "blasx" else None
        if not prof:
            continue
        t = prof.get("totals", {})
        wall, pin = prof.get("wall"), prof.get("host", {}).get("pin_seconds")
        timing = "" if r.best is None or wall is None else (
            f"call {r.best:.3f} s, engine {wall:.3f} s (outside it {max(r.best - wall, 0.0):.3f} s)"
            + ("" if pin is None else f", registering {pin:.3f} s") + "; ")
        devs = ", ".join(
            f"{d.get('name', i)}: {d.get('tasks', 0):.0f} tasks busy {_f(d.get('busy'), '.3f')} "
            f"comm {_f(d.get('comm'), '.3f')} idle {_f(d.get('idle'), '.3f')} s"
            for i, d in enumerate(prof.get("devices", [])))
        lines.append(
            f"{r.mode} {r.dtype} {r.size}: {timing}H2D {gib(t.get('bytes_h2d', 0)):.2f} GiB, "
            f"D2H {gib(t.get('bytes_d2h', 0)):.2f} GiB, P2P {gib(t.get('bytes_p2p', 0)):.2f} GiB; "
            f"L1 hits {t.get('l1_hits', 0):.0f}, L2 hits {t.get('l2_hits', 0):.0f}, "
            f"misses {t.get('misses', 0):.0f}, steals {t.get('steals', 0):.0f}; {devs}")
    return lines


def format_registration(cases: Sequence[dict]) -> list[str]:
    lines = []
    for case in cases:
        reg = case.get("modes", {}).get("registered", {}).get("registration")
        if reg:
            lines.append(f"{case['dtype']} {size_label(case['m'], case['n'], case['k'])}: "
                         f"registered {reg['gib']:.2f} GiB in {reg['seconds']:.3f} s "
                         f"({reg['seconds_per_gib']:.4f} s/GiB), "
                         f"unregistered in {reg['unregister_seconds']:.3f} s")
    return lines


def format_machine(env: dict) -> list[str]:
    gpus = env.get("gpus") or []
    names = ", ".join(f"cuda:{g.get('id')} {g.get('name')} ({_f(g.get('mem_gib'), '.0f')} GiB)"
                      for g in gpus) or env.get("cupy_error", "no GPU information")
    return [
        f"host: {env.get('host', '?')} ({env.get('cpu', '?')}, {env.get('cpus', '?')} CPUs, "
        f"{_f(env.get('host_mem_gib'), '.0f')} GiB)",
        f"GPUs: {names}",
        f"CUDA driver {env.get('cuda_driver', '?')}, runtime {env.get('cuda_runtime', '?')}, "
        f"cuBLAS {env.get('cublas', '?')} ({env.get('libcublas', '?')})",
        f"python {env.get('python', '?')}, numpy {env.get('numpy', '?')}, "
        f"cupy {env.get('cupy', '?')}, scipy {env.get('scipy', '?')}, "
        f"blasx {env.get('blasx', '?')} (git {env.get('git_commit', '?')})",
    ]


def format_markdown(report: dict) -> str:
    """The markdown summary: command, machine, date, table, ratios, costs, profiles."""
    rows = [r if isinstance(r, Row) else Row(**r) for r in report.get("summary", [])]
    cfg = report.get("config", {})
    md = [f"# GEMM benchmark: {report.get('tag', '')} {report.get('date', '')}", "",
          "```", report.get("command", ""), "```", "",
          "## Machine", "", *(f"- {x}" for x in format_machine(report.get("env", {}))), "",
          "## Settings", "",
          f"- alpha {_num(cfg.get('alpha'))}, beta {_num(cfg.get('beta'))}, "
          f"seed {cfg.get('seed')}, "
          f"{cfg.get('runs')} timed runs + {cfg.get('warmup')} warm-up per contender, "
          f"shuffled; modes {cfg.get('modes')}; GPUs {cfg.get('gpus')}",
          f"- cuBLAS-XT blocks {cfg.get('xt_blocks')} (pinning {cfg.get('xt_pinning')}); "
          f"blasx tile {cfg.get('tile') or 'default'}",
          "- tolerance on ||C - ref||_F / ||ref||_F: 1e-4 (s, c), 1e-10 (d, z), "
          "x sqrt(K/8192) above K = 8192", "",
          "## Results", "", format_markdown_table(rows), "",
          "`*` best cuBLAS-XT block; `cupy` = in-core kernel time on one GPU, "
          "`cupy+copies` includes the host<->device copies.", ""]
    for title, lines in (("Same-run ratios", format_ratios(report.get("ratios", []))),
                         ("Host registration cost", format_registration(report.get("cases", []))),
                         ("blasx profile of the best run", format_profiles(rows)),
                         ("Failures", format_failures(rows))):
        if lines:
            md += [f"## {title}", "", *(f"- {x}" for x in lines), ""]
    return "\n".join(md).rstrip() + "\n"


def format_text_report(report: dict) -> str:
    rows = [r if isinstance(r, Row) else Row(**r) for r in report.get("summary", [])]
    out = [format_table(rows), "(* = best cuBLAS-XT block)"]
    for title, lines in (("ratios", format_ratios(report.get("ratios", []))),
                         ("host-link bounds", format_bounds(report.get("cases", []), rows)),
                         ("registration", format_registration(report.get("cases", []))),
                         ("failures", format_failures(rows))):
        if lines:
            out += ["", f"{title}:", *(f"  {x}" for x in lines)]
    return "\n".join(out)
