"""The interrupt matrix: Ctrl-C at each phase of a call, for every routine family, on the sim.

A test-only hook (``blasx.runtime.faults``) fires at a named phase: in the calling thread
(``plan``, ``register``, ``submit``) it raises KeyboardInterrupt there; on a device's worker
(``load``, ``compute``, ``writeback``, ``cpu``) it interrupts the caller (a real SIGINT for
the main thread, an async exception for others) and holds that operation until the call is
cancelled, so the interrupt always lands while the call runs. After each: KeyboardInterrupt
reached the caller, the caller's arrays are untouched (calls that return a new array) or
only the output was written (in-place calls), nothing leaked (``Engine.leaks``: tasks,
events, lines with readers, heap blocks, directory entries; and threads), and the next call
is right.
"""

from __future__ import annotations

import importlib
import signal
import threading
import time

import numpy as np
import pytest
import scipy.linalg.blas as S

import blasx

faults = importlib.import_module("blasx.runtime.faults")
level3 = importlib.import_module("blasx.level3")

N = 96
TILE = 32


ON_GPUS = [pytest.mark.gpu, pytest.mark.skipif(blasx.session._cuda_count() < 1, reason="needs a CUDA GPU and CuPy")]
CALLER_PHASES = ("plan", "register", "submit")
DEVICE_PHASES = ("load", "compute", "writeback")


def _operands(rand):
    a = rand((N, N), seed=1)
    b = rand((N, N), seed=2)
    c = rand((N, N), seed=3)
    sym = np.asfortranarray(a + a.T)
    tri = np.asfortranarray(np.triu(a) + N * np.eye(N))  # well conditioned for trsm
    return a, b, c, sym, tri


def _routines(rand):
    """name -> (blasx call, scipy/numpy reference, arrays it must leave untouched)."""
    a, b, c, sym, tri = _operands(rand)
    return {
        "gemm": (lambda: blasx.gemm(1.0, a, b, beta=0.5, c=c), lambda: S.dgemm(1.0, a, b, beta=0.5, c=c), (a, b, c)),
        "symm": (lambda: blasx.symm(1.0, sym, b, beta=0.5, c=c), lambda: S.dsymm(1.0, sym, b, beta=0.5, c=c),
                 (sym, b, c)),
        "syrk": (lambda: blasx.syrk(1.0, a, beta=0.5, c=c), lambda: S.dsyrk(1.0, a, beta=0.5, c=c), (a, c)),
        "syr2k": (lambda: blasx.syr2k(1.0, a, b), lambda: S.dsyr2k(1.0, a, b), (a, b)),
        "trmm": (lambda: blasx.trmm(1.0, tri, b), lambda: S.dtrmm(1.0, tri, b), (tri, b)),
        "trsm": (lambda: blasx.trsm(1.0, tri, b, side=1), lambda: S.dtrsm(1.0, tri, b, side=1), (tri, b)),
        "matmul": (lambda: blasx.matmul(a, b), lambda: a @ b, (a, b)),
    }


ROUTINES = ("gemm", "symm", "syrk", "syr2k", "trmm", "trsm", "matmul")


class Interrupter:
    """The fault hook: at the ``nth`` time ``phase`` is reached, interrupt the caller of the call
    (``victims``: thread ident -> None, any call those threads run; default the main thread)."""

    def __init__(self, phase: str, nth: int = 1, victims=None, hold: bool = True) -> None:
        self.phase, self.nth, self.hold = phase, nth, hold
        self.victims = victims if victims is not None else {threading.main_thread().ident}
        self.seen = 0
        self.fired: list = []
        self.lock = threading.Lock()

    def __call__(self, phase, device, task) -> None:
        if phase != self.phase:
            return
        if phase in CALLER_PHASES:
            if threading.get_ident() in self.victims and threading.get_ident() not in self.fired:
                with self.lock:
                    self.seen += 1
                    go = self.seen == self.nth
                if go:
                    self.fired.append(threading.get_ident())
                    raise KeyboardInterrupt(f"injected at {phase}")
            return
        call = task.call if task is not None else None
        owner = next((t for t in self.victims if level3.running_call(t) is call), None)
        if owner is None or owner in self.fired:
            return
        with self.lock:
            self.seen += 1
            go = self.seen >= self.nth and owner not in self.fired
            if go:
                self.fired.append(owner)
        if go:
            faults.interrupt(owner)
            for _ in range(2000 if self.hold else 0):  # hold this operation until the caller has cancelled the call
                if call.failed:
                    break
                threading.Event().wait(0.005)


