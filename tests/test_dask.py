"""blasx.dask against scipy. Every routine and flag, chunkings that are irregular, unequal between the operands
or single-chunk, super-blocks and chains on dask's threads in this process with one blasx engine on its CPU
(``threads``: the adapter's graphs and block calls; the engine's devices are tested elsewhere, and
``test_local_threaded_scheduler`` runs the adapter on two sims); on a LocalCluster of two worker processes, each
with one blasx engine on its CPU (``client``: what the cluster adds, at ~3 ms a task on 2 cores): shapes, mixed
types, zarr and memmap operands, offload, progress, argument errors and the memory budget."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
import scipy.linalg.blas as sb

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")
import dask  # noqa: E402

import blasx.dask as bd  # noqa: E402

TOL = {np.dtype("f4"): 1e-5, np.dtype("f8"): 1e-12, np.dtype("c8"): 1e-5, np.dtype("c16"): 1e-12}


@pytest.fixture
def threads():
    """dask.compute on dask's threads in this process (even beside a client), on one engine on its CPU."""
    import blasx
    blasx.configure(devices="cpu")
    with dask.config.set(scheduler="threads"):
        yield
    blasx.shutdown()


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=None, worker_dashboard_address=None)
    c = distributed.Client(cluster)
    bd.configure(c, devices="cpu")
    yield c
    c.close()
    cluster.close()


def _rand(rng, shape, dtype):
    x = rng.uniform(-1, 1, shape)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.uniform(-1, 1, shape)
    return x.astype(dtype)


def _tri(rng, n, dtype):
    """A well-conditioned triangular solve: a strong diagonal."""
    return _rand(rng, (n, n), dtype) + 4 * n ** 0.5 * np.eye(n, dtype=dtype)


# chunkings along one dimension of 60: irregular, regular, single chunk
IRR, REG, ONE = (7, 23, 1, 29), (15, 15, 15, 15), (60,)


def _check(rel_err, results, refs, dtypes):
    for got, ref, dt in zip(dask.compute(*results), refs, dtypes):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        assert rel_err(got, ref) < TOL[np.dtype(dt)] * 100


def _gemm_cases(rng, chunkings):
    """(arguments of bd.gemm, scipy's result, dtype) for each chunking, flag pair and (beta, with c); c's NaN
    where beta is 0 must not be read."""
    m = k = n = 60
    for n_case, (ch, (ta, tb), (beta, with_c)) in enumerate(itertools.product(
            chunkings, [(0, 0), (1, 0), (0, 2), (2, 1)], [(0.0, False), (0.5, True), (0.0, True)])):
        dt = ("f8", "c8")[n_case % 2]
        a = _rand(rng, (m, k) if ta == 0 else (k, m), dt)
        b = _rand(rng, (k, n) if tb == 0 else (n, k), dt)
        c = _rand(rng, (m, n), dt) if with_c else None
        if with_c and beta == 0:
            c[0, 0] = np.nan  # beta = 0: c is not read
        alpha = 1.5 - 0.5j if dt == "c8" else 1.5
        ref = sb.get_blas_funcs("gemm", (a, b))(alpha, a, b, beta=beta, c=np.nan_to_num(c) if c is not None else None,
                                               trans_a=ta, trans_b=tb)
        xc = da.from_array(c, chunks=(ch[1], ch[3])) if c is not None else None
        args = (alpha, da.from_array(a, chunks=(ch[0], ch[1])), da.from_array(b, chunks=(ch[2], ch[3])))
        yield args, dict(beta=beta, c=xc, trans_a=ta, trans_b=tb), ref, dt


def test_gemm_chunkings_and_flags(threads, rel_err):
    chunkings = [(IRR, REG, REG, ONE), (ONE, ONE, ONE, ONE), (REG, IRR, (31, 29), (4, 56)), (IRR, IRR, IRR, IRR)]
    cases = list(_gemm_cases(np.random.default_rng(1), chunkings))
    _check(rel_err, [bd.gemm(*args, **kw) for args, kw, _, _ in cases], [c[2] for c in cases], [c[3] for c in cases])


