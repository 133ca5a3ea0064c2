"""blasx.dnn.from_torch: a torch.nn.Module traced with torch.fx into a :class:`blasx.dnn.Network` (the IR of
graph.py), its weights copied as float64 numpy arrays. Inference semantics (eval mode): batch norm uses its
running statistics, dropout reads through; what training needs is kept too (a parameter node's module path,
batch norm's momentum, dropout's p and mode). torch is imported only here, when called.

Supported: the modules in ``_MODULES`` and the functions / methods in ``_FUNCTIONS`` / ``_METHODS``
(torch.nn.functional forms and tensor methods of the same layers). Anything else raises one
:class:`UnsupportedError` listing every unsupported node with its name and type.
"""

from __future__ import annotations

import copy
import operator
import os
import threading

from .args import is_int
from .graph import Graph, Node
from .network import Network


class UnsupportedError(ValueError):
    """from_torch met nodes it cannot map; ``nodes`` lists (name, type) of every one."""

    def __init__(self, nodes: list):
        self.nodes = list(nodes)
        listing = "; ".join(f"{name} ({kind})" for name, kind in self.nodes)
        super().__init__(f"module: {len(self.nodes)} unsupported node(s): {listing}")


def _array(t):
    return None if t is None else t.detach().to("cpu").double().numpy().copy()


def _act(fn, **kwargs):
    return "act", {"fn": fn, "kwargs": {k: v for k, v in kwargs.items() if v is not None}}, {}


def _module_table(nn):
    """torch module class -> f(module) -> (op, attrs, params), or why the module's settings are not supported."""
    def conv(m, nd):
        if m.padding_mode != "zeros":
            return f"padding_mode={m.padding_mode!r} (only 'zeros')"
        return "conv", {"nd": nd, "stride": m.stride, "padding": m.padding, "dilation": m.dilation,
                        "groups": m.groups}, {"weight": _array(m.weight), "bias": _array(m.bias)}

    def bn(m):
        if m.running_mean is None:
            return "track_running_stats=False (each batch normalised by its own statistics: it mixes its images)"
        nbt = getattr(m, "num_batches_tracked", None)
        return "batch_norm", {"eps": m.eps, "momentum": m.momentum,
                              "num_batches_tracked": 0 if nbt is None else int(nbt)}, {
                                  "running_mean": _array(m.running_mean),
                                               "running_var": _array(m.running_var),
                                               "weight": _array(m.weight), "bias": _array(m.bias)}

    def pool(kind, nd):
        def f(m):
            if kind == "max_pool" and m.return_indices:
                return "return_indices=True (not converted)"
            attrs = {"nd": nd, "kernel_size": m.kernel_size, "stride": m.stride, "padding": m.padding,
                     "ceil_mode": m.ceil_mode}
            if kind == "max_pool":
                attrs["dilation"] = m.dilation
            else:
                attrs["count_include_pad"] = m.count_include_pad
                if getattr(m, "divisor_override", None) is not None:
                    attrs["divisor_override"] = m.divisor_override
            return kind, attrs, {}
        return f

    def rnn(kind):
        def f(m):
            if getattr(m, "proj_size", 0) or m.dropout:
                return f"proj_size={getattr(m, 'proj_size', 0)}, dropout={m.dropout} (converted: neither)"
            return kind, {"num_layers": m.num_layers, "bidirectional": m.bidirectional,
                          "batch_first": m.batch_first}, {k: _array(v) for k, v in m.state_dict().items()}
        return f

    table = {
        nn.Linear: lambda m: ("linear", {}, {"weight": _array(m.weight), "bias": _array(m.bias)}),
        nn.LayerNorm: lambda m: ("layer_norm", {"normalized_shape": tuple(m.normalized_shape), "eps": m.eps},
                                 {"weight": _array(m.weight), "bias": _array(m.bias)}),
        nn.GroupNorm: lambda m: ("group_norm", {"num_groups": m.num_groups, "eps": m.eps},
                                 {"weight": _array(m.weight), "bias": _array(m.bias)}),
        nn.ReLU: lambda m: _act("relu"), nn.ReLU6: lambda m: _act("relu6"),
        nn.LeakyReLU: lambda m: _act("leaky_relu", negative_slope=m.negative_slope),
        nn.ELU: lambda m: _act("elu", alpha=m.alpha), nn.GELU: lambda m: _act("gelu", approximate=m.approximate),
        nn.SiLU: lambda m: _act("silu"), nn.Sigmoid: lambda m: _act("sigmoid"), nn.Tanh: lambda m: _act("tanh"),
        nn.Hardswish: lambda m: _act("hardswish"), nn.Hardsigmoid: lambda m: _act("hardsigmoid"),
        nn.AdaptiveAvgPool2d: lambda m: ("adaptive_avg_pool", {"output_size": m.output_size}, {}),
        nn.AdaptiveMaxPool2d: lambda m: None if m.return_indices else
        ("adaptive_max_pool", {"output_size": m.output_size}, {}),
        nn.LocalResponseNorm: lambda m: ("lrn", {"size": m.size, "alpha": m.alpha, "beta": m.beta, "k": m.k}, {}),
        nn.Softmax: lambda m: ("softmax", {"dim": m.dim}, {}),
        nn.LogSoftmax: lambda m: ("log_softmax", {"dim": m.dim}, {}),
        nn.Identity: lambda m: ("identity", {}, {}),
        nn.Flatten: lambda m: ("reshape", {}, {}),
        nn.LSTM: rnn("lstm"), nn.GRU: rnn("gru"),
    }
    for nd in (1, 2, 3):
        table[getattr(nn, f"Conv{nd}d")] = (lambda d: lambda m: conv(m, d))(nd)
        table[getattr(nn, f"BatchNorm{nd}d")] = bn
        table[getattr(nn, f"MaxPool{nd}d")] = pool("max_pool", nd)
        table[getattr(nn, f"AvgPool{nd}d")] = pool("avg_pool", nd)
    modes = {nn.Dropout: "element", nn.Dropout1d: "channel", nn.Dropout2d: "channel", nn.Dropout3d: "channel",
             nn.AlphaDropout: "alpha"}
    for cls, mode in modes.items():
        table[cls] = (lambda md: lambda m: ("dropout", {"p": m.p, "mode": md}, {}))(mode)
    return table


