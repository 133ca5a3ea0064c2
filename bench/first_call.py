"""The first blasx call of a fresh process against its warm calls: what engine start-up costs a user.

    python -m bench.first_call --n 8192 --dtypes d,s --devices cuda --samples 3
    python -m bench.first_call --n 512 --devices sim:2 --samples 2 --out /tmp/fc   # no GPU

Each sample is a new Python process: it makes A, B and C (F order), page-locks them itself where the
devices are CUDA GPUs (so the first call pays engine start-up, not registration; locking them opens
GPU 0's context outside the clock), then times ``blasx.gemm(1, a, b, c=c, overwrite_c=True)``: the
first call (devices opened, heaps and handles made, kernels loaded) and ``--warm-runs`` more. Every
result is checked on random rows against numpy in double precision, C poisoned before each run.
The figure is first / best warm call per sample (issue 24's goal: at most 1.5 at N = 8192).

``--contenders blasx,cupy``: the peer is the same GEMM by CuPy on GPU 0 in a fresh process of its own
(``cupy.asarray`` of the page-locked A and B, ``@``, made F-ordered on the GPU and copied into C): what a
process pays for its first cuBLAS call on a GPU context it opens, against its warm calls.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from blasx.runtime.dtypes import BY_PREFIX

CHECK_ROWS = 64


def tolerance(prefix: str, n: int) -> float:
    """Relative-norm bound of a checked result: 64 sqrt(k) unit roundoffs of the type."""
    return 64 * n ** 0.5 * float(np.finfo(BY_PREFIX[prefix].dtype).eps)


CONTENDERS = ("blasx", "cupy")


def child(n: int, prefix: str, devices: str, warm_runs: int, seed: int, contender: str = "blasx") -> dict:
    """One fresh process's first and warm calls (the body of ``--child``)."""
    if contender == "blasx":
        import blasx
    dtype = BY_PREFIX[prefix].dtype
    rng = np.random.default_rng(seed)

    def matrix():
        x = np.empty((n, n), dtype=dtype, order="F")
        x.real = rng.standard_normal((n, n))
        if dtype.kind == "c":
            x.imag = rng.standard_normal((n, n))
        return x
    a, b = matrix(), matrix()
    c = np.empty((n, n), dtype=dtype, order="F")
    if devices.startswith("cuda") or contender == "cupy":
        from cupy.cuda import runtime
        for x in (a, b, c):
            runtime.hostRegister(x.ctypes.data, x.nbytes, 1)  # pinned by others: blasx uses it as is
    rows = np.sort(rng.choice(n, size=min(CHECK_ROWS, n), replace=False))
    wide = np.complex128 if dtype.kind == "c" else np.float64
    ref = a[rows].astype(wide) @ b.astype(wide)
    if contender == "cupy":
        import cupy

        def call():
            # F order on the GPU, then straight into C (a host-side transpose would be timed otherwise)
            cupy.asfortranarray(cupy.asarray(a) @ cupy.asarray(b)).get(out=c)  # (get() synchronises)
        gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        names = f"cuda:0 {gpu.decode() if isinstance(gpu, bytes) else gpu}"
    else:
        blasx.configure(devices=devices)

        def call():
            blasx.gemm(1.0, a, b, c=c, overwrite_c=True)
    seconds, errors = [], []
    for _ in range(1 + warm_runs):
        c.fill(np.nan)
        t0 = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t0)
        errors.append(float(np.linalg.norm(c[rows] - ref) / np.linalg.norm(ref)))
    if contender == "blasx":
        names = ", ".join(d.name for d in blasx.engine().devices if d.kind != "cpu") or "cpu"  # (not the CPU worker)
        blasx.shutdown()
    return {"first": seconds[0], "warm": seconds[1:], "errors": errors, "devices": names}


def run_sample(args, n: int, prefix: str, seed: int, contender: str = "blasx") -> dict:
    cmd = [sys.executable, "-m", "bench.first_call", "--child", "--n", str(n), "--dtypes", prefix,
           "--devices", args.devices, "--warm-runs", str(args.warm_runs), "--seed", str(seed),
           "--contenders", contender]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"failure": f"no result in {args.timeout} s"}
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"failure": f"exit {out.returncode}: {out.stderr.strip()[-600:]}"}
    return json.loads(lines[-1])


