"""GEMM and matmul on the engine, with scipy.linalg.blas ``?gemm`` semantics."""

from __future__ import annotations

import threading

import numpy as np
import scipy.linalg.blas as _sp_blas

from . import _hostcall, session
from .checks import check_matrix, check_scalar, check_trans, compute_dtype, same_place, shares_memory
from .operands import TokenTable, canonical, is_cupy, leading_dim, make_operand
from .runtime.call import Call, Operand
from .runtime.engine import EngineClosed
from .runtime.devices import numpy_kernels
from .runtime.stats import CallStats, DeviceInfo, OpRecord, clock
from .runtime.plans import plan_gemm
from .runtime.tiling import OP_C, OP_N, OP_T
from .tile import choose_tile


class _ThreadCalls(threading.local):
    """Per thread: ``stats`` of its last call made in Python, and that call's ``profile`` once
    made; ``c_guard``: what holds the device of the thread's last call taken by the C entry
    points (blasx._hostcall). Class-level defaults: a missing attribute never raises (getattr with
    a default costs ~0.7 us)."""
    stats = None
    profile = None
    profile_of = None
    c_guard = None


_tls = _ThreadCalls()

#: This thread's last call made in Python, for the host fast paths of the front ends to set:
#: ``last_call.stats`` is a CallStats, or a host record ``(device, t0, t1, dtype, real flops)``
#: that :func:`last_profile` turns into one when asked (a tuple: recording a call costs ~50 ns).
#: The C entry points keep their record in C (blasx._hostcall): :func:`last_record` is the newer
#: of the two, the thread's last call. A writer of a record reads the end of its call with
#: :data:`end_clock` right before it writes: that marks the C record older.
last_call = _tls

#: Level-3 routine names without a type prefix (the perf-db's ``routine`` field).
ROUTINES = frozenset(("gemm", "symm", "hemm", "syrk", "herk", "syr2k", "her2k", "trmm", "trsm"))

# The call each thread is running now (thread ident -> Call), for progress displays in other
# threads (``running_call``). Written only by the calling thread, under the lock.
_running: dict = {}
_running_lock = threading.Lock()


def running_call(thread_ident: int):
    """The :class:`~blasx.runtime.call.Call` that thread ``thread_ident`` is running now, or None.

    Read-only, for progress displays: ``len(call.tasks) - call.remaining`` tasks are accounted
    for (done, or dropped when the call fails). Safe to call from any thread."""
    with _running_lock:
        return _running.get(thread_ident)


def last_record():
    """This thread's last blasx call: a CallStats, a host record ``(device, t0, t1, dtype, real
    flops)`` or None. The newer of the Python paths' record (``last_call.stats``) and the C entry
    points' (blasx._hostcall, when the library is loaded), in program order: a C call marks its
    record newer, a Python path's :data:`end_clock` read marks it older. A C record that is newer
    is taken: it becomes ``last_call.stats``."""
    if _c_take is not None:
        rec = _c_take()
        if rec is not None:
            _tls.stats = rec
            return rec
    return _tls.stats


def last_profile():
    """The profile (:class:`blasx.runtime.stats.Profile`) of this thread's last blasx call, or None."""
    stats = last_record()
    if stats is None:
        return None
    if type(stats) is tuple:
        stats = _tls.stats = _host_stats(*stats)
    prof = _tls.profile
    if prof is None or _tls.profile_of is not stats:
        prof = _tls.profile = stats.profile()  # made on demand: a small call need not pay for it
        _tls.profile_of = stats
    return prof


def _keep_profile(stats) -> None:
    """``stats`` becomes this thread's last call; its profile is made when asked for. A call
    that failed before its last task may have no finish time yet: it ends now."""
    if not stats.finished:
        stats.finish()
    end_clock()  # (the C record is older)
    _tls.stats = stats


def keep_host_call(dev, t0: float, dtype: np.dtype, real_flops: float) -> None:
    """A call the host BLAS ran in this thread from ``t0`` until now becomes this thread's last
    call: one clock read and one tuple (the hot paths write the same tuple themselves).
    ``real_flops`` counts a real call's flops (a complex one counts 4 times that)."""
    _tls.stats = (dev, t0, end_clock(), dtype, real_flops)


