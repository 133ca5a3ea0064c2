"""numpy-style ``matmul``, ``dot`` and ``tensordot`` on blasx, with numpy's semantics and errors.

The calls of BLAS types, or of two float16, bfloat16 or int8 operands (:mod:`blasx.precision`:
``out_dtype``, ``math``), run on blasx (docs/usage.md's dtype rule); the others are numpy's own
function. With the CPU alone a call of operands of the computation type is numpy's function on the
host BLAS; else it becomes gemms: one for a batch whose one operand is shared, else one per item.
"""

from __future__ import annotations

import math
import operator

import numpy as np

from . import dispatch, precision, session
from .blas3 import new_array
from .checks import shares_memory, writable
from .operands import READONLY, is_cupy
from .runtime import dtypes
from .runtime.stats import clock

# numpy's own functions, taken at import: blasx.offload may replace the ``numpy``
# module's attributes later, and the fallbacks here must never reach those wrappers.
_np_matmul = np.matmul
_np_dot = np.dot
_np_tensordot = np.tensordot

__all__ = ["matmul", "dot", "tensordot"]

# matmul keyword arguments handled here; any other one goes to np.matmul as given.
_MATMUL_KEYWORDS = frozenset(("casting", "dtype"))

#: numpy's matmul copies operands BLAS cannot read as they are and runs BLAS on the copies from
#: 2.3.1; before, it runs BLAS on C- or F-contiguous operands only
_ANY_STRIDES = np.lib.NumpyVersion(np.__version__) >= "2.3.1"

_nd = np.ndarray
_tls = dispatch._tls
_isqrt = math.isqrt  # (the functions' ``math`` argument hides the module)


def _host(x, y):
    """The CPU device when a plain call on x, y (numpy arrays of one BLAS type, the CPU alone) is
    numpy's own function on the host BLAS, else None."""
    if type(x) is _nd and type(y) is _nd and x.dtype is y.dtype and x.dtype in dtypes.BY_DTYPE:
        return session.host_device
    return None


def _check_out(out) -> None:
    """numpy's rule, checked before any work: an ``out`` must be writable."""
    if isinstance(out, tuple) and len(out) == 1:
        out = out[0]
    if (isinstance(out, np.ndarray) or is_cupy(out)) and not writable(out):  # (not an array: numpy's TypeError)
        raise ValueError("out: the output array is read-only; pass a writable array (or no out)")


# ---------------------------------------------------------------- matmul

def matmul(x1, x2, /, out=None, *, out_dtype=None, math=None, **kwargs):
    """``np.matmul(x1, x2, out=out, **kwargs)`` with the BLAS-type products run on blasx.

    ``dtype=`` and ``casting=`` select the computation type as numpy's; ``out`` may have any dtype
    the result can be cast to under ``casting``. ``out_dtype`` and ``math``: see the module docstring.
    """
    if math is not None or out_dtype is not None:
        with precision.math_mode(math):
            return _matmul(x1, x2, out, out_dtype, kwargs)
    if not kwargs and (dev := _host(x1, x2)) is not None and x1.ndim and x2.ndim and (
            _ANY_STRIDES or (x1.flags.forc and x2.flags.forc)) and (
            out is None or (type(out) is _nd and out.dtype is x1.dtype and out.flags.writeable
                            and (_ANY_STRIDES or out.flags.forc))):
        t0 = clock()
        res = _np_matmul(x1, x2, out=out)
        _tls.stats = (dev, t0, clock(), x1.dtype, 2.0 * res.size * x1.shape[-1])
        return res
    return _matmul(x1, x2, out, None, kwargs)


