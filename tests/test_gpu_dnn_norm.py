"""blasx.dnn's normalisation layers on CuPy arrays (marker ``gpu``; skipped where CuPy finds no GPU): the cases
of test_dnn_norm.py -- forward, running-statistic updates, cumulative average, inference, backward, both
layouts, out=, every dtype with torch's mixed-type parameters, a large half reduction with a large mean --
against CPU torch in float64, results on the input's GPU; plus the device checks (a second GPU, mixed
numpy/CuPy arguments)."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn
from dnn_ref import check_norm_stats_cast, host, is_cl, rand, rel, wide

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
NGPU = blasx.session._cuda_count()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="no CUDA GPU")]
F = torch.nn.functional
BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5, np.dtype(np.float16): 4e-3, BF16: 3e-2}
DTYPES = [(np.float64, np.float64), (np.float32, np.float32), (np.float16, np.float16), (np.float16, np.float32),
          (BF16, BF16), (BF16, np.float32)]
IDS = ["f64", "f32", "f16", "f16-f32params", "bf16", "bf16-f32params"]


def dev(x, layout="nchw"):
    """x on the current GPU, C-contiguous or channels-last (bfloat16 only where this CuPy has it)."""
    try:
        xc = cupy.asarray(x)
    except Exception as e:  # CuPy before bfloat16 support
        pytest.skip(f"this CuPy cannot hold {np.dtype(x.dtype).name} arrays ({type(e).__name__})")
    if layout == "nchw" or x.ndim < 3:
        return xc
    return cupy.ascontiguousarray(cupy.moveaxis(xc, 1, -1)).transpose(0, x.ndim - 1, *range(1, x.ndim - 1))


# ---------------------------------------------------------------- batch_norm

@pytest.mark.parametrize("dtype,pdtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("nsp", [0, 1, 2, 3])
def test_batch_norm_training(dtype, pdtype, layout, nsp):
    rng = np.random.default_rng(nsp)
    shape = (6, 5, *(7, 6, 5)[:nsp])
    x, g = rand(rng, shape, dtype, loc=1.5), rand(rng, shape, dtype)
    w, b, rm = rand(rng, (5,), pdtype), rand(rng, (5,), pdtype), rand(rng, (5,), pdtype)
    rv = rng.uniform(0.5, 2, 5).astype(pdtype)
    rmt, rvt = wide(rm), wide(rv)
    xt, wt, bt = wide(x, True), wide(w, True), wide(b, True)
    yt = F.batch_norm(xt, rmt, rvt, wt, bt, True, 0.3)
    yt.backward(wide(g))
    xd, rmd, rvd = dev(x, layout), dev(rm), dev(rv)
    y, m, s = dnn.batch_norm(xd, rmd, rvd, dev(w), dev(b), True, 0.3, return_stats=True)
    tol = TOL[np.dtype(dtype)]
    assert isinstance(y, cupy.ndarray) and y.dtype == np.dtype(dtype) and rel(y, yt) < tol
    assert m.dtype == s.dtype == (np.float64 if np.dtype(dtype) == np.float64 else np.float32)
    if layout == "cl" and nsp:
        assert is_cl(y)
    assert rmd.dtype == np.dtype(pdtype) and rel(rmd, rmt) < tol and rel(rvd, rvt) < tol
    gi, gw, gb = dnn.batch_norm_backward(dev(g, layout), xd, dev(w), m, s, True)
    assert gi.dtype == np.dtype(dtype) and gw.dtype == gb.dtype == np.dtype(pdtype)
    assert rel(gi, xt.grad) < tol and rel(gw, wt.grad) < tol and rel(gb, bt.grad) < tol


@pytest.mark.parametrize("dtype,pdtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_batch_norm_inference_and_backward(dtype, pdtype, layout):
    rng = np.random.default_rng(2)
    x, g = rand(rng, (4, 6, 9, 7), dtype), rand(rng, (4, 6, 9, 7), dtype)
    w, b, rm = rand(rng, (6,), pdtype), rand(rng, (6,), pdtype), rand(rng, (6,), pdtype)
    rv = rng.uniform(0.5, 2, 6).astype(pdtype)
    xt, wt, bt = wide(x, True), wide(w, True), wide(b, True)
    yt = F.batch_norm(xt, wide(rm), wide(rv), wt, bt, False, eps=1e-3)
    yt.backward(wide(g))
    xd, rmd, rvd = dev(x, layout), dev(rm), dev(rv)
    y, m, s = dnn.batch_norm(xd, rmd, rvd, dev(w), dev(b), eps=1e-3, return_stats=True)
    tol = TOL[np.dtype(dtype)]
    assert rel(y, yt) < tol and np.array_equal(host(rmd), rm) and np.array_equal(host(rvd), rv)
    for kw in (dict(running_mean=rmd, running_var=rvd), {}):
        gi, gw, gb = dnn.batch_norm_backward(dev(g, layout), xd, dev(w), m, s, False, 1e-3, **kw)
        assert rel(gi, xt.grad) < tol and rel(gw, wt.grad) < tol and rel(gb, bt.grad) < tol


def test_batch_norm_cumulative_average():
    rng = np.random.default_rng(7)
    mod = torch.nn.BatchNorm2d(3, momentum=None, dtype=torch.float64)
    rm, rv, nbt = cupy.zeros(3), cupy.ones(3), cupy.zeros((1,), cupy.int64)
    for step in range(3):
        x = rand(rng, (4, 3, 5, 2), loc=step)
        mod(wide(x))
        dnn.batch_norm(dev(x), rm, rv, training=True, momentum=None, num_batches_tracked=nbt)
        assert int(nbt[0]) == step + 1
        assert rel(rm, mod.running_mean) < 1e-12 and rel(rv, mod.running_var) < 1e-12


def test_batch_norm_no_affine_no_running():
    rng = np.random.default_rng(8)
    x, g = rand(rng, (5, 4, 6)), rand(rng, (5, 4, 6))
    xt = wide(x, True)
    F.batch_norm(xt, None, None, training=True).backward(wide(g))
    y, m, s = dnn.batch_norm(dev(x), None, None, training=True, return_stats=True)
    gi, gw, gb = dnn.batch_norm_backward(dev(g), dev(x), None, m, s)
    assert rel(y, F.batch_norm(wide(x), None, None, training=True)) < 1e-12 and rel(gi, xt.grad) < 1e-12
    assert gw is None and rel(gb, g.sum(axis=(0, 2))) < 1e-12


# ---------------------------------------------------------------- layer_norm, group_norm

@pytest.mark.parametrize("dtype,pdtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("lead,norm", [((), (37,)), ((6,), (33,)), ((3, 4), (5, 7)), ((2,), (3, 4, 5))])
def test_layer_norm(dtype, pdtype, lead, norm):
    rng = np.random.default_rng(len(lead) + len(norm))
    x, g = rand(rng, lead + norm, dtype, loc=-2.0), rand(rng, lead + norm, dtype)
    w, b = rand(rng, norm, pdtype), rand(rng, norm, pdtype)
    xt, wt, bt = wide(x, True), wide(w, True), wide(b, True)
    yt = F.layer_norm(xt, norm, wt, bt)
    yt.backward(wide(g))
    xd = dev(x)
    y, m, s = dnn.layer_norm(xd, norm, dev(w), dev(b), return_stats=True)
    tol = TOL[np.dtype(dtype)]
    assert y.dtype == np.dtype(dtype) and y.flags.c_contiguous and rel(y, yt) < tol
    assert m.shape == lead + (1,) * len(norm)
    gi, gw, gb = dnn.layer_norm_backward(dev(g), xd, norm, dev(w), m, s)
    assert gw.dtype == gb.dtype == np.dtype(pdtype)
    assert rel(gi, xt.grad) < tol and rel(gw, wt.grad) < tol and rel(gb, bt.grad) < tol


def test_layer_norm_channels_last_input():
    rng = np.random.default_rng(4)
    x = rand(rng, (2, 6, 5, 4))
    y = dnn.layer_norm(dev(x, "cl"), (5, 4))
    assert y.flags.c_contiguous and rel(y, F.layer_norm(wide(x), (5, 4))) < 1e-12


@pytest.mark.parametrize("dtype,pdtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("nsp,groups", [(0, 2), (1, 3), (2, 1), (2, 4), (2, 12), (3, 2)])
def test_group_norm(dtype, pdtype, layout, nsp, groups):
    rng = np.random.default_rng(nsp + groups)
    shape = (3, 12, *(9, 7, 5)[:nsp])
    x, g = rand(rng, shape, dtype, loc=3.0), rand(rng, shape, dtype)
    w, b = rand(rng, (12,), pdtype), rand(rng, (12,), pdtype)
    xt, wt, bt = wide(x, True), wide(w, True), wide(b, True)
    yt = F.group_norm(xt, groups, wt, bt)
    yt.backward(wide(g))
    xd = dev(x, layout)
    y, m, s = dnn.group_norm(xd, groups, dev(w), dev(b), return_stats=True)
    tol = TOL[np.dtype(dtype)]
    assert y.dtype == np.dtype(dtype) and rel(y, yt) < tol and m.shape == (3, groups)
    if layout == "cl" and nsp:
        assert is_cl(y)
    gi, gw, gb = dnn.group_norm_backward(dev(g, layout), xd, groups, dev(w), m, s)
    assert rel(gi, xt.grad) < tol and rel(gw, wt.grad) < tol and rel(gb, bt.grad) < tol


# ---------------------------------------------------------------- numerics, devices, out=

@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["f16", "bf16"])
def test_half_statistics_two_pass(dtype):
    rng = np.random.default_rng(5)
    x = (200.0 + rng.standard_normal((128, 4, 96, 96))).astype(dtype)
    rm, rv = cupy.zeros(4, cupy.float32), cupy.ones(4, cupy.float32)
    y, mean, invstd = dnn.batch_norm(dev(x), rm, rv, training=True, momentum=1.0, return_stats=True)
    xw = np.asarray(x, np.float64)
    var = xw.var(axis=(0, 2, 3))
    assert np.allclose(host(mean), xw.mean(axis=(0, 2, 3)), rtol=1e-6)
    assert np.allclose(1 / host(invstd) ** 2, var + 1e-5, rtol=1e-4)
    assert np.allclose(host(rv), xw.var(axis=(0, 2, 3), ddof=1), rtol=1e-4)


def test_out_and_other_device():
    rng = np.random.default_rng(6)
    x = rand(rng, (2, 6, 5, 4))
    for fn, kw in ((dnn.batch_norm, dict(running_mean=None, running_var=None, training=True)),
                   (dnn.group_norm, dict(num_groups=3)), (dnn.layer_norm, dict(normalized_shape=(5, 4)))):
        ref = fn(x, **kw)
        out = cupy.empty(x.shape)
        assert fn(dev(x, "cl"), **kw, out=out) is out and rel(out, ref) < 1e-12
    if NGPU < 2:
        return
    with cupy.cuda.Device(1):
        xd, w1 = dev(x), cupy.ones(6)
    y = dnn.group_norm(xd, 3, w1)
    assert y.device.id == 1 and rel(y, dnn.group_norm(x, 3)) < 1e-12
    with pytest.raises(ValueError, match="weight: is on GPU 0 but input is on GPU 1"):
        dnn.group_norm(xd, 3, cupy.ones(6))


def test_mixed_numpy_cupy_rejected():
    x = np.random.default_rng(0).standard_normal((2, 4, 3))
    with pytest.raises(TypeError, match="mix of numpy and cupy"):
        dnn.batch_norm(x, cupy.zeros(4), cupy.ones(4))
    with pytest.raises(TypeError, match="mix of numpy and cupy"):
        dnn.layer_norm(dev(x), 3, np.ones(3))
    with pytest.raises(TypeError, match="mix of numpy and cupy"):
        dnn.group_norm(dev(x), 2, out=np.empty_like(x))


def test_backward_takes_statistics_of_another_float_type():
    check_norm_stats_cast(dev)