"""Host-to-device rate of tile copies as blasx issues them, against one flat copy of the same bytes.

    python -m bench.scripts.h2d_tile_rate [--n 32768] [--tiles 4096,2048] [--reps 5]

Question (issue 4, the start of a level-3 call): the profiles show the host link at 45-47 GB/s
while a call starts, and the 2026-11-22 measurement of a flat pinned copy was 55 GB/s. Is the gap
the 2-D shape of a tile copy (``cudaMemcpy2DAsync`` of a T x T tile out of an N x N column-major
array: T columns of T * itemsize bytes, pitch N * itemsize), or the link itself? Times, with CUDA
events on one stream of GPU 0, from an N x N float64 array page-locked with ``cudaHostRegister``:
one flat copy of T*T*8 bytes, one 2-D tile copy, four tile copies back to back, and the 2-D tile
copy while a D2H tile copy runs on a second stream (both directions at once, as in a call). Best
of ``--reps``; GB/s of the H2D bytes.
"""

from __future__ import annotations

import argparse

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--tiles", default="4096,2048")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    import cupy as cp
    rt = cp.cuda.runtime
    n = args.n
    host = np.empty((n, n), dtype=np.float64, order="F")
    host[:] = 1.0  # touch every page before registering
    rt.hostRegister(host.ctypes.data, host.nbytes, 0)
    try:
        s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
        for t in (int(x) for x in args.tiles.split(",")):
            nbytes = t * t * 8
            dev = cp.empty(4 * t * t, dtype=cp.float64)
            back = cp.empty(t * t, dtype=cp.float64)

            def timed(issue, stream, extra=None):
                best = float("inf")
                for _ in range(args.reps):
                    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                    e0.record(stream)
                    if extra is not None:
                        s2.wait_event(e0)
                        extra()
                    issue()
                    e1.record(stream)
                    e1.synchronize()
                    s2.synchronize()
                    best = min(best, cp.cuda.get_elapsed_time(e0, e1) / 1e3)
                return best

            src = host.ctypes.data
            pitch = n * 8

            def flat():
                rt.memcpyAsync(dev.data.ptr, src, nbytes, rt.memcpyHostToDevice, s1.ptr)

            def tile(i=0, j=0, slot=0):
                off = src + (j * t * n + i * t) * 8
                rt.memcpy2DAsync(dev.data.ptr + slot * nbytes, t * 8, off, pitch, t * 8, t,
                                 rt.memcpyHostToDevice, s1.ptr)

            def four():
                for q in range(4):
                    tile(q, 1, q)

            def d2h():  # a tile back to the host array, as a write-back
                off = src + (3 * t * n + 2 * t) * 8
                rt.memcpy2DAsync(off, pitch, back.data.ptr, t * 8, t * 8, t, rt.memcpyDeviceToHost, s2.ptr)

            rows = [("flat copy", timed(flat, s1), 1), ("2-D tile", timed(tile, s1), 1),
                    ("4 tiles in a row", timed(four, s1), 4), ("2-D tile + D2H tile", timed(tile, s1, d2h), 1)]
            print(f"T = {t} ({nbytes / 2**20:.0f} MiB per tile), N = {n}, pitch {pitch} B")
            for name, sec, k in rows:
                print(f"  {name:22s} {sec * 1e3:8.3f} ms  {k * nbytes / sec / 1e9:6.1f} GB/s")
            del dev, back
    finally:
        rt.hostUnregister(host.ctypes.data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
