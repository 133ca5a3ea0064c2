"""Convolution benchmark: blasx.dnn against cuDNN through torch, in one process, every result checked.

    python -m bench.conv                                   # ResNet-50 set + own layers, fp32/tf32/fp16, 1 GPU
    python -m bench.conv --modes fp16 --layers resnet50 --directions fwd,bwd-data
    python -m bench.conv --host --devices cuda:0,1 --batch 512 --modes fp32,fp16   # see bench.conv_host
    python -m bench.conv --devices sim:2 --shrink 16 --batch 2 --reps 1 --out /tmp/r  # CPU: sims vs torch CPU

Layers (bench.conv_layers): every distinct conv shape of torchvision's resnet50 at 224x224 (traced
with forward hooks where torchvision imports, else a built-in table) at ``--batch`` (64), and a
depthwise, a dilated, a 3-D, a 1-D and a transposed layer; ``--layers mobilenet_v2``: MobileNet-v2's
depthwise 3x3 shapes. Modes: fp32 (TF32 off on both sides:
cudnn.allow_tf32 and cuda.matmul.allow_tf32 False, blasx math "ieee"), tf32 (both on, blasx math
"tf32"), fp16 and bf16 (float32 accumulation). Directions: fwd (conv / conv_transpose),
bwd-data (torch.nn.grad.convNd_input against blasx.dnn.convNd_input), bwd-weight (convNd_weight).

On GPUs (``--devices cuda:0``) both contenders get the same torch tensors, blasx through DLPack as
CuPy arrays (no copy). Both (and the lowered cuBLAS GEMM) are timed alike, as the rate of a loop of calls:
after ``--warmup`` calls, ROUNDS rounds of ``--reps`` calls issued back to back, the GPUs synchronized at the
end of each round; a call's time is the median round's over ``--reps``. blasx's host time to issue a call is
kept too: a layer whose issue time reaches its call time is host-bound (its limit says so). A first, untimed
call records the device-route forms blasx chose (bench.conv_forms; "engine": tile tasks, the sims').
Both results are compared with float64 torch on the same (rounded) inputs: blasx passes when its
relative-norm error is within max(the mode's tolerance, 2x cuDNN's own error); a failing check is
FAIL (an exception ERROR) and is left out of the geometric means, never silently. ``cuBLAS``
is torch.matmul on the lowered GEMM shape (groups 1): a rate the im2col lowering cannot beat.
With sims (``--devices sim:N``) torch on the CPU is the peer and arrays are numpy (CPU tests).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import statistics
import sys
import time

import numpy as np

from . import conv_forms
from . import conv_layers as CL
from .machine import machine_name
from .result_files import beside_peer, command_line, utc_stamp, write_json_md

MODES = ("fp32", "tf32", "fp16", "bf16")
#: the blasx math mode and the operand type of each mode
MATH = {"fp32": "ieee", "tf32": "tf32", "fp16": "ieee", "bf16": "ieee"}
TORCH_DTYPE = {"fp32": "float32", "tf32": "float32", "fp16": "float16", "bf16": "bfloat16"}
#: relative-norm error against float64 allowed per mode (a result rounded to the type, TF32 inputs)
TOLERANCE = {"fp32": 1e-4, "tf32": 5e-3, "fp16": 5e-3, "bf16": 3e-2}
GOAL = 0.8  # the issue's goal: each geomean at >= 0.8x cuDNN
CUBLAS_MAX_BYTES = 4 << 30  # the lowered GEMM's B (the im2col matrix) is built for cuBLAS only below this
ROUNDS = 3  # timed rounds of --reps calls per contender
HOST_BOUND = 0.9  # issue time / call time from which a layer counts as host-bound
FAMILIES = ("resnet50", "own", "mobilenet_v2")


def _list(text: str, allowed, option: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise ValueError(f"{option}: got {text!r}; allowed: {', '.join(allowed)} (comma list)")
    return list(dict.fromkeys(values))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.conv", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--devices", default=None, help="blasx devices: cuda:0 (default; --host: cuda:0,1), sim:N")
    p.add_argument("--modes", default="fp32,tf32,fp16", help=f"comma list of {', '.join(MODES)} (default fp32,tf32,fp16)")
    p.add_argument("--directions", default=",".join(CL.DIRECTIONS), help="comma list of fwd, bwd-data, bwd-weight")
    p.add_argument("--layers", default="resnet50,own",
                   help="comma list of families (resnet50, own, mobilenet_v2) and layer names "
                        "(default resnet50,own)")
    p.add_argument("--batch", type=int, default=None, help="batch (default 64; --host: 512)")
    p.add_argument("--layout", choices=("nchw", "channels-last"), default="nchw",
                   help="memory layout of x, dY and the output on both sides (default nchw)")
    p.add_argument("--weight-layout", choices=("same", "nchw"), default="same",
                   help="the weight's memory layout on both sides: as x's (default), or contiguous NCHW whatever "
                        "x's (torch's default weights beside channels-last activations)")
    p.add_argument("--shrink", type=int, default=1, help="divide channels and sizes by this (smoke runs, tests)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per contender (default 2)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per contender, median (default 5)")
    p.add_argument("--no-cublas", action="store_true", help="skip cuBLAS on the lowered GEMM shape")
    p.add_argument("--cache-gib", type=float, default=None,
                   help="blasx tile cache per GPU (default: half the free memory at the start)")
    p.add_argument("--seed", type=int, default=0)
    h = p.add_argument_group("--host (bench.conv_host)")
    h.add_argument("--host", action="store_true", help="numpy batch in host memory, blasx on --devices vs torch on 1 GPU")
    h.add_argument("--host-modes", default="pinned,pageable,fresh", help="comma list of pinned, pageable, fresh")
    h.add_argument("--torch-chunks", type=int, default=4, help="torch peer: batch chunks on 2 streams (1: serial)")
    h.add_argument("--check-images", type=int, default=4, help="images checked against float64 (default 4)")
    p.add_argument("--tag", default="", help="name part of the output files: conv-TAG-STAMP")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="directory of the .json and .md")
    p.add_argument("--quiet", action="store_true", help="no line per case")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.modes = _list(args.modes, MODES, "--modes")
        args.directions = _list(args.directions, CL.DIRECTIONS, "--directions")
        args.host_modes = _list(args.host_modes, ("pinned", "pageable", "fresh"), "--host-modes")
        args.devices = args.devices or ("cuda:0,1" if args.host else "cuda:0")
        args.gpu = args.devices.startswith("cuda")
        if not (args.gpu or args.devices.startswith("sim")):
            raise ValueError(f"--devices: got {args.devices!r}; allowed: cuda, cuda:IDS, sim:N[,...]")
        args.batch = args.batch or (512 if args.host else 64)
        for name in ("batch", "shrink", "reps", "torch_chunks", "check_images"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: got {getattr(args, name)}; need an int >= 1")
        if args.warmup < 0:
            raise ValueError(f"--warmup: got {args.warmup}; need an int >= 0")
        if args.tag and not args.tag.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"--tag: got {args.tag!r}; letters, digits, '-' and '_' only")
        args.layer_words = [x.strip() for x in args.layers.split(",") if x.strip()]
        if not args.layer_words:
            raise ValueError(f"--layers: got {args.layers!r}; families ({', '.join(FAMILIES)}) or layer names")
    except ValueError as e:
        p.error(str(e))
    return args


def select_layers(args) -> tuple[list, str]:
    """The layers named by --layers (families and names), shrunk; and where ResNet-50's came from."""
    layers, source = CL.layer_set(args.batch)
    words = set(args.layer_words)
    chosen = [CL.shrink(x, args.shrink) for x in layers if x.family in words or x.name in words]
    unknown = words - set(FAMILIES) - {x.name for x in layers}
    if unknown or not chosen:
        raise SystemExit(f"--layers: got {', '.join(sorted(unknown)) or args.layers!r}; allowed: "
                         f"{', '.join(FAMILIES)} or names: {', '.join(x.name for x in layers)}")
    return chosen, source


