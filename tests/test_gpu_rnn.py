"""blasx.dnn recurrent layers on CUDA GPUs (marker ``gpu``; skipped without one): CuPy inputs against torch's
CUDA modules (cuDNN) and against blasx's own host path, graph replay against the eager loop, placements on
several GPUs."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn
from blasx.dnn import rnn_graph, rnn_multi, rnn_plan, rnn_replay

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
NGPU = blasx.session._cuda_count()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0 or not torch.cuda.is_available(), reason="no CUDA GPU")]

TOL = {"float64": 1e-10, "float32": 1e-4, "float16": 2e-2}


def _err(a, ref):
    a = cupy.asnumpy(a).astype(np.float64) if hasattr(a, "get") else np.asarray(a, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30))


def _case(mode, dtype, layers=2, bidir=False, proj=0, T=20, B=8, I=32, H=64, lengths=None):
    torch.manual_seed(0)
    tdt = getattr(torch, dtype)
    kw = dict(num_layers=layers, bidirectional=bidir)
    m = (torch.nn.LSTM(I, H, proj_size=proj, **kw) if mode == "lstm" else torch.nn.GRU(I, H, **kw)).cuda().to(tdt)
    x = torch.randn(T, B, I, device="cuda", dtype=tdt, requires_grad=True)
    if lengths is not None:
        pk = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor(lengths))
        ty, tst = m(pk)
        ty = torch.nn.utils.rnn.pad_packed_sequence(ty, total_length=T)[0]
    else:
        ty, tst = m(x)
    f = dnn.lstm if mode == "lstm" else dnn.gru
    extra = dict(proj_size=proj) if mode == "lstm" else {}
    y, st, saved = f(cupy.from_dlpack(x.detach()), None, m.state_dict(), training=True, lengths=lengths, **kw, **extra)
    assert isinstance(y, cupy.ndarray)
    assert _err(y, ty.detach().double().cpu().numpy()) < TOL[dtype]
    outs = [ty, tst[0], tst[1]] if mode == "lstm" else [ty, tst]
    gs = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, gs)
    bw = dnn.lstm_backward if mode == "lstm" else dnn.gru_backward
    g = bw(saved, *[cupy.from_dlpack(t) for t in gs])
    assert _err(g["input"], x.grad.double().cpu().numpy()) < 5 * TOL[dtype]
    for k, p in m.named_parameters():
        assert _err(g[k], p.grad.double().cpu().numpy()) < 5 * TOL[dtype], k
    return g


@pytest.fixture(autouse=True)
def _cuda():
    """GPU 0, and torch's float32 references in IEEE float32 (cuDNN allows TF32 by default), restored after."""
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        blasx.configure(devices="cuda:0")
        yield
        blasx.shutdown()
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_vs_cudnn(mode, dtype):
    _case(mode, dtype, bidir=True, lengths=[20, 17, 17, 9, 5, 3, 1, 1])


@pytest.mark.parametrize("mode", ["lstm", "gru"])
@pytest.mark.parametrize("narrow", [True, False])
def test_narrow_float16_backward_vs_cudnn(mode, narrow, monkeypatch):
    """rnn_layer.NARROW (the default) and not: the float16 backward loop keeps its gate gradients only rounded
    to float16 (the bias gradients summed from them in float32), or in float32 too; the graph loops (persistent
    kernels off), one layer and two."""
    from blasx.dnn import rnn_layer, rnn_persist
    monkeypatch.setattr(rnn_layer, "NARROW", narrow)
    monkeypatch.setattr(rnn_persist, "ENABLED", False)
    _case(mode, "float16", layers=1)
    _case(mode, "float16", layers=2, bidir=True)


def test_lstm_projection_gpu():
    _case("lstm", "float32", proj=16)


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_uninitialised_memory_never_reaches_a_result_gpu(monkeypatch, mode):
    """Every cupy.empty / empty_like returns NaN (the pool hands back memory holding anything): variable lengths,
    a projection, graphs and their replay still match cuDNN."""
    real, real_like = cupy.empty, cupy.empty_like

    def poisoned(*a, **k):
        out = real(*a, **k)
        if out.dtype.kind in "fc":
            out.fill(np.nan)
        return out

    def poisoned_like(*a, **k):
        out = real_like(*a, **k)
        if out.dtype.kind in "fc":
            out.fill(np.nan)
        return out
    monkeypatch.setattr(cupy, "empty", poisoned)
    monkeypatch.setattr(cupy, "empty_like", poisoned_like)
    for _ in range(2):  # captured, then replayed
        _case(mode, "float32", bidir=True, proj=16 if mode == "lstm" else 0, lengths=[20, 17, 17, 9, 5, 3, 1, 1])


def test_graph_replay_equals_eager(monkeypatch):
    """The step loops' graphs (the whole call's replay off: it would take calls 2 and 3) give eager's bits."""
    monkeypatch.setattr(rnn_replay, "ENABLED", False)
    rng = np.random.default_rng(0)
    m = torch.nn.LSTM(16, 32, num_layers=2)
    p = {k: cupy.asarray(v.detach().numpy()) for k, v in m.state_dict().items()}
    x = cupy.asarray(rng.standard_normal((30, 4, 16)).astype(np.float32))
    with rnn_graph.eager():
        ref = dnn.lstm(x, None, p, num_layers=2)[0]
    before = rnn_graph.stats()
    ys = [dnn.lstm(x, None, p, num_layers=2)[0] for _ in range(3)]
    after = rnn_graph.stats()
    assert after["failures"] == before["failures"], after["failed"]
    captured = after["captured"] - before["captured"]
    assert captured > 0 and after["replayed"] - before["replayed"] >= 2 * captured  # calls 2 and 3 replay each
    for y in ys:
        assert float(cupy.abs(y - ref).max()) == 0.0


