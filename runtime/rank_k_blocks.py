"""Recursive blocking of one rank-k diagonal tile (the SYRK/HERK/SYR2K/HER2K diagonal step).

A diagonal tile of a rank-k update writes one triangle of C: ``C_tri = alpha X Y^T + beta C_tri``
(``X = Y = op(A)`` for SYRK). In a DSYRK call at N=32768 on 2 H200s the diagonal steps cost ~23
ms more per GPU than the same flops as GEMM steps (bench/results/NOTES.md, fifth session), so
cuBLAS's syrk tile runs well below its GEMM rate. Splitting the triangle in two,

    lower:  C11 (triangle), C21 = alpha X2 Y1^T + beta C21 (a GEMM), C22 (triangle)

(upper: C12 = alpha X1 Y2^T + beta C12), and recursing down to ``leaf``, turns all but
1/2^depth of the flops into GEMMs on sub-blocks, with no change to what is computed.

This module is pure: :func:`rank_k_tile_ops` returns the sub-operations in order, in
C-coordinates; a backend runs them with its own kernels (``cuda``: cuBLAS syrk/herk/syr2k/her2k
on a diagonal block, gemm on an off-diagonal one, on sub-block pointers), and the tests run them
with numpy against scipy. An op's rows of C are rows of the left factors (X, and Y for SYR2K's
second term), its columns rows of the right ones.
"""

from __future__ import annotations

from typing import NamedTuple


class Tri(NamedTuple):
    """The rank-k kernel on the diagonal block C[d0:d0+size, d0:d0+size] (its stored triangle)."""
    d0: int
    size: int


class Rect(NamedTuple):
    """A GEMM on the off-diagonal block C[r0:r0+rows, c0:c0+cols]."""
    r0: int
    c0: int
    rows: int
    cols: int


def rank_k_tile_ops(n: int, lower: int, leaf: int) -> list:
    """The blocks of an n x n diagonal tile's ``lower`` (else upper) triangle, in order.

    A tile of at most ``leaf`` (or 1) is one :class:`Tri`. Halves are split at a multiple of
    ``leaf`` when the size allows (aligned sub-blocks), else at the middle.
    """
    if leaf < 1:
        raise ValueError(f"leaf: got {leaf!r}, need an int >= 1")
    ops: list = []

    def block(lo: int, hi: int) -> None:
        if hi - lo <= leaf:
            ops.append(Tri(lo, hi - lo))
            return
        half = (hi - lo) // 2
        if half >= leaf:
            half -= half % leaf
        h = lo + half
        block(lo, h)
        ops.append(Rect(h, lo, hi - h, h - lo) if lower else Rect(lo, h, h - lo, hi - h))
        block(h, hi)

    if n:
        block(0, n)
    return ops
