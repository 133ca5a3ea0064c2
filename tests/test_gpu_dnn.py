"""blasx.dnn on real CUDA GPUs (marker ``gpu``; skipped where CuPy finds none): the im2col fill (host x
staged by pitched copies, CuPy x gathered in place), the epilogue, half types with a residual, against
CPU torch in float64."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn
from dnn_ref import cl, rel, wide

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
NGPU = blasx.session._cuda_count()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="no CUDA GPU")]
F = torch.nn.functional


def _bf16():
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}


@pytest.fixture(autouse=True)
def _engine():
    blasx.configure(devices="cuda", tile=64, cache_bytes=256 << 20)
    yield
    blasx.shutdown()


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("where", ["host", "host-engine", "device"])
def test_forward(nd, layout, where, monkeypatch):
    if where == "host-engine":  # the engine's tile tasks (im2col filled on the GPUs), not host_batch
        from blasx.dnn import conv_direct
        monkeypatch.setattr(conv_direct, "ROUTE", "engine")
    rng = np.random.default_rng(nd)
    size = (300, 37, 13)[:nd] if nd < 3 else (9, 11, 13)
    x = rng.standard_normal((5, 12, *size))
    w = rng.standard_normal((21, 4, *(3,) * nd))
    b = rng.standard_normal(21)
    xin = cl(x) if layout == "cl" else x
    w_, b_ = w, b
    if where == "device":
        xc = cupy.asarray(x)
        xin = xc if layout == "nchw" else cupy.ascontiguousarray(cupy.moveaxis(xc, 1, -1)).transpose(
            0, nd + 1, *range(1, nd + 1))
        w_, b_ = cupy.asarray(w), cupy.asarray(b)
    y = getattr(dnn, f"conv{nd}d")(xin, w_, b_, stride=2, padding=1, dilation=1, groups=3, activation="relu")
    ref = F.relu(getattr(F, f"conv{nd}d")(wide(x), wide(w), wide(b), stride=2, padding=1, groups=3)).numpy()
    assert type(y) is type(xin)
    assert rel(y, ref) < 1e-12


@pytest.mark.parametrize("view", ["interior", "channels-last", "every-other"])
@pytest.mark.parametrize("fn", ["conv2d", "conv_transpose2d"])
@pytest.mark.parametrize("where", ["host", "device"])
def test_an_unbatched_out_of_any_strides_is_written(view, fn, where):
    """An unbatched out not compact in x's layout (a padded buffer's interior, a channels-last or every-other-
    column view), on the device route (which converts an NCHW 3x3 of 8 channels to channels-last) and the host
    batch route: it holds the result and the memory around it is untouched."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8, 6, 6)).astype(np.float32)
    w = (rng.standard_normal((8, 8, 3, 3)) / 8).astype(np.float32)
    shape = {"interior": (8, 8, 8), "channels-last": (6, 6, 8), "every-other": (8, 6, 12)}[view]
    buf = np.full(shape, np.nan, np.float32)
    xp = cupy if where == "device" else np
    xin, win, buf = (xp.asarray(a) for a in (x, w, buf))
    out = {"interior": lambda b: b[:, 1:-1, 1:-1], "channels-last": lambda b: b.transpose(2, 0, 1),
           "every-other": lambda b: b[:, :, ::2]}[view](buf)
    got = getattr(dnn, fn)(xin, win, padding=1, out=out, math="ieee")
    want = getattr(F, fn)(wide(x[None]), wide(w), padding=1).numpy()[0]
    host_out = cupy.asnumpy(out) if where == "device" else out
    host_buf = cupy.asnumpy(buf) if where == "device" else buf
    assert got is out and rel(host_out, want) < 1e-5
    assert np.isnan(host_buf).sum() == host_buf.size - host_out.size


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dtypes_residual_epilogue(dtype):
    dt = _bf16() if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 16, 33, 29)).astype(dt)
    w = rng.standard_normal((24, 16, 3, 3)).astype(dt)
    r = rng.standard_normal((4, 24, 33, 29)).astype(dt)
    sc, sh = rng.uniform(0.5, 2, 24), rng.standard_normal(24)
    y = dnn.conv2d(x, w, padding="same", scale=sc, shift=sh, residual=r, activation="silu")
    conv = F.conv2d(wide(x), wide(w), padding="same")
    ref = F.silu(conv * torch.from_numpy(sc)[:, None, None] + torch.from_numpy(sh)[:, None, None] + wide(r))
    assert y.dtype == dt and rel(y, ref.numpy()) < TOL[dtype]


HOST_BATCH_TOL = {("float32", "ieee"): 1e-5, ("float32", "tf32"): 5e-3, ("float16", "ieee"): 5e-3,
                  ("bfloat16", "ieee"): 3e-2, ("float64", "ieee"): 1e-12}


@pytest.mark.parametrize("dtype,math", list(HOST_BATCH_TOL))
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("memory", ["pageable", "pinned", "registered"])
@pytest.mark.parametrize("kernel,stride,pad,c", [(3, 1, 1, 64), (1, 2, 0, 32), (3, 2, 1, 8)])
def test_host_batch_vs_torch(monkeypatch, dtype, math, layout, memory, kernel, stride, pad, c):
    """A numpy batch on every GPU in chunks (host_batch), epilogue and (read-only) residual included, into a given
    out and into one blasx makes; the caller's arrays untouched."""
    from blasx.dnn import host_batch
    from blasx.runtime import hostmem
    monkeypatch.setattr(host_batch, "CHUNK_BYTES", 1 << 20)  # many chunks on every GPU
    if memory == "registered":
        monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1)
    dt = _bf16() if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((37, c, 19, 17)).astype(dt)
    w = (rng.standard_normal((48, c, kernel, kernel)) / np.sqrt(c * kernel * kernel)).astype(dt)
    conv = F.conv2d(wide(x), wide(w), None, stride, pad)
    r = rng.standard_normal(tuple(conv.shape)).astype(dt)
    b, sc, sh = rng.standard_normal(48), rng.uniform(0.5, 2, 48), rng.standard_normal(48)
    if layout == "cl":
        x, r = cl(x), cl(r)
    if memory == "pinned":
        def pinned_copy(a):
            mem = cupy.cuda.alloc_pinned_memory(a.nbytes)
            flat = np.frombuffer(mem, a.dtype, a.size)
            host = host_batch.in_layout(flat, a.shape, layout)
            host[...] = a
            return host
        x, r = pinned_copy(x), pinned_copy(r)
    x0, r0 = x.copy(), r.copy()
    r.flags.writeable = False  # (the residual is only read)
    t = torch.from_numpy
    ref = F.relu((conv + t(b)[:, None, None]) * t(sc)[:, None, None] + t(sh)[:, None, None] + wide(r)).numpy()
    y = dnn.conv2d(x, w, b, stride, pad, scale=sc, shift=sh, residual=r, activation="relu", math=math)
    assert type(y) is np.ndarray and y.dtype == dt and (layout == "cl") == (not y.flags.c_contiguous)
    assert rel(y, ref) < HOST_BATCH_TOL[(dtype, math)]
    out = host_batch.in_layout(np.full(y.size, np.nan, dt), y.shape, layout)
    got = dnn.conv2d(x, w, None, stride, pad, out=out, math=math)
    assert got is out and rel(out, conv.numpy()) < HOST_BATCH_TOL[(dtype, math)]
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(r, r0)


