"""blasx.linalg.blas against scipy.linalg.blas: every level-3 routine, prefix and flag, the f2py
conversions, overwrite_*, bad arguments, get_blas_funcs / find_best_blas_type, level-1/2 forwarding.

Everything runs on two simulated GPUs with 16x16 tiles, so the small matrices here still make
several tiles (and tasks) per call."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import scipy.linalg.blas as S

import blasx
from blasx.linalg import blas as B

pytestmark = pytest.mark.skipif(not hasattr(blasx, "dsymm"),
                                reason="blasx.dsymm & co. (blasx/blas3.py) are not there yet")

PREFIXES = "sdcz"
DT = {"s": np.float32, "d": np.float64, "c": np.complex64, "z": np.complex128}
M, N, K = 37, 29, 23  # not multiples of the 16x16 tile


@pytest.fixture(autouse=True)
def _sim():
    blasx.configure(devices="sim:2", tile=16)
    yield


def _arr(rand, shape, prefix, seed, order):
    return rand(shape, DT[prefix], seed=seed, order=order)


def _same(rel_err, tol, got, ref, prefix):
    assert isinstance(got, np.ndarray)
    assert got.dtype == ref.dtype, (got.dtype, ref.dtype)
    assert got.shape == ref.shape
    assert got.flags.f_contiguous == ref.flags.f_contiguous
    assert rel_err(got, ref) < 50 * tol(DT[prefix])


def _ran_on_blasx(before) -> bool:
    p = blasx.last_profile()
    return p is not None and p is not before and p.totals()["tasks"] > 0


ALPHA = {"s": 1.5, "d": 1.5, "c": 1.5 - 0.5j, "z": 1.5 - 0.5j}
BETA = {"s": 0.5, "d": 0.5, "c": 0.5 + 0.25j, "z": 0.5 + 0.25j}


# ---------------------------------------------------------------- results against scipy

@pytest.mark.parametrize("prefix", PREFIXES)
def test_gemm_all_flags(prefix, rand, rel_err, tol):
    for ta, tb, order, with_c in itertools.product((0, 1, 2), (0, 1, 2), "FC", (False, True)):
        a = _arr(rand, (M, K) if ta == 0 else (K, M), prefix, 1, order)
        b = _arr(rand, (K, N) if tb == 0 else (N, K), prefix, 2, order)
        kw = dict(trans_a=ta, trans_b=tb)
        if with_c:
            kw.update(beta=BETA[prefix], c=_arr(rand, (M, N), prefix, 3, order))
        before = blasx.last_profile()
        got = getattr(B, prefix + "gemm")(ALPHA[prefix], a, b, **kw)
        assert _ran_on_blasx(before)
        _same(rel_err, tol, got, getattr(S, prefix + "gemm")(ALPHA[prefix], a, b, **kw), prefix)


@pytest.mark.parametrize("name", [p + r for r in ("symm", "hemm") for p in B.LEVEL3[r]])
def test_symm_hemm_all_flags(name, rand, rel_err, tol):
    prefix = name[0]
    for side, lower, order, with_c in itertools.product((0, 1), (0, 1), "FC", (False, True)):
        s = M if side == 0 else N
        a = _arr(rand, (s, s), prefix, 4, order)
        b = _arr(rand, (M, N), prefix, 5, order)
        kw = dict(side=side, lower=lower)
        if with_c:
            kw.update(beta=BETA[prefix], c=_arr(rand, (M, N), prefix, 6, order))
        before = blasx.last_profile()
        got = getattr(B, name)(ALPHA[prefix], a, b, **kw)
        assert _ran_on_blasx(before)
        _same(rel_err, tol, got, getattr(S, name)(ALPHA[prefix], a, b, **kw), prefix)


@pytest.mark.parametrize("name", [p + r for r in ("syrk", "herk", "syr2k", "her2k") for p in B.LEVEL3[r]])
def test_rank_k_all_flags(name, rand, rel_err, tol):
    prefix, routine = name[0], name[1:]
    herm = routine.startswith("her")
    two = routine.endswith("2k")
    transes = (0, 2) if herm else ((0, 1) if prefix in "cz" else (0, 1, 2))
    alpha = 1.5 if routine == "herk" else ALPHA[prefix]
    beta = 0.5 if herm else BETA[prefix]
    for trans, lower, order, with_c in itertools.product(transes, (0, 1), "FC", (False, True)):
        shape = (N, K) if trans == 0 else (K, N)
        args = [alpha, _arr(rand, shape, prefix, 7, order)]
        if two:
            args.append(_arr(rand, shape, prefix, 8, order))
        kw = dict(trans=trans, lower=lower)
        if with_c:
            kw.update(beta=beta, c=_arr(rand, (N, N), prefix, 9, order))
        before = blasx.last_profile()
        got = getattr(B, name)(*args, **kw)
        assert _ran_on_blasx(before)
        _same(rel_err, tol, got, getattr(S, name)(*args, **kw), prefix)


@pytest.mark.parametrize("name", [p + r for r in ("trmm", "trsm") for p in PREFIXES])
def test_trmm_trsm_all_flags(name, rand, rel_err, tol):
    prefix = name[0]
    for side, lower, trans, diag, order in itertools.product((0, 1), (0, 1), (0, 1, 2), (0, 1), "FC"):
        s = M if side == 0 else N
        a = _arr(rand, (s, s), prefix, 10, order)
        a = a + np.asarray(4 * np.eye(s), dtype=a.dtype)  # well conditioned for trsm
        a = np.asarray(a, order=order)
        b = _arr(rand, (M, N), prefix, 11, order)
        kw = dict(side=side, lower=lower, trans_a=trans, diag=diag)
        before = blasx.last_profile()
        got = getattr(B, name)(ALPHA[prefix], a, b, **kw)
        assert _ran_on_blasx(before)
        _same(rel_err, tol, got, getattr(S, name)(ALPHA[prefix], a, b, **kw), prefix)


def test_positional_order_and_defaults_match_scipy(rand, rel_err, tol):
    a, b = rand((M, K), seed=1), rand((K, N), seed=2)
    c = rand((M, N), seed=3)
    _same(rel_err, tol, B.dgemm(2.0, a.T, b, 0.5, c, 1, 0), S.dgemm(2.0, a.T, b, 0.5, c, 1, 0), "d")
    t = rand((M, M), seed=4) + 4 * np.eye(M)
    _same(rel_err, tol, B.dtrsm(1.0, t, c, 0, 1, 1, 0), S.dtrsm(1.0, t, c, 0, 1, 1, 0), "d")
    _same(rel_err, tol, B.dsyrk(1.0, a, 0.0, None, 1, 1), S.dsyrk(1.0, a, 0.0, None, 1, 1), "d")
    for name, fn in B.FUNCTIONS.items():
        assert list(B.signature_of(name[1:]).parameters) == list(fn.__signature__.parameters)
        assert fn.__name__ == name


# ---------------------------------------------------------------- overwrite_*

@pytest.mark.parametrize("order, dtype", [("F", np.float64), ("C", np.float64), ("F", np.float32)])
def test_overwrite_c_like_scipy(order, dtype, rand):
    a, b = rand((M, K), seed=1), rand((K, N), seed=2)
    results = []
    for mod in (S, B):
        c = np.asarray(rand((M, N), seed=3), dtype=dtype, order=order)
        c0 = c.copy()
        r = mod.dgemm(1.0, a, b, beta=1.0, c=c, overwrite_c=1)
        results.append((r is c, np.array_equal(c, c0), r.copy()))
    assert results[0][0] == results[1][0]  # in place exactly when scipy is
    assert results[0][1] == results[1][1]  # c left alone exactly when scipy leaves it
    np.testing.assert_allclose(results[1][2], results[0][2], rtol=1e-12)


def test_overwrite_c_of_a_misaligned_c_like_scipy():
    """A misaligned c (F-contiguous, writable) is not written in place, as f2py copies it: a new array comes
    back and c is left alone."""
    for mod in (S, B):
        buf = np.zeros(16 * 8 + 1, np.uint8)
        c = np.ndarray((4, 4), np.float64, buffer=buf[1:], order="F")
        c[...] = 1
        r = mod.dgemm(1.0, np.eye(4), np.eye(4), 1.0, c, overwrite_c=1)
        assert r is not c and (c == 1).all() and (r == np.eye(4) + 1).all()


@pytest.mark.parametrize("engine", ["sim:2", "cpu"])
def test_beta_one_leaves_a_complex_inf_as_it_is(engine):
    """C = 0 A B + 1 C and a rank-k update with beta 1: c's values are not multiplied by 1 (inf + 0j would
    become inf + nanj), as BLAS returns at once or skips the scaling."""
    blasx.configure(devices=engine, tile=16)
    a, b = np.ones((4, 3), complex, order="F"), np.ones((3, 5), complex, order="F")
    c = np.ones((4, 5), complex, order="F")
    c[0, 0] = np.inf
    for alpha, aa, bb in ((0.0, a, b), (1.0, a[:, :0], b[:0])):
        got, want = B.zgemm(alpha, aa, bb, 1.0, c)[0, 0], S.zgemm(alpha, aa, bb, 1.0, c)[0, 0]
        assert got == want == complex(np.inf, 0) and not np.isnan(got.imag)
    s = np.ones((4, 4), complex, order="F")
    s[0, 0] = np.inf
    got = B.zsyrk(1.0, a, 1.0, s)[0, 0]
    assert got.real == np.inf and got.imag == S.zsyrk(1.0, a, 1.0, s)[0, 0].imag == 0
    # a product with C tiles folded in afterwards (late C: the old tile added to the product, beta 1)
    a2, c2 = np.full((64, 64), 0.01 + 0j, order="F"), np.zeros((64, 64), complex, order="F")
    c2[0, 0] = np.inf
    with np.errstate(all="ignore"):
        got, want = B.zgemm(1.0, a2, a2, 1.0, c2)[0, 0], S.zgemm(1.0, a2, a2, 1.0, c2)[0, 0]
    assert got == want == complex(np.inf, 0)


@pytest.mark.parametrize("engine", ["sim:2", "cpu"])
@pytest.mark.parametrize("beta", [np.inf, np.nan, -np.inf])
def test_a_non_finite_beta_without_c_gives_nan_where_scipy_writes(engine, beta, rand):
    """f2py makes c zeros, and BLAS's beta * 0 is NaN: every entry it writes is NaN (a rank-k update's triangle
    alone), as scipy's; blasx dropped beta with c and returned the bare product."""
    blasx.configure(devices=engine, tile=16)
    a, b = _arr(rand, (M, K), "d", 1, "F"), _arr(rand, (K, N), "d", 2, "F")
    s, z = _arr(rand, (M, M), "d", 3, "F"), _arr(rand, (M, K), "z", 4, "F")
    for name, args in (("dgemm", (1.0, a, b)), ("dsymm", (1.0, s, _arr(rand, (M, N), "d", 5, "F"))),
                       ("dsyrk", (1.0, a)), ("dsyr2k", (1.0, a, a)), ("zherk", (1.0, z)), ("zher2k", (1.0, z, z)),
                       ("zgemm", (1.0, z, np.asfortranarray(z.T)))):
        with np.errstate(invalid="ignore"):
            got, want = getattr(B, name)(*args, beta=beta), getattr(S, name)(*args, beta=beta)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=name)
        assert np.isnan(want).any()


