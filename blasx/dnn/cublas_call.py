"""cublasGemmStridedBatchedEx for blasx.dnn's device routes (convolutions, RNN steps): one callable,
``strided_batched_ex()(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb,
strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo)`` returning the cublasStatus_t.

It is the C extension ``blasx._cublas_call`` where the package build made it (the arguments cross in one
C call), else ctypes (the same function, its 23 arguments converted by ctypes on every call). Either way the
function is the libcublas CuPy loaded, and the GIL is released during the call.

``issue`` makes such a call on a handle of this module's pool bound to the caller's stream; ``own_handle``
gives a Workspace (a network worker's, whose GEMMs are captured into CUDA graphs) a handle of its own.
"""

from __future__ import annotations

import functools
import weakref

import numpy as np

from ..runtime.devices.cupy_streams import PER_THREAD, stream_key
from . import direct_cache


@functools.lru_cache(maxsize=None)
def strided_batched_ex(use_extension: bool = True):
    """The callable (pointers as ints, alpha and beta host pointers); ``use_extension=False``: the ctypes one."""
    from ..runtime.devices import cublas_ctypes as cc
    return bind(cc.libcublas().cublasGemmStridedBatchedEx, use_extension)


def bind(fn, use_extension: bool = True):
    """The callable for ``fn``, a ctypes function with cublasGemmStridedBatchedEx's signature (its argument
    types are set here): through the C extension where ``use_extension`` and it is built, else ``fn``."""
    import ctypes
    P, I, Q = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    fn.argtypes = [P, I, I, I, I, I, P, P, I, I, Q, P, I, I, Q, P, P, I, I, Q, I, I, I]
    fn.restype = I
    ext = _extension() if use_extension else None
    if ext is None:
        return fn
    return functools.partial(ext.gemm_strided_batched_ex, ctypes.cast(fn, ctypes.c_void_p).value)


def _extension():
    try:
        from .. import _cublas_call
    except ImportError:  # built without a C compiler
        return None
    return _cublas_call


def check(status: int, what=None) -> None:
    """Raise where a call returned a cuBLAS error (``what``: the call, for the message)."""
    if status != 0:
        raise RuntimeError(f"cublasGemmStridedBatchedEx failed with cublasStatus_t {status}"
                           + (f" ({what})" if what is not None else ""))


def issue(fn, device: int, stream: int, args: tuple, what=None) -> None:
    """``fn(handle, *args)`` on a handle of ``device`` bound to ``stream`` (the pool's); raises on a cuBLAS
    error (``what``: the call, for the message)."""
    key, h = _take_handle(device, stream)
    try:
        status = fn(h[0], *args)
    finally:
        _give_handle(key, h)
    check(status, what)


# ---------------------------------------------------------------- handles

_HANDLES: dict = {}  # key (own: (device, stream key); shared: device id) -> idle handles
_HELD: dict = {}  # own key -> the stream it names (held, so its handle is never another stream's meanwhile)

MAX_STREAMS = 16  # streams per process whose handles are bound to them; the rest share per-device handles


def _take_handle(device_id: int, stream: int):
    """A cuBLAS handle (host pointer mode) that issues on ``stream``, the caller's until :func:`_give_handle`:
    threads issuing GEMMs at once each hold their own, never waiting on a lock. A handle is bound to one
    stream with its own workspace, set once, so a GEMM captured into a CUDA graph on that stream (the network
    executor) keeps a workspace no other stream writes (the per-thread default stream: one per thread). Past
    MAX_STREAMS streams, handles are shared per device: one bound to another stream is bound again, ``stream``
    ordered after the last GEMM issued with it (whose workspace it is about to write)."""
    h = _RESERVED.get((device_id, stream)) if _RESERVED else None
    if h is not None:
        return (device_id, stream), h
    own = (device_id, *stream_key(stream))
    key = own if own in _HANDLES or len(_HANDLES) < MAX_STREAMS else device_id
    if key is not own and _capturing(stream):  # a graph keeps the workspace it captured: never a shared one
        key = own
    pool = _HANDLES.get(key)
    if pool is None:
        pool = _HANDLES.setdefault(key, [])
        if key is own:
            _HELD.setdefault(key, _current_stream(stream))
    try:
        h = pool.pop()
    except IndexError:
        h = _new_handle()
    return key, _bound(h, stream)  # (a new handle, or a shared one last used on another stream: bound again)


