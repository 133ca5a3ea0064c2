"""Correctness of blasx.gemm and blasx.matmul on simulated GPUs (and the CPU worker),
against numpy in float64 / complex128, by relative Frobenius-norm error."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blasx

T = 16  # tile of most tests
DTYPES = (np.float32, np.float64, np.complex64, np.complex128)
WIDE = {np.dtype(np.float32): np.float64, np.dtype(np.float64): np.float64,
        np.dtype(np.complex64): np.complex128, np.dtype(np.complex128): np.complex128}


def op(x, trans):
    x = np.asarray(x, dtype=WIDE[np.dtype(x.dtype)] if x.dtype in WIDE else np.float64)
    return (x, x.T, x.conj().T)[trans]


def stored_shape(rows, cols, trans):
    """Shape of the stored operand whose op(.) is rows x cols."""
    return (rows, cols) if trans == 0 else (cols, rows)


def reference(alpha, a, b, beta=0.0, c=None, trans_a=0, trans_b=0):
    r = alpha * (op(a, trans_a) @ op(b, trans_b))
    if c is not None and beta != 0:
        r = r + beta * np.asarray(c, dtype=np.complex128 if np.iscomplexobj(c) else np.float64)
    return r


def scalar(value, dtype):
    """The value as the computation sees it (alpha/beta are rounded to the dtype)."""
    return np.asarray(value, dtype=dtype)[()]


@pytest.fixture
def sim3():
    blasx.configure(devices="sim:3", tile=T)


# --------------------------------------------------------------------------- every op x dtype

SHAPES = [(1, 1, 1), (T - 1, T, T + 1), (T, T + 1, T - 1), (T + 1, T - 1, T), (37, 19, 5 * T + 3),
          (2, 3, 9 * T), (50, 33, 17)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product((0, 1, 2), repeat=2)))
def test_gemm_all_ops_dtypes_shapes(sim3, rand, rel_err, tol, trans_a, trans_b, dtype):
    complex_ = np.dtype(dtype).kind == "c"
    alpha = 0.75 - 0.5j if complex_ else -1.25
    for s, (m, n, k) in enumerate(SHAPES):
        for order_a, order_b in (("F", "F"), ("C", "C"), ("F", "C"), ("C", "F")):
            a = rand(stored_shape(m, k, trans_a), dtype, seed=s, order=order_a)
            b = rand(stored_shape(k, n, trans_b), dtype, seed=100 + s, order=order_b)
            out = blasx.gemm(alpha, a, b, trans_a=trans_a, trans_b=trans_b)
            assert out.shape == (m, n) and out.dtype == np.dtype(dtype)
            assert out.flags.f_contiguous
            ref = reference(scalar(alpha, dtype), a, b, trans_a=trans_a, trans_b=trans_b)
            err = rel_err(out, ref)
            assert err < tol(dtype), (m, n, k, order_a, order_b, err)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 2), (2, 1)])
def test_gemm_with_c_and_beta(sim3, rand, rel_err, tol, trans_a, trans_b, dtype):
    complex_ = np.dtype(dtype).kind == "c"
    alpha, beta = (0.5 + 1.5j, -2.0 + 0.25j) if complex_ else (1.5, -0.75)
    m, n, k = 2 * T + 3, T + 5, 3 * T - 1
    a = rand(stored_shape(m, k, trans_a), dtype, seed=1)
    b = rand(stored_shape(k, n, trans_b), dtype, seed=2)
    for order in ("F", "C"):
        c = rand((m, n), dtype, seed=3, order=order)
        ref = reference(scalar(alpha, dtype), a, b, scalar(beta, dtype), c, trans_a, trans_b)
        before = c.copy()
        out = blasx.gemm(alpha, a, b, beta, c, trans_a, trans_b, overwrite_c=False)
        assert out is not c and np.array_equal(c, before)  # c untouched
        assert rel_err(out, ref) < tol(dtype)
        out2 = blasx.gemm(alpha, a, b, beta, c, trans_a, trans_b, overwrite_c=True)
        assert out2 is c  # matching dtype: the result is c itself
        assert rel_err(c, ref) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("order", ["F", "C"])
def test_gemm_beta_zero_never_reads_c_and_writes_every_element(sim3, rand, rel_err, tol, dtype, order):
    m, n, k = 3 * T + 1, 2 * T - 3, T + 7
    a, b = rand((m, k), dtype, seed=4), rand((k, n), dtype, seed=5)
    c = np.full((m, n), np.nan, dtype=dtype, order=order)
    out = blasx.gemm(1.0, a, b, 0.0, c, overwrite_c=True)
    assert out is c
    assert np.isfinite(c).all()
    assert rel_err(c, reference(1.0, a, b)) < tol(dtype)
    # overwrite_c=False: a new array, also fully written, c still NaN
    c2 = np.full((m, n), np.nan, dtype=dtype, order=order)
    out = blasx.gemm(2.0, a, b, 0.0, c2)
    assert out is not c2 and np.isnan(c2).all() and np.isfinite(out).all()
    assert rel_err(out, reference(2.0, a, b)) < tol(dtype)


def test_gemm_overwrite_c_with_other_dtype_returns_new_array(sim3, rand, rel_err):
    a, b = rand((20, 30), np.float64, 1), rand((30, 10), np.float64, 2)
    c = rand((20, 10), np.float32, 3)
    before = c.copy()
    out = blasx.gemm(1.0, a, b, 1.0, c, overwrite_c=True)  # c is f32, a/b f64 -> f64
    assert out is not c and out.dtype == np.float64 and np.array_equal(c, before)
    assert rel_err(out, reference(1.0, a, b, 1.0, c)) < 1e-12


# --------------------------------------------------------------------------- layouts and views

def test_gemm_strided_and_reversed_views(sim3, rand, rel_err):
    base_a = rand((120, 150), np.float64, 6)
    base_b = rand((160, 90), np.complex128, 7, order="C")
    views_a = [base_a[::2, ::3], base_a[::-1, :50][:, ::-1], base_a[5:45, 7:57],
               base_a.T[10:60, 3:43], base_a[::-3, 1::2][:40, :50]]
    for va in views_a:
        m, k = va.shape
        vb_candidates = [base_b[:k, :30], base_b[::-1][:k, ::-2], base_b[1:2 * k:2, 3:40], base_b.T.T[:k, ::3]]
        for vb in vb_candidates:
            out = blasx.gemm(1.0, va, vb)  # f64 x c128 -> c128
            assert out.dtype == np.complex128
            assert rel_err(out, va @ vb) < 1e-12, (va.strides, vb.strides)


def test_gemm_into_strided_and_reversed_c(sim3, rand, rel_err):
    a, b = rand((40, 25), np.float64, 8), rand((25, 30), np.float64, 9)
    cases = [((80, 90), "F", lambda x: x[::2, ::3]),
             ((40, 30), "F", lambda x: x[::-1, ::-1]),
             ((50, 40), "C", lambda x: x[5:45, 4:34]),
             ((50, 40), "F", lambda x: x[5:45, 4:34]),
             ((30, 40), "F", lambda x: x.T[::-1])]
    for seed, (shape, order, sl) in enumerate(cases):
        parent = rand(shape, np.float64, 10 + seed, order=order)
        parent_before = parent.copy()
        c = sl(parent)
        assert c.shape == (40, 30)
        ref = reference(2.0, a, b, -1.0, c)
        out = blasx.gemm(2.0, a, b, -1.0, c, overwrite_c=True)
        assert out is c
        assert rel_err(c, ref) < 1e-12
        outside = np.ones(shape, dtype=bool)
        sl(outside)[...] = False
        assert np.array_equal(parent[outside], parent_before[outside])  # nothing outside c was written


# --------------------------------------------------------------------------- edge cases

@pytest.mark.parametrize("dtype", [np.float64, np.complex64])
def test_gemm_alpha_zero_reads_neither_a_nor_b(sim3, rand, rel_err, tol, dtype):
    a = np.full((30, 20), np.nan, dtype=dtype)
    b = np.full((20, 25), np.nan, dtype=dtype)
    c = rand((30, 25), dtype, 1)
    out = blasx.gemm(0.0, a, b, 3.0, c)
    assert rel_err(out, 3.0 * c.astype(np.complex128)) < tol(dtype)
    out = blasx.gemm(0.0, a, b)  # C = 0
    assert out.shape == (30, 25) and np.count_nonzero(out) == 0
    c2 = np.full((30, 25), np.nan, dtype=dtype)
    out = blasx.gemm(0, a, b, 0.0, c2, overwrite_c=True)
    assert out is c2 and np.count_nonzero(c2) == 0  # beta == 0: NaN in C is not read


def test_gemm_k_zero(sim3, rand, rel_err):
    a, b = np.empty((33, 0)), np.empty((0, 21))
    c = rand((33, 21), np.float64, 2)
    assert rel_err(blasx.gemm(1.0, a, b, -2.0, c), -2.0 * c) < 1e-15
    out = blasx.gemm(1.0, a, b)
    assert out.shape == (33, 21) and np.count_nonzero(out) == 0
    c2 = np.full((33, 21), np.nan)
    assert np.count_nonzero(blasx.gemm(1.0, a, b, 0.0, c2, overwrite_c=True)) == 0
    # with transposes
    out = blasx.gemm(1.0, np.empty((0, 33)), np.empty((21, 0)), 1.0, c, trans_a=1, trans_b=2)
    assert np.array_equal(out, c)


def test_gemm_empty_output(sim3):
    assert blasx.gemm(1.0, np.ones((0, 5)), np.ones((5, 7))).shape == (0, 7)
    assert blasx.gemm(1.0, np.ones((4, 5)), np.ones((5, 0))).shape == (4, 0)
    assert blasx.gemm(1.0, np.ones((5, 0)), np.ones((5, 3)), trans_a=1).shape == (0, 3)


def test_gemm_integer_and_half_inputs_promote_like_scipy(sim3, rel_err):
    rng = np.random.default_rng(3)
    ai = rng.integers(1, 9, size=(20, 30))
    bi = rng.integers(1, 9, size=(30, 18))
    out = blasx.gemm(1, ai, bi)
    assert out.dtype == np.float64 and np.array_equal(out, (ai @ bi).astype(np.float64))
    ah, bh = ai.astype(np.float16), bi.astype(np.float16)
    out = blasx.gemm(1, ah, bi.astype(np.float32))  # mixed with float16: scipy's float32
    assert out.dtype == np.float32 and rel_err(out, ai @ bi) < 1e-6
    # two float16 operands: float16 accumulated in float32 (blasx.precision); float32 on request
    out = blasx.gemm(1, ah, bh)
    assert out.dtype == np.float16 and rel_err(out, ai @ bi) < 2 ** -11
    out = blasx.gemm(1, ah, bh, out_dtype=np.float32)
    assert out.dtype == np.float32 and rel_err(out, ai @ bi) < 1e-6


def test_gemm_same_array_as_both_operands(sim3, rand, rel_err):
    a = rand((45, 45), np.complex128, 4)
    assert rel_err(blasx.gemm(1.0, a, a), a @ a) < 1e-12
    assert rel_err(blasx.gemm(1.0, a, a, trans_a=2), a.conj().T @ a) < 1e-12
    assert rel_err(blasx.gemm(1.0, a, a, trans_b=1), a @ a.T) < 1e-12


def test_gemm_numpy_scalars_for_alpha_beta(sim3, rand, rel_err):
    a, b, c = rand((20, 20), np.float32, 1), rand((20, 20), np.float32, 2), rand((20, 20), np.float32, 3)
    out = blasx.gemm(np.float64(2.0), a, b, np.int64(-1), c)
    assert out.dtype == np.float32 and rel_err(out, reference(2.0, a, b, -1.0, c)) < 1e-5
    out = blasx.gemm(1 + 0j, a, b)  # a complex scalar with no imaginary part is fine for real dtypes
    assert rel_err(out, reference(1.0, a, b)) < 1e-5


# --------------------------------------------------------------------------- property test

@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data(), tile=st.integers(4, 40), trans_a=st.sampled_from((0, 1, 2)),
       trans_b=st.sampled_from((0, 1, 2)), dtype=st.sampled_from(DTYPES),
       orders=st.sampled_from(("FF", "FC", "CF", "CC")), with_c=st.booleans())
def test_gemm_property(data, tile, trans_a, trans_b, dtype, orders, with_c, rand, rel_err, tol):
    cap = min(80, 10 * tile)  # at most ~1000 tile steps per example
    m, n, k = (data.draw(st.integers(1, cap), label=x) for x in "mnk")
    blasx.configure(devices="sim:3", tile=tile)
    a = rand(stored_shape(m, k, trans_a), dtype, seed=m * 7 + k, order=orders[0])
    b = rand(stored_shape(k, n, trans_b), dtype, seed=n * 11 + k, order=orders[1])
    alpha, beta = (1.5 - 0.5j, 0.5 + 2j) if np.dtype(dtype).kind == "c" else (1.5, 0.5)
    c = rand((m, n), dtype, seed=1) if with_c else None
    out = blasx.gemm(alpha, a, b, beta, c, trans_a, trans_b)
    ref = reference(scalar(alpha, dtype), a, b, scalar(beta, dtype) if with_c else 0.0, c, trans_a, trans_b)
    assert out.shape == (m, n) and out.dtype == np.dtype(dtype)
    assert rel_err(out, ref) < tol(dtype)


# --------------------------------------------------------------------------- matmul

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_matmul_1d_2d_combinations(sim3, rand, rel_err, tol, dtype):
    m, k, n = 2 * T + 1, 3 * T - 2, T + 3
    A, B = rand((m, k), dtype, 1), rand((k, n), dtype, 2, order="C")
    u, v = rand((k,), dtype, 3), rand((k,), dtype, 4)
    for x, y in ((A, B), (u, B), (A, v), (u, v), (A.T.T, B[:, ::2])):
        got = blasx.matmul(x, y)
        ref = np.matmul(x.astype(WIDE[np.dtype(dtype)]), y.astype(WIDE[np.dtype(dtype)]))
        assert np.shape(got) == np.shape(ref)
        assert np.asarray(got).dtype == np.dtype(dtype)
        assert rel_err(got, ref) < tol(dtype)


def test_matmul_out_and_dtype_rules(sim3, rand, rel_err):
    a, b = rand((30, 20), np.float32, 1), rand((20, 25), np.float64, 2)
    got = blasx.matmul(a, b)
    assert got.dtype == np.float64 and rel_err(got, a.astype(np.float64) @ b) < 1e-12
    out = np.full((30, 25), np.nan)
    assert blasx.matmul(a, b, out=out) is out and rel_err(out, a.astype(np.float64) @ b) < 1e-12
    outv = np.full((30,), np.nan)
    assert blasx.matmul(a, b[:, 0], out=outv) is outv and rel_err(outv, a.astype(np.float64) @ b[:, 0]) < 1e-12
    c = blasx.matmul(rand((10, 7), np.complex64, 3), rand((7, 9), np.float32, 4))
    assert c.dtype == np.complex64
    # k == 0 gives zeros
    z = blasx.matmul(np.ones((4, 0)), np.ones((0, 3)))
    assert z.shape == (4, 3) and np.count_nonzero(z) == 0


def test_matmul_integers_fall_back_to_numpy(sim3):
    rng = np.random.default_rng(0)
    a, b = rng.integers(-5, 5, (12, 9)), rng.integers(-5, 5, (9, 7)).astype(np.int32)
    got = blasx.matmul(a, b)
    assert got.dtype == np.result_type(a, b) and got.dtype.kind == "i"
    assert np.array_equal(got, a @ b)
    v = blasx.matmul(a[0], b)
    assert v.dtype.kind == "i" and np.array_equal(v, a[0] @ b)
    bb = blasx.matmul(a > 0, (b > 0))
    assert bb.dtype == np.bool_ and np.array_equal(bb, (a > 0) @ (b > 0))


# --------------------------------------------------------------------------- other device sets

@pytest.mark.parametrize("config", [dict(devices="cpu", tile=32), dict(devices="sim:2", tile=16, cpu=True),
                                    dict(devices="sim:1", tile=8, streams=1)],
                         ids=["cpu", "sim2+cpu", "sim1-1stream"])
def test_gemm_other_device_sets(config, rand, rel_err, tol):
    blasx.configure(**config)
    for dtype, (ta, tb) in zip(DTYPES, ((0, 0), (1, 2), (2, 0), (1, 1))):
        m, n, k = 70, 45, 90
        a = rand(stored_shape(m, k, ta), dtype, 1)
        b = rand(stored_shape(k, n, tb), dtype, 2, order="C")
        c = rand((m, n), dtype, 3)
        alpha, beta = (2 - 1j, 0.5j) if np.dtype(dtype).kind == "c" else (2.0, 0.5)
        out = blasx.gemm(alpha, a, b, beta, c, ta, tb)
        assert rel_err(out, reference(scalar(alpha, dtype), a, b, scalar(beta, dtype), c, ta, tb)) < tol(dtype)
    tile = blasx.engine().config.tile
    assert blasx.last_profile().totals()["tasks"] == -(-70 // tile) * -(-45 // tile)


# --------------------------------------------------------------------------- CPU only: the host fast path

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_cpu_only_gemm_runs_in_the_calling_thread(rand, rel_err, tol, dtype):
    """No GPU, no tile configured: GEMM is the host BLAS on the canonical views, in this thread
    (no planning, no engine hand-off), with BLAS semantics and a one-task profile."""
    import threading
    blasx.configure(devices="cpu")
    complex_ = np.dtype(dtype).kind == "c"
    alpha, beta = (0.75 - 0.5j, 0.5j) if complex_ else (-1.25, 0.5)
    threads_before = threading.active_count()
    for ta, tb in itertools.product((0, 1, 2), repeat=2):
        for order in ("F", "C"):
            m, n, k = 37, 19, 23
            a = rand(stored_shape(m, k, ta), dtype, 1, order=order)
            b = rand(stored_shape(k, n, tb), dtype, 2, order=order)
            c = rand((m, n), dtype, 3, order=order)
            c0 = c.copy()
            out = blasx.gemm(alpha, a, b, beta, c, ta, tb)
            want = reference(scalar(alpha, dtype), a, b, scalar(beta, dtype), c0, ta, tb)
            assert rel_err(out, want) < tol(dtype)
            assert np.array_equal(c, c0)  # no overwrite_c: c untouched
            out = blasx.gemm(alpha, a, b, beta, c, ta, tb, overwrite_c=True)
            assert rel_err(c if out is c else out, want) < tol(dtype)
    prof = blasx.last_profile()
    assert prof.totals()["tasks"] == 1 and prof.totals()["flops"] == (8 if complex_ else 2) * 37 * 19 * 23
    assert threading.active_count() == threads_before  # no worker thread was needed


def test_cpu_only_gemm_follows_blas_on_zero_scalars_and_empty_k(rand):
    blasx.configure(devices="cpu")
    a, b, c = rand((5, 4)), rand((4, 6), seed=1), rand((5, 6), seed=2)
    a_nan = a.copy()
    a_nan[0, 0] = np.nan
    out = blasx.gemm(0.0, a_nan, b, 0.5, c)  # alpha 0: A and B are not read
    assert np.array_equal(out, 0.5 * c)
    c_nan = c.copy()
    c_nan[1, 1] = np.nan
    out = blasx.gemm(2.0, a, b, 0.0, c_nan)  # beta 0: C is not read
    assert np.allclose(out, 2.0 * a @ b)
    out = blasx.gemm(2.0, rand((5, 0)), rand((0, 6)), 0.0, c_nan)  # k == 0, beta 0: zeros
    assert np.array_equal(out, np.zeros((5, 6)))
    assert blasx.last_profile().totals()["flops"] == 0


def test_cpu_only_routines_and_threads(rand, rel_err):
    """Level-3 routines other than GEMM run their planned tasks inline; many threads at once."""
    from concurrent.futures import ThreadPoolExecutor
    import scipy.linalg.blas as sb
    blasx.configure(devices="cpu")
    a = rand((40, 40)) + 40 * np.eye(40)
    b = rand((40, 30), seed=1)

    def work(i):
        x = blasx.linalg.blas.dtrsm(1.5, a, b, lower=i % 2)
        assert rel_err(x, sb.dtrsm(1.5, a, b, lower=i % 2)) < 1e-12
        y = blasx.matmul(a, b)
        assert rel_err(y, a @ b) < 1e-12
        return True

    with ThreadPoolExecutor(8) as ex:
        assert all(ex.map(work, range(32)))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_cpu_only_fast_path_without_c(rand, rel_err, tol, dtype):
    """``gemm(alpha, a, b)`` / ``matmul(a, b)`` on numpy matrices of one BLAS type, CPU only: the
    shortest path (no c, a real alpha) gives numpy's results, layouts and errors."""
    blasx.configure(devices="cpu")
    for ta, tb in itertools.product((0, 1, 2), repeat=2):
        for order, (m, n, k) in itertools.product(("F", "C"), ((37, 19, 23), (1, 1, 1), (5, 0, 3), (4, 3, 0))):
            a = rand(stored_shape(m, k, ta), dtype, 1, order=order)
            b = rand(stored_shape(k, n, tb), dtype, 2, order=order)
            out = blasx.gemm(-1.25, a, b, trans_a=ta, trans_b=tb)
            assert out.shape == (m, n) and out.dtype == dtype and out.flags.f_contiguous
            want = reference(scalar(-1.25, dtype), a, b, 0.0, None, ta, tb)
            if m and n and k:
                assert rel_err(out, want) < tol(dtype)
            else:
                assert np.array_equal(out, np.zeros((m, n)))
        mm = blasx.matmul(rand((6, 4), dtype, 3), rand((4, 5), dtype, 4))
        assert mm.flags.c_contiguous and mm.dtype == dtype
    assert blasx.last_profile().totals()["tasks"] == 1
    with pytest.raises(ValueError, match="inner dimensions must match"):
        blasx.gemm(1.0, rand((3, 4), dtype, 5), rand((5, 3), dtype, 6))


@pytest.mark.parametrize("routine", ["gemm", "syrk", "trmm"])
def test_rotate_steps_off_gives_the_same_bits_on_any_schedule(monkeypatch, rand, routine):
    """Knobs.rotate_steps=0: every task sums in the plan's order whichever device runs it, so differently paced
    devices (other schedules, steals) give bit-identical results; with rotation they may differ in the last bits."""
    monkeypatch.setenv("BLASX_KNOBS", "rotate_steps=0")
    a, b = rand((96, 200), np.float64, 1), rand((200, 80), np.float64, 2)
    t = np.triu(rand((96, 96), np.float64, 3)) + 4 * np.eye(96)
    run = {"gemm": lambda: blasx.gemm(1.0, a, b), "syrk": lambda: blasx.dsyrk(1.0, a),
           "trmm": lambda: blasx.dtrmm(1.0, t, a)}[routine]
    results = []
    for spec in ("sim:2", "sim:2,speeds=1/7", "sim:3,speeds=5/1/2", "sim:2,speeds=9/1"):
        blasx.configure(devices=spec, tile=16)
        results += [run(), run()]
    assert all(np.array_equal(results[0], r) for r in results[1:])
