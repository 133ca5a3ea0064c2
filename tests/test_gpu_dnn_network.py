"""blasx.dnn.Network on real CUDA GPUs (marker ``gpu``; skipped where CuPy finds none): host batches through
one and all GPUs, CuPy batches on their GPU, compiled vs uncompiled, both layouts, against CPU torch."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
NGPU = blasx.session._cuda_count()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="no CUDA GPU")]
nn, F = torch.nn, torch.nn.functional
TOL = {np.float32: 1e-4, np.float16: 2e-2}


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


class Block(nn.Module):
    def __init__(self, c, mid):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.c2, self.b2 = nn.Conv2d(mid, mid, 3, padding=1, bias=False), nn.BatchNorm2d(mid)
        self.c3, self.b3 = nn.Conv2d(mid, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)))
        return F.relu(self.b3(self.c3(y)) + x)


def _stats(m):
    """``m`` in eval mode with random batch-norm running statistics."""
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 1.5)
    return m.eval()


def _model():
    torch.manual_seed(0)
    return _stats(nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU(), Block(32, 16),
                                Block(32, 16), nn.Flatten(), nn.Linear(32 * 8 * 8, 10)))


def _ref(m, x):
    with torch.no_grad():
        return m.double()(torch.from_numpy(x.astype(np.float64))).numpy()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_host_batch_through_all_gpus(dtype, layout):
    blasx.configure(devices="cuda")
    m = _model()
    x = np.random.default_rng(0).standard_normal((37, 3, 16, 16)).astype(dtype)
    net = dnn.from_torch(m, (1, 3, 16, 16)).compile(dtype=dtype, layout=layout)
    y = net(x, chunk=8)
    assert isinstance(y, np.ndarray) and y.dtype == dtype and _rel(y, _ref(m, x)) < TOL[dtype]
    prof = net.last_profile()
    assert prof.chunks == 5 and len(prof.devices) == NGPU and all(d.startswith("cuda:") for d in prof.devices)
    assert any(r.fused for r in prof.by_layer())


def test_cupy_batch_stays_on_its_gpu():
    blasx.configure(devices="cuda")
    m = _model()
    x = np.random.default_rng(1).standard_normal((9, 3, 16, 16)).astype(np.float32)
    dev = NGPU - 1
    with cupy.cuda.Device(dev):
        xd = cupy.asarray(x)
    y = dnn.from_torch(m, (1, 3, 16, 16)).compile()(xd, chunk=4)
    assert isinstance(y, cupy.ndarray) and y.device.id == dev and _rel(y.get(), _ref(m, x)) < 1e-4


def test_worker_error_is_raised_and_the_network_stays_usable(monkeypatch):
    from blasx.dnn import layers
    blasx.configure(devices="cuda")
    m = _model()
    x = np.random.default_rng(2).standard_normal((16, 3, 16, 16)).astype(np.float32)
    # layer by layer: with graphs on, the 20th call can fall inside a chunk's capture, whose failure is absorbed
    # (the chunk then runs eagerly, correctly), and on one GPU it does
    net = dnn.from_torch(m, (1, 3, 16, 16)).compile(graphs=False)
    real, calls = layers.run_node, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 20:
            raise RuntimeError("boom on a GPU")
        return real(*a, **k)
    monkeypatch.setattr(layers, "run_node", flaky)
    with pytest.raises(RuntimeError, match="boom on a GPU"):
        net(x, chunk=2)
    monkeypatch.setattr(layers, "run_node", real)
    assert _rel(net(x, chunk=2), _ref(m, x)) < 1e-4


@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v2"])
def test_bench_models_compiled_vs_uncompiled(name):
    from bench import network_models as NM
    blasx.configure(devices="cuda")
    m, _ = NM.build(name, shrink=4, prefer_torchvision=False)
    x = np.random.default_rng(0).standard_normal((8, 3, 64, 64)).astype(np.float32)
    ref = _ref(m, x)
    for fuse in (False, True):
        y = dnn.from_torch(m, (1, 3, 64, 64)).compile(fuse=fuse, layout="cl")(x, chunk=3)
        assert _rel(y, ref) < 1e-3


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("source", ["host", "cupy"])
def test_chunks_replayed_from_cuda_graphs(dtype, source):
    """compile() (graphs=True): each worker's chunks of a shape after its first replay a captured CUDA graph;
    the outputs equal the eager run's and the reference, with no capture failing."""
    blasx.configure(devices="cuda")
    m = _model()
    x = np.random.default_rng(3).standard_normal((48, 3, 16, 16)).astype(dtype)
    xin = cupy.asarray(x) if source == "cupy" else x
    eager = dnn.from_torch(m, (1, 3, 16, 16)).compile(dtype=dtype, layout="cl", graphs=False)
    graphed = dnn.from_torch(m, (1, 3, 16, 16)).compile(dtype=dtype, layout="cl")  # graphs by default
    want = eager(xin, chunk=4)
    for _ in range(2):
        y = graphed(xin, chunk=4)
        got, ref = (a.get() if source == "cupy" else a for a in (y, want))
        assert _rel(got, ref) < (1e-6 if dtype == np.float32 else 1e-3) and _rel(got, _ref(m, x)) < TOL[dtype]
    g = graphed.last_profile().graphs
    assert g["failures"] == 0 and g["captured"] >= 1 and g["replays"] > 0, g
    assert any(r.name == "(cuda graph)" for r in graphed.last_profile().by_layer())


