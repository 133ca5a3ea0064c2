"""Replayed convolution calls captured into CUDA graphs (call_graph.py), on the CPU stand-in for CuPy
(bench/fake_cupy.py): a kept call whose operands come back to the same addresses is captured on its second
sighting and launched from the graph after; the graph holds exactly the launches an eager replay makes (every
pointer into the operands the same, scratch in the stream's arena); new addresses run eagerly; a failed
capture falls back to the eager call; an arena that grows retires the graphs captured in the old one."""

from __future__ import annotations

import numpy as np
import pytest

from bench import fake_cupy
from blasx import dnn
from blasx.dnn import call_graph, conv_memo, cublas_call, direct_cache
from blasx.dnn import conv_direct as cd
from test_dnn_conv_memo import CASES, _call, _masked, case_operands, each_case


@pytest.fixture(autouse=True)
def fresh():
    direct_cache.clear()
    yield
    direct_cache.clear()


def _same_addresses():
    """An allocator giving a call's k-th request of a size the same block every call (a loop's pool in steady
    state): ``alloc.reset()`` starts a call."""
    blocks, taken = {}, {}

    def alloc(nbytes):
        k = taken[nbytes] = taken.get(nbytes, -1) + 1
        if (nbytes, k) not in blocks:
            blocks[nbytes, k] = fake_cupy.MemoryPointer(fake_cupy._Mem(nbytes, 0))
        return blocks[nbytes, k]
    alloc.reset = taken.clear
    return alloc


def _graphs_of_the_one_kept_call():
    (replay,) = conv_memo._TABLE.entries.values()
    return replay.run.graphs


@each_case
def test_a_graph_holds_what_an_eager_replay_launches_and_later_calls_launch_it(case, dtype, cl):
    _, direction, _, _, _, stride, pad, groups = case
    dt = np.dtype(dtype)
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0), cd.on_own_gpu():
            x, w, dy = case_operands(cupy, case, dt, cl)
            named = {"x": x, "w": w, "dy": dy}
            alloc = _same_addresses()

            def call():
                alloc.reset()
                return _call(direction, x, w, dy, stride, pad, groups)
            with cupy.cuda.using_allocator(alloc):
                want = call()  # the full path
                if not conv_memo._TABLE.entries:
                    pytest.skip("not kept (the shifted form's NCHW weight transform)")
                fake.log.clear()
                eager_y = call()  # first sighting: eager
                eager = _masked(fake.log, named)
                fake.log.clear()
                captured_y = call()  # second: captured, then launched
                at_capture = list(fake.log)
                fake.log.clear()
                got = call()  # third: the graph alone
                later = list(fake.log)
            graphs = _graphs_of_the_one_kept_call()
    ((graph, arena, generation, _),) = graphs.graphs.values()
    stream = 0  # (the null stream, CuPy's default)
    assert _masked(graph.entries, named) == eager and any(e[0] in ("gemm", "raw_kernel") for e in eager)
    assert at_capture == later == [("graph_launch", len(graph.entries), stream)]
    assert graphs.replays == 1 and graphs.fails == 0 and generation == arena.generation
    for y in (eager_y, captured_y, got):
        assert (y.shape, y.strides, y.dtype) == (want.shape, want.strides, want.dtype)
    assert eager_y.data.ptr == captured_y.data.ptr == got.data.ptr


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_batched_weight_form_is_captured_too(monkeypatch, dtype):
    """The NCHW pointwise weight gradient's batched form (its ones vector made by a plan step, inside the
    graph): captured on the second sighting, launched after, as every kept call."""
    monkeypatch.setattr(cd, "FORM", "batched")
    case = next(c for c in CASES if c[:2] == ("pointwise", "bwd-weight"))
    test_a_graph_holds_what_an_eager_replay_launches_and_later_calls_launch_it(case, dtype, False)


@pytest.mark.parametrize("cl", [False, True])
def test_strided_backward_data_by_phases_is_replayed_from_a_graph(monkeypatch, cl):
    """BLASX_CONV_FORM=phases: a strided backward-data call runs as stride-1 convolutions of the sub-kernels
    (phases.py) instead of col2im, and its replays run the same calls, then from a CUDA graph."""
    monkeypatch.setattr(cd, "FORM", "phases")
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0), cd.on_own_gpu():
            w = cupy.empty((64, 32, 3, 3), dtype=np.float16)
            dy = cupy.empty((4, 64, 10, 10), dtype=np.float16)
            if cl:
                dy = cupy.empty((4, 10, 10, 64), dtype=np.float16).transpose(0, 3, 1, 2)
            alloc = _same_addresses()
            logs = []
            with cupy.cuda.using_allocator(alloc):
                for _ in range(4):
                    alloc.reset()
                    fake.log.clear()
                    gi = dnn.conv2d_input((4, 32, 20, 20), w, dy, 2, 1)
                    logs.append([e[0] for e in fake.log])
            (replay,) = conv_memo._TABLE.entries.values()
            assert replay.run.graphs.fails == 0
    assert gi.shape == (4, 32, 20, 20)
    assert logs[0] == logs[1] and logs[0].count("gemm") == 4  # four phases (taps 2x2, 2x1, 1x2, 1x1), no col2im
    assert logs[2] == logs[3] == ["graph_launch"]


