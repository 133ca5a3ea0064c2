"""blasx.dnn's normalisation layers (batch_norm, layer_norm, group_norm and their backward passes) on the host
against CPU torch: forward, running-statistic updates (momentum and cumulative), inference mode, backward
against torch.autograd, both layouts, out=, every dtype with torch's mixed-type parameters, a large
half-precision reduction with a large mean (the two-pass variance), and every validation error.

Errors are relative Frobenius norms against torch in float64 on the same (rounded) inputs; tolerances per
dtype: float64 1e-12, float32 1e-5, float16 4e-3, bfloat16 3e-2 (float32 statistics; each result rounded
once)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from blasx import dnn
from dnn_ref import check_norm_stats_cast, cl, is_cl, rand, rel, wide

BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5, np.dtype(np.float16): 4e-3, BF16: 3e-2}
HALF = [np.dtype(np.float16), BF16]


def maybe(rng, shape, dtype, present):
    return rand(rng, shape, dtype) if present else None


def grads(ts):
    return [None if t is None else t.grad for t in ts]


# ---------------------------------------------------------------- batch_norm

@settings(max_examples=25, deadline=None)
@given(nsp=st.integers(0, 3), n=st.integers(1, 4), c=st.integers(1, 5), layout=st.sampled_from(["nchw", "cl"]),
       affine=st.booleans(), running=st.booleans(), momentum=st.sampled_from([0.1, 0.5, 1.0]),
       seed=st.integers(0, 99))
def test_batch_norm_training_vs_torch(nsp, n, c, layout, affine, running, momentum, seed):
    rng = np.random.default_rng(seed)
    shape = (n, c, *(4, 3, 2)[:nsp])
    if n * int(np.prod(shape[2:])) < 3:  # (2 values a channel: grad_input is 0 up to eps, all cancellation)
        n, shape = 3, (3, *shape[1:])
    x, g = rand(rng, shape, loc=1.5), rand(rng, shape)
    w, b = maybe(rng, (c,), np.float64, affine), maybe(rng, (c,), np.float64, affine)
    rm, rv = (rand(rng, (c,)), rng.uniform(0.5, 2, c)) if running else (None, None)
    rmt, rvt = (wide(rm), wide(rv)) if running else (None, None)
    xt, wt, bt = wide(x, True), *(None if v is None else wide(v, True) for v in (w, b))
    yt = F.batch_norm(xt, rmt, rvt, wt, bt, training=True, momentum=momentum)
    yt.backward(wide(g))
    xin = cl(x) if layout == "cl" and nsp else x
    y, mean, invstd = dnn.batch_norm(xin, rm, rv, w, b, True, momentum, return_stats=True)
    assert rel(y, yt) < 1e-12
    if layout == "cl" and nsp:
        assert is_cl(y)
    if running:
        assert rel(rm, rmt) < 1e-12 and rel(rv, rvt) < 1e-12
    gi, gw, gb = dnn.batch_norm_backward(cl(g) if layout == "cl" and nsp else g, xin, w, mean, invstd, True)
    assert rel(gi, xt.grad) < 1e-12
    assert (gw is None) == (w is None)
    if affine:
        assert rel(gw, wt.grad) < 1e-12 and rel(gb, bt.grad) < 1e-12
    else:
        assert rel(gb, g.sum(axis=(0, *range(2, g.ndim)))) < 1e-12


@pytest.mark.parametrize("nsp", [0, 1, 2, 3])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_batch_norm_inference_and_backward(nsp, layout):
    rng = np.random.default_rng(nsp)
    shape = (3, 4, *(5, 4, 3)[:nsp])
    x, g = rand(rng, shape), rand(rng, shape)
    w, b, rm, rv = rand(rng, (4,)), rand(rng, (4,)), rand(rng, (4,)), rng.uniform(0.5, 2, 4)
    keep = rm.copy(), rv.copy()
    xt, wt, bt = wide(x, True), wide(w, True), wide(b, True)
    yt = F.batch_norm(xt, wide(rm), wide(rv), wt, bt, training=False, eps=1e-3)
    yt.backward(wide(g))
    xin = cl(x) if layout == "cl" else x
    y, mean, invstd = dnn.batch_norm(xin, rm, rv, w, b, eps=1e-3, return_stats=True)
    assert rel(y, yt) < 1e-12
    assert np.array_equal(rm, keep[0]) and np.array_equal(rv, keep[1])
    assert not np.shares_memory(mean, rm)
    for kw in (dict(running_mean=rm, running_var=rv), {}):  # the running stats, or the saved ones
        gi, gw, gb = dnn.batch_norm_backward(g, xin, w, mean, invstd, False, 1e-3, **kw)
        assert rel(gi, xt.grad) < 1e-12 and rel(gw, wt.grad) < 1e-12 and rel(gb, bt.grad) < 1e-12


def test_batch_norm_cumulative_average_and_num_batches_tracked():
    rng = np.random.default_rng(7)
    mod = torch.nn.BatchNorm2d(3, momentum=None, dtype=torch.float64)
    rm, rv, nbt = np.zeros(3), np.ones(3), np.zeros((), np.int64)
    for step in range(3):
        x = rand(rng, (4, 3, 5, 2), loc=step)
        mod(wide(x))
        dnn.batch_norm(x, rm, rv, training=True, momentum=None, num_batches_tracked=nbt)
        assert int(nbt) == int(mod.num_batches_tracked) == step + 1
        assert rel(rm, mod.running_mean) < 1e-12 and rel(rv, mod.running_var) < 1e-12
    # with a momentum, the counter still counts (as the module's buffer)
    dnn.batch_norm(x, rm, rv, training=True, momentum=0.2, num_batches_tracked=nbt)
    assert int(nbt) == 4


def test_batch_norm_empty_batch_leaves_running_stats():
    x = np.zeros((0, 3, 4))
    rm, rv = np.full(3, 0.5), np.full(3, 2.0)
    y = dnn.batch_norm(x, rm, rv, training=True)
    assert y.shape == x.shape and np.all(rm == 0.5) and np.all(rv == 2.0)


def test_out_and_layouts():
    rng = np.random.default_rng(3)
    x = rand(rng, (2, 6, 5, 4))
    for fn, kw in ((dnn.batch_norm, dict(running_mean=None, running_var=None, training=True)),
                   (dnn.group_norm, dict(num_groups=3)), (dnn.layer_norm, dict(normalized_shape=(5, 4)))):
        ref = fn(x, **kw)
        y = fn(cl(x), **kw)
        assert rel(y, ref) < 1e-12
        assert is_cl(y) == (fn is not dnn.layer_norm) and (y.flags.c_contiguous == (fn is dnn.layer_norm))
        out = np.empty_like(x)
        assert fn(cl(x), **kw, out=out) is out and rel(out, ref) < 1e-12
        strided = np.zeros((2, 6, 10, 4))[:, :, ::2]  # neither layout: computed on a C-contiguous copy
        strided[...] = x
        assert rel(fn(strided, **kw), ref) < 1e-12


# ---------------------------------------------------------------- layer_norm, group_norm

@settings(max_examples=25, deadline=None)
@given(lead=st.sampled_from([(), (3,), (2, 3)]), norm=st.sampled_from([(5,), (4, 5), (3, 4, 2)]),
       as_int=st.booleans(), affine=st.booleans(), eps=st.sampled_from([1e-5, 0.1]), seed=st.integers(0, 99))
def test_layer_norm_vs_torch(lead, norm, as_int, affine, eps, seed):
    rng = np.random.default_rng(seed)
    shape = lead + norm
    x, g = rand(rng, shape, loc=-2.0), rand(rng, shape)
    w, b = maybe(rng, norm, np.float64, affine), maybe(rng, norm, np.float64, affine)
    xt, wt, bt = wide(x, True), *(None if v is None else wide(v, True) for v in (w, b))
    ns = norm[0] if as_int and len(norm) == 1 else norm
    yt = F.layer_norm(xt, norm, wt, bt, eps)
    yt.backward(wide(g))
    y, mean, rstd = dnn.layer_norm(x, ns, w, b, eps, return_stats=True)
    assert rel(y, yt) < 1e-12
    assert mean.shape == rstd.shape == lead + (1,) * len(norm)
    gi, gw, gb = dnn.layer_norm_backward(g, x, ns, w, mean, rstd)
    assert rel(gi, xt.grad) < 1e-12 and (gw is None) == (w is None) and gb.shape == norm
    if affine:
        assert rel(gw, wt.grad) < 1e-12 and rel(gb, bt.grad) < 1e-12


@settings(max_examples=25, deadline=None)
@given(nsp=st.integers(0, 3), n=st.integers(1, 3), cg=st.integers(1, 3), groups=st.sampled_from([1, 2, 3]),
       layout=st.sampled_from(["nchw", "cl"]), affine=st.booleans(), seed=st.integers(0, 99))
def test_group_norm_vs_torch(nsp, n, cg, groups, layout, affine, seed):
    rng = np.random.default_rng(seed)
    c = cg * groups
    shape = (n, c, *(4, 3, 2)[:nsp])
    if cg * int(np.prod(shape[2:])) < 3:  # (2 values a group: grad_input is 0 up to eps, all cancellation)
        return
    x, g = rand(rng, shape, loc=3.0), rand(rng, shape)
    w, b = maybe(rng, (c,), np.float64, affine), maybe(rng, (c,), np.float64, affine)
    xt, wt, bt = wide(x, True), *(None if v is None else wide(v, True) for v in (w, b))
    yt = F.group_norm(xt, groups, wt, bt)
    yt.backward(wide(g))
    use_cl = layout == "cl" and nsp > 0
    xin, gin = (cl(x), cl(g)) if use_cl else (x, g)
    y, mean, rstd = dnn.group_norm(xin, groups, w, b, return_stats=True)
    assert rel(y, yt) < 1e-12 and mean.shape == rstd.shape == (n, groups)
    if use_cl:
        assert is_cl(y)
    gi, gw, gb = dnn.group_norm_backward(gin, xin, groups, w, mean, rstd)
    assert rel(gi, xt.grad) < 1e-12 and (gw is None) == (w is None)
    if affine:
        assert rel(gw, wt.grad) < 1e-12 and rel(gb, bt.grad) < 1e-12


# ---------------------------------------------------------------- dtypes

def _case(kind, rng, dtype, pdtype, layout):
    """(our forward, our backward, the torch float64 forward) of one layer on inputs rounded to dtype."""
    shape = (3, 6, 5, 4)
    x, g = rand(rng, shape, dtype, loc=2.0), rand(rng, shape, dtype)
    pshape = (5, 4) if kind == "layer" else (6,)
    w, b = rand(rng, pshape, pdtype), rand(rng, pshape, pdtype)
    xin, gin = (cl(x), cl(g)) if layout == "cl" else (x, g)
    if kind == "batch":
        rm, rv = rand(rng, (6,), pdtype), rng.uniform(0.5, 2, 6).astype(pdtype)
        rm0, rv0 = rm.copy(), rv.copy()
        rmt, rvt = wide(rm), wide(rv)

        def ours():
            y, m, s = dnn.batch_norm(xin, rm, rv, w, b, True, 0.3, return_stats=True)
            return y, m, s, dnn.batch_norm_backward(gin, xin, w, m, s, True)

        def theirs(xt, wt, bt):
            return F.batch_norm(xt, rmt, rvt, wt, bt, True, 0.3)

        def running():
            assert rm.dtype == rm0.dtype and rv.dtype == rv0.dtype
            assert rel(rm, rmt) < TOL[np.dtype(dtype)] and rel(rv, rvt) < TOL[np.dtype(dtype)]
        return x, g, w, b, ours, theirs, running
    if kind == "layer":
        def ours():
            y, m, s = dnn.layer_norm(xin, (5, 4), w, b, return_stats=True)
            return y, m, s, dnn.layer_norm_backward(gin, xin, (5, 4), w, m, s)
        return x, g, w, b, ours, lambda xt, wt, bt: F.layer_norm(xt, (5, 4), wt, bt), None

    def ours():
        y, m, s = dnn.group_norm(xin, 3, w, b, return_stats=True)
        return y, m, s, dnn.group_norm_backward(gin, xin, 3, w, m, s)
    return x, g, w, b, ours, lambda xt, wt, bt: F.group_norm(xt, 3, wt, bt), None


@pytest.mark.parametrize("kind", ["batch", "layer", "group"])
@pytest.mark.parametrize("dtype,pdtype", [(np.float32, np.float32), (np.float16, np.float16),
                                          (np.float16, np.float32), (BF16, BF16), (BF16, np.float32)],
                         ids=["f32", "f16", "f16-f32params", "bf16", "bf16-f32params"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_dtypes_vs_torch(kind, dtype, pdtype, layout):
    rng = np.random.default_rng(11)
    x, g, w, b, ours, theirs, running = _case(kind, rng, dtype, pdtype, layout)
    xt, wt, bt = wide(x, True), wide(w, True), wide(b, True)
    yt = theirs(xt, wt, bt)
    yt.backward(wide(g))
    y, m, s, (gi, gw, gb) = ours()
    tol = TOL[np.dtype(dtype)]
    assert y.dtype == gi.dtype == np.dtype(dtype) and gw.dtype == gb.dtype == np.dtype(pdtype)
    assert m.dtype == s.dtype == np.float32
    assert rel(y, yt) < tol and rel(gi, xt.grad) < tol
    assert rel(gw, wt.grad) < tol and rel(gb, bt.grad) < tol
    if running:
        running()


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_half_statistics_two_pass(dtype):
    """A large reduction of half data with a mean far from 0: E[x^2] - E[x]^2 in float32 would lose the
    variance; the two-pass form keeps it to float32 accuracy."""
    rng = np.random.default_rng(5)
    x = (200.0 + rng.standard_normal((64, 2, 96, 96))).astype(dtype)
    rm, rv = np.zeros(2, np.float32), np.ones(2, np.float32)
    y, mean, invstd = dnn.batch_norm(x, rm, rv, training=True, momentum=1.0, return_stats=True)
    xw = np.asarray(x, np.float64)
    var = xw.var(axis=(0, 2, 3))
    assert np.allclose(mean, xw.mean(axis=(0, 2, 3)), rtol=1e-6)
    assert np.allclose(1 / invstd ** 2, var + 1e-5, rtol=1e-4)
    assert np.allclose(rv, xw.var(axis=(0, 2, 3), ddof=1), rtol=1e-4)
    assert rel(y, (xw - xw.mean(axis=(0, 2, 3), keepdims=True)) / np.sqrt(var + 1e-5)[:, None, None]) < TOL[
        np.dtype(dtype)]


def test_float64_stats_dtype():
    x = np.random.default_rng(0).standard_normal((2, 4, 3))
    for stats in (dnn.batch_norm(x, None, None, training=True, return_stats=True)[1:],
                  dnn.layer_norm(x, 3, return_stats=True)[1:], dnn.group_norm(x, 2, return_stats=True)[1:]):
        assert all(s.dtype == np.float64 for s in stats)


# ---------------------------------------------------------------- validation

def _errors():
    """(call taking the arrays dict, exception type, message fragment)."""
    X, Xh = "x", "xh"

    def train(a, **kw):
        return dnn.batch_norm(a[X], a["rm"], a["rv"], training=True, **kw)
    return [
        (lambda a: dnn.batch_norm([[1.0, 2.0]], None, None, training=True), TypeError, "input: got list, expected a numpy"),
        (lambda a: dnn.batch_norm(a["xi"], None, None, training=True), TypeError, "input: dtype int64"),
        (lambda a: dnn.batch_norm(a["x1"], a["rm"], a["rv"]), ValueError, "input: expected (N, C)"),
        (lambda a: dnn.batch_norm(a[X], a["rm"], a["rv"], a["w5"]), ValueError, "weight: expected shape (4,)"),
        (lambda a: dnn.batch_norm(a[X], a["rm"], a["rv"], None, a["w5"]), ValueError, "bias: expected shape"),
        (lambda a: dnn.batch_norm(a[X], a["w5"], a["rv"]), ValueError, "running_mean: expected shape (4,)"),
        (lambda a: dnn.batch_norm(a[X], a["rm"], a["w5"]), ValueError, "running_var: expected shape (4,)"),
        (lambda a: dnn.batch_norm(a[X], a["rm"], a["rv"], a["w32"]), TypeError, "weight: dtype float32 does not"),
        (lambda a: dnn.batch_norm(a[X], a["rm"], a["rv"], [1.0] * 4), TypeError, "weight: got list, expected a numpy"),
        (lambda a: dnn.batch_norm(a[Xh], a["rm16"], a["rv"], training=True), TypeError, "or float32 for every"),
        (lambda a: dnn.batch_norm(a["x32"], a["rm16"], a["rv16"], training=True), TypeError, "running_mean: dtype"),
        (lambda a: dnn.batch_norm(a[X], a["rm"], a["rv"], training=1), TypeError, "training: got 1"),
        (lambda a: train(a, momentum="0.1"), TypeError, "momentum: got '0.1'"),
        (lambda a: train(a, eps=-1.0), ValueError, "eps: got -1.0"),
        (lambda a: train(a, eps=0.0), ValueError, "eps: must be positive during training, got 0.0"),
        (lambda a: train(a, eps=float("nan")), TypeError, "eps: got nan"),
        (lambda a: dnn.batch_norm(a[X], a["rm"], None, training=True), ValueError, "both be None"),
        (lambda a: dnn.batch_norm(a[X], None, None), ValueError, "evaluation mode"),
        (lambda a: dnn.batch_norm(a["x1c"], a["rm"], a["rv"], training=True), ValueError, "more than 1 value"),
        (lambda a: train(a, momentum=None), ValueError, "needs num_batches_tracked"),
        (lambda a: train(a, momentum=None, num_batches_tracked=a["rm"]), TypeError, "num_batches_tracked: expected"),
        (lambda a: train(a, return_stats=None), TypeError, "return_stats"),
        (lambda a: train(a, out=a["x32"]), TypeError, "out: expected dtype"),
        (lambda a: train(a, out=a["x1"]), ValueError, "out: expected shape"),
        (lambda a: train(a, out=a["ro"]), ValueError, "out: is read-only"),
        (lambda a: train(a, out=[0.0]), TypeError, "out: got a builtins.list"),
        (lambda a: dnn.batch_norm_backward(a["x1c"], a[X], None, a["rm"], a["rv"]), ValueError,
         "grad_output: expected input's shape"),
        (lambda a: dnn.batch_norm_backward(a["x32"], a[X], None, a["rm"], a["rv"]), TypeError, "grad_output: expected input's dtype"),
        (lambda a: dnn.batch_norm_backward(a[X], a[X], None, None, a["rv"]), ValueError, "save_mean: expected an"),
        (lambda a: dnn.batch_norm_backward(a[X], a[X], None, a["rm"], a["w5"]), ValueError, "save_invstd: expected 4"),
        (lambda a: dnn.batch_norm_backward(a[X], a[X], None, a["rm"], a["rv"], False, running_mean=a["rm"]),
         ValueError, "both be None"),
        (lambda a: dnn.batch_norm_backward(a[X], a[X], a["w32"], a["rm"], a["rv"]), TypeError, "weight: dtype"),
        (lambda a: dnn.layer_norm(a[X], ()), ValueError, "normalized_shape: got ()"),
        (lambda a: dnn.layer_norm(a[X], None), TypeError, "normalized_shape: got None"),
        (lambda a: dnn.layer_norm(a[X], (2.5,)), ValueError, "normalized_shape: got (2.5,), expected"),
        (lambda a: dnn.layer_norm(a[X], (4,)), ValueError, "normalized_shape=(4,) expects input of shape (*, 4)"),
        (lambda a: dnn.layer_norm(a["x1"], (3, 4)), ValueError, "input: expected at least 2 dimensions"),
        (lambda a: dnn.layer_norm(a[X], (3,), a["w5"]), ValueError, "weight: expected shape (3,)"),
        (lambda a: dnn.layer_norm(a[X], (3,), eps="small"), TypeError, "eps: got 'small'"),
        (lambda a: dnn.layer_norm(a[X], (3,), out=a["x32"]), TypeError, "out: expected dtype"),
        (lambda a: dnn.layer_norm_backward(a[X], a[X], (3,), None, a["rm"], a["rm"]), ValueError, "mean: expected 8"),
        (lambda a: dnn.layer_norm_backward(a[X], a[X], (3,), None, a["m8"], a["rm"]), ValueError, "rstd: expected 8"),
        (lambda a: dnn.group_norm(a[X], 3), ValueError, "channels (shape (2, 4, 3)) are not divisible"),
        (lambda a: dnn.group_norm(a[X], 0), ValueError, "num_groups: got 0"),
        (lambda a: dnn.group_norm(a[X], True), ValueError, "num_groups: got True"),
        (lambda a: dnn.group_norm(a["x1"], 1), ValueError, "input: expected (N, C, *)"),
        (lambda a: dnn.group_norm(a[X], 2, a["w5"]), ValueError, "weight: expected shape (4,)"),
        (lambda a: dnn.group_norm(a[X], 2, out=a["x1"]), ValueError, "out: expected shape"),
        (lambda a: dnn.group_norm_backward(a[X], a[X], 2, None, a["w5"], a["rm"]), ValueError, "mean: expected 4"),
        (lambda a: dnn.group_norm_backward(a[X], a["x32"], 2, None, a["rm"], a["rm"]), TypeError, "grad_output"),
    ]


@pytest.mark.parametrize("case", range(len(_errors())))
def test_validation_errors(case):
    call, exc, fragment = _errors()[case]
    rng = np.random.default_rng(case)
    a = {"x": rand(rng, (2, 4, 3)), "xh": rand(rng, (2, 4, 3), np.float16), "x32": rand(rng, (2, 4, 3), np.float32),
         "xi": np.ones((2, 4, 3), np.int64), "x1": rand(rng, (4,)), "x1c": rand(rng, (1, 4)),
         "rm": rand(rng, (4,)), "rv": rng.uniform(0.5, 2, 4), "rm16": rand(rng, (4,), np.float16),
         "rv16": np.ones(4, np.float16), "w5": rand(rng, (5,)), "w32": rand(rng, (4,), np.float32),
         "m8": rand(rng, (2, 4, 1)), "ro": rand(rng, (2, 4, 3))}
    a["ro"].flags.writeable = False
    before = {k: v.copy() for k, v in a.items()}
    with pytest.raises(exc) as err:
        call(a)
    assert fragment in str(err.value), str(err.value)
    for k, v in a.items():  # nothing was written, running statistics included
        assert np.array_equal(v, before[k], equal_nan=True), k


def test_backward_takes_statistics_of_another_float_type():
    check_norm_stats_cast()


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_kernel_load_and_store_are_filled_in(dtype):
    """The CUDA load/store of the element type come from the epilogue's templates, filled in for y and r."""
    from blasx.dnn import norm_kernels
    _, _, _, load, store = norm_kernels._types(np.dtype(dtype))
    assert "{" not in load and "{" not in store and "y" in load and "r" in store
