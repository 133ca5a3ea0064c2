"""blasx.dnn pooling on the host against CPU torch: max, average and adaptive pools over 1-3 spatial dims,
forward (values, indices) and backward (against torch.autograd), swept over kernel, stride, padding, dilation,
ceil_mode, count_include_pad, divisor_override and output sizes; both layouts, unbatched and empty batches,
every dtype, NaN/inf/ties, out=, and every validation error.

Errors are relative Frobenius norms against torch in float64 on the same (rounded) inputs; tolerances per
dtype: float64 1e-12, float32 1e-5, float16 4e-3, bfloat16 3e-2. Max pools' values and indices are exact."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from blasx import dnn
from dnn_ref import cl, is_cl, rel, wide

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16), BF16]
TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5, np.dtype(np.float16): 4e-3, BF16: 3e-2}
SIZES = {1: (11,), 2: (9, 8), 3: (6, 5, 7)}


def fn(name, nd):
    return getattr(dnn, name.replace("#", str(nd))), getattr(F, name.replace("#", str(nd)))


def torch_grad(tf, x, g, *args, **kw):
    """x's gradient of tf(x, ...) for the output gradient g (float64)."""
    xt = wide(x, True)
    y = tf(xt, *args, **kw)
    (y[0] if isinstance(y, tuple) else y).backward(wide(g))
    return xt.grad.numpy()


def prepare(rng, nd, n, c, lay, unbatched, dtype=np.float64):
    x = rng.standard_normal((n, c, *SIZES[nd])).astype(dtype)
    if lay == "cl":
        x = cl(x)
    return (x[0], x[0]) if unbatched else (x, x)


# ---------------------------------------------------------------- sweeps against torch

@settings(max_examples=150, deadline=None)
@given(nd=st.sampled_from([1, 2, 3]), n=st.integers(1, 2), c=st.integers(1, 3), k=st.integers(1, 4),
       stride=st.sampled_from([None, 1, 2, 3]), pad=st.integers(0, 2), dil=st.integers(1, 3), ceil=st.booleans(),
       lay=st.sampled_from(["nchw", "cl"]), unbatched=st.booleans(), seed=st.integers(0, 99))
def test_max_pool_vs_torch(nd, n, c, k, stride, pad, dil, ceil, lay, unbatched, seed):
    rng = np.random.default_rng(seed)
    x, _ = prepare(rng, nd, n, c, lay, unbatched)
    ours, theirs = fn("max_pool#d", nd)
    args = (k, stride, pad, dil, ceil)
    try:
        ref, ref_i = theirs(wide(x), *args, return_indices=True)
    except RuntimeError:
        with pytest.raises(ValueError):
            ours(x, *args, return_indices=True)
        return
    y, idx = ours(x, *args, return_indices=True)
    np.testing.assert_array_equal(y, ref.numpy())
    np.testing.assert_array_equal(idx, ref_i.numpy())
    assert idx.dtype == np.int64
    np.testing.assert_array_equal(ours(x, *args), y)
    if lay == "cl" and not unbatched and x.shape[1] > 1:
        assert is_cl(y) and is_cl(idx)
    g = rng.standard_normal(y.shape)
    dx = getattr(dnn, f"max_pool{nd}d_backward")(g, x.shape, idx, *args)
    assert rel(dx, torch_grad(theirs, x, g, *args)) < 1e-12


@settings(max_examples=150, deadline=None)
@given(nd=st.sampled_from([1, 2, 3]), n=st.integers(1, 2), c=st.integers(1, 3), k=st.integers(1, 4),
       stride=st.sampled_from([None, 1, 2, 3]), pad=st.integers(0, 2), ceil=st.booleans(), inc=st.booleans(),
       div=st.sampled_from([None, None, 1, 3, -2]), lay=st.sampled_from(["nchw", "cl"]), unbatched=st.booleans(),
       seed=st.integers(0, 99))
