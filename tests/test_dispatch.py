"""The front ends on the one dispatch path (blasx.dispatch), on the CPU alone and on two sims:
the prefixed gemms, outputs validated before any work (read-only and broadcast outputs copied as
scipy copies them, a read-only out= named), one dtype rule per signature, zero-stride operands,
scipy's argument forms through blasx.linalg.blas, the first call of a process, and the entry a
new front end uses."""

from __future__ import annotations

import inspect
import itertools
import tracemalloc

import numpy as np
import pytest
import scipy.linalg.blas as S

import blasx
from blasx import dispatch
from blasx.linalg import blas as B
from blasx.runtime.plans import plan_gemm

DEVICES = ["cpu", "sim:2"]
DT = {"s": np.float32, "d": np.float64, "c": np.complex64, "z": np.complex128}


@pytest.fixture(params=DEVICES)
def devices(request):
    blasx.configure(devices=request.param, tile=None if request.param == "cpu" else 16)
    return request.param


# ---------------------------------------------------------------- blasx.?gemm

@pytest.mark.parametrize("prefix", "sdcz")
def test_prefixed_gemm_has_scipys_signature_and_casts(prefix, devices, rand, rel_err, tol):
    fn = getattr(blasx, prefix + "gemm")
    assert prefix + "gemm" in blasx.__all__
    ref_fn = getattr(S, prefix + "gemm")
    assert list(inspect.signature(fn).parameters) == list(B.signature_of("gemm").parameters)
    a, b, c = rand((17, 13), np.float64, 1), rand((13, 11), np.float32, 2), rand((17, 11), np.int64, 3)
    for args, kw in [((1.5, a, b), {}), ((2, a.astype(np.int32), b), {"beta": 0.5, "c": c}),
                     ((1.0, a.T.copy(), b), {"trans_a": 1}), ((1.0, a, b.astype(np.complex64) if prefix in "cz" else b),
                                                              {"c": np.asfortranarray(c), "beta": 1, "overwrite_c": 1})]:
        got, ref = fn(*args, **kw), ref_fn(*args, **kw)
        assert got.dtype == ref.dtype == DT[prefix] and got.shape == ref.shape and got.flags.f_contiguous
        assert rel_err(got, ref) < 50 * tol(DT[prefix])


# ---------------------------------------------------------------- outputs

def _read_only(x):
    x = x.copy(order="K")
    x.flags.writeable = False
    return x


def _out_calls(rand):
    """(name, call(out), the scipy call it stands for) with a read-only or broadcast output."""
    a, b = rand((8, 6), seed=1), rand((6, 5), seed=2)
    sq, m = rand((8, 8), seed=3) + 4 * np.eye(8), rand((8, 5), seed=4)
    return [
        ("blasx.gemm", lambda c: blasx.gemm(1.0, a, b, 0.5, c, overwrite_c=1), lambda c: S.dgemm(1.0, a, b, 0.5, c, overwrite_c=1)),
        ("blasx.dgemm", lambda c: blasx.dgemm(1.0, a, b, 0.5, c, overwrite_c=1), lambda c: S.dgemm(1.0, a, b, 0.5, c, overwrite_c=1)),
        ("linalg.dgemm", lambda c: B.dgemm(1.0, a, b, 0.5, c, overwrite_c=1), lambda c: S.dgemm(1.0, a, b, 0.5, c, overwrite_c=1)),
        ("blasx.symm", lambda c: blasx.symm(1.0, sq, m, 0.5, c, overwrite_c=1), lambda c: S.dsymm(1.0, sq, m, 0.5, c, overwrite_c=1)),
        ("linalg.dsymm", lambda c: B.dsymm(1.0, sq, m, 0.5, c, overwrite_c=1), lambda c: S.dsymm(1.0, sq, m, 0.5, c, overwrite_c=1)),
        ("blasx.dtrmm", lambda x: blasx.dtrmm(1.0, sq, x, overwrite_b=1), lambda x: S.dtrmm(1.0, sq, x, overwrite_b=1)),
        ("linalg.dtrsm", lambda x: B.dtrsm(1.0, sq, x, overwrite_b=1), lambda x: S.dtrsm(1.0, sq, x, overwrite_b=1)),
    ]


