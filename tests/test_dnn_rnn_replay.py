"""rnn_replay's policy on a minimal stand-in for CuPy (numpy arrays; streams whose capture records the calls it
is given and whose graphs re-run them): which calls get a signature, the first call general, the second captured
and checked, later ones replayed with fresh outputs; a capture whose graph does not reproduce the general path
on another input is never used (every call still gets the general path's answer). GPU tests: test_gpu_rnn.py."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types

import numpy as np
import pytest

from blasx.dnn import rnn_layer, rnn_replay


class _Array(np.ndarray):
    device = types.SimpleNamespace(id=0)


_Array.__module__ = "cupy"  # (what signature() looks at)


class _Stream:
    count = 0

    def __init__(self, non_blocking=False, null=False):
        _Stream.count += 1
        self.ptr = 0 if null else _Stream.count
        self.capture = None  # the ops recorded while capturing

    def is_capturing(self):
        return self.capture is not None

    def begin_capture(self):
        self.capture = []

    def end_capture(self):
        ops, self.capture = self.capture, None
        return _Graph(ops)

    def record(self):
        return types.SimpleNamespace(synchronize=lambda: _mini.synced.append(self.ptr), src=self.ptr)

    def wait_event(self, ev):
        _mini.waits.append((self.ptr, ev.src))

    def synchronize(self):
        _mini.synced.append(self.ptr)

    def __enter__(self):
        _mini.stack.append(self)
        return self

    def __exit__(self, *exc):
        _mini.stack.pop()


class _Graph:
    def __init__(self, ops):
        self.ops = ops

    def launch(self, stream=None):
        for op in self.ops:
            op()


def _current():
    return _mini.stack[-1]


class _Pool:
    """A private pool of 1000 bytes on the current device; free_all_blocks hands them back unless ``in_use``
    (arrays of it still alive)."""
    made: list = []

    def __init__(self):
        self.held, self.in_use, self.frees = 1000, False, []
        self.malloc = None
        _Pool.made.append(self)

    def total_bytes(self):
        return self.held if _mini.device == 0 else 0

    def free_all_blocks(self):
        self.frees.append(_mini.device)
        if not self.in_use and _mini.device == 0:
            self.held = 0


_mini = types.SimpleNamespace(stack=[_Stream(null=True)], synced=[], waits=[], device=0)


@pytest.fixture
def mini(monkeypatch):
    cupy = types.ModuleType("cupy")
    cupy.empty_like = lambda a: np.empty_like(a).view(_Array)
    cupy.asnumpy = lambda a: np.asarray(a).view(np.ndarray).copy()
    cupy.negative = lambda a: (-np.asarray(a)).view(_Array)
    cupy.uint8 = np.uint8
    cupy.empty = lambda n, dtype=None: np.empty(n, dtype).view(_Array)
    cupy.cuda = types.SimpleNamespace(
        Stream=_Stream, get_current_stream=_current,
        MemoryPool=_Pool,
        using_allocator=lambda m: contextlib.nullcontext(),
        Device=lambda d=0: types.SimpleNamespace(compute_capability="90", __enter__=lambda: None,
                                                 __exit__=lambda *a: None),
        runtime=types.SimpleNamespace(getDevice=lambda: 0))

    class _Dev:
        def __init__(self, d=0):
            self.compute_capability = "90"
            self.d = d

        def __enter__(self):
            self.was, _mini.device = _mini.device, self.d
            return self

        def __exit__(self, *a):
            _mini.device = self.was
    cupy.cuda.Device = _Dev
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    spec = object()
    monkeypatch.setattr(rnn_replay, "_spec", lambda key, x, params: spec)  # (parse's cache: the same Spec)
    monkeypatch.setattr(rnn_layer, "_shared_handle", lambda d: None)
    from blasx.dnn import rnn_multi
    monkeypatch.setattr(rnn_multi, "cuda_devices", lambda home: [home, 1])
    rnn_replay.clear()
    yield cupy
    rnn_replay.clear()


def _x(v):
    return np.full((3, 2, 4), v, np.float32).view(_Array)


def _key(x, **kw):
    args = dict(mode="lstm", x=x, hx=None, params={}, num_layers=1, bidirectional=False, batch_first=False,
                lengths=None, proj_size=0, training=False, math=None)
    args.update(kw)
    return rnn_replay.signature(**args)


def test_signature_only_for_cupy_inference_outside_a_capture(mini, monkeypatch):
    x = _x(1.0)
    key = _key(x)
    assert key is not None and key[2] == (3, 2, 4) and key[12] == _current().ptr and key[13] is False
    assert _key(x, training=True) == key[:13] + (True,)
    assert _key(np.ones((3, 2, 4), np.float32)) is None
    assert _key(x, lengths=[3, 1]) != key and _key(x, bidirectional=True) != key
    assert _key(x, lengths=np.array([3, 1])) is None  # (lengths given as an array: the general path reads it)
    h = np.zeros((1, 2, 4), np.float32).view(_Array)
    assert _key(x, hx=(h, h))[10] == (((1, 2, 4), "<f4", "cupy"),) * 2
    with _Stream(non_blocking=True) as s:
        assert _key(x)[12] == s.ptr != key[12]
        s.begin_capture()
        assert _key(x) is None  # (a caller's own capture: its launches go into that graph)
        s.end_capture()
    monkeypatch.setattr(rnn_replay, "ENABLED", False)
    assert _key(x) is None


def _general(runs, capturing_records: bool):
    """A stand-in for the general path: y = 2 x, h_n = x's first step, fresh arrays each run; inside a capture
    its work is recorded for the graph when ``capturing_records`` (a capturable call), else done once there and
    then (work outside the graph: what the check must catch)."""
    def general(xc, hc):
        runs.append(float(np.asarray(xc).ravel()[0]))
        y, h = np.empty_like(xc).view(_Array), np.empty_like(xc[:1]).view(_Array)

        def work():
            y[...] = 2 * np.asarray(xc)
            h[...] = np.asarray(xc)[:1]
        s = _current()
        if s.is_capturing() and capturing_records:
            s.capture.append(work)
        else:
            work()
        return y, (h, None)
    return general


def test_a_capture_whose_graph_does_not_reproduce_the_call_is_never_used(mini):
    """Work done outside the graph during the capture: the check sees the capture-time outputs, not the
    probe's, so the capture is dropped; every call gets the general path (None: its caller runs it), TRIES
    captures in all."""
    runs: list = []
    general = _general(runs, capturing_records=False)
    key = _key(_x(1.0))
    before = rnn_replay.stats()
    for i in range(6):
        assert rnn_replay.call(key, _x(i + 1.0), None, {}, general) is None
    after = rnn_replay.stats()
    assert after["captured"] == before["captured"] and after["replayed"] == before["replayed"]
    assert after["failures"] - before["failures"] == rnn_replay.TRIES
    assert "differs from the general path" in after["failed"]
    assert runs == [2.0, -2.0, 3.0, -3.0, 4.0, -4.0]  # capture (on the call's x) and check (on -x), 3 times


def test_a_capture_that_raises_orders_the_caller_after_its_stream(mini):
    """A capture that fails (here the general path raising inside it) leaves the call to the general path; the
    slot's input buffer, made on the caller's stream and freed then, had a copy queued on the capture's stream:
    the caller's stream waits for that stream first."""
    runs: list = []
    plain = _general(runs, capturing_records=True)

    def general(xc, hc):
        if _current().is_capturing():
            raise RuntimeError("not capturable")
        return plain(xc, hc)
    key = _key(_x(1.0))
    before = rnn_replay.stats()
    assert rnn_replay.call(key, _x(1.0), None, {}, general) is None  # (first: general)
    _mini.waits.clear()
    assert rnn_replay.call(key, _x(2.0), None, {}, general) is None  # (second: the capture fails)
    assert rnn_replay.stats()["failures"] - before["failures"] == 1
    caller = _current().ptr
    assert any(w == caller and src != caller for w, src in _mini.waits)


