"""The default tile rule (``blasx.tile.default_tile``, ``small_n_tile``) by exact value, and the
``small_n_tiles`` knob: small calls on CUDA get 2 x streams tasks per GPU, large ones keep 4096;
tensor-core types take the wide tile where every stream still gets 4 tasks."""

import numpy as np
import pytest

import blasx
from blasx.runtime.knobs import Knobs
from blasx.tile import SMALL_N, WIDE_TILE, choose_tile, default_tile, small_n_tile, wide_class


def cuda_tile(n, workers, small_n=True, m=None, k=None):
    m = n if m is None else m
    return default_tile(m, n, n if k is None else k, "cuda", workers=workers, streams=4, split=True, small_n=small_n)


@pytest.mark.parametrize("n, workers, old, new", [
    (4096, 1, 2048, 2048), (4096, 2, 2048, 2048),      # already at the least tile
    (8192, 1, 4096, 3072), (8192, 2, 4096, 2048),      # 4 tiles -> 3 x 3 / 4 x 4 even tiles
    (12288, 1, 4096, 4096), (12288, 2, 4096, 3072),    # 9 tiles are enough for one GPU, not for two
    (16384, 1, 4096, 4096), (16384, 2, 4096, 4096), (40960, 2, 4096, 4096),  # large calls: unchanged
    (16384, 8, 4096, 3072),
])
def test_square_calls(n, workers, old, new):
    assert cuda_tile(n, workers, small_n=False) == old
    assert cuda_tile(n, workers) == new


def test_small_n_tile_exact():
    assert small_n_tile(10000, 10000, 10000, 4096, 16, 512, 2048) == 2560  # 4 x 4 grid, evened from 3072
    assert small_n_tile(5000, 3000, 4000, 4096, 8, 512, 2048) == 2048  # none reaches 8: the least tile
    assert small_n_tile(4096, 4096, 4096, 2048, 16, 512, 2048) == 2048  # at the least tile already
    assert small_n_tile(8192, 8192, 8192, 4096, 4, 512, 2048) == 4096  # enough tasks: unchanged
    assert small_n_tile(8192, 8192, 8192, 4096, 16, 256, 1024) == 2048
    assert small_n_tile(6000, 6000, 6000, 4096, 9, 512, 1024) == 2048  # 3 x 3 of 2000, rounded up to 512


def test_a_long_k_keeps_its_tile_for_split_k():
    # X^T X: few C tiles, split-k's partial sums give the tasks; a smaller tile would only add k-steps
    assert cuda_tile(1024, 2, k=2 * 10 ** 6) == 4096
    assert cuda_tile(8192, 2, k=512) == 2048  # a short k: C tiles only


def test_only_kinds_with_a_rule_change():
    assert "sim" not in SMALL_N and "cpu" not in SMALL_N
    for n in (100, 1000, 5000):
        assert (default_tile(n, n, n, "sim", workers=2, streams=4, split=True, small_n=True)
                == default_tile(n, n, n, "sim", workers=2, streams=4, split=True, small_n=False))


def test_knob_parses_and_choose_tile_uses_the_rule_on_sims(monkeypatch, rand, rel_err):
    assert Knobs().small_n_tiles is False  # off until a GPU A/B says otherwise
    assert Knobs.from_env("small_n_tiles=1").small_n_tiles is True
    # give the sim kind a rule for this test: choose_tile then follows it, and results stay right
    monkeypatch.setitem(SMALL_N, "sim", (16, 32, 2))
    blasx.configure(devices="sim:2", streams=2)
    try:
        eng = blasx.engine()
        eng.config.knobs = Knobs.from_env("small_n_tiles=1")
        assert choose_tile(eng, 256, 256, 256, np.float64) == 96  # 3 x 3 tiles >= 2 x 2 streams x 2 GPUs
        eng.config.knobs = Knobs.from_env("small_n_tiles=0")
        assert choose_tile(eng, 256, 256, 256, np.float64) == 128
        eng.config.knobs = Knobs.from_env("small_n_tiles=1")
        a, b = rand((256, 256)), rand((256, 256), seed=1)
        assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12
    finally:
        blasx.shutdown()


