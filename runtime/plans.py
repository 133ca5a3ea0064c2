"""Planners of the level-3 routines beyond GEMM (the paper's Eq. 1b-1f, Section IV-A).

Like :func:`~blasx.runtime.tasks.plan_gemm`, every planner here is a pure
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
  it. A cuBLAS DTRSM tile ran at 21 TFLOPS on an H200, the multiply at 41
  (out of place + copy back) and an inversion costs ~1.5 of them; the inverse
  is made once for the call (not once per device) and read by the other
  devices over the peer link (L2). Each inversion is listed two levels ahead
  of the tiles that use it, so it runs while earlier levels are solved; the
  first level keeps trsm steps (waiting for an inversion would idle it).
"""

from __future__ import annotations

from typing import Iterable

from .call import STEP_FLOPS
from .tasks import (SC_ALPHA, SC_ALPHA_CONJ, SC_BETA, SC_MINUS_ONE, SC_ONE, SC_ZERO, Step, Task,
                    tile_order)
from .tiling import OP_C, OP_N, OP_T, TileRef, n_tiles, op_tile, tile_ref

# Operand slots, per routine (see the module docstring).
SYMM_A, SYMM_B, SYMM_C = 0, 1, 2
SYRK_A, SYRK_C = 0, 1
SYR2K_A, SYR2K_B, SYR2K_C = 0, 1, 2
TRMM_A, TRMM_B, TRMM_C = 0, 1, 2
TRSM_A, TRSM_B, TRSM_X, TRSM_V = 0, 1, 2, 3

SIDE_LEFT, SIDE_RIGHT = 0, 1
UPPER, LOWER = 0, 1


def step_flops(step: Step, is_complex: bool) -> float:
    """Real flops of one step (as ``Call.step_flops``: complex counts 4 times)."""
    f = STEP_FLOPS[step.kernel](step) if step.kernel in STEP_FLOPS else 2.0 * step.m * step.n * step.k
    return 4.0 * f if is_complex else f


def task_flops(steps: Iterable[Step], is_complex: bool) -> float:
    return float(sum(step_flops(s, is_complex) for s in steps))


def _first_beta(beta_zero: bool) -> int:
    return SC_ZERO if beta_zero else SC_BETA


def _scale(c, beta_ix: int) -> Step:
    return Step("scale", None, None, OP_N, OP_N, c.rows, c.cols, 0, SC_ALPHA, beta_ix)


def _width(index: int, extent: int, tile: int) -> int:
    return min(tile, extent - index * tile)


def _mirror_op(hermitian: bool) -> int:
    return OP_C if hermitian else OP_T


# =========================================================================== SYMM / HEMM

