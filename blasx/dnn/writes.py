"""The caller's arrays a blasx.dnn front end writes outside the engine (an ``out=``, an ``inplace`` input, batch
norm's running statistics): the read-only roots they overlap are retired after the call, as the engine retires
those of the views it writes (operands.READONLY), so no cached tile of that memory outlives the write."""

from __future__ import annotations

import functools
import inspect

import numpy as np

from ..operands import READONLY

#: parameters naming a caller's array that a front end may write
WRITTEN = ("out", "running_mean", "running_var", "num_batches_tracked")


def retires_writes(fn):
    """``fn`` with the host arrays it may have written (its ``WRITTEN`` arguments, and its first argument when
    ``inplace`` is true) retired from the read-only registry when it returns or raises; ``fn`` unchanged when
    it takes none of them."""
    sig = inspect.signature(fn)
    names = [p for p in WRITTEN if p in sig.parameters]
    inplace = "inplace" in sig.parameters
    if not names and not inplace:
        return fn
    first = next(iter(sig.parameters))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            if READONLY.holds_roots():
                READONLY.drop_written(_targets(sig, names, inplace, first, args, kwargs))
    return call


def _targets(sig, names, inplace, first, args, kwargs) -> list:
    try:
        given = sig.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return []  # (the call itself raised for these arguments, before any write)
    found = [given.get(n) for n in names]
    flag = given.get("inplace")
    if inplace and (flag is True or (isinstance(flag, np.bool_) and flag)):
        found.append(given.get(first))
    flat = []
    for x in found:
        flat.extend(x if isinstance(x, (tuple, list)) else (x,))
    return [x for x in flat if isinstance(x, np.ndarray)]
