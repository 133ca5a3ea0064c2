"""CPU tests of bench/cpu_worker.py: the shuffled schedule, the CPU shares, the table, and the
whole comparison on sim devices, where the CPU worker must get tasks and every result be right."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import cpu_worker as W  # noqa: E402


def test_parse_args_defaults_and_errors(capsys):
    args = W.parse_args([])
    assert args.n == [2048, 4096, 8192, 16384] and args.gpus == [1, 2] and args.runs == 3
    assert args.dtypes == ["d"] and args.specs == {1: "cuda:0", 2: "cuda:0,1"}
    assert args.modes == ["off", "on", "auto"]
    assert W.parse_args(["--modes", "auto,off"]).modes == ["off", "auto"]
    with pytest.raises(SystemExit):
        W.parse_args(["--n", "2048,x"])
    assert "--n: got '2048,x'" in capsys.readouterr().err
    for bad in ("maybe", "on,on", ""):
        with pytest.raises(SystemExit):
            W.parse_args(["--modes", bad])
        assert "--modes: got" in capsys.readouterr().err


def test_schedule_is_complete_shuffled_and_seeded():
    items = W.schedule([1, 2], 3, seed=0, dtype="d", n=4096)
    assert sorted(items) == sorted((g, m, k) for g in (1, 2) for m in ("off", "on", "auto") for k in range(3))
    assert items == W.schedule([1, 2], 3, seed=0, dtype="d", n=4096)
    assert items != W.schedule([1, 2], 3, seed=0, dtype="d", n=8192)
    assert items != sorted(items)
    assert {m for _, m, _ in W.schedule([1], 2, 0, "d", 64, ["off", "auto"])} == {"off", "auto"}


def test_cpu_share():
    prof = {"devices": [{"kind": "cuda", "share": 0.7, "flops_share": 0.8, "tasks": 7},
                        {"kind": "cpu", "share": 0.3, "flops_share": 0.2, "tasks": 3}]}
    assert W.cpu_share(prof) == (0.3, 0.2, 3)
    assert W.cpu_share({"devices": [{"kind": "cuda", "share": 1.0, "tasks": 4}]}) == (0.0, 0.0, 0)
    assert W.cpu_share(None) == (None, None, None)


def rec(n, g, cpu, seconds, warmup=False, share=0.25, ok=True):
    devs = [{"kind": "cuda", "share": 1 - share, "flops_share": 1 - share, "tasks": 3}]
    if cpu not in (False, "off"):
        devs.append({"kind": "cpu", "share": share, "flops_share": share, "tasks": 1})
    return {"dtype": "d", "n": n, "gpus": g, "cpu": cpu, "seconds": seconds, "warmup": warmup, "ok": ok,
            "profile": {"devices": devs}}


def test_summarize_and_table():
    records = [rec(1000, 1, "off", 5.0, warmup=True), rec(1000, 1, "off", 1.0), rec(1000, 1, "off", 1.2),
               rec(1000, 1, "on", 0.8, share=0.2), rec(1000, 1, "on", 0.9, share=0.4),
               rec(1000, 1, "auto", 0.5, share=0.5), rec(1000, 1, "auto", 2.0, share=0.3),
               rec(1000, 2, "off", 0.5), rec(1000, 2, "on", 0.6, ok=False)]
    rows = W.summarize(records, [1, 2])
    assert [(r["n"], r["gpus"]) for r in rows] == [(1000, 1), (1000, 2)]
    r = rows[0]
    assert r["gpus_only"]["best"] == 1.0 and r["with_cpu"]["best"] == 0.8 and r["speedup"] == pytest.approx(1.25)
    assert r["auto"]["best"] == 0.5 and r["auto_speedup"] == pytest.approx(2.0)
    assert r["with_cpu"]["cpu_task_share"] == pytest.approx(0.3) and r["with_cpu"]["cpu_tasks"] == [1, 1]
    assert r["auto"]["cpu_task_share"] == pytest.approx(0.4) and r["auto"]["median"] == pytest.approx(1.25)
    assert r["gpus_only"]["tflops"] == pytest.approx(2e9 / 1.0 / 1e12)
    assert r["ok"] and not rows[1]["ok"]
    assert "auto" not in rows[1] and rows[1]["auto_speedup"] is None
    table = W.format_table(rows).splitlines()
    assert table[0].startswith("| dtype | N | GPUs | TFLOPS GPUs only | TFLOPS + CPU (cpu=True) | TFLOPS + CPU auto |")
    assert all(x.count("|") == table[0].count("|") for x in table)
    assert "| 1.250x | 2.000x | 30.0% | 40.0% | 30.0% | 40.0% | ok |" in table[2]
    assert table[3] == "| d | 1000 | 2 | 0.00 | 0.00 | - | 0.833x | - | 25.0% | - | 25.0% | - | WRONG |"
    # Records of the two-mode version (cpu False / True) read as off / on.
    old = W.summarize([rec(64, 1, False, 1.0), rec(64, 1, True, 2.0)], [1])
    assert old[0]["speedup"] == pytest.approx(0.5) and "auto" not in old[0]


def test_comparison_on_sim(tmp_path):
    rc = W.main(["--backend", "sim", "--devices-spec", "sim:{g},rate=1e8", "--n", "64,128", "--gpus", "1,2",
                 "--runs", "1", "--tile", "16", "--out", str(tmp_path)])
    assert rc == 0
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2 and files[0].startswith("cpu-worker-sim-") and files[0].endswith(".json")
    data = json.load(open(tmp_path / files[0]))
    recs = data["records"]
    assert all(r["ok"] and r["in_place"] for r in recs)
    timed = [r for r in recs if not r["warmup"]]
    assert sorted((r["n"], r["gpus"], r["cpu"]) for r in timed) == sorted(
        (n, g, m) for n in (64, 128) for g in (1, 2) for m in ("off", "on", "auto"))
    assert all(any(r["warmup"] for r in recs if (r["n"], r["gpus"], r["cpu"]) == k)
               for k in {(r["n"], r["gpus"], r["cpu"]) for r in recs})   # a warm-up before each
    for r in recs:
        kinds = [d["kind"] for d in r["profile"]["devices"]]
        assert kinds == ["sim"] * r["gpus"] + (["cpu"] if r["cpu"] != "off" else [])
    for mode in ("on", "auto"):  # sims at 1e8 flop/s: the CPU worker takes part in both modes
        assert sum(d["tasks"] for r in recs if r["cpu"] == mode for d in r["profile"]["devices"]
                   if d["kind"] == "cpu") > 0
    assert len(data["summary"]) == 4 and data["modes"] == ["off", "on", "auto"]
    md = open(tmp_path / files[1]).read()
    assert md.startswith("# The CPU worker beside the GPUs (sim, ")
    assert "| d | 128 | 2 |" in md and "cpu:" in md and "WRONG" not in md and "+ CPU auto" in md
