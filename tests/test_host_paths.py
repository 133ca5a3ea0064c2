"""The CPU alone: the fast paths of blasx.matmul / dot / tensordot, blasx.gemm, the
blasx.linalg.blas level-3 wrappers and the prefixed level-3 functions (blasx.dsyrk ...).

With ``devices="cpu"`` and no fixed tile, a plain call runs numpy's or scipy's own routine (the
host BLAS) behind ``session.host_device``, and so do calls with c, beta, overwrite_*, alpha 0,
complex scalars, converted arrays and matmul's out= / dtype= (the second lanes). These tests
check that the flag follows configure / shutdown, that the fast paths are taken (the general
path is made to fail), give what numpy / scipy give and what the general path gives (by
relative error, on random non-zero inputs, outputs poisoned with NaN where they are not read),
write in place exactly when the general path does, raise the same errors, and leave a profile
for last_profile(), in every thread."""

from __future__ import annotations

import importlib
import itertools
import threading

import numpy as np
import pytest
import scipy.linalg.blas as S

import blasx
from blasx import blas3, hostpath, level3, numpy_api, session
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


def _rel_ok(rel_err, tol, got, ref, factor=50):
    assert rel_err(got, ref) < factor * tol(np.asarray(ref).dtype), rel_err(got, ref)


def _general(fn):
    """fn() with the fast paths off (a fixed tile: the engine plans the call), then back on."""
    blasx.configure(devices="cpu", tile=8)
    try:
        return fn()
    finally:
        blasx.configure(devices="cpu")
        blasx.engine()


# ---------------------------------------------------------------- the flag

def test_flag_follows_configure_and_shutdown(rand):
    a = rand((6, 5), order="C")
    assert session.host_device is not None and session.host_device.kind == "cpu"
    blasx.shutdown()
    assert session.host_device is None
    blasx.matmul(a, a.T)  # the first call takes the general path, which starts the engine
    assert session.host_device is not None
    blasx.configure(devices="sim:2")
    assert session.host_device is None
    blasx.matmul(a, a.T)
    assert session.host_device is None
    assert blasx.last_profile().devices[0].kind == "sim"  # ran through the engine, on the sims
    blasx.configure(devices="cpu", tile=4)  # a fixed tile: the engine plans tiles, no fast path
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


# ---------------------------------------------------------------- numpy's functions

LAYOUTS = {"C": lambda x: x, "F": np.asfortranarray}


@pytest.mark.parametrize("dtype", BLAS)
@pytest.mark.parametrize("la, lb", list(itertools.product("CF", "CF")))
def test_matmul_fast_path(dtype, la, lb, rand, rel_err, tol, monkeypatch):
    a = LAYOUTS[la](rand((17, 13), dtype, seed=1, order="C"))
    b = LAYOUTS[lb](rand((13, 11), dtype, seed=2, order="C"))
    ref = np.matmul(a, b)
    slow = _general(lambda: blasx.matmul(a, b))
    _general_fails(monkeypatch)
    got = blasx.matmul(a, b)
    assert got.dtype == ref.dtype and got.shape == ref.shape and got.flags.c_contiguous
    assert slow.flags.c_contiguous
    _rel_ok(rel_err, tol, got, ref)
    _rel_ok(rel_err, tol, got, slow)
    p = blasx.last_profile()
    factor = 8 if np.dtype(dtype).kind == "c" else 2
    assert p.totals()["tasks"] == 1 and p.totals()["flops"] == factor * 17 * 13 * 11
    assert p.devices[0].kind == "cpu"


@pytest.mark.parametrize("sa, sb", [((20,), (20,)), ((20,), (20, 7)), ((9, 20), (20,)), ((3, 9, 20), (20, 7)),
                                    ((2, 1, 9, 5), (3, 5, 7)), ((0, 9, 5), (5, 7)), ((9, 0), (0, 7))])
def test_matmul_fast_path_shapes(sa, sb, rand, rel_err, tol, monkeypatch):
    a, b = rand(sa, seed=1, order="C"), rand(sb, seed=2, order="C")
    ref = np.matmul(a, b)
    _general_fails(monkeypatch)
    got = blasx.matmul(a, b)
    assert type(got) is type(ref) and np.shape(got) == np.shape(ref)
    if np.size(ref):
        _rel_ok(rel_err, tol, got, ref)


def test_matmul_strided_operands(rand, rel_err, tol, monkeypatch):
    """Strides like these: numpy's matmul from numpy 2.3.1 (it copies them and runs BLAS); before,
    numpy runs its loop without BLAS on them, and blasx keeps them on its gemm (both:
    tests/test_hostcall.py)."""
    a = rand((30, 40), order="C")[::2, ::3]
    b = rand((14, 9), seed=2, order="F")
    ref = np.matmul(a, b)

    def boom(*x, **k):
        raise AssertionError("numpy's matmul ran")
    if importlib.import_module("blasx._hostcall").NUMPY_COPIES_STRIDES:
        _general_fails(monkeypatch)
    else:
        monkeypatch.setattr(numpy_api, "_np_matmul", boom)
    _rel_ok(rel_err, tol, blasx.matmul(a, b), ref)


