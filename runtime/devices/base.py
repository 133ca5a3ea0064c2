"""The device backend contract: a small base class with hooks.

A backend is a stream device (``cuda``, ``sim``) driven by the shared
:class:`~blasx.runtime.worker.StreamWorker`, or the host itself (``cpu``)
driven by :class:`~blasx.runtime.worker.CpuWorker`. The scheduler never
looks inside a backend; it calls these hooks, always from the device's own
worker thread (``open``/``close`` too, so CUDA contexts and handles are
bound to that thread).

Locations (``Loc``) are opaque to the scheduler: a backend makes them with
``arena_loc`` (a heap block of its arena, column-major with ``ld = rows``) or
``array_loc`` (a tile of an operand that already lives on this device, used
in place), and receives them back in ``copy_in``/``copy_out``/``run_step``.
Events are opaque too; ``done`` and ``sync`` raise
:class:`DeviceError` once the device is broken, so a worker never waits
forever on a device that died.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from ...heap import OffsetHeap
from ..knobs import Knobs


class DeviceError(RuntimeError):
    """A device failed; its unfinished work is handed to the others or fails loudly."""


class Device(ABC):
    kind: ClassVar[str] = "base"
    #: True for devices with their own memory and streams (driven by StreamWorker).
    streamed: ClassVar[bool] = True
    #: True if the device can read CuPy arrays in place or over a peer link.
    reads_device_arrays: ClassVar[bool] = False
    #: True if its worker thread should be pinned to a core (Algorithm 1, line 9).
    binds_thread: ClassVar[bool] = False
    #: The engine's scheduling switches (set by the engine; the kernels read theirs).
    knobs: Knobs = Knobs()

    def __init__(self, index: int, *, nstreams: int, cache_bytes: int, name: str) -> None:
        if nstreams < 1:
            raise ValueError(f"streams: got {nstreams!r}, need an int >= 1")
        self.index = index  # worker index in the engine
        self.nstreams = nstreams  # compute streams 0 .. nstreams-1, one task each
        # Copy streams after them: host loads, peer loads and write-backs each queue on
        # their own, so a copy never waits behind a kernel of the stream that needs it
        # next (prefetch), and a peer copy waiting for a peer's fill never holds up host loads.
        self.h2d_stream = nstreams
        self.p2p_stream = nstreams + 1
        self.d2h_stream = nstreams + 2
        self.n_all_streams = nstreams + 3
        self.cache_bytes = cache_bytes
        self.name = name
        self.heap: OffsetHeap | None = None
        self.error: BaseException | None = None  # set once the device is broken

    # -- lifecycle (worker thread) --
    @abstractmethod
    def open(self) -> None:
        """Allocate the arena (one allocation, Section IV-E), streams and handles."""

    @abstractmethod
    def close(self) -> None:
        """Release everything ``open`` took; must be safe after a failure."""

    def _make_heap(self, nbytes: int, alignment: int = 256) -> OffsetHeap:
        nbytes -= nbytes % alignment
        self.heap = OffsetHeap(nbytes, alignment)
        return self.heap

    def cache_capacity(self) -> int:
        """Bytes of the tile-cache heap (known once opened)."""
        return self.heap.capacity if self.heap is not None else self.cache_bytes

    def cache_limit(self) -> int | None:
        """Bytes the tile cache may hold now, below its capacity when other allocations took
        device memory since it opened (None: all of it)."""
        return None

    def is_device_error(self, exc: BaseException) -> bool:
        """``exc``, raised by one of this device's hooks, means the device is broken (besides
        ``DeviceError``, which always does); anything else fails only the call it came from."""
        return False

    # -- per call, on the calling thread --
    def prepare_call(self, call: Any) -> None:
        """Get ready for a call before its tasks are queued (pin host memory, limit threads)."""

    def finish_call(self, call: Any) -> None:
        """Undo ``prepare_call`` once the call is over, successful or not."""

    # -- topology --
    def can_read_from(self, other: "Device") -> bool:
        """True if this device can copy directly from ``other``'s memory (peer link)."""
        return False

    def holds_array(self, operand: Any) -> bool:
        """True if ``operand`` lives in this device's memory (use its tiles in place)."""
        return False

    # -- memory locations --
    @abstractmethod
    def arena_loc(self, offset: int, rows: int, cols: int, dtype) -> Any: ...

    def array_loc(self, operand: Any, ref: Any) -> Any:
        raise NotImplementedError(f"{self.kind} devices hold no operand arrays")

    # -- asynchronous operations on stream ``s`` --
    @abstractmethod
    def copy_in(self, s: int, dst: Any, src: Any, rows: int, cols: int, dtype) -> None:
        """Fill ``dst`` (a Loc of this device) from ``src``: ("host", operand, ref),
        ("peer", device, loc) or ("array", operand, ref) for an array on another device."""

    @abstractmethod
    def copy_out(self, s: int, operand: Any, ref: Any, src: Any) -> None:
        """Write the finished tile at ``src`` back to its home in ``operand``."""

    #: Tile kernels that can write their result into another tile (``run_step``'s ``out``)
    #: instead of over ``c``: a worker then gives them a fresh block, which becomes the task's C.
    OUT_OF_PLACE: frozenset = frozenset({"invmm"})

    @abstractmethod
    def run_step(self, s: int, step: Any, call: Any, a: Any, b: Any, c: Any, task: Any = None,
                 out: Any = None) -> None:
        """Launch the step's tile kernel (``step.kernel``) with scalars from ``call``; with ``out``
        (a kernel of ``OUT_OF_PLACE`` only) the result goes there and ``c`` is only read."""

    @abstractmethod
    def record(self, s: int) -> Any:
        """An event that completes when everything issued so far on ``s`` has."""

    @abstractmethod
    def wait(self, s: int, event: Any) -> None:
        """Make stream ``s`` wait for ``event`` (an event of this device)."""

    def release_event(self, event: Any) -> None:
        """The scheduler no longer refers to ``event``: the backend may reuse it."""

    @abstractmethod
    def done(self, event: Any) -> bool: ...

    @abstractmethod
    def sync(self, event: Any) -> None: ...

    # -- profiling --
    def begin_op(self, s: int) -> Any:
        """Mark the start of a traced operation; returns a handle for ``end_op``."""
        return None

    def end_op(self, s: int, handle: Any, kind: str, nbytes: int, flops: float, task: Any) -> None:
        """Mark the end of a traced operation."""

    def take_records(self) -> list:
        """Finished (task, OpRecord) pairs since the last call, for the stats."""
        return []

    # -- misc --
    def bind_thread(self, core: int | None) -> None:
        """Pin the calling worker thread to a core (Algorithm 1, line 9) where possible."""
        if core is None or not hasattr(os, "sched_setaffinity"):
            return
        try:
            os.sched_setaffinity(0, {core})
        except OSError:
            pass  # fewer cores than workers, or a restricted cpuset: run unpinned

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


_BACKENDS: dict[str, type] = {}


def register_backend(cls: type) -> type:
    """Class decorator: make a backend selectable by its ``kind``."""
    _BACKENDS[cls.kind] = cls
    return cls


def backend(kind: str) -> type:
    try:
        return _BACKENDS[kind]
    except KeyError:
        raise ValueError(f"devices: unknown backend {kind!r}; known: {sorted(_BACKENDS)}") from None
