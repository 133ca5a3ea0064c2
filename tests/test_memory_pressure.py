"""Memory pressure on the sim: another allocation takes device memory before or during a call.

``runtime.devices.sim.take_memory(i, n)`` stands for another library (CuPy's pool, torch)
allocating on sim ``i``. The heap is sized from what is free when the engine starts; a
running engine keeps its tile cache within what is left (it evicts), and a call that cannot
fit even then fails with a MemoryError that says what it needed and had. No device dies.
"""

from __future__ import annotations

import importlib
import threading

import numpy as np
import pytest

import blasx

sim = importlib.import_module("blasx.runtime.devices.sim")
faults = importlib.import_module("blasx.runtime.faults")

MEM = 1 << 20
TILE = 32  # float64 tiles of 8 KiB


@pytest.fixture
def taken():
    held = []

    def take(i, n):
        held.append(sim.take_memory(i, n))
        return held[-1]
    yield take
    for h in held:
        h.release()
    faults.install(None)


def _taker(phase, nth, take, index, nbytes):
    """A fault hook that takes ``nbytes`` on sim ``index`` the ``nth`` time ``phase`` is reached."""
    seen = []
    lock = threading.Lock()

    def hook(p, device, task):
        if p != phase:
            return
        with lock:
            seen.append(p)
            if len(seen) == nth:
                take(index, nbytes)
    return hook


def test_heap_is_sized_from_what_is_free_at_start(taken, rand, rel_err):
    taken(0, MEM // 2)
    blasx.configure(devices=f"sim:2,mem={MEM}", tile=TILE)
    a, b = rand((256, 256)), rand((256, 256), seed=1)
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12
    eng = blasx.engine()
    assert eng.devices[0].cache_capacity() == MEM // 2 and eng.devices[1].cache_capacity() == MEM
    assert eng.leaks() == []


def test_memory_taken_mid_call_shrinks_the_cache(taken, rand, rel_err):
    """Three quarters of both sims' memory go mid-call: the cache evicts down to what is left
    and the call completes, right."""
    blasx.configure(devices=f"sim:2,mem={MEM}", tile=TILE)
    a, b = rand((256, 256)), rand((256, 256), seed=1)
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12
    first = _taker("compute", 5, taken, 0, 3 * MEM // 4)
    second = _taker("compute", 6, taken, 1, 3 * MEM // 4)
    faults.install(lambda p, d, t: (first(p, d, t), second(p, d, t)))
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12
    faults.install(None)
    eng = blasx.engine()
    for d in eng.devices:
        assert d.heap.bytes_used <= MEM // 4
    assert eng.leaks() == [] and all(w.alive for w in eng.workers)
    assert rel_err(blasx.gemm(1.0, b, a), b @ a) < 1e-12


def test_too_little_memory_mid_call_fails_the_call_clearly(taken, rand, rel_err):
    """All but two tiles' worth taken on the only sim mid-call: a task needs three (A, B, C),
    so the call fails with a MemoryError naming what it needed and had; the device lives, and
    once the memory is given back the next call runs."""
    blasx.configure(devices=f"sim:1,mem={MEM}", tile=TILE, streams=1)
    a, b = rand((128, 128)), rand((128, 128), seed=1)
    held = []
    hook = _taker("compute", 2, lambda i, n: held.append(taken(i, n)), 0, MEM - 2 * 8192)
    faults.install(hook)
    with pytest.raises(MemoryError) as info:
        blasx.gemm(1.0, a, b)
    faults.install(None)
    msg = str(info.value)
    assert "needed a 8192-byte block" in msg and "bytes free of the 16384" in msg, msg
    eng = blasx.engine()
    assert all(w.alive for w in eng.workers) and eng.leaks() == []
    held[0].release()
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12


def test_no_memory_at_start_then_the_next_call_starts_again(taken, rand, rel_err):
    """Every sim's memory taken before the engine starts: the first call fails saying so (no
    device could start); once it is given back, the next call starts the devices again."""
    held = [taken(0, MEM - 1024), taken(1, MEM - 1024)]
    blasx.configure(devices=f"sim:2,mem={MEM}", tile=TILE)
    a = rand((64, 64))
    with pytest.raises(blasx.DeviceError, match="bytes of device memory free"):
        blasx.gemm(1.0, a, a)
    for h in held:
        h.release()
    assert rel_err(blasx.gemm(1.0, a, a), a @ a) < 1e-12


@pytest.mark.gpu
def test_gpu_with_cupy_holding_90_percent_of_memory(rand, rel_err):
    """CuPy holds 90% of GPU 0's memory before the first call: the heap is sized from what is
    left, and a gemm completes, or fails with an error that says what was needed and free;
    either way GPU 0 stays usable and the next call, with the memory given back, is right."""
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no CUDA GPU")
    except Exception:  # noqa: BLE001 - no driver
        pytest.skip("no CUDA GPU")
    with cupy.cuda.Device(0):
        free, total = cupy.cuda.runtime.memGetInfo()
        hog = cupy.empty(int(0.9 * total) - (total - free), dtype=np.uint8)
    a, b = rand((8192, 4096)), rand((4096, 8192), seed=1)
    try:
        blasx.configure(devices="cuda:0", cpu=False)
        try:
            out = blasx.gemm(1.0, a, b)
        except (MemoryError, blasx.DeviceError) as exc:
            assert "bytes" in str(exc) and "free" in str(exc), str(exc)
        else:
            assert rel_err(out, a @ b) < 1e-12
            assert blasx.engine().devices[0].cache_capacity() <= total - int(0.9 * total)
    finally:
        del hog
        cupy.get_default_memory_pool().free_all_blocks()
    blasx.reset()
    assert rel_err(blasx.gemm(1.0, a[:1024, :512], b[:512, :1024]), a[:1024, :512] @ b[:512, :1024]) < 1e-12