@pytest.mark.parametrize("kind", ["read-only", "broadcast"])
def test_read_only_outputs_are_copied(kind, devices, rand, rel_err):
    """A read-only c (b for trmm/trsm) or a broadcast view given with overwrite_*: a new array is
    returned and the output left alone, on every device (a read-only c used to kill every sim in
    write-back). scipy does so for a broadcast view; into a read-only F-ordered array scipy 1.17's
    f2py writes anyway, blasx does not."""
    for name, call, ref_call in _out_calls(rand):
        shape = (8, 5)
        if kind == "read-only":
            out = _read_only(rand(shape, seed=5))
        else:
            out = np.broadcast_to(rand((1, 5), seed=5), shape)
            assert ref_call(out) is not out
        before = out.copy()
        got = call(out)
        assert got is not out, name
        np.testing.assert_array_equal(out, before)
        assert rel_err(got, ref_call(before.copy(order="F"))) < 1e-12, name
    a = rand((20, 20), seed=6)
    assert rel_err(blasx.gemm(1.0, a, a), a @ a) < 1e-12  # every device still lives


# ---------------------------------------------------------------- dtype rules

DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.int32, np.int64, np.uint64, np.float16, np.float32, np.float64,
          np.longdouble, np.complex64, np.complex128, np.clongdouble]


def test_gemm_picks_scipys_blas_type(devices):
    """blasx.gemm and the generic routines: the type scipy's find_best_blas_type picks, exactly;
    except gemm of two float16 or two int8 operands (blasx.precision: float16, int32)."""
    reduced = {np.float16: np.float16, np.int8: np.int32}
    for da, db in itertools.product(DTYPES, repeat=2):
        a, b = np.ones((3, 2), da), np.ones((2, 4), db)
        want = reduced[da] if da is db and da in reduced else S.find_best_blas_type((a, b))[1]
        got = blasx.gemm(1, a, b)
        assert got.dtype == want, (da, db)
        assert blasx.syrk(1, a).dtype == S.find_best_blas_type((a,))[1]
        np.testing.assert_array_equal(got, np.full((3, 4), 2, want))


def test_numpy_front_end_follows_numpy(devices, rand):
    """matmul / dot / tensordot: BLAS result types on blasx, every other type numpy's own function
    (numpy's dtype and values); two int8 operands give int32 (blasx.precision)."""
    for da, db in itertools.product((np.bool_, np.int8, np.int64, np.float16, np.float32, np.complex64), repeat=2):
        a, b = (np.arange(12) % 3).reshape(3, 4).astype(da), (np.arange(8) % 2).reshape(4, 2).astype(db)
        for got, ref in ((blasx.matmul(a, b), np.matmul(a, b)), (blasx.dot(a, b), np.dot(a, b)),
                         (blasx.tensordot(a, b, 1), np.tensordot(a, b, 1))):
            assert got.dtype == (np.int32 if da is db is np.int8 else ref.dtype), (da, db)
            np.testing.assert_allclose(got, ref, rtol=1e-6)


# ---------------------------------------------------------------- zero strides

def test_zero_stride_operands_are_validated_before_any_copy(devices, expect):
    """np.broadcast_to of a huge array: a bad call raises before anything is copied (a copy of
    these would take terabytes)."""
    huge = np.broadcast_to(np.ones((1, 1), np.int32), (1 << 20, 1 << 20))
    small = np.ones((3, 3))
    expect(ValueError, "a, b", "inner dimensions", call=lambda: blasx.gemm(1.0, huge, small))
    expect(ValueError, "a, b", call=lambda: B.dgemm(1.0, huge, small))
    expect(ValueError, "a, b", call=lambda: blasx.dgemm(1.0, small, huge))
    expect(ValueError, "b:", call=lambda: blasx.dsyr2k(1.0, small, huge))
    expect(ValueError, "a:", call=lambda: blasx.trsm(1.0, huge, small))


@pytest.mark.parametrize("call, product", [(lambda x, y: B.dgemm(1.0, x, y), True),
                                           (lambda x, y: blasx.gemm(1.0, x, y.astype(np.float32)), True),
                                           (lambda x, y: blasx.dsymm(1.0, x, y), False),
                                           (lambda x, y: B.dtrsm(1.0, x, y), False)])
def test_zero_stride_operand_is_copied_at_most_once(call, product):
    """A broadcast operand that must be converted and made compact: one copy, not two (the front
    ends' conversion, the same for every device: measured on the CPU, where nothing else allocates)."""
    blasx.configure(devices="cpu")
    n = 1000
    bc = np.broadcast_to(np.arange(n, dtype=np.int32) % 7 + n * (np.arange(n) == 0), (n, n))  # float64: 8 MB
    b = np.ones((n, 2))
    ref = bc.astype(np.float64) @ b
    blasx.engine()
    tracemalloc.start()
    try:
        got = call(bc, b)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if product:
        np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert peak < 1.5 * n * n * 8, peak


