"""``sim``: a stand-in GPU for machines without CUDA, driven by the same StreamWorker as ``cuda``.

Its memory is a numpy byte arena carved by the same offset heap; each in-order stream is a thread,
with events between them; one compute engine and H2D / D2H / peer copy engines, each a lock, so
kernels serialise while copies overlap them. An operation lasts at least its cost-model time
(:class:`SimModel`: ``flops / rate * slow`` or ``bytes / bandwidth``, times ``dilate``). Test hooks:
fault injection (``fail_at``, the ``faults.py`` hooks), memory other libraries hold
(:func:`take_memory`), peer links (``peers``). Timing mode (``timing=1`` or ``data=0``) runs the
heap and the cost model with no data, for predictions on machines one does not have
(``bench/scaling_sim.py``); a :class:`HostLink` caps several sims' host copies together.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from .. import faults
from ..stats import OpRecord
from ..derived import host_tile
from ..latch import Latch
from .base import DerivedSource, DeviceError, HostSource, PeerSource, StreamDevice, register_backend
from .numpy_kernels import KERNELS, kernel_for, round_into


@dataclass(frozen=True)
class SimModel:
    """Rates of a simulated GPU (defaults: small, so that tests run in milliseconds)."""

    rate: float = 4e9  # flop/s of the compute engine
    h2d: float = 8e9  # bytes/s host -> device
    d2h: float = 8e9
    p2p: float = 16e9
    slow: float = 1.0  # every duration is multiplied by this (a slower GPU)
    issue: float = 0.0  # host seconds per launched kernel or copy, spent by the calling thread
    dilate: float = 1.0  # time dilation: every duration and issue time is multiplied by this too
    # (kernel, factor) pairs: that tile kernel runs at factor * rate; the others at rate
    krate: tuple[tuple[str, float], ...] = ()

    def kernel_time(self, flops: float, kernel: str = "gemm") -> float:
        return flops / (self.rate * dict(self.krate).get(kernel, 1.0)) * self.slow * self.dilate

    def copy_time(self, nbytes: int, engine: str) -> float:
        return nbytes / getattr(self, engine) * self.slow * self.dilate

    def issue_time(self) -> float:
        return self.issue * self.dilate


class HostLink:
    """A host-side bandwidth cap shared by the host copies of several sims (``bandwidth`` and ``dilate``
    passed the sim spec's checks): every H2D/D2H copy reserves ``nbytes / bandwidth * dilate`` seconds
    on the link, first come first served, and ends no earlier than its reservation. With ``duplex`` the
    two directions have separate reservations (a PCIe link); else they share one (host memory)."""

    def __init__(self, bandwidth: float, *, dilate: float = 1.0, duplex: bool = False,
                 name: str = "host") -> None:
        self.bandwidth = float(bandwidth)
        self.dilate = float(dilate)
        self.duplex = duplex
        self.name = name
        self._lock = threading.Lock()
        self._free_at = {"h2d": 0.0, "d2h": 0.0}
        self.bytes = {"h2d": 0, "d2h": 0}

    def reserve(self, direction: str, t0: float, nbytes: int) -> float:
        """Book ``nbytes`` in ``direction`` from time ``t0`` on; returns when the booking ends."""
        ch = direction if self.duplex else "h2d"
        with self._lock:
            start = max(t0, self._free_at[ch])
            end = start + nbytes / self.bandwidth * self.dilate
            self._free_at[ch] = end
            self.bytes[direction] += nbytes
        return end

    def __repr__(self) -> str:
        return (f"<HostLink {self.name} {self.bandwidth / 1e9:g} GB/s"
                f"{' per direction' if self.duplex else ''}>")


class TimingLoc:
    """A location in a timing-mode sim's (nonexistent) arena: where and how big, no data."""

    __slots__ = ("offset", "rows", "cols", "nbytes")

    def __init__(self, offset: int, rows: int, cols: int, itemsize: int, ld: int | None = None) -> None:
        self.offset = offset
        self.rows = rows
        self.cols = cols
        self.nbytes = (rows if ld is None else ld) * cols * itemsize

    def __repr__(self) -> str:
        return f"<TimingLoc @{self.offset} {self.rows}x{self.cols} {self.nbytes} B>"


_taken: dict[int, int] = {}  # sim index -> device bytes other allocations hold (take_memory)
_taken_lock = threading.Lock()


class Taken:
    """Device memory held by another allocation on one sim (:func:`take_memory`); ``release``
    gives it back."""

    def __init__(self, index: int, nbytes: int) -> None:
        self.index, self.nbytes = index, nbytes

    def release(self) -> None:
        with _taken_lock:
            if self.nbytes:
                _taken[self.index] -= self.nbytes
                self.nbytes = 0


def take_memory(index: int, nbytes: int) -> Taken:
    """Another library allocates ``nbytes`` on sim ``index`` (a test hook, any time, also mid-call):
    engines opened later size their heap without it, and running ones keep their cache within
    what is left."""
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes: got {nbytes!r}, need an int >= 0")
    with _taken_lock:
        _taken[index] = _taken.get(index, 0) + nbytes
    return Taken(index, nbytes)


def taken(index: int) -> int:
    """Bytes other allocations hold on sim ``index``."""
    return _taken.get(index, 0)


class SimEvent:
    __slots__ = ("_flag", "device")

    def __init__(self, device: "SimDevice") -> None:
        self._flag = Latch()
        self.device = device


class _Stream:
    """An in-order queue of operations run by one thread."""

    def __init__(self, dev: "SimDevice", idx: int) -> None:
        self.dev = dev
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"blasx-{dev.name}-s{idx}",
                                       daemon=getattr(dev, "daemon_threads", False))
        self.thread.start()

    def submit(self, fn) -> None:
        self.q.put(fn)

    def _run(self) -> None:
        # A GPU's kernels signal no floating-point exceptions: numpy's warnings here (which a caller's warning
        # filter can turn into errors, in every thread) would break the device on a call's inf or NaN.
        np.seterr(all="ignore")  # (numpy's error state is per thread)
        while True:
            op = self.q.get()
            if op is None:
                return
            if self.dev.error is not None:
                continue  # a broken device executes nothing more; its events never fire
            try:
                op()
            except BaseException as exc:  # noqa: BLE001 - becomes the device's error, seen by its worker
                if self.dev.error is None:  # keep the first error: later ones are its consequences
                    self.dev.error = exc


