"""rnn_persist.plan by exact value (the block shape of the persistent recurrent kernel, and where it does not
apply), and run()'s launch against the kernel's declared parameters on the CPU stand-in for CuPy."""

from __future__ import annotations

from math import gcd

import numpy as np
import pytest

import blasx

from blasx.dnn import rnn_persist
from blasx.dnn.rnn_persist import Plan


@pytest.mark.parametrize("args, want", [
    (("lstm", 16, 512, 2, 132), Plan(8, 64, 8, 4, 4, 1, 19104, False)),  # J 4 -> 8 (16: 32 tiles a warp)
    (("lstm", 64, 1024, 2, 132), Plan(8, 128, 8, 4, 8, 4, 75936, False)),  # J 16: weight regs over 96
    (("gru", 64, 1024, 2, 132), Plan(8, 128, 8, 3, 8, 4, 55424, False)),
    (("gru", 16, 512, 2, 132), Plan(8, 64, 8, 3, 4, 1, 13952, False)),
    (("gru", 16, 1024, 2, 132), Plan(16, 64, 8, 6, 8, 1, 27904, False)),  # from 128 blocks: up to 64 tiles
    (("lstm", 64, 512, 2, 132), Plan(8, 64, 8, 4, 4, 4, 75936, False)),
    (("lstm", 16, 1024, 2, 132), Plan(8, 128, 8, 4, 8, 1, 19104, False)),  # J 16: weight regs over 96
    (("rnn_tanh", 5, 256, 2, 132), Plan(8, 32, 8, 1, 2, 1, 4672, True)),
    (("rnn_tanh", 16, 1024, 2, 132), Plan(16, 64, 8, 2, 8, 1, 9344, False)),  # J 32: 32 tiles
    (("lstm", 8, 64, 2, 132), Plan(2, 32, 4, 1, 1, 1, 2664, True)),  # 4 k steps: 4 warps multiply
    (("gru", 16, 80, 2, 132), Plan(8, 10, 5, 3, 1, 1, 9344, True)),
    (("lstm", 128, 512, 2, 132), Plan(8, 64, 8, 4, 4, 4, 77984, False)),  # H <= NARROW_H: two passes of 64 rows
])
def test_plan(args, want):
    assert rnn_persist.plan(*args) == want


@pytest.mark.parametrize("args", [
    ("lstm", 64, 2048, 2, 132),  # weight fragments over the register budget
    ("gru", 128, 2048, 2, 132),
    ("lstm", 16, 500, 2, 132),  # H not a multiple of 16
    ("lstm", 16, 512, 4, 132),  # float32 storage
    ("lstm", 0, 512, 2, 132),
    ("rnn_relu", 8, 4096, 2, 16),  # more blocks than SMs at any J that fits
    ("lstm", 65, 1024, 2, 132),  # over MAX_BATCH
    ("gru", 129, 512, 2, 132),  # over NARROW_BATCH (H <= NARROW_H)
])
def test_plan_none(args):
    assert rnn_persist.plan(*args) is None


@pytest.mark.parametrize("args, want", [
    ((16, 512, 2, 132), Plan(8, 64, 8, 1, 16, 1, 5120, False)),  # J 16 would give a warp 32 tiles
    ((32, 1024, 2, 132), Plan(8, 128, 8, 1, 32, 2, 10240, False)),  # J 16: 128 tiles a warp
    ((16, 1024, 2, 132), Plan(16, 64, 8, 2, 32, 1, 10240, False)),  # from 128 blocks: up to 64 tiles
    ((16, 768, 2, 132), Plan(16, 48, 8, 2, 24, 1, 10240, False)),  # from 96 blocks: up to 64 tiles
    ((48, 128, 2, 132), Plan(8, 16, 8, 1, 4, 3, 15360, True)),
    ((128, 128, 2, 132, rnn_persist.SMEM, 128), Plan(8, 16, 8, 1, 4, 4, 24576, True)),  # two passes of 64 rows
    ((5, 16, 2, 132), Plan(8, 2, 4, 1, 1, 1, 2368, True)),  # 4 k steps: 4 warps multiply
])
def test_plan_backward(args, want):
    assert rnn_persist.plan_backward(*args) == want


