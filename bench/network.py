"""Network benchmark: blasx.dnn.Network (from_torch(...).compile()) against torch on the same weights and the
same host batch, in one process, every output checked.

    python -m bench.network                                          # resnet50, mobilenet_v2; batch 1024; cuda:0,1
    python -m bench.network --models resnet50 --modes fp16 --devices cuda:0
    python -m bench.network --devices sim:2 --batch 4 --shrink 16 --size 32 --reps 1 --out /tmp/r   # CPU smoke run

torch (eval mode, the mode's precision, channels-last on GPUs, cudnn.benchmark on) runs on the first GPU,
the host batch streamed through it in ``--chunk`` chunks including its copies (pinned host memory, one
stream), the same way blasx is fed. blasx runs the batch on the first GPU alone and on all of ``--devices``,
compiled (graph passes) and uncompiled (the graph as traced). Every output is compared with float64 torch
on the CPU for ``--check-images`` images (the first, the last and random ones, so every GPU's chunks are
sampled): a contender passes when its relative-norm error is within
max(the mode's tolerance, 2x torch's own); a failing check is FAIL and is reported, never hidden. With
sims (``--devices sim:N``) torch on the CPU is the peer. Writes network-TAG-STAMP.md/.json to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from . import network_models as NM
from .result_files import beside_peer
from .conv import _list  # comma lists checked against the allowed names
from .level3_check import sample_rows

MODES = ("fp32", "tf32", "fp16", "bf16")
MATH = {"fp32": "ieee", "tf32": "tf32", "fp16": "ieee", "bf16": "ieee"}
TORCH_DTYPE = {"fp32": "float32", "tf32": "float32", "fp16": "float16", "bf16": "bfloat16"}
TOLERANCE = {"fp32": 1e-4, "tf32": 1e-2, "fp16": 2e-2, "bf16": 8e-2}  # relative-norm error of the logits
GOALS = {1: 0.85, 2: 1.7}  # the throughput goals against torch on one GPU, by GPU count



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.network", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--devices", default="cuda:0,1", help="blasx devices: cuda:IDS (default cuda:0,1) or sim:N")
    p.add_argument("--models", default=",".join(NM.MODELS), help=f"comma list of {', '.join(NM.MODELS)}")
    p.add_argument("--modes", default="fp32,tf32,fp16", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--batch", type=int, default=1024, help="images in the host batch (default 1024)")
    p.add_argument("--chunk", type=int, default=None, help="images a chunk, both sides (default: blasx's choice; "
                                                           "torch 128)")
    p.add_argument("--size", type=int, default=224, help="image height and width (default 224)")
    p.add_argument("--shrink", type=int, default=1, help="divide the channel widths by this (smoke runs)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per contender (default 1)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per contender, median (default 3)")
    p.add_argument("--check-images", type=int, default=4,
                   help="images checked against float64 torch: the first, the last and random ones (default 4)")
    p.add_argument("--cache-gib", type=float, default=0.5,
                   help="blasx's tile cache per GPU in GiB (default 0.5: the layers run on their GPU, off the cache)")
    p.add_argument("--no-uncompiled", action="store_true", help="skip the uncompiled blasx runs")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for the run (seconds; default Python's 0.005): how soon a worker "
                        "thread back from a CUDA call gets the interpreter from the others")
    p.add_argument("--eager", action="store_true", help="also the compiled runs with compile(graphs=False) (GPUs: "
                                                        "every chunk layer by layer, no CUDA graphs)")
    p.add_argument("--layout", choices=("auto", "nchw", "cl"), default="auto",
                   help="blasx's activations: nchw or cl (channels-last); auto: cl on GPUs, nchw on sims")
    p.add_argument("--trace", action="store_true", help="also write the Chrome trace of the last blasx run")
    p.add_argument("--tag", default="", help="name part of the output files: network-TAG-STAMP")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="directory of the .json and .md")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no line per run")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.models = _list(args.models, NM.MODELS, "--models")
        args.modes = _list(args.modes, MODES, "--modes")
        args.gpu = args.devices.startswith("cuda")
        if not (args.gpu or args.devices.startswith("sim")):
            raise ValueError(f"--devices: got {args.devices!r}; allowed: cuda:IDS or sim:N")
        args.gpus = [int(i) for i in args.devices.partition(":")[2].split(",") if i.strip()] if args.gpu else []
        if args.gpu and not args.gpus:
            raise ValueError(f"--devices: got {args.devices!r}; name the GPUs, e.g. cuda:0,1")
        for name in ("batch", "size", "shrink", "reps", "check_images"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: got {getattr(args, name)}; need an int >= 1")
        if args.chunk is not None and args.chunk < 1:
            raise ValueError(f"--chunk: got {args.chunk}; need an int >= 1")
        if args.warmup < 0:
            raise ValueError(f"--warmup: got {args.warmup}; need an int >= 0")
        if args.tag and not args.tag.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"--tag: got {args.tag!r}; letters, digits, '-' and '_' only")
    except ValueError as e:
        p.error(str(e))
    return args


def _np_dtype(mode: str):
    if mode == "bf16":
        from ml_dtypes import bfloat16
        return np.dtype(bfloat16)
    return np.dtype(TORCH_DTYPE[mode])


def _to_torch(torch, a: np.ndarray):
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _timed(fn, warmup: int, reps: int):
    """(median seconds, all seconds, the last result)."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), times, out