def plan_symm(m: int, n: int, tile: int, side: int, lower: int, *, hermitian: bool = False,
              alpha_zero: bool = False, beta_zero: bool = True, is_complex: bool = False,
              block: tuple[int, int] = (1, 1)) -> list[Task]:
    """Tasks of ``C = alpha S B + beta C`` (side 0) or ``C = alpha B S + beta C`` (side 1).

    C and B are m x n; S is the symmetric (``hermitian``: Hermitian) matrix
    defined by the ``lower`` (else upper) triangle of the stored square A
    (m x m for side 0, n x n for side 1). Eq. 1f: C_ij sums S_ik B_kj over k;
    the diagonal S_ii is a ``symm``/``hemm`` step on A(i, i), a stored S_ik is
    a gemm on A(i, k) with op N, an unstored one a gemm on the mirror A(k, i)
    with op T (C). Steps run in k order; the first takes the task's beta.
    """
    kernel = "hemm" if hermitian else "symm"
    mirror = _mirror_op(hermitian)
    s_dim = m if side == SIDE_LEFT else n
    tm, tn, ts = n_tiles(m, tile), n_tiles(n, tile), n_tiles(s_dim, tile)
    first = _first_beta(beta_zero)
    tasks: list[Task] = []
    for i, j in tile_order(tm, tn, block):
        c = tile_ref(SYMM_C, i, j, m, n, tile)
        if alpha_zero:
            steps = (_scale(c, first),)
        else:
            steps = []
            for k in range(ts):
                beta_ix = first if k == 0 else SC_ONE
                kw = _width(k, s_dim, tile)
                if side == SIDE_LEFT:  # S_ik B_kj
                    b = tile_ref(SYMM_B, k, j, m, n, tile)
                    if k == i:
                        steps.append(Step(kernel, tile_ref(SYMM_A, i, i, m, m, tile), b, OP_N, OP_N,
                                          c.rows, c.cols, kw, SC_ALPHA, beta_ix, side, lower))
                    else:
                        stored = (i > k) == bool(lower)
                        a = tile_ref(SYMM_A, i, k, m, m, tile) if stored else tile_ref(SYMM_A, k, i, m, m, tile)
                        steps.append(Step("gemm", a, b, OP_N if stored else mirror, OP_N,
                                          c.rows, c.cols, kw, SC_ALPHA, beta_ix))
                else:  # B_ik S_kj
                    bt = tile_ref(SYMM_B, i, k, m, n, tile)
                    if k == j:
                        steps.append(Step(kernel, tile_ref(SYMM_A, j, j, n, n, tile), bt, OP_N, OP_N,
                                          c.rows, c.cols, kw, SC_ALPHA, beta_ix, side, lower))
                    else:
                        stored = (k > j) == bool(lower)
                        a = tile_ref(SYMM_A, k, j, n, n, tile) if stored else tile_ref(SYMM_A, j, k, n, n, tile)
                        steps.append(Step("gemm", bt, a, OP_N, OP_N if stored else mirror,
                                          c.rows, c.cols, kw, SC_ALPHA, beta_ix))
            steps = tuple(steps)
        tasks.append(Task(len(tasks), c, not beta_zero, steps, task_flops(steps, is_complex),
                          rotatable=len(steps) > 1))
    return tasks


# =========================================================================== SYRK / HERK, SYR2K / HER2K

def _triangle(tn: int, lower: int, block: tuple[int, int]) -> list[tuple[int, int]]:
    """The C tiles (i, j) of the ``lower`` (i >= j) or upper (i <= j) triangle, in block order."""
    return [(i, j) for i, j in tile_order(tn, tn, block) if (i >= j if lower else i <= j)]


def _rank_op(op: int, hermitian: bool) -> int:
    """The op applied to the second factor's stored tile: op(A)_jk^T (^H) in terms of stored tiles."""
    if op == OP_N:
        return _mirror_op(hermitian)
    return OP_N


def _rank_tile(slot: int, op: int, i: int, kk: int, n: int, k: int, tile: int):
    """Stored tile of op(X) tile (i, kk), op(X) being n x k.

    It is also the right factor of a rank-k gemm step, with op ``_rank_op(op)``:
    for op N, op(X)_jk^T is X(j, kk) with op T (C); for op T (C), op(X)_jk =
    X(kk, j)^T (^H), whose transpose (conjugate transpose) is X(kk, j) with op N."""
    rows, cols = (n, k) if op == OP_N else (k, n)
    return op_tile(slot, op, i, kk, rows, cols, tile)


