"""Where the time of a small GEMM call goes, on real GPUs (issue 3: parallel efficiency at small N).

    python -m bench.scripts.small_call_timeline --n 4096,8192 --tiles 2048,4096 --gpus 1,2 --out DIR

A diagnostic, not a benchmark: for each (GPU count, N, tile) it runs one warm-up and three timed
``blasx.gemm`` calls (C := 1.5 A B + 0.5 C on registered, contiguous F-ordered arrays) and, for
the fastest, writes

* the host-side phases of the call (tile choice, operands, planning, backend preparation, engine
  submit until the last task, backend finish), timed by wrapping those functions;
* every device operation of the call (kind, stream, start and end in ms from the call's start,
  MB, name, task), from the profile (``configure(trace=True)``), with the gaps where a device ran
  nothing;
* the Chrome trace (``DIR/timeline-g<G>-n<N>-t<T>.json``).

Each call's result is checked on 32 rows against numpy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import numpy as np


def _timed(phases, name, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            phases.setdefault(name, 0.0)
            phases[name] += time.perf_counter() - t0
    return wrapper


@contextlib.contextmanager
def _phase_timers(phases):
    import blasx.level3 as l3
    from blasx.runtime.devices.cuda import CudaDevice
    from blasx.runtime.engine import Engine
    saved = [(l3, "choose_tile"), (l3, "make_operand"), (Engine, "submit"), (CudaDevice, "prepare_call"),
             (CudaDevice, "finish_call")]
    originals = [(obj, name, getattr(obj, name)) for obj, name in saved]
    try:
        for obj, name, fn in originals:
            setattr(obj, name, _timed(phases, name, fn))
        yield
    finally:
        for obj, name, fn in originals:
            setattr(obj, name, fn)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", default="4096,8192")
    p.add_argument("--tiles", default="2048,4096")
    p.add_argument("--gpus", default="1,2")
    p.add_argument("--out", required=True)
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for the run (default: leave Python's)")
    p.add_argument("--ld-factor", type=int, default=1,
                   help="allocate N x (f N) arrays and use N x N views with leading dimension f N "
                        "(as bench.efficiency does), default 1")
    p.add_argument("--tag", default="", help="suffix of the output file names")
    args = p.parse_args(argv)
    if args.switch_interval is not None:
        import sys
        sys.setswitchinterval(args.switch_interval)
    import blasx
    from bench.cublasxt import registered
    sizes = [int(x) for x in args.n.split(",")]
    tiles = [int(x) for x in args.tiles.split(",")]
    gpus = [int(x) for x in args.gpus.split(",")]
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    lines = []
    for n in sizes:
        f = args.ld_factor
        big = [np.asfortranarray(rng.standard_normal((f * n, n))) for _ in range(3)]
        a, b, c = (x[:n] for x in big)
        rows = np.sort(rng.choice(n, 32, replace=False))
        with registered(*big):
            for g in gpus:
                for t in tiles:
                    blasx.configure(devices="cuda:" + ",".join(map(str, range(g))), tile=t, trace=True)
                    best = None
                    for k in range(4):
                        before = c[rows].copy()
                        phases: dict = {}
                        with _phase_timers(phases):
                            t0 = time.perf_counter()
                            blasx.gemm(1.5, a, b, 0.5, c, overwrite_c=True)
                            wall = time.perf_counter() - t0
                        want = 1.5 * (a[rows] @ b) + 0.5 * before
                        err = np.linalg.norm(c[rows] - want) / np.linalg.norm(want)
                        if err > 1e-10:
                            raise SystemExit(f"wrong result: g={g} n={n} t={t} err={err:.2e}")
                        if k and (best is None or wall < best[0]):
                            best = (wall, phases, blasx.last_profile())
                    wall, phases, prof = best
                    tag = f"g{g}-n{n}-t{t}{args.tag}"
                    prof.to_chrome_trace(os.path.join(args.out, f"timeline-{tag}.json"))
                    lines.append(f"\n## {tag}: wall {wall * 1e3:.2f} ms, engine window {prof.wall * 1e3:.2f} ms")
                    lines.append("phases (ms): " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in phases.items()))
                    lines.append(prof.report())
                    t0 = prof.start
                    recs = sorted(prof.records, key=lambda r: (r.device, r.start))
                    for d in sorted({r.device for r in recs}):
                        mine = [r for r in recs if r.device == d]
                        lines.append(f"device {d}: {len(mine)} ops")
                        busy_to = t0
                        for r in mine:
                            gap = (r.start - busy_to) * 1e3
                            lines.append(f"  {r.kind:6} s{r.stream:<2} {(r.start - t0) * 1e3:8.3f} {(r.end - t0) * 1e3:8.3f}"
                                         f"  {r.nbytes / 1e6:7.1f} MB  {r.name:14} task {r.task}"
                                         + (f"   <- gap {gap:.3f} ms" if gap > 0.05 else ""))
                            busy_to = max(busy_to, r.end)
                    print("\n".join(lines[-3:]), flush=True)
        blasx.shutdown()
    with open(os.path.join(args.out, f"small_call_timeline{args.tag}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
