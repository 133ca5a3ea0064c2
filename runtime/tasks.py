"""Tasks: one output tile C_ij and its k-steps (the paper's Section IV-A).

A task is metadata only: tile references, op flags and scalar *indices*; no
array is copied when a call is taskized. Everything in this module is a pure
function of shapes and flags, so plans are compared by exact value in tests
(as dask's ``order.py`` is).

The model already covers what later routines need:

* every step names its tile kernel (``gemm`` here; ``syrk``, ``trmm``,
  ``trsm``, ``symm`` on diagonal tiles later), so the k-steps of one task may
  run different kernels;
* ``deps`` lists tasks of the same call that must have finished (TRSM);
* a call may carry an epilogue applied to the finished C tile on the device
  before write-back (bias + activation for fused DNN layers).

Scalars are referred to by index into the call's scalar table
(``SC_ALPHA, SC_BETA, SC_ZERO, SC_ONE``), so a device can pass cuBLAS a host
pointer without building a Python scalar per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .tiling import OP_N, TileRef, n_tiles, op_tile, tile_ref

SC_ALPHA, SC_BETA, SC_ZERO, SC_ONE, SC_MINUS_ONE, SC_ALPHA_CONJ = 0, 1, 2, 3, 4, 5
N_SCALARS = 6

# Operand slots used by the GEMM planner.
SLOT_A, SLOT_B, SLOT_C = 0, 1, 2


class Step(NamedTuple):
    """One k-step of a task: ``C = alpha_s * op_a(A) op_b(B) + beta_s * C`` (for gemm)."""

    kernel: str  # device kernel name: "gemm" or "scale" (C = beta * C)
    a: TileRef | None
    b: TileRef | None
    op_a: int
    op_b: int
    m: int
    n: int
    k: int
    alpha: int  # scalar index
    beta: int  # scalar index
    # Flags of the triangular/symmetric tile kernels (syrk, symm, trmm, trsm, ...),
    # with BLAS meanings: side 0 = left, 1 = right; uplo 0 = upper, 1 = lower;
    # diag 0 = non-unit, 1 = unit. gemm and scale ignore them.
    side: int = 0
    uplo: int = 0
    diag: int = 0


@dataclass(slots=True, eq=False)
class Task:
    """Solve one C tile. Mutable only in ``call`` (bound by the engine) and ``worker`` (who ran it)."""

    tid: int  # index in the call's task list
    c: TileRef
    load_c: bool  # read C from its home before the first step (beta != 0)
    steps: tuple[Step, ...]
    flops: float
    deps: tuple[int, ...] = ()
    # The steps commute (a sum of gemm updates): a device may run them from any
    # starting k, which spreads the first host loads of several devices over
    # different tiles so that each later finds the rest in a peer's L1 (L2 hits).
    rotatable: bool = False
    # With ``rotatable``: the first ``fixed`` steps always run first, only the rest rotate
    # (TRMM's diagonal step initialises C; the gemm steps after it commute).
    fixed: int = 0
    # Keep the finished C tile cached as a clean line (MESI-X E instead of I) because
    # later tasks of the call read it (TRSM reads solved tiles).
    keep_c: bool = False
    # Where the C buffer's first contents come from when ``load_c`` (None: the C tile itself).
    c_init: TileRef | None = None
    # ``deps`` step by step: when set, ``gates[k]`` (tids, a subset of ``deps``) must have
    # finished before step k is issued, ``gates[len(steps)]`` before the write-back; a stream
    # device may then start the task once every dep has *started* (started tasks finish
    # without waiting for later ones, so this cannot deadlock). Without gates every dep must
    # have finished before the task starts. A CPU worker runs a task whole: it always waits
    # for every dep.
    gates: tuple[tuple[int, ...], ...] = ()
    # Write after read (in-place TRMM): the gates name tasks that *read* what this task
    # overwrites, so a gate opens once their kernels are done (``Call.computed``), not their
    # write-backs: a line's write-backs then no longer wait for each other in a chain.
    war: bool = False
    # Started ahead of Eq. 3's choice in a station (it reads no A/B tile, so Eq. 3 would rank it
    # last): later tasks of the call wait for it (TRSM's inversions of the diagonal blocks).
    urgent: bool = False
    call: Any = field(default=None, repr=False)
    worker: int = -1

    def input_tiles(self) -> list[TileRef]:
        """Every A/B tile the task reads, in step order (for Eq. 3 priorities)."""
        out = []
        for s in self.steps:
            if s.a is not None:
                out.append(s.a)
            if s.b is not None:
                out.append(s.b)
        return out


def rotated_steps(steps: tuple[Step, ...], start: int) -> tuple[Step, ...]:
    """The steps of a rotatable task beginning at ``start``: the first one run
    takes the task's initial beta (it initialises C), every other one accumulates."""
    n = len(steps)
    start %= n
    if start == 0:
        return steps
    first_beta = steps[0].beta
    order = steps[start:] + steps[:start]
    return tuple(s._replace(beta=first_beta if i == 0 else SC_ONE) for i, s in enumerate(order))


