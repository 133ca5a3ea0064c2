"""When the CPU worker takes a task beside the GPUs (the paper's Fig. 9).

Beside GPUs the CPU is orders of magnitude slower per task, so by demand (``cpu=True``) every call waits
for its CPU task. In auto mode (``cpu=None`` beside CUDA GPUs, ``cpu="auto"`` beside any stream devices) it
takes a task only when :func:`decide` predicts the call then ends no later: always with no GPU; never for a
call with dependencies (TRSM) or one the GPUs hold at once (stations + compute streams), nor while a rate
is unknown or the call's host operands are being page-locked (their tasks then are no rate samples); else iff

    cpu_s = margin * t.flops / r_cpu  <  gpu_s = (waiting - t.flops + RUNNING_LEFT * running) / sum(r_g)

(``waiting``: flops of the call's unstarted tasks, ``t`` included; ``running``: those started and
unfinished). Other calls' work is left out, so the rule errs towards the GPUs. Rates per worker and dtype
(:class:`RateMeter`) are the flops of its last ``WINDOW`` tasks over the busy seconds they took; a GPU's
counts once it has finished as many tasks as it has streams (an unknown one counts as the fastest known);
the CPU's is first probed with a small GEMM (``CpuDevice.probe``).

State: a RateMeter window is written by its worker's thread only (the CPU worker reads ``_sums``
lock-free); ``Call.flops_waiting``/``flops_running`` under the call's lock; ``Admission.counts`` and
``last`` by the CPU worker alone.
"""

from __future__ import annotations

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
ALONE, DEPS, SMALL, SOONER, LATER = "alone", "deps", "small", "sooner", "later"
NO_GPU_RATE, NO_CPU_RATE, REGISTERING = "gpu rate unknown", "cpu rate unknown", "inputs registering"
#: Reasons that hold for the whole call, whatever the rates (nothing to look at again until another call).
NEVER_FOR_THE_CALL = frozenset({DEPS, SMALL})
REASONS = (ALONE, REGISTERING, DEPS, SMALL, NO_GPU_RATE, NO_CPU_RATE, SOONER, LATER)


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` answered and why, with the predicted finish times (s from now) when rates were known."""

    admit: bool
    reason: str
    cpu_s: float | None = None
    gpu_s: float | None = None


def decide(task_flops: float, call_tasks: int, has_deps: bool, gpu_hold: int,
           cpu_rate: float | None, gpu_rates: list, waiting_flops: float, running_flops: float,
           *, margin: float = MARGIN, running_left: float = RUNNING_LEFT, registering: bool = False) -> Decision:
    """The admission rule (module docstring): may the CPU worker take this task now? ``gpu_rates``: one
    per live stream worker that can run the call (None: not measured yet). ``waiting_flops`` includes the
    task itself. ``registering``: the call's host operands are still being page-locked."""
    if not gpu_rates:
        return Decision(True, ALONE)
    if registering:
        return Decision(False, REGISTERING)
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
    """Per-worker flop rates from finished tasks (module docstring). ``busy(w)``: worker ``w`` runs a task
    as one of its tasks starts (that one not counted); asked from ``w``'s own thread only."""

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

    def finished(self, w: int, key: str, flops: float, t: float, sample: bool = True) -> None:
        """Worker ``w`` finished a task of ``flops`` in dtype ``key`` at ``t`` (``sample``: a rate sample)."""
        mark = self._mark[w]
        self._mark[w] = t
        if mark is not None and sample:  # (never seen starting: no interval to measure)
            self._add(w, key, flops, max(0.0, t - mark))

    def seed(self, w: int, key: str, flops: float, seconds: float) -> None:
        """A first sample for ``(w, key)`` (the CPU's probe); ignored once it has one."""
        if (w, key) not in self._window and flops > 0 and seconds > 0:
            self._add(w, key, flops, seconds)

    def _add(self, w: int, key: str, flops: float, seconds: float) -> None:
        k = (w, key)
        win = self._window.setdefault(k, deque(maxlen=self.window))
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

    def __init__(self, engine) -> None:
        self.engine = engine
        self.meter = RateMeter(len(engine.devices), self._busy)
        self.counts = dict.fromkeys(REASONS, 0)
        self.last: Decision | None = None

    def _busy(self, w: int) -> bool:
        # ``inflight``: a stream worker's started, unretired tasks (read lock-free); the CPU worker runs one at a time.
        workers = self.engine.workers
        return w < len(workers) and getattr(workers[w], "inflight", 0) > 0

    def admits(self, cpu_worker, task) -> bool:
        """May ``cpu_worker`` take ``task`` now? (Called from the CPU worker's thread only.)"""
        call = task.call
        if call.failed:
            return True  # its call failed: taking it drops it at once
        eng, meter, key = self.engine, self.meter, call.dtype.char
        gpus = [w for w in eng.workers if w.dev.streamed and eng.can_run(w, call)]
        gpu_hold = sum(w.station.capacity + w.dev.nstreams for w in gpus)
        gpu_rates = [meter.rate(w.idx, key) if meter.samples.get((w.idx, key), 0) >= w.dev.nstreams else None
                     for w in gpus]  # (one burst first: module docstring)

        def rule() -> Decision:
            return decide(task.flops, call.n_tasks, call.has_deps, gpu_hold, meter.rate(cpu_worker.idx, key),
                          gpu_rates, call.flops_waiting, call.flops_running, registering=call.registering)

        d = rule()
        if d.reason == NO_CPU_RATE:
            meter.seed(cpu_worker.idx, key, *cpu_worker.dev.probe(call.dtype))
            d = rule()
        self.counts[d.reason] += 1
        self.last = d
        return d.admit