def test_avg_pool_vs_torch(nd, n, c, k, stride, pad, ceil, inc, div, lay, unbatched, seed):
    rng = np.random.default_rng(seed)
    x, _ = prepare(rng, nd, n, c, lay, unbatched)
    ours, theirs = fn("avg_pool#d", nd)
    args = (k, stride, pad, ceil, inc) + ((div,) if nd > 1 else ())
    try:
        ref = theirs(wide(x), *args)
    except RuntimeError:
        with pytest.raises(ValueError):
            ours(x, *args)
        return
    y = ours(x, *args)
    assert rel(y, ref.numpy()) < 1e-12
    if lay == "cl" and not unbatched and x.shape[1] > 1:
        assert is_cl(y)
    g = rng.standard_normal(y.shape)
    dx = getattr(dnn, f"avg_pool{nd}d_backward")(g, x.shape, *args)
    assert rel(dx, torch_grad(theirs, x, g, *args)) < 1e-12


@settings(max_examples=120, deadline=None)
@given(nd=st.sampled_from([1, 2, 3]), reduce=st.sampled_from(["avg", "max"]), n=st.integers(1, 2),
       c=st.integers(1, 3), data=st.data(), lay=st.sampled_from(["nchw", "cl"]), unbatched=st.booleans(),
       seed=st.integers(0, 99))
def test_adaptive_vs_torch(nd, reduce, n, c, data, lay, unbatched, seed):
    rng = np.random.default_rng(seed)
    x, _ = prepare(rng, nd, n, c, lay, unbatched)
    maybe = st.one_of(st.none(), st.integers(1, 13)) if nd > 1 else st.integers(1, 13)  # (torch's 1-d: no None)
    size = data.draw(st.one_of(st.integers(1, 13), st.tuples(*[maybe] * nd)))
    ours, theirs = fn(f"adaptive_{reduce}_pool#d", nd)
    name = f"adaptive_{reduce}_pool{nd}d_backward"
    g_of = lambda y: rng.standard_normal(y.shape)  # noqa: E731
    if reduce == "max":
        y, idx = ours(x, size, True)
        ref, ref_i = theirs(wide(x), size, True)
        np.testing.assert_array_equal(y, ref.numpy())
        np.testing.assert_array_equal(idx, ref_i.numpy())
        g = g_of(y)
        dx = getattr(dnn, name)(g, x, idx)
    else:
        y = ours(x, size)
        assert rel(y, theirs(wide(x), size).numpy()) < 1e-12
        g = g_of(y)
        dx = getattr(dnn, name)(g, x)
    assert rel(dx, torch_grad(theirs, x, g, size)) < 1e-12
    if lay == "cl" and not unbatched and x.shape[1] > 1:
        assert is_cl(y) and is_cl(dx)


# ---------------------------------------------------------------- dtypes

CASES = [("max_pool#d", dict(kernel_size=3, stride=2, padding=1, dilation=1, ceil_mode=True)),
         ("max_pool#d", dict(kernel_size=2, stride=1, padding=1, dilation=2)),
         ("avg_pool#d", dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)),
         ("avg_pool#d", dict(kernel_size=2, stride=1)),
         ("adaptive_avg_pool#d", dict(output_size=4)),
         ("adaptive_max_pool#d", dict(output_size=4)),
         ("max_pool#d", dict(kernel_size=2)),  # windows tiling the input (the host's block path)
         ("avg_pool#d", dict(kernel_size=2)),
         ("adaptive_avg_pool#d", dict(output_size=1)),
         ("adaptive_max_pool#d", dict(output_size=1))]