def test_replays_copy_in_and_out_and_follow_new_inputs(mini):
    """A capturable call: the second call captures and checks, every later call replays; each result is a
    fresh array holding that call's answer."""
    runs: list = []
    general = _general(runs, capturing_records=True)
    key = _key(_x(1.0))
    before = rnn_replay.stats()
    assert rnn_replay.call(key, _x(1.0), None, {}, general) is None  # the first call: general
    got = [rnn_replay.call(key, _x(v), None, {}, general) for v in (2.0, 3.0, 5.0, 7.0)]
    st = {k: v - before[k] for k, v in rnn_replay.stats().items() if k != "failed"}
    assert st == {"captured": 1, "replayed": 4, "failures": 0, "backward_captured": 0, "backward_replayed": 0}
    assert runs == [2.0, -2.0]  # captured once, checked once on -x; no general run after
    for v, (y, (h, c)) in zip((2.0, 3.0, 5.0, 7.0), got):
        assert (y == 2 * v).all() and (h == v).all() and c is None and y.shape == (3, 2, 4)
    e = next(iter(rnn_replay._entries.values()))
    assert all(r[0] is not e.slots[0].out[0] for r in got) and len({id(r[0]) for r in got}) == 4


def test_a_new_spec_or_engine_starts_a_new_entry(mini, monkeypatch):
    """The parameters parsed to another Spec (new arrays, or changed ones) or a reconfigured engine: the graph
    of the old ones is not replayed (the call is general again, then captured anew)."""
    runs: list = []
    general = _general(runs, capturing_records=True)
    key = _key(_x(1.0))
    rnn_replay.call(key, _x(1.0), None, {}, general)
    assert rnn_replay.call(key, _x(2.0), None, {}, general) is not None
    other = object()
    monkeypatch.setattr(rnn_replay, "_spec", lambda key, x, params: other)
    assert rnn_replay.call(key, _x(3.0), None, {}, general) is None  # general: a new entry's first call
    assert rnn_replay.call(key, _x(4.0), None, {}, general) is not None
    assert runs[-2:] == [4.0, -4.0]


