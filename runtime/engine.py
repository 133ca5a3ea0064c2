"""The blasx scheduler: a long-lived multi-device service (the BLASX runtime).

This docstring is the design doc. It follows Algorithm 1 of the BLASX paper
(``../shared/seeds/003_5f0983b53bc3aac8.txt``), with the tile caches of
Section IV-B, the scheduling infrastructure of Section IV-C (Fig. 4), the
stream overlap of IV-D and the heap of IV-E.

Policy
------
* A call (``gemm``, later every level-3 routine) is split by a pure planner
  into tasks, one per output tile C_ij (Eq. 2 tasks in all), each a list of
  k-steps. Tasks go to a **global queue** that never blocks (``queue.py``).
  Calls whose operands all live in host memory go to the queue every worker
  serves; calls with CuPy operands go to the queue only CUDA workers serve.
* One **worker thread per device** (``worker.py``) keeps a **reservation
  station** of ``streams`` tasks. It pulls from the queue when it has room
  (demand-driven balance: a device pulls as fast as it finishes, so slow
  devices get fewer tasks), steals the newest task of the most loaded
  station when the queue is empty, and starts the station's task of highest
  **Eq. 3 priority** (2 per input tile in its L1, 1 per tile in a peer's L1);
  an ``urgent`` task (TRSM's inversions of diagonal blocks, which read no A/B
  tile and which later tasks wait for) goes first.
  **Fair share of small calls**: a stream-device worker holding
  max(1, tasks // stream workers) of a call leaves the rest to a stream peer
  with room that holds less, unless it has nothing else to run
  (``Worker._leave_for_peer``); otherwise a call smaller than one device's
  station + streams all goes to the first worker to wake. Nothing is left
  for the CPU worker, which takes work by demand (``cpu=True``) or by its
  admission rule (auto mode, below).
* Each stream runs one task; a worker issues one k-step of every active task
  in turn (interleaving over k), with at most ``2 * streams`` tasks in flight
  (``Knobs.commit_steps`` adds a horizon in flops: a started task cannot move
  to another device, so what each device has committed when the queues run
  dry is the call's tail).
* Tiles are read through the **two-level cache**: L1 is the device's ALRU
  (Algorithm 2) over its preallocated heap; L2 is the other devices' L1,
  found through the **MESI-X directory** (``coherence.py``) and copied over
  peer links. A peer's line still being filled from the host is read (after
  its fill) only if the host bytes ahead of it on the peer's link do not
  exceed this device's own host backlog plus the tile
  (``Knobs.peer_wait_if_sooner``); else the tile is loaded here, so devices
  that start together use both host links. A written C tile is M and is
  written back at once (-> I).
* The **CPU worker**, when enabled, takes whole tasks and solves each with
  the host BLAS, its thread count limited by threadpoolctl so every GPU
  worker keeps a core. With ``cpu=True`` it takes them by demand. In **auto
  mode** (``configure(cpu=None)`` beside CUDA GPUs, ``cpu="auto"`` beside
  any) it takes a task, from the queue or by stealing, only when
  ``admission.py``'s rule predicts that it finishes it before the GPUs
  would finish the rest of the call (rates measured per worker over its
  finished tasks, the CPU's seeded by a probe); never a task of a call with
  dependencies or of a call the GPUs can hold at once. When the CPU is the
  only device, a call's tasks run in the calling thread instead
  (``Engine.inline``): the hand-off to a worker thread and back cost
  ~0.4 ms a call, 20x numpy's time at N=64.

Invariants
----------
1. Every task of a call is accounted exactly once (done, cancelled or
   abandoned); a call returns only then, so no device still writes into the
   caller's memory after ``submit`` returns or raises.
2. A cache line's reader count is the number of issued, unfinished
   operations that read it; only lines with no readers are evicted, and the
   heap block of a line or of a C buffer is freed only by its device's worker
   after the event that ends its last use.
3. A tile key begins with a token that is never reused. Tokens of host
   arrays that may be written name one call only; read-only arrays (whose
   whole base chain is read-only) keep their token, and cached tiles, for
   their life. So no stale tile can be read.
4. Cross-device waits always target an event that was recorded before the
   wait is issued (a peer's fill event, read under the directory lock while
   the reader holds a reader count on that line), so waits follow issue
   order and cannot form a cycle. If the peer breaks before its fill
   completes, the sim copies from the tile's home instead, so one device's
   failure neither stalls nor corrupts another.
5. No exception escapes a worker: it is attached to the calls whose tasks
   the worker held. Those tasks are handed to live workers, unless their
   write-back was in flight and the task reads its own tile (``beta != 0``,
   or an in-place TRMM), or a write-after-read gate already let a tile it
   read be overwritten (``Call.recompute_safe``: in-place TRMM overwrites a
   tile once its readers' *kernels* are done), in which case the call fails
   loudly. With no live worker able to run a call, it fails.
6. Workers are non-daemon threads; ``shutdown`` puts one sentinel per worker
   on the queue and joins them all (and the sim stream threads). An inline
   engine (the CPU alone) starts no thread at all.
7. No finalizer waits for a lock: a finalizer runs wherever the garbage
   collector frees its object, which may be inside a critical section of the
   same lock in the same thread. The locks finalizers take are re-entrant
   (host registrations, read-only tokens), and ``retire_base`` only tries the
   directory lock, leaving a base it cannot retire now in ``_retired``.

State (each field has one owner)
--------------------------------
``devices``, ``workers``, ``stations``
    Fixed at start. A station is pushed/popped by its worker and stolen from
    by others under its own lock.
``queues``
    ``{"any": TaskQueue, "gpu": TaskQueue}``; any thread puts, workers get.
``directory``
    The MESI-X directory and every device's ALRU metadata, under
    ``directory.lock``; heap blocks belong to their device's worker.
``work_generation``, ``_cv``
    Bumped and notified when work appears (submit, re-queue, failure,
    shutdown); idle workers sleep on ``_cv`` until it changes.
``_calls``
    Calls in progress, so a failure with no live worker can fail them all.
``_retired``
    Bases of collected read-only arrays whose tiles are still to be marked
    dead (invariant 7); any thread appends, the holder of the directory
    lock drains (``retire_base``, and every ``submit``).
``_switching``
    Python's switch interval while calls are in flight (``switching.py``;
    off unless ``EngineConfig.switch_interval`` is set).
``admission``
    The auto-mode CPU worker's rule and its rate meter (``admission.py``,
    which lists their fields), or None (no CPU worker in auto mode). Calls
    of an engine that has one report every task start and finish to its
    meter and keep their flops waiting / running (``Call.meter_with``).
Per worker (``worker.py``), written by that worker alone
    ``slots`` (the task on each stream), ``pending`` (events per stream),
    ``inflight`` / ``inflight_of`` (tasks started and not retired, in all
    and per call), ``h2d_issued`` / ``h2d_done`` (host bytes loaded, and
    retired). Peers read ``inflight_of`` and the station length for the
    fair-share rule and ``h2d_*`` for the peer-wait rule, without a lock:
    a stale value only costs balance, never correctness.
"""

