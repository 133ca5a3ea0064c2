"""The cuBLAS tile kernels of a ``cuda`` device (``CudaDevice._kernels``): gemm (GemmEx for mixed
and TF32 calls), the rank-k and symmetric/triangular tile kernels, and the diagonal TRSM tiles'
blocking and inversion (trsm_blocks.py, tri_inverse.py). A mixin: the device state it reads
(handles, streams, scratch) is ``CudaDevice``'s."""

from __future__ import annotations

import numpy as np

from ..tasks import SC_MINUS_ONE, SC_ONE
from ..tri_inverse import Leaf, tri_inverse_ops
from ..trsm_blocks import Solve, stored_block, trsm_tile_ops
from .. import dtypes
from ..dtypes import prefix as blas_prefix
from .base import DeviceError
from .cuda_lowp import device_view, imma_operands, int8_exact
from .cupy_streams import on_stream

MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from unified addressing


def _cublas():
    from cupy_backends.cuda.libs import cublas
    return cublas


def _gemm_ex():
    """cublasGemmEx: CuPy's binding, else the same libcublas through ctypes."""
    from .cublas_ctypes import gemm_ex
    return getattr(_cublas(), "gemmEx", None) or gemm_ex()


class CudaKernels:
    def _k_gemm(self, s, step, call, a, b, c) -> None:
        if call.mixed or call.math == "tf32":
            self._k_gemm_ex(s, step, call, a, b, c)
            return
        alpha, beta = self._ptrs(call, step, False, False)
        self._routine("gemm", call.dtype)(self.handles[s], step.op_a, step.op_b, step.m, step.n, step.k,
                                          alpha, a[0], a[1], b[0], b[1], beta, c[0], c[1])

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
                int8_exact(on_stream(self.streams[s]), step, call, a, b, c)
                return
            m, k, op_a, op_b, ta, tb = imma_operands(lambda nbytes: self._scratch(s, nbytes),
                                                     on_stream(self.streams[s]), step, a, b)
        try:
            fn(self.handles[s], op_a, op_b, m, step.n, k, sc + step.alpha * ssz,
               ta[0], t_in, ta[1], tb[0], t_in, tb[1], sc + step.beta * ssz, c[0], t_acc, c[1], compute,
               dtypes.CUBLAS_GEMM_DEFAULT)
        except Exception as exc:  # noqa: BLE001 - cuBLAS's status, from CuPy's binding or ctypes
            if call.pad_ld != 4 or not ("NOT_SUPPORTED" in str(exc) or str(exc).endswith("cublasStatus_t 15")):
                raise
            self._blas["int8_refused"] = True  # refused before any work: this device takes the exact path from now on
            int8_exact(on_stream(self.streams[s]), step, call, a, b, c)

    # Level-3 tile kernels: the contract is runtime/devices/numpy_kernels.py. cuBLAS's fill mode is LOWER = 0,
    # UPPER = 1, the reverse of Step.uplo (1 = lower); side, diag and op codes agree with BLAS. herk's alpha/beta
    # and her2k's beta are real: their pointers go into the call's real scalar table.
    def _routine(self, name: str, dtype):
        """cuBLAS's ``?name`` for ``dtype`` (``"gemm"``, float64 -> dgemm), cached: CuPy's binding, else
        the same libcublas through ctypes."""
        key = (name, dtype)
        fn = self._blas.get(key)
        if fn is None:
            from .cublas_ctypes import routine
            prefix = blas_prefix(dtype)
            fn = self._blas[key] = getattr(_cublas(), prefix + name, None) or routine(prefix, name)
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
        return tiles if step.k else ((c[0], max(1, step.n)),) * len(tiles)

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

    #: Largest triangle one cuBLAS trsm call solves; bigger diagonal tiles are split recursively
    #: (runtime/trsm_blocks.py) so most of their flops run as GEMMs, faster than a large solve.
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
        invert_triangle(self.handles[s], c[0], c[1], step.m, call.dtype, step.uplo, step.diag, self.INVERSE_LEAF,
                        self._routine, self._scratch(s, step.m * step.m * call.itemsize), self.stream_ptrs[s])

    def _k_invmm(self, s, step, call, a, b, c, out=None) -> None:
        """c = alpha op(V) c (side 0) or alpha c op(V) (side 1), V a diagonal block's inverse, out of
        place (cuBLAS's in-place TRMM is slower): into ``out`` when the worker gives one (a fresh heap
        block), else into the stream's scratch tile, then copied back."""
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
        """c = alpha c + beta b (cuBLAS geam, in place on c); complex with alpha = beta = 1: a plain sum (geam's
        1 * b turns a complex infinity into inf+nanj, numpy_kernels.axpby adds b itself)."""
        if call.dtype.kind == "c" and call.scalars[step.alpha] == 1 and call.scalars[step.beta] == 1:
            with on_stream(self.streams[s]):
                cv = device_view(c[0], step.m, step.n, c[1], call.dtype)
                cv += device_view(b[0], step.m, step.n, b[1], call.dtype)
            return
        alpha, beta = self._ptrs(call, step, False, False)
        self._routine("geam", call.dtype)(self.handles[s], 0, 0, step.m, step.n, alpha, c[0], c[1], beta, b[0], b[1],
                                          c[0], c[1])

    def _k_add(self, s, step, call, a, b, c) -> None:
        """c = alpha a + beta c in the C tile's type (split-k's reduction; numpy_kernels.add): a
        copy for c = a; else cuBLAS geam in place on c, scalars in the call's compute type, which
        is the C tile's; int32 tiles (int8 calls): a CuPy kernel."""
        dt = call.acc_dtype
        if call.scalars[step.beta] == 0 and call.scalars[step.alpha] == 1:  # C = a: a copy, C never read
            from cupy.cuda import runtime
            isz = dt.itemsize
            runtime.memcpy2DAsync(c[0], c[1] * isz, a[0], a[1] * isz, step.m * isz, step.n, MEMCPY_DEFAULT,
                                  self.stream_ptrs[s])
            return
        if dt.kind in "fc":
            sc, ssz = call.scalars.ctypes.data, call.scalars.itemsize
            self._routine("geam", dt)(self.handles[s], 0, 0, step.m, step.n, sc + step.alpha * ssz, a[0], a[1],
                                      sc + step.beta * ssz, c[0], c[1], c[0], c[1])
            return
        with on_stream(self.streams[s]):
            add_tile(a, c, step.m, step.n, dt, call.scalars[step.alpha], call.scalars[step.beta])

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