def test_a_tensor_core_type_takes_the_wide_tile_where_every_stream_gets_4_tasks():
    def wide(n, workers, k=None):
        return default_tile(n, n, n if k is None else k, "cuda", workers=workers, streams=4, split=True,
                            small_n=False, wide="reduced")
    assert WIDE_TILE["cuda", "reduced"] == (8192, 4)
    assert wide(65536, 2) == 8192   # 64 C tiles >= 4 x 4 streams x 2 GPUs
    assert wide(32768, 2) == 4096   # 16 C tiles: the default rule
    assert wide(32768, 1) == 8192   # 16 C tiles for one GPU
    assert wide(45056, 2) == 8192   # 6 x 6 = 36 C tiles
    assert wide(40960, 2) == 4096   # 5 x 5 = 25
    assert wide(4096, 1, k=10 ** 7) == 4096  # split-k's partial sums do not count: C tiles alone
    assert default_tile(65536, 65536, 65536, "sim", workers=2, streams=4, split=True, small_n=False,
                        wide="reduced") == 256  # the sim keeps its tile


def test_tf32_takes_the_wide_tile_where_every_stream_gets_2_tasks():
    def wide(n, workers):
        return default_tile(n, n, n, "cuda", workers=workers, streams=4, split=True, small_n=False, wide="tf32")
    assert WIDE_TILE["cuda", "tf32"] == (8192, 2)
    assert wide(32768, 2) == 8192   # 16 C tiles >= 2 x 4 streams x 2 GPUs
    assert wide(65536, 2) == 8192
    assert wide(24576, 2) == 4096   # 9 C tiles: the default rule
    assert wide(24576, 1) == 8192   # 9 >= 8 for one GPU
    assert wide_class(np.float32, "tf32") == "tf32"
    assert wide_class(np.float32) is None and wide_class(np.float64, "tf32") is None
    assert wide_class(np.float16) == "reduced" and wide_class(np.int8, "tf32") == "reduced"


def test_choose_tile_gives_the_wide_tile_to_reduced_types_only(monkeypatch, rand, rel_err):
    monkeypatch.setitem(WIDE_TILE, ("sim", "reduced"), (128, 2))  # a rule for the sim kind, as above
    blasx.configure(devices="sim:2", streams=2)
    try:
        eng = blasx.engine()
        assert choose_tile(eng, 512, 512, 512, np.float16) == 128  # 16 C tiles >= 2 x 2 streams x 2 GPUs
        assert choose_tile(eng, 512, 512, 512, np.int8) == 128
        assert choose_tile(eng, 512, 512, 512, np.float32) == 256   # not a tensor-core type
        assert choose_tile(eng, 256, 256, 256, np.float16) == 128  # 4 C tiles: the default rule's 128
        assert choose_tile(eng, 256, 256, 4096, np.float16) == 256  # 4 C tiles < 8: split-k's default
        a, b = rand((512, 512)).astype(np.float16), rand((512, 512), seed=1).astype(np.float16)
        ref = a.astype(np.float32) @ b.astype(np.float32)
        assert rel_err(blasx.gemm(1.0, a, b, out_dtype=np.float32), ref) < 1e-5
    finally:
        blasx.shutdown()


def test_choose_tile_gives_tf32_calls_their_wide_tile(monkeypatch, rand, rel_err):
    monkeypatch.setitem(WIDE_TILE, ("sim", "tf32"), (128, 2))
    blasx.configure(devices="sim:2", streams=2)
    try:
        eng = blasx.engine()
        assert choose_tile(eng, 512, 512, 512, np.float32, math="tf32") == 128  # 16 C tiles >= 2 x 2 x 2
        assert choose_tile(eng, 512, 512, 512, np.float32) == 256
        a, b = rand((512, 512)).astype(np.float32), rand((512, 512), seed=1).astype(np.float32)
        ref = a.astype(np.float64) @ b
        for math, tasks in (("tf32", 16), ("ieee", 4)):  # the call's own math reaches the tile rule
            assert rel_err(blasx.gemm(1.0, a, b, math=math), ref) < 1e-3
            assert blasx.last_profile().summary()["tasks"] == tasks
        blasx.configure(devices="sim:2", streams=2, math="tf32")  # and the configured one
        blasx.gemm(1.0, a, b)
        assert blasx.last_profile().summary()["tasks"] == 16
    finally:
        blasx.shutdown()
