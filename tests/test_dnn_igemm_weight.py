"""The implicit weight-gradient form (igemm_weight.py) on the CPU: its planner by exact value, its choice among the
weight-gradient forms, and the kernel's addressing (the pixel rows a k-tile reads through the launch's division
multipliers, each B chunk's tap, the split's k-tile ranges) emulated in numpy against torch in float64."""

from __future__ import annotations

import numpy as np
import pytest

from blasx.dnn import conv_direct as cd
from blasx.dnn import gather_kernel as gk
from blasx.dnn import igemm_weight as iw
from blasx.dnn import weight_forms as wf
from blasx.dnn.conv_sets import layers
from blasx.dnn.geometry import conv_geometry
from dnn_ref import geometry

torch = pytest.importorskip("torch")
f16, f32 = np.dtype(np.float16), np.dtype(np.float32)


def quo(a, m, s):
    """The kernel's quotient by a fast_divisor pair (gather_kernel.HELPERS' blasx_quo) on int64 arrays."""
    return (a * m >> 32) >> s if m else a


def emulate(launch: iw.Launch, x_cl: np.ndarray, dy_cl: np.ndarray) -> np.ndarray:
    """dW (K, T*R*S*C) as the kernel computes it: per split, the k-tiles' pixel rows decoded with the launch's
    multipliers, dY's rows times X's rows at each column chunk's tap (zero outside the input); splits in order."""
    (N, D, H, W, C, K, KD, R, S, O, P, Q, sd, sh, sw, pd, ph, pw, dd, dh, dw, per,
     mq, shq, mp, shp, mo, sho) = launch.ints
    wgm, bn = launch.config.wgm, launch.config.bn
    rsc = KD * R * S * C
    assert launch.grid[0] * bn >= rsc > (launch.grid[0] - 1) * bn and launch.grid[1] * 64 * wgm == K
    assert launch.threads == 128 * wgm and launch.smem <= iw.SMEM_MAX
    npix = N * O * P * Q
    kts = -(-npix // 64)
    split = launch.grid[2]
    assert per * split >= kts > per * (split - 1)
    x, dyf = x_cl.ravel(), dy_cl.reshape(npix, K)
    cols = np.arange(rsc)
    tap, c = cols // C, cols % C
    od, oh, ow = tap // (R * S) * dd, tap % (R * S) // S * dh, tap % S * dw
    parts = np.zeros((split, K, rsc))
    for z in range(split):
        pix = np.arange(z * per * 64, min(kts, (z + 1) * per) * 64)
        pix = pix[pix < npix]
        t1 = quo(pix, mq, shq)
        t2 = quo(t1, mp, shp)
        n = quo(t2, mo, sho)
        q, p, o = pix - t1 * Q, t1 - t2 * P, t2 - n * O
        assert (t1 == pix // Q).all() and (t2 == pix // (Q * P)).all() and (n == pix // (Q * P * O)).all()
        d0, h0, w0 = (o * sd - pd)[:, None], (p * sh - ph)[:, None], (q * sw - pw)[:, None]
        ok = (0 <= d0 + od) & (d0 + od < D) & (0 <= h0 + oh) & (h0 + oh < H) & (0 <= w0 + ow) & (w0 + ow < W)
        idx = (((n[:, None] * D + d0 + od) * H + h0 + oh) * W + w0 + ow) * C + c
        assert idx[ok].min(initial=0) >= 0 and idx[ok].max(initial=0) < x.size
        b = np.where(ok, x[np.where(ok, idx, 0)], 0.0)
        parts[z] = dyf[pix].T @ b
    return parts.sum(axis=0)


CASES = [  # (n, c, k, size, kernel, stride, padding, dilation, type)
    (2, 64, 64, (11, 13), (3, 3), 1, 1, 1, "float16"),
    (3, 128, 128, (9, 10), (3, 3), 2, (0, 2), (2, 1), "bfloat16"),
    (2, 64, 192, (7, 7), (3, 3), 1, 1, 1, "float16"),  # K of one warpgroup's rows
    (2, 64, 64, (37,), (5,), 3, 2, 2, "float16"),
    (2, 64, 128, (4, 5, 6), (3, 3, 3), (1, 2, 1), 1, 1, "bfloat16"),
    (1, 192, 64, (6, 6), (2, 2), 1, 0, 1, "float16"),  # columns past a 256 tile
]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
@pytest.mark.parametrize("split", [None, 3])
def test_emulated_addressing_matches_torch(case, split):
    n, c, k, size, kernel, stride, pad, dil, t = case
    geo = geometry(n, c, k, size, kernel, stride, pad, dil)
    assert iw.applies(geo, np.float16, True)
    cfg = iw.config(geo, 132)
    if split is not None:
        cfg = cfg._replace(split=split)
    launch = iw.plan_launch(geo, t, cfg)
    rng = np.random.default_rng(c + k)
    x = rng.standard_normal((n, c, *size))
    y = torch.nn.functional.__dict__[f"conv{len(size)}d"](torch.from_numpy(x), torch.zeros(k, c, *kernel, dtype=torch.float64),
                                                         None, stride, pad, dil)
    dy = rng.standard_normal(tuple(y.shape))
    want = torch.nn.grad.__dict__[f"conv{len(size)}d_weight"](torch.from_numpy(x), (k, c, *kernel),
                                                             torch.from_numpy(dy), stride, pad, dil).numpy()
    nd = len(size)
    to_cl = (0, *range(2, nd + 2), 1)
    got = emulate(launch, x.transpose(to_cl).copy(), dy.transpose(to_cl).copy())
    want_m = want.transpose(0, *range(2, nd + 2), 1).reshape(k, -1)
    np.testing.assert_allclose(got, want_m, rtol=1e-10, atol=1e-10)


def test_config_on_resnet50s_3x3s():
    """One warpgroup (256 columns) where K = 64, else two (192 columns); splits filling one wave of 132 blocks."""
    got = {}
    for layer in layers("resnet50", 64):
        x, w = np.empty(layer["x_shape"], np.float16), np.empty(layer["weight_shape"], np.float16)
        geo = conv_geometry("conv2d", 2, x, w, layer["stride"], layer["padding"], 1, 1)
        if layer["weight_shape"][2] == 3:
            got[layer["name"]] = iw.config(geo, 132)
    assert got["layer1.0.conv2"] == iw.Config(1, 256, 4, 44)  # 3 tiles
    assert got["layer2.1.conv2"] == iw.Config(2, 192, 4, 22)  # 6 tiles
    assert got["layer3.1.conv2"] == iw.Config(2, 192, 4, 5)  # 24 tiles
    assert got["layer4.1.conv2"] == iw.Config(2, 192, 4, 1)  # 96 tiles, 49 k-tiles
    assert iw.config(geometry(1, 64, 64, (8, 8), (3, 3), 1, 1), 132).split == 1  # one k-tile


def test_plan_launch_by_value():
    geo = geometry(2, 64, 128, (9, 10), (3, 3), 2, (0, 2), (2, 1))
    launch = iw.plan_launch(geo, "float16", iw.Config(2, 192, 4, 2))
    # out 3 x 6 = 18 pixels an image, 36 in all: one k-tile, so one split
    assert launch.grid == (3, 1, 1) and launch.threads == 256 and launch.part == 0
    assert launch.smem == 4 * 5 * 8192 + 1024 and launch.config.split == 1
    assert launch.ints[:22] == (2, 1, 9, 10, 64, 128, 1, 3, 3, 1, 3, 6, 1, 2, 2, 0, 0, 2, 1, 2, 1, 1)
    assert launch.ints[22:] == (*gk.fast_divisor(6), *gk.fast_divisor(3), 0, 0)  # output 3 x 6, depth 1
    big = geometry(64, 64, 64, (56, 56), (3, 3), 1, 1)
    launch = iw.plan_launch(big, "bfloat16", iw.config(big, 132))
    assert launch.grid == (3, 1, 44) and launch.part == 44 * 64 * 576 and launch.reduce_ints == (64 * 576, 44)


def test_applies_and_the_default_choice():
    big = geometry(64, 64, 64, (56, 56), (3, 3), 1, 1)
    assert iw.applies(big, f16, True) and not iw.applies(big, f16, False) and not iw.applies(big, f32, True)
    assert not iw.applies(geometry(4, 48, 64, (9, 9), (3, 3)), f16, True)  # C not whole 64-channel chunks
    assert wf.weight_forms(big, "cl", f16, capable=True) == ("im2col", "shifted", "implicit")
    assert wf.weight_forms(big, "cl", f16, capable=False) == ("im2col", "shifted")
    assert wf.weight_forms(big, "cl") == ("im2col", "shifted")  # no dtype: not asked
    assert wf.weight_form(big, f16, None, "cl", capable=True) == "implicit"
    assert wf.weight_form(big, f16, "im2col", "cl", capable=True) == "im2col"  # a force
    small = geometry(64, 512, 512, (7, 7), (3, 3), 1, 1)  # 3,136 output pixels: im2col
    assert wf.weight_form(small, f16, None, "cl", capable=True) == "im2col"
    assert wf.weight_form(small, f16, "implicit", "cl", capable=True) == "implicit"
    point = geometry(64, 64, 64, (56, 56), (1, 1))
    assert wf.weight_form(point, f16, None, "cl", capable=True) == "im2col"  # a 1x1 is one GEMM on x


def test_the_find_step_times_the_kernel_where_it_applies():
    from blasx.dnn.find import forms_for
    big = geometry(64, 64, 64, (56, 56), (3, 3), 1, 1)
    assert forms_for(big, "bwd-weight", f16, "cl", None, capable=True) == ("im2col", "shifted", "implicit")
    assert forms_for(big, "bwd-weight", f16, "cl", None, capable=False) == ("im2col", "shifted")
    assert forms_for(big, "bwd-weight", f32, "cl", "tf32", capable=True) == ("im2col", "shifted")


def test_split_partials_fall_back_within_the_budget():
    geo = geometry(64, 256, 256, (14, 14), (3, 3), 1, 1)
    steps, scratch = wf.implicit_steps(geo, f16, 1 << 30)
    assert steps == [cd.ImplicitWeight("float16", iw.Config(2, 192, 4, 5))]
    assert scratch == {"part": 5 * 256 * 2304 * 2}
    steps, scratch = wf.implicit_steps(geo, f16, 3 * 256 * 2304 * 4 + 1)
    assert steps[0].config.split == 3 and scratch == {"part": 3 * 256 * 2304 * 2}
    steps, scratch = wf.implicit_steps(geo, f16, 256 * 2304 * 4 * 2 - 1)
    assert steps[0].config.split == 1 and scratch == {}


def test_kernel_source_names_its_tile_and_transposed_operands():
    src = iw.kernel_source("bfloat16", iw.Config(2, 192, 4, 1))
    assert "#define WGM 2\n" in src and "#define BN 192\n" in src and "#define OUT_BF16 1\n" in src
    assert "m64n192k16.f32.bf16.bf16 {%0, %1," in src and "%95}, %96, %97, p, 1, 1, 1, 1;" in src
    assert "wgmma_n192(acc, desc(" in src and "WGMMA(" not in src