@pytest.mark.parametrize("group", [20, 100])
def test_gemm_super_blocks_for_every_flag_and_chunking(threads, rel_err, group):
    """blasx.dask.group merges output blocks into super-blocks (one call a step on their joined pieces): results
    as scipy's for every chunking and flag, C's old values never read; chunks follow the super-blocks where
    C is not read, the operands' own boundaries where it is (beta != 0)."""
    chunkings = [(IRR, REG, REG, ONE), (REG, IRR, (31, 29), (4, 56)), (IRR, IRR, IRR, IRR)]
    cases = list(_gemm_cases(np.random.default_rng(11), chunkings))
    out = []
    for args, kw, _, _ in cases:
        with dask.config.set({"blasx.dask.group": group}):
            got = bd.gemm(*args, **kw)
        with dask.config.set({"blasx.dask.group": "off"}):
            plain = bd.gemm(*args, **kw).chunks
        if kw["beta"] != 0:  # C is read: the blocks of every operand's boundaries, as without super-blocks
            assert got.chunks == plain
        else:
            assert all(min(x) >= min(group, 60) for x in got.chunks) and got.chunks != plain, got.chunks
        out.append(got)
    _check(rel_err, out, [c[2] for c in cases], [c[3] for c in cases])
    with dask.config.set({"blasx.dask.group": "several"}), pytest.raises(ValueError, match="blasx.dask.group"):
        bd.matmul(da.ones((4, 4), chunks=2), da.ones((4, 4), chunks=2))


def test_gemm_shapes_and_mixed_types(client, rel_err):
    rng = np.random.default_rng(2)
    cases = [((1, 60), (60, 1)), ((60, 1), (1, 45)), ((37, 0), (0, 11)), ((0, 5), (5, 3))]
    out, refs = [], []
    for sa, sb_ in cases:
        a, b = _rand(rng, sa, "f8"), _rand(rng, sb_, "f8")
        out.append(bd.gemm(1.0, da.from_array(a, chunks=7), da.from_array(b, chunks=5)))
        refs.append(a @ b)
    a32, b64 = _rand(rng, (30, 20), "f4"), _rand(rng, (20, 10), "c16")
    out.append(bd.gemm(2.0, da.from_array(a32, chunks=9), da.from_array(b64, chunks=6)))
    refs.append(sb.zgemm(2.0, a32, b64))
    _check(rel_err, out, refs, ["f8"] * 4 + ["c16"])


def _level3_cases(rng):
    """(blasx.dask call, scipy reference, dtype) for every flag of every routine."""
    n, m = 45, 38
    chunks_sq, chunks_b = ((10, 20, 15), (17, 28)), ((25, 20), (9, 29))
    cases = []
    for routine, dt in [("symm", "f8"), ("hemm", "c16")]:
        for side, lower in itertools.product((0, 1), (0, 1)):
            a = _rand(rng, (n, n), dt)
            a[np.tril_indices(n, -1) if not lower else np.triu_indices(n, 1)] = np.nan  # never read
            b = _rand(rng, (n, m) if side == 0 else (m, n), dt)
            c = _rand(rng, b.shape, dt)
            ref = getattr(sb, ("d" if dt == "f8" else "z") + routine)(0.7, a, b, 0.3, c, side=side, lower=lower)
            cases.append((getattr(bd, routine)(0.7, da.from_array(a, chunks=chunks_sq),
                                               da.from_array(b, chunks=chunks_b if side == 0 else chunks_b[::-1]),
                                               0.3, da.from_array(c, chunks=13), side=side, lower=lower), ref, dt))
    for routine, dt, transes in [("syrk", "f8", (0, 1, 2)), ("syrk", "c8", (0, 1)), ("herk", "c16", (0, 2)),
                                 ("syr2k", "f4", (0, 1)), ("her2k", "c16", (0, 2))]:
        for trans, lower in itertools.product(transes, (0, 1)):
            a = _rand(rng, (n, m) if trans == 0 else (m, n), dt)
            b = _rand(rng, a.shape, dt)
            c = _rand(rng, (n, n), dt)
            alpha = 0.9 if routine == "herk" or dt[0] == "f" else 0.9 + 0.2j
            fn = getattr(sb, {"f4": "s", "f8": "d", "c8": "c", "c16": "z"}[dt] + routine)
            two = routine.endswith("2k")
            ref = fn(alpha, a, b, 0.4, c, trans=trans, lower=lower) if two else fn(alpha, a, 0.4, c, trans=trans,
                                                                                  lower=lower)
            xa = da.from_array(a, chunks=(chunks_b if trans == 0 else chunks_b[::-1]))
            xb = da.from_array(b, chunks=11)
            xc = da.from_array(c, chunks=chunks_sq)
            got = (getattr(bd, routine)(alpha, xa, xb, 0.4, xc, trans=trans, lower=lower) if two else
                   getattr(bd, routine)(alpha, xa, 0.4, xc, trans=trans, lower=lower))
            cases.append((got, ref, dt))
    for routine, dt in [("trmm", "c16"), ("trsm", "c8")]:
        for side, lower, trans, diag in itertools.product((0, 1), (0, 1), (0, 1, 2), (0, 1)):
            a = _tri(rng, n, dt)
            a[np.tril_indices(n, -1) if not lower else np.triu_indices(n, 1)] = np.nan  # never read
            b = _rand(rng, (n, m) if side == 0 else (m, n), dt)
            fn = getattr(sb, {"f8": "d", "c8": "c", "c16": "z"}[dt] + routine)
            ref = fn(1.3, a, b, side=side, lower=lower, trans_a=trans, diag=diag)
            got = getattr(bd, routine)(1.3, da.from_array(a, chunks=chunks_sq),
                                       da.from_array(b, chunks=chunks_b if side == 0 else chunks_b[::-1]),
                                       side=side, lower=lower, trans_a=trans, diag=diag)
            cases.append((got, ref, dt))
    return cases


