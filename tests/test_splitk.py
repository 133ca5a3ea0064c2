"""Split-k (issue 21): the planner by exact value, the choice of S, and blasx.gemm / matmul on sims.

``plan_gemm(split=S)`` plans S partial tasks per C tile over fixed k ranges into a scratch operand,
then one reduction task per C tile gated on them; ``choose_split`` picks S. On the sim: every GEMM
type against numpy by relative-norm error, alpha / beta, bit-identical results run to run, a
device failing mid-call, Ctrl-C; GPU tests (``gpu``) check the same on CUDA.
"""

from __future__ import annotations

import importlib
import random
import signal
import threading

import numpy as np
import pytest

import blasx
from blasx.runtime.call import Call
from blasx.runtime.devices.numpy_kernels import KERNELS
from blasx.runtime.plans import (MIN_PART_TILES, PARTIAL_SHARE, SLOT_A, SLOT_B, SLOT_C, SLOT_P, choose_split,
                                 gemm_flops, partial_ref, partial_shape, plan_gemm)
from blasx.runtime.stats import CallStats, DeviceInfo
from blasx.runtime.tasks import N_SCALARS, SC_ALPHA, SC_BETA, SC_ONE, SC_ZERO, Step
from blasx.runtime.tiling import OP_C, OP_N, OP_T, TileRef, n_tiles, tile_ref

faults = importlib.import_module("blasx.runtime.faults")
dispatch = importlib.import_module("blasx.dispatch")

try:
    from ml_dtypes import bfloat16
except ImportError:  # optional
    bfloat16 = None

NGPU = blasx.session._cuda_count()
FLOATS = (np.float32, np.float64, np.complex64, np.complex128)
REDUCED = (np.float16,) + ((bfloat16,) if bfloat16 is not None else ())
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.complex64): 1e-5, np.dtype(np.float64): 1e-12,
       np.dtype(np.complex128): 1e-12, np.dtype(np.float16): 3e-3}
if bfloat16 is not None:
    TOL[np.dtype(bfloat16)] = 2e-2


def _fields(t):
    return (t.tid, t.c, t.load_c, t.steps, t.flops, t.deps, t.rotatable, t.fixed, t.keep_c, t.c_init, t.gates,
            t.war, t.urgent)


# =========================================================================== the planner

def test_plan_gemm_split_hand_computed():
    # C 5x3 (tiles 4 + 1 rows), k = 10 (tiles 4, 4, 2), T = 4, split 2: k tiles [0, 1) and [1, 3);
    # per C tile its partials, then its reduction
    tasks = plan_gemm(5, 3, 10, 4, OP_N, OP_N, beta_zero=False, split=2)
    assert [t.tid for t in tasks] == list(range(6))
    p00, p01, r0, p10, p11, r1 = tasks
    assert [t.c for t in (p00, p01, p10, p11)] == [
        TileRef(SLOT_P, 0, 0, 0, 0, 4, 3), TileRef(SLOT_P, 0, 1, 0, 3, 4, 3),
        TileRef(SLOT_P, 1, 0, 4, 0, 1, 3), TileRef(SLOT_P, 1, 1, 4, 3, 1, 3)]
    A = lambda i, kk: tile_ref(SLOT_A, i, kk, 5, 10, 4)  # noqa: E731
    B = lambda kk, j: tile_ref(SLOT_B, kk, j, 10, 3, 4)  # noqa: E731
    # partial 0 of C tile (0, 0): one k tile, from beta 0 into the scratch
    assert p00.steps == (Step("gemm", A(0, 0), B(0, 0), OP_N, OP_N, 4, 3, 4, SC_ALPHA, SC_ZERO),)
    # partial 1 of C tile (1, 0): k tiles 1 and 2 in order
    assert p11.steps == (Step("gemm", A(1, 1), B(1, 0), OP_N, OP_N, 1, 3, 4, SC_ALPHA, SC_ZERO),
                         Step("gemm", A(1, 2), B(2, 0), OP_N, OP_N, 1, 3, 2, SC_ALPHA, SC_ONE))
    assert [t.flops for t in (p00, p01, p10, p11)] == [2 * 4 * 3 * 4, 2 * 4 * 3 * 6, 2 * 1 * 3 * 4, 2 * 1 * 3 * 6]
    for t in (p00, p01, p10, p11):
        assert not t.load_c and t.keep_c and not t.rotatable and t.deps == () and t.gates == ()
    assert r0.c == TileRef(SLOT_C, 0, 0, 0, 0, 4, 3) and r1.c == TileRef(SLOT_C, 1, 0, 4, 0, 1, 3)
    assert r0.steps == (Step("add", p00.c, None, OP_N, OP_N, 4, 3, 0, SC_ONE, SC_BETA),
                        Step("add", p01.c, None, OP_N, OP_N, 4, 3, 0, SC_ONE, SC_ONE))
    assert r1.steps == (Step("add", p10.c, None, OP_N, OP_N, 1, 3, 0, SC_ONE, SC_BETA),
                        Step("add", p11.c, None, OP_N, OP_N, 1, 3, 0, SC_ONE, SC_ONE))
    assert (r0.deps, r0.gates, r1.deps, r1.gates) == ((0, 1), ((0,), (1,), ()), (3, 4), ((3,), (4,), ()))
    for r in (r0, r1):
        assert r.load_c and not r.keep_c and not r.rotatable and r.flops == 0.0
    assert sum(t.flops for t in tasks) == gemm_flops(5, 3, 10, False)


