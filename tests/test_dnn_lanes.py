"""lanes.py: the long-lived threads the recurrent and network executors run their per-device loops on."""

from __future__ import annotations

import signal
import threading

import pytest

from blasx.dnn import lanes


def test_idle_lanes_are_reused():
    first = lanes.start(lambda: None)
    first.join()
    started, _ = lanes.count()
    names = []
    for _ in range(5):
        job = lanes.start(lambda: names.append(threading.current_thread().name))
        job.join()
        assert job.error is None
    assert lanes.count()[0] == started and len(set(names)) == 1 and names[0].startswith("blasx-lane-")


def test_jobs_that_wait_on_each_other_never_queue_behind_a_busy_lane():
    """A job waiting on another job's progress (as the diagonal RNN groups do) gets its own lane."""
    go = threading.Event()
    jobs = [lanes.start(lambda: go.wait(10)) for _ in range(3)] + [lanes.start(go.set)]
    for job in jobs:
        job.join()
    assert go.is_set() and all(j.error is None for j in jobs)


def test_errors_reach_the_joiner_and_the_lane_lives_on():
    def fail():
        raise KeyboardInterrupt("stop")
    job = lanes.start(fail)
    job.join()
    assert isinstance(job.error, KeyboardInterrupt)
    again = lanes.start(lambda: None)
    again.join()
    assert again.error is None


def test_shutdown_ends_the_idle_lanes():
    import blasx
    lanes.start(lambda: None).join()
    assert any(t.name.startswith("blasx-lane-") for t in threading.enumerate())
    blasx.shutdown()
    assert not any(t.name.startswith("blasx-lane-") for t in threading.enumerate()) and lanes.count()[1] == 0
    job = lanes.start(lambda: None)  # and lanes start again after it
    job.join()
    assert job.error is None


def _interrupt_first_join(monkeypatch):
    """Job.join raises KeyboardInterrupt the first time (a Ctrl-C while the caller waits), then waits."""
    real, seen = lanes.Job.join, []

    def join(self):
        if not seen:
            seen.append(1)
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(lanes.Job, "join", join)


def test_ctrl_c_while_joining_waits_for_the_jobs_then_raises(monkeypatch):
    release, done = threading.Event(), []
    jobs = [lanes.start(lambda i=i: (release.wait(10), done.append(i))) for i in range(3)]
    _interrupt_first_join(monkeypatch)
    stopped = []
    with pytest.raises(KeyboardInterrupt):
        lanes.join_all(jobs, lambda exc: (stopped.append(type(exc)), release.set()))
    assert stopped == [KeyboardInterrupt] and sorted(done) == [0, 1, 2]  # every job ended before the raise


def _sigint_after_first_start(monkeypatch):
    """lanes.start raises SIGINT (a Ctrl-C) right after it started the first job, between two starts."""
    real, seen = lanes.start, []

    def start(fn):
        job = real(fn)
        if not seen:
            seen.append(1)
            signal.raise_signal(signal.SIGINT)
        return job
    monkeypatch.setattr(lanes, "start", start)


def test_run_all_holds_a_ctrl_c_until_every_job_started_then_waits_for_them(monkeypatch):
    release, done, stopped, lanes_used = threading.Event(), [], [], []

    def job(i):
        lanes_used.append(threading.current_thread())
        release.wait(10)
        done.append(i)
    _sigint_after_first_start(monkeypatch)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            lanes.run_all([lambda i=i: job(i) for i in range(3)],
                          lambda exc: (stopped.append(type(exc)), release.set()))
    finally:
        signal.signal(signal.SIGINT, old)
    assert stopped == [KeyboardInterrupt] and sorted(done) == [0, 1, 2]  # all started, all ended before the raise
    for _ in range(200):  # (a lane returns itself to the pool just before it sets its job done)
        if all(lane in lanes._idle for lane in lanes_used):
            break
        threading.Event().wait(0.01)
    assert len(set(lanes_used)) == 3 and all(lane in lanes._idle for lane in lanes_used)  # none lost from the pool


def test_run_all_a_lane_that_cannot_start(monkeypatch):
    real, calls, ran, stopped = lanes.start, [], [], []

    def start(fn):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("can't start new thread")
        return real(fn)
    monkeypatch.setattr(lanes, "start", start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        lanes.run_all([lambda: (threading.Event().wait(0.05), ran.append(1))] * 3, stopped.append)
    assert ran == [1] and [type(e) for e in stopped] == [RuntimeError]  # the started job ran to its end first


def test_network_run_with_a_ctrl_c_between_its_workers_starts(monkeypatch):
    """A Ctrl-C after the first worker's lane started: before, it reached the caller with that worker running."""
    import numpy as np

    from blasx.dnn import executor
    active, ran = [], []
    _sigint_after_first_start(monkeypatch)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            executor.run([_Stub(0, active, ran), _Stub(1, active, ran)], np.ones((40, 3)), 0, 1, False)
    finally:
        signal.signal(signal.SIGINT, old)
    seen = (list(active), len(ran))
    threading.Event().wait(0.1)  # (an orphaned worker would go on taking chunks)
    assert seen == ([], len(ran)) and len(ran) < 40


class _Stub:
    """A network worker of executor.run: each chunk takes 20 ms; ``active`` lists the lanes inside one."""

    def __init__(self, lane, active, ran):
        self.lane, self.label, self.graphs, self.chunk_graphs = lane, "cuda:0", False, {}
        self.stats, self.events, self.active, self.ran = {}, [], active, ran

    def reset(self):
        pass

    def context(self):
        import contextlib
        return contextlib.nullcontext()

    def run_chunk(self, xc, k, t0, host_in, pinning=None):
        self.active.append(self.lane)
        threading.Event().wait(0.02)
        self.ran.append(k)
        self.active.remove(self.lane)
        return xc * 2.0


def test_network_run_stops_its_workers_before_ctrl_c_reaches_the_caller(monkeypatch):
    """A Ctrl-C in net(x) on several workers: they take no more chunks, and none still runs when it is raised."""
    import numpy as np

    from blasx.dnn import executor
    active, ran = [], []
    _interrupt_first_join(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        executor.run([_Stub(0, active, ran), _Stub(1, active, ran)], np.ones((40, 3)), 0, 1, False)
    assert active == [] and len(ran) < 40


def test_a_forked_child_starts_lanes_of_its_own():
    """The parent's idle lanes do not exist in a forked child: a job there runs on a new lane (it hung on one)."""
    import os
    import subprocess
    import sys
    code = (
        "import os, faulthandler\n"
        "from blasx.dnn import lanes\n"
        "lanes.start(lambda: None).join()\n"  # one idle lane in the parent
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    faulthandler.dump_traceback_later(20, exit=True)\n"
        "    lanes.start(lambda: None).join()\n"
        "    os._exit(0)\n"
        "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "BLASX_DEVICES": "cpu"})
    assert r.stdout.strip() == "0", r.stdout + r.stderr
