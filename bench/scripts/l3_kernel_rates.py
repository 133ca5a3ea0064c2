"""Tile-kernel rates inside real level-3 calls on GPUs (issue 4: why TRSM/TRMM trail GEMM).

    python -m bench.scripts.l3_kernel_rates --n 16384 --routines gemm,trsm,trmm --out DIR

A diagnostic: for each routine, one warm-up and one traced call (double precision, upper, left,
no transpose, registered host arrays, default tile), then the device kernels of the traced call
grouped by their flop count (so a 4096 trsm tile, n^3 flops, is told from a gemm tile, 2 n^3),
with count, total time and TFLOPS per group, and the per-device busy / comm / idle breakdown.
Kernels run one at a time per device (``Knobs.chain_kernels``), so a kernel's interval is its own.
"""

from __future__ import annotations

import argparse
import collections
import os

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--routines", default="gemm,trsm,trmm")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import blasx
    from blasx.linalg import blas
    from bench.cublasxt import registered
    n = args.n
    rng = np.random.default_rng(0)
    a = np.asfortranarray(np.triu(rng.standard_normal((n, n))) + n * np.eye(n))
    b = np.asfortranarray(rng.standard_normal((n, n)))
    c = np.asfortranarray(rng.standard_normal((n, n)))
    calls = {"gemm": lambda: blas.dgemm(1.5, a, b, 0.5, c, overwrite_c=1),
             "trsm": lambda: blas.dtrsm(1.5, a, b, overwrite_b=1),
             "trmm": lambda: blas.dtrmm(1.5, a, b, overwrite_b=1)}
    lines = []
    with registered(a, b, c):
        blasx.configure(devices="cuda:" + ",".join(map(str, range(args.gpus))), trace=True)
        for r in args.routines.split(","):
            calls[r]()
            calls[r]()
            prof = blasx.last_profile()
            groups = collections.defaultdict(lambda: [0, 0.0, 0.0])
            for rec in prof.records:
                if rec.kind == "kernel":
                    g = groups[(rec.device, float(f"{rec.flops:.3g}"))]
                    g[0] += 1
                    g[1] += rec.end - rec.start
                    g[2] += rec.flops
            lines.append(f"\n## d{r} N={n}: {prof.wall:.4f} s, {prof.totals()['flops'] / prof.wall / 1e12:.1f} TFLOPS")
            lines.append(prof.report())
            lines.append("kernels by flop count: device, flops per kernel, count, seconds, TFLOPS")
            for (d, f), (cnt, sec, fl) in sorted(groups.items()):
                lines.append(f"  {d} {f:.3g} x{cnt}: {sec:.4f} s  {fl / sec / 1e12 if sec else 0:.1f} TFLOPS")
            print("\n".join(lines[-(len(groups) + 2):]), flush=True)
        blasx.shutdown()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"l3-kernel-rates-n{n}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
