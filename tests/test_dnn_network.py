"""blasx.dnn.Network on the CPU (sims and the CPU device) against CPU torch: compiled vs uncompiled, every
dtype, both layouts, chunking, the profile and trace, errors. Cases needing a primitive not yet in
blasx.dnn are skipped until it is."""

from __future__ import annotations

import json

import numpy as np
import pytest

import blasx
from blasx import dnn
from blasx.dnn import layers

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional

TOL = {np.float64: 1e-12, np.float32: 2e-5, np.float16: 1e-2}


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _bn_stats(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.copy_(torch.rand(mod.num_features, generator=g) - 0.5)
                mod.running_var.copy_(torch.rand(mod.num_features, generator=g) + 0.5)
                mod.weight.copy_(torch.rand(mod.num_features, generator=g) + 0.5)
                mod.bias.copy_(torch.rand(mod.num_features, generator=g) - 0.5)
    return m.eval()


class Block(nn.Module):
    """A bottleneck block; BN optional (folding needs no batch_norm function)."""

    def __init__(self, c, mid, bn=True):
        super().__init__()
        norm = nn.BatchNorm2d if bn else (lambda k: nn.Identity())
        self.c1, self.b1 = nn.Conv2d(c, mid, 1, bias=not bn), norm(mid)
        self.c2, self.b2 = nn.Conv2d(mid, mid, 3, padding=1, bias=not bn), norm(mid)
        self.c3, self.b3 = nn.Conv2d(mid, c, 1, bias=not bn), norm(c)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = torch.relu(self.b2(self.c2(y)))
        return F.relu(self.b3(self.c3(y)) + x)


class ResNetish(nn.Module):
    def __init__(self, bn=True, act=nn.ReLU):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(8) if bn else nn.Identity()
        self.act = act()
        self.blocks = nn.Sequential(Block(8, 4, bn), Block(8, 4, bn))
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = self.blocks(self.act(self.bn(self.stem(x))))
        return self.fc(self.drop(x.view(x.size(0), -1)))


@pytest.fixture(params=["sim:2", "cpu"])
def engine(request):
    blasx.configure(devices=request.param, tile=16)
    yield request.param


def _x(n=5, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 3, 8, 8))


def _torch64(m, x):
    with torch.no_grad():
        return m.double()(torch.from_numpy(x)).numpy()


def test_compiled_and_uncompiled_match_torch_without_batchnorm(engine):
    m = ResNetish(bn=False).eval()
    x = _x()
    ref = _torch64(m, x)
    plain = dnn.from_torch(m, (1, 3, 8, 8))
    y0 = plain(x)
    net = dnn.from_torch(m, (1, 3, 8, 8)).compile()
    y1 = net(x, chunk=2)
    assert _rel(y0, ref) < 1e-12 and _rel(y1, ref) < 1e-12 and _rel(y1, y0) < 1e-12
    assert sum(n.op == "conv" for n in net.nodes) == 7 and not any(n.op in ("act", "add") for n in net.nodes)
    assert any(n.op == "act" for n in plain.nodes)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_batchnorm_folded_network_matches_torch(dtype):
    blasx.configure(devices="sim:2", tile=16)
    m = _bn_stats(ResNetish(bn=True))
    x = _x(4, seed=1)
    ref = _torch64(m, x)
    net = dnn.from_torch(m, (1, 3, 8, 8)).compile(dtype=dtype)
    y = net(x.astype(dtype))
    assert y.dtype == dtype and y.shape == (4, 10)
    assert _rel(y, ref) < TOL[dtype]
    assert not any(n.op == "batch_norm" for n in net.nodes)


def test_bfloat16():
    ml = pytest.importorskip("ml_dtypes")
    blasx.configure(devices="sim:1", tile=16)
    m = _bn_stats(ResNetish())
    x = _x(3)
    net = dnn.from_torch(m, (1, 3, 8, 8)).compile(dtype=ml.bfloat16)
    y = net(x)  # x is cast to the network's type
    assert y.dtype == ml.bfloat16 and _rel(y, _torch64(m, x)) < 5e-2