def test_graph_replay_equals_eager_without_split_k():
    """A small float32 layer's loop GEMMs run without split-k (rnn_graph.NO_SPLIT_ROWS); launched from Python they
    take the same settings, so both give the same bits."""
    rng = np.random.default_rng(4)
    m = torch.nn.LSTM(256, 256)
    p = {k: cupy.asarray(v.detach().numpy()) for k, v in m.state_dict().items()}
    x = cupy.asarray(rng.standard_normal((50, 16, 256)).astype(np.float32))
    with rnn_graph.eager():
        ref = dnn.lstm(x, None, p)[0]
    for _ in range(3):
        assert float(cupy.abs(dnn.lstm(x, None, p)[0] - ref).max()) == 0.0


def test_backward_graph_replay_equals_eager():
    rng = np.random.default_rng(1)
    m = torch.nn.LSTM(16, 32, num_layers=2, bidirectional=True)
    p = {k: cupy.asarray(v.detach().numpy()) for k, v in m.state_dict().items()}
    x = cupy.asarray(rng.standard_normal((30, 4, 16)).astype(np.float32))
    gy = cupy.asarray(rng.standard_normal((30, 4, 64)).astype(np.float32))
    lengths = [30, 25, 25, 7]

    def grads():
        y, _, saved = dnn.lstm(x, None, p, num_layers=2, bidirectional=True, lengths=lengths, training=True)
        return dnn.lstm_backward(saved, gy)
    with rnn_graph.eager():
        ref = grads()
    before = rnn_graph.stats()
    runs = [grads() for _ in range(3)]
    after = rnn_graph.stats()
    assert after["failures"] == before["failures"], after["failed"]
    assert after["replayed"] >= before["replayed"] + 8  # calls 2 and 3: 2 layers x 2 directions, forward and backward
    for g in runs:
        for k in ref:
            assert float(cupy.abs(g[k] - ref[k]).max()) == 0.0, k


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layers,bidir,B,kind", [(4, False, 16, "diagonal"), (1, True, 16, "directions"),
                                                 (2, True, 16, "directions"), (1, False, 256, "batch")])
def test_two_gpus(layers, bidir, B, kind):
    blasx.configure(devices="cuda:0,1")
    _case("lstm", "float32", layers=layers, bidir=bidir, B=B, lengths=None)
    assert rnn_multi.last_run()["placement"].kind == kind


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("mode,dtype", [("lstm", "float16"), ("gru", "float32")])
def test_two_gpus_local_gemms(mode, dtype):
    """On two GPUs a one-layer call too small to split runs on GPU 0 with local GEMMs (training against cuDNN), and
    a repeated inference call is captured and replayed there."""
    from blasx.dnn import rnn_replay
    blasx.configure(devices="cuda:0,1")
    _case(mode, dtype, layers=1)
    assert rnn_multi.last_run()["placement"].local and rnn_multi.last_run()["backward_on"] == {(0, 0): 0}
    m = (torch.nn.LSTM if mode == "lstm" else torch.nn.GRU)(32, 64).cuda().to(getattr(torch, dtype))
    x = cupy.asarray(np.random.default_rng(2).standard_normal((20, 8, 32)) * 0.5, dtype=dtype)
    fn = dnn.lstm if mode == "lstm" else dnn.gru
    p, before = m.state_dict(), rnn_replay.stats()
    first, second, third = (fn(x, None, p)[0] for _ in range(3))
    st = rnn_replay.stats()
    assert st["captured"] == before["captured"] + 1 and st["replayed"] == before["replayed"] + 2, st["failed"]
    assert rnn_multi.last_run()["placement"].local
    for later in (second, third):
        assert _err(first.astype(cupy.float32), cupy.asnumpy(later.astype(cupy.float32))) < 1e-3


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("mode,dtype", [("lstm", "float32"), ("gru", "float32"), ("lstm", "float64")])
def test_two_gpus_bidirectional_training(mode, dtype):
    """Bidirectional training on two GPUs: each direction's forward and backward on its own GPU, every gradient
    home on GPU 0 and equal to torch's."""
    blasx.configure(devices="cuda:0,1")
    g = _case(mode, dtype, layers=2, bidir=True, lengths=[20, 17, 17, 9, 5, 3, 1, 1])
    run = rnn_multi.last_run()
    assert run["placement"].kind == "directions"
    assert run["ran_on"] == run["backward_on"] == {(layer, d): d for layer in range(2) for d in range(2)}
    assert all(v.device.id == 0 for v in g.values())


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_two_gpus_bidirectional_equals_one(mode):
    """With h0/c0 and their gradients, float64: two GPUs give one GPU's gradients (graphs replayed on the
    second call)."""
    rng = np.random.default_rng(4)
    T, B, I, H, L, lengths = 12, 4, 8, 16, 2, [12, 9, 9, 2]
    m = (torch.nn.LSTM if mode == "lstm" else torch.nn.GRU)(I, H, num_layers=L, bidirectional=True).double()
    p = {k: cupy.asarray(v.detach().numpy()) for k, v in m.state_dict().items()}
    x = cupy.asarray(rng.standard_normal((T, B, I)))
    h0, c0 = (cupy.asarray(rng.standard_normal((2 * L, B, H))) for _ in range(2))
    gy = cupy.asarray(rng.standard_normal((T, B, 2 * H)) * (np.arange(T)[:, None] < np.asarray(lengths))[..., None])
    gh, gc = (cupy.asarray(rng.standard_normal((2 * L, B, H))) for _ in range(2))

    def grads():
        kw = dict(num_layers=L, bidirectional=True, lengths=lengths, training=True)
        if mode == "lstm":
            return dnn.lstm_backward(dnn.lstm(x, (h0, c0), p, **kw)[2], gy, gh, gc)
        return dnn.gru_backward(dnn.gru(x, h0, p, **kw)[2], gy, gh)
    ref = grads()
    blasx.configure(devices="cuda:0,1")
    for _ in range(2):
        g = grads()
        assert rnn_multi.last_run()["backward_on"] == {(layer, d): d for layer in range(L) for d in range(2)}
        for k in ref:
            assert g[k].device.id == 0 and _err(g[k], cupy.asnumpy(ref[k])) < 1e-12, k


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layers", [2, 4])
@pytest.mark.parametrize("mode,dtype,lengths", [("lstm", "float32", None), ("gru", "float32", None),
                                                ("lstm", "float64", [20, 17, 17, 9, 5, 3, 1, 1])])
