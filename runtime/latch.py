"""A one-shot flag that waiters hit by an asynchronous exception cannot wedge.

``threading.Event`` enters its Condition through Python frames (``Condition.__enter__`` / ``__exit__``); an
asynchronous exception (Ctrl-C in the main thread, ``PyThreadState_SetAsyncExc`` in another) raised right after
the inner acquire leaves the Event's lock held for good, and the worker that later sets the Event blocks forever.
A :class:`Latch` holds no lock while it is open: ``set`` raises a flag and releases a raw lock that waiters only
try with a bounded timeout, so a waiter interrupted anywhere costs at most one poll to the others, never the setter.

:func:`wait_through` is the waiter's side of the same rule: a call that must not return while its work still
touches the caller's buffers waits again through a Ctrl-C and raises it after; :func:`sigint_recorded` holds a
Ctrl-C back while threads start (one raised inside ``Thread.start()`` or between two starts would orphan them).
"""

from __future__ import annotations

import contextlib
import threading
import time

POLL = 0.05  # s: a waiter rechecks the flag at least this often (only matters after an interrupted waiter)


class Latch:
    """``set()`` once; ``is_set()``; ``wait(timeout)`` -> whether set (the ``threading.Event`` subset used here)."""

    __slots__ = ("_flag", "_gate")

    def __init__(self) -> None:
        self._flag = False
        self._gate = threading.Lock()
        self._gate.acquire()  # released by set: a waiter's acquire returns at once from then on

    def set(self) -> None:
        if not self._flag:
            self._flag = True  # first: a waiter that finds the gate taken by another waiter still sees the flag
            try:
                self._gate.release()
            except RuntimeError:  # another thread's set released it first
                pass

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._flag:
            left = POLL if deadline is None else min(POLL, deadline - time.monotonic())
            if left <= 0:
                break
            if self._gate.acquire(timeout=left):
                try:
                    self._gate.release()  # open for the next waiter
                except RuntimeError:  # a racing second set() released it for us
                    pass
        return self._flag


def wait_through(wait, pending=None, on_first=None, held=BaseException):
    """Calls ``wait()`` again until it returns, keeping any ``held`` exception it raised (a Ctrl-C) instead of
    letting it out: returns the first one kept (or ``pending``, one kept by an earlier wait of the same call),
    for the caller to raise once all its waits are done. ``on_first(exc)`` runs once, when the first is kept
    (to make the awaited work stop early). An exception not ``held`` propagates."""
    while True:
        try:
            wait()
            return pending
        except held as exc:  # noqa: BLE001 - kept, raised by the caller after its waits
            if pending is None:
                pending = exc
                if on_first is not None:
                    on_first(exc)


@contextlib.contextmanager
def sigint_recorded():
    """In the main thread (with a Python SIGINT handler), a SIGINT inside the block is recorded instead of
    handled; yields a function that runs the handler for it, if one came (Python's raises KeyboardInterrupt).
    Elsewhere, or with SIGINT ignored or defaulted, a no-op."""
    import signal
    old = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if not callable(old):
        yield lambda: None
        return
    got: list = []
    signal.signal(signal.SIGINT, lambda signum, frame: got.append(frame))
    try:
        yield lambda: old(signal.SIGINT, got[0]) if got else None
    finally:
        signal.signal(signal.SIGINT, old)
