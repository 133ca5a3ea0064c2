"""A stand-in for CuPy on the CPU, for timing and checking the host side of blasx.dnn's device route
with no GPU: arrays are numpy arrays (a subclass whose module is ``cupy``, so blasx takes them for CuPy
arrays) whose memory is never touched, and every GPU launch (elementwise kernels, copies, fills, uploads,
cuBLAS calls) is a no-op that records its arguments in ``LOG`` while ``recording`` is on.

    with fake_cupy.installed() as fake:
        x = fake.cupy.empty((64, 256, 56, 56), dtype=np.float16)
        blasx.dnn.conv2d(x, w, ...)          # runs conv.py's CuPy route, launching nothing

Large arrays cost address space only (pages are never written). ``installed`` puts the fake modules
(``cupy``, ``cupy_backends.cuda.libs.cublas``) in ``sys.modules`` and the route's cuBLAS entry point
in place, and takes them out again on exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import sys
import threading
import types

import numpy as np

LOG: list = []
_state = {"recording": False, "mem_info_calls": 0, "free": 64 << 30, "copies": False}
_local = threading.local()
_stream_ids = itertools.count(0x1000, 0x10)
_event_ids = itertools.count(0x5000, 0x10)


def record(*entry) -> None:
    """A launch: into the open capture's graph while a stream captures, else into LOG while recording."""
    graph = getattr(_local, "capture", None)
    if graph is not None:
        graph.append(entry)
    elif _state["recording"]:
        LOG.append(entry)


class _Mem:
    """One allocation: a numpy byte buffer (never written) and its device."""

    def __init__(self, nbytes: int, device: int):
        self.raw = np.empty(max(1, nbytes), dtype=np.uint8)
        self.ptr = self.raw.__array_interface__["data"][0]
        self.device = device


class MemoryPointer:
    def __init__(self, mem, offset: int = 0):
        self.mem, self.ptr = mem, mem.ptr + offset
        self.device_id = mem.device


class UnownedMemory:
    def __init__(self, ptr: int, size: int, owner, device_id: int = -1):
        self.ptr, self.size, self.owner = ptr, size, owner
        self.raw = (ctypes.c_char * size).from_address(ptr)
        self.device = _current_device()