def test_plan_gemm_split_beta_zero_transposed_complex():
    # op T / C: A stored k x m, B stored n x k; beta 0: the reduction starts from SC_ZERO, C not loaded
    tasks = plan_gemm(4, 4, 12, 4, OP_T, OP_C, is_complex=True, split=3)
    assert len(tasks) == 4
    for s, t in enumerate(tasks[:3]):  # one C tile: its three partials, then its reduction
        assert t.c == TileRef(SLOT_P, 0, s, 0, 4 * s, 4, 4)
        assert t.steps == (Step("gemm", tile_ref(SLOT_A, s, 0, 12, 4, 4), tile_ref(SLOT_B, 0, s, 4, 12, 4),
                                OP_T, OP_C, 4, 4, 4, SC_ALPHA, SC_ZERO),)
        assert t.flops == 8 * 4 * 4 * 4
    red = tasks[3]
    assert not red.load_c and [st.beta for st in red.steps] == [SC_ZERO, SC_ONE, SC_ONE]
    assert red.deps == (0, 1, 2)


def test_split_one_is_the_plain_plan():
    for args in ((37, 19, 83, 16, OP_N, OP_T), (5, 5, 5, 2, OP_C, OP_N), (64, 64, 4000, 32, OP_T, OP_N)):
        for kw in ({}, {"beta_zero": False}, {"alpha_zero": True}, {"block": (2, 2)}):
            plain = plan_gemm(*args, **kw)
            assert [_fields(t) for t in plan_gemm(*args, split=1, **kw)] == [_fields(t) for t in plain]
            assert all(not t.keep_c and not t.deps for t in plain)


def test_split_plan_invariants():
    rng = random.Random(3)
    for _ in range(40):
        m, n, k, T = rng.randint(1, 50), rng.randint(1, 50), rng.randint(1, 300), rng.choice((4, 7, 16))
        tk = n_tiles(k, T)
        S = rng.randint(1, tk)
        block, op_a = rng.choice(((1, 1), (2, 2))), rng.randint(0, 2)
        tasks = plan_gemm(m, n, k, T, op_a, rng.randint(0, 2), beta_zero=rng.random() < 0.5, split=S, block=block)
        tiles = n_tiles(m, T) * n_tiles(n, T)
        assert len(tasks) == (tiles if S == 1 else tiles * (S + 1))
        assert sum(t.flops for t in tasks) == gemm_flops(m, n, k, False)
        if S == 1:
            continue
        pm, pn = partial_shape(m, n, S)
        parts = [t for t in tasks if not t.deps]
        assert len(parts) == S * tiles and len({(t.c.bi, t.c.bj) for t in parts}) == S * tiles  # own lines
        for t in parts:
            assert t.c.slot == SLOT_P and 0 <= t.c.r0 and t.c.r0 + t.c.rows <= pm and t.c.c0 + t.c.cols <= pn
        reds = tasks[S::S + 1]
        assert all(t.deps for t in reds) and len(reds) == tiles
        for red in reds:
            assert red.c.slot == SLOT_C and red.deps == tuple(range(red.tid - S, red.tid))
            ks = [st.a.bj if op_a == OP_N else st.a.bi for d in red.deps for st in tasks[d].steps]  # A's k tiles
            assert ks == list(range(tk))  # every k tile once, in order
            assert sum(st.k for d in red.deps for st in tasks[d].steps) == k
            assert [tasks[d].c for d in red.deps] == [st.a for st in red.steps]
            assert all((tasks[d].c.bi, tasks[d].c.c0 % n) == (red.c.bi, red.c.c0) for d in red.deps)


