"""The C entry points of the CPU-only fast paths (blasx._hostcall) and the calls the third pass
took off the general path: numpy scalars as alpha / beta, nested lists, blocks of larger arrays
and strided matmul operands.

blasx.matmul, dot, gemm and the scipy-signature level-3 functions are C callables where the
library builds: a plain call runs numpy's / scipy's own function from C, any other call the
Python function (``__wrapped__``), which has the same fast paths in Python. These tests check
both against numpy / scipy and against blasx's general path on random inputs (relative error;
bit for bit where it is the same routine), operands poisoned with NaN around them (a read out of
bounds shows), the profile recorded, errors unchanged, and that they behave as functions."""

from __future__ import annotations

import gc
import inspect
import itertools
import os
import pickle
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import scipy.linalg.blas as S

import blasx
from blasx import _hostcall, blas3, level3, numpy_api, session
from blasx.linalg import blas as B

BLAS = (np.float32, np.float64, np.complex64, np.complex128)
DT = {"s": np.float32, "d": np.float64, "c": np.complex64, "z": np.complex128}


@pytest.fixture(autouse=True)
def _cpu():
    blasx.configure(devices="cpu")
    blasx.engine()  # publishes session.host_device
    yield


def _general_fails(monkeypatch):
    """Make every general path raise: a call that still succeeds took a fast path."""
    def boom(*a, **k):
        raise AssertionError("the general path ran")
    for mod, name in ((level3, "_run_gemm"), (level3, "submit_planned"), (blas3, "submit_planned"),
                      (numpy_api, "run_batch"), (numpy_api, "gemm_into"), (B, "_impl")):
        monkeypatch.setattr(mod, name, boom)


def _general(fn):
    """fn() with the fast paths off (a fixed tile: the engine plans the call), then back on."""
    blasx.configure(devices="cpu", tile=8)
    try:
        return fn()
    finally:
        blasx.configure(devices="cpu")
        blasx.engine()


def _error_of(fn):
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


def _outcome(fn):
    """(("ok", result) or ("error", type, message), warning messages) of fn()."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            res = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - compared with the general path's
            res = ("error", type(e), str(e))
    return res, [f"{w.category.__name__}: {w.message}" for w in caught]


def _same_outcome(fast, slow, rel_err, tol):
    (r1, w1), (r2, w2) = fast, slow
    assert w1 == w2 and r1[0] == r2[0]
    if r1[0] == "error":
        assert r1 == r2
    else:
        got, ref = np.asarray(r1[1]), np.asarray(r2[1])
        assert got.dtype == ref.dtype and got.shape == ref.shape
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
        assert rel_err(np.nan_to_num(got), np.nan_to_num(ref)) < 50 * tol(got.dtype)


def _ok(rel_err, tol, got, ref, factor=50):
    assert np.isfinite(got).all()
    assert rel_err(got, ref) < factor * tol(np.asarray(ref).dtype), rel_err(got, ref)


def _flops(dtype) -> int:
    return 8 if np.dtype(dtype).kind == "c" else 2


# ---------------------------------------------------------------- layouts, poisoned around

def _laid_out(x, how):
    """x's values in the layout ``how``; around a block of a larger array NaN (read out of bounds: NaN)."""
    if how == "C":
        return np.ascontiguousarray(x)
    if how == "F":
        return np.asfortranarray(x)
    if x.ndim != 2:
        raise ValueError(how)
    m, n = x.shape
    if how in ("block", "blockF"):  # a unit stride, a larger leading dimension
        big = np.full((m + 3, n + 5), np.nan, dtype=x.dtype, order="F" if how == "blockF" else "C")
        big[2:2 + m, 1:1 + n] = x
        return big[2:2 + m, 1:1 + n]
    if how == "strided":  # no unit stride
        big = np.full((2 * m + 1, 3 * n), np.nan, dtype=x.dtype)
        big[1::2, ::3] = x
        return big[1::2, ::3]
    if how == "reversed":
        return np.ascontiguousarray(x[::-1, ::-1])[::-1, ::-1]
    raise ValueError(how)


LAYOUTS = ("C", "F", "block", "blockF", "strided", "reversed")


# ---------------------------------------------------------------- the entry points themselves

ENTRY_POINTS = [blasx.matmul, blasx.dot, blasx.gemm, B.dgemm, B.zherk, blasx.dsyrk, blasx.ctrsm]


def test_entry_points_are_c_callables_that_behave_as_functions():
    from blasx import _ufunc_loops
    if _hostcall.kind() != "c":
        if _ufunc_loops._compiler() and _ufunc_loops._python_include() and not os.environ.get(_hostcall.ENV_PYTHON):
            pytest.fail("a C compiler and Python's headers are here, but blasx._hostcall's library did not load")
        pytest.skip("no C compiler or Python headers: the Python functions stand alone")
    for f in ENTRY_POINTS:
        assert type(f).__name__ == "hostcall", f
        assert inspect.isfunction(f.__wrapped__)
        assert f.__doc__ and f.__name__ in f.__qualname__ and "*args" not in str(inspect.signature(f))
        assert pickle.loads(pickle.dumps(f)) is f
    for f in (blasx.matmul, blasx.dot, blasx.gemm):
        assert inspect.signature(f) == inspect.signature(f.__wrapped__)
    assert blasx.matmul.__name__ == "matmul" and blasx.matmul.__module__ == "blasx.numpy_api"
    assert str(inspect.signature(B.dgemm)).startswith("(alpha, a, b, beta=0.0, c=None")
    assert B.dgemm.typecode == "d" and B.dgemm.module_name == "blasx"
    lib = _hostcall._library()
    assert _hostcall._layout_ok(lib) and _hostcall._clock_ok(lib)


def test_without_the_library_the_python_functions_stand_alone(tmp_path):
    code = ("import inspect, numpy as np, blasx\n"
            "from blasx import _hostcall\n"
            "blasx.configure(devices='cpu')\n"
            "a = np.arange(12.0).reshape(3, 4)\n"
            "assert _hostcall.kind() == 'python' and inspect.isfunction(blasx.matmul)\n"
            "assert inspect.isfunction(blasx.linalg.blas.dgemm) and inspect.isfunction(blasx.gemm)\n"
            "assert np.array_equal(blasx.matmul(a, a.T), a @ a.T)\n"
            "assert np.allclose(blasx.linalg.blas.dgemm(1.0, a, a.T), a @ a.T)\n"
            "assert blasx.last_profile().totals()['tasks'] == 1\n")
    env = dict(os.environ, **{_hostcall.ENV_PYTHON: "1", "BLASX_CACHE_DIR": str(tmp_path)})
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def _both(f):
    """The entry point and its Python function (the same one where there is no C)."""
    return (f, f.__wrapped__) if hasattr(f, "__wrapped__") else (f,)


def test_other_sessions_take_the_python_functions(rand, rel_err, tol):
    """On the sims (no host device) the C callables hand every call to Python: the engine runs it."""
    a, b = rand((9, 6), seed=1, order="C"), rand((6, 5), seed=2, order="C")
    blasx.configure(devices="sim:2")
    for call in (lambda: blasx.matmul(a, b), lambda: blasx.dot(a, b), lambda: blasx.gemm(1.0, a, b),
                 lambda: B.dgemm(1.0, a, b)):
        _ok(rel_err, tol, call(), a @ b)
        assert blasx.last_profile().devices[0].kind == "sim"


# ---------------------------------------------------------------- matmul and dot

MATMUL_SHAPES = [((9, 6), (6, 5)), ((6,), (6, 5)), ((9, 6), (6,)), ((1, 6), (6, 1)), ((3, 9, 6), (6, 5)),
                 ((2, 9, 6), (2, 6, 5))]


def _operand(shape, dtype, how, seed, rand):
    x = rand(shape, dtype, seed=seed, order="C")
    if len(shape) == 2:
        return _laid_out(x, how)
    if len(shape) == 3 and how == "strided":  # every other item of a batch, strided inside
        big = np.full((2 * shape[0], shape[1], 2 * shape[2]), np.nan, dtype=dtype)
        big[::2, :, ::2] = x
        return big[::2, :, ::2]
    return x if how in ("C", "block", "blockF", "strided") else np.asfortranarray(x)


