"""The one path of every blasx call: validated canonical operands -> the host BLAS or the engine.

Every front end validates its arguments and makes its output first (nothing is written before a call
is known to be good), casts each operand at most once (:func:`as_operand`) and hands the call to
:func:`run`: with the CPU alone (:func:`host_device`) scipy's or numpy's own routine in the caller's
thread, else planned and submitted (:func:`submit_planned`); either way the thread's :func:`last_profile`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import warnings

import numpy as np
import scipy.linalg.blas as _sp_blas

from . import session
from .operands import READONLY, TokenTable, array_module, canonical, column_major_view, is_cupy, make_operand, top_array
from .runtime import dtypes, hostpool
from .runtime.call import Call
from .runtime.devices.numpy_kernels import scale_views
from .runtime.engine import EngineClosed
from .runtime.plans import choose_split, partial_shape, plan_gemm
from .runtime.stats import CallStats, DeviceInfo, OpRecord, clock, combined
from .threadlocal import setting
from .tile import choose_tile

_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)


class Float16OverflowWarning(RuntimeWarning):
    """A float16 result has values beyond float16's range (they became inf) from finite inputs."""


#: Level-3 routine names without a type prefix (the perf-db's ``routine`` field).
ROUTINES = frozenset(("gemm", "symm", "hemm", "syrk", "herk", "syr2k", "her2k", "trmm", "trsm"))


# ---------------------------------------------------------------- this thread's last call

class _ThreadCalls(threading.local):
    """Per thread: ``stats`` of its last call (a CallStats, a host record ``(device, t0, t1, dtype, real
    flops)``, or a list of those for a batched front end's items, ``batch`` while it runs), and that call's
    ``profile`` once made."""
    stats = None
    profile = None
    profile_of = None
    batch = None


_tls = _ThreadCalls()

# The call each thread is running on the engine now (thread ident -> Call), for progress displays.
# Written only by the calling thread, under the lock.
_running: dict = {}
_running_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """The parent's calls are not the child's; a parent thread may have held the lock at the fork."""
    global _running, _running_lock
    _running, _running_lock = {}, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def running_call(thread_ident: int):
    """The :class:`~blasx.runtime.call.Call` that thread ``thread_ident`` is running now, or None
    (from any thread; read-only, for progress displays)."""
    with _running_lock:
        return _running.get(thread_ident)


def last_profile():
    """The profile (:class:`blasx.runtime.stats.Profile`) of this thread's last blasx call, or None."""
    stats = _tls.stats
    if stats is None:
        return None
    if type(stats) is tuple:
        stats = _tls.stats = _host_stats(*stats)
    if _tls.profile_of is not stats:  # made on demand: a small call need not pay for it
        _tls.profile = stats.profile() if type(stats) is not list else combined(
            [(_host_stats(*s) if type(s) is tuple else s).profile() for s in stats])
        _tls.profile_of = stats
    return _tls.profile


@contextlib.contextmanager
def one_profile():
    """Inside, this thread's blasx calls make one profile together (a batched front end's items)."""
    outer, _tls.batch = _tls.batch, []
    try:
        yield
    finally:
        items, _tls.batch = _tls.batch, outer
        if items:
            _set_stats(items if len(items) > 1 else items[0])


def _set_stats(stats) -> None:
    """``stats`` (a CallStats or a host record) is this thread's last call, or one item of its batch."""
    if _tls.batch is not None:
        _tls.batch.append(stats)
    else:
        _tls.stats = stats


def record_host(dev, t0: float, dtype, real_flops: float) -> None:
    """A call the host BLAS ran in this thread from ``t0`` until now becomes this thread's last
    call. ``real_flops`` counts a real call's flops (a complex one counts 4 times that)."""
    _set_stats((dev, t0, clock(), dtype, real_flops))


def _host_stats(dev, t0: float, t1: float, dtype, real_flops: float) -> CallStats:
    """The stats of a host call: one task on the CPU device."""
    flops = real_flops * (4.0 if np.dtype(dtype).kind == "c" else 1.0)
    stats = CallStats([DeviceInfo(dev.index, dev.name, dev.kind)], keep_records=dev.trace)
    stats.start(t0)
    row = stats.owned_row(0)
    row["tasks"], row["steps"], row["flops"] = 1, 1, flops
    stats.add_record(OpRecord(0, "host", t0, t1, flops=flops, task=0, name="task"))
    stats.host["math"] = "ieee"  # the host BLAS has no TF32
    stats.finish(t1)
    return stats


# ---------------------------------------------------------------- host or engine

