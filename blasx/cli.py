"""The ``blasx`` command line: ``gemm`` (an out-of-core GEMM on the devices found, checked against
numpy, with a progress line and a report), ``info`` (devices, links, perf-db; ``--measure``: rates,
:mod:`blasx.probe`) and ``tune`` (store the best tile sizes in the perf-db; ``--conv``: the fastest
convolution form per layer, :mod:`blasx.dnn.find`; ``--show``, ``--clear``).

Bad options end with a one-line error and exit status 2, as argparse's own; the settings of
``blasx.configure`` in force before a command are back in force after it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import os
import re
import sys
import time

import numpy as np

from . import dispatch, precision
from .runtime import dtypes

MIN_CACHE_BYTES = 1 << 16
CPU_HELP = ("the CPU worker beside the GPUs takes tasks by demand (cpu=True; default: auto mode beside CUDA "
            "GPUs, taking a task only when predicted to help; none beside sims)")
DEVICES_HELP = ("device spec: cuda, cuda:0,1, sim:4, sim:2,slow=4, cpu "
                "(default: $BLASX_DEVICES, else all CUDA GPUs, else cpu)")


# ---------------------------------------------------------------- argument types

def _arg_type(convert, need: str, ok=lambda v: True):
    """An argparse type: ``convert(text)`` (ValueError: not valid) passing ``ok``; errors say what
    was received and ``need``."""
    def parse(text: str):
        try:
            v = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}, need {need}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"got {v}, need {need}")
        return v
    return parse


def _items(text: str) -> list[str]:
    """The non-empty comma-separated items of ``text`` (ValueError if none)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(text)
    return items


def _prefix(text: str) -> str:
    """The prefix named by a prefix or a type name (``d``, ``float64``, ``half``, ``i8``; gemm's reduced types)."""
    return dtypes.parse(text, gemm=True).prefix


_positive = _arg_type(int, "a positive integer", lambda v: v >= 1)
_nonnegative = _arg_type(int, "an integer >= 0", lambda v: v >= 0)
_positive_list = _arg_type(lambda t: [_positive(x) for x in _items(t)], "positive integers separated by commas")
_dtype = _arg_type(_prefix, f"one of {', '.join(dtypes.GEMM_PREFIXES)} (or {dtypes.GEMM_ALLOWED})")
_dtype_list = _arg_type(lambda t: list(dict.fromkeys(map(_prefix, _items(t)))),
                        f"one or more of {', '.join(dtypes.GEMM_PREFIXES)} separated by commas")


_DIRECTIONS = ("fwd", "bwd-data", "bwd-weight")


def _direction_list(text: str) -> list[str]:
    """"all", or conv directions separated by commas (ValueError: another word)."""
    if text.strip() == "all":
        return list(_DIRECTIONS)
    items = list(dict.fromkeys(_items(text)))
    if any(d not in _DIRECTIONS for d in items):
        raise ValueError(text)
    return items


_directions = _arg_type(_direction_list, f"all or one or more of {', '.join(_DIRECTIONS)} separated by commas")


