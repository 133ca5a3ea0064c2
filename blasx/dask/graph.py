"""The client side of blasx.dask: operands, boundaries and the task graph of one call.

Every dimension of a call is cut at the union of its operands' chunk boundaries on that
dimension, so each piece a step reads lies inside one block of each operand (no rechunk). An
output block is one task (:func:`blasx.dask.worker.run_block`) whose dependencies are the dask
blocks its steps read; operands in storage (``da.from_zarr``, a zarr array or an ``np.memmap``
given as an operand) are read by the task itself and add no dependency.
"""

from __future__ import annotations

import bisect
import itertools

import dask
import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.utils import parse_bytes
from dask.highlevelgraph import HighLevelGraph

from .worker import Block, Ref, Storage, engine_has_gpus, refs_of, run_block


#: dask.config's ``blasx.dask.task-bytes`` "auto" (the default): the most bytes of dependency blocks one task
#: takes; an output block whose steps read more is a chain of tasks (each link starts from a copy of the last's
#: block). Blocks read from GPUs (:func:`device_blocks`: CuPy blocks, or host blocks where every worker's engine
#: has GPUs) get the larger bound: a call reads them in place, tile by tile, onto GPUs of tens of GB, where the
#: links' copies would cost more memory than the larger bound does.
TASK_BYTES = 4 << 30
DEVICE_TASK_BYTES = 16 << 30


def bounds_of(chunks) -> tuple[int, ...]:
    return tuple(itertools.accumulate(chunks, initial=0))


def union(*bounds) -> tuple[int, ...]:
    return tuple(sorted(set().union(*bounds)))


def out_bounds(*bounds) -> tuple[int, ...]:
    """An output dimension's block boundaries: the one chunking all of ``bounds`` share as it is (its empty chunks
    kept, as dask.array's own result keeps them), else their union."""
    return tuple(bounds[0]) if all(tuple(b) == tuple(bounds[0]) for b in bounds) else union(*bounds)


def spans(b):
    """The intervals between consecutive boundaries."""
    return list(zip(b[:-1], b[1:]))


def group_bounds(b, extent: int) -> tuple[int, ...]:
    """The boundaries ``b`` with consecutive intervals merged into groups of at least ``extent`` (a last group
    shorter than that joins the one before); ``extent`` <= 0 keeps ``b``."""
    if extent <= 0 or len(b) < 3:
        return tuple(b)
    out = [b[0]]
    for x in b[1:-1]:
        if x - out[-1] >= extent:
            out.append(x)
    if len(out) > 1 and b[-1] - out[-1] < extent:
        out.pop()
    return (*out, b[-1])


def inside(b, interval) -> list:
    """The intervals of the boundaries ``b`` that make up ``interval`` (whose ends are boundaries of ``b``)."""
    return [s for s in spans(b) if interval[0] <= s[0] and s[1] <= interval[1]]


def as_dask(name: str, x):
    """x as a 2-D dask array: a dask array as it is, any other array (numpy, zarr, memmap)
    through ``da.from_array``. Anything else raises TypeError naming the parameter."""
    if isinstance(x, np.ma.MaskedArray) or isinstance(getattr(x, "_meta", None), np.ma.MaskedArray):
        raise TypeError(f"{name}: got a masked array; blasx.dask would ignore its mask (pass .filled(0), or an "
                        f"unmasked array)")
    if not isinstance(x, da.Array):
        if not (hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "__getitem__")):
            raise TypeError(f"{name}: got {type(x).__name__}; need a dask array (or a numpy, zarr or memmap array)")
        if np.dtype(x.dtype).kind not in "biufc":
            raise TypeError(f"{name}: got dtype {x.dtype}; allowed: numeric types")
        # a memmap read by the tasks from its file: only one whose data is the file's (mode 'c' keeps its
        # changes in this process; a copy or a strided view has no file mapping of its own)
        x = da.from_array(Storage(x) if Storage.reads_file(x) else np.asarray(x) if isinstance(x, np.memmap) else x)
    if x.ndim != 2:
        raise ValueError(f"{name}: got a {x.ndim}-D array of shape {x.shape}; need a matrix (2-D)")
    if any(np.isnan(n) for n in x.shape):
        raise ValueError(f"{name}: its shape {x.shape} is unknown (NaN chunks); call compute_chunk_sizes() first")
    return x


def _storage(x: da.Array):
    """The array in storage behind x, when x is exactly ``da.from_zarr`` (or ``da.from_array`` of a
    zarr array, or a memmap given to blasx.dask): its blocks are plain reads of it; else None."""
    layers = x.dask.layers
    if len(layers) != 2 or x.name not in layers:
        return None
    (other,) = [k for k in layers if k != x.name]
    src = dict(layers[other])
    if len(src) != 1:
        return None
    (obj,) = src.values()
    obj = getattr(obj, "value", obj)  # a DataNode in dask's task spec, the object itself before
    if getattr(obj, "shape", None) != x.shape or getattr(obj, "dtype", None) != x.dtype:
        return None
    if isinstance(obj, Storage):
        return obj
    if type(obj).__module__.split(".")[0] == "zarr":
        return Storage(obj)
    return None


