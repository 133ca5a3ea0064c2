"""rnn_graph's replay logic on the CPU: a stand-in for CuPy whose stream capture records the loop's primitive
calls (instead of running them) and whose graph replays them. Forward and backward through the graph entries
(eager first run, capture, replays) must equal the plain loops, with the GEMMs issued on the entry's workspace."""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest

from blasx.dnn import rnn_cells, rnn_diag, rnn_diag_cells, rnn_graph, rnn_layer
from blasx.dnn.rnn_params import GATES

_rec = {"ops": None}  # the calls recorded while a stand-in stream captures


class _Graph:
    def __init__(self, calls):
        self.calls = calls

    def launch(self, stream):
        for call in self.calls:
            call()


class _Stream:
    ptr = 1  # one stream as far as on_stream can tell: it switches nothing

    def __init__(self, non_blocking=False):
        pass

    def use(self):
        return self

    def record(self):
        return None

    def wait_event(self, event):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def begin_capture(self):
        _rec["ops"] = []

    def end_capture(self):
        graph, _rec["ops"] = _Graph(_rec["ops"]), None
        return graph


class _Device:
    compute_capability = "90"
    id = 0


class _Arr(np.ndarray):
    device = _Device()


def _a(x):
    return np.asarray(x).view(_Arr)


XP = types.SimpleNamespace(
    cuda=types.SimpleNamespace(Stream=_Stream, get_current_stream=_Stream, Device=lambda *a: _Device()),
    empty_like=lambda x: np.empty_like(x).view(_Arr), empty=lambda *a, **k: np.empty(*a, **k).view(_Arr),
    zeros=lambda *a, **k: np.zeros(*a, **k).view(_Arr), uint8=np.uint8)


class _Ops(rnn_layer.HostOps):
    """HostOps on the stand-in: each primitive runs now, or is recorded while a capture is under way."""

    def __init__(self):
        super().__init__()
        self.xp, self.workspace, self.on_workspace, self._ph = XP, None, [], {}

    def _do(self, call):
        if _rec["ops"] is None:
            call()
        else:
            _rec["ops"].append(call)

    def gemm(self, a, w, out, trans_w, beta=0.0):
        self.on_workspace.append(self.workspace is not None)
        self._do(lambda: rnn_layer.HostOps.gemm(a, w, out, trans_w, beta))

    def copy(self, dst, src):
        self._do(lambda: rnn_layer.HostOps.copy(dst, src))

    def add(self, dst, src):
        self._do(lambda: rnn_layer.HostOps.add(dst, src))

    def bias(self, *args):
        self._do(lambda: rnn_layer.HostOps.bias(*args))

    def forward(self, *args):
        self._do(lambda: rnn_cells.np_forward(*args))

    def backward_step(self, *args, **kw):
        self._do(lambda: rnn_cells.np_backward_step(*args, **kw))

    def placeholder(self, f):
        return self._ph.setdefault(np.dtype(f), XP.zeros(1, dtype=f))

    def gemm_batched(self, a, w, out, trans_w, beta):
        self.on_workspace.append(self.workspace is not None)
        self._do(lambda: rnn_layer.HostOps.gemm_batched(a, w, out, trans_w, beta))

    def diag_forward(self, *args):
        self._do(lambda: rnn_diag_cells.np_forward(*args))


