"""The network IR of blasx.dnn: a list of :class:`Node` in topological order, each naming its inputs;
built in code (:class:`Builder`) or by :func:`blasx.dnn.from_torch`. Parameters are float64 numpy arrays
(the executor casts them to the run's type once per device), so passes fold them exactly.

Op kinds (``Node.op``) and what they run, one table: ``FUNCTIONS`` maps a kind to its blasx.dnn function
name ("{nd}" is the node's ``nd`` attribute); ``ACTIVATIONS`` lists the activation functions an ``act``
node may name. Shapes are inferred per node from the input's (:func:`infer_shapes`), batch first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

#: op kind -> the blasx.dnn function that runs it (None: done by the executor itself)
FUNCTIONS = {
    "input": None, "conv": "conv{nd}d", "linear": "linear", "batch_norm": "batch_norm", "layer_norm": "layer_norm",
    "group_norm": "group_norm", "max_pool": "max_pool{nd}d", "avg_pool": "avg_pool{nd}d",
    "adaptive_avg_pool": "adaptive_avg_pool2d", "adaptive_max_pool": "adaptive_max_pool2d",
    "lrn": "local_response_norm", "softmax": "softmax", "log_softmax": "log_softmax", "act": "{fn}",
    "dropout": None, "identity": None, "add": "add", "cat": "cat", "reshape": None, "getitem": None,
    "lstm": "lstm", "gru": "gru",
}
#: activation functions of ``act`` nodes (torch.nn.functional's names; ``kwargs`` are their parameters)
ACTIVATIONS = ("relu", "relu6", "leaky_relu", "elu", "gelu", "silu", "sigmoid", "tanh", "hardswish", "hardsigmoid")
#: kinds whose output is a view of their first input (no buffer of their own)
ALIASES = ("dropout", "identity", "reshape", "getitem")


@dataclass
class Node:
    """One layer: ``name`` (unique), ``op`` (a key of FUNCTIONS), ``inputs`` (names of earlier nodes),
    ``attrs`` (hyper-parameters; a conv/linear's fused epilogue: ``activation``, ``residual`` (its input
    is ``inputs[1]``) and ``fused`` (the names of the nodes folded in)), ``params`` (float64 arrays)."""

    name: str
    op: str
    inputs: tuple = ()
    attrs: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)

    def with_(self, **changes) -> "Node":
        """A copy with ``changes``; attrs/params are copied so the original is never modified."""
        changes.setdefault("attrs", dict(self.attrs))
        changes.setdefault("params", dict(self.params))
        return replace(self, **changes)


@dataclass
class Graph:
    """Nodes in topological order (the first is the ``input``) and the name of the output node."""

    nodes: list
    output: str
    batch_axis: int = 0

    def by_name(self) -> dict:
        return {n.name: n for n in self.nodes}

    def users(self) -> dict:
        """name -> names of the nodes reading it (the output counts as a user named '')."""
        out = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.name)
        out[self.output].append("")
        return out

    def validate(self) -> "Graph":
        """Raise ValueError unless names are unique, inputs come earlier, kinds are known."""
        seen = set()
        for n in self.nodes:
            if n.op not in FUNCTIONS:
                raise ValueError(f"node {n.name!r}: op {n.op!r} unknown; allowed: {', '.join(FUNCTIONS)}")
            if n.name in seen:
                raise ValueError(f"node {n.name!r}: the name is used twice")
            late = [i for i in n.inputs if i not in seen]
            if late:
                raise ValueError(f"node {n.name!r}: inputs {late} are not earlier nodes")
            if n.op == "act" and n.attrs.get("fn") not in ACTIVATIONS:
                raise ValueError(f"node {n.name!r}: activation {n.attrs.get('fn')!r}; "
                                 f"allowed: {', '.join(ACTIVATIONS)}")
            seen.add(n.name)
        if not self.nodes or self.nodes[0].op != "input" or sum(n.op == "input" for n in self.nodes) != 1:
            raise ValueError("nodes: the first node, and only it, must be the 'input'")
        if self.output not in seen:
            raise ValueError(f"output: {self.output!r} is not a node")
        return self


def function_name(node: Node) -> str | None:
    """The blasx.dnn function that runs ``node`` (None: the executor does it)."""
    fn = FUNCTIONS[node.op]
    return None if fn is None else fn.format(nd=node.attrs.get("nd", 2), fn=node.attrs.get("fn", ""))


# ---------------------------------------------------------------- shapes

def _tuple(v, nd: int) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * nd


def _window(size, k, s, p, d, ceil_mode=False) -> int:
    span = size + 2 * p - d * (k - 1) - 1
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= size + p:  # torch: the last window must start inside the input or left padding
        out -= 1
    return out


def _conv_shape(n: Node, x: tuple) -> tuple:
    nd = n.attrs["nd"]
    w = n.params["weight"]
    k = w.shape[2:]
    s, d = _tuple(n.attrs.get("stride", 1), nd), _tuple(n.attrs.get("dilation", 1), nd)
    pad = n.attrs.get("padding", 0)
    if pad == "same":
        return (x[0], w.shape[0], *x[2:])
    p = (0,) * nd if pad == "valid" else _tuple(pad, nd)
    return (x[0], w.shape[0], *(_window(x[2 + i], k[i], s[i], p[i], d[i]) for i in range(nd)))


def _pool_shape(n: Node, x: tuple) -> tuple:
    nd = n.attrs["nd"]
    k = _tuple(n.attrs["kernel_size"], nd)
    s = _tuple(n.attrs.get("stride") or k, nd)
    p = _tuple(n.attrs.get("padding", 0), nd)
    d = _tuple(n.attrs.get("dilation", 1), nd)
    cm = n.attrs.get("ceil_mode", False)
    return (*x[:2], *(_window(x[2 + i], k[i], s[i], p[i], d[i], cm) for i in range(nd)))


def _adaptive_shape(n: Node, x: tuple) -> tuple:
    size = _tuple(n.attrs["output_size"], 2)
    return (*x[:2], *(x[2 + i] if v is None else v for i, v in enumerate(size)))


def _broadcast(*shapes) -> tuple:
    return tuple(np.broadcast_shapes(*shapes))


def _cat_shape(n: Node, *shapes) -> tuple:
    dim = n.attrs.get("dim", 0) % len(shapes[0])
    out = list(shapes[0])
    out[dim] = sum(s[dim] for s in shapes)
    return tuple(out)


def _reshape_shape(n: Node, x: tuple) -> tuple:
    tail = list(n.attrs["shape"])  # the shape after the batch dim; one -1 allowed
    if -1 in tail:
        known = math.prod(v for v in tail if v != -1)
        tail[tail.index(-1)] = math.prod(x[1:]) // known
    return (x[0], *tail)


_SHAPES = {
    "conv": _conv_shape,
    "linear": lambda n, x: (*x[:-1], n.params["weight"].shape[0]),
    "max_pool": _pool_shape, "avg_pool": _pool_shape,
    "adaptive_avg_pool": _adaptive_shape, "adaptive_max_pool": _adaptive_shape,
    "add": lambda n, *xs: _broadcast(*xs),
    "cat": _cat_shape, "reshape": _reshape_shape,
}
_SAME = ("batch_norm", "layer_norm", "group_norm", "lrn", "softmax", "log_softmax", "act", "dropout", "identity")


def infer_shapes(graph: Graph, input_shape: tuple) -> dict:
    """name -> output shape of every node for an input of ``input_shape`` (batch included);
    None where the kind's shape is not inferred here (recurrent layers and what reads them)."""
    shapes: dict = {}
    for n in graph.nodes:
        ins = [shapes[i] for i in n.inputs]
        if n.op == "input":
            shapes[n.name] = tuple(input_shape)
        elif any(s is None for s in ins) or n.op in ("lstm", "gru", "getitem"):
            shapes[n.name] = None
        elif n.op == "conv" or n.op == "linear":
            shapes[n.name] = _SHAPES[n.op](n, ins[0])
        elif n.op in _SAME:
            shapes[n.name] = ins[0]
        else:
            shapes[n.name] = _SHAPES[n.op](n, *ins)
    return shapes


