"""The C entry points' direct BLAS calls (blasx._blas_symbols, _hostcall's "Direct BLAS"): a plain
2-D ``matmul`` / ``dot`` calls the cblas gemm numpy's own functions call, ``gemm`` and
``blasx.linalg.blas.?gemm`` the routine scipy's wrapper calls, with the same arguments. They must
give numpy's / scipy's bits, results made as theirs are, numpy's floating-point warnings, and leave
every other call to numpy's / scipy's function (spies show which ran)."""

from __future__ import annotations

import contextlib
import itertools
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg.blas as S

import blasx
from blasx import _blas_symbols as sym
from blasx import _hostcall, level3, numpy_api
from blasx.linalg import blas as B

BLAS = (np.float32, np.float64, np.complex64, np.complex128)

pytestmark = pytest.mark.skipif(_hostcall.kind() != "c", reason="no C library: the Python functions stand alone")


@pytest.fixture(autouse=True)
def _cpu():
    blasx.configure(devices="cpu")
    blasx.engine()  # publishes session.host_device
    yield


@contextlib.contextmanager
def _direct(numpy_gemm=True, scipy_gemm=True):
    """The direct calls of the given families on (the others off), then all of them back."""
    lib = _hostcall._library()
    try:
        yield _hostcall.set_direct(lib, numpy_gemm, scipy_gemm)
    finally:
        _hostcall.set_direct(lib)


def _bits(x):
    return np.asarray(x).tobytes(order="A"), x.dtype, x.shape, x.strides


def _python_run(fn):
    """(fn(), the names of the blasx Python functions called in it)."""
    import os
    import sys
    ran, mark = [], os.sep + "blasx" + os.sep

    def prof(frame, event, arg):
        if event == "call" and mark in frame.f_code.co_filename:
            ran.append(frame.f_code.co_name)
    sys.setprofile(prof)
    try:
        return fn(), ran
    finally:
        sys.setprofile(None)


def _outcome(fn):
    try:
        return "ok", _bits(np.asarray(fn()))
    except Exception as e:  # noqa: BLE001 - compared
        return "error", type(e).__name__, str(e)


def _spy(real, seen):
    def spy(*args, **kw):
        seen.append(args)
        return real(*args, **kw)
    return spy


# ---------------------------------------------------------------- where the routines are

def test_the_routines_are_found_where_numpys_wheels_put_them():
    if not sym.supported():
        pytest.skip("direct calls are made on x86-64 / AArch64 Linux only")
    got = _hostcall.direct()
    assert got["scipy"] is True
    assert got["numpy"] is not None and [sym._CBLAS.match(n).group(2) for n in got["numpy"]] == list("sdcz")


def test_numpys_c_api_slots():
    """The slots the C code calls are the ones numpy's own header names."""
    header = (Path(np.get_include()) / "numpy" / "__multiarray_api.h").read_text()
    for name, slot in sym.API_SLOTS.items():
        m = re.search(rf"#define {name} \\\s*\(\*\(.*?\)\s*\\?\s*PyArray_API\[(\d+)\]\)", header, re.S)
        assert m is not None and int(m.group(1)) == slot, name


def test_elf_imports_and_the_cblas_names_among_them(tmp_path):
    try:
        from numpy._core import _multiarray_umath as umath
    except ImportError:
        from numpy.core import _multiarray_umath as umath
    if not sym.supported():
        pytest.skip("ELF only here")
    names = sym.elf_imports(umath.__file__)
    assert names is not None and "PyObject_GetAttr" in names  # (an undefined symbol numpy surely imports)
    assert sym.cblas_names(names) == _hostcall.direct()["numpy"]
    text = tmp_path / "not-elf.so"
    text.write_text("not an ELF file")
    assert sym.elf_imports(str(text)) is None and sym.elf_imports(str(tmp_path / "missing")) is None
    plain = ["cblas_sgemm", "cblas_dgemm", "cblas_cgemm", "cblas_zgemm"]
    assert sym.cblas_names(plain + ["cblas_dgemm_batch", "cblas_dgemv", "foo"]) == tuple(plain)
    assert sym.cblas_names(["cblas_sgemm_64", "cblas_dgemm_64", "cblas_cgemm_64", "cblas_zgemm_64"])[3] == "cblas_zgemm_64"
    assert sym.cblas_names(plain[:3]) is None  # one missing
    assert sym.cblas_names(plain + ["scipy_cblas_dgemm64_"]) is None  # two of one: which numpy calls is not known
    assert sym.cblas_names(None) is None


