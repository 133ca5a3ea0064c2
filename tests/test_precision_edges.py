"""Reduced precision at its edges: byte-swapped operands, a float16 x bfloat16 pair with out_dtype in every front
end, int8 alpha of a narrow type, gemm_int8's scales as quantize makes them, and the math mode said where the CPU
alone runs (each failed before its fix)."""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import pytest

import blasx
import blasx.cli
from blasx import precision as P

bfloat16 = pytest.importorskip("ml_dtypes").bfloat16


def _normal(shape, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dt", ["f2", "f4"])
def test_byte_swapped_operands_follow_their_types_rules(dt):
    blasx.configure(devices="sim:2", tile=16)
    a, b, c = _normal((40, 30), dt), _normal((30, 20), dt, 1), _normal((40, 20), dt, 2)
    swapped = [x.astype(">" + dt) for x in (a, b, c)]
    native = blasx.gemm(1.5, a, b, 0.5, c)
    got = blasx.gemm(1.5, *swapped[:2], 0.5, swapped[2])
    assert got.dtype == native.dtype == np.dtype(dt) and np.array_equal(got, native)  # float16 stays float16
    for f in (blasx.matmul, blasx.dot):
        assert np.array_equal(f(*swapped[:2], out_dtype=np.float32), f(a, b, out_dtype=np.float32))
    assert np.array_equal(blasx.gemm(1.0, *swapped[:2], out_dtype=np.float32),
                          blasx.gemm(1.0, a, b, out_dtype=np.float32))
    x = np.array([1e39, 1.0])  # float64 values past float32's range: a swapped float64 is still float64
    q, s = blasx.quantize(x.astype(">f8"))
    assert np.array_equal(q, blasx.quantize(x)[0]) and s == blasx.quantize(x)[1]


def test_a_float16_bfloat16_pair_with_out_dtype_is_refused_by_every_front_end():
    blasx.configure(devices="sim:2", tile=16)
    h, b = np.ones((4, 3), np.float16), np.ones((3, 2), bfloat16)
    for call in (lambda: blasx.matmul(h, b, out_dtype=np.float32), lambda: blasx.dot(h, b, out_dtype=np.float32),
                 lambda: blasx.tensordot(h, b, 1, out_dtype=np.float32), lambda: blasx.dot(h, b, out_dtype=np.int32)):
        with pytest.raises(TypeError, match="a, b: got float16 and bfloat16; gemm takes A and B of one type"):
            call()


def test_int8_alpha_of_a_narrow_type_needs_no_cast_warning():
    blasx.configure(devices="sim:2", tile=16)
    q = np.ones((4, 4), np.int8)
    with warnings.catch_warnings(), np.errstate(over="raise"):
        warnings.simplefilter("error")
        assert (blasx.gemm(np.float16(2), q, q, beta=np.float16(0)) == 8).all()
    with pytest.raises(ValueError, match="int8 gemm takes integer alpha"):
        blasx.gemm(np.float16(np.inf), q, q)


def test_gemm_int8_scales_as_quantize_takes_them():
    blasx.configure(devices="sim:2", tile=16)
    q = np.ones((4, 4), np.int8)
    assert (P.gemm_int8(q, np.array(0.5, bfloat16), q, 1.0) == 2.0).all()  # bfloat16 is a real type
    for tiny in (1e-50, np.array([1.0, 1.0, 1e-60, 1.0])):  # nonzero, 0 in float32: its rows silently 0
        with pytest.raises(ValueError, match="a_scale: holds 1e-[56]0; need finite scales within float32's range"):
            P.gemm_int8(q, tiny, q, 1.0)
    assert (P.gemm_int8(q, 0.0, q, 1.0) == 0).all()  # a zero scale is the caller's


def test_the_math_said_is_the_math_that_runs():
    blasx.configure(devices="cpu", math="tf32")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        blasx.cli.main(["info"])
    line = next(x for x in out.getvalue().splitlines() if x.startswith("math:"))
    assert line.startswith("math: float32 gemm in ieee (tf32 configured: the CPU has no TF32)")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert blasx.cli.main(["gemm", "--devices", "cpu", "--math", "tf32", "--n", "64", "--dtype", "s",
                               "--runs", "1"]) == 0
    assert ", ieee math (the CPU has no TF32)" in out.getvalue()
    assert P.tolerance(np.float32, 100, math="TF32") == P.tolerance(np.float32, 100, math="tf32")
    with pytest.raises(ValueError, match="math: got 'fast'"):
        P.tolerance(np.float32, 100, math="fast")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_inf_input_on_the_cpu_raises_no_false_floating_point_error(dtype):
    """The CPU device computes float16 / bfloat16 products through the host BLAS in float32, whose kernels
    flagged "invalid" on an inf input (lanes no result reads): under np.errstate(invalid="raise") the call
    failed before writing out, where numpy's own float16 matmul and the GPUs raise nothing."""
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    blasx.configure(devices="cpu", tile=16)
    x = np.ones((8, 8), dt)
    x[5, 3] = np.inf
    out = np.full((8, 8), -1, dt)
    with np.errstate(invalid="raise"):
        blasx.matmul(x, np.ones((8, 8), dt), out=out)
    assert np.isinf(out[5].astype(np.float32)).all() and (out[:5].astype(np.float32) == 8).all()
