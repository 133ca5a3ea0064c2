"""The level-3 routines on dask arrays: scipy.linalg.blas signatures, one task per output block.

Each output block accumulates on one worker, a blasx call per piece of the shared dimension, so
no partial product of an (i, k, j) block triple is ever a dask result. Arguments are checked on
the client before any graph is built; the routines return lazy dask arrays (``progress=True``:
persisted, with distributed's progress bar). ``overwrite_c`` / ``overwrite_b`` are accepted for
scipy's signatures and ignored: dask arrays are immutable, the result is always a new array.
"""

from __future__ import annotations

import numbers

import dask
import dask.array as da
import numpy as np

from ..linalg import find_best_blas_type
from .graph import Operand, as_dask, build, device_blocks, group_bounds, inside, out_bounds, spans, union

#: blasx.dask.group's "auto" side where blocks are read from GPUs: a super-block's call is about a 16384^2 GEMM or
#: more, and reads each operand tile once for all of its output blocks
GROUP_EXTENT = 16384

_BLAS = {np.dtype(t) for t in ("f4", "f8", "c8", "c16")}
_COMPLEX_OF = {np.dtype("f4"): np.dtype("c8"), np.dtype("f8"): np.dtype("c16")}


# ---------------------------------------------------------------- checks

def _flag(name: str, value, allowed=(0, 1)) -> int:
    if isinstance(value, (bool, np.bool_)):
        value = int(value)
    if not isinstance(value, numbers.Integral) or int(value) not in allowed:
        raise ValueError(f"{name}: got {value!r}, allowed: {', '.join(map(str, allowed))}")
    return int(value)


def _scalar(name: str, value, dtype, real: bool = False):
    if isinstance(value, np.ndarray) and value.ndim == 0:  # scipy's routines take a 0-d array too
        value = value[()]
    if not isinstance(value, numbers.Number) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: got {type(value).__name__} {value!r}; need a number")
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real) and value.imag != 0:
        if real or dtype.kind != "c":
            why = "a real number" if real else f"a real number for the real type {dtype}"
            raise TypeError(f"{name}: got complex {value!r}; need {why}")
        return complex(value)
    return complex(value) if dtype.kind == "c" else float(value.real if isinstance(value, complex) else value)


def _blas_type(*arrays, hermitian: bool = False) -> np.dtype:
    """scipy's rule (find_best_blas_type); the Hermitian routines take the complex type."""
    arrays = [x for x in arrays if x is not None]
    if any(np.dtype(x.dtype).kind not in "biufc" for x in arrays):
        got = ", ".join(str(x.dtype) for x in arrays)
        raise TypeError(f"dtype: got {got}; allowed: numeric types (converted to float32, float64, complex64 "
                        f"or complex128 as scipy converts them)")
    dt = np.dtype(find_best_blas_type([np.empty((0, 0), x.dtype) for x in arrays])[1])
    return _COMPLEX_OF.get(dt, dt) if hermitian else dt


def _shape(name: str, x, shape, why: str) -> None:
    if x is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: got shape {tuple(x.shape)}, expected {tuple(shape)} ({why})")


def _finish(x, progress: bool):
    """The call's array; with ``progress``, persisted now with distributed's terminal bar (which needs a
    distributed client: checked before anything runs)."""
    if not isinstance(progress, (bool, np.bool_)):
        raise TypeError(f"progress: got {progress!r}; allowed: True or False")
    if progress:
        from distributed import default_client, progress as bar
        try:
            default_client()
        except ValueError:
            raise ValueError("progress: True needs a distributed Client (the terminal bar follows its tasks); "
                             "none is running: make one, or pass progress=False") from None
        x = x.persist()
        bar(x)
    return x


def _c_init(b, C, r, c, beta, read: bool):
    """The initial value of a block: beta times c's piece when c is read, else zeros."""
    if C is None or not read:
        return ("zeros",)
    return ("copy", b.piece(C, r[0], r[1], c[0], c[1]), beta)


def _op(b, X, t: int, rows, cols):
    """The piece rows x cols of op(X): a piece of X (t = 0) or of its transpose."""
    return b.piece(X, rows[0], rows[1], cols[0], cols[1]) if t == 0 else b.piece(X, cols[0], cols[1], rows[0], rows[1])


# ---------------------------------------------------------------- GEMM

def gemm(alpha, a, b, beta=0.0, c=None, trans_a=0, trans_b=0, overwrite_c=False, *, progress=False):
    """C = alpha op(a) op(b) + beta c (scipy.linalg.blas.?gemm) on dask arrays of any chunking."""
    return _finish(_gemm(alpha, a, b, beta, c, trans_a, trans_b, None), progress)


