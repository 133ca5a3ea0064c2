"""SYMM, HEMM, SYRK, HERK, SYR2K, HER2K, TRMM and TRSM on simulated GPUs, against
scipy.linalg.blas (compared in float64 / complex128 by relative Frobenius-norm error).

Tiles are small (8) so that shapes are not multiples of the tile; every
routine runs with every dtype and flag combination (side, lower, trans, diag)
on a few shapes, with the triangles a routine must not read poisoned with
NaN. Then: layouts and overwrite semantics, alpha == 0 / beta == 0 / k == 0,
bad arguments, a call larger than the tile caches, the CPU worker, and a
TRSM on heterogeneous devices (balance and dependency order).
"""

from __future__ import annotations

import inspect
import itertools
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import scipy.linalg.blas as sblas

import blasx
import blasx.runtime.call

T = 8
DTYPES = (np.float32, np.float64, np.complex64, np.complex128)
PREFIX = {np.dtype(np.float32): "s", np.dtype(np.float64): "d",
          np.dtype(np.complex64): "c", np.dtype(np.complex128): "z"}
SHAPES = [(19, 13), (1, 1), (1, 37), (37, 1)]  # (m, n) of b/c, or (n, k) of the rank-k updates
ids = {"ids": lambda d: np.dtype(d).name}


@pytest.fixture
def sim3():
    blasx.configure(devices="sim:3", tile=T)


def is_complex(dtype) -> bool:
    return np.dtype(dtype).kind == "c"


def scalars(dtype, real=False):
    """(alpha, beta) for a dtype, exactly representable in it."""
    if is_complex(dtype) and not real:
        return 0.75 - 0.5j, -0.25 + 1.5j
    return -1.25, 0.5


def poisoned(a, lower, unit=False, hermitian=False):
    """A copy of the square a whose unread parts are NaN: the other triangle, the diagonal
    (unit), the imaginary part of the diagonal (Hermitian)."""
    p = a.copy(order="F")
    other = np.triu(np.ones(a.shape, bool), 1) if lower else np.tril(np.ones(a.shape, bool), -1)
    p[other] = np.nan
    d = np.arange(a.shape[0])
    if unit:
        p[d, d] = np.nan
    elif hermitian:
        p.imag[d, d] = np.nan
    return p


def triangle(n, lower):
    ones = np.ones((n, n), bool)
    return np.tril(ones) if lower else np.triu(ones)


def well_conditioned(rand, s, dtype, seed):
    """A square matrix whose triangles (unit or not) are well-conditioned: small off-diagonal, big diagonal."""
    a = rand((s, s), dtype, seed) / (2 * s)
    a[np.arange(s), np.arange(s)] += 2
    return a


def ref(routine, dtype, *args, **kw):
    return getattr(sblas, PREFIX[np.dtype(dtype)] + routine)(*args, **kw)


# =========================================================================== every routine x dtype x flags

def cases(routines):
    """(routine, dtype) pairs; the Hermitian routines are complex only."""
    return [pytest.param(r, d, id=f"{r}-{np.dtype(d).name}") for r in routines for d in DTYPES
            if not r.startswith("he") or is_complex(d)]


@pytest.mark.parametrize("routine,dtype", cases(["symm", "hemm"]))
def test_symm_hemm_all_flags(sim3, rand, rel_err, tol, routine, dtype):
    alpha, beta = scalars(dtype)
    generic = getattr(blasx, routine)
    for (m, n), side, lower in itertools.product(SHAPES, (0, 1), (0, 1)):
        s = m if side == 0 else n
        a, b, c = rand((s, s), dtype, 1), rand((m, n), dtype, 2), rand((m, n), dtype, 3)
        before = c.copy()
        expect = ref(routine, dtype, alpha, a, b, beta, c, side=side, lower=lower)
        out = generic(alpha, poisoned(a, lower, hermitian=routine == "hemm"), b, beta, c, side=side, lower=lower)
        assert out.dtype == np.dtype(dtype) and out.flags.f_contiguous and out is not c
        assert np.array_equal(c, before)
        assert rel_err(out, expect) < tol(dtype), (m, n, side, lower)
        out = generic(alpha, a, b, side=side, lower=lower)  # beta = 0, no c
        assert rel_err(out, ref(routine, dtype, alpha, a, b, side=side, lower=lower)) < tol(dtype)


