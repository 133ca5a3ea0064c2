"""torch's rules where blasx.dnn departed from them: a 0-d array of the same kind promotes no dimensioned one in
add; layer_norm and group_norm take a negative eps (NaN where var + eps < 0, as torch)."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn

torch = pytest.importorskip("torch")
F = torch.nn.functional


@pytest.mark.parametrize("a, b", [(np.float32, np.float64), (np.float16, np.float32), (np.float64, np.float32)])
def test_add_with_a_0d_operand_keeps_the_dimensioned_operands_type(a, b):
    blasx.configure(devices="cpu")
    x, s = np.arange(6, dtype=a).reshape(2, 3), np.array(0.5, dtype=b)
    want = (torch.from_numpy(x) + torch.from_numpy(s)).numpy()
    for got in (dnn.add(x, s), dnn.add(s, x)):
        assert got.dtype == want.dtype and np.allclose(got, want)
    both = dnn.add(np.array(1, dtype=a), s)  # two 0-d: promoted
    assert both.dtype == np.promote_types(a, b)


@pytest.mark.parametrize("devices", ["cpu", "sim:2"])
def test_layer_and_group_norm_take_a_negative_eps_as_torch(devices):
    blasx.configure(devices=devices, tile=16)
    x = np.random.default_rng(0).standard_normal((2, 6, 4)) * 3
    x[0, 0] = 0.01  # a row of tiny variance: var + eps < 0 there
    t = torch.from_numpy(x)
    for got, want in ((dnn.layer_norm(x, (4,), eps=-0.1), F.layer_norm(t, (4,), eps=-0.1)),
                      (dnn.group_norm(x, 2, eps=-0.1), F.group_norm(t, 2, eps=-0.1))):
        want = want.numpy()
        assert np.array_equal(np.isnan(got), np.isnan(want))
        assert np.allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("devices", ["cpu", "sim:2"])
def test_linear_takes_torchs_1d_weight_and_one_value_bias(devices):
    blasx.configure(devices=devices, tile=16)
    rng = np.random.default_rng(2)
    x, w1, w2 = rng.standard_normal((3, 4)), rng.standard_normal(4), rng.standard_normal((2, 4))
    t = torch.from_numpy
    assert np.allclose(dnn.linear(x, w1), F.linear(t(x), t(w1)).numpy())
    for b in (np.array(0.5), np.array([0.5])):
        got, want = dnn.linear(x, w2, b), F.linear(t(x), t(w2), t(b)).numpy()
        assert got.shape == want.shape and np.allclose(got, want)
    with pytest.raises(ValueError, match="bias"):
        dnn.linear(x, w2, np.ones(3))
