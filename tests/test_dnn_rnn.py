"""blasx.dnn recurrent layers against torch (CPU) autograd: outputs, final states and every gradient.

The reference runs in float64 on the parameters and inputs rounded to the tested dtype, so each dtype's error
is blasx's own: relative Frobenius norm below TOL (float64 1e-12; float32 1e-5; TF32 GEMMs 1e-2; float16 1e-2,
bfloat16 6e-2, both with float32 accumulation and cell state, y and h stored in their own type).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import blasx
from blasx import dnn
from blasx.dnn import rnn_multi, rnn_plan

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

TOL = {"float64": 1e-12, "float32": 1e-5, "tf32": 1e-2, "float16": 1e-2, "bfloat16": 6e-2}
GTOL = {"float64": 1e-11, "float32": 1e-4, "tf32": 3e-2, "float16": 3e-2, "bfloat16": 1.5e-1}
DT = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
      "tf32": np.float32}
FWD = {"lstm": dnn.lstm, "gru": dnn.gru}
BWD = {"lstm": dnn.lstm_backward, "gru": dnn.gru_backward}


def _err(a, ref) -> float:
    a = np.asarray(a).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(a - ref) / (den if den else 1.0))


def _module(mode, inp, hid, layers, bidir, bias, proj, bf, seed=0):
    torch.manual_seed(seed)
    kw = dict(num_layers=layers, bidirectional=bidir, bias=bias, batch_first=bf)
    if mode == "lstm":
        return torch.nn.LSTM(inp, hid, proj_size=proj, **kw).double()
    if mode == "gru":
        return torch.nn.GRU(inp, hid, **kw).double()
    return torch.nn.RNN(inp, hid, nonlinearity=mode[4:], **kw).double()


def compare(mode, *, T=5, B=3, I=4, H=6, layers=1, bidir=False, bias=True, proj=0, bf=False, lengths=None,
            dtype="float64", hx=True, backward=True, seed=0):
    """Run blasx and torch on one random problem; assert every output and gradient within tolerance."""
    m = _module(mode, I, H, layers, bidir, bias, proj, bf, seed)
    dt = np.dtype(DT[dtype])
    rng = np.random.default_rng(seed)
    with torch.no_grad():  # the reference sees exactly the tested dtype's values
        for p in m.parameters():
            p.copy_(torch.from_numpy(p.numpy().astype(dt).astype(np.float64)))
    params = {k: v.numpy().astype(dt) for k, v in m.state_dict().items()}
    xs = (B, T, I) if bf else (T, B, I)
    xn = rng.standard_normal(xs).astype(dt)
    nd, out = (2 if bidir else 1) * layers, proj or H
    h0 = rng.standard_normal((nd, B, out)).astype(dt) if hx else None
    c0 = rng.standard_normal((nd, B, H)).astype(dt) if hx else None
    x = torch.tensor(xn.astype(np.float64), requires_grad=True)
    th0 = None if h0 is None else torch.tensor(h0.astype(np.float64), requires_grad=True)
    tc0 = None if c0 is None else torch.tensor(c0.astype(np.float64), requires_grad=True)
    thx = (th0, tc0) if mode == "lstm" and hx else th0
    if lengths is not None:
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor(lengths), batch_first=bf)
        ty, tst = m(packed, thx)
        ty = torch.nn.utils.rnn.pad_packed_sequence(ty, batch_first=bf, total_length=T)[0]
    else:
        ty, tst = m(x, thx)
    kw = dict(num_layers=layers, bidirectional=bidir, batch_first=bf, lengths=lengths, training=True,
              math="tf32" if dtype == "tf32" else None)
    bhx = (h0, c0) if mode == "lstm" and hx else h0
    if mode == "lstm":
        y, (h_n, c_n), saved = dnn.lstm(xn, bhx, params, proj_size=proj, **kw)
        pairs = [(y, ty), (h_n, tst[0]), (c_n, tst[1])]
    elif mode == "gru":
        y, h_n, saved = dnn.gru(xn, bhx, params, **kw)
        pairs = [(y, ty), (h_n, tst)]
    else:
        y, h_n, saved = dnn.rnn(xn, bhx, params, nonlinearity=mode[4:], **kw)
        pairs = [(y, ty), (h_n, tst)]
    for got, ref in pairs:
        assert got.dtype == dt and got.shape == tuple(ref.shape)
        assert _err(got, ref.detach().numpy()) < TOL[dtype], (mode, dtype)
    if not backward:
        return
    gys = [rng.standard_normal(tuple(r.shape)).astype(dt) for _, r in pairs]
    if lengths is not None:  # padded outputs carry no gradient
        mask = (np.arange(T)[:, None] < np.asarray(lengths)[None, :])
        gys[0] = gys[0] * (mask.T if bf else mask)[..., None].astype(dt)
    torch.autograd.backward([r for _, r in pairs], [torch.tensor(g.astype(np.float64)) for g in gys])
    if mode == "lstm":
        g = dnn.lstm_backward(saved, *gys)
    elif mode == "gru":
        g = dnn.gru_backward(saved, *gys)
    else:
        g = dnn.rnn_backward(saved, *gys)
    want = {"input": x.grad, **({"h0": th0.grad} if hx else {}), **({"c0": tc0.grad} if hx and mode == "lstm" else {})}
    want.update({k: p.grad for k, p in m.named_parameters()})
    assert set(want) <= set(g)
    for k, ref in want.items():
        assert g[k].dtype == dt and g[k].shape == tuple(ref.shape), k
        assert _err(g[k], ref.numpy()) < GTOL[dtype], (mode, dtype, k, _err(g[k], ref.numpy()))


@pytest.fixture(autouse=True)
def _cpu():
    blasx.configure(devices="cpu")
    yield
    blasx.shutdown()


@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
@pytest.mark.parametrize("layers,bidir,bias,bf,lengths", [
    (1, False, True, False, None), (2, True, False, True, None), (3, False, True, False, [5, 3, 1]),
    (2, True, True, True, [5, 5, 5]), (1, True, True, False, [1, 1, 1])])
def test_modes_vs_torch(mode, layers, bidir, bias, bf, lengths):
    compare(mode, layers=layers, bidir=bidir, bias=bias, bf=bf, lengths=lengths)


@pytest.mark.parametrize("layers,bidir,lengths", [(1, False, None), (2, True, [5, 4, 2]), (2, False, [3, 3, 1])])
def test_lstm_projection(layers, bidir, lengths):
    compare("lstm", layers=layers, bidir=bidir, proj=3, lengths=lengths)


@pytest.mark.parametrize("dtype", ["float32", "tf32", "float16", "bfloat16"])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_dtypes(mode, dtype):
    compare(mode, layers=2, bidir=True, lengths=[5, 4, 1], dtype=dtype, T=6, B=3, I=8, H=16)


@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_uninitialised_memory_never_reaches_a_result(monkeypatch, mode):
    """Every numpy.empty / empty_like the call makes returns NaN (reused memory may hold anything): outputs and
    gradients still match torch, variable lengths and a projection included (rows past a sequence's end are
    never written)."""
    real, real_like = np.empty, np.empty_like

    def poisoned(shape, dtype=float, *a, **k):
        out = real(shape, dtype, *a, **k)
        if out.dtype.kind in "fc":
            out.fill(np.nan)
        return out

    def poisoned_like(proto, dtype=None, *a, **k):
        out = real_like(proto, dtype, *a, **k)
        if out.dtype.kind in "fc":
            out.fill(np.nan)
        return out
    monkeypatch.setattr(np, "empty", poisoned)
    monkeypatch.setattr(np, "empty_like", poisoned_like)
    compare(mode, layers=2, bidir=True, proj=3 if mode == "lstm" else 0, lengths=[5, 4, 2])


def test_lstm_projection_half():
    compare("lstm", layers=2, proj=4, dtype="float16", H=8)


@pytest.mark.parametrize("devices", ["sim:1", "sim:2", "sim:3"])
@pytest.mark.parametrize("mode,layers,bidir,B,proj,kind", [
    ("lstm", 3, False, 3, 0, "diagonal"), ("gru", 4, False, 3, 0, "diagonal"), ("lstm", 3, False, 3, 2, "wavefront"),
    ("gru", 2, True, 3, 0, "directions"), ("rnn_tanh", 1, False, 130, 0, "batch")])
def test_sims_placements(devices, mode, layers, bidir, B, proj, kind):
    blasx.configure(devices=devices)
    lengths = [5] * (B // 2) + [3] * (B - B // 2) if B > 3 else [5, 4, 2]
    compare(mode, layers=layers, bidir=bidir, B=B, H=5, proj=proj, lengths=lengths,
            dtype="float32" if B > 3 else "float64")
    run = rnn_multi.last_run()
    assert run["placement"].kind == (kind if devices != "sim:1" else "single")
    if kind == "directions" and devices != "sim:1":
        assert {run["ran_on"][(0, 0)], run["ran_on"][(0, 1)]} == {0, 1}
    if kind in ("wavefront", "diagonal") and devices == "sim:3":
        want = [layer * 3 // layers for layer in range(layers)]
        assert [run["ran_on"][(layer, 0)] for layer in range(layers)] == want


@pytest.mark.parametrize("mode,proj", [("lstm", 0), ("lstm", 3), ("gru", 0), ("rnn_tanh", 0)])
@pytest.mark.parametrize("hx", [True, False])
def test_wavefront_pieces_every_mode(monkeypatch, mode, proj, hx):
    """A wavefront of 3 layers on sim:2 in pieces of 2 steps (the last of 1), each piece a one-layer loop from the
    states the piece before left: outputs and gradients as torch's, with and without initial states."""
    blasx.configure(devices="sim:2")
    pl = rnn_plan.Placement("wavefront", 2, ((0,), (0,), (1,)), chunk=2)
    monkeypatch.setattr(rnn_plan, "plan", lambda *a, **k: pl)
    compare(mode, layers=3, T=7, B=4, H=5, proj=proj, hx=hx, lengths=[7, 6, 6, 3])
    run = rnn_multi.last_run()
    assert run["placement"] is pl and [run["ran_on"][(layer, 0)] for layer in range(3)] == [0, 0, 1]


