"""Sub-pixel (phase) decomposition of a strided transposed convolution (pure geometry).

A transposed convolution with stride s is a gather convolution of the zero-inserted input (``insert``
= s, see ``ConvGeometry``), where all but 1/s of the taps of each output pixel read zeros. Splitting the
output by position mod s (phase r writes y[..., r::s]), phase r reads only the taps m = m0 + s*a of the
flipped kernel with m0 = (pad_lo - r) mod s, each from a real input position: a stride-1 convolution of
x itself with that sub-kernel. Dilation > 1 keeps the zero-inserted gather (its taps need not split so).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from .geometry import ConvGeometry


@dataclass(frozen=True)
class Phase:
    """One phase: it writes y[..., offset::stride] with the forward (flipped) kernel's taps
    ``taps`` (a slice per spatial dim); ``geo`` is its stride-1 convolution, None where it has no
    taps (the phase is zeros, plus the bias)."""

    offset: tuple[int, ...]
    taps: tuple[slice, ...]
    out_size: tuple[int, ...]
    geo: ConvGeometry | None


def applies(geo: ConvGeometry) -> bool:
    """Whether ``geo`` (a transposed convolution's gather) splits into phases: some stride > 1, dilation 1."""
    return any(z > 1 for z in geo.insert) and all(d == 1 for d in geo.dilation)


# The device route's default for a strided transposed call (the find step may choose otherwise): the phases where
# every phase has taps, with this many output channels and input pixels an image; col2im (one GEMM) otherwise.
MIN_CHANNELS = 8
MIN_PIXELS = 784


def preferred(geo: ConvGeometry) -> bool:
    """Whether ``geo`` runs by its phases by default: no phase without taps (a 1x1 or a kernel smaller than the
    stride leaves zero phases, one GEMM does better), ``MIN_CHANNELS`` output channels (a first layer's three
    make each phase a thin GEMM) and ``MIN_PIXELS`` input pixels an image (fewer: the phases' launches and
    copies cost more than col2im's scatter)."""
    return applies(geo) and geo.k >= MIN_CHANNELS and _prod(geo.in_size) >= MIN_PIXELS and \
        all(ph.geo is not None for ph in phases(geo))


def _dim(pad_lo: int, k: int, s: int, out: int, r: int) -> tuple[slice, int, int, int]:
    """(taps, sub-kernel size, stride-1 pad_lo, outputs) of phase offset r in one spatial dim."""
    m0 = (pad_lo - r) % s
    return slice(m0, None, s), len(range(m0, k, s)), (pad_lo - r - m0) // s, len(range(r, out, s))


def phases(geo: ConvGeometry) -> list[Phase]:
    """The phases of ``geo`` (see :func:`applies`) with at least one output pixel, in row-major order."""
    out = []
    for offset in product(*(range(s) for s in geo.insert)):
        dims = [_dim(*a) for a in zip(geo.pad_lo, geo.kernel, geo.insert, geo.out_size, offset)]
        taps, kernel, pad, size = (tuple(v) for v in zip(*dims))
        if 0 in size:
            continue
        sub = None
        if 0 not in kernel:
            ones = (1,) * geo.nd
            sub = ConvGeometry(geo.n, geo.c, geo.k, geo.groups, geo.in_size, kernel, ones, ones, pad, ones, size)
        out.append(Phase(offset, taps, size, sub))
    return out


def gemm_flops(geo: ConvGeometry) -> tuple[int, int]:
    """(GEMM flops of the zero-inserted gather, of its phases): 2 * N * K * Cg * (taps x pixels) summed."""
    per = 2 * geo.n * geo.k * geo.cg
    whole = per * geo.p * int(_prod(geo.kernel))
    split = sum(per * ph.geo.p * _prod(ph.geo.kernel) for ph in phases(geo) if ph.geo is not None)
    return whole, split


def _prod(v) -> int:
    r = 1
    for e in v:
        r *= int(e)
    return r
