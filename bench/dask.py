"""blasx.dask against dask.array's own matmul and against blasx in one process, on one cluster shape.

    python -m bench.dask --n 8192 --block 1024 --devices cpu --workers 2          # CPU cluster
    python -m bench.dask --n 32768 --block 8192 --devices cuda --workers 1 --gpu-chunks   # one worker, both GPUs
    python -m bench.dask --n 32768 --block 8192 --devices cuda --workers 2 --layout per-gpu --gpu-chunks
    python -m bench.dask --zarr /scratch/bx --ram-factor 2 --devices cuda --workers 1  # beyond host memory
    python -m bench.dask --zarr /tmp/bx --ram-factor 2 --memory-limit 16GB ...      # beyond the workers' limits

Each contender runs on a fresh LocalCluster (so each worker's memory is its own): the operands are
made on the workers and persisted first, then the product is persisted and timed; a sampler
thread in each worker records its resident memory every few ms, and the peak above the level
before the call is reported, the highest of the runs (each run starts once the workers have let
the last run's product go; the time is the fastest run's). Every result is checked on random rows
against numpy. ``--zarr`` writes operands of ``--ram-factor`` times this node's memory into zarr
arrays and times ``to_zarr(blasx.dask.matmul(from_zarr(a), from_zarr(b)))`` (``--memory-limit``: per worker, and
then the operands are ``--ram-factor`` times the workers' limits together).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import socket
import sys
import threading
import time

import numpy as np

CHECK_ROWS = 32


# ---------------------------------------------------------------- worker-side memory sampler

CONTENDERS = ("blasx.dask", "dask.array", "blasx (one process)")


def _sample_start(dask_worker, interval: float = 0.003) -> int:
    """Sample this worker's resident memory (and CuPy's pool, when CuPy is loaded) every few ms.
    (The state is kept on the worker object: this module may be pickled by value, globals too.)"""
    import psutil
    proc = psutil.Process()
    cp = sys.modules.get("cupy")
    pool = cp.get_default_memory_pool() if cp is not None else None
    rss = proc.memory_info().rss
    dev = pool.used_bytes() if pool is not None else 0
    state = {"peak": rss, "base": rss, "dev_peak": dev, "dev_base": dev, "stop": False}

    def loop():
        while not state["stop"]:
            state["peak"] = max(state["peak"], proc.memory_info().rss)
            if pool is not None:
                state["dev_peak"] = max(state["dev_peak"], pool.used_bytes())
            time.sleep(interval)

    state["thread"] = threading.Thread(target=loop, daemon=True)
    state["thread"].start()
    dask_worker._blasx_bench_sampler = state
    return rss


def _sample_stop(dask_worker) -> dict:
    state = dask_worker._blasx_bench_sampler
    state["stop"] = True
    state["thread"].join()
    return {k: state[k] for k in ("base", "peak", "dev_base", "dev_peak")}


# ---------------------------------------------------------------- one contender

def _cluster(args, memory_limit=None):
    import dask
    from distributed import Client, LocalCluster
    settings = {"distributed.worker.memory.spill": False, "distributed.worker.memory.target": False}
    with dask.config.set(settings):
        if args.layout == "per-gpu":
            cluster = _per_gpu_cluster(args, memory_limit)
        else:
            cluster = LocalCluster(n_workers=args.workers, threads_per_worker=args.threads, processes=True,
                                   dashboard_address=None, memory_limit=memory_limit or "auto")
    client = Client(cluster)
    import blasx.dask as bd
    bd.configure(client, devices=args.devices, **_engine_settings(args))
    client.run(lambda: __import__("blasx").engine() and None)  # device start-up out of the timing
    return cluster, client


def _engine_settings(args) -> dict:
    from dask.utils import parse_bytes
    return {"cache_bytes": parse_bytes(args.cache_bytes)} if args.cache_bytes else {}


def _per_gpu_cluster(args, memory_limit):
    """One worker per GPU, each seeing only its own (dask-cuda's LocalCUDACluster when installed,
    else the same made from a SpecCluster with CUDA_VISIBLE_DEVICES per worker)."""
    try:
        from dask_cuda import LocalCUDACluster
        return LocalCUDACluster(n_workers=args.workers, threads_per_worker=args.threads, dashboard_address=None,
                                memory_limit=memory_limit or "auto")
    except ImportError:
        from distributed import Nanny, Scheduler, SpecCluster
        workers = {i: {"cls": Nanny, "options": {"nthreads": args.threads, "env": {"CUDA_VISIBLE_DEVICES": str(i)},
                                                 "memory_limit": memory_limit or "auto"}}
                   for i in range(args.workers)}
        return SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {"dashboard_address": None}})


def _operands(args, xp_chunks: bool):
    import dask.array as da
    n, blk = args.n, args.block
    a = da.random.default_rng(1).random((n, n), chunks=blk)
    b = da.random.default_rng(2).random((n, n), chunks=blk)
    if xp_chunks:
        import cupy
        a, b = a.map_blocks(cupy.asarray), b.map_blocks(cupy.asarray)
    return a, b


def _host(x) -> np.ndarray:
    return np.asarray(getattr(x, "get", lambda: x)())


def check_rows(n: int) -> np.ndarray:
    """The rows of C every run checks: the first, the last and random ones (every block row is likely hit)."""
    from .level3_check import sample_rows
    return sample_rows(n, min(CHECK_ROWS, n), 0)


def reference_rows(a, b, rows) -> np.ndarray:
    """``a[rows] @ b`` by numpy on the client, b gathered in column slabs of at most 256 MiB: a reference that
    neither contender computes (dask.array's matmul checked against itself would pass its own fault)."""
    ar = _host(a[rows].compute())
    n, width = b.shape[1], max(1, (256 << 20) // max(1, b.shape[0] * b.dtype.itemsize))
    return np.concatenate([ar @ _host(b[:, lo:lo + width].compute()) for lo in range(0, n, width)], axis=1)


def _check(c, rows, ref) -> float:
    """The relative error of rows ``rows`` of c (computed again where c was not kept) against ``ref``."""
    return float(np.linalg.norm(_host(c[rows].compute()) - ref) / np.linalg.norm(ref))


def _sync_devices() -> None:
    """Wait for every GPU this process sees (CuPy launches return before their kernels finish: a persisted
    CuPy-chunked product is done only when its GPUs are)."""
    if "cupy" in sys.modules:
        import cupy
        for d in range(cupy.cuda.runtime.getDeviceCount()):
            with cupy.cuda.Device(d):
                cupy.cuda.runtime.deviceSynchronize()


def _forget(client, keys, timeout: float = 60.0) -> None:
    """Wait until no worker holds any of ``keys`` (a result let go) and collect garbage there, so the next
    run's memory base holds no earlier result that would be freed during that run (and offset its peak)."""
    import gc
    want = {str(k) for k in keys}
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        if not any(str(k) in want for held in client.has_what().values() for k in held):
            break
        time.sleep(0.05)
    client.run(gc.collect)


def run_cluster(args, method: str) -> dict:
    import dask
    import dask.array as da
    from dask.core import flatten
    from distributed import wait
    import blasx.dask as bd
    cluster, client = _cluster(args, memory_limit=args.memory_limit)
    try:
        a, b = _operands(args, args.gpu_chunks)
        a, b = a.persist(), b.persist()
        wait([a, b])
        rows = check_rows(args.n)
        ref_rows = reference_rows(a, b, rows)
        if args.sink == "sum":  # random weights: a misplaced or transposed block of C changes u^T C v
            u, v = _weights(args, a.chunks[0], 5), _weights(args, b.chunks[1], 6)
            ref = float(np.dot(*(_host(x) for x in dask.compute(da.dot(u, a), da.dot(b, v)))))
        best = None
        for _ in range(args.runs):
            client.run(_sample_start)
            t = time.perf_counter()
            with dask.config.set({"blasx.dask.group": args.group,
                                  **({"blasx.dask.task-bytes": args.task_bytes} if args.task_bytes else {})}):
                c = bd.matmul(a, b) if method == "blasx" else da.matmul(a, b)
            if args.sink == "sum":  # C streams into u^T C v: no block is kept
                total = float(_host(da.dot(u, da.dot(c, v)).compute()))
            else:
                c = c.persist()
                wait(c)
            client.run(_sync_devices)
            dt = time.perf_counter() - t
            mem = client.run(_sample_stop)
            err = _check(c, rows, ref_rows)  # (a summed C: those rows computed again)
            if args.sink == "sum":  # and u^T (A B) v = (u^T A)(B v)
                err = max(err, abs(total - ref) / abs(ref))
            peak = max(m["peak"] - m["base"] for m in mem.values())
            dev = max(m["dev_peak"] - m["dev_base"] for m in mem.values())
            keys = list(flatten(c.__dask_keys__()))
            del c
            _forget(client, keys)
            run = {"seconds": dt, "gflops": 2 * args.n ** 3 / dt / 1e9, "peak_worker_bytes": peak,
                   "peak_worker_gpu_pool_bytes": dev, "rel_err": err}
            if best is not None:  # the fastest run's time; the highest peaks and the worst error of all runs
                run = {**(run if dt < best["seconds"] else best),
                       **{k: max(run[k], best[k]) for k in ("peak_worker_bytes", "peak_worker_gpu_pool_bytes",
                                                            "rel_err")}}
            best = run
        return best
    finally:
        client.close()
        cluster.close()


def _weights(args, chunks, seed: int):
    """A persisted random vector of N, chunked as ``chunks``, of the operands' chunk type."""
    import dask.array as da
    w = da.random.default_rng(seed).random(args.n, chunks=(chunks,))
    if args.gpu_chunks:
        import cupy
        w = w.map_blocks(cupy.asarray, dtype=w.dtype)
    return w.persist()


def run_single(args) -> dict:
    """blasx in this process on the same node: the whole product as one blasx call."""
    import blasx
    blasx.configure(devices=args.devices.replace("{name}", "0") if "{" in args.devices else args.devices,
                    **_engine_settings(args))
    rng = np.random.default_rng(1)
    a, b = rng.random((args.n, args.n)), rng.random((args.n, args.n))
    if args.gpu_chunks:
        import cupy
        a, b = cupy.asarray(a), cupy.asarray(b)
    blasx.matmul(a[:256], b[:, :256])
    _sync_devices()
    best = None
    for _ in range(args.runs):
        t = time.perf_counter()
        c = blasx.matmul(a, b)
        _sync_devices()
        dt = time.perf_counter() - t
        rows = check_rows(args.n)
        ref = np.asarray(a[rows].get() if args.gpu_chunks else a[rows]) @ (b.get() if args.gpu_chunks else b)
        got = c[rows].get() if args.gpu_chunks else c[rows]
        err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        del c, got  # the result's buffer back to the pool before the next run, as a worker lets its result go
        run = {"seconds": dt, "gflops": 2 * args.n ** 3 / dt / 1e9, "peak_worker_bytes": None,
               "peak_worker_gpu_pool_bytes": None, "rel_err": err}
        if best is not None:  # the fastest run's time, the worst error of all runs
            run = {**(run if dt < best["seconds"] else best), "rel_err": max(run["rel_err"], best["rel_err"])}
        best = run
    blasx.shutdown()
    return best


def run_zarr(args) -> dict:
    """A GEMM on zarr operands of ``ram_factor`` times this node's memory, written to zarr."""
    import dask.array as da
    import psutil
    import zarr
    from dask.utils import parse_bytes

    import blasx.dask as bd
    ram = (psutil.virtual_memory().total if args.memory_limit == "auto"
           else parse_bytes(args.memory_limit) * args.workers)  # the node's, or the workers' memory
    n = args.zarr_n or int((args.ram_factor * ram / 2 / 8) ** 0.5) // args.block * args.block
    blk = args.block
    paths = {x: os.path.join(args.zarr, f"{x}.zarr") for x in "abc"}
    for i, x in enumerate("ab"):
        if not os.path.exists(paths[x]):
            z = zarr.create_array(store=paths[x], shape=(n, n), chunks=(blk, blk), dtype="f8")
            src = da.random.default_rng(i + 1).random((n, n), chunks=blk)
            cluster, client = _cluster(args)
            try:
                src.to_zarr(z)
            finally:
                client.close()
                cluster.close()
    t = time.perf_counter()
    za = zarr.open_array(paths["a"])
    for i in range(0, n, blk):  # the storage's own read rate (decompression included), one reader
        za[i:i + blk]
    disk = 8 * n * n / (time.perf_counter() - t) / 1e9
    cluster, client = _cluster(args, memory_limit=args.memory_limit)
    try:
        a, b = da.from_zarr(paths["a"]), da.from_zarr(paths["b"])
        client.run(_sample_start)
        t = time.perf_counter()
        bd.matmul(a, b).to_zarr(paths["c"], overwrite=True)
        dt = time.perf_counter() - t
        mem = client.run(_sample_stop)
        rows = np.sort(np.random.default_rng(0).choice(n, size=8, replace=False))
        za, zb, zc = (zarr.open_array(paths[x]) for x in "abc")
        ref = np.zeros((len(rows), n))
        for k in range(0, n, blk):  # b a slab at a time: the operands may not fit in memory
            ref += za.oindex[rows, k:k + blk] @ zb[k:k + blk, :]
        err = float(np.linalg.norm(zc.oindex[rows, :] - ref) / np.linalg.norm(ref))
        nblk = n // blk
        read = 8 * n * n * nblk * 2  # every C block task reads its A row panel and B column panel
        return {"n": n, "operand_bytes": 2 * 8 * n * n, "ram_bytes": ram, "seconds": dt,
                "gflops": 2 * n ** 3 / dt / 1e9, "read_gbps": read / dt / 1e9, "storage_gbps_one_reader": disk,
                "rel_err": err,
                "peak_worker_bytes": max(m["peak"] - m["base"] for m in mem.values())}
    finally:
        client.close()
        cluster.close()


# ---------------------------------------------------------------- report

def markdown(res: dict) -> str:
    a = res["args"]
    lines = [f"# blasx.dask, {res['host']} {res['date']}", "",
             f"N = {a['n']}, chunks {a['block']}, {a['workers']} worker(s) x {a['threads']} thread(s) "
             f"({a['layout']}), C {'persisted' if a.get('sink', 'persist') == 'persist' else 'reduced to u^T C v'}, "
             f"devices `{a['devices']}`{', CuPy chunks' if a['gpu_chunks'] else ''}; {a['runs']} run(s): "
             "the fastest's time, the highest peaks and the worst error", "",
             "| contender | seconds | GFLOPS | peak worker memory, host (MB above its level before the call) | "
             "peak worker CuPy pool (MB above) | rel. error | check |",
             "| --- | --: | --: | --: | --: | --: | :-- |"]
    for name, r in res["results"].items():
        peak, dev = (("-" if r.get(k) is None else f"{r[k] / 1e6:.0f}")
                     for k in ("peak_worker_bytes", "peak_worker_gpu_pool_bytes"))
        lines.append(f"| {name} | {r['seconds']:.2f} | {r['gflops']:.1f} | {peak} | {dev} | {r['rel_err']:.1e} | "
                     f"{'ok' if r['ok'] else 'WRONG'} |")
    r = res["results"]
    if "blasx.dask" in r and "dask.array" in r:
        d, x = r["dask.array"], r["blasx.dask"]
        mem, where = (("peak_worker_gpu_pool_bytes", "CuPy pool") if a["gpu_chunks"]  # CuPy chunks: device memory
                      else ("peak_worker_bytes", "host"))
        lines += ["", f"blasx.dask vs dask.array: {d['seconds'] / x['seconds']:.2f}x faster, peak memory ({where}) "
                      f"{x[mem] / max(d[mem], 1):.2f} of dask.array's"]
    if "blasx.dask" in r and "blasx (one process)" in r:
        lines.append(f"Dask layer cost vs blasx in one process: "
                     f"{r['blasx.dask']['seconds'] / r['blasx (one process)']['seconds'] - 1:+.1%}")
    if "zarr" in res:
        z = res["zarr"]
        lines += ["", f"zarr: N = {z['n']}, operands {z['operand_bytes'] / 1e9:.1f} GB = "
                      f"{z['operand_bytes'] / z['ram_bytes']:.2f}x the memory (node's, or the workers' limits): "
                      f"{z['seconds']:.1f} s, {z['gflops']:.1f} GFLOPS, "
                      f"reads {z['read_gbps']:.2f} GB/s (the storage gives one reader "
                      f"{z['storage_gbps_one_reader']:.2f} GB/s), "
                      f"peak worker memory {z['peak_worker_bytes'] / 1e6:.0f} MB, "
                      f"rel. error {z['rel_err']:.1e}"]
    return "\n".join(lines) + "\n"


def default_contenders(devices: str, gpu_chunks: bool) -> list[str]:
    """Every contender, but dask.array where GPU workers get host chunks (it computes numpy chunks on the workers'
    CPUs: not the peer of a GPU run, and hours at its sizes)."""
    host_on_gpus = devices.startswith("cuda") and not gpu_chunks
    return [c for c in CONTENDERS if not (host_on_gpus and c == "dask.array")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--block", type=int, default=1024, help="chunk size of the operands")
    p.add_argument("--devices", default="cpu", help='blasx devices of each worker ("cuda:{name}": one GPU each)')
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="threads per worker")
    p.add_argument("--layout", choices=("local", "per-gpu"), default="local",
                   help="per-gpu: one worker per GPU seeing only its own (then --devices cuda)")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--contenders", help="comma list of: " + ", ".join(CONTENDERS) + " (default: all; with GPU "
                   "devices and host chunks not dask.array, which computes numpy chunks on the workers' CPUs)")
    p.add_argument("--gpu-chunks", action="store_true", help="CuPy chunks (GPU workers)")
    p.add_argument("--cache-bytes", help="blasx's tile cache per device, e.g. 24GiB (default: blasx's, half "
                                         "the free GPU memory; leave room for CuPy chunks)")
    p.add_argument("--sink", choices=("persist", "sum"), default="persist",
                   help="persist C on the workers (checked on random rows), or reduce it to u^T C v with random "
                        "u, v (no block kept; checked against (u^T A)(B v), and rows of C computed again)")
    p.add_argument("--zarr", help="a directory: also run the zarr-backed GEMM there")
    p.add_argument("--zarr-n", type=int, help="its N (default: from --ram-factor)")
    p.add_argument("--ram-factor", type=float, default=2.0)
    p.add_argument("--memory-limit", default="auto", help="each worker's memory limit, e.g. 200GB (Dask's auto: "
                   "the node's memory times the worker's share of its cores)")
    p.add_argument("--group", default="auto", help="blasx.dask's output super-block side (dask config "
                   "blasx.dask.group): auto, off or a number of elements (N: one call a worker)")
    p.add_argument("--task-bytes", help="blasx.dask's most dependency bytes a task takes (dask config "
                   "blasx.dask.task-bytes, e.g. 16GiB; default blasx's): a larger output block is a chain of tasks")
    p.add_argument("--out", default=None, help="directory for the JSON and markdown")
    args = p.parse_args(argv)
    if args.contenders is None:
        args.contenders = ",".join(default_contenders(args.devices, args.gpu_chunks))
    names = [s.strip() for s in args.contenders.split(",") if s.strip()]
    if not names or any(n not in CONTENDERS for n in names):
        p.error(f"--contenders: got {args.contenders!r}; allowed: a comma list of {', '.join(CONTENDERS)}")
    if args.group not in ("auto", "off"):
        try:
            args.group = int(args.group)
        except ValueError:
            p.error(f"--group: got {args.group!r}; allowed: auto, off or a number of elements")
    from dask.utils import parse_bytes
    for opt, v in (("--task-bytes", args.task_bytes), ("--memory-limit", args.memory_limit)):
        try:
            if v not in (None, "auto"):
                parse_bytes(v)
        except ValueError:
            p.error(f"{opt}: got {v!r}; allowed: a size such as 4GiB or 500MB")
    import blasx
    from bench.machine import collect_env
    env = collect_env(list(range(blasx.session._cuda_count())))
    res = {"host": socket.gethostname(), "date": _dt.datetime.now().isoformat(timespec="seconds"),
           "command": "python -m bench.dask " + shlex.join(argv if argv is not None else sys.argv[1:]),
           "gpus": [g["name"] for g in env.get("gpus", [])], "env": env, "args": vars(args), "results": {}}
    for name in names:
        print(f"{name} ...", file=sys.stderr, flush=True)
        if name == "blasx (one process)":
            res["results"][name] = run_single(args)
        else:
            res["results"][name] = run_cluster(args, "blasx" if name == "blasx.dask" else "dask")
    if args.zarr:
        res["zarr"] = run_zarr(args)
    tol = 1e-10
    for r in list(res["results"].values()) + ([res["zarr"]] if "zarr" in res else []):
        r["tolerance"], r["ok"] = tol, bool(r["rel_err"] < tol)
    text = markdown(res)
    print(text)
    if args.out:
        kind = args.devices.replace(":", "").replace("{name}", "each") + ("-pergpu" if args.layout == "per-gpu" else "")
        kind += "-cupy" if args.gpu_chunks else ""
        kind += "-sum" if args.sink == "sum" else ""
        kind += f"-g{args.group}" if args.group != "auto" else ""
        kind += f"-tb{args.task_bytes}" if args.task_bytes else ""
        kind += f"-ml{args.memory_limit}" if args.memory_limit != "auto" else ""
        stem = os.path.join(args.out, f"dask-{kind}-w{args.workers}t{args.threads}-n{args.n}-b{args.block}-"
                                      f"{_dt.datetime.now():%Y%m%d-%H%M%S}")  # (a rerun never overwrites)
        os.makedirs(args.out, exist_ok=True)
        with open(stem + ".json", "w") as f:
            json.dump(res, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(text)
    bad = [k for k, r in res["results"].items() if not r["ok"]] + (["zarr"] if "zarr" in res and not res["zarr"]["ok"]
                                                                     else [])
    if bad:
        print(f"WRONG: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
