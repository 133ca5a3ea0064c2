"""The weight gradient's forms on the device route (conv_direct.py plans the forward's):

- im2col (``weight_steps``): col(X) gathered per chunk of images, then dW^T += col dY^T;
- shifted (channels-last, stride 1, no zero insertion, groups 1, a kernel window): X copied into the zero-padded
  grid ``xp`` and dY into ``yw``, the same grid with zeros outside the outputs; then per kernel tap
  dW_t^T (C x K) += xp shifted by the tap (C x wide rows) . yw^T, one GEMM a tap (batching a kernel row's taps
  in one strided-batched GEMM gets far slower cuBLAS kernels). No im2col matrix: the scratch is about x and dY once.
  Its wide rows pair each tap with pixels outside its windows against yw's zeros, so a non-finite value of x
  reaches every tap's gradient as NaN (im2col: only the taps whose windows hold it).
- implicit (igemm_weight.py: Hopper GPUs, channels-last float16 or bfloat16, groups 1, C and K multiples of 64):
  one kernel gathers X's im2col tiles into shared memory and multiplies them there with dY's, no col buffer;
  pixel splits' float32 partials summed in order by a second kernel.
- winograd (3x3 stride 1, strict float32 or float64; winograd.py): the forward's transforms transposed, a^2
  GEMMs at k = the tiles; by default where C and K are both 64 or more (float64: 16; winograd.pays).
- batched (NCHW pointwise, groups 1): an image's X_n (C x P) and dY_n (K x P) lie as they are; strided-batched
  GEMMs make the images' dW_n^T = X_n dY_n^T in the accumulation type (``dwp``: one partial sum an image while
  they fit ``PARTIALS_BYTES``, else images share them, beta 1), one GEMM sums them (``dwp`` times a vector of
  ones). im2col copies X and dY pixel-major first.

``weight_form`` picks one as ``conv_direct.forward_form`` picks the forward's: a force (``conv_direct.FORM``),
the find-db's entry for the problem's bwd-weight key, else implicit where it applies to a kernel window over at
least ``IMPLICIT_MIN_PIXELS`` output pixels, batched where it applies to maps of at least
``BATCHED_MIN_PIXELS[itemsize]`` pixels (or ``BATCHED_SMALL_PIXELS`` with C * K at most ``BATCHED_SMALL_CK``),
else im2col (the shifted form is taken only where the find step measured it faster).
"""

from __future__ import annotations

from math import prod

import numpy as np

from ..runtime import dtypes
from . import conv_direct as cd
from . import finddb, igemm, igemm_weight
from .geometry import ConvGeometry

# the batched form by default from maps this large, by element size (fewer: its per-image GEMMs are thin) ...
BATCHED_MIN_PIXELS = {2: 784, 4: 196}
# ... and from BATCHED_SMALL_PIXELS where C * K is at most BATCHED_SMALL_CK (im2col's copies, ~C + K, weigh more
# against its GEMM there)
BATCHED_SMALL_PIXELS = 196
BATCHED_SMALL_CK = 1 << 18
# the implicit kernel by default on a window over this many output pixels (fewer, as on ResNet-50's 7x7 maps:
# its blocks are too few to fill the GPU, and the im2col GEMM runs instead)
IMPLICIT_MIN_PIXELS = 8192
PARTIALS_BYTES = 16 << 20  # the batched form's partial sums kept within this (they stay in a GPU's L2)


def batched_applies(geo: ConvGeometry) -> bool:
    """Whether the batched form can run ``geo`` (NCHW operands): a pointwise convolution, groups 1."""
    return geo.groups == 1 and cd.pointwise(geo)


