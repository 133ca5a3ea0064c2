"""blasx.dnn.Network training on a CUDA GPU (marker ``gpu``; skipped where CuPy finds none): the ResNet-style
case of test_dnn_train.py on CuPy arrays (output, input gradient, every parameter gradient, running statistics)
against CPU torch autograd in float64, and an SGD step through set_parameters with CuPy arrays."""

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
TOL = {np.float64: 1e-10, np.float32: 1e-3}


def _err(a, ref) -> float:
    a, ref = np.asarray(a.get() if hasattr(a, "get") else a, np.float64), ref.detach().double().numpy()
    assert a.shape == ref.shape, (a.shape, ref.shape)
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 0.1))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(y)) + x)


class ResNetish(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.blocks = nn.Sequential(Block(16), Block(16))
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.bn(self.stem(x))))
        return self.fc(torch.flatten(self.gap(self.blocks(x)), 1))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_resnet_style_on_cupy(dtype):
    blasx.configure(devices="cuda")
    torch.manual_seed(0)
    m = ResNetish().double().train()
    net = dnn.from_torch(m, (2, 3, 16, 16))
    x = np.random.default_rng(0).standard_normal((8, 3, 16, 16))
    g = np.random.default_rng(1).standard_normal((8, 10))
    dev = NGPU - 1
    with cupy.cuda.Device(dev):
        xd, gd = cupy.asarray(x.astype(dtype)), cupy.asarray(g.astype(dtype))
    y = net.forward_train(xd, math="ieee")
    gx = net.backward(gd)
    assert isinstance(y, cupy.ndarray) and y.device.id == dev and gx.device.id == dev and gx.dtype == dtype
    xt = torch.from_numpy(x).requires_grad_()
    yt = m(xt)
    yt.backward(torch.from_numpy(g))
    assert _err(y, yt) < TOL[dtype]
    assert _err(gx, xt.grad) < TOL[dtype]
    for k, p in m.named_parameters():
        assert isinstance(net.grads[k], cupy.ndarray) and net.grads[k].device.id == dev
        assert _err(net.grads[k], p.grad) < TOL[dtype], k
    for k, v in m.named_buffers():
        if "running" in k:
            assert _err(net.buffers()[k], v) < TOL[dtype], k
    with cupy.cuda.Device(dev):  # an SGD step with the gradients where they are
        net.set_parameters({k: cupy.asarray(p) - 0.1 * net.grads[k].astype(np.float64)
                            for k, p in net.parameters().items()})
    for k, p in m.named_parameters():
        want = p.detach().numpy() - 0.1 * p.grad.numpy()
        assert np.linalg.norm(net.parameters()[k] - want) <= TOL[dtype] * max(np.linalg.norm(want), 0.1), k



def test_resnet_style_float16_on_cupy_as_accurate_as_torchs_float16():
    """float16 training on a GPU: every gradient within 1.5x of the error CPU torch's own float16 run has
    (both against float64 torch), as on the host (test_dnn_train.py)."""
    import copy
    blasx.configure(devices="cuda")
    torch.manual_seed(0)
    m = ResNetish().double().train()
    net = dnn.from_torch(m, (2, 3, 16, 16))
    m16 = copy.deepcopy(m).half()
    x = np.random.default_rng(0).standard_normal((8, 3, 16, 16))
    g = np.random.default_rng(1).standard_normal((8, 10))
    y = net.forward_train(cupy.asarray(x.astype(np.float16)))
    gx = net.backward(cupy.asarray(g.astype(np.float16)))
    xt, xh = torch.from_numpy(x).requires_grad_(), torch.from_numpy(x).half().requires_grad_()
    m(xt).backward(torch.from_numpy(g))
    m16(xh).backward(torch.from_numpy(g).half())
    assert y.dtype == gx.dtype == np.float16
    assert _err(gx, xt.grad) <= 1.5 * _err(xh.grad.numpy(), xt.grad) + 1e-3, "input gradient"
    p16 = dict(m16.named_parameters())
    for k, p in m.named_parameters():
        assert _err(net.grads[k], p.grad) <= 1.5 * _err(p16[k].grad.numpy(), p.grad) + 1e-3, k
