"""Tests on real CUDA GPUs (marker ``gpu``; skipped where CuPy finds none)."""

from __future__ import annotations

import numpy as np
import pytest

import blasx

cupy = pytest.importorskip("cupy")
NGPU = blasx.session._cuda_count()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="no CUDA GPU")]

DTYPES = [np.float32, np.float64, np.complex64, np.complex128]
TOL = {np.float32: 2e-5, np.float64: 1e-12, np.complex64: 2e-5, np.complex128: 1e-12}


def rand(rng, shape, dtype):
    x = rng.standard_normal(shape)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.standard_normal(shape)
    return x.astype(dtype)


def rel_err(x, ref):
    x = np.asarray(x, dtype=np.complex128)
    return np.linalg.norm(x - ref) / np.linalg.norm(ref)


def reference(alpha, a, b, beta, c, ta, tb):
    ops = (lambda x: x, lambda x: x.T, lambda x: x.conj().T)
    r = alpha * (ops[ta](a.astype(np.complex128)) @ ops[tb](b.astype(np.complex128)))
    return r + beta * c.astype(np.complex128) if c is not None else r


@pytest.fixture(autouse=True)
def _engine():
    blasx.configure(devices="cuda", tile=256, cache_bytes=512 << 20)
    yield
    blasx.shutdown()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ta", [0, 1, 2])
@pytest.mark.parametrize("tb", [0, 1, 2])
def test_gemm_host_all_gpus(dtype, ta, tb):
    rng = np.random.default_rng(7 + ta * 3 + tb)
    m, n, k = 700, 530, 610
    a = rand(rng, (m, k) if ta == 0 else (k, m), dtype)
    b = rand(rng, (k, n) if tb == 0 else (n, k), dtype)
    c = rand(rng, (m, n), dtype)
    got = blasx.gemm(1.5, a, b, beta=0.5, c=c, trans_a=ta, trans_b=tb)
    assert rel_err(got, reference(1.5, a, b, 0.5, c, ta, tb)) < TOL[dtype]
    tasks = blasx.last_profile().counters
    assert sum(tasks[d]["tasks"] for d in tasks) == 9  # ceil(700/256) * ceil(530/256)


@pytest.mark.parametrize("order", ["C", "F"])
def test_gemm_c_order_beta_zero_poisoned(order):
    rng = np.random.default_rng(1)
    a = np.asarray(rand(rng, (1000, 900), np.float64), order=order)
    b = np.asarray(rand(rng, (900, 1100), np.float64), order=order)
    c = np.full((1000, 1100), np.nan, order=order)
    got = blasx.gemm(2.0, a, b, beta=0.0, c=c, overwrite_c=True)
    assert got is c
    assert rel_err(got, reference(2.0, a, b, 0, None, 0, 0)) < 1e-12


def test_p2p_seen_in_stats_with_two_gpus():
    if NGPU < 2:
        pytest.skip("needs 2 GPUs")
    rng = np.random.default_rng(3)
    a = rand(rng, (4096, 4096), np.float64)
    b = rand(rng, (4096, 4096), np.float64)
    got = blasx.gemm(1.0, a, b)
    prof = blasx.last_profile()
    assert rel_err(got, a @ b) < 1e-12
    tot = prof.totals()
    assert tot["bytes_p2p"] > 0 and tot["l2_hits"] > 0, prof.report()
    # Every GPU worked (the auto-mode CPU worker, added by default beside CUDA GPUs, may not).
    gpus = [d for d in prof.counters if prof.devices[d].kind == "cuda"]
    assert all(prof.counters[d]["tasks"] > 0 for d in gpus), prof.report()


@pytest.mark.parametrize("dtype", [np.float32, np.complex128])
def test_cupy_operands_result_on_device(dtype):
    rng = np.random.default_rng(5)
    a_h, b_h = rand(rng, (900, 700), dtype), rand(rng, (700, 800), dtype)
    with cupy.cuda.Device(0):
        a, b = cupy.asarray(a_h), cupy.asarray(b_h)
    got = blasx.gemm(1.0, a, b, trans_a=0)
    assert isinstance(got, cupy.ndarray) and got.device.id == 0
    assert rel_err(cupy.asnumpy(got), a_h.astype(np.complex128) @ b_h) < TOL[dtype]
    m = blasx.matmul(a, b)
    assert isinstance(m, cupy.ndarray) and m.flags.c_contiguous
    assert rel_err(cupy.asnumpy(m), a_h.astype(np.complex128) @ b_h) < TOL[dtype]


def test_cupy_operands_on_other_gpu():
    if NGPU < 2:
        pytest.skip("needs 2 GPUs")
    rng = np.random.default_rng(6)
    a_h, b_h = rand(rng, (1024, 512), np.float64), rand(rng, (512, 768), np.float64)
    with cupy.cuda.Device(1):
        a, b = cupy.asarray(a_h), cupy.asarray(b_h)
    got = blasx.gemm(1.0, a, b)
    assert got.device.id == 1
    assert rel_err(cupy.asnumpy(got), a_h @ b_h) < 1e-12