def test_channels_last_and_chunks_agree():
    blasx.configure(devices="sim:2", tile=16)
    m = _bn_stats(ResNetish())
    x = _x(7, seed=2)
    ref = _torch64(m, x)
    net = dnn.from_torch(m, (1, 3, 8, 8)).compile(layout="cl")
    for chunk in (1, 3, 7, 100):
        assert _rel(net(x, chunk=chunk), ref) < 1e-12


def test_the_default_layout_is_channels_last_on_gpus_and_nchw_on_the_host_engine():
    blasx.configure(devices="sim:2", tile=16)
    m = _bn_stats(ResNetish())
    x = _x(3, seed=4)
    net = dnn.from_torch(m, (1, 3, 8, 8)).compile()
    assert net.layout == "auto" and net.run_layout(True) == "cl" and net.run_layout(False) == "nchw"
    assert _rel(net(x), _torch64(m, x)) < 1e-12
    assert [w.layout for ws in net._workers.values() for w in ws] == ["nchw"]  # the host engine's one lane
    assert net.compile(layout="cl").run_layout(False) == "cl" and net.compile(layout="nchw").run_layout(True) == "nchw"


def test_the_default_layout_runs_channels_last_on_a_gpu(monkeypatch):
    """compile()'s default on a GPU (the CPU stand-in): the GPU's workers run channels-last, x and y NCHW."""
    from bench import fake_cupy
    from blasx import session
    monkeypatch.setattr(session, "cuda_ordinals", lambda: [0])
    m = _bn_stats(ResNetish())
    try:
        with fake_cupy.installed():
            net = dnn.from_torch(m, (1, 3, 8, 8)).compile(dtype=np.float32, workers_per_gpu=1, graphs=False)
            y = net(_x(4, seed=5).astype(np.float32), chunk=2)
            assert [w.layout for ws in net._workers.values() for w in ws] == ["cl"]
            assert y.shape == (4, 10) and y.flags.c_contiguous
    finally:
        blasx.shutdown()


def test_builder_network_runs():
    blasx.configure(devices="cpu")
    r = np.random.default_rng(3)
    from blasx.dnn.graph import Builder
    b = Builder((2, 5, 5))
    w1, w2 = r.standard_normal((4, 2, 3, 3)), r.standard_normal((3, 4 * 25))
    h = b.act(b.conv(b.x, w1, padding=1), "gelu", approximate="tanh")
    out = b.linear(b.flatten(h), w2)
    net = b.network(out)
    x = r.standard_normal((2, 2, 5, 5))
    ref = F.linear(torch.flatten(F.gelu(F.conv2d(torch.from_numpy(x), torch.from_numpy(w1), padding=1),
                                        approximate="tanh"), 1), torch.from_numpy(w2)).numpy()
    assert _rel(net(x), ref) < 1e-12
    assert _rel(net.compile()(x), ref) < 1e-12


