"""bench.scaling_sim end to end on a small problem (no calibration): the JSON and its markdown report."""

from __future__ import annotations

import json

from bench import scaling_sim


def test_a_small_prediction_writes_its_report(tmp_path):
    doc = scaling_sim.main(["--n", "1024", "--gpus", "1,2", "--dtypes", "d", "--models", "fitted",
                            "--scenarios", "independent", "--no-calibration", "--out", str(tmp_path), "--quiet"])
    js, md = sorted(tmp_path.glob("scaling-sim-*.json")), sorted(tmp_path.glob("scaling-sim-*.md"))
    assert len(js) == len(md) == 1
    saved = json.loads(js[0].read_text())
    assert {(p["n"], p["gpus"]) for p in saved["points"]} == {(1024, 1), (1024, 2)}
    assert saved["limits"] == list(scaling_sim.LIMITS) and doc["points"]
    text = md[0].read_text()
    assert "PREDICTION, NOT A MEASUREMENT" in text and "## Summary" in text and "| 1024 | 2 |" in text