def test_out_of_core_small_cache_evicts():
    blasx.configure(devices="cuda", tile=256, cache_bytes=32 << 20)
    rng = np.random.default_rng(9)
    a, b = rand(rng, (3000, 2500), np.float64), rand(rng, (2500, 2800), np.float64)
    got = blasx.gemm(1.0, a, b)
    assert rel_err(got, a @ b) < 1e-12
    assert blasx.last_profile().totals()["evictions"] > 0


def test_threads_share_the_engine():
    from concurrent.futures import ThreadPoolExecutor
    rng = np.random.default_rng(11)
    probs = [(rand(rng, (300 + 37 * i, 200 + 11 * i), np.float64), rand(rng, (200 + 11 * i, 250), np.float64))
             for i in range(8)]
    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda p: blasx.gemm(1.0, *p), probs))
    for (a, b), got in zip(probs, outs):
        assert rel_err(got, a @ b) < 1e-12


def test_registered_arrays_next_to_small_ones():
    """Large arrays are page-locked on their whole pages only; their edge tiles are copied in
    pieces (pageable head/tail, registered chunks), and small arrays in the pages next to them still copy as pageable memory
    (a registration reaching into a neighbour's page made CUDA refuse the neighbour's copies)."""
    blasx.configure(devices="cuda", tile=1024)
    rng = np.random.default_rng(7)
    for _ in range(3):
        n = 2400  # 46 MiB: registered; served from glibc's heap or its own mapping
        a, b, c = (rand(rng, (n, n), np.float64) for _ in range(3))
        small = [rand(rng, (300, 300), np.float64) for _ in range(4)]  # likely to land beside them
        got = blasx.gemm(1.5, a, b, beta=0.5, c=c)
        assert rel_err(got, reference(1.5, a, b, 0.5, c, 0, 0)) < 1e-12
        s = blasx.gemm(1.0, small[0], small[1], beta=1.0, c=small[2])
        assert rel_err(s, reference(1.0, small[0], small[1], 1.0, small[2], 0, 0)) < 1e-12
        out = np.empty((n, n), order="F")
        blasx.gemm(1.0, a, b, c=out, overwrite_c=True)  # written back through the edges too
        assert rel_err(out, reference(1.0, a, b, 0, None, 0, 0)) < 1e-12


def test_large_host_results_come_page_locked_from_the_pool(monkeypatch):
    """gemm / matmul / level-3 results blasx allocates are page-locked pool memory (no fresh pages to lock
    in the call); a result's buffer serves the next result of its size once every view of it is gone;
    results stay exact, a reused buffer's old bytes never leak into a zeros result."""
    import gc
    from blasx.runtime import hostmem, hostpool
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 20)
    pool = hostpool.OutputPool(idle_limit=1 << 30)
    monkeypatch.setattr(hostpool, "POOL", pool)
    rng = np.random.default_rng(5)
    a, b = rand(rng, (512, 384), np.float64), rand(rng, (384, 512), np.float64)
    blasx.gemm(1.0, a[:8], b[:, :8])  # the engine runs: results of the next calls come from the pool
    c = blasx.gemm(1.0, a, b)
    assert rel_err(c, a @ b) < TOL[np.float64] and not c.flags.owndata and pool.handed == 1
    from cupy.cuda import runtime
    assert runtime.pointerGetAttributes(c.ctypes.data).type == 1  # cudaMemoryTypeHost: page-locked
    first = c.ctypes.data
    del c
    gc.collect()
    m = blasx.matmul(np.ascontiguousarray(a), np.ascontiguousarray(b))  # C order, the same bytes
    assert m.ctypes.data == first and m.flags.c_contiguous and pool.reused == 1
    assert rel_err(m, a @ b) < TOL[np.float64]
    m[...] = np.nan
    del m
    gc.collect()
    s = blasx.dsyrk(1.0, a)  # 512 x 512 again; its lower triangle must be zeros
    ref = np.triu(a @ a.T)
    assert s.ctypes.data == first and rel_err(s, ref) < TOL[np.float64]


@pytest.mark.parametrize("shape", [(1500, 1300, 900), (600, 500, 6000)], ids=["tiles", "split-k"])
def test_a_new_result_starts_from_c_staged_into_it(monkeypatch, shape):
    """gemm(alpha, a, b, beta, c) with fresh host arrays: A and B staged, c's values copied by the call's threads
    straight into the new (page-locked) result, in chunks cut inside columns; exact, c untouched, twice."""
    from blasx.runtime import hostmem, hostpool
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 20)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 23 * hostmem.PAGE)
    monkeypatch.setattr(hostpool, "POOL", hostpool.OutputPool(idle_limit=1 << 30))
    blasx.configure(devices="cuda", tile=256, cache_bytes=256 << 20)
    rng = np.random.default_rng(22)
    m, n, k = shape
    c = np.asfortranarray(rand(rng, (m, n), np.float64))
    before = c.copy(order="F")
    for _ in range(2):  # the second time c has been seen: still copied into the result, not registered
        a, b = (np.asfortranarray(rand(rng, s, np.float64)) for s in ((m, k), (k, n)))
        got = blasx.gemm(1.5, a, b, beta=-0.5, c=c)
        assert got is not c and rel_err(got, reference(1.5, a, b, -0.5, before, 0, 0)) < 1e-12
        assert np.array_equal(c, before) and hostmem.REGISTRY._ours.get(id(c)) is None
        assert blasx.last_profile().host["staged_bytes"] >= c.nbytes


