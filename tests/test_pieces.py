"""GEMM on grids of pieces (blasx.pieces, runtime/plans/pieces.py): the plan's tile references moved into
the pieces by exact value, one engine call against numpy, and the cases it declines."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blasx
from blasx import pieces as P
from blasx.dask import worker as W
from blasx.runtime.plans import plan_gemm
from blasx.runtime.plans.pieces import on_pieces, pieces_tile
from blasx.runtime.tiling import TileRef

OPS = {0: lambda x: x, 1: lambda x: x.T, 2: lambda x: x.conj().T}


def test_pieces_tile_divides_every_interior_bound():
    assert pieces_tile(16, [(0, 48, 64), (0, 32, 100)]) == 16
    assert pieces_tile(16, [(0, 24, 40)]) == 12  # only 24 is interior: its largest divisor up to 16
    assert pieces_tile(16, [(0, 24, 40, 56)]) == 8  # gcd(24, 40)
    assert pieces_tile(4096, [(0, 10000, 20000)]) == 2500
    assert pieces_tile(16, [(0, 100), (0, 7)]) == 16  # no interior bound: the tile as chosen


def test_on_pieces_moves_a_and_b_tiles_into_their_pieces_and_shifts_the_other_slots():
    # A stored 4 x 6 cut at row 2 and column 4 (pieces 2x4, 2x2, 2x4, 2x2); B stored 6 x 2 cut at row 4; tile 2
    tasks = plan_gemm(4, 2, 6, 2, 0, 0, beta_zero=False)
    moved = on_pieces(tasks, ((0, 2, 4), (0, 4, 6)), ((0, 4, 6), (0, 2)), 2)
    t = moved[-1]  # C tile (1, 0): rows 2-3
    assert t.c == TileRef(6, 1, 0, 2, 0, 2, 2)  # C: slot 2 -> 2 + 4 + 2 - 2
    assert [s.a for s in t.steps] == [TileRef(2, 0, 0, 0, 0, 2, 2), TileRef(2, 0, 1, 0, 2, 2, 2),
                                      TileRef(3, 0, 0, 0, 0, 2, 2)]
    assert [s.b for s in t.steps] == [TileRef(4, 0, 0, 0, 0, 2, 2), TileRef(4, 1, 0, 2, 0, 2, 2),
                                      TileRef(5, 0, 0, 0, 0, 2, 2)]
    assert [(s.kernel, s.m, s.n, s.k, s.beta) for s in t.steps] == [(s.kernel, s.m, s.n, s.k, s.beta)
                                                                       for s in tasks[-1].steps]
    with pytest.raises(ValueError, match="crosses a piece bound"):
        on_pieces(tasks, ((0, 3, 4), (0, 6)), ((0, 6), (0, 2)), 2)


def _case(rng, ta, tb, order, dtype, ms=(32, 16), ks=(48, 16, 32), ns=(16, 32)):
    cplx = np.dtype(dtype).kind == "c"

    def r(shape):
        x = rng.standard_normal(shape) + (1j * rng.standard_normal(shape) if cplx else 0)
        return x.astype(dtype)
    A, B = r((sum(ms), sum(ks))), r((sum(ks), sum(ns)))
    mb, kb, nb = (np.cumsum((0,) + s) for s in (ms, ks, ns))
    # stored pieces p with op(p) the logical piece: op is its own inverse up to conjugation
    ag = [[np.array(OPS[ta](A[mb[i]:mb[i + 1], kb[q]:kb[q + 1]]), order=order) for q in range(len(ks))]
          for i in range(len(ms))]
    bg = [[np.array(OPS[tb](B[kb[q]:kb[q + 1], nb[j]:nb[j + 1]]), order=order) for j in range(len(ns))]
          for q in range(len(ks))]
    return A, B, ag, bg


@pytest.fixture
def sim2():
    blasx.configure(devices="sim:2", tile=16)
    yield
    blasx.configure()


@pytest.mark.parametrize("ta", [0, 1, 2])
@pytest.mark.parametrize("tb", [0, 1, 2])
@pytest.mark.parametrize("order", ["C", "F"])
def test_gemm_pieces_equals_numpy_in_one_call(sim2, monkeypatch, ta, tb, order):
    monkeypatch.setattr(P, "LEAST_TILE", 16)
    rng = np.random.default_rng(ta * 10 + tb)
    A, B, ag, bg = _case(rng, ta, tb, order, np.complex128)
    c = np.asfortranarray(rng.standard_normal((48, 48)) + 0j)
    want = (0.5 - 1j) * A @ B + 2.0 * c
    assert P.gemm_pieces(0.5 - 1j, ag, ta, bg, tb, 2.0, c)
    assert np.linalg.norm(c - want) / np.linalg.norm(want) < 1e-14
    assert blasx.last_profile().totals()["tasks"] == 9  # one call: C's 3 x 3 tiles of 16


def test_beta_zero_never_reads_c_and_a_common_divisor_sets_the_tile(sim2, monkeypatch):
    monkeypatch.setattr(P, "LEAST_TILE", 8)
    rng = np.random.default_rng(5)
    A, B, ag, bg = _case(rng, 0, 1, "C", np.float32, ms=(24, 16), ks=(8, 40), ns=(24,))
    c = np.full((40, 24), np.nan, dtype=np.float32, order="F")
    assert P.gemm_pieces(1.5, ag, 0, bg, 1, 0.0, c)
    want = 1.5 * A.astype(np.float64) @ B.astype(np.float64)
    assert np.linalg.norm(c - want) / np.linalg.norm(want) < 1e-6
    assert blasx.last_profile().totals()["tasks"] == (40 // 8) * (24 // 8)  # tile 8 (gcd of 24, 8, 40 ...)


def test_split_k_scratch_follows_the_pieces(sim2, monkeypatch):
    monkeypatch.setattr(P, "LEAST_TILE", 16)
    rng = np.random.default_rng(6)
    A, B, ag, bg = _case(rng, 0, 0, "F", np.float64, ms=(16,), ks=(64,) * 4, ns=(16,))
    c = np.asfortranarray(rng.standard_normal((16, 16)))
    want = A @ B - c
    assert P.gemm_pieces(1.0, ag, 0, bg, 0, -1.0, c)
    assert np.abs(c - want).max() < 1e-11
    assert blasx.last_profile().totals()["tasks"] > 1  # one C tile: partial sums and their reduction


def test_declined_cases_do_nothing(sim2, monkeypatch):
    monkeypatch.setattr(P, "LEAST_TILE", 16)
    rng = np.random.default_rng(7)
    _, _, ag, bg = _case(rng, 0, 0, "C", np.float64)
    c = np.zeros((48, 48), order="F")
    mixed = [row[:] for row in ag]
    mixed[1][2] = np.asfortranarray(mixed[1][2])  # one piece's canonical op differs
    assert not P.gemm_pieces(1.0, mixed, 0, bg, 0, 0.0, c)
    assert not P.gemm_pieces(1.0, ag, 0, bg, 0, 0.0, np.zeros((48, 48)))  # c C-ordered
    assert not P.gemm_pieces(1.0, ag, 0, bg, 0, 0.0, c, least=32)  # bounds' gcd 16 < 32
    blasx.configure(devices="sim:2", tile=64)
    assert not P.gemm_pieces(1.0, ag, 0, bg, 0, 0.0, c)  # the engine's tile 64 over twice the bounds' 16
    blasx.configure(devices="sim:2", tile=32)
    assert not P.gemm_pieces(1.0, [[p.astype(np.float32) for p in row] for row in ag], 0, bg, 0, 0.0, c)
    assert not c.any()
    assert P.gemm_pieces(1.0, ag, 0, bg, 0, 0.0, c)  # tile 32: 16 is half of it
    with pytest.raises(ValueError, match="do not make c"):
        P.gemm_pieces(1.0, ag, 0, bg, 0, 0.0, np.zeros((48, 40), order="F"))


def test_a_gpu_workers_grid_step_reads_its_pieces_in_place(sim2, monkeypatch):
    """blasx.dask's grid step on device blocks (any array module but numpy) goes to gemm_pieces: no joined
    copy is made or counted."""
    monkeypatch.setattr(P, "LEAST_TILE", 16)
    monkeypatch.setattr(W, "_joined", lambda *a: pytest.fail("joined"))
    rng = np.random.default_rng(8)
    A, B, ag, bg = _case(rng, 1, 0, "C", np.float64)
    xs = [[ag[i][k] for i in range(2)] for k in range(3)]  # the worker's grid: xs[k][i]
    acc = np.empty((48, 48), order="F")
    held = W.memory_stats()["held"]
    got = W._grid_gemm((2.0, xs, 1, bg, 0), acc, xp=object(), beta=0.0)
    assert got is acc and np.abs(acc - 2.0 * A @ B).max() < 1e-11
    assert W.memory_stats()["held"] == held


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data(), tile=st.sampled_from((4, 6, 8)), ta=st.sampled_from((0, 1, 2)), tb=st.sampled_from((0, 1, 2)),
       order=st.sampled_from("CF"), dtype=st.sampled_from((np.float32, np.float64, np.complex64, np.complex128)),
       beta=st.sampled_from((0.0, 1.0, -0.5)))
def test_gemm_pieces_property(monkeypatch, data, tile, ta, tb, order, dtype, beta):
    """Random grids (pieces of whole tiles, the last of each dimension ragged) against numpy in float64/complex128;
    a beta-0 c is NaN-poisoned."""
    monkeypatch.setattr(P, "LEAST_TILE", 1)
    blasx.configure(devices="sim:3", tile=tile)
    try:
        def sizes(label):
            n = data.draw(st.integers(1, 3), label=label)
            whole = [tile * data.draw(st.integers(1, 3)) for _ in range(n - 1)]
            return tuple(whole + [data.draw(st.integers(1, 2 * tile))])
        ms, ks, ns = sizes("m"), sizes("k"), sizes("n")
        rng = np.random.default_rng(len(ms) * 100 + len(ks) * 10 + len(ns))
        A, B, ag, bg = _case(rng, ta, tb, order, dtype, ms, ks, ns)
        c = np.asfortranarray(_case(rng, 0, 0, "F", dtype, ms, (1,), ns)[0] @ np.ones((1, sum(ns)), dtype))
        wide = np.complex128 if np.dtype(dtype).kind == "c" else np.float64
        want = 0.75 * A.astype(wide) @ B.astype(wide) + (beta * c.astype(wide) if beta else 0)
        if beta == 0:
            c[...] = np.nan
        assert P.gemm_pieces(0.75, ag, ta, bg, tb, beta, c)
        tol = 1e-4 if np.dtype(dtype).itemsize <= 8 and np.dtype(dtype).kind != "c" or dtype == np.complex64 else 1e-12
        assert np.linalg.norm(c - want) / np.linalg.norm(want) < tol
    finally:
        blasx.configure()


@pytest.mark.parametrize("devices", ["sim:2", "cpu"])
def test_host_blocks_are_one_call_on_an_engine_with_devices(monkeypatch, devices):
    """blasx.dask's host blocks on an engine with devices: a task's k steps are one engine call on its blocks in
    place (no join, no call a k interval); the CPU alone keeps one host BLAS call a k interval."""
    import dask.array as da

    import blasx.dask as bd
    monkeypatch.setattr(P, "LEAST_TILE", 16)
    blasx.configure(devices=devices, **({"tile": 16} if devices != "cpu" else {}))
    calls = {"pieces": 0, "gemm": 0}
    real_pieces, real_gemm = W.gemm_pieces, blasx.gemm
    monkeypatch.setattr(W, "gemm_pieces", lambda *a, **k: calls.__setitem__("pieces", calls["pieces"] + 1)
                        or real_pieces(*a, **k))
    monkeypatch.setattr(blasx, "gemm", lambda *a, **k: calls.__setitem__("gemm", calls["gemm"] + 1)
                        or real_gemm(*a, **k))
    try:
        rng = np.random.default_rng(9)
        a, b = rng.standard_normal((48, 64)), rng.standard_normal((64, 32))
        got = bd.matmul(da.from_array(a, chunks=16), da.from_array(b, chunks=16)).compute(scheduler="threads")
        assert np.abs(got - a @ b).max() < 1e-11
        if devices == "cpu":
            assert calls == {"pieces": 0, "gemm": 3 * 2 * 4}  # 6 blocks, 4 k intervals each
        else:
            assert calls == {"pieces": 6, "gemm": 0}
    finally:
        blasx.configure()