def test_a_routine_that_does_not_give_the_reference_bits_is_not_called(monkeypatch):
    """_direct_ok compares with numpy's matmul / scipy's ?gemm: a difference turns that family off."""
    lib = _hostcall._library()
    if _hostcall.direct()["numpy"] is None:
        pytest.skip("no direct matmul here")
    a, b = np.ones((4, 3)), np.ones((3, 5))
    try:
        monkeypatch.setattr(np, "matmul", lambda x, y: np.add(np.dot(x, y), 1.0, dtype=x.dtype))
        got = _hostcall.set_direct(lib)
        monkeypatch.undo()
        assert got == _hostcall.direct() and got["numpy"] is None and got["scipy"] is True
        seen = []
        entry = _hostcall.matmul(blasx.matmul.__wrapped__, _spy(np.matmul, seen), numpy_api._DTYPE_KW)
        assert np.array_equal(entry(a, b), a @ b) and len(seen) == 1
    finally:
        _hostcall.set_direct(lib)
    assert _hostcall.direct()["numpy"] is not None


# ---------------------------------------------------------------- matmul and dot

SHAPES = [(2, 2, 2), (5, 3, 4), (17, 33, 5), (64, 130, 70)]  # (the last one lets the GIL go: m n k >= 64^3)


def _pair(m, k, n, dtype, oa, ob, rand):
    return rand((m, k), dtype, seed=m + k, order=oa), rand((k, n), dtype, seed=k + n, order=ob)


@pytest.mark.parametrize("dtype", BLAS)
def test_matmul_and_dot_give_numpys_bits_without_numpys_function(dtype, rand):
    if _hostcall.direct()["numpy"] is None:
        pytest.skip("no direct matmul here")
    for (m, k, n), oa, ob in itertools.product(SHAPES, "CF", "CF"):
        a, b = _pair(m, k, n, dtype, oa, ob, rand)
        for fn, ref_fn, kind in ((blasx.matmul, np.matmul, "matmul"), (blasx.dot, np.dot, "dot")):
            seen = []
            entry = (_hostcall.matmul(fn.__wrapped__, _spy(ref_fn, seen), numpy_api._DTYPE_KW) if kind == "matmul"
                     else _hostcall.dot(fn.__wrapped__, _spy(ref_fn, seen)))
            ref = ref_fn(a, b)
            for f in (fn, entry):
                got = f(a, b)
                assert _bits(got) == _bits(ref) and type(got) is np.ndarray
                assert got.flags.owndata and got.flags.writeable and got.flags.aligned and got.base is None
            assert not seen, f"numpy's {kind} ran"
            calls = _hostcall.direct_calls()
            fn(a, b)
            assert _hostcall.direct_calls() == calls + 1
            totals = blasx.last_profile().totals()
            assert totals["tasks"] == 1 and totals["flops"] == (8 if np.dtype(dtype).kind == "c" else 2) * m * n * k


@pytest.mark.parametrize("dtype", [np.float64, np.complex64])
def test_other_products_are_numpys_own(dtype, rand):
    """What numpy computes otherwise (syrk for a @ a.T, gemv for a dimension 1, batches, operands of
    two types) goes to numpy's function, whose result it is. Operands numpy copies before its BLAS
    call (strided, reversed) are copied as numpy copies them and the call made directly, where
    the load check found numpy's bits so (``direct()["copies"]``), else numpy's function takes them."""
    a, b = _pair(6, 5, 4, dtype, "C", "F", rand)
    sq = rand((5, 5), dtype, seed=9)
    wide = np.complex128
    own = [(a, a.T), (sq, sq), (a[:1], b), (a, b[:, :1]), (a[None], b), (a, b.astype(wide))]
    copied = [(a[:, ::2], b[::2]), (a.astype(wide), b.astype(wide)[::-1])]
    for (x, y), is_copied in [(c, False) for c in own] + [(c, True) for c in copied]:
        for k, (fn, ref_fn, make) in enumerate(((blasx.matmul, np.matmul, lambda f, s: _hostcall.matmul(f, s, numpy_api._DTYPE_KW)),
                                                (blasx.dot, np.dot, _hostcall.dot))):
            if fn is blasx.dot and x.ndim == 3:
                continue
            seen = []
            got = make(fn.__wrapped__, _spy(ref_fn, seen))(x, y)
            direct = is_copied and _hostcall.direct()["copies"][k]
            assert _bits(got) == _bits(ref_fn(x, y)) and len(seen) == (x.dtype == y.dtype and not direct)
    lib = _hostcall._library()
    try:
        lib.blasx_hc_set_copies(0, 0)
        for x, y in copied:
            seen = []
            got = _hostcall.matmul(blasx.matmul.__wrapped__, _spy(np.matmul, seen), numpy_api._DTYPE_KW)(x, y)
            assert len(seen) == 1 and _bits(got) == _bits(np.matmul(x, y))
        lib.blasx_hc_set_copies(2, 2)  # (copies in the order nearest the strides: what another numpy may do)
        for x, y in copied + [(a[:, ::2], b[::2].T.copy().T[:, :])]:
            for f, ref_fn in ((blasx.matmul, np.matmul), (blasx.dot, np.dot)):
                calls = _hostcall.direct_calls()
                got = f(x, y)
                assert _hostcall.direct_calls() == calls + (x.dtype == y.dtype)
                assert got.shape == ref_fn(x, y).shape and np.allclose(got, ref_fn(x, y), rtol=1e-5, atol=1e-5)
    finally:
        _hostcall.set_direct(lib)


