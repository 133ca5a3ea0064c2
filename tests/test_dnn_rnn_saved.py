"""A training forward's saved state keeps the values its forward ran with: the caller writing into x or into the
parameters before the backward changes no gradient (numpy / CuPy arrays: the state holds copies); a torch tensor
parameter written in place (its version counter moved) makes the backward raise, as torch's autograd does."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _engine(request):
    blasx.configure(devices=getattr(request, "param", "cpu"))
    yield
    blasx.shutdown()


def _model(mode, layers, bidir, proj=0):
    torch.manual_seed(3)
    if mode == "lstm":
        return torch.nn.LSTM(5, 6, num_layers=layers, bidirectional=bidir, proj_size=proj).double()
    return torch.nn.GRU(5, 6, num_layers=layers, bidirectional=bidir).double()


def _call(mode, x, params, layers, bidir, proj=0):
    kw = dict(num_layers=layers, bidirectional=bidir, training=True)
    if mode == "lstm":
        return dnn.lstm(x, None, params, proj_size=proj, **kw)
    return dnn.gru(x, None, params, **kw)


def _backward(mode, saved, gy):
    return (dnn.lstm_backward if mode == "lstm" else dnn.gru_backward)(saved, gy)


@pytest.mark.parametrize("_engine", ["cpu", "sim:2"], indirect=True)
@pytest.mark.parametrize("mode,layers,bidir,proj", [("lstm", 1, False, 0), ("lstm", 3, False, 0),
                                                    ("gru", 2, True, 0), ("lstm", 2, False, 3)])
def test_writes_into_x_and_numpy_params_after_the_forward_change_no_gradient(_engine, mode, layers, bidir, proj):
    m = _model(mode, layers, bidir, proj) if mode == "lstm" else _model(mode, layers, bidir)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 4, 5))
    params = {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}
    y, _, saved = _call(mode, x, params, layers, bidir, proj)
    gy = rng.standard_normal(y.shape)
    ref = _backward(mode, _call(mode, x, params, layers, bidir, proj)[2], gy)
    x[:] = 0.0  # the caller reuses its buffers before the backward
    for v in params.values():
        v *= -3.0
    got = _backward(mode, saved, gy)
    assert got.keys() == ref.keys()
    for k in ref:  # (the sims' engine may sum a GEMM's pieces in another order: last bits)
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-12, atol=1e-14, err_msg=k)


def test_a_torch_parameter_written_in_place_after_the_forward_fails_the_backward():
    m = _model("lstm", 2, False)
    x = np.random.default_rng(1).standard_normal((6, 3, 5))
    p = {k: v.detach() for k, v in m.state_dict().items()}  # views sharing the module's version counters
    y, _, saved = dnn.lstm(x, None, p, num_layers=2, training=True)
    gy = np.ones_like(y)
    dnn.lstm_backward(saved, gy)  # nothing written yet: fine, and again
    with torch.no_grad():
        m.weight_hh_l1.mul_(0.5)  # an optimizer step before the backward
    with pytest.raises(RuntimeError, match=r"params\['weight_hh_l1'\].*in place.*version"):
        dnn.lstm_backward(saved, gy)
    # the engine stays usable, and a new forward takes the new values
    y2, _, saved2 = dnn.lstm(x, None, p, num_layers=2, training=True)
    g = dnn.lstm_backward(saved2, gy)
    ty, _ = m(torch.from_numpy(x))
    ty.backward(torch.from_numpy(gy))
    np.testing.assert_allclose(y2, ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g["weight_hh_l1"], m.weight_hh_l1.grad.numpy(), rtol=1e-8, atol=1e-10)


def test_biases_written_after_the_forward_need_no_check():
    """The backward reads no bias: a bias updated in place before it changes nothing and raises nothing."""
    m = _model("gru", 1, False)
    x = np.random.default_rng(2).standard_normal((4, 2, 5))
    p = {k: v.detach() for k, v in m.state_dict().items()}
    y, _, saved = dnn.gru(x, None, p, training=True)
    gy = np.ones_like(y)
    ref = dnn.gru_backward(dnn.gru(x, None, p, training=True)[2], gy)
    with torch.no_grad():
        m.bias_hh_l0.add_(1.0)
    got = dnn.gru_backward(saved, gy)
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


@pytest.mark.parametrize("_engine", ["cpu", "sim:2"], indirect=True)
@pytest.mark.parametrize("mode,layers,bidir,batch_first", [("lstm", 1, False, False), ("gru", 2, True, True),
                                                           ("lstm", 2, False, True)])
def test_nan_in_x_past_a_sequences_end_never_reaches_a_gradient(_engine, mode, layers, bidir, batch_first):
    """Padding (t >= lengths[b]) is never read by torch's packed sequences: a NaN or inf there (np.empty's
    garbage, NaN-padded data) must not make the input weights' gradient NaN; x itself is left as it was."""
    m = _model(mode, layers, bidir)
    params = {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}
    rng = np.random.default_rng(1)
    T, B, lengths = 6, 3, np.array([6, 3, 1], dtype=np.uint8)  # (unsigned lengths are valid too)
    x = rng.standard_normal((T, B, 5))
    for b, n in enumerate(lengths):
        x[n:, b] = np.nan if b % 2 else np.inf
    xin = np.ascontiguousarray(x.transpose(1, 0, 2)) if batch_first else x
    kept = xin.copy()
    kw = dict(num_layers=layers, bidirectional=bidir, batch_first=batch_first, lengths=lengths, training=True)
    y, _, saved = (dnn.lstm if mode == "lstm" else dnn.gru)(xin, None, params, **kw)
    gy = rng.standard_normal(y.shape)
    got = _backward(mode, saved, gy)
    np.testing.assert_array_equal(xin, kept)
    xt = torch.tensor(np.nan_to_num(x, nan=0.0, posinf=0.0), requires_grad=True)
    packed = torch.nn.utils.rnn.pack_padded_sequence(xt, torch.tensor(lengths.astype(np.int64)))
    ty = torch.nn.utils.rnn.pad_packed_sequence(m(packed)[0], total_length=T)[0]
    ty.backward(torch.from_numpy(gy.transpose(1, 0, 2) if batch_first else gy))
    for name, p in m.named_parameters():
        np.testing.assert_allclose(got[name], p.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)
