"""Replays of device-route convolution calls (conv_memo.py) on the CPU stand-in for CuPy (bench/fake_cupy.py):
a replayed call launches exactly what the full path launches for the same operands (GEMMs, gathers, copies,
with every pointer into the operands the same); keys tell apart everything a plan depends on; calls with an
epilogue, a Workspace or a graph capture are never kept; a replay gives way when the route no longer applies
or its memory cannot be had."""

from __future__ import annotations

import numpy as np
import pytest

from bench import fake_cupy
from blasx import dnn
from blasx.dnn import conv_direct as cd
from blasx.dnn import conv_memo, direct_cache, direct_cuda
from blasx.dnn.geometry import conv_geometry


@pytest.fixture(autouse=True)
def fresh():
    direct_cache.clear()
    yield
    direct_cache.clear()


def _masked(log, named: dict):
    """The log with each device pointer as (operand name, byte offset) where it points into a named operand,
    else "fresh" (outputs and scratch are allocated anew each call)."""
    spans = [(n, a.data.ptr, a.data.ptr + a.nbytes) for n, a in named.items()]

    def ptr(p):
        for n, lo, hi in spans:
            if lo <= p < hi:
                return (n, p - lo)
        return "fresh"
    out = []
    for e in log:
        if e[0] == "gemm":
            args = list(e[1:])
            for i in (6, 10, 15):  # A, B, C
                args[i] = ptr(args[i])
            args[5] = args[14] = None  # host scalars' addresses
            out.append(("gemm", *args))
        elif e[0] == "kernel":
            out.append(("kernel", e[1], tuple((a[0], ptr(a[1]), *a[2:]) if isinstance(a, tuple) and a and
                                              a[0] == "array" else a for a in e[2]), e[3]))
        elif e[0] == "raw_kernel":  # a raw kernel sees an array's pointer alone
            out.append((*e[:4], tuple(("array", ptr(a[1])) if isinstance(a, tuple) and a and a[0] == "array"
                                      else a for a in e[4]), *e[5:]))
        else:
            out.append(e)
    return out


def _arr(cupy, shape, dt, cl):
    if not cl:
        return cupy.empty(shape, dtype=dt)
    m = cupy.empty((shape[0], *shape[2:], shape[1]), dtype=dt)
    return m.transpose(0, m.ndim - 1, *range(1, m.ndim - 1))


# (name, direction, C, K, kernel, stride, padding, groups)
CASES = [("pointwise", "fwd", 64, 32, 1, 1, 0, 1), ("strided", "fwd", 16, 32, 3, 2, 1, 2),
         ("shifted", "fwd", 64, 32, 3, 1, 1, 1), ("first-layer", "fwd", 3, 32, 7, 2, 3, 1),
         ("pointwise", "bwd-data", 64, 32, 1, 1, 0, 1),
         ("window", "bwd-data", 16, 32, 3, 1, 1, 1), ("strided", "bwd-data", 16, 32, 3, 2, 1, 2),
         ("pointwise", "bwd-weight", 64, 32, 1, 1, 0, 1),
         ("strided", "bwd-weight", 16, 32, 3, 2, 1, 2)]


def _call(direction, x, w, dy, stride, padding, groups):
    if direction == "fwd":
        return dnn.conv2d(x, w, None, stride, padding, 1, groups)
    if direction == "bwd-data":
        return dnn.conv2d_input(tuple(x.shape), w, dy, stride, padding, 1, groups)
    return dnn.conv2d_weight(x, tuple(w.shape), dy, stride, padding, 1, groups)


def case_operands(cupy, case, dt, cl, w_cl=None):
    """(x, w, dY) of a case of CASES: 4 images of 10 x 10; the weight in ``w_cl``'s layout (default: x's)."""
    _, _, c, k, kern, stride, pad, groups = case
    x = _arr(cupy, (4, c, 10, 10), dt, cl)
    w = _arr(cupy, (k, c // groups, kern, kern), dt, cl if w_cl is None else w_cl)
    side = (10 + 2 * pad - kern) // stride + 1
    return x, w, _arr(cupy, (4, k, side, side), dt, cl)


def each_case(test):
    """``test`` for every case of CASES, in both layouts and both types."""
    for mark in (pytest.mark.parametrize("cl", [False, True], ids=["nchw", "cl"]),
                 pytest.mark.parametrize("dtype", ["float16", "float32"]),
                 pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])):
        test = mark(test)
    return test


