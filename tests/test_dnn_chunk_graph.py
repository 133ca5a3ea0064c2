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
