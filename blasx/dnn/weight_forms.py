"""The weight gradient's forms on the device route (conv_direct.py plans the forward's):

- im2col (``conv_direct.weight_steps``): col(X) gathered per chunk of images, then dW^T += col dY^T;
- shifted (channels-last, stride 1, no zero insertion, groups 1, a kernel window): X copied into the zero-padded
  grid ``xp`` and dY into ``yw``, the same grid with zeros outside the outputs; then per kernel tap
  dW_t^T (C x K) += xp shifted by the tap (C x wide rows) . yw^T, one GEMM a tap (batching a kernel row's taps
  in one strided-batched GEMM gets far slower cuBLAS kernels). No im2col matrix: the scratch is about x and dY once.
  Its wide rows pair each tap with pixels outside its windows against yw's zeros, so a non-finite value of x
  reaches every tap's gradient as NaN (im2col: only the taps whose windows hold it).

``weight_form`` picks one as ``conv_direct.forward_form`` picks the forward's: a force (``conv_direct.FORM``),
the find-db's entry for the problem's bwd-weight key, else im2col (the shifted form is taken only where the
find step measured it faster).
"""

from __future__ import annotations

from math import prod

import numpy as np

from . import conv_direct as cd
from . import finddb
from .geometry import ConvGeometry


def weight_forms(geo: ConvGeometry, layout: str = "nchw") -> tuple[str, ...]:
    """The weight-gradient forms that can run ``geo`` in ``layout``, im2col first."""
    return ("im2col",) + (("shifted",) if layout == "cl" and cd.shifted_applies(geo) else ())


def weight_form(geo: ConvGeometry, dtype, force: str | None = None, layout: str = "nchw", math: str | None = None,
                device=None) -> str:
    """The weight-gradient form of ``geo``: ``force`` where it applies, else the find-db's, else im2col."""
    applicable = weight_forms(geo, layout)
    if len(applicable) == 1:
        return "im2col"
    if force in applicable:
        return force
    stored = finddb.stored_form(geo, dtype, layout, math, device, direction="bwd-weight")
    return stored if stored in applicable else "im2col"


def shifted_scratch(geo: ConvGeometry) -> int:
    """Scratch elements per image of the shifted weight plan (``xp`` and ``yw``)."""
    return prod(cd.padded_size(geo)) * (geo.c + geo.k)


def shifted_steps(geo: ConvGeometry, parts: list) -> list:
    """dW (``dw``, the ``(K, taps * C)`` channels-last matrix) by chunks ``parts``: Pad x into xp, Crop dY
    into yw (both cleared before the first chunk), then one GEMM per kernel tap (beta 1 after the first chunk)."""
    ip, C, K = cd.padded_size(geo), geo.c, geo.k
    taps = prod(geo.kernel)
    steps: list = []
    for i, (n0, nb) in enumerate(parts):
        beta = 0.0 if i == 0 else 1.0
        steps += [cd.Pad(n0, nb, i == 0), cd.Crop(n0, nb, False, i == 0)]
        rows = cd.wide_rows(geo, nb)
        for t, tap in enumerate(np.ndindex(*geo.kernel)):  # dW_t^T (C x K, ld taps*C) += xp_t (C x rows) yw^T
            off = cd._flat([v * d for v, d in zip(tap, geo.dilation)], ip)
            steps.append(cd.Gemm(("xp", off * C), ("yw", 0), ("dw", t * C), cd.OP_N, cd.OP_T, C, K, rows, C, K,
                                 taps * C, 0, 0, 0, 1, beta))
    return steps