def host_device():
    """The CPU device when every call runs on the host BLAS in its caller's thread, else None; starts
    the engine on first use, so the first call is routed as every later one."""
    dev = session.host_device
    if dev is None:
        session.engine()  # publishes session.host_device when the engine runs on the host
        dev = session.host_device
    return dev


@functools.cache
def blas_routine(routine: str, dtype):
    """scipy's own ``?routine`` for ``dtype`` (from its extension module through get_blas_funcs,
    never the module attribute that blasx.offload may replace)."""
    return _sp_blas.get_blas_funcs(routine, dtype=np.dtype(dtype))


def written(out, res) -> None:
    """Make ``out`` hold ``res``, a host routine's result for it: f2py returns ``out`` itself when
    it wrote it in place, else a copy (an ``out`` it could not take as it is)."""
    if res is not out:
        out[...] = res


@contextlib.contextmanager
def whole(writes_caller: bool, steps: bool = False):
    """A call that writes the caller's own array (``overwrite_c``, ``overwrite_b``, ``out=``) on the
    engine is not cut short by Ctrl-C: the interrupt takes effect once the call returns, as with
    numpy's and scipy's own calls, so that array is fully written (calls into fresh arrays are
    cancelled at once instead, the caller's arrays untouched). A second Ctrl-C meanwhile stops the call at
    once (the array then partly written). Main thread only; else a no-op. ``steps``: the work is several steps
    in Python (a layer of blasx.dnn), held also with the CPU alone (one host BLAS call is not interruptible)."""
    main = writes_caller and (steps or session.host_device is None) and \
        threading.current_thread() is threading.main_thread()
    old = signal.getsignal(signal.SIGINT) if main else None
    if not callable(old):  # (also a handler that is not Python's: SIG_IGN, SIG_DFL)
        yield
        return
    hit = []

    def held(signum, frame):
        hit.append((signum, frame))
        if len(hit) > 1:  # the user insists
            old(signum, frame)
    signal.signal(signal.SIGINT, held)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if len(hit) == 1:
        old(*hit[0])  # the deferred Ctrl-C: Python's handler raises KeyboardInterrupt here


def as_operand(x, dtype):
    """``x`` of ``dtype``: itself, or one compact copy (a broadcast view is copied once, never twice)."""
    return x if x.dtype == dtype else x.astype(dtype)


def run(name: str, views: list, plan, dtype, alpha, beta, dims: tuple[int, int, int], *,
        host=None, flops: float = 0.0, scratch=None, **options) -> None:
    """Run one validated call on canonical operands: the entry every front end (and ``blasx.dnn``) uses.

    ``views``: column-major views of one BLAS ``dtype`` in the planner's slot order, outputs included;
    ``plan``, ``dims``, ``scratch`` and ``options`` as :func:`submit_planned` takes them. ``host()``,
    if given, computes the same on the host BLAS into the output views: with the CPU alone and numpy
    operands it runs instead of the engine, recorded as one host task of ``flops`` real flops.
    """
    if host is not None and type(views[0]) is np.ndarray and (dev := host_device()) is not None:
        t0 = clock()
        host()
        record_host(dev, t0, dtype, flops)
        return
    submit_planned(name, views, plan, dtype, alpha, beta, dims, scratch, **options)