def weight_forms(geo: ConvGeometry, layout: str = "nchw", dtype=None, capable: bool | None = None,
                 math: str | None = None) -> tuple[str, ...]:
    """The weight-gradient forms that can run ``geo`` in ``layout`` (and ``dtype`` and ``math``: dtype None,
    the implicit and winograd forms left out), im2col first; ``capable``: whether the GPU runs the implicit
    kernel (None: CuPy's current device is asked)."""
    from . import winograd
    if dtype is not None and winograd.applies(geo, dtype, math):
        return weight_forms(geo, layout, None) + ("winograd",)
    if layout == "cl":
        out = ("im2col",) + (("shifted",) if cd.shifted_applies(geo) else ())
        if dtype is not None and igemm_weight.applies(geo, dtype, True):
            if capable is None:
                capable = igemm.current_capable()
            out += ("implicit",) if capable else ()
        return out
    return ("im2col",) + (("batched",) if batched_applies(geo) else ())


def weight_form(geo: ConvGeometry, dtype, force: str | None = None, layout: str = "nchw", math: str | None = None,
                device=None, capable: bool | None = None) -> str:
    """The weight-gradient form of ``geo``: ``force`` where it applies, else the find-db's, else implicit on a
    window over many pixels, winograd where winograd.pays (C and K large enough), batched on large maps where
    they apply, else im2col."""
    applicable = weight_forms(geo, layout, dtype, capable, math)
    if len(applicable) == 1:
        return "im2col"
    if force in applicable:
        return force
    stored = finddb.stored_form(geo, dtype, layout, math, device, direction="bwd-weight")
    if stored in applicable:
        return stored
    if "implicit" in applicable and prod(geo.kernel) > 1 and geo.n * geo.p >= IMPLICIT_MIN_PIXELS:
        return "implicit"
    from . import winograd
    if "winograd" in applicable and winograd.pays(geo, dtype, "bwd-weight"):
        return "winograd"
    large = geo.p >= BATCHED_MIN_PIXELS.get(np.dtype(dtype).itemsize, max(BATCHED_MIN_PIXELS.values())) or \
        (geo.p >= BATCHED_SMALL_PIXELS and geo.c * geo.k <= BATCHED_SMALL_CK)
    return "batched" if "batched" in applicable and large else "im2col"


def weight_steps(geo: ConvGeometry, cl: bool, parts: list, pad: tuple | None = None) -> list:
    """dW (``dw``) = sum over images of dY_n col_n^T by chunks ``parts``, accumulating after the first;
    ``pad``: col's rows padded (conv_direct.reduction_pad): dW is ``(K, rows)`` then (its padding's columns zero:
    the aligned GEMM runs faster than one of crs rows), in the order (r..., c) in both layouts."""
    G, kg, crs, p, K = geo.groups, geo.kg, geo.crs, geo.p, geo.k
    steps: list = []
    if cl and cd.pointwise(geo):
        return [cd.Gemm(("x", g * geo.cg), ("dy", g * kg), ("dw", g * kg * crs), cd.OP_N, cd.OP_T, crs, kg,
                        geo.n * p, geo.c, K, crs, 0, 0, 0, 1, 0.0) for g in range(G)]
    for i, (n0, nb) in enumerate(parts):
        beta = 0.0 if i == 0 else 1.0
        if not cl:
            steps.append(cd.CopyDy(n0, nb))
        if pad is not None:  # (one group) dW^T (rows x K, order (r..., c), rows past crs zero) += col dY^T
            rows, run = pad
            steps.append(cd.Gather(0, n0, nb, p * rows, 1, rows, False, run))
            steps.append(cd.Gemm(("col", 0), ("dy", n0 * p * K), ("dw", 0), cd.OP_N, cd.OP_T, rows, K, nb * p, rows,
                                 K, rows, 0, 0, 0, 1, beta) if cl else
                         cd.Gemm(("col", 0), ("dyc", 0), ("dw", 0), cd.OP_N, cd.OP_N, rows, K, nb * p, rows, nb * p,
                                 rows, 0, 0, 0, 1, beta))
            continue
        for g in range(G):
            if cl:  # dW_g^T (crs x kg) += col (crs x nb*P) dY_g^T
                steps.append(cd.Gather(g, n0, nb, p * crs, 1, crs, False))
                steps.append(cd.Gemm(("col", 0), ("dy", n0 * p * K + g * kg), ("dw", g * kg * crs), cd.OP_N,
                                     cd.OP_T, crs, kg, nb * p, crs, K, crs, 0, 0, 0, 1, beta))
            else:  # col (nb*P x crs, ld nb*P); dyc_g (nb*P x kg)
                steps.append(cd.Gather(g, n0, nb, p, nb * p, 1, True))
                steps.append(cd.Gemm(("col", 0), ("dyc", g * kg * nb * p), ("dw", g * kg * crs), cd.OP_T,
                                     cd.OP_N, crs, kg, nb * p, nb * p, nb * p, crs, 0, 0, 0, 1, beta))
    return steps


