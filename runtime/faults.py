"""Test-only fault hooks: named points of a call at which a test may inject a failure.

Library code calls :func:`at` at each phase; it does nothing unless a test installed a hook
(:func:`install`), which runs in the thread reaching the phase and may raise there or interrupt a
caller's thread (:func:`interrupt`): the interrupt matrix and the soak use them. Phases, in call
order: ``plan``, ``register``, ``submit`` (the calling thread: tasks planned, host memory being
registered, tasks about to be queued); ``load``, ``compute``, ``writeback`` (a stream worker issuing
a tile copy, a kernel, an output copy home); ``cpu`` (the CPU worker, before a task).
"""

from __future__ import annotations

import ctypes
import signal
import threading

_hook = None  # fn(phase, device, task) or None


def at(phase: str, device=None, task=None) -> None:
    """Phase ``phase`` is reached (by ``device``'s worker for ``task``, where they apply)."""
    hook = _hook
    if hook is not None:
        hook(phase, device, task)


def install(hook) -> None:
    """Set the hook (None removes it)."""
    global _hook
    _hook = hook


def interrupt(thread_id: int, exc: type = KeyboardInterrupt) -> None:
    """Raise ``exc`` in thread ``thread_id`` as soon as it runs Python code: a real SIGINT for the
    main thread (it also ends a blocking wait there, as Ctrl-C does), else an async exception."""
    if thread_id == threading.main_thread().ident and exc is KeyboardInterrupt:
        signal.pthread_kill(thread_id, signal.SIGINT)
        return
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc))
