"""The device contract: a shared base, a stream protocol, a host protocol, and a registry.

A backend is a :class:`StreamDevice` (``cuda``, ``sim``: own memory and streams, driven by
:class:`~blasx.runtime.worker.StreamWorker`) or a :class:`HostDevice` (``cpu``: whole tasks in the
host operands, driven by :class:`~blasx.runtime.worker.CpuWorker` or inline by the engine). Hooks
run on the device's worker thread (``open``/``close`` too, so CUDA contexts bind to it), except
``prepare_call``/``finish_call``, on the calling thread. Locations (``Loc``, from ``arena_loc`` or
``array_loc``) and events are opaque to the scheduler; ``done`` and ``sync`` raise
:class:`DeviceError` once the device is broken, so no worker waits forever on a dead device.
"""

from __future__ import annotations

import contextlib
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from ...heap import OffsetHeap
from ..knobs import Knobs


class DeviceError(RuntimeError):
    """A device failed; its unfinished work is handed to the others or fails loudly."""


# ---------------------------------------------------------------- copy sources (copy_in's ``src``)

@dataclass(frozen=True, slots=True)
class HostSource:
    """Tile ``ref`` of the host operand ``operand`` (``Operand.array`` is a numpy array)."""

    operand: Any
    ref: Any


@dataclass(frozen=True, slots=True)
class ArraySource:
    """Tile ``ref`` of ``operand``, an array in another device's memory, read over the peer link."""

    operand: Any
    ref: Any


@dataclass(frozen=True, slots=True)
class DerivedSource:
    """Tile ``ref`` of the derived ``operand`` (runtime/derived.py), made on the device from ``source``,
    the call's operand it derives from (host or device memory): ``operand.derive`` says how."""

    operand: Any
    ref: Any
    source: Any


@dataclass(frozen=True, slots=True)
class PeerSource:
    """A cache line of peer ``device`` at ``loc``. ``after``: the peer's event that ends the line's
    fill (None: filled); the copy follows it. The tile's home, tile ``ref`` of ``operand``, is for a
    backend that sees the peer break before that event (sim): it reads the home instead."""

    device: Any
    loc: Any
    after: Any
    operand: Any
    ref: Any


# ---------------------------------------------------------------- the shared base

class Device(ABC):
    """What the engine needs of every device: identity, lifecycle and the per-call hooks."""

    kind: ClassVar[str] = "base"
    #: True for a StreamDevice (own memory and streams), False for a HostDevice.
    streamed: ClassVar[bool]
    #: True if the device can read CuPy arrays in place or over a peer link.
    reads_device_arrays: ClassVar[bool] = False
    #: True if its worker thread should be pinned to a core (Algorithm 1, line 9).
    binds_thread: ClassVar[bool] = False
    #: The engine's scheduling switches (set by the engine; the kernels read theirs).
    knobs: Knobs = Knobs()

    def __init__(self, index: int, *, name: str, nstreams: int = 1) -> None:
        if nstreams < 1:
            raise ValueError(f"streams: got {nstreams!r}, need an int >= 1")
        self.index = index  # worker index in the engine
        self.name = name
        self.nstreams = nstreams  # tasks it runs at once (its station holds as many)
        self.error: BaseException | None = None  # set once the device is broken

    @abstractmethod
    def open(self) -> None:
        """Take the device's resources (worker thread)."""

    @abstractmethod
    def close(self) -> None:
        """Release everything ``open`` took; must be safe after a failure."""

    def quiesce(self) -> None:
        """Wait (bounded) for the work already issued to the device: a failing worker's, before its tasks go to
        other devices or fail their calls. Nothing to wait for here."""

    def is_device_error(self, exc: BaseException) -> bool:
        """``exc``, raised by one of this device's hooks, means the device is broken (besides
        ``DeviceError``, which always does); anything else fails only the call it came from."""
        return False

    # -- per call, on the calling thread --
    def prepare_call(self, call: Any) -> None:
        """Get ready for a call before its tasks are queued (pin host memory, limit threads)."""

    def finish_call(self, call: Any) -> None:
        """Undo what ``prepare_call`` did once the call is over, successful or not; also runs
        after a ``prepare_call`` that an interrupt cut short."""

    def bind_thread(self, core: int | None) -> None:
        """Pin the calling worker thread to a core (Algorithm 1, line 9) where possible."""
        if core is not None and hasattr(os, "sched_setaffinity"):
            with contextlib.suppress(OSError):  # fewer cores than workers, or a restricted cpuset: unpinned
                os.sched_setaffinity(0, {core})

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


# ---------------------------------------------------------------- host execution

class HostDevice(Device):
    """The host computing whole tasks in place in the host operands: no arena, copies or streams."""

    streamed = False

    @abstractmethod
    def run_task(self, task: Any) -> None:
        """Solve ``task``'s C tile in place (every step, then the call's epilogue), on this thread."""

    def engage(self) -> None:
        """A task or probe is about to run here (e.g. limit the BLAS threads now)."""

    @abstractmethod
    def probe(self, dtype) -> tuple[float, float]:
        """(flops, seconds) of a small GEMM in ``dtype``: the admission rule's first rate estimate."""


# ---------------------------------------------------------------- stream devices

