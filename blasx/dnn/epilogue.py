"""The convolution's fused epilogue, conv -> +bias -> *scale + shift -> +residual -> activation, as the
engine's per-channel epilogue (runtime/epilogues.py: ChannelAffine, one per C slot of the call)."""

from __future__ import annotations

import numpy as np

from ..runtime.epilogues import ChannelAffine, PerSlot


def make_epilogue(bias, scale, shift, act, residual: bool, slots: dict):
    """(epilogue or None, per-channel weight factor or None). ``slots`` maps each C slot of the call
    to (axis, first channel, channels): its rows (axis 0) or columns (axis 1) take the values of
    channels ``first .. first + channels - 1``, repeating. With a residual the C tile starts from it,
    so scale is folded into the weights (the factor returned) and bias*scale + shift is the shift."""
    def f64(v):
        return None if v is None else np.asarray(v, dtype=np.float64)
    bias, scale, shift = f64(bias), f64(scale), f64(shift)
    total = bias
    if scale is not None and total is not None:
        total = total * scale
    if shift is not None:
        total = shift if total is None else total + shift
    fold = scale if residual else None
    epi_scale = None if residual else scale
    if epi_scale is None and total is None and act is None:
        return None, fold

    def part(v, first, n):
        return None if v is None else v[first:first + n]
    return PerSlot({slot: ChannelAffine(axis, part(epi_scale, first, n), part(total, first, n), act)
                    for slot, (axis, first, n) in slots.items()}), fold
