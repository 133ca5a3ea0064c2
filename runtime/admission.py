"""When the CPU worker takes a task beside the GPUs (the paper's Fig. 9).

The CPU worker (``worker.CpuWorker``) solves whole tasks with the host BLAS. Beside GPUs it is
one to three orders of magnitude slower per task (one of its tasks can outlast a whole call on
the GPUs), so taking work *by demand* (what ``configure(cpu=True)`` does) makes every call wait
for its CPU task. In **auto** mode
(``configure(cpu=None)`` beside CUDA GPUs, ``cpu="auto"`` beside any stream devices) the CPU
worker takes a task only when the rule below predicts that this makes the call end no later.

Rule
----
For a task ``t`` of call ``c`` (the head of the global queue, or a task the CPU would steal from
a GPU's station), with G the live stream workers that can run ``c``:

1. **alone**: G is empty (every GPU failed, or none can run it): take it; nobody else will.
2. **deps**: ``c`` has a task with dependencies (TRSM): never. A dependency solved on the CPU
   would hold up every GPU task that waits for it, and a CPU task waits for all its
   dependencies to *finish* where a GPU starts at its first open gate.
3. **small**: ``len(c.tasks) <= hold``, where ``hold`` is the sum over G of station capacity +
   compute streams (what the GPUs can hold at once: the fair-share rule of
   ``Worker._leave_for_peer`` spreads such a call over the GPUs alone): never.
4. **rates**: with ``r_cpu`` the CPU's rate and ``r_g`` each GPU's rate in the call's dtype
   (flop/s, :class:`RateMeter`): a GPU's rate is known once it has finished as many tasks as it
   has streams (one burst, below); a GPU of G whose rate is not known yet counts as fast as the
   fastest one known; if none is known, never (**gpu rate unknown**). If the CPU's rate is not
   known, the worker probes it once (``CpuDevice.probe``) and decides again; if it is still
   unknown, never (**cpu rate unknown**).
5. **sooner / later**: take ``t`` iff

       cpu_s = margin * t.flops / r_cpu  <  gpu_s = (waiting - t.flops + RUNNING_LEFT * running) / sum(r_g)

   ``cpu_s`` is when the CPU would finish ``t``, ``gpu_s`` when the GPUs would finish the rest
   of the call without it (both in seconds from now: the CPU worker decides only when it is
   idle, so it would start ``t`` now). ``waiting`` is the flops of ``c``'s tasks not started
   (queued or in a station, ``t`` included), ``running`` those started and not finished, of
   which half is assumed left (``RUNNING_LEFT``). Work of other calls queued before ``c``'s
   is left out, which only makes ``gpu_s`` smaller: the rule errs towards leaving tasks to the
   GPUs. ``MARGIN`` (1.5) covers the error of ``r_cpu`` (a probe of a small GEMM; the host
   BLAS slowed by the GPU workers' threads and copies).

:func:`decide` is the rule as a pure function of those numbers (tested by exact values);
:meth:`Admission.admits` gathers them. Beside fast GPUs the CPU takes a task only while
``MARGIN * sum(r_g) / r_cpu`` (hundreds) of the call's tasks are left besides it: in practice
never. Against slow GPUs (sims with ``rate=`` far below the host's BLAS) it takes a growing
share of every large call.

Measured rates (``RateMeter``)
------------------------------
Each worker's rate, per dtype character, is the flops of its last ``WINDOW`` (16) finished
tasks over the busy seconds they took: each task's interval runs from the worker's previous
completion, or from the start of its first task after being idle, to its own completion. A
ratio of sums, not an average of per-task ratios: a GPU with ``2 * streams`` tasks in flight
finishes them in bursts (the first after a long interval, the next ones a few microseconds
apart), and only the sum over a burst is its throughput; 16 covers two bursts of 4-stream
devices. A GPU's first sample alone reads low: its interval is shared by the tasks that ran
interleaved with it, so with n streams it can read up to n times below the device's rate. So
the rule uses a GPU's rate only once it has as many samples as the GPU has streams. (A
window beats an exponentially weighted average, which weights the long interval that opens a
burst more than the short ones that end it.)

The CPU's first sample is the probe: a 256-square GEMM of the call's dtype
(``CpuDevice.probe``), best of three, on the CPU worker's BLAS threads (a small GEMM runs
below the rate of a large tile, so it errs low). The GPUs get no seed: until one of them
finishes a task the CPU takes nothing (**gpu rate unknown**), so in an engine's first call it
joins only after the GPUs' first completions. Nothing is seeded from the perf-db: its entries are whole-call rates
of one tile choice, not per-worker rates.

State (each field has one owner)
--------------------------------
``Admission.meter``
    The engine's :class:`RateMeter`, for the engine's life (rates carry over between calls).
``RateMeter._window``, ``RateMeter._sums``
    ``{(worker index, dtype char): deque of (flops, seconds)}``, its last ``WINDOW`` samples,
    and ``{(worker index, dtype char): (flops, seconds)}``, their sums. Written only by that
    worker's thread (``Call.started`` / ``Call.account`` run there); the CPU worker reads
    ``_sums`` lock-free: each entry is replaced by one assignment, so it sees an old or a new
    pair.
``RateMeter._mark``
    Per worker: when its current busy interval began (its last completion, or its first start
    after being idle; None before its first task). Written by that worker's thread.
``RateMeter.samples``
    ``{(worker, dtype char): samples so far}`` (the probe counts as one).
``Call.meter``, ``Call.flops_waiting``, ``Call.flops_running``
    Set by ``Engine.submit`` when the engine has an admission rule (``Call.meter_with``):
    the meter to notify at each start and finish, and the flops of the call's tasks not
    started / started and unfinished, kept under the call's lock by ``started``,
    ``unstarted`` and ``account``.
``Admission.counts``
    ``{reason: decisions}`` of :meth:`Admission.admits`, written by the CPU worker alone. These
    count decisions, not tasks: an idle CPU worker asks again at every wake-up (every 2 ms
    while some station holds tasks). The tasks it took are in the call's profile (the ``cpu``
    device's row).
``Admission.last``
    The latest :class:`Decision` (for tests and debugging).

Cost: a decision is a few dictionary reads and a division; a CPU worker that leaves work asks
a few times per poll (the queue's head, its own pull, the tasks of the station it would steal
from), a small fraction of one core while a call runs.

Thread limits: in auto mode the CPU device limits the BLAS threads (every core but one per GPU
worker) only once it runs a probe or a task, and restores them when the last call running then
ends (``CpuDevice.engage``); a call in which the CPU takes nothing leaves them alone.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

#: The CPU's predicted time for a task is multiplied by this before it is compared.
MARGIN = 1.5
#: Share of a started, unfinished task's flops assumed still to run.
RUNNING_LEFT = 0.5
#: Finished tasks per worker and dtype that its measured rate sums over.
WINDOW = 16

# Decision reasons (the keys of Admission.counts). Only ALONE and SOONER take the task.
ALONE = "alone"
DEPS = "deps"
SMALL = "small"
NO_GPU_RATE = "gpu rate unknown"
NO_CPU_RATE = "cpu rate unknown"
SOONER = "sooner"
LATER = "later"
#: Reasons that hold for the whole call, whatever the rates: nothing to look at again until
#: another call is posted.
NEVER_FOR_THE_CALL = frozenset({DEPS, SMALL})
REASONS = (ALONE, DEPS, SMALL, NO_GPU_RATE, NO_CPU_RATE, SOONER, LATER)

clock = time.perf_counter


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` answered, and why. ``cpu_s`` / ``gpu_s``: the two predicted finish
    times (seconds from now) when the rates were known, else None."""

    admit: bool
    reason: str
    cpu_s: float | None = None
    gpu_s: float | None = None


