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

import inspect
import itertools
import os
import pickle
import subprocess
import sys
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
