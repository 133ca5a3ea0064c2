"""A kernel launched through the driver with its arguments packed once (the implicit-GEMM kernel, the gather,
col2im): a launch sets the leading pointer arguments in place and calls cuLaunchKernel, where CuPy's kernel
call converts every argument on each launch."""

from __future__ import annotations

import ctypes
import threading


class DriverLaunch:
    """A CuPy kernel launched by the driver's cuLaunchKernel (CuPy's binding) with its arguments packed
    once: a call sets the ``pointers`` leading arguments and launches (CuPy's kernel call converts every
    argument on each call). ``tail``: the ctypes values of the other arguments. Each thread packs into
    buffers of its own."""

    def __init__(self, kernel, grid: tuple, block: tuple, smem: int, pointers: int, tail: tuple) -> None:
        self.fn, self.grid, self.block, self.smem = kernel.kernel.ptr, grid, block, smem
        self.pointers, self.tail = pointers, tail
        self._tls = threading.local()

    def _buffers(self):
        import cupy
        ptrs = (ctypes.c_void_p * self.pointers)()
        tail = [type(v)(v.value) for v in self.tail]
        addrs = [ctypes.addressof(ptrs) + i * ctypes.sizeof(ctypes.c_void_p) for i in range(self.pointers)]
        params = (ctypes.c_void_p * (self.pointers + len(tail)))(*addrs, *(ctypes.addressof(v) for v in tail))
        self._tls.b = b = (ptrs, ctypes.addressof(params), cupy.cuda.driver.launchKernel, params, tail)
        return b

    def __call__(self, stream: int, *pointers: int) -> None:
        b = getattr(self._tls, "b", None) or self._buffers()
        ptrs = b[0]
        for i, p in enumerate(pointers):
            ptrs[i] = p
        b[2](self.fn, *self.grid, *self.block, self.smem, stream, b[1], 0)
