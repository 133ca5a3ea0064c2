"""Host scratch arrays for operands the planner adds to a call (TRSM's diagonal-block inverses).

On GPUs the engine page-locks host operands (19 ms/GiB for touched memory, ~4x that for fresh
untouched memory: bench/results/NOTES.md), and a copy into scratch memory that is not locked
yet waits for it. A scratch array made afresh for each call would pay that on every call, so
they are kept and reused: a call takes the smallest kept buffer that is large enough (its
first bytes, viewed as the array it needs) and gives it back when it ends; two calls running at
once never share one. At most ``MAX_KEPT`` buffers are kept between calls (the largest
first); ``clear`` (called by ``blasx.shutdown``) drops them all.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np

MAX_KEPT = 2


class ScratchPool:
    def __init__(self, max_kept: int = MAX_KEPT) -> None:
        self.max_kept = max_kept
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []  # 1-d uint8 buffers, not in use

    def _get(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        return np.empty(max(1, nbytes), dtype=np.uint8)

    def _put(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: -b.nbytes)
            del self._free[self.max_kept:]

    @contextmanager
    def take(self, shape: tuple[int, int], dtype):
        """An F-ordered array of ``shape`` and ``dtype`` (contents undefined) for the block."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        buf = self._get(nbytes)
        try:
            yield buf[:nbytes].view(dtype).reshape(shape, order="F")
        finally:
            self._put(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)


POOL = ScratchPool()