@dispatch.front_end
def _matmul(x1, x2, out, out_dtype, kwargs):
    _check_out(out)
    if out_dtype is not None and kwargs.get("dtype") is not None and \
            np.dtype(kwargs["dtype"]) != precision.out_type(out_dtype):
        raise TypeError(f"dtype, out_dtype: got {np.dtype(kwargs['dtype']).name} and "
                        f"{precision.out_type(out_dtype).name}; give one, or the same type")
    plan = _matmul_plan(x1, x2, out, kwargs, out_dtype)
    if plan is None:
        if out_dtype is not None:
            _reject_out_dtype(x1, x2, out_dtype)
        return _fallback(_np_matmul, x1, x2, out=out, **kwargs)
    a, b, out, ct, casting, xp, it = plan
    if xp is np and a.dtype == ct and b.dtype == ct and ct in dtypes.BY_DTYPE and (
            _ANY_STRIDES or (a.flags.forc and b.flags.forc)) and (
            out is None or (out.dtype == ct and out.flags.forc)) and (dev := dispatch.host_device()) is not None:
        # The CPU alone: numpy's own matmul runs the host BLAS on these (numpy's errors for bad shapes)
        t0 = clock()
        res = _np_matmul(a, b, out=out, **kwargs)
        dispatch.record_host(dev, t0, ct, 2.0 * res.size * a.shape[-1])
        return res
    a1 = a[..., None, :] if a.ndim == 1 else a
    b1 = b[..., :, None] if b.ndim == 1 else b
    n, k = a1.shape[-2:]
    if b1.shape[-2] != k:
        return _fallback(_np_matmul, x1, x2, out=out, **kwargs)  # numpy's core-dimension mismatch error
    m = b1.shape[-1]
    try:
        batch = np.broadcast_shapes(a1.shape[:-2], b1.shape[:-2])
    except ValueError:
        return _fallback(_np_matmul, x1, x2, out=out, **kwargs)  # numpy's broadcast error
    final = batch + ((n,) if a.ndim > 1 else ()) + ((m,) if b.ndim > 1 else ())
    if out is not None and (tuple(out.shape) != final or final == ()):
        return _fallback(_np_matmul, x1, x2, out=out, **kwargs)  # numpy's output-shape error (or a 0-d out)
    direct = (out is not None and out.dtype == ct and not _aliases(out, a, b))
    res = out if direct else new_array(xp, final, ct, None, order="C")
    if final == ():
        c = res.reshape(1, 1)  # a fresh 0-d array: a view
    else:
        c = res[..., None, :] if a.ndim == 1 else res
        c = c[..., :, None] if b.ndim == 1 else c
    a3 = xp.broadcast_to(dispatch.as_operand(a1, it), batch + (n, k))  # (cast before broadcast: one copy)
    b3 = xp.broadcast_to(dispatch.as_operand(b1, it), batch + (k, m))
    with dispatch.whole(direct):
        run_batch(a3, b3, c, xp)
    if out is not None:
        if not direct:
            xp.copyto(out, res, casting=casting)
        return out
    return res[()] if final == () else res  # numpy returns a scalar for 1-D @ 1-D


def _matmul_plan(x1, x2, out, kwargs, out_dtype=None):
    """(a, b, out, result dtype, casting, xp, input dtype) when blasx computes this matmul, else
    None (numpy does)."""
    if not _MATMUL_KEYWORDS.issuperset(kwargs):
        return None
    casting = kwargs.get("casting", "same_kind")
    if isinstance(out, tuple):
        if len(out) != 1:
            return None
        out = out[0]
    arrays = _arrays(x1, x2, out)
    if arrays is None:
        return None
    xp, a, b = arrays
    if a.ndim == 0 or b.ndim == 0:
        return None
    try:
        ct = np.dtype(kwargs["dtype"]) if kwargs.get("dtype") is not None else np.result_type(a.dtype, b.dtype)
        reduced = precision.result_type(a.dtype, b.dtype, out_dtype or kwargs.get("dtype"))
    except TypeError:
        return None
    it, ct = reduced if reduced is not None else (ct, ct)
    if (reduced is None and (out_dtype is not None or ct not in dtypes.BY_DTYPE)) or not isinstance(casting, str):
        return None
    try:
        if not (np.can_cast(a.dtype, ct, casting) and np.can_cast(b.dtype, ct, casting)):
            return None
        if out is not None and not np.can_cast(ct, out.dtype, casting):
            return None
    except (TypeError, ValueError):
        return None
    return a, b, out, ct, casting, xp, it


