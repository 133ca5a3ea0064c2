"""The fused per-channel epilogue on real CUDA GPUs (marker ``gpu``; skipped where CuPy finds
none): the CuPy kernels of runtime/devices/cuda_epilogue.py on tiles of each type, and gemm with
a ChannelAffine epilogue on one and two GPUs, host and CuPy operands, every activation, axis and
type. Tolerances: the kernel alone, 8 units of the tile type's roundoff relative to the larger of
the result, the activation's input and 1 (CUDA's math functions are within 2 ulps, and gelu's and
silu's x * f(x) carries f's error times |x|); the gemm, 4x blasx.precision.tolerance."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dispatch
from blasx import precision as P
from blasx.dnn.activations import affine_reference
from blasx.runtime.activations import parse_activation
from blasx.runtime.epilogues import ChannelAffine

cupy = pytest.importorskip("cupy")
NGPU = blasx.session._cuda_count()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="no CUDA GPU")]

try:
    from ml_dtypes import bfloat16
except ImportError:
    bfloat16 = None

FLOATS = [np.float64, np.float32, np.float16] + ([bfloat16] if bfloat16 is not None else [])
ACTS = [None, "relu", "relu6", ("leaky_relu", 0.2), ("elu", 0.7), "sigmoid", "tanh", "gelu", "gelu_tanh",
        "hardswish", "silu"]
SPECS = ["cuda:0"] + (["cuda:0,1"] if NGPU >= 2 else [])
ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def _name(t):
    return np.dtype(t).name


def _rel(x, ref):
    x = np.asarray(x).astype(np.float64)
    return np.linalg.norm(x - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("dt", FLOATS, ids=_name)
@pytest.mark.parametrize("act", ACTS, ids=str)
@pytest.mark.parametrize("ld", [48, 37], ids=["ld>rows", "contiguous"])
def test_kernel_on_a_tile_of_each_type(dt, act, ld):
    """The kernel in place on a column-major tile with ld > rows (the transposed view) and ld = rows (the flat
    form), vectors along rows and columns: equal to the host's float32 (float64) computation rounded once,
    within 8 roundoffs."""
    from blasx.runtime.devices.cuda_epilogue import affine_activation
    rng = np.random.default_rng(1)
    rows, cols = 37, 29
    host = (rng.standard_normal((ld, cols)) * 3).astype(dt)
    ct = np.float64 if np.dtype(dt) == np.float64 else np.float32
    parsed = parse_activation(act)
    for axis in (0, 1):
        vec = rng.uniform(0.5, 2, (rows, cols)[axis]).astype(ct), rng.standard_normal((rows, cols)[axis]).astype(ct)
        bits = host.view(np.uint16) if np.dtype(dt).itemsize == 2 else host
        dev = cupy.asfortranarray(cupy.asarray(bits))
        sc, sh = (cupy.asarray(v)[:, None] if axis == 0 else cupy.asarray(v)[None, :] for v in vec)
        stream = cupy.cuda.Stream(non_blocking=True)
        affine_activation(stream, (dev.data.ptr, ld), rows, cols, dt, sc, sh,
                          None if parsed is None else parsed.name, (parsed.param if parsed else None) or 0.0)
        stream.synchronize()
        got = cupy.asnumpy(dev).view(host.dtype) if np.dtype(dt).itemsize == 2 else cupy.asnumpy(dev)
        v = host[:rows].astype(ct) * (vec[0][:, None] if axis == 0 else vec[0][None, :])
        v = v + (vec[1][:, None] if axis == 0 else vec[1][None, :])
        want = (v if parsed is None else parsed.host(v)).astype(dt).astype(np.float64)
        g = got[:rows].astype(np.float64)
        err = np.abs(g - want) / np.maximum(np.maximum(np.abs(want), np.abs(v)), 1.0)
        assert err.max() <= 8 * ROUNDOFF[_name(dt)], (act, axis, err.max())
        np.testing.assert_array_equal(got[rows:], host[rows:])  # the ld padding is not touched


@pytest.fixture(params=SPECS)
def spec(request):
    blasx.configure(devices=request.param, tile=256, cache_bytes=256 << 20, cpu=False)
    yield request.param
    blasx.shutdown()


@pytest.mark.parametrize("dt", FLOATS, ids=_name)
@pytest.mark.parametrize("where", ["host", "cupy"])
def test_gemm_with_the_epilogue(spec, dt, where):
    """Every activation x axis, C in either order (C order: the epilogue runs transposed),
    edge tiles and 3 k-steps at tile 256."""
    rng = np.random.default_rng(2)
    m, n, k = 700, 530, 610
    a = np.asfortranarray(rng.standard_normal((m, k)).astype(dt))
    b = np.asfortranarray(rng.standard_normal((k, n)).astype(dt))
    y = a.astype(np.float64) @ b.astype(np.float64)
    tol = 4 * P.tolerance(dt, k)
    xp = np if where == "host" else cupy
    da, db = (a, b) if where == "host" else (cupy.asarray(a), cupy.asarray(b))
    for i, act in enumerate(ACTS):
        for axis in (0, 1):
            size = (m, n)[axis]
            scale, shift = rng.uniform(0.5, 2.0, size), rng.standard_normal(size)
            c = xp.zeros((m, n), dtype=dt, order="FC"[(i + axis) % 2])
            vecs = (scale, shift) if where == "host" else (cupy.asarray(scale), cupy.asarray(shift))
            dispatch.gemm(1.0, da, db, 0.0, c, 0, 0, dt, k, epilogue=ChannelAffine(axis, *vecs, act))
            got = c if where == "host" else cupy.asnumpy(c)
            err = _rel(got, affine_reference(y, axis, scale, shift, act))
            assert err <= tol, (act, axis, err, tol)


def test_residual_tf32_and_a_float32_output(spec):
    """beta C inside the activation under TF32 math; float16 inputs with a float32 output."""
    rng = np.random.default_rng(3)
    m, n, k = 520, 610, 300
    a = np.asfortranarray(rng.standard_normal((m, k)).astype(np.float32))
    b = np.asfortranarray(rng.standard_normal((k, n)).astype(np.float32))
    res = np.asfortranarray(rng.standard_normal((m, n)).astype(np.float32))
    shift = rng.standard_normal(m)
    c = res.copy(order="F")
    dispatch.gemm(1.0, a, b, 1.0, c, 0, 0, np.float32, k, math="tf32",
                  epilogue=ChannelAffine(0, None, shift, "relu"))
    want = affine_reference(a.astype(np.float64) @ b + res, 0, None, shift, "relu")
    assert _rel(c, want) <= 4 * P.tolerance(np.float32, k, math="tf32")
    h_a, h_b = a.astype(np.float16), b.astype(np.float16)
    c = np.zeros((m, n), dtype=np.float32, order="F")
    scale = rng.uniform(0.5, 2, n)
    dispatch.gemm(1.0, h_a, h_b, 0.0, c, 0, 0, np.float16, k, epilogue=ChannelAffine(1, scale, None, "gelu"))
    want = affine_reference(h_a.astype(np.float64) @ h_b.astype(np.float64), 1, scale, None, "gelu")
    assert _rel(c, want) <= 4 * P.tolerance(np.float16, k, np.float32)


def test_vectors_repeat_along_the_axis(spec):
    """NCHW conv's C (P, N*K): K = 100 values serve 7 images; 256-wide tiles span repetitions."""
    rng = np.random.default_rng(4)
    p, images, kc, k = 300, 7, 100, 200
    for axis in (0, 1):
        m, n = (images * kc, p) if axis == 0 else (p, images * kc)
        a = np.asfortranarray(rng.standard_normal((m, k)).astype(np.float32))
        b = np.asfortranarray(rng.standard_normal((k, n)).astype(np.float32))
        scale, shift = rng.uniform(0.5, 2, kc), rng.standard_normal(kc)
        c = np.zeros((m, n), dtype=np.float32, order="F")
        dispatch.gemm(1.0, a, b, 0.0, c, 0, 0, np.float32, k, epilogue=ChannelAffine(axis, scale, shift, "silu"))
        want = affine_reference(a.astype(np.float64) @ b, axis, np.tile(scale, images), np.tile(shift, images), "silu")
        assert _rel(c, want) <= 4 * P.tolerance(np.float32, k)
