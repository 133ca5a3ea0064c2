"""The scheduler on simulated GPUs: demand-driven balance and stealing, the two-level
tile cache (exact hit counts where the schedule is deterministic, exact invariants
where it is not), read-only reuse across calls, out-of-core runs, many calling
threads, fail-over, thread hygiene, traces and the epilogue hook."""

from __future__ import annotations

import gc
import threading
import time
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import blasx
import blasx.dispatch
from blasx.operands import TokenTable, make_operand
from blasx.runtime.call import Call
from blasx.runtime.config import parse_devices, sim_factors
from blasx.runtime.devices.sim import SimDevice
from blasx.runtime.stats import CallStats, DeviceInfo
from blasx.runtime.plans import plan_gemm
from blasx.runtime.tiling import OP_N


def ceil_div(a, b):
    return -(-a // b)


@pytest.fixture
def planned(monkeypatch):
    """Records the task lists the front end plans, so tests can see which worker ran each task."""
    plans = []
    original = blasx.dispatch.plan_gemm

    def spy(*args, **kwargs):
        tasks = original(*args, **kwargs)
        plans.append(tasks)
        return tasks

    monkeypatch.setattr(blasx.dispatch, "plan_gemm", spy)
    return plans


def distinct_inputs(tasks, worker=None):
    """Distinct (operand slot, tile row, tile col) read by the tasks (of one worker)."""
    return {(r.slot, r.bi, r.bj) for t in tasks if worker is None or t.worker == worker
            for r in t.input_tiles()}


def lookups(tasks, worker=None):
    return sum(len(t.input_tiles()) for t in tasks if worker is None or t.worker == worker)


# =========================================================================== balance and stealing

@pytest.mark.slow
@pytest.mark.serial
def test_heterogeneous_devices_share_tasks_by_speed(rand, rel_err):
    """Demand-driven balance: each device's share of tasks is within 15% (relative) of its
    speed share (1/f_i) / sum_j (1/f_j). The simulated kernel time (6.5 ms per 32^3 step on a
    fast device) dominates the Python overhead, and one stream per device keeps the buffering
    (and so the end effect) small; 529 tasks."""
    spec = "sim:4,slow=4"
    factors = sim_factors(parse_devices(spec))
    assert factors == [1.0, 1.0, 1.0, 4.0]
    speed = [1 / f for f in factors]
    speed_share = [s / sum(speed) for s in speed]
    blasx.configure(devices=spec + ",rate=1e7", tile=32, streams=1)
    a, b = rand((23 * 32, 32)), rand((32, 23 * 32), seed=1)
    out = blasx.gemm(1.0, a, b)
    assert rel_err(out, a @ b) < 1e-12
    prof = blasx.last_profile()
    tasks = [prof.counters[i]["tasks"] for i in range(4)]
    assert sum(tasks) == 23 * 23
    shares = [t / sum(tasks) for t in tasks]
    for i, (got, want) in enumerate(zip(shares, speed_share)):
        assert abs(got - want) <= 0.15 * want, f"device {i}: share {got:.3f} vs speed share {want:.3f} ({tasks})"
    assert sum(prof.counters[i]["steals"] for i in range(4)) > 0


def test_every_task_runs_exactly_once(rand, planned):
    blasx.configure(devices="sim:3,speeds=1/2/3", tile=16)
    blasx.gemm(1.0, rand((100, 60)), rand((60, 90)))
    (tasks,) = planned
    prof = blasx.last_profile()
    assert all(t.worker in (0, 1, 2) for t in tasks)
    for d in range(3):
        assert prof.counters[d]["tasks"] == sum(t.worker == d for t in tasks)
        assert prof.counters[d]["steps"] == sum(len(t.steps) for t in tasks if t.worker == d)
    assert prof.totals()["tasks"] == len(tasks) == 7 * 6
    assert prof.totals()["flops"] == 2 * 100 * 60 * 90


# =========================================================================== L1 / L2 tile caches

def test_l1_hits_hand_computed_single_device(rand, rel_err):
    """One device, a cache that holds everything: each distinct tile misses once, every
    other look-up hits. C 37x19, K 48, T 16: 3x2 tasks of 3 steps, 2 look-ups per step =
    36 look-ups over 3x3 A tiles + 3x2 B tiles = 15 misses, 21 L1 hits."""
    T, m, n, k = 16, 37, 19, 48
    blasx.configure(devices="sim:1", tile=T)
    a, b, c = rand((m, k), seed=1), rand((k, n), seed=2), rand((m, n), seed=3)
    out = blasx.gemm(1.0, a, b, 2.0, c)
    assert rel_err(out, a @ b + 2.0 * c) < 1e-12
    t = blasx.last_profile().totals()
    assert (t["tasks"], t["steps"], t["misses"], t["l1_hits"], t["l2_hits"], t["evictions"]) == (6, 18, 15, 21, 0, 0)
    assert t["flops"] == 2 * m * n * k and t["steals"] == 0
    # every A, B and C element crosses the host link once; C is written back once
    assert t["bytes_h2d"] == (m * k + k * n + m * n) * 8
    assert t["bytes_d2h"] == m * n * 8 and t["bytes_p2p"] == 0
    dev = blasx.engine().devices[0]
    assert (dev.bytes_in, dev.bytes_out, dev.bytes_p2p) == (t["bytes_h2d"], t["bytes_d2h"], 0)


def test_one_stream_runs_tasks_one_at_a_time_in_plan_order(rand):
    blasx.configure(devices="sim:1", tile=8, streams=1)
    blasx.gemm(1.0, rand((24, 24)), rand((24, 24), seed=1))
    prof = blasx.last_profile()
    assert prof.totals()["misses"] == 9 + 9 and prof.totals()["l1_hits"] == 2 * 27 - 18
    kernels = sorted((r for r in prof.records if r.kind == "kernel"), key=lambda r: r.start)
    order = [r.task for r in kernels]
    assert order and order == sorted(order)  # task 0's steps, then task 1's, ...
    for r1, r2 in zip(kernels, kernels[1:]):  # never two kernels at once
        assert r1.end <= r2.start + 1e-9


@pytest.mark.parametrize("spec", ["sim:3", "sim:2,speeds=1/8", "sim:4,peers=0"])
def test_cache_counters_match_each_workers_tasks(spec, rand, planned):
    """Schedule-independent invariants: with no eviction, a worker misses (or copies from a
    peer) each distinct tile of its tasks exactly once and hits on every other look-up."""
    T = 16
    blasx.configure(devices=spec, tile=T)
    a, b = rand((8 * T, 6 * T)), rand((6 * T, 7 * T), seed=1)
    blasx.gemm(1.0, a, b)
    (tasks,) = planned
    prof = blasx.last_profile()
    tile_bytes = T * T * 8
    for d, c in prof.counters.items():
        mine = distinct_inputs(tasks, d)
        assert c["misses"] + c["l2_hits"] == len(mine), (d, c)
        assert c["l1_hits"] == lookups(tasks, d) - len(mine), (d, c)
        assert c["bytes_p2p"] == c["l2_hits"] * tile_bytes  # every tile is a full one here
        assert c["bytes_h2d"] == c["misses"] * tile_bytes
        dev = blasx.engine().devices[d]
        assert (dev.bytes_in, dev.bytes_p2p, dev.bytes_out) == (c["bytes_h2d"], c["bytes_p2p"], c["bytes_d2h"])


def test_l2_peer_copies_only_with_peer_links(rand, rel_err):
    """sim:1 is 8x slower, so sim:0 has long finished loading the tiles that sim:1's later
    tasks need: those come over the peer link (L2 hits). Without peer links, never."""
    a, b = rand((128, 128)), rand((128, 128), seed=1)
    results = {}
    for peers in ("1", "0"):
        blasx.configure(devices=f"sim:2,speeds=1/8,peers={peers}", tile=16)
        out = blasx.gemm(1.0, a, b)
        assert rel_err(out, a @ b) < 1e-12
        t = blasx.last_profile().totals()
        results[peers] = (t["l2_hits"], t["bytes_p2p"], [d.bytes_p2p for d in blasx.engine().devices])
        blasx.shutdown()
    l2, p2p, dev_p2p = results["1"]
    assert l2 > 0 and p2p == l2 * 16 * 16 * 8 and sum(dev_p2p) == p2p
    assert results["0"] == (0, 0, [0, 0])


# =========================================================================== reuse across calls

def test_read_only_operand_is_cached_across_calls(rand, rel_err):
    T = 16
    blasx.configure(devices="sim:1", tile=T)
    a = rand((4 * T, 3 * T))
    a.flags.writeable = False
    b1, b2 = rand((3 * T, 2 * T), seed=1), rand((3 * T, 2 * T), seed=2)
    n_a, n_b, n_lookups = 4 * 3, 3 * 2, 2 * (4 * 2 * 3)
    blasx.gemm(1.0, a, b1)
    first = blasx.last_profile().totals()
    assert (first["misses"], first["l1_hits"]) == (n_a + n_b, n_lookups - n_a - n_b)
    out = blasx.gemm(1.0, a, b2)
    assert rel_err(out, a @ b2) < 1e-12
    second = blasx.last_profile().totals()
    assert (second["misses"], second["l1_hits"]) == (n_b, n_lookups - n_b)  # all of A hits
    assert second["bytes_h2d"] == n_b * T * T * 8


def test_writable_operand_is_never_reused_across_calls(rand, rel_err):
    T = 16
    blasx.configure(devices="sim:1", tile=T)
    a, b = rand((4 * T, 3 * T)), rand((3 * T, 2 * T), seed=1)
    blasx.gemm(1.0, a, b)
    first = blasx.last_profile().totals()
    blasx.gemm(1.0, a, b)
    second = blasx.last_profile().totals()
    assert second["misses"] == first["misses"] == 4 * 3 + 3 * 2
    assert second["l1_hits"] == first["l1_hits"]
    # changed in place between calls: the result follows (no stale tile)
    a *= -3.0
    a[5, 7] = 42.0
    b[:, 1] += 1.0
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12
    # a read-only *view* of a writable array is not frozen: it may change under it
    v = a.view()
    v.flags.writeable = False
    assert rel_err(blasx.gemm(1.0, v, b), a @ b) < 1e-12
    a += 1.0
    assert rel_err(blasx.gemm(1.0, v, b), a @ b) < 1e-12


def test_a_new_read_only_array_never_sees_old_tiles(rand, rel_err):
    blasx.configure(devices="sim:2", tile=16)
    b = rand((48, 40), seed=9)
    for seed in range(4):  # same shape each time: freed memory is likely to be reused
        a = rand((64, 48), seed=seed)
        a.flags.writeable = False
        assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12
        del a
        gc.collect()


def test_a_read_only_array_seen_writable_again_drops_its_tiles(rand, rel_err):
    """Read-only, then writable (a call sees it so), rewritten through itself, read-only again: a new base, the
    old one's lines retired, the new values used. (With no call while writable blasx cannot see the write:
    usage.md states the promise.)"""
    from blasx.operands import READONLY
    blasx.configure(devices="sim:2", tile=16)
    a, b = rand((40, 40), seed=1), rand((40, 40), seed=2)
    a.flags.writeable = False
    blasx.gemm(1.0, a, b)
    old = READONLY.base_of(a)
    a.flags.writeable = True
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12
    a[...] = rand((40, 40), seed=3)
    a.flags.writeable = False
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12
    assert READONLY.base_of(a) != old and lines_of_base(blasx.engine().directory, old) == 0


def test_blasx_writing_a_read_only_arrays_memory_through_an_alias_drops_its_tiles(rand, rel_err):
    """c written in place through an alias whose base chain never reaches the read-only root (np.frombuffer
    of its buffer, ctypes): the root's tiles are retired by the write, not kept stale."""
    import ctypes
    blasx.configure(devices="sim:2", tile=16)
    n = 48
    eye = np.eye(n)
    eye.flags.writeable = False
    for how in ("frombuffer", "ctypes"):
        r = np.asfortranarray(rand((n, n), seed=4))
        if how == "frombuffer":
            alias = np.frombuffer(memoryview(r.reshape(-1, order="F")), dtype=r.dtype).reshape((n, n), order="F")
        else:
            alias = np.ctypeslib.as_array((ctypes.c_double * (n * n)).from_address(r.ctypes.data))
            alias = alias.reshape((n, n), order="F")
        r.flags.writeable = False
        blasx.gemm(1.0, r, eye)  # r's tiles cached for its life
        x, y = rand((n, n), seed=5), rand((n, n), seed=6)
        blasx.gemm(1.0, x, y, 0.0, alias, overwrite_c=True)  # blasx writes r's memory
        assert rel_err(r, x @ y) < 1e-12
        assert rel_err(blasx.gemm(1.0, r, eye), x @ y) < 1e-12


def test_a_read_only_array_over_bytes_is_not_cached_between_calls(rand, rel_err):
    """bytes are not immutable to numpy: unpickling gives a writable array over a bytes object, so a read-only
    array over the same bytes can change without a write blasx sees; its tiles live for one call only."""
    import pickle
    blasx.configure(devices="sim:2", tile=16)
    n = 48
    y = pickle.loads(pickle.dumps(rand((n, n), seed=8)))
    assert isinstance(y.base, bytes) and y.flags.writeable
    z = np.frombuffer(y.base, dtype=np.float64)[-n * n:].reshape(n, n)
    b = rand((n, n), seed=9)
    assert rel_err(blasx.gemm(1.0, z, b), z @ b) < 1e-12
    y += 1.0
    assert rel_err(blasx.gemm(1.0, z, b), np.array(z) @ b) < 1e-12


def test_front_end_writes_into_a_read_only_arrays_memory_drop_its_tiles(rand, rel_err):
    """The front ends' own writes into the caller's array (a strided c's copy-back, a cast into out, a k = 0
    fill, a mixed call's beta scaling) retire the read-only root it aliases, as the engine's writes do."""
    blasx.configure(devices="sim:2", tile=16, cache_bytes=1 << 20)
    n = 64
    eye = np.eye(n)
    eye.flags.writeable = False
    f = lambda *s: rand(s, seed=sum(s))  # noqa: E731
    writes = (
        (lambda r: r[::2, ::2], lambda w: blasx.gemm(1.0, f(32, 8), f(8, 32), 0.0, w, overwrite_c=True)),
        (lambda r: r[::2, ::2], lambda w: blasx.matmul(f(32, 8), f(8, 32), out=w)),
        (lambda r: r[::2, ::2], lambda w: blasx.matmul(f(32, 8), f(8, 32), out=(w,))),  # (numpy's tuple form)
        (lambda r: r[:32, :32], lambda w: blasx.matmul(f(32, 8).astype(np.float32), f(8, 32).astype(np.float32),
                                                       out=w)),
        (lambda r: r[:32, :32], lambda w: blasx.matmul(f(32, 0), f(0, 32), out=w)),
    )
    for alias, write in writes:
        r = np.asfortranarray(rand((n, n), seed=10))
        w = alias(r)
        r.flags.writeable = False
        assert rel_err(blasx.gemm(1.0, r, eye), r) < 1e-12  # r's tiles cached for its life
        write(w)
        assert rel_err(blasx.gemm(1.0, r, eye), np.array(r)) < 1e-12
    r16 = np.asfortranarray(rand((n, n), seed=11)).astype(np.float16)
    w16, e16 = r16[:32, :32], np.eye(n, dtype=np.float16)
    r16.flags.writeable = False
    blasx.matmul(r16, e16)
    blasx.gemm(0.0, f(32, 8).astype(np.float16), f(8, 32).astype(np.float16), 0.0, w16, overwrite_c=True)
    assert not blasx.matmul(r16, e16)[:32, :32].any()


def test_a_read_only_array_cached_while_another_thread_writes_it_is_dropped_after(rand, rel_err, monkeypatch):
    """A call caching a read-only root while a call of another thread writes its memory (through a view made
    before the flag was cleared): the writer retires the root again when it ends, so no stale tile outlives it."""
    from blasx import dispatch
    blasx.configure(devices="sim:2", tile=16)
    n = 48
    r = np.asfortranarray(rand((n, n), seed=7))
    v = r[:]
    r.flags.writeable = False
    eye = np.eye(n)
    x, y = rand((n, n), seed=8), rand((n, n), seed=9)
    real = dispatch._backends
    started, cached = threading.Event(), threading.Event()

    def backends(eng):  # the writer's call, paused after it started until the reader cached r
        if threading.current_thread().name == "writer":
            started.set()
            cached.wait(10)
        return real(eng)
    monkeypatch.setattr(dispatch, "_backends", backends)
    w = threading.Thread(target=lambda: blasx.gemm(1.0, x, y, 0.0, v, overwrite_c=True), name="writer")
    w.start()
    started.wait(10)
    blasx.gemm(1.0, r, eye)  # caches r (old values) while the writer is under way
    cached.set()
    w.join()
    assert rel_err(blasx.gemm(1.0, r, eye), x @ y) < 1e-12


def lines_of_base(directory, base: int, live_only: bool = True) -> int:
    """Cached lines of token base ``base`` on every device (dead ones too unless ``live_only``)."""
    return sum(1 for alru in directory.alrus for line in alru
               if line.key[0][0] == base and not (live_only and line.dead))


def test_collected_read_only_array_tiles_are_retired(rand):
    """Regression: READONLY.on_retire was never set, so lines of collected read-only arrays
    stayed live (listed, not evicted first) forever. The finalizer takes no lock: the base waits
    for the next call's submission, which retires it before planning."""
    from blasx.operands import READONLY

    blasx.configure(devices="sim:1", tile=16)
    a = rand((32, 32))
    a.flags.writeable = False
    blasx.gemm(1.0, a, rand((32, 32), seed=1))
    base = READONLY.base_of(a)
    eng = blasx.engine()
    assert lines_of_base(eng.directory, base) == 4
    del a
    gc.collect()
    assert list(eng._retired) == [base]
    blasx.gemm(1.0, rand((8, 8)), rand((8, 8), seed=1))
    assert lines_of_base(eng.directory, base) == 0 and not eng._retired


def test_retire_base_never_takes_the_directory_lock():
    """A finalizer's retire_base returns at once even while this thread holds the directory lock (no
    try-acquire either: an asynchronous exception right after a bare acquire would leak the lock); a
    call's own per-call tokens are retired by the time it returns."""
    blasx.configure(devices="sim:1", tile=16)
    eng = blasx.engine()
    a = np.ones((32, 32))
    blasx.gemm(1.0, a, a)  # (writable: per-call tokens)
    assert not eng._retired and eng.leaks() == []
    with eng.directory.lock:
        eng.retire_base(-12345)
    assert list(eng._retired) == [-12345]
    blasx.gemm(1.0, a, a)
    assert not eng._retired


def test_a_read_only_array_collected_under_the_directory_lock_is_retired_later(rand):
    """The retirement hook runs in whatever frame the collector frees the array, possibly one
    holding the directory lock in the same thread: it must not wait for the lock (a deadlock),
    and the lines die at the next call's submission instead."""
    from blasx.operands import READONLY

    blasx.configure(devices="sim:1", tile=16)
    a = rand((32, 32))
    a.flags.writeable = False
    a_cycle = [a]
    a_cycle.append(a_cycle)  # freed by the cyclic collector only
    blasx.gemm(1.0, a, rand((32, 32), seed=1))
    base = READONLY.base_of(a)
    eng = blasx.engine()
    del a
    with eng.directory.lock:  # as a worker holds it when the collector runs
        a_cycle.clear()
        gc.collect()  # the finalizer returns at once (a plain wait here would never end)
    assert lines_of_base(eng.directory, base) == 4
    blasx.gemm(1.0, rand((8, 8)), rand((8, 8), seed=1))
    assert lines_of_base(eng.directory, base) == 0


# =========================================================================== out of core

@pytest.mark.parametrize("beta", [0.0, -0.5])
def test_out_of_core(rand, rel_err, beta):
    """A + B + C is over 10x the 256 KiB tile cache of each device: tiles are evicted and
    reloaded, and the result is still right. 390 is not a multiple of 32: edge tiles of
    several sizes fragment the heap."""
    cache = 256 * 1024
    blasx.configure(devices="sim:2", tile=32, cache_bytes=cache)
    m = n = k = 390
    a, b, c = rand((m, k)), rand((k, n), seed=1), rand((m, n), seed=2)
    assert a.nbytes + b.nbytes + c.nbytes >= 10 * cache
    out = blasx.gemm(1.0, a, b, beta, c)
    assert rel_err(out, a @ b + beta * c) < 1e-12
    t = blasx.last_profile().totals()
    assert t["evictions"] > 0
    assert t["bytes_h2d"] > a.nbytes + b.nbytes  # some tiles were loaded more than once


# =========================================================================== many calling threads

def test_sixteen_threads_at_once(rand, rel_err, tol):
    blasx.configure(devices="sim:3", tile=16)
    dtypes = (np.float32, np.float64, np.complex64, np.complex128)
    start = threading.Barrier(16)

    def one(i):
        rng = np.random.default_rng(i)
        m, n, k = (int(x) for x in rng.integers(1, 90, size=3))
        dtype = dtypes[i % 4]
        ta, tb = i % 3, (i // 3) % 3
        a = rand((m, k) if ta == 0 else (k, m), dtype, seed=i, order="FC"[i % 2])
        b = rand((k, n) if tb == 0 else (n, k), dtype, seed=100 + i)
        c = rand((m, n), dtype, seed=200 + i)
        start.wait()
        out = blasx.gemm(2.0, a, b, 0.5, c, ta, tb)
        opa = (a, a.T, a.conj().T)[ta].astype(np.complex128)
        opb = (b, b.T, b.conj().T)[tb].astype(np.complex128)
        err = rel_err(out, 2.0 * opa @ opb + 0.5 * c)
        tasks = blasx.last_profile().totals()["tasks"]  # this thread's own profile
        split = blasx.dispatch.gemm_split(blasx.engine(), m, n, k, 16, dtype)  # split-k: partials, then reductions
        return err, tol(dtype), tasks, ceil_div(m, 16) * ceil_div(n, 16) * (split + 1 if split > 1 else 1)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    for i, (err, limit, tasks, want) in enumerate(results):
        assert err < limit, (i, err)
        assert tasks == want, (i, tasks, want)


# =========================================================================== failures

def _run_with_timeout(fn, timeout=30.0):
    """Run fn on a thread; return (result, exception, seconds). Fails if it hangs."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["exc"] = exc

    t0 = time.perf_counter()
    th = threading.Thread(target=target, name="test-caller", daemon=True)
    th.start()
    th.join(timeout)
    assert not th.is_alive(), f"call still running after {timeout} s"
    return box.get("result"), box.get("exc"), time.perf_counter() - t0


def test_fail_over_to_the_other_devices(rand, rel_err):
    blasx.configure(devices="sim:3,fail=1@3", tile=16)
    a, b = rand((128, 96)), rand((96, 112), seed=1)
    out, exc, _ = _run_with_timeout(lambda: blasx.gemm(1.0, a, b))
    assert exc is None, repr(exc)
    assert rel_err(out, a @ b) < 1e-12
    failures = blasx.engine().failures
    assert [name for name, _ in failures] == ["sim:1"]
    assert "injected fault" in repr(failures[0][1])  # the root cause, not a consequence
    # the engine keeps serving with the two live devices
    out = blasx.gemm(1.0, b.T, a.T)
    assert rel_err(out, (a @ b).T) < 1e-12
    assert blasx.last_profile().counters[1]["tasks"] == 0


def test_fail_over_with_beta_is_right_or_loud(rand, rel_err):
    """With beta != 0 a task whose write-back was in flight cannot be redone: the call may
    fail, but must never return a wrong C, nor hang."""
    a, b, c = rand((96, 64)), rand((64, 80), seed=1), rand((96, 80), seed=2)
    for fail_at in (2, 5, 9):
        blasx.configure(devices=f"sim:2,fail=0@{fail_at}", tile=16)
        out, exc, _ = _run_with_timeout(lambda: blasx.gemm(1.0, a, b, 1.0, c))
        if exc is None:
            assert rel_err(out, a @ b + c) < 1e-12
        else:
            assert isinstance(exc, blasx.DeviceError), repr(exc)
            assert "sim:0" in str(exc)
        blasx.shutdown()


def test_fail_over_of_a_new_result_from_the_callers_c_is_recomputed(rand, rel_err):
    """A new result that starts from the caller's c (scipy's dgemm, beta != 0, no overwrite; TRSM into a new X
    from B): a task cut short in its write-back is redone from c, which nobody writes: right, never an error."""
    from blasx.linalg import blas as bb
    a, b, c = rand((70, 60)), rand((60, 50), seed=1), np.asfortranarray(rand((70, 50), seed=2))
    t = np.triu(rand((70, 70), seed=3)) + 70 * np.eye(70)
    for fail_at in (3, 7, 11, 17, 23):
        blasx.configure(devices=f"sim:3,fail=0@{fail_at}", tile=16)
        out, exc, _ = _run_with_timeout(lambda: bb.dgemm(1.0, a, b, 0.5, c))
        assert exc is None, repr(exc)
        assert rel_err(out, a @ b + 0.5 * c) < 1e-12
        blasx.shutdown()
        blasx.configure(devices=f"sim:3,fail=0@{fail_at}", tile=16)
        out, exc, _ = _run_with_timeout(lambda: bb.dtrsm(1.0, t, c))
        assert exc is None, repr(exc)
        assert rel_err(t @ out, c) < 1e-12
        blasx.shutdown()


def test_fail_over_to_the_cpu_worker(rand, rel_err):
    """The CPU worker may take every task before the sim runs its 2nd kernel; repeat the call
    until the sim has failed (every result must be right, failed device or not)."""
    blasx.configure(devices="sim:1,fail=0@2", tile=16, cpu=True)
    a, b = rand((160, 70)), rand((70, 160), seed=1)
    for _ in range(200):  # (under load the CPU worker may win every task of several calls)
        out, exc, _ = _run_with_timeout(lambda: blasx.gemm(1.0, a, b))
        assert exc is None, repr(exc)
        assert rel_err(out, a @ b) < 1e-12
        if blasx.engine().failures:
            break
    assert [n for n, _ in blasx.engine().failures] == ["sim:0"]
    out = blasx.gemm(1.0, b, a)  # the CPU alone from now on
    assert rel_err(out, b @ a) < 1e-12
    assert blasx.last_profile().counters[0]["tasks"] == 0


def test_no_device_left_raises_with_the_worker_traceback(rand):
    blasx.configure(devices="sim:1,fail=0@2", tile=16)
    a, b = rand((64, 64)), rand((64, 64), seed=1)
    c = rand((64, 64), seed=2)
    _, exc, took = _run_with_timeout(lambda: blasx.gemm(1.0, a, b, 1.0, c))
    assert isinstance(exc, blasx.DeviceError), repr(exc)
    assert took < 30
    assert "sim:0" in str(exc)
    cause = exc.__cause__
    assert cause is not None
    text = "".join(traceback.format_exception(cause))
    assert "sim.py" in text and "injected fault at kernel" in text
    assert "worker.py" in text  # where the worker met the failure
    # a later call fails at once too, and shutdown does not hang
    _, exc2, took2 = _run_with_timeout(lambda: blasx.gemm(1.0, a, b))
    assert isinstance(exc2, blasx.DeviceError) and "no live device" in str(exc2)
    assert took2 < 5
    _, exc3, took3 = _run_with_timeout(blasx.shutdown, timeout=10)
    assert exc3 is None and took3 < 5
    assert _blasx_threads() == []  # the broken device's threads are gone too
    # a new engine works again
    blasx.configure(devices="sim:1", tile=16)
    out = blasx.gemm(1.0, a, b)
    np.testing.assert_allclose(out, a @ b, rtol=1e-12)


# =========================================================================== threads and traces

def _blasx_threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("blasx-"))


def test_no_threads_leak(rand):
    blasx.shutdown()
    before = set(threading.enumerate())
    for config in (dict(devices="sim:3", streams=2), dict(devices="sim:2", cpu=True), dict(devices="cpu")):
        blasx.configure(tile=16, **config)
        blasx.gemm(1.0, rand((50, 40)), rand((40, 30), seed=1))
        names = _blasx_threads()
        # the CPU alone runs calls in the calling thread (Engine.inline): no worker at all
        assert any(n.startswith("blasx-worker-") for n in names) == (config["devices"] != "cpu")
        blasx.shutdown()
        assert _blasx_threads() == []
    assert set(threading.enumerate()) == before


def test_shutdown_is_idempotent_and_restarts_lazily(rand, rel_err):
    blasx.configure(devices="sim:2", tile=16)
    eng = blasx.engine()
    blasx.shutdown()
    blasx.shutdown()
    assert eng.closed
    a, b = rand((20, 20)), rand((20, 20), seed=1)
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12
    assert blasx.engine() is not eng and blasx.engine().spec == "sim:2"


def test_trace_profile_and_chrome_trace(rand):
    blasx.configure(devices="sim:3", tile=16, trace=True)
    blasx.gemm(1.0, rand((128, 96)), rand((96, 128), seed=1))
    prof = blasx.last_profile()
    assert prof.records and prof.wall > 0
    assert {r.kind for r in prof.records} >= {"kernel", "h2d", "d2h"}
    trace = prof.to_chrome_trace()
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    ran = {d for d, c in prof.counters.items() if c["tasks"] > 0}
    assert ran and {e["pid"] for e in events} >= ran
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"sim:0", "sim:1", "sim:2"}
    bd = prof.breakdown()
    for row in bd:
        assert abs(row.busy + row.comm + row.idle - prof.wall) < 1e-6
    # the summary is JSON-ready and counts every look-up once
    s = prof.summary()
    assert abs(s["l1_hit_rate"] + s["l2_hit_rate"] + s["miss_rate"] - 1.0) < 1e-12


def test_no_trace_keeps_counters_only(rand):
    blasx.configure(devices="sim:2", tile=16, trace=False)
    blasx.gemm(1.0, rand((64, 64)), rand((64, 64), seed=1))
    prof = blasx.last_profile()
    assert prof.records == () and prof.totals()["tasks"] == 16


def test_profile_has_every_record_even_if_the_worker_is_descheduled(rand, monkeypatch):
    """Regression, deterministic form of a race: StreamWorker.retire used to complete the call
    before handing the device's last OpRecords to the stats; a worker paused in between (as a
    descheduled thread would be) made the caller's profile miss them."""
    original = SimDevice.take_records

    def late(self):
        time.sleep(0.05)
        return original(self)

    monkeypatch.setattr(SimDevice, "take_records", late)
    blasx.configure(devices="sim:1", tile=16, streams=1)
    blasx.gemm(1.0, rand((32, 32)), rand((32, 32), seed=1))
    prof = blasx.last_profile()
    assert sum(r.kind == "kernel" for r in prof.records) == prof.totals()["steps"] == 8