def test_split_plan_with_nothing_to_multiply_ignores_split():
    for kw in ({"alpha_zero": True}, {}):
        k = 0 if not kw else 64
        tasks = plan_gemm(8, 8, k, 4, OP_N, OP_N, beta_zero=False, split=4, **kw)
        assert [t.steps[0].kernel for t in tasks] == ["scale"] * 4 and not any(t.deps for t in tasks)


@pytest.mark.parametrize("split", [0, -1, 5, 2.0, None])
def test_split_out_of_range_is_rejected(split):
    with pytest.raises(ValueError, match=r"split: got .*need an int from 1 to 4 \(the k tiles\)"):
        plan_gemm(8, 8, 16, 4, OP_N, OP_N, split=split)


def test_partial_ref():
    assert partial_shape(5, 3, 4) == (5, 12)
    assert partial_ref(2, 1, 0, 5, 3, 4) == TileRef(SLOT_P, 1, 2, 4, 6, 1, 3)
    assert partial_ref(1, 0, 1, 8, 6, 4) == TileRef(SLOT_P, 0, 3, 0, 10, 4, 2)


def _execute(tasks, a, b, c, alpha, beta, S, order_seed=None):
    """Run a plan's tasks with the numpy tile kernels (C in its own type), partials in any order."""
    dt = c.dtype
    scalars = np.zeros(N_SCALARS, dtype=dt)
    scalars[SC_ALPHA], scalars[SC_BETA], scalars[SC_ONE] = alpha, beta, 1
    m, n = c.shape
    ops = [a, b, c, np.full(partial_shape(m, n, S), np.nan, dtype=dt, order="F")]
    view = lambda r: None if r is None else ops[r.slot][r.r0:r.r0 + r.rows, r.c0:r.c0 + r.cols]  # noqa: E731
    first = [t for t in tasks if not t.deps]
    if order_seed is not None:
        random.Random(order_seed).shuffle(first)
    for t in first + [t for t in tasks if t.deps]:
        buf = view(t.c).copy(order="F") if t.load_c else np.full((t.c.rows, t.c.cols), np.nan, dtype=dt, order="F")
        for st in t.steps:
            KERNELS[st.kernel](st, scalars, view(st.a), view(st.b), buf)
        view(t.c)[...] = buf
    return c


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_split_plan_executed_matches_numpy_and_is_order_independent(dtype, rand, rel_err):
    m, n, k, T = 9, 7, 70, 4
    for op_a, op_b, S, beta in ((OP_N, OP_N, 3, 0.0), (OP_T, OP_N, 5, 0.5), (OP_C, OP_T, 18, -1.0)):
        a = rand((m, k) if op_a == OP_N else (k, m), dtype, seed=1)
        b = rand((k, n) if op_b == OP_N else (n, k), dtype, seed=2)
        c0 = rand((m, n), dtype, seed=3)
        c0[0, 0] = np.nan if beta == 0 else c0[0, 0]  # beta 0: C is never read
        alpha = 1.5 - 0.5j if np.dtype(dtype).kind == "c" else 1.5
        tasks = plan_gemm(m, n, k, T, op_a, op_b, beta_zero=beta == 0, is_complex=np.dtype(dtype).kind == "c",
                          split=S)
        f = (lambda x: x, lambda x: x.T, lambda x: x.conj().T)
        wide = np.complex128
        ref = alpha * f[op_a](a.astype(wide)) @ f[op_b](b.astype(wide)) + (
            beta * np.nan_to_num(c0.astype(wide)) if beta else 0)
        runs = [_execute(tasks, a, b, c0.copy(order="F"), alpha, beta, S, seed) for seed in (None, 1, 2)]
        tol = 1e-5 if np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.complex64)) else 1e-12
        assert rel_err(runs[0], ref) < tol
        assert all(np.array_equal(runs[0], r) for r in runs[1:])


