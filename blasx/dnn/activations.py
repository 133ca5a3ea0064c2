"""Activations of the fused epilogues (``activation=`` of blasx.dnn's layers): the parser and the
host reference forms. The table itself is the engine's (blasx.runtime.activations), which applies
them on the devices; this is the front ends' and the tests' name for it."""

from __future__ import annotations

import numpy as np

from ..runtime.activations import ALLOWED, NAMES, Activation, parse_activation

__all__ = ["ALLOWED", "NAMES", "Activation", "parse_activation", "reference"]


def reference(x, activation) -> np.ndarray:
    """``activation`` (anything :func:`parse_activation` takes) of the real array ``x`` on the
    host, in float64 for float64 input and float32 otherwise, returned in x's type."""
    x = np.asarray(x)
    act = parse_activation(activation)
    wide = x.astype(np.float64 if x.dtype == np.float64 else np.float32)
    return (wide if act is None else act.host(wide)).astype(x.dtype)
