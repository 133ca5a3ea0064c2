"""blasx.offload: unmodified `a @ b`, np.matmul, np.dot and scipy.linalg.blas level-3 calls run on
blasx above the threshold (the profile shows it), stay on numpy below it, and everything is put back
exactly when offload ends (numpy's matmul loops, numpy.dot, the scipy functions)."""

from __future__ import annotations

import importlib
import math
import threading
import warnings

import numpy as np
import pytest
import scipy.linalg.blas as S

import blasx

O = importlib.import_module("blasx.offload")
if O._ext is None:  # tests/test_import.py covers an installation without it
    pytest.skip("blasx was installed without its C extension blasx._matmul_loops", allow_module_level=True)
ORIGINAL_LOOPS = O._ext.loops()
ORIGINAL_DOT = np.dot
ORIGINAL_SCIPY = {n: getattr(S, n) for n in blasx.linalg.blas.FUNCTIONS}

T = 1e4  # a threshold that the 40x30x20 products here (48000 flops) pass


@pytest.fixture(autouse=True)
def _sim_and_clean():
    blasx.configure(devices="sim:2", tile=16)
    yield
    leaked = O.offload_active()
    while O._entries:  # never let one test's offload reach the next
        with O._lock:
            O._entries.clear()
            O._uninstall()
    assert not leaked, "the test left offload on"
    _assert_restored()


def _assert_restored():
    assert O._ext.loops() == ORIGINAL_LOOPS and not O._ext.installed()
    assert np.dot is ORIGINAL_DOT
    for n, f in ORIGINAL_SCIPY.items():
        assert getattr(S, n) is f, n


def _close(x, ref, tol=1e-12):
    """||x - ref|| / ||ref|| < tol, with numpy's shape and dtype."""
    x, ref = np.asarray(x), np.asarray(ref)
    assert x.shape == ref.shape and x.dtype == ref.dtype, (x.shape, ref.shape, x.dtype, ref.dtype)
    err = np.linalg.norm((x - ref).ravel()) / max(np.linalg.norm(ref.ravel()), 1e-300)
    assert err < tol, err


def _mark():
    return blasx.last_profile()


def _offloaded(before) -> bool:
    p = blasx.last_profile()
    return p is not None and p is not before and p.totals()["tasks"] > 0


def _ab(rand, dtype=np.float64, m=40, k=30, n=20):
    return rand((m, k), dtype, seed=1, order="C"), rand((k, n), dtype, seed=2, order="C")


# ---------------------------------------------------------------- unmodified code runs on blasx

@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128])
def test_at_operator_runs_on_blasx_and_back_on_numpy_after(dtype, rand, rel_err, tol):
    a, b = _ab(rand, dtype)
    ref = np.einsum("ik,kj->ij", a, b)
    with blasx.offload(threshold=T):
        m = _mark()
        c = a @ b
        assert _offloaded(m)
        assert c.dtype == dtype and c.flags.c_contiguous and rel_err(c, ref) < 10 * tol(dtype)
        m = _mark()
        c = np.matmul(a, b)
        assert _offloaded(m)
        assert rel_err(c, ref) < 10 * tol(dtype)
    m = _mark()
    assert rel_err(a @ b, ref) < 10 * tol(dtype)
    assert blasx.last_profile() is m  # numpy's loop again


def test_np_dot_and_scipy_dgemm_run_on_blasx(rand):
    a, b = _ab(rand)
    ref = a @ b
    z = rand((30, 20), np.complex128, seed=3)
    with blasx.offload(threshold=T):
        assert np.dot is not ORIGINAL_DOT and S.dgemm is not ORIGINAL_SCIPY["dgemm"]
        m = _mark()
        _close(np.dot(a, b), ref)
        assert _offloaded(m)
        m = _mark()
        c = S.dgemm(1.0, a, b)
        assert _offloaded(m)
        _close(c, ref)
        assert c.flags.f_contiguous  # scipy's conventions
        m = _mark()
        h = S.zherk(1.0, z, lower=1)
        assert _offloaded(m)
        _close(h, ORIGINAL_SCIPY["zherk"](1.0, z, lower=1))
    _assert_restored()
    m = _mark()
    np.dot(a, b), S.dgemm(1.0, a, b)
    assert blasx.last_profile() is m


