"""The implicit weight-gradient kernel (igemm_weight.py) on a Hopper GPU (marker ``gpu``): forced and chosen by
the heuristic, both layouts (NCHW operands convolved channels-last), with and without pixel splits, replays on
fresh values, operands off a 16-byte boundary, against CPU torch in float64."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn
from dnn_ref import rel, wide

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
NGPU = blasx.session._cuda_count()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="no CUDA GPU")]


def _capable():
    from blasx.dnn import igemm
    return igemm.current_capable()


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _device(x, layout):
    xc = cupy.asarray(x)
    if layout == "nchw":
        return xc
    return cupy.ascontiguousarray(cupy.moveaxis(xc, 1, -1)).transpose(0, x.ndim - 1, *range(1, x.ndim - 1))


CASES = [  # (n, c, k, size, kernel, stride, padding, dilation)
    (3, 64, 64, (13, 11), 3, 1, 1, 1),
    (2, 128, 128, (9, 10), 3, 2, (0, 2), (2, 1)),
    (2, 64, 192, (7, 9), 3, 1, (1, 0), 1),  # K of one warpgroup's rows past a tile
    (2, 64, 64, (37,), 5, 3, 2, 2),
    (2, 64, 128, (4, 5, 6), 3, (1, 2, 1), 1, 1),
    (1, 192, 64, (6, 6), 2, 1, 0, 1),  # columns past a 256-column tile
]


@pytest.mark.skipif(not _capable(), reason="the implicit kernels need compute capability 9.0")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["cl", "nchw"])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_implicit_weight_form_vs_torch(monkeypatch, dtype, layout, chunked, case):
    """Forced (the heuristic keeps small maps on im2col); twice on fresh values (the second a replay); an
    operand one element off a 16-byte boundary; the kernel's launches counted. ``chunked``: scratch too small for
    a split's partials (dW written by the kernel) or NCHW operands' channels-last copies."""
    from blasx.dnn import conv_direct, igemm_weight
    n, c, k, size, kern, stride, pad, dil = case
    nd, dt = len(size), _dtype(dtype)
    if layout == "nchw" and nd != 2:
        pytest.skip("NCHW weight gradients convert 2-D windows only")
    monkeypatch.setattr(conv_direct, "ROUTE", "direct")
    monkeypatch.setattr(conv_direct, "FORM", "implicit")
    if chunked:
        monkeypatch.setattr(conv_direct, "BUDGET_FRACTION", 2**60)
    calls = []
    launch = igemm_weight.Launcher.__call__
    monkeypatch.setattr(igemm_weight.Launcher, "__call__", lambda self, *a: (calls.append(self.launch.config),
                                                                             launch(self, *a))[1])
    tol = {"float16": 5e-3, "bfloat16": 3e-2}[dtype]
    rng = np.random.default_rng(c + k + nd)
    fn = getattr(dnn, f"conv{nd}d_weight")
    ref = getattr(torch.nn.grad, f"conv{nd}d_weight")
    wshape = (k, c, *(kern,) * nd)
    y_shape = getattr(torch.nn.functional, f"conv{nd}d")(torch.zeros(n, c, *size), torch.zeros(wshape), None,
                                                         stride, pad, dil).shape
    for i in range(2):
        x = rng.standard_normal((n, c, *size)).astype(dt)
        dy = rng.standard_normal(tuple(y_shape)).astype(dt)
        want = ref(wide(x), wshape, wide(dy), stride, pad, dil).numpy()
        gw = fn(_device(x, layout), wshape, _device(dy, layout), stride, pad, dil)
        assert gw.dtype == dt and gw.shape == wshape and rel(gw, want) < tol, i
    if layout == "nchw" and chunked:  # no room to convert the operands: the im2col form on NCHW
        assert calls == []
    else:
        assert len(calls) == 2 and (not chunked or all(cfg.split == 1 for cfg in calls))
    if layout == "cl":  # x one element past a 16-byte boundary: copied to aligned memory first
        xd = _device(x, "cl")
        xs = cupy.empty(xd.size + 1, dtype=xd.dtype)[1:]
        xs[...] = xd.transpose(0, *range(2, nd + 2), 1).ravel()
        xv = xs.reshape(xd.shape[0], *xd.shape[2:], xd.shape[1]).transpose(0, nd + 1, *range(1, nd + 1))
        assert xv.data.ptr % 16 and rel(fn(xv, wshape, _device(dy, "cl"), stride, pad, dil), want) < tol


@pytest.mark.skipif(not _capable(), reason="the implicit kernels need compute capability 9.0")
@pytest.mark.parametrize("layout", ["cl", "nchw"])
def test_heuristic_takes_the_kernel_on_large_maps(monkeypatch, layout):
    """A ResNet-50 layer1 3x3 at batch 8 (25,088 output pixels): the heuristic's choice, with splits."""
    from blasx.dnn import conv_direct, igemm_weight
    monkeypatch.setattr(conv_direct, "ROUTE", "direct")
    calls = []
    launch = igemm_weight.Launcher.__call__
    monkeypatch.setattr(igemm_weight.Launcher, "__call__", lambda self, *a: (calls.append(self.launch.config),
                                                                             launch(self, *a))[1])
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 64, 56, 56)).astype(np.float16)
    dy = rng.standard_normal((8, 64, 56, 56)).astype(np.float16)
    gw = dnn.conv2d_weight(_device(x, layout), (64, 64, 3, 3), _device(dy, layout), 1, 1)
    want = torch.nn.grad.conv2d_weight(wide(x), (64, 64, 3, 3), wide(dy), 1, 1).numpy()
    assert rel(gw, want) < 5e-3 and len(calls) == 1 and calls[0].split > 1
