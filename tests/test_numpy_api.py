"""blasx.matmul / blasx.dot / blasx.tensordot against numpy: broadcasting, 1-D operands, out=,
dtype rules, errors, the fallbacks, and which products make one gemm."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import blasx
from blasx import numpy_api


@pytest.fixture(autouse=True)
def _sim():
    blasx.configure(devices="sim:2", tile=16)
    yield


BLAS = (np.float32, np.float64, np.complex64, np.complex128)


def _r(rand, shape, dtype=np.float64, seed=0):
    if np.dtype(dtype).kind in "fc":
        return rand(shape, dtype, seed=seed, order="C")
    return np.random.default_rng(seed).integers(-3, 4, size=shape).astype(dtype)


def _check(got, ref, tol=None):
    assert type(got) is type(ref), (type(got), type(ref))
    assert np.shape(got) == np.shape(ref)
    assert np.asarray(got).dtype == np.asarray(ref).dtype
    kind = np.asarray(ref).dtype
    rtol = tol or (2e-5 if kind in (np.float32, np.complex64) else 1e-12)
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * 10)


@pytest.fixture
def gemm_calls(monkeypatch):
    """How many gemms blasx ran (numpy_api.gemm_into calls)."""
    calls = []
    real = numpy_api.gemm_into

    def counting(a2, b2, c2):
        calls.append((a2.shape, b2.shape))
        return real(a2, b2, c2)
    monkeypatch.setattr(numpy_api, "gemm_into", counting)
    return calls


MATMUL_SHAPES = [
    ((20,), (20,)), ((20,), (20, 18)), ((17, 20), (20,)), ((17, 20), (20, 18)),
    ((3, 17, 20), (20, 18)), ((17, 20), (3, 20, 18)), ((3, 17, 20), (3, 20, 18)),
    ((2, 1, 17, 20), (4, 20, 18)), ((4, 1, 9, 5), (3, 5, 7)), ((5, 3, 17, 20), (20,)), ((20,), (5, 3, 20, 18)),
    ((1, 17, 20), (6, 20, 18)), ((0, 17, 20), (20, 18)), ((17, 0), (0, 18)), ((3, 17, 20), (1, 20, 0)),
    ((2, 3, 1, 20), (20, 1)),
]


@pytest.mark.parametrize("sa, sb", MATMUL_SHAPES)
@pytest.mark.parametrize("dtype", BLAS)
def test_matmul_shapes_and_broadcasting(sa, sb, dtype, rand):
    a, b = _r(rand, sa, dtype, 1), _r(rand, sb, dtype, 2)
    _check(blasx.matmul(a, b), np.matmul(a, b))


def test_matmul_runs_on_blasx(rand):
    a, b = _r(rand, (40, 30)), _r(rand, (30, 20))
    before = blasx.last_profile()
    blasx.matmul(a, b)
    p = blasx.last_profile()
    assert p is not before and p.totals()["flops"] == 2 * 40 * 30 * 20


def test_matmul_layouts(rand):
    base = _r(rand, (6, 40, 50), np.float64, 3)
    for a in (base, base[:, ::2, ::-1], np.swapaxes(base, -1, -2), np.asfortranarray(base)):
        b = _r(rand, (a.shape[-1], 11), np.float64, 4)
        for bb in (b, np.asfortranarray(b), b[::-1]):
            _check(blasx.matmul(a, bb), np.matmul(a, bb))


def test_matmul_mixed_dtypes_follow_numpy(rand):
    for da, db in itertools.product(BLAS + (np.int32, np.float16, np.bool_), repeat=2):
        a, b = _r(rand, (3, 9, 7), da, 1), _r(rand, (7, 5), db, 2)
        tol = 1e-2 if np.float16 in (da, db) and np.result_type(da, db) == np.float16 else None
        _check(blasx.matmul(a, b), np.matmul(a, b), tol)


def test_matmul_other_dtypes_fall_back_to_numpy(rand, gemm_calls):
    for dt in (np.int64, np.bool_, np.longdouble, object):  # (float16 and int8: blasx.precision)
        a = np.arange(12).reshape(3, 4).astype(dt)
        b = np.arange(8).reshape(4, 2).astype(dt)
        got = blasx.matmul(a, b)
        ref = np.matmul(a, b)
        assert got.dtype == ref.dtype
        np.testing.assert_array_equal(got, ref)
    assert gemm_calls == []


def test_matmul_one_gemm_when_the_batch_stacks(rand, gemm_calls):
    a, b = _r(rand, (4, 17, 20)), _r(rand, (20, 18))
    _check(blasx.matmul(a, b), a @ b)
    assert gemm_calls == [((68, 20), (20, 18))]  # (N*n, k) @ (k, m)
    gemm_calls.clear()
    a2 = _r(rand, (17, 20))
    b2 = _r(rand, (4, 20, 18))
    _check(blasx.matmul(a2, b2), a2 @ b2)
    assert gemm_calls == [((17, 20), (20, 72))]  # a @ [b_1 .. b_4]
    gemm_calls.clear()
    b2t = np.swapaxes(_r(rand, (4, 18, 20)), -1, -2)  # b^T stacks as a view: c^T = b^T a^T
    _check(blasx.matmul(a2, b2t), a2 @ b2t)
    assert gemm_calls == [((72, 20), (20, 17))]
    gemm_calls.clear()
    a3, b3 = _r(rand, (3, 17, 20)), _r(rand, (3, 20, 18))
    _check(blasx.matmul(a3, b3), a3 @ b3)
    assert len(gemm_calls) == 3  # one per batch item
    gemm_calls.clear()
    a4 = _r(rand, (4, 30, 20))[:, ::2]  # batch rows at two strides: stacked on a copy
    _check(blasx.matmul(a4, b), a4 @ b)
    assert gemm_calls == [((60, 20), (20, 18))]
    gemm_calls.clear()
    a5 = np.broadcast_to(_r(rand, (17, 20)), (3, 17, 20))  # both shared: one product, copied
    _check(blasx.matmul(a5, b), a5 @ b)
    assert len(gemm_calls) == 1


def test_matmul_out(rand):
    a, b = _r(rand, (3, 17, 20)), _r(rand, (20, 18))
    out = np.empty((3, 17, 18))
    r = blasx.matmul(a, b, out=out)
    assert r is out
    _check(out, a @ b)
    out32 = np.empty((3, 17, 18), np.float32)  # same_kind cast of the result
    assert blasx.matmul(a, b, out=out32) is out32
    np.testing.assert_allclose(out32, (a @ b).astype(np.float32), rtol=1e-6)
    outF = np.asfortranarray(np.empty((3, 17, 18)))
    assert blasx.matmul(a, b, out=outF) is outF
    _check(outF, a @ b)
    tup = np.empty((3, 17, 18))
    assert blasx.matmul(a, b, out=(tup,)) is tup
    v = _r(rand, (20,))
    outv = np.empty(17)
    assert blasx.matmul(a[0], v, out=outv) is outv
    _check(outv, a[0] @ v)


def test_matmul_out_aliasing_an_input(rand):
    a = _r(rand, (20, 20), seed=1)
    b = _r(rand, (20, 20), seed=2)
    ref = a @ b
    x = a.copy()
    assert blasx.matmul(x, b, out=x) is x
    _check(x, ref)


def test_matmul_dtype_and_casting(rand):
    a, b = _r(rand, (9, 7)), _r(rand, (7, 5))
    _check(blasx.matmul(a, b, dtype=np.float32), np.matmul(a, b, dtype=np.float32))
    _check(blasx.matmul(a.astype(np.float32), b.astype(np.float32), dtype=np.complex128),
           np.matmul(a.astype(np.float32), b.astype(np.float32), dtype=np.complex128))
    ai = a.astype(np.int64)
    _check(blasx.matmul(ai, ai.T, dtype=np.float64), np.matmul(ai, ai.T, dtype=np.float64))
    with pytest.raises(TypeError) as ref:  # numpy's UFuncTypeError: float64 result into an int64 out
        np.matmul(a, b, out=np.empty((9, 5), np.int64))
    with pytest.raises(TypeError) as got:
        blasx.matmul(a, b, out=np.empty((9, 5), np.int64))
    assert str(got.value) == str(ref.value)
    with pytest.raises(TypeError):
        np.matmul(a, b, dtype=np.float32, casting="safe")
    with pytest.raises(TypeError):
        blasx.matmul(a, b, dtype=np.float32, casting="safe")


def test_matmul_errors_are_numpys(rand):
    a, b = _r(rand, (3, 4)), _r(rand, (5, 6))
    for args in [(a, b), (np.ones((2, 3, 4)), np.ones((3, 4, 5))), (np.float64(2.0), a), (a, 3.0)]:
        with pytest.raises(ValueError) as ref:
            np.matmul(*args)
        with pytest.raises(ValueError) as got:
            blasx.matmul(*args)
        assert str(got.value) == str(ref.value)
    with pytest.raises(ValueError):
        blasx.matmul(np.ones((3, 4)), np.ones((4, 5)), out=np.empty((3, 4)))


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
def test_matmul_scalars_lists_and_subclasses(rand):
    v = np.arange(5.0)
    r = blasx.matmul(v, v)
    assert type(r) is np.float64 and r == v @ v
    _check(blasx.matmul([[1.0, 2.0], [3.0, 4.0]], [[1.0], [1.0]]), np.matmul([[1.0, 2.0], [3.0, 4.0]], [[1.0], [1.0]]))
    m = np.asmatrix(np.ones((2, 2)))
    got = blasx.matmul(m, m)
    assert type(got) is np.matrix
    np.testing.assert_array_equal(got, np.matmul(m, m))
    _check(blasx.matmul(np.ones((2, 3)), np.ones((3, 4)), axes=[(-2, -1), (-2, -1), (-2, -1)]),
           np.matmul(np.ones((2, 3)), np.ones((3, 4)), axes=[(-2, -1), (-2, -1), (-2, -1)]))


def test_matmul_is_the_package_export():
    assert blasx.matmul is numpy_api.matmul
    from blasx import level3
    assert not hasattr(level3, "matmul")  # one matmul: numpy_api's


# ---------------------------------------------------------------- dot

DOT_SHAPES = [((20,), (20,)), ((20,), (20, 18)), ((17, 20), (20,)), ((17, 20), (20, 18)),
              ((3, 17, 20), (20,)), ((3, 17, 20), (20, 18)), ((3, 17, 20), (4, 20, 18)),
              ((2, 3, 7, 20), (5, 20, 4)), ((20,), (4, 20, 18)), ((0, 20), (20, 5)), ((4, 0), (0, 5))]


@pytest.mark.parametrize("sa, sb", DOT_SHAPES)
@pytest.mark.parametrize("dtype", BLAS)
def test_dot_matches_numpy(sa, sb, dtype, rand, gemm_calls):
    a, b = _r(rand, sa, dtype, 1), _r(rand, sb, dtype, 2)
    _check(blasx.dot(a, b), np.dot(a, b))
    if 0 not in sa + sb:
        assert len(gemm_calls) == 1  # N-D dot is one gemm


def test_dot_scalars_out_and_errors(rand):
    a, b = _r(rand, (17, 20)), _r(rand, (20, 18))
    _check(blasx.dot(3.0, a), np.dot(3.0, a))
    _check(blasx.dot(a, np.float64(2.0)), np.dot(a, np.float64(2.0)))
    out = np.empty((17, 18))
    assert blasx.dot(a, b, out=out) is out
    _check(out, np.dot(a, b))
    for bad in (np.empty((17, 18), np.float32), np.empty((18, 17)).T, np.empty((17, 19))):
        with pytest.raises(ValueError) as ref:
            np.dot(a, b, out=bad)
        with pytest.raises(ValueError) as got:
            blasx.dot(a, b, out=bad)
        assert str(got.value) == str(ref.value)
    with pytest.raises(ValueError) as ref:
        np.dot(a, a)
    with pytest.raises(ValueError) as got:
        blasx.dot(a, a)
    assert str(got.value) == str(ref.value)
    ai = a.astype(np.int32)
    _check(blasx.dot(ai, ai.T), np.dot(ai, ai.T))  # integers: numpy's
    _check(blasx.dot(a.astype(np.float32), b), np.dot(a.astype(np.float32), b))
    v = np.arange(4.0)
    r = blasx.dot(v, v)
    assert type(r) is np.float64 and r == 14.0
    o = np.empty(())
    r = blasx.dot(v, v, out=o)  # numpy's dot gives the scalar with a 0-d out too
    assert type(r) is type(np.dot(v, v, np.empty(()))) is np.float64 and r == 14.0 and o == 14.0


# ---------------------------------------------------------------- tensordot

@pytest.mark.parametrize("axes", [2, 1, 0, ([1, 0], [0, 1]), ([0], [1]), ((2,), (0,)), (-1, 0), ([-1, -3], [0, 1])])
@pytest.mark.parametrize("dtype", (np.float64, np.complex64))
def test_tensordot_matches_numpy(axes, dtype, rand, gemm_calls):
    a = _r(rand, (4, 5, 6), dtype, 1)
    shape_b = {2: (5, 6, 3), 1: (6, 3), 0: (2, 3)}.get(axes) if isinstance(axes, int) else None
    if shape_b is None:
        aa, ab = axes
        aa = [aa] if isinstance(aa, int) else list(aa)
        ab = [ab] if isinstance(ab, int) else list(ab)
        nb = max(max(x % 3 for x in ab) + 1, len(ab)) + 1
        shape_b = [3] * nb
        for i, j in zip(aa, ab):
            shape_b[j] = a.shape[i]
        shape_b = tuple(shape_b)
    b = _r(rand, shape_b, dtype, 2)
    _check(blasx.tensordot(a, b, axes), np.tensordot(a, b, axes))
    assert len(gemm_calls) == 1


def test_tensordot_errors_and_fallbacks(rand):
    a, b = _r(rand, (4, 5)), _r(rand, (6, 3))
    for axes in (1, ([0], [0]), ([0, 1], [0]), 3):
        with pytest.raises(Exception) as ref:  # noqa: B017 - whatever numpy raises
            np.tensordot(a, b, axes)
        with pytest.raises(type(ref.value)):
            blasx.tensordot(a, b, axes)
    ai = np.arange(20).reshape(4, 5)
    np.testing.assert_array_equal(blasx.tensordot(ai, ai, ([0], [0])), np.tensordot(ai, ai, ([0], [0])))


def test_dot_with_an_empty_array_like_keeps_its_dtype_as_numpy():
    """numpy gives an empty Python list or tuple b a's type; an array-like (``__array__``, a memoryview) keeps
    its own."""
    class Like:
        def __init__(self, a):
            self.a = a

        def __array__(self, dtype=None, copy=None):
            return self.a
    a = np.ones((2, 0), np.float32)
    import collections
    for b in (Like(np.zeros(0)), memoryview(np.zeros(0)), Like(np.zeros(0, np.complex128)), [], (), range(0),
              collections.deque(), (np.empty((0, 2)),)):
        want = np.dot(a, b)
        got = blasx.dot(a, b)
        assert got.dtype == want.dtype and got.shape == want.shape


@pytest.mark.parametrize("fn, message", [(lambda o: blasx.dot(np.ones(3), np.ones(3), o), "'out' must be an array"),
                                         (lambda o: blasx.matmul(np.ones(3), np.ones(3), out=o),
                                          "return arrays must be of ArrayType")])
def test_a_numpy_scalar_as_out_is_numpys_type_error(fn, message):
    with pytest.raises(TypeError, match=message):
        fn(np.float64(0))
