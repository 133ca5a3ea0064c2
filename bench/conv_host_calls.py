"""Host time of one blasx.dnn convolution call on CuPy operands, with no GPU: conv2d's CuPy route on
the CPU stand-in for CuPy (bench/fake_cupy.py: every launch a no-op), per ResNet-50 layer, as a
Network worker calls it (inside ``on_own_gpu``, on a worker's stream, ``out=`` a planned buffer, bias
on the host, relu, the weights the same arrays every call).

    python -m bench.conv_host_calls --batch 64 --reps 200 --dtype float16 --layouts nchw,cl

Prints microseconds per call per layer and their mean (the launches' own CuPy/driver costs are not
in it: the stand-in's launches cost next to nothing); ``--profile`` adds cProfile's top entries.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from . import fake_cupy
from .conv_layers import resnet50_table


def _cl(cupy, shape, dtype):
    moved = cupy.empty((shape[0], *shape[2:], shape[1]), dtype=dtype)
    return moved.transpose(0, moved.ndim - 1, *range(1, moved.ndim - 1))


def layer_calls(fake, batch: int, dtype, layout: str, residual: bool):
    """(name, call) per ResNet-50 layer: a conv2d on fake CuPy arrays as a Network worker makes it."""
    from blasx import dnn
    cupy = fake.cupy
    rng = np.random.default_rng(0)
    calls = []
    for layer in resnet50_table(batch):
        alloc = (lambda s: _cl(cupy, s, dtype)) if layout == "cl" else (lambda s: cupy.empty(s, dtype=dtype))
        x, y = alloc(layer.x_shape), alloc(layer.y_shape)
        res = alloc(layer.y_shape) if residual else None
        w = cupy.empty(layer.w_shape, dtype=dtype)
        b = rng.standard_normal(layer.k)

        def call(layer=layer, x=x, y=y, w=w, b=b, res=res):
            return dnn.conv2d(x, w, b, layer.stride, layer.padding, layer.dilation, layer.groups,
                              activation="relu", residual=res, out=y)
        calls.append((layer.name, call))
    return calls


def _workspace():
    """A Network worker's Workspace where this version has them (weights' transforms and scratch kept)."""
    try:
        from blasx.dnn import direct_cache
    except ImportError:
        import contextlib
        return contextlib.nullcontext()
    return direct_cache.using(direct_cache.Workspace())


def measure(batch: int, reps: int, dtype, layout: str, residual: bool, profile: bool = False) -> dict:
    """Microseconds per call per layer (median of 5 runs of ``reps`` calls each)."""
    from blasx.dnn import conv_direct
    out = {}
    with fake_cupy.installed() as fake:
        cupy = fake.cupy
        stream = cupy.cuda.Stream(non_blocking=True)
        with cupy.cuda.Device(0), stream, conv_direct.on_own_gpu(), _workspace():
            calls = layer_calls(fake, batch, dtype, layout, residual)
            for _, call in calls:
                call()  # warm: kernels made, caches filled
            for name, call in calls:
                runs = []
                for _ in range(5):
                    t = time.perf_counter()
                    for _ in range(reps):
                        call()
                    runs.append((time.perf_counter() - t) / reps * 1e6)
                out[name] = sorted(runs)[2]
            if profile:
                import cProfile
                import pstats
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(max(1, reps // 10)):
                    for _, call in calls:
                        call()
                pr.disable()
                pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        out["mem_info_calls"] = fake.state["mem_info_calls"]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--layouts", default="nchw,cl")
    ap.add_argument("--residual", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    results = {}
    for lay in a.layouts.split(","):
        r = measure(a.batch, a.reps, np.dtype(a.dtype), lay, a.residual, a.profile)
        results[lay] = r
        calls = r.pop("mem_info_calls")
        print(f"layout {lay}, {a.dtype}, batch {a.batch}{', residual' if a.residual else ''} "
              f"(memGetInfo calls: {calls})")
        for name, us in r.items():
            print(f"  {name:<24}{us:9.1f} us")
        print(f"  {'mean':<24}{sum(r.values()) / len(r):9.1f} us")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
