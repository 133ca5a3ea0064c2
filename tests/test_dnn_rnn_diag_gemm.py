"""The diagonal loop's per-step GEMM issue (rnn_layer.CudaOps.gemm_layers) on the CPU stand-in for CuPy, and the
hand-off between diagonal groups (rnn_diag_groups.Progress)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from blasx.dnn import rnn_diag, rnn_diag_groups, rnn_layer


def _issue(dtype, math, n, workspace, capture=False):
    """gemm_layers' recorded calls: ("stream", ptr), ("workspace", offset or None, bytes), gemm_ex / gemm_batched."""
    from bench import fake_cupy
    from blasx.runtime.devices import cublas_ctypes as cc
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        cc.set_stream = lambda handle, ptr: fake_cupy.record("stream", ptr)
        cc.set_workspace = lambda handle, ptr, size: fake_cupy.record("workspace", ptr, size)
        ops = rnn_layer.CudaOps(math)
        ops.workspace = cupy.empty(n * 4096, dtype=np.uint8) if workspace else None
        B, H = 3, 8
        D = cupy.empty((7, B, n + 1, H), dtype=dtype)
        w = cupy.empty((n, 4 * H, 2 * H), dtype=dtype)
        out = cupy.empty((n, B, 4 * H), dtype=np.float32)
        main = cupy.cuda.Stream(non_blocking=True)
        with main:
            if capture:
                main.begin_capture()
            fake_cupy.LOG.clear()
            d = D[2]  # rnn_diag.window(d, n), made as the stand-in's own array
            win = cupy.ndarray((n, B, 2 * H), dtype, memptr=d.data, strides=(H * d.itemsize, d.strides[0], d.itemsize))
            ops.gemm_layers(win, w, out, True, 0)
            log = list(fake_cupy.LOG)
            if capture:
                log = main.end_capture().entries
        base = None if ops.workspace is None else ops.workspace.data.ptr
        return log, main.ptr, base


def test_float32_ieee_forks_one_gemm_per_layer_each_on_its_side_stream_and_workspace_piece():
    n = 3
    log, main, base = _issue(np.float32, "ieee", n, workspace=True)
    gemms = [e for e in log if e[0] == "gemm_ex"]
    assert gemms == [("gemm_ex", 32, 3, 16)] * n  # (n, m, k) of out^T = W . a^T per layer
    streams = [e[1] for e in log if e[0] == "stream"]
    assert len(set(streams)) == n and main not in streams
    pieces = [e[1:] for e in log if e[0] == "workspace"]
    assert pieces == [(base + i * 4096, 4096) for i in range(n)]
    # forked after the main stream's work, joined back before anything after it
    assert log[0] == ("event_record", main) and log[-n:] == [("wait_event", main)] * n


def test_without_a_workspace_each_branch_gets_its_own_default_sized_piece():
    from blasx.runtime.devices.cublas_ctypes import workspace_bytes
    log, _, _ = _issue(np.float32, "ieee", 2, workspace=False)
    sizes = [e[2] for e in log if e[0] == "workspace"]
    assert sizes == [workspace_bytes(9)] * 2


def test_float64_keeps_the_batched_call():
    log, _, _ = _issue(np.float64, "ieee", 2, workspace=True)
    assert [e[0] for e in log if e[0].startswith("gemm")] == ["gemm_batched"]


def test_inside_a_callers_capture_without_a_workspace_nothing_is_allocated():
    log, _, _ = _issue(np.float32, "ieee", 2, workspace=False, capture=True)
    assert [e[0] for e in log if e[0].startswith("gemm")] == ["gemm_batched"]


def test_a_waiter_gets_the_first_event_that_satisfies_it():
    """The publishing thread runs chunks ahead of its device: a waiter must order itself after the hand-off it
    needs, not after the latest one."""
    p = rnn_diag_groups.Progress(0)
    for v, ev in ((7, "e7"), (14, "e14"), (21, "e21")):
        p.publish(v, ev)
    assert p.wait(lambda v: v >= 10) == "e14"
    assert p.wait(lambda v: v >= 0) is None  # the start needs no event
    back = rnn_diag_groups.Progress(30)
    for v, ev in ((20, "e20"), (10, "e10")):
        back.publish(v, ev)
    assert back.wait(lambda v: v <= 25) == "e20"