@pytest.mark.parametrize("dtype", BLAS)
def test_matmul_every_layout(dtype, rand, rel_err, tol, monkeypatch):
    """numpy's matmul from C (and from the Python fast path) for operands of every layout it runs
    BLAS on: all of them from numpy 2.3.1 (it copies the others); the result, its type and order
    are numpy's, the profile counts the product."""
    cases = []
    for (sa, sb), la, lb in itertools.product(MATMUL_SHAPES, LAYOUTS, LAYOUTS):
        if (len(sa) != 2 or len(sb) != 2) and (la, lb) not in (("C", "C"), ("F", "strided"), ("strided", "C")):
            continue
        cases.append((_operand(sa, dtype, la, 1, rand), _operand(sb, dtype, lb, 2, rand)))
    slow = _general(lambda: [blasx.matmul(a, b) for a, b in cases])
    with monkeypatch.context() as mp:
        if _hostcall.NUMPY_COPIES_STRIDES:
            _general_fails(mp)
        for (a, b), ref_slow in zip(cases, slow):
            ref = np.matmul(np.ascontiguousarray(a), np.ascontiguousarray(b))
            for f in _both(blasx.matmul):
                got = f(a, b)
                assert type(got) is type(ref) and got.dtype == ref.dtype and got.shape == ref.shape
                assert got.flags.c_contiguous
                _ok(rel_err, tol, got, ref)
                _ok(rel_err, tol, got, ref_slow)
                assert blasx.last_profile().totals()["flops"] == _flops(dtype) * ref.size * a.shape[-1]


def test_matmul_strides_numpy_runs_without_blas(rand, rel_err, tol, monkeypatch):
    """Before numpy 2.3.1 numpy's matmul runs its loop without BLAS on operands without a unit
    stride: blasx keeps those on its gemm, and hands numpy blocks of larger arrays (a unit stride:
    numpy's BLAS). Here the library is told so (and the Python fast path)."""
    lib = _hostcall._library()
    if lib is None:
        pytest.skip("no C library")
    monkeypatch.setattr(numpy_api, "_ANY_STRIDES", False)
    a, b = rand((12, 8), seed=1), rand((8, 7), seed=2)
    try:
        assert _hostcall._init(lib, False) == 0
        with monkeypatch.context() as mp:
            _general_fails(mp)
            for la, lb in (("block", "C"), ("F", "blockF"), ("blockF", "block")):
                _ok(rel_err, tol, blasx.matmul(_laid_out(a, la), _laid_out(b, lb)), a @ b)
        with monkeypatch.context() as mp:
            mp.setattr(numpy_api, "_np_matmul", lambda *x, **k: pytest.fail("numpy's matmul ran"))
            for la, lb in (("strided", "C"), ("F", "strided"), ("reversed", "C")):
                for f in _both(blasx.matmul):
                    _ok(rel_err, tol, f(_laid_out(a, la), _laid_out(b, lb)), a @ b)
    finally:
        assert _hostcall._init(lib, _hostcall.NUMPY_COPIES_STRIDES) == 0


@pytest.mark.parametrize("dtype", BLAS)
def test_dot_every_layout(dtype, rand, rel_err, tol, monkeypatch):
    cases = [(_laid_out(rand((9, 6), dtype, seed=1, order="C"), la), _laid_out(rand((6, 5), dtype, seed=2), lb))
             for la, lb in itertools.product(LAYOUTS, LAYOUTS)]
    cases += [(rand((6,), dtype, seed=3)[::-1], cases[0][1]), (cases[3][0], rand((12,), dtype, seed=4)[::2])]
    _general_fails(monkeypatch)
    for a, b in cases:
        ref = np.dot(np.ascontiguousarray(a), np.ascontiguousarray(b))
        for f in _both(blasx.dot):
            got = f(a, b)
            assert type(got) is type(ref) and got.dtype == ref.dtype and got.shape == ref.shape
            _ok(rel_err, tol, got, ref)
            assert blasx.last_profile().totals()["flops"] == _flops(dtype) * ref.size * 6


@pytest.mark.parametrize("dtype", BLAS)
def test_dot_out_in_c(dtype, rand, monkeypatch):
    """dot(a, b, out) of 1-D / 2-D operands (out by position or keyword, NaN-filled, one that is a
    itself): numpy's dot from C, bit for bit, out returned, the profile of the Python function; an
    out numpy refuses raises numpy's error, as the general path did; 1-D . 1-D with out keeps the
    general path (numpy would return a scalar, blasx returns out)."""
    a, b = rand((6, 6), dtype, seed=1, order="C"), rand((6, 5), dtype, seed=2, order="C")
    v = rand((6,), dtype, seed=3)
    for x, y in ((a, b), (v, b), (a, v), (a[:, ::2], b[::2])):
        shape = np.dot(x, y).shape
        for how in ("keyword", "positional"):
            o1, o2, o3 = (np.full(shape, np.nan, dtype) for _ in range(3))

            def call(f, o):
                return f(x, y, out=o) if how == "keyword" else f(x, y, o)

            with monkeypatch.context() as mp:
                _general_fails(mp)
                got = _in_c(lambda: call(blasx.dot, o1))
                prof = _profile()
                assert call(_py(blasx.dot), o2) is o2 and prof == _profile()
            assert got is o1 and call(np.dot, o3) is o3
            np.testing.assert_array_equal(o1, o3)
            np.testing.assert_array_equal(o2, o3)
    x = a.copy()
    want = np.dot(a, a)
    assert _in_c(lambda: blasx.dot(x, x, out=x)) is x   # numpy computes through a copy
    np.testing.assert_array_equal(x, want)
    for bad in (np.empty((6, 5), _other(dtype)), np.empty((5, 6), dtype).T, np.empty((6, 4), dtype),
                _readonly(np.empty((6, 5), dtype)), np.empty((6, 5), dtype).tolist(), np.empty((1, 6, 5), dtype)):
        got = _error_of(lambda: blasx.dot(a, b, out=bad))
        assert got == _general(lambda: _error_of(lambda: blasx.dot(a, b, out=bad))) == _error_of(lambda: np.dot(a, b, out=bad))
    o, o2 = np.empty((), dtype), np.empty((), dtype)
    assert blasx.dot(v, v, out=o) is o and _general(lambda: blasx.dot(v, v, out=o2)) is o2
    _ok(lambda p, q: abs(complex(p) - complex(q)) / abs(complex(q)), lambda d: np.finfo(d).eps, o[()], np.dot(v, v))
    assert _error_of(lambda: blasx.dot(a, b, o, out=o))[0] is TypeError


def test_matmul_and_dot_of_lists(rand, monkeypatch):
    """Nested lists: numpy's arrays of them, then the fast paths (numpy's result, bit for bit); lists
    numpy makes other arrays of (ints, ragged ones) keep the paths they had (numpy's results and
    errors)."""
    for dt in (np.float64, np.complex128):
        a, b = rand((9, 6), dt, seed=1), rand((6, 5), dt, seed=2)
        with monkeypatch.context() as mp:
            _general_fails(mp)
            for x, y in ((a.tolist(), b.tolist()), (a.tolist(), b), (a, b[:, 0].tolist()), (a[0].tolist(), b)):
                for f, g in ((blasx.matmul, np.matmul), (blasx.dot, np.dot)):
                    for h in _both(f):
                        got, ref = h(x, y), g(x, y)
                        assert type(got) is type(ref) and got.dtype == ref.dtype and got.shape == ref.shape
                        np.testing.assert_array_equal(got, ref)
            assert blasx.last_profile().totals()["flops"] == _flops(dt) * 6 * 5
            out = np.empty((9, 9), dt)
            assert blasx.matmul(a.tolist(), a.T.tolist(), out=out) is out
            np.testing.assert_array_equal(out, np.matmul(a.tolist(), a.T.tolist()))
    ints = [[1, 2], [3, 4]]
    for f, g in ((blasx.matmul, np.matmul), (blasx.dot, np.dot)):
        got = f(ints, ints)
        assert got.dtype == g(ints, ints).dtype and np.array_equal(got, g(ints, ints))
        ragged = [[1.0, 2.0], [3.0]]
        assert _error_of(lambda: f(ragged, ints)) == _general(lambda: _error_of(lambda: f(ragged, ints)))
        assert _error_of(lambda: f(ragged, ints)) == _error_of(lambda: g(ragged, ints))


# ---------------------------------------------------------------- blasx.gemm

def _alphas(dtype):
    """alpha values of every type the fast paths take for this dtype."""
    real = [1.5, 2, np.float64(-0.75), np.float32(1.25), np.int64(3), np.int32(-2)]
    cplx = [0.5 - 1.5j, np.complex128(1 + 2j), np.complex64(-0.5 + 0.25j)]
    return real + (cplx if np.dtype(dtype).kind == "c" else [])


