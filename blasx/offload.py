"""Redirecting unmodified numpy / scipy code to blasx: ``with blasx.offload(threshold=...):``.

While offload is on, ``a @ b`` (numpy's matmul loops replaced by the C extension
``blasx._matmul_loops``), ``np.dot`` and scipy.linalg.blas's level-3 functions run on the engine when
their flop count reaches the threshold, else as before (the extension's C forwarder calls the original
at once when ``8 a.size b.size`` is below it). The patches go in with the first enable or block and
come out, exactly restored, with the last. docs/usage.md has every option.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import numbers
import os
import threading
import warnings
from dataclasses import dataclass, field

import numpy as np

from . import numpy_api

try:
    from . import _matmul_loops as _ext
except ImportError:  # installed without a C compiler: np.dot and scipy only
    _ext = None

#: Default offload thresholds in flops, per device kind: never on cpu (numpy's own BLAS plus scheduling)
#: and sim (slower than numpy); cuda: where GPUs beat the host BLAS (``bench.offload_threshold`` measures it).
DEFAULT_THRESHOLDS = {"cpu": math.inf, "sim": math.inf, "cuda": 2.0 * 2048 ** 3}

ENV_THRESHOLD = "BLASX_OFFLOAD_THRESHOLD"

#: Why ``@`` cannot be redirected where the extension is missing, and what to do.
NO_EXTENSION = ("blasx.offload: redirecting `a @ b` / np.matmul needs the C extension blasx._matmul_loops, which "
                "this installation lacks (blasx was installed without a C compiler). Reinstall blasx from source "
                "where a C compiler and Python's headers are available (`pip install .` in a checkout; the build "
                "prints why the extension failed), or pass matmul=False to redirect only np.dot and "
                "scipy.linalg.blas")

__all__ = ["offload", "offload_enable", "offload_disable", "offload_threshold", "offload_active",
           "offload_stats", "default_threshold", "matmul_available", "DEFAULT_THRESHOLDS"]


# ---------------------------------------------------------------- state

@dataclass(eq=False)
class _Entry:
    """One active enable (``kind`` "enable") or ``with offload()`` block ("context")."""
    kind: str
    threshold: float | None
    matmul: bool
    thread: int = field(default_factory=threading.get_ident)


_lock = threading.RLock()
_entries: list[_Entry] = []
_default: float = math.inf      # resolved when the first entry comes in


class _ThreadState(threading.local):
    """Per thread: ``stack`` of the entries of its ``with offload()`` blocks, ``local`` the
    override in force (None: the process-wide threshold), ``busy`` the depth of blasx calls it is in."""

    def __init__(self) -> None:
        self.stack, self.local, self.busy = [], None, 0


_tls = _ThreadState()
_saved: dict[tuple[object, str], tuple[object, object]] = {}  # (module, name) -> (original, our wrapper)
_stats = {"matmul": 0, "dot": 0, "scipy": 0, "fallback": 0}
_global_now = math.inf          # _global_threshold(), kept current for the wrappers' fast path
_last_error: BaseException | None = None


def matmul_available() -> bool:
    """True when ``a @ b`` can be redirected (the C extension blasx._matmul_loops is installed)."""
    return _ext is not None


def _check_matmul(matmul) -> bool:
    if not isinstance(matmul, (bool, np.bool_)):
        raise TypeError(f"matmul: got {matmul!r} of type {type(matmul).__name__}; allowed: True or False")
    if matmul and _ext is None:
        raise RuntimeError(NO_EXTENSION)
    return bool(matmul)


def _check_threshold(value):
    if value is None:
        return None
    allowed = "allowed: a number of flops >= 0 (math.inf: never offload), or None for the default"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"threshold: got {value!r} of type {type(value).__name__}; {allowed}")
    if not float(value) >= 0:  # also NaN
        raise ValueError(f"threshold: got {float(value)!r}; {allowed}")
    return float(value)


def default_threshold() -> float:
    """``$BLASX_OFFLOAD_THRESHOLD`` if set, else ``DEFAULT_THRESHOLDS`` for the configured device kind."""
    env = os.environ.get(ENV_THRESHOLD, "").strip()
    if env:
        try:
            value = float(env)
        except ValueError:
            value = math.nan
        if not value >= 0:
            raise ValueError(f"{ENV_THRESHOLD}: got {env!r}; allowed: a number of flops >= 0 or 'inf'")
        return value
    from . import session
    from .runtime.config import parse_devices
    spec = session.settings().devices or os.environ.get("BLASX_DEVICES") or ("cuda" if session._cuda_count() else "cpu")
    return DEFAULT_THRESHOLDS.get(parse_devices(spec).kind, math.inf)


def _enabled_threshold() -> float | None:
    """The latest active enable's threshold (the default where it gave none), or None with no enable active."""
    enables = [e for e in _entries if e.kind == "enable"]
    if not enables:
        return None
    return next((e.threshold for e in reversed(enables) if e.threshold is not None), _default)


