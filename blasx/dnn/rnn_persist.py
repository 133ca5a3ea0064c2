"""A recurrent layer-direction's whole forward loop as one persistent kernel (rnn_persist.cu), for float16 layers
on CuPy arrays (CuPy has no bfloat16) without a projection.

The step loop of rnn_layer.py costs a GEMM and a cell kernel a step; replayed from a CUDA graph that is still
two dependent launches a step, and at small batch and hidden sizes their fixed costs, not the work, set the time
(the case cuDNN's persistent kernels address too). Here each block owns J hidden units (all
gates of each unit, so the cell needs no other block's result) and its warps hold those units' weight rows in
registers for the whole loop, each warp a share of the k range; a step is: each warp loads its slice of h_prev
from L2 into its tensor-core fragments, the products, the warps' partial sums, the cell, write the block's slice
of h, and a grid-wide wait (one counter, or with few blocks per-block step flags). Blocks must all be resident at
once: the launch is cooperative, one block per SM.

:func:`plan` (pure) picks J, the k split, the rows a pass and the step ordering; a shape it cannot fit (weight fragments
over the register budget, H not a multiple of 16) returns None and the graph loop runs instead.

An LSTM layer's backward loop runs the same way (:func:`run_backward`, :func:`plan_backward`): a block owns J units
as outputs of dh = dgates . W_hh, its warps hold those columns of W_hh, and a step multiplies the previous step's
gate gradients of all blocks (float16, from L2), applies the cell gradient and publishes the block's slice.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from importlib import resources
from math import gcd

import numpy as np

from ..runtime.devices.cupy_streams import stream_key
from .rnn_params import GATES

MODES = {"lstm": 0, "gru": 1, "rnn_tanh": 2, "rnn_relu": 3}
THREADS = 256
WARPS = THREADS // 32
SMEM = 227 * 1024  # dynamic shared memory a block may use on sm_80/sm_90
MAX_MT = 4  # 16-row tiles a pass (registers: MT x NT accumulator tiles a warp)
MAX_WREGS = 96  # registers a thread may give to weight fragments (NT x KT x 2)
MAX_TILES = 16  # a warp's mma tiles a step (NT x KT x MT) up to which blocks are made wider (J doubled) ...
MANY_BLOCKS, MAX_TILES_MANY = 64, 64  # ... up to 64 tiles while the grid has more blocks than this (its wait and
#                                        h traffic grow with the blocks)
MIN_BLOCKS = 32  # ... and down to this many blocks
MAX_BATCH = 64  # larger batches take the graph loop: each block reads all of h a step, and past one pass of
#                 64 rows that traffic from L2 costs more than the launches a graph replay pays ...
NARROW_H, NARROW_BATCH = 512, 128  # ... except in layers of H <= NARROW_H, whose two passes still cost less
FLAG_BLOCKS = 32  # grids up to this many blocks order their steps by per-block flags, larger ones by a counter
MAX_WREGS_BWD = 128  # the backward kernel's weight registers: more than the forward's (its cell needs fewer)
BWD_MAX_BATCH = 48  # the backward kernel's limit: every block reads all 4H gate gradients of its rows a step, so
#                     its step grows with the rows faster than the graph loop's GEMM and cell

ENABLED = True  # False: the graph loop always (A/B and tests)


@dataclass(frozen=True)
class Plan:
    units: int  # J: hidden units a block owns
    blocks: int  # H / J, at most one per SM
    kwarps: int  # KW: warps splitting the k range (the others only stage gx and apply the cell)
    nt: int  # NT: 8-column tiles of the block's G*J gate columns
    kt: int  # KT: 16-wide k steps a warp
    mt: int  # MT: 16-row tiles of h a pass
    smem: int  # dynamic shared memory bytes
    flags: bool  # steps ordered by per-block flags (else by one counter)


def plan(mode: str, batch: int, hidden: int, itemsize: int, sms: int, smem: int = SMEM,
         max_batch: int | None = None) -> Plan | None:
    """The persistent kernel's shape for this layer, or None where it does not apply (batch over ``max_batch``,
    default :data:`MAX_BATCH`, or :data:`NARROW_BATCH` where H <= :data:`NARROW_H`). J starts as the smallest
    unit count that makes G*J a whole number of 8-column tiles with H/J <= ``sms`` blocks and doubles while a
    warp's tiles a step stay within :data:`MAX_TILES` (:data:`MAX_TILES_MANY` while the grid has over
    :data:`MANY_BLOCKS` blocks) and the blocks number at least :data:`MIN_BLOCKS` (measured with every J a
    shape allows: a step's wait and every block's reading of h grow with the blocks, the products with a warp's
    tiles); the k range is split over the most warps (up to 8) that divide it into 16-wide steps; the weight
    fragments must fit :data:`MAX_WREGS` registers; a pass takes as many 16-row tiles (up to 4) as fit in
    shared memory; grids of up to :data:`FLAG_BLOCKS` blocks wait on per-block flags."""
    if max_batch is None:
        max_batch = max(MAX_BATCH, NARROW_BATCH) if hidden <= NARROW_H else MAX_BATCH
    return _plan(mode, batch, hidden, itemsize, sms, smem, max_batch)


@functools.lru_cache(maxsize=256)
def _plan(mode: str, batch: int, hidden: int, itemsize: int, sms: int, smem: int, max_batch: int) -> Plan | None:
    g = GATES[mode]
    if hidden % 16 or not 1 <= batch <= max_batch or itemsize != 2:
        return None
    step = 8 // gcd(g, 8)
    j = next((j for j in range(step, hidden + 1, step) if hidden % j == 0 and hidden // j <= sms), None)
    best = None if j is None else _shape(mode, batch, hidden, itemsize, smem, j)
    while best is not None:  # wider blocks while their warps' work stays small, or while there are many blocks
        j *= 2
        wider = _shape(mode, batch, hidden, itemsize, smem, j) if hidden % j == 0 else None
        limit = MAX_TILES_MANY if best.blocks > MANY_BLOCKS else MAX_TILES
        if wider is None or wider.blocks < MIN_BLOCKS or wider.nt * wider.kt * wider.mt > limit:
            break
        best = wider
    return best


def _shape(mode: str, batch: int, hidden: int, itemsize: int, smem: int, j: int) -> Plan | None:
    """The plan with J = ``j``, or None (weight fragments over the register budget, or no pass of rows fits)."""
    nj, k16 = GATES[mode] * j, hidden // 16
    kw = max(w for w in range(1, WARPS + 1) if k16 % w == 0)
    nt, kt = nj // 8, k16 // kw
    if nt * kt * 2 > MAX_WREGS:
        return None
    fixed = (nj + j) * 4 + (batch * j * 4 if mode == "lstm" else 0)  # biases, cell states
    for mt in range(min(-(-batch // 16), MAX_MT), 0, -1):
        rows = 16 * mt
        need = fixed + (kw + 1) * rows * nj * 4  # + partial products, gx
        if need <= smem:
            return Plan(j, hidden // j, kw, nt, kt, mt, need, hidden // j <= FLAG_BLOCKS)
    return None


def plan_backward(batch: int, hidden: int, itemsize: int, sms: int, smem: int = SMEM,
                  max_batch: int | None = None) -> Plan | None:
    """The backward kernel's shape for an LSTM layer of this shape (rnn_persist_bwd), or None where it does not
    apply (batch over ``max_batch``, default :data:`BWD_MAX_BATCH`). A block owns J units as outputs of
    dh = dgates . W_hh, so a warp's k range is a share of 4H and ``nt`` = J / 8; J starts at the smallest multiple
    of 8 with H/J <= ``sms`` blocks and widens by the forward's rule; ``smem`` counts the partial products and the
    block's dh and dc."""
    return _plan_backward(batch, hidden, itemsize, sms, smem, BWD_MAX_BATCH if max_batch is None else max_batch)


