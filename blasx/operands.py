"""Operands in canonical form, and their cache identity (tokens).

The engine works on column-major matrices: every operand is a column-major view ``V`` with
``X = V`` or ``X = V.T`` (a C-ordered array is its transpose's view), and the op a kernel applies
follows from (transposed, conjugated); conjugation without transposition, not a BLAS op, is
materialised once. Tokens (the engine's invariant 3): a fresh negative base per call for host
arrays that may be written and for device arrays; a positive base for the life of a host array
whose whole base chain is read-only (its tiles stay cached across calls).
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref

import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy < 2
    from numpy import byte_bounds

from .runtime.call import Operand
from .runtime.derived import Derivation
from .runtime.tiling import OP_C, OP_N, OP_T

# (transposed, conjugated) -> BLAS op on the column-major view; (0, 1) has none.
OP_OF = {(False, False): OP_N, (True, False): OP_T, (True, True): OP_C}

_call_bases = itertools.count(-1, -1)


def is_cupy(x) -> bool:
    return type(x).__module__.startswith("cupy")


def _is_column_major(x) -> bool:
    """True if x is a column-major matrix with some leading dimension >= its rows."""
    r, c = x.shape
    isz = x.itemsize
    s0, s1 = x.strides
    return (r <= 1 or s0 == isz) and (c <= 1 or (s1 > 0 and s1 % isz == 0 and s1 >= isz * r))


def column_major_view(x):
    """(V, t) with V column-major and x == (V.T if t else V); None for other strides."""
    if _is_column_major(x):
        return x, False
    if _is_column_major(x.T):
        return x.T, True
    return None


def canonical(x, op: int, transposed_problem: bool, cm=None):
    """(V, blas_op) such that the problem's operand (op(x), transposed if the problem is) == blas_op(V).
    ``cm``: x's :func:`column_major_view`, where the caller has it."""
    if cm is None:
        cm = column_major_view(x)
    if cm is None:  # arbitrary strides: one contiguous copy
        x = array_module(is_cupy(x)).asfortranarray(x)
        cm = (x, False)
    v, t = cm
    trans = t ^ (op != OP_N) ^ transposed_problem
    conj = op == OP_C
    if (trans, conj) not in OP_OF:  # conjugate, no transpose: materialise conj(V)
        return array_module(is_cupy(v)).asfortranarray(v.conj()), OP_N
    return v, OP_OF[(trans, conj)]


def array_module(on_gpu: bool):
    """cupy for device arrays, else numpy."""
    if on_gpu:
        import cupy
        return cupy
    return np


