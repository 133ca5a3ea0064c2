"""Reduced precision on the engine: float16, bfloat16 and int8 GEMM, TF32 math, int8 quantization.

Type combinations (A and B of one type; C's type is ``out_dtype``):

* float16 -> float16 (default) or float32; bfloat16 -> bfloat16 (default) or float32: the products
  accumulate in float32 (cuBLAS compute type 32F) and are rounded once to the output type;
* int8 -> int32: exact (compute type 32I; exact on the CPU and sim too: float64 holds every sum);
* float32 with ``math="tf32"``: A and B rounded to TF32 (10 mantissa bits), float32 accumulation.

Every other combination is rejected, naming these (:func:`check_types`). Errors against float64
on the same inputs: :func:`tolerance`. A float16 result with values beyond float16's range
(inf where the inputs are finite) raises a :class:`Float16OverflowWarning` naming the count.
NaN and inf in the inputs propagate as in cuBLAS (no warning).

:func:`quantize` and :func:`gemm_int8` give symmetric int8 quantization with per-tensor or
per-channel scales, the scales applied on the device to each C tile before its write-back.
"""

from __future__ import annotations

import numbers
import warnings

import numpy as np

from . import session
from .operands import TokenTable, canonical, is_cupy, leading_dim, make_operand
from .runtime import dtypes
from .runtime.call import Call, Operand
from .runtime.engine import EngineClosed
from .runtime.epilogues import Dequantize
from .runtime.plans import plan_gemm
from .runtime.stats import CallStats, DeviceInfo
from .runtime.tiling import OP_N
from .tile import choose_tile

_ENGINE_ATTEMPTS = 3
_F32 = np.dtype(np.float32)

#: Unit roundoff of each output / accumulation type (half the distance from 1 to the next value).
UNIT_ROUNDOFF = {np.dtype(np.float16): 2.0 ** -11, np.dtype(np.float32): 2.0 ** -24,
                 np.dtype(np.float64): 2.0 ** -53}
if "b" in dtypes.GEMM_BY_PREFIX:
    UNIT_ROUNDOFF[dtypes.GEMM_BY_PREFIX["b"].dtype] = 2.0 ** -8
TF32_ROUNDOFF = 2.0 ** -11


class Float16OverflowWarning(RuntimeWarning):
    """A float16 result has values beyond float16's range (they became inf) from finite inputs."""


_default_math = ["ieee"]


def set_default_math(math: str) -> None:
    """The math mode calls use when they pass none (``blasx.configure(math=...)``)."""
    _default_math[0] = check_math(math)


def default_math() -> str:
    return _default_math[0]


def check_math(math) -> str:
    if math is None:
        return _default_math[0]
    if not isinstance(math, str) or math.lower() not in dtypes.MATH_MODES:
        raise ValueError(f"math: got {math!r}, allowed: {', '.join(map(repr, dtypes.MATH_MODES))}")
    return math.lower()


def check_types(a_dtype, b_dtype, out_dtype=None, math: str = "ieee") -> tuple[dtypes.BlasType, np.dtype]:
    """(row of A's type, C's type) of a gemm on these types; TypeError listing what exists."""
    row = dtypes.gemm_of(a_dtype)
    if row is None or np.dtype(a_dtype) != np.dtype(b_dtype):
        raise TypeError(f"a, b: got {np.dtype(a_dtype).name} and {np.dtype(b_dtype).name}; gemm takes A and B "
                        f"of one type: {dtypes.gemm_combinations()}")
    allowed = dtypes.GEMM_OUT[row.dtype]
    out = allowed[0] if out_dtype is None else np.dtype(out_dtype)
    if out not in allowed:
        raise TypeError(f"out_dtype: got {out.name} for {row.dtype.name} inputs; allowed: "
                        f"{dtypes.gemm_combinations()}")
    if math == "tf32" and row.prefix not in ("s", "h", "b"):
        raise ValueError(f"math: 'tf32' applies to float32 (got {row.dtype.name} inputs); "
                         f"use math='ieee' for {row.dtype.name}")
    return row, out


