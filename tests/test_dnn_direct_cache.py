"""The device route's host-side caches (direct_cache.py, direct_cuda.py, conv.py's parses) on the CPU: a
cached plan is the uncached one, cache keys tell apart what they must (type, layout, beta, budget, math,
device, stream, activation), and with the CPU stand-in for CuPy (bench/fake_cupy.py) a conv2d call
launches the same kernels and GEMMs, with the same arguments, from cold caches and from warm ones."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from bench import fake_cupy
from blasx import dnn
from blasx.dnn import gather_kernel as gk
from blasx.dnn import conv as conv_mod
from blasx.dnn import conv_direct as cd
from blasx.dnn import cublas_call, direct_cache, direct_cuda, direct_epilogue
from blasx.dnn.geometry import conv_geometry, transpose_geometry
from blasx.runtime import dtypes


@pytest.fixture(autouse=True)
def fresh():
    direct_cache.clear()
    yield
    direct_cache.clear()


def _geos():
    x = np.empty((4, 64, 14, 12))
    out = [conv_geometry("conv2d", 2, x, np.empty((32, 64, 3, 3)), 1, 1, 1, 1),  # shifted where chosen
           conv_geometry("conv2d", 2, x, np.empty((32, 64, 1, 1)), 1, 0, 1, 1),  # pointwise
           conv_geometry("conv2d", 2, x, np.empty((32, 16, 3, 3)), 2, 1, 1, 4),  # strided, grouped
           transpose_geometry("conv_transpose2d", 2, x, np.empty((64, 8, 4, 4)), 2, 1, 0, 1, 1)]
    return out


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("cl", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("budget", [1, 1 << 40])
def test_cached_plan_is_the_uncached_plan(dtype, cl, beta, budget):
    dt = np.dtype(dtype)
    for geo in _geos():
        got = direct_cuda.forward_plan(geo, cl, dt, beta, budget)
        form = cd.forward_form(geo, dt, cd.FORM, "cl" if cl else "nchw")
        form = "im2col" if form in ("implicit", "winograd") and beta else form  # (their kernels write y)
        steps, scratch = cd.forward_plan(geo, cl, dt, beta, budget, form)
        assert (got.form, got.steps, got.scratch) == (form, steps, scratch)
        assert direct_cuda.forward_plan(geo, cl, dt, beta, budget) is got  # kept
        x_size = geo.n * geo.c * int(np.prod(geo.in_size))
        for s, launch in zip(steps, got.launches):
            if isinstance(s, cd.Gather):
                # the widest unit that divides the group's channels, then each narrower one, then elements
                units = [u for u in direct_cuda.GATHER_UNITS if u > dt.itemsize and cd.widened(geo, cl, s, u // dt.itemsize)]
                chain = []
                while launch is not None:
                    chain.append(launch)
                    launch = launch.narrow
                assert [g.unit for g in chain] == units + [dt.itemsize]
                for g in chain:
                    v = g.unit // dt.itemsize
                    wgeo, ws = cd.widened(geo, cl, s, v) if v > 1 else (geo, s)
                    assert list(g.args) == [int(a) for a in cd.gather_args(wgeo, cl, ws)]
                    assert g.total * v == s.nb * geo.crs * geo.p and g.magic == gk.magic_args(g.args)
                    assert g.index == ("int32" if max(g.total, x_size // v) < 2**31 else "int64")
                    assert all(type(a) is int for a in g.args)  # packed into ctypes of the index type once
            elif isinstance(s, cd.Gemm):
                t = dtypes.CUDA_TYPE[dt]
                assert launch.a == (s.a[0], s.a[1] * dt.itemsize, t) and launch.c == (s.c[0], s.c[1] * dt.itemsize, t)
                assert launch.dims == (s.op_a, s.op_b, s.m, s.n, s.k) and launch.beta == s.beta
                assert launch.ldc == (s.ldc, s.stride_c, s.batch)
            else:
                assert launch is None


def test_plan_keys_tell_apart_type_layout_beta_budget_and_form(monkeypatch):
    geo = _geos()[0]
    base = direct_cuda.forward_plan(geo, False, np.float32, 0.0, 1 << 40)
    others = [direct_cuda.forward_plan(geo, True, np.float32, 0.0, 1 << 40),
              direct_cuda.forward_plan(geo, False, np.float16, 0.0, 1 << 40),
              direct_cuda.forward_plan(geo, False, np.float32, 1.0, 1 << 40),
              direct_cuda.forward_plan(geo, False, np.float32, 0.0, 1)]
    monkeypatch.setattr(cd, "FORM", "im2col" if base.form == "shifted" else "shifted")
    others.append(direct_cuda.forward_plan(geo, False, np.float32, 0.0, 1 << 40))
    assert all(o is not base for o in others)
    assert others[-1].form != base.form
    assert others[1].launches != base.launches  # the CUDA types differ


def test_a_find_db_entry_changes_the_cached_plan(monkeypatch):
    """The form is chosen per call (force, find-db, heuristic) and is part of the plan's key: a new find-db
    entry takes effect on the next call, not after the cache has forgotten the old plan."""
    from blasx.dnn import finddb
    geo = _geos()[0]
    assert cd.shifted_applies(geo)
    base = direct_cuda.forward_plan(geo, False, np.float32, 0.0, 1 << 40, "ieee")
    other = "im2col" if base.form == "shifted" else "shifted"
    monkeypatch.setattr(finddb, "stored_form", lambda *a, **k: other)
    got = direct_cuda.forward_plan(geo, False, np.float32, 0.0, 1 << 40, "ieee")
    assert got.form == other and got is not base


def test_gemm_constants_per_type_and_math():
    f32 = dtypes.gemm_of(np.float32)
    ieee, tf32 = direct_cuda.gemm_consts(np.float32, "ieee"), direct_cuda.gemm_consts(np.float32, "tf32")
    assert ieee[0] == dtypes.compute_type(f32, "ieee") and tf32[0] == dtypes.compute_type(f32, "tf32")
    f64 = direct_cuda.gemm_consts(np.float64, "ieee")
    assert f64[2][1.0].dtype == np.float64 and ieee[2][1.0].dtype == np.float32
    for consts in (ieee, f64):
        for beta, ptr in consts[1].items():
            assert ptr == consts[2][beta].ctypes.data and consts[2][beta][0] == beta


def test_parses_kept_but_checked_as_before():
    x, w = np.ones((1, 2, 5, 5)), np.ones((3, 2, 3, 3))
    a = conv_mod._geometry("conv2d", 2, x, w, 1, 1, 1, 1)
    assert a == conv_geometry("conv2d", 2, x, w, 1, 1, 1, 1)
    assert conv_mod._geometry("conv2d", 2, x, w, 1, 1, 1, 1) is a
    assert conv_mod._geometry("conv2d", 2, x, w, 2, 1, 1, 1) != a
    assert conv_mod._geometry("conv2d", 2, x.astype(np.float32), w.astype(np.float32), 1, 1, 1, 1) is not a
    with pytest.raises(ValueError, match="stride"):  # True == 1, but a bool is no stride
        dnn.conv2d(x, w, stride=True)
    with pytest.raises(ValueError, match="padding"):
        dnn.conv2d(x, w, padding=(1, -1))
    assert conv_mod._activation("relu") is conv_mod._activation("relu")
    assert conv_mod._activation("relu").name == "relu" and conv_mod._activation("gelu").name == "gelu"
    assert conv_mod._activation(None) is None


def test_workspace_keeps_transforms_by_identity():
    ws = direct_cache.Workspace()
    w1, w2 = np.arange(6.0), np.arange(6.0)
    made = []

    def make(w):
        made.append(w)
        return w * 2
    with direct_cache.using(ws):
        a = direct_cache.derived(w1, "k", lambda: make(w1))
        assert direct_cache.derived(w1, "k", lambda: make(w1)) is a
        assert direct_cache.derived(w1, "other", lambda: make(w1)) is not a
        assert direct_cache.derived(w2, "k", lambda: make(w2)) is not a  # equal contents, another array
        assert direct_cache.derived(w1[:], "k", lambda: make(w1)) is a  # a fresh view of the same memory
        assert direct_cache.derived(w1[::2], "k", lambda: make(w1)) is not a  # another view
    assert len(made) == 4
    assert direct_cache.derived(w1, "k", lambda: make(w1)) is not a  # no workspace: made every call
    buf = ws.scratch("col", 10, np.uint16, lambda n, dt: np.zeros(n, dt))
    again = ws.scratch("col", 8, np.uint16, lambda n, dt: pytest.fail("should be reused"))
    assert buf.size == 10 and again.size == 8 and np.shares_memory(buf, again)
    assert ws.scratch("col", 12, np.uint16, lambda n, dt: np.zeros(n, dt)).size == 12


def test_device_vectors_per_device_stream_type_and_contents():
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        v = np.arange(4.0)

        def uploads():
            return sum(1 for e in fake.log if e[0] == "upload")
        s1, s2 = cupy.cuda.Stream(), cupy.cuda.Stream()
        with cupy.cuda.Device(0), s1:
            a = direct_cache.device_vector(v, np.float32, direct_epilogue._column)
            assert direct_cache.device_vector(v.copy(), np.float32, direct_epilogue._column) is a and uploads() == 1
            assert a.shape == (4, 1) and a.dtype == np.float32
            assert direct_cache.device_vector(v, np.float64, direct_epilogue._column) is not a
            assert direct_cache.device_vector(v + 1, np.float32, direct_epilogue._column) is not a
            assert direct_cache.device_vector(v, np.float32) is not a  # another shape: another entry
        with cupy.cuda.Device(0), s2:
            assert direct_cache.device_vector(v, np.float32, direct_epilogue._column) is not a
        with cupy.cuda.Device(1), s1:
            b = direct_cache.device_vector(v, np.float32, direct_epilogue._column)
            assert b is not a and b.device.id == 1
        assert uploads() == 6
        assert [e[3] for e in fake.log if e[0] == "upload"][0] == v.astype(np.float32).tobytes()
        got = []  # the per-thread default stream: one handle, another stream in each thread, so an entry each
        ptds = cupy.cuda.Stream(ptr=2)

        def vector():
            with cupy.cuda.Device(0), ptds:
                got.append(direct_cache.device_vector(v, np.float32, direct_epilogue._column))
        vector()
        t = threading.Thread(target=vector)
        t.start()
        t.join()
        assert got[0] is not got[1] and uploads() == 8


def test_free_memory_read_once_per_device():
    with fake_cupy.installed() as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0):
            b = direct_cuda.budget()
            assert direct_cuda.budget() == b and fake.state["mem_info_calls"] == 1
        with cupy.cuda.Device(1):
            direct_cuda.budget()
            assert fake.state["mem_info_calls"] == 2
            direct_cuda.budget(refresh=True)
            assert fake.state["mem_info_calls"] == 3


def _launches(log):
    """The recorded kernel launches, GEMMs and copies, with device pointers masked (scratch is allocated
    anew where no Workspace keeps it), less what fills a cache (uploads, tiles, weight transforms)."""
    out = []
    for e in log:
        if e[0] in ("kernel", "raw_kernel"):
            at = 2 if e[0] == "kernel" else 4  # (a raw kernel's name, grid and block come first)
            out.append((*e[:at], tuple(a[2:] if isinstance(a, tuple) and a[0] == "array" else a for a in e[at]),
                        *e[at + 1:]))
        elif e[0] == "gemm":
            args = list(e[1:])
            for i in (5, 6, 10, 14, 15):  # alpha, A, B, beta, C
                args[i] = None
            out.append(("gemm", *args))
        elif e[0] not in ("upload", "tile", "contiguous"):
            out.append(e)
    return out


@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("case", ["shifted", "pointwise", "strided", "depthwise", "residual"])
def test_launches_the_same_from_cold_and_warm_caches(layout, dtype, case):
    """conv2d on the stand-in: the first call (caches cold), a second and third (warm, in a Workspace)
    and one after every cache is emptied record the same launches."""
    dt = np.dtype(dtype)
    c, k, kern, stride, groups = {"shifted": (64, 32, 3, 1, 1), "pointwise": (64, 32, 1, 1, 1),
                                  "strided": (16, 32, 3, 2, 2), "depthwise": (16, 16, 3, 1, 16),
                                  "residual": (64, 32, 3, 1, 1)}[case]
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy

        def arr(shape):
            if layout == "nchw":
                return cupy.empty(shape, dtype=dt)
            m = cupy.empty((shape[0], *shape[2:], shape[1]), dtype=dt)
            return m.transpose(0, 3, 1, 2)
        x, w = arr((4, c, 10, 10)), cupy.empty((k, c // groups, kern, kern), dtype=dt)
        side = (10 + 2 * (kern // 2) - kern) // stride + 1
        out = (4, k, side, side)
        y, r = arr(out), arr(out) if case == "residual" else None
        bias = np.linspace(-1, 1, k)
        ws = direct_cache.Workspace()
        runs = []
        with cupy.cuda.Device(0), cupy.cuda.Stream(), cd.on_own_gpu():
            for i in range(4):
                if i == 3:
                    direct_cache.clear()
                    ws.release()
                fake.log.clear()
                with direct_cache.using(ws if i else direct_cache.Workspace()):  # (a fresh one: cold)
                    dnn.conv2d(x, w, bias, stride, kern // 2, 1, groups, activation="relu", residual=r, out=y)
                runs.append(_launches(fake.log))
                if i == 0:
                    assert any(e[0] == "upload" for e in fake.log)
                if i == 2:
                    assert not any(e[0] in ("upload", "tile", "contiguous") for e in fake.log)  # all kept
        assert runs[0] and runs[0] == runs[1] == runs[2] == runs[3]
        assert any(e[0] in (("kernel",) if case == "depthwise" else ("gemm", "raw_kernel")) for e in runs[0])


def test_a_capture_makes_nothing_and_keeps_what_it_reads():
    """Inside direct_cache.capturing (a CUDA graph capture) a missing scratch buffer, weight transform or
    channel vector raises CaptureMiss before anything is made; what is handed out is kept in the capture's
    list, so a graph keeps the memory it uses after the caches drop or regrow it."""
    ws, w = direct_cache.Workspace(), np.arange(4.0)
    alloc = lambda n, dt: np.zeros(n, dt)  # noqa: E731
    keep: list = []
    with direct_cache.using(ws):
        with direct_cache.capturing(keep):
            for make in (lambda: ws.scratch("col", 8, np.float32, alloc),
                         lambda: direct_cache.derived(w, "rows", lambda: pytest.fail("made in a capture")),
                         lambda: ws.vector(("v",), lambda: pytest.fail("made in a capture"))):
                with pytest.raises(direct_cache.CaptureMiss, match="CUDA graph capture"):
                    make()
        assert keep == [] and ws.buffers == {} and ws.weights == {} and ws.vectors == {}
        ws.scratch("col", 8, np.float32, alloc)
        buf = ws.buffers["col"]
        t = direct_cache.derived(w, "rows", lambda: w * 2)
        v = ws.vector(("v",), lambda: (None, np.ones(3)))
        with direct_cache.capturing(keep):
            assert np.shares_memory(ws.scratch("col", 6, np.float32, alloc), buf)
            assert direct_cache.derived(w, "rows", lambda: pytest.fail("made again")) is t
            assert ws.vector(("v",), lambda: pytest.fail("made again")) is v
            with pytest.raises(direct_cache.CaptureMiss, match="'col' of 9"):  # a regrowth is a miss too
                ws.scratch("col", 9, np.float32, alloc)
        assert ws.buffers["col"] is buf  # the refused regrowth left the buffer as it was
    assert any(k is buf for k in keep) and any(k[1] is t for k in keep if isinstance(k, tuple)) and any(k is v for k in keep)
    ws.release()
    assert any(k is buf for k in keep)  # the graph's reference outlives the cache's


def test_a_workspace_owns_one_handle_bound_to_its_stream_handed_on_when_dropped():
    """cublas_call.own_handle: a Workspace's GEMMs use one handle of its own (none shared with other streams,
    a capture keeps it); a dropped Workspace's handle goes to the next Workspace of that device."""
    import gc
    with fake_cupy.installed():
        made = []
        real = cublas_call._new_handle

        def new():
            made.append(real())
            return made[-1]
        old = cublas_call._new_handle
        cublas_call._new_handle = new
        try:
            ws1, ws2 = direct_cache.Workspace(), direct_cache.Workspace()
            h1 = cublas_call.own_handle(ws1, 0, 11)
            assert cublas_call.own_handle(ws1, 0, 11) == h1 and len(made) == 1
            cublas_call.own_handle(ws2, 0, 12)
            assert len(made) == 2 and ws2.handle[1] is not ws1.handle[1]  # its own workspace memory
            keep: list = []
            with direct_cache.capturing(keep):
                assert cublas_call.own_handle(ws1, 0, 11) == h1
                with pytest.raises(direct_cache.CaptureMiss):
                    cublas_call.own_handle(direct_cache.Workspace(), 0, 13)
            assert keep == [ws1.handle]
            first = ws1.handle
            del ws1
            gc.collect()
            assert cublas_call._SPARE[0] == [first]
            ws3 = direct_cache.Workspace()
            cublas_call.own_handle(ws3, 0, 14)
            assert len(made) == 2 and ws3.handle[:2] == first[:2] and ws3.handle[2] == 14  # rebound
            assert cublas_call._SPARE[0] == []
        finally:
            cublas_call._new_handle = old