def test_graph_replays_keep_their_memory_when_the_caches_drop_it():
    """A captured graph reads the worker's scratch, weight transforms and channel vectors: after the caches drop
    them all and their memory is handed out and overwritten, replays still give the right output."""
    from blasx.dnn import direct_cache
    blasx.configure(devices="cuda:0")
    m = _model()
    x = np.random.default_rng(4).standard_normal((16, 3, 16, 16)).astype(np.float32)
    net = dnn.from_torch(m, (1, 3, 16, 16)).compile(dtype=np.float32, layout="cl", graphs=True, workers_per_gpu=1)
    for _ in range(3):
        want = net(x, chunk=4)
    assert net.last_profile().graphs["replays"] > 0
    for w in net._workers_for([0], np.dtype(np.float32), (4, 3, 16, 16)):
        w.workspace.release()
    direct_cache.clear()
    with cupy.cuda.Device(0):
        junk = [cupy.full(1 << 20, np.nan, dtype=np.float32) for _ in range(64)]  # reuses freed pool blocks
        cupy.cuda.Device().synchronize()
    y = net(x, chunk=4)
    del junk
    assert _rel(y, want) < 1e-6 and _rel(y, _ref(m, x)) < TOL[np.float32]
    assert net.last_profile().graphs["failures"] == 0


class _Seq(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn = getattr(nn, kind)(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y[:, -1])


def _nets():
    """The issue's other network kinds: MobileNet-style (hardswish, relu6, depthwise with whole 16-byte units of
    channels), VGG-style with LRN, and LSTM/GRU sequence models with a linear head."""
    torch.manual_seed(0)
    mobile = _stats(nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.Hardswish(),
                                  nn.Conv2d(16, 16, 3, 1, 1, groups=16), nn.BatchNorm2d(16), nn.ReLU6(),
                                  nn.Conv2d(16, 24, 1), nn.BatchNorm2d(24), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(24, 4)))
    vgg = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.LocalResponseNorm(3), nn.MaxPool2d(2),
                        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                        nn.Linear(16 * 4 * 4, 10), nn.ReLU(), nn.Dropout(), nn.Linear(10, 3)).eval()
    return {"mobilenet": (mobile, (3, 16, 16)), "vgg_lrn": (vgg, (3, 16, 16)),
            "lstm_head": (_Seq("LSTM").eval(), (7, 16)), "gru_head": (_Seq("GRU").eval(), (7, 16))}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("name", ["mobilenet", "vgg_lrn", "lstm_head", "gru_head"])
def test_other_network_kinds_on_gpus(name, dtype):
    """Host batches through all GPUs (graphs on), compiled and not, within the dtype's tolerance of torch in
    float64."""
    blasx.configure(devices="cuda")
    m, shape = _nets()[name]
    x = np.random.default_rng(2).standard_normal((12, *shape)).astype(dtype)
    ref = _ref(m, x)
    layout = "cl" if len(shape) == 3 else "auto"  # (auto on GPUs: channels-last, sequences as they are)
    for fuse in (False, True):
        net = dnn.from_torch(m, (1, *shape)).compile(dtype=dtype, layout=layout, fuse=fuse)
        for _ in range(2):  # the second call replays the captured chunks
            y = net(x, chunk=3)
            assert y.dtype == dtype and _rel(y, ref) < {np.float32: 1e-4, np.float16: 3e-2}[dtype], (fuse, _rel(y, ref))
