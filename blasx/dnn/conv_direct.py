"""The device route of blasx.dnn: a convolution whose operands are CuPy arrays of one GPU, run there without
tile tasks, all on the current stream, then the fused epilogue over the whole output, in a form (``forward_form``):

- im2col: a chunk of images gathered into one col buffer (one kernel per chunk and group), then one
  cuBLAS GEMM per chunk and group (strided-batched over images for NCHW output);
- shifted (stride 1, no zero insertion, groups 1): a chunk copied once into a zero-padded
  channels-last buffer ``xp`` (N, *Ip, C), then per kernel tap one GEMM with K = C whose A is ``xp``
  shifted by the tap's offset (no gather) into a "wide" output ``yw`` over the padded grid, whose
  valid part is copied into y; the wide columns past the output are computed and dropped;
- implicit (igemm.py: Hopper GPUs, channels-last float16, bfloat16 or TF32, groups 1): one kernel
  gathers each im2col tile into shared memory and multiplies it there (no col buffer), the whole batch;
- winograd (winograd.py: 3x3 stride 1, strict float32 or float64): F(m x m, 3x3), m = WINOGRAD_TILE, at k = C.

``FORM`` forces a form where it applies (None: the find-db's entry, else the heuristic), from ``BLASX_CONV_FORM``
at import: one of ``FORMS`` (also weight_forms.py's ``batched``, phases.py's ``col2im`` and ``phases``).

Plans are pure data (``forward_steps``, weight_forms' ``weight_steps``): buffers are named and addressed by
element offsets, so a numpy stand-in can run them on the CPU (tests). Buffers: ``x`` (X's compact memory),
``w`` (the weight matrix ``(K, CRS)`` row-major, reduction order (c, r, s), or (r, s, c) channels-last),
``y`` (Y's memory), ``col`` (the im2col scratch), ``dy`` (dY's memory), ``dyc`` (a chunk of NCHW dY as
``(K, images, P)``), ``dw`` (dW as ``(K, CRS)`` row-major, in the accumulation type); the shifted
form's ``wt`` (the weight as ``(K, taps, C)`` row-major), ``xp`` and ``yw`` (see ``Pad`` and ``Crop``); the
batched weight form's ``dwp`` (partial sums and a vector of ones, in the accumulation type; ``Ones``).
"""

from __future__ import annotations

import os
import threading
from math import prod
from typing import NamedTuple

import numpy as np

from ..threadlocal import setting
from . import call_graph, direct_cache, finddb, gather_kernel, igemm, transpose_kernel
from .geometry import ConvGeometry

OP_N, OP_T = 0, 1
SPLIT_FLOPS = 1e12  # below this a CuPy call stays on its own GPU even where the engine has several
BUDGET_FRACTION = 4  # the scratch of one call takes at most free device memory / this
ROUTE = None  # tests: "direct" or "engine" forces a route for CuPy operands ("engine": host batches too); None chooses
_local = threading.local()  # .on_own_gpu: this thread's CuPy calls stay on their operands' GPU (on_own_gpu())
FORMS = tuple(f for f in finddb.FORMS if f != "depthwise")  # the forms FORM can force (depthwise: its own route)
FORM = os.environ.get("BLASX_CONV_FORM") or None  # forces the form where it applies
SHIFTED_MIN_C = 64  # cuBLAS runs K = C well from here
LAYOUT_MIN_C = 8  # NCHW operands with fewer input or output channels are convolved as they lie (device_layout)
LAYOUT_MIN_PIXELS = 128  # ... and NCHW 1x1s with this many output pixels an image
INSERTED_MIN_PIXELS = 256  # ... or this many, for a 1x1 over a zero-inserted input (strided backward-data)
WEIGHT_MIN_PIXELS = {2: 0, 4: 128}  # an NCHW weight gradient's window converted from this many output pixels
SHIFTED_MAX_WIDE = 1.5  # the wide grid's pixels (computed) per output pixel (kept), at most: the taps' extra work
WINOGRAD_TILE = 4  # the winograd form's m x m output tiles: F(2x2, 3x3) or F(4x4, 3x3) (winograd.py)