@pytest.mark.parametrize("mode,proj", [("lstm", 0), ("lstm", 3), ("gru", 0), ("rnn_tanh", 0)])
@pytest.mark.parametrize("bs", [(4,) * 6, (4, 4, 3, 2, 2, 1)])
@pytest.mark.parametrize("reverse", [False, True])
def test_graph_entries_equal_plain_loops(mode, proj, bs, reverse):
    rng = np.random.default_rng(len(bs) + proj)
    T, B, H = len(bs), bs[0], 5
    G, out = GATES[mode], proj or H
    rnn_graph.clear()
    before = rnn_graph.stats()
    for call in range(4):
        keep = call != 1  # an inference call in between: S and the last C only
        gx = _a(rng.standard_normal((T, B, G * H)))
        w = _a(rng.standard_normal((G * H, out)))
        wr = _a(rng.standard_normal((proj, H))) if proj else None
        bias = _a(rng.standard_normal((G + (mode == "gru")) * H)) if call != 2 else None  # the cell's (or none)
        ref = rnn_layer.forward_buffers(np, mode, T, B, H, out, bool(proj), np.float64, np.float64)
        st = rnn_layer.forward_buffers(XP, mode, T, B, H, out, bool(proj), np.float64, np.float64)
        st.S[...] = np.nan  # never read: the fill writes the entry's inputs and first states
        h0, c0 = rng.standard_normal((B, out)), rng.standard_normal((B, H))
        ref.S[0] = h0
        if ref.C is not None:
            ref.C[0] = c0
        rnn_layer.forward_loop(rnn_layer.HostOps(), mode, gx, w, wr, bias, ref, np.empty((B, G * H)), bs, reverse)

        def fill(e, gx=gx, bias=bias, h0=h0, c0=c0):
            e.gx[...] = gx
            if bias is not None:
                e.bias[...] = bias
            e.st.S[0] = h0
            if e.st.C is not None:
                e.st.C[0] = c0
        ops = _Ops()
        rnn_graph.run(ops, mode, rnn_graph.Like(gx.shape, np.float64), w, wr,
                      None if bias is None else rnn_graph.Like(bias.shape, np.float64), st,
                      rnn_graph.Like((B, G * H), np.float64), bs, reverse, keep=keep, fill=fill)
        assert np.array_equal(st.S, ref.S)
        if ref.C is not None:
            assert np.array_equal(st.C[-1], ref.C[-1])
            if keep:
                assert np.array_equal(st.C, ref.C)
        assert all(ops.on_workspace) and ops.workspace is None
        if not keep:
            continue
        dy = _a(rng.standard_normal((T, B, 2 * out)))[..., :out] if call < 3 else None  # a strided view
        dh_n = _a(rng.standard_normal((B, out))) if call else None
        dc_n = _a(rng.standard_normal((B, H))) if call and mode == "lstm" else None
        want = rnn_layer.backward_loop(rnn_layer.HostOps(), mode, ref, w, wr, None if dy is None else np.asarray(dy),
                                       dh_n, dc_n, bs, reverse, H)
        ops = _Ops()
        got = rnn_graph.run_backward(ops, mode, st, w, wr, dy, dh_n, dc_n, bs, reverse, H)
        for name in ("dgx", "dgh", "dhs", "dh", "dc"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert np.array_equal(a, b), name
        assert all(ops.on_workspace) and ops.workspace is None
        # use=: the caller reads the entry's own result buffers before it goes back (no copies)
        seen = rnn_graph.run_backward(_Ops(), mode, st, w, wr, dy, dh_n, dc_n, bs, reverse, H,
                                      use=lambda bw: (bw, bw.dgx.sum(), bw.dh.copy()))
        assert seen[0] is not got and np.array_equal(seen[1], want.dgx.sum()) and np.array_equal(seen[2], want.dh)
    after = rnn_graph.stats()
    assert after["failures"] == before["failures"]
    assert after["captured"] == before["captured"] + 4  # forwards with biases and without, backwards with dy and without
    assert after["replayed"] == before["replayed"] + 6  # forward calls 1, 3; backward: the use= calls and call 2
    rnn_graph.clear()


@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_diag_parts_equal_plain_loop(mode):
    """A diagonal loop run as graph parts (chunks: eager and captured on the first call, replayed after) equals
    the plain loop over all steps."""
    rng = np.random.default_rng(3)
    n, T, B, H = 3, 5, 2, 4
    G, gw = GATES[mode], rnn_diag_cells.gate_width(mode, H)
    S = T + n - 1

    def bufs(xp):
        return rnn_diag.Bufs(D=xp.zeros((S + 1, B, n + 1, H)), C=xp.zeros((S + 1, n, B, H)),
                             G=xp.zeros((S, n, B, 4 * H)), O=xp.zeros((n, B, gw)), W=xp.zeros((n, gw, 2 * H)),
                             bias=xp.zeros((n, gw)), P0=xp.zeros((T, B, G * H)),
                             acts=rnn_diag.acts_table((2, 2, 1, 1, 1), n))
    rnn_graph.clear()
    e = rnn_graph.Diag(XP, bufs(XP))
    parts = rnn_diag.chunks(S, 3)
    for call in range(3):
        ref = bufs(np)
        for name in ("W", "bias", "P0"):
            v = rng.standard_normal(getattr(ref, name).shape) * 0.5
            getattr(ref, name)[...] = v
            getattr(e.b, name)[...] = v
        rnn_diag.forward_steps(rnn_layer.HostOps(), mode, ref, True, range(S))
        ops = _Ops()
        for part, (a, z) in enumerate(parts):
            rnn_graph.run_part(ops, e, part, np.float64,
                               lambda a=a, z=z: rnn_diag.forward_steps(ops, mode, e.b, True, range(a, z)))
        assert np.array_equal(e.b.D, ref.D) and all(ops.on_workspace)
    assert len(e.graphs) == len(parts) and e.fails == {}


def test_failed_capture_is_tried_again_then_left_eager(monkeypatch):
    """A capture that fails (another thread's synchronising call can invalidate it) is tried again on the next
    calls, CAPTURE_TRIES times in all; every call's result is right meanwhile, and after the last failure the
    part stays eager."""
    rng = np.random.default_rng(5)
    ends = {"n": 0, "fail": 0}
    real_end = _Stream.end_capture

    def end(self):
        ends["n"] += 1
        graph = real_end(self)
        if ends["n"] <= ends["fail"]:
            raise RuntimeError("capture invalidated")
        return graph
    monkeypatch.setattr(_Stream, "end_capture", end)
    n, T, B, H = 2, 5, 2, 3
    S = T + n - 1

    def bufs(xp):
        return rnn_diag.Bufs(D=xp.zeros((S + 1, B, n + 1, H)), C=xp.zeros((S + 1, n, B, H)),
                             G=xp.zeros((S, n, B, 4 * H)), O=xp.zeros((n, B, 4 * H)), W=xp.zeros((n, 4 * H, 2 * H)),
                             bias=xp.zeros((n, 4 * H)), P0=xp.zeros((T, B, 4 * H)),
                             acts=rnn_diag.acts_table((2, 2, 1, 1, 1), n))
    for fail, captured_on in ((2, 3), (rnn_graph.CAPTURE_TRIES, None)):
        ends.update(n=0, fail=fail)
        e = rnn_graph.Diag(XP, bufs(XP))
        before = rnn_graph.stats()
        for call in range(1, 6):
            ref = bufs(np)
            for name in ("W", "bias", "P0"):
                v = rng.standard_normal(getattr(ref, name).shape) * 0.5
                getattr(ref, name)[...] = v
                getattr(e.b, name)[...] = v
            rnn_diag.forward_steps(rnn_layer.HostOps(), "lstm", ref, True, range(S))
            ops = _Ops()
            rnn_graph.run_part(ops, e, 0, np.float64, lambda: rnn_diag.forward_steps(ops, "lstm", e.b, True, range(S)))
            assert np.array_equal(e.b.D, ref.D)
            assert (0 in e.graphs) == (captured_on is not None and call >= captured_on)
        after = rnn_graph.stats()
        assert after["failures"] - before["failures"] == fail == e.fails[0]
        assert after["failed"] == "RuntimeError: capture invalidated"
        assert ends["n"] == (captured_on or fail)


@pytest.mark.parametrize("mode,proj", [("lstm", 0), ("lstm", 3), ("gru", 0)])
def test_a_leased_forward_keeps_its_entry_until_collected(mode, proj):
    """A training forward with lease=True copies out only S: C, gates and R are the entry's own, held by the
    Forward (a second forward of the key takes another entry) until it is collected; the backward replays its
    graph on those buffers in place (captured once per entry) and equals the plain loops; past MAX_LEASES saved
    states of a key a forward copies out as before; once the Forwards are gone their entries serve the next
    calls without new captures."""
    rng = np.random.default_rng(7 + proj)
    bs = (3, 3, 2, 1)
    T, B, H = len(bs), bs[0], 4
    G, out = GATES[mode], proj or H
    rnn_graph.clear()
    before = rnn_graph.stats()
    w = _a(rng.standard_normal((G * H, out)))
    wr = _a(rng.standard_normal((proj, H))) if proj else None

    def train(leased=True):
        gx = _a(rng.standard_normal((T, B, G * H)))
        ref = rnn_layer.forward_buffers(np, mode, T, B, H, out, bool(proj), np.float64, np.float64)
        ref.S[0] = 0
        if ref.C is not None:
            ref.C[0] = 0
        rnn_layer.forward_loop(rnn_layer.HostOps(), mode, gx, w, wr, None, ref, np.empty((B, G * H)), bs, False)
        st = rnn_layer.forward_buffers(XP, mode, T, B, H, out, bool(proj), np.float64, np.float64, lean=True)
        assert isinstance(st.gates, rnn_layer.Like) and st.lease is None

        def fill(e):
            e.gx[...] = gx
            e.st.S[0] = 0
            if e.st.C is not None:
                e.st.C[0] = 0
        rnn_graph.run(_Ops(), mode, rnn_graph.Like(gx.shape, np.float64), w, wr, None, st,
                      rnn_graph.Like((B, G * H), np.float64), bs, False, keep=True, fill=fill, lease=True)
        e = st.lease
        assert (e is not None) == leased
        if leased:
            assert st.gates is e.st.gates and st.S is not e.st.S
        for name in ("S", "C", "R"):
            if getattr(ref, name) is not None:
                assert np.array_equal(getattr(st, name), getattr(ref, name)), name
        assert all(np.array_equal(st.gates[t, :b], ref.gates[t, :b]) for t, b in enumerate(bs))  # (active rows)
        dy = _a(rng.standard_normal((T, B, out)))
        want = rnn_layer.backward_loop(rnn_layer.HostOps(), mode, ref, w, wr, np.asarray(dy), None, None, bs, False, H)
        for _ in range(2):  # captured on the entry the first time, then replayed
            got = rnn_graph.run_backward(_Ops(), mode, st, w, wr, dy, None, None, bs, False, H)
            assert np.array_equal(got.dgx, want.dgx) and np.array_equal(got.dh, want.dh)
        assert not leased or len(e.backs) == 1
        return st
    assert rnn_graph.MAX_LEASES == 2
    first = train()
    second = train()
    entries = [first.lease, second.lease]
    assert entries[0] is not entries[1]  # the first Forward still held its entry
    assert rnn_graph.stats()["captured"] == before["captured"] + 4  # a forward and a backward graph per entry
    assert rnn_graph.stats()["leased"] == before["leased"] + 2
    third = train(leased=False)  # two out on lease: copied out, its backward on a backward entry of its own
    captured = rnn_graph.stats()["captured"]
    del first, second, third  # collected: the leased entries are idle again
    fourth = train()
    assert fourth.lease in entries
    after = rnn_graph.stats()
    assert after["failures"] == before["failures"] and after["captured"] == captured
    rnn_graph.clear()


def test_entries_belong_to_one_call_at_a_time():
    """Two calls of one key never share an entry: a second take while the first is out makes another; given
    back, entries are reused (most recent first) and at most MAX_GRAPHS idle ones are kept."""
    rnn_graph.clear()
    made = []

    def make():
        made.append(rnn_graph.Diag(XP, None))
        return made[-1]
    a = rnn_graph.diag_entry("k", make)
    b = rnn_graph.diag_entry("k", make)
    assert a is not b and len(made) == 2
    rnn_graph.release(a)
    assert rnn_graph.diag_entry("k", make) is a
    rnn_graph.release(a)
    rnn_graph.release(b)
    assert rnn_graph.diag_entry("k", make) is b and rnn_graph.diag_entry("k", make) is a and len(made) == 2
    for e in (a, b):
        rnn_graph.release(e)
    others = [rnn_graph.diag_entry(("other", i), make) for i in range(rnn_graph.MAX_GRAPHS)]
    for e in others:
        rnn_graph.release(e)
    assert rnn_graph.diag_entry("k", make) not in (a, b)  # both dropped: least recently used
    assert rnn_graph.diag_entry(("other", 0), make) is others[0]
    rnn_graph.clear()


def test_ones_rows_for_column_sums_are_kept_per_device_and_type():
    """rnn_layer._ones (col_sum's GEMM operand on CUDA): a C-contiguous (1, n) row cut from one kept per device
    and type, a longer one (at least twice as long) made only when a longer one is asked for, the shorter ones
    kept (another stream's GEMM may still read them); numpy's col_sum is its axis-0 sum."""
    from bench import fake_cupy
    a = np.arange(12.0).reshape(4, 3)
    assert np.array_equal(rnn_layer.col_sum(np, a), a.sum(axis=0))
    with fake_cupy.installed() as fake:
        cupy = fake.cupy
        rnn_layer._ONES.clear()
        r5 = rnn_layer._ones(cupy, 5, np.float32)
        r3 = rnn_layer._ones(cupy, 3, np.float32)
        assert r5.shape == (1, 5) and r3.shape == (1, 3) and r3.flags.c_contiguous and r5.dtype == np.float32
        rows = rnn_layer._ONES[(0, np.dtype(np.float32))]
        assert [r.shape for r in rows] == [(1024,)] and rnn_layer._ones(cupy, 2000, np.float32).shape == (1, 2000)
        assert rnn_layer._ones(cupy, 2100, np.float32).shape == (1, 2100)
        assert [r.shape for r in rows] == [(1024,), (2048,), (4096,)]  # grown, shorter ones kept (maybe in use)
        assert rnn_layer._ones(cupy, 3, np.float64).dtype == np.float64 and len(rnn_layer._ONES) == 2
        rnn_layer._ONES.clear()


@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_narrow_half_backward_keeps_only_the_rounded_gradients(mode, monkeypatch):
    """rnn_layer.NARROW (CUDA float16 loops, here the stand-in): no gate gradients in F, only dgh rounded (g16)
    and GRU's dgx rounded (x16), each equal to the full form's rounding; dh and dc as the full form's."""
    monkeypatch.setattr(rnn_layer, "NARROW", True)
    rng = np.random.default_rng(11)
    bs = (3, 3, 2)
    T, B, H = len(bs), bs[0], 4
    G = GATES[mode]
    w16 = (rng.standard_normal((G * H, H)) * 0.3).astype(np.float16)
    st = rnn_layer.forward_buffers(np, mode, T, B, H, H, False, np.float16, np.float32)
    st.S[0] = 0
    if st.C is not None:
        st.C[0] = 0
    rnn_layer.forward_loop(rnn_layer.HostOps(), mode, rng.standard_normal((T, B, G * H)).astype(np.float32),
                           w16.astype(np.float32), None, None, st, np.empty((B, G * H), np.float32), bs, False)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    full = rnn_layer.backward_loop(rnn_layer.HostOps(), mode, st, w16, None, dy, None, None, bs, False, H)
    view = rnn_layer.Forward(*(None if a is None else _a(a) for a in (st.S, st.C, st.gates, st.R)))
    ops = _Ops()
    got, scratch = rnn_layer.backward_buffers(ops, mode, view, _a(w16), H, np.float32, None, None, np.float16)
    rnn_layer.backward_steps(ops, mode, view, _a(w16), None, _a(dy), bs, False, got, scratch)
    assert got.dgx is None and got.dgh is None and full.dgx is not None
    assert np.array_equal(got.g16, full.g16) and np.array_equal(got.dh, full.dh)
    if mode == "gru":
        assert np.array_equal(got.x16, full.dgx.astype(np.float16))
    else:
        assert got.x16 is None
    if mode == "lstm":
        assert np.array_equal(got.dc, full.dc)


def test_an_interrupted_lease_gives_its_entry_back_uncounted(monkeypatch):
    """Ctrl-C while a training forward takes its lease (here: in registering the finalizer): the call raises,
    the entry is idle again and not counted as lent, and the next forward takes it on lease."""
    rng = np.random.default_rng(3)
    T, B, H, G = 3, 2, 4, 4
    rnn_graph.clear()
    w = _a(rng.standard_normal((G * H, H)))

    def forward():
        st = rnn_layer.forward_buffers(XP, "lstm", T, B, H, H, False, np.float64, np.float64, lean=True)

        def fill(e):
            e.gx[...] = rng.standard_normal((T, B, G * H))
            e.st.S[0] = 0
            e.st.C[0] = 0
        rnn_graph.run(_Ops(), "lstm", rnn_graph.Like((T, B, G * H), np.float64), w, None, None, st,
                      rnn_graph.Like((B, G * H), np.float64), (B,) * T, False, keep=True, fill=fill, lease=True)
        return st

    def interrupt(*a, **k):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(rnn_graph.weakref, "finalize", interrupt)
        with pytest.raises(KeyboardInterrupt):
            forward()
    assert sum(rnn_graph._leased.values()) == 0 and sum(len(v) for v in rnn_graph._cache.values()) == 1
    idle = next(iter(rnn_graph._cache.values()))[0]
    st = forward()
    assert st.lease is idle and sum(rnn_graph._leased.values()) == 1
    del st
    rnn_graph.clear()


def test_graphs_switched_off_for_the_process(monkeypatch):
    """BLASX_RNN_GRAPHS=0 (rnn_graph.ENABLED): every thread's step loops launch eagerly; eager() still applies."""
    import subprocess
    import sys
    code = "from blasx.dnn import rnn_graph; print(rnn_graph.ENABLED, rnn_graph.enabled())"
    for value, want in (("0", "False False"), ("1", "True True")):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "BLASX_RNN_GRAPHS": value},
                             capture_output=True, text=True, check=True).stdout.split("\n")[-2]
        assert out == want
    monkeypatch.setattr(rnn_graph, "ENABLED", False)
    assert not rnn_graph.enabled()
    with rnn_graph.eager():
        assert not rnn_graph.enabled()
    monkeypatch.setattr(rnn_graph, "ENABLED", True)
    assert rnn_graph.enabled()


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_a_captured_prologue_reads_the_parameters_where_they_lie(mode, monkeypatch):
    """rnn_graph.run(prologue=): x copied into the entry, the weights' copies, the projection, the bias and zero
    first states replayed from a graph of their own, captured for the parameters' addresses: results equal the
    plain loop's on every call (new values in the same arrays included, as a training step's in-place update);
    parameters at new addresses get a graph of their own, up to PROLOGUES, then the oldest is dropped for a new
    one CAPTURE_TRIES times; after that new addresses run it eagerly."""
    monkeypatch.setattr(rnn_graph, "PROLOGUES", 2)
    rng = np.random.default_rng(9)
    T, B, H, n_in = 4, 3, 5, 6
    G = GATES[mode]
    nb = (G + (mode == "gru")) * H
    rnn_graph.clear()

    def params():
        return [_a(rng.standard_normal(sh)) for sh in ((G * H, n_in), (G * H, H), (G * H,), (G * H,))]
    p = params()
    pro = []
    for call in range(10):
        if call == 3:
            for a in p:  # in place, same addresses: the captured prologue reads the new values
                a[...] = rng.standard_normal(a.shape)
        if call >= 5:  # new arrays every call: captured anew until CAPTURE_TRIES changes, then eager
            p = params()
        w_ih, w_hh, b_ih, b_hh = p
        x = _a(rng.standard_normal((T, B, n_in)))
        ref = rnn_layer.forward_buffers(np, mode, T, B, H, H, False, np.float64, np.float64)
        ref.S[0] = 0
        if ref.C is not None:
            ref.C[0] = 0
        bias = np.empty(nb)
        rnn_layer.HostOps.bias(bias, b_ih, b_hh, mode == "gru")
        gx = (x.reshape(T * B, n_in) @ w_ih.T).reshape(T, B, G * H)
        rnn_layer.forward_loop(rnn_layer.HostOps(), mode, gx, w_hh, None, bias, ref, np.empty((B, G * H)), (B,) * T,
                               False)
        st = rnn_layer.forward_buffers(XP, mode, T, B, H, H, False, np.float64, np.float64)
        st.S[...] = np.nan
        ops = _Ops()

        def prologue(e):
            ops.gemm(e.x.reshape(T * B, -1), w_ih, e.gx.reshape(T * B, -1), True)
            ops.bias(e.bias, b_ih, b_hh, mode == "gru")
            ops.copy(e.st.S[0], 0)
            if e.st.C is not None:
                ops.copy(e.st.C[0], 0)
        sources = tuple(id(a) for a in p)
        like = rnn_graph.Like
        rnn_graph.run(ops, mode, like((T, B, G * H), np.float64), w_hh, None, like((nb,), np.float64), st,
                      like((B, G * H), np.float64), (B,) * T, False, fill=lambda e: None, x=x, prologue=prologue,
                      sources=sources)
        assert np.array_equal(st.S, ref.S), call
        e = rnn_graph._cache[next(iter(rnn_graph._cache))][0]
        if call == 0:  # a backward graph a leased entry keeps beside them: never counted or dropped here
            e.graphs[("bwd", "key")] = backward = object()
        pro.append((("pro", sources) in e.graphs, sum(k[0] == "pro" for k in e.graphs if isinstance(k, tuple)),
                    e.moved))
    assert rnn_graph.CAPTURE_TRIES == 3
    assert pro[:5] == [(True, 1, 0)] * 5  # captured on the first call (after its eager run), replayed after
    assert pro[5:] == [(True, 2, 0), (True, 2, 1), (True, 2, 2), (True, 2, 3), (False, 2, 3)]
    assert e.graphs[("bwd", "key")] is backward
    # each captured part keeps the placeholders its launches point at; a dropped prologue's went with it
    assert set(e.ph) == set(e.graphs) - {("bwd", "key")}
    rnn_graph.clear()


