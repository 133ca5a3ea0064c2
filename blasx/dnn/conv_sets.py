"""Named convolution layer sets for the find step (``blasx tune --conv``) and bench.conv: ResNet-50's
distinct conv shapes, MobileNet-v2's depthwise ones and a few others; or problems from a JSON file.

:func:`problems` turns a spec into find arguments: one dict per layer and direction with name, x_shape,
weight_shape, stride, padding, dilation, groups, direction. A transposed layer is timed as the
backward-data of the convolution it transposes (its forward pass is that), and only for "fwd".
"""

from __future__ import annotations

import json
import os

#: torchvision resnet50's distinct Conv2d shapes at 224x224, in forward order: (first module with
#: the shape, C, K, input H (= W), kernel, stride, padding).
RESNET50 = (
    ("conv1", 3, 64, 224, 7, 2, 3),
    ("layer1.0.conv1", 64, 64, 56, 1, 1, 0),
    ("layer1.0.conv2", 64, 64, 56, 3, 1, 1),
    ("layer1.0.conv3", 64, 256, 56, 1, 1, 0),
    ("layer1.1.conv1", 256, 64, 56, 1, 1, 0),
    ("layer2.0.conv1", 256, 128, 56, 1, 1, 0),
    ("layer2.0.conv2", 128, 128, 56, 3, 2, 1),
    ("layer2.0.conv3", 128, 512, 28, 1, 1, 0),
    ("layer2.0.downsample.0", 256, 512, 56, 1, 2, 0),
    ("layer2.1.conv1", 512, 128, 28, 1, 1, 0),
    ("layer2.1.conv2", 128, 128, 28, 3, 1, 1),
    ("layer3.0.conv1", 512, 256, 28, 1, 1, 0),
    ("layer3.0.conv2", 256, 256, 28, 3, 2, 1),
    ("layer3.0.conv3", 256, 1024, 14, 1, 1, 0),
    ("layer3.0.downsample.0", 512, 1024, 28, 1, 2, 0),
    ("layer3.1.conv1", 1024, 256, 14, 1, 1, 0),
    ("layer3.1.conv2", 256, 256, 14, 3, 1, 1),
    ("layer4.0.conv1", 1024, 512, 14, 1, 1, 0),
    ("layer4.0.conv2", 512, 512, 14, 3, 2, 1),
    ("layer4.0.conv3", 512, 2048, 7, 1, 1, 0),
    ("layer4.0.downsample.0", 1024, 2048, 14, 1, 2, 0),
    ("layer4.1.conv1", 2048, 512, 7, 1, 1, 0),
    ("layer4.1.conv2", 512, 512, 7, 3, 1, 1),
)

#: torchvision mobilenet_v2's distinct depthwise 3x3 convolutions (padding 1, groups = C) at 224x224, in
#: forward order: (first module with the shape, C, input H (= W), stride).
MOBILENET_V2_DW = (
    ("mbv2.features.1.conv.0.0", 32, 112, 1),
    ("mbv2.features.2.conv.1.0", 96, 112, 2),
    ("mbv2.features.3.conv.1.0", 144, 56, 1),
    ("mbv2.features.4.conv.1.0", 144, 56, 2),
    ("mbv2.features.5.conv.1.0", 192, 28, 1),
    ("mbv2.features.7.conv.1.0", 192, 28, 2),
    ("mbv2.features.8.conv.1.0", 384, 14, 1),
    ("mbv2.features.12.conv.1.0", 576, 14, 1),
    ("mbv2.features.14.conv.1.0", 576, 14, 2),
    ("mbv2.features.15.conv.1.0", 960, 7, 1),
)

#: Shapes ResNet-50 lacks: (name, C, K, input size, kernel, stride, padding, dilation, groups, transposed,
#: batch divisor). Transposed: C is x's channels, K the output's.
OWN = (
    ("depthwise3x3", 384, 384, (28, 28), 3, 1, 1, 1, 384, False, 1),
    ("dilated3x3", 256, 256, (28, 28), 3, 1, 2, 2, 1, False, 1),
    ("conv3d3x3x3", 64, 64, (8, 28, 28), 3, 1, 1, 1, 1, False, 4),
    ("conv1d-k3", 256, 256, (2048,), 3, 1, 1, 1, 1, False, 1),
    ("transposed4x4", 256, 128, (28, 28), 4, 2, 1, 1, 1, True, 1),
)

SETS = ("resnet50", "mobilenet_v2", "own")
DIRECTIONS = ("fwd", "bwd-data", "bwd-weight")


