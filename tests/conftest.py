"""Shared fixtures of the blasx test suite (no GPU needed: the ``sim`` backend stands in).

* every test ends with ``blasx.shutdown()``, so no engine (or worker thread)
  outlives the test that made it; each test configures what it needs;
* ``rel_err(x, ref)``: ||x - ref||_F / ||ref||_F in float64 / complex128;
* ``rand(shape, dtype, seed=0, order="F")``: random entries that are never zero
  (complex dtypes get random real and imaginary parts);
* ``expect(exc_type, *fragments, call=...)``: ``call()`` must raise ``exc_type``
  with every fragment in its message (returned).

pytest runs with ``--import-mode=importlib``, so test modules cannot import
this file; the helpers are handed out as fixtures (session-scoped, so
hypothesis tests may use them too).
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import threading

import numpy as np
import pytest

import blasx


def _rel_err(x, ref) -> float:
    x = np.asarray(x)
    ref = np.asarray(ref)
    wide = np.complex128 if (np.iscomplexobj(x) or np.iscomplexobj(ref)) else np.float64
    x = x.astype(wide)
    ref = ref.astype(wide)
    assert x.shape == ref.shape, f"shape {x.shape} != reference shape {ref.shape}"
    den = np.linalg.norm(ref)
    num = np.linalg.norm(x - ref)
    if den == 0:
        return float(num)
    return float(num / den)


def _nonzero(rng, shape) -> np.ndarray:
    """Uniform in +-[0.25, 1.25): never zero, both signs."""
    mag = rng.uniform(0.25, 1.25, size=shape)
    sign = rng.choice(np.array([-1.0, 1.0]), size=shape)
    return mag * sign


def _rand(shape, dtype=np.float64, seed=0, order="F") -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "c":
        x = _nonzero(rng, shape) + 1j * _nonzero(rng, shape)
    else:
        x = _nonzero(rng, shape)
    return np.asarray(x, dtype=dt, order=order).copy(order=order)


def _expect(exc_type, *fragments, call):
    """Run ``call``; it must raise ``exc_type`` with every fragment in the message."""
    with pytest.raises(exc_type) as info:
        call()
    msg = str(info.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


@pytest.fixture(autouse=True)
def _shutdown_blasx(monkeypatch):
    """Every test starts from the same session: its engine is stopped after it, and what it set
    with blasx.configure() is put back (shutdown() alone keeps the settings for the next engine)."""
    session = importlib.import_module("blasx.session")
    monkeypatch.setattr(session, "_settings", session.settings())
    yield
    blasx.shutdown()


def _start_in_thread(fn):
    """(the thread running ``fn``, the dict that gets ``{"value": fn()}`` or ``{"error": exc}``)."""
    out = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc
    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out


def _run_bounded(fn, seconds=60):
    """``{"value": fn()}`` or ``{"error": exc}`` from a thread, asserting the call ends within ``seconds``."""
    t, out = _start_in_thread(fn)
    t.join(seconds)
    assert not t.is_alive(), "the call hung"
    return out


@pytest.fixture(scope="session")
def run_bounded():
    return _run_bounded


@pytest.fixture(scope="session")
def start_in_thread():
    return _start_in_thread


def _in_threads(fn, n: int) -> None:
    """``fn(i)`` for i < n on n threads at once; the first error any raised is raised here. The threads end
    together: a thread's end destroys its CuPy cuBLAS handle, a device-wide synchronisation that would
    invalidate a CUDA graph capture still running in another."""
    errors = []
    done = threading.Barrier(n)

    def body(i):
        try:
            fn(i)
        except BaseException as exc:  # noqa: BLE001 - raised in the test
            errors.append(exc)
        try:
            done.wait(timeout=600)
        except threading.BrokenBarrierError:
            pass
    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@pytest.fixture(scope="session")
def in_threads():
    return _in_threads


@pytest.fixture(scope="session")
def rel_err():
    return _rel_err


@pytest.fixture(scope="session")
def rand():
    return _rand


@pytest.fixture(scope="session")
def expect():
    return _expect


@pytest.fixture(scope="session")
def tol():
    """Relative-error tolerance of a dtype: ~1e-5 single, ~1e-12 double precision."""
    def _tol(dtype) -> float:
        return 1e-5 if np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.complex64)) else 1e-12
    return _tol


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_per_xdist_worker():
    """Under pytest-xdist (make test: one worker per core), torch -- the CPU reference of the DNN tests,
    never the code under test -- computes on one thread: with its default of one OpenMP thread per core in
    every worker, the workers' threads spin against each other (~25% more CPU time on 2 cores). Only where
    a test module has imported torch already (nothing is imported here); a lone pytest keeps torch's default."""
    if os.environ.get("PYTEST_XDIST_WORKER") and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def _release_blas_control():
    """Let this thread set OpenBLAS's thread count whichever thread set it last (blasx's CPU device's own)."""
    from blasx.runtime.devices.cpu import _release_blas_control as release
    release()


def _blas_limit(n):
    """threadpoolctl's limiter of the BLAS pools at ``n`` threads (set from this thread)."""
    from threadpoolctl import threadpool_limits
    _release_blas_control()
    limiter = threadpool_limits(limits=n, user_api="blas")
    _release_blas_control()
    return limiter


def _blas_restore(limiter):
    _release_blas_control()
    limiter.restore_original_limits()
    _release_blas_control()


