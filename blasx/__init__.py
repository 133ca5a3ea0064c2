"""blasx: level-3 BLAS on every GPU of a server, out of core, from Python.

>>> import blasx, numpy as np
>>> a, b = np.random.rand(3000, 2000), np.random.rand(2000, 1000)
>>> c = blasx.gemm(1.0, a, b)          # scipy.linalg.blas.dgemm semantics
>>> d = blasx.matmul(a, b)             # numpy semantics (batches, broadcasting); also blasx.dot, blasx.tensordot
>>> s = blasx.dsyrk(1.0, a)            # every level-3 routine, scipy.linalg.blas names and semantics
>>> h = blasx.matmul(a.astype(np.float16), b.astype(np.float16))  # half/bfloat16/int8: blasx.precision
>>> print(blasx.last_profile().report())
>>> blasx.tune(sizes=[8192, 16384])     # measure the tile sizes once; later calls use the winners

>>> from blasx.linalg import blas    # stands in for scipy.linalg.blas (level 3 on blasx)
>>> with blasx.offload(threshold=1e10):   # unmodified `a @ b`, np.dot, scipy.linalg.blas.dgemm ... on blasx
...     e = a @ b

Devices come from ``blasx.configure(devices=...)`` or ``$BLASX_DEVICES``
(``cuda``, ``cuda:0,1``, ``sim:4``, ``cpu``); by default all CUDA GPUs, else the CPU.
"""

from .blas3 import PREFIXED as _PREFIXED, hemm, her2k, herk, symm, syr2k, syrk, trmm, trsm
from . import linalg
from .level3 import PREFIXED as _PREFIXED_GEMM, gemm, last_profile
from .numpy_api import dot, matmul, tensordot
from . import precision
from .precision import Float16OverflowWarning, gemm_int8, quantize
from .offload import offload, offload_disable, offload_enable, offload_threshold  # the module: importlib.import_module("blasx.offload")
from .runtime.devices.base import DeviceError
from .session import configure, engine, reset, shutdown
from .tune import tune  # the function; the module is importlib.import_module("blasx.tune")

__version__ = "0.1.0"

globals().update(_PREFIXED_GEMM)  # sgemm, dgemm, cgemm, zgemm (level3)
globals().update(_PREFIXED)  # ssymm, dsyrk, zherk, ... (made from a table in blas3)

__all__ = ["configure", "shutdown", "reset", "engine", "gemm", "matmul", "dot", "tensordot", "last_profile", "DeviceError",
           "tune", "precision", "quantize", "gemm_int8", "Float16OverflowWarning",
           "symm", "hemm", "syrk", "herk", "syr2k", "her2k", "trmm", "trsm", "linalg",
           "offload", "offload_enable", "offload_disable", "offload_threshold", *sorted(_PREFIXED_GEMM),
           *sorted(_PREFIXED)]


def __getattr__(name):
    """``blasx.dnn`` is imported on first use: BLAS users do not pay for the DNN layers' modules."""
    if name == "dnn":
        import importlib
        return importlib.import_module(".dnn", __name__)
    raise AttributeError(f"module 'blasx' has no attribute {name!r}")