def _plan_rank_k(n: int, k: int, tile: int, op: int, lower: int, kernel: str, c_slot: int,
                 diag_slots: tuple[int, int | None], terms: tuple[tuple[int, int, int], ...], *,
                 hermitian: bool, alpha_zero: bool, beta_zero: bool, is_complex: bool,
                 block: tuple[int, int]) -> list[Task]:
    """The loop :func:`plan_syrk` and :func:`plan_syr2k` share: tasks of the ``lower`` (else
    upper) triangle of the n x n C in slot ``c_slot``, op(X) being n x k for every operand.

    A diagonal tile runs one ``kernel`` step per k tile on the tiles (i, kk) of the
    ``diag_slots`` (a, b) operands (b None: no b tile, op_b N); an off-diagonal tile runs,
    per k tile, one gemm step ``alpha_s op(X)_ik op(Y)_jk^T`` per (X, Y, alpha_s) of
    ``terms``. A task's first step takes its beta, the later ones accumulate. With
    ``alpha == 0`` or ``k == 0`` a diagonal tile gets one ``kernel`` step with ``k == 0``
    and no tiles, the others a ``scale``.
    """
    a_slot, b_slot = diag_slots
    op_b = OP_N if b_slot is None else op
    op2 = _rank_op(op, hermitian)
    tn, tk = n_tiles(n, tile), n_tiles(k, tile)
    first = _first_beta(beta_zero)
    skip = alpha_zero or k == 0

    def x_tile(slot, i, kk):
        return None if slot is None else _rank_tile(slot, op, i, kk, n, k, tile)

    tasks: list[Task] = []
    for i, j in _triangle(tn, lower, block):
        c = tile_ref(c_slot, i, j, n, n, tile)
        diag = i == j
        if skip:
            steps = ((Step(kernel, None, None, op, op_b, c.rows, c.cols, 0, SC_ALPHA, first, 0, lower),)
                     if diag else (_scale(c, first),))
        elif diag:
            steps = tuple(
                Step(kernel, x_tile(a_slot, i, kk), x_tile(b_slot, i, kk), op, op_b,
                     c.rows, c.cols, _width(kk, k, tile), SC_ALPHA, first if kk == 0 else SC_ONE, 0, lower)
                for kk in range(tk))
        else:
            steps = tuple(
                Step("gemm", x_tile(x, i, kk), x_tile(y, j, kk), op, op2, c.rows, c.cols, _width(kk, k, tile),
                     alpha_ix, first if kk == 0 and t == 0 else SC_ONE)
                for kk in range(tk) for t, (x, y, alpha_ix) in enumerate(terms))
        # A diagonal tile's other triangle is written back as loaded: always load_c, and no
        # rotation (the late-C fold adds beta * old C over the whole tile).
        tasks.append(Task(len(tasks), c, diag or not beta_zero, steps, task_flops(steps, is_complex),
                          rotatable=(not diag) and len(steps) > 1))
    return tasks


def plan_syrk(n: int, k: int, tile: int, op: int, lower: int, *, hermitian: bool = False,
              alpha_zero: bool = False, beta_zero: bool = True, is_complex: bool = False,
              block: tuple[int, int] = (1, 1)) -> list[Task]:
    """Tasks of ``C = alpha op(A) op(A)^T + beta C`` (``hermitian``: ^H, real alpha, beta)
    on the ``lower`` (else upper) triangle of the n x n C (Eq. 1b).

    ``op(A)`` is n x k: A is stored n x k for op N, k x n for op T (SYRK) or C
    (HERK). Only tiles of the triangle get tasks. A diagonal tile runs one
    ``syrk``/``herk`` step per k tile on A's tile (load_c always: its other
    triangle is written back as loaded; not rotatable); an off-diagonal tile
    runs gemm steps ``op(A)_ik op(A)_jk^T``. With ``alpha == 0`` or ``k == 0``
    diagonal tiles get one ``syrk``/``herk`` step with ``k == 0`` and no tile
    (``C_tri = beta C_tri``; HERK also zeroes the diagonal's imaginary part), the
    others a ``scale``.
    """
    return _plan_rank_k(n, k, tile, op, lower, "herk" if hermitian else "syrk", SYRK_C, (SYRK_A, None),
                        ((SYRK_A, SYRK_A, SC_ALPHA),), hermitian=hermitian, alpha_zero=alpha_zero,
                        beta_zero=beta_zero, is_complex=is_complex, block=block)


