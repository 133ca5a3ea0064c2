"""Micro-benchmarks of the reservation station (run: pytest bench/micro/test_station_bench.py).

A station holds 8 tasks of 8 k-steps each (16 input tiles per task) from a
2 x 4 grid of C tiles of one GEMM call. A 4-device MESI-X directory holds
some of their tiles: device 0 (the picker) has half of the A row panels in
its L1, device 1 has half of the B column panels, so Eq. 3 priorities differ
between tasks. ``pop_best`` scores every task of the station, each score
being 16 directory look-ups, as the worker's ``_score`` does; ``steal``
takes the newest ready task. Setup (refilling the station) is not timed.
"""

from __future__ import annotations

import pytest

from blasx.runtime.cache import Line
from blasx.runtime.coherence import Directory
from blasx.runtime.station import EQ3_SCORE, WHERE_L1, WHERE_L2, ReservationStation, most_loaded, priority
from blasx.runtime.plans import plan_gemm

TILE = 1024
TASKS = plan_gemm(2 * TILE, 4 * TILE, 8 * TILE, TILE, 0, 0)  # 8 tasks x 8 k-steps
assert len(TASKS) == 8 and all(len(t.steps) == 8 for t in TASKS)
TOKENS = ((-1, 2 * TILE, 8 * TILE, TILE), (-2, 8 * TILE, 4 * TILE, TILE), (-3, 2 * TILE, 4 * TILE, TILE))
ME = 0


def _key(ref):
    return (TOKENS[ref.slot], ref.bi, ref.bj)


def _directory() -> Directory:
    d = Directory(4)
    off = 0
    for t in TASKS:
        for ref in t.input_tiles():
            if ref.slot == 0 and ref.bi == 0:  # A row panel 0 on device 0 (L1 for the picker)
                holder = 0
            elif ref.slot == 1 and ref.bj % 2 == 1:  # odd B column panels on device 1 (L2)
                holder = 1
            else:
                continue
            if holder in d.holders(_key(ref)):
                continue
            d.add(Line(_key(ref), holder, off, TILE * TILE * 8, TILE, TILE))
            off += TILE * TILE * 8
    return d


DIRECTORY = _directory()


def score(task) -> int:
    """The worker's Eq. 3 score (``StreamWorker._score``), with fixed tokens."""
    holders = DIRECTORY.holders
    total = 0
    for ref in task.input_tiles():
        h = holders((TOKENS[ref.slot], ref.bi, ref.bj))
        if h:
            total += EQ3_SCORE[WHERE_L1 if ME in h else WHERE_L2]
    return total


def _ready(task) -> bool:
    return True


def _full_station() -> ReservationStation:
    st = ReservationStation(ME, 8)
    for t in TASKS:
        st.push(t)
    return st


def test_scores_differ():
    scores = [score(t) for t in TASKS]
    assert len(set(scores)) > 1, scores
    assert scores == [priority(t, lambda k: DIRECTORY.where(k, ME), _key) for t in TASKS]


def test_score_one_task(benchmark):
    assert benchmark(score, TASKS[0]) == score(TASKS[0])


def test_pop_best_from_a_full_station(benchmark):
    """One pick among 8 tasks: 8 scores of 16 tiles each, under the station lock."""
    box = {}

    def setup():
        box["st"] = _full_station()

    def pick():
        return box["st"].pop_best(score, _ready)

    best = benchmark.pedantic(pick, setup=setup, rounds=3000, iterations=1, warmup_rounds=50)
    assert score(best) == max(score(t) for t in TASKS)


def test_pop_best_until_empty(benchmark):
    """A worker starting every task of its station in priority order (8 picks: 8 + 7 + ... + 1 scores)."""
    box = {}

    def setup():
        box["st"] = _full_station()

    def drain():
        st, n = box["st"], 0
        while st.pop_best(score, _ready) is not None:
            n += 1
        return n

    assert benchmark.pedantic(drain, setup=setup, rounds=1000, iterations=1, warmup_rounds=20) == 8


def test_pop_best_with_module_priority(benchmark):
    """The same pick through ``station.priority`` and ``Directory.where`` (the reference formula)."""
    box = {}

    def setup():
        box["st"] = _full_station()

    def where(k):
        return DIRECTORY.where(k, ME)

    def pick():
        return box["st"].pop_best(lambda t: priority(t, where, _key), _ready)

    benchmark.pedantic(pick, setup=setup, rounds=3000, iterations=1, warmup_rounds=50)


@pytest.mark.parametrize("ready", ["all", "first-only"])
def test_steal(benchmark, ready):
    """Steal the newest ready task; with "first-only", the thief scans past 7 tasks not ready yet."""
    box = {}
    first = TASKS[0]
    pred = _ready if ready == "all" else (lambda t: t is first)

    def setup():
        box["st"] = _full_station()

    def steal():
        return box["st"].steal(pred)

    got = benchmark.pedantic(steal, setup=setup, rounds=3000, iterations=1, warmup_rounds=50)
    assert got is (TASKS[-1] if ready == "all" else first)


def test_most_loaded_of_4_stations(benchmark):
    """Picking the steal victim: the load (flops) of every other station."""
    stations = [ReservationStation(i, 8) for i in range(4)]
    for i, st in enumerate(stations):
        for t in TASKS[: 2 * i + 1]:
            st.push(t)
    assert benchmark(most_loaded, stations, ME) is stations[3]