def _block(x, order):
    """x's values as a block of a larger array (a unit stride, a larger leading dimension), NaN around."""
    m, n = x.shape
    big = np.full((m + 3, n + 5), np.nan, dtype=x.dtype, order=order)
    big[2:2 + m, 1:1 + n] = x
    return big[2:2 + m, 1:1 + n]


@pytest.mark.parametrize("dtype", BLAS)
def test_outputs_blocks_and_keywords(dtype, rand):
    """matmul: blocks of larger arrays (numpy hands BLAS their leading dimension), out= C- or
    F-ordered (numpy writes the latter as out.T = b.T a.T), dtype= of the operands' type: direct,
    numpy's bits. dot: out= C-ordered direct, blocks direct through a C-ordered copy (numpy's dot
    copies them); an F-ordered out (numpy refuses it) and outputs that overlap an input: numpy's
    function, its result or error."""
    if _hostcall.direct()["numpy"] is None:
        pytest.skip("no direct matmul here")
    a, b = _pair(7, 5, 6, dtype, "C", "F", rand)
    mm = lambda seen: _hostcall.matmul(blasx.matmul.__wrapped__, _spy(np.matmul, seen), numpy_api._DTYPE_KW)
    dot = lambda seen: _hostcall.dot(blasx.dot.__wrapped__, _spy(np.dot, seen))
    cases = [  # (entry, reference, args, keywords, direct)
        (mm, np.matmul, (_block(a, "C"), _block(b, "F")), {}, True),
        (mm, np.matmul, (_block(a, "F"), b), {}, True),
        (mm, np.matmul, (a, b), {"out": "C"}, True), (mm, np.matmul, (a, b), {"out": "F"}, True),
        (mm, np.matmul, (_block(a, "F"), b), {"out": "C"}, True),
        (mm, np.matmul, (a, b), {"dtype": np.dtype(dtype)}, True),
        (mm, np.matmul, (a, b), {"dtype": np.dtype(dtype), "casting": "same_kind"}, False),
        (dot, np.dot, (a, b), {"out": "C"}, True), (dot, np.dot, (a, b), {"out": "F"}, False),
        (dot, np.dot, (_block(a, "C"), b), {}, _hostcall.direct()["copies"][1]),
    ]
    for make, ref_fn, args, kw, direct in cases:
        outs = []
        for f in (make, None):
            kw2 = dict(kw)
            if isinstance(kw.get("out"), str):
                kw2["out"] = np.full((7, 6), np.nan, dtype, order=kw["out"])
            seen = []
            try:
                got = (ref_fn if f is None else f(seen))(*args, **kw2)
                outs.append(("ok", _bits(got), got is kw2.get("out", got)))
            except Exception as e:  # noqa: BLE001 - numpy's error, both ways
                outs.append(("error", type(e), str(e)))
            if f is not None:
                assert len(seen) == (not direct), (ref_fn.__name__, kw)
        assert outs[0] == outs[1], (ref_fn.__name__, kw)
    sq, y = rand((6, 6), dtype, seed=5, order="C"), rand((6, 6), dtype, seed=6, order="F")
    for make, ref_fn in ((mm, np.matmul), (dot, np.dot)):
        for view in (lambda x: x, lambda x: x.T, lambda x: x[:, :]):  # out is a (view of an) input
            results = []
            for f in (make, None):
                x, seen = sq.copy(), []
                try:
                    (ref_fn if f is None else f(seen))(x, y, out=view(x))
                    results.append(("ok", _bits(x)))
                except ValueError as e:  # (numpy's dot refuses a transposed out)
                    results.append(("error", str(e)))
                if f is not None:
                    assert len(seen) == 1  # numpy's: it computes through a copy
            assert results[0] == results[1]


