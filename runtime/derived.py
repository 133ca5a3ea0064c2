"""Derived operands: matrices with no memory of their own, their tiles made on the device that needs them.

A derived operand (``Operand.derive``, a :class:`Derivation`) is a virtual ``rows x cols`` matrix computed
from another operand of the same call, its *source* (im2col's col(X) from the input X, a normal operand, in
host or device memory). A worker missing one of its tiles loads it with ``copy_in(..., DerivedSource(...))``
on its host-copy stream: the device reads the part of the source the tile needs and expands it into the tile's
cache line (``fill``; the sim and cpu devices use the numpy values of ``host_tile``). The expanded tile is then
an ordinary line: cached, copied to peers (PeerSource), evicted. A C tile is never derived.

Front ends put a derivation in the call's views in its slot (``make_operand`` turns it into the Operand);
the source's own view must be among the views too (its slot is ``source_slot``), so it is page-locked and
tokened as every operand. Tiles are keyed ``(token, bi, bj)`` with whatever ranges the planner gives them; the
token is the source's plus ``key``, which must fix the values of every keyed tile given the source's memory and
the tile size, so the tiles of a read-only source stay cached across calls and are retired with it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Hashable

from .call import Operand


class Derivation(ABC):
    """A virtual ``rows x cols`` matrix of one call, made from the operand in slot ``source_slot``,
    whose view (as in the call's views) is ``source_view``."""

    def __init__(self, rows: int, cols: int, source_view: Any, source_slot: int) -> None:
        self.rows = rows
        self.cols = cols
        self.source_view = source_view
        self.source_slot = source_slot

    @property
    @abstractmethod
    def key(self) -> Hashable:
        """What fixes a tile's values besides the source's memory, the tile size and (bi, bj)."""

    @abstractmethod
    def host_tile(self, source: Operand, ref) -> Any:
        """The values of tile ``ref`` (a ``ref.rows x ref.cols`` numpy array) from the host source."""

    def fill(self, dev, s: int, dst, source: Operand, ref) -> None:
        """Issue on stream ``s`` of CUDA device ``dev`` the work writing tile ``ref`` at ``dst = (ptr, ld)``."""
        raise NotImplementedError(f"{type(self).__name__} has no CUDA fill")

    @abstractmethod
    def nbytes_read(self, ref) -> int:
        """Bytes of the source a fill of tile ``ref`` reads (for the stats)."""

    def operand(self, tokens) -> Operand:
        """The call's Operand for this derivation (``tokens``: the call's TokenTable)."""
        base, *geom = tokens.token(self.source_view)
        token = (base, "derived", *geom, type(self).__name__, self.key)
        return Operand(None, self.rows, self.cols, self.rows, 0, -1, token, derive=self)


def source_of(call, operand: Operand) -> Operand:
    """The operand a derived ``operand`` of ``call`` is made from."""
    return call.operands[operand.derive.source_slot]


def host_tile(call, operand: Operand, ref):
    """Tile ``ref`` of ``operand`` of ``call`` as a numpy array: a view of its host memory, or the
    values of a derived tile."""
    if operand.derive is not None:
        return operand.derive.host_tile(source_of(call, operand), ref)
    return operand.array[ref.r0:ref.r0 + ref.rows, ref.c0:ref.c0 + ref.cols]
