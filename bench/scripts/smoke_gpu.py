"""First GPU figure: blasx DGEMM/SGEMM at N=16384 on all GPUs (host arrays), 3 runs, checked."""
import sys
import time

import numpy as np

import blasx

n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
tile = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
for dt in (np.float64, np.float32):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dt)
    b = rng.standard_normal((n, n)).astype(dt)
    blasx.configure(devices="cuda", tile=tile, cache_bytes=48 << 30)
    c = np.empty((n, n), dt, order="F")
    for r in range(4):
        c[...] = np.nan
        t = time.perf_counter()
        blasx.gemm(1.0, a, b, c=c, overwrite_c=True)
        t = time.perf_counter() - t
        print(f"{np.dtype(dt).name} run {r}: {t:.3f} s  {2 * n**3 / t / 1e12:.1f} TFLOPS", flush=True)
    print(blasx.last_profile().report(), flush=True)
    ref = a[:512].astype(np.float64) @ b.astype(np.float64)
    err = np.linalg.norm(c[:512] - ref) / np.linalg.norm(ref)
    print(f"{np.dtype(dt).name} rel err (first 512 rows): {err:.2e}", flush=True)
    blasx.shutdown()
