"""Convolution planners (pure): the GEMMs of blasx.dnn's lowering, tile by tile.

Per group g, with col_g the derived ``CRS x N*P`` im2col matrix (slot ``col0 + g``) and W_g the
``CRS x Kg`` weight matrix (slot ``w0 + g``, column-major; W^T in the usual notation):

* forward, channels-last output (Y_g: ``Kg x N*P``, slot ``y0 + g``): ``Y_g = W_g^T col_g``, uniform tiles;
* forward, NCHW output (Y: ``P x N*K`` with ld P, one slot ``y0``): per image n ``Y_n,g = col_g[:, n]^T W_g``:
  C tiles are a pixel range of one image by a channel range of one group, and col's column tiles never
  cross images (its tile (bj = n * tiles(P) + i) starts at n*P + i*T); a 1x1 stride-1 unpadded convolution
  reads X's own ``P x Cg`` block of each image and group instead (``direct``);
* backward-weights (dW_g: ``CRS x Kg``, slot ``dw0 + g``): ``dW_g = col_g dY_g^T``, one k-step per pixel
  tile: dY_g is ``Kg x N*P`` (slot ``dy0 + g``, op T) for channels-last, else one ``P x Kg`` view per
  image and group (slot ``dy0 + n * groups + g``). With ``split = S > 1`` (split-k, as ``plan_gemm``'s):
  per dW tile, S partial tasks over fixed, contiguous ranges of its k-steps into the scratch operand
  ``p0`` (``CRS x S*G*Kg``: partial s of group g at columns ``(s*G + g)*Kg``), kept cached, then one task
  adding them in the order 0..S-1.

With ``res0`` each C tile starts from the same tile of a residual operand (``c_init``, beta 1).
Non-uniform tile grids are only used for C and derived operands, whose tile keys never outlive a call
or carry the grid in their token; every input array is tiled uniformly.
"""

from __future__ import annotations

from typing import NamedTuple

from ..tasks import SC_ALPHA, SC_ONE, SC_ZERO, Step, Task
from ..tiling import OP_N, OP_T, TileRef, n_tiles
from .gemm import gemm_flops


class Span(NamedTuple):
    """A tile's range along one dimension and its tile index there."""

    index: int
    start: int
    size: int


def spans(extent: int, tile: int, offset: int = 0, index0: int = 0) -> list[Span]:
    """The tiles of ``extent`` elements from ``offset``, indexed from ``index0``."""
    return [Span(index0 + i, offset + i * tile, min(tile, extent - i * tile)) for i in range(n_tiles(extent, tile))]


def _ref(slot: int, row: Span, col: Span) -> TileRef:
    return TileRef(slot, row.index, col.index, row.start, col.start, row.size, col.size)


def gemm_tasks(tasks: list, c_slot: int, c_rows, c_cols, a_rows, b_cols, ksteps, op_a: int, op_b: int,
               res_slot: int | None = None) -> None:
    """Append the tasks of ``C = op_a(A) op_b(B) (+ R)`` over the given tile grids: C tile (c_rows[i],
    c_cols[j]) reads A's op-row span a_rows[i] and B's op-column span b_cols[j]; ``ksteps`` lists
    (A slot, A's k span, B slot, B's k span) per step."""
    first = SC_ZERO if res_slot is None else SC_ONE
    for cr, ar in zip(c_rows, a_rows):
        for cc, bc in zip(c_cols, b_cols):
            c = _ref(c_slot, cr, cc)
            steps = tuple(
                Step("gemm", _ref(sa, ar, ak) if op_a == OP_N else _ref(sa, ak, ar),
                     _ref(sb, bk, bc) if op_b == OP_N else _ref(sb, bc, bk), op_a, op_b, c.rows, c.cols, ak.size,
                     SC_ALPHA, first if kk == 0 else SC_ONE)
                for kk, (sa, ak, sb, bk) in enumerate(ksteps))
            k = sum(s.k for s in steps)
            init = None if res_slot is None else c._replace(slot=res_slot)
            tasks.append(Task(len(tasks), c, res_slot is not None, steps, gemm_flops(c.rows, c.cols, k, False),
                              rotatable=len(steps) > 1, c_init=init))


