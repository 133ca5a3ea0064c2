"""In-place inversion of one triangular tile by recursive blocking (TRSM's inversion tasks).

With each diagonal block inverted once per call (``plans.plan_trsm(inverse=True)``), every diagonal
solve becomes a multiply, which GPUs run much faster (as MAGMA's trsm does). In a copy of the
stored triangle:

    lower:  [[L11, 0], [L21, L22]]^-1 = [[X11, 0], [-X22 L21 X11, X22]]
    upper:  [[U11, U12], [0, U22]]^-1 = [[X11, -X11 U12 X22], [0, X22]]

down to blocks of at most ``leaf``, inverted directly. Only the stored triangle is read and written
(``diag`` as given), but a leaf may overwrite the rest of its block: the buffer is scratch. Pure:
:func:`tri_inverse_ops` lists the operations in order, which a backend runs with its kernels.
"""

from __future__ import annotations

from typing import NamedTuple

from .trsm_blocks import split


class Leaf(NamedTuple):
    """W[d0:d0+size, d0:d0+size] = its own triangle's inverse."""
    d0: int
    size: int


class Product(NamedTuple):
    """W[blk] = s * W[a0:a0+a_size, a0:a0+a_size] @ W[blk] (side 0) or s * W[blk] @ W[a...] (side 1),
    the diagonal block's stored triangle already inverted; s = -1 if ``negate`` else 1. ``blk`` is
    (r0, c0, rows, cols)."""
    side: int
    a0: int
    a_size: int
    blk: tuple[int, int, int, int]
    negate: bool


def tri_inverse_ops(size: int, lower: int, leaf: int) -> list:
    """The leaf inversions and products that invert a ``size`` triangle in place, in order; halves are
    split by :func:`~.trsm_blocks.split`; ``lower`` names the stored triangle (1 lower, 0 upper)."""
    if leaf < 1:
        raise ValueError(f"leaf: got {leaf!r}, need an int >= 1")
    if size < 0:
        raise ValueError(f"size: got {size!r}, need an int >= 0")
    ops: list = []

    def invert(lo: int, hi: int) -> None:
        if hi - lo <= leaf:
            ops.append(Leaf(lo, hi - lo))
            return
        h = split(lo, hi, leaf)
        # The off-diagonal block, times X11 then X22: lower W21 = -X22 (L21 X11), upper W12 = (-X11 U12) X22.
        blk = (h, lo, hi - h, h - lo) if lower else (lo, h, h - lo, hi - h)
        invert(lo, h)
        ops.append(Product(1 if lower else 0, lo, h - lo, blk, not lower))
        invert(h, hi)
        ops.append(Product(0 if lower else 1, h, hi - h, blk, bool(lower)))

    if size:
        invert(0, size)
    return ops