class Seq(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn = getattr(nn, kind)(6, 8, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y[:, -1])


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_sequence_model_with_linear_head(kind):
    blasx.configure(devices="sim:2", tile=16)
    torch.manual_seed(0)
    m = Seq(kind).eval()
    x = np.random.default_rng(0).standard_normal((5, 4, 6))
    net = dnn.from_torch(m, (2, 4, 6)).compile()
    assert _rel(net(x, chunk=2), _torch64(m, x)) < 1e-10


def test_profile_trace_and_progress(tmp_path, capsys):
    blasx.configure(devices="sim:2", tile=16)
    m = _bn_stats(ResNetish())
    net = dnn.from_torch(m, (1, 3, 8, 8)).compile()
    net(_x(6), chunk=2, progress=True)
    prof = net.last_profile()
    assert prof.images == 6 and prof.chunks == 3 and prof.devices == ("host",)
    rows = {r.name: r for r in prof.by_layer()}
    assert rows["stem"].fused == ("bn", "act") and rows["stem"].flops == 2.0 * 6 * 8 * 16 * 27
    assert all(r.seconds >= 0 for r in rows.values())
    assert "images/s" in prof.report() and "bn+act" in prof.report()
    assert rows["stem"].algo == "engine" and rows["stem"].algo == net.algo["stem"]  # host chunks: the engine
    assert all(r.algo == "" for r in rows.values() if r.op != "conv")
    assert {s["name"]: s["algo"] for s in prof.summary()["layers"]}["stem"] == "engine"
    trace = prof.to_chrome_trace(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text()) == trace
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 3 * len(net.nodes[1:])
    err = capsys.readouterr().err
    assert "3/3 chunks" in err and "images/s" in err
    assert json.dumps(prof.summary())


def test_progress_line_is_pure():
    from blasx.dnn.executor import progress_line
    assert progress_line(3, 8, 300, 2.0).startswith("network [#########---------------]  3/8 chunks  150 images/s")


def test_errors_are_raised_before_work_and_the_network_stays_usable(monkeypatch):
    blasx.configure(devices="sim:1", tile=16)
    m = ResNetish(bn=False).eval()
    net = dnn.from_torch(m, (1, 3, 8, 8)).compile()
    plain_ref = _torch64(m, _x(4))
    with pytest.raises(ValueError, match=r"x: expected shape \('N', 3, 8, 8\)"):
        net(np.zeros((2, 3, 8, 9)))
    with pytest.raises(TypeError, match="x: "):
        net(np.zeros((2, 3, 8, 8), dtype=np.int32))
    with pytest.raises(TypeError, match="x: expected a numpy or cupy array"):
        net([[1.0]])
    with pytest.raises(ValueError, match="chunk: got 0"):
        net(np.zeros((2, 3, 8, 8)), chunk=0)
    with pytest.raises(ValueError, match="layout: got 'nhwc'"):
        net.compile(layout="nhwc")
    calls = {"n": 0}
    real = layers.run_node

    def flaky(node, *a, **k):
        calls["n"] += 1
        if calls["n"] == 12:
            raise RuntimeError("boom in a layer")
        return real(node, *a, **k)
    monkeypatch.setattr(layers, "run_node", flaky)
    with pytest.raises(RuntimeError, match="boom in a layer"):
        net(_x(4), chunk=1)
    monkeypatch.setattr(layers, "run_node", real)
    assert _rel(net(_x(4), chunk=1), plain_ref) < 1e-12





@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v2"])
def test_bench_models_tiny_compiled_vs_uncompiled(name):
    from bench import network_models as NM
    blasx.configure(devices="sim:2", tile=16)
    m, _ = NM.build(name, shrink=16, prefer_torchvision=False)
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32))
    ref = _torch64(m, x)
    plain = dnn.from_torch(m, (1, 3, 32, 32))
    net = dnn.from_torch(m, (1, 3, 32, 32)).compile()
    assert _rel(plain(x), ref) < 1e-10 and _rel(net(x, chunk=1), ref) < 1e-10
    assert not any(n.op == "batch_norm" for n in net.nodes)


def test_mobilenet_style_hardswish_relu6_depthwise():
    blasx.configure(devices="sim:2", tile=16)
    m = _bn_stats(nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.Hardswish(),
                                nn.Conv2d(8, 8, 3, 1, 1, groups=8), nn.BatchNorm2d(8), nn.ReLU6(),
                                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)))
    x = _x(3)
    for fuse in (False, True):
        assert _rel(dnn.from_torch(m, (1, 3, 8, 8)).compile(fuse=fuse)(x), _torch64(m, x)) < 1e-10