def _softmax(op, a, k):
    b = _bind(a[1:], k, ["dim", "_stacklevel", "dtype"])
    return None if b.get("dtype") is not None else (op, {"dim": b.get("dim")}, {})


def _bind(args, kwargs, names):
    """torch's positional ``args`` + ``kwargs`` as a dict by parameter name (``names`` in torch's order)."""
    out = dict(zip(names, args))
    out.update(kwargs)
    return out


def _function_table(torch):
    F = torch.nn.functional

    def act(fn, pname=None):
        return lambda a, k: _act(fn, **({pname: _bind(a[1:], k, [pname]).get(pname)} if pname else {}))

    def pool(kind, nd, names):
        def f(a, k):
            b = _bind(a[1:], k, names)
            if b.get("return_indices"):
                return None
            b.pop("return_indices", None)
            return kind, {"nd": nd, **b}, {}
        return f

    mp = ["kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"]
    ap = ["kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"]
    table = {
        F.relu: act("relu"), torch.relu: act("relu"), F.relu6: act("relu6"),
        F.leaky_relu: act("leaky_relu", "negative_slope"), F.elu: act("elu", "alpha"),
        F.gelu: lambda a, k: _act("gelu", approximate=k.get("approximate")), F.silu: act("silu"),
        F.sigmoid: act("sigmoid"), torch.sigmoid: act("sigmoid"), F.tanh: act("tanh"), torch.tanh: act("tanh"),
        F.hardswish: act("hardswish"), F.hardsigmoid: act("hardsigmoid"),
        F.adaptive_avg_pool2d: lambda a, k: ("adaptive_avg_pool",
                                             {"output_size": _bind(a[1:], k, ["output_size"])["output_size"]}, {}),
        F.dropout: lambda a, k: ("dropout", {"p": _bind(a[1:], k, ["p"]).get("p", 0.5), "mode": "element",
                                             "training": _bind(a[1:], k, ["p", "training"]).get("training", True)},
                                 {}),
        torch.flatten: lambda a, k: ("reshape", {}, {}),
        F.softmax: lambda a, k: _softmax("softmax", a, k),
        F.log_softmax: lambda a, k: _softmax("log_softmax", a, k),
        F.local_response_norm: lambda a, k: ("lrn", _bind(a[1:], k, ["size", "alpha", "beta", "k"]), {}),
        operator.add: lambda a, k: ("add", {}, {}), operator.iadd: lambda a, k: ("add", {}, {}),
        torch.add: lambda a, k: None if k.get("alpha", 1) != 1 else ("add", {}, {}),
        torch.cat: lambda a, k: ("cat", {"dim": k.get("axis", _bind(a[1:], k, ["dim"]).get("dim", 0))}, {}),
        operator.getitem: lambda a, k: ("getitem", {"index": a[1]}, {}),
    }
    for nd in (1, 2, 3):
        table[getattr(F, f"max_pool{nd}d")] = pool("max_pool", nd, mp)
        table[getattr(F, f"avg_pool{nd}d")] = pool("avg_pool", nd, ap[:5] if nd == 1 else ap)
    return table