def test_batched_broadcast_strided_and_out(rand):
    a3 = rand((3, 40, 30), seed=1, order="C")
    b = rand((30, 20), seed=2, order="C")
    b3 = rand((3, 30, 20), seed=3, order="C")
    big = rand((60, 80), seed=4, order="C")
    cases = [
        (a3, b), (a3[0], b3), (a3, b3),          # shared b, shared a, per item
        (a3[None], b3[:, None]),                 # (1, 3, 40, 30) @ (3, 1, 30, 20): broadcast batch
        (big[::-1, ::2][:40, :30], b[::-1]),     # negative and non-unit strides
        (a3[0], b[:, 0]), (a3[0, 0], b),         # 1-D operands
        (np.asfortranarray(a3[0]), np.asfortranarray(b)),
    ]
    with blasx.offload(threshold=1e3):  # the 1-D products have 1200 and 2400 flops
        for x, y in cases:
            ref = np.einsum("...ik,...kj->...ij", x if x.ndim > 1 else x[None], y if y.ndim > 1 else y[:, None])
            if x.ndim == 1:
                ref = ref[..., 0, :]
            if y.ndim == 1:
                ref = ref[..., 0]
            m = _mark()
            got = x @ y
            assert _offloaded(m)
            _close(got, ref)
        out = np.empty((3, 40, 20))
        m = _mark()
        assert np.matmul(a3, b, out=out) is out
        assert _offloaded(m)
        _close(out, np.einsum("bik,kj->bij", a3, b))


def test_small_calls_stay_on_numpy(rand):
    a, b = _ab(rand, m=8, k=8, n=8)
    with blasx.offload(threshold=T):
        stats = O.offload_stats()
        m = _mark()
        _close(a @ b, np.einsum("ik,kj->ij", a, b))
        np.dot(a, b), S.dgemm(1.0, a, b)
        assert blasx.last_profile() is m
        after = O.offload_stats()
        assert (after["matmul"], after["dot"], after["scipy"]) == (stats["matmul"], stats["dot"], stats["scipy"])


def test_matmul_false_redirects_dot_and_scipy_only(rand):
    a, b = _ab(rand)
    ref = np.einsum("ik,kj->ij", a, b)
    with blasx.offload(threshold=T, matmul=False):
        assert O.offload_active() and not O._ext.installed()
        m = _mark()
        _close(a @ b, ref)
        assert blasx.last_profile() is m
        m = _mark()
        _close(np.dot(a, b), ref)
        assert _offloaded(m)
        with blasx.offload(threshold=T):  # `@` too while a block that asks for it is on
            assert O._ext.installed()
            m = _mark()
            _close(a @ b, ref)
            assert _offloaded(m)
        assert not O._ext.installed()
    _assert_restored()
    for bad in ("yes", None, 1):
        with pytest.raises(TypeError, match="matmul"):
            blasx.offload(matmul=bad)
        with pytest.raises(TypeError, match="matmul"):
            blasx.offload_enable(matmul=bad)
    assert not O.offload_active()


def test_the_hook_gets_read_only_operands_and_a_writeable_output(monkeypatch, rand):
    from blasx import numpy_api
    seen = []
    run_batch = numpy_api.run_batch

    def spy(a, b, c):
        seen.append((a.shape, b.shape, c.shape, a.flags.writeable, b.flags.writeable, c.flags.writeable))
        run_batch(a, b, c)
    monkeypatch.setattr(numpy_api, "run_batch", spy)
    a, b = _ab(rand)
    with blasx.offload(threshold=T):
        _close(a[::-1] @ b, np.einsum("ik,kj->ij", a[::-1], b))
    assert seen == [((1, 40, 30), (1, 30, 20), (1, 40, 20), False, False, True)]