@pytest.mark.parametrize("devices,cells,lanes", [("sim:1", ((0,),) * 3, (0, 1, 2)),
                                                  ("sim:2", ((0,), (0,), (1,)), (0, 1, 0))])
def test_wavefront_of_lanes(monkeypatch, devices, cells, lanes):
    """A wavefront of 3 layers in lanes (a stream a layer of a device on CUDA; on one device, or two lanes on the
    first of two) and pieces of 2 steps, its backward in the same pieces: outputs and gradients as torch's; each
    layer keeps its lane for the backward."""
    from blasx.dnn import rnn_wave_backward
    monkeypatch.setattr(rnn_wave_backward, "ALWAYS", True)
    seen = []
    real = rnn_wave_backward.run
    monkeypatch.setattr(rnn_wave_backward, "run", lambda *a: seen.append([k[0].lane for k in a[1]]) or real(*a))
    blasx.configure(devices=devices)
    pl = rnn_plan.Placement("wavefront", len({c[0] for c in cells}), cells, chunk=2, lanes=lanes)
    monkeypatch.setattr(rnn_plan, "plan", lambda *a, **k: pl)
    compare("lstm", layers=3, T=7, B=4, H=5, lengths=[7, 6, 6, 3])
    assert rnn_multi.last_run()["placement"] is pl and seen == [list(lanes)]