_METHODS = {
    "view": ("reshape", {}), "reshape": ("reshape", {}), "flatten": ("reshape", {}), "contiguous": ("identity", {}),
    "relu": ("act", {"fn": "relu", "kwargs": {}}), "sigmoid": ("act", {"fn": "sigmoid", "kwargs": {}}),
    "tanh": ("act", {"fn": "tanh", "kwargs": {}}), "add": ("add", {}), "__add__": ("add", {}),
}


def _traced_matches(torch, module, gm, shape, dtype) -> bool:
    """Whether the fx trace gives the module's own output on a random input (no gradients; the module's buffers
    as they were)."""
    probe = torch.randn((max(2, shape[0]), *shape[1:]), generator=torch.Generator().manual_seed(0),
                        dtype=torch.float64).to(dtype)  # (2 images: a training-mode batch norm takes 1 per channel)

    kept = [b.detach().clone() for b in module.buffers()]  # (a batch norm in training mode updates its own)

    def run(f):
        with torch.random.fork_rng(devices=[]):  # (random ops draw the same on both sides; the caller's RNG kept)
            torch.manual_seed(0)
            try:
                return f(probe.clone())
            finally:
                for b, k in zip(module.buffers(), kept):
                    b.copy_(k)
    try:
        want = run(module)
    except Exception:  # noqa: BLE001 - the module itself does not run on the probe: nothing to compare
        return True
    got = run(gm)
    if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)) or want.shape != got.shape:
        return isinstance(want, torch.Tensor) == isinstance(got, torch.Tensor)
    want, got = torch.nan_to_num(want.double()), torch.nan_to_num(got.double())
    return bool((want - got).norm() <= 1e-6 * want.norm())


def _resolve(alias: dict, name: str) -> str:
    while name in alias:
        name = alias[name]
    return name


#: mapped ops whose value is its input's memory in torch (eval-mode dropout returns its input itself)
_VIEWS = frozenset({"reshape", "getitem", "identity", "dropout"})


def _shared_reader(views: dict, name: str, fx_nodes: dict, order: dict, writer) -> str | None:
    """Another value sharing ``name``'s memory (its base, a view of it or of its base) that a node after
    ``writer`` reads, or None."""
    def root(v):
        while v in views:
            v = views[v]
        return v
    base = root(name)
    for v in {base, *views}:
        if v != name and root(v) == base and v in fx_nodes \
                and any(order[u.name] > order[writer.name] for u in fx_nodes[v].users):
            return v
    return None


