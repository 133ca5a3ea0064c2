"""bench/first_call.py on sims: fresh processes, every call checked, the table and the report's reading of it."""

from __future__ import annotations

import json

import pytest

from bench import first_call, report


def test_first_call_on_sims_writes_checked_results(tmp_path, capsys):
    assert first_call.main(["--n", "96", "--dtypes", "d,c", "--devices", "sim:2", "--samples", "2",
                            "--warm-runs", "2", "--out", str(tmp_path), "--tag", "t"]) == 0
    (path,) = tmp_path.glob("first-call-t-*.json")
    doc = json.loads(path.read_text())
    assert [(r["dtype"], r["n"]) for r in doc["results"]] == [("d", 96), ("c", 96)]
    for r in doc["results"]:
        assert r["ok"] and len(r["samples"]) == 2 and all(len(s["warm"]) == 2 for s in r["samples"])
        assert r["ratio_median"] > 0 and r["max_error"] <= first_call.tolerance(r["dtype"], 96)
    assert doc["devices"] == "sim:0, sim:1"
    table = report.read_first_call(str(path))
    assert table.header[0] == "dtype" and [row[:2] for row in table.rows] == [["float64 (d)", 96],
                                                                             ["complex64 (c)", 96]]
    assert "| d | 96 |" in capsys.readouterr().out


def test_a_failing_sample_is_reported_not_hidden(monkeypatch):
    monkeypatch.setattr(first_call, "run_sample", lambda args, n, prefix, seed: {"failure": "exit 1: boom"})
    assert first_call.main(["--n", "64", "--dtypes", "s", "--devices", "sim:1", "--samples", "1"]) == 1


@pytest.mark.parametrize("argv, word", [(["--dtypes", "q"], "--dtypes"), (["--n", "x"], "--n"),
                                        (["--samples", "0"], "--samples")])
def test_bad_arguments_name_the_option(argv, word, capsys):
    with pytest.raises(SystemExit):
        first_call.parse(argv)
    assert word in capsys.readouterr().err
