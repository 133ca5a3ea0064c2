"""Which of a broken device's tasks may run again after its write-back was issued (``engine._reads_own_tile``):
a task that reads the memory it writes cannot, since a partial write-back changed what it would read. By exact
value on planned tasks."""

from __future__ import annotations

from types import SimpleNamespace

from blasx.runtime.engine import _reads_own_tile
from blasx.runtime.plans import SLOT_C, TRSM_B, TRSM_X, plan_gemm, plan_syrk, plan_trsm
from blasx.runtime.tiling import OP_N


def _bound(tasks, tokens):
    call = SimpleNamespace(tokens=tokens)
    for t in tasks:
        t.call = call
    return tasks


def test_syrk_beta_zero_diagonal_tiles_may_run_again():
    # a diagonal tile is loaded for the triangle it keeps, written back as loaded: with beta 0 the task reads
    # nothing it writes anew (it was refused as "cannot be recomputed safely")
    tasks = _bound(plan_syrk(32, 16, 16, OP_N, 1, beta_zero=True), list("AC"))
    diag = [t for t in tasks if t.c.bi == t.c.bj]
    assert diag and all(t.load_c for t in diag) and not any(_reads_own_tile(t) for t in tasks)
    tasks = _bound(plan_syrk(32, 16, 16, OP_N, 1, beta_zero=False), list("AC"))
    assert all(t.load_c and _reads_own_tile(t) for t in tasks)  # beta != 0: every tile reads its old C


def test_gemm_reads_its_c_only_with_beta_and_from_its_own_memory():
    tokens = list("ABCD")
    assert not any(_reads_own_tile(t) for t in _bound(plan_gemm(32, 32, 32, 16, OP_N, OP_N), tokens))
    assert all(_reads_own_tile(t) for t in _bound(plan_gemm(32, 32, 32, 16, OP_N, OP_N, beta_zero=False), tokens))
    # a new result starting from the caller's c (another operand): the caller's c is never written
    fresh = plan_gemm(32, 32, 32, 16, OP_N, OP_N, beta_zero=False, c_init=True)
    assert not any(_reads_own_tile(t) for t in _bound(fresh, tokens))
    same = list("ABCC")  # ... unless that operand is C's own memory
    assert all(_reads_own_tile(t) for t in _bound(fresh, same)) and SLOT_C == 2


def test_trsm_in_place_reads_its_tile():
    tasks = plan_trsm(32, 32, 16, 0, 1, OP_N, 0)
    tokens = ["A"] * 8
    tokens[TRSM_B], tokens[TRSM_X] = "B", "X"
    assert not any(_reads_own_tile(t) for t in _bound(tasks, tokens))  # X separate from B: B is never written
    tokens[TRSM_X] = "B"
    assert all(_reads_own_tile(t) for t in _bound(tasks, tokens))  # X over B: each task reads B's tile it writes