@pytest.mark.parametrize("sa, sb", [((20,), (20,)), ((20,), (20, 7)), ((9, 20), (20,)), ((9, 20), (20, 7))])
@pytest.mark.parametrize("dtype", BLAS)
def test_dot_fast_path(sa, sb, dtype, rand, rel_err, tol, monkeypatch):
    a, b = rand(sa, dtype, seed=1, order="C"), rand(sb, dtype, seed=2, order="F")
    ref = np.dot(a, b)
    slow = _general(lambda: blasx.dot(a, b))
    _general_fails(monkeypatch)
    got = blasx.dot(a, b)
    assert type(got) is type(ref) and np.shape(got) == np.shape(ref) and np.asarray(got).dtype == ref.dtype
    _rel_ok(rel_err, tol, got, ref)
    _rel_ok(rel_err, tol, got, slow)
    factor = 8 if np.dtype(dtype).kind == "c" else 2
    assert blasx.last_profile().totals()["flops"] == factor * np.size(ref) * 20


@pytest.mark.parametrize("axes, sb", [(2, (5, 6, 3)), (1, (6, 7)), (0, (2, 3)), (([1, 0], [0, 1]), (5, 4, 3)),
                                      (([2], [1]), (2, 6)), ((1, 0), (5, 2))])
def test_tensordot_fast_path(axes, sb, rand, rel_err, tol, monkeypatch):
    a = rand((4, 5, 6), np.complex128, seed=1, order="C")
    b = rand(sb, np.complex128, seed=2, order="C")
    ref = np.tensordot(a, b, axes)
    slow = _general(lambda: blasx.tensordot(a, b, axes))
    _general_fails(monkeypatch)
    got = blasx.tensordot(a, b, axes)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    _rel_ok(rel_err, tol, got, ref)
    _rel_ok(rel_err, tol, got, slow)
    k = a.size * b.size // ref.size
    assert blasx.last_profile().totals()["flops"] == pytest.approx(8 * ref.size * np.sqrt(k))


def _error_of(fn):
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


@pytest.mark.parametrize("call", [
    lambda x, y: blasx.matmul(x, y), lambda x, y: blasx.dot(x, y), lambda x, y: blasx.tensordot(x, y, 1),
    lambda x, y: blasx.tensordot(x, y, 3), lambda x, y: blasx.matmul(x, np.ones((), x.dtype)),
])
def test_numpy_errors_are_unchanged(call, rand):
    a, b = rand((4, 5), seed=1, order="C"), rand((4, 5), seed=2, order="C")
    fast = _error_of(lambda: call(a, b))
    slow = _general(lambda: _error_of(lambda: call(a, b)))
    assert fast == slow


# ---------------------------------------------------------------- blasx.gemm

@pytest.mark.parametrize("dtype", BLAS)
def test_gemm_fast_path(dtype, rand, rel_err, tol, monkeypatch):
    fn = S.get_blas_funcs("gemm", dtype=dtype)
    for ta, tb, la, lb, alpha in itertools.product((0, 1, 2), (0, 1, 2), "CFS", "CF", (1.5, 2, -0.5)):
        a = rand((9, 7) if ta == 0 else (7, 9), dtype, seed=1, order="F")
        b = rand((7, 5) if tb == 0 else (5, 7), dtype, seed=2, order="F")
        a = np.ascontiguousarray(a) if la == "C" else a
        a = rand((20, 20), dtype, seed=3, order="C")[:a.shape[0] * 2:2, 1:a.shape[1] + 1] if la == "S" else a
        b = np.ascontiguousarray(b) if lb == "C" else b
        ref = fn(alpha, a, b, trans_a=ta, trans_b=tb)
        with monkeypatch.context() as mp:
            _general_fails(mp)
            got = blasx.gemm(alpha, a, b, trans_a=ta, trans_b=tb)
        assert got.dtype == ref.dtype and got.shape == ref.shape and got.flags.f_contiguous
        _rel_ok(rel_err, tol, got, ref)
    factor = 8 if np.dtype(dtype).kind == "c" else 2
    assert blasx.last_profile().totals()["flops"] == factor * 9 * 7 * 5


def test_gemm_edge_cases(rand):
    """alpha 0, k == 0 and empty results: the general path (alpha 0: C = beta C, reading neither a
    nor b, as BLAS says; some OpenBLAS builds' ?gemm read them: never handed one), BLAS's quick return."""
    a, b = rand((6, 4), seed=1), rand((4, 5), seed=2)
    a[0, 0] = np.nan
    assert np.all(blasx.gemm(0.0, a, b) == 0)
    assert blasx.gemm(1.0, np.ones((6, 0)), np.ones((0, 5))).tolist() == np.zeros((6, 5)).tolist()
    assert blasx.gemm(1.0, np.ones((0, 3)), np.ones((3, 5))).shape == (0, 5)


def test_gemm_errors_are_unchanged(rand):
    a, b = rand((6, 4), seed=1), rand((5, 3), seed=2)
    for call in (lambda: blasx.gemm(1.0, a, b), lambda: blasx.gemm(1.0, a, b, trans_a=3),
                 lambda: blasx.gemm(1.0, a, a, trans_a=True), lambda: blasx.gemm(1.0, a[0], b),
                 lambda: blasx.gemm(1.0, a, b.astype(np.float32))):
        assert _error_of(call) == _general(lambda: _error_of(call))


# ---------------------------------------------------------------- the scipy-signature level 3

