"""rnn_multi._Issued on the CPU stand-in for CuPy (bench/fake_cupy.py): each job is issued at once, on its
device and that device's pool stream after waiting for what the caller had queued; join() orders the caller's
streams after every job; a failing job synchronises the streams used so far, then raises."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from bench import fake_cupy
from blasx.dnn import rnn_multi


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(rnn_multi, "_streams", {})  # the pool streams made here are the stand-in's
    monkeypatch.setattr(rnn_multi, "_callers", {})
    with fake_cupy.installed(record_calls=True) as f:
        yield f


NULL = (0, 0)  # the stand-in's null stream as a caller (rnn_multi._caller)


def _pb(cupy):
    return types.SimpleNamespace(xp=cupy)


def test_jobs_run_in_order_on_their_device_and_stream(fake):
    cupy = fake.cupy
    seen = []

    def job(name):
        seen.append((name, cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr))
    pool = rnn_multi._Issued(_pb(cupy), [0, 1])
    waits_before = [e for e in fake_cupy.LOG if e[0] == "wait_event"]
    pool.start(1, job, "remote")
    assert seen == [("remote", 1, rnn_multi._stream(cupy, 1, 0, NULL).ptr)]  # at once, not on a thread
    pool.start(0, job, "home")
    pool.start(0, job, "home again")
    assert [s[0] for s in seen] == ["remote", "home", "home again"]
    assert seen[1][1:] == (0, rnn_multi._stream(cupy, 0, 0, NULL).ptr) and seen[2][1:] == (0, rnn_multi._stream(cupy, 0, 1, NULL).ptr)
    assert cupy.cuda.get_current_stream().ptr == 0 and cupy.cuda.Device().id == 0  # the caller's context is back
    waits = [e for e in fake_cupy.LOG if e[0] == "wait_event"][len(waits_before):]
    assert len(waits) == 3 * 2  # each job's stream waited for the caller's queue on both devices
    fake_cupy.LOG.clear()
    pool.join()
    waits = [e for e in fake_cupy.LOG if e[0] == "wait_event"]
    assert [w[1] for w in waits] == [0] * 6  # the caller's stream on each device waits for all three jobs


def test_a_failing_job_synchronises_the_streams_used_and_raises(fake):
    cupy = fake.cupy
    pool = rnn_multi._Issued(_pb(cupy), [0, 1])
    pool.start(0, lambda: None)

    def boom():
        raise RuntimeError("bad step")
    fake_cupy.LOG.clear()
    with pytest.raises(RuntimeError, match="bad step"):
        pool.start(1, boom)
    synced = {e[1] for e in fake_cupy.LOG if e[0] == "synchronize"}
    assert synced == {rnn_multi._stream(cupy, 0, 0, NULL).ptr, rnn_multi._stream(cupy, 1, 0, NULL).ptr}


def test_host_arrays_keep_threads():
    pb = types.SimpleNamespace(xp=np)
    assert isinstance(rnn_multi._pool(pb, [None]), rnn_multi._Threads)


def test_pool_streams_are_per_callers_stream(fake, monkeypatch):
    """Jobs forked from different caller streams get different pool streams (CuPy's pool hands a freed block back
    to the stream that allocated it: a job's arrays, read on the caller's stream after the join, must go only to
    later jobs of that caller); the per-thread default stream is a caller per thread; past MAX_CALLERS the jobs
    run on the caller's own stream."""
    cupy = fake.cupy
    seen = []

    def job():
        seen.append(cupy.cuda.get_current_stream().ptr)

    def run_from(stream):
        with stream:
            pool = rnn_multi._Issued(_pb(cupy), [0])
            pool.start(0, job)
            pool.join()
        return seen[-1]
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    first = run_from(a)
    assert run_from(a) == first and run_from(b) not in (first, a.ptr, b.ptr)
    assert rnn_multi._callers == {(a.ptr, 0): a, (b.ptr, 0): b}  # (each held: its handle never reused meanwhile)
    with cupy.cuda.Stream(ptr=2):  # (cudaStreamPerThread: one handle, a stream per thread)
        assert rnn_multi._caller(cupy) == (2, threading.get_ident())
    assert rnn_multi._caller(cupy) == NULL
    monkeypatch.setattr(rnn_multi, "MAX_CALLERS", 2)
    c = cupy.cuda.Stream(non_blocking=True)
    assert rnn_multi._stream(cupy, 0, 0, (c.ptr, 0)) is None
    assert run_from(c) == c.ptr  # (the caller's own stream: its jobs one after another)


def test_jobs_inside_a_whole_call_capture_run_on_side_streams_each_later_one_with_a_workspace(fake):
    """Inside a whole-call capture the jobs fork from the capturing stream onto this thread's side streams; a
    device's second job runs beside its first in the graph, so it gets a cuBLAS workspace of its own (two split-k
    GEMMs at once must not share one); join() orders the capture after both."""
    from blasx.dnn import rnn_layer
    cupy = fake.cupy
    seen = []

    def job():
        seen.append(cupy.cuda.get_current_stream().ptr)
    table = {0: "device 0's"}
    cap = cupy.cuda.Stream(non_blocking=True)
    with cap, rnn_layer.whole_call_capture(table):
        cap.begin_capture()
        pool = rnn_multi._Issued(_pb(cupy), [0])
        pool.start(0, job)
        pool.start(0, job)
        pool.join()
        graph = cap.end_capture()
    assert len(set(seen)) == 2 and cap.ptr not in seen
    assert sorted(k for k in table if k != 0) == [(0, seen[1])]  # the second job's own workspace
    waits = [e[1] for e in graph.entries if e[0] == "wait_event"]
    assert waits.count(cap.ptr) == 2 and rnn_multi._streams == {}  # (no pool stream made)
