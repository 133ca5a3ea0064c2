"""bench.rnn on sims with torch on the CPU as the peer: options, cases, a checked run and its outputs."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from bench import rnn as R  # noqa: E402


def test_options_and_cases():
    a = R.parse_args(["--modes", "lstm", "--hidden", "8,16", "--batch", "2", "--dtypes", "float32,float16",
                      "--math", "ieee,tf32", "--phases", "training"])
    cs = R.cases(a)
    assert len(cs) == 2 * (2 + 1)  # float32 in both math modes, float16 in ieee
    assert {c["math"] for c in cs if c["dtype"] == "float16"} == {"ieee"}
    deep = R.cases(R.parse_args(["--deepbench", "--dtypes", "float32", "--math", "ieee", "--phases", "inference"]))
    assert len(deep) == len(R.DEEPBENCH) and all(c["steps"] <= 375 for c in deep)
    assert all(c["host"] for c in R.cases(R.parse_args(["--host"]))) and not any(c["host"] for c in cs)


def test_checked_run_on_sims(tmp_path):
    rc = R.main(["--devices", "sim:2", "--peer", "cpu", "--modes", "lstm,gru", "--hidden", "8", "--batch", "3",
                 "--steps", "4", "--dtypes", "float32", "--math", "ieee", "--runs", "1", "--layers", "2",
                 "--min-time", "0", "--out", str(tmp_path), "--tag", "t"])
    assert rc == 0
    js = list(tmp_path.glob("rnn-t-sim-*.json"))  # the machine part: sim here, h200x2 on two H200s
    md = list(tmp_path.glob("rnn-t-*.md"))
    assert len(js) == 1 and len(md) == 1
    rep = json.loads(js[0].read_text())
    assert rep["command"].endswith("--tag t") and rep["date"] and rep["env"]
    assert len(rep["results"]) == 4 and all(r["ok"] for r in rep["results"])
    train = [r for r in rep["results"] if r["phase"] == "training"]
    assert train and all(r["max_err"] < r["tol"] for r in train)
    assert "| lstm | 8 | 3 | 4 |" in md[0].read_text()
    assert all(r["placement"] == "diagonal x2" for r in rep["results"]) and "diagonal x2 |" in md[0].read_text()


def test_paired_timing_alternates_and_runs_short_calls_longer():
    """bench.rnn._paired: one untimed call each, then peer and blasx alternately; at least ``runs`` each, more
    while either side's timed total is under min_time, at most MAX_RUNS; the last results come back."""
    order = []

    def side(name):
        def fn():
            order.append(name)
            return len(order)
        return fn
    tp, rp, tm, rm = R._paired(side("p"), side("m"), 3, lambda: None, 0.0)
    assert order == ["p", "m"] * 4 and len(tp) == len(tm) == 3 and (rp, rm) == (7, 8)
    order.clear()
    tp, _, tm, _ = R._paired(side("p"), side("m"), 1, lambda: None, 10.0)  # never reached: the cap
    assert len(tp) == len(tm) == R.MAX_RUNS and order[:4] == ["p", "m", "p", "m"]


def test_step_cost_split_into_fixed_and_per_step():
    """bench.rnn.split_cost: calls of T and 2T steps give the fixed cost a call and the cost a step exactly."""
    split_cost = R.split_cost
    fixed, per = split_cost(1.5e-3 + 100 * 4e-6, 1.5e-3 + 200 * 4e-6, 100)
    assert abs(fixed - 1.5e-3) < 1e-12 and abs(per - 4e-6) < 1e-15


def test_step_costs_name_each_way_measured():
    """The overhead line: every way a record holds (older records: Python and the layer graph), in order."""
    from bench.rnn import step_costs
    old = dict(eager_us_per_step=42.4, eager_us_fixed=1995, graph_us_per_step=6.9, graph_us_fixed=93)
    assert step_costs(old) == ("42.4 us a step and 1995 us a call launched from Python; 6.9 us a step and 93 us a "
                               "call with the layer's step loop replayed from its CUDA graph")
    new = dict(old, replay_us_per_step=7.0, replay_us_fixed=37)
    assert step_costs(new).endswith("; 7.0 us a step and 37 us a call with the whole call replayed from one CUDA graph")