@pytest.mark.parametrize("c, wide", [(64, True), (12, True), (6, False), (3, False)])
def test_pad_and_crop_copies_move_whole_units_where_the_channels_allow(c, wide):
    """direct_cuda.copy: a shifted form's Pad and Crop views (channels-last, 2-byte elements) copied as 8-byte
    units of four channels where every stride and the channel row allow: the same bytes land as with the
    element-wise copy (done here with numpy on the stand-in's memory)."""
    with fake_cupy.installed() as fake:
        cupy = fake.cupy
        x = np.zeros((2, c, 6, 5))
        geo = conv_geometry("conv2d", 2, x, np.zeros((8, c, 3, 3)), 1, 1, 1, 1)
        rng = np.random.default_rng(c)
        xb = cupy.empty(x.size, dtype=np.uint16)
        np.asarray(xb)[...] = rng.integers(0, 1 << 16, x.size, dtype=np.uint16)
        ip = cd.padded_size(geo)
        for s in (cd.Pad(0, 2, True), cd.Pad(1, 1, True)):
            bufs = [cupy.empty(2 * int(np.prod(ip)) * c, dtype=np.uint16) for _ in range(2)]
            for b in bufs:
                np.asarray(b)[...] = 0
            views = [cd.pad_views(geo, True, s, xb, b) for b in bufs]
            np.asarray(views[0][0])[...] = np.asarray(views[0][1])  # element by element
            wd, ws = (direct_cuda.wide_view(v, 8) for v in views[1])
            assert (wd is not None and ws is not None) == wide
            if wide:
                assert wd.dtype == np.uint64 and wd.shape[-1] * 4 == c
                np.asarray(wd)[...] = np.asarray(ws)
                assert np.array_equal(np.asarray(bufs[0]), np.asarray(bufs[1]))
        odd = cupy.empty(64, dtype=np.uint16)[1:61].reshape(3, 20)  # 2 bytes past an 8-byte boundary
        assert direct_cuda.wide_view(odd, 8) is None
        assert direct_cuda.wide_view(cupy.empty(64, dtype=np.uint16)[:60].reshape(3, 20)[:, ::2], 8) is None
        assert direct_cuda.wide_view(cupy.empty(16, dtype=np.uint64), 8) is None  # already 8 bytes


