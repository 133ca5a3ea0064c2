"""Reduced precision on the engine: float16, bfloat16 and int8 GEMM, TF32 math, int8 quantization.

The type rules: two float16 (bfloat16) operands accumulate in float32 and round once to float16
(bfloat16) or ``out_dtype=np.float32``; two int8 operands give int32, exactly; float32 with
``math="tf32"`` rounds A and B to TF32 on CUDA GPUs (emulated on sims; the CPU stays IEEE). Another
``out_dtype`` raises an error naming these (:func:`check_types`); other pairs keep scipy's rule
(``gemm``) or numpy's (the numpy front ends). Errors against float64: :func:`tolerance`. A float16
result that overflowed where the devices rounded it warns (:class:`Float16OverflowWarning`). The
calls take the one path of every gemm (:mod:`blasx.level3`, :func:`blasx.dispatch.gemm`).
:func:`quantize` and :func:`gemm_int8`: symmetric int8 quantization, scales applied on the device.
See docs/usage.md.
"""

from __future__ import annotations

import contextlib
import numbers
import threading

import numpy as np

from . import dispatch, session
from .checks import check_matrix, compute_dtype
from .threadlocal import setting
from .dispatch import Float16OverflowWarning  # noqa: F401 - blasx.precision.Float16OverflowWarning
from .operands import is_cupy
from .runtime import dtypes
from .runtime.epilogues import Dequantize

#: Unit roundoff of each output / accumulation type (half the distance from 1 to the next value).
UNIT_ROUNDOFF = {np.dtype(np.float16): 2.0 ** -11, np.dtype(np.float32): 2.0 ** -24,
                 np.dtype(np.float64): 2.0 ** -53}
if "b" in dtypes.GEMM_BY_PREFIX:
    UNIT_ROUNDOFF[dtypes.GEMM_BY_PREFIX["b"].dtype] = 2.0 ** -8
#: One TF32 ulp at 1 (10 mantissa bits): an input's error whether tensor cores round or truncate it.
TF32_UNIT = 2.0 ** -10


_override = threading.local()  # a per-call math mode for the gemms of one front-end call


def default_math() -> str:
    """The math mode of a call that names none: the per-call one in force (:func:`math_mode`),
    else ``blasx.configure(math=...)``'s."""
    m = getattr(_override, "math", None)
    return m if m is not None else session.settings().math


def check_math(math) -> str:
    """``math`` validated (None: :func:`default_math`)."""
    if math is None:
        return default_math()
    if not isinstance(math, str) or math.lower() not in dtypes.MATH_MODES:
        raise ValueError(f"math: got {math!r}, allowed: {', '.join(map(repr, dtypes.MATH_MODES))}")
    return math.lower()


@contextlib.contextmanager
def math_mode(math):
    """The gemms run inside use ``math`` (None: leave the mode as it is)."""
    if math is None:
        yield
        return
    with setting(_override, "math", check_math(math)):
        yield


def _dtype(name: str, value, allowed: str | None = None) -> np.dtype:
    """``np.dtype(value)`` in native byte order, a value numpy does not know named as ``name``'s (``allowed``:
    default the gemm combinations)."""
    try:
        return dtypes.native(value)
    except TypeError:
        raise TypeError(f"{name}: got {value!r}, not a data type; allowed: "
                        f"{allowed or dtypes.gemm_combinations()}") from None


def out_type(out_dtype) -> np.dtype:
    """``out_dtype`` as a numpy dtype (a value numpy does not know: TypeError naming ``out_dtype``)."""
    return _dtype("out_dtype", out_dtype)


def takes(a_dtype, b_dtype, out_dtype=None) -> bool:
    """A gemm on these types takes the reduced-type rules (:func:`check_types`), not scipy's: A
    and B of one reduced type (float16, bfloat16, int8), or an explicit ``out_dtype``."""
    if out_dtype is not None:
        return True
    if dtypes.native(a_dtype) != dtypes.native(b_dtype):
        return False
    row = dtypes.gemm_of(a_dtype)
    return row is not None and row.reduced


def gemm_types(a, b, c=None, out_dtype=None) -> tuple[np.dtype, np.dtype]:
    """(computation type, output type) of ``blasx.gemm`` on these arrays: the reduced-type rules
    when :func:`takes` says so (the output: ``out_dtype``, else c's type, which must be one of the
    input type's outputs, else the default), else scipy's BLAS type for both."""
    if not takes(a.dtype, b.dtype, out_dtype):
        dt = compute_dtype(a, b) if c is None else compute_dtype(a, b, c)
        return dt, dt
    row, out = check_types(a.dtype, b.dtype, out_dtype)
    if c is not None and out_dtype is None:
        if dtypes.native(c.dtype) not in dtypes.GEMM_OUT[row.dtype]:  # (cast into the output, its values would be cut)
            raise TypeError(f"c: got dtype {np.dtype(c.dtype).name} for {row.dtype.name} inputs; the output types "
                            f"allowed: {dtypes.gemm_combinations()}")
        out = dtypes.native(c.dtype)
    elif c is not None and dtypes.native(c.dtype) != out:  # (rounded to the output type before beta scaled it)
        raise TypeError(f"c: got dtype {np.dtype(c.dtype).name}; with out_dtype={out.name} c must be {out.name}")
    return row.dtype, out


