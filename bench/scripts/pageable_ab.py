"""One-shot GEMM on pageable host arrays: how the registration beside the call is cut and paced.

    python -m bench.scripts.pageable_ab [--n 16384] [--chunks-mib 256,1024,0] [--switch none,0.0005] [--runs 3]

DGEMM C = 1.5 A B + 0.5 C on touched host arrays over all GPUs. Before every run blasx's
registrations of the arrays are released (untimed), so each run pays its page-locking again, as
a call on arrays blasx has not seen does (``bench.gemm``'s pageable mode does the same). Configs
are interleaved run by run: the registration chunk size (``hostmem.CHUNK_BYTES``; 0 = one
registration per array) and Python's switch interval while calls run (``BLASX_SWITCH_INTERVAL``;
the registering thread needs the GIL between chunks). A last row keeps the registrations (the
arrays' second call: nothing to pin). Prints wall time, TFLOPS, the engine's wall and the
registration seconds of each run, and the best per config.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--chunks-mib", default="256,1024,0")
    ap.add_argument("--switch", default="none,0.0005")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    import blasx
    from blasx.runtime import hostmem

    n = args.n
    rng = np.random.default_rng(0)
    a, b, c0 = (np.asfortranarray(rng.standard_normal((n, n))) for _ in range(3))
    out = np.empty_like(c0, order="F")
    flops = 2.0 * n ** 3
    configs = list(itertools.product([int(x) for x in args.chunks_mib.split(",")], args.switch.split(",")))
    best = {}
    for run in range(args.runs):
        for chunk_mib, switch in configs + [("kept", "none")]:
            if switch == "none":
                os.environ.pop("BLASX_SWITCH_INTERVAL", None)
            else:
                os.environ["BLASX_SWITCH_INTERVAL"] = switch
            blasx.configure()  # the switch interval is read when the engine is built
            blasx.engine()
            if chunk_mib != "kept":
                hostmem.CHUNK_BYTES = (chunk_mib << 20) if chunk_mib else (1 << 62)
                for x in (a, b, out):
                    hostmem.REGISTRY.release(x)
            np.copyto(out, c0)
            t0 = time.perf_counter()
            blasx.gemm(1.5, a, b, beta=0.5, c=out, overwrite_c=True)
            dt = time.perf_counter() - t0
            prof = blasx.last_profile()
            key = (chunk_mib, switch)
            best[key] = min(best.get(key, dt), dt)
            print(f"run {run} chunk {chunk_mib!s:>5} MiB switch {switch:>7}: {dt:.4f} s {flops / dt / 1e12:6.1f} TFLOPS  "
                  f"engine wall {prof.wall:.4f} s  pinning {prof.host.get('pin_seconds', 0):.4f} s "
                  f"({prof.host.get('pinned_bytes', 0) / 2**30:.2f} GiB)", flush=True)
    print("best:")
    for (chunk_mib, switch), dt in best.items():
        print(f"  chunk {chunk_mib!s:>5} MiB switch {switch:>7}: {dt:.4f} s {flops / dt / 1e12:6.1f} TFLOPS")
    blasx.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