@pytest.mark.parametrize("case", ["gemm", "residual", "depthwise", "transposed"])
def test_cupy_channel_vectors_are_never_read_on_the_host(case):
    """A CuPy bias, scale or shift stays on the device (combined there, no copy to the host: that would wait
    for the GPU); numpy vectors are uploaded as before."""
    with fake_cupy.installed(record_calls=True) as fake:
        cupy = fake.cupy
        with cupy.cuda.Device(0), cd.on_own_gpu():
            x = cupy.empty((2, 16, 8, 8), dtype=np.float32)
            k = 16
            b, sc, sh = (cupy.empty(k, dtype=np.float32) for _ in range(3))
            fake.log.clear()
            if case == "gemm":
                dnn.conv2d(x, cupy.empty((k, 16, 3, 3), dtype=np.float32), b, 1, 1, scale=sc, shift=sh,
                           activation="relu")
            elif case == "residual":
                dnn.conv2d(x, cupy.empty((k, 16, 1, 1), dtype=np.float32), b, scale=sc, shift=sh,
                           residual=cupy.empty((2, k, 8, 8), dtype=np.float32))
            elif case == "depthwise":
                dnn.conv2d(x, cupy.empty((k, 1, 3, 3), dtype=np.float32), b, 1, 1, groups=16, scale=sc, shift=sh)
            else:
                dnn.conv_transpose2d(x, cupy.empty((16, k, 3, 3), dtype=np.float32), b, stride=2, padding=1)
            assert not any(e[0] == "get" for e in fake.log)
            assert all(e[1] == (1,) for e in fake.log if e[0] == "upload")  # only the unit constants (1, 0)
            assert any(e[0] in ("gemm", "kernel") for e in fake.log)
