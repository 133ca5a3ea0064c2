"""Pinning host arrays for asynchronous copies: a registration cache, filled while calls run.

Pageable copies overlap nothing, so blasx page-locks host operands in place (``cudaHostRegister``): the root
of an array (the ndarray owning the memory, at least ``MIN_REGISTER_BYTES``) is registered once while it
lives, its whole pages only; memory pinned by others is used as is, smaller arrays are copied pageable.
Registration costs about a pass over the data, so ``PIN_THREADS`` threads per call register ``CHUNK_BYTES``
chunks in the order the call reads them (an output it only writes after its inputs); a tile copy waits only
for the chunks it touches, split at chunk boundaries (``split_2d``: CUDA refuses a copy over a partly
registered range), and a chunk it waits for is taken next (``PinJob.hurry``).

Staging: an input the call only reads, seen for the first time, is copied instead into a page-locked buffer
of the result pool (same threads and chunk order; copies read the buffer, ``Pinning.delta``): with the buffer
idle in the pool, a pass of copying is cheaper than registering an array and later unregistering it. An
array seen again is registered in place: it is being reused.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
import time
import weakref

import numpy as np

from .latch import Latch, wait_through

PAGE = 4096
MIN_REGISTER_BYTES = 32 << 20  # glibc's largest dynamic mmap threshold
CHUNK_BYTES = 256 << 20  # one registration: short next to a call, few per GiB
HOST_REGISTER_PORTABLE = 1
WAIT_SECONDS = 120.0  # a copy waiting this long for a chunk's registration fails instead
PIN_THREADS = 4  # threads registering one call's chunks: the driver pins a fresh array's pages faster on several
STAGE_THREADS = min(24, os.cpu_count() or 1)  # threads of a call that stages: copies scale further than registration


def interior_pages(lo: int, nbytes: int) -> tuple[int, int]:
    """[start, end): the whole pages inside bytes [lo, lo + nbytes) (empty: start >= end)."""
    return -(-lo // PAGE) * PAGE, (lo + nbytes) // PAGE * PAGE


def chunk_spans(start: int, end: int, chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """[start, end) (page-aligned) cut into consecutive page-aligned spans of at most ``chunk`` bytes."""
    step = max(PAGE, chunk // PAGE * PAGE)
    return [(s, min(s + step, end)) for s in range(start, end, step)]


def round_robin(lists) -> list:
    """Items of the lists interleaved: the first of each, then the second of each, ..."""
    gap = object()
    return [x for row in itertools.zip_longest(*lists, fillvalue=gap) for x in row if x is not gap]


def split_2d(ptr: int, pitch: int, width: int, cols: int, cuts) -> list[tuple[int, int, int, int]]:
    """Pieces ``(c0, ncols, b0, b1)`` of a 2-D copy of ``cols`` columns of ``width`` bytes, column c
    at ``ptr + c * pitch``: bytes [b0, b1) of columns c0 .. c0 + ncols - 1. No piece's byte extent
    (first to last byte, gaps included) contains a cut: a cut x separates [.., x) from [x, ..)."""
    extent = (cols - 1) * pitch + width if cols else 0
    breaks, inside = {0, cols}, {}
    for x in cuts:
        r = x - ptr
        if not 0 < r < extent:
            continue
        c, off = divmod(r, pitch)
        if off == 0:
            breaks.add(c)  # at a column's first byte
        elif off >= width:
            breaks.add(c + 1)  # in the gap after a column
        else:
            inside.setdefault(c, set()).add(off)
            breaks.update((c, c + 1))
    pieces = []
    points = sorted(breaks)
    for a, b in zip(points, points[1:]):
        if a in inside:
            edges = [0, *sorted(inside[a]), width]
            pieces += [(a, 1, e0, e1) for e0, e1 in zip(edges, edges[1:])]
        else:
            pieces.append((a, b - a, 0, width))
    return pieces


class Pinning:
    """The page-locked state of one root's memory: chunks [start, end) registered (or being registered) by
    blasx, or the whole root pinned by someone else (``foreign``); the rest is pageable. A chunk's state is
    written by the one thread registering it before its event is set; readers wait on the events."""

    def __init__(self, lo: int, hi: int, chunks: list[tuple[int, int]], foreign: bool = False,
                 staged=None, source=None) -> None:
        self.lo, self.hi, self.chunks, self.foreign = lo, hi, chunks, foreign
        self.ok = [foreign] * len(chunks)  # registered (by blasx), or copied into the staging buffer
        self.ready = [Latch() for _ in chunks]
        self.claimed = [staged is not None] * len(chunks)  # a thread has taken it on (under the cache's lock)
        self.owner: list = [None] * len(chunks)  # the PinJob doing it until done (a waiter hurries it)
        if foreign:
            for ev in self.ready:
                ev.set()
        # staged: a page-locked uint8 array holding a copy of bytes [lo, hi) of the array ``source``
        # (copied chunk by chunk by a PinJob, every chunk claimed from the start); copies read it there
        self.staged, self.source = staged, source
        self.delta = 0 if staged is None else int(staged.ctypes.data) - lo  # host address -> where it is read
        # region boundaries a copy must not span: the chunks' edges (none in one staging buffer)
        self.cuts = [] if staged is not None else sorted({x for span in chunks for x in span} - {lo, hi})

    @classmethod
    def whole(cls, lo: int, hi: int) -> "Pinning":
        return cls(lo, hi, [(lo, hi)], foreign=True)

    def wait(self, lo: int, hi: int) -> None:
        """Until every chunk overlapping bytes [lo, hi) is registered or failed; raises after ``WAIT_SECONDS``."""
        for i, ((s, e), ev) in enumerate(zip(self.chunks, self.ready)):
            if s < hi and lo < e and not ev.is_set() and (job := self.owner[i]) is not None:
                job.hurry(self, i)  # wanted now: its job takes it next
        for (s, e), ev in zip(self.chunks, self.ready):
            if s < hi and lo < e and not ev.wait(WAIT_SECONDS):
                raise TimeoutError(f"host memory bytes [{s:#x}, {e:#x}) were not page-locked within "
                                   f"{WAIT_SECONDS} s (cudaHostRegister of {e - s} bytes usually takes milliseconds)")
        if self.staged is not None and not all(ok for (s, e), ok in zip(self.chunks, self.ok) if s < hi and lo < e):
            raise RuntimeError(f"host memory bytes [{lo:#x}, {hi:#x}) could not be copied into a page-locked "
                               "staging buffer")

    def pieces(self, ptr: int, pitch: int, width: int, cols: int) -> list[tuple[int, int, int, int]]:
        """The 2-D copy split so each piece lies in one region, once those regions are ready."""
        end = ptr + (cols - 1) * pitch + width
        self.wait(ptr, end)
        return split_2d(ptr, pitch, width, cols, [x for x in self.cuts if ptr < x < end])

    @property
    def pinned_bytes(self) -> int:
        return sum(e - s for (s, e), ok in zip(self.chunks, self.ok) if ok)


def root_of(x: np.ndarray) -> np.ndarray:
    """The ndarray owning the memory ``x`` views (``x`` itself where it owns its memory)."""
    node = x
    while isinstance(node.base, np.ndarray):
        node = node.base
    return node


def _one_block(root: np.ndarray) -> bool:
    """Whether ``root``'s memory is the one block [data, data + nbytes): an array numpy allocated is, but a C
    extension's array with no base (blasx.offload's view of np.matmul's operand) may be a strided window."""
    return root.flags.c_contiguous or root.flags.f_contiguous


