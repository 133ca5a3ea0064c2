"""``cpu``: BLASX's CPU worker device (Section IV-C.2).

It solves one whole task at a time with the host's multithreaded BLAS, reading tiles in place
(the host is its memory: no cache, copies or streams). threadpoolctl limits the BLAS threads while
calls run, so every GPU worker keeps a core; in auto mode only once it runs a probe or a task
(``engage``), so a call it takes nothing of pays nothing. ``probe`` times a small GEMM once per
dtype: the admission rule's first estimate of its rate.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from .. import dtypes
from ..derived import host_tile
from ..stats import OpRecord
from .base import HostDevice, register_backend
from .numpy_kernels import KERNELS, round_into


@register_backend
class CpuDevice(HostDevice):
    kind = "cpu"

    def __init__(self, index: int, *, name: str = "cpu", threads: int | None = None, trace: bool = True,
                 auto: bool = False) -> None:
        super().__init__(index, name=name)
        self.threads = threads
        self.trace = trace
        self.auto = auto  # beside GPUs: takes tasks by the admission rule, not by demand
        self._limiter = None
        self._users = 0
        self._lock = threading.Lock()

    def open(self) -> None:
        pass

    def close(self) -> None:
        with self._lock:
            if self._limiter is not None:
                self._restore()
            self._users = 0

    # Per-call BLAS thread limits, reference counted over concurrent calls.
    def prepare_call(self, call) -> None:
        if self.threads is None:
            return
        with self._lock:
            self._users += 1
            call.cpu_user = True  # finish_call undoes only what ran here
            if self._users == 1 and not self.auto:
                self._limit()

    def _limit(self) -> None:
        from threadpoolctl import threadpool_limits
        _release_blas_control()
        self._limiter = threadpool_limits(limits=self.threads, user_api="blas")

    def _restore(self) -> None:
        _release_blas_control()  # the thread restoring may not be the one that limited
        self._limiter.restore_original_limits()
        self._limiter = None
        _release_blas_control()

    def engage(self) -> None:
        """Auto mode: limit the BLAS threads now (a task or probe is about to run here), until
        the last call running ends. A no-op when they are limited already or never are."""
        if self.threads is None or self._limiter is not None:
            return
        with self._lock:
            if self._users > 0 and self._limiter is None:
                self._limit()

    def probe(self, dtype, n: int = 256, runs: int = 3) -> tuple[float, float]:
        """(flops, seconds) of the fastest of ``runs`` n x n x n GEMMs in ``dtype`` on this
        device's BLAS threads: the admission rule's first estimate of the CPU's rate."""
        self.engage()
        row = dtypes.gemm_of(dtype)
        dt = row.compute if row.reduced else row.dtype  # half, bfloat16, int8: computed in float32/float64
        if dt.kind == "i":
            dt = np.dtype(np.float64)
        rng = np.random.default_rng(0)
        a = np.asfortranarray(rng.standard_normal((n, n))).astype(dt)
        b = np.asfortranarray(rng.standard_normal((n, n))).astype(dt)
        best = float("inf")
        for _ in range(runs):
            t0 = time.perf_counter()
            np.matmul(a, b)
            best = min(best, time.perf_counter() - t0)
        return 2.0 * row.flop_factor * n ** 3, best

    def finish_call(self, call) -> None:
        if self.threads is None or not getattr(call, "cpu_user", False):
            return
        with self._lock:
            call.cpu_user = False
            self._users -= 1
            if self._users == 0 and self._limiter is not None:
                self._restore()

    def run_task(self, task) -> None:
        """Solve one C tile in place on the host (all steps, then the write)."""
        call = task.call
        t0 = time.perf_counter()
        # The host is this device's memory: compute in C's own tile, no copy in or out.
        # (Only this task writes it; TRSM reads only tiles whose tasks have finished.)
        home = acc = _tile(call, task.c)
        if call.mixed:  # accumulate in the wider type (half: float32), round once at the end
            acc = np.empty(home.shape, dtype=call.acc_dtype, order="F")
            if task.load_c:
                acc[...] = home
        if task.load_c and task.c_init is not None:
            acc[...] = _tile(call, task.c_init)  # TRSM: start from B's tile (a no-op when X is B)
        for step in task.steps:
            # (TF32 math is a GPU's: the CPU computes float32 in IEEE arithmetic)
            KERNELS[step.kernel](step, call.scalars, _tile(call, step.a), _tile(call, step.b), acc)
        if call.epilogue is not None:
            call.epilogue(self, 0, acc, task)
            if call.wb_dtype != acc.dtype:
                acc = acc.view(call.wb_dtype)  # an epilogue that converts does so in place
        if acc is not home:
            call.count_overflow(round_into(home, acc))
        t1 = time.perf_counter()
        st = call.stats
        st.count(self.index, "tasks")
        st.count(self.index, "steps", len(task.steps))
        st.count(self.index, "flops", task.flops)
        if self.trace:
            st.add_record(OpRecord(self.index, "host", t0, t1, stream=0, flops=task.flops, task=task.tid, name="task"))


def _tile(call, ref):
    """Tile ``ref`` of ``call`` (None: None): a view of host memory, or a derived tile's values."""
    return None if ref is None else host_tile(call, call.operands[ref.slot], ref)


def _release_blas_control() -> None:
    """Let the calling thread set OpenBLAS's (process-wide) thread count. threadpoolctl lets only
    the first thread that set it set it again, silently ignoring the others, until that thread
    ends or clears it; here the limit is set by whichever thread starts a call or (auto mode) by
    the CPU worker, and restored by the thread that ends the last call."""
    try:
        from threadpoolctl import OpenBLASController
    except ImportError:
        return
    clear = getattr(OpenBLASController, "clear_controlling_thread", None)
    if clear is not None:
        clear(force=True)


def default_threads(n_gpu_workers: int) -> int:
    """BLAS threads for the CPU worker: every core but one per GPU worker (at least 1)."""
    return max(1, (os.cpu_count() or 1) - n_gpu_workers)