def test_level3_every_routine_and_flag(threads, rel_err):
    cases = _level3_cases(np.random.default_rng(3))
    _check(rel_err, [c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases])


def test_alpha_zero_and_k_zero(client, rel_err):
    rng = np.random.default_rng(4)
    a, c = _rand(rng, (20, 0), "f8"), _rand(rng, (20, 20), "f8")
    nan = np.full((20, 7), np.nan)
    got = dask.compute(bd.syrk(1.0, da.from_array(a, chunks=6), 0.5, da.from_array(c, chunks=8), lower=1),
                       bd.syrk(0.0, da.from_array(nan, chunks=6), 2.0, da.from_array(c, chunks=8)),
                       bd.gemm(0.0, da.from_array(nan, chunks=6), da.from_array(nan.T, chunks=6), 1.0,
                               da.from_array(c, chunks=8)),
                       bd.trsm(0.0, da.from_array(np.full((20, 20), np.nan), chunks=6), da.from_array(c, chunks=8)))
    assert rel_err(got[0], sb.dsyrk(1.0, a, 0.5, c, lower=1)) < 1e-14
    assert rel_err(got[1], sb.dsyrk(0.0, np.zeros((20, 7)), 2.0, c)) < 1e-14
    assert rel_err(got[2], c) < 1e-14
    assert not got[3].any()


@pytest.mark.parametrize("group", ["off", 4])
def test_empty_dimensions(client, group):
    """An output with a zero dimension (chunked other dimensions, super-blocks or not; TRSM whose later blocks
    read its own output) is an empty array of the right shape, with no error."""
    tri = da.from_array(np.triu(np.ones((6, 6))) + 5 * np.eye(6), chunks=2)
    with dask.config.set({"blasx.dask.group": group}):
        got = dask.compute(bd.matmul(da.ones((6, 3), chunks=2), da.ones((3, 0), chunks=3)),
                           bd.matmul(da.ones((0, 3), chunks=2), da.ones((3, 6), chunks=3)),
                           bd.gemm(1.0, da.ones((6, 0), chunks=(2, 0)), da.ones((0, 6), chunks=(0, 2))),
                           bd.trsm(1.0, tri, da.ones((6, 0), chunks=(2, 0))),
                           bd.trsm(1.0, tri, da.ones((0, 6), chunks=(0, 2)), side=1),
                           bd.trmm(1.0, tri, da.ones((6, 0), chunks=(2, 0))))
    assert [g.shape for g in got] == [(6, 0), (0, 6), (6, 6), (6, 0), (0, 6), (6, 0)]
    assert not got[2].any()


def test_matmul_and_offload(client, rel_err):
    rng = np.random.default_rng(5)
    a, b, v = _rand(rng, (50, 40), "f4"), _rand(rng, (40, 30), "f8"), _rand(rng, (40,), "f8")
    xa, xb, xv = da.from_array(a, chunks=(13, 17)), da.from_array(b, chunks=(9, 30)), da.from_array(v, chunks=11)
    got = dask.compute(bd.matmul(xa, xb), bd.matmul(xa, xv), bd.matmul(xv, xb))
    for g, r in zip(got, (a @ b, a @ v, v @ b)):
        assert g.dtype == r.dtype and rel_err(g, r) < 1e-12
    ints = da.from_array(np.arange(12).reshape(3, 4), chunks=2)
    assert "blasx" not in bd.matmul(ints, ints.T).name  # numpy's integer result: dask's own matmul
    m = np.arange(12).reshape(3, 4)
    assert (bd.matmul(ints, ints.T).compute() == m @ m.T).all()
    with bd.offload():
        exprs = [xa @ xb, da.matmul(xa, xb), da.dot(xa, xb), da.tensordot(xa, xb, axes=1),
                 da.tensordot(xb, xa, axes=([0], [1])), np.asarray(b).T @ xa.T,
                 da.tensordot(xa, xb, axes=np.int64(1)), da.tensordot(xb, xa, axes=(np.int64(-2), [np.int32(1)]))]
        with pytest.raises((ValueError, IndexError, np.exceptions.AxisError)):  # out of range: dask's own error
            da.tensordot(xa, xb, axes=(3, 0))
    assert all(e.name.startswith("blasx-gemm") for e in exprs)
    assert not (xa @ xb).name.startswith("blasx")  # restored on exit
    refs = [a @ b] * 4 + [b.T @ a.T, b.T @ a.T, a @ b, b.T @ a.T]
    for g, r in zip(dask.compute(*exprs), refs):
        assert rel_err(g, r) < 1e-6


