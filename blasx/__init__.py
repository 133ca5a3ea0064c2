"""blasx: level-3 BLAS on every GPU of a server, out of core, from Python.

>>> import blasx, numpy as np
>>> a, b = np.random.rand(3000, 2000), np.random.rand(2000, 1000)
>>> c = blasx.gemm(1.0, a, b)          # scipy.linalg.blas.dgemm semantics
>>> d = blasx.matmul(a, b)             # numpy semantics
>>> print(blasx.last_profile().report())

Devices come from ``blasx.configure(devices=...)`` or ``$BLASX_DEVICES``
(``cuda``, ``cuda:0,1``, ``sim:4``, ``cpu``); by default all CUDA GPUs, else the CPU.
"""

from .level3 import gemm, last_profile, matmul
from .runtime.devices.base import DeviceError
from .session import configure, engine, shutdown

__version__ = "0.1.0"

__all__ = ["configure", "shutdown", "engine", "gemm", "matmul", "last_profile", "DeviceError"]