def test_records_left_with_a_device_do_not_keep_a_calls_arrays(rand, monkeypatch):
    """Regression: a device's timing records still open when a call ended held their tasks, and so
    the call and its arrays, until the next call; a result from the page-locked pool then could not
    return to it, and the next large result paid a fresh allocation. Records hold the collector only."""
    monkeypatch.setattr(SimDevice, "take_records", lambda self: [])  # every record stays with the device
    blasx.configure(devices="sim:1", tile=16, streams=1)
    a, b = rand((32, 32)), rand((32, 32), seed=1)
    result = blasx.gemm(1.0, a, b)
    alive = weakref.ref(result)
    del result
    gc.collect()
    assert alive() is None


def test_a_finished_call_leaves_no_cycle_holding_its_arrays(rand):
    """Regression: tasks refer to their call and the call to its tasks, so a finished call and the caller's
    arrays were freed only by the cyclic garbage collector, at some later allocation (on GPU engines a
    result's page-locked buffer missed the next call). Dispatch drops a completed call's tasks."""
    blasx.configure(devices="sim:2", tile=16)
    a, b = rand((64, 64)), rand((64, 64), seed=1)
    gc.collect()
    gc.disable()
    try:
        result = blasx.gemm(1.0, a, b)
        alive = [weakref.ref(result), weakref.ref(a)]
        del result, a
        assert [w() for w in alive] == [None, None]
    finally:
        gc.enable()