def _host_stats(dev, t0: float, t1: float, dtype: np.dtype, real_flops: float) -> CallStats:
    """The stats of a host call recorded by :func:`keep_host_call`: one task on the CPU device."""
    flops = real_flops * (4.0 if dtype.kind == "c" else 1.0)
    stats = CallStats([DeviceInfo(dev.index, dev.name, dev.kind)], keep_records=dev.trace)
    stats.start(t0)
    row = stats.owned_row(0)
    row["tasks"], row["steps"], row["flops"] = 1, 1, flops
    stats.add_record(OpRecord(0, "host", t0, t1, flops=flops, task=0, name="task"))
    stats.finish(t1)
    return stats


_FAST_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.complex64, np.complex128))

# scipy's own ?gemm per dtype (taken from scipy.linalg._fblas through get_blas_funcs, never the
# module attribute that blasx.offload may replace): the host BLAS of a CPU-only gemm.
_HOST_GEMM = {dt: _sp_blas.get_blas_funcs("gemm", dtype=dt) for dt in _FAST_DTYPES}

_OPS = frozenset((OP_N, OP_T, OP_C))

_REAL_SCALARS = frozenset((float, int, np.float64, np.float32, np.int64, np.int32))
#: dtype -> the types of alpha and beta the host gemm takes as they are: Python's and numpy's
#: numbers, which scipy's ?gemm and blasx's kernels convert alike (blasx rejects a complex scalar
#: with a non-zero imaginary part for a real type, and a bool: the general path)
_HOST_SCALARS = {dt: _REAL_SCALARS | ({complex, np.complex128, np.complex64} if dt.kind == "c" else set())
                 for dt in _FAST_DTYPES}
_ndarray = np.ndarray


def _op_shape(x, op: int) -> tuple[int, int]:
    return x.shape if op == OP_N else (x.shape[1], x.shape[0])


def gemm(alpha, a, b, beta=0.0, c=None, trans_a=0, trans_b=0, overwrite_c=False):
    """C = alpha op(a) op(b) + beta c, as scipy.linalg.blas.?gemm, on every configured device.

    The dtype is the BLAS type of a, b (and c): float32, float64, complex64 or
    complex128. numpy arrays give a result in host memory (F-ordered, as
    scipy's); cupy arrays give a result on a's device. With ``overwrite_c``
    and a c of the right dtype, the result is written into c and c is
    returned. Nothing is written when the arguments are rejected.
    """
    dev = session.host_device
    if (dev is not None and type(a) is _ndarray and type(b) is _ndarray and (dt := a.dtype) is b.dtype
            and (scalars := _HOST_SCALARS.get(dt)) is not None and type(alpha) in scalars and type(beta) in scalars
            and type(trans_a) is int and type(trans_b) is int and trans_a in _OPS and trans_b in _OPS
            and a.ndim == 2 and b.ndim == 2 and (c is None or (type(c) is _ndarray and c.dtype is dt and c.ndim == 2))):
        # The CPU alone, and a call that passes every check below by construction (``is`` for the
        # dtypes: numpy's builtin dtypes are singletons; an equal one that is another object
        # takes the shortcut below)
        out = _host_gemm(dev, alpha, a, b, beta, c, trans_a, trans_b, overwrite_c, dt)
        if out is not None:
            return out
    if (c is None and type(a) is np.ndarray and type(b) is np.ndarray and a.ndim == 2 and b.ndim == 2
            and a.dtype == b.dtype and a.dtype in _FAST_DTYPES and type(alpha) in (float, int)
            and type(trans_a) is int and type(trans_b) is int and trans_a in (0, 1, 2) and trans_b in (0, 1, 2)):
        # The commonest call (two numpy matrices of one BLAS type, a real alpha, no c) passes
        # every check below by construction: skip them (~15 us, most of a small CPU call).
        m, ka = _op_shape(a, trans_a)
        kb, n = _op_shape(b, trans_b)
        if ka == kb:  # else the checks below raise the error
            out = np.empty((m, n), dtype=a.dtype, order="F")
            if m and n:
                _run_gemm(alpha, a, b, 0, out, trans_a, trans_b, a.dtype, ka)
            return out
    check_matrix("a", a)
    check_matrix("b", b)
    if c is not None:
        check_matrix("c", c)
    on_gpu = same_place(a=a, b=b, c=c)
    trans_a = check_trans("trans_a", trans_a)
    trans_b = check_trans("trans_b", trans_b)
    dtype = compute_dtype(a, b) if c is None else compute_dtype(a, b, c)
    alpha = check_scalar("alpha", alpha, dtype)
    beta = check_scalar("beta", beta, dtype)
    m, ka = _op_shape(a, trans_a)
    kb, n = _op_shape(b, trans_b)
    if ka != kb:
        raise ValueError(f"a, b: op(a) is {m}x{ka} (a.shape={a.shape}, trans_a={trans_a}) but op(b) is "
                         f"{kb}x{n} (b.shape={b.shape}, trans_b={trans_b}); their inner dimensions must match")
    if c is not None:
        if c.shape != (m, n):
            raise ValueError(f"c: got shape {c.shape}, expected ({m}, {n}) = rows of op(a) x columns of op(b)")
        for name, x in (("a", a), ("b", b)):
            if shares_memory(c, x):
                raise ValueError(f"c: shares memory with {name}; the output must not alias an input")
    xp = _xp(on_gpu)
    a = _as_dtype(a, dtype, xp)
    b = _as_dtype(b, dtype, xp)
    if c is None:
        beta = 0
    out = _output(c, dtype, (m, n), overwrite_c, beta, xp, a if on_gpu else None)
    if m and n:
        _run_gemm(alpha, a, b, beta, out, trans_a, trans_b, dtype, ka)
    return out