@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_backward_recurrent_gemm_in_k_slices(monkeypatch, mode, splits):
    """rnn_layer.backward_steps with the recurrent GEMM in k slices (CUDA's step_splits, forced on the host): the
    partial sums ping-pong as stacks the next cell sums (GRU's own part in the last), carried rows past a
    sequence's end in the first part; every gradient as torch's, with variable lengths and both directions."""
    from blasx.dnn import rnn_layer
    calls = []

    def splits_of(f, k, h):
        calls.append(k)
        return splits
    monkeypatch.setattr(rnn_layer.HostOps, "step_splits", staticmethod(splits_of))
    compare(mode, layers=2, bidir=True, T=6, B=4, H=6, lengths=[6, 5, 3, 1])
    assert calls and all(k % splits == 0 for k in calls)


def test_step_splits_rule():
    """CudaOps.step_splits: STEP_SPLITS slices of 256+ for float32 gradients (TF32 at any size, IEEE up to hidden
    1024), none for other types, narrow k or uneven slices."""
    from blasx.dnn import rnn_layer
    ops = rnn_layer.CudaOps.__new__(rnn_layer.CudaOps)
    n = rnn_layer.STEP_SPLITS
    for math, f, k, h, want in [("tf32", np.float32, 4096, 1024, n), ("tf32", np.float32, 8192, 2048, n),
                                ("ieee", np.float32, 4096, 1024, n), ("ieee", np.float32, 8192, 2048, 1),
                                ("tf32", np.float64, 4096, 1024, 1), ("tf32", np.float32, 1024, 1024, 1),
                                ("tf32", np.float32, 3 * 683, 683, 1), ("ieee", np.float32, 3 * 1024, 1024, n)]:
        ops.math = math
        assert ops.step_splits(np.dtype(f), k, h) == want, (math, f, k, h)


def test_weight_gradients_beside_only_in_a_one_device_whole_call_capture(monkeypatch):
    """rnn_exec._side_weights: a layer's weight GEMMs leave the critical path only inside a whole-call capture
    (where the side stream is part of the graph), with every direction on the caller's device, and on CuPy."""
    from types import SimpleNamespace as NS

    from blasx.dnn import rnn_exec, rnn_layer
    cupy_like = NS()
    pb = NS(xp=cupy_like)
    here, there = [[NS(dev=0)], [NS(dev=0), NS(dev=0)]], [[NS(dev=0)], [NS(dev=1)]]
    assert not rnn_exec._side_weights(pb, here, 0)  # not capturing
    with rnn_layer.whole_call_capture({}):
        assert rnn_exec._side_weights(pb, here, 0)
        assert not rnn_exec._side_weights(pb, there, 0)  # a direction on another GPU
        assert not rnn_exec._side_weights(NS(xp=np), here, None)  # host arrays
        monkeypatch.setattr(rnn_exec, "SIDE_WEIGHTS", False)
        assert not rnn_exec._side_weights(pb, here, 0)


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_bidirectional_backward_on_two_sims(mode):
    """On sim:2 each direction's backward runs on the device its forward ran on (the two at once); every gradient
    equals the one-device result."""
    T, B, I, H, L = 6, 4, 5, 7, 2
    lengths = [6, 5, 5, 2]
    rng = np.random.default_rng(3)
    params = {k: v.numpy() for k, v in _module(mode, I, H, L, True, True, 0, False).state_dict().items()}
    x = rng.standard_normal((T, B, I))
    h0, c0 = rng.standard_normal((2 * L, B, H)), rng.standard_normal((2 * L, B, H))
    gy = rng.standard_normal((T, B, 2 * H)) * (np.arange(T)[:, None] < np.asarray(lengths))[..., None]
    gh, gc = rng.standard_normal((2 * L, B, H)), rng.standard_normal((2 * L, B, H))

    def run(devices):
        blasx.configure(devices=devices)
        kw = dict(num_layers=L, bidirectional=True, lengths=lengths, training=True)
        if mode == "lstm":
            y, _, saved = dnn.lstm(x, (h0, c0), params, **kw)
            g = dnn.lstm_backward(saved, gy, gh, gc)
        else:
            y, _, saved = dnn.gru(x, h0, params, **kw)
            g = dnn.gru_backward(saved, gy, gh)
        return y, g, rnn_multi.last_run()
    y1, g1, run1 = run("sim:1")
    y2, g2, run2 = run("sim:2")
    assert run1["backward_on"] == {(layer, d): 0 for layer in range(L) for d in range(2)}
    assert run2["placement"].kind == "directions"
    assert run2["ran_on"] == run2["backward_on"] == {(layer, d): d for layer in range(L) for d in range(2)}
    assert _err(y2, y1) <= 1e-12
    assert set(g1) == set(g2)
    for k in g1:
        assert g2[k].dtype == np.float64 and g2[k].shape == g1[k].shape, k
        assert _err(g2[k], g1[k]) <= 1e-12, (k, _err(g2[k], g1[k]))


