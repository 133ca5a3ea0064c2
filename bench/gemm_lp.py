"""bench.gemm's parts for the reduced types (h, b, i8) and TF32 math (issue 20).

* the in-core contender: one ``cublasGemmEx`` on one GPU (CuPy holds bfloat16 as its uint16
  bits), timed alone ("cupy") and with the copies of A, B (and C) in and C out ("cupy+copies"):
  the best a user has on one GPU (cuBLAS-XT has no half types);
* a row-sampled reference (float64 on the CPU, by column chunks): a full float64 reference of a
  65536^2 half problem would not fit a GPU and takes minutes on a CPU;
* the host-link bound of an out-of-core GEMM on G GPUs from the measured H2D / D2H rates: A and
  B must cross the host links once (and C too when beta != 0), C must come back. Two bounds: from
  idle links, and from links measured while a half-precision GEMM runs on the same GPU (as it does
  in an overlapped out-of-core call; on H100 that costs the H2D copies about a third of their rate).
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from blasx.runtime import dtypes

LINK_BYTES = 512 << 20  # bytes per copy when measuring a link
LINK_REPS = 5


def reduced(dtype: str, math: str) -> bool:
    """This problem needs GemmEx (a reduced type, or float32 under TF32)."""
    return not dtypes.GEMM_BY_PREFIX[dtype].level3 or (dtype == "s" and math == "tf32")


def _device_dtype(dt: np.dtype) -> np.dtype:
    """The type CuPy holds an array of ``dt`` as (bfloat16: its uint16 bits)."""
    bf = dtypes.GEMM_BY_PREFIX.get("b")
    return np.dtype(np.uint16) if bf is not None and dt == bf.dtype else dt


def incore_gemm_ex(p, device: int, math: str) -> tuple[float, float]:
    """(kernel seconds, seconds with the copies) of C = alpha A B + beta C on one GPU with
    cublasGemmEx, A/B in the problem's type, C in its output type, accumulating in the
    compute type; results written to ``p.c_out``."""
    import cupy
    from cupy.cuda import device as cuda_device

    from blasx.runtime.devices.cuda_kernels import _gemm_ex

    row = dtypes.GEMM_BY_PREFIX[p.dtype]
    out = p.c_out.dtype
    with cupy.cuda.Device(device) as dev:
        d_a = cupy.empty(p.a.shape, _device_dtype(p.a.dtype), order="F")
        d_b = cupy.empty(p.b.shape, _device_dtype(p.b.dtype), order="F")
        d_c = cupy.empty(p.c_out.shape, _device_dtype(out), order="F")
        scalars = np.array([p.alpha, p.beta], dtype=row.compute)
        handle = cuda_device.get_cublas_handle()
        stream = cupy.cuda.get_current_stream()
        from cupy_backends.cuda.libs import cublas
        cublas.setStream(handle, stream.ptr)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        dev.synchronize()
        t0 = time.perf_counter()
        d_a.data.copy_from_host(ctypes.c_void_p(p.a.ctypes.data), p.a.nbytes)
        d_b.data.copy_from_host(ctypes.c_void_p(p.b.ctypes.data), p.b.nbytes)
        if p.c_init is not None:  # the poisoned output holds the pristine C
            d_c.data.copy_from_host(ctypes.c_void_p(p.c_out.ctypes.data), p.c_out.nbytes)
        start.record()
        _gemm_ex()(handle, 0, 0, p.m, p.n, p.k, scalars.ctypes.data, d_a.data.ptr, row.cuda_type, p.m,
                   d_b.data.ptr, row.cuda_type, p.k, scalars.ctypes.data + scalars.itemsize, d_c.data.ptr,
                   dtypes.CUDA_TYPE[out], p.m, dtypes.compute_type(row, math), dtypes.CUBLAS_GEMM_DEFAULT)
        end.record()
        end.synchronize()
        d_c.data.copy_to_host(ctypes.c_void_p(p.c_out.ctypes.data), p.c_out.nbytes)
        total = time.perf_counter() - t0
        return cupy.cuda.get_elapsed_time(start, end) / 1e3, total


def sample_reference(a: np.ndarray, b: np.ndarray, rows, alpha, beta, c_init, chunk: int = 4096):
    """float64 ``alpha a[rows] @ b + beta c_init[rows]`` (``rows``: row indices) by column chunks of b, each
    widened on a thread pool (the widening, not the product, is most of the time)."""
    from .level3_check import _parallel
    a64 = a[rows].astype(np.float64)
    ref = np.empty((a64.shape[0], b.shape[1]), dtype=np.float64, order="F")
    wide = np.empty((b.shape[0], min(chunk, b.shape[1])), dtype=np.float64, order="F")
    for j in range(0, b.shape[1], chunk):
        w = wide[:, :min(chunk, b.shape[1] - j)]
        cols = [(c, min(c + 64, w.shape[1])) for c in range(0, w.shape[1], 64)]
        _parallel(lambda c: np.copyto(w[:, c[0]:c[1]], b[:, j + c[0]:j + c[1]], casting="unsafe"), cols)
        np.matmul(a64, w, out=ref[:, j:j + w.shape[1]])
    ref *= float(np.real(alpha))
    if c_init is not None:
        ref += float(np.real(beta)) * c_init[rows].astype(np.float64)
    return ref


def link_rates(gpus) -> dict:
    """Measured host-link rates (bytes/s) per GPU: {"h2d": [...], "d2h": [...]}, from pinned
    memory, best of a few copies; {} without CuPy or GPUs."""
    try:
        import cupy
        from cupy.cuda import runtime
    except Exception:  # noqa: BLE001 - no GPU: no bound
        return {}
    out = {"h2d": [], "d2h": []}
    host = cupy.cuda.alloc_pinned_memory(LINK_BYTES)
    for g in gpus:
        with cupy.cuda.Device(g):
            buf = cupy.empty(LINK_BYTES, dtype=cupy.uint8)
            stream = cupy.cuda.Stream(non_blocking=True)
            for key, dst, src, kind in (("h2d", buf.data.ptr, host.ptr, runtime.memcpyHostToDevice),
                                        ("d2h", host.ptr, buf.data.ptr, runtime.memcpyDeviceToHost)):
                best = float("inf")
                for _ in range(LINK_REPS):
                    start, end = cupy.cuda.Event(), cupy.cuda.Event()
                    start.record(stream)
                    runtime.memcpyAsync(dst, src, LINK_BYTES, kind, stream.ptr)
                    end.record(stream)
                    end.synchronize()
                    best = min(best, cupy.cuda.get_elapsed_time(start, end) / 1e3)
                out[key].append(LINK_BYTES / best)
            del buf
    # both GPUs' H2D copies at once: the host side (memory, PCIe switch) may cap their sum
    out["h2d_together"] = _together(gpus, host)
    out["h2d_busy"] = [_h2d_beside_gemm(g, host) for g in gpus]
    out["duplex_busy"] = [_duplex_beside_gemm(g, host) for g in gpus]
    return out


def _h2d_beside_gemm(gpu: int, host) -> float | None:
    """H2D bytes/s of one GPU while a float16 GEMM runs on it (another stream), best of a few."""
    import cupy
    from cupy.cuda import runtime
    try:
        with cupy.cuda.Device(gpu):
            x = cupy.ones((8192, 8192), dtype=cupy.float16)
            buf = cupy.empty(LINK_BYTES, dtype=cupy.uint8)
            copy, work = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
            best = float("inf")
            for _ in range(LINK_REPS):
                with work:
                    for _ in range(40):  # ~50 ms of kernels: longer than the copy
                        x @ x
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(copy)
                runtime.memcpyAsync(buf.data.ptr, host.ptr, LINK_BYTES, runtime.memcpyHostToDevice, copy.ptr)
                end.record(copy)
                end.synchronize()
                best = min(best, cupy.cuda.get_elapsed_time(start, end) / 1e3)
                work.synchronize()
            return LINK_BYTES / best
    except Exception:  # noqa: BLE001 - no bound from this GPU
        return None


def _duplex_beside_gemm(gpu: int, host) -> tuple | None:
    """(H2D, D2H) bytes/s of one GPU copying both ways at once while a float16 GEMM runs on it:
    an overlapped out-of-core call loads tiles while it writes finished ones back."""
    import cupy
    from cupy.cuda import runtime
    try:
        back = cupy.cuda.alloc_pinned_memory(LINK_BYTES)
        with cupy.cuda.Device(gpu):
            x = cupy.ones((8192, 8192), dtype=cupy.float16)
            bufs = [cupy.empty(LINK_BYTES, dtype=cupy.uint8) for _ in range(2)]
            streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(3)]
            best = (float("inf"), float("inf"))
            for _ in range(LINK_REPS):
                with streams[2]:
                    for _ in range(40):
                        x @ x
                evs = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(2)]
                for (start, end), st, (dst, src, kind) in zip(evs, streams, (
                        (bufs[0].data.ptr, host.ptr, runtime.memcpyHostToDevice),
                        (back.ptr, bufs[1].data.ptr, runtime.memcpyDeviceToHost))):
                    start.record(st)
                    runtime.memcpyAsync(dst, src, LINK_BYTES, kind, st.ptr)
                    end.record(st)
                times = []
                for start, end in evs:
                    end.synchronize()
                    times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
                best = (min(best[0], times[0]), min(best[1], times[1]))
                streams[2].synchronize()
            return LINK_BYTES / best[0], LINK_BYTES / best[1]
    except Exception:  # noqa: BLE001 - no bound from this GPU
        return None


def _together(gpus, host) -> float | None:
    """Aggregate H2D bytes/s with every GPU copying at once (None if it fails)."""
    import cupy
    from cupy.cuda import runtime
    try:
        bufs, streams = [], []
        for g in gpus:
            with cupy.cuda.Device(g):
                bufs.append(cupy.empty(LINK_BYTES, dtype=cupy.uint8))
                streams.append(cupy.cuda.Stream(non_blocking=True))
        best = float("inf")
        for _ in range(LINK_REPS):
            t0 = time.perf_counter()
            for g, buf, st in zip(gpus, bufs, streams):
                with cupy.cuda.Device(g):
                    runtime.memcpyAsync(buf.data.ptr, host.ptr, LINK_BYTES, runtime.memcpyHostToDevice, st.ptr)
            for g, st in zip(gpus, streams):
                with cupy.cuda.Device(g):
                    st.synchronize()
            best = min(best, time.perf_counter() - t0)
        return len(gpus) * LINK_BYTES / best
    except Exception:  # noqa: BLE001
        return None


def link_bound(rates: dict, in_bytes: int, out_bytes: int) -> dict | None:
    """The host-link bound of one call: max(bytes in / aggregate H2D, bytes out / aggregate D2H)
    in seconds, with its parts; None without measured rates."""
    if not rates or not rates.get("h2d"):
        return None
    h2d = sum(rates["h2d"])
    if rates.get("h2d_together"):
        h2d = min(h2d, rates["h2d_together"])
    d2h = sum(rates["d2h"])
    t_in, t_out = in_bytes / h2d, out_bytes / d2h
    bound = {"seconds": max(t_in, t_out), "in_bytes": in_bytes, "out_bytes": out_bytes,
             "h2d_bytes_per_s": h2d, "d2h_bytes_per_s": d2h, "in_seconds": t_in, "out_seconds": t_out}
    busy = rates.get("h2d_busy") or []
    if busy and all(busy):
        bound["h2d_busy_bytes_per_s"] = min(sum(busy), h2d)
        bound["busy_seconds"] = max(in_bytes / bound["h2d_busy_bytes_per_s"], t_out)
    duplex = rates.get("duplex_busy") or []
    if busy and all(busy) and duplex and all(duplex):
        # both directions at once beside a GEMM: together they move at most the sum of those rates
        both = sum(r[0] + r[1] for r in duplex)
        bound["duplex_bytes_per_s"] = both
        bound["duplex_seconds"] = max(bound["busy_seconds"], (in_bytes + out_bytes) / both)
    return bound


def format_bound(case: dict, blasx_best: float | None) -> str:
    b = case.get("link_bound")
    if not b:
        return ""
    ratio = f", blasx best / bound = {blasx_best / b['seconds']:.2f}x" if blasx_best else ""
    line = (f"{case['dtype']} {case['n']}: host-link bound {b['seconds']:.4f} s = max("
            f"{b['in_bytes'] / 2**30:.2f} GiB in / {b['h2d_bytes_per_s'] / 1e9:.1f} GB/s H2D, "
            f"{b['out_bytes'] / 2**30:.2f} GiB out / {b['d2h_bytes_per_s'] / 1e9:.1f} GB/s D2H){ratio}")
    if "busy_seconds" in b:
        busy_ratio = f", blasx best / bound = {blasx_best / b['busy_seconds']:.2f}x" if blasx_best else ""
        line += (f"; with a GEMM running beside the copies {b['busy_seconds']:.4f} s "
                 f"(H2D {b['h2d_busy_bytes_per_s'] / 1e9:.1f} GB/s){busy_ratio}")
    if "duplex_seconds" in b:
        dratio = f", blasx best / bound = {blasx_best / b['duplex_seconds']:.2f}x" if blasx_best else ""
        line += (f"; copying both ways at once beside a GEMM {b['duplex_seconds']:.4f} s "
                 f"({b['duplex_bytes_per_s'] / 1e9:.1f} GB/s in + out){dratio}")
    return line
