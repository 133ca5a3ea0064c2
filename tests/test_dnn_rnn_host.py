"""Host (numpy) recurrent calls on GPUs (rnn_host.py): the plan by exact value, and the route's plumbing on the
CPU stand-in for CuPy (what goes to the device, in which chunks, and what comes back)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from blasx.dnn import rnn_host, rnn_params

rnn = importlib.import_module("blasx.dnn.rnn")  # the module (blasx.dnn.rnn is also the function's name)


def _params(mode, n_in, H, layers=1, dirs=1, dtype=np.float32):
    rng = np.random.default_rng(0)
    g = rnn_params.GATES[mode]
    out = {}
    for layer in range(layers):
        for d in range(dirs):
            s = rnn_params.suffix(layer, d)
            k = n_in if layer == 0 else H * dirs
            out.update({"weight_ih" + s: rng.standard_normal((g * H, k)).astype(dtype),
                        "weight_hh" + s: rng.standard_normal((g * H, H)).astype(dtype),
                        "bias_ih" + s: rng.standard_normal(g * H).astype(dtype),
                        "bias_hh" + s: rng.standard_normal(g * H).astype(dtype)})
    return out


def test_batch_chunks_and_footprint():
    assert rnn_host.batch_chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert rnn_host.batch_chunks(9, 3) == [(0, 3), (3, 6), (6, 9)]
    assert rnn_host.batch_chunks(5, 99) == [(0, 5)]
    assert rnn_host.batch_chunks(3, 0) == [(0, 1), (1, 2), (2, 3)]
    pb = rnn._problem("lstm", np.zeros((7, 3, 5), np.float32), None, _params("lstm", 5, 8, 2), 2, False, False,
                      None, 0, None)
    one = rnn_host.footprint(pb.spec, 7, 1, 4, False)
    # per layer: 2 * 4H (gx, gates) + 3H (S, C, H-sized scratch) + 2 * out; plus x and y, float32
    assert one == 7 * (2 * (2 * 32 + 24 + 16) * 4 + (5 + 8) * 4)
    assert rnn_host.footprint(pb.spec, 7, 3, 4, False) == 3 * one
    assert rnn_host.footprint(pb.spec, 7, 1, 4, True) == one + 7 * 2 * (2 * 32 + 24 + 16) * 4


def test_applies(monkeypatch):
    x = np.zeros((4, 2, 3), np.float32)
    pb = rnn._problem("gru", x, None, _params("gru", 3, 4), 1, False, False, None, 0, None)
    monkeypatch.setattr(rnn_host, "gpus", lambda: (0,))
    assert rnn_host.applies(pb)
    monkeypatch.setattr(rnn_host, "gpus", lambda: ())
    assert not rnn_host.applies(pb)
    ml = pytest.importorskip("ml_dtypes")
    monkeypatch.setattr(rnn_host, "gpus", lambda: (0,))
    xb = x.astype(ml.bfloat16)
    pbb = rnn._problem("gru", xb, None, {k: v.astype(ml.bfloat16) for k, v in _params("gru", 3, 4).items()}, 1,
                       False, False, None, 0, None)
    assert not rnn_host.applies(pbb)  # CuPy has no bfloat16: the host path


def _device_call(calls, cupy, H, batch_first=False, dirs=1):
    """A stand-in for rnn._run's CuPy path: records its arguments, returns device outputs whose values say
    which call made them."""
    def again(xd, hd, pd, lens, bf):
        assert bf == batch_first
        calls.append((xd, hd, pd, lens))
        B = xd.shape[0 if batch_first else 1]
        y = cupy.empty(xd.shape[:2] + (dirs * H,), np.float32)
        h, c = cupy.empty((dirs, B, H), np.float32), cupy.empty((dirs, B, H), np.float32)
        for i, a in enumerate((y, h, c)):
            np.asarray(a)[...] = len(calls) * 10 + i
        return y, (h, c)
    return again


def test_a_call_that_fits_goes_to_the_device_once_and_comes_back_as_numpy(monkeypatch):
    from bench import fake_cupy
    monkeypatch.setattr(rnn_host, "gpus", lambda: (0,))
    T, B, n_in, H = 6, 5, 3, 4
    x = np.random.default_rng(1).standard_normal((T, B, n_in)).astype(np.float32)
    params = _params("lstm", n_in, H)
    h0 = np.ones((1, B, H), np.float32)
    pb = rnn._problem("lstm", x, (h0, h0), params, 1, False, False, None, 0, None)
    calls = []
    with fake_cupy.installed(record_calls=True) as fake:
        y, (h, c) = rnn_host.run(_device_call(calls, fake.cupy, H), pb, x, (h0, h0), None, False)
        uploads = [e for e in fake_cupy.LOG if e[0] == "upload"]
    (xd, hd, pd, lens), = calls
    assert type(y) is np.ndarray and y.shape == (T, B, H) and np.all(y == 10) and np.all(h == 11) and np.all(c == 12)
    assert xd.shape == x.shape and sorted(pd) == sorted(params) and len(hd) == 2 and lens is None
    assert any(e[1] == x.shape and e[3] == x.tobytes() for e in uploads)


@pytest.mark.parametrize("batch_first", [False, True])
def test_inference_past_the_budget_runs_in_batch_chunks(monkeypatch, batch_first):
    from bench import fake_cupy
    monkeypatch.setattr(rnn_host, "gpus", lambda: (0,))
    T, B, n_in, H = 6, 5, 3, 4
    x = np.random.default_rng(2).standard_normal((B, T, n_in) if batch_first else (T, B, n_in)).astype(np.float32)
    params = _params("lstm", n_in, H)
    h0 = np.arange(B * H, dtype=np.float32).reshape(1, B, H)
    lengths = [6, 5, 5, 3, 1]
    pb = rnn._problem("lstm", x, (h0, h0), params, 1, False, batch_first, lengths, 0, None)
    calls = []
    with fake_cupy.installed(record_calls=True) as fake:
        row = rnn_host.footprint(pb.spec, T, 1, 4, False)
        fake.state["free"] = 2 * row * rnn_host.BUDGET_FRACTION  # two rows a chunk
        again = _device_call(calls, fake.cupy, H, batch_first)
        y, (h, c) = rnn_host.run(again, pb, x, (h0, h0), lengths, False)
        uploads = [e for e in fake_cupy.LOG if e[0] == "upload"]
        assert rnn_host.run(again, pb, x, (h0, h0), lengths, True) is None  # training: the host path
    spans = rnn_host.batch_chunks(B, 2)
    assert [c[3] for c in calls[:len(spans)]] == [lengths[lo:hi] for lo, hi in spans]
    for i, (lo, hi) in enumerate(spans):
        xs = x[lo:hi] if batch_first else x[:, lo:hi]
        assert any(e[1] == xs.shape and e[3] == np.ascontiguousarray(xs).tobytes() for e in uploads)
        assert any(e[3] == np.ascontiguousarray(h0[:, lo:hi]).tobytes() for e in uploads)
        ys = y[lo:hi] if batch_first else y[:, lo:hi]
        assert np.all(ys == 10 * (i + 1)) and np.all(h[:, lo:hi] == 10 * (i + 1) + 1)
        assert np.all(c[:, lo:hi] == 10 * (i + 1) + 2)
    assert y.shape == x.shape[:2] + (H,) and h.shape == (1, B, H)


def test_host_saved_takes_host_gradients_only():
    saved = rnn_host.HostSaved(saved=None, device=0)
    with pytest.raises(TypeError, match="grad_y: expected a numpy array like x, got list"):
        rnn.lstm_backward(saved, [[1.0]])


def test_plan():
    pb = rnn._problem("lstm", np.zeros((10, 4, 5), np.float32), None, _params("lstm", 5, 8, 2), 2, False, False,
                      None, 0, None)
    unit = rnn_host.footprint(pb.spec, 1, 1, 4, False)
    assert rnn_host.plan(pb.spec, 10, 4, 4, False, 40 * unit) == ("whole", 0)
    assert rnn_host.plan(pb.spec, 10, 4, 4, False, 39 * unit) == ("rows", 3)
    assert rnn_host.plan(pb.spec, 10, 4, 4, False, 10 * unit) == ("rows", 1)
    assert rnn_host.plan(pb.spec, 10, 4, 4, False, 9 * unit) == ("steps", 2)
    assert rnn_host.plan(pb.spec, 10, 4, 4, False, 2 * unit) == ("steps", 1)
    assert rnn_host.plan(pb.spec, 10, 4, 4, True, 39 * unit) == ("host", 0)
    bi = rnn._problem("gru", np.zeros((10, 4, 5), np.float32), None, _params("gru", 5, 8, 1, 2), 1, True, False,
                      None, 0, None)
    ub = rnn_host.footprint(bi.spec, 1, 1, 4, False)
    assert rnn_host.plan(bi.spec, 10, 4, 4, False, 12 * ub) == ("rows", 1)
    assert rnn_host.plan(bi.spec, 10, 4, 4, False, 9 * ub) == ("host", 0)  # a reverse pass needs whole rows


def _host_call(mode, params, layers, bidir=False):
    """rnn._run on the host (the sims here), as rnn_host.run's ``call`` would run it on a GPU."""
    def call(xs, hs, ls, bf):
        return rnn._run(mode, xs, hs, params, layers, bidir, bf, ls, 0, False, None)
    return call