from __future__ import annotations

import collections
import os
import threading
import traceback
import weakref
from dataclasses import dataclass, field

from .admission import Admission
from .call import Call
from .coherence import Directory
from .devices.base import DeviceError
from .knobs import Knobs
from .queue import TaskQueue
from .station import ReservationStation
from .switching import SwitchInterval
from .worker import CpuWorker, StreamWorker


def _reads_own_tile(task) -> bool:
    """The task reads the memory it writes: C itself (beta != 0), or its tile of B in place."""
    if task.load_c:
        return True
    tokens, c = task.call.tokens, task.c
    return any(tokens[r.slot] == tokens[c.slot] and (r.bi, r.bj) == (c.bi, c.bj) for r in task.input_tiles())


class EngineClosed(RuntimeError):
    """The engine was shut down before a call's tasks were queued: nothing of the call ran, and
    it may run on another engine (``blasx.dispatch.submit_planned`` does so on the new one)."""


class _Sentinel:
    def __repr__(self) -> str:
        return "<blasx shutdown sentinel>"


@dataclass
class EngineConfig:
    devices: list  # Device objects, worker index == position
    tile: int | None = None  # None: choose per call
    streams: int = 4
    bind_threads: bool = True
    knobs: Knobs = field(default_factory=Knobs.from_env)
    switch_interval: float | None = None  # Python's switch interval while calls run (switching.py)


