"""bench.conv --host: a numpy batch in host memory, blasx.dnn forward on every GPU of --devices
against torch on one GPU doing copy in, conv, copy out from pinned memory.

    python -m bench.conv --host --devices cuda:0,1 --batch 512 --modes fp32,fp16 --reps 3 --warmup 1

Per mode and layer (forward), x (batch N) and the output live in host memory, page-locked
(``pinned``: registered before timing, as bench.gemm's registered mode) or not (``pageable``:
blasx's own registrations are released before every run, so each run pays its pinning; ``fresh``: each
run's x is a copy blasx has never seen, made before the clock starts, and blasx makes the output, as a
data loader's batches come: the one-shot case). The
weights are where each contender keeps them between calls: host memory for blasx (a numpy array
that owns its memory, as a user's would: blasx page-locks it in place on the first call), the GPU
for torch. torch runs two ways on its first GPU from pinned tensors: ``serial`` (the whole batch
copied in, convolved, copied out) and ``overlapped`` (``--torch-chunks`` chunks on two streams, so
one chunk's copies overlap another's conv); the ratio is taken against the faster. Both sides' outputs
are poisoned (NaN, by the host, untimed) before every call. Figures:
images/s (N / wall seconds), blasx / torch, checked on ``--check-images`` sampled images against
float64 torch. With sims, torch on the CPU is the peer and nothing is page-locked.
"""

from __future__ import annotations

import contextlib
import math
import statistics

import numpy as np

from . import conv as C
from .level3_check import sample_rows
from .machine import machine_name
from .result_files import beside_peer, command_line, utc_stamp
from .tallskinny import traffic

GOAL = 1.6  # the goal: >= 1.6x torch on one GPU