@pytest.mark.parametrize("dtype,math", [("float16", "ieee"), ("float32", "tf32"), ("bfloat16", "ieee"),
                                        ("float64", "ieee")])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_host_batch_graph_replays_read_each_calls_weights_and_epilogue(monkeypatch, dtype, math, layout):
    """Chunks replayed from CUDA graphs across calls (host_batch.GRAPHS): calls of one shape with new weights,
    biases, activations, residuals and the other layout, between calls of a larger layer that regrows the slots'
    buffers, each against torch; the weights' transforms are remade inside the graphs from the refilled weight
    buffer."""
    from blasx.dnn import host_batch
    monkeypatch.setattr(host_batch, "CHUNK_BYTES", 1 << 20)  # several chunks a slot: a call replays its own graphs
    monkeypatch.setattr(host_batch, "MIN_CHUNK_BYTES", 1)
    host_batch.release()
    dt = _bf16() if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(5)
    tol = HOST_BATCH_TOL[(dtype, math)]
    t = torch.from_numpy

    def case(n, c, k, hw, ksize, with_bias, act, with_res, lay=layout):
        x = rng.standard_normal((n, c, hw, hw)).astype(dt)
        w = (rng.standard_normal((k, c, ksize, ksize)) / np.sqrt(c * ksize * ksize)).astype(dt)
        b = rng.standard_normal(k) if with_bias else None
        conv = F.conv2d(wide(x), wide(w), None if b is None else t(b), 1, ksize // 2)
        r = rng.standard_normal(tuple(conv.shape)).astype(dt) if with_res else None
        ref = conv + (wide(r) if r is not None else 0)
        ref = {"relu": F.relu, "silu": F.silu, None: lambda v: v}[act](ref).numpy()
        if lay == "cl":
            x = cl(x)
            r = None if r is None else cl(r)
        y = dnn.conv2d(x, w, b, 1, ksize // 2, activation=act, residual=r, math=math)
        assert y.dtype == dt and rel(y, ref) < tol, (n, c, k, hw, ksize, with_bias, act, with_res)

    for i in range(3):
        for with_bias, act, with_res in [(False, None, False), (True, "relu", False), (True, "silu", True)]:
            case(24, 16, 24, 12, 3, with_bias, act, with_res)
            case(24, 16, 24, 12, 1, with_bias, act, with_res)
            case(24, 16, 24, 12, 3, with_bias, act, with_res, "nchw" if layout == "cl" else "cl")  # the other layout
        case(20 + 4 * i, 32, 40, 16, 3, True, "relu", False)  # larger: the slots' buffers grow
    replays = sum(g.replays for slots in host_batch._IDLE.values() for s in slots for g in s.graphs.values())
    assert replays > 0
    host_batch.release()


def test_transposed_and_backward():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 8, 40, 30))
    w = rng.standard_normal((12, 4, 3, 3))
    dy = rng.standard_normal((3, 12, 20, 15))
    for lay in (lambda a: a, cl):
        gi = dnn.conv2d_input(x.shape, w, lay(dy), stride=2, padding=1, groups=2)
        ref_i = torch.nn.grad.conv2d_input(x.shape, wide(w), wide(dy), 2, 1, 1, 2).numpy()
        assert rel(gi, ref_i) < 1e-12
        gw = dnn.conv2d_weight(lay(x), w.shape, lay(dy), stride=2, padding=1, groups=2)
        ref_w = torch.nn.grad.conv2d_weight(wide(x), w.shape, wide(dy), 2, 1, 1, 2).numpy()
        assert rel(gw, ref_w) < 1e-12
    wt = rng.standard_normal((8, 5, 4, 4))
    yt = dnn.conv_transpose2d(x, wt, stride=2, padding=1, output_padding=1)
    assert rel(yt, F.conv_transpose2d(wide(x), wide(wt), None, 2, 1, 1).numpy()) < 1e-12


# ---------------------------------------------------------------- the device route (conv_direct.py)

def _device(x, layout):
    xc = cupy.asarray(x)
    if layout == "nchw":
        return xc
    return cupy.ascontiguousarray(cupy.moveaxis(xc, 1, -1)).transpose(0, x.ndim - 1, *range(1, x.ndim - 1))


DIRECT_TOL = {("float32", "ieee"): 1e-5, ("float32", "tf32"): 5e-3, ("float16", "ieee"): 5e-3,
              ("float64", "ieee"): 1e-12}


@pytest.fixture(params=["one-chunk", "chunked"])
def direct_route(request, monkeypatch):
    """Every CuPy call on the device route; "chunked": scratch for one image at a time."""
    from blasx.dnn import conv_direct
    monkeypatch.setattr(conv_direct, "ROUTE", "direct")
    if request.param == "chunked":
        monkeypatch.setattr(conv_direct, "BUDGET_FRACTION", 2**60)
    return request.param


