"""How fast is a diagonal TRSM tile solved on one GPU, directly or through the triangle's inverse?

    python -m bench.scripts.tri_inverse_rate [--n 4096] [--leaves 256,512,1024] [--dtype d]

On one GPU, for an upper triangle of ``--n`` (well conditioned) and as many right-hand sides:
cuBLAS trsm on the tile (what a TRSM diagonal step costs without the inverse), trmm on the tile
(what it costs with one: in place, out of place with and without the copy back, and the copy), the in-place inversion of runtime/devices/cuda.py (``invert_triangle``)
at each leaf size, and a plain trsm against the identity. Median of 5 runs each, timed with CUDA
events; the inverse is checked against numpy.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

DTYPES = {"s": np.float32, "d": np.float64, "c": np.complex64, "z": np.complex128}


def timed(fn, runs: int = 5) -> float:
    """Median seconds of ``runs`` calls of ``fn`` on the current CUDA stream (CUDA events), after
    one untimed call (the first pays compilation and allocation)."""
    import cupy
    ts = []
    for _ in range(runs + 1):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return statistics.median(ts[1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--leaves", default="256,512,1024")
    ap.add_argument("--dtype", default="d", choices=sorted(DTYPES))
    args = ap.parse_args(argv)
    import cupy

    from blasx.runtime.devices.cuda import cublas_routine, invert_triangle

    n, dt = args.n, np.dtype(DTYPES[args.dtype])
    rng = np.random.default_rng(0)
    a_h = np.asfortranarray(np.triu(rng.standard_normal((n, n)) / n) + 2 * np.eye(n)).astype(dt)
    a = cupy.asarray(a_h, order="F")
    b = cupy.asarray(rng.standard_normal((n, n)).astype(dt), order="F")
    handle = cupy.cuda.device.get_cublas_handle()
    one = np.array([1], dtype=dt)
    flops = float(n) ** 3 * (4 if dt.kind == "c" else 1)


    def line(what, seconds, f=flops):
        rate = f"{f / seconds / 1e12:6.1f} TFLOPS (of n^3)" if f else f"{n * n * dt.itemsize / seconds / 1e9:6.0f} GB/s"
        print(f"{what:<40} {seconds * 1e3:8.3f} ms  {rate}", flush=True)

    trsm, trmm = cublas_routine("trsm", dt), cublas_routine("trmm", dt)
    x = b.copy(order="F")
    line("trsm tile (diagonal step, direct)",
         timed(lambda: trsm(handle, 0, 1, 0, 0, n, n, one.ctypes.data, a.data.ptr, n, x.data.ptr, n)))
    line("trmm tile, in place",
         timed(lambda: trmm(handle, 0, 1, 0, 0, n, n, one.ctypes.data, a.data.ptr, n, x.data.ptr, n, x.data.ptr, n)))
    y = cupy.empty_like(x, order="F")
    line("trmm tile, out of place + copy back (with A^-1)",
         timed(lambda: (trmm(handle, 0, 1, 0, 0, n, n, one.ctypes.data, a.data.ptr, n, x.data.ptr, n, y.data.ptr, n),
                        x.__setitem__(Ellipsis, y))))
    line("trmm tile, out of place alone",
         timed(lambda: trmm(handle, 0, 1, 0, 0, n, n, one.ctypes.data, a.data.ptr, n, x.data.ptr, n, y.data.ptr, n)))
    from cupy.cuda import runtime
    stream = cupy.cuda.get_current_stream().ptr
    nbytes = n * dt.itemsize
    line("the copy back alone (memcpy2DAsync, cudaMemcpyDefault, as cuda.py)",
         timed(lambda: runtime.memcpy2DAsync(x.data.ptr, nbytes, y.data.ptr, nbytes, nbytes, n, 4, stream)), f=0.0)
    line("trmm tile, out of place + memcpy2DAsync back (cuda.py's invmm)",
         timed(lambda: (trmm(handle, 0, 1, 0, 0, n, n, one.ctypes.data, a.data.ptr, n, x.data.ptr, n, y.data.ptr, n),
                        runtime.memcpy2DAsync(x.data.ptr, nbytes, y.data.ptr, nbytes, nbytes, n, 4, stream))))
    want = np.linalg.inv(np.triu(a_h).astype(np.complex128))
    for leaf in (int(v) for v in args.leaves.split(",")):
        w = a.copy(order="F")
        scratch = cupy.empty((n, n), dtype=dt, order="F")
        stream = cupy.cuda.get_current_stream().ptr

        def invert(buf):
            invert_triangle(handle, buf.data.ptr, n, n, dt, 0, 0, leaf, cublas_routine, scratch.data.ptr, stream)
        invert(w)
        err = np.linalg.norm(np.triu(cupy.asnumpy(w)) - want) / np.linalg.norm(want)
        line(f"invert_triangle, leaf {leaf} (err {err:.1e})", timed(lambda: invert(a.copy(order="F"))))
    ident = cupy.eye(n, dtype=dt)
    line("trsm against the identity (n^3)",
         timed(lambda: trsm(handle, 0, 1, 0, 0, n, n, one.ctypes.data, a.data.ptr, n, ident.copy().data.ptr, n)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
