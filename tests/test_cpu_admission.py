"""The CPU worker beside GPUs in auto mode (issue 5, ``runtime/admission.py``): the admission rule
by exact values, the rate meter, the worker's use of them on constructed workers, and whole calls
on sims: slow sims give the CPU a share, fast ones (and a slow CPU) give it none, calls with
dependencies and small calls never wait on it, a failed GPU leaves it the work, threads end.
Nothing here is timed: the sims are made 50x slower (or the CPU 1e5x slower) than needed."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest
import scipy.linalg.blas as sblas

import blasx
from blasx import operands as _operands
from blasx import session
from blasx.operands import TokenTable, make_operand
from blasx.perfdb import key_for
from blasx.runtime import admission as A
from blasx.runtime.call import Call, Operand
from blasx.runtime.config import parse_devices
from blasx.runtime.devices.cpu import CpuDevice
from blasx.runtime.devices.sim import SimDevice, build_sim_devices
from blasx.runtime.engine import Engine, EngineConfig
from blasx.runtime.stats import CallStats, DeviceInfo
from blasx.runtime.plans import plan_gemm
from blasx.runtime.tiling import OP_N
from blasx.runtime.worker import CpuWorker, StreamWorker

SLOW_SIMS = "sim:2,rate=1e8"  # ~0.7e8 flop/s measured per sim; numpy here: ~1e10-1e11


def cpu_tasks(profile=None) -> int:
    p = (profile or blasx.last_profile()).summary()
    return sum(d["tasks"] for d in p["devices"] if d["kind"] == "cpu")


# =========================================================================== the rule, by value

def test_decide_reasons_in_order():
    d = A.decide
    # No GPU can run the call: the CPU takes it, whatever else holds.
    assert d(8.0, 1, True, 0, None, [], 0.0, 0.0) == A.Decision(True, A.ALONE)
    assert d(8.0, 1, True, 0, None, [], 0.0, 0.0, registering=True) == A.Decision(True, A.ALONE)
    assert d(8.0, 100, True, 16, 1.0, [1.0], 800.0, 0.0, registering=True) == A.Decision(False, A.REGISTERING)
    assert d(8.0, 100, True, 16, 1.0, [1.0], 800.0, 0.0) == A.Decision(False, A.DEPS)
    assert d(8.0, 16, False, 16, 1.0, [1.0], 800.0, 0.0) == A.Decision(False, A.SMALL)
    assert d(8.0, 17, False, 16, 1.0, [None, None], 800.0, 0.0) == A.Decision(False, A.NO_GPU_RATE)
    assert d(8.0, 17, False, 16, None, [1.0, None], 800.0, 0.0) == A.Decision(False, A.NO_CPU_RATE)
    assert d(8.0, 17, False, 16, 0.0, [1.0], 800.0, 0.0) == A.Decision(False, A.NO_CPU_RATE)


def test_decide_compares_the_two_finish_times():
    # cpu_s = 1.5 * 4 / 2 = 3; gpu_s = (16 - 4 + 0.5 * 8) / (2 + 2) = 4 (the unknown GPU counts as the fastest)
    assert A.decide(4.0, 20, False, 16, 2.0, [2.0, None], 16.0, 8.0) == A.Decision(True, A.SOONER, 3.0, 4.0)
    # Faster GPUs: gpu_s = (16 - 4) / (4 + 2) = 2 < 3.
    assert A.decide(4.0, 20, False, 16, 2.0, [4.0, 2.0], 16.0, 0.0) == A.Decision(False, A.LATER, 3.0, 2.0)
    # Equal is not sooner: gpu_s = (16 - 4 + 0.5 * 0) / 4 = 3.
    assert A.decide(4.0, 20, False, 16, 2.0, [2.0, 2.0], 16.0, 0.0) == A.Decision(False, A.LATER, 3.0, 3.0)
    # Margin and running share are parameters: margin 1 -> cpu_s 2 < 3.
    assert A.decide(4.0, 20, False, 16, 2.0, [2.0, 2.0], 16.0, 0.0, margin=1.0) == A.Decision(True, A.SOONER, 2.0, 3.0)
    assert A.decide(4.0, 20, False, 16, 2.0, [2.0, 2.0], 4.0, 16.0, running_left=0.25) == \
        A.Decision(False, A.LATER, 3.0, 1.0)
    # Nothing left but the task itself: the GPUs are done at once.
    assert A.decide(4.0, 20, False, 16, 2.0, [2.0], 4.0, 0.0) == A.Decision(False, A.LATER, 3.0, 0.0)
    # The 2x H200 case: 37 TFLOPS a GPU, a 200 GFLOPS CPU, 4096 tiles of an N=65536 DGEMM (256
    # tasks of 2 * 4096^2 * 65536 flops), none started: the CPU would need 16.5 s, the GPUs 7.6 s.
    f = 2.0 * 4096 ** 2 * 65536
    got = A.decide(f, 256, False, 16, 2e11, [3.7e13, 3.7e13], 256 * f, 0.0)
    assert not got.admit and got.reason == A.LATER
    assert got.cpu_s == pytest.approx(1.5 * f / 2e11) and got.gpu_s == pytest.approx(255 * f / 7.4e13)


def test_rate_meter_sums_a_window_of_busy_intervals():
    busy = {0: False}
    m = A.RateMeter(2, lambda w: busy[w], window=3)
    assert m.rate(0, "d") is None
    m.started(0, 10.0)  # idle -> a busy interval begins at 10
    busy[0] = True
    m.started(0, 11.0)  # busy: no new interval
    m.finished(0, "d", 8.0, 12.0)  # 8 flops in 2 s
    m.finished(0, "d", 8.0, 12.0)  # the same instant: flops at no time
    assert m.rate(0, "d") == 16.0 / 2.0 and m.samples[(0, "d")] == 2
    busy[0] = False
    m.started(0, 20.0)  # idle since 12: the gap is not counted
    m.finished(0, "d", 4.0, 21.0)
    assert m.rate(0, "d") == 20.0 / 3.0
    m.started(0, 30.0)
    m.finished(0, "d", 10.0, 30.5)  # the window of 3 drops the first sample
    assert m.rate(0, "d") == (8.0 + 4.0 + 10.0) / (0.0 + 1.0 + 0.5)
    assert m.rate(0, "f") is None and m.rate(1, "d") is None  # per dtype and per worker
    m.seed(1, "d", 6.0, 2.0)
    m.seed(1, "d", 100.0, 1.0)  # ignored: it has a sample
    assert m.rate(1, "d") == 3.0
    m.finished(1, "d", 5.0, 7.0)  # never seen starting: only marks the time
    assert m.rate(1, "d") == 3.0 and m.samples[(1, "d")] == 1
    with pytest.raises(ValueError, match="window: got 0"):
        A.RateMeter(1, lambda w: False, window=0)


def test_call_keeps_its_flops_waiting_and_running():
    events = []

    class Meter:
        def started(self, w, t):
            events.append(("start", w))

        def finished(self, w, key, flops, t, sample=True):
            events.append(("finish", w, key, flops))

    tasks = plan_gemm(8, 8, 8, 4, OP_N, OP_N)  # 4 tasks of 2 * 4 * 4 * 8 = 256 flops
    ops = [make_operand(np.ones((8, 8), order="F"), TokenTable(4)) for _ in range(3)]
    call = Call("gemm", ops, tasks, np.float32, 1.0, 0.0, CallStats([DeviceInfo(0, "d", "sim")]))
    assert not call.has_deps and call.meter is None
    call.meter_with(Meter())
    assert (call.flops_waiting, call.flops_running) == (1024.0, 0.0)
    for t in tasks[:3]:
        t.worker = 1
        call.started(t)
    assert (call.flops_waiting, call.flops_running) == (256.0, 768.0)
    call.unstarted(tasks[0])  # handed back: waiting again
    call.unstarted(tasks[3])  # never started: nothing changes
    assert (call.flops_waiting, call.flops_running) == (512.0, 512.0)
    call.account(tasks[1], 1)
    call.account(tasks[2])  # dropped while running (its device failed)
    call.account(tasks[3])  # dropped before it started
    assert (call.flops_waiting, call.flops_running) == (256.0, 0.0)
    assert events == [("start", 1)] * 3 + [("finish", 1, "f", 256.0)]


# =========================================================================== the CPU worker's use of it

def constructed(n_tasks_side=6, streams=2, probe=(2.0 ** 20, 2.0 ** -10)):
    """2 sims + an auto CPU device, workers constructed (not started), and one call of
    n_tasks_side^2 tasks of 2 * 4 * 4 * 8 = 256 flops (tile 4, K = 8); the CPU's probe
    answers ``probe``."""
    devs = [SimDevice(i, nstreams=streams, cache_bytes=1 << 16, name=f"sim:{i}", trace=False) for i in range(2)]
    cpu = CpuDevice(2, auto=True)
    cpu.probe = lambda dtype: probe
    devs.append(cpu)
    eng = Engine(EngineConfig(devices=devs, streams=streams))
    eng.workers = [StreamWorker(eng, devs[0], eng.stations[0]), StreamWorker(eng, devs[1], eng.stations[1]),
                   CpuWorker(eng, devs[2], eng.stations[2])]
    n = 4 * n_tasks_side
    tasks = plan_gemm(n, n, 8, 4, OP_N, OP_N)
    ops = [make_operand(np.ones((n, 8), order="F"), TokenTable(4)),
           make_operand(np.ones((8, n), order="F"), TokenTable(4)),
           make_operand(np.ones((n, n), order="F"), TokenTable(4))]
    call = Call("gemm", ops, tasks, np.float64, 1.0, 0.0, CallStats([DeviceInfo(i, "d", "sim") for i in range(3)]))
    call.meter_with(eng.admission.meter)
    return eng, call


def test_admission_on_constructed_workers():
    eng, call = constructed()  # 36 tasks, hold = 2 sims x (2 station + 2 streams) = 8
    s0, s1, cpu = eng.workers
    adm = eng.admission
    assert isinstance(adm, A.Admission) and eng.config.devices[2].auto
    task = call.tasks[0]
    assert not cpu._takes(task) and adm.last == A.Decision(False, A.NO_GPU_RATE)
    assert adm.meter.rate(2, "d") is None  # no probe while the GPUs' rate is unknown
    adm.meter.seed(0, "d", 1024.0, 1.0)  # sim 0: one sample, fewer than its 2 streams: not known yet
    assert not cpu._takes(task) and adm.last == A.Decision(False, A.NO_GPU_RATE)
    adm.meter._add(0, "d", 1024.0, 1.0)  # a burst: sim 0 at 1024 flop/s; sim 1 unknown, counts as fast
    # The probe: 2^20 flops in 2^-10 s = 2^30 flop/s. cpu_s = 1.5 * 256 / 2^30; gpu_s = 35 * 256 / 2048.
    assert cpu._takes(task)
    assert adm.last == A.Decision(True, A.SOONER, 1.5 * 256 / 2.0 ** 30, 35 * 256 / 2048)
    assert adm.meter.rate(2, "d") == 2.0 ** 30 and adm.meter.samples[(2, "d")] == 1
    assert cpu._may_steal(task)
    assert s0._may_steal(task) is True  # stream workers steal as before
    # Tasks started on the GPUs count half: 30 waiting besides the task, 5 running.
    for t in call.tasks[1:6]:
        t.worker = 0
        call.started(t)
    assert cpu._takes(task) and adm.last.gpu_s == (30 + 2.5) * 256 / 2048
    # A CPU of 1 flop/s: later.
    adm.meter._sums[(2, "d")] = (1.0, 1.0)
    assert not cpu._takes(task) and adm.last.reason == A.LATER
    # Every GPU dead: the CPU takes everything.
    s0.alive = s1.alive = False
    assert cpu._takes(task) and adm.last == A.Decision(True, A.ALONE)
    assert adm.counts[A.SOONER] == 3 and adm.counts[A.LATER] == 1 and adm.counts[A.NO_GPU_RATE] == 2
    assert adm.counts[A.ALONE] == 1


def test_admission_leaves_small_calls_and_dependencies_to_the_gpus():
    eng, call = constructed(n_tasks_side=2)  # 4 tasks <= hold 8
    cpu = eng.workers[2]
    eng.admission.meter.seed(0, "d", 1.0, 1.0)
    assert not cpu._takes(call.tasks[0]) and eng.admission.last.reason == A.SMALL
    eng, call = constructed()
    eng.admission.meter.seed(0, "d", 1.0, 1.0)
    call.has_deps = True
    assert not eng.workers[2]._takes(call.tasks[0]) and eng.admission.last.reason == A.DEPS


def test_no_admission_and_no_rate_samples_while_a_calls_inputs_register():
    """Regression: a one-shot call's first tasks wait on host registration, so the GPUs' first rates were a
    fraction of their compute; the CPU was handed a 4096^2 x 32768 task that ran 8 s after the GPUs' 1.5 s.
    While the call's pin job runs the CPU takes nothing, and the GPUs' tasks of that time are no samples."""
    eng, call = constructed()
    cpu, adm = eng.workers[2], eng.admission
    adm.meter._add(0, "d", 1024.0, 1.0)
    adm.meter._add(0, "d", 1024.0, 1.0)  # a burst of sim 0 (2 streams): its rate is known
    job = types.SimpleNamespace(done=False)
    call.pin_job = job
    task = call.tasks[0]
    assert call.registering and not cpu._takes(task) and adm.last == A.Decision(False, A.REGISTERING)
    t1 = call.tasks[1]
    t1.worker = 0
    call.started(t1)
    call.account(t1, worker=0)  # finished while registering: the interval is no sample
    assert adm.meter.samples[(0, "d")] == 2 and adm.meter.rate(0, "d") == 1024.0
    job.done = True
    assert not call.registering and cpu._takes(task) and adm.last.reason == A.SOONER
    assert adm.counts[A.REGISTERING] == 1


def test_rate_meter_skips_an_interval_that_is_no_sample():
    m = A.RateMeter(1, lambda w: True)
    m.started(0, 0.0)
    m.finished(0, "d", 100.0, 10.0, sample=False)  # waited on something else: the mark moves, no sample
    assert m.rate(0, "d") is None and (0, "d") not in m.samples
    m.finished(0, "d", 100.0, 11.0)
    assert m.rate(0, "d") == 100.0 and m.samples[(0, "d")] == 1


def test_cpu_worker_puts_back_a_task_it_did_not_decide_on():
    """The CPU peeks the head, decides, then takes the head: if a peer took the head meanwhile,
    the task it got instead goes back in front unless it is admitted too."""
    eng, call = constructed()
    cpu = eng.workers[2]
    q = eng.queues["any"]
    q.put_many(call.tasks[:2])
    decided = []

    def takes(task):
        decided.append(task.tid)
        if len(decided) == 1:
            q.get()  # a GPU takes the head right after the CPU admitted it
            return True
        return False

    cpu._takes = takes
    assert cpu._pull() is None
    assert decided == [0, 1] and q.peek() is call.tasks[1] and len(q) == 1


def test_demand_mode_has_no_admission():
    devs = [SimDevice(0, nstreams=2, cache_bytes=1 << 16, name="sim:0", trace=False), CpuDevice(1)]
    eng = Engine(EngineConfig(devices=devs, streams=2))
    assert eng.admission is None
    eng = Engine(EngineConfig(devices=[CpuDevice(0, auto=True)]))
    assert eng.admission is None and eng.inline  # the CPU alone: calls run in the caller's thread


# =========================================================================== configure()

def test_configure_cpu_modes(tmp_path):
    blasx.configure(devices="sim:2", tile=8)  # cpu=None beside sims: no CPU worker
    assert [d.kind for d in blasx.engine().devices] == ["sim", "sim"] and blasx.engine().admission is None
    blasx.configure(devices="sim:2", tile=8, cpu="auto")
    eng = blasx.engine()
    assert [d.kind for d in eng.devices] == ["sim", "sim", "cpu"] and eng.devices[2].auto
    assert eng.admission is not None and isinstance(eng.workers[2], CpuWorker)
    assert key_for(eng.devices, np.float64, 64, 64, 64).device == "sim"  # the GPUs' perf-db entries
    blasx.configure(devices="sim:2", tile=8, cpu=True)
    eng = blasx.engine()
    assert not eng.devices[2].auto and eng.admission is None
    assert key_for(eng.devices, np.float64, 64, 64, 64).device == "sim+cpu"
    blasx.configure(devices="sim:2", tile=8, cpu=False)
    assert len(blasx.engine().devices) == 2
    blasx.configure(devices="cpu", cpu="auto")  # the CPU alone stays inline
    assert blasx.engine().inline and blasx.engine().admission is None
    for bad in ("yes", 1, "Auto"):
        with pytest.raises(ValueError, match=r"cpu: got .*need True, False, 'auto' or None"):
            blasx.configure(cpu=bad)
    for cpu in ("auto", True):  # refused by configure itself (it was at the first call)
        with pytest.raises(ValueError, match="cannot run beside timing-mode sims"):
            blasx.configure(devices="sim:2,timing=1", cpu=cpu)
    with pytest.raises(ValueError, match="give one of them"):
        blasx.configure(devices="sim:2,mem=64Mi", cache_bytes=1 << 20)
    assert session.cpu_mode(None, "cuda") == "auto" and session.cpu_mode(None, "sim") is None
    assert session.cpu_mode("auto", "sim") == "auto" and session.cpu_mode(True, "cuda") == "always"
    assert session.cpu_mode(False, "cuda") is None


def test_tile_choice_ignores_an_auto_cpu():
    from blasx.tile import choose_tile
    tiles = {}
    for cpu in (False, "auto", True):
        blasx.configure(devices="sim:2", cpu=cpu)
        tiles[cpu] = choose_tile(blasx.engine(), 512, 512, 512, np.float64)
    # 2 workers want 4 tiles of C: 256; a third (demand-mode) worker wants 6: 128.
    assert tiles == {False: 256, "auto": 256, True: 128}


def test_thread_limits_only_once_the_cpu_runs_something():
    dev = CpuDevice(0, threads=1, auto=True)
    call1, call2 = types.SimpleNamespace(), types.SimpleNamespace()
    dev.prepare_call(call1)
    assert dev._limiter is None  # a call in which the CPU takes nothing leaves the threads alone
    dev.engage()
    assert dev._limiter is not None
    dev.prepare_call(call2)
    dev.finish_call(call2)
    dev.finish_call(call2)  # twice (after an interrupted prepare_call, say): undone once
    assert dev._limiter is not None  # a call still runs
    dev.finish_call(call1)
    assert dev._limiter is None
    dev.engage()  # no call running: nothing to limit
    assert dev._limiter is None
    flops, seconds = dev.probe(np.complex64, n=32, runs=2)
    assert flops == 8.0 * 32 ** 3 and seconds > 0
    demand = CpuDevice(0, threads=1)
    call3 = types.SimpleNamespace()
    demand.finish_call(call3)  # a prepare_call that never ran: nothing to undo
    demand.prepare_call(call3)
    assert demand._limiter is not None
    demand.finish_call(call3)
    assert demand._limiter is None


# =========================================================================== whole calls on sims

def test_slow_sims_give_the_cpu_a_share(rand, rel_err):
    blasx.configure(devices=SLOW_SIMS, tile=32, cpu="auto")
    a, b, c = rand((256, 192)), rand((192, 256), seed=1), rand((256, 256), seed=2)
    shares = []
    for _ in range(2):  # the first call learns the GPUs' rates; the second starts with them
        out = blasx.gemm(1.5, a, b, 0.5, c)
        assert rel_err(out, 1.5 * a @ b + 0.5 * c) < 1e-12
        summary = blasx.last_profile().summary()
        cpu = [d for d in summary["devices"] if d["kind"] == "cpu"]
        assert len(cpu) == 1 and cpu[0]["tasks"] > 0
        assert cpu[0]["share"] == cpu[0]["tasks"] / summary["tasks"]
        shares.append(cpu[0]["tasks"])
    adm = blasx.engine().admission
    assert adm.counts[A.SOONER] >= sum(shares)
    assert adm.meter.rate(2, "d") > adm.meter.rate(0, "d")  # the CPU measured faster than a slow sim
    assert "cpu" in blasx.last_profile().report()
    # float32 has rates of its own, learnt the same way.
    out = blasx.gemm(1.0, a.astype(np.float32), b.astype(np.float32))
    assert rel_err(out, a.astype(np.float32) @ b.astype(np.float32)) < 1e-5
    assert adm.meter.rate(0, "f") is not None


def test_a_slow_cpu_takes_nothing_beside_sims(rand, rel_err, monkeypatch):
    """Data-mode sims cannot outrun numpy on the host that runs them, so a fast-GPU case with data
    has the CPU's probe say it is 1e7 times slower than it is (1e3 flop/s): the sims measure
    2e7 flop/s on a quiet 2-core machine, and a loaded one (the suite beside other work) read
    them low enough for a 1e5 flop/s CPU to be admitted in 1 of 8 runs."""
    monkeypatch.setattr(CpuDevice, "probe", lambda self, dtype: (1e3, 1.0))
    blasx.configure(devices="sim:2", tile=16, cpu="auto")
    a, b = rand((128, 64)), rand((64, 128), seed=1)
    for _ in range(2):
        assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12
        assert cpu_tasks() == 0
    adm = blasx.engine().admission
    assert adm.counts[A.LATER] > 0 and adm.counts[A.SOONER] == 0 and adm.last.reason == A.LATER


def test_fast_timing_sims_leave_the_cpu_nothing():
    """Sims at 1e15 flop/s in timing mode (no data: a task the CPU took would fail on it) beside
    an auto CPU with its real probe: the rule runs with both rates known and says later."""
    devs = build_sim_devices(parse_devices("sim:2,timing=1,rate=1e15,h2d=1e15,d2h=1e15,p2p=1e15,mem=4G"),
                             streams=4)
    devs.append(CpuDevice(2, name="cpu", threads=1, auto=True))
    eng = Engine(EngineConfig(devices=devs, streams=4))
    n, tile = 32768, 4096  # 64 tasks of 1.1e12 flops
    dtype = np.dtype(np.float64)
    try:
        eng.start()
        for _ in range(2):
            ops = [Operand(None, n, n, n, (1 + i) << 44, -1, (next(_operands._call_bases), n, n, n, dtype.str, tile))
                   for i in range(3)]
            tasks = plan_gemm(n, n, n, tile, OP_N, OP_N, beta_zero=True, block=(2, 2))
            stats = CallStats([DeviceInfo(d.index, d.name, d.kind) for d in devs])
            call = Call("gemm", ops, tasks, dtype, 1.0, 0.0, stats)
            eng.submit(call)
            assert call.stats.profile().counters[2]["tasks"] == 0
        assert eng.failures == []
        adm = eng.admission
        assert adm.counts[A.LATER] > 0 and adm.counts[A.SOONER] == 0
        assert adm.last.cpu_s > 100 * adm.last.gpu_s
    finally:
        eng.shutdown()


def test_dependencies_and_small_calls_never_wait_on_the_cpu(rand, rel_err):
    blasx.configure(devices=SLOW_SIMS, tile=16, cpu="auto")
    a, b = rand((256, 64)), rand((64, 256), seed=1)
    blasx.gemm(1.0, a, b)  # 256 tasks: the rates are measured
    adm = blasx.engine().admission
    assert adm.meter.rate(0, "d") is not None and adm.meter.rate(2, "d") is not None
    # TRSM: 6 x 6 tiles of X with dependencies.
    t = np.triu(rand((96, 96), seed=2)) + 96 * np.eye(96)
    x = blasx.trsm(1.0, t, rand((96, 96), seed=3), lower=0)
    assert rel_err(x, sblas.dtrsm(1.0, t, rand((96, 96), seed=3), lower=0)) < 1e-12
    assert cpu_tasks() == 0
    # 16 tasks: the two sims hold 2 x (4 + 4) at once.
    assert rel_err(blasx.gemm(1.0, a[:64], b[:, :64]), a[:64] @ b[:, :64]) < 1e-12
    assert blasx.last_profile().summary()["tasks"] == 16 and cpu_tasks() == 0


def test_the_cpu_takes_over_when_the_gpus_fail(rand, rel_err):
    blasx.configure(devices="sim:1,fail=0@2,rate=1e8", tile=16, cpu="auto")
    a, b = rand((160, 70)), rand((70, 160), seed=1)
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12
    assert [n for n, _ in blasx.engine().failures] == ["sim:0"]
    assert rel_err(blasx.gemm(1.0, b, a), b @ a) < 1e-12  # the CPU alone from now on
    assert cpu_tasks() == blasx.last_profile().summary()["tasks"] == 25
    assert blasx.engine().admission.last.reason == A.ALONE


def test_auto_engines_shut_down_cleanly(rand):
    def threads():
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("blasx-"))

    before = threads()
    blasx.configure(devices=SLOW_SIMS, tile=32, cpu="auto")
    a = rand((128, 128))
    blasx.gemm(1.0, a, a)
    assert "blasx-worker-cpu" in threads()
    blasx.shutdown()
    assert threads() == before


@pytest.mark.blas_threads  # (conftest: the process's own BLAS thread counts under xdist too)
def test_auto_cpu_limits_its_blas_threads_after_another_engine_did(rand, monkeypatch):
    """threadpoolctl lets only the thread that first set OpenBLAS's thread count set it again;
    a cpu=True engine sets it from the calling thread, an auto one from its worker thread: the
    second must still run its tasks on its own thread count (``cpu._release_blas_control``)."""
    from threadpoolctl import threadpool_info
    seen = []
    original = CpuDevice.run_task

    def run_task(self, task):
        seen.append((self.threads, [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]))
        return original(self, task)

    monkeypatch.setattr(CpuDevice, "run_task", run_task)
    a = rand((256, 256))
    for cpu in (True, "auto", True, "auto"):
        blasx.configure(devices=SLOW_SIMS, tile=32, cpu=cpu)
        blasx.gemm(1.0, a, a)
        blasx.gemm(1.0, a, a)  # auto mode: rates known, the CPU takes tasks
        assert cpu_tasks() > 0
    assert seen and all(all(n == threads for n in found) for threads, found in seen), seen[:5]


def test_cpu_worker_does_not_poll_while_calls_can_never_be_admitted(rand, monkeypatch):
    """A small call (or one with dependencies) is declined for the whole call: the CPU worker then
    sleeps until new work is posted instead of looking again every 2 ms beside the GPUs."""
    blasx.configure(devices="sim:2", tile=16, cpu="auto")
    eng = blasx.engine()
    waits = []
    original = eng.wait_for_work

    def spy(gen, timeout=None):
        if threading.current_thread() is eng.workers[2]:
            waits.append((timeout, eng.admission.last.reason if eng.admission.last else None))
        return original(gen, timeout)

    monkeypatch.setattr(eng, "wait_for_work", spy)
    a, b = rand((64, 64)), rand((64, 64), seed=1)  # 16 tasks: the two sims hold them all
    for _ in range(5):
        blasx.gemm(1.0, a, b)
    assert all(timeout is None for timeout, reason in waits if reason in A.NEVER_FOR_THE_CALL), waits