def test_diagonal_vs_cudnn(layers, mode, dtype, lengths):
    """Unidirectional stacks in float32 IEEE and float64 on two GPUs run diagonally, a group on each, forward and
    backward."""
    ngpu = 2
    blasx.configure(devices="cuda:0,1")
    _case(mode, dtype, layers=layers, lengths=lengths)
    run = rnn_multi.last_run()
    assert run["placement"].kind == "diagonal" and run["placement"].devices == ngpu
    assert sorted(set(run["ran_on"].values())) == list(range(ngpu))


@pytest.mark.parametrize("ngpu", [1, 2])
@pytest.mark.parametrize("layers,bidir", [(3, False), (2, True)])
@pytest.mark.parametrize("mode,dtype", [("lstm", "float16"), ("gru", "float16"), ("lstm", "float32")])
def test_wide_stack_vs_cudnn(ngpu, layers, bidir, mode, dtype):
    """A float16 stack on GPU 0 alone (its GEMMs local there with two GPUs), forward and backward; on two GPUs
    float32 IEEE stacks run diagonally, bidirectional layers a direction per GPU."""
    if ngpu > NGPU:
        pytest.skip("needs 2 GPUs")
    blasx.configure(devices="cuda:0" if ngpu == 1 else "cuda:0,1")
    _case(mode, dtype, layers=layers, bidir=bidir, lengths=None)
    run = rnn_multi.last_run()
    if ngpu == 1 or (dtype == "float16" and not bidir):
        assert run["placement"].kind == "single" and run["placement"].local == (ngpu == 2)
        assert set(run["ran_on"].values()) == set(run["backward_on"].values()) == {0}
    else:
        assert run["placement"].kind == ("directions" if bidir else "diagonal")


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("mode,dtype,proj,lengths", [
    ("lstm", "float32", 16, None), ("lstm", "float16", 0, None), ("gru", "float32", 0, [20, 17, 17, 9, 5, 3, 1, 1]),
    ("lstm", "float64", 0, [20, 17, 17, 9, 5, 3, 1, 1])])