@pytest.mark.parametrize("order", ["F", "C"])
def test_chunked_registration_splits_copies(monkeypatch, order):
    """Host arrays registered in many small chunks while the call runs: every tile copy is cut at
    the chunk edges (CUDA refuses a copy across two registrations), in and out, with the
    partial first/last pages pageable; a chunk someone else registered first fails for blasx and
    is copied as it is (pinned by them). Results exact, registrations released."""
    from blasx.runtime import hostmem
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 20)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 23 * hostmem.PAGE)  # not a multiple of a column: cuts inside columns
    blasx.configure(devices="cuda", tile=256, cache_bytes=256 << 20)
    rng = np.random.default_rng(21)
    m, n, k = 900, 700, 800
    a = np.asarray(rand(rng, (m, k), np.float64), order=order)
    b = np.asarray(rand(rng, (k, n), np.float64), order=order)
    c = np.asarray(rand(rng, (m, n), np.float64), order=order)
    chunk = hostmem.CHUNK_BYTES
    lo = hostmem.interior_pages(b.ctypes.data, b.nbytes)[0] + 2 * chunk
    cupy.cuda.runtime.hostRegister(lo, chunk, 1)  # b's third chunk, pinned by someone else: blasx's attempt fails
    out = None
    try:
        want = reference(1.5, a, b, 0.5, c, 0, 0)
        got = blasx.gemm(1.5, a, b, beta=0.5, c=c)
        assert rel_err(got, want) < 1e-12
        host = blasx.last_profile().host
        assert host["pinned_bytes"] > 0 and host["pin_seconds"] > 0
        out = np.full((m, n), np.nan, order="F")
        blasx.gemm(1.5, a, b, beta=0.5, c=c.copy(order="F"), overwrite_c=True)
        blasx.gemm(1.0, a, b, c=out, overwrite_c=True)  # written back piece by piece
        assert rel_err(out, reference(1.0, a, b, 0, None, 0, 0)) < 1e-12
        p = hostmem.REGISTRY._ours[id(b)]
        assert not all(p.ok) and any(p.ok)
    finally:
        for x in (a, b, c, out):
            if x is not None:
                hostmem.REGISTRY.release(x)
        cupy.cuda.runtime.hostUnregister(lo)


def test_default_cpu_worker_is_auto_and_leaves_small_calls_alone():
    """cpu=None beside CUDA GPUs: a CPU worker in auto mode (runtime/admission.py); a call of a few
    4096/2048 tiles is one the GPUs hold at once, so the CPU takes none of it."""
    blasx.configure(devices="cuda")
    eng = blasx.engine()
    assert eng.devices[-1].kind == "cpu" and eng.devices[-1].auto and eng.admission is not None
    rng = np.random.default_rng(11)
    a, b = rand(rng, (4096, 4096), np.float64), rand(rng, (4096, 4096), np.float64)
    for _ in range(2):
        got = blasx.gemm(1.0, a, b)
        assert rel_err(got, a @ b) < 1e-12
        prof = blasx.last_profile()
        cpu_tasks = sum(c["tasks"] for d, c in prof.counters.items() if prof.devices[d].kind == "cpu")
        assert cpu_tasks == 0, prof.report()
    assert eng.admission.counts["sooner"] == 0


def test_cupy_operand_written_on_the_callers_stream_is_read_after_it():
    """An operand a kernel on the caller's (non-blocking) current stream is still writing: the engine's
    streams, which do not wait for that stream, must not read it before it is written."""
    blasx.configure(devices="cuda")
    a = cupy.random.random((6144, 6144))
    cupy.cuda.Device().synchronize()
    with cupy.cuda.Stream(non_blocking=True):
        x = a @ a  # ~10 ms of work queued on this stream
        x = x @ a
        y = blasx.gemm(1.0, x, a[:, :512])
        ref = x @ a[:, :512]
        assert float(cupy.linalg.norm(y - ref) / cupy.linalg.norm(ref)) < 1e-12


def test_beta_one_leaves_a_complex_inf_as_it_is_on_cuda():
    """A late C tile folded in with beta 1 is added (CUDA's geam path), not multiplied by 1: a complex
    infinity in c stays inf + 0j, as scipy's zgemm gives (test_dropin_blas has the host engines)."""
    from scipy.linalg import blas as S
    from blasx.linalg import blas as B
    blasx.configure(devices="cuda", tile=16)
    a2, c2 = np.full((64, 64), 0.01 + 0j, order="F"), np.zeros((64, 64), complex, order="F")
    c2[0, 0] = np.inf
    with np.errstate(all="ignore"):
        got, want = B.zgemm(1.0, a2, a2, 1.0, c2)[0, 0], S.zgemm(1.0, a2, a2, 1.0, c2)[0, 0]
    assert got == want == complex(np.inf, 0)