@pytest.mark.parametrize("trans", [0, 1])
def test_syr2k_takes_the_leading_block_of_a_longer_b_as_scipy(trans, rand, rel_err, tol):
    """scipy's ?syr2k / ?her2k wrappers take b with more rows (trans=0) or columns (else) than a: its leading
    block is read."""
    a = _arr(rand, (M, K) if trans == 0 else (K, M), "d", 1, "F")
    b = _arr(rand, (M + 5, K) if trans == 0 else (K, M + 5), "d", 2, "F")
    _same(rel_err, tol, B.dsyr2k(1.0, a, b, trans=trans), S.dsyr2k(1.0, a, b, trans=trans), "d")
    z = _arr(rand, a.shape, "z", 3, "F")
    zb = _arr(rand, b.shape, "z", 4, "F")
    t = 2 if trans else 0
    _same(rel_err, tol, B.zher2k(1.0, z, zb, trans=t), S.zher2k(1.0, z, zb, trans=t), "z")


@pytest.mark.parametrize("name", ["dsyrk", "zherk", "dsymm", "zher2k"])
def test_overwrite_c_other_routines(name, rand):
    prefix = name[0]
    routine = name[1:]
    for order in "FC":
        outs = []
        for mod in (S, B):
            a = _arr(rand, (N, K) if "rk" in routine or "r2k" in routine else (N, N), prefix, 1, "F")
            args = [1.0, a]
            if routine in ("symm", "her2k", "syr2k"):
                args.append(_arr(rand, (N, K) if routine != "symm" else (N, N), prefix, 2, "F"))
            c = _arr(rand, (N, N), prefix, 3, order)
            if routine in ("herk", "her2k"):
                c = np.asarray(c + c.conj().T, order=order)
            r = getattr(mod, name)(*args, beta=0.5, c=c, overwrite_c=1)
            outs.append((r is c, r.copy()))
        assert outs[0][0] == outs[1][0]
        np.testing.assert_allclose(outs[1][1], outs[0][1], rtol=1e-10)


