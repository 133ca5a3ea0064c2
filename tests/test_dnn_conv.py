"""blasx.dnn against CPU torch: forward (1-3 d, groups, depthwise, stride, padding incl. asymmetric and
"same", dilation), transposed, backward-data, backward-weights, both layouts, dtypes, the fused epilogue,
out=, on 1-3 sims and the CPU, and a batch larger than the sims' memory.

Errors are relative Frobenius norms against torch in float64 on the same (rounded) inputs; tolerances per
dtype: float64 1e-12, float32 1e-5, float16 4e-3, bfloat16 3e-2 (float32 accumulation; the result rounded
once)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import grad as tgrad

import blasx
from blasx import dnn
from blasx.dnn import geometry
from dnn_ref import cl, rel, wide

TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5, np.dtype(np.float16): 4e-3,
       np.dtype(ml_dtypes.bfloat16): 3e-2}
T = torch.from_numpy


def rand(rng, shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


@pytest.fixture(params=["sim:1", "sim:3", "cpu"])
def devices(request):
    blasx.configure(devices=request.param, tile=16)
    return request.param


# ---------------------------------------------------------------- forward

@settings(max_examples=20, deadline=None)
@given(nd=st.sampled_from([1, 2, 3]), n=st.integers(1, 3), cg=st.integers(1, 3), kg=st.integers(1, 3),
       groups=st.sampled_from([1, 2, 3]), k=st.integers(1, 3), stride=st.integers(1, 3), pad=st.integers(0, 2),
       dil=st.integers(1, 2), layout=st.sampled_from(["nchw", "cl"]), seed=st.integers(0, 99))
def test_forward_vs_torch(nd, n, cg, kg, groups, k, stride, pad, dil, layout, seed):
    blasx.configure(devices="sim:2", tile=16)
    rng = np.random.default_rng(seed)
    size = (9, 7, 5)[:nd]
    if any(s + 2 * pad < dil * (k - 1) + 1 for s in size):
        return
    x = rand(rng, (n, cg * groups, *size))
    w = rand(rng, (kg * groups, cg, *(k,) * nd))
    b = rand(rng, (kg * groups,))
    xin = cl(x) if layout == "cl" else x
    y = getattr(dnn, f"conv{nd}d")(xin, w, b, stride, pad, dil, groups)
    ref = getattr(F, f"conv{nd}d")(T(x), T(w), T(b), stride, pad, dil, groups).numpy()
    assert rel(y, ref) < 1e-12
    kept = np.moveaxis(y, 1, -1) if geometry.layout(xin) == "cl" else y  # (C = 1: both layouts; NCHW wins)
    assert kept.flags.c_contiguous


def test_forward_devices_paddings_depthwise(devices):
    rng = np.random.default_rng(3)
    x = rand(rng, (2, 6, 13, 10))
    cases = [dict(padding="same", dilation=2), dict(padding="valid", stride=2), dict(padding=((2, 0), (1, 3))),
             dict(padding=(1, 0), stride=(1, 2), groups=3), dict(padding=1, groups=6)]  # depthwise last
    for kw in cases:
        g = kw.get("groups", 1)
        w = rand(rng, ({1: 4, 3: 6, 6: 6}[g], 6 // g, 3, 2))
        y = dnn.conv2d(x, w, **kw)
        pads = kw.get("padding")
        if isinstance(pads, tuple) and isinstance(pads[0], tuple):
            xt = F.pad(T(x), (pads[1][0], pads[1][1], pads[0][0], pads[0][1]))
            ref = F.conv2d(xt, T(w), **{k: v for k, v in kw.items() if k != "padding"})
        else:
            ref = F.conv2d(T(x), T(w), **kw)
        assert rel(y, ref.numpy()) < 1e-12, kw


def test_unbatched_out_and_layout_kept():
    blasx.configure(devices="sim:2", tile=16)
    rng = np.random.default_rng(4)
    x, w = rand(rng, (3, 11, 9)), rand(rng, (5, 3, 3, 3))
    y = dnn.conv2d(x, w, padding=1)
    assert y.shape == (5, 11, 9) and rel(y, F.conv2d(T(x), T(w), padding=1).numpy()) < 1e-12
    xb = cl(x[None])
    out = cl(np.zeros((1, 5, 11, 9)))
    got = dnn.conv2d(xb, w, padding=1, out=out)
    assert got is out and rel(out[0], F.conv2d(T(x), T(w), padding=1).numpy()) < 1e-12
    # a strided (neither layout) x is copied; the result is NCHW
    xs = np.zeros((1, 3, 22, 9))[:, :, ::2]
    xs[...] = x
    assert rel(dnn.conv2d(xs, w, padding=1)[0], F.conv2d(T(x), T(w), padding=1).numpy()) < 1e-12


OUT_VIEWS = {  # an unbatched out (C, H, W) of (4, 5, 5) in memory of another shape: buffer, view
    "interior": (lambda: np.full((4, 7, 7), np.nan), lambda b: b[:, 1:-1, 1:-1]),
    "crop": (lambda: np.full((4, 5, 8), np.nan), lambda b: b[:, :, :5]),
    "reversed": (lambda: np.full((4, 5, 5), np.nan), lambda b: b[:, ::-1]),
    "channels-last": (lambda: np.full((5, 5, 4), np.nan), lambda b: b.transpose(2, 0, 1)),
    "every-other": (lambda: np.full((4, 5, 10), np.nan), lambda b: b[:, :, ::2]),
}


@pytest.mark.parametrize("view", sorted(OUT_VIEWS))
@pytest.mark.parametrize("fn", ["conv2d", "conv_transpose2d"])
@pytest.mark.parametrize("where", ["sim:2", "cpu"])
def test_an_unbatched_out_of_any_strides_is_written(view, fn, where):
    """An unbatched out that is not compact in x's layout (a padded buffer's interior, a crop, reversed rows, a
    channels-last or every-other-column view) holds the result, and the memory around it is untouched."""
    blasx.configure(devices=where, tile=16)
    rng = np.random.default_rng(5)
    x = rand(rng, (3, 5, 5))
    w = rand(rng, (4, 3, 3, 3)) if fn == "conv2d" else rand(rng, (3, 4, 3, 3))
    make, view_of = OUT_VIEWS[view]
    buf = make()
    out = view_of(buf)
    got = getattr(dnn, fn)(x, w, padding=1, out=out)
    want = getattr(F, fn)(T(x[None]), T(w), padding=1).numpy()[0]
    assert got is out and rel(out, want) < 1e-12
    assert np.isnan(buf).sum() == buf.size - out.size


@pytest.mark.parametrize("view", ["channels-last", "every-other"])
def test_an_unbatched_cupy_out_converted_on_the_device_is_written(monkeypatch, view):
    """The device route convolving in another layout than x's (an NCHW 3x3 of 8 channels: channels-last on the
    device) converts into compact memory: an out not compact in x's layout gets it through a buffer (it got
    transposed garbage, and memory beside an every-other-column view was written)."""
    from bench import fake_cupy
    from blasx.dnn import conv, conv_direct

    def forward(fn_, geo, xd, lay, wd, yd, rd, *rest, **kwargs):  # (the route's convolution by CPU torch)
        xh = torch.from_numpy(np.ascontiguousarray(np.asarray(xd).view(np.ndarray)))
        wh = torch.from_numpy(np.ascontiguousarray(np.asarray(wd).view(np.ndarray)))
        yd.view(np.ndarray)[...] = F.conv2d(xh, wh, padding=1).numpy()
    rng = np.random.default_rng(6)
    xh = rng.standard_normal((8, 6, 6)).astype(np.float32)
    wh = rng.standard_normal((8, 8, 3, 3)).astype(np.float32)
    with fake_cupy.installed(copies=True) as fake:
        cp = fake.cupy
        monkeypatch.setattr(conv, "_forward_call", forward)
        def device(host):  # (the stand-in's arrays are host memory: filled in place)
            a = cp.empty(host.shape, dtype=host.dtype)
            a.view(np.ndarray)[...] = host
            return a
        with cp.cuda.Device(0), conv_direct.on_own_gpu():
            x, w = device(xh), device(wh)
            shape = (6, 6, 8) if view == "channels-last" else (8, 6, 12)
            buf = device(np.full(shape, np.nan, np.float32))
            out = buf.transpose(2, 0, 1) if view == "channels-last" else buf[:, :, ::2]
            got = dnn.conv2d(x, w, padding=1, out=out)
            o, b = np.asarray(out).view(np.ndarray), np.asarray(buf).view(np.ndarray)
    want = F.conv2d(T(xh[None]).double(), T(wh).double(), padding=1).numpy()[0]
    assert got is out and rel(o, want) < 1e-5 and np.isnan(b).sum() == b.size - o.size


def test_a_channels_last_out_of_one_pixel_is_taken():
    """A channels-last x whose output is one pixel an image: a channels-last out (whose memory is compact in
    both layouts) is written in place, forward and transposed, as a channels-last network's buffers are."""
    blasx.configure(devices="sim:2", tile=16)
    rng = np.random.default_rng(6)
    x, w = cl(rand(rng, (2, 8, 2, 2))), rand(rng, (4, 8, 3, 3))
    out = cl(np.full((2, 4, 1, 1), np.nan))
    assert dnn.conv2d(x, w, stride=2, padding=1, out=out) is out
    assert rel(out, F.conv2d(T(np.ascontiguousarray(x)), T(w), stride=2, padding=1).numpy()) < 1e-12
    xt, wt = cl(rand(rng, (2, 8, 1, 1))), rand(rng, (8, 4, 1, 1))
    out = cl(np.full((2, 4, 1, 1), np.nan))
    assert dnn.conv_transpose2d(xt, wt, out=out) is out
    assert rel(out, F.conv_transpose2d(T(np.ascontiguousarray(xt)), T(wt)).numpy()) < 1e-12