def _in_place(n, modules) -> bool:
    """The fx node writes its first tensor argument (``inplace=True``, ``+=``): torch's later readers of that
    tensor see the result, so they read this node."""
    import inspect
    if n.op == "call_module":
        return bool(getattr(modules[n.target], "inplace", False))
    if n.op == "call_function":
        if n.target is operator.iadd:
            return True
        try:
            return bool(inspect.signature(n.target).bind(*n.args, **n.kwargs).arguments.get("inplace", False))
        except (TypeError, ValueError):
            return bool(n.kwargs.get("inplace", False))
    return False


def _softmax_dim(dim, ndim: int) -> int:
    """torch's dim of a softmax (None: its legacy choice, 0 for 0-, 1- and 3-D inputs, else 1)."""
    if dim is None:
        return 0 if ndim in (0, 1, 3) else 1
    return dim % ndim if ndim else dim


#: ops that act on each row of the last dim alone: any leading dim may be the batch
ROW_WISE = frozenset({"linear", "dropout", "act", "identity", "add"})


def _batch_axis_use(n, mapped, batch_axis: int) -> str | None:
    """Why the mapped node mixes or selects the batch's images (along ``batch_axis``), which the network's
    per-chunk runs cannot do; None where it does not."""
    op, attrs = mapped[0], mapped[1]
    ndim = len(_shape_of(n) or ())
    if op in ("softmax", "log_softmax") and ndim and attrs["dim"] == batch_axis:  # (its dim resolved)
        return f"over the batch axis (dim {batch_axis})"
    if op == "cat" and ndim and attrs["dim"] % ndim == batch_axis:
        return f"along the batch axis (dim {batch_axis})"
    if op == "getitem" and n.args and _shape_of(n.args[0]) is not None:  # (a tensor's items, not a tuple's)
        index = attrs["index"] if isinstance(attrs["index"], tuple) else (attrs["index"],)
        axis = 0  # the input's axis the next item indexes
        for item in index:
            if item is Ellipsis:
                break  # (the axes after it are counted from the end)
            if item is None:
                if axis <= batch_axis:
                    return f"inserting an axis before the batch axis ({attrs['index']!r})"
                continue
            if axis == batch_axis and item != slice(None):
                return f"indexing the batch axis ({attrs['index']!r})"
            axis += 1
    return None


def _shape_of(node):
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _tensor_inputs(fx_node) -> list:
    """The fx nodes among a call's arguments (lists flattened), in order."""
    import torch.fx as fx
    out = []
    fx.node.map_arg((fx_node.args, fx_node.kwargs), lambda n: out.append(n) or n)
    return out


_tracing = threading.Lock()


def _after_fork_in_child() -> None:
    global _tracing
    _tracing = threading.Lock()  # (a parent thread may have held it at the fork)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _private_copy(torch, module):
    """A deep copy of ``module`` to trace (the module itself where it cannot be copied: then traced in place,
    its mode put back after)."""
    try:
        return copy.deepcopy(module)
    except Exception:  # noqa: BLE001 - an attribute that does not copy
        return module


