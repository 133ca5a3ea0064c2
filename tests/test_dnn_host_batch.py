"""blasx.dnn.host_batch: the plan by exact value, the route's choice, and the chunked run on the CPU stand-in
for CuPy (its copies real, the chunk's convolution done by CPU torch in the test's body) against torch on the
whole batch; errors stop the run and leave the slots reusable."""

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bench import fake_cupy  # noqa: E402
from blasx.dnn import conv_direct, direct_cache, host_batch  # noqa: E402
from blasx.dnn.geometry import conv_geometry, layout  # noqa: E402
from blasx.runtime import hostmem  # noqa: E402

MB = 1 << 20


def test_plan_by_exact_value():
    # 2 MB images, 2 GPUs: 2 slots x 4 chunks each -> 16 chunks of 32 (each 64 MB: within both bounds)
    assert host_batch.plan(512, 2_000_000, 2) == [(i, i + 32) for i in range(0, 512, 32)]
    # 800 kB images: chunks of at least 32 MiB (42 images) -> 12 chunks (6 a GPU) of 43 (the last 39)
    assert host_batch.plan(512, 800_000, 2) == [(i, min(512, i + 43)) for i in range(0, 512, 43)]
    # ... on one GPU, 43 of them: one chunk (a second would be under 32 MiB)
    assert host_batch.plan(43, 800_000, 1) == [(0, 43)]
    # 100 kB images: at least 336 images a chunk, but every GPU gets one -> 2 chunks of 256
    assert host_batch.plan(512, 100_000, 2) == [(0, 256), (256, 512)]
    # tiny images: one chunk a GPU
    assert host_batch.plan(7, 10, 1) == [(0, 7)]
    assert host_batch.plan(10, 10, 2) == [(0, 5), (5, 10)]
    assert host_batch.plan(3, 10, 2) == [(0, 2), (2, 3)]
    # 16 MiB images: at most 4 a chunk (64 MiB)
    assert host_batch.plan(512, 16 * MB, 2) == [(i, i + 4) for i in range(0, 512, 4)]
    # larger than a chunk: one image a chunk
    assert host_batch.plan(5, 100 * MB, 1) == [(i, i + 1) for i in range(5)]
    assert host_batch.plan(0, 10, 2) == []
    spans = host_batch.plan(1000, 1_234_567, 3)
    assert spans[0][0] == 0 and spans[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert len({hi - lo for lo, hi in spans[:-1]}) == 1


def test_device_layout_by_exact_value():
    """conv_direct.device_layout: the layout a host batch's chunks (and CuPy operands) are convolved in."""
    geo = conv_geometry("conv2d", 2, np.zeros((8, 16, 9, 9)), np.zeros((32, 16, 3, 3)), 1, 1, 1, 1)
    assert conv_direct.device_layout("nchw", geo, np.float32) == "cl"
    assert conv_direct.device_layout("nchw", geo, np.float16) == "cl"
    assert conv_direct.device_layout("cl", geo, np.float16) == "cl"
    assert conv_direct.device_layout("nchw", geo, np.float64) == "nchw"  # no channels-last forms measured faster
    grouped = conv_geometry("conv2d", 2, np.zeros((8, 16, 9, 9)), np.zeros((32, 8, 3, 3)), 1, 1, 1, 2)
    assert conv_direct.device_layout("nchw", grouped, np.float32) == "nchw"
    pointwise = conv_geometry("conv2d", 2, np.zeros((8, 16, 12, 12)), np.zeros((32, 16, 1, 1)), 1, 0, 1, 1)
    assert conv_direct.device_layout("nchw", pointwise, np.float16) == "nchw"  # a GEMM on x where it lies
    strided = conv_geometry("conv2d", 2, np.zeros((8, 16, 24, 24)), np.zeros((32, 16, 1, 1)), 2, 0, 1, 1)
    assert conv_direct.device_layout("nchw", strided, np.float16) == "nchw"  # gathers the strided pixels only
    small = conv_geometry("conv2d", 2, np.zeros((8, 16, 7, 7)), np.zeros((32, 16, 1, 1)), 1, 0, 1, 1)
    assert conv_direct.device_layout("nchw", small, np.float16) == "cl"  # 49-pixel GEMMs an image: one GEMM in CL
    small = conv_geometry("conv2d", 2, np.zeros((8, 16, 14, 14)), np.zeros((32, 16, 1, 1)), 2, 0, 1, 1)
    assert conv_direct.device_layout("nchw", small, np.float16) == "cl"
    from blasx.dnn.geometry import transpose_geometry  # a strided 1x1's backward-data: col2im over zero insertion
    down = transpose_geometry("t", 2, np.zeros((8, 32, 7, 7)), np.zeros((32, 16, 1, 1)), 2, 0, 1, 1, 1)
    assert down.out_size == (14, 14) and conv_direct.device_layout("nchw", down, np.float16) == "cl"  # 196 px
    down = transpose_geometry("t", 2, np.zeros((8, 32, 14, 14)), np.zeros((32, 16, 1, 1)), 2, 0, 1, 1, 1)
    assert conv_direct.device_layout("nchw", down, np.float16) == "nchw"  # 28 x 28
    one_d = conv_geometry("conv1d", 1, np.zeros((8, 16, 9)), np.zeros((32, 16, 3)), 1, 1, 1, 1)
    assert conv_direct.device_layout("nchw", one_d, np.float32) == "nchw"
    for x, w in (((8, 1, 9, 9), (32, 1, 3, 3)), ((8, 3, 9, 9), (32, 3, 7, 7)), ((8, 16, 9, 9), (1, 16, 3, 3)),
                 ((8, 16, 3, 3), (4, 16, 3, 3)), ((8, 64, 9, 9), (3, 64, 3, 3))):
        # a first layer's few channels (or its backward-data: three output channels); one output channel or pixel
        geo = conv_geometry("conv2d", 2, np.zeros(x), np.zeros(w), 1, 0, 1, 1)
        assert conv_direct.device_layout("nchw", geo, np.float32) == "nchw"


@pytest.mark.parametrize("size,kern,dtype,want", [
    (7, 1, np.float16, "nchw"), (14, 1, np.float32, "nchw"),  # a 1x1's weight gradient stays where it lies
    (7, 3, np.float16, "cl"), (12, 3, np.float16, "cl"),  # 2-byte: any window
    (7, 3, np.float32, "nchw"), (14, 3, np.float32, "cl")])  # 49 / 196 output pixels (4-byte: from 128)
def test_device_layout_of_a_weight_gradient(size, kern, dtype, want):
    geo = conv_geometry("conv2d", 2, np.zeros((8, 64, size, size)), np.zeros((64, 64, kern, kern)), 1, kern // 2,
                        1, 1)
    assert conv_direct.device_layout("nchw", geo, dtype, "bwd-weight") == want
    assert conv_direct.device_layout("nchw", geo, dtype) == ("nchw" if kern == 1 and size > 7 else "cl")


def test_applies(monkeypatch):
    x = np.zeros((4, 3, 8, 8), np.float32)
    monkeypatch.setattr(host_batch, "gpus", lambda: ())
    assert not host_batch.applies(x, 1000)
    monkeypatch.setattr(host_batch, "gpus", lambda: (0, 1))
    assert host_batch.applies(x, 1000)
    assert not host_batch.applies(x, host_batch.CHUNK_BYTES + 1)
    monkeypatch.setattr(conv_direct, "ROUTE", "engine")
    assert not host_batch.applies(x, 1000)


def _cl(a):
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


def _body(stride, padding, calls, fail_at=None, layouts=None):
    """A chunk's convolution by CPU torch, written into the slot's device array (host memory here);
    ``layouts`` collects the layouts the chunks' x, y and residual came in."""
    lock = threading.Lock()

    def body(xd, wd, yd, rd):
        with lock:
            calls.append(xd.shape[0])
            if layouts is not None:
                layouts.add(tuple(layout(a) for a in (xd, yd, rd) if a is not None))
            if fail_at is not None and len(calls) == fail_at:
                raise RuntimeError("chunk failed")
        x = torch.from_numpy(np.asarray(xd).view(np.ndarray).copy())
        w = torch.from_numpy(np.asarray(wd).view(np.ndarray).copy())
        y = torch.nn.functional.conv2d(x, w, None, stride, padding).numpy()
        if rd is not None:
            y = y + np.asarray(rd).view(np.ndarray)
        np.copyto(yd.view(np.ndarray), y)
    return body


@pytest.mark.parametrize("lay,dlay", [("nchw", None), ("cl", None), ("nchw", "cl")])
@pytest.mark.parametrize("devices", [(0,), (0, 1)])
@pytest.mark.parametrize("pinned", [False, True])
def test_run_matches_torch(monkeypatch, lay, dlay, devices, pinned):
    """Every chunk convolved in the device layout (an NCHW batch converted to channels-last on the device and
    back), the result in the batch's own layout, the caller's arrays untouched."""
    monkeypatch.setattr(host_batch, "MIN_CHUNK_BYTES", 1)  # small chunks: several on every slot
    rng = np.random.default_rng(1)
    x = rng.standard_normal((13, 8, 9, 9)).astype(np.float32)
    w = rng.standard_normal((6, 8, 3, 3)).astype(np.float32)
    res = rng.standard_normal((13, 6, 5, 5)).astype(np.float32)
    if lay == "cl":
        x, res = _cl(x), _cl(res)
    want = torch.nn.functional.conv2d(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(w), None,
                                      2, 1).numpy() + res
    x0, res0, w0 = x.copy(), res.copy(), w.copy()
    if pinned:  # the caller's memory page-locked: copied from and into as it is
        monkeypatch.setattr(host_batch, "pinnings", lambda arrays, min_bytes=None: (
            [None if a is None else hostmem.Pinning.whole(a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays],
            None))
    with fake_cupy.installed(copies=True):
        host_batch.release()
        y = host_batch.in_layout(np.full(13 * 6 * 25, np.nan, np.float32), (13, 6, 5, 5), lay)
        calls, layouts = [], set()
        host_batch.run(host_batch.Batch(x, y, res, lay, dlay), w, _body(2, 1, calls, layouts=layouts), devices)
        host_batch.release()
    assert layouts == {((dlay or lay),) * 3}
    assert sorted(calls) == sorted(hi - lo for lo, hi in host_batch.plan(13, 4 * (8 * 81 + 2 * 6 * 25), len(devices)))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert host_batch.memory_bytes(y, lay).size == y.nbytes  # y kept its layout
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(res, res0)
    np.testing.assert_array_equal(w, w0)


def test_an_error_stops_the_run_and_slots_stay_usable(monkeypatch):
    monkeypatch.setattr(host_batch, "MIN_CHUNK_BYTES", 1)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((32, 4, 6, 6)).astype(np.float32)
    w = rng.standard_normal((4, 4, 3, 3)).astype(np.float32)
    with fake_cupy.installed(copies=True):
        host_batch.release()
        y = np.zeros((32, 4, 4, 4), np.float32)
        calls = []
        with pytest.raises(RuntimeError, match="chunk failed"):
            host_batch.run(host_batch.Batch(x, y, None, "nchw"), w, _body(1, 0, calls, fail_at=3), (0, 1))
        assert len(calls) < len(host_batch.plan(32, 4 * (144 + 64), 2))  # the others stopped taking chunks
        idle = sum(len(v) for v in host_batch._IDLE.values())
        assert idle == 2 * host_batch.SLOTS  # every slot given back
        calls = []
        host_batch.run(host_batch.Batch(x, y, None, "nchw"), w, _body(1, 0, calls), (0, 1))
        assert sum(len(v) for v in host_batch._IDLE.values()) == idle  # reused, none made
        host_batch.release()
    want = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w)).numpy()
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_empty_is_page_locked_in_its_layout():
    with fake_cupy.installed():
        y = host_batch.empty((3, 5, 4, 4), np.float16, "cl")
        assert y.shape == (3, 5, 4, 4) and y.dtype == np.float16
        assert host_batch.memory_bytes(y, "cl").size == y.nbytes
        assert isinstance(hostmem.root_of(y).base, (bytearray, memoryview))  # the stand-in's pinned memory
        z = host_batch.empty((2, 3, 4), np.float32, "nchw")
        assert z.flags.c_contiguous and z.shape == (2, 3, 4)