def plan_syr2k(n: int, k: int, tile: int, op: int, lower: int, *, hermitian: bool = False,
               alpha_zero: bool = False, beta_zero: bool = True, is_complex: bool = False,
               block: tuple[int, int] = (1, 1)) -> list[Task]:
    """Tasks of ``C = alpha op(A) op(B)^T + alpha op(B) op(A)^T + beta C`` (Eq. 1e) on the
    ``lower`` (else upper) triangle; ``hermitian``: ``alpha op(A) op(B)^H +
    conj(alpha) op(B) op(A)^H``, beta real.

    A and B have the same shape (n x k for op N, k x n for op T / C). A
    diagonal tile runs one ``syr2k``/``her2k`` step per k tile (a = A's tile,
    b = B's); an off-diagonal tile runs two gemm steps per k tile:
    ``alpha op(A)_ik op(B)_jk^T`` then ``alpha' op(B)_ik op(A)_jk^T`` with
    alpha' = conj(alpha) (SC_ALPHA_CONJ) for HER2K. ``alpha == 0`` or ``k == 0``
    as in :func:`plan_syrk`.
    """
    alpha2 = SC_ALPHA_CONJ if hermitian else SC_ALPHA
    return _plan_rank_k(n, k, tile, op, lower, "her2k" if hermitian else "syr2k", SYR2K_C, (SYR2K_A, SYR2K_B),
                        ((SYR2K_A, SYR2K_B, SC_ALPHA), (SYR2K_B, SYR2K_A, alpha2)), hermitian=hermitian,
                        alpha_zero=alpha_zero, beta_zero=beta_zero, is_complex=is_complex, block=block)


# =========================================================================== TRMM

def effective_lower(lower: int, op: int) -> bool:
    """True if op(A) is lower triangular (A's stored triangle, transposed by T / C)."""
    return bool(lower) != (op != OP_N)


def trmm_levels(m: int, n: int, tile: int, side: int, lower: int, op: int) -> list[int]:
    """Block rows (side 0) or block columns (side 1) of B in the order an in-place TRMM writes them.

    A row (column) is written only after every task that reads its old value:
    left side, lower op(A): C_ij reads B_kj for k <= i, so the bottom row goes
    first; upper: the top row first; right side, lower op(A): C_ij reads B_ik
    for k >= j, so the left column first; upper: the right column first.
    """
    eff_lower = effective_lower(lower, op)
    count = n_tiles(m if side == SIDE_LEFT else n, tile)
    ascending = (not eff_lower) if side == SIDE_LEFT else eff_lower
    return list(range(count)) if ascending else list(range(count - 1, -1, -1))


#: Order families of in-place TRMM tasks (:func:`trmm_order`); ``lines``, ``wave``, ``work`` and
#: ``bands`` take a number. Only ``auto`` (the default), ``levels``, ``wave`` and ``blocks`` are meant
#: for use; the others are kept so that ``bench/level3_sim.py`` can reproduce the comparison in NOTES.md.
TRMM_ORDERS = ("auto", "levels", "wave", "lines", "work", "bands", "blocks")
#: ``auto`` lists level by level when the grid has at most this many tiles, else in blocks of 2 x 2
#: (on 2x H200 at N = 32768, 8 x 8 tiles, with the gemm steps rotated per device: 0.896-0.903 of
#: GEMM in 3 runs, the wave 0.866-0.880; NOTES.md, sixth session). Before blocks, the wave: in the
#: 2-GPU timing sim (bench/results/NOTES.md, fourth session) the wave won from 5 x 5 tiles up
#: (+7% at 5 x 5 and 6 x 6, +5% at 8 x 8, +1% at 12 x 12) but lost 12% at 4 x 4 (N = 16384, T =
#: 4096), where the whole call is held at once (2 devices x (station 4 + streams 4)) and the order
#: only decides which device gets which tasks: level by level, one device takes level 0 and the
#: other level 1, and they share B's tiles. The rule follows the 2-GPU case; it costs 5% at 3 x 3,
#: and 4 GPUs would prefer the wave at 4 x 4 too (+8%).
AUTO_LEVELS_MAX_TILES = 16


