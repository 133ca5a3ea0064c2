"""Activations of the fused epilogues (``activation=`` of blasx.dnn's layers): the parser and the
host reference forms. The table itself is the engine's (blasx.runtime.activations), which applies
them on the devices; this is the front ends' and the tests' name for it."""

from __future__ import annotations

import numpy as np

from ..runtime.activations import ALLOWED, NAMES, Activation, parse_activation

__all__ = ["ALLOWED", "NAMES", "Activation", "affine_reference", "parse_activation", "reference"]


def reference(x, activation) -> np.ndarray:
    """``activation`` (anything :func:`parse_activation` takes) of the real array ``x`` on the
    host, in float64 for float64 input and float32 otherwise, returned in x's type."""
    x = np.asarray(x)
    act = parse_activation(activation)
    wide = x.astype(np.float64 if x.dtype == np.float64 else np.float32)
    return (wide if act is None else act.host(wide)).astype(x.dtype)


def affine_reference(y, axis: int, scale, shift, activation):
    """``activation(y * scale + shift)`` with the vectors along ``y``'s rows (axis 0) or columns
    (axis 1), in y's own type (None: not applied): ChannelAffine's host reference."""
    bc = (lambda v: v[:, None]) if axis == 0 else (lambda v: v[None, :])
    if scale is not None:
        y = y * bc(scale)
    if shift is not None:
        y = y + bc(shift)
    act = parse_activation(activation)
    return y if act is None else act.host(y)