# The CPU alone: a blasx.gemm call that _host_gemm takes (c, beta, overwrite_c included; arguments by
# position or keyword) is checked in C and runs _host_gemm's call there (blasx._hostcall), every
# other call the Python function above
gemm = _hostcall.gemm(gemm, _HOST_GEMM, _HOST_SCALARS)
#: the C entry points' record (see last_record): its taker, and the clock a Python path reads for the
#: end of a call it records (perf_counter's value; the C record becomes older), perf_counter without them
_c_take, end_clock = _hostcall.record_reader() or (None, clock)


def _host_gemm(dev, alpha, a, b, beta, c, trans_a: int, trans_b: int, overwrite_c, dtype):
    """The CPU alone (``session.host_device``): scipy's own ?gemm, on F-ordered views where the
    operands allow it (scipy would copy a C-ordered operand first), for a call that passed every
    check by construction (see gemm). None when the shapes do not fit or a dimension is 0 (the
    general path raises, or makes BLAS's quick return), or when c is not one :func:`_c_mode`
    takes. Alpha 0 is never handed to scipy's ?gemm: BLAS reads neither a nor b then, but some
    OpenBLAS builds do (a NaN leaked in; _hostcall's HC_GEMM_ALPHA0), so :func:`host_scale` makes
    C = beta C here, as the general path's plan would. scipy's ?gemm does not read c when beta is 0."""
    sa, sb = a.shape, b.shape
    m, k = (sa[1], sa[0]) if trans_a else sa
    kb, n = (sb[1], sb[0]) if trans_b else sb
    if k != kb or not (m and n and k):
        return None
    fa, fb = a.flags, b.flags  # (made once: 35 ns each)
    mode = _C_NONE
    if c is not None:
        if c.shape != (m, n):
            return None
        mode = _c_mode(c, overwrite_c, a, b, fa.owndata and fb.owndata)
        if mode is None:
            return None
    if alpha == 0:
        t0 = clock()
        out = host_scale(beta, c, mode in (_C_IN_PLACE, _C_IN_PLACE_T), (m, n), dtype)
        _tls.stats = (dev, t0, end_clock(), dtype, 0.0)  # (the general path's C = beta C records no flops)
        return out
    if mode == _C_IN_PLACE_T:  # C^T = op(B)^T op(A)^T, written into the F-ordered c.T
        swapped = _SWAPPED_OPS[dtype.kind == "c"]
        if trans_a not in swapped or trans_b not in swapped:
            return None  # (op C transposed is conj without transpose: no BLAS form)
        a, b, fa, fb, trans_a, trans_b = b, a, fb, fa, swapped[trans_b], swapped[trans_a]
    # a C-ordered x is the F-ordered x.T: op N of x is op T of x.T and back (op C of x would be
    # conj without transpose of x.T: no BLAS form)
    if trans_a != OP_C and fa.c_contiguous and not fa.f_contiguous:
        a, trans_a = a.T, 1 - trans_a
    if trans_b != OP_C and fb.c_contiguous and not fb.f_contiguous:
        b, trans_b = b.T, 1 - trans_b
    t0 = clock()
    if mode == _C_NONE:  # beta is ignored without c (scipy would scale its zero c by it)
        out = _HOST_GEMM[dtype](alpha, a, b, 0.0, None, trans_a, trans_b)
    else:
        out = _HOST_GEMM[dtype](alpha, a, b, beta, c.T if mode == _C_IN_PLACE_T else c, trans_a, trans_b,
                                mode != _C_COPY)
        if mode != _C_COPY:
            out = c
    _tls.stats = (dev, t0, end_clock(), dtype, 2.0 * m * n * k)
    return out


