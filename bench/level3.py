"""Level-3 routines beside GEMM: blasx against cuBLAS-XT, in one process, on the same arrays.

    python -m bench.level3 --n 8192,16384 --gpus 2 --runs 3 --xt-block 8192 --out bench/results

Double precision, F-ordered host arrays page-locked before timing (the "registered" case),
alpha 1.5 / beta 0.5, upper triangle, no transpose, left side, non-unit diagonal. Every result
is checked on a sample of rows against numpy (for TRSM: the residual op(A) X - alpha B on those
rows). Rates use each routine's flop count (GEMM 2N^3, SYMM 2N^3, SYRK N^3, SYR2K 2N^3, TRMM N^3,
TRSM N^3), so a routine at GEMM's rate means GEMM-like efficiency.
"""

from __future__ import annotations

import argparse
import ctypes as C
import datetime as dt
import json
import os
import random
import time

import numpy as np

from .cublasxt import CublasXt, _check, registered

UPPER_XT, LEFT, NOTRANS, NONUNIT = 1, 0, 0, 0  # cuBLAS enums: FILL_MODE_UPPER = 1
S, P, I = C.c_size_t, C.c_void_p, C.c_int
XT_ARGTYPES = {
    "cublasXtDgemm": [P, I, I, S, S, S, P, P, S, P, S, P, P, S],
    "cublasXtDsymm": [P, I, I, S, S, P, P, S, P, S, P, P, S],
    "cublasXtDsyrk": [P, I, I, S, S, P, P, S, P, P, S],
    "cublasXtDsyr2k": [P, I, I, S, S, P, P, S, P, S, P, P, S],
    "cublasXtDtrmm": [P, I, I, I, I, S, S, P, P, S, P, S, P, S],
    "cublasXtDtrsm": [P, I, I, I, I, S, S, P, P, S, P, S],
}
FLOPS = {"gemm": 2, "symm": 2, "syrk": 1, "syr2k": 2, "trmm": 1, "trsm": 1}  # x N^3


def _xt_call(xt, name, *args):
    fn = getattr(xt._lib, name)
    fn.argtypes, fn.restype = XT_ARGTYPES[name], C.c_int
    _check(fn(xt._handle, *args), name)


def run_xt(xt, routine, n, A, B, C0, out, alpha, beta):
    al, be = C.c_double(alpha), C.c_double(beta)
    pa, pb, pc = A.ctypes.data, B.ctypes.data, out.ctypes.data
    ra, rb = C.addressof(al), C.addressof(be)
    if routine == "gemm":
        _xt_call(xt, "cublasXtDgemm", NOTRANS, NOTRANS, n, n, n, ra, pa, n, pb, n, rb, pc, n)
    elif routine == "symm":
        _xt_call(xt, "cublasXtDsymm", LEFT, UPPER_XT, n, n, ra, pa, n, pb, n, rb, pc, n)
    elif routine == "syrk":
        _xt_call(xt, "cublasXtDsyrk", UPPER_XT, NOTRANS, n, n, ra, pa, n, rb, pc, n)
    elif routine == "syr2k":
        _xt_call(xt, "cublasXtDsyr2k", UPPER_XT, NOTRANS, n, n, ra, pa, n, pb, n, rb, pc, n)
    elif routine == "trmm":  # out-of-place: C = alpha A B (B copied to out only for the timing symmetry)
        _xt_call(xt, "cublasXtDtrmm", LEFT, UPPER_XT, NOTRANS, NONUNIT, n, n, ra, pa, n, pb, n, pc, n)
    elif routine == "trsm":  # in place on out (= B)
        _xt_call(xt, "cublasXtDtrsm", LEFT, UPPER_XT, NOTRANS, NONUNIT, n, n, ra, pa, n, pc, n)


def run_blasx(blasx, routine, n, A, B, C0, out, alpha, beta):
    if routine in ("gemm", "symm", "syrk", "syr2k"):
        args = {"gemm": (A, B), "symm": (A, B), "syrk": (A,), "syr2k": (A, B)}[routine]
        fn = blasx.gemm if routine == "gemm" else getattr(blasx, "d" + routine)
        fn(alpha, *args, beta=beta, c=out, overwrite_c=True)
    else:
        getattr(blasx, "d" + routine)(alpha, A, out, overwrite_b=True)