# ---------------------------------------------------------------- scipy's argument forms

V3 = np.arange(1.0, 4.0)
M33 = np.arange(1.0, 10.0).reshape(3, 3) + 4 * np.eye(3)
FORMS = [
    ("dgemm", (1.0, [[1, 2], [3, 4]], [[1], [1]]), {}),                       # nested lists
    ("dgemm", (1.0, [1, 2], [[1, 2]]), {}),                                   # a 1-D list is a column
    ("dgemm", (1.0, V3, np.ones((1, 3))), {}),                                # 1-D a: a column
    ("dgemm", (1.0, np.ones((1, 3)), V3), {}),                                # 1-D b: a column
    ("dgemm", (1.0, M33, V3), {}),
    ("dgemm", (2.0, np.float64(3.0), np.ones((1, 4))), {}),                   # numpy scalar a: 1x1
    ("dgemm", (2.0, 3.0, [[1.0, 2.0]]), {}),                                  # Python scalar a
    ("dgemm", (1.0, 2.0, 3.0, 1.0, 4.0), {}),                                 # all scalars: a 0-d result
    ("dgemm", (1.0, 2.0, 3.0, 1.0, np.array(4.0)), {}),                       # 0-d c: a 0-d result
    ("dgemm", (1.0, 2.0, 3.0, 1.0, [[4.0]]), {}),
    ("dgemm", (1.0, M33, V3, 1.0, V3), {}),                                   # 1-D c: a 1-D result
    ("dgemm", (np.array(2.0), M33, M33), {}),                                 # 0-d alpha
    ("dgemm", ([2.0], M33, M33), {"beta": [0.5], "c": M33}),                  # one-element lists
    ("dgemm", (True, M33, M33), {"trans_b": True}),
    ("dgemm", (1, M33.astype(np.int32), M33.astype(np.float32)), {}),
    ("sgemm", (1, [[1, 2], [3, 4]], [[1, 0], [0, 1]]), {}),
    ("zgemm", (1, M33, M33), {}),
    ("dgemm", (1, np.ones((0, 3)), np.ones((3, 0))), {}),
    ("dgemm", (1, np.ones((3, 0)), np.ones((0, 3))), {}),
    ("dgemm", (1, np.ones((3, 0)), np.ones((0, 3)), 1.0, np.ones((3, 3))), {}),
    ("dsyrk", (1.0, V3), {}),
    ("dsyrk", (1.0, V3), {"trans": 1}),
    ("dsyrk", (1.0, 3.0), {}),
    ("dsyrk", (1.0, [[1, 2]]), {}),
    ("dsyrk", (1.0, 2.0, 1.0, 3.0), {}),
    ("dsyrk", (1.0, V3, 1.0, M33), {}),
    ("dsyrk", (1, np.ones((3, 0))), {}),
    ("dsyr2k", (1.0, V3, V3), {}),
    ("dsyr2k", (1.0, 2.0, 3.0, 1.0, 4.0), {}),
    ("zherk", (1.0, V3), {}),
    ("zher2k", (1.0, V3, V3 * 1j), {}),
    ("dsymm", (1.0, 2.0, [[1, 2, 3]]), {}),
    ("dsymm", (1.0, 2.0, V3), {"side": 1}),
    ("dsymm", (1.0, M33, V3), {}),
    ("dsymm", (1.0, M33, V3, 1.0, V3), {}),
    ("dsymm", (1.0, 2.0, 3.0, 1.0, 4.0), {}),
    ("dsymm", (1, np.ones((3, 3)), np.ones((3, 0))), {}),
    ("zhemm", (1.0, M33, V3 + 1j), {}),
    ("dtrmm", (1.0, 2.0, 3.0), {}),                                           # 0-d b: a 0-d result
    ("dtrmm", (1.0, 2.0, np.array(3.0)), {}),
    ("dtrmm", (1.0, 2.0, [3.0]), {}),                                         # 1-D b: a 1-D result
    ("dtrmm", (1.0, M33, [1.0, 2.0, 3.0]), {}),
    ("dtrmm", (1.0, 2.0, V3), {"side": 1}),
    ("dtrmm", (1, np.ones((0, 0)), np.ones((0, 3))), {}),
    ("dtrsm", (1.0, M33, V3), {}),
    ("dtrsm", (1.0, 2.0, 3.0), {}),
    ("ztrsm", (1.0, M33, V3), {"lower": 1}),
]