@pytest.mark.parametrize("name", ["matmul", "dot"])
def test_floating_point_flags_bring_numpys_warnings_and_errors(name):
    """A product that overflows (or makes inf - inf) is handed to numpy's function, which warns or
    raises as np.errstate says; an earlier flag does not warn."""
    fn, ref_fn = getattr(blasx, name), getattr(np, name)
    big, ten = np.full((4, 3), 1e308), np.full((3, 5), 10.0)
    inf, mixed = np.full((4, 2), np.inf), np.array([[1.0, 1, 1], [-1, -1, -1]])
    for x, y, what in ((big, ten, "overflow"), (inf, mixed, "invalid value")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = fn(x, y)
        assert [str(w.message) for w in caught] == [f"{what} encountered in {name}"]
        with np.errstate(all="ignore"):
            assert _bits(got) == _bits(ref_fn(x, y))
        with np.errstate(all="raise"), pytest.raises(FloatingPointError, match=f"{what} encountered in {name}"):
            fn(x, y)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("error")
            fn(x, y)
    with np.errstate(all="ignore"):
        np.float64(1e308) * 10.0  # (a flag raised before the call)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn(np.ones((3, 3)), np.ones((3, 3)))


def test_direct_products_on_many_threads(rand):
    from concurrent.futures import ThreadPoolExecutor
    pairs = [_pair(40 + i, 70, 90, np.float64, "CF"[i % 2], "FC"[i % 3 == 0], rand) for i in range(8)]
    refs = [a @ b for a, b in pairs]

    def work(i):
        a, b = pairs[i % 8]
        got = blasx.matmul(a, b) if i % 2 else blasx.dot(a, b)
        return _bits(got) == _bits(refs[i % 8])
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(200)))


# ---------------------------------------------------------------- gemm

def _alpha(dtype, j):
    """alpha of every type the fast paths take (f2py converts numpy's scalars by value, as the C code)."""
    real = [1.5, -0.75, 2, np.float64(-1.25), np.float32(0.1), np.int64(3), np.int32(-2)]
    cplx = [0.5 - 1.25j, 2j, np.complex128(1 - 0.5j), np.complex64(-0.25 + 0.1j)]
    choice = real + cplx if np.dtype(dtype).kind == "c" else real
    return choice[j % len(choice)]


@pytest.mark.parametrize("dtype", BLAS)
def test_gemm_gives_the_bits_of_its_scipy_call_without_the_wrapper(dtype, rand):
    """blasx.gemm(alpha, a, b[, trans_a, trans_b]) and linalg.blas.?gemm of F- or C-ordered operands
    and blocks of larger arrays, every op, alpha of every type: the bits of the same call through
    scipy's wrapper (the direct calls off; linalg.blas.?gemm: scipy's own ?gemm, which copies what
    is not F-ordered, as the direct call does; blasx.gemm reads an aligned C-ordered operand as its
    transpose, with the direct calls and without), the wrapper never called."""
    if not _hostcall.direct()["scipy"]:
        pytest.skip("no direct gemm here")
    routine = S.get_blas_funcs("gemm", dtype=dtype)
    seen = []
    spies = dict(level3._HOST_GEMM)
    spies[np.dtype(dtype)] = _spy(spies[np.dtype(dtype)], seen)
    entry = _hostcall.gemm(blasx.gemm.__wrapped__, spies, level3._HOST_SCALARS)
    lane = getattr(B, routine.typecode + "gemm")
    j = 0
    for (m, k, n), ta, tb, oa, ob in itertools.product(SHAPES[:3], range(3), range(3), ("C", "F", "block"), "CF"):
        a = rand((m, k) if ta == 0 else (k, m), dtype, seed=j, order="F" if oa == "F" else "C")
        b = rand((k, n) if tb == 0 else (n, k), dtype, seed=j + 1, order=ob)
        a = _block(a, "F") if oa == "block" else a  # (a block: the wrapper copies it, so does the direct call)
        alpha, j = _alpha(dtype, j), j + 1
        kw = {"trans_a": ta, "trans_b": tb}
        with _direct(scipy_gemm=False):
            before = [blasx.gemm(alpha, a, b, **kw), lane(alpha, a, b, **kw)]
        calls = _hostcall.direct_calls()
        got = [entry(alpha, a, b, **kw), lane(alpha, a, b, **kw)]
        assert _hostcall.direct_calls() == calls + 2
        assert [_bits(x) for x in got] == [_bits(x) for x in before]
        assert _bits(got[1]) == _bits(routine(alpha, a, b, **kw))
        assert got[0].flags.f_contiguous and got[0].flags.owndata
    assert not seen, "scipy's ?gemm wrapper ran"
    with _direct(scipy_gemm=False):
        entry(1.5, a, b, **kw)
    assert len(seen) == 1  # (the spy is the wrapper this entry calls)