def _devices(text: str) -> str:
    from .runtime.config import parse_devices

    try:
        parse_devices(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("devices: ")) from None
    return text


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _bytes(text: str) -> int:
    """'1048576', '64M', '64MiB', '1.5G', '2GB' (binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"got {text!r}, need a byte count such as 268435456, 256M or 2G")
    v = int(float(m.group(1)) * _UNITS[m.group(2)])
    if v < MIN_CACHE_BYTES:
        raise argparse.ArgumentTypeError(f"got {text!r} ({v} bytes), need at least {MIN_CACHE_BYTES} (64K)")
    return v


# ---------------------------------------------------------------- the parser

# Descriptions and epilogs keep their line breaks; option help is wrapped.
_Formatter = functools.partial(argparse.RawDescriptionHelpFormatter, max_help_position=30)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="blasx", formatter_class=_Formatter,
        description="blasx: level-3 BLAS on every GPU of a server, on host matrices larger than GPU "
                    "memory\n(the BLASX design: tile caches, work stealing, peer reads).",
        epilog="examples:\n"
               "  blasx gemm --n 16384 --dtype d          an out-of-core DGEMM, checked, with a report\n"
               "  blasx info --measure                    devices, links, bandwidths, GEMM rates\n"
               "  blasx tune --n 8192,16384               store the best tile sizes in the perf-db\n"
               "  blasx tune --conv resnet50              store each conv layer's fastest form (a GPU)\n"
               "\n'blasx COMMAND --help' shows a command's options.")
    from . import __version__
    p.add_argument("--version", action="version", version=f"blasx {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")
    p.commands = sub.choices  # command -> its parser, for its errors

    g = sub.add_parser(
        "gemm", formatter_class=_Formatter,
        help="run C = A B on host arrays across the devices, check it, report",
        description="Out-of-core GEMM C = A B on random host (numpy) arrays across the configured devices,\n"
                    "timed, checked against numpy on a sample of rows, with the per-device profile.\n"
                    "It prints its settings first and a result line last; a progress line (tiles done / total,\n"
                    "rate) is drawn on stderr when it is a terminal.",
        epilog="examples:\n"
               "  blasx gemm --n 16384                          DGEMM 16384^3 on all GPUs\n"
               "  blasx gemm --m 30000 --n 20000 --k 10000 --dtype s --devices cuda:0\n"
               "  blasx gemm --n 2048 --devices sim:2 --trace t.json   simulated GPUs, Chrome trace\n"
               "\nexit status: 0 checked ok, 1 wrong result or device failure, 2 bad options.")
    size = g.add_argument_group("problem")
    size.add_argument("--n", type=_positive, default=4096, metavar="N",
                      help="columns of C, and M and K unless given (default 4096)")
    size.add_argument("--m", type=_positive, metavar="M", help="rows of C (default N)")
    size.add_argument("--k", type=_positive, metavar="K", help="inner dimension (default N)")
    size.add_argument("--dtype", type=_dtype, default="d", metavar="{" + ",".join(dtypes.GEMM_PREFIXES) + "}",
                      help=f"{dtypes.GEMM_ALLOWED} (default d); h, b accumulate in float32, i8 in int32")
    size.add_argument("--math", choices=dtypes.MATH_MODES, default="ieee",
                      help="float32's math: ieee (default) or tf32 (TF32 tensor cores)")
    run = g.add_argument_group("devices and runs")
    run.add_argument("--devices", type=_devices, metavar="SPEC", help=DEVICES_HELP)
    run.add_argument("--tile", type=_positive, metavar="T", help="tile size (default: perf-db, else chosen per call)")
    run.add_argument("--cache-bytes", type=_bytes, metavar="BYTES",
                     help="tile cache per device, e.g. 8G (binary units: 8G = 8 GiB; a sim spec's mem= reads "
                          "K M G T as decimal, Ki Mi Gi Ti as binary; default: half the free GPU memory; 64M per sim)")
    run.add_argument("--cpu", action="store_true", help=CPU_HELP)
    run.add_argument("--runs", type=_positive, default=2, metavar="R", help="timed calls (default 2)")
    run.add_argument("--check-rows", type=_nonnegative, default=256, metavar="ROWS",
                     help="rows checked against numpy (default 256; 0: no check)")
    out = g.add_argument_group("output")
    shown = out.add_mutually_exclusive_group()
    shown.add_argument("--progress", dest="progress", action="store_true", default=None,
                       help="draw the progress line on stderr even when it is not a terminal")
    shown.add_argument("--no-progress", dest="progress", action="store_false",
                       help="no progress line")
    out.add_argument("--trace", metavar="FILE", help="write the last call's timeline as Chrome-trace JSON")
    out.add_argument("--profile", metavar="FILE", help="write the last call's profile plot (PNG; needs matplotlib)")

    i = sub.add_parser(
        "info", formatter_class=_Formatter,
        help="show the devices, their memory and links, rates, and the perf-db",
        description="The devices blasx would use: memory, tile cache, peer links, and the perf-db entries\n"
                    "(those that calls on these devices use are marked *). With --measure, also the rates:\n"
                    "  cuda  pinned host->device and device->host copies (256 MiB), peer copies over each\n"
                    "        peer link (256 MiB), cuBLAS DGEMM and SGEMM (N = 8192): about a second per GPU;\n"
                    "  sim   the configured cost model (not measured);\n"
                    "  cpu   numpy's DGEMM and SGEMM.")
    i.add_argument("--devices", type=_devices, metavar="SPEC", help=DEVICES_HELP)
    i.add_argument("--measure", action="store_true",
                   help="measure bandwidths and GEMM rates (about a second per GPU)")
    i.add_argument("--db", metavar="FILE", help="perf-db file to list (default: the one blasx calls read)")

    t = sub.add_parser(
        "tune", formatter_class=_Formatter,
        help="measure the tile sizes and store the best in the perf-db",
        description="Time GEMM on host arrays with each candidate tile size, check the results, and store\n"
                    "the fastest per device model, device count, dtype and shape class in the perf-db,\n"
                    "which later calls read (the paper's Section V-B: the tile size is the only tuning\n"
                    "parameter). With --conv, the find step instead: time every form of each convolution\n"
                    "layer's device route (im2col, shifted, implicit, winograd; weight gradients: batched; strided\n"
                    "backward-data: col2im, phases) on a CUDA GPU with CuPy operands,\n"
                    "check them against each other, and store the fastest in the find-db (the same file),\n"
                    "which blasx.dnn's convolutions on that GPU model read.",
        epilog="examples:\n"
               "  blasx tune --n 8192,16384              default candidates, double and single\n"
               "  blasx tune --n 16384 --dtype d --tiles 4096,8192\n"
               "  blasx tune --conv resnet50 --batch 64  ResNet-50's layers, float32, forward\n"
               "  blasx tune --conv layer1.0.conv2,layer4.1.conv2 --direction all --layout cl\n"
               "  blasx tune --conv shapes.json          [{\"x\": [32, 64, 56, 56], \"weight\": [64, 64, 3, 3],\n"
               "                                         \"padding\": 1}, ...]\n"
               "  blasx tune --show                      list the entries")
    t.add_argument("--n", type=_positive_list, metavar="N[,N...]",
                   help="sizes N, comma-separated (M = K = N unless given); default by backend "
                        "(cuda 8192,16384)")
    t.add_argument("--m", type=_positive, metavar="M", help="rows of C for every N")
    t.add_argument("--k", type=_positive, metavar="K", help="inner dimension for every N")
    t.add_argument("--dtype", type=_dtype_list, metavar="D[,D...]",
                   help=f"dtypes {', '.join(dtypes.GEMM_PREFIXES)}, comma-separated (default d,s; --conv: s "
                        f"of d, s, h, b)")
    t.add_argument("--devices", type=_devices, metavar="SPEC", help=DEVICES_HELP)
    t.add_argument("--tiles", type=_positive_list, metavar="T[,T...]",
                   help="candidate tiles, comma-separated (default by backend: cuda 2048,3072,4096,6144,8192)")
    t.add_argument("--cache-bytes", type=_bytes, metavar="BYTES",
                   help="tile cache per device, e.g. 8G (binary units, as gemm's)")
    t.add_argument("--cpu", action="store_true", help=CPU_HELP)
    t.add_argument("--runs", type=_positive, metavar="R",
                   help="timed calls per tile (--conv: per form) after one warm-up (default 2; --conv 3)")
    t.add_argument("--check-rows", type=_nonnegative, default=64, metavar="ROWS",
                   help="rows checked against numpy (default 64; 0: no check)")
    t.add_argument("--db", metavar="FILE", help="perf-db file (default: perfdb.sqlite in $BLASX_CACHE_DIR, "
                                                "$XDG_CACHE_HOME/blasx or ~/.cache/blasx (no home: a private "
                                                "temporary folder), the one blasx calls read)")
    conv = t.add_argument_group("convolutions (the find step, on a CUDA GPU)")
    conv.add_argument("--conv", metavar="LAYERS",
                      help="layers to time: resnet50, mobilenet_v2, own, all, layer names of those sets "
                           "(e.g. layer1.0.conv2), or a JSON file of shapes; comma-separated")
    conv.add_argument("--batch", type=_positive, default=32, metavar="N", help="images per call (default 32)")
    conv.add_argument("--direction", type=_directions, default=["fwd"], metavar="D[,D...]",
                      help="fwd, bwd-data, bwd-weight or all, comma-separated (default fwd)")
    conv.add_argument("--layout", choices=("nchw", "cl"), default="nchw",
                      help="activations' layout: nchw (default) or cl (channels-last)")
    conv.add_argument("--math", choices=dtypes.MATH_MODES, help="float32's math: ieee (default) or tf32")
    conv.add_argument("--gpu", type=_nonnegative, default=0, metavar="I", help="CUDA GPU ordinal (default 0)")
    what = t.add_mutually_exclusive_group()
    what.add_argument("--show", action="store_true", help="list the perf-db entries and exit")
    what.add_argument("--clear", action="store_true", help="remove every perf-db entry and exit")

    return p


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    import blasx

    from .perfdb import PerfDbError
    from .runtime.devices.base import DeviceError

    prev = blasx.session.settings()
    sub = parser.commands[args.cmd]
    try:
        return {"gemm": _gemm, "info": _info, "tune": _tune}[args.cmd](blasx, sub, args)
    except (DeviceError, PerfDbError) as exc:  # not the options' fault: one line on stderr, status 1
        print(f"{sub.prog}: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a $BLASX_* variable read where a module loads (blasx.dnn's): the user's setting
        if not str(exc).startswith("$BLASX_"):
            raise
        print(f"{sub.prog}: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError as exc:  # numpy's: host memory the estimate could not see (a cgroup's, ulimit's); else a
        text = str(exc).rstrip(".")  # device's (the tile cache full, CuPy out of memory), said as it is
        what = "out of host memory" + (f": {text}" if text else "") + "; try smaller sizes" \
            if type(exc) is MemoryError or "Unable to allocate" in text else text or type(exc).__name__
        print(f"{sub.prog}: error: {what}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{sub.prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # (`blasx info | head`: the reader left; Python's documented way out)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0 if args.cmd == "info" else 1  # (gemm's check and tune's stores may not have run)
    finally:
        blasx.configure(**dataclasses.asdict(prev))  # the settings before, and no engine left running


def _start(blasx, parser, **settings):
    """Configure and start the engine; device-spec problems are usage errors (exit 2)."""
    from .runtime.devices.base import DeviceError

    merged = {**dataclasses.asdict(blasx.session.settings()), **{k: v for k, v in settings.items() if v is not None}}
    try:
        blasx.configure(**merged)
        return blasx.engine()
    except DeviceError:
        raise
    except (ValueError, RuntimeError) as exc:
        msg = str(exc)
        if isinstance(exc, RuntimeError) and not msg.startswith("devices:"):
            raise
        for name, option in (("devices", "--devices"), ("cache_bytes", "--cache-bytes")):  # (the flag given)
            if msg.startswith(name + ":") and settings.get(name) is not None:
                msg = f"argument {option}:" + msg[len(name) + 1:]
        parser.error(msg)


def _check_output_path(parser, option: str, path: str | None) -> None:
    if path is None:
        return
    if not path.strip():
        parser.error(f"argument {option}: got an empty file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"argument {option}: got {path!r}, but its folder {folder} does not exist")
    if os.path.isdir(path):
        parser.error(f"argument {option}: got {path!r}, which is a folder; need a file name")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        parser.error(f"argument {option}: got {path!r}, which cannot be written")


def _gemm(blasx, parser, args) -> int:
    from . import precision, probe
    from .progress import Progress, wanted
    from .tile import choose_tile

    m, n, k = args.m or args.n, args.n, args.k or args.n
    blas_type = dtypes.GEMM_BY_PREFIX[args.dtype]
    dtype, out_dtype = blas_type.dtype, blas_type.out
    _check_output_path(parser, "--trace", args.trace)
    _check_output_path(parser, "--profile", args.profile)
    if args.profile and importlib.util.find_spec("matplotlib") is None:
        parser.error(f"argument --profile: got {args.profile!r}, but the plot needs matplotlib, "
                     f"which is not installed (pip install 'blasx[plot]')")
    nbytes = (m * k + k * n) * dtype.itemsize + m * n * out_dtype.itemsize
    try:
        precision.check_host_memory([(m, n, k)], [blas_type])
    except ValueError as exc:
        parser.error("arguments --m/--n/--k:" + str(exc).removeprefix("sizes:"))
    eng = _start(blasx, parser, devices=args.devices, tile=args.tile, cache_bytes=args.cache_bytes,
                 cpu=True if args.cpu else None)
    rng = np.random.default_rng(0)
    try:
        tile = choose_tile(eng, m, n, k, dtype, math=args.math)
    except ValueError as exc:  # the tile (given or the smallest) does not fit the tile cache
        parser.error(f"argument --tile: {str(exc).removeprefix('tile: ')}" if args.tile else str(exc))
    names = ", ".join(d.name for d in eng.devices)
    tiles = -(-m // tile) * -(-n // tile)
    kind = dtype.name if out_dtype == dtype else f"{dtype.name} -> {out_dtype.name}"
    runs = dispatch.math_that_runs(eng, args.math)
    math = f", {runs} math{'' if runs == args.math else ' (the CPU has no TF32)'}" if blas_type.prefix == "s" else ""
    # Said before the arrays are made and the runs start, so a log shows what runs at once.
    print(f"blasx gemm: {m}x{n}x{k} {kind} ({args.dtype}){math}, {probe.format_bytes(nbytes)} of operands, "
          f"on {eng.spec} ({names}), tile {tile} ({tiles} tile(s) of C), {args.runs} run(s)", flush=True)
    a, b = precision.random_operand(rng, (m, k), dtype), precision.random_operand(rng, (k, n), dtype)
    c = np.empty((m, n), out_dtype, order="F")
    poison = np.iinfo(out_dtype).min if out_dtype.kind in "iu" else np.nan
    flops = 2 * blas_type.flop_factor * m * n * k
    show = wanted(args.progress, sys.stderr)
    times = []
    for r in range(args.runs):
        c[...] = poison  # every element must be written
        with Progress(sys.stderr, label=f"run {r}", flops=flops, enabled=show):
            t = time.perf_counter()
            blasx.gemm(1, a, b, c=c, overwrite_c=True, math=args.math)
            t = time.perf_counter() - t
        times.append(t)
        print(f"  run {r}: {t:.3f} s, {flops / t / 1e12:.3f} TFLOPS", flush=True)
    prof = blasx.last_profile()
    print(prof.report())
    status, verdict = 0, "not checked"
    if any(getattr(d, "timing", False) for d in eng.devices):
        verdict = "not checked (timing-mode sims compute no data)"
    elif args.check_rows:
        rows = min(args.check_rows, m)
        err, tol = precision.check_rows(c[:rows], a[:rows], b, blas_type, prof.host.get("math", "ieee"))
        ok = (out_dtype.kind in "iu" or bool(np.isfinite(c).all())) and err <= tol
        print(f"check: {rows} rows against numpy, relative error {err:.2e} ({'ok' if ok else 'WRONG'}, tolerance {tol:g})")
        status, verdict = (0, "check ok") if ok else (1, "check WRONG")
    best = min(times)
    print(f"result: best of {len(times)} run(s) {best:.3f} s, {flops / best / 1e12:.3f} TFLOPS, {verdict}",
          flush=True)
    failed = blasx.engine().failures
    if failed:  # (the call was run again on the devices left: its answer stands, the failure is reported)
        print("device failure: " + "; ".join(f"{name}: {exc!r}" for name, exc in failed), file=sys.stderr)
        status = 1
    try:
        if args.trace:
            prof.to_chrome_trace(args.trace)
            print(f"trace: {args.trace}")
        if args.profile:
            prof.plot(args.profile)
            print(f"profile plot: {args.profile}")
    except OSError as exc:
        print(f"{parser.prog}: error: writing {exc.filename or 'the output'}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return status


def _versions(blasx) -> str:
    text = f"blasx {blasx.__version__}, numpy {np.__version__}"
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            rt = cupy.cuda.runtime.runtimeGetVersion()
            drv = cupy.cuda.runtime.driverGetVersion()
            text += f", cupy {cupy.__version__} (CUDA runtime {rt // 1000}.{rt % 1000 // 10}, driver {drv // 1000}.{drv % 1000 // 10})"
        except Exception:  # noqa: BLE001 - versions are a courtesy
            text += f", cupy {getattr(cupy, '__version__', '?')}"
    return text


def _info(blasx, parser, args) -> int:
    from . import probe
    from .perfdb import PerfDb, device_key, disabled

    _check_db(parser, args.db, write=False)
    eng = _start(blasx, parser, devices=args.devices)
    devices = list(eng.devices)
    facts = probe.device_facts(devices)
    links = probe.peer_links(devices)
    print(_versions(blasx))
    print("\n".join(probe.format_devices(eng.spec, facts) + probe.format_links(facts, links)))
    asked = blasx.session.settings().math
    runs = dispatch.math_that_runs(eng, asked)
    print(f"math: float32 gemm in {runs}{'' if runs == asked else f' ({asked} configured: the CPU has no TF32)'} "
          f"(blasx.configure(math='tf32') or a call's math='tf32': TF32 tensor cores); gemm types "
          f"{', '.join(dtypes.GEMM_PREFIXES)} ({dtypes.gemm_combinations()})")
    if args.measure:
        blasx.shutdown()  # frees the tile caches: the GPU measurements need the memory
        print("measuring...", file=sys.stderr, flush=True)
        rates = probe.measure(devices, links)
        print("\n".join(probe.format_rates(facts, rates)))
    db = PerfDb(args.db)  # (--db checked before the engine started)
    print("\n".join(probe.format_perfdb(db.path, db.entries(), device_key(devices), disabled())))
    return 0


def _check_db(parser, path: str | None, write: bool) -> None:
    """A --db the user named: not a folder, not a file of something else, and (to be written) in a folder that
    exists; a missing file is an empty db."""
    from .perfdb import file_problem
    if path is None:
        return
    why = file_problem(path)
    if why is not None:
        parser.error(f"argument --db: got {path!r}, which {why}")
    if write:
        _check_output_path(parser, "--db", path)


def _tune(blasx, parser, args) -> int:
    from .perfdb import PerfDb, disabled
    from .probe import format_perfdb
    from .tune import tune

    _check_db(parser, args.db, write=not args.show and not args.clear)
    db = PerfDb(args.db)
    if args.show:
        from .dnn import finddb
        print("\n".join(format_perfdb(db.path, db.entries(), disabled=disabled())))
        print("\n".join(finddb.format_entries(finddb.entries(db))))
        return 0
    if args.clear:
        existed = db.path.exists()
        n = db.clear()
        print(f"perf-db {db.path}: " + ("damaged or of another version: deleted" if existed and not db.path.exists()
                                        else f"removed {n} entr{'y' if n == 1 else 'ies'}"))
        return 0
    if args.conv is not None:
        return _tune_conv(parser, args, db)
    if (args.m or args.k) and args.n is None:
        parser.error("arguments --m/--k: need --n (the sizes they go with)")
    sizes = None if args.n is None else [(args.m or n, n, args.k or n) for n in args.n]
    eng = _start(blasx, parser, devices=args.devices, cache_bytes=args.cache_bytes,
                 cpu=True if args.cpu else None)
    names = ", ".join(d.name for d in eng.devices)
    print(f"blasx tune: {eng.spec} ({names}); perf-db {db.path}")
    try:
        rows = tune(sizes=sizes, dtypes=args.dtype or ["d", "s"], tiles=args.tiles, runs=args.runs or 2, db=db,
                    check_rows=args.check_rows, progress=lambda line: print("  " + line, flush=True))
    except ValueError as exc:  # (tiles below the devices' floor, sizes over the host memory: known once it runs)
        msg = str(exc)
        for word, option in (("tiles:", "argument --tiles:"), ("sizes:", "arguments --m/--n/--k:")):
            if msg.startswith(word):
                msg = option + msg[len(word):]
        parser.error(msg)
    print(f"{'dtype':<6}{'M x N x K':<22}{'shape class':<22}{'best':>6}  TFLOPS per tile (* best)")
    for r in rows:
        marks = {t: "*" if t == r["tile"] else "!" if t in r["bad"] else "" for t in r["tflops"]}
        cells = [f"{t}: -" if t in r["skipped"] else f"{t}: {r['tflops'][t]:.4g}{marks[t]}"
                 for t in r["tiles"] if t in r["skipped"] or t in marks]
        best = str(r["tile"]) if r["tile"] is not None else "none"
        mnk, shape = f"{r['m']}x{r['n']}x{r['k']}", "x".join(map(str, r["shape"]))
        print(f"{r['dtype']:<6}{mnk:<22}{shape:<22}{best:>6}  {'  '.join(cells)}")
    if any(r["skipped"] or r["bad"] for r in rows):
        print("(-: tile too big for the tile cache; !: wrong result, not a candidate)")
    stored = sum(r["stored"] for r in rows)
    print(f"stored {stored} of {len(rows)} entr{'y' if len(rows) == 1 else 'ies'} in {db.path}")
    return int(any(r["tile"] is None or r["bad"] or not r["stored"] for r in rows))  # 1: not every size stored


def _tune_conv(parser, args, db) -> int:
    """``blasx tune --conv``: the find step over a layer set (exit 1 where a layer failed or no GPU exists)."""
    from .dnn import conv_sets, finddb
    find = importlib.import_module("blasx.dnn.find")  # (blasx.dnn.find is the function)

    given = [o for o, v in (("--n", args.n), ("--m", args.m), ("--k", args.k), ("--tiles", args.tiles),
                            ("--devices", args.devices), ("--cache-bytes", args.cache_bytes), ("--cpu", args.cpu)) if v]
    if given:
        parser.error(f"argument --conv: {', '.join(given)} tune GEMM tiles, not convolutions; drop them")
    conv_types = args.dtype or ["s"]
    for p in conv_types:
        try:
            finddb.conv_dtype(p)
        except ValueError:
            parser.error(f"argument --dtype: got {p!r}; convolutions take d, s, h, b")
    try:
        problems = conv_sets.problems(args.conv, args.batch, tuple(args.direction))
    except ValueError as exc:
        parser.error(f"argument --conv: {str(exc).removeprefix('layers: ')}")
    for prob in problems:  # every shape checked before anything runs
        try:
            finddb.problem_key(prob["x_shape"], prob["weight_shape"], prob["stride"], prob["padding"],
                               prob["dilation"], prob["groups"], direction=prob["direction"], device="-")
        except (ValueError, TypeError) as exc:
            parser.error(f"argument --conv: layer {prob['name']!r}: {exc}")
    try:
        find._gpu(args.gpu)
    except find.NoGpuError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        parser.error(f"argument --gpu: {str(exc).removeprefix('device: ')}")
    runs = args.runs or 3
    print(f"blasx tune --conv: {len(problems) * len(conv_types)} problem(s) on GPU {args.gpu} "
          f"({finddb.gpu_name(args.gpu)}), {args.layout}, {runs} run(s) per form; find-db {db.path}", flush=True)
    status, stored, alone = 0, 0, 0
    for p in conv_types:
        for prob in problems:
            name, kw = prob["name"], {k: v for k, v in prob.items() if k != "name"}
            try:
                r = find.find(kw.pop("x_shape"), kw.pop("weight_shape"), **kw, dtype=p, layout=args.layout,
                              math=args.math, device=args.gpu, runs=runs, db=db)
            except Exception as exc:  # noqa: BLE001 - one layer's failure is reported, the others still run
                print(f"  {name:<28}{prob['direction']:<11}{p:<3}FAILED: {type(exc).__name__}: {exc}", flush=True)
                status = 1
                continue
            cells = "  ".join(f"{f} FAILED ({r['failed'][f]})" if f in r["failed"] else
                              f"{f} {r['best'][f] * 1e3:.3f} ms{'!' if f in r['bad'] else ''}" for f in r["forms"])
            print(f"  {name:<28}{prob['direction']:<11}{p:<3}{r['form'] or 'none':<11}{cells}", flush=True)
            stored += r["stored"]
            alone += not r["storable"]
            if r["bad"] or (r["storable"] and not r["stored"]):
                status = 1
    total = len(problems) * len(conv_types)
    note = f" ({alone} dilated strided backward-data problem(s) run col2im alone: timed, nothing to choose)" \
        if alone else ""
    print(f"(!: differs from the first form, not a candidate)\nstored {stored} of {total} "
          f"entr{'y' if total == 1 else 'ies'} in {db.path}{note}")
    return status


if __name__ == "__main__":
    sys.exit(main())
