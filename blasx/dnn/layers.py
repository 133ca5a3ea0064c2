"""How each node kind of the network IR runs on numpy or CuPy arrays: :func:`run_node` calls the blasx.dnn
function the kind names (graph.FUNCTIONS), looked up on the blasx.dnn module at call time, with the
node's attributes, its weights (already in the run's type and on the arrays' device) and ``out=`` (a
buffer of the plan, or None). Views (reshape, getitem, dropout, identity) are done here."""

from __future__ import annotations

from ..operands import address
from .graph import Node, function_name


def _dnn():
    from .. import dnn
    return dnn


def _linear(dnn, node: Node, args, w, out, math):
    """A linear layer as a 1-wide conv1d, so that it takes the fused residual and out= like a conv."""
    x = args[0]
    k, c = w["weight"].shape
    lead = x.shape[:-1]
    x3 = x.reshape(-1, c)[:, :, None]
    res = args[1].reshape(-1, k)[:, :, None] if node.attrs.get("residual") else None
    o2 = None if out is None else out.reshape(-1, k)
    y = dnn.conv1d(x3, w["weight"][:, :, None], w.get("bias"), activation=node.attrs.get("activation"),
                   residual=res, out=None if o2 is None else o2[:, :, None], math=math)
    if out is None:
        return y[:, :, 0].reshape(*lead, k)
    if address(o2) != address(out):  # (a channels-last out: its rows reshaped are a copy; a pointer test, as a
        out[...] = o2.reshape(out.shape)  # CUDA graph capture allows no exact overlap test)
    return out


def _act(dnn, node: Node, x, out):
    kwargs = {k: v for k, v in node.attrs.get("kwargs", {}).items() if k != "inplace"}
    return getattr(dnn, node.attrs["fn"])(x, **kwargs, out=out)


_POOL_ARGS = {"max_pool": ("kernel_size", "stride", "padding", "dilation", "ceil_mode"),
              "avg_pool": ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")}
_DEFAULTS = {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False, "count_include_pad": True}


def run_node(node: Node, args: list, w: dict, out, math):
    """The output of ``node`` on the values ``args`` of its inputs (written into ``out`` where given)."""
    op, a = node.op, node.attrs
    if op in ("dropout", "identity"):
        return args[0]
    if op == "reshape":
        return args[0].reshape(args[0].shape[0], *a["shape"])
    if op == "getitem":
        return args[0][a["index"]]
    dnn = _dnn()
    if op == "linear":
        return _linear(dnn, node, args, w, out, math)
    if op == "act":
        return _act(dnn, node, args[0], out)
    f = getattr(dnn, function_name(node))
    if op == "conv":
        return f(args[0], w["weight"], w.get("bias"), a.get("stride", 1), a.get("padding", 0), a.get("dilation", 1),
                 a.get("groups", 1), activation=a.get("activation"),
                 residual=args[1] if a.get("residual") else None, out=out, math=math)
    if op == "batch_norm":
        return f(args[0], w["running_mean"], w["running_var"], w.get("weight"), w.get("bias"), False, 0.1,
                 a.get("eps", 1e-5), out=out)
    if op == "layer_norm":
        return f(args[0], a["normalized_shape"], w.get("weight"), w.get("bias"), a.get("eps", 1e-5), out=out)
    if op == "group_norm":
        return f(args[0], a["num_groups"], w.get("weight"), w.get("bias"), a.get("eps", 1e-5), out=out)
    if op in _POOL_ARGS:
        names = [n for n in _POOL_ARGS[op] if n != "divisor_override" or "divisor_override" in a]
        return f(args[0], *(a.get(n, _DEFAULTS.get(n)) for n in names), out=out)
    if op in ("adaptive_avg_pool", "adaptive_max_pool"):
        return f(args[0], a["output_size"], out=out)
    if op == "lrn":
        return f(args[0], a["size"], a.get("alpha", 1e-4), a.get("beta", 0.75), a.get("k", 1.0), out=out)
    if op in ("softmax", "log_softmax"):
        return f(args[0], a["dim"], out=out)
    if op == "add":
        return f(args[0], args[1], out=out)
    if op == "cat":
        return f(list(args), a.get("dim", 0), out=out)
    if op in ("lstm", "gru"):
        return f(args[0], None, w, num_layers=a.get("num_layers", 1), bidirectional=a.get("bidirectional", False),
                 batch_first=a.get("batch_first", False), math=math)
    raise NotImplementedError(f"node {node.name!r}: op {op!r} has no runner")


def takes_out(node: Node) -> bool:
    """Whether the kind writes a planned buffer (recurrent layers return new arrays; views have none)."""
    return node.op not in ("lstm", "gru", "input", "dropout", "identity", "reshape", "getitem")
