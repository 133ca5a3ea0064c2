"""The winograd form (winograd.py: F(2x2, 3x3) and F(4x4, 3x3), forward and weight gradient) on the CPU: its
plans by exact value, their steps run by test_dnn_direct's numpy stand-in (each transform in numpy from its
matrices and by the real kernel's body compiled for the host), against torch in float64; where it applies and
where the heuristics choose it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from blasx import dnn
from blasx.dnn import conv_direct as cd
from blasx.dnn import direct_cache, direct_cuda
from blasx.dnn import weight_forms as wf
from blasx.dnn import winograd as wg
from blasx.dnn.geometry import conv_geometry, transpose_geometry
from dnn_ref import from_memory, memory
from test_dnn_direct import _cl, _rel, _wrows, emulated_forward, emulated_route, emulated_weight  # noqa: F401


def _geo(n=2, c=4, k=3, size=(7, 6), kernel=3, stride=1, pad=1, dilation=1, groups=1):
    x, w = np.zeros((n, c, *size)), np.zeros((k, c // groups, *(kernel,) * len(size)))
    return conv_geometry("conv", len(size), x, w, stride, pad, dilation, groups)


def test_where_it_applies():
    g = _geo()
    assert wg.applies(g, np.float32, None) and wg.applies(g, np.float64, None)
    assert not wg.applies(g, np.float32, "tf32") and not wg.applies(g, np.float16, None)
    for other in (_geo(stride=2), _geo(kernel=5, pad=2), _geo(dilation=2, pad=2), _geo(groups=2, c=4, k=4),
                  _geo(size=(7,), pad=1), _geo(kernel=1, pad=0)):
        assert not wg.applies(other, np.float32, None)
    t = transpose_geometry("conv_transpose2d", 2, np.zeros((2, 4, 5, 5)), np.zeros((4, 3, 3, 3)), 1, 1, 0, 1, 1)
    assert wg.applies(t, np.float32, None)  # a stride-1 backward-data's gather
    assert "winograd" in cd.forms(g, np.float32) and "winograd" not in cd.forms(g, np.float32, math="tf32")


def test_where_the_heuristics_choose_it(monkeypatch):
    """Where it applies with C and K >= winograd.MIN_CHANNELS (float32: 16 forward, 64 weight gradient; float64: 16),
    else a force or the find-db only; never for the tensor-core types or TF32."""
    g = _geo(c=64, k=64, size=(14, 14))
    assert cd.forward_form(g, np.float32) == "winograd" and cd.forward_form(g, np.float64) == "winograd"
    with direct_cache.using(direct_cache.Workspace()):
        assert cd.forward_form(g, np.float32) == "winograd"
    assert cd.forward_form(g, np.float32, math="tf32") == "im2col" and cd.forward_form(g, np.float16) == "im2col"
    thin = _geo(c=8, k=64, size=(14, 14))
    assert cd.forward_form(thin, np.float32) == "im2col" and cd.forward_form(thin, np.float32, "winograd") == "winograd"
    assert cd.forward_form(_geo(c=16, k=16), np.float32) == "winograd"
    assert cd.forward_form(_geo(stride=2), np.float32, "winograd") == "im2col"  # where it applies only
    assert wf.weight_form(g, np.float32, None, "cl") == "winograd" and wf.weight_form(g, np.float64) == "winograd"
    assert wf.weight_form(_geo(c=32, k=64), np.float32, None, "cl") == "im2col"
    assert wf.weight_form(_geo(c=16, k=64), np.float64) == "winograd"  # float64: from 16 channels
    assert cd.forward_form(_geo(c=8, k=64), np.float64) == "im2col"
    assert wf.weight_form(g, np.float32, None, "cl", "tf32") == "im2col"
    monkeypatch.setattr(cd.finddb, "stored_form", lambda *a, **k: "winograd")
    assert cd.forward_form(thin, np.float32) == "winograd" and cd.forward_form(g, np.float16) == "im2col"


def test_plan_exact(monkeypatch):
    """The filter transform once, then per chunk: input transform, 16 GEMMs (M[xi] = U[xi] V[xi], column-major,
    xi-major), output transform; v and m sized for the largest chunk."""
    monkeypatch.setattr(cd, "WINOGRAD_TILE", 2)
    g = _geo(n=3, c=4, k=3, size=(7, 6))  # 4 x 3 tiles an image
    assert wg.tiles(g) == (4, 3) and wg.scratch_per_image(g) == 16 * 7 * 12
    steps, scratch = wg.plan(g, np.float64, 2 * 16 * 7 * 12 * 8)
    assert [type(s).__name__ for s in steps] == ["Wino"] + ["Wino", "Gemm", "Wino"] * 2
    assert steps[0] == wg.Wino("filter") and steps[1] == wg.Wino("input", 0, 2) and steps[3] == wg.Wino("output", 0, 2)
    assert steps[2] == cd.Gemm(("u", 0), ("v", 0), ("m", 0), 0, 0, 3, 24, 4, 3, 4, 3, 12, 96, 72, 16, 0.0)
    assert steps[5].n == 12 and steps[5].stride_b == 48 and steps[6] == wg.Wino("output", 2, 1)
    assert scratch == {"u": 16 * 12, "v": 16 * 4 * 24, "m": 16 * 3 * 24}
    assert wg.threads(g, steps[1]) == 4 * 24 and wg.threads(g, steps[3]) == 3 * 24 and wg.threads(g, steps[0]) == 12
    assert wg.kernel_args(g, True, steps[4]) == (4, 7, 6, 4, 3, 12, 1, 1, 2, 7 * 6 * 4, 1, 6 * 4, 4)
    assert wg.kernel_args(g, False, steps[3]) == (3, 7, 6, 4, 3, 24, 0, 3 * 42, 42, 6, 1)
    with pytest.raises(ValueError, match="beta must be 0"):
        wg.plan(g, np.float64, 1 << 30, 1.0)
    four, scratch = wg.plan(g, np.float64, 1 << 30, m=4)  # F(4x4): 2 x 2 tiles of 6 x 6, 36 GEMMs
    assert wg.tiles(g, 4) == (2, 2) and [s.m for s in four if isinstance(s, wg.Wino)] == [4, 4, 4]
    assert four[2] == cd.Gemm(("u", 0), ("v", 0), ("m", 0), 0, 0, 3, 12, 4, 3, 4, 3, 12, 48, 36, 36, 0.0)
    assert scratch == {"u": 36 * 12, "v": 36 * 4 * 12, "m": 36 * 3 * 12}
    with pytest.raises(ValueError, match=r"conv_direct.WINOGRAD_TILE \(m\): got 3; allowed: 2, 4"):
        wg.plan(g, np.float64, 1 << 30, m=3)
    monkeypatch.setattr(cd, "FORM", "winograd")  # forced: a sum into y (a residual that is y) takes im2col
    assert direct_cuda.forward_plan(g, True, np.float64, 0.0, 1 << 30).form == "winograd"
    assert direct_cuda.forward_plan(g, True, np.float64, 1.0, 1 << 30).form == "im2col"


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([2, 4]), st.booleans(), st.integers(1, 3), st.integers(1, 5), st.integers(1, 4),
       st.integers(3, 11), st.integers(3, 10), st.sampled_from([0, 1, 2, (0, 2), (2, 1)]),
       st.sampled_from([1 << 30, 1]), st.integers(0, 1000))
def test_plan_vs_torch(m, cl, n, c, k, h, w, pad, budget, seed):
    """F(2x2) and F(4x4); output sizes that are and are not multiples of m (a partial last tile), padding 0-2 and
    asymmetric (torch given the padded input), both layouts, one image a chunk (budget 1) or all."""
    tile, cd.WINOGRAD_TILE = cd.WINOGRAD_TILE, m
    try:
        _plan_vs_torch(cl, n, c, k, h, w, pad, budget, seed)
    finally:
        cd.WINOGRAD_TILE = tile


def _plan_vs_torch(cl, n, c, k, h, w, pad, budget, seed):
    rng = np.random.default_rng(seed)
    x, wt = rng.standard_normal((n, c, h, w)), rng.standard_normal((k, c, 3, 3))
    if isinstance(pad, tuple):  # rows padded (lo, hi) = pad, columns 1 both sides
        xt = np.pad(x, ((0, 0), (0, 0), pad, (1, 1)))
        geo = conv_geometry("conv", 2, xt, wt, 1, 0, 1, 1)
        geo = type(geo)(**{**geo.__dict__, "in_size": (h, w), "pad_lo": (pad[0], 1)})
        ref = F.conv2d(torch.from_numpy(xt), torch.from_numpy(wt)).numpy()
    else:
        if min(h, w) + 2 * pad < 3:
            return
        geo = conv_geometry("conv", 2, x, wt, 1, pad, 1, 1)
        ref = F.conv2d(torch.from_numpy(x), torch.from_numpy(wt), None, 1, pad).numpy()
    assert wg.applies(geo, np.float64, None) and geo.out_size == ref.shape[2:]
    ymem = np.full(ref.size, np.nan)
    parts, form = emulated_forward(geo, memory(x, cl), cl, _wrows(wt, cl), ymem, None, budget, "winograd")
    assert form == "winograd"
    assert _rel(from_memory(ymem, ref.shape, cl), ref) < 1e-13


def test_weight_plan_exact_and_where_it_applies(monkeypatch):
    """Per chunk: the input and gradient transforms, a^2 GEMMs summing E V^T into u (beta 1 after the first),
    then the weight transform; the weight forms list it for strict float32 and float64 only."""
    monkeypatch.setattr(cd, "WINOGRAD_TILE", 2)
    g = _geo(n=3, c=4, k=3, size=(7, 6))
    steps, scratch = wg.weight_plan(g, np.float64, 16 * 7 * 12 * 8)  # one image a chunk
    assert [s.kind if isinstance(s, wg.Wino) else "gemm" for s in steps] == ["input", "dy", "gemm"] * 3 + ["weight"]
    assert steps[2] == cd.Gemm(("e", 0), ("v", 0), ("u", 0), 0, 1, 3, 4, 12, 3, 4, 3, 36, 48, 12, 16, 0.0)
    assert steps[5].beta == 1.0 and steps[4] == wg.Wino("dy", 1, 1, 2) and steps[-1] == wg.Wino("weight", m=2)
    assert scratch == {"u": 16 * 12, "v": 16 * 4 * 12, "e": 16 * 3 * 12}
    assert wg.kernel_args(g, True, steps[1]) == wg.kernel_args(g, True, wg.Wino("output", 0, 1))
    assert wg.threads(g, steps[-1]) == 12 and wg.threads(g, steps[1]) == 3 * 12
    assert wf.weight_forms(g, "cl", np.float32) == ("im2col", "shifted", "winograd")
    assert wf.weight_forms(g, "nchw", np.float64) == ("im2col", "winograd")
    assert wf.weight_forms(g, "cl", np.float32, math="tf32") == ("im2col", "shifted")
    assert wf.weight_form(g, np.float32, None, "cl") == "im2col" and wf.weight_form(g, np.float32, "winograd") == \
        "winograd"  # (4 channels: im2col unless forced)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([2, 4]), st.booleans(), st.integers(1, 3), st.integers(1, 5), st.integers(1, 4),
       st.integers(3, 11), st.integers(3, 10), st.sampled_from([0, 1, 2]), st.sampled_from([1 << 30, 1]),
       st.integers(0, 1000))
def test_weight_plan_vs_torch(m, cl, n, c, k, h, w, pad, budget, seed):
    """dW by F(2x2) and F(4x4): outputs that are and are not multiples of m, padding 0-2, both layouts, one image
    a chunk (u summed over chunks) or all, against torch in float64."""
    if min(h, w) + 2 * pad < 3:
        return
    rng = np.random.default_rng(seed)
    x, wt = rng.standard_normal((n, c, h, w)), np.zeros((k, c, 3, 3))
    geo = conv_geometry("conv", 2, x, wt, 1, pad, 1, 1)
    dy = rng.standard_normal((n, k, *geo.out_size))
    ref = torch.nn.grad.conv2d_weight(torch.from_numpy(x), wt.shape, torch.from_numpy(dy), 1, pad).numpy()
    tile, cd.WINOGRAD_TILE = cd.WINOGRAD_TILE, m
    try:
        dw, parts = emulated_weight(geo, memory(x, cl), memory(dy, cl), cl, budget, "winograd")
    finally:
        cd.WINOGRAD_TILE = tile
    assert len(parts) == (1 if budget > 1 else n)
    got = (np.moveaxis(dw.reshape(k, 3, 3, c), -1, 1) if cl else dw.reshape(k, c, 3, 3))
    assert _rel(got, ref) < 1e-13


@pytest.mark.parametrize("m, bound", [(2, 3), (4, 12)])
def test_float32_error_stays_near_the_direct_sums(m, bound):
    """In float32 the transforms' error is a small multiple of the direct sum's (both against float64): F(2x2)
    within 3 times (0.7 here), F(4x4) (its 1/6s, 1/24s and five-term sums) within 12 times (4.5 here)."""
    rng = np.random.default_rng(3)
    x, wt = rng.standard_normal((2, 64, 12, 12)).astype(np.float32), rng.standard_normal((32, 64, 3, 3)).astype(
        np.float32)
    ref = F.conv2d(torch.from_numpy(x).double(), torch.from_numpy(wt).double(), None, 1, 1).numpy()
    BT, G, AT = (np.array(mat, np.float32) for mat in wg.MATRICES[m])
    u = np.einsum("ar,kcrs,bs->abkc", G, wt, G, dtype=np.float32)
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    d = np.lib.stride_tricks.sliding_window_view(xp, (m + 2, m + 2), axis=(2, 3))[:, :, ::m, ::m]
    v = np.einsum("ai,ncpqij,bj->abcnpq", BT, d, BT, dtype=np.float32)
    mm = np.einsum("abkc,abcnpq->abknpq", u, v, dtype=np.float32)
    y = np.einsum("ia,abknpq,jb->nkpiqj", AT, mm, AT, dtype=np.float32).reshape(ref.shape)
    direct = F.conv2d(torch.from_numpy(x), torch.from_numpy(wt), None, 1, 1).numpy()
    assert _rel(y, ref) < bound * max(_rel(direct, ref), 1e-7)


@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_front_end_forward_and_input_gradient_forced(emulated_route, monkeypatch, layout):
    """conv2d (bias, scale, activation on the epilogue) and conv2d_input of a stride-1 3x3 run winograd where
    forced, against torch."""
    monkeypatch.setattr(cd, "FORM", "winograd")
    rng = np.random.default_rng(5)
    lay = _cl if layout == "cl" else (lambda a: a)
    x, w, b = rng.standard_normal((2, 5, 9, 7)), rng.standard_normal((4, 5, 3, 3)), rng.standard_normal(4)
    y = dnn.conv2d(lay(x), w, b, padding=1, activation="relu")
    ref = F.relu(F.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), 1, 1)).numpy()
    assert _rel(y, ref) < 1e-13
    dy = rng.standard_normal(ref.shape)
    dx = dnn.conv2d_input(x.shape, w, lay(dy), padding=1)
    want = torch.nn.grad.conv2d_input(x.shape, torch.from_numpy(w), torch.from_numpy(dy), 1, 1).numpy()
    assert _rel(dx, want) < 1e-13
    assert emulated_route.forms == ["winograd", "winograd"]
