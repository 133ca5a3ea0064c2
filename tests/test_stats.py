"""Tests of blasx.runtime.stats: interval union, Fig. 8 breakdown, counters, and the views."""

import json
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blasx.runtime.stats import (
    COUNTER_FIELDS, HOST_TID, CallStats, DeviceInfo, OpRecord, human_bytes, measure, union,
)

DEVICES = (DeviceInfo(0, "cuda:0 NVIDIA H200", "cuda"), DeviceInfo(1, "sim:1 (slow=4)", "sim"))


def make_stats(records=(), start=0.0, finish=10.0, devices=DEVICES):
    stats = CallStats(devices)
    stats.start(start)
    stats.finish(finish)
    for rec in records:
        stats.add_record(rec)
    return stats


# --------------------------------------------------------------------------- interval union

def test_union_merges_overlapping_touching_and_drops_empty():
    ivs = [(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0), (7.0, 7.0), (8.0, 9.0), (8.5, 8.75)]
    assert union(ivs) == [(0.0, 4.0), (5.0, 6.0), (8.0, 9.0)]
    assert measure(ivs) == 6.0
    assert union([]) == [] and measure([]) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30))
def test_union_measure_matches_unit_grid(pairs):
    ivs = [(float(min(a, b)), float(max(a, b))) for a, b in pairs]
    covered = {x for s, e in ivs for x in range(int(s), int(e))}
    assert measure(ivs) == len(covered)
    merged = union(ivs)
    assert all(e1 < s2 for (_, e1), (s2, _) in zip(merged, merged[1:]))


# --------------------------------------------------------------------------- breakdown

def test_breakdown_exact_values():
    recs = [
        # device 0: two overlapping kernels on two streams -> busy [1, 4]
        OpRecord(0, "kernel", 1.0, 3.0, stream=0, flops=4e12, task=0, name="gemm"),
        OpRecord(0, "kernel", 2.0, 4.0, stream=1, flops=4e12, task=1, name="gemm"),
        # copy partly hidden: [3.5, 4] under the kernels, [4, 5] exposed
        OpRecord(0, "h2d", 3.5, 5.0, stream=2, nbytes=1000, name="A(0,0)"),
        # two overlapping copies, fully exposed: union [6, 7.5]
        OpRecord(0, "d2h", 6.0, 7.0, stream=0, nbytes=500),
        OpRecord(0, "p2p", 6.5, 7.5, stream=1, nbytes=500),
        # host work counts as busy; it starts before the window: clipped to [0, 0.5]
        OpRecord(0, "host", -2.0, 0.5, name="stage"),
        # copy fully under host+kernel: hidden entirely
        OpRecord(0, "h2d", 1.5, 2.5, stream=3, nbytes=8),
        # device 1: kernel running past the window [9, 12] -> [9, 10]; copy wholly outside
        OpRecord(1, "kernel", 9.0, 12.0, flops=1.0),
        OpRecord(1, "h2d", 11.0, 13.0, nbytes=64),
        OpRecord(1, "h2d", -5.0, -1.0, nbytes=64),
    ]
    stats = make_stats(recs)
    stats.count(0, "tasks", 3)
    stats.count(1, "tasks", 1)
    stats.count(0, "flops", 8e12)
    b0, b1 = stats.profile().breakdown()

    assert (b0.device, b0.name, b0.tasks, b0.flops) == (0, "cuda:0 NVIDIA H200", 3, 8e12)
    assert b0.busy == 0.5 + 3.0            # host [0, .5] + kernels [1, 4]
    assert b0.comm == 1.0 + 1.5            # [4, 5] + [6, 7.5]
    assert b0.overlapped_comm == 0.5 + 1.0  # [3.5, 4] + [1.5, 2.5]
    assert b0.idle == 10.0 - 3.5 - 2.5
    assert b0.counters["tasks"] == 3

    assert (b1.busy, b1.comm, b1.idle, b1.overlapped_comm) == (1.0, 0.0, 9.0, 0.0)
    for b in (b0, b1):
        assert b.busy + b.comm + b.idle == pytest.approx(10.0)