def test_a_waiter_blocks_until_published_and_a_failure_releases_it():
    p = rnn_diag_groups.Progress(0)
    got = []
    t = threading.Thread(target=lambda: got.append(p.wait(lambda v: v >= 5)))
    t.start()
    p.publish(3, "e3")
    p.publish(6, "e6")
    t.join(5)
    assert got == ["e6"]
    q = rnn_diag_groups.Progress(0)
    errs = []

    def wait():
        try:
            q.wait(lambda v: v >= 5)
        except rnn_diag_groups.Aborted as exc:
            errs.append(exc)
    t = threading.Thread(target=wait)
    t.start()
    q.fail()
    t.join(5)
    assert len(errs) == 1


def test_layer0_projection_runs_a_part_ahead_on_its_side_stream():
    """_Layer0: before loop part p, the rows of parts p and p+1 are issued (once each) on the side stream and the
    loop's stream waits for part p's event; the pieces cover the T steps in order (parts past T add none)."""
    from types import SimpleNamespace
    from bench import fake_cupy
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        T, B, n_in, GH = 5, 2, 3, 8
        cell = SimpleNamespace(w_ih=cupy.empty((GH, 2 * n_in), dtype=np.float32)[:, ::2])  # a caller's strided view
        pb = SimpleNamespace(xp=cupy, x=cupy.empty((T, B, n_in), dtype=np.float32), math="ieee",
                             spec=SimpleNamespace(cells=((cell,),)))
        P0 = cupy.empty((T, B, GH), dtype=np.float32)
        parts = rnn_diag.chunks(T + 1, 2)  # a group of 2 layers: S = T + 1 diagonal steps
        loop = cupy.cuda.Stream(non_blocking=True)
        with loop:
            l0 = rnn_diag._Layer0(pb, np.float32, P0, parts)
            fake_cupy.LOG.clear()
            l0.ready(0)
            first = list(fake_cupy.LOG)
            for p in range(1, len(parts)):
                l0.ready(p)
            fake_cupy.LOG.clear()
            l0.join()  # at the end of the group's loop, error or not: the entry's buffer is free after it
            joined = list(fake_cupy.LOG)
    assert joined == [("event_record", l0.side.ptr), ("wait_event", loop.ptr)]
    gemms = [e for e in first if e[0] == "gemm_ex"]
    assert gemms == [("gemm_ex", GH, 2 * B, n_in)] * 2  # parts 0 and 1: two steps of B rows each
    assert first[-1] == ("wait_event", loop.ptr)
    assert l0.rows == [(0, 2), (2, 4), (4, 5)] and sorted(l0.events) == [0, 1, 2]


def _groups_run(first, fail=None, n=3):
    """rnn_diag_groups.run_groups on the stand-in: each body's (event, group) in the order they happened."""
    from types import SimpleNamespace
    from bench import fake_cupy
    seen, lock = [], threading.Lock()
    with fake_cupy.installed() as fake:
        pb = SimpleNamespace(xp=fake.cupy)
        progress = [rnn_diag_groups.Progress(0) for _ in range(n)]

        def body(g, dev, started):
            with lock:
                seen.append(("start", g))
            if g == fail:
                raise ValueError("broken group")
            with lock:
                seen.append(("first part", g))
            started()
            time.sleep(0.05)  # the next group sets up meanwhile
            with lock:
                seen.append(("end", g))
        try:
            rnn_diag_groups.run_groups(pb, [0] * n, n, body, progress, first=first)
        except ValueError as exc:
            return seen, exc
    return seen, None


