"""float16 conv with scale and residual on a CUDA GPU (marker ``gpu``): the scale is not folded into float16
weights (w * 1e4 overflows, w * 2e-4 goes subnormal); the conv with its affine map, then the residual and the
activation, on CuPy arrays (device route, channels-last too) and on a numpy batch run on the GPU (host_batch)."""

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


def _cl(a):
    return a.transpose(0, 2, 3, 1).copy().transpose(0, 3, 1, 2)


@pytest.mark.parametrize("where", ["cupy", "cupy-cl", "host"])
@pytest.mark.parametrize("sc", [1e4, 2e-4])
def test_float16_scale_with_a_residual(where, sc):
    blasx.configure(devices="cuda:0")
    rng = np.random.default_rng(17)
    big = sc > 1
    x = (rng.standard_normal((4, 16, 12, 12)) * (1e-3 if big else 1.0)).astype(np.float16)
    w = (rng.standard_normal((32, 16, 3, 3)) * (20 if big else 1e-2)).astype(np.float16)
    r = (rng.standard_normal((4, 32, 12, 12)) * (1.0 if big else 1e-6)).astype(np.float16)
    t = lambda a: torch.from_numpy(np.asarray(a, np.float64))  # noqa: E731
    ref = F.relu(F.conv2d(t(x), t(w), padding=1) * sc + t(r)).numpy()
    scale = np.full(32, sc)
    if where == "host":
        y = dnn.conv2d(x, w, padding=1, scale=scale, residual=r, activation="relu")
    else:
        lay = _cl if where == "cupy-cl" else (lambda a: a)
        y = dnn.conv2d(cupy.asarray(lay(x)), cupy.asarray(w), padding=1, scale=scale,
                       residual=cupy.asarray(lay(r)), activation="relu").get()
    y = np.asarray(y, np.float64)
    assert np.isfinite(y).all()
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 3e-3