@pytest.mark.parametrize("dtype", BLAS)
def test_gemm_every_layout_and_scalar(dtype, rand, rel_err, tol, monkeypatch):
    """blasx.gemm(alpha, a, b, trans_a=, trans_b=): scipy's ?gemm from C (and from Python), for
    operands of every layout, every op, alpha of every type taken (numpy scalars too): scipy's result
    on the same values, F-ordered, the profile's flops; the general path agrees."""
    fn = S.get_blas_funcs("gemm", dtype=dtype)
    rng = np.random.default_rng(7)
    alphas = _alphas(dtype)
    cases = []
    for (ta, tb), la, lb in itertools.product(itertools.product((0, 1, 2), (0, 1, 2)), LAYOUTS, ("C", "F", "block")):
        m, n, k = rng.integers(1, 9, 3)
        a = rand((m, k) if ta == 0 else (k, m), dtype, seed=int(rng.integers(1000)), order="C")
        b = rand((k, n) if tb == 0 else (n, k), dtype, seed=int(rng.integers(1000)), order="C")
        kw = {k_: v for k_, v in (("trans_a", ta), ("trans_b", tb)) if v or rng.random() < 0.5}
        cases.append((alphas[len(cases) % len(alphas)], _laid_out(a, la), _laid_out(b, lb), kw))
    slow = _general(lambda: [blasx.gemm(al, a, b, **kw) for al, a, b, kw in cases])
    _general_fails(monkeypatch)
    for (alpha, a, b, kw), ref_slow in zip(cases, slow):
        ref = fn(alpha, np.asfortranarray(a), np.asfortranarray(b), **kw)
        for f in _both(blasx.gemm):
            got = f(alpha, a, b, **kw)
            assert got.dtype == ref.dtype and got.shape == ref.shape and got.flags.f_contiguous
            _ok(rel_err, tol, got, ref)
            _ok(rel_err, tol, got, ref_slow)
            m, n = ref.shape
            k_ = a.shape[0] if kw.get("trans_a") else a.shape[1]
            assert blasx.last_profile().totals()["flops"] == _flops(dtype) * m * n * k_


def test_gemm_scalars_the_fast_paths_leave_alone(rand, rel_err, tol):
    """Scalars blasx treats otherwise than scipy keep the general path, its results and errors: a
    complex one (Python's or numpy's) for a real type, bools, longdouble, float16, 0-d arrays, str;
    alpha 0 reads neither a nor b (NaN in a)."""
    a, b = rand((5, 4), seed=1), rand((4, 3), seed=2)
    a[0, 0] = np.nan
    for alpha in (1 + 1j, np.complex128(1 + 1j), np.complex64(2), True, np.bool_(True), np.longdouble(1.5),
                  np.array(1.5), np.float16(1.5), "1.5", np.float64(0.0)):
        for f in _both(blasx.gemm):
            _same_outcome(_outcome(lambda: f(alpha, a, b)), _general(lambda: _outcome(lambda: f(alpha, a, b))),
                          rel_err, tol)
    assert np.all(blasx.gemm(np.float64(0.0), a, b) == 0)


# ---------------------------------------------------------------- the scipy-signature level 3

def _plain_ops(routine, dt, rand):
    """(args, kwargs) of a plain call of ``routine``: its required arrays, one flag by keyword."""
    a, b = rand((6, 6), dt, seed=1), rand((6, 4), dt, seed=2)
    if routine in ("trmm", "trsm"):
        return (np.asfortranarray(a + 4 * np.eye(6, dtype=dt)), b), {"lower": 1}
    if routine in ("syrk", "herk"):
        return (b,), {"lower": 1}
    if routine in ("syr2k", "her2k"):
        return (b, rand((6, 4), dt, seed=3)), {"trans": 0}
    if routine == "gemm":
        return (b, rand((6, 4), dt, seed=3)), {"trans_a": 1}
    return (a, b), {"side": 0}


LEVEL3 = [(p, r) for r, ps in B.LEVEL3.items() for p in ps]


@pytest.mark.parametrize("prefix, routine", LEVEL3)
def test_level3_numpy_scalars(prefix, routine, rand, rel_err, tol, monkeypatch):
    """alpha (and beta with c) numpy scalars of the types f2py and blasx convert alike: scipy's
    routine, bit for bit (the plain call from C and Python; the second lane), and what the general
    path computes; a complex numpy alpha where BLAS reads a real one keeps the general path."""
    dt = DT[prefix]
    sp = S.get_blas_funcs(routine, dtype=dt)
    ops, kw = _plain_ops(routine, dt, rand)
    real_alpha = routine == "herk" or prefix in "sd"
    alphas = [np.float64(1.5), np.float32(-0.5), np.int64(2)] + ([] if real_alpha else [np.complex128(0.5 + 1j)])
    fns = [getattr(B, prefix + routine)] + ([getattr(blasx, prefix + routine)] if routine != "gemm" else [])
    with_c = routine not in ("trmm", "trsm")
    slow = _general(lambda: [fn(al, *ops, **kw) for fn in fns for al in alphas])
    with monkeypatch.context() as mp:
        _general_fails(mp)
        got = []
        for fn in fns:
            for alpha in alphas:
                want = sp(alpha, *ops, **kw)
                for f in _both(fn):
                    np.testing.assert_array_equal(f(alpha, *ops, **kw), want)
                got.append(want)
                if with_c:  # the second lane: beta a numpy scalar, c poisoned where beta 0 does not read it
                    c = np.full(want.shape, np.nan, dtype=dt, order="F")
                    np.testing.assert_array_equal(fn(alpha, *ops, np.float64(0.0), c, **kw),
                                                  sp(alpha, *ops, 0.0, c, **kw))
                    c = rand(want.shape, dt, seed=5)
                    np.testing.assert_array_equal(fn(alpha, *ops, np.float32(0.5), c, **kw),
                                                  sp(alpha, *ops, 0.5, c, **kw))
    for g, s in zip(got, slow):
        assert rel_err(g, s) < 50 * tol(dt)


@pytest.mark.parametrize("name", ["dsyrk", "sgemm", "dtrsm", "zherk"])
def test_level3_complex_numpy_alpha_where_blas_reads_a_real_one(name, rand, rel_err, tol):
    """... keeps the general path: blasx.linalg.blas's warning (scipy's cast), the prefixed
    functions' error, as before."""
    dt = DT[name[0]]
    ops, kw = _plain_ops(name[1:], dt, rand)
    fns = [getattr(B, name)] + ([getattr(blasx, name)] if name[1:] != "gemm" else [])
    for fn, alpha in itertools.product(fns, (np.complex128(1.5 + 1j), np.complex64(1.5 + 1j))):
        for f in _both(fn):
            _same_outcome(_outcome(lambda: f(alpha, *ops, **kw)),
                          _general(lambda: _outcome(lambda: f(alpha, *ops, **kw))), rel_err, tol)


@pytest.mark.parametrize("prefix", "sdcz")
def test_level3_lists(prefix, rand, monkeypatch):
    """Nested lists (as scipy takes them): numpy's arrays of them, then the lanes: scipy's result on
    the lists, bit for bit; lists numpy makes ints or complex values of (for a real routine) keep
    the general path: its results, warnings and errors, as before."""
    dt = DT[prefix]
    a, b, c = rand((6, 4), dt, seed=1), rand((4, 5), dt, seed=2), rand((6, 5), dt, seed=3)
    sp = S.get_blas_funcs("gemm", dtype=dt)
    gemm = getattr(B, prefix + "gemm")
    with monkeypatch.context() as mp:
        _general_fails(mp)
        for x, y in ((a.tolist(), b.tolist()), (a, b.tolist()), (a.tolist(), b)):
            for f in _both(gemm):
                np.testing.assert_array_equal(f(1.5, x, y), sp(1.5, x, y))
                np.testing.assert_array_equal(f(1.5, x, y, 0.5, c), sp(1.5, x, y, 0.5, c))
        np.testing.assert_array_equal(B.__dict__[prefix + "syrk"](1.5, a.tolist()),
                                      S.get_blas_funcs("syrk", dtype=dt)(1.5, a.tolist()))
        assert blasx.last_profile().totals()["flops"] == (4 if prefix in "cz" else 1) * 6 * 7 * 4
    ints = [[1, 2], [3, 4]]
    got = gemm(1.0, ints, ints)
    np.testing.assert_array_equal(got, _general(lambda: gemm(1.0, ints, ints)))
    ragged = [[1.0, 2.0], [3.0]]
    call = lambda: gemm(1.0, ragged, ints)  # noqa: E731
    assert _error_of(call) == _general(lambda: _error_of(call))
    if prefix in "sd":
        with pytest.warns(np.exceptions.ComplexWarning):
            got = gemm(1.0, (a + 1j).tolist(), b)
        np.testing.assert_array_equal(got, sp(1.0, a, b))