@pytest.mark.parametrize("dtype", BLAS)
def test_gemm_with_c(dtype, rand):
    """blasx.gemm with c: overwrite_c with an F-ordered c (in place) and a C-ordered one (c.T in
    place), c itself; without overwrite_c, an F-ordered copy (the wrapper's), c untouched; the bits
    of the wrapper's call; NaN in c with beta 0 stays out."""
    if not _hostcall.direct()["scipy"]:
        pytest.skip("no direct gemm here")
    a, b = rand((7, 5), dtype, seed=1, order="F"), rand((5, 6), dtype, seed=2, order="C")
    for order, beta, ow in itertools.product("FC", (0.0, 0.5, 2), (0, 1)):
        c0 = rand((7, 6), dtype, seed=3, order=order)
        if beta == 0.0:
            c0[...] = np.nan
        outs = []
        for on in (False, True):
            c = c0.copy(order="K")
            with _direct(scipy_gemm=on):
                calls = _hostcall.direct_calls()
                res = blasx.gemm(1.25, a, b, beta=beta, c=c, overwrite_c=ow)
                assert _hostcall.direct_calls() - calls == on
            assert (res is c) == bool(ow) and np.isfinite(res).all()
            assert ow or _bits(c) == _bits(c0)
            outs.append(_bits(res))
        assert outs[0] == outs[1]


# ---------------------------------------------------------------- the scipy-signature routines

ROUTINES = {"gemm": ("trans_a", "trans_b"), "symm": ("side", "lower"), "hemm": ("side", "lower"),
            "syrk": ("trans", "lower"), "herk": ("trans", "lower"), "syr2k": ("trans", "lower"),
            "her2k": ("trans", "lower"), "trmm": ("side", "lower", "trans_a", "diag"),
            "trsm": ("side", "lower", "trans_a", "diag")}
FLAG_VALUES = {"trans_a": (0, 1, 2), "trans_b": (0, 1, 2), "trans": (0, 1, 2), "side": (0, 1), "lower": (0, 1),
               "diag": (0, 1)}


OTHER_TYPE = {"s": np.float64, "d": np.float32, "c": np.complex128, "z": np.complex64}  # convertible ones


def _lanes():
    for prefix, routine in itertools.product("sdcz", ROUTINES):
        if routine.startswith("he") and prefix in "sd":
            continue
        yield prefix, routine


def test_every_lane_has_its_scipy_routine():
    if not _hostcall.direct()["scipy"]:
        pytest.skip("no direct calls of scipy's routines here")
    lib = _hostcall._library()
    for prefix, routine in _lanes():
        assert lib.blasx_hc_lane_routine(getattr(B, prefix + routine)) == sym.scipy_routine(prefix, routine), routine
    assert sym.f77_args("void (char *, int *, double *, __pyx_t_double_complex *)") == "cipp"
    assert sym.f77_args("void (char *, void *)") == "c?" and sym.f77_args("int (char *)") == "?"
    typedef = "void (char *, __pyx_t_5scipy_6linalg_11cython_blas_blas_int *, __pyx_t_5scipy_6linalg_11cython_blas_d *)"
    assert [sym.f77_args(typedef, bits) for bits in (32, 64, None)] == ["cip", "c?p", "c?p"]  # (scipy >= 1.18)
    assert sym.f77_args("void (char *, int64_t *, long *)") == "c??"
    assert sym.blas_int_bits() == 32  # (scipy's wheels; the call that finds it is safe at 64 bits too)