def test_conv2d_on_numpy_takes_the_route(monkeypatch):
    """conv2d of a host batch with GPUs configured: one memcpy in and one out per chunk, the weight uploaded
    once per GPU, the chunks' convolutions on the device route (launches recorded)."""
    import blasx.dnn as dnn
    monkeypatch.setattr(host_batch, "gpus", lambda: (0, 1))
    x = np.zeros((16, 64, 8, 8), np.float16)
    w = np.zeros((64, 64, 3, 3), np.float16)
    with fake_cupy.installed(record_calls=True) as fake:
        host_batch.release()
        y = dnn.conv2d(x, w, padding=1, activation="relu")
        host_batch.release()
        copies = [e for e in fake.log if e[0] == "memcpy"]
    spans = host_batch.plan(16, 2 * 2 * 64 * 64, 2)
    assert y.shape == (16, 64, 8, 8) and y.dtype == np.float16
    assert sorted(e[1] for e in copies if e[2] == 1) == sorted([w.nbytes] * 2 + [2 * 64 * 64 * (hi - lo)
                                                                                 for lo, hi in spans])
    assert sorted(e[1] for e in copies if e[2] == 2) == sorted(2 * 64 * 64 * (hi - lo) for lo, hi in spans)


@pytest.mark.parametrize("view", ["channels-last", "strided"])
def test_an_unbatched_out_not_compact_in_xs_layout_is_written(monkeypatch, view):
    """An unbatched call's ``out`` in another layout than x's (a channels-last image, or every other column of a
    wider buffer) gets the route's result through a buffer; its columns outside the view stay untouched."""
    import blasx.dnn as dnn
    from blasx.dnn import conv
    monkeypatch.setattr(host_batch, "gpus", lambda: (0,))

    def forward(fn, geo, xd, lay, wd, yd, rd, *rest, **kwargs):  # (the chunk's convolution by CPU torch)
        x = torch.from_numpy(np.ascontiguousarray(np.asarray(xd).view(np.ndarray)))
        w = torch.from_numpy(np.ascontiguousarray(np.asarray(wd).view(np.ndarray)))
        np.copyto(yd.view(np.ndarray), torch.nn.functional.conv2d(x, w).numpy())
    monkeypatch.setattr(conv, "_forward_call", forward)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 9, 9)).astype(np.float32)
    w = rng.standard_normal((6, 8, 3, 3)).astype(np.float32)
    if view == "channels-last":
        buf = np.full((7, 7, 6), np.nan, np.float32)
        out = buf.transpose(2, 0, 1)
    else:
        buf = np.full((6, 7, 14), np.nan, np.float32)
        out = buf[:, :, ::2]
    with fake_cupy.installed(copies=True):
        host_batch.release()
        got = dnn.conv2d(x, w, out=out)
        host_batch.release()
    want = torch.nn.functional.conv2d(torch.from_numpy(x[None]), torch.from_numpy(w)).numpy()[0]
    assert got is out and np.allclose(out, want, rtol=1e-5, atol=1e-5)
    assert view == "channels-last" or np.isnan(buf[:, :, 1::2]).all()