@pytest.fixture
def hook():
    """Installs fault hooks for the test; Python's own Ctrl-C handler meanwhile (a process started
    in the background by a shell without job control inherits SIGINT ignored, and Ctrl-C then
    raises nothing)."""
    installed = []
    old = signal.signal(signal.SIGINT, signal.default_int_handler)

    def install(h):
        installed.append(h)
        faults.install(h)
        return h
    try:
        yield install
    finally:
        faults.install(None)
        signal.signal(signal.SIGINT, old)


def _blasx_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("blasx"))


def _check_after(name, routines, copies, rel_err, threads_before):
    run, ref, arrays = routines[name]
    for x, x0 in zip(arrays, copies):
        assert np.array_equal(x, x0), f"{name}: an operand was written by the cancelled call"
    eng = blasx.engine()
    assert eng.leaks() == []
    assert not eng.dead and all(w.alive for w in eng.workers)
    assert rel_err(run(), ref()) < 1e-12
    assert eng.leaks() == []
    assert _blasx_threads() == threads_before


def _interrupted(name, phase, rand, rel_err, hook, nth=1, **config):
    blasx.configure(devices=config.pop("devices", "sim:2"), tile=TILE, **config)
    routines = _routines(rand)
    run, ref, arrays = routines[name]
    assert rel_err(run(), ref()) < 1e-12  # warm: the engine and its threads are up
    threads_before = _blasx_threads()
    copies = [x.copy() for x in arrays]
    h = hook(Interrupter(phase, nth))
    with pytest.raises(KeyboardInterrupt):
        run()
    faults.install(None)
    assert h.fired, f"phase {phase} was never reached"
    _check_after(name, routines, copies, rel_err, threads_before)


@pytest.mark.parametrize("devices", ["sim:2", pytest.param("cuda", marks=ON_GPUS)])
@pytest.mark.parametrize("phase", CALLER_PHASES + DEVICE_PHASES)
@pytest.mark.parametrize("name", ROUTINES)
def test_interrupt_at_each_phase(name, phase, devices, rand, rel_err, hook):
    """On two sims and on every CUDA GPU (the same hooks: cuda.py reaches the same phases). No CPU worker beside
    the GPUs: in auto mode it may take enough of a small call's tasks that a GPU never computes a third."""
    _interrupted(name, phase, rand, rel_err, hook, nth=3 if phase == "compute" else 1, devices=devices,
                 **({"cpu": False} if devices == "cuda" else {}))


@pytest.mark.parametrize("name", ROUTINES)
def test_interrupt_while_the_cpu_worker_runs_a_task(name, rand, rel_err, hook):
    """The CPU worker beside a slow one-stream sim (which holds at most three tasks) takes the
    others by demand; Ctrl-C while it solves one."""
    _interrupted(name, "cpu", rand, rel_err, hook, devices="sim:1,rate=1e6", cpu=True, streams=1)


@pytest.mark.parametrize("name", ["gemm", "symm", "syrk", "trmm", "trsm", "matmul"])
def test_interrupted_in_place_call_fully_writes_its_output(name, rand, rel_err, hook):
    """With overwrite_c / overwrite_b / out= the output is the caller's array: Ctrl-C in the middle
    of its write-back takes effect once the call returns (as numpy's and scipy's calls), so the
    output is fully written and right, and nothing else is written."""
    blasx.configure(devices="sim:2", tile=TILE)
    a, b, c, sym, tri = _operands(rand)
    a0, b0, c0, sym0, tri0 = a.copy(), b.copy(), c.copy(), sym.copy(), tri.copy()
    calls = {
        "gemm": (lambda: blasx.gemm(1.0, a, b, beta=0.5, c=c, overwrite_c=1), c, lambda: a0 @ b0 + 0.5 * c0),
        "symm": (lambda: blasx.symm(1.0, sym, b, beta=0.5, c=c, overwrite_c=1), c, lambda: sym0 @ b0 + 0.5 * c0),
        "syrk": (lambda: blasx.syrk(1.0, a, beta=0.5, c=c, overwrite_c=1), c,
                 lambda: np.where(np.triu(np.ones((N, N))) > 0, a0 @ a0.T + 0.5 * c0, c0)),
        "trmm": (lambda: blasx.trmm(1.0, tri, b, overwrite_b=1), b, lambda: tri0 @ b0),
        "trsm": (lambda: blasx.trsm(1.0, tri, b, overwrite_b=1), b, lambda: np.linalg.solve(tri0, b0)),
        "matmul": (lambda: blasx.matmul(a, b, out=c), c, lambda: a0 @ b0),
    }
    run, written, ref = calls[name]
    h = hook(Interrupter("writeback", 2, hold=False))
    with pytest.raises(KeyboardInterrupt):
        run()
    faults.install(None)
    assert h.fired
    assert rel_err(written, ref()) < 1e-12, f"{name}: the in-place output is not fully written"
    for x, x0 in ((a, a0), (sym, sym0), (tri, tri0), (b, b0), (c, c0)):
        if x is not written:
            assert np.array_equal(x, x0), f"{name}: an input was written"
    assert blasx.engine().leaks() == []
    assert rel_err(blasx.gemm(1.0, a0, b0), a0 @ b0) < 1e-12