def _engine_types(x, y, out_dtype):
    """(input type, result type) of a dot/tensordot that blasx computes, None for numpy's own
    function (no BLAS or reduced type; numpy's errors); a bad ``out_dtype`` raises."""
    if out_dtype is None and x.dtype == y.dtype and x.dtype in dtypes.BY_DTYPE:  # one BLAS type: itself
        return x.dtype, x.dtype
    try:
        ct = np.result_type(x.dtype, y.dtype)
    except TypeError:  # no common type (float16 and bfloat16): numpy's error, or out_dtype's
        if out_dtype is not None:
            _reject_out_dtype(x, y, out_dtype)
        return None
    reduced = precision.result_type(x.dtype, y.dtype, out_dtype)
    if reduced is not None:
        return reduced
    if out_dtype is not None:
        _reject_out_dtype(x, y, out_dtype)
    return (ct, ct) if ct in dtypes.BY_DTYPE else None


def _reject_out_dtype(x1, x2, out_dtype) -> None:
    """``out_dtype`` names a combination that does not exist: TypeError listing those that do."""
    types = [np.asarray(x).dtype if not is_cupy(x) else x.dtype for x in (x1, x2)]
    precision.check_types(types[0], types[1], out_dtype)  # raises, naming the combinations
    raise TypeError(f"out_dtype: got {np.dtype(out_dtype).name} for {types[0].name} operands; allowed: "
                    f"{dtypes.gemm_combinations()}")


# ---------------------------------------------------------------- dot

def dot(a, b, out=None, *, out_dtype=None, math=None):
    """``np.dot(a, b, out=out)`` with the BLAS-type products run on blasx as one gemm,
    ``a.reshape(-1, K) @ moveaxis(b, -2, 0).reshape(K, -1)``. ``out_dtype`` and ``math``: see the
    module docstring."""
    if math is not None or out_dtype is not None:
        with precision.math_mode(math):
            return _dot(a, b, out, out_dtype)
    if (dev := _host(a, b)) is not None and 0 < a.ndim <= 2 and 0 < b.ndim <= 2 and (
            out is None or (type(out) is _nd and out.flags.writeable)):
        t0 = clock()
        res = _np_dot(a, b, out)
        _tls.stats = (dev, t0, clock(), a.dtype, 2.0 * res.size * a.shape[-1])
        return res
    return _dot(a, b, out, None)


