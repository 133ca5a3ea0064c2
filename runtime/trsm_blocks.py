"""Recursive blocking of one triangular-solve tile (the TRSM diagonal step).

Splitting the triangle in two (mirrored for upper and for the right side), down to ``leaf``,

    left, op(A) lower:   X1 = op(A)11^-1 alpha B1;  B2 = alpha B2 - op(A)21 X1;  X2 = op(A)22^-1 B2

turns all but 1/2^depth of the flops into GEMMs, which GPUs run faster than solves. Pure:
:func:`trsm_tile_ops` lists the sub-operations in order; ``A`` is the stored triangle, ``B`` the
m x n right-hand side, overwritten by X; op(A) blocks are in op-coordinates ``(r0, c0, rows, cols)``
(:func:`stored_block` maps them to stored blocks).
"""

from __future__ import annotations

from typing import NamedTuple

from .tiling import OP_N, effective_lower


class Solve(NamedTuple):
    """B[b_rows, b_cols] = s op(A[d0:d0+size, d0:d0+size])^-1 B[...] (side 0), or B op(..)^-1 (side 1);
    ``first``: s is the step's alpha, else 1."""
    d0: int
    size: int
    b_r0: int
    b_c0: int
    b_rows: int
    b_cols: int
    first: bool


class Update(NamedTuple):
    """B[c block] = s B[c block] - op(A)[a block] @ X[x block] (side 0) or - X[x block] @ op(A)[a block]
    (side 1); ``first``: s is the step's alpha, else 1. Blocks as (r0, c0, rows, cols); the A block
    in op-coordinates."""
    a: tuple[int, int, int, int]
    x: tuple[int, int, int, int]
    c: tuple[int, int, int, int]
    first: bool


def stored_block(a: tuple[int, int, int, int], op: int) -> tuple[int, int, int, int]:
    """The stored block (r0, c0, rows, cols) holding op(A)'s block ``a``; apply ``op`` to it."""
    r0, c0, rows, cols = a
    return a if op == OP_N else (c0, r0, cols, rows)


def split(lo: int, hi: int, leaf: int) -> int:
    """Where [lo, hi) is halved: at a multiple of ``leaf`` from lo when the size allows (aligned
    sub-blocks), else the middle."""
    half = (hi - lo) // 2
    return lo + (half - half % leaf if half >= leaf else half)


def trsm_tile_ops(m: int, n: int, side: int, lower: int, op: int, leaf: int) -> list:
    """The sub-solves and updates of one tile solve, in execution order; a tile whose triangle is at
    most ``leaf`` (or 1) is one :class:`Solve`, larger ones are halved by :func:`split`."""
    if leaf < 1:
        raise ValueError(f"leaf: got {leaf!r}, need an int >= 1")
    size = m if side == 0 else n
    # Forward when the solved part comes first in the product order: left/lower, right/upper.
    forward = bool(effective_lower(lower, op)) == (side == 0)
    ops: list = []

    def b_rows(lo, hi):  # the part of B a solve of op(A)[lo:hi, lo:hi] touches
        return (lo, 0, hi - lo, n) if side == 0 else (0, lo, m, hi - lo)

    def solve(lo: int, hi: int, first: bool) -> None:
        if hi - lo <= leaf:
            ops.append(Solve(lo, hi - lo, *b_rows(lo, hi), first))
            return
        h = split(lo, hi, leaf)
        done, rest = ((lo, h), (h, hi)) if forward else ((h, hi), (lo, h))
        solve(*done, first)
        if side == 0:  # B_rest -= op(A)[rest, done] X_done
            a = (rest[0], done[0], rest[1] - rest[0], done[1] - done[0])
        else:  # B_rest -= X_done op(A)[done, rest]
            a = (done[0], rest[0], done[1] - done[0], rest[1] - rest[0])
        ops.append(Update(a, b_rows(*done), b_rows(*rest), first))
        solve(*rest, False)

    if size:
        solve(0, size, True)
    return ops
