"""Recurrent-layer parameters by torch's names (``nn.LSTM/GRU/RNN.state_dict()``), validated and laid out.

Names: ``weight_ih_l{k}`` (G*H, in), ``weight_hh_l{k}`` (G*H, H or P), ``bias_ih_l{k}``, ``bias_hh_l{k}``
(G*H,), ``weight_hr_l{k}`` (P, H) with ``proj_size`` P > 0 (LSTM only), and the ``_reverse`` suffix for the
second direction. G is 4 for LSTM (gates i, f, g, o), 3 for GRU (r, z, n) and 1 for RNN. Every array must
have x's dtype and live where x lives, except that with a numpy x they may live on a GPU (``resident``: kept there
for a call that runs on the GPUs, rnn_host.py; read back otherwise); torch tensors are taken as they are
(converted by DLPack/numpy).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from ..operands import is_cupy
from ..threadlocal import setting
from .args import dtype_text

#: Gate count per mode.
GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


@dataclass(frozen=True)
class Cell:
    """The parameters of one layer and direction (arrays of x's module and dtype)."""
    w_ih: object  # (G*H, in)
    w_hh: object  # (G*H, out), out = P or H
    b_ih: object | None  # (G*H,)
    b_hh: object | None
    w_hr: object | None  # (P, H)


@dataclass(frozen=True)
class Spec:
    """Shape facts of a recurrent stack: mode, sizes and the cells, ``cells[layer][direction]``."""
    mode: str
    input_size: int
    hidden_size: int
    proj_size: int
    num_layers: int
    num_dirs: int
    bias: bool
    cells: tuple

    @property
    def gates(self) -> int:
        return GATES[self.mode]

    @property
    def out_size(self) -> int:
        """Features of h (and of each direction's part of y): P with a projection, else H."""
        return self.proj_size or self.hidden_size


def suffix(layer: int, direction: int) -> str:
    return f"_l{layer}" + ("_reverse" if direction else "")


def _bf16_from_torch(t):
    import ml_dtypes
    return t.view(__import__("torch").int16).numpy().view(ml_dtypes.bfloat16)


_views: dict = {}  # id(torch tensor) -> (weak reference to it, its layout, its CuPy view); dropped with the tensor
_views_lock = threading.RLock()  # re-entered when a collection drops an entry while the lock is held
MAX_VIEWS = 4096


def _cuda_view(t, xp):
    """A CuPy view of the CUDA torch tensor ``t`` (DLPack through torch is the costliest part of a small call's
    checks). The view made for this tensor object is reused while its storage, shape, strides and dtype are
    unchanged and both torch and CuPy issue on the legacy default stream, where DLPack's stream hand-over orders
    nothing (so none is skipped). An entry goes when its tensor does (the view holds the tensor's memory)."""
    key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
    with _views_lock:
        hit = _views.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == key and _default_streams(t.device.index, xp):
        return hit[2]
    view = xp.from_dlpack(t.detach())
    ident = id(t)
    ref = weakref.ref(t, lambda _r, k=ident: _drop(k, _r))
    with _views_lock:
        if len(_views) >= MAX_VIEWS:
            _views.clear()
        _views[ident] = (ref, key, view)
    return view


def _drop(ident: int, ref) -> None:
    with _views_lock:
        hit = _views.get(ident)
        if hit is not None and hit[0] is ref:
            del _views[ident]


def _default_streams(device: int, xp) -> bool:
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # the public call builds a Stream object each time
    stream = raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream
    return stream == 0 and xp.cuda.get_current_stream().ptr == 0


def as_array(name: str, v, xp, resident: bool = False):
    """``v`` as an array of ``xp`` (numpy or cupy); torch tensors converted without copies where possible. With a
    numpy ``xp``, a GPU array (CuPy or CUDA torch) stays a CuPy array where ``resident``, else is read back."""
    mod = type(v).__module__ or ""
    if mod.startswith("torch"):
        if xp is np:
            if resident and v.device.type == "cuda" and str(v.dtype) != "torch.bfloat16":
                import cupy
                return _cuda_view(v, cupy)
            t = v.detach().cpu()
            if str(t.dtype) == "torch.bfloat16":
                return _bf16_from_torch(t)
            return t.numpy()
        if v.device.type != "cuda":
            raise TypeError(f"params[{name!r}]: a CPU torch tensor for a cupy x; move it to the GPU (or pass numpy x)")
        return _cuda_view(v, xp)
    if xp is np:
        if is_cupy(v):
            return v if resident else v.get()
        if not isinstance(v, np.ndarray):
            raise TypeError(f"params[{name!r}]: expected an array, got {type(v).__name__}")
        return v if type(v) is np.ndarray else np.asarray(v)  # (np.matrix and other subclasses: a plain view)
    if not is_cupy(v):
        raise TypeError(f"params[{name!r}]: got {type(v).__name__} for a cupy x; pass cupy arrays on x's device")
    return v


def _get(params, name: str, shape: tuple, xp, dtype, why: str, resident: bool = False):
    if name not in params:
        raise KeyError(f"params: missing {name!r}, expected shape {shape} ({why})")
    a = as_array(name, params[name], xp, resident)
    if tuple(a.shape) != shape:
        raise ValueError(f"params[{name!r}]: expected shape {shape} ({why}), got {tuple(a.shape)}")
    if a.dtype != dtype:
        raise TypeError(f"params[{name!r}]: dtype {dtype_text(a.dtype)} differs from x's {np.dtype(dtype)}; "
                        f"every parameter must have x's dtype")
    return a


_specs: dict = {}  # (id(params), parse's arguments) -> (Spec, ((name, weak ref to the tensor, layout), ...), devices)
MAX_SPECS = 64


def parse(params, mode: str, input_size: int, *, num_layers: int, bidirectional: bool, proj_size: int,
          xp, dtype, resident: bool = False) -> Spec:
    """The validated :class:`Spec` of ``params``; raises naming the parameter and its expected shape.
    ``resident`` (numpy ``xp``): GPU arrays are kept as CuPy arrays (see the module docstring).

    The hidden size comes from ``weight_ih_l0`` (its rows / G); biases are all present or all absent.

    With a CuPy ``xp`` and CUDA torch tensors or CuPy arrays as every value, the Spec is kept and handed out
    again while the mapping holds the same names bound to the same objects of unchanged memory, shape, strides
    and dtype (for tensors, the conditions on which :func:`_cuda_view` reuses its views); an entry goes when
    one of its arrays does."""
    given = getattr(_given, "v", None)
    if given is not None and given[0] is params:
        return given[1]
    key = None
    if xp is not np:
        key = (id(params), mode, input_size, num_layers, bidirectional, proj_size, np.dtype(dtype))
        hit = _specs.get(key)
        if hit is not None and _unchanged(params, hit[1], hit[2], xp):
            return hit[0]
    spec = _parse(params, mode, input_size, num_layers=num_layers, bidirectional=bidirectional,
                  proj_size=proj_size, xp=xp, dtype=dtype, resident=resident)
    if key is not None:
        _remember(key, spec, params)
    return spec


_given = threading.local()  # .v: (params, its Spec) that parse returns as it is (a whole-call capture's)


def given(params, spec: Spec):
    """Within it, this thread's :func:`parse` of ``params`` returns ``spec`` (checked just before): a capture
    makes no views (DLPack orders the capturing stream after torch's, which a capture refuses)."""
    return setting(_given, "v", (params, spec))


def _layout(t) -> tuple:
    if is_cupy(t):
        return (t.data.ptr, tuple(t.shape), tuple(t.strides), t.dtype)
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _torch_cuda(v) -> bool:
    return (type(v).__module__ or "").startswith("torch") and v.device.type == "cuda"


def _unchanged(params, entries, devices, xp) -> bool:
    """Whether ``params`` holds the same arrays, of unchanged layout, as when its Spec was kept (torch tensors:
    also both libraries on the default stream, where their views were made; ``devices``: theirs)."""
    if len(params) != len(entries) or not all(_default_streams(d, xp) for d in devices):
        return False
    for name, ref, layout in entries:
        try:
            v = params[name]
        except KeyError:
            return False
        if v is not ref() or _layout(v) != layout:
            return False
    return True


def _remember(key, spec: Spec, params) -> None:
    """Keep ``spec`` for :func:`parse` when every value of ``params`` is a CUDA torch tensor or a CuPy array
    (the Spec holds them, or views of them, as they are: no copies)."""
    values = [(name, params[name]) for name in params.keys()]
    if not values or not hasattr(params, "__len__") or not all(_torch_cuda(v) or is_cupy(v) for _, v in values):
        return

    def drop(ref):
        with _views_lock:
            hit = _specs.get(key)
            if hit is not None and any(r is ref for _, r, _ in hit[1]):
                del _specs[key]
    entries = tuple((name, weakref.ref(v, drop), _layout(v)) for name, v in values)
    devices = tuple(sorted({v.device.index for _, v in values if _torch_cuda(v)}))
    with _views_lock:
        if len(_specs) >= MAX_SPECS:
            _specs.clear()
        _specs[key] = (spec, entries, devices)


def _parse(params, mode: str, input_size: int, *, num_layers: int, bidirectional: bool, proj_size: int,
           xp, dtype, resident: bool) -> Spec:
    if not hasattr(params, "keys") or not hasattr(params, "__getitem__"):
        raise TypeError(f"params: expected a mapping of torch's names to arrays (a state_dict), got "
                        f"{type(params).__name__}")
    for name, v in (("num_layers", num_layers), ("proj_size", proj_size)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < (1 if name == "num_layers" else 0):
            raise ValueError(f"{name}: got {v!r}, expected an int >= {1 if name == 'num_layers' else 0}")
    if proj_size and mode != "lstm":
        raise ValueError(f"proj_size: got {proj_size}; a projection exists for lstm only (0 for {mode})")
    g = GATES[mode]
    first = "weight_ih_l0"
    if first not in params:
        raise KeyError(f"params: missing {first!r}, expected shape ({g}*hidden_size, {input_size})")
    shape0 = tuple(params[first].shape) if hasattr(params[first], "shape") else \
        tuple(as_array(first, params[first], xp).shape)
    rows = shape0[0] if len(shape0) == 2 else 0
    if rows % g or rows == 0:
        raise ValueError(f"params[{first!r}]: expected shape ({g}*hidden_size, {input_size}) for {mode}, "
                         f"got {shape0}")
    if len(shape0) == 2 and shape0[1] != input_size:
        raise ValueError(f"x: got {input_size} features (its last dim), but params[{first!r}] has shape {shape0}: "
                         f"the model's input_size is {shape0[1]}")
    if "weight_hr_l0" in params and mode != "lstm":
        raise ValueError(f"params: unexpected 'weight_hr_l0' for {mode} (an LSTM's projection; {mode} has none)")
    if "weight_hr_l0" in params and not proj_size:
        raise ValueError("proj_size: got 0, but params has 'weight_hr_l0' (an LSTM with a projection): pass "
                         "proj_size=weight_hr_l0.shape[0]")
    h = rows // g
    if proj_size >= h:
        raise ValueError(f"proj_size: got {proj_size}, expected less than hidden_size {h}")
    out = proj_size or h
    dirs = 2 if bidirectional else 1
    bias = "bias_ih_l0" in params
    cells, expected = [], set()
    for layer in range(num_layers):
        row = []
        layer_in = input_size if layer == 0 else dirs * out
        for d in range(dirs):
            s = suffix(layer, d)
            names = ["weight_ih" + s, "weight_hh" + s] + (["bias_ih" + s, "bias_hh" + s] if bias else []) + (
                ["weight_hr" + s] if proj_size else [])
            expected.update(names)
            def get(name, shape, why):
                return _get(params, name + s, shape, xp, dtype, why, resident)
            w_ih = get("weight_ih", (g * h, layer_in), f"{g}*hidden_size x " + (
                "input_size" if layer == 0 else f"{dirs}*{'proj' if proj_size else 'hidden'}_size"))
            w_hh = get("weight_hh", (g * h, out), f"{g}*hidden_size x {'proj' if proj_size else 'hidden'}_size")
            b_ih = get("bias_ih", (g * h,), f"{g}*hidden_size") if bias else None
            b_hh = get("bias_hh", (g * h,), f"{g}*hidden_size") if bias else None
            w_hr = get("weight_hr", (proj_size, h), "proj_size x hidden_size") if proj_size else None
            row.append(Cell(w_ih, w_hh, b_ih, b_hh, w_hr))
        cells.append(tuple(row))
    extra = sorted(set(params.keys()) - expected)
    if extra:
        raise KeyError(f"params: unexpected {extra[0]!r} for {mode} with num_layers={num_layers}, "
                       f"bidirectional={bidirectional}, proj_size={proj_size}, bias={bias} "
                       f"(expected names: {', '.join(sorted(expected))})")
    return Spec(mode, int(input_size), h, int(proj_size), int(num_layers), dirs, bias, tuple(cells))


def names(spec: Spec) -> list[str]:
    """Every parameter name of ``spec``, in torch's state_dict order."""
    return list(arrays(spec))


_WEIGHTS = (("w_ih", "weight_ih"), ("w_hh", "weight_hh"), ("w_hr", "weight_hr"))  # what a backward reads


def _is_torch(v) -> bool:
    return (type(v).__module__ or "").startswith("torch")


def stash(spec: Spec, params) -> Spec:
    """``spec`` for a training forward: the weights its backward reads (w_ih, w_hh, w_hr; no bias) copied, so its
    saved state keeps the values the forward ran with whatever the caller writes into its arrays later; a torch
    tensor's is kept as it is, its version counter checked instead (:func:`versions`)."""
    def kept(cell, layer, d):
        s = suffix(layer, d)
        return dataclasses.replace(cell, **{f: a if a is None or _is_torch(params[name + s]) else a.copy()
                                            for f, name in _WEIGHTS for a in (getattr(cell, f),)})
    return dataclasses.replace(spec, cells=tuple(tuple(kept(c, layer, d) for d, c in enumerate(row))
                                                 for layer, row in enumerate(spec.cells)))


def versions(params, spec: Spec) -> tuple:
    """(name, tensor, its version counter) of each torch tensor among the weights a backward reads."""
    got = []
    for layer, row in enumerate(spec.cells):
        for d, cell in enumerate(row):
            for f, name in _WEIGHTS:
                v = params[name + suffix(layer, d)] if getattr(cell, f) is not None else None
                if _is_torch(v):
                    got.append((name + suffix(layer, d), v, v._version))
    return tuple(got)


def check_versions(got: tuple) -> None:
    """Raises (before any work) where a torch weight of :func:`versions` was written in place since."""
    for name, v, version in got:
        if v._version != version:
            raise RuntimeError(f"params[{name!r}]: written in place after the forward (training=True) whose saved "
                               f"state this is (torch version {version}, now {v._version}); its backward needs the "
                               f"values that forward used: run the backward before updating the parameters, or "
                               f"the forward again (torch's autograd raises here too)")


def arrays(spec: Spec) -> dict:
    """Every parameter of ``spec`` by torch's name (the parsed arrays), in state_dict order."""
    got = {}
    for layer, row in enumerate(spec.cells):
        for d, c in enumerate(row):
            s = suffix(layer, d)
            for key, a in (("weight_ih", c.w_ih), ("weight_hh", c.w_hh), ("bias_ih", c.b_ih), ("bias_hh", c.b_hh),
                           ("weight_hr", c.w_hr)):
                if a is not None:
                    got[key + s] = a
    return got


def on_host(spec: Spec) -> Spec:
    """``spec`` with every resident (CuPy) parameter read back to the host."""
    def host(a):
        return a.get() if is_cupy(a) else a
    cells = tuple(tuple(Cell(*(None if a is None else host(a) for a in (c.w_ih, c.w_hh, c.b_ih, c.b_hh, c.w_hr)))
                        for c in row) for row in spec.cells)
    return dataclasses.replace(spec, cells=cells)