def check(routine, A, B, C0, out, alpha, beta, rows):
    r = rows
    if routine == "gemm":
        ref = alpha * A[r] @ B + beta * C0[r]
    elif routine == "symm":
        ref = alpha * (np.triu(A) + np.triu(A, 1).T)[r] @ B + beta * C0[r]
    elif routine in ("syrk", "syr2k"):
        prod = A[r] @ A.T if routine == "syrk" else A[r] @ B.T + B[r] @ A.T
        ref = alpha * prod + beta * C0[r]
        mask = np.arange(A.shape[0])[None, :] >= np.asarray(r)[:, None]  # upper triangle of the rows
        ref, got = ref[mask], out[r][mask]
        return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    elif routine == "trmm":
        ref = alpha * np.triu(A)[r] @ B
    else:  # trsm: residual of triu(A) X = alpha B on the rows
        got = np.triu(A)[r] @ out
        ref = alpha * B[r]
        return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    return float(np.linalg.norm(out[r] - ref) / np.linalg.norm(ref))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.level3", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default="8192,16384")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--xt-block", type=int, default=8192)
    p.add_argument("--routines", default="gemm,symm,syrk,syr2k,trmm,trsm")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tag", default="h200x2")
    args = p.parse_args(argv)
    import blasx
    gpus = list(range(args.gpus))
    routines = args.routines.split(",")
    alpha, beta = 1.5, 0.5
    rows = list(range(0, 64))
    results = []
    for n in [int(x) for x in args.n.split(",")]:
        rng = np.random.default_rng(n)
        A = np.asfortranarray(rng.standard_normal((n, n)) / np.sqrt(n))
        A[np.diag_indices(n)] += 4.0  # well conditioned for TRSM
        B = np.asfortranarray(rng.standard_normal((n, n)))
        C0 = np.asfortranarray(rng.standard_normal((n, n)))
        out = np.empty((n, n), order="F")
        blasx.configure(devices="cuda:" + ",".join(map(str, gpus)))
        with registered(A, B, C0, out), CublasXt(gpus, block_dim=args.xt_block) as xt:
            order = [(who, rt, k) for rt in routines for who in ("blasx", "cublasxt") for k in range(args.runs + 1)]
            random.Random(n).shuffle(order)
            order.sort(key=lambda x: x[2] > 0)  # warm-ups first, then the shuffled timed runs
            for who, rt, k in order:
                out[...] = C0 if rt in ("gemm", "symm", "syrk", "syr2k") else B  # untimed reset
                t = time.perf_counter()
                (run_blasx if who == "blasx" else run_xt)(blasx if who == "blasx" else xt, rt, n, A, B, C0, out,
                                                         alpha, beta)
                t = time.perf_counter() - t
                if k == 0:
                    continue  # warm-up
                err = check(rt, A, B, C0, out, alpha, beta, rows)
                results.append({"who": who, "routine": rt, "n": n, "run": k, "seconds": t, "rel_err": err,
                                "tflops": FLOPS[rt] * n**3 / t / 1e12, "ok": bool(err < 1e-9)})
        blasx.shutdown()
    table = {}
    for r in results:
        key = (r["n"], r["routine"], r["who"])
        best = table.get(key)
        if best is None or r["seconds"] < best["seconds"]:
            table[key] = r | {"all_ok": all(x["ok"] for x in results if (x["n"], x["routine"], x["who"]) == key)}
    lines = ["| N | routine | blasx TFLOPS | cuBLAS-XT TFLOPS | blasx / XT | blasx / blasx GEMM | checked |",
             "| --: | :-- | --: | --: | --: | --: | :-- |"]
    for n in sorted({k[0] for k in table}):
        g = table.get((n, "gemm", "blasx"))
        for rt in routines:
            b, x = table.get((n, rt, "blasx")), table.get((n, rt, "cublasxt"))
            if not b or not x:
                continue
            ok = "ok" if b["all_ok"] and x["all_ok"] else "WRONG"
            lines.append(f"| {n} | d{rt} | {b['tflops']:.1f} | {x['tflops']:.1f} | {b['tflops'] / x['tflops']:.2f}x | "
                         f"{b['tflops'] / g['tflops']:.2f} | {ok} |")
    text = "\n".join(lines)
    print(text)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"level3-{args.tag}-{stamp}")
    with open(base + ".json", "w") as f:
        json.dump({"argv": argv, "results": results, "date": stamp}, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(f"# Level-3 routines: blasx vs cuBLAS-XT ({args.tag}, {stamp} UTC)\n\n```\npython -m bench.level3 "
                f"--n {args.n} --gpus {args.gpus} --runs {args.runs} --xt-block {args.xt_block}\n```\n\n"
                f"Best of {args.runs} shuffled runs after one warm-up each; double precision, registered host "
                f"arrays, upper / no transpose / left / non-unit.\n\n{text}\n")
    print("wrote", base + ".md")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