def test_offload_leaves_dask_what_blasx_dask_does_not_run(threads, rel_err):
    """Unknown chunk sizes, masked arrays, non-BLAS result types of dot / tensordot, and an operand type dask defers
    to: under offload, dask's own function runs them (they raised, or lost dask's result type)."""
    rng = np.random.default_rng(11)
    a, b = _rand(rng, (9, 6), "f8"), _rand(rng, (6, 5), "f8")
    xa, xb = da.from_array(a, chunks=4), da.from_array(b, chunks=3)
    rows = a[:, 0] > 0
    bools, i8 = (da.from_array(rng.random((9, 9)) > 0.5, chunks=((4, 4, 1), (9,))),
                 da.ones((9, 9), dtype=np.int8, chunks=3))

    class Deferring:  # an array type dask defers to (xarray / pint-like)
        __array_ufunc__ = None

        def __rmatmul__(self, other):
            return "deferred"
    with bd.offload():
        assert rel_err((xa[xa[:, 0] > 0] @ xb).compute(), a[rows] @ b) < 1e-12
        assert rel_err(da.dot(xa[xa[:, 0] > 0], xb).compute(), a[rows] @ b) < 1e-12
        masked = da.tensordot(da.ma.masked_greater(xa, 0.5), xb, 1).compute()
        assert isinstance(masked, np.ma.MaskedArray)
        assert da.tensordot(bools, i8, 1).dtype == da.dot(bools, i8).dtype == np.int64
        assert (xa @ Deferring()) == "deferred"
    assert np.array_equal(da.dot(bools, i8).compute(), bools.compute().astype(np.int64) @ np.ones((9, 9), np.int64))


def test_empty_chunks_are_kept_and_0d_scalars_taken(threads, rel_err):
    rng = np.random.default_rng(12)
    a, b = _rand(rng, (7, 6), "f8"), _rand(rng, (6, 5), "f8")
    xa, xb = da.from_array(a, chunks=((3, 0, 4), (6,))), da.from_array(b, chunks=((6,), (5, 0)))
    got = bd.matmul(xa, xb)
    assert got.chunks == da.matmul(xa, xb).chunks == ((3, 0, 4), (5, 0))
    assert rel_err(got.compute(), a @ b) < 1e-12
    c = bd.gemm(np.array(2.0), xa, xb, beta=np.array(0.5), c=np.ones((7, 5)))  # as scipy takes them
    assert rel_err(c.compute(), sb.dgemm(np.array(2.0), a, b, beta=np.array(0.5), c=np.ones((7, 5)))) < 1e-12


def test_zarr_and_memmap_operands_are_read_by_the_tasks(client, rel_err, tmp_path):
    zarr = pytest.importorskip("zarr")
    rng = np.random.default_rng(6)
    a, b = _rand(rng, (70, 50), "f8"), _rand(rng, (50, 40), "f8")
    za = zarr.create_array(store=str(tmp_path / "a.zarr"), shape=a.shape, chunks=(20, 15), dtype=a.dtype)
    za[:] = a
    mb = np.memmap(tmp_path / "b.dat", dtype=b.dtype, mode="w+", shape=b.shape, order="F")
    mb[:] = b
    mb.flush()
    xa = da.from_zarr(str(tmp_path / "a.zarr"))
    xb = np.memmap(tmp_path / "b.dat", dtype=b.dtype, mode="r", shape=b.shape, order="F")
    c = bd.gemm(1.0, xa, xb)
    layer_deps = c.dask.dependencies[c.name]
    assert not layer_deps, layer_deps  # no from-zarr / memmap blocks in the graph: the tasks read them
    c.to_zarr(str(tmp_path / "c.zarr"))
    assert rel_err(zarr.open_array(str(tmp_path / "c.zarr"))[:], a @ b) < 1e-13