class ndarray(np.ndarray):
    """A device array: numpy's metadata and views; no arithmetic is done on its memory."""

    __module__ = "cupy"  # blasx.operands.is_cupy goes by the type's module

    def __new__(cls, shape, dtype=float, memptr=None, strides=None):
        if memptr is None:
            return empty(shape, dtype)
        mem = memptr.mem
        buf = mem.raw if isinstance(mem, _Mem) else mem.raw
        a = np.ndarray.__new__(cls, shape, dtype, buffer=buf, offset=memptr.ptr - mem.ptr, strides=strides)
        a._mem = mem
        return a

    def __array_finalize__(self, obj):
        self._mem = getattr(obj, "_mem", None)

    @property
    def data(self):
        p = self.__dict__.get("_data")  # (made once an array: CuPy keeps its pointer as an attribute too)
        if p is None:
            p = self.__dict__["_data"] = MemoryPointer(self._mem, self.__array_interface__["data"][0] - self._mem.ptr)
        return p

    @property
    def device(self):
        return Device(self._mem.device)

    def get(self, stream=None, out=None):
        record("get", self.shape)
        mem = np.asarray(self).view(np.ndarray)  # (the stand-in's device memory is host memory)
        if out is None:
            return mem.copy()
        out[...] = mem
        return out

    def set(self, arr, stream=None):
        record("set", self.shape)

    def __setitem__(self, key, value):
        record("setitem", self.shape)
        if _state["copies"]:  # (a device-to-device copy, made where copies are)
            np.asarray(self).view(np.ndarray)[key] = np.asarray(value).view(np.ndarray)

    def fill(self, value):
        record("fill", self.shape)

    def astype(self, dtype, copy=True, **kw):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        record("astype", self.shape, np.dtype(dtype).name)
        return empty(self.shape, dtype)

    def copy(self, order="C"):
        record("copy", self.shape)
        return empty(self.shape, self.dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        shapes = [np.shape(i) for i in inputs]
        dt = np.result_type(*[i.dtype if hasattr(i, "dtype") else i for i in inputs])
        record("ufunc", ufunc.__name__)
        out = kwargs.get("out")
        if method == "__call__" and out is not None and len(out) == 1:  # in place (a += b): one kernel, no array
            return out[0]
        return empty(np.broadcast_shapes(*shapes), dt)  # (reductions too: CuPy's may take scratch, e.g. CUB's)


def empty(shape, dtype=float, order="C"):
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dt.itemsize
    alloc = getattr(_local, "allocator", None)
    p = alloc(nbytes) if alloc is not None else MemoryPointer(_Mem(nbytes, _current_device()))
    a = np.ndarray.__new__(ndarray, shape, dt, buffer=p.mem.raw, offset=p.ptr - p.mem.ptr)
    a._mem = p.mem
    return a


def empty_like(a, dtype=None):
    return empty(a.shape, dtype or a.dtype)


def zeros_like(a, dtype=None):
    record("zeros", a.shape)
    return empty(a.shape, dtype or a.dtype)


def full(shape, value, dtype=float):
    record("full", shape, value)
    return empty(shape, dtype)


def zeros(shape, dtype=float):
    record("zeros", shape)
    return empty(shape, dtype)


def ones(shape, dtype=float):
    record("ones", shape)
    return empty(shape, dtype)


def concatenate(arrays, axis=0):
    arrays = list(arrays)
    shape = list(arrays[0].shape)
    shape[axis] = sum(a.shape[axis] for a in arrays)
    record("concatenate", tuple(shape))
    return empty(shape, arrays[0].dtype)


def asarray(a, dtype=None):
    if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    if isinstance(a, ndarray):  # a cast on the device
        record("astype", a.shape, np.dtype(dtype).name)
        return empty(a.shape, dtype)
    a = np.asarray(a, dtype=dtype)
    record("upload", a.shape, a.dtype.name, a.tobytes())
    return empty(a.shape, a.dtype)


def asnumpy(a, stream=None):
    """The array's memory as a numpy array (the stand-in's memory is host memory; uploads leave it unwritten)."""
    record("asnumpy", a.shape)
    return np.array(np.asarray(a))


def ascontiguousarray(a, dtype=None):
    if isinstance(a, ndarray) and a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    if not isinstance(a, ndarray):
        return asarray(np.ascontiguousarray(a), dtype)
    record("contiguous", a.shape, a.strides)
    return empty(a.shape, dtype or a.dtype)


def tile(a, reps):
    record("tile", a.shape, reps)
    return empty(np.tile(np.empty(a.shape, np.uint8), reps).shape, a.dtype)


def may_share_memory(a, b, max_work=None) -> bool:
    return np.may_share_memory(a, b)


def copyto(dst, src, **kw):
    record("copyto", dst.shape)


class ElementwiseKernel:
    def __init__(self, in_params, out_params, operation, name="kernel", **kw):
        self.name = name

    def __call__(self, *args, size=None, **kw):
        record("kernel", self.name, tuple(_describe(a) for a in args), size)
        return args[-1] if args else None


ReductionKernel = ElementwiseKernel


_FUNCTIONS: dict = {}  # a RawKernel's function handle -> its name
_POINTERS: dict = {}  # a RawKernel's function handle -> its leading pointer parameters (3 where its code is not known)


def _leading_pointers(code, name) -> int:
    if not code or f"{name}(" not in code:
        return 3
    params = code.split(f"{name}(", 1)[1].split(")", 1)[0].split(",")
    return next((i for i, p in enumerate(params) if "*" not in p), len(params))


class RawKernel:
    """A raw kernel (``RawKernel(code, name, options=...)`` as CuPy's, or a RawModule's function): a launch (a call,
    or the driver's launchKernel of ``kernel.ptr``) records its name, grid, block, arguments and shared memory."""

    def __init__(self, *args, options=(), **kw):
        self.code, name = args if len(args) == 2 else (None, args[0])
        self.name, self.options = name, tuple(options)
        self.max_dynamic_shared_size_bytes = 0
        self.kernel = types.SimpleNamespace(ptr=id(self))
        _FUNCTIONS[id(self)] = name
        _POINTERS[id(self)] = _leading_pointers(self.code, name)

    def __call__(self, grid, block, args, shared_mem=0, **kw):
        record("raw_kernel", self.name, tuple(grid), tuple(block), tuple(_describe(a) for a in args), shared_mem)
        if _state["copies"] and self.name.startswith("blasx_transpose_"):  # a copy: made where copies are
            src, dst, batch, rows, cols = args
            flat = lambda a: np.ndarray((int(batch) * int(rows) * int(cols),), a.dtype, a._mem.raw,  # noqa: E731
                                        a.__array_interface__["data"][0] - a._mem.ptr)
            flat(dst).reshape(int(batch), int(cols), int(rows))[...] = \
                flat(src).reshape(int(batch), int(rows), int(cols)).transpose(0, 2, 1)


class RawModule:
    def __init__(self, code=None, options=(), **kw):
        self.code, self.options = code, options

    def get_function(self, name):
        return RawKernel(name)


def _describe(a):
    if isinstance(a, ndarray):
        return ("array", a.data.ptr, a.shape, a.strides, a.dtype.name)
    if isinstance(a, np.generic):
        return (type(a).__name__, a.item())
    return a


class _Pool:
    def free_bytes(self) -> int:
        return 0

    def free_all_blocks(self, stream=None) -> None:
        _state["pool_frees"] = _state.get("pool_frees", 0) + 1


_POOL = _Pool()


def get_default_memory_pool():
    return _POOL


# ---------------------------------------------------------------- cupy.cuda

def _current_device() -> int:
    return getattr(_local, "device", 0)


class Device:
    compute_capability = "90"
    attributes = {"MultiProcessorCount": 132}

    def __init__(self, device=None):
        self.id = _current_device() if device is None else int(device)

    def __enter__(self):
        stack = _local.__dict__.setdefault("devices", [])
        stack.append(_current_device())
        _local.device = self.id
        return self

    def __exit__(self, *exc):
        _local.device = _local.devices.pop()

    def synchronize(self):
        pass


class Stream:
    def __init__(self, null=False, non_blocking=False, ptr=None):
        self.ptr = 0 if null else (ptr if ptr is not None else next(_stream_ids))

    def __enter__(self):
        stack = _local.__dict__.setdefault("streams", [])
        stack.append(get_current_stream())
        _local.stream = self
        return self

    def __exit__(self, *exc):
        _local.stream = _local.streams.pop()

    def use(self):
        _local.stream = self
        return self

    def synchronize(self):
        record("synchronize", self.ptr)

    @property
    def done(self):
        return True  # nothing is ever pending on the stand-in

    def record(self, event=None):
        record("event_record", self.ptr)
        return event or Event()

    def wait_event(self, event):
        record("wait_event", self.ptr)


_NULL = Stream(null=True)
Stream.null = _NULL


def get_current_stream():
    return getattr(_local, "stream", _NULL)


class Graph:
    """A captured sequence of launches; ``launch`` records one entry (the launches are not repeated)."""

    def __init__(self, entries: list):
        self.entries = entries

    def launch(self, stream=None):
        record("graph_launch", len(self.entries), getattr(stream, "ptr", None))


def _begin_capture(self, mode=None):
    if getattr(_local, "capture", None) is not None:
        raise RuntimeError("a capture is already open in this thread")
    _local.capture = []


def _end_capture(self):
    entries, _local.capture = _local.capture, None
    return Graph(entries)


def _is_capturing(self):
    return getattr(_local, "capture", None) is not None


Stream.begin_capture, Stream.end_capture, Stream.is_capturing = _begin_capture, _end_capture, _is_capturing


class MemoryPool:
    """A pool whose allocations are counted (a graph's private pool in the network executor)."""

    def __init__(self):
        self.allocations = 0

    def malloc(self, nbytes: int):
        self.allocations += 1
        return MemoryPointer(_Mem(nbytes, _current_device()))


def get_allocator():
    alloc = getattr(_local, "allocator", None)
    return alloc if alloc is not None else (lambda nbytes: MemoryPointer(_Mem(nbytes, _current_device())))


def using_allocator(allocator=None):
    from blasx.threadlocal import setting
    return setting(_local, "allocator", allocator)


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.ptr = next(_event_ids)

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    @property
    def done(self):
        return True  # nothing is ever pending on the stand-in


def get_elapsed_time(a, b) -> float:
    return 0.0


def alloc_pinned_memory(nbytes: int):
    return bytearray(nbytes)


class OutOfMemoryError(MemoryError):
    pass


def _launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
    """The driver's launch: records as a RawKernel call does, with the leading pointer arguments read (the
    first three where the kernel's code is not known)."""
    import ctypes
    slots = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
    args = tuple(("array", ctypes.cast(slots[i], ctypes.POINTER(ctypes.c_uint64))[0]) for i in range(_POINTERS[f]))
    record("raw_kernel", _FUNCTIONS[f], (gx, gy, gz), (bx, by, bz), args, smem)


def _memcpy_async(dst: int, src: int, n: int, kind: int, stream: int) -> None:
    """Records the copy; with ``copies`` on (its memory is host memory either way) it is made too."""
    record("memcpy", n, kind)
    if _state["copies"]:
        ctypes.memmove(dst, src, n)


def _memcpy_peer_async(dst: int, dst_dev: int, src: int, src_dev: int, n: int, stream: int) -> None:
    record("memcpy_peer", n, dst_dev, src_dev)
    if _state["copies"]:
        ctypes.memmove(dst, src, n)


def _as_strided(a, shape, strides):
    return ndarray(shape, a.dtype, memptr=a.data, strides=strides)


def _mem_get_info():
    _state["mem_info_calls"] += 1
    return _state["free"], 80 << 30


def _build_modules() -> dict:
    cupy = types.ModuleType("cupy")
    for name in ("ndarray", "empty", "empty_like", "zeros_like", "full", "zeros", "ones", "concatenate", "asarray",
                 "asnumpy", "ascontiguousarray", "tile", "copyto", "may_share_memory", "ElementwiseKernel",
                 "ReductionKernel", "RawKernel", "RawModule", "get_default_memory_pool"):
        setattr(cupy, name, globals()[name])
    for name in ("uint8", "uint16", "uint32", "uint64", "int32", "int64", "float16", "float32", "float64"):
        setattr(cupy, name, getattr(np, name))
    cupy.lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(as_strided=_as_strided))
    cupy.add = np.add  # (a ufunc on the stand-in's arrays: recorded by their __array_ufunc__)
    cuda = types.ModuleType("cupy.cuda")
    for name in ("Device", "Stream", "Event", "get_current_stream", "get_elapsed_time", "alloc_pinned_memory",
                 "MemoryPointer", "UnownedMemory", "MemoryPool", "get_allocator", "using_allocator", "Graph"):
        setattr(cuda, name, globals()[name])
    cuda.runtime = types.SimpleNamespace(memGetInfo=_mem_get_info, getDevice=_current_device, memcpyHostToDevice=1,
                                         memcpyDeviceToHost=2, memcpyAsync=_memcpy_async,
                                         memcpyPeerAsync=_memcpy_peer_async,
                                         eventRecord=lambda event, stream: record("event_record", stream, event),
                                         streamWaitEvent=lambda stream, event, flags=0: record("wait_event", stream,
                                                                                                event),
                                         streamIsCapturing=lambda stream: _is_capturing(None))
    cuda.memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError)
    cuda.driver = types.SimpleNamespace(launchKernel=_launch_kernel)
    cupy.cuda = cuda
    cublas = types.ModuleType("cupy_backends.cuda.libs.cublas")
    cublas.create = lambda: 0
    cublas.setStream = lambda handle, stream: None
    cublas.setPointerMode = lambda handle, mode: None
    cublas.CUBLAS_POINTER_MODE_HOST = 0
    cublas.gemmEx = lambda handle, *args: record("gemm_ex", *args[2:5])  # (m, n, k)
    cuda.device = types.SimpleNamespace(get_cublas_handle=lambda: 0)
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.cublas = cublas
    backends_cuda = types.ModuleType("cupy_backends.cuda")
    backends_cuda.libs = libs
    backends = types.ModuleType("cupy_backends")
    backends.cuda = backends_cuda
    return {"cupy": cupy, "cupy.cuda": cuda, "cupy_backends": backends, "cupy_backends.cuda": backends_cuda,
            "cupy_backends.cuda.libs": libs, "cupy_backends.cuda.libs.cublas": cublas}


