"""The CPU alone: every call is one call of scipy's or numpy's own routine (blasx.dispatch's host route).

With ``devices="cpu"`` and no fixed tile, blasx.gemm, the level-3 routines (generic, prefixed,
blasx.linalg.blas) and blasx.matmul / dot / tensordot validate their arguments, then run the host
BLAS in the caller's thread. These tests check that the engine is never reached (from the first
call of a process on), that results are numpy's / scipy's and the engine's (a fixed tile makes the
CPU engine plan the same call), that BLAS's alpha 0 / beta 0 rules hold, that errors are those of
the engine route, and that last_profile() has the call, in every thread.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import scipy.linalg.blas as S

import blasx
from blasx import dispatch, numpy_api, session
from blasx.linalg import blas as B

BLAS = (np.float32, np.float64, np.complex64, np.complex128)
DT = {"s": np.float32, "d": np.float64, "c": np.complex64, "z": np.complex128}


@pytest.fixture(autouse=True)
def _cpu():
    blasx.configure(devices="cpu")
    yield


def _engine_fails(monkeypatch):
    """Make the engine route raise: a call that still succeeds took the host route."""
    def boom(*a, **k):
        raise AssertionError("the engine ran")
    monkeypatch.setattr(dispatch, "submit_planned", boom)


def _rel_ok(rel_err, tol, got, ref, factor=50):
    assert rel_err(got, ref) < factor * tol(np.asarray(ref).dtype), rel_err(got, ref)


def _engine(fn):
    """fn() on the CPU engine (a fixed tile: it plans the call), then back to the host route."""
    blasx.configure(devices="cpu", tile=8)
    try:
        return fn()
    finally:
        blasx.configure(devices="cpu")


def _error_of(fn):
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


# ---------------------------------------------------------------- the route

def test_host_device_follows_configure_and_shutdown(rand):
    a = rand((6, 5), order="C")
    assert dispatch.host_device().kind == "cpu"
    blasx.shutdown()
    assert session.host_device is None
    blasx.matmul(a, a.T)  # the first call starts the engine and takes the host route
    assert session.host_device is not None
    blasx.configure(devices="sim:2")
    assert dispatch.host_device() is None
    blasx.matmul(a, a.T)
    assert blasx.last_profile().devices[0].kind == "sim"
    blasx.configure(devices="cpu", tile=4)  # a fixed tile: the engine plans tiles
    blasx.gemm(1.0, a, a.T)
    assert session.host_device is None
    assert blasx.last_profile().totals()["tasks"] > 1
    blasx.configure(devices="cpu")
    blasx.gemm(1.0, a, a.T)
    assert session.host_device is not None
    blasx.shutdown()
    assert session.host_device is None


def test_a_stale_engine_is_not_published():
    eng = blasx.engine()
    blasx.configure(devices="sim:2")
    session._publish_host(eng)  # a thread that started eng before configure() replaced it
    assert session.host_device is None


def test_the_first_call_takes_the_host_route(rand, monkeypatch):
    blasx.shutdown()
    _engine_fails(monkeypatch)
    a = rand((9, 7), order="C")
    np.testing.assert_array_equal(blasx.gemm(1.0, a, a.T), S.dgemm(1.0, a.T, a.T, trans_a=1))
    blasx.shutdown()
    assert blasx.dsyrk(1.0, a).shape == (9, 9)


# ---------------------------------------------------------------- numpy's functions

MATMUL_SHAPES = [((20,), (20,)), ((20,), (20, 7)), ((9, 20), (20,)), ((9, 20), (20, 7)), ((3, 9, 20), (20, 7)),
                 ((2, 1, 9, 5), (3, 5, 7)), ((0, 9, 5), (5, 7)), ((9, 0), (0, 7))]


@pytest.mark.parametrize("dtype", BLAS)
@pytest.mark.parametrize("sa, sb", MATMUL_SHAPES)
def test_matmul_is_numpys(sa, sb, dtype, rand, monkeypatch):
    a, b = rand(sa, dtype, seed=1, order="C"), rand(sb, dtype, seed=2, order="F")
    _engine_fails(monkeypatch)
    got, ref = blasx.matmul(a, b), np.matmul(a, b)
    assert type(got) is type(ref) and np.shape(got) == np.shape(ref) and np.asarray(got).dtype == ref.dtype
    np.testing.assert_array_equal(got, ref)
    factor = 8 if np.dtype(dtype).kind == "c" else 2
    assert blasx.last_profile().totals()["flops"] == factor * np.size(ref) * a.shape[-1]
    assert blasx.last_profile().devices[0].kind == "cpu"


def test_matmul_strided_operands(rand, rel_err, tol, monkeypatch):
    """numpy's matmul runs BLAS on copies of these from numpy 2.3.1 (before: its loop without BLAS,
    so blasx makes them gemms)."""
    a = rand((30, 40), order="C")[::2, ::3]
    b = rand((14, 9), seed=2, order="F")
    if numpy_api._ANY_STRIDES:
        _engine_fails(monkeypatch)
    _rel_ok(rel_err, tol, blasx.matmul(a, b), np.matmul(a, b))


@pytest.mark.parametrize("dtype", BLAS)
def test_matmul_out_and_keywords(dtype, rand, rel_err, tol):
    """out= (C- and F-ordered, poisoned with NaN), dtype=, casting=: numpy's results, the same out returned."""
    other = {np.float32: np.float64, np.float64: np.float32, np.complex64: np.complex128,
             np.complex128: np.complex64}[dtype]
    x1, x2 = rand((3, 9, 6), dtype, seed=1, order="C"), rand((6, 5), dtype, seed=2, order="F")
    for out_order, kw in itertools.product(("none", "C", "F"), ({}, {"dtype": dtype}, {"dtype": np.dtype(other).name},
                                                                   {"casting": "no"}, {"casting": "unsafe", "dtype": other})):
        ct = np.dtype(kw.get("dtype") or dtype)
        o = None if out_order == "none" else np.full((3, 9, 5), np.nan, ct, order=out_order)
        got = blasx.matmul(x1, x2, out=o, **kw)
        assert (got is o) == (o is not None)
        _rel_ok(rel_err, tol, got, np.matmul(x1, x2, **kw))
        assert blasx.last_profile().totals()["flops"] > 0


