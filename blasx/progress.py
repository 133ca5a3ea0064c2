"""A progress line for blasx calls (tiles done / total, rate, elapsed) on a text stream: inside
``with Progress(sys.stderr, label="run 0", flops=f):`` a monitor thread reads the calling thread's
running call (:func:`blasx.level3.running_call`) a few times a second and redraws the line in place.
"""

from __future__ import annotations

import sys
import threading
import time

from .level3 import running_call
from .runtime.latch import Latch

INTERVAL_S = 0.2  # between redraws: a few updates a second
BAR_WIDTH = 24
THREAD_NAME = "blasx-progress"


def wanted(flag: bool | None, stream) -> bool:
    """``--progress`` (True) / ``--no-progress`` (False) / neither (None: only on a terminal)."""
    if flag is not None:
        return bool(flag)
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def render(label: str, done: int, total: int, elapsed: float, flops: float | None = None,
           state: str = "") -> str:
    """One progress line (no ``\\r``, no newline), e.g.
    ``run 0 [############------------]  128/256 tiles  50%  61.2 tiles/s  0.51 TFLOPS  2.1 s``.

    ``flops``: the whole call's flops, for an estimated rate (tiles are near equal);
    ``state``: appended as is (``"failed"``, ``"done"``)."""
    frac = min(max(done / total, 0.0), 1.0) if total > 0 else 0.0
    fill = int(round(frac * BAR_WIDTH))
    bar = "[" + "#" * fill + "-" * (BAR_WIDTH - fill) + "]"
    parts = [f"{label} {bar}" if label else bar, f"{done:>{len(str(total))}}/{total} tiles", f"{frac * 100:3.0f}%"]
    if elapsed > 0:
        parts.append(f"{done / elapsed:.3g} tiles/s")
        if flops:
            parts.append(flop_rate(frac * flops / elapsed))
    parts.append(f"{elapsed:.1f} s")
    if state:
        parts.append(state)
    return "  ".join(parts)


def flop_rate(v: float) -> str:
    """'61.2 TFLOPS', '512 GFLOPS', '20.9 MFLOPS' (sims run slow)."""
    for unit, scale in (("TFLOPS", 1e12), ("GFLOPS", 1e9)):
        if v >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{v / 1e6:.3g} MFLOPS"


def call_counts(call) -> tuple[int, int]:
    """(tasks accounted for, tasks) of a running :class:`~blasx.runtime.call.Call`."""
    total = call.n_tasks
    return max(0, total - call.remaining), total


class Progress:
    """A context manager drawing a progress line on ``stream`` while the thread that enters runs
    blasx calls (each call inside the block replaces the previous one on the line); ``enabled=False``
    makes it do nothing."""

    def __init__(self, stream=None, label: str = "", flops: float | None = None, enabled: bool = True,
                 interval: float | None = None) -> None:
        if interval is not None and not interval > 0:
            raise ValueError(f"interval: got {interval!r}, need a number of seconds > 0")
        self.stream = stream if stream is not None else sys.stderr
        self.label, self.flops, self.enabled, self.thread_ident = label, flops, enabled, None
        self.interval = interval if interval is not None else INTERVAL_S
        self.updates = 0  # lines drawn (intermediate and final)
        self._stop = Latch()
        self._monitor: threading.Thread | None = None
        self._call, self._t0, self._width = None, 0.0, 0

    # ---------------------------------------------------------------- drawing
    def _draw(self, line: str, end: str = "") -> None:
        pad = max(0, self._width - len(line))
        try:
            self.stream.write("\r" + line + " " * pad + end)
            self.stream.flush()
        except (ValueError, OSError):  # the stream was closed under us: stop drawing, never fail the call
            self.enabled = False
            return
        self._width = len(line)
        self.updates += 1

    def _snapshot(self, state: str = "") -> str | None:
        self._call = running_call(self.thread_ident) or self._call  # (the last call seen, once it has ended)
        if self._call is None:
            return None
        done, total = call_counts(self._call)
        return render(self.label, done, total, time.perf_counter() - self._t0, self.flops, state)

    def _run(self, stop: Latch) -> None:
        while not stop.wait(self.interval):
            line = self._snapshot()
            if line is not None and self.enabled:
                self._draw(line)

    # ---------------------------------------------------------------- context manager
    def __enter__(self) -> "Progress":
        if not self.enabled:
            return self
        self.thread_ident, self._t0 = threading.get_ident(), time.perf_counter()
        self._stop = Latch()  # a fresh one a use (a Latch is one-shot)
        self._monitor = threading.Thread(target=self._run, args=(self._stop,), name=THREAD_NAME, daemon=True)
        self._monitor.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        self._stop.set()
        monitor.join()
        if not self.enabled:
            return
        line = self._snapshot("failed" if exc_type is not None else "")
        if line is not None:
            self._draw(line, "\n")
        elif self.updates:
            self._draw("", "\n")