class RegistrationCache:
    def __init__(self) -> None:
        # Re-entrant: a root's finalizer (``_unregister``) runs wherever the garbage collector frees the root,
        # maybe inside this class's critical section in the same thread (a GC pass in ``Pinning.__init__``
        # under ``_pinning``'s lock may free an earlier call's array: a plain Lock would deadlock).
        self._lock = threading.RLock()
        self._ours: dict[int, Pinning] = {}  # id(root) -> what blasx registered (or is registering) in it
        self._seen: "weakref.WeakValueDictionary[int, np.ndarray]" = weakref.WeakValueDictionary()  # roots staged once

    def pin(self, arrays, min_bytes: int | None = None, late=(), threads: int | None = None,
            readonly=(), buffer=None, on_demand: bool = True, into=None) -> tuple[list, "PinJob | None"]:
        """Start pinning the roots (of at least ``min_bytes``, default ``MIN_REGISTER_BYTES``) of one call's host
        operands, chunks round-robin in address order (the order its tasks read them), those of the arrays at the
        indices ``late`` (outputs the call only writes; or a function giving them, called only if needed) after
        the others'. Returns each array's :class:`Pinning` (None: pageable) and the job registering the missing
        chunks on ``threads`` threads (default ``PIN_THREADS``, ``STAGE_THREADS`` when staging), which the caller
        joins after the call (None: nothing to do). The arrays at the indices ``readonly`` (inputs only read) may
        be staged into ``buffer(nbytes)`` (a page-locked uint8 array, or None); ``into``: {index: page-locked
        array} where a read-only input is staged straight, its values lying there byte for byte (a new result
        starting from them: :func:`_bytes_like`), seen before or not. ``on_demand``: ``PinJob.hurry`` is on."""
        from cupy.cuda import runtime

        min_bytes = MIN_REGISTER_BYTES if min_bytes is None else min_bytes
        # a root the call also writes is never staged (its copy would go stale)
        into = into or {}
        staging = {id(root_of(x)): None for i, x in enumerate(arrays) if i not in readonly} if buffer or into else {}
        pinnings, chunks, job = [], [], None
        try:
            for i, x in enumerate(arrays):
                stage = i in readonly and (buffer is not None or i in into)
                p = self._staging(runtime, x, staging, buffer, min_bytes, into.get(i)) if stage else None
                if p is not None:  # (a root read twice is staged once: its chunks listed with its first operand)
                    mine = [] if any(q is p for q in pinnings) else [(p, k) for k in range(len(p.chunks))]
                else:
                    p, mine = self._pinning(runtime, x, min_bytes)
                pinnings.append(p)
                chunks.append(mine)
            if not any(chunks):
                return pinnings, None
            late = late() if callable(late) else late
            order = (round_robin([c for i, c in enumerate(chunks) if i not in late])
                     + round_robin([c for i, c in enumerate(chunks) if i in late]))
            if threads is None and any(p.staged is not None for p, _ in order):
                threads = STAGE_THREADS
            job = PinJob(self, order, threads)
            if on_demand:
                for p, i in order:
                    p.owner[i] = job
            job.start()
        except BaseException:  # (Ctrl-C, or no memory for a staging buffer): what no thread took on is free again
            if job is None or not job.started:
                self._unclaim(chunks)
            else:  # (interrupted while starting its threads: they end before the call does)
                job.cancel()
                with contextlib.suppress(BaseException):
                    job.join()
            raise
        return pinnings, job

    def _unclaim(self, chunks: list) -> None:
        """Chunks this call claimed and will not register, claimable again (a later call registers them)."""
        with self._lock:
            for mine in chunks:
                for p, i in mine:
                    if p.staged is None:
                        p.claimed[i] = False
                        p.owner[i] = None

    def _staging(self, runtime, x, staging: dict, buffer, min_bytes: int, into=None):
        """A staged Pinning for x's root (shared by the call's operands on that root; its chunks copied by
        the call's job), or None: the root is small, pinned already or before, seen by blasx before, a view
        of a part of it, or ``buffer`` has none. With ``into`` (a page-locked array): staged there if x lies
        in it byte for byte, seen before or not."""
        root = root_of(x)
        key = id(root)
        if key in staging:
            return staging[key]
        lo = int(root.ctypes.data)
        p = None
        if (root.base is None and _one_block(root) and x.nbytes == root.nbytes and root.nbytes >= min_bytes
                and not (_is_pinned(runtime, lo) or _is_pinned(runtime, lo + root.nbytes - 1))):
            with self._lock:  # seen now, whatever follows: of calls racing on it, one stages it
                first = self._seen.get(key) is not root and key not in self._ours
                self._seen[key] = root
            buf = None if into is None else _bytes_like(into, x)
            if buf is not None and not _both_ends_pinned(runtime, buf.ctypes.data, buf.ctypes.data + buf.nbytes):
                buf = None
            if buf is None and first and buffer is not None:
                buf = buffer(root.nbytes)
            if buf is not None:
                p = Pinning(lo, lo + root.nbytes, chunk_spans(lo, lo + root.nbytes, CHUNK_BYTES), staged=buf,
                            source=root)
        staging[key] = p
        return p

    def _pinning(self, runtime, x, min_bytes: int):
        """(the Pinning of x's root, the list of (pinning, chunk index) this call must register)."""
        root = root_of(x)
        if root.nbytes == 0 or not _one_block(root):  # (a strided window of foreign memory: pageable)
            return None, []
        lo = int(root.ctypes.data)
        hi = lo + root.nbytes
        with self._lock:
            p = self._ours.get(id(root))
            if p is None:
                if _both_ends_pinned(runtime, lo, hi):
                    return Pinning.whole(lo, hi), []
                if root.base is not None or root.nbytes < min_bytes:
                    return None, []
                start, end = interior_pages(lo, root.nbytes)  # never a byte of a neighbouring array
                p = self._ours[id(root)] = Pinning(lo, hi, chunk_spans(start, end, CHUNK_BYTES))
                weakref.finalize(root, self._unregister, id(root), p)
            mine = [i for i, taken in enumerate(p.claimed) if not taken]
            for i in mine:
                p.claimed[i] = True
        return p, [(p, i) for i in mine]

    def register_chunk(self, p: Pinning, i: int) -> None:
        """Register (or, staged, copy) chunk i of p, on a thread of its PinJob; always sets its event."""
        if p.staged is not None:
            stage_chunk(p, i)
            return
        try:
            from cupy.cuda import runtime
            start, end = p.chunks[i]
            try:
                runtime.hostRegister(start, end - start, HOST_REGISTER_PORTABLE)
                p.ok[i] = True
            except runtime.CUDARuntimeError:  # already registered by others, or no lockable memory: pageable
                p.ok[i] = False
        finally:
            p.ready[i].set()

    def release(self, x: np.ndarray) -> bool:
        """Unregister now what blasx registered under ``x``'s root (True if any); the next call pins it again."""
        root = root_of(x)
        with self._lock:
            p = self._ours.get(id(root))
        if p is None:
            return False
        p.wait(p.lo, p.hi)  # a chunk still being registered by a running call
        self._unregister(id(root), p)
        return True

    def _unregister(self, key: int, p: Pinning) -> None:
        with self._lock:
            if self._ours.get(key) is not p:
                return
            del self._ours[key]
        with contextlib.suppress(Exception):  # at interpreter exit the driver may be gone already
            from cupy.cuda import runtime
            for (start, _), ok in zip(p.chunks, p.ok):
                if ok:
                    runtime.hostUnregister(start)

    def describe(self, lo: int, hi: int) -> str:
        """For error messages: the pinned state of host bytes [lo, hi) and blasx registrations overlapping them."""
        try:
            from cupy.cuda import runtime
            ends = f"pinned at first byte: {_is_pinned(runtime, lo)}, at last byte: {_is_pinned(runtime, hi - 1)}"
        except Exception as exc:  # noqa: BLE001 - a description must not raise
            ends = f"pinned state unknown ({exc!r})"
        with self._lock:
            overlap = [f"[{s:#x}, {e:#x}){'' if ok else ' (failed)'}" for p in self._ours.values()
                       for (s, e), ok in zip(p.chunks, p.ok) if s < hi and lo < e]
        return (f"host bytes [{lo:#x}, {hi:#x}): {ends}; blasx registrations overlapping: "
                f"{', '.join(overlap) or 'none'}")


