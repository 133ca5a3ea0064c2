"""blasx.dnn.Network training (forward_train / backward) on the CPU against torch autograd in train() mode:
outputs, the input's gradient, every parameter's gradient and the updated running statistics, for
ResNet-, MobileNet-, VGG- and LSTM-style models in float64 and float32; dropout masks; an SGD step;
errors before any work."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn

torch = pytest.importorskip("torch")
from train_ref import ResNetish, check_float16  # noqa: E402 - after torch is known to be there
from train_ref import err as _err  # noqa: E402

nn, F = torch.nn, torch.nn.functional

TOL = {np.float64: 1e-11, np.float32: 1e-4}


class MobileNetish(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.b0 = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8)
        self.dw, self.b1 = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8)
        self.pw, self.b2 = nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = F.relu6(self.b0(self.stem(x)))
        x = F.hardswish(self.b1(self.dw(x)))
        x = F.relu6(self.b2(self.pw(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class VGGish(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 8, 3, padding=1)
        self.lrn = nn.LocalResponseNorm(3, alpha=1e-2, beta=0.75, k=2.0)
        self.pool, self.avg = nn.MaxPool2d(2), nn.AvgPool2d(2)
        self.drop = nn.Dropout(p)
        self.fc1, self.fc2 = nn.Linear(8 * 2 * 2, 12), nn.Linear(12, 3)

    def forward(self, x):
        x = self.pool(self.lrn(F.relu(self.c1(x))))
        x = self.avg(F.relu(self.c2(x)))
        x = self.drop(F.relu(self.fc1(x.view(x.size(0), -1))))
        return F.log_softmax(self.fc2(x), dim=1)


class Seq(nn.Module):
    def __init__(self, kind="LSTM"):
        super().__init__()
        self.rnn = getattr(nn, kind)(6, 8, num_layers=2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(torch.tanh(self.norm(y[:, -1])))


def _check(model, x, dtype, tol=None, hook=None, net=None):
    """forward_train + backward of from_torch(model) against the model's autograd (in ``dtype``)."""
    tol = tol or TOL[dtype]
    tdt = torch.float64 if dtype == np.float64 else torch.float32
    model = model.to(tdt).train()
    net = net or dnn.from_torch(model, (2, *x.shape[1:]))
    x = x.astype(dtype)
    y = net.forward_train(x)
    if hook is not None:
        hook(model, net)
    g = np.random.default_rng(7).standard_normal(y.shape).astype(dtype)
    gx = net.backward(g)
    xt = torch.from_numpy(x.copy()).requires_grad_()
    yt = model(xt)
    yt.backward(torch.from_numpy(g))
    assert y.dtype == dtype and gx.dtype == dtype and gx.shape == x.shape
    assert _err(y, yt) < tol, "output"
    assert _err(gx, xt.grad) < tol, "input gradient"
    params = dict(model.named_parameters())
    assert sorted(net.grads) == sorted(params)
    for k, p in params.items():
        assert net.grads[k].dtype == dtype
        assert _err(net.grads[k], p.grad) < tol, k
    buffers = dict(model.named_buffers())  # (running statistics and num_batches_tracked)
    assert sorted(net.buffers()) == sorted(buffers)
    for k, v in buffers.items():
        assert _err(net.buffers()[k], v) < tol, k
    return net


@pytest.fixture(autouse=True)
def _engine():
    blasx.configure(devices="sim:2", tile=16)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_resnet_style(dtype):
    torch.manual_seed(0)
    _check(ResNetish(), np.random.default_rng(0).standard_normal((4, 3, 8, 8)), dtype)


@pytest.mark.parametrize("model", ["resnet", "mobilenet"])
def test_float16_training_is_as_accurate_as_torchs_float16(model):
    """float16 (float32 arithmetic inside each layer, float16 between them, as torch): every gradient within
    1.5x of the error CPU torch's own float16 run has, both against float64 torch."""
    torch.manual_seed(0)
    m = (ResNetish() if model == "resnet" else MobileNetish()).double().train()
    check_float16(dnn.from_torch(m, (2, 3, 16, 16)), m, np.random.default_rng(0).standard_normal((8, 3, 16, 16)))


