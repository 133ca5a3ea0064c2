"""blasx.dask on CUDA GPUs (marker ``gpu``; skipped where CuPy finds none): one worker owning
every GPU, with numpy and with CuPy chunks, and one worker per GPU (each seeing only its own)."""

from __future__ import annotations

import numpy as np
import pytest

import blasx

cupy = pytest.importorskip("cupy")
da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")
import dask  # noqa: E402

import blasx.dask as bd  # noqa: E402

NGPU = blasx.session._cuda_count()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="no CUDA GPU")]


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=True,
                                       dashboard_address=None, worker_dashboard_address=None)
    c = distributed.Client(cluster)
    bd.configure(c, devices="cuda", tile=512, cache_bytes=1 << 30)
    yield c
    c.close()
    cluster.close()


def _rel(x, ref):
    x = cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else np.asarray(x)
    return np.linalg.norm(x - ref) / np.linalg.norm(ref)


def _problem(n=3000, k=2500, m=2000, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, k)), rng.standard_normal((k, m))


def test_host_chunks_on_every_gpu_of_one_worker(client):
    a, b = _problem()
    xa, xb = da.from_array(a, chunks=(1000, 700)), da.from_array(b, chunks=(900, 1000))
    tri = np.tril(a[:2500, :2500]) / 2500 + np.eye(2500)  # diagonally dominant: a well-conditioned solve
    from blasx.dask import graph
    assert graph._gpu_workers()  # host blocks read from the GPUs: "auto" makes the product one super-block
    assert bd.matmul(xa, xb).numblocks == (1, 1)
    c, s, x = dask.compute(bd.matmul(xa, xb), bd.syrk(1.0, xa, lower=1),
                           bd.trsm(1.0, da.from_array(tri, chunks=800), xb, lower=1))
    assert _rel(c, a @ b) < 1e-12
    assert _rel(np.tril(s), np.tril(a @ a.T)) < 1e-12
    assert _rel(tri @ x, b) < 1e-12


def test_cupy_chunks(client):
    a, b = _problem(seed=1)
    xa = da.from_array(a, chunks=(1000, 700)).map_blocks(cupy.asarray)
    xb = da.from_array(b, chunks=(900, 1000)).map_blocks(cupy.asarray)
    c = bd.matmul(xa, xb)
    assert isinstance(c._meta, cupy.ndarray)
    got = c.compute()
    assert isinstance(got, cupy.ndarray)
    assert _rel(got, a @ b) < 1e-12
    with bd.offload():
        assert _rel((xa.astype(np.float32) @ xb.astype(np.float32)).compute(), a @ b) < 1e-5


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
def test_one_worker_per_gpu():
    workers = {i: {"cls": distributed.Nanny, "options": {"nthreads": 1, "env": {"CUDA_VISIBLE_DEVICES": str(i)}}}
               for i in range(2)}
    cluster = distributed.SpecCluster(workers=workers, scheduler={"cls": distributed.Scheduler,
                                                                  "options": {"dashboard_address": None}})
    with distributed.Client(cluster) as c:
        bd.configure(c, devices="cuda", tile=512, cache_bytes=1 << 30, cpu=False)
        assert sorted(len(v) for v in c.run(lambda: [d.name for d in blasx.engine().devices]).values()) == [1, 1]
        a, b = _problem(seed=2)
        got = bd.matmul(da.from_array(a, chunks=1000), da.from_array(b, chunks=1000)).compute()
        assert _rel(got, a @ b) < 1e-12
    cluster.close()
