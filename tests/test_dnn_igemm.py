"""The implicit-GEMM form (igemm.py) on the CPU: its planner by exact value, its choice among the forward
forms, and the kernel's addressing (the A rows it gathers per k-tile from the launch's arguments, the
weight rows, the split's k ranges) emulated in numpy against torch's convolution in float64."""

from __future__ import annotations

import numpy as np
import pytest

from blasx.dnn import conv_direct as cd
from blasx.dnn import call_graph, igemm
from blasx.dnn.geometry import conv_geometry
from dnn_ref import geometry

torch = pytest.importorskip("torch")


def emulate(launch: igemm.Launch, x_cl: np.ndarray, w_cl: np.ndarray) -> np.ndarray:
    """Y (M, K) as the kernel computes it: per split and k-tile, each output pixel's row of 128 bytes of
    channels read at its offset at tap 0 plus the tap's offset (zero where the tap falls outside the input),
    times the weight rows at the k-tile's offset; the splits summed in order."""
    (N, D, H, W, C, K, KD, R, S, O, P, Q, sd, sh, sw, pd, ph, pw, dd, dh, dw, per) = launch.ints
    bk = igemm.ROW_BYTES // igemm.TYPES[launch.type].itemsize
    x, w = x_cl.ravel(), w_cl.reshape(K, -1)
    M = N * O * P * Q
    assert launch.grid[0] * igemm.BM >= M > (launch.grid[0] - 1) * igemm.BM
    assert launch.grid[1] * launch.config.bn >= K > (launch.grid[1] - 1) * launch.config.bn
    m = np.arange(M)
    q, t = m % Q, m // Q
    p, t = t % P, t // P
    o, n = t % O, t // O
    d0, h0, w0 = o * sd - pd, p * sh - ph, q * sw - pw
    pix = (((n * D + d0) * H + h0) * W + w0) * C
    cchunks = C // bk
    total = KD * R * S * cchunks
    split = launch.grid[2]
    assert per * split >= total > per * (split - 1)
    parts = np.zeros((split, M, K))
    for z in range(split):
        for kg in range(z * per, min(total, (z + 1) * per)):
            tap, c0 = kg // cchunks, kg % cchunks * bk
            tt, rem = tap // (R * S), tap % (R * S)
            od, oh, ow = tt * dd, rem // S * dh, rem % S * dw
            ok = (0 <= d0 + od) & (d0 + od < D) & (0 <= h0 + oh) & (h0 + oh < H) & (0 <= w0 + ow) & (w0 + ow < W)
            idx = np.where(ok, pix + ((od * H + oh) * W + ow) * C + c0, 0)[:, None] + np.arange(bk)
            assert idx[ok].min(initial=0) >= 0 and idx[ok].max(initial=0) < x.size
            a = np.where(ok[:, None], x[idx], 0.0)
            parts[z] += a @ w[:, kg * bk:(kg + 1) * bk].T
    return parts.sum(axis=0)


CASES = [  # (n, c, k, size, kernel, stride, padding, dilation, type)
    (2, 64, 24, (11, 13), (3, 3), 1, 1, 1, "float16"),
    (3, 128, 40, (9, 10), (3, 3), 2, (0, 2), (2, 1), "bfloat16"),
    (2, 64, 8, (17,), (5,), 3, 2, 2, "float16"),
    (1, 64, 16, (4, 5, 6), (3, 2, 3), (1, 2, 1), (1, 0, 2), 1, "float16"),
    (2, 32, 12, (7, 7), (3, 3), 1, "same", 1, "float32"),
    (1, 512, 64, (7, 7), (3, 3), 1, 1, 1, "float16"),  # few blocks: split k
    (2, 64, 16, (6, 6), (1, 1), 2, 0, 1, "float16"),  # a strided 1x1
]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_the_kernels_addressing_computes_the_convolution(case):
    n, c, k, size, kernel, stride, padding, dilation, type_ = case
    nd = len(size)
    geo = geometry(n, c, k, size, kernel, stride, padding, dilation)
    assert igemm.applies(geo, np.dtype(type_) if type_ != "bfloat16" else np.float16, True, "tf32")
    cfg = igemm.config(geo, type_, 132)
    launch = igemm.plan_launch(geo, type_, cfg)
    rng = np.random.default_rng(len(size) + c)
    x = rng.standard_normal((n, c, *size))
    w = rng.standard_normal((k, c, *kernel))
    got = emulate(launch, np.moveaxis(x, 1, -1), np.moveaxis(w, 1, -1))
    conv = getattr(torch.nn.functional, f"conv{nd}d")
    ref = conv(torch.from_numpy(x), torch.from_numpy(w), None, stride, padding, dilation).numpy()
    ref = np.moveaxis(ref, 1, -1).reshape(-1, k)
    assert np.abs(got - ref).max() < 1e-10 * max(1.0, np.abs(ref).max())
    if case[1] == 512:
        assert launch.config.split > 1 and launch.part == launch.config.split * n * 49 * k


