"""bench.gemm's reduced-precision parts that run without a GPU (bench/gemm_lp.py, the options)."""

from __future__ import annotations

import numpy as np
import pytest

from bench import gemm as G
from bench import gemm_contenders as GC
from bench import gemm_lp as L
from bench import gemm_problem as GP


def test_options_take_the_reduced_types_and_tf32():
    args = G.parse_args(["--dtypes", "h,b,i8,s", "--math", "tf32", "--n", "64", "--beta", "0"])
    assert args.dtypes == ["h", "b", "i8", "s"] and args.math == "tf32"
    assert [L.reduced(d, "tf32") for d in "sd"] == [True, False] and L.reduced("h", "ieee")
    assert GP.tolerance("i8", 4096) == 0 and GP.typed_scalar(1.5, "i8") == 2
    assert 1e-3 < GP.tolerance("h", 4096) < 5e-3 and GP.tolerance("d", 4096) == 1e-10


@pytest.mark.parametrize("dtype", ["h", "i8"])
def test_problem_and_row_sampled_reference(dtype):
    args = G.parse_args(["--dtypes", dtype, "--n", "48", "--beta", "2", "--alpha", "1"])
    p = GP.make_problem(args, dtype, 48, 40, 36, [0])
    out = np.dtype(np.float16 if dtype == "h" else np.int32)
    assert p.c_out.dtype == out and p.c_init.dtype == out and list(p.ref_rows) == list(range(48))
    big = GP.make_problem(G.parse_args(["--dtypes", dtype, "--n", "48", "--check-rows", "5"]), dtype, 600, 8, 8, [0])
    assert len(big.ref_rows) == 5 and big.ref_rows[0] == 0 and big.ref_rows[-1] == 599  # spread over C
    one = GP.make_problem(G.parse_args(["--dtypes", dtype, "--n", "48", "--check-rows", "1"]), dtype, 600, 8, 8, [0])
    assert list(one.ref_rows) == [0]  # (a sample of one: the first row)
    ref, info = GC.compute_reference(p)
    assert info["where"] == "cpu" and ref.shape == (48, 40)
    want = p.alpha * (p.a.astype(np.float64) @ p.b.astype(np.float64)) + p.beta * p.c_init.astype(np.float64)
    np.testing.assert_allclose(ref, want, rtol=1e-12)
    p.poison()
    assert np.array_equal(p.c_out, p.c_init)  # beta != 0: the pristine C


def test_link_bound_takes_the_slower_direction_and_the_shared_cap():
    rates = {"h2d": [50e9, 50e9], "d2h": [40e9, 40e9], "h2d_together": 80e9}
    b = L.link_bound(rates, 8 << 30, 2 << 30)
    assert b["seconds"] == pytest.approx((8 << 30) / 80e9) and b["h2d_bytes_per_s"] == 80e9
    assert L.link_bound({}, 1, 1) is None
    line = L.format_bound({"dtype": "h", "n": 32768, "link_bound": b}, 2 * b["seconds"])
    assert "host-link bound" in line and "2.00x" in line


def test_busy_and_duplex_bounds():
    """Beside a GEMM the loads run at h2d_busy; copying both ways at once, in + out share the duplex sum."""
    rates = {"h2d": [50e9, 50e9], "d2h": [50e9, 50e9], "h2d_busy": [34e9, 34e9],
             "duplex_busy": [(28e9, 22e9), (28e9, 22e9)]}
    b = L.link_bound(rates, 4 << 30, 2 << 30)
    assert b["busy_seconds"] == pytest.approx((4 << 30) / 68e9)
    assert b["duplex_bytes_per_s"] == 100e9
    assert b["duplex_seconds"] == pytest.approx((6 << 30) / 100e9)
    line = L.format_bound({"dtype": "h", "n": 32768, "link_bound": b}, b["duplex_seconds"])
    assert "both ways at once" in line and "1.00x" in line
    rates["duplex_busy"] = [None, (28e9, 22e9)]  # a GPU that gave no figure: no duplex bound
    assert "duplex_seconds" not in L.link_bound(rates, 4 << 30, 2 << 30)
