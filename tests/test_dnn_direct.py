"""blasx.dnn's device route (conv_direct.py) on the CPU: its plans run by a numpy stand-in of the CUDA
steps (the gather kernel's body line by line, cuBLAS's strided-batched GEMM on flat buffers with every
operand's extent checked), against torch in float64; and the front end's wiring of the route (weight
layout, folded scale, epilogue, dW's layout) with the route's CUDA parts replaced by that stand-in."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from blasx import dnn
from blasx.dnn import conv as conv_mod
from blasx.dnn import conv_direct as cd
from blasx.dnn.geometry import conv_geometry, transpose_geometry


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def _memory(a, cl):
    """An (N, C, ...) array's memory in the layout: NCHW, or N(spatial)C for channels-last."""
    return np.ascontiguousarray(np.moveaxis(a, 1, -1) if cl else a).ravel()


def _from_memory(flat, shape, cl):
    if not cl:
        return flat.reshape(shape)
    return np.moveaxis(flat.reshape(shape[0], *shape[2:], shape[1]), -1, 1)


def _wrows(w, cl):
    """The (K, CRS) weight matrix: reduction order (c, r, s), or (r, s, c) for channels-last."""
    return np.ascontiguousarray(np.moveaxis(w, 1, -1) if cl else w).reshape(w.shape[0], -1)