def test_lead_and_tail_are_the_idle_time_before_the_first_and_after_the_last_operation():
    recs = [OpRecord(0, "h2d", 1.5, 2.5), OpRecord(0, "kernel", 2.0, 7.0), OpRecord(0, "d2h", 6.5, 8.0),
            OpRecord(1, "kernel", -1.0, 3.0)]  # clipped to the call's window
    assert [(b.lead, b.tail) for b in make_stats(recs).profile().breakdown()] == [(1.5, 2.0), (0.0, 7.0)]
    assert [(b.lead, b.tail) for b in make_stats().profile().breakdown()] == [(10.0, 0.0), (10.0, 0.0)]  # no operation


def test_breakdown_without_records_and_with_zero_wall():
    b0, b1 = make_stats().profile().breakdown()
    assert (b0.busy, b0.comm, b0.idle, b0.overlapped_comm) == (0.0, 0.0, 10.0, 0.0)
    assert b1.idle == 10.0

    zero = make_stats([OpRecord(0, "kernel", 0.0, 1.0)], start=5.0, finish=5.0)
    zero.count(0, "flops", 1e12)
    prof = zero.profile()
    assert prof.wall == 0.0
    assert all((b.busy, b.comm, b.idle) == (0.0, 0.0, 0.0) for b in prof.breakdown())
    s = prof.summary()
    assert s["tflops"] == 0.0 and s["l1_hit_rate"] == 0.0
    assert all(d["share"] == 0.0 and d["tflops"] == 0.0 for d in s["devices"])
    json.dumps(s)
    assert "total" in prof.report()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["kernel", "host", "h2d", "d2h", "p2p"]),
                          st.integers(-5, 25), st.integers(0, 10), st.integers(0, 3)),
                max_size=25))
def test_breakdown_parts_sum_to_wall(specs):
    recs = [OpRecord(0, k, float(s), float(s + n), stream=q) for k, s, n, q in specs]
    (b, _) = make_stats(recs, start=0.0, finish=20.0).profile().breakdown()
    assert b.busy + b.comm + b.idle == pytest.approx(20.0)
    copies = [(max(r.start, 0.0), min(r.end, 20.0)) for r in recs if r.kind in ("h2d", "d2h", "p2p")]
    assert b.comm + b.overlapped_comm == pytest.approx(measure(copies))
    assert min(b.busy, b.comm, b.idle, b.overlapped_comm) >= 0.0


# --------------------------------------------------------------------------- collector

def test_counters_are_exact_across_threads():
    stats = make_stats()
    n_threads, n_counts = 8, 1000
    barrier = threading.Barrier(n_threads)

    def work(i):
        barrier.wait()
        for _ in range(n_counts):
            stats.count(i % 2, "tasks")
            stats.count(i % 2, "bytes_h2d", 3)
            stats.add_record(OpRecord(i % 2, "kernel", 1.0, 2.0))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    prof = stats.profile()
    assert prof.totals()["tasks"] == n_threads * n_counts
    assert prof.totals()["bytes_h2d"] == 3 * n_threads * n_counts
    assert prof.counters[0]["tasks"] == prof.counters[1]["tasks"] == n_threads * n_counts // 2
    assert len(prof.records) == n_threads * n_counts


def test_count_validation_and_numpy_scalars():
    stats = make_stats()
    with pytest.raises(ValueError, match="unknown counter 'hits'"):
        stats.count(0, "hits")
    with pytest.raises(IndexError):
        stats.count(2, "tasks")
    with pytest.raises(ValueError, match="kind"):
        stats.add_record(OpRecord(0, "memset", 0.0, 1.0))
    with pytest.raises(ValueError, match="ends before"):
        stats.add_record(OpRecord(0, "kernel", 2.0, 1.0))
    np = pytest.importorskip("numpy")
    stats.count(0, "bytes_p2p", np.int64(7))
    stats.count(0, "flops", np.float32(0.5))
    t = stats.profile().totals()
    assert type(t["bytes_p2p"]) is int and t["bytes_p2p"] == 7 and t["flops"] == 0.5
    assert set(t) == set(COUNTER_FIELDS)


def test_keep_records_false():
    quiet = CallStats(DEVICES, keep_records=False)
    quiet.add_record(OpRecord(0, "kernel", 0.0, 1.0))
    quiet.count(1, "steals", 2)
    prof = quiet.profile()
    assert prof.records == () and prof.counters[1]["steals"] == 2