@dispatch.front_end
def _dot(a, b, out, out_dtype):
    _check_out(out)
    if out_dtype is not None and out is not None and hasattr(out, "dtype") and \
            np.dtype(out.dtype) != precision.out_type(out_dtype):
        raise TypeError(f"out: got dtype {np.dtype(out.dtype).name}; with out_dtype="
                        f"{precision.out_type(out_dtype).name} out must be that type (np.dot does not cast out)")
    arrays = _arrays(a, b, out)
    if arrays is None:
        return _fallback(_np_dot, a, b, out)
    xp, x, y = arrays
    if xp is np and y.size == 0 and not isinstance(b, np.ndarray):
        return _fallback(_np_dot, a, b, out)  # (numpy's type rules for an empty sequence or array-like b; no work)
    if x.ndim == 0 or y.ndim == 0 or (types := _engine_types(x, y, out_dtype)) is None:
        return _fallback(_np_dot, a, b, out)  # (a product with a scalar: numpy's multiply)
    it, ct = types
    k = x.shape[-1]
    if k != (y.shape[0] if y.ndim == 1 else y.shape[-2]):
        return _fallback(_np_dot, a, b, out)  # numpy's "shapes not aligned" error
    final = tuple(x.shape[:-1]) + (tuple(y.shape[:-2]) + tuple(y.shape[-1:]) if y.ndim >= 2 else ())
    if out is not None and (out.dtype != ct or tuple(out.shape) != final or not out.flags.c_contiguous):
        return _fallback(_np_dot, a, b, out)  # numpy's "output array is not acceptable" error
    if (xp is np and x.ndim <= 2 and y.ndim <= 2 and x.dtype == ct and y.dtype == ct and ct in dtypes.BY_DTYPE
            and (dev := dispatch.host_device()) is not None):
        # The CPU alone: numpy's own dot runs the host BLAS on 1-D and 2-D operands
        t0 = clock()
        res = _np_dot(x, y) if out is None else _np_dot(x, y, out)
        dispatch.record_host(dev, t0, ct, 2.0 * math.prod(final) * k)
        return res
    rows = math.prod(x.shape[:-1])
    cols = math.prod(y.shape[:-2]) * y.shape[-1] if y.ndim >= 2 else 1
    a2 = dispatch.as_operand(x, it).reshape(rows, k)
    b2 = dispatch.as_operand(y, it).reshape(k, 1) if y.ndim == 1 else xp.moveaxis(dispatch.as_operand(y, it), -2, 0).reshape(k, cols)
    direct = out is not None and not _aliases(out, x, y)
    res = out if direct else new_array(xp, final, ct, None, order="C")
    with dispatch.whole(direct):
        gemm_into(a2, b2, res.reshape(a2.shape[0], b2.shape[1]))
    if out is not None:
        if not direct:
            out[...] = res
            READONLY.drop_written([out])  # (the front end retires roots under a returned out, not under a scalar)
        return out[()] if final == () else out  # (numpy's dot gives the scalar, also with a 0-d out)
    return res[()] if final == () else res  # numpy returns a scalar for 1-D . 1-D


# ---------------------------------------------------------------- tensordot

def tensordot(a, b, axes=2, *, out_dtype=None, math=None):
    """``np.tensordot(a, b, axes)`` with the BLAS-type contraction run on blasx as one gemm.
    ``out_dtype`` and ``math``: see the module docstring."""
    if math is not None or out_dtype is not None:
        with precision.math_mode(math):
            return _tensordot(a, b, axes, out_dtype)
    if (dev := _host(a, b)) is not None:
        t0 = clock()
        res = _np_tensordot(a, b, axes)
        k2 = a.size * b.size // res.size if res.size else 0  # (m k) (k n) / (m n)
        _tls.stats = (dev, t0, clock(), a.dtype, 2.0 * res.size * _isqrt(k2))
        return res
    return _tensordot(a, b, axes, None)


@dispatch.front_end
def _tensordot(a, b, axes, out_dtype):
    arrays = _arrays(a, b)
    if arrays is None:
        return _fallback(_np_tensordot, a, b, axes)
    xp, x, y = arrays
    if (types := _engine_types(x, y, out_dtype)) is None or (parsed := _tensordot_axes(x, y, axes)) is None:
        return _fallback(_np_tensordot, a, b, axes)  # (bad axes or shapes: numpy's own error)
    (it, ct), (axes_a, axes_b) = types, parsed
    free_a = [i for i in range(x.ndim) if i not in axes_a]
    free_b = [i for i in range(y.ndim) if i not in axes_b]
    kdim = math.prod(x.shape[i] for i in axes_a)
    mdim = math.prod(x.shape[i] for i in free_a)
    ndim_ = math.prod(y.shape[i] for i in free_b)
    if xp is np and x.dtype == ct and y.dtype == ct and ct in dtypes.BY_DTYPE and (dev := dispatch.host_device()) is not None:
        # The CPU alone: numpy's own tensordot, one np.dot of the reshaped operands on the host BLAS
        t0 = clock()
        res = _np_tensordot(x, y, axes)
        dispatch.record_host(dev, t0, ct, 2.0 * mdim * ndim_ * kdim)
        return res
    a2 = dispatch.as_operand(x, it).transpose(free_a + axes_a).reshape(mdim, kdim)
    b2 = dispatch.as_operand(y, it).transpose(axes_b + free_b).reshape(kdim, ndim_)
    res = new_array(xp, (mdim, ndim_), ct, None, order="C")
    gemm_into(a2, b2, res)
    return res.reshape(tuple(x.shape[i] for i in free_a) + tuple(y.shape[i] for i in free_b))