@pytest.mark.parametrize("devices", ["sim:3", pytest.param("cuda", marks=ON_GPUS)])
def test_interrupts_in_several_threads_at_once(devices, rand, rel_err, hook):
    """Six threads call different routines at once; three are interrupted mid-compute (async
    KeyboardInterrupt). The other three get right answers, the three get KeyboardInterrupt,
    nothing leaks and every device stays alive."""
    blasx.configure(devices=devices, tile=TILE)
    routines = _routines(rand)
    names = ["gemm", "syrk", "trsm", "symm", "syr2k", "matmul"]
    assert rel_err(routines["gemm"][0](), routines["gemm"][1]()) < 1e-12
    threads_before = _blasx_threads()
    results: dict = {}
    start = threading.Barrier(len(names))

    def worker(i, name):
        start.wait()
        try:
            results[i] = ("ok", routines[name][0]())
        except KeyboardInterrupt:
            results[i] = ("interrupted", None)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            results[i] = ("error", exc)

    threads = [threading.Thread(target=worker, args=(i, n)) for i, n in enumerate(names)]
    victims = set()
    h = hook(Interrupter("compute", 1, victims))
    for i, t in enumerate(threads):
        t.start()
        if i % 2 == 0:
            victims.add(t.ident)
    for t in threads:
        t.join(60)
    faults.install(None)
    assert not any(t.is_alive() for t in threads)
    for i, name in enumerate(names):
        kind, val = results[i]
        assert kind != "error", f"{name}: {val!r}"
        if threads[i].ident in h.fired:
            assert kind == "interrupted", name
        else:
            assert kind == "ok" and rel_err(val, routines[name][1]()) < 1e-12, name
    assert len(h.fired) >= 1
    eng = blasx.engine()
    assert eng.leaks() == [] and all(w.alive for w in eng.workers)
    assert _blasx_threads() == threads_before
    assert rel_err(routines["syr2k"][0](), routines["syr2k"][1]()) < 1e-12


def test_interrupt_on_the_cpu_alone_reraises_and_the_next_call_works(rand, rel_err, hook):
    """The CPU as the only device runs tasks in the calling thread (``Engine.inline``)."""
    blasx.configure(devices="cpu", tile=TILE)
    routines = _routines(rand)
    hook(Interrupter("plan"))
    with pytest.raises(KeyboardInterrupt):
        routines["gemm"][0]()
    faults.install(None)
    assert rel_err(routines["gemm"][0](), routines["gemm"][1]()) < 1e-12