# =========================================================================== epilogue hook

def _gemm_with_epilogue(a, b, tile, epilogue):
    """What blasx.gemm does, with an epilogue: F-ordered a (m x k), b (k x n), beta = 0."""
    eng = blasx.engine()
    m, k = a.shape
    n = b.shape[1]
    out = np.empty((m, n), order="F")
    tokens = TokenTable(tile)
    operands = [make_operand(x, tokens) for x in (a, b, out)]
    tasks = plan_gemm(m, n, k, tile, OP_N, OP_N)
    stats = CallStats([DeviceInfo(d.index, d.name, d.kind) for d in eng.devices])
    eng.submit(Call("gemm", operands, tasks, np.float64, 1.0, 0.0, stats, epilogue=epilogue))
    return out, tasks


def test_epilogue_runs_on_every_tile_before_write_back(rand):
    a, b = rand((70, 40)), rand((40, 50), seed=1)
    relu = np.maximum(a @ b, 0)

    blasx.configure(devices="sim:2", tile=16)
    seen = []

    def on_stream(dev, s, c_loc, task):  # sim: enqueue behind the task's kernels on its stream
        seen.append(task.tid)
        dev.streams[s].submit(lambda: np.maximum(c_loc, 0, out=c_loc))

    out, tasks = _gemm_with_epilogue(a, b, 16, on_stream)
    np.testing.assert_allclose(out, relu, rtol=1e-12, atol=1e-12)
    assert sorted(seen) == [t.tid for t in tasks]
    blasx.shutdown()

    blasx.configure(devices="cpu", tile=32)

    def on_host(dev, s, acc, task):  # cpu: called with the finished tile, synchronously
        np.maximum(acc, 0, out=acc)

    out, _ = _gemm_with_epilogue(a, b, 32, on_host)
    np.testing.assert_allclose(out, relu, rtol=1e-12, atol=1e-12)