def test_level3_lists_keep_aliases_and_errors(rand):
    """A list operand never aliases an output; blasx's own functions reject lists (as scipy's
    don't), as before; bad lists raise what they raised."""
    a = rand((6, 4), seed=1)
    c = rand((6, 6), seed=2, order="F")
    assert B.dsyrk(1.0, a.tolist(), 0.5, c, overwrite_c=1) is c
    for call in (lambda: B.dgemm(1.0, [["x"]], [[1.0]]), lambda: B.dsyrk(1.0, [[1.0], 2.0]),
                 lambda: blasx.syrk(1.0, a.tolist()), lambda: blasx.dsyrk(1.0, a.tolist()),
                 lambda: blasx.gemm(1.0, a.tolist(), a.T), lambda: blasx.dtrmm(1.0, np.eye(6).tolist(), a)):
        assert _error_of(call) == _general(lambda: _error_of(call))


# ---------------------------------------------------------------- keyword calls in C (issue 5's fourth pass)

def _python_run(fn):
    """(fn(), the names of the blasx Python functions called in it)."""
    ran = []
    mark = os.sep + "blasx" + os.sep

    def prof(frame, event, arg):
        if event == "call" and mark in frame.f_code.co_filename:
            ran.append(frame.f_code.co_name)

    sys.setprofile(prof)
    try:
        res = fn()
    finally:
        sys.setprofile(None)
    return res, ran


def _in_c(fn, allow=()):
    """fn()'s result, asserting that no blasx Python function ran in it, but those named in ``allow``
    (what the C code calls itself: host_scale for an alpha-0 gemm): the C entry point took the call
    (where the library is built)."""
    if _hostcall.kind() != "c":
        return fn()
    res, ran = _python_run(fn)
    ran = [name for name in ran if name not in allow]
    assert not ran, f"blasx's Python ran: {ran}"
    return res


ALPHA0 = ("host_scale",)  # what the C entry points call for an alpha-0 gemm (C = beta C)


def _py(f):
    """The Python function behind an entry point (f itself without the library)."""
    return getattr(f, "__wrapped__", f)


def _profile():
    t = blasx.last_profile().totals()
    return t["tasks"], t["flops"]


def _poisoned_c(shape, dtype, how, rand, seed, nan=False):
    c = _laid_out(rand(shape, dtype, seed=seed, order="C"), how)
    if nan:
        c[...] = np.nan
    return c


@pytest.mark.parametrize("dtype", BLAS)
def test_gemm_with_c_in_c(dtype, rand, rel_err, tol, gemm_alpha0_reads):
    """blasx.gemm with beta, c (every layout, NaN around), overwrite_c (int / bool), alpha 0 (NaN in
    a and b), by position and by keyword: from C where the Python host path takes the call (c
    written in place when F-ordered, through c.T when C-ordered), else the Python function; both
    give the same array (bit for bit), the same object (c itself exactly when overwrite_c), the
    same profile, and scipy's ?gemm's values; c is not written when it is not the output."""
    fn = S.get_blas_funcs("gemm", dtype=dtype)
    cplx = np.dtype(dtype).kind == "c"
    rng = np.random.default_rng(11)
    specs = list(itertools.product((0, 1, 2), (0, 1, 2), ("F", "C", "blockF", "block", "strided"),
                                   (0, 1, False, True)))
    for ta, tb, lc, ow in specs:
        alpha = [1.5, 0.0, np.float64(-0.5), 2][int(rng.integers(4))]
        beta = [0.5, 0.0, np.float32(1.5), 1][int(rng.integers(4))]
        if cplx and rng.random() < 0.5:
            alpha, beta = alpha + 0.5j, beta - 0.25j
        la, lb = LAYOUTS[int(rng.integers(6))], ("C", "F", "block")[int(rng.integers(3))]
        positional = rng.random() < 0.5

        def args():
            a = _laid_out(rand((7, 6) if ta == 0 else (6, 7), dtype, seed=1, order="C"), la)
            b = _laid_out(rand((6, 5) if tb == 0 else (5, 6), dtype, seed=2, order="C"), lb)
            if alpha == 0:
                a[0, 0] = b[-1, -1] = np.nan
            return a, b, _poisoned_c((7, 5), dtype, lc, rand, 3, nan=beta == 0)

        def call(f, x):
            a, b, c = x
            if positional:
                return f(alpha, a, b, beta, c, ta, tb, ow)
            return f(alpha, a, b, c=c, beta=beta, overwrite_c=ow, trans_b=tb, trans_a=ta)

        # (alpha 0: never the host's ?gemm, some OpenBLAS builds read a and b then: C = beta C, where
        # no transposed product is needed)
        in_c = not ow or lc == "F" or (lc == "C" and (alpha == 0 or not (cplx and 2 in (ta, tb))))
        x1, x2 = args(), args()
        got = _in_c(lambda: call(blasx.gemm, x1), ALPHA0 if alpha == 0 else ()) if in_c else call(blasx.gemm, x1)
        prof = _profile()
        ref = call(_py(blasx.gemm), x2)
        assert prof == _profile()
        assert (got is x1[2]) == (ref is x2[2]) == bool(ow)
        assert got.dtype == np.dtype(dtype) and got.shape == (7, 5) and np.isfinite(got).all()
        np.testing.assert_array_equal(got, ref)
        sa, sb, sc = (np.asfortranarray(x) for x in args())
        if not (alpha == 0 and gemm_alpha0_reads(dtype)):  # (scipy's ?gemm reading a, b at alpha 0: not BLAS's)
            _ok(rel_err, tol, got, fn(alpha, sa, sb, beta, sc, ta, tb))
        if not ow:
            np.testing.assert_array_equal(x1[2], args()[2])


def _other(dt):
    return {np.float32: np.float64, np.float64: np.float32, np.complex64: np.complex128,
            np.complex128: np.complex64}[dt]


def _lane_calls(routine, dt, rand):
    """(label, args, kwargs, output index or None) of the second lane's calls of ``routine``: c and
    beta by position and keyword, flags by position, overwrite_* (an F-ordered c: in place; a
    C-ordered or block one: a new array), alpha 0 (NaN in a and b), beta 0 (NaN in c), arrays of
    the other precision (converted by scipy)."""
    tri, rank = routine in ("trmm", "trsm"), routine in ("syrk", "herk")
    a = rand((5, 5), dt, seed=1, order="F") + 3 * np.eye(5, dtype=dt)
    b = rand((5, 4) if tri else (5, 4), dt, seed=2, order="F")
    if routine in ("symm", "hemm"):
        ops, cshape = (a, b), (5, 4)
    elif rank:
        ops, cshape = (b,), (5, 5)
    elif routine in ("syr2k", "her2k"):
        ops, cshape = (b, rand((5, 4), dt, seed=4, order="F")), (5, 5)
    elif routine == "gemm":
        ops, cshape = (b, rand((4, 3), dt, seed=4, order="F")), (5, 3)
    else:
        ops, cshape = (a, b), None
    nan_ops = tuple(x.copy(order="F") for x in ops)
    for x in nan_ops:
        x[0, 0] = np.nan
    conv = tuple(x.astype(_other(dt)) for x in ops)
    flags = {"gemm": (0, 0), "symm": (0, 1), "hemm": (0, 1), "syrk": (0, 1), "herk": (0, 0), "syr2k": (0, 1),
             "her2k": (0, 1), "trmm": (0, 1, 1, 0), "trsm": (0, 0, 2, 1)}[routine]
    out = []
    if tri:
        bb = lambda how: _laid_out(ops[1], how)  # noqa: E731
        out += [("overwrite_b F", (1.5, ops[0], bb("F")), {"overwrite_b": 1, "lower": 1}, 2),
                ("overwrite_b C", (1.5, ops[0], bb("C")), {"overwrite_b": True}, 2),
                ("overwrite_b block", (1.5, ops[0], bb("blockF")), {"overwrite_b": 1, "side": 0}, 2),
                ("flags positional", (1.5, ops[0], bb("F"), *flags, 1), {}, 2),
                ("alpha 0", (0.0, *nan_ops), {"lower": 1}, None),
                ("converted", (2, *conv), {"trans_a": 1}, None),
                ("converted in place", (2, conv[0], bb("F")), {"overwrite_b": 1}, 2)]
        return out
    c = lambda how, nan=False: _poisoned_c(cshape, dt, how, rand, 5, nan)  # noqa: E731
    n = len(ops)
    out += [("c positional", (1.5, *ops, 0.5, c("F")), {}, None),
            ("c keyword", (1.5, *ops), {"c": c("C"), "beta": 0.5}, None),
            ("beta 0, NaN c", (1.5, *ops, 0.0, c("blockF", True)), {}, None),
            ("beta without c", (1.5, *ops, 0.5), {}, None),
            ("flags positional", (1.5, *ops, 1.0, c("F"), *flags), {}, None),
            ("overwrite F", (1.5, *ops, 0.5, c("F")), {"overwrite_c": 1}, n + 2),
            ("overwrite bool", (1.5, *ops), {"beta": 1, "c": c("F"), "overwrite_c": True}, None),
            ("overwrite C", (1.5, *ops, 0.5, c("C")), {"overwrite_c": 1}, n + 2),
            ("overwrite block", (1.5, *ops, 0.5, c("blockF")), {"overwrite_c": 1}, n + 2),
            ("alpha 0", (0.0, *nan_ops, 0.5, c("F")), {}, None),
            ("alpha 0 in place", (0, *nan_ops, 0.5, c("F")), {"overwrite_c": 1}, n + 2),
            ("converted", (1.5, *conv, 0.5, c("F").astype(_other(dt))), {}, None),
            ("converted, c in place", (1.5, *conv, 0.5, c("F")), {"overwrite_c": 1}, n + 2)]
    return out


