"""Pinning host arrays for asynchronous copies: a registration cache.

Copies between pageable memory and a GPU are staged by the driver and do not
overlap anything (7.8 GB/s measured on the H200 host, against 55 GB/s
pinned). blasx therefore page-locks host operands in place with
``cudaHostRegister`` (portable, so every GPU sees them as pinned):

* the whole buffer of the array's root (the ndarray owning the memory) is
  registered once and stays registered while that root lives; a finalizer
  unregisters it when the root is collected;
* memory that is already pinned (``cudaHostAlloc``, or registered by someone
  else) is recognised and used as is, and never unregistered by blasx;
* only ranges blasx registered itself are ever unregistered;
* only roots that own their memory and are at least ``MIN_REGISTER_BYTES``
  are registered. glibc serves such blocks from their own mmap, so their
  pages hold nothing else. Smaller blocks may share a page with another
  array, and CUDA rejects a copy from a range that is only partly
  registered (``cudaErrorInvalidValue``, seen on the H200 host), so those
  are copied from pageable memory instead; they are small.

Registration costs about 32 ms/GiB on that host, four times less than one
pageable transfer of the same bytes, and every later call on the same array
is free, which is why it is preferred to bounce buffers (see
``bench/results/NOTES.md`` for the measurement).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

PAGE = 4096
MIN_REGISTER_BYTES = 32 << 20  # glibc's largest dynamic mmap threshold
HOST_REGISTER_PORTABLE = 1
ERROR_ALREADY_REGISTERED = 712


def _root(x: np.ndarray) -> np.ndarray:
    node = x
    while isinstance(node.base, np.ndarray):
        node = node.base
    return node


class RegistrationCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ours: dict[int, tuple[int, int]] = {}  # id(root) -> (start, size) registered by blasx
        self.registered_bytes = 0
        self.seconds = 0.0

    def ensure_pinned(self, x: np.ndarray) -> str:
        """Pin the memory under ``x``; returns 'ours', 'foreign' (already pinned), 'pageable' or 'failed'."""
        import time

        from cupy.cuda import runtime

        root = _root(x)
        if root.nbytes == 0:
            return "failed"
        lo = int(root.ctypes.data)
        if _is_pinned(runtime, lo) and _is_pinned(runtime, lo + root.nbytes - 1):
            return "foreign"
        if root.base is not None or root.nbytes < MIN_REGISTER_BYTES:
            return "pageable"
        with self._lock:
            if id(root) in self._ours:
                return "ours"
            start = lo - lo % PAGE
            end = -(-(lo + root.nbytes) // PAGE) * PAGE
            t0 = time.perf_counter()
            try:
                runtime.hostRegister(start, end - start, HOST_REGISTER_PORTABLE)
            except runtime.CUDARuntimeError as exc:
                if getattr(exc, "status", None) == ERROR_ALREADY_REGISTERED:
                    return "foreign"
                return "failed"
            self.seconds += time.perf_counter() - t0
            self._ours[id(root)] = (start, end - start)
            self.registered_bytes += end - start
            weakref.finalize(root, self._unregister, id(root), start)
            return "ours"

    def _unregister(self, key: int, start: int) -> None:
        with self._lock:
            hit = self._ours.pop(key, None)
            if hit is None or hit[0] != start:
                return
            self.registered_bytes -= hit[1]
        try:
            from cupy.cuda import runtime
            runtime.hostUnregister(start)
        except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone already
            pass

    def describe(self, lo: int, hi: int) -> str:
        """Why a copy from host bytes [lo, hi) may have been refused: their pinned state and the
        blasx registrations overlapping them (for error messages)."""
        try:
            from cupy.cuda import runtime
            ends = f"pinned at first byte: {_is_pinned(runtime, lo)}, at last byte: {_is_pinned(runtime, hi - 1)}"
        except Exception as exc:  # noqa: BLE001 - a description must not raise
            ends = f"pinned state unknown ({exc!r})"
        with self._lock:
            overlap = [f"[{s:#x}, {s + n:#x})" for s, n in self._ours.values() if s < hi and lo < s + n]
        return (f"host bytes [{lo:#x}, {hi:#x}): {ends}; blasx registrations overlapping: "
                f"{', '.join(overlap) or 'none'}")

    def is_ours(self, x: np.ndarray) -> bool:
        with self._lock:
            return id(_root(x)) in self._ours


def _is_pinned(runtime, ptr: int) -> bool:
    try:
        attrs = runtime.pointerGetAttributes(ptr)
    except Exception:  # noqa: BLE001 - unregistered memory may be reported as an error
        return False
    kind = getattr(attrs, "type", None)
    if kind is not None:
        return kind == 1  # cudaMemoryTypeHost
    return bool(getattr(attrs, "devicePointer", 0))


REGISTRY = RegistrationCache()
