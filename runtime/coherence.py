"""The L2 tile cache: a MESI-X directory over every device's L1 (Fig. 3).

A tile is **I** (no holder: loaded from its home), **E** (one holder: others copy it over the peer link, an
L2 hit), **S** (several: a reader picks any ready holder it can reach) or **M** (just written: written back at
once and I again, or kept as a clean E line when the routine reads its own output, as TRSM). Nothing is
invalidated: inputs are not written during a call, tile keys start with never-reused tokens (engine invariant
3), and retired tokens' lines are dead, evicted first. One lock guards the directory and every ALRU's
metadata; no device call is made while holding it.
"""

from __future__ import annotations

import threading
from typing import Hashable

from .cache import ALRU, Line
from .station import WHERE_HOST, WHERE_L1, WHERE_L2

STATE_I, STATE_E, STATE_S = "I", "E", "S"


class Directory:
    def __init__(self, n_devices: int) -> None:
        self.lock = threading.Lock()
        self.alrus = [ALRU(d) for d in range(n_devices)]
        self._holders: dict[Hashable, dict[int, Line]] = {}
        # Recently retired tokens, so a line filled late for a finished call is born dead.
        self._dead_tokens: dict = {}
        # Per device: peers' copies from its lines not yet done (readers it lent); a failed device frees its memory
        # only once they are (its lines are dropped first, so its count only falls then).
        self.lent = [0] * n_devices

    def lend(self, line: Line) -> None:
        """A peer's copy from ``line`` begins (caller holds the lock): the line pinned, counted against its device."""
        line.readers += 1
        self.lent[line.device] += 1

    def unlend(self, line: Line) -> None:
        """That copy is done, or will never be (caller holds the lock)."""
        line.readers -= 1
        self.lent[line.device] -= 1

    # -- queries (caller holds the lock, or accepts a racy answer for priorities) --

    def where(self, key: Hashable, device: int) -> int:
        """Eq. 3b's case for ``key`` seen from ``device``: L1, L2 or host."""
        holders = self._holders.get(key)
        if not holders:
            return WHERE_HOST
        return WHERE_L1 if device in holders else WHERE_L2

    def state(self, key: Hashable) -> str:
        n = len(self._holders.get(key, ()))
        return STATE_I if n == 0 else STATE_E if n == 1 else STATE_S

    def holders(self, key: Hashable) -> dict[int, Line]:
        return self._holders.get(key, {})

    def peer_source(self, key: Hashable, device: int, can_read, filling=None, soon=None) -> Line | None:
        """A line of another device that ``device`` can copy from (``can_read(holder)``): a complete one
        first, else one whose fill is in flight if ``soon(line)``; never one not recorded yet (``filling``)."""
        holders = self._holders.get(key)
        if not holders:
            return None
        in_flight = None
        for d, line in holders.items():
            if d == device or line.dead or line.ready is filling or not can_read(d):
                continue
            if line.ready is None:
                return line
            if in_flight is None and (soon is None or soon(line)):
                in_flight = line
        return in_flight

    # -- updates (caller holds the lock) --

    def add(self, line: Line) -> None:
        self.alrus[line.device].insert(line)
        if line.key[0][0] in self._dead_tokens:
            self.alrus[line.device].bury(line)
            return
        self._holders.setdefault(line.key, {})[line.device] = line

    def drop(self, line: Line) -> None:
        """Remove a line from its ALRU and from the directory (the caller frees its heap block)."""
        self.alrus[line.device].remove(line)
        holders = self._holders.get(line.key)
        if holders is not None and holders.get(line.device) is line:
            del holders[line.device]
            if not holders:
                del self._holders[line.key]

    def retire_base(self, base: int) -> None:
        """No tile of any token ``(base, *geometry)`` may be read again: unlist its lines, mark them dead."""
        self._dead_tokens[base] = None
        if len(self._dead_tokens) > 4096:
            del self._dead_tokens[next(iter(self._dead_tokens))]
        for key in [k for k in self._holders if k[0][0] == base]:
            for line in self._holders.pop(key).values():
                self.alrus[line.device].bury(line)