def _ops(prefix, routine, rand, order):
    """Plain (args, kwargs) calls for prefix + routine, every flag value blasx allows."""
    dt = DT[prefix]
    m, n, k = 9, 7, 5
    a_sq = {0: rand((m, m), dt, seed=1, order=order), 1: rand((n, n), dt, seed=1, order=order)}
    b = rand((m, n), dt, seed=2, order=order)
    if routine == "gemm":
        for ta, tb in itertools.product((0, 1, 2), (0, 1, 2)):
            x = rand((m, k) if ta == 0 else (k, m), dt, seed=3, order=order)
            y = rand((k, n) if tb == 0 else (n, k), dt, seed=4, order=order)
            yield (1.5, x, y), {"trans_a": ta, "trans_b": tb}
    elif routine in ("symm", "hemm"):
        for side, lower in itertools.product((0, 1), (0, 1)):
            yield (1.5, a_sq[side], b), {"side": side, "lower": lower}
    elif routine in ("syrk", "herk", "syr2k", "her2k"):
        trans = (0, 2) if routine.startswith("her") else ((0, 1) if prefix in "cz" else (0, 1, 2))
        for t, lower in itertools.product(trans, (0, 1)):
            x = rand((n, k) if t == 0 else (k, n), dt, seed=3, order=order)
            args = (1.5, x) if routine in ("syrk", "herk") else (1.5, x, rand(x.shape, dt, seed=4, order=order))
            yield args, {"trans": t, "lower": lower}
    else:
        for side, lower, ta, diag in itertools.product((0, 1), (0, 1), (0, 1, 2), (0, 1)):
            a = a_sq[side] + (4 * np.eye(a_sq[side].shape[0], dtype=dt) if routine == "trsm" else 0)
            yield (1.5, np.asarray(a, order=order), b), {"side": side, "lower": lower, "trans_a": ta, "diag": diag}


# blasx.linalg.blas's functions, blasx's prefixed ones (there is no blasx.dgemm: blasx.gemm is generic)
# and blasx's generic ones (blasx.syrk ...) on arrays of the prefix's dtype
CASES = [(m, p, r) for r, ps in B.LEVEL3.items() for p in ps for m in ("linalg", "blasx", "generic")
         if not (m == "blasx" and r == "gemm")]


@pytest.mark.parametrize("module, prefix, routine", CASES)
def test_level3_fast_path(module, prefix, routine, rand, rel_err, tol, monkeypatch):
    fn = {"linalg": lambda: getattr(B, prefix + routine), "blasx": lambda: getattr(blasx, prefix + routine),
          "generic": lambda: getattr(blasx, routine)}[module]()
    sp = S.get_blas_funcs(routine, dtype=DT[prefix])
    calls = [(args, kw, order) for order in "FC" for args, kw in _ops(prefix, routine, rand, order)]
    slow = _general(lambda: [fn(*args, **kw) for args, kw, _ in calls])
    with monkeypatch.context() as mp:
        _general_fails(mp)
        for (args, kw, order), ref_slow in zip(calls, slow):
            ref = sp(*args, **kw)
            got = fn(*args, **kw)
            assert got.dtype == ref.dtype and got.shape == ref.shape and got.flags.f_contiguous
            np.testing.assert_array_equal(got, ref)  # it is scipy's own routine
            _rel_ok(rel_err, tol, got, ref_slow)     # and what the engine computes
            assert blasx.last_profile().totals()["flops"] > 0


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
])
def test_level3_errors_are_unchanged(call):
    fast = _error_of(call)
    assert fast == _general(lambda: _error_of(call))
    assert fast[0] in (ValueError, TypeError)


def test_generic_level3_keeps_its_dtype_rules(rand, rel_err, tol):
    """blasx.syrk & co. pick the dtype from all the arrays: mixed ones take the general path."""
    a32, b64 = rand((6, 4), np.float32, seed=1), rand((6, 4), np.float64, seed=2)
    got = blasx.syr2k(1.0, a32, b64)
    assert got.dtype == np.float64
    ref = a32.astype(np.float64) @ b64.T + b64 @ a32.astype(np.float64).T
    _rel_ok(rel_err, tol, np.triu(got), np.triu(ref))
    assert blasx.herk(1.0, b64).dtype == np.complex128  # a real a for herk: the complex type
    assert blasx.symm(1.0, rand((4, 4), np.float32), b64[:4]).dtype == np.float64


def test_level3_calls_the_lanes_cannot_take_run_the_general_path(rand):
    """A complex alpha (Python's or numpy's) for a real routine, bool flags, subclasses, complex
    arrays for a real routine, an output that may alias an input (it raises there, before the
    engine): blasx's general path, as before."""
    a, b = rand((6, 6), seed=1), rand((6, 4), seed=2)
    c = rand((6, 6), seed=3)
    ran = []
    real = blas3.submit_planned
    mp = pytest.MonkeyPatch()
    mp.setattr(blas3, "submit_planned", lambda *x: (ran.append(x[0]), real(*x)))
    try:
        blasx.dsyrk(np.complex128(1.0), a)
        blasx.dsyrk(1.0 + 0j, a)
        blasx.dsyrk(1.0, a, lower=True)
        blasx.dsymm(1.0, a, b, side=False)
        blasx.dsyrk(1.0, a.view(np.matrix))
        with pytest.warns(np.exceptions.ComplexWarning):
            blasx.dsyrk(1.0, a + 0.5j)
        with pytest.raises(ValueError, match="shares memory with a"):  # c is a, seen through a view
            blasx.dsyrk(1.0, a, 0.5, a[:, :], overwrite_c=1)
        blasx.syr2k(1.0, a.astype(np.float32), a)  # the generic ones: no conversion (their dtype rules)
    finally:
        mp.undo()
    assert ran == ["dsyrk", "dsyrk", "dsyrk", "dsymm", "dsyrk", "dsyrk", "syr2k"]


