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
  are registered, and only the pages that lie wholly inside them. CUDA
  rejects a copy from a range that is only partly registered
  (``cudaErrorInvalidValue``). glibc may serve even a large block from its
  heap, next to other arrays in the same page (seen on the H200 host: a
  small array after a registered one failed), so a registration must never
  reach past the array's own bytes. The array's partial first and last pages
  stay pageable: the device copies the few tiles that straddle a boundary of
  the registered span through a pinned bounce buffer (``straddles``).
  Smaller arrays are copied from pageable memory; they are small.

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


def interior_pages(lo: int, nbytes: int) -> tuple[int, int]:
    """[start, end): the whole pages inside bytes [lo, lo + nbytes) (empty: start >= end)."""
    return -(-lo // PAGE) * PAGE, (lo + nbytes) // PAGE * PAGE


def straddles(span: tuple[int, int] | None, lo: int, hi: int) -> bool:
    """Bytes [lo, hi) are partly inside and partly outside the pinned ``span``: CUDA copies
    them neither as pinned nor as pageable memory."""
    if span is None:
        return False
    start, end = span
    return lo < end and hi > start and not (start <= lo and hi <= end)


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

    def ensure_pinned(self, x: np.ndarray) -> tuple[str, tuple[int, int] | None]:
        """Pin the memory under ``x``; returns (how, span): how is 'ours', 'foreign' (already
        pinned), 'pageable' or 'failed'; span the pinned bytes [start, end) of its root, or None."""
        import time

        from cupy.cuda import runtime

        root = _root(x)
        if root.nbytes == 0:
            return "failed", None
        lo = int(root.ctypes.data)
        whole = (lo, lo + root.nbytes)
        if _is_pinned(runtime, lo) and _is_pinned(runtime, lo + root.nbytes - 1):
            return "foreign", whole
        if root.base is not None or root.nbytes < MIN_REGISTER_BYTES:
            return "pageable", None
        with self._lock:
            hit = self._ours.get(id(root))
            if hit is not None:
                return "ours", (hit[0], hit[0] + hit[1])
            start, end = interior_pages(lo, root.nbytes)  # never a byte of a neighbouring array
            t0 = time.perf_counter()
            try:
                runtime.hostRegister(start, end - start, HOST_REGISTER_PORTABLE)
            except runtime.CUDARuntimeError as exc:
                if getattr(exc, "status", None) == ERROR_ALREADY_REGISTERED:
                    return "foreign", whole
                return "failed", None
            self.seconds += time.perf_counter() - t0
            self._ours[id(root)] = (start, end - start)
            self.registered_bytes += end - start
            weakref.finalize(root, self._unregister, id(root), start)
            return "ours", (start, end)

    def release(self, x: np.ndarray) -> bool:
        """Unregister now what blasx registered under ``x``'s root (True if there was such a
        registration). The next call on it pins again; memory pinned by others is left alone."""
        root = _root(x)
        with self._lock:
            hit = self._ours.get(id(root))
        if hit is None:
            return False
        self._unregister(id(root), hit[0])
        return True

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
