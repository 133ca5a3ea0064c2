"""The ``blasx`` command line.

``blasx gemm``: the main job, an out-of-core GEMM on the devices found,
checked against numpy, with a report. ``blasx info``: the devices.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

DTYPES = {"s": np.float32, "d": np.float64, "c": np.complex64, "z": np.complex128}


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}, need a positive integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"got {v}, need a positive integer")
    return v


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="blasx", description="Multi-GPU tiled level-3 BLAS (the BLASX design).")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gemm", help="run C = alpha A B + beta C on host arrays, check it, and report",
                       description="Out-of-core GEMM on host (numpy) arrays across the configured devices, "
                                   "checked against numpy on a sample of rows.")
    g.add_argument("--n", type=_positive, default=4096, help="N (and M, K unless given); default 4096")
    g.add_argument("--m", type=_positive, help="rows of C (default N)")
    g.add_argument("--k", type=_positive, help="inner dimension (default N)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="d", help="s, d, c or z (default d)")
    g.add_argument("--devices", help="device spec: cuda, cuda:0,1, sim:4, cpu (default: $BLASX_DEVICES or all GPUs or cpu)")
    g.add_argument("--tile", type=_positive, help="tile size (default: chosen per call)")
    g.add_argument("--cache-bytes", type=_positive, help="tile cache per device in bytes")
    g.add_argument("--cpu", action="store_true", help="add the CPU as a worker beside the GPUs")
    g.add_argument("--runs", type=_positive, default=2, help="timed calls (default 2)")
    g.add_argument("--check-rows", type=int, default=256, help="rows checked against numpy (0: none)")
    g.add_argument("--trace", help="write the last call's timeline as Chrome-trace JSON here")
    g.add_argument("--profile", help="write the last call's profile plot (PNG, needs matplotlib) here")
    sub.add_parser("info", help="show the devices blasx would use")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import blasx
    try:
        if args.cmd == "info":
            return _info(blasx)
        return _gemm(blasx, args)
    finally:
        blasx.shutdown()


def _info(blasx) -> int:
    eng = blasx.engine()
    print(f"devices ({eng.spec}):")
    for d in eng.devices:
        cap = f", tile cache {d.cache_capacity() / 2**30:.2f} GiB" if d.streamed else ""
        print(f"  [{d.index}] {d.name} ({d.kind}, {d.nstreams} stream(s){cap})")
    return 0


def _gemm(blasx, args) -> int:
    m, k = args.m or args.n, args.k or args.n
    n = args.n
    dtype = np.dtype(DTYPES[args.dtype])
    blasx.configure(devices=args.devices, tile=args.tile, cache_bytes=args.cache_bytes,
                    cpu=True if args.cpu else None)
    rng = np.random.default_rng(0)

    def rand(shape):
        x = rng.standard_normal(shape)
        return (x + 1j * rng.standard_normal(shape) if dtype.kind == "c" else x).astype(dtype)

    a, b = rand((m, k)), rand((k, n))
    c = np.empty((m, n), dtype, order="F")
    flops = (8 if dtype.kind == "c" else 2) * m * n * k
    print(f"blasx gemm: {m}x{n}x{k} {dtype.name}, {(a.nbytes + b.nbytes + c.nbytes) / 2**30:.2f} GiB of operands")
    for r in range(args.runs):
        c[...] = np.nan  # poison: every element must be written
        t = time.perf_counter()
        blasx.gemm(1.0, a, b, c=c, overwrite_c=True)
        t = time.perf_counter() - t
        print(f"  run {r}: {t:.3f} s, {flops / t / 1e12:.3f} TFLOPS")
    prof = blasx.last_profile()
    print(prof.report())
    status = 0
    if args.check_rows:
        rows = min(args.check_rows, m)
        wide = np.complex128 if dtype.kind == "c" else np.float64
        ref = a[:rows].astype(wide) @ b.astype(wide)
        err = np.linalg.norm(c[:rows] - ref) / np.linalg.norm(ref)
        tol = 1e-4 if dtype in (np.float32, np.complex64) else 1e-10
        ok = bool(np.isfinite(c).all()) and err < tol
        print(f"check: {rows} rows against numpy, relative error {err:.2e} ({'ok' if ok else 'WRONG'}, tolerance {tol:g})")
        status = 0 if ok else 1
    if args.trace:
        prof.to_chrome_trace(args.trace)
        print(f"trace: {args.trace}")
    if args.profile:
        prof.plot(args.profile)
        print(f"profile plot: {args.profile}")
    return status


if __name__ == "__main__":
    sys.exit(main())