@each_case
def test_a_replay_launches_what_the_full_path_launches(case, dtype, cl):
    _replay_equals_full_path(case, dtype, cl)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] != "bwd-weight"], ids=lambda c: f"{c[0]}-{c[1]}")
def test_a_weight_in_the_other_layout_is_replayed(case):
    """A weight not in x's layout (a contiguous weight with channels-last x, as torch's default weights): its
    matrix is made again in the replay, which launches what the full path launches."""
    for cl in (True, False):
        _replay_equals_full_path(case, "float16", cl, w_cl=not cl)


def _replay_equals_full_path(case, dtype, cl, w_cl=None):
    _, direction, c, k, kern, stride, pad, groups = case
    dt = np.dtype(dtype)
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy

        def operands():
            return case_operands(cupy, case, dt, cl, w_cl)
        with cupy.cuda.Device(0), cd.on_own_gpu():
            _call(direction, *operands(), stride, pad, groups)  # the full path, kept where it can be replayed
            kept = len(conv_memo._TABLE.entries)
            x, w, dy = operands()
            named = {"x": x, "w": w, "dy": dy}
            fake.log.clear()
            got = _call(direction, x, w, dy, stride, pad, groups)
            replayed = _masked(fake.log, named)
            direct_cache.clear()  # the memo too: the full path again on the same operands
            fake.log.clear()
            want = _call(direction, x, w, dy, stride, pad, groups)
            full = _masked(fake.log, named)
    geo = conv_geometry("conv2d", 2, np.empty((4, c, 10, 10), dt), np.empty((k, c // groups, kern, kern), dt),
                        stride, pad, 1, groups)
    shifted_nchw = direction == "fwd" and not cl and cd.device_layout("nchw", geo, dt) == "nchw" and \
        cd.forward_form(geo, dt, cd.FORM, "nchw") == "shifted"
    assert kept == (0 if shifted_nchw else 1)  # (the shifted form's NCHW weight is a transform: never kept)
    assert replayed == full and any(e[0] in ("gemm", "raw_kernel") for e in full)
    assert (got.shape, got.strides, got.dtype) == (want.shape, want.strides, want.dtype)


def test_keys_tell_apart_what_a_plan_depends_on(monkeypatch):
    with fake_cupy.installed() as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0):
            x, w = cupy.empty((4, 16, 8, 8), dtype=np.float32), cupy.empty((8, 16, 3, 3), dtype=np.float32)
            base = conv_memo.key("conv2d", 2, x, w, (1, 1, 1, 1), None)
            assert base is not None and base == conv_memo.key("conv2d", 2, x, w, (1, 1, 1, 1), None)
            others = [conv_memo.key("conv2d", 2, x, w, (2, 1, 1, 1), None),
                      conv_memo.key("conv2d", 2, x, w, (1, 1, 1, 1), "tf32"),
                      conv_memo.key("conv2d", 2, x.astype(np.float16), w.astype(np.float16), (1, 1, 1, 1), None),
                      conv_memo.key("conv2d", 2, x.transpose(0, 1, 3, 2), w, (1, 1, 1, 1), None),
                      conv_memo.key("conv2d_weight", 2, x, w, (1, 1, 1, 1), None)]
            with cupy.cuda.Stream():
                others.append(conv_memo.key("conv2d", 2, x, w, (1, 1, 1, 1), None))
            for name, value in (("FORM", "im2col"), ("BUDGET_FRACTION", 2**60), ("SHIFTED_MIN_C", 1)):
                monkeypatch.setattr(cd, name, value)
                others.append(conv_memo.key("conv2d", 2, x, w, (1, 1, 1, 1), None))
                monkeypatch.undo()
            assert len({base, *others}) == len(others) + 1
            # never a key: numpy operands, arguments that are not plain, a bad math, a Workspace, a capture
            assert conv_memo.key("conv2d", 2, np.empty((4, 16, 8, 8)), w, (1, 1, 1, 1), None) is None
            assert conv_memo.key("conv2d", 2, x, w, (np.int64(1), 1, 1, 1), None) is None
            assert conv_memo.key("conv2d", 2, x, w, (1, 1, 1, 1), "TF32") is None
            with direct_cache.using(direct_cache.Workspace()):
                assert conv_memo.key("conv2d", 2, x, w, (1, 1, 1, 1), None) is None
            with direct_cache.capturing([]):
                assert conv_memo.key("conv2d", 2, x, w, (1, 1, 1, 1), None) is None
        with cupy.cuda.Device(1):  # operands off the current device
            assert conv_memo.key("conv2d", 2, x, w, (1, 1, 1, 1), None) is None


def test_calls_with_an_epilogue_replay_it_with_their_own_operands():
    """Bias, scale, shift, residual and activation: kept, their vectors checked on every replay before any
    launch and the epilogue launched with the call's own operands; out=, unbatched x and a scale folded into
    the weight (with a residual) are never kept."""
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0), cd.on_own_gpu():
            x, w = cupy.empty((4, 16, 8, 8), dtype=np.float32), cupy.empty((8, 16, 1, 1), dtype=np.float32)
            y = cupy.empty((4, 8, 8, 8), dtype=np.float32)
            dnn.conv2d(x, w, out=y)
            dnn.conv2d(x[0], w)
            dnn.conv2d(x, w, scale=np.ones(8), residual=y)
            assert not conv_memo._TABLE.entries
            r1, r2 = cupy.empty((4, 8, 8, 8), dtype=np.float32), cupy.empty((4, 8, 8, 8), dtype=np.float32)
            logs = []
            for bias, res in ((np.ones(8), r1), (np.zeros(8), r2), (cupy.empty(8, dtype=np.float32), r1)):
                for i in range(2):  # full path (or a replay of the first), then a replay
                    fake.log.clear()
                    dnn.conv2d(x, w, bias, shift=np.arange(8.0), residual=res, activation="relu")
                    launched = [e for e in fake.log if e[0] not in ("upload", "tile")]  # (cache fills aside)
                    logs.append(_masked(launched, {"x": x, "w": w, "res": res}))
            assert len(conv_memo._TABLE.entries) == 2  # numpy bias, CuPy bias
            assert logs[0] == logs[1]  # the replay launches what the full path did
            # (a CuPy vector's conversion: before the GEMMs in a replay, which makes the epilogue's vectors first)
            assert sorted(map(repr, logs[4])) == sorted(map(repr, logs[5])) and logs[4][-1] == logs[5][-1]
            kernels = [e for e in logs[2] if e[0] == "kernel"]  # (a replay on r2, eager: its first sighting)
            assert kernels and any(("array", ("res", 0)) == a[:2] for e in kernels for a in e[2] if type(a) is tuple)
            with pytest.raises(ValueError, match="bias: expected shape"):
                fake.log.clear()
                dnn.conv2d(x, w, np.ones(7), shift=np.arange(8.0), residual=r1, activation="relu")
            assert not any(e[0] in ("gemm", "kernel") for e in fake.log)  # checked before any launch