def test_add_kernel():
    st = lambda al, be: Step("add", None, None, OP_N, OP_N, 2, 2, 0, al, be)  # noqa: E731
    sc = np.array([3.0, 0.5, 0.0, 1.0, -1.0, 3.0])
    a = np.array([[1.0, 2.0], [3.0, 4.0]])
    c = np.full((2, 2), np.nan)
    KERNELS["add"](st(SC_ONE, SC_ZERO), sc, a, None, c)
    assert np.array_equal(c, a)  # beta 0: C not read
    KERNELS["add"](st(SC_ALPHA, SC_BETA), sc, a, None, c)
    assert np.array_equal(c, 3 * a + 0.5 * a)
    ci = np.array([[1, 2], [3, 4]], dtype=np.int32)
    KERNELS["add"](st(SC_ONE, SC_ONE), np.array([0, 0, 0, 1, -1, 0], dtype=np.int32), ci.copy(), None, ci)
    assert ci.dtype == np.int32 and np.array_equal(ci, [[2, 4], [6, 8]])


def test_mixed_call_keeps_partials_in_the_accumulation_type_at_home():
    tasks = plan_gemm(8, 8, 64, 4, OP_N, OP_N, split=4)
    stats = CallStats([DeviceInfo(0, "x", "sim")], keep_records=False)
    call = Call("gemm", [], tasks, np.float16, 1.0, 0.0, stats, out_dtype=np.float16)
    assert call.mixed and call.home_dtype(SLOT_P) == np.float32 and call.tile_dtype(SLOT_P) == np.float32
    assert call.home_dtype(SLOT_C) == np.float16 and call.tile_dtype(SLOT_C) == np.float32
    assert call.home_dtype(SLOT_A) == np.float16


# =========================================================================== the choice of S

def test_choose_split():
    big = 1 << 30
    kw = dict(streams=[4, 4], caches=[big, big], itemsize=4)
    # 64 x 64 C in one tile, k 313 tiles: one partial per stream of the two devices
    assert choose_split(64, 64, 20000, 64, **kw) == 8
    # X^T X, 1024 x 1024 C of 4 tiles of 512, 8 GPUs x 4 streams: 8 partials per tile
    assert choose_split(1024, 1024, 10 ** 7, 512, streams=[4] * 8, caches=[big] * 8, itemsize=4) == 8
    # 3 C tiles, 8 streams: ceil(8 / 3) = 3
    assert choose_split(48, 16, 4000, 16, **kw) == 3
    # each partial covers >= MIN_PART_TILES k tiles: k of 6 tiles gives 3 at most
    assert choose_split(16, 16, 96, 16, **kw) == 6 // MIN_PART_TILES == 3
    # partials take at most 1 / PARTIAL_SHARE of the smallest cache
    small = 2 * 64 * 64 * 4 * PARTIAL_SHARE
    assert choose_split(64, 64, 20000, 64, streams=[4, 4], caches=[big, small], itemsize=4) == 2


@pytest.mark.parametrize("case", [
    dict(m=64, n=64, k=20000, tile=64, streams=[], caches=[]),  # no stream device (the CPU alone)
    dict(m=64, n=64, k=20000, tile=64, streams=[1], caches=[1 << 30]),  # one stream: C's tile keeps it busy
    dict(m=256, n=256, k=20000, tile=64, streams=[4, 4], caches=[1 << 30] * 2),  # 16 C tiles >= 8 streams
    dict(m=64, n=64, k=3 * 64, tile=64, streams=[4, 4], caches=[1 << 30] * 2),  # k of 3 tiles: short
    dict(m=64, n=64, k=20000, tile=64, streams=[4, 4], caches=[1 << 16] * 2),  # no room for partials
])
def test_choose_split_keeps_one_task_per_tile(case):
    assert choose_split(case.pop("m"), case.pop("n"), case.pop("k"), case.pop("tile"), itemsize=4, **case) == 1