def test_an_input_compact_in_both_layouts_takes_its_outs():
    """geometry.call_layout by exact value, and a one-channel channels-last x (memory compact in both layouts)
    convolved into a channels-last out, as a channels-last network's buffers are."""
    one = cl(np.zeros((2, 1, 4, 4)))
    assert geometry.call_layout(one) == "nchw" and geometry.call_layout(one, cl(np.zeros((2, 6, 4, 4)))) == "cl"
    assert geometry.call_layout(one, np.zeros((2, 6, 4, 4))) == "nchw"
    assert geometry.call_layout(cl(np.zeros((2, 3, 4, 4))), np.zeros((2, 6, 4, 4))) == "cl"  # x's own layout
    assert geometry.call_layout(np.zeros((2, 3, 8, 8))[:, :, ::2]) == "nchw"  # neither: copied
    blasx.configure(devices="sim:2", tile=16)
    rng = np.random.default_rng(7)
    x, w = cl(rand(rng, (2, 1, 4, 4))), rand(rng, (6, 1, 3, 3))
    out = cl(np.full((2, 6, 4, 4), np.nan))
    assert dnn.conv2d(x, w, padding=1, out=out) is out
    assert rel(out, F.conv2d(T(np.ascontiguousarray(x)), T(w), padding=1).numpy()) < 1e-12


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_dtypes(dtype, layout):
    blasx.configure(devices="sim:2", tile=16)
    rng = np.random.default_rng(5)
    x, w, b = rand(rng, (2, 8, 10, 9), dtype), rand(rng, (6, 4, 3, 3), dtype), rand(rng, (6,), dtype)
    y = dnn.conv2d(cl(x) if layout == "cl" else x, w, b, padding=1, groups=2)
    assert y.dtype == np.dtype(dtype)
    ref = F.conv2d(wide(x), wide(w), wide(b), padding=1, groups=2).numpy()
    assert rel(y, ref) < TOL[np.dtype(dtype)]