def _bytes_like(dest, x: np.ndarray) -> np.ndarray | None:
    """``dest``'s memory as uint8 in memory order, where each element of x (a contiguous array owning its
    memory) has its counterpart at the same byte offset there (same type, shape and strides); else None."""
    order = "F" if x.flags.f_contiguous else "C" if x.flags.c_contiguous else None
    if (order is None or type(dest) is not np.ndarray or not dest.flags.writeable or dest.dtype != x.dtype
            or dest.shape != x.shape or dest.strides != x.strides):
        return None
    return dest.reshape(-1, order=order).view(np.uint8)


def stage_chunk(p: Pinning, i: int) -> None:
    """Copy chunk i of a staged p from its root into its buffer; always sets its event (a failed copy
    leaves the chunk not ok: a tile copy waiting for it raises, so the call fails rather than read it)."""
    try:
        start, end = p.chunks[i]
        src = p.source.reshape(-1, order="A").view(np.uint8)  # a root owning its memory is contiguous
        np.copyto(p.staged[start - p.lo:end - p.lo], src[start - p.lo:end - p.lo])
        p.ok[i] = True
    finally:
        p.ready[i].set()


class PinJob:
    """One call's chunks, registered (or staged) by threads of its own, each taking the chunk a tile copy
    waits for, if any (``hurry``), else the next in order; each chunk is taken once (under ``_lock``). Not
    daemons: the call joins the job before returning, so no registration outlives the call's arrays."""

    def __init__(self, cache: RegistrationCache, chunks: list, threads: int | None = None) -> None:
        self.cache, self.chunks = cache, chunks
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._taken = [False] * len(chunks)
        self._cursor = 0  # the next chunk in order not yet looked at
        self._hurried: collections.deque[int] = collections.deque()
        self._where = {(id(p), i): n for n, (p, i) in enumerate(chunks)}
        n = max(1, min(PIN_THREADS if threads is None else threads, len(chunks)))
        self._threads = [threading.Thread(target=self._run, name="blasx-pin", daemon=False) for _ in range(n)]
        self._t0 = 0.0
        self._ends: list[float] = []  # each thread's end (list.append is atomic under the GIL)
        self._cancelled = False

    def start(self) -> None:
        self._t0 = time.perf_counter()
        for t in self._threads:
            t.start()

    @property
    def started(self) -> bool:
        """A thread has started (it takes every chunk nobody took before it ends)."""
        return any(t.ident is not None for t in self._threads)

    def hurry(self, p: Pinning, i: int) -> None:
        """Chunk i of p is wanted now: the next thread free takes it (if this job has it, not yet taken)."""
        n = self._where.get((id(p), i))
        if n is not None:
            with self._lock:
                if not self._taken[n]:
                    self._hurried.append(n)

    def cancel(self) -> None:
        """Take no more chunks (a failed or interrupted call): each thread ends after the chunk it is doing; the
        chunks nobody took are left pageable for this call and claimable by the next (:meth:`_run`)."""
        self._cancelled = True

    def _take(self) -> int | None:
        """The chunk this thread does next (marked taken), or None when every chunk is taken (or cancelled)."""
        with self._lock:
            while not self._cancelled and (self._hurried or self._cursor < len(self.chunks)):
                if self._hurried:
                    n = self._hurried.popleft()
                else:
                    n, self._cursor = self._cursor, self._cursor + 1
                if not self._taken[n]:
                    self._taken[n] = True
                    return n
        return None

    def _run(self) -> None:
        try:
            while (n := self._take()) is not None:
                p, k = self.chunks[n]
                try:
                    self.cache.register_chunk(p, k)  # sets the chunk's event whatever happens
                finally:
                    p.owner[k] = None  # (no pinning keeps a finished job, and the call's arrays, alive)
        finally:  # after an unexpected error or a cancel the chunks nobody took stay pageable: no copy waits
            self._cancelled = True  # for them; a later call may claim them again
            for n in self._untaken():
                p, k = self.chunks[n]
                p.owner[k] = None
                p.ready[k].set()  # (before the cache's lock: a caller may hold it while it waits for no chunk)
                if p.staged is None:
                    with self.cache._lock:
                        p.claimed[k] = False
            self._ends.append(time.perf_counter())

    def _untaken(self) -> list[int]:
        """The chunks no thread took, now marked taken."""
        with self._lock:
            out = [n for n, taken in enumerate(self._taken) if not taken]
            for n in out:
                self._taken[n] = True
        return out

    def join(self) -> None:
        """Until every thread is done; ``seconds`` is then the registering time (start to the last thread's end).
        A Ctrl-C while waiting cancels the job, waits all the same (further Ctrl-Cs held back: no registration
        outlives the call that holds the arrays) and is raised after."""
        pending = None
        for t in self._threads:
            pending = wait_through(t.join, pending, lambda _exc: self.cancel())
        self.seconds = max(self._ends, default=self._t0) - self._t0
        if pending is not None:
            raise pending

    @property
    def threads(self) -> int:
        return len(self._threads)

    @property
    def done(self) -> bool:
        """Every thread has ended (each appends its end time last)."""
        return len(self._ends) == len(self._threads)

    def _done_bytes(self, staged: bool) -> int:
        """Bytes of this job's chunks that succeeded: copied into staging buffers, or registered."""
        return sum(p.chunks[i][1] - p.chunks[i][0] for p, i in self.chunks
                   if p.ok[i] and (p.staged is not None) == staged)

    pinned_bytes = property(lambda self: self._done_bytes(False))
    staged_bytes = property(lambda self: self._done_bytes(True))


def _both_ends_pinned(runtime, lo: int, hi: int) -> bool:
    """Bytes [lo, hi) page-locked at their first and last byte (memory pinned as one by someone else)."""
    return _is_pinned(runtime, lo) and _is_pinned(runtime, hi - 1)


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


def _after_fork_in_child() -> None:
    """A forked child registered nothing of its own: the parent's registrations are forgotten (their
    finalizers then do nothing) and the lock made anew (a parent thread may have held it)."""
    REGISTRY._lock = threading.RLock()
    REGISTRY._ours = {}
    REGISTRY._seen = weakref.WeakValueDictionary()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