def test_wavefront_on_two_gpus_vs_cudnn(mode, dtype, proj, lengths, monkeypatch):
    """A 4-layer stack as a wavefront of time pieces, layers 0-1 on GPU 0 and 2-3 on GPU 1 (a projection stack's
    own plan, the others' forced), forward and backward against cuDNN, twice (graphs replayed): each layer's
    backward on its forward's GPU, every gradient home on GPU 0."""
    blasx.configure(devices="cuda:0,1")
    if not proj:
        pl = rnn_plan.Placement("wavefront", 2, ((0,), (0,), (1,), (1,)), chunk=3)
        monkeypatch.setattr(rnn_plan, "plan", lambda *a, **k: pl)
    for _ in range(2):
        g = _case(mode, dtype, layers=4, proj=proj, lengths=lengths)
        run = rnn_multi.last_run()
        assert run["placement"].kind == "wavefront"
        assert run["ran_on"] == run["backward_on"] == {(layer, 0): layer // 2 for layer in range(4)}
        assert all(v.device.id == 0 for v in g.values())


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
def test_diagonal_graphs_equal_eager():
    """The diagonal loops (two GPUs) replayed from their per-chunk graphs give the eager loops' results bit for
    bit."""
    blasx.configure(devices="cuda:0,1")
    rng = np.random.default_rng(2)
    m = torch.nn.LSTM(16, 32, num_layers=4)
    p = {k: cupy.asarray(v.detach().numpy()) for k, v in m.state_dict().items()}
    x = cupy.asarray(rng.standard_normal((30, 4, 16)).astype(np.float32))
    gy = cupy.asarray(rng.standard_normal((30, 4, 32)).astype(np.float32))

    def run():
        y, _, saved = dnn.lstm(x, None, p, num_layers=4, training=True, lengths=[30, 22, 22, 3])
        return y, dnn.lstm_backward(saved, gy)
    with rnn_graph.eager():
        ref_y, ref_g = run()
    before = rnn_graph.stats()
    outs = [run() for _ in range(3)]
    after = rnn_graph.stats()
    assert after["failures"] == before["failures"], after["failed"]
    assert after["replayed"] > before["replayed"]
    for y, g in outs:
        assert float(cupy.abs(y - ref_y).max()) == 0.0
        for k in ref_g:
            assert float(cupy.abs(g[k] - ref_g[k]).max()) == 0.0, k


@pytest.mark.parametrize("layers", [1, 4])
def test_threads_calling_one_shape_at_once(layers, in_threads):
    """Several threads running the same shape at the same time (one graph key) each get their own answer: a
    graph entry belongs to one call at a time, on whatever stream that call uses."""
    rng = np.random.default_rng(4)
    m = torch.nn.LSTM(16, 32, num_layers=layers)
    p = {k: cupy.asarray(v.detach().numpy()) for k, v in m.state_dict().items()}
    xs = [cupy.asarray(rng.standard_normal((30, 4, 16)).astype(np.float32)) for _ in range(4)]
    with rnn_graph.eager():
        refs = [dnn.lstm(x, None, p, num_layers=layers)[0] for x in xs]

    def call(i):
        with cupy.cuda.Stream(non_blocking=True):
            for _ in range(5):
                y = dnn.lstm(xs[i], None, p, num_layers=layers)[0]
                assert float(cupy.abs(y - refs[i]).max()) == 0.0
    in_threads(call, 4)


@pytest.mark.parametrize("bidir", [False, True])
@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_saved_states_held_at_once_in_threads(mode, bidir, in_threads):
    """Training forwards keep their saved activations in their graph entries (rnn_graph.run(lease=True), a
    bidirectional layer's directions too): several saved states of one shape alive at once (more than
    MAX_LEASES: the rest copied out), their backwards run in reverse order, from threads on their own streams,
    each equal the eager answer; entries come back once the saved states are gone."""
    rng = np.random.default_rng(5)
    m = (torch.nn.LSTM if mode == "lstm" else torch.nn.GRU)(16, 32, bidirectional=bidir)
    p = {k: cupy.asarray(v.detach().numpy()) for k, v in m.state_dict().items()}
    xs = [cupy.asarray(rng.standard_normal((30, 4, 16)).astype(np.float32)) for _ in range(3)]
    gy = cupy.asarray(rng.standard_normal((30, 4, 64 if bidir else 32)).astype(np.float32))
    f, bw = (dnn.lstm, dnn.lstm_backward) if mode == "lstm" else (dnn.gru, dnn.gru_backward)
    with rnn_graph.eager():
        refs = [bw(f(x, None, p, bidirectional=bidir, training=True)[-1], gy) for x in xs]

    def call(i):
        with cupy.cuda.Stream(non_blocking=True):
            for _ in range(3):
                saved = [f(x, None, p, bidirectional=bidir, training=True)[-1] for x in xs]
                for j in (2, 1, 0):
                    g = bw(saved[j], gy)
                    wrong = {k: float(cupy.abs(g[k] - refs[j][k]).max()) for k in refs[j]}  # (all: which are off)
                    assert not any(wrong.values()), (j, {k: v for k, v in wrong.items() if v})
                del saved
    before = rnn_graph.stats()
    in_threads(call, 3)
    after = rnn_graph.stats()
    assert after["failures"] == before["failures"], after["failed"]
    assert after["replayed"] > after["captured"] - before["captured"] and after["leased"] > before["leased"]


@pytest.mark.parametrize("mode, H, B, bidir, lengths", [
    ("lstm", 64, 8, True, [20, 17, 17, 9, 5, 3, 1, 1]),
    ("lstm", 512, 80, False, None),  # two passes of 64 rows a step
    ("gru", 128, 16, True, None),
    ("gru", 64, 3, False, [20, 4, 2]),
    ("gru", 1024, 16, False, [20] * 9 + [13] * 7),  # 64 blocks: steps ordered by the counter, not flags
    ("lstm", 512, 16, True, None),  # 64 blocks of J = 8 (32 of J = 16 would give a warp 32 tiles)
    ("lstm", 1024, 16, False, [20] * 9 + [13] * 7),  # backward: 128 blocks, a warp's k range 512 wide
    ("lstm", 128, 128, False, [20] * 100 + [1] * 28),  # backward: two passes of 64 rows, flags
    ("rnn_tanh", 256, 5, True, None),
    ("rnn_relu", 64, 16, False, None),
])
def test_persistent_equals_graph_loop(mode, H, B, bidir, lengths, monkeypatch):
    """The persistent kernels (rnn_persist) against the graph loops on the same inputs: outputs, final states and
    every gradient of a training call (its saved gates feed the backward pass; LSTM's backward loop is persistent
    too)."""
    from blasx.dnn import rnn_persist
    monkeypatch.setattr(rnn_persist, "MAX_BATCH", 128)
    monkeypatch.setattr(rnn_persist, "BWD_MAX_BATCH", 128)
    torch.manual_seed(0)
    kw = dict(num_layers=2 if bidir else 1, bidirectional=bidir)  # unidirectional stacks run diagonally
    cls = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}.get(mode)
    m = cls(32, H, **kw) if cls else torch.nn.RNN(32, H, nonlinearity=mode[4:], **kw)
    tdt = torch.float16
    p = {k: cupy.from_dlpack(v.detach().cuda().to(tdt).contiguous()) for k, v in m.state_dict().items()}
    x = cupy.from_dlpack((torch.randn(20, B, 32, device="cuda") * 0.5).to(tdt))
    fn = {"lstm": dnn.lstm, "gru": dnn.gru}.get(mode) or (lambda *a, **k: dnn.rnn(*a, nonlinearity=mode[4:], **k))
    bw = {"lstm": dnn.lstm_backward, "gru": dnn.gru_backward}.get(mode, dnn.rnn_backward)

    def run():
        out = fn(x, None, p, training=True, lengths=lengths, **kw)
        gs = [cupy.ones_like(o) * 0.1 for o in cupy_outs(out)]
        return cupy_outs(out), bw(out[-1], *gs)

    def cupy_outs(out):
        return [out[0], *(out[1] if isinstance(out[1], tuple) else (out[1],))]

    before = rnn_persist.launches()
    outs, grads = run()
    loops = 4 if bidir else 1
    trained = loops * (2 if mode == "lstm" else 1)  # forward (and LSTM's backward) loops
    assert rnn_persist.launches() - before == trained
    old, rnn_persist.ENABLED = rnn_persist.ENABLED, False
    try:
        ref_outs, ref_grads = run()
    finally:
        rnn_persist.ENABLED = old
    assert rnn_persist.launches() - before == trained
    for a, r in zip(outs, ref_outs):
        assert _err(a.astype(cupy.float32), cupy.asnumpy(r.astype(cupy.float32))) < 1e-2
    inference = cupy_outs(fn(x, None, p, lengths=lengths, **kw))  # no saved gates, c stored at the end only
    assert rnn_persist.launches() - before == trained + loops
    for a, r in zip(inference, ref_outs):
        assert _err(a.astype(cupy.float32), cupy.asnumpy(r.astype(cupy.float32))) < 1e-2
    for k in ref_grads:
        assert _err(grads[k].astype(cupy.float32), cupy.asnumpy(ref_grads[k].astype(cupy.float32))) < 2e-2, k