@register_backend
class SimDevice(StreamDevice):
    kind = "sim"

    def __init__(self, index: int, *, nstreams: int, cache_bytes: int, name: str,
                 model: SimModel = SimModel(), fail_at: int | None = None,
                 peers: bool = True, trace: bool = True, timing: bool = False,
                 host_link: HostLink | None = None) -> None:
        super().__init__(index, nstreams=nstreams, cache_bytes=cache_bytes, name=name)
        self.model = model
        self.fail_at = fail_at
        self.peers = peers
        self.trace = trace
        self.timing = timing  # data-free timing mode: no arena, no numpy work, host arrays untouched
        self.host_link = host_link  # shared host cap of H2D/D2H copies, or None
        self.arena: np.ndarray | None = None
        self.streams: list[_Stream] = []
        self._engines = {kind: threading.Lock() for kind in ("kernel", "h2d", "d2h", "p2p")}  # one op at a time each
        self._records: list = []
        self._rec_lock = threading.Lock()
        self._kernels_run = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.bytes_p2p = 0

    # -- lifecycle --
    def open(self) -> None:
        free = self.cache_bytes - taken(self.index)  # the heap is the sim's device memory, less what is taken
        if free < 1 << 16:
            raise DeviceError(f"{self.name}: {max(free, 0)} bytes of device memory free of {self.cache_bytes} "
                              f"({taken(self.index)} taken by other allocations); a tile cache needs at least 65536")
        heap = self._make_heap(free)
        # Timing mode: the heap runs over the full size, but no byte of it is allocated.
        try:
            self.arena = None if self.timing else np.empty(heap.capacity, dtype=np.uint8)
        except MemoryError:
            raise MemoryError(f"{self.name}: its {heap.capacity}-byte tile cache (configure's cache_bytes, or the "
                              f"sim's mem=) does not fit in host memory") from None
        self.streams = [_Stream(self, s) for s in range(self.n_all_streams)]

    def close(self) -> None:
        for st in self.streams:
            st.submit(None)
        for st in self.streams:
            st.thread.join()
        self.streams = []
        self.arena = None

    def prepare_call(self, call) -> None:
        faults.at("register", self)  # where a cuda device registers host memory

    # -- topology --
    def can_read_from(self, other: StreamDevice) -> bool:
        return self.peers and isinstance(other, SimDevice) and other.peers

    # -- memory --
    def cache_limit(self) -> int | None:
        t = taken(self.index)
        return self.cache_bytes - t if t else None

    def arena_loc(self, offset: int, rows: int, cols: int, dtype, ld: int | None = None):
        """A column-major view of a heap block (leading dimension ``ld``, default ``rows``)."""
        dt = np.dtype(dtype)
        ld = rows if ld is None else ld
        if self.timing:
            return TimingLoc(offset, rows, cols, dt.itemsize, ld)
        if self.arena is None:  # (numpy would make a fresh, uninitialised buffer: never hand that out as a tile)
            raise RuntimeError(f"{self.name}: closed; its memory is gone")
        return np.ndarray((rows, cols), dtype=dt, buffer=self.arena, offset=offset,
                          strides=(dt.itemsize, ld * dt.itemsize))

    # -- operations --
    def _timed(self, s: int, kind: str, cost: float, work, task=None, nbytes=0, flops=0.0) -> None:
        """Queue an operation on stream ``s``: it holds its engine (``kind``) for at least ``cost``
        seconds (and, for host copies with a shared host link, until its booking there ends), doing
        ``work`` (None: nothing, in timing mode) meanwhile."""
        if not cost <= MAX_OP_SECONDS:  # (the options' product: each within its range, together a hang)
            raise DeviceError(f"{self.name}: one {kind} of {nbytes or flops:.3g} {'bytes' if nbytes else 'flops'} "
                              f"would take {cost:.3g} s, past the longest simulated operation ({MAX_OP_SECONDS:g} "
                              f"s): raise the sim's rate / bandwidths or lower slow, speeds, dilate, krate")
        link = self.host_link if kind in ("h2d", "d2h") else None

        def op():
            if task is not None and kind in ("kernel", "d2h") and task.call.failed:
                return  # a failed call's tile ops are skipped, so a cancel is prompt (loads still fill lines)
            with self._engines[kind]:
                t0 = time.perf_counter()
                if work is not None:
                    work()
                end = t0 + cost
                if link is not None:
                    end = max(end, link.reserve(kind, t0, nbytes))
                left = end - time.perf_counter()
                if left > 0:
                    time.sleep(left)
                t1 = time.perf_counter()
            if self.trace and task is not None:
                rec = OpRecord(self.index, kind, t0, t1, stream=s, nbytes=nbytes, flops=flops,
                               task=task.tid, name=kind)
                with self._rec_lock:
                    self._records.append((task.call.stats, rec))
        self.streams[s].submit(op)

    def copy_in(self, s, dst, src, rows, cols, dtype, task=None):
        faults.at("load", self, task)
        after = None
        if type(src) is HostSource:
            view = None if self.timing else _host_tile(src.operand, src.ref)
            engine = "h2d"
        elif type(src) is DerivedSource:  # made on the stream (a numpy gather), from host memory
            view, engine = None, "h2d"
        elif type(src) is PeerSource:
            view, engine, after = src.loc, "p2p", src.after
        else:
            raise DeviceError(f"{self.name}: sim devices cannot read a {type(src).__name__}")
        nbytes = rows * cols * np.dtype(dtype).itemsize  # in the source's type (a load may convert)
        peer_ok = [True]
        if after is not None:
            # A stream waiting on an event holds no engine (as on a GPU): wait first, then copy.
            def wait_op():
                peer_ok[0] = _wait_event(after)
            self.streams[s].submit(wait_op)

        def work():
            if not peer_ok[0]:
                # The peer broke before its fill completed: read the tile's home instead,
                # so one device's failure never corrupts or stalls another.
                if not self.timing:
                    dst[...] = (_host_tile(src.operand, src.ref) if src.operand.derive is None
                                else host_tile(task.call, src.operand, src.ref))
                self.bytes_in += nbytes
                return
            if not self.timing:
                dst[...] = view if view is not None else src.operand.derive.host_tile(src.source, src.ref)
            if engine == "p2p":
                self.bytes_p2p += nbytes
            else:
                self.bytes_in += nbytes
        self._timed(s, engine, self.model.copy_time(nbytes, engine), work, task, nbytes)
        self._launch_cost()

    def copy_out(self, s, operand, ref, src, task=None):
        faults.at("writeback", self, task)
        view = None if self.timing else _host_tile(operand, ref)
        nbytes = src.nbytes if task is None else task.call.home_nbytes(ref)  # C's type at home

        def work():
            if view is not None:
                try:
                    over = round_into(view, src)  # a mixed call's tile rounds to C's type here
                except Exception as exc:  # noqa: BLE001 - the host memory refused: the call's error
                    if task is None:
                        raise
                    task.call.fail(exc)
                    return
                if over and task is not None:
                    task.call.count_overflow(over)
            self.bytes_out += nbytes
        self._timed(s, "d2h", self.model.copy_time(nbytes, "d2h"), work, task, nbytes)
        self._launch_cost()

    def run_step(self, s, step, call, a, b, c, task=None, out=None):
        faults.at("compute", self, task)
        flops = call.step_flops(step)
        self._kernels_run += 1
        if self.fail_at is not None and self._kernels_run >= self.fail_at:
            n = self._kernels_run

            def work():
                raise DeviceError(f"{self.name}: injected fault at kernel {n}")
        elif self.timing:
            work = None  # the cost model's time only
        else:
            kern = kernel_for(step, call, KERNELS)
            if kern is None:
                raise DeviceError(f"{self.name}: no tile kernel {step.kernel!r}")
            extra = {} if out is None else {"out": out}

            def work():
                kern(step, call.scalars, a, b, c, **extra)
        self._timed(s, "kernel", self.model.kernel_time(flops, step.kernel), work, task, 0, flops)
        self._launch_cost()

    def _launch_cost(self) -> None:
        """The host time of one launch on the real device's API (``SimModel.issue``), on the caller."""
        t = self.model.issue_time()
        if t > 0:
            time.sleep(t)

    def record(self, s):
        ev = SimEvent(self)
        self.streams[s].submit(ev._flag.set)
        return ev

    def wait(self, s, event):
        def op():
            if not _wait_event(event):
                raise DeviceError(f"{self.name}: waited on an event of broken {event.device.name}")
        self.streams[s].submit(op)

    def done(self, event) -> bool:
        if event._flag.is_set():
            return True
        if self.error is not None:
            raise DeviceError(f"{self.name} failed: {self.error!r}") from self.error
        return False

    def sync(self, event) -> None:
        while not event._flag.wait(0.05):
            self.done(event)  # raises once this device broke

    def take_records(self) -> list:
        with self._rec_lock:
            out, self._records = self._records, []
        return out