def _global_threshold() -> float:
    """The threshold of threads outside every block: an enable's (process-wide), else never (math.inf): a
    ``with offload()`` block turns offload on for its own thread alone."""
    t = _enabled_threshold()
    return math.inf if t is None else t


def _local_threshold():
    """The calling thread's innermost block's threshold (a block that gave none: the enable's in force when
    it began, else the default), or None outside every block."""
    if not _tls.stack:
        return None
    own = next((e.threshold for e in reversed(_tls.stack) if e.threshold is not None), None)
    if own is not None:
        return own
    with _lock:
        t = _enabled_threshold()
    return _default if t is None else t


def _sync_local() -> None:
    """Publish the calling thread's override to the wrappers and the extension's thread-local copy."""
    _tls.local = _local_threshold()
    if _ext is not None:
        _ext.set_local(_tls.local)


def offload_threshold() -> float:
    """The threshold (flops) in force for the calling thread."""
    local = _local_threshold()
    if local is not None:
        return local
    with _lock:
        return _global_threshold() if _entries else default_threshold()


def offload_active() -> bool:
    """True while offload is on (some enable or ``with offload()`` block is active)."""
    return bool(_entries)


def offload_stats() -> dict:
    """Calls offloaded so far in this process (``matmul``, ``dot``, ``scipy``) and those that fell back
    to numpy after failing on blasx (``fallback``; the last error is ``last_error``)."""
    return dict(_stats, last_error=_last_error)


# ---------------------------------------------------------------- enable / disable

def offload_enable(threshold=None, matmul=True) -> None:
    """Turn offload on (each call needs one :func:`offload_disable`). threshold: flops from which a call
    runs on blasx, process-wide until the matching disable (None: keep the current one). matmul: also
    redirect ``a @ b`` (needs the C extension: RuntimeError without it); False: np.dot and scipy only."""
    _add(_Entry("enable", _check_threshold(threshold), _check_matmul(matmul)))


def offload_disable() -> None:
    """Undo one :func:`offload_enable` (the calling thread's latest, else the latest one); the last one
    restores numpy's matmul loops, ``numpy.dot`` and the scipy.linalg.blas functions."""
    with _lock:
        enables = [i for i, e in enumerate(_entries) if e.kind == "enable"]
        if not enables:
            if _entries:
                raise RuntimeError("offload_disable: no offload_enable() is active (offload is on only through "
                                   "`with blasx.offload()` blocks, which end by themselves)")
            raise RuntimeError("offload_disable: offload is not enabled (more offload_disable() than "
                               "offload_enable() calls)")
        me = threading.get_ident()
        mine = [i for i in enables if _entries[i].thread == me]
        del _entries[(mine or enables)[-1]]
        _reconcile()


class offload(contextlib.ContextDecorator):
    """``with blasx.offload(threshold=None, matmul=True):`` (or ``@blasx.offload(...)``): offload on inside,
    for the calling thread. threshold: the thread's inside the block (None: the enclosing block's, else an
    active enable's, else the default). matmul: as for :func:`offload_enable`. Re-entrant, nested or from
    threads; a thread's blocks may end out of order (each takes away its own)."""

    def __init__(self, threshold=None, matmul=True) -> None:
        self.threshold = _check_threshold(threshold)
        self.matmul = _check_matmul(matmul)
        self._open: dict = {}  # thread ident -> the entries of this object's open blocks there, innermost last

    def __enter__(self):
        entry = _Entry("context", self.threshold, self.matmul)
        _add(entry)
        _tls.stack.append(entry)
        self._open.setdefault(entry.thread, []).append(entry)
        _sync_local()
        return self

    def __exit__(self, *exc) -> None:
        ident = threading.get_ident()
        mine = self._open.get(ident)
        if not mine:
            raise RuntimeError("offload: leaving a block this thread did not enter (the __exit__ of a "
                               "`with blasx.offload()` must run in the thread that ran its __enter__)")
        entry = mine.pop()
        if not mine:
            del self._open[ident]
        _tls.stack.remove(entry)  # its own entry: a generator's or an asyncio task's block may end out of order
        _sync_local()
        with _lock:
            _entries.remove(entry)
            _reconcile()

    def __repr__(self) -> str:
        return f"blasx.offload(threshold={self.threshold!r}, matmul={self.matmul!r})"


