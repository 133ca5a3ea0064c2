"""The step loops of one recurrent layer in one direction: forward (eq. 11 per step) and backward (eq. 15).

The input projection (eq. 12) is done before the loop (one engine GEMM for all T steps, in rnn.py); each step
then costs one recurrent GEMM ``gh = h_prev . W_hh^T`` and one fused cell kernel (rnn_cells.py), plus the
projection GEMM ``h = r . W_hr^T`` for an LSTM with ``proj_size``. Variable lengths (sorted decreasing, as
MIOpen requires) shrink the active rows: step t runs the first ``bs[t]`` rows; the other rows keep their state
(finished sequences in the forward direction, not yet started ones in the reverse direction).

Arrays are indexed by *processing step* p (time t = p forward, T-1-p in reverse): ``S[p]`` is the hidden
state before step p (``S[T]`` is h_n), ``C[p]`` the cell state, ``gates[p]`` the saved activations, ``R[p]`` the
unprojected h. S and R have the storage type (rounded as the GPU stores them), everything else the compute
type F. The loops issue kernels and GEMMs only (no allocation), so on CUDA one loop can be captured into a
graph (rnn_graph.py); :class:`HostOps` and :class:`CudaOps` are the two sets of primitives.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from . import rnn_cells, rnn_diag_cells
from ..runtime import dtypes
from ..threadlocal import setting
from .cublas_call import check, device_workspace, strided_batched_ex
from .direct_cuda import gemm_consts


def compute_type(dtype) -> np.dtype:
    """F: float64 for float64 data, float32 for float32, float16 and bfloat16."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


class _Moves:
    """The in-place moves both backends share (numpy and CuPy arrays alike)."""

    @staticmethod
    def copy(dst, src) -> None:
        dst[...] = src

    @staticmethod
    def zero(dst) -> None:
        """dst = 0 in place (CuPy: a memset on contiguous memory, no scalar array made)."""
        dst.fill(0)

    @staticmethod
    def add(dst, src) -> None:
        """dst += src in place (on a view: ``a[:k] += b`` would also copy the view onto itself)."""
        dst += src

    @staticmethod
    def bias(out, b_ih, b_hh, gru: bool) -> None:
        """The step cell's bias from a layer's two (rnn_cells.bias_sum)."""
        rnn_cells.bias_sum(out, b_ih, b_hh, gru)


class HostOps(_Moves):
    """numpy primitives (host BLAS for the per-step GEMMs)."""
    xp = np
    forward = staticmethod(rnn_cells.np_forward)
    backward_step = staticmethod(rnn_cells.np_backward_step)

    def __init__(self, math: str = "ieee") -> None:
        self.math = math

    @staticmethod
    def gemm(a, w, out, trans_w: bool, beta: float = 0.0) -> None:
        """out = a . w^T (trans_w) or a . w, plus ``beta`` * out (0 or 1); a and w are cast to out's type first
        when they differ."""
        f = out.dtype if out.dtype.itemsize >= 4 else np.dtype(np.float32)
        a = a if a.dtype == f else a.astype(f)
        w = w if w.dtype == f else w.astype(f)
        res = a @ (w.T if trans_w else w)
        if beta:
            out += res
        else:
            out[...] = res

    @staticmethod
    def gemm_batched(a, w, out, trans_w: bool, beta: float) -> None:
        """out[i] = a[i] . w[i]^T (trans_w) or a[i] . w[i], plus ``beta`` * out[i] (0 or 1); a may be strided."""
        f = out.dtype
        res = np.matmul(a.astype(f), w.astype(f).transpose(0, 2, 1) if trans_w else w.astype(f))
        if beta:
            out += res
        else:
            out[...] = res

    def gemm_layers(self, a, w, out, trans_w: bool, beta: float) -> None:
        """A diagonal step's layers: :meth:`gemm_batched` (CudaOps may fork them)."""
        self.gemm_batched(a, w, out, trans_w, beta)

    @staticmethod
    def step_splits(f, k: int, h: int) -> int:
        """The backward loop's recurrent GEMM in k slices (:func:`backward_steps`): none on the host."""
        return 1

    diag_forward = staticmethod(rnn_diag_cells.np_forward)
    diag_backward = staticmethod(rnn_diag_cells.np_backward)

    @staticmethod
    def state_in(a):
        """A storage-type array as the cell kernels read it."""
        return a.astype(np.float32) if a.dtype.itemsize < 4 else a

    @staticmethod
    def placeholder(f):
        return None