@pytest.mark.parametrize("name", ["dtrmm", "dtrsm", "ztrsm"])
@pytest.mark.parametrize("order", "FC")
def test_overwrite_b_like_scipy(name, order, rand):
    prefix = name[0]
    a = _arr(rand, (M, M), prefix, 1, "F") + 4 * np.eye(M)
    outs = []
    for mod in (S, B):
        b = _arr(rand, (M, N), prefix, 2, order)
        b0 = b.copy()
        r = getattr(mod, name)(1.0, a, b, lower=1, overwrite_b=1)
        outs.append((r is b, np.array_equal(b, b0), r.copy()))
    assert outs[0][:2] == outs[1][:2]
    np.testing.assert_allclose(outs[1][2], outs[0][2], rtol=1e-10)


# ---------------------------------------------------------------- f2py conversions

def test_conversions_like_f2py(rand, rel_err):
    a, b = rand((M, K), seed=1), rand((K, N), seed=2)
    cases = [
        ("dgemm", (1.0, a.tolist(), b.tolist()), {}),                    # lists
        ("dgemm", (1.0, a, b[:, 0]), {}),                                # 1-D b is a column
        ("dgemm", (2.0, np.float64(3.0), np.ones((1, 4))), {}),         # 0-d a is 1x1
        ("dgemm", (1, a.astype(np.int32), b.astype(np.float32)), {}),    # any dtype cast to d
        ("sgemm", (1.0, a, b), {}),                                      # float64 cast down to s
        ("zgemm", (1.0, a, b), {}),                                      # real arrays to z
        ("dgemm", (np.array([2.0]), a, b), {}),                          # one-element alpha
        ("dgemm", (True, a.T, b), {"trans_a": True}),                    # bool flags
        ("dgemm", (1.0, a.T, b), {"trans_a": 1.0}),                      # float flag: int()
        ("dgemm", (1.0, a, b), {"overwrite_c": 5}),                      # any int is true
        ("dtrmm", (1.0, rand((M + 3, M + 1), seed=4), rand((M, N), seed=5)), {}),  # a's leading block
        ("dtrmm", (1.0, rand((N + 2, N), seed=4), rand((M, N), seed=5)), {"side": 1}),
    ]
    for name, args, kw in cases:
        ref = getattr(S, name)(*args, **kw)
        got = getattr(B, name)(*args, **kw)
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        assert rel_err(got, ref) < (1e-5 if got.dtype == np.float32 else 1e-12), name


