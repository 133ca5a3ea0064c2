"""In-place inversion of one triangular tile by recursive blocking (the TRSM diagonal step).

cuBLAS runs a large triangular solve tile at about a third of a GEMM tile's rate and a
triangular multiply at nearly a GEMM's. A TRSM call solves every diagonal block of A once per
block column of B: with the block's inverse computed once per call (an inversion task of
``plans.plan_trsm(inverse=True)``), each of those solves becomes a TRMM, ``X = op(A_ii)^-1 B =
op(A_ii^-1) B``. This is how MAGMA's GPU trsm works (``trtri_diag`` then products).

The inverse of the stored triangle is built in place, in a buffer holding a copy of it:

    lower:  [[L11, 0], [L21, L22]]^-1 = [[X11, 0], [-X22 L21 X11, X22]]
    upper:  [[U11, U12], [0, U22]]^-1 = [[X11, -X11 U12 X22], [0, X22]]

so after inverting the first half in place, the off-diagonal block is multiplied by it
(a TRMM), the second half is inverted, and the block is multiplied by that one with
alpha = -1. Blocks of at most ``leaf`` are inverted directly (a small solve against the
identity). All but 1/2^depth of the n^3/3 flops run as TRMMs.

Only the stored triangle is read (with a unit diagonal, not the diagonal: every product and
leaf takes ``diag`` as given) and only it holds the result; a leaf may overwrite the rest of
its diagonal block, so the buffer is scratch, never the caller's matrix.

This module is pure: :func:`tri_inverse_ops` returns the operations as plain tuples, in
order; a backend runs them with its own kernels (``cuda``: cuBLAS trsm/trmm on sub-block
pointers), and the tests run them with numpy against ``numpy.linalg.inv``.
"""

from __future__ import annotations

from typing import NamedTuple


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
    """The leaf inversions and products that invert a ``size`` triangle in place, in order.

    Halves are split at a multiple of ``leaf`` when the size allows (aligned sub-blocks),
    else at the middle; ``lower`` names the stored triangle (1 lower, 0 upper).
    """
    if leaf < 1:
        raise ValueError(f"leaf: got {leaf!r}, need an int >= 1")
    if size < 0:
        raise ValueError(f"size: got {size!r}, need an int >= 0")
    ops: list = []

    def invert(lo: int, hi: int) -> None:
        if hi - lo <= leaf:
            ops.append(Leaf(lo, hi - lo))
            return
        half = (hi - lo) // 2
        if half >= leaf:
            half -= half % leaf
        h = lo + half
        if lower:  # W21 = -X22 (L21 X11)
            blk = (h, lo, hi - h, h - lo)
            invert(lo, h)
            ops.append(Product(1, lo, h - lo, blk, False))
            invert(h, hi)
            ops.append(Product(0, h, hi - h, blk, True))
        else:  # W12 = (-X11 U12) X22
            blk = (lo, h, h - lo, hi - h)
            invert(lo, h)
            ops.append(Product(0, lo, h - lo, blk, True))
            invert(h, hi)
            ops.append(Product(1, h, hi - h, blk, False))

    if size:
        invert(0, size)
    return ops