def host_scale(beta, c, in_place: bool, shape: tuple, dtype):
    """C = beta C of an alpha-0 gemm on the host, A and B unread: in c itself (``in_place``: c is of
    ``dtype``, writable, C- or F-contiguous) and c returned, else a new F-ordered array of ``shape``
    (zeros without c). beta 0: c is not read, so its NaNs do not leak in (BLAS)."""
    if in_place:
        numpy_kernels.scale_views(c, dtype.type(beta))
        return c
    if c is None or beta == 0:
        return np.zeros(shape, dtype=dtype, order="F")
    if c.dtype is dtype:  # one ufunc call makes the F-ordered product (beta of c's type: no promotion)
        return np.multiply(c, dtype.type(beta), order="F")
    out = np.array(c, dtype=dtype, order="F")  # (c of another BLAS type: converted, as scipy converts it)
    out *= dtype.type(beta)
    return out


_hostcall.set_scale(host_scale)  # the C entry points' alpha-0 gemms


# How _host_gemm writes c: no c; into a new array (scipy copies c); in place into the F-ordered c;
# in place into c.T, the F-ordered view of a C-ordered c
_C_NONE, _C_COPY, _C_IN_PLACE, _C_IN_PLACE_T = 0, 1, 2, 3

# op of x -> op of x.T giving the transposed product, for real types (op C is op T) and complex ones
_SWAPPED_OPS = ({OP_N: OP_T, OP_T: OP_N, OP_C: OP_N}, {OP_N: OP_T, OP_T: OP_N})

_OVERWRITE_TYPES = frozenset((int, bool))


def _c_mode(c, overwrite_c, a, b, inputs_own_data: bool):
    """How _host_gemm writes the c of a host gemm, or None (the general path) when it cannot:
    blasx.gemm raises when c may alias a or b (written in place or not: the general path
    raises, here only no alias is proven: cheaply for arrays that each own their buffer, c and
    both inputs (``inputs_own_data``), else by numpy's bounds test), and with ``overwrite_c``
    writes into c whatever its layout (here only an F- or C-contiguous, writable, aligned c;
    scipy would copy any other, and write into a read-only one)."""
    if type(overwrite_c) not in _OVERWRITE_TYPES or a is c or b is c:
        return None
    fl = c.flags
    if not (inputs_own_data and fl.owndata) and (np.may_share_memory(c, a) or np.may_share_memory(c, b)):
        return None
    if not overwrite_c:
        return _C_COPY
    if not (fl.writeable and fl.aligned):
        return None
    if fl.f_contiguous:
        return _C_IN_PLACE
    return _C_IN_PLACE_T if fl.c_contiguous else None


def matmul(a, b, out=None):
    """numpy-style ``a @ b`` for 1-D and 2-D arrays (batches come with the drop-in layer)."""
    check_array = (isinstance(a, np.ndarray) or is_cupy(a)), (isinstance(b, np.ndarray) or is_cupy(b))
    if not all(check_array):
        bad = "a" if not check_array[0] else "b"
        raise TypeError(f"{bad}: got {type(a if bad == 'a' else b).__name__}, expected a numpy or cupy array")
    for name, x in (("a", a), ("b", b)):
        if x.ndim not in (1, 2):
            raise ValueError(f"{name}: got a {x.ndim}-D array; blasx.matmul takes 1-D or 2-D arrays")
    on_gpu = same_place(a=a, b=b, out=out)
    xp = _xp(on_gpu)
    rt = xp.result_type(a, b)
    if rt not in (np.float32, np.float64, np.complex64, np.complex128):
        return xp.matmul(a, b, out=out)  # integers, bool, float16: numpy's own loops, numpy's dtype rules
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    if a2.shape[1] != b2.shape[0]:
        raise ValueError(f"a, b: matmul: a has shape {a.shape} and b has shape {b.shape}; "
                         f"a's last dimension ({a2.shape[1]}) must equal b's first ({b2.shape[0]})")
    shape = a2.shape[:1] + b2.shape[1:]
    final = tuple(d for d, keep in zip(shape, (a.ndim == 2, b.ndim == 2)) if keep)
    if out is not None:
        if out.shape != final:
            raise ValueError(f"out: got shape {out.shape}, expected {final}")
        if out.dtype != rt:
            raise TypeError(f"out: got dtype {out.dtype}, expected {rt} (the result type of a and b)")
        for name, x in (("a", a), ("b", b)):
            if shares_memory(out, x):
                raise ValueError(f"out: shares memory with {name}; the output must not alias an input")
    res = xp.empty(shape, dtype=rt) if out is None else out.reshape(shape)
    if shape[0] and shape[1]:
        if a2.shape[1] == 0:
            res[...] = 0
        else:
            _run_gemm(1, _as_dtype(a2, rt, xp), _as_dtype(b2, rt, xp), 0, res, 0, 0, np.dtype(rt), a2.shape[1])
    if out is not None:
        return out
    return res.reshape(final)