class Gather(NamedTuple):
    """col's element (image j of the chunk, reduction row r, output pixel p) of group ``group`` for
    images ``n0 .. n0 + nb - 1`` at ``j * on + r * orr + p * op`` of ``col``; threads run over p
    fastest (``pixel_fastest``, NCHW x) or over r fastest (channels-last x). ``run`` > 1: a thread writes
    ``run`` consecutive r of a pixel (the run gather: orr 1, the order (r..., c) in either layout), whose rows
    are ``op`` long, zero past CRS (``reduction_pad``)."""

    group: int
    n0: int
    nb: int
    on: int
    orr: int
    op: int
    pixel_fastest: bool
    run: int = 1


class Gemm(NamedTuple):
    """``C_b = op_a(A_b) op_b(B_b) + beta C_b`` (column-major) for b < batch; operands as (buffer,
    element offset), ``A_b`` at offset + b * stride_a, likewise B and C."""

    a: tuple
    b: tuple
    c: tuple
    op_a: int
    op_b: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int
    batch: int
    beta: float


class CopyDy(NamedTuple):
    """``dyc = dy[n0:n0 + nb]`` as (K, nb, P): NCHW dY's images side by side per channel."""

    n0: int
    nb: int


class Pad(NamedTuple):
    """``xp``'s images 0 .. nb-1, as (nb, *Ip, C), get x's images n0 .. n0 + nb - 1 at ``pad_lo`` in
    the padded grid (``pad_views``); ``clear``: all of ``xp`` is zeroed first (its border stays zero)."""

    n0: int
    nb: int
    clear: bool


class Crop(NamedTuple):
    """The valid part of the wide output ``yw`` and y's images n0 .. n0 + nb - 1 (``crop_views``):
    ``to_y`` copies yw's into y; else y's into yw (a residual, before GEMMs with beta 1; ``clear``: all of
    yw is zeroed first)."""

    n0: int
    nb: int
    to_y: bool
    clear: bool = False


def pointwise(geo: ConvGeometry) -> bool:
    """1x1, stride 1, unpadded, no zero insertion: col(X) is X itself."""
    return all(v == 1 for v in (*geo.kernel, *geo.stride, *geo.insert)) and not any(geo.pad_lo) and \
        geo.out_size == geo.in_size


def device_layout(lay: str, geo: ConvGeometry, dtype, direction: str = "fwd") -> str:
    """The layout the device route convolves operands of layout ``lay`` in: an NCHW 2-D convolution with a
    kernel window (groups 1, not float64) in channels-last, x converted on the device before and y after
    (transpose_kernel; its forms run faster there: the implicit kernels, the gather's 16-byte units). Staying
    NCHW: a 1x1 with ``LAYOUT_MIN_PIXELS`` output pixels an image or more (a GEMM on x where it lies, or a gather
    of the strided pixels; NCHW's per-image GEMMs are too narrow below; ``INSERTED_MIN_PIXELS`` over a
    zero-inserted input: a strided backward-data's col2im); a layer with fewer than ``LAYOUT_MIN_C`` input or
    output channels (a first layer, ``reduction_pad``; its backward-data's large image copy costs more than the
    form gains); one whose x or y is the same memory in both layouts. ``geo``: the geometry the route runs; a
    weight gradient (``direction`` "bwd-weight") converts windows only, on maps of ``WEIGHT_MIN_PIXELS`` or more."""
    if lay != "nchw" or geo.nd != 2 or geo.groups != 1 or np.dtype(dtype) == np.float64:
        return lay
    window, pixels = prod(geo.kernel) > 1, prod(geo.out_size)
    if direction == "bwd-weight":
        if not window or pixels < WEIGHT_MIN_PIXELS.get(np.dtype(dtype).itemsize, 0):
            return lay
    elif not window and pixels >= (INSERTED_MIN_PIXELS if max(geo.insert) > 1 else LAYOUT_MIN_PIXELS):
        return lay
    if min(geo.k, prod(geo.in_size), pixels) == 1 or min(geo.c, geo.k) < LAYOUT_MIN_C:
        return lay
    return "cl"


def run_layout(lay: str, geo: ConvGeometry, dtype, copy_bytes: int, direction: str = "fwd") -> str:
    """:func:`device_layout`, where its copies (``copy_bytes`` of scratch) fit the current device's scratch
    budget (direct_cuda.budget, free memory read again, a full call's cost that replays skip; inside a graph
    capture the last reading); else ``lay`` (operands convolved where they lie need no copies)."""
    to = device_layout(lay, geo, dtype, direction)
    if to != lay:
        from . import direct_cuda
        if copy_bytes > direct_cuda.budget(refresh=not direct_cache.capture_active()):
            return lay
    return to


