"""Page-locked host memory for the results blasx allocates on GPU engines.

A result that blasx creates (``blasx.gemm(a, b)``, ``matmul`` without ``out``) would otherwise be a
new numpy array page-locked during its call (hostmem.py), and locking pages never touched before
costs the kernel a fault and a zeroing per page. Large results come from this pool instead:
page-locked buffers handed out as ordinary numpy arrays. When the last view of a result dies, its
buffer comes back here and serves the next result of the same size. Idle buffers stay page-locked
up to ``idle_limit`` bytes (the oldest freed are released first).
``$BLASX_RESULT_POOL``: ``off`` (or 0, no, false) for plain numpy results, or the idle limit (``8G``).

A new buffer is anonymous memory whose pages several threads touch first, then one
``cudaHostRegister``: ``cudaHostAlloc`` faults and zeroes every page on one thread, work that the
first touches spread over several threads.

Ownership: the pool's lock guards the free lists and the idle count; a handed-out buffer belongs
to the arrays viewing it (a ctypes object is their base, and its finalizer returns the buffer).
The finalizer runs wherever the garbage collector frees the last view, possibly inside this
module's own lock in the same thread, hence a re-entrant lock. ``LockedMemory`` owns the mappings.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import math
import mmap
import os
import threading
import weakref

import numpy as np

from .config import OFF_WORDS, parse_size
from .hostmem import HOST_REGISTER_PORTABLE, PAGE


def _host_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


def _cuda_register(ptr: int, nbytes: int) -> None:
    from cupy.cuda import runtime
    runtime.hostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE)


def _cuda_unregister(ptr: int) -> None:
    from cupy.cuda import runtime
    runtime.hostUnregister(ptr)


class LockedMemory:
    """``alloc(nbytes) -> pointer`` / ``free(pointer)`` of page-locked buffers: a private anonymous
    mapping, zeroed by several threads (each page faults in on the thread that first writes it), then
    registered whole (``register(ptr, nbytes)``, default cudaHostRegister, portable to every device).
    The mappings are this object's; ``free`` unregisters and unmaps."""

    def __init__(self, register=None, unregister=None) -> None:
        self._register = register or _cuda_register
        self._unregister = unregister or _cuda_unregister
        self._lock = threading.Lock()
        self._maps: dict[int, mmap.mmap] = {}

    def alloc(self, nbytes: int) -> int:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = None
        registering = False
        try:
            view = np.frombuffer(m, dtype=np.uint8)
            ptr = view.ctypes.data
            zero(view)
            view = None  # no export left: the mapping can close
            registering = True
            self._register(ptr, nbytes)
            with self._lock:
                self._maps[ptr] = m
        except BaseException:
            view = None
            if registering:  # (a Ctrl-C raised as the registration returned: never unmap registered pages)
                with contextlib.suppress(Exception):
                    self._unregister(ptr)
                with self._lock:
                    self._maps.pop(ptr, None)
            with contextlib.suppress(BufferError):  # a zeroing thread still at it (interrupted): unmapped with it
                m.close()
            raise
        return ptr

    def free(self, ptr: int) -> None:
        with self._lock:
            m = self._maps.pop(ptr)
        try:
            self._unregister(ptr)
        finally:
            m.close()

    @property
    def live(self) -> int:
        return len(self._maps)


_LOCKED = LockedMemory()


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
    default to :class:`LockedMemory`'s; idle buffers are kept up to ``idle_limit`` bytes (default:
    ``$BLASX_RESULT_POOL``'s, read at the first result; None there turns the pool off)."""

    _UNSET = object()

    def __init__(self, alloc=None, free=None, idle_limit=_UNSET) -> None:
        self._alloc = alloc or _LOCKED.alloc
        self._free_fn = free or _LOCKED.free
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


ZERO_PART = 64 << 20  # bytes a thread fills at least: large results are zeroed / copied by several threads


def _in_parts(work, nbytes: int, length: int) -> None:
    """``work(lo, hi)`` over [0, length) in parts on a few threads when ``nbytes`` is large (numpy's fills
    and copies let go of the GIL); the first part on this thread; a part's exception is raised here."""
    parts = min(16, os.cpu_count() or 1, nbytes // ZERO_PART, length)
    if parts < 2:
        work(0, length)
        return
    edges = [length * i // parts for i in range(parts + 1)]
    errors = []

    def run(lo, hi):
        try:
            work(lo, hi)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=span, name="blasx-fill") for span in zip(edges[1:-1], edges[2:])]
    for t in threads:
        t.start()
    run(edges[0], edges[1])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def zero(flat: np.ndarray) -> None:
    """Fill the 1-D ``flat`` with zeros (in parts on a few threads when it is large)."""
    _in_parts(lambda lo, hi: flat[lo:hi].fill(0), flat.nbytes, len(flat))


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for numpy arrays of one shape (values cast as assignment casts them), in parts
    of dst's outermost axis on a few threads when it is large: a new result holding c's values."""
    if dst.ndim == 0:
        dst[...] = src
        return
    axis = max(range(dst.ndim), key=lambda i: abs(dst.strides[i]))

    def part(lo, hi):
        cut = (slice(None),) * axis + (slice(lo, hi),)
        np.copyto(dst[cut], src[cut], casting="unsafe")
    _in_parts(part, dst.nbytes, dst.shape[axis])


POOL = OutputPool()


def _after_fork_in_child() -> None:
    """Locks a parent thread may have held at the fork, made anew in the child (the buffers are its copies)."""
    POOL._lock = threading.RLock()
    _LOCKED._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def stage_buffer(nbytes: int):
    """A page-locked buffer of the pool (uint8, ``nbytes``) to stage an input in (hostmem.RegistrationCache.pin's
    ``buffer``), or None: the pool is off, or could not keep three such buffers idle (an input's, another's, a
    result's) after the call."""
    limit = POOL.idle_limit
    return None if limit is None or 3 * nbytes > limit else POOL.array((nbytes,), np.uint8)
