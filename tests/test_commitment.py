"""How much work a GPU commits ahead (``Knobs.commit_steps``).

A task started on a stream cannot move to another device, so what each device has committed
when the queues run dry decides the call's tail. The rule is checked as a pure function, then
on simulated GPUs: the committed work stays under the horizon plus one task, and every result
is right (also for TRSM, whose gated tasks hold their slots while they wait)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import scipy.linalg.blas as sblas

import blasx
from blasx.runtime.call import Call
from blasx.runtime.knobs import Knobs
from blasx.runtime.stats import CallStats
from blasx.runtime.plans import plan_gemm
from blasx.runtime.tiling import OP_N
from blasx.runtime.worker import StreamWorker

T = 16  # tile of the simulated calls


# =========================================================================== the knob and its unit

def test_knobs_parse_counts_and_switches():
    k = Knobs.from_env("commit_steps=12,late_c=0")
    assert (k.commit_steps, k.late_c) == (12, False)
    assert Knobs.from_env("").commit_steps == Knobs().commit_steps == 0


@pytest.mark.parametrize("text", ["commit_steps=x", "commit_steps=-1", "commit_steps=1.5", "late_c=2",
                                  "nosuch=1", "commit_steps=\u00b2"])
def test_knobs_reject_bad_values_naming_what_is_allowed(text, expect):
    msg = str(expect(ValueError, "BLASX_KNOBS", repr(text), call=lambda: Knobs.from_env(text)))
    assert "'commit_steps'" in msg and "'late_c'" in msg and "int >= 0" in msg


def test_a_knob_given_twice_is_refused(expect):
    expect(ValueError, "BLASX_KNOBS", "'late_c' given twice", call=lambda: Knobs.from_env("late_c=0,late_c=1"))


def test_switches_read_from_the_environment(monkeypatch, expect):
    from blasx.runtime.config import env_switch
    for text, want in (("", True), (" off ", False), ("NO", False), ("yes", True), ("1", True)):
        monkeypatch.setenv("BLASX_TEST_SWITCH", text)
        assert env_switch("BLASX_TEST_SWITCH") is want
    monkeypatch.setenv("BLASX_TEST_SWITCH", "of")
    expect(ValueError, "$BLASX_TEST_SWITCH: got 'of'", call=lambda: env_switch("BLASX_TEST_SWITCH"))


@pytest.mark.parametrize("dtype, factor", [(np.float64, 2), (np.complex128, 8)])
def test_full_step_is_the_largest_step_of_the_call(dtype, factor):
    """2 T^3 flops for a real call (8 T^3 complex), whatever its edge tiles."""
    tasks = plan_gemm(50, 40, 70, T, OP_N, OP_N, beta_zero=True)
    call = Call("gemm", [], tasks, dtype, 1.0, 0.0, CallStats([]))
    assert call.full_step == factor * T ** 3
    assert Call("gemm", [], [], dtype, 1.0, 0.0, CallStats([])).full_step == 0.0


# =========================================================================== the rule, as a pure function

def _task(full_step, urgent=False):
    return types.SimpleNamespace(urgent=urgent, call=types.SimpleNamespace(full_step=full_step))


def _worker(inflight, commit_steps=4):
    return types.SimpleNamespace(inflight=inflight, commit_steps=commit_steps)


@pytest.mark.parametrize("inflight, committed, commit_steps, urgent, want", [
    (0, 99.0, 4, False, True),     # an idle device always takes one
    (3, 39.0, 4, False, True),     # below 4 full steps of 10 flops
    (3, 40.0, 4, False, False),    # at the horizon
    (3, 0.0, 4, False, True),      # tasks in flight whose kernels are all done (write-backs)
    (3, 40.0, 0, False, True),     # commit_steps=0: no horizon (the cap of 2 x streams tasks alone)
    (3, 40.0, 4, True, True),      # urgent: others wait for it
])
def test_within_horizon(inflight, committed, commit_steps, urgent, want):
    w = _worker(inflight, commit_steps)
    assert StreamWorker._within_horizon(w, _task(10.0, urgent), committed) is want


# =========================================================================== on simulated GPUs

@pytest.fixture
def commit_probe(monkeypatch):
    """After every ``assign``: (committed flops, the call's full step, its largest task's flops)."""
    seen = []
    original = StreamWorker.assign

    def assign(self):
        original(self)
        acts = [a for a in self.slots if a is not None]
        if acts:
            call = acts[0].task.call
            seen.append((self.committed(), call.full_step, max(t.flops for t in call.tasks)))

    monkeypatch.setattr(StreamWorker, "assign", assign)
    return seen


@pytest.mark.parametrize("steps, bounded", [(4, True), (0, False)])
def test_committed_work_stays_under_the_horizon_plus_one_task(steps, bounded, monkeypatch, commit_probe, rand,
                                                              rel_err):
    """GEMM tasks of 12 full steps on 4 streams: with commit_steps=4 a device never holds more
    than 4 steps + one task; with 0 it holds up to 8 tasks (the old rule), far beyond."""
    monkeypatch.setenv("BLASX_KNOBS", f"commit_steps={steps}")
    blasx.configure(devices="sim:2,rate=2e9", tile=T, streams=4)
    a, b = rand((4 * T, 12 * T)), rand((12 * T, 6 * T), seed=1)
    out = blasx.gemm(1.0, a, b)
    assert rel_err(out, a @ b) < 1e-12
    worst = max(c / (4 * full + task) for c, full, task in commit_probe)
    assert (worst <= 1.0) is bounded, worst


@pytest.mark.parametrize("steps", [1, 2])
def test_a_shallow_horizon_is_right_for_trsm_with_a_slow_device(steps, monkeypatch, rand, rel_err):
    """Gated TRSM tasks hold their slots (and their steps count as committed) while they wait for
    the tiles they read: a horizon of one or two steps must neither deadlock nor change the answer."""
    monkeypatch.setenv("BLASX_KNOBS", f"commit_steps={steps}")
    blasx.configure(devices="sim:3,speeds=1/1/4", tile=T, streams=4)
    n, m = 7 * T + 3, 5 * T + 1
    a = np.triu(rand((n, n), seed=2)) + n * np.eye(n)
    b = rand((n, m), seed=3)
    got = blasx.linalg.blas.dtrsm(1.5, a, b)
    assert rel_err(got, sblas.dtrsm(1.5, a, b)) < 1e-12
