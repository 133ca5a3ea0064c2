"""``blasx.dnn.find``: the find step (MIOpen's, for the device route): time every form that applies to
one convolution problem on a GPU, check each form's result against the first's, and store the fastest
in the find-db (finddb.py), which ``conv_direct.forward_form`` reads before its heuristic.

Forms: forward and backward-data (a convolution of dY with the flipped kernel) run "im2col", and also
"shifted", "implicit" and "winograd" where they apply to the gather they run (conv_direct.forms); the weight
gradient runs "im2col", and "shifted", "batched", "implicit" or "winograd" where it applies (weight_forms.py); depthwise
problems run "depthwise" alone. A strided backward-data problem runs "col2im" (col2im.py) and "phases" (stride-1
convolutions of the sub-kernels, phases.py; dilation 1); one with col2im alone (dilated) is timed and not
stored: the runtime has nothing to choose there. Any other problem with one form is still timed and
stored (its time is worth having; nothing else is chosen). The form is forced through ``conv_direct.FORM``
during the runs, so run the find step while no other thread convolves.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np

from . import col2im, conv_direct, depthwise, finddb, phases, weight_forms
from .geometry import ConvGeometry


class NoGpuError(RuntimeError):
    """The find step needs a CUDA GPU through CuPy, and there is none (nothing was measured)."""


def runtime_geometry(geo: ConvGeometry, direction: str) -> ConvGeometry:
    """The gather the device route runs for the forward problem ``geo`` in ``direction`` (backward-data:
    dY zero-inserted by the stride, with the flipped kernel, as ``transpose_geometry`` makes it)."""
    if direction != "bwd-data":
        return geo
    pad = tuple(d * (r - 1) - lo for d, r, lo in zip(geo.dilation, geo.kernel, geo.pad_lo))
    return ConvGeometry(geo.n, geo.k, geo.c, geo.groups, tuple(geo.out_size), tuple(geo.kernel), (1,) * geo.nd,
                        tuple(geo.dilation), pad, tuple(geo.stride), tuple(geo.in_size))


def forms_for(geo: ConvGeometry, direction: str, dtype=np.float64, layout: str = "nchw", math: str | None = None,
              capable: bool = False) -> tuple[str, ...]:
    """The device-route forms of the forward problem ``geo`` in ``direction`` in ``dtype``, ``layout`` and
    ``math`` (``capable``: the GPU runs the implicit kernel), the reference form first."""
    rt = runtime_geometry(geo, direction)
    if depthwise.applies(rt):
        return ("depthwise",)
    if direction == "bwd-weight":
        return weight_forms.weight_forms(rt, layout, dtype, capable, math)
    return conv_direct.forms(rt, dtype, layout, math, capable)


def rel_err(a, b) -> float:
    """||a - b||_F / ||b||_F in float64 (numpy or CuPy arrays)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    num, den = float(((a - b) ** 2).sum()) ** 0.5, float((b * b).sum()) ** 0.5
    return num / den if den > 0 else num


def measure(forms, call: Callable, timer: Callable, runs: int, tol: float, compare: Callable = rel_err) -> dict:
    """Time each form: ``call(form)`` runs it once and returns its result (the first call per form
    warms up and is checked against the first working form's), ``timer(run)`` the seconds of ``run()``; a
    form whose relative error exceeds ``tol`` (or is not finite), or whose first call raises, is never the
    winner. Returns seconds ({form: [runs]}), best ({form: min}), errors ({form: error}), failed ({form: the
    exception, as text}), bad (forms) and form (the fastest good one, ties: the earlier; None if none)."""
    out = {"forms": list(forms), "seconds": {}, "best": {}, "errors": {}, "failed": {}, "bad": [], "form": None}
    ref = None
    for f in forms:
        try:
            y = call(f)
        except Exception as exc:  # noqa: BLE001 - a form that cannot run is reported, the others still timed
            out["failed"][f] = f"{type(exc).__name__}: {exc}"
            out["bad"].append(f)
            continue
        if ref is None:
            ref, err = y, 0.0
        else:
            err = compare(y, ref)
        out["errors"][f] = err
        if not (np.isfinite(err) and err <= tol):
            out["bad"].append(f)
        times = [float(timer(lambda f=f: call(f))) for _ in range(runs)]
        out["seconds"][f] = times
        out["best"][f] = min(times)
    good = [f for f in forms if f not in out["bad"]]
    if good:
        out["form"] = min(good, key=lambda f: (out["best"][f], forms.index(f)))
    return out