def test_plan_rules():
    assert rnn_plan.plan(4, 1, 64, 100, 1) == rnn_plan.Placement("single", 1, ((0,),) * 4)
    assert rnn_plan.plan(4, 1, 64, 100, 1, projection=True) == rnn_plan.Placement("single", 1, ((0,),) * 4)
    assert rnn_plan.plan(4, 1, 64, 100, 2) == rnn_plan.Placement("diagonal", 2, ((0,), (0,), (1,), (1,)), chunk=7)
    assert rnn_plan.plan(4, 1, 64, 100, 2, projection=True) == rnn_plan.Placement(
        "wavefront", 2, ((0,), (0,), (1,), (1,)), chunk=25)  # 4 pieces: 2 a group
    assert rnn_plan.plan(3, 1, 64, 100, 8) == rnn_plan.Placement("diagonal", 3, ((0,), (1,), (2,)), chunk=5)
    assert rnn_plan.plan(2, 1, 8, 1000, 2).chunk == rnn_plan.MAX_CHUNK
    assert rnn_plan.plan(2, 2, 64, 100, 4) == rnn_plan.Placement("directions", 2, ((0, 1), (0, 1)))
    assert rnn_plan.plan(1, 1, 256, 100, 4) == rnn_plan.Placement("batch", 4, ((0,),), rows=((0, 64), (64, 128),
                                                                                              (128, 192), (192, 256)))
    assert rnn_plan.plan(1, 1, 130, 100, 4) == rnn_plan.Placement("batch", 2, ((0,),), rows=((0, 65), (65, 130)))
    assert rnn_plan.plan(1, 1, 100, 100, 4).kind == "single"
    # wide (tensor-core math): a stack without a projection layer after layer on x's device, its GEMMs local there
    # on several devices; a projection, a bidirectional layer and one layer as in float32 IEEE
    for wide in ("reduced", "tf32"):
        assert rnn_plan.plan(4, 1, 64, 100, 2, wide=wide) == rnn_plan.Placement("single", 1, ((0,),) * 4, local=True)
        assert rnn_plan.plan(4, 1, 64, 100, 1, wide=wide) == rnn_plan.Placement("single", 1, ((0,),) * 4)
    # TF32 inference on several devices: a wavefront of 2 pieces a group
    assert rnn_plan.plan(4, 1, 64, 100, 2, wide="tf32", training=False) == rnn_plan.Placement(
        "wavefront", 2, ((0,), (0,), (1,), (1,)), chunk=25)
    assert rnn_plan.plan(4, 1, 64, 100, 1, wide="tf32", training=False).kind == "single"
    assert rnn_plan.plan(4, 1, 64, 76, 2, wide="tf32", training=False).kind == "single"  # pieces of 19 steps
    assert rnn_plan.plan(4, 1, 64, 80, 2, wide="tf32", training=False).chunk == 20
    assert rnn_plan.plan(4, 1, 64, 100, 2, wide="reduced", training=False).kind == "single"
    assert rnn_plan.plan(4, 1, 64, 100, 2, projection=True, wide="tf32") == rnn_plan.plan(4, 1, 64, 100, 2,
                                                                                         projection=True)
    assert rnn_plan.plan(2, 2, 64, 100, 4, wide="tf32") == rnn_plan.plan(2, 2, 64, 100, 4)
    assert rnn_plan.plan(1, 1, 256, 100, 4, wide="tf32").kind == "batch"
    # captured whole (rnn_replay): float32 and float64 inference stacks as a wavefront of 4 pieces a group
    for wide in (None, "tf32"):
        assert rnn_plan.plan(4, 1, 64, 100, 2, wide=wide, training=False, captured=True) == rnn_plan.Placement(
            "wavefront", 2, ((0,), (0,), (1,), (1,)), chunk=13, lanes=(0, 1, 0, 1))
    assert rnn_plan.plan(4, 1, 64, 56, 2, training=False, captured=True).kind == "diagonal"  # pieces of 7 steps
    assert rnn_plan.plan(4, 1, 64, 64, 2, training=False, captured=True).chunk == 8
    assert rnn_plan.plan(4, 1, 64, 100, 2, wide="reduced", training=False, captured=True).kind == "single"
    assert rnn_plan.plan(4, 1, 64, 100, 2, captured=True).kind == "diagonal"  # (float32 IEEE training: not captured)
    # TF32 training captured whole: the wavefront too (its captured backward runs in the same pieces), each device's
    # group of layers in GPU_LANES lanes (contiguous runs)
    assert rnn_plan.plan(4, 1, 64, 100, 2, wide="tf32", captured=True) == rnn_plan.Placement(
        "wavefront", 2, ((0,), (0,), (1,), (1,)), chunk=13, lanes=(0, 1, 0, 1))
    assert rnn_plan.plan(5, 1, 64, 100, 2, wide="tf32", captured=True).lanes == (0, 0, 1, 0, 1)
    assert rnn_plan.plan(4, 1, 64, 100, 2, wide="reduced", captured=True).kind == "single"
    # ... and on one device as a wavefront of lanes (a stream a layer, at most 4), 8 pieces a layer
    for wide, training in ((None, False), (None, True), ("tf32", False), ("tf32", True)):
        assert rnn_plan.plan(4, 1, 64, 100, 1, wide=wide, training=training, captured=True, hidden=1024) == \
            rnn_plan.Placement("wavefront", 1, ((0,),) * 4, chunk=13, lanes=(0, 1, 2, 3))
    assert rnn_plan.plan(6, 1, 64, 100, 1, training=False, captured=True).lanes == (0, 0, 1, 2, 2, 3)
    # float32 IEEE inference on several devices: lanes within the work bound only; GPU_LANES 1: none
    assert rnn_plan.plan(4, 1, 64, 100, 2, training=False, captured=True, hidden=1024).lanes == (0, 1, 0, 1)
    assert rnn_plan.plan(4, 1, 128, 100, 2, training=False, captured=True, hidden=2048) == rnn_plan.Placement(
        "wavefront", 2, ((0,), (0,), (1,), (1,)), chunk=13)
    rnn_plan.GPU_LANES = 1
    rnn_plan.plan.cache_clear()
    try:
        assert rnn_plan.plan(4, 1, 64, 100, 2, wide="tf32", captured=True).lanes == ()
    finally:
        rnn_plan.GPU_LANES = 2
        rnn_plan.plan.cache_clear()
    # float32 IEEE and float64 steps past 128 x 1024 fill the GPU alone: no lanes; TF32 keeps them
    assert rnn_plan.plan(4, 1, 128, 100, 1, training=False, captured=True, hidden=1024).kind == "wavefront"
    assert rnn_plan.plan(4, 1, 128, 100, 1, training=False, captured=True, hidden=2048).kind == "single"
    assert rnn_plan.plan(4, 1, 128, 100, 1, wide="tf32", captured=True, hidden=2048).kind == "wavefront"
    assert rnn_plan.plan(4, 1, 64, 56, 1, training=False, captured=True).kind == "single"  # pieces of 7 steps
    assert rnn_plan.plan(4, 1, 64, 100, 1, wide="reduced", training=False, captured=True).kind == "single"
    assert rnn_plan.plan(4, 1, 64, 100, 1, training=False).kind == "single"
    assert rnn_plan.plan(4, 1, 64, 100, 2, projection=True, training=False, captured=True).chunk == 25
    assert rnn_plan.plan(2, 2, 64, 100, 2, training=False, captured=True).kind == "directions"
    # a one-layer call left on one device of several keeps its GEMMs there; on one device there is nothing to keep
    assert rnn_plan.plan(1, 1, 64, 100, 2) == rnn_plan.Placement("single", 1, ((0,),), local=True)
    assert not rnn_plan.plan(1, 1, 64, 100, 1).local and not rnn_plan.plan(2, 2, 64, 100, 1).local