def test_objects_that_say_they_are_numbers_convert_as_in_scipy(rand, rel_err):
    class Index:
        def __index__(self):
            return 1

    class Real:
        def __float__(self):
            return 2.0
    a, b = rand((M, K), seed=1), rand((K, N), seed=2)
    assert rel_err(B.dgemm(Real(), a.T.copy(), b, trans_a=Index()), S.dgemm(2.0, a, b)) < 1e-12
    for lib in (S, B):
        with pytest.raises(IndexError):
            lib.dgemm(1.0, a, b, trans_a=[])


def test_masked_scalars_convert_as_scipy_converts_them(rand):
    """A masked alpha (np.ma.masked is its own element: the conversion recursed forever) is NaN, as in scipy."""
    a, b = rand((M, K), seed=1), rand((K, N), seed=2)
    with pytest.warns(UserWarning):
        ref = S.dgemm(np.ma.masked, a, b)
    assert np.isnan(ref).all() and np.isnan(B.dgemm(np.ma.masked, a, b)).all()
    np.testing.assert_allclose(B.dgemm(np.ma.array([2.0]), a, b), S.dgemm(2.0, a, b), rtol=1e-12)


def test_complex_to_real_discards_imaginary_part_with_a_warning(rand):
    a, b = rand((M, K), seed=1), rand((K, N), seed=2)
    with pytest.warns(np.exceptions.ComplexWarning):
        got = B.dgemm(1.0, a + 1j, b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
        np.testing.assert_allclose(got, S.dgemm(1.0, a + 1j, b), rtol=1e-12)
    with pytest.warns(np.exceptions.ComplexWarning, match="alpha"):
        got = B.dgemm(2 + 3j, a, b)
    np.testing.assert_allclose(got, S.dgemm(2 + 3j, a, b), rtol=1e-12)  # scipy drops it silently
    z = rand((N, K), np.complex128, seed=3)
    c = rand((N, N), np.complex128, seed=4)
    with pytest.warns(np.exceptions.ComplexWarning):
        got = B.zherk(1 + 2j, z, beta=0.5 + 1j, c=c)
    np.testing.assert_allclose(got, S.zherk(1 + 2j, z, beta=0.5 + 1j, c=c), rtol=1e-12)


def test_empty_and_degenerate_shapes(rand):
    for args in [(1.0, np.ones((0, 3)), np.ones((3, 2))), (1.0, np.ones((2, 0)), np.ones((0, 2))),
                 (1.0, np.ones((2, 3)), np.ones((3, 0)))]:
        ref = S.dgemm(*args)
        got = B.dgemm(*args)
        assert got.shape == ref.shape
        np.testing.assert_array_equal(got, ref)


# ---------------------------------------------------------------- bad arguments

def _bad_cases(rand):
    a, b = rand((4, 3), seed=1), rand((3, 5), seed=2)
    t = rand((4, 4), seed=3)
    return [
        ("dgemm", (1.0, a, a), {}, "a, b"),                       # inner dimensions
        ("dgemm", (1.0, a, b), {"trans_a": 3}, "trans_a"),
        ("dgemm", (1.0, a, b), {"trans_b": -1}, "trans_b"),
        ("dgemm", (1.0, a, b), {"c": np.ones((3, 3)), "beta": 1.0}, "c"),
        ("dgemm", ("x", a, b), {}, "alpha"),
        ("dgemm", (None, a, b), {}, "alpha"),
        ("dgemm", (1.0, a), {}, "dgemm"),                         # missing b
        ("dgemm", (1.0, a, b), {"foo": 1}, "dgemm"),              # unknown keyword
        ("dgemm", (1.0, a, b, 0.0, None, 0, 0, 0, 0), {}, "dgemm"),  # too many arguments
        ("dgemm", (1.0, a, b), {"overwrite_c": "x"}, "overwrite_c"),
        ("dsymm", (1.0, t, b.T), {"side": 2}, "side"),
        ("dsymm", (1.0, t, b.T), {"lower": 2}, "lower"),
        ("dsymm", (1.0, rand((3, 3), seed=4), b.T), {}, "a"),     # a's size != b's rows
        ("dtrmm", (1.0, t, b.T), {"diag": 2}, "diag"),
        ("dtrsm", (1.0, t, b.T), {}, "a"),                        # trsm: a must fit exactly
        ("dsyr2k", (1.0, a, rand((4, 4), seed=5)), {}, "b"),
        ("dsyrk", (1.0, a), {"c": np.ones((3, 3)), "beta": 1.0}, "c"),
    ]


def test_bad_arguments_raise_where_scipy_raises(rand):
    for name, args, kw, param in _bad_cases(rand):
        with pytest.raises(Exception):  # noqa: B017 - scipy raises _fblas.error, ValueError or TypeError
            getattr(S, name)(*args, **kw)
        with pytest.raises((ValueError, TypeError)) as info:
            getattr(B, name)(*args, **kw)
        assert param in str(info.value), (name, param, str(info.value))


def test_bad_values_scipy_hands_to_blas_are_errors_here(rand):
    """scipy passes these to BLAS, which prints an xerbla message and returns an unspecified array."""
    z = rand((4, 3), np.complex128, seed=1)
    with pytest.raises(ValueError, match="trans"):
        B.zherk(1.0, z, trans=1)
    with pytest.raises(ValueError, match="trans"):
        B.zsyrk(1.0, z, trans=2)
    with pytest.raises(ValueError, match="trans"):
        B.zher2k(1.0, z, z, trans=1)
    with pytest.raises(ValueError, match="a"):
        B.dgemm(1.0, np.ones((2, 2, 2)), np.ones((2, 2)))


def test_rejected_call_writes_nothing(rand):
    a, b = rand((4, 3), seed=1), rand((3, 5), seed=2)
    c = np.asfortranarray(rand((4, 5), seed=3))
    c0 = c.copy()
    with pytest.raises(ValueError):
        B.dgemm(1.0, a, b, beta=1.0, c=c, trans_a=7, overwrite_c=1)
    np.testing.assert_array_equal(c, c0)


# ---------------------------------------------------------------- prefix selection

DTYPES = [np.float32, np.float64, np.complex64, np.complex128, np.int32, np.int64, np.bool_, np.float16,
          np.uint8, np.longdouble]


def test_find_best_blas_type_matches_scipy():
    for dts in itertools.chain(((d,) for d in DTYPES), itertools.combinations(DTYPES, 2),
                               itertools.combinations(DTYPES[:5], 3)):
        for orders in itertools.product("FC", repeat=len(dts)):
            arrays = tuple(np.zeros((3, 2), dtype=d, order=o) for d, o in zip(dts, orders))
            assert B.find_best_blas_type(arrays) == S.find_best_blas_type(arrays), (dts, orders)
    for d in [None, "f", "d", "F", "D", np.int32, "g"]:
        assert B.find_best_blas_type(dtype=d) == S.find_best_blas_type(dtype=d)
    assert B.find_best_blas_type((np.zeros(3),)) == S.find_best_blas_type((np.zeros(3),))


def test_get_blas_funcs_level3_are_blasx_with_scipys_attributes():
    for dts in itertools.chain(((d,) for d in DTYPES), itertools.combinations(DTYPES[:4], 2)):
        arrays = tuple(np.zeros((2, 2), dtype=d) for d in dts)
        for routine, prefixes in B.LEVEL3.items():
            try:
                ref = S.get_blas_funcs(routine, arrays)
            except ValueError:
                with pytest.raises(ValueError):
                    B.get_blas_funcs(routine, arrays)
                continue
            got = B.get_blas_funcs(routine, arrays)
            assert got is getattr(B, ref.typecode + routine)
            assert (got.typecode, got.prefix, got.dtype) == (ref.typecode, ref.prefix, ref.dtype)
            assert got.int_dtype == ref.int_dtype
            assert got.module_name == "blasx" and ref.module_name in ("fblas", "cblas")
    for d in ["f", "d", "F", "D", None]:
        assert B.get_blas_funcs("gemm", dtype=d).typecode == S.get_blas_funcs("gemm", dtype=d).typecode


def test_get_blas_funcs_mixed_names_and_errors():
    a = np.zeros((2, 2), dtype=np.complex64)
    got = B.get_blas_funcs(("gemm", "axpy", "herk", "gemv"), (a,))
    ref = S.get_blas_funcs(("gemm", "axpy", "herk", "gemv"), (a,))
    assert isinstance(got, list) and len(got) == 4
    assert got[0] is B.cgemm and got[2] is B.cherk
    assert got[1] is ref[1] and got[3] is ref[3]  # level 1/2: scipy's own routines
    with pytest.raises(ValueError):
        B.get_blas_funcs("nosuchroutine", (a,))
    with pytest.raises(ValueError):
        B.get_blas_funcs("hemm", (np.zeros((2, 2)),))  # no dhemm, in scipy either
    with pytest.raises(ValueError, match="ilp64"):
        B.get_blas_funcs("gemm", (a,), ilp64="sometimes")
    if not S.HAS_ILP64:
        with pytest.raises(RuntimeError, match="ilp64"):
            B.get_blas_funcs("gemm", (a,), ilp64=True)
        with pytest.raises(RuntimeError):
            S.get_blas_funcs("gemm", (a,), ilp64=True)
    assert B.get_blas_funcs("gemm", (a,), ilp64="preferred").typecode == "c"


# ---------------------------------------------------------------- the rest of scipy.linalg.blas

def test_every_scipy_name_is_there():
    names = [n for n in dir(S) if not n.startswith("__")]
    for name in names:
        got = getattr(B, name)
        if name in B.FUNCTIONS or name in ("get_blas_funcs", "find_best_blas_type"):
            assert got is not getattr(S, name)
        else:
            assert got is getattr(S, name), name  # forwarded: the very same object
    assert set(names) <= set(dir(B))
    with pytest.raises(AttributeError, match="nosuch"):
        B.nosuchname  # noqa: B018
    assert set(B.FUNCTIONS) == {p + r for r, ps in B.LEVEL3.items() for p in ps}
    assert all(hasattr(S, n) for n in B.FUNCTIONS)


def test_level1_and_level2_forwarded_results(rand):
    x, y = rand((7,), seed=1), rand((7,), seed=2)
    a = rand((5, 7), seed=3)
    np.testing.assert_array_equal(B.daxpy(x, y.copy(), a=2.0), S.daxpy(x, y.copy(), a=2.0))
    np.testing.assert_array_equal(B.dgemv(1.0, a, x), S.dgemv(1.0, a, x))
    assert B.ddot(x, y) == S.ddot(x, y)
    assert B.HAS_ILP64 == S.HAS_ILP64


def test_from_blasx_linalg_import_blas():
    from blasx import linalg
    assert linalg.blas is B
    assert linalg.get_blas_funcs is B.get_blas_funcs
    assert blasx.linalg is linalg


def test_arguments_bind_as_scipys_and_bad_bindings_name_the_signature(rand, rel_err):
    """Positional and keyword arguments bind as scipy's (the plain-call shortcut and the full path
    alike); a call that does not bind raises TypeError naming the wrapper and its signature."""
    a, b = np.asfortranarray(rand((4, 3), seed=1)), np.asfortranarray(rand((3, 5), seed=2))
    want = a @ b
    for args, kwargs in (((1.0, a, b), {}), ((1.0,), {"a": a, "b": b}), ((), {"alpha": 1.0, "a": a, "b": b}),
                         ((1.0, a.tolist(), b), {"trans_b": 0})):
        assert rel_err(B.dgemm(*args, **kwargs), want) < 1e-13
    for args, kwargs in (((1.0,), {}), ((1.0, a, b), {"nope": 1}), ((1.0, a, b), {"alpha": 2.0}),
                         ((1.0, a, b, 0.0, None, 0, 0, 0, 9), {})):
        with pytest.raises(TypeError, match="dgemm\\(\\): .*; the signature is dgemm\\(alpha, a, b"):
            B.dgemm(*args, **kwargs)


@pytest.mark.parametrize("devices,tile", [("sim:2", 16), ("cpu", 16), ("cpu", None)])
def test_masked_arrays_are_read_and_written_as_their_data(devices, tile):
    """f2py reads a masked array's data and writes c / b in place into it, the mask left alone, and gives the
    masked array back (blasx computed on the masked values' view: wrong values, crashes, cleared masks)."""
    blasx.configure(devices=devices, tile=tile)
    rng = np.random.default_rng(7)
    data = np.asfortranarray(rng.random((20, 20)) + 4 * np.eye(20))
    a, b = np.ma.masked_greater(data, 0.8), np.asfortranarray(rng.random((20, 20)))
    assert np.abs(B.dsyrk(1.5, a) - S.dsyrk(1.5, data)).max() < 1e-12
    for name, args in (("dgemm", (1.0, data, b, 1.0)), ("dtrmm", (1.0, data))):
        mine = np.ma.masked_greater(np.asfortranarray(rng.random((20, 20))), 0.5)
        theirs, mask = np.ma.array(np.asfortranarray(mine.data), mask=mine.mask.copy(), copy=True), mine.mask.copy()
        kw = {"c" if name == "dgemm" else "b": mine, "overwrite_" + ("c" if name == "dgemm" else "b"): 1}
        res = getattr(B, name)(*args, **kw)
        ref = getattr(S, name)(*args, **{**kw, ("c" if name == "dgemm" else "b"): theirs})
        assert res is mine and ref is theirs and np.array_equal(mine.mask, mask)
        assert np.abs(mine.data - theirs.data).max() < 1e-12


def test_herk_does_not_read_the_imaginary_part_of_cs_diagonal(rel_err):
    """BLAS: those values need not be set; with beta not 0 or 1 a NaN there made the diagonal NaN."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((40, 9)) + 1j * rng.standard_normal((40, 9))
    c = np.asfortranarray(rng.standard_normal((40, 40)) + 0j)
    clean = c.copy(order="F")
    c[np.diag_indices(40)] += complex(0, np.nan)
    c[0, 0] = complex(1.0, np.inf)
    clean[0, 0] = 1.0
    for name, args in (("zherk", (1.0, a)), ("zher2k", (1.0, a, a[::-1]))):
        for lower in (0, 1):
            got = getattr(B, name)(*args, beta=0.5, c=c.copy(order="F"), lower=lower)
            ref = getattr(S, name)(*args, beta=0.5, c=clean.copy(order="F"), lower=lower)
            assert np.isfinite(got).all() and rel_err(got, ref) < 1e-12


def test_shape_errors_name_the_shapes_given():
    with pytest.raises(ValueError, match=r"c: got shape \(3, 1\).*\(c of shape \(3,\) taken as \(3, 1\), as f2py"):
        B.dgemm(1.0, np.ones((1, 2)), np.ones((2, 3)), beta=1.0, c=np.ones(3))
    with pytest.raises(ValueError, match=r"\(a of shape \(4,\) taken as \(4, 1\), as f2py takes them\)"):
        B.dsyrk(1.0, np.ones(4), c=np.ones((2, 2)))