@pytest.mark.parametrize("stride", [1, 2])  # the bias as an epilogue; col2im's kernel reading it
@pytest.mark.parametrize("cupy_bias", [False, True])
def test_a_transposed_call_with_a_bias_is_replayed_from_a_graph(stride, cupy_bias):
    """conv_transpose2d with a bias is kept like any call: the bias checked and made before any launch, its address
    in the graph's key (a CuPy bias col2im reads at a new address runs eagerly, never a stale graph); a bad bias on
    a replay raises before any launch."""
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0), cd.on_own_gpu():
            x, w = cupy.empty((4, 64, 10, 10), dtype=np.float16), cupy.empty((64, 32, 3, 3), dtype=np.float16)
            bias = cupy.empty(32, dtype=np.float16) if cupy_bias else np.ones(32, np.float16)
            alloc = _same_addresses()
            logs = []
            with cupy.cuda.using_allocator(alloc):
                for _ in range(4):  # the full path, eager, captured, launched
                    alloc.reset()
                    fake.log.clear()
                    dnn.conv_transpose2d(x, w, bias, stride, 1)
                    logs.append([e[0] for e in fake.log])
                assert "gemm" in logs[1]  # (a CuPy vector is made anew each call: astype and the like first)
                assert all(g[-1] == "graph_launch" and "gemm" not in g and "raw_kernel" not in g for g in logs[2:])
                if cupy_bias:
                    other = cupy.empty(32, dtype=np.float16)
                    alloc.reset()
                    fake.log.clear()
                    dnn.conv_transpose2d(x, w, other, stride, 1)
                    got = [e[0] for e in fake.log]
                    if stride == 2:  # col2im reads the caller's vector: another address, eager
                        assert "graph_launch" not in got
                    else:  # the epilogue's vector is made from it first (astype), where the graph reads it
                        assert got[0] == "astype" and got[-1] == "graph_launch"
                fake.log.clear()
                with pytest.raises(ValueError, match=r"bias: expected shape \(32,\)"):
                    dnn.conv_transpose2d(x, w, (cupy.empty if cupy_bias else np.ones)(31, dtype=np.float16), stride, 1)
                assert not any(e[0] in ("gemm", "raw_kernel", "graph_launch") for e in fake.log)


def _graphs_world(cupy, need_bytes=1024, fail=None):
    """A Graphs whose launch allocates ``need_bytes`` of scratch and records its pointers."""
    calls = []

    def launch(x, w, y):
        scratch = cupy.empty(need_bytes, dtype=np.uint8)
        capturing = cupy.cuda.get_current_stream().is_capturing()
        if fail is not None and capturing and fail():
            raise RuntimeError("capture invalidated")
        calls.append((capturing, scratch.data.ptr))
        fake_cupy.record("work", x.data.ptr, y.data.ptr)
    return call_graph.Graphs(launch), calls


def test_the_policy_eager_then_captured_then_launched_per_address_triple():
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0):
            x, w = cupy.empty(8, dtype=np.float32), cupy.empty(8, dtype=np.float32)
            ys = [cupy.empty(8, dtype=np.float32) for _ in range(call_graph.KEPT + 2)]
            g, calls = _graphs_world(cupy)
            g.run(x, w, ys[0])
            assert calls == [(False, calls[0][1])] and fake.log[-1][0] == "work"  # eager
            g.run(x, w, ys[0])
            assert calls[-1][0] is True and fake.log[-1][0] == "graph_launch"  # captured, launched
            n = len(calls)
            g.run(x, w, ys[0])
            assert len(calls) == n and fake.log[-1][0] == "graph_launch"  # the graph alone
            g.run(x, w, ys[1])
            assert calls[-1][0] is False  # a new output address: eager
            a = call_graph.arena(0, cupy.cuda.Stream.null)
            for y in ys:
                g.run(x, w, y)
                g.run(x, w, y)
            assert len(g.graphs) == call_graph.KEPT  # the least recently used dropped
            lo, hi = a.buf.data.ptr, a.buf.data.ptr + a.size
            assert all(lo <= p < hi for capturing, p in calls if capturing)  # scratch in the arena
            call_graph.ENABLED = False
            try:
                n = len(calls)
                g.run(x, w, ys[-1])
                assert len(calls) == n + 1 and calls[-1][0] is False
            finally:
                call_graph.ENABLED = True


