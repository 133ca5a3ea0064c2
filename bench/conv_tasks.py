"""Task counts of blasx.dnn's engine path (plan lengths, nothing run) for the ResNet-50 layers on a
stand-in engine of GPUs: ``python -m bench.conv_tasks --batch 512 --gpus 2``."""

from __future__ import annotations

import argparse
import types

import numpy as np

from blasx.dnn import conv as C
from blasx.dnn.geometry import conv_geometry, transpose_geometry
from blasx.runtime.plans import plan_conv_forward, plan_conv_weight
from blasx.tile import choose_tile

from .conv_layers import RESNET50


class _Gpu:
    """What the tile choice reads of a device: a streamed CUDA device with a large tile cache."""

    streamed, kind, nstreams = True, "cuda", 4

    def cache_capacity(self) -> int:
        return 64 << 30


def stand_in(gpus: int):
    knobs = types.SimpleNamespace(split_k=False, block_order=False)
    return types.SimpleNamespace(devices=[_Gpu() for _ in range(gpus)],
                                 config=types.SimpleNamespace(tile=None, knobs=knobs, streams=4))


def counts(eng, batch: int, cap: bool) -> list[tuple]:
    """(layer, fwd nchw, fwd channels-last, bwd-data nchw, bwd-weight nchw) tasks per layer."""
    rows = []
    for name, c, k, size, ks, s, p in RESNET50:
        x = np.broadcast_to(np.zeros((), np.float32), (batch, c, size, size))
        w = np.broadcast_to(np.zeros((), np.float32), (k, c, ks, ks))
        geo = conv_geometry("conv2d", 2, x, w, s, p, 1, 1)
        dy = np.broadcast_to(np.zeros((), np.float32), (batch, k, *geo.out_size))
        tgeo = transpose_geometry("t", 2, dy, w, s, p, 0, 1, 1, x.shape)
        out = [name]
        for g, cl in ((geo, False), (geo, True), (tgeo, False)):
            rows_ = min(g.n * g.p, C.MAX_ROWS_HINT) if cap else g.n * g.p
            tile = choose_tile(eng, rows_, g.k, g.crs, np.float32, "conv2d")
            out.append(len(plan_conv_forward(g.n, g.p, g.kg, g.crs, 1, tile, cl, w0=0, col0=1, y0=2,
                                             direct=C.conv_direct.pointwise(g) and not cl)))
        rows_ = min(geo.n * geo.p, C.MAX_ROWS_HINT) if cap else geo.n * geo.p
        tile = choose_tile(eng, geo.crs, geo.k, rows_, np.float32, "conv2d_weight")
        out.append(len(plan_conv_weight(geo.n, geo.p, geo.kg, geo.crs, 1, tile, False, col0=0, dy0=1, dw0=2)))
        rows.append(tuple(out))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--gpus", type=int, default=2)
    args = ap.parse_args(argv)
    eng = stand_in(args.gpus)
    print("| layer | fwd nchw | fwd cl | bwd-data nchw | bwd-weight nchw | (before: pixel rows capped at "
          f"{C.MAX_ROWS_HINT}) |")
    for a, b in zip(counts(eng, args.batch, True), counts(eng, args.batch, False)):
        print("| " + " | ".join([a[0]] + [f"{x} -> {y}" for x, y in zip(a[1:], b[1:])]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
