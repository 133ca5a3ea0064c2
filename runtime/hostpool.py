"""Page-locked host memory for the results blasx allocates on GPU engines.

A result that blasx creates (``blasx.gemm(a, b)``, ``matmul`` without ``out``) would otherwise be a
new numpy array page-locked during its call (hostmem.py), and locking pages never touched before
costs the kernel a fault and a zeroing per page. Large results come from this pool instead:
page-locked buffers (``cudaHostAlloc``) handed out as ordinary numpy arrays. When the last view of
a result dies, its buffer comes back here and serves the next result of the same size. Idle
buffers stay page-locked up to ``idle_limit`` bytes (the oldest freed are released first).
``$BLASX_RESULT_POOL``: ``off`` (or 0, no, false) for plain numpy results, or the idle limit (``8G``).

Ownership: the pool's lock guards the free lists and the idle count; a handed-out buffer belongs
to the arrays viewing it (a ctypes object is their base, and its finalizer returns the buffer).
The finalizer runs wherever the garbage collector frees the last view, possibly inside this
module's own lock in the same thread, hence a re-entrant lock.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import math
import os
import threading
import weakref

import numpy as np

from .config import OFF_WORDS, parse_size
from .hostmem import PAGE

HOST_ALLOC_PORTABLE = 1  # cudaHostAllocPortable: page-locked for every device's copies


def _host_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


def _cuda_alloc(nbytes: int) -> int:
    from cupy.cuda import runtime
    return runtime.hostAlloc(nbytes, HOST_ALLOC_PORTABLE)


def _cuda_free(ptr: int) -> None:
    from cupy.cuda import runtime
    runtime.freeHost(ptr)


ENV = "BLASX_RESULT_POOL"


def env_setting(text: str | None = None) -> int | None:
    """``$BLASX_RESULT_POOL`` read: None (the pool is off), or the idle limit in bytes (default: an eighth of the
    host's memory). A value that is neither raises ValueError naming the variable."""
    text = os.environ.get(ENV, "") if text is None else text
    text = text.strip()
    if not text:
        return _host_bytes() // 8
    if text.lower() in OFF_WORDS:
        return None
    try:
        return int(parse_size(text))
    except ValueError as exc:
        raise ValueError(f"{ENV}: {exc}; or off to make plain numpy results") from None


class OutputPool:
    """Page-locked buffers by size (whole pages). ``alloc(nbytes) -> pointer`` and ``free(pointer)``
    default to cudaHostAlloc / cudaFreeHost; idle buffers are kept up to ``idle_limit`` bytes (default:
    ``$BLASX_RESULT_POOL``'s, read at the first result; None there turns the pool off)."""

    _UNSET = object()

    def __init__(self, alloc=None, free=None, idle_limit=_UNSET) -> None:
        self._alloc = alloc or _cuda_alloc
        self._free_fn = free or _cuda_free
        self._limit = idle_limit
        self._lock = threading.RLock()
        self._idle: collections.OrderedDict[int, int] = collections.OrderedDict()  # pointer -> bytes, oldest first
        self.idle_bytes = 0
        self.handed = 0  # buffers out with arrays now
        self.reused = 0  # results served from an idle buffer

    @property
    def idle_limit(self) -> int | None:
        if self._limit is OutputPool._UNSET:
            self._limit = env_setting()
        return self._limit

    def array(self, shape, dtype, order: str = "F", zeros: bool = False) -> np.ndarray | None:
        """A new array of ``shape`` and ``dtype`` in page-locked memory (zeros if asked), or None
        where the pool is off or no page-locked memory could be had (the caller makes a plain array)."""
        if self.idle_limit is None:
            return None
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        size = max(PAGE, -(-count * dtype.itemsize // PAGE) * PAGE)
        ptr = self._take(size)
        if ptr is None:
            try:
                ptr = self._alloc(size)
            except Exception:  # noqa: BLE001 - no page-locked memory left: a plain array will do
                return None
        else:
            self.reused += 1
        buf = (ctypes.c_byte * size).from_address(ptr)
        fin = weakref.finalize(buf, self._give_back, ptr, size)
        fin.atexit = False  # at exit the memory goes with the process
        self.handed += 1
        flat = np.frombuffer(buf, dtype=dtype, count=count)
        if zeros:
            zero(flat)
        return flat.reshape(shape, order=order)

    def _take(self, size: int) -> int | None:
        with self._lock:
            for ptr, n in reversed(self._idle.items()):  # the most recently freed: warm in the caches
                if n == size:
                    del self._idle[ptr]
                    self.idle_bytes -= n
                    return ptr
        return None

    def _give_back(self, ptr: int, size: int) -> None:
        drop = []
        with self._lock:
            self.handed -= 1
            self._idle[ptr] = size
            self.idle_bytes += size
            while self.idle_bytes > (self.idle_limit or 0) and self._idle:
                old, n = self._idle.popitem(last=False)
                self.idle_bytes -= n
                drop.append(old)
        for old in drop:
            with contextlib.suppress(Exception):  # a driver already gone (interpreter exit)
                self._free_fn(old)

    def clear(self) -> None:
        """Release every idle buffer (buffers out with arrays come back, and stay, as they die)."""
        with self._lock:
            drop, self._idle = list(self._idle), collections.OrderedDict()
            self.idle_bytes = 0
        for ptr in drop:
            with contextlib.suppress(Exception):
                self._free_fn(ptr)


ZERO_PART = 64 << 20  # bytes a thread zeroes at least: a reused buffer is cleared by several threads


def zero(flat: np.ndarray) -> None:
    """Fill the 1-D ``flat`` with zeros, in parts on a few threads when it is large (``fill`` lets go of the GIL)."""
    parts = min(8, os.cpu_count() or 1, flat.nbytes // ZERO_PART)
    if parts < 2:
        flat.fill(0)
        return
    edges = [len(flat) * i // parts for i in range(parts + 1)]
    threads = [threading.Thread(target=flat[a:b].fill, args=(0,), name="blasx-zero")
               for a, b in zip(edges[1:-1], edges[2:])]
    for t in threads:
        t.start()
    flat[:edges[1]].fill(0)
    for t in threads:
        t.join()


POOL = OutputPool()
