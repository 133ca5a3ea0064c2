"""blasx.dnn pooling on CUDA GPUs (marker ``gpu``; skipped where CuPy finds none): the CPU tests' cases on CuPy
arrays -- max, average and adaptive pools over 1-3 spatial dims, forward (values, indices) and backward against
CPU torch in float64 (autograd), seeded sweeps over kernel, stride, padding, dilation, ceil_mode,
count_include_pad and divisor_override, both layouts, float64/float32/float16, NaN/inf/ties, out=, results on
the input's GPU, and mixed numpy/CuPy arguments rejected."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn
from dnn_ref import host, is_cl, rel, wide

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
NGPU = blasx.session._cuda_count()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="no CUDA GPU")]
F = torch.nn.functional

TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 4e-3}
SIZES = {1: (37,), 2: (19, 17), 3: (9, 8, 11)}


def to_cl(a):
    xp = cupy.get_array_module(a)
    return xp.ascontiguousarray(xp.moveaxis(a, 1, -1)).transpose(0, a.ndim - 1, *range(1, a.ndim - 1))


def torch_grad(tf, x, g, *args, **kw):
    xt = wide(x, True)
    y = tf(xt, *args, **kw)
    (y[0] if isinstance(y, tuple) else y).backward(wide(g))
    return xt.grad.numpy()


def device_input(rng, nd, n, c, lay, dtype="float64", unbatched=False):
    x = cupy.asarray(rng.standard_normal((n, c, *SIZES[nd])).astype(dtype))
    if lay == "cl":
        x = to_cl(x)
    return x[0] if unbatched else x


def _sweep(seed, count):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        k = int(rng.integers(1, 5))
        yield rng, dict(nd=int(rng.integers(1, 4)), k=k, stride=[None, 1, 2, 3][rng.integers(4)],
                        pad=int(rng.integers(0, k // 2 + 1)), dil=int(rng.integers(1, 3)), ceil=bool(rng.integers(2)),
                        inc=bool(rng.integers(2)), lay=["nchw", "cl"][rng.integers(2)],
                        unbatched=bool(rng.integers(2)))


@pytest.mark.parametrize("seed", range(4))
def test_max_pool_sweep(seed):
    for rng, p in _sweep(seed, 25):
        nd = p["nd"]
        x = device_input(rng, nd, 2, 3, p["lay"], unbatched=p["unbatched"])
        args = (p["k"], p["stride"], p["pad"], p["dil"], p["ceil"])
        y, idx = getattr(dnn, f"max_pool{nd}d")(x, *args, return_indices=True)
        ref, ref_i = getattr(F, f"max_pool{nd}d")(wide(x), *args, return_indices=True)
        assert isinstance(y, cupy.ndarray) and isinstance(idx, cupy.ndarray)
        np.testing.assert_array_equal(host(y), ref.numpy())
        np.testing.assert_array_equal(host(idx), ref_i.numpy())
        np.testing.assert_array_equal(host(getattr(dnn, f"max_pool{nd}d")(x, *args)), ref.numpy())
        if p["lay"] == "cl" and not p["unbatched"]:
            assert is_cl(y) and is_cl(idx)
        g = cupy.asarray(rng.standard_normal(y.shape))
        dx = getattr(dnn, f"max_pool{nd}d_backward")(g, x.shape, idx, *args)
        assert rel(dx, torch_grad(getattr(F, f"max_pool{nd}d"), x, g, *args)) < 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_avg_pool_sweep(seed):
    for rng, p in _sweep(seed + 10, 25):
        nd = p["nd"]
        x = device_input(rng, nd, 2, 3, p["lay"], unbatched=p["unbatched"])
        div = (None, 3, -2)[rng.integers(3)] if nd > 1 else None
        args = (p["k"], p["stride"], p["pad"], p["ceil"], p["inc"]) + ((div,) if nd > 1 else ())
        y = getattr(dnn, f"avg_pool{nd}d")(x, *args)
        assert rel(y, getattr(F, f"avg_pool{nd}d")(wide(x), *args).numpy()) < 1e-12
        if p["lay"] == "cl" and not p["unbatched"]:
            assert is_cl(y)
        g = cupy.asarray(rng.standard_normal(y.shape))
        dx = getattr(dnn, f"avg_pool{nd}d_backward")(g, x.shape, *args)
        assert rel(dx, torch_grad(getattr(F, f"avg_pool{nd}d"), x, g, *args)) < 1e-12


@pytest.mark.parametrize("reduce", ["avg", "max"])
@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("lay", ["nchw", "cl"])
def test_adaptive(reduce, nd, lay):
    rng = np.random.default_rng(nd)
    x = device_input(rng, nd, 2, 3, lay)
    theirs = getattr(F, f"adaptive_{reduce}_pool{nd}d")
    for size in (1, 5, 13, 40, (None,) * (nd - 1) + (6,) if nd > 1 else 7):
        if reduce == "max":
            y, idx = getattr(dnn, f"adaptive_max_pool{nd}d")(x, size, True)
            ref, ref_i = theirs(wide(x), size, True)
            np.testing.assert_array_equal(host(y), ref.numpy())
            np.testing.assert_array_equal(host(idx), ref_i.numpy())
            g = cupy.asarray(rng.standard_normal(y.shape))
            dx = getattr(dnn, f"adaptive_max_pool{nd}d_backward")(g, x, idx)
        else:
            y = getattr(dnn, f"adaptive_avg_pool{nd}d")(x, size)
            assert rel(y, theirs(wide(x), size).numpy()) < 1e-12
            g = cupy.asarray(rng.standard_normal(y.shape))
            dx = getattr(dnn, f"adaptive_avg_pool{nd}d_backward")(g, x)
        assert rel(dx, torch_grad(theirs, x, g, size)) < 1e-12
        if lay == "cl":
            assert is_cl(dx)


CASES = [("max_pool#d", dict(kernel_size=3, stride=2, padding=1, dilation=1, ceil_mode=True)),
         ("max_pool#d", dict(kernel_size=2, stride=1, padding=1, dilation=2)),
         ("avg_pool#d", dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)),
         ("avg_pool#d", dict(kernel_size=2)),
         ("adaptive_avg_pool#d", dict(output_size=4)),
         ("adaptive_max_pool#d", dict(output_size=1))]


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("lay", ["nchw", "cl"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_dtypes_layouts(dtype, lay, case, nd):
    name, kw = CASES[case]
    ours, theirs = getattr(dnn, name.replace("#", str(nd))), getattr(F, name.replace("#", str(nd)))
    bw = getattr(dnn, name.replace("#", str(nd)) + "_backward")
    rng = np.random.default_rng(case)
    x = device_input(rng, nd, 2, 5, lay, dtype)
    is_max = "max" in name
    res = ours(x, **kw, **({"return_indices": True} if is_max else {}))
    ref = theirs(wide(x), **kw, **({"return_indices": True} if is_max else {}))
    y = res[0] if is_max else res
    assert y.dtype == np.dtype(dtype)
    g = cupy.asarray(rng.standard_normal(y.shape).astype(dtype))
    if is_max:
        np.testing.assert_array_equal(host(y).astype(np.float64), ref[0].numpy())
        np.testing.assert_array_equal(host(res[1]), ref[1].numpy())
        dx = bw(g, x.shape, res[1], **kw) if name.startswith("max") else bw(g, x.shape, res[1])
    else:
        assert rel(y, ref.numpy()) < TOL[dtype]
        dx = bw(g, x.shape, **kw) if name.startswith("avg") else bw(g, x.shape)
    if lay == "cl":
        assert is_cl(y)
    assert dx.dtype == np.dtype(dtype) and dx.shape == x.shape
    assert rel(dx, torch_grad(theirs, x, g, **kw)) < TOL[dtype]


@pytest.mark.parametrize("name, args", [("max_pool#d", (3, 2, 1, 1, True)), ("max_pool#d", (2,)),
                                        ("adaptive_max_pool#d", (4,)), ("adaptive_max_pool#d", (1,))])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_nan_inf_ties(name, args, nd):
    rng = np.random.default_rng(nd)
    x = rng.integers(-2, 3, (2, 3, *SIZES[nd])).astype(np.float64)
    x.flat[rng.choice(x.size, x.size // 6, replace=False)] = np.nan
    x.flat[rng.choice(x.size, x.size // 6, replace=False)] = -np.inf
    x[1] = -np.inf
    ours = getattr(dnn, name.replace("#", str(nd)))
    ref, ref_i = getattr(F, name.replace("#", str(nd)))(wide(x), *args, return_indices=True)
    for xd in (cupy.asarray(x), to_cl(cupy.asarray(x)), cupy.asarray(x, np.float16)):
        y, idx = ours(xd, *args, return_indices=True)
        np.testing.assert_array_equal(host(y).astype(np.float64), ref.numpy())
        np.testing.assert_array_equal(host(idx), ref_i.numpy())


def test_out_and_empty():
    rng = np.random.default_rng(5)
    x = device_input(rng, 2, 2, 3, "cl", "float32")
    ref, ref_i = dnn.max_pool2d(x, 3, 2, 1, return_indices=True)
    o, oi = to_cl(cupy.zeros(ref.shape, np.float32)), cupy.zeros(ref.shape, np.int64)
    r = dnn.max_pool2d(x, 3, 2, 1, return_indices=True, out=(o, oi))
    assert r[0] is o and r[1] is oi
    np.testing.assert_array_equal(host(o), host(ref))
    np.testing.assert_array_equal(host(oi), host(ref_i))
    a = cupy.empty((2, 3, 4, 4), np.float32)
    assert dnn.adaptive_avg_pool2d(x, 4, out=a) is a
    assert rel(a, F.adaptive_avg_pool2d(wide(x), 4).numpy()) < 1e-5
    e = cupy.zeros((0, 3, 8, 8), np.float32)
    y, i = dnn.max_pool2d(e, 2, return_indices=True)
    assert y.shape == (0, 3, 4, 4)
    assert dnn.max_pool2d_backward(y, e.shape, i, 2).shape == e.shape
    assert dnn.avg_pool2d_backward(y, e.shape, 2).shape == e.shape


def test_mixed_arrays_rejected():
    x = cupy.zeros((2, 3, 8, 8), np.float32)
    with pytest.raises(TypeError):
        dnn.max_pool2d(x, 2, out=np.zeros((2, 3, 4, 4), np.float32))
    with pytest.raises(TypeError):
        dnn.max_pool2d_backward(cupy.zeros((2, 3, 4, 4), np.float32), x.shape, np.zeros((2, 3, 4, 4), np.int64), 2)
    with pytest.raises(ValueError, match="indices: values"):
        dnn.max_pool2d_backward(cupy.zeros((2, 3, 4, 4), np.float32), x.shape,
                                cupy.full((2, 3, 4, 4), 64, np.int64), 2)


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
def test_second_device():
    rng = np.random.default_rng(6)
    with cupy.cuda.Device(1):
        x = device_input(rng, 2, 2, 3, "nchw", "float32")
    y, idx = dnn.max_pool2d(x, 3, 2, 1, return_indices=True)
    a = dnn.avg_pool2d(x, 3, 2, 1)
    g = dnn.avg_pool2d_backward(a, x.shape, 3, 2, 1)
    m = dnn.max_pool2d_backward(y, x.shape, idx, 3, 2, 1)
    assert {int(v.device.id) for v in (y, idx, a, g, m)} == {1}
    assert rel(a, F.avg_pool2d(wide(x), 3, 2, 1).numpy()) < 1e-5
    assert rel(m, torch_grad(F.max_pool2d, x, host(y), 3, 2, 1)) < 1e-5