def test_a_failed_capture_runs_eagerly_and_enough_failures_stop_capturing():
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0):
            x, w, y = (cupy.empty(8, dtype=np.float32) for _ in range(3))
            g, calls = _graphs_world(cupy, fail=lambda: True)
            g.run(x, w, y)
            for i in range(call_graph.TRIES):
                fake.log.clear()
                g.run(x, w, y)
                assert [e[0] for e in fake.log] == ["work"] and g.fails == i + 1  # eager after the failure
                assert not cupy.cuda.get_current_stream().is_capturing()
            assert "capture invalidated" in g.error and not g.graphs
            n = len(calls)
            g.run(x, w, y)
            assert len(calls) == n + 1 and calls[-1][0] is False  # no capture tried any more


def test_a_grown_arena_retires_the_graphs_captured_in_the_old_one():
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0):
            x, w, y = (cupy.empty(8, dtype=np.float32) for _ in range(3))
            small, small_calls = _graphs_world(cupy, need_bytes=1024)
            big, _ = _graphs_world(cupy, need_bytes=1 << 16)
            for _ in range(2):
                small.run(x, w, y)
            a = call_graph.arena(0, cupy.cuda.Stream.null)
            first = a.generation
            for _ in range(2):
                big.run(x, w, y)
            assert a.generation == first + 1 and a.size >= 1 << 16
            n = len(small_calls)
            small.run(x, w, y)  # its graph is of the old arena: captured again, not launched stale
            assert len(small_calls) == n + 1 and small_calls[-1][0] is True
            ((_, _, generation, _),) = small.graphs.values()
            assert generation == a.generation


def test_scratch_beyond_what_the_eager_run_allocated_comes_from_the_pool_and_stays_with_the_graph():
    with fake_cupy.installed() as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0):
            x, w, y = (cupy.empty(8, dtype=np.float32) for _ in range(3))
            sizes = iter([512, 4096])

            def launch(x, w, y):
                cupy.empty(next(sizes), dtype=np.uint8)
            g = call_graph.Graphs(launch)
            g.run(x, w, y)
            g.run(x, w, y)
            ((_, a, _, (buf, overflow)),) = g.graphs.values()
            assert buf is a.buf and len(overflow) == 1 and overflow[0].mem.raw.nbytes >= 4096


def test_a_capture_stream_has_a_cublas_handle_of_its_own():
    with fake_cupy.installed() as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0):
            for s in range(cublas_call.MAX_STREAMS + 1):
                key, h = cublas_call._take_handle(0, 0x9000 + s)
                cublas_call._give_handle(key, h)
            capture = call_graph.arena(0, cupy.cuda.Stream.null).capture.ptr
            key, h = cublas_call._take_handle(0, capture)
            assert h is cublas_call._RESERVED[(0, capture)] and h[2] == capture
            cublas_call._give_handle(key, h)
            assert h not in cublas_call._HANDLES.get(key, [])
            key2, h2 = cublas_call._take_handle(0, capture)
            assert h2 is h


def test_per_thread_default_streams_get_handles_per_thread():
    """cudaStreamPerThread is one pointer for another stream in each thread: its bound handles (and their
    workspaces) are kept per thread, never handed to a thread whose stream may run beside the first's."""
    import threading
    with fake_cupy.installed():
        keys = []

        def take():
            key, h = cublas_call._take_handle(0, 2)
            cublas_call._give_handle(key, h)
            keys.append((key, h))
        take()
        t = threading.Thread(target=take)
        t.start()
        t.join()
        assert keys[0][0] != keys[1][0] and keys[0][1] is not keys[1][1]


def _own_keys_taken(cupy):
    """Every own-stream handle key used up (MAX_STREAMS streams, each with its handle given back)."""
    for s in range(cublas_call.MAX_STREAMS):
        key, h = cublas_call._take_handle(0, 0x9000 + s)
        cublas_call._give_handle(key, h)