def gemm(alpha, a, b, beta, c, trans_a: int, trans_b: int, dtype, k: int, name: str = "gemm", *,
         math: str = "ieee", epilogue=None, c_src=None) -> None:
    """c = alpha op(a) op(b) + beta c, written into the 2-D ``c`` (any strides), on validated
    operands of ``dtype`` (c aliasing neither a nor b, its shape op(a)'s rows x op(b)'s columns,
    ``k`` the inner dimension). beta 0: c is not read. alpha 0 or k 0: C = beta C, a and b unread
    (never handed to a host ?gemm: some OpenBLAS builds multiply anyway).

    A *mixed* call (reduced types: ``dtype`` float16, bfloat16 or int8, or c of another type
    than ``dtype``) accumulates in the type's compute type and rounds once to c's type; it
    always runs on the engine. ``math``: "tf32" runs float32 on TF32 tensor cores (GPUs only).
    ``epilogue``: work on each finished C tile (runtime/epilogues.py), given for c as passed
    (transposed here when the call computes C^T). ``c_src``: where c's values are (c a new array,
    beta != 0): the tasks read their C tiles' first contents there (a host copy into c saved), or
    c is filled from it first where the call cannot (see :func:`_init_view`)."""
    if c.shape[0] == 0 or c.shape[1] == 0:
        return
    dtype = np.dtype(dtype)
    mixed = c.dtype != dtype or dtype not in dtypes.BY_DTYPE
    product = alpha != 0 and k != 0
    if not product and beta == 1 and epilogue is None and c_src is None:
        return  # C = 1 C: BLAS returns at once (c not rewritten: a complex inf keeps its zero imaginary part)
    cm = column_major_view(c)
    init = None if c_src is None else _init_view(c_src, c, cm, mixed or epilogue is not None or beta == 0)
    if mixed and not product:
        _scale_mixed(c, dtype, beta)
        return
    staging = None
    if cm is None:  # an output with arbitrary strides: compute into a compact copy, copied back
        staging = array_module(is_cupy(c)).asfortranarray(c)
        cm = (staging, False)
    cv, tp = cm
    if tp:  # C^T = op(B)^T op(A)^T
        va, opa = canonical(b, trans_b, True)
        vb, opb = canonical(a, trans_a, True)
        if epilogue is not None:
            epilogue = epilogue.transposed()
    else:
        va, opa = canonical(a, trans_a, False)
        vb, opb = canonical(b, trans_b, False)
    m, n = cv.shape

    def host():
        if init is not None:
            fill_from(c, c_src)
        if product:
            written(cv, blas_routine("gemm", dtype)(alpha, va, vb, beta, cv, opa, opb, 1))
        else:
            scale_views(cv, dtype.type(beta))

    # (the engine's options only where one differs from its default: no dict to build per host call)
    options = {} if not mixed and epilogue is None and math == "ieee" else {
        "out_dtype": c.dtype if mixed else None, "math": math, "epilogue": epilogue}
    split = [1]

    def partials(eng, tile):  # split-k's scratch (an epilogue would run on the partial tiles too)
        split[0] = gemm_split(eng, m, n, k, tile, dtype) if product and epilogue is None else 1
        return partial_shape(m, n, split[0]) if split[0] > 1 else None

    run(name, [va, vb, cv] + ([] if init is None else [init]),
        lambda tile, block, scratch=False: plan_gemm(
            m, n, k, tile, opa, opb, alpha_zero=(alpha == 0), beta_zero=(beta == 0), is_complex=dtype.kind == "c",
            block=block, split=split[0] if scratch else 1, c_init=init is not None),
        dtype, alpha, beta, (m, n, k), host=None if mixed or epilogue is not None else host,
        flops=2.0 * m * n * k if product else 0.0, scratch=partials, **options)
    if staging is not None:
        c[...] = staging


def _init_view(c_src, c, cm, refuse: bool):
    """The view of ``c_src`` in ``c``'s column-major orientation ``cm`` that a new result's tasks start from,
    or None after filling c from c_src here: a mixed call, an epilogue or beta 0 (``refuse``), an output
    without a column-major view, or a c_src that is not a numpy array of c's type in c's orientation."""
    if not refuse and cm is not None and type(c_src) is np.ndarray and type(c) is np.ndarray \
            and c_src.dtype == c.dtype and c_src.shape == c.shape:
        src = column_major_view(c_src)
        if src is not None and src[1] == cm[1]:
            return src[0]
    fill_from(c, c_src)
    return None


def fill_from(out, c) -> None:
    """out[...] = c; a large host copy on several threads (a new result holding c's values)."""
    if type(out) is np.ndarray and isinstance(c, np.ndarray):
        hostpool.copy_into(out, c)
    else:
        out[...] = c


def gemm_split(eng, m: int, n: int, k: int, tile: int, dtype) -> int:
    """Split-k's partial sums per C tile for an m x n x k product of ``dtype`` on ``eng`` with
    ``tile`` (``plans.choose_split`` on its stream devices; 1 where ``Knobs.split_k`` is off)."""
    if not eng.config.knobs.split_k:
        return 1
    streamed = [d for d in eng.devices if d.streamed]
    return choose_split(m, n, k, tile, streams=[d.nstreams for d in streamed],
                        caches=[d.cache_capacity() for d in streamed], itemsize=_acc(dtype).itemsize)


def _scale_mixed(c, dtype, beta) -> None:
    """C = beta C of a mixed call in its compute type (alpha 0 or k 0: no product), here."""
    if beta == 0:
        c[...] = 0
        return
    acc = np.dtype(dtypes.gemm_of(dtype).compute)
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = c.astype(acc) * acc.type(beta)
        c[...] = scaled
    if c.dtype == _F16:
        xp = array_module(is_cupy(c))
        warn_overflow(int((xp.isinf(c) & xp.isfinite(scaled)).sum()), c.size)


_overflow = threading.local()  # .tally: [count, size] while overflow_tallied() collects this thread's


