"""TRMM and TRSM's planners (Eq. 1e, 1f): level orders, write-after-read and solve dependencies."""

from __future__ import annotations

from ..tasks import SC_ALPHA, SC_MINUS_ONE, SC_ONE, SC_ZERO, Step, Task
from ..tiling import OP_N, TileRef, effective_lower, n_tiles, op_tile, tile_ref
from .common import (SIDE_LEFT, SIDE_RIGHT, TRMM_A, TRMM_B, TRMM_C, TRSM_A, TRSM_B, TRSM_V, TRSM_X, _scale, _width,
                     task_flops)
from .gemm import tile_order

def trmm_levels(m: int, n: int, tile: int, side: int, lower: int, op: int) -> list[int]:
    """Block rows (side 0) or block columns (side 1) of B in the order an in-place TRMM writes them: a
    row (column) after every task that reads its old value (left, lower op(A): C_ij reads B_kj for k <= i,
    so the bottom row first). That is TRSM's solve order reversed (a solved tile is read by the ones
    after it, an old one by those before it)."""
    return trsm_levels(m, n, tile, side, lower, op)[::-1]


#: Order families of in-place TRMM tasks (:func:`trmm_order`); ``wave`` and ``blocks`` take a number.
TRMM_ORDERS = ("auto", "levels", "wave", "blocks")
#: ``auto`` lists level by level when the grid has at most this many tiles (the devices hold the whole
#: call at once: level by level, one takes level 0 and the other level 1, sharing B's tiles), else in
#: blocks of 2 x 2 (blocks beat the wave on large grids).
AUTO_LEVELS_MAX_TILES = 16