def test_argument_errors_before_any_work(client):
    x = da.ones((10, 10), chunks=5)
    with pytest.raises(ValueError, match="trans_a: got 3"):
        bd.gemm(1.0, x, x, trans_a=3)
    with pytest.raises(ValueError, match="b: op\\(b\\) has 7 rows"):
        bd.gemm(1.0, x, da.ones((7, 3)))
    with pytest.raises(ValueError, match="c: got shape"):
        bd.gemm(1.0, x, x, c=da.ones((3, 3)))
    with pytest.raises(TypeError, match="alpha"):
        bd.gemm("2", x, x)
    with pytest.raises(TypeError, match="alpha: got complex"):
        bd.gemm(1j, x, x)
    with pytest.raises(ValueError, match="a: got a 3-D array"):
        bd.gemm(1.0, da.ones((2, 2, 2)), x)
    with pytest.raises(ValueError, match="lower: got 2"):
        bd.syrk(1.0, x, lower=2)
    with pytest.raises(ValueError, match="trans: got 1"):
        bd.herk(1.0, x, trans=1)
    with pytest.raises(TypeError, match="alpha: got complex"):
        bd.herk(1j, x)
    with pytest.raises(ValueError, match="a: got shape"):
        bd.trsm(1.0, da.ones((10, 9)), x)
    with pytest.raises(TypeError, match="dtype"):
        bd.gemm(1.0, da.from_array(np.full((10, 10), "a")), x)
    with pytest.raises(ValueError, match="devices"):
        bd.configure(client, devices="nonsense:3")


def test_progress_bar_persists(client, rel_err, capsys):
    a = np.random.default_rng(7).random((40, 30))
    x = bd.gemm(1.0, da.from_array(a, chunks=10), da.from_array(a.T, chunks=10), progress=True)
    assert rel_err(x.compute(), a @ a.T) < 1e-13


def test_memory_budget(client, tmp_path):
    """Peak bytes held per worker <= its C blocks + threads x (accumulator + two steps of pieces)."""
    zarr = pytest.importorskip("zarr")
    n, blk = 480, 60
    rng = np.random.default_rng(8)
    for name in "ab":
        z = zarr.create_array(store=str(tmp_path / f"{name}.zarr"), shape=(n, n), chunks=(blk, blk), dtype="f8")
        z[:] = rng.random((n, n))
    a, b = (da.from_zarr(str(tmp_path / f"{x}.zarr")) for x in "ab")
    bd.memory_peaks(client, reset=True)
    c = bd.matmul(a, b).persist()
    distributed.wait(c)
    peaks = bd.memory_peaks(client)
    owned = {w: 0 for w in peaks}
    for key, where in client.who_has(c).items():
        for w in where:
            owned[w] += blk * blk * 8
    piece = blk * blk * 8
    for w, peak in peaks.items():
        budget = owned[w] + 1 * (piece + 2 * (piece + piece))
        assert 0 < peak <= budget, (w, peak, budget)
    assert sum(owned.values()) == n * n * 8
    assert np.allclose(c.compute(), np.asarray(zarr.open_array(str(tmp_path / "a.zarr"))[:])
                       @ np.asarray(zarr.open_array(str(tmp_path / "b.zarr"))[:]))


def test_chains_bound_the_dependency_bytes_of_a_task(threads, rel_err):
    """With blasx.dask.task-bytes smaller than a block's panels, each output block is a chain of
    tasks, none taking more than the limit of dependency blocks (or one step's); same results."""
    cases = _level3_cases(np.random.default_rng(9))[::7]
    rng = np.random.default_rng(10)
    a, b = _rand(rng, (40, 90), "f8"), _rand(rng, (90, 30), "f8")
    with dask.config.set({"blasx.dask.task-bytes": 3 * 10 * 20 * 8}):
        xa, xb = da.from_array(a, chunks=(10, 20)), da.from_array(b, chunks=(20, 10))
        g = bd.gemm(1.0, xa, xb)
        again = _level3_cases(np.random.default_rng(9))[::7]
    tasks = dict(g.dask)
    links = [t for k, t in tasks.items() if isinstance(k, tuple) and str(k[0]).startswith("blasx-gemm")]
    assert len(links) == 12 * 4  # k = 20+20+20+20+10: 3200 B a step, the last two (4800 B) share a link
    size = {x.name: x for x in (xa, xb)}
    for _, plan, deps in links:
        assert sum(size[d[0]].blocks[d[1:]].nbytes for d in deps if d[0] in size) <= 3 * 10 * 20 * 8
    _check(rel_err, [g] + [c[0] for c in again], [a @ b] + [c[1] for c in cases], ["f8"] + [c[2] for c in cases])


def test_task_bytes_config(monkeypatch):
    """blasx.dask.task-bytes: "auto" bounds a task's dependency bytes at DEVICE_TASK_BYTES where every dask
    operand's chunks are CuPy arrays (read in place on a GPU), else TASK_BYTES (no client's workers to fit:
    the next test); a size as given; else an error naming the setting before any graph is built."""
    from types import SimpleNamespace as NS
    from blasx.dask import graph
    monkeypatch.setattr(graph, "_least_worker_memory", lambda: None)
    CupyLike = type("ndarray", (), {"__module__": "cupy._core.core"})
    dev, host = NS(x=NS(_meta=CupyLike())), NS(x=NS(_meta=np.empty((0, 0))))
    assert graph.task_bytes([dev, dev, None]) == graph.DEVICE_TASK_BYTES == 16 << 30
    assert graph.task_bytes([dev, host]) == graph.task_bytes([host]) == graph.TASK_BYTES == 4 << 30
    assert graph.task_bytes([NS(x=None)]) == graph.TASK_BYTES
    with dask.config.set({"blasx.dask.task-bytes": "300KB"}):
        assert graph.task_bytes([dev]) == 300_000
    a = da.ones((40, 40), chunks=20)
    for bad in ("lots", 0, None, True):
        with dask.config.set({"blasx.dask.task-bytes": bad}), pytest.raises(ValueError, match="task-bytes: got"):
            bd.gemm(1.0, a, a)