@pytest.mark.parametrize("prefix, routine", LEVEL3)
def test_level3_second_lane_in_c(prefix, routine, rand, gemm_alpha0_reads):
    """The scipy-signature functions (blasx.linalg.blas and blasx's prefixed ones) with c and beta,
    overwrite_*, flags by position, alpha 0, converted arrays: from C (no Python frame), scipy's
    routine called as the Python lane calls it, bit for bit; the Python function (``__wrapped__``)
    gives the same array, the same object and the same profile."""
    dt = DT[prefix]
    sp = S.get_blas_funcs(routine, dtype=dt)
    fns = [getattr(B, prefix + routine)] + ([getattr(blasx, prefix + routine)] if routine != "gemm" else [])
    for label, args, kw, out in _lane_calls(routine, dt, rand):
        fresh = lambda: ([x.copy(order="A") if isinstance(x, np.ndarray) else x for x in args],  # noqa: E731
                         {k: v.copy(order="A") if isinstance(v, np.ndarray) else v for k, v in kw.items()})
        for fn in fns:
            a1, k1 = fresh()
            alpha0_gemm = routine == "gemm" and label.startswith("alpha 0")  # (C = beta C, no ?gemm)
            got = _in_c(lambda: fn(*a1, **k1), ALPHA0 if alpha0_gemm else ())
            prof = _profile()
            a2, k2 = fresh()
            ref = _py(fn)(*a2, **k2)
            assert prof == _profile(), label
            a3, k3 = fresh()
            want = sp(*a3, **k3)
            if not (alpha0_gemm and gemm_alpha0_reads(dt)):  # (a ?gemm that reads a, b at alpha 0: not BLAS's)
                np.testing.assert_array_equal(got, want, label)
            np.testing.assert_array_equal(got, ref, label)
            assert got.dtype == np.dtype(dt), label
            if not (label == "beta 0, NaN c" and routine in ("syrk", "herk", "syr2k", "her2k")):  # (c's other triangle)
                assert np.isfinite(got).all(), label
            if out is not None:  # written in place exactly when scipy writes in place
                assert (got is a1[out]) == (ref is a2[out]) == (want is a3[out]), label


def test_second_lane_in_c_declines_what_python_decides(rand, rel_err, tol):
    """Outputs the C code cannot prove safe go to the Python function, with the results and errors
    of before: c sharing memory with a (blasx's error), c whose bounds overlap a's but whose
    elements do not (numpy's exact test: in place), a misaligned c, a read-only c (a new array)."""
    a = rand((6, 6), seed=1, order="F")
    for fn in (B.dsyrk, blasx.dsyrk, blasx.gemm):
        args = (a, a.T) if fn is blasx.gemm else (a,)
        for c in (a, a[:, :]):
            err = _error_of(lambda: fn(1.0, *args, 0.5, c, overwrite_c=1))
            assert err == _error_of(lambda: _py(fn)(1.0, *args, 0.5, c, overwrite_c=1))
            assert err[0] is ValueError and "shares memory with a" in err[1]
    buf = rand((460,), seed=3)
    x = np.lib.stride_tricks.as_strided(buf, (6, 4), (8, 720))
    for fn, extra in ((B.dsyrk, ()), (B.dgemm, (np.ones((4, 6)),)), (blasx.gemm, (np.ones((4, 6)),))):
        c = buf[50:86].reshape(6, 6, order="F")
        c0 = c.copy()
        want = (S.dsyrk(1.0, x, 0.5, c0) if fn is B.dsyrk else S.dgemm(1.0, x, extra[0], 0.5, c0))
        assert fn(1.0, x, *extra, 0.5, c, overwrite_c=1) is c
        _ok(rel_err, tol, c, want)
        c[...] = c0
    raw = np.zeros(6 * 6 * 8 + 8, np.uint8)
    odd = raw[1:1 + 288].view(np.float64).reshape(6, 6).T  # F-ordered, misaligned
    assert not odd.flags.aligned and odd.flags.f_contiguous
    odd[...] = rand((6, 6), seed=4)
    want = S.dsyrk(1.0, a, 0.5, odd.copy(order="F"))
    for fn in (B.dsyrk, blasx.dsyrk):
        o = odd.copy()
        got = fn(1.0, a, 0.5, odd, overwrite_c=1)
        assert got is odd
        _ok(rel_err, tol, got, want)
        odd[...] = o
    ro = rand((6, 6), seed=5, order="F")
    ro.flags.writeable = False
    for fn in (B.dsyrk, blasx.dsyrk):
        got = _in_c(lambda: fn(1.0, a, 0.5, ro, overwrite_c=1))
        assert got is not ro and np.array_equal(got, S.dsyrk(1.0, a, 0.5, ro))


def test_keyword_binding_in_c(rand):
    """The C code binds arguments as Python does: keywords by name (interned or not), in any order;
    a repeated, unknown or missing argument, or too many, goes to the Python function, which
    raises its TypeError."""
    a, b, c = rand((5, 4), seed=1, order="F"), rand((4, 3), seed=2, order="F"), rand((5, 3), seed=3, order="F")
    name = "".join(["be", "ta"])  # a str that is not the interned one
    for fn in (B.dgemm, blasx.gemm):
        want = S.dgemm(1.5, a, b, 0.5, c)
        np.testing.assert_array_equal(_in_c(lambda: fn(1.5, a, b, **{name: 0.5, "c": c})), want)
        np.testing.assert_array_equal(_in_c(lambda: fn(c=c, b=b, a=a, alpha=1.5, beta=0.5)), want)
        for args, kw in (((1.5, a, b), {"alpha": 2.0}), ((1.5, a, b, 0.5, c), {"gamma": 1}),
                         ((), {"a": a, "b": b}), ((1.5, a, b, 0.5, c, 0, 0, 0, 0), {}),
                         ((1.5, a, b, 0.5, c), {"c": c})):
            err = _error_of(lambda: fn(*args, **kw))
            assert err[0] is TypeError and err == _error_of(lambda: _py(fn)(*args, **kw))


