"""blasx.dnn's graph passes (passes.py) by exact value on small graphs, and the activation-buffer plan
fuzzed on random graphs (no two values alive at once share a buffer; every buffer holds its values)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from blasx.dnn import passes
from blasx.dnn.graph import Builder, Graph, Node, infer_shapes


def _w(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def _bn_params(k, seed=1):
    r = np.random.default_rng(seed)
    return dict(running_mean=r.standard_normal(k), running_var=r.uniform(0.5, 2, k), weight=r.uniform(0.5, 2, k),
                bias=r.standard_normal(k))


def test_fold_batchnorm_exact():
    b = Builder((3, 5, 5))
    w, bias, p = _w(4, 3, 3, 3), _w(4, seed=2), _bn_params(4)
    c = b.conv(b.x, w, bias, padding=1, name="c")
    out = b.batch_norm(c, eps=1e-3, name="bn", **p)
    g = b.network(out).graph
    folded = passes.fold_batchnorm(g, infer_shapes(g, (1, 3, 5, 5)))
    assert [n.name for n in folded.nodes] == ["x", "c"] and folded.output == "c"
    s = p["weight"] / np.sqrt(p["running_var"] + 1e-3)
    node = folded.by_name()["c"]
    np.testing.assert_array_equal(node.params["weight"], w * s[:, None, None, None])
    np.testing.assert_array_equal(node.params["bias"], (bias - p["running_mean"]) * s + p["bias"])
    assert node.attrs["fused"] == ("bn",)
    assert g.by_name()["c"].params["weight"] is not node.params["weight"] and len(g.nodes) == 3  # input untouched


def test_fold_batchnorm_linear_without_bias_and_affine():
    b = Builder((6,))
    w = _w(4, 6)
    p = _bn_params(4)
    p.pop("weight"), p.pop("bias")
    out = b.batch_norm(b.linear(b.x, w, name="fc"), name="bn", **p)
    g = b.network(out).graph
    node = passes.fold_batchnorm(g, infer_shapes(g, (1, 6))).by_name()["fc"]
    s = 1 / np.sqrt(p["running_var"] + 1e-5)
    np.testing.assert_array_equal(node.params["weight"], w * s[:, None])
    np.testing.assert_array_equal(node.params["bias"], -p["running_mean"] * s)


def test_no_fold_where_the_conv_output_has_another_user():
    b = Builder((3, 5, 5))
    c = b.conv(b.x, _w(3, 3, 1, 1), name="c")
    out = b.add(b.batch_norm(c, **_bn_params(3)), c)
    g = b.network(out).graph
    assert passes.fold_batchnorm(g, infer_shapes(g, (1, 3, 5, 5))).nodes == g.nodes


def test_no_fold_into_a_linear_with_a_3d_output():
    """Linear on (N, L, in) gives (N, L, out): batch norm's channels are L, not the linear's features."""
    b = Builder((5, 6))
    out = b.batch_norm(b.linear(b.x, _w(4, 6), name="fc"), name="bn", **_bn_params(5))
    g = b.network(out).graph
    assert passes.fold_batchnorm(g, infer_shapes(g, (1, 5, 6))).nodes == g.nodes


def _block():
    """x -> c1 -> relu -> c2 ; add(c2, x) -> relu -> out (a residual block)."""
    b = Builder((4, 5, 5))
    c1 = b.conv(b.x, _w(4, 4, 3, 3), padding=1, name="c1")
    r = b.act(c1, "relu", name="r1")
    c2 = b.conv(r, _w(4, 4, 3, 3, seed=1), padding=1, name="c2")
    s = b.add(c2, b.x, name="sum")
    return b, b.act(s, "leaky_relu", name="r2", negative_slope=0.2)


def test_fuse_epilogues_residual_and_activation():
    b, out = _block()
    g = b.network(out).graph
    fused = passes.fuse_epilogues(g, infer_shapes(g, (1, 4, 5, 5)))
    assert [(n.name, n.op, n.inputs) for n in fused.nodes] == [("x", "input", ()), ("c1", "conv", ("x",)),
                                                                ("c2", "conv", ("c1", "x"))]
    c1, c2 = fused.by_name()["c1"], fused.by_name()["c2"]
    assert c1.attrs["activation"] == "relu" and c1.attrs["fused"] == ("r1",)
    assert c2.attrs["residual"] and c2.attrs["activation"] == ("leaky_relu", 0.2)
    assert c2.attrs["fused"] == ("sum", "r2") and fused.output == "c2"
    assert [n.name for n in g.nodes] == ["x", "c1", "r1", "c2", "sum", "r2"]  # input untouched


def test_fuse_add_into_the_later_conv_and_move_it():
    b = Builder((2, 4, 4))
    a = b.conv(b.x, _w(2, 2, 1, 1), name="a")
    r = b.act(b.x, "tanh", name="t")  # computed after a: a cannot take t as its residual at a's place
    out = b.add(a, r, name="sum")
    g = b.network(out).graph
    fused = passes.fuse_epilogues(g, infer_shapes(g, (1, 2, 4, 4)))
    assert [(n.name, n.inputs) for n in fused.nodes] == [("x", ()), ("t", ("x",)), ("a", ("x", "t"))]


@pytest.mark.parametrize("case", ["broadcast", "two_users", "softmax", "act_then_add"])
def test_no_fusion(case):
    b = Builder((2, 4, 4))
    c = b.conv(b.x, _w(2, 2, 1, 1), name="c")
    if case == "broadcast":
        pooled = b.layer("adaptive_avg_pool", b.x, output_size=1)
        out = b.add(c, pooled)
    elif case == "two_users":
        out = b.add(b.act(c, "relu"), c)
    elif case == "softmax":  # no epilogue activation
        out = b.layer("softmax", c, dim=1)
    else:
        out = b.add(b.act(b.conv(b.x, _w(2, 2, 1, 1), name="d"), "relu"), c)
    g = b.network(out).graph
    fused = passes.fuse_epilogues(g, infer_shapes(g, (1, 2, 4, 4)))
    if case == "act_then_add":  # d's relu fuses; the add then fuses into c (d already has an activation)
        assert fused.by_name()["d"].attrs["activation"] == "relu"
        assert fused.by_name()["c"].attrs.get("residual") and fused.nodes[-1].name == "c"
    elif case == "two_users":  # the relu cannot fuse (c has two readers); the add can't either
        assert [n.op for n in fused.nodes] == [n.op for n in g.nodes]
    else:
        assert fused.nodes == g.nodes


def test_drop_identities_and_remove_dead():
    b = Builder((3,))
    d = b.layer("dropout", b.x)
    i = b.layer("identity", d)
    b.linear(b.x, _w(2, 3), name="unused")
    out = b.linear(i, _w(2, 3), name="fc")
    g = b.network(out).graph
    g2 = passes.remove_dead(passes.drop_identities(g))
    assert [(n.name, n.inputs) for n in g2.nodes] == [("x", ()), ("fc", ("x",))]


def test_plan_buffers_chain_ping_pongs():
    b = Builder((4, 8, 8))
    h = b.x
    for i in range(5):
        h = b.act(h, "relu")
    g = b.network(h).graph
    plan = passes.plan_buffers(g, infer_shapes(g, (2, 4, 8, 8)))
    assert [plan.buffer[f"act{i}"] for i in range(1, 6)] == [0, 1, 0, 1, 0]
    assert plan.sizes == [512, 512]


def test_plan_buffers_aliases_and_growth():
    b = Builder((4, 2, 2))
    a = b.act(b.x, "relu", name="a")                       # 16 elements
    f = b.flatten(a, name="f")                              # a view of a: a lives until f's last reader
    c = b.layer("cat", a, a, name="c", dim=1)               # 32
    d = b.linear(f, _w(3, 16), name="d")                    # 3
    out = b.add(b.flatten(c, name="fc"), b.linear(d, _w(32, 3), name="e"), name="o")
    g = b.network(out).graph
    plan = passes.plan_buffers(g, infer_shapes(g, (1, 4, 2, 2)))
    assert plan.buffer["f"] == plan.buffer["a"] and plan.buffer["fc"] == plan.buffer["c"]
    assert len({plan.buffer[n] for n in ("a", "c", "d")}) == 3
    _check_plan(g, plan, infer_shapes(g, (1, 4, 2, 2)))


def _check_plan(g: Graph, plan, shapes):
    life = passes.lifetimes(g)
    base = passes.base_of(g)
    vals = [n for n in life if n in plan.buffer]
    for n in vals:
        assert plan.sizes[plan.buffer[n]] >= math.prod(shapes[n]), n
    for i, a in enumerate(vals):
        for b_ in vals[i + 1:]:
            (s1, e1), (s2, e2) = life[a], life[b_]
            if plan.buffer[a] == plan.buffer[b_]:
                assert e1 < s2 or e2 < s1, (a, b_, life[a], life[b_])
    for n in g.nodes:
        if base[n.name] in plan.buffer:
            assert plan.buffer[n.name] == plan.buffer[base[n.name]]


@pytest.mark.parametrize("seed", range(40))
def test_plan_buffers_fuzz(seed):
    rnd = random.Random(seed)
    nodes = [Node("x", "input", (), {"shape": (3,)})]
    for i in range(rnd.randint(1, 30)):
        kind = rnd.choice(["act", "act", "add", "reshape", "cat", "lstm"])
        pick = lambda: rnd.choice(nodes).name  # noqa: E731
        name = f"n{i}"
        if kind == "act":
            nodes.append(Node(name, "act", (pick(),), {"fn": "relu"}))
        elif kind == "add":
            nodes.append(Node(name, "add", (pick(), pick())))
        elif kind == "reshape":
            nodes.append(Node(name, "reshape", (pick(),), {"shape": (-1,)}))
        elif kind == "cat":
            nodes.append(Node(name, "cat", tuple(pick() for _ in range(rnd.randint(1, 3))), {"dim": 1}))
        else:
            nodes.append(Node(name, "lstm", (pick(),)))
    g = Graph(nodes, rnd.choice(nodes[1:]).name).validate()
    # shapes: every value (batch, width) with a random width; the plan only reads element counts
    shapes = {n.name: (2, rnd.randint(1, 50)) for n in nodes}
    shapes["x"] = (2, 3)
    for n in nodes:
        if n.op == "lstm":
            shapes[n.name] = None
    plan = passes.plan_buffers(g, shapes)
    _check_plan(g, plan, {k: v for k, v in shapes.items() if v is not None})
    assert "x" not in plan.buffer and not any(n.op == "lstm" and n.name in plan.buffer for n in nodes)


@pytest.mark.parametrize("fn, kwargs, form", [
    ("relu", {}, "relu"), ("hardsigmoid", {}, "hardsigmoid"), ("hardswish", {"inplace": True}, "hardswish"),
    ("leaky_relu", {"negative_slope": 0.2}, ("leaky_relu", 0.2)), ("elu", {}, ("elu", 1.0)),
    ("gelu", {"approximate": "tanh"}, "gelu_tanh"), ("gelu", {}, "gelu")])
def test_every_activation_of_the_epilogue_table_fuses(fn, kwargs, form):
    """The fusable activations are the epilogue table's (runtime/activations.py), with torch's parameters."""
    b = Builder((2, 4, 4))
    out = b.act(b.conv(b.x, _w(2, 2, 1, 1), name="c"), fn, **kwargs)
    g = b.network(out).graph
    fused = passes.fuse_epilogues(g, infer_shapes(g, (1, 2, 4, 4)))
    assert [n.name for n in fused.nodes] == ["x", "c"] and fused.by_name()["c"].attrs["activation"] == form
