"""Convolution geometry (pure): argument normalisation, output shapes, validation, layout detection.

Names and rules follow torch.nn.functional; every error names the argument, what was received and what
is allowed. Padding per spatial dim is a (lo, hi) pair (an int or a tuple of ints is symmetric; "same" and
"valid" as in torch; a tuple of pairs is this library's extension for asymmetric padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from .args import check_count, check_dtype, ints

SPATIAL = {1: "(N, C, L)", 2: "(N, C, H, W)", 3: "(N, C, D, H, W)"}


def padding_pairs(padding, nd: int, kernel, dilation, stride) -> tuple[tuple[int, int], ...]:
    """Per spatial dim (lo, hi) from an int, ``nd`` ints, ``nd`` (lo, hi) pairs, "same" or "valid"."""
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0),) * nd
        if padding == "same":
            if any(s != 1 for s in stride):
                raise ValueError(f"padding: 'same' is not supported for strided convolutions (stride={stride})")
            total = [d * (k - 1) for k, d in zip(kernel, dilation)]
            return tuple((t // 2, t - t // 2) for t in total)
        raise ValueError(f"padding: got {padding!r}; allowed: an int, a tuple of {nd} ints or of {nd} "
                         f"(lo, hi) pairs, 'same' or 'valid'")
    if isinstance(padding, (tuple, list)) and len(padding) == nd and all(isinstance(p, (tuple, list)) for p in padding):
        pairs = tuple(ints("padding", tuple(p), 2, 0) for p in padding)
        return pairs
    return tuple((p, p) for p in ints("padding", padding, nd, 0, single=True))


@dataclass(frozen=True)
class ConvGeometry:
    """One convolution as a gather: output pixel o reads input position u = o*stride - pad_lo + r*dilation
    of the *virtual* input, whose every ``insert``-th position is a real one (u // insert; zero
    insertion, for transposed convolutions) and the rest zeros, as is everything outside ``in_size``."""

    n: int  # batch
    c: int  # input channels
    k: int  # output channels
    groups: int
    in_size: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    pad_lo: tuple[int, ...]
    insert: tuple[int, ...]
    out_size: tuple[int, ...]

    @property
    def nd(self) -> int:
        return len(self.in_size)

    @property
    def cg(self) -> int:
        return self.c // self.groups

    @property
    def kg(self) -> int:
        return self.k // self.groups

    @property
    def p(self) -> int:
        return prod(self.out_size)

    @property
    def crs(self) -> int:
        return self.cg * prod(self.kernel)


def _shapes(fn: str, nd: int, x, weight):
    if x.ndim not in (nd + 1, nd + 2):
        raise ValueError(f"{fn}: x must be {nd + 2}-D {SPATIAL[nd]} (or {nd + 1}-D unbatched), "
                         f"got shape {tuple(x.shape)}")
    if weight.ndim != nd + 2:
        raise ValueError(f"{fn}: weight must be {nd + 2}-D, got shape {tuple(weight.shape)}")
    dt = check_dtype("x", x)
    if np.dtype(weight.dtype) != dt:
        raise TypeError(f"{fn}: x is {dt} but weight is {np.dtype(weight.dtype)}; they must match")
    shape = tuple(x.shape) if x.ndim == nd + 2 else (1, *x.shape)
    return shape, tuple(weight.shape)


def _channels(c: int, k: int, x, weight) -> None:
    """x has input channels and spatial extent, weight output channels and kernel extent (as torch requires; an
    empty sum would leave the output unwritten)."""
    if c == 0:
        raise ValueError(f"x: expected at least 1 channel, got x.shape={tuple(x.shape)}")
    if k == 0:
        raise ValueError(f"weight: expected at least 1 output channel, got weight.shape={tuple(weight.shape)}")
    if 0 in tuple(weight.shape)[2:]:
        raise ValueError(f"weight: every kernel size must be positive, got weight.shape={tuple(weight.shape)}")
    if 0 in tuple(x.shape)[-(weight.ndim - 2):]:
        raise ValueError(f"x: every spatial size must be positive (only the batch may be 0), got "
                         f"x.shape={tuple(x.shape)}")


def conv_geometry(fn: str, nd: int, x, weight, stride, padding, dilation, groups) -> ConvGeometry:
    """The geometry of conv{nd}d(x, weight, ...) after torch's checks (x may be unbatched)."""
    (n, c, *size), (k, cg, *kernel) = _shapes(fn, nd, x, weight)
    _channels(c, weight.shape[0], x, weight)
    groups = check_count("groups", groups)
    stride = ints("stride", stride, nd, 1, single=True)
    dilation = ints("dilation", dilation, nd, 1, single=True)
    pads = padding_pairs(padding, nd, kernel, dilation, stride)
    if c % groups:
        raise ValueError(f"groups: input channels {c} (x.shape={tuple(x.shape)}) are not divisible by groups={groups}")
    if k % groups:
        raise ValueError(f"groups: output channels {k} (weight.shape={tuple(weight.shape)}) are not divisible "
                         f"by groups={groups}")
    if cg * groups != c:
        raise ValueError(f"weight: expected weight.shape[1] == {c // groups} (x's {c} channels / groups={groups}), "
                         f"got weight.shape={tuple(weight.shape)}")
    out = []
    for i in range(nd):
        padded = size[i] + pads[i][0] + pads[i][1]
        span = dilation[i] * (kernel[i] - 1) + 1
        if span > padded:
            raise ValueError(f"{fn}: kernel size {tuple(kernel)} (dilated: {span} in dim {i}) can't be greater than "
                             f"the padded input size {padded} (x.shape={tuple(x.shape)}, padding={pads})")
        out.append((padded - span) // stride[i] + 1)
    return ConvGeometry(n, c, k, groups, tuple(size), tuple(kernel), stride, dilation,
                        tuple(p[0] for p in pads), (1,) * nd, tuple(out))


def transpose_geometry(fn: str, nd: int, x, weight, stride, padding, output_padding, groups, dilation,
                       output_size=None) -> ConvGeometry:
    """conv_transpose{nd}d(x, weight (in, out/groups, k...), ...) as the gather of a convolution of x,
    zero-inserted by the stride, with the flipped, transposed kernel (stride 1). ``output_size``
    (backward-data's input size) sets output_padding instead."""
    (n, c, *size), (cw, kg, *kernel) = _shapes(fn, nd, x, weight)
    _channels(c, weight.shape[1], x, weight)
    groups = check_count("groups", groups)
    stride = ints("stride", stride, nd, 1, single=True)
    dilation = ints("dilation", dilation, nd, 1, single=True)
    pads = padding_pairs(padding, nd, kernel, dilation, stride)
    if cw != c:
        raise ValueError(f"weight: expected weight.shape[0] == {c} (x's channels), "
                         f"got weight.shape={tuple(weight.shape)}")
    if c % groups:
        raise ValueError(f"groups: input channels {c} (x.shape={tuple(x.shape)}) are not divisible by groups={groups}")
    base = [(size[i] - 1) * stride[i] - pads[i][0] - pads[i][1] + dilation[i] * (kernel[i] - 1) + 1 for i in range(nd)]
    if output_size is not None:
        want = tuple(output_size)[-nd:]
        opad = tuple(w - b for w, b in zip(want, base))
        if any(not 0 <= o < s for o, s in zip(opad, stride)):  # (its forward gives grad_output's size)
            raise ValueError(f"input_size: {tuple(output_size)} cannot be reached from grad_output's spatial size "
                             f"{tuple(size)} (possible sizes per dim: {base} + [0, stride))")
    else:
        opad = ints("output_padding", output_padding, nd, 0, single=True)
        for o, s, d in zip(opad, stride, dilation):
            if o >= s and o >= d:
                raise ValueError(f"output_padding: got {output_padding!r}; it must be smaller than either stride "
                                 f"({stride}) or dilation ({dilation})")
    out = tuple(b + o for b, o in zip(base, opad))
    if any(o < 1 for o in out):
        raise ValueError(f"{fn}: output size {out} is not positive (x.shape={tuple(x.shape)}, padding={pads})")
    pad_lo = tuple(dilation[i] * (kernel[i] - 1) - pads[i][0] for i in range(nd))
    return ConvGeometry(n, c, kg * groups, groups, tuple(size), tuple(kernel), (1,) * nd, dilation, pad_lo,
                        stride, out)


def is_layout(x, lay: str) -> bool:
    """Whether x's memory is compact in layout ``lay`` ("nchw" or "cl"): both hold where the two coincide
    (one channel, or one pixel an image), which :func:`layout` reports as "nchw"."""
    if lay == "nchw":
        return bool(x.flags.c_contiguous)
    return bool(x.transpose(0, *range(2, x.ndim), 1).flags.c_contiguous)


def call_layout(x, out=None) -> str:
    """The layout a call on batched ``x`` works in: x's (:func:`layout`; "nchw" for an x in neither, which is
    copied), except that an x compact in both layouts (one channel, or one pixel an image) takes that of
    ``out`` (batched, or None), which it then keeps."""
    lay = layout(x) or "nchw"
    if out is not None and lay == "nchw" and is_layout(x, "cl") and not is_layout(out, "nchw") and \
            is_layout(out, "cl"):
        return "cl"
    return lay


def layout(x) -> str | None:
    """"nchw" for a C-contiguous array, "cl" for channels-last (an NCHW-shaped view of N(spatial)C memory,
    any spatial rank), else None (the front end copies it to C-contiguous)."""
    if x.flags.c_contiguous:
        return "nchw"
    moved = x.transpose(0, *range(2, x.ndim), 1)
    if moved.flags.c_contiguous:
        return "cl"
    return None
