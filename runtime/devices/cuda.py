"""``cuda``: one NVIDIA GPU through CuPy's low-level runtime and cuBLAS bindings.

Per device: one arena from a single ``cudaMalloc`` carved by the offset heap
(no cudaMalloc/cudaFree in the hot path), ``streams`` non-blocking streams
with one cuBLAS handle each, pooled events, and peer access to every GPU
that allows it. Copies are ``cudaMemcpy2DAsync`` (host tiles are pitched
sub-blocks of the pinned host array) or ``cudaMemcpyPeerAsync``; kernels are
cuBLAS ``?gemm`` with host-pointer scalars taken from the call's scalar
table, accumulating in place (beta = 1 after the first step): no temporary
is made per k-step.

Reduced precision (a *mixed* call, runtime/call.py): gemm is ``cublasGemmEx`` with half,
bfloat16 or int8 A/B and the C tile in the accumulation type (float32; int32 for int8), compute
type 32F or 32I; TF32 math runs float32 gemm with compute type 32F_FAST_TF32. A C tile that is
loaded or written back in another type is staged in a per-stream scratch block and converted
there by a CuPy kernel on the copy's own stream; one rounded to float16 adds its overflows to a
per-call counter in device memory. int8 tiles go to cuBLAS in the form its int8 kernels take.
The kernels and conversions of these types: ``cuda_lowp``.
"""

from __future__ import annotations

import time

import numpy as np

from ..hostmem import REGISTRY
from ..stats import OpRecord
from ..tasks import SC_MINUS_ONE, SC_ONE
from ..tri_inverse import Leaf, tri_inverse_ops
from ..trsm_blocks import Solve, stored_block, trsm_tile_ops
from .. import dtypes, faults
from ..dtypes import prefix as blas_prefix
from .base import DeviceError, PeerSource, StreamDevice, register_backend
from .cuda_lowp import DeviceCount, convert_tile, device_view, imma_operands, int8_exact, kernels

MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from unified addressing
EVENT_DISABLE_TIMING = 2
STREAM_NON_BLOCKING = 1
NOT_READY = 600  # cudaErrorNotReady
RESERVE_BYTES = 2 << 30  # left free for cuBLAS workspaces and the user's own CuPy arrays
DEFAULT_CACHE_FRACTION = 0.5
MIN_CACHE_BYTES = 16 << 20  # below this a device does not start (a few tiles of any useful size)



def _cublas():
    from cupy_backends.cuda.libs import cublas
    return cublas


def cublas_routine(name: str, dtype):
    """cuBLAS's ``?name`` for ``dtype`` (``"gemm"``, float64 -> dgemm): CuPy's binding, else the
    same libcublas through ctypes."""
    prefix = blas_prefix(dtype)
    fn = getattr(_cublas(), prefix + name, None)
    if fn is None:
        from .cublas_ctypes import routine
        fn = routine(prefix, name)
    return fn


def _gemm_ex():
    """cublasGemmEx: CuPy's binding, else the same libcublas through ctypes."""
    fn = getattr(_cublas(), "gemmEx", None)
    if fn is None:
        from .cublas_ctypes import gemm_ex
        fn = gemm_ex()
    return fn


def _tile_bytes(rows: int, cols: int, ld: int, isz: int) -> int:
    """Bytes from a column-major tile's first element to just past its last (ld in elements)."""
    return ((cols - 1) * ld + rows) * isz


