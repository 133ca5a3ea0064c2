"""The caller's arrays of a blasx.dnn front end against the read-only registry (operands.READONLY): those it
writes outside the engine (an ``out=``, an ``inplace`` input, batch norm's running statistics) retire the
read-only roots they overlap after the call, as the engine retires those of the views it writes, so no cached
tile of that memory outlives the write; and those it is given writable retire their own roots before it (a call
that sees an array writable again, whatever copy of it the engine gets)."""

from __future__ import annotations

import functools
import inspect

import numpy as np

from ..dispatch import seen_writable
from ..operands import READONLY

#: parameters naming a caller's array that a front end may write
WRITTEN = ("out", "running_mean", "running_var", "num_batches_tracked")
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def retires_writes(fn):
    """``fn`` with its writable arguments' read-only roots retired first, and the host arrays it may have written
    (its ``WRITTEN`` arguments, and its first argument when ``inplace`` is true) retired from the read-only
    registry when it returns or raises. The arguments are found by position or keyword, worked out once here."""
    params = list(inspect.signature(fn).parameters.values())

    def spot(name):
        p = next((q for q in params if q.name == name), None)
        return None if p is None else (name, params.index(p) if p.kind in _POSITIONAL else None)
    spots = [s for s in map(spot, WRITTEN) if s is not None]
    flag = spot("inplace")
    first = (params[0].name, 0) if params else None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if READONLY.holds_roots():
            seen_writable((*args, *kwargs.values()))
        try:
            return fn(*args, **kwargs)
        finally:
            if (spots or flag is not None) and READONLY.holds_roots():
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
