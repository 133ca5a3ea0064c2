"""The engine's lifecycle against calls in flight: shutdown() / configure() from another thread lets the calls
finish before any worker stops (a stopped worker's closed device was read by its peers: wrong tiles; its
re-queued tasks served by nobody: a hang), and a Ctrl-C while the workers open their devices leaves a usable
engine, not a half-started one."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np

import blasx
from blasx.runtime import faults
from blasx.runtime.devices import sim


def _shutdown_mid_call(start_in_thread, fn, when, then=None):
    """fn()'s result, run in a thread while shutdown() runs in another: the first task operation ``when(phase,
    dev)`` holds its device until shutdown has been asked for (0.2 s more), then runs ``then()`` (a fault)."""
    go, fired = threading.Event(), threading.Event()

    def hook(phase, dev, task):
        if when(phase, dev) and not fired.is_set():
            fired.set()
            go.wait(10)
            if then is not None:
                then()
    faults.install(hook)
    try:
        t, out = start_in_thread(fn)
        assert fired.wait(10)
        s, _ = start_in_thread(blasx.shutdown)
        time.sleep(0.2)  # (before the fix the other worker had stopped and closed its device by now)
        go.set()
        t.join(20)
        s.join(20)
    finally:
        faults.install(None)
    assert not t.is_alive() and not s.is_alive()
    assert "error" not in out, repr(out.get("error"))
    return out["value"]


def _on_sim1_load(phase, dev):
    return phase == "load" and dev.index == 1


def test_shutdown_during_a_call_lets_it_finish_right(start_in_thread):
    """sim:1 held on its first load while shutdown() runs: sim:0 must not stop (and close its arena, whose lines
    sim:1 then reads as a peer) before the call is done."""
    for seed in range(3):
        blasx.configure(devices="sim:2", tile=32, streams=1)
        rng = np.random.default_rng(seed)
        a, b = rng.random((64, 128)), rng.random((128, 256))
        got = _shutdown_mid_call(start_in_thread, lambda: blasx.gemm(1.0, a, b), _on_sim1_load)
        np.testing.assert_allclose(got, a @ b, rtol=1e-12)


def test_a_device_failing_while_shutdown_waits_hands_its_tasks_on(start_in_thread):
    blasx.configure(devices="sim:2", tile=32, streams=1)
    # 16 tasks: sim:1 surely loads a tile (with 4, a loaded machine's sim:0 could take them all, the hook unfired)
    a, b = np.random.default_rng(1).random((128, 64)), np.random.default_rng(2).random((64, 128))

    def fail():
        raise blasx.DeviceError("injected: sim:1 breaks during shutdown")
    got = _shutdown_mid_call(start_in_thread, lambda: blasx.gemm(1.0, a, b), _on_sim1_load, fail)
    np.testing.assert_allclose(got, a @ b, rtol=1e-12)


def test_shutdown_during_a_trsm_with_the_cpu_worker_holding_a_chain(start_in_thread):
    blasx.configure(devices="sim:1", tile=32, streams=1, cpu=True)
    rng = np.random.default_rng(3)
    n = 192
    a, b = np.triu(rng.random((n, n))) + n * np.eye(n), rng.random((n, 32))
    x = _shutdown_mid_call(start_in_thread, lambda: blasx.trsm(1.0, a, b),
                           lambda phase, dev: phase in ("compute", "cpu"))  # (the first task, on either device)
    np.testing.assert_allclose(a @ x, b, rtol=1e-10, atol=1e-12)


def test_ctrl_c_while_the_workers_open_leaves_a_started_engine(monkeypatch):
    """A KeyboardInterrupt while the devices open (a CUDA context takes ~0.1-1 s; a slow sim here) is raised
    once they have: later calls work, and shutdown stops every worker."""
    opened = sim.SimDevice.open

    def slow_open(self):
        time.sleep(0.4)
        opened(self)
    monkeypatch.setattr(sim.SimDevice, "open", slow_open)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        blasx.configure(devices="sim:2", tile=32)
        a = np.random.default_rng(4).random((64, 64))
        timer = threading.Timer(0.15, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGINT))
        timer.start()
        try:
            blasx.gemm(1.0, a, a)
        except KeyboardInterrupt:
            pass
        timer.join()
        for _ in range(2):
            np.testing.assert_allclose(blasx.gemm(1.0, a, a), a @ a, rtol=1e-12)
        eng = blasx.engine()
        blasx.shutdown()
        assert not any(w.is_alive() for w in eng.workers)
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_call_interrupted_before_it_was_queued_does_not_hold_shutdown(monkeypatch, start_in_thread):
    """A Ctrl-C landing as a call is being listed (here in its stats' start) cancels it: shutdown() does not wait
    for a call nobody runs, even while the traceback keeps the call alive."""
    from blasx.runtime import stats
    blasx.configure(devices="sim:2", tile=16)
    a = np.random.default_rng(5).random((64, 64))
    start = stats.CallStats.start
    armed = [True]

    def interrupted(self, t=None):
        if armed[0] and t is None:
            armed[0] = False
            raise KeyboardInterrupt
        return start(self, t)
    monkeypatch.setattr(stats.CallStats, "start", interrupted)
    try:
        blasx.gemm(1.0, a, a)
    except KeyboardInterrupt as exc:
        kept = exc.__traceback__  # (as a REPL keeps it: the call stays alive)
    monkeypatch.setattr(stats.CallStats, "start", start)
    eng = blasx.engine()
    assert all(c.done for c in eng._live_calls()) and eng.leaks() == []
    np.testing.assert_allclose(blasx.gemm(1.0, a, a), a @ a, rtol=1e-12)
    s, _ = start_in_thread(blasx.shutdown)
    s.join(10)
    assert not s.is_alive() and kept is not None


def test_an_engine_closed_before_it_started_is_replaced(monkeypatch, start_in_thread):
    """configure() in another thread closes the engine a call fetched before the call started it: the call runs
    on the new one (session.engine tries again), not an error."""
    from blasx.runtime import engine as E
    blasx.configure(devices="sim:2", tile=16)
    a = np.random.default_rng(6).random((64, 64))
    start = E.Engine.start

    def slow(self):
        if threading.current_thread().name == "caller" and not self._started:
            time.sleep(0.2)  # (the caller loses the GIL right after fetching it)
        return start(self)
    monkeypatch.setattr(E.Engine, "start", slow)
    out = {}

    def caller():
        out["value"] = blasx.gemm(1.0, a, a)
    t = threading.Thread(target=caller, name="caller", daemon=True)
    t.start()
    time.sleep(0.05)
    blasx.configure(devices="sim:3", tile=16)
    t.join(20)
    assert not t.is_alive()
    np.testing.assert_allclose(out["value"], a @ a, rtol=1e-12)


def test_the_interpreter_exits_while_non_daemon_threads_still_call(tmp_path):
    """The main thread ends while three threads keep calling: the exit hook stops the engine, their later calls
    start one whose threads are daemons (not joined), and the process exits with every result right."""
    import subprocess
    import sys
    script = tmp_path / "exit_threads.py"
    script.write_text(
        "import threading, time\n"
        "import numpy as np\n"
        "import blasx\n"
        "blasx.configure(devices='sim:2', tile=16)\n"
        "a = np.random.default_rng(0).random((64, 64))\n"
        "wrong = []\n"
        "def work():\n"
        "    for _ in range(20):\n"
        "        try:\n"
        "            if not np.allclose(blasx.gemm(1.0, a, a), a @ a):\n"
        "                wrong.append(1)\n"
        "        except blasx.runtime.call.CallCancelled:\n"
        "            pass  # (a call in flight when the exit hook ran)\n"
        "ts = [threading.Thread(target=work) for _ in range(3)]\n"
        "for t in ts:\n"
        "    t.start()\n"
        "time.sleep(0.05)\n"
        "import atexit\n"
        "atexit.register(lambda: print('wrong', len(wrong), flush=True))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrong 0" in done.stdout


def test_a_forked_child_builds_its_own_engine(tmp_path):
    """fork() after the engine started (multiprocessing's fork start method): the child has none of its
    parent's worker threads, so it forgets that engine and builds its own; parent and child both answer
    right, while another parent thread is calling at the fork."""
    import subprocess
    import sys
    script = tmp_path / "fork.py"
    script.write_text(
        "import multiprocessing as mp, threading\n"
        "import numpy as np\n"
        "import blasx\n"
        "blasx.configure(devices='sim:2', tile=16)\n"
        "a = np.random.default_rng(0).random((64, 64))\n"
        "def ok(_):\n"
        "    return bool(np.allclose(blasx.gemm(1.0, a, a), a @ a))\n"
        "stop = threading.Event()\n"
        "def busy():\n"
        "    while not stop.is_set():\n"
        "        ok(0)\n"
        "t = threading.Thread(target=busy)\n"
        "t.start()\n"
        "with mp.get_context('fork').Pool(2) as pool:\n"
        "    got = pool.map_async(ok, range(4)).get(timeout=60)\n"
        "stop.set(); t.join()\n"
        "print('children', got, 'parent', ok(0), flush=True)\n")
    done = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "children [True, True, True, True] parent True" in done.stdout


def test_a_worker_thread_that_cannot_start_leaves_no_thread_running(monkeypatch):
    """Out of threads while the workers start: the start raises, the workers that did start are stopped (their
    threads would hold the process from exiting), and the next call starts a whole engine."""
    from blasx.runtime import engine as engine_mod
    real, count = engine_mod._start_once, [0]

    def start_once(w):
        count[0] += 1
        if count[0] == 2:
            raise RuntimeError("can't start new thread")
        real(w)
    monkeypatch.setattr(engine_mod, "_start_once", start_once)
    before = {t.ident for t in threading.enumerate()}
    blasx.configure(devices="sim:3", tile=16)
    try:
        blasx.engine()
        raise AssertionError("the start should have failed")
    except RuntimeError as exc:
        assert "can't start new thread" in str(exc)
    time.sleep(0.2)
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before  # nothing left running
    monkeypatch.setattr(engine_mod, "_start_once", real)
    a = np.random.default_rng(0).random((48, 48))
    np.testing.assert_allclose(blasx.gemm(1.0, a, a), a @ a, rtol=1e-12)
    blasx.shutdown()