def test_tf32_math():
    """math="tf32": float32 on TF32 units (the sim rounds the inputs to TF32's 10-bit mantissa too)."""
    blasx.configure(devices="sim:1", tile=16)
    rng = np.random.default_rng(6)
    x, w = rand(rng, (1, 4, 8, 8), np.float32), rand(rng, (3, 4, 3, 3), np.float32)
    y = dnn.conv2d(x, w, math="tf32")
    assert blasx.last_profile().host["math"] == "tf32"
    assert 1e-5 < rel(y, F.conv2d(wide(x), wide(w)).numpy()) < 2e-3


# ---------------------------------------------------------------- epilogue

ACTS = {None: lambda t: t, "relu": F.relu, "relu6": F.relu6, "leaky_relu": F.leaky_relu,
        ("leaky_relu", 0.2): lambda t: F.leaky_relu(t, 0.2), "elu": F.elu, "sigmoid": torch.sigmoid,
        "tanh": torch.tanh, "gelu": F.gelu, "hardswish": F.hardswish, "silu": F.silu}


@pytest.mark.parametrize("act", list(ACTS), ids=str)
def test_epilogue_activations(act):
    blasx.configure(devices="sim:2", tile=16)
    rng = np.random.default_rng(7)
    x, w, b = rand(rng, (2, 4, 7, 6)), rand(rng, (5, 4, 3, 3)), rand(rng, (5,))
    for layout in ("nchw", "cl"):
        y = dnn.conv2d(cl(x) if layout == "cl" else x, w, b, padding=1, activation=act)
        ref = ACTS[act](F.conv2d(T(x), T(w), T(b), padding=1)).numpy()
        assert rel(y, ref) < 1e-12, layout