@register_backend
class CudaDevice(StreamDevice):
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
        self._kernels = {}
        self._blas = {}
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
        self._kernels = {"gemm": self._k_gemm, "scale": self._k_scale, "axpby": self._k_axpby,
                         "syrk": self._k_rank_k, "herk": self._k_rank_k,
                         "syr2k": self._k_rank_2k, "her2k": self._k_rank_2k,
                         "symm": self._k_symm, "hemm": self._k_symm,
                         "trmm": self._k_trmm, "trsm": self._k_trsm,
                         "invmm": self._k_invmm, "trtri": self._k_trtri}
        self._blas = {}
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
        cublas = _cublas()
        try:
            for p in self.stream_ptrs:
                runtime.streamSynchronize(p)
        finally:
            self._scratches = {}
            for ev in self._events + self._timing_events + [r[-1] for r in self._open_records] + \
                    [r[-2] for r in self._open_records]:
                try:
                    runtime.eventDestroy(ev)
                except Exception:  # noqa: BLE001 - best effort on a broken device
                    pass
            self._events, self._timing_events, self._open_records = [], [], []
            for h in self.handles:
                cublas.destroy(h)
            self.handles = []
            self.streams, self.stream_ptrs = [], []
            if self.base:
                runtime.free(self.base)
                self.base = 0

    def _alloc_arena(self, runtime) -> int:
        """The tile cache's one allocation, sized from the memory free now (others may hold most
        of it): half of it, leaving a reserve; when the allocation fails (another allocation
        won the race), CuPy's cached blocks are given back and half as much is tried, down to
        MIN_CACHE_BYTES; then DeviceError says what was needed and what was free."""
        import cupy
        tried = []
        want = None
        while True:
            free, _total = runtime.memGetInfo()
            reserve = min(RESERVE_BYTES, free // 4)
            cap = max(0, free - reserve)
            want = min(self._want_cache or int(free * DEFAULT_CACHE_FRACTION), cap) if want is None else min(want, cap)
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
        faults.at("register", self)
        host = [op for op in call.operands if op.on_host]
        if host:
            pinnings, call.pin_job = REGISTRY.pin([op.array for op in host])
            for op, p in zip(host, pinnings):
                op.pinning = p

    def finish_call(self, call) -> None:
        job = getattr(call, "pin_job", None)
        if job is not None:  # registration never outlives the call that holds the arrays
            job.join()
            call.stats.host["pin_seconds"] = job.seconds
            call.stats.host["pinned_bytes"] = job.pinned_bytes

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
        with self.streams[s]:
            return self._scratch(s, nbytes)

    def _convert(self, s, src, sld, sdtype, dst, dld, ddtype, rows, cols, over=None) -> None:
        """Convert a column-major tile between element types on stream ``s`` (a CuPy kernel);
        ``over``: a uint64 counter in this device's memory that float16 overflows are added to."""
        with self.streams[s]:
            convert_tile(src, sld, sdtype, dst, dld, ddtype, rows, cols, over)

    def _counter(self, s: int) -> DeviceCount:
        """A zeroed overflow counter on this device, zeroed on stream ``s`` (the write-back
        stream, where every conversion that adds to it runs)."""
        import cupy
        with cupy.cuda.Device(self.ordinal), self.streams[s]:
            return DeviceCount(cupy.zeros(1, dtype=np.uint64), self.ordinal)

    def dequantize(self, s, loc, rows: int, cols: int, row_scale, col_scale) -> None:
        """The int32 tile at ``loc`` -> float32 ``tile * row_scale[:, None] * col_scale[None, :]``
        in place, on stream ``s`` (the scales: CuPy float32 vectors on this device)."""
        with self.streams[s]:
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
        try:
            for c0, n, b0, b1 in pieces:
                runtime.memcpy2DAsync(dst + c0 * dpitch + b0, dpitch, src + c0 * spitch + b0, spitch, b1 - b0, n,
                                      MEMCPY_DEFAULT, self.stream_ptrs[s])
        except runtime.CUDARuntimeError as exc:
            raise self._copy_error(direction, exc, operand, host, pitch // isz, rows, cols, isz) from exc

    def _copy_error(self, direction, exc, operand, ptr, ld, rows, cols, isz) -> DeviceError:
        """A refused tile copy, with what the driver saw of the memory (CUDA says only 'invalid argument')."""
        span = _tile_bytes(rows, cols, ld, isz)
        where = (REGISTRY.describe(ptr, ptr + span) if operand.on_host
                 else f"device {operand.device} bytes [{ptr:#x}, {ptr + span:#x})")
        return DeviceError(f"{self.name}: tile copy {direction} of {rows}x{cols} elements (ld {ld}, "
                           f"{isz} bytes each) refused: {exc}; {where}")

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

    def _k_gemm(self, s, step, call, a, b, c) -> None:
        if call.mixed or call.math == "tf32":
            self._k_gemm_ex(s, step, call, a, b, c)
            return
        sc, isz = call.scalars.ctypes.data, call.itemsize
        self._routine("gemm", call.dtype)(self.handles[s], step.op_a, step.op_b, step.m, step.n, step.k,
                               sc + step.alpha * isz, a[0], a[1], b[0], b[1],
                               sc + step.beta * isz, c[0], c[1])

    def _k_gemm_ex(self, s, step, call, a, b, c) -> None:
        """cublasGemmEx: A and B in the call's type, C in the accumulation type, alpha and beta
        (host pointers) in the compute type."""
        fn = self._blas.get("gemmEx")
        if fn is None:
            fn = self._blas["gemmEx"] = _gemm_ex()
        sc, ssz = call.scalars.ctypes.data, call.scalars.itemsize
        t_in, t_acc = dtypes.CUDA_TYPE[call.dtype], dtypes.CUDA_TYPE[call.acc_dtype]
        compute = dtypes.compute_type(dtypes.gemm_of(call.dtype), call.math)
        m, k, op_a, op_b, ta, tb = step.m, step.k, step.op_a, step.op_b, a, b
        if call.pad_ld == 4:
            if self._blas.get("int8_refused"):
                self._int8_exact(s, step, call, a, b, c)
                return
            m, k, op_a, op_b, ta, tb = self._imma_operands(s, step, a, b)
        try:
            fn(self.handles[s], op_a, op_b, m, step.n, k, sc + step.alpha * ssz,
               ta[0], t_in, ta[1], tb[0], t_in, tb[1], sc + step.beta * ssz, c[0], t_acc, c[1], compute,
               dtypes.CUBLAS_GEMM_DEFAULT)
        except Exception as exc:  # noqa: BLE001 - cuBLAS's status, from CuPy's binding or ctypes
            if call.pad_ld != 4 or not ("NOT_SUPPORTED" in str(exc) or str(exc).endswith("cublasStatus_t 15")):
                raise
            self._blas["int8_refused"] = True  # refused before any work: this device takes the exact path from now on
            self._int8_exact(s, step, call, a, b, c)

    def _int8_exact(self, s, step, call, a, b, c) -> None:
        int8_exact(self.streams[s], step, call, a, b, c)

    def _imma_operands(self, s, step, a, b):
        return imma_operands(lambda nbytes: self._scratch(s, nbytes), self.streams[s], step, a, b)

    # Level-3 tile kernels: the contract is runtime/devices/numpy_kernels.py. cuBLAS's fill
    # mode is LOWER = 0, UPPER = 1, the reverse of Step.uplo (1 = lower); side, diag and op
    # codes agree with BLAS. herk's alpha/beta and her2k's beta are real: their pointers go
    # into the call's real scalar table.
    def _routine(self, name: str, dtype):
        key = (name, dtype)
        fn = self._blas.get(key)
        if fn is None:
            fn = self._blas[key] = cublas_routine(name, dtype)
        return fn

    @staticmethod
    def _ptrs(call, step, real_alpha: bool, real_beta: bool):
        cplx, real = call.scalars.ctypes.data, call.real_scalars.ctypes.data
        isz, rsz = call.itemsize, call.real_scalars.itemsize
        alpha = real + step.alpha * rsz if real_alpha else cplx + step.alpha * isz
        beta = real + step.beta * rsz if real_beta else cplx + step.beta * isz
        return alpha, beta

    @staticmethod
    def _inputs(step, c, *tiles):
        """(pointer, ld) of each input tile; a step with k == 0 has none (alpha == 0 or an
        empty inner dimension: only C = beta C on the triangle), so pass C's pointer, which
        cuBLAS does not read then, with a valid leading dimension."""
        if step.k == 0:
            dummy = (c[0], max(1, step.n))
            return tuple(dummy for _ in tiles)
        return tiles

    def _k_rank_k(self, s, step, call, a, b, c) -> None:
        herm = step.kernel == "herk"
        alpha, beta = self._ptrs(call, step, herm, herm)
        (a,) = self._inputs(step, c, a)
        self._routine(step.kernel, call.dtype)(self.handles[s], 1 - step.uplo, step.op_a, step.n, step.k,
                                               alpha, a[0], a[1], beta, c[0], c[1])

    def _k_rank_2k(self, s, step, call, a, b, c) -> None:
        alpha, beta = self._ptrs(call, step, False, step.kernel == "her2k")
        a, b = self._inputs(step, c, a, b)
        self._routine(step.kernel, call.dtype)(self.handles[s], 1 - step.uplo, step.op_a, step.n, step.k,
                                               alpha, a[0], a[1], b[0], b[1], beta, c[0], c[1])

    def _k_symm(self, s, step, call, a, b, c) -> None:
        alpha, beta = self._ptrs(call, step, False, False)
        self._routine(step.kernel, call.dtype)(self.handles[s], step.side, 1 - step.uplo, step.m, step.n,
                                               alpha, a[0], a[1], b[0], b[1], beta, c[0], c[1])

    def _k_trmm(self, s, step, call, a, b, c) -> None:
        alpha, _ = self._ptrs(call, step, False, False)
        self._routine("trmm", call.dtype)(self.handles[s], step.side, 1 - step.uplo, step.op_a, step.diag,
                                          step.m, step.n, alpha, a[0], a[1], b[0], b[1], c[0], c[1])

    #: Largest triangle one cuBLAS trsm call solves; bigger diagonal tiles are split
    #: recursively (runtime/trsm_blocks.py) so most of their flops run as GEMMs, which cuBLAS
    #: runs about three times as fast as a large solve.
    TRSM_LEAF = 1024

    def _k_trsm(self, s, step, call, a, b, c) -> None:
        alpha, _ = self._ptrs(call, step, False, False)
        h, uplo = self.handles[s], 1 - step.uplo
        trsm = self._routine("trsm", call.dtype)
        if (step.m if step.side == 0 else step.n) <= self.TRSM_LEAF:
            trsm(h, step.side, uplo, step.op_a, step.diag, step.m, step.n, alpha, a[0], a[1], c[0], c[1])
            return
        gemm = self._routine("gemm", call.dtype)
        isz, sc = call.itemsize, call.scalars.ctypes.data
        one, minus_one = sc + SC_ONE * isz, sc + SC_MINUS_ONE * isz
        (pa, lda), (pc, ldc) = a, c
        for o in trsm_tile_ops(step.m, step.n, step.side, step.uplo, step.op_a, self.TRSM_LEAF):
            scale = alpha if o.first else one
            if type(o) is Solve:
                trsm(h, step.side, uplo, step.op_a, step.diag, o.b_rows, o.b_cols, scale,
                     pa + (o.d0 + o.d0 * lda) * isz, lda, pc + (o.b_r0 + o.b_c0 * ldc) * isz, ldc)
                continue
            r0, c0, _, _ = stored_block(o.a, step.op_a)
            ap = pa + (r0 + c0 * lda) * isz
            xr, xc, xrows, xcols = o.x
            cr, cc, crows, ccols = o.c
            xp, cp = pc + (xr + xc * ldc) * isz, pc + (cr + cc * ldc) * isz
            if step.side == 0:  # C = scale C - op(A) X
                gemm(h, step.op_a, 0, crows, ccols, xrows, minus_one, ap, lda, xp, ldc, scale, cp, ldc)
            else:  # C = scale C - X op(A)
                gemm(h, 0, step.op_a, crows, ccols, xcols, minus_one, xp, ldc, ap, lda, scale, cp, ldc)

    #: Leaves of the recursive triangle inversion (tri_inverse.py).
    INVERSE_LEAF = 512

    def _k_trtri(self, s, step, call, a, b, c) -> None:
        """TRSM's inversion task (plans.plan_trsm with ``inverse``): c's stored triangle -> its inverse."""
        isz = call.itemsize
        invert_triangle(self.handles[s], c[0], c[1], step.m, call.dtype, step.uplo, step.diag, self.INVERSE_LEAF,
                        self._routine, self._scratch(s, step.m * step.m * isz), self.stream_ptrs[s])

    def _k_invmm(self, s, step, call, a, b, c, out=None) -> None:
        """c = alpha op(V) c (side 0) or alpha c op(V) (side 1), V a diagonal block's inverse, out of
        place: into ``out`` when the worker gives one (a fresh heap block), else into the stream's
        scratch tile, then copied back: cuBLAS's in-place TRMM runs at about half the speed of
        its out-of-place form."""
        from cupy.cuda import runtime
        alpha, _ = self._ptrs(call, step, False, False)
        isz = call.itemsize
        dst, ld = out if out is not None else (self._scratch(s, step.m * step.n * isz), step.m)
        self._routine("trmm", call.dtype)(self.handles[s], step.side, 1 - step.uplo, step.op_a, step.diag,
                                          step.m, step.n, alpha, a[0], a[1], c[0], c[1], dst, ld)
        if out is None:
            runtime.memcpy2DAsync(c[0], c[1] * isz, dst, ld * isz, step.m * isz, step.n, MEMCPY_DEFAULT,
                                  self.stream_ptrs[s])

    def _scratch(self, s: int, nbytes: int) -> int:
        """Pointer to a device buffer of at least ``nbytes`` for stream ``s`` alone (stream order
        keeps its uses apart), from CuPy's pool, kept until the device closes."""
        import cupy
        buf = self._scratches.get(s)
        if buf is None or buf.nbytes < nbytes:
            self._scratches.pop(s, None)
            try:
                buf = cupy.empty(nbytes, dtype=np.uint8)  # on stream s (current)
            except cupy.cuda.memory.OutOfMemoryError:
                cupy.get_default_memory_pool().free_all_blocks()  # cached blocks of others, then once more
                try:
                    buf = cupy.empty(nbytes, dtype=np.uint8)
                except cupy.cuda.memory.OutOfMemoryError as exc:
                    free = cupy.cuda.runtime.memGetInfo()[0]
                    raise MemoryError(f"{self.name}: a {nbytes}-byte scratch buffer for a tile kernel does "
                                      f"not fit; {free} bytes of device memory are free") from exc
            self._scratches[s] = buf
        return buf.data.ptr

    def _k_axpby(self, s, step, call, a, b, c) -> None:
        """c = alpha c + beta b (cuBLAS geam, in place on c)."""
        sc, isz = call.scalars.ctypes.data, call.itemsize
        self._routine("geam", call.dtype)(self.handles[s], 0, 0, step.m, step.n, sc + step.alpha * isz, c[0], c[1],
                               sc + step.beta * isz, b[0], b[1], c[0], c[1])

    def _k_scale(self, s, step, call, a, b, c) -> None:
        from cupy.cuda import runtime
        dt = call.acc_dtype  # the C tile's type on the device
        isz = dt.itemsize
        if call.scalars[step.beta] == 0:
            if c[1] == step.m:  # a compact tile: one memset
                runtime.memsetAsync(c[0], 0, step.m * step.n * isz, self.stream_ptrs[s])
                return
            for j in range(step.n):  # columns of the tile (ld may exceed rows for in-place C)
                runtime.memsetAsync(c[0] + j * c[1] * isz, 0, step.m * isz, self.stream_ptrs[s])
            return
        if dt.kind not in "fc":
            raise DeviceError(f"{self.name}: no scale kernel for {dt.name} tiles with beta != 0")
        sc = call.scalars.ctypes.data + step.beta * isz
        for j in range(step.n):
            self._routine("scal", dt)(self.handles[s], step.m, sc, c[0] + j * c[1] * isz, 1)

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
    def _timing_event(self):
        from cupy.cuda import runtime
        return self._timing_events.pop() if self._timing_events else runtime.eventCreate()

    def begin_op(self, s):
        if not self.trace:
            return None
        from cupy.cuda import runtime
        ev = self._timing_event()
        runtime.eventRecord(ev, self.stream_ptrs[s])
        return ev

    def end_op(self, s, handle, kind, nbytes, flops, task):
        if handle is None:
            return
        from cupy.cuda import runtime
        ev = self._timing_event()
        runtime.eventRecord(ev, self.stream_ptrs[s])
        self._open_records.append((task, kind, s, nbytes, flops, handle, ev))

    def take_records(self) -> list:
        if not self._open_records:
            return []
        from cupy.cuda import runtime
        anchor, t0 = self._anchor
        out, keep = [], []
        for rec in self._open_records:
            task, kind, s, nbytes, flops, start, end = rec
            if runtime.eventQuery(end) != 0:
                keep.append(rec)
                continue
            a = t0 + runtime.eventElapsedTime(anchor, start) / 1e3
            b = t0 + runtime.eventElapsedTime(anchor, end) / 1e3
            out.append((task, OpRecord(self.index, kind, a, b, stream=s, nbytes=nbytes, flops=flops,
                                       task=task.tid, name=kind)))
            self._timing_events += (start, end)
        self._open_records = keep
        if not keep and time.perf_counter() - t0 > 30.0:
            self._reanchor()  # float32 milliseconds lose precision far from the anchor
        return out


def invert_triangle(handle, ptr: int, ld: int, size: int, dtype, lower: int, diag: int, leaf: int, routine,
                    scratch: int, stream: int) -> None:
    """Replace the stored triangle of the ``size`` x ``size`` column-major matrix at ``ptr``
    (leading dimension ``ld``) by its inverse (tri_inverse.py's ops), on ``stream``, which must be
    ``handle``'s; ``routine(name, dtype)`` gives the cuBLAS function; ``scratch`` points to a device
    buffer of size^2 elements that only this stream uses. Leaves are solved against an identity in
    the scratch block and copied in; products go out of place into it and are copied back
    (in-place TRMM runs at half speed). Only cuBLAS calls and pitched copies are issued: they are
    cheap to issue, so the GPU does not wait for the host between them."""
    from cupy.cuda import runtime
    dtype = np.dtype(dtype)
    isz = dtype.itemsize
    scalars = np.array([1, -1], dtype=dtype)  # host scalars: read when each call is made
    one, minus_one = scalars.ctypes.data, scalars.ctypes.data + isz
    uplo = 1 - lower
    trsm, trmm = routine("trsm", dtype), routine("trmm", dtype)
    ops = tri_inverse_ops(size, lower, leaf)
    big = max(o.size for o in ops if type(o) is Leaf)
    eye = _identity(big, dtype)  # symmetric, so also F-ordered; its top-left blocks are identities

    def copy(dst, dld, src, sld, rows, cols):
        runtime.memcpy2DAsync(dst, dld * isz, src, sld * isz, rows * isz, cols, MEMCPY_DEFAULT, stream)

    for o in ops:
        if type(o) is Leaf:
            blk = ptr + (o.d0 + o.d0 * ld) * isz
            copy(scratch, size, eye.data.ptr, big, o.size, o.size)
            trsm(handle, 0, uplo, 0, diag, o.size, o.size, one, blk, ld, scratch, size)
            copy(blk, ld, scratch, size, o.size, o.size)
            continue
        r0, c0, rows, cols = o.blk
        bp = ptr + (r0 + c0 * ld) * isz
        trmm(handle, o.side, uplo, 0, diag, rows, cols, minus_one if o.negate else one,
             ptr + (o.a0 + o.a0 * ld) * isz, ld, bp, ld, scratch, size)
        copy(bp, ld, scratch, size, rows, cols)


_IDENTITIES: dict = {}


def _identity(size: int, dtype):
    """A ``size`` x ``size`` identity of ``dtype`` on the current device, made once and never written."""
    import cupy
    key = (cupy.cuda.runtime.getDevice(), size, np.dtype(dtype))
    eye = _IDENTITIES.get(key)
    if eye is None:
        eye = cupy.eye(size, dtype=dtype)
        cupy.cuda.get_current_stream().synchronize()  # filled before another stream reads it
        _IDENTITIES[key] = eye
    return eye
