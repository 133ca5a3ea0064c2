"""The sim A/B scripts of the tenth session (bench/scripts/steal_rule_ab_sim.py, start_order_ab_sim.py):
a tiny run of each prints every variant, and the engine's methods they patch are put back."""

from __future__ import annotations

import pytest

from blasx.runtime import worker as W


def test_steal_rule_ab_runs_both_rules_and_restores_the_engine(capsys):
    from bench.scripts import steal_rule_ab_sim
    assert "_steal" not in vars(W.StreamWorker)
    assert steal_rule_ab_sim.main(["--n", "8192", "--repeats", "1", "--cases", "trsm", "--speeds", "1/1.06"]) == 0
    out = capsys.readouterr().out
    assert "speeds=1/1.06 N=8192" in out and out.count("trsm   engine") == 1 and out.count("trsm   start-now") == 1
    assert "_steal" not in vars(W.StreamWorker)  # the engine's own (inherited) rule again


def test_start_order_ab_runs_every_variant_and_restores_the_engine(capsys):
    from bench import level3_sim
    from bench.scripts import start_order_ab_sim
    assign, plan = W.StreamWorker.assign, level3_sim.plan_case
    assert start_order_ab_sim.main(["--cases", "trmm", "--n", "8192", "--repeats", "1",
                                    "--variants", "base,rev,norot,split"]) == 0
    out = capsys.readouterr().out
    assert all(f"trmm   {v:6s}" in out for v in ("base", "rev", "norot", "split"))
    assert (W.StreamWorker.assign, level3_sim.plan_case) == (assign, plan)
    with pytest.raises(SystemExit, match="--variants: got 'x'"):
        start_order_ab_sim.main(["--variants", "x"])
