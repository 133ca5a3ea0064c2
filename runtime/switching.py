"""Python's thread switch interval while calls run (an experiment switch, off by default).

A worker that wants to issue waits for the GIL until its holder blocks or the switch interval ends, so a
shorter interval while calls are in flight bounds that wait. Process-wide: set when the first concurrent
call starts, put back when the last ends (unless changed meanwhile).
"""

from __future__ import annotations

import sys
import threading


class SwitchInterval:
    """Reference-counted ``sys.setswitchinterval(seconds)`` around calls; None: leave it alone."""

    def __init__(self, seconds: float | None) -> None:
        if seconds is not None and not (isinstance(seconds, (int, float)) and 0 < seconds < 1):
            raise ValueError(f"switch_interval: got {seconds!r}, need seconds in (0, 1), or None")
        self.seconds = seconds
        self._lock = threading.Lock()
        self._users = 0
        self._saved: float | None = None
        self._ours: float | None = None  # the value as Python stores it (microseconds, rounded)

    def __enter__(self) -> "SwitchInterval":
        if self.seconds is not None:
            with self._lock:
                self._users += 1
                if self._users == 1:
                    self._saved = sys.getswitchinterval()
                    sys.setswitchinterval(self.seconds)
                    self._ours = sys.getswitchinterval()
        return self

    def __exit__(self, *exc) -> None:
        if self.seconds is not None:
            with self._lock:
                self._users -= 1
                if self._users == 0 and sys.getswitchinterval() == self._ours:  # not changed by anyone since
                    sys.setswitchinterval(self._saved)
