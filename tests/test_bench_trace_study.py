"""bench/scripts/level3_knobs_ab.py's saved profiles and bench/scripts/trace_study.py, on sims."""

import numpy as np

import blasx


def test_saved_profile_is_read_back_with_station_moves(tmp_path, capsys, rand, monkeypatch):
    from bench.scripts import level3_knobs_ab as ab
    from bench.scripts import trace_study
    from blasx.runtime.station import ReservationStation

    for name in ("push", "pop_best", "steal"):  # log_stations wraps them: put them back afterwards
        monkeypatch.setattr(ReservationStation, name, getattr(ReservationStation, name))
    monkeypatch.setattr(ab, "STATION_LOG", [])
    ab.log_stations()
    blasx.configure(devices="sim:2", tile=16)
    a = np.asfortranarray(np.triu(rand((96, 96))) + 96 * np.eye(96))
    b = rand((96, 64), seed=1)
    blasx.dtrsm(1.0, a, b)
    path = str(tmp_path / "trsm.json.gz")
    ab.save_profile(blasx.last_profile(), path)
    doc, recs = trace_study.load(path)
    tids = {r["task"] for r in recs if r["kind"] == "kernel"}
    assert tids and sum(c["tasks"] for c in doc["counters"].values()) == len(tids)
    # every task entered a station and was assigned to a stream from one
    pushed = {tid for _, _, op, tid in doc["stations"] if op == "push"}
    assigned = {tid for _, _, op, tid in doc["stations"] if op == "pop_best"}
    assert tids <= pushed and tids <= assigned
    assert trace_study.main([path, "--bin-ms", "1", "--tasks"]) == 0
    out = capsys.readouterr().out
    assert "device 0:" in out and "device 1:" in out and "pop_best@" in out