class StreamDevice(Device):
    """A device with its own memory (one arena carved by an :class:`OffsetHeap`) and in-order
    streams: ``nstreams`` compute streams, then one copy stream each for host loads, peer loads
    and write-backs, so a copy never waits behind a kernel of the stream that needs it next."""

    streamed = True
    #: Tile kernels that can write their result into another tile (``run_step``'s ``out``)
    #: instead of over ``c``: a worker then gives them a fresh block, which becomes the task's C.
    OUT_OF_PLACE: ClassVar[frozenset] = frozenset({"invmm"})

    def __init__(self, index: int, *, nstreams: int, cache_bytes: int, name: str) -> None:
        super().__init__(index, name=name, nstreams=nstreams)
        self.h2d_stream = nstreams
        self.p2p_stream = nstreams + 1
        self.d2h_stream = nstreams + 2
        self.n_all_streams = nstreams + 3
        self.cache_bytes = cache_bytes
        self.heap: OffsetHeap | None = None

    QUIESCE_SECONDS = 10.0  # the longest a failing worker waits for its streams' work

    def quiesce(self) -> None:
        """Wait, at most QUIESCE_SECONDS, for the work issued on every stream: a write-back still queued must not
        land after another device's redone tile, or in C after its call has returned. A broken device's error
        ends the wait (its work is lost anyway)."""
        deadline = time.monotonic() + self.QUIESCE_SECONDS
        events = [self.record(s) for s in range(self.n_all_streams)]
        try:
            for ev in events:
                while not self.done(ev) and time.monotonic() < deadline:
                    time.sleep(0.001)
        finally:
            for ev in events:
                self.release_event(ev)

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

    # -- topology --
    def can_read_from(self, other: Device) -> bool:
        """True if this device can copy directly from ``other``'s memory (peer link)."""
        return False

    def holds_array(self, operand: Any) -> bool:
        """True if ``operand`` lives in this device's memory (use its tiles in place)."""
        return False

    # -- locations --
    @abstractmethod
    def arena_loc(self, offset: int, rows: int, cols: int, dtype) -> Any:
        """The Loc of a ``rows x cols`` tile at heap offset ``offset`` (``ld = rows``)."""

    def array_loc(self, operand: Any, ref: Any) -> Any:
        """The Loc of tile ``ref`` of an operand this device holds (``holds_array``)."""
        raise DeviceError(f"{self.name}: holds no operand arrays")

    # -- asynchronous operations on stream ``s`` --
    @abstractmethod
    def copy_in(self, s: int, dst: Any, src: HostSource | PeerSource | ArraySource | DerivedSource, rows: int,
                cols: int, dtype, task: Any = None) -> None:
        """Fill ``dst`` (a Loc of this device) from ``src`` (a DerivedSource: make the tile there)."""

    @abstractmethod
    def copy_out(self, s: int, operand: Any, ref: Any, src: Any, task: Any = None) -> None:
        """Write the finished tile at ``src`` back to its home, tile ``ref`` of ``operand``."""

    @abstractmethod
    def run_step(self, s: int, step: Any, call: Any, a: Any, b: Any, c: Any, task: Any = None,
                 out: Any = None) -> None:
        """Launch the step's tile kernel (``step.kernel``) with scalars from ``call``; with ``out``
        (a kernel of ``OUT_OF_PLACE`` only) the result goes there and ``c`` is only read."""

    # -- events --
    @abstractmethod
    def record(self, s: int) -> Any:
        """An event that completes when everything issued so far on ``s`` has."""

    @abstractmethod
    def wait(self, s: int, event: Any) -> None:
        """Make stream ``s`` wait for ``event`` (an event of this device or of a peer)."""

    @abstractmethod
    def done(self, event: Any) -> bool:
        """True once ``event`` completed; DeviceError if the device broke."""

    @abstractmethod
    def sync(self, event: Any) -> None:
        """Block until ``event`` completes; DeviceError if the device broke."""

    def release_event(self, event: Any) -> None:
        """The scheduler no longer refers to ``event``: the backend may reuse it."""

    # -- tracing --
    def begin_op(self, s: int) -> Any:
        """Mark the start of a traced operation; returns a handle for ``end_op`` (None: not traced)."""

    def end_op(self, s: int, handle: Any, kind: str, nbytes: int, flops: float, task: Any) -> None:
        """Mark the end of a traced operation."""

    def take_records(self) -> list:
        """Finished (stats, OpRecord) pairs since the last call: each record with its call's collector
        (``task.call.stats``). A backend keeps the collector, not the task: a record still open after
        its call ends must not keep the call's arrays alive."""
        return []


_BACKENDS: dict[str, type] = {}


def register_backend(cls: type) -> type:
    """Class decorator: make a backend selectable by its ``kind``."""
    _BACKENDS[cls.kind] = cls
    return cls


def backend(kind: str) -> type:
    """The backend class registered as ``kind``."""
    try:
        return _BACKENDS[kind]
    except KeyError:
        raise ValueError(f"devices: unknown backend {kind!r}; known: {sorted(_BACKENDS)}") from None


def backends() -> dict[str, type]:
    """Every registered backend, by kind (``cuda`` only once its module is imported)."""
    return dict(_BACKENDS)