@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_local_gemms_vs_torch(mode):
    """A one-layer call too small to split over two devices runs on x's device with its GEMMs ("single", local);
    forward and backward match torch."""
    blasx.configure(devices="sim:2")
    compare(mode, T=6, B=3, I=8, H=16, dtype="float32")
    assert rnn_multi.last_run()["placement"] == rnn_plan.Placement("single", 1, ((0,),), local=True)


@pytest.mark.parametrize("dtype", ["float32", "tf32", "float16", "bfloat16"])
@pytest.mark.parametrize("mode,layers,bidir", [("lstm", 3, False), ("gru", 3, False), ("lstm", 2, True)])
@pytest.mark.parametrize("devices", ["cpu", "sim:2"])
def test_wide_stack_vs_torch(devices, mode, layers, bidir, dtype):
    """A stack in tensor-core math runs on x's device alone ("single"), float32 IEEE diagonally over several
    devices, a bidirectional stack a direction per device in every math; all match torch, both passes."""
    blasx.configure(devices=devices)
    compare(mode, layers=layers, bidir=bidir, dtype=dtype, T=6, B=3, I=8, H=16)
    kind = rnn_multi.last_run()["placement"].kind
    if bidir:
        assert kind == ("directions" if devices == "sim:2" else "single")
    else:
        assert kind == ("diagonal" if dtype == "float32" and devices == "sim:2" else "single")


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_tf32_inference_stack_runs_as_a_wavefront(mode, monkeypatch):
    """TF32 inference of a stack on two devices: the wavefront (training keeps it on x's device); outputs as
    torch's."""
    blasx.configure(devices="sim:2")
    monkeypatch.setattr(rnn_plan, "MIN_PIECE_STEPS", 1)  # (pieces of 3 steps here)
    rnn_plan.plan.cache_clear()
    try:
        compare(mode, layers=3, dtype="tf32", T=9, B=3, I=8, H=16, backward=False)
        assert rnn_multi.last_run()["placement"].kind == "single"  # (compare calls with training=True)
        rng = np.random.default_rng(0)
        m = _module(mode, 8, 16, 3, False, True, 0, False, 0)
        params = {k: v.numpy().astype(np.float32) for k, v in m.state_dict().items()}
        x = rng.standard_normal((9, 3, 8)).astype(np.float32)
        fn = dnn.lstm if mode == "lstm" else dnn.gru
        y = fn(x, None, params, num_layers=3, math="tf32")[0]
        assert rnn_multi.last_run()["placement"].kind == "wavefront"
    finally:
        rnn_plan.plan.cache_clear()
    with torch.no_grad():
        ref = m(torch.from_numpy(x.astype(np.float64)))[0].numpy()
    assert _err(y, ref) < TOL["tf32"]


