"""In-flight records of a stream worker: a task on a stream, what one step holds, what an event ends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .tasks import SC_BETA, SC_ONE, Step


@dataclass(slots=True, eq=False)
class _Active:
    """A task on a stream: its steps in this device's order, which comes next, and where C is."""

    task: Any
    steps: tuple
    k: int = 0
    c_loc: Any = None
    c_off: int | None = None  # heap offset of the C buffer; None when C is used in place
    late: bool = False  # Knobs.late_c: C starts at beta = 0, the old C is folded in at the end
    old_loc: Any = None
    old_off: int | None = None
    old_ready: Any = None  # event: the old C tile is in old_loc

    def buffers(self) -> tuple:
        """Heap offsets this task holds (freed at its last event)."""
        return tuple(o for o in (self.c_off, self.old_off) if o is not None)

    def fold_step(self) -> Step:
        """C += beta * old C, after the last product step (Knobs.late_c)."""
        c = self.task.c
        return Step("axpby", None, None, 0, 0, c.rows, c.cols, 0, SC_ONE, SC_BETA)


@dataclass(slots=True, eq=False)
class _StepWork:
    """What one step has taken so far (lines with a reader count, fills not yet flushed, blocks not yet
    owned by the task), so an error of the call mid-step can give them back."""

    release: list = field(default_factory=list)
    fills: dict = field(default_factory=dict)
    extra: list = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _Pending:
    """Bookkeeping to do when ``event`` completes."""

    event: Any
    seq: int
    release: tuple = ()  # lines whose reader count drops
    ready: tuple = ()  # lines whose fill completes
    free: tuple = ()  # heap offsets to free
    task: Any = None
    finished: bool = False  # the task is complete at this event
    writeback: bool = False  # the task's write-back was issued before this event
    h2d_bytes: int = 0  # host-to-device bytes this event ends (the h2d backlog)
    computed: Any = None  # a task whose last kernel this event ends (write-after-read gates)
    work: float = 0.0  # flops of the kernel this event ends (the device's committed work drops)
    step_of: Any = None  # the task one of whose k-steps this event ends (the profile counts the step then)