@pytest.mark.parametrize("first,order", [(0, [0, 1, 2]), (2, [2, 1, 0])])
def test_groups_set_up_and_issue_one_after_another_from_the_wavefront_start(first, order):
    """CuPy: a group's body starts only once its predecessor has issued its first part (a body holds the GIL
    while it issues, so the group that starts the wavefront goes first)."""
    seen, err = _groups_run(first)
    assert err is None
    for a, b in zip(order, order[1:]):
        assert seen.index(("first part", a)) < seen.index(("start", b)) < seen.index(("end", a))


def test_a_failing_group_stops_the_later_ones_before_their_setup_and_its_error_is_raised():
    seen, err = _groups_run(0, fail=0)
    assert str(err) == "broken group"
    assert seen == [("start", 0)]  # groups 1 and 2 never began their setup


def _weights_reference(spec, cells, layers, gw):
    """The layout rnn_diag.weights writes, built from zeros (float64, then compared in the storage types)."""
    H, out = spec.hidden_size, spec.out_size
    W, bias = np.zeros((len(layers), gw, 2 * out)), np.zeros((len(layers), gw))
    for i, layer in enumerate(layers):
        c = cells[layer][0]
        rows = 3 * H if spec.mode == "gru" else gw
        if layer:
            W[i, :rows, :out] = c.w_ih
        if spec.mode == "gru":
            W[i, :2 * H, out:], W[i, 3 * H:, out:] = c.w_hh[:2 * H], c.w_hh[2 * H:]
        else:
            W[i, :, out:] = c.w_hh
        if c.b_ih is not None:
            b_ih, b_hh = c.b_ih.astype(np.float64), c.b_hh.astype(np.float64)
            if spec.mode == "gru":
                bias[i, :3 * H] = b_ih
                bias[i, :2 * H] += b_hh[:2 * H]
                bias[i, 3 * H:] = b_hh[2 * H:]
            else:
                bias[i] = b_ih + b_hh
    return W, bias


