"""scipy's BLAS gemm called with the GIL let go (blasx/gilfree.py), and the plain-call shortcut's use of it
when several threads call large gemms: the same results as scipy's wrappers, bit for bit, with scipy's output
rules (c in place, a copy of c, a new array; beta 0 never reads c), and other threads running meanwhile."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import scipy.linalg.blas as sb

import blasx
from blasx import gilfree, shortcut

TYPES = [np.float32, np.float64, np.complex64, np.complex128]


def _f(rng, shape, dt):
    x = rng.standard_normal(shape)
    if np.dtype(dt).kind == "c":
        x = x + 1j * rng.standard_normal(shape)
    return np.asfortranarray(x.astype(dt))


@pytest.mark.parametrize("dt", TYPES)
@pytest.mark.parametrize("ta,tb", [(0, 0), (1, 0), (0, 1), (2, 1), (1, 2)])
def test_the_routine_is_scipys_bit_for_bit(dt, ta, tb):
    if np.dtype(dt).kind != "c" and 2 in (ta, tb):
        ta, tb = min(ta, 1), min(tb, 1)
    rng = np.random.default_rng(1)
    m, n, k = 37, 29, 41
    a = _f(rng, (m, k) if ta == 0 else (k, m), dt)
    b = _f(rng, (k, n) if tb == 0 else (n, k), dt)
    c = _f(rng, (m, n), dt)
    alpha, beta = (0.5 - 0.25j, 1.5 + 0.5j) if np.dtype(dt).kind == "c" else (0.5, 1.5)
    want = sb.get_blas_funcs("gemm", dtype=dt)(alpha, a, b, beta, c, ta, tb)
    got = c.copy(order="F")
    gilfree.routine(dt)(ta, tb, m, n, k, alpha, a, b, beta, got)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("dt", TYPES)
def test_the_shortcut_takes_it_when_threads_share_with_scipys_output_rules(dt, monkeypatch):
    blasx.gemm(1.0, np.eye(2, dtype=dt), np.eye(2, dtype=dt))  # the engine started: later calls take the shortcut
    calls = []
    monkeypatch.setattr(shortcut, "_shared", lambda now: calls.append(now) or True)  # (asked on that route only)
    monkeypatch.setattr(shortcut, "GIL_FREE_SIZE", 1)
    rng = np.random.default_rng(2)
    a, b, c = _f(rng, (40, 30), dt), _f(rng, (30, 20), dt), _f(rng, (40, 20), dt)
    g = sb.get_blas_funcs("gemm", dtype=dt)
    got = blasx.gemm(1.0, a, b)  # a new F-ordered array
    assert got.flags.f_contiguous and np.array_equal(got, g(1.0, a, b))
    keep = c.copy()
    got = blasx.gemm(2.0, a, b, 0.5, c)  # a copy of c, c untouched
    assert got is not c and np.array_equal(c, keep) and np.array_equal(got, g(2.0, a, b, 0.5, c))
    inplace = c.copy(order="F")
    got = blasx.gemm(2.0, a, b, 0.5, inplace, overwrite_c=True)  # c itself
    assert got is inplace and np.array_equal(got, g(2.0, a, b, 0.5, c))
    nan = np.full_like(c, np.nan)
    assert np.array_equal(blasx.gemm(1.0, a, b, 0.0, nan), g(1.0, a, b))  # beta 0: c never read
    cr = np.ascontiguousarray(a)  # row-major operands go as transposes
    assert np.array_equal(blasx.gemm(1.0, cr, b), g(1.0, a, b))
    assert len(calls) == 5


def test_other_threads_run_during_the_call():
    """While one thread is in a long gemm through the routine, another keeps running Python."""
    rng = np.random.default_rng(3)
    n = 1200
    a, b = _f(rng, (n, n), np.float64), _f(rng, (n, n), np.float64)
    c = np.zeros((n, n), order="F")
    fn = gilfree.routine(np.float64)
    started, done, count = threading.Event(), threading.Event(), [0]

    def work():
        started.set()
        for _ in range(3):
            fn(0, 0, n, n, n, 1.0, a, b, 0.0, c)
        done.set()
    t = threading.Thread(target=work)
    t.start()
    started.wait()
    while not done.is_set():
        count[0] += 1
    t.join()
    assert count[0] > 1000 and np.allclose(c, a @ b)


@pytest.mark.parametrize("dt", TYPES)
@pytest.mark.parametrize("ta,tb", [(0, 0), (1, 0), (0, 1), (2, 2)])
def test_blocks_of_larger_arrays_are_read_in_place(dt, ta, tb):
    """Operands that are blocks of larger arrays (a leading dimension, either order) go to the routine with
    their leading dimension, not copied; the results are scipy's on the same values. Operands with no unit
    stride take the full path, as before."""
    if np.dtype(dt).kind != "c" and 2 in (ta, tb):
        ta, tb = 1, 1
    rng = np.random.default_rng(4)
    m, n, k = 33, 27, 45
    big_c = np.ascontiguousarray(_f(rng, (100, 90), dt))
    big_f = _f(rng, (100, 90), dt)
    a = (big_c if ta != 2 else big_f)[3:3 + (m if ta == 0 else k), 5:5 + (k if ta == 0 else m)]
    b = big_f[7:7 + (k if tb == 0 else n), 2:2 + (n if tb == 0 else k)]
    assert not (a.flags.c_contiguous or a.flags.f_contiguous or b.flags.c_contiguous or b.flags.f_contiguous)
    c = _f(rng, (m, n), dt)
    g = sb.get_blas_funcs("gemm", dtype=dt)
    blasx.gemm(1.0, np.eye(2, dtype=dt), np.eye(2, dtype=dt))  # the engine started: the shortcut serves
    fast = blasx.level3._FAST[np.dtype(dt)]
    want = g(0.5, np.array(a, order="F"), np.array(b, order="F"), 2.0, c, ta, tb)
    assert fast(0.5, a, b, 2.0, c, ta, tb, 0) is not shortcut.NO
    got = blasx.gemm(0.5, a, b, 2.0, c, trans_a=ta, trans_b=tb)
    tol = 1e-5 if np.dtype(dt) in (np.float32, np.complex64) else 1e-13
    assert np.allclose(got, want, rtol=tol, atol=tol)
    every_other = big_f[:2 * m:2, :k]
    assert fast(1.0, every_other, b[:k, :n] if tb == 0 else b[:n, :k].T, 0.0, None, 0, 0, 0) is shortcut.NO