CALLS = 10  # calls a timed run issues back to back


def cuda_timer(run, calls: int = CALLS) -> float:
    """Seconds a call of ``run()`` takes on the current stream, by CUDA events around ``calls`` calls issued
    back to back as a network issues its layers: a form whose host issue outlasts its GPU work pays for it,
    and the fixed cost of one timed call (events, a cold stream) is spread over all of them."""
    import cupy
    stream = cupy.cuda.get_current_stream()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(calls):
        run()
    end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / calls


@contextlib.contextmanager
def forced(form: str):
    """conv_direct.FORM forced to ``form`` (where it is one of its forms) inside."""
    before = conv_direct.FORM
    conv_direct.FORM = form if form in conv_direct.FORMS else None
    try:
        yield
    finally:
        conv_direct.FORM = before


def tolerance(dtype: str, math: str, reduction: int) -> float:
    """How far two forms' results may differ: twice the GEMM tolerance of the reduction length."""
    from .. import precision
    from ..runtime import dtypes
    row = dtypes.GEMM_BY_PREFIX[dtype]
    floor = 1e-4 if row.dtype.itemsize <= 4 else 1e-10
    return 2.0 * max(4.0 * precision.tolerance(row.dtype, reduction, math=math), floor)


def _gpu(device) -> int:
    """The ordinal of GPU ``device`` (NoGpuError where CuPy finds no CUDA GPU)."""
    from .. import session
    if not isinstance(device, (int, np.integer)) or isinstance(device, bool) or device < 0:
        raise ValueError(f"device: got {device!r}, need a CUDA GPU ordinal (an int >= 0)")
    count = session._cuda_count()
    if count == 0:
        raise NoGpuError("the find step times convolutions on a CUDA GPU, and CuPy finds none (no CuPy, no "
                         "driver or no GPU); nothing was measured or stored")
    if device >= count:
        raise ValueError(f"device: got {device}, but CuPy finds {count} GPU(s) (ordinals 0..{count - 1})")
    return int(device)


