"""Uninitialised or stale device memory never reaches a result (marker ``gpu``; skipped where CuPy finds no GPU):
the GPU analogue of test_dnn_poison.py, on CuPy operands of cuda:0 (the device route: conv_direct.py planning,
direct_cuda.py running gathers, cuBLAS GEMMs, the implicit-GEMM kernel, col2im, phases, the depthwise kernels,
weight_forms' batched and shifted forms, conv_memo replays and call_graph CUDA graphs; plus CuPy pools, batch
norm and one LSTM).

Each case runs a call CALLS times normally (the full path, then memo replays: eagerly, captured into a CUDA
graph, launched from it), then, after blasx's caches are cleared, CALLS times again with poisoned memory:

- ``cupy.empty`` / ``cupy.empty_like`` return memory whose every byte is 0xFF (NaN in float16/32/64, -1 or the
  maximum in integers), by a cudaMemsetAsync on the current stream, so inside a graph capture the memset is
  captured too and every replay poisons its scratch again;
- CuPy's pool is emptied, then a few large blocks of 0xFF bytes are allocated and freed on the stream the calls
  use, so what the pool splits off for arrays made any other way holds poison too;
- before every call the scratch blasx keeps between calls (call_graph arenas, a Workspace's buffers) is
  filled with 0xFF bytes.

The poisoned run's i-th result must equal the normal run's i-th (the same code path: deterministic kernels,
so in practice bitwise; TOL allows summation-order noise) and be finite; integer results (pool indices) exactly
equal. The results of one run must also agree with each other (a replay gives the full path's result) within
the device route's tolerances.

Stale data: ``test_stale_scratch_*`` run a *larger* call of another shape first (in the same CUDA-graph arena, the
same pool, or the same Workspace scratch), then the call under test, which must give exactly what it gives
fresh; then its scratch is poisoned and it must still.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import blasx
from blasx import dnn
from dnn_ref import cl, leaves, poisoned_empty, rel

cupy = pytest.importorskip("cupy")
NGPU = blasx.session._cuda_count()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="no CUDA GPU")]

CALLS = 5  # full path, replay (eager, scratch counted), replay captured into a graph, graph launches
# the same code path twice: bitwise in practice; these allow summation-order noise only
TOL = {"float64": 1e-12, "float32": 1e-6, "float16": 1e-3}
TF32_TOL = 2e-6
# one run's calls against each other (full path, replays, graph launches), as test_gpu_dnn's DIRECT_TOL
RUN_TOL = {("float32", "ieee"): 1e-5, ("float32", "tf32"): 5e-3, ("float16", "ieee"): 5e-3,
           ("float64", "ieee"): 1e-12}
DTYPES = [("float32", "ieee"), ("float32", "tf32"), ("float16", "ieee")]
DT_IDS = ["f32", "tf32", "f16"]
POISON_BLOCKS = (64 << 20, 16 << 20, 4 << 20, 1 << 20, 256 << 10, 64 << 10, 16 << 10)  # bytes


@pytest.fixture(autouse=True)
def _engine(monkeypatch):
    from blasx.dnn import conv_direct
    blasx.configure(devices="cuda", tile=64, cache_bytes=256 << 20)
    monkeypatch.setattr(conv_direct, "ROUTE", "direct")
    cupy.cuda.Device(0).use()
    _fresh()
    yield
    _fresh()
    blasx.shutdown()


@pytest.fixture(params=["one-chunk", "chunked"])
def route(request, monkeypatch):
    """Route "chunked": scratch for one image at a time (chunks reuse one scratch: a chunk must not read the last's)."""
    from blasx.dnn import conv_direct
    if request.param == "chunked":
        monkeypatch.setattr(conv_direct, "BUDGET_FRACTION", 2**60)
    return request.param


# ---------------------------------------------------------------- poison

def _memset(a):
    """Every byte of the dense CuPy array ``a`` set to 0xFF, on the current stream (captured inside a capture)."""
    if a.size:
        a.data.memset_async(0xFF, a.nbytes)
    return a


@contextlib.contextmanager
def poisoned():
    """cupy.empty / cupy.empty_like hand out 0xFF bytes (NaN for every float type)."""
    with poisoned_empty(cupy, _memset):
        yield


def _sync():
    cupy.cuda.Device().synchronize()


def _fresh():
    """No state of one run reaches the next: the route's tables (plans, replays, graphs and their arenas, device
    vectors, free-memory readings) and the recurrent graphs emptied."""
    from blasx.dnn import direct_cache, rnn_graph
    _sync()
    direct_cache.clear()
    rnn_graph.clear()


def _poison_pool():
    """CuPy's pool emptied, then holding only free memory of 0xFF bytes on the current stream: fresh blocks of
    POISON_BLOCKS' sizes, and every free remainder of a block still in use (free_all_blocks keeps those) split off
    by allocations of halving sizes while the pool serves them; all poisoned, then freed. What the pool hands out
    next on this stream holds poison, however the array is made (blocks it must newly allocate aside)."""
    _sync()
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    held = [_memset(cupy.ndarray((n,), dtype=cupy.uint8)) for n in POISON_BLOCKS]
    size = 1 << 26
    for _ in range(4096):  # (bounded: a few remainders at most in practice)
        if size < 512:
            break
        before = pool.free_bytes()
        if before < size:
            size //= 2
            continue
        held.append(_memset(cupy.ndarray((size,), dtype=cupy.uint8)))
        if pool.free_bytes() >= before:  # no free chunk this large (on this stream): a new block, poisoned too
            size //= 2
    _sync()
    del held


def _poison_scratch(*workspaces):
    """The scratch blasx keeps between calls filled with 0xFF: every call_graph arena's buffer (a graph's scratch),
    and the buffers of the given Workspaces."""
    from blasx.dnn import call_graph
    _sync()
    for a in list(call_graph._ARENAS.entries.values()):
        if a.buf is not None:
            _memset(a.buf)
    for ws in workspaces:
        for b in ws.buffers.values():
            _memset(b)
    _sync()


# ---------------------------------------------------------------- runs and comparison

def _host(r):
    """A call's result with its CuPy arrays copied to the host (nested tuples, lists, dicts kept)."""
    if isinstance(r, dict):
        return {k: _host(v) for k, v in r.items()}
    if isinstance(r, (tuple, list)):
        return type(r)(_host(v) for v in r)
    if isinstance(r, cupy.ndarray):
        return cupy.asnumpy(r)
    return r


def _run(fn, calls=CALLS, poison=False, workspaces=()):
    """fn() ``calls`` times, each result copied to the host and its device arrays released before the next call
    (so CuPy's pool hands the next call the same addresses: its memo replay is captured into a graph, then
    launched from it); ``poison``: the kept scratch poisoned before each call."""
    out = []
    for _ in range(calls):
        if poison:
            _poison_scratch(*workspaces)
        r = fn()
        _sync()
        out.append(_host(r))
        del r
    return out


def _compare(got, ref, tol, what):
    gl, rl = list(leaves(got)), list(leaves(ref))
    assert [p for p, _ in gl] == [p for p, _ in rl], what
    for (path, g), (_, r) in zip(gl, rl):
        if r is None or isinstance(r, (bool, int, float, str)):
            assert g == r, (what, path)
            continue
        g, r = np.asarray(g), np.asarray(r)
        assert g.shape == r.shape and g.dtype == r.dtype, (what, path, g.shape, r.shape, g.dtype, r.dtype)
        if r.dtype.kind not in "fc":
            assert np.array_equal(g, r), (what, path, "differs (integer/boolean result)")
            continue
        assert np.isfinite(r).all(), (what, path, "the reference itself is not finite: the case proves nothing")
        bad = ~np.isfinite(g)
        assert not bad.any(), (what, path, f"{int(bad.sum())} of {g.size} entries not finite, first at "
                                           f"{tuple(int(i) for i in np.argwhere(bad)[0])}")
        err = rel(g, r)
        assert err <= tol, (what, path, err, tol)


def _graph_stats():
    """(graph launches, failed captures, their messages) over the kept convolution calls (conv_memo)."""
    from blasx.dnn import conv_memo
    gs = [getattr(r.run, "graphs", None) for r in conv_memo._TABLE.entries.values()]
    gs = [g for g in gs if g is not None]
    return sum(g.replays for g in gs), sum(g.fails for g in gs), [g.error for g in gs if g.fails]


def same_when_poisoned(fn, dtype="float32", math="ieee", graphs=False, calls=CALLS):
    """fn() ``calls`` times normally, then ``calls`` times with poisoned memory (caches cleared first): call i of
    each run the same (within TOL) and finite; within each run the calls agree within RUN_TOL. ``graphs``: no
    capture of the poisoned run failed.
    Returns the reference run's first result (host)."""
    tol = TF32_TOL if math == "tf32" else TOL[np.dtype(dtype).name]
    run_tol = RUN_TOL.get((np.dtype(dtype).name, math), tol)
    _fresh()
    ref = _run(fn, calls)
    _fresh()
    _poison_pool()
    with poisoned():
        got = _run(fn, calls, poison=True)
        _, fails, errors = _graph_stats()
    _fresh()
    for i, (g, r) in enumerate(zip(got, ref)):
        _compare(g, r, tol, f"call {i}: poisoned vs normal")
        _compare(r, ref[0], run_tol, f"call {i} vs call 0 (normal run)")
    if graphs:  # (whether a graph is launched depends on the pool handing an output its address back)
        assert fails == 0, errors
    return ref[0]


# ---------------------------------------------------------------- operands and calls

def _dev(a, layout):
    """A host array on the GPU, C-contiguous ("nchw") or channels-last ("cl": an NCHW-shaped view of NHWC)."""
    x = cupy.asarray(a)
    return cl(x) if layout == "cl" else x


def _out(size, k, s, p, d=1):
    return tuple((n + 2 * p - d * (k - 1) - 1) // s + 1 for n in size)


def _conv_calls(dtype, math, layout, n, c, k, size, kernel, stride=1, pad=0, groups=1, seed=0):
    """{name: fn} of conv2d calls on fixed operands of one geometry: "fwd" (plain), "epi" (a numpy bias, a
    residual, relu), "input" (backward-data), "weight" (backward-weight)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    osz = _out(size, kernel, stride, pad)
    x = rng.standard_normal((n, c, *size)).astype(dt)
    w = (rng.standard_normal((k, c // groups, kernel, kernel)) / np.sqrt(c // groups * kernel * kernel)).astype(dt)
    dy = rng.standard_normal((n, k, *osz)).astype(dt)
    r = rng.standard_normal((n, k, *osz)).astype(dt)
    b = rng.standard_normal(k)
    xd, wd, dyd, rd = _dev(x, layout), _dev(w, layout), _dev(dy, layout), _dev(r, layout)
    geo = (stride, pad, 1, groups)
    return {
        "fwd": lambda: dnn.conv2d(xd, wd, None, *geo, math=math),
        "epi": lambda: dnn.conv2d(xd, wd, b, *geo, residual=rd, activation="relu", math=math),
        "input": lambda: dnn.conv2d_input(x.shape, wd, dyd, *geo, math=math),
        "weight": lambda: dnn.conv2d_weight(xd, w.shape, dyd, *geo, math=math),
    }


def _transpose_call(dtype, math, layout, n, c, kg, size, kernel, stride, pad, groups=1, bias="numpy", seed=0):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    x = _dev(rng.standard_normal((n, c, *size)).astype(dt), layout)
    w = _dev((rng.standard_normal((c, kg, kernel, kernel)) / np.sqrt(c * kernel)).astype(dt), "nchw")
    b = {None: None, "numpy": rng.standard_normal(kg * groups),
         "cupy": cupy.asarray(rng.standard_normal(kg * groups).astype(dt))}[bias]
    return lambda: dnn.conv_transpose2d(x, w, b, stride, pad, stride - 1, groups, math=math)


def _skip_chunked_tf32(route, math):
    if route == "chunked" and math == "tf32":
        pytest.skip("chunking does not depend on the math mode: float32 covers it")


def _force(monkeypatch, form):
    from blasx.dnn import conv_direct
    monkeypatch.setattr(conv_direct, "FORM", form)


# ---------------------------------------------------------------- conv2d forward

FWD_GEOMETRIES = {  # name: (n, c, k, size, kernel, stride, pad, groups)
    "3x3": (3, 32, 24, (10, 9), 3, 1, 1, 1),
    "3x3-s2-g2": (3, 32, 24, (11, 9), 3, 2, 1, 2),
    "first-layer": (2, 3, 16, (12, 11), 3, 1, 1, 1),  # channels-last: x's channels padded to a gather unit
    "1x1": (3, 32, 24, (9, 8), 1, 1, 0, 1),
}


@pytest.mark.parametrize("form", ["im2col", "shifted"])
@pytest.mark.parametrize("geometry", list(FWD_GEOMETRIES))
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("dtype,math", DTYPES, ids=DT_IDS)
def test_conv_forward(route, monkeypatch, form, geometry, layout, dtype, math):
    """conv2d plain and with the epilogue (numpy bias, residual, relu), the form forced where it applies."""
    _skip_chunked_tf32(route, math)
    n, c, k, size, kern, stride, pad, groups = FWD_GEOMETRIES[geometry]
    if form == "shifted" and (stride != 1 or groups != 1 or kern == 1):
        pytest.skip("the shifted form needs stride 1, one group and a kernel window")
    _force(monkeypatch, form)
    calls = _conv_calls(dtype, math, layout, n, c, k, size, kern, stride, pad, groups, seed=1)
    same_when_poisoned(calls["fwd"], dtype, math, graphs=True)
    same_when_poisoned(calls["epi"], dtype, math, graphs=True)


def _implicit_capable():
    from blasx.dnn import igemm
    return igemm.current_capable()


IMPLICIT_GEOMETRIES = {  # name: (n, c, k, size)  (3x3, stride 1, padding 1)
    "c64": (2, 64, 64, (12, 10)),
    "c512-split-k": (2, 512, 64, (7, 7)),  # one row block: split k, float32 partials in scratch "part"
}


@pytest.mark.skipif(not _implicit_capable(), reason="the implicit-GEMM kernel needs compute capability 9.0")
@pytest.mark.parametrize("geometry", list(IMPLICIT_GEOMETRIES))
@pytest.mark.parametrize("dtype,math", [("float16", "ieee"), ("float32", "tf32")], ids=["f16", "tf32"])
def test_conv_forward_implicit(monkeypatch, geometry, dtype, math):
    """The implicit-GEMM form (forced, channels-last) plain and with the epilogue; with C == K also the stride-1
    backward-data it runs (a forward of the flipped kernel)."""
    from blasx.dnn import conv_direct
    from blasx.dnn.geometry import conv_geometry
    n, c, k, size = IMPLICIT_GEOMETRIES[geometry]
    _force(monkeypatch, "implicit")
    geo = conv_geometry("t", 2, np.zeros((n, c, *size), dtype), np.zeros((k, c, 3, 3), dtype), 1, 1, 1, 1)
    assert conv_direct.forward_form(geo, np.dtype(dtype), "implicit", "cl", math) == "implicit"
    calls = _conv_calls(dtype, math, "cl", n, c, k, size, 3, 1, 1, 1, seed=2)
    same_when_poisoned(calls["fwd"], dtype, math, graphs=True)
    same_when_poisoned(calls["epi"], dtype, math, graphs=True)
    if c == k:
        same_when_poisoned(calls["input"], dtype, math, graphs=True)


@pytest.mark.skipif(not _implicit_capable(), reason="the implicit kernels need compute capability 9.0")
@pytest.mark.parametrize("size", [(12, 10), (33, 32)], ids=["one-split", "splits"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_conv_weight_implicit(monkeypatch, size, layout):
    """The implicit weight-gradient kernel (forced; NCHW operands converted): dW written by the kernel, or
    "splits" (2,112 output pixels: 33 k-tiles) with float32 partials in scratch "part"."""
    _force(monkeypatch, "implicit")
    calls = _conv_calls("float16", "ieee", layout, 2, 64, 128, size, 3, 1, 1, 1, seed=5)
    same_when_poisoned(calls["weight"], "float16", "ieee", graphs=True)


# ---------------------------------------------------------------- conv2d_input

INPUT_CASES = {  # name: (form forced, n, c, k, size, kernel, stride, pad, groups)
    "s1-im2col": ("im2col", 3, 32, 24, (10, 9), 3, 1, 1, 1),
    "s1-shifted": ("shifted", 3, 32, 24, (10, 9), 3, 1, 1, 1),
    "s2-col2im": ("col2im", 3, 32, 24, (11, 10), 3, 2, 1, 1),
    "s2-col2im-g2": ("col2im", 3, 32, 24, (11, 10), 3, 2, 1, 2),
    "s2-phases": ("phases", 3, 32, 24, (16, 15), 3, 2, 1, 1),
}


@pytest.mark.parametrize("case", list(INPUT_CASES))
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("dtype,math", DTYPES, ids=DT_IDS)
def test_conv_input(route, monkeypatch, case, layout, dtype, math):
    """conv2d_input at stride 1 (a convolution of the flipped kernel: im2col, shifted) and stride 2 (col2im's GEMMs
    into columns and its kernel; the phases)."""
    _skip_chunked_tf32(route, math)
    form, n, c, k, size, kern, stride, pad, groups = INPUT_CASES[case]
    _force(monkeypatch, form)
    calls = _conv_calls(dtype, math, layout, n, c, k, size, kern, stride, pad, groups, seed=3)
    same_when_poisoned(calls["input"], dtype, math, graphs=True)


# ---------------------------------------------------------------- conv2d_weight

WEIGHT_CASES = {  # name: (form forced, layouts, n, c, k, size, kernel, stride, pad, groups)
    "im2col-s2-g2": ("im2col", ("nchw", "cl"), 3, 32, 24, (11, 9), 3, 2, 1, 2),
    "im2col-s1": ("im2col", ("nchw", "cl"), 3, 32, 24, (10, 9), 3, 1, 1, 1),
    "shifted": ("shifted", ("nchw", "cl"), 3, 32, 24, (10, 9), 3, 1, 1, 1),  # NCHW: converted (channels-last)
    "batched-1x1": ("batched", ("nchw",), 7, 40, 24, (9, 11), 1, 1, 0, 1),
}


@pytest.mark.parametrize("partials", ["own", "shared"])
@pytest.mark.parametrize("case", list(WEIGHT_CASES))
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("dtype,math", DTYPES, ids=DT_IDS)
def test_conv_weight(route, monkeypatch, partials, case, layout, dtype, math):
    """conv2d_weight by im2col, the shifted form (channels-last, stride 1) and the batched form (NCHW 1x1; "shared":
    PARTIALS_BYTES for three partial sums, seven images adding into them with beta 1)."""
    _skip_chunked_tf32(route, math)
    from blasx.dnn import weight_forms
    form, layouts, n, c, k, size, kern, stride, pad, groups = WEIGHT_CASES[case]
    if layout not in layouts:
        pytest.skip(f"the {form} form does not run {layout} operands")
    if partials == "shared":
        if form != "batched":
            pytest.skip("partial sums: the batched form's")
        monkeypatch.setattr(weight_forms, "PARTIALS_BYTES", 3 * c * k * 4)
    _force(monkeypatch, form)
    calls = _conv_calls(dtype, math, layout, n, c, k, size, kern, stride, pad, groups, seed=4)
    same_when_poisoned(calls["weight"], dtype, math, graphs=True)


# ---------------------------------------------------------------- conv_transpose2d

@pytest.mark.parametrize("stride,form", [(1, None), (2, "col2im"), (2, "phases")])
@pytest.mark.parametrize("bias", ["numpy", "cupy"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("dtype,math", DTYPES, ids=DT_IDS)
def test_conv_transpose_bias(route, monkeypatch, stride, form, bias, layout, dtype, math):
    """conv_transpose2d with a bias: stride 1 (a convolution, the bias in the epilogue), stride 2 by col2im (its
    kernel adds the bias) and by phases (each phase's convolution adds it; a phase without taps gets it)."""
    _skip_chunked_tf32(route, math)
    _force(monkeypatch, form)
    size = (9, 8) if form != "phases" else (15, 14)
    fn = _transpose_call(dtype, math, layout, 3, 32, 24, size, 3, stride, 1, bias=bias, seed=5)
    same_when_poisoned(fn, dtype, math, graphs=form == "col2im")


# ---------------------------------------------------------------- depthwise

@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_depthwise(layout, dtype):
    """Depthwise convolutions (depthwise.py's kernels; channels-last with C a multiple of the vector width: the
    vector kernel): forward with the epilogue, a channel multiplier, backward-data at stride 2 (zero insertion),
    backward-weight (partial sums per split)."""
    rng = np.random.default_rng(6)
    dt = np.dtype(dtype)
    n, c, size = 3, 16, (11, 10)
    x = _dev(rng.standard_normal((n, c, *size)).astype(dt), layout)
    w = _dev((rng.standard_normal((c, 1, 3, 3)) / 3).astype(dt), layout)
    w2 = _dev((rng.standard_normal((2 * c, 1, 3, 3)) / 3).astype(dt), layout)
    b = rng.standard_normal(c)
    osz = _out(size, 3, 2, 1)
    dy = _dev(rng.standard_normal((n, c, *osz)).astype(dt), layout)
    r1 = _dev(rng.standard_normal((n, c, *size)).astype(dt), layout)
    same_when_poisoned(lambda: dnn.conv2d(x, w, b, 1, 1, 1, c, residual=r1, activation="relu"), dtype, calls=2)
    same_when_poisoned(lambda: dnn.conv2d(x, w, None, 2, 1, 1, c), dtype, calls=2)
    same_when_poisoned(lambda: dnn.conv2d(x, w2, b.repeat(2), 1, 1, 1, c), dtype, calls=2)
    same_when_poisoned(lambda: dnn.conv2d_input((n, c, *size), w, dy, 2, 1, 1, c), dtype, calls=2)
    same_when_poisoned(lambda: dnn.conv2d_weight(x, (c, 1, 3, 3), dy, 2, 1, 1, c), dtype, calls=2)


# ---------------------------------------------------------------- pools and batch norm

@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_pools(layout, dtype):
    """Max (values and int64 indices), average and adaptive pools on CuPy arrays, forward and backward."""
    rng = np.random.default_rng(7)
    dt = np.dtype(dtype)
    x = _dev(rng.standard_normal((2, 5, 11, 10)).astype(dt), layout)
    for k, s, p, dil, ceil in [(3, 2, 1, 1, True), (2, 2, 1, 2, False)]:
        y, idx = same_when_poisoned(lambda: dnn.max_pool2d(x, k, s, p, dil, ceil, True), dtype, calls=2)
        gy = _dev(rng.standard_normal(y.shape).astype(dt), layout)
        idx_d = _dev(idx, layout)
        same_when_poisoned(lambda: dnn.max_pool2d_backward(gy, x.shape, idx_d, k, s, p, dil, ceil), dtype, calls=2)
        for cip in (True, False):
            y = same_when_poisoned(lambda: dnn.avg_pool2d(x, k, s, p, ceil, cip), dtype, calls=2)
            gy = _dev(rng.standard_normal(y.shape).astype(dt), layout)
            same_when_poisoned(lambda: dnn.avg_pool2d_backward(gy, x.shape, k, s, p, ceil, cip), dtype, calls=2)
    for osz in [(4, 3), (1, 1)]:
        y = same_when_poisoned(lambda: dnn.adaptive_avg_pool2d(x, osz), dtype, calls=2)
        gy = _dev(rng.standard_normal(y.shape).astype(dt), layout)
        same_when_poisoned(lambda: dnn.adaptive_avg_pool2d_backward(gy, x.shape), dtype, calls=2)
        y, idx = same_when_poisoned(lambda: dnn.adaptive_max_pool2d(x, osz, True), dtype, calls=2)
        idx_d = _dev(idx, layout)
        same_when_poisoned(lambda: dnn.adaptive_max_pool2d_backward(gy, x.shape, idx_d), dtype, calls=2)


@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_batch_norm(layout, dtype):
    """batch_norm training (statistics returned, running ones updated: fresh copies each call), inference, and
    batch_norm_backward, on CuPy arrays."""
    rng = np.random.default_rng(8)
    dt = np.dtype(dtype)
    x = _dev(rng.standard_normal((3, 6, 7, 5)).astype(dt), layout)
    dy = _dev(rng.standard_normal((3, 6, 7, 5)).astype(dt), layout)
    w, b = cupy.asarray(rng.standard_normal(6).astype(dt)), cupy.asarray(rng.standard_normal(6).astype(dt))
    rm, rv = cupy.asarray(rng.standard_normal(6).astype(dt)), cupy.asarray((np.abs(rng.standard_normal(6)) + 0.5)
                                                                           .astype(dt))

    def train():
        m, v = rm.copy(), rv.copy()
        y, mean, invstd = dnn.batch_norm(x, m, v, w, b, True, 0.1, 1e-5, return_stats=True)
        return y, mean, invstd, m, v
    _, mean, invstd, _, _ = same_when_poisoned(train, dtype, calls=2)
    mean, invstd = cupy.asarray(mean), cupy.asarray(invstd)
    same_when_poisoned(lambda: dnn.batch_norm_backward(dy, x, w, mean, invstd, True, 1e-5), dtype, calls=2)
    same_when_poisoned(lambda: dnn.batch_norm(x, rm, rv, w, b, False, 0.1, 1e-5), dtype, calls=2)
    same_when_poisoned(lambda: dnn.batch_norm_backward(dy, x, w, mean, invstd, False, 1e-5, running_mean=rm,
                                                       running_var=rv), dtype, calls=2)


# ---------------------------------------------------------------- one recurrent case (test_gpu_rnn covers more)

def test_lstm_lengths_projection():
    """A bidirectional two-layer LSTM with a projection and variable lengths, forward (training) and backward,
    captured into CUDA graphs and replayed (rnn_graph), with poisoned memory."""
    rng = np.random.default_rng(9)
    T, B, I, H, P, L = 12, 6, 16, 32, 8, 2
    lengths = [12, 9, 9, 5, 2, 1]
    params = {}
    for layer in range(L):
        for sfx in ("", "_reverse"):
            inp = I if layer == 0 else 2 * P
            shapes = {"weight_ih": (4 * H, inp), "weight_hh": (4 * H, P), "bias_ih": (4 * H,), "bias_hh": (4 * H,),
                      "weight_hr": (P, H)}
            for name, shape in shapes.items():
                params[f"{name}_l{layer}{sfx}"] = cupy.asarray((rng.standard_normal(shape) * 0.3).astype(np.float32))
    x = cupy.asarray(rng.standard_normal((T, B, I)).astype(np.float32))
    h0 = cupy.asarray(rng.standard_normal((2 * L, B, P)).astype(np.float32))
    c0 = cupy.asarray(rng.standard_normal((2 * L, B, H)).astype(np.float32))
    gy = cupy.asarray(rng.standard_normal((T, B, 2 * P)).astype(np.float32))
    gh = cupy.asarray(rng.standard_normal((2 * L, B, P)).astype(np.float32))
    gc = cupy.asarray(rng.standard_normal((2 * L, B, H)).astype(np.float32))

    def run():
        y, (hn, cn), saved = dnn.lstm(x, (h0, c0), params, num_layers=L, bidirectional=True, lengths=lengths,
                                      proj_size=P, training=True)
        return y, hn, cn, dnn.lstm_backward(saved, gy, gh, gc)
    same_when_poisoned(run, "float32", calls=3)  # eager, captured, replayed


# ---------------------------------------------------------------- stale scratch from a larger call

# name: (form forced, PARTIALS_BYTES or None, call kind, layout, dtype, the larger call's geometry, the call's)
# geometry: (n, c, k, size, kernel, stride, pad, groups)
STALE = {
    "fwd-im2col": ("im2col", None, "fwd", "nchw", "float32", (4, 32, 32, (20, 18), 3, 1, 1, 1),
                   (2, 16, 24, (9, 7), 3, 2, 1, 1)),
    "fwd-shifted": ("shifted", None, "epi", "cl", "float16", (4, 32, 32, (20, 18), 3, 1, 2, 1),
                    (2, 32, 24, (7, 9), 3, 1, 1, 1)),
    "fwd-implicit": ("implicit", None, "fwd", "cl", "float16", (2, 512, 64, (9, 9), 3, 1, 1, 1),
                     (2, 512, 64, (7, 7), 3, 1, 1, 1)),
    "input-col2im": ("col2im", None, "input", "cl", "float16", (4, 32, 32, (21, 19), 3, 2, 1, 1),
                     (2, 16, 24, (9, 11), 3, 2, 1, 1)),
    "input-phases": ("phases", None, "input", "nchw", "float32", (4, 32, 32, (20, 18), 3, 2, 1, 1),
                     (2, 16, 24, (15, 14), 3, 2, 1, 1)),
    "weight-shifted": ("shifted", None, "weight", "cl", "float32", (4, 32, 32, (20, 18), 3, 1, 2, 1),
                       (2, 32, 24, (7, 9), 3, 1, 1, 1)),
    "weight-batched": ("batched", 3 * 40 * 24 * 4, "weight", "nchw", "float32", (8, 48, 32, (12, 12), 1, 1, 0, 1),
                       (7, 40, 24, (9, 11), 1, 1, 0, 1)),
    "weight-im2col": ("im2col", None, "weight", "nchw", "float16", (4, 32, 32, (20, 18), 3, 1, 1, 1),
                      (2, 16, 24, (9, 7), 3, 2, 1, 2)),
    "weight-implicit": ("implicit", None, "weight", "cl", "float16", (8, 64, 128, (20, 18), 3, 1, 1, 1),
                        (4, 64, 128, (17, 16), 3, 1, 1, 1)),  # partials of 5 splits, then of 2
}


def _stale_calls(monkeypatch, name):
    from blasx.dnn import weight_forms
    form, partials, kind, layout, dtype, big, small = STALE[name]
    if form == "implicit" and not _implicit_capable():
        pytest.skip("the implicit-GEMM kernel needs compute capability 9.0")
    _force(monkeypatch, form)
    if partials is not None:
        monkeypatch.setattr(weight_forms, "PARTIALS_BYTES", partials)
    big_fn = _conv_calls(dtype, "ieee", layout, *big, seed=10)[kind]
    small_fn = _conv_calls(dtype, "ieee", layout, *small, seed=11)[kind]
    return big_fn, small_fn, TOL[dtype]


@pytest.mark.parametrize("name", list(STALE))
def test_stale_scratch_from_a_larger_call_graphs(monkeypatch, name):
    """On one stream, a larger call of another shape runs CALLS times (its replay captured into a graph: the
    stream's arena sized for its scratch, then holding its data; the pool's free blocks too), then the call under
    test CALLS times (its graph in the same arena, its eager scratch from the same pool): the results it gives on
    fresh state. Then the arena poisoned, and two more calls (graph launches) the same."""
    big_fn, small_fn, tol = _stale_calls(monkeypatch, name)
    _fresh()
    ref = _run(small_fn)
    _fresh()
    _run(big_fn)
    got = _run(small_fn)
    for i, (g, r) in enumerate(zip(got, ref)):
        _compare(g, r, tol, f"call {i} after a larger call vs fresh")
    with poisoned():
        again = _run(small_fn, 2, poison=True)
    replays, fails, errors = _graph_stats()
    for g in again:
        _compare(g, ref[-1], tol, "after the arena was poisoned vs fresh")
    assert fails == 0, errors
    assert replays > 0, "no call was launched from a CUDA graph"


@pytest.mark.parametrize("name", list(STALE))
def test_stale_scratch_from_a_larger_call_workspace(monkeypatch, name):
    """In a Workspace (a network worker's: scratch kept by name and reused, call after call), a larger call of
    another shape leaves its data in the buffers, then the call under test: what it gives in a fresh Workspace.
    Then the buffers poisoned, and the call again the same."""
    from blasx.dnn import direct_cache
    big_fn, small_fn, tol = _stale_calls(monkeypatch, name)
    _fresh()
    fresh_ws = direct_cache.Workspace()
    with direct_cache.using(fresh_ws):
        ref = _run(small_fn, 2)
    fresh_ws.release()
    _fresh()
    ws = direct_cache.Workspace()
    with direct_cache.using(ws):
        _run(big_fn, 1)
        got = _run(small_fn, 2)
        with poisoned():
            again = _run(small_fn, 2, poison=True, workspaces=(ws,))
    ws.release()
    for i, (g, r) in enumerate(zip(got, ref)):
        _compare(g, r, tol, f"call {i} after a larger call vs a fresh Workspace")
    for g in again:
        _compare(g, ref[-1], tol, "after the Workspace's scratch was poisoned vs a fresh Workspace")


def test_poison_reaches_allocations():
    """The poison is in force: cupy.empty / empty_like give NaN (floats) and all-ones bytes (integers), and
    what the pool splits off its poisoned blocks holds 0xFF bytes."""
    with poisoned():
        assert bool(cupy.isnan(cupy.empty(3, cupy.float32)).all())
        assert bool(cupy.isnan(cupy.empty_like(cupy.zeros((2, 3), cupy.float16))).all())
        assert bool(cupy.isnan(cupy.empty((4, 2), cupy.float64).T).all())
        assert bool((cupy.empty(2, cupy.int64) == -1).all()) and bool((cupy.empty(4, cupy.uint16) == 0xFFFF).all())
    assert not bool(cupy.isnan(cupy.zeros(3)).any())
    _poison_pool()
    a = cupy.ndarray((1000,), dtype=cupy.float32)  # (not through cupy.empty)
    assert bool(cupy.isnan(a).all())
