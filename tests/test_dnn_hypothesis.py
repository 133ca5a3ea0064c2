"""Every blasx.dnn primitive against CPU torch by hypothesis: shapes, element types, layouts and the ops'
arguments are drawn within (and a little past) torch's legal ranges. Where torch raises, blasx must raise
too (a ValueError or TypeError naming the same parameter where the rule is known); elsewhere forward and
backward (against torch.autograd) must agree, and no input may be written.

Errors are relative Frobenius norms against torch in float64 on the same (rounded) inputs; tolerances per
dtype: float64 1e-12, float32 1e-5, float16 4e-3, bfloat16 3e-2. The examples are derandomized (the
profile below), so a run is reproducible; convolutions run on the CPU device and on two sims."""

from __future__ import annotations

import os

import math
import re
from contextlib import contextmanager

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import blasx
from blasx import dnn
from dnn_ref import cl, rel, wide

# derandomized: the same examples on every run and machine; the engine fixture holds no per-example state
settings.register_profile("blasx-dnn-hypothesis", derandomize=True, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                 HealthCheck.filter_too_much])
PROFILE = settings.get_profile("blasx-dnn-hypothesis")


SCALE = float(os.environ.get("BLASX_HYPOTHESIS_SCALE", "0.6"))  # examples per test: n x this (longer runs: > 1)


def examples(n: int):
    return settings(PROFILE, max_examples=max(10, round(n * SCALE)))


