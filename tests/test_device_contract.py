"""The device contract (runtime/devices/base.py), checked against every backend that is registered
and can run here: ``sim`` and ``cpu`` everywhere, ``cuda`` where CuPy finds a GPU.

Stream devices do a round trip by hand, as a StreamWorker would: arena locations, host loads on
the H2D stream, gemm steps on a compute stream that waits for them, a write-back on the D2H
stream, events between them; then a peer copy, event semantics and close after a failure. The
host device runs whole tasks. Results are compared with numpy. Last, the numpy tile kernels that
sim and cpu share warn about non-finite values only where numpy's matmul would.
"""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest

from blasx.operands import TokenTable, make_operand
from blasx.runtime.call import Call
from blasx.runtime.devices import (ArraySource, DeviceError, HostDevice, HostSource, PeerSource, StreamDevice,
                                   backend, backends)
from blasx.runtime.devices.numpy_kernels import KERNELS, OPS
from blasx.runtime.devices.sim import SimDevice, SimModel
from blasx.runtime.plans import plan_gemm
from blasx.runtime.stats import CallStats, DeviceInfo
from blasx.runtime.tasks import Step
from blasx.runtime.tiling import OP_N, OP_T

TILE = 8


def _cuda_count() -> int:
    try:
        from blasx.runtime.devices import cuda  # noqa: F401 - registers the backend
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy, no driver or no GPU
        return 0


def _sim(i: int, **kw):
    # Slow host loads (512 bytes take ~5 ms): a kernel that did not wait for its copy would read garbage.
    return SimDevice(i, nstreams=2, cache_bytes=1 << 16, name=f"sim:{i}", model=SimModel(h2d=1e5), **kw)


def _cuda(i: int):
    return backend("cuda")(i, ordinal=i, nstreams=2, cache_bytes=32 << 20)


def _use(dev) -> None:
    """Make ``dev`` the calling thread's current device where the backend has one (CUDA events and
    kernels belong to the current device; a worker thread drives one device, this test several)."""
    if dev.kind == "cuda":
        import cupy
        cupy.cuda.Device(dev.ordinal).use()


def _cpu(i: int):
    return backend("cpu")(i, name="cpu", threads=1)


#: kind -> (factory(index), how many such devices this machine has); every registered kind needs one.
FACTORIES = {"sim": (_sim, lambda: 2), "cuda": (_cuda, _cuda_count), "cpu": (_cpu, lambda: 1)}
_MARKS = {"cuda": [pytest.mark.gpu]}
KINDS = [pytest.param(k, marks=_MARKS.get(k, [])) for k in FACTORIES]


def _device(kind: str, i: int = 0):
    factory, count = FACTORIES[kind]
    if count() <= i:  # (counting registers the backend where it can run: cuda)
        pytest.skip(f"{kind}: needs {i + 1} device(s) here")
    return factory(i)


def _stream_device(kind: str, i: int = 0) -> StreamDevice:
    dev = _device(kind, i)
    if not isinstance(dev, StreamDevice):
        dev.close()
        pytest.skip(f"{kind} is not a stream device")
    return dev