def test_least_recently_used_entries_dropped_past_the_bounds(mini, monkeypatch):
    """At most MAX_ENTRIES signatures and MAX_BYTES of graph memory: the least recently used goes first, once
    its last replay is done (its event synchronised); its next call is general again, then captured anew."""
    runs: list = []
    general = _general(runs, capturing_records=True)
    monkeypatch.setattr(rnn_replay, "MAX_ENTRIES", 2)
    keys = [_key(_x(1.0), lengths=[3] * (i + 1)) for i in range(3)]  # three signatures

    def twice(k, v):
        rnn_replay.call(k, _x(v), None, {}, general)
        return rnn_replay.call(k, _x(v), None, {}, general)
    assert twice(keys[0], 1.0) is not None and twice(keys[1], 2.0) is not None
    assert rnn_replay.call(keys[0], _x(3.0), None, {}, general) is not None  # keys[0] used last: keys[1] goes
    _mini.synced.clear()
    assert twice(keys[2], 4.0) is not None
    assert list(rnn_replay._entries) == [keys[0], keys[2]] and _mini.synced  # (keys[1]'s last replay waited for)
    assert rnn_replay.call(keys[1], _x(5.0), None, {}, general) is None  # dropped: general, then captured again
    # the bytes bound: room for one entry and a half keeps the newest alone
    one = rnn_replay._entries[keys[2]].nbytes
    assert one > 1000  # (its pool, workspace and x buffer)
    monkeypatch.setattr(rnn_replay, "MAX_ENTRIES", 16)
    monkeypatch.setattr(rnn_replay, "MAX_BYTES", one * 3 // 2)
    assert rnn_replay.call(keys[1], _x(6.0), None, {}, general) is not None
    assert list(rnn_replay._entries) == [keys[1]]
    # a signature whose graph alone would pass the bound stays on the general path for good
    monkeypatch.setattr(rnn_replay, "MAX_BYTES", one // 2)
    before = rnn_replay.stats()
    for v in (7.0, 8.0, 9.0, 10.0):
        assert rnn_replay.call(keys[0], _x(v), None, {}, general) is None
    after = rnn_replay.stats()
    assert after["failures"] - before["failures"] == 1 and "would pass MAX_BYTES" in after["failed"]
    assert after["captured"] == before["captured"]


def test_dropped_slots_pools_go_back_to_the_gpu_once_unused(mini, monkeypatch):
    """A dropped slot's private pool is retired: its blocks freed on every GPU, the pool let go once it holds
    nothing; one whose arrays are still in use (a saved state reading it) stays counted in held_bytes and is freed
    on a later sweep. A capture over MAX_BYTES retires its pool too."""
    runs: list = []
    general = _general(runs, capturing_records=True)
    _Pool.made.clear()
    keys = [_key(_x(1.0), lengths=[3] * (i + 1)) for i in range(2)]
    for k in keys:
        rnn_replay.call(k, _x(1.0), None, {}, general)
        assert rnn_replay.call(k, _x(1.0), None, {}, general) is not None
    first, second = _Pool.made
    second.in_use = True
    held = rnn_replay.held_bytes()
    rnn_replay.clear()
    assert first.frees == [0, 1] and first.held == 0 and [p for p, _ in rnn_replay._retired] == [second]
    assert rnn_replay.held_bytes() == 1000 < held
    second.in_use = False
    assert rnn_replay.held_bytes() == 0 and rnn_replay._retired == [] and second.held == 0
    monkeypatch.setattr(rnn_replay, "MAX_BYTES", 10)
    rnn_replay.call(keys[0], _x(1.0), None, {}, general)
    assert rnn_replay.call(keys[0], _x(1.0), None, {}, general) is None and _Pool.made[-1].held == 0


@dataclasses.dataclass
class _Problem:
    x: object
    graphs: bool = False


@dataclasses.dataclass
class _Saved:
    problem: _Problem
    layers: list


def test_training_calls_lease_a_slot_to_their_saved_state(mini):
    """A training call's saved state reads its slot's buffers (here its x) in place: the slot is leased until
    the state is collected, a second slot is captured while the first is out, MAX_LEASES at most (then the
    general path), and a slot comes back for the next call once its state is gone."""
    import gc
    runs: list = []
    inner = _general(runs, capturing_records=True)

    def general(xc, hc):
        y, st = inner(xc, hc)
        return y, st, _Saved(_Problem(xc), [])

    def backward(saved, gy):  # reads the saved state's x where it lies
        return {"input": 3 * np.asarray(saved.problem.x).view(_Array)}
    key = _key(_x(1.0), training=True)
    before = rnn_replay.stats()
    assert rnn_replay.call(key, _x(1.0), None, {}, general, backward) is None  # general
    y2, _, s2 = rnn_replay.call(key, _x(2.0), None, {}, general, backward)  # slot A captured, leased to s2
    y3, _, s3 = rnn_replay.call(key, _x(3.0), None, {}, general, backward)  # slot B (A is out)
    assert (y2 == 4).all() and (y3 == 6).all() and s2.problem.graphs is not False
    assert (backward(s2, None)["input"] == 6).all() and (backward(s3, None)["input"] == 9).all()
    assert rnn_replay.call(key, _x(4.0), None, {}, general, backward) is None  # both out: general
    del s2
    gc.collect()
    slot_b = s3.replay_slot
    rnn_replay.touched(s3)  # (its backward's reads: the slot's next replay waits for them)
    assert len(slot_b.reads) == 1
    y5, _, s5 = rnn_replay.call(key, _x(5.0), None, {}, general, backward)  # slot A again
    assert (y5 == 10).all() and (backward(s5, None)["input"] == 15).all() and (backward(s3, None)["input"] == 9).all()
    st = {k: v - before[k] for k, v in rnn_replay.stats().items() if k != "failed"}
    assert st == {"captured": 2, "replayed": 3, "failures": 0, "backward_captured": 0, "backward_replayed": 0}
    assert s5.replay_slot is not slot_b and len(slot_b.reads) == 1
    del s3
    gc.collect()
    r6 = rnn_replay.call(key, _x(6.0), None, {}, general, backward)  # slot B again: it waited for those reads
    assert r6[2].replay_slot is slot_b and slot_b.reads == [] and slot_b.leased


def _backward_general(runs, capturing_records: bool = True):
    """A stand-in for the general backward: grads["input"] = 3 x + grad_y (x: the saved state's, read where it
    lies), a fresh array each run; recorded into a capture as _general's work is."""
    def general(saved, grads):
        gy = grads[0]
        runs.append(None if gy is None else float(np.asarray(gy).ravel()[0]))
        out = np.empty_like(saved.problem.x).view(_Array)

        def work():
            out[...] = 3 * np.asarray(saved.problem.x) + (0 if gy is None else np.asarray(gy))
        s = _current()
        if s.is_capturing() and capturing_records:
            s.capture.append(work)
        else:
            work()
        return {"input": out}
    return general


def _training():
    """A training call's stand-ins: (its general path, its signature, its backward reading x where it lies)."""
    inner = _general([], capturing_records=True)

    def general(xc, hc):
        y, st = inner(xc, hc)
        return y, st, _Saved(_Problem(xc), [])
    return general, _key(_x(1.0), training=True), (lambda s, gy: {"input": 3 * np.asarray(s.problem.x)})


def _trained(x_value: float):
    """A training call replayed from its slot (the signature's second call): its saved state."""
    general, key, back = _training()
    rnn_replay.call(key, _x(x_value), None, {}, general, back)
    return rnn_replay.call(key, _x(x_value), None, {}, general, back)[2]


def test_a_replayed_forwards_backward_is_captured_on_its_second_call_and_replayed_after(mini):
    """rnn_replay_backward: per slot and gradients' signature the first backward is general (None), the second
    general too (its answer returned) and captured, checked on the same gradients; later ones replay with fresh
    outputs following new gradients; a signature with another gradient given is apart; a saved state of no
    slot, host gradients and a dropped slot (also one dropped between the lookup and the replay) take the
    general path."""
    from blasx.dnn import rnn_replay_backward as rb
    saved = _trained(2.0)
    assert saved.replay_slot is not None
    runs: list = []
    general = _backward_general(runs)
    before = rnn_replay.stats()

    def gy(v):
        return np.full((3, 2, 4), v, np.float32).view(_Array)
    assert rb.call(saved, (gy(1.0), None, None), general) is None  # first: the caller runs the general path
    got = rb.call(saved, (gy(1.0), None, None), general)  # second: general, then captured
    assert (got["input"] == 7.0).all() and runs[0] == 1.0 and np.isnan(runs[1])  # (captured on NaN gradients)
    outs = [rb.call(saved, (gy(v), None, None), general) for v in (5.0, 9.0)]
    assert [float(o["input"].ravel()[0]) for o in outs] == [11.0, 15.0] and len(runs) == 2
    assert outs[0]["input"] is not outs[1]["input"]  # fresh arrays
    st = rnn_replay.stats()
    assert st["backward_captured"] - before["backward_captured"] == 1
    assert st["backward_replayed"] - before["backward_replayed"] == 2 and st["failures"] == before["failures"]
    # grad_h_n given: another signature (general twice, then replayed)
    h = np.zeros((1, 2, 4), np.float32).view(_Array)
    assert rb.call(saved, (gy(1.0), h, None), general) is None
    assert rb.call(saved, (None, None, None), general) is None
    assert rb.call(np.float32(0), (gy(1.0), None, None), general) is None  # no slot
    assert rb.call(saved, (np.ones((3, 2, 4), np.float32), None, None), general) is None  # host gradient
    slot = saved.replay_slot
    assert len(slot.backs) == 1 and slot.nbytes > 0
    (k, b), = slot.backs.items()
    rnn_replay.clear()  # the slot dropped: its backward graph goes (its pool retired), the general path after
    assert slot.backs == {} and rb.call(saved, (gy(1.0), None, None), general) is None
    assert rb._replay(slot, k, b, (gy(1.0), None, None)) is None  # (looked up before the drop, replayed after)


def test_a_backward_capture_that_does_not_reproduce_the_call_is_never_used(mini):
    """Backward work done outside its graph: the check on the same gradients sees the capture-time answer
    missing from the graph's outputs, so the capture is dropped (TRIES in all); every call gets the general
    path's answer."""
    from blasx.dnn import rnn_replay_backward as rb
    saved = _trained(2.0)
    runs: list = []
    general = _backward_general(runs, capturing_records=False)
    before = rnn_replay.stats()
    g = np.full((3, 2, 4), 1.0, np.float32).view(_Array)
    results = [rb.call(saved, (g, None, None), general) for _ in range(2 + rnn_replay.TRIES)]
    assert results[0] is None and all((r["input"] == 7.0).all() for r in results[1:1 + rnn_replay.TRIES])
    assert results[-1] is None  # given up: the caller runs the general path
    after = rnn_replay.stats()
    assert after["backward_captured"] == before["backward_captured"]
    assert after["failures"] - before["failures"] == rnn_replay.TRIES
    assert rnn_replay._retired == []  # (the failed captures' pools swept at once)
    nan = np.array([np.nan, 1.0]).view(_Array)
    assert rnn_replay._worst((nan,), (nan,)) == float("inf")  # (NaN never passes a check, not even against NaN)


def test_a_replay_that_fails_gives_its_training_slot_back(mini, monkeypatch):
    """An error while replaying (out of memory copying the outputs out) leaves no slot leased to a saved state
    that never came: the next call replays from the same slot."""
    general, key, back = _training()
    rnn_replay.call(key, _x(1.0), None, {}, general, back)
    slot = rnn_replay.call(key, _x(2.0), None, {}, general, back)[2].replay_slot  # captured, its state dropped
    import gc
    gc.collect()
    real = rnn_replay._copy_out

    def failing(out):
        raise MemoryError("out of memory allocating 1,024 bytes")
    monkeypatch.setattr(rnn_replay, "_copy_out", failing)
    with pytest.raises(MemoryError):
        rnn_replay.call(key, _x(3.0), None, {}, general, back)
    assert not slot.leased
    monkeypatch.setattr(rnn_replay, "_copy_out", real)
    y, _, saved = rnn_replay.call(key, _x(4.0), None, {}, general, back)
    assert saved.replay_slot is slot and (y == 8.0).all()


def test_a_dropped_slot_waits_for_backwards_that_read_it_elsewhere(mini):
    """A saved state's backward on another stream marks the slot read (rnn_replay.touched); dropping the slot
    (clear, the bounds) waits for those reads too before its graph's memory goes."""
    saved = _trained(2.0)
    other = _Stream(non_blocking=True)
    with other:
        rnn_replay.touched(saved)
    _mini.synced.clear()
    rnn_replay.clear()
    assert other.ptr in _mini.synced