def test_a_second_ctrl_c_during_an_in_place_call_stops_it_at_once():
    """The first Ctrl-C of a call writing the caller's array waits for the call's end; a second one does not."""
    import signal
    from blasx import dispatch
    blasx.configure(devices="sim:2", tile=TILE)
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with dispatch.whole(True):
            signal.raise_signal(signal.SIGINT)  # held back
            reached.append(1)
            signal.raise_signal(signal.SIGINT)  # raised now
            reached.append(2)
    assert reached == [1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("devices", ["sim:3,slow=4", "cpu", pytest.param("cuda", marks=ON_GPUS)])
def test_ctrl_c_during_a_convolution_into_out_writes_it_whole(devices):
    """blasx.dnn layers writing the caller's out= follow the in-place rule: Ctrl-C takes effect once out is
    whole (it was left 24-86% unwritten), on the CPU alone too (a layer is several steps there); out is whole
    and right, or untouched where the interrupt came before the call."""
    import _thread
    from blasx import dnn
    blasx.configure(devices=devices, tile=16 if devices.startswith("sim") else None)
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4, 8, 24, 24)), rng.standard_normal((16, 8, 3, 3))
    ref = dnn.conv2d(x, w, None, 1, 1)
    dy = rng.standard_normal((4, 16, 24, 24))
    ref_t = dnn.conv_transpose2d(dy, w, None, 1, 1)
    for call, out, want in ((lambda o: dnn.conv2d(x, w, None, 1, 1, out=o), np.empty_like(ref), ref),
                            (lambda o: dnn.conv_transpose2d(dy, w, None, 1, 1, out=o), np.empty_like(ref_t), ref_t)):
        t0 = time.perf_counter()
        call(out)
        took = time.perf_counter() - t0
        for frac in (0.2, 0.5):
            out[...] = np.nan
            timer = threading.Timer(took * frac, _thread.interrupt_main)
            try:
                timer.start()
                call(out)
                time.sleep(took + 0.1)  # (the interrupt lands here if the call was quicker)
            except KeyboardInterrupt:
                pass
            timer.join()
            if np.isnan(out).all():  # (the interrupt came before the call began: out untouched)
                continue
            np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)  # whole, never part (sims: sum order)


def _start_with_a_sigint(raises):
    """A new sim:2 engine started with a SIGINT arriving as each worker thread starts; ``raises`` comes out of
    start(). Returns its workers, checked running."""
    from blasx.runtime import engine as E
    real = E._start_once

    def interrupted_start(w):
        signal.raise_signal(signal.SIGINT)
        real(w)
    E._start_once = interrupted_start
    try:
        blasx.configure(devices="sim:2")
        with pytest.raises(raises):
            blasx.engine().start()
    finally:
        E._start_once = real
    workers = blasx.engine().workers
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    return workers


def test_a_ctrl_c_while_workers_start_is_recorded_then_raised_once_they_run():
    """Thread.start() interrupted after it launched the thread looks unstarted, and was started again (a twin
    that shutdown never joins): the engine's start records a SIGINT and raises it once every worker runs."""
    from blasx.runtime.latch import sigint_recorded
    with sigint_recorded() as replay:
        signal.raise_signal(signal.SIGINT)
        for _ in range(1000):  # (bytecodes where a raised KeyboardInterrupt would surface)
            pass
    with pytest.raises(KeyboardInterrupt):
        replay()
    workers = _start_with_a_sigint(KeyboardInterrupt)
    blasx.shutdown()
    assert not any(w.is_alive() for w in workers)


def test_a_call_cancelled_by_a_ctrl_c_during_shutdown_says_so():
    """The Ctrl-C came in the thread shutting the engine down, not in the call's own thread."""
    blasx.configure(devices="sim:2,slow=50")
    a = np.random.default_rng(0).random((600, 600))
    blasx.gemm(1.0, a[:64, :64], a[:64, :64])
    out = []

    def other():
        try:
            blasx.gemm(1.0, a, a)
            out.append("finished")
        except Exception as e:  # noqa: BLE001
            out.append(str(e))
    t = threading.Thread(target=other)
    t.start()
    time.sleep(0.2)
    timer = threading.Timer(0.1, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            blasx.shutdown()
    finally:
        timer.join()
        t.join(60)
    assert out == ["gemm was cancelled by KeyboardInterrupt in a thread shutting the engine down "
                   "(blasx.shutdown / configure)"]
    blasx.configure(devices="sim:2")


def test_a_sigint_handler_raising_something_else_while_workers_start_leaves_a_started_engine():
    """A user's handler (a Ctrl-C that quits: SystemExit) runs once the workers run, and its exception is raised
    with the engine started, not halfway (workers twice, and a shutdown that hung)."""
    calls = []

    def quits(signum, frame):
        calls.append(signum)
        raise SystemExit(3)
    old = signal.signal(signal.SIGINT, quits)
    try:
        workers = _start_with_a_sigint(SystemExit)
    finally:
        signal.signal(signal.SIGINT, old)
    assert len(calls) == 1
    assert blasx.gemm(1.0, np.ones((8, 8)), np.ones((8, 8)))[0, 0] == 8 and blasx.engine().workers == workers
    blasx.shutdown()
    assert not any(w.is_alive() for w in workers)
    blasx.configure(devices="sim:2")