# ---------------------------------------------------------------- installing the patches

def _add(entry: _Entry) -> None:
    """Make ``entry`` active, putting in what it needs; on failure nothing changes."""
    global _default
    with _lock:
        if not _entries:
            _default = default_threshold()
        _entries.append(entry)
        try:
            _reconcile()
        except BaseException:
            _entries.remove(entry)
            _reconcile()
            raise


def _after_fork_in_child() -> None:
    """A forked child has only the forking thread: a lock another parent thread held is made anew, and the
    entries of the other threads' ``with offload()`` blocks (which will never end here) are dropped."""
    global _lock
    _lock = threading.RLock()
    me = threading.get_ident()
    gone = [e for e in _entries if e.kind == "context" and e.thread != me]
    if gone:
        for e in gone:
            _entries.remove(e)
        _reconcile()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _reconcile() -> None:
    """Bring the patches in line with ``_entries`` (under _lock): np.dot and scipy while any entry is
    active, numpy's matmul loops while any active entry asked for them."""
    global _global_now
    _global_now = _global_threshold()  # published to the wrappers and the extension
    if _ext is not None:
        _ext.set_global(_global_now)
    if _entries and not _saved:
        _patch_all()
    want_loops = any(e.matmul for e in _entries)
    if want_loops and not _ext.installed():
        _install_loops()
    elif not want_loops and _ext is not None and _ext.installed():
        displaced = _ext.uninstall()
        if displaced:
            warnings.warn(f"blasx.offload_disable: np.matmul's {', '.join(displaced)} loop was no longer blasx's "
                          f"(replaced by someone else meanwhile); numpy's original was put back",
                          RuntimeWarning, stacklevel=4)
    if not _entries:
        _unpatch_all()


def _install_loops() -> None:
    """Replace the loops and check that ``@`` reaches them; on failure numpy's loops are put back."""
    _ext.install(_matmul_hook)
    _ext.set_local(math.inf)  # the probes stay on numpy's loop
    try:
        for slot, dt in enumerate((np.float32, np.float64, np.complex64, np.complex128, np.float16)):
            before = _ext.hits(slot)
            x = np.ones((2, 2), dtype=dt)
            y = x @ x
            if _ext.hits(slot) == before:
                raise RuntimeError(
                    f"blasx.offload: PyUFunc_ReplaceLoopBySignature replaced np.matmul's {np.dtype(dt).name} loop, "
                    f"but `a @ b` does not call the new loop on numpy {np.__version__} (this numpy caches the "
                    f"loop elsewhere); `@` cannot be redirected here (matmul=False redirects np.dot and scipy)")
            if not (y == 2).all():
                raise RuntimeError(f"blasx.offload: the {np.dtype(dt).name} matmul trampoline gave a wrong result")
    except BaseException:
        _ext.uninstall()
        raise
    finally:
        _ext.set_local(_tls.local)


@atexit.register
def _at_exit() -> None:
    """Offload still on at exit: put numpy's loops back before the interpreter (and the engine) go.
    (Registered after blasx.session's shutdown hook, so it runs before it.)"""
    with _lock:
        if _entries:
            _entries.clear()
            _reconcile()


def _patch_all() -> None:
    """Replace numpy.dot and scipy.linalg.blas's level-3 functions (all or none)."""
    global _dot_next
    try:
        _dot_next = np.dot
        _patch(np, "dot", _forwarded(_dot_next, _dot_wrapper, (0, "a"), (1, "b")))
        import scipy.linalg.blas as spblas

        from .linalg import blas as ours
        for name, fn in ours.FUNCTIONS.items():
            original = getattr(spblas, name, None)
            if original is not None:
                b = None if name[1:] in ("syrk", "herk") else (2, "b")  # their bound is 8 a.size^2
                _patch(spblas, name, _forwarded(original, _scipy_wrapper(name, original, fn), (1, "a"), b))
    except BaseException:
        _unpatch_all()
        raise


def _forwarded(original, wrapper, a: tuple[int, str], b: tuple[int, str] | None):
    """``wrapper`` behind the extension's C forwarder, which calls ``original`` itself for every call
    the wrapper would hand it at once (operands not exact ndarrays, or whose sizes bound the flops
    below the threshold); the wrapper alone without the extension."""
    if _ext is None:
        return wrapper
    ib, name_b = b if b is not None else (-1, a[1])
    fwd = _ext.forwarder(original, wrapper, a[0], a[1], ib, name_b)
    for attr in ("__name__", "__qualname__", "__doc__", "__wrapped__", "__module__"):
        setattr(fwd, attr, getattr(wrapper, attr))
    fwd.__module__ = getattr(original, "__module__", None) or wrapper.__module__  # (pickled as numpy.dot is)
    return fwd