def _gemm_call(devs, m, n, k, dtype, alpha=1.5, beta=0.5, seed=0):
    """A planned gemm call on host operands; returns (call, (a, b, c0))."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)

    def rand(r, c):
        x = rng.standard_normal((r, c)) + (1j * rng.standard_normal((r, c)) if dt.kind == "c" else 0)
        return np.asfortranarray(x.astype(dt))
    a, b, c = rand(m, k), rand(k, n), rand(m, n)
    tokens = TokenTable(TILE)
    ops = [make_operand(x, tokens) for x in (a, b, c)]
    tasks = plan_gemm(m, n, k, TILE, OP_N, OP_N, beta_zero=beta == 0, is_complex=dt.kind == "c")
    stats = CallStats([DeviceInfo(d.index, d.name, d.kind) for d in devs])
    return Call("gemm", ops, tasks, dt, alpha, beta, stats), (a, b, c.copy())


def _tol(dtype) -> float:
    return 1e-5 if np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.complex64)) else 1e-12


def _rel(x, ref) -> float:
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


# ---------------------------------------------------------------- every backend

def test_every_registered_backend_implements_one_protocol():
    _cuda_count()  # registers cuda where CuPy imports
    for kind, cls in backends().items():
        assert kind in FACTORIES, f"backend {kind!r} has no contract test"
        assert cls.kind == kind and not inspect.isabstract(cls), cls
        assert issubclass(cls, StreamDevice) != issubclass(cls, HostDevice), cls
        assert cls.streamed == issubclass(cls, StreamDevice)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        backend("nope")


@pytest.mark.parametrize("kind", KINDS)
def test_opened_device_has_the_shared_attributes(kind):
    dev = _device(kind)
    dev.open()
    try:
        assert dev.kind == kind and dev.index == 0 and isinstance(dev.name, str) and dev.error is None
        assert dev.nstreams >= 1 and isinstance(dev.binds_thread, bool)
        assert isinstance(dev.reads_device_arrays, bool) and dev.knobs is not None
        assert kind in repr(dev) or dev.name in repr(dev)
        if isinstance(dev, StreamDevice):
            assert (dev.h2d_stream, dev.p2p_stream, dev.d2h_stream, dev.n_all_streams) == tuple(
                dev.nstreams + i for i in range(4))
            assert dev.heap is not None and dev.cache_capacity() == dev.heap.capacity > 0
        else:
            for name in ("copy_in", "copy_out", "run_step", "record", "arena_loc", "heap"):
                assert not hasattr(dev, name), f"a host device has no {name}"
    finally:
        dev.close()


# ---------------------------------------------------------------- stream devices

def _alloc_tile(dev, call, ref):
    off = dev.heap.alloc(ref.rows * ref.cols * call.itemsize)
    assert off is not None
    return off, dev.arena_loc(off, ref.rows, ref.cols, call.dtype)


def _run_task_by_hand(dev, call, task, s=0):
    """Load C, run every step after its tiles' loads, write C back, as a StreamWorker would."""
    offs = []
    c_off, c_loc = _alloc_tile(dev, call, task.c)
    offs.append(c_off)
    if task.load_c:
        dev.copy_in(dev.h2d_stream, c_loc, HostSource(call.operands[task.c.slot], task.c),
                    task.c.rows, task.c.cols, call.dtype, task)
    events = []
    for step in task.steps:
        locs = []
        for ref in (step.a, step.b):
            off, loc = _alloc_tile(dev, call, ref)
            offs.append(off)
            h = dev.begin_op(dev.h2d_stream)
            dev.copy_in(dev.h2d_stream, loc, HostSource(call.operands[ref.slot], ref), ref.rows, ref.cols,
                        call.dtype, task)
            dev.end_op(dev.h2d_stream, h, "h2d", ref.rows * ref.cols * call.itemsize, 0.0, task)
            locs.append(loc)
        loaded = dev.record(dev.h2d_stream)
        dev.wait(s, loaded)
        h = dev.begin_op(s)
        dev.run_step(s, step, call, locs[0], locs[1], c_loc, task)
        dev.end_op(s, h, "kernel", 0, call.step_flops(step), task)
        events.append(loaded)
    computed = dev.record(s)
    dev.wait(dev.d2h_stream, computed)
    dev.copy_out(dev.d2h_stream, call.operands[task.c.slot], task.c, c_loc, task)
    written = dev.record(dev.d2h_stream)
    dev.sync(written)
    assert dev.done(written) and dev.done(computed)
    for ev in events + [computed, written]:
        dev.release_event(ev)
    for off in offs:
        dev.heap.free(off)


@pytest.mark.parametrize("dtype", [np.float64, np.complex64])
@pytest.mark.parametrize("kind", KINDS)
def test_stream_device_round_trip_matches_numpy(kind, dtype):
    dev = _stream_device(kind)
    call, (a, b, c0) = _gemm_call([dev], 2 * TILE, TILE + 3, 2 * TILE, dtype)
    dev.open()
    try:
        for task in call.tasks:
            _run_task_by_hand(dev, call, task)
        records = dev.take_records()
    finally:
        dev.close()
    assert dev.error is None
    c = call.operands[2].array
    assert _rel(c, 1.5 * (a @ b) + 0.5 * c0) < _tol(dtype)
    assert isinstance(records, list)
    for stats, rec in records:
        assert rec.device == dev.index and rec.end >= rec.start and stats is call.stats
        assert call.tasks[rec.task].tid == rec.task


