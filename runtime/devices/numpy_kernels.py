"""Tile kernels on numpy views, shared by the ``sim`` and ``cpu`` backends.

Each kernel updates the C tile ``c`` in place from tiles ``a`` and ``b``,
with scalars taken from the call's scalar table by the step's indices. BLAS
rules hold: with ``beta == 0`` C is overwritten and never read.
"""

from __future__ import annotations

OPS = (lambda x: x, lambda x: x.T, lambda x: x.conj().T)  # indexed by op code N, T, C


def gemm(step, scalars, a, b, c) -> None:
    prod = OPS[step.op_a](a) @ OPS[step.op_b](b)
    alpha, beta = scalars[step.alpha], scalars[step.beta]
    if alpha != 1:
        prod *= alpha
    if beta == 0:
        c[...] = prod
    else:
        if beta != 1:
            c *= beta
        c += prod


def scale(step, scalars, a, b, c) -> None:
    beta = scalars[step.beta]
    if beta == 0:
        c[...] = 0
    else:
        c *= beta


def axpby(step, scalars, a, b, c) -> None:
    """c += beta * b: folds the old C tile (b) into a product computed with beta = 0."""
    c += scalars[step.beta] * b


KERNELS = {"gemm": gemm, "scale": scale, "axpby": axpby}