def host_inputs(torch, layer, mode: str, layout: str, seed: int, device):
    """(x, w) as CPU torch tensors in the mode's type (x in the layout), standard normal scaled,
    drawn on ``device`` (a GPU draws a batch of 512 in a blink)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, C.TORCH_DTYPE[mode])
    x = torch.randn(layer.x_shape, generator=gen, device=device).to(dt)
    if layout == "channels-last" and x.dim() in (4, 5):
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    w = torch.randn(layer.w_shape, generator=gen, device=device) / math.sqrt(math.prod(layer.w_shape[1:]))
    return x.cpu(), w.to(dt).cpu()


def pinned_pair(side, layer, x_host):
    """torch's x (a page-locked copy of x_host) and y (page-locked, in x's layout); plain CPU
    tensors on sims."""
    torch = side.torch
    stored, axes = _stored(layer.y_shape, x_host)
    pin = side.gpu
    return (torch.empty_like(x_host, pin_memory=pin).copy_(x_host),
            torch.empty(stored, dtype=x_host.dtype, pin_memory=pin).permute(axes))


def torch_peer(side, layer, x_pin, y_pin, w, chunks: int):
    """A callable running torch's forward on its first GPU from pinned x into pinned y (copy in,
    conv, copy out; ``chunks`` > 1: on two streams). On the CPU: the conv alone."""
    torch, F = side.torch, side.torch.nn.functional
    if not side.gpu:
        return lambda: y_pin.copy_(C.conv_call(F, None, layer, "fwd", x_pin, w, None))
    dev = side.device
    w_dev = w.to(dev)
    streams = [torch.cuda.Stream(dev) for _ in range(2 if chunks > 1 else 1)]
    step = -(-layer.batch // chunks)
    spans = [(lo, min(layer.batch, lo + step)) for lo in range(0, layer.batch, step)]

    def run():
        for i, (lo, hi) in enumerate(spans):
            with torch.cuda.stream(streams[i % len(streams)]):
                xd = x_pin[lo:hi].to(dev, non_blocking=True)
                y_pin[lo:hi].copy_(C.conv_call(F, None, layer, "fwd", xd, w_dev, None), non_blocking=True)
        torch.cuda.synchronize(dev)
    return run


def sample_images(n: int, count: int, seed: int) -> list[int]:
    """Sorted distinct images: the first, the last and random ones (level3_check.sample_rows, at least two)."""
    return sample_rows(n, max(count, 2), seed).tolist()


def check(side, layer, x_host, w, got, images) -> float:
    """Relative-norm error of ``got`` (torch tensor of y) on ``images`` against float64 torch."""
    torch = side.torch
    dev = side.device
    xs = x_host[images].to(dev, torch.float64)
    ref = C.conv_call(torch.nn.functional, None, layer, "fwd", xs, w.to(dev, torch.float64), None)
    return C.rel_error(torch, got[images].to(dev), ref)


def _release(arrays) -> None:
    """Unregister what blasx page-locked in an earlier run (pageable mode pays it every run)."""
    try:
        from blasx.runtime.hostmem import REGISTRY
    except ImportError:
        return
    for a in arrays:
        REGISTRY.release(a)


def _pinned(side, arrays):
    """Page-lock the arrays' memory (a channels-last view's NHWC base) for the block; not on sims."""
    if not side.gpu:
        return contextlib.nullcontext()
    from .cublasxt import registered
    whole = [a if a.flags.c_contiguous or a.flags.f_contiguous else a.base for a in arrays]
    return registered(*whole)


def run_layer(side, dnn, layer, mode: str, args, seed: int, log) -> list[dict]:
    import blasx
    torch = side.torch
    x_t, w_t = host_inputs(torch, layer, mode, args.layout, seed, side.device)
    x, w = _owned(side.to_host(x_t)), _owned(side.to_host(w_t))  # numpy owns them, as a user's would
    images = sample_images(layer.batch, args.check_images, seed)
    base = {"layer": layer.name, "family": layer.family, "shape": layer.describe(), "mode": mode,
            "batch": layer.batch, "flops": layer.flops}
    peers, pairs = {}, None
    try:  # the peer: a failure here (out of memory, say) is every host mode's ERROR
        for name, chunks in (("serial", 1), ("overlapped", args.torch_chunks)) if args.torch_chunks > 1 and side.gpu \
                else (("serial", 1),):
            x_pin, y_pin = pairs = pairs or pinned_pair(side, layer, x_t)
            with torch.no_grad():  # y poisoned before every call, as blasx's (its pages written by the host then)
                times, _ = side.time_wall(torch_peer(side, layer, x_pin, y_pin, w_t, chunks), args.warmup, args.reps,
                                          lambda: y_pin.fill_(float("nan")))
                peers[name] = {"seconds": statistics.median(times), "chunks": chunks,
                               "err": check(side, layer, x_t, w_t, y_pin, images)}
    except Exception as e:  # noqa: BLE001 - reported, the run goes on
        log(f"{mode} {layer.name}: torch failed: {type(e).__name__}: {e}")
        return [dict(base, host_mode=hm, torch=peers, torch_best_s=None, torch_err=None, blasx_s=None,
                     blasx_err=None, blasx_images_s=None, torch_images_s=None, ratio=None, status="ERROR",
                     error=f"torch: {type(e).__name__}: {e}"[:300]) for hm in args.host_modes]
    del pairs
    best = min(peers.values(), key=lambda p: p["seconds"])
    torch_err = max(p["err"] for p in peers.values())
    rows = []
    for hm in args.host_modes:
        y = _empty_out(x, layer)
        out = {} if layer.transposed or hm == "fresh" else {"out": y}
        row = dict(base, host_mode=hm, torch=peers, torch_best_s=best["seconds"], torch_err=torch_err)
        fresh = [_owned(x) for _ in range(args.warmup + args.reps)] if hm == "fresh" else []
        try:
            with _pinned(side, [x, y]) if hm == "pinned" else contextlib.nullcontext():
                def call():
                    xs = fresh.pop() if fresh else x
                    return C.conv_call(dnn, dnn, layer, "fwd", xs, w, None, **out)

                def untimed():  # every call writes its whole output afresh (and pageable pays its page-locking)
                    if hm == "pageable":
                        _release([x, y])
                    if out:
                        y.fill(np.nan)
                before = blasx.last_profile()
                times, got = side.time_wall(call, args.warmup, args.reps, untimed)
            row["blasx_s"] = statistics.median(times)
            row.update(traffic(blasx, before), x_bytes=x.nbytes)
            row["blasx_err"] = check(side, layer, x_t, w_t, side.from_host(got), images)
            row["tolerance"] = beside_peer(C.TOLERANCE[mode], torch_err)
            row["status"] = "ok" if row["blasx_err"] <= row["tolerance"] else "FAIL"
        except Exception as e:  # noqa: BLE001 - reported as ERROR, the run goes on
            row.update(blasx_s=None, blasx_err=None, status="ERROR", error=f"{type(e).__name__}: {e}"[:300])
        finally:
            if hm == "pageable":
                _release([x, y])
        row["blasx_images_s"] = layer.batch / row["blasx_s"] if row["blasx_s"] else None
        row["torch_images_s"] = layer.batch / best["seconds"]
        row["ratio"] = best["seconds"] / row["blasx_s"] if row["blasx_s"] else None
        rows.append(row)
        peer_ms = ", ".join(f"{k} {v['seconds'] * 1e3:.1f} ms" for k, v in peers.items())
        log(f"{mode:<4} {hm:<8} {layer.name:<22} blasx {C._f(row['blasx_images_s'], 0)} img/s, torch "
            f"{row['torch_images_s']:.0f} img/s ({peer_ms}) "
            f"ratio {C._f(row['ratio'])} {row['status']}" + (f" {row['error']}" if row.get("error") else ""))
    return rows


def _owned(x: np.ndarray) -> np.ndarray:
    """A copy of x in memory numpy owns, in x's layout."""
    out = _empty(x.shape, x)
    np.copyto(out, x)
    return out


