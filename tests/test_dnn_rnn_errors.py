"""blasx.dnn recurrent layers: bad input raises before any work, naming the parameter and the expected shape;
the caller's arrays are left as they were."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _cpu():
    blasx.configure(devices="cpu")
    yield
    blasx.shutdown()


def _lstm_params(layers=1, bidir=False, proj=0, bias=True):
    m = torch.nn.LSTM(3, 4, num_layers=layers, bidirectional=bidir, proj_size=proj, bias=bias).double()
    return {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}


def _raises(exc, *fragments, call):
    with pytest.raises(exc) as info:
        call()
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))


def test_missing_and_misshaped_params():
    x = np.ones((5, 2, 3))
    p = _lstm_params()
    del p["weight_hh_l0"]
    _raises(KeyError, "weight_hh_l0", "(16, 4)", call=lambda: dnn.lstm(x, None, p))
    p = _lstm_params()
    p["bias_hh_l0"] = p["bias_hh_l0"][:5]
    _raises(ValueError, "bias_hh_l0", "(16,)", "(5,)", call=lambda: dnn.lstm(x, None, p))
    p = _lstm_params()
    _raises(ValueError, "weight_ih_l0", "(16, 3)", call=lambda: dnn.lstm(np.ones((5, 2, 7)), None, p))
    _raises(KeyError, "weight_ih_l1", call=lambda: dnn.lstm(x, None, p, num_layers=2))
    _raises(KeyError, "unexpected", "_l1", "num_layers=1", call=lambda: dnn.lstm(x, None, _lstm_params(2)))
    _raises(ValueError, "weight_hh_l0", "(16, 2)", "proj_size", call=lambda: dnn.lstm(x, None, p, proj_size=2))
    _raises(ValueError, "weight_ih_l0", "3*hidden_size", call=lambda: dnn.gru(x, None, p))
    _raises(TypeError, "proj_size", call=lambda: dnn.gru(x, None, p, proj_size=2))
    _raises(TypeError, "params", call=lambda: dnn.lstm(x))
    for scalar in (np.array(1.0), np.float64(1.0), torch.tensor(1.0, dtype=torch.float64)):  # (was IndexError)
        _raises(ValueError, "weight_ih_l0", "(4*hidden_size, 3)", "got ()",
                call=lambda s=scalar: dnn.lstm(x, None, dict(p, weight_ih_l0=s)))
    _raises(ValueError, "proj_size: got 0", "weight_hr_l0", call=lambda: dnn.lstm(x, None, _lstm_params(proj=2)))


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # (np.matrix's own)
def test_matrix_parameters_run_as_plain_arrays():
    x = np.random.default_rng(0).standard_normal((5, 2, 3))
    p = _lstm_params()
    q = {k: np.asmatrix(v) if v.ndim == 2 else v for k, v in p.items()}
    np.testing.assert_array_equal(dnn.lstm(x, None, q)[0], dnn.lstm(x, None, p)[0])


def test_bad_states_and_lengths():
    x = np.ones((5, 2, 3))
    p = _lstm_params()
    h0, c0 = np.zeros((1, 2, 4)), np.zeros((1, 2, 4))
    _raises(ValueError, "hx[0]", "(1, 2, 4)", call=lambda: dnn.lstm(x, (np.zeros((1, 3, 4)), c0), p))
    _raises(ValueError, "hx[1]", "(1, 2, 4)", call=lambda: dnn.lstm(x, (h0, np.zeros((2, 2, 4))), p))
    _raises(TypeError, "hx", "pair", call=lambda: dnn.lstm(x, h0, p))
    _raises(ValueError, "lengths", "decreasing", call=lambda: dnn.lstm(x, None, p, lengths=[2, 5]))
    _raises(ValueError, "lengths", "1..5", call=lambda: dnn.lstm(x, None, p, lengths=[6, 2]))
    _raises(ValueError, "lengths", "1..5", call=lambda: dnn.lstm(x, None, p, lengths=[5, 0]))
    _raises(ValueError, "lengths", "2 integers", call=lambda: dnn.lstm(x, None, p, lengths=[5]))
    _raises(ValueError, "lengths", "decreasing", call=lambda: dnn.lstm(x, None, p, lengths=np.array([2, 5], np.uint8)))
    assert dnn.lstm(x, None, p, lengths=np.array([5, 2], np.uint8))[0].shape == (5, 2, 4)  # (unsigned: no wrap)
    _raises(ValueError, "nonlinearity", call=lambda: dnn.rnn(x, None, {}, nonlinearity="gelu"))


def test_dtype_mismatch_and_bad_x():
    p = _lstm_params()
    _raises(TypeError, "weight_ih_l0", "float64", "float32",
            call=lambda: dnn.lstm(np.ones((5, 2, 3), np.float32), None, p))
    _raises(TypeError, "hx[0]", "float32", call=lambda: dnn.lstm(
        np.ones((5, 2, 3)), (np.zeros((1, 2, 4), np.float32), np.zeros((1, 2, 4))), p))
    _raises(TypeError, "x", "int64", call=lambda: dnn.lstm(np.ones((5, 2, 3), np.int64), None, p))
    t = torch.zeros(1, 2, 4, dtype=torch.float64)  # a tensor where a numpy array like x is expected
    _raises(TypeError, "hx[0]", "numpy array like x", "Tensor",
            call=lambda: dnn.lstm(np.ones((5, 2, 3)), (t, np.zeros((1, 2, 4))), p))
    g = {k: v.detach().numpy().copy() for k, v in torch.nn.GRU(3, 4).double().state_dict().items()}
    _raises(TypeError, "hx", "numpy array like x", "Tensor", call=lambda: dnn.gru(np.ones((5, 2, 3)), t, g))
    _raises(ValueError, "x", "3 dimensions", call=lambda: dnn.lstm(np.ones((5, 2, 3, 1)), None, p))
    _raises(ValueError, "math", call=lambda: dnn.lstm(np.ones((5, 2, 3)), None, p, math="fast"))
    big = {"x": np.ones((5, 2, 3), ">f8"), "hx": (np.zeros((1, 2, 4), ">f8"), np.zeros((1, 2, 4)))}
    _raises(TypeError, "x:", "non-native byte order", "'>f8'", call=lambda: dnn.lstm(big["x"], None, p))
    _raises(TypeError, "hx[0]", "non-native byte order", call=lambda: dnn.lstm(np.ones((5, 2, 3)), big["hx"], p))


def test_backward_errors_and_nothing_written():
    x = np.random.default_rng(0).standard_normal((5, 2, 3))
    p = _lstm_params()
    h0, c0 = np.ones((1, 2, 4)), np.ones((1, 2, 4))
    before = [a.copy() for a in (x, h0, c0, *p.values())]
    y, _, saved = dnn.lstm(x, (h0, c0), p, training=True)
    for a, b in zip((x, h0, c0, *p.values()), before):
        assert np.array_equal(a, b)
    _raises(ValueError, "grad_y", "(5, 2, 4)", call=lambda: dnn.lstm_backward(saved, np.ones((5, 2, 5))))
    _raises(ValueError, "grad_c_n", "(1, 2, 4)", call=lambda: dnn.lstm_backward(saved, y, None, np.ones((2, 2, 4))))
    _raises(ValueError, "lstm", call=lambda: dnn.gru_backward(saved, y))
    _raises(TypeError, "saved", call=lambda: dnn.lstm_backward(None, y))
    _raises(TypeError, "grad_y", "numpy array like x", call=lambda: dnn.lstm_backward(saved, torch.from_numpy(y)))
    g = dnn.lstm_backward(saved, np.ones_like(y))  # the engine (and saved) still usable after the errors
    assert g["input"].shape == x.shape


def test_a_wrong_input_size_names_x_and_a_stray_projection_names_params():
    x = np.zeros((5, 2, 4))  # the model takes 3 features
    _raises(ValueError, "x: got 4 features (its last dim)", "input_size is 3", call=lambda: dnn.lstm(x, None,
                                                                                                    _lstm_params()))
    gru = {k: v.detach().numpy() for k, v in torch.nn.GRU(3, 4).double().state_dict().items()}
    gru["weight_hr_l0"] = np.zeros((2, 4))
    _raises(ValueError, "params: unexpected 'weight_hr_l0' for gru", call=lambda: dnn.gru(x[..., :3], None, gru))


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # (np.matrix's own)
def test_edge_values_follow_torch_and_need_no_warning():
    """relu RNN's backward selects (0 * inf was NaN, a NaN h's gradient was dropped); a gate pre-activation far
    below zero warned of exp's overflow (an error under -W error); an np.matrix x failed in training."""
    import warnings
    m = torch.nn.RNN(1, 2, nonlinearity="relu").double()
    with torch.no_grad():
        m.weight_ih_l0[:] = torch.tensor([[1.0], [-2.0]])
        for w in (m.weight_hh_l0, m.bias_ih_l0, m.bias_hh_l0):
            w.zero_()
    params = {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}
    for x, gy in ((np.array([[[1.0]]]), np.array([[[1.0, np.inf]]])), (np.array([[[np.nan]]]), np.ones((1, 1, 2)))):
        xt = torch.tensor(x, requires_grad=True)
        m(xt)[0].backward(torch.tensor(gy))
        _, _, saved = dnn.rnn(x, None, params, nonlinearity="relu", training=True)
        g = dnn.rnn_backward(saved, gy)
        np.testing.assert_array_equal(g["input"], xt.grad.numpy())
        np.testing.assert_array_equal(g["weight_ih_l0"], m.weight_ih_l0.grad.numpy())
        m.zero_grad()
    lstm = _lstm_params()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = dnn.lstm(np.full((2, 1, 3), -1e4), None, lstm)[0]
    assert np.isfinite(y).all()
    xm = np.asmatrix(np.random.default_rng(0).standard_normal((5, 3)))
    y, _, saved = dnn.lstm(xm, None, lstm, training=True)
    y_ref = dnn.lstm(np.asarray(xm), None, lstm)[0]
    np.testing.assert_array_equal(y, y_ref)
    assert dnn.lstm_backward(saved, np.ones_like(y_ref))["input"].shape == (5, 3)