def _patch(module, name: str, wrapper) -> None:
    original = getattr(module, name)
    _saved[(module, name)] = (original, wrapper)
    setattr(module, name, wrapper)


def _unpatch_all() -> None:
    displaced = []
    for (module, name), (original, wrapper) in list(_saved.items()):
        if getattr(module, name, None) is wrapper:
            setattr(module, name, original)
        else:
            displaced.append(f"{module.__name__}.{name}")
        del _saved[(module, name)]
    if displaced:
        warnings.warn(f"blasx.offload_disable: {', '.join(displaced)} no longer held blasx's wrapper (replaced by "
                      f"someone else meanwhile); left as found", RuntimeWarning, stacklevel=4)


# ---------------------------------------------------------------- what runs inside

def _bypass() -> bool:
    """blasx's own threads, and a thread already inside a blasx call, stay on numpy."""
    return _tls.busy > 0 or threading.current_thread().name.startswith("blasx-")


@contextlib.contextmanager
def inside_blasx():
    """The calling thread runs blasx's own work meanwhile (an inline engine's tile kernels: their ``@`` and
    np.dot stay on numpy, not offloaded back into blasx)."""
    _tls.busy += 1
    try:
        yield
    finally:
        _tls.busy -= 1


def _offloaded(kind: str, fn, /, *args, **kwargs):
    """``fn(*args, **kwargs)`` on blasx (the thread's calls inside it stay on numpy), counted as ``kind``."""
    _tls.busy += 1
    try:
        res = fn(*args, **kwargs)
    finally:
        _tls.busy -= 1
    _stats[kind] += 1
    return res


def _failed(what: str, err: BaseException) -> None:
    """A blasx failure numpy recomputes: kept in offload_stats() and warned of; not np.errstate's "raise" (a
    FloatingPointError: numpy's own call raises it again, nothing failed)."""
    if isinstance(err, FloatingPointError):
        return
    global _last_error
    _last_error = err
    _stats["fallback"] += 1
    # (warnings turned into errors are swallowed: the error is kept in offload_stats())
    with contextlib.suppress(Exception):
        warnings.warn(f"blasx.offload: {what} failed on blasx ({type(err).__name__}: {err}); computed by "
                      f"numpy instead", RuntimeWarning, stacklevel=3)


def _matmul_hook(a, b, c) -> bool:
    """Called by the trampoline at or above the threshold with (N, n, k), (N, k, m), (N, n, m) views:
    True when blasx wrote ``c``, False to let numpy's loop do it. Raises only KeyboardInterrupt, which the
    trampoline raises again in this thread once the ufunc returns (``_matmul_loops.c``: numpy's loop writes c)."""
    if _bypass() or _items_below_threshold(a, b, c) or _fp_checked(c.dtype):
        return False
    try:
        _offloaded("matmul", numpy_api.run_batch, a, b, c)
        return True
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - nothing else may escape into numpy's loop
        _failed(f"matmul ({c.dtype.name})", e)
        return False


def _fp_checked(*dtypes) -> bool:
    """Whether numpy's own product of these types would raise or call on a floating-point error (np.errstate's
    "raise" / "call" for over or invalid): then numpy computes it (blasx's GPU tiles set no FP flags)."""
    if not any(dt.kind in "fc" for dt in dtypes):
        return False
    err = np.geterr()
    return err["over"] in ("raise", "call") or err["invalid"] in ("raise", "call")


def _items_below_threshold(a, b, c) -> bool:
    """A batch blasx would run as one gemm an item (no operand shared by the items, so not one stacked gemm)
    whose items are each below the threshold: numpy's loop runs them faster than a blasx call each."""
    count = c.shape[0]
    if count <= 1 or numpy_api._batch_shared(a) or numpy_api._batch_shared(b):
        return False
    thr = _global_now if _tls.local is None else _tls.local
    n, k = a.shape[-2:]
    return (8.0 if c.dtype.kind == "c" else 2.0) * n * k * b.shape[-1] < thr


_BLAS_CHARS = frozenset("fdFD")
_ndarray = np.ndarray
_dot_next = numpy_api._np_dot  # what numpy.dot was when offload went in (numpy's own, unless patched before)


