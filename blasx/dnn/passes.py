"""Graph passes of :meth:`blasx.dnn.Network.compile`: pure functions Graph -> Graph (the input graph is
never modified) and the activation-buffer plan.

- :func:`drop_identities`: inference dropout and identity nodes read through.
- :func:`fold_batchnorm`: an inference batch norm right after a conv/linear, whose output nothing else
  reads, folds into that layer's weight and bias (exactly, in float64).
- :func:`fuse_epilogues`: a residual add and then an activation after a conv/linear become its fused
  epilogue (MIOpen's CBA / CBNA / NA): the fused node takes the place of the last node it absorbs.
- :func:`remove_dead`: nodes the output does not depend on go.
- :func:`plan_buffers`: each activation gets a buffer id; a buffer is reused once the values in it are dead.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..runtime.activations import parse_activation
from .graph import ALIASES, Graph, Node



def _rename(nodes: list, output: str, old: str, new: str) -> tuple[list, str]:
    """Every reference to ``old`` (inputs and the output) made to ``new``."""
    out = [n if old not in n.inputs else n.with_(inputs=tuple(new if i == old else i for i in n.inputs))
           for n in nodes]
    return out, (new if output == old else output)


def drop_identities(graph: Graph) -> Graph:
    """Inference dropout and identity nodes removed; their readers read their input."""
    nodes, output = list(graph.nodes), graph.output
    for name in [n.name for n in graph.nodes if n.op in ("dropout", "identity")]:
        node = next(m for m in nodes if m.name == name)  # its input may itself have been renamed
        nodes = [m for m in nodes if m.name != name]
        nodes, output = _rename(nodes, output, name, node.inputs[0])
    return Graph(nodes, output, graph.batch_axis)


def activation_of(node: Node):
    """The epilogue form (blasx.dnn's ``activation=``: a name, or (name, parameter)) of an ``act`` node, or
    None if the epilogue's activation table (the one the kernels use) does not have it."""
    if node.op != "act":
        return None
    kwargs = {k: v for k, v in node.attrs.get("kwargs", {}).items() if k != "inplace"}
    try:
        act = parse_activation({"name": node.attrs.get("fn"), **kwargs})
    except (TypeError, ValueError):
        return None
    return act.name if act.param is None else (act.name, act.param)


def _absorbs(layer: Node) -> bool:
    """A conv/linear whose epilogue is still empty past bias (BN folds into weights, so only before this)."""
    return layer.op in ("conv", "linear") and layer.attrs.get("activation") is None and not layer.attrs.get("residual")


def _merge(graph: Graph, layer: Node, into: Node, fused: Node) -> Graph:
    """``fused`` (the new form of ``layer``) replaces ``into`` (the node it absorbed) at into's place."""
    nodes, output = [], graph.output
    for n in graph.nodes:
        if n.name == layer.name:
            continue
        nodes.append(fused if n.name == into.name else n)
    nodes, output = _rename(nodes, output, into.name, layer.name)
    return Graph(nodes, output, graph.batch_axis)


def _sole_user(graph: Graph, users: dict, name: str) -> str | None:
    u = users[name]
    return u[0] if len(u) == 1 and u[0] else None


def fold_batchnorm(graph: Graph, shapes: dict) -> Graph:
    """Each batch_norm whose input is a conv/linear read by nothing else folds into its weight and bias:
    ``w' = w * s`` (per output channel), ``b' = (b - mean) * s + beta``, ``s = gamma / sqrt(var + eps)``.
    A linear folds only where its output is 2-D (its features are batch norm's channels, axis 1; on a 3-D
    output batch norm normalises axis 1, not the features). ``shapes``: infer_shapes of the graph."""
    while True:
        users, by = graph.users(), graph.by_name()
        for bn in graph.nodes:
            if bn.op != "batch_norm":
                continue
            layer = by[bn.inputs[0]]
            if not _absorbs(layer) or _sole_user(graph, users, layer.name) != bn.name:
                continue
            if layer.op == "linear" and len(shapes.get(layer.name) or ()) != 2:
                continue
            p = bn.params
            w = layer.params["weight"]
            k = w.shape[0]
            s = np.ones(k) if p.get("weight") is None else p["weight"]
            s = s / np.sqrt(p["running_var"] + bn.attrs.get("eps", 1e-5))
            b = layer.params.get("bias", np.zeros(k))
            shift = np.zeros(k) if p.get("bias") is None else p["bias"]
            fused = layer.with_()
            fused.params["weight"] = w * s.reshape(k, *(1,) * (w.ndim - 1))
            fused.params["bias"] = (b - p["running_mean"]) * s + shift
            fused.attrs["fused"] = (*layer.attrs.get("fused", ()), bn.name)
            graph = _merge(graph, layer, bn, fused)
            break
        else:
            return graph


def fuse_epilogues(graph: Graph, shapes: dict) -> Graph:
    """conv/linear -> add(other) -> activation becomes one conv/linear with ``residual`` (input 1) and
    ``activation``. An add fuses into one of its two inputs that is such a layer read only by the add,
    when the other input has the add's shape (no broadcast); an activation fuses into a layer read only by
    it (after any residual). ``shapes``: :func:`blasx.dnn.graph.infer_shapes` of the graph."""
    while True:
        users, by, order = graph.users(), graph.by_name(), {n.name: i for i, n in enumerate(graph.nodes)}
        for n in graph.nodes:
            fused = None
            if n.op == "act" and len(n.inputs) == 1:
                layer = by[n.inputs[0]]
                act = activation_of(n)
                if act is not None and layer.op in ("conv", "linear") and layer.attrs.get("activation") is None \
                        and _sole_user(graph, users, layer.name) == n.name:
                    fused = layer.with_()
                    fused.attrs["activation"] = act
            elif n.op == "add" and len(n.inputs) == 2 and n.inputs[0] != n.inputs[1]:
                for cand in sorted(n.inputs, key=lambda i: -order[i]):
                    other = n.inputs[1] if cand == n.inputs[0] else n.inputs[0]
                    layer = by[cand]
                    if _absorbs(layer) and _sole_user(graph, users, cand) == n.name \
                            and shapes.get(other) is not None and shapes.get(other) == shapes.get(n.name) \
                            and shapes.get(cand) == shapes.get(n.name):
                        fused = layer.with_(inputs=(layer.inputs[0], other))
                        fused.attrs["residual"] = True
                        break
            if fused is not None:
                fused.attrs["fused"] = (*layer.attrs.get("fused", ()), n.name)
                graph = _merge(graph, layer, n, fused)
                shapes = {**shapes, layer.name: shapes.get(n.name)}
                break
        else:
            return graph


def remove_dead(graph: Graph, keep=()) -> Graph:
    """Only the nodes the output depends on (and the input) are kept, in their order; and those ``keep`` names
    depend on (training: a batch norm off the output's path still updates its running statistics, as torch's)."""
    by, live, todo = graph.by_name(), set(), [graph.output, *keep]
    while todo:
        name = todo.pop()
        if name not in live:
            live.add(name)
            todo.extend(by[name].inputs)
    return Graph([n for n in graph.nodes if n.name in live or n.op == "input"], graph.output, graph.batch_axis)


# ---------------------------------------------------------------- the activation-buffer plan

class BufferPlan(NamedTuple):
    """``buffer``: node name -> buffer id (aliases: their base's; nodes not planned are absent);
    ``sizes``: elements of each buffer (the largest value it holds)."""

    buffer: dict
    sizes: list

    def total(self) -> int:
        return sum(self.sizes)


def base_of(graph: Graph) -> dict:
    """name -> the node whose memory it is (an alias's first input, followed to a non-alias)."""
    base: dict = {}
    for n in graph.nodes:
        base[n.name] = base[n.inputs[0]] if n.op in ALIASES else n.name
    return base


def lifetimes(graph: Graph) -> dict:
    """base name -> (index defined, index of its last reader, an alias's readers included; the output
    lives to the end)."""
    base = base_of(graph)
    life = {}
    for i, n in enumerate(graph.nodes):
        if base[n.name] == n.name:
            life[n.name] = [i, i]
        for src in n.inputs:
            life[base[src]][1] = max(life[base[src]][1], i)
    life[base[graph.output]][1] = len(graph.nodes)
    return {k: tuple(v) for k, v in life.items()}


def plan_buffers(graph: Graph, shapes: dict, planned=lambda node: True) -> BufferPlan:
    """Buffers for the outputs of the nodes with a known shape for which ``planned(node)`` holds (the
    input node never). A node's output takes the smallest free buffer that fits, else the largest free one
    (grown), else a new one; buffers free once their value's last reader has run (after that reader's own
    output is placed, so an output never shares memory with its inputs)."""
    life = lifetimes(graph)
    buffer, sizes, free = {}, [], []
    holder: dict = {}  # buffer id -> the base name it holds now
    ends: dict = {}
    for name, (_, last) in life.items():
        ends.setdefault(last, []).append(name)
    for i, n in enumerate(graph.nodes):
        if n.name in life and n.op != "input" and shapes.get(n.name) is not None and planned(n):
            need = math.prod(shapes[n.name])
            fits = [b for b in free if sizes[b] >= need]
            if fits:
                b = min(fits, key=lambda j: (sizes[j], j))
            elif free:
                b = max(free, key=lambda j: (sizes[j], -j))
                sizes[b] = need
            else:
                b = len(sizes)
                sizes.append(need)
            if b in free:
                free.remove(b)
            buffer[n.name] = b
            holder[b] = n.name
        for name in ends.get(i, ()):
            b = buffer.get(name)
            if b is not None and holder.get(b) == name:
                free.append(b)
                del holder[b]
    base = base_of(graph)
    for n in graph.nodes:
        if base[n.name] != n.name and base[n.name] in buffer:
            buffer[n.name] = buffer[base[n.name]]
    return BufferPlan(buffer, sizes)