def weight_scratch(geo: ConvGeometry, cl: bool, pad: tuple | None = None) -> int:
    """Scratch elements per image of the weight plan (col, and dY's copy for NCHW); ``pad`` as weight_steps'."""
    if cl and cd.pointwise(geo):
        return 0
    return (geo.crs if pad is None else pad[0]) * geo.p + (0 if cl else geo.k * geo.p)


def batched_slots(geo: ConvGeometry, nb: int, acc_itemsize: int) -> int:
    """How many partial sums a chunk of ``nb`` images keeps: one an image while they fit ``PARTIALS_BYTES``,
    else as many as fit (at least one); the images past them add into them (beta 1)."""
    return max(1, min(nb, PARTIALS_BYTES // (geo.c * geo.k * acc_itemsize)))


def batched_steps(geo: ConvGeometry, parts: list, slots: int | None = None) -> list:
    """dW (``dw``, the ``(K, C)`` matrix) by chunks ``parts``: a vector of ones after the ``slots`` partial sums
    in ``dwp`` (default: the largest chunk's image count); per chunk, its images' dW_n^T (C x K) by
    strided-batched GEMMs over X and dY where they lie, ``slots`` images a GEMM (image j into partial j mod
    slots), then dW^T (C*K x 1) += dwp (C*K x slots) . ones."""
    C, K, P = geo.c, geo.k, geo.p
    slots = slots or max(nb for _, nb in parts)
    ones = slots * C * K
    steps: list = [cd.Ones("dwp", ones, slots)]
    for i, (n0, nb) in enumerate(parts):
        for r in range(0, nb, slots):
            steps.append(cd.Gemm(("x", (n0 + r) * C * P), ("dy", (n0 + r) * K * P), ("dwp", 0), cd.OP_T, cd.OP_N,
                                 C, K, P, P, P, C, C * P, K * P, C * K, min(slots, nb - r), 0.0 if r == 0 else 1.0))
        used = min(slots, nb)
        steps.append(cd.Gemm(("dwp", 0), ("dwp", ones), ("dw", 0), cd.OP_N, cd.OP_N, C * K, 1, used, C * K, used,
                             C * K, 0, 0, 0, 1, 0.0 if i == 0 else 1.0))
    return steps


def batched_scratch(geo: ConvGeometry, nb: int, dtype) -> int:
    """The batched plan's ``dwp`` (``nb`` partial sums and the ones, in the accumulation type) in elements of
    ``dtype``, even (a view in the wider type needs whole elements)."""
    dt = np.dtype(dtype)
    acc = np.dtype(dtypes.gemm_of(dt).compute)
    n = -(-nb * (geo.c * geo.k + 1) * acc.itemsize // dt.itemsize)
    return n + n % 2


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


def implicit_steps(geo: ConvGeometry, dtype, budget: int, sms: int = cd.IMPLICIT_SMS) -> tuple[list, dict]:
    """(steps, scratch) of the implicit form: one ImplicitWeight step; its splits' float32 partials in ``part``
    (in elements of ``dtype``), as many splits as fit ``budget`` bytes (none: dW written by the kernel)."""
    cfg = igemm_weight.config(geo, sms)
    per_split = geo.k * geo.crs * 4
    split = max(1, min(cfg.split, budget // per_split))
    step = cd.ImplicitWeight(igemm_weight.type_name(dtype), cfg._replace(split=split))
    return [step], ({"part": split * per_split // np.dtype(dtype).itemsize} if split > 1 else {})
