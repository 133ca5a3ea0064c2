"""runtime.latch.Latch: a one-shot flag whose waiters, interrupted anywhere, never wedge the setter or the other
waiters (threading.Event's Condition can be left locked by an asynchronous exception); wait_through."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

from blasx.runtime import latch
from blasx.runtime.latch import Latch


def test_set_wait_and_timeout():
    a = Latch()
    assert not a.is_set()
    t0 = time.monotonic()
    assert a.wait(0.02) is False and time.monotonic() - t0 >= 0.02
    assert a.wait(0) is False
    a.set()
    a.set()  # a second set is a no-op
    assert a.is_set() and a.wait() and a.wait(0) and a.wait(1)


def test_waiters_wake_at_set():
    a, woke = Latch(), []
    threads = [threading.Thread(target=lambda: woke.append(a.wait(10))) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    a.set()
    for t in threads:
        t.join(5)
    assert woke == [True] * 4 and time.monotonic() - t0 < 1


def test_a_waiter_interrupted_holding_the_gate_costs_others_one_poll():
    """As if a waiter got an asynchronous exception between its acquire and its release: the gate stays taken,
    yet later and blocked waiters still return within a poll, and set() (already done) never blocked."""
    a = Latch()
    a.set()
    assert a._gate.acquire(blocking=False)  # the interrupted waiter's hold, never released
    t0 = time.monotonic()
    assert a.wait() and a.wait(5)
    assert time.monotonic() - t0 < 4 * latch.POLL


def test_async_exceptions_at_random_points_never_wedge_it():
    """Many waiters hit by async KeyboardInterrupts at random moments, then set: set returns at once and every
    surviving waiter sees the flag."""
    for _ in range(20):
        a, seen = Latch(), []

        def waiter():
            try:
                while not a.wait(0.001):
                    pass
                seen.append(True)
            except KeyboardInterrupt:
                seen.append(False)
        threads = [threading.Thread(target=waiter) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads[::2]:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(KeyboardInterrupt))
        time.sleep(0.005)
        t0 = time.monotonic()
        a.set()
        assert time.monotonic() - t0 < 0.5
        for t in threads:
            t.join(5)
        assert not any(t.is_alive() for t in threads) and len(seen) == 4 and a.wait(1)


def test_wait_through_keeps_the_first_interrupt_and_waits_again():
    """wait_through: a held exception is kept and the wait called again until it returns; on_first runs once;
    an earlier kept one wins; an exception not held propagates."""
    calls, first = [], []
    script = [KeyboardInterrupt("a"), KeyboardInterrupt("b"), None]

    def wait():
        calls.append(1)
        e = script.pop(0)
        if e is not None:
            raise e
    got = latch.wait_through(wait, on_first=first.append)
    assert len(calls) == 3 and str(got) == "a" and [str(e) for e in first] == ["a"]
    earlier = RuntimeError("earlier")
    script[:] = [KeyboardInterrupt("c"), None]
    assert latch.wait_through(wait, earlier, on_first=first.append) is earlier and len(first) == 1
    assert latch.wait_through(lambda: None) is None
    script[:] = [ValueError("not held")]
    with pytest.raises(ValueError):
        latch.wait_through(wait, held=KeyboardInterrupt)
