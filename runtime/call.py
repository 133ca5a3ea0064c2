"""One submitted BLAS call: its operands, tasks, scalars and completion state.

Workers *account* for every task exactly once (done, cancelled or abandoned); the call completes when all
are, so no worker still writes into the caller's memory when ``wait`` returns, with or without an error.
Accounting a task twice is a no-op, so a cancelling caller may sweep up tasks that no worker holds
(``Engine._cancel``) without racing a worker.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import numpy as np

from . import dtypes as _dtypes
from . import faults
from .latch import Latch
from .stats import CallStats
from .tasks import (N_SCALARS, SC_ALPHA, SC_ALPHA_CONJ, SC_BETA, SC_MINUS_ONE, SC_ONE, SC_ZERO,
                    Step, Task)

_call_ids = itertools.count(1)
_clock = time.perf_counter


class CallCancelled(Exception):
    """The caller stopped waiting (KeyboardInterrupt or another exception in its thread, or exit): tasks dropped."""


# Real flops of one step by kernel (times 4 if complex; not listed: gemm's 2 m n k), for stats and the sim.
STEP_FLOPS = {
    "scale": lambda s: float(s.m * s.n),
    **dict.fromkeys(("syrk", "herk"), lambda s: 1.0 * s.n * (s.n + 1) * s.k),
    **dict.fromkeys(("syr2k", "her2k"), lambda s: 2.0 * s.n * (s.n + 1) * s.k),
    **dict.fromkeys(("trmm", "trsm", "invmm"), lambda s: 1.0 * s.m * s.n * (s.m if s.side == 0 else s.n)),
    "trtri": lambda s: s.m ** 3 / 3.0,
}


def step_flops(step: Step, is_complex: bool) -> float:
    """Real flops of one step (complex counts 4 times)."""
    f = STEP_FLOPS[step.kernel](step) if step.kernel in STEP_FLOPS else 2.0 * step.m * step.n * step.k
    return 4.0 * f if is_complex else f


@dataclass(eq=False)
class Operand:
    """A matrix in canonical (column-major) form, where it lives, and its cache identity."""

    array: Any  # column-major view: numpy (host) or cupy (device)
    rows: int
    cols: int
    ld: int  # leading dimension, elements
    ptr: int  # address of element (0, 0)
    device: int  # -1: host memory; else the CUDA ordinal holding it
    token: Hashable  # first part of every tile key of this operand
    pinning: Any = None  # how its host memory is page-locked (hostmem.Pinning; set by the cuda backend)
    # A derived operand (runtime/derived.py) has no memory (array None, device -1): its tiles are made
    # from another operand of the call on the device that needs them.
    derive: Any = None

    @property
    def on_host(self) -> bool:
        """In host memory (a derived operand has none: False)."""
        return self.device < 0 and self.derive is None


def step_slots(tasks) -> set[int]:
    """Slots of the operands the tasks' steps read (A and B tiles of their kernels)."""
    return {r.slot for t in tasks for st in t.steps for r in (st.a, st.b) if r is not None}