@pytest.mark.parametrize("dtype", ["float16", "float32"])  # the persistent kernel's loop, the graph loop
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_a_repeated_small_call_replays(mode, batch_first, dtype):
    """A repeated one-layer inference call on one GPU (rnn_replay.py): captured on its signature's second call
    (hx given or not: two signatures), replayed after; outputs and final states equal the general path's and
    torch's, with hx, after an in-place update of a parameter and after a new tensor in the mapping; lengths and
    a training call in between change nothing."""
    from blasx.dnn import rnn_replay
    torch.manual_seed(5)
    cls = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}.get(mode)
    kw = dict(batch_first=batch_first)
    tdt = getattr(torch, dtype)
    m = (cls(32, 64, **kw) if cls else torch.nn.RNN(32, 64, nonlinearity="tanh", **kw)).cuda().to(tdt)
    x = (torch.randn(8, 20, 32, device="cuda") * 0.5).to(tdt)
    x = x if batch_first else x.transpose(0, 1).contiguous()
    cx, p = cupy.from_dlpack(x), m.state_dict()
    fn = {"lstm": dnn.lstm, "gru": dnn.gru}.get(mode) or (lambda *a, **k: dnn.rnn(*a, nonlinearity="tanh", **k))
    h = torch.randn(1, 8, 64, device="cuda").to(tdt) * 0.5
    thx = (h, torch.randn(1, 8, 64, device="cuda").to(tdt) * 0.5) if mode == "lstm" else h
    chx = tuple(cupy.from_dlpack(t) for t in thx) if mode == "lstm" else cupy.from_dlpack(thx)

    def flat(out):
        return [out[0], *(out[1] if isinstance(out[1], tuple) else (out[1],))]

    def check(out, hx=None):
        with torch.no_grad():
            ref = flat(m(x, hx))
        for a, r in zip(flat(out), ref):
            assert isinstance(a, cupy.ndarray) and a.dtype == np.dtype(dtype) and a.shape == tuple(r.shape)
            assert _err(a.astype(cupy.float32), r.float().cpu().numpy()) < TOL[dtype]

    before = rnn_replay.stats()
    first, second, third = (fn(cx, None, p, **kw) for _ in range(3))  # general, captured (and run), replayed
    for later in (second, third):
        for a, b in zip(flat(first), flat(later)):
            assert _err(a.astype(cupy.float32), cupy.asnumpy(b.astype(cupy.float32))) < 1e-3
    check(third)
    fn(cx, chx, p, **kw)
    fn(cx, chx, p, **kw)
    check(fn(cx, chx, p, **kw), thx)
    with torch.no_grad():
        p["weight_hh_l0"].mul_(0.5)  # in place: the same tensors, read where they lie
    check(fn(cx, None, p, **kw))
    st = rnn_replay.stats()
    assert st["captured"] - before["captured"] == 2 and st["replayed"] - before["replayed"] == 5, st["failed"]
    with torch.no_grad():  # a new tensor in the mapping: parsed anew, a new entry
        p["bias_ih_l0"] = p["bias_ih_l0"] + 0.25
        m.bias_ih_l0.copy_(p["bias_ih_l0"])
    check(fn(cx, None, p, **kw))
    fn(cx, None, p, lengths=[20] * 8, **kw)
    fn(cx, None, p, training=True, **kw)
    check(fn(cx, None, p, **kw))
    check(fn(cx, None, p, **kw))
    assert rnn_replay.stats()["failures"] == before["failures"], rnn_replay.stats()["failed"]


def test_torch_params_views_follow_in_place_updates():
    """Views of a state_dict's CUDA tensors are made once per tensor and reused (rnn_params._cuda_view): an
    in-place update of a parameter shows in the next call, and a tensor of a new shape gets a new view."""
    from blasx.dnn import rnn_params
    torch.manual_seed(3)
    m = torch.nn.LSTM(32, 64).cuda().half()
    x = (torch.randn(12, 8, 32, device="cuda") * 0.5).half()
    p = m.state_dict()
    dnn.lstm(cupy.from_dlpack(x), None, p)
    assert all(id(t) in rnn_params._views for t in p.values())
    views = {k: rnn_params._views[id(t)][2] for k, t in p.items()}
    with torch.no_grad():
        p["weight_hh_l0"].mul_(0.5)  # the module's own parameter storage
        p["bias_ih_l0"].add_(0.25)
        ref = m(x)[0]
    y = dnn.lstm(cupy.from_dlpack(x), None, p)[0]
    assert all(rnn_params._views[id(t)][2] is views[k] for k, t in p.items())  # reused
    assert _err(y.astype(cupy.float32), ref.float().cpu().numpy()) < TOL["float16"]
    with torch.no_grad():  # the mapping's own tensor object moved to new storage: its kept Spec is not reused
        b = torch.full_like(m.bias_hh_l0, 0.5)
        m.bias_hh_l0.set_(b)
        p["bias_hh_l0"].set_(b)
        ref = m(x)[0]
    y = dnn.lstm(cupy.from_dlpack(x), None, p)[0]
    assert _err(y.astype(cupy.float32), ref.float().cpu().numpy()) < TOL["float16"]
    with torch.no_grad():
        m.weight_hh_l0.set_(torch.zeros_like(m.weight_hh_l0))  # new storage under the same tensor object
    p2 = m.state_dict()
    y2 = dnn.lstm(cupy.from_dlpack(x), None, p2)[0]
    with torch.no_grad():
        assert _err(y2.astype(cupy.float32), m(x)[0].float().cpu().numpy()) < TOL["float16"]