# =========================================================================== on the sim

def _tasks():
    return int(blasx.last_profile().totals()["tasks"])


def _ref(alpha, a, b, beta=0, c=None, ta=0, tb=0):
    wide = np.complex128 if np.iscomplexobj(a) else np.float64
    f = (lambda x: x, lambda x: x.T, lambda x: x.conj().T)
    r = alpha * (f[ta](a.astype(wide)) @ f[tb](b.astype(wide)))
    return r + beta * c.astype(wide) if c is not None and beta != 0 else r


@pytest.mark.parametrize("devices", ["sim:1", "sim:2", "sim:3"])
@pytest.mark.parametrize("dtype", FLOATS + REDUCED, ids=lambda d: np.dtype(d).name)
def test_tall_skinny_gemm_splits_and_is_right(devices, dtype, rand, rel_err):
    blasx.configure(devices=devices, tile=32)
    a, b = rand((40, 6000), dtype, seed=1), rand((6000, 24), dtype, seed=2)
    complex_ = np.dtype(dtype).kind == "c"
    alpha = 0.75 - 0.5j if complex_ else -1.25
    c = blasx.gemm(alpha, a, b)
    assert c.dtype == np.dtype(dtype)
    assert rel_err(c, _ref(alpha, a, b)) < TOL[np.dtype(dtype)]
    assert _tasks() > 2  # 2 C tiles, 4 streams a device: split


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("ta,tb", [(0, 0), (1, 0), (2, 1), (0, 2)])
def test_split_gemm_alpha_beta_ops(dtype, ta, tb, rand, rel_err):
    blasx.configure(devices="sim:2", tile=16)
    m, n, k = 20, 30, 600
    a = rand((m, k) if ta == 0 else (k, m), dtype, seed=1)
    b = rand((k, n) if tb == 0 else (n, k), dtype, seed=2)
    c = rand((m, n), dtype, seed=3)
    alpha, beta = (0.5 + 1j, -0.25 + 0.5j) if np.dtype(dtype).kind == "c" else (0.5, -2.0)
    out = blasx.gemm(alpha, a, b, beta=beta, c=c, trans_a=ta, trans_b=tb)
    assert rel_err(out, _ref(alpha, a, b, beta, c, ta, tb)) < TOL[np.dtype(dtype)]
    assert _tasks() > 4
    c[0, 0] = np.nan  # beta 0: C is never read
    out = blasx.gemm(alpha, a, b, beta=0.0, c=c, trans_a=ta, trans_b=tb)
    assert rel_err(out, _ref(alpha, a, b, ta=ta, tb=tb)) < TOL[np.dtype(dtype)]


def test_xtx_and_matmul(rand, rel_err):
    blasx.configure(devices="sim:2", tile=32)
    x = rand((6000, 64), np.float64, seed=4)
    assert rel_err(blasx.gemm(1.0, x, x, trans_a=1), x.T @ x) < 1e-12
    assert _tasks() > 4
    assert rel_err(blasx.matmul(x.T, x), x.T @ x) < 1e-12
    assert _tasks() > 4
    y = rand((64, 6000), np.float32, seed=5)
    assert rel_err(blasx.matmul(y, y.T), y.astype(np.float64) @ y.T.astype(np.float64)) < 1e-5


def test_reduced_types_out_dtype_and_int8(rand, rel_err):
    blasx.configure(devices="sim:2", tile=32)
    a, b = rand((40, 5000), np.float16, seed=1), rand((5000, 40), np.float16, seed=2)
    c = blasx.gemm(1.0, a, b, out_dtype=np.float32)
    assert c.dtype == np.float32 and rel_err(c, _ref(1.0, a, b)) < 1e-5
    assert _tasks() > 4
    rng = np.random.default_rng(0)
    i, j = rng.integers(-128, 128, (40, 5000), dtype=np.int8), rng.integers(-128, 128, (5000, 40), dtype=np.int8)
    r = blasx.gemm(3, i, j)
    assert r.dtype == np.int32 and np.array_equal(r, 3 * (i.astype(np.int64) @ j.astype(np.int64)))
    assert _tasks() > 4


