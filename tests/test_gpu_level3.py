"""Level-3 routines other than GEMM on real GPUs (marker ``gpu``), against scipy.linalg.blas."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import scipy.linalg.blas as sblas

import blasx

cupy = pytest.importorskip("cupy")
NGPU = blasx.session._cuda_count()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="no CUDA GPU")]

PREFIX = {np.float32: "s", np.float64: "d", np.complex64: "c", np.complex128: "z"}
TOL = {np.float32: 2e-5, np.float64: 1e-12, np.complex64: 2e-5, np.complex128: 1e-12}


def rand(rng, shape, dtype):
    x = rng.standard_normal(shape) + 0.5
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.standard_normal(shape)
    return np.asfortranarray(x.astype(dtype))


def rel_err(x, ref):
    x, ref = np.asarray(x, np.complex128), np.asarray(ref, np.complex128)
    return np.linalg.norm(x - ref) / np.linalg.norm(ref)


def well_conditioned_triangle(rng, n, dtype):
    a = rand(rng, (n, n), dtype) / n
    a[np.diag_indices(n)] += 2.0
    return np.asfortranarray(a)


@pytest.fixture(autouse=True)
def _engine():
    blasx.configure(devices="cuda", tile=256, cache_bytes=512 << 20)
    yield
    blasx.shutdown()


@pytest.mark.parametrize("dtype", list(PREFIX))
@pytest.mark.parametrize("side,lower", list(itertools.product([0, 1], [0, 1])))
def test_symm(dtype, side, lower):
    rng = np.random.default_rng(1)
    m, n = 700, 530
    a = rand(rng, (m, m) if side == 0 else (n, n), dtype)
    b, c = rand(rng, (m, n), dtype), rand(rng, (m, n), dtype)
    p = PREFIX[dtype]
    ref = getattr(sblas, p + "symm")(1.5, a, b, beta=0.5, c=c, side=side, lower=lower)
    got = getattr(blasx, p + "symm")(1.5, a, b, beta=0.5, c=c, side=side, lower=lower)
    assert rel_err(got, ref) < TOL[dtype]
    if p in "cz":
        ref = getattr(sblas, p + "hemm")(1.5, a, b, beta=0.5, c=c, side=side, lower=lower)
        got = getattr(blasx, p + "hemm")(1.5, a, b, beta=0.5, c=c, side=side, lower=lower)
        assert rel_err(got, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", list(PREFIX))
@pytest.mark.parametrize("trans,lower", list(itertools.product([0, 1], [0, 1])))
def test_syrk_syr2k(dtype, trans, lower):
    rng = np.random.default_rng(2)
    n, k = 650, 420
    a = rand(rng, (n, k) if trans == 0 else (k, n), dtype)
    b = rand(rng, a.shape, dtype)
    c = rand(rng, (n, n), dtype)
    p = PREFIX[dtype]
    for name, args in (("syrk", (a,)), ("syr2k", (a, b))):
        ref = getattr(sblas, p + name)(1.5, *args, beta=0.5, c=c, trans=trans, lower=lower)
        got = getattr(blasx, p + name)(1.5, *args, beta=0.5, c=c, trans=trans, lower=lower)
        assert rel_err(got, ref) < TOL[dtype], name


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
@pytest.mark.parametrize("trans,lower", list(itertools.product([0, 2], [0, 1])))
def test_herk_her2k(dtype, trans, lower):
    rng = np.random.default_rng(3)
    n, k = 650, 420
    a = rand(rng, (n, k) if trans == 0 else (k, n), dtype)
    b = rand(rng, a.shape, dtype)
    c = rand(rng, (n, n), dtype)
    p = PREFIX[dtype]
    ref = getattr(sblas, p + "herk")(1.5, a, beta=0.5, c=c, trans=trans, lower=lower)
    got = getattr(blasx, p + "herk")(1.5, a, beta=0.5, c=c, trans=trans, lower=lower)
    assert rel_err(got, ref) < TOL[dtype]
    ref = getattr(sblas, p + "her2k")(1.5 + 0.5j, a, b, beta=0.5, c=c, trans=trans, lower=lower)
    got = getattr(blasx, p + "her2k")(1.5 + 0.5j, a, b, beta=0.5, c=c, trans=trans, lower=lower)
    assert rel_err(got, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", list(PREFIX))
@pytest.mark.parametrize("side,lower,trans,diag",
                         [(0, 0, 0, 0), (0, 1, 1, 1), (1, 0, 2, 0), (1, 1, 0, 1), (0, 1, 2, 0), (1, 0, 1, 1)])
def test_trmm_trsm(dtype, side, lower, trans, diag):
    rng = np.random.default_rng(4)
    m, n = 600, 450
    a = well_conditioned_triangle(rng, m if side == 0 else n, dtype)
    b = rand(rng, (m, n), dtype)
    p = PREFIX[dtype]
    for name in ("trmm", "trsm"):
        ref = getattr(sblas, p + name)(1.5, a, b, lower=lower, trans_a=trans, side=side, diag=diag)
        got = getattr(blasx, p + name)(1.5, a, b, lower=lower, trans_a=trans, side=side, diag=diag)
        assert rel_err(got, ref) < TOL[dtype] * 10, name


# How a diagonal TRSM tile is solved: with the inverse of its block, made once per call by an
# inversion task (plans.plan_trsm(inverse=True), the default), its leaves and products exercised
# by a leaf of 64 on tiles of 256; or by cuBLAS trsm recursively blocked (runtime/trsm_blocks.py),
# leaf 64.
DIAGONAL_SOLVES = {"inverse": ({"INVERSE_LEAF": 64}, ""), "blocked": ({"TRSM_LEAF": 64}, "trsm_inverse=0")}


@pytest.mark.parametrize("solve", list(DIAGONAL_SOLVES))
@pytest.mark.parametrize("dtype", list(PREFIX))
@pytest.mark.parametrize("side,lower,trans,diag", list(itertools.product((0, 1), (0, 1), (0, 1, 2), (0, 1))))
def test_trsm_diagonal_tiles(monkeypatch, solve, dtype, side, lower, trans, diag):
    """Every flag combination, in place and not, for each way of solving the diagonal tiles."""
    from blasx.runtime.devices.cuda import CudaDevice
    attrs, knobs = DIAGONAL_SOLVES[solve]
    for name, value in attrs.items():
        monkeypatch.setattr(CudaDevice, name, value)
    monkeypatch.setenv("BLASX_KNOBS", knobs)
    blasx.configure(tile=256)
    rng = np.random.default_rng(7)
    m, n = 600, 450
    a = well_conditioned_triangle(rng, m if side == 0 else n, dtype)
    b = rand(rng, (m, n), dtype)
    p = PREFIX[dtype]
    ref = getattr(sblas, p + "trsm")(1.5, a, b, lower=lower, trans_a=trans, side=side, diag=diag)
    got = getattr(blasx, p + "trsm")(1.5, a, b, lower=lower, trans_a=trans, side=side, diag=diag)
    assert rel_err(got, ref) < TOL[dtype] * 10
    b2 = b.copy(order="F")
    out = getattr(blasx, p + "trsm")(1.5, a, b2, lower=lower, trans_a=trans, side=side, diag=diag, overwrite_b=True)
    assert out is b2 and rel_err(b2, ref) < TOL[dtype] * 10



@pytest.mark.parametrize("side,lower", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_in_place_trmm_of_a_cupy_b_on_its_gpu(side, lower):
    """A GPU holding B computed every task into B itself, so a task overwrote tiles other tasks had still to
    read (the write-after-read gates hold back write-backs only)."""
    blasx.configure(tile=256)
    rng = np.random.default_rng(3)
    m, n = 900, 700
    s = m if side == 0 else n
    a = np.asfortranarray(np.triu(rng.random((s, s))) + np.eye(s))
    a = a.T.copy(order="F") if lower else a
    b = np.asfortranarray(rng.random((m, n)))
    ref = sblas.dtrmm(1.5, a, b, side=side, lower=lower)
    bd = cupy.asfortranarray(cupy.asarray(b))
    out = blasx.dtrmm(1.5, cupy.asarray(a), bd, side=side, lower=lower, overwrite_b=True)
    assert out is bd and rel_err(cupy.asnumpy(bd), ref) < 1e-12