def _strided_batched(*args) -> None:
    """cublasGemmStridedBatchedEx (cublas_call: its strides are 64-bit), raising on a cuBLAS error."""
    check(strided_batched_ex()(*args))


_shared: dict = {}  # device id -> (cuBLAS handle, its lock): the handle of workspace GEMMs, kept for the process
_shared_lock = threading.Lock()


def _shared_handle(dev: int):
    """The device's handle for :meth:`CudaOps.gemm` on a workspace (made outside any capture, on first use)."""
    with _shared_lock:
        if dev not in _shared:
            from cupy_backends.cuda.libs import cublas
            _shared[dev] = (cublas.create(), threading.Lock())
        return _shared[dev]


_side = threading.local()  # per thread: (device id, key) -> a non-blocking side stream
_whole = threading.local()  # .ws: {device id, or (id, stream ptr): cuBLAS workspace} while capturing a whole call


class NotCapturable(RuntimeError):
    """Raised inside a whole-call capture by work that cannot be captured (the call then runs eagerly)."""


def whole_call_capture(workspaces: dict):
    """Within it this thread captures a whole call (rnn_replay.py): every CudaOps GEMM without a workspace of
    its own issues through ctypes with ``workspaces[device]`` (owned by the graph), and GEMMs that would go to
    the engine (rnn_exec) are local or refused."""
    return setting(_whole, "ws", workspaces)


def capturing_whole_call() -> bool:
    return getattr(_whole, "ws", None) is not None


def lane_workspace(stream) -> None:
    """Inside a whole-call capture: a cuBLAS workspace of ``stream``'s own (the current device's, made on it) for
    the GEMMs issued there, so that two streams of one device running side by side never share one. It is kept in
    the capture's table, which the graph holds."""
    import cupy
    _whole.ws[(cupy.cuda.Device().id, stream.ptr)] = device_workspace(cupy)


def _side_stream(dev: int, key):
    """The calling thread's side stream ``key`` on ``dev`` (per thread, so one thread's capture never takes in
    another thread's launches on a shared stream)."""
    streams = _side.__dict__.setdefault("streams", {})
    if (dev, key) not in streams:
        import cupy
        with cupy.cuda.Device(dev):
            streams[(dev, key)] = cupy.cuda.Stream(non_blocking=True)
    return streams[(dev, key)]


def gemm_ex_layout(x) -> tuple[int, int]:
    """(cuBLAS op, leading dimension) of a row-major operand x (r, c) read as the column-major x^T: C-contiguous
    memory is x^T itself (op N, ld c), F-contiguous memory is x (op T, ld r); ValueError for any other layout."""
    if x.flags.c_contiguous:
        return 0, max(1, x.shape[1])
    if x.flags.f_contiguous:
        return 1, max(1, x.shape[0])
    raise ValueError(f"gemm operand of shape {x.shape} and strides {x.strides} is neither C- nor F-contiguous")


