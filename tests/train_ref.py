"""What the training tests on the host (test_dnn_train.py) and on GPUs (test_gpu_dnn_train.py) share: the
ResNet-style model, the error measure, and the check of float16 training against torch's own float16."""

from __future__ import annotations

import copy

import numpy as np
import torch

nn, F = torch.nn, torch.nn.functional


def err(a, ref) -> float:
    """Relative-norm error (numpy or CuPy ``a``); against a reference of (about) zero, absolute (a bias before
    a batch norm)."""
    a, ref = np.asarray(a.get() if hasattr(a, "get") else a, np.float64), ref.detach().double().numpy()
    assert a.shape == ref.shape, (a.shape, ref.shape)
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 0.1))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c, momentum=None)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(y)) + x)


class ResNetish(nn.Module):
    def __init__(self, width: int = 8, classes: int = 5):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width)
        self.pool = nn.MaxPool2d(2)
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        x = self.pool(F.relu(self.bn(self.stem(x))))
        return self.fc(torch.flatten(self.gap(self.blocks(x)), 1))


def check_float16(net, m, x: np.ndarray, to_device=lambda a: a) -> None:
    """forward_train + backward of ``net`` (from_torch of the float64 module ``m``) on ``x`` in float16 (put
    where ``to_device`` puts it): every gradient within 1.5x of the error CPU torch's own float16 run has, both
    against float64 torch."""
    m16 = copy.deepcopy(m).half()
    y = net.forward_train(to_device(x.astype(np.float16)))
    g = np.random.default_rng(1).standard_normal(y.shape)
    gx = net.backward(to_device(g.astype(np.float16)))
    xt, xh = torch.from_numpy(x).requires_grad_(), torch.from_numpy(x).half().requires_grad_()
    m(xt).backward(torch.from_numpy(g))
    m16(xh).backward(torch.from_numpy(g).half())
    assert y.dtype == gx.dtype == np.float16
    assert err(gx, xt.grad) <= 1.5 * err(xh.grad.numpy(), xt.grad) + 1e-3, "input gradient"
    p16 = dict(m16.named_parameters())
    for k, p in m.named_parameters():
        assert err(net.grads[k], p.grad) <= 1.5 * err(p16[k].grad.numpy(), p.grad) + 1e-3, k