@contextlib.contextmanager
def overflow_unreported():
    """Inside, this thread's float16 overflow reports are dropped: an intermediate result, its caller judging the
    final one (a two-pass convolution)."""
    with setting(_overflow, "tally", [0, 0]):
        yield


@contextlib.contextmanager
def overflow_tallied():
    """Inside, this thread's float16 overflow warnings are summed, not issued; one warning for the whole
    after (a batched product: one per call, not one per item)."""
    tally = [0, 0]
    with setting(_overflow, "tally", tally):
        yield
    warn_overflow(*tally)


def warn_overflow(count: int, size: int) -> None:
    """Warn, in the calling thread, that ``count`` of ``size`` float16 results overflowed (the
    caller's line named: the first frame outside blasx), as the caller's ``np.errstate(over=...)`` asks:
    "ignore" says nothing, "raise" raises FloatingPointError (the result written, as numpy's)."""
    tally = getattr(_overflow, "tally", None)
    if tally is not None:
        tally[0] += count
        tally[1] += size
        return
    mode = np.geterr()["over"]
    if not count or mode == "ignore":
        return
    text = (f"float16 overflow: {count} of {size} result values exceed float16's range (+-65504) and are inf; "
            f"pass out_dtype=np.float32 to keep them")
    if mode == "raise":
        raise FloatingPointError(text)
    level, frame = 2, sys._getframe(1)
    while frame is not None and (str(frame.f_globals.get("__name__", "")).startswith("blasx.")
                                 or frame.f_globals.get("__name__") == "contextlib"):
        level, frame = level + 1, frame.f_back
    warnings.warn(text, Float16OverflowWarning, stacklevel=level)


# ---------------------------------------------------------------- the engine