def test_resnet_style_two_steps_accumulate_and_running_stats_follow():
    """Two forward/backward pairs: gradients add up (torch's accumulation) and the running statistics
    (momentum and cumulative average) take both batches."""
    torch.manual_seed(1)
    m = ResNetish().double().train()
    net = dnn.from_torch(m, (2, 3, 8, 8))
    rng = np.random.default_rng(1)
    for _ in range(2):
        x, g = rng.standard_normal((3, 3, 8, 8)), rng.standard_normal((3, 5))
        net.forward_train(x)
        net.backward(g)
        m(torch.from_numpy(x)).backward(torch.from_numpy(g))
    for k, p in m.named_parameters():
        assert _err(net.grads[k], p.grad) < 1e-11, k
    for k, v in net.buffers().items():
        assert _err(v, dict(m.named_buffers())[k]) < 1e-11, k
    net.zero_grad()
    assert net.grads == {}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_mobilenet_style(dtype):
    torch.manual_seed(2)
    _check(MobileNetish(), np.random.default_rng(2).standard_normal((4, 3, 8, 8)), dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_vgg_style_with_lrn_and_dropout_off(dtype):
    torch.manual_seed(3)
    _check(VGGish(0.0), np.random.default_rng(3).standard_normal((3, 3, 8, 8)), dtype)


def test_vgg_style_dropout_mask_matches_torch_with_the_same_mask():
    torch.manual_seed(4)
    model = VGGish(0.4)
    x = np.random.default_rng(4).standard_normal((3, 3, 8, 8))

    def same_mask(model, net):
        (name, mask), = net.dropout_masks().items()
        assert name == "drop" and mask.dtype == np.bool_ and 0 < mask.mean() < 1
        keep = torch.from_numpy(mask)
        model.drop.register_forward_hook(lambda mod, inp, out: inp[0] * keep / (1 - 0.4))
    net = _check(model, x, np.float64, hook=same_mask)
    first = net.dropout_masks()["drop"]
    net.forward_train(x)
    assert (net.dropout_masks()["drop"] != first).any()  # a new mask each step, from the seed
    again = dnn.from_torch(VGGish(0.4).double().train(), (2, 3, 8, 8))
    again.forward_train(x)
    assert (again.dropout_masks()["drop"] == first).all()  # the same seed: the same first mask
    again.seed = 5
    again.forward_train(x)
    assert (again.dropout_masks()["drop"] != net.dropout_masks()["drop"]).any()


@pytest.mark.parametrize("kind, dtype", [("LSTM", np.float64), ("LSTM", np.float32), ("GRU", np.float64)])
def test_recurrent_with_linear_head(kind, dtype):
    torch.manual_seed(5)
    _check(Seq(kind), np.random.default_rng(5).standard_normal((4, 5, 6)), dtype)


class FanOut(nn.Module):
    """One value read by three nodes (a cat, an add of itself, a residual); GroupNorm, the other activations,
    an adaptive max pool."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1, dilation=1, groups=2)
        self.gn = nn.GroupNorm(2, 4)
        # (no Hardsigmoid: torch's CPU backward scales by 1/6 rounded to float32, off by ~1e-8 in float64)
        self.acts = nn.Sequential(nn.GELU(approximate="tanh"), nn.SiLU(), nn.ELU(0.7), nn.LeakyReLU(0.1))
        self.amax = nn.AdaptiveMaxPool2d(2)

    def forward(self, x):
        h = torch.sigmoid(self.c(x))
        y = torch.cat([h, h + h], dim=1)
        z = self.acts(self.c2(F.gelu(self.gn(y[:, :4] + h))))
        return F.softmax(self.amax(z).flatten(1), dim=1)


def test_functional_dropout_keeps_p_and_training():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return F.dropout(F.dropout(self.lin(x), 0.25, training=self.training), p=0.4, training=False)
    net = dnn.from_torch(M().double().train(), (2, 4))
    y = net.forward_train(np.ones((50, 4)))
    (name, mask), = net.dropout_masks().items()  # the second reads through, as torch's
    assert name == "dropout" and 0.5 < mask.mean() < 0.95
    gx = net.backward(np.ones_like(y))
    assert gx.shape == (50, 4)


def test_fan_out_sums_gradients():
    torch.manual_seed(6)
    _check(FanOut(), np.random.default_rng(6).standard_normal((2, 3, 5, 5)), np.float64)


class Twice(nn.Module):
    """A linear layer and a batch norm each called twice (shared weights: the gradients add up)."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(torch.tanh(self.bn(self.lin(x)))))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_module_called_twice_shares_its_parameters(dtype):
    torch.manual_seed(10)
    net = _check(Twice(), np.random.default_rng(10).standard_normal((5, 4)), dtype)
    assert sorted(net.parameters()) == ["bn.bias", "bn.weight", "lin.bias", "lin.weight"]


def test_a_network_built_in_code_names_parameters_by_node():
    rng = np.random.default_rng(9)
    b = dnn.graph.Builder((3, 4, 4))
    h = b.conv(b.x, rng.standard_normal((5, 3, 3, 3)), rng.standard_normal(5), padding=1, name="c")
    h = b.batch_norm(h, np.zeros(5), np.ones(5), rng.standard_normal(5), rng.standard_normal(5), name="bn")
    h = b.flatten(b.act(h, "tanh"))
    net = b.network(b.linear(h, rng.standard_normal((2, 80)), name="fc"))
    assert sorted(net.parameters()) == ["bn.bias", "bn.weight", "c.bias", "c.weight", "fc.weight"]
    assert sorted(net.buffers()) == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
    x = rng.standard_normal((3, 3, 4, 4))
    y = net.forward_train(x)
    gx = net.backward(np.ones_like(y))
    m = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.BatchNorm2d(5), nn.Tanh(), nn.Flatten(),
                      nn.Linear(80, 2, bias=False)).double()
    with torch.no_grad():
        names = {"c.weight": "0.weight", "c.bias": "0.bias", "bn.weight": "1.weight", "bn.bias": "1.bias",
                 "fc.weight": "4.weight"}
        for k, p in net.parameters().items():
            dict(m.named_parameters())[names[k]].copy_(torch.from_numpy(p))
    xt = torch.from_numpy(x).requires_grad_()
    yt = m(xt)
    yt.sum().backward()
    assert _err(y, yt) < 1e-12 and _err(gx, xt.grad) < 1e-12
    assert _err(net.grads["c.weight"], m[0].weight.grad) < 1e-12 and _err(net.buffers()["bn.running_var"],
                                                                           m[1].running_var) < 1e-12