# =========================================================================== engine-internal regressions

def test_failed_worker_releases_its_reads_of_peer_lines():
    """Regression, unit form (no threads started): worker 0 has an L2 copy from device 1's line
    in flight when it breaks. StreamWorker.held_tasks used to drop its pending events without
    releasing those reads: after ``sim:2,fail=0@K`` calls, dozens of device 1's lines kept
    readers == 1 with no work left, and could never be evicted."""
    from blasx.runtime.cache import Line
    from blasx.runtime.engine import Engine, EngineConfig
    from blasx.runtime.worker import StreamWorker, _Pending

    devs = [SimDevice(i, nstreams=1, cache_bytes=1 << 16, name=f"sim:{i}", trace=False) for i in range(2)]
    eng = Engine(EngineConfig(devices=devs))
    w0 = StreamWorker(eng, devs[0], eng.stations[0])
    key = ((-1, 0, 8, 8, 8, "<f8", 8), 0, 0)
    peer_line, own_line = Line(key, 1, 0, 512, 8, 8), Line(key, 0, 0, 512, 8, 8)
    with eng.directory.lock:
        eng.directory.add(peer_line)
        eng.directory.add(own_line)
        peer_line.readers = own_line.readers = 1  # read by worker 0's copy, not yet retired
    w0.pending[0].append(_Pending(object(), 1, release=(own_line, peer_line), ready=(own_line,)))
    w0.held_tasks()
    assert own_line.key not in eng.directory.alrus[0]  # the broken device's lines are dropped
    assert peer_line.readers == 0  # ... and its reads of device 1's line are over