def plan_conv_forward(n: int, p: int, kg: int, crs: int, groups: int, tile: int, channels_last: bool, *,
                      w0: int, col0: int, y0: int, res0: int | None = None, direct: bool = False) -> list[Task]:
    """Tasks of a convolution's forward GEMMs (the module docstring). ``direct`` (NCHW, 1x1 stride 1
    unpadded): col_g's image n is X's own ``P x Cg`` block, slot ``col0 + n * groups + g`` (op N)."""
    tasks: list[Task] = []
    ks = spans(crs, tile)
    for g in range(groups):
        if channels_last:
            res = None if res0 is None else res0 + g
            kst = [(w0 + g, k, col0 + g, k) for k in ks]
            gemm_tasks(tasks, y0 + g, spans(kg, tile), spans(n * p, tile), spans(kg, tile), spans(n * p, tile),
                       kst, OP_T, OP_N, res)
            continue
        tp, tk = n_tiles(p, tile), n_tiles(kg, tile)
        for img in range(n):
            cols = spans(kg, tile, offset=(img * groups + g) * kg, index0=(img * groups + g) * tk)
            if direct:
                kst = [(col0 + img * groups + g, k, w0 + g, k) for k in ks]
                gemm_tasks(tasks, y0, spans(p, tile), cols, spans(p, tile), spans(kg, tile), kst, OP_N, OP_N, res0)
                continue
            kst = [(col0 + g, k, w0 + g, k) for k in ks]
            gemm_tasks(tasks, y0, spans(p, tile), cols, spans(p, tile, img * p, img * tp), spans(kg, tile),
                       kst, OP_T, OP_N, res0)
    return tasks


def plan_conv_weight(n: int, p: int, kg: int, crs: int, groups: int, tile: int, channels_last: bool, *,
                     col0: int, dy0: int, dw0: int, split: int = 1, p0: int | None = None) -> list[Task]:
    """Tasks of backward-weights, ``dW_g = col_g dY_g^T`` (long-k: one step per pixel tile; split-k with
    ``split`` > 1 and the scratch slot ``p0``, as the module docstring says)."""
    tasks: list[Task] = []
    tp = n_tiles(p, tile)
    for g in range(groups):
        if channels_last:
            kst = [(col0 + g, k, dy0 + g, k) for k in spans(n * p, tile)]
            op_b = OP_T
        else:
            kst = [(col0 + g, Span(img * tp + s.index, img * p + s.start, s.size), dy0 + img * groups + g, s)
                   for img in range(n) for s in spans(p, tile)]
            op_b = OP_N
        if split > 1:
            _split_tasks(tasks, dw0 + g, spans(crs, tile), spans(kg, tile), kst, op_b, split, p0,
                         [(s * groups + g) * kg for s in range(split)], n_tiles(kg, tile), g, groups)
            continue
        gemm_tasks(tasks, dw0 + g, spans(crs, tile), spans(kg, tile), spans(crs, tile), spans(kg, tile),
                   kst, OP_N, op_b)
    return tasks


def _split_tasks(tasks: list, c_slot: int, c_rows, c_cols, ksteps, op_b: int, split: int, p_slot: int,
                 p_cols: list, tn: int, g: int, groups: int) -> None:
    """Split-k tasks of ``C = A op_b(B)``: per C tile, ``split`` partial tasks over contiguous ranges of
    ``ksteps`` into the scratch ``p_slot`` (partial s at column ``p_cols[s]`` plus the tile's), then one
    task adding them in order."""
    if not 1 < split <= len(ksteps):
        raise ValueError(f"split: got {split!r}, need an int from 2 to {len(ksteps)} (the k steps)")
    bounds = [s * len(ksteps) // split for s in range(split + 1)]
    for cr in c_rows:
        for cc in c_cols:
            c = _ref(c_slot, cr, cc)
            pids, parts = [], []
            for s in range(split):
                part = TileRef(p_slot, cr.index, (s * groups + g) * tn + cc.index, cr.start, p_cols[s] + cc.start,
                               cr.size, cc.size)
                steps = tuple(
                    Step("gemm", _ref(sa, cr, ak), _ref(sb, bk, cc) if op_b == OP_N else _ref(sb, cc, bk),
                         OP_N, op_b, c.rows, c.cols, ak.size, SC_ALPHA, SC_ZERO if kk == 0 else SC_ONE)
                    for kk, (sa, ak, sb, bk) in enumerate(ksteps[bounds[s]:bounds[s + 1]]))
                pids.append(len(tasks))
                parts.append(part)
                tasks.append(Task(len(tasks), part, False, steps,
                                  gemm_flops(c.rows, c.cols, sum(st.k for st in steps), False), keep_c=True))
            adds = tuple(Step("add", part, None, OP_N, OP_N, c.rows, c.cols, 0, SC_ONE, SC_ZERO if s == 0 else SC_ONE)
                         for s, part in enumerate(parts))
            tasks.append(Task(len(tasks), c, False, adds, 0.0, deps=tuple(pids),
                              gates=tuple((t,) for t in pids) + ((),)))