@pytest.mark.parametrize("sa, sb", [((20,), (20,)), ((20,), (20, 7)), ((9, 20), (20,)), ((9, 20), (20, 7)),
                                    ((3, 9, 20), (4, 20, 7))])
@pytest.mark.parametrize("dtype", BLAS)
def test_dot_is_numpys_or_one_gemm(sa, sb, dtype, rand, rel_err, tol):
    a, b = rand(sa, dtype, seed=1, order="C"), rand(sb, dtype, seed=2, order="F")
    got, ref = blasx.dot(a, b), np.dot(a, b)
    assert type(got) is type(ref) and np.shape(got) == np.shape(ref) and np.asarray(got).dtype == ref.dtype
    if len(sa) <= 2 and len(sb) <= 2:
        np.testing.assert_array_equal(got, ref)  # numpy's own dot
    else:
        _rel_ok(rel_err, tol, got, ref)  # numpy's N-D dot has no BLAS: one host gemm
    factor = 8 if np.dtype(dtype).kind == "c" else 2
    assert blasx.last_profile().totals()["flops"] == factor * np.size(ref) * 20


@pytest.mark.parametrize("axes, sb", [(2, (5, 6, 3)), (1, (6, 7)), (0, (2, 3)), (([1, 0], [0, 1]), (5, 4, 3)),
                                      (([2], [1]), (2, 6)), ((1, 0), (5, 2))])
def test_tensordot_is_numpys(axes, sb, rand, monkeypatch):
    a = rand((4, 5, 6), np.complex128, seed=1, order="C")
    b = rand(sb, np.complex128, seed=2, order="C")
    _engine_fails(monkeypatch)
    got, ref = blasx.tensordot(a, b, axes), np.tensordot(a, b, axes)
    np.testing.assert_array_equal(got, ref)
    k = a.size * b.size // ref.size
    assert blasx.last_profile().totals()["flops"] == pytest.approx(8 * ref.size * np.sqrt(k))


@pytest.mark.parametrize("call", [
    lambda x, y: blasx.matmul(x, y), lambda x, y: blasx.dot(x, y), lambda x, y: blasx.tensordot(x, y, 1),
    lambda x, y: blasx.tensordot(x, y, 3), lambda x, y: blasx.matmul(x, np.ones((), x.dtype)),
    lambda x, y: blasx.matmul(x, x.T, out=np.empty((3, 4))),
    lambda x, y: blasx.matmul(x, x.T, out=np.empty((4, 4), np.int64)),
    lambda x, y: blasx.matmul(x, x.T, dtype=np.float32, casting="no"),
    lambda x, y: blasx.matmul(x, x.T, casting="bogus"),
    lambda x, y: blasx.matmul(x + 1j, x.T, dtype=np.float64),
])
def test_numpy_errors_are_the_engine_routes(call, rand):
    a, b = rand((4, 5), seed=1, order="C"), rand((4, 5), seed=2, order="C")
    host = _error_of(lambda: call(a, b))
    assert host == _engine(lambda: _error_of(lambda: call(a, b)))