def test_sim_waiting_for_a_peer_fill_does_not_hold_the_copy_engine():
    """Regression (a hang seen with plain ``sim:2``, 128x128 gemm, tile 16, after ~15-60 calls,
    while the sim waited for a peer's fill inside its p2p engine lock): dev1 stream 1 copies
    after E0 (dev0's fill); E0 comes after E1 (dev1's fill on stream 0); E1 is behind a p2p copy
    on dev1 stream 0. Every wait targets an event recorded before it, so this must finish, as
    it would on GPUs (cudaStreamWaitEvent blocks the stream, not the copy engine)."""
    from types import SimpleNamespace

    from blasx.runtime.devices.base import PeerSource
    from blasx.runtime.tiling import TileRef

    devs = [SimDevice(i, nstreams=2, cache_bytes=1 << 16, name=f"sim:{i}", trace=False) for i in range(2)]
    for d in devs:
        d.open()
    d0, d1 = devs
    f8 = np.float64
    home = (SimpleNamespace(array=np.ones((4, 4))), TileRef(0, 0, 0, 0, 0, 4, 4))
    gate = threading.Event()
    finished = False
    try:
        d1.streams[0].submit(lambda: gate.wait(10))  # stream 0 of dev1 is busy (a long kernel)
        d1.copy_in(0, d1.arena_loc(0, 4, 4, f8), PeerSource(d0, d0.arena_loc(0, 4, 4, f8), None, *home), 4, 4, f8)
        e1 = d1.record(0)  # dev1's fill of line X
        d0.copy_in(0, d0.arena_loc(256, 4, 4, f8), PeerSource(d1, d1.arena_loc(0, 4, 4, f8), e1, *home), 4, 4, f8)
        e0 = d0.record(0)  # dev0's fill of line Y, from X in flight
        d1.copy_in(1, d1.arena_loc(256, 4, 4, f8), PeerSource(d0, d0.arena_loc(256, 4, 4, f8), e0, *home), 4, 4, f8)
        e2 = d1.record(1)  # dev1 copies Y in flight
        time.sleep(0.2)
        gate.set()
        finished = e2._flag.wait(3)
    finally:
        gate.set()
        if not finished:  # break the cycle so the stream threads can end
            d0.error = RuntimeError("test: breaking a deadlock")
        for d in devs:
            d.close()
    assert finished