@pytest.fixture(scope="session")
def _xdist_blas_limit():
    """Under pytest-xdist (make test: one worker per core) numpy's BLAS runs one thread in each worker (a
    holder of its limiter; None elsewhere): with one thread per core in every worker -- the sims' tile
    kernels and the references are numpy -- the workers' BLAS threads spin against each other (~25% more
    CPU time on 2 cores). blasx's CPU device sets its own limit for its calls and restores what it found,
    as before. Tests that look at the BLAS thread counts are marked ``blas_threads``: they run with the
    process's own counts. A lone pytest (make test's serial pass) keeps the default."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield None
        return
    holder = [_blas_limit(1)]
    yield holder
    _blas_restore(holder[0])


@pytest.fixture(autouse=True)
def _blas_threads(request, _xdist_blas_limit):
    """See ``_xdist_blas_limit``: a ``blas_threads`` test runs on the process's own BLAS thread counts."""
    if _xdist_blas_limit is None or request.node.get_closest_marker("blas_threads") is None:
        yield
        return
    _blas_restore(_xdist_blas_limit[0])  # back to the counts found before the session's limit...
    yield
    blasx.shutdown()  # (its CPU device puts back what it limited first)
    _xdist_blas_limit[0] = _blas_limit(1)  # ...and one thread again for the tests after it


@pytest.fixture(autouse=True)
def _no_perfdb(monkeypatch):
    """A developer's own `blasx tune` entries must not change the tile sizes tests rely on."""
    monkeypatch.setenv("BLASX_PERFDB", "off")


@pytest.fixture(scope="session")
def gemm_alpha0_reads():
    """``gemm_alpha0_reads(dtype)``: scipy's own ?gemm of this machine multiplies a and b even when
    alpha is 0 (a NaN in a reaches C). BLAS says it does not read them, and some OpenBLAS builds do
    (scipy 1.18.1 / OpenBLAS 0.3.31 SkylakeX on the GPU hosts, s and d): tests that compare blasx
    with scipy's ?gemm at alpha 0 then compare with blasx's general path only."""
    import scipy.linalg.blas as S

    def reads(dtype) -> bool:
        a = np.ones((4, 4), dtype=dtype, order="F")
        a[0, 0] = np.nan
        return bool(np.isnan(S.get_blas_funcs("gemm", dtype=np.dtype(dtype))(0.0, a, np.ones_like(a))).any())
    return reads


# bench/ is not installed with blasx: its tests (the files test_bench_*.py and the tests named
# test_bench_*) run from a source checkout, where `import bench` finds it, and are skipped elsewhere.
try:
    importlib.import_module("bench")
    _NO_BENCH = None
except ImportError:
    _NO_BENCH = "bench/ is not installed with blasx: its tests run from a source checkout"
collect_ignore_glob = ["test_bench_*.py"] if _NO_BENCH else []


def pytest_configure(config):
    # here rather than in pyproject.toml: also registered when tests/ runs outside the checkout
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs through CuPy (skipped where there are none)")
    config.addinivalue_line("markers", "slow: longer stress tests")
    config.addinivalue_line("markers", "serial: asserts wall-clock bounds; make test runs these after the others, alone")
    config.addinivalue_line("markers", "blas_threads: looks at the BLAS thread counts; runs on the process's own "
                                       "counts under pytest-xdist too (see _xdist_blas_limit in conftest)")


def pytest_collection_modifyitems(items):
    if _NO_BENCH:
        for item in items:
            if item.name.startswith("test_bench"):
                item.add_marker(pytest.mark.skip(reason=_NO_BENCH))


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Collection (importing torch, dask, scipy, the test modules) runs without the garbage collector: what
    it makes lives until the end, and the collector walked the growing heap again and again (~1.5 s a
    worker). After it, what it made is moved out of the collector's sight (gc.freeze; ~230,000 objects), so
    that every full collection during the tests -- the automatic ones and the tests' own gc.collect() --
    looks at the objects made since, not at them again (~0.2 s each). Objects the tests make are collected
    as before."""
    gc.disable()
    try:
        return (yield)
    finally:
        gc.enable()
        gc.collect()
        gc.freeze()


class FakeRuntime:
    """cupy.cuda.runtime as the registration cache uses it: registrations are recorded, one
    address can be made to fail, nothing is pinned beforehand; 2-D copies are made (memmove) and recorded."""

    class CUDARuntimeError(RuntimeError):
        pass

    def __init__(self, fail_at=None):
        self.registered, self.unregistered, self.fail_at, self.copies = [], [], fail_at, []

    def pointerGetAttributes(self, ptr):
        raise self.CUDARuntimeError("not a CUDA pointer")

    def hostRegister(self, start, size, flags):
        if start == self.fail_at:
            raise self.CUDARuntimeError("cudaErrorHostMemoryAlreadyRegistered")
        self.registered.append((start, size))

    def hostUnregister(self, start):
        self.unregistered.append(start)

    def memcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        import ctypes
        self.copies.append((dst, src, width, height))
        for c in range(height):
            ctypes.memmove(dst + c * dpitch, src + c * spitch, width)


@pytest.fixture
def fake_cuda(monkeypatch):
    """``fake_cuda(**kw)``: a FakeRuntime installed as cupy.cuda.runtime (for this test), returned."""
    import sys
    import types

    def install(**kw):
        rt = FakeRuntime(**kw)
        cupy = types.ModuleType("cupy")
        cupy.cuda = types.ModuleType("cupy.cuda")
        cupy.cuda.runtime = rt
        monkeypatch.setitem(sys.modules, "cupy", cupy)
        monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)
        return rt
    return install
