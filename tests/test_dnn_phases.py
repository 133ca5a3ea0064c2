"""The sub-pixel (phase) decomposition of strided transposed convolutions and backward-data: its pure
geometry by exact value, and conv_transpose{1,2,3}d / conv{2,3}d_input through it against CPU torch
(stride 2 and 3, kernels smaller and larger than the stride, padding, output_padding, groups, both
layouts, float64 and float32) on the CPU and on two sims, and against the zero-inserted path (PHASES off)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn import grad as tgrad

import blasx
from blasx import dnn
from blasx.dnn import conv_transpose as conv, phases
from blasx.dnn.geometry import transpose_geometry
from dnn_ref import cl, rel

T = torch.from_numpy
TOL = {np.float64: 1e-12, np.float32: 1e-5}


def rand(rng, shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def _geo(size, k, stride, padding, output_padding=0, dilation=1):
    nd = len(size)
    x = np.zeros((1, 2, *size))
    w = np.zeros((2, 3, *k))
    return transpose_geometry(f"conv_transpose{nd}d", nd, x, w, stride, padding, output_padding, 1, dilation)


# ---------------------------------------------------------------- pure geometry

def test_geometry_exact_1d():
    # L=4, k=3, s=2, p=1: out 7; phase 0 uses flipped taps 1 (one tap), phase 1 taps 0, 2
    g = _geo((4,), (3,), 2, 1)
    assert g.out_size == (7,) and g.insert == (2,) and g.pad_lo == (1,)
    ph = phases.phases(g)
    assert [p.offset for p in ph] == [(0,), (1,)]
    assert [p.taps for p in ph] == [(slice(1, None, 2),), (slice(0, None, 2),)]
    assert [p.out_size for p in ph] == [(4,), (3,)]
    assert [p.geo.kernel for p in ph] == [(1,), (2,)]
    assert [p.geo.pad_lo for p in ph] == [(0,), (0,)]
    assert all(p.geo.insert == (1,) and p.geo.stride == (1,) and p.geo.in_size == (4,) for p in ph)


def test_geometry_exact_empty_and_missing_phases():
    # k=1 < s=3: only phase 0 has a tap; the other two are zeros (geo None)
    ph = phases.phases(_geo((5,), (1,), 3, 0, 2))
    assert [(p.offset, p.out_size, p.geo is None) for p in ph] == [((0,), (5,), False), ((1,), (5,), True),
                                                                   ((2,), (5,), True)]
    assert ph[0].geo.kernel == (1,) and ph[0].geo.pad_lo == (0,)
    # an output shorter than the stride has no pixels in some phases: they are left out
    ph = phases.phases(_geo((1,), (2,), 3, 0))
    assert [p.offset for p in ph] == [(0,), (1,)]


def test_geometry_2d_and_flops():
    g = _geo((5, 6), (3, 4), (2, 3), (1, 2), (1, 0))
    ph = phases.phases(g)
    assert len(ph) == 6 and [p.offset for p in ph][:3] == [(0, 0), (0, 1), (0, 2)]
    assert sum(int(np.prod(p.out_size)) for p in ph) == int(np.prod(g.out_size))  # a partition of y
    whole, split = phases.gemm_flops(g)
    assert whole == 2 * 1 * 3 * 2 * int(np.prod(g.out_size)) * 12
    assert split * 4 < whole  # about 1/6 of it
    assert phases.applies(g) and not phases.applies(_geo((5,), (3,), 1, 1))
    assert not phases.applies(_geo((5,), (3,), 2, 1, dilation=2))


def _bwd_data(n, c, k, size, kernel, stride, padding):
    """The transposed gather of the backward-data of the forward conv (C=c -> K=k, size, kernel, stride)."""
    out = (size + 2 * padding - kernel) // stride + 1
    x, w = np.zeros((n, k, out, out)), np.zeros((k, c, kernel, kernel))
    op = size - ((out - 1) * stride - 2 * padding + kernel)
    return transpose_geometry("conv_transpose2d", 2, x, w, stride, padding, op, 1, 1)


@pytest.mark.parametrize("problem, preferred", [
    ((64, 128, 128, 56, 3, 2, 1), True),   # ResNet-50 layer2.0.conv2: dY 28x28
    ((64, 256, 256, 28, 3, 2, 1), False),  # layer3.0.conv2: dY 14x14 (196 pixels), col2im's kernel faster
    ((64, 512, 512, 14, 3, 2, 1), False),  # layer4.0.conv2: dY 7x7
    ((64, 256, 512, 56, 1, 2, 0), False),  # layer2.0.downsample.0: three phases without taps
    ((64, 3, 64, 224, 7, 2, 3), False),    # conv1: three output channels
    ((64, 64, 64, 56, 3, 1, 1), False),    # stride 1: no phases
])
def test_preferred_on_resnet50_backward_data(problem, preferred):
    assert phases.preferred(_bwd_data(*problem)) is preferred


# ---------------------------------------------------------------- against torch

@pytest.fixture(params=["cpu", "sim:2"])
def devices(request):
    blasx.configure(devices=request.param, tile=16)
    yield request.param
    blasx.configure(devices="cpu")


@pytest.fixture
def counted(monkeypatch):
    """How many transposed calls took the phase path."""
    seen = [0]
    orig = conv._phase_calls

    def spy(*a, **kw):
        seen[0] += 1
        return orig(*a, **kw)
    monkeypatch.setattr(conv, "_phase_calls", spy)
    return seen


CASES = [  # nd, n, cin, cout/g, groups, size, kernel, stride, padding, output_padding
    (2, 2, 4, 3, 2, (5, 7), (3, 3), 2, 1, 1),
    (2, 1, 3, 2, 1, (4, 5), (1, 1), 3, 0, 2),  # kernel smaller than the stride: empty phases
    (2, 2, 2, 3, 1, (5, 4), (5, 4), 2, 2, 0),
    (2, 1, 6, 1, 3, (3, 5), (7, 2), (3, 2), (3, 0), (2, 1)),
    (2, 1, 3, 2, 1, (4, 3), (2, 3), 3, 0, 0),
    (1, 2, 3, 2, 3, (9,), (7,), 3, 4, 2),
    (3, 1, 4, 2, 2, (3, 4, 3), (3, 2, 4), 2, 1, 1),
    (3, 1, 2, 2, 1, (2, 3, 2), (2, 2, 2), (2, 3, 2), 0, (1, 0, 1)),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_transpose_vs_torch(devices, counted, case, layout, dtype):
    nd, n, cin, kg, g, size, k, s, p, op = case
    rng = np.random.default_rng(CASES.index(case) * 2 + (layout == "cl"))
    x, w, b = rand(rng, (n, cin, *size), dtype), rand(rng, (cin, kg, *k), dtype), rand(rng, (kg * g,), dtype)
    y = getattr(dnn, f"conv_transpose{nd}d")(cl(x) if layout == "cl" else x, w, b, s, p, op, g)
    ref = getattr(F, f"conv_transpose{nd}d")(T(x).double(), T(w).double(), T(b).double(), s, p, op, g).numpy()
    assert counted[0] == 1 and y.dtype == dtype and y.shape == ref.shape
    assert rel(y, ref) < TOL[dtype]


@pytest.mark.parametrize("nd,size,k,s,p", [(2, (9, 8), (3, 3), 2, 1), (2, (11, 10), (1, 1), 2, 0),
                                           (2, (10, 9), (5, 5), 3, 2), (3, (7, 6, 5), (3, 3, 3), 2, 1)])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_input_grad_vs_torch(devices, counted, nd, size, k, s, p, layout):
    rng = np.random.default_rng(sum(size))
    groups, c, kout = 2, 4, 6
    x = rand(rng, (2, c, *size))
    w = rand(rng, (kout, c // groups, *k))
    dy = getattr(F, f"conv{nd}d")(T(x), T(w), None, s, p, 1, groups).numpy()
    dy = rand(rng, dy.shape)
    got = getattr(dnn, f"conv{nd}d_input")(x.shape, w, cl(dy) if layout == "cl" else dy, s, p, 1, groups)
    ref = getattr(tgrad, f"conv{nd}d_input")(x.shape, T(w), T(dy), s, p, 1, groups).numpy()
    assert counted[0] == 1 and rel(got, ref) < 1e-12


def test_ab_switch_and_out(monkeypatch, counted):
    blasx.configure(devices="cpu")
    rng = np.random.default_rng(7)
    x, w, b = rand(rng, (2, 4, 6, 5)), rand(rng, (4, 3, 3, 3)), rand(rng, (3,))
    out = cl(np.full((2, 3, 12, 10), np.nan))
    got = dnn.conv_transpose2d(cl(x), w, b, 2, 1, 1, out=out)
    assert got is out and counted[0] == 1
    monkeypatch.setattr(conv, "PHASES", False)
    old = dnn.conv_transpose2d(x, w, b, 2, 1, 1)
    assert counted[0] == 1 and rel(out, old) < 1e-12
    unb = dnn.conv_transpose2d(x[0], w, b, 2, 1, 1)  # unbatched, the old path
    assert rel(unb, old[0]) < 1e-12
    monkeypatch.setattr(conv, "PHASES", True)
    assert rel(dnn.conv_transpose2d(x[0], w, b, 2, 1, 1), old[0]) < 1e-12 and counted[0] == 2


def test_fallbacks(counted):
    blasx.configure(devices="cpu")
    rng = np.random.default_rng(8)
    x, w = rand(rng, (1, 2, 5, 5)), rand(rng, (2, 2, 3, 3))
    for s, d in ((1, 1), (2, 2)):  # stride 1, dilation > 1: the zero-inserted gather
        y = dnn.conv_transpose2d(x, w, None, s, 1, 1 if s > 1 else 0, 1, d)
        ref = F.conv_transpose2d(T(x), T(w), None, s, 1, 1 if s > 1 else 0, 1, d).numpy()
        assert rel(y, ref) < 1e-12
    assert counted[0] == 0