@pytest.mark.parametrize("mode", ["lstm", "gru"])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("lengths", [None, [9, 9, 7, 4, 1]])
@pytest.mark.parametrize("with_hx", [False, True])
def test_time_and_row_chunks_equal_the_whole_call(mode, batch_first, lengths, with_hx):
    """Chunks run through the real (host) path give the whole call's outputs and final states."""
    rng = np.random.default_rng(5)
    T, B, n_in, H, L = 9, 5, 3, 4, 2
    x = rng.standard_normal((B, T, n_in) if batch_first else (T, B, n_in))
    params = _params(mode, n_in, H, L, dtype=np.float64)
    h0 = rng.standard_normal((L, B, H)) if with_hx else None
    hx = (h0, rng.standard_normal((L, B, H))) if with_hx and mode == "lstm" else h0
    call = _host_call(mode, params, L)
    pb = rnn._problem(mode, x, hx, params, L, False, batch_first, lengths, 0, None)
    y, st = call(x, hx, lengths, batch_first)
    same = lambda a: a  # noqa: E731 - "to the host" on the host
    for got in [rnn_host.by_time(call, pb, x, hx, lengths, k, same) for k in (1, 2, 4)] + \
               [rnn_host.by_rows(call, pb, x, hx, lengths, rnn_host.batch_chunks(B, k), same) for k in (1, 2)]:
        gy, gst = got
        assert gy.shape == y.shape and np.allclose(gy, y, rtol=1e-12, atol=1e-12)
        for a, b in zip(gst if isinstance(gst, tuple) else (gst,), st if isinstance(st, tuple) else (st,)):
            assert a.shape == b.shape and np.allclose(a, b, rtol=1e-12, atol=1e-12)