def test_two_runs_are_bit_identical(rand):
    blasx.configure(devices="sim:2,speeds=1/3", tile=16)
    a, b = rand((30, 1600), np.float32, seed=1), rand((1600, 30), np.float32, seed=2)
    c = rand((30, 30), np.float32, seed=3)
    first = blasx.gemm(1.0, a, b, beta=0.5, c=c)
    assert _tasks() > 4
    for _ in range(3):
        assert np.array_equal(blasx.gemm(1.0, a, b, beta=0.5, c=c), first)
    blasx.configure(devices="sim:2", tile=16)  # other speeds, other schedule: the same bits
    assert np.array_equal(blasx.gemm(1.0, a, b, beta=0.5, c=c), first)


def test_knob_off_keeps_one_task_per_tile(monkeypatch, rand, rel_err):
    monkeypatch.setenv("BLASX_KNOBS", "split_k=0")
    blasx.configure(devices="sim:2", tile=32)
    a, b = rand((64, 3000), seed=1), rand((3000, 64), seed=2)
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12
    assert _tasks() == 4


def test_no_split_for_many_tiles_short_k_or_the_cpu(rand, rel_err):
    blasx.configure(devices="sim:2", tile=16)
    a, b = rand((96, 200), seed=1), rand((200, 96), seed=2)
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12 and _tasks() == 36  # 36 tiles >= 8 streams
    a, b = rand((16, 48), seed=1), rand((48, 16), seed=2)
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12 and _tasks() == 1  # 3 k tiles: too short
    blasx.configure(devices="cpu", tile=16)
    a, b = rand((16, 4000), seed=1), rand((4000, 16), seed=2)
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12 and _tasks() == 1


def test_cpu_worker_beside_a_sim(rand, rel_err):
    """The CPU worker by demand beside one sim: it may run partials and reductions whole."""
    blasx.configure(devices="sim:1", cpu=True, tile=32, streams=2)
    a, b = rand((64, 5000), seed=1), rand((5000, 64), seed=2)
    assert rel_err(blasx.gemm(2.0, a, b), 2.0 * a @ b) < 1e-12
    h = rand((64, 5000), np.float16, seed=3)
    assert rel_err(blasx.gemm(1.0, h, h, trans_b=1), _ref(1.0, h, h, tb=1)) < 3e-3


@pytest.mark.parametrize("phase,nth", [("compute", 5), ("writeback", 2), ("load", 30), ("compute", 150)])
def test_a_device_failing_mid_call_leaves_the_result_right(phase, nth, rand, rel_err, run_bounded):
    """sim:1 breaks at its nth kernel / partial write-back / load: its tasks go to sim:0, the
    reductions read the partials that were written home, the engine stays usable."""
    blasx.configure(devices="sim:2", tile=32)
    a, b = rand((64, 8000), seed=1), rand((8000, 64), seed=2)
    seen = []

    def hook(ph, dev, task):
        if ph == phase and dev is not None and dev.index == 1:
            seen.append(1)
            if len(seen) == nth:
                raise blasx.DeviceError(f"injected device error on sim:1 at {phase}")
    faults.install(hook)
    try:
        out = run_bounded(lambda: blasx.gemm(1.0, a, b))
    finally:
        faults.install(None)
    assert len(seen) >= nth
    assert "error" not in out, out.get("error")
    assert rel_err(out["value"], a @ b) < 1e-12
    eng = blasx.engine()
    assert [w.alive for w in eng.workers] == [True, False] and eng.leaks() == []
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12 and _tasks() > 4


