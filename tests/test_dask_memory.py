"""blasx.dask under a worker memory limit: zarr operands larger than the workers' memory, and a
worker killed during a call (Dask runs its tasks again; the result is right or the call fails)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")
zarr = pytest.importorskip("zarr")
import dask  # noqa: E402

import blasx.dask as bd  # noqa: E402

LIMIT = 420e6  # per worker; the nanny restarts a worker past 95% of it (a worker starts near 230 MB)


@pytest.fixture(scope="module")
def client():
    settings = {"distributed.worker.memory.spill": False, "distributed.worker.memory.target": False,
                "distributed.worker.memory.pause": False, "distributed.worker.memory.terminate": 0.95}
    with dask.config.set(settings):
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, memory_limit=LIMIT,
                                           dashboard_address=None, worker_dashboard_address=None)
    c = distributed.Client(cluster)
    bd.configure(c, devices="cpu")
    yield c
    c.close()
    cluster.close()


def test_zarr_operands_larger_than_the_workers_memory(client, tmp_path):
    """a (128 x 262144) and b (262144 x 128) in zarr, 537 MB together, more than the two workers'
    headroom under the limit: the product completes, each worker within the memory bound."""
    m, k, kb = 128, 262144, 8192
    rng = np.random.default_rng(0)
    za = zarr.create_array(store=str(tmp_path / "a.zarr"), shape=(m, k), chunks=(m, kb), dtype="f8")
    zb = zarr.create_array(store=str(tmp_path / "b.zarr"), shape=(k, m), chunks=(kb, m), dtype="f8")
    ref = np.zeros((m, m))
    for j in range(0, k, 8 * kb):  # written (and the reference made) a slab at a time
        x, y = rng.random((m, 8 * kb)), rng.random((8 * kb, m))
        za[:, j:j + 8 * kb], zb[j:j + 8 * kb, :] = x, y
        ref += x @ y
    a, b = da.from_zarr(str(tmp_path / "a.zarr")), da.from_zarr(str(tmp_path / "b.zarr"))
    assert a.nbytes + b.nbytes > 2 * (0.95 * LIMIT - 230e6)
    bd.memory_peaks(client, reset=True)
    bd.matmul(a, b).to_zarr(str(tmp_path / "c.zarr"))
    peaks = bd.memory_peaks(client)
    piece = m * kb * 8
    budget = m * m * 8 + (m * m * 8 + 2 * (piece + piece))  # R = 1 block, t = 1
    assert max(peaks.values()) <= budget, (peaks, budget)
    got = zarr.open_array(str(tmp_path / "c.zarr"))[:]
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-12
    assert len(client.scheduler_info()["workers"]) == 2  # no worker was restarted for memory


def test_worker_killed_during_a_call(client):
    """A worker process dies mid-call: Dask runs its tasks on the live and the restarted worker,
    and the result is still exact (or the call raises KilledWorker, never a wrong answer)."""
    bd.configure(client, devices="sim:2,dilate=30")  # slow sims: the call is still running at the kill
    try:
        n = 512
        rng = np.random.default_rng(1)
        a, b = rng.random((n, n)), rng.random((n, n))
        c = bd.matmul(da.from_array(a, chunks=128), da.from_array(b, chunks=128)).persist()
        deadline = time.time() + 60
        while not any(f.status == "finished" for f in distributed.futures_of(c)) and time.time() < deadline:
            time.sleep(0.05)
        assert not all(f.status == "finished" for f in distributed.futures_of(c)), "finished before the kill"
        victim = next(iter(client.scheduler_info()["workers"]))
        os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
        try:
            got = c.compute()
        except distributed.KilledWorker:
            return  # a clear error is allowed; a wrong result is not
        assert np.linalg.norm(got - a @ b) / np.linalg.norm(a @ b) < 1e-13
    finally:
        bd.configure(client, devices="cpu")
