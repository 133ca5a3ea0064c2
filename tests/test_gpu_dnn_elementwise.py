"""blasx.dnn's activations, softmax, LRN, dropout, add, cat and flatten on CuPy arrays (marker ``gpu``; skipped
where CuPy finds no GPU): the CPU tests' cases against CPU torch in float64, results on the input's device and
of its kind. CuPy has no bfloat16 arrays, so the device types are float64, float32 and float16."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn
from blasx.dnn.geometry import layout
from blasx.runtime.activations import Activation
from dnn_ref import ACTS, TOL, act_fn as _fn, dtype_name as _name, cl, host, rel, wide

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
NGPU = blasx.session._cuda_count()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="no CUDA GPU")]
F = torch.nn.functional

DTYPES = [np.float64, np.float32, np.float16]  # CuPy has no bfloat16 arrays


def rand(shape, dt=np.float64, seed=0, lay="nchw", scale=3.0):
    x = (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dt)
    x[np.isin(x.astype(np.float64), [-3.0, 0.0, 3.0, 6.0])] = 0.5  # off the activations' kinks
    d = cupy.asarray(x)
    return cl(d) if lay == "cl" else d


@pytest.fixture(params=range(min(NGPU, 2)), ids=lambda i: f"gpu{i}")
def gpu(request):
    """Each case on GPU 0 and (where there is one) GPU 1: results must be made on the input's device."""
    with cupy.cuda.Device(request.param):
        yield request.param


def on(y, dev):
    assert isinstance(y, cupy.ndarray) and y.device.id == dev
    return y


@pytest.mark.parametrize("lay", ["nchw", "cl"])
@pytest.mark.parametrize("dt", DTYPES, ids=_name)
@pytest.mark.parametrize("name", list(ACTS))
def test_activations(name, dt, lay, gpu):
    args, table = ACTS[name]
    x = rand((3, 5, 7, 4), dt, lay=lay)
    g = rand((3, 5, 7, 4), dt, seed=1)
    y = on(getattr(dnn, _fn(name))(x, **args), gpu)
    assert y.dtype == np.dtype(dt) and layout(y) == layout(x)
    xt = wide(x, True)
    yt = getattr(F, _fn(name))(xt, **args)
    yt.backward(wide(g))
    tol = TOL[_name(dt)]
    assert rel(y, yt.detach().numpy()) < tol
    saved = y if Activation(table).saves == "output" else x
    dx = on(getattr(dnn, f"{_fn(name)}_backward")(g, saved, **args), gpu)
    tol = max(tol, 1e-7) if name == "hardsigmoid" else tol  # torch's float32 1/6
    assert rel(dx, xt.grad.numpy()) < (4 * tol if Activation(table).saves == "output" else tol)
    if name not in ("gelu", "gelu_tanh", "sigmoid", "tanh"):
        z = x.copy()
        assert getattr(dnn, name)(z, **args, inplace=True) is z
        assert rel(z, y) == 0
    out = cupy.empty_like(x)
    assert getattr(dnn, _fn(name))(x, **args, out=out) is out and rel(out, y) == 0


def test_activations_pass_nan_and_edge_values(gpu):
    x = np.array([-1e30, -7, -6, -3, -1, -0.0, 0, 1, 3, 6, 7, 1e30, np.inf, -np.inf, np.nan])
    for name, (args, _) in ACTS.items():
        y = on(getattr(dnn, _fn(name))(cupy.asarray(x), **args), gpu)
        want = getattr(F, _fn(name))(torch.from_numpy(x), **args).numpy()
        np.testing.assert_allclose(host(y), want, rtol=1e-14, atol=1e-300)


@pytest.mark.parametrize("dt", DTYPES, ids=_name)
@pytest.mark.parametrize("lay", ["nchw", "cl"])
def test_softmax(dt, lay, gpu):
    x = rand((3, 6, 5, 4), dt, lay=lay)
    for name in ("softmax", "log_softmax"):
        for dim in (0, 1, 3, -2):
            y = on(getattr(dnn, name)(x, dim), gpu)
            assert y.dtype == np.dtype(dt) and y.flags.c_contiguous
            xt = wide(x, True)
            yt = getattr(F, name)(xt, dim)
            g = rand(x.shape, dt, seed=dim + 7)
            yt.backward(wide(g))
            assert rel(y, yt.detach().numpy()) < TOL[_name(dt)]
            dx = on(getattr(dnn, f"{name}_backward")(g, y, dim), gpu)
            assert rel(dx, xt.grad.numpy()) < 4 * TOL[_name(dt)]
    y = on(dnn.softmax(rand((4, 9), np.float16), 1, dtype=np.float32), gpu)
    assert y.dtype == np.float32
    e = cupy.asarray(np.array([[1000.0, 999.0, -1000.0], [-np.inf, 0.0, 1.0]]))
    np.testing.assert_allclose(host(dnn.softmax(e, 1)), F.softmax(wide(e), 1).numpy(), rtol=1e-14)


