"""Host-side caches of the device route (conv_direct.py, depthwise.py), so that a convolution call on CuPy
arrays spends its host time on launches: small bounded tables whose keys spell out everything a value
depends on.

- ``Table``: a dict of at most ``limit`` entries, emptied when full (values are cheap to remake).
- free device memory per device (the scratch budget), read once and again only after an allocation fails;
- channel vectors on the device per (device, stream, contents): uploaded on the stream that reads them,
  so no other stream can read one before its upload lands (the entry keeps its stream alive);
- ``Workspace``: what one stream's owner (a Network worker) keeps between calls: transforms of weights it
  never changes (keyed by the memory the weight array views), scratch buffers reused call after call, its channel
  vectors and its cuBLAS handle (bound to its stream, with a workspace of its own).

Inside :func:`capturing` (a CUDA graph being captured on this thread) nothing is made: a value the caches
lack raises :class:`CaptureMiss` (made there, it would exist only once the graph ran), and every value handed
out is appended to the capture's ``keep`` list, so the graph holds the memory it reads and writes however the
caches change later. Inside :func:`weights_in_graph` too, weights' transforms are made anew (never looked up):
a graph whose weight buffer is refilled between replays (host_batch.py) makes them from what it holds then.
"""

from __future__ import annotations

import threading

import numpy as np

from ..runtime.devices.cupy_streams import stream_key
from ..threadlocal import setting

_local = threading.local()  # .workspace: the Workspace of this thread's calls; .keep: the capture's list


class CaptureMiss(RuntimeError):
    """A cached device value was missing while a CUDA graph was being captured (the capture is abandoned;
    the chunk runs eagerly, which makes it)."""


def capturing(keep: list):
    """Within it, this thread captures a CUDA graph: cache misses raise CaptureMiss and every value handed
    out is appended to ``keep``."""
    return setting(_local, "keep", keep)


def weights_in_graph():
    """Within it (a capture), Workspace.derived makes each weight transform inside the graph, kept by it."""
    return setting(_local, "fresh_weights", True)


def making(what: str) -> None:
    """About to make ``what``: refused (CaptureMiss) while this thread captures."""
    if getattr(_local, "keep", None) is not None:
        raise CaptureMiss(f"{what} is not made yet; it cannot be made inside a CUDA graph capture")


def capture_active() -> bool:
    """Whether this thread is capturing a CUDA graph (inside :func:`capturing`)."""
    return getattr(_local, "keep", None) is not None


def kept(v):
    """``v``, handed out: kept by this thread's capture under way, if any."""
    keep = getattr(_local, "keep", None)
    if keep is not None:
        keep.append(v)
    return v


class Table:
    """A bounded memo: ``get(key, make)`` returns the value kept for ``key``, else ``make()`` kept."""

    def __init__(self, limit: int):
        self.limit = limit
        self.entries: dict = {}

    def get(self, key, make):
        v = self.entries.get(key)
        if v is None:
            v = make()
            if len(self.entries) >= self.limit:
                self.entries.clear()
            self.entries[key] = v
        return v

    def clear(self) -> None:
        self.entries.clear()


TABLES: list[Table] = []


def table(limit: int) -> Table:
    """A new Table, emptied by :func:`clear`."""
    t = Table(limit)
    TABLES.append(t)
    return t


def clear() -> None:
    """Empty every table and the free-memory readings (tests; a device reset)."""
    for t in TABLES:
        t.clear()
    _FREE.clear()


# ---------------------------------------------------------------- free device memory

_FREE: dict = {}  # device id -> free bytes (the pool's free blocks included) when last read


def free_bytes(device_id: int, refresh: bool = False) -> int:
    """Free memory of the current device ``device_id``: read once, again with ``refresh``."""
    free = None if refresh else _FREE.get(device_id)
    if free is None:
        import cupy
        free = _FREE[device_id] = cupy.cuda.runtime.memGetInfo()[0] + cupy.get_default_memory_pool().free_bytes()
    return free


# ---------------------------------------------------------------- channel vectors on the device

_VECTORS = table(1024)