def _on_device(cupy, params, device=0):
    """``params`` as stand-in CuPy arrays on ``device`` holding the same values."""
    out = {}
    with cupy.cuda.Device(device):
        for k, v in params.items():
            a = cupy.empty(v.shape, v.dtype)
            np.asarray(a).view(np.ndarray)[...] = v
            out[k] = a
    return out


@pytest.mark.parametrize("rows", [None, 2])
def test_resident_parameters_stay_on_the_device(monkeypatch, rows):
    """A numpy x with GPU-resident parameters (a model on its device): they are validated where they are and
    every device call (the whole batch, or ``rows`` a chunk past the budget) gets them as they are; only each
    call's x, h0 and c0 go up."""
    from bench import fake_cupy
    monkeypatch.setattr(rnn_host, "gpus", lambda: (0,))
    T, B, n_in, H = 6, 5, 3, 4
    x = np.random.default_rng(1).standard_normal((T, B, n_in)).astype(np.float32)
    h0 = np.ones((1, B, H), np.float32)
    calls = []
    with fake_cupy.installed(record_calls=True) as fake:
        pd = _on_device(fake.cupy, _params("lstm", n_in, H))
        pb = rnn._problem("lstm", x, (h0, h0), pd, 1, False, False, None, 0, None)
        assert all(rnn_params.arrays(pb.spec)[k] is v for k, v in pd.items())
        if rows:
            fake.state["free"] = rows * rnn_host.footprint(pb.spec, T, 1, 4, False) * rnn_host.BUDGET_FRACTION
        fake_cupy.LOG.clear()
        rnn_host.run(_device_call(calls, fake.cupy, H), pb, x, (h0, h0), None, False)
        moved = [e[1] for e in fake_cupy.LOG if e[0] in ("upload", "copy")]  # (a parameter copied or uploaded)
        read = [e[1] for e in fake_cupy.LOG if e[0] == "get"]
    spans = rnn_host.batch_chunks(B, rows) if rows else [(0, B)]
    assert len(calls) == len(spans) and all(c[2][k] is v for c in calls for k, v in pd.items())
    assert sorted(moved) == sorted(s for lo, hi in spans
                                     for s in ((T, hi - lo, n_in), (1, hi - lo, H), (1, hi - lo, H)))
    assert not any(v.shape == shape for v in pd.values() for shape in read)  # no parameter read back