class Operand:
    """One matrix of a call: its row and column boundaries, and how a task reads a piece of it."""

    def __init__(self, name: str, x, storage: bool = True):
        self.name = name
        self.x = x if isinstance(x, da.Array) else None
        self.storage = _storage(x) if storage and self.x is not None else None
        self.rows = bounds_of(x.chunks[0]) if self.x is not None else x[0]
        self.cols = bounds_of(x.chunks[1]) if self.x is not None else x[1]
        self.key = x.name if self.x is not None else None
        self.itemsize = x.dtype.itemsize if self.x is not None else 16

    @classmethod
    def output(cls, key: str, rows, cols, dtype) -> "Operand":
        """The output of the call itself, read by its later blocks (TRSM); a zero-length dimension one empty
        block, as :func:`build` makes it."""
        op = cls("out", tuple(b if len(b) > 1 else (0, 0) for b in (rows, cols)))
        op.key, op.itemsize = key, np.dtype(dtype).itemsize
        return op

    def block_of(self, r0: int, c0: int) -> tuple[int, int]:
        """The block holding (r0, c0) (the last block for a piece at the end of a dimension)."""
        return (min(bisect.bisect_right(self.rows, r0), len(self.rows) - 1) - 1,
                min(bisect.bisect_right(self.cols, c0), len(self.cols) - 1) - 1)


class BlockBuilder:
    """Collects one block's dependencies and storage handles while its steps are written."""

    def __init__(self):
        self.deps: dict = {}  # key -> slot
        self.nbytes: list[int] = []  # slot -> bytes of that block
        self.stores: dict = {}

    def piece(self, op: Operand, r0: int, r1: int, c0: int, c1: int) -> Ref:
        if op.storage is not None:
            slot = -1 - self.stores.setdefault(id(op.storage), (len(self.stores), op.storage))[0]
            return Ref(slot, r0, r1, c0, c1)
        bi, bj = op.block_of(r0, c0)
        key = (op.key, bi, bj)
        if key not in self.deps:
            self.deps[key] = len(self.deps)
            self.nbytes.append((op.rows[bi + 1] - op.rows[bi]) * (op.cols[bj + 1] - op.cols[bj]) * op.itemsize)
        return Ref(self.deps[key], r0 - op.rows[bi], r1 - op.rows[bi], c0 - op.cols[bj], c1 - op.cols[bj])

    def tasks(self, key, shape, dtype, init, steps, limit: int) -> dict:
        """The block's task, or a chain of tasks when its dependency blocks exceed ``limit`` bytes:
        each link takes the previous link's block and the dependencies of its own steps (at least
        one step), so no task holds more than ``limit`` bytes of them (or one step's)."""
        stores = tuple(s for _, s in sorted(self.stores.values(), key=lambda t: t[0]))
        keys = list(self.deps)
        groups, slots, size = [[]], set(self._slots(init)), sum(self.nbytes[x] for x in self._slots(init))
        for step in steps:
            new = self._slots(step) - slots
            if groups[-1] and size + sum(self.nbytes[x] for x in new) > limit:
                groups.append([])
                slots, size, new = set(), 0, self._slots(step)
            groups[-1].append(step)
            slots |= new
            size += sum(self.nbytes[x] for x in new)
        out, prev = {}, None
        for g, group in enumerate(groups):
            link = key if g == len(groups) - 1 else (f"{key[0]}-k{g}",) + tuple(key[1:])
            remap: dict[int, int] = {}
            deps = [] if prev is None else [prev]
            if prev is None:
                first = self._remap(init, remap, deps, keys)
            else:
                first = ("copy", Ref(0, 0, shape[0], 0, shape[1]), 1.0)
            group = [self._remap(s, remap, deps, keys) for s in group]
            plan = Block(tuple(shape), np.dtype(dtype).str, first, tuple(group), stores)
            out[link] = (run_block, plan, deps)
            prev = link
        return out

    @staticmethod
    def _slots(step) -> set:
        return {a.slot for a in refs_of(step) if a.slot >= 0}

    @staticmethod
    def _remap(step, remap, deps, keys):
        def new(a):
            if isinstance(a, tuple) and not isinstance(a, Ref):  # a grid step's nested pieces
                return tuple(new(x) for x in a)
            if not isinstance(a, Ref) or a.slot < 0:
                return a
            if a.slot not in remap:
                remap[a.slot] = len(deps)
                deps.append(keys[a.slot])
            return a._replace(slot=remap[a.slot])
        return (step[0],) + tuple(new(a) for a in step[1:])