@pytest.mark.parametrize("batch_first", [False, True])
def test_host_arrays_run_on_the_gpu(batch_first, monkeypatch):
    """numpy x on a GPU server (rnn_host.py): the CuPy path on the GPU, numpy results matching torch (forward,
    final states and every gradient, numpy gradients in); past the memory budget, inference in batch chunks."""
    from blasx.dnn import rnn_host
    torch.manual_seed(3)
    T, B, I, H = 15, 6, 12, 16
    m = torch.nn.LSTM(I, H, num_layers=2, bidirectional=True, batch_first=batch_first).double()
    lengths = [15, 15, 11, 8, 3, 1]
    x = torch.randn((B, T, I) if batch_first else (T, B, I), dtype=torch.float64, requires_grad=True)
    pk = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor(lengths), batch_first=batch_first)
    ty, (th, tc) = m(pk)
    ty = torch.nn.utils.rnn.pad_packed_sequence(ty, batch_first=batch_first, total_length=T)[0]
    gs = [torch.randn_like(o) for o in (ty, th, tc)]
    torch.autograd.backward([ty, th, tc], gs)
    p = {k: v.detach().float().numpy() for k, v in m.state_dict().items()}
    xn = x.detach().float().numpy()
    kw = dict(num_layers=2, bidirectional=True, batch_first=batch_first, lengths=lengths)
    y, (h, c), saved = dnn.lstm(xn, None, p, training=True, **kw)
    assert isinstance(saved, rnn_host.HostSaved) and all(type(a) is np.ndarray for a in (y, h, c))
    for a, ref in ((y, ty), (h, th), (c, tc)):
        assert a.dtype == np.float32 and _err(a, ref.detach().numpy()) < TOL["float32"]
    g = dnn.lstm_backward(saved, *[t.float().numpy() for t in gs])
    assert type(g["input"]) is np.ndarray and _err(g["input"], x.grad.numpy()) < 5 * TOL["float32"]
    for k, v in m.named_parameters():
        assert _err(g[k], v.grad.numpy()) < 5 * TOL["float32"], k
    monkeypatch.setattr(rnn_host, "plan", lambda *a: ("rows", 4))  # as past the memory budget
    y2, (h2, c2) = dnn.lstm(xn, None, p, **kw)
    for a, ref in ((y2, ty), (h2, th), (c2, tc)):
        assert _err(a, ref.detach().numpy()) < TOL["float32"]


@pytest.mark.parametrize("where", ["torch", "cupy-last-gpu"])
def test_host_x_with_resident_parameters(where):
    """numpy x with the parameters resident on a GPU (the CUDA module's state_dict, or CuPy arrays on the last
    GPU): numpy results matching torch, gradients included, the parameters never read back."""
    torch.manual_seed(6)
    T, B, I, H = 12, 5, 10, 16
    m = torch.nn.GRU(I, H, num_layers=2).cuda()
    x = torch.randn(T, B, I, device="cuda", requires_grad=True)
    ty, th = m(x)
    gs = [torch.randn_like(o) for o in (ty, th)]
    torch.autograd.backward([ty, th], gs)
    if where == "torch":
        p = m.state_dict()
    else:
        with cupy.cuda.Device(NGPU - 1):
            p = {k: cupy.asarray(v.detach().cpu().numpy()) for k, v in m.state_dict().items()}
    y, h, saved = dnn.gru(x.detach().cpu().numpy(), None, p, num_layers=2, training=True)
    assert type(y) is np.ndarray and _err(y, ty.detach().cpu().numpy()) < TOL["float32"]
    assert _err(h, th.detach().cpu().numpy()) < TOL["float32"]
    g = dnn.gru_backward(saved, *[t.cpu().numpy() for t in gs])
    assert type(g["input"]) is np.ndarray and _err(g["input"], x.grad.cpu().numpy()) < 5 * TOL["float32"]
    for k, v in m.named_parameters():
        assert type(g[k]) is np.ndarray and _err(g[k], v.grad.cpu().numpy()) < 5 * TOL["float32"], k


def test_host_arrays_in_time_chunks_on_the_gpu(monkeypatch):
    """A unidirectional stack too long for the device (forced): time chunks with carried states match torch."""
    from blasx.dnn import rnn_host
    torch.manual_seed(4)
    T, B, I, H = 23, 5, 8, 16
    m = torch.nn.GRU(I, H, num_layers=2).double()
    lengths = [23, 20, 20, 9, 2]
    x = torch.randn(T, B, I, dtype=torch.float64)
    h0 = torch.randn(2, B, H, dtype=torch.float64)
    pk = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor(lengths))
    ty, th = m(pk, h0)
    ty = torch.nn.utils.rnn.pad_packed_sequence(ty, total_length=T)[0]
    p = {k: v.detach().float().numpy() for k, v in m.state_dict().items()}
    monkeypatch.setattr(rnn_host, "plan", lambda *a: ("steps", 6))
    y, h = dnn.gru(x.float().numpy(), h0.float().numpy(), p, num_layers=2, lengths=lengths)
    assert _err(y, ty.detach().numpy()) < TOL["float32"] and _err(h, th.detach().numpy()) < TOL["float32"]


def test_a_callers_stream_set_by_use_stays_current_and_orders_the_call():
    """A stream the caller made current by use() (as with a torch stream through ExternalStream) is current
    after an LSTM call (its first call captures graphs on a side stream), and the result is right."""
    torch.manual_seed(1)
    m = torch.nn.LSTM(32, 64, num_layers=2).cuda()
    x = torch.randn(20, 8, 32, device="cuda")
    ty, _ = m(x)
    torch.cuda.synchronize()  # x and the weights are torch's: written before the caller's stream reads them
    mine = cupy.cuda.Stream(non_blocking=True)
    mine.use()
    try:
        for _ in range(3):  # eager, captured, replayed
            y, _ = dnn.lstm(cupy.from_dlpack(x), None, m.state_dict(), num_layers=2)
            assert cupy.cuda.get_current_stream() == mine
        mine.synchronize()
        assert _err(y, ty.detach().double().cpu().numpy()) < TOL["float32"]
    finally:
        cupy.cuda.Stream.null.use()