class Engine:
    SENTINEL = _Sentinel()

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.devices = list(config.devices)
        if not self.devices:
            raise ValueError("devices: got an empty list, need at least one device")
        for d in self.devices:
            d.knobs = config.knobs
        self.directory = Directory(len(self.devices))
        self.queues = {"any": TaskQueue(), "gpu": TaskQueue()}
        self.stations = [ReservationStation(d.index, max(1, d.nstreams)) for d in self.devices]
        self.workers = []
        self.work_generation = 0
        self._cv = threading.Condition()
        self._lock = threading.Lock()
        self._retired: collections.deque[int] = collections.deque()  # retire_base's backlog
        self._calls: "weakref.WeakSet[Call]" = weakref.WeakSet()
        self._started = False
        self._closed = False
        self.failures: list[tuple[str, BaseException]] = []
        self._switching = SwitchInterval(config.switch_interval)
        # The CPU worker's admission rule (admission.py), when a CPU device in auto mode sits
        # beside stream devices; None: the CPU worker (if any) takes work by demand.
        auto_cpu = any(not d.streamed and getattr(d, "auto", False) for d in self.devices)
        self.admission = Admission(self) if auto_cpu and any(d.streamed for d in self.devices) else None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            if self._closed:
                raise RuntimeError("this blasx engine was shut down; blasx.configure() makes a new one")
            if self.inline:  # calls run in their own threads: no worker thread to start
                self.devices[0].open()
                self._started = True
                return
            ncores = os.cpu_count() or 1
            for d, st in zip(self.devices, self.stations):
                core = (d.index % ncores) if (self.config.bind_threads and d.binds_thread and ncores > len(self.devices)) else None
                cls = StreamWorker if d.streamed else CpuWorker
                self.workers.append(cls(self, d, st, core))
            for w in self.workers:
                w.start()
            for w in self.workers:
                w.opened.wait()
            self._started = True
        errors = [(w.dev.name, w.open_error) for w in self.workers if w.open_error is not None]
        if errors and not any(w.alive for w in self.workers):
            self.shutdown()
            name, exc = errors[0]
            raise DeviceError(f"no device could start; {name}: {exc!r}") from exc

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            started = self._started
        if started and self.inline:
            self.devices[0].close()
        elif started:
            self.queues["any"].put_many([self.SENTINEL] * len(self.workers))
            self._poke()
            for w in self.workers:
                w.join()

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------ worker services
    def queues_for(self, worker):
        if worker.dev.reads_device_arrays:
            return (self.queues["gpu"], self.queues["any"])
        return (self.queues["any"],)

    def stations_for(self, worker):
        return [st for st, w in zip(self.stations, self.workers) if w is not worker]

    def can_run(self, worker, call: Call) -> bool:
        return worker.alive and (not call.device_only or worker.dev.reads_device_arrays)

    def wait_for_work(self, seen_generation: int, poll: float | None = None) -> None:
        """Sleep until work changes; at most ``poll`` seconds (None: no bound), or 2 ms while a
        station holds tasks (they may be stolen)."""
        with self._cv:
            if self.work_generation != seen_generation:
                return
            # Tasks waiting in another station may be stolen: look again soon.
            timeout = 0.002 if any(len(st) for st in self.stations) else poll
            self._cv.wait(timeout)

    def _poke(self) -> None:
        with self._cv:
            self.work_generation += 1
            self._cv.notify_all()

    # ------------------------------------------------------------ calls
    def submit(self, call: Call) -> None:
        """Run ``call`` to completion on the workers; raise its error, if any."""
        self.start()
        if self._retired:
            self._drain_retired()
        if not self.inline:  # workers run it: they may fail, and need waking for dependents
            if not self._runnable(call):
                raise DeviceError(self._unrunnable_message(call))
            self._calls.add(call)
            if call.has_deps:
                call.on_finish = self._poke  # finished tasks free their dependents: wake idle workers
            if self.admission is not None:
                call.meter_with(self.admission.meter)  # rates and the call's flops left, for the CPU
        call.stats.start()
        try:
            if self.inline:
                self._run_inline(call)
            else:
                with self._switching:
                    self._enqueue(call)
                    while not call.wait(0.5):
                        if not self._runnable(call):
                            self._fail_unrunnable()
        finally:
            for op in call.operands:
                if op.token[0] < 0:  # per-call token: its tiles may never be read again
                    self.retire_base(op.token[0])
        if call.error is not None:
            err = call.error
            raise DeviceError(f"{call.name} failed: {err}") from err

    def _enqueue(self, call: Call) -> None:
        """Queue ``call``'s tasks, unless shutdown has begun: the workers stop at its sentinels,
        so tasks queued after them would never run and the caller would wait forever (seen:
        a call racing ``blasx.configure()``). Under the lock that shutdown() sets ``_closed``
        with, so the tasks go in before the sentinels or not at all (EngineClosed)."""
        with self._lock:
            if self._closed:
                raise EngineClosed(f"{call.name}: this blasx engine was shut down (configure() or shutdown() "
                                   f"ran) before the call was queued; nothing of it ran")
            self.queue_of(call).put_many(call.tasks)
        self._poke()

    @property
    def inline(self) -> bool:
        """The host CPU is the only device: calls run in the calling thread (see the policy)."""
        return len(self.devices) == 1 and not self.devices[0].streamed

    def _run_inline(self, call: Call) -> None:
        """Run ``call``'s tasks on the CPU device in the calling thread, in plan order (which
        puts every task after its dependencies). An error fails this call only; every task is
        accounted either way (invariant 1)."""
        dev = self.devices[0]
        tasks = iter(call.tasks)
        try:
            for task in tasks:
                if not call.is_ready(task):
                    raise RuntimeError(f"task {task.tid} of {call.name} is planned before a task it depends on")
                task.worker = dev.index
                call.started(task)
                try:
                    dev.run_task(task)
                except BaseException:
                    call.account(task)
                    raise
                call.account(task, dev.index)
        except BaseException as exc:  # noqa: BLE001 - raised to the caller by submit, as from a worker
            exc.blasx_traceback = traceback.format_exc()
            call.fail(exc)
            for task in tasks:
                call.account(task)

    def retire_base(self, base: int) -> None:
        """Tiles of token base ``base`` may never be read again (a read-only array died).

        Called by a finalizer, so in whatever frame the garbage collector frees the array, which
        may hold the directory lock in this very thread: it never waits for that lock. A base it
        cannot retire now waits in ``_retired`` for the next one that can, at the latest the next
        call's submission (a base is never reused, so its lines are only dead a little later)."""
        self._retired.append(base)
        self._drain_retired()

    def _drain_retired(self) -> None:
        lock = self.directory.lock
        if not lock.acquire(blocking=False):
            return
        try:
            while self._retired:
                self.directory.retire_base(self._retired.popleft())
        finally:
            lock.release()

    def _runnable(self, call: Call) -> bool:
        return any(self.can_run(w, call) for w in self.workers)

    def _unrunnable_message(self, call: Call) -> str:
        live = [w.dev.name for w in self.workers if w.alive]
        if not live:
            dead = "; ".join(f"{n}: {e!r}" for n, e in self.failures) or "none started"
            return f"no live device left to run {call.name} (failures: {dead})"
        return f"{call.name} has CuPy operands but no live CUDA device can run it (live devices: {live})"

    # ------------------------------------------------------------ failures
    def worker_failed(self, worker, exc: BaseException, held) -> None:
        """Hand a broken worker's tasks on, or fail their calls (invariant 5)."""
        with self._lock:
            worker.alive = False
            self.failures.append((worker.dev.name, exc))
            for task, writeback_issued in held:
                call = task.call
                if call.failed:
                    call.account(task)
                elif writeback_issued and _reads_own_tile(task):
                    self._fail_call(call, DeviceError(
                        f"{worker.dev.name} failed while writing back tile {task.c[1:3]} of {call.name}; "
                        f"the task reads that tile (beta != 0, or in place), so it cannot be recomputed "
                        f"safely from a partly written tile: {exc!r}"), exc)
                    call.account(task)
                elif not call.recompute_safe(task):
                    self._fail_call(call, DeviceError(
                        f"{worker.dev.name} failed before finishing tile {task.c[1:3]} of {call.name}, whose old "
                        f"tiles have since been overwritten in place (its computed result let them be), so it "
                        f"cannot be recomputed: {exc!r}"), exc)
                    call.account(task)
                elif not self._runnable(call):
                    self._fail_call(call, DeviceError(self._unrunnable_message(call)), exc)
                    call.account(task)
                else:
                    # In front: later tasks of the call may depend on it (TRSM).
                    task.worker = -1
                    call.unstarted(task)
                    self.queue_of(call).put_front(task)
        self._fail_unrunnable()
        self._poke()

    def queue_of(self, call: Call):
        """The global queue of a call's tasks: CUDA workers alone serve calls with CuPy operands."""
        return self.queues["gpu" if call.device_only else "any"]

    def requeue(self, task) -> None:
        """Put a task a worker gave back (unstarted) in front of its queue and wake the workers."""
        self.queue_of(task.call).put_front(task)
        self._poke()

    def _fail_call(self, call: Call, err: BaseException, cause: BaseException | None) -> None:
        if cause is not None and err.__cause__ is None:
            err.__cause__ = cause
        call.fail(err)

    def _fail_unrunnable(self) -> None:
        """Fail and drain every call no live worker can run, so nobody waits forever."""
        for call in list(self._calls):
            if not call.failed and not self._runnable(call):
                cause = self.failures[-1][1] if self.failures else None
                self._fail_call(call, DeviceError(self._unrunnable_message(call)), cause)
        dead_stations = [st for st, w in zip(self.stations, self.workers) if not w.alive]
        for st in dead_stations:
            for t in st.drain():
                if t.call.failed:
                    t.call.account(t)
                else:
                    self.queue_of(t.call).put_front(t)
        if not any(w.alive for w in self.workers):
            for q in self.queues.values():
                for t in q.remove_if(lambda t: t is not self.SENTINEL):
                    t.call.account(t)
