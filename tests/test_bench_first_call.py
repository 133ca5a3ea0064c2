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
    assert table.header[:2] == ["contender", "dtype"] and [row[:3] for row in table.rows] == [
        ["blasx", "float64 (d)", 96], ["blasx", "complex64 (c)", 96]]
    assert "| blasx | d | 96 |" in capsys.readouterr().out


def test_the_cupy_peer_runs_in_processes_of_its_own(monkeypatch, capsys):
    """Each contender's samples are fresh processes of that contender; one that cannot run (no CuPy here)
    is a failure in the table, and the run's exit status, never a missing row."""
    seen = []

    def sample(args, n, prefix, seed, contender):
        seen.append(contender)
        if contender == "cupy":
            return {"failure": "exit 1: No module named 'cupy'"}
        return {"first": 2.0, "warm": [1.0, 0.5], "errors": [0.0] * 3, "devices": "sim:0"}
    monkeypatch.setattr(first_call, "run_sample", sample)
    assert first_call.main(["--n", "64", "--dtypes", "d", "--devices", "sim:1", "--samples", "2",
                            "--contenders", "blasx,cupy"]) == 1
    out = capsys.readouterr().out
    assert seen == ["blasx", "blasx", "cupy", "cupy"]
    assert "| blasx | d | 64 | 2.000 | 0.500 | 4.00 |" in out and "| cupy | d | 64 | - |" in out
    assert "- cupy d 64: exit 1: No module named 'cupy'" in out


def test_a_failing_sample_is_reported_not_hidden(monkeypatch):
    monkeypatch.setattr(first_call, "run_sample", lambda args, n, prefix, seed, who: {"failure": "exit 1: boom"})
    assert first_call.main(["--n", "64", "--dtypes", "s", "--devices", "sim:1", "--samples", "1"]) == 1


@pytest.mark.parametrize("argv, word", [(["--dtypes", "q"], "--dtypes"), (["--n", "x"], "--n"),
                                        (["--samples", "0"], "--samples"), (["--contenders", "xt"], "--contenders")])
def test_bad_arguments_name_the_option(argv, word, capsys):
    with pytest.raises(SystemExit):
        first_call.parse(argv)
    assert word in capsys.readouterr().err