# ---------------------------------------------------------------- the second lanes (c, beta, out=, ...)

def _host_general(fn):
    """fn() on blasx's general path on this very engine (the CPU alone, no fixed tile), which is
    what these calls ran before the second lanes: the fast paths read session.host_device, and
    engine() publishes it again once the general path has started it."""
    session.host_device = None
    try:
        return fn()
    finally:
        blasx.engine()


def _same(got, ref, rel_err, tol):
    """Same type, dtype, shape, memory order and NaN pattern; the numbers equal within the dtype's tolerance."""
    assert type(got) is type(ref)
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert (got.flags.f_contiguous, got.flags.c_contiguous) == (ref.flags.f_contiguous, ref.flags.c_contiguous)
    nan = np.isnan(got)
    np.testing.assert_array_equal(nan, np.isnan(ref))
    assert rel_err(np.where(nan, 0, got), np.where(nan, 0, ref)) < 50 * tol(got.dtype)


OTHER_PRECISION = {"s": "d", "d": "s", "c": "z", "z": "c"}
# Scalars of the lanes' calls: "cplx" is a complex value where the routine takes one (else the real one)
COMPLEX_ALPHA = {"alpha": 1.5 - 0.5j, "beta": 0.5 + 0.25j}
REAL_ONLY = {"alpha": ("herk",), "beta": ("herk", "her2k")}

# The calls with c (every routine but trmm/trsm): label, alpha, beta, c (None, "rand", "nan",
# "other": random of the other precision), overwrite_c, NaN in a and b, arrays of the other
# precision (converted: not for the generic functions), every argument positional, compared
# with scipy (not where blasx deliberately differs)
C_CALLS = [
    dict(label="c, positional", alpha=1.5, beta=0.5, c="rand", positional=True),
    dict(label="c, complex scalars", alpha="cplx", beta="cplx", c="rand", complex_only=True),
    dict(label="beta 0: c is not read", alpha=1.5, beta=0.0, c="nan"),
    dict(label="alpha 0: a, b are not read", alpha=0.0, beta=0.5, c="rand", nan_inputs=True),
    dict(label="alpha 0, beta 1: c as it is", alpha=0.0, beta=1.0, c="rand", nan_inputs=True),
    dict(label="overwrite_c", alpha=1.5, beta=0.5, c="rand", overwrite=1),
    dict(label="overwrite_c, beta 0", alpha=1.5, beta=0.0, c="nan", overwrite=True),
    dict(label="int scalars, overwrite 0", alpha=2, beta=1, c="rand", overwrite=0),
    dict(label="beta without c is ignored", alpha=1.5, beta=float("nan"), c=None, scipy=False),
    dict(label="alpha 0 without c", alpha=0.0, beta=0.5, c=None, nan_inputs=True),
    dict(label="converted arrays", alpha=1.5, beta=0.5, c="other", other=True, overwrite=1),
    dict(label="converted c only", alpha=1.5, beta=0.5, c="other", overwrite=1),
]
B_CALLS = [  # trmm / trsm: b is the output
    dict(label="positional", alpha=1.5, positional=True),
    dict(label="overwrite_b", alpha=1.5, overwrite=1),
    dict(label="complex alpha, overwrite_b", alpha="cplx", overwrite=True, complex_only=True),
    dict(label="alpha 0: a, b are not read", alpha=0.0, nan_inputs=True),
    dict(label="alpha 0, overwrite_b", alpha=0, nan_inputs=True, overwrite=1),
    dict(label="converted arrays", alpha=1.5, other=True, overwrite=1),
]


def _scalar(name, value, routine, dtype):
    if value != "cplx":
        return value
    return COMPLEX_ALPHA[name] if routine not in REAL_ONLY[name] else COMPLEX_ALPHA[name].real


def _lane_call(prefix, routine, order, flags, spec, rand):
    """(args, kwargs, output) of one call, fresh arrays each time (the same values): the output is
    the array the call may write in place (c, or b for trmm/trsm), None without c."""
    dt = DT[prefix]
    src = DT[OTHER_PRECISION[prefix]] if spec.get("other") else dt
    m, n, k = 7, 5, 4

    def arr(shape, seed, dtype=src):
        x = rand(shape, dtype, seed=seed, order=order)
        if spec.get("nan_inputs"):
            x[1, 0] = np.nan
        return x

    if routine == "gemm":
        ops = [arr((k, m) if flags["trans_a"] else (m, k), 1), arr((n, k) if flags["trans_b"] else (k, n), 2)]
        c_shape = (m, n)
    elif routine in ("symm", "hemm", "trmm", "trsm"):
        s = n if flags["side"] else m
        a = arr((s, s), 1)
        if routine == "trsm":
            a = np.asarray(a + 4 * np.eye(s, dtype=src), order=order)
        ops, c_shape = [a, arr((m, n), 2)], (m, n)
    else:
        shape = (k, n) if flags["trans"] else (n, k)
        ops = [arr(shape, 1)] + ([arr(shape, 2)] if routine in ("syr2k", "her2k") else [])
        c_shape = (n, n)
    alpha = _scalar("alpha", spec["alpha"], routine, dt)
    if routine in ("trmm", "trsm"):
        out, named = ops[1], {"overwrite_b": spec.get("overwrite", 0)}
        head = [alpha, *ops]
    else:
        c = spec.get("c")
        c = None if c is None else rand(c_shape, DT[OTHER_PRECISION[prefix]] if c == "other" else dt, seed=3,
                                        order=order)
        if spec.get("c") == "nan":
            c[...] = np.nan
        out = c
        head = [alpha, *ops, _scalar("beta", spec["beta"], routine, dt), c]
        named = {"overwrite_c": spec.get("overwrite", 0)}
    if spec.get("positional"):
        return head + list(flags.values()) + list(named.values()), {}, out
    if routine not in ("trmm", "trsm"):  # beta and c by keyword
        named.update(beta=head.pop(-2), c=head.pop(-1))
    return head, {**flags, **named}, out