def test_resident_parameters_on_another_gpu_are_copied_to_the_calls(monkeypatch):
    from bench import fake_cupy
    monkeypatch.setattr(rnn_host, "gpus", lambda: (0, 1))
    T, B, n_in, H = 4, 2, 3, 4
    x = np.zeros((T, B, n_in), np.float32)
    calls = []
    with fake_cupy.installed(record_calls=True) as fake:
        pd = _on_device(fake.cupy, _params("gru", n_in, H), device=1)
        pb = rnn._problem("gru", x, None, pd, 1, False, False, None, 0, None)
        rnn_host.run(_device_call(calls, fake.cupy, H), pb, x, None, None, False)
    (_, _, got, _), = calls
    assert sorted(got) == sorted(pd) and all(a.device.id == 0 for a in got.values())


@pytest.mark.parametrize("gpus", [(), (0,)])
def test_resident_parameters_are_read_back_where_the_call_runs_on_the_host(monkeypatch, gpus):
    """No GPU among the engine's devices, or a call the route leaves to the host path (training past the
    budget): the GPU-resident parameters are read back and the result is the host path's."""
    from bench import fake_cupy
    T, B, n_in, H = 5, 3, 4, 6
    rng = np.random.default_rng(5)
    x = rng.standard_normal((T, B, n_in)).astype(np.float32)
    params = _params("lstm", n_in, H, layers=2)
    monkeypatch.setattr(rnn_host, "gpus", lambda: ())
    want = rnn.lstm(x, None, params, num_layers=2, training=True)
    monkeypatch.setattr(rnn_host, "gpus", lambda: gpus)
    with fake_cupy.installed() as fake:
        fake.state["free"] = 0  # nothing fits the device: training stays on the host path
        got = rnn.lstm(x, None, _on_device(fake.cupy, params), num_layers=2, training=True)
    for a, b in ((got[0], want[0]), (got[1][0], want[1][0]), (got[1][1], want[1][1])):
        assert type(a) is np.ndarray
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert isinstance(got[2], rnn.Saved) and all(isinstance(c.w_ih, np.ndarray)
                                                 for row in got[2].problem.spec.cells for c in row)