def gemm_flops(m: int, n: int, k: int, is_complex: bool) -> float:
    """Floating-point operations of an m x n x k product (a complex FMA is 8 real flops)."""
    return (8.0 if is_complex else 2.0) * m * n * k


def plan_gemm(
    m: int,
    n: int,
    k: int,
    tile: int,
    op_a: int,
    op_b: int,
    *,
    alpha_zero: bool = False,
    beta_zero: bool = True,
    is_complex: bool = False,
    block: tuple[int, int] = (1, 1),
) -> list[Task]:
    """Tasks of ``C = alpha op_a(A) op_b(B) + beta C`` in canonical (column-major) form.

    ``C`` is ``m x n``; ``A`` is stored ``m x k`` when ``op_a`` is N, else ``k x m``;
    likewise ``B`` is ``k x n`` or ``n x k``. Tasks are listed C-tile row by row, so
    tasks pulled one after another share a row panel of ``A`` (L1/L2 reuse).
    With ``alpha == 0`` or ``k == 0`` the product is skipped and only
    ``C = beta C`` remains (BLAS: A and B are not read); with ``beta == 0``
    C is never read, so NaNs in C do not leak into the result.

    ``block = (bm, bn)`` lists C tiles in blocks of bm x bn tiles (row-major
    inside a block and across blocks): a device that pulls one block runs tasks
    that share both A row panels and B column panels, so one round on it needs
    bm + bn panels instead of 1 + n (see ``tile_order``).
    """
    a_rows, a_cols = (m, k) if op_a == OP_N else (k, m)
    b_rows, b_cols = (k, n) if op_b == OP_N else (n, k)
    tm, tn, tk = n_tiles(m, tile), n_tiles(n, tile), n_tiles(k, tile)
    skip_product = alpha_zero or k == 0
    tasks: list[Task] = []
    for i, j in tile_order(tm, tn, block):
        c = tile_ref(SLOT_C, i, j, m, n, tile)
        if skip_product:
            steps = (Step("scale", None, None, OP_N, OP_N, c.rows, c.cols, 0, SC_ALPHA,
                          SC_ZERO if beta_zero else SC_BETA),)
            flops = 0.0
        else:
            steps = tuple(
                Step(
                    "gemm",
                    op_tile(SLOT_A, op_a, i, kk, a_rows, a_cols, tile),
                    _b_tile(op_b, kk, j, b_rows, b_cols, tile),
                    op_a,
                    op_b,
                    c.rows,
                    c.cols,
                    min(tile, k - kk * tile),
                    SC_ALPHA,
                    (SC_ZERO if beta_zero else SC_BETA) if kk == 0 else SC_ONE,
                )
                for kk in range(tk)
            )
            flops = gemm_flops(c.rows, c.cols, k, is_complex)
        tasks.append(Task(len(tasks), c, not beta_zero, steps, flops, rotatable=len(steps) > 1))
    return tasks


def tile_order(tm: int, tn: int, block: tuple[int, int] = (1, 1)) -> list[tuple[int, int]]:
    """C tiles (i, j) of a tm x tn grid, in blocks of block[0] x block[1] tiles."""
    bm, bn = max(1, block[0]), max(1, block[1])
    return [(i, j)
            for i0 in range(0, tm, bm) for j0 in range(0, tn, bn)
            for i in range(i0, min(i0 + bm, tm)) for j in range(j0, min(j0 + bn, tn))]


def _b_tile(op_b: int, kk: int, j: int, b_rows: int, b_cols: int, tile: int) -> TileRef:
    # op(B) tile (kk, j) is stored tile (kk, j) for N, (j, kk) for T/C.
    if op_b == OP_N:
        return tile_ref(SLOT_B, kk, j, b_rows, b_cols, tile)
    return tile_ref(SLOT_B, j, kk, b_rows, b_cols, tile)
