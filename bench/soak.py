"""Soak: many threads of random level-3 calls on the sim, with device faults and Ctrl-C injected.

    python -m bench.soak --minutes N [--threads 16] [--seed S] [--devices sim:3,rate=2e9] [--cpu]

Every call's routine, dtype, shapes (0-size included), memory layout and flags are random;
its result is checked against scipy.linalg.blas (numpy for matmul). Faults come from the
test hooks of ``blasx.runtime.faults``: a device error at a random tile copy (that device
dies; its tasks move on, and ``blasx.reset()`` brings it back), and a KeyboardInterrupt in a
caller's thread mid-compute (its call is cancelled; the arrays of a call that returns a new
array must be untouched). Every ``--check`` seconds all threads pause and the idle engine is
audited for leaks (``Engine.leaks``). Prints calls, outcomes, faults injected, interrupts,
wrong answers (must be 0), leaks (must be 0) and the peak RSS; exits 1 if either is not 0.
"""

from __future__ import annotations

import argparse
import importlib
import random
import resource
import sys
import threading
import time

import numpy as np
import scipy.linalg.blas as S

import blasx

faults = importlib.import_module("blasx.runtime.faults")
level3 = importlib.import_module("blasx.level3")

DTYPES = (np.float32, np.float64, np.complex64, np.complex128)
TOL = {np.dtype(np.float32): 2e-4, np.dtype(np.float64): 1e-10, np.dtype(np.complex64): 2e-4,
       np.dtype(np.complex128): 1e-10}
ROUTINES = ("gemm", "symm", "hemm", "syrk", "herk", "syr2k", "her2k", "trmm", "trsm", "matmul")


def _arr(rng: np.random.Generator, shape, dtype, order):
    x = rng.uniform(-1, 1, shape)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.uniform(-1, 1, shape)
    return np.asarray(x, dtype=dtype, order=order).copy(order=order)


def _dim(rng: random.Random) -> int:
    return rng.choice((0, 1, rng.randint(2, 40), rng.randint(40, 160)))


def make_case(rng: random.Random, nrng: np.random.Generator):
    """(name, blasx call, reference call, arrays, the array the call may write or None)."""
    name = rng.choice(ROUTINES)
    complex_only = name in ("hemm", "herk", "her2k")
    dtype = np.dtype(rng.choice(DTYPES[2:] if complex_only else DTYPES))
    order = rng.choice("CF")
    m, n, k = _dim(rng), _dim(rng), _dim(rng)
    alpha = complex(rng.uniform(-2, 2), rng.uniform(-1, 1)) if dtype.kind == "c" else rng.uniform(-2, 2)
    beta = rng.choice((0.0, rng.uniform(-1, 1)))
    a_ = lambda shape: _arr(nrng, shape, dtype, order)  # noqa: E731
    if name == "matmul":
        a, b = a_((m, k)), a_((k, n))
        return name, (lambda: blasx.matmul(a, b)), (lambda: a @ b), (a, b), None
    fn = S.get_blas_funcs(name, dtype=dtype)
    overwrite = rng.random() < 0.3
    if name == "gemm":
        ta, tb = rng.randint(0, 2), rng.randint(0, 2)
        a = a_((k, m) if ta else (m, k))
        b = a_((n, k) if tb else (k, n))
        c = _arr(nrng, (m, n), dtype, "F") if beta or overwrite else None
        kw = dict(trans_a=ta, trans_b=tb, beta=beta, c=c)
        return (name, (lambda: blasx.gemm(alpha, a, b, overwrite_c=overwrite, **kw)),
                (lambda: fn(alpha, a, b, **{**kw, "c": None if c is None else c.copy(order="F")})),
                (a, b) + ((c,) if c is not None and not overwrite else ()), c if overwrite else None)
    if name in ("symm", "hemm"):
        side, lower = rng.randint(0, 1), rng.randint(0, 1)
        a = a_((m, m) if side == 0 else (n, n))
        b = a_((m, n))
        c = _arr(nrng, (m, n), dtype, "F")
        f = getattr(blasx, name)
        return (name, (lambda: f(alpha, a, b, beta=beta, c=c, side=side, lower=lower, overwrite_c=overwrite)),
                (lambda: fn(alpha, a, b, beta=beta, c=c.copy(order="F"), side=side, lower=lower)),
                (a, b) if overwrite else (a, b, c), c if overwrite else None)
    if name in ("syrk", "herk", "syr2k", "her2k"):
        two = name.endswith("2k")
        k = max(k, 1)  # scipy's ?syrk family rejects lda for k = 0 and returns c unscaled
        trans = rng.choice((0, 2) if name.startswith("her") else (0, 1))
        lower = rng.randint(0, 1)
        if name == "herk":
            alpha = rng.uniform(-2, 2)
        if name.startswith("her"):
            beta = float(np.real(beta))
        a = a_((k, n) if trans else (n, k))
        b = a_((k, n) if trans else (n, k))
        c = _arr(nrng, (n, n), dtype, "F")
        f = getattr(blasx, name)
        args = (alpha, a, b) if two else (alpha, a)
        return (name, (lambda: f(*args, beta=beta, c=c, trans=trans, lower=lower, overwrite_c=overwrite)),
                (lambda: fn(*args, beta=beta, c=c.copy(order="F"), trans=trans, lower=lower)),
                ((a, b) if two else (a,)) + (() if overwrite else (c,)), c if overwrite else None)
    side, lower, ta, diag = rng.randint(0, 1), rng.randint(0, 1), rng.randint(0, 2), rng.randint(0, 1)
    s = m if side == 0 else n
    a = np.asarray(_arr(nrng, (s, s), dtype, order) + 4 * np.eye(s, dtype=dtype), order=order)  # well conditioned
    b = _arr(nrng, (m, n), dtype, "F")
    f = getattr(blasx, name)
    kw = dict(side=side, lower=lower, trans_a=ta, diag=0 if name == "trsm" else diag)
    return (name, (lambda: f(alpha, a, b, overwrite_b=overwrite, **kw)),
            (lambda: fn(alpha, a, b.copy(order="F"), **kw)), (a,) if overwrite else (a, b), b if overwrite else None)