def _stored(shape, like) -> tuple[tuple, tuple]:
    """(the shape as stored, the axes that view it as ``shape``): NHWC memory for a channels-last
    ``like`` (numpy array or torch tensor), else ``shape`` itself."""
    nd, st = len(shape), like.strides if isinstance(like, np.ndarray) else tuple(like.stride())
    item = like.itemsize if isinstance(like, np.ndarray) else 1
    if nd in (4, 5) and st[1] == item and like.shape[1] > 1:
        order = (0, *range(2, nd), 1)
        return tuple(shape[i] for i in order), tuple(int(i) for i in np.argsort(order))
    return tuple(shape), tuple(range(nd))


def _empty(shape, like: np.ndarray) -> np.ndarray:
    """An empty numpy array of ``shape`` in the layout of ``like``."""
    stored, axes = _stored(shape, like)
    return np.empty(stored, dtype=like.dtype).transpose(axes)


def _empty_out(x: np.ndarray, layer) -> np.ndarray:
    return _empty(layer.y_shape, x)


def summarize(rows: list) -> list[dict]:
    """Per (mode, host mode): the whole set as one pass (sum of times) and the geomean of ratios."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for hm in dict.fromkeys(r["host_mode"] for r in rows):
            rs = [r for r in rows if (r["mode"], r["host_mode"]) == (mode, hm)]
            ok = [r for r in rs if r["status"] == "ok"]
            t_b, t_t = sum(r["blasx_s"] for r in ok), sum(r["torch_best_s"] for r in ok)
            g = math.exp(statistics.fmean(math.log(r["ratio"]) for r in ok)) if ok else None
            out.append({"mode": mode, "host_mode": hm, "layers": len(rs), "ok": len(ok), "geomean": g,
                        "set_ratio": t_t / t_b if ok else None, "goal_met": bool(ok) and len(ok) == len(rs)
                        and t_t / t_b >= GOAL})
    return out


def markdown(doc: dict) -> str:
    lines = [f"# Convolution from host memory: {doc['machine']}, {doc['date']}", "", "```", doc["command"], "```", "",
             f"blasx devices `{doc['devices']}` against torch: {doc['peer']}; batch {doc['batch']}, layout "
             f"{doc['layout']}, median of {doc['reps']} after {doc['warmup']} warm-up(s); forward only. "
             f"Versions: {', '.join(f'{k} {v}' for k, v in doc['versions'].items())}.", "",
             "| mode | host memory | set: torch s / blasx s | geomean blasx / torch | checked / layers | goal 1.6x |",
             "| :-- | :-- | --: | --: | :-- | :-- |"]
    for s in doc["summary"]:
        lines.append(f"| {s['mode']} | {s['host_mode']} | {C._f(s['set_ratio'])} | {C._f(s['geomean'])} | "
                     f"{s['ok']} / {s['layers']} | {'met' if s['goal_met'] else 'NOT met'} |")
    lines += ["", "| mode | host memory | layer | x, kernel -> K | blasx images/s | torch images/s | torch serial ms "
              "| torch overlapped ms | blasx ms | blasx / torch | H2D / x | err blasx / torch | check |",
              "| :-- | :-- | :-- | :-- | --: | --: | --: | --: | --: | --: | --: | :-- | :-- |"]
    for r in doc["rows"]:
        ms = lambda k: C._f(r["torch"][k]["seconds"] * 1e3, 1) if k in r["torch"] else "-"  # noqa: E731
        err = lambda e: "-" if e is None else f"{e:.1e}"  # noqa: E731
        lines.append(f"| {r['mode']} | {r['host_mode']} | {r['layer']} | {r['shape']} | {C._f(r['blasx_images_s'], 0)} | "
                     f"{C._f(r['torch_images_s'], 0)} | {ms('serial')} | {ms('overlapped')} | "
                     f"{C._f(r['blasx_s'] and r['blasx_s'] * 1e3, 1)} | {C._f(r['ratio'])} | "
                     f"{C._f(r['h2d_bytes'] / r['x_bytes'] if r.get('h2d_bytes') else None)} | "
                     f"{err(r.get('blasx_err'))} / {err(r['torch_err'])} | {r['status']} |")
    errors = [f"- {r['mode']} {r['host_mode']} {r['layer']}: {r['error']}" for r in doc["rows"] if r.get("error")]
    lines += ["", "torch: the faster of serial and overlapped, both from pinned memory with the weights on the GPU; "
              "H2D / x: bytes blasx copied in (weights included) over x's bytes, in its last run; "
              "errors against float64 torch on the sampled images.", ""] + (["## Errors", "", *errors, ""] if errors else [])
    return "\n".join(lines)


def main(args, argv, dnn, log) -> int:
    import blasx
    side = C.Side(args)
    layers, _ = C.select_layers(args)
    stamp, date = utc_stamp()
    rows = []
    try:
        for mode in args.modes:
            side.precision(mode)
            C.configure_blasx(args, mode, side)
            for i, layer in enumerate(layers):
                rows += run_layer(side, dnn, layer, mode, args, args.seed + i, log)
                side.free()
    finally:
        blasx.shutdown()
    chunks = f"serial, and {args.torch_chunks} chunks on 2 streams" if args.torch_chunks > 1 else "serial"
    doc = {"kind": "conv-host", "stamp": stamp, "date": date, "command": command_line("bench.conv", argv),
           "machine": machine_name() if args.gpu else f"{args.devices} (CPU)", "devices": args.devices,
           "peer": f"one GPU, copy in + conv + copy out, {chunks}" if args.gpu else "torch on the CPU", "batch": args.batch,
           "layout": args.layout, "reps": args.reps, "warmup": args.warmup, "versions": C.versions(args.gpu),
           "summary": summarize(rows), "rows": rows}
    C.write(args, doc, markdown(doc), "convhost", log)
    for s in doc["summary"]:
        log(f"{s['mode']} {s['host_mode']}: set ratio {C._f(s['set_ratio'])}, geomean {C._f(s['geomean'])} "
            f"({s['ok']}/{s['layers']} checked)")
    return 0 if all(r["status"] == "ok" for r in rows) else 1
