"""lanes.py: the long-lived threads the recurrent and network executors run their per-device loops on."""

from __future__ import annotations

import threading

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