def test_vgg_style_with_lrn():
    blasx.configure(devices="sim:2", tile=16)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.LocalResponseNorm(3), nn.MaxPool2d(2),
                      nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32, 5),
                      nn.ReLU(), nn.Dropout(), nn.Linear(5, 3)).eval()
    x = _x(3)
    for fuse in (False, True):
        assert _rel(dnn.from_torch(m, (1, 3, 8, 8)).compile(fuse=fuse)(x), _torch64(m, x)) < 1e-10


def test_graphs_option_is_checked_and_is_a_no_op_on_the_host():
    """compile(graphs=True) replays chunks from CUDA graphs on GPUs only: on the host the run is the same."""
    blasx.configure(devices="sim:1", tile=16)
    m = ResNetish(bn=False).eval()
    with pytest.raises(TypeError, match="graphs: got 1"):
        dnn.from_torch(m, (1, 3, 8, 8)).compile(graphs=1)
    net = dnn.from_torch(m, (1, 3, 8, 8)).compile(graphs=True)
    assert _rel(net(_x(4), chunk=2), _torch64(m, _x(4))) < 1e-12 and net.last_profile().graphs is None


def test_default_chunk_by_exact_value():
    """The batch over the lanes once, at most CHUNK_MAX images, within a worker's share of free device memory."""
    from blasx.dnn.network import CHUNK_MAX, default_chunk
    mib, gib = 1 << 20, 1 << 30
    assert default_chunk(1024, 2, mib, 80 * gib, 2) == CHUNK_MAX == 256
    assert default_chunk(1024, 8, mib, 80 * gib, 2) == 128
    assert default_chunk(100_000, 4, 10 * mib, 8 * gib, 2) == 51  # (8 GiB * 0.5 / 2) // (10 MiB * 4)
    assert default_chunk(3, 4, mib, 80 * gib, 2) == 1 and default_chunk(5, 1, 10 * gib, gib, 2) == 1


def test_profile_algorithms_are_worked_out_once_per_configuration(monkeypatch):
    blasx.configure(devices="sim:1", tile=16)
    net = dnn.from_torch(ResNetish(bn=False).eval(), (1, 3, 8, 8)).compile()
    calls = []
    real = net.algos
    monkeypatch.setattr(net, "algos", lambda *a: calls.append(a) or real(*a))
    for _ in range(3):
        net(_x(4), chunk=2)
    assert len(calls) == 1 and net.last_profile().by_layer()[0].algo == "engine"
    net(_x(4), chunk=1)  # another chunk shape
    net.compile()
    net(_x(4), chunk=1)  # compile forgets it
    assert [a[0] for a in calls if a] == [(2, 3, 8, 8), (1, 3, 8, 8), (1, 3, 8, 8)]  # (compile's own: no args)


