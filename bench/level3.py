"""Level-3 routines beside GEMM: blasx against cuBLAS-XT, in one process, on the same arrays.

    python -m bench.level3 --n 8192,16384 --dtypes d,s --gpus 2 --runs 3 --xt-block 8192 --out bench/results
    python -m bench.level3 --n 16384,32768 --dtypes z,c --gpus 1 --runs 1 \\
        --routines gemm,symm,hemm,syrk,herk,syr2k,her2k,trmm,trsm

Single (s), double (d), single complex (c) and double complex (z) precision, F-ordered host
arrays page-locked before timing (the "registered" case), upper triangle, no transpose, left side,
non-unit diagonal. alpha 1.5 / beta 0.5 for s and d; alpha 1.5-0.5j / beta 0.5+0.25j for c and z,
except where BLAS takes real scalars: HERK (alpha 1.5, beta 0.5) and HER2K (beta 0.5). The
Hermitian routines (HEMM, HERK, HER2K) exist for c and z only. Every result is checked on a
sample of rows spread over the matrix against a float64 (complex128 for c and z) reference
computed by numpy (for TRSM: the residual op(A) X - alpha B on those rows); the tolerance on the
relative error is 1e-9 (d, z) or 1e-4 (s, c), times sqrt(N / 8192) above N = 8192. Rates use each
routine's flop count (GEMM, SYMM, HEMM 2N^3, SYRK, HERK N^3, SYR2K, HER2K 2N^3, TRMM, TRSM N^3;
x4 for complex types, whose multiply-add is 8 real flops against 2), so a routine at GEMM's rate
means GEMM-like efficiency.

The arrays of one (N, dtype) exist only while that case runs; float32 and complex arrays are made
from float64 random numbers cast chunk by chunk (never a full float64 copy). The pure pieces
(argument parsing here; the routines in bench.level3_routines, array generation and the checks in
bench.level3_check, the two contenders' calls in bench.level3_contenders, the tables in
bench.level3_table) are also used by ``bench.efficiency`` and ``bench.ab``; CuPy and cuBLAS-XT are
only touched inside :func:`main`'s run loop.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time

from blasx.runtime.dtypes import BY_PREFIX, PREFIXES, TYPES

from .cublasxt import CublasXt, registered
from .level3_check import (
    CHECK_ROWS, base_tolerance, compare, make_arrays, parallel_copy, reference, sample_rows, tolerance,
)
from .level3_contenders import run_blasx, run_xt
from .level3_routines import (
    ALL_ROUTINES, ALPHA, BETA, C_ROUTINES, FLOPS, HERMITIAN, ROUTINE_DTYPES, ROUTINES, routines_for, scalars,
)
from .level3_table import (
    DTYPE_NAMES, device_times, format_breakdown, format_failures, format_markdown, format_table, scalar_table,
)
from .machine import gpu_tag, machine_name
from .result_files import command_line, finite, utc_stamp, write_json_md

#: the dtypes that :func:`parse_dtypes` allows by default (bench.efficiency's --dtypes: real only)
REAL_DTYPES = tuple(t.prefix for t in TYPES if not t.is_complex)


class ArgError(argparse.ArgumentTypeError, ValueError):
    """A bad option value. argparse shows its message as is; callers outside argparse may catch
    it as a ValueError."""


# --------------------------------------------------------------------------- arguments


def parse_dtypes(text: str, option: str = "--dtypes", allowed=REAL_DTYPES) -> list[str]:
    """'d,s' -> ['d', 's'] (order kept, duplicates dropped), each letter one of `allowed`. The
    default is s and d, the dtypes of bench.efficiency (which takes this parser); bench.level3's
    own --dtypes allows c and z too (:func:`parse_level3_dtypes`)."""
    values = [x.strip().lower() for x in str(text).split(",") if x.strip()]
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise ArgError(f"{option}: got {text!r}; allowed: a comma list of {', '.join(allowed)} "
                       f"({', '.join(f'{d} = {BY_PREFIX[d].dtype.name}' for d in allowed)})")
    return list(dict.fromkeys(values))


def parse_level3_dtypes(text: str) -> list[str]:
    """bench.level3's --dtypes: 'z,c' -> ['z', 'c'], any of s, d, c, z."""
    return parse_dtypes(text, "--dtypes", tuple(PREFIXES))