# ---------------------------------------------------------------- the scipy-signature routines

def _ops(prefix, routine, rand, order):
    """(args, kwargs) calls of prefix + routine for every flag value blasx allows, with c and beta
    or without."""
    dt = DT[prefix]
    m, n, k = 9, 7, 5
    a_sq = {0: rand((m, m), dt, seed=1, order=order), 1: rand((n, n), dt, seed=1, order=order)}
    b = rand((m, n), dt, seed=2, order=order)
    beta = 0.5 if routine in ("herk", "her2k") or prefix in "sd" else 0.5 + 0.25j
    if routine == "gemm":
        for ta, tb in itertools.product((0, 1, 2), (0, 1, 2)):
            x = rand((m, k) if ta == 0 else (k, m), dt, seed=3, order=order)
            y = rand((k, n) if tb == 0 else (n, k), dt, seed=4, order=order)
            yield (1.5, x, y), {"trans_a": ta, "trans_b": tb}
            yield (1.5, x, y, beta, rand((m, n), dt, seed=5, order=order)), {"trans_a": ta, "trans_b": tb}
    elif routine in ("symm", "hemm"):
        for side, lower in itertools.product((0, 1), (0, 1)):
            yield (1.5, a_sq[side], b), {"side": side, "lower": lower}
            yield (1.5, a_sq[side], b, beta, rand((m, n), dt, seed=5, order=order)), {"side": side, "lower": lower}
    elif routine in ("syrk", "herk", "syr2k", "her2k"):
        trans = (0, 2) if routine.startswith("her") else ((0, 1) if prefix in "cz" else (0, 1, 2))
        for t, lower in itertools.product(trans, (0, 1)):
            x = rand((n, k) if t == 0 else (k, n), dt, seed=3, order=order)
            args = (1.5, x) if routine in ("syrk", "herk") else (1.5, x, rand(x.shape, dt, seed=4, order=order))
            yield args, {"trans": t, "lower": lower}
            c = rand((n, n), dt, seed=5, order=order)
            yield args + (beta, c + c.conj().T), {"trans": t, "lower": lower}
    else:
        for side, lower, ta, diag in itertools.product((0, 1), (0, 1), (0, 1, 2), (0, 1)):
            a = a_sq[side] + (4 * np.eye(a_sq[side].shape[0], dtype=dt) if routine == "trsm" else 0)
            yield (1.5, np.asarray(a, order=order), b), {"side": side, "lower": lower, "trans_a": ta, "diag": diag}


# blasx.linalg.blas's functions, blasx's prefixed ones and blasx's generic ones on arrays of the prefix's dtype
CASES = [(m, p, r) for r, ps in B.LEVEL3.items() for p in ps for m in ("linalg", "blasx", "generic")]


@pytest.mark.parametrize("module, prefix, routine", CASES)
def test_level3_is_scipys(module, prefix, routine, rand, rel_err, tol, monkeypatch):
    fn = {"linalg": lambda: getattr(B, prefix + routine), "blasx": lambda: getattr(blasx, prefix + routine),
          "generic": lambda: getattr(blasx, routine)}[module]()
    sp = S.get_blas_funcs(routine, dtype=DT[prefix])
    calls = [(args, kw) for order in "FC" for args, kw in _ops(prefix, routine, rand, order)]
    engine = _engine(lambda: [fn(*args, **kw) for args, kw in calls])
    with monkeypatch.context() as mp:
        _engine_fails(mp)
        for (args, kw), ref_engine in zip(calls, engine):
            ref = sp(*args, **kw)
            got = fn(*args, **kw)
            assert got.dtype == ref.dtype and got.shape == ref.shape and got.flags.f_contiguous
            _rel_ok(rel_err, tol, got, ref, factor=5)  # scipy's routine, on the operands or their transposes
            _rel_ok(rel_err, tol, got, ref_engine)     # and what the engine computes
            assert blasx.last_profile().totals()["flops"] > 0


