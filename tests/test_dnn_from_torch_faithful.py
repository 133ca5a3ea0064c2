"""from_torch converts only what it computes as torch does: an in-place update of a tensor whose memory another
value read later shares, modules with forward hooks and an index that moves the batch axis are refused (each was
accepted and computed otherwise); a linear layer on channels-last activations writes its planned output."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional


def _ref(m, x):
    with torch.no_grad():
        return m.double().eval()(torch.from_numpy(x.copy())).numpy()


class _ViewWritten(nn.Module):  # relu_ on a flatten view; the base is returned
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.c(x)
        F.relu(y.flatten(1), inplace=True)
        return y


class _BaseWritten(nn.Module):  # relu_ on the base; a view taken before is returned
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.c(x)
        v = y.flatten(1)
        F.relu(y, inplace=True)
        return v


class _DropoutThenWritten(nn.Module):  # eval Dropout returns its input; relu_ on that input after
    def __init__(self):
        super().__init__()
        self.c, self.d = nn.Conv2d(3, 4, 3, padding=1), nn.Dropout(0.5)

    def forward(self, x):
        y = self.c(x)
        z = self.d(y)
        F.relu(y, inplace=True)
        return z


class _DropoutReluChain(nn.Module):  # the usual chain: nothing else reads the shared tensor later
    def __init__(self):
        super().__init__()
        self.c, self.d, self.r = nn.Conv2d(3, 4, 3, padding=1), nn.Dropout(0.5), nn.ReLU(inplace=True)

    def forward(self, x):
        return self.r(self.d(self.c(x)))


@pytest.mark.parametrize("model", [_ViewWritten, _BaseWritten, _DropoutThenWritten])
def test_an_in_place_update_of_shared_memory_read_later_is_refused(model):
    with pytest.raises(dnn.UnsupportedError, match="in-place update of a tensor sharing memory"):
        dnn.from_torch(model().double().eval(), (1, 3, 5, 5))


def test_an_in_place_chain_with_no_later_reader_of_the_shared_tensor_converts():
    blasx.configure(devices="sim:2", tile=16)
    m = _DropoutReluChain().double().eval()
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 5))
    y = dnn.from_torch(m, (1, 3, 5, 5)).compile()(x)
    assert np.allclose(y, _ref(m, x), rtol=1e-12, atol=1e-12)


def test_modules_with_forward_hooks_are_refused():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).double().eval()
    m[0].register_forward_hook(lambda mod, inp, out: out * 2)
    with pytest.raises(dnn.UnsupportedError, match="forward hooks"):
        dnn.from_torch(m, (1, 3, 5, 5))
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).double().eval()
    m[1].register_forward_pre_hook(lambda mod, inp: (inp[0] - 1,))
    with pytest.raises(dnn.UnsupportedError, match="forward hooks"):
        dnn.from_torch(m, (1, 3, 5, 5))


class _NewAxisFirst(nn.Module):
    def forward(self, x):
        return F.relu(x)[None]


class _NewAxisAfter(nn.Module):
    def forward(self, x):
        return F.relu(x)[:, None]


def test_an_index_inserting_an_axis_before_the_batch_is_refused_after_it_taken():
    with pytest.raises(dnn.UnsupportedError, match="inserting an axis before the batch axis"):
        dnn.from_torch(_NewAxisFirst().double(), (1, 3, 4))
    blasx.configure(devices="sim:2", tile=16)
    x = np.random.default_rng(1).standard_normal((3, 3, 4))
    assert np.allclose(dnn.from_torch(_NewAxisAfter().double(), (1, 3, 4))(x), np.maximum(x, 0)[:, None])


@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("devices", ["sim:2", "cpu"])
def test_a_linear_layer_on_channels_last_activations_writes_its_output(devices, layout):
    """Linear over the last dim of a 4-D activation: the planned channels-last output reshaped to rows is a copy
    (it was returned unwritten)."""
    blasx.configure(devices=devices, tile=16)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Linear(6, 5)).double().eval()
    x = np.random.default_rng(0).standard_normal((3, 3, 6, 6))
    y = dnn.from_torch(m, (1, 3, 6, 6)).compile(layout=layout)(x)
    assert np.allclose(y, _ref(m, x), rtol=1e-12, atol=1e-12)