def test_sgd_step_with_parameters_and_set_parameters_matches_torch():
    torch.manual_seed(7)
    m = ResNetish().double().train()
    net = dnn.from_torch(m, (2, 3, 8, 8))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = np.random.default_rng(7).standard_normal((4, 3, 8, 8))
    g = np.random.default_rng(8).standard_normal((4, 5))
    for step in range(2):
        net.zero_grad()
        net.forward_train(x)
        net.backward(g)
        opt.zero_grad()
        m(torch.from_numpy(x)).backward(torch.from_numpy(g))
        opt.step()
        if step == 0:
            for k, p in net.parameters().items():
                p -= 0.1 * net.grads[k]  # in place: the network's own arrays
        else:
            net.set_parameters({k: p - 0.1 * net.grads[k] for k, p in net.parameters().items()})
    for k, p in m.named_parameters():
        assert _err(net.parameters()[k], p) < 1e-12, k
    m.eval()
    ref = m(torch.from_numpy(x))
    assert net.compiled is None
    assert _err(net.compile()(x), ref) < 1e-11  # inference sees the trained weights and running stats


def test_errors_before_any_work():
    torch.manual_seed(8)
    m = VGGish(0.5).double().train()
    net = dnn.from_torch(m, (2, 3, 8, 8))
    with pytest.raises(RuntimeError, match="backward: no forward_train"):
        net.backward(np.zeros((2, 3)))
    y = net.forward_train(np.zeros((2, 3, 8, 8)))
    with pytest.raises(ValueError, match=r"grad_out: expected a numpy array of shape \(2, 3\)"):
        net.backward(np.zeros((2, 4)))
    with pytest.raises(ValueError, match="grad_out: .* dtype float64"):
        net.backward(np.zeros((2, 3), np.float32))
    net.backward(np.ones_like(y))
    with pytest.raises(RuntimeError, match="each forward_train allows one backward"):
        net.backward(np.ones_like(y))
    net.forward_train(np.zeros((2, 3, 8, 8), np.float32))
    with pytest.raises(ValueError, match=r"grads: .* call zero_grad\(\)"):
        net.backward(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="values: unknown names"):
        net.set_parameters({"nope.weight": np.zeros(3)})
    before = net.parameters()["fc2.bias"].copy()
    with pytest.raises(ValueError, match=r"values\['fc1.bias'\]: expected a real numpy or CuPy array of shape "
                                         r"\(12,\)"):
        net.set_parameters({"fc2.bias": np.zeros(3), "fc1.bias": np.zeros(5)})
    assert (net.parameters()["fc2.bias"] == before).all()  # nothing written
    net.seed = -1
    with pytest.raises(ValueError, match="seed: got -1"):
        net.forward_train(np.zeros((2, 3, 8, 8)))