def tolerance(dtype, k: int, out_dtype=None, math: str = "ieee") -> float:
    """Relative Frobenius-norm error of a gemm in ``dtype`` with inner dimension ``k``, against
    float64 on the same inputs (random, zero-mean data):

        u_out + 2 sqrt(k) u_acc  (+ 2 u_tf32 under TF32 math)

    u_out is the output type's unit roundoff (float16 2^-11, bfloat16 2^-8, float32 2^-24), u_acc
    float32's: a product of two half or bfloat16 values is exact in float32, so only the k
    additions round, and their errors add up like a random walk (factor 2 of margin). TF32 rounds
    each input to 11 significant bits (u_tf32 = 2^-11). int8 -> int32: 0 (exact). float64: 2
    sqrt(k) 2^-53."""
    row = dtypes.gemm_of(dtype)
    if row is None:
        raise TypeError(f"dtype: got {dtype!r}, allowed: {dtypes.GEMM_ALLOWED}")
    if row.dtype.kind in "iu":
        return 0.0
    out = row.out if out_dtype is None else np.dtype(out_dtype)
    acc = row.real if row.is_complex else row.compute
    u_out = UNIT_ROUNDOFF[row.real if out.kind == "c" else out]
    tol = u_out + 2.0 * np.sqrt(max(k, 1)) * UNIT_ROUNDOFF[acc]
    if math == "tf32" and row.prefix == "s":
        tol += 2.0 * TF32_ROUNDOFF
    return float(tol)


# ---------------------------------------------------------------- gemm

def _xp(on_gpu: bool):
    if on_gpu:
        import cupy
        return cupy
    return np


def _check_array(name: str, x, ndim=(2,)):
    if not (isinstance(x, np.ndarray) or is_cupy(x)):
        raise TypeError(f"{name}: got {type(x).__name__}, need a numpy or cupy array")
    if x.ndim not in ndim:
        raise ValueError(f"{name}: got a {x.ndim}-d array, need {' or '.join(f'{d}-d' for d in ndim)}")


def _check_scalar(name: str, value, row: dtypes.BlasType):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: got {value!r}, need a real number")
    if row.dtype.kind in "iu":
        if value != int(value) or not -2 ** 31 <= value < 2 ** 31:
            raise ValueError(f"{name}: got {value!r}; int8 gemm takes integer alpha and beta (int32)")
        return int(value)
    return float(value)


def _check_trans(name: str, op) -> int:
    if isinstance(op, (bool, np.bool_)) or not isinstance(op, numbers.Integral) or op not in (0, 1, 2):
        raise ValueError(f"{name}: got {op!r}, allowed: 0 (N), 1 (T), 2 (C)")
    return int(op)


def gemm(alpha, a, b, beta=0.0, c=None, trans_a=0, trans_b=0, overwrite_c=False, out_dtype=None, math=None):
    """C = alpha op(a) op(b) + beta c (scipy.linalg.blas ``?gemm`` semantics: an F-ordered result)
    for the reduced types and TF32 math: see the module docstring for the combinations,
    :func:`tolerance` for the accuracy. ``out_dtype`` defaults to ``c``'s type if given, else
    the input type's default output (float16 -> float16, bfloat16 -> bfloat16, int8 -> int32)."""
    _check_array("a", a)
    _check_array("b", b)
    if c is not None:
        _check_array("c", c)
    places = {is_cupy(x) for x in (a, b, c) if x is not None}
    if len(places) > 1:
        raise TypeError("a, b, c: pass all numpy arrays (host) or all cupy arrays (GPU)")
    on_gpu = places.pop()
    math = check_math(math)
    if out_dtype is None and c is not None:
        out_dtype = c.dtype
    row, out = check_types(a.dtype, b.dtype, out_dtype, math)
    if c is not None and c.dtype != out:
        raise TypeError(f"c: got {c.dtype.name}, need out_dtype {out.name}")
    trans_a, trans_b = _check_trans("trans_a", trans_a), _check_trans("trans_b", trans_b)
    alpha, beta = _check_scalar("alpha", alpha, row), _check_scalar("beta", beta, row)
    m, ka = a.shape if trans_a == OP_N else a.shape[::-1]
    kb, n = b.shape if trans_b == OP_N else b.shape[::-1]
    if ka != kb:
        raise ValueError(f"a, b: op(a) is {m}x{ka} but op(b) is {kb}x{n}; their inner dimensions must match")
    if c is not None and c.shape != (m, n):
        raise ValueError(f"c: got shape {c.shape}, expected ({m}, {n})")
    xp = _xp(on_gpu)
    if c is None:
        beta = 0
    if c is not None and overwrite_c and c.flags.f_contiguous and c.flags.writeable:
        result = c
    else:
        result = xp.empty((m, n), dtype=out, order="F")
        if c is not None and beta != 0:
            result[...] = c
    av, op_a = canonical(a, trans_a, False)
    bv, op_b = canonical(b, trans_b, False)
    run(av, op_a, bv, op_b, result, m, n, ka, row.dtype, out, alpha, beta, math)
    return result