def block_shape(eng) -> tuple[int, int]:
    """Blocks of C tiles in queue order (``Knobs.block_order``): 2 x (streams / 2), else single tiles."""
    return (2, max(1, eng.config.streams // 2)) if eng.config.knobs.block_order else (1, 1)


# Engines a call tries when each is shut down before it was queued: enough for a configure()
# racing the call, bounded for an exit (atexit's shutdown) racing it.
_ENGINE_ATTEMPTS = 3


def submit_planned(name: str, views: list, plan, dtype, alpha, beta, dims: tuple[int, int, int],
                   scratch=None, tile_fit=None, **options) -> None:
    """Run one planned call on the engine: choose the tile, make the operands, plan, submit, keep the profile.

    ``plan(tile, block)`` returns the tasks on ``views``; ``dims = (m, n, k)`` sizes the call for the
    tile choice. ``scratch(engine, tile)``, if given, returns the shape of one more operand the planner
    writes and reads (None: none), then planned with ``plan(tile, block, True)``. ``options``:
    ``out_dtype``, ``math`` and ``epilogue`` as :class:`~blasx.runtime.call.Call` takes them.
    ``tile_fit(tile)``, if given, returns the tile to use instead of the chosen one (no larger: it fits
    where that one did). Raises the call's error. A call whose engine was shut down before its tasks
    were queued (configure() in another thread) runs on its replacement.
    """
    dtype = np.dtype(dtype)
    for attempt in range(_ENGINE_ATTEMPTS):
        try:
            _submit_on(session.engine(), name, views, plan, dtype, alpha, beta, dims, scratch, options, tile_fit)
            return
        except EngineClosed:
            if attempt == _ENGINE_ATTEMPTS - 1:
                raise


def _submit_on(eng, name, views, plan, dtype, alpha, beta, dims, scratch, options, tile_fit=None) -> None:
    """:func:`submit_planned` on the engine ``eng`` (raises EngineClosed from eng.submit)."""
    tile = choose_tile(eng, *dims, dtype, name if name in ROUTINES else name[1:],  # "dtrsm" -> "trsm"
                       options.get("math", "ieee"))
    if tile_fit is not None:
        tile = min(tile, tile_fit(tile))
    shape = scratch(eng, tile) if scratch is not None else None
    if shape is None:
        _submit_tasks(eng, name, views, plan(tile, block_shape(eng)), dtype, alpha, beta, tile, **options)
        return
    # The scratch, in the accumulation type (split-k's partials): on the GPU of CuPy operands, else on the
    # engine's first GPU (its tiles then never cross the host link, and no host memory is page-locked for
    # it), else (sims, the CPU) in host memory.
    like = next(v for v in views if isinstance(v, np.ndarray) or is_cupy(v))  # (views may hold derivations)
    home = like.device.id if is_cupy(like) else next((d.ordinal for d in eng.devices if d.kind == "cuda"), None)
    if home is None:
        extra = np.empty(shape, dtype=_acc(dtype), order="F")
    else:
        import cupy
        with cupy.cuda.Device(home):
            extra = cupy.empty(shape, dtype=_acc(dtype), order="F")
    _submit_tasks(eng, name, [*views, extra], plan(tile, block_shape(eng), True), dtype, alpha, beta, tile,
                  **options)


def _acc(dtype) -> np.dtype:
    """The accumulation type of ``dtype``'s calls (a reduced type's compute type, else itself)."""
    row = dtypes.gemm_of(dtype)
    return np.dtype(dtype) if row is None else row.compute


def front_end(fn):
    """``fn`` (a front end returning the array it wrote) with what ends a call there: float16 overflows reported
    once, when the caller's array is whole (an ``np.errstate`` "raise" after the front end's copy-back, as
    numpy's); and when the result is one of the caller's arrays it was passed (c, b, out, or numpy's ``out=(o,)``),
    the read-only roots it overlaps retired, as the engine's calls retire those of the views they write (the front
    end's own copy-backs, fills and casts write outside that window). A new result overlaps no root."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if READONLY.holds_roots():  # (the engine may be handed copies or other views of them)
            seen_writable((*args, *kwargs.values()))
        if _tls.batch is None:
            _tls.stats = None  # (a call that runs nothing has no profile, not the last one's)
        with overflow_tallied():
            res = fn(*args, **kwargs)
        if type(res) is np.ndarray and any(res is x or (type(x) is tuple and any(res is y for y in x))
                                           for x in (*args, *kwargs.values())):
            READONLY.drop_written([res])
        return res
    return call


def seen_writable(values) -> None:
    """A call sees the caller's arrays among ``values`` (and in tuples and lists of them): the read-only roots of
    those that are writable again are retired, whatever the call hands the engine (a cast or strided copy, another
    view)."""
    for v in values:
        if type(v) is tuple or type(v) is list:
            seen_writable(v)
        elif isinstance(v, np.ndarray) and v.flags.writeable:
            READONLY.drop(top_array(v))


def math_that_runs(eng, math: str, dtype=_F32) -> str:
    """The math mode a call of ``dtype`` asking for ``math`` runs in on ``eng``: TF32 is float32's, on GPUs (and
    the sims standing in for them); the CPU alone has no TF32 units."""
    return "ieee" if math != "ieee" and (eng.inline or np.dtype(dtype) != _F32) else math


def _submit_tasks(eng, name, views, tasks, dtype, alpha, beta, tile, *, out_dtype=None, math="ieee",
                  epilogue=None) -> None:
    """Make the call and run it; ``out_dtype``, ``math`` and ``epilogue`` as ``Call`` takes them
    (the math mode that ran is the profile's ``host["math"]``). A float16 result that overflowed
    where the devices rounded it warns here, once, after the call."""
    math = math_that_runs(eng, math, dtype)
    written = [views[i] for i in {t.c.slot for t in tasks}]
    READONLY.drop_written(written)
    tokens = TokenTable(tile)
    operands = [make_operand(v, tokens) for v in views]
    stats = CallStats([DeviceInfo(d.index, d.name, d.kind) for d in eng.devices],
                      keep_records=session.settings().trace)
    stats.host["math"] = math
    call = Call(name, operands, tasks, dtype, alpha, beta, stats, epilogue=epilogue, out_dtype=out_dtype,
                math=math)
    call.tile = tile
    prepared = []  # backends whose prepare_call ran: an interrupt inside one still finishes it
    ident = threading.get_ident()
    with _running_lock:
        outer = _running.get(ident)
        _running[ident] = call
    try:
        for d in _backends(eng):
            prepared.append(d)
            d.prepare_call(call)
        off = sys.modules.get("blasx.offload") if eng.inline else None
        with off.inside_blasx() if off is not None else contextlib.nullcontext():  # (kernels in this thread)
            eng.submit(call)
        if call.out_dtype == _F16 and call.mixed:
            warn_overflow(call.overflows(), sum(operands[i].rows * operands[i].cols
                                                for i in call.written_slots() - call.acc_slots))
    finally:
        READONLY.drop_written(written)  # (the writes are done: a root cached meanwhile is stale now)
        with _running_lock:
            if outer is None:
                _running.pop(ident, None)
            else:
                _running[ident] = outer
        for d in prepared:
            d.finish_call(call)
        if not stats.finished:  # a call that failed before its last task ends now
            stats.finish()
        _set_stats(stats)
        call.drop_tasks()


def _backends(eng):
    """One device of each backend class: per-call host preparation (pinning, CPU thread limits)."""
    seen = {}
    for d in eng.devices:
        seen.setdefault(type(d), d)
    return list(seen.values())