def find(x_shape, weight_shape, stride=1, padding=0, dilation=1, groups=1, *, dtype=np.float32,
         layout: str = "nchw", math: str | None = None, direction: str = "fwd", device: int = 0, runs: int = 3,
         db=None, store: bool = True, seed: int = 0, timer: Callable | None = None) -> dict:
    """Time every device-route form of conv{nd}d(x, weight, ...) (shapes as torch takes them; ``direction``
    "fwd", "bwd-data" (conv{nd}d_input) or "bwd-weight" (conv{nd}d_weight)) on CUDA GPU ``device`` with
    random CuPy operands in ``dtype`` and ``layout`` ("nchw" or "cl"; an NCHW problem the device route runs
    channels-last, conv_direct.device_layout, is stored as channels-last), ``runs`` timed runs per form (each
    CALLS calls back to back) after one checked warm-up; store the fastest correct form in the find-db
    (``db``: a PerfDb, a path, or None for the one the runtime reads) unless ``store`` is False.
    ``timer(run)``: seconds of ``run()`` (None: CUDA events). Raises NoGpuError where CuPy finds no GPU, before anything is made.

    Returns a dict: key (ConvKey), text, forms, seconds ({form: [runs]}), best ({form: s}), errors
    ({form: relative error against the first form}), failed ({form: its exception}), bad, form (the winner or
    None), storable (False where the problem runs one form by design: a dilated strided backward-data's col2im),
    stored."""
    if not isinstance(runs, int) or isinstance(runs, bool) or runs < 1:
        raise ValueError(f"runs: got {runs!r}, need an int >= 1")
    key = finddb.problem_key(x_shape, weight_shape, stride, padding, dilation, groups, direction=direction,
                             device="-", dtype=dtype, layout=layout, math=math)
    geo = finddb.forward_geometry(x_shape, weight_shape, stride, padding, dilation, groups, dtype)
    ordinal = _gpu(device)
    import cupy
    key = key._replace(device=finddb.gpu_name(ordinal) or "cuda")
    from ..runtime import dtypes
    dt = dtypes.GEMM_BY_PREFIX[key.dtype].dtype
    rt = runtime_geometry(geo, direction)
    from . import igemm
    given = key.layout  # the operands' layout; the key's is the one the device route runs the problem in
    key = key._replace(layout=conv_direct.device_layout(given, rt, dt, direction))
    forms = forms_for(geo, direction, dt, key.layout, key.math, igemm.capable(ordinal))
    if direction == "bwd-data" and col2im.applies(rt, dt) and not depthwise.applies(rt):  # strided
        forms = ("col2im", "phases") if phases.applies(rt) else ("col2im",)
    alone = len(forms) == 1 and forms[0] == "col2im"  # (timed, nothing to choose)
    with cupy.cuda.Device(ordinal), conv_direct.on_own_gpu():
        call = _caller(geo, direction, given, dt, key.math, tuple(x_shape), tuple(weight_shape),
                       (stride, padding, dilation, groups), seed)
        red = geo.crs if direction == "fwd" else geo.kg * int(np.prod(geo.kernel)) if direction == "bwd-data" \
            else geo.n * geo.p
        out = measure(forms, call, timer or cuda_timer, runs, tolerance(key.dtype, key.math, red))
    out.update(key=key, text=key.text, storable=not alone, stored=False)
    if store and not alone and out["form"] is not None:
        finddb.store(key, out["form"], {f: out["best"][f] for f in forms if f not in out["bad"]}, db)
        out["stored"] = True
    return out


def _operand(rng, shape, channels_last: bool, dt):
    """A random CuPy operand of ``shape`` in ``dt``, channels-last (an NCHW-shaped view of NHWC memory) or not."""
    import cupy
    a = rng.standard_normal(shape, dtype=np.float32)
    if channels_last:
        nd = len(shape) - 2
        a = cupy.ascontiguousarray(cupy.moveaxis(a, 1, -1)).transpose(0, nd + 1, *range(1, nd + 1))
    try:
        return a.astype(dt)
    except (TypeError, ValueError) as e:
        raise ValueError(f"dtype: {dt} operands cannot be made on the GPU ({e})") from None


def entry_points(nd: int) -> tuple:
    """The public forward, backward-data and backward-weights functions of ``nd``-d convolution (by their names
    in the package, whichever module defines them)."""
    from .. import dnn
    return tuple(getattr(dnn, f"conv{nd}d{s}") for s in ("", "_input", "_weight"))


def _caller(geo, direction, layout, dt, math, x_shape, w_shape, conv_args, seed) -> Callable:
    """``call(form)``: the convolution of ``direction`` on random operands with ``form`` forced."""
    import cupy

    rng = cupy.random.default_rng(seed)
    nd = geo.nd
    cl = layout == "cl"
    x, w = _operand(rng, x_shape, cl, dt), _operand(rng, w_shape, False, dt)
    dy = _operand(rng, (geo.n, geo.k, *geo.out_size), cl, dt)
    stride, padding, dilation, groups = conv_args
    fwd, data, weight = entry_points(nd)

    def call(form):
        with forced(form):
            if direction == "fwd":
                return fwd(x, w, None, stride, padding, dilation, groups, math=math)
            if direction == "bwd-data":
                return data(x_shape, w, dy, stride, padding, dilation, groups, math=math)
            return weight(x, w_shape, dy, stride, padding, dilation, groups, math=math)
    return call