class Injector:
    """The fault hook: device errors at tile copies, KeyboardInterrupts in callers mid-compute."""

    def __init__(self, seed: int, p_device: float, p_interrupt: float, callers: set) -> None:
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.p_device, self.p_interrupt = p_device, p_interrupt
        self.callers = callers
        self.device_faults = 0
        self.interrupts = 0
        self.interrupted: set = set()
        self.enabled = True

    def __call__(self, phase, dev, task) -> None:
        if not self.enabled or task is None:
            return
        with self.lock:
            roll = self.rng.random()
        if phase == "load" and roll < self.p_device:
            with self.lock:
                self.device_faults += 1
            raise blasx.DeviceError(f"{dev.name}: soak-injected device error")
        if phase == "compute" and roll < self.p_interrupt:
            call = task.call
            owner = next((t for t in list(self.callers) if level3.running_call(t) is call), None)
            with self.lock:
                if owner is None or call.cid in self.interrupted:
                    return
                self.interrupted.add(call.cid)
                self.interrupts += 1
            faults.interrupt(owner)
            for _ in range(2000):  # hold this operation until the caller has cancelled the call
                if call.failed:
                    return
                time.sleep(0.005)


class Soak:
    def __init__(self, args) -> None:
        self.args = args
        self.deadline = time.monotonic() + args.minutes * 60
        self.lock = threading.Lock()
        self.counts = {"calls": 0, "ok": 0, "interrupted": 0, "device_failed": 0, "zero_size": 0}
        self.wrong: list[str] = []
        self.leaks: list[str] = []
        self.resets = 0
        self.checks = 0
        self.callers: set = set()
        self.injector = Injector(args.seed, args.p_device, args.p_interrupt, self.callers)
        self.pause = threading.Event()
        self.paused = threading.Semaphore(0)
        self.resume = threading.Event()

    def count(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1

    def bad(self, msg: str) -> None:
        with self.lock:
            self.wrong.append(msg)

    def thread_body(self, i: int) -> None:
        self.callers.add(threading.get_ident())
        rng = random.Random(self.args.seed * 1000 + i)
        nrng = np.random.default_rng(self.args.seed * 1000 + i)
        while time.monotonic() < self.deadline:
            if self.pause.is_set():
                self.paused.release()
                self.resume.wait()
                continue
            try:
                self.one_call(rng, nrng)
            except KeyboardInterrupt:
                self.bad(f"thread {i}: a KeyboardInterrupt outside a call")

    def one_call(self, rng, nrng) -> None:
        name, run, ref, inputs, out = make_case(rng, nrng)
        copies = [x.copy() for x in inputs]
        try:
            want = ref()
        except Exception:  # noqa: BLE001 - arguments scipy refuses: skip
            return
        self.count("calls")
        if want.size == 0:
            self.count("zero_size")
        try:
            got = run()
        except KeyboardInterrupt:
            self.count("interrupted")
            for x, x0 in zip(inputs, copies):
                if not np.array_equal(x, x0, equal_nan=True):
                    self.bad(f"{name}: an input was written by an interrupted call")
            return
        except blasx.DeviceError as exc:
            if "soak-injected" not in str(exc) and "no live device" not in str(exc):
                self.bad(f"{name}: unexpected DeviceError {exc}")
            self.count("device_failed")
            return
        except Exception as exc:  # noqa: BLE001 - counted as a wrong answer
            self.bad(f"{name} {want.dtype} {want.shape}: raised {exc!r}")
            return
        for x, x0 in zip(inputs, copies):
            if not np.array_equal(x, x0, equal_nan=True):
                self.bad(f"{name}: an input was written")
        if got.shape != want.shape or got.dtype != want.dtype:
            self.bad(f"{name}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
            return
        den = np.linalg.norm(want)
        err = np.linalg.norm(got - want) / (den if den else 1.0)
        if not err <= TOL[want.dtype] * 10:
            self.bad(f"{name} {want.dtype} {want.shape}: relative error {err:.3g}")
            return
        self.count("ok")

    def checkpoint(self, threads) -> None:
        """Pause every thread between calls, audit the idle engine, bring dead devices back."""
        self.pause.set()
        alive = [t for t in threads if t.is_alive()]
        for _ in alive:
            if not self.paused.acquire(timeout=120):
                self.bad("a thread did not pause within 120 s (a hung call?)")
                break
        self.injector.enabled = False
        eng = blasx.engine()
        found = eng.leaks()
        self.checks += 1
        if found:
            self.leaks += found
        if any(not w.alive for w in eng.workers):
            blasx.reset()
            self.resets += 1
        self.injector.enabled = True
        self.pause.clear()
        self.resume.set()
        time.sleep(0.05)
        self.resume.clear()

    def run(self) -> int:
        a = self.args
        blasx.configure(devices=a.devices, tile=a.tile, cpu=True if a.cpu else False)
        faults.install(self.injector)
        t0 = time.monotonic()
        threads = [threading.Thread(target=self.thread_body, args=(i,), name=f"soak-{i}") for i in range(a.threads)]
        for t in threads:
            t.start()
        next_check = time.monotonic() + a.check
        while any(t.is_alive() for t in threads):
            time.sleep(0.2)
            if time.monotonic() >= next_check and time.monotonic() < self.deadline:
                self.checkpoint(threads)
                next_check = time.monotonic() + a.check
        faults.install(None)
        self.checks += 1
        self.leaks += blasx.engine().leaks()
        wall = time.monotonic() - t0
        c, inj = self.counts, self.injector
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"soak: {a.minutes:g} min, {a.threads} threads, seed {a.seed}, devices {a.devices}"
              f"{' + cpu' if a.cpu else ''}, tile {a.tile}; wall {wall:.0f} s")
        print(f"calls made:        {c['calls']} ({c['zero_size']} with a 0-size result)")
        print(f"  right answers:   {c['ok']}")
        print(f"  interrupted:     {c['interrupted']}")
        print(f"  device-failed:   {c['device_failed']}")
        print(f"faults injected:   {inj.device_faults} device errors; devices brought back by reset(): {self.resets}")
        print(f"interrupts:        {inj.interrupts}")
        print(f"wrong answers:     {len(self.wrong)}")
        for w in self.wrong[:20]:
            print(f"    {w}")
        print(f"leaks:             {len(self.leaks)} (over {self.checks} idle audits)")
        for w in self.leaks[:20]:
            print(f"    {w}")
        print(f"peak memory (RSS): {rss:.0f} MiB")
        blasx.shutdown()
        return 1 if self.wrong or self.leaks else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--devices", default="sim:3")
    p.add_argument("--tile", type=int, default=32)
    p.add_argument("--cpu", action="store_true", help="a CPU worker beside the sims (by demand)")
    p.add_argument("--check", type=float, default=20.0, help="seconds between idle leak audits")
    p.add_argument("--p-device", type=float, default=0.0005, help="chance of a device error per tile copy")
    p.add_argument("--p-interrupt", type=float, default=0.002, help="chance of a Ctrl-C per tile kernel")
    return Soak(p.parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