def _dot_wrapper(a, b, out=None):
    if type(a) is _ndarray and type(b) is _ndarray:
        local = _tls.local
        thr = _global_now if local is None else local
        # 8 a.size b.size bounds the flop count: small calls leave after these few attribute reads; numpy keeps
        # an out it rejects (its own error) and products whose FP errors raise (its own FloatingPointError)
        if (8.0 * a.size * b.size >= thr and (flops := _dot_flops(a, b)) and flops >= thr and not _bypass()
                and (out is None or _dot_out_ok(a, b, out)) and not _fp_checked(a.dtype, b.dtype)):
            try:
                return _offloaded("dot", numpy_api.dot, a, b, out)
            except Exception as e:  # noqa: BLE001 - numpy recomputes it all (out is only written)
                _failed("np.dot", e)
    return _dot_next(a, b, out)


def _dot_out_ok(a, b, out) -> bool:
    """Whether numpy's dot takes ``out``: a writable C-contiguous ndarray of the result's exact shape and dtype."""
    shape = a.shape[:-1] + (b.shape[:-2] + b.shape[-1:] if b.ndim >= 2 else ())
    return (type(out) is _ndarray and out.flags.c_contiguous and out.flags.writeable and out.shape == shape
            and out.dtype == np.result_type(a, b))


def _dot_flops(a, b) -> float:
    if a.dtype.char not in _BLAS_CHARS or b.dtype.char not in _BLAS_CHARS or not a.ndim or not b.ndim:
        return 0.0
    k = a.shape[-1]
    if not k or k != (b.shape[0] if b.ndim == 1 else b.shape[-2]):
        return 0.0
    return (8.0 if (a.dtype.kind == "c" or b.dtype.kind == "c") else 2.0) * (a.size // k) * b.size


_dot_wrapper.__doc__ = ("np.dot, offloaded to blasx above the threshold by blasx.offload.\n\n"
                        + (numpy_api._np_dot.__doc__ or ""))
_dot_wrapper.__wrapped__ = numpy_api._np_dot
_dot_wrapper.__name__ = _dot_wrapper.__qualname__ = "dot"  # what it stands in for, as the scipy wrappers


def _scipy_flops(family: str, spec: dict, is_complex: bool, args, kwargs) -> float:
    """The flop count of a scipy level-3 call on plain 2-D ndarrays, else 0 (then scipy runs it)."""
    if len(args) > len(spec):
        return 0.0

    def arg(name):
        i, default = spec[name]
        return args[i] if i < len(args) else kwargs.get(name, default)

    try:
        a = arg("a")
        b = arg("b") if "b" in spec else a
        if not (type(a) is _ndarray and a.ndim == 2 and type(b) is _ndarray and b.ndim == 2):
            return 0.0
        if family == "gemm":
            m, k = a.shape if int(arg("trans_a")) == 0 else a.shape[::-1]
            n = b.shape[1] if int(arg("trans_b")) == 0 else b.shape[0]
            flops = 2.0 * m * n * k
        elif family in ("symm", "trmm"):
            m, n = b.shape
            flops = (2.0 if family == "symm" else 1.0) * m * n * (m if int(arg("side")) == 0 else n)
        else:
            n, k = a.shape if int(arg("trans")) == 0 else a.shape[::-1]
            flops = (2.0 if family == "syr2k" else 1.0) * n * n * k
        if "c" in spec and (c := arg("c")) is not None and type(c) is not _ndarray:
            return 0.0
    except (TypeError, ValueError, KeyError, IndexError):
        return 0.0
    return flops * 4.0 if is_complex else flops


def _scipy_wrapper(name: str, original, ours):
    from .linalg.blas import _FAMILY, _PARAMS
    family = _FAMILY[name[1:]]
    spec = {p: (i, d) for i, (p, d) in enumerate(_PARAMS[family])}
    is_complex = name[0] in "cz"
    rank1 = family == "syrk"

    def wrapper(*args, **kwargs):
        local = _tls.local
        thr = _global_now if local is None else local
        # 8 a.size b.size (a.size^2 for ?syrk/?herk) bounds the flop count: small calls leave early
        a = args[1] if len(args) > 1 else kwargs.get("a")
        x = a if rank1 else (args[2] if len(args) > 2 else kwargs.get("b"))
        if (type(a) is _ndarray and type(x) is _ndarray and 8.0 * a.size * x.size >= thr
                and (flops := _scipy_flops(family, spec, is_complex, args, kwargs)) and flops >= thr
                and not _bypass()):
            try:
                return _offloaded("scipy", ours, *args, **kwargs)
            except (TypeError, ValueError):
                pass  # rejected before anything was written: scipy's own behaviour follows
        return original(*args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = (f"scipy.linalg.blas.{name}, offloaded to blasx above the threshold by blasx.offload.\n\n"
                       + (getattr(original, "__doc__", None) or ""))
    wrapper.__wrapped__ = original
    return wrapper
