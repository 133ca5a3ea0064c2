"""The fused per-channel epilogue (runtime/epilogues.py ChannelAffine): ``act(tile * scale + shift)``
on each finished C tile of a gemm, on the sim (1-3 devices) and the CPU, against numpy on the
float64 product; the activation table (torch's formulas) and ``parse_activation``.

Tolerances (relative Frobenius error vs float64): 4x blasx.precision.tolerance of the call's type
(the gemm's own error, which an activation's slope (<= 1.5) and the norm change may at most
roughly double twice); the activations alone: a few units of roundoff of the compute type.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

import blasx
from blasx import dispatch
from blasx import precision as P
from blasx.dnn.activations import affine_reference, reference
from blasx.runtime.activations import NAMES, Activation, parse_activation
from blasx.runtime.epilogues import ChannelAffine
from blasx.runtime.tiling import TileRef
from host_cc import compile_host, tile_types

try:
    from ml_dtypes import bfloat16
except ImportError:
    bfloat16 = None

FLOATS = [np.float64, np.float32, np.float16] + ([bfloat16] if bfloat16 is not None else [])
ACTS = [None, "relu", "relu6", ("leaky_relu", 0.2), ("elu", 0.7), "sigmoid", "tanh", "gelu", "gelu_tanh",
        "hardswish", "silu"]


def _name(t):
    return np.dtype(t).name


# ---------------------------------------------------------------- the activations on the host

def _phi(x):
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


SCALAR = {  # torch's definitions, one float at a time
    "relu": lambda x: max(x, 0.0),
    "relu6": lambda x: min(max(x, 0.0), 6.0),
    "leaky_relu": lambda x: x if x >= 0 else 0.2 * x,
    "elu": lambda x: x if x > 0 else 0.7 * (math.exp(x) - 1),
    "sigmoid": lambda x: 1 / (1 + math.exp(-x)),
    "tanh": math.tanh,
    "gelu": lambda x: x * _phi(x),
    "gelu_tanh": lambda x: 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
    "hardswish": lambda x: x * min(max(x + 3, 0.0), 6.0) / 6,
    "silu": lambda x: x / (1 + math.exp(-x)),
    "hardsigmoid": lambda x: min(max(x + 3, 0.0), 6.0) / 6,
}


def _act(name):
    return parse_activation({"leaky_relu": ("leaky_relu", 0.2), "elu": ("elu", 0.7)}.get(name, name))


@pytest.mark.parametrize("name", NAMES)
def test_activations_follow_torchs_formulas(name):
    x = np.concatenate([np.linspace(-8, 8, 161), [-3.0, 0.0, 3.0, 6.0, -0.0]])
    want = np.array([SCALAR[name](float(v)) for v in x])
    act = _act(name)
    got = act.host(x)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)
    got32 = act.host(x.astype(np.float32))
    assert got32.dtype == np.float32  # computed in float32, not widened
    np.testing.assert_allclose(got32, want, rtol=4e-6, atol=4e-7)


@pytest.mark.parametrize("dt", [np.float32, np.float64], ids=_name)
def test_activations_are_stable_and_pass_nan(dt):
    x = np.array([-1e30, -1e4, -1e3, 1e3, 1e4, 1e30, np.inf, -np.inf, np.nan], dtype=dt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = {n: _act(n).host(x) for n in NAMES}
    for n, y in out.items():
        assert np.isnan(y[-1]), n  # NaN in, NaN out
        assert not np.isnan(y[:6]).any(), (n, y)
    np.testing.assert_array_equal(out["sigmoid"][:6], [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(out["silu"][:3], [0, 0, 0])
    np.testing.assert_array_equal(out["tanh"][:6], [-1, -1, -1, 1, 1, 1])
    np.testing.assert_array_equal(out["elu"][:3], np.full(3, -0.7, dtype=dt))
    np.testing.assert_array_equal(out["relu6"][:6], [0, 0, 0, 6, 6, 6])


def test_parse_activation_forms():
    assert parse_activation(None) is None
    assert parse_activation("relu") == Activation("relu", None)
    assert parse_activation("leaky_relu") == Activation("leaky_relu", 0.01)  # torch's defaults
    assert parse_activation("elu") == Activation("elu", 1.0)
    assert parse_activation(("leaky_relu", 0.2)) == Activation("leaky_relu", 0.2)
    assert parse_activation(("elu", 2)) == Activation("elu", 2.0)
    assert parse_activation({"name": "leaky_relu", "negative_slope": 0.3}) == Activation("leaky_relu", 0.3)
    assert parse_activation({"name": "elu", "alpha": 0.5}) == Activation("elu", 0.5)
    assert parse_activation({"name": "gelu"}) == Activation("gelu", None)
    assert parse_activation(("gelu", "tanh")) == Activation("gelu_tanh", None)
    assert parse_activation({"name": "gelu", "approximate": "none"}) == Activation("gelu", None)
    act = Activation("silu")
    assert parse_activation(act) is act
    assert set(NAMES) == set(SCALAR)


@pytest.mark.parametrize("value, exc, fragment", [
    ("swish", ValueError, "unknown name 'swish'"),
    ("Relu", ValueError, "unknown name"),
    (("relu", 0.5), ValueError, "relu takes no parameter"),
    (("leaky_relu", "x"), ValueError, "negative_slope must be a finite real number"),
    (("elu", float("inf")), ValueError, "alpha must be a finite real number"),
    (("elu", True), ValueError, "alpha must be a finite real number"),
    (("gelu", "fast"), ValueError, "approximate is 'none' or 'tanh'"),
    ({"name": "elu", "slope": 1}, ValueError, "unknown keys ['slope']"),
    (3, TypeError, "of type int"),
    (["relu"], TypeError, "of type list"),
    (("relu", 1, 2), TypeError, "of type tuple"),
])
def test_parse_activation_errors_name_the_argument(value, exc, fragment, expect):
    msg = expect(exc, "activation: got", fragment, "allowed: None, 'relu'", "'hardswish'",
                 call=lambda: parse_activation(value))
    assert repr(value) in msg


def test_reference_keeps_the_input_type():
    x = np.linspace(-3, 3, 13)
    for dt in FLOATS:
        y = reference(x.astype(dt), "hardswish")
        assert y.dtype == np.dtype(dt)
    np.testing.assert_array_equal(reference(x, None), x)


# ---------------------------------------------------------------- the epilogue object

def test_channel_affine_checks_its_arguments(expect):
    expect(ValueError, "axis: got 2", "allowed: 0", call=lambda: ChannelAffine(2))
    expect(ValueError, "axis: got True", call=lambda: ChannelAffine(True))
    expect(ValueError, "scale: got shape (2, 3)", "1-D", call=lambda: ChannelAffine(0, scale=np.ones((2, 3))))
    expect(ValueError, "shift: got shape (0,)", call=lambda: ChannelAffine(0, shift=[]))
    expect(TypeError, "shift: got an array of complex128", call=lambda: ChannelAffine(0, shift=np.ones(3) * 1j))
    expect(ValueError, "shift: got 4 values, scale has 3", call=lambda: ChannelAffine(1, np.ones(3), np.ones(4)))
    expect(ValueError, "activation: got 'bogus'", call=lambda: ChannelAffine(0, activation="bogus"))
    ep = ChannelAffine(0, shift=np.arange(5))
    assert ep.size == 5 and ep.scale is None and ep.shift.dtype == np.float64
    ep.check(5, 7)
    ep.check(15, 1)  # three repetitions
    expect(ValueError, "shift: got 5 values, the output has 7 rows (C's channel axis), not a multiple of 5",
           call=lambda: ep.check(7, 5))
    expect(ValueError, "scale: got 2 values", "3 columns", call=lambda: ChannelAffine(1, [1, 2]).check(2, 3))
    ChannelAffine(1, activation="relu").check(3, 4)  # no vectors: any shape
    assert ChannelAffine(0).size is None


def test_transposed_swaps_the_axis_and_keeps_the_rest():
    ep = ChannelAffine(0, np.arange(3.0), np.ones(3), ("elu", 0.5))
    t = ep.transposed()
    assert t.axis == 1 and t.transposed().axis == 0
    assert t.activation == Activation("elu", 0.5)
    np.testing.assert_array_equal(t.scale, ep.scale)
    np.testing.assert_array_equal(t.shift, ep.shift)
    assert not hasattr(ep, "dtype")  # it converts nothing: the write-back reads the accumulator's type


@pytest.mark.parametrize("dt", FLOATS, ids=_name)
@pytest.mark.parametrize("axis", [0, 1])
def test_a_tile_is_computed_in_float32_and_rounded_once(dt, axis):
    """On the CPU device's path, a tile of each type: computed in float32 (float64 for float64)
    from the tile's own values, rounded once to the tile's type; only the tile's part of the
    vectors is read."""
    rng = np.random.default_rng(3)
    full = rng.standard_normal((9, 7)).astype(dt)
    scale, shift = rng.uniform(0.5, 2, (9, 7)[axis]), rng.standard_normal((9, 7)[axis])
    ref = TileRef(2, 0, 0, 2, 3, 4, 3)  # rows 2..5, cols 3..5
    tile = np.asfortranarray(full[2:6, 3:6])
    task = SimpleNamespace(c=ref, call=SimpleNamespace(acc_dtype=tile.dtype))
    ChannelAffine(axis, scale, shift, "gelu")(SimpleNamespace(kind="cpu"), 0, tile, task)
    ct = np.float64 if np.dtype(dt) == np.float64 else np.float32
    sc = scale[2:6, None] if axis == 0 else scale[None, 3:6]
    sh = shift[2:6, None] if axis == 0 else shift[None, 3:6]
    v = full[2:6, 3:6].astype(ct) * sc.astype(ct) + sh.astype(ct)
    want = parse_activation("gelu").host(v).astype(dt)
    assert tile.dtype == np.dtype(dt)
    np.testing.assert_array_equal(tile.astype(np.float64), want.astype(np.float64))


# ---------------------------------------------------------------- on the engine

def _configure(dev):
    blasx.configure(devices=dev, tile=None if dev == "cpu" else 32)


def _operands(rng, m, n, k, dt, c_order="F"):
    a = np.asfortranarray(rng.standard_normal((m, k)).astype(dt))
    b = np.asfortranarray(rng.standard_normal((k, n)).astype(dt))
    c = np.zeros((m, n), dtype=dt, order=c_order)
    return a, b, c


def _rel(x, ref):
    x = np.asarray(x).astype(np.float64)
    return np.linalg.norm(x - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("dev", ["sim:1", "sim:2", "sim:3", "cpu"])
@pytest.mark.parametrize("dt", FLOATS, ids=_name)
def test_every_activation_and_axis_on_the_engine(dev, dt):
    """Each activation x axis x C's memory order (C order: the front end computes C^T and the
    epilogue runs transposed), edge tiles on every side."""
    _configure(dev)
    rng = np.random.default_rng(7)
    m, n, k = 70, 45, 40
    tol = 4 * P.tolerance(dt, k)
    for i, act in enumerate(ACTS):
        for axis in (0, 1):
            a, b, c = _operands(rng, m, n, k, dt, c_order="FC"[(i + axis) % 2])
            size = (m, n)[axis]
            scale, shift = rng.uniform(0.5, 2.0, size), rng.standard_normal(size)
            dispatch.gemm(1.0, a, b, 0.0, c, 0, 0, dt, k, epilogue=ChannelAffine(axis, scale, shift, act))
            assert c.dtype == np.dtype(dt)
            want = affine_reference(a.astype(np.float64) @ b.astype(np.float64), axis, scale, shift, act)
            err = _rel(c, want)
            assert err <= tol, (act, axis, err, tol)


@pytest.mark.parametrize("dev", ["sim:1", "sim:3", "cpu"])
def test_vectors_repeat_along_the_axis(dev):
    """NCHW conv's C is (P, N*K), column n*K + k: K values serve N images, tiles of 32 columns
    starting anywhere in a repetition and spanning its end (K = 24); rows likewise."""
    _configure(dev)
    rng = np.random.default_rng(13)
    p, images, kc, k = 50, 5, 24, 30
    for axis in (0, 1):
        m, n = (images * kc, p) if axis == 0 else (p, images * kc)
        a, b, c = _operands(rng, m, n, k, np.float32)
        scale, shift = rng.uniform(0.5, 2, kc), rng.standard_normal(kc)
        ep = ChannelAffine(axis, scale, shift, "relu6")
        ep.check(m, n)
        dispatch.gemm(1.0, a, b, 0.0, c, 0, 0, np.float32, k, epilogue=ep)
        want = affine_reference(a.astype(np.float64) @ b, axis, np.tile(scale, images), np.tile(shift, images), "relu6")
        assert _rel(c, want) <= 4 * P.tolerance(np.float32, k)


@pytest.mark.parametrize("dev", ["sim:2", "cpu"])
def test_scale_shift_each_optional_and_the_residual_through_beta(dev):
    """scale alone, shift alone, activation alone; beta C (conv's residual) inside the
    activation; transposed operands and alpha."""
    _configure(dev)
    rng = np.random.default_rng(11)
    m, n, k = 66, 50, 33
    for dt in (np.float64, np.float32):
        a = np.asfortranarray(rng.standard_normal((k, m)).astype(dt))  # used transposed
        b = np.asfortranarray(rng.standard_normal((k, n)).astype(dt))
        residual = rng.standard_normal((m, n)).astype(dt)
        y = 0.5 * (a.astype(np.float64).T @ b) + residual.astype(np.float64)
        for axis, scale, shift, act in [(0, rng.uniform(0.5, 2, m), None, "relu"),
                                        (1, None, rng.standard_normal(n), "silu"),
                                        (1, None, None, ("leaky_relu", 0.1)),
                                        (0, rng.uniform(-2, 2, m), rng.standard_normal(m), None)]:
            c = np.asfortranarray(residual.copy())
            dispatch.gemm(0.5, a, b, 1.0, c, 1, 0, dt, k, epilogue=ChannelAffine(axis, scale, shift, act))
            assert _rel(c, affine_reference(y, axis, scale, shift, act)) <= 4 * P.tolerance(dt, k), (dt, axis, act)


@pytest.mark.parametrize("dev", ["sim:2", "cpu"])
@pytest.mark.parametrize("dt", [np.float16] + ([bfloat16] if bfloat16 is not None else []), ids=_name)
def test_half_inputs_with_a_float32_output(dev, dt):
    """A mixed call whose output keeps the float32 accumulator: the epilogue's result unrounded."""
    _configure(dev)
    rng = np.random.default_rng(5)
    m, n, k = 40, 70, 50
    a, b, _ = _operands(rng, m, n, k, dt)
    c = np.zeros((m, n), dtype=np.float32, order="F")
    shift = rng.standard_normal(n)
    dispatch.gemm(1.0, a, b, 0.0, c, 0, 0, dt, k, epilogue=ChannelAffine(1, None, shift, "tanh"))
    want = affine_reference(a.astype(np.float64) @ b.astype(np.float64), 1, None, shift, "tanh")
    assert _rel(c, want) <= 4 * P.tolerance(dt, k, np.float32)


def test_a_tile_type_it_cannot_take_fails_the_call_not_the_engine():
    _configure("sim:2")
    rng = np.random.default_rng(2)
    a = np.asfortranarray(rng.standard_normal((40, 40)) + 1j)
    c = np.zeros((40, 40), dtype=np.complex128, order="F")
    with pytest.raises(TypeError, match="complex128"):
        dispatch.gemm(1.0, a, a, 0.0, c, 0, 0, np.complex128, 40, epilogue=ChannelAffine(0, activation="relu"))
    x = rng.standard_normal((40, 40))
    np.testing.assert_allclose(blasx.gemm(1.0, x, x), x @ x)  # the engine goes on


def test_timing_mode_skips_the_work():
    blasx.configure(devices="sim:2,timing=1", tile=32)
    a = np.ones((64, 64), order="F")
    c = np.zeros((64, 64), order="F")
    dispatch.gemm(1.0, a, a, 0.0, c, 0, 0, np.float64, 64, epilogue=ChannelAffine(0, shift=np.ones(64)))
    assert not c.any()  # data-free: no product and no epilogue on the host arrays


# ---------------------------------------------------------------- the CUDA forms, checked on the host

def test_every_tile_type_and_activation_has_a_cuda_kernel():
    from blasx.runtime.devices import cuda_epilogue as ce
    names = {ce.kernel_source(dt, a)[3] for dt in FLOATS for a in (None, *NAMES)}
    assert len(names) == len(FLOATS) * (len(NAMES) + 1)
    with pytest.raises(TypeError, match="int32"):
        ce.kernel_source(np.int32, "relu")


def test_flat_form_indexes_the_vectors_as_broadcasting_does():
    """The flat kernel's (divisor, modulus) take each column-major element's flat index to the entry its
    row (a (rows, 1) vector), its column ((1, cols)) or the one value ((1, 1)) gives, as numpy broadcasts."""
    from blasx.runtime.devices import cuda_epilogue as ce
    for rows, cols in ((1, 1), (1, 7), (5, 1), (37, 29)):
        u = np.arange(rows * cols)
        for shape in ((rows, 1), (1, cols), (1, 1)):
            v = np.arange(1, int(np.prod(shape)) + 1).reshape(shape)
            d, m = ce._flat_index(v, rows)
            want = np.broadcast_to(v, (rows, cols)).reshape(-1, order="F")
            assert np.array_equal(v.reshape(-1)[(u // int(d)) % int(m)], want), (rows, cols, shape)
    names = {ce.flat_kernel_source(dt, a)[3] for dt in FLOATS for a in (None, *NAMES)}
    assert len(names) == len(FLOATS) * (len(NAMES) + 1)


def test_cuda_expressions_compiled_for_the_host_match_numpy(tmp_path):
    """The kernels' loop bodies (float, double and bfloat16 bits; float16 needs CUDA's type)
    compiled with the host's C++ compiler: the same results as the numpy forms within 2 ulps of
    the larger of the result and 1, NaN where numpy has NaN, bfloat16 rounding exact."""
    import ctypes
    from blasx.runtime.devices import cuda_epilogue as ce
    types = tile_types()
    acts = [None, *NAMES]
    src = []
    for dt, ctype in types.items():
        f = "double" if dt == np.float64 else "float"
        for a in acts:
            _, _, op, name = ce.kernel_source(dt, a)
            src.append(f'extern "C" void {name}({ctype}* ys, long n, {f} sc, {f} sh, {f} p) '
                       f'{{ for (long j = 0; j < n; ++j) {{ {ctype}& y = ys[j]; {op}; }} }}')
    lib = compile_host(src, tmp_path)
    if lib is None:
        pytest.skip("no C++ compiler")
    x = np.concatenate([np.linspace(-30, 30, 2001), [-1e30, 1e30, np.inf, -np.inf, np.nan, 0.0]])
    for dt in types:
        ct = np.float64 if dt == np.float64 else np.float32
        cparam = ctypes.c_double if dt == np.float64 else ctypes.c_float
        ulp = 2.0 ** -7 if dt.itemsize == 2 else float(np.finfo(ct).eps)
        for a in acts:
            act = _act(a) if a else None
            fn = getattr(lib, ce.kernel_source(dt, a)[3])
            fn.argtypes = [ctypes.c_void_p, ctypes.c_long, cparam, cparam, cparam]
            y = x.astype(dt)
            got = y.copy()
            fn(got.ctypes.data, got.size, 1.5, 0.25, (act.param if act else None) or 0.0)
            v = y.astype(ct) * ct(1.5) + ct(0.25)
            want = (v if act is None else act.host(v)).astype(dt).astype(np.float64)
            got = got.astype(np.float64)
            assert np.array_equal(np.isnan(got), np.isnan(want)), a
            ok = ~np.isnan(want) & (got != want)
            err = np.abs(got[ok] - want[ok]) / np.maximum(np.abs(want[ok]), 1.0)
            assert err.size == 0 or err.max() <= 2 * ulp, (dt, a, err.max())


def test_vector_and_flat_forms_compiled_for_the_host_give_each_element_its_entries(tmp_path):
    """The 16-byte vector form (cuda_epilogue.vector_kernel_source) and the flat form, their texts compiled for
    the host, with and without a residual: each element gets the scale and shift entries numpy's broadcasting
    gives it (per-row, per-column and single vectors); vector_index refuses shapes whose units would straddle
    two entries."""
    import ctypes
    from blasx.runtime.devices import cuda_epilogue as ce
    types = tile_types()
    src = []
    for dt, ctype in types.items():
        f = "double" if dt == np.float64 else "float"
        for res in (False, True):
            rv = f", const {ctype}* rv" if res else ""
            _, _, op, name = ce.vector_kernel_source(dt, "relu", res)
            src.append(f'extern "C" void {name}({ctype}* yv, long n, const {f}* scv, const {f}* shv, {f} p, '
                       f'unsigned sd, unsigned sm, unsigned ss, unsigned hd, unsigned hm, unsigned hs{rv}) '
                       f'{{ for (long i = 0; i < n; ++i) {{ {op} }} }}')
            _, _, op, name = ce.flat_kernel_source(dt, "relu", res)
            src.append(f'extern "C" void {name}({ctype}* ys, long n, const {f}* scv, const {f}* shv, {f} p, '
                       f'unsigned sd, unsigned sm, unsigned hd, unsigned hm{rv}) '
                       f'{{ for (long i = 0; i < n; ++i) {{ {ctype}& y = ys[i]; {op}; }} }}')
    lib = compile_host(src, tmp_path)
    if lib is None:
        pytest.skip("no C++ compiler")
    rng = np.random.default_rng(0)
    for dt in types:
        ct = np.float64 if dt == np.float64 else np.float32
        per = ce.VECTOR_BYTES // dt.itemsize
        cparam = ctypes.c_double if dt == np.float64 else ctypes.c_float
        rows, cols = 3 * per, 5
        for res in (False, True):
            vec = getattr(lib, ce.vector_kernel_source(dt, "relu", res)[3])
            flat = getattr(lib, ce.flat_kernel_source(dt, "relu", res)[3])
            tail = [ctypes.c_void_p] if res else []
            vec.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, cparam] + \
                [ctypes.c_uint] * 6 + tail
            flat.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, cparam] + \
                [ctypes.c_uint] * 4 + tail
            for shapes in (((rows, 1), (1, 1)), ((1, cols), (rows, 1)), ((1, 1), (1, cols))):
                sc, sh = (np.ascontiguousarray(rng.standard_normal(s).astype(ct)) for s in shapes)
                y = rng.standard_normal(rows * cols).astype(dt)
                r = rng.standard_normal(rows * cols).astype(dt)
                full = [np.broadcast_to(v, (rows, cols)).reshape(-1, order="F") for v in (sc, sh)]
                want = y.astype(ct) * full[0] + full[1] + (r.astype(ct) if res else 0)
                want = np.maximum(want, 0).astype(dt).astype(np.float64)
                extra = [r.ctypes.data] if res else []
                got = y.copy()
                idx = [ce.vector_index(v, rows, per) for v in (sc, sh)]
                vec(got.ctypes.data, got.size // per, sc.ctypes.data, sh.ctypes.data, 0.0,
                    *(int(a) for a in idx[0] + idx[1]), *extra)
                assert np.array_equal(got.astype(np.float64), want), (dt, shapes, res, "vector")
                got = y.copy()
                fidx = [ce._flat_index(v, rows) for v in (sc, sh)]
                flat(got.ctypes.data, got.size, sc.ctypes.data, sh.ctypes.data, 0.0,
                     *(int(a) for a in fidx[0] + fidx[1]), *extra)
                assert np.array_equal(got.astype(np.float64), want), (dt, shapes, res, "flat")
    assert ce.vector_index(np.ones((1, 5)), 6, 4) is None  # a unit spans two columns' entries
    assert ce.vector_index(np.ones((6, 1)), 6, 4) is None  # a unit spans the end of the rows' vector
    assert ce.vector_index(np.ones((1, 5)), 8, 4)[2] == 0 and ce.vector_index(np.ones((8, 1)), 8, 4)[2] == 1
