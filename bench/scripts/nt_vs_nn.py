"""Is SYRK's off-diagonal gemm step (op N x op T) slower than GEMM's (N x N), sustained, and does a
transposed copy of the right tile (one cuBLAS geam) pay for itself?

    python -m bench.scripts.nt_vs_nn [--tile 4096] [--dtypes d,s,z,c] [--rounds 4] [--burst 16]

Profiles of N = 32768 calls on one H200 show SYRK's gemm steps at 50.8 TFLOPS while GEMM's run at
54.5 (both after the GPU clocks down from 59.5 in the first ~150 ms). Here, on one GPU, bursts of
``--burst`` T x T x T products (C += A B) run back to back in each form, the forms alternating for
``--rounds`` rounds so that clock changes hit every form alike:

* ``NN``: op N x op N (GEMM's steps);
* ``NT``: op N x op T (SYRK's off-diagonal steps; C for complex, HERK's);
* ``TN``: op T x op N;
* ``NN+geam/8``: one geam transposing B into a T x T buffer, then ``burst`` NN products with it,
  counting one transpose per 8 products (a cached transposed tile used by ~8 tasks).

Reported per form: the median time per product over the bursts, and TFLOPS.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

DTYPES = {"s": np.float32, "d": np.float64, "c": np.complex64, "z": np.complex128}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tile", type=int, default=4096)
    ap.add_argument("--dtypes", default="d,s,z,c")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--burst", type=int, default=16)
    args = ap.parse_args(argv)
    import cupy

    from blasx.runtime.devices.cuda import cublas_routine

    handle = cupy.cuda.device.get_cublas_handle()
    t = args.tile
    for code in args.dtypes.split(","):
        dt = np.dtype(DTYPES[code])
        cplx = dt.kind == "c"
        opt = 2 if cplx else 1
        gemm = cublas_routine("gemm", dt)
        rng = np.random.default_rng(0)
        mk = lambda: cupy.asarray((rng.standard_normal((t, t)) + (1j * rng.standard_normal((t, t)) if cplx else 0))  # noqa: E731
                                  .astype(dt), order="F")
        a, b, c, bt = mk(), mk(), mk(), mk()
        one = np.array([1], dtype=dt)
        flops = 2.0 * t ** 3 * (4 if cplx else 1)

        def prod(op_a, op_b, bb):
            gemm(handle, op_a, op_b, t, t, t, one.ctypes.data, a.data.ptr, t, bb.data.ptr, t, one.ctypes.data,
                 c.data.ptr, t)

        def transpose():
            bt[...] = b.T.conj() if cplx else b.T

        forms = {"NN": lambda: prod(0, 0, b), "NT": lambda: prod(0, opt, b), "TN": lambda: prod(opt, 0, b)}
        per = {k: [] for k in list(forms) + ["NN+geam/8", "transpose"]}
        for _ in range(args.rounds):
            for name, fn in forms.items():
                e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                e0.record()
                for _ in range(args.burst):
                    fn()
                e1.record()
                e1.synchronize()
                per[name].append(cupy.cuda.get_elapsed_time(e0, e1) / 1e3 / args.burst)
            e0, e1, e2 = cupy.cuda.Event(), cupy.cuda.Event(), cupy.cuda.Event()
            e0.record()
            transpose()
            e1.record()
            for _ in range(args.burst):
                prod(0, 0, bt)
            e2.record()
            e2.synchronize()
            tr = cupy.cuda.get_elapsed_time(e0, e1) / 1e3
            per["transpose"].append(tr)
            per["NN+geam/8"].append(cupy.cuda.get_elapsed_time(e1, e2) / 1e3 / args.burst + tr / 8)
        base = statistics.median(per["NN"])
        for name, ts in per.items():
            sec = statistics.median(ts)
            rate = "" if name == "transpose" else f"{flops / sec / 1e12:7.1f} TFLOPS ({base / sec:.3f} of NN)"
            print(f"{code} T={t} {name:>10}: {sec * 1e3:8.3f} ms  {rate}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