# ---------------------------------------------------------------- internals

def _xp(on_gpu: bool):
    if on_gpu:
        import cupy
        return cupy
    return np


def _as_dtype(x, dtype, xp):
    return x if x.dtype == dtype else x.astype(dtype)


def _output(c, dtype, shape, overwrite_c, beta, xp, like):
    """Where the result goes: c itself (overwrite_c, right dtype) or a new F-ordered array."""
    if c is not None and overwrite_c and c.dtype == dtype:
        return c
    if like is not None:
        with like.device:
            out = xp.empty(shape, dtype=dtype, order="F")
    else:
        out = xp.empty(shape, dtype=dtype, order="F")
    if c is not None and beta != 0:
        out[...] = c
    return out


def _run_gemm(alpha, a, b, beta, c, trans_a, trans_b, dtype, k) -> None:
    """Canonicalise (transpose trick), plan, submit, and keep the profile."""
    from .operands import column_major_view

    cm = column_major_view(c)
    staging = None
    if cm is None:  # an output with arbitrary strides: compute into a compact copy, copy back
        staging = _xp(is_cupy(c)).asfortranarray(c)
        cm = (staging, False)
    cv, tp = cm
    if tp:  # C^T = op(B)^T op(A)^T
        va, opa = canonical(b, trans_b, True)
        vb, opb = canonical(a, trans_a, True)
    else:
        va, opa = canonical(a, trans_a, False)
        vb, opb = canonical(b, trans_b, False)
    m, n = cv.shape
    eng = session.engine()
    if eng.inline and eng.config.tile is None:
        _gemm_on_host(eng, alpha, va, opa, vb, opb, beta, cv, dtype, k)
    else:
        submit_planned(
            "gemm", [va, vb, cv],
            lambda tile, block: plan_gemm(m, n, k, tile, opa, opb, alpha_zero=(alpha == 0), beta_zero=(beta == 0),
                                          is_complex=dtype.kind == "c", block=block),
            dtype, alpha, beta, (m, n, k))
    if staging is not None:
        c[...] = staging


def _gemm_on_host(eng, alpha, a, op_a, b, op_b, beta, c, dtype, k) -> None:
    """The CPU is the only device: the host BLAS on the canonical views, in this thread, with
    the profile of a one-task call. What the planner would run (one task: the gemm kernel, or
    C = beta C when alpha == 0 or k == 0, A and B unread), without the planning, operands and
    engine hand-off that cost ~0.1 ms a call (bench/results/NOTES.md, third session)."""
    t = dtype.type
    t0 = clock()
    if alpha == 0 or k == 0:
        numpy_kernels.scale_views(c, t(beta))
        flops = 0.0
    else:
        numpy_kernels.gemm_views(a, b, c, op_a, op_b, t(alpha), t(beta))
        flops = 2.0 * c.shape[0] * c.shape[1] * k
    keep_host_call(eng.devices[0], t0, dtype, flops)