def matmul(a, b, out_dtype=None, math=None):
    """numpy's ``a @ b`` (vectors, stacks of matrices, broadcasting) for the reduced types and
    TF32 math, as :func:`gemm`: a C-ordered result of ``out_dtype``."""
    _check_array("a", a, (1, 2, 3, 4, 5, 6))
    _check_array("b", b, (1, 2, 3, 4, 5, 6))
    if is_cupy(a) != is_cupy(b):
        raise TypeError("a, b: pass both numpy arrays (host) or both cupy arrays (GPU)")
    math = check_math(math)
    row, out = check_types(a.dtype, b.dtype, out_dtype, math)
    xp = _xp(is_cupy(a))
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    if a2.shape[-1] != b2.shape[-2]:
        raise ValueError(f"a, b: shapes {a.shape} and {b.shape} do not match for matmul "
                         f"({a2.shape[-1]} != {b2.shape[-2]})")
    batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    m, k, n = a2.shape[-2], a2.shape[-1], b2.shape[-1]
    result = xp.empty(batch + (m, n), dtype=out)
    ab = xp.broadcast_to(a2, batch + (m, k))
    bb = xp.broadcast_to(b2, batch + (k, n))
    for idx in np.ndindex(*batch):
        c = result[idx]
        # C-ordered C (m x n) is the column-major C^T = B^T A^T
        bv, op_b = canonical(bb[idx], OP_N, True)
        av, op_a = canonical(ab[idx], OP_N, True)
        run(bv, op_b, av, op_a, c.T, n, m, k, row.dtype, out, 1, 0, math)
    if a.ndim == 1:
        result = result[..., 0, :]
    if b.ndim == 1:
        result = result[..., 0]
    return result


def run(av, op_a, bv, op_b, cv, m: int, n: int, k: int, dtype, out_dtype, alpha, beta, math: str,
        epilogue=None, check_overflow: bool = True) -> None:
    """C = alpha op_a(A) op_b(B) + beta C on canonical (column-major) views, ``cv`` of
    ``out_dtype`` written in place: on the engine, or (alpha 0 or k 0) C = beta C here."""
    if not (m and n):
        return
    if alpha == 0 or k == 0:
        acc = np.dtype(dtypes.gemm_of(dtype).compute)
        with np.errstate(over="ignore"):
            cv[...] = (cv.astype(acc) * acc.type(beta)) if beta != 0 else 0
        return
    for attempt in range(_ENGINE_ATTEMPTS):
        eng = session.engine()
        try:
            _submit(eng, av, op_a, bv, op_b, cv, m, n, k, dtype, out_dtype, alpha, beta, math, epilogue)
            break
        except EngineClosed:
            if attempt == _ENGINE_ATTEMPTS - 1:
                raise
    if check_overflow and np.dtype(out_dtype) == np.float16:
        report_overflow(cv, (av, bv) + ((cv,) if beta != 0 else ()))


def report_overflow(c, inputs) -> None:
    """Warn when float16 ``c`` holds inf but none of ``inputs`` holds inf or NaN (an overflow of
    the float16 range, not a propagated value). Reads C once; the inputs only when C has inf."""
    xp = _xp(is_cupy(c))
    bad = int(xp.isinf(c).sum())
    if not bad:
        return
    if any(not bool(xp.isfinite(x).all()) for x in inputs):
        return  # inf or NaN in the inputs: propagated as cuBLAS does, not an overflow
    warnings.warn(f"float16 overflow: {bad} of {c.size} result values exceed float16's range "
                  f"(+-65504) and are inf; pass out_dtype=np.float32 to keep them",
                  Float16OverflowWarning, stacklevel=3)


