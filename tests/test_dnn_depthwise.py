"""blasx.dnn's depthwise kernels (depthwise.py) on the CPU: their programs (the index arithmetic the CUDA
source is rendered from) run on numpy with C's integer semantics against torch in float64 -- forward,
backward-data (zero insertion), transposed, backward-weights, any padding (asymmetric too), stride and
dilation, NCHW and channels-last; the kernel sources; and which front-end calls take the route, with the
route's CUDA launches replaced by the numpy programs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from blasx import dnn
from blasx.dnn import conv_transpose as conv_mod
from blasx.dnn import conv_direct as cd
from blasx.dnn import depthwise as dw
from blasx.dnn.geometry import conv_geometry, transpose_geometry
from blasx.runtime.devices import cuda_epilogue
from dnn_ref import from_memory, memory

T = torch.from_numpy


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-300))


def _cl(x):
    return np.ascontiguousarray(np.moveaxis(x, 1, -1)).transpose(0, x.ndim - 1, *range(1, x.ndim - 1))


def _bits(params, bufs):
    return 32 if dw.index_type(params, [b.size for b in bufs.values()]) == "int32" else 64


def program_forward(geo, cl, xmem, wflat):
    """The forward kernel's sums (y's memory order) by its program on numpy."""
    params = dw.forward_params(geo, cl)
    acc = np.zeros(geo.n * geo.k * geo.p)
    bufs = {"x": xmem, "w": wflat}
    env = {**params, "e": np.arange(acc.size)}
    dw.execute(dw.forward_program(geo.nd, cl, dw.inserted(geo)), env, bufs, acc, bits=_bits(params, bufs))
    return acc, env


def program_weight(geo, cl, xmem, dymem, split):
    params = dw.weight_params(geo, cl, split)
    part = np.zeros(geo.k * geo.crs * split)
    bufs = {"x": xmem, "dy": dymem}
    dw.execute(dw.weight_program(geo.nd, cl), {**params, "e": np.arange(part.size)}, bufs, part,
               bits=_bits(params, bufs))
    return dw.reduce_partials(part, geo, cl, split)


def _torch_pad(x, pad, nd):
    """(x padded for torch, torch's padding): asymmetric pairs applied to x, else left to torch."""
    if isinstance(pad, int):
        return x, pad
    return np.pad(x, ((0, 0), (0, 0), *pad[:nd])), 0


SIZES = {1: (13,), 2: (9, 8), 3: (6, 5, 7)}
PADS = st.sampled_from([0, 1, 2, ((0, 2), (1, 0), (2, 1)), ((2, 0), (0, 1), (1, 1))])
CASES = st.tuples(st.sampled_from([1, 2, 3]), st.booleans(), st.integers(1, 3), PADS, st.integers(1, 2),
                  st.integers(2, 5), st.integers(1, 3), st.sampled_from([1, 2, 3]), st.integers(0, 1000))


@settings(max_examples=40, deadline=None)
@given(CASES)
def test_forward_and_weight_programs_vs_torch(case):
    """groups == C (multiplier m): the forward program and the weight program (several splits)."""
    nd, cl, stride, pad, dil, c, m, ks, seed = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, c, *SIZES[nd]))
    w = rng.standard_normal((c * m, 1, *(ks,) * nd))
    pad = pad if isinstance(pad, int) else tuple(pad[:nd])
    try:
        geo = conv_geometry("conv", nd, x, w, stride, pad, dil, c)
    except ValueError:
        return  # kernel larger than the padded input
    assert dw.applies(geo) and not dw.inserted(geo)
    xt, tpad = _torch_pad(x, pad, nd)
    ref = getattr(F, f"conv{nd}d")(T(xt), T(w), None, stride, tpad, dil, c).numpy()
    acc, _ = program_forward(geo, cl, memory(x, cl), w.ravel())
    assert _rel(from_memory(acc, ref.shape, cl), ref) < 1e-13
    dy = rng.standard_normal(ref.shape)
    want = getattr(torch.nn.grad, f"conv{nd}d_weight")(T(xt), w.shape, T(dy), stride, tpad, dil, c).numpy()
    for split in {1, 3, dw.weight_split(geo), geo.n * geo.p + 2}:
        got = program_weight(geo, cl, memory(x, cl), memory(dy, cl), split).reshape(w.shape)
        assert _rel(got, want) < 1e-13