def _lane_operands(routine, fl, dtype, rand, seed):
    m, n, k = 6, 4, 5
    if routine == "gemm":
        return [rand((k, m) if fl["trans_a"] else (m, k), dtype, seed=seed),
                rand((n, k) if fl["trans_b"] else (k, n), dtype, seed=seed + 1)], (m, n)
    if routine in ("symm", "hemm", "trmm", "trsm"):
        s = n if fl["side"] else m
        a = rand((s, s), dtype, seed=seed) + 4 * np.eye(s, dtype=dtype)
        return [np.asfortranarray(a), rand((m, n), dtype, seed=seed + 1)], (m, n)
    a = rand((k, n) if fl["trans"] else (n, k), dtype, seed=seed)
    return ([a, rand(a.shape, dtype, seed=seed + 1)] if routine.endswith("2k") else [a]), (n, n)


@pytest.mark.parametrize("prefix,routine", list(_lanes()))
def test_lanes_give_the_wrappers_bits(prefix, routine, rand):
    """Every flag combination (those blasx refuses: the same error), operands F- or C-ordered, blocks
    of larger arrays and of another type, with c and beta (c C-ordered, of another type),
    overwrite_c / overwrite_b, alpha 0: the same outcome with the direct calls on and off, and
    scipy's wrapper's bits; each call one direct call."""
    if not _hostcall.direct()["scipy"]:
        pytest.skip("no direct calls of scipy's routines here")
    dtype = np.dtype({"s": np.float32, "d": np.float64, "c": np.complex64, "z": np.complex128}[prefix])
    fn, ref_fn = getattr(B, prefix + routine), getattr(S, prefix + routine)
    tri = routine in ("trmm", "trsm")
    real_scalars = routine in ("herk",)
    seed = 0
    for values in itertools.product(*(FLAG_VALUES[f] for f in ROUTINES[routine])):
        fl = dict(zip(ROUTINES[routine], values))
        ops, shape = _lane_operands(routine, fl, dtype, rand, seed)
        seed += 2
        alpha = 1.25 if real_scalars or dtype.kind == "f" else 1.25 - 0.5j
        other = OTHER_TYPE[prefix]  # (an array of another type: the wrapper converts it, so does the direct call)
        forms = [((alpha, *ops), {}), ((alpha, np.ascontiguousarray(ops[0]), *ops[1:]), {}),
                 ((alpha, _block(ops[0], "C"), *ops[1:]), {}), ((alpha, ops[0].astype(other), *ops[1:]), {})]
        if not tri:
            c = rand(shape, dtype, seed=seed)
            forms += [((alpha, *ops), {"beta": 0.5, "c": c}), ((alpha, *ops), {"beta": 2, "c": c, "overwrite_c": 1}),
                      ((0.0, *ops), {"beta": 0.5, "c": c}) if routine != "gemm" else ((2, *ops), {"c": c}),
                      ((alpha, *ops), {"beta": 0.5, "c": np.ascontiguousarray(c)}),
                      ((alpha, *ops), {"beta": 0.5, "c": c.astype(other), "overwrite_c": 1})]
        else:
            forms += [((alpha, *ops), {"overwrite_b": 1}), ((0.0, *ops), {}),
                      ((alpha, ops[0], np.ascontiguousarray(ops[1])), {}),
                      ((alpha, ops[0], ops[1].astype(other)), {"overwrite_b": 1})]
        for args, kw in forms:
            outcomes, made = [], None
            for on in (True, False, None):  # direct calls on, off; scipy's wrapper
                args2 = [x.copy(order="K") if isinstance(x, np.ndarray) else x for x in args]
                kw2 = {k: v.copy(order="K") if isinstance(v, np.ndarray) else v for k, v in kw.items()}
                try:
                    if on is None:
                        got = ref_fn(*args2, **fl, **kw2)
                    else:
                        with _direct(scipy_gemm=on):
                            calls = _hostcall.direct_calls()
                            got = fn(*args2, **fl, **kw2)
                            if on:
                                made = _hostcall.direct_calls() - calls
                    written = kw2.get("c", args2[-1] if tri else None)
                    outcomes.append(("ok", _bits(got), got is written))
                except Exception as e:  # noqa: BLE001 - compared between the three
                    outcomes.append(("error", type(e).__name__))
            if outcomes[0][0] == "error":  # (blasx refuses what scipy may not: herk's trans 1, say)
                assert outcomes[0] == outcomes[1], (fl, kw)
            else:
                assert outcomes[0] == outcomes[1] == outcomes[2], (fl, kw)
                assert made == 1, (fl, kw)