def test_a_replay_gives_way_where_the_route_no_longer_applies_or_memory_runs_out(monkeypatch):
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0), cd.on_own_gpu():
            x, w = cupy.empty((4, 16, 10, 10), dtype=np.float32), cupy.empty((8, 16, 3, 3), dtype=np.float32)
            dnn.conv2d(x, w, None, 2, 1)  # im2col: a gather into scratch
            (k,) = conv_memo._TABLE.entries
            monkeypatch.setattr(cd, "applies", lambda x, flops: False)
            assert conv_memo.replay(k, x, w) is None  # the engine's route now: the full path runs
            monkeypatch.undo()
            oom = [True]
            empty_bits = direct_cuda.empty_bits

            def failing(size, dtype):
                if oom[0]:
                    oom[0] = False
                    raise fake.cupy.cuda.memory.OutOfMemoryError("no memory")
                return empty_bits(size, dtype)
            monkeypatch.setattr(direct_cuda, "empty_bits", failing)
            assert conv_memo.replay(k, x, w) is None and k not in conv_memo._TABLE.entries  # dropped
            y = dnn.conv2d(x, w, None, 2, 1)  # the full path, kept again
            assert y.shape == (4, 8, 5, 5) and k in conv_memo._TABLE.entries


def test_a_col2im_replay_weighs_the_flops_the_full_path_weighed():
    """The route check of a replayed strided backward-data call weighs its real work (no inserted zeros), as
    the full path's check did, so the two never disagree about the route."""
    with fake_cupy.installed() as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0), cd.on_own_gpu():
            w, dy = cupy.empty((32, 16, 3, 3), dtype=np.float32), cupy.empty((4, 32, 5, 5), dtype=np.float32)
            dnn.conv2d_input((4, 16, 10, 10), w, dy, 2, 1)
            (r,) = conv_memo._TABLE.entries.values()
            assert r.flops == 2.0 * 4 * 25 * 32 * 16 * 9