@pytest.mark.parametrize("args", [(16, 2048, 2, 132), (49, 512, 2, 132), (129, 512, 2, 132, rnn_persist.SMEM, 128), (16, 500, 2, 132),
                                  (16, 512, 4, 132), (0, 512, 2, 132)])
def test_plan_backward_none(args):
    assert rnn_persist.plan_backward(*args) is None


def test_plan_passes(monkeypatch):
    """Batches over 64 rows take several passes a step (allowed where MAX_BATCH is raised, and up to
    NARROW_BATCH rows in layers of H <= NARROW_H)."""
    monkeypatch.setattr(rnn_persist, "MAX_BATCH", 1 << 20)
    assert rnn_persist.plan("lstm", 128, 1024, 2, 132) == Plan(8, 128, 8, 4, 8, 4, 77984, False)
    assert rnn_persist.plan("lstm", 60000, 512, 2, 132) is None  # every row's cell state does not fit


def test_plan_fits_shared_memory():
    for mode in rnn_persist.GATES:
        for h in range(16, 2049, 16):
            for b in (1, 16, 17, 64, 200):
                p = rnn_persist.plan(mode, b, h, 2, 132)
                if p is None:
                    continue
                g = rnn_persist.GATES[mode]
                assert p.smem <= rnn_persist.SMEM and p.blocks * p.units == h and p.blocks <= 132
                assert g * p.units == 8 * p.nt and p.kwarps * p.kt * 16 == h and p.kwarps <= 8
                assert p.nt * p.kt * 2 <= rnn_persist.MAX_WREGS and 1 <= p.mt <= rnn_persist.MAX_MT
                assert p.flags == (p.blocks <= rnn_persist.FLAG_BLOCKS)
                step = 8 // gcd(g, 8)
                first = next(j for j in range(step, h + 1, step) if h % j == 0 and h // j <= 132)
                if p.units > first:  # J was doubled: within the rule's limits (the grid before had many blocks)
                    assert p.blocks >= rnn_persist.MIN_BLOCKS
                    many = 2 * p.blocks > rnn_persist.MANY_BLOCKS
                    assert p.nt * p.kt * p.mt <= (rnn_persist.MAX_TILES_MANY if many else rnn_persist.MAX_TILES)


def _kernel_params(name: str = "rnn_persist_fwd") -> list[str]:
    """The parameter names of kernel ``name`` in rnn_persist.cu."""
    import re
    from importlib import resources
    src = resources.files("blasx.dnn").joinpath("rnn_persist.cu").read_text()
    sig = re.search(name + r"\((.*?)\)\s*\{", src, re.S).group(1)
    return [re.split(r"[\s*]+", p.strip())[-1] for p in sig.split(",")]


@pytest.mark.parametrize("mode, bias, h0, reverse", [("lstm", True, False, False), ("gru", False, True, True),
                                                     ("rnn_tanh", True, True, False)])
def test_run_launches_what_the_kernel_declares(monkeypatch, mode, bias, h0, reverse):
    """run()'s launch on the CPU stand-in for CuPy: the kernel's own parameters in order (arrays where given, null
    where absent), the plan's grid, block, shared memory and compile-time shape."""
    from bench import fake_cupy
    from blasx.dnn import rnn_layer
    for name in ("_kernels", "_smem_set", "_counts", "_SMS", "_syncs"):
        monkeypatch.setattr(rnn_persist, name, {})  # nothing made on the stand-in outlives the test
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        T, B, H = 7, 5, 64
        g = rnn_persist.GATES[mode]
        pl = rnn_persist.applies(mode, np.float16, B, H, cupy.cuda.Device())
        assert pl == rnn_persist.plan(mode, B, H, 2, 132)
        gx = cupy.empty((T, B, g * H), dtype=np.float32)
        w = cupy.empty((g * H, H), dtype=np.float16)
        b_ih, b_hh = (cupy.empty((g * H,), dtype=np.float16) for _ in range(2)) if bias else (None, None)
        st = rnn_layer.forward_buffers(cupy, mode, T, B, H, H, False, np.float16, np.float32, gates=True)
        hn = cupy.empty((B, H), dtype=np.float16)
        cn = cupy.empty((B, H), dtype=np.float16) if mode == "lstm" else None
        fake_cupy.LOG.clear()
        rnn_persist.run(pl, mode, gx, b_ih, b_hh, w, st, (B,) * T, reverse, h0, False, hn=hn, cn=cn)
        (launch,) = [e for e in fake_cupy.LOG if e[0] == "raw_kernel"]
        kernel = rnn_persist._kernels[(mode, pl.nt, pl.kwarps, pl.kt, pl.mt, pl.flags)]
    _, name, grid, block, args, smem = launch
    assert (name, grid, block, smem) == ("rnn_persist_fwd", (pl.blocks,), (rnn_persist.THREADS,), pl.smem)
    assert kernel.max_dynamic_shared_size_bytes == pl.smem
    assert {f"-DMODE={rnn_persist.MODES[mode]}", f"-DNT={pl.nt}", f"-DKW={pl.kwarps}", f"-DKT={pl.kt}",
            f"-DMT={pl.mt}", f"-DFLAGS={int(pl.flags)}"} <= set(kernel.options)
    params = _kernel_params()
    assert len(args) == len(params)
    got = dict(zip(params, args))

    def array(a):
        return ("array", a.data.ptr, a.shape, a.strides, a.dtype.name)
    assert got["gx"] == array(gx) and got["W"] == array(w) and got["S"] == array(st.S)
    assert got["gates"] == (array(st.gates) if st.gates is not None else ("uint64", 0))  # rnn: nothing saved
    assert got["C"] == (array(st.C) if mode == "lstm" else ("uint64", 0))
    assert got["b_ih"] == (array(b_ih) if bias else ("uint64", 0))
    assert got["b_hh"] == (array(b_hh) if bias else ("uint64", 0))
    assert got["bs"][0] == "array" and got["bs"][2] == (T,) and got["sync"][2] == (132 + 1,)  # a flag per SM + 1
    assert got["hn_out"] == array(hn) and got["cn_out"] == (array(cn) if mode == "lstm" else ("uint64", 0))
    assert [got[k] for k in ("T", "B", "H", "reverse", "zero_h", "zero_c")] == [
        ("int32", T), ("int32", B), ("int32", H), ("int32", int(reverse)), ("int32", int(not h0)), ("int32", 1)]


def test_active_rows_are_kept_and_inside_a_capture_filled_by_kernels(monkeypatch):
    """The kernel's active rows per step: one array per device, rows and stream outside captures; inside one, fresh
    arrays written by one fill per run of equal counts (the graph replays them; no copy from host memory, which
    a capture cannot take and whose buffer would be gone at a replay), never kept."""
    from bench import fake_cupy
    monkeypatch.setattr(rnn_persist, "_counts", {})
    with fake_cupy.installed(record_calls=True, copies=True) as fake:
        cupy = fake.cupy
        fake_cupy.LOG.clear()
        a = rnn_persist._active(cupy, (4, 4, 3, 1), 0)
        assert [e for e in fake_cupy.LOG if e[0] == "upload"] == [
            ("upload", (4,), "int32", np.array([4, 4, 3, 1], np.int32).tobytes())]
        assert rnn_persist._active(cupy, (4, 4, 3, 1), 0) is a
        side = cupy.cuda.Stream(non_blocking=True)
        fake_cupy.LOG.clear()
        with side:
            side.begin_capture()
            b = rnn_persist._active(cupy, (5, 5, 5, 2, 2), 0)
            c = rnn_persist._active(cupy, (4, 4, 3, 1), 0)
            side.end_capture()
        assert list(np.asarray(b)) == [5, 5, 5, 2, 2] and b.dtype == np.int32 and c is not a
        assert list(np.asarray(c)) == [4, 4, 3, 1] and not [e for e in fake_cupy.LOG if e[0] == "upload"]
        assert list(rnn_persist._counts) == [(0, (4, 4, 3, 1), 0, 0)]
        with side:  # another stream: its own copy (copied in and freed on the stream whose kernels read it)
            d = rnn_persist._active(cupy, (4, 4, 3, 1), 0)
        assert d is not a and rnn_persist._counts[(0, (4, 4, 3, 1), side.ptr, 0)] == (side, d)


def test_sync_words_are_kept_per_device_and_stream(monkeypatch):
    """The step wait's words (zeroed once; each launch leaves them zero) are one buffer per device and stream,
    the stream held with them; a capturing stream gets fresh zeroed words of its own."""
    from bench import fake_cupy
    monkeypatch.setattr(rnn_persist, "_syncs", {})
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        fake_cupy.LOG.clear()
        a = rnn_persist._sync_words(cupy, 0, 132)
        assert a.shape == (133,) and a.dtype == np.uint32
        assert [e[0] for e in fake_cupy.LOG].count("zeros") == 1
        assert rnn_persist._sync_words(cupy, 0, 132) is a
        assert rnn_persist._sync_words(cupy, 1, 132) is not a
        side = cupy.cuda.Stream(non_blocking=True)
        with side:
            b = rnn_persist._sync_words(cupy, 0, 132)
            assert b is not a and rnn_persist._sync_words(cupy, 0, 132) is b
            assert rnn_persist._syncs[(0, side.ptr, 0)][0] is side
            side.begin_capture()
            c = rnn_persist._sync_words(cupy, 0, 132)
            side.end_capture()
        assert c is not b and len(rnn_persist._syncs) == 3


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_a_small_inference_call_is_a_gemm_and_one_launch(monkeypatch, mode):
    """A float16 layer's inference on the CPU stand-in for CuPy: the projection's GEMM and the persistent kernel,
    which writes the final states into the returned h_n (and c_n) itself: no copies, no other launches (the
    general path: whole-call graphs off); the engine is never started."""
    from bench import fake_cupy
    from blasx import dnn
    from blasx.dnn import rnn_replay
    monkeypatch.setattr(rnn_replay, "ENABLED", False)
    for name in ("_kernels", "_smem_set", "_counts", "_SMS", "_syncs"):
        monkeypatch.setattr(rnn_persist, name, {})
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        T, B, H = 6, 4, 32
        g = rnn_persist.GATES[mode]
        p = {"weight_ih_l0": (g * H, H), "weight_hh_l0": (g * H, H), "bias_ih_l0": (g * H,), "bias_hh_l0": (g * H,)}
        p = {k: cupy.empty(s, dtype=np.float16) for k, s in p.items()}
        x = cupy.empty((T, B, H), dtype=np.float16)
        call = dnn.lstm if mode == "lstm" else dnn.gru
        call(x, None, p)  # (the stream's sync words are made once)
        fake_cupy.LOG.clear()
        y, state = call(x, None, p)
        kinds = sorted(e[0] for e in fake_cupy.LOG)
        (launch,) = [e for e in fake_cupy.LOG if e[0] == "raw_kernel"]
    assert kinds == ["gemm_ex", "raw_kernel"]
    assert blasx.session._engine is None  # (nothing of the call needed it: no tile cache taken from the GPU)
    got = dict(zip(_kernel_params(), launch[4]))
    h_n, c_n = state if mode == "lstm" else (state, None)
    assert got["hn_out"][1] == h_n.data.ptr and got["S"][1] == y.data.ptr - B * H * 2  # y is S[1:]
    assert got["cn_out"] == (("array", c_n.data.ptr, (B, H), (2 * H, 2), "float16") if c_n is not None
                             else ("uint64", 0))


def test_run_backward_launches_what_the_kernel_declares(monkeypatch):
    """run_backward()'s launch on the CPU stand-in: the backward kernel's own parameters in order, its plan's grid
    and shared memory, fresh outputs of the loop's shapes."""
    from bench import fake_cupy
    for name in ("_kernels", "_smem_set", "_counts", "_SMS", "_syncs"):
        monkeypatch.setattr(rnn_persist, name, {})
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        T, B, H = 7, 5, 64
        pl = rnn_persist.applies_backward("lstm", np.float16, B, H, cupy.cuda.Device())
        assert pl == rnn_persist.plan_backward(B, H, 2, 132)
        assert rnn_persist.applies_backward("gru", np.float16, B, H, cupy.cuda.Device()) is None
        gates = cupy.empty((T, B, 4 * H), dtype=np.float32)
        C = cupy.empty((T + 1, B, H), dtype=np.float32)
        w = cupy.empty((4 * H, H), dtype=np.float16)
        dy = cupy.empty((T, B, H), dtype=np.float32)
        dh_n = cupy.empty((B, H), dtype=np.float32)
        fake_cupy.LOG.clear()
        dgx, g16, dh0, dc0 = rnn_persist.run_backward(pl, gates, C, w, dy, dh_n, None, (B,) * T, True)
        (launch,) = [e for e in fake_cupy.LOG if e[0] == "raw_kernel"]
        kernel = rnn_persist._kernels[("lstm", pl.nt, pl.kwarps, pl.kt, pl.mt, pl.flags, "bwd")]
    _, name, grid, block, args, smem = launch
    assert (name, grid, block, smem) == ("rnn_persist_bwd", (pl.blocks,), (rnn_persist.THREADS,), pl.smem)
    assert "-DBWD=1" in kernel.options and f"-DNT={pl.nt}" in kernel.options
    assert (dgx.shape, dgx.dtype, g16.shape, g16.dtype) == ((T, B, 4 * H), np.float32, (T, B, 4 * H), np.float16)
    assert dh0.shape == dc0.shape == (B, H)
    params = _kernel_params("rnn_persist_bwd")
    got = dict(zip(params, args))
    assert len(args) == len(params)

    def array(a):
        return ("array", a.data.ptr, a.shape, a.strides, a.dtype.name)
    assert [got[k] for k in ("gates", "C", "W", "dy", "dh_n", "dgx", "g16", "dh0", "dc0")] == [
        array(a) for a in (gates, C, w, dy, dh_n, dgx, g16, dh0, dc0)]
    assert got["dc_n"] == ("uint64", 0) and got["sync"][2] == (133,)
    assert [got[k] for k in ("T", "B", "H", "reverse")] == [("int32", T), ("int32", B), ("int32", H), ("int32", 1)]


def test_a_small_training_call_runs_both_loops_persistent(monkeypatch):
    """A float16 LSTM layer's training call on the stand-in: the forward and backward loops are one launch each
    (no graph, no copies into graph buffers)."""
    from bench import fake_cupy
    from blasx import dnn
    for name in ("_kernels", "_smem_set", "_counts", "_SMS", "_syncs"):
        monkeypatch.setattr(rnn_persist, name, {})
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        T, B, H = 6, 4, 32
        p = {"weight_ih_l0": (4 * H, H), "weight_hh_l0": (4 * H, H), "bias_ih_l0": (4 * H,), "bias_hh_l0": (4 * H,)}
        p = {k: cupy.empty(s, dtype=np.float16) for k, s in p.items()}
        x = cupy.empty((T, B, H), dtype=np.float16)
        y, _, saved = dnn.lstm(x, None, p, training=True)
        fake_cupy.LOG.clear()
        g = dnn.lstm_backward(saved, y)
        kernels = [e[1] for e in fake_cupy.LOG if e[0] == "raw_kernel"]
        graphs = [e for e in fake_cupy.LOG if e[0] == "graph_launch"]
    assert kernels == ["rnn_persist_bwd"] and not graphs
    assert set(g) >= {"input", "h0", "c0", "weight_hh_l0", "bias_ih_l0"}