# ---------------------------------------------------------------- nesting, thresholds, threads

def test_nested_contexts_and_thresholds(rand):
    a, b = _ab(rand)
    assert not O.offload_active()
    with blasx.offload(threshold=T):
        assert O.offload_threshold() == T
        with blasx.offload(threshold=math.inf):
            assert O.offload_threshold() == math.inf
            m = _mark()
            a @ b
            assert blasx.last_profile() is m  # the inner block keeps it on numpy
            with blasx.offload():  # None: inherits the enclosing block's
                assert O.offload_threshold() == math.inf
        assert O.offload_threshold() == T
        m = _mark()
        a @ b
        assert _offloaded(m)
        blasx.offload_enable(threshold=5e9)  # process-wide; this thread's block still overrides it
        assert O.offload_threshold() == T
        blasx.offload_disable()
        assert O.offload_active()
    assert not O.offload_active()
    _assert_restored()


def test_enable_disable_pairs(rand):
    a, b = _ab(rand)
    blasx.offload_enable(threshold=T)
    blasx.offload_enable()
    assert O.offload_threshold() == T
    blasx.offload_enable(threshold=math.inf)
    assert O.offload_threshold() == math.inf
    blasx.offload_disable()
    assert O.offload_threshold() == T
    blasx.offload_disable()
    assert O.offload_active()
    m = _mark()
    a @ b
    assert _offloaded(m)
    blasx.offload_disable()
    assert not O.offload_active()
    _assert_restored()
    with pytest.raises(RuntimeError, match="not enabled"):
        blasx.offload_disable()
    with blasx.offload(threshold=T):
        with pytest.raises(RuntimeError, match="offload_enable"):
            blasx.offload_disable()  # a block is not ended by offload_disable


def test_decorator_and_reentrant_object(rand):
    a, b = _ab(rand)
    ctx = blasx.offload(threshold=T)

    @ctx
    def work():
        m = _mark()
        a @ b
        return _offloaded(m)

    assert work()
    with ctx:
        with ctx:
            assert O.offload_active()
        assert O.offload_active()
    assert not O.offload_active()


def test_bad_thresholds():
    for bad, exc in ((-1, ValueError), (float("nan"), ValueError), ("1e9", TypeError), (True, TypeError),
                     ([1], TypeError)):
        with pytest.raises(exc, match="threshold"):
            blasx.offload(threshold=bad)
        with pytest.raises(exc, match="threshold"):
            blasx.offload_enable(threshold=bad)
    assert not O.offload_active()


def test_default_threshold(monkeypatch, rand):
    assert O.default_threshold() == math.inf  # sim (and cpu, measured): never worth it
    blasx.configure(devices="cpu")
    assert O.default_threshold() == O.DEFAULT_THRESHOLDS["cpu"] == math.inf
    monkeypatch.setenv(O.ENV_THRESHOLD, "12345")
    assert O.default_threshold() == 12345.0
    monkeypatch.setenv(O.ENV_THRESHOLD, "lots")
    with pytest.raises(ValueError, match=O.ENV_THRESHOLD):
        O.default_threshold()
    monkeypatch.delenv(O.ENV_THRESHOLD)
    blasx.configure(devices="sim:2", tile=16)
    a, b = _ab(rand, m=200, k=200, n=200)
    with blasx.offload():  # the default: inf on sim
        m = _mark()
        a @ b
        assert blasx.last_profile() is m
    monkeypatch.setenv(O.ENV_THRESHOLD, "1e4")
    with blasx.offload():
        assert O.offload_threshold() == 1e4
        m = _mark()
        a @ b
        assert _offloaded(m)


