"""``cuda``: one NVIDIA GPU through CuPy's low-level runtime and cuBLAS bindings.

Per device: one arena from a single ``cudaMalloc`` carved by the offset heap (no cudaMalloc/cudaFree
in the hot path), ``streams`` non-blocking streams with one cuBLAS handle each, pooled events, and
peer access to every GPU that allows it. Copies are ``cudaMemcpy2DAsync`` (host tiles are pitched
sub-blocks of the page-locked host array) or ``cudaMemcpyPeerAsync``; kernels (``cuda_kernels``) are
cuBLAS calls with host-pointer scalars from the call's scalar table, accumulating in place (beta 1
after the first step: no temporary per k-step).

A *mixed* call (runtime/call.py) runs gemm as ``cublasGemmEx``: half, bfloat16 or int8 A/B, the C
tile in the accumulation type (float32; int32 for int8), compute type 32F or 32I; TF32 math is
float32 gemm with compute type 32F_FAST_TF32. A C tile loaded or written back in another type is
converted in a per-stream scratch block by a CuPy kernel on the copy's stream (float16 overflows
counted per call in device memory); ``cuda_lowp`` holds these conversions and the int8 forms cuBLAS takes.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from ..hostmem import REGISTRY
from ..stats import OpRecord
from .. import faults, hostpool
from .base import DerivedSource, DeviceError, PeerSource, StreamDevice, register_backend
from .cuda_kernels import MEMCPY_DEFAULT, CudaKernels, _cublas
from .cuda_lowp import DeviceCount, convert_tile, device_view, kernels
from .cupy_streams import on_stream

EVENT_DISABLE_TIMING = 2
NOT_READY = 600  # cudaErrorNotReady
RESERVE_BYTES = 2 << 30  # left free for cuBLAS workspaces and the user's own CuPy arrays
DEFAULT_CACHE_FRACTION = 0.5
MIN_CACHE_BYTES = 16 << 20  # below this a device does not start (a few tiles of any useful size)


@register_backend
class CudaDevice(CudaKernels, StreamDevice):
    kind = "cuda"
    reads_device_arrays = True
    binds_thread = True

    def __init__(self, index: int, *, ordinal: int, nstreams: int, cache_bytes: int | None,
                 trace: bool = True) -> None:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(ordinal)
        gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        super().__init__(index, nstreams=nstreams, cache_bytes=cache_bytes or 0, name=f"cuda:{ordinal} {gpu}")
        self.ordinal = ordinal
        self.trace = trace
        self._want_cache = cache_bytes
        self.base = 0
        self.streams = []
        self.stream_ptrs: list[int] = []
        self.handles: list[int] = []
        self._events: list[int] = []
        self._timing_events: list[int] = []
        self._open_records: list = []
        self._peers: set[int] = set()
        self._anchor = (0, 0.0)
        self._kernels = {"gemm": self._k_gemm, "scale": self._k_scale, "axpby": self._k_axpby,
                         "syrk": self._k_rank_k, "herk": self._k_rank_k,
                         "syr2k": self._k_rank_2k, "her2k": self._k_rank_2k,
                         "symm": self._k_symm, "hemm": self._k_symm,
                         "trmm": self._k_trmm, "trsm": self._k_trsm,
                         "invmm": self._k_invmm, "trtri": self._k_trtri, "add": self._k_add}
        self._blas = {}  # cuBLAS functions by (name, dtype), and the int8 path's flag
        self._scratches: dict = {}  # compute stream -> CuPy buffer for out-of-place tile kernels

    # ------------------------------------------------------------ lifecycle
    def open(self) -> None:
        import cupy
        from cupy.cuda import runtime
        cublas = _cublas()
        cupy.cuda.Device(self.ordinal).use()
        self.base = self._alloc_arena(runtime)
        self.streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(self.n_all_streams)]
        self.stream_ptrs = [st.ptr for st in self.streams]
        for st in self.streams[:self.nstreams]:  # cuBLAS runs on the compute streams only
            h = cublas.create()
            cublas.setStream(h, st.ptr)
            self.handles.append(h)
        for peer in range(runtime.getDeviceCount()):
            if peer != self.ordinal and runtime.deviceCanAccessPeer(self.ordinal, peer):
                try:
                    runtime.deviceEnablePeerAccess(peer)
                except runtime.CUDARuntimeError as exc:
                    if "PeerAccessAlreadyEnabled" not in str(exc):
                        continue
                self._peers.add(peer)
        self._reanchor()

    def close(self) -> None:
        from cupy.cuda import runtime
        try:
            for p in self.stream_ptrs:
                runtime.streamSynchronize(p)
        finally:
            self._scratches = {}
            for ev in self._events + self._timing_events + [e for r in self._open_records for e in r[-2:]]:
                with contextlib.suppress(Exception):  # best effort on a broken device
                    runtime.eventDestroy(ev)
            self._events, self._timing_events, self._open_records = [], [], []
            for h in self.handles:
                _cublas().destroy(h)
            self.handles = []
            self.streams, self.stream_ptrs = [], []
            if self.base:
                runtime.free(self.base)
                self.base = 0

    def _alloc_arena(self, runtime) -> int:
        """The tile cache's one allocation, sized from the memory free now (others may hold most of it):
        half of it, leaving a reserve; when it fails (another allocation won the race), CuPy's cached
        blocks are given back and half as much is tried, down to MIN_CACHE_BYTES, then DeviceError."""
        import cupy
        tried, want = [], self._want_cache
        while True:
            free, _total = runtime.memGetInfo()
            cap = max(0, free - min(RESERVE_BYTES, free // 4))
            want = min(want or int(free * DEFAULT_CACHE_FRACTION), cap)
            if want < MIN_CACHE_BYTES:
                raise DeviceError(f"{self.name}: a tile cache needs at least {MIN_CACHE_BYTES} bytes; {free} bytes "
                                  f"of device memory are free (tried {tried or 'nothing'})")
            heap = self._make_heap(want, alignment=512)
            try:
                base = runtime.malloc(heap.capacity)
            except runtime.CUDARuntimeError as exc:
                if "memory" not in str(exc).lower():
                    raise
                tried.append(heap.capacity)
                cupy.get_default_memory_pool().free_all_blocks()
                want = heap.capacity // 2
                continue
            self.cache_bytes = heap.capacity
            return base

    def is_device_error(self, exc: BaseException) -> bool:
        """CUDA and cuBLAS errors break the device, except an out-of-memory and a cuBLAS status
        that rejects the call's arguments (NOT_SUPPORTED, INVALID_VALUE): those fail the call."""
        text = str(exc).lower()
        if isinstance(exc, MemoryError) or "out of memory" in text or "memoryallocation" in text:
            return False
        if type(exc).__name__ == "CUBLASError" and ("not_supported" in text or "invalid_value" in text):
            return False
        return type(exc).__name__ in ("CUDARuntimeError", "CUBLASError", "CUDADriverError")

    def _reanchor(self) -> None:
        from cupy.cuda import runtime
        ev = runtime.eventCreate()
        runtime.eventRecord(ev, self.stream_ptrs[0])
        runtime.eventSynchronize(ev)
        old = self._anchor[0]
        self._anchor = (ev, time.perf_counter())
        if old:
            runtime.eventDestroy(old)

    # ------------------------------------------------------------ topology and memory
    def can_read_from(self, other: StreamDevice) -> bool:
        return isinstance(other, CudaDevice) and other.ordinal in self._peers

    def holds_array(self, operand) -> bool:
        return operand.device == self.ordinal

    def arena_loc(self, offset: int, rows: int, cols: int, dtype, ld: int | None = None):
        return (self.base + offset, rows if ld is None else ld)

    def array_loc(self, operand, ref):
        isz = operand.array.itemsize
        return (operand.ptr + (ref.c0 * operand.ld + ref.r0) * isz, operand.ld)

    def prepare_call(self, call) -> None:
        """Start page-locking the host operands (hostmem.py): the call's tile copies wait only
        for the chunks they touch, so its first tiles move while the rest is registered."""
        import cupy
        faults.at("register", self)
        # Let the work the caller queued on CuPy's current stream of each device holding an operand finish:
        # the engine's streams do not wait for it, and would read an operand not yet written.
        for ordinal in sorted({op.device for op in call.operands if op.device >= 0}):
            with cupy.cuda.Device(ordinal):
                cupy.cuda.get_current_stream().synchronize()
        host = [(slot, op) for slot, op in enumerate(call.operands) if op.on_host]
        if not host:
            return
        where = {slot: i for i, (slot, _) in enumerate(host)}  # an operand's slot -> its index in host

        def late():  # outputs and late C sources: their chunks after the inputs' (worked out only when needed)
            return {where[s] for s in call.written_only() | call.late_inputs() if s in where}
        knobs, readonly, into = self.knobs, (), {}
        if knobs.stage_inputs:
            written = call.written_slots()
            readonly = {i for slot, i in where.items() if slot not in written}
            if knobs.stage_into_result:  # a new result's first contents, copied into it
                into = {where[s]: call.operands[d].array for s, d in call.init_targets().items()
                        if s in where and d in where}
        pinnings, call.pin_job = REGISTRY.pin([op.array for _, op in host], late=late,
                                              threads=knobs.pin_threads or None, readonly=readonly,
                                              buffer=hostpool.stage_buffer, on_demand=knobs.chunks_on_demand,
                                              into=into)
        for (_, op), p in zip(host, pinnings):
            op.pinning = p

    def finish_call(self, call) -> None:
        job = getattr(call, "pin_job", None)
        if job is not None:  # registration never outlives the call that holds the arrays
            if call.failed:  # (cancelled, or failed: its chunks not yet taken are left for a later call)
                job.cancel()
            job.join()
            call.stats.host["pin_seconds"] = job.seconds
            call.stats.host["pinned_bytes"] = job.pinned_bytes
            call.stats.host["staged_bytes"] = job.staged_bytes

    # ------------------------------------------------------------ operations
    def copy_in(self, s, dst, src, rows, cols, dtype, task=None):
        faults.at("load", self, task)
        from cupy.cuda import runtime
        isz = np.dtype(dtype).itemsize
        if type(src) is PeerSource:
            if src.after is not None:  # the peer's fill is in flight: order our copy after it
                runtime.streamWaitEvent(self.stream_ptrs[s], src.after)
            # (a heap tile is compact over its leading dimension, which int8 pads: ld * cols elements)
            runtime.memcpyPeerAsync(dst[0], self.ordinal, src.loc[0], src.device.ordinal, dst[1] * cols * isz,
                                    self.stream_ptrs[s])
            return
        if type(src) is DerivedSource:  # expanded here from its source (runtime/derived.py)
            src.operand.derive.fill(self, s, dst, src.source, src.ref)
            return
        # HostSource or ArraySource: a pitched copy from the operand's own memory
        ptr, ld = self.array_loc(src.operand, src.ref)
        want = np.dtype(dtype) if task is None else task.call.tile_dtype(src.ref.slot)
        if want == np.dtype(dtype):
            self._copy_2d(s, "in", src.operand, dst[0], dst[1] * isz, ptr, ld * isz, rows, cols, isz)
            return
        stage = self._stage(s, rows * cols * isz)  # the tile as it is at home, then converted
        self._copy_2d(s, "in", src.operand, stage, rows * isz, ptr, ld * isz, rows, cols, isz)
        self._convert(s, stage, rows, dtype, dst[0], dst[1], want, rows, cols)

    def copy_out(self, s, operand, ref, src, task=None):
        faults.at("writeback", self, task)
        isz = operand.array.itemsize
        ptr, ld = self.array_loc(operand, ref)
        have = operand.array.dtype if task is None else task.call.wb_dtype
        if have != operand.array.dtype:  # round the accumulated tile to C's type first
            stage = self._stage(s, ref.rows * ref.cols * isz)
            over = None
            if operand.array.dtype == np.float16:  # count overflows where they happen, per device
                over = task.call.overflow_counter(self.index, lambda: self._counter(s)).array
            self._convert(s, src[0], src[1], have, stage, ref.rows, operand.array.dtype, ref.rows, ref.cols, over)
            src = (stage, ref.rows)
        self._copy_2d(s, "out", operand, ptr, ld * isz, src[0], src[1] * isz, ref.rows, ref.cols, isz)

    def _stage(self, s: int, nbytes: int) -> int:
        """A scratch block of stream ``s`` (a copy stream), allocated on that stream."""
        with on_stream(self.streams[s]):
            return self._scratch(s, nbytes)

    def _convert(self, s, src, sld, sdtype, dst, dld, ddtype, rows, cols, over=None) -> None:
        """Convert a column-major tile between element types on stream ``s`` (a CuPy kernel);
        ``over``: a uint64 counter in this device's memory that float16 overflows are added to."""
        with on_stream(self.streams[s]):
            convert_tile(src, sld, sdtype, dst, dld, ddtype, rows, cols, over)

    def _counter(self, s: int) -> DeviceCount:
        """A zeroed overflow counter on this device, zeroed on stream ``s`` (the write-back
        stream, where every conversion that adds to it runs)."""
        import cupy
        with cupy.cuda.Device(self.ordinal), on_stream(self.streams[s]):
            return DeviceCount(cupy.zeros(1, dtype=np.uint64), self.ordinal)

    def dequantize(self, s, loc, rows: int, cols: int, row_scale, col_scale) -> None:
        """The int32 tile at ``loc`` -> float32 ``tile * row_scale[:, None] * col_scale[None, :]``
        in place, on stream ``s`` (the scales: CuPy float32 vectors on this device)."""
        with on_stream(self.streams[s]):
            ints = device_view(loc[0], rows, cols, loc[1], np.int32)
            floats = device_view(loc[0], rows, cols, loc[1], np.float32)
            kernels()["dequantize"](ints, row_scale[:, None], col_scale[None, :], floats)

    def _copy_2d(self, s, direction, operand, dst, dpitch, src, spitch, rows, cols, isz) -> None:
        """One tile copy between the arena and ``operand`` (on the ``host`` side: ``src`` for
        "in", ``dst`` for "out"). A host tile is split where its bytes change registration
        (hostmem.Pinning.pieces): a piece lies in one registered chunk, or in pageable memory,
        never across, which CUDA refuses; it waits for the chunks it reads or writes."""
        from cupy.cuda import runtime
        host, pitch = (src, spitch) if direction == "in" else (dst, dpitch)
        pinning = operand.pinning if operand.on_host else None
        width = rows * isz
        pieces = ((0, cols, 0, width),) if pinning is None else pinning.pieces(host, pitch, width, cols)
        if pinning is not None and pinning.delta:  # a staged input: read from its page-locked copy
            assert direction == "in", "a staged operand is never written"
            src += pinning.delta
        try:
            for c0, n, b0, b1 in pieces:
                runtime.memcpy2DAsync(dst + c0 * dpitch + b0, dpitch, src + c0 * spitch + b0, spitch, b1 - b0, n,
                                      MEMCPY_DEFAULT, self.stream_ptrs[s])
        except runtime.CUDARuntimeError as exc:  # CUDA says only 'invalid argument': add what it saw of the memory
            ld = pitch // isz
            end = host + ((cols - 1) * ld + rows) * isz  # just past the tile's last element
            where = (REGISTRY.describe(host, end) if operand.on_host
                     else f"device {operand.device} bytes [{host:#x}, {end:#x})")
            raise DeviceError(f"{self.name}: tile copy {direction} of {rows}x{cols} elements (ld {ld}, "
                              f"{isz} bytes each) refused: {exc}; {where}") from exc

    def run_step(self, s, step, call, a, b, c, task=None, out=None):
        faults.at("compute", self, task)
        kernel = self._kernels.get(step.kernel)
        if kernel is None:
            raise DeviceError(f"{self.name}: no tile kernel {step.kernel!r}")
        self.streams[s].use()  # CuPy's cuBLAS wrappers bind the handle to the current stream
        if out is None:
            kernel(s, step, call, a, b, c)
        else:
            kernel(s, step, call, a, b, c, out)

    def record(self, s):
        from cupy.cuda import runtime
        ev = self._events.pop() if self._events else runtime.eventCreateWithFlags(EVENT_DISABLE_TIMING)
        runtime.eventRecord(ev, self.stream_ptrs[s])
        return ev

    def release_event(self, ev) -> None:
        self._events.append(ev)

    def wait(self, s, event):
        from cupy.cuda import runtime
        runtime.streamWaitEvent(self.stream_ptrs[s], event)

    def done(self, event) -> bool:
        from cupy.cuda import runtime
        st = runtime.eventQuery(event)
        if st == 0:
            return True
        if st == NOT_READY:
            return False
        raise DeviceError(f"{self.name}: CUDA error {st} ({runtime.getErrorName(st)})")

    def sync(self, event) -> None:
        from cupy.cuda import runtime
        runtime.eventSynchronize(event)

    # ------------------------------------------------------------ tracing
    def _timing_event(self, s: int):
        """A pooled timing event, recorded on stream ``s``."""
        from cupy.cuda import runtime
        ev = self._timing_events.pop() if self._timing_events else runtime.eventCreate()
        runtime.eventRecord(ev, self.stream_ptrs[s])
        return ev

    def begin_op(self, s):
        return self._timing_event(s) if self.trace else None

    def end_op(self, s, handle, kind, nbytes, flops, task):
        if handle is not None:
            end = self._timing_event(s)
            self._open_records.append((task.call.stats, task.tid, kind, s, nbytes, flops, handle, end))

    def take_records(self) -> list:
        if not self._open_records:
            return []
        from cupy.cuda import runtime
        anchor, t0 = self._anchor
        out, keep = [], []
        for rec in self._open_records:
            stats, tid, kind, s, nbytes, flops, start, end = rec
            if runtime.eventQuery(end) != 0:
                keep.append(rec)
                continue
            a = t0 + runtime.eventElapsedTime(anchor, start) / 1e3
            b = t0 + runtime.eventElapsedTime(anchor, end) / 1e3
            out.append((stats, OpRecord(self.index, kind, a, b, stream=s, nbytes=nbytes, flops=flops,
                                        task=tid, name=kind)))
            self._timing_events += (start, end)
        self._open_records = keep
        if not keep and time.perf_counter() - t0 > 30.0:
            self._reanchor()  # float32 milliseconds lose precision far from the anchor
        return out
