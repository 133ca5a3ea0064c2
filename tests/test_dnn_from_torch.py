"""blasx.dnn.from_torch's conversion rules against torch on the CPU: in-place operations, operations across the
batch's images, a linear's batch norm, a module called twice, a module of buffers alone. Each case either
converts to a network that gives torch's answer or is refused naming the node."""

from __future__ import annotations

import importlib
import re

import numpy as np
import pytest

import blasx
from blasx import dnn
from blasx.dnn.from_torch import UnsupportedError

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional


@pytest.fixture(autouse=True)
def _engine():
    blasx.configure(devices="sim:2", tile=16)
    yield
    blasx.shutdown()


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _same(m, shape, chunk=None, seed=0):
    """The converted network's inference output against the module's own (float64, eval mode)."""
    m = m.double().eval()
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal(shape))
    ref = m(x.clone()).detach().numpy()
    got = dnn.from_torch(m, (1, *shape[1:])).compile()(x.numpy(), **({} if chunk is None else {"chunk": chunk}))
    assert _rel(got, ref) < 1e-12


class _Conv(nn.Module):
    def __init__(self, body, **more):
        super().__init__()
        self.c, self.body = nn.Conv2d(3, 3, 3, padding=1), body
        for k, v in more.items():
            setattr(self, k, v)

    def forward(self, x):
        return self.body(self, x)


def test_an_in_place_activation_is_seen_by_the_tensors_later_readers():
    """y + relu_(y) is 2 relu(y) in torch: the reader of y after the in-place ReLU reads its result."""
    _same(_Conv(lambda s, x: (lambda y: y + s.r(y))(s.c(x)), r=nn.ReLU(inplace=True)), (2, 3, 5, 5))
    _same(_Conv(lambda s, x: (lambda y: F.relu(y, inplace=True) + y)(s.c(x))), (2, 3, 5, 5))


def test_a_trace_that_differs_from_the_module_is_refused():
    """`y += x` traces as `y + x` (torch.fx): a reader of the old y would see the sum in torch, not here."""
    def body(s, x):
        y = s.c(x)
        skip = y
        y += x
        return torch.cat([y, skip], 1)
    with pytest.raises(UnsupportedError, match="traced graph computes otherwise"):
        dnn.from_torch(_Conv(body).double(), (1, 3, 5, 5))


@pytest.mark.parametrize("body,why", [
    (lambda s, x: F.softmax(s.c(x), dim=0), "softmax .* over the batch axis"),
    (lambda s, x: s.ls(s.c(x).flatten(2)), "LogSoftmax over the batch axis"),  # implicit dim 0 on 3-D
    (lambda s, x: torch.cat([s.c(x), x]), "cat .* along the batch axis"),
    (lambda s, x: torch.cat([s.c(x), x], axis=0), "cat .* along the batch axis"),
    (lambda s, x: s.c(x)[:1], "getitem .* indexing the batch axis"),
    (lambda s, x: s.c(x).add(x, alpha=2), "Tensor.add"),
    (lambda s, x: F.softmax(s.c(x), dim=1, dtype=torch.float32), "softmax"),
])
def test_operations_across_the_batch_or_unsupported_arguments_are_refused(body, why):
    """A chunk of the batch is run at a time: an op mixing or selecting images cannot be; an argument the
    network would drop (alpha, dtype) is refused, not ignored."""
    with pytest.raises(UnsupportedError, match=why):
        dnn.from_torch(_Conv(body, ls=nn.LogSoftmax()).double(), (1, 3, 5, 5))


def test_implicit_softmax_dim_and_channel_items_convert():
    _same(_Conv(lambda s, x: s.sm(s.c(x)), sm=nn.Softmax()), (4, 3, 5, 5), chunk=2)  # implicit dim 1 on 4-D
    _same(_Conv(lambda s, x: s.c(x)[:, 1:]), (4, 3, 5, 5), chunk=2)
    m = _Conv(lambda s, x: s.sm(s.c(x)), sm=nn.Softmax())
    net = dnn.from_torch(m.double().train(), (2, 3, 5, 5))
    y = net.forward_train(np.ones((2, 3, 5, 5)))
    assert net.backward(np.ones_like(y)).shape == (2, 3, 5, 5)  # (dim resolved: the backward runs)


def test_an_implicit_softmax_dim_on_an_input_of_unknown_rank_is_refused(monkeypatch):
    """torch's implicit dim follows the input's rank (0 on 1- and 3-D, else 1): without the rank the network
    cannot tell whether it is the batch axis, so the softmax is refused, not given dim 0."""
    ft = importlib.import_module("blasx.dnn.from_torch")
    known = ft._shape_of
    monkeypatch.setattr(ft, "_shape_of", lambda n: None if n.name == "sm" else known(n))
    with pytest.raises(UnsupportedError, match="implicit dim on an input of unknown rank"):
        dnn.from_torch(_Conv(lambda s, x: s.sm(s.c(x)), sm=nn.Softmax()).double(), (1, 3, 5, 5))


