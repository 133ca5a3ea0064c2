"""Tasks: one output tile C_ij and its k-steps (the paper's Section IV-A).

A task is metadata only (tile references, op flags, scalar indices), pure, so tests compare plans by value.
Each step names its tile kernel. Scalars are indices into the call's scalar table (``SC_ALPHA``, ...), so a
device can pass cuBLAS a host pointer without building a Python scalar per step.
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
    # Flags of the triangular/symmetric tile kernels, with BLAS meanings (gemm and scale ignore them):
    # side 0 = left, 1 = right; uplo 0 = upper, 1 = lower; diag 0 = non-unit, 1 = unit.
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
    deps: tuple[int, ...] = ()  # tasks of the call that must finish first (TRSM)
    # The steps commute (a sum of gemm updates): a device may start at any k, which spreads the first host
    # loads of several devices over different tiles, so each later finds the rest in a peer's L1.
    rotatable: bool = False
    # With ``rotatable``: the first ``fixed`` steps always run first (TRMM's diagonal step initialises C).
    fixed: int = 0
    # Keep the finished C tile cached as a clean line (MESI-X E, not I): later tasks of the call read it.
    keep_c: bool = False
    # Where the C buffer's first contents come from when ``load_c`` (None: the C tile itself).
    c_init: TileRef | None = None
    # ``deps`` step by step: ``gates[k]`` (a subset of ``deps``) must have finished before step k is issued,
    # ``gates[len(steps)]`` before the write-back; a stream device may then start the task once every dep has
    # *started* (started tasks finish without waiting for later ones: no deadlock). Without gates, and on
    # the CPU worker (whole tasks), every dep must have finished before the task starts.
    gates: tuple[tuple[int, ...], ...] = ()
    # Write after read (in-place TRMM): the gates name tasks that *read* what this task overwrites, so a gate
    # opens once their kernels are done (``Call.computed``): a line's write-backs no longer wait in a chain.
    war: bool = False
    # Started ahead of Eq. 3's choice (which would rank it last: it reads no A/B tile): later tasks wait
    # for it (TRSM's inversions of the diagonal blocks).
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
    """A rotatable task's steps from ``start``: the first one run takes the initial beta, the others accumulate."""
    start %= len(steps)
    if start == 0:
        return steps
    first_beta = steps[0].beta
    order = steps[start:] + steps[:start]
    return tuple(s._replace(beta=first_beta if i == 0 else SC_ONE) for i, s in enumerate(order))