class Call:
    def __init__(self, name: str, operands: list[Operand], tasks: list[Task], dtype,
                 alpha, beta, stats: CallStats, epilogue: Callable | None = None,
                 out_dtype=None, math: str = "ieee") -> None:
        self.cid = next(_call_ids)
        self.name = name
        self.operands = operands
        self.tokens = tuple(op.token for op in operands)
        self.tasks = tasks
        self.n_tasks = len(tasks)  # (kept after ``drop_tasks``)
        self.dtype = np.dtype(dtype)  # the input operands' type (every operand's, unless mixed)
        self.itemsize = self.dtype.itemsize
        self.is_complex = self.dtype.kind == "c"
        self.math = math  # "ieee" or "tf32" (float32 gemm on tensor cores)
        derived = {i for i, op in enumerate(operands) if op.derive is not None}
        if derived and any(t.c.slot in derived for t in tasks):
            raise ValueError(f"{name}: a C tile of a derived operand (derived operands are read-only)")
        self._typed(out_dtype, epilogue, tasks)
        # Scalar tables indexed by SC_*, in the accumulation type, alive with the call so devices may pass
        # pointers into them; ``real_scalars``: the real parts (herk's alpha and beta, her2k's beta).
        self.scalars = np.zeros(N_SCALARS, dtype=self.compute)
        self.scalars[SC_ALPHA], self.scalars[SC_BETA] = alpha, beta
        self.scalars[SC_ZERO], self.scalars[SC_ONE], self.scalars[SC_MINUS_ONE] = 0, 1, -1
        self.scalars[SC_ALPHA_CONJ] = np.conj(self.scalars[SC_ALPHA])
        self.real_scalars = np.ascontiguousarray(self.scalars.real)
        self.on_finish = None  # engine hook: a finished task may make others ready (deps)
        self.stats = stats
        self.epilogue = epilogue
        self.device_only = any(op.device >= 0 for op in operands)
        self.has_deps = any(t.deps for t in tasks)  # some task waits for others (TRSM)
        # The engine's rate meter and the flops not started / running, with a CPU admission rule (``meter_with``).
        self.meter = None
        self.pin_job = None  # a backend's job page-locking the host operands (``prepare_call``), or None
        self._full_step: float | None = None  # flops of the largest step (``full_step``)
        self.flops_waiting = 0.0
        self.flops_running = 0.0
        self._lock = threading.Lock()
        self._finished_tids: set[int] = set()
        self._accounted_tids: set[int] = set()
        self._started_tids: set[int] = set()  # assigned to a worker and not handed back (gates)
        # Write-after-read gates (``Task.war``): tasks whose kernels are done, and those among them whose
        # readers' write-backs were let through on that (they can never run again).
        self.war_gated = any(t.war for t in tasks)
        self._computed_tids: set[int] = set()
        self._relied_tids: set[int] = set()
        self._done = Latch()
        self.error: BaseException | None = None
        # float16 results that overflowed where a device rounded C: counted on the host or in device counters
        self._overflows = 0
        self._overflow_counters: dict = {}
        for t in tasks:
            t.call = self
        if not tasks:
            self._done.set()
        faults.at("plan")

    def _typed(self, out_dtype, epilogue, tasks) -> None:
        """The element types of a call. A *mixed* call (half, bfloat16 or int8 inputs, or an output type
        other than the inputs') keeps C tiles on a device in the accumulation type ``acc_dtype``; the
        write-back converts them to C's type at home (``out_dtype``), or an epilogue with a ``dtype``
        attribute converts them in place first (int8 dequantization). Otherwise every type is ``dtype``."""
        row = _dtypes.gemm_of(self.dtype)
        self.compute = row.compute if row is not None else self.dtype
        self.out_dtype = self.dtype if out_dtype is None else np.dtype(out_dtype)
        self.mixed = self.out_dtype != self.dtype or self.compute != self.dtype
        self.acc_dtype = self.compute if self.mixed else self.dtype
        self.wb_dtype = np.dtype(getattr(epilogue, "dtype", None) or self.acc_dtype)
        # (a C buffer's first contents, ``Task.c_init``, are loaded into the accumulation type too)
        self.c_slots = frozenset(s for t in tasks for s in (t.c.slot, *((t.c_init.slot,) if t.c_init else ()))
                                 ) if self.mixed else frozenset()
        # C tiles kept for later tasks of the call (split-k's partial sums) stay in that type at home too
        self.acc_slots = frozenset(t.c.slot for t in tasks if t.keep_c) if self.mixed else frozenset()
        # int8 tiles on a device have a leading dimension that is a multiple of 4 (cuBLAS's rule)
        self.pad_ld = 4 if self.dtype == np.int8 else 1

    def written_slots(self) -> frozenset[int]:
        """Slots of the operands the call writes (its tasks' C)."""
        return frozenset(t.c.slot for t in self.tasks)

    def late_inputs(self) -> frozenset[int]:
        """Slots read only as the first contents of rotatable tasks' C: under ``Knobs.late_c`` their tiles
        are fetched near a task's end, so they are page-locked after the inputs' too."""
        init = {t.c_init.slot for t in self.tasks if t.c_init is not None and t.rotatable}
        if init:
            init -= {t.c_init.slot for t in self.tasks if t.c_init is not None and not t.rotatable}
            init -= step_slots(self.tasks)
        return frozenset(init)

    def init_targets(self) -> dict[int, int]:
        """{C source's slot: the slot it starts}, where neither is a step's operand, every task writing the
        latter starts from the same tile of the source, and the source starts nothing else (so its values
        may be staged straight into it: each tile there is read before it is written)."""
        read = step_slots(self.tasks)
        targets = {}
        for d in {t.c.slot for t in self.tasks} - read:
            starts = {t.c_init.slot if t.c_init is not None and t.c_init[3:] == t.c[3:] else None
                      for t in self.tasks if t.c.slot == d}
            if len(starts) == 1 and (s := starts.pop()) is not None and s not in read:
                targets[s] = d
        elsewhere = {t.c_init.slot for t in self.tasks
                     if t.c_init is not None and targets.get(t.c_init.slot) != t.c.slot}
        return {s: d for s, d in targets.items() if s not in elsewhere}

    def written_only(self) -> frozenset[int]:
        """Slots of the operands the call only writes (never a step's operand): page-locked after the inputs'."""
        return frozenset({t.c.slot for t in self.tasks} - step_slots(self.tasks))

    def home_dtype(self, slot: int) -> np.dtype:
        """The type of operand ``slot`` in its home memory."""
        return self.acc_dtype if slot in self.acc_slots else self.out_dtype if slot in self.c_slots else self.dtype

    def tile_dtype(self, slot: int) -> np.dtype:
        """The type of a tile of operand ``slot`` on a device (C tiles: the accumulation type)."""
        return self.acc_dtype if slot in self.c_slots else self.dtype

    def tile_ld(self, slot: int, rows: int) -> int:
        """Leading dimension of a ``rows``-row tile of operand ``slot`` in a device's heap."""
        return -(-rows // self.pad_ld) * self.pad_ld

    def tile_nbytes(self, slot: int, rows: int, cols: int) -> int:
        """Heap bytes of a ``rows x cols`` tile of operand ``slot`` on a device."""
        return self.tile_ld(slot, rows) * cols * self.tile_dtype(slot).itemsize

    def home_nbytes(self, ref) -> int:
        """Bytes a copy of tile ``ref`` moves to or from its home."""
        return ref.rows * ref.cols * self.home_dtype(ref.slot).itemsize

    def count_overflow(self, n: int) -> None:
        """Add ``n`` overflowed float16 results (a device that counts on the host)."""
        if n:
            with self._lock:
                self._overflows += n

    def overflow_counter(self, device: int, make: Callable[[], Any]):
        """Device ``device``'s overflow counter for this call (``int(counter)``), made by ``make()`` on first use."""
        counter = self._overflow_counters.get(device)
        if counter is None:
            with self._lock:
                counter = self._overflow_counters.get(device)
                if counter is None:
                    counter = self._overflow_counters[device] = make()
        return counter

    def overflows(self) -> int:
        """float16 results that overflowed in this call (after it completed)."""
        return self._overflows + sum(int(c) for c in self._overflow_counters.values())

    @property
    def failed(self) -> bool:
        return self.error is not None

    def step_flops(self, step: Step) -> float:
        return step_flops(step, self.is_complex)

    @property
    def full_step(self) -> float:
        """Flops of the largest k-step, the unit of ``Knobs.commit_steps`` (racing first askers get the same)."""
        f = self._full_step
        if f is None:
            f = self._full_step = max((self.step_flops(st) for t in self.tasks for st in t.steps), default=0.0)
        return f

    def is_ready(self, task: Task) -> bool:
        """Every task ``task`` depends on has finished (what a whole-task CPU worker needs)."""
        if not task.deps or self.error is not None:
            return True  # a failed call's tasks are "ready" to be dropped, so none is stuck waiting
        fin = self._finished_tids
        return all(d in fin for d in task.deps)

    def is_startable(self, task: Task) -> bool:
        """A stream device may start ``task``: its deps have finished or, with gates, started."""
        if not task.gates or self.error is not None:
            return self.is_ready(task)
        fin, started = self._finished_tids, self._started_tids
        return all(d in fin or d in started for d in task.deps)

    def gate_open(self, task: Task, k: int) -> bool:
        """Step ``k`` (the write-back for ``k == len(steps)``) of a gated task may be issued. A write-after-
        read gate (``task.war``) needs its tasks' kernels done, not their write-backs; once it opens they are
        *relied on* (they read the old tile, now overwritten) and may not be recomputed (``recompute_safe``)."""
        if not task.gates or self.error is not None:
            return True
        gate = task.gates[k]
        if not task.war:
            fin = self._finished_tids
            return all(d in fin for d in gate)
        with self._lock:  # atomic with recompute_safe: a hand-back never races the overwrite
            done = self._computed_tids
            if not all(d in done for d in gate):
                return False
            self._relied_tids.update(gate)
            return True

    def computed(self, task: Task) -> None:
        """Every kernel of ``task`` is done (maybe not its write-back): opens the WAR gates waiting for it."""
        with self._lock:
            self._computed_tids.add(task.tid)
        if self.on_finish is not None:
            self.on_finish()

    def recompute_safe(self, task: Task) -> bool:
        """``task`` may run again from the start (its device failed before it finished): False once a
        write-after-read gate relied on its kernels. When True, it no longer counts as computed."""
        if not self.war_gated:
            return True
        with self._lock:
            if task.tid in self._relied_tids:
                return False
            self._computed_tids.discard(task.tid)
            return True

    def gate_lost(self, task: Task, k: int) -> bool:
        """A dependency of gate ``k`` is neither finished nor started: it went back to the queue."""
        fin, started = self._finished_tids, self._started_tids
        return any(d not in fin and d not in started for d in task.gates[k])

    @property
    def registering(self) -> bool:
        """Host operands are still being page-locked beside the call: the GPUs' tasks wait on it, so their
        times meanwhile are no rate samples."""
        job = self.pin_job
        return job is not None and not job.done

    def meter_with(self, meter) -> None:
        """Before any task is queued: report to ``meter`` (``admission.RateMeter``), keep the flops left."""
        self.flops_waiting = float(sum(t.flops for t in self.tasks))
        self.meter = meter

    def started(self, task: Task) -> None:
        """``task`` starts on worker ``task.worker`` (called from that worker's thread)."""
        meter = self.meter
        if meter is None:
            self._started_tids.add(task.tid)  # one owner per tid at a time: the worker running it
            return
        with self._lock:
            self._started_tids.add(task.tid)
            self.flops_waiting -= task.flops
            self.flops_running += task.flops
        meter.started(task.worker, _clock())

    def unstarted(self, task: Task) -> None:
        """``task`` goes back to a queue (its device failed, or it gave up waiting)."""
        if self.meter is None:
            self._started_tids.discard(task.tid)
            return
        with self._lock:
            if task.tid in self._started_tids:
                self._started_tids.discard(task.tid)
                self.flops_running -= task.flops
                self.flops_waiting += task.flops

    def account(self, task: Task, worker: int | None = None) -> None:
        """``task`` is finished (worker given) or dropped (no worker); complete the call after the last."""
        meter = self.meter
        with self._lock:
            if task.tid in self._accounted_tids:
                return  # a cancelling caller's sweep got here first (Engine._cancel)
            self._accounted_tids.add(task.tid)
            if worker is not None and not self.failed:
                self._finished_tids.add(task.tid)
                self._computed_tids.add(task.tid)
            if meter is not None:
                if task.tid in self._started_tids:
                    self.flops_running -= task.flops
                else:
                    self.flops_waiting -= task.flops
            last = len(self._accounted_tids) == self.n_tasks
        if meter is not None and worker is not None:
            # (a failed call's task may have stopped early: its time is no rate sample)
            meter.finished(worker, self.dtype.char, task.flops, _clock(),
                           sample=not self.registering and not self.failed)
        if last:
            self.stats.finish()
            self._done.set()
        elif self.on_finish is not None and worker is not None:
            self.on_finish()

    def fail(self, exc: BaseException) -> None:
        """Record the first error."""
        with self._lock:
            if self.error is None:
                self.error = exc

    @property
    def remaining(self) -> int:
        return self.n_tasks - len(self._accounted_tids)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def drop_tasks(self) -> None:
        """After a completed call: forget its tasks, which refer back to it (a cycle holding the operands and
        the caller's arrays until the cyclic garbage collector runs)."""
        if self.done:
            self.tasks = ()

    def unaccounted(self) -> list[Task]:
        """Tasks not yet accounted for (for a cancelling caller's sweep)."""
        with self._lock:
            acc = set(self._accounted_tids)
        return [t for t in self.tasks if t.tid not in acc]

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)