def invert_triangle(handle, ptr: int, ld: int, size: int, dtype, lower: int, diag: int, leaf: int, routine,
                    scratch: int, stream: int) -> None:
    """Replace the stored triangle of the ``size`` x ``size`` column-major matrix at ``ptr`` (leading
    dimension ``ld``) by its inverse (tri_inverse.py's ops), on ``stream``, ``handle``'s; ``routine(name,
    dtype)`` gives the cuBLAS function; ``scratch``: a device buffer of size^2 elements for this stream
    alone. Leaves are solved against an identity in the scratch block and copied in; products go out of
    place into it and are copied back. Only cuBLAS calls and pitched copies, cheap to issue, so the GPU
    does not wait for the host between them."""
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


_ADD: list = []


def add_tile(a, c, rows: int, cols: int, dtype, alpha, beta) -> None:
    """c = alpha a + beta c (beta 0: c not read) on column-major (pointer, ld) tiles of ``dtype``,
    on the current stream (a CuPy kernel; integer tiles wrap as their type does)."""
    import cupy
    if not _ADD:
        _ADD.append(cupy.ElementwiseKernel("T x, T alpha, T beta", "T y",
                                           "y = beta == (T)0 ? (T)(alpha * x) : (T)(alpha * x + beta * y)",
                                           "blasx_add_tile"))
    t = np.dtype(dtype).type
    _ADD[0](device_view(a[0], rows, cols, a[1], dtype), t(alpha), t(beta), device_view(c[0], rows, cols, c[1], dtype))


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
