"""The convolution's fused epilogue, conv -> +bias -> *scale + shift -> +residual -> activation, as the
engine's per-channel epilogue (runtime/epilogues.py: ChannelAffine, one per C slot of the call)."""

from __future__ import annotations

from typing import NamedTuple

from ..operands import array_module, is_cupy
from ..runtime.epilogues import ChannelAffine, PerSlot


class Affine(NamedTuple):
    """The device route's epilogue: y = act(conv * scale + shift) per output channel, the vectors numpy or CuPy
    arrays (None: 1, 0), read on the device where they already are (no wait for the GPU)."""

    scale: object
    shift: object
    activation: object


def parts(bias, scale, shift) -> tuple:
    """(scale, shift) of the epilogue y = conv * scale + shift, float64, computed where the vectors are (CuPy where
    any is: a CuPy vector is never read on the host): shift = bias * scale + shift. (A residual starts the C tile,
    so a call with a residual has no scale here: conv.py runs such a call's scale in a pass of its own.)"""
    xp = vector_module(bias, scale, shift)

    def f64(v):
        return None if v is None else xp.asarray(v, dtype=xp.float64)
    bias, scale, shift = f64(bias), f64(scale), f64(shift)
    total = bias
    if scale is not None and total is not None:
        total = total * scale
    if shift is not None:
        total = shift if total is None else total + shift
    return scale, total


def device_affine(bias, scale, shift, act):
    """The device route's Affine, or None where there is nothing to do (see :func:`parts`)."""
    epi_scale, total = parts(bias, scale, shift)
    if epi_scale is None and total is None and act is None:
        return None
    return Affine(epi_scale, total, act)


def make_epilogue(bias, scale, shift, act, slots: dict):
    """The engine's epilogue, or None where there is nothing to do. ``slots`` maps each C slot of the call to
    (axis, first channel, channels): its rows (axis 0) or columns (axis 1) take the values of channels
    ``first .. first + channels - 1``, repeating (see :func:`parts`)."""
    epi_scale, total = parts(*(_host(v) for v in (bias, scale, shift)))
    if epi_scale is None and total is None and act is None:
        return None

    def part(v, first, n):
        return None if v is None else v[first:first + n]
    return PerSlot({slot: ChannelAffine(axis, part(epi_scale, first, n), part(total, first, n), act)
                    for slot, (axis, first, n) in slots.items()})


def _host(v):
    return v.get() if is_cupy(v) else v  # the engine's epilogues hold host vectors (each device gets a copy)


def vector_module(*vectors):
    """cupy where any of ``vectors`` is a CuPy array, else numpy."""
    return array_module(any(is_cupy(v) for v in vectors if v is not None))