def _lane_cases(prefix, routine, convert):
    """(spec, flags): every call of C_CALLS / B_CALLS that applies, each with the next combination
    of the flags blasx allows (so that the calls go through all of them)."""
    cplx = prefix in "cz"
    names = hostpath.FLAG_ORDER[routine]
    allowed = hostpath.FAST_FLAGS[routine][cplx]
    combos = list(itertools.product(*(sorted(allowed[x]) for x in names)))
    specs = B_CALLS if routine in ("trmm", "trsm") else C_CALLS
    specs = [s for s in specs if (cplx or not s.get("complex_only")) and (convert or not s.get("other")
                                                                           and s.get("c") != "other")]
    return [(s, dict(zip(names, combos[i % len(combos)]))) for i, s in enumerate(specs)]


def _no_blas_form(module, prefix, routine, order, spec, flags) -> bool:
    """The general path: blasx.gemm writes a C-ordered c in place through c.T, which complex op C
    has no BLAS form for; a gemm with alpha 0 is never handed to the host's ?gemm (some OpenBLAS
    builds read a and b then)."""
    if routine == "gemm" and spec.get("alpha", 1) == 0:
        return True
    return (module == "generic" and routine == "gemm" and prefix in "cz" and order == "C"
            and bool(spec.get("overwrite")) and spec.get("c") and 2 in flags.values())


def _untouched(routine, flags):
    """Mask of the part of c that a rank-k routine does not write (the other triangle), or None."""
    if routine not in ("syrk", "herk", "syr2k", "her2k"):
        return None
    n = 5
    return np.triu(np.ones((n, n), bool), 1) if flags["lower"] else np.tril(np.ones((n, n), bool), -1)


@pytest.mark.parametrize("module, prefix, routine", CASES)
def test_level3_second_lane(module, prefix, routine, rand, rel_err, tol, monkeypatch, gemm_alpha0_reads):
    """c, beta, overwrite_*, alpha 0, complex scalars, conversions: scipy's routine, with blasx's
    results (the general path's, scipy's where they agree), outputs, untouched triangles, NaN
    rules and profiles, for C- and F-ordered operands."""
    fn = {"linalg": lambda: getattr(B, prefix + routine), "blasx": lambda: getattr(blasx, prefix + routine),
          "generic": lambda: getattr(blasx, routine)}[module]()
    sp = S.get_blas_funcs(routine, dtype=DT[prefix])
    for order, (spec, flags) in itertools.product("FC", _lane_cases(prefix, routine, module != "generic")):
        what = f"{spec['label']}, {order}, {flags}"

        def call(runner=lambda f: f()):
            args, kw, out = _lane_call(prefix, routine, order, flags, spec, rand)
            return runner(lambda: fn(*args, **kw)), out

        with monkeypatch.context() as mp:
            if not _no_blas_form(module, prefix, routine, order, spec, flags):
                _general_fails(mp)
            got, out = call()
        prof = blasx.last_profile().totals()
        ref, ref_out = call(_host_general)
        assert (got is out) == (ref is ref_out), what  # written in place exactly when blasx does
        _same(got, ref, rel_err, tol)
        if out is not None and got is not out:  # not written
            np.testing.assert_array_equal(out, _lane_call(prefix, routine, order, flags, spec, rand)[2], what)
        scipy_blas = not (routine == "gemm" and spec["alpha"] == 0 and gemm_alpha0_reads(DT[prefix]))
        if spec.get("scipy", True) and scipy_blas:  # (scipy's ?gemm reading a, b at alpha 0: not BLAS's)
            args, kw, _ = _lane_call(prefix, routine, order, flags, spec, rand)
            want = sp(*args, **kw)
            if module == "generic" and routine == "gemm":  # blasx.gemm: c.T may be written (C^T = B^T A^T)
                _same(got if got.flags.f_contiguous else np.asfortranarray(got), want, rel_err, tol)
            else:
                np.testing.assert_array_equal(got, want, what)  # it is scipy's routine
        if spec["alpha"] != 0 or spec.get("beta") not in (1, 1.0):  # (the general path's quick return records nothing)
            assert prof["tasks"] == 1 and prof["flops"] == blasx.last_profile().totals()["flops"], what
        mask = _untouched(routine, flags)
        c0 = _lane_call(prefix, routine, order, flags, spec, rand)[2]
        if mask is not None:  # the other triangle: c's (zeros without c), all the rest written and finite
            np.testing.assert_array_equal(got[mask], 0 if c0 is None else c0[mask].astype(got.dtype), what)
            assert np.isfinite(got[~mask]).all(), what
        else:
            assert np.isfinite(got).all(), what


