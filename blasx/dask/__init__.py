"""blasx on Dask distributed: level-3 BLAS on dask arrays, each output block on one worker's engine.

>>> from distributed import Client, LocalCluster
>>> import blasx.dask as bd, dask.array as da
>>> client = Client(LocalCluster(n_workers=2, threads_per_worker=1))
>>> bd.configure(client, devices="sim:2")        # each worker process: one blasx engine
>>> a = da.random.random((4000, 3000), chunks=1000)
>>> c = bd.matmul(a, a.T)                          # lazy; also bd.gemm, bd.symm, ..., bd.trsm
>>> with bd.offload():                             # dask.array's matmul, @, dot, tensordot on blasx
...     d = (a @ a.T).compute()

Install with ``pip install 'blasx[dask]'``.
"""

import contextlib

try:
    import dask.array  # noqa: F401 - blasx.dask is an optional extra
except ModuleNotFoundError as _e:
    raise ModuleNotFoundError(f"blasx.dask needs dask[array] and distributed ({_e}); install them with "
                              f"pip install 'blasx[dask]'", name=_e.name) from _e

from .offload import offload
from .level3 import hemm, her2k, herk, symm, syr2k, syrk, trmm, trsm
from .routines import gemm, matmul
from .worker import BlasxPlugin, memory_stats

__all__ = ["configure", "gemm", "matmul", "symm", "hemm", "syrk", "herk", "syr2k", "her2k", "trmm", "trsm",
           "offload", "memory_peaks", "BlasxPlugin"]


def configure(client, **settings) -> None:
    """Run ``blasx.configure(**settings)`` in every worker process of ``client``'s cluster, now and
    in workers that join or restart later (a worker plugin). ``devices`` may name the worker:
    ``"cuda:{name}"``. Without it each worker starts blasx's default engine on its first task."""
    from ..runtime.config import parse_devices
    devices = settings.get("devices")
    if isinstance(devices, str):
        parse_devices(devices.format(name=0) if "{" in devices else devices)
    try:
        client.register_plugin(BlasxPlugin(**settings))
    except BaseException:  # (a worker could not start these settings: workers joining later must not take them)
        with contextlib.suppress(Exception):
            client.unregister_worker_plugin(BlasxPlugin.name)
        raise


def memory_peaks(client, reset: bool = True) -> dict:
    """Each worker's peak of bytes held by blasx.dask tasks (output blocks alive, the running
    tasks' accumulators, dependency blocks and storage pieces) since the last reset:
    {worker address: bytes}. ``reset`` starts the next measurement."""
    return {w: s["peak"] for w, s in client.run(memory_stats, reset=reset).items()}