@functools.lru_cache(maxsize=256)
def _plan_backward(batch: int, hidden: int, itemsize: int, sms: int, smem: int, max_batch: int) -> Plan | None:
    if hidden % 16 or not 1 <= batch <= max_batch or itemsize != 2:
        return None
    j = next((j for j in range(8, hidden + 1, 8) if hidden % j == 0 and hidden // j <= sms), None)
    best = None if j is None else _shape_backward(batch, hidden, smem, j)
    while best is not None:
        j *= 2
        wider = _shape_backward(batch, hidden, smem, j) if hidden % j == 0 else None
        limit = MAX_TILES_MANY if best.blocks > MANY_BLOCKS else MAX_TILES
        if wider is None or wider.blocks < MIN_BLOCKS or wider.nt * wider.kt * wider.mt > limit:
            break
        best = wider
    return best


def _shape_backward(batch: int, hidden: int, smem: int, j: int) -> Plan | None:
    k16 = 4 * hidden // 16
    kw = max(w for w in range(1, WARPS + 1) if k16 % w == 0)
    nt, kt = j // 8, k16 // kw
    if nt * kt * 2 > MAX_WREGS_BWD:
        return None
    for mt in range(min(-(-batch // 16), MAX_MT), 0, -1):
        need = kw * 16 * mt * j * 4 + 2 * batch * j * 4
        if need <= smem:
            return Plan(j, hidden // j, kw, nt, kt, mt, need, hidden // j <= FLAG_BLOCKS)
    return None


_lock = threading.Lock()
_kernels: dict = {}  # (mode, NT, KW, KT, MT, flags[, "bwd"]) -> RawKernel
_smem_set: dict = {}  # (kernel, device) -> dynamic shared memory allowed so far
_counts: dict = {}  # (device, active rows by time, stream) -> (the stream, the rows as a device array) (_active)
_launches = [0]
_NULL = np.uint64(0)


def launches() -> int:
    """Persistent loops launched in this process (tests and benchmarks check which loop ran)."""
    return _launches[0]


def _kernel(mode: str, pl: Plan, backward: bool = False):
    key = (mode, pl.nt, pl.kwarps, pl.kt, pl.mt, pl.flags) + (("bwd",) if backward else ())
    with _lock:
        if key not in _kernels:
            import cupy
            src = resources.files(__package__).joinpath("rnn_persist.cu").read_text()
            opts = ("-std=c++17", f"-DMODE={MODES[mode]}", f"-DNT={pl.nt}", f"-DKW={pl.kwarps}", f"-DKT={pl.kt}",
                    f"-DMT={pl.mt}", f"-DFLAGS={int(pl.flags)}", f"-DBWD={int(backward)}")
            name = "rnn_persist_bwd" if backward else "rnn_persist_fwd"
            _kernels[key] = cupy.RawKernel(src, name, options=opts, enable_cooperative_groups=True)
        return _kernels[key]


def _prepare(fn, device_id: int, smem: int) -> None:
    key = (fn, device_id)
    if _smem_set.get(key, 0) < smem:
        fn.max_dynamic_shared_size_bytes = smem
        _smem_set[key] = smem


def applies(mode: str, store, B: int, H: int, device) -> Plan | None:
    """The plan for a layer of this shape (no projection) on ``device`` (a cupy.cuda.Device), or None: on only for
    float16 storage, while :data:`ENABLED`."""
    if not ENABLED or np.dtype(store) != np.float16:
        return None
    return plan(mode, B, H, 2, _sms(device))


_SMS: dict = {}


def _sms(device) -> int:
    if device.id not in _SMS:
        _SMS[device.id] = int(device.attributes["MultiProcessorCount"])
    return _SMS[device.id]


def _active(xp, bs, device_id: int):
    """The active rows of each step on the device, kept per device, rows and stream (copied in and freed on the
    stream whose kernels read it: no other stream's kernel reads it before the copy lands or after it is freed);
    inside a stream capture written by fill kernels the graph replays (a copy from host memory cannot be
    captured) and not kept (its memory is the graph's)."""
    stream = xp.cuda.get_current_stream()
    if stream.is_capturing():
        a = xp.empty(len(bs), dtype=np.int32)
        start = 0
        for i in range(1, len(bs) + 1):  # (rows are non-increasing: a fill per run of equal counts)
            if i == len(bs) or bs[i] != bs[start]:
                a[start:i] = bs[start]
                start = i
        return a
    key = (device_id, tuple(bs), *stream_key(stream.ptr))
    with _lock:
        hit = _counts.get(key)
    if hit is None:
        hit = stream, xp.asarray(np.asarray(bs, dtype=np.int32))  # (the stream held: its handle not reused meanwhile)
        with _lock:
            if len(_counts) > 64:
                _counts.clear()
            _counts[key] = hit
    return hit[1]


_syncs: dict = {}  # (device, stream, thread where streams are per thread) -> (the stream, its zeroed sync words)
MAX_SYNCS = 64


def _sync_words(cupy, dev_id: int, sms: int):
    """Zeroed words for the kernel's step wait (at most one flag per SM and a count of blocks done), kept per
    device and stream: a launch leaves them zero (the kernel's last block clears them) and the launches of one
    stream run in order. A capturing stream gets its own (zeroed in the graph). The entry holds the stream, so
    its handle is not reused while the words are."""
    stream = cupy.cuda.get_current_stream()
    if stream.is_capturing():
        return cupy.zeros(sms + 1, dtype=cupy.uint32)
    key = (dev_id, *stream_key(stream.ptr))
    hit = _syncs.get(key)
    if hit is None:
        with _lock:
            if len(_syncs) >= MAX_SYNCS:
                for k, (s, _words) in list(_syncs.items()):
                    if s.done:
                        del _syncs[k]
        hit = _syncs[key] = (stream, cupy.zeros(sms + 1, dtype=cupy.uint32))
    return hit[1]


def run(pl: Plan, mode: str, gx, b_ih, b_hh, w_hh, st, bs, reverse: bool, h0: bool, c0: bool, hn=None,
        cn=None) -> None:
    """The forward loop of rnn_layer.forward_loop on the current stream: writes st.S[1:], st.C[1:] (LSTM; the last
    only without st.gates) and st.gates (when not None); ``gx`` (T, B, G*H) float32 is the input projection alone
    (the biases ``b_ih``, ``b_hh`` in the storage type, or None, are added here); ``h0``/``c0``: st.S[0] / st.C[0]
    hold the initial states (else zeros are written there); ``hn``/``cn``: C-contiguous (B, H) arrays of the
    storage type the final h / c (LSTM) are written to as well, or None."""
    import cupy
    T, B = gx.shape[:2]
    H = st.S.shape[2]
    dev = cupy.cuda.Device()
    fn = _kernel(mode, pl)
    _prepare(fn, dev.id, pl.smem)
    null = _NULL
    fn((pl.blocks,), (THREADS,),
       (gx, null if b_ih is None else b_ih, null if b_hh is None else b_hh, w_hh, st.S,
        null if st.C is None else st.C, null if st.gates is None else st.gates, _active(cupy, bs, dev.id),
        null if hn is None else hn, null if cn is None else cn, _sync_words(cupy, dev.id, _sms(dev)),
        np.int32(T), np.int32(B), np.int32(H), np.int32(reverse), np.int32(not h0), np.int32(not c0)),
       shared_mem=pl.smem)
    _launches[0] += 1


def applies_backward(mode: str, store, B: int, H: int, device) -> Plan | None:
    """The backward plan for an LSTM layer of this shape on ``device``, or None (as :func:`applies`)."""
    if not ENABLED or mode != "lstm" or np.dtype(store) != np.float16:
        return None
    return plan_backward(B, H, 2, _sms(device))


def run_backward(pl: Plan, gates, C, w_hh, dy, dh_n, dc_n, bs, reverse: bool):
    """rnn_layer.backward_loop of an LSTM layer-direction (no projection) in one launch on the current stream:
    ``gates`` (T, B, 4H) and ``C`` (T+1, B, H) float32 as the forward saved them, ``w_hh`` (4H, H) float16
    C-contiguous, ``dy`` (T, B, H) float32 C-contiguous in time order or None, ``dh_n``/``dc_n`` (B, H) float32
    C-contiguous or None. Returns (dgx (T, B, 4H) float32, the same rounded to float16, dh0, dc0 (B, H) float32)."""
    import cupy
    T, B, GH = gates.shape
    H = GH // 4
    dev = cupy.cuda.Device()
    fn = _kernel("lstm", pl, backward=True)
    _prepare(fn, dev.id, pl.smem)
    dgx = cupy.empty((T, B, GH), dtype=cupy.float32)
    g16 = cupy.empty((T, B, GH), dtype=cupy.float16)
    dh0 = cupy.empty((B, H), dtype=cupy.float32)
    dc0 = cupy.empty((B, H), dtype=cupy.float32)
    null = _NULL
    fn((pl.blocks,), (THREADS,),
       (gates, C, w_hh, null if dy is None else dy, null if dh_n is None else dh_n, null if dc_n is None else dc_n,
        _active(cupy, bs, dev.id), dgx, g16, dh0, dc0, _sync_words(cupy, dev.id, _sms(dev)), np.int32(T),
        np.int32(B), np.int32(H), np.int32(reverse)),
       shared_mem=pl.smem)
    _launches[0] += 1
    return dgx, g16, dh0, dc0
