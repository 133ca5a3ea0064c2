"""``with blasx.dask.offload():``: dask.array's matmul, ``@``, dot and tensordot on 2-D arrays
run on blasx.dask; any other call (N-D, non-BLAS types, unknown chunk sizes, masked arrays) runs dask's own
function."""

from __future__ import annotations

import contextlib
import operator
import threading

import dask.array as da
import dask.array.routines as _routines

# (``a @ b`` needs no patch: dask's ``Array.__matmul__`` calls ``dask.array.routines.matmul`` as it is at call time,
# after its check for an operand type it defers to)
_ORIG = {"matmul": _routines.matmul, "dot": _routines.dot, "tensordot": _routines.tensordot}
_lock = threading.Lock()
_depth = 0


def original_matmul(a, b):
    return _ORIG["matmul"](a, b)


def _matmul(a, b):
    from .routines import matmul
    return matmul(a, b)


def _takes(a, b) -> bool:
    """blasx.dask runs this product (:func:`routines.blas_operands`): else dask's own function, with its type."""
    from .routines import blas_operands
    return blas_operands(a, b)


def _dot(a, b):
    if getattr(a, "ndim", 0) in (1, 2) and getattr(b, "ndim", 0) in (1, 2) and _takes(a, b):
        return _matmul(a, b)
    return _ORIG["dot"](a, b)


def _index(v):
    """``v`` as a Python int if it is an integer (numpy's too), else None."""
    try:
        return operator.index(v)
    except TypeError:
        return None


def _contracted(axes):
    """(a's axis, b's axis) of a 2-D tensordot contracting one axis of each, or None (any other ``axes``, an axis
    out of range included: dask's own function takes it, and raises where it must)."""
    if _index(axes) == 1:
        return 1, 0
    if not isinstance(axes, (tuple, list)) or len(axes) != 2:
        return None
    pair = []
    for v in axes:
        if _index(v) is None:
            if not isinstance(v, (tuple, list)) or len(v) != 1:
                return None
            v = v[0]
        i = _index(v)
        if i is None or not -2 <= i <= 1:
            return None
        pair.append(i % 2)
    return tuple(pair)


def _tensordot(a, b, axes=2):
    """2-D tensordot contracting one axis of each is one gemm (a transpose flag per operand)."""
    if getattr(a, "ndim", 0) == 2 and getattr(b, "ndim", 0) == 2 and _takes(a, b):
        pair = _contracted(axes)
        if pair is not None:
            return _matmul(a if pair[0] == 1 else a.T, b if pair[1] == 0 else b.T)
    return _ORIG["tensordot"](a, b, axes=axes)


_PATCH = {"matmul": _matmul, "dot": _dot, "tensordot": _tensordot}


def _install(on: bool) -> None:
    for name, f in (_PATCH if on else _ORIG).items():
        setattr(da, name, f)
        setattr(_routines, name, f)


@contextlib.contextmanager
def offload():
    """Within the block (process-wide, nestable), ``dask.array.matmul``, ``a @ b``, ``da.dot`` and
    ``da.tensordot`` on 1-D / 2-D dask arrays of the BLAS types build blasx.dask graphs."""
    global _depth
    with _lock:
        _depth += 1
        if _depth == 1:
            _install(True)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _install(False)