def test_an_interrupt_before_the_chunks_still_joins_the_registrations(monkeypatch):
    """Ctrl-C while the call takes its slots (on a first call: making the CUDA contexts), after x's and y's
    registrations started: run raises only once no registration thread is left (none outlives the call)."""
    import time
    monkeypatch.setattr(host_batch, "gpus", lambda: (0,))
    x = np.ones((64, 1024, 1024), np.uint8)  # (64 MiB each: registered in place)
    y = np.zeros((64, 1024, 1024), np.uint8)
    w = np.ones((1, 1024, 1, 1), np.uint8)
    with fake_cupy.installed(copies=True) as fake:
        rt = fake.cupy.cuda.runtime
        rt.CUDARuntimeError = RuntimeError
        rt.pointerGetAttributes = lambda p: (_ for _ in ()).throw(RuntimeError("pageable"))
        rt.hostRegister = lambda p, n, f: time.sleep(0.05)
        rt.hostUnregister = lambda p: None

        def interrupted(device, count):
            raise KeyboardInterrupt
        monkeypatch.setattr(host_batch, "take", interrupted)
        with pytest.raises(KeyboardInterrupt):
            host_batch.run(host_batch.Batch(x, y, None, "nchw"), w, lambda *a: None, (0,))
        assert not [t for t in threading.enumerate() if t.name == "blasx-pin"]
        from blasx.runtime import hostmem
        hostmem.REGISTRY.release(x)
        hostmem.REGISTRY.release(y)