def test_a_lane_whose_routine_differs_keeps_the_wrapper(rand):
    if not _hostcall.direct()["scipy"]:
        pytest.skip("no direct calls of scipy's routines here")
    lib, fn = _hostcall._library(), B.dsymm
    flags = {"side": {0, 1}, "lower": {0, 1}}
    try:
        _hostcall._lane_direct(lib, fn, "symm", np.dtype(np.float64), lambda *a, **k: S.dsymm(*a, **k) * 1.0001,
                               flags, ("side", "lower"))
        assert lib.blasx_hc_lane_routine(fn) is None
        a, b = rand((5, 5), seed=1), rand((5, 3), seed=2)
        assert _bits(fn(1.5, a, b)) == _bits(S.dsymm(1.5, a, b))
    finally:
        _hostcall._lane_direct(lib, fn, "symm", np.dtype(np.float64), S.dsymm, flags, ("side", "lower"))
    assert lib.blasx_hc_lane_routine(fn) == sym.scipy_routine("d", "symm")


@pytest.mark.parametrize("dtype", BLAS)
def test_alpha_zero_gemm_scales_c_in_c(dtype, rand):
    """gemm with alpha 0: C = beta C made in C, as host_scale makes it (real types: the same products
    in a loop; complex: host_scale's np.multiply call; beta 0: zeros, NaN in c not read), in place or
    into a new F-ordered array, for every entry (blasx.gemm, linalg.blas.?gemm), c C- or F-ordered;
    A and B (NaN) unread; no blasx Python (not even host_scale)."""
    a, b = rand((6, 4), dtype, seed=1), rand((4, 5), dtype, seed=2)
    a[0, 0] = b[1, 1] = np.nan
    lane = getattr(B, "sdcz"[BLAS.index(dtype)] + "gemm")
    betas = (0.5, -3, 0.0) + ((np.float64(1.5),) if np.dtype(dtype).kind == "f" else (0.5 - 2j, 1j))
    for f, order, beta, ow, nan in itertools.product((blasx.gemm, lane), "FC", betas, (0, 1), (False, True)):
        c0 = rand((6, 5), dtype, seed=3, order=order)
        if nan:
            c0[2, 3] = np.nan
        c, ref_c = c0.copy(order="K"), c0.copy(order="K")
        got, ran = _python_run(lambda: f(0.0, a, b, beta=beta, c=c, overwrite_c=ow))
        assert not ran, ran  # (not even host_scale)
        ref = level3.host_scale(beta, ref_c, bool(ow) and (f is blasx.gemm or order == "F"), (6, 5), np.dtype(dtype))
        assert _bits(np.asfortranarray(got)) == _bits(np.asfortranarray(ref)) and got.dtype == dtype
        assert (got is c) == (bool(ow) and (f is blasx.gemm or order == "F"))
        if beta == 0.0:
            assert not np.isnan(got).any()
        assert blasx.last_profile().totals()["flops"] == 0.0


def test_nested_lists_are_made_arrays_in_c(rand):
    """matmul / dot of nested lists (numpy's arrays of them, as np.asarray makes them) and
    blasx.linalg.blas routines of lists as a and b (arrays of the routine's type, as scipy's wrapper
    makes them) made in C, then the direct call: numpy's / scipy's bits, no Python. Lists numpy
    makes other arrays of for matmul (ints) or none of (ragged), complex numbers for a real
    routine, and blasx's own functions (which reject lists) keep their paths."""
    a, b = rand((6, 4), seed=1, order="C"), rand((4, 5), seed=2, order="C")
    la, lb = a.tolist(), b.tolist()
    cases = [(blasx.matmul, np.matmul, (la, lb)), (blasx.matmul, np.matmul, (a, lb)), (blasx.dot, np.dot, (la, b)),
             (B.dgemm, S.dgemm, (1.5, la, lb)), (B.dsyrk, S.dsyrk, (0.5, la)), (B.zgemm, S.zgemm, (1j, la, b)),
             (B.dtrmm, S.dtrmm, (2.0, (np.eye(6) + np.triu(a @ a.T)).tolist(), a.tolist())),
             (B.sgemm, S.sgemm, (1.5, la, lb)), (B.cgemm, S.cgemm, (2.0, (a + 1j).tolist(), lb)),
             (B.zsyrk, S.zsyrk, (1.0, [[1.5, 2j], [0.5 - 1j, 3.0]]))]  # (typed conversions: floats / complex)
    for f, ref, args in cases:
        calls = _hostcall.direct_calls()
        got, ran = _python_run(lambda: f(*args))
        assert not ran, ran
        assert _hostcall.direct_calls() == calls + 1
        assert _bits(np.asarray(got)) == _bits(np.asarray(ref(*args)))
    ints = [[1, 2], [3, 4]]
    assert blasx.matmul(ints, ints).dtype == np.matmul(ints, ints).dtype
    calls = _hostcall.direct_calls()
    with pytest.raises(ValueError):
        blasx.matmul([[1.0, 2.0], [3.0]], ints)
    assert _hostcall.direct_calls() == calls
    with pytest.raises(Exception):
        blasx.dsyrk(1.0, la)  # (blasx's own functions reject lists)
    # lists scipy converts to the routine's type (ints, None as NaN): scipy's bits, as the Python path
    # gives them; complex numbers for a real routine (numpy's typed conversion refuses): the Python path
    for odd in ([[1, 2], [3, 4]], [[1.0, None], [2.0, 3.0]]):
        got, ran = _python_run(lambda: _outcome(lambda: B.dgemm(1.0, odd, odd)))
        assert not ran and got == _outcome(lambda: S.dgemm(1.0, odd, odd))
    cplx = [[1.0, 2j], [3.0, 4.0]]
    seen = []
    for f in (B.dgemm, B.dgemm.__wrapped__):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, ran = _python_run(lambda: _outcome(lambda: f(1.0, cplx, cplx)))
        seen.append((got, [str(w.message) for w in caught], "second" in ran))
    assert seen[0] == seen[1] and seen[0][2] and "discards the imaginary part" in seen[0][1][0]