@pytest.mark.parametrize("dtype", BLAS)
def test_matmul_out_and_dtype_in_c(dtype, rand, rel_err, tol):
    """matmul with out= (by keyword or position, C- or F-ordered, NaN-filled), dtype= (every spelling
    taken), casting=: numpy's matmul from C, bit for bit, the same out returned, the profile of the
    Python function; an out numpy writes without BLAS (non-contiguous, another dtype) and other
    keywords go to the Python function, with the results and errors of before."""
    other = _other(dtype)
    x1 = _laid_out(rand((7, 6), dtype, seed=1, order="C"), "block")
    x2 = rand((6, 5), dtype, seed=2, order="F")
    for out_how, kw in itertools.product(("none", "C", "F", "positional"),
                                         ({}, {"dtype": dtype}, {"dtype": np.dtype(other)}, {"dtype": np.dtype(dtype).char},
                                          {"dtype": np.dtype(other).name}, {"casting": "same_kind"},
                                          {"casting": "unsafe", "dtype": other}, {"dtype": None})):
        ct = np.dtype(kw.get("dtype") or dtype)

        def out():
            return None if out_how == "none" else np.full((7, 5), np.nan, ct, order="F" if out_how == "F" else "C")

        def call(f, o):
            if out_how == "positional":
                return f(x1, x2, o, **kw)
            return f(x1, x2, **kw) if o is None else f(x1, x2, out=o, **kw)

        o1, o2, o3 = out(), out(), out()
        got = _in_c(lambda: call(blasx.matmul, o1))
        prof = _profile()
        ref = call(_py(blasx.matmul), o2)
        assert prof == _profile()
        want = call(np.matmul, o3)
        assert (got is o1) == (ref is o2) == (o1 is not None)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, ref)
    for make in (lambda: np.empty((7, 10), dtype)[:, ::2], lambda: np.empty((7, 5), other),
                 lambda: np.empty((7, 5), np.complex128)):
        o, o2 = make(), make()
        assert blasx.matmul(x1, x2, out=o) is o and _py(blasx.matmul)(x1, x2, out=o2) is o2
        np.testing.assert_array_equal(o, o2)
        _ok(rel_err, tol, o, np.matmul(x1, x2, out=np.empty_like(o)))
    for call in (lambda f: f(x1, x2, np.empty((7, 5), dtype), out=np.empty((7, 5), dtype)),
                 lambda f: f(x1, x2, out=np.empty((7, 4), dtype)),
                 lambda f: f(x1, x2, out=_readonly(np.empty((7, 5), dtype))),
                 lambda f: f(x1, x2, dtype=np.int32),
                 lambda f: f(x1, x2, dtype=[1]),
                 lambda f: f(x1, x2, casting="bogus"),
                 lambda f: f(x1, x2, casting=None),
                 lambda f: f(x1, x2, bogus=1),
                 lambda f: f(x1, x1, out=np.empty((7, 6), dtype)),
                 lambda f: f(x1, x2, dtype=other, casting="no")):
        fast, slow = _outcome(lambda: call(blasx.matmul)), _outcome(lambda: call(_py(blasx.matmul)))
        assert fast[0][0] == slow[0][0] and fast[1] == slow[1]
        if fast[0][0] == "error":
            assert fast == slow
        else:
            np.testing.assert_array_equal(fast[0][1], slow[0][1])


def _readonly(x):
    x = x.copy()
    x.flags.writeable = False
    return x


@pytest.mark.parametrize("dtype", BLAS)
def test_tensordot_in_c(dtype, rand):
    """tensordot of two ndarrays of one BLAS type (axes an int, a pair, by keyword, the default):
    numpy's tensordot from C, bit for bit, with the Python function's profile; numpy's errors; other
    operands go to the Python function."""
    a = rand((3, 4, 5), dtype, seed=1, order="C")
    b = _laid_out(rand((5, 6), dtype, seed=2, order="C"), "strided")
    sq = rand((4, 5), dtype, seed=3, order="F")
    for args, kw in (((a, b, 1), {}), ((a, b), {"axes": 1}), ((a, b, ([2], [0])), {}), ((sq, sq), {}),
                     ((sq, sq, 0), {}), ((a, rand((4, 5, 2), dtype, seed=4)), {}), ((a, b, ((2,), (0,))), {})):
        got = _in_c(lambda: blasx.tensordot(*args, **kw))
        prof = _profile()
        ref = _py(blasx.tensordot)(*args, **kw)
        assert prof == _profile()
        want = np.tensordot(*args, **kw)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, ref)
    for call in (lambda f: f(a, b, 2), lambda f: f(a, b, axes=([0], [0])), lambda f: f(a, b, 1, axes=1),
                 lambda f: f(a, b, bogus=1), lambda f: f(a, b.astype(_other(dtype)), 1)):
        fast = _outcome(lambda: call(blasx.tensordot))
        slow = _outcome(lambda: call(_py(blasx.tensordot)))
        assert fast[0][0] == slow[0][0] and fast[1] == slow[1]
        if fast[0][0] == "error":
            assert fast[0][1] is slow[0][1]


def test_keyword_calls_in_c_keep_refcounts(rand):
    """Many calls of each new C case change no argument's reference count (a leak or a lost
    reference would)."""
    a, b = rand((5, 5), seed=1, order="F"), rand((5, 5), seed=2, order="F")
    c, o = rand((5, 5), seed=3, order="F"), np.empty((5, 5))
    cc = np.ascontiguousarray(c)
    a32 = a.astype(np.float32)
    eye, bb = np.asfortranarray(np.eye(5)), b.copy(order="F")
    alpha, beta = 1.5, 0.5
    calls = [lambda: blasx.gemm(alpha, a, b, beta, c), lambda: blasx.gemm(alpha, a, b, beta, c, overwrite_c=True),
             lambda: blasx.gemm(alpha, a, b, beta, cc, overwrite_c=1), lambda: B.dsymm(0.0, a, b, beta, c),
             lambda: B.dsyrk(alpha, a32, beta=beta, c=c, overwrite_c=1), lambda: blasx.dtrsm(1.0, eye, bb, overwrite_b=1),
             lambda: blasx.matmul(a, b, out=o), lambda: blasx.matmul(a, b, dtype=np.float32),
             lambda: blasx.tensordot(a, b, 1), lambda: B.dsymm(alpha, a, b, beta, c, 1, 1),
             lambda: blasx.dot(a, b, out=o), lambda: blasx.dot(a, b, o)]
    objs = (a, b, c, cc, o, a32, eye, bb, alpha, beta, np.float32, 1, True, session.host_device, a.dtype, a32.dtype)
    gc.collect()
    r0 = sys.getrefcount(a.dtype)
    for _ in range(200):
        np.dot(a, b)
    if sys.getrefcount(a.dtype) != r0:  # numpy 2.5.2's own dot / tensordot gain a dtype reference a call
        objs = objs[:-2]
    for i, f in enumerate(calls):
        f()
        gc.collect()  # (garbage of earlier calls, freed by a collection inside the loop, would count)
        before = [sys.getrefcount(x) for x in objs]
        for _ in range(2000):
            f()
        assert [sys.getrefcount(x) for x in objs] == before, i


# ---------------------------------------------------------------- the record of the last call

def _recorded_calls(n: int, rand, general: bool = True):
    """(name, call, real flops x dtype factor) of calls of n-sized operands that record on each
    path: the C entry points (plain and keyword calls), the Python fast paths (the Python
    functions, a mixed-dtype gemm) and, with ``general``, blasx's general path (a CallStats). Each
    call's shape differs from the others' (m, k, p below), so its flops name it."""
    m, k, p = n + 2, n + 1, n
    a, b = rand((m, k), seed=1, order="C"), rand((k, p), seed=2, order="C")
    af, bf, cf = rand((m, k), seed=3), rand((k, p), seed=4), rand((m, p), seed=5)
    z1, z2 = rand((m + 1, k), np.complex128, seed=6), rand((k, p), np.complex128, seed=7)
    a32 = a.astype(np.float32)
    sq = rand((m, m), seed=8)
    calls = [
        ("C matmul", lambda: blasx.matmul(a, b), 2 * m * k * p),
        ("C dot", lambda: blasx.dot(a[:-1], b), 2 * (m - 1) * k * p),
        ("C gemm", lambda: blasx.gemm(1.0, af[:, :-1], bf[:-1]), 2 * m * (k - 1) * p),
        ("C gemm c", lambda: blasx.gemm(1.0, af, bf, 0.5, cf), 2 * m * k * p),
        ("C zgemm", lambda: B.zgemm(1.0, z1, z2), 8 * (m + 1) * k * p),
        ("C dsymm c", lambda: B.dsymm(1.0, sq, cf, 0.5, cf), 2 * m * p * m),
        ("C tensordot", lambda: blasx.tensordot(a, b[:, :-1], 1), 2 * m * k * (p - 1)),
        ("Python matmul", lambda: _py(blasx.matmul)(a[1:], b), 2 * (m - 1) * k * p),
        ("Python dgemm", lambda: _py(B.dgemm)(1.0, af[1:], bf), 2 * (m - 1) * k * p),
        ("Python gemm mixed", lambda: blasx.gemm(1.0, a32, b[:, 1:]), 2 * m * k * (p - 1)),
    ]
    if general:
        calls.append(("general gemm", lambda: _general(lambda: blasx.gemm(1.0, af[2:], bf)), 2 * (m - 2) * k * p))
    return calls


