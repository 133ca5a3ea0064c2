"""blasx.dnn's standalone activations (pointwise.py) on numpy arrays against CPU torch in float64: forward
and backward (torch.autograd), every dtype, C-contiguous and channels-last, inplace= and out=, torch's
argument names, every validation error; the one activation table (host forms, CUDA expressions and
gradients share its names) and the CUDA gradient expressions compiled for the host against the host forms.

Tolerances (relative Frobenius error vs float64 torch on the same, already rounded, input): a few units of
roundoff of the type (the result is rounded once; backward of half types also reads a rounded output).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from blasx import dnn
from blasx.dnn.geometry import layout
from blasx.runtime.activations import NAMES, Activation
from blasx.runtime.devices import cuda_epilogue as ce
from dnn_ref import ACTS, DTYPES, TOL, act_fn as _fn, dtype_name as _name, cl, rel, wide
from host_cc import compile_host, tile_types

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _input(dt, lay, seed=0, shape=(3, 5, 7, 4)):
    """Uniform in (-7, 7), off the kinks (-3, 0, 3, 6: torch's vectorised and scalar paths differ at some)."""
    x = np.random.default_rng(seed).uniform(-7, 7, shape).astype(dt)
    x[np.isin(x.astype(np.float64), [-3.0, 0.0, 3.0, 6.0])] = 0.5
    return cl(x) if lay == "cl" else x


# ---------------------------------------------------------------- forward and backward vs torch

@pytest.mark.parametrize("lay", ["nchw", "cl"])
@pytest.mark.parametrize("dt", DTYPES, ids=_name)
@pytest.mark.parametrize("name", list(ACTS))
def test_forward_and_backward_match_torch(name, dt, lay):
    args, table = ACTS[name]
    x = _input(dt, lay)
    g = _input(dt, "nchw", seed=1)
    keep = x.copy()
    y = getattr(dnn, _fn(name))(x, **args)
    assert y.dtype == np.dtype(dt) and y.shape == x.shape and layout(y) == layout(x)
    xt = wide(x, grad=True)
    yt = getattr(F, _fn(name))(xt, **args)
    yt.backward(wide(g))
    tol = TOL[_name(dt)]
    assert rel(y, yt.detach().numpy()) < tol
    saved = y if Activation(table).saves == "output" else x
    dx = getattr(dnn, f"{_fn(name)}_backward")(g, saved, **args)
    assert dx.dtype == np.dtype(dt) and dx.shape == x.shape
    if name == "hardsigmoid":  # torch multiplies by 1/6 rounded to float32 in every type; ours divides by 6
        tol = max(tol, 1e-7)
    assert rel(dx, xt.grad.numpy()) < (4 * tol if Activation(table).saves == "output" else tol)
    np.testing.assert_array_equal(x, keep)  # the input is only read


@pytest.mark.parametrize("name", list(ACTS))
def test_edge_values_and_nan_follow_torch(name):
    args, table = ACTS[name]
    x = np.array([-1e30, -7, -6, -3, -1, -0.0, 0, 1, 3, 6, 7, 1e30, np.inf, -np.inf, np.nan])
    y = getattr(dnn, _fn(name))(x, **args)
    want = getattr(F, _fn(name))(torch.from_numpy(x), **args).numpy()
    np.testing.assert_allclose(y, want, rtol=1e-14, atol=1e-300)  # NaN where torch has NaN
    g = np.linspace(-2, 2, x.size)
    want = []
    for i in range(x.size):  # one element at a time: torch's scalar (definitional) path, as its CUDA one
        xt = wide(x[i:i + 1], grad=True)
        getattr(F, _fn(name))(xt, **args).backward(torch.from_numpy(g[i:i + 1]))
        want.append(xt.grad.item())
    saved = y if Activation(table).saves == "output" else x
    dx = getattr(dnn, f"{_fn(name)}_backward")(g, saved, **args)
    fin = np.isfinite(x) & (np.abs(x) < 1e29)  # torch's gradient at +-inf / huge values is formula-dependent
    rtol = 1e-7 if name == "hardsigmoid" else 1e-10  # (torch's float32 1/6; gelu_tanh's cancellation far out)
    np.testing.assert_allclose(dx[fin], np.array(want)[fin], rtol=rtol, atol=1e-300)


@pytest.mark.parametrize("name", list(ACTS))
def test_a_nan_inputs_gradient_follows_torchs_vectorised_kernels(name):
    """64 NaNs (torch's vectorised path, what a tensor of any size meets): relu6's gradient 0, elu's and
    hardswish's NaN (all three gave grad_output)."""
    args, table = ACTS[name]
    x, g = np.full(64, np.nan), np.linspace(-2, 2, 64)
    xt = wide(x, grad=True)
    getattr(F, _fn(name))(xt, **args).backward(torch.from_numpy(g))
    saved = getattr(dnn, _fn(name))(x, **args) if Activation(table).saves == "output" else x
    np.testing.assert_array_equal(getattr(dnn, f"{_fn(name)}_backward")(g, saved, **args), xt.grad.numpy())


@pytest.mark.parametrize("name", [n for n in ACTS if n not in ("gelu", "gelu_tanh", "sigmoid", "tanh")])
@pytest.mark.parametrize("dt", [np.float32, np.float16], ids=_name)
def test_inplace_writes_the_input_and_returns_it(name, dt):
    args, _ = ACTS[name]
    x = _input(dt, "cl")
    want = getattr(dnn, name)(x, **args)
    y = getattr(dnn, name)(x, **args, inplace=True)
    assert y is x
    np.testing.assert_array_equal(x, want)


@pytest.mark.parametrize("dt", DTYPES, ids=_name)
def test_out_is_written_and_returned(dt):
    x = _input(dt, "nchw")
    out = np.empty_like(x)
    assert dnn.gelu(x, approximate="tanh", out=out) is out
    np.testing.assert_array_equal(out, dnn.gelu(x, approximate="tanh"))
    g = _input(dt, "nchw", seed=1)
    out2 = np.empty_like(x)
    assert dnn.silu_backward(g, x, out=out2) is out2
    np.testing.assert_array_equal(out2, dnn.silu_backward(g, x))
    assert dnn.relu(x, out=x) is x  # out may be the input itself


def test_argument_names_are_torchs():
    for name in ("relu", "relu6", "leaky_relu", "elu", "silu", "hardswish", "hardsigmoid"):
        ours = inspect.signature(getattr(dnn, name)).parameters
        theirs = inspect.signature(getattr(F, name)).parameters
        assert list(ours)[:len(theirs)] == list(theirs), name
        assert all(ours[p].default == theirs[p].default for p in theirs if p != "input"), name
        assert [p for p in ours if p not in theirs] == ["out"]
    gelu = inspect.signature(dnn.gelu).parameters  # torch's approximate is keyword-only
    assert list(gelu) == ["input", "approximate", "out"] and gelu["approximate"].kind == gelu["out"].kind
    for name in ("sigmoid", "tanh"):
        assert list(inspect.signature(getattr(dnn, name)).parameters) == ["input", "out"]


def test_backward_takes_what_the_table_says_torch_saves():
    for name, (_, table) in ACTS.items():
        params = list(inspect.signature(getattr(dnn, f"{_fn(name)}_backward")).parameters)
        assert params[:2] == ["grad_output", Activation(table).saves], name


# ---------------------------------------------------------------- the one table

def test_one_table_host_cuda_and_gradient_forms_share_the_names():
    assert set(NAMES) == set(ce.EXPRESSIONS) - {None} == set(ce.GRADIENTS)
    assert {"hardsigmoid", "gelu_tanh"} <= set(NAMES)
    assert {ACTS[n][1] for n in ACTS} == set(NAMES)  # every entry has a standalone function
    x = np.linspace(-4, 4, 9)
    for n in NAMES:
        act = Activation(n, 0.3 if n in ("leaky_relu", "elu") else None)
        assert act.saves in ("input", "output")
        assert act.host_grad(np.ones_like(x), x).shape == x.shape
    for dt in DTYPES:
        for n in NAMES:
            srcs = {ce.pointwise_source(dt, n, grad)[3] for grad in (False, True)}
            assert len(srcs) == 2


def test_cuda_pointwise_kernels_compiled_for_the_host_match_the_host_forms(tmp_path):
    """The standalone kernels' bodies (forward and gradient; float, double and bfloat16 bits) compiled by
    the host's C++ compiler: the host forms' results within 4 ulps of max(|result|, 1), NaN alike (gelu_tanh's
    gradient within 128: its 1 - tanh^2 cancels, and the host's and numpy's tanh differ by an ulp)."""
    import ctypes
    types = tile_types()
    src = []
    for dt, ctype in types.items():
        f = "double" if dt == np.float64 else "float"
        for n in NAMES:
            _, _, op, kname = ce.pointwise_source(dt, n)
            src.append(f'extern "C" void {kname}(const {ctype}* xs, {ctype}* ys, long n, {f} p) '
                       f'{{ for (long j = 0; j < n; ++j) {{ const {ctype}& xin = xs[j]; {ctype}& yout = ys[j]; '
                       f'{op}; }} }}')
            _, _, op, kname = ce.pointwise_source(dt, n, True)
            src.append(f'extern "C" void {kname}(const {ctype}* gs, const {ctype}* ss, {ctype}* ys, long n, {f} p) '
                       f'{{ for (long j = 0; j < n; ++j) {{ const {ctype}& gin = gs[j]; const {ctype}& saved = ss[j]; '
                       f'{ctype}& yout = ys[j]; {op}; }} }}')
    lib = compile_host(src, tmp_path)
    if lib is None:
        pytest.skip("no C++ compiler")
    x = np.concatenate([np.linspace(-9, 9, 1801), [-3.0, 3.0, 6.0, 0.0, -1e30, 1e30, np.inf, -np.inf, np.nan]])
    g = np.cos(np.arange(x.size)) * 3
    for dt in types:
        ct = np.float64 if dt == np.float64 else np.float32
        cparam = ctypes.c_double if dt == np.float64 else ctypes.c_float
        ulp = 2.0 ** -7 if dt.itemsize == 2 else float(np.finfo(ct).eps)
        xs, gs = x.astype(dt), g.astype(dt)
        for n in NAMES:
            act = Activation(n, 0.3 if n in ("leaky_relu", "elu") else None)
            for grad in (False, True):
                fn = getattr(lib, ce.pointwise_source(dt, n, grad)[3])
                got = np.empty_like(xs)
                ptrs = [a.ctypes.data for a in ((gs, xs) if grad else (xs,))]
                fn.argtypes = [ctypes.c_void_p] * (len(ptrs) + 1) + [ctypes.c_long, cparam]
                fn(*ptrs, got.ctypes.data, got.size, act.param or 0.0)
                wx, wg = xs.astype(ct), gs.astype(ct)
                want = (act.host_grad(wg, wx) if grad else act.host(wx)).astype(dt).astype(np.float64)
                got = got.astype(np.float64)
                assert np.array_equal(np.isnan(got), np.isnan(want)), (n, grad)
                ok = ~np.isnan(want) & (got != want)
                err = np.abs(got[ok] - want[ok]) / np.maximum(np.abs(want[ok]), 1.0)
                bound = 128 * ulp if grad and n == "gelu_tanh" and dt.itemsize > 2 else 4 * ulp  # (1 - tanh^2)
                assert err.size == 0 or err.max() <= bound, (dt, n, grad, err.max())


# ---------------------------------------------------------------- validation

def _x():
    return np.ones((2, 3), np.float32)


@pytest.mark.parametrize("call, exc, fragments", [
    (lambda: dnn.relu([1.0, 2.0]), TypeError, ("input: got list", "numpy or cupy")),
    (lambda: dnn.relu(np.ones(3, np.int32)), TypeError, ("input: dtype int32", "allowed: float64")),
    (lambda: dnn.relu(_x(), inplace=1), TypeError, ("inplace: got 1", "True or False")),
    (lambda: dnn.leaky_relu(_x(), "a"), TypeError, ("negative_slope: got 'a'", "real number")),
    (lambda: dnn.elu(_x(), alpha=True), TypeError, ("alpha: got True", "real number")),
    (lambda: dnn.gelu(_x(), approximate="fast"), ValueError, ("approximate: got 'fast'", "'none', 'tanh'")),
    (lambda: dnn.relu(_x(), out=np.empty((3, 2), np.float32)), ValueError, ("out: expected shape (2, 3)",)),
    (lambda: dnn.relu(_x(), out=np.empty((2, 3))), TypeError, ("out: expected dtype float32", "float64")),
    (lambda: dnn.relu(_x(), out=np.empty((2, 3), np.float32)[:, ::-1].copy().T.T), None, ()),
    (lambda: dnn.relu(_x(), True, out=np.empty((2, 3), np.float32)), ValueError, ("out: inplace=True",)),
    (lambda: dnn.relu_backward(_x(), np.ones((3, 2), np.float32)), ValueError,
     ("output: expected grad_output's shape (2, 3)",)),
    (lambda: dnn.silu_backward(_x(), np.ones((2, 3))), TypeError, ("input: expected grad_output's dtype float32",)),
])
def test_errors_name_the_argument(call, exc, fragments, expect):
    if exc is None:
        call()  # an out of any layout is fine
        return
    expect(exc, *fragments, call=call)


def test_read_only_and_overlapping_arrays_are_refused(expect):
    x = _x()
    x.flags.writeable = False
    expect(ValueError, "input: is read-only", call=lambda: dnn.relu(x, inplace=True))
    y = np.ones((2, 4), np.float32)
    expect(ValueError, "out: overlaps an input", call=lambda: dnn.tanh(y[:, :3], out=y[:, 1:]))
    np.testing.assert_array_equal(y, 1)  # nothing written on error
