"""The L2 tile cache: a MESI-X directory over every device's L1 (Fig. 3).

States of a tile, as the directory sees them:

* **I**: no device holds it; a reader loads it from its home (host memory or
  the device array it lives in).
* **E**: one device holds it; a second device that misses in its L1 copies it
  from that device over the peer link (an L2 hit) instead of from the host.
* **S**: several devices hold it; a reader picks any ready holder it has
  peer access to.
* **M**: a device has just written an output tile. In BLASX this state is
  ephemeral: the tile is written back to its home at once and becomes I
  (the written buffer is freed, or kept as a clean E line by routines that
  read their own output, such as TRSM).

Input tiles are never written during a call, so no invalidation traffic is
needed inside a call. Across calls, staleness is avoided by identity: a tile
key starts with a *token* that names the operand for the life of one call
(for writable host arrays and device arrays), or for the life of a read-only
host array. Tokens are never reused, so a line of a finished call can never
be hit again; retired tokens mark their lines dead and owners evict them
first.

Concurrency: one lock guards the directory and the metadata of every ALRU
(line presence, reader counts, ready events). Critical sections are a few
dict operations; no device call is made while holding it.
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
        """A line of another device that ``device`` can copy from (``can_read(holder)``).

        A complete line (``ready is None``) is preferred; a line whose fill is
        in flight (``ready`` is that fill's event) is next best: the reader's
        stream waits for the event, then copies over the peer link, which
        still beats the host link. Lines whose fill is not even recorded yet
        (``ready is filling``) are skipped, and so are in-flight lines for which
        ``soon(line)`` is false (the reader's own host link would be faster).
        """
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
        """No tile of any token of ``base`` may be read again: unlist its lines, mark them dead.

        A token is a tuple ``(base, *geometry)``; a base names one array for the
        life of a call, or a read-only array for its whole life.
        """
        self._dead_tokens[base] = None
        if len(self._dead_tokens) > 4096:
            del self._dead_tokens[next(iter(self._dead_tokens))]
        for key in [k for k in self._holders if k[0][0] == base]:
            for line in self._holders.pop(key).values():
                self.alrus[line.device].bury(line)

    def lines_of_base(self, base: int, live_only: bool = True) -> int:
        return sum(1 for alru in self.alrus for line in alru
                   if line.key[0][0] == base and not (live_only and line.dead))