def test_a_shared_handle_orders_its_next_stream_after_its_last_gemm():
    """Past MAX_STREAMS, handles are shared per device: a handle given back records an event on the stream it
    issued on, and a stream that takes it from another waits for that event before its GEMM writes the
    workspace (the last GEMM may still be running)."""
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0):
            _own_keys_taken(cupy)
            fake.log.clear()
            key, h = cublas_call._take_handle(0, 0xA000)
            assert key == 0 and h[2] == 0xA000 and h[3] is None
            cublas_call._give_handle(key, h)
            (event,) = [e for e in fake.log if e[0] == "event_record"]
            assert event[1] == 0xA000
            fake.log.clear()
            key, h2 = cublas_call._take_handle(0, 0xB000)
            assert key == 0 and h2[0] == h[0] and h2[2] == 0xB000
            assert fake.log == [("wait_event", 0xB000, event[2])]
            cublas_call._give_handle(key, h2)
            fake.log.clear()
            key, h3 = cublas_call._take_handle(0, 0xB000)  # (the same stream again: no wait)
            assert h3[2] == 0xB000 and not [e for e in fake.log if e[0] == "wait_event"]


def test_a_capturing_stream_never_takes_a_shared_handle():
    """A graph keeps the workspace it was captured with: a capturing stream gets a handle of its own even past
    MAX_STREAMS (none recorded or waited on)."""
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0):
            _own_keys_taken(cupy)
            s = cupy.cuda.Stream(non_blocking=True)
            s.begin_capture()
            try:
                key, h = cublas_call._take_handle(0, s.ptr)
                cublas_call._give_handle(key, h)
            finally:
                s.end_capture()
            assert key == (0, s.ptr, 0) and h in cublas_call._HANDLES[key]


def test_a_handle_or_arena_keyed_by_a_stream_holds_that_stream():
    """An own-stream handle's key and an arena's name a stream by its handle: the stream is held, so a destroyed
    stream's handle never comes back as a new stream's while the first one's GEMMs or graphs may run."""
    import gc
    import weakref
    with fake_cupy.installed() as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0):
            s = cupy.cuda.Stream(non_blocking=True)
            alive = weakref.ref(s)
            with s:
                key, h = cublas_call._take_handle(0, s.ptr)
                cublas_call._give_handle(key, h)
            del s
            gc.collect()
            assert alive() is not None and cublas_call._HELD[key] is alive()
            s2 = cupy.cuda.Stream(non_blocking=True)
            alive = weakref.ref(s2)
            a = call_graph.arena(0, s2)
            del s2
            gc.collect()
            assert alive() is a.stream and call_graph.arena(0, a.stream) is a


def test_calls_on_a_per_thread_default_stream_stay_eager():
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0), cupy.cuda.Stream(ptr=2):  # cudaStreamPerThread: another stream per thread
            x, w, y = (cupy.empty(8, dtype=np.float32) for _ in range(3))
            g, calls = _graphs_world(cupy)
            for _ in range(3):
                g.run(x, w, y)
            assert [c[0] for c in calls] == [False] * 3 and not g.graphs and not g.seen


def test_a_call_with_an_epilogue_is_captured_with_it_and_keyed_by_its_operands_addresses():
    """conv + bias + shift + residual + relu: the graph holds the GEMMs and the epilogue kernel an eager replay
    launches (the residual read where it lies); another residual array (another address) runs eagerly."""
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0), cd.on_own_gpu():
            x, w = cupy.empty((4, 16, 8, 8), dtype=np.float32), cupy.empty((8, 16, 3, 3), dtype=np.float32)
            r1, r2 = (cupy.empty((4, 8, 8, 8), dtype=np.float32) for _ in range(2))
            named = {"x": x, "w": w, "res": r1}

            alloc = _same_addresses()

            def call(res):
                fake.log.clear()
                alloc.reset()
                dnn.conv2d(x, w, np.ones(8), 1, 1, shift=np.arange(8.0), residual=res, activation="relu")
                return [e for e in fake.log if e[0] not in ("upload", "tile")]  # (cache fills aside)
            with cupy.cuda.using_allocator(alloc):
                call(r1)  # the full path
                eager = _masked(call(r1), named)  # first sighting
                at_capture, later = call(r1), call(r1)
                other = call(r2)
            graphs = _graphs_of_the_one_kept_call()
    ((graph, _, _, _),) = graphs.graphs.values()
    assert _masked(graph.entries, named) == eager
    assert any(e[0] == "kernel" and any(type(a) is tuple and a[:2] == ("array", ("res", 0)) for a in e[2])
               for e in eager)  # the epilogue reads the residual where it lies
    assert at_capture == later == [("graph_launch", len(graph.entries), 0)]
    assert other and not any(e[0] == "graph_launch" for e in other)  # a new residual address: eager
