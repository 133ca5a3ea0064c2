"""Reduced precision (issue 20) on the CPU and the sim: float16, bfloat16, int8, TF32, quantization.

Tolerances: ``blasx.precision.tolerance`` (relative Frobenius norm against float64 on the same
inputs: u_out + 2 sqrt(k) u_f32, plus 2^-9 under TF32); int8 -> int32 exact.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import blasx
from blasx import perfdb
from blasx import precision as P
from blasx.runtime import dtypes
from blasx.runtime.devices.numpy_kernels import to_tf32

try:
    from ml_dtypes import bfloat16
except ImportError:  # bfloat16 is optional
    bfloat16 = None

DEVICES = ["cpu", "sim:2"]
HALF_TYPES = [np.float16] + ([bfloat16] if bfloat16 is not None else [])


def _configure(dev: str) -> None:
    blasx.configure(devices=dev, tile=None if dev == "cpu" else 32)


def _normal(shape, dtype, seed=0, order="C"):
    x = np.random.default_rng(seed).standard_normal(shape)
    return np.asarray(x.astype(dtype), order=order)


def _ref(a, b):
    return a.astype(np.float64) @ b.astype(np.float64)


# ---------------------------------------------------------------- the dtype table

def test_table_rows_and_cuda_constants():
    h = dtypes.GEMM_BY_PREFIX["h"]
    i8 = dtypes.GEMM_BY_PREFIX["i8"]
    assert (h.dtype, h.compute, h.out, h.cuda_type, h.cuda_compute, h.level3) == (
        np.float16, np.float32, np.float16, 2, 68, False)
    assert (i8.dtype, i8.compute, i8.out, i8.cuda_type, i8.cuda_compute) == (np.int8, np.int32, np.int32, 3, 72)
    assert dtypes.CUDA_TYPE[np.dtype(np.int32)] == 10 and dtypes.CUDA_TYPE[np.dtype(np.float32)] == 0
    assert dtypes.compute_type(dtypes.BY_PREFIX["s"], "tf32") == 77
    assert dtypes.compute_type(dtypes.BY_PREFIX["s"], "ieee") == 68
    assert dtypes.compute_type(dtypes.BY_PREFIX["d"], "tf32") == 70
    # the level-3 view is unchanged: s, d, c, z
    assert dtypes.PREFIXES == "sdcz" and dtypes.of(np.float16) is None
    assert dtypes.parse("half", gemm=True) is h and dtypes.parse("i8", gemm=True) is i8
    with pytest.raises(ValueError, match="allowed: s, d, c, z"):
        dtypes.parse("h")
    assert dtypes.GEMM_OUT[np.dtype(np.float16)] == (np.float16, np.float32)
    assert dtypes.GEMM_OUT[np.dtype(np.int8)] == (np.int32,)
    if bfloat16 is not None:
        b = dtypes.GEMM_BY_PREFIX["b"]
        assert (b.dtype, b.compute, b.cuda_type) == (np.dtype(bfloat16), np.float32, 14)
        assert dtypes.parse("bf16", gemm=True) is b


def test_perfdb_keys_per_dtype():
    devs = ["cuda:0 NVIDIA H100"]
    for dt, ch in ((np.float16, "h"), (np.int8, "i8"), ("i8", "i8"), (np.float64, "d")):
        assert perfdb.key_for(devs, dt, 4096, 4096, 4096).dtype == ch
    key = perfdb.key_for(devs, np.int8, 4096, 4096, 4096)
    assert perfdb.PerfKey.parse(key.text) == key
    with pytest.raises(ValueError, match="gemm alone"):
        perfdb.key_for(devs, np.float16, 4096, 4096, 4096, "trsm")


# ---------------------------------------------------------------- combinations

def test_rejected_combinations_list_the_allowed_ones():
    a16, a8 = np.ones((4, 4), np.float16), np.ones((4, 4), np.int8)
    c_float = np.full((4, 4), 0.75)
    for call, exc, frag in [
        (lambda: blasx.matmul(a16, a16.astype(np.float32), out_dtype=np.float16), TypeError,
         "float16 -> float16 or float32"),
        (lambda: blasx.matmul(a16, a16, out_dtype=np.float64), TypeError, "int8 -> int32"),
        (lambda: blasx.dot(a16, a16, out_dtype=np.float64), TypeError, "out_dtype: got float64"),
        (lambda: blasx.tensordot(a8, a8, 1, out_dtype=np.int8), TypeError, "out_dtype: got int8"),
        (lambda: blasx.gemm(1, a8, a8, out_dtype=np.float32), TypeError, "out_dtype: got float32"),
        (lambda: blasx.matmul(a16, a16, math="fast"), ValueError, "allowed: 'ieee', 'tf32'"),
        (lambda: blasx.gemm(1.0, np.ones((4, 3), np.float16), a16), ValueError, "inner dimensions must match"),
        (lambda: blasx.gemm(0.5, a8, a8), ValueError, "integer alpha"),
        # a c of a type the pair cannot output: refused, not cast (fractions cut, values wrapped)
        (lambda: blasx.gemm(1, a8, a8, 1, c_float), TypeError, "c: got dtype float64 for int8 inputs"),
        (lambda: blasx.gemm(1.0, a16, a16, 1.0, c_float.astype(np.complex128)), TypeError,
         "c: got dtype complex128 for float16"),
        # ... nor one other than out_dtype (rounded to float16 before beta scaled it: 1e5 -> inf)
        (lambda: blasx.gemm(1.0, a16, a16, 0.1, c_float * 1e5, out_dtype=np.float16), TypeError,
         "with out_dtype=float16 c must be float16"),
        (lambda: blasx.gemm(1, a8, a8, np.nan, np.zeros((4, 4), np.int32)), ValueError, "beta: got nan"),
        (lambda: blasx.quantize(np.array([[5j, 1]])), TypeError, "x: got complex128, need a real type"),
        (lambda: blasx.quantize(np.array([1.0, 1e300])), ValueError, "outside float32's range"),
        (lambda: blasx.quantize(np.array([1e-44, -1e-45])), ValueError, "outside float32's range"),
        (lambda: blasx.gemm_int8(a8, None, a8, 1.0), TypeError, "a_scale: got None"),
        (lambda: blasx.gemm_int8(a8, 1.0, a8, "x"), TypeError, "b_scale"),
        (lambda: blasx.matmul(a16, a16, out_dtype="bogus"), TypeError, "out_dtype: got 'bogus', not a data type"),
        (lambda: blasx.quantize(np.ones(3), dtype="foo"), TypeError,
         "dtype: got 'foo', not a data type; allowed: int8"),
    ]:
        c0 = c_float.copy()
        with pytest.raises(exc, match=frag):
            call()
        assert np.array_equal(c_float, c0)
    # mixed types follow the old rules (scipy's for gemm, numpy's for matmul); TF32 is float32's alone
    assert blasx.gemm(1.0, a16, a16.astype(np.float32)).dtype == np.float32
    assert blasx.matmul(a16, a16.astype(np.float32)).dtype == np.float32
    assert blasx.gemm(1, a8, a8, 1, np.ones((4, 4), np.int32)).dtype == np.int32  # (c of an allowed type)
    assert blasx.gemm(1.0, a16, a16, 0.5, np.ones((4, 4), np.float32), out_dtype=np.float32).dtype == np.float32
    assert blasx.gemm(1.0, a16, a16, 1.0, np.ones((4, 4), np.float32)).dtype == np.float32
    d = _normal((30, 30), np.float64)
    assert np.abs(blasx.gemm(1.0, d, d, math="tf32") - d @ d).max() < 1e-12


# ---------------------------------------------------------------- half and bfloat16

@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dt", HALF_TYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("out", [None, np.float32], ids=["default", "float32"])
def test_half_types_accumulate_in_float32(dev, dt, out):
    _configure(dev)
    m, k, n = 70, 97, 45  # edge tiles in every dimension, 4 k-steps at tile 32
    a, b = _normal((m, k), dt), _normal((k, n), dt, seed=1)
    c = blasx.matmul(a, b, out_dtype=out)
    want = np.dtype(dt) if out is None else np.dtype(np.float32)
    assert c.dtype == want and c.shape == (m, n) and c.flags.c_contiguous
    tol = P.tolerance(dt, k, out)
    ref = _ref(a, b)
    assert np.linalg.norm(c.astype(np.float64) - ref) / np.linalg.norm(ref) <= tol
    # numpy's float32 product, cast once: what a float32-accumulating GPU gives
    f32 = (a.astype(np.float32) @ b.astype(np.float32)).astype(want)
    assert np.linalg.norm(c.astype(np.float64) - f32.astype(np.float64)) / np.linalg.norm(ref) <= tol
    assert tol < (2e-3 if np.dtype(want).itemsize == 2 and dt is np.float16 else 1e-2)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dt", HALF_TYPES, ids=lambda t: np.dtype(t).name)
def test_half_gemm_with_beta_trans_and_c(dev, dt):
    """scipy semantics: alpha, beta, op(a), op(b), C loaded (converted to float32 on the device)."""
    _configure(dev)
    m, k, n = 50, 66, 41
    a = _normal((k, m), dt, order="F")  # op(a) = a.T
    b = _normal((k, n), dt, seed=1, order="F")
    c = _normal((m, n), dt, seed=2, order="F")
    c0 = c.copy()
    out = blasx.gemm(0.5, a, b, beta=-2.0, c=c, trans_a=1)
    assert out.dtype == np.dtype(dt) and np.array_equal(c, c0)  # c untouched without overwrite_c
    ref = 0.5 * _ref(a.T, b) - 2.0 * c.astype(np.float64)
    assert np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref) <= P.tolerance(dt, k)
    same = blasx.gemm(0.5, a, b, beta=-2.0, c=c, trans_a=1, overwrite_c=True)
    assert same is c and np.array_equal(same, out)


@pytest.mark.parametrize("dev", DEVICES)
def test_alpha_zero_and_empty_inner_dimension(dev):
    _configure(dev)
    a, b = _normal((6, 0), np.float16), _normal((0, 5), np.float16)
    assert np.array_equal(blasx.matmul(a, b), np.zeros((6, 5), np.float16))
    c = _normal((6, 5), np.float16, seed=3, order="F")
    out = blasx.gemm(0.0, _normal((6, 4), np.float16), _normal((4, 5), np.float16), beta=3.0, c=c)
    assert np.array_equal(out, (3.0 * c.astype(np.float32)).astype(np.float16))


@pytest.mark.parametrize("dev", DEVICES)
def test_float16_overflow_warns_and_propagation_does_not(dev):
    _configure(dev)
    big = np.full((40, 40), 100.0, np.float16)  # every product sum is 400000 > 65504
    with pytest.warns(P.Float16OverflowWarning, match="1600 of 1600"):
        c = blasx.matmul(big, big)
    assert np.isinf(c).all()
    assert np.isfinite(blasx.matmul(big, big, out_dtype=np.float32)).all()
    x = _normal((40, 40), np.float16)
    x[3, 4], x[5, 6] = np.inf, np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error", P.Float16OverflowWarning)
        c = blasx.matmul(x, _normal((40, 40), np.float16, seed=1))
    assert np.isnan(c[5]).all() and not np.isfinite(c[3]).all()


@pytest.mark.parametrize("dev", DEVICES)
def test_float16_overflow_counts_each_rounded_value(dev):
    """Counted where C is rounded: an inf from a finite float32 sum is one; a NaN row from a NaN
    input is not; C = beta C (alpha 0) counts too. The warning names the caller's line."""
    _configure(dev)
    a = np.ones((40, 40), np.float16)
    a[0, :] = 100  # row 0: 40 * 100 * 100 = 400000 > 65504
    a[5, 6] = np.nan  # row 5: NaN, propagated
    b = np.full((40, 40), 100.0, np.float16)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        c = blasx.matmul(a, b)
    assert [str(w.message).split(" result")[0] for w in got] == ["float16 overflow: 40 of 1600"]
    assert got[0].category is P.Float16OverflowWarning and got[0].lineno == _line_of("c = blasx.matmul(a, b)")
    assert np.isinf(c[0]).all() and np.isnan(c[5]).all() and np.isfinite(np.delete(c, [0, 5], 0)).all()
    with pytest.warns(P.Float16OverflowWarning, match="25 of 25"):
        blasx.gemm(0.0, a[:5], b[:, :5], beta=2.0, c=np.full((5, 5), 60000.0, np.float16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", P.Float16OverflowWarning)
        blasx.gemm(1.0, a[1:5], b, out_dtype=np.float32)  # a float32 output never overflows
    with warnings.catch_warnings(record=True) as got:  # a batch of separate items: one warning for the call
        warnings.simplefilter("always")
        blasx.matmul(np.stack([a, a]), np.stack([b, b * 0.5]))
    assert [str(w.message).split(" result")[0] for w in got] == ["float16 overflow: 80 of 3200"]
    assert got[0].filename == __file__


def _line_of(text: str) -> int:
    """The line of this file's function holding ``text`` (the warning's line, without file paths)."""
    import inspect
    lines, start = inspect.getsourcelines(test_float16_overflow_counts_each_rounded_value)
    return start + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("dt", HALF_TYPES, ids=lambda t: np.dtype(t).name)
def test_batched_and_vector_matmul(dt):
    _configure("sim:2")
    a, b = _normal((3, 20, 33), dt), _normal((33, 17), dt, seed=1)
    c = blasx.matmul(a, b)
    assert c.shape == (3, 20, 17)
    for i in range(3):
        assert np.linalg.norm(c[i].astype(np.float64) - _ref(a[i], b)) / np.linalg.norm(_ref(a[i], b)) \
            <= P.tolerance(dt, 33)
    v = _normal((33,), dt, seed=2)
    assert blasx.matmul(a[0], v).shape == (20,) and blasx.matmul(v, b).shape == (17,)


def test_half_moves_half_the_bytes_of_float32():
    """Tiles travel in the operands' own type: a half call's host loads are half a float32 call's."""
    blasx.configure(devices="sim:1", tile=32)
    moved = {}
    for dt in (np.float16, np.float32):
        blasx.matmul(_normal((64, 64), dt), _normal((64, 64), dt, seed=1))
        prof = blasx.last_profile()
        moved[dt] = prof.totals()["bytes_h2d"]
    assert moved[np.float16] * 2 == moved[np.float32] > 0


# ---------------------------------------------------------------- int8

@pytest.mark.parametrize("dev", DEVICES)
def test_int8_products_are_exact_in_int32(dev):
    _configure(dev)
    rng = np.random.default_rng(0)
    m, k, n = 45, 70, 37  # no dimension a multiple of 4: padded leading dimensions on the sim
    a = rng.integers(-128, 128, (m, k)).astype(np.int8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    c = blasx.matmul(a, b)
    assert c.dtype == np.int32 and np.array_equal(c, a.astype(np.int64) @ b.astype(np.int64))
    c0 = rng.integers(-1000, 1000, (m, n)).astype(np.int32)
    g = blasx.gemm(3, np.asfortranarray(a), b, beta=-2, c=c0)
    assert np.array_equal(g, 3 * (a.astype(np.int64) @ b) - 2 * c0.astype(np.int64))


def test_int8_tiles_have_leading_dimensions_multiple_of_4():
    from blasx.runtime.call import Call
    from blasx.runtime.plans import plan_gemm
    from blasx.runtime.stats import CallStats
    tasks = plan_gemm(10, 10, 10, 8, 0, 0)
    call = Call("i8gemm", [], tasks, np.int8, 1, 0, CallStats([]), out_dtype=np.int32)
    assert call.mixed and call.acc_dtype == np.int32 and call.tile_ld(0, 2) == 4 and call.tile_ld(0, 8) == 8
    assert call.tile_nbytes(0, 2, 8) == 32 and call.tile_nbytes(2, 2, 8) == 4 * 8 * 4
    half = Call("hgemm", [], tasks, np.float16, 1, 0, CallStats([]))
    assert half.mixed and half.tile_dtype(0) == np.float16 and half.tile_dtype(2) == np.float32
    assert half.home_dtype(2) == np.float16 and half.scalars.dtype == np.float32
    assert not Call("dgemm", [], tasks, np.float64, 1, 0, CallStats([])).mixed


# ---------------------------------------------------------------- TF32

def test_to_tf32_rounds_to_10_mantissa_bits():
    x = np.array([1.0, 1.0 + 2.0 ** -11, 1.0 + 2.0 ** -12, -(1.0 + 3 * 2.0 ** -12), np.inf, np.nan], np.float32)
    r = to_tf32(x)
    assert r[0] == 1.0 and r[1] == 1.0 + 2.0 ** -10 and r[2] == 1.0  # ties away from zero
    assert r[3] == -(1.0 + 2.0 ** -10) and np.isinf(r[4]) and np.isnan(r[5])


def test_tf32_is_opt_in_and_reported_on_the_sim():
    _configure("sim:2")
    k = 90
    a, b = _normal((60, k), np.float32), _normal((k, 50), np.float32, seed=1)
    ref = _ref(a, b)
    ieee = blasx.matmul(a, b)
    assert np.linalg.norm(ieee - ref) / np.linalg.norm(ref) <= P.tolerance(np.float32, k)
    for tf in (blasx.matmul(a, b, math="tf32"), blasx.gemm(1.0, a, b, math="tf32"),
               blasx.dot(a, b, math="tf32"), blasx.tensordot(a, b, 1, math="tf32")):
        assert blasx.last_profile().host["math"] == "tf32"
        err = np.linalg.norm(tf - ref) / np.linalg.norm(ref)
        assert P.tolerance(np.float32, k) < err <= P.tolerance(np.float32, k, math="tf32")
        rounded = _ref(to_tf32(a), to_tf32(b))  # exactly what tensor cores multiply
        assert np.linalg.norm(tf - rounded) / np.linalg.norm(ref) <= P.tolerance(np.float32, k)
    blasx.configure(devices="sim:2", tile=32, math="tf32")
    again = blasx.matmul(a, b)  # (two devices may sum the k-steps in another order: not bit-equal)
    assert blasx.last_profile().host["math"] == "tf32"
    assert np.linalg.norm(again - rounded) / np.linalg.norm(ref) <= P.tolerance(np.float32, k)
    with pytest.raises(ValueError, match="math: got 'fast'"):
        blasx.configure(math="fast")


def test_profile_report_names_the_math_mode():
    _configure("sim:2")
    a = _normal((40, 40), np.float32)
    blasx.gemm(1.0, a, a, math="tf32")
    assert "math tf32" in blasx.last_profile().report().splitlines()[0]
    blasx.matmul(a, a)
    assert "math ieee" in blasx.last_profile().report().splitlines()[0]
    blasx.configure(devices="cpu")
    blasx.gemm(1.0, a, a, math="tf32")  # the host BLAS: IEEE
    assert "math ieee" in blasx.last_profile().report().splitlines()[0]


def test_tf32_on_the_cpu_is_ieee():
    """The CPU has no TF32 units: a CPU-only engine computes float32 in IEEE and says so."""
    blasx.configure(devices="cpu", math="tf32")
    a, b = _normal((60, 90), np.float32), _normal((90, 50), np.float32, seed=1)
    c = blasx.gemm(1.0, a, b)
    assert blasx.last_profile().host["math"] == "ieee"
    assert np.linalg.norm(c - _ref(a, b)) / np.linalg.norm(_ref(a, b)) <= P.tolerance(np.float32, 90)


def test_cublas_argument_errors_fail_the_call_not_the_device():
    """cuBLAS's NOT_SUPPORTED / INVALID_VALUE reject one call's arguments; other statuses break the device."""
    from blasx.runtime.devices.cuda import CudaDevice

    class CUBLASError(Exception):  # CuPy's exception, by name
        pass
    judge = CudaDevice.is_device_error
    assert not judge(None, CUBLASError("CUBLAS_STATUS_NOT_SUPPORTED"))
    assert not judge(None, CUBLASError("CUBLAS_STATUS_INVALID_VALUE"))
    assert not judge(None, MemoryError("out of memory"))
    assert judge(None, CUBLASError("CUBLAS_STATUS_EXECUTION_FAILED"))


@pytest.mark.parametrize("ops", [(0, 0), (1, 0), (0, 1), (1, 1)], ids=["NN", "TN", "NT", "TT"])
@pytest.mark.parametrize("dims", [(8, 12, 16), (7, 5, 9), (8, 5, 10), (6, 3, 8)], ids=str)
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "odd-ld"])
def test_int8_tiles_reach_cublas_in_a_form_it_takes(monkeypatch, ops, dims, aligned):
    """The cuda backend's int8 operand fix-up (cuda_lowp.imma_operands), on numpy memory: cuBLAS gets
    the TN form, m, k and the leading dimensions are multiples of 4 and the product is unchanged."""
    import types
    from collections import namedtuple
    from contextlib import nullcontext
    from blasx.runtime.devices import cuda_lowp

    arena = np.zeros(1 << 16, np.uint8)

    def view(ptr, rows, cols, ld, dtype):
        return np.lib.stride_tricks.as_strided(arena[ptr:].view(np.dtype(dtype)), (rows, cols), (1, ld))
    monkeypatch.setattr(cuda_lowp, "device_view", view)
    monkeypatch.setitem(__import__("sys").modules, "cupy", types.SimpleNamespace(copyto=np.copyto))
    m, n, k = dims
    op_a, op_b = ops
    rng = np.random.default_rng(sum(dims))
    a = rng.integers(-128, 128, (k, m) if op_a else (m, k)).astype(np.int8)
    b = rng.integers(-128, 128, (n, k) if op_b else (k, n)).astype(np.int8)
    if aligned:  # heap tiles: leading dimensions padded to 4, aligned offsets
        (pa, lda), (pb, ldb) = (0, -(-a.shape[0] // 4) * 4), (4096, -(-b.shape[0] // 4) * 4)
    else:  # in-core sub-matrices: odd leading dimensions and offsets
        (pa, lda), (pb, ldb) = (1, a.shape[0] + 1), (4001, b.shape[0] + 3)
    view(pa, *a.shape, lda, np.int8)[...] = a
    view(pb, *b.shape, ldb, np.int8)[...] = b
    Step = namedtuple("Step", "m n k op_a op_b")
    m2, k2, oa, ob, a2, b2 = cuda_lowp.imma_operands(lambda nbytes: 32768, nullcontext(), Step(m, n, k, op_a, op_b),
                                                     (pa, lda), (pb, ldb))
    assert m2 % 4 == 0 and k2 % 4 == 0 and a2[1] % 4 == 0 and b2[1] % 4 == 0 and a2[0] % 4 == 0 == b2[0] % 4
    assert (oa, ob) == (1, 0)  # "TN": the only form cuBLAS runs on its int8 tensor cores
    if aligned and ops == (1, 0) and (m, k) == (m2, k2):
        assert (a2, b2) == ((pa, lda), (pb, ldb))  # already in that form: handed on in place
    ta = view(a2[0], *((m2, k2) if oa == 0 else (k2, m2)), a2[1], np.int8).astype(np.int64)
    tb = view(b2[0], *((k2, n) if ob == 0 else (n, k2)), b2[1], np.int8).astype(np.int64)
    got = (ta if oa == 0 else ta.T) @ (tb if ob == 0 else tb.T)
    ref = (a.T if op_a else a).astype(np.int64) @ (b.T if op_b else b).astype(np.int64)
    assert np.array_equal(got[:m], ref)


@pytest.mark.parametrize("ops", [(0, 0), (1, 1)], ids=["NN", "TT"])
def test_int8_exact_path_where_cublas_refuses(monkeypatch, ops):
    """The cuda backend's fallback for int8 forms cuBLAS refuses (cuda_lowp.int8_exact), on numpy
    memory: alpha op(A) op(B) + beta C in int32, exact."""
    import types
    from collections import namedtuple
    from contextlib import nullcontext
    from blasx.runtime.devices import cuda_lowp
    from blasx.runtime.tasks import SC_ALPHA, SC_BETA

    arena = np.zeros(1 << 16, np.uint8)

    def view(ptr, rows, cols, ld, dtype):
        dt = np.dtype(dtype)
        return np.lib.stride_tricks.as_strided(arena[ptr:].view(np.uint8)[:(rows + ld * cols) * dt.itemsize]
                                               .view(dt), (rows, cols), (dt.itemsize, ld * dt.itemsize))
    monkeypatch.setattr(cuda_lowp, "device_view", view)
    monkeypatch.setitem(__import__("sys").modules, "cupy",
                        types.SimpleNamespace(copyto=np.copyto, matmul=np.matmul))
    m, n, k = 7, 5, 9
    op_a, op_b = ops
    rng = np.random.default_rng(1)
    a = rng.integers(-128, 128, (k, m) if op_a else (m, k)).astype(np.int8)
    b = rng.integers(-128, 128, (n, k) if op_b else (k, n)).astype(np.int8)
    c0 = rng.integers(-1000, 1000, (m, n)).astype(np.int32)
    view(0, *a.shape, a.shape[0] + 1, np.int8)[...] = a
    view(1024, *b.shape, b.shape[0], np.int8)[...] = b
    view(4096, m, n, 8, np.int32)[...] = c0
    call = types.SimpleNamespace(scalars=np.zeros(8, np.int32))
    call.scalars[SC_ALPHA], call.scalars[SC_BETA] = 3, -2
    Step = namedtuple("Step", "m n k op_a op_b alpha beta")
    cuda_lowp.int8_exact(nullcontext(), Step(m, n, k, op_a, op_b, SC_ALPHA, SC_BETA), call,
                         (0, a.shape[0] + 1), (1024, b.shape[0]), (4096, 8))
    ref = 3 * ((a.T if op_a else a).astype(np.int64) @ (b.T if op_b else b)) - 2 * c0.astype(np.int64)
    assert np.array_equal(view(4096, m, n, 8, np.int32), ref)


# ---------------------------------------------------------------- quantization

def test_quantize_per_tensor_and_per_channel():
    x = _normal((30, 20), np.float32)
    x[:, 3] = 0  # a zero channel gets scale 1
    q, s = P.quantize(x)
    assert q.dtype == np.int8 and s.shape == () and s.dtype == np.float32
    assert np.abs(q).max() == 127 and np.all(np.abs(x - q * s) <= s / 2 + 1e-6)
    q1, s1 = P.quantize(x, axis=1)
    assert s1.shape == (20,) and s1[3] == 1 and np.all(q1[:, 3] == 0)
    assert np.all(np.abs(x - q1 * s1[None, :]) <= s1[None, :] / 2 + 1e-6)
    q0, s0 = P.quantize(x, axis=-2)
    assert s0.shape == (30,) and np.all(np.abs(x - q0 * s0[:, None]) <= s0[:, None] / 2 + 1e-6)
    for kw, exc, frag in [({"dtype": np.int16}, TypeError, "allowed: int8"), ({"axis": 2}, ValueError, "axis")]:
        with pytest.raises(exc, match=frag):
            P.quantize(x, **kw)
    bad = x.copy()
    bad[0, 0] = np.inf
    with pytest.raises(ValueError, match="finite"):
        P.quantize(bad)


@pytest.mark.parametrize("dev", DEVICES)
def test_gemm_int8_applies_scales_on_the_device(dev):
    _configure(dev)
    a, b = _normal((70, 90), np.float32), _normal((90, 50), np.float32, seed=1)
    ref = a @ b
    for (ax_a, ax_b), limit in (((None, None), 2.5e-2), ((0, 1), 1.5e-2)):
        aq, sa = P.quantize(a, axis=ax_a)
        bq, sb = P.quantize(b, axis=ax_b)
        c = P.gemm_int8(aq, sa, bq, sb)
        assert c.dtype == np.float32 and c.shape == (70, 50)
        sa2 = sa if ax_a is None else sa[:, None]
        exact = (aq.astype(np.float64) * sa2) @ (bq.astype(np.float64) * sb)
        assert np.linalg.norm(c - exact) / np.linalg.norm(exact) < 1e-6  # int32 sums exact, scales in float32
        assert np.linalg.norm(c - ref) / np.linalg.norm(ref) < limit
    with pytest.raises(ValueError, match="one per rows of a_q"):
        P.gemm_int8(aq, np.ones(3), bq, sb)
    with pytest.raises(TypeError, match="need int8"):
        P.gemm_int8(a, sa, bq, sb)


def test_bad_input_leaves_arrays_and_engine_alone():
    _configure("sim:2")
    a = _normal((8, 8), np.float16)
    c = np.ones((8, 8), np.float16, order="F")
    with pytest.raises(TypeError):
        blasx.gemm(1.0, a, a.astype(np.float32), beta=1.0, c=c, overwrite_c=True, out_dtype=np.float16)
    assert np.all(c == 1)
    assert blasx.matmul(a, a).dtype == np.float16


# ---------------------------------------------------------------- tools

@pytest.mark.parametrize("dt", ["h", "i8"] + (["b"] if bfloat16 is not None else []))
def test_cli_gemm_runs_and_checks_each_reduced_type(dt, capsys):
    from blasx.cli import main
    assert main(["gemm", "--n", "96", "--dtype", dt, "--devices", "sim:2", "--tile", "32", "--runs", "1",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "(ok, tolerance" in out and ("int8 -> int32" in out if dt == "i8" else True)


def test_tune_takes_the_reduced_types(tmp_path):
    rows = blasx.tune(sizes=[64], dtypes="h,i8", tiles=[32, 64], runs=1, devices="sim:2",
                      db=str(tmp_path / "db.sqlite"))
    assert [r["dtype"] for r in rows] == ["h", "i8"] and all(r["tile"] in (32, 64) and not r["bad"] for r in rows)


# ---------------------------------------------------------------- offload

def test_offload_sends_float16_at_operator_to_the_engine():
    """``a @ b`` on float16 above the threshold runs on blasx (float32 accumulation, a float16
    result as numpy's); below it, numpy's own loop."""
    import importlib
    O = importlib.import_module("blasx.offload")
    if not O.matmul_available():
        pytest.skip("blasx._matmul_loops is not built")
    blasx.configure(devices="sim:2", tile=16)
    a, b = _normal((40, 30), np.float16), _normal((30, 20), np.float16, seed=1)
    with blasx.offload(threshold=1e4):
        before = O.offload_stats()["matmul"]
        c = a @ b
        assert O.offload_stats()["matmul"] == before + 1
        small = a[:4, :4] @ b[:4, :4]  # 128 flops: numpy's loop
        assert O.offload_stats()["matmul"] == before + 1
    assert c.dtype == np.float16 and c.flags.c_contiguous and small.dtype == np.float16
    assert np.linalg.norm(c.astype(np.float64) - _ref(a, b)) / np.linalg.norm(_ref(a, b)) <= P.tolerance(np.float16, 30)


@pytest.mark.parametrize("dev", DEVICES)
def test_int32_sums_past_the_range_wrap_as_cublas(dev):
    """An int8 product past int32's range wraps modulo 2^32 on every device (the GPU's cuBLAS does; a float64 ->
    int32 cast gave INT_MIN or device-dependent values)."""
    _configure(dev)
    a, b = np.full((1, 140000), 127, np.int8), np.full((140000, 1), 127, np.int8)
    want = (127 * 127 * 140000 + 2 ** 31) % 2 ** 32 - 2 ** 31
    assert int(blasx.gemm(1, a, b)[0, 0]) == want
    # int32 arithmetic: alpha times the sum wraps too, exactly (alpha * sum past 2^53 was formed in float64)
    a, b = a[:, :301], b[:301]
    alpha = 2 ** 31 - 1
    assert int(blasx.gemm(alpha, a, b)[0, 0]) == (alpha * 127 * 127 * 301 + 2 ** 31) % 2 ** 32 - 2 ** 31


@pytest.mark.parametrize("dev", DEVICES)
def test_gemm_int8_past_the_int32_range_sums_in_exact_pieces(dev):
    """gemm_int8's float32 result stays right where an int32 sum would wrap (k > K_EXACT, here at its worst,
    every product 127 * 127): the k pieces are each exact, added in float32."""
    _configure(dev)
    k = P.K_EXACT + 2000
    a, b = np.full((2, k), 127, np.int8), np.full((k, 3), -127, np.int8)
    c = P.gemm_int8(a, np.float32(0.5), b, np.float32(0.25))
    assert c.shape == (2, 3) and np.allclose(c, -127 * 127 * k * 0.125, rtol=1e-6)


def test_configure_takes_math_in_any_case():
    blasx.configure(devices="cpu", math="TF32")
    assert blasx.session.settings().math == "tf32"
    blasx.configure(devices="cpu")


@pytest.mark.parametrize("dt", [np.float32, np.float64, np.complex64])
def test_front_ends_take_out_dtype_naming_the_blas_type_itself(dt):
    """matmul / dot / tensordot take ``out_dtype`` equal to a BLAS input type (gemm does): the same result."""
    _configure("sim:2")
    a = _normal((5, 7), dt)
    for f in (blasx.matmul, blasx.dot, lambda x, y, **k: blasx.tensordot(x, y, 1, **k)):
        got = f(a, a.T, out_dtype=dt)
        assert got.dtype == dt and np.allclose(got, a @ a.T, rtol=1e-5)


def test_conflicting_out_types_and_bad_scales_are_refused():
    """out_dtype beside a dot's out of another type, or beside matmul's dtype= naming another, is a TypeError
    (out_dtype was ignored, or dtype= was); non-finite gemm_int8 scales, a 0-d quantize with an axis and a
    tolerance for a pair gemm does not take name their argument."""
    _configure("sim:2")
    a, b = np.ones((4, 3), np.float16), np.ones((3, 2), np.float16)
    out = np.zeros((4, 2), np.float16)
    with pytest.raises(TypeError, match="out: got dtype float16; with out_dtype=float32"):
        blasx.dot(a, b, out=out, out_dtype=np.float32)
    assert (out == 0).all()
    with pytest.raises(TypeError, match="dtype, out_dtype: got float32 and float16"):
        blasx.matmul(a, b, dtype=np.float32, out_dtype=np.float16)
    assert blasx.matmul(a, b, dtype=np.float32, out_dtype=np.float32).dtype == np.float32
    q = np.ones((2, 3), np.int8)
    for bad in (np.nan, np.inf, 1e300):
        with pytest.raises(ValueError, match="a_scale: holds .*need finite scales"):
            P.gemm_int8(q, bad, q.T.copy(), 1.0)
    with pytest.raises(ValueError, match="axis: got 0 for a 0-d x"):
        P.quantize(np.array(1.0, np.float32), axis=0)
    with pytest.raises(TypeError, match="out_dtype: got float64 for float16"):
        P.tolerance(np.float16, 100, out_dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no numpy cast warning before quantize's own error)
        with pytest.raises(ValueError, match="outside float32's range"):
            P.quantize(np.array([1e300, 1.0]))


@pytest.mark.skipif(bfloat16 is None, reason="needs ml_dtypes")
def test_gemm_takes_bfloat16_beside_another_type_as_scipy_does():
    """bfloat16 beside another type follows scipy's rule (an unlisted numeric type: float64), as float16 beside
    float32 does; the TypeError claimed such types were converted."""
    _configure("sim:2")
    a, b = np.ones((2, 3), bfloat16), np.ones((3, 2), np.float32)
    c = blasx.gemm(1.0, a, b)
    assert c.dtype == np.float64 and (c == 3).all()
    assert blasx.gemm(1.0, a, b.astype(np.complex64)).dtype == np.complex128


@pytest.mark.parametrize("dev", DEVICES)
def test_float16_overflow_follows_the_callers_errstate(dev):
    """np.errstate(over="ignore") silences the overflow warning and "raise" raises FloatingPointError after the
    call, as numpy's float16 matmul does; under offload numpy's own error comes, with no fallback warning."""
    _configure(dev)
    a = np.full((4, 4), 300, np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(over="ignore"):
            assert np.isinf(blasx.matmul(a, a)).all()
        with np.errstate(over="raise"), pytest.raises(FloatingPointError, match="float16 overflow"):
            blasx.matmul(a, a)
        with blasx.offload(threshold=0), np.errstate(over="raise"), pytest.raises(FloatingPointError):
            a @ a
    with pytest.warns(blasx.Float16OverflowWarning):
        blasx.matmul(a, a)
    # "raise" comes once the caller's array is whole: a strided out written through a copy-back
    big = np.zeros((8, 8), np.float16)
    with np.errstate(over="raise"), pytest.raises(FloatingPointError):
        blasx.matmul(a, a, out=big[::2, ::2])
    assert np.isinf(big[::2, ::2]).all()


@pytest.mark.parametrize("prefix", ["d", "s", "z", "c", "h", "i8"])
def test_operands_peak_bytes_bounds_what_making_them_allocates(prefix):
    """The CLI's and tune's host-memory check: the estimate is at least the traced peak of making a and b with
    random_operand beside an output (the draws, casts and copies included), and not far above it."""
    import tracemalloc
    m, n, k = 300, 200, 400
    row = dtypes.GEMM_BY_PREFIX[prefix]
    rng = np.random.default_rng(0)
    tracemalloc.start()
    try:
        c = np.empty((m, n), row.out, order="F")
        a = P.random_operand(rng, (m, k), row.dtype)
        b = P.random_operand(rng, (k, n), row.dtype)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del a, b, c
    est = P.operands_peak_bytes(m, n, k, row.dtype, row.out)
    assert peak <= est <= 1.5 * peak + (1 << 16), (peak, est)
