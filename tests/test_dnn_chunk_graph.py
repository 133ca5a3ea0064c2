"""chunk_graph.py on the CPU: a stand-in for CuPy's stream capture and memory pool. The first chunk of a shape
runs eagerly, the next is captured with the graph's own allocator, later ones replay; a failed capture is
tried again TRIES times, then the shape stays eager with the reason kept."""

from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest

from blasx.dnn import chunk_graph
from blasx.dnn.chunk_graph import ChunkGraph

_state = {"allocator": None, "capturing": False}


class _Pool:
    def malloc(self, n):
        return n


@contextlib.contextmanager
def _using(alloc):
    before, _state["allocator"] = _state["allocator"], alloc
    try:
        yield
    finally:
        _state["allocator"] = before


class _Graph:
    def __init__(self, fn):
        self.fn, self.launches = fn, 0

    def launch(self, stream):
        self.launches += 1


class _Stream:
    def __init__(self, invalidate=0):
        self.invalidate = invalidate  # captures that end with an error

    def begin_capture(self):
        assert not _state["capturing"]
        _state["capturing"] = True

    def end_capture(self):
        _state["capturing"] = False
        if self.invalidate:
            self.invalidate -= 1
            raise RuntimeError("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
        return _Graph(None)


XP = types.SimpleNamespace(cuda=types.SimpleNamespace(MemoryPool=_Pool, using_allocator=_using))


def test_eager_then_captured_then_replayed():
    g = ChunkGraph()
    assert not g.wants_capture()  # the first chunk of a shape runs eagerly
    g.eager += 1
    seen = []
    y = np.arange(3)

    def forward():
        seen.append((_state["capturing"], _state["allocator"] is not None))
        return y
    assert g.wants_capture() and g.capture(XP, _Stream(), forward)
    assert seen == [(True, True)] and _state["allocator"] is None  # captured with the graph's own pool
    assert g.replay(None) is y and g.replay(None) is y and g.graph.launches == 2 and not g.wants_capture()
    assert chunk_graph.summary([g]) == {"captured": 1, "replays": 2, "eager": 1, "failures": 0, "error": ""}


def test_failed_captures_are_tried_again_then_left_eager():
    g, stream = ChunkGraph(), _Stream(invalidate=chunk_graph.TRIES)
    g.eager += 1
    for i in range(chunk_graph.TRIES):
        assert g.wants_capture() and not g.capture(XP, stream, lambda: None)
        assert g.fails == i + 1 and "INVALIDATED" in g.error and g.graph is None
        g.eager += 1
    assert not g.wants_capture() and not _state["capturing"]
    assert chunk_graph.summary([g])["failures"] == chunk_graph.TRIES


def test_an_error_inside_the_capture_ends_it_and_is_kept():
    g = ChunkGraph()
    g.eager = 1

    def boom():
        raise ValueError("a layer failed")
    assert not g.capture(XP, _Stream(), boom)
    assert not _state["capturing"] and g.error == "ValueError: a layer failed" and g.fails == 1


def test_interrupt_inside_the_capture_ends_it_and_propagates():
    g = ChunkGraph()
    g.eager = 1

    def stop():
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        g.capture(XP, _Stream(), stop)
    assert not _state["capturing"] and _state["allocator"] is None and g.graph is None


def _launches(entries) -> list:
    """Launches by kind and what tells them apart besides addresses (kernel name; GEMM dims and types)."""
    out = []
    for e in entries:
        if e[0] == "kernel":
            out.append(("kernel", e[1], e[3]))
        elif e[0] == "gemm":
            out.append(("gemm", *e[1:6]))
        elif e[0] in ("contiguous", "fill", "setitem", "copy", "astype", "tile", "zeros", "ufunc"):
            out.append((e[0], e[1]))
    return out


def test_network_chunks_replay_their_graph_on_a_stand_in_gpu(monkeypatch):
    """Network.compile(graphs=True) on bench/fake_cupy's stand-in GPU: a worker's first chunk runs eagerly, its
    second is captured (temporaries from the graph's own pool) and every chunk after is one graph launch; the
    captured launches are the eager run's, in order."""
    torch = pytest.importorskip("torch")
    import blasx
    from bench import fake_cupy
    from blasx import dnn, session
    nn = torch.nn
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                      nn.Linear(8, 4)).eval()
    monkeypatch.setattr(session, "cuda_ordinals", lambda: [0])
    x = np.random.default_rng(0).standard_normal((8, 3, 16, 16)).astype(np.float32)
    try:
        with fake_cupy.installed(record_calls=True) as fake:
            eager = dnn.from_torch(m, (1, 3, 16, 16)).compile(dtype=np.float32, layout="cl", workers_per_gpu=1,
                                                            graphs=False)
            eager(x[:2], chunk=2)
            fake.log.clear()
            eager(x[:2], chunk=2)  # one chunk, warm
            want = _launches(fake.log)
            net = dnn.from_torch(m, (1, 3, 16, 16)).compile(dtype=np.float32, layout="cl", workers_per_gpu=1,
                                                             graphs=True)
            y = net(x, chunk=2)
            g = net.last_profile().graphs
            assert y.shape == (8, 4) and g == {"captured": 1, "replays": 3, "eager": 1, "failures": 0, "error": ""}
            (worker,) = net._workers_for([0], np.dtype(np.float32), (2, 3, 16, 16))
            (cg,) = worker.chunk_graphs.values()
            assert cg.pool.allocations > 0  # the capture's temporaries came from the graph's pool
            fake.log.clear()
            net(x, chunk=2)
            assert [e[0] for e in fake.log if e[0] == "graph_launch"] == ["graph_launch"] * 4
            assert not any(e[0] in ("kernel", "gemm") for e in fake.log)  # no layer ran from Python
        assert _launches(cg.graph.entries) == want  # the eager chunk's launches, in order
    finally:
        blasx.shutdown()