def test_sim_device_keeps_its_first_error():
    """Regression: a stream op failing *because* the device broke (a wait on its own event)
    used to overwrite the device's error, so the injected fault vanished from the reports."""
    from types import SimpleNamespace

    dev = SimDevice(0, nstreams=2, cache_bytes=1 << 16, name="sim:0", fail_at=1, trace=False)
    dev.open()
    gate = threading.Event()
    try:
        dev.streams[1].submit(lambda: gate.wait(10))
        step = plan_gemm(2, 2, 2, 2, OP_N, OP_N)[0].steps[0]
        dev.run_step(1, step, SimpleNamespace(step_flops=lambda st: 0.0, scalars=None), None, None, None)
        ev = dev.record(1)  # never fires: the kernel before it fails
        dev.wait(0, ev)  # stream 0 waits for it, then gives up because the device broke
        gate.set()
        deadline = time.monotonic() + 5
        while dev.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # give the waiting stream time to notice the failure
    finally:
        gate.set()
        dev.close()
    assert "injected fault at kernel 1" in repr(dev.error)


def test_worker_does_not_sleep_while_tasks_are_queued():
    """Deterministic form of a hang seen in ~1 of 30-60 ``sim:2,fail=0@5`` calls with beta != 0:
    the failed worker re-queues its station's tasks, then fails the call on a write-back. The
    live worker's station is full, so fill_station pulls nothing; assign cancels the station's
    tasks (their call failed); with no slot busy and nothing pending the loop sleeps, while
    the re-queued tasks (and the call's untouched ones) wait in the queue forever."""
    from blasx.runtime.engine import Engine, EngineConfig

    dev = SimDevice(0, nstreams=1, cache_bytes=1 << 16, name="sim:0", trace=False)
    eng = Engine(EngineConfig(devices=[dev], streams=1))
    tokens = TokenTable(2)
    operands = [make_operand(np.ones((4, 4), order="F"), tokens) for _ in range(3)]
    tasks = plan_gemm(4, 4, 4, 2, OP_N, OP_N)
    call = Call("gemm", operands, tasks, np.float64, 1.0, 0.0, CallStats([DeviceInfo(0, "sim:0", "sim")]))
    call.fail(RuntimeError("failed on another device"))
    eng.stations[0].push(tasks[0])  # a full station (capacity 1)
    eng.queues["any"].put_many(tasks[1:])
    eng.start()
    try:
        completed = call.wait(2)
    finally:
        eng._poke()  # unstick the worker so that shutdown can join it
        eng.shutdown()
    assert completed


