"""Planners of the level-3 routines (the paper's Eq. 1a-1f, Section IV-A), one module per family.

Each planner is a pure function of shapes and flags returning the call's tasks, one per output tile,
in canonical (column-major) form: ``tile`` is T (edge tiles smaller); ``lower`` names the *stored*
triangle read (A of SYMM/HEMM, TRMM, TRSM) or written (C of SYRK/HERK/SYR2K/HER2K), 1 lower, 0 upper;
``op`` is 0 N, 1 T, 2 C; ``alpha_zero``/``beta_zero`` follow BLAS (A, B or C are then not read).
Operand slots are in ``common.py``. Diagonal tiles run the matching tile kernel
(``devices/numpy_kernels.py``); every other contribution is a ``gemm`` step on a *stored* tile, the
mirror tile (k, i) with op T (C when Hermitian) standing for (i, k). A task's ``flops`` sums its
steps' (``call.STEP_FLOPS``; complex x4). Scheduling flags:

* ``rotatable``: every step is a full-tile accumulation; not for diagonal tiles of the triangle-only
  routines (the late-C fold would clobber the kept triangle); TRMM rotates its gemm steps only.
* A partly written C tile has ``load_c=True`` even with ``beta == 0`` (its untouched triangle is
  written back as loaded); its kernels still get ``SC_ZERO``.
* ``deps`` and ``gates``: TRSM's on the tasks solving the X tiles it reads (``keep_c``), step by step;
  in-place TRMM's mirror ones (write after read: ``Task.war``), for its write-back alone; GEMM's split-k
  reductions on their partial tasks (``choose_split`` picks the split from the devices' streams and caches).
"""

from __future__ import annotations

from .common import (LOWER, SIDE_LEFT, SIDE_RIGHT, SYMM_A, SYMM_B, SYMM_C, SYR2K_A, SYR2K_B, SYR2K_C, SYRK_A,
                     SYRK_C, TRMM_A, TRMM_B, TRMM_C, TRSM_A, TRSM_B, TRSM_V, TRSM_X, UPPER, step_flops, task_flops)
from .conv import Span, gemm_tasks, plan_conv_forward, plan_conv_weight, spans
from .gemm import SLOT_A, SLOT_B, SLOT_C, SLOT_P, gemm_flops, partial_ref, partial_shape, plan_gemm, tile_order
from .rank import plan_syr2k, plan_syrk
from .split import MIN_PART_TILES, PARTIAL_SHARE, choose_split
from .symm import plan_symm
from .tri import (AUTO_LEVELS_MAX_TILES, TRMM_ORDERS, effective_lower, inverse_ref, inverse_shape, plan_trmm,
                  plan_trsm, trmm_levels, trmm_order, trsm_levels)

__all__ = [n for n in dir() if not n.startswith("_") and n != "annotations"]
