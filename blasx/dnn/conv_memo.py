"""Replays of device-route convolution calls (conv_direct.py): a call on CuPy arrays whose every input to its
checks and its plan (the operands' shapes, strides, types and device; the geometry arguments; the math mode;
the current device and stream; the route's switches: a forced form, the scratch budget's fraction, the form
heuristic's bounds; the perf-db's generation in this process) equals an earlier call's runs that call's launches
again on the new operands' memory. It skips the checks the earlier call passed and the layout work, weight views
and planning it did: a 1x1 convolution's GEMM is shorter on a GPU than that host work.

Only calls whose whole work is launches that read the operands in place and write fresh memory, then the
epilogue from the call's own vectors and residual, are kept (``Replay``): no ``out=``; x read where it lies (or
copied into zero-padded channels, as the full path copies an image's few channels); the
caller's weight read where it lies (forward, backward-data by col2im) or its flipped weight matrix made anew
(stride-1 backward-data); no phases. Any other call finds no key (``key`` returns None) or no entry, and takes
the full path each time. Whether the device route applies is asked again on every replay (it depends on the
engine's configuration), and a replay that cannot allocate gives way to the full path, which reads the free
memory again.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from .. import perfdb, precision
from ..operands import is_cupy
from ..runtime import dtypes
from . import call_graph, conv_direct, direct_cache, transpose_kernel

_TABLE = direct_cache.table(256)


class Epilogue(NamedTuple):
    """A replayed call's epilogue, its operands checked and its vectors made on the device: ``launch(y)`` runs it on
    the current stream; ``addresses``: the device memory it reads besides y (a graph's key holds them)."""

    launch: Callable
    addresses: tuple


class Replay(NamedTuple):
    """What a kept call did: ``run(a, b)`` redoes it on new operands (x and w, or x and dY) and returns its
    result; ``flops`` is what the route check weighs."""

    run: Callable
    flops: float


def operand_kind(v):
    """What a key tells of an optional operand: None, "host" (numpy, any shape: checked on every call), or a
    CuPy array's (shape, strides, type, device)."""
    if v is None:
        return None
    if not is_cupy(v):
        return "host"
    return (v.shape, v.strides, v.dtype, v.data.device_id)


def key(kind: str, nd: int, a, b, args: tuple, math, extra: tuple = ()):
    """The memo key of a call of ``kind`` on CuPy arrays ``a`` and ``b`` with geometry arguments ``args``, or
    None where such a call is never replayed (not CuPy; a Workspace or a graph capture in charge; arguments
    that are not plain ints, tuples and strings; operands off the current device). ``extra``: what else
    the plan depends on (the caller's plain values). Every call asks it first: kept lean."""
    if not (type(a).__module__.startswith("cupy") and type(b).__module__.startswith("cupy")):
        return None
    local = direct_cache._local
    if getattr(local, "workspace", None) is not None or getattr(local, "keep", None) is not None:
        return None
    for v in args:
        if not (v is None or type(v) is int or type(v) is str or (type(v) is tuple and _ints(v))):
            return None
    if math is None:
        math = precision.default_math()
    elif not (type(math) is str and math in dtypes.MATH_MODES):
        return None
    cupy = _cupy()
    da, db = a.data, b.data
    dev = da.device_id
    if db.device_id != dev or cupy.cuda.runtime.getDevice() != dev:
        return None
    return (kind, nd, a.shape, a.strides, a.dtype, b.shape, b.strides, b.dtype, args, math, dev,
            cupy.cuda.get_current_stream().ptr, conv_direct.switches(), perfdb.generation(), extra)


def _ints(t: tuple) -> bool:
    for e in t:
        if type(e) is not int:
            return False
    return True


def _cupy():
    import cupy
    return cupy


def replay(k, a, b, extras=None):
    """The kept call's result on ``a`` and ``b`` (and the epilogue's operands ``extras``), or None (no entry; the
    route no longer applies; out of memory: the entry is dropped and the full path runs)."""
    if k is None:
        return None
    r = _TABLE.entries.get(k)
    if r is None or not conv_direct.applies(a, r.flops):
        return None
    import cupy
    try:
        return r.run(a, b, extras)
    except cupy.cuda.memory.OutOfMemoryError:
        _TABLE.entries.pop(k, None)
        return None


def keep(k, r: Replay | None) -> None:
    """Keep ``r`` under ``k`` (either None: nothing)."""
    if k is not None and r is not None:
        _TABLE.get(k, lambda: r)


def forward_replay(geo, cl: bool, dtype, math: str, plan, make_y, weight_of=None, epilogue=None,
                   flops: float | None = None, converted: bool = False, bias_of=None) -> Replay | None:
    """The replay of a forward call that ran ``plan`` (direct_cuda.ForwardPlan) on x, the ``(K, CRS)`` weight
    matrix (the caller's weight where it lies, or ``weight_of`` the caller's weight) and ``y = make_y()``, then
    the epilogue where given (``epilogue(extras)`` checks the call's epilogue operands before any launch and
    returns what finishes y); None for the shifted form on NCHW operands (its tap-major weight is another
    transform). ``flops``: what the full path's route check weighed (None: the gather's). ``converted``: the
    plan ran on channels-last copies of the caller's NCHW x and y (conv_direct.device_layout), made again.
    ``bias_of(extras)``: the bias vector on the device that the plan's own kernel reads (col2im's), checked
    and made before any launch."""
    if plan.form == "shifted" and not cl:
        return None
    import cupy

    from . import direct_cuda
    dt = np.dtype(dtype)
    scratch = tuple(plan.scratch.items())
    flops = 2.0 * geo.n * geo.p * geo.k * geo.crs if flops is None else flops
    rows = conv_direct.padded_rows(plan.steps)
    if plan.form == "implicit" and not scratch and bias_of is None:
        return _implicit_replay(geo, cl, dt, math, plan, make_y, weight_of, epilogue, flops, converted)
    if not scratch and len(plan.launches) == 1 and type(plan.launches[0]) is direct_cuda.GemmLaunch \
            and bias_of is None:
        issue = direct_cuda.gemm_issuer(plan.launches[0], {"x": 0, "w": 1, "wt": 1, "y": 2}, dt, math)
        if issue is not None:
            return _gemm_replay(issue, make_y, weight_of, epilogue, flops, converted)

    def launch(x, w, y, bias=None):
        if weight_of is not None:
            w = weight_of(w)
        if rows is not None:  # the weight matrix padded (in the order (r..., c)) as the full path pads it
            wmat = w if w.ndim == 2 else conv_direct.weight_rows(cupy, w, cl, geo.k, geo.crs)
            w = conv_direct.pad_reduction(cupy, wmat, rows, direct_cuda.scratch("wpad", geo.k * rows, dt).view(dt),
                                          0 if cl else geo.c)
        bufs = {"x": x, "w": w, "wt": w, "y": y}  # (the shifted form's channels-last wt is w)
        if bias is not None:
            bufs["bias"] = bias
        for name, size in scratch:
            bufs[name] = direct_cuda.empty_bits(size, dt)
        direct_cuda.CudaOps(geo, cl, bufs, dt, math).run(plan.steps, plan.launches)
    return _launch_replay(launch, make_y, epilogue, flops, converted, bias_of)


def call_replay(launch, make_y, flops: float, converted: bool = False) -> Replay:
    """The replay of a call made of other calls (a strided transposed convolution's phases): ``launch(x, w, y)``
    runs them again, eagerly and then from a CUDA graph as any replay (their plans cached by the first call)."""
    return _launch_replay(launch, make_y, None, flops, converted)


def _implicit_replay(geo, cl, dt, math, plan, make_y, weight_of, epilogue, flops, converted) -> Replay:
    """The replay of an implicit-form call without scratch: one launch through the driver with its arguments
    packed once (igemm.Launcher), on the current stream; operands off a 16-byte boundary take the plan's
    executor (which copies them)."""
    import cupy

    from . import direct_cuda, igemm
    go = igemm.launcher(plan.launches[0])
    stream_of = cupy.cuda.get_current_stream

    def launch(x, w, y):
        px, pw, py = x.data.ptr, w.data.ptr, y.data.ptr
        if (px | pw | py) % igemm.ALIGN:
            direct_cuda.CudaOps(geo, cl, {"x": x, "w": w, "y": y}, dt, math).run(plan.steps, plan.launches)
        else:
            go(stream_of().ptr, px, pw, py)
    return _launch_replay(_weighted(launch, weight_of), make_y, epilogue, flops, converted)


def _gemm_replay(issue, make_y, weight_of, epilogue, flops, converted) -> Replay:
    """The replay of a call whose plan is one GEMM on x, the weight matrix and y (a pointwise convolution):
    ``issue`` (direct_cuda.gemm_issuer) with its arguments packed once, on the current stream."""
    import cupy
    stream_of = cupy.cuda.get_current_stream

    def launch(x, w, y):
        issue(stream_of().ptr, x.data.device_id, x, w, y)
    return _launch_replay(_weighted(launch, weight_of), make_y, epilogue, flops, converted)


def _weighted(launch, weight_of):
    """``launch`` on the weight made by ``weight_of`` from the caller's (None: the caller's)."""
    if weight_of is None:
        return launch
    return lambda x, w, y: launch(x, weight_of(w), y)


def _launch_replay(launch, make_y, epilogue, flops, converted=False, bias_of=None) -> Replay:
    """The replay that makes y and runs ``launch(x, w, y)`` (its scratch its own), then the epilogue where the
    call has one (``epilogue(extras)``: its operands checked before any launch, an :class:`Epilogue`): from a CUDA
    graph keyed by the operands' addresses and the epilogue's (call_graph.py). ``converted``: ``launch`` takes
    channels-last x and y, the caller's are NCHW (copies made each run, in the graph). ``bias_of(extras)``:
    a vector ``launch`` takes after y (its address in the graph's key)."""
    if converted:
        launch = _in_channels_last(launch)
    graphs = call_graph.Graphs(launch)
    if bias_of is not None:
        def run(x, w, extras=None):
            b = bias_of(extras)
            y = make_y()
            graphs.run(x, w, y, (b.data.ptr,), None, (b,))
            return y
    elif epilogue is None:
        def run(x, w, extras=None):
            y = make_y()
            graphs.run(x, w, y)
            return y
    else:
        def run(x, w, extras=None):
            done = epilogue(extras)
            y = make_y()
            graphs.run(x, w, y, done.addresses, done.launch)
            return y
    run.graphs = graphs
    return Replay(run, flops)


def _in_channels_last(launch):
    """``launch(x, w, y)`` on NCHW x and y through channels-last copies of both (as the full path makes them)."""
    def run(x, w, y, *operands):
        yc = conv_direct.layout_scratch("y_in_layout", y.shape, y.dtype, "cl")
        launch(conv_direct.in_layout(x, "x_in_layout", "cl"), w, yc, *operands)
        transpose_kernel.copy(y, yc, False)
    return run


def weight_replay(geo, cl: bool, dtype, math: str, plan, finish, converted: bool = False) -> Replay:
    """The replay of a weight-gradient call that ran ``plan`` (direct_cuda.WeightPlan) on x and dY, its result
    ``finish(dw)`` of the ``(K, CRS)`` matrix ``dw``; from a CUDA graph keyed by the operands' addresses
    (call_graph.py); a plan of one GEMM without scratch issues it with its arguments packed once. ``converted``:
    the plan ran on channels-last copies of the caller's NCHW x and dY, made again in the graph."""
    import cupy

    from . import direct_cuda
    flops = 2.0 * geo.n * geo.p * geo.k * geo.crs
    dt = np.dtype(dtype)
    issue = None
    if not plan.scratch and len(plan.launches) == 1 and type(plan.launches[0]) is direct_cuda.GemmLaunch \
            and plan.dw_dtype == dt:
        issue = direct_cuda.gemm_issuer(plan.launches[0], {"x": 0, "dy": 1, "dw": 2}, dtype, math)
    if issue is not None:
        stream_of = cupy.cuda.get_current_stream

        def launch(x, dy, dw):
            issue(stream_of().ptr, x.data.device_id, x, dy, dw)
    else:
        def launch(x, dy, dw):
            direct_cuda.run_weight_plan(geo, cl, dtype, math, plan, x, dy, out=dw)
    if converted:  # dw: the NCHW weight's memory, copied from the channels-last result (as the full path does)
        inner, nd = launch, geo.nd

        def launch(x, dy, dw):
            dwm = cupy.empty((geo.k, geo.crs), dtype=dt)
            inner(conv_direct.in_layout(x, "x_in_layout", "cl"), conv_direct.in_layout(dy, "dy_in_layout", "cl"), dwm)
            moved = dwm.reshape(geo.k, *geo.kernel, geo.cg).transpose(0, nd + 1, *range(1, nd + 1))
            transpose_kernel.copy(dw.reshape(geo.k, geo.cg, *geo.kernel), moved, False)
    graphs, shape = call_graph.Graphs(launch), (geo.k, geo.crs)

    def run(x, dy, extras=None):
        dw = cupy.empty(shape, dtype=dt)
        graphs.run(x, dy, dw)
        return finish(dw)
    run.graphs = graphs
    return Replay(run, flops)
