"""blasx across a fork and at interpreter exit, each in a subprocess with a deadline: a child forked while
another parent thread held one of blasx's locks (offload's, the perf-db table's, a Network's, from_torch's) or
was importing CuPy works (it hung); sgemm & co. pickle (a process pool takes them); calls in flight in
non-daemon threads when the main thread ends finish (they were cancelled)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import blasx

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _run(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "BLASX_DEVICES": "sim:2"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)


FORKS = """
    import os, signal, threading
    def forks(n, child):
        bad = 0
        for _ in range(n):
            pid = os.fork()
            if pid == 0:
                signal.alarm(10)
                os._exit(0 if child() else 3)
            bad += os.waitpid(pid, 0)[1] != 0
        return bad
"""


def test_a_child_forked_beside_offload_blocks_and_network_calls_works():
    r = _run(FORKS + """
    import numpy as np, blasx, torch
    from blasx import dnn
    blasx.configure(devices="sim:2", tile=16)
    a = np.random.rand(30, 30); ref = a @ a
    def blocks():
        while True:
            with blasx.offload(threshold=1e12):
                pass
    threading.Thread(target=blocks, daemon=True).start()
    def use():
        with blasx.offload(threshold=0):
            return np.allclose(a @ a, ref)
    print("offload", forks(40, use))
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU()).eval()
    net = dnn.from_torch(m, (1, 3, 8, 8)).compile()
    x = np.random.rand(2, 3, 8, 8).astype(np.float32)
    want = net(x)
    threading.Thread(target=lambda: [net(x) for _ in iter(int, 1)], daemon=True).start()
    print("network", forks(5, lambda: np.allclose(net(x), want)))
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "offload 0" in r.stdout and "network 0" in r.stdout, r.stdout


def test_prefixed_gemms_pickle():
    for name in ("sgemm", "dgemm", "cgemm", "zgemm", "dsyrk"):
        f = getattr(blasx, name)
        assert pickle.loads(pickle.dumps(f)) is f


def test_calls_of_non_daemon_threads_finish_when_the_main_thread_ends():
    r = _run("""
    import threading, time, numpy as np, blasx
    blasx.configure(devices="sim:2", tile=16)
    a = np.random.rand(200, 200)
    ok = []
    def work():
        for _ in range(30):
            ok.append(np.allclose(blasx.gemm(1.0, a, a), a @ a))
        print("worker", len(ok), all(ok), flush=True)
    threading.Thread(target=work).start()
    time.sleep(0.05)  # (its first call in flight)
    print("main ends", flush=True)
    """)
    assert r.returncode == 0 and "worker 30 True" in r.stdout, (r.stdout, r.stderr[-2000:])
    assert "CallCancelled" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_failed_cupy_import_is_not_retried(monkeypatch):
    from blasx import session
    monkeypatch.setattr(session, "_NO_CUPY", [])
    monkeypatch.setitem(sys.modules, "cupy", None)  # (import cupy raises ImportError)
    assert session._cuda_count() == 0 and session._NO_CUPY == [True]
    monkeypatch.delitem(sys.modules, "cupy")
    assert session._cuda_count() == 0  # not imported again
