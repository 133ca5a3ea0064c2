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
from train_ref import ResNetish, check_float16  # noqa: E402 - after torch is known to be there
from train_ref import err as _err  # noqa: E402

TOL = {np.float64: 1e-10, np.float32: 1e-3}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_resnet_style_on_cupy(dtype):
    blasx.configure(devices="cuda")
    torch.manual_seed(0)
    m = ResNetish(16, 10).double().train()
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
    blasx.configure(devices="cuda")
    torch.manual_seed(0)
    m = ResNetish(16, 10).double().train()
    check_float16(dnn.from_torch(m, (2, 3, 16, 16)), m, np.random.default_rng(0).standard_normal((8, 3, 16, 16)),
                  cupy.asarray)