def flops(node: Node, shapes: dict) -> float:
    """Multiply-add flops (2 per MAC) of a conv or linear node; 0 for the memory-bound kinds."""
    out = shapes.get(node.name)
    if out is None or node.op not in ("conv", "linear"):
        return 0.0
    w = node.params["weight"]
    return 2.0 * math.prod(out) * math.prod(w.shape[1:])


# ---------------------------------------------------------------- builder

class Builder:
    """Build a :class:`Graph` in code: every method adds one node and returns its name.

    >>> b = Builder((3, 32, 32)); h = b.conv(b.x, w, bias, padding=1); h = b.act(h, "relu"); net = b.network(h)
    """

    def __init__(self, input_shape: tuple, name: str = "x"):
        self.nodes = [Node(name, "input", (), {"shape": tuple(int(v) for v in input_shape)})]
        self.x = name
        self._count: dict = {}

    def _name(self, op: str, name: str | None) -> str:
        if name is None:
            self._count[op] = self._count.get(op, 0) + 1
            name = f"{op}{self._count[op]}"
        return name

    def layer(self, op: str, *inputs: str, name: str | None = None, params: dict | None = None, **attrs) -> str:
        """Add a node of kind ``op`` reading ``inputs``; ``params`` are copied as float64."""
        p = {k: np.array(v, dtype=np.float64) for k, v in (params or {}).items() if v is not None}
        node = Node(self._name(op, name), op, tuple(inputs), attrs, p)
        self.nodes.append(node)
        return node.name

    def conv(self, x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, name=None) -> str:
        nd = np.ndim(weight) - 2
        return self.layer("conv", x, name=name, params={"weight": weight, "bias": bias}, nd=nd, stride=stride,
                          padding=padding, dilation=dilation, groups=groups)

    def linear(self, x, weight, bias=None, name=None) -> str:
        return self.layer("linear", x, name=name, params={"weight": weight, "bias": bias})

    def batch_norm(self, x, running_mean, running_var, weight=None, bias=None, eps=1e-5, name=None) -> str:
        return self.layer("batch_norm", x, name=name, eps=eps, params={
            "running_mean": running_mean, "running_var": running_var, "weight": weight, "bias": bias})

    def act(self, x, fn: str, name=None, **kwargs) -> str:
        return self.layer("act", x, name=name, fn=fn, kwargs=kwargs)

    def add(self, a, b, name=None) -> str:
        return self.layer("add", a, b, name=name)

    def flatten(self, x, start_dim=1, name=None) -> str:
        if start_dim != 1:
            raise ValueError(f"start_dim: got {start_dim}; the builder flattens from dim 1 (the batch stays)")
        return self.layer("reshape", x, name=name, shape=(-1,))

    def network(self, output: str):
        from .network import Network
        return Network(Graph(list(self.nodes), output).validate())
