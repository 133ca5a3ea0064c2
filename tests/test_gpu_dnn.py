"""blasx.dnn on real CUDA GPUs (marker ``gpu``; skipped where CuPy finds none): the im2col fill (host x
staged by pitched copies, CuPy x gathered in place), the epilogue, half types with a residual, against
CPU torch in float64."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
NGPU = blasx.session._cuda_count()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="no CUDA GPU")]
F = torch.nn.functional


def _bf16():
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}


def rel(x, ref):
    x = np.asarray(cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else x, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def cl(x):
    return np.ascontiguousarray(np.moveaxis(x, 1, -1)).transpose(0, x.ndim - 1, *range(1, x.ndim - 1))


def wide(x):
    return torch.from_numpy(np.asarray(x, np.float64))


@pytest.fixture(autouse=True)
def _engine():
    blasx.configure(devices="cuda", tile=64, cache_bytes=256 << 20)
    yield
    blasx.shutdown()


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("where", ["host", "device"])
def test_forward(nd, layout, where):
    rng = np.random.default_rng(nd)
    size = (300, 37, 13)[:nd] if nd < 3 else (9, 11, 13)
    x = rng.standard_normal((5, 12, *size))
    w = rng.standard_normal((21, 4, *(3,) * nd))
    b = rng.standard_normal(21)
    xin = cl(x) if layout == "cl" else x
    w_, b_ = w, b
    if where == "device":
        xc = cupy.asarray(x)
        xin = xc if layout == "nchw" else cupy.ascontiguousarray(cupy.moveaxis(xc, 1, -1)).transpose(
            0, nd + 1, *range(1, nd + 1))
        w_, b_ = cupy.asarray(w), cupy.asarray(b)
    y = getattr(dnn, f"conv{nd}d")(xin, w_, b_, stride=2, padding=1, dilation=1, groups=3, activation="relu")
    ref = F.relu(getattr(F, f"conv{nd}d")(wide(x), wide(w), wide(b), stride=2, padding=1, groups=3)).numpy()
    assert type(y) is type(xin)
    assert rel(y, ref) < 1e-12


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dtypes_residual_epilogue(dtype):
    dt = _bf16() if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 16, 33, 29)).astype(dt)
    w = rng.standard_normal((24, 16, 3, 3)).astype(dt)
    r = rng.standard_normal((4, 24, 33, 29)).astype(dt)
    sc, sh = rng.uniform(0.5, 2, 24), rng.standard_normal(24)
    y = dnn.conv2d(x, w, padding="same", scale=sc, shift=sh, residual=r, activation="silu")
    conv = F.conv2d(wide(x), wide(w), padding="same")
    ref = F.silu(conv * torch.from_numpy(sc)[:, None, None] + torch.from_numpy(sh)[:, None, None] + wide(r))
    assert y.dtype == dt and rel(y, ref.numpy()) < TOL[dtype]


def test_transposed_and_backward():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 8, 40, 30))
    w = rng.standard_normal((12, 4, 3, 3))
    dy = rng.standard_normal((3, 12, 20, 15))
    for lay in (lambda a: a, cl):
        gi = dnn.conv2d_input(x.shape, w, lay(dy), stride=2, padding=1, groups=2)
        ref_i = torch.nn.grad.conv2d_input(x.shape, wide(w), wide(dy), 2, 1, 1, 2).numpy()
        assert rel(gi, ref_i) < 1e-12
        gw = dnn.conv2d_weight(lay(x), w.shape, lay(dy), stride=2, padding=1, groups=2)
        ref_w = torch.nn.grad.conv2d_weight(wide(x), w.shape, wide(dy), 2, 1, 1, 2).numpy()
        assert rel(gw, ref_w) < 1e-12
    wt = rng.standard_normal((8, 5, 4, 4))
    yt = dnn.conv_transpose2d(x, wt, stride=2, padding=1, output_padding=1)
    assert rel(yt, F.conv_transpose2d(wide(x), wide(wt), None, 2, 1, 1).numpy()) < 1e-12