def build(routine: str, rows, cols, dtype, operands, block, token_args) -> da.Array:
    """The dask array of one call: ``block(i, j, r, c, builder)`` returns the (init, steps) of
    output block (i, j), whose rows are the interval r and columns c."""
    rows, cols = (b if len(b) > 1 else (0, 0) for b in (rows, cols))  # a zero-length dimension: one empty block
    limit = task_bytes(operands)
    name = f"blasx-{routine}-" + tokenize(routine, rows, cols, np.dtype(dtype).str, *token_args)
    dsk = {}
    for (i, r), (j, c) in itertools.product(enumerate(spans(rows)), enumerate(spans(cols))):
        b = BlockBuilder()
        init, steps = block(i, j, r, c, b, name)
        dsk.update(b.tasks((name, i, j), (r[1] - r[0], c[1] - c[0]), dtype, init, steps, limit))
    deps = [op.x for op in operands if op is not None and op.x is not None and op.storage is None]
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=deps)
    chunks = (tuple(np.diff(rows).tolist()), tuple(np.diff(cols).tolist()))
    return da.Array(graph, name, chunks, meta=_meta(operands, dtype))


def cupy_chunks(*xs) -> bool:
    """Every one of the dask arrays ``xs`` has CuPy chunks."""
    return all(type(x._meta).__module__.split(".")[0] == "cupy" for x in xs)


def device_blocks(*xs) -> bool:
    """Whether a task's engine call reads the blocks of the dask arrays ``xs`` from GPUs: every one has CuPy
    chunks, or every worker of the current distributed client runs its engine on GPUs (host blocks are then read
    in place by a call that copies each tile to a GPU once)."""
    return bool(xs) and (cupy_chunks(*xs) or _gpu_workers())


def task_bytes(operands) -> int:
    """The dependency bytes a task may take (``dask.config``'s ``blasx.dask.task-bytes``): "auto" gives
    DEVICE_TASK_BYTES where the dask operands' blocks are read from GPUs (:func:`device_blocks`), else TASK_BYTES,
    within the smallest worker memory limit of the current distributed client (Dask errs a task whose dependencies
    exceed its worker's limit, counting CuPy blocks too): at most that limit for CuPy blocks (they take no host
    memory), half of it for host blocks (the task's accumulator and the worker's other tasks need the rest); or a
    size."""
    v = dask.config.get("blasx.dask.task-bytes", "auto")
    if v == "auto":
        xs = [op.x for op in operands if op is not None and op.x is not None]
        cupy = bool(xs) and cupy_chunks(*xs)
        bound = DEVICE_TASK_BYTES if device_blocks(*xs) else TASK_BYTES
        limit = _least_worker_memory()
        if limit is not None:
            bound = min(bound, limit if cupy else limit // 2)
        return bound
    try:
        n = parse_bytes(v)
    except (AttributeError, TypeError, ValueError):
        n = -1
    if isinstance(v, bool) or n <= 0:
        raise ValueError(f"dask config blasx.dask.task-bytes: got {v!r}; allowed: 'auto' or a size in bytes > 0 "
                         f"(such as 4GiB)")
    return n


def _workers():
    """(the current synchronous distributed client, its scheduler's worker records), or None: no distributed, no
    client (dask's local schedulers), an asynchronous one, or a scheduler gone (the call's compute reports it)."""
    try:
        from distributed import default_client
        client = default_client()
    except (ImportError, ValueError):
        return None
    if client.asynchronous:
        return None
    try:
        try:
            info = client.scheduler_info(n_workers=-1)
        except TypeError:  # a distributed before n_workers=: every worker
            info = client.scheduler_info()
    except OSError:
        return None
    return client, info.get("workers", {})


def _least_worker_memory() -> int | None:
    """The smallest memory limit among the current distributed client's workers (None: no synchronous client, or
    no limits)."""
    found = _workers()
    limits = [int(x) for x in (w.get("memory_limit") for w in found[1].values()) if x] if found else []
    return min(limits) if limits else None


_gpu_sets: dict = {}  # (scheduler address, worker addresses) -> whether every worker's engine has GPUs


def _gpu_workers() -> bool:
    """Whether every worker of the current distributed client runs its blasx engine on GPUs (asked of the workers
    once per set of them; False without a synchronous client or workers)."""
    found = _workers()
    if not found or not found[1]:
        return False
    client, workers = found
    key = (client.scheduler.address, tuple(sorted(workers)))
    if key not in _gpu_sets:
        try:
            _gpu_sets[key] = all(client.run(engine_has_gpus, workers=list(workers)).values())
        except Exception:  # noqa: BLE001 - a worker went away or its engine failed (its tasks will say): ask again
            return False
    return _gpu_sets[key]


def _meta(operands, dtype):
    for op in operands:
        if op is not None and op.x is not None and op.x._meta is not None:
            return op.x._meta.astype(dtype, copy=False).reshape((0, 0))
    return np.empty((0, 0), dtype=dtype)