def load_dnn():
    """blasx.dnn, or an exit naming what is missing."""
    try:
        return importlib.import_module("blasx.dnn")
    except ImportError as e:
        raise SystemExit(f"bench.conv needs blasx.dnn (issue 21): {e}")


# --------------------------------------------------------------------------- where the contenders run


class Side:
    """torch's device, blasx's arrays (CuPy through DLPack on GPUs, numpy views on the CPU), timers."""

    def __init__(self, args):
        import torch
        self.torch, self.gpu = torch, args.gpu
        self.gpus = [int(i) for i in args.devices.partition(":")[2].split(",") if i.strip()] if self.gpu else []
        if self.gpu and not self.gpus:
            self.gpus = list(range(torch.cuda.device_count()))
        self.device = torch.device(f"cuda:{self.gpus[0]}" if self.gpu else "cpu")

    def precision(self, mode: str) -> None:
        """TF32 on both of torch's switches only in tf32 mode; cuDNN autotuning on."""
        t = self.torch
        t.backends.cudnn.benchmark = True
        t.backends.cudnn.allow_tf32 = t.backends.cuda.matmul.allow_tf32 = mode == "tf32"

    def to_blasx(self, t):
        if self.gpu:
            import cupy
            return cupy.from_dlpack(t)
        return self.to_host(t)

    def from_blasx(self, a):
        return self.torch.from_dlpack(a) if self.gpu else self.from_host(a)

    def to_host(self, t) -> np.ndarray:
        """A CPU tensor as a numpy view (bfloat16 as ml_dtypes')."""
        if t.dtype == self.torch.bfloat16:
            from ml_dtypes import bfloat16
            return t.view(self.torch.int16).numpy().view(bfloat16)
        return t.numpy()

    def from_host(self, a):
        """A numpy array as a CPU tensor view."""
        a = np.asarray(a)
        if a.dtype.name == "bfloat16":
            return self.torch.from_numpy(a.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(a)

    def free(self) -> None:
        """Give the memory torch and CuPy cache back, so that the next layer's tensors fit."""
        if self.gpu:
            import cupy
            self.torch.cuda.empty_cache()
            getattr(self.torch._C, "_host_emptyCache", lambda: None)()  # torch's cached page-locked blocks
            for g in self.gpus:
                with cupy.cuda.Device(g):
                    cupy.get_default_memory_pool().free_all_blocks()

    def sync(self) -> None:
        for g in self.gpus:
            self.torch.cuda.synchronize(g)

    def time_calls(self, fn, warmup: int, reps: int) -> tuple[list, object, float]:
        """(seconds a call in each of ROUNDS rounds of ``reps`` calls issued back to back, the devices
        synchronized once a round; the last result; the least host seconds a round took to issue a call).
        ``self.issue_trace`` keeps what the timed calls did on the host: the slowest call to issue and
        the device allocations (cudaMalloc by CuPy's pool) among them."""
        for _ in range(warmup):
            fn()
        self.sync()
        times, issue, out, slowest = [], [], None, 0.0
        with _AllocCount(self.gpu) as allocs:
            for _ in range(ROUNDS):
                t0, host = time.perf_counter(), 0.0
                for _ in range(reps):
                    t = time.perf_counter()
                    out = fn()
                    dt = time.perf_counter() - t
                    host, slowest = host + dt, max(slowest, dt)
                self.sync()
                times.append((time.perf_counter() - t0) / reps)
                issue.append(host / reps)
        self.issue_trace = {"issue_max_s": slowest, "device_allocs": allocs.count}
        return times, out, min(issue)

    def time_wall(self, fn, warmup: int, reps: int, before=None) -> tuple[list, object]:
        """Wall seconds of each timed call, the GPUs synchronized before and after; the last result (host
        batches, bench.conv_host: a call's copies in and out are part of it). ``before()``, untimed, runs before
        every call (an output poisoned, registrations released)."""
        for _ in range(warmup):
            if before is not None:
                before()
            fn()
        self.sync()
        times, out = [], None
        for _ in range(reps):
            if before is not None:
                before()
                self.sync()
            t = time.perf_counter()
            out = fn()
            self.sync()
            times.append(time.perf_counter() - t)
        return times, out


class _AllocCount:
    """Counts CuPy's device allocations (cudaMalloc by its pool) while active; 0 without a GPU."""

    def __init__(self, gpu: bool):
        self.count, self.hook = 0, None
        if gpu:
            import cupy

            class Hook(cupy.cuda.MemoryHook):
                name = "bench-conv-allocs"

                def alloc_preprocess(hook, **kw):  # noqa: N805 - the counter is the outer object
                    self.count += 1
            self.hook = Hook()

    def __enter__(self):
        if self.hook is not None:
            self.hook.__enter__()
        return self

    def __exit__(self, *exc):
        if self.hook is not None:
            self.hook.__exit__(*exc)


def conv_call(nn, grad, layer, direction: str, x, w, dy, **out):
    """One convolution through torch's functions (nn = torch.nn.functional, grad = torch.nn.grad)
    or blasx.dnn's (both = blasx.dnn): the same names, positions and arguments (``out=`` only
    for blasx's forward conv)."""
    d, s, p, dil, g = layer.dims, layer.stride, layer.padding, layer.dilation, layer.groups
    if direction == "fwd":
        if layer.transposed:
            return getattr(nn, f"conv_transpose{d}d")(x, w, None, s, p, layer.output_padding, g, dil)
        return getattr(nn, f"conv{d}d")(x, w, None, s, p, dil, g, **out)
    if direction == "bwd-data":
        return getattr(grad, f"conv{d}d_input")(tuple(layer.x_shape), w, dy, s, p, dil, g)
    return getattr(grad, f"conv{d}d_weight")(x, tuple(layer.w_shape), dy, s, p, dil, g)


def make_inputs(torch, layer, mode: str, device, layout: str, seed: int, weight_layout: str = "same") -> dict:
    """x, w, dY: standard normal x and dY, w scaled by 1/sqrt(fan-in), in the mode's type; the weight in x's
    layout, or contiguous NCHW (``weight_layout`` "nchw")."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, TORCH_DTYPE[mode])
    fan_in = math.prod(layer.w_shape[1:])

    def rand(shape, scale=1.0, lay=layout):
        t = (torch.randn(shape, generator=gen, device=device) * scale).to(dt)
        if lay == "channels-last" and len(shape) in (4, 5):
            t = t.contiguous(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
        return t
    w = rand(layer.w_shape, 1.0 / math.sqrt(fan_in), layout if weight_layout == "same" else "nchw")
    return {"x": rand(layer.x_shape), "w": w, "dy": None if layer.transposed else rand(layer.y_shape)}


def rel_error(torch, got, ref) -> float:
    """||got - ref|| / ||ref|| in float64 (inf for a missing result or a wrong shape)."""
    if got is None or tuple(got.shape) != tuple(ref.shape):
        return math.inf
    den = float(torch.linalg.vector_norm(ref))
    num = float(torch.linalg.vector_norm(got.to(torch.float64) - ref))
    return num / den if den else num


def lowered_gemm_seconds(side, layer, direction: str, mode: str, warmup: int, reps: int):
    """torch.matmul (cuBLAS) on the GEMM shape the direction lowers to; None for groups > 1 and
    operands above CUBLAS_MAX_BYTES."""
    torch = side.torch
    m, n, k = layer.gemm(direction)
    dt = getattr(torch, TORCH_DTYPE[mode])
    if layer.groups != 1 or not side.gpu or (m * k + k * n) * dt.itemsize > CUBLAS_MAX_BYTES:
        return None
    a = torch.randn((m, k), device=side.device).to(dt)
    b = torch.randn((k, n), device=side.device).to(dt)
    times, _, _ = side.time_calls(lambda: a @ b, warmup, reps)
    return statistics.median(times)


def _tflops(flops: float, seconds):
    return flops / seconds / 1e12 if seconds else None


def limit_note(row: dict) -> str:
    """What limits a layer that falls short of the goal, where the columns tell it."""
    if row["status"] != "ok" or row["ratio"] >= GOAL:
        return ""
    notes = []
    issue = row.get("blasx_issue_s")
    if issue and row["blasx_s"] and issue >= HOST_BOUND * row["blasx_s"]:
        allocs = row.get("blasx_device_allocs")
        notes.append(f"host-bound ({1e6 * issue:.0f} us to issue a call"
                     + (f"; {allocs} cudaMalloc in the timed calls)" if allocs else ")"))
    m, n, k = row["gemm"]
    forms = (row.get("form") or "engine").split("+")
    if "channels-last copies" in forms:
        notes.append("NCHW operands copied to channels-last and back")
    if "implicit" in forms:
        notes.append("the implicit kernel's tile loads")
    if "winograd" in forms:
        notes.append("the Winograd transforms' passes over memory")
    if not {"im2col", "col2im", "engine"} & set(forms):  # no col buffer: the GEMM notes do not apply
        return "; ".join(notes) or "-"
    if row["groups"] > 1:
        notes.append(f"{row['groups']} group GEMMs of m={m}, k={k}")
    elif min(m, n, k) < 128:
        notes.append(f"thin GEMM (min dim {min(m, n, k)})")
    if row["cublas_tflops"] and row["cudnn_tflops"] > row["cublas_tflops"]:
        notes.append("cuDNN beats cuBLAS on the lowered GEMM")
    if row["expansion"] > 1:
        notes.append(f"im2col {row['expansion']:.1f}x its input")
    return "; ".join(notes) or "-"


def run_case(side, dnn, layer, direction: str, mode: str, args, inputs: dict) -> dict:
    """One (layer, direction, mode): cuDNN, blasx, the float64 reference, the checks."""
    torch = side.torch
    x, w, dy = inputs["x"], inputs["w"], inputs["dy"]
    itemsize = x.element_size()
    m, n, k = layer.gemm(direction)
    row = {"layer": layer.name, "family": layer.family, "shape": layer.describe(), "direction": direction,
           "mode": mode, "groups": layer.groups, "gemm": [m, n, k], "flops": layer.flops,
           "col_mib": layer.col_elements(direction) * itemsize / 2**20,
           "expansion": layer.col_elements(direction) / layer.expanded_elements(direction)}
    row.update(cudnn_s=None, cudnn_err=None, cublas_s=None, blasx_s=None, blasx_err=None, tolerance=TOLERANCE[mode])
    with torch.no_grad():
        try:  # the peer and the reference: a failure here (out of memory, say) is the row's ERROR
            t_times, t_out, _ = side.time_calls(lambda: conv_call(torch.nn.functional, torch.nn.grad, layer,
                                                                  direction, x, w, dy), args.warmup, args.reps)
            ref = conv_call(torch.nn.functional, torch.nn.grad, layer, direction, x.double(), w.double(),
                            None if dy is None else dy.double())
            row["cudnn_s"] = statistics.median(t_times)
            row["cudnn_err"] = rel_error(torch, t_out, ref)
            del t_out
            if not args.no_cublas:
                row["cublas_s"] = lowered_gemm_seconds(side, layer, direction, mode, args.warmup, args.reps)
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            row.update(status="ERROR", error=f"torch: {type(e).__name__}: {e}"[:300])
            ref = None
        if ref is not None:
            try:
                bx = {key: None if v is None else side.to_blasx(v) for key, v in inputs.items()}
                with conv_forms.recorded([]) as forms:  # a first, untimed call: the forms it chooses
                    conv_call(dnn, dnn, layer, direction, bx["x"], bx["w"], bx["dy"])
                row["form"] = "+".join(forms) or "engine"
                b_times, b_out, row["blasx_issue_s"] = side.time_calls(
                    lambda: conv_call(dnn, dnn, layer, direction, bx["x"], bx["w"], bx["dy"]), args.warmup, args.reps)
                row["blasx_s"] = statistics.median(b_times)
                row.update({f"blasx_{k}": v for k, v in side.issue_trace.items()})
                row["blasx_err"] = rel_error(torch, side.from_blasx(b_out), ref)
                row["tolerance"] = beside_peer(TOLERANCE[mode], row["cudnn_err"])
                row["status"] = "ok" if row["blasx_err"] <= row["tolerance"] else "FAIL"
            except Exception as e:  # noqa: BLE001 - reported as ERROR, the run goes on
                row.update(status="ERROR", error=f"{type(e).__name__}: {e}"[:300])
        del ref
    row["cudnn_tflops"] = _tflops(layer.flops, row["cudnn_s"])
    row["blasx_tflops"] = _tflops(layer.flops, row["blasx_s"])
    row["cublas_tflops"] = _tflops(2.0 * m * n * k, row["cublas_s"])
    row["ratio"] = row["cudnn_s"] / row["blasx_s"] if row["blasx_s"] and row["cudnn_s"] else None
    row["limit"] = limit_note(row)
    return row


def configure_blasx(args, mode: str, side) -> None:
    import blasx
    cache = None
    if args.gpu:
        free = min(side.torch.cuda.mem_get_info(g)[0] for g in side.gpus)
        cache = int(args.cache_gib * 2**30) if args.cache_gib else free // 2
    blasx.configure(devices=args.devices, math=MATH[mode], cache_bytes=cache)


def run_device(args, dnn, log) -> tuple[list, str]:
    """Every (mode, layer, direction): one row each."""
    import blasx
    side = Side(args)
    layers, source = select_layers(args)
    rows = []
    try:
        for mode in args.modes:
            side.precision(mode)
            configure_blasx(args, mode, side)
            for i, layer in enumerate(layers):
                inputs = make_inputs(side.torch, layer, mode, side.device, args.layout, args.seed + i,
                                     args.weight_layout)
                for direction in (d for d in layer.directions if d in args.directions):
                    row = run_case(side, dnn, layer, direction, mode, args, inputs)
                    rows.append(row)
                    log(case_line(row))
                del inputs
                side.free()
    finally:
        blasx.shutdown()
    return rows, source


def case_line(r: dict) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)
    return (f"{r['mode']:<4} {r['direction']:<10} {r['layer']:<22} cuDNN {f(r['cudnn_tflops'], '7.2f')} "
            f"blasx {f(r['blasx_tflops'], '7.2f')} TFLOPS ratio {f(r['ratio'], '5.2f')} "
            f"err {f(r.get('blasx_err'), '.1e')} {r['status']}" + (f" {r['error']}" if r.get("error") else ""))


# --------------------------------------------------------------------------- summary and output


def geomeans(rows: list) -> list[dict]:
    """Geometric mean of blasx / cuDNN throughput per (mode, direction), ResNet-50 set and all;
    checked results only, with the count of the others."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for direction in dict.fromkeys(r["direction"] for r in rows):
            for which, pick in (("ResNet-50", lambda r: r["family"] == "resnet50"), ("all", lambda r: True)):
                rs = [r for r in rows if r["mode"] == mode and r["direction"] == direction and pick(r)]
                ok = [r["ratio"] for r in rs if r["status"] == "ok" and r["ratio"]]
                if rs:
                    g = math.exp(statistics.fmean(math.log(x) for x in ok)) if ok else None
                    out.append({"mode": mode, "direction": direction, "set": which, "geomean": g,
                                "layers": len(rs), "ok": len(ok), "failed": len(rs) - len(ok),
                                "goal_met": g is not None and g >= GOAL and len(ok) == len(rs)})
    return out


def _f(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(doc: dict) -> str:
    lines = [f"# Convolution against cuDNN: {doc['machine']}, {doc['date']}", "", "```", doc["command"], "```", "",
             f"blasx devices `{doc['devices']}`, peer {doc['peer']}; batch {doc['batch']}, layout {doc['layout']}"
             f"{'' if doc.get('weight_layout', 'same') == 'same' else ', weights contiguous NCHW'}, "
             f"calls issued back to back, {ROUNDS} rounds of {doc['reps']} after {doc['warmup']} warm-up(s), the median "
             f"round; ResNet-50 layers {doc['layer_source']}. "
             f"Versions: {', '.join(f'{k} {v}' for k, v in doc['versions'].items())}.", "",
             "## Geometric means of blasx / cuDNN throughput", "",
             "| mode | direction | set | geomean | checked / layers | goal 0.8x |", "| :-- | :-- | :-- | --: | :-- | :-- |"]
    for g in doc["geomeans"]:
        lines.append(f"| {g['mode']} | {g['direction']} | {g['set']} | {_f(g['geomean'])} | {g['ok']} / {g['layers']} | "
                     f"{'met' if g['goal_met'] else 'NOT met'} |")
    lines += ["", "## Per layer", "",
              "| mode | dir | layer | x, kernel -> K | GEMM m x n x k | im2col MiB (x input) | cuDNN ms | cuDNN TFLOPS "
              "| blasx ms | blasx TFLOPS | blasx / cuDNN | cuBLAS TFLOPS (lowered) | err blasx / cuDNN | check | form | limit |",
              "| :-- | :-- | :-- | :-- | :-- | --: | --: | --: | --: | --: | --: | --: | :-- | :-- | :-- | :-- |"]
    for r in doc["rows"]:
        m, n, k = r["gemm"]
        g = f"{r['groups']} x " if r["groups"] > 1 else ""
        ms = lambda s: "-" if s is None else f"{s * 1e3:.3f}"  # noqa: E731
        err = lambda e: "-" if e is None else f"{e:.1e}"  # noqa: E731
        lines.append(f"| {r['mode']} | {r['direction']} | {r['layer']} | {r['shape']} | {g}{m} x {n} x {k} | "
                     f"{_f(r['col_mib'], 1)} ({_f(r['expansion'], 1)}) | {ms(r['cudnn_s'])} | {_f(r['cudnn_tflops'])} | "
                     f"{ms(r['blasx_s'])} | {_f(r['blasx_tflops'])} | {_f(r['ratio'])} | {_f(r['cublas_tflops'])} | "
                     f"{err(r.get('blasx_err'))} / {err(r['cudnn_err'])} | {r['status']} | {r.get('form', '-')} | "
                     f"{r['limit'] or '-'} |")
    errors = [f"- {r['mode']} {r['direction']} {r['layer']}: {r['error']}" for r in doc["rows"] if r.get("error")]
    lines += ["", "Errors are relative-norm errors against float64 torch on the same inputs; a result passes within "
              "max(the mode's tolerance, 2x cuDNN's error): " + ", ".join(f"{m} {t:g}" for m, t in TOLERANCE.items())
              + ". FAIL and ERROR rows are left out of the geometric means. cuBLAS (lowered): torch.matmul on "
              "the direction's GEMM shape (groups 1). im2col MiB: the matrix the derived operand stands for "
              "(never built), 0 for a plain GEMM.", ""] + (["## Errors", "", *errors, ""] if errors else [])
    return "\n".join(lines)


def versions(side_gpu: bool) -> dict:
    import torch
    out = {"torch": torch.__version__}
    if side_gpu:
        out["cudnn"] = torch.backends.cudnn.version()
        try:
            import cupy
            out["cupy"] = cupy.__version__
        except ImportError:
            pass
    try:
        import blasx
        out["blasx"] = blasx.__version__
    except ImportError:
        pass
    return out


def write(args, doc: dict, md: str, prefix: str, log) -> tuple[str, str]:
    base = os.path.join(args.out, f"{prefix}-" + (f"{args.tag}-" if args.tag else "") + doc["stamp"])
    paths = write_json_md(base, doc, md)
    for path in paths:
        log(f"wrote {path}")
    return paths


def main(argv=None, dnn=None) -> int:
    """Run the benchmark; ``dnn`` stands in for blasx.dnn (tests). Exit status 1 on a FAIL or ERROR."""
    args = parse_args(argv)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))  # noqa: E731
    dnn = dnn or load_dnn()
    if args.host:
        from . import conv_host
        return conv_host.main(args, argv, dnn, log)
    stamp, date = utc_stamp()
    rows, source = run_device(args, dnn, log)
    doc = {"kind": "conv", "stamp": stamp, "date": date, "command": command_line("bench.conv", argv),
           "machine": machine_name() if args.gpu else f"{args.devices} (CPU)", "devices": args.devices,
           "peer": "cuDNN through torch" if args.gpu else "torch on the CPU",
           "batch": args.batch, "layout": args.layout, "weight_layout": args.weight_layout, "shrink": args.shrink, "reps": args.reps, "warmup": args.warmup,
           "layer_source": source, "modes": args.modes, "tolerance": TOLERANCE, "versions": versions(args.gpu),
           "geomeans": geomeans(rows), "rows": rows}
    md = markdown(doc)
    write(args, doc, md, "conv", log)
    for g in doc["geomeans"]:
        log(f"geomean {g['mode']} {g['direction']} {g['set']}: {_f(g['geomean'])} ({g['ok']}/{g['layers']} checked)")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