def leading_dim(v) -> int:
    isz = v.itemsize
    return max(1, v.strides[1] // isz if v.shape[1] > 1 else v.shape[0])


def address(v) -> int:
    return int(v.data.ptr) if is_cupy(v) else int(v.ctypes.data)


# ---------------------------------------------------------------- read-only tokens

class _ReadOnlyRegistry:
    """Life-long bases for arrays that cannot be written (invariant 3)."""

    def __init__(self) -> None:
        # Re-entrant: ``_retire`` is a finalizer, run wherever the garbage collector frees a root,
        # also inside ``base_of``'s critical section in the same thread.
        self._lock = threading.RLock()
        self._by_id: dict[int, tuple[weakref.ref, int, int, int]] = {}  # id -> (root, base, memory lo, hi)
        self._next = itertools.count(1)
        self._spans = None  # (keys, bases, lo, hi) arrays of _by_id for drop_written; None: made again
        self.on_retire = None  # engine hook: retire the base's cached tiles

    def base_of(self, root) -> int:
        with self._lock:
            hit = self._by_id.get(id(root))
            if hit is not None and hit[0]() is root:
                return hit[1]
            base = next(self._next)
            self._by_id[id(root)] = (weakref.ref(root), base, *byte_bounds(root))
            self._spans = None
            weakref.finalize(root, self._retire, id(root), base)
            return base

    def holds_roots(self) -> bool:
        return bool(self._by_id)

    def drop_written(self, arrays) -> None:
        """Retire every root whose memory one of ``arrays`` (host arrays a call writes) overlaps: a write
        through an alias whose base chain never reaches the root (``np.frombuffer`` of its buffer, ctypes)
        changes what its cached tiles hold. A writing call does this before it starts and again when it ends
        (a call in another thread may have cached the root meanwhile)."""
        if not self._by_id:
            return
        spans = [byte_bounds(a) for a in arrays if isinstance(a, np.ndarray) and a.size]
        if not spans:
            return
        with self._lock:
            if not self._by_id:
                return
            if self._spans is None:  # (one vectorised test per written array, not a Python loop over the roots)
                keys = list(self._by_id)
                bases, los, his = (np.array([self._by_id[key][i] for key in keys], dtype=np.uint64) for i in (1, 2, 3))
                self._spans = np.array(keys, dtype=object), bases, los, his
            keys, bases, los, his = self._spans
            hit = np.zeros(len(keys), dtype=bool)
            for lo, hi in spans:
                hit |= (los < hi) & (lo < his)
            hits = list(zip(keys[hit].tolist(), bases[hit].tolist()))
        for key, base in hits:
            self._retire(key, base)

    def drop(self, root) -> None:
        """``root`` was seen writable again: its base (and the base's cached tiles) retired, if it has one."""
        with self._lock:
            hit = self._by_id.get(id(root))
        if hit is not None and hit[0]() is root:
            self._retire(id(root), hit[1])

    def _retire(self, key: int, base: int) -> None:
        with self._lock:
            hit = self._by_id.get(key)
            if hit is not None and hit[1] == base:
                del self._by_id[key]
                self._spans = None
        if self.on_retire is not None:
            self.on_retire(base)


READONLY = _ReadOnlyRegistry()
if hasattr(os, "register_at_fork"):  # (a parent thread may hold the lock at the fork)
    os.register_at_fork(after_in_child=lambda: setattr(READONLY, "_lock", threading.RLock()))


def frozen_root(x):
    """The owning root array if ``x`` and every array it views are read-only, else None."""
    if is_cupy(x) or x.flags.writeable:
        return None
    node = x
    while isinstance(node.base, np.ndarray):
        node = node.base
        if node.flags.writeable:
            return None
    # an ndarray owning its memory; not a window on foreign memory (a C extension's, or a bytes object's:
    # numpy's unpickling hands out writable arrays over bytes)
    return node if node.base is None and node.flags.owndata else None


def top_array(x):
    """The last ndarray of ``x``'s base chain."""
    while isinstance(x.base, np.ndarray):
        x = x.base
    return x


class TokenTable:
    """Tokens of one call: the same memory with the same geometry gets the same token."""

    def __init__(self, tile: int) -> None:
        self.tile = tile
        self._seen: dict = {}

    def token(self, v) -> tuple:
        geom = (address(v), v.shape[0], v.shape[1], leading_dim(v), v.dtype.str, self.tile)
        tok = self._seen.get(geom)
        if tok is not None:
            return tok
        root = frozen_root(v)
        if root is not None:
            tok = (READONLY.base_of(root), geom[0] - int(root.ctypes.data)) + geom[1:]
        else:
            if not is_cupy(v):  # a root read-only before and writable now: its cached tiles may be stale
                READONLY.drop(top_array(v))
            tok = (next(_call_bases),) + geom[1:]
        self._seen[geom] = tok
        return tok


def make_operand(v, tokens: TokenTable) -> Operand:
    if isinstance(v, Derivation):  # a derived operand: no memory of its own (runtime/derived.py)
        return v.operand(tokens)
    device = int(v.device.id) if is_cupy(v) else -1
    return Operand(v, v.shape[0], v.shape[1], leading_dim(v), address(v), device, tokens.token(v))
