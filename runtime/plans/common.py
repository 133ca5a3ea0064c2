"""What the level-3 planners share: operand slots, flags, step and task flops, small step makers."""

from __future__ import annotations

from typing import Iterable

from ..call import step_flops
from ..tasks import SC_ALPHA, Step
from ..tiling import OP_N

# Operand slots, per routine. TRMM_C is B itself in place; TRSM_B is each task's initial C, TRSM_X may be
# B, TRSM_V (with ``inverse``) the scratch inverses of A's diagonal blocks (``inverse_ref``).
SYMM_A, SYMM_B, SYMM_C = 0, 1, 2
SYRK_A, SYRK_C = 0, 1
SYR2K_A, SYR2K_B, SYR2K_C = 0, 1, 2
TRMM_A, TRMM_B, TRMM_C = 0, 1, 2
TRSM_A, TRSM_B, TRSM_X, TRSM_V = 0, 1, 2, 3

SIDE_LEFT, SIDE_RIGHT = 0, 1
UPPER, LOWER = 0, 1


def task_flops(steps: Iterable[Step], is_complex: bool) -> float:
    return float(sum(step_flops(s, is_complex) for s in steps))


def _scale(c, beta_ix: int) -> Step:
    return Step("scale", None, None, OP_N, OP_N, c.rows, c.cols, 0, SC_ALPHA, beta_ix)


def _width(index: int, extent: int, tile: int) -> int:
    return min(tile, extent - index * tile)