def _wait_event(event: SimEvent) -> bool:
    """Wait for ``event``; False if its device broke before it fired."""
    while not event._flag.wait(0.05):
        if event.device.error is not None:
            return event._flag.is_set()
    return True


def _host_tile(operand, ref) -> np.ndarray:
    return operand.array[ref.r0:ref.r0 + ref.rows, ref.c0:ref.c0 + ref.cols]


MAX_OP_SECONDS = 3600.0  # the longest one simulated tile operation may take
DEFAULT_SIM_CACHE = 64 << 20  # tile-cache heap per sim when neither mem= nor cache_bytes says


def build_sim_devices(spec, *, streams: int, cache_bytes: int | None = None,
                      trace: bool = True) -> list[SimDevice]:
    """The sim devices of a parsed ``sim`` spec, every option applied; ``cache_bytes`` (configure's)
    and ``mem=`` both set the heap: give one."""
    from ..config import check_sim_heap, sim_factors, sim_settings

    opts = spec.options
    ts = sim_settings(spec)
    check_sim_heap(spec, cache_bytes)
    heap_bytes = cache_bytes if cache_bytes is not None else (ts.mem if ts.mem is not None else DEFAULT_SIM_CACHE)
    rates = {k: float(opts[k]) for k in ("rate", "h2d", "d2h", "p2p") if k in opts}
    fail_dev, fail_at = None, None
    if "fail" in opts:
        d, _, n = opts["fail"].partition("@")
        fail_dev, fail_at = int(d), int(n)
    factors = sim_factors(spec)
    links: list[HostLink | None] = [None] * len(factors)
    if ts.host is not None:
        group = ts.hostgroup or len(factors)
        for g0 in range(0, len(factors), group):
            members = range(g0, min(g0 + group, len(factors)))
            link = HostLink(ts.host, dilate=ts.dilate, duplex=ts.hostduplex,
                            name=f"host[{members[0]}..{members[-1]}]")
            for i in members:
                links[i] = link
    devs = []
    for i, f in enumerate(factors):
        model = SimModel(**rates, slow=f, issue=ts.issue, dilate=ts.dilate, krate=ts.krate)
        name = f"sim:{i}" + (f" (slow={f:g})" if f != 1 else "")
        devs.append(SimDevice(i, nstreams=streams, cache_bytes=heap_bytes, name=name, model=model,
                              fail_at=fail_at if i == fail_dev else None,
                              peers=opts.get("peers", "1") == "1", trace=trace,
                              timing=ts.timing, host_link=links[i]))
    return devs
