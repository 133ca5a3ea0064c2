"""bench/report.py: docs/performance.md from the committed result files, one table per benchmark."""

from __future__ import annotations

import os
import shutil

import bench
from bench import ab, report

RESULTS = os.path.join(os.path.dirname(bench.__file__), "results")
PAGE = os.path.join(os.path.dirname(os.path.dirname(bench.__file__)), "docs", "performance.md")


def test_the_committed_results_make_every_table():
    page = report.render(RESULTS)
    for title in ("GEMM on host arrays", "Level 3 beside GEMM", "Parallel efficiency of GEMM", "Offload threshold",
                  "CPU worker beside the GPUs", "Predicted scaling (sim)"):
        assert f"## {title}" in page
    assert "| dtype | mode | N | blasx | cuBLAS-XT (block) | blasx / XT |" in page
    assert "| float64 (d) | registered | 16384 | 87.3 | 53.6 (8192) | 1.63 |" in page  # blasx beside its peer
    assert "| float64 (d) | 32768 | trsm | 89.3 | 49.1 | 1.82 | 0.88 |" in page
    assert "python -m bench.level3 --n 16384,32768 --dtypes d" in page
    assert "**2x NVIDIA H200**, 2026-11-28 13:27" in page
    assert "PREDICTION, NOT A MEASUREMENT" in page
    tables = [x for x in page.splitlines() if x.startswith("|")]
    assert all(x.endswith("|") for x in tables)


def test_the_committed_page_is_the_script_output():
    with open(PAGE, encoding="utf-8") as f:
        assert f.read() == report.render(RESULTS), "run python -m bench.report and commit docs/performance.md"


def test_dates_read_as_minutes():
    assert report._stamp_date("20261127-161558") == "2026-11-27 16:15"
    assert report._stamp_date("2026-11-27T16:15:58") == "2026-11-27 16:15"


def test_only_the_latest_run_of_a_command_per_machine_is_shown(tmp_path):
    for name in ("level3-h200x1-20261123-130310.json", "gemm-h200x4-20261122-065327.json"):
        shutil.copy(os.path.join(RESULTS, name), tmp_path / name)
    old = (tmp_path / "level3-h200x1-20261123-130310.json").read_text()
    (tmp_path / "level3-h200x1-20261122-000000.json").write_text(
        old.replace('"date": "2026-11-23', '"date": "2026-11-22').replace("--out /root/out", "--out /elsewhere"))
    page = report.render(str(tmp_path))
    assert "level3-h200x1-20261123-130310.json" in page and "20261122-000000" not in page
    assert "## GEMM on host arrays" in page and "## Parallel efficiency" not in page


def test_a_knob_ab_result_gets_its_table(tmp_path):
    assert ab.main(["--devices", "sim:1", "--n", "128", "--runs", "1", "--a", "", "--b", "late_c=0",
                    "--quiet", "--out", str(tmp_path)]) == 0
    page = report.render(str(tmp_path))
    assert "## Knob A/Bs" in page and "| 128 | gemm | B |" in page and "B = `late_c=0`" in page


def test_main_writes_the_page(tmp_path, capsys):
    out = tmp_path / "docs" / "performance.md"
    assert report.main(["--results", RESULTS, "--out", str(out)]) == 0
    assert out.read_text().startswith("# Performance")