def test_level3_second_lane_is_taken(rand, monkeypatch):
    """Each kind of call above takes the lane (the general path made to fail), and a read-only c
    with overwrite_c gets a new array (scipy would write into it)."""
    a, c = rand((6, 4), seed=1), rand((6, 6), seed=2)
    ro = c.copy(order="F")
    ro.flags.writeable = False
    ro0 = ro.copy()
    _general_fails(monkeypatch)
    monkeypatch.setattr(blas3, "_rank", lambda *x, **k: pytest.fail("blasx.dsyrk's general path ran"))
    for fn in (B.dsyrk, blasx.dsyrk, blasx.syrk):
        got = fn(1.0, a, 0.5, ro, overwrite_c=1)
        assert got is not ro and np.array_equal(ro, ro0)
        assert fn(0.0, a, beta=0.5, c=c) is not c
        assert fn(1.5, a, 1, c, 0, 1, True) is c
    assert B.dsyrk(1.0, a.astype(np.float32), 0.5, c.astype(np.float32), overwrite_c=1).dtype == np.float64


def test_level3_second_lane_aliases(rand, rel_err, tol):
    """An output written in place that shares memory with an input: blasx's error, as before; one
    whose bounds overlap an input's but whose elements do not: the general path's exact check
    finds them disjoint, and the call runs in place."""
    a = rand((6, 6), seed=1)
    for fn in (B.dsyrk, blasx.dsyrk, blasx.syrk):
        for c in (a, a[:, :]):
            err = _error_of(lambda: fn(1.0, a, 0.5, c, overwrite_c=1))
            assert err == _host_general(lambda: _error_of(lambda: fn(1.0, a, 0.5, c, overwrite_c=1)))
            assert err[0] is ValueError and "shares memory with a" in err[1]
    b = a[:, :4].copy(order="F")
    for fn in (B.dtrmm, blasx.dtrmm, blasx.trmm, B.dtrsm):
        err = _error_of(lambda: fn(1.0, b[:4, :4], b, side=1, overwrite_b=1))
        assert err == _host_general(lambda: _error_of(lambda: fn(1.0, b[:4, :4], b, side=1, overwrite_b=1)))
        assert "b: shares memory with a" in err[1]
    # c = buf[50:86] (F-ordered 6 x 6), a: buf[i + 90 j], around c's block but never in it
    buf = rand((460,), seed=3)
    c = buf[50:86].reshape(6, 6, order="F")
    x = np.lib.stride_tricks.as_strided(buf, (6, 4), (8, 720))
    assert np.may_share_memory(c, x) and not np.shares_memory(c, x)
    want = S.dsyrk(1.0, x, 0.5, c.copy(order="F"))
    assert B.dsyrk(1.0, x, 0.5, c, overwrite_c=1) is c
    _same(c, want, rel_err, tol)


def test_level3_second_lane_tells_binding_errors_from_its_own(rand, monkeypatch):
    """Arguments that do not bind to scipy's signature go to the general path (its message); a
    TypeError raised inside the lane (here by scipy's routine) is raised as it is."""
    def broken(*args, **kwargs):
        raise TypeError("from inside")
    monkeypatch.setattr(hostpath._sp, "get_blas_funcs", lambda *a, **k: broken)
    ran = []
    f = hostpath.with_host_path("d", "syrk", lambda *a, **k: ran.append(k) or "general")
    a, c = rand((6, 4), seed=1), rand((6, 6), seed=2)
    assert f(1.0, a, 0.5, c, bogus=1) == "general" and ran == [{"bogus": 1}]
    with pytest.raises(TypeError, match="from inside"):
        f(1.0, a, 0.5, c)
    assert len(ran) == 1


@pytest.mark.parametrize("call", [
    lambda a, c: B.dsyrk(1.0, a, 0.5, c[:5]),                     # c's shape
    lambda a, c: blasx.dsyrk(1.0, a, 0.5, c[0]),                   # a 1-D c
    lambda a, c: blasx.dsyrk(1.0, a, 0.5 + 1j, c),                 # complex beta for a real routine
    lambda a, c: blasx.zherk(1.0, a + 0j, 0.5 + 1j, c + 0j),       # complex beta for herk
    lambda a, c: blasx.zherk(1.0, a + 0j, 0.5, c + 0j, trans=1),   # zherk trans 1 (scipy: zeros)
    lambda a, c: blasx.dsyrk(1.0, a, "x", c),                      # beta not a number
    lambda a, c: B.dsyrk(1.0, a, 0.5, c, overwrite_c="yes"),       # overwrite_c not an int
    lambda a, c: B.dsymm(1.0, c, a, 0.5, c[:, :4], side=2),        # side 2
    lambda a, c: B.dsyr2k(1.0, a, c, 0.5, c),                      # b's shape
    lambda a, c: B.dtrmm(1.0, c, a, overwrite_b=1, diag=2),        # diag 2
    lambda a, c: B.dtrsm(1.0, c, a.T, 0, overwrite_b=1),           # a's shape
    lambda a, c: B.dgemm(1.0, a, a, 0.5, c),                       # inner dimensions
    lambda a, c: B.dgemm(1.0, a, a.T, 0.5, c, overwrite_c=1, bogus=1),
    lambda a, c: B.zsyrk(1.0, a + 0j, 0.5, c + 0j, trans=2),       # zsyrk trans 2
])
def test_level3_second_lane_errors_are_unchanged(call, rand):
    a, c = rand((6, 4), seed=1), rand((6, 6), seed=2)
    fast = _error_of(lambda: call(a, c))
    assert fast == _host_general(lambda: _error_of(lambda: call(a, c)))
    assert fast == _general(lambda: _error_of(lambda: call(a, c)))
    assert fast[0] in (ValueError, TypeError)