def test_context_manager_window():
    with CallStats(DEVICES) as stats:
        stats.count(0, "tasks")
    prof = stats.profile()
    assert prof.wall >= 0.0 and prof.finish >= prof.start
    assert stats.profile().finish == prof.finish   # finished windows stay fixed


# --------------------------------------------------------------------------- views

def example_profile():
    stats = make_stats([
        OpRecord(0, "kernel", 1.0, 3.0, stream=0, flops=2e12, task=4, name="gemm"),
        OpRecord(0, "h2d", 0.5, 1.5, stream=1, nbytes=1 << 20, task=4, name="A(1,2)"),
        OpRecord(0, "host", 0.0, 0.25, name="stage"),
        OpRecord(1, "p2p", 2.0, 2.5, stream=2, nbytes=4096),
        OpRecord(1, "kernel", 20.0, 21.0),   # outside the window: dropped by every view
    ], start=0.0, finish=4.0)
    for dev, field, n in [(0, "tasks", 3), (1, "tasks", 1), (0, "flops", 2e12), (1, "flops", 2e12),
                          (0, "l1_hits", 6), (1, "l2_hits", 2), (1, "misses", 2),
                          (0, "bytes_h2d", 1 << 20), (0, "bytes_d2h", 1000),
                          (1, "bytes_p2p", 4096), (1, "steals", 1)]:
        stats.count(dev, field, n)
    return stats.profile()


def test_summary_is_json_and_consistent():
    s = json.loads(json.dumps(example_profile().summary()))
    assert s["wall"] == 4.0
    assert s["tflops"] == pytest.approx(4e12 / 4.0 / 1e12)
    assert s["tasks"] == 4
    assert (s["l1_hit_rate"], s["l2_hit_rate"], s["miss_rate"]) == (0.6, 0.2, 0.2)
    assert s["host_bytes"] == (1 << 20) + 1000 and s["p2p_bytes"] == 4096
    d0, d1 = s["devices"]
    assert (d0["name"], d0["kind"], d0["share"], d1["share"]) == ("cuda:0 NVIDIA H200", "cuda", 0.75, 0.25)
    assert (d0["busy"], d0["comm"], d0["idle"], d0["overlapped_comm"]) == (2.25, 0.5, 1.25, 0.5)
    assert d1["counters"]["steals"] == 1


def test_report_lists_every_device_and_totals():
    text = example_profile().report()
    for dev in DEVICES:
        assert dev.name in text
    lines = text.splitlines()
    assert lines[-1].startswith("total")
    assert "75.0%" in text and "25.0%" in text
    assert "1.05 MB" in text and "4.10 kB" in text
    assert human_bytes(0) == "0 B" and human_bytes(2.5e12) == "2.50 TB" and human_bytes(5e15) == "5000.00 TB"


def test_chrome_trace_structure(tmp_path):
    prof = example_profile()
    path = tmp_path / "trace.json"
    trace = prof.to_chrome_trace(path)
    assert json.loads(path.read_text()) == trace
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    meta = [e for e in events if e["ph"] == "M"]
    assert len(complete) == 4                        # the record outside the window is dropped
    gemm = next(e for e in complete if e["name"] == "gemm")
    assert (gemm["pid"], gemm["tid"], gemm["cat"]) == (0, 0, "kernel")
    assert (gemm["ts"], gemm["dur"]) == (1e6, 2e6)  # µs from start
    assert gemm["args"] == {"bytes": 0, "flops": 2e12, "task": 4}
    host = next(e for e in complete if e["cat"] == "host")
    assert (host["tid"], host["ts"], host["dur"]) == (HOST_TID, 0.0, 0.25e6)

    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert procs == {0: "cuda:0 NVIDIA H200", 1: "sim:1 (slow=4)"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert threads == {(0, 0): "stream 0", (0, 1): "stream 1", (0, HOST_TID): "host",
                       (1, 2): "stream 2"}
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in complete)


def test_plot_without_matplotlib_raises_clear_error(monkeypatch, tmp_path):
    for mod in ("matplotlib", "matplotlib.figure", "matplotlib.patches"):
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(ImportError, match=r"blasx\[plot\]"):
        example_profile().plot(tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    for prof, name in [(example_profile(), "p.png"), (make_stats().profile(), "empty.png")]:
        prof.plot(tmp_path / name)
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
