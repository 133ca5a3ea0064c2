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
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def retires_writes(fn):
    """``fn`` with the host arrays it may have written (its ``WRITTEN`` arguments, and its first argument when
    ``inplace`` is true) retired from the read-only registry when it returns or raises; ``fn`` unchanged when
    it takes none of them. The arguments are found by position or keyword, worked out once here."""
    params = list(inspect.signature(fn).parameters.values())

    def spot(name):
        p = next((q for q in params if q.name == name), None)
        return None if p is None else (name, params.index(p) if p.kind in _POSITIONAL else None)
    spots = [s for s in map(spot, WRITTEN) if s is not None]
    flag = spot("inplace")
    if not spots and flag is None:
        return fn
    first = (params[0].name, 0)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            if READONLY.holds_roots():
                found = [_given(args, kwargs, s) for s in spots]
                if flag is not None and _true(_given(args, kwargs, flag)):
                    found.append(_given(args, kwargs, first))
                flat = [y for x in found for y in (x if isinstance(x, (tuple, list)) else (x,))
                        if isinstance(y, np.ndarray)]
                if flat:
                    READONLY.drop_written(flat)
    return call


def _given(args, kwargs, spot):
    name, pos = spot
    return args[pos] if pos is not None and pos < len(args) else kwargs.get(name)


def _true(flag) -> bool:
    return flag is True or (isinstance(flag, np.bool_) and bool(flag))