def check_gemm_scalar(name: str, value, dtype):
    """int8 gemm's alpha and beta are int32 (cuBLAS compute type 32I); other types' pass as they are."""
    if np.dtype(dtype).kind not in "iu":
        return value
    v = complex(value)  # (Python's: a float16 value compared with 2**31 would overflow float16)
    if not np.isfinite(v.real) or v.imag != 0 or v.real != int(v.real) or not -2 ** 31 <= v.real < 2 ** 31:
        raise ValueError(f"{name}: got {value!r}; int8 gemm takes integer alpha and beta (int32)")
    return int(v.real)


def result_type(a_dtype, b_dtype, out_dtype=None):
    """(input type, output type) of a numpy-front-end product on the reduced path, or None when
    it is not one (numpy's rules then apply): A and B of one reduced type, the output its
    default or ``out_dtype`` (numpy's ``dtype=``) when that combination exists; A and B of one
    other BLAS type with ``out_dtype`` that type."""
    a, b = dtypes.native(a_dtype), dtypes.native(b_dtype)
    row = dtypes.gemm_of(a)
    if a != b or row is None:
        return None
    if not row.reduced:  # (a BLAS type: out_dtype may only name itself, as gemm takes it)
        return (a, a) if out_dtype is not None and _dtype("out_dtype", out_dtype) == a else None
    out = row.out if out_dtype is None else _dtype("out_dtype", out_dtype)
    return (a, out) if out in dtypes.GEMM_OUT[a] else None


def check_types(a_dtype, b_dtype, out_dtype=None) -> tuple[dtypes.BlasType, np.dtype]:
    """(row of A's type, C's type) of a gemm on these types; TypeError listing what exists.
    (TF32 math applies to float32 alone; other types ignore it.)"""
    row = dtypes.gemm_of(a_dtype)
    if row is None or dtypes.native(a_dtype) != dtypes.native(b_dtype):
        raise TypeError(f"a, b: got {np.dtype(a_dtype).name} and {np.dtype(b_dtype).name}; gemm takes A and B "
                        f"of one type: {dtypes.gemm_combinations()}")
    allowed = dtypes.GEMM_OUT[row.dtype]
    out = allowed[0] if out_dtype is None else _dtype("out_dtype", out_dtype)
    if out not in allowed:
        raise TypeError(f"out_dtype: got {out.name} for {row.dtype.name} inputs; allowed: "
                        f"{dtypes.gemm_combinations()}")
    return row, out


def tolerance(dtype, k: int, out_dtype=None, math: str = "ieee") -> float:
    """Relative Frobenius-norm error of a gemm in ``dtype`` with inner dimension ``k``, against
    float64 on the same inputs (random, zero-mean data):

        u_out + 2 sqrt(k) u_acc  (+ 2 u_tf32 under TF32 math)

    u_out is the output type's unit roundoff (float16 2^-11, bfloat16 2^-8, float32 2^-24), u_acc
    float32's: a product of two half or bfloat16 values is exact in float32, so only the k
    additions round, and their errors add up like a random walk (factor 2 of margin). TF32 cuts
    each input to 11 significant bits, rounding or truncating (u_tf32 = 2^-10, one ulp: cuBLAS's
    kernels may do either). int8 -> int32: 0 (exact). float64: 2^-53 + 2 sqrt(k) 2^-53."""
    row = dtypes.gemm_of(dtype)
    if row is None:
        raise TypeError(f"dtype: got {dtype!r}, allowed: {dtypes.GEMM_ALLOWED}")
    row, out = check_types(row.dtype, row.dtype, out_dtype)  # (a pair gemm does not take: TypeError)
    if row.dtype.kind in "iu":
        return 0.0
    acc = row.real if row.is_complex else row.compute
    u_out = UNIT_ROUNDOFF[row.real if out.kind == "c" else out]
    tol = u_out + 2.0 * np.sqrt(max(k, 1)) * UNIT_ROUNDOFF[acc]
    if check_math(math) == "tf32" and row.prefix == "s":
        tol += 2.0 * TF32_UNIT
    return float(tol)


