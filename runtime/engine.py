"""The blasx scheduler: a long-lived multi-device service (the BLASX runtime).

This docstring is the design doc. It follows Algorithm 1 of the BLASX paper (Wang et al., "BLASX: A High
Performance Level-3 BLAS Library for Heterogeneous Multi-GPU Computing", ICS 2016): the tile caches of
Section IV-B, the scheduling of IV-C (Fig. 4), the stream overlap of IV-D, the heap of IV-E.

Policy
------
* A pure planner splits a call into tasks (one per output tile C_ij, each a list of k-steps) on a
  non-blocking **global queue** (``queue.py``); tasks with CuPy operands go to one only CUDA workers serve.
* One **worker thread per device** (``worker_base.py``; ``worker.py`` and ``assign.py`` for stream devices,
  ``cpu_worker.py`` for the CPU) keeps a **reservation station** of ``nstreams`` tasks: it pulls while it has
  room (demand-driven balance), and past that while no task it holds is ready (tasks waiting on dependencies
  must not starve those they wait for). If its station is still empty after pulling, it steals the newest task
  it can run from the station holding the most waiting flops, even while the queue holds tasks left for others
  (below); it starts the task of highest **Eq. 3 priority** (2 per input tile in its L1, 1 per tile in a peer's
  L1), an ``urgent`` one (TRSM's diagonal inversions, which later tasks wait for) first. **Fair share of
  small calls**: a stream worker holding max(1, tasks // stream workers) of a call leaves the rest to a
  stream peer with room that holds less, unless it has nothing else to run (``Worker._leave_for_peer``);
  with ``Knobs.line_homes`` each line of an in-place TRMM or a TRSM of at most two lines a device goes to
  one device (``_leave_for_home``).
* A stream device has ``nstreams`` compute streams and three copy streams (host loads, peer loads,
  write-backs). Each active task holds a compute stream; a worker issues one k-step of every active task in
  turn, at most ``2 * nstreams`` tasks in flight (``Knobs.commit_steps`` adds a horizon in flops: a started task
  cannot move, so what each device has committed when the queues run dry is the call's tail). With
  ``Knobs.chain_kernels`` each kernel waits for the device's previous one: kernels run one at a time in issue
  order, and the streams overlap copies and write-backs with them, not kernels with each other.
* A rotatable task's k-steps start at its device's share of k (``assign.py``), so its summation order depends
  on the device that ran it: on several stream devices results are not bit-identical run to run (split-k's
  reduction order is fixed). ``Knobs.late_c`` folds beta * C in at a task's end. Every knob, the queue order
  (``Knobs.block_order``), TRSM's inverses (``Knobs.trsm_inverse``) and the details: docs/design.md,
  *Scheduling details*.
* Tiles are read through the **two-level cache**: L1 is the device's ALRU (Algorithm 2) over its heap; L2
  the other devices' L1, found through the **MESI-X directory** (``coherence.py``), copied over peer links.
  A peer's line still filling from the host is waited for only if the host bytes ahead of it are at most
  this device's own backlog plus the tile (``Knobs.peer_wait_if_sooner``). A written C tile is M and is
  written back at once (-> I).
* The **CPU worker** solves whole tasks with the host BLAS, its threads limited so every GPU worker keeps
  a core: by demand with ``cpu=True``; in **auto mode** (``cpu=None`` beside CUDA GPUs, ``cpu="auto"``)
  only when ``admission.py`` predicts it finishes the task before the GPUs finish the rest of the call,
  never for a call with dependencies or one the GPUs hold at once, nor while the call's host operands are
  being page-locked. With the CPU as the only device, tasks run in the calling thread (``Engine.inline``).

Invariants
----------
1. Every task of a call is accounted exactly once (done, cancelled or abandoned); a call returns only
   then, so no device writes into the caller's memory after ``submit`` returns or raises.
2. A line's reader count is the number of issued, unfinished operations that read it; only lines with no
   readers are evicted; a heap block is freed only by its device's worker after the event ending its last use.
3. A tile key begins with a token that is never reused: per call for host arrays that may be written and
   for device (CuPy) arrays; for life for read-only host arrays (whole base chain read-only). No stale tile
   is read.
4. Cross-device waits target an event recorded before the wait is issued (a peer's fill event, read under
   the directory lock while holding a reader count), so waits cannot form a cycle. If the peer breaks
   before its fill completes, the sim copies from the tile's home instead.
5. No exception escapes a worker. A call's own error fails that call; any other is the device's: its tasks
   go to live workers, unless their write-back was in flight and the task reads its own tile, or a
   write-after-read gate already let a tile it read be overwritten (``Call.recompute_safe``): then the
   call fails, as does a call no live worker can run.
6. Workers are non-daemon threads; ``shutdown`` puts one sentinel per worker on the queue and joins them
   (and the sim stream threads). An inline engine starts no thread. An engine started after the exit hook
   stopped the last one (threads still calling at interpreter exit) has daemon threads
   (``EngineConfig.daemon_threads``): the interpreter's join of non-daemon threads would wait for them forever.
7. No finalizer waits for a lock (it may run inside a critical section of that lock): their locks are
   re-entrant; ``retire_base`` takes none, it leaves the base in ``_retired``, which ``submit`` drains (at a
   call's start and end, in a ``with`` block: no asynchronous exception can land between the directory lock's
   acquire and release there, as one can after a bare ``acquire``).

Failure model
-------------
* **Bad input** raises in the caller before a Call exists; nothing is queued.
* **Interrupt** (any exception in the caller's thread while its call is planned, registered, queued or
  waited for) cancels the call (``_cancel``): no worker starts another of its tasks, queued and stationed
  tasks are taken back, tasks on devices stop at their next step, then the interrupt is re-raised (in the
  main thread a second Ctrl-C meanwhile is ignored). Lines are marked ready only when filled and the call's
  tokens are retired, so no later call reads a half-filled line; other calls go on, the next call works.
  What a caller waits on or wakes workers with is entered at C level (``latch.Latch``, ``_cv_lock``): an
  interrupt landing between a Python-level acquire and its ``try`` would leave that lock held for good.
* **The caller's arrays**: inputs are never written. A call returning a new array leaves all of them
  untouched (it is cancelled as above); one writing into the caller's array (``overwrite_c``/``overwrite_b``
  with a usable array, ``out=``) holds Ctrl-C back until it returns (``blasx.dispatch.whole``, main
  thread), as numpy's and scipy's calls do, so that output is fully written when KeyboardInterrupt is
  raised (an async exception injected into another thread still cancels it, maybe partly written; one
  injected while that thread starts the engine's workers can, on CPython 3.11, land in the new thread before
  it reports itself started and leave the caller in ``Thread.start()``: a CPython limit, not Ctrl-C's case).
* **An error of one call** (a refused write-back, ``CacheFull``, anything not a device error,
  ``Worker.device_error``) fails that call; its tasks stop as on an interrupt; the device goes on.
* **A device error** (``DeviceError``, a broken stream, a CUDA/cuBLAS error other than out of memory, a
  dying worker thread): that worker stops, its lines are dropped, the peer lines it read unpinned, its
  tasks go to live workers or fail their calls; its memory is freed only once peers' copies from its lines,
  picked before they were dropped, are done (``Directory.lent``). A waiting caller checks every ``WAIT_POLL``
  that a live worker can still run its call. ``blasx.reset()`` restarts the engine; the next call does so by itself
  once every device is dead.
* **Out of memory**: a heap is sized from the memory free at open (cuda: half, retried at half the size;
  sim: ``mem=`` less ``sim.take_memory``); a device that cannot get a minimum does not start, naming needed
  and free bytes. Memory taken by others mid-run shrinks the cache (``Device.cache_limit``); a block that
  still does not fit once the worker's own work has retired fails the call with ``CacheFull`` (while peers
  still read its lines, after up to 200,000 sleeps of 0.2 ms for them to end), as a cuda scratch buffer that cannot
  be had does (MemoryError). A host chunk that cannot be registered is copied as pageable memory; one that could not
  be staged fails the copies reading it.
* **Shutdown**: ``shutdown()`` and ``configure()`` let the calls in flight finish (a Ctrl-C meanwhile cancels
  them) before any worker takes its sentinel: a worker that stopped mid-call would leave its peers reading
  lines of a closed device, or tasks handed on to nobody; interpreter exit cancels the calls in flight first
  (``shutdown(cancel=True)``), so it returns promptly, but those of non-daemon threads (``keep``: the
  interpreter waits for those threads anyway). A worker that leaves its loop counts as dead.
* **Start**: a Ctrl-C while the workers open their devices is held back until they have, then raised with
  the engine started. An engine closed before it started raises ``EngineClosed`` (the session builds another).
  A call is listed in ``_calls`` inside the block whose interrupt cancels it: shutdown never waits for a call
  nobody runs.

State (who changes each field)
------------------------------
* ``devices``, ``workers``, ``stations``: fixed at start. A station is pushed/popped by its worker, stolen
  from by peers, emptied of a cancelled call's tasks by its caller (``_take_back``) and, once its worker is
  dead, drained by whichever thread runs ``_fail_unrunnable``; all under the station's lock.
* ``queues``: ``{"any": TaskQueue, "gpu": TaskQueue}`` (deque operations, atomic under the GIL); any thread
  puts, workers get; a cancelling caller removes its call's tasks (``remove_if``), as ``_fail_unrunnable``
  removes all once no worker lives.
* ``directory``: MESI-X directory and every ALRU, under ``directory.lock``; heap blocks belong to their worker.
  It remembers the last 4096 retired token bases, so a line filled late for one of them is born dead (one
  filled late for an older base is never read either: tokens are not reused; ALRU evicts it in its turn).
* ``work_generation``, ``_cv``: bumped and notified when work appears (submit, re-queue, failure, shutdown);
  idle workers sleep on ``_cv`` until it changes, at most 2 ms while any station holds tasks (a station filling
  notifies nobody, and a steal must not wait for the next call).
* ``_calls``: calls in progress, so a failure with no live worker can fail them all; added and copied under
  ``_calls_lock`` (``_live_calls``).
* ``_retired``: bases of collected read-only arrays whose tiles are still to be marked dead (invariant 7);
  any thread appends (finalizers, submit), submit drains under the directory lock.
* ``_switching``: Python's switch interval while calls are in flight (``switching.py``); ``admission``: the
  auto-mode CPU worker's rule and rate meter (``admission.py``), or None.
* Per worker, written by that worker alone: ``slots``, ``pending`` (events per stream), ``inflight`` /
  ``inflight_of``, ``h2d_issued`` / ``h2d_done``. Peers read ``inflight_of``, the station length and
  ``h2d_*`` without a lock: a stale value only costs balance, never correctness.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from dataclasses import dataclass, field

from .admission import Admission
from . import faults
from .call import Call, CallCancelled
from .coherence import Directory
from .devices.base import DeviceError
from .knobs import Knobs
from .latch import sigint_recorded, wait_through
from .queue import TaskQueue
from .station import ReservationStation
from .switching import SwitchInterval
from .tasks import SC_ZERO
from .worker import CpuWorker, StreamWorker


WAIT_POLL = 0.1  # seconds between a waiting caller's checks that its call can still run
SWEEP_POLL = 0.05  # seconds between a cancelling caller's sweeps for tasks nobody holds


def _start_once(w) -> None:
    """``w.start()``, unless an interrupted earlier try already started the thread."""
    if w.ident is None and not w.is_alive():
        try:
            w.start()
        except RuntimeError:
            if w.ident is None and not w.is_alive():  # (not "threads can only be started once": a real failure)
                raise


def _reads_own_tile(task) -> bool:
    """The task reads the memory it writes: C itself (beta != 0, its first contents from C's own memory, not a
    ``c_init`` elsewhere such as the caller's untouched c), or its tile of B in place. A loaded tile whose first
    step does not read it (beta 0: SYRK's diagonal tile, loaded for the triangle it keeps and writes back as
    loaded) reads none of what the task writes anew: a partial write-back left the kept part as it was."""
    tokens, c = task.call.tokens, task.c
    if task.load_c and (task.c_init is None or tokens[task.c_init.slot] == tokens[c.slot]) \
            and task.steps[0].beta != SC_ZERO:
        return True
    return any(tokens[r.slot] == tokens[c.slot] and (r.bi, r.bj) == (c.bi, c.bj) for r in task.input_tiles())


class EngineClosed(RuntimeError):
    """Shut down before a call's tasks were queued: nothing of it ran (``dispatch.submit_planned`` reruns it)."""


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
    daemon_threads: bool = False  # an engine started after the interpreter's exit hook: its threads not joined


class Engine:
    SENTINEL = _Sentinel()

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.devices = list(config.devices)
        if not self.devices:
            raise ValueError("devices: got an empty list, need at least one device")
        for d in self.devices:
            d.knobs = config.knobs
            d.daemon_threads = config.daemon_threads
        self.directory = Directory(len(self.devices))
        self.queues = {"any": TaskQueue(), "gpu": TaskQueue()}
        self.stations = [ReservationStation(d.index, max(1, d.nstreams)) for d in self.devices]
        self.workers = []
        self.work_generation = 0
        # entered through the lock itself, never Condition.__enter__ (see Failure model: Interrupt)
        self._cv_lock = threading.Lock()
        self._cv = threading.Condition(self._cv_lock)
        self._lock = threading.Lock()
        self._retired: collections.deque[int] = collections.deque()  # retire_base's backlog
        self._calls: "weakref.WeakSet[Call]" = weakref.WeakSet()
        self._calls_lock = threading.Lock()  # adds and snapshots of _calls (a set changing under a copy raises)
        self._started = False
        self._closed = False
        self.failures: list[tuple[str, BaseException]] = []
        self._switching = SwitchInterval(config.switch_interval)
        # The CPU worker's rule (admission.py) for an auto-mode CPU device beside stream devices; else None.
        auto_cpu = any(not d.streamed and getattr(d, "auto", False) for d in self.devices)
        self.admission = Admission(self) if auto_cpu and any(d.streamed for d in self.devices) else None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            if self._closed:  # (a call that raced configure(): EngineClosed reruns it on the new engine)
                raise EngineClosed("this blasx engine was shut down before it started; blasx.configure() makes a "
                                   "new one")
            if self.inline:  # calls run in their own threads: no worker thread to start
                self.devices[0].open()
                self._started = True
                return
            ncores = os.cpu_count() or 1
            bind = self.config.bind_threads and ncores > len(self.devices)
            workers = [(StreamWorker if d.streamed else CpuWorker)(self, d, st, core)
                       for d, st in zip(self.devices, self.stations)
                       for core in [d.index % ncores if bind and d.binds_thread else None]]
            self.workers = workers
            # A Ctrl-C meanwhile is held back until every worker has opened its device (CUDA contexts: slow), then
            # raised with the engine started: half-started workers would be started twice, or never stopped.
            # In the main thread a SIGINT is recorded, not raised, while threads start: one raised inside
            # Thread.start() after the thread was launched looks like one never started (started again: twins).
            pending = failed = None
            with sigint_recorded() as replay:
                try:
                    for w in workers:
                        pending = wait_through(lambda w=w: _start_once(w), pending, held=KeyboardInterrupt)
                except Exception as exc:  # a thread could not start (out of threads): those that did are stopped
                    failed = exc
                    self.workers = [w for w in workers if w.ident is not None]
            try:
                replay()  # (the recorded SIGINT's handler: Python's raises KeyboardInterrupt, kept for later)
            except BaseException as exc:  # noqa: BLE001 - a handler's SystemExit too: raised once workers run
                pending = pending or exc
            for w in self.workers:
                pending = wait_through(w.opened.wait, pending)
            self._started = True
        if failed is not None:
            self.shutdown()
            raise failed
        if pending is not None:
            raise pending
        errors = [(w.dev.name, w.open_error) for w in self.workers if w.open_error is not None]
        if errors and not any(w.alive for w in self.workers):
            self.shutdown()
            name, exc = errors[0]
            raise DeviceError(f"no device could start; {name}: {exc!r}") from exc

    def shutdown(self, cancel: bool = False, keep=frozenset()) -> None:
        """Stop the workers once the queued work is done; ``cancel`` (interpreter exit) fails the calls in flight
        but those in ``keep`` (of threads the interpreter still waits for)."""
        started = False
        try:  # (from before ``_closed`` is set: an interrupt anywhere after it still stops the workers)
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                started = self._started
            if cancel and started and not self.inline:
                for call in self._live_calls():
                    if not call.done and call not in keep:
                        call.fail(CallCancelled(f"{call.name}: blasx was shut down while the call ran"))
                        self._take_back(call)
            if started and self.inline:
                self.devices[0].close()
            elif started:  # the calls queued before ``_closed`` run to their end first: a worker that stopped
                self._finish_calls()  # meanwhile would leave its peers reading lines of a closed device
        finally:  # (interrupted: the calls left are cancelled, then the workers stopped all the same)
            if started and not self.inline:
                self.queues["any"].put_many([self.SENTINEL] * len(self.workers))
                self._poke()
                for w in self.workers:
                    if w is not threading.current_thread():
                        wait_through(w.join)

    def _finish_calls(self) -> None:
        """Wait for every call in flight (failing those no live worker can run); an exception meanwhile (Ctrl-C)
        cancels the ones left, then is raised."""
        try:
            for call in self._live_calls():
                while not call.wait(WAIT_POLL):
                    if not self._runnable(call):
                        self._fail_unrunnable()
        except BaseException as exc:
            for call in self._live_calls():
                if not call.done:
                    self._cancel(call, exc, "in a thread shutting the engine down (blasx.shutdown / configure)")
            raise

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
        """Sleep until work changes: at most ``poll`` s (None: no bound), 2 ms while a station holds tasks to steal."""
        with self._cv_lock:
            if self.work_generation != seen_generation:
                return
            timeout = 0.002 if any(len(st) for st in self.stations) else poll
            self._cv.wait(timeout)

    def _poke(self) -> None:
        with self._cv_lock:
            self.work_generation += 1
            self._cv.notify_all()

    # ------------------------------------------------------------ calls
    def submit(self, call: Call) -> None:
        """Run ``call`` to completion; raise its error, if any. An exception in this thread meanwhile
        (KeyboardInterrupt, an async one) cancels it (``_cancel``), re-raised once no device works for it."""
        self.start()
        if self._retired:
            self._drain_retired()
        if not self.inline:  # workers run it: they may fail, and need waking for dependents
            if self._closed:  # (its stopped workers count as dead: say why, so the call reruns on the new engine)
                raise EngineClosed(self._closed_message(call))
            if not self._runnable(call):
                raise DeviceError(self._unrunnable_message(call))
        try:
            if not self.inline:  # (listed inside the try: an interrupt anywhere after cancels it, so no
                with self._calls_lock:  # shutdown waits for a call nobody runs)
                    self._calls.add(call)
                if call.has_deps:
                    call.on_finish = self._poke  # finished tasks free their dependents: wake idle workers
                if self.admission is not None:
                    call.meter_with(self.admission.meter)  # rates and the call's flops left, for the CPU
            call.stats.start()
            if self.inline:
                self._run_inline(call)
            else:
                with self._switching:
                    faults.at("submit")
                    self._enqueue(call)
                    while not call.wait(WAIT_POLL):
                        if not self._runnable(call):
                            self._fail_unrunnable()
        except BaseException as exc:
            if not self.inline and not call.done:
                self._cancel(call, exc)
            raise
        finally:
            for op in call.operands:
                if op.token[0] < 0:  # per-call token: its tiles may never be read again
                    self.retire_base(op.token[0])
            if self._retired:
                self._drain_retired()
        err = call.error
        if err is None:
            return
        if isinstance(err, DeviceError):
            raise DeviceError(f"{call.name} failed: {err}") from err
        raise err  # an error of the call itself (a host-side write, a full tile cache): its own type

    def _enqueue(self, call: Call) -> None:
        """Queue ``call``'s tasks before shutdown's sentinels or not at all (EngineClosed): tasks behind
        the sentinels would never run. Under the lock that shutdown() sets ``_closed`` with."""
        with self._lock:
            if self._closed:
                raise EngineClosed(self._closed_message(call))
            self.queue_of(call).put_many(call.tasks)
        self._poke()

    @staticmethod
    def _closed_message(call: Call) -> str:
        return (f"{call.name}: this blasx engine was shut down (configure() or shutdown() ran) before the call was "
                f"queued; nothing of it ran")

    @property
    def inline(self) -> bool:
        """The host CPU is the only device: calls run in the calling thread (see the policy)."""
        return len(self.devices) == 1 and not self.devices[0].streamed

    def _run_inline(self, call: Call) -> None:
        """Run ``call``'s tasks in plan order in the calling thread; an error fails this call only (invariant 1)."""
        dev = self.devices[0]
        tasks = iter(call.tasks)
        try:
            for task in tasks:
                if not call.is_ready(task):
                    raise RuntimeError(f"task {task.tid} of {call.name} is planned before a task it depends on")
                task.worker = dev.index
                call.started(task)
                try:
                    faults.at("cpu", dev, task)
                    dev.run_task(task)
                except BaseException:
                    call.account(task)
                    raise
                call.account(task, dev.index)
        except BaseException as exc:  # noqa: BLE001 - raised to the caller by submit, as from a worker
            call.fail(exc if isinstance(exc, Exception) else CallCancelled(f"{call.name}: {exc!r}"))
            for task in tasks:
                call.account(task)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt and the like reach the caller as they are

    def _cancel(self, call: Call, exc: BaseException, where: str = "in its calling thread") -> None:
        """The caller stops waiting for ``call`` (``exc`` in its thread; ``where`` says so in the error): fail it
        (no worker starts another of its tasks), take its queued and stationed tasks back, and wait until those
        on devices end (each stops at its next step). A task nobody holds in two sweeps in a row (the interrupt
        came before it was queued) is accounted here. In the main thread a second Ctrl-C meanwhile is ignored."""
        call.fail(CallCancelled(f"{call.name} was cancelled by {type(exc).__name__} {where}"))
        self._poke()
        restore = _defer_sigint()
        try:
            lost: set = set()
            while True:
                self._take_back(call)
                if call.wait(SWEEP_POLL):
                    return
                held = {t.tid for w in self.workers for t in w.held_snapshot() if t.call is call}
                now = {t.tid for t in call.unaccounted() if t.tid not in held}
                for t in call.tasks:
                    if t.tid in now and t.tid in lost:
                        call.account(t)
                lost = now
        finally:
            restore()

    def _take_back(self, call: Call) -> None:
        """Account the tasks of ``call`` (failed) that sit in a queue or a station."""
        for held in (*self.queues.values(), *self.stations):
            for t in held.remove_if(lambda t: t is not self.SENTINEL and t.call is call):
                call.account(t)

    @property
    def dead(self) -> bool:
        """Started, and every device failed: ``blasx.reset()`` or the next call replaces the engine."""
        return self._started and not self.inline and not any(w.alive for w in self.workers)

    def leaks(self) -> list[str]:
        """What an idle engine should not hold (tests and the soak; run with no call in flight)."""
        from .audit import leaks
        return leaks(self)

    def retire_base(self, base: int) -> None:
        """Tiles of token base ``base`` may never be read again (a read-only array died). Called by finalizers, so
        it takes no lock (invariant 7): the base waits in ``_retired`` for the next submission's drain."""
        self._retired.append(base)

    def _drain_retired(self) -> None:
        """Retires the waiting bases (a caller's thread, never inside a directory critical section)."""
        with self.directory.lock:
            while self._retired:
                self.directory.retire_base(self._retired.popleft())

    def _runnable(self, call: Call) -> bool:
        return any(self.can_run(w, call) for w in self.workers)

    def _unrunnable_message(self, call: Call) -> str:
        live = [w.dev.name for w in self.workers if w.alive]
        if not live:
            dead = "; ".join(f"{n}: {e!r}" for n, e in self.failures) or "none started"
            return (f"no live device left to run {call.name} (failures: {dead}); blasx.reset(), or the "
                    f"next call, starts the devices again")
        return f"{call.name} has CuPy operands but no live CUDA device can run it (live devices: {live})"

    # ------------------------------------------------------------ failures
    def worker_failed(self, worker, exc: BaseException, held) -> None:
        """Hand a broken worker's tasks on, or fail their calls (invariant 5)."""
        with self._lock:
            worker.alive = False
            self.failures.append((worker.dev.name, exc))
            for task, writeback_issued in held:
                call = task.call
                err = None
                if call.failed:
                    pass
                elif writeback_issued and _reads_own_tile(task):
                    err = (f"{worker.dev.name} failed while writing back tile {task.c[1:3]} of {call.name}; "
                           f"the task reads that tile (beta != 0, or in place), so it cannot be recomputed "
                           f"safely from a partly written tile: {exc!r}")
                elif not call.recompute_safe(task):
                    err = (f"{worker.dev.name} failed before finishing tile {task.c[1:3]} of {call.name}, whose "
                           f"old tiles have since been overwritten in place (its computed result let them be), so "
                           f"it cannot be recomputed: {exc!r}")
                elif not self._runnable(call):
                    err = self._unrunnable_message(call)
                else:
                    # In front: later tasks of the call may depend on it (TRSM).
                    task.worker = -1
                    call.unstarted(task)
                    self.queue_of(call).put_front(task)
                    continue
                if err is not None:
                    self._fail_call(call, err, exc)
                call.account(task)
        self._fail_unrunnable()
        self._poke()

    def queue_of(self, call: Call):
        """The global queue of a call's tasks: CUDA workers alone serve calls with CuPy operands."""
        return self.queues["gpu" if call.device_only else "any"]

    def requeue(self, task) -> None:
        """Put a task a worker gave back (unstarted) in front of its queue and wake the workers."""
        self.queue_of(task.call).put_front(task)
        self._poke()

    def _fail_call(self, call: Call, message: str, cause: BaseException | None) -> None:
        err = DeviceError(message)
        err.__cause__ = cause
        call.fail(err)

    def _live_calls(self) -> list:
        with self._calls_lock:
            return list(self._calls)

    def _fail_unrunnable(self) -> None:
        """Fail and drain every call no live worker can run, so nobody waits forever."""
        for call in self._live_calls():
            if not call.failed and not self._runnable(call):
                cause = self.failures[-1][1] if self.failures else None
                self._fail_call(call, self._unrunnable_message(call), cause)
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


def _defer_sigint():
    """In the main thread, hold SIGINT (Ctrl-C) back until the returned function is called: the
    caller is already cleaning up after one. Elsewhere (or with no Python handler) a no-op."""
    import signal
    old = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if old is None:
        return lambda: None
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    return lambda: signal.signal(signal.SIGINT, old)