def test_a_kernel_fault_then_every_device_failing(rand, rel_err, run_bounded):
    """A sim's injected kernel fault (``fail=``) moves its work to the other; with one sim that
    fails the call fails (DeviceError), and the next call on working devices is right."""
    a, b = rand((64, 8000), seed=1), rand((8000, 64), seed=2)
    blasx.configure(devices="sim:2,fail=0@4", tile=32)
    out = run_bounded(lambda: blasx.gemm(1.0, a, b))
    assert "error" not in out and rel_err(out["value"], a @ b) < 1e-12
    blasx.configure(devices="sim:1,fail=0@6", streams=2, tile=32)
    out = run_bounded(lambda: blasx.gemm(1.0, a, b))
    assert isinstance(out.get("error"), blasx.DeviceError) and "injected fault" in str(out["error"])
    blasx.configure(devices="sim:2", tile=32)
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12 and _tasks() > 4


@pytest.mark.parametrize("phase", ["compute", "writeback"])
def test_ctrl_c_cancels_cleanly(phase, rand, rel_err):
    """Ctrl-C while partials compute or are written home: KeyboardInterrupt reaches the caller,
    its arrays are untouched, nothing leaks, the next call is right."""
    blasx.configure(devices="sim:2", tile=32)
    a, b, c = rand((64, 6000), seed=1), rand((6000, 64), seed=2), rand((64, 64), seed=3)
    run = lambda: blasx.gemm(1.0, a, b, beta=0.5, c=c)  # noqa: E731
    ref = a @ b + 0.5 * c
    assert rel_err(run(), ref) < 1e-12  # warm
    copies = [x.copy() for x in (a, b, c)]
    main = threading.main_thread().ident
    fired = []

    def hook(ph, dev, task):
        if ph != phase or task is None or dispatch.running_call(main) is not task.call or fired:
            return
        fired.append(1)
        faults.interrupt(main)
        for _ in range(2000):  # hold until the caller cancelled the call
            if task.call.failed:
                break
            threading.Event().wait(0.005)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    faults.install(hook)
    try:
        with pytest.raises(KeyboardInterrupt):
            run()
    finally:
        faults.install(None)
        signal.signal(signal.SIGINT, old)
    assert fired
    for x, x0 in zip((a, b, c), copies):
        assert np.array_equal(x, x0)
    eng = blasx.engine()
    assert eng.leaks() == [] and all(w.alive for w in eng.workers)
    assert rel_err(run(), ref) < 1e-12


# =========================================================================== on GPUs (the lead runs these)

@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("dtype", FLOATS + REDUCED + (np.int8,), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("on_device", [False, True], ids=["host", "cupy"])
@pytest.mark.parametrize("devices", ["cuda", "cuda:0"])
def test_gpu_split_gemm(devices, on_device, dtype, rand, rel_err):
    import cupy
    blasx.configure(devices=devices, tile=512)
    rng = np.random.default_rng(0)
    if np.dtype(dtype) == np.int8:
        a, b = rng.integers(-128, 128, (256, 40000), dtype=np.int8), rng.integers(-128, 128, (40000, 256), dtype=np.int8)
        ref = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.int64)  # exact: |sum| < 2^53; BLAS-fast
    else:
        a, b = rand((256, 40000), dtype, seed=1), rand((40000, 256), dtype, seed=2)
        ref = _ref(1.0, a, b)
    xa, xb = (cupy.asarray(a), cupy.asarray(b)) if on_device else (a, b)
    c = blasx.gemm(1, xa, xb)
    assert _tasks() > 1
    got = cupy.asnumpy(c) if on_device else c
    if np.dtype(dtype) == np.int8:
        assert np.array_equal(got, ref)
    else:
        tol = max(TOL[np.dtype(dtype)], 1e-4 if np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.complex64)) else 0)
        assert rel_err(got, ref) < tol
    again = blasx.gemm(1, xa, xb)
    assert np.array_equal(cupy.asnumpy(again) if on_device else again, got)  # bit-identical


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU and CuPy")
def test_gpu_split_gemm_beta_and_xtx(rand, rel_err):
    blasx.configure(devices="cuda", tile=512)
    x = rand((200000, 512), np.float64, seed=4)
    c = rand((512, 512), np.float64, seed=5)
    out = blasx.gemm(2.0, x, x, beta=-0.5, c=c, trans_a=1)
    assert _tasks() > 1 and rel_err(out, 2.0 * x.T @ x - 0.5 * c) < 1e-12