@settings(max_examples=30, deadline=None)
@given(CASES)
def test_backward_data_program_vs_torch(case):
    """conv_input with groups == C as the front end makes it: the zero-inserted dY (stride > 1) with the
    flipped kernel, one output channel a group summing the multiplier's m channels."""
    nd, cl, stride, pad, dil, c, m, ks, seed = case
    rng = np.random.default_rng(seed)
    pad = pad if isinstance(pad, int) else 1
    x = np.zeros((2, c, *SIZES[nd]))
    w = rng.standard_normal((c * m, 1, *(ks,) * nd))
    try:
        fwd = conv_geometry("conv", nd, x, w, stride, pad, dil, c)
    except ValueError:
        return
    dy = rng.standard_normal((2, c * m, *fwd.out_size))
    geo = transpose_geometry("t", nd, dy, w, stride, pad, 0, c, dil, x.shape)
    assert dw.applies(geo) and (geo.cg, geo.kg) == (m, 1) and dw.inserted(geo) == (stride > 1)
    ref = getattr(torch.nn.grad, f"conv{nd}d_input")(x.shape, T(w), T(dy), stride, pad, dil, c).numpy()
    acc, _ = program_forward(geo, cl, memory(dy, cl), conv_mod._flipped_transposed(np, w, c).ravel())
    assert _rel(from_memory(acc, ref.shape, cl), ref) < 1e-13


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([1, 2, 3]), st.booleans(), st.integers(1, 3), st.integers(0, 1), st.integers(1, 2),
       st.integers(1, 2), st.integers(0, 1000))
def test_transposed_depthwise_program_vs_torch(nd, cl, stride, pad, dil, m, seed):
    """conv_transpose with groups == its input channels (weight (C, m, k...))."""
    rng = np.random.default_rng(seed)
    c = 3
    x = rng.standard_normal((2, c, *(4,) * nd))
    wt = rng.standard_normal((c, m, *(3,) * nd))
    opad = 1 if stride > 1 else 0
    geo = transpose_geometry("t", nd, x, wt, stride, pad, opad, c, dil)
    assert dw.applies(geo) and geo.cg == 1
    ref = getattr(F, f"conv_transpose{nd}d")(T(x), T(wt), None, stride, pad, opad, c, dil).numpy()
    acc, _ = program_forward(geo, cl, memory(x, cl), conv_mod._flipped_transposed(np, wt, c).ravel())
    assert _rel(from_memory(acc, ref.shape, cl), ref) < 1e-13