@pytest.mark.parametrize("routine,dtype", cases(["syrk", "herk", "syr2k", "her2k"]))
def test_rank_k_all_flags(sim3, rand, rel_err, tol, routine, dtype):
    hermitian = routine.startswith("her")
    two = routine.endswith("2k")
    alpha, beta = scalars(dtype)
    if hermitian:
        beta = -0.75
        if not two:
            alpha = 1.5
    trans_all = (0, 2) if hermitian else (0, 1) if is_complex(dtype) else (0, 1, 2)
    generic = getattr(blasx, routine)
    for (n, k), trans, lower in itertools.product(SHAPES, trans_all, (0, 1)):
        shape = (n, k) if trans == 0 else (k, n)
        a, b, c = rand(shape, dtype, 4), rand(shape, dtype, 5), rand((n, n), dtype, 6)
        ab = (a, b) if two else (a,)
        before = c.copy()
        expect = ref(routine, dtype, alpha, *ab, beta, c, trans=trans, lower=lower)
        out = generic(alpha, *ab, beta, c, trans=trans, lower=lower)
        assert out.dtype == np.dtype(dtype) and out.flags.f_contiguous
        assert np.array_equal(c, before)
        assert rel_err(out, expect) < tol(dtype), (n, k, trans, lower)
        # only the lower (upper) triangle is written: the other keeps c's values, bit for bit
        assert np.array_equal(out[~triangle(n, lower)], c[~triangle(n, lower)])
        if hermitian:
            assert np.all(np.diagonal(out).imag == 0)
        # no c: the other triangle is zero, as in scipy's new output
        out = generic(alpha, *ab, trans=trans, lower=lower)
        assert rel_err(out, ref(routine, dtype, alpha, *ab, trans=trans, lower=lower)) < tol(dtype)
        assert not out[~triangle(n, lower)].any()


@pytest.mark.parametrize("dtype", DTYPES, **ids)
@pytest.mark.parametrize("side,lower", list(itertools.product((0, 1), (0, 1))))
@pytest.mark.parametrize("routine", ["trmm", "trsm"])
def test_trmm_trsm_all_flags(sim3, rand, rel_err, tol, routine, side, lower, dtype):
    alpha, _ = scalars(dtype)
    generic = getattr(blasx, routine)
    for (m, n), trans_a, diag in itertools.product(SHAPES, (0, 1, 2), (0, 1)):
        s = m if side == 0 else n
        a, b = well_conditioned(rand, s, dtype, 7), rand((m, n), dtype, 8)
        before = b.copy()
        expect = ref(routine, dtype, alpha, a, b, side=side, lower=lower, trans_a=trans_a, diag=diag)
        out = generic(alpha, poisoned(a, lower, unit=diag), b, side=side, lower=lower, trans_a=trans_a, diag=diag)
        assert out is not b and np.array_equal(b, before)
        assert out.dtype == np.dtype(dtype) and out.flags.f_contiguous
        assert rel_err(out, expect) < tol(dtype), (m, n, trans_a, diag)


@pytest.mark.parametrize("dtype", [np.float64, np.complex64], **ids)
def test_trmm_trsm_in_place_all_flags(sim3, rand, rel_err, tol, dtype):
    """overwrite_b with an F-ordered b: written over b tile by tile, under dependencies."""
    alpha, _ = scalars(dtype)
    for routine, side, lower, trans_a, diag in itertools.product(("trmm", "trsm"), (0, 1), (0, 1), (0, 1, 2), (0, 1)):
        m, n = 37, 29
        s = m if side == 0 else n
        a, b = well_conditioned(rand, s, dtype, 7), rand((m, n), dtype, 8)
        expect = ref(routine, dtype, alpha, a, b, side=side, lower=lower, trans_a=trans_a, diag=diag)
        out = getattr(blasx, routine)(alpha, poisoned(a, lower, unit=diag), b, side=side, lower=lower,
                                      trans_a=trans_a, diag=diag, overwrite_b=True)
        assert out is b and rel_err(b, expect) < tol(dtype), (routine, side, lower, trans_a, diag)


