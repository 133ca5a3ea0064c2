"""Knob A/B: two or more engine configurations run alternately on one set of arrays, every result checked.

    python -m bench.ab --devices sim:2 --routine trsm --n 8192 --a commit_steps=0 --b commit_steps=64 --runs 3
    python -m bench.ab --devices cuda --routine gemm,syrk,trsm --n 32768 --a "" --b commit_steps=64 --runs 4
    python -m bench.ab --devices cuda --routine gemm --n 16384 --a cpu=False --b cpu=auto --config cpu=True
    python -m bench.ab --model h200 --routine syr2k,trmm --n 32768 --a "" --b commit_steps=64 --speeds 1/1.06

A configuration (``--a``, ``--b``, then ``--config`` as often as wanted; A, B, C, ... in that
order) is a comma list of NAME=VALUE: a field of ``blasx.runtime.knobs.Knobs`` (0 / 1, or an
int) or a setting of ``blasx.configure`` (tile, streams, cache_bytes, cpu = True / False / auto,
trace). ``""`` is blasx's defaults.

On devices (``--devices``: sims, GPUs, the CPU), the arrays are made once per N (as
``bench.level3``: double unless ``--dtype``, upper, left, no transpose, non-unit, TRMM and TRSM
written over a copy of B) and every configuration runs every routine on them: one untimed round
first, then ``--runs`` timed rounds, the configurations' order rotating from round to round. A
knob that the engine reads per call is switched on the running engine; any other change starts
a new engine, on which each routine's first call is untimed. Every result is checked on sampled rows against
numpy in the wide type; a wrong result makes the exit status 1.

With ``--model h200`` nothing runs on a GPU: a PREDICTION, NOT A MEASUREMENT. The routines'
own planners make the tasks on operands that do not exist, and the real scheduler runs them on
``--gpus`` data-free timing sims with the 2x H200 cost model of ``bench.scaling_sim`` (fitted
host links, the cuda backend's heap, tile-kernel rates as measured: ``--krate``). ``--speeds
1/1.06`` slows the second GPU by 6%: two GPUs of one model differ run to run. Only knobs may
differ between configurations there.

Tables: per N, routine and configuration the median time, TFLOPS (median and range), the ratio
to configuration A's median, and the ratio to the same configuration's GEMM when gemm runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import numpy as np

from blasx.runtime import dtypes
from blasx.runtime.knobs import Knobs

from .level3 import parse_routines
from .level3_check import compare, make_arrays, parallel_copy, reference, sample_rows, tolerance
from .level3_contenders import run_blasx
from .level3_routines import ALL_ROUTINES, ALPHA, BETA, C_ROUTINES, FLOPS, ROUTINE_DTYPES, scalars
from .machine import machine_name
from .result_files import command_line, finite, utc_stamp, write_json_md

#: Knobs the stream workers read when they start; any other knob is read per call or step and
#: can be switched on a running engine.
STARTUP_KNOBS = ("chain_kernels", "late_c", "peer_wait_if_sooner")
#: blasx.configure's settings a configuration may set, with their parsers.
SETTINGS = {
    "tile": int, "streams": int, "cache_bytes": int, "trace": lambda v: _flag(v, "trace"),
    "cpu": lambda v: "auto" if v.lower() == "auto" else _flag(v, "cpu"),
}
MODEL_ROUTINES = ("gemm", "symm", "syrk", "syr2k", "trmm", "trsm")
#: tile-kernel rates / the GEMM step rate, measured inside level-3 calls on an H200
DEFAULT_KRATE = "trmm:0.9/trsm:0.39/invmm:0.9/trtri:0.12"
PREDICTION = ("PREDICTION, NOT A MEASUREMENT: simulated GPUs (blasx `sim` backend, data-free timing mode) "
              "with the cost model fitted to the 2x H200 GEMM measurement; no GPU was used.")


def _flag(value: str, name: str) -> bool:
    if value.lower() in ("1", "true"):
        return True
    if value.lower() in ("0", "false"):
        return False
    raise ValueError(f"{name}: got {value!r}; allowed: 0, 1, True, False")


@dataclasses.dataclass(frozen=True)
class Config:
    """One side of the A/B: its label, its text, the knobs and the configure settings."""
    label: str
    text: str
    knobs: Knobs
    settings: tuple  # (name, value) pairs for blasx.configure


def parse_config(label: str, text: str) -> Config:
    """'commit_steps=64,cpu=auto' -> Config; ValueError naming the item and what is allowed."""
    knob_text, settings = [], {}
    knob_names = {f.name for f in dataclasses.fields(Knobs)}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--{label.lower()}: got {item!r}; expected NAME=VALUE")
        if name in knob_names:
            knob_text.append(item)
        elif name in SETTINGS:
            try:
                settings[name] = SETTINGS[name](value)
            except ValueError as e:
                raise ValueError(f"--{label.lower()}: got {item!r}: {e}") from None
        else:
            raise ValueError(f"--{label.lower()}: got {item!r}; NAME is a knob ({', '.join(sorted(knob_names))}) "
                             f"or a configure setting ({', '.join(SETTINGS)})")
    try:
        knobs = Knobs.from_env(",".join(knob_text))
    except ValueError as e:
        raise ValueError(f"--{label.lower()}: {e}") from None
    return Config(label, text, knobs, tuple(sorted(settings.items())))


def _ints(text: str, option: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ValueError(f"{option}: got {text!r}; expected a comma list of ints >= 1")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--a", dest="configs", action="append", default=None, metavar="KNOBS",
                   help="configuration A (default: blasx's defaults)")
    p.add_argument("--b", dest="configs", action="append", metavar="KNOBS", help="configuration B")
    p.add_argument("--config", dest="configs", action="append", metavar="KNOBS", help="one more configuration")
    p.add_argument("--routine", default="gemm", help=f"comma list of {', '.join(ALL_ROUTINES)} (default gemm)")
    p.add_argument("--n", default="8192", help="matrix sizes N, comma list (every operand N x N)")
    p.add_argument("--dtype", default="d", help="s, d, c or z (a type name too; default d)")
    p.add_argument("--runs", type=int, default=3, help="timed rounds (default 3)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--devices", default=None, help="blasx device spec: sim:2, cuda, cuda:0,1, cpu "
                       "(default: configure's default)")
    where.add_argument("--model", choices=["h200"], default=None,
                       help="predict on data-free timing sims with the 2x H200 cost model instead")
    m = p.add_argument_group("--model only")
    m.add_argument("--gpus", type=int, default=2, help="simulated GPUs (default 2)")
    m.add_argument("--speeds", default="", help="per-GPU slowdowns joined by '/', e.g. 1/1.06")
    m.add_argument("--krate", default=DEFAULT_KRATE, help=f"tile-kernel rate factors (default {DEFAULT_KRATE}; "
                   "'none': all at the GEMM rate)")
    m.add_argument("--tile", type=int, default=4096, help="tile (default 4096)")
    m.add_argument("--dilate", type=float, default=8.0, help="time dilation of the sims (>= 1)")
    m.add_argument("--issue", type=float, default=None, help="host seconds per launch (default the model's)")
    p.add_argument("--tag", default="", help="name part of the output files: ab-TAG-STAMP")
    p.add_argument("--out", default=None, help="directory for ab-[TAG-]STAMP.{json,md}")
    p.add_argument("--quiet", action="store_true", help="no line per run")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        texts = args.configs or [""]
        args.configs = [parse_config(chr(ord("A") + i), t) for i, t in enumerate(texts)]
        args.n = _ints(args.n, "--n")
        args.dtype = dtypes.parse(args.dtype).prefix
        args.routines = parse_routines(args.routine)
        if args.runs < 1:
            raise ValueError(f"--runs: got {args.runs}, need an int >= 1")
        bad = [r for r in args.routines if args.dtype not in ROUTINE_DTYPES[r]]
        if bad:
            raise ValueError(f"--routine: got {', '.join(bad)} with --dtype {args.dtype}; those are complex-only")
        if args.model:
            _check_model_args(args)
        if args.tag and not args.tag.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"--tag: got {args.tag!r}; letters, digits, '-' and '_' only")
    except (ValueError, argparse.ArgumentTypeError) as e:
        p.error(str(e))
    return args


def _check_model_args(args) -> None:
    if args.dtype != "d":
        raise ValueError(f"--dtype: got {args.dtype!r}; --model runs double (d) only")
    bad = [r for r in args.routines if r not in MODEL_ROUTINES]
    if bad:
        raise ValueError(f"--routine: got {', '.join(bad)}; --model allows {', '.join(MODEL_ROUTINES)}")
    if [c.label for c in args.configs if c.settings]:
        raise ValueError("--model: configurations may set knobs only, not configure settings")
    if args.gpus < 1 or args.tile < 1 or not args.dilate >= 1:
        raise ValueError(f"--gpus / --tile / --dilate: got {args.gpus} / {args.tile} / {args.dilate}; "
                         f"need ints >= 1 and a dilation >= 1")
    if args.speeds:
        try:
            factors = [float(x) for x in args.speeds.split("/")]
        except ValueError:
            factors = []
        if len(factors) != args.gpus or not all(f >= 1 for f in factors):
            raise ValueError(f"--speeds: got {args.speeds!r}; expected {args.gpus} factors >= 1 joined by '/', "
                             f"e.g. {'/'.join(['1'] * (args.gpus - 1) + ['1.06'])}")
    args.krate = "" if args.krate == "none" else args.krate
    if args.krate:
        from blasx.runtime.config import parse_krate
        try:
            parse_krate(args.krate)
        except ValueError:
            raise ValueError(f"--krate: got {args.krate!r}; expected KERNEL:FACTOR pairs joined by '/', "
                             f"factors > 0, e.g. trmm:0.9/trsm:0.35") from None


def flops(routine: str, n: int, dtype: str) -> float:
    return FLOPS[routine] * dtypes.BY_PREFIX[dtype].flop_factor * float(n) ** 3


def rounds(configs: list, runs: int):
    """(round, config) in run order: round 0 untimed, then each round starts one config later."""
    for r in range(runs + 1):
        k = r % len(configs)
        yield from ((r, c) for c in configs[k:] + configs[:k])


# --------------------------------------------------------------------------- on devices


class Switcher:
    """Puts a configuration in force: on the running engine when only per-call knobs differ,
    else through blasx.configure (a new engine). ``use`` says whether the engine is new."""

    def __init__(self, blasx, devices):
        self.blasx, self.devices, self.current = blasx, devices, None

    def use(self, config: Config) -> bool:
        cur = self.current
        same = (cur is not None and cur.settings == config.settings
                and all(getattr(cur.knobs, k) == getattr(config.knobs, k) for k in STARTUP_KNOBS))
        if not same:
            os.environ["BLASX_KNOBS"] = ",".join(f"{k}={int(v)}" for k, v in vars(config.knobs).items())
            self.blasx.configure(devices=self.devices, **dict(config.settings))
        eng = self.blasx.session.engine()
        eng.config.knobs = config.knobs
        for d in eng.devices:
            d.knobs = config.knobs
        self.current = config
        return not same


def run_devices(args, log) -> list[dict]:
    """Every (N, round, config, routine) on the devices; one record per timed call."""
    import blasx
    records = []
    old = os.environ.get("BLASX_KNOBS")
    switch = Switcher(blasx, args.devices)
    try:
        for n in args.n:
            A, B, C0, out = make_arrays(n, args.dtype)
            rows = sample_rows(n)
            refs: dict = {}
            warm: set = set()  # routines called on the current engine
            for r, cfg in rounds(args.configs, args.runs):
                for rt in args.routines:
                    alpha, beta = scalars(args.dtype, rt)
                    if switch.use(cfg):
                        warm = set()
                    if r and rt not in warm:  # a routine's first call on a new engine (devices opened): untimed
                        run_blasx(blasx, args.dtype, rt, n, A, B, C0, out, alpha, beta)
                    warm.add(rt)
                    parallel_copy(out, C0 if rt in C_ROUTINES else B)
                    t = time.perf_counter()
                    run_blasx(blasx, args.dtype, rt, n, A, B, C0, out, alpha, beta)
                    t = time.perf_counter() - t
                    if rt not in refs:
                        refs[rt] = reference(rt, A, B, C0, alpha, beta, rows)
                    err = compare(rt, A, out, rows, refs[rt])
                    ok = bool(err <= tolerance(args.dtype, n))
                    prof = blasx.last_profile()
                    devs = prof.summary()["devices"] if prof is not None else []
                    rec = {"n": n, "round": r, "config": cfg.label, "routine": rt, "seconds": t,
                           "tflops": flops(rt, n, args.dtype) / t / 1e12, "rel_err": finite(err), "ok": ok,
                           "devices": [{k: d[k] for k in ("name", "tasks", "busy", "comm", "idle")} for d in devs]}
                    log(_run_line(rec, "warm-up" if not r else f"run {r}")
                        + ("" if ok else f" WRONG (rel err {err:.1e})"))
                    if r or not ok:
                        records.append(rec)
            del A, B, C0, out
    finally:
        blasx.shutdown()
        if old is None:
            os.environ.pop("BLASX_KNOBS", None)
        else:
            os.environ["BLASX_KNOBS"] = old
    return records


def _run_line(rec: dict, what: str) -> str:
    per = "  ".join(f"{d['name']} busy {d['busy'] * 1e3:.1f} comm {d['comm'] * 1e3:.1f} idle {d['idle'] * 1e3:.1f}"
                    for d in rec.get("devices", []))
    return (f"N={rec['n']} {rec['routine']:<6} {rec['config']} {what}: {rec['seconds']:.4f} s "
            f"{rec['tflops']:7.2f} TFLOPS  {per}")


# --------------------------------------------------------------------------- in the timing model


def plan_model_case(routine: str, n: int, tile: int, block, knobs: Knobs):
    """(tasks, operand slot -> operand index) of ``routine`` on N x N operands as bench.level3 calls
    it (TRMM / TRSM in place: the output slot is B's operand; TRSM's inverses are operand 3)."""
    from blasx.runtime import plans as P
    from blasx.runtime.tiling import OP_N
    up, left, unit = 0, 0, 0
    if routine == "gemm":
        return P.plan_gemm(n, n, n, tile, OP_N, OP_N, beta_zero=False, block=block), [0, 1, 2]
    if routine == "symm":
        return P.plan_symm(n, n, tile, left, up, beta_zero=False, block=block), [0, 1, 2]
    if routine == "syrk":
        return P.plan_syrk(n, n, tile, OP_N, up, beta_zero=False, block=block), [0, 2]
    if routine == "syr2k":
        return P.plan_syr2k(n, n, tile, OP_N, up, beta_zero=False, block=block), [0, 1, 2]
    if routine == "trsm":
        inv = knobs.trsm_inverse
        return P.plan_trsm(n, n, tile, left, up, OP_N, unit, inverse=inv), [0, 1, 1] + [3] * inv
    return P.plan_trmm(n, n, tile, left, up, OP_N, unit, block=block, in_place=True), [0, 1, 1]


def model_once(args, cfg: Config, routine: str, n: int) -> dict:
    """One simulated call on a fresh engine of timing sims; times undilated."""
    from blasx import operands as _operands
    from blasx.dispatch import block_shape
    from blasx.runtime.call import Call, Operand
    from blasx.runtime.plans import inverse_shape
    from blasx.runtime.stats import CallStats, DeviceInfo

    from . import scaling_sim as S
    model = _model(args)
    spec = (S.spec_for(args.gpus, "d", model, S.cuda_heap_bytes(model.gpu_mem), args.dilate, "independent")
            + (f",krate={args.krate}" if args.krate else "") + (f",speeds={args.speeds}" if args.speeds else ""))
    dtype, tile = np.dtype(np.float64), args.tile
    alpha, beta = scalars("d", routine)

    def make_call(eng, devs):
        tasks, slots = plan_model_case(routine, n, tile, block_shape(eng), cfg.knobs)
        base = next(_operands._call_bases)
        shapes = [(n, n)] * 3 + [inverse_shape(n, tile)]  # A, B, C; TRSM's inverses
        made = [Operand(None, r, c, r, (1 + i) << 44, -1, (base - 1000 * i, r, c, r, dtype.str, tile))
                for i, (r, c) in enumerate(shapes)]  # fake addresses, never read
        stats = CallStats([DeviceInfo(d.index, d.name, d.kind) for d in devs], keep_records=True)
        call = Call(routine, [made[i] for i in slots], tasks, dtype, alpha, beta, stats)
        call.tile = tile
        return call

    devs, call, _ = S.submit_on_sims(spec, model.streams, make_call, knobs=cfg.knobs)
    if call.error is not None:
        raise call.error
    prof = call.stats.profile()
    ideal = sum(devs[0].model.kernel_time(call.step_flops(st), st.kernel)
                for t in call.tasks for st in t.steps) / args.gpus / args.dilate
    per = [{"name": b.name, "tasks": b.tasks, "busy": b.busy / args.dilate, "comm": b.comm / args.dilate,
            "idle": b.idle / args.dilate} for b in prof.breakdown()]
    wall = prof.wall / args.dilate
    return {"n": n, "config": cfg.label, "routine": routine, "seconds": wall,
            "tflops": flops(routine, n, "d") / wall / 1e12, "ok": True, "devices": per,
            "busy_inflation": statistics.fmean(d["busy"] for d in per) / ideal}


def _model(args):
    from . import scaling_sim as S
    m = S.MODEL
    return S.Model(rate=m.rate, h2d=S.FITTED_LINK, d2h=S.FITTED_LINK, p2p=m.p2p, gpu_mem=m.gpu_mem,
                   streams=m.streams, alpha=ALPHA, beta=BETA, issue=m.issue if args.issue is None else args.issue)


def run_model(args, log) -> list[dict]:
    """Every (N, round, config, routine) in the timing model; round 0 is timed too (no warm-up
    is needed: each call gets fresh sims)."""
    from .scaling_sim import retried
    records = []
    for n in args.n:
        for r, cfg in rounds(args.configs, args.runs - 1):
            for rt in args.routines:
                rec = retried(lambda: model_once(args, cfg, rt, n))
                rec["round"] = r + 1
                log(_run_line(rec, f"run {r + 1}"))
                records.append(rec)
    return records


# --------------------------------------------------------------------------- tables


def summarize(records: list[dict], configs: list[Config]) -> list[dict]:
    """One row per (N, routine, config) of the timed runs: median time, TFLOPS median and range,
    the ratio to configuration A's median time and to the same configuration's GEMM."""
    rows = []
    for n in dict.fromkeys(r["n"] for r in records):
        for rt in dict.fromkeys(r["routine"] for r in records):
            for c in configs:
                runs = [x for x in records if (x["n"], x["routine"], x["config"]) == (n, rt, c.label) and x["round"]]
                if runs:
                    tf = sorted(x["tflops"] for x in runs)
                    rows.append({"n": n, "routine": rt, "config": c.label, "knobs": c.text, "runs": len(runs),
                                 "median_s": statistics.median(x["seconds"] for x in runs),
                                 "best_s": min(x["seconds"] for x in runs), "tflops": statistics.median(tf),
                                 "tflops_min": tf[0], "tflops_max": tf[-1], "ok": all(x["ok"] for x in runs)})
    find = {(r["n"], r["routine"], r["config"]): r for r in rows}
    a = configs[0].label
    for r in rows:
        base, gemm = find.get((r["n"], r["routine"], a)), find.get((r["n"], "gemm", r["config"]))
        r["vs_a"] = base["median_s"] / r["median_s"] if base else None
        r["of_gemm"] = r["tflops"] / gemm["tflops"] if gemm else None
    return rows


def markdown(doc: dict) -> str:
    lines = [f"# Knob A/B: {doc['where']}, {doc['date']}", ""]
    if doc.get("prediction"):
        lines += [f"**{PREDICTION}**", ""]
    lines += ["```", doc["command"], "```", "", "Configurations: " + "; ".join(
        f"{c['label']} = `{c['text'] or 'defaults'}`" for c in doc["configs"]) + f". dtype {doc['dtype']}, "
        f"{doc['runs']} timed round(s), configurations alternating.", "",
        "| N | routine | config | median s | TFLOPS | range | vs A | of GEMM | check |",
        "| --: | :-- | :-- | --: | --: | :-- | --: | --: | :-- |"]
    for r in doc["summary"]:
        opt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        lines.append(f"| {r['n']} | {r['routine']} | {r['config']} | {r['median_s']:.4f} | {r['tflops']:.1f} | "
                     f"{r['tflops_min']:.1f}-{r['tflops_max']:.1f} | {opt(r['vs_a'])} | {opt(r['of_gemm'])} | "
                     f"{'-' if doc.get('prediction') else 'ok' if r['ok'] else 'WRONG'} |")
    lines += ["", "vs A: configuration A's median time / this one's (above 1: faster than A); of GEMM: TFLOPS / "
              "the same configuration's GEMM TFLOPS; check: every timed result against numpy (none in the model).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))  # noqa: E731
    stamp, date = utc_stamp()
    records = run_model(args, log) if args.model else run_devices(args, log)
    doc = {"kind": "ab", "prediction": bool(args.model), "stamp": stamp, "date": date,
           "where": (f"{args.gpus} simulated H200s (timing mode)" if args.model
                     else f"devices {args.devices or 'default'}"),
           "command": command_line("bench.ab", argv), "dtype": args.dtype, "runs": args.runs,
           "configs": [{"label": c.label, "text": c.text, "knobs": vars(c.knobs), "settings": dict(c.settings)}
                       for c in args.configs],
           "model": {"gpus": args.gpus, "speeds": args.speeds, "krate": args.krate, "tile": args.tile,
                     "dilate": args.dilate} if args.model else None,
           "summary": summarize(records, args.configs), "records": records, "host": machine_name()}
    md = markdown(doc)
    if args.out:
        base = os.path.join(args.out, "ab-" + (f"{args.tag}-" if args.tag else "") + stamp)
        for path in write_json_md(base, doc, md):
            log(f"wrote {path}")
    else:
        print(md)
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
