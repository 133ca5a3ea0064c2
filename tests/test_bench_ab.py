"""bench/ab.py: configurations parsed, the engine switched between them, every result checked,
and the timing-model A/B with its knobs and per-GPU speeds reaching the engine; tiny sizes."""

from __future__ import annotations

import json
import os

import pytest

from bench import ab, level3_contenders
from blasx.runtime.knobs import Knobs


def test_a_configuration_is_knobs_and_configure_settings():
    c = ab.parse_config("B", "commit_steps=64, late_c=0,cpu=auto,tile=256")
    assert c.knobs == Knobs(commit_steps=64, late_c=False)
    assert dict(c.settings) == {"cpu": "auto", "tile": 256}
    assert ab.parse_config("A", "").knobs == Knobs() and ab.parse_config("A", "").settings == ()
    assert dict(ab.parse_config("C", "cpu=False,trace=1").settings) == {"cpu": False, "trace": True}


@pytest.mark.parametrize("text, fragment", [
    ("nosuch=1", "--b: got 'nosuch=1'; NAME is a knob"),
    ("late_c", "--b: got 'late_c'; expected NAME=VALUE"),
    ("late_c=2", "--b: BLASX_KNOBS: got 'late_c=2'"),
    ("cpu=maybe", "--b: got 'cpu=maybe': cpu: got 'maybe'; allowed: 0, 1, True, False"),
])
def test_bad_configurations_name_what_is_allowed(text, fragment):
    with pytest.raises(ValueError) as e:
        ab.parse_config("B", text)
    assert fragment in str(e.value)


@pytest.mark.parametrize("argv, fragment", [
    (["--routine", "hemm"], "--routine: got hemm with --dtype d"),
    (["--dtype", "q"], "dtype: got 'q'"),
    (["--n", "0"], "--n: got '0'"),
    (["--model", "h200", "--a", "tile=256"], "configurations may set knobs only"),
    (["--model", "h200", "--speeds", "1/0.5"], "--speeds: got '1/0.5'; expected 2 factors >= 1"),
    (["--model", "h200", "--krate", "trsm:0"], "--krate: got 'trsm:0'"),
    (["--model", "h200", "--routine", "herk", "--dtype", "z"], "--dtype: got 'z'; --model runs double"),
])
def test_bad_options_exit_with_the_reason(capsys, argv, fragment):
    with pytest.raises(SystemExit) as e:
        ab.parse_args(argv)
    assert e.value.code == 2 and fragment in capsys.readouterr().err


def test_configurations_rotate_round_by_round():
    cs = ["A", "B", "C"]
    assert [(r, c) for r, c in ab.rounds(cs, 2)] == [
        (0, "A"), (0, "B"), (0, "C"), (1, "B"), (1, "C"), (1, "A"), (2, "C"), (2, "A"), (2, "B")]


def test_on_sims_every_configuration_runs_and_is_checked(tmp_path, monkeypatch, capsys):
    import blasx
    from blasx.runtime import engine as engine_mod
    engines = []
    original = engine_mod.Engine.__init__

    def init(self, config):
        engines.append(config.knobs)
        original(self, config)

    monkeypatch.setattr(engine_mod.Engine, "__init__", init)
    monkeypatch.setenv("BLASX_KNOBS", "late_c=1")
    seen = []
    run = level3_contenders.run_blasx
    monkeypatch.setattr(ab, "run_blasx", lambda bx, *a: seen.append(bx.session.engine().config.knobs) or run(bx, *a))
    status = ab.main(["--devices", "sim:2", "--routine", "gemm,trsm,syrk", "--n", "256", "--a", "commit_steps=0",
                      "--b", "commit_steps=8", "--config", "late_c=0,tile=64", "--runs", "2", "--quiet",
                      "--out", str(tmp_path), "--tag", "t"])
    assert status == 0
    (js,) = tmp_path.glob("ab-t-*.json")
    doc = json.loads(js.read_text())
    rows = doc["summary"]
    assert [(r["routine"], r["config"]) for r in rows] == [(rt, c) for rt in ("gemm", "trsm", "syrk") for c in "ABC"]
    assert all(r["runs"] == 2 and r["ok"] for r in rows)
    assert all(r["vs_a"] == 1.0 for r in rows if r["config"] == "A")
    assert all(r["of_gemm"] == 1.0 for r in rows if r["routine"] == "gemm")
    assert {k.commit_steps for k in seen} == {0, 8} and any(not k.late_c for k in seen)
    # rounds A B C, B C A, C A B: A <-> B switch on the running engine (commit_steps is read per
    # call); every switch to or from C (late_c, tile) starts an engine: 7 in all
    assert len(engines) == 7 and sum(not k.late_c for k in engines) == 3
    assert os.environ["BLASX_KNOBS"] == "late_c=1" and blasx.session._engine is None
    md = next(tmp_path.glob("ab-t-*.md")).read_text()
    assert "| 256 | trsm | B |" in md and "A = `commit_steps=0`" in md


def test_a_wrong_result_makes_the_status_1(monkeypatch, capsys):
    run = level3_contenders.run_blasx

    def wrong(bx, dtype, rt, n, A, B, C0, out, alpha, beta):
        run(bx, dtype, rt, n, A, B, C0, out, alpha, beta)
        out[0, 0] += 1.0

    monkeypatch.setattr(ab, "run_blasx", wrong)
    assert ab.main(["--devices", "sim:1", "--n", "128", "--runs", "1"]) == 1
    assert "WRONG (rel err" in capsys.readouterr().out


def test_the_timing_model_takes_knobs_and_speeds(monkeypatch, capsys):
    from blasx.runtime import engine as engine_mod
    seen = []
    original = engine_mod.Engine.__init__

    def init(self, config):
        seen.append((config.knobs.commit_steps, [d.model.slow for d in config.devices]))
        original(self, config)

    monkeypatch.setattr(engine_mod.Engine, "__init__", init)
    assert ab.main(["--model", "h200", "--routine", "gemm,trsm", "--n", "1024", "--tile", "256", "--runs", "1",
                    "--a", "", "--b", "commit_steps=8", "--speeds", "1/2", "--dilate", "1", "--issue", "0"]) == 0
    out = capsys.readouterr().out
    assert {k for k, _ in seen} == {0, 8} and all(slow == [1.0, 2.0] for _, slow in seen)
    assert "PREDICTION, NOT A MEASUREMENT" in out and "| 1024 | trsm | B |" in out


def test_model_plans_write_in_place_and_follow_trsm_inverse():
    assert ab.plan_model_case("trsm", 64, 16, (2, 2), Knobs())[1] == [0, 1, 1, 3]
    assert ab.plan_model_case("trsm", 64, 16, (2, 2), Knobs(trsm_inverse=False))[1] == [0, 1, 1]
    assert ab.plan_model_case("trmm", 64, 16, (2, 2), Knobs())[1] == [0, 1, 1]
    assert ab.plan_model_case("syrk", 64, 16, (2, 2), Knobs())[1] == [0, 2]


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit):
        ab.main(["--help"])
    out = capsys.readouterr().out
    assert "--a KNOBS" in out and "--model" in out and "--speeds" in out
