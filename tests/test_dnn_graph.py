"""blasx.dnn's network IR (graph.py) and from_torch: building, validation, shapes, torch.fx mapping,
the one error listing every unsupported node."""

from __future__ import annotations

import numpy as np
import pytest

from blasx import dnn
from blasx.dnn.from_torch import UnsupportedError
from blasx.dnn.graph import Builder, Graph, Node, infer_shapes

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional


def _w(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def test_builder_makes_a_valid_graph_with_float64_params():
    b = Builder((3, 8, 8))
    h = b.conv(b.x, _w(4, 3, 3, 3).astype(np.float32), np.zeros(4), padding=1)
    h = b.act(h, "relu")
    out = b.linear(b.flatten(h), _w(5, 4 * 64))
    net = b.network(out)
    assert [n.op for n in net.graph.nodes] == ["input", "conv", "act", "reshape", "linear"]
    assert net.graph.nodes[1].params["weight"].dtype == np.float64
    assert infer_shapes(net.graph, (2, 3, 8, 8))[out] == (2, 5)


@pytest.mark.parametrize("nodes, output, fragment", [
    ([Node("x", "input"), Node("a", "bogus", ("x",))], "a", "op 'bogus' unknown"),
    ([Node("x", "input"), Node("a", "act", ("x",), {"fn": "relu"}), Node("a", "act", ("x",), {"fn": "relu"})],
     "a", "used twice"),
    ([Node("x", "input"), Node("a", "add", ("x", "b")), Node("b", "act", ("x",), {"fn": "relu"})], "a",
     "not earlier nodes"),
    ([Node("a", "act", (), {"fn": "relu"})], "a", "must be the 'input'"),
    ([Node("x", "input"), Node("a", "act", ("x",), {"fn": "softplus"})], "a", "activation 'softplus'"),
    ([Node("x", "input")], "y", "output: 'y'"),
])
def test_validate_names_the_problem(nodes, output, fragment):
    with pytest.raises(ValueError, match=fragment):
        Graph(nodes, output).validate()


@pytest.mark.parametrize("k, s, p, d, ceil", [(3, 2, 1, 1, False), (3, 2, 1, 1, True), (2, 2, 0, 1, True),
                                              (3, 3, 1, 2, True), (5, 1, 2, 1, False)])
@pytest.mark.parametrize("size", [7, 8, 13])
def test_pool_and_conv_shapes_match_torch(k, s, p, d, ceil, size):
    g = Graph([Node("x", "input"), Node("m", "max_pool", ("x",), {"nd": 2, "kernel_size": k, "stride": s,
                                                                   "padding": p, "dilation": d, "ceil_mode": ceil}),
               Node("c", "conv", ("x",), {"nd": 2, "stride": s, "padding": p, "dilation": d},
                    {"weight": np.zeros((4, 2, k, k))})], "m")
    shapes = infer_shapes(g, (1, 2, size, size))
    x = torch.zeros(1, 2, size, size)
    assert shapes["m"] == tuple(F.max_pool2d(x, k, s, p, d, ceil_mode=ceil).shape)
    assert shapes["c"] == tuple(F.conv2d(x, torch.zeros(4, 2, k, k), None, s, p, d).shape)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.pool = nn.MaxPool2d(2)
        self.drop = nn.Dropout()
        self.fc = nn.Linear(6 * 4 * 4, 3)

    def forward(self, x):
        y = self.pool(F.relu(self.bn(self.conv(x))))
        y = torch.cat([y, y], 1)[:, :6]
        return F.log_softmax(self.fc(self.drop(y.view(y.size(0), -1))), dim=1)


def test_from_torch_maps_modules_functions_and_methods():
    m = Small()
    net = dnn.from_torch(m, (2, 3, 8, 8))
    ops = [n.op for n in net.graph.nodes]
    assert ops == ["input", "conv", "batch_norm", "act", "max_pool", "cat", "getitem", "reshape", "dropout", "linear",
                   "log_softmax"]
    by = net.graph.by_name()
    np.testing.assert_array_equal(by["conv"].params["weight"], m.conv.weight.detach().double().numpy())
    np.testing.assert_array_equal(by["bn"].params["running_var"], m.bn.running_var.double().numpy())
    assert by["view"].attrs["shape"] == (96,) and by["cat"].attrs["dim"] == 1
    assert by["log_softmax"].attrs["dim"] == 1 and m.training  # the module's mode is restored


class Unsupported(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 3, 2)
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        y = self.conv(x) - x
        return self.up(y).mean(dim=(2, 3))


def test_from_torch_lists_every_unsupported_node():
    with pytest.raises(UnsupportedError) as info:
        dnn.from_torch(Unsupported(), (1, 3, 4, 4))
    names = [name for name, _ in info.value.nodes]
    assert names == ["sub", "up", "mean"]
    msg = str(info.value)
    assert "3 unsupported" in msg and "ConvTranspose2d" in msg and "operator.sub" in msg and "Tensor.mean" in msg


def test_from_torch_rejects_bad_arguments():
    with pytest.raises(TypeError, match="module: expected a torch.nn.Module"):
        dnn.from_torch(lambda x: x, (1, 3))
    with pytest.raises(ValueError, match="example_input_shape"):
        dnn.from_torch(Small(), (0, 3, 8, 8))


def test_from_torch_batch_moving_reshape_is_unsupported():
    class Fold(nn.Module):
        def forward(self, x):
            return x.reshape(-1, 4)
    with pytest.raises(ValueError, match="reshape"):
        dnn.from_torch(Fold(), (2, 8))


def test_from_torch_resnet_and_mobilenet_shapes():
    from bench import network_models as NM
    for name in NM.MODELS:
        m, _ = NM.build(name, shrink=16, prefer_torchvision=False)
        net = dnn.from_torch(m, (1, 3, 32, 32))
        shapes = infer_shapes(net.graph, (2, 3, 32, 32))
        assert shapes[net.graph.output] == (2, 1000)
        convs = sum(isinstance(x, nn.Conv2d) for x in m.modules())
        assert sum(n.op == "conv" for n in net.graph.nodes) == convs
