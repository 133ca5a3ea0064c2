"""GEMM's planner: one task per C tile, one k-step per tile of the inner dimension (Eq. 1a); with
``split``, split-k: several partial tasks per C tile over fixed k ranges, then one reduction task."""

from __future__ import annotations

from ..tasks import SC_ALPHA, SC_BETA, SC_ONE, SC_ZERO, Step, Task
from ..tiling import OP_N, TileRef, n_tiles, op_tile, tile_ref
from .common import _scale, _width

# Operand slots of the GEMM planner; SLOT_P is split-k's scratch of partial sums (``partial_ref``).
# With ``c_init`` C's first contents come from SLOT_C0 (the caller's c, the result being a new array)
# and the scratch moves one slot on.
SLOT_A, SLOT_B, SLOT_C, SLOT_P = 0, 1, 2, 3
SLOT_C0 = 3


def gemm_flops(m: int, n: int, k: int, is_complex: bool) -> float:
    """Floating-point operations of an m x n x k product (a complex FMA is 8 real flops)."""
    return (8.0 if is_complex else 2.0) * m * n * k


def plan_gemm(m: int, n: int, k: int, tile: int, op_a: int, op_b: int, *, alpha_zero: bool = False,
              beta_zero: bool = True, is_complex: bool = False, block: tuple[int, int] = (1, 1),
              split: int = 1, c_init: bool = False) -> list[Task]:
    """Tasks of ``C = alpha op_a(A) op_b(B) + beta C`` in canonical (column-major) form.

    ``C`` is ``m x n``; ``A`` is stored ``m x k`` when ``op_a`` is N, else ``k x m``; likewise ``B``.
    With ``alpha == 0`` or ``k == 0`` only ``C = beta C`` remains (A and B not read); with ``beta == 0``
    C is never read (NaNs in C do not leak in). Tasks follow ``tile_order``: ``block = (bm, bn)`` lists
    C tiles in blocks of bm x bn, so a device pulling a block shares A row and B column panels.

    ``split = S > 1`` (at most the k tiles; ignored with ``alpha == 0`` or ``k == 0``): per C tile, S
    partial tasks ``P_s = alpha op_a(A) op_b(B)`` over the s-th of S contiguous k-tile ranges (not
    rotatable) into the scratch SLOT_P (``partial_shape``, ``keep_c``), then a reduction task gated on them:
    ``C = P_0 + beta C``, then ``C += P_s`` in that order (identical results run to run). A tile's tasks
    are listed together, so the queue's fair share gives every device partials, not one the reductions.

    ``c_init`` (with beta != 0): each C tile starts from the same tile of operand SLOT_C0 instead of
    C's own (``Task.c_init``), so a new result need not hold C's values before the call.
    """
    a_rows, a_cols = (m, k) if op_a == OP_N else (k, m)
    b_rows, b_cols = (k, n) if op_b == OP_N else (n, k)
    tm, tn, tk = n_tiles(m, tile), n_tiles(n, tile), n_tiles(k, tile)
    product = not alpha_zero and k > 0
    if not isinstance(split, int) or split < 1 or (product and split > tk):
        raise ValueError(f"split: got {split!r}, need an int from 1 to {max(1, tk)} (the k tiles)")
    first = SC_ZERO if beta_zero else SC_BETA
    order = tile_order(tm, tn, block)
    p_slot = SLOT_P + 1 if c_init else SLOT_P

    def init(i: int, j: int) -> TileRef | None:
        return tile_ref(SLOT_C0, i, j, m, n, tile) if c_init and not beta_zero else None

    def k_steps(i: int, j: int, c: TileRef, k0: int, k1: int, beta0: int) -> tuple[Step, ...]:
        return tuple(Step("gemm", op_tile(SLOT_A, op_a, i, kk, a_rows, a_cols, tile),
                          op_tile(SLOT_B, op_b, kk, j, b_rows, b_cols, tile), op_a, op_b, c.rows, c.cols,
                          _width(kk, k, tile), SC_ALPHA, beta0 if kk == k0 else SC_ONE) for kk in range(k0, k1))

    tasks: list[Task] = []
    if split > 1 and product:
        bounds = [s * tk // split for s in range(split + 1)]
        for i, j in order:
            pids = tuple(range(len(tasks), len(tasks) + split))
            for s in range(split):
                k0, k1 = bounds[s], bounds[s + 1]
                p = partial_ref(s, i, j, m, n, tile, p_slot)
                tasks.append(Task(len(tasks), p, False, k_steps(i, j, p, k0, k1, SC_ZERO),
                                  gemm_flops(p.rows, p.cols, min(k, k1 * tile) - k0 * tile, is_complex), keep_c=True))
            c = tile_ref(SLOT_C, i, j, m, n, tile)
            steps = tuple(Step("add", partial_ref(s, i, j, m, n, tile, p_slot), None, OP_N, OP_N, c.rows, c.cols,
                               0, SC_ONE, first if s == 0 else SC_ONE) for s in range(split))
            tasks.append(Task(len(tasks), c, not beta_zero, steps, 0.0, deps=pids,
                              gates=tuple((p,) for p in pids) + ((),), c_init=init(i, j)))
        return tasks
    for i, j in order:
        c = tile_ref(SLOT_C, i, j, m, n, tile)
        if not product:
            steps, flops = (_scale(c, first),), 0.0
        else:
            steps = k_steps(i, j, c, 0, tk, first)
            flops = gemm_flops(c.rows, c.cols, k, is_complex)
        tasks.append(Task(len(tasks), c, not beta_zero, steps, flops, rotatable=len(steps) > 1, c_init=init(i, j)))
    return tasks


def partial_shape(m: int, n: int, split: int) -> tuple[int, int]:
    """Shape of split-k's scratch (column-major): the ``split`` partial m x n products side by side."""
    return m, split * n


def partial_ref(s: int, i: int, j: int, m: int, n: int, tile: int, slot: int = SLOT_P) -> TileRef:
    """The scratch tile holding partial ``s`` of C tile (i, j): C's tile, ``s`` column blocks of n over."""
    c = tile_ref(slot, i, j, m, n, tile)
    return c._replace(bj=s * n_tiles(n, tile) + j, c0=s * n + c.c0)


def tile_order(tm: int, tn: int, block: tuple[int, int] = (1, 1)) -> list[tuple[int, int]]:
    """C tiles (i, j) of a tm x tn grid, in blocks of block[0] x block[1] tiles."""
    bm, bn = max(1, block[0]), max(1, block[1])
    return [(i, j)
            for i0 in range(0, tm, bm) for j0 in range(0, tn, bn)
            for i in range(i0, min(i0 + bm, tm)) for j in range(j0, min(j0 + bn, tn))]
