"""L1 tile cache: the Approximate LRU of Algorithm 2, one per device.

A line maps a tile key to a heap block; ``readers`` counts the issued, unfinished operations using it (line
22). Eviction takes the least recent line *with no readers* (lines 11-18). Peers change reader counts (L2
copies), so line metadata is used under the directory lock, which every method here expects the caller to
hold; the heap behind the lines is touched by the owning worker alone.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Iterator


@dataclass(slots=True, eq=False, repr=False)
class Line:
    """One cached tile on one device."""

    key: Hashable
    device: int  # worker index of the holder
    offset: int  # heap offset of the tile (column-major, ld = rows)
    nbytes: int
    rows: int
    cols: int
    readers: int = 0
    ready: Any = None  # event that ends the copy filling the line; None once it is known done
    dead: bool = False  # its data may no longer be read (token retired); evict first
    # Filled from the host: the holder's ``h2d_issued`` once this fill is done (host traffic ahead of it); else None.
    fill_mark: int | None = None

    def __repr__(self) -> str:
        return f"Line({self.key!r} on {self.device} @{self.offset} readers={self.readers})"


class ALRU:
    """Lines of one device, least recent first. Dead lines (``bury``) are kept apart, in the order they
    died, and go first: a live line of the tile may be cached beside a dead one still read."""

    __slots__ = ("device", "_lines", "_dead")

    def __init__(self, device: int) -> None:
        self.device = device
        self._lines: OrderedDict[Hashable, Line] = OrderedDict()
        self._dead: dict[int, Line] = {}  # id(line) -> line

    def __len__(self) -> int:
        return len(self._lines) + len(self._dead)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._lines or any(line.key == key for line in self._dead.values())

    def __iter__(self) -> Iterator[Line]:
        yield from list(self._dead.values())
        yield from list(self._lines.values())

    def get(self, key: Hashable) -> Line | None:
        """Translate (Algorithm 2, line 2): the line, moved to most recent, or None."""
        line = self._lines.get(key)
        if line is not None:
            self._lines.move_to_end(key)
        return line

    def peek(self, key: Hashable) -> Line | None:
        """The line without touching recency (peers and priority look-ups)."""
        return self._lines.get(key)

    def insert(self, line: Line) -> None:
        """Enqueue (Algorithm 2, lines 19-23): a new line becomes the most recent."""
        if line.key in self._lines:
            raise KeyError(f"tile {line.key!r} is already cached on device {self.device}")
        self._lines[line.key] = line

    def victim(self) -> Line | None:
        """Dequeue (Algorithm 2, lines 11-18): the first idle line from the LRU end, dead lines first."""
        for lines in (self._dead, self._lines):
            for line in lines.values():
                if line.readers == 0:
                    return line
        return None

    def bury(self, line: Line) -> None:
        """Mark a line dead and set it apart: it is among the next to go, and no longer found by key."""
        if line.dead:
            return
        del self._lines[line.key]
        line.dead = True
        self._dead[id(line)] = line

    def remove(self, line: Line) -> None:
        if line.dead:
            del self._dead[id(line)]
        else:
            del self._lines[line.key]
