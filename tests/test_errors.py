"""Bad arguments: every error names the parameter, the value received and what is
allowed, and nothing is written (c is compared byte for byte before and after)."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx.runtime.devices.base import DeviceError


@pytest.fixture
def sim2():
    blasx.configure(devices="sim:2", tile=16)


@pytest.fixture
def abc(rand):
    """a 20x30, b 30x10, c 20x10 float64, and c's bytes before the call."""
    a, b, c = rand((20, 30), np.float64, 1), rand((30, 10), np.float64, 2), rand((20, 10), np.float64, 3)
    return a, b, c, c.tobytes()


# --------------------------------------------------------------------------- shapes

def test_inner_dimension_mismatch_names_a_and_b(sim2, rand, abc, expect):
    a, _, c, before = abc
    b = rand((25, 10), np.float64, 4)
    expect(ValueError, "a, b", "a.shape=(20, 30)", "b.shape=(25, 10)", "inner dimensions must match",
           call=lambda: blasx.gemm(1.0, a, b, 1.0, c, overwrite_c=True))
    assert c.tobytes() == before
    # with transposes the message gives op(a) and op(b) and the flags
    expect(ValueError, "op(a) is 30x20", "trans_a=1", "op(b) is 30x10",
           call=lambda: blasx.gemm(1.0, a, rand((30, 10)), trans_a=1))


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4), ()])
def test_non_2d_operands(sim2, abc, shape, expect):
    a, b, c, before = abc
    bad = np.ones(shape)
    expect(ValueError, "a:", f"{len(shape)}-D", str(shape), "2-D matrix",
           call=lambda: blasx.gemm(1.0, bad, b, 1.0, c, overwrite_c=True))
    expect(ValueError, "b:", f"{len(shape)}-D", call=lambda: blasx.gemm(1.0, a, bad, 1.0, c, overwrite_c=True))
    expect(ValueError, "c:", f"{len(shape)}-D", call=lambda: blasx.gemm(1.0, a, b, 1.0, bad, overwrite_c=True))
    assert c.tobytes() == before


@pytest.mark.parametrize("shape", [(10, 20), (20, 11), (1, 1)])
def test_c_of_wrong_shape(sim2, abc, shape, expect):
    a, b, _, _ = abc
    c = np.ones(shape)
    before = c.tobytes()
    expect(ValueError, "c:", f"got shape {shape}", "expected (20, 10)",
           call=lambda: blasx.gemm(1.0, a, b, 1.0, c, overwrite_c=True))
    assert c.tobytes() == before


# --------------------------------------------------------------------------- dtypes

@pytest.mark.parametrize("bad_dtype,fragment", [(object, "object"), ("U3", "<U")])
def test_unknown_dtypes(sim2, abc, bad_dtype, fragment, expect):
    a, b, c, before = abc
    bad = np.ones((20, 30)).astype(bad_dtype)
    for call in (lambda: blasx.gemm(1.0, bad, b, 1.0, c, overwrite_c=True),
                 lambda: blasx.gemm(1.0, bad, bad.T.copy(), 1.0, c, overwrite_c=True)):
        expect(TypeError, "dtype:", fragment, "allowed: float32, float64, complex64, complex128", call=call)
    assert c.tobytes() == before


@pytest.mark.parametrize("bad_dtype", ["M8[s]", "m8[s]"])
def test_unpromotable_dtypes_get_a_blasx_message(sim2, abc, bad_dtype, expect):
    """Regression: numpy's DTypePromotionError used to escape compute_dtype unexplained."""
    a, b, c, before = abc
    bad = np.ones((20, 30)).astype(bad_dtype)
    expect(TypeError, "dtype:", str(np.dtype(bad_dtype)), "allowed: float32, float64, complex64, complex128",
           call=lambda: blasx.gemm(1.0, bad, b, 1.0, c, overwrite_c=True))
    assert c.tobytes() == before


# --------------------------------------------------------------------------- aliasing