@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("dtype", [np.float64, np.float16], ids=lambda d: np.dtype(d).name)
def test_epilogue_bias_scale_shift_residual(devices, layout, dtype):
    rng = np.random.default_rng(8)
    x, w = rand(rng, (2, 6, 9, 8), dtype), rand(rng, (4, 3, 3, 3), dtype)
    b, sc, sh = rand(rng, (4,)), rng.uniform(0.5, 2, 4), rand(rng, (4,))
    conv = F.conv2d(wide(x), wide(w), wide(b.astype(dtype)), padding=1, groups=2)
    bn = conv * T(sc)[:, None, None] + T(sh)[:, None, None]
    lay = cl if layout == "cl" else (lambda a: a)
    r = rand(rng, conv.shape, dtype)
    for kw, ref in ((dict(scale=sc, shift=sh), bn), (dict(shift=sh), conv + T(sh)[:, None, None]),
                    (dict(scale=sc, shift=sh, residual=lay(r), activation="relu"), F.relu(bn + wide(r))),
                    (dict(residual=lay(r)), conv + wide(r))):
        y = dnn.conv2d(lay(x), w, b.astype(dtype), padding=1, groups=2, **kw)
        assert rel(y, ref.numpy()) < (1e-12 if dtype == np.float64 else 4e-3), sorted(kw)


def test_linear():
    blasx.configure(devices="sim:2", tile=16)
    rng = np.random.default_rng(9)
    x, w, b = rand(rng, (3, 5, 20)), rand(rng, (7, 20)), rand(rng, (7,))
    y = dnn.linear(x, w, b, activation="tanh")
    assert rel(y, torch.tanh(F.linear(T(x), T(w), T(b))).numpy()) < 1e-12


def test_linear_checks_features_and_types_before_its_empty_shortcuts():
    """In-features that do not match raise as torch's linear does, an empty side too (it returned the bias, or
    an empty array); a list or mismatched types are named errors."""
    blasx.configure(devices="sim:2", tile=16)
    f32 = np.float32
    for x, w in ((np.ones((2, 0), f32), np.ones((3, 4), f32)), (np.ones((2, 6), f32), np.ones((0, 5), f32)),
                 (np.ones((2, 6), f32), np.ones((3, 5), f32))):
        with pytest.raises(ValueError, match="must equal weight's in-features"):
            dnn.linear(x, w, np.arange(w.shape[0], dtype=f32))
    with pytest.raises(TypeError, match="input: got list"):
        dnn.linear([[1.0]], np.ones((1, 1), f32))
    with pytest.raises(TypeError, match="input is float32 but weight is float64"):
        dnn.linear(np.ones((2, 3), f32), np.ones((0, 3)))
    assert dnn.linear(np.ones((2, 0), f32), np.ones((3, 0), f32), np.arange(3, dtype=f32)).tolist() == [[0, 1, 2]] * 2