def test_a_transposed_call_with_few_channels_replays_its_padding():
    """conv_transpose2d on 3 channels-last channels: col's rows padded to whole runs (27 -> 32 elements) and the
    flipped weight's matrix padded alike on every replay, launching what the full path launches."""
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0), cd.on_own_gpu():
            x, w = _arr(cupy, (4, 3, 9, 9), np.float16, True), _arr(cupy, (3, 16, 3, 3), np.float16, True)
            dnn.conv_transpose2d(x, w, None, 1, 1)
            assert len(conv_memo._TABLE.entries) == 1
            fake.log.clear()
            got = dnn.conv_transpose2d(x, w, None, 1, 1)
            replayed = _masked(fake.log, {"x": x, "w": w})
            direct_cache.clear()
            fake.log.clear()
            want = dnn.conv_transpose2d(x, w, None, 1, 1)
            full = _masked(fake.log, {"x": x, "w": w})
    gemms = [e for e in full if e[0] == "gemm"]
    assert replayed == full and gemms and all(32 in e[1:] and 27 not in e[1:] for e in gemms), gemms
    assert (got.shape, got.strides) == (want.shape, want.strides)


@pytest.mark.parametrize("direction", ["fwd", "bwd-weight"])
def test_a_one_gemm_plan_replays_with_its_arguments_packed_once(monkeypatch, direction):
    # a pointwise channels-last convolution is one GEMM: its replay issues it without building CudaOps
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        x, w, dy = (_arr(cupy, s, np.float32, True) for s in ((4, 64, 10, 10), (32, 64, 1, 1), (4, 32, 10, 10)))
        with cupy.cuda.Device(0), cd.on_own_gpu():
            _call(direction, x, w, dy, 1, 0, 1)
            monkeypatch.setattr(direct_cuda, "CudaOps", None)  # a replay that built one would fail
            fake.log.clear()
            got = _call(direction, x, w, dy, 1, 0, 1)
    assert [e[0] for e in fake.log if e[0].startswith("gemm")] == ["gemm"]
    assert got.shape == ((4, 32, 10, 10) if direction == "fwd" else (32, 64, 1, 1))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_shifted_weight_form_replays_what_its_full_path_launches(monkeypatch, dtype):
    monkeypatch.setattr(cd, "FORM", "shifted")
    dt = np.dtype(dtype)
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy

        def operands():
            return (_arr(cupy, (4, 16, 10, 10), dt, True), _arr(cupy, (32, 16, 3, 3), dt, True),
                    _arr(cupy, (4, 32, 10, 10), dt, True))
        with cupy.cuda.Device(0), cd.on_own_gpu():
            _call("bwd-weight", *operands(), 1, 1, 1)
            x, w, dy = operands()
            named = {"x": x, "w": w, "dy": dy}
            fake.log.clear()
            got = _call("bwd-weight", x, w, dy, 1, 1, 1)
            replayed = _masked(fake.log, named)
            direct_cache.clear()
            fake.log.clear()
            _call("bwd-weight", x, w, dy, 1, 1, 1)
            full = _masked(fake.log, named)
    gemms = [e for e in full if e[0] == "gemm"]
    assert replayed == full and len(gemms) == 9 and all(g[20] == 1 for g in gemms)  # a GEMM per kernel tap
    assert got.shape == (32, 16, 3, 3) and got.dtype == dt