@pytest.mark.parametrize("mode,dtype,layers,bidir,ngpu,extra", [
    ("lstm", "float16", 1, False, 1, {}),
    ("gru", "float32", 2, False, 1, {"batch_first": True}),
    ("lstm", "float32", 1, True, 2, {"math": "tf32"}),
    ("lstm", "float32", 1, True, 2, {}),
    ("gru", "float16", 2, False, 2, {}),
    ("lstm", "float32", 2, False, 1, {"lengths": [20, 17, 17, 9, 5, 5, 2, 1]}),
    ("lstm", "float32", 3, False, 2, {"math": "tf32", "T": 100}),  # the wavefront's pieces over both GPUs
    ("gru", "float32", 3, False, 2, {"T": 100}),  # general: the diagonal; captured: a wavefront
    ("lstm", "float32", 3, False, 1, {"T": 100}),  # one GPU: captured as a wavefront of lanes
    ("gru", "float32", 4, False, 1, {"math": "tf32", "T": 100}),
    ("lstm", "float16", 1, False, 1, {"cupy_params": True}),  # a mapping of CuPy arrays (views of the tensors)
    ("gru", "float32", 1, True, 2, {"cupy_params": True}),
])
def test_repeated_calls_replay_one_graph_of_the_whole_call(mode, dtype, layers, bidir, ngpu, extra):
    """rnn_replay: the second call of a signature is captured (over every GPU it uses) and checked, later
    calls replay it; every call's outputs and final states match cuDNN's for that call's own x and hx, fresh
    arrays each, after in-place parameter updates too (the graph reads the parameters where they lie); a new
    tensor in the mapping starts a new entry."""
    from blasx.dnn import rnn_replay
    if NGPU < ngpu:
        pytest.skip(f"needs {ngpu} GPUs")
    blasx.configure(devices="cuda" if ngpu > 1 else "cuda:0")
    math = extra.get("math")
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = math == "tf32"
    tol = 2e-3 if math == "tf32" else TOL[dtype]
    torch.manual_seed(7)
    tdt = getattr(torch, dtype)
    cls = torch.nn.LSTM if mode == "lstm" else torch.nn.GRU
    bf = extra.get("batch_first", False)
    m = cls(32, 64, num_layers=layers, bidirectional=bidir, batch_first=bf).cuda().to(tdt)
    p = m.state_dict()
    if extra.get("cupy_params"):  # (views: the module's in-place updates show in them)
        p = {k: cupy.from_dlpack(v) for k, v in p.items()}
    fn = dnn.lstm if mode == "lstm" else dnn.gru
    kw = dict(num_layers=layers, bidirectional=bidir, batch_first=bf, lengths=extra.get("lengths"), math=math)
    lengths, T = extra.get("lengths"), extra.get("T", 20)
    before = rnn_replay.stats()
    results = []
    for i in range(5):
        x = (torch.randn(8, T, 32, device="cuda") * 0.5).to(tdt)
        x = x if bf else x.transpose(0, 1).contiguous()
        ld = layers * (2 if bidir else 1)
        h = (torch.randn(ld, 8, 64, device="cuda") * 0.5).to(tdt)
        thx = (h, (torch.randn(ld, 8, 64, device="cuda") * 0.5).to(tdt)) if mode == "lstm" else h
        with_hx = i % 2 == 1
        chx = None if not with_hx else (tuple(cupy.from_dlpack(t) for t in thx) if mode == "lstm"
                                         else cupy.from_dlpack(thx))
        if i == 3:
            with torch.no_grad():
                m.weight_hh_l0.mul_(0.5)  # in place: the same memory, the graph reads the new values
        out = fn(cupy.from_dlpack(x), chx, p, **kw)
        with torch.no_grad():
            if lengths is not None:
                pk = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor(lengths), batch_first=bf)
                ty, tst = m(pk, thx if with_hx else None)
                ty = torch.nn.utils.rnn.pad_packed_sequence(ty, batch_first=bf, total_length=T)[0]
            else:
                ty, tst = m(x, thx if with_hx else None)
        refs = [ty, *(tst if mode == "lstm" else (tst,))]
        got = [out[0], *(out[1] if mode == "lstm" else (out[1],))]
        for a, r in zip(got, refs):
            assert isinstance(a, cupy.ndarray) and a.shape == tuple(r.shape)
            assert _err(a.astype(cupy.float32), r.float().cpu().numpy()) < tol, i
        results.append(got[0])
    if "T" in extra:
        assert rnn_multi.last_run()["placement"].kind == "wavefront"
    st = rnn_replay.stats()
    # two signatures (hx given or not): each general once, captured on its second call, then replayed
    assert st["captured"] - before["captured"] == 2 and st["failures"] == before["failures"], st["failed"]
    assert st["replayed"] - before["replayed"] >= 1
    with torch.no_grad():  # a new array in the mapping: parsed anew, a new entry
        p["weight_ih_l0"] = p["weight_ih_l0"] * 0.5
        m.weight_ih_l0.copy_(torch.from_dlpack(p["weight_ih_l0"]) if extra.get("cupy_params") else p["weight_ih_l0"])
    x = (torch.randn(8, T, 32, device="cuda") * 0.5).to(tdt)
    x = x if bf else x.transpose(0, 1).contiguous()
    for _ in range(3):
        out = fn(cupy.from_dlpack(x), None, p, **kw)
        with torch.no_grad():
            if lengths is not None:
                pk = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor(lengths), batch_first=bf)
                ty = torch.nn.utils.rnn.pad_packed_sequence(m(pk)[0], batch_first=bf, total_length=T)[0]
            else:
                ty = m(x)[0]
        assert _err(out[0].astype(cupy.float32), ty.float().cpu().numpy()) < tol


