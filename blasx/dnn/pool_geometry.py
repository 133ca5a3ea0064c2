"""Pooling geometry (pure): torch.nn.functional's argument rules for max, average and adaptive pools, their
output sizes, and the per-dim windows the host and device kernels walk.

Every error names the argument, what was received and what is allowed. Pools of 1 or 2 spatial dims are
*lifted* to 3 (leading size-1 dims with a unit window), so one kernel serves every rank; a flat spatial index
(the indices of max pools) is unchanged by the lift.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .args import check_array, check_flag, ints, is_int
from .geometry import SPATIAL


@dataclass(frozen=True)
class PoolGeometry:
    """One pool over spatial dims ``in_size`` -> ``out_size``. Window pools: output o of a dim reads
    positions ``o*stride - padding + r*dilation`` (r < kernel) that lie inside the input; adaptive pools:
    positions ``floor(o*in/out)`` to ``ceil((o+1)*in/out)`` (exclusive)."""

    reduce: str  # "max" or "avg"
    adaptive: bool
    in_size: tuple[int, ...]
    out_size: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    count_include_pad: bool = True
    divisor_override: int = 0  # 0: none

    @property
    def nd(self) -> int:
        return len(self.in_size)

    def lifted(self) -> PoolGeometry:
        """The same pool over 3 spatial dims (size-1 leading dims with a unit window)."""
        k = 3 - self.nd
        one, zero = (1,) * k, (0,) * k
        return PoolGeometry(self.reduce, self.adaptive, one + self.in_size, one + self.out_size, one + self.kernel,
                            one + self.stride, zero + self.padding, one + self.dilation, self.count_include_pad,
                            self.divisor_override)


# ---------------------------------------------------------------- arguments

def check_input(fn: str, nd: int, x) -> tuple[int, int, tuple[int, ...], bool]:
    """(N, C, spatial size, unbatched) of a pool's input (dtype checked); non-batch dims must be non-empty."""
    check_array("input", x)
    return shape_of(fn, nd, "input", tuple(x.shape))


def shape_of(fn: str, nd: int, name: str, shape) -> tuple[int, int, tuple[int, ...], bool]:
    """(N, C, spatial size, unbatched) of the shape ``shape`` of a pool's input, checked as torch does."""
    if len(shape) not in (nd + 1, nd + 2):
        raise ValueError(f"{fn}: {name} must be {nd + 2}-D {SPATIAL[nd]} or {nd + 1}-D unbatched, got shape "
                         f"{tuple(shape)}")
    unbatched = len(shape) == nd + 1
    n, c, *size = (1, *shape) if unbatched else shape
    if any(s < 1 for s in (c, *size)):
        raise ValueError(f"{fn}: {name} must have non-empty channel and spatial dims (only the batch may be "
                         f"empty), got shape {tuple(shape)}")
    return int(n), int(c), tuple(int(s) for s in size), unbatched


