"""blasx.dnn's softmax/log_softmax, local_response_norm, dropout, add, cat and flatten on numpy arrays against
CPU torch in float64: forward and backward (torch.autograd), every dtype, C-contiguous and channels-last,
out=, torch's edge cases and every validation error.

Tolerances (relative Frobenius error vs float64 torch on the same, already rounded, input): a few units of
roundoff of the type (half types compute in float32 and round once).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from blasx import dnn
from blasx.dnn.geometry import layout
from dnn_ref import DTYPES, TOL, bfloat16, dtype_name as _name, cl, rel, wide

torch = pytest.importorskip("torch")
F = torch.nn.functional


def rand(shape, dt=np.float64, seed=0, lay="nchw", scale=3.0):
    x = (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dt)
    return cl(x) if lay == "cl" else x


# ---------------------------------------------------------------- softmax, log_softmax

@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dt", DTYPES, ids=_name)
@pytest.mark.parametrize("lay", ["nchw", "cl"])
def test_softmax_every_dim_matches_torch(log, dt, lay):
    name = "log_softmax" if log else "softmax"
    x = rand((3, 6, 5, 4), dt, lay=lay)
    keep = x.copy()
    for dim in (0, 1, 2, 3, -1, -3):
        y = getattr(dnn, name)(x, dim)
        assert y.dtype == np.dtype(dt) and y.flags.c_contiguous  # torch's result is contiguous
        xt = wide(x, grad=True)
        yt = getattr(F, name)(xt, dim)
        g = rand(x.shape, dt, seed=dim + 7)
        yt.backward(wide(g))
        assert rel(y, yt.detach().numpy()) < TOL[_name(dt)], dim
        dx = getattr(dnn, f"{name}_backward")(g, y, dim)
        assert dx.dtype == np.dtype(dt)
        assert rel(dx, xt.grad.numpy()) < 4 * TOL[_name(dt)], dim
    np.testing.assert_array_equal(x, keep)


def test_softmax_dtype_casts_first_and_backward_returns_the_input_type():
    x = rand((4, 9), np.float16)
    y = dnn.softmax(x, 1, dtype=np.float32)
    assert y.dtype == np.float32
    xt = wide(x, grad=True)
    yt = F.softmax(xt, 1)
    assert rel(y, yt.detach().numpy()) < 1e-6
    g = rand(x.shape, np.float32, seed=3)
    yt.backward(wide(g))
    dx = dnn.softmax_backward(g, y, 1, input_dtype=np.float16)
    assert dx.dtype == np.float16 and rel(dx, xt.grad.numpy()) < 2e-3
    y64 = dnn.log_softmax(rand((5, 3), np.float32), -1, "float64")
    assert y64.dtype == np.float64
    if bfloat16 is not None:  # float64 -> bfloat16 rounds first, as torch's cast
        x = rand((3, 7))
        want = F.softmax(torch.from_numpy(x).to(torch.bfloat16).double(), 0).numpy()
        assert rel(dnn.softmax(x, 0, dtype=bfloat16), want) < 1.6e-2


def test_softmax_is_stable_and_follows_torch_on_edge_values():
    x = np.array([[1000.0, 999.0, -1000.0], [-np.inf, 0.0, 1.0], [-np.inf] * 3, [np.nan, 0, 1]])
    for name in ("softmax", "log_softmax"):
        with np.errstate(invalid="ignore"):
            y = getattr(dnn, name)(x, 1)
        want = getattr(F, name)(torch.from_numpy(x), 1).numpy()
        np.testing.assert_allclose(y, want, rtol=1e-14)  # NaN where torch has NaN


def test_softmax_implicit_dim_is_torchs_with_its_warning():
    for shape, dim in [((5,), 0), ((3, 4), 1), ((2, 3, 4), 0), ((2, 3, 4, 5), 1)]:
        x = rand(shape)
        with pytest.warns(UserWarning, match="Implicit dimension choice for softmax"):
            y = dnn.softmax(x)
        np.testing.assert_allclose(y, F.softmax(torch.from_numpy(x), dim).numpy(), rtol=1e-13)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dnn.log_softmax(np.array(2.0), 0) == 0.0  # a 0-D input: its one element
    assert dnn.softmax(np.empty((0, 3), np.float32), 1).shape == (0, 3)


def test_softmax_out():
    x = rand((4, 5), np.float32)
    out = np.empty_like(x)
    assert dnn.softmax(x, 1, out=out) is out
    np.testing.assert_array_equal(out, dnn.softmax(x, 1))
    assert dnn.log_softmax(x, 0, out=x) is x  # in place: the result may go back into the input


# ---------------------------------------------------------------- local_response_norm

@pytest.mark.parametrize("dt", DTYPES, ids=_name)
@pytest.mark.parametrize("shape, size", [((2, 7, 9), 3), ((2, 6, 5, 4), 4), ((2, 5, 3, 4), 1),
                                         ((1, 4, 3, 2, 3), 5), ((2, 3, 4, 5), 8)])
@pytest.mark.parametrize("lay", ["nchw", "cl"])
def test_lrn_matches_torch(dt, shape, size, lay):
    x = rand(shape, dt, lay=lay, scale=2.0)
    args = dict(alpha=0.3, beta=0.75, k=2.0) if size != 1 else {}
    keep = x.copy()
    y = dnn.local_response_norm(x, size, **args)
    assert y.dtype == np.dtype(dt) and layout(y) == layout(x)
    xt = wide(x, grad=True)
    yt = F.local_response_norm(xt, size, **args)
    g = rand(shape, dt, seed=5)
    yt.backward(wide(g))
    assert rel(y, yt.detach().numpy()) < TOL[_name(dt)]
    dx = dnn.local_response_norm_backward(g, x, size, **args)
    assert dx.dtype == np.dtype(dt) and layout(dx) == layout(x)
    assert rel(dx, xt.grad.numpy()) < 4 * TOL[_name(dt)]
    np.testing.assert_array_equal(x, keep)


def test_lrn_other_strides_out_and_empty():
    x = rand((3, 8, 6, 5))[:, ::2, :, 1:]
    want = F.local_response_norm(torch.from_numpy(np.ascontiguousarray(x)), 3, 0.1).numpy()
    out = np.empty(x.shape)
    assert dnn.local_response_norm(x, 3, 0.1, out=out) is out
    np.testing.assert_allclose(out, want, rtol=1e-13)
    e = np.empty((0, 3, 4))
    assert dnn.local_response_norm(e, 2) is e  # torch returns an empty input itself


# ---------------------------------------------------------------- dropout

@pytest.mark.parametrize("dt", DTYPES, ids=_name)
def test_dropout_training_scales_the_kept_and_backward_uses_the_mask(dt):
    x = rand((4, 8, 16, 16), dt, lay="cl")
    y, mask = dnn.dropout(x, 0.3, seed=7, return_mask=True)
    assert y.dtype == np.dtype(dt) and layout(y) == "cl" and mask.dtype == bool and mask.shape == x.shape
    assert abs(mask.mean() - 0.7) < 0.02
    xt = wide(x, grad=True)
    yt = xt * torch.from_numpy(mask) / 0.7  # torch's formula with this mask
    g = rand(x.shape, dt, seed=2)
    yt.backward(wide(g))
    assert rel(y, yt.detach().numpy()) < TOL[_name(dt)]
    assert rel(dnn.dropout_backward(g, mask, 0.3), xt.grad.numpy()) < TOL[_name(dt)]
    y2, mask2 = dnn.dropout(x, 0.3, seed=7, return_mask=True)  # same seed, same mask
    np.testing.assert_array_equal(mask2, mask)
    np.testing.assert_array_equal(y2, y)
    assert not np.array_equal(dnn.dropout(x, 0.3, seed=8, return_mask=True)[1], mask)


def test_dropout_inference_p0_p1_inplace_and_out():
    x = rand((3, 5))
    assert dnn.dropout(x, 0.5, training=False) is x  # torch returns the input itself
    assert dnn.dropout(x, 0.0) is x
    y, mask = dnn.dropout(x, 0.5, False, return_mask=True)
    assert y is x and mask.all()
    g = rand((3, 5), seed=1)
    assert dnn.dropout_backward(g, mask, 0.5, training=False) is g
    xn = x.copy()
    xn[0, 0] = np.nan
    y1, m1 = dnn.dropout(xn, 1.0, return_mask=True)
    want = F.dropout(torch.from_numpy(xn), 1.0).numpy()
    np.testing.assert_array_equal(y1, want)  # zeros, NaN stays NaN (x * 0)
    assert not m1.any()
    np.testing.assert_array_equal(dnn.dropout_backward(g, m1, 1.0), 0 * g)
    out = np.empty_like(x)
    assert dnn.dropout(x, 0.5, training=False, out=out) is out and np.array_equal(out, x)
    z = x.copy()
    w, m = dnn.dropout(z, 0.4, inplace=True, seed=3, return_mask=True)
    assert w is z
    np.testing.assert_allclose(z, np.where(m, x / 0.6, 0), rtol=1e-15)


# ---------------------------------------------------------------- add

@pytest.mark.parametrize("da, db", [(np.float64, np.float64), (np.float32, np.float32), (np.float16, np.float16),
                                    (np.float16, np.float32), (np.float32, np.float64)]
                         + ([(bfloat16, bfloat16), (np.float16, bfloat16)] if bfloat16 is not None else []),
                         ids=lambda t: _name(t))
@pytest.mark.parametrize("sa, sb", [((2, 3, 4, 5), (2, 3, 4, 5)), ((2, 3, 4, 5), (3, 1, 1)), ((1, 5), (4, 1)),
                                    ((3, 1, 5), (2, 3, 4, 5))])
def test_add_broadcasts_promotes_and_backward_sums(da, db, sa, sb):
    a, b = rand(sa, da), rand(sb, db, seed=1)
    y = dnn.add(a, b, alpha=-1.5)
    ta, tb = wide(a, True), wide(b, True)
    yt = torch.add(ta.to(_torch_dtype(da)), tb.to(_torch_dtype(db)), alpha=-1.5)
    assert y.dtype == np.dtype(_np_dtype(yt.dtype)) and y.shape == tuple(yt.shape)
    ref = torch.add(ta, tb, alpha=-1.5)
    g = rand(y.shape, y.dtype, seed=2)
    ref.backward(wide(g))
    assert rel(y, ref.detach().numpy()) < TOL[y.dtype.name]
    ga, gb = dnn.add_backward(g, sa, sb, -1.5, input_dtype=da, other_dtype=db)
    assert ga.dtype == np.dtype(da) and gb.dtype == np.dtype(db)
    assert rel(ga, ta.grad.numpy()) < TOL[_name(da)] and rel(gb, tb.grad.numpy()) < TOL[_name(db)]


def _torch_dtype(dt):
    return {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
            "bfloat16": torch.bfloat16}[_name(dt)]


def _np_dtype(t):
    return {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
            torch.bfloat16: bfloat16}[t]


def test_add_scalar_layout_out_and_identity_grads():
    x = rand((2, 3, 4, 5), np.float32, lay="cl")
    y = dnn.add(x, 2.5, alpha=2)
    assert y.dtype == np.float32 and layout(y) == "cl"
    np.testing.assert_allclose(y, x + 5.0, rtol=1e-6)
    assert layout(dnn.add(x, np.ascontiguousarray(x))) == "cl"  # the first operand's layout
    assert layout(dnn.add(np.ascontiguousarray(x), x)) == "nchw"
    assert layout(dnn.add(rand((3, 1, 1), np.float32), x)) == "cl"  # the first of the full shape
    out = np.empty((2, 3, 4, 5), np.float32)
    assert dnn.add(x, x, out=out) is out and np.array_equal(out, 2 * x)
    z = x.copy()
    assert dnn.add(z, rand((5,), np.float32), out=z) is z  # z += other
    g = rand((2, 3, 4, 5))
    gi, go = dnn.add_backward(g, (2, 3, 4, 5), None)
    assert gi is g and go is None  # torch passes the gradient through


# ---------------------------------------------------------------- cat

@pytest.mark.parametrize("dt", DTYPES, ids=_name)
def test_cat_every_dim_and_backward(dt):
    shapes = [(2, 3, 4, 5), (2, 3, 4, 5)]
    for dim in range(4):
        parts = []
        for i, s in enumerate(shapes):
            s = list(s)
            s[dim] += i
            parts.append(rand(tuple(s), dt, seed=i))
        y = dnn.cat(parts, dim)
        ts = [wide(p, True) for p in parts]
        yt = torch.cat(ts, dim)
        np.testing.assert_array_equal(y.astype(np.float64), yt.detach().numpy())
        g = rand(y.shape, dt, seed=9)
        yt.backward(wide(g))
        grads = dnn.cat_backward(g, [p.shape[dim] for p in parts], dim)
        for gr, t in zip(grads, ts):
            assert np.shares_memory(gr, g)  # views, as torch's narrow
            np.testing.assert_array_equal(gr.astype(np.float64), t.grad.numpy())


def test_cat_layout_promotion_legacy_empties_and_out():
    a, b = rand((2, 3, 4, 5), np.float32, lay="cl"), rand((2, 2, 4, 5), np.float32, seed=1, lay="cl")
    assert layout(dnn.cat([a, b], 1)) == "cl"  # every input channels-last
    assert layout(dnn.cat([a, np.ascontiguousarray(b)], 1)) == "nchw"
    y = dnn.cat((rand((2, 3), np.float16), rand((1, 3), np.float64)))
    assert y.dtype == np.float64 and y.shape == (3, 3)
    e = np.empty((0,), np.float32)
    np.testing.assert_array_equal(dnn.cat([e, a, e], 1), np.concatenate([a], 1))  # 1-D empties skipped
    out = np.empty((2, 5, 4, 5), np.float32)
    assert dnn.cat([a, b], -3, out=out) is out
    np.testing.assert_array_equal(out, np.concatenate([a, b], 1))
    grads = dnn.cat_backward(rand((2, 5)), [2, 3], 1, dtypes=[np.float32, None])
    assert grads[0].dtype == np.float32 and grads[1].dtype == np.float64


# ---------------------------------------------------------------- flatten

def test_flatten_is_torchs_and_a_view():
    x = rand((2, 3, 4, 5))
    for start, end in [(0, -1), (1, -1), (1, 2), (-3, -2), (2, 2)]:
        y = dnn.flatten(x, start, end)
        assert y.shape == tuple(torch.flatten(torch.from_numpy(x), start, end).shape)
        assert np.shares_memory(y, x)
        assert dnn.flatten_backward(y, x.shape).shape == x.shape
    assert dnn.flatten(x, 2, 2) is x  # nothing merges: the input itself, as torch
    assert dnn.flatten(np.array(3.0)).shape == (1,)
    t = x.transpose(0, 2, 1, 3)  # no view can merge dims 1..2: a copy
    y = dnn.flatten(t, 1, 2)
    assert not np.shares_memory(y, t)
    np.testing.assert_array_equal(y, torch.flatten(torch.from_numpy(t), 1, 2).numpy())


# ---------------------------------------------------------------- validation

def _x(shape=(2, 3, 4)):
    return np.ones(shape, np.float32)


@pytest.mark.parametrize("call, exc, fragments", [
    (lambda: dnn.softmax([1.0], 0), TypeError, ("input: got list",)),
    (lambda: dnn.softmax(_x(), 3), IndexError, ("dim: got 3", "[-3, 2]")),
    (lambda: dnn.softmax(_x(), 1.0), TypeError, ("dim: got 1.0", "expected an int")),
    (lambda: dnn.softmax(_x(), 1, dtype=np.int32), TypeError, ("dtype: got", "allowed: float64")),
    (lambda: dnn.softmax(_x(), 1, out=np.empty((2, 3, 4))), TypeError, ("out: expected dtype float32",)),
    (lambda: dnn.softmax_backward(_x(), _x((2, 3, 5)), 1), ValueError, ("output: expected grad_output's shape",)),
    (lambda: dnn.log_softmax_backward(_x(), _x(), 1, input_dtype="int8"), TypeError, ("input_dtype: got 'int8'",)),
    (lambda: dnn.local_response_norm(_x((2, 3)), 2), ValueError, ("input: expected 3D or higher",)),
    (lambda: dnn.local_response_norm(_x(), 0), ValueError, ("size: got 0", ">= 1")),
    (lambda: dnn.local_response_norm(_x(), 2.0), TypeError, ("size: got 2.0",)),
    (lambda: dnn.local_response_norm(_x(), 2, alpha="a"), TypeError, ("alpha: got 'a'", "real number")),
    (lambda: dnn.local_response_norm_backward(_x(), _x((2, 3, 5)), 2), ValueError,
     ("grad_output: expected input's shape",)),
    (lambda: dnn.dropout(_x(), 1.5), ValueError, ("p: dropout probability has to be between 0 and 1", "1.5")),
    (lambda: dnn.dropout(_x(), -0.1), ValueError, ("p: dropout probability",)),
    (lambda: dnn.dropout(_x(), True), TypeError, ("p: got True",)),
    (lambda: dnn.dropout(_x(), 0.5, training="yes"), TypeError, ("training: got 'yes'",)),
    (lambda: dnn.dropout(_x(), 0.5, seed=-1), ValueError, ("seed: got -1", ">= 0")),
    (lambda: dnn.dropout(_x(), 0.5, seed=1.5), TypeError, ("seed: got 1.5",)),
    (lambda: dnn.dropout(_x(), 0.5, True, True, out=_x()), ValueError, ("out: inplace=True",)),
    (lambda: dnn.dropout_backward(_x(), _x(), 0.5), TypeError, ("mask: got ndarray of dtype float32",)),
    (lambda: dnn.dropout_backward(_x(), np.ones((2, 3), bool), 0.5), ValueError, ("mask: expected grad_output's",)),
    (lambda: dnn.add(_x(), _x((3, 3))), ValueError, ("other: shape (3, 3) does not broadcast",)),
    (lambda: dnn.add(_x(), True), TypeError, ("other: got bool",)),
    (lambda: dnn.add(_x(), _x(), alpha="2"), TypeError, ("alpha: got '2'",)),
    (lambda: dnn.add(_x(), _x(), out=np.empty((2, 3), np.float32)), ValueError, ("out: expected shape (2, 3, 4)",)),
    (lambda: dnn.add_backward(_x(), (5, 4), None), ValueError, ("input_shape: (5, 4) does not broadcast",)),
    (lambda: dnn.add_backward(_x(), "abc"), TypeError, ("input_shape: got 'abc'",)),
    (lambda: dnn.cat([]), TypeError, ("tensors: got []", "non-empty")),
    (lambda: dnn.cat(_x()), TypeError, ("tensors: got",)),
    (lambda: dnn.cat([_x(), np.array(1.0, np.float32)]), ValueError, ("tensors[1]: a zero-dimensional",)),
    (lambda: dnn.cat([_x(), _x((2, 4, 4))], 0), ValueError, ("tensors[1]: sizes must match except in dimension 0",)),
    (lambda: dnn.cat([_x(), _x((2, 3))], 0), ValueError, ("tensors[1]: sizes must match",)),
    (lambda: dnn.cat([_x()], 3), IndexError, ("dim: got 3",)),
    (lambda: dnn.cat_backward(_x(), [1, 2], 0), ValueError, ("sizes: (1, 2) add up to 3, not", "2")),
    (lambda: dnn.flatten(_x(), 2, 1), ValueError, ("start_dim: 2 (dim 2) cannot come after end_dim 1",)),
    (lambda: dnn.flatten(_x(), 0, 5), IndexError, ("end_dim: got 5",)),
    (lambda: dnn.flatten_backward(_x(), (5, 5)), ValueError, ("input_shape: (5, 5) has 25 elements",)),
])
def test_errors_name_the_argument(call, exc, fragments, expect):
    expect(exc, *fragments, call=call)


def test_overlapping_out_is_refused_and_nothing_is_written(expect):
    buf = np.ones((2, 8), np.float32)
    a, b = buf[:, :4], buf[:, 4:]
    expect(ValueError, "out: overlaps an input", call=lambda: dnn.cat([a, b], 1, out=buf))
    expect(ValueError, "out: overlaps an input", call=lambda: dnn.softmax(buf[:, :6], 1, out=buf[:, 2:]))
    expect(ValueError, "out: overlaps an input", call=lambda: dnn.add(a, b, out=buf[:, 1:5]))
    np.testing.assert_array_equal(buf, 1)


def test_dropout_of_infinities_follows_torch_without_a_warning():
    """inf * a dropped position is NaN, as torch's; numpy's "invalid value" warning was an error under -W error."""
    g = np.array([[np.inf, np.nan, 1.0, -np.inf]])
    mask = np.array([[False, True, False, True]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = dnn.dropout_backward(g, mask, 0.5)
    want = torch.from_numpy(g) * torch.from_numpy(mask) * 2.0
    np.testing.assert_array_equal(got, want.numpy())


def test_layers_on_infinities_give_torchs_nans_without_numpys_warnings():
    """softmax / norms / lrn / add of inputs holding +-inf warned "invalid value" (an error under -W error or the
    caller's np.errstate(invalid="raise")); torch's results, silently."""
    x = np.random.default_rng(0).standard_normal((2, 4, 5, 5))
    x[0, 0, 0, 0], x[1, 2, 2, 2] = np.inf, -np.inf
    xt = torch.from_numpy(x)
    cases = [(lambda: dnn.softmax(x, 1), lambda: torch.softmax(xt, 1)),
             (lambda: dnn.log_softmax(x, 1), lambda: torch.log_softmax(xt, 1)),
             (lambda: dnn.layer_norm(x, (5, 5)), lambda: torch.nn.functional.layer_norm(xt, (5, 5))),
             (lambda: dnn.group_norm(x, 2), lambda: torch.nn.functional.group_norm(xt, 2)),
             (lambda: dnn.add(x, -x), lambda: xt + (-xt))]
    with warnings.catch_warnings(), np.errstate(invalid="raise"):
        warnings.simplefilter("error")
        got = [f() for f, _ in cases]
    for g, (_, ref) in zip(got, cases):
        np.testing.assert_allclose(g, ref().numpy(), rtol=1e-12, atol=1e-12)
