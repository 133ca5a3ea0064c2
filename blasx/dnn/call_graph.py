"""Replayed convolution calls (conv_memo) captured into CUDA graphs, keyed by their operands' addresses: a call
whose x, weight (or dY) and freshly made output lie where an earlier call's did launches that call's graph, one
launch instead of the call's kernels and cuBLAS calls, each of which costs the host more than a small layer
costs the GPU. A loop's arrays come back to the same addresses from CuPy's pool, so a loop's calls replay.

Policy: a kept call on new addresses (x, w, y and its epilogue's vectors and residual) runs eagerly once, the
scratch it allocates counted; the next call on them is captured (its scratch in the arena) and launched; each
kept call holds its last ``KEPT`` graphs. A capture that fails leaves the call eager (``TRIES`` failures a kept
call: eager for good).

Invariants:
- a graph reads and writes only x, w, y, the epilogue's vectors and residual, and a transposed call's bias at
  the addresses of its key
  (read at launch: their contents then) and scratch in its stream's :class:`Arena`; the key is taken after the
  output and the epilogue's vectors are made, so a graph never writes an array the caller did not get from
  this call and reads the vectors this call made (cached by contents: an address shows this call's values);
- a stream's graphs run in its order, one after the other, so they share one arena (sized to the largest
  call's scratch) and one cuBLAS handle with its workspace, bound to the arena's capture stream, which nothing
  else issues on (cublas_call.reserve);
- an arena that grows gets a new generation: graphs of an older one are captured again (each holds the memory
  it was captured with until it is dropped);
- calls on a per-thread default stream run eagerly (its pointer names another stream in each thread).

State: ``_ARENAS`` (device, stream pointer) -> Arena, a direct_cache table (emptied with the route's caches:
graphs of a dropped arena are captured again). Per kept call (conv_memo.Replay): a :class:`Graphs`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..runtime.config import env_switch
from ..runtime.devices.cupy_streams import PER_THREAD
from . import direct_cache

ENABLED = env_switch("BLASX_CONV_GRAPHS")  # off: every replay launches eagerly
KEPT = 8  # graphs a kept call holds (a loop alternates its outputs, and fresh vectors, between a few addresses)
TRIES = 3  # failed captures after which a kept call stays eager
ARENA_MAX = 1 << 30  # bytes of scratch an arena may hold; a call needing more stays eager
ALIGN = 512  # bytes each scratch allocation is rounded up to (as CuPy's pool rounds)


def _rounded(n: int) -> int:
    return -(-max(int(n), 1) // ALIGN) * ALIGN


class Arena:
    """One (device, stream)'s scratch for its graphs: a buffer handed out from its start by a bump allocator
    during each capture, the stream the graphs are captured on, its generation and a lock (one capture at a
    time); it holds the stream its graphs are launched on."""

    def __init__(self, device: int, stream):
        import cupy

        from . import cublas_call
        self.lock = threading.Lock()
        self.device = device
        self.stream = stream  # (held: its handle never names another stream while this arena lives)
        self.capture = cupy.cuda.Stream(non_blocking=True)
        cublas_call.reserve(device, self.capture.ptr)
        self.buf, self.size, self.offset, self.generation = None, 0, 0, 0
        self.inner = None  # the allocator in use when the capture under way began
        self.overflow: list = []  # its allocations past the buffer (kept by its graph)

    def fit(self, need: int) -> None:
        """Make the buffer hold ``need`` bytes (a new one, a new generation, when it does not)."""
        if need > self.size:
            import cupy
            self.buf = cupy.empty(need, dtype=cupy.uint8)
            self.size, self.generation = need, self.generation + 1

    def alloc(self, nbytes: int):
        """The next ``nbytes`` of the buffer (CuPy allocator); past its end, a pool allocation the graph keeps."""
        import cupy
        n = _rounded(nbytes)
        if self.offset + n > self.size:
            p = self.inner(nbytes)
            self.overflow.append(p)
            return p
        p = cupy.cuda.MemoryPointer(self.buf.data.mem, self.buf.data.ptr - self.buf.data.mem.ptr + self.offset)
        self.offset += n
        return p


# stream pointers naming a different stream in each thread (cudaStreamPerThread; CuPy's null stream where CuPy
# runs on per-thread default streams): graphs there could share an arena between threads' concurrent work
_ARENAS = direct_cache.table(64)  # (device, stream pointer) -> Arena; emptied with the other caches


def arena(device: int, stream) -> Arena:
    """The arena of ``stream`` (a CuPy stream) on ``device``."""
    return _ARENAS.get((device, stream.ptr), lambda: Arena(device, stream))


class Graphs:
    """The graphs of one kept call: ``run(x, w, y, extra, after, operands)`` does what ``launch(x, w, y,
    *operands)`` then ``after(y)`` issue on the current stream (``extra``: the addresses ``after`` and the
    operands read), from a graph where the addresses' is kept, else eagerly (counting them) or by capturing it."""

    def __init__(self, launch):
        self.launch = launch
        # (stream, x, w, y addresses, the epilogue's) -> (graph, arena, generation, the memory it keeps)
        self.graphs: OrderedDict = OrderedDict()
        self.seen: OrderedDict = OrderedDict()  # address keys run eagerly -> scratch bytes they allocated
        self.fails = 0
        self.error = ""
        self.replays = 0

    def run(self, x, w, y, extra: tuple = (), after=None, operands: tuple = ()) -> None:
        if after is None:
            def work():
                self.launch(x, w, y, *operands)
        else:
            def work():
                self.launch(x, w, y, *operands)
                after(y)
        if not ENABLED or self.fails >= TRIES:
            return work()
        import cupy
        stream = cupy.cuda.get_current_stream()
        sp, yd = stream.ptr, y.data
        if sp in PER_THREAD:  # one pointer for every thread's own stream: no shared arena
            return work()
        key = (sp, x.data.ptr, w.data.ptr, yd.ptr, *extra)
        g = self.graphs.get(key)
        if g is not None:
            if g[1] is _ARENAS.entries.get((yd.device_id, sp)) and g[2] == g[1].generation:
                g[0].launch(stream)
                self.replays += 1
                return
            self.graphs.pop(key, None)
        need = self.seen.get(key)
        if need is None or need > ARENA_MAX:
            self._eager(key, work)
            return
        graph = self._capture(key, need, stream, yd.device_id, work)
        if graph is None:
            work()
        else:
            graph.launch(stream)

    def _eager(self, key, work) -> None:
        """The call eagerly, the bytes it allocates counted (an arena for its graph holds them)."""
        import cupy
        inner, total = cupy.cuda.get_allocator(), [0]

        def counting(nbytes):
            total[0] += _rounded(nbytes)
            return inner(nbytes)
        with cupy.cuda.using_allocator(counting):
            work()
        self.seen[key] = total[0]
        while len(self.seen) > 4 * KEPT:
            self.seen.popitem(last=False)

    def _capture(self, key, need: int, stream, device: int, work):
        """``work()`` captured on its stream's arena's capture stream (launching nothing), kept; None on failure."""
        import cupy
        a = arena(device, stream)
        with a.lock:
            try:
                a.fit(need)
                a.offset, a.overflow, a.inner = 0, [], cupy.cuda.get_allocator()
                with a.capture, cupy.cuda.using_allocator(a.alloc):
                    a.capture.begin_capture()
                    try:
                        work()
                    finally:
                        graph = a.capture.end_capture()  # (an invalidated capture ends with an error)
            except Exception as exc:  # noqa: BLE001 - the call runs eagerly; the reason is kept
                self.fails += 1
                self.error = f"{type(exc).__name__}: {exc}"
                return None
            self.graphs[key] = (graph, a, a.generation, (a.buf, a.overflow))
            while len(self.graphs) > KEPT:
                self.graphs.popitem(last=False)
        return graph