def test_diagonal_order(monkeypatch):
    """Each diagonal step (one group, on one device) advances every layer of the group at once: layer l at step s
    works on time s - l (idle outside 0..T-1), and the backward visits the same (step, layer, time) triples in
    reverse."""
    from blasx.dnn import rnn_diag_cells, rnn_layer
    seen = {"fwd": [], "bwd": []}
    real_f, real_b = rnn_diag_cells.np_forward, rnn_diag_cells.np_backward

    def fwd(mode, o, bias, p0, cp, co, g, dp, do, act, first):
        seen["fwd"].append(tuple(int(a) for a in act))
        real_f(mode, o, bias, p0, cp, co, g, dp, do, act, first)

    def bwd(mode, en, ec, ext, dhn, dc, g, c, cp, d, dp, dg, act, s, T):
        seen["bwd"].append((s, tuple(int(a) for a in act)))
        real_b(mode, en, ec, ext, dhn, dc, g, c, cp, d, dp, dg, act, s, T)
    monkeypatch.setattr(rnn_layer.HostOps, "diag_forward", staticmethod(fwd))
    monkeypatch.setattr(rnn_layer.HostOps, "diag_backward", staticmethod(bwd))
    monkeypatch.setattr(rnn_plan, "plan", lambda *a, **k: rnn_plan.Placement("diagonal", 1, ((0,),) * 3))
    compare("lstm", layers=3, T=4, B=3, lengths=[4, 2, 1])
    bs = (3, 2, 1, 1)
    want = [tuple(bs[s - l] if 0 <= s - l < 4 else -1 for l in range(3)) for s in range(6)]
    assert seen["fwd"] == want
    assert seen["bwd"] == [(s, want[s]) for s in range(5, -1, -1)]


def test_state_dict_tensors_and_unbatched():
    m = torch.nn.GRU(3, 4, num_layers=2).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    ty, th = m(x)
    y, h = dnn.gru(x.numpy(), None, m.state_dict(), num_layers=2)  # torch tensors as they are; 2-D x
    assert y.shape == (6, 4) and h.shape == (2, 4)
    assert _err(y, ty.detach().numpy()) < 1e-12 and _err(h, th.detach().numpy()) < 1e-12


def test_no_grad_inputs_defaults():
    m = torch.nn.LSTM(3, 4).double()
    x = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    y, (h, c) = m(x)
    y.sum().backward()
    _, _, saved = dnn.lstm(x.detach().numpy(), None, m.state_dict(), training=True)
    g = dnn.lstm_backward(saved, np.ones((4, 2, 4)))
    assert _err(g["input"], x.grad.numpy()) < 1e-12
    assert _err(g["weight_hh_l0"], m.weight_hh_l0.grad.numpy()) < 1e-12


@settings(max_examples=6, deadline=None)
@given(mode=st.sampled_from(["lstm", "gru", "rnn_tanh", "rnn_relu"]), layers=st.integers(1, 2),
       bidir=st.booleans(), bf=st.booleans(), T=st.integers(1, 4), B=st.integers(1, 3), seed=st.integers(0, 99))
def test_random_configs(mode, layers, bidir, bf, T, B, seed):
    blasx.configure(devices="cpu")
    lengths = sorted(np.random.default_rng(seed).integers(1, T + 1, size=B).tolist(), reverse=True)
    compare(mode, T=T, B=B, layers=layers, bidir=bidir, bf=bf, lengths=lengths, seed=seed)


