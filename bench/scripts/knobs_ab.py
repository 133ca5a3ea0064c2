"""A/B of the scheduling knobs (runtime/knobs.py) in one process, on the same arrays.

    python3 bench/scripts/knobs_ab.py N [gpus]

For each knob setting and beta in (0, 0.5): DGEMM (and SGEMM for the default), 3 timed runs after
a warm-up, every result checked on a row sample, with the per-device breakdown of the best run.
"""
import json
import os
import sys
import time

import numpy as np

import blasx

N = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
GPUS = sys.argv[2] if len(sys.argv) > 2 else None
SETTINGS = ["", "late_c=0", "block_order=0", "chain_kernels=1"]
out = []
rng = np.random.default_rng(0)
arrays = {}
for dt in (np.float64, np.float32):
    a = rng.standard_normal((N, N)).astype(dt)
    b = rng.standard_normal((N, N)).astype(dt)
    c0 = rng.standard_normal((N, N)).astype(dt)
    arrays[dt] = (a, b, c0)
ref_rows = {dt: (arrays[dt][0][:256].astype(np.float64) @ arrays[dt][1].astype(np.float64)) for dt in arrays}
for knobs in SETTINGS:
    for dt in (np.float64, np.float32):
        if dt == np.float32 and knobs:
            continue
        a, b, c0 = arrays[dt]
        os.environ["BLASX_KNOBS"] = knobs
        blasx.configure(devices="cuda" + (":" + GPUS if GPUS else ""), tile=4096, cache_bytes=48 << 30)
        for beta in (0.0, 0.5):
            c = np.empty((N, N), dt, order="F")
            times = []
            best = None
            for r in range(4):
                c[...] = c0 if beta else np.nan
                t = time.perf_counter()
                blasx.gemm(1.0, a, b, beta=beta, c=c, overwrite_c=True)
                t = time.perf_counter() - t
                if r:
                    times.append(t)
                    if best is None or t <= min(times):
                        best = blasx.last_profile().summary()
            ref = ref_rows[dt] + beta * c0[:256]
            err = float(np.linalg.norm(c[:256] - ref) / np.linalg.norm(ref))
            tf = 2 * N**3 / min(times) / 1e12
            row = {"knobs": knobs or "default", "dtype": np.dtype(dt).name, "beta": beta, "N": N,
                   "best_s": min(times), "median_s": float(np.median(times)), "tflops": tf, "rel_err": err,
                   "devices": [{k: d[k] for k in ("name", "tasks", "busy", "comm", "idle")} for d in best["devices"]],
                   "totals": {k: best["totals"][k] for k in ("bytes_h2d", "bytes_d2h", "bytes_p2p", "l1_hits", "l2_hits", "misses")}}
            out.append(row)
            dev = " ".join(f"[{d['busy']:.3f}/{d['comm']:.3f}/{d['idle']:.3f}]" for d in row["devices"])
            print(f"{row['knobs']:44s} {row['dtype']:8s} beta={beta:<4} {tf:7.1f} TFLOPS  best {min(times):.4f}s  "
                  f"err {err:.1e}  busy/comm/idle {dev}  H2D {row['totals']['bytes_h2d']/1e9:.2f}GB "
                  f"P2P {row['totals']['bytes_p2p']/1e9:.2f}GB", flush=True)
        blasx.shutdown()
path = os.path.join(os.environ.get("OUT", "."), f"knobs-ab-N{N}-gpus{GPUS or 'all'}.json")
with open(path, "w") as f:
    json.dump(out, f, indent=1)
print("wrote", path)
