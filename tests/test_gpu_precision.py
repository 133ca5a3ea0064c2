"""Reduced precision on real CUDA GPUs (marker ``gpu``; skipped where CuPy finds none): float16,
bfloat16, int8 and TF32 gemm on one and on two GPUs, host and CuPy operands, beta and edge tiles,
the int8 dequantization epilogue, float16 overflow. Tolerances: blasx.precision.tolerance."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import blasx
from blasx import precision as P
from blasx.runtime.devices.numpy_kernels import to_tf32
from blasx.tile import choose_tile

cupy = pytest.importorskip("cupy")
NGPU = blasx.session._cuda_count()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="no CUDA GPU")]

try:
    from ml_dtypes import bfloat16
except ImportError:
    bfloat16 = None

HALF = [np.float16] + ([bfloat16] if bfloat16 is not None else [])
SPECS = ["cuda:0"] + (["cuda:0,1"] if NGPU >= 2 else [])


def _normal(rng, shape, dt, order="F"):
    return np.asarray(rng.standard_normal(shape).astype(dt), order=order)


def _rel(x, ref):
    x = np.asarray(x, dtype=np.float64)
    return np.linalg.norm(x - ref) / np.linalg.norm(ref)


@pytest.fixture(params=SPECS)
def spec(request):
    blasx.configure(devices=request.param, tile=256, cache_bytes=256 << 20, cpu=False)
    yield request.param
    blasx.shutdown()


@pytest.mark.parametrize("dt", HALF, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("out", [None, np.float32], ids=["own", "float32"])
def test_half_types(spec, dt, out):
    rng = np.random.default_rng(1)
    m, n, k = 700, 530, 610  # edge tiles, 3 k-steps at tile 256
    a, b = _normal(rng, (m, k), dt), _normal(rng, (k, n), dt)
    c = _normal(rng, (m, n), dt if out is None else np.float32)
    got = blasx.gemm(1.5, a, b, beta=0.5, c=c, out_dtype=out)
    assert got.dtype == (np.dtype(dt) if out is None else np.float32)
    ref = 1.5 * (a.astype(np.float64) @ b.astype(np.float64)) + 0.5 * c.astype(np.float64)
    assert _rel(got, ref) <= P.tolerance(dt, k, out)
    prof = blasx.last_profile()
    assert sum(prof.counters[d]["tasks"] for d in prof.counters) == 9


@pytest.mark.parametrize("dt", HALF, ids=lambda t: np.dtype(t).name)
def test_half_matmul_c_ordered_and_transposed(spec, dt):
    rng = np.random.default_rng(2)
    a, b = _normal(rng, (513, 300), dt, "C"), _normal(rng, (411, 300), dt, "C")
    got = blasx.matmul(a, b.T)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    assert got.dtype == np.dtype(dt) and got.flags.c_contiguous and _rel(got, ref) <= P.tolerance(dt, 300)


def test_int8_exact(spec):
    rng = np.random.default_rng(3)
    m, n, k = 701, 533, 611  # leading dimensions padded to multiples of 4 in the tile caches
    a = rng.integers(-128, 128, (m, k)).astype(np.int8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    got = blasx.matmul(a, b)
    assert got.dtype == np.int32 and np.array_equal(got, a.astype(np.int64) @ b.astype(np.int64))
    c = rng.integers(-1000, 1000, (m, n)).astype(np.int32)
    got = blasx.gemm(2, np.asfortranarray(a), np.asfortranarray(b), beta=-3, c=c)
    assert np.array_equal(got, 2 * (a.astype(np.int64) @ b) - 3 * c.astype(np.int64))


@pytest.mark.parametrize("trans", [(0, 0), (1, 0), (0, 1), (1, 1)], ids=["NN", "TN", "NT", "TT"])
def test_int8_every_op_and_odd_shapes(spec, trans):
    """Every op pair, m and k not multiples of 4 (the tiles go to cuBLAS's IMMA form on the device)."""
    rng = np.random.default_rng(7)
    m, n, k = 301, 259, 263
    ta, tb = trans
    a = rng.integers(-128, 128, (k, m) if ta else (m, k)).astype(np.int8)
    b = rng.integers(-128, 128, (n, k) if tb else (k, n)).astype(np.int8)
    got = blasx.gemm(1, a, b, trans_a=ta, trans_b=tb)
    ref = (a.T if ta else a).astype(np.int64) @ (b.T if tb else b).astype(np.int64)
    assert got.dtype == np.int32 and np.array_equal(got, ref)


def test_int8_cupy_operands_with_odd_leading_dimensions(spec):
    """In-core int8 operands read in place at odd leading dimensions and offsets."""
    rng = np.random.default_rng(8)
    big_a = cupy.asarray(np.asfortranarray(rng.integers(-128, 128, (306, 291)).astype(np.int8)))
    big_b = cupy.asarray(np.asfortranarray(rng.integers(-128, 128, (293, 277)).astype(np.int8)))
    ga, gb = big_a[1:304, 1:], big_b[:290]  # (303, 290) at ld 306, offset 307 bytes; (290, 277) at ld 293
    a, b = cupy.asnumpy(ga), cupy.asnumpy(gb)
    got = blasx.gemm(1, ga, gb)
    assert isinstance(got, cupy.ndarray)
    assert np.array_equal(got.get(), a.astype(np.int64) @ b.astype(np.int64))


def test_tf32(spec):
    rng = np.random.default_rng(4)
    k = 1000
    a, b = _normal(rng, (600, k), np.float32), _normal(rng, (k, 500), np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    ieee = blasx.gemm(1.0, a, b)
    assert _rel(ieee, ref) <= P.tolerance(np.float32, k)
    tf = blasx.gemm(1.0, a, b, math="tf32")
    assert blasx.last_profile().host["math"] == "tf32"
    assert _rel(tf, ref) <= P.tolerance(np.float32, k, math="tf32")
    # what tensor cores multiply: the inputs rounded to TF32 (cuBLAS may round or truncate)
    rounded = to_tf32(a).astype(np.float64) @ to_tf32(b).astype(np.float64)
    assert _rel(tf, rounded) <= 2 * P.TF32_UNIT


def test_gemm_int8_scales_on_the_device(spec):
    rng = np.random.default_rng(5)
    a, b = _normal(rng, (700, 900), np.float32, "C"), _normal(rng, (900, 500), np.float32, "C")
    aq, sa = blasx.quantize(a, axis=0)
    bq, sb = blasx.quantize(b, axis=1)
    got = blasx.gemm_int8(aq, sa, bq, sb)
    exact = (aq.astype(np.float64) * sa[:, None]) @ (bq.astype(np.float64) * sb)
    assert got.dtype == np.float32 and _rel(got, exact) < 1e-6
    assert _rel(got, a.astype(np.float64) @ b) < 1.5e-2


def test_gemm_int8_past_the_int32_range_on_the_device(spec):
    """A k where int32 could wrap (every product 127 * 127) in exact pieces, host and CuPy operands."""
    k = P.K_EXACT + 2000
    a, b = np.full((64, k), 127, np.int8), np.full((k, 48), -127, np.int8)
    want = -127 * 127 * k * 0.125
    assert np.allclose(blasx.gemm_int8(a, np.float32(0.5), b, np.float32(0.25)), want, rtol=1e-6)
    got = blasx.gemm_int8(cupy.asarray(a), np.float32(0.5), cupy.asarray(b), np.float32(0.25))
    assert np.allclose(cupy.asnumpy(got), want, rtol=1e-6)


@pytest.mark.parametrize("dt", HALF + [np.int8], ids=lambda t: np.dtype(t).name)
def test_cupy_operands(spec, dt):
    """Operands already on a GPU (in-core: C accumulates in a tile-cache buffer, then converts)."""
    rng = np.random.default_rng(6)
    if dt is bfloat16:
        pytest.skip("CuPy has no bfloat16 arrays")
    if dt is np.int8:
        a = rng.integers(-128, 128, (520, 260)).astype(np.int8)
        b = rng.integers(-128, 128, (260, 300)).astype(np.int8)
    else:
        a, b = _normal(rng, (520, 260), dt, "C"), _normal(rng, (260, 300), dt, "C")
    got = blasx.matmul(cupy.asarray(a), cupy.asarray(b))
    assert isinstance(got, cupy.ndarray)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert _rel(got.get(), ref) <= (0 if dt is np.int8 else P.tolerance(dt, 260))


def test_float16_overflow_reported(spec):
    big = np.full((300, 300), 100.0, np.float16)
    with pytest.warns(P.Float16OverflowWarning, match="90000 of 90000"):
        c = blasx.matmul(big, big)
    assert np.isinf(c).all()
    few = np.ones((300, 300), np.float16)
    few[7, :] = 100  # row 7 alone: 300 * 100 * 100 > 65504, counted on the devices
    with pytest.warns(P.Float16OverflowWarning, match="300 of 90000"):
        c = blasx.matmul(few, big)
    assert np.isinf(c[7]).all() and np.isfinite(np.delete(c, 7, 0)).all()
    x = big / 100
    x[0, 0] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error", P.Float16OverflowWarning)
        c = blasx.matmul(x, x)
    assert np.isnan(c[0]).all() and np.isfinite(c[1:, 1:]).all()


def test_the_wide_tile_on_one_gpu():
    # float16 at 32768 on one GPU: 16 C tiles of 8192 (blasx.tile.WIDE_TILE); rows checked in float64
    blasx.configure(devices="cuda:0", cpu=False)
    try:
        rng = np.random.default_rng(7)
        n = 32768
        a = _normal(rng, (n, n), np.float16, "C")
        b = _normal(rng, (n, n), np.float16, "C")
        assert choose_tile(blasx.engine(), n, n, n, np.float16) == 8192
        got = blasx.matmul(a, b)
        rows = rng.choice(n, 64, replace=False)
        ref = a[rows].astype(np.float64) @ b.astype(np.float64)
        assert _rel(got[rows], ref) <= P.tolerance(np.float16, n)
    finally:
        blasx.shutdown()


def test_int8_in_the_tn_form_on_tiles_of_4096_and_the_callers_stream_kept():
    # every NN tile is copied to cuBLAS's TN form; the gemm must run after that copy on the same stream
    # (CuPy's `with stream:` had left the null stream current), and the caller's stream stays current
    blasx.configure(devices="cuda:0", tile=4096, cpu=False)
    try:
        rng = np.random.default_rng(9)
        n = 8192
        a = np.asfortranarray(rng.integers(-128, 128, (n, n), dtype=np.int8))
        b = np.asfortranarray(rng.integers(-128, 128, (n, n), dtype=np.int8))
        mine = cupy.cuda.Stream(non_blocking=True)
        mine.use()
        got = blasx.gemm(1, a, b)
        assert cupy.cuda.get_current_stream() == mine
        rows = np.sort(rng.choice(n, 16, replace=False))
        assert np.array_equal(got[rows], a[rows].astype(np.int64) @ b.astype(np.int64))
    finally:
        cupy.cuda.Stream.null.use()
        blasx.shutdown()


def test_tf32_calls_take_the_wide_tile_on_every_gpu():
    # float32 in TF32 math at 32768: 16 C tiles of 8192, 2 a stream on two GPUs (blasx.tile.WIDE_TILE; the
    # products at that tile are checked by bench.gemm's runs, the call's math reaching the rule on the sim)
    for devices in ("cuda", "cuda:0"):
        blasx.configure(devices=devices, cpu=False)
        try:
            eng = blasx.engine()
            n = 32768
            assert choose_tile(eng, n, n, n, np.float32, math="tf32") == 8192
            assert choose_tile(eng, n, n, n, np.float32) == 4096
            assert choose_tile(eng, 16384, 16384, 16384, np.float32, math="tf32") == 4096  # 4 C tiles
        finally:
            blasx.shutdown()