def _order_key(order: str, levels: int, lines: int):
    """The sort key of (depth, line) cells for ``order`` (see :func:`trmm_order`)."""
    family = order.rstrip("0123456789.")
    arg = order[len(family):]
    try:
        x = float(arg) if arg else None
    except ValueError:
        family = "?"
    if (family not in TRMM_ORDERS or (x is not None and (family in ("auto", "levels") or not x > 0
                                                         or (family == "blocks" and x != int(x))))):
        raise ValueError(f"order: got {order!r}; allowed: auto, levels, wave[S], blocks[B] "
                         f"(S a number > 0, default 1; B an int >= 1, default 2)")
    if family == "auto":
        family, x = ("levels", None) if levels * lines <= AUTO_LEVELS_MAX_TILES else ("blocks", None)
    if family == "levels":
        return lambda c: (c[0], c[1])
    if family == "wave":
        s = 1.0 if x is None else x
        return lambda c: (c[0] + s * c[1], c[1])
    b = 2 if x is None else int(x)
    return lambda c: (c[0] // b + c[1] // b, c[0] // b, c[0], c[1])


def trmm_order(m: int, n: int, tile: int, side: int, lower: int, op: int, order: str = "auto") -> list[tuple[int, int]]:
    """The tiles (i, j) of an in-place TRMM, in task-list order.

    A *line* (a block column of B for side 0, a block row for side 1) depends only on itself, level
    by level: its tile of depth d (``trmm_levels(...)[d]``) is written after those of depth < d.
    Every order keeps that; they differ in how lines interleave:

    * ``levels``: depth 0 of every line, then depth 1, ... (the first level reads all of B);
    * ``wave[S]`` (S default 1): cell (d, l) sorts by d + S l, then l: one new line of B enters
      per level, its loads overlapping the updates of the lines already started;
    * ``blocks[B]`` (B default 2): blocks of B levels x B lines as a wave over blocks (D + L,
      then D), level by level inside; a block's B^2 tasks share B rows of A and B lines of B;
    * ``auto`` (default): ``levels`` up to ``AUTO_LEVELS_MAX_TILES`` tiles, else ``blocks``.
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

    A is the ``lower`` (else upper) triangle of the stored square A, unit diagonal if ``unit``. Task
    (i, j) runs the diagonal ``trmm`` step first (it initialises C: no beta, load_c False), then gemm
    steps over the nonzero tiles of op(A) with beta SC_ONE, which rotate (``fixed=1``). With ``alpha ==
    0``, C = 0 and A, B are not read. Out of place (default), C (slot 2) is a separate output and tasks
    follow ``tile_order``. ``in_place``: slot 2 is B, so each task depends on the tasks of the earlier
    levels (:func:`trmm_levels`) of its line, and only its write-back waits for them (``war``,
    ``gates``); tasks are listed in ``order`` (:func:`trmm_order`), which leaves the dependencies alone.
    """
    eff_lower = effective_lower(lower, op)
    tm, tn = n_tiles(m, tile), n_tiles(n, tile)
    war = bool(in_place) and not alpha_zero  # B's tiles are overwritten: write after read
    cells = trmm_order(m, n, tile, side, lower, op, order) if war else tile_order(tm, tn, block)
    tasks: list[Task] = []
    tid_of: dict[tuple[int, int], int] = {}
    for i, j in cells:
        c = tile_ref(TRMM_C, i, j, m, n, tile)
        if alpha_zero:
            steps = (_scale(c, SC_ZERO),)
        elif side == SIDE_LEFT:  # C_ij = sum_k op(A)_ik B_kj, k <= i (lower) or k >= i (upper)
            steps = (Step("trmm", tile_ref(TRMM_A, i, i, m, m, tile), tile_ref(TRMM_B, i, j, m, n, tile),
                          op, OP_N, c.rows, c.cols, c.rows, SC_ALPHA, SC_ZERO, side, lower, unit),
                     *(Step("gemm", op_tile(TRMM_A, op, i, k, m, m, tile), tile_ref(TRMM_B, k, j, m, n, tile),
                            op, OP_N, c.rows, c.cols, _width(k, m, tile), SC_ALPHA, SC_ONE)
                       for k in (range(i) if eff_lower else range(i + 1, tm))))
        else:  # C_ij = sum_k B_ik op(A)_kj, k >= j (lower) or k <= j (upper)
            steps = (Step("trmm", tile_ref(TRMM_A, j, j, n, n, tile), tile_ref(TRMM_B, i, j, m, n, tile),
                          op, OP_N, c.rows, c.cols, c.cols, SC_ALPHA, SC_ZERO, side, lower, unit),
                     *(Step("gemm", tile_ref(TRMM_B, i, k, m, n, tile), op_tile(TRMM_A, op, k, j, n, n, tile),
                            OP_N, op, c.rows, c.cols, _width(k, n, tile), SC_ALPHA, SC_ONE)
                       for k in (range(j + 1, tn) if eff_lower else range(j))))
        deps, gates, line = (), (), ()
        if war:
            # Every task that reads B_ij's old value sits in an earlier level of this column (row).
            # Only the write-back waits for them: the task reads nothing they write.
            peers = [(i, jj) for jj in range(tn)] if side == SIDE_RIGHT else [(ii, j) for ii in range(tm)]
            deps = tuple(sorted(tid_of[x] for x in peers if x in tid_of))
            gates = ((),) * len(steps) + (deps,)
            line = (i, tm) if side == SIDE_RIGHT else (j, tn)
        tid_of[(i, j)] = len(tasks)
        # The gemm steps after the diagonal one commute: devices start them at different k
        # (rotatable, fixed=1), so that two devices loading one row of A split it between them.
        tasks.append(Task(len(tasks), c, False, steps, task_flops(steps, is_complex), deps, gates=gates,
                          war=war, rotatable=len(steps) > 2, fixed=1, line=line))
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

    X and B are m x n; A is the ``lower`` (else upper) triangle of the stored square A, unit diagonal
    if ``unit``. Forward, left side (Eq. 1c; reversed for backward): ``X_ij = op(A)_ii^-1 (alpha B_ij -
    sum_{k before i} op(A)_ik X_kj)``. Task (i, j) starts from B_ij (``c_init``), runs one gemm step per
    solved tile (the first with beta SC_ALPHA: it scales B), then the diagonal ``trsm`` step; ``deps``:
    the tasks solving the X tiles it reads (slot 2, ``keep_c``). Tasks are listed level by level in
    solve order. With ``alpha == 0``: ``scale`` tasks, A and B not read.

    ``inverse``: each level's diagonal block but the first is inverted once by a task of its own
    (``trtri`` on V's tile ``inverse_ref``, loaded from A's; ``keep_c``, ``urgent``), listed before the
    tiles of the level solved three earlier (those of levels 1 and 2 first); the diagonal step becomes ``invmm``
    by it, gated on that task. The first level keeps ``trsm`` steps, so no device idles waiting for an
    inversion at the start.
    """
    tm, tn = n_tiles(m, tile), n_tiles(n, tile)
    s_dim = m if side == SIDE_LEFT else n
    levels = trsm_levels(m, n, tile, side, lower, op)
    tasks: list[Task] = []
    if alpha_zero:
        for i, j in tile_order(tm, tn):
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
            add_inverse(levels[depth + 3])  # before this level's tiles, three levels ahead of its use
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
            inv = inverse and depth > 0  # a multiply by the block's inverse, gated on its inversion task
            diag = inverse_ref(lv, s_dim, tile) if inv else tile_ref(TRSM_A, lv, lv, s_dim, s_dim, tile)
            steps.append(Step("invmm" if inv else "trsm", diag, None, op, OP_N, c.rows, c.cols, diag.rows, scale,
                              SC_ONE, side, lower, unit))
            diag_gate = (inv_of[lv],) if inv else ()
            steps = tuple(steps)
            tid_of[(i, j)] = len(tasks)
            # Step by step: each update waits only for the X tile it reads, so a task starts (loads B_ij
            # and its A tiles, applies the solved updates) while the rest of its column is being solved.
            gates = tuple((d,) for d in deps) + (diag_gate, ())
            deps.extend(diag_gate)
            tasks.append(Task(len(tasks), c, True, steps, task_flops(steps, is_complex), deps=tuple(deps),
                              keep_c=depth < last, c_init=tile_ref(TRSM_B, i, j, m, n, tile), gates=gates,
                              line=(o, len(others))))
    return tasks