def test_a_gpu_call_orders_its_workers_after_the_callers_stream_and_calls_run_one_at_a_time(monkeypatch):
    """CuPy x (the CPU stand-in): every worker's stream waits for an event of the caller's stream before it
    reads x, and its output is made on the caller's stream (the workers' streams are the network's, shared by
    its calls); two threads calling one network run one call at a time."""
    import threading

    from bench import fake_cupy
    from blasx import session
    from blasx.dnn import executor
    monkeypatch.setattr(session, "cuda_ordinals", lambda: [0])
    m = _bn_stats(ResNetish())
    try:
        with fake_cupy.installed(record_calls=True) as fake:
            cupy = fake.cupy
            net = dnn.from_torch(m, (1, 3, 8, 8)).compile(dtype=np.float32, workers_per_gpu=1, graphs=False)
            x = cupy.asarray(_x(4, seed=5).astype(np.float32))
            made_on = []
            real_empty = cupy.empty

            def empty(*a, **k):
                made = real_empty(*a, **k)
                made_on.append((tuple(made.shape), cupy.cuda.get_current_stream().ptr))
                return made
            caller = cupy.cuda.Stream(non_blocking=True)
            with caller:
                net(x, chunk=2)  # (workers made: their first call)
                fake_cupy.LOG.clear()
                monkeypatch.setattr(cupy, "empty", empty)
                y = net(x, chunk=2)
                monkeypatch.setattr(cupy, "empty", real_empty)
            (w,) = [w for ws in net._workers.values() for w in ws]
            log = [e[:2] for e in fake_cupy.LOG]
            first_wait = log.index(("wait_event", w.stream.ptr))
            assert ("event_record", caller.ptr) in log[:first_wait]
            assert y.shape == (4, 10) and [p for shape, p in made_on if shape == (4, 10)] == [caller.ptr]
            inside, most, lock = [0], [0], threading.Lock()
            real_run = executor.run

            def run(*a, **k):
                with lock:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                try:
                    return real_run(*a, **k)
                finally:
                    with lock:
                        inside[0] -= 1
            monkeypatch.setattr(executor, "run", run)
            ts = [threading.Thread(target=lambda: net(x, chunk=2)) for _ in range(3)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert most[0] == 1
    finally:
        blasx.shutdown()


def test_a_failing_gpu_worker_synchronises_its_stream_before_the_error_is_raised(monkeypatch):
    """A chunk that raises on a GPU worker (the CPU stand-in): its stream is synchronised first (its queued work
    done before a compile() or new parameters can drop its buffers), then the error reaches the caller."""
    from bench import fake_cupy
    from blasx import session
    from blasx.dnn import executor
    monkeypatch.setattr(session, "cuda_ordinals", lambda: [0])
    m = _bn_stats(ResNetish())
    try:
        with fake_cupy.installed(record_calls=True) as fake:
            net = dnn.from_torch(m, (1, 3, 8, 8)).compile(dtype=np.float32, workers_per_gpu=1, graphs=False)
            x = fake.cupy.asarray(_x(4, seed=5).astype(np.float32))
            net(x, chunk=2)
            (w,) = [w for ws in net._workers.values() for w in ws]

            def fail(*a, **k):
                raise RuntimeError("a broken chunk")
            monkeypatch.setattr(executor.Worker, "run_chunk", fail)
            fake_cupy.LOG.clear()
            with pytest.raises(RuntimeError, match="a broken chunk"):
                net(x, chunk=2)
            assert ("synchronize", w.stream.ptr) in [e[:2] for e in fake_cupy.LOG]
    finally:
        blasx.shutdown()


def test_an_empty_batch_gives_torchs_empty_output():
    """net(x) of an empty batch returns torch's empty output (shape and the compiled dtype) without running."""
    import torch
    blasx.configure(devices="sim:2", tile=16)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16, 5))
    net = dnn.from_torch(m.eval(), (1, 3, 4, 4))
    y = net(np.zeros((0, 3, 4, 4), np.float32))
    assert y.shape == tuple(m(torch.zeros(0, 3, 4, 4)).shape) == (0, 5) and y.dtype == np.float32
    assert net.compile(dtype=np.float16)(np.zeros((0, 3, 4, 4), np.float32)).dtype == np.float16


def test_an_empty_batch_through_indexing_or_a_recurrent_layer_gives_torchs_empty_output():
    """Output shapes the graph does not infer (a channel slice, a batch-first LSTM): one image of zeros is run for
    the shape (an empty batch was refused, blaming recurrent layers for the slice)."""
    import torch

    class Sliced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = torch.nn.Conv2d(3, 6, 3, padding=1)

        def forward(self, x):
            return self.c(x)[:, 1:4]

    class Recurrent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.r = torch.nn.LSTM(4, 5, batch_first=True)

        def forward(self, x):
            return self.r(x)[0]
    blasx.configure(devices="sim:2", tile=16)
    for m, shape in ((Sliced(), (3, 5, 5)), (Recurrent(), (7, 4))):
        m = m.double().eval()
        want = tuple(m(torch.zeros((0, *shape), dtype=torch.float64)).shape)
        assert dnn.from_torch(m, (1, *shape))(np.zeros((0, *shape))).shape == want