def test_config_by_exact_value():
    """ResNet-50's 3x3 layers at batch 64 on 132 multiprocessors, and small problems that split."""
    g = lambda c, k, s, stride=1: geometry(64, c, k, (s, s), (3, 3), stride, 1)  # noqa: E731
    assert igemm.config(g(64, 64, 56), "float16", 132) == igemm.Config(64, 0, 1)
    assert igemm.config(g(128, 128, 28), "float16", 132) == igemm.Config(128, 1, 1)
    assert igemm.config(g(256, 256, 14), "float16", 132) == igemm.Config(256, 1, 1)
    # 3136 pixels: 25 row blocks; BN 256 would leave 50 blocks (< 66), so 128: 100 blocks, no split
    assert igemm.config(g(512, 512, 7), "float16", 132) == igemm.Config(128, 1, 1)
    assert igemm.config(g(512, 512, 7), "float32", 132) == igemm.Config(128, 1, 1)
    assert igemm.config(geometry(16, 512, 512, (7, 7), (3, 3), 1, 1), "float16", 132) == igemm.Config(128, 1, 4)
    # 98 pixels, one row block: 4 splits at most, each at least 8 k-tiles (9 * 512 * 2 / 128 = 72 k-tiles)
    assert igemm.config(geometry(2, 512, 64, (7, 7), (3, 3), 1, 1), "float16", 132) == igemm.Config(64, 0, 4)
    # too few k-tiles to split (9 * 64 * 2 / 128 = 9)
    assert igemm.config(geometry(1, 64, 64, (8, 8), (3, 3), 1, 1), "float16", 132) == igemm.Config(64, 0, 1)