def _order_key(order: str, levels: int, lines: int):
    """The sort key of (depth, line) cells for ``order`` (see :func:`trmm_order`)."""
    family = order.rstrip("0123456789.")
    arg = order[len(family):]
    try:
        x = float(arg) if arg else None
    except ValueError:
        x = None
        family = "?"
    integral = family in ("lines", "bands", "work", "blocks")
    if (family not in TRMM_ORDERS or (x is None and family in ("work", "bands"))
            or (x is not None and (family in ("auto", "levels") or not x > 0 or (integral and x != int(x))))):
        raise ValueError(f"order: got {order!r}; allowed: auto, levels, wave[S], lines[Q], work[Q], bands[B], "
                         f"blocks[B] (S a number > 0, default 1; Q and B ints >= 1, lines' default 1, "
                         f"blocks' 2)")
    if family == "auto":
        family, x = ("levels", None) if levels * lines <= AUTO_LEVELS_MAX_TILES else ("blocks", None)
    if family == "levels":
        return lambda c: (c[0], c[1])
    if family == "wave":
        s = 1.0 if x is None else x
        return lambda c: (c[0] + s * c[1], c[1])
    if family == "lines":
        q = 1 if x is None else int(x)
        return lambda c: (c[1] // q, c[0], c[1])
    if family == "bands":
        b = int(x)
        return lambda c: (c[0] // b, c[1], c[0])
    if family == "blocks":
        b = 2 if x is None else int(x)
        return lambda c: (c[0] // b + c[1] // b, c[0] // b, c[0], c[1])
    # work: line l starts once 1/q of a line's steps are listed (a level of depth d has levels - d steps)
    before = [sum(levels - e for e in range(d)) for d in range(levels + 1)]
    start = before[levels] / x
    return lambda c: (before[c[0]] + c[1] * start, c[1])


def trmm_order(m: int, n: int, tile: int, side: int, lower: int, op: int, order: str = "auto") -> list[tuple[int, int]]:
    """The tiles (i, j) of an in-place TRMM, in task-list order.

    A *line* is a block column of B (side 0) or a block row (side 1). Its tiles
    read and overwrite only tiles of the same line, so they depend only on each
    other, level by level: the tile of depth d (``trmm_levels(...)[d]``) is
    written after the tiles of depth < d of its line. Every order below keeps
    each line's tiles in depth order, so every task is listed after its
    dependencies; they differ in how the lines are interleaved:

    * ``levels``: depth 0 of every line, then depth 1, ... The first level reads
      all of B (side 0, upper: C_0j reads B_kj for every k), so a device's first
      tasks each need a whole column of B from the host before any reuse.
    * ``wave[S]`` (S default 1): line l starts S levels after line l - 1; cell
      (d, l) sorts by d + S l, then by line. With S = 1 one new line of B and
      one new row of A enter per level, and the loads of a new line overlap the
      updates of the lines already started.
    * ``lines[Q]``: Q lines at a time, level by level among them (Q = 1: line
      by line).
    * ``work[Q]``: as ``wave``, with depths weighted by their steps: line l
      starts once 1/Q of a line's steps have been listed.
    * ``bands[B]``: B levels at a time, line by line within them.
    * ``blocks[B]`` (B default 2): blocks of B levels x B lines, listed as a
      wave over blocks (block (D, L) by D + L, then D), level by level within a
      block. The B^2 tasks of a block (one device's streams take them together)
      share B rows of A and B lines of B, and the next block of a front shares
      those rows of A (read over the peer link) with B new lines.
    * ``auto`` (default): ``levels`` for grids of at most ``AUTO_LEVELS_MAX_TILES``
      tiles, else ``blocks``.
    """
    levels = trmm_levels(m, n, tile, side, lower, op)
    lines = n_tiles(n if side == SIDE_LEFT else m, tile)
    key = _order_key(order, len(levels), lines)
    cells = sorted(((d, ln) for d in range(len(levels)) for ln in range(lines)), key=key)
    return [(levels[d], ln) if side == SIDE_LEFT else (ln, levels[d]) for d, ln in cells]


def plan_trmm(m: int, n: int, tile: int, side: int, lower: int, op: int, unit: int, *,
              alpha_zero: bool = False, is_complex: bool = False,
              block: tuple[int, int] = (1, 1), in_place: bool = False, order: str = "auto") -> list[Task]:
    """Tasks of ``C = alpha op(A) B`` (side 0) or ``C = alpha B op(A)`` (side 1) (Eq. 1d).

    A is the ``lower`` (else upper) triangle of the stored square A (m x m for
    side 0, n x n for side 1), with a unit diagonal if ``unit``. Task (i, j)
    runs the diagonal ``trmm`` step first (it initialises C; no beta, load_c
    False), then gemm steps ``alpha op(A)_ik B_kj`` (side 0) or ``alpha B_ik
    op(A)_kj`` (side 1) over the nonzero tiles of op(A), with beta SC_ONE: those
    rotate (``rotatable`` with ``fixed=1``: the diagonal step stays first). With
    ``alpha == 0``, C = 0 and A, B are not read.

    Out of place (default), C (slot 2) is a separate m x n output, B (slot 1)
    is only read, and tasks follow ``tile_order``. ``in_place``: slot 2 is the
    same array as B, so a tile may be written only once the kernels of every
    task reading its old value are done (``war``). Each task depends on every task of the earlier
    levels (:func:`trmm_levels`) in its block column (side 0) or block row
    (side 1): write-after-read dependencies, the mirror of TRSM's
    read-after-write ones. Tasks are listed in ``order`` (:func:`trmm_order`;
    every order lists a task after its dependencies, and the dependencies do
    not depend on the order); ``order`` is not used out of place.
    """
    eff_lower = effective_lower(lower, op)
    tm, tn = n_tiles(m, tile), n_tiles(n, tile)
    if in_place and not alpha_zero:
        cells = trmm_order(m, n, tile, side, lower, op, order)
    else:
        cells = list(tile_order(tm, tn, block))
    tasks: list[Task] = []
    tid_of: dict[tuple[int, int], int] = {}
    for i, j in cells:
        c = tile_ref(TRMM_C, i, j, m, n, tile)
        if alpha_zero:
            steps = (_scale(c, SC_ZERO),)
        elif side == SIDE_LEFT:  # C_ij = sum_k op(A)_ik B_kj, k <= i (lower) or k >= i (upper)
            steps = [Step("trmm", tile_ref(TRMM_A, i, i, m, m, tile), tile_ref(TRMM_B, i, j, m, n, tile),
                          op, OP_N, c.rows, c.cols, c.rows, SC_ALPHA, SC_ZERO, side, lower, unit)]
            for k in (range(i) if eff_lower else range(i + 1, tm)):
                steps.append(Step("gemm", op_tile(TRMM_A, op, i, k, m, m, tile), tile_ref(TRMM_B, k, j, m, n, tile),
                                  op, OP_N, c.rows, c.cols, _width(k, m, tile), SC_ALPHA, SC_ONE))
            steps = tuple(steps)
        else:  # C_ij = sum_k B_ik op(A)_kj, k >= j (lower) or k <= j (upper)
            steps = [Step("trmm", tile_ref(TRMM_A, j, j, n, n, tile), tile_ref(TRMM_B, i, j, m, n, tile),
                          op, OP_N, c.rows, c.cols, c.cols, SC_ALPHA, SC_ZERO, side, lower, unit)]
            for k in (range(j + 1, tn) if eff_lower else range(j)):
                steps.append(Step("gemm", tile_ref(TRMM_B, i, k, m, n, tile), op_tile(TRMM_A, op, k, j, n, n, tile),
                                  OP_N, op, c.rows, c.cols, _width(k, n, tile), SC_ALPHA, SC_ONE))
            steps = tuple(steps)
        deps: tuple[int, ...] = ()
        gates: tuple[tuple[int, ...], ...] = ()
        if in_place and not alpha_zero:
            # Every task that reads B_ij's old value sits in an earlier level of this column (row).
            # Only the write-back waits for them: the task reads nothing they write.
            line = [(i, jj) for jj in range(tn)] if side == SIDE_RIGHT else [(ii, j) for ii in range(tm)]
            deps = tuple(sorted(tid_of[x] for x in line if x in tid_of))
            gates = ((),) * len(steps) + (deps,)
        tid_of[(i, j)] = len(tasks)
        # The gemm steps after the diagonal one commute: devices start them at different k
        # (rotatable, fixed=1), so that two devices loading one row of A split it between them.
        tasks.append(Task(len(tasks), c, False, steps, task_flops(steps, is_complex), deps, gates=gates,
                          war=bool(gates), rotatable=len(steps) > 2, fixed=1))
    return tasks


# =========================================================================== TRSM

def trsm_levels(m: int, n: int, tile: int, side: int, lower: int, op: int) -> list[int]:
    """Block rows (side 0) or block columns (side 1) of X in solve order (Eq. 1c)."""
    eff_lower = effective_lower(lower, op)
    count = n_tiles(m if side == SIDE_LEFT else n, tile)
    # left: lower op(A) is forward substitution; right: X op(A), upper op(A) is forward.
    forward = eff_lower if side == SIDE_LEFT else not eff_lower
    return list(range(count)) if forward else list(range(count - 1, -1, -1))


def inverse_shape(s_dim: int, tile: int) -> tuple[int, int]:
    """Shape of TRSM's scratch V (column-major): diagonal block k's inverse sits in rows
    [0, w_k), columns [k T, k T + w_k) (w_k the block's width), one block per column tile."""
    return min(tile, s_dim), s_dim


def inverse_ref(k: int, s_dim: int, tile: int) -> TileRef:
    """V's tile holding the inverse of A's diagonal block ``k`` (a square of its width)."""
    w = _width(k, s_dim, tile)
    return TileRef(TRSM_V, 0, k, 0, k * tile, w, w)


def plan_trsm(m: int, n: int, tile: int, side: int, lower: int, op: int, unit: int, *,
              alpha_zero: bool = False, is_complex: bool = False, inverse: bool = False) -> list[Task]:
    """Tasks of the solve ``op(A) X = alpha B`` (side 0) or ``X op(A) = alpha B`` (side 1).

    X and B are m x n; A is the ``lower`` (else upper) triangle of the stored
    square A (m x m for side 0, n x n for side 1), unit diagonal if ``unit``.
    Left side, forward case (Eq. 1c with the order reversed for the backward
    case): ``X_ij = op(A)_ii^-1 (alpha B_ij - sum_{k before i} op(A)_ik X_kj)``.

    Task (i, j) starts from B_ij (``c_init``, load_c), runs one gemm step
    ``c = -op(A)_ik X_kj + beta_s c`` per solved tile (beta_s = SC_ALPHA for the
    first one: it scales B by alpha, then SC_ONE), then the diagonal ``trsm``
    step with alpha SC_ONE (SC_ALPHA if it had no update). X tiles are read
    through TileRefs of slot 2; ``deps`` are the tasks that solve them;
    ``keep_c`` is set on the tasks whose X tile a later task reads. Tasks are
    listed level by level (block rows for side 0, block columns for side 1, in
    solve order), all tiles of a level together. With ``alpha == 0`` X = 0:
    ``scale`` tasks with no dependencies, A and B not read.

    ``inverse``: the diagonal block of each level but the first is inverted once
    by a task of its own (``trtri`` on V's tile, ``inverse_ref``, loaded from A's:
    ``c_init``; ``keep_c``, ``urgent``), listed two levels ahead of its use (the
    first two before level 0); the diagonal step of a tile is then ``invmm`` (``c =
    op(V_kk) c``, side 0; ``c = c op(V_kk)``, side 1) on V's tile, gated on that
    task, which is in ``deps``. The first level keeps ``trsm`` steps: its tiles
    have nothing else to do, so waiting for an inversion (load, invert, write
    back) would idle every device at the start, while the next inversions run
    beside them.
    """
    tm, tn = n_tiles(m, tile), n_tiles(n, tile)
    s_dim = m if side == SIDE_LEFT else n
    levels = trsm_levels(m, n, tile, side, lower, op)
    tasks: list[Task] = []
    if alpha_zero:
        for i in range(tm):
            for j in range(tn):
                c = tile_ref(TRSM_X, i, j, m, n, tile)
                steps = (_scale(c, SC_ZERO),)
                tasks.append(Task(len(tasks), c, False, steps, task_flops(steps, is_complex)))
        return tasks
    tid_of: dict[tuple[int, int], int] = {}
    inv_of: dict[int, int] = {}
    last = len(levels) - 1

    def add_inverse(lv: int) -> None:
        v = inverse_ref(lv, s_dim, tile)
        step = Step("trtri", None, None, OP_N, OP_N, v.rows, v.cols, v.rows, SC_ONE, SC_ONE, side, lower, unit)
        inv_of[lv] = len(tasks)
        tasks.append(Task(len(tasks), v, True, (step,), task_flops((step,), is_complex), keep_c=True,
                          c_init=tile_ref(TRSM_A, lv, lv, s_dim, s_dim, tile), urgent=True))

    if inverse:
        for lv in levels[1:3]:
            add_inverse(lv)
    for depth, lv in enumerate(levels):
        if inverse and depth + 3 < len(levels):
            add_inverse(levels[depth + 3])  # two levels ahead of the tiles that use it
        done = levels[:depth]  # solved before this level, in solve order
        others = range(tn) if side == SIDE_LEFT else range(tm)
        for o in others:
            i, j = (lv, o) if side == SIDE_LEFT else (o, lv)
            c = tile_ref(TRSM_X, i, j, m, n, tile)
            steps = []
            deps = []
            for k in done:
                beta_ix = SC_ALPHA if not steps else SC_ONE
                kw = _width(k, s_dim, tile)
                if side == SIDE_LEFT:
                    a = op_tile(TRSM_A, op, i, k, m, m, tile)
                    x = tile_ref(TRSM_X, k, j, m, n, tile)
                    steps.append(Step("gemm", a, x, op, OP_N, c.rows, c.cols, kw, SC_MINUS_ONE, beta_ix))
                    deps.append(tid_of[(k, j)])
                else:
                    x = tile_ref(TRSM_X, i, k, m, n, tile)
                    a = op_tile(TRSM_A, op, k, j, n, n, tile)
                    steps.append(Step("gemm", x, a, OP_N, op, c.rows, c.cols, kw, SC_MINUS_ONE, beta_ix))
                    deps.append(tid_of[(i, k)])
            scale = SC_ONE if steps else SC_ALPHA
            if inverse and depth:
                diag = inverse_ref(lv, s_dim, tile)
                steps.append(Step("invmm", diag, None, op, OP_N, c.rows, c.cols, diag.rows, scale, SC_ONE,
                                  side, lower, unit))
                diag_gate = (inv_of[lv],)
            else:
                diag = tile_ref(TRSM_A, lv, lv, s_dim, s_dim, tile)
                steps.append(Step("trsm", diag, None, op, OP_N, c.rows, c.cols, diag.rows, scale, SC_ONE,
                                  side, lower, unit))
                diag_gate = ()
            steps = tuple(steps)
            tid_of[(i, j)] = len(tasks)
            # Step by step: each update waits only for the X tile it reads, so a task starts (loads B_ij
            # and its A tiles, applies the solved updates) while the rest of its column is being solved.
            gates = tuple((d,) for d in deps) + (diag_gate, ())
            deps.extend(diag_gate)
            tasks.append(Task(len(tasks), c, True, steps, task_flops(steps, is_complex), deps=tuple(deps),
                              keep_c=depth < last, c_init=tile_ref(TRSM_B, i, j, m, n, tile), gates=gates))
    return tasks