def test_c_aliasing_an_input_is_rejected(sim2, rand, expect):
    a, b = rand((24, 24), np.float64, 1), rand((24, 24), np.float64, 2)
    for c, name in ((a, "a"), (b, "b"), (a.T, "a"), (a[:, ::-1], "a"), (b[::1, :], "b")):
        before = c.tobytes()
        expect(ValueError, "c:", f"shares memory with {name}", "must not alias",
               call=lambda: blasx.gemm(1.0, a, b, 1.0, c, overwrite_c=True))
        assert c.tobytes() == before
    # partial overlap of views of one buffer
    big = rand((40, 40), np.float64, 3)
    a, c = big[:20, :20], big[10:30, 10:30]
    before = big.tobytes()
    expect(ValueError, "shares memory with a", call=lambda: blasx.gemm(1.0, a, b[:20, :20], 1.0, c, overwrite_c=True))
    assert big.tobytes() == before
    # disjoint views of one buffer are fine
    c = big[20:40, 20:40]
    ref = a @ b[:20, :20] + c
    assert blasx.gemm(1.0, a, b[:20, :20], 1.0, c, overwrite_c=True) is c
    np.testing.assert_allclose(c, ref, rtol=1e-12)


# --------------------------------------------------------------------------- flags and scalars

@pytest.mark.parametrize("value", [3, -1, "x", "N", 1.0, None])
@pytest.mark.parametrize("name", ["trans_a", "trans_b"])
def test_bad_trans_flags(sim2, abc, name, value, expect):
    a, b, c, before = abc
    msg = expect(ValueError, f"{name}:", repr(value), "allowed: 0 (N), 1 (T), 2 (C",
                 call=lambda: blasx.gemm(1.0, a, b.T.copy() if name == "trans_b" else b, 1.0, c,
                                         overwrite_c=True, **{name: value}))
    assert msg.startswith(name)
    assert c.tobytes() == before


@pytest.mark.parametrize("value", ["no", "0", [0], -1, 2, 0.5, None])
@pytest.mark.parametrize("routine", ["gemm", "symm", "syrk", "syr2k", "trmm", "trsm"])
def test_bad_overwrite_flags_raise_and_leave_the_array_alone(sim2, rand, routine, value, expect):
    """overwrite_c / overwrite_b take False / True or 0 / 1: a truthy "no" or 2 wrote the caller's array."""
    a = rand((12, 12), seed=1) + 12 * np.eye(12)
    b, c = np.asfortranarray(rand((12, 12), seed=2)), np.asfortranarray(rand((12, 12), seed=3))
    name = "overwrite_b" if routine in ("trmm", "trsm") else "overwrite_c"
    call = {"gemm": lambda: blasx.gemm(1.0, a, b, 1.0, c, overwrite_c=value),
            "symm": lambda: blasx.symm(1.0, a, b, 1.0, c, overwrite_c=value),
            "syrk": lambda: blasx.syrk(1.0, a, 1.0, c, overwrite_c=value),
            "syr2k": lambda: blasx.syr2k(1.0, a, b, 1.0, c, overwrite_c=value),
            "trmm": lambda: blasx.trmm(1.0, a, b, overwrite_b=value),
            "trsm": lambda: blasx.trsm(1.0, a, b, overwrite_b=value)}[routine]
    before = (b.copy(), c.copy())
    expect(ValueError, f"{name}:", repr(value), "allowed: 0", call=call)
    np.testing.assert_array_equal(b, before[0])
    np.testing.assert_array_equal(c, before[1])


def test_numpy_integer_trans_flags_are_accepted(sim2, abc, rel_err):
    a, b, _, _ = abc
    out = blasx.gemm(1.0, a.T.copy(), b, trans_a=np.int64(1), trans_b=np.uint8(0))
    assert rel_err(out, a @ b) < 1e-12
    # bools as 0 / 1, as scipy's drop-in and the other flags take them
    out = blasx.gemm(1.0, a.T.copy(), b, trans_a=True, trans_b=np.bool_(False))
    assert rel_err(out, a @ b) < 1e-12
    h = a.astype(complex)
    assert rel_err(np.triu(blasx.herk(1.0, h, trans=False)), np.triu(h @ h.conj().T)) < 1e-12