def _tensordot_axes(x, y, axes):
    """numpy's axes rules, as normalized lists (axes_a, axes_b); None when numpy would raise."""
    try:
        n = axes if type(axes) is int else None  # (an int without iter()'s TypeError)
        if n is None:
            try:
                iter(axes)
            except TypeError:
                n = operator.index(axes)
        if n is not None:
            if n < 0 or n > x.ndim or n > y.ndim:
                return None
            axes_a, axes_b = range(x.ndim - n, x.ndim), range(n)
        else:
            axes_a, axes_b = axes
            axes_a, axes_b = _axis_list(axes_a), _axis_list(axes_b)
            if len(axes_a) != len(axes_b):
                return None
    except (TypeError, ValueError):
        return None
    norm_a, norm_b = [], []
    for i, j in zip(axes_a, axes_b):
        if not (-x.ndim <= i < x.ndim and -y.ndim <= j < y.ndim):
            return None
        i %= x.ndim
        j %= y.ndim
        if x.shape[i] != y.shape[j]:
            return None
        norm_a.append(i)
        norm_b.append(j)
    if len(set(norm_a)) != len(norm_a) or len(set(norm_b)) != len(norm_b):
        return None
    return norm_a, norm_b


def _axis_list(v) -> list[int]:
    """A sequence of axes, or one axis, as a list (TypeError: neither)."""
    try:
        return [operator.index(i) for i in v]
    except TypeError:
        return [operator.index(v)]


# ---------------------------------------------------------------- the gemm building blocks

def gemm_into(a2, b2, c2) -> None:
    """``c2[...] = a2 @ b2`` on the engine; 2-D operands of one BLAS dtype (or of a reduced type,
    c2 of its output type), c2 aliasing neither."""
    k = a2.shape[1]
    if k == 0:
        c2[...] = 0
        return
    dispatch.gemm(1, a2, b2, 0, c2, 0, 0, a2.dtype, k, math=precision.default_math())


def run_batch(a, b, c, xp=np) -> None:
    """``c[i] = a[i] @ b[i]`` over the common batch dimensions of a (..., n, k), b (..., k, m), c (..., n, m):
    a and b may be broadcast views (zero batch strides), c is writable and aliases neither."""
    batch = tuple(c.shape[:-2])
    n, k = a.shape[-2:]
    m = b.shape[-1]
    count = math.prod(batch)
    if count == 0 or n == 0 or m == 0:
        return
    if k == 0:
        c[...] = 0
        return
    z = (0,) * len(batch)  # the first item
    if count == 1:
        gemm_into(a[z], b[z], c[z])
        return
    if xp is np:
        shared_a, shared_b = _batch_shared(a), _batch_shared(b)
        if shared_a and shared_b:  # every item is the same product
            gemm_into(a[z], b[z], c[z])
            c[...] = c[z]
            return
        if shared_b:  # (N*n, k) @ (k, m); a copied to stacked rows when its rows lie at several strides
            rows = _stack_rows(a)
            if rows is None:
                rows = np.ascontiguousarray(a).reshape(count * n, k)
            _stacked(rows, b[z], c, count * n, m, False)
            return
        if shared_a:
            bt = _stack_rows(np.swapaxes(b, -1, -2))
            if bt is not None:  # c^T = b^T a^T: (N*m, k) @ (k, n)
                _stacked(bt, a[z].T, c, count * m, n, True)
                return
            # a @ [b_1 ... b_N]: b copied side by side, (n, k) @ (k, N*m)
            wide = np.ascontiguousarray(np.moveaxis(b.reshape(count, k, m), 0, 1)).reshape(k, count * m)
            buf = np.empty((n, count * m), dtype=c.dtype)
            gemm_into(a[z], wide, buf)
            c[...] = np.moveaxis(buf.reshape(n, count, m), 1, 0).reshape(c.shape)
            return
    with dispatch.overflow_tallied(), dispatch.one_profile():  # (one overflow warning, one profile: the batch)
        for idx in np.ndindex(*batch):
            gemm_into(a[idx], b[idx], c[idx])


