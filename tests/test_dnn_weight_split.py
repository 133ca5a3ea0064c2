"""Split-k in convolution backward-weights (runtime/plans/conv.py): the plan by exact value, and the
engine's result against torch with the split engaged, bit-identical from run to run."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn
from blasx.dnn import conv as conv_module
from blasx.runtime.plans import plan_conv_weight
from blasx.runtime.tiling import TileRef

torch = pytest.importorskip("torch")


def test_plan_split_partials_then_ordered_adds():
    # channels-last, N*P = 18 pixels in tiles of 4 (5 k-steps), dW 6 x 4 (CRS x Kg): one C tile row pair
    tasks = plan_conv_weight(2, 9, 4, 6, 1, 4, True, col0=0, dy0=1, dw0=2, split=2, p0=4)
    assert len(tasks) == 6  # 2 C tiles x (2 partials + 1 add)
    p0, p1, add = tasks[:3]
    assert p0.c == TileRef(4, 0, 0, 0, 0, 4, 4) and p1.c == TileRef(4, 0, 1, 0, 4, 4, 4)
    assert [s.k for s in p0.steps] == [4, 4] and [s.k for s in p1.steps] == [4, 4, 2]
    assert p0.keep_c and p1.keep_c and not p0.rotatable
    assert add.c == TileRef(2, 0, 0, 0, 0, 4, 4) and add.deps == (0, 1)
    assert [s.kernel for s in add.steps] == ["add", "add"] and [s.a for s in add.steps] == [p0.c, p1.c]
    with pytest.raises(ValueError, match="split"):
        plan_conv_weight(2, 9, 4, 6, 1, 4, True, col0=0, dy0=1, dw0=2, split=6, p0=4)


@pytest.mark.parametrize("devices", ["sim:1", "sim:2", "sim:3"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_weight_grad_with_split_matches_torch(devices, layout, monkeypatch):
    splits = []
    orig = conv_module.plan_conv_weight
    monkeypatch.setattr(conv_module, "plan_conv_weight", lambda *a, **k: splits.append(k["split"]) or orig(*a, **k))
    blasx.configure(devices=devices, tile=16)
    try:
        rng = np.random.default_rng(1)
        x = rng.standard_normal((6, 8, 12, 12)).astype(np.float32)
        dy = rng.standard_normal((6, 10, 12, 12)).astype(np.float32)
        if layout == "cl":
            x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
            dy = np.ascontiguousarray(dy.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
        dw = dnn.conv2d_weight(x, (10, 4, 3, 3), dy, padding=1, groups=2)
        again = dnn.conv2d_weight(x, (10, 4, 3, 3), dy, padding=1, groups=2)
    finally:
        blasx.configure()
    assert max(splits) > 1
    ref = torch.nn.grad.conv2d_weight(torch.from_numpy(np.ascontiguousarray(x)).double(), (10, 4, 3, 3),
                                      torch.from_numpy(np.ascontiguousarray(dy)).double(), padding=1, groups=2).numpy()
    assert np.linalg.norm(dw - ref) / np.linalg.norm(ref) < 1e-5
    assert np.array_equal(dw, again)