@pytest.mark.parametrize("dt", DTYPES, ids=_name)
@pytest.mark.parametrize("shape, size", [((2, 7, 9), 3), ((2, 6, 5, 4), 4), ((1, 4, 3, 2, 3), 5), ((2, 3, 4, 5), 8)])
@pytest.mark.parametrize("lay", ["nchw", "cl"])
def test_lrn(dt, shape, size, lay, gpu):
    x = rand(shape, dt, lay=lay, scale=2.0)
    y = on(dnn.local_response_norm(x, size, 0.3, 0.75, 2.0), gpu)
    assert y.dtype == np.dtype(dt) and layout(y) == layout(x)
    xt = wide(x, True)
    yt = F.local_response_norm(xt, size, 0.3, 0.75, 2.0)
    g = rand(shape, dt, seed=5)
    yt.backward(wide(g))
    assert rel(y, yt.detach().numpy()) < TOL[_name(dt)]
    dx = on(dnn.local_response_norm_backward(g, x, size, 0.3, 0.75, 2.0), gpu)
    assert rel(dx, xt.grad.numpy()) < 4 * TOL[_name(dt)]


@pytest.mark.parametrize("dt", DTYPES, ids=_name)
def test_dropout(dt, gpu):
    x = rand((4, 8, 16, 16), dt, lay="cl")
    y, mask = dnn.dropout(x, 0.3, seed=7, return_mask=True)
    on(y, gpu), on(mask, gpu)
    assert mask.dtype == bool and layout(y) == "cl" and abs(float(mask.mean()) - 0.7) < 0.02
    xt = wide(x, True)
    yt = xt * torch.from_numpy(host(mask)) / 0.7
    g = rand(x.shape, dt, seed=2)
    yt.backward(wide(g))
    assert rel(y, yt.detach().numpy()) < TOL[_name(dt)]
    assert rel(on(dnn.dropout_backward(g, mask, 0.3), gpu), xt.grad.numpy()) < TOL[_name(dt)]
    y2, mask2 = dnn.dropout(x, 0.3, seed=7, return_mask=True)
    assert bool((mask2 == mask).all()) and rel(y2, y) == 0  # same seed, same mask
    assert dnn.dropout(x, 0.5, training=False) is x
    z = on(dnn.dropout(x, 1.0), gpu)
    assert not bool(z.any())


def test_add_cat_flatten(gpu):
    a, b = rand((2, 3, 4, 5), np.float16, lay="cl"), rand((3, 1, 1), np.float32, seed=1)
    y = on(dnn.add(a, b, alpha=-1.5), gpu)
    assert y.dtype == np.float32 and layout(y) == "cl"
    ta, tb = wide(a, True), wide(b, True)
    ref = torch.add(ta, tb, alpha=-1.5)
    assert rel(y, ref.detach().numpy()) < 3e-6
    g = rand(y.shape, np.float32, seed=2)
    ref.backward(wide(g))
    ga, gb = dnn.add_backward(g, a.shape, b.shape, -1.5, input_dtype=np.float16)
    assert on(ga, gpu).dtype == np.float16 and rel(ga, ta.grad.numpy()) < 2e-3
    assert rel(on(gb, gpu), tb.grad.numpy()) < 3e-6
    assert rel(on(dnn.add(a, 2.5, alpha=2), gpu), host(a).astype(np.float64) + 5) < 2e-3
    c = rand((2, 2, 4, 5), np.float16, seed=3, lay="cl")
    y = on(dnn.cat([a, c], 1), gpu)
    assert layout(y) == "cl"
    np.testing.assert_array_equal(host(y), np.concatenate([host(a), host(c)], 1))
    grads = dnn.cat_backward(y, [3, 2], 1)
    assert rel(grads[1], c) == 0
    f = on(dnn.flatten(a, 1), gpu)
    assert f.shape == (2, 60)
    assert dnn.flatten_backward(f, a.shape).shape == a.shape


def test_numpy_and_cupy_do_not_mix(expect):
    x = cupy.ones((2, 3), np.float32)
    expect(TypeError, "mix of numpy and cupy", call=lambda: dnn.add(x, np.ones((2, 3), np.float32)))
    expect(TypeError, "mix of numpy and cupy", call=lambda: dnn.relu(x, out=np.empty((2, 3), np.float32)))
    expect(TypeError, "mix of numpy and cupy", call=lambda: dnn.cat([x, np.ones((2, 3), np.float32)]))
    expect(TypeError, "mask: got ndarray", call=lambda: dnn.dropout_backward(x, np.ones((2, 3), bool), 0.5))