class NumpyOps:
    """The CUDA steps in numpy on flat float64 buffers."""

    def __init__(self, geo, cl, bufs):
        self.geo, self.cl, self.bufs = geo, cl, bufs

    def _mat(self, ref, rows, cols, ld, b, stride):
        buf = self.bufs[ref[0]]
        off = ref[1] + b * stride
        assert ld >= max(1, rows), "cuBLAS needs ld >= the stored rows"
        assert off >= 0 and off + (cols - 1) * ld + rows <= buf.size, f"{ref[0]} read/written out of bounds"
        return np.lib.stride_tricks.as_strided(buf[off:], (rows, cols), (8, ld * 8), writeable=True)

    def gemm(self, s):
        for b in range(s.batch):
            a = self._mat(s.a, *((s.m, s.k) if s.op_a == cd.OP_N else (s.k, s.m)), s.lda, b, s.stride_a)
            bb = self._mat(s.b, *((s.k, s.n) if s.op_b == cd.OP_N else (s.n, s.k)), s.ldb, b, s.stride_b)
            c = self._mat(s.c, s.m, s.n, s.ldc, b, s.stride_c)
            prod = (a if s.op_a == cd.OP_N else a.T) @ (bb if s.op_b == cd.OP_N else bb.T)
            assert not np.isnan(prod).any(), "a GEMM read scratch the gather did not write"
            c[...] = prod + (s.beta * c if s.beta else 0.0)

    def gather(self, s):
        """The kernel's body (conv_direct._KERNEL_BODY) on every i < nb * CRS * P."""
        g = self.geo
        (P, CRS, KS, Cg, cl, pf, goff, K1, K2, O1, O2, st0, st1, st2, dl0, dl1, dl2, pl0, pl1, pl2, z0, z1, z2,
         I0, I1, I2, sn, sc, s0, s1, s2, n0, on, orr, op) = cd.gather_args(g, self.cl, s)
        i = np.arange(s.nb * g.crs * g.p)
        if pf:
            p, t = i % P, i // P
            r, j = t % CRS, t // CRS
        else:
            r, t = i % CRS, i // CRS
            p, j = t % P, t // P
        if cl:
            k, c = r // Cg, r % Cg
        else:
            c, k = r // KS, r % KS
        k2, k1, k0 = k % K2, (k // K2) % K1, k // (K1 * K2)
        o2, o1, o0 = p % O2, (p // O2) % O1, p // (O1 * O2)
        u0, u1, u2 = o0 * st0 - pl0 + k0 * dl0, o1 * st1 - pl1 + k1 * dl1, o2 * st2 - pl2 + k2 * dl2
        ok = (u0 >= 0) & (u1 >= 0) & (u2 >= 0)
        ok &= (np.fmod(u0, z0) == 0) & (np.fmod(u1, z1) == 0) & (np.fmod(u2, z2) == 0)
        u0, u1, u2 = np.trunc(u0 / z0).astype(int), np.trunc(u1 / z1).astype(int), np.trunc(u2 / z2).astype(int)
        ok &= (u0 < I0) & (u1 < I1) & (u2 < I2)
        x, col = self.bufs["x"], self.bufs["col"]
        src = (n0 + j) * sn + (goff + c) * sc + u0 * s0 + u1 * s1 + u2 * s2
        dst = j * on + r * orr + p * op
        assert dst.max() < col.size and len(np.unique(dst)) == dst.size, "the gather's writes collide or overflow"
        assert src[ok].min(initial=0) >= 0 and src[ok].max(initial=0) < x.size
        col[dst] = np.where(ok, x[np.where(ok, src, 0)], 0.0)

    def copy_dy(self, s):
        g = self.geo
        dy = self.bufs["dy"].reshape(g.n, g.k, g.p)
        self.bufs["dyc"][:g.k * s.nb * g.p] = dy[s.n0:s.n0 + s.nb].transpose(1, 0, 2).ravel()


def emulated_forward(geo, xmem, cl, wrows, ymem, residual, budget):
    """conv_direct.forward's steps on numpy buffers (y's memory written in place)."""
    per = cd.forward_scratch(geo)
    parts = cd.chunks(geo.n, per * 8, budget)
    bufs = {"x": xmem, "w": wrows.ravel(), "y": ymem, "col": np.full(max(nb for _, nb in parts) * per, np.nan)}
    if residual is not None:
        ymem[...] = residual
    cd.run(cd.forward_steps(geo, cl, parts, 0.0 if residual is None else 1.0), NumpyOps(geo, cl, bufs))
    return parts


def emulated_weight(geo, xmem, dymem, cl, budget):
    per = cd.weight_scratch(geo, cl)
    parts = cd.chunks(geo.n, per * 8, budget)
    nb = max(nb for _, nb in parts)
    bufs = {"x": xmem, "dy": dymem, "dw": np.full(geo.k * geo.crs, np.nan),
            "col": np.full(nb * geo.crs * geo.p, np.nan), "dyc": np.full(nb * geo.k * geo.p, np.nan)}
    cd.run(cd.weight_steps(geo, cl, parts), NumpyOps(geo, cl, bufs))
    return bufs["dw"].reshape(geo.k, geo.crs), parts


def _case(rng, nd, groups, cg, kg, n):
    size = (11, 7, 5)[:nd] if nd < 3 else (5, 6, 4)
    x = rng.standard_normal((n, cg * groups, *size))
    return x, size


CASES = st.tuples(st.sampled_from([1, 2, 3]), st.booleans(), st.integers(1, 3), st.integers(0, 2),
                  st.integers(1, 2), st.sampled_from([1, 2]), st.sampled_from([1, 3]), st.integers(0, 1000))


@settings(max_examples=40, deadline=None)
@given(CASES, st.sampled_from([1 << 30, 1]))
def test_forward_and_weight_plans_vs_torch(case, budget):
    """Forward (and backward-weights) by the route's plans; budget 1: one image a chunk."""
    nd, cl, stride, pad, dil, groups, ks, seed = case
    rng = np.random.default_rng(seed)
    x, _ = _case(rng, nd, groups, 2, 3, 3)
    w = rng.standard_normal((3 * groups, 2, *(ks,) * nd))
    try:
        geo = conv_geometry("conv", nd, x, w, stride, pad, dil, groups)
    except ValueError:
        return  # kernel larger than the padded input
    ref = getattr(F, f"conv{nd}d")(torch.from_numpy(x), torch.from_numpy(w), None, stride, pad, dil, groups).numpy()
    ymem = np.full(ref.size, np.nan)
    parts = emulated_forward(geo, _memory(x, cl), cl, _wrows(w, cl), ymem, None, budget)
    assert len(parts) == (1 if budget > 1 or cd.pointwise(geo) else geo.n)
    assert _rel(_from_memory(ymem, ref.shape, cl), ref) < 1e-13
    dy = rng.standard_normal(ref.shape)
    dw, _ = emulated_weight(geo, _memory(x, cl), _memory(dy, cl), cl, budget)
    want = getattr(torch.nn.grad, f"conv{nd}d_weight")(torch.from_numpy(x), w.shape, torch.from_numpy(dy), stride,
                                                        pad, dil, groups).numpy()
    got = np.moveaxis(dw.reshape(w.shape[0], *w.shape[2:], w.shape[1]), -1, 1) if cl else dw.reshape(w.shape)
    assert _rel(got, want) < 1e-13


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([1, 2, 3]), st.booleans(), st.integers(1, 3), st.integers(0, 1), st.integers(1, 2),
       st.sampled_from([1, 2]), st.integers(0, 1000))
def test_transposed_plan_with_residual_vs_torch(nd, cl, stride, pad, dil, groups, seed):
    """conv_transpose (zero insertion in the gather) with a residual (beta 1 on y)."""
    rng = np.random.default_rng(seed)
    x, _ = _case(rng, nd, groups, 2, 2, 2)
    wt = rng.standard_normal((2 * groups, 3, *(3,) * nd))
    opad = 1 if stride > 1 else 0
    geo = transpose_geometry("t", nd, x, wt, stride, pad, opad, groups, dil)
    ref = getattr(F, f"conv_transpose{nd}d")(torch.from_numpy(x), torch.from_numpy(wt), None, stride, pad, opad,
                                             groups, dil).numpy()
    res = rng.standard_normal(ref.shape)
    wf = conv_mod._flipped_transposed(np, wt, groups)
    ymem = np.full(ref.size, np.nan)
    emulated_forward(geo, _memory(x, cl), cl, _wrows(wf, cl), ymem, _memory(res, cl), 1)
    assert _rel(_from_memory(ymem, ref.shape, cl), ref + res) < 1e-13


def test_chunks():
    assert cd.chunks(10, 100, 350) == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert cd.chunks(4, 100, 10) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert cd.chunks(4, 0, 10) == [(0, 4)]
    assert cd.chunks(4, 100, 1 << 40) == [(0, 4)]


def test_plan_shapes_exact():
    """NCHW: one strided-batched GEMM per chunk and group (W with stride 0, Y_n with stride K*P);
    channels-last: one GEMM over the chunk's pixels; pointwise: no gather, no scratch."""
    x = np.zeros((4, 6, 5, 5))
    geo = conv_geometry("conv", 2, x, np.zeros((8, 3, 3, 3)), 1, 1, 1, 2)
    steps = cd.forward_steps(geo, False, [(0, 3), (3, 1)], 0.0)
    assert [type(s).__name__ for s in steps] == ["Gather", "Gemm"] * 4
    g = steps[3]  # chunk 0, group 1
    assert g == cd.Gemm(("col", 0), ("w", 4 * 27), ("y", 4 * 25), 0, 0, 25, 4, 27, 25, 27, 25, 27 * 25, 0, 8 * 25,
                        3, 0.0)
    cl = cd.forward_steps(geo, True, [(0, 4)], 1.0)
    assert cl[1] == cd.Gemm(("w", 0), ("col", 0), ("y", 0), 1, 0, 4, 100, 27, 27, 27, 8, 0, 0, 0, 1, 1.0)
    pw = conv_geometry("conv", 2, x, np.zeros((8, 6, 1, 1)), 1, 0, 1, 1)
    assert cd.forward_scratch(pw) == 0
    assert cd.forward_steps(pw, False, [(0, 4)], 0.0) == [
        cd.Gemm(("x", 0), ("w", 0), ("y", 0), 0, 0, 25, 8, 6, 25, 6, 25, 150, 0, 200, 4, 0.0)]


# ---------------------------------------------------------------- the front end's wiring, CUDA parts emulated

@pytest.fixture
def emulated_route(monkeypatch):
    """conv.py takes the device route for numpy arrays, whose CUDA parts run as the numpy stand-in."""
    calls = []

    def forward(geo, x, cl, wrows, y, residual, affine, math):
        calls.append("forward")
        ymem = np.full(y.size, np.nan)
        res = None if residual is None else _memory(np.asarray(residual), cl)
        emulated_forward(geo, _memory(x, cl), cl, np.asarray(wrows, np.float64), ymem, res, 1)
        out = _from_memory(ymem, y.shape, cl)
        if affine is not None:
            shape = (1, -1) + (1,) * geo.nd
            if affine.scale is not None:
                out = out * affine.scale.reshape(shape)
            if affine.shift is not None:
                out = out + affine.shift.reshape(shape)
            if affine.activation is not None:
                out = affine.activation.host(out)
        y[...] = out

    def weight(geo, x, dy, cl, math):
        calls.append("weight")
        return emulated_weight(geo, _memory(x, cl), _memory(dy, cl), cl, 1)[0]
    monkeypatch.setattr(cd, "applies", lambda x, flops: True)
    monkeypatch.setattr(cd, "forward", forward)
    monkeypatch.setattr(cd, "weight", weight)
    return calls


def _cl(x):
    return np.ascontiguousarray(np.moveaxis(x, 1, -1)).transpose(0, x.ndim - 1, *range(1, x.ndim - 1))


@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_front_end_routes_forward_weight_and_input(emulated_route, layout):
    rng = np.random.default_rng(7)
    lay = _cl if layout == "cl" else (lambda a: a)
    x = rng.standard_normal((3, 4, 9, 8))
    w = rng.standard_normal((6, 2, 3, 3))
    b, sc, sh = rng.standard_normal(6), rng.uniform(0.5, 2, 6), rng.standard_normal(6)
    r = rng.standard_normal((3, 6, 5, 4))
    y = dnn.conv2d(lay(x), w, b, stride=2, padding=1, groups=2, scale=sc, shift=sh, residual=lay(r),
                   activation="relu")
    t = torch.from_numpy
    conv = F.conv2d(t(x), t(w), t(b), 2, 1, 1, 2)
    ref = F.relu(conv * t(sc)[:, None, None] + t(sh)[:, None, None] + t(r)).numpy()
    assert _rel(y, ref) < 1e-13 and (layout == "cl") == (not y.flags.c_contiguous)
    dy = rng.standard_normal((3, 6, 5, 4))
    gw = dnn.conv2d_weight(lay(x), w.shape, lay(dy), stride=2, padding=1, groups=2)
    assert _rel(gw, torch.nn.grad.conv2d_weight(t(x), w.shape, t(dy), 2, 1, 1, 2).numpy()) < 1e-13
    gi = dnn.conv2d_input(x.shape, w, lay(dy), stride=2, padding=1, groups=2)
    assert _rel(gi, torch.nn.grad.conv2d_input(x.shape, t(w), t(dy), 2, 1, 1, 2).numpy()) < 1e-13
    assert emulated_route == ["forward", "weight", "forward"]