@pytest.mark.parametrize("lengths", [None, [7, 5, 5, 2]])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_wavefront_backward_in_pieces_vs_torch(dtype, lengths, monkeypatch):
    """rnn_wave_backward (taken inside whole-call captures; here everywhere): a projected stack's wavefront backward
    in its time pieces over two devices (the last piece first, state gradients carried between pieces, weight
    gradients summed over them) gives torch's gradients."""
    from blasx.dnn import rnn_wave_backward
    monkeypatch.setattr(rnn_wave_backward, "ALWAYS", True)
    calls = []
    real = rnn_wave_backward.run
    monkeypatch.setattr(rnn_wave_backward, "run", lambda *a: calls.append(a[1][0][0].pieces) or real(*a))
    blasx.configure(devices="sim:2")
    compare("lstm", T=7, B=4, layers=3, proj=3, lengths=lengths, dtype=dtype)
    assert rnn_multi.last_run()["placement"].kind == "wavefront"
    assert calls == [((0, 2), (2, 4), (4, 6), (6, 7))]
    assert rnn_multi.last_run()["backward_on"] == {(0, 0): 0, (1, 0): 0, (2, 0): 1}


def test_wavefront_backward_stays_layer_after_layer_outside_captures_and_in_half_types():
    """Pieces only where no host time is spent a piece (a whole-call capture), never for 2-byte types."""
    from blasx.dnn import rnn_wave_backward

    class _K:
        pieces = ((0, 2), (2, 4))

    class _Pb:
        xp = np
        x = np.zeros((4, 1, 1), np.float32)
    assert not rnn_wave_backward.applies(_Pb, [[_K()]])
    rnn_wave_backward.ALWAYS = True
    try:
        assert rnn_wave_backward.applies(_Pb, [[_K()]])
        _Pb.x = np.zeros((4, 1, 1), np.float16)
        assert not rnn_wave_backward.applies(_Pb, [[_K()]])
        assert not rnn_wave_backward.applies(_Pb, [[_K(), _K()]])  # (a direction each: not a wavefront)
    finally:
        rnn_wave_backward.ALWAYS = False


@dataclasses.dataclass
class _WavePb:
    """What rnn_wave_backward.run reads of a problem (the tests on the CPU stand-in for CuPy)."""
    xp: object
    spec: object
    x: object
    bs: tuple
    math: str
    lengths: object = None


def test_wavefront_backward_inside_a_capture_forks_a_stream_per_device_and_joins_into_it(monkeypatch):
    """rnn_wave_backward.run inside a whole-call capture (the CPU stand-in for CuPy): the pieces last-first, each
    piece top layer first, each layer on its forward's device and that device's side stream (forked from the
    capture: they wait for its event), state gradients carried from the piece after, an event where a piece's
    input gradient crosses to the other device and a wait for it there, both streams joined into the capture;
    weight gradients summed over the pieces and brought home."""
    import types

    from bench import fake_cupy
    from blasx.dnn import rnn_layer, rnn_wave_backward
    monkeypatch.setattr(rnn_multi, "_local", lambda pb, dev, home, only=None: pb)
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        L, T, B, O = 3, 6, 2, 4
        pieces = ((0, 2), (2, 4), (4, 6))
        on = [0, 0, 1]

        def arr(shape, dev):
            with cupy.cuda.Device(dev):
                return cupy.zeros(shape, dtype=np.float32)
        layers = [[rnn_multi.Kept(d, arr((T, B, O), d), rnn_layer.Forward(arr((T + 1, B, O), d), None,
                                                                           arr((T, B, 4 * O), d), None),
                                  True, pieces)] for d in on]
        pb = _WavePb(cupy, types.SimpleNamespace(num_layers=L), arr((T, B, O), 0), (B,) * T, "tf32")
        seen = []

        def direction(lp, ops, layer, k, mm, args, defer):
            seen.append((layer, k.inp.shape[0], cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr,
                         args[0] is not None, args[1] is not None))
            defer.append(((arr((2, 2), on[layer]), None), lambda ops: {f"weight_hh_l{layer}": ops[0]}))
            return {}, arr((k.inp.shape[0], B, O), on[layer]), arr((B, O), on[layer]), None
        cap = cupy.cuda.Stream(non_blocking=True)
        with cap, rnn_layer.whole_call_capture({0: None, 1: None}):
            cap.begin_capture()
            assert rnn_wave_backward.applies(pb, layers)
            grads, dx, dhs, dcs = rnn_wave_backward.run(pb, layers, arr((T, B, O), 0), None, None, direction)
            graph = cap.end_capture()
    order = [(layer, dev) for layer, _, dev, _, _, _ in seen]
    assert order == [(2, 1), (1, 0), (0, 0)] * 3 and [n for _, n, _, _, _, _ in seen] == [2] * 9
    streams = {dev: {s for _, _, d, s, _, _ in seen if d == dev} for dev in (0, 1)}
    assert all(len(v) == 1 for v in streams.values()) and cap.ptr not in streams[0] | streams[1]
    assert streams[0] != streams[1]
    # dy into every piece of every layer; the final states' gradients only into the last piece (none given)
    assert all(has_dy for *_, has_dy, _ in seen) and [has_dh for *_, has_dh in seen] == [False] * 3 + [True] * 6
    (s0,), (s1,) = streams[0], streams[1]
    ops = [(e[0], e[1]) for e in graph.entries if e[0] in ("event_record", "wait_event")]
    assert ops[:3] == [("event_record", cap.ptr), ("wait_event", s0), ("wait_event", s1)]  # forked
    assert ops[3:9] == [("event_record", s1), ("wait_event", s0)] * 3  # a crossing a piece, layer 2 -> layer 1
    assert ops[-2:] == [("wait_event", cap.ptr), ("wait_event", cap.ptr)]  # joined
    assert sorted(grads) == ["weight_hh_l0", "weight_hh_l1", "weight_hh_l2"] and dx.shape == (T, B, O)
    assert all(g.shape == (2 * len(pieces), 2) for g in grads.values())  # (each one GEMM over its pieces' rows)
    assert len(dhs) == L and dcs == [None] * L


