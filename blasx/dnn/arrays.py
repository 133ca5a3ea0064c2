"""What every blasx.dnn function does with its arrays: numpy (host) or CuPy (the array's GPU), never a mix;
results are made on the inputs' device; reductions of float16/bfloat16 run in float32."""

from __future__ import annotations

import contextlib

import numpy as np

from ..operands import array_module, is_cupy


def xp_of(*arrays):
    """numpy or cupy, the same for every given array (None skipped; TypeError when mixed)."""
    given = [a for a in arrays if a is not None]
    kinds = {is_cupy(a) for a in given}
    if len(kinds) > 1:
        raise TypeError("arrays: got a mix of numpy and cupy arrays; pass all numpy (host) or all cupy (GPU)")
    return array_module(kinds == {True})


def on_device_of(x):
    """A CuPy array's device as the current one (results are made there), else nothing."""
    return x.device if is_cupy(x) else contextlib.nullcontext()


def compute_dtype(dtype) -> np.dtype:
    """The type arithmetic runs in for arrays of ``dtype``: float64 stays, everything else float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)
