"""blasx.dnn's pure parts: the convolution planners by exact value, a numpy plan evaluator (tasks run
with the derived tiles' host values) against torch, the im2col gather, and the CUDA fill's slab copies and
gather index arithmetic emulated in numpy (the kernel's body, line by line)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from blasx.dnn.geometry import conv_geometry
from blasx.dnn.im2col import Im2col
from blasx.operands import TokenTable, make_operand
from blasx.runtime.derived import host_tile
from blasx.runtime.plans import plan_conv_forward, plan_conv_weight
from blasx.runtime.tasks import SC_ONE, SC_ZERO
from blasx.runtime.tiling import OP_N, OP_T, TileRef


def _cl(x):
    return np.ascontiguousarray(np.moveaxis(x, 1, -1)).transpose(0, x.ndim - 1, *range(1, x.ndim - 1))


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


# ---------------------------------------------------------------- exact plans

def test_forward_nchw_plan_exact():
    """One image, 3 pixels, 2 output channels, CRS 4, tile 2: C tiles per image, col tiles per image."""
    tasks = plan_conv_forward(2, 3, 2, 4, 1, 2, False, w0=0, col0=1, y0=2)
    assert len(tasks) == 4  # 2 images x 2 pixel tiles x 1 channel tile
    t = tasks[2]  # image 1, pixels 0-1
    assert t.c == TileRef(2, 0, 1, 0, 2, 2, 2)
    assert [s.a for s in t.steps] == [TileRef(1, 0, 2, 0, 3, 2, 2), TileRef(1, 1, 2, 2, 3, 2, 2)]
    assert [s.b for s in t.steps] == [TileRef(0, 0, 0, 0, 0, 2, 2), TileRef(0, 1, 0, 2, 0, 2, 2)]
    assert [(s.op_a, s.op_b, s.m, s.n, s.k, s.beta) for s in t.steps] == [(OP_T, OP_N, 2, 2, 2, SC_ZERO),
                                                                         (OP_T, OP_N, 2, 2, 2, SC_ONE)]
    assert tasks[3].c == TileRef(2, 1, 1, 2, 2, 1, 2)
    assert tasks[3].steps[0].a == TileRef(1, 0, 3, 0, 5, 2, 1)
    assert not t.load_c and t.c_init is None and t.rotatable and t.flops == 2.0 * 2 * 2 * 4


def test_forward_direct_nchw_plan_exact():
    """1x1 NCHW: image n, group g reads X's own P x Cg block (slot col0 + n*groups + g, op N)."""
    tasks = plan_conv_forward(2, 3, 1, 2, 2, 2, False, w0=0, col0=2, y0=6, direct=True)
    assert len(tasks) == 8  # 2 groups x 2 images x 2 pixel tiles
    t = tasks[6]  # group 1, image 1, pixels 0-1
    assert t.c == TileRef(6, 0, 3, 0, 3, 2, 1)
    (s,) = t.steps
    assert (s.a, s.b, s.op_a, s.op_b) == (TileRef(5, 0, 0, 0, 0, 2, 2), TileRef(1, 0, 0, 0, 0, 2, 1), OP_N, OP_N)


def test_forward_channels_last_plan_with_residual_exact():
    tasks = plan_conv_forward(2, 3, 3, 2, 2, 4, True, w0=0, col0=2, y0=4, res0=6)
    assert len(tasks) == 4  # 2 groups x (1 channel tile x 2 pixel tiles of 6)
    t = tasks[3]  # group 1, pixels 4-5
    assert t.c == TileRef(5, 0, 1, 0, 4, 3, 2)
    assert t.load_c and t.c_init == TileRef(7, 0, 1, 0, 4, 3, 2)
    (s,) = t.steps
    assert (s.a, s.b, s.op_a, s.op_b, s.beta) == (TileRef(1, 0, 0, 0, 0, 2, 3), TileRef(3, 0, 1, 0, 4, 2, 2),
                                                  OP_T, OP_N, SC_ONE)