def test_wavefront_lanes_of_one_device_inside_a_capture_each_have_a_stream_and_a_workspace(monkeypatch):
    """rnn_wave_backward.run of a one-device wavefront of lanes (rnn_plan.Placement.lanes; the CPU stand-in for
    CuPy): each layer on its lane's own side stream of device 0, an event and a wait where a piece's input gradient
    crosses lanes (no copy: one device), the second and third lanes with a cuBLAS workspace of their own in the
    capture's table (the first uses the device's), every lane joined into the capture."""
    import types

    from bench import fake_cupy
    from blasx.dnn import rnn_layer, rnn_wave_backward
    monkeypatch.setattr(rnn_multi, "_local", lambda pb, dev, home, only=None: pb)
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        L, T, B, O = 3, 4, 2, 4
        pieces = ((0, 2), (2, 4))

        def arr(shape):
            return cupy.zeros(shape, dtype=np.float32)
        layers = [[rnn_multi.Kept(0, arr((T, B, O)), rnn_layer.Forward(arr((T + 1, B, O)), None,
                                                                        arr((T, B, 4 * O)), None),
                                  True, pieces, lane)] for lane in range(L)]
        pb = _WavePb(cupy, types.SimpleNamespace(num_layers=L), arr((T, B, O)), (B,) * T, "tf32")
        seen, dys = [], []
        table = {0: "device 0's"}

        def direction(lp, ops, layer, k, mm, args, defer):
            seen.append((layer, cupy.cuda.get_current_stream().ptr))
            dys.append(args[0])
            defer.append(((arr((2, 2)),), lambda ops: {f"weight_hh_l{layer}": ops[0]}))
            return {}, arr((k.inp.shape[0], B, O)), arr((B, O)), None
        cap = cupy.cuda.Stream(non_blocking=True)
        with cap, rnn_layer.whole_call_capture(table):
            cap.begin_capture()
            rnn_wave_backward.run(pb, layers, arr((T, B, O)), None, None, direction)
            graph = cap.end_capture()
    lane = {layer: {s for ly, s in seen if ly == layer} for layer in range(L)}
    assert all(len(v) == 1 for v in lane.values()) and len(set().union(*lane.values()) | {cap.ptr}) == L + 1
    assert sorted(k for k in table if k != 0) == sorted((0, s) for layer in (1, 2) for s in lane[layer])
    assert [(ly, s) for ly, s in seen] == [(ly, *lane[ly]) for ly in (2, 1, 0)] * 2
    ops = [(e[0], e[1]) for e in graph.entries if e[0] in ("event_record", "wait_event")]
    s0, s1, s2 = (next(iter(lane[ly])) for ly in range(L))
    assert ops[:4] == [("event_record", cap.ptr), ("wait_event", s0), ("wait_event", s1), ("wait_event", s2)]
    assert ops[4:8] == [("event_record", s2), ("wait_event", s1), ("event_record", s1), ("wait_event", s0)]
    assert ops[-3:] == [("wait_event", cap.ptr)] * 3


def test_a_backward_that_raises_still_marks_its_saved_state_read(monkeypatch):
    """lstm_backward marks the saved state's replay slot read (rnn_replay.touched) even when the backward raises
    (a Ctrl-C in it): work it queued may still read the slot, and the slot's next replay must wait for it."""
    from blasx.dnn import rnn_replay, rnn_replay_backward
    rng = np.random.default_rng(0)
    p = {k: v.detach().numpy() for k, v in _module("lstm", 3, 4, 1, False, True, 0, False).state_dict().items()}
    _, _, saved = dnn.lstm(rng.standard_normal((2, 1, 3)), None, p, training=True)
    marked = []

    def interrupt(*a):
        raise KeyboardInterrupt
    monkeypatch.setattr(rnn_replay_backward, "call", interrupt)
    monkeypatch.setattr(rnn_replay, "touched", marked.append)
    with pytest.raises(KeyboardInterrupt):
        dnn.lstm_backward(saved, np.ones((2, 1, 4)))
    assert marked == [saved]