def test_several_threads(rand):
    n_threads = 4
    results, errors = {}, []
    barrier = threading.Barrier(n_threads)

    def work(i):
        try:
            a = rand((40, 30), seed=10 + i, order="C")
            b = rand((30, 20), seed=20 + i, order="C")
            thr = math.inf if i == 0 else T  # thread 0 keeps its products on numpy
            with blasx.offload(threshold=thr):
                barrier.wait()
                outs = []
                for _ in range(5):
                    outs.append(a @ b)
                    outs.append(np.dot(a, b))
                ok = all(np.allclose(o, np.einsum("ik,kj->ij", a, b), rtol=1e-12) for o in outs)
                results[i] = (ok, blasx.last_profile())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    assert all(ok for ok, _ in results.values())
    assert results[0][1] is None  # its own threshold (inf) kept it on numpy
    assert all(results[i][1] is not None for i in range(1, n_threads))


def test_enable_disable_from_many_threads(rand):
    errors = []

    def churn():
        try:
            for _ in range(20):
                blasx.offload_enable(threshold=T)
                a = np.ones((40, 30))
                assert (a @ np.ones((30, 20)) == 30).all()
                blasx.offload_disable()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=churn) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors
    assert not O.offload_active()
    _assert_restored()


# ---------------------------------------------------------------- safety

def test_engine_workers_stay_on_numpy(rand):
    """With the CPU device, blasx's own tile kernels use `@`: with threshold 0 they must not recurse."""
    blasx.configure(devices="cpu", tile=256)
    a, b = _ab(rand, m=600, k=500, n=400)
    with blasx.offload(threshold=0):
        m = _mark()
        c = a @ b
        assert _offloaded(m)
    _close(c, a @ b)


@pytest.mark.blas_threads  # (conftest: the process's own BLAS thread counts under xdist too)
def test_blas_thread_settings_are_left_as_found(rand):
    from threadpoolctl import threadpool_info

    def threads():
        return sorted((i["filepath"], i["num_threads"]) for i in threadpool_info() if i["user_api"] == "blas")

    for spec in (dict(devices="sim:2", tile=16), dict(devices="sim:2", tile=16, cpu=True), dict(devices="cpu")):
        blasx.configure(**spec)
        before = threads()
        a, b = _ab(rand, m=300, k=300, n=300)
        with blasx.offload(threshold=T):
            m = _mark()
            a @ b
            assert _offloaded(m)
            assert threads() == before
        assert threads() == before


def test_a_failing_blasx_call_is_computed_by_numpy(monkeypatch, rand):
    from blasx import numpy_api

    def boom(*args, **kwargs):
        raise blasx.DeviceError("simulated device failure")
    monkeypatch.setattr(numpy_api, "run_batch", boom)
    monkeypatch.setattr(numpy_api, "gemm_into", boom)
    a, b = _ab(rand)
    before = O.offload_stats()["fallback"]
    with blasx.offload(threshold=T):
        with pytest.warns(RuntimeWarning, match="simulated device failure"):
            c = a @ b
        with pytest.warns(RuntimeWarning, match="simulated device failure"):
            d = np.dot(a, b)
    _close(c, np.einsum("ik,kj->ij", a, b))
    _close(d, c)
    assert O.offload_stats()["fallback"] == before + 2
    assert isinstance(O.offload_stats()["last_error"], blasx.DeviceError)


def test_scipy_behaviour_kept_for_calls_blasx_rejects(rand):
    a, b = _ab(rand)
    with blasx.offload(threshold=T):
        with pytest.raises(Exception) as info:  # noqa: B017
            S.dgemm(1.0, a, b, trans_a=3)
        assert type(info.value).__name__ == "error"  # scipy's own _fblas.error
        _close(S.dgemm(1.0, a.tolist(), b), a @ b)  # lists: scipy's path


def test_wrappers_are_c_forwarders_that_look_like_the_wrappers():
    with blasx.offload(threshold=T):
        assert type(np.dot).__name__ == "forwarder" and type(S.dgemm).__name__ == "forwarder"
        assert np.dot.__name__ == "dot" and np.dot.__wrapped__ is ORIGINAL_DOT
        assert S.zherk.__name__ == "zherk" and S.zherk.__wrapped__ is ORIGINAL_SCIPY["zherk"]
        assert "offloaded to blasx" in S.dgemm.__doc__ and "offloaded to blasx" in np.dot.__doc__


