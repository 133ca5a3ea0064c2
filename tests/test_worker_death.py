"""Failures that are not interrupts: a worker thread dying, a device error, a host-side error.

A worker that dies for any reason hands its tasks to the others (or fails their calls when
none can run them), never leaving a caller waiting; a device is declared dead only on a
device error, and ``blasx.reset()`` (or the next call, once every device is dead) starts the
devices again. An error of one call (an output the host refuses to write) fails that call.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import blasx

worker_mod = importlib.import_module("blasx.runtime.worker")
faults = importlib.import_module("blasx.runtime.faults")
DeviceError = blasx.DeviceError


def _break_once(monkeypatch, method, index):
    """Make ``StreamWorker.<method>`` raise once on worker ``index``: its thread dies."""
    orig = getattr(worker_mod.StreamWorker, method)
    fired = []

    def broken(self, *a, **k):
        if self.idx == index and not fired and self.inflight:
            fired.append(1)
            raise RuntimeError(f"injected: worker {index} dies in {method}")
        return orig(self, *a, **k)
    monkeypatch.setattr(worker_mod.StreamWorker, method, broken)
    return fired


@pytest.mark.parametrize("method", ["retire", "assign", "fill_station"])
def test_a_worker_that_dies_hands_its_tasks_on(method, monkeypatch, rand, rel_err, run_bounded):
    blasx.configure(devices="sim:2", tile=32)
    a, b = rand((192, 160)), rand((160, 192), seed=1)
    fired = _break_once(monkeypatch, method, 0)
    out = run_bounded(lambda: blasx.gemm(1.0, a, b))
    assert fired and "error" not in out, out.get("error")
    assert rel_err(out["value"], a @ b) < 1e-12
    eng = blasx.engine()
    assert [w.alive for w in eng.workers] == [False, True]
    assert eng.leaks() == []
    monkeypatch.undo()
    blasx.reset()
    eng = blasx.engine()
    assert all(w.alive for w in eng.workers)
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12


def test_every_device_dead_fails_the_call_then_the_next_call_starts_them_again(rand, rel_err, run_bounded):
    blasx.configure(devices="sim:1,fail=0@3", tile=32)
    a = rand((128, 128))
    out = run_bounded(lambda: blasx.gemm(1.0, a, a))
    assert isinstance(out.get("error"), DeviceError), out
    assert "injected fault" in str(out["error"])
    assert blasx.engine().devices[0].error is None  # a new engine: the failed one was replaced
    # The new sim fails again at its third kernel (same spec), and again is replaced.
    out = run_bounded(lambda: blasx.gemm(1.0, a, a))
    assert isinstance(out.get("error"), DeviceError)
    blasx.configure(devices="sim:1", tile=32)
    assert rel_err(blasx.gemm(1.0, a, a), a @ a) < 1e-12


def test_device_error_injected_by_hook_moves_work_to_the_other_device(rand, rel_err, run_bounded):
    blasx.configure(devices="sim:2", tile=32)
    a, b = rand((160, 160)), rand((160, 160), seed=1)
    seen = []

    def hook(phase, dev, task):
        if phase == "load" and dev.index == 1:
            seen.append(1)
            if len(seen) == 3:
                raise DeviceError("injected device error on sim:1")
    faults.install(hook)
    try:
        out = run_bounded(lambda: blasx.gemm(1.0, a, b))
    finally:
        faults.install(None)
    assert "error" not in out, out.get("error")
    assert rel_err(out["value"], a @ b) < 1e-12
    eng = blasx.engine()
    assert [w.alive for w in eng.workers] == [True, False] and eng.leaks() == []


def test_a_host_side_write_error_fails_the_call_not_the_device(rand, rel_err, run_bounded):
    """A read-only C handed to the engine as an output (the front ends copy such a c, so the
    dispatch entry is called directly): the host refuses the write-back. The call fails with
    that error; no device dies."""
    from blasx import dispatch

    blasx.configure(devices="sim:2", tile=32)
    a, b = rand((128, 128)), rand((128, 128), seed=1)
    c = np.asfortranarray(rand((128, 128), seed=2))
    c.flags.writeable = False
    before = c.copy()
    out = run_bounded(lambda: dispatch.gemm(1.0, a, b, 1.0, c, 0, 0, np.dtype(np.float64), 128))
    assert isinstance(out.get("error"), ValueError), out
    assert np.array_equal(c, before)
    eng = blasx.engine()
    assert all(w.alive for w in eng.workers) and eng.leaks() == []
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12
    # the front end copies a read-only c, as scipy does
    res = blasx.gemm(1.0, a, b, beta=1.0, c=c, overwrite_c=1)
    assert res is not c and rel_err(res, a @ b + before) < 1e-12 and np.array_equal(c, before)
