"""blasx.dnn's host arithmetic under torch's floating-point rules: an ``inf - inf`` or ``0 / 0`` inside a layer
gives NaN silently, as torch's (and CuPy's) kernels do, where numpy would warn (an error under ``-W error`` or the
caller's ``np.errstate(invalid="raise")``). Overflow stays the caller's to hear about (float16 results)."""

from __future__ import annotations

import functools

import numpy as np


def torch_fp_rules(fn):
    """``fn`` run with numpy's invalid-value and divide-by-zero warnings off."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with np.errstate(invalid="ignore", divide="ignore"):
            return fn(*args, **kwargs)
    return call