@pytest.mark.parametrize("routine", ["dgemm", "dsyrk", "dsymm", "dtrsm"])
def test_prefixed_routines_name_a_non_numeric_array(sim2, routine, expect):
    """The prefixed front ends cast to their type: an object or string array that does not convert to numbers is
    named before the cast (numpy's bare conversion error came out); one of numbers converts, as scipy's does."""
    a = np.ones((4, 4))
    junk = np.empty((4, 4), object)
    junk[...] = [[object()] * 4] * 4
    for bad in (junk, np.full((4, 4), "x")):
        args = {"dgemm": (1.0, bad, a), "dsyrk": (1.0, bad), "dsymm": (1.0, bad, a), "dtrsm": (1.0, bad, a)}
        expect(TypeError, "a: got an array of dtype:", str(bad.dtype), "does not convert to numbers",
               call=lambda: getattr(blasx, routine)(*args[routine]))
    for fine in (a.astype(object), a.astype(str)):
        args = {"dgemm": (1.0, fine, a), "dsyrk": (1.0, fine), "dsymm": (1.0, fine, a), "dtrsm": (1.0, fine, a)}
        assert getattr(blasx, routine)(*args[routine]).dtype == np.float64


def test_gemm_into_a_c_whose_elements_share_memory_returns_a_new_array(sim2, rand):
    """A c whose elements overlap each other (as_strided) cannot hold the product: a new array comes back (as
    f2py copies such a c), c is left alone; it was written through and returned wrong."""
    from numpy.lib.stride_tricks import as_strided
    a, b = rand((6, 5), np.float64, 1), rand((5, 6), np.float64, 2)
    buf = np.zeros(12)
    c = as_strided(buf, (6, 6), (8, 8))
    r = blasx.gemm(1.0, a, b, 0.0, c, overwrite_c=True)
    assert r is not c and (buf == 0).all()
    np.testing.assert_allclose(r, a @ b, rtol=1e-12)


def test_zero_d_array_scalars_are_taken_as_scipy_takes_them(sim2, abc, rel_err):
    a, b, c, _ = abc
    out = blasx.gemm(np.array(1.5), a, b, np.array(0.5), c)
    assert rel_err(out, 1.5 * a @ b + 0.5 * c) < 1e-12


@pytest.mark.parametrize("name", ["alpha", "beta"])
@pytest.mark.parametrize("value", ["2.0", None, [1.0], np.ones(1), True])
def test_non_numeric_scalars(sim2, abc, name, value, expect):
    a, b, c, before = abc
    kw = {"alpha": 1.0, "beta": 1.0, name: value}
    expect(TypeError, f"{name}:", repr(value), "expected a number",
           call=lambda: blasx.gemm(kw["alpha"], a, b, kw["beta"], c, overwrite_c=True))
    assert c.tobytes() == before


@pytest.mark.parametrize("name", ["alpha", "beta"])
def test_complex_scalar_for_real_dtype(sim2, abc, name, expect):
    a, b, c, before = abc
    kw = {"alpha": 1.0, "beta": 1.0, name: 1 + 2j}
    expect(TypeError, f"{name}:", "(1+2j)", "real float64",
           call=lambda: blasx.gemm(kw["alpha"], a, b, kw["beta"], c, overwrite_c=True))
    assert c.tobytes() == before


# --------------------------------------------------------------------------- foreign objects

class FakeCupy:
    """Looks like a CuPy array to blasx's duck check, without CuPy."""
    __module__ = "cupy._core.core"
    ndim = 2
    shape = (30, 10)
    dtype = np.dtype(np.float64)


@pytest.mark.parametrize("bad", [[[1.0, 2.0]], ((1.0,),), 3.0, "ab", None], ids=repr)
def test_non_arrays(sim2, abc, bad, expect):
    a, b, c, before = abc
    if bad is not None:
        expect(TypeError, "a:", f"got {type(bad).__name__}", "expected a numpy or cupy array",
               call=lambda: blasx.gemm(1.0, bad, b, 1.0, c, overwrite_c=True))
    expect(TypeError, "b:", f"got {type(bad).__name__}",
           call=lambda: blasx.gemm(1.0, a, bad, 1.0, c, overwrite_c=True))
    assert c.tobytes() == before


def test_mixing_numpy_with_a_device_array(sim2, abc, expect):
    a, _, c, before = abc
    expect(TypeError, "operands:", "a=numpy", "b=cupy", "all numpy arrays",
           call=lambda: blasx.gemm(1.0, a, FakeCupy(), 1.0, c, overwrite_c=True))
    assert c.tobytes() == before


# --------------------------------------------------------------------------- outputs