@pytest.mark.parametrize("cl", [False, True])
def test_one_output_a_group_forward_and_weight(cl):
    """groups == K with a few input channels a group (cg 3): the channel loop of both programs."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 6, 7, 9))
    w = rng.standard_normal((2, 3, 3, 2))
    geo = conv_geometry("conv", 2, x, w, (2, 1), ((1, 0), (0, 2)), (1, 2), 2)
    assert dw.applies(geo) and (geo.cg, geo.kg) == (3, 1)
    xt = np.pad(x, ((0, 0), (0, 0), (1, 0), (0, 2)))
    ref = F.conv2d(T(xt), T(w), None, (2, 1), 0, (1, 2), 2).numpy()
    acc, _ = program_forward(geo, cl, memory(x, cl), w.ravel())
    assert _rel(from_memory(acc, ref.shape, cl), ref) < 1e-13
    dy = rng.standard_normal(ref.shape)
    want = torch.nn.grad.conv2d_weight(T(xt), w.shape, T(dy), (2, 1), 0, (1, 2), 2).numpy()
    got = program_weight(geo, cl, memory(x, cl), memory(dy, cl), 5).reshape(w.shape)
    assert _rel(got, want) < 1e-13


def test_applies():
    def geo(c, k, groups, transposed=False):
        x = np.zeros((1, c, 8, 8))
        if transposed:
            return transpose_geometry("t", 2, x, np.zeros((c, k // groups, 3, 3)), 2, 1, 1, groups, 1)
        return conv_geometry("c", 2, x, np.zeros((k, c // groups, 3, 3)), 1, 1, 1, groups)
    assert dw.applies(geo(32, 32, 32)) and dw.applies(geo(32, 96, 32))  # depthwise, multiplier 3
    assert dw.applies(geo(96, 32, 32))  # backward-data's form: 3 channels into each output
    assert dw.applies(geo(8, 16, 8, transposed=True))
    assert dw.applies(geo(16 * 16, 16, 16)) and not dw.applies(geo(17 * 16, 16, 16))  # MAX_CG
    assert not dw.applies(geo(1, 8, 1)) and not dw.applies(geo(8, 8, 1))  # groups 1: GEMMs
    assert not dw.applies(geo(8, 12, 2)) and not dw.applies(geo(8, 8, 4))  # 4 and 2 channels per group, out too


def test_programs_use_c_semantics_and_checks():
    """execute's / and % truncate as C's do; an out-of-bounds read and an int32 overflow are caught."""
    acc, env = np.zeros(3), {"e": np.arange(3)}
    dw.execute([("let", "a", "(e - 2) / 2"), ("let", "b", "(e - 2) % 2")], env, {}, acc)
    assert list(env["a"]) == [-1, 0, 0] and list(env["b"]) == [0, -1, 0]
    prog = [("for", "t", "N", [("need", "e + t >= 1"), ("fma", ("x", "e + t"), ("x", "e"))])]
    dw.execute(prog, {"N": 2, "e": np.arange(3)}, {"x": np.arange(4.0)}, acc)
    assert list(acc) == [0, 1 + 2, 2 * 2 + 2 * 3]  # t = 0 masked for e = 0
    with pytest.raises(AssertionError, match="out of bounds"):
        dw.execute(prog, {"N": 3, "e": np.arange(3)}, {"x": np.arange(4.0)}, acc)
    with pytest.raises(AssertionError, match="overflows 32 bits"):
        dw.execute([("let", "a", "e * 2147483647")], {"e": np.arange(3)}, {}, acc, bits=32)
    with pytest.raises(ValueError, match="outside a loop"):
        dw.render([("need", "e < 1")])
    assert dw.render([("for", "t", "N", [("need", "t < 2", "e > t"), ("fma", ("x", "t"), ("w", "e"))])]) == [
        "for (I t = 0; t < N; ++t) {", "  if (!((t < 2) && (e > t))) continue;",
        "  acc += blasx_ld(x[t]) * blasx_ld(w[e]);", "}"]


def test_index_type():
    geo = conv_geometry("c", 2, np.zeros((2, 4, 9, 9)), np.zeros((4, 1, 3, 3)), 1, 1, 1, 4)
    p = dw.forward_params(geo, False)
    assert dw.index_type(p, [648, 36, 648]) == "int32"
    assert dw.index_type(p, [2**31, 36, 648]) == "int64"
    assert dw.index_type({**p, "L0": -(2**31)}, [648]) == "int64"


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("activation", [None, *sorted(cuda_epilogue.EXPRESSIONS.keys() - {None})])
def test_sources(dtype, activation):
    """The kernels' parameters are the programs' (in order), the activation and the store are the
    epilogue kernel's, and every kernel variant has its own name (the cache key)."""
    if dtype == "bfloat16":
        dt = pytest.importorskip("ml_dtypes").bfloat16
    else:
        dt = np.dtype(dtype)
    ptype, ctype, load, store = cuda_epilogue.TILE_TYPES[cuda_epilogue.tile_type(dt)]
    load, store = load.format("y"), store.format("y", "r")
    assert "{" not in store  # the templates are filled in (a bare {0} does not compile)
    x = np.zeros((2, 4, 5, 6))
    geo = conv_geometry("c", 2, x, np.zeros((8, 1, 3, 3)), 2, 1, 1, 4)
    src = dw.forward_source(dt, 2, True, False, activation, True, "int32")
    ints = [p.split()[1] for p in src["in_params"].split(", ") if p.startswith("int32")]
    assert ints == list(dw.forward_params(geo, True))
    assert src["in_params"].startswith(f"raw {ptype} x, raw {ptype} w") and src["out_params"] == f"{ptype} y"
    assert cuda_epilogue.EXPRESSIONS[activation].format(**cuda_epilogue.MATH_FUNCTIONS[ctype]) in src["operation"]
    assert src["operation"].endswith(store + ";") and load in src["preamble"]
    assert "\n".join(dw.render(dw.forward_program(2, True, False))) in src["operation"]
    ws = dw.weight_source(dt, 2, False, "int64")
    assert [p.split()[1] for p in ws["in_params"].split(", ") if p.startswith("int64")] == list(
        dw.weight_params(geo, False, 3))
    names = {dw.forward_source(dt, nd, cl, z, activation, res, ix)["name"] for nd in (1, 2, 3) for cl in (0, 1)
             for z in (0, 1) for res in (0, 1) for ix in ("int32", "int64")}
    assert len(names) == 48


