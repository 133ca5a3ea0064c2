"""What ``blasx info`` reports: device facts, peer links, quick measurements, perf-db entries.

Facts come at once from a started engine's devices. :func:`measure` (``--measure``, about a second
per device) times pinned copies, peer copies and cuBLAS DGEMM/SGEMM on ``cuda`` with CUDA events
(best of ``GPU_REPS`` after a warm-up), reads the cost model of a ``sim`` and times numpy's GEMM on
the ``cpu``; a failing measurement is reported with its reason. The ``format_*`` functions are pure.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass

import numpy as np

from .runtime import dtypes as blas_types
from .runtime.devices.cupy_streams import on_stream

COPY_BYTES = 256 << 20  # host <-> device and peer copies
GEMM_N = 8192  # cuBLAS GEMM size
GPU_REPS = 3  # timed repetitions after the warm-up (best is kept)
GPU_WARM_S = 0.1  # the warm-up: the operation repeated for at least this long (and at least once)
CPU_GEMM_SIZES = (512, 1024, 2048, 4096)
CPU_GEMM_TARGET_S = 0.1
BANDWIDTH_KINDS = ("H2D", "D2H", "P2P")


@dataclass(frozen=True)
class DeviceFacts:
    """One engine device, as ``blasx info`` shows it."""

    index: int  # worker index in the engine
    name: str  # "cuda:0 NVIDIA H200", "sim:1 (slow=4)", "cpu"
    kind: str  # "cuda" | "sim" | "cpu"
    streams: int
    cache_bytes: int | None = None  # tile-cache heap (stream devices)
    memory_total: int | None = None  # device memory (host memory for the cpu), bytes
    memory_free: int | None = None  # free now (on a GPU: besides blasx's tile cache), bytes


@dataclass(frozen=True)
class Rate:
    """One measured (or modelled) rate of one device: ``what`` is ``"H2D"``, ``"D2H"``, ``"P2P"`` (bytes/s)
    or ``"DGEMM"``, ``"SGEMM"``, ``"GEMM"`` (flop/s); ``value`` None: the measurement failed and ``how``
    says why; ``peer``: for P2P, the worker index of the device read from."""

    device: int
    what: str
    value: float | None
    how: str = ""
    peer: int | None = None


# ---------------------------------------------------------------------------------------------
# facts (instant)

def host_memory() -> tuple[int | None, int | None]:
    """(total, available) host memory in bytes, None where unknown."""
    info = {}
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        info = {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f)
                if k in ("MemTotal", "MemAvailable")}
    total, avail = info.get("MemTotal"), info.get("MemAvailable")
    if total is None:
        with contextlib.suppress(ValueError, OSError, AttributeError):
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return total, avail


def device_facts(devices) -> list[DeviceFacts]:
    """Facts of an engine's devices (``blasx.engine().devices``, opened: the tile cache is known)."""
    out = []
    for d in devices:
        total = free = None
        if d.kind == "cuda":
            try:
                import cupy
                with cupy.cuda.Device(d.ordinal):
                    free, total = map(int, cupy.cuda.runtime.memGetInfo())
            except Exception:  # noqa: BLE001 - a fact we cannot read is shown as unknown
                total = free = None
        elif d.kind == "cpu":
            total, free = host_memory()
        cache = d.cache_capacity() if d.streamed else None
        out.append(DeviceFacts(d.index, d.name, d.kind, d.nstreams, cache, total, free))
    return out


def peer_links(devices) -> list[tuple[int, int]]:
    """Ordered pairs (i, j) of worker indices where device i reads device j's memory directly."""
    devs = [d for d in devices if d.streamed]
    return [(a.index, b.index) for a in devs for b in devs if a is not b and a.can_read_from(b)]


# ---------------------------------------------------------------------------------------------
# measurements

def _failed(device: int, what: str, exc: BaseException, peer: int | None = None) -> Rate:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return Rate(device, what, None, "failed: " + (text if len(text) <= 160 else text[:157] + "..."), peer)


