"""GEMM benchmark: blasx against cuBLAS-XT, in-core CuPy (cuBLAS on one GPU) and NumPy.

    python -m bench.gemm --n 16384 --dtypes d,s --gpus 2 --runs 3 \\
        --modes registered,pageable --out bench/results

Every contender runs on the same host arrays in one process, its runs shuffled together with
the other contenders' runs; every result is checked against a higher-precision reference.
See bench/README.md for the contenders, the modes and how to read the output. CuPy is only
imported inside the functions that need a GPU, so bench.gemm and its parts import (and the
formatting functions run) on a machine without one. This module holds the options, the run
loop and the result files; the cases are in bench.gemm_problem, the contenders and the
reference in bench.gemm_contenders, the summary and its formatting in bench.gemm_table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import gc
import json
import math
import os
import random
import re
import shlex
import socket
import sys
import time
import traceback
from dataclasses import asdict, is_dataclass, replace
from typing import Callable, Sequence

import numpy as np

from blasx.runtime.dtypes import GEMM_PREFIXES as PREFIXES
from blasx.runtime.dtypes import MATH_MODES

from . import gemm_lp
from .cublasxt import registered
from .gemm_contenders import CONTENDER_ORDER, CONTENDERS, Contender, _free_device_pool, compute_reference
from .gemm_problem import (
    MODES, Problem, frobenius, host_bytes_needed, make_problem, rel_error, size_label, tflops, typed_scalar,
)
from .gemm_table import Record, compute_ratios, format_machine, format_markdown, format_text_report, summarize
from .machine import _describe, collect_env, gib, resolve_gpus


# --------------------------------------------------------------------------- constants

DEFAULT_MODES = ("registered", "pageable")
DEFAULT_N = (16384,)
DEFAULT_RUNS = 3
DEFAULT_XT_BLOCKS = (2048, 4096, 8192)
QUICK_N = (1024, 2048)
QUICK_RUNS = 2
QUICK_XT_BLOCKS = (512, 1024)

log = functools.partial(print, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- arguments


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _choice_list(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [x.strip().lower() for x in text.split(",") if x.strip()]
        bad = [v for v in values if v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {bad or text!r}; choose from {','.join(choices)}")
        return list(dict.fromkeys(values))
    return parse


def _gpu_list(text: str) -> list[int]:
    """'2' -> the first two GPUs [0, 1]; '0,1' or '1,' -> exactly those ids."""
    try:
        if "," in text:
            ids = [int(x) for x in text.split(",") if x.strip()]
            if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
                raise ValueError
            return ids
        count = int(text)
        if count < 1:
            raise ValueError
        return list(range(count))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--gpus takes a count ('2') or a comma list of device ids ('0,1', '1,'), not {text!r}")


def _complex(text: str) -> complex:
    try:
        return complex(text.replace(" ", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.gemm",
        description="GEMM C = alpha*A@B + beta*C on host arrays: blasx vs cuBLAS-XT vs in-core "
                    "CuPy vs NumPy, all in one process, runs shuffled, every result checked.")
    size = p.add_argument_group("problem")
    size.add_argument("--n", type=_int_list, default=None,
                      help=f"comma list of N (default {','.join(map(str, DEFAULT_N))}; "
                           f"--quick: {','.join(map(str, QUICK_N))})")
    size.add_argument("--m", type=int, default=None, help="M for every N (default: N)")
    size.add_argument("--k", type=int, default=None, help="K for every N (default: N)")
    size.add_argument("--dtypes", type=_choice_list(tuple(PREFIXES), "dtype"), default=["d", "s"],
                      help=f"comma list of {','.join(PREFIXES)} (default d,s); h, b accumulate in "
                           f"float32 and return their type, i8 returns int32 (alpha, beta rounded)")
    size.add_argument("--math", choices=MATH_MODES, default="ieee",
                      help="float32's math: ieee (default) or tf32 (TF32 tensor cores; s only)")
    size.add_argument("--check-rows", type=int, default=None,
                      help="check this many rows of C, spread over it (the first, the last and random ones), "
                           "against a float64 CPU reference (default: all of C for s,d,c,z in IEEE math, 256 rows "
                           "for h,b,i8 and TF32)")
    size.add_argument("--alpha", type=_complex, default=complex(1.5),
                      help="alpha (default 1.5; complex like 1.5+0.5j for c,z only)")
    size.add_argument("--beta", type=_complex, default=complex(0.5),
                      help="beta (default 0.5; 0 poisons C with NaN before every run)")
    size.add_argument("--seed", type=int, default=0, help="seed of the arrays and the run order")
    run = p.add_argument_group("runs")
    run.add_argument("--gpus", type=_gpu_list, default=None,
                     help="GPU count ('2' = devices 0,1) or id list ('0,1'); default: all visible")
    run.add_argument("--runs", type=int, default=None,
                     help=f"timed runs per contender (default {DEFAULT_RUNS}; "
                          f"--quick: {QUICK_RUNS})")
    run.add_argument("--warmup", type=int, default=1,
                     help="untimed, unchecked calls per contender and mode before the timed runs "
                          "(default 1)")
    run.add_argument("--modes", type=_choice_list(MODES, "mode"), default=list(DEFAULT_MODES),
                     help="comma list of registered,pageable,fresh (default registered,pageable); fresh: "
                          "A and B copied into new arrays before every run, blasx returning a new C")
    run.add_argument("--contenders", type=_choice_list(CONTENDER_ORDER, "contender"),
                     default=list(CONTENDER_ORDER),
                     help=f"comma list of {','.join(CONTENDER_ORDER)} (default all)")
    run.add_argument("--tile", type=int, default=None, help="blasx tile size (default: blasx's)")
    run.add_argument("--xt-blocks", type=_int_list, default=None,
                     help=f"cuBLAS-XT block dims (default {','.join(map(str, DEFAULT_XT_BLOCKS))}; "
                          f"--quick: {','.join(map(str, QUICK_XT_BLOCKS))})")
    run.add_argument("--xt-pinning", choices=("auto", "on", "off"), default="auto",
                     help="cuBLAS-XT pinning mode: auto = on for pageable and fresh, off for "
                          "registered arrays")
    run.add_argument("--numpy-max-n", type=int, default=8192,
                     help="run numpy only when max(M,N,K) <= this (default 8192)")
    run.add_argument("--quick", action="store_true",
                     help="smoke run: small N, fewer runs, small cuBLAS-XT blocks")
    out = p.add_argument_group("output")
    out.add_argument("--out", default=os.path.join("bench", "results"),
                     help="directory of the JSON and markdown results (default bench/results)")
    out.add_argument("--tag", default=None, help="name in the result files (default: hostname)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and complete the options: --quick defaults, sizes, scalar/dtype checks."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.n = args.n or list(QUICK_N if args.quick else DEFAULT_N)
    args.runs = args.runs if args.runs is not None else (QUICK_RUNS if args.quick else DEFAULT_RUNS)
    args.xt_blocks = args.xt_blocks or list(QUICK_XT_BLOCKS if args.quick else DEFAULT_XT_BLOCKS)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    for name in ("m", "k", "tile", "numpy_max_n"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if (args.alpha.imag or args.beta.imag) and any(d not in "cz" for d in args.dtypes):
        parser.error("complex --alpha/--beta need complex --dtypes (c,z) only")
    args.sizes = [(args.m or n, n, args.k or n) for n in args.n]
    args.tag = _safe_name(args.tag or socket.gethostname())
    return args


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "host"


# --------------------------------------------------------------------------- running


def schedule(contenders: Sequence[Contender], p: Problem, runs: int, seed: int) -> list[tuple]:
    """All (contender, variant, run) triples in a random order fixed by the seed and the case."""
    items = [(c, v, r) for c in contenders for v in c.variants(p) for r in range(runs)]
    random.Random(f"{seed}:{p.dtype}:{p.m}:{p.n}:{p.k}:{p.mode}").shuffle(items)
    return items


def _records(c: Contender, variant, p: Problem, run: int, warmup: bool, **fields) -> list[Record]:
    times = fields.pop("times", None) or {label: None for label in c.labels(variant)}
    return [Record(label, c.name, variant, p.mode, p.dtype, p.m, p.n, p.k, run, seconds,
                   warmup=warmup, **fields) for label, seconds in times.items()]


def release_blasx_pins(p: Problem) -> None:
    """Pageable mode measures one-shot calls: whatever blasx page-locked in an earlier run is
    unregistered (untimed) before every run, so blasx pays its pinning or staging each time and
    no other contender reads memory that blasx left pinned."""
    try:
        from blasx.runtime.hostmem import REGISTRY
    except ImportError:                 # blasx not installed: it pinned nothing
        return
    for x in (p.a, p.b, p.c_init, p.c_out):
        if x is not None:
            REGISTRY.release(x)


def refresh_inputs(p: Problem) -> None:
    """Fresh mode: A and B become new arrays of the same values (untimed), their pages written and
    never page-locked: a caller's one-shot arrays. The old ones go (and blasx's registrations with them)."""
    for name in ("a", "b"):
        old = getattr(p, name)
        new = np.empty_like(old, order="K")
        np.copyto(new, old)
        setattr(p, name, new)
        del old


def execute(c: Contender, variant, p: Problem, run: int, warmup: bool = False) -> list[Record]:
    """Poison C, run once, check the result (not for warm-ups); failures become records."""
    p.poison()
    if p.mode in ("pageable", "fresh"):
        release_blasx_pins(p)
    if p.mode == "fresh":
        refresh_inputs(p)
    try:
        out = c.run(p, variant)
    except Exception as e:
        failure, extra = _describe(e), {"traceback": traceback.format_exc()[-4000:]}
        del e
        _free_device_pool()             # e.g. after an out-of-memory error
        return _records(c, variant, p, run, warmup, error=None, ok=False,
                        failure=failure, extra=extra)
    if warmup:
        return _records(c, variant, p, run, True, times=out.times, error=None, ok=True,
                        extra=out.extra)
    result = out.result if p.ref_rows is None or out.result is None else np.asarray(out.result)[p.ref_rows]
    err = rel_error(result, p.ref, p.ref_norm)
    ok = bool(err <= p.tolerance)
    return _records(c, variant, p, run, False, times=out.times, error=err, ok=ok,
                    extra=out.extra)


def _log_records(p: Problem, recs: list[Record], total: int | None = None) -> None:
    for r in recs:
        head = f"[{p.mode} {p.dtype} {p.size}] {r.label:<18}"
        which = "warm-up" if r.warmup else f"run {r.run + 1}/{total}"
        if r.failure:
            log(f"{head} {which}: FAILED {r.failure}")
        elif r.warmup:
            log(f"{head} {which}: {r.seconds:.4f} s")
        else:
            tf = tflops(p.dtype, p.m, p.n, p.k, r.seconds) or 0.0
            log(f"{head} {which}: {r.seconds:.4f} s {tf:8.2f} TFLOPS  err {r.error:.1e} "
                f"{'ok' if r.ok else 'WRONG'}")


def run_mode(p: Problem, contenders: Sequence[Contender], args) -> tuple[list[Record], dict]:
    """Warm-ups, then the shuffled timed runs, of every applicable contender in one mode.
    A contender variant that raises is not run again in this mode."""
    records: list[Record] = []
    skipped: dict[str, str] = {}
    active = []
    for c in contenders:
        try:
            reason = c.skip_reason(p)
        except Exception as e:
            reason = f"cannot check: {_describe(e)}"
        if reason:
            skipped[c.name] = reason
            log(f"[{p.mode} {p.dtype} {p.size}] {c.name}: skipped ({reason})")
        else:
            active.append(c)
    failed: set[tuple[str, object]] = set()

    def do(c, v, run, warmup):
        recs = execute(c, v, p, run, warmup)
        _log_records(p, recs, args.runs)
        if any(r.failure for r in recs):
            failed.add((c.name, v))
        records.extend(recs)

    for c in active:
        for v in c.variants(p):
            for i in range(args.warmup):
                if (c.name, v) not in failed:
                    do(c, v, i, True)
    for c, v, r in schedule(active, p, args.runs, args.seed):
        if (c.name, v) not in failed:
            do(c, v, r, False)
    return records, skipped


def _registration_info(reg) -> dict:
    return {"gib": gib(reg.nbytes), "seconds": reg.seconds,
            "seconds_per_gib": reg.seconds_per_gib,
            "unregister_seconds": reg.unregister_seconds}


def run_problem(args, dtype: str, size: tuple[int, int, int], gpus: list[int],
                contenders: Sequence[Contender], report: dict) -> None:
    m, n, k = size
    need = host_bytes_needed(dtype, m, n, k, typed_scalar(args.beta, dtype), args.check_rows, "fresh" in args.modes)
    log(f"== {dtype} {size_label(m, n, k)}: host arrays {gib(need):.1f} GiB")
    _warn_host_memory(need)
    t0 = time.perf_counter()
    p = make_problem(args, dtype, m, n, k, gpus)
    case = {"dtype": dtype, "m": m, "n": n, "k": k, "alpha": p.alpha, "beta": p.beta,
            "tolerance": p.tolerance, "host_gib": gib(need), "math": p.math,
            "generate_seconds": time.perf_counter() - t0, "modes": {}}
    rates = report.setdefault("link_rates", None)
    if rates is None and "blasx" in args.contenders:
        rates = report["link_rates"] = gemm_lp.link_rates(gpus)
    in_bytes = p.a.nbytes + p.b.nbytes + (p.c_init.nbytes if p.c_init is not None else 0)
    case["link_bound"] = gemm_lp.link_bound(rates or {}, in_bytes, p.c_out.nbytes)
    if case["link_bound"]:
        log("   " + gemm_lp.format_bound(case, None))
    ref, case["reference"] = compute_reference(p)
    p.ref, p.ref_norm = ref, frobenius(ref)
    log(f"   reference on {case['reference']['where']} in {case['reference']['seconds']:.1f} s")
    report["cases"].append(case)
    for mode in args.modes:
        pm = replace(p, mode=mode)
        info: dict = {}
        if mode == "registered":
            hold = registered(pm.a, pm.b, pm.c_out)
        else:
            hold = contextlib.nullcontext()
        try:
            with hold as reg:
                if reg is not None:
                    log(f"   registered {gib(reg.nbytes):.1f} GiB in {reg.seconds:.2f} s "
                        f"({reg.seconds_per_gib:.3f} s/GiB)")
                try:
                    records, info["skipped"] = run_mode(pm, contenders, args)
                finally:
                    for c in contenders:
                        with contextlib.suppress(Exception):
                            c.end_mode()
            if reg is not None:
                info["registration"] = _registration_info(reg)
        except Exception as e:          # registration failed: note it, go on with other modes
            info["error"] = _describe(e)
            log(f"   mode {mode} failed: {info['error']}")
            records = []
        case["modes"][mode] = info
        report["records"].extend(records)
    del p, ref
    gc.collect()


def _warn_host_memory(need: int) -> None:
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemAvailable"))
    except (OSError, StopIteration, ValueError):
        return
    if need > 0.9 * avail:
        log(f"   WARNING: needs {gib(need):.1f} GiB of host memory, {gib(avail):.1f} GiB available")


# --------------------------------------------------------------------------- output


def jsonable(obj):
    """JSON-safe copy: numpy scalars to Python, NaN/inf to None, complex to str."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(asdict(obj))
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, complex):
        return str(obj) if obj.imag else jsonable(obj.real)
    if isinstance(obj, np.ndarray):
        return f"<array {obj.shape} {obj.dtype}>"
    return repr(obj)


