"""bench/level3_sim.py: case parsing, the operands of in-place cases, and a tiny run end to end."""

from __future__ import annotations

import json
import os

import pytest

from bench import level3_sim
from blasx.runtime.plans import plan_trmm
from blasx.runtime.tiling import OP_N


def test_parse_cases_puts_gemm_first_and_names_what_is_allowed():
    assert level3_sim.parse_cases("trmm:wave, trsm,trmm:wave") == ["gemm", "trmm:wave", "trsm"]
    assert level3_sim.parse_cases("syrk,gemm") == ["syrk", "gemm"]
    for bad in ("trmm:zigzag", "herk", "trmm:", "", "syrk@nosuch=1", "syrk@commit_steps=x", "nope@late_c=0"):
        with pytest.raises(SystemExit, match=r"--cases: got .*allowed .*trmm-oop.*trmm:ORDER.*@KNOBS"):
            level3_sim.parse_cases(bad)


def test_a_case_may_carry_its_own_knobs():
    assert level3_sim.parse_cases("syrk@commit_steps=64+late_c=0,trmm:wave@commit_steps=8") == [
        "gemm", "syrk@commit_steps=64+late_c=0", "trmm:wave@commit_steps=8"]
    assert level3_sim.base_of("trmm:wave@commit_steps=8") == "trmm:wave"
    assert level3_sim.knobs_of("syrk@commit_steps=64+late_c=0") == "commit_steps=64,late_c=0"
    assert level3_sim.routine_of("trsm-blocked@late_c=0") == "trsm"
    assert level3_sim.plan_case("syrk@late_c=0", 64, 16, (2, 2))[1] == [0, 2]


def test_knobs_and_speeds_reach_the_engine_and_the_tables(tmp_path, monkeypatch):
    """``CASE@KNOBS`` runs that case's engine with those knobs (and puts BLASX_KNOBS back);
    ``--speeds`` makes the second sim slower."""
    from blasx.runtime import engine as engine_mod
    seen = []
    original = engine_mod.Engine.__init__

    def init(self, config):
        seen.append((config.knobs.commit_steps, [d.model.slow for d in config.devices]))
        original(self, config)

    monkeypatch.setattr(engine_mod.Engine, "__init__", init)
    monkeypatch.setenv("BLASX_KNOBS", "late_c=1")
    doc = level3_sim.main(["--n", "512", "--tile", "256", "--cases", "gemm,gemm@commit_steps=8", "--repeats", "1",
                           "--dilate", "1", "--issue", "0", "--speeds", "1/2", "--quiet", "--out", str(tmp_path)])
    # (a run the host disturbed is run again: scaling_sim.retried)
    assert {k for k, _ in seen} == {0, 8} and seen[0][0] == 0 and all(slow == [1.0, 2.0] for _, slow in seen)
    assert [p["case"] for p in doc["points"]] == ["gemm", "gemm@commit_steps=8"]
    assert doc["speeds"] == "1/2" and "speeds=1/2" in doc["spec_example"]
    assert "per-GPU slowdowns: 1/2" in next(tmp_path.glob("*.md")).read_text()
    assert os.environ["BLASX_KNOBS"] == "late_c=1"


def test_in_place_cases_write_into_b():
    tasks, slots = level3_sim.plan_case("trmm:levels", 64, 16, (2, 2))
    assert slots == [0, 1, 1]  # slot 2 (C) is B's operand: one array, one token
    want = plan_trmm(64, 64, 16, 0, 0, OP_N, 0, in_place=True, order="levels")
    assert [(t.c, t.steps, t.deps, t.gates) for t in tasks] == [(t.c, t.steps, t.deps, t.gates) for t in want]
    assert level3_sim.plan_case("trsm", 64, 16, (2, 2))[1] == [0, 1, 1, 3]  # + the inverses' scratch
    assert level3_sim.plan_case("trsm-blocked", 64, 16, (2, 2))[1] == [0, 1, 1]
    assert level3_sim.plan_case("trmm-oop", 64, 16, (2, 2))[1] == [0, 1, 2]
    assert level3_sim.plan_case("syrk", 64, 16, (2, 2))[1] == [0, 2]
    # the default order is the planner's: blocks of 2 x 2 for 8 x 8 tiles
    default = [(t.c.bi, t.c.bj) for t in level3_sim.plan_case("trmm", 128, 16, (2, 2))[0]]
    assert default[:5] == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2)]


def test_tiny_run_writes_the_tables(tmp_path):
    doc = level3_sim.main(["--n", "1024", "--tile", "256", "--cases", "trmm,trmm:levels,trsm,trmm-oop,syrk",
                           "--repeats", "1", "--dilate", "1", "--issue", "0", "--quiet", "--out", str(tmp_path),
                           "--tag", "t"])
    assert [p["case"] for p in doc["points"]] == ["gemm", "trmm", "trmm:levels", "trsm", "trmm-oop", "syrk"]
    assert doc["points"][0]["ratio"] == 1.0 and all(p["tflops"] > 0 for p in doc["points"])
    assert doc["krate"] == level3_sim.DEFAULT_KRATE and "krate=trmm:0.9/trsm:0.39" in doc["spec_example"]
    (md,) = tmp_path.glob("level3-sim-t-*.md")
    (js,) = tmp_path.glob("level3-sim-t-*.json")
    assert "PREDICTION, NOT A MEASUREMENT" in md.read_text() and "| 1024 | trmm:levels |" in md.read_text()
    assert json.loads(js.read_text())["command"].startswith("python -m bench.level3_sim --n 1024")


@pytest.mark.parametrize("args,needle", [
    (["--krate", "trsm:0"], r"--krate: got 'trsm:0'"),
    (["--tag", "a/b"], r"--tag: got 'a/b'"),
    (["--n", "0"], r"--n: got '0'"),
    (["--dilate", "0.5"], r"--dilate: got 0.5"),
    (["--speeds", "1/0.5"], r"--speeds: got '1/0.5'; expected 2 factors >= 1 .* e.g. 1/1.06"),
    (["--speeds", "1/1/1"], r"--speeds: got '1/1/1'"),
    (["--speeds", "x"], r"--speeds: got 'x'"),
])
def test_bad_options_name_the_option_and_value(args, needle):
    with pytest.raises(SystemExit, match=needle):
        level3_sim.main(args + ["--quiet"])