def device_vector(values, dtype, shape_of=None):
    """``values`` (host, any float type) as a CuPy array of ``dtype`` on the current device, uploaded once
    per stream; ``shape_of(xp, v)`` reshapes/tiles the uploaded vector (its name and arguments must be in
    ``shape_of``'s identity: pass a module-level function or a functools.partial of one). ``values`` already
    on the device (CuPy) are converted there, on the current stream, each call (never read on the host)."""
    import cupy
    if isinstance(values, cupy.ndarray):
        making("a channel vector from a CuPy array")  # (inside a capture: made anew each replay otherwise)
        v = values.astype(dtype, copy=False)
        return v if shape_of is None else shape_of(cupy, v)
    host = np.ascontiguousarray(values, dtype=dtype)
    stream = cupy.cuda.get_current_stream()
    key = (cupy.cuda.Device().id, *stream_key(stream.ptr), host.dtype.str, host.shape, host.tobytes(),
           _identity(shape_of))

    def make():
        v = cupy.asarray(host)
        return stream, v if shape_of is None else shape_of(cupy, v)
    ws = workspace()
    if ws is not None:  # the worker's own, dropped with it
        return ws.vector(key, make)[1]
    if key not in _VECTORS.entries:
        making("a channel vector")
    return kept(_VECTORS.get(key, make))[1]


def _identity(fn):
    if fn is None:
        return None
    return (getattr(fn, "func", fn), getattr(fn, "args", ()))


# ---------------------------------------------------------------- a stream owner's workspace

class Workspace:
    """What one stream's owner keeps between convolution calls (all used on that stream only):
    ``derived(weight, kind, make)``: ``make()`` of a weight array it never changes, kept while the
    weight is (keyed by the memory it views, its owner held); ``scratch(name, size, dtype)``: a reusable buffer;
    ``vector(key, make)``: a channel vector; ``handle``: its cuBLAS handle (cublas_call.own_handle)."""

    LIMIT = 4096  # transforms (and vectors) kept at most (then all dropped)

    def __init__(self):
        self.weights: dict = {}
        self.buffers: dict = {}
        self.vectors: dict = {}
        self.handle = None  # (cuBLAS handle, its workspace, its stream), made on the first GEMM

    def derived(self, weight, kind, make):
        if getattr(_local, "fresh_weights", False):
            return kept(make())
        base, ident = _array_identity(weight)
        key = (ident, kind)
        got = self.weights.get(key)
        if got is not None and got[0] is not base:  # (the entry holds the base array: its id is not reused)
            got = None
        if got is None:
            making(f"a weight transform {kind}")
            if len(self.weights) >= self.LIMIT:
                self.weights.clear()
            got = self.weights[key] = (base, make())
        return kept(got)[1]

    def vector(self, key, make):
        got = self.vectors.get(key)
        if got is None:
            making("a channel vector")
            if len(self.vectors) >= self.LIMIT:
                self.vectors.clear()
            got = self.vectors[key] = make()
        return kept(got)

    def scratch(self, name: str, size: int, dtype, alloc):
        """``size`` elements of ``dtype`` (the first ones of a buffer kept under ``name``, grown as needed)."""
        dt = np.dtype(dtype)
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dt or buf.size < size:
            making(f"scratch {name!r} of {size} elements")
            self.buffers.pop(name, None)
            buf = self.buffers[name] = alloc(size, dt)
        return kept(buf)[:size]

    def release(self) -> None:
        self.weights.clear()
        self.buffers.clear()
        self.vectors.clear()


def _array_identity(a) -> tuple:
    """(the array owning ``a``'s memory, a key equal for every view of it with the same address, shape, strides
    and type): a layer that takes a fresh view of a weight per call finds the transform of the last one."""
    base = a
    while getattr(base, "base", None) is not None:
        base = base.base
    ptr = getattr(a.data, "ptr", None)
    if ptr is None:
        ptr = a.__array_interface__["data"][0]
    return base, (id(base), ptr, a.shape, a.strides, a.dtype.str)


def workspace():
    """This thread's Workspace (see :func:`using`), or None."""
    return getattr(_local, "workspace", None)


def using(ws: Workspace | None):
    """Within it, this thread's convolutions keep weights' transforms and scratch in ``ws``. Its owner
    promises that the weight arrays it passes are never changed and that every call runs on one stream."""
    return setting(_local, "workspace", ws)


def derived(weight, kind, make):
    """``make()``, kept in this thread's Workspace where there is one."""
    ws = workspace()
    return make() if ws is None else ws.derived(weight, kind, make)