# ---------------------------------------------------------------- int8 quantization

def quantize(x, dtype=np.int8, axis=None):
    """Symmetric quantization: ``(values, scales)`` with ``x ~= values * scales``.

    ``axis=None``: one scale for the tensor (a 0-d float32 array); ``axis=i``: one scale per index
    along axis ``i`` (per channel; shape ``(x.shape[i],)``), broadcast along ``i`` when applied.
    A scale is ``max|x| / 127`` over its slice (1 where the slice is all zeros); values are
    ``round(x / scale)`` in [-127, 127] (round half to even). Each value is off by at most half a
    scale step. ``x``: a real numpy or cupy array of finite values."""
    if not (isinstance(x, np.ndarray) or is_cupy(x)):
        raise TypeError(f"x: got {type(x).__name__}, need a numpy or cupy array")
    dispatch.seen_writable((x,))  # (a blasx call seeing x writable: its read-only tiles are stale)
    if _dtype("dtype", dtype, "int8") != np.int8:
        raise TypeError(f"dtype: got {np.dtype(dtype).name}, allowed: int8")
    if not dtypes.is_real(x.dtype):
        raise TypeError(f"x: got {x.dtype.name}, need a real type")
    xp = dispatch.array_module(is_cupy(x))
    wide = x.dtype.kind == "f" and x.dtype.itemsize > 8  # (longdouble: float64, not float32's range)
    xf = x if dtypes.native(x.dtype) == np.float64 else x.astype(np.float64 if wide else np.float32)
    if axis is None:
        amax = xp.abs(xf).max() if xf.size else xp.asarray(0.0)
    else:
        if x.ndim == 0 and axis is not None:
            raise ValueError(f"axis: got {axis!r} for a 0-d x; need None (one scale for the tensor)")
        if isinstance(axis, bool) or not isinstance(axis, numbers.Integral) or not -x.ndim <= axis < x.ndim:
            raise ValueError(f"axis: got {axis!r}, need None or an int in [{-x.ndim}, {x.ndim})")
        axis = int(axis) % x.ndim
        others = tuple(i for i in range(x.ndim) if i != axis)
        amax = xp.abs(xf).max(axis=others) if xf.size else xp.zeros(x.shape[axis])
    if not bool(xp.isfinite(amax).all()):
        raise ValueError("x: holds inf or NaN; quantize takes finite values")
    with np.errstate(over="ignore"):  # (past float32's range: the error below, not numpy's cast warning)
        scales = xp.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    if not bool((xp.isfinite(scales) & (scales > 0)).all()):  # (float64 data past float32's range)
        raise ValueError("x: its largest magnitudes give scales outside float32's range (max|x| / 127 must lie "
                         "between float32's smallest and largest positive values)")
    shape = [1] * x.ndim
    if axis is not None:
        shape[axis] = x.shape[axis]
    values = xp.clip(xp.rint(xf / scales.reshape(shape)), -127, 127).astype(np.int8)
    return values, scales


K_EXACT = (2 ** 31 - 1) // (128 * 128)  # the longest k whose int32 sum of int8 products cannot wrap: 131071


def gemm_int8(a_q, a_scale, b_q, b_scale):
    """``(a_q * a_scale) @ (b_q * b_scale)`` in float32 from int8 operands (numpy semantics for
    2-d operands: a C-ordered m x n result): the int8 product accumulates exactly in int32 on
    the devices, and each finished C tile is scaled to float32 there before its write-back.

    ``a_scale``: a scalar or one scale per row of ``a_q`` (shape ``(m,)``, from
    ``quantize(a, axis=0)``); ``b_scale``: a scalar or one per column of ``b_q`` (``(n,)``,
    ``quantize(b, axis=1)``). Scales along k cannot be factored out of the sum: not accepted.
    The int32 sum is exact (a k past :data:`K_EXACT`, where int32 could wrap, is summed in pieces of that
    length, each exact, added in float32): the error against the unquantized product is :func:`quantize`'s."""
    check_matrix("a_q", a_q)
    check_matrix("b_q", b_q)
    if is_cupy(a_q) != is_cupy(b_q):
        raise TypeError("a_q, b_q: pass both numpy arrays (host) or both cupy arrays (GPU)")
    for name, x in (("a_q", a_q), ("b_q", b_q)):
        if x.dtype != np.int8:
            raise TypeError(f"{name}: got {x.dtype.name}, need int8 (blasx.quantize)")
    m, k = a_q.shape
    kb, n = b_q.shape
    if k != kb:
        raise ValueError(f"a_q, b_q: shapes {a_q.shape} and {b_q.shape} do not match ({k} != {kb})")
    rs = _scales("a_scale", a_scale, m, "rows of a_q")
    cs = _scales("b_scale", b_scale, n, "columns of b_q")
    xp = dispatch.array_module(is_cupy(a_q))
    result = xp.empty((m, n), dtype=np.float32)
    if k == 0:
        result[...] = 0
        return result
    for k0 in range(0, k, K_EXACT):
        k1 = min(k, k0 + K_EXACT)
        part = result if k0 == 0 else xp.empty((m, n), dtype=np.float32)
        dispatch.gemm(1, a_q[:, k0:k1], b_q[k0:k1], 0, part, 0, 0, np.int8, k1 - k0, epilogue=Dequantize(rs, cs))
        if k0:
            result += part
    return result