def decide(task_flops: float, call_tasks: int, has_deps: bool, gpu_hold: int,
           cpu_rate: float | None, gpu_rates: list, waiting_flops: float, running_flops: float,
           *, margin: float = MARGIN, running_left: float = RUNNING_LEFT) -> Decision:
    """The admission rule (module docstring): may the CPU worker take this task now?

    ``gpu_rates``: one entry per live stream worker that can run the call (None: not measured
    yet); empty when there is none. ``waiting_flops`` includes the task itself."""
    if not gpu_rates:
        return Decision(True, ALONE)
    if has_deps:
        return Decision(False, DEPS)
    if call_tasks <= gpu_hold:
        return Decision(False, SMALL)
    known = [r for r in gpu_rates if r is not None and r > 0]
    if not known:
        return Decision(False, NO_GPU_RATE)
    if cpu_rate is None or not cpu_rate > 0:
        return Decision(False, NO_CPU_RATE)
    fastest = max(known)
    gpu_rate = sum(r if (r is not None and r > 0) else fastest for r in gpu_rates)
    cpu_s = margin * task_flops / cpu_rate
    gpu_s = max(0.0, waiting_flops - task_flops + running_left * running_flops) / gpu_rate
    return Decision(cpu_s < gpu_s, SOONER if cpu_s < gpu_s else LATER, cpu_s, gpu_s)


