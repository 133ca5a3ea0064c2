"""The result pool (runtime/hostpool.py) on ordinary memory: arrays handed out, buffers coming back
only when the last view dies, reuse by size, the idle limit, allocation failure; and which results
the front ends take from it."""

import ctypes
import gc

import numpy as np
import pytest

from blasx.runtime import hostpool
from blasx.runtime.hostmem import PAGE


class FakeHost:
    """cudaHostAlloc / cudaFreeHost on ctypes buffers: what is live, what was freed."""

    def __init__(self, fail=False):
        self.live, self.freed, self.fail = {}, [], fail

    def alloc(self, nbytes):
        if self.fail:
            raise MemoryError("cudaErrorMemoryAllocation")
        buf = (ctypes.c_byte * nbytes)()
        self.live[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def free(self, ptr):
        self.freed.append(ptr)
        del self.live[ptr]


def pool(idle_limit=1 << 30, fail=False):
    host = FakeHost(fail)
    return hostpool.OutputPool(host.alloc, host.free, idle_limit), host


def test_an_array_of_the_shape_order_and_dtype_asked_for():
    p, host = pool()
    a = p.array((300, 200), np.float32)
    b = p.array((5, 7), np.complex128, order="C", zeros=True)
    assert a.shape == (300, 200) and a.dtype == np.float32 and a.flags.f_contiguous and a.flags.writeable
    assert b.flags.c_contiguous and not b.any() and b.dtype == np.complex128
    a[...] = 1.5
    assert (a == 1.5).all() and a.ctypes.data in host.live and len(host.live) == 2 and p.handed == 2


def test_a_buffer_comes_back_when_the_last_view_dies_and_serves_the_same_size():
    p, host = pool()
    a = p.array((256, 64), np.float64)
    ptr, view = a.ctypes.data, a[10:, 3:]
    del a
    gc.collect()
    assert p.idle_bytes == 0 and p.handed == 1  # a view of it is alive: not reusable
    view[...] = 2.0  # (still the caller's memory)
    del view
    gc.collect()
    assert p.idle_bytes == 256 * 64 * 8 and p.handed == 0 and not host.freed
    other = p.array((100, 100), np.float64)  # another size: a new buffer
    again = p.array((64, 256), np.float64, order="C")  # the same bytes: the idle buffer
    assert again.ctypes.data == ptr and other.ctypes.data != ptr and p.reused == 1 and p.idle_bytes == 0


def test_idle_buffers_beyond_the_limit_are_freed_oldest_first():
    p, host = pool(idle_limit=3 * PAGE)
    arrays = [p.array((PAGE // 8,), np.float64) for _ in range(4)]  # a page each
    ptrs = [x.ctypes.data for x in arrays]
    while arrays:  # freed in the order made
        arrays.pop(0)
    gc.collect()
    assert host.freed == ptrs[:1] and p.idle_bytes == 3 * PAGE
    p.clear()
    assert sorted(host.freed) == sorted(ptrs) and p.idle_bytes == 0 and not host.live


def test_no_page_locked_memory_gives_none_for_a_plain_array():
    p, _ = pool(fail=True)
    assert p.array((10, 10), np.float64) is None and p.handed == 0


def test_front_ends_take_large_host_results_from_the_pool_on_gpu_engines(monkeypatch):
    from blasx import blas3, session
    from blasx.runtime import hostmem
    p, host = pool()
    monkeypatch.setattr(hostpool, "POOL", p)
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 16)
    monkeypatch.setattr(session, "on_cuda", lambda: True)
    big = blas3.new_array(np, (128, 128), np.float64, None)
    zeros = blas3.new_array(np, (128, 128), np.float32, None, zeros=True, order="C")
    small = blas3.new_array(np, (16, 16), np.float64, None)  # under MIN_REGISTER_BYTES: plain memory
    assert big.ctypes.data in host.live and zeros.ctypes.data in host.live and not zeros.any()
    assert big.flags.f_contiguous and zeros.flags.c_contiguous and small.flags.owndata
    monkeypatch.setattr(hostpool, "POOL", hostpool.OutputPool(host.alloc, host.free, idle_limit=None))
    assert blas3.new_array(np, (128, 128), np.float64, None).flags.owndata  # BLASX_RESULT_POOL=off
    monkeypatch.setattr(session, "on_cuda", lambda: False)  # the CPU or the sim: plain arrays
    monkeypatch.setattr(hostpool, "POOL", p)
    assert blas3.new_array(np, (128, 128), np.float64, None).flags.owndata


def test_on_cuda_is_false_before_the_first_call_and_on_the_cpu():
    import blasx
    from blasx import session
    blasx.shutdown()
    assert session.on_cuda() is False
    blasx.configure(devices="cpu")
    try:
        blasx.gemm(1.0, np.ones((4, 4)), np.ones((4, 4)))
        assert session.on_cuda() is False
    finally:
        blasx.configure()


@pytest.mark.parametrize("zeros", [False, True])
def test_results_of_the_pool_are_exact_after_reuse(zeros):
    """A reused buffer holds the previous result's bytes: a zeros request clears them, an empty one
    is written whole by its call."""
    p, _ = pool()
    a = p.array((64, 64), np.float64)
    a[...] = 7.0
    del a
    gc.collect()
    b = p.array((64, 64), np.float64, zeros=zeros)
    assert p.reused == 1 and ((b == 0).all() if zeros else (b == 7.0).all())


def test_shutdown_releases_the_idle_buffers(monkeypatch):
    import blasx
    p, host = pool()
    monkeypatch.setattr(hostpool, "POOL", p)
    a = p.array((64, 64), np.float64)
    ptr = a.ctypes.data
    del a
    gc.collect()
    assert p.idle_bytes > 0
    blasx.shutdown()
    assert p.idle_bytes == 0 and host.freed == [ptr]


def test_zero_clears_every_part_of_a_large_buffer(monkeypatch):
    monkeypatch.setattr(hostpool, "ZERO_PART", 1024)
    flat = np.full(10_001, 3.0)  # ~80 KB: split over the threads, uneven parts
    hostpool.zero(flat)
    assert not flat.any()
    small = np.full(10, 2.0)
    hostpool.zero(small)
    assert not small.any()


def test_threads_sharing_the_pool_never_get_a_buffer_that_is_in_use():
    import threading
    p, host = pool()
    live, lock, errors = set(), threading.Lock(), []

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(200):
            shape = (64, 64) if rng.random() < 0.5 else (32, 128 + 64)
            a = p.array(shape, np.float64)
            with lock:
                if a.ctypes.data in live:
                    errors.append(a.ctypes.data)
                live.add(a.ctypes.data)
            a[...] = seed
            ok = (a == seed).all()
            with lock:
                live.discard(a.ctypes.data)
            if not ok:
                errors.append("overwritten")
            del a
    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert not errors and p.handed == 0 and p.reused > 0


def test_the_environment_turns_the_pool_off_or_sets_its_idle_limit(monkeypatch):
    assert hostpool.env_setting("") == hostpool._host_bytes() // 8
    assert hostpool.env_setting(" off ") is None and hostpool.env_setting("0") is None
    assert hostpool.env_setting("8G") == 8_000_000_000 and hostpool.env_setting("64Mi") == 64 << 20
    with pytest.raises(ValueError, match=r"BLASX_RESULT_POOL: got 'lots'.*or off"):
        hostpool.env_setting("lots")
    monkeypatch.setenv("BLASX_RESULT_POOL", "off")
    host = FakeHost()
    p = hostpool.OutputPool(host.alloc, host.free)  # read at the first result
    assert p.array((64, 64), np.float64) is None and not host.live
    monkeypatch.setenv("BLASX_RESULT_POOL", "1Mi")
    p = hostpool.OutputPool(host.alloc, host.free)
    assert p.array((64, 64), np.float64) is not None and p.idle_limit == 1 << 20


def test_locked_memory_zeroes_registers_whole_and_unmaps_on_free(monkeypatch):
    """A new buffer: zeroed pages (touched in parts by several threads), one registration of the whole
    range; free unregisters it and unmaps; a failed registration unmaps and raises."""
    monkeypatch.setattr(hostpool, "ZERO_PART", 1 << 16)
    calls = []
    mem = hostpool.LockedMemory(lambda p, n: calls.append(("register", p, n)),
                                lambda p: calls.append(("unregister", p)))
    nbytes = 64 * PAGE
    ptr = mem.alloc(nbytes)
    buf = (ctypes.c_byte * nbytes).from_address(ptr)
    assert calls == [("register", ptr, nbytes)] and mem.live == 1 and ptr % PAGE == 0
    assert not any(bytes(buf))
    buf[nbytes - 1] = 7
    del buf
    mem.free(ptr)
    assert calls[-1] == ("unregister", ptr) and mem.live == 0

    def refuse(p, n):
        raise MemoryError("cudaErrorHostMemoryAlreadyRegistered")
    with pytest.raises(MemoryError):
        hostpool.LockedMemory(refuse, lambda p: None).alloc(nbytes)

    def interrupted(flat):
        raise KeyboardInterrupt
    monkeypatch.setattr(hostpool, "zero", interrupted)
    with pytest.raises(KeyboardInterrupt):  # the interrupt itself, not an unmapping error
        mem.alloc(nbytes)
    assert mem.live == 0


def test_an_interrupt_as_the_registration_returns_unregisters_before_unmapping():
    """Ctrl-C raised as cudaHostRegister returns (the range registered): the range is unregistered before it is
    unmapped (registered pages unmapped would let a later allocation there pass for page-locked)."""
    calls = []

    def register(p, n):
        calls.append(("register", p))
        raise KeyboardInterrupt
    mem = hostpool.LockedMemory(register, lambda p: calls.append(("unregister", p)))
    with pytest.raises(KeyboardInterrupt):
        mem.alloc(16 * PAGE)
    assert [c[0] for c in calls] == ["register", "unregister"] and calls[0][1] == calls[1][1] and mem.live == 0


@pytest.mark.parametrize("order", ["F", "C"])
def test_copy_into_in_parts_equals_assignment(monkeypatch, order):
    """copy_into cuts the outermost axis into parts (several threads): the same values as ``dst[...] = src``,
    across layouts and a cast; a part's failure is raised to the caller."""
    monkeypatch.setattr(hostpool, "ZERO_PART", 1 << 10)
    rng = np.random.default_rng(3)
    src = rng.standard_normal((37, 53)).astype(np.float32)
    src = src if order == "F" else np.asfortranarray(src)  # the other layout from dst's
    dst = np.empty((37, 53), np.float64, order=order)
    hostpool.copy_into(dst, src)
    assert np.array_equal(dst, src.astype(np.float64))
    with pytest.raises(ValueError):
        hostpool.copy_into(np.empty((37, 53)), np.empty((37, 54)))
