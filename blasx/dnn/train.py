"""Training of a :class:`blasx.dnn.Network`: the graph as built (no folding, no fusion) in torch's train()
mode over the whole batch -- batch norm on the batch's statistics, updating the running ones; dropout with a
seeded mask -- keeping what each node's backward needs on a :class:`Tape`; then the reverse pass: every
node's backward (the blasx.dnn ``*_backward`` / ``conv*_input`` / ``conv*_weight`` functions), gradients of
a value read by several nodes summed, parameter gradients by torch's names.

One device: numpy on the host (layers on the engine's devices) or CuPy on x's GPU. Parameters are the
graph's float64 arrays (the truth), cast to x's type on x's device once per forward.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from ..operands import is_cupy
from .graph import Graph, Node

#: parameters that are running statistics (buffers), not trained
BUFFERS = ("running_mean", "running_var")
#: act functions whose backward reads the output (the others read the input)
_READS_OUTPUT = ("relu", "sigmoid", "tanh")
_BASIC_INDEX = (int, slice, type(None), type(Ellipsis))


def _dnn():
    from .. import dnn
    return dnn


class Parts(dict):
    """The gradient of a tuple value (a recurrent layer's output): path of indices -> array."""


def _add(acc, g):
    """acc + g (out of place: either may be a view another gradient shares)."""
    if acc is None:
        return g
    if isinstance(acc, Parts):
        out = Parts(acc)
        for k, v in g.items():
            out[k] = v if k not in out else out[k] + v
        return out
    return acc + g


# ---------------------------------------------------------------- per kind: forward and backward

def _conv_args(n: Node):
    a = n.attrs
    return a.get("stride", 1), a.get("padding", 0), a.get("dilation", 1), a.get("groups", 1)


def _conv_f(n, args, w, ctx):
    f = getattr(_dnn(), f"conv{n.attrs['nd']}d")
    return f(args[0], w["weight"], w.get("bias"), *_conv_args(n), math=ctx.math), args[0]


def _conv_b(n, g, x, w, ctx):
    dnn, nd = _dnn(), n.attrs["nd"]
    gx = getattr(dnn, f"conv{nd}d_input")(x.shape, w["weight"], g, *_conv_args(n), math=ctx.math)
    grads = {"weight": getattr(dnn, f"conv{nd}d_weight")(x, w["weight"].shape, g, *_conv_args(n), math=ctx.math)}
    if "bias" in w:
        grads["bias"] = dnn.conv_bias_grad(g)
    return [gx], grads


def _linear_f(n, args, w, ctx):
    return _dnn().linear(args[0], w["weight"], w.get("bias"), math=ctx.math), args[0]


def _linear_b(n, g, x, w, ctx):
    """As a 1-wide conv1d, the forward's lowering."""
    dnn = _dnn()
    k, c = w["weight"].shape
    x3, g3 = x.reshape(-1, c)[:, :, None], g.reshape(-1, k)[:, :, None]
    w3 = w["weight"][:, :, None]
    gx = dnn.conv1d_input(x3.shape, w3, g3, math=ctx.math)[:, :, 0].reshape(x.shape)
    grads = {"weight": dnn.conv1d_weight(x3, w3.shape, g3, math=ctx.math)[:, :, 0]}
    if "bias" in w:
        grads["bias"] = dnn.conv_bias_grad(g3)
    return [gx], grads


def _bn_f(n, args, w, ctx):
    a = n.attrs
    momentum = a.get("momentum", 0.1)
    key = a.get("module", n.name)  # (torch counts per module: one called twice counts twice)
    ctx.batches[key] = ctx.batches.get(key, a.get("num_batches_tracked", 0)) + 1
    if momentum is None:  # torch's cumulative average
        momentum = 1.0 / ctx.batches[key]
    y, mean, invstd = _dnn().batch_norm(args[0], w["running_mean"], w["running_var"], w.get("weight"),
                                        w.get("bias"), True, momentum, a.get("eps", 1e-5), return_stats=True)
    return y, (args[0], mean, invstd)


def _bn_b(n, g, saved, w, ctx):
    x, mean, invstd = saved
    gx, gw, gb = _dnn().batch_norm_backward(g, x, w.get("weight"), mean, invstd, True, n.attrs.get("eps", 1e-5))
    return [gx], _affine(w, gw, gb)


def _affine(w, gw, gb) -> dict:
    return {k: v for k, v in (("weight", gw), ("bias", gb)) if k in w}


def _affine_norm(name: str, attr: str) -> tuple:
    """(forward, backward) of a layer_norm / group_norm node (``attr``: the attribute after x): the forward
    keeps x and its statistics for the backward."""
    def forward(n, args, w, ctx):
        y, mean, rstd = getattr(_dnn(), name)(args[0], n.attrs[attr], w.get("weight"), w.get("bias"),
                                              n.attrs.get("eps", 1e-5), return_stats=True)
        return y, (args[0], mean, rstd)

    def backward(n, g, saved, w, ctx):
        x, mean, rstd = saved
        gx, gw, gb = getattr(_dnn(), name + "_backward")(g, x, n.attrs[attr], w.get("weight"), mean, rstd)
        return [gx], _affine(w, gw, gb)
    return forward, backward


_ln_f, _ln_b = _affine_norm("layer_norm", "normalized_shape")
_gn_f, _gn_b = _affine_norm("group_norm", "num_groups")


def _max_args(n):
    a = n.attrs
    return a["kernel_size"], a.get("stride"), a.get("padding", 0), a.get("dilation", 1), a.get("ceil_mode", False)


def _max_f(n, args, w, ctx):
    y, idx = getattr(_dnn(), f"max_pool{n.attrs['nd']}d")(args[0], *_max_args(n), return_indices=True)
    return y, (args[0].shape, idx)


def _max_b(n, g, saved, w, ctx):
    shape, idx = saved
    return [getattr(_dnn(), f"max_pool{n.attrs['nd']}d_backward")(g, shape, idx, *_max_args(n))], {}


def _avg_args(n):
    a = n.attrs
    out = [a["kernel_size"], a.get("stride"), a.get("padding", 0), a.get("ceil_mode", False),
           a.get("count_include_pad", True)]
    return out + [a["divisor_override"]] if a.get("divisor_override") is not None else out


def _avg_f(n, args, w, ctx):
    return getattr(_dnn(), f"avg_pool{n.attrs['nd']}d")(args[0], *_avg_args(n)), args[0].shape


def _avg_b(n, g, shape, w, ctx):
    return [getattr(_dnn(), f"avg_pool{n.attrs['nd']}d_backward")(g, shape, *_avg_args(n))], {}


def _aavg_f(n, args, w, ctx):
    return _dnn().adaptive_avg_pool2d(args[0], n.attrs["output_size"]), args[0].shape


def _aavg_b(n, g, shape, w, ctx):
    return [_dnn().adaptive_avg_pool2d_backward(g, shape)], {}


def _amax_f(n, args, w, ctx):
    y, idx = _dnn().adaptive_max_pool2d(args[0], n.attrs["output_size"], return_indices=True)
    return y, (args[0].shape, idx)


def _amax_b(n, g, saved, w, ctx):
    return [_dnn().adaptive_max_pool2d_backward(g, *saved)], {}


def _lrn_args(n):
    a = n.attrs
    return a["size"], a.get("alpha", 1e-4), a.get("beta", 0.75), a.get("k", 1.0)


def _lrn_f(n, args, w, ctx):
    return _dnn().local_response_norm(args[0], *_lrn_args(n)), args[0]


def _lrn_b(n, g, x, w, ctx):
    return [_dnn().local_response_norm_backward(g, x, *_lrn_args(n))], {}


def _softmax_f(n, args, w, ctx):
    y = getattr(_dnn(), n.op)(args[0], n.attrs["dim"])
    return y, y


def _softmax_b(n, g, y, w, ctx):
    return [getattr(_dnn(), f"{n.op}_backward")(g, y, n.attrs["dim"])], {}


def _act_kwargs(n):
    return {k: v for k, v in n.attrs.get("kwargs", {}).items() if k != "inplace"}


def _act_f(n, args, w, ctx):
    fn = n.attrs["fn"]
    y = getattr(_dnn(), fn)(args[0], **_act_kwargs(n))
    return y, (y if fn in _READS_OUTPUT else args[0])


def _act_b(n, g, saved, w, ctx):
    return [getattr(_dnn(), f"{n.attrs['fn']}_backward")(g, saved, **_act_kwargs(n))], {}


def _dropout_p(n) -> float:
    """The p a dropout node drops with in training (0: it reads through)."""
    return float(n.attrs.get("p", 0.5)) if n.attrs.get("training", True) else 0.0


def _dropout_f(n, args, w, ctx):
    p = _dropout_p(n)
    if p == 0:
        return args[0], None
    y, mask = _dnn().dropout(args[0], p, True, seed=ctx.seed_of(n), return_mask=True)
    ctx.masks[n.name] = mask
    return y, mask


def _dropout_b(n, g, mask, w, ctx):
    return [g if mask is None else _dnn().dropout_backward(g, mask, _dropout_p(n))], {}


def _same_f(n, args, w, ctx):
    return args[0], None


def _same_b(n, g, saved, w, ctx):
    return [g], {}


def _add_f(n, args, w, ctx):
    return _dnn().add(args[0], args[1]), (args[0].shape, args[1].shape)


def _add_b(n, g, shapes, w, ctx):
    return list(_dnn().add_backward(g, *shapes)), {}


def _cat_f(n, args, w, ctx):
    dim = n.attrs.get("dim", 0)
    return _dnn().cat(list(args), dim), [a.shape[dim % a.ndim] for a in args]


def _cat_b(n, g, sizes, w, ctx):
    return list(_dnn().cat_backward(g, sizes, n.attrs.get("dim", 0))), {}


def _reshape_f(n, args, w, ctx):
    x = args[0]
    return x.reshape(x.shape[0], *n.attrs["shape"]), x.shape


def _reshape_b(n, g, shape, w, ctx):
    return [g.reshape(shape)], {}


def _getitem_f(n, args, w, ctx):
    x = args[0]
    saved = ("seq",) if isinstance(x, (tuple, list)) else ("array", x.shape, x.dtype)
    return x[n.attrs["index"]], saved


def _getitem_b(n, g, saved, w, ctx):
    index = n.attrs["index"]
    if saved[0] == "seq":
        parts = g.items() if isinstance(g, Parts) else [((), g)]
        return [Parts({(index, *path): v for path, v in parts})], {}
    gx = ctx.xp.zeros(saved[1], dtype=saved[2])
    gx[index] = g
    return [gx], {}


def _rnn_f(n, args, w, ctx):
    a = n.attrs
    y, state, saved = getattr(_dnn(), n.op)(args[0], None, w, num_layers=a.get("num_layers", 1),
                                            bidirectional=a.get("bidirectional", False),
                                            batch_first=a.get("batch_first", False), training=True, math=ctx.math)
    return (y, state), saved


def _rnn_b(n, g, saved, w, ctx):
    dnn = _dnn()
    if n.op == "lstm":
        grads = dnn.lstm_backward(saved, g.get((0,)), g.get((1, 0)), g.get((1, 1)))
    else:
        grads = dnn.gru_backward(saved, g.get((0,)), g.get((1,)))
    return [grads["input"]], {k: grads[k] for k in w}


#: op kind -> (forward(node, args, weights, ctx) -> (value, saved), backward(node, grad, saved, weights, ctx)
#: -> ([grad of each input or None], {param: grad}))
KINDS = {
    "conv": (_conv_f, _conv_b), "linear": (_linear_f, _linear_b), "batch_norm": (_bn_f, _bn_b),
    "layer_norm": (_ln_f, _ln_b), "group_norm": (_gn_f, _gn_b), "max_pool": (_max_f, _max_b),
    "avg_pool": (_avg_f, _avg_b), "adaptive_avg_pool": (_aavg_f, _aavg_b),
    "adaptive_max_pool": (_amax_f, _amax_b), "lrn": (_lrn_f, _lrn_b), "softmax": (_softmax_f, _softmax_b),
    "log_softmax": (_softmax_f, _softmax_b), "act": (_act_f, _act_b), "dropout": (_dropout_f, _dropout_b),
    "identity": (_same_f, _same_b), "add": (_add_f, _add_b), "cat": (_cat_f, _cat_b),
    "reshape": (_reshape_f, _reshape_b), "getitem": (_getitem_f, _getitem_b), "lstm": (_rnn_f, _rnn_b),
    "gru": (_rnn_f, _rnn_b),
}


def _why_not(n: Node) -> str | None:
    """Why ``n`` has no training form here (None: it has one)."""
    if n.op == "input":
        return None
    if n.op not in KINDS:
        return f"op {n.op!r} has no backward"
    if n.op in ("conv", "linear") and (n.attrs.get("activation") or n.attrs.get("residual")):
        return "a fused epilogue (train the graph as built, not a compiled one)"
    if n.op == "dropout" and _dropout_p(n) > 0 and n.attrs.get("mode", "element") != "element":
        return f"{n.attrs['mode']} dropout in training (only element-wise dropout is)"
    if n.op == "getitem":
        index = n.attrs["index"]
        if not all(isinstance(i, _BASIC_INDEX) for i in (index if isinstance(index, tuple) else (index,))):
            return f"index {index!r} (only ints, slices, None and ... are)"
    return None


def check(graph: Graph) -> None:
    """Raise NotImplementedError naming every node that cannot be trained (before any work)."""
    bad = [(n.name, n.op, why) for n in graph.nodes if (why := _why_not(n)) is not None]
    if bad:
        raise NotImplementedError("network: no training for " + "; ".join(f"node {name!r} ({op}): {why}"
                                                                          for name, op, why in bad))


# ---------------------------------------------------------------- parameter names

def param_table(graph: Graph, buffers: bool = False) -> dict:
    """torch's name ("<module>.<param>"; a node built in code: "<node>.<param>") -> [(node, param key)] of
    the trained parameters (``buffers``: of the running statistics instead)."""
    out: dict = {}
    for n in graph.nodes:
        prefix = n.attrs.get("module", n.name)
        for k in n.params:
            if (k in BUFFERS) == buffers:
                out.setdefault(f"{prefix}.{k}", []).append((n.name, k))
    return out


def batch_counts(graph: Graph, trainer) -> dict:
    """torch's "<module>.num_batches_tracked" -> the batches each batch norm has counted (a module called twice
    counts twice): ``trainer``'s count, else the module's own at conversion."""
    out: dict = {}
    for n in graph.nodes:
        if "running_mean" in n.params:
            key = n.attrs.get("module", n.name)
            out[f"{key}.num_batches_tracked"] = trainer.batches.get(key, n.attrs.get("num_batches_tracked", 0))
    return out


# ---------------------------------------------------------------- the tape, forward and backward

@dataclass
class Context:
    """What the per-kind functions share in one forward/backward: the array module, math, dropout seeds
    and masks, and the batch norm batch counters (owned by the Trainer)."""

    xp: object
    math: object
    seed: int
    step: int
    batches: dict
    masks: dict = field(default_factory=dict)
    index: dict = field(default_factory=dict)

    def seed_of(self, n: Node) -> int:
        """The mask seed of dropout node ``n``: from the network's seed, the step and the node's position."""
        return int(np.random.SeedSequence([self.seed, self.step, self.index[n.name]]).generate_state(1)[0])


@dataclass
class Tape:
    """One forward_train: the graph that ran, the weights it used, what each node's backward needs."""

    graph: Graph
    ctx: Context
    weights: dict
    saved: dict
    out_like: object  # the output (its type, shape and dtype check grad_out)
    x_like: tuple  # the input's (shape, dtype)


def _weights(graph: Graph, x) -> dict:
    """node -> {param: array in x's type on x's device}, one per graph array (a module called twice shares
    them): copies, so the tape keeps the weights its forward used whatever the caller does to them before
    backward (an SGD step in place); on the host in float64 the running statistics are the graph's own arrays
    (updated in place)."""
    dt, made = np.dtype(x.dtype), {}

    def cast(k, v):
        if id(v) not in made:
            made[id(v)] = cupy.asarray(v.astype(dt)) if is_cupy(x) else \
                np.asarray(v, dtype=dt) if k in BUFFERS else np.array(v, dtype=dt)
        return made[id(v)]
    cupy = None
    if is_cupy(x):
        import cupy
    with _on_device(x):
        return {n.name: {k: cast(k, v) for k, v in n.params.items()} for n in graph.nodes if n.params}


def forward(graph: Graph, x, ctx: Context):
    """The output of ``graph`` (checked with :func:`check`) on ``x`` in training mode, and its Tape."""
    weights = _weights(graph, x)
    ctx.index = {n.name: i for i, n in enumerate(graph.nodes)}
    values, saved = {graph.nodes[0].name: x}, {}
    last = {}
    for i, n in enumerate(graph.nodes):
        for src in n.inputs:
            last[src] = i
    for i, n in enumerate(graph.nodes[1:], 1):
        values[n.name], saved[n.name] = KINDS[n.op][0](n, [values[s] for s in n.inputs], weights.get(n.name, {}),
                                                       ctx)
        for s in n.inputs:
            if last[s] == i and s != graph.output:
                values.pop(s, None)
    _store_running_stats(graph, weights)
    y = values[graph.output]
    return y, Tape(graph, ctx, weights, saved, y, (x.shape, x.dtype))


def _store_running_stats(graph: Graph, weights: dict) -> None:
    """The updated running statistics back into the graph's float64 arrays (where they were copies)."""
    for n in graph.nodes:
        for k in BUFFERS:
            w = weights.get(n.name, {}).get(k)
            if w is not None and w is not n.params[k]:
                n.params[k][...] = w.get() if is_cupy(w) else w


def backward(tape: Tape, grad_out):
    """(the input's gradient, {node: {param: gradient}}) of the tape's forward for ``grad_out``."""
    graph, ctx = tape.graph, tape.ctx
    grads = {graph.output: grad_out}
    params: dict = {}
    with _on_device(grad_out):
        for n in reversed(graph.nodes[1:]):
            g = grads.pop(n.name, None)
            saved = tape.saved.pop(n.name)
            if g is None:  # nothing the output depends on reads it (e.g. an unused recurrent state)
                continue
            ins, pgrads = KINDS[n.op][1](n, g, saved, tape.weights.get(n.name, {}), ctx)
            for src, gi in zip(n.inputs, ins):
                if gi is not None:
                    grads[src] = _add(grads.get(src), gi)
            if pgrads:
                params[n.name] = pgrads
    gx = grads.get(graph.nodes[0].name)
    if gx is not None and ctx.xp.may_share_memory(gx, grad_out):  # (views only between: its own array, as torch's)
        gx = gx.copy()
    return (ctx.xp.zeros(*tape.x_like) if gx is None else gx), params


def _on_device(a):
    if not is_cupy(a):
        import contextlib
        return contextlib.nullcontext()
    import cupy
    return cupy.cuda.Device(a.device.id)


# ---------------------------------------------------------------- a Network's training state

class Trainer:
    """A Network's training state (it alone changes it): the forward count (dropout seeds), batch norm's
    batch counts, the last forward's tape and dropout masks, and the accumulated gradients by torch's names."""

    def __init__(self):
        self.step = 0
        self.batches: dict = {}
        self.tape: Tape | None = None
        self.owner = None  # the thread of the last forward: its backward alone may take the tape
        self.masks: dict = {}
        self.grads: dict = {}

    def forward(self, graph: Graph, x, seed: int, math):
        from .passes import remove_dead
        check(graph)
        self.tape, self.masks = None, {}
        xp = np
        if is_cupy(x):
            import cupy as xp
        ctx = Context(xp, math, seed, self.step, self.batches)
        self.step += 1
        with _on_device(x):
            stats = [n.name for n in graph.nodes if "running_mean" in n.params]  # (updated even off the path)
            y, self.tape = forward(remove_dead(graph, stats), x, ctx)
            # the caller's own copy: the tape may hold y itself (an output-reading last layer), which
            # ``y -= target; backward(y)`` would otherwise rewrite
            y = tuple(v.copy(order="K") for v in y) if isinstance(y, tuple) else y.copy(order="K")
        self.masks, self.owner = ctx.masks, threading.get_ident()
        return y

    def backward(self, grad_out, table: dict):
        """The input's gradient; parameter gradients added into ``grads`` (``table``: param_table)."""
        tape = self.tape
        if tape is None:
            raise RuntimeError("backward: no forward_train to differentiate (each forward_train allows one "
                               "backward)")
        if self.owner != threading.get_ident():  # (another thread's forward_train replaced this thread's tape)
            raise RuntimeError("backward: the last forward_train of this network ran in another thread; a network "
                               "trains in one thread at a time (its tape, step and grads are one)")
        want = tape.out_like
        if isinstance(want, tuple):
            raise TypeError("backward: the network's output is a tuple; only one array output is differentiated")
        if type(grad_out) is not type(want) or tuple(grad_out.shape) != tuple(want.shape) \
                or grad_out.dtype != want.dtype:
            raise ValueError(f"grad_out: expected a {type(want).__module__} array of shape {tuple(want.shape)} "
                             f"and dtype {want.dtype} (the output's), got {type(grad_out).__name__} of shape "
                             f"{tuple(getattr(grad_out, 'shape', ()))} and dtype {getattr(grad_out, 'dtype', None)}")
        if is_cupy(want) and grad_out.device.id != want.device.id:
            raise ValueError(f"grad_out: on GPU {grad_out.device.id}, the output on GPU {want.device.id}")
        stale = [k for k, g in self.grads.items() if type(g) is not type(want) or g.dtype != want.dtype]
        if stale:
            raise ValueError(f"grads: {', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''} hold "
                             f"{type(self.grads[stale[0]]).__module__} {self.grads[stale[0]].dtype} gradients of an "
                             f"earlier backward; this one gives {type(want).__module__} {want.dtype}: call "
                             f"zero_grad() first")
        self.tape = None
        gx, pgrads = backward(tape, grad_out)
        with _on_device(grad_out):
            for name, locs in table.items():
                for node, k in locs:
                    g = pgrads.get(node, {}).get(k)
                    if g is None:
                        continue
                    if name in self.grads:
                        self.grads[name] += g
                    else:
                        self.grads[name] = tape.ctx.xp.array(g, copy=True)
        return gx