def _scales(name: str, s, count: int, what: str) -> np.ndarray:
    """A float32 vector of ``count`` scales from a scalar or a vector of ``count``."""
    raw = np.asarray(s.get() if is_cupy(s) else s)
    if raw.dtype.kind == "b" or not dtypes.is_real(raw.dtype):
        raise TypeError(f"{name}: got {raw.dtype if s is not None else None}; need real scales (quantize's)")
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        arr = raw.astype(np.float32)
    # (a nonzero scale that float32 makes 0 would zero its rows or columns)
    lost = ~np.isfinite(arr) | ((arr == 0) & (raw != 0))
    if lost.any():
        bad = raw.reshape(-1)[lost.reshape(-1)][0]
        raise ValueError(f"{name}: holds {float(bad)!r}; need finite scales within float32's range (quantize's)")
    if arr.ndim == 0 or arr.size == 1:
        return np.full(count, float(arr.reshape(())), dtype=np.float32)
    if arr.ndim != 1 or arr.shape[0] != count:
        raise ValueError(f"{name}: got shape {arr.shape}, need a scalar or ({count},), one per {what}")
    return arr


# ---------------------------------------------------------------- test operands and checks (CLI, tune, bench)

def random_operand(rng, shape, dtype) -> np.ndarray:
    """Random host operand of any gemm type: standard normal values (complex: both parts), int8
    uniform over [-128, 127]; F-ordered."""
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return np.asfortranarray(rng.integers(info.min, info.max + 1, size=shape, dtype=dt))
    x = rng.standard_normal(shape)
    if dt.kind == "c":
        x = x + 1j * rng.standard_normal(shape)
    return np.asfortranarray(x.astype(dt))


def operands_peak_bytes(m: int, n: int, k: int, dtype, out_dtype=None) -> int:
    """Host bytes at the peak of making a gemm's a (m x k) and b (k x n) with :func:`random_operand` beside an
    m x n output: the three arrays, plus the larger operand's temporaries while it is made (a float64 draw, the
    cast, the F-ordered copy; complex: two draws and their sum)."""
    dt = np.dtype(dtype)
    its = dt.itemsize
    held = (m * k + k * n) * its + m * n * np.dtype(out_dtype or dt).itemsize
    per = its if dt.kind in "iu" else max(40, 16 + 2 * its) - its if dt.kind == "c" else 8 + its
    return held + max(m * k, k * n) * per


def check_host_memory(sizes, types) -> None:
    """ValueError ("sizes: ...") where making a gemm's operands for an (m, n, k) of ``sizes`` and a BLAS type of
    ``types`` (:func:`operands_peak_bytes`) needs more host memory than is available now: checked before work."""
    from .probe import format_bytes, host_memory
    _total, avail = host_memory()
    if avail is None:
        return
    for row in types:
        for m, n, k in sizes:
            need = operands_peak_bytes(m, n, k, row.dtype, row.out)
            if need > avail:
                raise ValueError(f"sizes: {m}x{n}x{k} {row.dtype.name} operands take {format_bytes(need)} while they "
                                 f"are made, but only {format_bytes(avail)} of host memory is available")


def check_rows(c_rows, a_rows, b, row: dtypes.BlasType, math: str = "ieee") -> tuple[float, float]:
    """(relative Frobenius error of ``c_rows`` against ``a_rows @ b`` in the wide reference type,
    its tolerance): 4 :func:`tolerance` of the call, at least 1e-4 (4-byte types) or 1e-10;
    0 for int8 (exact)."""
    wide = np.dtype(np.float64) if row.dtype.kind in "iu" else row.wide
    ref = a_rows.astype(wide) @ b.astype(wide)
    got = c_rows.astype(wide)
    err = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), np.finfo(float).tiny))
    if row.dtype.kind in "iu":
        return err, 0.0
    tol = tolerance(row.dtype, b.shape[0], math=math) * 4.0
    floor = 1e-4 if row.real.itemsize <= 4 else 1e-10
    return err, max(tol, floor)
