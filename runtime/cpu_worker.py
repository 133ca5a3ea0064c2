"""The CPU worker: the paper's CPU computation thread, one whole task at a time in the host operands."""

from __future__ import annotations

from . import faults
from .admission import NEVER_FOR_THE_CALL
from .worker_base import Worker


class CpuWorker(Worker):
    """The CPU computation thread (Section IV-C.2), multithreaded BLAS per tile. By demand (``cpu=True``) it takes
    the queue's head whenever idle, steals when it is empty; in auto mode only what ``engine.admission`` admits."""

    current = None  # the task being solved (it writes C in place)
    writing = False  # ... and its solve has begun (C may be partly written)

    def _takes(self, task) -> bool:
        adm = self.engine.admission
        return adm is None or adm.admits(self, task)

    _may_steal = _takes  # a stationed task is admitted as a queued one

    def _pull(self):
        """As ``Worker._pull``; in auto mode a task other than the head it admitted (a peer took that one
        meanwhile) is put back unless admitted too: the CPU never runs a task it did not decide on."""
        q, head, takes = self._head()
        if not takes:
            return None
        t = q.get()
        if self.engine.admission is None or t is None or t is head or t is self.engine.SENTINEL \
                or self._takes(t):
            return t
        self.engine.requeue(t)  # in front again, and the workers are woken for it
        return None

    def holding(self, call) -> int:
        cur = self.current
        return super().holding(call) + (cur is not None and cur.call is call)

    def held_snapshot(self) -> tuple:
        cur = self.current
        return super().held_snapshot() + ((cur,) if cur is not None else ())

    def has_runnable(self) -> bool:
        return self.current is not None or super().has_runnable()

    def held_tasks(self):
        out = super().held_tasks()
        if self.current is not None:
            out.append((self.current, self.writing))  # once C may be partly written: as an issued write-back
            self.current = None
        return out

    def loop(self) -> None:
        eng = self.engine
        while True:
            gen = eng.work_generation
            self.fill_station()
            task = self.station.pop_best(lambda t: 0, self.ready)
            if task is not None:
                self.current = task  # held before the check (a canceller's sweep)
                solved_by = None  # stays None for a failed call's task: it is dropped
                if not task.call.failed:
                    task.worker = self.idx
                    task.call.started(task)
                    try:
                        faults.at("cpu", self.dev, task)
                        self.dev.engage()  # auto mode: the BLAS thread limit, from the first task run
                        self.writing = True
                        self.dev.run_task(task)
                        solved_by = self.idx
                    except Exception as exc:  # noqa: BLE001 - a call's own error fails that call only
                        if self.device_error(exc):
                            raise
                        task.call.fail(exc)
                self.current, self.writing = None, False
                task.call.account(task, solved_by)
                continue
            if self.stopping and len(self.station) == 0:
                return
            if self._work_waiting():
                continue
            # Auto mode: a declined task may be admitted once rates are known or the GPUs' work shrinks, so
            # look again soon; not for a call never admitted (no thread keeps waking beside a small GPU call).
            adm = eng.admission
            declined = adm is not None and any(len(q) for q in eng.queues_for(self)) and not (
                adm.last is not None and adm.last.reason in NEVER_FOR_THE_CALL)
            eng.wait_for_work(gen, 0.002 if declined else None)