def test_a_slot_is_settled_through_a_ctrl_c():
    """Cleanup after an error: a Ctrl-C while waiting for a slot's stream is held back and the wait done again
    (its page-locked buffers may still be in flight), the slot then reusable and the interrupt raised after."""
    from types import SimpleNamespace as NS
    calls = []

    def synchronize():
        calls.append("sync")
        if len(calls) == 1:
            raise KeyboardInterrupt
    slot = NS(stream=NS(synchronize=synchronize), drain=lambda: calls.append("drain"))
    usable, exc = host_batch._settle(slot)
    assert usable and isinstance(exc, KeyboardInterrupt) and calls == ["sync", "sync", "drain"]
    broken = NS(stream=NS(synchronize=lambda: (_ for _ in ()).throw(RuntimeError("device lost"))), drain=None)
    usable, exc = host_batch._settle(broken)
    assert not usable and isinstance(exc, RuntimeError)


def test_host_bytes_are_never_a_copy():
    """memory_bytes refuses an array not compact in the layout (its bytes would be a copy, taking the writes)."""
    a = np.zeros((2, 3, 4, 5), np.float32)
    assert np.shares_memory(host_batch.memory_bytes(a, "nchw"), a)
    with pytest.raises(RuntimeError, match="not compact"):
        host_batch.memory_bytes(a, "cl")