@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("layers", [(0, 1), (1, 2)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_groups_weights_fill_every_element_once(mode, layers, bias, dtype):
    """weights() writes each region once (no zero fill first): poisoned buffers come out exactly as the
    layout built from zeros, gaps and layer 0's input half zero, biases summed in F."""
    from blasx.dnn import rnn_diag_cells, rnn_params
    H, L = 4, 3
    rng = np.random.default_rng(0)
    g = rnn_params.GATES[mode]
    params = {}
    for layer in range(L):
        params[f"weight_ih_l{layer}"] = rng.standard_normal((g * H, H)).astype(dtype)
        params[f"weight_hh_l{layer}"] = rng.standard_normal((g * H, H)).astype(dtype)
        if bias:
            params[f"bias_ih_l{layer}"] = rng.standard_normal(g * H).astype(dtype)
            params[f"bias_hh_l{layer}"] = rng.standard_normal(g * H).astype(dtype)
    spec = rnn_params.parse(params, mode, H, num_layers=L, bidirectional=False, proj_size=0, xp=np, dtype=dtype)
    gw = rnn_diag_cells.gate_width(mode, H)
    W = np.full((len(layers), gw, 2 * H), np.nan, dtype=dtype)
    b = np.full((len(layers), gw), np.nan, dtype=dtype)  # F: x's type (float32 IEEE or float64 run diagonally)
    rnn_diag.weights(spec, spec.cells, layers, W, b)
    W_ref, b_ref = _weights_reference(spec, spec.cells, layers, gw)
    np.testing.assert_array_equal(W, W_ref.astype(dtype))
    np.testing.assert_array_equal(b, b_ref.astype(dtype))


def _four_layers_on_two(cp):
    """A 4-layer LSTM problem (T=9, B=3, H=4, no biases) on stand-in arrays, placed diagonally on two devices;
    the graph cache emptied."""
    import importlib
    from blasx.dnn import rnn_graph, rnn_multi, rnn_plan
    rnn = importlib.import_module("blasx.dnn.rnn")
    T, B, H, L = 9, 3, 4, 4
    p = {}
    for layer in range(L):
        p.update({f"weight_ih_l{layer}": cp.empty((4 * H, H), np.float32),
                  f"weight_hh_l{layer}": cp.empty((4 * H, H), np.float32)})
    pb = rnn._problem("lstm", cp.empty((T, B, H), np.float32), None, p, L, False, False, None, 0, None)
    pl = rnn_plan.plan(L, 1, B, T, 2)
    rnn_multi._last.run = {"placement": pl, "ran_on": {}}
    rnn_graph.clear()
    return pb, pl


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_warm_diagonal_call_hands_over_by_peer_copies_and_keeps_its_part_copies_in_the_graphs(phase):
    """4 layers on two (stand-in) GPUs, graphs on: after the first call every part replays its graph (which
    also holds the part's hand-off scatter and y / input-gradient copy); between the groups each time step
    crosses once, as one peer copy a part (up in forward, down in backward), and y comes home in one; both
    groups' entries are idle again after the call."""
    import collections
    from bench import fake_cupy
    from blasx.dnn import rnn_graph
    with fake_cupy.installed(record_calls=True) as fake:
        cp = fake.cupy
        pb, pl = _four_layers_on_two(cp)
        T, B, H = 9, 3, 4
        training = phase == "backward"
        for _ in range(2):
            if not training:
                fake_cupy.LOG.clear()
            y, h, c, saved = rnn_diag.forward(pb, pl, [0, 1], training)
            if training:
                fake_cupy.LOG.clear()
                rnn_diag.backward(pb, saved, cp.empty((T, B, H), np.float32), None, None)
        log = list(fake_cupy.LOG)
        idle = sum(len(v) for v in rnn_graph._cache.values())
    kinds = collections.Counter(e[0] for e in log)
    parts = len(rnn_diag.chunks(T + 1, pl.chunk))
    assert kinds["graph_launch"] == 2 * parts and "kernel" not in kinds  # nothing captured again
    peers = [e for e in log if e[0] == "memcpy_peer"]
    step = B * H * 4
    if training:  # the input gradient down, from the top group's device
        assert all(e[2:] == (0, 1) for e in peers) and sum(e[1] for e in peers) == T * step
    else:
        assert peers[-1] == ("memcpy_peer", T * step, 0, 1)  # y home from the top group's device
        assert all(e[2:] == (1, 0) for e in peers[:-1]) and sum(e[1] for e in peers[:-1]) == T * step
    assert y.shape == (T, B, H) and y.device.id == 0 and idle == (4 if training else 2)


def test_a_group_failing_mid_call_raises_gives_every_entry_back_and_the_next_call_runs(monkeypatch):
    """A group whose loop fails (here group 1's third chunk): its error is raised, the other group is released
    from its wait, both graph entries go back to the cache, and the next call of the shape runs."""
    from bench import fake_cupy
    from blasx.dnn import rnn_graph
    with fake_cupy.installed(record_calls=True) as fake:
        cp = fake.cupy
        pb, pl = _four_layers_on_two(cp)
        T, B, H = 9, 3, 4
        rnn_diag.forward(pb, pl, [0, 1], False)
        real, calls = rnn_diag.forward_part, []

        def failing(ops, mode, b, first, steps, into, out, n):
            calls.append(first)
            if not first and sum(1 for c in calls if not c) == 3:
                raise RuntimeError("device fault in group 1")
            return real(ops, mode, b, first, steps, into, out, n)
        monkeypatch.setattr(rnn_diag, "forward_part", failing)
        rnn_graph.clear()  # eager parts, so that the stand-in runs the replaced body
        with pytest.raises(RuntimeError, match="device fault in group 1"):
            rnn_diag.forward(pb, pl, [0, 1], False)
        idle = sum(len(v) for v in rnn_graph._cache.values())
        monkeypatch.setattr(rnn_diag, "forward_part", real)
        y, _, _, _ = rnn_diag.forward(pb, pl, [0, 1], False)
    assert idle == 2 and y.shape == (T, B, H)