def test_retire_loses_no_completed_entry_when_the_device_breaks():
    """Deterministic form: stream 0's oldest event is done (task 0 finished, it read device 1's
    line); stream 1's is not, and the device is broken, so done() raises there. Task 0 must
    be accounted (or handed over) and its read of the peer line released. End to end, after
    ``sim:3,fail=1@3`` calls ~1 in 3 runs left lines of live devices pinned (readers == 1)."""
    from blasx.runtime.cache import Line
    from blasx.runtime.devices.base import DeviceError
    from blasx.runtime.devices.sim import SimEvent
    from blasx.runtime.engine import Engine, EngineConfig
    from blasx.runtime.worker import StreamWorker, _Pending

    devs = [SimDevice(i, nstreams=2, cache_bytes=1 << 16, name=f"sim:{i}", trace=False) for i in range(2)]
    eng = Engine(EngineConfig(devices=devs))
    w0 = StreamWorker(eng, devs[0], eng.stations[0])
    tokens = TokenTable(2)
    operands = [make_operand(np.ones((4, 4), order="F"), tokens) for _ in range(3)]
    tasks = plan_gemm(4, 4, 2, 2, OP_N, OP_N)
    call = Call("gemm", operands, tasks, np.float64, 1.0, 0.0,
                CallStats([DeviceInfo(i, d.name, "sim") for i, d in enumerate(devs)]))
    peer_line = Line((call.tokens[0], 0, 0), 1, 0, 32, 2, 2)
    with eng.directory.lock:
        eng.directory.add(peer_line)
        peer_line.readers = 1  # task 0's copy from device 1
    done_ev, stuck_ev = SimEvent(devs[0]), SimEvent(devs[0])
    done_ev._flag.set()
    w0.inflight, w0.inflight_of = 2, {call: 2}
    w0.pending[0].append(_Pending(done_ev, 1, release=(peer_line,), task=tasks[0], finished=True, writeback=True))
    w0.pending[1].append(_Pending(stuck_ev, 2, task=tasks[1], finished=True, writeback=True))
    devs[0].error = RuntimeError("broken")
    with pytest.raises(DeviceError):
        w0.retire()
    held = [t.tid for t, _ in w0.held_tasks()]  # what Worker.fail hands to the engine
    assert 1 in held
    assert call.remaining == len(tasks) - 1 or 0 in held  # task 0: accounted, or handed over
    assert peer_line.readers == 0


@pytest.mark.parametrize("config", [dict(devices="sim:1,fail=0@0", cpu=True), dict(devices="cpu", tile=16)],
                         ids=["cpu-worker-thread", "cpu-only-inline"])
def test_cpu_worker_task_that_raises_fails_the_call_not_hangs(config, rand, monkeypatch):
    """A task raising on the CPU (C written in place) fails the call loudly with its own error,
    within a bounded time, and breaks no device (it is the call's error, not a device error):
    in the CPU worker thread once the only other device has failed (its tasks are handed to
    the CPU), and in the calling thread when the CPU is the only device (``Engine.inline``; a
    configured tile makes several tasks). The next call runs."""
    from blasx.runtime.devices import cpu as cpu_mod

    def boom(self, task):
        raise FloatingPointError("injected CPU task failure")

    monkeypatch.setattr(cpu_mod.CpuDevice, "run_task", boom)
    blasx.configure(**config)
    a, b = rand((64, 48)), rand((48, 40), seed=1)
    _, exc, took = _run_with_timeout(lambda: blasx.gemm(1.0, a, b))
    assert isinstance(exc, FloatingPointError) and "injected CPU task failure" in str(exc), repr(exc)
    assert took < 30
    monkeypatch.undo()
    assert np.allclose(blasx.gemm(1.0, a, b), a @ b)


@pytest.mark.parametrize("spec, want", [("sim:2", [2, 2]), ("sim:3", [1, 1, 2])])
def test_a_small_call_is_shared_by_every_device(spec, want, rand, rel_err):
    """4 tasks, 4 streams a device: the first worker to wake could hold them all (it did, on
    2 H200s at N=4096 and 8192); the fair-share rule (``Worker._leave_for_peer``) leaves each
    device its share, max(1, floor(tasks / devices)), every time."""
    blasx.configure(devices=spec + ",rate=1e7", tile=32, streams=4)
    a, b = rand((64, 50)), rand((50, 64), seed=1)
    for _ in range(8):
        out = blasx.gemm(1.0, a, b)
        assert rel_err(out, a @ b) < 1e-12
        prof = blasx.last_profile()
        assert sorted(prof.counters[i]["tasks"] for i in range(len(want))) == want


def test_peer_fill_sooner_compares_host_bytes_ahead():
    """``StreamWorker._peer_fill_sooner``: wait for a peer's in-flight host load only if the host
    bytes still ahead of it on the peer's link (its fill mark minus the peer's retired bytes)
    are at most those a load issued here now would wait behind (this device's backlog plus
    the tile). Exact values on two workers' counters."""
    from blasx.runtime.cache import Line
    from blasx.runtime.engine import Engine, EngineConfig
    from blasx.runtime.worker import StreamWorker

    devs = [SimDevice(i, nstreams=2, cache_bytes=1 << 16, name=f"sim:{i}", trace=False) for i in range(2)]
    eng = Engine(EngineConfig(devices=devs))
    eng.workers = [StreamWorker(eng, d, st) for d, st in zip(devs, eng.stations)]
    me, peer = eng.workers
    line = Line(("t", 0, 0), 1, 0, 100, 5, 5)  # 100 bytes, held by device 1
    line.fill_mark = 1000  # the peer's link is done with it once it has moved 1000 bytes
    peer.h2d_done = 700  # 300 bytes ahead of it there
    me.h2d_issued, me.h2d_done = 500, 300  # 200 queued here + 100 for the tile = 300: a tie waits
    assert me._peer_fill_sooner(line)
    me.h2d_done = 301  # 199 + 100 < 300: load it here
    assert not me._peer_fill_sooner(line)
    peer.h2d_done = 800
    assert me._peer_fill_sooner(line)
    line.fill_mark = None  # filled over a peer link: nothing on a host link ahead of it
    peer.h2d_done = 0
    assert me._peer_fill_sooner(line)


def test_h2d_backlog_counts_every_host_load_and_drains_to_zero(rand, rel_err):
    """After a call, every host byte a worker issued is retired (the backlog its peers read is 0),
    and the bytes issued equal the call's H2D counter."""
    blasx.configure(devices="sim:2", tile=16, streams=2)
    a, b, c = rand((70, 50)), rand((50, 60), seed=1), rand((70, 60), seed=2)
    out = blasx.gemm(1.0, a, b, 0.5, c)
    assert rel_err(out, a @ b + 0.5 * c) < 1e-12
    eng = blasx.session.engine()
    prof = blasx.last_profile()
    for w in eng.workers:
        assert w.h2d_done == w.h2d_issued == prof.counters[w.idx]["bytes_h2d"]


