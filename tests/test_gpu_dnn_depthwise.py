"""blasx.dnn's depthwise kernels (depthwise.py) on a real CUDA GPU (marker ``gpu``; skipped where CuPy
finds none): CuPy operands against CPU torch in float64, every element type (bfloat16 as its bits, through
the module's entry points: CuPy has no bfloat16), layout, rank, stride/padding/dilation, the fused
epilogue, out=, and the backward directions; each call checked to have taken the depthwise kernels."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn
from dnn_ref import rel, wide

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
NGPU = blasx.session._cuda_count()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="no CUDA GPU")]
F = torch.nn.functional
T = torch.from_numpy

TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}
SIZES = {1: (37,), 2: (13, 11), 3: (6, 7, 5)}
# (stride, padding, dilation, multiplier); "asym": (lo, hi) pairs, applied to x for torch
CASES = [(1, 1, 1, 1), (2, 1, 1, 1), (1, "asym", 2, 2), (3, 0, 1, 3), (2, 2, 2, 1)]
ASYM = ((1, 0), (0, 2), (2, 1))


def _device(x, layout):
    xc = cupy.asarray(x)
    if layout == "nchw":
        return xc
    return cupy.ascontiguousarray(cupy.moveaxis(xc, 1, -1)).transpose(0, x.ndim - 1, *range(1, x.ndim - 1))


def _pads(pad, nd):
    """(blasx's padding, x padded for torch, torch's padding)."""
    if pad != "asym":
        return pad, (lambda a: a), pad
    pairs = ASYM[:nd]
    return pairs, (lambda a: np.pad(np.asarray(a, np.float64), ((0, 0), (0, 0), *pairs))), 0


@pytest.fixture(autouse=True)
def _engine():
    blasx.configure(devices="cuda", tile=64, cache_bytes=256 << 20)
    yield
    blasx.shutdown()


def _pattern(launches, *parts):
    """Whether ``launches`` is runs of ``parts``: (name, most) -- 1 to ``most`` launches of name in a row (a
    strided backward-data or transposed convolution runs as up to stride^nd sub-pixel phases, conv_transpose.PHASES)."""
    i = 0
    for name, most in parts:
        n = 0
        while i < len(launches) and launches[i] == name and n < most:
            i, n = i + 1, n + 1
        if n == 0:
            return False
    return i == len(launches)


@pytest.fixture
def launches(monkeypatch):
    """The device route forced; the depthwise launches counted (the vector forward kernel's as forwards)."""
    from blasx.dnn import conv_direct, depthwise
    monkeypatch.setattr(conv_direct, "ROUTE", "direct")
    seen = []
    for name, as_name in (("launch_forward", "launch_forward"), ("launch_vector", "launch_forward"),
                          ("launch_weight", "launch_weight")):
        real = getattr(depthwise, name)

        def spy(*args, _real=real, _name=as_name, **kwargs):
            seen.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(depthwise, name, spy)
    return seen


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_forward_epilogue(launches, nd, layout, dtype, case):
    stride, pad, dil, m = case
    rng = np.random.default_rng(nd)
    dt = np.dtype(dtype)
    c = 6
    x = rng.standard_normal((3, c, *SIZES[nd])).astype(dt)
    w = rng.standard_normal((c * m, 1, *(3,) * nd)).astype(dt)
    padding, tpad_x, tpad = _pads(pad, nd)
    conv = getattr(F, f"conv{nd}d")(wide(tpad_x(x)), wide(w), None, stride, tpad, dil, c)
    r = rng.standard_normal(tuple(conv.shape)).astype(dt)
    b, sc, sh = rng.standard_normal(c * m), rng.uniform(0.5, 2, c * m), rng.standard_normal(c * m)
    ch = (slice(None),) + (None,) * nd
    ref = F.relu((conv + T(b)[ch]) * T(sc)[ch] + T(sh)[ch] + wide(r)).numpy()
    fn = getattr(dnn, f"conv{nd}d")
    y = fn(_device(x, layout), cupy.asarray(w), cupy.asarray(b), stride, padding, dil, c, scale=cupy.asarray(sc),
           shift=cupy.asarray(sh), residual=_device(r, layout), activation="relu")
    assert isinstance(y, cupy.ndarray) and y.dtype == dt and (layout == "cl") == (not y.flags.c_contiguous)
    assert rel(y, ref) < TOL[dtype]
    plain = fn(_device(x, layout), cupy.asarray(w), None, stride, padding, dil, c)
    assert rel(plain, conv.numpy()) < TOL[dtype]
    assert launches == ["launch_forward"] * 2


@pytest.mark.parametrize("activation", ["relu", "relu6", ("leaky_relu", 0.2), ("elu", 0.5), "sigmoid", "tanh",
                                        "gelu", ("gelu", "tanh"), "hardswish", "silu"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_activations(launches, activation, dtype):
    from blasx.dnn.activations import parse_activation
    rng = np.random.default_rng(1)
    dt = np.dtype(dtype)
    x = rng.standard_normal((2, 8, 15, 12)).astype(dt)
    w = rng.standard_normal((8, 1, 3, 3)).astype(dt)
    b = rng.standard_normal(8)
    conv = F.conv2d(wide(x), wide(w), T(b), 1, 1, 1, 8).numpy()
    ref = parse_activation(activation).host(conv)
    y = dnn.conv2d(cupy.asarray(x), cupy.asarray(w), cupy.asarray(b), padding=1, groups=8, activation=activation)
    assert rel(y, ref) < TOL[dtype]


@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_out_and_unbatched(launches, layout):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 4, 10, 9))
    w = rng.standard_normal((4, 1, 5, 3))
    ref = F.conv2d(T(x), T(w), None, (2, 1), (2, 1), 1, 4).numpy()
    out = _device(np.full(ref.shape, np.nan), layout)
    y = dnn.conv2d(_device(x, layout), cupy.asarray(w), stride=(2, 1), padding=(2, 1), groups=4, out=out)
    assert y is out and rel(out, ref) < 1e-12
    y1 = dnn.conv2d(cupy.asarray(x[0]), cupy.asarray(w), stride=(2, 1), padding=(2, 1), groups=4)
    assert y1.shape == ref.shape[1:] and rel(y1, ref[0]) < 1e-12
    xs = _device(x, layout)  # out may not overlap x (on the host as on GPUs), checked before any work
    with pytest.raises(ValueError, match="out: overlaps an input"):
        dnn.conv2d(xs, cupy.asarray(w[..., 1:4, :]), padding=(1, 1), groups=4, out=xs)
    assert rel(xs, x) == 0.0


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_backward_directions(launches, nd, layout, dtype, case):
    """conv{nd}d_input and conv{nd}d_weight with groups == C (multiplier m), and conv_transpose{nd}d with
    groups == its input channels."""
    stride, pad, dil, m = case
    pad = 1 if pad == "asym" else pad  # torch's grad functions take symmetric padding only
    rng = np.random.default_rng(nd + 10)
    dt = np.dtype(dtype)
    c = 5
    x = rng.standard_normal((3, c, *SIZES[nd])).astype(dt)
    w = rng.standard_normal((c * m, 1, *(3,) * nd)).astype(dt)
    out = getattr(F, f"conv{nd}d")(wide(x), wide(w), None, stride, pad, dil, c)
    dy = rng.standard_normal(tuple(out.shape)).astype(dt)
    grad = torch.nn.grad
    gi = getattr(dnn, f"conv{nd}d_input")(x.shape, cupy.asarray(w), _device(dy, layout), stride, pad, dil, c)
    want = getattr(grad, f"conv{nd}d_input")(x.shape, wide(w), wide(dy), stride, pad, dil, c).numpy()
    assert gi.dtype == dt and (layout == "cl") == (not gi.flags.c_contiguous) and rel(gi, want) < TOL[dtype]
    gw = getattr(dnn, f"conv{nd}d_weight")(_device(x, layout), w.shape, _device(dy, layout), stride, pad, dil, c)
    want = getattr(grad, f"conv{nd}d_weight")(wide(x), w.shape, wide(dy), stride, pad, dil, c).numpy()
    assert gw.dtype == dt and gw.shape == w.shape and gw.flags.c_contiguous and rel(gw, want) < TOL[dtype]
    wt = rng.standard_normal((c, m, *(3,) * nd)).astype(dt)
    opad = 1 if stride > 1 else 0
    yt = getattr(dnn, f"conv_transpose{nd}d")(_device(x, layout), cupy.asarray(wt), None, stride, pad, opad, c, dil)
    want = getattr(F, f"conv_transpose{nd}d")(wide(x), wide(wt), None, stride, pad, opad, c, dil).numpy()
    assert rel(yt, want) < TOL[dtype]
    phases = 1 if stride == 1 else stride ** nd
    assert _pattern(launches, ("launch_forward", phases), ("launch_weight", 1), ("launch_forward", phases)), launches


@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_bfloat16_bits(layout):
    """bfloat16 through the entry points, arrays as uint16 bits: forward with the epilogue, backward-weights."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from blasx.dnn import depthwise
    from blasx.dnn.activations import parse_activation
    from blasx.dnn.geometry import conv_geometry
    bf = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 8, 14, 10)).astype(bf)
    w = rng.standard_normal((16, 1, 3, 3)).astype(bf)
    cl = layout == "cl"
    geo = conv_geometry("conv2d", 2, x, w, 2, 1, 1, 8)
    conv = F.conv2d(wide(x), wide(w), None, 2, 1, 1, 8)
    r = rng.standard_normal(tuple(conv.shape)).astype(bf)
    sc, sh = rng.uniform(0.5, 2, 16), rng.standard_normal(16)

    def bits(a):
        return _device(a.view(np.uint16), layout)
    y = _device(np.zeros(conv.shape, np.uint16), layout)
    depthwise.forward(geo, bits(x), cl, cupy.asarray(w.view(np.uint16)), y, bits(r),
                      (None, sc, sh, parse_activation("silu")), dtype=bf)
    ref = F.silu(conv * T(sc)[:, None, None] + T(sh)[:, None, None] + wide(r)).numpy()
    assert rel(cupy.asnumpy(y).view(bf), ref) < TOL["bfloat16"]
    dy = rng.standard_normal(tuple(conv.shape)).astype(bf)
    gw = depthwise.weight(geo, bits(x), bits(dy), cl, dtype=bf)
    want = torch.nn.grad.conv2d_weight(wide(x), w.shape, wide(dy), 2, 1, 1, 8).numpy()
    assert gw.dtype == np.uint16 and gw.shape == w.shape and rel(cupy.asnumpy(gw).view(bf), want) < TOL["bfloat16"]


@pytest.mark.parametrize("c,size,stride", [(32, 112, 1), (96, 112, 2), (144, 56, 2), (576, 14, 1), (960, 7, 1)])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_mobilenet_v2_layers(launches, c, size, stride, layout):
    """MobileNet-v2's depthwise 3x3 shapes at batch 2, float32: forward (bias, relu6), both backwards."""
    rng = np.random.default_rng(c)
    x = rng.standard_normal((2, c, size, size)).astype(np.float32)
    w = rng.standard_normal((c, 1, 3, 3)).astype(np.float32)
    b = rng.standard_normal(c)
    conv = F.conv2d(wide(x), wide(w), T(b), stride, 1, 1, c)
    y = dnn.conv2d(_device(x, layout), cupy.asarray(w), cupy.asarray(b), stride, 1, 1, c, activation="relu6")
    assert rel(y, F.relu6(conv).numpy()) < 1e-5
    dy = rng.standard_normal(tuple(conv.shape)).astype(np.float32)
    gi = dnn.conv2d_input(x.shape, cupy.asarray(w), _device(dy, layout), stride, 1, 1, c)
    assert rel(gi, torch.nn.grad.conv2d_input(x.shape, wide(w), wide(dy), stride, 1, 1, c).numpy()) < 1e-5
    gw = dnn.conv2d_weight(_device(x, layout), w.shape, _device(dy, layout), stride, 1, 1, c)
    assert rel(gw, torch.nn.grad.conv2d_weight(wide(x), w.shape, wide(dy), stride, 1, 1, c).numpy()) < 1e-5
    assert _pattern(launches, ("launch_forward", 1), ("launch_forward", stride ** 2), ("launch_weight", 1)), launches


def test_route_is_taken_for_cupy_and_host_batches(launches, monkeypatch):
    """CuPy operands and host batches (host_batch: one chunk here) take the kernel; the engine's tile tasks not."""
    from blasx.dnn import conv_direct, host_batch
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 6, 9, 9))
    w = rng.standard_normal((6, 1, 3, 3))
    ref = F.conv2d(T(x), T(w), None, 1, 1, 1, 6).numpy()
    chunks = len(host_batch.plan(2, 1, len(host_batch.gpus())))  # one a GPU
    assert rel(dnn.conv2d(x, w, padding=1, groups=6), ref) < 1e-12 and launches == ["launch_forward"] * chunks
    assert rel(dnn.conv2d(cupy.asarray(x), cupy.asarray(w), padding=1, groups=6), ref) < 1e-12
    assert launches == ["launch_forward"] * (chunks + 1)
    monkeypatch.setattr(conv_direct, "ROUTE", "engine")
    assert rel(dnn.conv2d(x, w, padding=1, groups=6), ref) < 1e-12 and launches == ["launch_forward"] * (chunks + 1)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("ks,stride,pad,dil", [(3, 1, 1, 1), (3, 2, 1, 1), (5, 1, 2, 1), (3, 1, 2, 2), (5, 2, 0, 1)])