def _gemm_stub():
    """The route's cublasGemmStridedBatchedEx: a C function that ignores its arguments and returns 0 (abs of
    the null handle), called as the real one is (blasx.dnn.cublas_call: the C extension, else ctypes; its
    conversion cost is the real one's), recording the call where calls are recorded."""
    from blasx.dnn import cublas_call
    fn = cublas_call.bind(ctypes.CDLL(None).abs)

    def gemm(*args):
        record("gemm", *args[1:], ctypes.string_at(args[6], 4), ctypes.string_at(args[15], 4))
        return fn(*args)
    return gemm if _state["recording"] else fn


def _kernel_tables() -> list:
    """The kernel caches the route fills (the fake's kernels must not outlive it)."""
    from blasx.dnn import depthwise, direct_cuda
    from blasx.runtime.devices import cuda_epilogue, cuda_lowp
    return [direct_cuda._KERNELS, direct_cuda._GATHERS, direct_cuda._COL2IMS, depthwise._KERNELS, cuda_epilogue._KERNELS, cuda_lowp._KERNELS]


def _clear_caches() -> None:
    try:
        from blasx.dnn import direct_cache
    except ImportError:
        return
    direct_cache.clear()


@contextlib.contextmanager
def installed(record_calls: bool = False, copies: bool = False):
    """The fake modules in sys.modules and the route's GEMM entry points stubbed; ``record_calls``:
    every launch recorded in ``LOG`` (cleared on entry); ``copies``: ``runtime.memcpyAsync``, ``a[...] = b`` and
    the transpose kernel (blasx.dnn.transpose_kernel) copy the bytes (device arrays are host memory: a test's own
    code may compute on them)."""
    mods = _build_modules()
    saved = {k: sys.modules.get(k) for k in mods}
    from blasx.dnn import cublas_call
    saved_gemm = cublas_call.strided_batched_ex
    tables = cublas_call._HANDLES, cublas_call._HELD, cublas_call._SPARE, cublas_call._RESERVED
    saved_handles = [dict(t) for t in tables]
    kernel_tables = _kernel_tables()
    saved_kernels = [dict(t) for t in kernel_tables]
    LOG.clear()
    _local.__dict__.clear()  # this thread starts on device 0's null stream, whatever an earlier use left current
    _state["mem_info_calls"] = 0
    _state["free"] = 64 << 30
    _state["recording"] = record_calls
    _state["copies"] = copies
    sys.modules.update(mods)
    stub = _gemm_stub()
    cublas_call.strided_batched_ex = lambda use_extension=True: stub
    for t in tables:
        t.clear()
    from blasx.runtime.devices import cublas_ctypes
    from blasx.dnn import rnn_layer
    saved_cc = (cublas_ctypes.set_stream, cublas_ctypes.set_workspace, cublas_ctypes.set_pointer_mode,
                cublas_ctypes.gemm_ex)
    saved_sb = rnn_layer._strided_batched
    cublas_ctypes.set_stream = cublas_ctypes.set_workspace = lambda *args: None  # a handle's one-time binding
    cublas_ctypes.set_pointer_mode = lambda *args: None
    cublas_ctypes.gemm_ex = lambda: (lambda handle, *args: record("gemm_ex", *args[2:5]))  # (m, n, k)
    rnn_layer._strided_batched = lambda handle, *args: record("gemm_batched", *args[2:5], args[-4])  # (m, n, k, batch)
    for t in kernel_tables:
        t.clear()
    _clear_caches()
    try:
        yield types.SimpleNamespace(cupy=mods["cupy"], log=LOG, state=_state)
    finally:
        _local.__dict__.clear()
        _state["recording"] = False
        _state["copies"] = False
        cublas_call.strided_batched_ex = saved_gemm
        (cublas_ctypes.set_stream, cublas_ctypes.set_workspace, cublas_ctypes.set_pointer_mode,
         cublas_ctypes.gemm_ex) = saved_cc
        rnn_layer._strided_batched = saved_sb
        for table, before in zip(tables, saved_handles):
            table.clear()
            table.update(before)
        for t, before in zip(kernel_tables, saved_kernels):
            t.clear()
            t.update(before)
        _clear_caches()
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