def test_a_worker_keeps_the_graphs_of_its_latest_shapes():
    """Varying batch sizes give a worker as many last-chunk shapes: it keeps KEPT of them, least recently used
    dropped first, a used one kept fresh."""
    from collections import OrderedDict
    graphs = OrderedDict()
    first = chunk_graph.lookup(graphs, (1,))
    for n in range(2, chunk_graph.KEPT + 1):
        chunk_graph.lookup(graphs, (n,))
    assert chunk_graph.lookup(graphs, (1,)) is first  # used again: now the most recent
    chunk_graph.lookup(graphs, (99,))
    assert len(graphs) == chunk_graph.KEPT and (2,) not in graphs and graphs[(1,)] is first
    assert list(graphs)[-1] == (99,)


def test_a_page_locked_batch_is_copied_in_without_staging(monkeypatch):
    """A host batch blasx page-locked (the engine's registration cache) goes to a GPU worker straight from its
    memory, in pieces that never span a registration boundary; a batch of another type is cast through the
    page-locked staging buffer as before. The registering job is joined before the call returns."""
    torch = pytest.importorskip("torch")
    import threading

    import blasx
    from bench import fake_cupy
    from blasx import dnn, session
    from blasx.runtime import hostmem
    nn = torch.nn
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 2)).eval()
    monkeypatch.setattr(session, "cuda_ordinals", lambda: [0])
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1)
    x = np.random.default_rng(0).standard_normal((8, 3, 8, 8)).astype(np.float32)
    lo, cut = x.ctypes.data, x.ctypes.data + x.nbytes // 3 + 2  # a registration boundary inside chunk 0
    joined = []

    class Job(threading.Thread):
        def join(self, timeout=None):
            joined.append(True)

    def pin(arrays):
        assert arrays[0] is x
        p = hostmem.Pinning(lo, lo + x.nbytes, [(lo, cut), (cut, lo + x.nbytes)])
        for ev in p.ready:
            ev.set()
        return [p], Job()
    monkeypatch.setattr(hostmem.REGISTRY, "pin", pin)
    try:
        with fake_cupy.installed(record_calls=True) as fake:
            net = dnn.from_torch(m, (1, 3, 8, 8)).compile(dtype=np.float32, layout="cl", workers_per_gpu=1)
            fake.log.clear()
            net(x, chunk=4)
            copies = [e for e in fake.log if e[0] == "memcpy"]
            assert [e[1] for e in copies] == [cut - lo, x.nbytes // 2 - (cut - lo), x.nbytes // 2]
            assert not any(e[0] == "set" for e in fake.log) and joined == [True]
            fake.log.clear()
            net(x.astype(np.float64), chunk=4)  # cast on the host: staged
            assert [e[0] for e in fake.log if e[0] in ("memcpy", "set")] == ["set", "set"]
            fake.log.clear()
            net(np.concatenate([x] * 3)[:8], chunk=4)  # a third of a larger array: not locked whole, staged
            assert [e[0] for e in fake.log if e[0] in ("memcpy", "set")] == ["set", "set"] and joined == [True]
    finally:
        blasx.shutdown()