@pytest.mark.parametrize("inverse", [1, 0])
def test_trsm_every_flag_with_and_without_inverses(rand, rel_err, tol, monkeypatch, inverse):
    """Knobs.trsm_inverse: diagonal blocks inverted once (trtri tasks, invmm steps) or solved in
    place (trsm steps); 3 sims, tiles of 8, in place and not."""
    monkeypatch.setenv("BLASX_KNOBS", f"trsm_inverse={inverse}")
    blasx.configure(devices="sim:3", tile=8)
    for dtype in (np.float32, np.complex128):
        alpha, _ = scalars(dtype)
        for side, lower, trans_a, diag in itertools.product((0, 1), (0, 1), (0, 1, 2), (0, 1)):
            m, n = 29, 21
            s = m if side == 0 else n
            a, b = well_conditioned(rand, s, dtype, 7), rand((m, n), dtype, 8)
            expect = ref("trsm", dtype, alpha, a, b, side=side, lower=lower, trans_a=trans_a, diag=diag)
            for overwrite in (False, True):
                bb = b.copy(order="F")
                out = blasx.trsm(alpha, poisoned(a, lower, unit=diag), bb, side=side, lower=lower,
                                 trans_a=trans_a, diag=diag, overwrite_b=overwrite)
                assert (out is bb) == overwrite and rel_err(out, expect) < tol(dtype), (side, lower, trans_a, diag)
            tiles, blocks = -(-m // 8) * -(-n // 8), -(-s // 8)  # an inversion per diagonal block but the first
            assert blasx.last_profile().totals()["tasks"] == tiles + inverse * (blocks - 1)


@pytest.mark.parametrize("new_block", [1, 0])
def test_trsm_diagonal_multiply_into_a_new_block(rand, rel_err, tol, monkeypatch, new_block):
    """Knobs.invmm_new_block: each diagonal multiply by a block's inverse writes into a fresh heap
    block, which becomes the task's C (the old C freed once the kernel read it), instead of over C.
    The same answers; every heap block left after the calls is a cache line (none leaked)."""
    from blasx.runtime.devices.sim import SimDevice
    monkeypatch.setenv("BLASX_KNOBS", f"invmm_new_block={new_block}")
    outs = []
    original = SimDevice.run_step

    def run_step(self, s, step, call, a, b, c, task=None, out=None):
        if step.kernel == "invmm":
            outs.append(out is not None)
        return original(self, s, step, call, a, b, c, task, out)

    monkeypatch.setattr(SimDevice, "run_step", run_step)
    blasx.configure(devices="sim:3", tile=8)
    for dtype in (np.float64, np.complex64):
        alpha, _ = scalars(dtype)
        for side, lower, trans_a in itertools.product((0, 1), (0, 1), (0, 2)):
            m, n = 29, 21
            a, b = well_conditioned(rand, m if side == 0 else n, dtype, 7), rand((m, n), dtype, 8)
            out = blasx.trsm(alpha, a, b, side=side, lower=lower, trans_a=trans_a)
            want = ref("trsm", dtype, alpha, a, b, side=side, lower=lower, trans_a=trans_a)
            assert rel_err(out, want) < tol(dtype), (dtype, side, lower, trans_a)
    assert outs and set(outs) == {bool(new_block)}
    eng = blasx.session.engine()
    for w in eng.workers:
        lines = list(eng.directory.alrus[w.idx])
        assert w.dev.heap.n_allocated == len(lines) and all(w.dev.heap.is_allocated(x.offset) for x in lines)


def test_invmm_kernel_writes_out_and_only_reads_c(rand):
    """The numpy kernel's contract for an out-of-place diagonal multiply (runtime.devices.numpy_kernels)."""
    from blasx.runtime.devices.numpy_kernels import invmm
    from blasx.runtime.tasks import SC_ONE, Step
    v, c = np.triu(rand((6, 6), np.float64, 1)), rand((6, 5), np.float64, 2)
    scal = np.array([0.0, 0.0, 0.0, 1.0, -1.0, 0.0])
    step = Step("invmm", None, None, 0, 0, 6, 5, 6, SC_ONE, SC_ONE, 0, 0, 0)
    out, c0 = np.full((6, 5), np.nan, order="F"), c.copy()
    invmm(step, scal, v, None, c, out=out)
    assert np.array_equal(c, c0) and np.allclose(out, v @ c0, rtol=1e-14)
    invmm(step, scal, v, None, c)
    assert np.array_equal(c, out)


@pytest.mark.parametrize("order", ["levels", "wave", "wave2", "blocks", "blocks3"])
def test_in_place_trmm_every_order(sim3, rand, rel_err, tol, monkeypatch, order):
    """Every listing order of runtime.plans.trmm_order runs on the scheduler (3 sims, 5 x 4 tiles
    with edge tiles) and gives scipy's result for every flag combination: the order changes only
    which tasks are pulled first, never the write-after-read dependencies."""
    import blasx.blas3
    from blasx.runtime.plans import plan_trmm

    planned = []

    def plan(*a, **kw):
        planned.append(kw["in_place"])
        return plan_trmm(*a, **kw, order=order)
    monkeypatch.setattr(blasx.blas3, "plan_trmm", plan)
    for side, lower, trans_a in itertools.product((0, 1), (0, 1), (0, 1, 2)):
        m, n = (37, 29) if side == 0 else (29, 37)
        s = m if side == 0 else n
        a, b = well_conditioned(rand, s, np.float64, 7), rand((m, n), np.float64, 8)
        expect = ref("trmm", np.float64, -1.25, a, b, side=side, lower=lower, trans_a=trans_a)
        out = blasx.trmm(-1.25, poisoned(a, lower), b, side=side, lower=lower, trans_a=trans_a, overwrite_b=True)
        assert out is b and rel_err(b, expect) < tol(np.float64), (order, side, lower, trans_a)
    assert planned == [True] * 12


def test_prefixed_functions_cast_like_scipy(sim3, rand, rel_err, tol):
    a, b, c = rand((13, 13), np.float64, 1), rand((13, 9), np.float64, 2), rand((13, 9), np.float64, 3)
    for p, dt in (("s", np.float32), ("d", np.float64), ("c", np.complex64), ("z", np.complex128)):
        out = getattr(blasx, p + "symm")(0.5, a.T.copy(), b.T.copy(), 2.0, c.T.copy(), 1, 1)  # side=1, lower=1
        assert rel_err(out, getattr(sblas, p + "symm")(0.5, a.T.copy(), b.T.copy(), 2.0, c.T.copy(), 1, 1)) < tol(dt)
        out = getattr(blasx, p + "symm")(0.5, a, b, 2.0, c, 0, 1)
        assert out.dtype == np.dtype(dt)
        assert rel_err(out, getattr(sblas, p + "symm")(0.5, a, b, 2.0, c, 0, 1)) < tol(dt)
        aw = well_conditioned(rand, 9, np.float64, 4)
        out = getattr(blasx, p + "trsm")(2.0, aw, b, 1, 1, 1, 0)  # side=1, lower=1, trans_a=1, diag=0
        assert rel_err(out, getattr(sblas, p + "trsm")(2.0, aw, b, 1, 1, 1, 0)) < tol(dt)
        out = getattr(blasx, p + "syrk")(1.0, b, 0.0, None, 1)  # positional trans
        assert out.shape == (9, 9) and rel_err(out, getattr(sblas, p + "syrk")(1.0, b, 0.0, None, 1)) < tol(dt)
    zb = rand((13, 9), np.complex128, 5)
    for p in "cz":
        out = getattr(blasx, p + "herk")(1.0, zb, trans=2, lower=1)
        assert rel_err(out, getattr(sblas, p + "herk")(1.0, zb, trans=2, lower=1)) < tol(out.dtype)
        out = getattr(blasx, p + "her2k")(1 + 1j, zb, zb, 0.5, None, 0, 1)
        assert rel_err(out, getattr(sblas, p + "her2k")(1 + 1j, zb, zb, 0.5, None, 0, 1)) < tol(out.dtype)
    # real input to a generic Hermitian routine: the complex type of the same precision
    out = blasx.herk(1.0, rand((6, 4), np.float32, 6))
    assert out.dtype == np.complex64
    assert not hasattr(blasx, "dherk") and not hasattr(blasx, "shemm")
    assert str(inspect.signature(blasx.dtrmm)) == "(alpha, a, b, side=0, lower=0, trans_a=0, diag=0, overwrite_b=False)"
    assert str(inspect.signature(blasx.zher2k)) == \
        "(alpha, a, b, beta=0.0, c=None, trans=0, lower=0, overwrite_c=False)"


# =========================================================================== layouts and overwrite

def test_c_ordered_and_strided_operands(sim3, rand, rel_err, tol):
    """F-ordered, C-ordered (used through their transpose) and strided (copied) operands."""
    layouts = {"F": np.asfortranarray, "C": np.ascontiguousarray,
               "strided": lambda x: np.repeat(np.repeat(x, 2, 0), 3, 1)[::2, ::3]}
    for dtype in (np.float64, np.complex128):
        alpha, beta = scalars(dtype)
        base = rand((60, 70), dtype, 9)
        herm = ("hemm", "herk", "her2k") if is_complex(dtype) else ()
        for how, lay in layouts.items():
            a = lay(well_conditioned(rand, 17, dtype, 10))
            for lower, side in itertools.product((0, 1), (0, 1)):
                b, c = (lay(base[:17, :11]), lay(base[20:37, 30:41])) if side == 0 else \
                    (lay(base[:11, :17]), lay(base[20:31, 30:47]))
                for routine in ("symm",) + herm[:1]:
                    got = getattr(blasx, routine)(alpha, a, b, beta, c, side=side, lower=lower)
                    want = ref(routine, dtype, alpha, a, b, beta, c, side=side, lower=lower)
                    assert rel_err(got, want) < tol(dtype), (how, routine, side, lower)
                for routine, trans in itertools.product(("trmm", "trsm"), (0, 1, 2)):
                    got = getattr(blasx, routine)(alpha, a, b, side=side, lower=lower, trans_a=trans)
                    want = ref(routine, dtype, alpha, a, b, side=side, lower=lower, trans_a=trans)
                    assert rel_err(got, want) < tol(dtype), (how, routine, side, lower, trans)
            cc = lay(base[:17, 40:57])
            for routine, lower, trans in itertools.product(("syrk", "syr2k") + herm[1:], (0, 1), (0, 1, 2)):
                if routine.startswith("her") and trans == 1 or is_complex(dtype) and routine.startswith("syr") \
                        and trans == 2:
                    continue
                shape = (slice(0, 17), slice(0, 11)) if trans == 0 else (slice(0, 11), slice(0, 17))
                x, y = lay(base[shape]), lay(base[30:, 50:][shape])
                ab = (x, y) if routine.endswith("2k") else (x,)
                got = getattr(blasx, routine)(1.5, *ab, -0.5, cc, trans=trans, lower=lower)
                want = ref(routine, dtype, 1.5, *ab, -0.5, cc, trans=trans, lower=lower)
                assert rel_err(got, want) < tol(dtype), (how, routine, lower, trans)
        # a and b of syr2k in different layouts
        x, y = np.asfortranarray(base[:17, :11]), np.ascontiguousarray(base[20:37, 30:41])
        for trans in (0, 1):
            got = blasx.syr2k(alpha, x, y, trans=trans)
            assert rel_err(got, ref("syr2k", dtype, alpha, x, y, trans=trans)) < tol(dtype)


def test_overwrite_follows_f2py(sim3, rand, rel_err, tol):
    a = rand((15, 15), np.float64, 1)
    aw = well_conditioned(rand, 15, np.float64, 2)
    # F-contiguous of the right dtype: written in place and returned
    c = rand((15, 15), np.float64, 3)
    want = sblas.dsyrk(1.0, a, 0.5, c, lower=1)
    assert blasx.syrk(1.0, a, 0.5, c, lower=1, overwrite_c=True) is c and rel_err(c, want) < 1e-12
    b = rand((15, 7), np.float64, 4)
    want = sblas.dtrsm(2.0, aw, b, lower=1, trans_a=1)
    assert blasx.trsm(2.0, aw, b, lower=1, trans_a=1, overwrite_b=True) is b and rel_err(b, want) < 1e-12
    b = rand((7, 15), np.float64, 5)
    want = sblas.dtrmm(2.0, aw, b, side=1, diag=1)
    assert blasx.trmm(2.0, aw, b, side=1, diag=1, overwrite_b=True) is b and rel_err(b, want) < 1e-12
    c = rand((15, 7), np.float64, 6)
    want = sblas.dsymm(1.0, aw, rand((15, 7), np.float64, 7), 2.0, c)
    assert blasx.symm(1.0, aw, rand((15, 7), np.float64, 7), 2.0, c, overwrite_c=True) is c
    assert rel_err(c, want) < 1e-12
    # C-ordered, or another dtype: a new array, the input untouched (as f2py)
    for x in (np.ascontiguousarray(rand((15, 7), np.float64, 8)), rand((15, 7), np.float32, 8)):
        before = x.copy()
        out = blasx.trsm(1.0, aw, x, overwrite_b=True)
        assert out is not x and np.array_equal(x, before) and out.dtype == np.float64
        assert rel_err(out, sblas.dtrsm(1.0, aw, x)) < 1e-12
        out = blasx.trmm(1.0, aw, x, overwrite_b=True)
        assert out is not x and np.array_equal(x, before)
    c = np.ascontiguousarray(rand((15, 15), np.float64, 9))
    before = c.copy()
    out = blasx.syrk(1.0, a, 1.0, c, overwrite_c=True)
    assert out is not c and np.array_equal(c, before) and rel_err(out, sblas.dsyrk(1.0, a, 1.0, c)) < 1e-12
    # a read-only b is never written
    b = rand((15, 7), np.float64, 10)
    b.flags.writeable = False
    out = blasx.trsm(1.0, aw, b, overwrite_b=True)
    assert out is not b and rel_err(out, sblas.dtrsm(1.0, aw, b)) < 1e-12


# =========================================================================== alpha == 0, beta == 0, k == 0

def test_alpha_zero_reads_neither_a_nor_b(sim3, rand, rel_err):
    for dtype in (np.float64, np.complex128):
        nan_a, nan_b = np.full((12, 12), np.nan, dtype), np.full((12, 9), np.nan, dtype)
        c = rand((12, 9), dtype, 1)
        assert rel_err(blasx.symm(0.0, nan_a, nan_b, 0.5, c), 0.5 * c) < 1e-15
        assert np.array_equal(blasx.symm(0.0, nan_a, nan_b, 1.0, c), c)
        for routine in ("trmm", "trsm"):
            out = getattr(blasx, routine)(0.0, nan_a, nan_b)
            assert out.shape == (12, 9) and not out.any()
        c = rand((12, 12), dtype, 2)
        for routine in ("syrk", "syr2k") + (("herk", "her2k") if dtype == np.complex128 else ()):
            ab = (nan_a, nan_a) if routine.endswith("2k") else (nan_a,)
            out = getattr(blasx, routine)(0.0, *ab, 2.0, c, lower=1)
            want = ref(routine, dtype, 0.0, *((c, c) if routine.endswith("2k") else (c,)), 2.0, c, lower=1)
            assert rel_err(out, want) < 1e-15, routine
            assert np.array_equal(out[~triangle(12, 1)], c[~triangle(12, 1)])
            # beta == 1: BLAS returns at once, c untouched (HERK's imaginary diagonal too)
            assert np.array_equal(getattr(blasx, routine)(0.0, *ab, 1.0, c, lower=1), c)


def test_beta_zero_never_reads_c(sim3, rand, rel_err, tol):
    for dtype in DTYPES:
        alpha, _ = scalars(dtype)
        a, b = rand((19, 19), dtype, 1), rand((19, 11), dtype, 2)
        c = np.full((19, 11), np.nan, dtype, order="F")
        out = blasx.symm(alpha, a, b, 0.0, c, side=0, lower=1, overwrite_c=True)
        assert out is c and np.isfinite(c).all()
        assert rel_err(c, ref("symm", dtype, alpha, a, b, side=0, lower=1)) < tol(dtype)
        for routine, lower in itertools.product(("syrk", "syr2k", "herk", "her2k"), (0, 1)):
            herm = routine.startswith("her")
            if herm and not is_complex(dtype):
                continue
            al = 1.5 if routine == "herk" else alpha
            ab = (b, b[::-1].copy(order="F")) if routine.endswith("2k") else (b,)
            c = np.full((19, 19), np.nan, dtype, order="F")
            out = getattr(blasx, routine)(al, *ab, 0.0, c, lower=lower)
            tri = triangle(19, lower)
            assert np.isfinite(out[tri]).all() and np.isnan(out[~tri]).all()  # c's other triangle kept
            want = ref(routine, dtype, al, *ab, lower=lower)
            assert rel_err(out[tri], want[tri]) < tol(dtype), routine


def test_rank_k_with_k_zero_scales_the_triangle(sim3, rand):
    c = rand((11, 11), np.complex128, 1)
    for lower in (0, 1):
        tri = triangle(11, lower)
        out = blasx.herk(1.0, np.zeros((11, 0), np.complex128), 2.0, c, lower=lower)
        want = c.copy()
        want[tri] *= 2
        d = np.arange(11)
        want[d, d] = want[d, d].real
        assert np.array_equal(out, want)
        out = blasx.syr2k(1.0, np.zeros((0, 11)), np.zeros((0, 11)), 2.0, c, trans=1, lower=lower)
        want = c.copy()
        want[tri] *= 2
        assert np.array_equal(out, want)


def test_empty_outputs(sim3):
    assert blasx.syrk(1.0, np.zeros((0, 5))).shape == (0, 0)
    assert blasx.symm(1.0, np.zeros((0, 0)), np.zeros((0, 4))).shape == (0, 4)
    assert blasx.trsm(1.0, np.zeros((3, 3)), np.zeros((3, 0))).shape == (3, 0)
    assert blasx.trmm(1.0, np.zeros((0, 0)), np.zeros((0, 2))).shape == (0, 2)


# =========================================================================== bad arguments

def test_bad_flags_name_the_parameter_and_write_nothing(sim3, rand, expect):
    a, b = rand((9, 9), np.float64, 1), rand((9, 5), np.float64, 2)
    c, cz = rand((9, 9), np.float64, 3), rand((9, 9), np.complex128, 4)
    saved = [(x, x.copy()) for x in (a, b, c, cz)]
    expect(ValueError, "side:", "got 2", "0 (left", "1 (right", call=lambda: blasx.symm(1.0, a, b, side=2))
    expect(ValueError, "lower:", "got 3", call=lambda: blasx.syrk(1.0, a, 1.0, c, lower=3, overwrite_c=True))
    expect(ValueError, "trans:", "got 3", call=lambda: blasx.syrk(1.0, a, 1.0, c, trans=3, overwrite_c=True))
    expect(ValueError, "trans:", "got 1", "0 (N", "2 (C",
           call=lambda: blasx.herk(1.0, cz, 1.0, cz, trans=1, overwrite_c=True))
    expect(ValueError, "trans:", "got 1", call=lambda: blasx.zher2k(1.0, cz, cz, 1.0, cz, trans=1, overwrite_c=True))
    expect(ValueError, "trans:", "got 2", "her2k", call=lambda: blasx.zsyr2k(1.0, cz, cz, 1.0, cz, trans=2))
    expect(ValueError, "trans_a:", "got 5", call=lambda: blasx.trsm(1.0, a, b, trans_a=5, overwrite_b=True))
    expect(ValueError, "diag:", "got 2", "unit", call=lambda: blasx.trmm(1.0, a, b, diag=2, overwrite_b=True))
    expect(ValueError, "side:", "got -1", call=lambda: blasx.trsm(1.0, a, b, side=-1, overwrite_b=True))
    # real scalars of the Hermitian routines
    expect(TypeError, "beta:", "real", call=lambda: blasx.herk(1.0, cz, 1j, cz, overwrite_c=True))
    expect(TypeError, "alpha:", "real", call=lambda: blasx.zherk(1 + 2j, cz, 1.0, cz, overwrite_c=True))
    expect(TypeError, "beta:", "real", call=lambda: blasx.her2k(1j, cz, cz, 0.5j, cz, overwrite_c=True))
    expect(TypeError, "alpha:", "complex", call=lambda: blasx.dsyrk(1j, a, 1.0, c, overwrite_c=True))
    expect(TypeError, "alpha:", "expected a number", call=lambda: blasx.trsm("x", a, b, overwrite_b=True))
    for x, before in saved:
        assert np.array_equal(x, before)


def test_bad_shapes_name_the_parameter_and_write_nothing(sim3, rand, expect):
    a, b = rand((9, 9), np.float64, 1), rand((9, 5), np.float64, 2)
    c = rand((9, 9), np.float64, 3)
    saved = [(x, x.copy()) for x in (a, b, c)]
    expect(ValueError, "a:", "(9, 9)", "(5, 5)", "side=1", call=lambda: blasx.symm(1.0, a, b, side=1))
    expect(ValueError, "a:", "(9, 9)", "(5, 5)", call=lambda: blasx.trsm(1.0, a, b, side=1, overwrite_b=True))
    expect(ValueError, "a:", "(9, 5)", "(9, 9)", call=lambda: blasx.trmm(1.0, b, c, overwrite_b=True))
    expect(ValueError, "c:", "(9, 9)", "(9, 5)", call=lambda: blasx.symm(1.0, a, b, 1.0, c, overwrite_c=True))
    expect(ValueError, "c:", "(9, 9)", "(5, 5)", call=lambda: blasx.syrk(1.0, b, 1.0, c, trans=1, overwrite_c=True))
    expect(ValueError, "b:", "(9, 9)", "(9, 5)", call=lambda: blasx.syr2k(1.0, b, a, 1.0, c, overwrite_c=True))
    expect(ValueError, "b:", "1-D", call=lambda: blasx.trsm(1.0, a, np.ones(9), overwrite_b=True))
    expect(TypeError, "a:", "list", call=lambda: blasx.syrk(1.0, [[1.0]]))
    expect(TypeError, "dtype:", call=lambda: blasx.syrk(1.0, np.ones((2, 2), "M8[s]")))
    expect(ValueError, "c:", "shares memory with a",
           call=lambda: blasx.syrk(1.0, c[:, :3], 1.0, c, overwrite_c=True))
    for x, before in saved:
        assert np.array_equal(x, before)


# =========================================================================== out of core, CPU worker

def test_larger_than_the_tile_caches(rand, rel_err, tol):
    blasx.configure(devices="sim:3", tile=16, cache_bytes=256 * 1024)
    n = 150  # a 150 x 150 complex128 matrix is 352 KiB: no operand fits a device's cache
    for dtype in (np.float64, np.complex128):
        a, b = well_conditioned(rand, n, dtype, 1), rand((n, n), dtype, 2)
        alpha, beta = scalars(dtype)
        got = blasx.syr2k(alpha, a, b, beta, b, lower=1)
        assert rel_err(got, ref("syr2k", dtype, alpha, a, b, beta, b, lower=1)) < tol(dtype)
        assert blasx.last_profile().totals()["evictions"] > 0
        got = blasx.symm(alpha, a, b, beta, b, side=1)
        assert rel_err(got, ref("symm", dtype, alpha, a, b, beta, b, side=1)) < tol(dtype)
        got = blasx.trmm(alpha, a, b, side=1, trans_a=2)
        assert rel_err(got, ref("trmm", dtype, alpha, a, b, side=1, trans_a=2)) < tol(dtype)
    got = blasx.herk(2.0, b, -1.0, a, trans=2)
    assert rel_err(got, sblas.zherk(2.0, b, -1.0, a, trans=2)) < 1e-12


def test_trsm_larger_than_the_tile_caches(rand, rel_err, tol):
    """Kept X tiles (E lines) compete with A tiles for the caches: a kept line must not be
    evicted (its heap block reused) before its kernel and write-back have run."""
    blasx.configure(devices="sim:3", tile=16, cache_bytes=256 * 1024)
    n = 150
    for dtype in (np.complex128, np.float64):
        a, b = well_conditioned(rand, n, dtype, 1), rand((n, n), dtype, 2)
        alpha, _ = scalars(dtype)
        for lower, trans_a, side in ((1, 1, 0), (0, 0, 1), (1, 0, 0)):
            got = blasx.trsm(alpha, a, b, side=side, lower=lower, trans_a=trans_a)
            want = ref("trsm", dtype, alpha, a, b, side=side, lower=lower, trans_a=trans_a)
            assert rel_err(got, want) < tol(dtype), (dtype, lower, trans_a, side)
            assert blasx.last_profile().totals()["evictions"] > 0


def test_cpu_worker_beside_sims(rand, rel_err):
    blasx.configure(devices="sim:2", tile=8, cpu=True)
    a, b = well_conditioned(rand, 40, np.float64, 1), rand((40, 30), np.float64, 2)
    for side, lower, trans in itertools.product((0, 1), (0, 1), (0, 1)):
        bb = b if side == 0 else b.T.copy(order="F")
        got = blasx.trsm(1.5, a, bb, side=side, lower=lower, trans_a=trans)
        assert rel_err(got, sblas.dtrsm(1.5, a, bb, side=side, lower=lower, trans_a=trans)) < 1e-12
    c = rand((40, 40), np.float64, 3)
    assert rel_err(blasx.syrk(1.0, b, 2.0, c, lower=1), sblas.dsyrk(1.0, b, 2.0, c, lower=1)) < 1e-12
    assert rel_err(blasx.trmm(1.0, a, b, diag=1), sblas.dtrmm(1.0, a, b, diag=1)) < 1e-12


# =========================================================================== TRSM on heterogeneous devices

@pytest.mark.parametrize("inverse", [True, False])
def test_trsm_on_a_slow_device_respects_dependencies(rand, rel_err, monkeypatch, inverse):
    monkeypatch.setenv("BLASX_KNOBS", f"trsm_inverse={int(inverse)}")
    blasx.configure(devices="sim:3,slow=4,rate=5e6", tile=16)  # simulated kernel time dominates
    finished = []
    original = blasx.runtime.call.Call.account

    def spy(self, task, worker=None):
        if self.name == "trsm" and worker is not None:
            finished.append(task.tid)
        return original(self, task, worker)

    monkeypatch.setattr(blasx.runtime.call.Call, "account", spy)
    m, n = 48, 640  # 3 levels (block rows) of 40 tiles
    a, b = well_conditioned(rand, m, np.float64, 1), rand((m, n), np.float64, 2)
    x = blasx.trsm(0.5, a, b, lower=0)
    assert rel_err(x, sblas.dtrsm(0.5, a, b, lower=0)) < 1e-12
    prof = blasx.last_profile()
    tasks = [prof.counters[i]["tasks"] for i in range(3)]
    flops = [prof.counters[i]["flops"] for i in range(3)]
    count = 120 + 2 * inverse  # with inverses: an inversion task per diagonal block but the first
    assert sum(tasks) == count
    # sim:2 is 4x slower: pulling work by demand, it runs fewer tasks and less work
    assert tasks[2] < min(tasks[0], tasks[1]) and flops[2] < min(flops[0], flops[1]), (tasks, flops)
    # every task finished after the tasks it depends on (the plan is the one planned for this call)
    from blasx.runtime.plans import TRSM_V, TRSM_X, plan_trsm
    plan = plan_trsm(m, n, 16, 0, 0, 0, 0, inverse=inverse)
    position = {tid: i for i, tid in enumerate(finished)}
    assert sorted(finished) == list(range(count))
    for t in plan:
        assert all(position[d] < position[t.tid] for d in t.deps), t.tid
    # Solved X tiles (and the inverses) are read from the device caches (kept as E lines: L1 on
    # the writer, L2 on the others), never from the host: the only misses are A's stored tiles,
    # once per device (with inverses, A(1,1) and A(2,2) only by their inversion tasks).
    totals = prof.totals()
    cached_reads = sum(1 for t in plan for st in t.steps for r in (st.a, st.b)
                       if r is not None and r.slot in (TRSM_X, TRSM_V))
    assert cached_reads == 40 * (1 + 2) + 80 * inverse
    assert totals["misses"] <= (4 * 3 + 2 if inverse else 6 * 3), totals
    assert totals["l1_hits"] + totals["l2_hits"] >= cached_reads


def test_trsm_survives_a_device_failure():
    """A device breaks in the middle of a TRSM (a chain of 12 dependent tiles): the call must end,
    with the right X or with a DeviceError, never hang. Run in a subprocess: a hang is a timeout."""
    script = textwrap.dedent("""
        import numpy as np, scipy.linalg.blas as sb, blasx
        blasx.configure(devices="sim:2,fail=0@2", tile=16)
        rng = np.random.default_rng(0)
        m, n = 192, 16
        a = np.asfortranarray(rng.standard_normal((m, m)) / (2 * m) + 2 * np.eye(m))
        b = np.asfortranarray(rng.standard_normal((m, n)))
        try:
            x = blasx.trsm(1.0, a, b, lower=1)
            assert np.linalg.norm(x - sb.dtrsm(1.0, a, b, lower=1)) <= 1e-12 * np.linalg.norm(x)
        except blasx.DeviceError as exc:
            print("failed loudly:", exc)
        blasx.shutdown()
        print("finished")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=8)
    assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr[-2000:]


def test_in_place_trmm_trsm_survive_device_failures():
    """Fault injection over many points, one stream per device (a station then holds waiting tasks
    beyond its capacity): each call ends with the right answer or a DeviceError, never a wrong
    answer (an in-place task failing mid write-back would reread its own half-written tile) and
    never a hang. In a subprocess: a hang is a timeout."""
    script = textwrap.dedent("""
        import numpy as np, scipy.linalg.blas as sb, blasx
        for routine in ("trmm", "trsm"):
            for dev, at in ((0, 4), (1, 4), (0, 9), (1, 13), (0, 21)):
                blasx.configure(devices=f"sim:2,fail={dev}@{at}", tile=16, streams=1)
                rng = np.random.default_rng(at)
                a = np.asfortranarray(rng.standard_normal((160, 160)) / 320 + 2 * np.eye(160))
                b = np.asfortranarray(rng.standard_normal((160, 16)))  # one column: a chain of 10
                want = getattr(sb, "d" + routine)(1.0, a, b, lower=1)
                try:
                    x = getattr(blasx, routine)(1.0, a, b, lower=1, overwrite_b=True)
                    assert np.linalg.norm(x - want) <= 1e-12 * np.linalg.norm(want), (routine, at)
                except blasx.DeviceError:
                    pass
                blasx.shutdown()
        print("finished")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize("lower", [0, 1])
@pytest.mark.parametrize("dtype", [np.float64, np.complex64])
def test_trsm_with_a_zero_pivot_gives_inf_or_nan_as_a_solve(lower, dtype):
    """A singular triangle over several tiles (trsm by inverses of the diagonal blocks, knob trsm_inverse): a
    zero pivot gives inf / NaN wherever scipy's solve does (LAPACK's trtri stops at it; a finite wrong answer was
    returned), and where the answer is finite it is scipy's."""
    blasx.configure(devices="sim:2", tile=16)
    rng = np.random.default_rng(7)
    n = 64
    a = rng.random((n, n)).astype(dtype)
    a = (np.tril(a) if lower else np.triu(a)) + 4 * np.eye(n, dtype=dtype)
    a[37, 37] = 0
    b = rng.random((n, 5)).astype(dtype)
    with np.errstate(all="ignore"):
        want = {np.float64: sblas.dtrsm, np.complex64: sblas.ctrsm}[dtype](1.0, a, b, lower=lower)
    got = blasx.trsm(1.0, a, b, lower=lower)
    bad = ~np.isfinite(want)
    assert bad.any() and not np.isfinite(got[bad]).any()
    ok = np.isfinite(got)
    assert np.allclose(got[ok], want[ok], rtol=1e-4)