def test_a_linear_on_3d_input_keeps_its_batch_norm():
    """BatchNorm1d after a Linear on (N, L, in) normalises L, not the linear's features: not folded."""
    _same(nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(5)).apply(_stats), (4, 5, 6))
    _same(nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)).apply(_stats), (4, 6))  # 2-D: folded, same answer


def _stats(mod):
    if isinstance(mod, nn.BatchNorm1d):
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            mod.running_mean.copy_(torch.randn(mod.running_mean.shape, generator=g))
            mod.running_var.copy_(torch.rand(mod.running_var.shape, generator=g) + 0.5)


def test_a_batch_norm_called_twice_counts_twice():
    """momentum=None (a cumulative average): torch counts batches per module, so a module called twice in a
    forward averages with 1/1 then 1/2."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3, momentum=None)

        def forward(self, x):
            return self.bn(F.relu(self.bn(x)))
    m = M().double().train()
    net = dnn.from_torch(m, (2, 3))
    for step in range(3):
        x = torch.from_numpy(np.random.default_rng(step).standard_normal((8, 3)))
        m(x)
        net.forward_train(x.numpy())
        np.testing.assert_allclose(net.buffers()["bn.running_mean"], m.bn.running_mean.numpy(), rtol=1e-12)


def test_a_module_of_buffers_alone_converts_in_its_dtype():
    m = nn.BatchNorm2d(3, affine=False).double().eval()
    _same(nn.Sequential(m), (2, 3, 4, 4))


def test_compile_and_set_parameters_wait_for_a_call_of_another_thread(monkeypatch):
    """compile() / set_parameters() from one thread while another thread's call runs: the call finishes on the
    graph and weights it started with (compile dropped its run record mid-call: TypeError; new weights could
    be missed by workers stored after the clear), and the next call uses the new ones."""
    import threading
    import time
    from blasx.dnn import executor
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()).double().eval()
    net = dnn.from_torch(m, (1, 3, 8, 8)).compile()
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8))
    net(x)
    real = executor.run

    def slow(*a, **k):  # (the call's window widened)
        out = real(*a, **k)
        time.sleep(0.2)
        return out
    monkeypatch.setattr(executor, "run", slow)
    got, err = [], []
    t = threading.Thread(target=lambda: got.append(net(x)))
    t.start()
    time.sleep(0.05)
    try:
        net.compile()
        new = {k: v.detach().numpy() * 2 for k, v in m.state_dict().items()}
        net.set_parameters(new)
    except Exception as exc:  # noqa: BLE001
        err.append(exc)
    t.join()
    assert not err and len(got) == 1
    ref = m(torch.from_numpy(x)).detach().numpy()
    assert _rel(got[0], ref) < 1e-12
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(2)
    assert _rel(net(x), m(torch.from_numpy(x)).detach().numpy()) < 1e-12


def test_conversion_never_runs_or_switches_the_users_module():
    """The trace and its probe run on a copy: a thread training the module meanwhile never sees it in eval mode,
    its batch norm's running statistics are never put back, and its forward is never called by from_torch."""
    class Seen(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.bn, self.modes = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), []

        def forward(self, x):
            if not torch.fx._symbolic_trace.is_fx_tracing():
                self.modes.append(self.training)
            return self.bn(self.c(x))
    m = Seen().double().train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    dnn.from_torch(m, (2, 3, 5, 5))
    assert m.modes == [] and m.training and m.bn.training
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_a_backward_after_another_threads_forward_train_is_refused():
    """One network's tape is one: A's forward, B's forward, A's backward gave A B's input gradient (silent)."""
    import threading
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()).double().train()
    net = dnn.from_torch(m, (2, 3, 5, 5))
    x = np.random.default_rng(1).standard_normal((2, 3, 5, 5))
    y = net.forward_train(x)
    t = threading.Thread(target=lambda: net.forward_train(2 * x))
    t.start()
    t.join()
    with pytest.raises(RuntimeError, match="ran in another thread"):
        net.backward(np.ones_like(y))
    y = net.forward_train(x)  # (this thread's own forward: its backward runs)
    assert net.backward(np.ones_like(y)).shape == x.shape


