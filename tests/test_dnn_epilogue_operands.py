"""The fused epilogue's operands against torch and the out= rules: a scale with a residual is not folded into the
weights in any type, vectors overlapping out are refused, an Activation object is checked like a name, out= of
any ndarray kind and never self-overlapping, float16 overflows counted on the results alone."""

from __future__ import annotations

import ctypes
import warnings

import numpy as np
import pytest

import blasx
import blasx.dnn as dnn
from blasx.precision import Float16OverflowWarning
from blasx.runtime.activations import Activation, parse_activation

torch = pytest.importorskip("torch")
F = torch.nn.functional


def T(a):
    return torch.from_numpy(np.ascontiguousarray(a))


@pytest.mark.parametrize("devices", ["cpu", "sim:2"])
def test_a_scale_with_a_residual_is_applied_to_the_conv_not_to_the_weights(devices):
    """inf scale over a zero weight (inf * 0 = NaN if folded), float32 overflow of w * scale (1e10 * 1e30), and
    bfloat16 weights whose products cancel (w * 1.1 rounded to 8 bits: 9% off): each as without the residual."""
    blasx.configure(devices=devices, tile=16)
    x, w = np.ones((1, 2, 3), np.float32), np.array([[[1.0], [0.0]]], np.float32)
    y = dnn.conv1d(x, w, scale=np.array([np.inf]), residual=np.zeros((1, 1, 3), np.float32))
    assert np.array_equal(y, np.full((1, 1, 3), np.inf, np.float32))
    x, w = np.full((1, 1, 3), 1e-10, np.float32), np.full((1, 1, 1), 1e10, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = dnn.conv1d(x, w, scale=np.array([1e30]), residual=np.zeros((1, 1, 3), np.float32))
    assert np.allclose(y, 1e30, rtol=1e-6)
    ml = pytest.importorskip("ml_dtypes")
    bf = np.dtype(ml.bfloat16)
    w = np.array([[[1.0], [-0.9921875], [0.0078125]]]).astype(bf)  # cancelling products
    x = np.ones((1, 3, 2)).astype(bf)
    plain = dnn.conv1d(x, w, scale=np.array([1.1])).astype(np.float64)
    with_res = dnn.conv1d(x, w, scale=np.array([1.1]), residual=np.zeros((1, 1, 2), bf)).astype(np.float64)
    assert np.array_equal(plain, with_res)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_scale_with_a_residual_matches_torch_in_wide_types(dtype):
    blasx.configure(devices="sim:2", tile=16)
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((2, 3, 7, 7)).astype(dtype), rng.standard_normal((4, 3, 3, 3)).astype(dtype)
    r, sc, sh = rng.standard_normal((2, 4, 7, 7)).astype(dtype), rng.random(4) + 0.5, rng.standard_normal(4)
    ref = F.relu(F.conv2d(T(x).double(), T(w).double(), padding=1) * T(sc)[:, None, None] + T(sh)[:, None, None]
                 + T(r).double()).numpy()
    y = dnn.conv2d(x, w, padding=1, scale=sc, shift=sh, residual=r, activation="relu")
    assert y.dtype == dtype
    tol = 1e-12 if dtype == np.float64 else 1e-5
    assert np.linalg.norm(y - ref) <= tol * np.linalg.norm(ref)


@pytest.mark.parametrize("devices", ["cpu", "sim:2"])
@pytest.mark.parametrize("vector", ["bias", "scale", "shift"])
def test_a_vector_overlapping_out_is_refused_and_out_untouched(devices, vector):
    blasx.configure(devices=devices, tile=16)
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((1, 2, 6, 6)), rng.standard_normal((4, 2, 3, 3))
    out = np.full((1, 4, 4, 4), 7.0)
    with pytest.raises(ValueError, match="out: overlaps an input array"):
        dnn.conv2d(x, w, out=out, **{vector: out.reshape(-1)[:4]})
    assert (out == 7.0).all()
    tout = np.full((1, 4, 13, 13), 7.0)
    with pytest.raises(ValueError, match="out: overlaps an input array"):
        dnn.conv_transpose2d(x, w.transpose(1, 0, 2, 3).copy(), tout.reshape(-1)[:4], stride=2, out=tout)
    assert (tout == 7.0).all()


def test_an_activation_object_is_checked_as_a_name_is():
    assert parse_activation(Activation("leaky_relu")) == Activation("leaky_relu", 0.01)
    assert parse_activation(Activation("elu")) == Activation("elu", 1.0)
    with pytest.raises(ValueError, match="activation: .*unknown name 'swish'"):
        parse_activation(Activation("swish"))
    with pytest.raises(ValueError, match="activation: .*relu takes no parameter"):
        parse_activation(Activation("relu", 2.0))
    with pytest.raises(ValueError, match="activation: .*negative_slope must be a finite real number"):
        parse_activation(("leaky_relu", 10 ** 400))
    with pytest.raises(ValueError, match="gelu's approximate is 'none' or 'tanh'"):
        parse_activation({"name": "gelu", "approximate": 3})


@pytest.mark.parametrize("devices", ["cpu", "sim:2"])
def test_an_unknown_activation_object_writes_nothing(devices):
    blasx.configure(devices=devices, tile=16)
    x, w, out = np.ones((1, 2, 9, 9)), np.ones((3, 2, 3, 3)), np.full((1, 3, 7, 7), 5.0)
    with pytest.raises(ValueError, match="activation"):
        dnn.conv2d(x, w, activation=Activation("swish"), out=out)
    assert (out == 5.0).all()
    y = dnn.conv2d(-x, w, activation=Activation("leaky_relu"))
    assert np.allclose(y, F.leaky_relu(F.conv2d(T(-x), T(w))).numpy())


def test_linear_without_outputs_checks_its_other_arguments():
    x, w = np.ones((2, 5)), np.ones((0, 5))
    assert dnn.linear(x, w).shape == (2, 0)
    with pytest.raises(ValueError, match="bias"):
        dnn.linear(x, w, np.ones(3))
    with pytest.raises(ValueError, match="activation"):
        dnn.linear(x, w, activation="swish")
    with pytest.raises(ValueError, match="math"):
        dnn.linear(x, w, math="fast")


def test_memmap_operands_and_outputs_are_host_arrays(tmp_path):
    blasx.configure(devices="sim:2", tile=16)
    rng = np.random.default_rng(5)
    x = np.memmap(tmp_path / "x.dat", dtype=np.float64, mode="w+", shape=(1, 2, 6, 6))
    x[...] = rng.standard_normal(x.shape)
    w = rng.standard_normal((3, 2, 3, 3))
    ref = F.conv2d(T(np.asarray(x)), T(w)).numpy()
    out = np.empty((1, 3, 4, 4))
    assert dnn.conv2d(x, w, out=out) is out and np.allclose(out, ref)
    mout = np.memmap(tmp_path / "o.dat", dtype=np.float64, mode="w+", shape=(1, 3, 4, 4))
    dnn.conv2d(np.asarray(x).copy(), w, out=mout, residual=np.zeros((1, 3, 4, 4)))
    assert np.allclose(mout, ref)


def test_a_self_overlapping_out_is_refused():
    x, w = np.ones((2, 9, 9)), np.ones((4, 2, 3, 3))
    out = np.lib.stride_tricks.as_strided(np.zeros(7 * 7 + 4), (4, 7, 7), (8, 56, 8), writeable=True)
    with pytest.raises(ValueError, match="out: more than one of its elements refers to a single memory location"):
        dnn.conv2d(x, w, out=out)
    # interleaved strides whose elements are all distinct (offsets 0, 24, 16, 40, 32, 56 bytes): taken
    x1 = np.random.default_rng(0).standard_normal((1, 3, 2))
    out = np.lib.stride_tricks.as_strided(np.zeros(16), (1, 3, 2), (8, 16, 24), writeable=True)
    dnn.conv2d(x1, np.full((1, 1, 1, 1), 2.0), out=out)
    assert np.array_equal(out, 2 * x1)


@pytest.mark.parametrize("devices", ["cpu", "sim:2"])
def test_float16_overflow_is_counted_on_the_results_and_warned_as_blasxs(devices):
    blasx.configure(devices=devices, tile=16)
    x, w = np.full((1, 1, 4), 400, np.float16), np.full((1, 1, 1), 200, np.float16)
    for kw in ({}, {"residual": np.full((1, 1, 4), 10, np.float16)},
               {"scale": np.full(1, 0.5), "residual": np.full((1, 1, 4), 30000, np.float16)}):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            y = dnn.conv1d(x, w, **kw)
        assert np.isinf(y).all()
        assert [type(m.message) for m in got] == [Float16OverflowWarning], kw
        assert "4 of 4 result values" in str(got[0].message)


def test_bias_overlap_through_a_foreign_alias_is_seen():
    """A bias whose base chain never reaches out (ctypes over out's memory) is found by memory, not by base."""
    blasx.configure(devices="cpu")
    out = np.zeros((1, 4, 4, 4))
    alias = np.ctypeslib.as_array((ctypes.c_double * 4).from_address(out.ctypes.data))
    with pytest.raises(ValueError, match="out: overlaps"):
        dnn.conv2d(np.ones((1, 2, 6, 6)), np.ones((4, 2, 3, 3)), alias, out=out)


@pytest.mark.parametrize("devices", ["cpu", "sim:2"])
def test_float16_two_pass_overflow_is_judged_on_the_result(devices):
    """scale with residual runs in two passes: an intermediate beyond float16 that the activation brings back
    (tanh) is no overflow; under errstate "raise" out is written whole before the error; one warning a call."""
    blasx.configure(devices=devices, tile=16)
    x = np.ones((1, 1, 4, 4), np.float16)
    x[0, 0, 0, 0] = 60000
    w, s, sh = np.ones((2, 1, 1, 1), np.float16), np.array([2.0, 1.0]), np.zeros(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = dnn.conv2d(x, w, scale=s, shift=sh, residual=np.full((1, 2, 4, 4), 0.5, np.float16), activation="tanh")
        with np.errstate(over="raise"):
            dnn.conv2d(x, w, scale=s, shift=sh, residual=np.full((1, 2, 4, 4), 0.5, np.float16), activation="tanh")
    assert np.isfinite(y).all()
    out = np.zeros((1, 2, 4, 4), np.float16)
    with np.errstate(over="raise"), pytest.raises(FloatingPointError, match="float16 overflow: 1 of 32"):
        dnn.conv2d(x, w, scale=s, shift=sh, residual=np.full((1, 2, 4, 4), 5.0, np.float16), out=out,
                   activation="relu")
    assert out[0, 0, 0, 0] == np.inf and out[0, 0, 0, 1] == 7 and out[0, 1, 0, 0] == 60000 + 5
    x[0, 0, 0, 0] = 40000
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        dnn.conv2d(x, w, scale=s, shift=sh, residual=np.full((1, 2, 4, 4), 40000, np.float16))
    assert [str(m.message)[:39] for m in got] == ["float16 overflow: 2 of 32 result values"]