def test_abandon_lost_hands_back_a_waiter_whose_dependency_went_back_to_the_queue():
    """Deterministic form of ``StreamWorker._abandon_lost``: a gated TRSM task sits on a stream,
    waiting at its first gate for a task that was started and then handed back (its device
    failed). The waiter gives its stream up: it goes to the front of the queue, unstarted,
    the worker's in-flight counts drop, and its buffers are freed after the work already issued."""
    from blasx.runtime.engine import Engine, EngineConfig
    from blasx.runtime.plans import plan_trsm
    from blasx.runtime.worker import StreamWorker, _Active

    dev = SimDevice(0, nstreams=2, cache_bytes=1 << 16, name="sim:0", trace=False)
    eng = Engine(EngineConfig(devices=[dev], streams=2))
    w = StreamWorker(eng, dev, eng.stations[0])
    dev.open()
    try:
        tokens = TokenTable(2)
        operands = [make_operand(np.eye(4, order="F") + 1.0, tokens) for _ in range(3)]
        tasks = plan_trsm(4, 2, 2, 0, 1, 0, 0)  # left, lower: block row 1 waits for block row 0
        call = Call("trsm", operands, tasks, np.float64, 1.0, 0.0, CallStats([DeviceInfo(0, "sim:0", "sim")]))
        dep, waiter = tasks[0], tasks[1]
        assert waiter.gates and waiter.gates[0] == (dep.tid,)
        call.started(dep)
        call.started(waiter)
        w.slots[0] = _Active(waiter, waiter.steps)
        w.inflight, w.inflight_of = 1, {call: 1}
        assert not w._abandon_lost()  # the dependency is running: keep waiting
        call.unstarted(dep)  # its device failed: it went back to the queue
        assert w._abandon_lost()
        assert w.slots[0] is None and w.inflight == 0 and w.inflight_of == {}
        assert eng.queues["any"].peek() is waiter and waiter.worker == -1
        assert not call.is_startable(waiter)  # it waits for dep to start again
        assert len(w.pending[0]) == 1  # one event ends the issued work before the buffers go
    finally:
        dev.close()


def test_fair_share_counts_stream_devices_only():
    """``Worker._leave_for_peer`` on constructed workers (2 sims + the CPU worker, none started):
    a sim holding its share leaves the rest to the other sim while that one has room and holds
    less, never to the CPU worker (~100x slower per tile on a GPU server); the CPU worker never
    leaves work."""
    from blasx.runtime.devices.cpu import CpuDevice
    from blasx.runtime.engine import Engine, EngineConfig
    from blasx.runtime.worker import CpuWorker, StreamWorker

    devs = [SimDevice(i, nstreams=4, cache_bytes=1 << 16, name=f"sim:{i}", trace=False) for i in range(2)]
    devs.append(CpuDevice(2))
    eng = Engine(EngineConfig(devices=devs, streams=4))
    eng.workers = [StreamWorker(eng, devs[0], eng.stations[0]), StreamWorker(eng, devs[1], eng.stations[1]),
                   CpuWorker(eng, devs[2], eng.stations[2])]
    s0, s1, cpu = eng.workers
    tokens = TokenTable(2)
    operands = [make_operand(np.ones((4, 4), order="F"), tokens) for _ in range(3)]
    tasks = plan_gemm(4, 4, 4, 2, OP_N, OP_N)  # 4 tasks: share 4 // 2 sims = 2
    call = Call("gemm", operands, tasks, np.float64, 1.0, 0.0, CallStats([DeviceInfo(i, "d", "sim") for i in range(3)]))
    eng.stations[0].push(tasks[0])
    assert not s0._leave_for_peer(call)  # holds 1 < 2
    eng.stations[0].push(tasks[1])
    assert s0._leave_for_peer(call)  # holds 2, sim 1 has room and holds 0
    eng.stations[1].push(tasks[2])
    eng.stations[1].push(tasks[3])
    assert not s0._leave_for_peer(call)  # sim 1 holds its share too; the CPU worker does not count
    assert not cpu._leave_for_peer(call)
    for t in eng.stations[1].drain():
        pass
    s1.alive = False  # a dead peer cannot take anything
    assert not s0._leave_for_peer(call)


@pytest.mark.parametrize("lines", [4, 5])
def test_line_homes_leave_a_line_for_its_device(lines):
    """``Worker._leave_for_home`` (``Knobs.line_homes``) on constructed workers (2 sims, none started): an
    in-place TRMM task of line j of 4 belongs to sim j * 2 // 4; another sim leaves it at the queue's head while
    that one is alive with room and the asker holds a task it can run; never with more than two lines a
    device (5), nor with the knob off."""
    from blasx.runtime.engine import Engine, EngineConfig
    from blasx.runtime.knobs import Knobs
    from blasx.runtime.plans import plan_trmm
    from blasx.runtime.worker import StreamWorker

    def engine(on):
        devs = [SimDevice(i, nstreams=2, cache_bytes=1 << 16, name=f"sim:{i}", trace=False) for i in range(2)]
        eng = Engine(EngineConfig(devices=devs, streams=2, knobs=Knobs(line_homes=on)))
        eng.workers = [StreamWorker(eng, devs[i], eng.stations[i]) for i in range(2)]
        return eng
    n = 2 * lines
    tasks = plan_trmm(n, n, 2, 0, 1, OP_N, 0, in_place=True)  # lower, left: lines are B's columns
    assert {t.line for t in tasks} == {(j, lines) for j in range(lines)}
    tokens = TokenTable(2)
    operands = [make_operand(np.ones((n, n), order="F"), tokens) for _ in range(3)]
    Call("trmm", operands, tasks, np.float64, 1.0, 0.0, CallStats([DeviceInfo(i, "d", "sim") for i in range(2)]))
    first = [t for t in tasks if not t.deps]  # the first level: runnable at once
    mine, theirs = (next(t for t in first if t.line[0] == j) for j in (0, lines - 1))
    eng = engine(True)
    s0, s1 = eng.workers
    assert not s0._leave_for_home(theirs)  # nothing runnable held: it takes the head
    eng.stations[0].push(mine)
    assert s0._leave_for_home(theirs) == (lines == 4) and not s0._leave_for_home(mine)
    while eng.stations[1].free_slots() > 0:
        eng.stations[1].push(theirs)
    assert not s0._leave_for_home(theirs)  # its home has no room
    eng.stations[1].drain()
    s1.alive = False  # a dead home cannot take it
    assert not s0._leave_for_home(theirs)
    eng = engine(False)
    eng.stations[0].push(mine)
    assert not eng.workers[0]._leave_for_home(theirs)