def layout_scratch(name: str, shape: tuple, dtype, lay: str):
    """An uninitialised device array of ``shape`` in layout ``lay``: scratch ``name`` of the call
    (direct_cuda.scratch: the Workspace's buffer where there is one)."""
    from . import direct_cuda, host_batch
    flat = direct_cuda.scratch(name, prod(shape), dtype).view(np.dtype(dtype))
    return host_batch.in_layout(flat, tuple(shape), lay)


def in_layout(x, name: str, lay: str):
    """A copy of the compact device array ``x`` in the other layout ``lay``, in scratch ``name``."""
    out = layout_scratch(name, x.shape, x.dtype, lay)
    transpose_kernel.copy(out, x, lay == "cl")
    return out


def chunks(n: int, per_image: int, budget: int) -> list[tuple[int, int]]:
    """(first image, images) chunks of ``n`` images, each's scratch (``per_image`` bytes an image)
    within ``budget`` bytes (one image at least)."""
    nb = n if per_image == 0 else max(1, min(n, budget // per_image))
    return [(n0, min(nb, n - n0)) for n0 in range(0, n, nb)]


def reduction_pad(geo: ConvGeometry, cl: bool, itemsize: int) -> tuple[int, int] | None:
    """(rows, run) where col's rows are padded: an ungrouped convolution with a kernel window over at most
    PAD_C_MAX input channels whose CRS elements are not a whole number of RUN_BYTES; its rows padded with zeros
    to ``rows`` (a multiple of ``run`` = RUN_BYTES / itemsize: the run gather's 16-byte stores, and aligned rows
    for the GEMMs; the forward's weight matrix padded alike, ``pad_reduction``). Else None. Padded rows are in
    the channels-last reduction order (r..., c) whatever x's layout (the run gather reads x by its strides)."""
    run = gather_kernel.RUN_BYTES // itemsize
    if geo.groups != 1 or geo.c > PAD_C_MAX or run <= 1 or geo.crs % run == 0 or pointwise(geo) \
            or any(z != 1 for z in geo.insert):
        return None
    return -(-geo.crs // run) * run, run


def forward_steps(geo: ConvGeometry, cl: bool, parts: list, beta: float, pad: tuple | None = None) -> list:
    """y = conv(x, w) (+ beta y) by chunks ``parts`` of images (ignored for a pointwise conv); ``pad``: col's
    rows and the weight matrix's padded (``reduction_pad``)."""
    G, kg, crs, p, K, C = geo.groups, geo.kg, geo.crs, geo.p, geo.k, geo.c
    if pad is not None:  # (one group) col: a pixel's padded row of ``rows`` elements after another
        rows, run = pad
        return [step for n0, nb in parts for step in (
            Gather(0, n0, nb, p * rows, 1, rows, False, run),
            Gemm(("w", 0), ("col", 0), ("y", n0 * p * K), OP_T, OP_N, K, nb * p, rows, rows, rows, K, 0, 0, 0, 1,
                 beta) if cl else  # Y (K x nb*P, ld K) = W^T col; NCHW: per image Y_n^T (P x K, ld P) = col_n^T W
            Gemm(("col", 0), ("w", 0), ("y", n0 * K * p), OP_T, OP_N, p, K, rows, rows, rows, p, p * rows, 0, K * p,
                 nb, beta))]
    steps: list = []
    if pointwise(geo):
        for g in range(G):
            if cl:  # Y_g (kg x N*P, ld K) = W_g^T X_g (cg x N*P, ld C)
                steps.append(Gemm(("w", g * kg * crs), ("x", g * geo.cg), ("y", g * kg), OP_T, OP_N, kg, geo.n * p,
                                  crs, crs, C, K, 0, 0, 0, 1, beta))
            else:  # per image: Y_n,g^T (P x kg, ld P) = X_n,g^T (P x cg) W_g
                steps.append(Gemm(("x", g * geo.cg * p), ("w", g * kg * crs), ("y", g * kg * p), OP_N, OP_N, p, kg,
                                  crs, p, crs, p, C * p, 0, K * p, geo.n, beta))
        return steps
    for n0, nb in parts:
        for g in range(G):
            if cl:  # col (crs x nb*P, ld crs); Y_g's columns of the chunk
                steps.append(Gather(g, n0, nb, p * crs, 1, crs, False))
                steps.append(Gemm(("w", g * kg * crs), ("col", 0), ("y", n0 * p * K + g * kg), OP_T, OP_N, kg,
                                  nb * p, crs, crs, crs, K, 0, 0, 0, 1, beta))
            else:  # col_j (P x crs, ld P) per image; Y_j,g^T = col_j W_g, batched over the chunk's images
                steps.append(Gather(g, n0, nb, crs * p, p, 1, True))
                steps.append(Gemm(("col", 0), ("w", g * kg * crs), ("y", n0 * K * p + g * kg * p), OP_N, OP_N, p,
                                  kg, crs, p, crs, p, crs * p, 0, K * p, nb, beta))
    return steps


def forward_scratch(geo: ConvGeometry, form: str = "im2col", pad: tuple | None = None) -> int:
    """Scratch elements per image of the forward plan of ``form`` (0: none); ``pad`` as forward_steps'."""
    if form == "shifted":
        return prod(padded_size(geo)) * (geo.c + geo.k)
    return 0 if pointwise(geo) else (geo.crs if pad is None else pad[0]) * geo.p


# ---------------------------------------------------------------- the shifted form

def shifted_applies(geo: ConvGeometry) -> bool:
    """Whether the shifted form can run ``geo``: stride 1, no zero insertion, one group, taps > 1."""
    return all(v == 1 for v in (*geo.stride, *geo.insert)) and geo.groups == 1 and prod(geo.kernel) > 1


def forward_form(geo: ConvGeometry, dtype, force: str | None = None, layout: str = "nchw", math: str | None = None,
                 device=None, capable: bool | None = None) -> str:
    """The forward form among those that apply to ``geo`` (``forms``), by precedence: ``force`` (FORM,
    BLASX_CONV_FORM); the find-db's entry for the problem in ``layout`` and ``math`` on GPU ``device``
    (None: CuPy's current one; finddb.stored_form); the heuristic:

    - implicit where it applies, the convolution has a kernel window and at least IMPLICIT_MIN_PIXELS output
      pixels (fewer leave the kernel's grid short of the GPU's SMs; the im2col GEMM is faster there); for a
      1x1 stride-1 convolution (a plain GEMM on x) only where calls are issued one by one (no CUDA graphs:
      call_graph.ENABLED off, no Workspace) and igemm.pays_pointwise says its launch beats cuBLAS's call on
      the host; never for a strided 1x1 (its gather is a cheap subsample);
    - shifted where C >= SHIFTED_MIN_C (cuBLAS's k = C efficient), a row of C elements is 16-byte aligned
      (every tap's A pointer and ld) and the wide grid is at most SHIFTED_MAX_WIDE times the output pixels,
      for tensor-core GEMMs (float16, bfloat16, TF32) inside a Workspace only: a network's worker, whose calls
      replay from CUDA graphs, pays the forms' GPU time alone (the taps' GEMMs take less of it on large maps), a
      plain call pays the host time of the taps' launches too (the one im2col GEMM wins there);
    - winograd where it applies (strict float32 and float64) and winograd.pays (enough channels);
    - else im2col.

    ``capable``: whether the GPU runs the implicit kernel (None: CuPy's current device is asked)."""
    if force is not None and force not in FORMS:
        raise ValueError(f"conv_direct.FORM (or BLASX_CONV_FORM): got {force!r}; allowed: None, {', '.join(FORMS)}")
    applicable = forms(geo, dtype, layout, math, capable)
    if len(applicable) == 1:
        return "im2col"
    if force in applicable:
        return force
    stored = finddb.stored_form(geo, dtype, layout, math, device)
    if stored in applicable:
        return stored
    from . import winograd
    if "implicit" in applicable and _implicit_pays(geo, dtype):
        return "implicit"
    if "winograd" in applicable and winograd.pays(geo, dtype):
        return "winograd"
    if "shifted" not in applicable:
        return "im2col"
    wide = np.prod(padded_size(geo)) / geo.p
    size = np.dtype(dtype).itemsize
    ok = (size < 4 or math == "tf32") and direct_cache.workspace() is not None and geo.c >= SHIFTED_MIN_C and \
        geo.c * size % 16 == 0 and wide <= SHIFTED_MAX_WIDE  # tensor-core types in a Workspace
    return "shifted" if ok else "im2col"


IMPLICIT_MIN_PIXELS = 8192  # output pixels (N * P) from which the implicit kernel beats im2col's gather + GEMM


def _implicit_pays(geo: ConvGeometry, dtype) -> bool:
    """The heuristic's implicit rule (see forward_form)."""
    if pointwise(geo):
        graphs = call_graph.ENABLED or direct_cache.workspace() is not None
        return not graphs and igemm.pays_pointwise(geo, dtype)
    return prod(geo.kernel) > 1 and geo.n * geo.p >= IMPLICIT_MIN_PIXELS


def forms(geo: ConvGeometry, dtype, layout: str = "nchw", math: str | None = None,
          capable: bool | None = None) -> tuple[str, ...]:
    """The forward forms that can run ``geo`` in ``dtype``, ``layout``, ``math``, im2col first."""
    from . import winograd
    out = ("im2col",) + (("shifted",) if shifted_applies(geo) else ())
    if igemm.applies(geo, dtype, layout == "cl", math) and (igemm.current_capable() if capable is None else capable):
        out += ("implicit",)
    return out + (("winograd",) if winograd.applies(geo, dtype, math) else ())


def padded_size(geo: ConvGeometry) -> tuple[int, ...]:
    """The padded grid Ip (stride 1): the output plus the dilated kernel's reach, per spatial dim."""
    return tuple(o + d * (k - 1) for o, d, k in zip(geo.out_size, geo.dilation, geo.kernel))


def _flat(index, size) -> int:
    """Row-major flat index of ``index`` in a grid of ``size``."""
    return int(np.ravel_multi_index(tuple(index), tuple(size)))


def wide_rows(geo: ConvGeometry, nb: int) -> int:
    """Wide rows a chunk of ``nb`` images computes: up to its last valid output pixel, so the last
    tap's A ends at the last element of the chunk's ``xp`` (no trailing rows read)."""
    ip = padded_size(geo)
    return (nb - 1) * prod(ip) + _flat([o - 1 for o in geo.out_size], ip) + 1


def wide_ld(geo: ConvGeometry, cl: bool, nb: int) -> int:
    """yw's leading dimension: K for channels-last ((rows, K) row-major), else the chunk's wide
    grid rounded up to 8 elements ((K, ld) row-major, each channel's column aligned)."""
    return geo.k if cl else -(-nb * prod(padded_size(geo)) // 8) * 8


def shifted_buffers(geo: ConvGeometry, cl: bool, nb: int) -> dict:
    """Scratch elements of ``xp`` and ``yw`` for chunks of at most ``nb`` images."""
    cells = nb * prod(padded_size(geo))
    return {"xp": cells * geo.c, "yw": cells * geo.k if cl else geo.k * wide_ld(geo, cl, nb)}


def shifted_steps(geo: ConvGeometry, cl: bool, parts: list, beta: float) -> list:
    """y = conv(x, wt) (+ beta y) by chunks ``parts``: Pad, (Crop of a residual into yw,) one GEMM
    per tap over the chunk's wide rows (beta after the first tap 1), Crop into y."""
    ip, C, K = padded_size(geo), geo.c, geo.k
    taps = prod(geo.kernel)
    offsets = [_flat([t * d for t, d in zip(tap, geo.dilation)], ip) for tap in np.ndindex(*geo.kernel)]
    steps: list = []
    for i, (n0, nb) in enumerate(parts):
        steps.append(Pad(n0, nb, i == 0))
        if beta:
            steps.append(Crop(n0, nb, False))
        m, ld = wide_rows(geo, nb), wide_ld(geo, cl, nb)
        for t, off in enumerate(offsets):
            b = beta if t == 0 else 1.0
            if cl:  # yw^T (K x m, ld K) += wt_t (K x C, stored C x K ld taps*C) xp_off^T (C x m, ld C)
                steps.append(Gemm(("wt", t * C), ("xp", off * C), ("yw", 0), OP_T, OP_N, K, m, C, taps * C, C, K,
                                  0, 0, 0, 1, b))
            else:  # yw (m x K, ld) += xp_off (m x C, stored C x m ld C) wt_t^T (C x K, ld taps*C)
                steps.append(Gemm(("xp", off * C), ("wt", t * C), ("yw", 0), OP_T, OP_N, m, K, C, C, taps * C, ld,
                                  0, 0, 0, 1, b))
        steps.append(Crop(n0, nb, True))
    return steps


def pad_views(geo: ConvGeometry, cl: bool, s: Pad, x, xp) -> tuple:
    """(destination in ``xp``, source in ``x``) of step ``s``, both (nb, *spatial, C); x and xp flat
    arrays (numpy or CuPy) of x's memory and the xp buffer."""
    nd, C, ip = geo.nd, geo.c, padded_size(geo)
    xv = x.reshape(geo.n, *geo.in_size, C) if cl else x.reshape(geo.n, C, *geo.in_size)
    xv = xv[s.n0:s.n0 + s.nb]
    if not cl:
        xv = xv.transpose(0, *range(2, nd + 2), 1)
    dst = xp[:s.nb * prod(ip) * C].reshape(s.nb, *ip, C)
    dsl, ssl = [], []
    for lo, size, pad in zip(geo.pad_lo, geo.in_size, ip):  # input position u sits at u + lo
        v0, u0 = max(lo, 0), max(-lo, 0)
        ext = max(0, min(size - u0, pad - v0))
        dsl.append(slice(v0, v0 + ext))
        ssl.append(slice(u0, u0 + ext))
    return dst[(slice(None), *dsl, slice(None))], xv[(slice(None), *ssl, slice(None))]


def crop_views(geo: ConvGeometry, cl: bool, s: Crop, y, yw) -> tuple:
    """(y's images of step ``s``, yw's valid part) in y's layout; y and yw flat arrays (numpy or CuPy)."""
    nd, K, ip, out = geo.nd, geo.k, padded_size(geo), geo.out_size
    cells = s.nb * prod(ip)
    valid = tuple(slice(0, o) for o in out)
    if cl:
        yv = y.reshape(geo.n, *out, K)[s.n0:s.n0 + s.nb]
        wv = yw[:cells * K].reshape(s.nb, *ip, K)[(slice(None), *valid, slice(None))]
    else:
        yv = y.reshape(geo.n, K, *out)[s.n0:s.n0 + s.nb]
        ld = wide_ld(geo, cl, s.nb)
        wv = yw[:K * ld].reshape(K, ld)[:, :cells].reshape(K, s.nb, *ip)[(slice(None), slice(None), *valid)]
        wv = wv.transpose(1, 0, *range(2, nd + 2))
    return yv, wv


def forward_plan(geo: ConvGeometry, cl: bool, dtype, beta: float, budget: int, form: str) -> tuple[list, dict]:
    """(steps, scratch buffer name -> elements) of the forward pass in ``form`` with scratch of at most
    ``budget`` bytes (one image a chunk at least)."""
    if form in ("implicit", "winograd"):
        from . import winograd
        return implicit_plan(geo, dtype, budget) if form == "implicit" else winograd.plan(geo, dtype, budget, beta)
    pad = reduction_pad(geo, cl, np.dtype(dtype).itemsize) if form == "im2col" else None
    per = forward_scratch(geo, form, pad)
    parts = chunks(geo.n, per * np.dtype(dtype).itemsize, budget)
    nb = max(nb for _, nb in parts)
    if form == "shifted":
        return shifted_steps(geo, cl, parts, beta), shifted_buffers(geo, cl, nb)
    return forward_steps(geo, cl, parts, beta, pad), ({"col": nb * per} if per else {})


class Implicit(NamedTuple):
    """y = conv(x, w) over the whole batch by the implicit-GEMM kernel (igemm.py) in kernel type ``type`` with
    tile and split ``config``; split partials in scratch ``part``."""

    type: str
    config: tuple


class ImplicitWeight(NamedTuple):
    """dW = dY^T im2col(X) by the implicit weight-gradient kernel (igemm_weight.py), as ``Implicit``."""

    type: str
    config: tuple


IMPLICIT_SMS = 132  # the multiprocessors a plan's split is sized for (H100 SXM and H200)


def implicit_plan(geo: ConvGeometry, dtype, budget: int, sms: int = IMPLICIT_SMS) -> tuple[list, dict]:
    """(steps, scratch) of the implicit form: one Implicit step; its split's float32 partials in ``part``
    (in elements of ``dtype``), without a split where they would pass ``budget`` bytes."""
    t = igemm.type_name(dtype, "tf32")  # float32 takes this form in TF32 math only
    cfg = igemm.config(geo, t, sms)
    part = cfg.split * geo.n * geo.p * geo.k * 4
    if cfg.split > 1 and part > budget:
        cfg, part = cfg._replace(split=1), 0
    step = Implicit(t, cfg)
    return [step], ({"part": part // np.dtype(dtype).itemsize} if cfg.split > 1 else {})


def tap_major(xp, geo: ConvGeometry, cl: bool, wmat):
    """The ``(K, taps, C)`` weight the shifted form reads, from the ``(K, CRS)`` weight matrix."""
    if cl:
        return wmat
    return xp.ascontiguousarray(wmat.reshape(geo.k, geo.c, -1).transpose(0, 2, 1))


class Ones(NamedTuple):
    """Elements ``offset .. offset + count - 1`` of buffer ``name``, in dW's type, set to 1 (the batched
    weight form's summing vector, made in the plan so a captured graph makes it too)."""

    name: str
    offset: int
    count: int


_OPS = {Gather: "gather", Gemm: "gemm", CopyDy: "copy_dy", Pad: "pad", Crop: "crop", Implicit: "implicit",
        Ones: "ones", ImplicitWeight: "implicit_weight"}


def run(steps: list, ops) -> None:
    """Each step by the ``ops`` method of its kind (gather, gemm, copy_dy, pad, crop; CUDA or a numpy
    stand-in)."""
    for s in steps:
        getattr(ops, _OPS[type(s)])(s)


def gather_args(geo: ConvGeometry, cl: bool, s: Gather) -> tuple:
    """The gather kernel's integer arguments (gather_kernel.ARG_NAMES; RUN_ARG_NAMES for a run gather) for
    step ``s``."""
    from .im2col import x_strides
    sn, sc, ssp = x_strides(geo, cl)
    pad = 3 - geo.nd

    def three(t, fill):
        return (*t, *(fill,) * pad)
    return (geo.p, geo.crs, prod(geo.kernel), geo.cg, int(cl), int(s.pixel_fastest), s.group * geo.cg,
            *three(geo.kernel, 1)[1:], *three(geo.out_size, 1)[1:], *three(geo.stride, 1), *three(geo.dilation, 1),
            *three(geo.pad_lo, 0), *three(geo.insert, 1), *three(geo.in_size, 1), sn, sc, *three(ssp, 0), s.n0,
            s.on, s.orr, s.op, *((s.op // s.run, s.nb * geo.p) if s.run > 1 else ()))


def widened(geo: ConvGeometry, cl: bool, s: Gather, v: int):
    """(geometry, step) of the gather ``s`` over units of ``v`` consecutive channels, one wider load and store
    a thread (channels-last x and col, where the channels of a group come in whole units); None where it
    cannot. Its arguments are the narrow gather's in units: the same kernel moves the same bytes."""
    if v <= 1 or not cl or s.pixel_fastest or s.run > 1 or s.orr != 1 or geo.cg % v or s.on % v or s.op % v:
        return None
    import dataclasses
    return dataclasses.replace(geo, c=geo.c // v), s._replace(on=s.on // v, op=s.op // v)


# ---------------------------------------------------------------- the route (its CUDA side: direct_cuda.py)

def switches() -> tuple:
    """The settings a plan depends on (tests and benches change them): a replayed call's key holds them."""
    return FORM, BUDGET_FRACTION, SHIFTED_MIN_C, SHIFTED_MAX_WIDE, PAD_C_MAX, WINOGRAD_TILE, IMPLICIT_MIN_PIXELS


def on_own_gpu():
    """Within it, this thread's convolutions on CuPy arrays run on the arrays' GPU (this route), never
    split over the engine's GPUs: a network's per-GPU workers each hold a chunk of their own."""
    return setting(_local, "on_own_gpu", True)


def applies(x, flops: float) -> bool:
    """Whether a call on CuPy array ``x`` takes this route: inside :func:`on_own_gpu`, or unless
    forced (``ROUTE``), when the engine has at most one GPU or the call is too small for splitting
    it over several to pay."""
    if not type(x).__module__.startswith("cupy"):  # (operands.is_cupy, inline: every replay asks)
        return False
    if getattr(_local, "on_own_gpu", False):
        return True
    if ROUTE is not None:
        return ROUTE == "direct"
    if flops < SPLIT_FLOPS:  # (asked first: the engine's GPUs cost a session look-up)
        return True
    from .. import session
    return len(set(session.cuda_ordinals())) <= 1


PAD_C_MAX = 7  # a call with at most this many input channels has its col rows padded (reduction_pad)


def weight_rows(xp, wconv, cl: bool, k: int, crs: int):
    """The ``(K, CRS)`` row-major weight matrix: reduction order (c, r...), or (r..., c) channels-last."""
    if cl:
        wconv = wconv.transpose(0, *range(2, wconv.ndim), 1)
    return xp.ascontiguousarray(wconv).reshape(k, crs)


def pad_reduction(xp, wmat, rows: int, out=None, channels: int = 0):
    """The ``(K, rows)`` weight matrix (in ``out``, compact, where given): ``wmat``'s columns, then zeros
    (``reduction_pad``); ``channels`` > 0: ``wmat``'s order is (c, r...) over that many channels, made (r..., c)."""
    k, crs = wmat.shape
    out = xp.empty((k, rows), dtype=wmat.dtype) if out is None else out.reshape(k, rows)
    out[:, crs:] = 0
    if channels:
        out[:, :crs].reshape(k, crs // channels, channels)[...] = wmat.reshape(k, channels, -1).transpose(0, 2, 1)
    else:
        out[:, :crs] = wmat
    return out


def padded_rows(steps: list) -> int | None:
    """The padded length of col's rows in a plan's ``steps`` (a forward's weight matrix's too), or None."""
    return next((s.op for s in steps if isinstance(s, Gather) and s.run > 1), None)


def forward(geo: ConvGeometry, x, cl: bool, wmat, y, residual, affine, math: str):
    """y = epilogue(conv(x, w) (+ residual)) on x's device: ``wmat`` the ``(K, CRS)`` weight matrix
    (no scale with a residual: conv.py), ``affine`` the per-output-channel map (epilogue.Affine: scale, shift,
    activation) or None; x, y, residual compact in the layout ``cl`` says. Returns the plan it ran
    (direct_cuda.ForwardPlan) where the GEMMs read x (or its channel-padded copy) and wmat and wrote y
    (conv_memo can replay it, then :func:`finish`), else None."""
    import cupy

    from . import direct_cache, direct_cuda
    dt = np.dtype(x.dtype)

    # the residual is added by the epilogue kernel (one read), not copied into y for the GEMMs to accumulate on
    # (a copy, and the GEMMs reading y), unless it is y itself
    in_y = residual is not None and residual.data.ptr == y.data.ptr

    def attempt(budget):
        plan = direct_cuda.forward_plan(geo, cl, dt, 1.0 if in_y else 0.0, budget, math)
        return plan, {name: direct_cuda.scratch(name, size, dt) for name, size in plan.scratch.items()}
    plan, scratch = direct_cuda.with_memory(attempt)
    rows = padded_rows(plan.steps)
    if rows is not None:
        wmat = direct_cache.derived(wmat, ("pad_rows", rows, cl),
                                    lambda: pad_reduction(cupy, wmat, rows, channels=0 if cl else geo.c))
    bufs = {"x": x, "w": wmat, "y": y, **scratch}
    if plan.form == "shifted":
        bufs["wt"] = direct_cache.derived(wmat, ("tap_major", cl, geo.k, geo.c),
                                          lambda: tap_major(cupy, geo, cl, wmat))
    direct_cuda.CudaOps(geo, cl, bufs, dt, math).run(plan.steps, plan.launches)
    finish(geo, cl, y, affine, residual, in_y)
    return None if in_y else plan


def finish(geo: ConvGeometry, cl: bool, y, affine, residual, in_y: bool) -> None:
    """After the GEMMs: the epilogue kernel where there is one (``in_y``: the residual is y, already summed)."""
    if affine is not None or (residual is not None and not in_y):
        from . import direct_epilogue
        direct_epilogue.epilogue(geo, cl, y, affine, None if in_y else residual)


def weight(geo: ConvGeometry, x, dy, cl: bool, math: str):
    """(dW as the ``(K, CRS)`` row-major matrix of x's type (reduction order as ``cl`` says), the plan that
    made it: direct_cuda.WeightPlan)."""
    from . import direct_cuda
    dt = np.dtype(x.dtype)

    def attempt(budget):
        plan = direct_cuda.weight_plan(geo, cl, dt, budget, math)
        return direct_cuda.run_weight_plan(geo, cl, dt, math, plan, x, dy), plan
    return direct_cuda.with_memory(attempt)