def test_ctrl_c_during_a_capture_ends_it_and_leaves_the_key_usable(monkeypatch):
    """A KeyboardInterrupt raised while a loop is being captured: the capture is ended before it propagates
    (no stream left capturing), nothing is counted as a failure, and the next call of the key captures and
    then replays with the right result."""
    rng = np.random.default_rng(11)
    mode, T, B, H = "gru", 3, 2, 4
    ends = []
    real_end = _Stream.end_capture
    monkeypatch.setattr(_Stream, "end_capture", lambda self: ends.append(1) or real_end(self))
    real_forward = rnn_layer.forward_loop
    hit = {"on": True}

    def forward_loop(*a, **k):
        if _rec["ops"] is not None and hit["on"]:
            hit["on"] = False
            raise KeyboardInterrupt
        return real_forward(*a, **k)
    monkeypatch.setattr(rnn_layer, "forward_loop", forward_loop)
    rnn_graph.clear()
    before = rnn_graph.stats()
    w = _a(rng.standard_normal((3 * H, H)))
    for call in range(3):
        gx = _a(rng.standard_normal((T, B, 3 * H)))
        ref = rnn_layer.forward_buffers(np, mode, T, B, H, H, False, np.float64, np.float64)
        ref.S[0] = 0
        real_forward(rnn_layer.HostOps(), mode, gx, w, None, None, ref, np.empty((B, 3 * H)), (B,) * T, False)
        st = rnn_layer.forward_buffers(XP, mode, T, B, H, H, False, np.float64, np.float64)

        def fill(e, gx=gx):
            e.gx[...] = gx
            e.st.S[0] = 0

        def go():
            rnn_graph.run(_Ops(), mode, rnn_graph.Like(gx.shape, np.float64), w, None, None, st,
                          rnn_graph.Like((B, 3 * H), np.float64), (B,) * T, False, fill=fill)
        if call == 0:
            with pytest.raises(KeyboardInterrupt):
                go()
            assert _rec["ops"] is None and len(ends) == 1  # the capture was ended
            continue
        go()
        assert np.array_equal(st.S, ref.S)
    after = rnn_graph.stats()
    assert after["failures"] == before["failures"] and after["captured"] == before["captured"] + 1
    assert after["replayed"] == before["replayed"] + 1 and len(ends) == 2
    rnn_graph.clear()


