"""A new GEMM result starting from the caller's c (``plan_gemm(c_init=True)``): the plan by exact value,
the engine reading c's tiles as the first contents of C instead of a host copy into the result, and the
fallbacks that still copy (orientation, type, beta 0), against numpy on simulated GPUs."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import blasx
from blasx.runtime.call import Call
from blasx.runtime.plans import SLOT_C, plan_gemm, plan_trsm
from blasx.runtime.plans.gemm import SLOT_C0, SLOT_P
from blasx.runtime.tiling import OP_N, TileRef, tile_ref

dispatch = importlib.import_module("blasx.dispatch")
hostpool = importlib.import_module("blasx.runtime.hostpool")


def test_plan_gemm_c_init_exact():
    # C 5x3, k = 10, T = 4: two C tiles, each starting from the same tile of SLOT_C0
    plain = plan_gemm(5, 3, 10, 4, OP_N, OP_N, beta_zero=False)
    tasks = plan_gemm(5, 3, 10, 4, OP_N, OP_N, beta_zero=False, c_init=True)
    assert [t.c_init for t in tasks] == [TileRef(SLOT_C0, 0, 0, 0, 0, 4, 3), TileRef(SLOT_C0, 1, 0, 4, 0, 1, 3)]
    assert [(t.c, t.steps, t.load_c, t.rotatable) for t in tasks] == [(t.c, t.steps, t.load_c, t.rotatable) for t in plain]
    # beta 0: C is never read, so nothing to start from
    assert all(t.c_init is None for t in plan_gemm(5, 3, 10, 4, OP_N, OP_N, c_init=True))
    # split-k: the partial sums move one slot on; the reductions start from SLOT_C0
    split = plan_gemm(5, 3, 10, 4, OP_N, OP_N, beta_zero=False, split=2, c_init=True)
    p00, p01, r0, p10, p11, r1 = split
    assert {t.c.slot for t in (p00, p01, p10, p11)} == {SLOT_P + 1} and p01.c.c0 == 3
    assert r0.steps[0].a == p00.c and r0.c == tile_ref(SLOT_C, 0, 0, 5, 3, 4)
    assert r0.c_init == TileRef(SLOT_C0, 0, 0, 0, 0, 4, 3) and r1.c_init.r0 == 4
    assert all(t.c_init is None for t in (p00, p01, p10, p11))


def test_a_new_results_c_source_is_registered_late():
    calls = lambda tasks: Call.late_inputs(type("C", (), {"tasks": tasks})())  # noqa: E731
    assert calls(plan_gemm(300, 200, 500, 128, 0, 0, beta_zero=False, c_init=True)) == {SLOT_C0}
    assert calls(plan_gemm(300, 200, 500, 128, 0, 0, beta_zero=False)) == frozenset()
    assert calls(plan_trsm(300, 200, 128, 0, 0, 0, 0)) == frozenset()  # B starts its tasks: needed early


@pytest.fixture
def sim2():
    blasx.configure(devices="sim:2", tile=16)
    yield
    blasx.reset()


@pytest.mark.parametrize("shape", [(37, 21, 45), (20, 18, 400)], ids=["tiles", "split-k"])
@pytest.mark.parametrize("dtype", [np.float64, np.complex64])
def test_a_new_result_starts_from_c_without_a_host_copy(sim2, monkeypatch, shape, dtype):
    m, n, k = shape
    rng = np.random.default_rng(0)
    mk = lambda *s, order="F": np.asarray(rng.standard_normal(s) + (1j * rng.standard_normal(s) if np.dtype(dtype).kind == "c" else 0),  # noqa: E731
                                          dtype=dtype, order=order)
    a, b, c = mk(m, k), mk(k, n), mk(m, n)
    before = c.copy()
    copies = []
    real = hostpool.copy_into
    monkeypatch.setattr(hostpool, "copy_into", lambda dst, src: (copies.append(src), real(dst, src)))
    out = blasx.gemm(1.5, a, b, beta=-0.5, c=c)
    ref = 1.5 * (a.astype(np.complex128) @ b) - 0.5 * c
    assert out is not c and np.array_equal(c, before) and not copies  # c read by the tasks, not copied
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5
    # a C-ordered c (its tiles lie transposed to the result's): copied into the result first
    c2 = np.ascontiguousarray(c)
    out2 = blasx.gemm(1.5, a, b, beta=-0.5, c=c2)
    assert len(copies) == 1 and np.linalg.norm(out2 - ref) / np.linalg.norm(ref) < 1e-5
    # alpha 0: C = beta c, from c's tiles
    out3 = blasx.gemm(0.0, a, b, beta=2.0, c=c)
    assert np.allclose(out3, 2 * c) and np.array_equal(c, before)


def test_fallbacks_fill_the_result_first(sim2):
    rng = np.random.default_rng(1)
    a, b = np.asfortranarray(rng.standard_normal((30, 20))), np.asfortranarray(rng.standard_normal((20, 25)))
    c32 = np.asfortranarray(rng.standard_normal((30, 25)).astype(np.float32))  # another type than the result's
    out = blasx.gemm(1.0, a, b, beta=1.0, c=c32)
    assert out.dtype == np.float64 and np.allclose(out, a @ b + c32, atol=1e-6)
    c = np.asfortranarray(rng.standard_normal((30, 25)))
    assert np.allclose(blasx.gemm(1.0, a, b, beta=0.0, c=c), a @ b)  # beta 0: c not read
    half = blasx.gemm(1.0, a.astype(np.float16), b.astype(np.float16), beta=1.0, c=c.astype(np.float16))
    assert half.dtype == np.float16  # a mixed call: filled first, then run
    ref = a.astype(np.float16).astype(np.float32) @ b.astype(np.float16).astype(np.float32) + c.astype(np.float16)
    assert np.linalg.norm(half.astype(np.float32) - ref) / np.linalg.norm(ref) < 1e-2


def test_the_host_route_fills_the_result_too():
    blasx.configure(devices="cpu")
    try:
        rng = np.random.default_rng(2)
        a, b, c = (np.asfortranarray(rng.standard_normal(s)) for s in ((40, 30), (30, 35), (40, 35)))
        out = blasx.gemm(2.0, a, b, beta=3.0, c=c)
        assert np.allclose(out, 2 * a @ b + 3 * c)
    finally:
        blasx.reset()


def test_which_c_sources_may_be_staged_into_the_result():
    targets = lambda tasks: Call.init_targets(type("C", (), {"tasks": tasks})())  # noqa: E731
    assert targets(plan_gemm(300, 200, 500, 128, 0, 0, beta_zero=False, c_init=True)) == {SLOT_C0: SLOT_C}
    assert targets(plan_gemm(20, 18, 400, 4, 0, 0, beta_zero=False, split=2, c_init=True)) == {SLOT_C0: SLOT_C}
    assert targets(plan_gemm(300, 200, 500, 128, 0, 0, beta_zero=False)) == {}
    assert targets(plan_trsm(300, 200, 128, 0, 0, 0, 0)) == {}
    # a task writing C from elsewhere (or from another tile) would have its tile overwritten by the staging copy
    tasks = plan_gemm(300, 200, 500, 128, 0, 0, beta_zero=False, c_init=True)
    tasks[1].c_init = tasks[1].c_init._replace(r0=tasks[1].c.r0 + 1)
    assert targets(tasks) == {}
