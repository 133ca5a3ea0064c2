"""Staging one-shot inputs through page-locked buffers (hostmem's staging), without CUDA: which operands
are staged, the bytes the copy threads put in the buffer, where tile copies then read, failures."""

import types

import numpy as np
import pytest

from blasx.runtime import hostmem
from blasx.runtime.hostmem import RegistrationCache


@pytest.fixture
def rt(fake_cuda, monkeypatch):
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 1 << 16)
    return fake_cuda()


def buffers(log):
    def buffer(nbytes):
        b = np.empty(nbytes, dtype=np.uint8)
        log.append(b)
        return b
    return buffer


def test_a_first_seen_input_is_staged_and_registered_in_place_when_seen_again(rt):
    reg, made = RegistrationCache(), []
    rng = np.random.default_rng(0)
    a = np.asfortranarray(rng.standard_normal((96, 200)))  # 150 KiB: three 64 KiB chunks
    c = np.ones((96, 200), order="F")
    (pa, pc), job = reg.pin([a, c], late={1}, readonly={0}, buffer=buffers(made))
    job.join()
    assert len(made) == 1 and pa.staged is made[0] and pa.delta == made[0].ctypes.data - a.ctypes.data
    assert np.array_equal(made[0].view(a.dtype).reshape(a.shape, order="F"), a)  # every byte copied
    assert pc.staged is None and rt.registered and all(s >= c.ctypes.data for s, _ in rt.registered)  # C registered
    assert job.staged_bytes == a.nbytes and job.pinned_bytes == sum(n for _, n in rt.registered)
    assert job.threads == min(hostmem.STAGE_THREADS, len(pa.chunks) + len(pc.chunks))
    assert pa.pieces(a.ctypes.data, 96 * 8, 96 * 8, 200) == [(0, 200, 0, 96 * 8)]  # one buffer: no cuts
    # the next call on the same A: it is being reused, so it is registered in place
    (again,), job2 = reg.pin([a], readonly={0}, buffer=buffers(made))
    job2.join()
    assert len(made) == 1 and again.staged is None and again.delta == 0 and all(again.ok)
    for x in (a, c):
        reg.release(x)


def test_what_is_never_staged(rt):
    reg, made = RegistrationCache(), []
    big = np.ones((96, 400), order="F")
    (p1, p2), job = reg.pin([big[:, :200], big[:, 200:]], readonly={0}, buffer=buffers(made))
    job.join()  # A a view of half its root, and that root written by the call: both registered in place
    assert not made and p1 is p2 and p1.staged is None
    small = np.ones(16)
    (ps,), job = reg.pin([small], readonly={0}, buffer=buffers(made))
    assert ps is None and job is None and not made  # small: pageable
    d = np.ones((96, 200))
    (pd,), job = reg.pin([d], readonly={0}, buffer=lambda n: None)  # no buffer to be had: registered
    job.join()
    assert pd.staged is None and all(pd.ok)
    e = np.ones((96, 200))
    (pe,), job = reg.pin([e], readonly=(), buffer=buffers(made))  # not an input only: registered
    job.join()
    assert pe.staged is None and not made
    for x in (big, d, e):
        reg.release(x)


def test_one_root_read_twice_is_staged_once(rt):
    reg, made = RegistrationCache(), []
    a = np.ones((96, 200), order="F")
    (p1, p2), job = reg.pin([a, a.T], readonly={0, 1}, buffer=buffers(made))
    job.join()
    assert len(made) == 1 and p1 is p2 and p1.staged is made[0] and job.staged_bytes == a.nbytes


def test_a_failed_staging_copy_fails_the_tile_copy_instead_of_reading_the_buffer(rt, monkeypatch):
    reg, made = RegistrationCache(), []
    a = np.ones((96, 200), order="F")

    def broken(p, i):
        p.ready[i].set()  # as stage_chunk's finally after a failed copy: ready, not ok
    monkeypatch.setattr(hostmem, "stage_chunk", broken)
    (pa,), job = reg.pin([a], readonly={0}, buffer=buffers(made))
    job.join()
    with pytest.raises(RuntimeError, match="staging buffer"):
        pa.pieces(a.ctypes.data, 96 * 8, 96 * 8, 10)