def torch_runner(torch, model, mode: str, args, x: np.ndarray):
    """A function running torch on the host batch: chunks copied in (pinned, non-blocking), output copied out."""
    import copy
    gpu = args.gpu
    dev = torch.device(f"cuda:{args.gpus[0]}" if gpu else "cpu")
    tdt = getattr(torch, TORCH_DTYPE[mode])
    m = copy.deepcopy(model).to(dev, tdt)
    if gpu:
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
        m = m.to(memory_format=torch.channels_last)
    host = _to_torch(torch, x)
    if gpu:
        host = host.pin_memory()
    chunk = args.chunk or (128 if gpu else len(x))

    def run():
        outs = []
        with torch.no_grad():
            for lo in range(0, host.shape[0], chunk):
                xc = host[lo:lo + chunk].to(dev, non_blocking=True)
                if gpu:
                    xc = xc.contiguous(memory_format=torch.channels_last)
                outs.append(m(xc).to("cpu", non_blocking=gpu))
            if gpu:
                torch.cuda.synchronize(dev)
        y = torch.cat(outs)
        return (y.view(torch.int16).numpy().view(_np_dtype(mode)) if y.dtype == torch.bfloat16 else y.numpy())
    return run


def _check(name: str, y, ref, images, tol: float, torch_err: float | None) -> dict:
    err = _rel(y[images], ref)
    limit = beside_peer(tol, torch_err)
    return {"name": name, "error": err, "limit": limit, "ok": bool(np.isfinite(err) and err <= limit)}


def bench_model(name: str, mode: str, args, log) -> dict:
    import torch

    import blasx
    from blasx import dnn
    model, source = NM.build(name, shrink=args.shrink, seed=args.seed)
    shape = (args.batch, 3, args.size, args.size)
    x = np.random.default_rng(args.seed).standard_normal(shape, dtype=np.float32).astype(_np_dtype(mode))
    images = sample_rows(args.batch, min(args.check_images, args.batch), args.seed)  # every GPU's chunks sampled
    with torch.no_grad():
        import copy
        ref = copy.deepcopy(model).double()(_to_torch(torch, x[images]).double()).numpy()
    tol = TOLERANCE[mode]
    row = {"model": name, "source": source, "mode": mode, "batch": args.batch, "size": args.size, "runs": [],
           "checks": []}
    t_sec, t_times, y = _timed(torch_runner(torch, model, mode, args, x), args.warmup, args.reps)
    torch_chk = _check("torch", y, ref, images, tol, None)
    row["checks"].append(torch_chk)
    row["runs"].append({"name": "torch", "devices": 1, "seconds": t_sec, "images_per_s": args.batch / t_sec,
                        "times": t_times})
    log(f"{name} {mode} torch: {args.batch / t_sec:.1f} images/s, error {torch_chk['error']:.2e}")
    sets = [[args.gpus[0]], args.gpus] if args.gpu and len(args.gpus) > 1 else [args.gpus]
    configs = [(s, True, True) for s in sets] + ([] if args.no_uncompiled else [(sets[-1], False, True)])
    configs += [(s, True, False) for s in sets] if args.eager and args.gpu else []
    for gpus, fuse, graphs in configs:
        blasx.configure(devices=f"cuda:{','.join(map(str, gpus))}" if args.gpu else args.devices,
                        cache_bytes=int(args.cache_gib * (1 << 30)) if args.gpu else None)
        lay = args.layout if args.layout != "auto" else "cl" if args.gpu else "nchw"
        net = dnn.from_torch(model, (1, 3, args.size, args.size)).compile(dtype=_np_dtype(mode), math=MATH[mode],
                                                                          layout=lay, fuse=fuse, graphs=graphs)
        label = (f"blasx {'eager' if fuse and not graphs else 'compiled' if fuse else 'uncompiled'} "
                 f"x{len(gpus) if args.gpu else args.devices}")
        try:
            sec, times, y = _timed(lambda: net(x, chunk=args.chunk, progress=False), args.warmup, args.reps)
        except Exception as e:  # noqa: BLE001 -- reported as ERROR, never silently dropped
            row["checks"].append({"name": label, "error": None, "limit": tol, "ok": False, "exception": repr(e)})
            log(f"{name} {mode} {label}: ERROR {e!r}")
            continue
        chk = _check(label, y, ref, images, tol, torch_chk["error"])
        row["checks"].append(chk)
        prof = net.last_profile()
        graphs_seen = prof.graphs
        if args.gpu and graphs and fuse:  # replayed chunks are timed whole: the layers from one eager call
            net.compile(dtype=_np_dtype(mode), math=MATH[mode], layout=lay, fuse=True, graphs=False)
            net(x, chunk=args.chunk, progress=False)
            prof = net.last_profile()
        run = {"name": label, "devices": len(gpus) if args.gpu else 1, "compiled": fuse, "seconds": sec,
               "images_per_s": args.batch / sec, "times": times, "vs_torch": t_sec / sec,
               "nodes": len(net.nodes) - 1, "layers": prof.summary()["layers"] if fuse else None,
               "report": prof.report(top=15), "graphs": graphs_seen}
        row["runs"].append(run)
        if args.trace and fuse:
            prof.to_chrome_trace(os.path.join(args.out, f"network-{name}-{mode}-x{run['devices']}.trace.json"))
        log(f"{name} {mode} {label}: {run['images_per_s']:.1f} images/s = {run['vs_torch']:.2f}x torch, "
            f"error {chk['error']:.2e} {'ok' if chk['ok'] else 'FAIL'}")
    return row


