"""The convolution layers of bench.conv: ResNet-50's distinct conv shapes, MobileNet-v2's depthwise ones
and a few others.

A :class:`Layer` is one convolution (its batch, channels, input size, kernel, stride, padding,
dilation, groups; transposed or not) with what the benchmark reports about it: flops, the GEMM
that each direction lowers to (per group) and the bytes of the im2col matrix that the derived
operand stands for (0 where the lowering is a plain GEMM on the activations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# ResNet-50's, MobileNet-v2's and the own shapes: tables of the library (`blasx tune --conv` times them too)
from blasx.dnn.conv_sets import MOBILENET_V2_DW, OWN, RESNET50

DIRECTIONS = ("fwd", "bwd-data", "bwd-weight")


@dataclass(frozen=True)
class Layer:
    """One convolution. Transposed: ``c`` is x's channels, ``k`` the output's, weight (c, k/g, kernel)."""
    name: str
    batch: int
    c: int
    k: int
    size: tuple
    kernel: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int = 1
    transposed: bool = False
    output_padding: tuple = ()
    family: str = "own"  # "resnet50" for the ResNet-50 set

    @property
    def dims(self) -> int:
        return len(self.size)

    @property
    def out_size(self) -> tuple:
        if self.transposed:
            return tuple((i - 1) * s - 2 * p + d * (r - 1) + op + 1 for i, r, s, p, d, op in zip(
                self.size, self.kernel, self.stride, self.padding, self.dilation, self.output_padding or (0,) * self.dims))
        return tuple((i + 2 * p - d * (r - 1) - 1) // s + 1
                     for i, r, s, p, d in zip(self.size, self.kernel, self.stride, self.padding, self.dilation))

    @property
    def x_shape(self) -> tuple:
        return (self.batch, self.c, *self.size)

    @property
    def y_shape(self) -> tuple:
        return (self.batch, self.k, *self.out_size)

    @property
    def w_shape(self) -> tuple:
        if self.transposed:
            return (self.c, self.k // self.groups, *self.kernel)
        return (self.k, self.c // self.groups, *self.kernel)

    @property
    def directions(self) -> tuple:
        """A transposed layer runs forward only: its backwards are a forward conv and conv_weight."""
        return ("fwd",) if self.transposed else DIRECTIONS

    @property
    def direct(self) -> bool:
        """1x1, stride 1, unpadded: a plain GEMM on the activations (no im2col)."""
        return all(r == 1 for r in self.kernel) and all(s == 1 for s in self.stride) and not any(self.padding)

    @property
    def flops(self) -> float:
        """2 * multiply-adds of the convolution (the same count for its two backwards)."""
        rs = math.prod(self.kernel)
        if self.transposed:
            return 2.0 * self.batch * self.c * math.prod(self.size) * (self.k // self.groups) * rs
        return 2.0 * self.batch * self.k * math.prod(self.out_size) * (self.c // self.groups) * rs

    def gemm(self, direction: str) -> tuple:
        """(m, n, k) of the GEMM of one group that ``direction`` lowers to (times ``groups``)."""
        rs, g = math.prod(self.kernel), self.groups
        npix_in, npix_out = self.batch * math.prod(self.size), self.batch * math.prod(self.out_size)
        if self.transposed:  # the backward-data GEMM of the conv it transposes
            return (self.k // g, npix_out, self.c // g * rs)
        return {"fwd": (self.k // g, npix_out, self.c // g * rs),
                "bwd-data": (self.c // g, npix_in, self.k // g * rs),
                "bwd-weight": (self.k // g, self.c // g * rs, npix_out)}[direction]

    def col_elements(self, direction: str) -> int:
        """Elements of the im2col matrix the derived operand stands for (0: direct GEMM)."""
        if self.direct:
            return 0
        _, n, k = self.gemm(direction)
        return self.groups * n * k

    def expanded_elements(self, direction: str) -> int:
        """Elements of the operand that im2col expands (x, or dY for backward-data)."""
        return math.prod(self.y_shape if direction == "bwd-data" and not self.transposed else self.x_shape)

    def describe(self) -> str:
        """'64x256x56x56 k1x1 s2 -> 512' (x's shape, kernel, stride etc., output channels)."""
        def dims(t):
            return "x".join(map(str, t))
        extra = [f"s{dims(self.stride)}" if any(s != 1 for s in self.stride) else "",
                 f"p{dims(self.padding)}" if any(self.padding) else "",
                 f"d{dims(self.dilation)}" if any(d != 1 for d in self.dilation) else "",
                 f"g{self.groups}" if self.groups != 1 else "", "T" if self.transposed else ""]
        return " ".join([dims(self.x_shape), f"k{dims(self.kernel)}", *filter(None, extra), f"-> {self.k}"])


def conv(name, batch, c, k, size, kernel, stride=1, padding=0, dilation=1, groups=1, transposed=False,
         output_padding=0, family="own") -> Layer:
    """A Layer with int arguments spread over the spatial dims of ``size``."""
    size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
    d = len(size)

    def tup(v):
        return tuple(v) if isinstance(v, (tuple, list)) else (v,) * d
    return Layer(name, batch, c, k, size, tup(kernel), tup(stride), tup(padding), tup(dilation), groups,
                 transposed, tup(output_padding) if transposed else (), family)


def resnet50_table(batch: int) -> list[Layer]:
    return [conv(n, batch, c, k, h, r, s, p, family="resnet50") for n, c, k, h, r, s, p in RESNET50]


def trace_resnet50(batch: int) -> list[Layer] | None:
    """ResNet-50's distinct conv shapes traced from torchvision's model at batch 1 (forward
    hooks), at ``batch``; None without torchvision."""
    try:
        import torch
        from torchvision.models import resnet50
    except Exception:  # noqa: BLE001 - torchvision missing or broken: the table stands in
        return None
    model, seen = resnet50(weights=None).eval(), {}

    def hook(name):
        def record(mod, inputs, _out):
            key = (mod.in_channels, mod.out_channels, tuple(inputs[0].shape[2:]), mod.kernel_size, mod.stride,
                   mod.padding, mod.dilation, mod.groups)
            seen.setdefault(key, name)
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        model(torch.zeros(1, 3, 224, 224))
    for h in handles:
        h.remove()
    return [Layer(name, batch, c, k, size, r, s, p, d, g, family="resnet50")
            for (c, k, size, r, s, p, d, g), name in seen.items()]


def mobilenet_v2_dw_table(batch: int) -> list[Layer]:
    return [conv(n, batch, c, c, h, 3, st, 1, groups=c, family="mobilenet_v2") for n, c, h, st in MOBILENET_V2_DW]


def own_layers(batch: int) -> list[Layer]:
    """Shapes ResNet-50 lacks: depthwise, dilated, 3-D, 1-D, transposed."""
    return [conv(n, max(1, batch // div), c, k, size, r, s, p, dilation=d, groups=g, transposed=t)
            for n, c, k, size, r, s, p, d, g, t, div in OWN]


def layer_set(batch: int, which=("resnet50", "own", "mobilenet_v2")) -> tuple[list[Layer], str]:
    """The layers of the families in ``which`` at ``batch``, and where ResNet-50's came from."""
    out, source = [], "-"
    if "resnet50" in which:
        traced = trace_resnet50(batch)
        source = "traced from torchvision" if traced else "the built-in table (no torchvision)"
        out += traced or resnet50_table(batch)
    if "own" in which:
        out += own_layers(batch)
    if "mobilenet_v2" in which:
        out += mobilenet_v2_dw_table(batch)
    return out, source


def shrink(layer: Layer, factor: int) -> Layer:
    """The layer with channels and spatial sizes divided by ``factor`` (a tiny stand-in for tests
    and smoke runs): at least one channel per group, the kernel's extent kept."""
    if factor == 1:
        return layer
    depthwise = layer.groups == layer.c == layer.k and layer.groups > 1
    g = 1 if depthwise else layer.groups
    c, k = (max(g, -(-ch // factor) // g * g) for ch in (layer.c, layer.k))
    if depthwise:
        k = g = c
    size = tuple(max(d * (r - 1) + 1, i // factor) for i, r, d in zip(layer.size, layer.kernel, layer.dilation))
    return replace(layer, c=c, k=k, size=size, groups=g)