@pytest.mark.parametrize("dtype", BLAS)
def test_gemm_outputs_in_place_whatever_the_layout(dtype, rand, rel_err, tol):
    """blasx.gemm with overwrite_c writes into c, F- or C-ordered or strided, as the engine does."""
    a, b = rand((9, 7), dtype, seed=1), rand((7, 5), dtype, seed=2)
    for make in (lambda x: x.copy(order="F"), lambda x: x.copy(order="C"),
                 lambda x: np.asfortranarray(np.repeat(x, 2, axis=0))[::2]):
        c0 = rand((9, 5), dtype, seed=3)
        for trans_b in (0, 2):
            bb = b if trans_b == 0 else b.conj().T.copy()
            c = make(c0)
            assert blasx.gemm(1.5, a, bb, 0.5, c, trans_b=trans_b, overwrite_c=True) is c
            _rel_ok(rel_err, tol, c, 1.5 * a @ b + 0.5 * c0)


@pytest.mark.parametrize("entry", ["blasx.gemm", "linalg.dgemm", "blasx.dgemm"])
def test_gemm_with_alpha_zero_never_reaches_the_host_gemm(rand, entry, monkeypatch):
    """alpha 0: C = beta C, a and b unread, and never handed to the host's ?gemm (some OpenBLAS
    builds multiply a NaN by the 0)."""
    fn = {"blasx.gemm": blasx.gemm, "linalg.dgemm": B.dgemm, "blasx.dgemm": blasx.dgemm}[entry]
    asked = []
    real = dispatch.blas_routine
    monkeypatch.setattr(dispatch, "blas_routine", lambda r, dt: asked.append(r) or real(r, dt))
    a, b = rand((6, 4), seed=1), rand((4, 5), seed=2)
    a[0, 0] = b[1, 1] = np.nan
    c0 = rand((6, 5), seed=3)
    for alpha in (0.0, np.float64(0.0), 0):
        for kw in ({}, {"beta": 0.5, "c": c0.copy(order="F")}, {"beta": 0.5, "c": c0.copy(order="F"), "overwrite_c": 1},
                   {"beta": 0.5, "c": np.ascontiguousarray(c0)}):
            for x, y in ((a, b), (np.ascontiguousarray(a), np.ascontiguousarray(b))):
                want = 0.5 * c0 if kw else np.zeros((6, 5))
                kw2 = {k: v.copy(order="K") if isinstance(v, np.ndarray) else v for k, v in kw.items()}
                got = fn(alpha, x, y, **kw2)
                assert not np.isnan(got).any(), (entry, alpha, kw)
                np.testing.assert_allclose(got, want, rtol=1e-15)
    assert "gemm" not in asked


@pytest.mark.parametrize("name", ["dgemm", "zgemm", "dsymm", "zhemm", "dsyrk", "zherk", "dsyr2k", "zher2k"])
def test_beta_zero_does_not_read_c(name, rand):
    """beta 0: the written part of c is not read, so its NaNs do not leak (BLAS), c given or in place."""
    prefix, routine = name[0], name[1:]
    dt = DT[prefix]
    a = rand((6, 6), dt, seed=1)
    args = (1.5, a) if routine in ("syrk", "herk") else (1.5, a, rand((6, 6), dt, seed=2))
    for ow in (0, 1):
        c = np.full((6, 6), np.nan, dt, order="F")
        got = getattr(B, name)(*args, beta=0.0, c=c, overwrite_c=ow)
        part = got if routine in ("gemm", "symm", "hemm") else np.triu(got)  # (lower=0: the upper triangle)
        assert np.isfinite(part).all(), (name, ow)


