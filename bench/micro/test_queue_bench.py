"""Micro-benchmarks of the global task queue (run: pytest bench/micro/test_queue_bench.py).

The queue is a ``collections.deque`` used without a lock (``runtime/queue.py``):
``put`` is an append, ``get`` a popleft, each atomic under the GIL. Items are
real GEMM tasks (a 32 x 32 grid of C tiles, 1024 tasks). The multi-threaded
case runs 4 long-lived threads, each putting and getting its share, so the
time includes the GIL hand-offs that 4 workers and a submitting thread cause;
thread start-up is not timed. Divide by OPS for a per-task cost.
"""

from __future__ import annotations

import threading

import pytest

from blasx.runtime.queue import TaskQueue
from blasx.runtime.plans import plan_gemm

TILE = 256
TASKS = plan_gemm(32 * TILE, 32 * TILE, 4 * TILE, TILE, 0, 0)  # 1024 tasks of 4 k-steps
OPS = len(TASKS)


def test_put_get_one_task(benchmark):
    q = TaskQueue()
    task = TASKS[0]

    def pair():
        q.put(task)
        q.get()

    benchmark(pair)
    assert len(q) == 0


def test_put_many_then_drain_one_thread(benchmark):
    """A call's submit (``put_many``) and every task pulled by one worker (``get`` until None)."""
    q = TaskQueue()

    def run():
        q.put_many(TASKS)
        n = 0
        while q.get() is not None:
            n += 1
        return n

    assert benchmark(run) == OPS
    benchmark.extra_info["tasks"] = OPS


def test_put_then_get_each_one_thread(benchmark):
    q = TaskQueue()

    def run():
        for t in TASKS:
            q.put(t)
        for _ in TASKS:
            q.get()

    benchmark(run)
    assert len(q) == 0
    benchmark.extra_info["tasks"] = OPS


@pytest.mark.parametrize("threads", [1, 4])
def test_put_get_from_threads(benchmark, threads):
    """``threads`` threads each put their share of the tasks one by one, then get as many.

    Gets may return another thread's task: what is checked is that none is
    lost or duplicated across the round.
    """
    q = TaskQueue()
    share = [TASKS[i::threads] for i in range(threads)]
    go, done = threading.Barrier(threads + 1), threading.Barrier(threads + 1)
    got: list[list] = [[] for _ in range(threads)]
    stop = False

    def body(i):
        while True:
            go.wait()
            if stop:
                return
            mine, out = share[i], got[i]
            out.clear()
            for t in mine:
                q.put(t)
            while len(out) < len(mine):
                t = q.get()
                if t is not None:
                    out.append(t)
            done.wait()

    pool = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(threads)]
    for th in pool:
        th.start()

    def run():
        go.wait()
        done.wait()

    try:
        benchmark.pedantic(run, rounds=50, iterations=1, warmup_rounds=2)
    finally:
        stop = True
        go.wait()
        for th in pool:
            th.join()
    assert sorted(t.tid for g in got for t in g) == list(range(OPS))
    assert len(q) == 0
    benchmark.extra_info["tasks"] = OPS