def test_operands_found_by_position_and_keyword(rand):
    """Above the threshold whether a and b come by position or keyword; the exact flop count
    decides where the size bound passes (a matrix times a vector); array-likes go to numpy."""
    a, b = _ab(rand)  # 48000 flops >= T
    v = rand((30,), seed=3)  # a @ v: 2400 flops < T, but 8 a.size v.size >= T
    offloaded = [lambda: S.dgemm(1.0, a, b), lambda: S.dgemm(1.0, a, b=b), lambda: S.dgemm(alpha=1.0, a=a, b=b),
                 lambda: np.dot(a, b), lambda: np.dot(a, b=b), lambda: np.dot(a=a, b=b),
                 lambda: S.dsyrk(1.0, a), lambda: S.dsyrk(1.0, a=a, lower=1), lambda: S.dsyr2k(1.0, a, a)]
    kept = [lambda: np.dot(a, v), lambda: np.dot(a.tolist(), b), lambda: S.dgemm(1.0, a[:4], b[:, :4].copy()[:30]),
            lambda: S.dsyrk(1.0, a[:4, :4])]
    with blasx.offload(threshold=T):
        for call in offloaded:
            m = _mark()
            got = call()
            assert _offloaded(m)
            assert np.all(np.isfinite(got))
        for call in kept:
            m = _mark()
            call()
            assert blasx.last_profile() is m
    with blasx.offload(threshold=T):
        _close(np.dot(a=a, b=b), a @ b)
        _close(S.dgemm(alpha=2.0, a=a, b=b), 2 * (a @ b))
        _close(np.tril(S.dsyrk(1.0, a=a, lower=1)), np.tril(a @ a.T))


def test_failed_install_changes_nothing(monkeypatch):
    monkeypatch.setattr(O._ext, "hits", lambda slot: 0)  # as if `@` did not reach the new loop
    with pytest.raises(RuntimeError, match="does not call the new loop"):
        blasx.offload_enable(threshold=T)
    assert not O.offload_active()
    _assert_restored()


# ---------------------------------------------------------------- the threshold benchmark