def _check_record(name, call, flops, errors):
    """call() becomes this thread's last call: its profile's flops, one CPU device, a window within
    the call; a C call leaves level3.last_call.stats alone (no Python object per call)."""
    before = level3.last_call.stats
    t0 = time.perf_counter()
    call()
    t1 = time.perf_counter()
    if name.startswith("C ") and _hostcall.kind() == "c" and level3.last_call.stats is not before:
        errors.append(f"{name}: the C path wrote level3.last_call.stats")
    p = blasx.last_profile()
    got = (p.totals()["flops"], p.totals()["tasks"], [d.kind for d in p.devices], t0 <= p.start <= p.finish <= t1)
    if got != (flops, 1, ["cpu"], True) and not (name.startswith("general") and got[0] == flops and got[3]):
        errors.append(f"{name}: profile {got}, expected flops {flops} in [{t0}, {t1}]")
    if blasx.last_profile() is not p:
        errors.append(f"{name}: a second last_profile() made another profile")


def test_record_of_interleaved_c_and_python_calls(rand):
    """C and Python paths interleaved on one thread, the profile read after some calls only: it is
    always the latest call's (the newer of C's record and Python's wins), whichever path made it
    and whatever made the one before."""
    calls = _recorded_calls(6, rand)
    rng = np.random.default_rng(0)
    errors = []
    pending = None
    for i in range(300):
        name, call, flops = calls[rng.integers(len(calls))]
        if rng.random() < 0.4:   # not read: the next read must still pick the latest of several
            call()
            pending = (name, flops)
            continue
        _check_record(name, call, flops, errors)
        pending = None
    if pending is not None:
        assert blasx.last_profile().totals()["flops"] == pending[1], pending
    for name, call, flops in calls:   # each path after each path
        for name2, call2, flops2 in calls:
            call()
            _check_record(name2, call2, flops2, errors)
    assert not errors, errors[:5]


