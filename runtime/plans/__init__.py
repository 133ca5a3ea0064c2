"""Planners of the level-3 routines (the paper's Eq. 1a-1f, Section IV-A), one module per family.

Every planner here is a pure
function of shapes and flags that returns the call's tasks, one per output
tile it writes, in canonical (column-major) form with explicit flags:

* ``tile`` is the tile size T; edge tiles are smaller (``tile_ref``);
* ``lower`` names the *stored* triangle that is read (A of SYMM/HEMM, TRMM,
  TRSM) or written (C of SYRK/HERK/SYR2K/HER2K): 1 lower, 0 upper;
* ``op`` is the op code (0 N, 1 T, 2 C) applied to the stored operand;
* ``alpha_zero`` / ``beta_zero`` let the plan follow BLAS: with alpha == 0
  A and B are not read, with beta == 0 the written part of C is not read.

Operand slots (indices into the call's operand list) per routine:

==================  ====================================================
plan_symm           0 A (the square symmetric/Hermitian factor), 1 B, 2 C
plan_syrk           0 A, 1 C
plan_syr2k          0 A, 1 B, 2 C
plan_trmm           0 A (triangular), 1 B (read only), 2 C (the output; the
                    same array as B with ``in_place``)
plan_trsm           0 A (triangular), 1 B (right-hand side, read only as
                    each task's initial C), 2 X (the output; may be the
                    same array as B when solving in place); with
                    ``inverse``, 3 V (scratch: the inverses of A's
                    diagonal blocks, ``inverse_ref``)
==================  ====================================================

Diagonal tiles run the matching tile kernel (``symm``, ``hemm``, ``syrk``,
``herk``, ``syr2k``, ``her2k``, ``trmm``, ``trsm``: see
``devices/numpy_kernels.py`` for the contract); every other contribution is a
``gemm`` step on a *stored* tile, the mirror tile (k, i) with op T (C for the
Hermitian routines) standing for the unstored (i, k). A task's ``flops`` is
the sum of its steps' flops by the conventions of ``call.STEP_FLOPS`` (complex
counts 4 times), so tasks of one call really differ in weight.

Scheduling flags:

* tasks whose steps are all full-tile accumulations (``c = alpha X + beta_s c``)
  are ``rotatable``; diagonal tiles of the triangle-only routines are not: the
  late-C fold of the worker (``Knobs.late_c``) adds ``beta * old C`` over the
  whole tile, which would clobber the triangle that must stay as loaded;
  TRMM's tasks rotate their gemm steps only (``fixed=1``: the diagonal step,
  which initialises C, stays first; TRMM never loads C, so no late-C fold);
* a C tile that is only partly written has ``load_c=True`` even with
  ``beta == 0`` (the untouched triangle is written back as loaded), its
  kernels then still get ``SC_ZERO`` as beta (the written triangle is not read);
* TRSM tasks have ``deps`` on the tasks that solve the X tiles they read, read
  those through TileRefs of slot 2 (kept cached: ``keep_c``), start from B's
  tile (``c_init``) and are listed level by level (every column of the first
  block row solved, then the next...), so ready work comes first;
* in-place TRMM tasks have the mirror ``deps`` (write after read): a B tile is
  overwritten only once the kernels of every task reading its old value are
  done (``Task.war``: their own write-backs need not be). The
  block columns (side 0) or rows (side 1) of B are independent *lines*; tasks
  are listed as a wave over them (``trmm_order``: line l starts one level after
  line l - 1), so B comes from the host one line per level instead of all of
  it for the first level (level by level for grids of at most 16 tiles);
* both carry ``gates`` (see ``Task``): TRSM's step k waits only for the X tile
  it reads, TRMM's write-back alone waits, so tasks start early and overlap
  their loads and updates with the tasks they depend on;
* TRSM with ``inverse``: one more task per diagonal block inverts A's
  triangle (``trtri``, from A's tile into V's, kept cached) and each diagonal
  solve becomes a triangular multiply by that inverse (``invmm``), gated on
  it. cuBLAS runs the multiply about twice as fast as the solve, and an
  inversion costs about one and a half multiplies; the inverse is made once
  for the call (not once per device) and read by the other devices over the
  peer link (L2). Each inversion is listed two levels ahead
  of the tiles that use it, so it runs while earlier levels are solved; the
  first level keeps trsm steps (waiting for an inversion would idle it).
"""

from __future__ import annotations

from .common import (LOWER, SIDE_LEFT, SIDE_RIGHT, SYMM_A, SYMM_B, SYMM_C, SYR2K_A, SYR2K_B, SYR2K_C, SYRK_A,
                     SYRK_C, TRMM_A, TRMM_B, TRMM_C, TRSM_A, TRSM_B, TRSM_V, TRSM_X, UPPER, step_flops, task_flops)
from .gemm import SLOT_A, SLOT_B, SLOT_C, gemm_flops, plan_gemm, tile_order
from .rank import plan_syr2k, plan_syrk
from .symm import plan_symm
from .tri import (AUTO_LEVELS_MAX_TILES, TRMM_ORDERS, effective_lower, inverse_ref, inverse_shape, plan_trmm,
                  plan_trsm, trmm_levels, trmm_order, trsm_levels)

__all__ = [n for n in dir() if not n.startswith("_") and n != "annotations"]