# ---------------------------------------------------------------- which calls take the route

class Calls(list):
    pass


@pytest.fixture
def routed(monkeypatch):
    """Every call on the device route (numpy arrays included); the depthwise launches run the programs
    on numpy (the kernel's epilogue line in numpy), conv_direct's forward and weight are recorded only."""
    calls = Calls()

    def launch_forward(geo, cl, dtype, act, bufs):
        calls.append("depthwise.forward")
        acc, env = program_forward(geo, cl, bufs["x"], bufs["w"])
        v = acc * bufs["sc"][env["k"]] + bufs["sh"][env["k"]]
        if "res" in bufs:
            v = v + bufs["res"]
        bufs["y"][...] = v if act is None else act.host(v)

    def launch_weight(geo, cl, dtype, bufs, split):
        calls.append("depthwise.weight")
        bufs["part"][...] = 0.0
        params = dw.weight_params(geo, cl, split)
        dw.execute(dw.weight_program(geo.nd, cl), {**params, "e": np.arange(bufs["part"].size)}, bufs,
                   bufs["part"])

    def record(name, result=None):
        def fn(*args, **kwargs):
            calls.append(name)
            return result
        return fn
    monkeypatch.setattr(cd, "applies", lambda x, flops: True)
    monkeypatch.setattr(dw, "launch_forward", launch_forward)
    monkeypatch.setattr(dw, "launch_weight", launch_weight)
    monkeypatch.setattr(cd, "forward", record("conv_direct.forward"))
    monkeypatch.setattr(cd, "weight", record("conv_direct.weight", (np.zeros(8 * 18), None)))  # (dW, no plan)
    return calls


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_front_end_forward_with_epilogue(routed, nd, layout):
    """conv{nd}d with groups == C: bias, scale, shift, residual, activation, out=, channels-last kept."""
    rng = np.random.default_rng(nd)
    lay = _cl if layout == "cl" else (lambda a: a)
    x = rng.standard_normal((2, 4, *SIZES[nd]))
    w = rng.standard_normal((8, 1, *(3,) * nd))
    b, sc, sh = rng.standard_normal(8), rng.uniform(0.5, 2, 8), rng.standard_normal(8)
    conv = getattr(F, f"conv{nd}d")(T(x), T(w), T(b), 2, 1, 1, 4)
    r = rng.standard_normal(tuple(conv.shape))
    ch = (slice(None),) + (None,) * nd
    ref = F.silu(conv * T(sc)[ch] + T(sh)[ch] + T(r)).numpy()
    out = lay(np.full(ref.shape, np.nan))
    y = getattr(dnn, f"conv{nd}d")(lay(x), w, b, 2, 1, 1, 4, scale=sc, shift=sh, residual=lay(r), activation="silu",
                                   out=out)
    assert y is out and _rel(y, ref) < 1e-13 and (layout == "cl") == (not y.flags.c_contiguous)
    plain = getattr(dnn, f"conv{nd}d")(lay(x), w, None, 2, 1, 1, 4)
    assert _rel(plain, getattr(F, f"conv{nd}d")(T(x), T(w), None, 2, 1, 1, 4).numpy()) < 1e-13
    assert (layout == "cl") == (not plain.flags.c_contiguous)
    assert routed == ["depthwise.forward"] * 2