def _machine(args) -> dict:
    info = {"host": platform.node(), "python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch
        info["torch"] = torch.__version__
        if args.gpu:
            info["gpus"] = [torch.cuda.get_device_name(g) for g in args.gpus]
    except Exception:  # noqa: BLE001 -- informational only
        pass
    return info


def markdown(result: dict) -> str:
    lines = [f"# bench.network {result['date']}", "", f"`{result['command']}`", "",
             f"machine: {json.dumps(result['machine'])}", "",
             "| model | mode | contender | images/s | vs torch | error | check |", "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        checks = {c["name"]: c for c in row["checks"]}
        for run in row["runs"]:
            c = checks.get(run["name"], {})
            lines.append(f"| {row['model']} | {row['mode']} | {run['name']} | {run['images_per_s']:.1f} | "
                         f"{run.get('vs_torch', 1.0):.2f}x | {c.get('error', float('nan')):.2e} | "
                         f"{'ok' if c.get('ok') else 'FAIL'} |")
        for c in row["checks"]:
            if "exception" in c:
                lines.append(f"| {row['model']} | {row['mode']} | {c['name']} | - | - | - | ERROR {c['exception']} |")
    lines.append("")
    for row in result["rows"]:
        for run in row["runs"]:
            if run.get("compiled") and run.get("report"):
                how = " (from one more call with graphs off)" if run.get("graphs") is not None else ""
                lines += [f"## {row['model']} {row['mode']} {run['name']}: top layers{how}", "", "```",
                          run["report"], "```", ""]
    fusion = [f"- {r['model']} {r['mode']}: compiled {c['images_per_s']:.1f} vs uncompiled {u['images_per_s']:.1f} "
              f"images/s ({c['images_per_s'] / u['images_per_s']:.2f}x), {u['nodes']} -> {c['nodes']} nodes"
              for r in result["rows"]
              for c in [x for x in r["runs"] if x.get("compiled") is True][-1:]
              for u in [x for x in r["runs"] if x.get("compiled") is False][:1]]
    if fusion:
        lines += ["## what fusion bought (same devices)", "", *fusion, ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    os.makedirs(args.out, exist_ok=True)
    if args.switch_interval is not None:
        if not args.switch_interval > 0:
            raise SystemExit(f"--switch-interval: got {args.switch_interval}, need seconds > 0")
        sys.setswitchinterval(args.switch_interval)
    rows = [bench_model(name, mode, args, log) for name in args.models for mode in args.modes]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    result = {"command": "python -m bench.network " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": stamp, "machine": _machine(args), "args": {k: v for k, v in vars(args).items()},
              "rows": rows, "ok": all(c["ok"] for r in rows for c in r["checks"])}
    base = os.path.join(args.out, f"network-{args.tag + '-' if args.tag else ''}{stamp}")
    with open(base + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, default=str)
    with open(base + ".md", "w", encoding="utf-8") as f:
        f.write(markdown(result))
    log(f"wrote {base}.md and .json; {'all checks ok' if result['ok'] else 'SOME CHECKS FAILED'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
