"""Assign: which task a stream device starts next (Algorithm 1, lines 10-16, and Eq. 3).

Each free stream gets the station's best ready task by Eq. 3 (an ``urgent`` one first), within ``2 * streams``
tasks in flight and ``Knobs.commit_steps``; a rotatable task's k-steps start at this device's share of k.
"""

from __future__ import annotations

from .inflight import _Active
from .station import EQ3_SCORE, WHERE_L1
from .tasks import rotated_steps

URGENT_SCORE = 1 << 30  # above any Eq. 3 sum


class StreamAssign:
    """The assign step: a mixin of StreamWorker (uses its ``slots``, ``station``, ``inflight``, ``directory``)."""

    @staticmethod
    def ready(task) -> bool:
        """``task`` may start on a stream: a gated task waits step by step (``Task.gates``)."""
        return task.call.is_startable(task)

    @property
    def commit_steps(self) -> int:
        """``Knobs.commit_steps``, read live (an A/B may switch it on a running engine)."""
        return self.engine.config.knobs.commit_steps

    def committed(self) -> float:
        """Flops committed here and not yet run: issued, unretired kernels and active tasks' unissued steps."""
        return self.issued_work + sum(a.task.call.step_flops(st) for a in self.slots if a is not None
                                      for st in a.steps[a.k:])

    def _within_horizon(self, task, committed: float) -> bool:
        """``task`` fits on ``committed`` flops (``Knobs.commit_steps``); always on an idle device, or urgent."""
        if self.inflight == 0 or not self.commit_steps or task.urgent:
            return True
        return committed <= 0 or committed < self.commit_steps * task.call.full_step

    def assign(self) -> None:
        for s, slot in enumerate(self.slots):
            if slot is not None or self.inflight >= self.max_inflight:
                continue
            committed = self.committed() if self.commit_steps else 0.0
            task = self.station.pop_best(self._score,
                                         lambda t: self._within_horizon(t, committed) and self.ready(t))
            if task is None:
                return
            act = self.slots[s] = _Active(task, task.steps)  # held before the check (a canceller's sweep)
            if task.call.failed:
                self.slots[s] = None
                task.call.account(task)
                continue
            task.worker = self.idx
            task.call.started(task)
            steps = task.steps
            if task.rotatable and self.n_devices > 1 and self.engine.config.knobs.rotate_steps \
                    and not any(task.gates[:len(steps)]):
                # Device d starts at the d-th share of k; only a write-back gate (in-place TRMM) ignores their order.
                head, body = steps[:task.fixed], steps[task.fixed:]
                steps = head + rotated_steps(body, (len(body) * self.rank) // self.n_devices)
            act.steps = steps
            self.inflight += 1
            self.inflight_of[task.call] = self.inflight_of.get(task.call, 0) + 1

    def _score(self, task) -> int:
        """Eq. 3 for this device (lock-free: a stale answer only costs locality); ``urgent`` tasks first."""
        if task.urgent:
            return URGENT_SCORE
        call, where, tokens, me = task.call, self.directory.where, task.call.tokens, self.idx
        total = 0
        for ref in task.input_tiles():
            if self.dev.holds_array(call.operands[ref.slot]):
                total += EQ3_SCORE[WHERE_L1]
            else:
                total += EQ3_SCORE[where((tokens[ref.slot], ref.bi, ref.bj), me)]
        return total
