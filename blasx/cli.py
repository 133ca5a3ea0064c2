"""The ``blasx`` command line.

``blasx gemm``: the main job, an out-of-core GEMM on the devices found,
checked against numpy, with a report. ``blasx info``: the devices.
``blasx tune``: measure the tile sizes and store the best in the perf-db
(``--show`` lists it, ``--clear`` empties it).
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


def _positive_list(text: str) -> list[int]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"got {text!r}, need positive integers separated by commas")
    return [_positive(x) for x in items]


def _dtype_list(text: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in DTYPES]
    if not items or bad:
        raise argparse.ArgumentTypeError(f"got {text!r}, need one or more of {', '.join(sorted(DTYPES))} "
                                         f"separated by commas")
    return items


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
    t = sub.add_parser("tune", help="measure the tile sizes and store the best in the perf-db",
                       description="Time GEMM on host arrays with each candidate tile size, check the results, "
                                   "and store the fastest per device model, device count, dtype and shape class "
                                   "in the perf-db, which later calls read (the paper's Section V-B: the tile "
                                   "size is the only tuning parameter).")
    t.add_argument("--n", type=_positive_list, help="sizes N, comma-separated (M = K = N unless given); "
                                                    "default by backend (cuda 8192,16384)")
    t.add_argument("--m", type=_positive, help="rows of C for every N")
    t.add_argument("--k", type=_positive, help="inner dimension for every N")
    t.add_argument("--dtype", type=_dtype_list, default=["d", "s"], help="dtypes, comma-separated (default d,s)")
    t.add_argument("--devices", help="device spec: cuda, cuda:0,1, sim:4, cpu (default: as blasx gemm)")
    t.add_argument("--tiles", type=_positive_list, help="candidate tiles, comma-separated "
                                                        "(default by backend: cuda 2048,3072,4096,6144,8192)")
    t.add_argument("--cache-bytes", type=_positive, help="tile cache per device in bytes")
    t.add_argument("--cpu", action="store_true", help="add the CPU as a worker beside the GPUs")
    t.add_argument("--runs", type=_positive, default=2, help="timed calls per tile after one warm-up (default 2)")
    t.add_argument("--check-rows", type=int, default=64, help="rows checked against numpy (0: none)")
    t.add_argument("--db", help="perf-db file (default: perfdb.sqlite in $BLASX_CACHE_DIR, "
                                "$XDG_CACHE_HOME/blasx or ~/.cache/blasx, the one blasx calls read)")
    what = t.add_mutually_exclusive_group()
    what.add_argument("--show", action="store_true", help="list the perf-db entries and exit")
    what.add_argument("--clear", action="store_true", help="remove every perf-db entry and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import blasx
    try:
        if args.cmd == "info":
            return _info(blasx)
        if args.cmd == "tune":
            return _tune(blasx, args)
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


def _tune(blasx, args) -> int:
    from .perfdb import PerfDb
    from .tune import tune

    db = PerfDb(args.db)
    if args.show:
        return _show(db)
    if args.clear:
        n = db.clear()
        print(f"perf-db {db.path}: removed {n} entr{'y' if n == 1 else 'ies'}")
        return 0
    if args.check_rows < 0:
        print(f"blasx tune: error: --check-rows: got {args.check_rows}, need an int >= 0", file=sys.stderr)
        return 2
    sizes = None if args.n is None else [(args.m or n, n, args.k or n) for n in args.n]
    if args.m or args.k:
        if sizes is None:
            print("blasx tune: error: --m/--k need --n", file=sys.stderr)
            return 2
    prev = blasx.session.settings()
    blasx.configure(devices=args.devices if args.devices is not None else prev.devices, streams=prev.streams,
                    cache_bytes=args.cache_bytes if args.cache_bytes is not None else prev.cache_bytes,
                    cpu=True if args.cpu else prev.cpu, trace=prev.trace)
    eng = blasx.engine()
    names = ", ".join(d.name for d in eng.devices)
    print(f"blasx tune: {eng.spec} ({names}); perf-db {db.path}")
    rows = tune(sizes=sizes, dtypes=args.dtype, tiles=args.tiles, runs=args.runs, db=db,
                check_rows=args.check_rows, progress=lambda line: print("  " + line, flush=True))
    print(f"{'dtype':<6}{'M x N x K':<22}{'shape class':<22}{'best':>6}  TFLOPS per tile (* best)")
    status = 0
    for r in rows:
        cells = []
        for t in r["tiles"]:
            if t in r["skipped"]:
                cells.append(f"{t}: -")
            elif t in r["tflops"]:
                mark = "*" if t == r["tile"] else ("!" if t in r["bad"] else "")
                cells.append(f"{t}: {r['tflops'][t]:.4g}{mark}")
        best = str(r["tile"]) if r["tile"] is not None else "none"
        mnk, shape = f"{r['m']}x{r['n']}x{r['k']}", "x".join(map(str, r["shape"]))
        print(f"{r['dtype']:<6}{mnk:<22}{shape:<22}{best:>6}  {'  '.join(cells)}")
        if r["tile"] is None or r["bad"] or not r["stored"]:
            status = 1
    if any(r["skipped"] or r["bad"] for r in rows):
        print("(-: tile too big for the tile cache; !: wrong result, not a candidate)")
    stored = sum(r["stored"] for r in rows)
    print(f"stored {stored} of {len(rows)} entr{'y' if len(rows) == 1 else 'ies'} in {db.path}")
    return status


def _show(db) -> int:
    entries = db.entries()
    if not entries:
        print(f"perf-db {db.path}: no entries")
        return 0
    print(f"perf-db {db.path}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
    print(f"{'device':<20}{'gpus':>5}  {'dtype':<6}{'routine':<9}{'shape class':<22}{'tile':>6}"
          f"{'TFLOPS':>11}  {'date':<26}blasx")
    for e in entries:
        shape = "x".join(map(str, e["shape"]))
        best = e["results"].get(e["tile"])
        tf = f"{best:.4g}" if best is not None else "-"
        print(f"{e['device']:<20}{e['ndev']:>5}  {e['dtype']:<6}{e['routine']:<9}{shape:<22}{e['tile']:>6}"
              f"{tf:>11}  {e['date']:<26}{e['version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