def test_unsupported_kinds_are_named_before_any_work():
    class Channel(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(3, 4, 1)
            self.d = nn.Dropout2d(0.5)

        def forward(self, x):
            return self.d(self.c(x))
    net = dnn.from_torch(Channel().double(), (2, 3, 4, 4))
    with pytest.raises(NotImplementedError, match=r"node 'd' \(dropout\): channel dropout"):
        net.forward_train(np.zeros((2, 3, 4, 4)))
    fused = dnn.Network(dnn.from_torch(ResNetish().double(), (2, 3, 8, 8)).compile().compiled)
    with pytest.raises(NotImplementedError, match=r"node 'stem' \(conv\): a fused epilogue"):
        fused.forward_train(np.zeros((2, 3, 8, 8)))


def test_the_tape_keeps_what_its_forward_used():
    """In float64 the tape held the network's own weights (an SGD step before backward gave the new weights'
    gradient), and the output returned was the one a sigmoid's backward reads (``y -= target`` rewrote it)."""
    torch.manual_seed(9)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Sigmoid()).double()
    net = dnn.from_torch(m, (3, 6))
    x, target = np.random.default_rng(9).standard_normal((2, 3, 6))[0], np.full((3, 5), 0.5)
    xt = torch.from_numpy(x).requires_grad_()
    yt = m(xt)
    yt.backward(yt.detach() - torch.from_numpy(target))
    y = net.forward_train(x)
    for p in net.parameters().values():
        p += 1.0  # between forward_train and backward
    y -= target
    gx = net.backward(y)
    assert _err(gx, xt.grad) < 1e-12 and _err(net.grads["0.weight"], m[0].weight.grad) < 1e-12