def test_a_time_major_recurrent_network_takes_its_modules_own_input_shape():
    """batch_first=False: the batch is dim 1, so the example (T, B, F) and inputs of the module's own shape are
    taken, any batch size, and the stored per-image shape leaves out dim 1."""
    blasx.configure(devices="sim:2")

    class G(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.fc = torch.nn.GRU(4, 5), torch.nn.Linear(5, 2)

        def forward(self, x):
            return self.fc(self.rnn(x)[0])

    torch.manual_seed(0)
    m = G().double().eval()
    x = np.random.default_rng(1).standard_normal((6, 3, 4))
    with torch.no_grad():
        ref = m(torch.tensor(x)).numpy()
    for example in ((6, 1, 4), (6, 3, 4)):
        net = dnn.from_torch(m, example)
        net.compile()
        y = net(x)
        assert y.shape == (6, 3, 2) and np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-12
        assert net(x[:, :1]).shape == (6, 1, 2)
    with pytest.raises(ValueError, match=r"expected shape \(6, 'N', 4\)"):
        net(x[:5])


def test_a_time_major_recurrent_layer_after_row_wise_layers_chunks_along_dim_1():
    """Layers before a batch_first=False LSTM / GRU that work row by row (Linear, Dropout, activations) keep dim 1
    the batch, so a chunked run splits images, not time steps; one that may mix dim 1 is refused, named."""
    blasx.configure(devices="sim:2", tile=16)

    class M(torch.nn.Module):
        def __init__(self, pre):
            super().__init__()
            self.pre, self.rnn = pre, torch.nn.GRU(4, 5)

        def forward(self, x):
            return self.rnn(self.pre(x))[0]

    torch.manual_seed(0)
    x = np.random.default_rng(1).standard_normal((6, 3, 4))
    for pre in (torch.nn.Dropout(0.1), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())):
        m = M(pre).double().eval()
        with torch.no_grad():
            ref = m(torch.tensor(x)).numpy()
        net = dnn.from_torch(m, (6, 3, 4))
        assert net.graph.batch_axis == 1
        for chunk in (None, 1, 2):
            y = net(x, chunk=chunk) if chunk else net(x)
            assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-12
    with pytest.raises(UnsupportedError, match="batch_first=False after"):
        dnn.from_torch(M(torch.nn.LayerNorm([3, 4])).double().eval(), (6, 3, 4))


def test_a_batch_first_recurrent_layers_states_have_the_batch_at_dim_1():
    """h_n / c_n of a batch-first LSTM or GRU are (layers x directions, N, H): h_n[-1] (a classifier's last
    layer) is taken and chunks right; h_n returned whole, indexed along its batch dim or read by another op is
    refused, named (it was taken as batch-first: a garbled, transposed output)."""
    blasx.configure(devices="sim:2", tile=16)

    class M(torch.nn.Module):
        def __init__(self, kind, pick):
            super().__init__()
            self.rnn = getattr(torch.nn, kind)(5, 7, batch_first=True, num_layers=2, bidirectional=True)
            self.fc, self.pick, self.lstm = torch.nn.Linear(7, 3), pick, kind == "LSTM"

        def forward(self, x):
            if self.lstm:
                _, (h, c) = self.rnn(x)
            else:
                _, h = self.rnn(x)
            return self.pick(self, h)

    torch.manual_seed(0)
    x = np.random.default_rng(1).standard_normal((5, 6, 5))
    for kind in ("LSTM", "GRU"):
        for pick in (lambda s, h: s.fc(h[-1]), lambda s, h: s.fc(h[-2:][0]) + s.fc(h[1])):
            m = M(kind, pick).double().eval()
            with torch.no_grad():
                ref = m(torch.tensor(x)).numpy()
            net = dnn.from_torch(m, (2, 6, 5))
            for chunk in (None, 1, 4):
                y = net(x, chunk=chunk) if chunk else net(x)
                assert y.shape == ref.shape and np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-12
        for pick, why in ((lambda s, h: h, "output: a recurrent layer's h_n"), (lambda s, h: s.fc(h[:, 0]),
                          "indexing the batch axis"), (lambda s, h: s.fc(h), "on a recurrent layer's h_n")):
            with pytest.raises(UnsupportedError, match=why):
                dnn.from_torch(M(kind, pick).double().eval(), (2, 6, 5))


def test_modules_refused_for_their_settings_say_which():
    """A module whose settings are not converted is named with them (a bare "unsupported node" said nothing)."""
    blasx.configure(devices="sim:2")
    cases = ((nn.BatchNorm2d(3, track_running_stats=False), (2, 3, 4, 4), "track_running_stats=False"),
             (nn.Conv2d(3, 3, 3, padding_mode="reflect", padding=1), (2, 3, 4, 4), "padding_mode='reflect'"),
             (nn.LSTM(3, 4, num_layers=2, dropout=0.5, batch_first=True), (2, 5, 3), "dropout=0.5"))
    for module, shape, why in cases:
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.m = module

            def forward(self, x):
                y = self.m(x)
                return y[0] if isinstance(self.m, nn.LSTM) else y
        with pytest.raises(UnsupportedError, match=re.escape(why)):
            dnn.from_torch(M().eval(), shape)