def test_weight_plan_exact():
    nchw = plan_conv_weight(2, 3, 2, 2, 1, 2, False, col0=0, dy0=1, dw0=3)
    (t,) = nchw
    assert t.c == TileRef(3, 0, 0, 0, 0, 2, 2)
    assert [(s.a, s.b) for s in t.steps] == [
        (TileRef(0, 0, 0, 0, 0, 2, 2), TileRef(1, 0, 0, 0, 0, 2, 2)),
        (TileRef(0, 0, 1, 0, 2, 2, 1), TileRef(1, 1, 0, 2, 0, 1, 2)),
        (TileRef(0, 0, 2, 0, 3, 2, 2), TileRef(2, 0, 0, 0, 0, 2, 2)),
        (TileRef(0, 0, 3, 0, 5, 2, 1), TileRef(2, 1, 0, 2, 0, 1, 2))]
    (c,) = plan_conv_weight(2, 3, 2, 2, 1, 4, True, col0=0, dy0=1, dw0=2)
    assert [(s.a, s.b, s.op_b) for s in c.steps] == [
        (TileRef(0, 0, 0, 0, 0, 2, 4), TileRef(1, 0, 0, 0, 0, 2, 4), OP_T),
        (TileRef(0, 0, 1, 0, 4, 2, 2), TileRef(1, 0, 1, 0, 4, 2, 2), OP_T)]


# ---------------------------------------------------------------- a numpy plan evaluator

def evaluate(tasks, views, tile):
    """Run ``tasks`` in numpy on the operands of ``views`` (derived tiles by their host values)."""
    tokens = TokenTable(tile)
    ops = [make_operand(v, tokens) for v in views]

    class _Call:
        operands = ops
    for t in tasks:
        c = ops[t.c.slot].array[t.c.r0:t.c.r0 + t.c.rows, t.c.c0:t.c.c0 + t.c.cols]
        acc = np.array(host_tile(_Call, ops[t.c_init.slot], t.c_init)) if t.load_c else np.zeros(c.shape)
        for s in t.steps:
            a, b = (host_tile(_Call, ops[r.slot], r) for r in (s.a, s.b))
            acc = (a.T if s.op_a else a) @ (b.T if s.op_b else b) + (acc if s.beta == SC_ONE else 0)
        c[...] = acc


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 2), st.sampled_from([1, 2]), st.integers(1, 3), st.integers(1, 2),
       st.integers(0, 2), st.integers(1, 2), st.booleans(), st.sampled_from([2, 3, 5]))
def test_forward_plan_evaluated_vs_torch(n, cg, groups, kg, stride, pad, dil, cl, tile):
    rng = np.random.default_rng(n * 100 + cg * 10 + kg)
    x = rng.standard_normal((n, cg * groups, 6, 5))
    w = rng.standard_normal((kg * groups, cg, 2, 3))
    geo = conv_geometry("conv2d", 2, x, w, stride, pad, dil, groups)
    ref = F.conv2d(torch.from_numpy(x), torch.from_numpy(w), None, stride, pad, dil, groups).numpy()
    xx = _cl(x) if cl else x
    xs = (xx.transpose(0, 2, 3, 1).reshape(-1, x.shape[1]).T if cl else xx.reshape(-1, 30).T)
    wm = (np.ascontiguousarray(w.transpose(0, 2, 3, 1)) if cl else w).reshape(geo.k, -1).T
    G = groups
    y = np.zeros((n, *geo.out_size, geo.k)) if cl else np.zeros((n, geo.k, *geo.out_size))
    ys = ([y.reshape(-1, geo.k).T[g * kg:(g + 1) * kg] for g in range(G)] if cl else [y.reshape(n * geo.k, -1).T])
    x_slot = 2 * G + len(ys)
    views = [*(wm[:, g * kg:(g + 1) * kg] for g in range(G)), *(Im2col(geo, g, cl, not cl, xs, x_slot)
                                                                for g in range(G)), *ys, xs]
    evaluate(plan_conv_forward(n, geo.p, kg, geo.crs, G, tile, cl, w0=0, col0=G, y0=2 * G), views, tile)
    got = np.moveaxis(y, -1, 1) if cl else y
    assert _rel(got, ref) < 1e-13


# ---------------------------------------------------------------- im2col host values and the CUDA fill emulated

