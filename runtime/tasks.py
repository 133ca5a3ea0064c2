"""Tasks: one output tile C_ij and its k-steps (the paper's Section IV-A).

A task is metadata only (tile references, op flags, scalar indices; no array is copied), and this
module is pure, so plans are compared by exact value in tests. Each step names its tile kernel, so
the steps of one task may run different kernels; ``deps`` lists tasks of the same call that must
finish first (TRSM); a call may carry an epilogue applied to finished C tiles before write-back.
Scalars are indices into the call's scalar table (``SC_ALPHA``, ...), so a device can pass cuBLAS
a host pointer without building a Python scalar per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .tiling import TileRef

SC_ALPHA, SC_BETA, SC_ZERO, SC_ONE, SC_MINUS_ONE, SC_ALPHA_CONJ = 0, 1, 2, 3, 4, 5
N_SCALARS = 6


class Step(NamedTuple):
    """One k-step of a task: ``C = alpha_s * op_a(A) op_b(B) + beta_s * C`` (for gemm)."""

    kernel: str  # tile kernel: "gemm", "scale" (C = beta * C), "syrk", "trsm", ... (numpy_kernels.KERNELS)
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
    # (index, count): the task's line (a column of B, or a row for side right, in in-place TRMM and TRSM), whose
    # tasks wait only on each other; with ``Knobs.line_homes`` line i's tasks go to stream device i * n // count.
    line: tuple[int, int] = ()
    call: Any = field(default=None, repr=False)
    worker: int = -1

    @property
    def work(self) -> float:
        """What the task weighs in balancing devices: its flops, at least 1 (a flop-less task still takes a turn)."""
        return max(self.flops, 1.0)

    def input_tiles(self) -> list[TileRef]:
        """Every A/B tile the task reads, in step order (for Eq. 3 priorities)."""
        return [t for s in self.steps for t in (s.a, s.b) if t is not None]


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
