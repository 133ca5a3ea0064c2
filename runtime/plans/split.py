"""Split-k's choice: how many partial sums per C tile a GEMM gets (``plan_gemm(split=S)``)."""

from __future__ import annotations

from typing import Sequence

from ..tiling import n_tiles

#: Fewest k tiles one partial sum covers: a shorter one costs its reduction more than it saves.
MIN_PART_TILES = 2
#: The partial sums take at most this share of the smallest device's tile cache (1 / 8).
PARTIAL_SHARE = 8


def choose_split(m: int, n: int, k: int, tile: int, *, streams: Sequence[int], caches: Sequence[int],
                 itemsize: int) -> int:
    """Partial sums per C tile (1: no split) of an m x n x k GEMM with ``tile``, on stream devices
    with ``streams[d]`` streams and ``caches[d]`` cache bytes, partials of ``itemsize`` bytes.

    C's tiles times S should reach the streams of every device (the C tiles alone are fewer), each
    partial covering at least MIN_PART_TILES k tiles, and the S m x n partials at most 1 /
    PARTIAL_SHARE of the smallest cache. No stream device, C tiles enough or k short: 1, so such
    plans are unchanged."""
    slots = sum(streams)
    tiles = n_tiles(m, tile) * n_tiles(n, tile)
    tk = n_tiles(k, tile)
    if not slots or tiles >= slots or tk < 2 * MIN_PART_TILES:
        return 1
    by_memory = min(caches) // PARTIAL_SHARE // max(1, m * n * itemsize)
    return max(1, min(-(-slots // tiles), tk // MIN_PART_TILES, by_memory))
