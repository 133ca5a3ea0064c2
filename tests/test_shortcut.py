"""blasx.shortcut: plain calls on the CPU alone give scipy's result, the same output array, and a host record."""

import numpy as np
import pytest
import scipy.linalg.blas as sp

import blasx
from blasx import dispatch, shortcut
from blasx.linalg import blas as B

DT = {"s": np.float32, "d": np.float64, "c": np.complex64, "z": np.complex128}


@pytest.fixture(autouse=True)
def _cpu():
    blasx.configure(devices="cpu")
    dispatch.host_device()  # starts the engine: a shortcut finds no engine before that
    yield
    blasx.shutdown()


def _args(routine, dt, rng, c_order=False):
    def m(r, c):
        x = rng.uniform(-1, 1, (r, c)) + (1j * rng.uniform(-1, 1, (r, c)) if np.dtype(dt).kind == "c" else 0)
        return np.asarray(x, dt, order="C" if c_order else "F")
    if routine in ("trmm", "trsm"):
        return (1.5, m(5, 5) + 5 * np.eye(5, dtype=dt), m(5, 4)), {"side": 0, "lower": 1, "trans_a": 1, "diag": 0}
    if routine in ("syrk", "herk"):
        return (1.5, m(5, 3)), {"beta": 0.5, "c": m(5, 5), "trans": 0, "lower": 1}
    if routine in ("syr2k", "her2k"):
        return (1.5, m(5, 3), m(5, 3)), {"beta": 0.5, "c": m(5, 5), "lower": 0}
    if routine in ("symm", "hemm"):
        return (1.5, m(4, 4), m(4, 3)), {"beta": 0.5, "c": m(4, 3), "side": 0, "lower": 1}
    return (1.5, m(4, 6), m(6, 3)), {"beta": 0.5, "c": m(4, 3)}


ROUTINES = [(p, r) for r, ps in B.LEVEL3.items() for p in ps]


@pytest.mark.parametrize("prefix,routine", ROUTINES)
@pytest.mark.parametrize("overwrite", [0, 1])
@pytest.mark.parametrize("entry", ["linalg", "blasx"])
def test_plain_call_is_scipys_call(prefix, routine, overwrite, entry, rel_err):
    rng = np.random.default_rng(1)
    args, kw = _args(routine, DT[prefix], rng)
    out = "b" if routine in ("trmm", "trsm") else "c"
    kw["overwrite_" + out] = overwrite
    fn = getattr(B if entry == "linalg" else blasx, prefix + routine)
    want = getattr(sp, prefix + routine)(*[x.copy(order="F") if isinstance(x, np.ndarray) else x for x in args],
                                         **{k: v.copy(order="F") if isinstance(v, np.ndarray) else v for k, v in kw.items()})
    target = kw.get("c", args[-1])
    dispatch._tls.stats = None
    got = fn(*args, **kw)
    assert type(dispatch._tls.stats) is tuple  # a host record
    assert (got is target) == bool(overwrite)
    assert rel_err(got, want) < (1e-5 if prefix in "sc" else 1e-13)


def test_gemm_of_row_major_operands_transposes_them(rel_err):
    rng = np.random.default_rng(2)
    for dt in (np.float64, np.complex128):
        a, b = (np.asarray(rng.uniform(-1, 1, s), dt) for s in ((4, 6), (3, 6)))
        for ta, tb in ((0, 1), (1, 0), (2, 2)):
            x = a if ta == 0 else np.ascontiguousarray(a.T)
            y = b.T.copy() if tb == 0 else b
            res = shortcut.make("gemm", np.dtype(dt))(1.0, x, y, 0.0, None, ta, tb, 0)
            if ta == 2 and dt is np.complex128:
                assert res is shortcut.NO  # a conjugate of a row-major operand: the full path's
                continue
            assert rel_err(res, a @ b.T) < 1e-13


def test_non_plain_calls_take_the_full_path():
    d = np.dtype(np.float64)
    a = np.asfortranarray(np.ones((4, 4)))
    gemm = shortcut.make("gemm", d)
    for args in ((0.0, a, a), (1.0, a.astype(np.float32), a), (True, a, a), (1.0, a, a[:3]),
                 (1.0, a, a, 0.0, a, 0, 0, 1),  # c in place aliasing a: the full path raises
                 (1.0, a, a, 0.0, None, 3, 0, 0), (1.0, a, a, 0.0, None, 0, 0, 2), (1.0, a[::2], a[:2])):
        assert gemm(*args) is shortcut.NO
    with pytest.raises(ValueError, match="shares memory"):
        B.dgemm(1.0, a, a, 0.0, a, overwrite_c=1)
    blasx.shutdown()
    assert gemm(1.0, a, a) is shortcut.NO  # no engine yet: the full path starts it


def test_large_plain_gemm_releases_the_gil_only_when_threads_share_it(monkeypatch):
    """One calling thread: scipy's own routine through its wrapper; several threads calling large gemms: the
    same routine with the GIL let go (gilfree.py), so that their calls overlap."""
    import threading

    from blasx import gilfree
    calls = []
    real = gilfree.routine

    def spy(dtype):
        fn = real(dtype)
        return lambda *args: (calls.append(threading.get_ident()), fn(*args))[1]
    monkeypatch.setattr(gilfree, "routine", spy)
    monkeypatch.setattr(shortcut, "_callers", {})
    rng = np.random.default_rng(0)
    a, b = np.asfortranarray(rng.random((300, 260))), np.asfortranarray(rng.random((260, 280)))
    ref = a @ b
    c = blasx.dgemm(1.0, a, b)
    assert not calls and np.allclose(c, ref, rtol=1e-13)
    shortcut._callers[-1] = shortcut.clock()  # another thread's large gemm just now
    c = blasx.dgemm(1.0, a, b)
    assert calls == [threading.get_ident()] and np.allclose(c, ref, rtol=1e-13)
    shortcut._callers[-1] -= 2 * shortcut.SHARED_SECONDS  # long ago: it no longer counts
    calls.clear()
    blasx.dgemm(1.0, a, b)
    assert not calls and -1 not in shortcut._callers