@pytest.mark.parametrize("kind", KINDS)
def test_stream_device_peer_copy(kind):
    d0, d1 = _stream_device(kind, 0), _stream_device(kind, 1)
    call, (a, _, _) = _gemm_call([d0, d1], TILE, TILE, TILE, np.float64)
    ref = call.tasks[0].steps[0].a
    host = call.operands[ref.slot]
    out_tokens = TokenTable(TILE)
    out = make_operand(np.zeros((TILE, TILE), order="F"), out_tokens)
    d0.open()
    d1.open()
    try:
        if not d1.can_read_from(d0):
            assert kind == "cuda", f"{kind}: two devices of this kind are peers"
            pytest.skip("these GPUs have no peer link")
        _use(d0)
        _, loc0 = _alloc_tile(d0, call, ref)
        d0.copy_in(d0.h2d_stream, loc0, HostSource(host, ref), ref.rows, ref.cols, call.dtype)
        filled = d0.record(d0.h2d_stream)  # in flight: the peer copy is ordered after it
        _use(d1)
        _, loc1 = _alloc_tile(d1, call, ref)
        d1.copy_in(d1.p2p_stream, loc1, PeerSource(d0, loc0, filled, host, ref), ref.rows, ref.cols, call.dtype)
        copied = d1.record(d1.p2p_stream)
        d1.wait(d1.d2h_stream, copied)
        d1.copy_out(d1.d2h_stream, out, ref._replace(slot=0), loc1)
        d1.sync(d1.record(d1.d2h_stream))
        d0.sync(filled)
    finally:
        for d in (d1, d0):
            _use(d)
            d.close()
    np.testing.assert_array_equal(out.array, a[:TILE, :TILE])


@pytest.mark.parametrize("kind", KINDS)
def test_stream_device_events(kind):
    dev = _stream_device(kind)
    call, (a, _, _) = _gemm_call([dev], TILE, TILE, TILE, np.float64)
    ref = call.tasks[0].steps[0].a
    dev.open()
    try:
        idle = dev.record(1)  # nothing issued on stream 1: complete at once
        dev.sync(idle)
        assert dev.done(idle)
        _, loc = _alloc_tile(dev, call, ref)
        dev.copy_in(dev.h2d_stream, loc, HostSource(call.operands[ref.slot], ref), ref.rows, ref.cols, call.dtype)
        loaded = dev.record(dev.h2d_stream)
        dev.wait(0, loaded)  # stream 0 waits for stream h2d: its event ends after the load
        after = dev.record(0)
        dev.sync(after)
        assert dev.done(after) and dev.done(loaded)  # events complete in stream order
        dev.wait(0, loaded)  # waiting on a completed event does not block
        dev.sync(dev.record(0))
        for ev in (idle, loaded, after):
            dev.release_event(ev)
    finally:
        dev.close()
    assert dev.error is None


@pytest.mark.parametrize("kind", KINDS)
def test_stream_device_rejects_unknown_kernels_and_sources_and_closes(kind):
    dev = _stream_device(kind)
    call, _ = _gemm_call([dev], TILE, TILE, TILE, np.float64)
    step = Step("no-such-kernel", None, None, OP_N, OP_T, TILE, TILE, TILE, 0, 1)
    dev.open()
    try:
        _, loc = _alloc_tile(dev, call, call.tasks[0].c)
        with pytest.raises(DeviceError, match="no-such-kernel"):
            dev.run_step(0, step, call, None, None, loc)
        if not dev.reads_device_arrays:
            src = ArraySource(call.operands[0], call.tasks[0].steps[0].a)
            with pytest.raises(DeviceError):
                dev.copy_in(dev.p2p_stream, loc, src, TILE, TILE, call.dtype)
        dev.sync(dev.record(0))  # still usable: nothing was issued
    finally:
        dev.close()


@pytest.mark.parametrize("kind", KINDS)
def test_quiesce_waits_for_the_work_issued_on_every_stream(kind):
    """A failing worker quiesces its device before its tasks go to others: the copies and kernels already issued
    (a write-back among them) have completed when quiesce returns."""
    dev = _stream_device(kind)
    call, _ = _gemm_call([dev], TILE, TILE, TILE, np.float64)
    ref = call.tasks[0].steps[0].a
    dev.open()
    try:
        _, loc = _alloc_tile(dev, call, ref)
        dev.copy_in(dev.h2d_stream, loc, HostSource(call.operands[ref.slot], ref), ref.rows, ref.cols, call.dtype)
        loaded = dev.record(dev.h2d_stream)
        dev.quiesce()
        assert dev.done(loaded)
        dev.release_event(loaded)
    finally:
        dev.close()


def test_a_failing_worker_quiesces_its_device_before_handing_its_tasks_on():
    """Worker.fail: the device's queued work is waited for (a broken device's error suppressed) before the
    engine hands the worker's tasks to other devices or fails their calls."""
    from types import SimpleNamespace as NS

    from blasx.runtime.worker_base import Worker
    order = []

    def quiesce():
        order.append("quiesce")
        raise DeviceError("a broken device cannot wait")
    dev = NS(error=None, quiesce=quiesce)
    engine = NS(worker_failed=lambda w, exc, held: order.append(("handed on", w.dev.error, held)))
    me = NS(alive=True, dev=dev, engine=engine, held_tasks=lambda: ["t"])
    exc = RuntimeError("tile copy refused")
    Worker.fail(me, exc)
    assert order == ["quiesce", ("handed on", exc, ["t"])] and not me.alive