def test_the_cuda_backend_reads_a_staged_input_from_its_buffer(rt):
    """``_copy_2d`` of a staged operand copies from the buffer at the same offsets; writes never go there."""
    from blasx.runtime.devices.cuda import CudaDevice
    reg, made = RegistrationCache(), []
    rng = np.random.default_rng(1)
    a = np.asfortranarray(rng.standard_normal((96, 200)))
    (pa,), job = reg.pin([a], readonly={0}, buffer=buffers(made))
    job.join()
    dev = types.SimpleNamespace(stream_ptrs=[0])
    op = types.SimpleNamespace(on_host=True, pinning=pa)
    tile = np.zeros((32, 50), order="F")
    src = a.ctypes.data + (50 * 96 + 32) * 8  # rows 32.., columns 50..
    CudaDevice._copy_2d(dev, 0, "in", op, tile.ctypes.data, 32 * 8, src, 96 * 8, 32, 50, 8)
    assert np.array_equal(tile, a[32:64, 50:100])
    assert rt.copies[-1][1] == src + pa.delta  # read from the buffer
    with pytest.raises(AssertionError):
        CudaDevice._copy_2d(dev, 0, "out", op, src, 96 * 8, tile.ctypes.data, 32 * 8, 32, 50, 8)


def test_calls_in_several_threads_on_one_fresh_array(rt, in_threads):
    """Threads pinning the same never-seen array at once: exactly one stages it (into its own buffer), the
    others register it in place once; every thread's chunks end ready and what it reads holds the array."""
    import threading
    reg, made = RegistrationCache(), []
    rng = np.random.default_rng(3)
    a = np.asfortranarray(rng.standard_normal((96, 400)))
    results = []
    barrier = threading.Barrier(4)

    def call(_):
        barrier.wait()
        (p,), job = reg.pin([a], readonly={0}, buffer=buffers(made))
        if job is not None:
            job.join()
        p.wait(p.lo, p.hi)
        results.append(p)
    in_threads(call, 4)
    assert len(results) == 4
    staged = [p for p in results if p.staged is not None]
    assert len(staged) == len(made) == 1 and np.array_equal(staged[0].staged.view(a.dtype), a.ravel(order="F"))
    in_place = {id(p) for p in results if p.staged is None}
    assert len(in_place) == 1 and all(all(p.ok) for p in results)  # one registration, shared
    assert sum(n for _, n in rt.registered) == next(p for p in results if p.staged is None).pinned_bytes
    reg.release(a)


def test_a_finished_call_leaves_nothing_alive_through_a_registered_root(rt):
    """A registered root's Pinning lives as long as the root; once the job is done it refers to no job, so
    a staged buffer and the call's other arrays die with the call (with the cyclic collector off)."""
    import gc
    import weakref
    reg = RegistrationCache()
    a, c = np.ones((96, 200), order="F"), np.ones((96, 200), order="F")
    gc.disable()
    try:
        pinnings, job = reg.pin([a, c], readonly={0}, buffer=lambda n: np.empty(n, dtype=np.uint8))
        job.join()
        staged = weakref.ref(pinnings[0].staged)
        dead_job = weakref.ref(job)
        pc = reg._ours[id(c)]
        del pinnings, job
        assert staged() is None and dead_job() is None and pc.owner == [None] * len(pc.chunks)
    finally:
        gc.enable()
    reg.release(c)