def from_torch(module, example_input_shape):
    """A :class:`blasx.dnn.Network` of ``module`` (a torch.nn.Module taking one tensor), traced with
    torch.fx and shape-checked on a zero input of ``example_input_shape`` (batch first). Weights are copied;
    the module is not modified. Raises :class:`UnsupportedError` listing every node it cannot map."""
    import torch
    import torch.fx as fx
    from torch.fx.passes.shape_prop import ShapeProp

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    try:
        given = tuple(example_input_shape)
    except TypeError:
        given = None
    if given is None or len(given) < 2 or not all(is_int(v) and v >= 1 for v in given):
        raise ValueError(f"example_input_shape: got {example_input_shape!r}; need (batch, ...) of positive ints")
    shape = tuple(int(v) for v in given)
    # A copy is traced and probed, not the module: its mode, buffers and running statistics stay as they are
    # for a thread using it meanwhile; one trace at a time (torch.fx patches nn.Module.__call__ process-wide).
    module = _private_copy(torch, module)
    with _tracing:
        gm = fx.symbolic_trace(module)
        was_training = module.training
        try:
            module.eval()
            gm.eval()
            with torch.no_grad():
                first = next(module.parameters(), None)
                first = next(module.buffers(), None) if first is None else first  # (a module of buffers alone)
                dtype = (torch.zeros(()) if first is None else first).dtype
                try:
                    ShapeProp(gm).propagate(torch.zeros(shape, dtype=dtype))
                except RuntimeError as e:  # (a shape the module cannot take: torch's own message, named)
                    why = str(e.__cause__ or e).strip().splitlines()
                    raise ValueError(f"example_input_shape: the module does not run on an input of shape {shape}: "
                                     f"{why[-1] if why else type(e).__name__}") from None
                module.train(was_training)  # (the mode the trace took its flags from)
                gm.train(was_training)
                faithful = _traced_matches(torch, module, gm, shape, dtype)
        finally:
            module.train(was_training)
    modules = dict(gm.named_modules())
    mtable, ftable = _module_table(torch.nn), _function_table(torch)
    nodes, bad, skipped, output, batch_axis, shared, alias = [], [], set(), None, 0, {}, {}
    views, fx_nodes = {}, {x.name: x for x in gm.graph.nodes}  # views: a value -> the value it views
    ops, states = {}, {}  # a node -> its op; a batch-first recurrent layer's states -> "tuple" / "tensor" (batch dim 1)
    order = {name: i for i, name in enumerate(fx_nodes)}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if nodes:
                bad.append((n.name, "second input (placeholder)"))
            nodes.append(Node(n.name, "input", (), {"shape": shape[1:]}))
            continue
        if n.op == "output":
            out = n.args[0]
            if isinstance(out, fx.Node):
                output = out.name
            else:
                bad.append((n.name, f"output of type {type(out).__name__} (one tensor only)"))
            continue
        if n.op == "call_method" and n.target == "size":
            skipped.add(n.name)  # read only by view/reshape, whose shapes come from the trace
            continue
        mapped, kind = None, None
        if n.op == "call_module":
            m = modules[n.target]
            kind = f"{type(m).__module__}.{type(m).__qualname__}"
            if m._forward_hooks or m._forward_pre_hooks:  # (the trace runs them; the network would not)
                bad.append((n.name, f"{kind} with forward hooks or pre-hooks (not converted; remove them first)"))
                continue
            f = mtable.get(type(m))
            mapped = f(m) if f is not None else None
            if type(mapped) is str:  # (the module's settings, and why they are not supported)
                bad.append((n.name, f"{kind} with {mapped}"))
                continue
        elif n.op == "call_function":
            kind = f"call_function {getattr(n.target, '__module__', '')}.{getattr(n.target, '__name__', n.target)}"
            f = ftable.get(n.target)
            mapped = f(n.args, n.kwargs) if f is not None else None
        elif n.op == "call_method":
            kind = f"call_method Tensor.{n.target}"
            if n.target in _METHODS and not (n.target == "add" and (n.kwargs.get("alpha", 1) != 1 or len(n.args) > 2)):
                op, attrs = _METHODS[n.target]
                mapped = op, dict(attrs), {}
        else:
            kind = n.op
        ins = [_resolve(alias, a.name) for a in _tensor_inputs(n) if a.name not in skipped]
        if mapped is not None and mapped[0] in ("softmax", "log_softmax"):
            if mapped[1]["dim"] is None and _shape_of(n) is None:  # (torch's implicit dim follows the rank)
                bad.append((n.name, f"{kind} with an implicit dim on an input of unknown rank"))
                continue
            mapped = mapped[0], {"dim": _softmax_dim(mapped[1]["dim"], len(_shape_of(n) or ()))}, {}
        state = states.get(ins[0]) if ins else None
        if any(i in states for i in ins[1:]) or (state and (mapped is None or mapped[0] != "getitem")):
            bad.append((n.name, f"{kind} on a recurrent layer's h_n / c_n, whose batch is dim 1 in a batch-first "
                                f"network (select a layer first: h_n[-1])"))
            continue
        why = None if mapped is None else _batch_axis_use(n, mapped, 1 if state == "tensor" else batch_axis)
        if why is not None:
            bad.append((n.name, f"{kind} {why}"))
            continue
        if mapped is not None and mapped[0] == "reshape":
            out_shape, in_shape = _shape_of(n), shape
            if out_shape is None or batch_axis or out_shape[0] != in_shape[0]:
                mapped = None  # a reshape that moves the batch dim (or of a time-major network: not followed)
            else:
                mapped = "reshape", {"shape": out_shape[1:]}, {}
        if mapped is not None and mapped[0] == "getitem" and any(isinstance(v, fx.Node) for v in
                                                                 (mapped[1]["index"] if isinstance(
                                                                     mapped[1]["index"], tuple) else ())):
            mapped = None
        if mapped is None:
            bad.append((n.name, kind))
            continue
        op, attrs, params = mapped
        if op in ("lstm", "gru") and not attrs["batch_first"] and batch_axis == 0:
            # time-major: the batch is dim 1 from the input on, if every node before works row by row
            mixing = [m.name for m in nodes[1:] if m.op not in ROW_WISE]
            if mixing:
                bad.append((n.name, f"{kind} with batch_first=False after {', '.join(mixing)}, which may mix its "
                                    f"batch dim 1 (put it first, after row-wise layers only, or use batch_first=True)"))
                continue
            batch_axis = 1
        if op in ("add", "cat") and len(ins) < 2:
            bad.append((n.name, f"{kind} with a non-tensor operand"))
            continue
        params = {k: v for k, v in params.items() if v is not None}
        if n.op == "call_module" and params:  # torch's parameter names are "<module>.<name>" (training)
            attrs = {**attrs, "module": n.target}
            if n.target in shared:  # a module called twice: its nodes share the arrays
                params = shared[n.target]
            shared.setdefault(n.target, params)
        if op == "getitem" and batch_axis == 0 and ins:
            index = attrs["index"]
            first = index[0] if isinstance(index, tuple) and index else index
            if ops.get(ins[0]) in ("lstm", "gru") and index in (1, -1):  # (h_n, c_n) of an LSTM, h_n of a GRU
                states[n.name] = "tuple" if _shape_of(n) is None else "tensor"
            elif state == "tuple" or (state == "tensor" and type(first) is not int):  # (an int drops the layers' dim)
                states[n.name] = "tensor"
        ops[n.name] = op
        nodes.append(Node(n.name, op, tuple(ins[:1] if op in ("reshape", "getitem") else ins), attrs, params))
        if op in _VIEWS and ins:
            views[n.name] = ins[0]
        if ins and _in_place(n, modules):  # later readers of the written tensor read this node's value
            other = _shared_reader(views, ins[0], fx_nodes, order, n)
            if other is not None:
                bad.append((n.name, f"{kind}: an in-place update of a tensor sharing memory with {other}, read "
                                    "later (torch's readers of it see the write)"))
            alias[ins[0]] = n.name
    if output is not None:
        output = _resolve(alias, output)
        if output in states:
            bad.append((output, "output: a recurrent layer's h_n / c_n, whose batch is dim 1 in a batch-first network "
                                "(return h_n[-1], or the layer's output sequence)"))
    if not faithful:
        bad.append(("forward", "the traced graph computes otherwise than the module (torch.fx records `y += x` "
                               "as `y + x`: an in-place update of a tensor read again, or code it cannot follow)"))
    if bad:
        raise UnsupportedError(bad)
    if batch_axis and nodes:  # time-major: the input's per-image shape leaves out dim 1, not dim 0
        nodes[0] = Node(nodes[0].name, "input", (), {"shape": shape[:batch_axis] + shape[batch_axis + 1:]})
    graph = Graph(nodes, output, batch_axis).validate()
    return Network(graph, input_shape=shape)