def output_paths(out_dir: str, tag: str, stamp: str) -> tuple[str, str]:
    base = os.path.join(out_dir, f"gemm-{tag}-{stamp}")
    return base + ".json", base + ".md"


def write_outputs(report: dict, out_dir: str) -> tuple[str, str]:
    rows = summarize(Record(**r) if isinstance(r, dict) else r for r in report["records"])
    report["summary"] = rows
    report["ratios"] = compute_ratios(rows, len(report["config"].get("gpus") or []))
    os.makedirs(out_dir, exist_ok=True)
    json_path, md_path = output_paths(out_dir, report["tag"], report["stamp"])
    tmp = json_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(jsonable(report), f, indent=1)
    os.replace(tmp, json_path)
    with open(md_path, "w") as f:
        f.write(format_markdown(report))
    return json_path, md_path


def new_report(args: argparse.Namespace, argv: Sequence[str], env: dict) -> dict:
    now = _dt.datetime.now(_dt.timezone.utc).astimezone()
    config = {k: v for k, v in vars(args).items() if k not in ("sizes",)}
    config["sizes"] = [list(s) for s in args.sizes]
    return {"schema": "blasx-bench-gemm/1", "tag": args.tag,
            "date": now.isoformat(timespec="seconds"), "stamp": now.strftime("%Y%m%d-%H%M%S"),
            "command": shlex.join([os.path.basename(sys.executable), "-m", "bench.gemm", *argv]),
            "argv": list(argv), "cwd": os.getcwd(), "config": config, "env": env,
            "cases": [], "records": [], "summary": [], "ratios": []}


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.gpus = resolve_gpus(args.gpus)
    env = collect_env(args.gpus)
    report = new_report(args, argv, env)
    for line in format_machine(env):
        log(line)
    contenders = [CONTENDERS[name](args) for name in args.contenders]
    paths = None
    try:
        for dtype in args.dtypes:
            for size in args.sizes:
                run_problem(args, dtype, size, args.gpus, contenders, report)
                paths = write_outputs(report, args.out)
    except KeyboardInterrupt:
        log("interrupted: writing what was measured")
    finally:
        for c in contenders:
            try:
                c.close()
            except Exception as e:
                log(f"closing {c.name}: {_describe(e)}")
        paths = write_outputs(report, args.out)
    print(format_text_report(report))
    print(f"\nwrote {paths[0]}\n      {paths[1]}")
    # (a peer that cannot run a size, out of memory say, is reported; blasx failing one is the run's failure)
    return 1 if any(r.status == "WRONG" or (r.status == "FAILED" and r.label == "blasx")
                    for r in report["summary"]) else 0


if __name__ == "__main__":
    sys.exit(main())