def _submit(eng, av, op_a, bv, op_b, cv, m, n, k, dtype, out_dtype, alpha, beta, math, epilogue) -> None:
    from . import level3  # the thread's last call and the backends' per-call hooks
    views = [av, bv, cv]
    if eng.inline:
        tile = eng.config.tile or max(1, m, n, k)
        operands = [Operand(v, v.shape[0], v.shape[1], leading_dim(v), 0, -1, (0,)) for v in views]
        block = (1, 1)
    else:
        tile = choose_tile(eng, m, n, k, dtype, "gemm")
        tokens = TokenTable(tile)
        operands = [make_operand(v, tokens) for v in views]
        block = level3.block_shape(eng)
    tasks = plan_gemm(m, n, k, tile, op_a, op_b, beta_zero=(beta == 0), block=block)
    stats = CallStats([DeviceInfo(d.index, d.name, d.kind) for d in eng.devices],
                      keep_records=session.settings().trace)
    stats.host["math"] = math
    name = dtypes.prefix(dtype) + "gemm"
    call = Call(name, operands, tasks, dtype, alpha, beta, stats, epilogue=epilogue, out_dtype=out_dtype,
                math=math)
    call.tile = tile
    backends = level3._backends(eng)
    for d in backends:
        d.prepare_call(call)
    try:
        eng.submit(call)
    finally:
        for d in backends:
            d.finish_call(call)
        level3._keep_profile(stats)


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
    if np.dtype(dtype) != np.int8:
        raise TypeError(f"dtype: got {np.dtype(dtype).name}, allowed: int8")
    if x.dtype.kind not in "fiu" and dtypes.gemm_of(x.dtype) is None:
        raise TypeError(f"x: got {x.dtype.name}, need a real type")
    xp = _xp(is_cupy(x))
    xf = x.astype(np.float32) if x.dtype != np.float64 else x
    if axis is None:
        amax = xp.abs(xf).max() if xf.size else xp.asarray(0.0)
    else:
        if isinstance(axis, bool) or not isinstance(axis, numbers.Integral) or not -x.ndim <= axis < x.ndim:
            raise ValueError(f"axis: got {axis!r}, need None or an int in [{-x.ndim}, {x.ndim})")
        axis = int(axis) % x.ndim
        others = tuple(i for i in range(x.ndim) if i != axis)
        amax = xp.abs(xf).max(axis=others) if xf.size else xp.zeros(x.shape[axis])
    if not bool(xp.isfinite(amax).all()):
        raise ValueError("x: holds inf or NaN; quantize takes finite values")
    scales = xp.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    shape = [1] * x.ndim
    if axis is not None:
        shape[axis] = x.shape[axis]
    values = xp.clip(xp.rint(xf / scales.reshape(shape)), -127, 127).astype(np.int8)
    return values, scales


def gemm_int8(a_q, a_scale, b_q, b_scale):
    """``(a_q * a_scale) @ (b_q * b_scale)`` in float32 from int8 operands (numpy semantics for
    2-d operands: a C-ordered m x n result): the int8 product accumulates exactly in int32 on
    the devices, and each finished C tile is scaled to float32 there before its write-back.

    ``a_scale``: a scalar or one scale per row of ``a_q`` (shape ``(m,)``, from
    ``quantize(a, axis=0)``); ``b_scale``: a scalar or one per column of ``b_q`` (``(n,)``,
    ``quantize(b, axis=1)``). Scales along k cannot be factored out of the sum: not accepted.
    Error against the float32 product of the unquantized inputs (standard normal 512 x 512
    operands): relative Frobenius norm about 1.5e-2 with per-tensor scales, 1.05e-2 per channel
    (the tests check < 2.5e-2 and < 1.5e-2); the int32 sum itself is exact."""
    _check_array("a_q", a_q)
    _check_array("b_q", b_q)
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
    xp = _xp(is_cupy(a_q))
    result = xp.empty((m, n), dtype=np.float32)
    if k == 0:
        result[...] = 0
        return result
    bv, op_b = canonical(b_q, OP_N, True)
    av, op_a = canonical(a_q, OP_N, True)
    # the canonical C is C^T: its rows are b's columns, its columns a's rows
    run(bv, op_b, av, op_a, result.T, n, m, k, np.int8, np.float32, 1, 0, "ieee",
        epilogue=Dequantize(cs, rs), check_overflow=False)
    return result


def _scales(name: str, s, count: int, what: str) -> np.ndarray:
    """A float32 vector of ``count`` scales from a scalar or a vector of ``count``."""
    arr = np.asarray(s.get() if is_cupy(s) else s, dtype=np.float32)
    if arr.ndim == 0 or arr.size == 1:
        return np.full(count, float(arr.reshape(())), dtype=np.float32)
    if arr.ndim != 1 or arr.shape[0] != count:
        raise ValueError(f"{name}: got shape {arr.shape}, need a scalar or ({count},), one per {what}")
    return arr
