"""Micro-benchmarks of the L1 tile cache and the MESI-X directory
(run: pytest bench/micro/test_cache_bench.py).

The ALRU holds LINES lines, a few thousand tiles as a GPU with tens of GiB
of tile cache and small tiles has. ``get`` is a hit moved to the MRU end,
``insert`` + ``remove`` the steady-state churn of a full cache, ``victim``
the search for the LRU line with no readers (it scans past busy lines, so
it is timed with none, a quarter and half of the oldest lines busy).
Directory operations run under ``directory.lock`` as the workers run them.
"""

from __future__ import annotations

import itertools
import random

import pytest

from blasx.runtime.cache import ALRU, Line
from blasx.runtime.coherence import Directory

LINES = 4096
DEVICES = 4
TILE = 1024
NBYTES = TILE * TILE * 8
TOKEN = (-7, 64 * TILE, 64 * TILE, TILE)


def _key(i: int):
    return (TOKEN, i // 64, i % 64)


def _line(i: int, device: int = 0) -> Line:
    return Line(_key(i), device, i * NBYTES, NBYTES, TILE, TILE)


def _alru(n: int = LINES) -> ALRU:
    a = ALRU(0)
    for i in range(n):
        a.insert(_line(i))
    return a


def test_alru_get_hit(benchmark):
    a = _alru()
    keys = [_key(i) for i in range(LINES)]
    random.Random(1).shuffle(keys)
    it = itertools.cycle(keys)
    benchmark(lambda: a.get(next(it)))
    assert len(a) == LINES


def test_alru_get_miss(benchmark):
    a = _alru()
    missing = _key(LINES + 1)
    assert benchmark(a.get, missing) is None


def test_alru_peek(benchmark):
    a = _alru()
    k = _key(LINES // 2)
    assert benchmark(a.peek, k) is not None


def test_alru_insert_and_evict(benchmark):
    """A full cache taking a new tile: find the victim, remove it, insert the new line."""
    a = _alru()
    counter = itertools.count(LINES)

    def churn():
        v = a.victim()
        a.remove(v)
        a.insert(_line(next(counter)))

    benchmark(churn)
    assert len(a) == LINES


@pytest.mark.parametrize("busy", [0.0, 0.25, 0.5])
def test_alru_victim(benchmark, busy):
    """``victim`` with the oldest ``busy`` fraction of lines still read by in-flight steps."""
    a = _alru()
    n_busy = int(LINES * busy)
    for i, line in enumerate(a):
        if i < n_busy:
            line.readers = 1
    v = benchmark(a.victim)
    assert v.key == _key(n_busy)
    benchmark.extra_info["lines_scanned"] = n_busy + 1


def _directory() -> Directory:
    """LINES tiles spread over DEVICES devices, a quarter of them on two devices (S state)."""
    d = Directory(DEVICES)
    for i in range(LINES):
        d.add(_line(i, i % DEVICES))
        if i % 4 == 0:
            d.add(_line(i, (i + 1) % DEVICES))
    return d


def test_directory_add_drop(benchmark):
    """A line filled and later evicted on device 3 (I -> E -> I), each under the lock."""
    d = _directory()
    line = _line(LINES + 5, 3)

    def add_drop():
        with d.lock:
            d.add(line)
        with d.lock:
            d.drop(line)

    benchmark(add_drop)
    assert d.state(line.key) == "I"


def test_directory_add_drop_shared(benchmark):
    """A second copy of a held tile (E -> S -> E), under the lock."""
    d = _directory()
    line = _line(1, 3)  # tile 1 lives on device 1

    def add_drop():
        with d.lock:
            d.add(line)
        with d.lock:
            d.drop(line)

    benchmark(add_drop)
    assert d.state(line.key) == "E"


@pytest.mark.parametrize("case", ["hit", "in-flight", "miss"])
def test_directory_peer_source(benchmark, case):
    """An L1 miss on device 0 asking for a peer copy, under the lock."""
    d = _directory()
    filling = object()
    if case == "hit":
        key = _key(2)  # on device 2, complete
    elif case == "in-flight":
        key = _key(3)
        d.holders(key)[3].ready = object()  # its fill is recorded but not finished
    else:
        key = _key(LINES + 9)

    def can_read(dev: int) -> bool:
        return True

    def ask():
        with d.lock:
            return d.peer_source(key, 0, can_read, filling)

    got = benchmark(ask)
    assert (got is None) == (case == "miss")


def test_directory_where(benchmark):
    """Eq. 3b's case of one tile (the lock-free read the priorities use)."""
    d = _directory()
    keys = [_key(i) for i in range(0, LINES, 7)]
    it = itertools.cycle(keys)
    benchmark(lambda: d.where(next(it), 0))