# ---------------------------------------------------------------- transposed, backward

@settings(max_examples=15, deadline=None)
@given(nd=st.sampled_from([1, 2, 3]), n=st.integers(1, 2), groups=st.sampled_from([1, 2]), k=st.integers(1, 3),
       stride=st.integers(1, 3), pad=st.integers(0, 2), dil=st.integers(1, 2), opad=st.integers(0, 2),
       layout=st.sampled_from(["nchw", "cl"]), seed=st.integers(0, 99))
def test_transposed_vs_torch(nd, n, groups, k, stride, pad, dil, opad, layout, seed):
    if opad >= max(stride, dil):
        return
    blasx.configure(devices="sim:2", tile=16)
    rng = np.random.default_rng(seed)
    x = rand(rng, (n, 2 * groups, *(5, 4, 3)[:nd]))
    w = rand(rng, (2 * groups, 3, *(k,) * nd))
    b = rand(rng, (3 * groups,))
    tconv = getattr(F, f"conv_transpose{nd}d")
    try:
        ref = tconv(T(x), T(w), T(b), stride, pad, opad, groups, dil).numpy()
    except RuntimeError:
        with pytest.raises(ValueError):
            getattr(dnn, f"conv_transpose{nd}d")(x, w, b, stride, pad, opad, groups, dil)
        return
    y = getattr(dnn, f"conv_transpose{nd}d")(cl(x) if layout == "cl" else x, w, b, stride, pad, opad, groups, dil)
    assert rel(y, ref) < 1e-12


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_backward_vs_torch(devices, nd, layout):
    rng = np.random.default_rng(10 + nd)
    lay = cl if layout == "cl" else (lambda a: a)
    for stride, pad, dil, groups in ((1, 0, 1, 1), (2, 1, 1, 2), (3, 2, 2, 1), (2, 1, 1, 4)):
        x = rand(rng, (3, 4, *(9, 7, 6)[:nd]))
        w = rand(rng, (8, 4 // groups, *(3, 2, 3)[:nd]))
        y = getattr(F, f"conv{nd}d")(T(x), T(w), None, stride, pad, dil, groups)
        dy = rand(rng, tuple(y.shape))
        gi = getattr(dnn, f"conv{nd}d_input")(x.shape, w, lay(dy), stride, pad, dil, groups)
        ref_i = getattr(tgrad, f"conv{nd}d_input")(x.shape, T(w), T(dy), stride, pad, dil, groups).numpy()
        assert rel(gi, ref_i) < 1e-12
        gw = getattr(dnn, f"conv{nd}d_weight")(lay(x), w.shape, lay(dy), stride, pad, dil, groups)
        ref_w = getattr(tgrad, f"conv{nd}d_weight")(T(x), w.shape, T(dy), stride, pad, dil, groups).numpy()
        kept = np.moveaxis(gw, 1, -1) if layout == "cl" else gw  # (channels-last operands: a channels-last dW)
        assert kept.flags.c_contiguous and rel(gw, ref_w) < 1e-12
    assert rel(dnn.conv_bias_grad(dy), dy.sum(axis=(0, *range(2, dy.ndim)))) < 1e-12


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_backward_dtypes(dtype):
    blasx.configure(devices="sim:2", tile=16)
    rng = np.random.default_rng(11)
    x, w = rand(rng, (2, 4, 9, 9), dtype), rand(rng, (6, 4, 3, 3), dtype)
    dy = rand(rng, (2, 6, 5, 5), dtype)
    gi = dnn.conv2d_input(x.shape, w, dy, stride=2, padding=1)
    gw = dnn.conv2d_weight(x, w.shape, dy, stride=2, padding=1)
    assert gi.dtype == gw.dtype == np.dtype(dtype)
    assert rel(gi, tgrad.conv2d_input(x.shape, wide(w), wide(dy), 2, 1).numpy()) < TOL[np.dtype(dtype)]
    assert rel(gw, tgrad.conv2d_weight(wide(x), w.shape, wide(dy), 2, 1).numpy()) < TOL[np.dtype(dtype)]


# ---------------------------------------------------------------- out of core

def test_batch_larger_than_device_memory():
    """The input (and col(X), never built) far exceeds each sim's tile cache: tiles stream through it."""
    mem = 1 << 19
    blasx.configure(devices=f"sim:2,mem={mem}", tile=32)
    rng = np.random.default_rng(12)
    x, w = rand(rng, (48, 8, 24, 24)), rand(rng, (16, 8, 3, 3))
    assert x.nbytes > 2 * mem
    for layout in ("nchw", "cl"):
        y = dnn.conv2d(cl(x) if layout == "cl" else x, w, padding=1, activation="relu")
        assert rel(y, F.relu(F.conv2d(T(x), T(w), padding=1)).numpy()) < 1e-12
    prof = blasx.last_profile().totals()
    assert prof["evictions"] > 0


@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_pointwise_is_a_plain_gemm(layout):
    """1x1 stride-1 unpadded: col(X) is X's own memory; only X, W (and the residual) cross the host link."""
    blasx.configure(devices="sim:1", tile=16)
    rng = np.random.default_rng(13)
    x, w, r = rand(rng, (3, 8, 10, 10)), rand(rng, (6, 4, 1, 1)), rand(rng, (3, 6, 10, 10))
    lay = cl if layout == "cl" else (lambda a: a)
    sh = rng.uniform(0.5, 2, 6)
    y = dnn.conv2d(lay(x), w, groups=2, shift=sh, residual=lay(r))
    assert rel(y, (F.conv2d(T(x), T(w), groups=2) + T(sh)[:, None, None] + T(r)).numpy()) < 1e-12
    assert blasx.last_profile().totals()["bytes_h2d"] == x.nbytes + w.nbytes + r.nbytes


@pytest.mark.parametrize("devices", ["cpu", "sim:2"])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_weight_gradient_of_an_empty_batch_is_zero(devices, nd):
    """N = 0: a sum of nothing, zeros as torch gives (no route writes an empty product), both layouts."""
    blasx.configure(devices=devices, tile=16)
    x, dy = np.ones((0, 4) + (6,) * nd), np.ones((0, 5) + (4,) * nd)
    fn = getattr(dnn, f"conv{nd}d_weight")
    for lay in ((lambda a: a), cl) if nd == 2 else ((lambda a: a),):
        dw = fn(lay(x), (5, 4) + (3,) * nd, lay(dy))
        assert dw.shape == (5, 4) + (3,) * nd and not dw.any()


@pytest.mark.parametrize("devices", ["cpu", "sim:2"])
@pytest.mark.parametrize("sc", [1e4, 2e-4])
def test_float16_scale_with_a_residual_keeps_torchs_range(devices, sc):
    """float16 with scale and residual: not folded into the weights (w * 1e4 overflows float16, w * 2e-4 goes
    subnormal), so the result is as accurate as without the residual."""
    blasx.configure(devices=devices, tile=16)
    rng = np.random.default_rng(16)
    big = sc > 1
    x = (rng.standard_normal((2, 4, 9, 9)) * (1e-3 if big else 1.0)).astype(np.float16)
    w = (rng.standard_normal((5, 4, 3, 3)) * (20 if big else 1e-2)).astype(np.float16)
    r = (rng.standard_normal((2, 5, 9, 9)) * (1.0 if big else 1e-6)).astype(np.float16)
    scale = np.full(5, sc)
    ref = F.relu(F.conv2d(T(x).double(), T(w).double(), padding=1) * sc + T(r).double()).numpy()
    y = dnn.conv2d(x, w, padding=1, scale=scale, residual=r, activation="relu")
    assert y.dtype == np.float16 and np.isfinite(y).all()
    assert rel(y.astype(np.float64), ref) < 3e-3


@pytest.mark.parametrize("devices", ["cpu", "sim:2"])
def test_a_read_only_residual_is_taken(devices):
    """The residual is only read: a read-only one (a broadcast view, a read-only mapping) is accepted, every call
    the same answer."""
    blasx.configure(devices=devices, tile=16)
    rng = np.random.default_rng(15)
    x, w, r = rand(rng, (2, 4, 9, 9)), rand(rng, (5, 4, 3, 3)), rand(rng, (2, 5, 9, 9))
    ref = F.relu(F.conv2d(T(x), T(w), padding=1) + T(r)).numpy()
    r.flags.writeable = False
    for _ in range(2):
        assert rel(dnn.conv2d(x, w, padding=1, residual=r, activation="relu"), ref) < 1e-12
    row = np.broadcast_to(r[:1], r.shape)  # read-only, zero strides
    ref = F.conv2d(T(x), T(w), padding=1) + T(np.ascontiguousarray(row))
    assert rel(dnn.conv2d(x, w, padding=1, residual=row), ref.numpy()) < 1e-12


def test_read_only_input_stays_cached_and_no_leaks():
    """col(X) of a read-only X keys on X's life-long token: a second call finds its expanded tiles
    cached (no host bytes at all); per-call tiles are retired (the idle audit finds nothing)."""
    blasx.configure(devices="sim:1", tile=16)
    rng = np.random.default_rng(14)
    x, w = rand(rng, (2, 4, 9, 9)), rand(rng, (5, 4, 3, 3))
    x.flags.writeable = w.flags.writeable = False
    first = dnn.conv2d(x, w, padding=1)
    assert blasx.last_profile().totals()["bytes_h2d"] > 0
    second = dnn.conv2d(x, w, padding=1)
    assert blasx.last_profile().totals()["bytes_h2d"] == 0
    assert np.array_equal(first, second)
    xw = x.copy()  # writable: derived tiles per call, retired after it
    dnn.conv2d(xw, w, padding=1)
    dnn.conv2d(cl(xw), w, padding=1)
    dnn.conv2d_weight(xw, w.shape, first, padding=1)
    assert blasx.engine().leaks() == []


def test_a_one_element_tuple_stands_for_every_dim_as_in_torch():
    """torch's convolutions take stride / padding / dilation / output_padding as a 1-element tuple or list for
    every spatial dim (they were refused)."""
    import torch
    F = torch.nn.functional
    blasx.configure(devices="sim:2", tile=16)
    rng = np.random.default_rng(0)
    x, w, wt = rng.random((1, 2, 8, 8)), rng.random((3, 2, 3, 3)), rng.random((2, 3, 3, 3))
    for kw in ({"stride": (2,)}, {"padding": [1]}, {"dilation": (2,)}):
        want = F.conv2d(torch.from_numpy(x), torch.from_numpy(w), **kw).numpy()
        np.testing.assert_allclose(dnn.conv2d(x, w, **kw), want, rtol=1e-12)
    want = F.conv_transpose2d(torch.from_numpy(x), torch.from_numpy(wt), stride=(2,), output_padding=(1,)).numpy()
    np.testing.assert_allclose(dnn.conv_transpose2d(x, wt, stride=(2,), output_padding=(1,)), want, rtol=1e-12)
    with pytest.raises(ValueError, match=r"stride: got \(2, 2, 2\), expected an int or a tuple of 1 or 2 ints"):
        dnn.conv2d(x, w, stride=(2, 2, 2))


def test_a_strided_transposed_float16_call_warns_of_overflow_once():
    """Its phases are engine calls of their own: each warned of its overflow (three warnings, none of the call's
    count); now one warning for the call, its phases' counts summed."""
    import warnings
    blasx.configure(devices="sim:2", tile=16)
    x, w = np.full((1, 64, 4, 4), 30, np.float16), np.full((64, 2, 3, 3), 30, np.float16)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        y = dnn.conv_transpose2d(x, w, None, 2)
    over = [str(g.message) for g in got if g.category.__name__ == "Float16OverflowWarning"]
    assert len(over) == 1 and f"{int(np.isinf(y).sum())} of {y.size} result values" in over[0], over
