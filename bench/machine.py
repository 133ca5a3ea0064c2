"""The machine a benchmark runs on: host, GPU and library versions for its report (collect_env), its GPU ids
(resolve_gpus), and the GPUs' names for titles and result-file tags (machine_name, gpu_tag)."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import socket
import subprocess
import sys
import traceback
from typing import Sequence

import numpy as np

from .cublasxt import cublas_version, find_libcublas


# --------------------------------------------------------------------------- sizes and errors
# a size in GiB and an exception in one line: how the reports give memory and failures (bench.gemm's too)


def gib(nbytes: float) -> float:
    return nbytes / 2**30


def _describe(e: BaseException) -> str:
    where = ""
    tb = traceback.extract_tb(e.__traceback__) if e.__traceback__ else []
    if tb:
        where = f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno})"
    return f"{type(e).__name__}: {e}{where}"


# --------------------------------------------------------------------------- environment


def _run_text(cmd: list[str], timeout: float = 20) -> str | None:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _host_mem_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return gib(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return None


def resolve_gpus(requested: list[int] | None) -> list[int]:
    """The benchmark's device ids: all visible ones by default; exits on unknown ids."""
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        raise SystemExit(f"cannot list the GPUs through CuPy: {_describe(e)}")
    gpus = list(range(count)) if requested is None else requested
    bad = [g for g in gpus if g >= count]
    if not gpus or bad:
        raise SystemExit(f"--gpus {gpus}: {count} GPU(s) visible")
    return gpus


def _gpu_env(gpus: Sequence[int]) -> dict:
    import cupy
    rt = cupy.cuda.runtime
    # load CuPy's libcublas now, so that find_libcublas (which prefers a loaded one) binds
    # cuBLAS-XT from that same library rather than from a second copy
    with contextlib.suppress(Exception), cupy.cuda.Device(gpus[0]):
        cupy.cuda.device.get_cublas_handle()
    env: dict = {"cupy": cupy.__version__,
                 "cuda_driver": _cuda_version(rt.driverGetVersion()),
                 "cuda_runtime": _cuda_version(rt.runtimeGetVersion()),
                 "gpus": [], "peer_access": {}}
    for d in gpus:
        props = rt.getDeviceProperties(d)
        name = props.get("name", b"?")
        env["gpus"].append({
            "id": d, "name": name.decode() if isinstance(name, bytes) else str(name),
            "mem_gib": gib(props.get("totalGlobalMem", 0)),
            "cc": f"{props.get('major', '?')}.{props.get('minor', '?')}",
            "sms": props.get("multiProcessorCount"),
            "pci_bus": props.get("pciBusID")})
    for i in gpus:
        for j in gpus:
            if i != j:
                env["peer_access"][f"{i}->{j}"] = bool(rt.deviceCanAccessPeer(i, j))
    return env


def collect_env(gpus: Sequence[int]) -> dict:
    """Machine and software versions; every probe is optional."""
    env: dict = {"host": socket.gethostname(), "platform": platform.platform(),
                 "python": platform.python_version(), "numpy": np.__version__,
                 "cpu": _cpu_model(), "cpus": os.cpu_count(), "host_mem_gib": _host_mem_gib()}
    with contextlib.suppress(Exception):
        import scipy
        env["scipy"] = scipy.__version__
    try:
        env.update(_gpu_env(gpus))
    except Exception as e:
        env["cupy_error"] = _describe(e)
    try:
        env["libcublas"] = find_libcublas()
        env["cublas"] = cublas_version()
    except Exception as e:
        env["libcublas_error"] = _describe(e)
    try:
        import blasx
        env["blasx"] = getattr(blasx, "__version__", "?")
    except Exception as e:
        env["blasx_error"] = _describe(e)
    here = os.path.dirname(os.path.abspath(__file__))
    env["git_commit"] = _run_text(["git", "-C", here, "rev-parse", "--short", "HEAD"])
    env["git_dirty"] = bool(_run_text(["git", "-C", here, "status", "--porcelain"]))
    env["nvidia_smi"] = _run_text(["nvidia-smi", "--query-gpu=index,name,driver_version,"
                                   "pci.bus_id,clocks.max.sm,clocks.max.mem,power.limit",
                                   "--format=csv"])
    env["nvidia_smi_topo"] = _run_text(["nvidia-smi", "topo", "-m"])
    return env


# --------------------------------------------------------------------------- GPU names


def gpu_names() -> list[str]:
    """The GPUs' names from `nvidia-smi -L` (['NVIDIA H200', ...]); [] where there is none."""
    names: list[str] = []
    try:
        res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        if res.returncode == 0:
            for line in res.stdout.splitlines():
                if line.startswith("GPU "):
                    names.append(line.split(":", 1)[1].split("(UUID")[0].strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return names


def gpu_tag(count: int, names: list[str] | None = None) -> str:
    """The default result-file tag: 'h200x2' for 2 GPUs named 'NVIDIA H200', 'gpux2' if unnamed."""
    names = gpu_names() if names is None else names
    found = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", names[0]) if names else None  # H200, A100, L40S
    model = found.group(1).lower() if found else "gpu"
    return f"{model}x{count}"


def machine_name() -> str:
    """'2x NVIDIA H200' from `nvidia-smi -L`, else from CuPy, else the host name and 'no GPU'."""
    names = gpu_names()
    if not names and "cupy" in sys.modules:  # only if CuPy is already in use: never start CUDA here
        try:
            rt = sys.modules["cupy"].cuda.runtime
            for i in range(rt.getDeviceCount()):
                name = rt.getDeviceProperties(i).get("name", b"?")
                names.append(name.decode() if isinstance(name, bytes) else str(name))
        except Exception:  # noqa: BLE001 - no driver / no GPU: fall through
            names = []
    host = socket.gethostname()
    if not names:
        return f"{host} (no GPU found)"
    groups: dict[str, int] = {}
    for nm in names:
        groups[nm] = groups.get(nm, 0) + 1
    return f"{host}: " + ", ".join(f"{k}x {nm}" for nm, k in groups.items())