def _stacked(lhs, rhs, c, rows: int, cols: int, transposed: bool) -> None:
    """One gemm of the stacked problem into c's stacked view, or into a buffer copied into c."""
    target = np.swapaxes(c, -1, -2) if transposed else c
    view = _stack_rows(target)
    if view is not None:
        gemm_into(lhs, rhs, view)
        return
    buf = np.empty((rows, cols), dtype=c.dtype)
    gemm_into(lhs, rhs, buf)
    target[...] = buf.reshape(target.shape)


def _batch_shared(x) -> bool:
    """True when every batch item of x is the same matrix (all batch strides 0, or size 1)."""
    return all(s == 0 or d == 1 for d, s in zip(x.shape[:-2], x.strides[:-2]))


def _stack_rows(x):
    """A 2-D view (prod(shape[:-1]), shape[-1]) of x without a copy, or None when its rows
    do not lie at one stride."""
    dims = [(d, s) for d, s in zip(x.shape[:-1], x.strides[:-1]) if d != 1]
    if any(s0 != s1 * d1 for (_, s0), (d1, s1) in zip(dims, dims[1:])):
        return None
    row_stride = dims[-1][1] if dims else x.itemsize * max(1, x.shape[-1])
    if dims and row_stride == 0:
        return None
    return np.lib.stride_tricks.as_strided(x, (math.prod(x.shape[:-1]), x.shape[-1]), (row_stride, x.strides[-1]),
                                           writeable=x.flags.writeable)


# ---------------------------------------------------------------- helpers

def _arrays(x1, x2, out=None):
    """(xp, a, b) of operands blasx may compute on: all CuPy (``out`` too, if given), or numpy
    arrays (array-likes converted, ``out`` a base-class ndarray); None: numpy (CuPy) decides."""
    if is_cupy(x1) or is_cupy(x2) or (out is not None and is_cupy(out)):
        if not (is_cupy(x1) and is_cupy(x2) and (out is None or is_cupy(out))):
            return None
        import cupy
        return cupy, x1, x2
    a, b = _plain(x1), _plain(x2)
    if a is None or b is None or (out is not None and type(out) is not np.ndarray):
        return None
    return np, a, b


def _fallback(np_fn, x1, x2, *args, **kwargs):
    """numpy's own ``np_fn`` (CuPy's namesake for CuPy operands): its result, or its error."""
    if is_cupy(x1) or is_cupy(x2):
        import cupy
        return getattr(cupy, np_fn.__name__)(x1, x2, *args, **kwargs)
    return np_fn(x1, x2, *args, **kwargs)


def _plain(x):
    """x as a base-class ndarray (array-likes converted), or None when numpy's dispatch must decide
    (ndarray subclasses, objects with __array_ufunc__ / __array_function__ overrides)."""
    if type(x) is np.ndarray:
        return x
    if isinstance(x, np.generic):
        return np.asarray(x)
    if isinstance(x, np.ndarray) or hasattr(type(x), "__array_ufunc__") or hasattr(type(x), "__array_function__"):
        return None
    try:
        arr = np.asarray(x)
    except Exception:  # noqa: BLE001 - numpy's own call will report it
        return None
    return arr if arr.dtype != object else None


def _aliases(out, *inputs) -> bool:
    return any(shares_memory(out, x) for x in inputs)
