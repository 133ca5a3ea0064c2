"""A CUDA kernel's own operation text compiled for the host by the C++ compiler on the path, so the CPU
tests run the code the GPUs run (the epilogue and activation forms, the conv gather)."""

from __future__ import annotations

import ctypes
import pathlib
import shutil
import subprocess
import tempfile

import numpy as np

try:
    from ml_dtypes import bfloat16
except ImportError:
    bfloat16 = None

# CUDA's bit casts and isnan, for the operation texts that use them
SHIMS = """#include <cmath>
#include <cstring>
using std::isnan;
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
"""


def compile_host(functions: list[str], directory=None) -> ctypes.CDLL | None:
    """The shared library of ``functions`` (C++ definitions, after SHIMS), or None without a compiler."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        return None
    d = pathlib.Path(directory or tempfile.mkdtemp())
    (d / "k.cpp").write_text("\n".join([SHIMS, *functions]))
    subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-o", str(d / "k.so"), str(d / "k.cpp")], check=True,
                   capture_output=True)
    return ctypes.CDLL(str(d / "k.so"))


def tile_types() -> dict:
    """numpy dtype -> the C++ type a kernel's operation sees it as (bfloat16 as its bits, where ml_dtypes is)."""
    types = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
    if bfloat16 is not None:
        types[np.dtype(bfloat16)] = "unsigned short"
    return types