def summarise(prefix: str, n: int, samples: list[dict], contender: str = "blasx") -> dict:
    good = [s for s in samples if "failure" not in s]
    ok = bool(good) and len(good) == len(samples) and all(e <= tolerance(prefix, n) for s in good for e in s["errors"])
    ratios = [s["first"] / min(s["warm"]) for s in good if s["warm"]]
    return {"contender": contender, "dtype": prefix, "n": n, "samples": samples, "ok": ok,
            "first_median": statistics.median(s["first"] for s in good) if good else None,
            "warm_best_median": statistics.median(min(s["warm"]) for s in good if s["warm"]) if ratios else None,
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_worst": max(ratios) if ratios else None,
            "max_error": max((e for s in good for e in s["errors"]), default=None)}


def markdown(res: dict) -> str:
    lines = [f"# bench.first_call, {res['host']} {res['date']}", "", f"- command: `{res['command']}`",
             f"- devices: {res['devices']}", "",
             "| contender | dtype | N | first call s (median) | best warm call s (median) | first / warm (median) | "
             "worst | max rel. error | ok |", "| --- | --- | --: | --: | --: | --: | --: | --: | --- |"]
    for r in res["results"]:
        f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
        lines.append(f"| {r.get('contender', 'blasx')} | {r['dtype']} | {r['n']} | {f(r['first_median'])} | "
                     f"{f(r['warm_best_median'])} | "
                     f"{f(r['ratio_median'], 2)} | {f(r['ratio_worst'], 2)} | "
                     f"{'-' if r['max_error'] is None else format(r['max_error'], '.1e')} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    failures = [f"- {r.get('contender', 'blasx')} {r['dtype']} {r['n']}: {s['failure']}" for r in res["results"]
                for s in r["samples"] if "failure" in s]
    return "\n".join(lines + ([""] + failures if failures else [])) + "\n"


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.first_call", description=__doc__.splitlines()[0])
    p.add_argument("--n", default="8192", help="comma list of square sizes")
    p.add_argument("--dtypes", default="d,s", help="comma list of s, d, c, z")
    p.add_argument("--devices", default="cuda", help="blasx devices (cuda, cuda:0,1, sim:2, ...)")
    p.add_argument("--samples", type=int, default=3, help="fresh processes per size and dtype")
    p.add_argument("--warm-runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a sample may take")
    p.add_argument("--out", default=None, help="directory for the JSON and markdown (e.g. bench/results)")
    p.add_argument("--tag", default=None, help="name in the result files (default: hostname)")
    p.add_argument("--contenders", default="blasx", help="comma list of blasx, cupy (CuPy on GPU 0: the peer)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.sizes = [int(x) for x in args.n.split(",") if x.strip()]
    except ValueError:
        p.error(f"--n: got {args.n!r}, expected a comma list of positive integers")
    args.contenders = [x.strip() for x in args.contenders.split(",") if x.strip()]
    if not args.contenders or any(x not in CONTENDERS for x in args.contenders):
        p.error(f"--contenders: got {args.contenders!r}, expected a comma list of {', '.join(CONTENDERS)}")
    args.prefixes = [x.strip() for x in args.dtypes.split(",") if x.strip()]
    bad = [x for x in args.prefixes if x not in BY_PREFIX]
    if bad or not args.prefixes:
        p.error(f"--dtypes: got {args.dtypes!r}, expected a comma list of s, d, c, z")
    for name, value in (("--n", min(args.sizes, default=0)), ("--samples", args.samples),
                        ("--warm-runs", args.warm_runs)):
        if value < 1:
            p.error(f"{name}: got {value}, expected positive integers")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.child:
        print(json.dumps(child(args.sizes[0], args.prefixes[0], args.devices, args.warm_runs, args.seed,
                               args.contenders[0])))
        return 0
    res = {"host": socket.gethostname(), "date": _dt.datetime.now().isoformat(timespec="seconds"),
           "command": "python -m bench.first_call " + " ".join(argv if argv is not None else sys.argv[1:]),
           "args": {k: v for k, v in vars(args).items() if k != "child"}, "results": [], "devices": ""}
    for n in args.sizes:
        for prefix in args.prefixes:
            for who in args.contenders:
                print(f"{who} {prefix} {n} ...", file=sys.stderr, flush=True)
                samples = [run_sample(args, n, prefix, args.seed + i, who) for i in range(args.samples)]
                if who == "blasx":
                    res["devices"] = res["devices"] or next((s["devices"] for s in samples if "devices" in s), "")
                res["results"].append(summarise(prefix, n, samples, who))
    text = markdown(res)
    print(text)
    if args.out:
        tag = args.tag or socket.gethostname()
        stem = os.path.join(args.out, f"first-call-{tag}-{_dt.datetime.now():%Y%m%d-%H%M%S}")
        with open(stem + ".json", "w") as f:
            json.dump(res, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(text)
    return 0 if all(r["ok"] for r in res["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