def test_vector_kernel_equals_the_element_kernel(monkeypatch, dtype, ks, stride, pad, dil):
    """Channels-last 2-D depthwise with whole 16-byte units of channels runs depthwise_vec's kernel: the same
    sums as the one-element-a-thread kernel (scale, shift, residual, relu6) and torch's within the type."""
    from blasx.dnn import conv_direct, depthwise, depthwise_vec
    monkeypatch.setattr(conv_direct, "ROUTE", "direct")
    rng = np.random.default_rng(ks * 10 + stride)
    dt = np.dtype(dtype)
    c = 4 * depthwise_vec.per_unit(dt)
    x = rng.standard_normal((3, c, 13, 11)).astype(dt)
    w = rng.standard_normal((c, 1, ks, ks)).astype(dt)
    conv = F.conv2d(wide(x), wide(w), None, stride, pad, dil, c)
    r = rng.standard_normal(tuple(conv.shape)).astype(dt)
    b, sc, sh = rng.standard_normal(c), rng.uniform(0.5, 2, c), rng.standard_normal(c)
    ch = (slice(None), None, None)
    ref = F.relu6((conv + T(b)[ch]) * T(sc)[ch] + T(sh)[ch] + wide(r)).numpy()
    seen = []
    real = depthwise.launch_vector
    monkeypatch.setattr(depthwise, "launch_vector", lambda *a, **k: (seen.append(1), real(*a, **k)))

    def run():
        return dnn.conv2d(_device(x, "cl"), cupy.asarray(w), cupy.asarray(b), stride, pad, dil, c,
                          scale=cupy.asarray(sc), shift=cupy.asarray(sh), residual=_device(r, "cl"),
                          activation="relu6")
    y = run()
    assert seen == [1] and rel(y, ref) < TOL[dtype]
    monkeypatch.setattr(depthwise_vec, "applies", lambda *a: False)
    y1 = run()
    same = {"float64": 1e-14, "float32": 1e-6}.get(dtype, 1e-3)  # one rounding apart at most, here and there
    assert seen == [1] and rel(y, cupy.asnumpy(y1).astype(np.float64)) < same