@pytest.mark.parametrize("name, args, kw", FORMS, ids=[f"{i}-{f[0]}" for i, f in enumerate(FORMS)])
def test_scipy_argument_forms(name, args, kw, devices):
    ref = getattr(S, name)(*args, **kw)
    got = getattr(B, name)(*args, **kw)
    assert type(got) is type(ref)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    np.testing.assert_allclose(got, ref, rtol=1e-6 if name[0] in "sc" else 1e-12)


@pytest.mark.parametrize("name, args", [("dgemm", (1.0, M33, V3, 1.0)), ("dsymm", (1.0, M33, V3, 1.0)),
                                        ("dtrmm", (1.0, M33)), ("dsyrk", (1.0, np.ones(1), 1.0))])
def test_rank_one_outputs_written_in_place_as_scipy_does(name, args, devices):
    results = []
    for mod in (S, B):
        out = np.arange(1.0, 4.0) if name != "dsyrk" else np.ones(1)
        r = getattr(mod, name)(*args, out, **({"overwrite_b": 1} if name == "dtrmm" else {"overwrite_c": 1}))
        results.append((r is out, r.copy()))
    assert results[0][0] == results[1][0]
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-12)


# ---------------------------------------------------------------- one route, from the first call

@pytest.mark.parametrize("call", [
    lambda a, b: blasx.gemm(1.0, a, b), lambda a, b: blasx.matmul(a, b), lambda a, b: blasx.dot(a, b),
    lambda a, b: B.sgemm(1.0, a, b, 0.5, a @ b), lambda a, b: blasx.syrk(1.0, a), lambda a, b: B.strsm(1.0, a, b),
], ids=["gemm", "matmul", "dot", "linalg-sgemm", "syrk", "linalg-strsm"])
@pytest.mark.parametrize("spec", ["cpu", "sim:1"])
def test_first_call_is_bit_identical_to_later_ones(call, spec, rand):
    """The first call of an engine takes the route of every later one. (With several devices the
    order of a tile's k-steps follows what each has cached, so bits may differ between any two calls.)"""
    blasx.configure(devices=spec)
    a = rand((96, 96), np.float32, seed=1) + 8 * np.eye(96, dtype=np.float32)
    b = rand((96, 96), np.float32, seed=2)
    blasx.shutdown()  # the next call is the first of its engine
    first = call(a, b)
    for _ in range(2):
        np.testing.assert_array_equal(call(a, b), first)


def test_each_device_kind_takes_its_one_route(devices, rand, monkeypatch):
    """The CPU alone: scipy's routine (a host record), never the engine; sims: the engine, never a
    host routine. Plain calls (blasx.shortcut) and those that take the full path alike."""
    ran = []
    submit = dispatch.submit_planned
    monkeypatch.setattr(dispatch, "submit_planned", lambda *a, **k: ran.append("engine") or submit(*a, **k))
    a, b = rand((30, 20), seed=1), rand((20, 10), seed=2)
    af, bf = np.asfortranarray(a), np.asfortranarray(b)
    for call in (lambda: blasx.gemm(1.0, a, b), lambda: blasx.dsyrk(1.0, a), lambda: B.ztrmm(1.0, a[:20], b),
                 lambda: B.dgemm(1.0, af, bf), lambda: blasx.dsyrk(1.0, af), lambda: B.dtrmm(1.0, af[:20], bf)):
        n = len(ran)
        call()
        if len(ran) == n:
            ran.append("host" if type(dispatch._tls.stats) is tuple else "?")
    assert ran == (["host"] * 6 if devices == "cpu" else ["engine"] * 6)


# ---------------------------------------------------------------- the entry of a new front end

def test_run_takes_canonical_views_and_a_planner(devices, rand, rel_err):
    """What blasx.dnn will do: canonical views, a planner, and the host routine for the CPU alone."""
    a, b = rand((40, 30), seed=1), rand((30, 20), seed=2)
    c = np.empty((40, 20), order="F")
    host_ran = []

    def host():
        host_ran.append(1)
        c[...] = a @ b

    dispatch.run("gemm", [a, b, c], lambda tile, block: plan_gemm(40, 20, 30, tile, 0, 0, beta_zero=True, block=block),
                 np.float64, 1.0, 0.0, (40, 20, 30), host=host, flops=2.0 * 40 * 20 * 30)
    assert rel_err(c, a @ b) < 1e-12
    assert bool(host_ran) == (devices == "cpu")
    assert blasx.last_profile().totals()["flops"] == 2 * 40 * 20 * 30
