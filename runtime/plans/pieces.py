"""A GEMM whose A and B are grids of separate arrays ("pieces"): GEMM's own plan, its A and B tiles read
from the piece holding them.

Each stored operand (canonical, column-major) is cut by row and column bounds into pieces, each one
operand of the call: A's pieces in row-major grid order from slot 0, then B's, then the planner's other
operands (C, its first contents, split-k's scratch) in their order. Every interior bound is a multiple
of the tile, so each tile lies inside one piece, at the same offsets from that piece's first tile as
from the whole operand's: the plan is GEMM's, only its A and B tile references move.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

from ..tasks import Task
from ..tiling import TileRef
from .gemm import SLOT_A, SLOT_B

#: Planner slots from this one on (C, C's first contents, the scratch) follow the pieces.
_FIRST_OTHER = SLOT_B + 1


def common_divisor(bounds) -> int:
    """The greatest common divisor of the interior bounds in ``bounds`` (each a sequence of piece bounds, first
    0, last the extent); 0 when none is interior."""
    return math.gcd(*(x for b in bounds for x in b[1:-1]))


def pieces_tile(tile: int, bounds) -> int:
    """The largest tile <= ``tile`` that divides every bound in ``bounds`` (as :func:`common_divisor` takes them;
    the last is not needed to divide): ``tile`` when none is interior."""
    g = common_divisor(bounds)
    if g == 0:
        return tile
    return max(d for d in range(1, min(g, tile) + 1) if g % d == 0)


def n_pieces(bounds) -> int:
    """Pieces of one operand cut by ``bounds = (row_bounds, col_bounds)``."""
    return (len(bounds[0]) - 1) * (len(bounds[1]) - 1)


def _moved(ref: TileRef, base: int, rows, cols, tile: int) -> TileRef:
    p = bisect.bisect_right(rows, ref.r0) - 1
    q = bisect.bisect_right(cols, ref.c0) - 1
    r0, c0 = ref.r0 - rows[p], ref.c0 - cols[q]
    if r0 % tile or c0 % tile or ref.r0 + ref.rows > rows[p + 1] or ref.c0 + ref.cols > cols[q + 1]:
        raise ValueError(f"tile at ({ref.r0}, {ref.c0}) of {ref.rows}x{ref.cols} crosses a piece bound "
                         f"(rows {rows}, columns {cols}, tile {tile})")
    return ref._replace(slot=base + p * (len(cols) - 1) + q, bi=r0 // tile, bj=c0 // tile, r0=r0, c0=c0)


def on_pieces(tasks: list[Task], a_bounds, b_bounds, tile: int) -> list[Task]:
    """GEMM's ``tasks`` (planned with ``tile`` on the whole stored A and B) on pieces: ``a_bounds`` /
    ``b_bounds`` are (row bounds, column bounds) of the stored A / B, each interior bound a multiple of
    ``tile``. Raises ValueError if a tile crosses a bound."""
    na, nb = n_pieces(a_bounds), n_pieces(b_bounds)
    shift = na + nb - _FIRST_OTHER

    def move(ref: TileRef | None) -> TileRef | None:
        if ref is None:
            return None
        if ref.slot == SLOT_A:
            return _moved(ref, 0, *a_bounds, tile)
        if ref.slot == SLOT_B:
            return _moved(ref, na, *b_bounds, tile)
        return ref._replace(slot=ref.slot + shift)

    return [dataclasses.replace(t, c=move(t.c), c_init=move(t.c_init),
                                steps=tuple(s._replace(a=move(s.a), b=move(s.b)) for s in t.steps))
            for t in tasks]