def test_a_state_dict_round_trips_with_its_batch_counts():
    """num_batches_tracked (a momentum=None batch norm's divisor) is a buffer: read, and set by set_parameters."""
    torch.manual_seed(10)
    m = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3, momentum=None)).double().train()
    net = dnn.from_torch(m, (2, 2, 5, 5))
    xs = np.random.default_rng(10).standard_normal((3, 2, 2, 5, 5))
    start = {k: v.clone() for k, v in m.state_dict().items()}
    for x in xs[:2]:
        net.forward_train(x)
        m(torch.from_numpy(x))
    assert int(net.buffers()["1.num_batches_tracked"]) == 2
    net.set_parameters({k: v.numpy() for k, v in start.items()})  # back to the start, counts too
    m.load_state_dict(start)
    net.forward_train(xs[2])
    m(torch.from_numpy(xs[2]))
    for k, v in m.state_dict().items():
        assert _err(net.buffers().get(k, net.parameters().get(k)), v) < 1e-12, k
    with pytest.raises(ValueError, match=r"values\['1.bias'\]: expected a real numpy or CuPy array of shape \(3,\), "
                                         r"got Tensor"):
        net.set_parameters({"1.bias": torch.zeros(3)})


def test_a_batch_norm_off_the_outputs_path_still_counts_its_batches():
    """torch's train mode runs a module whose result is dropped (an auxiliary head): its running statistics
    update; forward_train pruned it (they stayed 0 and 1). Its parameters get no gradient, as torch's (None)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.bn, self.aux = nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.BatchNorm2d(3)

        def forward(self, x):
            y = self.c(x)
            self.aux(y)
            return self.bn(y)
    torch.manual_seed(11)
    m = M().double().train()
    x = np.random.default_rng(11).standard_normal((2, 2, 5, 5))
    g = np.random.default_rng(12).standard_normal((2, 3, 3, 3))
    net = dnn.from_torch(m, x.shape)
    xt = torch.from_numpy(x).requires_grad_()
    m(xt).backward(torch.from_numpy(g))
    net.forward_train(x)
    assert _err(net.backward(g), xt.grad) < 1e-12
    for k, v in m.named_buffers():
        assert _err(net.buffers()[k], v) < 1e-12, k
    for k, p in m.named_parameters():
        assert (k in net.grads) == (p.grad is not None) and (p.grad is None or _err(net.grads[k], p.grad) < 1e-12)


def test_a_call_after_training_compiles_as_the_last_compile():
    """After forward_train (or set_parameters) the next net(x) compiled again with dtype None and no fusion."""
    torch.manual_seed(12)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()).double().train()
    net = dnn.from_torch(m, (2, 3, 6, 6)).compile(dtype=np.float32)
    x = np.random.default_rng(12).standard_normal((2, 3, 6, 6))
    assert net(x).dtype == np.float32
    net.forward_train(x)
    m(torch.from_numpy(x))
    y = net(x)
    m.eval()
    assert y.dtype == np.float32 and _err(y, m(torch.from_numpy(x))) < 1e-5
    assert len(net.compiled.nodes) < len(net.graph.nodes)  # fused again: batch norm folded, relu in the conv


def test_a_network_on_infinities_gives_torchs_nans_without_numpys_warnings():
    """A softmax over an inf in a network run in the caller's thread (the CPU): its layers are blasx.dnn's, under
    torch's floating-point rules (no "invalid value" warning, an error under -W error)."""
    import warnings
    blasx.configure(devices="cpu")
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Softmax(1)).double()
    net = dnn.from_torch(m, (2, 4))
    x = np.array([[np.inf, 1, 2, 3], [1, 2, 3, 4.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = net(x)
        net.backward(np.ones_like(net.forward_train(x)))
    np.testing.assert_allclose(y, m(torch.from_numpy(x)).detach().numpy(), rtol=1e-12)


def test_the_input_gradient_never_shares_the_callers_dy():
    """A network of views alone (flatten, identity): its input gradient is an array of its own, as torch's
    x.grad (it was dy reshaped: writing one wrote the other)."""
    blasx.configure(devices="sim:2", tile=16)

    class Flat(torch.nn.Module):
        def forward(self, x):
            return torch.flatten(x, 1)
    net = dnn.from_torch(Flat(), (1, 2, 3))
    y = net.forward_train(np.ones((4, 2, 3)))
    dy = np.arange(y.size, dtype=y.dtype).reshape(y.shape)
    gx = net.backward(dy)
    assert not np.may_share_memory(gx, dy) and (gx.reshape(dy.shape) == dy).all()