F64, F32, F16, BF16 = (np.dtype(t) for t in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16))
TOL = {F64: 1e-12, F32: 1e-5, F16: 4e-3, BF16: 3e-2}
TORCH = {F64: torch.float64, F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
NUMPY = {v: k for k, v in TORCH.items()}
ALL = st.sampled_from([F64, F64, F32, F16, BF16])  # float64 twice: the strict comparison is drawn most
MAX_ELEMS = 4000
NORMS = 4.0  # normalisations: 1/sqrt(var + eps) amplifies rounding (float32's most) where var is small

# torch's message -> the word blasx's message must hold (the parameter both name); the first match counts
SAME_PARAMETER = [
    (r"pad should be (at most|smaller than or equal to) half", "padding"),
    (r"output padding must be smaller", "output_padding"),
    (r"padding='same' is not supported for strided", "padding"),
    (r"num_groups", "num_groups"),
    (r"more than 1 value per channel", "more than 1 value"),
    (r"running_mean must be defined", "running_mean"),
    (r"Dimension out of range", "dim"),
    (r"Kernel size can't be greater than actual input size", "kernel size"),
    (r"Output size is too small", "output size"),
    (r"smaller than kernel size", "kernel_size"),
    (r"expected weight to be at least \d+ at dimension 0", "channel"),
    (r"non-empty .*weight tensor expected", "weight"),
    (r"start_dim cannot come after end_dim", "start_dim"),
    (r"dropout probability has to be between 0 and 1", "p"),
    (r"groups", "groups"),  # last: torch names groups in other messages too
]


@pytest.fixture(params=["cpu", "sim:2"])
def engine(request):
    """The engine's host (numpy) path or two sims; conftest puts the settings back after the test."""
    blasx.configure(devices=request.param, tile=16)
    return request.param


# ---------------------------------------------------------------- helpers

def rand(rng, shape, dtype, scale=1.0):
    return np.asarray(scale * rng.standard_normal(shape), dtype=dtype)


def layout_of(x, lay):
    return cl(x) if lay == "cl" else x


def close(got, ref, dtype, factor=1.0, floor=0.0):
    """got's relative error against ref is within ``factor`` times dtype's tolerance. ``floor``: the least
    denominator (an input's norm), for results that can cancel to near zero, where rounding noise the size
    of the input's is all there is (in torch's result too)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), floor, 1e-300)
    assert err <= factor * TOL[np.dtype(dtype)], f"relative error {err:.3g} (dtype {np.dtype(dtype).name})"


def norm(a) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64)))


def close_norm_grads(got, refs, dy, dtype, pdt, affine: bool) -> None:
    """A norm's (dx, dweight, dbias) against the references, relative to dy's size (they can cancel)."""
    scale = norm(dy)
    close(got[0], refs[0], dtype, floor=scale, factor=NORMS)
    if affine:
        close(got[1], refs[1], pdt, floor=scale, factor=NORMS)
        close(got[2], refs[2], pdt, floor=scale, factor=NORMS)


def _norm_backward(rng, dtype, lay, ref, tensors, inputs, pdt, affine, backward) -> None:
    """A batch or group norm's backward on a random dY (in ``lay``) against torch.autograd through ``ref``:
    ``backward(dY)`` returns (gx, gw, gb), leaving ``inputs`` and dY untouched."""
    dy = rand(rng, tuple(ref.shape), dtype)
    ref.backward(wide(dy))
    dyin = layout_of(dy, lay)
    with untouched(*inputs, dy, dyin):
        grads = backward(dyin)
    close_norm_grads(grads, [None if t is None else t.grad.numpy() for t in tensors], dy, dtype, pdt, affine)


@contextmanager
def untouched(*arrays):
    """The arrays hold the same values after the block as before it."""
    before = [None if a is None else np.array(a, copy=True) for a in arrays]
    yield
    for i, (a, b) in enumerate(zip(arrays, before)):
        if a is not None:
            assert np.asarray(a).tobytes() == b.tobytes(), f"input {i} was modified"


def torch_or_raises(torch_call, blasx_call, same_parameter=True):
    """torch's result; where torch raises, None after checking that blasx raises a ValueError or TypeError
    naming the same parameter (where the rule is in SAME_PARAMETER, and ``same_parameter``: not where two
    rules may break at once and the two check in another order)."""
    try:
        return torch_call()
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        event("torch raises")  # (--hypothesis-show-statistics: how many examples check errors only)
        with pytest.raises((ValueError, TypeError, IndexError)) as info:
            blasx_call()
        for pattern, word in SAME_PARAMETER if same_parameter else ():
            if re.search(pattern, str(exc)):
                assert word in str(info.value), (str(exc), str(info.value))
                break
        return None


def dims(lo, hi, nd):
    """An int or a tuple of nd ints in [lo, hi] (both spellings torch takes)."""
    return st.one_of(st.integers(lo, hi), st.tuples(*[st.integers(lo, hi)] * nd))


def per_dim(draw, lo, hi, nd):
    return draw(dims(lo, hi, nd))


def tup(v, nd):
    return (v,) * nd if isinstance(v, int) else tuple(v)


def grads(tf, inputs, dy):
    """torch's output and the gradients of ``inputs`` (float64 tensors tracking gradients) for ``dy``."""
    y = tf(*inputs)
    y.backward(wide(dy))
    return y.detach().numpy(), [None if t is None or t.grad is None else t.grad.numpy() for t in inputs]


def sizes(draw, nd, lo=1, hi=8):
    """nd sizes in [lo, hi], the upper half drawn more (fewer windows larger than the input)."""
    return tuple(draw(st.one_of(st.integers(lo, hi), st.integers((lo + hi) // 2, hi))) for _ in range(nd))


# ---------------------------------------------------------------- convolutions

@pytest.mark.filterwarnings("ignore:Using padding='same'")
@examples(150)
@given(data=st.data())
def test_conv(engine, data):
    """conv1d/2d/3d forward, conv*_input, conv*_weight and conv_bias_grad against torch.autograd."""
    d = data.draw
    nd = d(st.integers(1, 3), "nd")
    channels = st.one_of(st.integers(1, 3), st.integers(0, 3))  # 0: an empty weight, which torch rejects
    groups, cg, kg = d(st.integers(1, 3), "groups"), d(st.integers(1, 3), "cg"), d(channels, "kg")
    n = d(st.sampled_from([None, 0, 1, 2, 3]), "n")
    size = sizes(d, nd, 1, (12, 8, 5)[nd - 1])
    kernel = sizes(d, nd, 1, 4)
    stride, dilation = per_dim(d, 1, 3, nd), per_dim(d, 1, 2, nd)
    padding = d(st.one_of(st.integers(0, 3), st.tuples(*[st.integers(0, 3)] * nd), st.sampled_from(["same", "valid"])))
    dtype, lay = d(ALL, "dtype"), d(st.sampled_from(["nchw", "cl"]) if n else st.just("nchw"), "layout")
    has_bias = d(st.booleans(), "bias")
    xshape = ((n,) if n else ()) + (cg * groups, *size)
    assume(math.prod(xshape) <= MAX_ELEMS)
    rng = np.random.default_rng(d(st.integers(0, 2**16), "seed"))
    x, w = rand(rng, xshape, dtype), rand(rng, (kg * groups, cg, *kernel), dtype)
    b = rand(rng, (kg * groups,), dtype) if has_bias else None
    xin = layout_of(x, lay)
    args = (stride, padding, dilation, groups)
    bconv, tconv = getattr(dnn, f"conv{nd}d"), getattr(F, f"conv{nd}d")
    tx, tw, tb = wide(x, True), wide(w, True), (wide(b, True) if has_bias else None)
    ref = torch_or_raises(lambda: tconv(tx, tw, tb, *args), lambda: bconv(xin, w, b, *args), same_parameter=kg > 0)
    if ref is None:
        return
    with untouched(x, xin, w, b):
        y = bconv(xin, w, b, *args)
    close(y, ref.detach().numpy(), dtype)
    if isinstance(padding, str) or ref.numel() == 0:
        return  # torch.nn.grad's backward functions take numeric padding
    dy = rand(rng, tuple(ref.shape), dtype)
    ref.backward(wide(dy))
    dyin = layout_of(dy, lay)
    with untouched(x, xin, w, dy, dyin):
        gx = getattr(dnn, f"conv{nd}d_input")(x.shape, w, dyin, *args)
        gw = getattr(dnn, f"conv{nd}d_weight")(xin, w.shape, dyin, *args)
        gb = dnn.conv_bias_grad(dyin) if n else None
    close(gx, tx.grad.numpy(), dtype)
    close(gw, tw.grad.numpy(), dtype)
    if has_bias and n:
        close(gb, tb.grad.numpy(), dtype)


@examples(100)
@given(data=st.data())
def test_conv_transpose(engine, data):
    """conv_transpose1d/2d/3d forward (weight (in, out/groups, k...)) against torch."""
    d = data.draw
    nd = d(st.integers(1, 3), "nd")
    channels = st.one_of(st.integers(1, 3), st.integers(0, 3))  # 0: an empty weight, which torch rejects
    groups, cg, kg = d(st.integers(1, 3), "groups"), d(channels, "cg"), d(channels, "kg")
    n = d(st.sampled_from([None, 0, 1, 2]), "n")
    size = sizes(d, nd, 1, (9, 6, 4)[nd - 1])
    kernel = sizes(d, nd, 1, 3)
    stride, dilation = per_dim(d, 1, 3, nd), per_dim(d, 1, 2, nd)
    padding = per_dim(d, 0, 2, nd)
    output_padding = d(st.one_of(st.just(0), dims(0, 2, nd)), "output_padding")
    dtype, lay = d(ALL, "dtype"), d(st.sampled_from(["nchw", "cl"]) if n else st.just("nchw"), "layout")
    has_bias = d(st.booleans(), "bias")
    xshape = ((n,) if n else ()) + (cg * groups, *size)
    assume(math.prod(xshape) * kg * math.prod(tup(stride, nd)) <= MAX_ELEMS)
    rng = np.random.default_rng(d(st.integers(0, 2**16), "seed"))
    x, w = rand(rng, xshape, dtype), rand(rng, (cg * groups, kg, *kernel), dtype)
    b = rand(rng, (kg * groups,), dtype) if has_bias else None
    xin = layout_of(x, lay)
    args = (stride, padding, output_padding, groups, dilation)
    fb, ft = getattr(dnn, f"conv_transpose{nd}d"), getattr(F, f"conv_transpose{nd}d")
    ref = torch_or_raises(lambda: ft(wide(x), wide(w), None if b is None else wide(b), *args),
                          lambda: fb(xin, w, b, *args), same_parameter=cg * kg > 0)
    if ref is None:
        return
    with untouched(x, xin, w, b):
        y = fb(xin, w, b, *args)
    close(y, ref.numpy(), dtype)


@examples(40)
@given(data=st.data())
def test_linear(engine, data):
    d = data.draw
    lead = d(st.lists(st.integers(1, 4), max_size=3), "lead")
    fin, fout = d(st.integers(0, 12), "in"), d(st.integers(0, 12), "out")
    dtype, has_bias = d(ALL, "dtype"), d(st.booleans(), "bias")
    rng = np.random.default_rng(d(st.integers(0, 2**16), "seed"))
    x, w = rand(rng, (*lead, fin), dtype), rand(rng, (fout, fin), dtype)
    b = rand(rng, (fout,), dtype) if has_bias else None
    with untouched(x, w, b):
        y = dnn.linear(x, w, b)
    close(y, F.linear(wide(x), wide(w), None if b is None else wide(b)).numpy(), dtype)


# ---------------------------------------------------------------- normalisation

def _param_dtype(d, dtype):
    """Parameters have x's type or, for half x, float32 (as torch's mixed-precision norms)."""
    return d(st.sampled_from([dtype, F32]), "param dtype") if dtype in (F16, BF16) else dtype


@examples(120)
@given(data=st.data())
def test_batch_norm(data):
    """batch_norm forward (training or not, running statistics updated in place, momentum None with
    num_batches_tracked) and batch_norm_backward against torch.autograd."""
    d = data.draw
    n, c = d(st.integers(0, 4), "n"), d(st.integers(1, 5), "c")
    size = sizes(d, d(st.integers(0, 3), "spatial dims"), 1, 6)
    shape = (n, c, *size)
    assume(math.prod(shape) <= MAX_ELEMS)
    dtype = d(ALL, "dtype")
    pdt = _param_dtype(d, dtype)
    lay = d(st.sampled_from(["nchw", "cl"]) if len(shape) >= 3 else st.just("nchw"), "layout")
    training = d(st.booleans(), "training")
    running = d(st.booleans(), "running") if n else True  # torch skips every check for an empty batch
    momentum = d(st.one_of(st.none(), st.floats(0.0, 1.0)), "momentum")
    eps = d(st.floats(1e-5, 0.1), "eps")
    affine = d(st.booleans(), "affine")
    rng = np.random.default_rng(d(st.integers(0, 2**16), "seed"))
    x = rand(rng, shape, dtype, scale=2.0) + dtype.type(0.5)
    xin = layout_of(x, lay)
    rm = rand(rng, (c,), pdt) if running else None
    rv = rng.uniform(0.5, 2.0, c).astype(pdt) if running else None
    nbt = np.array([d(st.integers(0, 4), "num_batches_tracked")], np.int64) if momentum is None else None
    w, b = (rand(rng, (c,), pdt), rand(rng, (c,), pdt)) if affine else (None, None)
    trm, trv = (wide(rm), wide(rv)) if running else (None, None)
    factor = momentum if momentum is not None else 1.0 / (int(nbt[0]) + 1)
    tx, tw, tb = wide(x, True), (wide(w, True) if affine else None), (wide(b, True) if affine else None)

    def blasx_call():
        return dnn.batch_norm(xin, rm, rv, w, b, training, momentum, eps, num_batches_tracked=nbt,
                              return_stats=True)
    ref = torch_or_raises(lambda: F.batch_norm(tx, trm, trv, tw, tb, training, factor, eps), blasx_call)
    if ref is None:
        return
    rm0, rv0 = (rm.copy(), rv.copy()) if running else (None, None)
    with untouched(x, xin, w, b):
        y, mean, invstd = blasx_call()
    close(y, ref.detach().numpy(), dtype, floor=norm(x), factor=NORMS)
    if running:
        close(rm, trm.numpy(), pdt, floor=1.0)
        close(rv, trv.numpy(), pdt)
    if nbt is not None and running and training:
        assert nbt[0] == round(1 / factor)
    kw = dict(running_mean=rm0, running_var=rv0) if not training else {}
    _norm_backward(rng, dtype, lay, ref, (tx, tw, tb), (x, xin, w, mean, invstd), pdt, affine,
                   lambda dyin: dnn.batch_norm_backward(dyin, xin, w, mean, invstd, training, eps, **kw))


@examples(100)
@given(data=st.data())
def test_layer_norm(data):
    d = data.draw
    lead = d(st.lists(st.integers(0, 4), max_size=2), "lead")
    normalized = d(st.lists(st.integers(1, 6), min_size=1, max_size=3), "normalized_shape")
    shape = (*lead, *normalized)
    assume(math.prod(shape) <= MAX_ELEMS)
    dtype = d(ALL, "dtype")
    pdt = _param_dtype(d, dtype)
    eps, affine = d(st.floats(1e-5, 0.1), "eps"), d(st.booleans(), "affine")
    ns = normalized[0] if len(normalized) == 1 and d(st.booleans(), "int shape") else tuple(normalized)
    rng = np.random.default_rng(d(st.integers(0, 2**16), "seed"))
    x = rand(rng, shape, dtype)
    w, b = (rand(rng, normalized, pdt), rand(rng, normalized, pdt)) if affine else (None, None)
    tx, tw, tb = wide(x, True), (wide(w, True) if affine else None), (wide(b, True) if affine else None)
    dy = rand(rng, shape, dtype)
    with untouched(x, w, b):
        y, mean, rstd = dnn.layer_norm(x, ns, w, b, eps, return_stats=True)
    ref, (gx_ref, gw_ref, gb_ref) = grads(lambda *t: F.layer_norm(t[0], tup(ns, 1), *t[1:], eps), [tx, tw, tb], dy)
    close(y, ref, dtype, floor=norm(x), factor=NORMS)
    with untouched(x, w, dy, mean, rstd):
        gx, gw, gb = dnn.layer_norm_backward(dy, x, ns, w, mean, rstd)
    close_norm_grads((gx, gw, gb), (gx_ref, gw_ref, gb_ref), dy, dtype, pdt, affine)


@examples(100)
@given(data=st.data())
def test_group_norm(data):
    d = data.draw
    n, c = d(st.integers(0, 3), "n"), d(st.integers(1, 8), "c")
    num_groups = d(st.one_of(st.sampled_from([g for g in range(1, c + 1) if c % g == 0]), st.integers(1, 8)),
                   "num_groups")
    size = sizes(d, d(st.integers(0, 3), "spatial dims"), 1, 6)
    shape = (n, c, *size)
    assume(math.prod(shape) <= MAX_ELEMS)
    dtype = d(ALL, "dtype")
    pdt = _param_dtype(d, dtype)
    lay = d(st.sampled_from(["nchw", "cl"]) if len(shape) >= 3 else st.just("nchw"), "layout")
    eps, affine = d(st.floats(1e-5, 0.1), "eps"), d(st.booleans(), "affine")
    rng = np.random.default_rng(d(st.integers(0, 2**16), "seed"))
    x = rand(rng, shape, dtype)
    xin = layout_of(x, lay)
    w, b = (rand(rng, (c,), pdt), rand(rng, (c,), pdt)) if affine else (None, None)
    tx, tw, tb = wide(x, True), (wide(w, True) if affine else None), (wide(b, True) if affine else None)
    ref = torch_or_raises(lambda: F.group_norm(tx, num_groups, tw, tb, eps),
                          lambda: dnn.group_norm(xin, num_groups, w, b, eps))
    if ref is None:
        return
    with untouched(x, xin, w, b):
        y, mean, rstd = dnn.group_norm(xin, num_groups, w, b, eps, return_stats=True)
    close(y, ref.detach().numpy(), dtype, floor=norm(x), factor=NORMS)
    _norm_backward(rng, dtype, lay, ref, (tx, tw, tb), (x, xin, w, mean, rstd), pdt, affine,
                   lambda dyin: dnn.group_norm_backward(dyin, xin, num_groups, w, mean, rstd))


@examples(80)
@given(data=st.data())
def test_local_response_norm(data):
    d = data.draw
    n, c = d(st.integers(0, 3), "n"), d(st.integers(1, 8), "c")
    size = sizes(d, d(st.integers(1, 3), "spatial dims"), 1, 6)
    shape = (n, c, *size)
    assume(math.prod(shape) <= MAX_ELEMS)
    dtype = d(ALL, "dtype")
    lay = d(st.sampled_from(["nchw", "cl"]), "layout")
    window = d(st.integers(1, c + 2), "size")
    alpha, beta, k = d(st.floats(1e-4, 1.0), "alpha"), d(st.floats(0.1, 1.5), "beta"), d(st.floats(0.5, 2.0), "k")
    rng = np.random.default_rng(d(st.integers(0, 2**16), "seed"))
    x, dy = rand(rng, shape, dtype), rand(rng, shape, dtype)
    xin, dyin = layout_of(x, lay), layout_of(dy, lay)
    tx = wide(x, True)
    ref, (gx_ref,) = grads(lambda t: F.local_response_norm(t, window, alpha, beta, k), [tx], dy)
    with untouched(x, xin, dy, dyin):
        y = dnn.local_response_norm(xin, window, alpha, beta, k)
        gx = dnn.local_response_norm_backward(dyin, xin, window, alpha, beta, k)
    close(y, ref, dtype)
    close(gx, gx_ref, dtype, floor=norm(dy), factor=NORMS)


# ---------------------------------------------------------------- pools

def _pool_input(d, nd, rng):
    n = d(st.sampled_from([None, 0, 1, 2]), "n")
    c = d(st.integers(1, 4), "c")
    size = sizes(d, nd, 1, (14, 9, 6)[nd - 1])
    shape = ((n,) if n else ()) + (c, *size)
    assume(math.prod(shape) <= MAX_ELEMS)
    dtype = d(ALL, "dtype")
    lay = d(st.sampled_from(["nchw", "cl"]) if n else st.just("nchw"), "layout")
    x = rand(rng, shape, dtype)
    return x, layout_of(x, lay), lay, dtype


def _window_pool_case(d):
    """(nd, rng, x, x in its layout, layout, dtype, kernel, stride, padding) of a max or average pool case."""
    nd = d(st.integers(1, 3), "nd")
    rng = np.random.default_rng(d(st.integers(0, 2**16), "seed"))
    x, xin, lay, dtype = _pool_input(d, nd, rng)
    kernel = per_dim(d, 1, 4, nd)
    stride = d(st.one_of(st.none(), st.integers(1, 3), st.tuples(*[st.integers(1, 3)] * nd)), "stride")
    return nd, rng, x, xin, lay, dtype, kernel, stride, d(st.one_of(dims(0, 1, nd), dims(0, 2, nd)), "padding")


@examples(150)
@given(data=st.data())
def test_max_pool(data):
    """max_pool1d/2d/3d values and indices (exact) and max_pool*_backward against torch.autograd."""
    d = data.draw
    nd, rng, x, xin, lay, dtype, kernel, stride, padding = _window_pool_case(d)
    dilation, ceil_mode = per_dim(d, 1, 2, nd), d(st.booleans(), "ceil_mode")
    args = (kernel, stride, padding, dilation, ceil_mode)
    fb, ft = getattr(dnn, f"max_pool{nd}d"), getattr(F, f"max_pool{nd}d")
    tx = wide(x, True)
    ref = torch_or_raises(lambda: ft(tx, *args, return_indices=True), lambda: fb(xin, *args, True))
    if ref is None:
        return
    with untouched(x, xin):
        y, idx = fb(xin, *args, True)
    assert np.array_equal(np.asarray(y, np.float64), ref[0].detach().numpy())
    assert np.array_equal(idx, ref[1].numpy())
    dy = rand(rng, tuple(y.shape), dtype)
    dyin = layout_of(dy, lay) if y.ndim == nd + 2 else dy
    back = getattr(dnn, f"max_pool{nd}d_backward")
    # a window wholly in the padding (dilation with ceil_mode): -inf at an index past the plane, in torch and
    # blasx alike; blasx's backward drops its gradient, torch's writes it past the plane (compared zeroed)
    empty = idx >= math.prod(x.shape[-nd:])
    ref[0].backward(wide(np.where(empty, 0, dy) if empty.any() else dy))
    with untouched(x, xin, dy, dyin, idx):
        gx = back(dyin, xin, idx, *args)
    close(gx, tx.grad.numpy(), dtype)


@examples(150)
@given(data=st.data())
def test_avg_pool(data):
    """avg_pool1d/2d/3d (ceil_mode, count_include_pad, divisor_override) and avg_pool*_backward."""
    d = data.draw
    nd, rng, x, xin, lay, dtype, kernel, stride, padding = _window_pool_case(d)
    ceil_mode, count_include_pad = d(st.booleans(), "ceil_mode"), d(st.booleans(), "count_include_pad")
    args = (kernel, stride, padding, ceil_mode, count_include_pad)
    if nd > 1:
        args += (d(st.one_of(st.none(), st.integers(1, 5)), "divisor_override"),)
    fb, ft = getattr(dnn, f"avg_pool{nd}d"), getattr(F, f"avg_pool{nd}d")
    tx = wide(x, True)
    ref = torch_or_raises(lambda: ft(tx, *args), lambda: fb(xin, *args))
    if ref is None:
        return
    with untouched(x, xin):
        y = fb(xin, *args)
    close(y, ref.detach().numpy(), dtype)
    dy = rand(rng, tuple(y.shape), dtype)
    ref.backward(wide(dy))
    dyin = layout_of(dy, lay) if y.ndim == nd + 2 else dy
    with untouched(x, xin, dy, dyin):
        gx = getattr(dnn, f"avg_pool{nd}d_backward")(dyin, xin, *args)
    close(gx, tx.grad.numpy(), dtype)


@examples(120)
@given(data=st.data())
def test_adaptive_pool(data):
    """adaptive_avg/max_pool1d/2d/3d (output sizes smaller, larger, None) and their backward passes."""
    d = data.draw
    nd, reduce = d(st.integers(1, 3), "nd"), d(st.sampled_from(["avg", "max"]), "reduce")
    rng = np.random.default_rng(d(st.integers(0, 2**16), "seed"))
    x, xin, lay, dtype = _pool_input(d, nd, rng)
    space = x.shape[-nd:]
    outs = [d(st.one_of(st.integers(1, s + 2), st.none()) if nd > 1 else st.integers(1, s + 2), "output_size")
            for s in space]
    output_size = outs[0] if nd == 1 else tuple(outs)
    name = f"adaptive_{reduce}_pool{nd}d"
    fb, ft = getattr(dnn, name), getattr(F, name)
    tx = wide(x, True)
    with untouched(x, xin):
        if reduce == "max":
            y, idx = fb(xin, output_size, True)
        else:
            y, idx = fb(xin, output_size), None
    ref = ft(tx, output_size, return_indices=True) if reduce == "max" else ft(tx, output_size)
    if reduce == "max":
        assert np.array_equal(np.asarray(y, np.float64), ref[0].detach().numpy())
        assert np.array_equal(idx, ref[1].numpy())
        ref = ref[0]
    else:
        close(y, ref.detach().numpy(), dtype)
    dy = rand(rng, tuple(y.shape), dtype)
    ref.backward(wide(dy))
    dyin = layout_of(dy, lay) if y.ndim == nd + 2 else dy
    with untouched(x, xin, dy, dyin, idx):
        back = getattr(dnn, name + "_backward")
        gx = back(dyin, xin, idx) if reduce == "max" else back(dyin, xin)
    close(gx, tx.grad.numpy(), dtype)


# ---------------------------------------------------------------- pointwise

# name -> (torch forward of (x, param), the parameter's name and strategy, backward reads "input"/"output")
ACTIVATIONS = {
    "relu": (lambda t, p: F.relu(t), None, "output"),
    "relu6": (lambda t, p: F.relu6(t), None, "input"),
    "leaky_relu": (lambda t, p: F.leaky_relu(t, p), ("negative_slope", st.floats(-2.0, 2.0)), "input"),
    "elu": (lambda t, p: F.elu(t, p), ("alpha", st.floats(0.0, 3.0)), "input"),
    "gelu": (lambda t, p: F.gelu(t, approximate=p), ("approximate", st.sampled_from(["none", "tanh"])), "input"),
    "silu": (lambda t, p: F.silu(t), None, "input"),
    "sigmoid": (lambda t, p: torch.sigmoid(t), None, "output"),
    "tanh": (lambda t, p: torch.tanh(t), None, "output"),
    "hardswish": (lambda t, p: F.hardswish(t), None, "input"),
    "hardsigmoid": (lambda t, p: F.hardsigmoid(t), None, "input"),
}


OUTPUT_BACKWARD = {"relu": lambda g, y: torch.ops.aten.threshold_backward(g, y, 0),
                   "sigmoid": torch.ops.aten.sigmoid_backward, "tanh": torch.ops.aten.tanh_backward}


def _any_layout(d, x):
    """x C-contiguous, channels-last, transposed or strided (a view of a larger array)."""
    lay = d(st.sampled_from(["c", "cl", "transposed", "strided"] if x.ndim >= 3 else ["c", "transposed"]), "layout")
    if lay == "cl":
        return cl(x)
    if lay == "transposed":
        return x.T.copy().T
    if lay == "strided":
        big = np.zeros((*x.shape[:-1], 2 * x.shape[-1]), x.dtype)
        big[..., ::2] = x
        return big[..., ::2]
    return x


@examples(200)
@given(data=st.data())
def test_activation(data):
    """Each activation (with its parameter) and its *_backward against torch.autograd, on inputs that
    reach the kinks (0, +-3, 6) in every dtype."""
    d = data.draw
    name = d(st.sampled_from(sorted(ACTIVATIONS)), "activation")
    tf, param, saves = ACTIVATIONS[name]
    p = d(param[1], param[0]) if param else None
    shape = d(st.lists(st.integers(1, 7), max_size=4), "shape")
    dtype = d(ALL, "dtype")
    rng = np.random.default_rng(d(st.integers(0, 2**16), "seed"))
    x = rand(rng, shape, dtype, scale=d(st.sampled_from([1.0, 4.0]), "scale"))
    if x.size and d(st.booleans(), "kinks"):  # the points where the derivative's convention matters
        flat = x.reshape(-1)
        flat[rng.integers(0, x.size, min(x.size, 6))] = rng.choice([0.0, -3.0, 3.0, 6.0], min(x.size, 6))
    xin = _any_layout(d, x)
    dy = rand(rng, shape, dtype)
    tx = wide(x, True)
    ref, (gx_ref,) = grads(lambda t: tf(t, p), [tx], dy)
    kw = {param[0]: p} if param else {}
    with untouched(x, xin, dy):
        y = getattr(dnn, name)(xin, **kw)
        saved = y if saves == "output" else xin
        gx = getattr(dnn, name + "_backward")(dy, saved, **kw)
    if saves == "output":  # the gradient of the rounded output: torch's backward formula on that
        gx_ref = OUTPUT_BACKWARD[name](wide(dy), wide(y)).numpy()
    close(y, ref, dtype, floor=norm(x))  # (tiny results: gelu's erf form cancels, leaky_relu underflows)
    # torch's hardsigmoid_backward multiplies by a float32 1/6 in every dtype (relative error 3e-8)
    close(gx, gx_ref, dtype, factor=max(1.0, 1e-7 / TOL[dtype]) if name == "hardsigmoid" else 1.0,
          floor=norm(dy))
    # in place: the input itself is written and returned
    if name not in ("gelu", "sigmoid", "tanh"):
        z = np.array(xin, copy=True)
        assert getattr(dnn, name)(z, inplace=True, **kw) is z
        close(z, ref, dtype, floor=norm(x))


@examples(120)
@given(data=st.data())
def test_softmax(data):
    """softmax and log_softmax along any dim (dtype= too) and their backward passes."""
    d = data.draw
    log = d(st.booleans(), "log")
    shape = d(st.lists(st.integers(1, 7), max_size=4), "shape")
    nd = max(len(shape), 1)
    dim = d(st.integers(-nd - 1, nd), "dim")  # one out of range either side
    dtype = d(ALL, "dtype")
    to = d(st.sampled_from([None, F32, F64]), "dtype=")
    rng = np.random.default_rng(d(st.integers(0, 2**16), "seed"))
    x = rand(rng, shape, dtype, scale=d(st.sampled_from([1.0, 10.0]), "scale"))
    fb, ft = (dnn.log_softmax, F.log_softmax) if log else (dnn.softmax, F.softmax)
    out_dt = dtype if to is None else to
    xc = x.astype(out_dt)  # dtype= casts the input first, in torch too
    ref = torch_or_raises(lambda: ft(wide(xc), dim), lambda: fb(x, dim, to))
    if ref is None:
        return
    with untouched(x):
        y = fb(x, dim, to)
    assert y.dtype == out_dt
    close(y, ref.numpy(), out_dt, floor=norm(xc) if log else 0.0)  # (log: near 0 where one entry dominates)
    dy = rand(rng, shape, out_dt)
    back = dnn.log_softmax_backward if log else dnn.softmax_backward
    with untouched(dy, y):
        gx = back(dy, y, dim, input_dtype=dtype)
    assert gx.dtype == dtype
    # the gradient of the rounded output: torch's backward kernel on that output (its autograd saves it)
    tback = torch.ops.aten._log_softmax_backward_data if log else torch.ops.aten._softmax_backward_data
    gx_ref = tback(wide(dy), wide(y), dim, torch.float64).numpy()
    close(gx, gx_ref, max(out_dt, dtype, key=TOL.get), floor=norm(dy))


@examples(60)
@given(data=st.data())
def test_dropout(data):
    """dropout's result is torch's ``x * mask / (1 - p)`` for the mask it returns (identity without
    training or at p = 0, zeros at p = 1); dropout_backward against torch.autograd of the same."""
    d = data.draw
    shape = d(st.lists(st.integers(1, 9), max_size=4), "shape")
    dtype = d(ALL, "dtype")
    p = d(st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 1.0, -0.1, 1.1])), "p")
    training, seed = d(st.booleans(), "training"), d(st.integers(0, 2**16), "seed")
    rng = np.random.default_rng(seed)
    x = rand(rng, shape, dtype)
    ref = torch_or_raises(lambda: F.dropout(wide(x), p, training), lambda: dnn.dropout(x, p, training, seed=seed))
    if ref is None:
        return
    with untouched(x):
        y, mask = dnn.dropout(x, p, training, seed=seed, return_mask=True)
    assert mask.dtype == np.bool_ and mask.shape == x.shape
    tx = wide(x, True)
    keep = torch.from_numpy(np.asarray(mask)).to(torch.float64)
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    expected = (tx * keep * scale) if training and p > 0 else tx * 1.0
    close(y, expected.detach().numpy(), dtype)
    if not training or p == 0:
        assert mask.all()
    dy = rand(rng, shape, dtype)
    expected.backward(wide(dy))
    with untouched(dy, mask):
        gx = dnn.dropout_backward(dy, mask, p, training)
    close(gx, tx.grad.numpy(), dtype)


# ---------------------------------------------------------------- tensors

def _broadcast_operand(d, shape, label):
    """A shape that broadcasts to ``shape``: a suffix of it with some sizes made 1."""
    k = d(st.integers(0, len(shape)), f"{label} rank")
    tail = shape[len(shape) - k:]
    return tuple(1 if d(st.booleans(), f"{label} ones") else s for s in tail)


@examples(120)
@given(data=st.data())
def test_add(data):
    """add (broadcasting, alpha, a scalar other, mixed types promoted as torch) and add_backward."""
    d = data.draw
    shape = tuple(d(st.lists(st.integers(1, 6), max_size=4), "shape"))
    ashape, bshape = _broadcast_operand(d, shape, "input"), _broadcast_operand(d, shape, "other")
    adt, bdt = d(ALL, "input dtype"), d(ALL, "other dtype")
    scalar = d(st.booleans(), "scalar other")
    alpha = d(st.sampled_from([1, -1, 0.5, 2.0, 0]), "alpha")
    rng = np.random.default_rng(d(st.integers(0, 2**16), "seed"))
    a = rand(rng, ashape, adt)
    b = float(rng.standard_normal()) if scalar else rand(rng, bshape, bdt)
    ta, tb = wide(a, True), (b if scalar else wide(b, True))
    with untouched(a, None if scalar else b):
        y = dnn.add(a, b, alpha=alpha)
    want_dt = adt if scalar else NUMPY[torch.result_type(torch.empty(ashape, dtype=TORCH[adt]),  # (0-d: no promotion)
                                                         torch.empty(bshape, dtype=TORCH[bdt]))]
    assert y.dtype == want_dt, (y.dtype, want_dt)
    ref = torch.add(ta, tb, alpha=alpha)
    close(y, ref.detach().numpy(), want_dt)
    dy = rand(rng, tuple(ref.shape), want_dt)
    ref.backward(wide(dy))
    ga, gb = dnn.add_backward(dy, ashape, None if scalar else bshape, alpha,
                              input_dtype=adt, other_dtype=None if scalar else bdt)
    assert ga.dtype == adt and ga.shape == ashape
    close(ga, ta.grad.numpy(), max(want_dt, adt, key=TOL.get))
    if not scalar:
        assert gb.dtype == bdt and gb.shape == bshape
        close(gb, tb.grad.numpy(), max(want_dt, bdt, key=TOL.get))


@examples(80)
@given(data=st.data())
def test_cat(data):
    """cat along any dim (mixed types, channels-last inputs, legacy empty 1-D inputs) and cat_backward."""
    d = data.draw
    base = d(st.lists(st.integers(1, 5), min_size=1, max_size=5), "shape")
    dim = d(st.integers(-len(base), len(base) - 1), "dim")
    count = d(st.integers(1, 4), "count")
    lens = [d(st.integers(0, 4), "length") for _ in range(count)]
    dts = [d(ALL, "dtype") for _ in range(count)]
    lay = d(st.sampled_from(["c", "cl"]) if len(base) in (4, 5) else st.just("c"), "layout")
    empty_1d = d(st.booleans(), "an empty 1-D input")
    rng = np.random.default_rng(d(st.integers(0, 2**16), "seed"))
    arrays = []
    for n_, dt in zip(lens, dts):
        s = list(base)
        s[dim] = n_
        arrays.append(layout_of(rand(rng, s, dt), "cl" if lay == "cl" else "nchw"))
    if empty_1d:
        arrays.insert(d(st.integers(0, len(arrays)), "where"), np.zeros((0,), dts[0]))
    with untouched(*arrays):
        y = dnn.cat(arrays, dim)
    ts = [wide(a, True) for a in arrays]
    ref = torch.cat(ts, dim)
    close(y, ref.detach().numpy(), y.dtype)
    dy = rand(rng, tuple(ref.shape), y.dtype)
    ref.backward(wide(dy))
    kept = [a for a in arrays if not (a.ndim == 1 and a.shape[0] == 0)]
    gs = dnn.cat_backward(dy, [a.shape[dim] for a in kept], dim, dtypes=[a.dtype for a in kept])
    for g, a, t in zip(gs, kept, [t for t, a in zip(ts, arrays) if not (a.ndim == 1 and a.shape[0] == 0)]):
        assert g.dtype == a.dtype and g.shape == a.shape
        close(g, t.grad.numpy(), max(np.dtype(a.dtype), np.dtype(y.dtype), key=TOL.get))


@examples(80)
@given(data=st.data())
def test_flatten(data):
    d = data.draw
    shape = d(st.lists(st.integers(1, 5), max_size=5), "shape")
    nd = max(len(shape), 1)
    start, end = d(st.integers(-nd, nd - 1), "start_dim"), d(st.integers(-nd, nd - 1), "end_dim")
    dtype = d(ALL, "dtype")
    rng = np.random.default_rng(d(st.integers(0, 2**16), "seed"))
    x = _any_layout(d, rand(rng, shape, dtype))
    tx = wide(x, True)
    ref = torch_or_raises(lambda: torch.flatten(tx, start, end), lambda: dnn.flatten(x, start, end))
    if ref is None:
        return
    with untouched(x):
        y = dnn.flatten(x, start, end)
    assert y.shape == tuple(ref.shape)
    assert np.asarray(y, np.float64).tobytes() == ref.detach().numpy().tobytes()
    dy = rand(rng, tuple(ref.shape), dtype)
    gx = dnn.flatten_backward(dy, x.shape)
    assert gx.shape == x.shape and np.array_equal(np.asarray(gx, np.float64).reshape(-1),
                                                  np.asarray(dy, np.float64).reshape(-1))


# ---------------------------------------------------------------- inputs are never written

@examples(25)
@given(data=st.data())
def test_inputs_never_modified(engine, data):
    """One drawn channels-last batch through every family's forward and backward: no input changes
    (the per-family tests check theirs too; this one holds them all side by side)."""
    d = data.draw
    dtype = d(ALL, "dtype")
    n, c, h, w_ = d(st.integers(1, 2)), d(st.integers(2, 4)), d(st.integers(3, 7)), d(st.integers(3, 7))
    rng = np.random.default_rng(d(st.integers(0, 2**16), "seed"))
    x = cl(rand(rng, (n, c, h, w_), dtype))
    wt, dyc = rand(rng, (c, 1, 3, 3), dtype), cl(rand(rng, (n, c, h, w_), dtype))
    g = cl(rand(rng, (n, c, h, w_), dtype))
    vec = rand(rng, (c,), dtype)
    before = {k: v.copy() for k, v in dict(x=x, wt=wt, dyc=dyc, g=g, vec=vec).items()}
    _, mi = dnn.max_pool2d(x, 2, 1, 0, 1, False, True)
    calls = [
        lambda: dnn.conv2d(x, wt, vec, 1, 1, 1, c), lambda: dnn.conv2d_input(x.shape, wt, dyc, 1, 1, 1, c),
        lambda: dnn.conv2d_weight(x, wt.shape, dyc, 1, 1, 1, c), lambda: dnn.conv_bias_grad(dyc),
        lambda: dnn.conv_transpose2d(x, wt, vec, 1, 1, 0, c),
        lambda: dnn.batch_norm(x, None, None, vec, vec, True, return_stats=True),
        lambda: dnn.group_norm(x, 1, vec, vec), lambda: dnn.layer_norm(x, (h, w_)),
        lambda: dnn.local_response_norm(x, 3), lambda: dnn.local_response_norm_backward(g, x, 3),
        lambda: dnn.max_pool2d_backward(g[:, :, :h - 1, :w_ - 1], x, mi, 2, 1),
        lambda: dnn.avg_pool2d(x, 2, 1), lambda: dnn.adaptive_max_pool2d(x, 2),
        lambda: dnn.softmax(x, 1), lambda: dnn.softmax_backward(g, x, 1), lambda: dnn.log_softmax(x, -1),
        lambda: dnn.gelu(x), lambda: dnn.gelu_backward(g, x), lambda: dnn.leaky_relu(x, 0.2),
        lambda: dnn.dropout(x, 0.5, seed=1), lambda: dnn.add(x, g, alpha=2), lambda: dnn.cat([x, g], 1),
        lambda: dnn.flatten(x, 1),
    ]
    for call in calls:
        call()
    for k, v in dict(x=x, wt=wt, dyc=dyc, g=g, vec=vec).items():
        assert v.tobytes() == before[k].tobytes(), k


# ---------------------------------------------------------------- regressions (found by the tests above)

def test_group_norm_rejects_one_value_per_group_as_torch():
    """F.group_norm raises where N * C // num_groups * spatial size is 1 (before the divisibility check);
    blasx accepted it."""
    for shape, g in [((1, 1), 1), ((1, 2), 2), ((1, 3, 1), 2), ((1, 2, 1, 1), 2)]:
        with pytest.raises(ValueError, match="more than 1 value"):
            F.group_norm(torch.zeros(shape), g)
        with pytest.raises(ValueError, match="more than 1 value"):
            dnn.group_norm(np.zeros(shape), g)
    for shape, g in [((2, 2), 2), ((1, 4), 2)]:  # torch takes these
        x = np.random.default_rng(0).standard_normal(shape)
        assert rel(dnn.group_norm(x, g), F.group_norm(wide(x), g).numpy()) < 1e-12


def test_avg_pool3d_rejects_input_smaller_than_kernel_as_torch():
    """torch's avg_pool3d (forward and backward; not the 1-D/2-D ones) rejects an input smaller than the
    kernel even where padding makes the output non-empty; blasx returned a result."""
    x = np.zeros((1, 1, 1, 3, 3))
    with pytest.raises(RuntimeError, match="smaller than kernel size"):
        F.avg_pool3d(torch.from_numpy(x), 2, 1, (1, 0, 0))
    with pytest.raises(ValueError, match="kernel_size"):
        dnn.avg_pool3d(x, 2, 1, (1, 0, 0))
    with pytest.raises(ValueError, match="kernel_size"):
        dnn.avg_pool3d_backward(np.zeros((1, 1, 2, 2, 2)), x.shape, 2, 1, (1, 0, 0))
    assert dnn.avg_pool2d(x[0], 2, 1, (1, 0)).shape == F.avg_pool2d(torch.from_numpy(x[0]), 2, 1, (1, 0)).shape


def test_conv_rejects_zero_channels():
    """A convolution of x without channels or with a weight without output channels: torch raises (but
    for conv*d's x without channels, where it returns an empty (N, 0, ...) result); blasx returned an
    unwritten (uninitialised) output."""
    z, o = np.zeros, np.ones
    for call in (lambda: dnn.conv1d(z((1, 0, 5)), o((3, 0, 1)), o(3)), lambda: dnn.conv2d(z((1, 2, 5, 5)), o((0, 2, 3, 3))),
                 lambda: dnn.conv_transpose2d(z((1, 0, 3, 3)), o((0, 2, 3, 3))),
                 lambda: dnn.conv_transpose2d(z((1, 2, 3, 3)), o((2, 0, 3, 3))),
                 lambda: dnn.conv2d_weight(z((1, 2, 5, 5)), (0, 2, 3, 3), z((1, 0, 3, 3))),
                 lambda: dnn.conv2d_input((1, 2, 5, 5), o((0, 2, 3, 3)), z((1, 0, 3, 3)))):
        with pytest.raises(ValueError, match="channel"):
            call()


def test_linear_zero_features_as_torch():
    """linear with no input features is bias (then the activation), with no output features empty, as
    torch's; blasx raised numpy's reshape error for the first."""
    rng = np.random.default_rng(0)
    b = rng.standard_normal(3)
    y = dnn.linear(np.zeros((2, 0)), np.zeros((3, 0)), b, activation="relu")
    assert rel(y, F.relu(F.linear(wide(np.zeros((2, 0))), wide(np.zeros((3, 0))), wide(b))).numpy()) == 0
    assert dnn.linear(np.zeros((4, 0)), np.zeros((3, 0))).shape == (4, 3)
    assert dnn.linear(rng.standard_normal((2, 5, 4)), np.zeros((0, 4))).shape == (2, 5, 0)


def test_batch_norm_counts_an_empty_training_batch_as_torch():
    """torch's BatchNorm increments num_batches_tracked on an empty training batch too (updating no
    statistic); blasx did not."""
    nbt, rm, rv = np.zeros(1, np.int64), np.zeros(2), np.ones(2)
    mod = torch.nn.BatchNorm2d(2, momentum=None).double().train()
    for x in (np.zeros((0, 2, 3, 3)), np.random.default_rng(0).standard_normal((2, 2, 3, 3))):
        dnn.batch_norm(x, rm, rv, training=True, momentum=None, num_batches_tracked=nbt)
        mod(torch.from_numpy(x))
        assert int(nbt[0]) == int(mod.num_batches_tracked)
    assert rel(rm, mod.running_mean) < 1e-12 and rel(rv, mod.running_var) < 1e-12


def test_dropout_mask_of_a_0d_input_is_an_array():
    """dropout of a 0-d input returned numpy's bool scalar as the mask, which dropout_backward rejects."""
    y, mask = dnn.dropout(np.array(2.0), 0.5, seed=3, return_mask=True)
    assert isinstance(mask, np.ndarray) and mask.shape == () and mask.dtype == np.bool_
    assert dnn.dropout_backward(np.array(1.0), mask, 0.5) == (2.0 if mask else 0.0)
