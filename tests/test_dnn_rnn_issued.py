"""rnn_multi._Issued on the CPU stand-in for CuPy (bench/fake_cupy.py): each job is issued at once, on its
device and that device's pool stream after waiting for what the caller had queued; join() orders the caller's
streams after every job; a failing job synchronises the streams used so far, then raises."""

from __future__ import annotations

import types

import numpy as np
import pytest

from bench import fake_cupy
from blasx.dnn import rnn_multi


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(rnn_multi, "_streams", {})  # the pool streams made here are the stand-in's
    with fake_cupy.installed(record_calls=True) as f:
        yield f


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
    assert seen == [("remote", 1, rnn_multi._stream(cupy, 1, 0).ptr)]  # at once, not on a thread
    pool.start(0, job, "home")
    pool.start(0, job, "home again")
    assert [s[0] for s in seen] == ["remote", "home", "home again"]
    assert seen[1][1:] == (0, rnn_multi._stream(cupy, 0, 0).ptr) and seen[2][1:] == (0, rnn_multi._stream(cupy, 0, 1).ptr)
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
    assert synced == {rnn_multi._stream(cupy, 0, 0).ptr, rnn_multi._stream(cupy, 1, 0).ptr}


def test_host_arrays_keep_threads():
    pb = types.SimpleNamespace(xp=np)
    assert isinstance(rnn_multi._pool(pb, [None]), rnn_multi._Threads)
