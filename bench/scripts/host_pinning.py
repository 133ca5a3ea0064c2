"""How fast can pageable host memory reach a GPU? The costs behind blasx's one-shot pageable path.

    python bench/scripts/host_pinning.py [--gib 2] [--threads 1,2,4,8,16] [--out DIR]

On one host array of ``--gib`` GiB (random, touched) it measures, each best of 3:

* ``cudaHostRegister`` of the whole array from one thread, and in page-aligned chunks from
  T threads at once (each chunk its own registration), and the matching unregisters;
* host copies from the pageable array into a pinned buffer (``np.copyto`` on column blocks,
  which releases the GIL) from T threads at once: the staging rate;
* ``cudaMemcpy`` host-to-device from pageable memory, from pinned memory, and from the
  freshly registered array.

Prints one line per measurement (GB/s = 1e9 bytes/s, s/GiB) and writes them as JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import time

import numpy as np

PAGE = 4096


def best(fn, runs=3):
    t = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def chunks(lo: int, nbytes: int, parts: int) -> list[tuple[int, int]]:
    start, end = -(-lo // PAGE) * PAGE, (lo + nbytes) // PAGE * PAGE
    per = -(-(end - start) // parts)
    step = -(-per // PAGE) * PAGE
    return [(s, min(step, end - s)) for s in range(start, end, step)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import cupy
    from cupy.cuda import runtime

    threads = [int(t) for t in args.threads.split(",")]
    n = int(args.gib * (1 << 30)) // 8
    cols = 4096
    x = np.asfortranarray(np.random.default_rng(0).random((n // cols, cols)))
    nbytes = x.nbytes
    lo = x.ctypes.data
    rows = []

    def note(what, seconds, nb=nbytes):
        row = {"what": what, "seconds": seconds, "GBps": nb / seconds / 1e9, "s_per_gib": seconds / (nb / (1 << 30))}
        rows.append(row)
        print(f"{what:<44} {seconds * 1e3:9.1f} ms  {row['GBps']:7.2f} GB/s  {row['s_per_gib']:.4f} s/GiB", flush=True)

    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        thp = "?"
    print(f"# {platform.node()} cpus={os.cpu_count()} array {nbytes / 2**30:.2f} GiB THP: {thp}", flush=True)

    for t in threads:
        parts = chunks(lo, nbytes, t)
        reg_t, unreg_t = float("inf"), float("inf")
        for _ in range(3):
            with cf.ThreadPoolExecutor(t) as pool:
                t0 = time.perf_counter()
                list(pool.map(lambda p: runtime.hostRegister(p[0], p[1], 1), parts))
                t1 = time.perf_counter()
                list(pool.map(lambda p: runtime.hostUnregister(p[0]), parts))
                t2 = time.perf_counter()
            reg_t, unreg_t = min(reg_t, t1 - t0), min(unreg_t, t2 - t1)
        note(f"hostRegister, {t} thread(s) x {len(parts)} chunk(s)", reg_t)
        note(f"hostUnregister, {t} thread(s)", unreg_t)

    # Fresh arrays, as a one-shot caller has them: the first registration of memory that was
    # never registered, against registering it again (what a best-of-3 measures), whole and in
    # blasx's chunks.
    for label, parts_of in (("whole", lambda lo_, nb: chunks(lo_, nb, 1)),
                            ("256 MiB chunks", lambda lo_, nb: [(s0, n0) for s0, n0 in chunks(lo_, nb, max(1, nb >> 28))])):
        first, again = float("inf"), float("inf")
        for _ in range(2):
            y = np.empty_like(x, order="F")
            np.copyto(y, x)  # touched by its producer
            parts = parts_of(y.ctypes.data, y.nbytes)
            for which in ("first", "again"):
                t0 = time.perf_counter()
                for p0, n0 in parts:
                    runtime.hostRegister(p0, n0, 1)
                t1 = time.perf_counter()
                for p0, _ in parts:
                    runtime.hostUnregister(p0)
                if which == "first":
                    first = min(first, t1 - t0)
                else:
                    again = min(again, t1 - t0)
            del y
        note(f"hostRegister fresh array, {label}, first", first)
        note(f"hostRegister fresh array, {label}, again", again)

    pinned_mem = cupy.cuda.alloc_pinned_memory(nbytes)
    pinned = np.frombuffer(pinned_mem, dtype=x.dtype, count=x.size).reshape(x.shape, order="F")
    for t in threads:
        edges = np.linspace(0, cols, t + 1).astype(int)

        def copy_part(i):
            np.copyto(pinned[:, edges[i]:edges[i + 1]], x[:, edges[i]:edges[i + 1]])

        with cf.ThreadPoolExecutor(t) as pool:
            note(f"memcpy pageable->pinned, {t} thread(s)", best(lambda: list(pool.map(copy_part, range(t)))))
        # a 2-D tile (rows/2 x cols/2) as the engine would stage it
        half = pinned[: x.shape[0] // 2, : cols // 2]
        src = x[: x.shape[0] // 2, : cols // 2]
        e2 = np.linspace(0, cols // 2, t + 1).astype(int)

        def copy_tile(i):
            np.copyto(half[:, e2[i]:e2[i + 1]], src[:, e2[i]:e2[i + 1]])

        with cf.ThreadPoolExecutor(t) as pool:
            note(f"memcpy 2-D tile -> pinned, {t} thread(s)", best(lambda: list(pool.map(copy_tile, range(t)))), src.nbytes)

    dev = cupy.empty(x.shape, x.dtype, order="F")
    chunk = min(nbytes, 256 << 20)
    note("H2D from pageable (256 MiB, sync)", best(lambda: runtime.memcpy(dev.data.ptr, lo, chunk, 1)), chunk)
    note("H2D from pinned (whole, sync)", best(lambda: runtime.memcpy(dev.data.ptr, pinned.ctypes.data, nbytes, 1)))
    parts = chunks(lo, nbytes, 1)
    runtime.hostRegister(parts[0][0], parts[0][1], 1)
    try:
        note("H2D from registered (interior, sync)",
             best(lambda: runtime.memcpy(dev.data.ptr, parts[0][0], parts[0][1], 1)), parts[0][1])
    finally:
        runtime.hostUnregister(parts[0][0])
    if args.out:
        path = os.path.join(args.out, "host-pinning.json")
        with open(path, "w") as f:
            json.dump({"host": platform.node(), "cpus": os.cpu_count(), "gib": nbytes / 2**30, "thp": thp,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