def test_calls_from_several_threads_keep_their_own_slots(monkeypatch, in_threads):
    """Four threads' runs at once: each gets slots of its own (never another call's buffers) and its own result."""
    monkeypatch.setattr(host_batch, "MIN_CHUNK_BYTES", 1)
    rng = np.random.default_rng(3)
    cases = [(rng.standard_normal((9, 4, 7, 7)).astype(np.float32),
              rng.standard_normal((5, 4, 3, 3)).astype(np.float32)) for _ in range(4)]
    outs = [np.full((9, 5, 5, 5), np.nan, np.float32) for _ in cases]
    with fake_cupy.installed(copies=True):
        host_batch.release()

        def call(i):
            for _ in range(3):
                x, w = cases[i]
                host_batch.run(host_batch.Batch(x, outs[i], None, "nchw"), w, _body(1, 0, []), (0, 1))
        in_threads(call, 4)
        host_batch.release()
    for (x, w), y in zip(cases, outs):
        want = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w)).numpy()
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("direction,copies", [("fwd", 2), ("bwd-data", 2), ("bwd-weight", 3)])
@pytest.mark.parametrize("kern,want", [(3, "cl"), (1, "nchw")])  # (144 pixels: a 1x1 stays)
def test_cupy_nchw_operands_are_convolved_in_the_device_layout(kern, want, direction, copies):
    """NCHW CuPy operands of a 3x3 run channels-last: the inputs copied in (x, or dY, or both), the result copied
    back into the caller's layout (y, dX, or dW as KCRS), the replay making the same copies; a pointwise
    call runs on its operands where they lie."""
    import blasx.dnn as dnn
    from blasx.dnn import direct_cache
    with fake_cupy.installed(record_calls=True) as fake:
        direct_cache.clear()
        cupy = fake.cupy
        with cupy.cuda.Device(0), conv_direct.on_own_gpu():
            x, w = cupy.empty((4, 64, 12, 12), dtype=np.float16), cupy.empty((32, 64, kern, kern), dtype=np.float16)
            dy = cupy.empty((4, 32, 12, 12), dtype=np.float16)
            call = {"fwd": lambda: dnn.conv2d(x, w, padding=kern // 2),
                    "bwd-data": lambda: dnn.conv2d_input(x.shape, w, dy, padding=kern // 2),
                    "bwd-weight": lambda: dnn.conv2d_weight(x, w.shape, dy, padding=kern // 2)}[direction]
            logs, outs = [], []
            for _ in range(2):  # the full path, then its replay
                fake.log.clear()
                outs.append(call())
                logs.append([e for e in fake.log if e[0] == "raw_kernel" and e[1].startswith("blasx_transpose_")])
        direct_cache.clear()
    assert [len(g) for g in logs] == [copies if want == "cl" else 0] * 2
    assert all(o.flags.c_contiguous for o in outs)  # the caller's layout
    assert outs[0].shape == outs[1].shape == (w.shape if direction == "bwd-weight" else x.shape if direction ==
                                              "bwd-data" else dy.shape)


def test_an_nchw_pointwise_weight_gradient_runs_the_batched_form():
    """NCHW CuPy operands of a 1x1 on 28x28 maps: dW by the batched form, no copy of x or dY (no transpose, no
    gather), two GEMMs (every image's partial dW, then their sum), the replay issuing the same two."""
    import blasx.dnn as dnn
    from blasx.dnn import direct_cache
    with fake_cupy.installed(record_calls=True) as fake:
        direct_cache.clear()
        cupy = fake.cupy
        with cupy.cuda.Device(0), conv_direct.on_own_gpu():
            x, dy = cupy.empty((4, 64, 28, 28), dtype=np.float16), cupy.empty((4, 32, 28, 28), dtype=np.float16)
            logs = []
            for _ in range(2):  # the full path, then its replay
                fake.log.clear()
                dw = dnn.conv2d_weight(x, (32, 64, 1, 1), dy)
                logs.append([e for e in fake.log if e[0] in ("gemm", "raw_kernel", "kernel")])
        direct_cache.clear()
    assert dw.shape == (32, 64, 1, 1)
    for log in logs:
        gemms = [e[3:6] for e in log if e[0] == "gemm"]
        assert gemms == [(64, 32, 784), (64 * 32, 1, 4)]
        assert not any(e[0] == "raw_kernel" and e[1].startswith(("blasx_transpose_", "blasx_gather")) for e in log)


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (3, 40, 33, 2), (1, 64, 1, 70), (2, 5, 4, 3, 3)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_transpose_kernel_geometry(shape, dtype):
    """transpose_kernel by exact value: the matrices of both directions, a grid that covers every tile, and (on
    the stand-in, which makes the copy) both directions against numpy."""
    from blasx.dnn import transpose_kernel as tk
    n, c, p = shape[0], shape[1], int(np.prod(shape[2:]))
    assert tk.matrices(shape, True) == (n, c, p) and tk.matrices(shape, False) == (n, p, c)
    gx, gy, _ = tk.grid(n, c, p)
    assert gx == -(-c // tk.TILE) * -(-p // tk.TILE) and gy == n
    assert tk.grid(10 ** 6, 1, 1)[1] == tk.MAX_BATCH_BLOCKS  # more images loop
    assert tk.paired_grid(n, c, p)[0] == -(-c // 64) * -(-p // 64)
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    with fake_cupy.installed(copies=True):
        import cupy
        xd = cupy.empty(shape, dtype=dtype)
        np.asarray(xd).view(np.ndarray)[...] = x
        cl = host_batch.in_layout(cupy.empty(xd.size, dtype=dtype), shape, "cl")
        tk.copy(cl, xd, True)
        back = cupy.empty(shape, dtype=dtype)
        tk.copy(back, cl, False)
        np.testing.assert_array_equal(np.asarray(cl).view(np.ndarray), x)
        assert layout(cl) == "cl"
        np.testing.assert_array_equal(np.asarray(back).view(np.ndarray), x)


def test_the_paired_transpose_takes_even_two_byte_copies_on_four_byte_boundaries(monkeypatch):
    from blasx.dnn import transpose_kernel as tk
    monkeypatch.setattr(tk, "PAIRED", False)
    assert not tk.paired(2, 4, 6, (0, 256))  # off unless PAIRED
    monkeypatch.setattr(tk, "PAIRED", True)
    assert tk.paired(2, 4, 6, (0, 256))
    assert not tk.paired(4, 4, 6, (0, 256)) and not tk.paired(2, 3, 6, (0, 256)) and not tk.paired(2, 4, 5, (0, 256))
    assert not tk.paired(2, 4, 6, (2, 256))
    shape = (3, 40, 6, 11)  # P = 66: paired both ways; the stand-in makes the copy by the kernels' argument order
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float16)
    with fake_cupy.installed(copies=True, record_calls=True) as fake:
        import cupy
        xd = cupy.empty(shape, dtype=np.float16)
        np.asarray(xd).view(np.ndarray)[...] = x
        cl = host_batch.in_layout(cupy.empty(xd.size, dtype=np.float16), shape, "cl")
        tk.copy(cl, xd, True)
        names = [e[1] for e in fake.log if e[0] == "raw_kernel"]
        np.testing.assert_array_equal(np.asarray(cl).view(np.ndarray), x)
    assert names == ["blasx_transpose_pair16"]


def test_the_vector_transpose_takes_whole_vectors_on_sixteen_byte_boundaries(monkeypatch):
    from blasx.dnn import transpose_kernel as tk
    assert tk.vectored(2, 8, 16, (0, 256)) and tk.vectored(4, 4, 12, (0, 256))
    assert not tk.vectored(2, 4, 16, (0, 256)) and not tk.vectored(4, 6, 12, (0, 256))  # part of a vector
    assert not tk.vectored(8, 8, 8, (0, 256)) and not tk.vectored(1, 16, 16, (0, 256))  # other sizes
    assert not tk.vectored(2, 8, 16, (8, 256))
    monkeypatch.setattr(tk, "VECTOR", False)
    assert not tk.vectored(2, 8, 16, (0, 256))
    assert tk.vector_grid(3, 130, 64, 2) == (3 * 1, 3, 1) and tk.vector_grid(3, 130, 64, 4) == (5 * 2, 3, 1)
    code, name = tk.vector_source(2)
    assert name == "blasx_transpose_v16" and "const int E = 8; const int T = 64;" in code


def test_nchw_operands_stay_where_their_copies_would_not_fit(monkeypatch):
    """conv_direct.run_layout: channels-last only where the copies fit the scratch budget (free memory / 4)."""
    from blasx.dnn import direct_cache, direct_cuda
    geo = conv_geometry("conv2d", 2, np.zeros((8, 16, 9, 9)), np.zeros((32, 16, 3, 3)), 1, 1, 1, 1)
    reads = []
    monkeypatch.setattr(direct_cuda, "budget", lambda refresh=False: reads.append(refresh) or 1000)
    assert conv_direct.run_layout("nchw", geo, np.float16, 1000) == "cl"
    assert conv_direct.run_layout("nchw", geo, np.float16, 1001) == "nchw"
    assert conv_direct.run_layout("cl", geo, np.float16, 10 ** 9) == "cl"
    assert reads == [True, True]  # free memory read again (the layout already channels-last: nothing to copy)
    with direct_cache.capturing([]):
        assert conv_direct.run_layout("nchw", geo, np.float16, 1000) == "cl"
    assert reads[-1] is False  # inside a graph capture: the last reading


@pytest.mark.parametrize("lay", ["nchw", "cl"])
def test_a_one_shot_batch_is_registered_and_the_chunks_read_it_in_place(monkeypatch, lay):
    """A batch blasx has not seen (large enough to pin) is registered in place, never staged into a pool
    buffer (measured slower), and every chunk's copy to the device reads x where it lies (the result right);
    seen again, the registration is reused."""
    from blasx.runtime import hostmem, hostpool
    monkeypatch.setattr(host_batch, "MIN_CHUNK_BYTES", 1)
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 14)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 1 << 13)
    monkeypatch.setattr(hostmem, "REGISTRY", hostmem.RegistrationCache())
    staged = []
    monkeypatch.setattr(hostpool, "stage_buffer", lambda nbytes: staged.append(nbytes))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((13, 8, 9, 9)).astype(np.float32)  # 33 KB: four 8 KiB chunks
    w = rng.standard_normal((6, 8, 3, 3)).astype(np.float32)
    if lay == "cl":
        x = _cl(x)
    want = torch.nn.functional.conv2d(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(w), None,
                                      2, 1).numpy()
    registered = []
    with fake_cupy.installed(copies=True, record_calls=True):
        import cupy
        rt = cupy.cuda.runtime
        rt.CUDARuntimeError = RuntimeError
        rt.hostRegister = lambda start, size, flags: registered.append((start, size))
        rt.hostUnregister = lambda start: None
        sources = []
        copy = rt.memcpyAsync
        monkeypatch.setattr(rt, "memcpyAsync", lambda d, s, n, k, st: (sources.append((s, n, k)), copy(d, s, n, k, st)))
        for _ in range(2):
            host_batch.release()
            sources.clear()
            y = host_batch.in_layout(np.full(13 * 6 * 25, np.nan, np.float32), (13, 6, 5, 5), lay)
            host_batch.run(host_batch.Batch(x, y, None, lay), w, _body(2, 1, []), (0, 1))
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
            x_reads = [(s, n) for s, n, k in sources if k == 1 and n != w.nbytes]
            assert x_reads and all(x.ctypes.data <= s and s + n <= x.ctypes.data + x.nbytes for s, n in x_reads)
        host_batch.release()
        hostmem.REGISTRY.release(x)
    assert not staged
    lo, hi = x.ctypes.data, x.ctypes.data + x.nbytes
    x_regs = [(a, n) for a, n in registered if a < hi and a + n > lo]
    assert x_regs and sum(n for _, n in x_regs) <= x.nbytes + 2 * 4096  # registered once (page-rounded)


def _graph_counts():
    """{key: (eager, replays, failures)} over the idle slots' graphs."""
    return {(s.device, k): (g.eager, g.replays, g.fails) for slots in host_batch._IDLE.values() for s in slots
            for k, g in s.graphs.items()}


def _pinned_everywhere(monkeypatch):
    monkeypatch.setattr(host_batch, "gpus", lambda: (0, 1))
    monkeypatch.setattr(host_batch, "pinnings", lambda arrays, min_bytes=None: (
        [None if a is None else hostmem.Pinning.whole(a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays],
        None))


def test_conv_chunks_replay_graphs_across_calls_and_new_epilogue_values_get_their_own(monkeypatch):
    """conv2d of a host batch: a key's first chunk eager, the next captured and replayed, and later calls of the
    same layer replay (one graph launch a chunk); a new bias is a new key; off (GRAPHS), nothing is captured."""
    import blasx.dnn as dnn
    _pinned_everywhere(monkeypatch)
    x = np.zeros((16, 64, 8, 8), np.float16)
    w = np.zeros((64, 64, 3, 3), np.float16)
    with fake_cupy.installed():
        host_batch.release()
        for _ in range(3):
            dnn.conv2d(x, w, padding=1)
        counts = _graph_counts()
        assert len(counts) == 2 and all(c == (1, 2, 0) for c in counts.values())  # one chunk a GPU a call
        dnn.conv2d(x, w, np.ones(64, np.float32), padding=1, activation="relu")
        assert len(_graph_counts()) == 4
        dnn.conv2d(x, w, np.ones(64, np.float32), padding=1, activation="relu")
        assert sorted(_graph_counts().values()) == [(1, 1, 0)] * 2 + [(1, 2, 0)] * 2  # (captured, then replayed)
        host_batch.release()
        monkeypatch.setattr(host_batch, "GRAPHS", False)
        dnn.conv2d(x, w, padding=1)
        dnn.conv2d(x, w, padding=1)
        assert _graph_counts() == {}
        host_batch.release()


def test_a_scale_with_a_residual_is_never_captured(monkeypatch):
    """Its two passes judge overflow on the host: the body names no key, so its chunks run eagerly."""
    import blasx.dnn as dnn
    _pinned_everywhere(monkeypatch)
    keys = []
    run = host_batch.run
    monkeypatch.setattr(host_batch, "run", lambda *a, body_key=None, **k: (keys.append(body_key), run(*a, **k)))
    x = np.zeros((16, 8, 8, 8), np.float32)
    w = np.zeros((8, 8, 3, 3), np.float32)
    with fake_cupy.installed():
        dnn.conv2d(x, w, padding=1, scale=np.ones(8), residual=np.zeros((16, 8, 8, 8), np.float32))
        dnn.conv2d(x, w, padding=1, scale=np.ones(8))
        host_batch.release()
    assert keys[0] is None and keys[1] is not None


def test_a_slot_drops_its_least_recent_graph_after_synchronizing(monkeypatch):
    """Beyond GRAPHS_KEPT keys a slot drops a graph only once its stream is synchronized (it may be in flight)."""
    monkeypatch.setattr(host_batch, "GRAPHS_KEPT", 2)
    with fake_cupy.installed(record_calls=True) as fake:
        s = host_batch.Slot(0)
        ran = []
        for key in ("a", "a", "a", "b", "b", "c"):
            s.compute(lambda k=key: ran.append(k), key)
        assert list(s.graphs) == ["b", "c"]
        assert [e for e in fake.log if e[0] == "synchronize"] == [("synchronize", s.stream.ptr)]
        assert s.graphs["b"].graph is not None and s.graphs["c"].eager == 1


def test_an_interrupted_capture_is_ended_and_the_interrupt_raised():
    """A Ctrl-C inside a capture ends the capture (the stream usable) and is raised as it is."""
    from blasx.dnn import chunk_graph

    def forward():
        raise KeyboardInterrupt
    with fake_cupy.installed() as fake:
        stream = fake.cupy.cuda.Stream(non_blocking=True)
        g = chunk_graph.ChunkGraph()
        with pytest.raises(KeyboardInterrupt):
            g.capture(fake.cupy, stream, forward)
        assert not stream.is_capturing() and g.graph is None


def test_weights_in_graph_makes_every_transform_anew():
    """Inside weights_in_graph a Workspace never hands out a kept transform: made each time, kept by the capture."""
    from blasx.dnn import direct_cache
    ws = direct_cache.Workspace()
    w = np.zeros(4)
    made = []
    assert ws.derived(w, "t", lambda: made.append(1) or "kept") == "kept"
    keep = []
    with direct_cache.capturing(keep), direct_cache.weights_in_graph():
        assert ws.derived(w, "t", lambda: made.append(2) or "fresh") == "fresh"
    assert made == [1, 2] and keep == ["fresh"] and ws.derived(w, "t", lambda: "again") == "kept"


def test_slots_come_back_in_the_same_roles_call_after_call():
    """take gives a device's idle slots in the order give_back left them: chunk k meets the same slot (its
    graphs, and the first slot's weight buffer) call after call."""
    with fake_cupy.installed():
        host_batch.release()
        first = host_batch.take(0, 2)
        host_batch.give_back(first)
        for _ in range(3):
            again = host_batch.take(0, 2)
            assert again == first
            host_batch.give_back(again)
        assert host_batch.take(0, 1) == first[:1]
        host_batch.release()


def test_graphs_holding_a_replaced_scratch_buffer_are_dropped_at_the_next_capture():
    """A slot's Workspace grows a scratch buffer for a larger chunk: graphs still holding the old one are dropped
    (after the stream is synchronized) when the slot next captures, so they do not keep old buffers alive."""
    with fake_cupy.installed(record_calls=True) as fake:
        s = host_batch.Slot(0)

        def seg(n):
            return lambda: s.device_array("xc", (n, 4), np.float32, "nchw")
        with direct_cache.using(s.workspace):
            for key, n in (("a", 10), ("a", 10), ("b", 20)):
                s.compute(seg(n), key)
            assert s.graphs["a"].graph is not None and len(s.graphs["a"].buffers) == 1
            fake.log.clear()
            s.compute(seg(20), "b")  # captured: "a" holds the 10-row buffer the Workspace replaced
        assert list(s.graphs) == ["b"] and s.graphs["b"].graph is not None
        assert [e for e in fake.log if e[0] == "synchronize"] == [("synchronize", s.stream.ptr)]


def test_a_chunk_key_holds_the_batch_layout(monkeypatch):
    """Channels-last and NCHW batches of one layer convolve in one device layout on slot buffers at the same
    addresses, but only NCHW chunks have layout copies around the body: they never share a graph."""
    import blasx.dnn as dnn
    _pinned_everywhere(monkeypatch)
    monkeypatch.setattr(host_batch, "gpus", lambda: (0,))
    x = np.zeros((16, 64, 8, 8), np.float16)
    xcl = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    w = np.zeros((64, 64, 3, 3), np.float16)
    with fake_cupy.installed():
        host_batch.release()
        dnn.conv2d(xcl, w, padding=1)
        dnn.conv2d(xcl, w, padding=1)
        dnn.conv2d(x, w, padding=1)
        assert sorted(_graph_counts().values()) == [(1, 0, 0), (1, 1, 0)]  # the NCHW call ran eagerly
        host_batch.release()