def _gemm(alpha, a, b, beta, c, trans_a, trans_b, dtype):
    ta, tb = _flag("trans_a", trans_a, (0, 1, 2)), _flag("trans_b", trans_b, (0, 1, 2))
    a, b = as_dask("a", a), as_dask("b", b)
    c = as_dask("c", c) if c is not None else None
    dtype = _blas_type(a, b, c) if dtype is None else dtype
    alpha, beta = _scalar("alpha", alpha, dtype), _scalar("beta", beta, dtype)
    m, k = a.shape if ta == 0 else a.shape[::-1]
    kb, n = b.shape if tb == 0 else b.shape[::-1]
    if kb != k:
        raise ValueError(f"b: op(b) has {kb} rows but op(a) has {k} columns (shapes a {a.shape}, b {b.shape}, "
                         f"trans_a={ta}, trans_b={tb})")
    _shape("c", c, (m, n), "op(a) rows x op(b) columns")
    A, B = Operand("a", a), Operand("b", b)
    C = Operand("c", c) if c is not None else None
    rows = out_bounds(A.rows if ta == 0 else A.cols, *([C.rows] if C else []))
    cols = out_bounds(B.cols if tb == 0 else B.rows, *([C.cols] if C else []))
    ks = [] if alpha == 0 else spans(union(A.cols if ta == 0 else A.rows, B.rows if tb == 0 else B.cols))

    g = group_extent(a, b) if C is None or beta == 0 else 0  # super-blocks: C's old values are not read

    def block(i, j, r, cc, bb, name):
        sub_r, sub_c = (inside(rows, r), inside(cols, cc)) if g else ([r], [cc])
        if g and (r[0] == r[1] or cc[0] == cc[1]):  # an empty output (a dimension of zero): nothing to compute
            return ("zeros",), []
        if len(sub_r) > 1 or len(sub_c) > 1:  # a super-block: its pieces joined into one call a step
            return ("zeros",), [("gemm_grid", alpha, (tuple(_op(bb, A, ta, x, kk) for x in sub_r),), ta,
                                 (tuple(_op(bb, B, tb, kk, y) for y in sub_c),), tb) for kk in ks]
        init = _c_init(bb, C, r, cc, beta, beta != 0)
        steps = [("gemm", alpha, _op(bb, A, ta, r, kk), ta, _op(bb, B, tb, kk, cc), tb, 1.0) for kk in ks]
        return init, steps

    return build("gemm", group_bounds(rows, g), group_bounds(cols, g), dtype, (A, B, C), block,
                 (alpha, beta, ta, tb, a.name, b.name, c.name if c is not None else None, g))


def group_extent(*xs) -> int:
    """Output blocks' least side in elements (``dask.config``'s ``blasx.dask.group``): ``"auto"`` (default)
    gives GROUP_EXTENT where the blocks are read from GPUs (graph.device_blocks: CuPy chunks, or workers whose
    engines have GPUs; a call should fill them, and every output block of a call shares its copies of the
    operands' tiles) and 0 (the chunks' own blocks) otherwise; ``"off"`` or 0: the chunks' blocks; a number:
    that side for any chunks (on the CPU alone, a super-block's pieces are copied together each step)."""
    v = dask.config.get("blasx.dask.group", "auto")
    if v == "auto":
        return GROUP_EXTENT if device_blocks(*xs) else 0
    if v in (None, False, "off"):
        return 0
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Integral, str)) or not str(v).isdigit():
        raise ValueError(f"dask config blasx.dask.group: got {v!r}; allowed: 'auto', 'off' or a number of "
                         f"elements >= 0")
    return int(v)


def blas_operands(a, b) -> bool:
    """The product of arrays ``a`` and ``b`` is one blasx.dask runs: its type one of the four BLAS types, every
    chunk size known, neither masked. Any other runs dask's own function (matmul, dot, tensordot), which
    handles them (NaN chunks, masks, integer types)."""
    try:
        dtype = np.result_type(a.dtype, b.dtype)
    except (TypeError, AttributeError):
        return False
    return dtype in _BLAS and not any(
        any(np.isnan(n) for n in x.shape) or isinstance(x, np.ma.MaskedArray)
        or isinstance(getattr(x, "_meta", None), np.ma.MaskedArray) for x in (a, b))


def matmul(a, b, *, progress=False):
    """``a @ b`` with numpy's shape rules for 1-D and 2-D operands: the four BLAS types run on blasx, any other
    result type (integers, bool, float16 ...), N-D operands, unknown chunk sizes and masked arrays run
    ``dask.array.matmul`` itself, with its result type (int8 @ int8 is int64 there)."""
    from .offload import original_matmul  # (the package's name ``offload`` is the function)
    for name, x in (("a", a), ("b", b)):
        if x is None or isinstance(x, (str, bytes)):
            raise TypeError(f"{name}: got {type(x).__name__}; need an array (dask, numpy, zarr or memmap)")
    a, b = (x if hasattr(x, "ndim") else np.asarray(x) for x in (a, b))
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError("matmul: a 0-d operand is not allowed (numpy's rule); use multiplication")
    if a.ndim > 2 or b.ndim > 2 or not blas_operands(a, b):
        return _finish(original_matmul(a, b), progress)
    # a 1-D operand as a dask array first (a zarr array cannot be indexed with None)
    a, b = (x if isinstance(x, da.Array) or x.ndim != 1 else da.from_array(x) for x in (a, b))
    dtype = np.result_type(a.dtype, b.dtype)
    va, vb = a.ndim == 1, b.ndim == 1
    a2 = as_dask("a", a[None, :] if va else a)
    b2 = as_dask("b", b[:, None] if vb else b)
    if a2.shape[1] != b2.shape[0]:
        raise ValueError(f"matmul: a has {a2.shape[1]} columns but b has {b2.shape[0]} rows "
                         f"(shapes {tuple(a.shape)} and {tuple(b.shape)})")
    out = _gemm(1.0, a2, b2, 0.0, None, 0, 0, dtype)
    out = out[0] if va else out
    out = out[..., 0] if vb else out
    return _finish(out, progress)