def test_plan_launch_by_exact_value():
    geo = geometry(64, 512, 512, (7, 7), (3, 3), 1, 1)
    launch = igemm.plan_launch(geo, "float16", igemm.Config(128, 1, 2))
    assert launch.grid == (25, 4, 2)
    assert launch.ints == (64, 1, 7, 7, 512, 512, 1, 3, 3, 1, 7, 7, 1, 1, 1, 0, 1, 1, 1, 1, 1, 36)
    assert launch.part == 2 * 3136 * 512 and launch.reduce_ints == (3136 * 512, 2)
    assert launch.reduce_grid == (-(-3136 * 512 // 1024),)
    assert launch.smem == 4 * 256 * 128 + 1024
    # 15 k-tiles over 4 splits of 4: the last has 3, and the grid has the 4 splits the tiles need
    odd = igemm.plan_launch(geometry(1, 64, 64, (6, 5), (3, 5), 1, 0), "float16", igemm.Config(64, 0, 4))
    assert odd.ints[-1] == 4 and odd.grid[2] == 4 and odd.config.split == 4
    tf = igemm.plan_launch(geo, "float32", igemm.Config(256, 1, 1))
    assert tf.smem == max(4 * 384 * 128, 128 * 260 * 4) + 1024 and tf.part == 0


def test_applies_and_the_forms_it_joins(monkeypatch):
    geo = geometry(64, 64, 64, (14, 14), (3, 3), 1, 1)  # 12,544 output pixels
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    assert igemm.applies(geo, f16, True, None)
    assert not igemm.applies(geo, f16, False, None)  # NCHW
    assert not igemm.applies(geo, f32, True, None) and igemm.applies(geo, f32, True, "tf32")
    assert not igemm.applies(geo, np.dtype(np.float64), True, None)
    assert not igemm.applies(geometry(8, 48, 64, (14, 14), (3, 3), 1, 1), f16, True, None)  # C not whole k-tiles
    assert not igemm.applies(geometry(8, 64, 60, (14, 14), (3, 3), 1, 1), f16, True, None)  # K not whole pieces
    grouped = conv_geometry("conv", 2, np.zeros((8, 128, 14, 14), f16), np.zeros((64, 64, 3, 3), f16), 1, 1, 1, 2)
    assert not igemm.applies(grouped, f16, True, None)
    assert cd.forms(geo, f16, "cl", None, capable=True) == ("im2col", "shifted", "implicit")
    assert cd.forms(geo, f16, "cl", None, capable=False) == ("im2col", "shifted")
    assert cd.forward_form(geo, f16, None, "cl", None, capable=True) == "implicit"
    assert cd.forward_form(geo, f16, None, "nchw", None, capable=True) == "im2col"
    assert cd.forward_form(geo, f16, "shifted", "cl", None, capable=True) == "shifted"
    small = geometry(2, 64, 64, (14, 14), (3, 3), 1, 1)  # 392 output pixels: the grid is short of the SMs
    assert cd.forward_form(small, f16, None, "cl", None, capable=True) == "im2col"
    assert cd.forward_form(small, f16, "implicit", "cl", None, capable=True) == "implicit"
    point = geometry(8, 64, 64, (14, 14), (1, 1))
    assert cd.forward_form(point, f16, None, "cl", None, capable=True) == "im2col"  # a plain GEMM: cuBLAS
    assert cd.forward_form(point, f16, "implicit", "cl", None, capable=True) == "implicit"
    # 1x1s the kernel takes (igemm.pays_pointwise) where calls are issued one by one: 2-byte types, 4 k-tiles
    # or more, few pixels or channels; from CUDA graphs (the default) cuBLAS's GEMM, whose GPU time is less
    deep = geometry(64, 1024, 256, (14, 14), (1, 1))
    assert igemm.pays_pointwise(deep, f16) and cd.forward_form(deep, f16, None, "cl", None, capable=True) == "im2col"
    monkeypatch.setattr(call_graph, "ENABLED", False)
    assert cd.forward_form(deep, f16, None, "cl", None, capable=True) == "implicit"
    assert not igemm.pays_pointwise(deep, f32) and cd.forward_form(deep, f32, None, "cl", "tf32", True) == "im2col"
    assert not igemm.pays_pointwise(geometry(64, 128, 512, (28, 28), (1, 1)), f16)  # 2 k-tiles
    assert not igemm.pays_pointwise(geometry(64, 256, 128, (56, 56), (1, 1)), f16)  # 200,704 pixels, 128 channels
    assert igemm.pays_pointwise(geometry(64, 256, 64, (56, 56), (1, 1)), f16)
    assert cd.forward_form(geometry(64, 64, 64, (28, 28), (1, 1), 2), f16, None, "cl", None, capable=True) == "im2col"


def test_split_partials_fall_back_within_the_budget():
    geo = geometry(2, 512, 64, (7, 7), (3, 3), 1, 1)
    steps, scratch = cd.implicit_plan(geo, np.float16, 1 << 30)
    assert steps[0].config.split == 4 and scratch == {"part": 4 * 98 * 64 * 2}
    steps, scratch = cd.implicit_plan(geo, np.float16, 4 * 98 * 64 * 4 - 1)
    assert steps[0].config.split == 1 and scratch == {}


def test_kernel_source_names_its_tile_and_instruction():
    src = igemm.kernel_source("bfloat16", igemm.Config(128, 1, 1))
    assert "#define BN 128\n" in src and "#define PIPE 1\n" in src and "#define OUT_BF16 1\n" in src
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1," in src and "%63}, %64, %65, p, 1, 1, 0, 0;" in src
    assert "wgmma_n128(acc, desc(" in src and "WGMMA(" not in src
    tf = igemm.kernel_source("float32", igemm.Config(64, 0, 1))
    assert "m64n64k8.f32.tf32.tf32" in tf and "%33, p, 1, 1;" in tf and "#define ELEM_BYTES 4\n" in tf


def test_driver_launches_pack_each_threads_pointers():
    """Launcher (the replays' launch): threads launching one plan at once each pass their own pointers and the
    plan's integer arguments; a launcher is made once per device."""
    import threading

    from bench import fake_cupy
    geo = geometry(2, 64, 24, (11, 13), (3, 3), 1, 1)
    launch = igemm.plan_launch(geo, "float16", igemm.config(geo, "float16", 132))
    with fake_cupy.installed(record_calls=True) as fake:
        igemm._MODULES.clear()
        igemm._LAUNCHERS.clear()
        go = igemm.launcher(launch)
        assert igemm.launcher(launch) is go
        barrier = threading.Barrier(4)

        def work(t):
            barrier.wait()
            for i in range(50):
                base = (t * 1000 + i) * 4096
                go(0, base, base + 16, base + 32)
        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        got = sorted(e[4] for e in fake.log if e[0] == "raw_kernel")
        want = sorted(tuple(("array", (t * 1000 + i) * 4096 + o) for o in (0, 16, 32)) for t in range(4) for i in range(50))
        assert got == want
        assert all(e[1] == "blasx_igemm" and e[2] == launch.grid and e[5] == launch.smem for e in fake.log)
    igemm._MODULES.clear()
    igemm._LAUNCHERS.clear()