class CudaOps(_Moves):
    """CuPy primitives on the current device and stream: cuBLAS GemmEx for the per-step GEMMs (half inputs
    with a float32 result, TF32 when asked), the cell ElementwiseKernels.

    ``workspace`` (a device buffer, set by rnn_graph.py around a loop it runs or captures) sends the GEMMs
    through ctypes on a per-device handle with that buffer as cuBLAS's workspace: CuPy's cuBLAS wrappers refuse
    a capturing stream, and a captured GEMM must not use a workspace that dies with CuPy's per-thread handle."""
    forward = staticmethod(rnn_cells.cupy_forward)

    def backward_step(self, mode, a, dh, dy, dc, gates, c, c_prev, h, h_prev, dgx, dgh, dc_out, dh_out, g16=None,
                      x16=None):
        """rnn_cells.cupy_backward_step; placeholders stand in for absent ``g16``/``x16`` (storage type) and
        ``dgx``/``dgh`` (F: the narrow form, only the rounded copies written)."""
        ph, phf = self.placeholder(h.dtype), self.placeholder(dh.dtype)
        half = 0 if g16 is None else 2 if dgx is None else 1
        rnn_cells.cupy_backward_step(mode, a, dh, dy, dc, gates, c, c_prev, h, h_prev,
                                     phf if dgx is None else dgx, phf if dgh is None else dgh, dc_out, dh_out,
                                     ph if g16 is None else g16, ph if x16 is None else x16, half)

    def __init__(self, math: str = "ieee") -> None:
        import cupy
        self.xp = cupy
        self.math = math
        self._fn = None
        self._ph: dict = {}
        self._workspace = None
        self.split_k = True  # False: the workspace GEMMs get none, so cuBLAS picks no split-k (no reduction launch)

    @property
    def workspace(self):
        """The GEMMs' own workspace (set by rnn_graph.py), else a whole-call capture's for this device, else None
        (CuPy's handle)."""
        ws = self._workspace
        if ws is None and (table := getattr(_whole, "ws", None)) is not None:
            dev = self.xp.cuda.Device().id
            ws = table.get((dev, self.xp.cuda.get_current_stream().ptr))
            ws = table.get(dev) if ws is None else ws
        return ws

    @workspace.setter
    def workspace(self, ws) -> None:
        self._workspace = ws

    diag_forward = staticmethod(rnn_diag_cells.cupy_forward)
    diag_backward = staticmethod(rnn_diag_cells.cupy_backward)

    def _gemm_ex(self):
        if self._fn is None:
            from cupy_backends.cuda.libs import cublas
            fn = getattr(cublas, "gemmEx", None)
            if fn is None:
                from ..runtime.devices.cublas_ctypes import gemm_ex
                fn = gemm_ex()
            self._fn = fn
        return self._fn

    def gemm(self, a, w, out, trans_w: bool, beta: float = 0.0) -> None:
        """out (m, n) = a (m, k) . w^T (trans_w; w is (n, k)) or a . w (w is (k, n)), plus ``beta`` * out (0 or 1);
        row-major, contiguous."""
        self.matmul(a, w.T if trans_w else w, out, beta)

    def matmul(self, a, b, out, beta: float = 0.0) -> None:
        """out (m, n, C-contiguous) = a (m, k) . b (k, n) (+ ``beta`` * out, 0 or 1), a and b each C- or
        F-contiguous (gemm_ex_layout), of one type: one cublasGemmEx on the current stream, issued as the
        column-major out^T = op(b^T) op(a^T)."""
        import cupy
        from cupy_backends.cuda.libs import cublas
        m, k = a.shape
        n = out.shape[1]
        if m == 0:
            return
        (op_a, lda), (op_b, ldb) = gemm_ex_layout(a), gemm_ex_layout(b)
        compute, scal, _keep = gemm_consts(a.dtype, self.math)
        args = (op_b, op_a, n, m, k, scal[1.0],
                b.data.ptr, dtypes.CUDA_TYPE[b.dtype], ldb,
                a.data.ptr, dtypes.CUDA_TYPE[a.dtype], lda, scal[1.0 if beta else 0.0],
                out.data.ptr, dtypes.CUDA_TYPE[out.dtype], n, compute, dtypes.CUBLAS_GEMM_DEFAULT)
        stream = cupy.cuda.get_current_stream().ptr
        if self.workspace is not None:
            self._gemm_on_workspace(stream, args)
            return
        handle = cupy.cuda.device.get_cublas_handle()
        cublas.setStream(handle, stream)
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        self._gemm_ex()(handle, *args)

    def _gemm_on_workspace(self, stream: int, args: tuple, fn=None) -> None:
        """One GemmEx (or ``fn``) through ctypes on the device's shared handle: stream, then workspace (setting
        the stream resets it), host scalars (captured by value), under the handle's lock so threads do not mix
        settings."""
        from ..runtime.devices import cublas_ctypes as cc
        handle, lock = _shared_handle(self.xp.cuda.Device().id)
        ws = self.workspace
        with lock:
            cc.set_stream(handle, stream)
            cc.set_workspace(handle, ws.data.ptr, ws.nbytes if self.split_k else 0)
            cc.set_pointer_mode(handle, 0)
            (fn or cc.gemm_ex())(handle, *args)

    def step_splits(self, f, k: int, h: int) -> int:
        """k slices of the backward loop's recurrent GEMM (dh = dgates . W_hh, k the gates' width) as one strided-
        batched GEMM whose partial sums the next cell kernel adds (:func:`backward_steps`), not cuBLAS's split-k
        and its reduction: :data:`STEP_SPLITS` for float32 with slices of 256+ (IEEE only up to H = 1024), else 1."""
        ok = np.dtype(f) == np.float32 and k % STEP_SPLITS == 0 and k // STEP_SPLITS >= 256
        return STEP_SPLITS if ok and (self.math == "tf32" or h <= 1024) else 1

    def gemm_batched(self, a, w, out, trans_w: bool, beta: float) -> None:
        """out[i] (m, n) = a[i] (m, k) . w[i]^T (trans_w) or a[i] . w[i], plus ``beta`` * out[i] (0 or 1): one
        cublasGemmStridedBatchedEx on the current stream. Rows of a and out may be strided (the last axis
        contiguous), w contiguous; row-major, issued as the column-major out^T = op(w) a^T."""
        import cupy
        from ..runtime.devices import cublas_ctypes as cc
        nb, m, k = a.shape
        n = out.shape[2]
        ia, io = a.itemsize, out.itemsize
        assert a.strides[2] == ia and out.strides[2] == io and w.flags.c_contiguous
        compute, scal, _keep = gemm_consts(a.dtype, self.math)
        args = (1 if trans_w else 0, 0, n, m, k, scal[1.0],
                w.data.ptr, dtypes.CUDA_TYPE[w.dtype], k if trans_w else n, w.strides[0] // w.itemsize,
                a.data.ptr, dtypes.CUDA_TYPE[a.dtype], a.strides[1] // ia, a.strides[0] // ia,
                scal[1.0 if beta else 0.0],
                out.data.ptr, dtypes.CUDA_TYPE[out.dtype], out.strides[1] // io, out.strides[0] // io, nb,
                compute, dtypes.CUBLAS_GEMM_DEFAULT)
        stream = cupy.cuda.get_current_stream().ptr
        if self.workspace is not None:
            self._gemm_on_workspace(stream, args, _strided_batched)
            return
        handle = cupy.cuda.device.get_cublas_handle()
        cc.set_stream(handle, stream)
        cc.set_pointer_mode(handle, 0)
        _strided_batched(handle, *args)

    def gemm_layers(self, a, w, out, trans_w: bool, beta: float) -> None:
        """:meth:`gemm_batched`'s result for a diagonal step's layers. float32 IEEE (SIMT kernels, where cuBLAS's
        batched call picks a slower kernel for these small-row shapes than separate calls get) issues one
        GemmEx per layer, each on its own side stream forked from and joined to the current one by events (so a
        capture turns them into parallel graph branches), each on its own 1/n of the workspace (rnn_graph.Diag
        holds one default-sized piece per layer; a fresh one when none is set, so eager and captured loops pick
        the same kernels; without a workspace cuBLAS picks far slower ones here); float64 keeps the batched call
        (rnn_plan runs tensor-core math layer after layer, never diagonally)."""
        nb = a.shape[0]
        if nb == 1 or a.dtype != np.float32:
            self.gemm_batched(a, w, out, trans_w, beta)
            return
        import cupy
        from ..runtime.devices import cublas_ctypes as cc
        m, k = a.shape[1:]
        n = out.shape[2]
        compute, scal, _keep = gemm_consts(a.dtype, self.math)
        main = cupy.cuda.get_current_stream()
        dev = cupy.cuda.Device().id
        ws = self.workspace
        if ws is None and main.is_capturing():  # a caller's capture: nothing allocated in it
            self.gemm_batched(a, w, out, trans_w, beta)
            return
        if ws is None:  # freed to the current stream's pool: reused only after the joins below
            ws = device_workspace(cupy, nb)
        piece = (ws.nbytes // nb) & ~255 if self.split_k else 0
        handle, lock = _shared_handle(dev)
        fork = main.record()
        joins = []
        for i in range(nb):
            st = _side_stream(dev, i)
            st.wait_event(fork)
            args = (1 if trans_w else 0, 0, n, m, k, scal[1.0],
                    w[i].data.ptr, dtypes.CUDA_TYPE[w.dtype], k if trans_w else n,
                    a[i].data.ptr, dtypes.CUDA_TYPE[a.dtype], a.strides[1] // a.itemsize,
                    scal[1.0 if beta else 0.0], out[i].data.ptr, dtypes.CUDA_TYPE[out.dtype],
                    out.strides[1] // out.itemsize, compute, dtypes.CUBLAS_GEMM_DEFAULT)
            with lock:
                cc.set_stream(handle, st.ptr)
                cc.set_workspace(handle, ws.data.ptr + i * piece if piece else 0, piece)
                cc.set_pointer_mode(handle, 0)
                cc.gemm_ex()(handle, *args)
            joins.append(st.record())
        for ev in joins:
            main.wait_event(ev)

    @staticmethod
    def state_in(a):
        return a

    def placeholder(self, f):
        """A one-element stand-in for an argument the mode lacks (made once, so no capture allocates it)."""
        f = np.dtype(f)
        if f not in self._ph:
            self._ph[f] = self.xp.zeros(1, dtype=f)
        return self._ph[f]


NARROW = True  # CUDA float16 backward loops keep their gate gradients only rounded (backward_buffers): less memory
#               traffic; False keeps them in float32 too
STEP_SPLITS = 8  # k slices of a CUDA backward step's recurrent GEMM (CudaOps.step_splits; 1: cuBLAS's split-k)


def col_sum(xp, a, out_dtype=None):
    """The column sums of a C-contiguous (r, n) ``a`` (bias gradients over all steps), in ``out_dtype`` (default
    a's; float32 for float16 ``a``: accumulated in float32): on CUDA a ones-row GEMM in IEEE math, which reads
    ``a`` at full memory bandwidth (CuPy's axis-0 reduction does not)."""
    if xp is np:
        return a.sum(axis=0, dtype=out_dtype)
    out = xp.empty((1, a.shape[1]), dtype=out_dtype or a.dtype)
    CudaOps("ieee").matmul(_ones(xp, a.shape[0], a.dtype), a, out)
    return out[0]


_ONES: dict = {}  # (device, dtype) -> the ones rows made there, shortest first (none freed: a GEMM queued on
#                  another stream may still read a shorter one; each new one at least twice as long)
_ONES_LOCK = threading.Lock()


def _ones(xp, n: int, dtype):
    """A (1, n) row of ones on the current device, cut from the longest kept per device and type (made, and
    waited for, the first time a longer one is asked for: any stream may read it after)."""
    key = (xp.cuda.Device().id, np.dtype(dtype))
    rows = _ONES.get(key)
    if not rows or rows[-1].shape[0] < n:
        with _ONES_LOCK:
            rows = _ONES.setdefault(key, [])
            if not rows or rows[-1].shape[0] < n:
                row = xp.ones(max(n, 1024, 2 * rows[-1].shape[0] if rows else 0), dtype=dtype)
                xp.cuda.get_current_stream().synchronize()
                rows.append(row)
    return rows[-1][:n].reshape(1, n)


@dataclass
class Forward:
    """What one direction's forward loop leaves: states by processing step (see the module docstring)."""
    S: object  # (T+1, B, out) storage type
    C: object | None  # (T+1, B, H) F, LSTM
    gates: object | None  # (T, B, 4H) F, LSTM and GRU
    R: object | None  # (T, B, H) storage type, LSTM with a projection
    lease: object = None  # the rnn_graph entry whose buffers C, gates and R are, held while this is alive


class Like:
    """The shape and dtype of a buffer, where there is no array of it (rnn_graph.py's entries make them)."""

    def __init__(self, shape: tuple, dtype) -> None:
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)


def order(T: int, reverse: bool):
    """Time index of each processing step."""
    return range(T - 1, -1, -1) if reverse else range(T)


def forward_buffers(xp, mode: str, T: int, B: int, H: int, out: int, proj: bool, store, f,
                    gates: bool = True, lean: bool = False) -> Forward:
    """Empty buffers of a forward loop (``gates=False``: none for the saved activations, where a loop that
    needs none for its result runs without them; ``lean``: S alone, the others as :class:`Like` for a graph
    entry to lend, rnn_graph.run)."""
    saved = rnn_cells.SAVED[mode] if gates else 0
    # R zeroed: the loop writes only a step's active rows, and weight_hr's gradient reads all of them
    empty, zeros = (Like, Like) if lean else (lambda s, dtype: xp.empty(s, dtype=dtype),
                                              lambda s, dtype: xp.zeros(s, dtype=dtype))
    return Forward(S=xp.empty((T + 1, B, out), dtype=store),
                   C=empty((T + 1, B, H), f) if mode == "lstm" else None,
                   gates=empty((T, B, saved * H), f) if saved else None,
                   R=zeros((T, B, H), store) if proj else None)


def forward_loop(ops, mode: str, gx, w_hh, w_hr, bias, st: Forward, gh, bs, reverse: bool) -> None:
    """The step loop: ``gx`` (T, B, G*H) in time order (F, the projection alone), ``bias`` the cell's (rnn_cells:
    the kernel adds it) or None, ``st.S[0]`` (and
    ``st.C[0]``) hold h0 (c0) on entry; ``gh`` is a (B, G*H) F scratch; ``bs[t]`` the active rows at time t."""
    T, B = gx.shape[:2]
    f = gx.dtype
    ph = ops.placeholder(f)
    times = order(T, reverse)
    for p in range(T):
        t = times[p]
        a = bs[t]
        hp = st.S[p, :a]
        ops.gemm(hp, w_hh, gh[:a], True)
        cp = st.C[p, :a] if st.C is not None else ph
        cn = st.C[p + 1, :a] if st.C is not None else ph
        g = st.gates[p, :a] if st.gates is not None else ph
        h_out = st.R[p, :a] if st.R is not None else st.S[p + 1, :a]
        ops.forward(mode, gx[t, :a], gh[:a], bias, cp, ops.state_in(hp), g, cn, h_out)
        if st.R is not None:
            ops.gemm(st.R[p, :a], w_hr, st.S[p + 1, :a], True)
        if a < B:
            ops.copy(st.S[p + 1, a:], st.S[p, a:])
            if st.C is not None:
                ops.copy(st.C[p + 1, a:], st.C[p, a:])


@dataclass
class Backward:
    """One direction's backward loop results (processing-step order, F)."""
    dgx: object  # (T, B, G*H): gate pre-activation gradients, input side (zero for inactive rows)
    dgh: object  # the hidden side (the same array as dgx except for GRU)
    dhs: object | None  # (T, B, P): the gradient of each projected h, for dW_hr
    dh: object  # (B, out): the gradient of h0 on exit
    dc: object | None  # (B, H): of c0
    g16: object | None = None  # (T, B, G*H): dgh rounded to the float16 storage type, where the loop's GEMMs take it
    x16: object | None = None  # (T, B, G*H): GRU's dgx rounded likewise, in the narrow form (dgx, dgh None)


@dataclass
class BackwardScratch:
    """Per-step temporaries of the backward loop ((B, ...) F; placeholders where the mode has none). The step
    gradients ping-pong between Backward.dh/dc and dh2/dc2, so a step is one fused cell kernel and one GEMM."""
    dr: object | None  # (B, H): the gradient of the unprojected h (projection only)
    dh2: object  # (B, out): the other dh
    dc2: object  # (B, H): the other dc (LSTM)
    carry: object  # (B, H): where a projection step's cell carries inactive rows (unused; projection only)
    parts: tuple | None = None  # two (n, B, out) stacks of dh's partial sums in place of dh / dh2 (k slices)
    splits: int = 1  # k slices of the recurrent GEMM: n = splits (GRU: + 1, the part not through W_hh)


def backward_buffers(ops, mode: str, st: Forward, w_hh, H: int, f, dh_n, dc_n, half=None) -> tuple:
    """(Backward with zeroed gradients and dh/dc set from dh_n/dc_n, its BackwardScratch) for :func:`backward_steps`
    on the recurrent weight ``w_hh``; rows a loop never reaches stay zero. ``half`` (a 2-byte dtype): the loop's
    GEMMs take dgh rounded to it; on CUDA with :data:`NARROW` the gate gradients are kept only so rounded (``dgx``,
    ``dgh`` None; GRU's dgx in ``x16``), as every GEMM after the loop reads them in that type."""
    xp, g = ops.xp, w_hh.shape[0]
    T, B = st.S.shape[0] - 1, st.S.shape[1]
    out = st.S.shape[2]
    narrow = NARROW and half is not None and xp is not np and st.R is None
    dgx = None if narrow else xp.zeros((T, B, g), dtype=f)
    dgh = xp.zeros((T, B, g), dtype=f) if mode == "gru" and not narrow else dgx
    dhs = xp.zeros((T, B, out), dtype=f) if st.R is not None else None
    dh = xp.zeros((B, out), dtype=f) if dh_n is None else dh_n.astype(f, copy=True)
    dc = None
    if mode == "lstm":
        dc = xp.zeros((B, H), dtype=f) if dc_n is None else dc_n.astype(f, copy=True)
    proj = st.R is not None
    splits = 1 if proj or half is not None or not w_hh.flags.c_contiguous else ops.step_splits(f, g, H)
    n = splits + (mode == "gru")
    scratch = BackwardScratch(dr=xp.empty((B, H), dtype=f) if proj else None,
                              dh2=xp.empty((B, out), dtype=f),
                              dc2=xp.empty((B, H), dtype=f) if mode == "lstm" else ops.placeholder(f),
                              carry=xp.empty((B, H), dtype=f) if proj else ops.placeholder(f),
                              parts=(xp.zeros((n, B, out), dtype=f), xp.zeros((n, B, out), dtype=f))
                              if splits > 1 else None, splits=splits)
    g16 = xp.zeros((T, B, g), dtype=half) if half is not None else None
    x16 = xp.zeros((T, B, g), dtype=half) if narrow and mode == "gru" else None
    return Backward(dgx, dgh, dhs, dh, dc, g16, x16), scratch


def half_of(w_hh):
    """The 2-byte type of recurrent weights given in it (the backward loop's GEMMs then take dgh rounded to it,
    on tensor cores, as cuDNN keeps half gradients), or None for weights in F."""
    return w_hh.dtype if w_hh.dtype.itemsize == 2 else None


def backward_loop(ops, mode: str, st: Forward, w_hh_f, w_hr_f, dy, dh_n, dc_n, bs, reverse: bool,
                  H: int) -> Backward:
    """Eq. 15 step by step in reverse processing order; ``dy`` (T, B, out) F in time order (or None),
    ``dh_n``/``dc_n`` (B, out)/(B, H) F or None. Weights are in F, or ``w_hh_f`` in float16 (see :func:`half_of`;
    no projection)."""
    bw, scratch = backward_buffers(ops, mode, st, w_hh_f, H, compute_type(w_hh_f.dtype), dh_n, dc_n, half_of(w_hh_f))
    dy = None if dy is None else ops.xp.ascontiguousarray(dy)
    backward_steps(ops, mode, st, w_hh_f, w_hr_f, dy, bs, reverse, bw, scratch)
    return bw


def backward_steps(ops, mode: str, st: Forward, w_hh_f, w_hr_f, dy, bs, reverse: bool, bw: Backward,
                   scratch: BackwardScratch) -> None:
    """The backward step loop on buffers from :func:`backward_buffers` (``dy`` C-contiguous or None): kernels
    and GEMMs only (no allocation), so on CUDA it can be captured into a graph like the forward loop. Without a
    projection a step is one fused cell kernel (dy added, inactive rows carried over) and one GEMM into the
    other dh buffer (GRU: accumulating onto the cell's part not through W_hh). With ``scratch.splits`` > 1 the
    GEMM is a strided-batched one over k slices of the gate gradients, each slice's product in its own part of a
    stack that the next cell kernel sums as its dh (GRU: the cell's own part in the stack's last), so a step has
    no reduction launch."""
    T, B = st.S.shape[0] - 1, st.S.shape[1]
    f = bw.dh.dtype
    ph = ops.placeholder(f)
    dhs = (bw.dh, scratch.dh2)
    sp = scratch.splits
    if scratch.parts is not None and st.R is None and w_hh_f.flags.c_contiguous:  # (slices as views, no copy)
        dhs = scratch.parts
        ops.copy(dhs[0][0], bw.dh)
        ops.zero(dhs[0][1:])
    else:
        sp = 1
    dcs = (bw.dc, scratch.dc2) if bw.dc is not None else (ph, ph)
    times = list(order(T, reverse))
    for n, p in enumerate(range(T - 1, -1, -1)):
        t, cur, nxt = times[p], n % 2, 1 - n % 2
        a = bs[t]
        dh, dh_next, dc, dc_next = dhs[cur], dhs[nxt], dcs[cur], dcs[nxt]
        gates = st.gates[p] if st.gates is not None else ph
        c, c_prev = (st.C[p + 1], st.C[p]) if st.C is not None else (ph, ph)
        if st.R is None:
            g16, x16 = (None if v is None else v[p] for v in (bw.g16, bw.x16))
            ops.backward_step(mode, a, dh, None if dy is None else dy[t], dc, gates, c, c_prev,
                              ops.state_in(st.S[p + 1]), ops.state_in(st.S[p]),
                              None if bw.dgx is None else bw.dgx[p], None if bw.dgh is None else bw.dgh[p], dc_next,
                              dh_next, g16, x16)
            dg = (bw.dgh if g16 is None else bw.g16)[p, :a]
            if sp == 1:
                ops.gemm(dg, w_hh_f, dh_next[:a], False, beta=1.0 if mode == "gru" else 0.0)
            else:
                k = dg.shape[1] // sp
                ops.gemm_batched(dg.reshape(a, sp, k).transpose(1, 0, 2), w_hh_f.reshape(sp, k, -1),
                                 dh_next[:sp, :a], False, 0.0)
            continue
        if dy is not None:  # projection (LSTM): dh is the projected h's gradient
            ops.add(dh[:a], dy[t, :a])
        ops.copy(bw.dhs[p, :a], dh[:a])
        ops.gemm(dh[:a], w_hr_f, scratch.dr[:a], False)
        ops.backward_step(mode, a, scratch.dr, None, dc, gates, c, c_prev, ops.state_in(st.R[p]),
                          ops.state_in(st.S[p]), bw.dgx[p], bw.dgh[p], dc_next, scratch.carry)
        ops.gemm(bw.dgh[p, :a], w_hh_f, dh_next[:a], False)
        if a < B:
            ops.copy(dh_next[a:], dh[a:])
    if sp > 1:  # dh0's parts summed by copies and in-place adds (a reduction may allocate, e.g. CUB's scratch)
        last = dhs[T % 2]
        ops.copy(bw.dh, last[0])
        for q in range(1, last.shape[0]):
            ops.add(bw.dh, last[q])
    elif T % 2:  # the last step wrote the second buffers
        ops.copy(bw.dh, scratch.dh2)
    if T % 2 and bw.dc is not None:
        ops.copy(bw.dc, scratch.dc2)


