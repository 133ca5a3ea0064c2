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


def test_a_remote_directions_copies_are_issued_before_any_loop(fake, monkeypatch):
    """A bidirectional layer with its reverse direction on another GPU: that direction's parameters and input
    are copied there first, on a stream of their own (the copies run while x's own direction is issued), and
    its loop's stream waits once more, for them; without PREFETCH the copies come with its own loop, after the
    home direction's."""
    from blasx import dnn
    cupy = fake.cupy
    monkeypatch.setattr(rnn_multi, "devices_for", lambda pb: [0, 1])
    rng = np.random.default_rng(0)
    H, B, T = 16, 4, 3
    p = {k + s: cupy.asarray(rng.standard_normal(shape).astype(np.float32)) for s in ("", "_reverse")
         for k, shape in (("weight_ih_l0", (4 * H, H)), ("weight_hh_l0", (4 * H, H)), ("bias_ih_l0", (4 * H,)),
                          ("bias_hh_l0", (4 * H,)))}
    x = cupy.asarray(rng.standard_normal((T, B, H)).astype(np.float32))
    dnn.lstm(x, None, p, bidirectional=True)  # graphs captured
    waits = {}
    for prefetch in (True, False):
        monkeypatch.setattr(rnn_multi, "PREFETCH", prefetch)
        fake_cupy.LOG.clear()
        dnn.lstm(x, None, p, bidirectional=True)
        assert rnn_multi.last_run()["ran_on"] == {(0, 0): 0, (0, 1): 1}
        log = list(fake_cupy.LOG)
        copies = [i for i, e in enumerate(log) if e[0] == "copy"]
        gemms = [i for i, e in enumerate(log) if e[0] == "gemm_ex"]
        assert len(gemms) == 2  # a projection a direction
        # four parameters and x to device 1, then S and the last cell state home (inference brings no more)
        assert [log[i][1] for i in copies] == [(4 * H, H)] * 2 + [(4 * H,)] * 2 + [(T, B, H), (T + 1, B, H),
                                                                                   (1, B, H)]
        assert (copies[4] < gemms[0]) == prefetch
        remote = [e[2] for e in log if e[0] == "graph_launch"][1]
        fetch = next(e[1] for e in log[copies[4]:] if e[0] == "event_record")
        assert (fetch != remote) == prefetch
        waits[prefetch] = log.count(("wait_event", remote))
    assert waits[True] == waits[False] + 1
