"""Long-lived threads for the per-device loops of recurrent layers and networks.

A thread that ends takes CuPy's per-thread library handles with it, and a cuBLAS handle destroyed while another
thread captures a CUDA graph invalidates that capture; a fresh thread also pays for new handles on its first
call. So these loops run on threads kept until ``blasx.shutdown()``: an idle lane is reused and a new one starts
only when all are busy (a job may wait on another job's progress, so none ever queues behind a busy lane).
Callers run their jobs through :func:`run_all`: a Ctrl-C while they start is held until all have started, so no
job runs unjoined and no lane is lost from the pool.
"""

from __future__ import annotations

import os
import queue
import threading

from ..runtime.latch import Latch, sigint_recorded, wait_through
from .fp_rules import torch_fp_rules

MAX_IDLE = 32  # idle lanes kept; a lane finding this many idle ones ends

_lock = threading.Lock()
_idle: list = []
_started = [0]


def _after_fork_in_child() -> None:
    """The parent's lanes do not exist in a forked child (and its lock may have been held at the fork)."""
    global _lock
    _lock = threading.Lock()
    _idle.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Job:
    """One callable on a lane: ``join()`` waits for it; ``error`` is what it raised (None when it returned)."""

    def __init__(self) -> None:
        self.done = Latch()
        self.error: BaseException | None = None

    def join(self) -> None:
        self.done.wait()


class _Lane(threading.Thread):
    def __init__(self, n: int) -> None:
        super().__init__(name=f"blasx-lane-{n}", daemon=True)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:  # stop_idle's sentinel
                return
            fn, job = item
            try:
                torch_fp_rules(fn)()  # (blasx.dnn's floating-point rules on its threads too)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever joins the job
                job.error = exc
            with _lock:
                keep = len(_idle) < MAX_IDLE
                if keep:
                    _idle.append(self)
            job.done.set()
            if not keep:
                return


def start(fn) -> Job:
    """Runs ``fn()`` on an idle lane (a new one when none is idle) and returns its job. Not safe against a
    Ctrl-C arriving inside (the lane or the job may be lost): :func:`run_all` holds it back."""
    job = Job()
    with _lock:
        lane = _idle.pop() if _idle else None
        if lane is None:
            _started[0] += 1
            lane = _Lane(_started[0])
            lane.start()
    lane.jobs.put((fn, job))
    return job


def run_all(fns, on_interrupt=None) -> None:
    """Runs each of ``fns`` on a lane of its own and waits for them all, as :func:`join_all`. In the main thread a
    Ctrl-C while they start is held until every one has started, then handled as one arriving while they run (a
    job left unjoined could still write the caller's buffers after the caller got its KeyboardInterrupt). A lane
    that cannot start (out of threads): ``on_interrupt(exc)``, the started jobs waited for, then ``exc`` raised."""
    jobs, pending = [], None
    with sigint_recorded() as replay:
        try:
            for fn in fns:
                jobs.append(start(fn))
        except Exception as exc:  # noqa: BLE001 - raised once the started jobs are done
            pending = exc
    try:
        replay()  # (the held SIGINT's handler: Python's raises KeyboardInterrupt)
    except BaseException as exc:  # noqa: BLE001 - a handler's SystemExit too: raised once the jobs are done
        pending = pending or exc
    if pending is not None and on_interrupt is not None:
        on_interrupt(pending)
    for job in jobs:
        pending = wait_through(job.join, pending, on_interrupt)
    if pending is not None:
        raise pending


def join_all(jobs, on_interrupt=None) -> None:
    """Wait for every job. An exception in the waiting thread (Ctrl-C) calls ``on_interrupt()`` (to make the
    jobs stop early), waits for them all the same -- further Ctrl-Cs held back -- and is then raised: when the
    caller gets it, no job still touches the caller's buffers."""
    pending = None
    for job in jobs:
        pending = wait_through(job.join, pending, on_interrupt)
    if pending is not None:
        raise pending


def stop_idle(timeout: float = 5.0) -> None:
    """End the idle lanes (blasx.shutdown: no blasx thread outlives it); busy ones finish their jobs and stay."""
    with _lock:
        idle = list(_idle)
        _idle.clear()
    for lane in idle:
        lane.jobs.put(None)
    for lane in idle:
        lane.join(timeout)


def count() -> tuple:
    """(lanes started so far, idle now)."""
    with _lock:
        return _started[0], len(_idle)