@pytest.mark.parametrize("call", [
    lambda: B.zherk(1.0, np.ones((3, 2), complex), trans=1),     # scipy hands it to BLAS; blasx raises
    lambda: B.zsyrk(1.0, np.ones((3, 2), complex), trans=2),
    lambda: B.dgemm(1.0, np.ones((3, 2)), np.ones((3, 2))),      # shapes scipy may not check
    lambda: B.dsymm(1.0, np.ones((3, 3)), np.ones((4, 2))),
    lambda: B.dtrsm(1.0, np.ones((3, 3)), np.ones((4, 2))),
    lambda: B.dsyr2k(1.0, np.ones((3, 2)), np.ones((3, 3))),
    lambda: B.dgemm(1.0, np.ones((3, 2)), np.ones((2, 2)), trans_a=3),
    lambda: B.dtrmm(1.0, np.ones((3, 3)), np.ones((3, 2)), diag=2),
    lambda: blasx.dsyrk(1.0, np.ones((3, 2)), lower=2),
    lambda: blasx.gemm(1.0, np.ones((3, 2)), np.ones((3, 2)), 0.5, np.ones((3, 3))[:, :2]),
    lambda: blasx.gemm(1.0, np.ones((3, 2)), np.ones((2, 2)), "x"),
    lambda: blasx.gemm(1.0, np.ones((3, 2)), np.ones((2, 2)), 0.5 + 1j, np.ones((3, 2))),
])
def test_level3_errors_are_the_engine_routes(call):
    host = _error_of(call)
    assert host == _engine(lambda: _error_of(call))
    assert host[0] in (ValueError, TypeError)


def test_generic_level3_keeps_its_dtype_rules(rand, rel_err, tol):
    """blasx.syr2k & co. pick the dtype from all the arrays."""
    a32, b64 = rand((6, 4), np.float32, seed=1), rand((6, 4), np.float64, seed=2)
    got = blasx.syr2k(1.0, a32, b64)
    assert got.dtype == np.float64
    ref = a32.astype(np.float64) @ b64.T + b64 @ a32.astype(np.float64).T
    _rel_ok(rel_err, tol, np.triu(got), np.triu(ref))
    assert blasx.herk(1.0, b64).dtype == np.complex128  # a real a for herk: the complex type
    assert blasx.symm(1.0, rand((4, 4), np.float32), b64[:4]).dtype == np.float64


# ---------------------------------------------------------------- profiles and threads

def test_profile_without_trace(rand):
    blasx.configure(devices="cpu", trace=False)
    a = rand((8, 8), order="C")
    blasx.matmul(a, a)
    p = blasx.last_profile()
    assert p.totals()["tasks"] == 1 and p.totals()["flops"] == 2 * 8 ** 3
    assert blasx.last_profile() is p  # made once


def test_threads_keep_their_own_profiles(rand, rel_err, in_threads):
    def work(i):
        n = 8 + i
        a, b = rand((n, n), seed=i, order="C"), rand((n, n), seed=i + 100, order="F")
        for _ in range(100):
            assert rel_err(blasx.matmul(a, b), np.matmul(a, b)) < 1e-12
            assert blasx.last_profile().totals()["flops"] == 2 * n ** 3
            assert rel_err(B.dgemm(1.0, a, b), S.dgemm(1.0, a, b)) < 1e-12
            assert blasx.last_profile().totals()["flops"] == 2 * n ** 3
    in_threads(work, 4)


def test_reconfigure_while_threads_call(rand, rel_err):
    """Calls racing configure() run either on the host or on the new engine, never fail or go wrong."""
    a, b = rand((12, 10), seed=1, order="C"), rand((10, 8), seed=2, order="C")
    ref = a @ b
    stop = threading.Event()
    errors = []

    def work():
        try:
            while not stop.is_set():
                assert rel_err(blasx.matmul(a, b), ref) < 1e-12
                assert rel_err(blasx.gemm(1.0, a, b), ref) < 1e-12
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for spec in ("sim:2", "cpu", "sim:2", "cpu"):
        blasx.configure(devices=spec)
        blasx.engine()
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors
    assert session.host_device is not None


def test_a_call_whose_engine_was_shut_down_runs_on_the_new_one(rand, rel_err, monkeypatch):
    """The engine a call fetched is shut down before its tasks are queued (configure() in another
    thread): the call runs on the new engine instead of waiting forever behind the sentinels."""
    blasx.configure(devices="sim:2", tile=4)
    old = blasx.engine()
    old.shutdown()
    fetched = iter([old, old])  # (host_device() asks first, then the engine route)
    real = session.engine
    monkeypatch.setattr(session, "engine", lambda: next(fetched, None) or real())
    a = rand((10, 6), seed=1)
    got = blasx.dsyrk(1.0, a, lower=1)
    assert rel_err(np.tril(got), np.tril(a @ a.T)) < 1e-12
    assert blasx.last_profile().devices[0].kind == "sim"
    from blasx.runtime.engine import EngineClosed
    with pytest.raises(EngineClosed, match="shut down"):  # every engine it tries is shut down: it says so
        monkeypatch.setattr(session, "engine", lambda: old)
        blasx.dsyrk(1.0, a)