class RateMeter:
    """Per-worker flop rates from finished tasks (module docstring, "Measured rates").

    ``busy(w)`` says whether worker ``w`` runs any task at the moment one of its tasks starts
    (that task not counted); it is only asked from ``w``'s own thread."""

    def __init__(self, nworkers: int, busy: Callable[[int], bool], window: int = WINDOW) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window: got {window!r}, need an int >= 1")
        self.window = window
        self.busy = busy
        self._mark: list[float | None] = [None] * nworkers
        self._window: dict = {}
        self._sums: dict = {}
        self.samples: dict = {}

    def started(self, w: int, t: float) -> None:
        """Worker ``w`` starts a task at time ``t``: a busy interval begins if it was idle."""
        if w >= 0 and (self._mark[w] is None or not self.busy(w)):
            self._mark[w] = t

    def finished(self, w: int, key: str, flops: float, t: float) -> None:
        """Worker ``w`` finished a task of ``flops`` in dtype ``key`` at time ``t``."""
        mark = self._mark[w]
        if mark is None:  # finished a task it was never seen starting: no interval to measure
            self._mark[w] = t
            return
        self._add(w, key, flops, max(0.0, t - mark))
        self._mark[w] = t

    def seed(self, w: int, key: str, flops: float, seconds: float) -> None:
        """A first sample for ``(w, key)`` (the CPU's probe); ignored once it has one."""
        if (w, key) not in self._window and flops > 0 and seconds > 0:
            self._add(w, key, flops, seconds)

    def _add(self, w: int, key: str, flops: float, seconds: float) -> None:
        k = (w, key)
        win = self._window.get(k)
        if win is None:
            win = self._window[k] = deque(maxlen=self.window)
        win.append((float(flops), float(seconds)))
        self._sums[k] = (sum(f for f, _ in win), sum(s for _, s in win))
        self.samples[k] = self.samples.get(k, 0) + 1

    def rate(self, w: int, key: str) -> float | None:
        """Worker ``w``'s rate in dtype ``key`` (flop/s); None until it has a sample with time."""
        e = self._sums.get((w, key))
        if e is None or not e[1] > 0:
            return None
        return e[0] / e[1]


class Admission:
    """The engine's admission rule for its auto-mode CPU worker (one per engine)."""

    def __init__(self, engine, *, margin: float = MARGIN, running_left: float = RUNNING_LEFT,
                 window: int = WINDOW) -> None:
        self.engine = engine
        self.margin = margin
        self.running_left = running_left
        self.meter = RateMeter(len(engine.devices), self._busy, window)
        self.counts = dict.fromkeys(REASONS, 0)
        self.last: Decision | None = None

    def _busy(self, w: int) -> bool:
        # A stream worker's ``inflight`` counts its started, unretired tasks (read lock-free, as
        # peers do for the fair-share rule); the CPU worker runs one task at a time.
        workers = self.engine.workers
        return w < len(workers) and getattr(workers[w], "inflight", 0) > 0

    def admits(self, cpu_worker, task) -> bool:
        """May ``cpu_worker`` take ``task`` now? (Called from the CPU worker's thread only.)"""
        call = task.call
        if call.failed:
            return True  # its call failed: taking it drops it at once
        eng = self.engine
        gpus = [w for w in eng.workers if w.dev.streamed and eng.can_run(w, call)]
        key = call.dtype.char
        meter = self.meter
        args = (task.flops, len(call.tasks), call.has_deps,
                sum(w.station.capacity + w.dev.nstreams for w in gpus))
        gpu_rates = [meter.rate(w.idx, key) if meter.samples.get((w.idx, key), 0) >= w.dev.nstreams else None
                     for w in gpus]  # (one burst first: module docstring, "Measured rates")
        d = self._decide(args, meter.rate(cpu_worker.idx, key), gpu_rates, call)
        if d.reason == NO_CPU_RATE:
            flops, seconds = cpu_worker.dev.probe(call.dtype)
            meter.seed(cpu_worker.idx, key, flops, seconds)
            d = self._decide(args, meter.rate(cpu_worker.idx, key), gpu_rates, call)
        self.counts[d.reason] += 1
        self.last = d
        return d.admit

    def _decide(self, args, cpu_rate, gpu_rates, call) -> Decision:
        return decide(*args, cpu_rate, gpu_rates, call.flops_waiting, call.flops_running,
                      margin=self.margin, running_left=self.running_left)
