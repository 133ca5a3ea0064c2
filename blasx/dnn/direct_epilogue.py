"""The device route's epilogue (conv_direct.py): the per-output-channel affine map, the residual and the
activation over the whole output in one kernel (runtime.devices.cuda_epilogue), its vectors uploaded once per
stream (direct_cache.device_vector)."""

from __future__ import annotations

import numpy as np

from . import direct_cache
from .geometry import ConvGeometry


def _column(xp, v):
    return v[:, None]


def _cell(xp, v):
    return v.reshape(1, 1)


def _tiled_row(images: int, xp, v):
    return xp.tile(v, images)[None, :]


def epilogue(geo: ConvGeometry, cl: bool, y, affine, residual=None) -> None:
    """The per-channel affine map (``affine`` an epilogue.Affine, or None: none), the ``residual`` (an array laid
    out as y, or None) and the activation over all of y, in one kernel."""
    launch_epilogue(geo, cl, y, epilogue_vectors(geo, cl, y.dtype, affine), residual)


def epilogue_vectors(geo: ConvGeometry, cl: bool, dtype, affine) -> tuple:
    """(scale, shift, activation) the epilogue kernel reads for ``affine``: its vectors on the device, laid out for
    the kernel (uploaded once per stream: direct_cache.device_vector)."""
    import functools
    ct = np.float64 if np.dtype(dtype) == np.float64 else np.float32

    def vec(v, unit):
        if v is None:
            return direct_cache.device_vector(np.full(1, unit), ct, _cell)
        return direct_cache.device_vector(v, ct, _column if cl else functools.partial(_tiled_row, geo.n))
    scale, shift, act = (None, None, None) if affine is None else (affine.scale, affine.shift, affine.activation)
    return vec(scale, 1.0), vec(shift, 0.0), act


def launch_epilogue(geo: ConvGeometry, cl: bool, y, vectors: tuple, residual=None) -> None:
    """The epilogue kernel over y with ``vectors`` (epilogue_vectors') and ``residual``, on the current stream."""
    import cupy

    from ..runtime.devices.cuda_epilogue import affine_activation
    rows, cols, ld = (geo.k, geo.n * geo.p, geo.k) if cl else (geo.p, geo.n * geo.k, geo.p)
    scale, shift, act = vectors
    affine_activation(cupy.cuda.get_current_stream(), (y.data.ptr, ld), rows, cols, y.dtype, scale, shift,
                      None if act is None else act.name, (act.param if act is not None else None) or 0.0,
                      None if residual is None else residual.data.ptr)