def test_record_per_thread(rand):
    """Many threads calling the C and Python paths at once: each thread's profile is its own last
    call's (operands of a size of its own: the flops say whose); a new thread has no record."""
    import threading
    nthreads, rounds = 4, 150
    barrier = threading.Barrier(nthreads)
    errors = []

    def work(t):
        try:
            if blasx.last_profile() is not None:
                errors.append(f"thread {t}: a profile before its first call")
            calls = _recorded_calls(5 + 3 * t, rand, general=False)
            rng = np.random.default_rng(t)
            barrier.wait()
            for _ in range(rounds):
                name, call, flops = calls[rng.integers(len(calls))]
                _check_record(f"{name} (thread {t})", call, flops, errors)
        except Exception as e:  # noqa: BLE001 - reported below, with the thread
            errors.append(f"thread {t}: {e!r}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # threads switch between and inside calls
    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(nthreads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:5]


@pytest.mark.skipif(_hostcall.kind() != "c", reason="the C entry points' record")
def test_record_order_is_program_order_not_the_clocks(rand):
    """Which record is the last call is decided by program order, never by comparing their times:
    a Python record written right after a C call (well within a microsecond of its end, as the
    Python paths write theirs: end_clock(), then the record) is the last one even where its times
    say it is older, and a C call after a Python record is the last one even where that record's
    times lie in the future. The C record, once taken, is not reported again."""
    a = rand((3, 3))
    dev = session.host_device
    for i in range(200):
        blasx.matmul(a, a)                                    # C: 54 flops
        level3.keep_host_call(dev, time.perf_counter(), a.dtype, 7.0)
        assert level3.last_record()[4] == 7.0, i
        blasx.dot(a, a)                                       # C: 54 flops
        level3.end_clock()
        level3.last_call.stats = (dev, 0.0, 0.0, a.dtype, 5.0)  # ends (by its times) before the C call
        assert level3.last_record()[4] == 5.0 and level3.last_record()[4] == 5.0, i
        level3.last_call.stats = (dev, 0.0, float("inf"), a.dtype, 3.0)
        blasx.matmul(a[:2], a)                                # C: 36 flops, "before" the record by its times
        got = level3.last_record()
        assert got[4] == 36.0 and level3.last_record() is got, i
        assert blasx.last_profile().totals()["flops"] == 36.0


@pytest.mark.skipif(_hostcall.kind() != "c", reason="the C entry points' record")
def test_c_record_times_on_perf_counters_clock(rand):
    """Whatever clock the C code stamps with (the TSC converted when read, CLOCK_MONOTONIC, or
    perf_counter), a record read at once or 50 ms later lies within perf_counter's window around
    its call, its duration within that window's."""
    assert _hostcall.clock() in ("tsc", "monotonic", "perf_counter")
    a = rand((24, 24))
    for wait in (0.0, 0.05, 0.0):
        for _ in range(20):
            t0 = time.perf_counter()
            blasx.matmul(a, a)
            t1 = time.perf_counter()
            if wait:
                time.sleep(wait)
            rec = level3.last_record()
            assert t0 <= rec[1] <= rec[2] <= t1, (wait, t0, rec[1:3], t1)


@pytest.mark.skipif(_hostcall.kind() != "c", reason="the C entry points' record")
def test_record_with_clock_gettime_where_the_tsc_is_off(tmp_path):
    """$BLASX_HOST_TSC=0: the C code stamps with CLOCK_MONOTONIC (perf_counter's clock here); the
    records and their order are as with the TSC."""
    if time.get_clock_info("perf_counter").implementation != "clock_gettime(CLOCK_MONOTONIC)":
        pytest.skip("perf_counter does not read CLOCK_MONOTONIC here")
    code = (
        "import time, numpy as np, blasx\n"
        "from blasx import _hostcall, level3\n"
        "from blasx.linalg import blas as B\n"
        "blasx.configure(devices='cpu')\n"
        "blasx.engine()\n"
        "assert _hostcall.clock() == 'monotonic', _hostcall.clock()\n"
        "a, b = np.ones((3, 4)), np.ones((4, 5))\n"
        "for f, flops in ((lambda: blasx.matmul(a, b), 120), (lambda: B.dgemm.__wrapped__(1.0, a[1:], b), 80),\n"
        "                 (lambda: B.dgemm(1.0, a, b), 120), (lambda: blasx.dot(a[1:], b), 80)) * 3:\n"
        "    t0 = time.perf_counter()\n"
        "    f()\n"
        "    t1 = time.perf_counter()\n"
        "    p = blasx.last_profile()\n"
        "    assert p.totals()['flops'] == flops and t0 <= p.start <= p.finish <= t1, (p.totals(), flops)\n"
        "print('ok')\n")
    _child_prints_ok(code, tmp_path, BLASX_HOST_TSC="0")


def _in_python(fn):
    """fn()'s result, asserting that blasx's Python function ran (the C entry point declined)."""
    res, ran = _python_run(fn)
    assert ran, "no blasx Python function ran"
    return res


@pytest.mark.skipif(_hostcall.kind() != "c", reason="the C entry points")
def test_c_entry_points_see_every_change_of_the_host_device(rand):
    """The C code reads session.host_device at every call (on Python >= 3.12 a cached pointer that a
    dict watcher drops): set to None or to another device, by assignment or through the module
    dict, restored, or replaced by a fresh engine, each change takes effect at the next call (None:
    the Python function, which runs the general path on the engine and publishes the device again)."""
    from blasx.runtime.devices.cpu import CpuDevice
    a = rand((5, 5))
    want = a @ a
    dev = session.host_device
    assert dev is not None
    np.testing.assert_array_equal(_in_c(lambda: blasx.matmul(a, a)), want)
    d = vars(session)
    try:
        for change, back in ((lambda: setattr(session, "host_device", None), lambda: setattr(session, "host_device", dev)),
                             (lambda: d.update({"host_device": None}), lambda: d.__setitem__("host_device", dev))):
            for _ in range(3):  # (the general path's engine() publishes the device again: change it each time)
                change()
                np.testing.assert_allclose(_in_python(lambda: blasx.matmul(a, a)), want, rtol=1e-13)
            back()
            for _ in range(3):
                np.testing.assert_array_equal(_in_c(lambda: blasx.matmul(a, a)), want)
                assert level3.last_record()[0] is dev
        other = CpuDevice(0)
        for put in (lambda x: setattr(session, "host_device", x), lambda x: d.update(host_device=x)):
            put(other)
            np.testing.assert_array_equal(_in_c(lambda: blasx.matmul(a, a)), want)
            assert level3.last_record()[0] is other
            put(dev)
            np.testing.assert_array_equal(_in_c(lambda: blasx.matmul(a, a)), want)
            assert level3.last_record()[0] is dev
    finally:
        d["host_device"] = dev
    blasx.configure(devices="cpu")
    blasx.engine()
    new = session.host_device
    assert new is not dev
    np.testing.assert_array_equal(_in_c(lambda: blasx.matmul(a, a)), want)
    assert level3.last_record()[0] is new


@pytest.mark.skipif(_hostcall.kind() != "c", reason="the C entry points' record")
def test_c_record_holds_its_device_while_its_thread_keeps_it(rand):
    """The C record's device is held by a guard in the thread's level3.last_call: a thread that
    ends lets its device go, a new device replaces the old one, and a guard dropped drops the
    record (the Python record then stands)."""
    import threading
    a = rand((4, 4))
    blasx.matmul(a, a)
    dev = session.host_device
    refs = sys.getrefcount(dev)
    seen = []

    def work():
        blasx.matmul(a, a)
        seen.append((level3.last_record()[0] is dev, level3.last_call.c_guard is not None))

    th = threading.Thread(target=work)
    th.start()
    th.join()
    assert seen == [(True, True)] and sys.getrefcount(dev) == refs

    blasx.configure(devices="cpu")
    blasx.engine()
    new = session.host_device
    refs = sys.getrefcount(dev)
    blasx.matmul(a, a)
    assert new is not dev and sys.getrefcount(dev) == refs - 1 and level3.last_record()[0] is new

    level3.last_call.stats = None
    blasx.dot(a, a)
    del level3.last_call.c_guard   # (what the thread's end does): the C record goes with it
    assert level3.last_record() is None and blasx.last_profile() is None
    blasx.dot(a, a)
    assert level3.last_call.c_guard is not None and blasx.last_profile().totals()["flops"] == 2 * 4 ** 3


@pytest.mark.skipif(_hostcall.kind() != "c", reason="the C entry points' record")
def test_record_with_perf_counter_called_from_c(tmp_path):
    """Where perf_counter does not read CLOCK_MONOTONIC the C code calls it (twice a call): the
    records are right, and the newer record still wins."""
    code = (
        "import time\n"
        "info, perf = time.get_clock_info, time.perf_counter\n"
        "calls = [0]\n"
        "def get_clock_info(name):\n"
        "    got = info(name)\n"
        "    if name == 'perf_counter':\n"
        "        got.implementation = 'another clock'\n"
        "    return got\n"
        "def counted():\n"
        "    calls[0] += 1\n"
        "    return perf()\n"
        "time.get_clock_info, time.perf_counter = get_clock_info, counted\n"
        "import numpy as np, blasx\n"
        "from blasx import _hostcall, level3\n"
        "from blasx.linalg import blas as B\n"
        "blasx.configure(devices='cpu')\n"
        "blasx.engine()\n"
        "assert _hostcall.kind() == 'c'\n"
        "a, b = np.ones((3, 4)), np.ones((4, 5))\n"
        "for f, flops in ((lambda: blasx.matmul(a, b), 120), (lambda: B.dgemm.__wrapped__(1.0, a[1:], b), 80),\n"
        "                 (lambda: B.dgemm(1.0, a, b), 120), (lambda: blasx.dot(a[1:], b), 80)):\n"
        "    n, t0 = calls[0], perf()\n"
        "    f()\n"
        "    t1, n = perf(), calls[0] - n\n"
        "    p = blasx.last_profile()\n"
        "    assert p.totals()['flops'] == flops and t0 <= p.start <= p.finish <= t1, (p.totals(), flops)\n"
        "    assert n == 2, n\n"
        "print('ok')\n")
    _child_prints_ok(code, tmp_path)


def _child_prints_ok(code: str, tmp_path, **env_vars) -> None:
    """Run ``code`` in a fresh interpreter (its own C library build, in tmp_path; ``env_vars`` set):
    it must print ok."""
    env = dict(os.environ, BLASX_CACHE_DIR=str(tmp_path), **env_vars)
    out = subprocess.run([sys.executable, "-c", code], env=env, timeout=120, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.skipif(not hasattr(os, "fork") or _hostcall.kind() != "c", reason="fork; the C entry points' record")
def test_c_record_after_fork(tmp_path):
    """In a child forked while another thread holds a record, the forking thread keeps its own
    record (the other thread's guard, released there by the forking thread, is left alone), and
    calls record as before."""
    code = (
        "import os, threading, numpy as np, blasx\n"
        "from blasx import level3\n"
        "blasx.configure(devices='cpu')\n"
        "blasx.engine()\n"
        "a = np.ones((4, 4))\n"
        "held, done = threading.Event(), threading.Event()\n"
        "def work():\n"
        "    blasx.matmul(a[:3], a)\n"
        "    held.set()\n"
        "    done.wait()\n"
        "th = threading.Thread(target=work)\n"
        "th.start()\n"
        "held.wait()\n"
        "blasx.dot(a[:2], a)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    ok = blasx.last_profile().totals()['flops'] == 2 * 2 * 4 * 4\n"
        "    blasx.matmul(a[:1], a)\n"
        "    ok = ok and blasx.last_profile().totals()['flops'] == 2 * 1 * 4 * 4\n"
        "    os._exit(0 if ok else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "done.set()\n"
        "th.join()\n"
        "assert os.waitstatus_to_exitcode(status) == 0, status\n"
        "assert blasx.last_profile().totals()['flops'] == 2 * 2 * 4 * 4\n"
        "print('ok')\n")
    _child_prints_ok(code, tmp_path)


def test_gemm_never_hands_alpha_zero_to_the_host_gemm(rand, monkeypatch):
    """BLAS reads neither a nor b when alpha is 0, but some OpenBLAS builds' ?gemm multiply them
    (scipy's wheels on the GPU hosts: a NaN of a leaked into C). blasx.gemm's C entry point and its
    Python host path make C = beta C themselves (level3.host_scale), a host call of no flops, never
    through the general path: here the host ?gemm is a spy that fails on alpha 0, and the general
    path's gemm fails at once, for every form both paths take."""
    from blasx import level3
    seen = []

    def general(*args, **kw):
        raise AssertionError("an alpha-0 gemm took the general path")
    monkeypatch.setattr(level3, "_run_gemm", general)

    def spy_of(real):
        def spy(*args, **kw):
            alpha = args[0] if args else kw["alpha"]
            seen.append(alpha)
            if alpha == 0:
                raise AssertionError("alpha 0 reached the host ?gemm")
            return real(*args, **kw)
        return spy

    spies = {dt: spy_of(f) for dt, f in level3._HOST_GEMM.items()}
    monkeypatch.setattr(level3, "_HOST_GEMM", spies)  # (the Python host path reads it per call)
    py = _py(blasx.gemm)
    entries = [py] + ([_hostcall.gemm(py, spies, level3._HOST_SCALARS)] if _hostcall.kind() == "c" else [])
    a, b = rand((6, 4), seed=1), rand((4, 5), seed=2)
    a[0, 0] = b[1, 1] = np.nan
    c0 = rand((6, 5), seed=3)
    for f in entries:
        for alpha in (0.0, np.float64(0.0), 0):
            for kw in ({}, {"beta": 0.5, "c": np.asfortranarray(c0)},
                       {"beta": 0.5, "c": np.asfortranarray(c0), "overwrite_c": 1},
                       {"beta": 0.5, "c": np.ascontiguousarray(c0), "overwrite_c": 1}):
                for x, y in ((np.asfortranarray(a), np.asfortranarray(b)), (np.ascontiguousarray(a), b)):
                    kw2 = {k: v.copy(order="K") if isinstance(v, np.ndarray) else v for k, v in kw.items()}
                    got = f(alpha, x, y, **kw2)
                    np.testing.assert_array_equal(got, 0.5 * c0 if kw else np.zeros((6, 5)))
                    assert (got is kw2.get("c")) == bool(kw.get("overwrite_c"))
                    prof = blasx.last_profile()
                    assert prof.records[0].kind == "host" and prof.totals()["flops"] == 0.0
        before = len(seen)
        lib = _hostcall._library()
        try:  # (scipy's routines themselves off: the wrapper, the spy here, is called)
            if lib is not None:
                _hostcall.set_direct(lib, True, False)
            f(1.5, np.asfortranarray(np.nan_to_num(a)), np.asfortranarray(np.nan_to_num(b)))
        finally:
            if lib is not None:
                _hostcall.set_direct(lib)
        assert len(seen) == before + 1  # the spy is the host ?gemm this entry calls