def _emulated_fill(col, xs, ref, in_place):
    """The CUDA fill of ``ref`` in numpy: the slab copies, then the gather kernel's body on every element."""
    copies, total, args = col.fill_plan(ref, in_place)
    if copies is None:
        return np.zeros((ref.rows, ref.cols))
    flat = xs.reshape(-1, order="F")
    if in_place:
        slab = flat
    else:
        slab = np.full(total, np.nan)
        for d, src, width, height, dpitch, spitch in copies:
            for h in range(height):
                slab[d + h * dpitch:d + h * dpitch + width] = flat[src + h * spitch:src + h * spitch + width]
    (r0, c0, rows, P, KS, Cg, cl, goff, K1, K2, O1, O2, st0, st1, st2, dl0, dl1, dl2, pl0, pl1, pl2, z0, z1, z2,
     I0, I1, I2, sn, sc, s0, s1, s2, bn, bc, bi) = args
    i = np.arange(ref.rows * ref.cols)
    row, colm = i % rows, i // rows
    gr, gc = r0 + row, c0 + colm
    if cl:
        k, c = gr // Cg, gr % Cg
    else:
        c, k = gr // KS, gr % KS
    k2, k1, k0 = k % K2, (k // K2) % K1, k // (K1 * K2)
    n, p = gc // P, gc % P
    o2, o1, o0 = p % O2, (p // O2) % O1, p // (O1 * O2)
    u0, u1, u2 = o0 * st0 - pl0 + k0 * dl0, o1 * st1 - pl1 + k1 * dl1, o2 * st2 - pl2 + k2 * dl2
    ok = (u0 >= 0) & (u1 >= 0) & (u2 >= 0)
    ok &= (np.fmod(u0, z0) == 0) & (np.fmod(u1, z1) == 0) & (np.fmod(u2, z2) == 0)
    u0, u1, u2 = np.trunc(u0 / z0).astype(int), np.trunc(u1 / z1).astype(int), np.trunc(u2 / z2).astype(int)
    ok &= (u0 < I0) & (u1 < I1) & (u2 < I2)
    idx = (n - bn) * sn + (c + goff - bc) * sc + (u0 - bi) * s0 + u1 * s1 + u2 * s2
    y = np.where(ok, slab[np.where(ok, idx, 0)], 0.0)
    tile = np.empty((ref.rows, ref.cols))
    tile[row, colm] = y
    assert not np.isnan(tile).any(), "the gather read outside the staged slab"
    return tile


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([1, 2, 3]), st.booleans(), st.integers(1, 3), st.integers(0, 2), st.integers(1, 2),
       st.sampled_from([1, 2]), st.booleans(), st.integers(0, 1000))
def test_im2col_tiles_and_emulated_fill(nd, cl, stride, pad, dil, groups, transposed, seed):
    from blasx.dnn.conv import _x_view
    from blasx.dnn.conv_transpose import _flipped_transposed
    from blasx.dnn.geometry import transpose_geometry
    rng = np.random.default_rng(seed)
    size = (7, 5, 4)[:nd]
    x = rng.standard_normal((2, 2 * groups, *size))
    if transposed:
        w = rng.standard_normal((2 * groups, 3, *(2,) * nd))
        geo = transpose_geometry("t", nd, x, w, stride, pad, 0, groups, dil)
        wf = _flipped_transposed(np, w, groups)
        tconv = getattr(F, f"conv_transpose{nd}d")
        ref = tconv(torch.from_numpy(x), torch.from_numpy(w), None, stride, pad, 0, groups, dil).numpy()
    else:
        wf = w = rng.standard_normal((3 * groups, 2, *(2,) * nd))
        geo = conv_geometry("c", nd, x, w, stride, pad, dil, groups)
        ref = getattr(F, f"conv{nd}d")(torch.from_numpy(x), torch.from_numpy(w), None, stride, pad, dil,
                                       groups).numpy()
    xx = _cl(x) if cl else x
    xs = _x_view(xx, "cl" if cl else "nchw")
    tokens = TokenTable(4)
    src = make_operand(xs, tokens)
    y = np.empty((2, geo.k, geo.p))
    for g in range(groups):
        col = Im2col(geo, g, cl, False, xs, 1)
        full = col.host_tile(src, TileRef(0, 0, 0, 0, 0, col.rows, col.cols))
        wm = (np.ascontiguousarray(np.moveaxis(wf, 1, -1)) if cl else wf).reshape(geo.k, -1)
        wm = wm[g * geo.kg:(g + 1) * geo.kg]
        y[:, g * geo.kg:(g + 1) * geo.kg] = (wm @ full).reshape(geo.kg, 2, geo.p).transpose(1, 0, 2)
        for r0, c0, rows, cols in ((0, 0, col.rows, col.cols), (1, 2, 3, 5), (col.rows - 2, col.cols - 4, 2, 4),
                                   (0, geo.p - 1, col.rows, 2)):
            rows, cols = min(rows, col.rows - r0), min(cols, col.cols - c0)
            if rows <= 0 or cols <= 0 or r0 < 0 or c0 < 0:
                continue
            ref_t = TileRef(0, 0, 0, r0, c0, rows, cols)
            want = full[r0:r0 + rows, c0:c0 + cols]
            assert np.array_equal(col.host_tile(src, ref_t), want)
            for in_place in (False, True):
                assert np.array_equal(_emulated_fill(col, xs, ref_t, in_place), want)
            assert col.nbytes_read(ref_t) <= x.nbytes
    assert _rel(y.reshape(ref.shape), ref) < 1e-13
