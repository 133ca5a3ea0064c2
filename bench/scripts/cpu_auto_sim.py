"""PREDICTION: the auto-mode CPU worker beside H200-like timing sims (what it costs where it takes nothing).

    python -m bench.scripts.cpu_auto_sim [--n 16384,32768] [--gpus 2] [--runs 3] [--dilate 8]

No GPU runs. ``bench.scaling_sim``'s fitted 2x H200 model (DGEMM 59 TFLOPS, host links 45 GB/s,
P2P 396 GB/s, launch cost 25 us, the cuda backend's heap and default tile) in data-free timing
mode, with and without an auto-mode CPU worker (``CpuDevice(auto=True)``, as ``configure(cpu=None)``
adds beside CUDA GPUs). The CPU's rate comes from its real probe (this host's numpy), put on the
sims' dilated clock (its seconds times ``--dilate``), so the rule sees the ratio of the real
devices. A task the CPU took would fail (timing operands hold no data): the run reports it.

Per N: ``--runs`` timed calls per mode after one warm-up, modes alternating call by call on two
engines built once; times are wall / dilate. ``alpha 1.5, beta 0.5`` as bench.gemm.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from blasx import operands as _operands
from blasx.dispatch import block_shape
from blasx.runtime.call import Call, Operand
from blasx.runtime.config import parse_devices
from blasx.runtime.devices.cpu import CpuDevice, default_threads
from blasx.runtime.devices.sim import build_sim_devices
from blasx.runtime.engine import Engine, EngineConfig
from blasx.runtime.knobs import Knobs
from blasx.runtime.stats import CallStats, DeviceInfo
from blasx.runtime.plans import plan_gemm
from blasx.runtime.tiling import OP_N

from bench.scaling_sim import FITTED_LINK, MODEL, cuda_heap_bytes, cuda_tile, spec_for


def make_engine(gpus: int, n_max: int, dilate: float, auto: bool):
    model = MODEL.__class__(rate=MODEL.rate, h2d=FITTED_LINK, d2h=FITTED_LINK)
    heap = cuda_heap_bytes(model.gpu_mem)
    devs = build_sim_devices(parse_devices(spec_for(gpus, "d", model, heap, dilate, "independent")),
                             streams=model.streams, trace=True)
    if auto:
        cpu = CpuDevice(gpus, name="cpu", threads=default_threads(gpus), auto=True)
        real_probe = cpu.probe

        def probe(dtype, _real=real_probe):
            flops, seconds = _real(dtype)
            return flops, seconds * dilate  # the CPU on the sims' dilated clock

        cpu.probe = probe
        devs.append(cpu)
    eng = Engine(EngineConfig(devices=devs, tile=None, streams=model.streams, knobs=Knobs.from_env()))
    eng.start()
    return eng, model, heap


def one_call(eng, n: int, model, heap: int) -> tuple[float, Call]:
    dtype = np.dtype(np.float64)
    gpus = sum(1 for d in eng.devices if d.streamed)
    tile = cuda_tile(n, n, n, gpus, dtype.itemsize, heap, model.streams)
    ops = [Operand(None, n, n, n, (1 + i) << 44, -1, (next(_operands._call_bases), n, n, n, dtype.str, tile))
           for i in range(3)]
    tasks = plan_gemm(n, n, n, tile, OP_N, OP_N, alpha_zero=False, beta_zero=False, is_complex=False,
                      block=block_shape(eng))
    call = Call("gemm", ops, tasks, dtype, model.alpha, model.beta,
                CallStats([DeviceInfo(d.index, d.name, d.kind) for d in eng.devices]))
    call.tile = tile
    t0 = time.perf_counter()
    eng.submit(call)
    return time.perf_counter() - t0, call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="16384,32768")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dilate", type=float, default=8.0)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.n.split(",")]
    print(f"PREDICTION (timing sims, no GPU): {args.gpus} H200-like sims, dilate {args.dilate:g}, "
          f"{args.runs} timed calls per mode after one warm-up, modes alternating", flush=True)
    engines = {m: make_engine(args.gpus, max(sizes), args.dilate, m == "auto") for m in ("off", "auto")}
    bad = 0
    try:
        for n in sizes:
            times = {"off": [], "auto": []}
            cpu_tasks = 0
            for k in range(args.runs + 1):
                for mode in ("off", "auto") if k % 2 == 0 else ("auto", "off"):
                    eng, model, heap = engines[mode]
                    wall, call = one_call(eng, n, model, heap)
                    prof = call.stats.profile()
                    mine = prof.counters[len(eng.devices) - 1]["tasks"] if mode == "auto" else 0  # the CPU's
                    if k:
                        cpu_tasks += mine
                    if k:
                        times[mode].append(wall / args.dilate)
                    flops = 2.0 * n ** 3
                    print(f"   N={n} {mode:<4} {'warm-up' if not k else f'run {k}'}: {wall / args.dilate:.4f} s "
                          f"(predicted) {flops / (wall / args.dilate) / 1e12:6.1f} TFLOPS, tile {call.tile}, "
                          f"{len(call.tasks)} tasks" + (f", cpu tasks {mine}" if mode == "auto" else ""), flush=True)
            adm = engines["auto"][0].admission
            off, auto = min(times["off"]), min(times["auto"])
            print(f"N={n}: best off {off:.4f} s, auto {auto:.4f} s, auto/off {auto / off:.3f}; medians "
                  f"{statistics.median(times['off']):.4f} / {statistics.median(times['auto']):.4f}; CPU tasks in "
                  f"timed auto calls {cpu_tasks}", flush=True)
            print(f"   admission decisions so far: { {r: c for r, c in adm.counts.items() if c} }; last {adm.last}",
                  flush=True)
            m = adm.meter
            print("   rates (flop/s on the dilated clock): "
                  + ", ".join(f"worker {w} {k}: {m.rate(w, k):.3g}" for (w, k) in sorted(m._sums)), flush=True)
            bad += cpu_tasks
        for mode, (eng, _, _) in engines.items():
            if eng.failures:
                print(f"{mode}: failures {eng.failures}")
                bad += 1
    finally:
        for eng, _, _ in engines.values():
            eng.shutdown()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