def measure(devices, links=None, *, copy_bytes: int = COPY_BYTES, gemm_n: int = GEMM_N,
            dtypes: tuple[str, ...] = ("d", "s"), reps: int = GPU_REPS) -> list[Rate]:
    """Rates of each device (Device objects of an engine, which may be shut down) and of the peer
    ``links`` (default :func:`peer_links`); a failed measurement is a :class:`Rate` with ``value=None``."""
    devices = list(devices)
    links = peer_links(devices) if links is None else list(links)
    for name, v in (("copy_bytes", copy_bytes), ("gemm_n", gemm_n), ("reps", reps)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: got {v!r}, need a positive int")
    if not dtypes or any(x not in ("s", "d") for x in dtypes):
        raise ValueError(f"dtypes: got {dtypes!r}, need 's' and/or 'd'")
    by_index = {d.index: d for d in devices}
    rates: list[Rate] = []
    for d in devices:
        if d.kind == "sim":
            rates += _sim_rates(d, [j for i, j in links if i == d.index])
        elif d.kind == "cpu":
            rates += _cpu_rates(d.index, dtypes)
        elif d.kind == "cuda":
            peers = [(j, by_index[j].ordinal) for i, j in links if i == d.index and by_index[j].kind == "cuda"]
            rates += _cuda_rates(d.index, d.ordinal, peers, copy_bytes, gemm_n, dtypes, reps)
        else:
            rates.append(Rate(d.index, "GEMM", None, f"not measured: unknown device kind {d.kind!r}"))
    return rates


def _sim_rates(dev, peers: list[int]) -> list[Rate]:
    m = dev.model
    how = "sim model" + (f" (slow={m.slow:g})" if m.slow != 1 else "")
    out = [Rate(dev.index, "H2D", m.h2d / m.slow, how), Rate(dev.index, "D2H", m.d2h / m.slow, how)]
    out += [Rate(dev.index, "P2P", m.p2p / m.slow, how, peer=j) for j in peers]
    out.append(Rate(dev.index, "GEMM", m.rate / m.slow, how))
    return out


def _cpu_gemm_rate(dtype, reps: int = 3) -> tuple[float, int]:
    """(flop/s, n): numpy's n x n GEMM at the first of CPU_GEMM_SIZES whose best of ``reps`` calls
    takes CPU_GEMM_TARGET_S, else at the last."""
    rng = np.random.default_rng(0)
    for n in CPU_GEMM_SIZES:
        a = rng.standard_normal((n, n)).astype(dtype)
        b = rng.standard_normal((n, n)).astype(dtype)
        c = np.empty((n, n), dtype)
        np.matmul(a, b, out=c)  # warm-up (thread pool start)
        best = math.inf
        for _ in range(reps):
            t = time.perf_counter()
            np.matmul(a, b, out=c)
            best = min(best, time.perf_counter() - t)
        if best >= CPU_GEMM_TARGET_S:
            break
    return 2.0 * n ** 3 / max(best, 1e-9), n


def _cpu_rates(index: int, dtypes) -> list[Rate]:
    out = []
    for ch in dtypes:
        what = ch.upper() + "GEMM"
        try:
            rate, n = _cpu_gemm_rate(blas_types.BY_PREFIX[ch].dtype)
            out.append(Rate(index, what, rate, f"numpy (host BLAS), N={n}"))
        except Exception as exc:  # noqa: BLE001 - report, go on
            out.append(_failed(index, what, exc))
    return out


def _best_gpu_seconds(issue, stream, reps: int, warm_s: float | None = None) -> float:
    """Best time of ``issue()`` on ``stream`` by CUDA events, after ``issue()`` repeated for at least
    ``warm_s`` seconds (default ``GPU_WARM_S``; at least once)."""
    import cupy

    warm_s = GPU_WARM_S if warm_s is None else warm_s
    t0 = time.perf_counter()
    while True:
        issue()
        stream.synchronize()
        if time.perf_counter() - t0 >= warm_s:
            break
    best = math.inf
    for _ in range(reps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        issue()
        end.record(stream)
        end.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return best


def _cuda_rates(index: int, ordinal: int, peers: list[tuple[int, int]], nbytes: int, n: int,
                dtypes, reps: int) -> list[Rate]:
    try:
        import cupy
        from cupy.cuda import runtime
    except Exception as exc:  # noqa: BLE001
        return [_failed(index, "H2D", exc)]
    out: list[Rate] = []
    mib = f"{nbytes / (1 << 20):g} MiB"

    def attempt(what: str, fn, *args, peer: int | None = None) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - report, go on
            out.append(_failed(index, what, exc, peer))

    def copy(what: str, dst: int, src: int, kind: int, stream) -> None:
        t = _best_gpu_seconds(lambda: runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr), stream, reps)
        out.append(Rate(index, what, nbytes / t, f"pinned host memory, {mib}"))

    def copies():
        with cupy.cuda.Device(ordinal):
            stream = cupy.cuda.Stream(non_blocking=True)
            host = cupy.cuda.alloc_pinned_memory(nbytes)
            buf = cupy.empty(nbytes, dtype=cupy.uint8)
            attempt("H2D", copy, "H2D", buf.data.ptr, host.ptr, runtime.memcpyHostToDevice, stream)
            attempt("D2H", copy, "D2H", host.ptr, buf.data.ptr, runtime.memcpyDeviceToHost, stream)
            del buf, host

    def peer_copy(j: int, peer_ordinal: int):
        # The reader (this device) copies from the peer's memory, as the engine's L2 reads do.
        with cupy.cuda.Device(peer_ordinal):
            src = cupy.empty(nbytes, dtype=cupy.uint8)
        with cupy.cuda.Device(ordinal):
            try:
                runtime.deviceEnablePeerAccess(peer_ordinal)
            except runtime.CUDARuntimeError as exc:
                if "PeerAccessAlreadyEnabled" not in str(exc):
                    raise
            dst = cupy.empty(nbytes, dtype=cupy.uint8)
            stream = cupy.cuda.Stream(non_blocking=True)
            t = _best_gpu_seconds(lambda: runtime.memcpyPeerAsync(dst.data.ptr, ordinal, src.data.ptr,
                                                                  peer_ordinal, nbytes, stream.ptr), stream, reps)
        out.append(Rate(index, "P2P", nbytes / t, f"from cuda:{peer_ordinal}, {mib}", peer=j))

    def gemm(ch: str):
        dtype = blas_types.BY_PREFIX[ch].dtype
        with cupy.cuda.Device(ordinal):
            stream = cupy.cuda.Stream(non_blocking=True)
            with on_stream(stream):
                a = cupy.random.random((n, n)).astype(dtype)
                b = cupy.random.random((n, n)).astype(dtype)
                c = cupy.empty((n, n), dtype=dtype)
                t = _best_gpu_seconds(lambda: cupy.matmul(a, b, out=c), stream, reps)
            del a, b, c
        out.append(Rate(index, ch.upper() + "GEMM", 2.0 * n ** 3 / t, f"cuBLAS (CuPy matmul), N={n}"))

    attempt("H2D", copies)
    for j, peer_ordinal in peers:
        attempt("P2P", peer_copy, j, peer_ordinal, peer=j)
    for ch in dtypes:
        attempt(ch.upper() + "GEMM", gemm, ch)
    with contextlib.suppress(Exception):  # freeing the pools is a courtesy
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    return out


# ---------------------------------------------------------------------------------------------
# formatting (pure)

def format_bytes(n: int | None) -> str:
    """1.5 * 2**30 -> '1.50 GiB'; None -> '?'."""
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def format_rate(rate: Rate) -> str:
    """'55.2 GB/s', '59.8 TFLOPS', '34.5 GFLOPS' (below 1 TFLOPS), 'failed'."""
    if rate.value is None:
        return "failed"
    if rate.what in BANDWIDTH_KINDS:
        return f"{rate.value / 1e9:.4g} GB/s"
    if rate.value < 1e12:
        return f"{rate.value / 1e9:.4g} GFLOPS"
    return f"{rate.value / 1e12:.4g} TFLOPS"


def format_devices(spec: str, facts: list[DeviceFacts]) -> list[str]:
    lines = [f"devices ({spec}):"]
    for f in facts:
        extra = [f"{f.streams} stream{'s' if f.streams != 1 else ''}"]
        if f.kind == "cuda":
            extra.append(f"memory {format_bytes(f.memory_total)}")
        elif f.kind == "cpu" and f.memory_total is not None:
            extra.append(f"host memory {format_bytes(f.memory_total)}")
        if f.cache_bytes is not None:
            extra.append(f"tile cache {format_bytes(f.cache_bytes)}")
        if f.memory_free is not None:
            extra.append(f"{format_bytes(f.memory_free)} free")
        lines.append(f"  [{f.index}] {f.name} ({f.kind}, {', '.join(extra)})")
    return lines


def format_links(facts: list[DeviceFacts], links: list[tuple[int, int]]) -> list[str]:
    """'peer links: [0] <-> [1]' (both ways), '[0] -> [1]' (one way), or 'none'; nothing for
    fewer than two stream devices."""
    streamed = [f for f in facts if f.kind != "cpu"]
    if len(streamed) < 2:
        return []
    pairs = set(links)
    text = [f"[{i}] <-> [{j}]" if (j, i) in pairs else f"[{i}] -> [{j}]"
            for i, j in sorted(pairs) if i < j or (j, i) not in pairs]
    return ["peer links: " + (", ".join(text) if text else "none (tiles of other devices are read from host memory)")]


def format_rates(facts: list[DeviceFacts], rates: list[Rate]) -> list[str]:
    """Per device, one line per rate: what, value, how it was had."""
    names = {f.index: f.name for f in facts}
    lines = ["rates (blasx info --measure):"]
    for index in sorted({r.device for r in rates}):
        lines.append(f"  [{index}] {names.get(index, '?')}")
        for r in (r for r in rates if r.device == index):
            what = r.what if r.peer is None else f"{r.what} <- [{r.peer}]"
            lines.append(f"      {what:<12}{format_rate(r):>16}   {r.how}")
    if len(lines) == 1:
        lines.append("  (nothing measured)")
    return lines


def format_perfdb(path, entries: list[dict], this_key: tuple[str, int] | None = None,
                  disabled: bool = False) -> list[str]:
    """The perf-db table (as ``blasx tune --show``); ``this_key`` (device model, GPUs): entries
    that calls on these devices would use are marked ``*``."""
    note = " (ignored by the runtime: BLASX_PERFDB is off)" if disabled else ""
    host_only = this_key is not None and tuple(this_key) == ("cpu", 1)
    if host_only:  # (a CPU-only engine makes one host BLAS call a gemm: it reads no entry)
        this_key = None
    if not entries:
        return [f"perf-db {path}: no entries{note}"]
    n = len(entries)
    lines = [f"perf-db {path}: {n} entr{'y' if n == 1 else 'ies'}{note}",
             f"  {'device':<20}{'gpus':>5}  {'dtype':<6}{'routine':<9}{'shape class':<22}{'tile':>6}"
             f"{'TFLOPS':>11}  {'date':<26}blasx"]
    mine = 0
    for e in entries:
        shape = "x".join(map(str, e["shape"]))
        best = e["results"].get(e["tile"])
        tf = f"{best:.4g}" if best is not None else "-"
        mark = "*" if this_key is not None and (e["device"], e["ndev"]) == tuple(this_key) else " "
        mine += mark == "*"
        lines.append(f"{mark} {e['device']:<20}{e['ndev']:>5}  {e['dtype']:<6}{e['routine']:<9}{shape:<22}"
                     f"{e['tile']:>6}{tf:>11}  {e['date']:<26}{e['version']}")
    if this_key is not None:
        lines.append(f"(* {mine} entr{'y' if mine == 1 else 'ies'} for these devices: "
                     f"{this_key[0]}, {this_key[1]} GPU{'s' if this_key[1] != 1 else ''})")
    if host_only:
        lines.append("(the CPU alone: each gemm is one host BLAS call, which reads no entry)")
    return lines
