"""Write-after-read gates (``Task.war``, in-place TRMM): a tile is overwritten once the kernels
of the tasks that read its old value are done, not their write-backs; a task relied on that way
can never be run again from the start."""

import subprocess
import sys
import textwrap

from blasx.runtime.call import Call
from blasx.runtime.plans import plan_trmm
from blasx.runtime.stats import CallStats


def _call(tasks):
    return Call("dtrmm", [], tasks, "float64", 1.0, 0.0, CallStats([]))


def test_in_place_trmm_tasks_carry_war_gates_out_of_place_do_not():
    in_place = plan_trmm(64, 32, 16, 0, 0, 0, 0, in_place=True)
    assert in_place and all(t.war for t in in_place)
    assert not any(t.war or t.gates for t in plan_trmm(64, 32, 16, 0, 0, 0, 0))


def test_war_gate_opens_on_computed_and_pins_the_readers():
    tasks = plan_trmm(64, 16, 16, 0, 0, 0, 0, in_place=True, order="levels")  # one line of 4 levels
    call = _call(tasks)
    assert call.war_gated
    # Upper, left: level 0 is block row 0; the task of row 1 overwrites B_1 once row 0 has read it.
    writer = next(t for t in tasks if t.c.bi == 1)
    (reader,) = writer.deps
    wb = len(writer.steps)
    for t in (reader, writer.tid):
        call.started(tasks[t])
    assert call.is_startable(writer) and not call.gate_open(writer, wb)
    call.computed(tasks[reader])  # its kernels are done, its write-back is not
    assert call.gate_open(writer, wb)
    # Relied on: a failed device must not hand it back to run again (B_1 may be overwritten).
    assert not call.recompute_safe(tasks[reader])
    # A computed task nobody relied on yet may run again, and then counts as not computed.
    row2 = next(t for t in tasks if t.c.bi == 2)
    reader2 = tasks[row2.deps[-1]]
    call.computed(reader2)
    assert call.recompute_safe(reader2) and not call.gate_open(row2, len(row2.steps))


def test_gates_without_war_still_wait_for_finished():
    tasks = plan_trmm(64, 16, 16, 0, 0, 0, 0, in_place=True, order="levels")
    for t in tasks:
        t.war = False
    call = _call(tasks)
    writer = next(t for t in tasks if t.c.bi == 1)
    call.computed(tasks[writer.deps[0]])
    assert not call.gate_open(writer, len(writer.steps))
    call.account(tasks[writer.deps[0]], 0)
    assert call.gate_open(writer, len(writer.steps))


def test_in_place_trmm_right_or_loud_under_fault_injection():
    """Many fault points, 1 and 4 streams, several lines: with write-back gates on the readers'
    kernels a reader may fail after its tile was overwritten; the call must then fail loudly
    (DeviceError), never return a wrong B, never hang. In a subprocess: a hang is a timeout."""
    script = textwrap.dedent("""
        import numpy as np, scipy.linalg.blas as sb, blasx
        outcomes = {"right": 0, "loud": 0}
        for streams in (1, 4):
            for lower in (0, 1):
                for dev, at in ((0, 3), (1, 6), (0, 11), (1, 17), (0, 26), (1, 40)):
                    blasx.configure(devices=f"sim:2,fail={dev}@{at}", tile=16, streams=streams)
                    rng = np.random.default_rng(at)
                    a = np.asfortranarray(rng.standard_normal((96, 96)) / 192 + 2 * np.eye(96))
                    b = np.asfortranarray(rng.standard_normal((96, 48)))  # 6 levels x 3 lines
                    want = sb.dtrmm(1.5, a, b, lower=lower)
                    try:
                        x = blasx.trmm(1.5, a, b, lower=lower, overwrite_b=True)
                        assert np.linalg.norm(x - want) <= 1e-12 * np.linalg.norm(want), (streams, lower, dev, at)
                        outcomes["right"] += 1
                    except blasx.DeviceError:
                        outcomes["loud"] += 1
                    blasx.shutdown()
        print("finished", outcomes)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr[-2000:]


def test_in_place_trmm_on_a_device_holding_b_computes_gated_tasks_in_a_buffer(monkeypatch):
    """A device holding B (CUDA with a CuPy B on it; emulated: sims whose array view is the operand's own memory)
    computed every task into B itself, so a task's first kernel overwrote a tile other tasks had still to read
    (the write-after-read gates hold back write-backs only): wrong results every time."""
    import numpy as np
    import scipy.linalg.blas as sb

    import blasx
    from blasx.runtime.devices import sim
    monkeypatch.setattr(sim.SimDevice, "holds_array",
                        lambda self, op: op.array is not None and op.device < 0 and op.array.flags.writeable)
    monkeypatch.setattr(sim.SimDevice, "array_loc",
                        lambda self, op, ref: op.array[ref.r0:ref.r0 + ref.rows, ref.c0:ref.c0 + ref.cols])
    rng = np.random.default_rng(0)
    for spec in ("sim:1", "sim:2", "sim:2,speeds=1/4"):
        blasx.configure(devices=spec, tile=8, streams=4)
        a = np.asfortranarray(np.triu(rng.random((48, 48))) + np.eye(48))
        b = np.asfortranarray(rng.random((48, 40)))
        want = sb.dtrmm(1.0, a, b)
        got = blasx.dtrmm(1.0, a, b, overwrite_b=True)
        assert got is b and np.abs(got - want).max() < 1e-10, spec
    blasx.shutdown()
