"""The contenders of bench.gemm (blasx, cuBLAS-XT, in-core CuPy, NumPy) and the higher-precision reference
they are checked against, with the host<->device copies both use; CuPy is imported inside functions only."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import time
from dataclasses import dataclass, field

import numpy as np

from blasx.runtime.dtypes import GEMM_BY_PREFIX as BY_PREFIX

from . import gemm_lp
from .cublasxt import CublasXt
from .gemm_problem import Problem
from .machine import _describe, gib

#: the contenders, in table order (and --contenders' default)
CONTENDER_ORDER = ("blasx", "cublasxt", "cupy", "numpy")


# --------------------------------------------------------------------------- GPU helpers


def _to_device(host: np.ndarray):
    """A device copy of a contiguous host array, same layout (synchronous cudaMemcpy)."""
    import cupy
    d = cupy.empty(host.shape, host.dtype, order="F" if host.flags.f_contiguous else "C")
    _h2d(d, host)
    return d


def _h2d(dev, host: np.ndarray) -> None:
    assert dev.nbytes == host.nbytes and dev.dtype == host.dtype
    dev.data.copy_from_host(ctypes.c_void_p(host.ctypes.data), host.nbytes)


def _d2h(host: np.ndarray, dev) -> None:
    assert dev.nbytes == host.nbytes and dev.dtype == host.dtype
    assert dev.flags.f_contiguous == host.flags.f_contiguous or host.ndim < 2
    dev.data.copy_to_host(ctypes.c_void_p(host.ctypes.data), host.nbytes)


def _free_device_pool() -> None:
    with contextlib.suppress(Exception):
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()


def device_free_bytes(device: int) -> int:
    import cupy
    _free_device_pool()
    with cupy.cuda.Device(device):
        free, _total = cupy.cuda.runtime.memGetInfo()
    return free


def _reference_gpu(p: Problem, ref_dtype: np.dtype, device: int) -> np.ndarray:
    import cupy
    from cupy import cublas

    def up(host):
        d = _to_device(host)
        return d if d.dtype == ref_dtype else d.astype(ref_dtype, order="F")

    def compute() -> np.ndarray:        # device arrays live only in this frame
        d_a, d_b = up(p.a), up(p.b)
        if p.c_init is not None:
            d_c = up(p.c_init)
        else:
            d_c = cupy.empty((p.m, p.n), ref_dtype, order="F")
        cublas.gemm("N", "N", d_a, d_b, out=d_c, alpha=p.alpha, beta=p.beta)
        cupy.cuda.Device(device).synchronize()
        ref = np.empty((p.m, p.n), dtype=ref_dtype, order="F")
        _d2h(ref, d_c)
        return ref

    try:
        with cupy.cuda.Device(device):
            return compute()
    finally:
        _free_device_pool()


def _reference_cpu(p: Problem, ref_dtype: np.dtype) -> np.ndarray:
    ref = p.a.astype(ref_dtype) @ p.b.astype(ref_dtype)
    ref *= p.alpha
    if p.c_init is not None:
        ref += p.beta * p.c_init.astype(ref_dtype)
    return np.asfortranarray(ref)


def compute_reference(p: Problem) -> tuple[np.ndarray, dict]:
    """The reference result in higher precision: cuBLAS on the first GPU when A, B, C fit in
    its free memory at the reference precision, else NumPy on the CPU."""
    ref_dtype = BY_PREFIX[p.dtype].wide
    if p.ref_rows is not None:  # a row sample, in float64 on the CPU
        t0 = time.perf_counter()
        ref = gemm_lp.sample_reference(p.a, p.b, p.ref_rows, p.alpha, p.beta, p.c_init)
        return ref, {"dtype": "float64", "where": "cpu", "rows": len(p.ref_rows), "sampled": "first, last, random",
                     "seconds": time.perf_counter() - t0}
    device = p.gpus[0]
    need = (p.m * p.k + p.k * p.n + p.m * p.n) * ref_dtype.itemsize + max(p.a.nbytes, p.b.nbytes)
    info: dict = {"dtype": str(ref_dtype)}
    t0 = time.perf_counter()
    ref = None
    try:
        free = device_free_bytes(device)
        if need < 0.9 * free:
            ref = _reference_gpu(p, ref_dtype, device)
            info["where"] = f"cuda:{device}"
        else:
            info["gpu_skipped"] = f"needs {gib(need):.1f} GiB, {gib(free):.1f} GiB free"
    except Exception as e:          # no GPU, or it failed: fall back to the CPU
        info["gpu_error"] = _describe(e)
    if ref is None:
        ref = _reference_cpu(p, ref_dtype)
        info["where"] = "cpu"
    info["seconds"] = time.perf_counter() - t0
    return ref, info


# --------------------------------------------------------------------------- contenders


@dataclass
class Outcome:
    """One run: seconds per label (a run may time several things), the result array."""
    times: dict[str, float]
    result: np.ndarray | None
    extra: dict = field(default_factory=dict)


class Contender:
    """One implementation under test. Subclasses set `name` and implement `run`."""
    name = "?"

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def variants(self, p: Problem) -> list:
        return [None]

    def labels(self, variant) -> list[str]:
        return [self.name]

    def skip_reason(self, p: Problem) -> str | None:
        return None

    def run(self, p: Problem, variant) -> Outcome:
        raise NotImplementedError

    def end_mode(self) -> None:
        """Release what was held for one (problem, mode)."""

    def close(self) -> None:
        """Release everything (end of the benchmark)."""


class BlasxContender(Contender):
    """blasx.gemm (scipy.linalg.blas semantics) over all benchmark GPUs."""
    name = "blasx"

    def __init__(self, args):
        super().__init__(args)
        self._blasx = None
        self._error: str | None = None

    def _module(self, p: Problem):
        if self._error:
            raise RuntimeError(self._error)
        if self._blasx is None:
            try:
                import blasx
                blasx.configure(devices="cuda:" + ",".join(map(str, p.gpus)),
                                tile=self.args.tile or None)
            except Exception as e:
                self._error = f"blasx import/configure failed: {_describe(e)}"
                raise RuntimeError(self._error) from e
            self._blasx = blasx
        return self._blasx

    def run(self, p, variant):
        bx = self._module(p)
        t0 = time.perf_counter()
        if p.mode == "fresh":  # as a caller writes it: a new result (C's values in it where beta != 0)
            result = bx.gemm(p.alpha, p.a, p.b, beta=p.beta, c=None if p.c_init is None else p.c_out, math=p.math)
        else:
            result = bx.gemm(p.alpha, p.a, p.b, beta=p.beta, c=p.c_out, overwrite_c=True, math=p.math)
        seconds = time.perf_counter() - t0
        extra = {"result_is_c": result is p.c_out}
        try:
            extra["profile"] = bx.last_profile().summary()
        except Exception as e:
            extra["profile_error"] = _describe(e)
        return Outcome({"blasx": seconds}, result, extra)

    def close(self):
        if self._blasx is not None:
            self._blasx, bx = None, self._blasx
            bx.shutdown()


class CublasXtContender(Contender):
    """cuBLAS-XT over all benchmark GPUs, one variant per block dim; a handle per
    (block, pinning) lives for one mode (its creation is not timed)."""
    name = "cublasxt"

    def __init__(self, args):
        super().__init__(args)
        self._handles: dict[tuple, CublasXt] = {}

    def variants(self, p):
        return list(self.args.xt_blocks)

    def skip_reason(self, p):
        if gemm_lp.reduced(p.dtype, p.math):
            return "cuBLAS-XT has no half, bfloat16, int8 or TF32 gemm"
        return None

    def labels(self, block):
        return [f"cublasxt[b={block}]"]

    def pinning(self, mode: str) -> bool:
        return {"on": True, "off": False}.get(self.args.xt_pinning, mode != "registered")

    def _handle(self, p: Problem, block: int) -> CublasXt:
        key = (tuple(p.gpus), block, self.pinning(p.mode))
        if key not in self._handles:
            self._handles[key] = CublasXt(p.gpus, block_dim=block, pinning=key[2])
        return self._handles[key]

    def run(self, p, block):
        xt = self._handle(p, block)
        t0 = time.perf_counter()
        xt.gemm(p.alpha, p.a, p.b, p.beta, p.c_out)
        seconds = time.perf_counter() - t0
        return Outcome({self.labels(block)[0]: seconds}, p.c_out,
                       {"block": block, "pinning": xt.pinning})

    def end_mode(self):
        handles, self._handles = list(self._handles.values()), {}
        for h in handles:
            h.close()

    close = end_mode


class CupyContender(Contender):
    """In-core cuBLAS gemm through CuPy on the first benchmark GPU: "cupy" times the kernel
    alone with CUDA events (the in-core ceiling), "cupy+copies" adds the host->device copies
    of A, B (and C when beta != 0) and the device->host copy of C (perf_counter)."""
    name = "cupy"

    def labels(self, variant):
        return ["cupy", "cupy+copies"]

    def skip_reason(self, p):
        need = p.a.nbytes + p.b.nbytes + p.c_out.nbytes
        free = device_free_bytes(p.gpus[0])
        if need > 0.95 * free:
            return (f"A, B, C need {gib(need):.1f} GiB on cuda:{p.gpus[0]}, "
                    f"{gib(free):.1f} GiB free")
        return None

    def run(self, p, variant):
        import cupy
        dev = cupy.cuda.Device(p.gpus[0])
        try:
            with dev:
                if gemm_lp.reduced(p.dtype, p.math):  # cublasGemmEx (CuPy has no bfloat16 type)
                    kernel, total = gemm_lp.incore_gemm_ex(p, dev.id, p.math)
                else:
                    kernel, total = self._timed(p, dev)
        finally:
            _free_device_pool()         # the device arrays died with _timed's frame
        return Outcome({"cupy": kernel, "cupy+copies": total}, p.c_out, {"device": dev.id})

    @staticmethod
    def _timed(p: Problem, dev) -> tuple[float, float]:
        import cupy
        from cupy import cublas
        d_a, d_b, d_c = (cupy.empty(x.shape, x.dtype, order="F") for x in (p.a, p.b, p.c_out))
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        dev.synchronize()
        t0 = time.perf_counter()
        _h2d(d_a, p.a)
        _h2d(d_b, p.b)
        if p.c_init is not None:
            _h2d(d_c, p.c_out)          # the poisoned output holds the pristine C
        start.record()
        cublas.gemm("N", "N", d_a, d_b, out=d_c, alpha=p.alpha, beta=p.beta)
        end.record()
        end.synchronize()
        _d2h(p.c_out, d_c)
        total = time.perf_counter() - t0
        return cupy.cuda.get_elapsed_time(start, end) / 1e3, total

    def end_mode(self):
        _free_device_pool()

    close = end_mode


class NumpyContender(Contender):
    """numpy a @ b on the CPU (its BLAS, all cores), with alpha and beta applied."""
    name = "numpy"

    def skip_reason(self, p):
        if gemm_lp.reduced(p.dtype, p.math):
            return "numpy has no fast half, bfloat16, int8 or TF32 matmul"
        if max(p.m, p.n, p.k) > self.args.numpy_max_n:
            return f"max(M,N,K) > --numpy-max-n {self.args.numpy_max_n}"
        return None

    def run(self, p, variant):
        t0 = time.perf_counter()
        if p.c_init is None:
            np.matmul(p.a, p.b, out=p.c_out)
            if p.alpha != 1:
                p.c_out *= p.alpha
        else:
            prod = p.a @ p.b
            prod *= p.alpha
            p.c_out *= p.beta
            p.c_out += prod
            del prod
        return Outcome({"numpy": time.perf_counter() - t0}, p.c_out)


CONTENDERS: dict[str, type[Contender]] = {
    "blasx": BlasxContender,
    "cublasxt": CublasXtContender,
    "cupy": CupyContender,
    "numpy": NumpyContender,
}