def parse_positive_list(text: str, option: str) -> list[int]:
    """'8192,16384' -> [8192, 16384]: positive integers, order kept, duplicates dropped."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise ArgError(f"{option}: got {text!r}; allowed: a comma list of positive integers")
    return list(dict.fromkeys(values))


def _only_for(routines) -> str:
    """'hemm, herk: c, z only' for the routines of some dtypes only ('' if none)."""
    groups: dict[str, list[str]] = {}
    for r in routines:
        if ROUTINE_DTYPES[r] != PREFIXES:
            groups.setdefault(ROUTINE_DTYPES[r], []).append(r)
    return "; ".join(f"{', '.join(rs)}: {', '.join(ds)} only" for ds, rs in groups.items())


def parse_routines(text: str) -> list[str]:
    values = [x.strip().lower() for x in str(text).split(",") if x.strip()]
    bad = [v for v in values if v not in FLOPS]
    if not values or bad:
        raise ArgError(f"--routines: got {text!r}; allowed: a comma list of {', '.join(ALL_ROUTINES)} "
                       f"({_only_for(ALL_ROUTINES)})")
    return list(dict.fromkeys(values))


def resolve_routines(routines, dtypes) -> list[str]:
    """--routines against --dtypes. None (the default) -> every routine of at least one selected
    dtype, in table order (s, d: the six of every dtype; with c or z also hemm, herk, her2k).
    A list keeps its order; a routine of no selected dtype (hemm with --dtypes d,s) is an error."""
    if routines is None:
        return [r for r in ALL_ROUTINES if any(routines_for(d, [r]) for d in dtypes)]
    orphans = [r for r in routines if not any(routines_for(d, [r]) for d in dtypes)]
    if orphans:
        raise ArgError(f"--routines: got {','.join(routines)!r}; {_only_for(orphans)}, and --dtypes is "
                       f"{','.join(dtypes)!r}: add one of those dtypes to --dtypes or drop "
                       f"{', '.join(orphans)} from --routines")
    return list(routines)


def positive_int(option: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = 0
        if v <= 0:
            raise ArgError(f"{option}: got {text!r}; allowed: a positive integer")
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.level3", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=lambda t: parse_positive_list(t, "--n"), default=[8192, 16384],
                   help="comma list of N (default 8192,16384)")
    p.add_argument("--dtypes", type=parse_level3_dtypes, default=["d", "s"],
                   help="comma list of s,d,c,z (float32, float64, complex64, complex128; default d,s)")
    p.add_argument("--gpus", type=positive_int("--gpus"), default=2, help="GPU count (devices 0..count-1)")
    p.add_argument("--runs", type=positive_int("--runs"), default=3, help="timed runs per routine and contender")
    p.add_argument("--xt-block", type=positive_int("--xt-block"), default=8192, help="cuBLAS-XT block dim")
    p.add_argument("--routines", type=parse_routines, default=None,
                   help=f"comma list of {','.join(ALL_ROUTINES)}. Each dtype runs those that exist for it: "
                        f"{','.join(HERMITIAN)} for c and z only (with --dtypes d,z they run for z alone); one "
                        f"that exists for no selected dtype is an error. Default: every routine of a selected "
                        f"dtype ({','.join(ROUTINES)} for s and d; for c and z the Hermitian ones too)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrays and of the run order")
    p.add_argument("--devices", default=None,
                   help="blasx device spec (default cuda:0,..,gpus-1); cuBLAS-XT still needs the GPUs (the CPU "
                        "tests run the loop with sim:2 and cuBLAS-XT replaced by numpy)")
    p.add_argument("--tile", type=positive_int("--tile"), default=None,
                   help="blasx tile size for every routine (default: blasx's choice per call)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tag", default=None, help="name in the result files (default: GPU model and --gpus, 'h200x2')")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.routines = resolve_routines(args.routines, args.dtypes)
    except ArgError as e:
        p.error(str(e))
    return args


# --------------------------------------------------------------------------- running


def run_case(blasx, xt, args, n: int, dtype: str, A, B, C0, out, results: list) -> None:
    """The warm-ups, then the shuffled timed runs, of every routine and contender on one
    (N, dtype). A call that raises is recorded as a failure and its (contender, routine) is not
    run again in this case."""
    rows = sample_rows(n, CHECK_ROWS, args.seed)
    routines = routines_for(dtype, args.routines)  # d: no hemm, herk, her2k
    order = [(who, rt, k) for rt in routines for who in ("blasx", "cublasxt") for k in range(args.runs + 1)]
    random.Random(f"{args.seed}:{n}:{dtype}").shuffle(order)
    order.sort(key=lambda x: x[2] > 0)  # warm-ups first, then the shuffled timed runs
    failed: set = set()
    refs: dict = {}  # routine -> its reference rows, computed at its first check
    for who, rt, k in order:
        if (who, rt) in failed:
            continue
        alpha, beta = scalars(dtype, rt)
        parallel_copy(out, C0 if rt in C_ROUTINES else B)  # untimed reset
        t = time.perf_counter()
        try:
            if who == "blasx":
                run_blasx(blasx, dtype, rt, n, A, B, C0, out, alpha, beta)
            else:
                run_xt(xt, dtype, rt, n, A, B, C0, out, alpha, beta)
        except Exception as e:  # noqa: BLE001 - recorded; the other routines go on
            failed.add((who, rt))
            msg = f"{type(e).__name__}: {e}"
            print(f"   {who:<8} {dtype}{rt:<6} {'warm-up' if k == 0 else f'run {k}'}: FAILED {msg}", flush=True)
            results.append({"who": who, "routine": rt, "dtype": dtype, "n": n, "run": k, "seconds": None,
                            "rel_err": None, "tflops": None, "ok": False, "failure": msg})
            continue
        t = time.perf_counter() - t
        if k == 0:
            continue  # warm-up
        if rt not in refs:
            refs[rt] = reference(rt, A, B, C0, alpha, beta, rows)
        err = compare(rt, A, out, rows, refs[rt])
        ok = bool(err <= tolerance(dtype, n))
        tf = FLOPS[rt] * BY_PREFIX[dtype].flop_factor * n**3 / t / 1e12
        print(f"   {who:<8} {dtype}{rt:<6} run {k}: {t:.4f} s {tf:7.2f} TFLOPS err {err:.1e} "
              f"{'ok' if ok else 'WRONG'}", flush=True)
        results.append({"who": who, "routine": rt, "dtype": dtype, "n": n, "run": k, "seconds": t,
                        "rel_err": finite(err), "tflops": tf, "ok": ok,
                        **({"devices": device_times(blasx.last_profile())} if who == "blasx" else {})})


def main(argv=None):
    args = parse_args(argv)
    import blasx
    gpus = list(range(args.gpus))
    devices = args.devices or "cuda:" + ",".join(map(str, gpus))
    results: list[dict] = []
    registration = []
    problems: list[str] = []
    try:
        for n in args.n:
            for dtype in args.dtypes:
                t0 = time.perf_counter()
                A, B, C0, out = make_arrays(n, dtype, args.seed)
                print(f"== N={n} {DTYPE_NAMES[dtype]}: arrays {4 * A.nbytes / 2**30:.1f} GiB made in "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
                try:
                    blasx.configure(devices=devices, tile=args.tile)
                    with registered(A, B, C0, out) as reg, CublasXt(gpus, block_dim=args.xt_block) as xt:
                        print(f"   registered {reg.nbytes / 2**30:.1f} GiB in {reg.seconds:.1f} s", flush=True)
                        run_case(blasx, xt, args, n, dtype, A, B, C0, out, results)
                    registration.append({"n": n, "dtype": dtype, "gib": reg.nbytes / 2**30, "seconds": reg.seconds,
                                         "unregister_seconds": reg.unregister_seconds})
                finally:
                    blasx.shutdown()
                    del A, B, C0, out
                    gc.collect()
    except KeyboardInterrupt:
        problems.append("interrupted: the table holds what was measured")
    except Exception as e:
        problems.append(f"{type(e).__name__}: {e}")
        raise
    finally:
        text = format_table(results, args.routines, args.dtypes)
        print(text)
        stamp, date = utc_stamp()
        args.tag = args.tag or gpu_tag(args.gpus)
        report = {"tag": args.tag, "date": date, "stamp": stamp, "command": command_line("bench.level3", argv),
                  "machine": machine_name(), "dtypes": args.dtypes, "runs": args.runs, "alpha": ALPHA, "beta": BETA,
                  "tile": args.tile,
                  "table": text, "breakdown": format_breakdown(results, args.routines, args.dtypes),
                  "failures": problems + format_failures(results)}
        base = os.path.join(args.out, f"level3-{args.tag}-{stamp}")
        data = {**{k: v for k, v in report.items() if k not in ("table", "breakdown")},
                "argv": sys.argv[1:] if argv is None else list(argv), "routines": args.routines, "n": args.n,
                "xt_block": args.xt_block, "gpus": args.gpus, "devices": devices,
                "scalars": scalar_table(args.dtypes, args.routines),
                "flop_factor": {d: BY_PREFIX[d].flop_factor for d in args.dtypes},
                "tolerance": {d: base_tolerance(d) for d in args.dtypes}, "registration": registration,
                "results": results}
        paths = write_json_md(base, data, format_markdown(report))
        print("wrote", paths[0], "and", paths[1])
    return 0 if results and all(r["ok"] for r in results) and not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
