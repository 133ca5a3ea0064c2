"""The tile size, the one tuning knob (the paper's Section V-B).

Per call: the configured tile if any; else the backend's default, shrunk
while the call would give the devices too few tasks to share, and while a
device's tile cache could not hold the tiles its in-flight tasks need.
"""

from __future__ import annotations

import numpy as np

DEFAULT_TILE = {"cuda": 4096, "sim": 256, "cpu": 2048}
MIN_TILE = {"cuda": 512, "sim": 16, "cpu": 256}


def tiles_needed(streams: int) -> int:
    """Tiles a device's cache must hold to always make progress: a C buffer and
    a late-C buffer per in-flight task (2 tasks per stream), A and B of the step
    being issued, and slack for fragmentation."""
    return 5 * streams + 4


def choose_tile(eng, m: int, n: int, k: int, dtype) -> int:
    itemsize = np.dtype(dtype).itemsize
    streamed = [d for d in eng.devices if d.streamed]
    if eng.config.tile is not None:
        tile = eng.config.tile
        _check_fits(streamed, tile, itemsize)
        return tile
    kind = streamed[0].kind if streamed else "cpu"
    tile, floor = DEFAULT_TILE[kind], MIN_TILE[kind]
    tile = min(tile, max(floor, _pow2_at_least(max(m, n, k))))
    workers = max(1, len(eng.devices))
    while tile > floor and -(-m // tile) * -(-n // tile) < 2 * workers:
        tile //= 2
    while tile > floor and not _fits(streamed, tile, itemsize):
        tile //= 2
    _check_fits(streamed, tile, itemsize)
    return tile


def _pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


def _fits(devices, tile: int, itemsize: int) -> bool:
    need = tile * tile * itemsize * tiles_needed(max((d.nstreams for d in devices), default=1))
    return all(d.cache_capacity() >= need for d in devices)


def _check_fits(devices, tile: int, itemsize: int) -> None:
    for d in devices:
        need = tile * tile * itemsize * tiles_needed(d.nstreams)
        if d.cache_capacity() < need:
            raise ValueError(
                f"tile: {tile} needs a tile cache of at least {need} bytes on {d.name} "
                f"({tiles_needed(d.nstreams)} tiles of {tile}x{tile}x{itemsize} bytes), but it has "
                f"{d.cache_capacity()}; lower the tile size or raise cache_bytes")
