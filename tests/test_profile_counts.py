"""What a profile counts: tasks and flops as they complete (a task handed on from a broken device once, a cancelled
call's skipped work not at all), a batched front end's items together, a call that runs nothing no profile; the
CPU worker beside sims hands on a task it had not started solving; a failed call feeds no rate sample."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

import blasx
from blasx.runtime import faults


@pytest.mark.parametrize("cpu", [False, True, "auto"])
@pytest.mark.parametrize("at", [3, 6, 12])
def test_tasks_and_flops_of_a_call_whose_device_broke_count_once(cpu, at):
    rng = np.random.default_rng(0)
    a, b = rng.random((128, 64)), rng.random((64, 128))
    blasx.configure(devices=f"sim:2,fail=0@{at},rate=1e8", tile=32, streams=2, cpu=cpu)
    assert np.abs(blasx.gemm(1.0, a, b) - a @ b).max() < 1e-12
    t = blasx.last_profile().totals()
    assert t["tasks"] == 16 and t["flops"] == 2 * 128 * 128 * 64


def test_a_cancelled_call_counts_no_work_it_skipped_and_feeds_no_rate_sample(monkeypatch):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    blasx.configure(devices="sim:2,rate=1e8", tile=32, cpu="auto", streams=4)
    rng = np.random.default_rng(0)
    a, b = rng.random((256, 256)), rng.random((256, 256))
    blasx.gemm(1.0, a, b)
    blasx.gemm(1.0, a, b)
    meter = blasx.engine().admission.meter
    samples = dict(meter.samples)
    main, fired = threading.main_thread().ident, []

    def hook(phase, dev, task):
        if phase == "compute" and not fired:
            fired.append(1)
            faults.interrupt(main)
    faults.install(hook)
    try:
        with pytest.raises(KeyboardInterrupt):
            blasx.gemm(1.0, a, b)
    finally:
        faults.install(None)
    t = blasx.last_profile().totals()
    assert t["tasks"] < 64 and t["flops"] == pytest.approx(t["tasks"] * 2 * 32 ** 2 * 256)
    time.sleep(0.2)  # (the stopped tasks retire)
    new = sum(meter.samples.get(k, 0) - samples.get(k, 0) for k in ((0, "d"), (1, "d")))
    assert new <= t["tasks"]  # tasks that completed before the call failed, none stopped after it


def test_a_batched_matmul_has_one_profile_and_an_empty_call_none():
    blasx.configure(devices="sim:2", tile=16)
    rng = np.random.default_rng(1)
    a, b = rng.random((4, 32, 48)), rng.random((4, 48, 64))
    assert np.allclose(blasx.matmul(a, b), a @ b)
    p = blasx.last_profile()
    assert p.totals()["flops"] == 4 * 2 * 32 * 48 * 64
    assert p.totals()["tasks"] == 4 * (32 // 16) * (64 // 16)
    blasx.matmul(np.ones((0, 5)), np.ones((5, 3)))
    assert blasx.last_profile() is None


@pytest.mark.parametrize("cpu", [True, "auto"])
def test_a_cpu_fault_before_the_solve_hands_the_task_on(cpu):
    """beta != 0: the CPU worker broke before it touched C, so its task is redone on a sim (it failed the call,
    as if C had been partly written)."""
    rng = np.random.default_rng(0)
    a, b, c = rng.random((160, 64)), rng.random((64, 160)), rng.random((160, 160))
    blasx.configure(devices="sim:2,rate=1e8", tile=32, cpu=cpu, streams=2)
    blasx.gemm(1.0, a, b)
    blasx.gemm(1.0, a, b)
    hits = [0]

    def hook(phase, dev, task):
        if phase == "cpu":
            hits[0] += 1
            if hits[0] == 2:
                raise blasx.DeviceError("injected cpu fault")
    faults.install(hook)
    try:
        out = blasx.gemm(1.0, a, b, 0.5, c)
    finally:
        faults.install(None)
    if hits[0] >= 2:
        assert [name for name, _ in blasx.engine().failures] == ["cpu"]
    assert np.abs(out - (a @ b + 0.5 * c)).max() < 1e-12