def out_len(size: int, kernel: int, stride: int, pad: int, dilation: int, ceil_mode: bool) -> int:
    """torch's pooling output length: floor (or ceil) of the windows that fit; in ceil mode the last window
    must start inside the input or its left padding."""
    span = dilation * (kernel - 1) + 1
    out = (size + 2 * pad - span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def window(fn: str, nd: int, size, reduce: str, kernel_size, stride, padding, dilation=1, ceil_mode=False,
           count_include_pad=True, divisor_override=None) -> PoolGeometry:
    """The geometry of a max (``reduce="max"``) or average pool of an input of spatial size ``size``."""
    kernel = ints("kernel_size", kernel_size, nd, 1, one=True)
    if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0):
        stride = kernel
    strides = ints("stride", stride, nd, 1, one=True)
    pads = ints("padding", padding, nd, 0, one=True)
    dils = ints("dilation", dilation, nd, 1, one=True)
    ceil_mode = check_flag("ceil_mode", ceil_mode)
    count_include_pad = check_flag("count_include_pad", count_include_pad)
    if divisor_override is not None and (not is_int(divisor_override) or divisor_override == 0):
        raise ValueError(f"{fn}: divisor_override must be None or a non-zero int, got {divisor_override!r}")
    if reduce == "avg" and len(size) == 3 and any(s < k for s, k in zip(size, kernel)):  # torch's, 3-D avg only
        raise ValueError(f"{fn}: input size {tuple(size)} is smaller than kernel_size {kernel} (padding aside)")
    if any(p > k // 2 for p, k in zip(pads, kernel)):
        raise ValueError(f"{fn}: padding {padding!r} must be at most half the kernel size (kernel_size={kernel})")
    out = tuple(out_len(*a, ceil_mode) for a in zip(size, kernel, strides, pads, dils))
    if any(o < 1 for o in out):
        raise ValueError(f"{fn}: the output size {out} is too small (input size {tuple(size)}, kernel_size={kernel}, "
                         f"stride={strides}, padding={pads}, dilation={dils}); each must be >= 1")
    return PoolGeometry(reduce, False, tuple(size), out, kernel, strides, pads, dils, count_include_pad,
                        int(divisor_override or 0))


def adaptive(fn: str, nd: int, size, reduce: str, output_size) -> PoolGeometry:
    """The geometry of an adaptive pool: ``output_size`` an int or ``nd`` ints or Nones (None: the input's)."""
    vals = (output_size,) * nd if is_int(output_size) else output_size
    if (not isinstance(vals, (tuple, list)) or len(vals) != nd
            or not all(v is None or is_int(v) for v in vals)):
        raise ValueError(f"{fn}: output_size must be an int or a tuple of {nd} ints or Nones, got {output_size!r}")
    out = tuple(int(s) if v is None else int(v) for v, s in zip(vals, size))
    if any(o < 0 for o in out):
        raise ValueError(f"{fn}: output_size must be non-negative, got {output_size!r}")
    one = (1,) * nd
    return PoolGeometry(reduce, True, tuple(size), out, one, one, (0,) * nd, one)


# ---------------------------------------------------------------- windows (host kernels)

@dataclass(frozen=True)
class Windows:
    """One spatial dim's windows: output o reads ``start[o] + r*step`` for r < ``length[o]`` where inside
    [0, size); ``first[o]`` is the first such position (torch's initial max index); r < ``kmax``."""

    start: np.ndarray
    step: int
    length: np.ndarray
    first: np.ndarray
    kmax: int
    size: int


def windows(geo: PoolGeometry) -> list[Windows]:
    """Per spatial dim, the windows of ``geo``."""
    out = []
    for j in range(geo.nd):
        o = np.arange(geo.out_size[j], dtype=np.int64)
        s = geo.in_size[j]
        if geo.adaptive:
            start = o * s // geo.out_size[j] if geo.out_size[j] else o
            length = -(-(o + 1) * s // geo.out_size[j]) - start if geo.out_size[j] else o
            first, step = start, 1
        else:
            d = geo.dilation[j]
            start = o * geo.stride[j] - geo.padding[j]
            length = np.full_like(o, geo.kernel[j])
            first, step = start + np.maximum(-(start // d), 0) * d, d  # the first non-negative position
        out.append(Windows(start, step, length, first, int(length.max()) if len(length) else 0, s))
    return out


def empty_windows(geo: PoolGeometry) -> np.ndarray | None:
    """Boolean ``out_size`` array of the windows holding no input position (dilation with ceil_mode can make
    them: torch's max pool gives such a window -inf and an index past the plane, and its backward drops it);
    None where there is none."""
    if geo.adaptive:
        return None
    inside = []
    for w in windows(geo):
        r = np.arange(geo.kernel[len(inside)])
        pos = w.start[:, None] + r[None, :] * w.step
        inside.append(((pos >= 0) & (pos < w.size)).any(axis=1))
    if all(v.all() for v in inside):
        return None
    full = np.ones(geo.out_size, dtype=bool)
    for j, v in enumerate(inside):
        full &= v.reshape((1,) * j + (-1,) + (1,) * (geo.nd - j - 1))
    return ~full


def divisor(geo: PoolGeometry) -> np.ndarray:
    """The divisor of each output of an average pool (shape ``out_size``), as torch: divisor_override, or the
    window's size clipped to the padded input (count_include_pad) or to the input."""
    if geo.divisor_override:
        return np.full(geo.out_size, geo.divisor_override, dtype=np.int64)
    per_dim = []
    for w, pad in zip(windows(geo), geo.padding):
        if geo.adaptive:
            per_dim.append(w.length)
            continue
        end = np.minimum(w.start + w.length, w.size + pad)
        if geo.count_include_pad:
            per_dim.append(end - w.start)
        else:
            per_dim.append(np.minimum(end, w.size) - np.maximum(w.start, 0))
    total = per_dim[0]
    for c in per_dim[1:]:
        total = np.multiply.outer(total, c)
    return total