def test_sim_fault_breaks_the_device_and_close_still_works():
    dev = _sim(0, fail_at=1)
    call, _ = _gemm_call([dev], TILE, TILE, TILE, np.float64)
    dev.open()
    try:
        with pytest.raises(DeviceError, match="injected fault at kernel 1"):
            _run_task_by_hand(dev, call, call.tasks[0])
        ev = dev.record(0)  # a broken device executes nothing more: its events never complete
        with pytest.raises(DeviceError):
            dev.done(ev)
        with pytest.raises(DeviceError):
            dev.sync(ev)
    finally:
        dev.close()
    assert "injected fault" in repr(dev.error)


def test_sim_peer_copy_reads_the_home_when_the_peer_breaks():
    d0, d1 = _sim(0), _sim(1)
    call, (a, _, _) = _gemm_call([d0, d1], TILE, TILE, TILE, np.float64)
    ref = call.tasks[0].steps[0].a
    host = call.operands[ref.slot]
    d0.open()
    d1.open()
    try:
        _, loc0 = _alloc_tile(d0, call, ref)
        _, loc1 = _alloc_tile(d1, call, ref)
        def boom():
            raise RuntimeError("test: the peer breaks")
        d0.streams[0].submit(boom)
        never = d0.record(0)  # after the failure: never fires
        d1.copy_in(d1.p2p_stream, loc1, PeerSource(d0, loc0, never, host, ref), ref.rows, ref.cols, call.dtype)
        d1.sync(d1.record(d1.p2p_stream))
        got = np.array(loc1)
    finally:
        d1.close()
        d0.close()
    np.testing.assert_array_equal(got, a[:TILE, :TILE])
    assert d1.error is None and d0.error is not None


# ---------------------------------------------------------------- host devices

@pytest.mark.parametrize("dtype", [np.float32, np.complex128])
@pytest.mark.parametrize("kind", KINDS)
def test_host_device_runs_tasks_in_place(kind, dtype):
    _cuda_count()  # registers cuda where CuPy imports (this test may run first)
    if not issubclass(backends().get(kind, StreamDevice), HostDevice):
        pytest.skip(f"{kind} is not a host device")
    dev = _device(kind)
    call, (a, b, c0) = _gemm_call([dev], 2 * TILE + 1, TILE, 3 * TILE, dtype)
    dev.open()
    dev.prepare_call(call)
    try:
        flops, seconds = dev.probe(dtype)
        assert flops > 0 and seconds > 0
        dev.engage()
        for task in call.tasks:
            dev.run_task(task)
    finally:
        dev.finish_call(call)
        dev.close()
    assert _rel(call.operands[2].array, 1.5 * (a @ b) + 0.5 * c0) < _tol(dtype)
    assert call.stats.profile().totals()["tasks"] == len(call.tasks)


# ---------------------------------------------------------------- tile kernels: floating-point warnings

def _warns(fn) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return any(issubclass(w.category, RuntimeWarning) for w in caught)


def _kernel_inputs(dtype, fill):
    a = np.ones((4, 4), dtype=dtype, order="F")
    b = np.ones((4, 4), dtype=dtype, order="F")
    c = np.ones((4, 4), dtype=dtype, order="F")
    a[0, 0], a[2, 1], a[1, 2] = -fill, fill, fill  # in both triangles and off the diagonal
    b[3, 0] = fill
    c[0, 0] = c[3, 3] = fill  # with -fill from a: fill - fill where C is accumulated
    return a, b, c


@pytest.mark.parametrize("fill", [np.nan, np.inf])
@pytest.mark.parametrize("dtype", [np.float64, np.complex64])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_tile_kernels_warn_only_where_numpy_matmul_would(name, dtype, fill):
    """NaN inputs never warn (numpy's matmul does not); gemm's product warns exactly when numpy's
    matmul of the same tiles does; the other kernels, like their BLAS routines, never warn."""
    scalars = np.array([2, 0.5, 0, 1, -1, 2], dtype=dtype)
    for side, op in ((0, 0), (1, 1)):
        a, b, c = _kernel_inputs(dtype, fill)
        step = Step(name, None, None, op, 0, 4, 4, 4, 0, 1, side, 1, 0)
        warned = _warns(lambda: KERNELS[name](step, scalars, a, b, c))
        if name == "gemm":
            a, b, _ = _kernel_inputs(dtype, fill)
            assert warned == _warns(lambda: np.matmul(OPS[op](a), b)), (side, op)
        else:
            assert not warned, (side, op)
        if fill is np.nan:
            assert not warned