@pytest.mark.parametrize("dtype", BLAS)
def test_tensordot_of_c_ordered_operands_is_one_direct_call(dtype, rand):
    """tensordot(a, b, n) with an int n (or the default 2) of C-ordered operands: numpy's tensordot
    is dot(a.reshape(M, K), b.reshape(K, N)).reshape(...) on views, one cblas_?gemm call, made
    directly here: numpy's bits and shape, numpy's function not called. Other calls (axes as
    pairs, F-ordered operands, a dimension 1, mismatched shapes, overflow) are numpy's function's."""
    if _hostcall.direct()["numpy"] is None:
        pytest.skip("no direct calls of numpy's BLAS here")
    seen = []
    entry = _hostcall.tensordot(blasx.tensordot.__wrapped__, _spy(np.tensordot, seen))
    c3, d3 = rand((4, 5, 6), dtype, seed=1, order="C"), rand((5, 6, 7), dtype, seed=2, order="C")
    a, b = rand((9, 8), dtype, seed=3, order="C"), rand((8, 5), dtype, seed=4, order="C")
    direct = [((a, b, 1), {}), ((c3, d3), {}), ((c3, d3, 2), {}), ((c3, rand((6, 3), dtype, seed=5, order="C"), 1), {}),
              ((c3, d3), {"axes": 2})]
    for args, kw in direct:
        calls = _hostcall.direct_calls()
        got = entry(*args, **kw)
        assert _hostcall.direct_calls() == calls + 1 and not seen
        assert _bits(got) == _bits(np.tensordot(*args, **kw)) and got.flags.c_contiguous
    others = [((a, b), {"axes": ([1], [0])}), ((np.asfortranarray(a), b, 1), {}), ((a[:1], b, 1), {}),
              ((c3, d3, 1), {}), ((a, a, 1), {}), ((np.full((4, 3), 1e200), np.full((3, 5), 1e200), 1), {})]
    for args, kw in others:
        seen.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, ref = _outcome(lambda: entry(*args, **kw)), _outcome(lambda: np.tensordot(*args, **kw))
        assert got == ref and len(seen) == (args[0].dtype == args[1].dtype)
        assert len(caught) % 2 == 0  # (the overflow: numpy's warning once for each)


def test_direct_scipy_calls_on_many_threads(rand):
    """Large enough to let the GIL go during the BLAS call (m n k >= 64^3): the lanes' and gemm's direct
    calls from several threads at once, each the wrapper's bits, each recorded on its own thread."""
    from concurrent.futures import ThreadPoolExecutor
    a, b, c = (rand((96, 96), np.float64, seed=s) for s in (1, 2, 3))
    calls = [(B.dgemm, S.dgemm, (1.5, a, b)), (B.dsyrk, S.dsyrk, (0.5, a)), (B.dtrsm, S.dtrsm, (2.0, a + 96 * np.eye(96), b)),
             (B.dsymm, S.dsymm, (1.0, a, b, 0.5, c))]
    refs = [_bits(ref(*args)) for _, ref, args in calls]

    def work(i):
        f, _, args = calls[i % len(calls)]
        got = f(*args)
        return _bits(got) == refs[i % len(calls)] and blasx.last_profile().totals()["tasks"] == 1
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(80)))
