"""The worker side of blasx.dask: the block task, storage reads, the engine plugin, the memory counter.

A block task computes one output block on the worker's blasx engine from a :class:`Block` plan:
an initial value (zeros, or a piece of c, scaled) and a list of steps, each one blasx call on
pieces of the operands that accumulates into the block. Pieces come from the task's dependencies
(dask blocks, sliced as views) or are read from storage (zarr, np.memmap) one step ahead of use,
so a task holds its block plus at most two steps' storage pieces at a time.
"""

from __future__ import annotations

import dataclasses
import mmap
import threading
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from distributed.diagnostics.plugin import WorkerPlugin

import blasx
from blasx.blas3 import new_array
from blasx.operands import array_module, is_cupy
from blasx.pieces import gemm_pieces


class Ref(NamedTuple):
    """A rectangle of one operand: ``slot`` >= 0 indexes the task's dependency blocks (local
    coordinates), ``slot`` < 0 is storage ``-1 - slot`` of the plan (global coordinates)."""
    slot: int
    r0: int
    r1: int
    c0: int
    c1: int


class Storage:
    """An array in storage that pickles by reference: a zarr array (as itself), or a contiguous
    np.memmap (as its file, offset, dtype, shape and order: a memmap pickles as its whole data,
    and ``da.from_array`` copies one into the graph, so blasx.dask wraps a memmap in this first)."""

    @staticmethod
    def reads_file(arr) -> bool:
        """Whether a memmap's data is its file's, read back by offset: mapped (not a copy), contiguous, and
        not copy-on-write (mode 'c' keeps writes in this process)."""
        return (isinstance(arr, np.memmap) and arr._mmap is not None and arr.mode != "c"
                and (arr.flags.c_contiguous or arr.flags.f_contiguous))

    def __init__(self, arr):
        self.obj, self.file = None, None
        self.token = uuid.uuid4().hex  # every wrap is new data: a file or array rewritten in place is never
        #                                taken for an earlier call's (its mtime need not change)
        if isinstance(arr, np.memmap):
            if not Storage.reads_file(arr):
                raise ValueError("a memmap operand must be a contiguous, file-backed mapping (not mode 'c')")
            base = np.frombuffer(arr._mmap, np.uint8).ctypes.data
            start = arr.offset - arr.offset % mmap.ALLOCATIONGRANULARITY
            offset = start + (arr.ctypes.data - base)
            order = "C" if arr.flags.c_contiguous else "F"
            self.file = (str(arr.filename), offset, arr.dtype.str, arr.shape, order)
        else:
            self.obj = arr
        self.shape, self.dtype, self.ndim = tuple(arr.shape), np.dtype(arr.dtype), arr.ndim
        self._open = None

    def __getstate__(self):
        return {**self.__dict__, "_open": None}

    def __dask_tokenize__(self):
        return ("blasx-storage", self.token)

    def _array(self):
        if self.obj is not None:
            return self.obj
        if self._open is None:
            name, offset, dt, shape, order = self.file
            self._open = np.memmap(name, dtype=np.dtype(dt), mode="r", offset=offset, shape=shape, order=order)
        return self._open

    def __getitem__(self, index):
        return np.array(self._array()[index])

    def read(self, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        return self[r0:r1, c0:c1]


@dataclass(frozen=True)
class Block:
    """The plan of one output block. ``init``: ``("zeros",)`` or ``("copy", ref, scale)``;
    ``steps``: ``(op, args...)`` tuples whose Refs name the pieces each blasx call reads (see
    :func:`_apply`; a k = 0 step has ``("empty", rows, cols)`` for its pieces); ``stores``: the
    storage operands the Refs read."""
    shape: tuple[int, int]
    dtype: str
    init: tuple
    steps: tuple
    stores: tuple = ()


# ---------------------------------------------------------------- the memory counter

_lock = threading.Lock()
_held = 0
_peak = 0
_outputs: dict[int, int] = {}  # id -> bytes of the live output blocks of this worker's tasks


def _add(n: int) -> None:
    global _held, _peak
    with _lock:
        _held += n
        _peak = max(_peak, _held)


def _drop_output(key: int) -> None:
    _add(-_outputs.pop(key, 0))


def _track_output(x) -> None:
    try:
        weakref.finalize(x, _drop_output, id(x))
    except TypeError:  # an array type without weak references: not counted
        return
    _outputs[id(x)] = x.nbytes
    _add(x.nbytes)


def memory_stats(reset: bool = False) -> dict:
    """This process's counter: ``held`` (bytes of blasx.dask blocks alive now: output blocks, the
    running tasks' accumulators, storage pieces and dependency blocks) and ``peak`` (the most
    since the last reset). ``reset`` starts the peak again from ``held``."""
    global _peak
    with _lock:
        out = {"held": _held, "peak": _peak}
        if reset:
            _peak = _held
    return out


# ---------------------------------------------------------------- the block task

def _read(ref: Ref, deps, stores, xp):
    if ref.slot >= 0:
        return deps[ref.slot][ref.r0:ref.r1, ref.c0:ref.c1]
    x = stores[-1 - ref.slot].read(ref.r0, ref.r1, ref.c0, ref.c1)
    return x if xp is np else xp.asarray(x)


def refs_of(step) -> list:
    """The step's Refs in order, those nested in a grid step's tuples included."""
    out = []

    def walk(a):
        if isinstance(a, Ref):
            out.append(a)
        elif isinstance(a, tuple):
            for x in a:
                walk(x)
    for a in step[1:]:
        walk(a)
    return out


def _load(step, deps, stores, xp):
    """The step's pieces (storage reads counted while they live), in the order of its Refs."""
    pieces = []
    for ref in refs_of(step):
        x = _read(ref, deps, stores, xp)
        if ref.slot < 0:
            _add(x.nbytes)
        pieces.append(x)
    return pieces


def _release(step, pieces) -> None:
    for ref, x in zip(refs_of(step), pieces):
        if ref.slot < 0:
            _add(-x.nbytes)


def _filled(a, p):
    """Argument ``a`` with each Ref (nested ones too) replaced by the next of the pieces ``p``."""
    if isinstance(a, Ref):
        return next(p)
    if isinstance(a, tuple):
        return tuple(_filled(x, p) for x in a)
    return a


def join_order(grid) -> str:
    """The layout of a join: C where every piece is C-contiguous (each piece's copy is then whole rows, not a
    transposing copy), else F."""
    return "C" if all(p.flags.c_contiguous and not p.flags.f_contiguous for row in grid for p in row) else "F"


def _joined(xp, grid):
    """A matrix from a grid (rows of pieces): the piece itself where there is one, else one copy in the pieces'
    layout (:func:`join_order`), each piece written into its place (no row panels made first: a join holds only
    its result)."""
    if len(grid) == 1 and len(grid[0]) == 1:
        return grid[0][0]
    heights, widths = [row[0].shape[0] for row in grid], [p.shape[1] for p in grid[0]]
    out = xp.empty((sum(heights), sum(widths)), dtype=grid[0][0].dtype, order=join_order(grid))
    r0 = 0
    for row, h in zip(grid, heights):
        c0 = 0
        for p in row:
            out[r0:r0 + h, c0:c0 + p.shape[1]] = p
            c0 += p.shape[1]
        r0 += h
    return out


def _engine_runs(xp) -> bool:
    """Whether a task's gemm runs are each one engine call: CuPy blocks, or an engine with devices (the CPU
    alone runs each step as one host BLAS call)."""
    return xp is not np or not blasx.engine().inline


def _grid_gemm(args, acc, xp, beta=1.0):
    """acc = alpha op(A) op(B) + beta acc where A is the grid xs[k][i] (k: pieces of the shared dimension, i: of
    acc's rows) and B the grid ys[k][j] (j: of acc's columns), each piece stored as the operand stores it: one
    engine call reading the pieces in place (``blasx.pieces``) where the engine has devices and the pieces tile,
    else one call on their joins (device pieces) or one call a k interval (host pieces: a join of the whole k
    would add its panels to the worker's bounded host memory)."""
    alpha, xs, ta, ys, tb = args
    K, R = range(len(xs)), range(len(xs[0]))
    if _engine_runs(xp) and gemm_pieces(alpha, [[xs[k][i] for k in K] for i in R], ta, ys, tb, beta, acc):
        return acc
    if xp is np:
        for k in K:
            acc = _joined_gemm(alpha, xs[k:k + 1], ta, ys[k:k + 1], tb, acc, xp, beta if k == 0 else 1.0)
        return acc
    return _joined_gemm(alpha, xs, ta, ys, tb, acc, xp, beta)


def _joined_gemm(alpha, xs, ta, ys, tb, acc, xp, beta):
    """:func:`_grid_gemm` as one blasx call on the grids' joins (a grid of one piece is that piece)."""
    K, R, C = range(len(xs)), range(len(xs[0])), range(len(ys[0]))
    a = _joined(xp, [[xs[k][i] for k in K] for i in R] if ta == 0 else [[xs[k][i] for i in R] for k in K])
    b = _joined(xp, [[ys[k][j] for j in C] for k in K] if tb == 0 else [[ys[k][j] for k in K] for j in C])
    made = sum(x.nbytes for x, one in ((a, len(K) * len(R) == 1), (b, len(K) * len(C) == 1)) if not one)
    _add(made)
    try:
        return blasx.gemm(alpha, a, b, beta=beta, c=acc, trans_a=ta, trans_b=tb, overwrite_c=True)
    finally:
        _add(-made)


def _apply(step, pieces, acc, xp, fresh: bool = False):
    """One step: a blasx call on the pieces, accumulating into acc (F-ordered, written in place). ``fresh``: acc
    is uninitialised and the step a gemm, which then overwrites it (beta 0: its old contents are not read).
    Pieces of another type are converted to acc's here, counted while the step runs (scipy's rule: int8 and
    float16 too, whose reduced paths in blasx want an int32 or float16 / float32 result, not acc's)."""
    converted = [x.dtype != acc.dtype for x in pieces]
    pieces = [x.astype(acc.dtype) if c else x for x, c in zip(pieces, converted)]
    made = sum(x.nbytes for x, c in zip(pieces, converted) if c)
    _add(made)
    try:
        return _step(step, pieces, acc, xp, fresh)
    finally:
        _add(-made)


def _step(step, pieces, acc, xp, fresh: bool):
    """:func:`_apply`'s call, its pieces of acc's type."""
    op, p = step[0], iter(pieces)
    args = [_filled(a, p) for a in step[1:]]
    if op == "gemm_grid":  # acc += alpha op(A) op(B), A and B grids of pieces
        return _grid_gemm(args, acc, xp, 0.0 if fresh else 1.0)
    if op == "gemm":  # acc = alpha op(x) op(y) + beta acc
        alpha, x, ta, y, tb, beta = args
        return blasx.gemm(alpha, x, y, beta=0.0 if fresh else beta, c=acc, trans_a=ta, trans_b=tb, overwrite_c=True)
    if op in ("symm", "hemm"):
        alpha, x, y, beta, side, lower = args
        return getattr(blasx, op)(alpha, x, y, beta=beta, c=acc, side=side, lower=lower, overwrite_c=True)
    if op in ("syrk", "herk"):
        alpha, x, beta, trans, lower = args
        return getattr(blasx, op)(alpha, x, beta=beta, c=acc, trans=trans, lower=lower, overwrite_c=True)
    if op in ("syr2k", "her2k"):
        alpha, x, y, beta, trans, lower = args
        return getattr(blasx, op)(alpha, x, y, beta=beta, c=acc, trans=trans, lower=lower, overwrite_c=True)
    if op == "trmm":  # acc += alpha op(x) y, x the triangular diagonal block
        alpha, x, y, lower, trans, diag = args
        acc += blasx.trmm(alpha, x, y, side=0, lower=lower, trans_a=trans, diag=diag)
        return acc
    if op == "trsm":  # acc = op(x)^-1 acc
        x, lower, trans, diag = args
        return blasx.trsm(1.0, x, acc, side=0, lower=lower, trans_a=trans, diag=diag, overwrite_b=True)
    raise ValueError(f"step: unknown operation {op!r}")


def _init(plan: Block, deps, xp, fresh: bool = False):
    """The block's accumulator: zeros (uninitialised where ``fresh``: its first step overwrites it), or a scaled
    copy of c's piece. A large host block on GPUs is page-locked memory from blasx's result pool, as a result
    blasx makes is (``new_array``): the engine's copies into it then lock no fresh pages."""
    dtype = np.dtype(plan.dtype)
    if plan.init[0] == "zeros":
        return new_array(xp, plan.shape, dtype, None, zeros=not fresh)
    _, ref, scale = plan.init
    acc = new_array(xp, plan.shape, dtype, None)
    acc[...] = _read(ref, deps, plan.stores, xp)
    if scale != 1:
        acc *= scale
    return acc


def _with_empties(step, xp, dtype):
    """A k = 0 step names its pieces by shape (a tuple ``("empty", rows, cols)``): make them here."""
    return tuple(xp.zeros(a[1:], dtype=dtype, order="F") if isinstance(a, tuple) and a and a[0] == "empty" else a
                 for a in step)


def _join_runs(steps: list, join: bool) -> list:
    """With ``join`` (:func:`_engine_runs`): each run of gemm steps (plain or a super-block's ``gemm_grid``) with
    one (alpha, trans_a, trans_b) reading dependency blocks becomes one ``gemm_grid`` step (:func:`_grid_gemm`):
    one engine call over the run's whole k, whose C tiles get every k step (and split-k where they are few)
    instead of one call per k interval; a run of one keeps its step. Without: the steps as they are."""
    if not join:
        return steps
    out: list = []  # [step, the plain gemm step it stands for while a run of one, joinable]
    for s in steps:
        plain = s[0] == "gemm" and isinstance(s[2], Ref) and isinstance(s[4], Ref)
        g = ("gemm_grid", s[1], ((s[2],),), s[3], ((s[4],),), s[5]) if plain else s if s[0] == "gemm_grid" else None
        if g is None or not all(r.slot >= 0 for r in refs_of(g)):
            out.append([s, None, False])
            continue
        last = out[-1][0] if out and out[-1][2] else None
        if last is not None and (last[1], last[3], last[5], len(last[2][0]), len(last[4][0])) == \
                (g[1], g[3], g[5], len(g[2][0]), len(g[4][0])):
            out[-1] = [(last[0], last[1], last[2] + g[2], last[3], last[4] + g[4], last[5]), None, True]
        else:
            out.append([g, s if plain else None, True])
    return [orig or step for step, orig, _ in out]


def run_block(plan: Block, deps: list):
    """The task: the output block of ``plan`` from the dependency blocks ``deps``."""
    xp = array_module(any(is_cupy(d) for d in deps))
    held = sum(d.nbytes for d in {id(d): d for d in deps}.values() if id(d) not in _outputs)
    _add(held)
    acc = None
    try:
        steps = _join_runs([_with_empties(s, xp, np.dtype(plan.dtype)) for s in plan.steps], _engine_runs(xp))
        fresh = plan.init[0] == "zeros" and bool(steps) and steps[0][0] in ("gemm", "gemm_grid")
        acc = _init(plan, deps, xp, fresh)
        _add(acc.nbytes)
        pool = ThreadPoolExecutor(1) if plan.stores and len(steps) > 1 else None
        try:
            nxt = None
            for i, step in enumerate(steps):
                pieces = nxt.result() if nxt is not None else _load(step, deps, plan.stores, xp)
                nxt = (pool.submit(_load, steps[i + 1], deps, plan.stores, xp)
                       if pool is not None and i + 1 < len(steps) else None)
                try:
                    acc = _apply(step, pieces, acc, xp, fresh and i == 0)
                finally:
                    _release(step, pieces)
                    del pieces
        finally:
            if pool is not None:
                if nxt is not None:  # an error: the read ahead is dropped
                    try:
                        _release(steps[i + 1], nxt.result())
                    except Exception:  # noqa: BLE001 - the step's own error is the one raised
                        pass
                pool.shutdown()
    finally:
        _add(-held - (acc.nbytes if acc is not None else 0))
    _track_output(acc)
    return acc


# ---------------------------------------------------------------- the engine of each worker

class BlasxPlugin(WorkerPlugin):
    """A Dask worker plugin: ``blasx.configure(**settings)`` in each worker process as it starts
    (and again in a worker restarted after a crash). ``devices`` may name the worker:
    ``"cuda:{name}"`` gives worker 0 GPU 0, worker 1 GPU 1 (LocalCluster names workers 0, 1, ...)."""

    name = "blasx"
    idempotent = False

    def __init__(self, **settings):
        self.settings = settings

    def setup(self, worker=None):
        kw = dict(self.settings)
        if isinstance(kw.get("devices"), str) and "{" in kw["devices"]:
            kw["devices"] = kw["devices"].format(name=getattr(worker, "name", 0))
        before = dataclasses.asdict(blasx.session.settings())
        try:
            blasx.configure(**kw)
            blasx.engine()
        except BaseException:  # (devices this worker lacks: it keeps the settings it had, not broken ones)
            blasx.configure(**before)
            raise

    def teardown(self, worker=None):
        blasx.shutdown()


def engine_has_gpus() -> bool:
    """Whether this process's blasx engine (started here if it is not yet) runs on GPUs."""
    return any(getattr(d, "kind", "") == "cuda" for d in blasx.engine().devices)