@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("m", [1, 2])
def test_front_end_backward_directions(routed, layout, m):
    rng = np.random.default_rng(m)
    lay = _cl if layout == "cl" else (lambda a: a)
    x = rng.standard_normal((2, 6, 11, 9))
    w = rng.standard_normal((6 * m, 1, 3, 3))
    dy = rng.standard_normal((2, 6 * m, 6, 5))
    gi = dnn.conv2d_input(x.shape, w, lay(dy), stride=2, padding=1, groups=6)
    assert _rel(gi, torch.nn.grad.conv2d_input(x.shape, T(w), T(dy), 2, 1, 1, 6).numpy()) < 1e-13
    assert (layout == "cl") == (not gi.flags.c_contiguous)
    gw = dnn.conv2d_weight(lay(x), w.shape, lay(dy), stride=2, padding=1, groups=6)
    assert gw.shape == w.shape and gw.flags.c_contiguous
    assert _rel(gw, torch.nn.grad.conv2d_weight(T(x), w.shape, T(dy), 2, 1, 1, 6).numpy()) < 1e-13
    wt = rng.standard_normal((6, m, 4, 4))
    yt = dnn.conv_transpose2d(lay(x), wt, None, stride=2, padding=1, output_padding=1, groups=6)
    assert _rel(yt, F.conv_transpose2d(T(x), T(wt), None, 2, 1, 1, 6).numpy()) < 1e-13
    n = 4 if conv_mod.PHASES else 1  # stride 2 in 2-D: four phase convolutions
    assert routed == ["depthwise.forward"] * n + ["depthwise.weight"] + ["depthwise.forward"] * n


def test_other_calls_keep_their_routes(routed, monkeypatch):
    """Grouped convs with several channels a group in and out, and groups 1, stay on conv_direct; numpy
    arrays off the forced route stay on the engine (no launch at all)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 8, 9, 9))
    dnn.conv2d(x, rng.standard_normal((12, 4, 3, 3)), groups=2)
    dnn.conv2d(x, rng.standard_normal((4, 8, 3, 3)))
    dnn.conv2d_weight(x, (8, 2, 3, 3), rng.standard_normal((2, 8, 7, 7)), groups=4)
    assert routed == ["conv_direct.forward", "conv_direct.forward", "conv_direct.weight"]
    monkeypatch.setattr(cd, "applies", lambda x, flops: False)
    w = rng.standard_normal((8, 1, 3, 3))
    y = dnn.conv2d(x, w, padding=1, groups=8)
    assert len(routed) == 3 and _rel(y, F.conv2d(T(x), T(w), None, 1, 1, 1, 8).numpy()) < 1e-12


@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_output_over_its_input(routed, layout):
    """y in x's own memory (a same-shape depthwise conv with out=x on CuPy): x is read from a copy."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 4, 7, 6))
    w = rng.standard_normal((4, 1, 3, 3))
    ref = F.conv2d(T(x), T(w), None, 1, 1, 1, 4).numpy()
    xin = _cl(x) if layout == "cl" else x.copy()
    geo = conv_geometry("conv2d", 2, xin, w, 1, 1, 1, 4)
    dw.forward(geo, xin, layout == "cl", w, xin, None, (None, None, None, None))
    assert _rel(xin, ref) < 1e-13 and routed == ["depthwise.forward"]