@pytest.mark.parametrize("mode,dtype,layers,bidir,ngpu,math", [
    ("lstm", "float16", 1, False, 1, None),
    ("gru", "float32", 2, False, 1, None),
    ("lstm", "float32", 1, True, 2, "tf32"),
])
def test_training_steps_replay_the_forward_with_leased_slots(mode, dtype, layers, bidir, ngpu, math):
    """rnn_replay with training=True: a loop of forward + backward steps, each step's saved state kept until
    the next step's forward returns (as a training loop holds it): from the second step the forward replays a
    graph leased to its saved state (two slots alternate); outputs and every gradient match torch's autograd
    through cuDNN for that step's own x and grad_y, after an in-place parameter update too; from a slot's second
    backward the backward replays its own graph, with the same gradients."""
    from blasx.dnn import rnn_replay
    if NGPU < ngpu:
        pytest.skip(f"needs {ngpu} GPUs")
    blasx.configure(devices="cuda" if ngpu > 1 else "cuda:0")
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = math == "tf32"
    tol = 2e-3 if math == "tf32" else TOL[dtype]
    torch.manual_seed(11)
    tdt = getattr(torch, dtype)
    m = (torch.nn.LSTM if mode == "lstm" else torch.nn.GRU)(32, 64, num_layers=layers,
                                                             bidirectional=bidir).cuda().to(tdt)
    p = m.state_dict()
    fn, bw = (dnn.lstm, dnn.lstm_backward) if mode == "lstm" else (dnn.gru, dnn.gru_backward)
    before = rnn_replay.stats()
    saved = None
    for i in range(6):
        if i == 4:
            with torch.no_grad():
                p["weight_hh_l0"].mul_(0.5)  # in place: the graph reads the new values
        x = (torch.randn(20, 8, 32, device="cuda") * 0.5).to(tdt).requires_grad_(True)
        y, st, saved = fn(cupy.from_dlpack(x.detach()), None, p, num_layers=layers, bidirectional=bidir,
                          training=True, math=math)
        m.zero_grad()
        ty, _ = m(x)
        gy = torch.randn_like(ty)
        ty.backward(gy)
        assert _err(y.astype(cupy.float32), ty.detach().float().cpu().numpy()) < tol, i
        g = bw(saved, cupy.from_dlpack(gy))
        assert _err(g["input"].astype(cupy.float32), x.grad.float().cpu().numpy()) < 5 * tol, i
        for k, prm in m.named_parameters():
            assert _err(g[k].astype(cupy.float32), prm.grad.float().cpu().numpy()) < 5 * tol, (i, k)
    st = rnn_replay.stats()
    assert st["captured"] - before["captured"] == 2 and st["failures"] == before["failures"], st["failed"]
    assert st["replayed"] - before["replayed"] >= 4
    # each slot's backward: general, then captured (rnn_replay_backward), then replayed (slot A's third)
    assert st["backward_captured"] - before["backward_captured"] == 2
    assert st["backward_replayed"] - before["backward_replayed"] >= 1


@pytest.mark.parametrize("ngpu", [1, 2])
@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_tf32_training_stack_captured_as_a_wavefront_with_its_backward_in_pieces(mode, ngpu):
    """A 4-layer TF32 training loop on two GPUs (two lanes each), or on one GPU's lanes (a stream a layer): the
    replayed forward is a wavefront (plan(captured=True)), each slot's backward is captured from its second call (on
    two GPUs in the layers' time pieces, rnn_wave_backward; on one, layer after layer, each layer's weight gradients
    on a side stream) and replayed after; outputs and every gradient within TF32's tolerance of torch's."""
    from blasx.dnn import rnn_exec, rnn_replay, rnn_wave_backward
    if NGPU < ngpu:
        pytest.skip(f"needs {ngpu} GPUs")
    blasx.configure(devices="cuda" if ngpu > 1 else "cuda:0")
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(13)
    m = (torch.nn.LSTM if mode == "lstm" else torch.nn.GRU)(64, 64, num_layers=4).cuda()
    p = m.state_dict()
    fn, bw = (dnn.lstm, dnn.lstm_backward) if mode == "lstm" else (dnn.gru, dnn.gru_backward)
    pieces, beside = [], []
    real, real_side = rnn_wave_backward.run, rnn_exec._side_weights

    def spy(*a):
        pieces.append(a[1][0][0].pieces)
        return real(*a)

    def side(*a):
        beside.append(real_side(*a))
        return beside[-1]
    before = rnn_replay.stats()
    saved = None
    try:
        rnn_wave_backward.run, rnn_exec._side_weights = spy, side
        for i in range(7):
            x = (torch.randn(64, 16, 64, device="cuda") * 0.5).requires_grad_(True)
            y, st, saved = fn(cupy.from_dlpack(x.detach()), None, p, num_layers=4, training=True, math="tf32")
            m.zero_grad()
            ty, _ = m(x)
            gy = torch.randn_like(ty)
            ty.backward(gy)
            assert _err(y, ty.detach().cpu().numpy()) < 2e-3, i
            g = bw(saved, cupy.from_dlpack(gy))
            assert _err(g["input"], x.grad.cpu().numpy()) < 1e-2, i
            for k, prm in m.named_parameters():
                assert _err(g[k], prm.grad.cpu().numpy()) < 1e-2, (i, k)
    finally:
        rnn_wave_backward.run, rnn_exec._side_weights = real, real_side
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    st = rnn_replay.stats()
    assert st["failures"] == before["failures"], st["failed"]
    assert st["backward_captured"] - before["backward_captured"] == 2
    assert st["backward_replayed"] - before["backward_replayed"] >= 2
    assert (pieces and all(len(ps) >= 4 for ps in pieces)) if ngpu > 1 else not pieces  # (one GPU: layer by layer)
    assert ngpu > 1 or True in beside  # (one GPU: captured with the weight gradients on a side stream)
    assert rnn_multi.last_run()["placement"].kind == "wavefront"
    assert rnn_multi.last_run()["placement"].lanes == ((0, 1, 2, 3) if ngpu == 1 else (0, 1, 0, 1))