def test_task_bytes_within_the_workers_memory(client):
    """With a distributed client, "auto" fits the smallest worker memory limit (Dask errs a task whose dependencies
    exceed its worker's): at most that limit for CuPy blocks, half of it for host blocks; a size set is used as
    it is."""
    from types import SimpleNamespace as NS
    from blasx.dask import graph
    least = min(w["memory_limit"] for w in client.scheduler_info()["workers"].values())
    CupyLike = type("ndarray", (), {"__module__": "cupy._core.core"})
    dev, host = NS(x=NS(_meta=CupyLike())), NS(x=NS(_meta=np.empty((0, 0))))
    assert graph.task_bytes([dev]) == min(graph.DEVICE_TASK_BYTES, least)
    assert graph.task_bytes([host]) == min(graph.TASK_BYTES, least // 2)
    with dask.config.set({"blasx.dask.task-bytes": "64GiB"}):
        assert graph.task_bytes([dev]) == 64 << 30


def test_auto_groups_host_blocks_on_gpu_workers(client, monkeypatch):
    """"auto" reads host blocks as from GPUs where every worker's engine has GPUs: super-blocks of GROUP_EXTENT and
    the device bound on a task's dependencies (host blocks: within half the workers' least memory limit); this
    cluster's CPU workers say they have none, so their host chunks keep their own blocks."""
    from types import SimpleNamespace as NS
    from blasx.dask import graph, routines
    host = np.empty((0, 0))
    xs = [da.ones((40, 40), chunks=20)]
    assert not graph._gpu_workers() and not graph.device_blocks(*xs)
    assert routines.group_extent(*xs) == 0
    least = min(w["memory_limit"] for w in client.scheduler_info()["workers"].values())
    assert graph.task_bytes([NS(x=NS(_meta=host))]) == min(graph.TASK_BYTES, least // 2)
    monkeypatch.setattr(graph, "_gpu_workers", lambda: True)
    assert routines.group_extent(*xs) == routines.GROUP_EXTENT == 16384
    assert graph.task_bytes([NS(x=NS(_meta=host))]) == min(graph.DEVICE_TASK_BYTES, least // 2)
    assert graph.device_blocks() is False  # no dask operand (storage alone): nothing is read from blocks


def test_local_threaded_scheduler(rel_err):
    """Without a distributed client the graph runs on dask's threads, on this process's engine."""
    import blasx
    blasx.configure(devices="sim:2")
    rng = np.random.default_rng(11)
    a, b = _rand(rng, (70, 50), "c16"), _rand(rng, (50, 40), "c16")
    got = bd.gemm(1.0, da.from_array(a, chunks=(20, 30)), da.from_array(b, chunks=(15, 17)), trans_b=0)
    assert rel_err(got.compute(scheduler="threads"), a @ b) < 1e-13


def test_gemm_runs_joined_along_k_for_device_blocks():
    """With CuPy blocks (or host blocks on an engine with devices) a task's run of gemm steps (one alpha and trans
    pair, dependency pieces) is one call over the whole k (a grid step); a storage piece or another routine's step
    ends a run; the CPU alone keeps the steps. The grid step equals the steps' sum (run here on numpy)."""
    from blasx.dask import worker as W
    rng = np.random.default_rng(3)
    deps = [rng.standard_normal((6, 9)), rng.standard_normal((9, 5)), rng.standard_normal((9, 6))]
    a0, a1 = W.Ref(0, 0, 6, 0, 4), W.Ref(0, 0, 6, 4, 9)
    b0, b1 = W.Ref(1, 0, 4, 0, 5), W.Ref(1, 4, 9, 0, 5)
    at0, at1 = W.Ref(2, 0, 4, 0, 6), W.Ref(2, 4, 9, 0, 6)  # op(a) = a^T pieces
    store = W.Ref(-1, 0, 6, 0, 4)
    steps = [("gemm", 2.0, a0, 0, b0, 0, 1.0), ("gemm", 2.0, a1, 0, b1, 0, 1.0), ("gemm", 1.0, at0, 1, b0, 0, 1.0),
             ("gemm", 1.0, at1, 1, b1, 0, 1.0), ("gemm", 1.0, store, 0, b0, 0, 1.0), ("trsm", a0, 0, 0, 0)]
    assert W._join_runs(steps, False) == steps
    joined = W._join_runs(steps, True)
    assert joined == [("gemm_grid", 2.0, ((a0,), (a1,)), 0, ((b0,), (b1,)), 0),
                      ("gemm_grid", 1.0, ((at0,), (at1,)), 1, ((b0,), (b1,)), 0),
                      ("gemm", 1.0, store, 0, b0, 0, 1.0), ("trsm", a0, 0, 0, 0)]
    assert W._join_runs(steps[:1] + steps[4:], True) == steps[:1] + steps[4:]  # a run of one stays a gemm
    acc = np.asfortranarray(rng.standard_normal((6, 5)))
    want = acc + 2.0 * deps[0] @ deps[1]
    got = W._apply(joined[0], W._load(joined[0], deps, (), np), acc.copy(order="F"), np)
    assert np.abs(got - want).max() < 1e-12
    got = W._apply(joined[1], W._load(joined[1], deps, (), np), acc.copy(order="F"), np)
    assert np.abs(got - (acc + deps[2].T @ deps[1])).max() < 1e-12


def test_host_accumulators_come_from_the_result_pool_on_gpus(monkeypatch):
    """On an engine with GPUs a task's large host accumulator is page-locked memory from blasx's result pool (as
    blasx's own results are), zeros or a scaled copy of c's piece; elsewhere a plain array."""
    from blasx import session
    from blasx.dask import worker as W
    from blasx.runtime import hostmem, hostpool
    live = []

    def alloc(nbytes):
        live.append((ctypes.c_byte * nbytes)())
        return ctypes.addressof(live[-1])
    pool = hostpool.OutputPool(alloc, lambda ptr: None, idle_limit=1 << 30)
    monkeypatch.setattr(hostpool, "POOL", pool)
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 0)
    c = np.arange(12.0).reshape(3, 4)
    zeros = W.Block((3, 4), "float64", ("zeros",), ())
    copy = W.Block((3, 4), "float64", ("copy", W.Ref(0, 0, 3, 0, 4), 2.0), ())
    monkeypatch.setattr(session, "on_cuda", lambda: False)
    assert W._init(zeros, [c], np).base is None and pool.handed == 0
    monkeypatch.setattr(session, "on_cuda", lambda: True)
    kept = []  # (a buffer goes back to the pool when its array dies)
    for plan, want in ((zeros, np.zeros((3, 4))), (copy, 2 * c)):
        kept.append(W._init(plan, [c], np))
        assert pool.handed == len(kept) and kept[-1].flags.f_contiguous and kept[-1].dtype == np.float64
        assert np.array_equal(kept[-1], want)
    kept.append(W._init(zeros, [c], np, fresh=True))
    assert kept[-1].shape == (3, 4) and pool.handed == 3


def test_memmaps_whose_data_is_not_their_files_and_rewritten_files(threads, rel_err, tmp_path):
    """A copy-on-write memmap (mode 'c': its changes live in this process) and a memmap's copy are read as
    arrays, not from the file; a file rewritten between two calls is new data (the second call's key differs)."""
    n = 24
    path = tmp_path / "m.dat"
    np.memmap(path, dtype="f8", mode="w+", shape=(n, n))[:] = 1.0
    eye = np.eye(n)
    cow = np.memmap(path, dtype="f8", mode="c", shape=(n, n))
    cow[:] = 5.0
    assert rel_err(bd.matmul(cow, eye).compute(), cow) < 1e-12
    assert rel_err(bd.matmul(cow.copy(), eye).compute(), cow) < 1e-12
    m = np.memmap(path, dtype="f8", mode="r+", shape=(n, n))
    first = bd.matmul(m, eye).persist()
    assert rel_err(first.compute(), np.ones((n, n))) < 1e-12
    m[:] = 3.0
    m.flush()
    second = bd.matmul(m, eye)
    assert second.name != first.name and rel_err(second.compute(), 3 * np.ones((n, n))) < 1e-12


def test_masked_int8_and_progress_without_a_client(threads, rel_err, monkeypatch):
    a = np.arange(36, dtype="i1").reshape(6, 6)
    x = da.from_array(a, chunks=3)
    for call in (bd.gemm(1.0, x, x), bd.syrk(1.0, x), bd.trmm(1.0, x, x)):  # int8: float32 by scipy's rule
        assert call.dtype == np.float32
        call.compute()
    assert rel_err(bd.gemm(1.0, x, x).compute(), a.astype("f4") @ a.astype("f4")) < 1e-6
    masked = bd.matmul(np.ma.masked_less(a.astype("f8"), 3), a.astype("f8"))  # matmul: dask's own takes masks
    assert not masked.name.startswith("blasx") and isinstance(masked.compute(), np.ma.MaskedArray)
    with pytest.raises(TypeError, match="b: got a masked array"):
        bd.gemm(1.0, x.astype("f8"), da.ma.masked_less(x.astype("f8"), 3))
    def no_client():
        raise ValueError("No clients found")
    monkeypatch.setattr(distributed, "default_client", no_client)  # (the module's cluster may still run)
    with pytest.raises(ValueError, match="progress: True needs a distributed Client"):
        bd.gemm(1.0, x, x, progress=True)
    with pytest.raises(TypeError, match="progress: got 'no'"):
        bd.gemm(1.0, x, x, progress="no")


def test_a_configure_the_workers_cannot_start_leaves_them_as_they_were(client, rel_err):
    """Settings a worker cannot start (a GPU it lacks) raise, and the workers keep the settings they had: later
    calls run (they failed on every worker until configure was called again)."""
    bd.configure(client, devices="cpu")
    with pytest.raises(Exception):
        bd.configure(client, devices="cuda:63")
    assert all(d == "cpu" for d in client.run(lambda: __import__("blasx").session.settings().devices).values())
    a = np.random.default_rng(3).random((16, 16))
    assert rel_err(bd.matmul(da.from_array(a, chunks=8), da.from_array(a, chunks=8)).compute(), a @ a) < 1e-12


def test_matmul_operands_that_are_not_arrays_and_1d_storage(threads, rel_err, tmp_path):
    a = np.random.default_rng(4).random((5, 6))
    x = da.from_array(a, chunks=2)
    for bad in (None, "abc"):
        with pytest.raises(TypeError, match="a: got"):
            bd.matmul(bad, x)
    zarr = pytest.importorskip("zarr")
    z = zarr.open_array(str(tmp_path / "v.zarr"), mode="w", shape=(6,), chunks=(4,), dtype="f8")
    z[:] = np.arange(6.0)
    assert rel_err(bd.matmul(x, z).compute(), a @ np.arange(6.0)) < 1e-12


def test_float16_operands_take_a_wider_result_type(threads, rel_err):
    """float16 operands computed in a wider type by scipy's rule (a float64 c, or complex for the Hermitian
    routines) are converted like int8 ones: the tasks failed with an error naming a c the caller never passed."""
    rng = np.random.default_rng(3)
    a16 = rng.standard_normal((40, 30)).astype(np.float16)
    a = da.from_array(a16, chunks=(16, 12))
    c = da.from_array(rng.standard_normal((40, 40)), chunks=16)
    a64 = a16.astype(np.float64)
    got = bd.gemm(1.0, a, a.T, beta=1.0, c=c).compute()
    assert got.dtype == np.float64 and rel_err(got, a64 @ a64.T + c.compute()) < 1e-12
    h = bd.herk(1.0, a).compute()
    assert h.dtype == np.complex64 and rel_err(np.triu(h), np.triu(a64 @ a64.T)) < 1e-6


def test_matmul_falling_back_to_dask_honours_progress(monkeypatch):
    """bd.matmul's fallback to dask.array (integers here) checks progress as the blasx path does: no client
    is a named error (it was ignored)."""
    import distributed

    def no_client():
        raise ValueError("No clients found")
    monkeypatch.setattr(distributed, "default_client", no_client)  # (another test's client may still be up)
    a = da.ones((8, 8), dtype=np.int64, chunks=4)
    with pytest.raises(ValueError, match="progress: True needs a distributed Client"):
        bd.matmul(a, a, progress=True)


def test_pieces_converted_to_the_results_type_are_counted(threads):
    """Pieces of another type than the result (int64 -> float64 by scipy's rule) are converted a step at a time
    and counted while the step runs (they were made unseen, inside blasx.gemm or by the step for int8 and
    float16, so memory_peaks read less than the worker held)."""
    from blasx.dask import worker
    rng = np.random.default_rng(3)
    n, blk = 200, 100
    piece = blk * blk * 8
    peaks = {}
    for dt in ("f8", "i8"):
        a = da.from_array((rng.uniform(-9, 9, (n, 2 * n))).astype(dt), chunks=blk).persist(scheduler="sync")
        b = da.from_array((rng.uniform(-9, 9, (2 * n, n))).astype(dt), chunks=blk).persist(scheduler="sync")
        worker.memory_stats(reset=True)
        got = bd.gemm(1.0, a, b).compute(scheduler="sync")
        peaks[dt] = worker.memory_stats()["peak"]
        assert got.dtype == np.float64 and np.allclose(got, a.compute().astype("f8") @ b.compute().astype("f8"))
    assert peaks["i8"] >= peaks["f8"] + 2 * piece  # an A and a B piece converted while a step runs
