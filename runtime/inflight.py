"""In-flight records of a stream worker: a task on a stream, what one step holds, what an event ends."""

from __future__ import annotations

from .tasks import SC_BETA, SC_ONE, Step


class _Active:
    """A task on a stream: its steps in this device's order, which comes next, and where C is."""

    __slots__ = ("task", "steps", "k", "c_loc", "c_off", "late", "old_loc", "old_off", "old_ready")

    def __init__(self, task, steps) -> None:
        self.task = task
        self.steps = steps
        self.k = 0
        self.c_loc = None
        self.c_off = None  # heap offset of the C buffer; None when C is used in place
        self.late = False  # Knobs.late_c: C starts at beta = 0, the old C is folded in at the end
        self.old_loc = None
        self.old_off = None
        self.old_ready = None  # event: the old C tile is in old_loc

    def buffers(self) -> tuple:
        """Heap offsets this task holds (freed at its last event)."""
        return tuple(o for o in (self.c_off, self.old_off) if o is not None)

    def fold_step(self) -> Step:
        """C += beta * old C, after the last product step (Knobs.late_c)."""
        c = self.task.c
        return Step("axpby", None, None, 0, 0, c.rows, c.cols, 0, SC_ONE, SC_BETA)


class _StepWork:
    """What one step has taken so far (lines with a reader count, fills not yet flushed, blocks
    not yet owned by the task), so an error of the call mid-step can give them back."""

    __slots__ = ("release", "fills", "extra")

    def __init__(self) -> None:
        self.release: list = []
        self.fills: dict = {}
        self.extra: list = []


class _Pending:
    """Bookkeeping to do when ``event`` completes."""

    __slots__ = ("event", "seq", "release", "ready", "free", "task", "finished", "writeback", "h2d_bytes",
                 "computed", "work")

    def __init__(self, event, seq, release=(), ready=(), free=(), task=None, finished=False, writeback=False,
                 h2d_bytes=0, computed=None, work=0.0):
        self.event = event
        self.seq = seq
        self.release = release  # lines whose reader count drops
        self.ready = ready  # lines whose fill completes
        self.free = free  # heap offsets to free
        self.task = task
        self.finished = finished  # the task is complete at this event
        self.writeback = writeback  # the task's write-back was issued before this event
        self.h2d_bytes = h2d_bytes  # host-to-device bytes this event ends (the h2d backlog)
        self.computed = computed  # a task whose last kernel this event ends (write-after-read gates)
        self.work = work  # flops of the kernel this event ends (the device's committed work drops)
