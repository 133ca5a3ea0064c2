"""bench/cpu_overhead.py: a tiny run of every entry, and its noise verdict."""

from __future__ import annotations

import importlib
import itertools


def test_bench_cpu_overhead_runs(capsys):
    bench = importlib.import_module("bench.cpu_overhead")
    assert bench.main(["--sizes", "8", "--dtypes", "d,c", "--rounds", "2", "--target-ms", "0.2", "--entries", "all"]) == 0
    out = capsys.readouterr().out
    for what in ("matmul", "tensordot", "gemm-C", "linalg-trsm", "linalg-her2k", "ovh best", "gemm-c", "gemm-ow",
                 "matmul-out", "dot-out", "matmul-dtype", "linalg-syrk-ow", "linalg-her2k-conv", "linalg-trsm-a0",
                 "blasx-trmm-ow", "blasx-hemm-c", "matmul-sub", "matmul-strided", "matmul-list", "dot-list", "gemm-np",
                 "linalg-gemm-list", "blasx-syrk-np", "noise", "verdict", "# slower than the peer by more than its noise"):
        assert what in out, what
    assert "WRONG" not in out
    assert bench.main(["--sizes", "8", "--dtypes", "s", "--rounds", "2", "--target-ms", "0.2", "--no-noise"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in bench.DEFAULT_ENTRIES if "he" not in name)
    assert "matmul-list" not in out


def test_bench_cpu_overhead_noise_verdict():
    """The noise column: the peer timed twice in each round (the six orders in turn), and the verdict."""
    bench = importlib.import_module("bench.cpu_overhead")
    assert sorted(bench.ORDERS) == sorted(itertools.permutations(range(3)))
    assert [bench.verdict_of(p, 0.1) for p in (0.05, 0.1, 0.2, -0.05, -0.2)] == [
        "noise", "noise", "SLOWER", "noise", "faster"]
    calls = []
    r = bench.compare(lambda: calls.append("o"), lambda: calls.append("p"), rounds=6, target_s=1e-5)
    assert {"noise", "paired"} <= set(r) and r["noise"] >= 0
    assert calls.count("p") == 10 + 2 * calls.count("o")  # (10: the calibration) the peer timed twice a round
    assert "noise" not in bench.compare(lambda: None, lambda: None, rounds=2, target_s=1e-5, noise=False)