@pytest.mark.parametrize("dtype", BLAS)
def test_gemm_with_c(dtype, rand, rel_err, tol, monkeypatch, gemm_alpha0_reads):
    """blasx.gemm with c, beta, overwrite_c, alpha 0, complex scalars: scipy's ?gemm, with blasx's
    outputs (c written in place whatever its layout: a C-ordered c through c.T) and results."""
    fn = S.get_blas_funcs("gemm", dtype=dtype)
    cplx = np.dtype(dtype).kind == "c"
    alphas, betas = ((1.5 - 0.5j, 0.5 + 0.25j) if cplx else (1.5, 0.5)), ((1.5, 0.0), (0.0, 0.5))
    for i, (ta, tb, la, lc, ow) in enumerate(itertools.product((0, 1, 2), (0, 1, 2), "CF", "CF", (0, True))):
        alpha, beta = (alphas, *betas)[i % 3]

        def args():
            a = rand((9, 7) if ta == 0 else (7, 9), dtype, seed=1, order=la)
            b = rand((7, 5) if tb == 0 else (5, 7), dtype, seed=2, order=la)
            c = rand((9, 5), dtype, seed=3, order=lc)
            if beta == 0:
                c[...] = np.nan
            if alpha == 0:
                a[0, 0] = b[0, 0] = np.nan
            return a, b, c

        a, b, c = args()
        # (no BLAS form of that product into c.T; alpha 0 is never handed to the host's ?gemm)
        slow = (cplx and ow and lc == "C" and 2 in (ta, tb)) or alpha == 0
        with monkeypatch.context() as mp:
            if not slow:
                _general_fails(mp)
            got = blasx.gemm(alpha, a, b, beta, c, ta, tb, ow)
        prof = blasx.last_profile().totals()
        ga, gb, gc = args()
        ref = _host_general(lambda: blasx.gemm(alpha, ga, gb, beta, gc, ta, tb, ow))
        assert (got is c) == (ref is gc) == bool(ow)
        _same(got, ref, rel_err, tol)
        assert prof == blasx.last_profile().totals()
        sa, sb, sc = args()
        if not (alpha == 0 and gemm_alpha0_reads(dtype)):  # (scipy's ?gemm reading a, b at alpha 0: not BLAS's)
            _same(np.asfortranarray(got), fn(alpha, sa, sb, beta, sc, ta, tb), rel_err, tol)
        assert np.isfinite(got).all()
        if not ow:
            np.testing.assert_array_equal(c, args()[2])  # c not written


def test_gemm_with_c_errors_and_aliases(rand):
    """Bad arguments and a c that shares memory with a (blasx checks it even when it copies c):
    the errors of before."""
    a, b, c = rand((6, 4), seed=1), rand((4, 6), seed=2), rand((6, 6), seed=3)
    for call in (lambda: blasx.gemm(1.0, a, b, 0.5, c[:5]), lambda: blasx.gemm(1.0, a, b, "x", c),
                 lambda: blasx.gemm(1.0, a, b, 0.5 + 1j, c),
                 lambda: blasx.gemm(1.0, a, b, 0.5, c[0]), lambda: blasx.gemm(1.0, c[:, :4], b, 0.5, c),
                 lambda: blasx.gemm(1.0, c[:, :4], b, 0.5, c, overwrite_c=True),
                 lambda: blasx.gemm(1.0, a, c[:4], 0.5, c, overwrite_c=True),
                 lambda: blasx.gemm(1.0, a, b, 0.5, c.T, overwrite_c=True, trans_b=3)):
        fast = _error_of(call)
        assert fast == _host_general(lambda: _error_of(call))
        assert fast[0] in (ValueError, TypeError)
    assert "c: shares memory with a" in _error_of(lambda: blasx.gemm(1.0, c[:, :4], b, 0.5, c))[1]


@pytest.mark.parametrize("dtype", BLAS)
@pytest.mark.parametrize("sa, sb", [((9, 6), (6, 5)), ((6,), (6, 5)), ((9, 6), (6,)), ((3, 9, 6), (6, 5)),
                                    ((2, 1, 9, 6), (3, 6, 5))])
def test_matmul_out_and_keywords(dtype, sa, sb, rand, rel_err, tol, monkeypatch):
    """matmul with out= (C- and F-ordered, poisoned with NaN; one that is an operand), dtype=,
    casting=: numpy's own matmul, with blasx's results and the same out returned."""
    other = {np.float32: np.float64, np.float64: np.float32, np.complex64: np.complex128,
             np.complex128: np.complex64}[dtype]
    x1, x2 = rand(sa, dtype, seed=1, order="C"), rand(sb, dtype, seed=2, order="F")
    shape = np.matmul(x1, x2).shape
    for out_order, kw in itertools.product(("none", "C", "F"), ({}, {"dtype": dtype}, {"dtype": np.dtype(other).name},
                                                                   {"casting": "no"}, {"casting": "unsafe", "dtype": other})):
        ct = np.dtype(kw.get("dtype") or dtype)

        def out():
            return None if out_order == "none" else np.full(shape, np.nan, ct, order=out_order)

        o = out()
        with monkeypatch.context() as mp:
            _general_fails(mp)
            got = blasx.matmul(x1, x2, out=o, **kw)
        g = out()
        ref = _host_general(lambda: blasx.matmul(x1, x2, out=g, **kw))
        assert (got is o) == (ref is g) == (o is not None)
        _same(got, ref, rel_err, tol)
        _same(got, np.matmul(x1, x2, out=out(), **kw), rel_err, tol)
        assert blasx.last_profile().totals()["flops"] > 0
    sq = rand((6, 6), dtype, seed=3, order="C")
    want = np.matmul(sq, sq)
    with monkeypatch.context() as mp:
        _general_fails(mp)
        assert blasx.matmul(sq, sq.copy(), out=sq) is sq  # out is an operand: numpy copies it first
    _same(sq, want, rel_err, tol)