def block_shape(eng) -> tuple[int, int]:
    """Blocks of C tiles in queue order (``Knobs.block_order``): 2 x (streams / 2), else single tiles."""
    streams = eng.config.streams
    return (2, max(1, streams // 2)) if eng.config.knobs.block_order else (1, 1)


def submit_planned(name: str, views: list, plan, dtype, alpha, beta, dims: tuple[int, int, int],
                   scratch=None) -> None:
    """Run one planned call on the engine: choose the tile, make the operands, plan, submit, keep the profile.

    ``views`` are the operands in canonical (column-major) form, in the planner's
    slot order; ``plan(tile, block)`` returns the tasks; ``dims = (m, n, k)``
    sizes the call for the tile choice. ``scratch(engine, tile)``, if given, returns
    the shape of one more operand the planner writes and reads (None: none); it is
    made where ``_scratch_home`` says, appended to the
    operands, and the plan is then ``plan(tile, block, True)``. Raises the call's
    error, if any.
    A call that finds its engine shut down before its tasks were queued (configure() or
    shutdown() in another thread) runs on the engine that replaces it.
    """
    dtype = np.dtype(dtype)
    for attempt in range(_ENGINE_ATTEMPTS):
        eng = session.engine()
        if eng.inline:
            _submit_on_host(eng, name, views, plan, dtype, alpha, beta, dims)
            return
        try:
            _submit_on(eng, name, views, plan, dtype, alpha, beta, dims, scratch)
            return
        except EngineClosed:
            if attempt == _ENGINE_ATTEMPTS - 1:
                raise


# Engines a call tries when each is shut down before it was queued: enough for a configure()
# racing the call, bounded for an exit (atexit's shutdown) racing it.
_ENGINE_ATTEMPTS = 3


def _submit_on(eng, name, views, plan, dtype, alpha, beta, dims, scratch=None) -> None:
    """:func:`submit_planned` on the worker engine ``eng`` (raises EngineClosed from eng.submit)."""
    tile = choose_tile(eng, *dims, dtype, name if name in ROUTINES else name[1:])  # "dtrsm" -> "trsm"
    shape = scratch(eng, tile) if scratch is not None else None
    if shape is None:
        _submit_tasks(eng, name, views, plan(tile, block_shape(eng)), dtype, alpha, beta, tile)
        return
    home = _scratch_home(eng, views[0])
    if home is None:
        extra = np.empty(shape, dtype=dtype, order="F")
    else:
        import cupy
        with cupy.cuda.Device(home):
            extra = cupy.empty(shape, dtype=dtype, order="F")
    _submit_tasks(eng, name, [*views, extra], plan(tile, block_shape(eng), True), dtype, alpha, beta, tile)


def _scratch_home(eng, like) -> int | None:
    """Where a planner's scratch operand lives: on the GPU of CuPy operands, else on the engine's
    first GPU (its tiles then never cross the host link, and host memory is not page-locked for
    it: a fresh 1 GiB host scratch cost a one-shot DTRSM N=32768 ~0.3 s on 2 H200s; the call
    then runs on the GPU workers only), else (sim and CPU devices) in host memory (None)."""
    if not isinstance(like, np.ndarray):
        return like.device.id
    return next((d.ordinal for d in eng.devices if d.kind == "cuda"), None)


def _submit_tasks(eng, name, views, tasks, dtype, alpha, beta, tile) -> None:
    tokens = TokenTable(tile)
    operands = [make_operand(v, tokens) for v in views]
    stats = CallStats([DeviceInfo(d.index, d.name, d.kind) for d in eng.devices],
                      keep_records=session.settings().trace)
    call = Call(name, operands, tasks, dtype, alpha, beta, stats)
    call.tile = tile
    for d in _backends(eng):
        d.prepare_call(call)
    ident = threading.get_ident()
    with _running_lock:
        outer = _running.get(ident)
        _running[ident] = call
    try:
        eng.submit(call)
    finally:
        with _running_lock:
            if outer is None:
                _running.pop(ident, None)
            else:
                _running[ident] = outer
        for d in _backends(eng):
            d.finish_call(call)
        _keep_profile(stats)


def _submit_on_host(eng, name, views, plan, dtype, alpha, beta, dims) -> None:
    """The CPU is the only device: the tasks run in this thread (``Engine.inline``), one task
    unless a tile was configured (then the host BLAS sees the whole problem at once). No
    tile cache, so no tokens and no page-locking: only what the CPU kernels read."""
    dev = eng.devices[0]
    tile = eng.config.tile or max(1, *dims)
    operands = [Operand(v, v.shape[0], v.shape[1], leading_dim(v), 0, -1, _HOST_TOKEN) for v in views]
    stats = CallStats([DeviceInfo(dev.index, dev.name, dev.kind)], keep_records=session.settings().trace)
    call = Call(name, operands, plan(tile, (1, 1)), dtype, alpha, beta, stats)
    call.tile = tile
    try:
        eng.submit(call)
    finally:
        _keep_profile(stats)


# Token of every operand of an inline (CPU-only) call: nothing is cached, so none is needed;
# base 0 is never a per-call base (those are negative) nor a read-only one (positive).
_HOST_TOKEN = (0,)


def _backends(eng):
    """One device of each backend class: per-call host preparation (pinning, CPU thread limits)."""
    seen = {}
    for d in eng.devices:
        seen.setdefault(type(d), d)
    return list(seen.values())
