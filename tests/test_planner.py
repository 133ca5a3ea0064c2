"""Exact-value tests of the pure parts of the runtime: the GEMM planner and the
tiling helpers, device-spec parsing, the global queue, reservation stations,
the ALRU tile cache and the MESI-X directory. Nothing here starts an engine."""

from __future__ import annotations

import itertools
import math
import threading

import pytest

from blasx.runtime.cache import ALRU, Line
from blasx.runtime.coherence import STATE_E, STATE_I, STATE_S, Directory
from blasx.runtime.config import DeviceSpec, parse_devices, sim_factors
from blasx.runtime.queue import TaskQueue
from blasx.runtime.station import (
    EQ3_SCORE, WHERE_HOST, WHERE_L1, WHERE_L2, ReservationStation, most_loaded, priority,
)
from blasx.runtime.plans import SLOT_A, SLOT_B, SLOT_C, gemm_flops, plan_gemm
from blasx.runtime.tasks import SC_ALPHA, SC_BETA, SC_ONE, SC_ZERO, Step, rotated_steps
from blasx.runtime.tiling import (
    OP_C, OP_N, OP_T, TileRef, n_tiles, op_tile, tile_ref, tile_span,
)


# =========================================================================== tiling helpers

def test_n_tiles_and_tile_span():
    assert [n_tiles(e, 4) for e in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    assert n_tiles(10**12 + 1, 10**6) == 10**6 + 1
    assert tile_span(0, 10, 4) == (0, 4)
    assert tile_span(1, 10, 4) == (4, 4)
    assert tile_span(2, 10, 4) == (8, 2)  # edge tile
    assert tile_span(0, 3, 4) == (0, 3)  # matrix smaller than a tile


def test_tile_ref_edges():
    # 10 x 7 matrix, T = 4: tiles of 4/4/2 rows and 4/3 columns
    assert tile_ref(SLOT_A, 0, 0, 10, 7, 4) == TileRef(SLOT_A, 0, 0, 0, 0, 4, 4)
    assert tile_ref(SLOT_A, 2, 1, 10, 7, 4) == TileRef(SLOT_A, 2, 1, 8, 4, 2, 3)
    assert tile_ref(SLOT_B, 1, 0, 10, 7, 4) == TileRef(SLOT_B, 1, 0, 4, 0, 4, 4)
    # every element is covered exactly once
    covered = set()
    for bi in range(n_tiles(10, 4)):
        for bj in range(n_tiles(7, 4)):
            t = tile_ref(0, bi, bj, 10, 7, 4)
            cells = {(r, c) for r in range(t.r0, t.r0 + t.rows) for c in range(t.c0, t.c0 + t.cols)}
            assert not covered & cells
            covered |= cells
    assert covered == {(r, c) for r in range(10) for c in range(7)}


def test_op_tile_transpose_trick():
    # op(X) tile (i, k) is stored tile (i, k) for N and stored tile (k, i) for T and C
    assert op_tile(SLOT_A, OP_N, 2, 1, 10, 7, 4) == tile_ref(SLOT_A, 2, 1, 10, 7, 4)
    for op in (OP_T, OP_C):
        # X stored 7 x 10, op(X) is 10 x 7; op(X) tile (2, 1) = stored tile (1, 2)
        assert op_tile(SLOT_A, op, 2, 1, 7, 10, 4) == TileRef(SLOT_A, 1, 2, 4, 8, 3, 2)


# =========================================================================== planner

def test_plan_gemm_hand_computed_example():
    # C 5x3, K = 7, T = 4, op_a = T (A stored 7x5), op_b = N (B stored 7x3), beta == 0
    tasks = plan_gemm(5, 3, 7, 4, OP_T, OP_N, beta_zero=True)
    assert len(tasks) == 2
    t0, t1 = tasks
    assert (t0.tid, t1.tid) == (0, 1)
    assert t0.c == TileRef(SLOT_C, 0, 0, 0, 0, 4, 3)
    assert t1.c == TileRef(SLOT_C, 1, 0, 4, 0, 1, 3)
    assert t0.load_c is False and t1.load_c is False
    assert t0.deps == () and t0.worker == -1 and t0.call is None
    assert t0.steps == (
        Step("gemm", TileRef(SLOT_A, 0, 0, 0, 0, 4, 4), TileRef(SLOT_B, 0, 0, 0, 0, 4, 3),
             OP_T, OP_N, 4, 3, 4, SC_ALPHA, SC_ZERO),
        Step("gemm", TileRef(SLOT_A, 1, 0, 4, 0, 3, 4), TileRef(SLOT_B, 1, 0, 4, 0, 3, 3),
             OP_T, OP_N, 4, 3, 3, SC_ALPHA, SC_ONE),
    )
    assert t1.steps == (
        Step("gemm", TileRef(SLOT_A, 0, 1, 0, 4, 4, 1), TileRef(SLOT_B, 0, 0, 0, 0, 4, 3),
             OP_T, OP_N, 1, 3, 4, SC_ALPHA, SC_ZERO),
        Step("gemm", TileRef(SLOT_A, 1, 1, 4, 4, 3, 1), TileRef(SLOT_B, 1, 0, 4, 0, 3, 3),
             OP_T, OP_N, 1, 3, 3, SC_ALPHA, SC_ONE),
    )
    assert t0.flops == 2 * 4 * 3 * 7 and t1.flops == 2 * 1 * 3 * 7
    assert t0.input_tiles() == [t0.steps[0].a, t0.steps[0].b, t0.steps[1].a, t0.steps[1].b]


def test_plan_gemm_hand_computed_b_transposed_beta_nonzero_complex():
    # C 4x6, K = 4, T = 4, op_a = N (A 4x4), op_b = C (B stored 6x4), beta != 0, complex
    tasks = plan_gemm(4, 6, 4, 4, OP_N, OP_C, beta_zero=False, is_complex=True)
    assert [t.c for t in tasks] == [TileRef(SLOT_C, 0, 0, 0, 0, 4, 4), TileRef(SLOT_C, 0, 1, 0, 4, 4, 2)]
    assert all(t.load_c for t in tasks)
    assert tasks[1].steps == (
        Step("gemm", TileRef(SLOT_A, 0, 0, 0, 0, 4, 4), TileRef(SLOT_B, 1, 0, 4, 0, 2, 4),
             OP_N, OP_C, 4, 2, 4, SC_ALPHA, SC_BETA),
    )
    assert tasks[1].flops == 8 * 4 * 2 * 4  # 8 real flops per complex FMA


def _reference_plan(m, n, k, T, op_a, op_b, beta_zero, is_complex):
    """An independent, explicit re-derivation of the plan."""
    def ref(slot, bi, bj, rows, cols):
        r0, c0 = bi * T, bj * T
        return TileRef(slot, bi, bj, r0, c0, min(T, rows - r0), min(T, cols - c0))

    a_rows, a_cols = (m, k) if op_a == OP_N else (k, m)
    b_rows, b_cols = (k, n) if op_b == OP_N else (n, k)
    out = []
    for i in range(math.ceil(m / T)):
        for j in range(math.ceil(n / T)):
            c = ref(SLOT_C, i, j, m, n)
            steps = []
            for kk in range(math.ceil(k / T)):
                a = ref(SLOT_A, i, kk, a_rows, a_cols) if op_a == OP_N else ref(SLOT_A, kk, i, a_rows, a_cols)
                b = ref(SLOT_B, kk, j, b_rows, b_cols) if op_b == OP_N else ref(SLOT_B, j, kk, b_rows, b_cols)
                first = SC_ZERO if beta_zero else SC_BETA
                steps.append(Step("gemm", a, b, op_a, op_b, c.rows, c.cols, min(T, k - kk * T), SC_ALPHA,
                                  first if kk == 0 else SC_ONE))
            flops = (8 if is_complex else 2) * c.rows * c.cols * k
            out.append((c, not beta_zero, tuple(steps), float(flops)))
    return out


@pytest.mark.parametrize("op_a,op_b", list(itertools.product((OP_N, OP_T, OP_C), repeat=2)))
@pytest.mark.parametrize("m,n,k,T", [(1, 1, 1, 4), (3, 4, 5, 4), (4, 4, 4, 4), (5, 5, 5, 4),
                                     (9, 2, 17, 4), (2, 9, 1, 3), (16, 12, 40, 8)])
def test_plan_gemm_matches_reference(op_a, op_b, m, n, k, T):
    for beta_zero, is_complex in itertools.product((True, False), repeat=2):
        tasks = plan_gemm(m, n, k, T, op_a, op_b, beta_zero=beta_zero, is_complex=is_complex)
        assert len(tasks) == math.ceil(m / T) * math.ceil(n / T)
        assert [t.tid for t in tasks] == list(range(len(tasks)))
        got = [(t.c, t.load_c, t.steps, t.flops) for t in tasks]
        assert got == _reference_plan(m, n, k, T, op_a, op_b, beta_zero, is_complex)
        # the tasks' flops add up to the whole product
        assert sum(t.flops for t in tasks) == gemm_flops(m, n, k, is_complex)
        # every step's inner size matches the tiles it reads
        for t in tasks:
            for s in t.steps:
                a_inner = s.a.cols if op_a == OP_N else s.a.rows
                b_inner = s.b.rows if op_b == OP_N else s.b.cols
                assert a_inner == b_inner == s.k
                assert (s.a.rows if op_a == OP_N else s.a.cols) == t.c.rows == s.m
                assert (s.b.cols if op_b == OP_N else s.b.rows) == t.c.cols == s.n


def test_gemm_flops():
    assert gemm_flops(2, 3, 4, False) == 48.0
    assert gemm_flops(2, 3, 4, True) == 192.0


@pytest.mark.parametrize("alpha_zero,k", [(True, 9), (False, 0), (True, 0)])
@pytest.mark.parametrize("beta_zero", [True, False])
def test_plan_gemm_scale_only_plans(alpha_zero, k, beta_zero):
    tasks = plan_gemm(6, 5, k, 4, OP_T, OP_C, alpha_zero=alpha_zero, beta_zero=beta_zero, is_complex=True)
    assert [t.c for t in tasks] == [tile_ref(SLOT_C, i, j, 6, 5, 4) for i in range(2) for j in range(2)]
    beta_ix = SC_ZERO if beta_zero else SC_BETA
    for t in tasks:
        assert t.steps == (Step("scale", None, None, OP_N, OP_N, t.c.rows, t.c.cols, 0, SC_ALPHA, beta_ix),)
        assert t.flops == 0.0
        assert t.load_c is (not beta_zero)
        assert t.input_tiles() == []  # A and B are never read


def test_rotatable_only_with_several_gemm_steps():
    assert [t.rotatable for t in plan_gemm(8, 4, 12, 4, OP_N, OP_N)] == [True, True]
    assert [t.rotatable for t in plan_gemm(8, 4, 4, 4, OP_N, OP_N)] == [False, False]  # one step
    assert [t.rotatable for t in plan_gemm(8, 4, 12, 4, OP_N, OP_N, alpha_zero=True)] == [False, False]


@pytest.mark.parametrize("beta_zero", [True, False])
def test_rotated_steps(beta_zero):
    steps = plan_gemm(4, 4, 10, 4, OP_N, OP_T, beta_zero=beta_zero)[0].steps  # k tiles of 4, 4, 2
    first = SC_ZERO if beta_zero else SC_BETA
    assert [s.beta for s in steps] == [first, SC_ONE, SC_ONE]
    assert rotated_steps(steps, 0) is steps
    assert rotated_steps(steps, 3) is steps  # start is taken modulo the step count
    rot = rotated_steps(steps, 1)
    assert [s.a.bj for s in rot] == [1, 2, 0] and [s.b.bj for s in rot] == [1, 2, 0]
    assert [s.k for s in rot] == [4, 2, 4]
    assert [s.beta for s in rot] == [first, SC_ONE, SC_ONE]  # only the first step run sets C
    assert [s._replace(beta=0) for s in rot] == [s._replace(beta=0) for s in steps[1:] + steps[:1]]
    rot = rotated_steps(steps, -1)
    assert [s.a.bj for s in rot] == [2, 0, 1] and rot[0].beta == first


def test_plan_gemm_empty_output():
    assert plan_gemm(0, 5, 3, 4, OP_N, OP_N) == []
    assert plan_gemm(5, 0, 3, 4, OP_N, OP_N) == []


# =========================================================================== device specs

@pytest.mark.parametrize("text,kind,ids,options", [
    ("cuda", "cuda", (), {}),
    ("cuda:0,1", "cuda", (0, 1), {}),
    (" CUDA : 1 ", "cuda", (1,), {}),
    ("cpu", "cpu", (), {}),
    ("sim", "sim", (), {}),
    ("sim:4", "sim", (4,), {}),
    ("sim:2,slow=4", "sim", (2,), {"slow": "4"}),
    ("sim:3,speeds=1/1/4", "sim", (3,), {"speeds": "1/1/4"}),
    ("sim:2,fail=1@5", "sim", (2,), {"fail": "1@5"}),
    ("sim:2,peers=0", "sim", (2,), {"peers": "0"}),
    ("sim:2, rate=1e9 , h2d=2e9,d2h=3e9,p2p=4e9", "sim", (2,),
     {"rate": "1e9", "h2d": "2e9", "d2h": "3e9", "p2p": "4e9"}),
])
def test_parse_devices_accepts(text, kind, ids, options):
    assert parse_devices(text) == DeviceSpec(kind, ids, options)


@pytest.mark.parametrize("text", [
    "", "   ", "gpu", "tpu:0", "cuda:x", "cuda:0,0", "cuda:slow=2", "cpu:1", "cpu:threads=2",
    "sim:1,2", "sim:0", "sim:-3", "sim:2,foo=1", "sim:2,slow=0", "sim:2,slow=-1", "sim:2,slow=abc",
    "sim:2,rate=0", "sim:2,speeds=1/0", "sim:2,speeds=1/x", "sim:2,fail=x", "sim:2,fail=1",
    "sim:2,fail=a@b", "sim:2,peers=2", "sim:2,peers=yes", "sim:2,speeds=1/1/4", "sim:3,speeds=1/2",
    "sim:2,fail=2@1", "sim:2,fail=-1@1",
])
def test_parse_devices_rejects_with_named_parameter_and_value(text):
    with pytest.raises(ValueError) as info:
        parse_devices(text)
    msg = str(info.value)
    assert msg.startswith("devices:"), msg
    assert repr(text) in msg or repr(text.strip()) in msg, msg


@pytest.mark.parametrize("value", [None, 4, ["sim:2"]])
def test_parse_devices_rejects_non_strings(value):
    with pytest.raises(ValueError) as info:
        parse_devices(value)
    msg = str(info.value)
    assert msg.startswith("devices:") and repr(value) in msg and "'sim:4'" in msg


def test_parse_devices_unknown_option_lists_allowed():
    with pytest.raises(ValueError, match=r"unknown sim option 'foo'.*allowed: slow, rate"):
        parse_devices("sim:2,foo=1")
    with pytest.raises(ValueError, match=r"allowed: cuda, sim, cpu"):
        parse_devices("gpu")


def test_sim_factors():
    assert sim_factors(parse_devices("sim")) == [1.0, 1.0]
    assert sim_factors(parse_devices("sim:3")) == [1.0, 1.0, 1.0]
    assert sim_factors(parse_devices("sim:3,slow=4")) == [1.0, 1.0, 4.0]
    assert sim_factors(parse_devices("sim:3,speeds=1/2.5/4")) == [1.0, 2.5, 4.0]
    with pytest.raises(ValueError, match=r"devices: speeds lists 3 factors for 2 sim devices"):
        sim_factors(parse_devices("sim:2,speeds=1/1/4"))


# =========================================================================== global queue

def test_task_queue_fifo_never_blocks():
    q = TaskQueue()
    assert q.get() is None and len(q) == 0
    q.put(1)
    q.put_many([2, 3, 4])
    assert len(q) == 4
    assert [q.get() for _ in range(5)] == [1, 2, 3, 4, None]


def test_task_queue_remove_if_keeps_order():
    q = TaskQueue()
    q.put_many(range(10))
    assert q.remove_if(lambda x: x % 3 == 0) == [0, 3, 6, 9]
    q.put(99)
    assert [q.get() for _ in range(len(q))] == [1, 2, 4, 5, 7, 8, 99]


def test_task_queue_concurrent_producers_consumers_lose_nothing():
    q = TaskQueue()
    got, lock = [], threading.Lock()

    def produce(base):
        for i in range(2000):
            q.put(base + i)

    def consume():
        mine = []
        while len(mine) < 2000:
            x = q.get()
            if x is not None:
                mine.append(x)
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=produce, args=(b,)) for b in (0, 10_000)]
    threads += [threading.Thread(target=consume) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(got) == list(range(2000)) + list(range(10_000, 12_000))


# =========================================================================== reservation stations

def test_station_capacity_and_errors():
    with pytest.raises(ValueError, match=r"capacity: got 0"):
        ReservationStation(0, 0)
    st = ReservationStation(3, 2)
    assert st.owner == 3 and st.free_slots() == 2 and len(st) == 0
    st.push("a")
    assert st.free_slots() == 1 and len(st) == 1 and st.snapshot() == ("a",)


def test_station_pop_best_by_score_fifo_ties_and_ready():
    st = ReservationStation(0, 8)
    for name in ("a1", "b2", "c1", "d2", "e0"):
        st.push(name)
    score = lambda t: int(t[1])  # noqa: E731
    assert st.pop_best(score) == "b2"  # highest score, first pulled among ties
    assert st.pop_best(score) == "d2"
    assert st.pop_best(score, ready=lambda t: t != "a1") == "c1"  # a1 not ready
    assert st.pop_best(score, ready=lambda t: False) is None
    assert st.pop_best(score) == "a1"
    assert st.pop_best(score) == "e0"  # score 0 still wins over nothing
    assert st.pop_best(score) is None


def test_station_steal_takes_newest_ready():
    st = ReservationStation(0, 8)
    for x in (1, 2, 3, 4):
        st.push(x)
    assert st.steal() == 4
    assert st.steal(ready=lambda t: t % 2 == 1) == 3
    assert st.steal(ready=lambda t: t > 10) is None
    assert st.snapshot() == (1, 2)
    assert st.remove_if(lambda t: t == 1) == [1]
    assert st.drain() == [2] and len(st) == 0


def test_most_loaded_by_waiting_flops():
    from blasx.runtime.tasks import Task

    class task:  # a stand-in with Task's own weight
        work = Task.work

        def __init__(self, flops):
            self.flops = flops

    s0, s1, s2 = (ReservationStation(i, 8) for i in range(3))
    assert most_loaded([s0, s1, s2], exclude=0) is None  # all empty
    for f in (10.0, 10.0, 10.0):
        s0.push(task(f))
    for f in (100.0, 1.0):
        s1.push(task(f))
    s2.push(task(0.0))  # flop-less tasks (scale) still weigh 1
    assert (s0.load(), s1.load(), s2.load()) == (30.0, 101.0, 1.0)
    assert most_loaded([s0, s1, s2], exclude=2) is s1  # two tasks outweigh three lighter ones
    assert most_loaded([s0, s1, s2], exclude=1) is s0
    assert most_loaded([s2], exclude=0) is s2
    assert most_loaded([s0], exclude=0) is None
    s2.push(task(29.0))
    assert most_loaded([s0, s2], exclude=1) is s0  # ties: the first one listed


def test_eq3_priority():
    assert EQ3_SCORE == {WHERE_HOST: 0, WHERE_L2: 1, WHERE_L1: 2}
    task = plan_gemm(4, 4, 8, 4, OP_N, OP_N)[0]  # reads A(0,0) B(0,0) A(0,1) B(1,0)
    where = {(SLOT_A, 0, 0): WHERE_L1, (SLOT_B, 0, 0): WHERE_L2, (SLOT_A, 0, 1): WHERE_HOST,
             (SLOT_B, 1, 0): WHERE_L1}
    assert priority(task, where.__getitem__, lambda r: (r.slot, r.bi, r.bj)) == 2 + 1 + 0 + 2


# =========================================================================== ALRU

def _line(key, dev=0, off=0, nbytes=64):
    return Line(key, dev, off, nbytes, 4, 2)


def test_alru_recency_and_victims():
    c = ALRU(0)
    lines = [_line(k, off=i * 64) for i, k in enumerate("abcd")]
    for ln in lines:
        c.insert(ln)
    assert len(c) == 4 and sum(line.nbytes for line in c) == 256 and "a" in c and "z" not in c
    assert [ln.key for ln in c] == list("abcd")
    assert c.victim().key == "a"
    assert c.get("a").key == "a"  # touched: now the most recent
    assert [ln.key for ln in c] == list("bcda")
    assert c.peek("b").key == "b"  # peek does not touch
    assert c.victim().key == "b"
    assert c.get("zz") is None and c.peek("zz") is None
    # readers block eviction
    lines[1].readers = 1
    assert c.victim().key == "c"
    # dead lines go first, even if more recent (bury moves them to the LRU end)
    c.bury(lines[0])
    assert lines[0].dead and [ln.key for ln in c][0] == "a"
    assert c.victim().key == "a"
    lines[0].readers = 2  # ... unless read
    assert c.victim().key == "c"
    for ln in lines:
        ln.readers = 1
    assert c.victim() is None  # everything busy
    c.remove(lines[2])
    assert len(c) == 3 and sum(line.nbytes for line in c) == 192 and "c" not in c
    with pytest.raises(KeyError):
        c.insert(_line("b"))  # a live line of that tile is cached
    c.insert(_line("a"))  # beside the dead "a" (its readers may still be at work)
    assert c.peek("a") is not lines[0] and lines[0] in list(c)
    assert ALRU(5).victim() is None


# =========================================================================== MESI-X directory

def _key(base, bi=0, bj=0):
    return ((base, 0, 8, 8, 8, "<f8", 4), bi, bj)


def test_directory_states_and_where():
    d = Directory(3)
    k = _key(-1)
    assert d.state(k) == STATE_I and d.where(k, 0) == WHERE_HOST and d.holders(k) == {}
    l0 = _line(k, dev=0)
    d.add(l0)
    assert d.state(k) == STATE_E
    assert d.where(k, 0) == WHERE_L1 and d.where(k, 1) == WHERE_L2
    assert d.holders(k) == {0: l0} and k in d.alrus[0]
    l1 = _line(k, dev=1)
    d.add(l1)
    assert d.state(k) == STATE_S and d.where(k, 1) == WHERE_L1 and d.where(k, 2) == WHERE_L2
    d.drop(l0)
    assert d.state(k) == STATE_E and k not in d.alrus[0] and d.holders(k) == {1: l1}
    d.drop(l1)
    assert d.state(k) == STATE_I and d.holders(k) == {}


def test_directory_peer_source():
    """A peer may copy a line of another device it can read, that is not dead and whose fill
    is at least recorded: complete lines (ready is None) first, else one whose fill event is
    in flight (the reader's stream waits for it). Lines still marked ``filling`` never."""
    d = Directory(3)
    k = _key(-2)
    FILLING = object()
    everyone = lambda holder: True  # noqa: E731
    own = _line(k, dev=0)
    d.add(own)
    assert d.peer_source(k, 0, everyone, FILLING) is None  # never its own line
    assert d.peer_source(_key(-99), 0, everyone, FILLING) is None  # nobody holds it
    p1 = _line(k, dev=1)
    p1.ready = FILLING  # fill not even recorded yet
    d.add(p1)
    assert d.peer_source(k, 0, everyone, FILLING) is None
    p1.ready = event = object()  # fill recorded, in flight
    assert d.peer_source(k, 0, everyone, FILLING) is p1
    p2 = _line(k, dev=2)
    d.add(p2)  # complete: preferred over the one in flight
    assert d.peer_source(k, 0, everyone, FILLING) is p2
    assert d.peer_source(k, 0, lambda holder: holder != 2, FILLING) is p1  # no link to 2
    assert d.peer_source(k, 0, lambda holder: False, FILLING) is None
    p2.dead = True
    assert d.peer_source(k, 0, everyone, FILLING) is p1
    p1.dead = True
    assert d.peer_source(k, 0, everyone, FILLING) is None
    assert d.peer_source(k, 1, everyone, FILLING) is own  # seen from device 1, 0's line is a peer line
    d.drop(own)
    p1.dead = False
    assert d.peer_source(k, 2, everyone, FILLING) is p1 and p1.ready is event  # 2's own line is never used


def test_directory_peer_source_skips_in_flight_lines_that_would_come_late():
    """``soon(line)`` vetoes in-flight lines only: a complete line is always a source."""
    d = Directory(3)
    k = _key(-3)
    FILLING = object()
    everyone = lambda holder: True  # noqa: E731
    p1, p2 = _line(k, dev=1), _line(k, dev=2)
    p1.ready = p2.ready = object()  # both in flight
    d.add(p1)
    d.add(p2)
    assert d.peer_source(k, 0, everyone, FILLING, soon=lambda line: False) is None
    assert d.peer_source(k, 0, everyone, FILLING, soon=lambda line: line is p2) is p2
    p1.ready = None  # complete
    assert d.peer_source(k, 0, everyone, FILLING, soon=lambda line: False) is p1


def lines_of_base(directory, base: int, live_only: bool = True) -> int:
    """Cached lines of token base ``base`` on every device (dead ones too unless ``live_only``)."""
    return sum(1 for alru in directory.alrus for line in alru
               if line.key[0][0] == base and not (live_only and line.dead))


def test_directory_retire_base():
    d = Directory(2)
    ka, kb, other = _key(-5, 0, 0), _key(-5, 1, 0), _key(-6)
    la, lb, lo = _line(ka, 0), _line(kb, 1, off=64), _line(other, 1, off=128)
    for ln in (la, lb, lo):
        d.add(ln)
    assert lines_of_base(d, -5) == 2
    d.retire_base(-5)
    assert la.dead and lb.dead and not lo.dead
    assert d.state(ka) == STATE_I and d.state(kb) == STATE_I and d.state(other) == STATE_E
    assert lines_of_base(d, -5) == 0 and lines_of_base(d, -5, live_only=False) == 2
    # still in their ALRUs (the owners free them), and evicted first
    assert ka in d.alrus[0] and d.alrus[1].victim() is lb
    # a line filled late for a retired token is born dead and never listed
    late = _line(_key(-5, 2, 2), 0, off=256)
    d.add(late)
    assert late.dead and d.holders(late.key) == {} and late.key in d.alrus[0]
    # dropping a dead line removes it from its ALRU without touching the directory
    d.drop(la)
    assert ka not in d.alrus[0]