@pytest.mark.parametrize("devices", ["cpu", "sim:2"])
def test_read_only_out_is_named_before_any_work(devices, rand, expect, rel_err):
    """numpy signatures: a read-only out= raises ValueError naming out, like numpy, on every device;
    the engine stays usable."""
    blasx.configure(devices=devices)
    a, b = rand((6, 4)), rand((4, 3))
    for dtype in (np.float64, np.int64):
        out = np.zeros((6, 3), dtype)
        out.flags.writeable = False
        x, y = a.astype(dtype), b.astype(dtype)
        for call in (lambda: blasx.matmul(x, y, out=out), lambda: blasx.matmul(x, y, out=(out,)),
                     lambda: blasx.dot(x, y, out=out)):
            expect(ValueError, "out:", "read-only", call=call)
            assert not out.any()
    assert rel_err(blasx.matmul(a, b), a @ b) < 1e-12


def test_matmul_out_errors_are_numpys(sim2, rand):
    a, b = rand((6, 4)), rand((4, 3))
    for out in (np.zeros((6, 4)), np.zeros((6, 3), np.int64)):
        with pytest.raises(Exception) as ref:  # noqa: B017 - whatever numpy raises
            np.matmul(a, b, out=out)
        with pytest.raises(type(ref.value)) as got:
            blasx.matmul(a, b, out=out)
        assert str(got.value) == str(ref.value)
        assert not out.any()


# --------------------------------------------------------------------------- configure

@pytest.mark.parametrize("spec", ["gpu", "sim:0", "sim:2,slow=0", "sim:2,bogus=1", "cpu:2", "cuda:a", ""])
def test_configure_rejects_bad_device_specs(spec, expect):
    msg = expect(ValueError, "devices:", call=lambda: blasx.configure(devices=spec))
    assert repr(spec) in msg


@pytest.mark.parametrize("kw,fragments", [
    (dict(tile=0), ("tile:", "got 0", "positive int")),
    (dict(tile=-16), ("tile:", "got -16",)),
    (dict(tile=16.0), ("tile:", "got 16.0",)),
    (dict(tile=True), ("tile:", "got True",)),
    (dict(tile="32"), ("tile:", "got '32'",)),
    (dict(streams=0), ("streams:", "got 0", "from 1 to 32")),
    (dict(streams=33), ("streams:", "got 33",)),
    (dict(streams=2.0), ("streams:", "got 2.0",)),
    (dict(streams=True), ("streams:", "got True",)),
    (dict(cache_bytes=1000), ("cache_bytes:", "got 1000", ">= 65536")),
    (dict(cache_bytes=65535), ("cache_bytes:", "got 65535",)),
    (dict(cache_bytes=1.5e6), ("cache_bytes:", "got 1500000.0",)),
])
def test_configure_rejects_bad_knobs(kw, fragments, expect):
    expect(ValueError, *fragments, call=lambda: blasx.configure(devices="sim:1", **kw))


def test_bad_configure_keeps_the_previous_settings(rand, rel_err):
    blasx.configure(devices="sim:2", tile=16)
    with pytest.raises(ValueError):
        blasx.configure(devices="sim:2", tile=0)
    a, b = rand((40, 30)), rand((30, 20))
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12
    assert blasx.engine().spec == "sim:2" and blasx.engine().config.tile == 16


@pytest.mark.parametrize("spec,fragment", [("sim:2,speeds=1/1/4", "speeds lists 3 factors for 2 sim devices"),
                                           ("sim:2,fail=5@1", "fail names sim device 5"),
                                           ("sim:1,fail=1@1", "fail names sim device 1")])
def test_configure_rejects_inconsistent_sim_specs(spec, fragment, expect):
    """Regression: the speeds count was checked only at the first call, the fail device never."""
    expect(ValueError, "devices:", fragment, repr(spec), call=lambda: blasx.configure(devices=spec))


def test_tile_too_big_for_cache_raises_at_call_time(rand, expect):
    blasx.configure(devices="sim:1", tile=256, cache_bytes=1 << 20)  # accepted: checked per call
    a, b, c = rand((300, 300)), rand((300, 300)), rand((300, 300))
    before = c.tobytes()
    expect(ValueError, "tile:", "256", "cache", "lower the tile size or raise cache_bytes",
           call=lambda: blasx.gemm(1.0, a, b, 1.0, c, overwrite_c=True))
    assert c.tobytes() == before


def test_auto_tile_shrinks_to_fit_a_small_cache(rand, rel_err):
    blasx.configure(devices="sim:2", cache_bytes=1 << 16)
    a, b = rand((200, 150)), rand((150, 170))
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12
    # complex128 tiles of the sims' least speed-wise tile (16) do not fit 64 KiB: smaller ones do (they were refused)
    ac, bc = rand((50, 50), np.complex128), rand((50, 50), np.complex128)
    assert rel_err(blasx.gemm(1.0, ac, bc), ac @ bc) < 1e-12
    blasx.configure(devices="sim:2", cache_bytes=1 << 16, streams=8)
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12