def test_a_new_results_first_contents_are_staged_into_it(rt, monkeypatch):
    """``into``: the caller's c, read only as the first contents of a new (page-locked) result, is copied into
    the result itself, after the inputs' chunks, seen before or not; tile copies read c's tiles there."""
    reg, made = RegistrationCache(), []
    rng = np.random.default_rng(4)
    a, c0 = (np.asfortranarray(rng.standard_normal((96, 200))) for _ in range(2))
    out = np.full((96, 200), np.nan, order="F")  # the new result, page-locked (the pool's)
    lo, hi = out.ctypes.data, out.ctypes.data + out.nbytes
    monkeypatch.setattr(hostmem, "_is_pinned", lambda runtime, ptr: lo <= ptr < hi)
    order = []
    real = hostmem.stage_chunk
    monkeypatch.setattr(hostmem, "stage_chunk", lambda p, i: (order.append(p.staged.ctypes.data != lo), real(p, i)))
    for seen_before in (False, True):
        out.fill(np.nan)
        order.clear()
        (pa, pout, pc0), job = reg.pin([a, out, c0], late={1, 2}, readonly={0, 2}, buffer=buffers(made), into={2: out},
                                       threads=1)
        job.join()
        assert pout.foreign and pc0.delta == lo - c0.ctypes.data and np.array_equal(out, c0)
        assert (pa.staged is not None) != seen_before and len(made) == (not seen_before) and job.staged_bytes == c0.nbytes + (0 if seen_before else a.nbytes)
        if not seen_before:
            assert order == [True] * len(pa.chunks) + [False] * len(pc0.chunks)  # A's chunks first, then c's
        made.clear()
        reg.release(a)
    # not byte for byte alike (C order against F), or not page-locked: c is staged or registered as any input
    c1 = np.ascontiguousarray(c0)
    (_, p1), job = reg.pin([out, c1], readonly={1}, buffer=buffers(made), into={1: out})
    job.join()
    assert p1.staged is made[0] and p1.staged is not out
    other = np.empty((96, 200), order="F")
    c2 = c0.copy(order="F")
    (_, p2), job = reg.pin([other, c2], readonly={1}, buffer=buffers(made), into={1: other})
    job.join()
    assert p2.staged is made[1] and not np.isnan(out).any()
    reg.release(other)


def test_calls_in_several_threads_stage_one_c_into_their_own_results(rt, monkeypatch, in_threads):
    """Threads whose calls start new results from the same c at once: each copies c into its own result, and
    c is registered by none of them."""
    import threading
    reg = RegistrationCache()
    c = np.asfortranarray(np.random.default_rng(5).standard_normal((96, 300)))
    outs = [np.full((96, 300), np.nan, order="F") for _ in range(4)]
    spans = [(o.ctypes.data, o.ctypes.data + o.nbytes) for o in outs]
    monkeypatch.setattr(hostmem, "_is_pinned", lambda runtime, ptr: any(lo <= ptr < hi for lo, hi in spans))
    barrier = threading.Barrier(4)
    got = [None] * 4

    def call(i):
        barrier.wait()
        (_, p), job = reg.pin([outs[i], c], late={0, 1}, readonly={1}, into={1: outs[i]})
        job.join()
        got[i] = p
    in_threads(call, 4)
    assert all(p.delta == o.ctypes.data - c.ctypes.data for p, o in zip(got, outs))
    assert all(np.array_equal(o, c) for o in outs) and not rt.registered and id(c) not in reg._ours


def test_a_strided_window_with_no_base_is_neither_staged_nor_registered(rt):
    """blasx.offload's view of np.matmul's operand (a C extension's array with no base that does not own its
    memory) of A[:, :k]: its nbytes is not its extent, so staging its "whole root" would copy the wrong bytes
    and registering [data, data + nbytes) the wrong range. It stays pageable."""
    import blasx
    from blasx import numpy_api
    from blasx.operands import canonical
    from blasx.runtime.tiling import OP_N
    pytest.importorskip("blasx._matmul_loops")
    seen = {}
    real = numpy_api.run_batch

    def spy(a, b, c, xp=np):
        seen.setdefault("a", a)
        return real(a, b, c, xp)
    numpy_api.run_batch = spy
    try:
        blasx.configure(devices="sim:1", tile=32)
        a, b = np.random.default_rng(0).random((256, 300)), np.random.default_rng(1).random((200, 64))
        with blasx.offload(threshold=0):
            got = a[:, :200] @ b
    finally:
        numpy_api.run_batch = real
        blasx.shutdown()
    assert np.allclose(got, a[:, :200] @ b)
    x, _ = canonical(seen["a"][0], OP_N, False)
    assert hostmem.root_of(x).base is None and not hostmem.root_of(x).flags.owndata
    reg = RegistrationCache()
    assert reg._staging(rt, x, {}, lambda n: np.zeros(n, np.uint8), min_bytes=0) is None
    assert reg._pinning(rt, x, 0) == (None, [])
    from blasx.operands import frozen_root
    x.flags.writeable = False  # (foreign memory: never cached for its life, whatever its flag says)
    assert frozen_root(x) is None
