"""How fast can a diagonal tile of SYRK / HERK run on one GPU, and by which cuBLAS call?

    python -m bench.scripts.diag_kernel_rates [--tiles 4096,2048] [--dtypes s,d,c,z]

A SYRK diagonal step is ``C_ii = alpha A_ik A_ik^T + C_ii`` on the lower triangle of a T x T tile
with k = T (what ``plans.plan_syrk`` makes). On one GPU, for each dtype and tile size, with CUDA
events (median of 7 after one warm-up), it times:

* ``gemm``: the off-diagonal step (op N, op T) on a full tile, the rate the diagonal is held to;
* ``syrk`` (``herk`` for c/z): what the diagonal step runs now;
* ``syrkx`` (``herkx``) with B = A: cuBLAS's "product known to be symmetric" variant;
* ``split``: two syrks of T/2 and one gemm of T/2 x T/2 (one level of the recursive split).

Rates are of the flops each computes usefully (the triangle: T^2 k, complex x4), so a call at the
GEMM rate on its useful flops would reach the GEMM figure. Each result is checked against syrk's.
"""

from __future__ import annotations

import argparse

import numpy as np

DTYPES = {"s": np.float32, "d": np.float64, "c": np.complex64, "z": np.complex128}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", default="4096,2048")
    ap.add_argument("--dtypes", default="s,d,c,z")
    args = ap.parse_args(argv)
    import cupy

    from bench.scripts.tri_inverse_rate import timed
    from blasx.runtime.devices.cuda import cublas_routine

    handle = cupy.cuda.device.get_cublas_handle()

    for code in args.dtypes.split(","):
        dt = np.dtype(DTYPES[code])
        cplx = dt.kind == "c"
        rk = "herk" if cplx else "syrk"
        for t in map(int, args.tiles.split(",")):
            k, h = t, t // 2
            rng = np.random.default_rng(0)
            a_h = rng.standard_normal((t, k)) + (1j * rng.standard_normal((t, k)) if cplx else 0)
            a = cupy.asarray(a_h.astype(dt), order="F")
            c0 = cupy.asarray(rng.standard_normal((t, t)).astype(dt), order="F")
            one = np.array([1], dtype=dt)
            rone = np.array([1], dtype=np.float32 if dt in (np.float32, np.complex64) else np.float64)
            alpha_rk = (rone if cplx else one).ctypes.data
            useful = float(t) * t * k * (4 if cplx else 1)
            gemm, syrk = cublas_routine("gemm", dt), cublas_routine(rk, dt)
            syrkx = cublas_routine(rk + "x", dt)
            op2 = 2 if cplx else 1
            ref = c0.copy(order="F")
            syrk(handle, 0, 0, t, k, alpha_rk, a.data.ptr, t, alpha_rk, ref.data.ptr, t)
            cases = {}
            c = c0.copy(order="F")
            isz = dt.itemsize

            def run_gemm():
                gemm(handle, 0, op2, t, t, k, one.ctypes.data, a.data.ptr, t, a.data.ptr, t, one.ctypes.data,
                     c.data.ptr, t)

            def run_syrk():
                syrk(handle, 0, 0, t, k, alpha_rk, a.data.ptr, t, alpha_rk, c.data.ptr, t)

            def run_syrkx():
                syrkx(handle, 0, 0, t, k, one.ctypes.data, a.data.ptr, t, a.data.ptr, t, alpha_rk, c.data.ptr, t)

            def run_split():
                p, q = a.data.ptr, a.data.ptr + h * isz  # rows [0, h) and [h, t) of A
                syrk(handle, 0, 0, h, k, alpha_rk, p, t, alpha_rk, c.data.ptr, t)
                gemm(handle, 0, op2, t - h, h, k, one.ctypes.data, q, t, p, t, one.ctypes.data,
                     c.data.ptr + h * isz, t)
                syrk(handle, 0, 0, t - h, k, alpha_rk, q, t, alpha_rk, c.data.ptr + (h * t + h) * isz, t)

            for name, fn in (("gemm", run_gemm), (rk, run_syrk), (rk + "x", run_syrkx), ("split", run_split)):
                try:
                    sec = timed(fn, runs=7)
                except Exception as e:  # a routine this cuBLAS lacks: say so, go on
                    print(f"{code} T={t:5d} {name:>6}: failed: {e!r}", flush=True)
                    continue
                flops = 2 * useful if name == "gemm" else useful
                cases[name] = sec
                err = ""
                if name != "gemm":
                    c[...] = c0
                    fn()
                    low = cupy.tril(c - ref)
                    err = f"  err {float(cupy.linalg.norm(low) / cupy.linalg.norm(cupy.tril(ref))):.1e}"
                print(f"{code} T={t:5d} {name:>6}: {sec * 1e3:8.3f} ms {flops / sec / 1e12:7.1f} TFLOPS"
                      f" ({cases['gemm'] / 2 / sec:.2f} of the GEMM rate){err}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