def test_device_error_is_exported():
    assert blasx.DeviceError is DeviceError and issubclass(DeviceError, RuntimeError)


def test_device_arrays_are_compared_by_bounds_before_the_exact_test(monkeypatch):
    """CuPy's exact shares_memory makes and sorts a pointer per element of both arrays on the GPU: it runs only
    where the arrays' byte bounds overlap; a host array and a device array never share memory."""
    import sys
    import types
    from blasx import checks
    calls = []
    fake = types.ModuleType("cupy")
    fake.may_share_memory = lambda x, y: calls.append("bounds") or x.lo < y.hi and y.lo < x.hi
    fake.shares_memory = lambda x, y: calls.append("exact") or x.exact
    monkeypatch.setitem(sys.modules, "cupy", fake)
    Dev = type("ndarray", (), {"__module__": "cupy._core.core"})

    def dev(lo, hi, exact=True):
        x = Dev()
        x.lo, x.hi, x.exact = lo, hi, exact
        return x
    assert not checks.shares_memory(dev(0, 10), dev(10, 20)) and calls == ["bounds"]
    calls.clear()
    assert checks.shares_memory(dev(0, 10), dev(5, 20)) and calls == ["bounds", "exact"]
    calls.clear()
    assert not checks.shares_memory(dev(0, 10, exact=False), dev(5, 20)) and calls == ["bounds", "exact"]
    calls.clear()
    assert not checks.shares_memory(dev(0, 10), np.zeros(3)) and not checks.shares_memory(np.zeros(3), dev(0, 1))
    assert calls == []


def test_in_place_rule_takes_cupy_flags_which_lack_aligned():
    """CuPy's flags have no ``aligned``: asking for it failed every CuPy TRMM / TRSM with overwrite_b=True."""
    from types import SimpleNamespace

    from blasx.blas3 import written_in_place
    dt = np.dtype(np.float64)

    def like(ptr):
        return SimpleNamespace(dtype=dt, flags=SimpleNamespace(f_contiguous=True, c_contiguous=False),
                               data=SimpleNamespace(ptr=ptr))
    assert written_in_place(like(4096), dt, 1) and not written_in_place(like(4097), dt, 1)
    assert not written_in_place(like(4096), dt, 0)


def test_an_int_scalar_no_float_holds_is_named(sim2, expect):
    """alpha = 10**400 raised Python's bare OverflowError from deep in the call (float16 / int8 paths): now the
    parameter is named before any work, as scipy names it."""
    for dt in (np.float64, np.float16, np.int8):
        x = np.ones((3, 3), dt)
        expect(OverflowError, "alpha:", "cannot be converted to a float", call=lambda: blasx.gemm(10 ** 400, x, x))
        cd = np.int32 if dt is np.int8 else dt
        expect(OverflowError, "beta:", call=lambda: blasx.gemm(1.0, x, x, -(10 ** 400), np.zeros((3, 3), cd)))
    assert blasx.gemm(2 ** 1000, np.ones((2, 2)), np.ones((2, 2)))[0, 0] == 2.0 * 2 ** 1000


def test_bad_environment_settings_name_their_variable(monkeypatch, expect):
    """A device spec from $BLASX_DEVICES and a BLASX_SWITCH_INTERVAL out of range name the variable (they
    named a 'devices' argument never given, and an internal 'switch_interval')."""
    blasx.shutdown()
    monkeypatch.setenv("BLASX_DEVICES", "bogus")
    blasx.configure(devices=None)
    expect(ValueError, "$BLASX_DEVICES: unknown backend 'bogus'", call=blasx.engine)
    monkeypatch.setenv("BLASX_DEVICES", "sim:2")
    for bad in ("-1", "2", "abc"):
        monkeypatch.setenv("BLASX_SWITCH_INTERVAL", bad)
        expect(ValueError, f"BLASX_SWITCH_INTERVAL: got {bad!r}", "(0, 1)", call=blasx.engine)
    monkeypatch.delenv("BLASX_SWITCH_INTERVAL")
    assert blasx.engine() is not None
    blasx.shutdown()