def test_no_entries_inside_a_callers_capture():
    """A recurrent call made while its stream is capturing (a network chunk's graph being captured) runs its loop
    into that capture: no entry is taken (an entry's events and graphs cannot cross into another capture)."""
    from bench import fake_cupy
    import importlib
    rnn = importlib.import_module("blasx.dnn.rnn")  # the module (blasx.dnn.rnn names the function)
    with fake_cupy.installed() as fake:
        cupy = fake.cupy
        x = cupy.asarray(np.zeros((3, 2, 4), np.float32))
        params = {"weight_ih_l0": cupy.asarray(np.zeros((8, 4), np.float32)),
                  "weight_hh_l0": cupy.asarray(np.zeros((8, 8), np.float32))}

        def graphs():
            return rnn._problem("rnn_tanh", x, None, params, 1, False, False, None, 0, None).graphs
        assert graphs() and rnn_graph.usable(cupy)
        stream = cupy.cuda.get_current_stream()
        stream.begin_capture()
        try:
            assert not graphs() and not rnn_graph.usable(cupy)
        finally:
            stream.end_capture()
        assert graphs()
        with rnn_graph.eager():
            assert not graphs()


def test_idle_entries_are_bounded_by_their_bytes(monkeypatch):
    """Idle entries past MAX_IDLE_BYTES go, least recently used first (the one just given back stays, however
    large); held_bytes counts each distinct buffer once (views of one array are one buffer)."""
    rnn_graph.clear()
    entries = [rnn_graph.Diag(XP, None) for _ in range(4)]
    for e in entries:
        e.b = (np.zeros(1000, np.float32), np.zeros(1000, np.float32)[10:])  # a buffer and a view of another
    one = rnn_graph.buffer_bytes(entries[0])
    assert one == entries[0].workspace.nbytes + 2 * 4000
    monkeypatch.setattr(rnn_graph, "MAX_IDLE_BYTES", int(2.5 * one))
    for i, e in enumerate(entries):
        e.key = ("k", i)
        rnn_graph.release(e)
    assert rnn_graph.held_bytes() == 2 * one
    fresh = rnn_graph.Diag(XP, None)
    assert rnn_graph.diag_entry(("k", 0), lambda: fresh) is fresh  # dropped
    assert rnn_graph.diag_entry(("k", 3), lambda: fresh) is entries[3]
    monkeypatch.setattr(rnn_graph, "MAX_IDLE_BYTES", one // 2)
    rnn_graph.release(entries[3])
    assert rnn_graph.held_bytes() == one  # alone over the bound: kept
    rnn_graph.clear()
    assert rnn_graph.held_bytes() == 0


def test_a_call_that_ran_out_of_gpu_memory_runs_again_after_the_caches_are_released(monkeypatch):
    """dnn's recurrent calls: a CuPy out-of-memory error while the caches hold memory drops them (idle graph
    entries, whole-call graphs, CuPy's cached blocks) and runs the call once more; with nothing held, or a second
    failure, the error reaches the caller."""
    from bench import fake_cupy
    import importlib
    from blasx.dnn import rnn_replay
    rnn = importlib.import_module("blasx.dnn.rnn")  # (blasx.dnn.rnn is also the function)
    with fake_cupy.installed():
        oom = sys.modules["cupy"].cuda.memory.OutOfMemoryError
        calls = []

        def flaky(n):
            calls.append(n)
            if len(calls) == 1:
                raise oom("out of memory allocating 294,912,000 bytes")
            return n * 2
        cleared = []
        monkeypatch.setattr(rnn_graph, "held_bytes", lambda: 1 << 30)
        monkeypatch.setattr(rnn_graph, "clear", lambda: cleared.append("graphs"))
        monkeypatch.setattr(rnn_replay, "clear", lambda: cleared.append("replay"))
        assert rnn._retrying(flaky, 21) == 42 and calls == [21, 21] and cleared == ["graphs", "replay"]
        calls.clear()
        monkeypatch.setattr(rnn_graph, "held_bytes", lambda: 0)
        with pytest.raises(MemoryError, match="294,912,000"):
            rnn._retrying(flaky, 1)  # nothing was held: not run again
        assert calls == [1]

        def always(n):
            calls.append(n)
            raise oom("still out of memory")
        calls.clear()
        monkeypatch.setattr(rnn_graph, "held_bytes", lambda: 1 << 30)
        with pytest.raises(MemoryError, match="still"):
            rnn._retrying(always, 1)
        assert calls == [1, 1]


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_cuda_step_loops_allocate_nothing(mode, splits, monkeypatch):
    """forward_loop and backward_steps with CudaOps (the fake CuPy): kernels and GEMMs only, no allocation once
    the placeholders exist, since rnn_graph captures them into graphs whose replays write the captured addresses
    (memory freed after a capture would be written by every replay)."""
    from bench import fake_cupy
    with fake_cupy.installed() as fake:
        cupy = fake.cupy
        ops = rnn_layer.CudaOps("ieee")
        monkeypatch.setattr(rnn_layer.CudaOps, "step_splits", lambda self, f, k, h: splits)  # (k slices too)
        T, B, H = 5, 4, 8
        g = GATES[mode] * H
        st = rnn_layer.forward_buffers(cupy, mode, T, B, H, H, False, np.float32, np.float32)
        gx, w_hh, gh = (cupy.empty(s, dtype=np.float32) for s in ((T, B, g), (g, H), (B, g)))
        bias, dy = cupy.empty((4 * H,), dtype=np.float32), cupy.empty((T, B, H), dtype=np.float32)
        bs = [4, 4, 3, 2, 1]
        bw, scratch = rnn_layer.backward_buffers(ops, mode, st, w_hh, H, np.float32, None, None)

        def loops():
            rnn_layer.forward_loop(ops, mode, gx, w_hh, None, bias, st, gh, bs, False)
            rnn_layer.backward_steps(ops, mode, st, w_hh, None, dy, bs, False, bw, scratch)
        loops()  # (the placeholders made)
        made = []
        real = fake_cupy.empty
        monkeypatch.setattr(fake_cupy, "empty", lambda *a, **k: made.append(a) or real(*a, **k))
        loops()
        assert made == []


def test_k_slice_stacks_only_for_a_contiguous_recurrent_weight(monkeypatch):
    """backward_buffers makes the k slices' partial-sum stacks only where backward_steps can slice the weight
    as views (C-contiguous W_hh); a transposed view takes cuBLAS's split-k and no stacks."""
    from bench import fake_cupy
    with fake_cupy.installed() as fake:
        cupy = fake.cupy
        ops = rnn_layer.CudaOps("ieee")
        monkeypatch.setattr(rnn_layer.CudaOps, "step_splits", lambda self, f, k, h: 2)
        T, B, H = 3, 4, 8
        st = rnn_layer.forward_buffers(cupy, "lstm", T, B, H, H, False, np.float32, np.float32)
        dense = cupy.empty((4 * H, H), dtype=np.float32)
        viewed = cupy.empty((H, 4 * H), dtype=np.float32).T
        _, a = rnn_layer.backward_buffers(ops, "lstm", st, dense, H, np.float32, None, None)
        _, b = rnn_layer.backward_buffers(ops, "lstm", st, viewed, H, np.float32, None, None)
        assert (a.splits, b.splits) == (2, 1) and a.parts is not None and b.parts is None


def test_dropped_entries_live_until_their_last_users_work_is_done(monkeypatch):
    """An idle entry dropped past MAX_GRAPHS (or by clear) keeps its buffers until the event of its last user's
    work has completed: freed at once they would go back to the stream that allocated them, free for its next
    allocation while another stream may still be using them."""
    class Done:
        def __init__(self, done):
            self.done = done

    class Entry:
        def __init__(self, key, done):
            self.key, self.done = key, Done(done)
    monkeypatch.setattr(rnn_graph, "MAX_GRAPHS", 1)
    monkeypatch.setattr(rnn_graph, "_cache", type(rnn_graph._cache)())
    monkeypatch.setattr(rnn_graph, "_draining", [])
    running, finished = Entry("a", False), Entry("b", True)
    with rnn_graph._lock:
        rnn_graph._idle(running)
        rnn_graph._idle(finished)  # drops "a", whose work still runs
        assert rnn_graph._draining == [running] and rnn_graph._cache == {"b": [finished]}
        rnn_graph._idle(Entry("c", True))  # drops "b", done: freed at once
        assert rnn_graph._draining == [running]
        running.done.done = True
        rnn_graph._take_back()
        assert rnn_graph._draining == []
        rnn_graph._cache["c"].pop()  # (taken by a call: its key's list left empty, the least recently used)
        rnn_graph._idle(Entry("e", True))
        rnn_graph._idle(Entry("f", True))
        assert rnn_graph._cache == {"f": [rnn_graph._cache["f"][0]]}
    late = Entry("d", False)
    with rnn_graph._lock:
        rnn_graph._idle(late)
    rnn_graph.clear()
    assert rnn_graph._cache == {} and rnn_graph._draining == [late]