@pytest.mark.parametrize("dtype,math", list(DIRECT_TOL))
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("kernel,stride,pad,groups", [(3, 2, 1, 2), (1, 1, 0, 1), (3, 1, 1, 1)])
def test_direct_forward_epilogue_residual(direct_route, dtype, math, layout, kernel, stride, pad, groups):
    rng = np.random.default_rng(5)
    dt = np.dtype(dtype)
    x = rng.standard_normal((3, 8, 13, 11)).astype(dt)
    w = rng.standard_normal((12, 8 // groups, kernel, kernel)).astype(dt)
    conv = F.conv2d(wide(x), wide(w), None, stride, pad, 1, groups)
    r = rng.standard_normal(tuple(conv.shape)).astype(dt)
    b, sc, sh = rng.standard_normal(12), rng.uniform(0.5, 2, 12), rng.standard_normal(12)
    y = dnn.conv2d(_device(x, layout), cupy.asarray(w), cupy.asarray(b), stride, pad, 1, groups,
                   scale=cupy.asarray(sc), shift=cupy.asarray(sh), residual=_device(r, layout), activation="relu",
                   math=math)
    t = torch.from_numpy
    ref = F.relu((conv + t(b)[:, None, None]) * t(sc)[:, None, None] + t(sh)[:, None, None] + wide(r)).numpy()
    assert isinstance(y, cupy.ndarray) and y.dtype == dt and (layout == "cl") == (not y.flags.c_contiguous)
    assert rel(y, ref) < DIRECT_TOL[(dtype, math)]
    plain = dnn.conv2d(_device(x, layout), cupy.asarray(w), None, stride, pad, 1, groups, math=math)
    assert rel(plain, conv.numpy()) < DIRECT_TOL[(dtype, math)]


def test_the_callers_stream_stays_current_and_orders_the_call(direct_route):
    """A stream the caller made current by use() is current after a call with an epilogue (CuPy's `with`
    had left the null stream current), and the call's work ran on it."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 8, 12, 12)).astype(np.float32)
    w = rng.standard_normal((16, 8, 3, 3)).astype(np.float32)
    mine = cupy.cuda.Stream(non_blocking=True)
    mine.use()
    try:
        y = dnn.conv2d(cupy.asarray(x), cupy.asarray(w), None, 1, 1, activation="relu", shift=cupy.ones(16))
        assert cupy.cuda.get_current_stream() == mine
        mine.synchronize()
        ref = F.relu(F.conv2d(wide(x), wide(w), None, 1, 1) + 1).numpy()
        assert rel(y, ref) < 1e-5
    finally:
        cupy.cuda.Stream.null.use()


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_direct_backward_and_transposed(direct_route, dtype, layout):
    rng = np.random.default_rng(6)
    dt = np.dtype(dtype)
    x = rng.standard_normal((3, 8, 14, 10)).astype(dt)
    w = rng.standard_normal((12, 4, 3, 3)).astype(dt)
    dy = rng.standard_normal((3, 12, 7, 5)).astype(dt)
    tol = DIRECT_TOL[(dtype, "ieee")]
    gi = dnn.conv2d_input(x.shape, cupy.asarray(w), _device(dy, layout), stride=2, padding=1, groups=2)
    assert rel(gi, torch.nn.grad.conv2d_input(x.shape, wide(w), wide(dy), 2, 1, 1, 2).numpy()) < tol
    gw = dnn.conv2d_weight(_device(x, layout), w.shape, _device(dy, layout), stride=2, padding=1, groups=2)
    assert gw.dtype == dt and gw.shape == w.shape
    assert rel(gw, torch.nn.grad.conv2d_weight(wide(x), w.shape, wide(dy), 2, 1, 1, 2).numpy()) < tol
    pw = rng.standard_normal((6, 8, 1, 1)).astype(dt)
    dyp = rng.standard_normal((3, 6, 14, 10)).astype(dt)
    gpw = dnn.conv2d_weight(_device(x, layout), pw.shape, _device(dyp, layout))
    assert rel(gpw, torch.nn.grad.conv2d_weight(wide(x), pw.shape, wide(dyp)).numpy()) < tol
    wt = rng.standard_normal((8, 5, 4, 4)).astype(dt)
    yt = dnn.conv_transpose2d(_device(x, layout), cupy.asarray(wt), stride=2, padding=1, output_padding=1)
    assert rel(yt, F.conv_transpose2d(wide(x), wide(wt), None, 2, 1, 1).numpy()) < tol


@pytest.mark.parametrize("form", ["im2col", "shifted"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_direct_forms_vs_torch(direct_route, monkeypatch, form, dtype, layout, nd):
    """Both forward forms (conv_direct.FORM) on stride-1 convolutions, with the epilogue and a residual,
    and a stride-1 backward-data (a forward of the flipped kernel), against torch in float64."""
    from blasx.dnn import conv_direct
    from blasx.dnn.geometry import conv_geometry
    monkeypatch.setattr(conv_direct, "FORM", form)
    rng = np.random.default_rng(nd)
    dt = np.dtype(dtype)
    size = (40,) if nd == 1 else (13, 11) if nd == 2 else (5, 6, 7)
    pad = dil = 2 if nd == 2 else 1
    x = rng.standard_normal((3, 64, *size)).astype(dt)
    w = (rng.standard_normal((24, 64, *(3,) * nd)) / 8).astype(dt)
    assert conv_direct.forward_form(conv_geometry("t", nd, x, w, 1, pad, dil, 1), dt, form) == form
    conv = getattr(F, f"conv{nd}d")(wide(x), wide(w), None, 1, pad, dil)
    r = rng.standard_normal(tuple(conv.shape)).astype(dt)
    b, sc, sh = rng.standard_normal(24), rng.uniform(0.5, 2, 24), rng.standard_normal(24)
    y = getattr(dnn, f"conv{nd}d")(_device(x, layout), cupy.asarray(w), cupy.asarray(b), 1, pad, dil,
                                   scale=cupy.asarray(sc), shift=cupy.asarray(sh), residual=_device(r, layout),
                                   activation="relu")
    t, ch = torch.from_numpy, (slice(None),) + (None,) * nd
    ref = F.relu((conv + t(b)[ch]) * t(sc)[ch] + t(sh)[ch] + wide(r)).numpy()
    tol = DIRECT_TOL[(dtype, "ieee")]
    assert isinstance(y, cupy.ndarray) and y.dtype == dt and (layout == "cl") == (not y.flags.c_contiguous)
    assert rel(y, ref) < tol
    w2 = (rng.standard_normal((64, 64, *(3,) * nd)) / 8).astype(dt)
    dy = rng.standard_normal(tuple(conv.shape[:1]) + (64,) + tuple(conv.shape[2:])).astype(dt)
    gi = getattr(dnn, f"conv{nd}d_input")(x.shape, cupy.asarray(w2), _device(dy, layout), 1, pad, dil)
    want = getattr(torch.nn.grad, f"conv{nd}d_input")(x.shape, wide(w2), wide(dy), 1, pad, dil).numpy()
    assert rel(gi, want) < tol


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("pad, size", [(1, (13, 11)), (0, (12, 9)), (2, (7, 8))])
def test_winograd_form_vs_torch(direct_route, monkeypatch, m, dtype, layout, pad, size):
    """BLASX_CONV_FORM=winograd, F(2x2) and F(4x4): 3x3 stride-1 forward with the epilogue (outputs that are and
    are not multiples of m: a partial last tile), a residual (which takes im2col's sum into y), a stride-1
    backward-data and the weight gradient, against torch in float64; poisoned outputs."""
    from blasx.dnn import conv_direct
    from blasx.dnn.geometry import conv_geometry
    monkeypatch.setattr(conv_direct, "FORM", "winograd")
    monkeypatch.setattr(conv_direct, "WINOGRAD_TILE", m)
    rng = np.random.default_rng(pad)
    dt = np.dtype(dtype)
    x = rng.standard_normal((3, 40, *size)).astype(dt)
    w = (rng.standard_normal((24, 40, 3, 3)) / 8).astype(dt)
    assert conv_direct.forward_form(conv_geometry("t", 2, x, w, 1, pad, 1, 1), dt, conv_direct.FORM) == "winograd"
    conv = F.conv2d(wide(x), wide(w), None, 1, pad)
    b = rng.standard_normal(24)
    out = cupy.full(tuple(conv.shape), np.nan, dtype=dt)
    if layout == "cl":
        out = cupy.full((conv.shape[0], *conv.shape[2:], conv.shape[1]), np.nan, dtype=dt).transpose(0, 3, 1, 2)
    y = dnn.conv2d(_device(x, layout), cupy.asarray(w), cupy.asarray(b), 1, pad, activation="relu", out=out)
    tol = DIRECT_TOL[(dtype, "ieee")]
    assert y is out and rel(y, F.relu(conv + torch.from_numpy(b)[:, None, None]).numpy()) < tol
    r = rng.standard_normal(tuple(conv.shape)).astype(dt)
    y = dnn.conv2d(_device(x, layout), cupy.asarray(w), None, 1, pad, residual=_device(r, layout))
    assert rel(y, (conv + wide(r)).numpy()) < tol
    dy = rng.standard_normal(tuple(conv.shape)).astype(dt)
    gi = dnn.conv2d_input(x.shape, cupy.asarray(w), _device(dy, layout), 1, pad)
    assert rel(gi, torch.nn.grad.conv2d_input(x.shape, wide(w), wide(dy), 1, pad).numpy()) < tol
    gw = dnn.conv2d_weight(_device(x, layout), w.shape, _device(dy, layout), 1, pad)
    assert rel(gw, torch.nn.grad.conv2d_weight(wide(x), w.shape, wide(dy), 1, pad).numpy()) < tol


@pytest.mark.parametrize("math", ["ieee", "tf32"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_shifted_weight_form_vs_torch(direct_route, monkeypatch, math, dtype, nd):
    """The weight gradient's shifted form (weight_forms.py, conv_direct.FORM forced) on channels-last stride-1
    convolutions with padding and dilation, and its replay, against torch in float64."""
    from blasx.dnn import conv_direct, weight_forms
    from blasx.dnn.geometry import conv_geometry
    if dtype == "float16" and math == "tf32":
        return
    monkeypatch.setattr(conv_direct, "FORM", "shifted")
    rng = np.random.default_rng(10 + nd)
    dt = np.dtype(dtype)
    size = (40,) if nd == 1 else (13, 11) if nd == 2 else (5, 6, 7)
    pad, dil = (2, 2) if nd == 2 else (1, 1)
    x = rng.standard_normal((3, 32, *size)).astype(dt)
    wshape = (24, 32, *(3,) * nd)
    assert weight_forms.weight_form(conv_geometry("t", nd, x, np.empty(wshape, dt), 1, pad, dil, 1), dt,
                                    "shifted", "cl") == "shifted"
    conv = getattr(F, f"conv{nd}d")(wide(x), wide(np.zeros(wshape, dt)), None, 1, pad, dil)
    dy = rng.standard_normal(tuple(conv.shape)).astype(dt)
    ref = getattr(torch.nn.grad, f"conv{nd}d_weight")(wide(x), wshape, wide(dy), 1, pad, dil).numpy()
    xd, dyd = _device(x, "cl"), _device(dy, "cl")
    for _ in range(2):  # the full path, then its replay
        gw = getattr(dnn, f"conv{nd}d_weight")(xd, wshape, dyd, 1, pad, dil, math=math)
        assert gw.dtype == dt and gw.shape == wshape
        assert rel(gw, ref) < DIRECT_TOL[(dtype, math)] * 2


@pytest.mark.parametrize("partials", [1 << 30, 3 * 40 * 24 * 4])
@pytest.mark.parametrize("math", ["ieee", "tf32"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_batched_weight_form_vs_torch(direct_route, monkeypatch, partials, math, dtype):
    """The NCHW pointwise weight gradient's batched form (forced), one partial sum an image or three shared by
    seven images (PARTIALS_BYTES), and its replay, against torch in float64."""
    from blasx.dnn import conv_direct, direct_cache, weight_forms
    if dtype == "float16" and math == "tf32":
        return
    monkeypatch.setattr(conv_direct, "FORM", "batched")
    monkeypatch.setattr(weight_forms, "PARTIALS_BYTES", partials)
    direct_cache.clear()  # plans and replays made under another budget
    rng = np.random.default_rng(31)
    dt = np.dtype(dtype)
    x = rng.standard_normal((7, 40, 9, 11)).astype(dt)
    dy = rng.standard_normal((7, 24, 9, 11)).astype(dt)
    ref = torch.nn.grad.conv2d_weight(wide(x), (24, 40, 1, 1), wide(dy)).numpy()
    for _ in range(3):  # the full path, then its replays
        gw = dnn.conv2d_weight(cupy.asarray(x), (24, 40, 1, 1), cupy.asarray(dy), math=math)
        assert gw.dtype == dt and rel(gw, ref) < DIRECT_TOL[(dtype, math)] * 2


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("kernel,stride,pad,groups,c", [(1, 1, 0, 1, 16), (3, 2, 1, 2, 8), (3, 1, 1, 1, 64),
                                                        (7, 2, 3, 1, 3)])
def test_replayed_calls_on_fresh_operands(direct_route, dtype, layout, kernel, stride, pad, groups, c):
    """Forward (plain, and with bias, residual and relu), backward-data and backward-weight called on new
    operands of one shape (later calls replay the first: conv_memo), every result against torch in float64, the
    poisoned memory a replay's allocations may reuse included."""
    from blasx.dnn import conv_memo
    rng = np.random.default_rng(7)
    dt = np.dtype(dtype)
    tol = DIRECT_TOL[(dtype, "ieee")]
    for i in range(4):
        x = rng.standard_normal((3, c, 13, 11)).astype(dt)
        w = (rng.standard_normal((12, c // groups, kernel, kernel)) / 4).astype(dt)
        ref = F.conv2d(wide(x), wide(w), None, stride, pad, 1, groups)
        dy = rng.standard_normal(tuple(ref.shape)).astype(dt)
        b, r = rng.standard_normal(12), rng.standard_normal(tuple(ref.shape)).astype(dt)
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.full(1 << 22, np.nan, dtype=cupy.float32)  # poison what the pool hands out next
        y = dnn.conv2d(_device(x, layout), _device(w, layout), None, stride, pad, 1, groups)
        assert rel(y, ref.numpy()) < tol, i
        yf = dnn.conv2d(_device(x, layout), _device(w, layout), b if i < 2 else cupy.asarray(b), stride, pad, 1,
                        groups, residual=_device(r, layout), activation="relu")  # numpy bias, then CuPy's
        assert rel(yf, F.relu(ref + torch.from_numpy(b)[:, None, None] + wide(r)).numpy()) < tol, i
        gi = dnn.conv2d_input(x.shape, _device(w, layout), _device(dy, layout), stride, pad, 1, groups)
        assert rel(gi, torch.nn.grad.conv2d_input(x.shape, wide(w), wide(dy), stride, pad, 1, groups).numpy()) < tol
        gw = dnn.conv2d_weight(_device(x, layout), w.shape, _device(dy, layout), stride, pad, 1, groups)
        assert gw.dtype == dt and gw.shape == w.shape
        assert rel(gw, torch.nn.grad.conv2d_weight(wide(x), w.shape, wide(dy), stride, pad, 1, groups).numpy()) < tol
    assert len(conv_memo._TABLE.entries) >= 2  # forward and weight at least (backward-data by phases is not kept)


@pytest.mark.parametrize("dtype,math", [*DIRECT_TOL, ("bfloat16", "ieee")])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("nd,c", [(1, 3), (2, 1), (2, 3), (2, 5), (3, 3)])
def test_few_channels_by_padded_rows_vs_torch(direct_route, dtype, math, nd, c, layout):
    """x of a few channels (an image's first layer) in either layout: col's rows padded to whole 16-byte runs by
    the run gather and the weight matrix alike (conv_direct.reduction_pad): forward with the epilogue and the
    weight gradient on new operands each call (later calls replay), against torch in float64."""
    from blasx.dnn import conv_direct, direct_cuda
    from blasx.dnn.geometry import conv_geometry
    dt = _bf16() if dtype == "bfloat16" else np.dtype(dtype)
    tol = DIRECT_TOL.get((dtype, math), 3e-2)
    rng = np.random.default_rng(c * nd)
    size = ((45,), (23, 19), (9, 8, 7))[nd - 1]
    fn, fwd, grad_w = (getattr(dnn, f"conv{nd}d"), getattr(F, f"conv{nd}d"),
                       getattr(torch.nn.grad, f"conv{nd}d_weight"))
    for i in range(3):
        x = rng.standard_normal((4, c, *size)).astype(dt)
        w = (rng.standard_normal((16, c, *(5,) * nd)) / 4).astype(dt)
        b = rng.standard_normal(16)
        ref = fwd(wide(x), wide(w), None, 2, 2)
        y = fn(_device(x, layout), _device(w, layout), cupy.asarray(b), 2, 2, activation="relu", math=math)
        assert y.dtype == dt and rel(y, F.relu(ref + torch.from_numpy(b)[(slice(None),) + (None,) * nd]).numpy()) < tol
        dy = rng.standard_normal(tuple(ref.shape)).astype(dt)
        gw = getattr(dnn, f"conv{nd}d_weight")(_device(x, layout), w.shape, _device(dy, layout), 2, 2, math=math)
        assert gw.dtype == dt and rel(gw, grad_w(wide(x), w.shape, wide(dy), 2, 2).numpy()) < tol
    geo = conv_geometry("t", nd, x, w, 2, 2, 1, 1)
    rows, run = conv_direct.reduction_pad(geo, layout == "cl", dt.itemsize)
    plan = direct_cuda.forward_plan(geo, layout == "cl", dt, 0.0, direct_cuda.budget(), math)
    assert conv_direct.padded_rows(plan.steps) == rows and rows % run == 0 and rows - geo.crs < run


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("kernel,stride,pad,groups,c", [(1, 1, 0, 1, 16), (3, 2, 1, 2, 8), (3, 1, 1, 1, 64),
                                                        (7, 2, 3, 1, 3)])
def test_weight_in_the_other_layout_replayed_as_it_changes(direct_route, dtype, layout, kernel, stride, pad, groups,
                                                           c):
    """x in ``layout``, the weight in the other (a channels-last x with torch's default contiguous weight): the
    replays (eager, captured, graph launches) make the weight's matrix again from its memory, so a weight changed
    in place between calls (an optimizer step) is read anew; against torch every call."""
    from blasx.dnn import conv_memo, direct_cache
    direct_cache.clear()  # (the memo too: this test's one kept call is counted below)
    rng = np.random.default_rng(8)
    dt = np.dtype(dtype)
    w = (rng.standard_normal((12, c // groups, kernel, kernel)) / 4).astype(dt)
    wd = _device(w, "nchw" if layout == "cl" else "cl")
    y = None
    for i in range(6):
        x = rng.standard_normal((3, c, 13, 11)).astype(dt)
        wd *= wd.dtype.type(0.9)  # in place: the same address, new values
        ref = F.conv2d(wide(x), wide(cupy.asnumpy(wd)), None, stride, pad, 1, groups)
        del y  # the output's block back to the pool: the next call's output lies there (captured, then launched)
        y = dnn.conv2d(_device(x, layout), wd, None, stride, pad, 1, groups)
        assert rel(y, ref.numpy()) < DIRECT_TOL[(dtype, "ieee")], i
    if layout == "cl":  # kept and replayed (an NCHW x's shifted form is not: its weight is another transform)
        assert len(conv_memo._TABLE.entries) == 1


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_col2im_transposed_vs_torch(direct_route, dtype, layout, nd):
    """Strided transposed convolutions and backward-data on CuPy operands (col2im.py: GEMMs into columns, the
    col2im kernel), with dilation, groups, output padding, bias and a channels-last weight, against torch."""
    rng = np.random.default_rng(nd)
    dt = np.dtype(dtype)
    size = (23,) if nd == 1 else (9, 7) if nd == 2 else (5, 4, 6)
    x = rng.standard_normal((3, 8, *size)).astype(dt)
    w = (rng.standard_normal((8, 5, *(3,) * nd)) / 4).astype(dt)
    b = rng.standard_normal(10)
    tol = DIRECT_TOL[(dtype, "ieee")]
    y = getattr(dnn, f"conv_transpose{nd}d")(_device(x, layout), _device(w, layout), cupy.asarray(b), stride=2,
                                             padding=1, output_padding=1, groups=2, dilation=2)
    ref = getattr(F, f"conv_transpose{nd}d")(wide(x), wide(w), torch.from_numpy(b), 2, 1, 1, 2, 2).numpy()
    assert isinstance(y, cupy.ndarray) and y.dtype == dt and rel(y, ref) < tol
    wf = (rng.standard_normal((8, 10, *(3,) * nd)) / 4).astype(dt)
    dy = rng.standard_normal((3, 8, *size)).astype(dt)
    xs = (3, 10, *(2 * s for s in size))
    gi = getattr(dnn, f"conv{nd}d_input")(xs, _device(wf, layout), _device(dy, layout), stride=2, padding=1)
    want = getattr(torch.nn.grad, f"conv{nd}d_input")(xs, wide(wf), wide(dy), 2, 1).numpy()
    assert rel(gi, want) < tol


def test_direct_route_is_chosen_for_one_gpu():
    from blasx.dnn import conv_direct
    x = cupy.zeros((1, 2, 4, 4), dtype=cupy.float32)
    assert conv_direct.applies(x, 1.0)
    assert not conv_direct.applies(np.zeros((1, 2, 4, 4), np.float32), 1.0)


def test_cupy_conv_leaves_the_engine_unstarted():
    """A convolution on CuPy arrays of one GPU runs on that GPU's direct route: the engine (whose tile
    cache takes much of each GPU's memory) is not started for it."""
    blasx.session.shutdown()
    x = cupy.asarray(np.random.default_rng(0).standard_normal((2, 8, 9, 9), dtype=np.float32))
    w = cupy.asarray(np.random.default_rng(1).standard_normal((4, 8, 3, 3), dtype=np.float32))
    y = dnn.conv2d(x, w, np.ones(4, np.float32), padding=1)
    ref = F.conv2d(wide(x.get()), wide(w.get()), torch.ones(4, dtype=torch.float64), padding=1).numpy()
    assert rel(y, ref) < TOL["float32"]
    assert blasx.session._engine is None


def _implicit_capable():
    from blasx.dnn import igemm
    return igemm.current_capable()


IMPLICIT_CASES = [  # (n, c, k, size, kernel, stride, padding, dilation)
    (3, 64, 24, (13, 11), 3, 1, 1, 1),
    (2, 128, 200, (9, 10), 3, 2, (0, 2), (2, 1)),  # K past a 128 tile, asymmetric geometry
    (2, 64, 8, (37,), 5, 3, 2, 2),
    (2, 64, 16, (4, 5, 6), 3, (1, 2, 1), 1, 1),
    (2, 512, 64, (7, 7), 3, 1, 1, 1),  # one row block: split k
    (4, 64, 72, (10, 10), 1, 2, 0, 1),  # a strided 1x1
    (2, 64, 40, (8, 9), 3, 1, "same", 1),
    (2, 256, 64, (9, 7), 1, 1, 0, 1),  # a 1x1 the kernel takes over cuBLAS (16-bit types)
]


@pytest.mark.skipif(not _implicit_capable(), reason="the implicit-GEMM kernel needs compute capability 9.0")
@pytest.mark.parametrize("dtype,math", [("float16", "ieee"), ("bfloat16", "ieee"), ("float32", "tf32")])
@pytest.mark.parametrize("case", IMPLICIT_CASES, ids=[str(i) for i in range(len(IMPLICIT_CASES))])
def test_implicit_form_vs_torch(direct_route, monkeypatch, dtype, math, case):
    """The implicit-GEMM form (igemm.py, chosen by the heuristic) on channels-last operands: plain, with the
    fused epilogue and a residual, on fresh operands again (a replay), on operands off a 16-byte boundary;
    a stride-1 backward-data through it; against torch in float64, the kernel's launches counted."""
    from blasx.dnn import conv_direct, conv_memo, igemm
    from blasx.dnn.geometry import conv_geometry
    n, c, k, size, kern, stride, pad, dil = case
    nd = len(size)
    dt = _bf16() if dtype == "bfloat16" else np.dtype(dtype)
    tol = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 5e-3}[dtype]
    calls = []
    launch = igemm.Launcher.__call__
    monkeypatch.setattr(igemm.Launcher, "__call__", lambda self, *a: (calls.append(self.launch.config),
                                                                      launch(self, *a))[1])
    rng = np.random.default_rng(c + k)
    geo = conv_geometry("t", nd, np.zeros((n, c, *size), np.float16), np.zeros((k, c, *(kern,) * nd), np.float16),
                        stride, pad, dil, 1)
    monkeypatch.setattr(conv_direct, "FORM", "implicit")  # (the heuristic takes im2col for small grids and 1x1s)
    assert conv_direct.forward_form(geo, dt, conv_direct.FORM, "cl", math) == "implicit"
    fn, fwd = getattr(dnn, f"conv{nd}d"), getattr(F, f"conv{nd}d")
    for i in range(2):
        x = rng.standard_normal((n, c, *size)).astype(np.float32)
        w = (rng.standard_normal((k, c, *(kern,) * nd)) / np.sqrt(c * kern ** nd)).astype(np.float32)
        xd, wd = _device(x.astype(dt), "cl"), _device(w.astype(dt), "cl")
        xr, wr = wide(x.astype(dt)), wide(w.astype(dt))
        conv = fwd(xr, wr, None, stride, pad, dil)
        y = fn(xd, wd, None, stride, pad, dil, math=math)
        assert y.dtype == dt and not y.flags.c_contiguous and rel(y, conv.numpy()) < tol, i
        r = rng.standard_normal(tuple(conv.shape)).astype(dt)
        b, sh = rng.standard_normal(k), rng.standard_normal(k)
        yf = fn(xd, wd, cupy.asarray(b), stride, pad, dil, shift=cupy.asarray(sh), residual=_device(r, "cl"),
                activation="relu", math=math)
        ch = (slice(None),) + (None,) * nd
        ref = F.relu(conv + torch.from_numpy(b + sh)[ch] + wide(r)).numpy()
        assert rel(yf, ref) < tol, i
    assert len(calls) == 4 and len(conv_memo._TABLE.entries) >= 1
    # operands one element past a 16-byte boundary: copied to aligned memory first
    xs = cupy.empty(xd.size + 1, dtype=xd.dtype)[1:]
    xs[...] = xd.transpose(0, *range(2, nd + 2), 1).ravel()
    xv = xs.reshape(xd.shape[0], *xd.shape[2:], xd.shape[1]).transpose(0, nd + 1, *range(1, nd + 1))
    assert xv.data.ptr % 16 and rel(fn(xv, wd, None, stride, pad, dil, math=math), conv.numpy()) < tol
    if stride == 1 and c == k:
        dy = rng.standard_normal(tuple(conv.shape)).astype(dt)
        gi = getattr(dnn, f"conv{nd}d_input")(x.shape, wd, _device(dy, "cl"), 1, pad, dil, math=math)
        want = getattr(torch.nn.grad, f"conv{nd}d_input")(x.shape, wr, wide(dy), 1, pad, dil).numpy()
        assert rel(gi, want) < tol


@pytest.mark.parametrize("dtype,math", [("float32", "ieee"), ("float32", "tf32"), ("float16", "ieee")])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("kernel,stride,pad,groups,c", [(1, 1, 0, 1, 64), (3, 2, 1, 2, 8), (3, 1, 1, 1, 64)])
def test_graph_replays_read_the_operands_contents_at_each_call(direct_route, dtype, math, layout, kernel, stride,
                                                               pad, groups, c):
    """A loop over fixed operands rewritten in place (a training step's x, weight and dY): forward (plain, and with
    a numpy bias whose values change at step 5, a CuPy shift changed at step 6 and a residual), backward-data and
    backward-weight called with their outputs released each time (CuPy's pool hands the same addresses back), so
    later calls launch CUDA graphs (call_graph.py); every result against torch in float64, on a stream of the
    caller's."""
    from blasx.dnn import conv_memo
    rng = np.random.default_rng(11)
    dt = np.dtype(dtype)
    tol = DIRECT_TOL[(dtype, math)]
    shape_x, shape_w = (4, c, 13, 11), (32, c // groups, kernel, kernel)
    xs, ws = _device(np.zeros(shape_x, dt), layout), _device(np.zeros(shape_w, dt), layout)
    ref_shape = F.conv2d(torch.zeros(shape_x), torch.zeros(shape_w), None, stride, pad, 1, groups).shape
    dys, res = (_device(np.zeros(tuple(ref_shape), dt), layout) for _ in range(2))
    shift = cupy.zeros(32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(8):
            xh = rng.standard_normal(shape_x).astype(dt)
            wh = (rng.standard_normal(shape_w) / 4).astype(dt)
            dyh, rh = (rng.standard_normal(tuple(ref_shape)).astype(dt) for _ in range(2))
            for dev, host in ((xs, xh), (ws, wh), (dys, dyh), (res, rh)):
                dev[...] = cupy.asarray(host)  # in place: the same addresses every step
            bias = np.linspace(-1, 1, 32) * (1 if i < 5 else -2)  # the same values, then others
            shift[...] = cupy.asarray(np.linspace(0, 1, 32) + (i >= 6))  # a CuPy vector, changed in place at 6
            y = dnn.conv2d(xs, ws, None, stride, pad, 1, groups, math=math)
            yf = dnn.conv2d(xs, ws, bias, stride, pad, 1, groups, shift=shift, residual=res, activation="relu",
                            math=math)
            gi = dnn.conv2d_input(shape_x, ws, dys, stride, pad, 1, groups, math=math)
            gw = dnn.conv2d_weight(xs, shape_w, dys, stride, pad, 1, groups, math=math)
            stream.synchronize()
            conv = F.conv2d(wide(xh), wide(wh), None, stride, pad, 1, groups)
            assert rel(y, conv.numpy()) < tol, i
            ch = torch.from_numpy(bias + cupy.asnumpy(shift))[:, None, None]
            assert rel(yf, F.relu(conv + ch + wide(rh)).numpy()) < tol, i
            want_i = torch.nn.grad.conv2d_input(shape_x, wide(wh), wide(dyh), stride, pad, 1, groups)
            want_w = torch.nn.grad.conv2d_weight(wide(xh), shape_w, wide(dyh), stride, pad, 1, groups)
            assert rel(gi, want_i.numpy()) < tol and rel(gw, want_w.numpy()) < tol, i
            assert (cupy.moveaxis(gw, 1, -1) if layout == "cl" else gw).flags.c_contiguous  # the operands' layout
            del y, yf, gi, gw
    replays = [getattr(r.run, "graphs", None) for r in conv_memo._TABLE.entries.values()]
    assert sum(g.replays for g in replays if g is not None) > 0 and all(g.fails == 0 for g in replays if g)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_strided_backward_data_by_phases(direct_route, monkeypatch, dtype, layout):
    """BLASX_CONV_FORM=phases: strided backward-data (and a transposed call) as stride-1 convolutions of the
    sub-kernels, in a loop over operands rewritten in place (replayed, then from CUDA graphs), against torch."""
    from blasx.dnn import conv_direct, conv_memo
    monkeypatch.setattr(conv_direct, "FORM", "phases")
    rng = np.random.default_rng(13)
    dt = np.dtype(dtype)
    tol = DIRECT_TOL[(dtype, "ieee")]
    shape_x, shape_w = (4, 64, 14, 13), (64, 64, 3, 3)
    ref = F.conv2d(torch.zeros(shape_x), torch.zeros(shape_w), None, 2, 1)
    dys, ws = _device(np.zeros(tuple(ref.shape), dt), layout), _device(np.zeros(shape_w, dt), "nchw")
    for i in range(6):
        dyh = rng.standard_normal(tuple(ref.shape)).astype(dt)
        wh = (rng.standard_normal(shape_w) / 8).astype(dt)
        dys[...], ws[...] = cupy.asarray(dyh), cupy.asarray(wh)
        gi = dnn.conv2d_input(shape_x, ws, dys, 2, 1, math="ieee")
        yt = dnn.conv_transpose2d(dys, ws, None, 2, 1, 1, math="ieee")
        cupy.cuda.get_current_stream().synchronize()
        want = torch.nn.grad.conv2d_input(shape_x, wide(wh), wide(dyh), 2, 1)
        assert rel(gi, want.numpy()) < tol, i
        assert rel(yt, F.conv_transpose2d(wide(dyh), wide(wh), None, 2, 1, 1).numpy()) < tol, i
        del gi, yt
    replays = [getattr(r.run, "graphs", None) for r in conv_memo._TABLE.entries.values()]
    assert sum(g.replays for g in replays if g is not None) > 0 and all(g.fails == 0 for g in replays if g)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("stride", [1, 2])
def test_transposed_replays_with_a_bias(direct_route, dtype, layout, stride):
    """conv_transpose2d with a bias in a loop over fixed operands rewritten in place: a numpy bias whose values
    change at step 5, and a CuPy bias changed in place at step 6; replayed (col2im's kernel reads the bias;
    stride 1: the bias as an epilogue) and launched from CUDA graphs, every result against float64 torch."""
    from blasx.dnn import conv_memo
    rng = np.random.default_rng(12)
    dt = np.dtype(dtype)
    tol = DIRECT_TOL[(dtype, "ieee")]
    shape_x, shape_w = (4, 64, 9, 7), (64, 32, 3, 3)
    xs, ws = _device(np.zeros(shape_x, dt), layout), _device(np.zeros(shape_w, dt), "nchw")
    bias_d = cupy.zeros(32, dtype=dt)
    for i in range(8):
        xh = rng.standard_normal(shape_x).astype(dt)
        wh = (rng.standard_normal(shape_w) / 8).astype(dt)
        xs[...], ws[...] = cupy.asarray(xh), cupy.asarray(wh)
        bias = (np.linspace(-1, 1, 32) * (1 if i < 5 else -2)).astype(dt)
        bias_d[...] = cupy.asarray(np.linspace(0, 1, 32) + (i >= 6), dtype=dt)
        y = dnn.conv_transpose2d(xs, ws, bias, stride, 1, stride - 1, math="ieee")
        yd = dnn.conv_transpose2d(xs, ws, bias_d, stride, 1, stride - 1, math="ieee")
        cupy.cuda.get_current_stream().synchronize()
        plain = F.conv_transpose2d(wide(xh), wide(wh), None, stride, 1, stride - 1)
        assert rel(y, (plain + torch.from_numpy(bias.astype(np.float64))[:, None, None]).numpy()) < tol, i
        want_d = plain + torch.from_numpy(cupy.asnumpy(bias_d).astype(np.float64))[:, None, None]
        assert rel(yd, want_d.numpy()) < tol, i
        del y, yd
    replays = [getattr(r.run, "graphs", None) for r in conv_memo._TABLE.entries.values()]
    assert sum(g.replays for g in replays if g is not None) > 0 and all(g.fails == 0 for g in replays if g)


@pytest.mark.parametrize("streams", ["own", "null", "shared"])
def test_graph_replays_from_threads_at_once(direct_route, in_threads, streams, monkeypatch):
    """Four threads each loop over their own operands of one shape (rewritten in place every step), on a
    stream of their own or all on the null stream (one shared arena for its graphs), or on streams of their own
    past cublas_call.MAX_STREAMS, eagerly (cuBLAS handles and workspaces shared, a weight-gradient GEMM long in k);
    every result against torch in float64: no thread ever reads another's scratch or result."""
    from blasx.dnn import call_graph, cublas_call
    hw = (13, 11)
    if streams == "shared":  # (every call eager: its GEMMs on the shared handles, none on a capture stream's)
        monkeypatch.setattr(cublas_call, "MAX_STREAMS", 0)
        monkeypatch.setattr(call_graph, "ENABLED", False)
        hw = (56, 48)
    shape_x, shape_w = (4, 64, *hw), (32, 64, 3, 3)
    ref_shape = (4, 32, *hw)
    results = {}

    def worker(t):
        r = np.random.default_rng(100 + t)
        xs = _device(np.zeros(shape_x, np.float32), "cl")
        ws = _device(np.zeros(shape_w, np.float32), "cl")
        dys = _device(np.zeros(ref_shape, np.float32), "cl")
        stream = cupy.cuda.Stream.null if streams == "null" else cupy.cuda.Stream(non_blocking=True)
        with stream:
            for i in range(8):
                xh, wh = r.standard_normal(shape_x), r.standard_normal(shape_w) / 8
                dyh = r.standard_normal(ref_shape)
                for dev, host in ((xs, xh), (ws, wh), (dys, dyh)):
                    dev[...] = cupy.asarray(host.astype(np.float32))
                y = dnn.conv2d(xs, ws, None, 1, 1)
                gw = dnn.conv2d_weight(xs, shape_w, dys, 1, 1)
                stream.synchronize()
                results[(t, i)] = (xh, wh, dyh, cupy.asnumpy(y), cupy.asnumpy(gw))
    in_threads(worker, 4)
    for (t, i), (xh, wh, dyh, y, gw) in results.items():
        xf, wf = torch.from_numpy(xh.astype(np.float32)).double(), torch.from_numpy(wh.astype(np.float32)).double()
        dyf = torch.from_numpy(dyh.astype(np.float32)).double()
        assert rel(y, F.conv2d(xf, wf, None, 1, 1).numpy()) < 1e-5, (t, i)
        assert rel(gw, torch.nn.grad.conv2d_weight(xf, shape_w, dyf, 1, 1).numpy()) < 1e-5, (t, i)
    assert len(results) == 32
    assert streams != "shared" or cublas_call._HANDLES.get(0)  # (the device's shared handles were used)


@pytest.mark.parametrize("kernel", ["plain", "paired", "vector"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (3, 40, 33, 2), (1, 64, 1, 70), (5, 33, 31, 17), (2, 5, 4, 3, 3),
                                   (3, 130, 10, 13), (2, 64, 66, 2), (2, 64, 8, 8), (3, 16, 12, 10), (2, 40, 7, 8),
                                   (1, 136, 9, 8)])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8"])
def test_transpose_kernel_both_ways(monkeypatch, shape, dtype, kernel):
    """The NCHW <-> channels-last copy (transpose_kernel: the vector or the paired kernel where it applies, and
    where switched on) against CuPy's strided copy, into poisoned memory; partial tiles both ways."""
    from blasx.dnn import transpose_kernel
    monkeypatch.setattr(transpose_kernel, "PAIRED", kernel == "paired")
    monkeypatch.setattr(transpose_kernel, "VECTOR", kernel == "vector")
    x = cupy.asarray((np.random.default_rng(1).standard_normal(shape) * 50).astype(dtype))
    moved = (shape[0], *shape[2:], shape[1])
    back = (0, len(shape) - 1, *range(1, len(shape) - 1))
    c = cupy.full(moved, 77, dtype=dtype).transpose(back)
    transpose_kernel.copy(c, x, True)
    assert c.base.flags.c_contiguous and bool((c == x).all())
    y = cupy.full(shape, 77, dtype=dtype)
    transpose_kernel.copy(y, c, False)
    assert bool((y == x).all())