def _capturing(stream: int) -> bool:
    import cupy
    return bool(cupy.cuda.runtime.streamIsCapturing(stream))


def _current_stream(ptr: int):
    """The current stream's object where its handle is ``ptr`` (None otherwise, and for the per-thread stream)."""
    import cupy
    cur = cupy.cuda.get_current_stream()
    return cur if cur.ptr == ptr and ptr not in PER_THREAD else None


def _bound(h: tuple, stream: int) -> tuple:
    """Handle ``h`` bound to ``stream`` with its own workspace (set after the stream: setting it resets it); a
    handle last used on another stream (shared: its event recorded when given back) orders ``stream`` after it."""
    if h[2] == stream:
        return h
    from ..runtime.devices import cublas_ctypes
    if h[3] is not None:
        import cupy
        cupy.cuda.runtime.streamWaitEvent(stream, h[3].ptr)
    cublas_ctypes.set_stream(h[0], stream)
    cublas_ctypes.set_workspace(h[0], h[1].data.ptr, h[1].nbytes)
    return h[0], h[1], stream, h[3]


def reserve(device_id: int, stream: int) -> None:
    """Give ``stream`` (a graph capture stream, call_graph.py) a handle of its own, bound to it with its own
    workspace, made now (never inside a capture): GEMMs issued on it use that handle whatever
    MAX_STREAMS says, so graphs captured there keep a workspace no other stream writes."""
    key = (device_id, stream)
    if key not in _RESERVED:
        _RESERVED[key] = _bound(_new_handle(), stream)


_RESERVED: dict = {}  # (device id, capture stream) -> its handle (one capture at a time: call_graph's lock)
_SPARE: dict = {}  # device id -> handles of Workspaces that were dropped


def own_handle(ws, device_id: int, stream: int):
    """The cuBLAS handle of the Workspace ``ws`` (its owner's one stream): bound to ``stream`` with a workspace
    of its own, so a GEMM captured into a CUDA graph keeps a workspace no other stream writes while the graph
    lives; handed on to a later Workspace of the device when ``ws`` is dropped."""
    h = ws.handle
    if h is None or h[2] != stream:
        direct_cache.making("a cuBLAS handle")
        spare = _SPARE.setdefault(device_id, [])
        h = _bound(spare.pop() if spare else _new_handle(), stream)
        if ws.handle is None:
            weakref.finalize(ws, _drop_handle, ws.__dict__, spare)
        ws.handle = h
    return direct_cache.kept(h)[0]


def _drop_handle(state: dict, spare: list) -> None:
    if state.get("handle") is not None:
        spare.append(state["handle"])


def device_workspace(xp, count: int = 1):
    """``count`` cuBLAS workspaces of the default size for the current device's architecture, back to back, in
    one byte array on it."""
    from ..runtime.devices.cublas_ctypes import workspace_bytes
    return xp.empty(count * workspace_bytes(int(xp.cuda.Device().compute_capability) // 10), dtype=np.uint8)


def _new_handle() -> tuple:
    """(handle, its workspace, the stream it is bound to: none yet, its give-back event: none yet)."""
    import cupy
    from cupy_backends.cuda.libs import cublas
    return cublas.create(), device_workspace(cupy), None, None


def _give_handle(key, h) -> None:
    if _RESERVED.get(key) is h:
        return
    if type(key) is int:  # shared: the next stream to take it waits for this GEMM (its workspace's last user)
        import cupy
        if h[3] is None:
            h = h[:3] + (cupy.cuda.Event(disable_timing=True),)
        cupy.cuda.runtime.eventRecord(h[3].ptr, h[2])
    _HANDLES[key].append(h)