@pytest.mark.parametrize("call", [
    lambda a, o: blasx.matmul(a, a.T, out=o[:3]),                     # out's shape
    lambda a, o: blasx.matmul(a, a.T, out=o.astype(np.int64)),        # out's dtype (numpy's casting error)
    lambda a, o: blasx.matmul(a, a.T, out=_readonly(o)),
    lambda a, o: blasx.matmul(a, a.T, dtype=np.float32, casting="no"),
    lambda a, o: blasx.matmul(a, a.T, casting="bogus"),
    lambda a, o: blasx.matmul(a, a, out=o),                           # core dimensions
    lambda a, o: blasx.matmul(a + 1j, a.T, dtype=np.float64),          # complex to real under same_kind
])
def test_matmul_out_errors_are_unchanged(call, rand):
    a, o = rand((4, 5), seed=1, order="C"), np.empty((4, 4))
    fast = _error_of(lambda: call(a, o))
    assert fast == _host_general(lambda: _error_of(lambda: call(a, o)))


def _readonly(x):
    x = x.copy()
    x.flags.writeable = False
    return x


# ---------------------------------------------------------------- profiles and threads

def test_profile_without_trace(rand):
    blasx.configure(devices="cpu", trace=False)
    blasx.engine()
    a = rand((8, 8), order="C")
    blasx.matmul(a, a)
    p = blasx.last_profile()
    assert p.totals()["tasks"] == 1 and p.totals()["flops"] == 2 * 8 ** 3
    assert blasx.last_profile() is p  # made once


def test_threads_keep_their_own_profiles(rand, rel_err, tol):
    errors = []

    def work(i):
        try:
            n = 8 + i
            a, b = rand((n, n), seed=i, order="C"), rand((n, n), seed=i + 100, order="F")
            for _ in range(200):
                got = blasx.matmul(a, b)
                assert rel_err(got, np.matmul(a, b)) < 1e-12
                assert blasx.last_profile().totals()["flops"] == 2 * n ** 3
                got = B.dgemm(1.0, a, b)
                assert rel_err(got, S.dgemm(1.0, a, b)) < 1e-12
                assert blasx.last_profile().totals()["flops"] == 2 * n ** 3
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


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
    fetched = iter([old])
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


# ---------------------------------------------------------------- the benchmark

def test_bench_cpu_overhead_runs(capsys):
    bench = importlib.import_module("bench.cpu_overhead")
    assert bench.main(["--sizes", "8", "--dtypes", "d,c", "--rounds", "2", "--target-ms", "0.2"]) == 0
    out = capsys.readouterr().out
    for what in ("matmul", "tensordot", "gemm-C", "linalg-trsm", "linalg-her2k", "ovh best", "gemm-c", "gemm-ow",
                 "matmul-out", "dot-out", "matmul-dtype", "linalg-syrk-ow", "linalg-her2k-conv", "linalg-trsm-a0", "blasx-trmm-ow",
                 "blasx-hemm-c", "matmul-sub", "matmul-strided", "matmul-list", "dot-list", "gemm-np",
                 "linalg-gemm-list", "blasx-syrk-np", "noise", "verdict", "# slower than the peer by more than its noise"):
        assert what in out, what
    assert "WRONG" not in out


def test_bench_cpu_overhead_noise_verdict():
    """The noise column: the peer timed twice in each round (the six orders in turn), and the verdict."""
    bench = importlib.import_module("bench.cpu_overhead")
    assert sorted(bench.ORDERS) == sorted(itertools.permutations(range(3)))
    assert [bench.verdict_of(p, 0.1) for p in (0.05, 0.1, 0.2, -0.05, -0.2)] == [
        "noise", "noise", "SLOWER", "noise", "faster"]
    calls = []
    r = bench.compare(lambda: calls.append("o"), lambda: calls.append("p"), rounds=6, target_s=1e-5)
    assert {"noise", "paired"} <= set(r) and r["noise"] >= 0
    assert calls.count("p") == 10 + 2 * calls.count("o")  # (10: the calibration) the peer timed twice a round
    assert "noise" not in bench.compare(lambda: None, lambda: None, rounds=2, target_s=1e-5, noise=False)


@pytest.mark.parametrize("entry", ["blasx.gemm", "linalg.dgemm"])
def test_gemm_with_alpha_zero_never_reaches_the_host_gemm(rand, entry):
    """An alpha-0 gemm in every form the fast paths take (plain, with c and beta, keywords, C-ordered
    operands, in place): C = beta C, no NaN of a or b in it (test_hostcall checks that the host's ?gemm
    is never called: some OpenBLAS builds multiply a NaN by the 0)."""
    fn = {"blasx.gemm": blasx.gemm, "linalg.dgemm": B.dgemm}[entry]
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
