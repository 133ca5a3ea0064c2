"""Reduced-precision tile work on a CUDA device (the ``cuda`` backend's helpers): CuPy views of
device memory, element-type conversions that count float16 overflows, cuBLAS's int8 operand form
and an exact int8 path where cuBLAS refuses one. Every function issues its work on the current
stream (or the one it is given)."""

from __future__ import annotations

import numpy as np

from .. import dtypes


def device_view(ptr: int, rows: int, cols: int, ld: int, dtype):
    """A CuPy column-major view of device memory at ``ptr`` (bfloat16 as its uint16 bits)."""
    import cupy
    dt = np.dtype(dtype)
    bf = dtypes.GEMM_BY_PREFIX.get("b")
    if bf is not None and dt == bf.dtype:
        dt = np.dtype(np.uint16)
    mem = cupy.cuda.UnownedMemory(ptr, max(1, ((cols - 1) * ld + rows) * dt.itemsize), None)
    return cupy.ndarray((rows, cols), dtype=dt, memptr=cupy.cuda.MemoryPointer(mem, 0),
                        strides=(dt.itemsize, ld * dt.itemsize))


_KERNELS: dict = {}


def kernels() -> dict:
    """CuPy elementwise kernels for tile conversions (made once; CuPy compiles them per device)."""
    if not _KERNELS:
        import cupy
        ek = cupy.ElementwiseKernel
        _KERNELS["bf16_to_f32"] = ek("uint16 x", "float32 y", "y = __uint_as_float(((unsigned int)x) << 16)",
                                     "blasx_bf16_to_f32")
        # round to nearest even, as ml_dtypes and cuBLAS do; NaN stays a (quiet) NaN
        _KERNELS["f32_to_bf16"] = ek(
            "float32 x", "uint16 y",
            "unsigned int u = __float_as_uint(x);"
            "y = isnan(x) ? (unsigned short)((u >> 16) | 0x40u)"
            " : (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)", "blasx_f32_to_bf16")
        # an overflow is an inf result from a finite accumulator (inf and NaN in it propagate)
        _KERNELS["f32_to_f16"] = ek(
            "float32 x, raw uint64 over", "float16 y",
            "y = (float16)x; if (isinf((float)y) && isfinite(x)) atomicAdd((unsigned long long*)&over[0], 1ULL)",
            "blasx_f32_to_f16_count")
        _KERNELS["dequantize"] = ek("int32 x, float32 r, float32 c", "float32 y", "y = (float)x * r * c",
                                    "blasx_dequantize")
    return _KERNELS


def convert_tile(src: int, sld: int, sdtype, dst: int, dld: int, ddtype, rows: int, cols: int,
                 over=None) -> None:
    """Convert a rows x cols column-major tile from ``sdtype`` at ``src`` to ``ddtype`` at ``dst``
    on the current stream: half and int types by CuPy's casts, bfloat16 by its bits. ``over``
    (float32 -> float16): a uint64 device counter that the overflows are added to."""
    import cupy
    x = device_view(src, rows, cols, sld, sdtype)
    y = device_view(dst, rows, cols, dld, ddtype)
    bf = dtypes.GEMM_BY_PREFIX.get("b")
    if over is not None and x.dtype == np.float32 and y.dtype == np.float16:
        kernels()["f32_to_f16"](x, over, y)
    elif bf is not None and np.dtype(sdtype) == bf.dtype:
        kernels()["bf16_to_f32"](x, y)
    elif bf is not None and np.dtype(ddtype) == bf.dtype:
        kernels()["f32_to_bf16"](x, y)
    else:
        cupy.copyto(y, x, casting="unsafe")


class DeviceCount:
    """A call's float16 overflow count in one device's memory; ``int()`` reads it (after the call)."""

    def __init__(self, array, ordinal: int) -> None:
        self.array = array
        self.ordinal = ordinal

    def __int__(self) -> int:
        import cupy
        with cupy.cuda.Device(self.ordinal):
            return int(self.array.get()[0])


def int8_exact(stream, step, call, a, b, c) -> None:
    """int8 gemm where cuBLAS's int8 kernels refuse the call: the tiles widened to float64 and
    multiplied by CuPy's matmul (DGEMM), exact while k 2^14 < 2^53, then alpha P + beta C in
    int64 stored to the int32 C tile (wrapping as int32 arithmetic does)."""
    import cupy
    m, n, k = step.m, step.n, step.k
    with stream:
        fa = device_view(a[0], *((m, k) if step.op_a == 0 else (k, m)), a[1], np.int8).astype(np.float64)
        fb = device_view(b[0], *((k, n) if step.op_b == 0 else (n, k)), b[1], np.int8).astype(np.float64)
        prod = cupy.matmul(fa if step.op_a == 0 else fa.T, fb if step.op_b == 0 else fb.T)
        cv = device_view(c[0], m, n, c[1], np.int32)
        res = prod.astype(np.int64) * int(call.scalars[step.alpha])
        beta = int(call.scalars[step.beta])
        if beta != 0:
            res += cv.astype(np.int64) * beta
        cupy.copyto(cv, res.astype(np.int32))

def imma_operands(scratch, stream, step, a, b):
    """int8 operands in the one form cuBLAS runs on its int8 tensor-core kernels (IMMA): "TN", A
    transposed and B not (both k-major), m and k multiples of 4, leading dimensions multiples of 4,
    aligned pointers. Other forms are refused (CUBLAS_STATUS_NOT_SUPPORTED) or run on kernels
    without IMMA. An operand not already in that form is copied to it (transposed,
    zero-padded to m4 x k4 and k4 x n: zeros add nothing) into this stream's scratch; C's rows
    m..m4 then lie in its ld padding (a multiple of 4) and are never read. Returns
    (m, k, op_a, op_b, a, b)."""
    import cupy
    m, n, k = step.m, step.n, step.k
    m4, k4 = -(-m // 4) * 4, -(-k // 4) * 4
    a_ok, b_ok = a[1] % 4 == 0 and a[0] % 4 == 0, b[1] % 4 == 0 and b[0] % 4 == 0
    direct_a = step.op_a != 0 and (m, k) == (m4, k4) and a_ok and a[0] % 16 == 0
    direct_b = step.op_b == 0 and k == k4 and b_ok and b[0] % 16 == 0
    if direct_a and direct_b:
        return m, k, 1, 0, a, b
    size_a = 0 if direct_a else -(-k4 * m4 // 256) * 256
    base = scratch(size_a + (0 if direct_b else k4 * n))
    with stream:
        if not direct_a:  # A' (k4 x m4) with A'^T = op_a(A), padded with zeros
            src = device_view(a[0], *((m, k) if step.op_a == 0 else (k, m)), a[1], np.int8)
            dst = device_view(base, k4, m4, k4, np.int8)
            if (m4, k4) != (m, k):
                dst.fill(0)
            cupy.copyto(dst[:k, :m], src.T if step.op_a == 0 else src)
            a = (base, k4)
        if not direct_b:  # B' (k4 x n) = op_b(B), padded with zeros
            src = device_view(b[0], *((k, n) if step.op_b == 0 else (n, k)), b[1], np.int8)
            dst = device_view(base + size_a, k4, n, k4, np.int8)
            if k4 != k:
                dst.fill(0)
            cupy.copyto(dst[:k, :], src if step.op_b == 0 else src.T)
            b = (base + size_a, k4)
    return m4, k4, 1, 0, a, b