def test_bench_offload_threshold_runs(capsys):
    bench = importlib.import_module("bench.offload_threshold")
    rows = [{"flops": 1.0, "speedup": 0.5}, {"flops": 2.0, "speedup": 1.2}, {"flops": 3.0, "speedup": 1.5}]
    assert bench.crossover(rows) == 2.0
    assert bench.crossover(rows[:1]) == math.inf
    assert bench.crossover([{"flops": 1.0, "speedup": 2.0}, {"flops": 2.0, "speedup": 0.9}]) == math.inf
    assert bench.main(["--devices", "sim:2", "--tile", "16", "--sizes", "16,32", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert "crossover (float64)" in out and "numpy ms" in out


def test_bench_offload_mode_runs(capsys):
    bench = importlib.import_module("bench.offload_threshold")
    assert bench.main(["--offload", "--devices", "cpu", "--dtypes", "s,z", "--sizes", "8", "--rounds", "2",
                       "--target-ms", "0.2"]) == 0
    out = capsys.readouterr().out
    for what in ("a @ b", "np.dot", "scipy sgemm", "scipy zgemm", "within 5%", "ratio best", "noise", "verdict",
                 "beyond the noise"):
        assert what in out, what
    assert not O.offload_active()
    assert [bench.verdict(x, 0.02) for x in (1.01, 0.99, 1.03, 0.97)] == ["noise", "noise", "SLOWER", "faster"]



def test_blocks_of_one_thread_may_end_out_of_order():
    """A generator's block stays open across its yields, so the caller's block can end first: each block's end
    takes away its own threshold (it took the innermost one, the generator's)."""
    def gen():
        with blasx.offload(threshold=1e30):
            yield
    g = gen()
    with blasx.offload(threshold=0):
        next(g)  # the generator's block opens inside the caller's
    assert O.offload_threshold() == 1e30  # the caller's (0) is gone; the generator's is still open
    g.close()
    assert O.offload_threshold() == math.inf
    _assert_restored()


def test_a_blasx_call_inside_a_block_keeps_its_own_kernels_on_numpy(rand):
    """An engine running its tile kernels in the calling thread (the CPU with a tile size): their products are
    blasx's own work, not numpy calls to send back into blasx (each tile was a nested blasx call)."""
    blasx.configure(devices="cpu", tile=4)
    a, b = rand((32, 32), seed=1), rand((32, 32), seed=2)
    with blasx.offload(threshold=0):
        before = O.offload_stats()["matmul"]
        got = blasx.gemm(1.0, a, b)
        assert O.offload_stats()["matmul"] == before
        a @ b  # (a numpy call in the block itself still goes to blasx)
        assert O.offload_stats()["matmul"] == before + 1
    np.testing.assert_allclose(got, a @ b, rtol=1e-12)


def test_a_block_turns_offload_on_for_its_own_thread_only(rand, monkeypatch):
    """While another thread sits in a block, a thread outside every block stays on numpy (even where the
    default threshold would offload its call); offload_enable() is what turns it on process-wide."""
    monkeypatch.setenv("BLASX_OFFLOAD_THRESHOLD", "0")
    a, b = _ab(rand)
    inside, done = threading.Event(), threading.Event()

    def other():
        with blasx.offload():
            inside.set()
            done.wait(10)
    t = threading.Thread(target=other)
    t.start()
    try:
        inside.wait(10)
        assert O.offload_active() and O.offload_threshold() == math.inf
        m = _mark()
        a @ b
        assert blasx.last_profile() is m  # not offloaded
        blasx.offload_enable()
        try:
            assert O.offload_threshold() == 0
            m = _mark()
            a @ b
            assert _offloaded(m)
        finally:
            blasx.offload_disable()
    finally:
        done.set()
        t.join()


def test_an_out_numpy_rejects_gets_numpys_error_and_no_fallback_warning(rand):
    """np.dot with an out numpy does not take: numpy's ValueError, not a blasx failure warned and counted."""
    import warnings
    a, b = _ab(rand)
    with blasx.offload(threshold=0), warnings.catch_warnings():
        warnings.simplefilter("error")
        before = O.offload_stats()["fallback"]
        with pytest.raises(ValueError, match="output array is not acceptable"):
            np.dot(a, b, out=np.empty((a.shape[0], b.shape[1]), np.float32))
        assert O.offload_stats()["fallback"] == before


def test_np_dot_into_a_read_only_out_is_numpys_error_with_no_fallback(rand):
    """A read-only out is left to numpy's dot (its own ValueError), not tried on blasx first (which failed, warned
    of a fallback and counted one)."""
    blasx.configure(devices="sim:2", tile=16)
    a, b = rand((32, 32)), rand((32, 32))
    out = np.zeros((32, 32))
    out.flags.writeable = False
    before = O.offload_stats()["fallback"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with blasx.offload(threshold=0), pytest.raises(ValueError):
            np.dot(a, b, out)
    assert O.offload_stats()["fallback"] == before and not out.any()


def test_np_dot_pickles_by_reference_inside_offload():
    """Code pickling np.dot itself (multiprocessing, joblib) works inside offload: the forwarder pickles as
    numpy.dot, which unpickles to whatever numpy.dot is there (it could not be pickled)."""
    import pickle
    with blasx.offload():
        data = pickle.dumps(np.dot)
        assert pickle.loads(data) is np.dot
    assert pickle.loads(data) is np.dot


def test_a_batch_of_small_independent_items_stays_with_numpy(rand):
    """A stacked a @ b above the threshold whose items share no operand and are each below it runs in numpy's
    loop (blasx would make a call an item: far slower); with a shared operand it is one stacked gemm, offloaded."""
    blasx.configure(devices="sim:2", tile=16)
    a, b = rand((50, 8, 8)), rand((50, 8, 8))  # 2 * 8^3 = 1024 flops an item, 51,200 in all
    with blasx.offload(threshold=10_000):
        before = O.offload_stats()["matmul"]
        np.testing.assert_allclose(a @ b, np.matmul(a, b))
        assert O.offload_stats()["matmul"] == before
        got = a @ b[0]  # b shared: one (400, 8) @ (8, 8) gemm
        assert O.offload_stats()["matmul"] == before + 1
        ref = np.einsum("nij,jk->nik", a, b[0])
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-12


@pytest.fixture
def hook_interrupted(monkeypatch):
    """A sim:2 engine whose offloaded matmuls raise KeyboardInterrupt inside the hook; a 64 x 64 operand."""
    if not O.matmul_available():
        pytest.skip("the matmul trampoline (blasx._matmul_loops) is not built")
    blasx.configure(devices="sim:2")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(O.numpy_api, "run_batch", interrupted)
    return np.random.default_rng(0).standard_normal((64, 64))


def test_a_ctrl_c_inside_an_offloaded_matmul_reaches_the_caller(hook_interrupted, monkeypatch):
    """numpy's loop cannot raise: the trampoline raises the Ctrl-C again once the ufunc returns (numpy's loop
    having written the result); not a failed call, no fallback counted."""
    x = hook_interrupted
    before = O.offload_stats()["fallback"]
    with pytest.raises(KeyboardInterrupt):
        with blasx.offload(threshold=0):
            y = x @ x
            for _ in range(1000):  # (the exception is raised at the next bytecode check)
                pass
    assert O.offload_stats()["fallback"] == before
    monkeypatch.undo()
    with blasx.offload(threshold=0):
        assert np.allclose(x @ x, np.dot(x, x))
    del y


def test_a_ctrl_c_inside_an_offloaded_matmul_of_another_thread_stays_in_that_thread(hook_interrupted):
    """Raised again in the thread whose matmul it was (an asynchronous exception), not faked as a SIGINT for the
    main thread (whose handler would also run twice)."""
    x = hook_interrupted
    got = []

    def other():
        try:
            with blasx.offload(threshold=0):
                x @ x
                for _ in range(1000):
                    pass
            got.append("nothing")
        except KeyboardInterrupt:
            got.append("KeyboardInterrupt")
    t = threading.Thread(target=other)
    t.start()
    t.join(60)
    for _ in range(1000):  # (a KeyboardInterrupt faked for the main thread would surface here)
        pass
    assert got == ["KeyboardInterrupt"]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.complex128, np.float16])
@pytest.mark.parametrize("setting", [{"over": "raise"}, {"invalid": "raise"}, {"over": "call"}])
def test_products_whose_fp_errors_raise_stay_on_numpy(dtype, setting):
    """Under np.errstate(over / invalid = "raise" or "call") `@` and np.dot of float types are numpy's own, which
    raise FloatingPointError (or call) as numpy does: blasx's GPU tiles set no floating-point flags."""
    big = np.full((40, 30), np.finfo(dtype).max / 4, dtype) if setting.get("over") else np.full((40, 30), np.inf, dtype)
    other = np.full((30, 20), 4, dtype) if setting.get("over") else np.zeros((30, 20), dtype)
    calls = []
    with blasx.offload(threshold=T):
        with np.errstate(**{"all": "ignore", **setting}, call=lambda kind, flag: calls.append(kind)):
            before = _mark()
            for product in (lambda: big @ other, lambda: np.dot(big, other)):
                if "call" in setting.values():
                    product()
                else:
                    with pytest.raises(FloatingPointError):
                        product()
            assert not _offloaded(before)
        np.ones((40, 30), dtype) @ other  # numpy's default errstate again: offloaded
        assert _offloaded(before)
    assert len(calls) == (2 if "call" in setting.values() else 0)