def _layer(name, batch, c, k, size, kernel, stride, padding, dilation=1, groups=1, transposed=False) -> dict:
    nd = len(size)
    kern = (kernel,) * nd
    if transposed:  # the forward conv of x (batch, K, out) whose backward-data this is
        out = tuple((i - 1) * stride - 2 * padding + dilation * (kernel - 1) + 1 for i in size)
        return {"name": name, "x_shape": (batch, k, *out), "weight_shape": (c, k // groups, *kern),
                "stride": stride, "padding": padding, "dilation": dilation, "groups": groups, "transposed": True}
    return {"name": name, "x_shape": (batch, c, *size), "weight_shape": (k, c // groups, *kern), "stride": stride,
            "padding": padding, "dilation": dilation, "groups": groups, "transposed": False}


def layers(which: str, batch: int) -> list[dict]:
    """The layers of set ``which`` (one of SETS) at ``batch``."""
    if which == "resnet50":
        return [_layer(n, batch, c, k, (h, h), r, s, p) for n, c, k, h, r, s, p in RESNET50]
    if which == "mobilenet_v2":
        return [_layer(n, batch, c, c, (h, h), 3, s, 1, groups=c) for n, c, h, s in MOBILENET_V2_DW]
    if which == "own":
        return [_layer(n, max(1, batch // div), c, k, size, r, s, p, d, g, t)
                for n, c, k, size, r, s, p, d, g, t, div in OWN]
    raise ValueError(f"layers: got {which!r}, need one of {', '.join(SETS)}")


def _from_json(path: str, batch: int) -> list[dict]:
    """Layers from a JSON list of {"x": [N, C, ...], "weight": [K, C/g, ...], "stride", "padding",
    "dilation", "groups" (each optional, default 1, 0, 1, 1), "name" (optional)}; N may be null (``batch``)."""
    try:
        with open(path, encoding="utf-8") as f:
            items = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"layers: cannot read {path!r} as JSON: {e}") from None
    if not isinstance(items, list) or not all(isinstance(i, dict) and "x" in i and "weight" in i for i in items):
        raise ValueError(f"layers: {path!r} must hold a JSON list of objects with 'x' and 'weight' shapes")
    out = []
    for j, it in enumerate(items):
        unknown = sorted(set(it) - JSON_KEYS)
        if unknown:
            raise ValueError(f"layers: {path!r} item {j}: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"allowed: {', '.join(sorted(JSON_KEYS))}")
        for name in ("x", "weight"):
            if not isinstance(it[name], list):
                raise ValueError(f"layers: {path!r} item {j}: {name!r} must be a list of sizes, got {it[name]!r}")
        x = list(it["x"])
        x[0] = batch if x and x[0] is None else x[0]
        out.append({"name": str(it.get("name", f"{os.path.basename(path)}[{j}]")), "x_shape": tuple(x),
                    "weight_shape": tuple(it["weight"]), "stride": _arg(it.get("stride", 1)),
                    "padding": _arg(it.get("padding", 0)), "dilation": _arg(it.get("dilation", 1)),
                    "groups": it.get("groups", 1), "transposed": False})
    return out


#: the keys of a JSON layer
JSON_KEYS = frozenset({"x", "weight", "stride", "padding", "dilation", "groups", "name"})


def _arg(v):
    return tuple(v) if isinstance(v, list) else v


def problems(spec: str, batch: int = 32, directions=("fwd",)) -> list[dict]:
    """Find arguments for ``spec``: a set name (SETS), "all", a JSON file, or layer names from the sets,
    comma-separated; one dict per layer and direction (a transposed layer: "fwd" only, as bwd-data)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"layers: got {spec!r}, need {', '.join(SETS)}, all, layer names or a JSON file")
    bad = [d for d in directions if d not in DIRECTIONS]
    if bad or not directions:
        raise ValueError(f"directions: got {directions!r}, need one or more of {', '.join(DIRECTIONS)}")
    everything = {s: layers(s, batch) for s in SETS}
    by_name = {lay["name"]: lay for s in SETS for lay in everything[s]}
    chosen: list[dict] = []
    for item in (t.strip() for t in spec.split(",") if t.strip()):
        if item == "all":
            chosen += [lay for s in SETS for lay in everything[s]]
        elif item in everything:
            chosen += everything[item]
        elif item in by_name:
            chosen.append(by_name[item])
        elif item.endswith(".json") or os.path.isfile(item):
            chosen += _from_json(item, batch)
        else:
            raise ValueError(f"layers: {item!r} is not {', '.join(SETS)}, all, a JSON file nor a layer of those "
                             f"sets (such as 'layer1.0.conv2', 'depthwise3x3')")
    if not chosen:
        raise ValueError(f"layers: {spec!r} names no layer")
    out = []
    for lay in chosen:
        for d in directions:
            if lay["transposed"] and d != "fwd":
                continue
            out.append({**{k: v for k, v in lay.items() if k != "transposed"},
                        "direction": "bwd-data" if lay["transposed"] else d})
    return out
