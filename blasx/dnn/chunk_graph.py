"""A network worker's forward of one chunk shape captured into a CUDA graph and replayed
(``Network.compile(graphs=True)``): one launch a chunk instead of a Python call per layer, so the host keeps up
with the GPUs and several GPUs' workers stop queueing for the interpreter.

The first chunk of a shape runs eagerly (kernels compiled, channel vectors uploaded, scratch sized, weight
transforms made); the next is captured on the worker's stream and replayed, and every later one replays.
What the layers allocate inside the capture comes from a memory pool of the graph's own, kept with it (its
replays write there and nothing else allocates from it). What they take from the worker's caches (scratch,
weight transforms, channel vectors, the cuBLAS handle bound to the worker's stream with its own workspace)
the graph keeps a reference to (direct_cache.capturing), so a cache that drops or regrows an entry later never
frees memory a replay still reads or writes; a value the caches lack fails the capture (it would be made only
inside the graph). A capture that fails (that, or a synchronising call of another thread invalidating it) is
tried again on the next chunks, :data:`TRIES` times in all; then the shape stays eager and ``error`` says why.
"""

from __future__ import annotations

TRIES = 3  # captures tried per chunk shape
KEPT = 8  # chunk shapes a worker keeps graphs of (a server's varying batch sizes give as many last chunks)


class ChunkGraph:
    """One worker's graph of one chunk shape: its state, the graph, its memory pool and its output array."""

    def __init__(self) -> None:
        self.eager = 0  # chunks run eagerly
        self.replays = 0
        self.fails = 0
        self.error = ""
        self.graph = None
        self.pool = None
        self.keep: list = []  # the cached device values the graph reads or writes
        self.buffers: list = []  # those of them its owner's Workspace held as scratch when captured (host_batch)
        self.y = None

    def wants_capture(self) -> bool:
        return self.graph is None and self.eager > 0 and self.fails < TRIES

    def capture(self, xp, stream, forward, fresh_weights: bool = False) -> bool:
        """``forward()`` (the layers on the worker's fixed input buffer) captured on ``stream``, the current
        stream; True when it worked (nothing ran: replay it for this chunk). ``fresh_weights``: the weights'
        transforms are made inside the graph (direct_cache.weights_in_graph), from the weights at each replay."""
        import contextlib

        from .direct_cache import capturing, weights_in_graph
        pool, keep = xp.cuda.MemoryPool(), []
        try:
            with xp.cuda.using_allocator(pool.malloc), capturing(keep), \
                    weights_in_graph() if fresh_weights else contextlib.nullcontext():
                try:
                    stream.begin_capture()
                    y = forward()
                except BaseException:  # the capture ended (if it began), the error raised: a Ctrl-C stays one
                    with contextlib.suppress(Exception):
                        stream.end_capture()
                    raise
                graph = stream.end_capture()  # an invalidated capture ends with an error
        except Exception as exc:  # noqa: BLE001 - the shape runs eagerly; the reason is kept
            self.fails += 1
            self.error = f"{type(exc).__name__}: {exc}"
            return False
        self.graph, self.pool, self.keep, self.y = graph, pool, keep, y
        return True

    def replay(self, stream):
        """The chunk's output (this graph's own array, rewritten by the next replay)."""
        self.graph.launch(stream)
        self.replays += 1
        return self.y


def lookup(graphs, shape: tuple) -> ChunkGraph:
    """The ChunkGraph of ``shape`` in a worker's ``graphs`` (an OrderedDict, least recently used first; made
    when new), beyond KEPT shapes the least recently used dropped with its graph and memory pool (the worker
    synchronises its stream after every chunk, so no dropped graph is still running)."""
    g = graphs.get(shape)
    if g is None:
        g = graphs[shape] = ChunkGraph()
        while len(graphs) > KEPT:
            graphs.popitem(last=False)
    graphs.move_to_end(shape)
    return g


def summary(graphs) -> dict:
    """Counts over ``graphs`` (ChunkGraph): shapes captured, replays, eager chunks, failed captures, last error."""
    out = {"captured": 0, "replays": 0, "eager": 0, "failures": 0, "error": ""}
    for g in graphs:
        out["captured"] += g.graph is not None
        out["replays"] += g.replays
        out["eager"] += g.eager
        out["failures"] += g.fails
        out["error"] = g.error or out["error"]
    return out
