"""bench.tallskinny on the CPU: its parts and a run on sims (no link bound, no CuPy peer)."""

from __future__ import annotations

import glob
import json

import numpy as np
import pytest

import blasx
from bench import report
from bench import tallskinny as T

SMALL = ["--devices", "sim:2", "--cols", "48", "--check", "12", "--runs", "1", "--quiet"]


def _doc(folder):
    (path,) = glob.glob(str(folder / "tallskinny-*.json"))
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("order", ["C", "F"])
def test_x_and_the_sampled_reference(order):
    x = T.make_x(3000, 40, "s", order, 0)
    assert x.shape == (3000, 40) and x.dtype == np.float32 and x.flags[f"{order}_CONTIGUOUS"]
    ia, ib = T.sample_block(40, 8, 1)
    assert len(ia) == len(ib) == 8 and ia[0] == ib[0] == 0 and ia[-1] == ib[-1] == 39
    ref = T.reference_block(x, ia, ib, rows=700)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(ref, x64[:, ia].T @ x64[:, ib], rtol=1e-12, atol=1e-9)


def test_options_are_checked():
    for bad in (["--dtypes", "z"], ["--blasx-kw", "split"], ["--modes", "pinned"], ["--cols", "0"]):
        with pytest.raises(SystemExit):
            T.parse_args(bad)
    args = T.parse_args(["--blasx-kw", "split=4", "--check", "5000"])
    assert args.kw == {"split": 4} and args.check == 1024 and args.n == [1000000]


def test_a_run_on_sims_writes_its_files(tmp_path):
    assert T.main(SMALL + ["--n", "2000,5000", "--order", "F", "--out", str(tmp_path)]) == 0
    doc = _doc(tmp_path)
    assert [(r["dtype"], r["n"], r["mode"]) for r in doc["rows"]] == [
        (d, n, m) for d in "ds" for n in (2000, 5000) for m in ("registered", "pageable")]
    assert all(r["status"] == "ok" and r["who"] == "blasx" and r["bound"] is None for r in doc["rows"])
    assert all(r["flops"] == 2.0 * 48 * 48 * r["n"] for r in doc["rows"])
    assert all(r["h2d_bytes"] >= r["x_gib"] * 2**30 and r["tasks"] >= 1 for r in doc["rows"])
    page = report.render(str(tmp_path))
    assert "## Tall-skinny GEMM from host memory" in page and "| float32 (s) | 5000 | pageable |" in page


def test_a_wrong_result_fails(tmp_path, monkeypatch):
    right = blasx.gemm
    monkeypatch.setattr(blasx, "gemm", lambda *a, **k: right(*a, **k) * 1.001)
    assert T.main(SMALL + ["--n", "1000", "--dtypes", "d", "--modes", "pageable", "--out", str(tmp_path)]) == 1
    (row,) = _doc(tmp_path)["rows"]
    assert row["status"] == "FAIL" and row["rel_err"] > 1e-4