_VEC: dict = {}


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 2), st.integers(0, 2), st.integers(1, 2), st.sampled_from([1, 3, 5]), st.booleans(),
       st.sampled_from(["float32", "float64", "bfloat16"]), st.integers(0, 1000))
def test_vector_kernel_compiled_for_the_host_vs_torch(stride, pad, dil, ks, residual, dtype, seed):
    """depthwise_vec's kernel text (16-byte units of channels, tap-major weight) compiled for the host: a
    channels-last depthwise convolution with bias, relu6 and a residual equals torch's in float64 within the
    type's rounding; it applies only to whole units of channels, channels-last, 2-D, multiplier 1."""
    from blasx.dnn import depthwise_vec as dv
    from host_cc import bfloat16, compile_host, tile_types
    if dtype == "bfloat16" and bfloat16 is None:
        pytest.skip("no ml_dtypes")
    dt = np.dtype(bfloat16 if dtype == "bfloat16" else dtype)
    ctype = tile_types()[dt]
    f = "double" if dt == np.float64 else "float"
    key = (dt.str, residual)
    if key not in _VEC:
        src = dv.source(dt, "relu6", residual, "int64")
        ints = ", ".join(f"long long {n}" for n in dv.NAMES)
        res = f"const {ctype}* res, " if residual else ""
        _VEC[key] = compile_host([f'extern "C" void k(const {ctype}* x, const {ctype}* wt, const {f}* sc, '
                                  f'const {f}* sh, {res}{f} p, {ints}, {ctype}* yv, long long units) '
                                  f'{{ for (long long i = 0; i < units; ++i) {{ {src["operation"]} }} }}'])
    lib = _VEC[key]
    if lib is None:
        pytest.skip("no C++ compiler")
    rng = np.random.default_rng(seed)
    k = 2 * dv.per_unit(dt)
    x = rng.standard_normal((2, k, 7, 6)).astype(dt)
    w = rng.standard_normal((k, 1, ks, ks)).astype(dt)
    try:
        geo = conv_geometry("conv2d", 2, x, w, stride, pad, dil, k)
    except ValueError:
        return
    assert dv.applies(geo, True, dt) and not dv.applies(geo, False, dt)
    bias = rng.standard_normal(k)
    ref = F.conv2d(T(x.astype(np.float64)), T(w.astype(np.float64)), T(bias), stride, pad, dil, k).numpy()
    r = rng.standard_normal(ref.shape).astype(dt) if residual else None
    want = np.clip(ref + (r.astype(np.float64) if residual else 0), 0, 6)
    ct = np.float64 if dt == np.float64 else np.float32
    xm, wt = memory(x, True), np.ascontiguousarray(w.reshape(k, -1).T)
    sc, sh = np.ones(k, ct), bias.astype(ct)
    y = np.full(want.size, np.nan).astype(dt)
    prm = dv.params(geo, dt)
    import ctypes
    arrays = [xm, wt, sc, sh, *([memory(r, True)] if residual else [])]
    fn = lib.k
    fn.argtypes = [ctypes.c_void_p] * len(arrays) + [ctypes.c_double if ct == np.float64 else ctypes.c_float] + \
        [ctypes.c_longlong] * len(prm) + [ctypes.c_void_p, ctypes.c_longlong]
    fn(*(a.ctypes.data for a in arrays), 0.0, *prm.values(), y.ctypes.data, y.size // dv.per_unit(dt))
    got = from_memory(y.astype(np.float64), want.shape, True)
    assert _rel(got, want) < {np.float64: 1e-13, np.float32: 1e-6}.get(dt.type, 1e-2)
    geo_m2 = conv_geometry("conv2d", 2, x, np.zeros((2 * k, 1, 3, 3), dt), 1, 1, 1, k)
    assert not dv.applies(geo_m2, True, dt)  # a channel multiplier
