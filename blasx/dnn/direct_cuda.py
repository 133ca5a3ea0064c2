"""The CUDA side of the device route (conv_direct.py): its plans' steps run on the current device and stream
(the gather kernel, cuBLAS's strided-batched GEMM through ctypes, CuPy copies; the epilogue over the output:
direct_epilogue.py), and what each call would otherwise redo on the host, kept (direct_cache.py): the forward plan
with every launch's arguments per (geometry, layout, type, beta, form inputs, budget), the GEMM constants
per (type, math), the scratch budget per device, the epilogue's vectors per stream.
"""

from __future__ import annotations

from math import prod
from typing import NamedTuple

import numpy as np

from ..runtime import dtypes
from . import col2im as c2
from . import conv_direct as cd
from . import direct_cache, driver_launch, gather_kernel, igemm, igemm_weight, winograd
from . import weight_forms as wf
from . import cublas_call as cc
from .geometry import ConvGeometry

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(a, unit: int | None = None):
    """A compact CuPy array's memory as a flat array of unsigned integers of its element size (or of ``unit``
    bytes, which must divide its size)."""
    import cupy
    unit = unit or a.dtype.itemsize
    return cupy.ndarray((a.size * a.dtype.itemsize // unit,), dtype=_UINT[unit], memptr=a.data)


_KERNELS: dict = {}


def _gather_kernel(unit: int, index: str, nd: int, insert: bool, run: int = 1):
    """The gather (``gather_kernel.source``) over ``unit``-byte elements, indices of ``index`` ("int32" where
    every index fits, else "int64"), ``nd`` spatial dimensions, zero insertion or not; ``run`` > 1: the run
    gather (``gather_kernel.run_source``) over ``unit``-byte elements."""
    key = (unit, index, nd, insert, run)
    k = _KERNELS.get(key)
    if k is None:
        import cupy
        src = gather_kernel.run_source(unit, index, nd) if run > 1 else gather_kernel.source(*key[:4])
        k = _KERNELS[key] = cupy.RawKernel(*src)
    return k


THREADS = 256  # a block of the gather and col2im kernels
MAX_BLOCKS = 1 << 20  # past this their grid-stride loops take the rest
_GATHERS: dict = {}


def _packed(kernel, g, pointers: int) -> "driver_launch.DriverLaunch":
    """``kernel`` over ``g.total`` threads with ``pointers`` pointer arguments, then g's arguments (of its index
    type), the divisors' multipliers and shifts and the thread count, packed once."""
    import ctypes
    ct = ctypes.c_int32 if g.index == "int32" else ctypes.c_int64
    blocks = max(1, min(-(-g.total // THREADS), MAX_BLOCKS))
    return driver_launch.DriverLaunch(kernel, (blocks, 1, 1), (THREADS, 1, 1), 0, pointers,
                                      (*(ct(a) for a in g.args), *(ctypes.c_uint32(v) for v in g.magic),
                                       ctypes.c_int64(g.total)))


def gather_launcher(g: "GatherLaunch", device: int) -> "driver_launch.DriverLaunch":
    """Gather ``g``'s kernel on ``device`` with its arguments packed once: ``(stream, x, col)`` launches it."""
    got = _GATHERS.get((g, device))
    if got is None:
        got = _GATHERS[(g, device)] = _packed(_gather_kernel(g.unit, g.index, g.nd, g.insert, g.run), g, 2)
    return got


# ---------------------------------------------------------------- launches, prepared once per plan

class GatherLaunch(NamedTuple):
    """The gather kernel's integer arguments (gather_kernel.ARG_NAMES), index type, threads, spatial
    dimensions, whether it inserts zeros, the bytes a thread moves, where that is more than an element the
    launch in the next narrower unit (for x or col not aligned to this one), the divisors' multipliers, and the
    elements a thread writes (> 1: the run gather, ``unit`` the element size)."""

    args: tuple
    index: str
    total: int
    nd: int
    insert: bool
    unit: int
    narrow: "GatherLaunch | None" = None
    magic: tuple = ()
    run: int = 1


GATHER_UNIT = 8  # bytes of consecutive elements a copy moves where it can (copy)
GATHER_UNITS = (16, 8)  # bytes of consecutive channels a gather thread moves where it can, widest first


class GemmLaunch(NamedTuple):
    """A Gemm step's cuBLAS arguments with its operands as (buffer, byte offset, CUDA type)."""

    a: tuple
    b: tuple
    c: tuple
    dims: tuple  # op_a, op_b, m, n, k
    lda: tuple  # lda, stride_a
    ldb: tuple
    ldc: tuple  # ldc, stride_c, batch
    beta: float


def gather_launch(geo: ConvGeometry, cl: bool, s: cd.Gather, x_size: int, itemsize: int) -> GatherLaunch:
    """The launch of gather ``s`` over elements of ``itemsize`` bytes: in the widest of GATHER_UNITS it can,
    each with the next narrower launch (down to elements) for buffers not aligned to it; a run gather as it is
    (it reads elements, and col's runs are aligned)."""
    if s.run > 1:
        args = tuple(int(a) for a in cd.gather_args(geo, cl, s))
        total = -(-s.nb * geo.p // gather_kernel.RUN_PIXELS) * (s.op // s.run)
        index = "int32" if max(s.nb * geo.p * s.op, x_size) < 2**31 else "int64"
        return GatherLaunch(args, index, total, geo.nd, False, itemsize,
                            magic=gather_kernel.magic_args(args, gather_kernel.RUN_ARG_NAMES,
                                                           gather_kernel.RUN_DIVISORS), run=s.run)
    launch = _gather_launch(geo, cl, s, x_size, itemsize)
    for unit in reversed(GATHER_UNITS):
        v = unit // itemsize
        wide = cd.widened(geo, cl, s, v) if unit > itemsize else None
        if wide is not None:
            launch = _gather_launch(wide[0], cl, wide[1], x_size // v, unit)._replace(narrow=launch)
    return launch


def _gather_launch(geo: ConvGeometry, cl: bool, s: cd.Gather, x_size: int, unit: int) -> GatherLaunch:
    total = s.nb * geo.crs * geo.p
    index = "int32" if max(total, x_size) < 2**31 else "int64"
    args = tuple(int(a) for a in cd.gather_args(geo, cl, s))
    return GatherLaunch(args, index, total, geo.nd, any(z != 1 for z in geo.insert), unit,
                        magic=gather_kernel.magic_args(args))


ACC_BUFFERS = ("dw", "dwp")  # a weight plan's buffers in dw's type (dwp: the batched form's partial sums)


def gemm_launch(s: cd.Gemm, dtype, dw_dtype=None) -> GemmLaunch:
    """Every buffer but dw is of the operand type (scratch: as its bits); dw of ``dw_dtype`` (None: the
    accumulation type)."""
    dt = np.dtype(dtype)
    acc = np.dtype(dtypes.gemm_of(dt).compute if dw_dtype is None else dw_dtype)

    def operand(ref):
        t = acc if ref[0] in ACC_BUFFERS else dt
        return ref[0], ref[1] * t.itemsize, dtypes.CUDA_TYPE[t]
    return GemmLaunch(operand(s.a), operand(s.b), operand(s.c), (s.op_a, s.op_b, s.m, s.n, s.k),
                      (s.lda, s.stride_a), (s.ldb, s.stride_b), (s.ldc, s.stride_c, s.batch), s.beta)


def prepare(geo: ConvGeometry, cl: bool, dtype, steps: list, dw_dtype=None) -> list:
    """Per step, what launching it takes that depends on the plan alone (None: nothing); dw of ``dw_dtype``
    (None: the accumulation type)."""
    x_size = geo.n * geo.c * prod(geo.in_size)
    out = []
    for s in steps:
        if isinstance(s, cd.Gather):
            out.append(gather_launch(geo, cl, s, x_size, np.dtype(dtype).itemsize))
        elif isinstance(s, cd.Gemm):
            out.append(gemm_launch(s, dtype, dw_dtype))
        elif isinstance(s, cd.Implicit):
            out.append(igemm.plan_launch(geo, s.type, s.config))
        elif isinstance(s, cd.ImplicitWeight):
            out.append(igemm_weight.plan_launch(geo, s.type, s.config))
        elif isinstance(s, c2.Col2im):
            out.append(col2im_launch(geo, cl, s, dtype))
        else:
            out.append(None)
    return out


class ForwardPlan(NamedTuple):
    form: str
    steps: list
    scratch: dict
    launches: list


_PLANS = direct_cache.table(512)


def forward_plan(geo: ConvGeometry, cl: bool, dtype, beta: float, budget: int, math: str | None = None) -> ForwardPlan:
    """conv_direct's forward form (chosen per call: a force, the find-db, the heuristic) and the plan for
    it, with its launches, made once per key."""
    dt = np.dtype(dtype)
    form = cd.forward_form(geo, dt, cd.FORM, "cl" if cl else "nchw", math)
    if form in ("implicit", "winograd") and beta:  # their kernels write y; a sum into y takes the GEMMs
        form = "im2col"
    key = (geo, cl, dt.str, beta, budget, form, cd.WINOGRAD_TILE if form == "winograd" else 0)

    def make():
        steps, scratch = cd.forward_plan(geo, cl, dt, beta, budget, form)
        return ForwardPlan(form, steps, scratch, prepare(geo, cl, dt, steps))
    return _PLANS.get(key, make)


class WeightPlan(NamedTuple):
    steps: list
    scratch: dict
    launches: list
    dw_dtype: np.dtype
    form: str = "im2col"


def weight_plan(geo: ConvGeometry, cl: bool, dtype, budget: int, math: str | None = None) -> WeightPlan:
    """The weight-gradient plan in its form (weight_forms.weight_form: a force, the find-db, the heuristic) with
    scratch of at most ``budget`` bytes, made once per key: dW in the operand type where no GEMM accumulates
    into it (cuBLAS rounds its float32 sums once), else in the accumulation type (rounded after the last
    chunk, ``run_weight_plan``)."""
    dt = np.dtype(dtype)
    form = wf.weight_form(geo, dt, cd.FORM, "cl" if cl else "nchw", math)

    def make():
        acc = np.dtype(dtypes.gemm_of(dt).compute)
        if form == "shifted":
            parts = cd.chunks(geo.n, wf.shifted_scratch(geo) * dt.itemsize, budget)
            steps = wf.shifted_steps(geo, parts)
            scratch = cd.shifted_buffers(geo, True, max(nb for _, nb in parts))
        elif form == "implicit":  # the kernel writes dW in the operand type
            steps, scratch = wf.implicit_steps(geo, dt, budget)
            return WeightPlan(steps, scratch, prepare(geo, cl, dt, steps, dt), dt, form)
        elif form == "winograd":  # its GEMMs sum into u; its last kernel writes dW in the operand type
            steps, scratch = winograd.weight_plan(geo, dt, budget)
            return WeightPlan(steps, scratch, prepare(geo, cl, dt, steps, dt), dt, form)
        elif form == "batched":  # dwp: the partial sums and ones in the accumulation type
            parts = cd.chunks(geo.n, (geo.k * geo.c + 1) * acc.itemsize, budget)
            slots = wf.batched_slots(geo, max(nb for _, nb in parts), acc.itemsize)
            steps = wf.batched_steps(geo, parts, slots)
            scratch = {"dwp": wf.batched_scratch(geo, slots, dt)}
        else:
            pad = cd.reduction_pad(geo, cl, dt.itemsize)
            per = wf.weight_scratch(geo, cl, pad)
            parts = cd.chunks(geo.n, per * dt.itemsize, budget)
            steps = wf.weight_steps(geo, cl, parts, pad)
            scratch = {}
            if per:
                nb = max(nb for _, nb in parts)
                scratch["col"] = (geo.crs if pad is None else pad[0]) * geo.p * nb
                if not cl:
                    scratch["dyc"] = nb * per - scratch["col"]
        once = form != "batched" and all(s.beta == 0.0 for s in steps if isinstance(s, cd.Gemm))
        dw_dtype = dt if once else acc
        return WeightPlan(steps, scratch, prepare(geo, cl, dt, steps, dw_dtype), dw_dtype, form)
    return _WEIGHT_PLANS.get((geo, cl, dt.str, budget, form, cd.WINOGRAD_TILE if form == "winograd" else 0), make)


_WEIGHT_PLANS = direct_cache.table(512)


def run_weight_plan(geo: ConvGeometry, cl: bool, dtype, math: str, plan: WeightPlan, x, dy, out=None):
    """dW = ``plan`` run on x and dY: the ``(K, CRS)`` row-major matrix of x's type (written into ``out`` where
    given), in the reduction order of x's layout (a plan with padded rows makes ``(K, rows)`` in the order
    (r..., c): its first CRS columns taken, reordered for NCHW)."""
    import cupy
    dt = np.dtype(dtype)
    bufs = {name: empty_bits(size, dt) for name, size in plan.scratch.items()}
    if out is None:
        out = cupy.empty((geo.k, geo.crs), dtype=dt)
    rows = cd.padded_rows(plan.steps)
    width = rows or geo.crs
    direct = plan.dw_dtype == dt and rows is None  # the plan writes ``out`` itself
    dw = out if direct else cupy.empty((geo.k, width), dtype=plan.dw_dtype)
    bufs.update(x=x, dy=dy, dw=dw, y=dy)  # (the shifted form's Crop copies "y", here dY, into yw)
    CudaOps(geo, cl, bufs, dt, math).run(plan.steps, plan.launches)
    if direct:
        return out
    if plan.dw_dtype != dt:  # rounded once, after the last chunk's GEMM
        made = cupy.empty((geo.k, width), dtype=dt)
        if dt == np.float16:
            made[...] = dw
        else:  # bfloat16: rounded to nearest even from float32's bits
            round_bf16()(dw, _bits(made).reshape(dw.shape))
        dw = made
    dw = dw[:, :geo.crs]
    if rows is not None and not cl:
        out.reshape(geo.k, geo.c, -1)[...] = dw.reshape(geo.k, -1, geo.c).transpose(0, 2, 1)
    else:
        out[...] = dw
    return out


def transposed_plan(geo: ConvGeometry, cl: bool, wcl: bool, dtype, budget: int) -> ForwardPlan:
    """The col2im plan (col2im.py) of the transposed convolution ``geo`` with scratch of at most ``budget``
    bytes, with its launches, made once per key."""
    dt = np.dtype(dtype)

    def make():
        per = c2.scratch_per_image(geo)
        parts = cd.chunks(geo.n, per * dt.itemsize, budget)
        steps = c2.steps(geo, cl, wcl, parts)
        scratch = {"col": max(nb for _, nb in parts) * per}
        if c2.reorders(geo, cl, wcl):
            scratch["wt"] = geo.c * geo.kg * prod(geo.kernel)
        return ForwardPlan("col2im", steps, scratch, prepare(geo, cl, dt, steps))
    return _PLANS.get(("col2im", geo, cl, wcl, dt.str, budget), make)


def transposed(geo: ConvGeometry, x, cl: bool, w, wcl: bool, y, bias, math: str) -> ForwardPlan:
    """y = conv_transpose(x, w) (+ bias, host values) by col2im.py's plan on x's device; returns the plan."""
    dt = np.dtype(x.dtype)

    def attempt(budget):
        plan = transposed_plan(geo, cl, wcl, dt, budget)
        return plan, {name: scratch(name, size, dt) for name, size in plan.scratch.items()}
    plan, bufs = with_memory(attempt)
    bufs.update(x=x, w=w, y=y)
    if bias is not None:
        bufs["bias"] = direct_cache.device_vector(bias, dt)
    CudaOps(geo, cl, bufs, dt, math).run(plan.steps, plan.launches)
    return plan


class Col2imLaunch(NamedTuple):
    """A Col2im step's kernel arguments (col2im.ARG_NAMES), the divisors' multipliers, index type, threads,
    spatial dimensions and element type."""

    args: tuple
    magic: tuple
    index: str
    total: int
    nd: int
    dtype: str
    vec: int


def col2im_launch(geo: ConvGeometry, cl: bool, s: c2.Col2im, dtype) -> Col2imLaunch:
    args = tuple(int(a) for a in c2.kernel_args(geo, cl, s))
    vec = c2.vector(geo, cl, dtype)
    return Col2imLaunch(args, c2.magic_args(args), c2.index_type(geo, s, s.nb * c2.scratch_per_image(geo)),
                        c2.threads(geo, s, vec), geo.nd, np.dtype(dtype).name, vec)


def col2im_launcher(g: Col2imLaunch, device: int) -> "driver_launch.DriverLaunch":
    """``g``'s kernel on ``device`` with its arguments packed once: ``(stream, col, bias or 0, y)`` launches it."""
    got = _COL2IMS.get((g, device))
    if got is None:
        import cupy
        key = (g.dtype, g.nd, g.index, g.vec)
        k = _KERNELS.get(key)
        if k is None:
            k = _KERNELS[key] = cupy.RawKernel(*c2.source(*key))
        got = _COL2IMS[(g, device)] = _packed(k, g, 3)
    return got


_COL2IMS: dict = {}


_CONSTS = direct_cache.table(64)


def gemm_consts(dtype, math: str) -> tuple:
    """(CUDA compute type, {beta: address of a host scalar of the compute type}, the scalars) for GEMMs
    of ``dtype`` in ``math`` (the scalars are only read: cuBLAS takes host-pointer scalars' values when
    called; the entry keeps them alive)."""
    def make():
        row = dtypes.gemm_of(dtype)
        scalars = {b: np.array([b], dtype=row.compute) for b in (0.0, 1.0)}
        return dtypes.compute_type(row, math), {b: v.ctypes.data for b, v in scalars.items()}, scalars
    return _CONSTS.get((np.dtype(dtype).str, math), make)


def gemm_args(g: GemmLaunch, pa: int, pb: int, pc: int, scalars: dict, compute: int) -> tuple:
    """cublasGemmStridedBatchedEx's arguments after the handle for ``g`` on buffers at ``pa``, ``pb``, ``pc``
    (``scalars``, ``compute``: gemm_consts')."""
    return (*g.dims, scalars[1.0], pa + g.a[1], g.a[2], *g.lda, pb + g.b[1], g.b[2], *g.ldb, scalars[g.beta],
            pc + g.c[1], g.c[2], *g.ldc, compute, dtypes.CUBLAS_GEMM_DEFAULT)


def gemm_issuer(g: GemmLaunch, names: dict, dtype, math: str):
    """``issue(stream, device, *arrays)``: the GEMM ``g`` on the compact CuPy arrays that ``names`` (buffer name
    -> index into ``arrays``) names, on a handle bound to ``stream``, without a :class:`CudaOps` (a replayed
    call's one GEMM); None where g reads a buffer not in ``names``."""
    try:
        ia, ib, ic = (names[r[0]] for r in (g.a, g.b, g.c))
    except KeyError:
        return None
    compute, scalars, keep = gemm_consts(dtype, math)
    fn = cc.strided_batched_ex()

    def issue(stream: int, device: int, *arrays) -> None:
        cc.issue(fn, device, stream, gemm_args(g, arrays[ia].data.ptr, arrays[ib].data.ptr, arrays[ic].data.ptr,
                                               scalars, compute), g)
    issue.keep = keep  # (the host scalars the arguments point to live as long as the issuer)
    return issue


# ---------------------------------------------------------------- running steps

class CudaOps:
    """Runs plan steps on the current device and stream. ``bufs``: name -> compact CuPy array."""

    def __init__(self, geo: ConvGeometry, cl: bool, bufs: dict, dtype, math: str) -> None:
        import cupy
        self.geo, self.cl, self.bufs, self.dtype = geo, cl, bufs, np.dtype(dtype)
        self.compute, self.scalars, self._keep = gemm_consts(dtype, math)
        self.stream = cupy.cuda.get_current_stream()
        self.device = cupy.cuda.Device().id
        self.gemm_fn = cc.strided_batched_ex()
        self.ptrs: dict = {}
        self.flat: dict = {}

    def _ptr(self, name: str) -> int:
        p = self.ptrs.get(name)
        if p is None:
            p = self.ptrs[name] = self.bufs[name].data.ptr
        return p

    def _bits(self, name: str, unit: int | None = None):
        b = self.flat.get((name, unit))
        if b is None:
            b = self.flat[(name, unit)] = _bits(self.bufs[name], unit)
        return b

    def run(self, steps: list, launches: list) -> None:
        """The steps with their prepared launches (``prepare``)."""
        for s, launch in zip(steps, launches):
            if launch is None:
                getattr(self, cd._OPS[type(s)])(s)
            elif type(launch) is GemmLaunch:
                self.launch_gemm(launch)
            elif type(launch) is igemm.Launch:
                self.launch_implicit(launch)
            elif type(launch) is igemm_weight.Launch:
                self.launch_implicit_weight(launch)
            elif type(launch) is Col2imLaunch:
                self.launch_col2im(launch)
            else:
                self.launch_gather(launch)

    def ones(self, s: cd.Ones) -> None:
        self.bufs[s.name].view(self.bufs["dw"].dtype)[s.offset:s.offset + s.count].fill(1)

    def gather(self, s: cd.Gather) -> None:
        self.launch_gather(gather_launch(self.geo, self.cl, s, self.bufs["x"].size, self.bufs["x"].dtype.itemsize))

    def launch_gather(self, g: GatherLaunch) -> None:
        x, col = self._ptr("x"), self._ptr("col")
        while g.narrow is not None and (x | col) % g.unit:
            g = g.narrow
        gather_launcher(g, self.device)(self.stream.ptr, x, col)

    def gemm(self, s: cd.Gemm) -> None:
        self.launch_gemm(gemm_launch(s, self.dtype))

    def launch_gemm(self, g: GemmLaunch) -> None:
        args = gemm_args(g, self._ptr(g.a[0]), self._ptr(g.b[0]), self._ptr(g.c[0]), self.scalars, self.compute)
        ws = direct_cache.workspace()
        if ws is not None:
            cc.check(self.gemm_fn(cc.own_handle(ws, self.device, self.stream.ptr), *args), g)
        else:
            cc.issue(self.gemm_fn, self.device, self.stream.ptr, args, g)

    def implicit(self, s: cd.Implicit) -> None:
        self.launch_implicit(igemm.plan_launch(self.geo, s.type, s.config))

    def launch_implicit(self, launch: igemm.Launch) -> None:
        self._launch_aligned(igemm.run, launch, ("x", "w", "y"))

    def implicit_weight(self, s: cd.ImplicitWeight) -> None:
        self.launch_implicit_weight(igemm_weight.plan_launch(self.geo, s.type, s.config))

    def launch_implicit_weight(self, launch: igemm_weight.Launch) -> None:
        self._launch_aligned(igemm_weight.run, launch, ("x", "dy", "dw"))

    def _launch_aligned(self, run, launch, names: tuple) -> None:
        """``run(launch, a, b, out, part)`` on the buffers ``names``; an operand off a 16-byte boundary (a view)
        is copied to fresh memory first (and the output copied back)."""
        import cupy
        a, b, out = (self.bufs[n] for n in names)
        a, b = (v if igemm.aligned(v) else cupy.array(v) for v in (a, b))
        dst = out if igemm.aligned(out) else cupy.empty_like(out)
        run(launch, a, b, dst, self.bufs.get("part"))
        if dst is not out:
            out[...] = dst

    def weight_order(self, s: c2.WeightOrder) -> None:
        from . import host_batch, transpose_kernel
        g = self.geo
        shape = (g.c, g.kg, prod(g.kernel))
        transpose_kernel.copy(host_batch.in_layout(self.bufs["wt"][:prod(shape)], shape, "cl"),
                              self.bufs["w"].reshape(shape), True)

    def wino(self, s) -> None:
        winograd.launch(self, s)

    def col2im(self, s: c2.Col2im) -> None:
        self.launch_col2im(col2im_launch(self.geo, self.cl, s, self.dtype))

    def launch_col2im(self, g: Col2imLaunch) -> None:
        bias = self.bufs.get("bias")
        col2im_launcher(g, self.device)(self.stream.ptr, self._ptr("col"), 0 if bias is None else bias.data.ptr,
                                        self._ptr("y"))

    def copy_dy(self, s: cd.CopyDy) -> None:
        g = self.geo
        dy = _bits(self.bufs["dy"]).reshape(g.n, g.k, g.p)
        dyc = _bits(self.bufs["dyc"])[:g.k * s.nb * g.p].reshape(g.k, s.nb, g.p)
        dyc[...] = dy[s.n0:s.n0 + s.nb].transpose(1, 0, 2)

    def pad(self, s: cd.Pad) -> None:
        xp = self.bufs["xp"]
        if s.clear:
            xp.fill(0)
        dst, src = cd.pad_views(self.geo, self.cl, s, self._bits("x"), xp)
        copy(dst, src)

    def crop(self, s: cd.Crop) -> None:
        yw = self.bufs["yw"]
        if s.clear:
            yw.fill(0)
        yv, wv = cd.crop_views(self.geo, self.cl, s, self._bits("y"), yw)
        if wv.data.mem is not yw.data.mem:  # a reshape that copied would lose the residual's writes
            raise RuntimeError(f"conv_direct: yw's valid part is not a view of yw ({s})")
        if s.to_y:
            copy(yv, wv)
        else:
            copy(wv, yv)


def copy(dst, src) -> None:
    """``dst[...] = src`` for arrays of element bits, in GATHER_UNIT-byte units along their last axis where
    both allow (channels-last pixels: one load and store a thread moves several channels)."""
    wd, ws = wide_view(dst, GATHER_UNIT), wide_view(src, GATHER_UNIT)
    if wd is not None and ws is not None:
        wd[...] = ws
    else:
        dst[...] = src


def wide_view(a, unit: int):
    """``a`` as ``unit``-byte integers along its last axis (contiguous there, every other stride, its address and
    its last axis's bytes multiples of ``unit``); None where it is not."""
    import cupy
    isz = a.itemsize
    if isz >= unit or a.ndim == 0 or a.strides[-1] != isz or a.shape[-1] * isz % unit or a.data.ptr % unit or \
            any(st % unit for st in a.strides[:-1]):
        return None
    return cupy.ndarray((*a.shape[:-1], a.shape[-1] * isz // unit), dtype=_UINT[unit], memptr=a.data,
                        strides=(*a.strides[:-1], unit))


# ---------------------------------------------------------------- scratch

def device_id() -> int:
    import cupy
    return cupy.cuda.Device().id


def budget(refresh: bool = False) -> int:
    """Scratch bytes one call may take: free device memory (the pool's free blocks included), read once
    per device (``refresh``: again), / BUDGET_FRACTION."""
    return direct_cache.free_bytes(device_id(), refresh) // cd.BUDGET_FRACTION


def empty_bits(size: int, dtype):
    """Scratch for ``size`` elements of ``dtype``, as unsigned integers of its size (any element type)."""
    import cupy
    return cupy.empty(size, dtype=_UINT[np.dtype(dtype).itemsize])


def scratch(name: str, size: int, dtype):
    """Scratch ``name`` of the call: the thread's Workspace's buffer (reused), else a new one."""
    ws = direct_cache.workspace()
    if ws is None:
        return empty_bits(size, dtype)
    udt = _UINT[np.dtype(dtype).itemsize]
    return ws.scratch(name, size, udt, lambda n, _dt: empty_bits(n, dtype))


def with_memory(attempt):
    """``attempt(budget)``; where a device allocation fails, once more with the free memory read again
    (and the Workspace's scratch given back first)."""
    import cupy
    try:
        return attempt(budget())
    except cupy.cuda.memory.OutOfMemoryError:
        ws = direct_cache.workspace()
        if ws is not None:
            ws.buffers.clear()
        return attempt(budget(refresh=True))


_BF16 = []


def round_bf16():
    if not _BF16:
        import cupy
        _BF16.append(cupy.ElementwiseKernel(
            "float32 r", "uint16 y", "unsigned int u = __float_as_uint(r); y = isnan(r) ? "
            "(unsigned short)((u >> 16) | 0x40u) : (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)",
            "blasx_conv_round_bf16"))
    return _BF16[0]
