"""``sim``: a stand-in GPU for machines without CUDA.

It runs exactly the scheduler code that ``cuda`` runs (the same
StreamWorker), with:

* its own memory: one numpy byte arena, carved by the same offset heap;
* in-order streams, each executed by a thread, and events between them;
* one compute engine and separate H2D / D2H / peer copy engines, each a lock,
  so kernels of different streams serialise while copies overlap them, as on
  a GPU;
* a cost model: an operation lasts at least ``flops / rate * slow`` (kernels)
  or ``bytes / bandwidth`` (copies); the thread sleeps for what the real numpy
  work did not take. ``slow`` emulates a slower GPU;
* byte counters (``bytes_in``, ``bytes_out``, ``bytes_p2p``) over its life;
* optional fault injection (``fail_at``: the n-th kernel raises), to test
  fail-over;
* peer links that can be set (``peers``).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..stats import OpRecord
from .base import Device, DeviceError, register_backend
from .numpy_kernels import KERNELS


@dataclass(frozen=True)
class SimModel:
    """Rates of a simulated GPU (defaults: small, so that tests run in milliseconds)."""

    rate: float = 4e9  # flop/s of the compute engine
    h2d: float = 8e9  # bytes/s host -> device
    d2h: float = 8e9
    p2p: float = 16e9
    slow: float = 1.0  # every duration is multiplied by this

    def kernel_time(self, flops: float) -> float:
        return flops / self.rate * self.slow

    def copy_time(self, nbytes: int, engine: str) -> float:
        return nbytes / getattr(self, engine) * self.slow


class SimEvent:
    __slots__ = ("_flag", "device")

    def __init__(self, device: "SimDevice") -> None:
        self._flag = threading.Event()
        self.device = device


class _Stream:
    """An in-order queue of operations run by one thread."""

    def __init__(self, dev: "SimDevice", idx: int) -> None:
        self.dev = dev
        self.idx = idx
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"blasx-{dev.name}-s{idx}")
        self.thread.start()

    def submit(self, fn) -> None:
        self.q.put(fn)

    def _run(self) -> None:
        while True:
            op = self.q.get()
            if op is None:
                return
            if self.dev.error is not None:
                continue  # a broken device executes nothing more; its events never fire
            try:
                op()
            except BaseException as exc:  # noqa: BLE001 - becomes the device's error, seen by its worker
                if self.dev.error is None:  # keep the first error: later ones are its consequences
                    self.dev.error = exc


@register_backend
class SimDevice(Device):
    kind = "sim"

    def __init__(self, index: int, *, nstreams: int, cache_bytes: int, name: str,
                 model: SimModel = SimModel(), fail_at: int | None = None,
                 peers: bool = True, trace: bool = True) -> None:
        super().__init__(index, nstreams=nstreams, cache_bytes=cache_bytes, name=name)
        self.model = model
        self.fail_at = fail_at
        self.peers = peers
        self.trace = trace
        self.arena: np.ndarray | None = None
        self.streams: list[_Stream] = []
        self._compute = threading.Lock()
        self._engines = {"h2d": threading.Lock(), "d2h": threading.Lock(), "p2p": threading.Lock()}
        self._records: list = []
        self._rec_lock = threading.Lock()
        self._kernels_run = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.bytes_p2p = 0

    # -- lifecycle --
    def open(self) -> None:
        heap = self._make_heap(self.cache_bytes)
        self.arena = np.empty(heap.capacity, dtype=np.uint8)
        self.streams = [_Stream(self, s) for s in range(self.n_all_streams)]

    def close(self) -> None:
        for st in self.streams:
            st.submit(None)
        for st in self.streams:
            st.thread.join()
        self.streams = []
        self.arena = None

    # -- topology --
    def can_read_from(self, other: Device) -> bool:
        return self.peers and isinstance(other, SimDevice) and other.peers

    # -- memory --
    def arena_loc(self, offset: int, rows: int, cols: int, dtype):
        dt = np.dtype(dtype)
        return np.ndarray((rows, cols), dtype=dt, buffer=self.arena, offset=offset,
                          strides=(dt.itemsize, rows * dt.itemsize))

    # -- operations --
    def _timed(self, s: int, kind: str, lock, cost: float, work, task=None, nbytes=0, flops=0.0) -> None:
        def op():
            with lock:
                t0 = time.perf_counter()
                work()
                left = cost - (time.perf_counter() - t0)
                if left > 0:
                    time.sleep(left)
                t1 = time.perf_counter()
            if self.trace and task is not None:
                rec = OpRecord(self.index, kind, t0, t1, stream=s, nbytes=nbytes, flops=flops,
                               task=task.tid, name=kind)
                with self._rec_lock:
                    self._records.append((task, rec))
        self.streams[s].submit(op)

    def copy_in(self, s, dst, src, rows, cols, dtype, task=None):
        kind, obj, where, after, home = src
        if kind == "host":
            view = _host_tile(obj, where)
            engine, rec_kind = "h2d", "h2d"
        elif kind == "peer":
            view, engine, rec_kind = where, "p2p", "p2p"
        else:
            raise DeviceError(f"sim devices cannot read {kind!r} sources")
        nbytes = dst.nbytes
        peer_ok = [True]
        if after is not None:
            # A stream waiting on an event holds no engine (as on a GPU): wait first, then copy.
            def wait_op():
                peer_ok[0] = _wait_peer(after)
            self.streams[s].submit(wait_op)

        def work():
            if not peer_ok[0]:
                # The peer broke before its fill completed: read the tile's home instead,
                # so one device's failure never corrupts or stalls another.
                dst[...] = _host_tile(*home)
                self.bytes_in += nbytes
                return
            dst[...] = view
            if engine == "p2p":
                self.bytes_p2p += nbytes
            else:
                self.bytes_in += nbytes
        self._timed(s, rec_kind, self._engines[engine], self.model.copy_time(nbytes, engine), work,
                    task, nbytes)

    def copy_out(self, s, operand, ref, src, task=None):
        view = _host_tile(operand, ref)
        nbytes = src.nbytes

        def work():
            view[...] = src
            self.bytes_out += nbytes
        self._timed(s, "d2h", self._engines["d2h"], self.model.copy_time(nbytes, "d2h"), work, task, nbytes)

    def run_step(self, s, step, call, a, b, c, task=None):
        flops = call.step_flops(step)
        self._kernels_run += 1
        if self.fail_at is not None and self._kernels_run >= self.fail_at:
            n = self._kernels_run

            def work():
                raise DeviceError(f"{self.name}: injected fault at kernel {n}")
        else:
            kern = KERNELS[step.kernel]

            def work():
                kern(step, call.scalars, a, b, c)
        self._timed(s, "kernel", self._compute, self.model.kernel_time(flops), work, task, 0, flops)

    def record(self, s):
        ev = SimEvent(self)
        self.streams[s].submit(ev._flag.set)
        return ev

    def wait(self, s, event):
        def op():
            while not event._flag.wait(0.05):
                if event.device.error is not None:
                    raise DeviceError(f"{self.name}: waited on an event of broken {event.device.name}")
        self.streams[s].submit(op)

    def done(self, event) -> bool:
        if event._flag.is_set():
            return True
        if self.error is not None:
            raise DeviceError(f"{self.name} failed: {self.error!r}") from self.error
        return False

    def sync(self, event) -> None:
        while not event._flag.wait(0.05):
            if self.error is not None:
                raise DeviceError(f"{self.name} failed: {self.error!r}") from self.error

    def take_records(self) -> list:
        with self._rec_lock:
            out, self._records = self._records, []
        return out


def _wait_peer(event: SimEvent) -> bool:
    """Wait for a peer's event; False if the peer broke before it fired."""
    while not event._flag.wait(0.05):
        if event.device.error is not None:
            return event._flag.is_set()
    return True


def _host_tile(operand, ref) -> np.ndarray:
    return operand.array[ref.r0:ref.r0 + ref.rows, ref.c0:ref.c0 + ref.cols]
