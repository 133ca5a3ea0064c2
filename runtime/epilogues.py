"""Epilogues: work a device does on a finished C tile before its write-back (``Call.epilogue``).

An epilogue is called as ``epilogue(device, stream, loc, task)`` by the worker (stream devices)
or the CPU device, with the tile's location in the device's form (a numpy view on sim and cpu,
``(pointer, ld)`` on cuda). On a stream device it is called when the tile's kernels are issued,
not done: it issues its work on ``stream`` (sim: ``device.streams[stream].submit``). One with a
``dtype`` attribute converts the tile in place to that type (same item size); the write-back then
reads it as such (``Call.wb_dtype``). ``transposed()`` gives the epilogue of C^T, for a front end
that computes the transposed product (``dispatch.gemm``).
"""

from __future__ import annotations

import threading

import numpy as np


class Dequantize:
    """int8 gemm's epilogue: the int32 tile -> float32 ``tile * row_scale[i] * col_scale[j]`` in
    place (the scales of the quantized operands, on the canonical C's rows and columns)."""

    dtype = np.dtype(np.float32)

    def __init__(self, row_scale, col_scale) -> None:
        self.row_scale = np.ascontiguousarray(row_scale, dtype=np.float32)
        self.col_scale = np.ascontiguousarray(col_scale, dtype=np.float32)
        self._on_device: dict = {}  # device index -> the scales in its memory (CuPy)
        self._lock = threading.Lock()

    def transposed(self) -> "Dequantize":
        """The epilogue of the transposed product (C^T: row and column scales swapped)."""
        return Dequantize(self.col_scale, self.row_scale)

    def __call__(self, dev, s, loc, task) -> None:
        ref = task.c
        rows, cols = slice(ref.r0, ref.r0 + ref.rows), slice(ref.c0, ref.c0 + ref.cols)
        if dev.kind == "cuda":
            r, c = self._device_scales(dev)
            dev.dequantize(s, loc, ref.rows, ref.cols, r[rows], c[cols])
            return
        r, c = self.row_scale[rows, None], self.col_scale[None, cols]

        def work():
            scaled = loc.astype(np.float32)
            scaled *= r
            scaled *= c
            loc.view(np.float32)[...] = scaled
        if dev.kind == "sim":  # behind the tile's kernels on its stream (none in timing mode)
            if not dev.timing:
                dev.streams[s].submit(work)
            return
        work()  # cpu: the finished tile, in this thread

    def _device_scales(self, dev):
        """The scales on ``dev`` (copied once per device, the first time it finishes a tile)."""
        got = self._on_device.get(dev.index)
        if got is None:
            import cupy
            with self._lock, cupy.cuda.Device(dev.ordinal):
                got = self._on_device.get(dev.index)
                if got is None:
                    got = (cupy.asarray(self.row_scale), cupy.asarray(self.col_scale))
                    cupy.cuda.get_current_stream().synchronize()
                    self._on_device[dev.index] = got
        return got
