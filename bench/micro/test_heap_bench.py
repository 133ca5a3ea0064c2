"""Micro-benchmarks of the device heap (run: pytest bench/micro/test_heap_bench.py).

Each round replays one seeded trace of tile loads into a fresh 1 GiB arena
(4096-byte alignment): a load that does not fit evicts resident tiles until
it does, as the tile cache does.  Timings cover heap calls plus the small
eviction bookkeeping; divide by LOADS for a per-load cost.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from blasx.heap import OffsetHeap

GiB = 1 << 30
ALIGN = 4096
LOADS = 20000  # enough to reach steady state: the small-tile arena holds ~3600 tiles

# Tile byte sizes: square fp64/fp32 tiles, plus the ragged edge tiles of a
# matrix whose size is not a multiple of the tile size.
BIG_TILES = [1024 * 1024 * 8, 1024 * 1024 * 4, 512 * 512 * 8, 1024 * 300 * 8]
SMALL_TILES = [128 * 128 * 8, 256 * 256 * 8, 192 * 192 * 8, 256 * 77 * 8]


def _trace(sizes: list[int], seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(sizes) for _ in range(LOADS)]


def _replay_lru(trace: list[int]) -> OffsetHeap:
    heap = OffsetHeap(GiB, ALIGN)
    lru: deque[int] = deque()
    for nbytes in trace:
        off = heap.alloc(nbytes)
        while off is None:
            heap.free(lru.popleft())
            off = heap.alloc(nbytes)
        lru.append(off)
    return heap


def _replay_random(trace: list[int], seed: int) -> OffsetHeap:
    # Random eviction scatters holes across the arena: the harder case for
    # first fit, with thousands of blocks when tiles are small.
    rng = random.Random(seed)
    heap = OffsetHeap(GiB, ALIGN)
    resident: list[int] = []
    for nbytes in trace:
        off = heap.alloc(nbytes)
        while off is None:
            i = rng.randrange(len(resident))
            resident[i], resident[-1] = resident[-1], resident[i]
            heap.free(resident.pop())
            off = heap.alloc(nbytes)
        resident.append(off)
    return heap


def test_alloc_free_pair(benchmark):
    heap = OffsetHeap(GiB, ALIGN)
    for _ in range(64):  # a few residents so blocks have neighbours
        heap.alloc(8 << 20)

    def pair():
        heap.free(heap.alloc(4 << 20))

    benchmark(pair)
    heap.check()


@pytest.mark.parametrize("tiles", ["big", "small"])
def test_churn_lru(benchmark, tiles):
    trace = _trace(BIG_TILES if tiles == "big" else SMALL_TILES, seed=1)
    heap = benchmark.pedantic(_replay_lru, args=(trace,), rounds=5, iterations=1)
    heap.check()
    benchmark.extra_info["blocks_at_end"] = len(heap.blocks())


@pytest.mark.parametrize("tiles", ["big", "small"])
def test_churn_random_eviction(benchmark, tiles):
    trace = _trace(BIG_TILES if tiles == "big" else SMALL_TILES, seed=2)
    heap = benchmark.pedantic(_replay_random, args=(trace, 3), rounds=5, iterations=1)
    heap.check()
    benchmark.extra_info["blocks_at_end"] = len(heap.blocks())