def _backward(name, nd, g, x, idx, kw):
    bw = getattr(dnn, name.replace("#", str(nd)) + "_backward")
    if name.startswith("adaptive_avg"):
        return bw(g, x.shape)
    if name.startswith("adaptive_max"):
        return bw(g, x.shape, idx)
    if name.startswith("max"):
        return bw(g, x.shape, idx, **kw)
    return bw(g, x.shape, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lay", ["nchw", "cl"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_dtypes_layouts(dtype, lay, case, nd):
    name, kw = CASES[case]
    rng = np.random.default_rng(case)
    x, _ = prepare(rng, nd, 2, 3, lay, False, dtype)
    ours, theirs = fn(name, nd)
    is_max = "max" in name
    res = ours(x, **kw, **({"return_indices": True} if is_max else {}))
    ref = theirs(wide(x), **kw, **({"return_indices": True} if is_max else {}))
    y, idx = res if is_max else (res, None)
    assert y.dtype == dtype
    if is_max:
        np.testing.assert_array_equal(np.asarray(y, np.float64), ref[0].numpy())
        np.testing.assert_array_equal(idx, ref[1].numpy())
        ref = ref[0]
    else:
        assert rel(y, ref.detach().numpy()) < TOL[dtype]
    if lay == "cl":
        assert is_cl(y)
    g = rng.standard_normal(y.shape).astype(dtype)
    dx = _backward(name, nd, g, x, idx, kw)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert rel(dx, torch_grad(theirs, x, g, **kw)) < TOL[dtype]


# ---------------------------------------------------------------- NaN, inf, ties, edges

@pytest.mark.parametrize("name, args", [("max_pool#d", (3, 2, 1, 1, True)), ("max_pool#d", (2,)),
                                        ("adaptive_max_pool#d", (4,)), ("adaptive_max_pool#d", (1,))])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_nan_inf_ties(name, args, nd):
    rng = np.random.default_rng(nd)
    x = rng.integers(-2, 3, (2, 3, *SIZES[nd])).astype(np.float64)  # many ties
    x.flat[rng.choice(x.size, x.size // 6, replace=False)] = np.nan
    x.flat[rng.choice(x.size, x.size // 6, replace=False)] = -np.inf
    x[1] = -np.inf  # whole windows of -inf
    ours, theirs = fn(name, nd)
    y, idx = ours(x, *args, return_indices=True)
    ref, ref_i = theirs(wide(x), *args, return_indices=True)
    np.testing.assert_array_equal(y, ref.numpy())
    np.testing.assert_array_equal(idx, ref_i.numpy())
    np.testing.assert_array_equal(ours(cl(x), *args, return_indices=True)[1], ref_i.numpy())


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("lay", ["nchw", "cl"])
def test_windows_over_padding_alone(nd, lay):
    """Dilation with ceil_mode can leave windows no input position (a 1-wide dim, kernel 2, dilation 2,
    padding 1): forward gives torch's -inf and index (past the plane); backward drops their gradient (torch's
    CPU kernel writes it past the plane, into the next one: compared with that gradient zeroed)."""
    from blasx.dnn.pool_geometry import empty_windows, window
    k, s, p, d = 2, 1, 1, 2
    size = (1, 4, 3)[:nd]
    empty = empty_windows(window("max_pool", nd, size, "max", k, s, p, d, True))
    assert empty is not None and empty.all()
    x = np.random.default_rng(nd).standard_normal((2, 3, *size))
    xt = torch.from_numpy(x).requires_grad_()
    y, i = getattr(F, f"max_pool{nd}d")(xt, k, s, p, d, True, return_indices=True)
    xin = cl(x) if lay == "cl" else x
    yb, ib = getattr(dnn, f"max_pool{nd}d")(xin, k, s, p, d, True, return_indices=True)
    assert np.array_equal(yb, y.detach().numpy()) and np.array_equal(ib, i.numpy()) and np.isinf(yb).all()
    g = np.random.default_rng(9).standard_normal(y.shape)
    y.backward(torch.from_numpy(np.where(empty, 0.0, g)))
    gin = cl(g) if lay == "cl" else g
    gb = getattr(dnn, f"max_pool{nd}d_backward")(gin, xin, ib, k, s, p, d, True)
    assert np.array_equal(gb, xt.grad.numpy()) and not gb.any()
    assert empty_windows(window("max_pool", nd, (5,) * nd, "max", k, s, p, d, True)) is None
    g[0, 0], g[1, 2] = np.inf, np.nan  # dropped too (inf * 0 put NaN at position 0)
    gin = cl(g) if lay == "cl" else g
    assert not getattr(dnn, f"max_pool{nd}d_backward")(gin, xin, ib, k, s, p, d, True).any()


def test_nan_last_wins_and_inf_average():
    x = np.array([[[1.0, np.nan, 3.0, np.nan, 2.0]]])
    y, i = dnn.max_pool1d(x, 5, return_indices=True)
    assert np.isnan(y[0, 0, 0]) and i[0, 0, 0] == 3
    z = np.array([[[1.0, np.inf, 2.0, 3.0, -np.inf, 4.0]]])
    np.testing.assert_array_equal(dnn.avg_pool1d(z, 2), F.avg_pool1d(wide(z), 2).numpy())


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_empty_batch(nd):
    x = np.zeros((0, 3, *SIZES[nd]))
    y, idx = getattr(dnn, f"max_pool{nd}d")(x, 2, return_indices=True)
    assert y.shape == idx.shape == tuple(F.max_pool2d(torch.zeros(0, 3, 8, 8), 2).shape[:2]) + y.shape[2:]
    assert getattr(dnn, f"max_pool{nd}d_backward")(y, x.shape, idx, 2).shape == x.shape
    assert getattr(dnn, f"avg_pool{nd}d_backward")(y, x.shape, 2).shape == x.shape
    assert getattr(dnn, f"adaptive_avg_pool{nd}d")(x, 2).shape == (0, 3, *(2,) * nd)


def test_adaptive_empty_output_and_none():
    x = np.random.default_rng(0).standard_normal((2, 3, 7, 6))
    assert dnn.adaptive_avg_pool2d(x, (0, 3)).shape == (2, 3, 0, 3)
    y, i = dnn.adaptive_max_pool2d(x, 0, True)
    assert y.shape == i.shape == (2, 3, 0, 0)
    np.testing.assert_array_equal(dnn.adaptive_avg_pool2d_backward(y, x.shape), np.zeros_like(x))
    np.testing.assert_array_equal(dnn.adaptive_max_pool2d(x, (None, 2)), F.adaptive_max_pool2d(wide(x), (None, 2)))


def test_other_strides_copied_and_inputs_untouched():
    rng = np.random.default_rng(1)
    base = rng.standard_normal((4, 8, 10, 12))
    x = base[:, ::2, 1:, ::-1]  # neither layout
    keep = x.copy()
    y = dnn.avg_pool2d(x, 3, 1, 1)
    assert y.flags.c_contiguous
    assert rel(y, F.avg_pool2d(wide(x), 3, 1, 1).numpy()) < 1e-12
    np.testing.assert_array_equal(x, keep)


# ---------------------------------------------------------------- out=

@pytest.mark.parametrize("lay", ["nchw", "cl"])
def test_out(lay):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 9, 8)).astype(np.float32)
    x = cl(x) if lay == "cl" else x
    ref, ref_i = dnn.max_pool2d(x, 3, 2, 1, return_indices=True)
    for form in ("nchw", "cl"):
        o = np.full(ref.shape, 7, np.float32)
        o = cl(o) if form == "cl" else o
        oi = np.zeros(ref.shape, np.int64)
        assert dnn.max_pool2d(x, 3, 2, 1, out=o) is o
        np.testing.assert_array_equal(o, ref)
        r = dnn.max_pool2d(x, 3, 2, 1, return_indices=True, out=(o * 0, oi))
        assert r[1] is oi
        np.testing.assert_array_equal(oi, ref_i)
        a = np.empty((2, 3, 4, 4), np.float32)
        assert dnn.adaptive_avg_pool2d(x, (4, 4), out=a) is a
        np.testing.assert_array_equal(a, dnn.adaptive_avg_pool2d(x, 4))
    u = np.empty(ref.shape[1:], np.float32)
    assert dnn.avg_pool2d(x[0], 3, 2, 1, out=u) is u
    np.testing.assert_array_equal(u, dnn.avg_pool2d(x, 3, 2, 1)[0])


# ---------------------------------------------------------------- validation

X2 = np.zeros((2, 3, 8, 8), np.float32)
G2 = np.zeros((2, 3, 4, 4), np.float32)
I2 = np.zeros((2, 3, 4, 4), np.int64)

ERRORS = [
    (lambda: dnn.max_pool2d(X2[0, 0, 0], 2), ValueError, "4-D"),
    (lambda: dnn.max_pool2d(np.zeros((2, 0, 8, 8)), 2), ValueError, "non-empty"),
    (lambda: dnn.max_pool2d(np.zeros((2, 3, 0, 8)), 2), ValueError, "non-empty"),
    (lambda: dnn.max_pool2d(X2.astype(np.int32), 2), TypeError, "int32"),
    (lambda: dnn.max_pool2d([[1.0]], 2), TypeError, "array"),
    (lambda: dnn.max_pool2d(X2, 0), ValueError, "kernel_size: got 0; each value must be positive"),
    (lambda: dnn.max_pool2d(X2, (2, 2, 2)), ValueError,
     r"kernel_size: got \(2, 2, 2\), expected an int or a tuple of 1 or 2 ints"),
    (lambda: dnn.max_pool2d(X2, 2.0), ValueError, "kernel_size"),
    (lambda: dnn.max_pool1d(X2[0], (2, 2)), ValueError, r"kernel_size: got \(2, 2\), expected an int or a tuple of 1 int"),
    (lambda: dnn.max_pool2d(X2, 2, 0), ValueError, "stride: got 0; each value must be positive"),
    (lambda: dnn.max_pool2d(X2, 2, (1, 2, 3)), ValueError, "stride"),
    (lambda: dnn.max_pool2d(X2, 2, 1, -1), ValueError, "padding: got -1; each value must be non-negative"),
    (lambda: dnn.max_pool2d(X2, 2, 1, 2), ValueError, "at most half the kernel"),
    (lambda: dnn.max_pool2d(X2, 3, 1, 1, 0), ValueError, "dilation: got 0; each value must be positive"),
    (lambda: dnn.max_pool2d(X2, 9), ValueError, "output size"),
    (lambda: dnn.max_pool2d(X2, 2, ceil_mode=1), TypeError, "ceil_mode"),
    (lambda: dnn.max_pool2d(X2, 2, return_indices="yes"), TypeError, "return_indices"),
    (lambda: dnn.avg_pool2d(X2, 2, count_include_pad=None), TypeError, "count_include_pad"),
    (lambda: dnn.avg_pool2d(X2, 2, divisor_override=0), ValueError, "divisor_override"),
    (lambda: dnn.avg_pool2d(X2, 2, divisor_override=1.5), ValueError, "divisor_override"),
    (lambda: dnn.avg_pool3d(X2[0], 2), ValueError, "5-D"),
    (lambda: dnn.adaptive_avg_pool2d(X2, -1), ValueError, "non-negative"),
    (lambda: dnn.adaptive_avg_pool2d(X2, (2, 2, 2)), ValueError, "output_size"),
    (lambda: dnn.adaptive_max_pool2d(X2, "2"), ValueError, "output_size"),
    (lambda: dnn.max_pool2d(X2, 2, out=np.zeros((2, 3, 4, 5), np.float32)), ValueError, "out: expected shape"),
    (lambda: dnn.max_pool2d(X2, 2, out=G2.astype(np.float64)), TypeError, "out: expected dtype"),
    (lambda: dnn.max_pool2d(X2, 2, out=torch.zeros(2, 3, 4, 4)), TypeError, "out: got a torch"),
    (lambda: dnn.max_pool2d(X2, 2, out=np.broadcast_to(G2[:1], G2.shape)), ValueError, "read-only"),
    (lambda: dnn.max_pool2d(X2, 2, return_indices=True, out=(G2.copy(), G2.copy())), TypeError, r"out\[1\]"),
    (lambda: dnn.max_pool2d(X2, 2, return_indices=True, out=(G2.copy(),)), ValueError, "pair"),
    (lambda: dnn.max_pool2d(X2.astype(np.float64), 2, return_indices=True,
                            out=(lambda v: (v, v.view(np.int64)))(G2.astype(np.float64))), ValueError, "overlap"),
    (lambda: dnn.avg_pool2d(X2, 2, 2, 0, False, True, None, out=X2.reshape(-1)[:96].reshape(G2.shape)),
     ValueError, "overlaps"),
    (lambda: dnn.max_pool2d_backward(G2, X2.shape, I2[:, :, :3], 2), ValueError, "indices: expected shape"),
    (lambda: dnn.max_pool2d_backward(G2, X2.shape, I2.astype(np.float32), 2), TypeError, "indices: expected an"),
    (lambda: dnn.max_pool2d_backward(G2, X2.shape, I2 + 64, 2), ValueError, r"\[0, 64\)"),
    (lambda: dnn.max_pool2d_backward(G2, X2.shape, I2 - 1, 2), ValueError, "indices: values"),
    (lambda: dnn.max_pool2d_backward(G2, X2.shape, None, 2), TypeError, "indices is required"),
    (lambda: dnn.max_pool2d_backward(G2, (2, 3, 8, 10), I2, 2), ValueError, "grad_output: expected shape"),
    (lambda: dnn.max_pool2d_backward(G2, (2, 3), I2, 2), ValueError, "input_shape must be 4-D"),
    (lambda: dnn.max_pool2d_backward(G2, 5, I2, 2), TypeError, "input_shape"),
    (lambda: dnn.max_pool2d_backward(G2, (2, 3, 8, -8), I2, 2), ValueError, "input_shape"),
    (lambda: dnn.max_pool2d_backward(G2.astype(np.int16), X2.shape, I2, 2), TypeError, "grad_output: dtype"),
    (lambda: dnn.max_pool2d_backward("g", X2.shape, I2, 2), TypeError, "grad_output: got str, expected a numpy"),
    (lambda: dnn.adaptive_avg_pool2d_backward([1.0], X2.shape), TypeError, "grad_output: got list, expected"),
    (lambda: dnn.avg_pool2d_backward(G2, X2.shape, 2, padding=3), ValueError, "at most half"),
    (lambda: dnn.avg_pool2d_backward(G2, X2.shape, 3), ValueError, "grad_output: expected shape"),
    (lambda: dnn.adaptive_avg_pool2d_backward(G2, (2, 4, 8, 8)), ValueError, "grad_output: expected shape"),
    (lambda: dnn.adaptive_avg_pool2d_backward(G2[0, 0, 0], X2.shape), ValueError, "grad_output must be 3-D or 4-D"),
    (lambda: dnn.adaptive_max_pool2d_backward(G2, X2, None), TypeError, "indices is required"),
]


@pytest.mark.parametrize("case", range(len(ERRORS)))
def test_errors(case):
    call, exc, match = ERRORS[case]
    keep = (X2.copy(), G2.copy(), I2.copy())
    with pytest.raises(exc, match=match):
        call()
    for a, b in zip((X2, G2, I2), keep):
        np.testing.assert_array_equal(a, b)


def test_error_leaves_out_untouched():
    o = np.full((2, 3, 4, 4), 5.0, np.float32)
    with pytest.raises(ValueError):
        dnn.max_pool2d(X2, 2, padding=2, out=o)
    assert (o == 5).all()
