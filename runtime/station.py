"""Reservation stations (Section IV-C, Fig. 4) and the Eq. 3 priority.

Each worker owns a station of tasks pulled from the global queue, not yet started, and starts the one of
highest Eq. 3 priority on its device ``d``: the sum over its input tiles of 2 if in d's L1, 1 if in a peer's
(L2), else 0, refreshed at every pick; ties go to the task pulled first (the planner's locality order).
Peers steal from it, so its list is guarded by a lock.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

from .tasks import Task

# f(X) of Eq. 3b: a lookup table, indexed by where the tile is.
WHERE_HOST, WHERE_L2, WHERE_L1 = 0, 1, 2
EQ3_SCORE = {WHERE_HOST: 0, WHERE_L2: 1, WHERE_L1: 2}


def priority(task: Task, where: Callable[[object], int], key_of: Callable[[object], object]) -> int:
    """Eq. 3a: sum of f over the task's input tiles; ``where(key)`` says L1/L2/host."""
    return sum(EQ3_SCORE[where(key_of(t))] for t in task.input_tiles())


class ReservationStation:
    __slots__ = ("owner", "capacity", "_tasks", "_lock")

    def __init__(self, owner: int, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: got {capacity!r}, need an int >= 1")
        self.owner = owner
        self.capacity = capacity
        self._tasks: list[Task] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tasks)

    def load(self) -> float:
        """Waiting work: the flops of the tasks held (at least 1 per task, for flop-less ones)."""
        return sum(t.work for t in self._tasks)

    def free_slots(self) -> int:
        return self.capacity - len(self._tasks)

    def any_ready(self, ready: Callable[[Task], bool]) -> bool:
        with self._lock:
            return any(ready(t) for t in self._tasks)

    def push(self, task: Task) -> None:
        with self._lock:
            self._tasks.append(task)

    def pop_best(self, score: Callable[[Task], int], ready: Callable[[Task], bool] | None = None) -> Task | None:
        """Remove and return the ready task of highest score (first pulled wins ties)."""
        with self._lock:
            best_i, best_s = -1, -1
            for i, t in enumerate(self._tasks):
                if ready is not None and not ready(t):
                    continue
                s = score(t)
                if s > best_s:
                    best_i, best_s = i, s
            return self._tasks.pop(best_i) if best_i >= 0 else None

    def steal(self, ready: Callable[[Task], bool] | None = None) -> Task | None:
        """Take the most recently pulled ready task (the one its owner would start last)."""
        with self._lock:
            for i in range(len(self._tasks) - 1, -1, -1):
                if ready is None or ready(self._tasks[i]):
                    return self._tasks.pop(i)
            return None

    def drain(self) -> list[Task]:
        with self._lock:
            out, self._tasks = self._tasks, []
            return out

    def remove_if(self, pred: Callable[[Task], bool]) -> list[Task]:
        with self._lock:
            taken = [t for t in self._tasks if pred(t)]
            self._tasks = [t for t in self._tasks if not pred(t)]
            return taken

    def snapshot(self) -> tuple[Task, ...]:
        with self._lock:
            return tuple(self._tasks)


def most_loaded(stations: Iterable[ReservationStation], exclude: int) -> ReservationStation | None:
    """The steal target: the station, not ``exclude``'s, holding the most waiting flops; None if none holds any."""
    load, best = max(((st.load(), st) for st in stations if st.owner != exclude), key=lambda x: x[0],
                     default=(0.0, None))
    return best if load > 0 else None
