"""The tile size, the one tuning knob (the paper's Section V-B).

Per call: the configured tile; else the perf-db's (:mod:`blasx.perfdb`, read once per engine and
again after this process stores into it), shrunk while a device's tile cache could not hold it;
else the backend's default, shrunk while the devices would get too few tasks or the tiles their
in-flight tasks need would not fit.
"""

from __future__ import annotations

import os
import threading
import weakref

import numpy as np

from . import perfdb
from .runtime import dtypes
from .runtime.plans.split import MIN_PART_TILES
from .runtime.tiling import n_tiles

DEFAULT_TILE = {"cuda": 4096, "sim": 256, "cpu": 2048}
MIN_TILE = {"cuda": 512, "sim": 16, "cpu": 256}
#: kind -> (granule, least, per_stream) of ``Knobs.small_n_tiles``: tiles in multiples of the granule
#: (cuBLAS runs those at its full rate), never below ``least`` (a smaller tile step costs more host
#: time to issue than it computes), for ``per_stream`` tasks per stream of every device.
SMALL_N = {"cuda": (512, 2048, 2)}
#: (kind, class) -> (tile, per_stream): the tile of a tensor-core call ("reduced": h, b, i8; "tf32": float32
#: in TF32 math) where every device still gets ``per_stream`` tasks per stream. On a 4096 tile its kernel is
#: short against its copies and issue; twice the side halves the traffic per flop. TF32's kernels are
#: slower than the 2-byte types', so fewer tasks per stream still hide the fill and drain.
WIDE_TILE = {("cuda", "reduced"): (8192, 4), ("cuda", "tf32"): (8192, 2)}


def tiles_needed(streams: int) -> int:
    """Tiles a device's cache must hold to always make progress: a C and a late-C buffer per in-flight
    task (2 tasks per stream), A and B of the step being issued, and slack for fragmentation."""
    return 5 * streams + 4


def choose_tile(eng, m: int, n: int, k: int, dtype, routine: str = "gemm", math: str = "ieee") -> int:
    """The tile of an m x n x k call of ``dtype`` (``math`` the float32 math it runs in) on ``eng``."""
    row = dtypes.gemm_of(dtype)  # a reduced type's C tiles accumulate wider
    itemsize = np.dtype(dtype).itemsize if row is None else max(row.itemsize, row.compute.itemsize)
    streamed = [d for d in eng.devices if d.streamed]
    if eng.config.tile is not None:
        _check_fits(streamed, eng.config.tile, itemsize)
        return eng.config.tile
    if not streamed:
        # The CPU alone: its BLAS already uses every core, so tiling only adds copies and
        # hand-offs; one task per call keeps blasx at numpy's speed.
        return max(1, m, n, k)
    kind = streamed[0].kind
    floor = MIN_TILE[kind]
    tile = db_tile(eng, m, n, k, dtype, routine)
    if tile is not None and tile >= floor:  # (a smaller one, hand-edited or of another version: not used)
        while tile > floor and not _fits(streamed, tile, itemsize):
            tile //= 2
        if _fits(streamed, tile, itemsize):
            return tile
    workers = max(1, sum(1 for d in eng.devices if not getattr(d, "auto", False)))  # auto CPU: rarely any
    knobs = eng.config.knobs
    tile = default_tile(m, n, k, kind, workers=workers, streams=max(d.nstreams for d in streamed),
                        split=knobs.split_k, small_n=knobs.small_n_tiles, wide=wide_class(dtype, math))
    while tile > 1 and not _fits(streamed, tile, itemsize):  # (below the floor too: a cache too small for it)
        tile //= 2
    _check_fits(streamed, tile, itemsize)
    return tile


def wide_class(dtype, math: str = "ieee") -> str | None:
    """The WIDE_TILE class of a call of ``dtype`` in ``math``: "reduced", "tf32" or None."""
    row = dtypes.gemm_of(dtype)
    if row is not None and row.reduced:
        return "reduced"
    return "tf32" if math == "tf32" and np.dtype(dtype) == np.float32 else None


def default_tile(m: int, n: int, k: int, kind: str, *, workers: int, streams: int, split: bool,
                 small_n: bool, wide: str | None = None) -> int:
    """The backend's default tile for an m x n x k call on ``workers`` devices of ``streams`` streams,
    before the cache-fit check: for a tensor-core call (``wide``, its :func:`wide_class`) WIDE_TILE's
    tile where its C tiles give every device per_stream x streams tasks; else DEFAULT_TILE, halved
    while the devices would get fewer than 2 tasks each; with ``small_n`` (on a kind in SMALL_N),
    then :func:`small_n_tile` for SMALL_N's per_stream x streams tasks per device."""
    if (kind, wide) in WIDE_TILE:
        big, per_stream = WIDE_TILE[kind, wide]
        if _tasks(m, n, k, big, False) >= per_stream * streams * workers:  # C tiles alone
            return big
    floor = MIN_TILE[kind]
    tile = min(DEFAULT_TILE[kind], max(floor, 1 << max(0, max(m, n, k) - 1).bit_length()))  # a power of 2
    while tile > floor and _tasks(m, n, k, tile, split) < 2 * workers:
        tile //= 2
    if small_n and kind in SMALL_N:
        granule, least, per_stream = SMALL_N[kind]
        tile = small_n_tile(m, n, k, tile, per_stream * streams * workers, granule, least, split)
    return tile


def small_n_tile(m: int, n: int, k: int, tile: int, target: int, granule: int, least: int,
                 split: bool = False) -> int:
    """``tile``, or, where it gives fewer than ``target`` tasks, the largest multiple of ``granule`` from
    ``least`` up that gives them (else ``least``), evened out to the smallest multiple of ``granule``
    with the same C grid (no thin last row or column of tiles): small calls fill every stream."""
    if tile <= least or _tasks(m, n, k, tile, split) >= target:
        return tile
    t = tile - tile % granule
    while t > least and _tasks(m, n, k, t, split) < target:
        t -= granule
    t = max(t, least)
    even = max(-(-m // n_tiles(m, t)), -(-n // n_tiles(n, t)))
    return min(t, -(-even // granule) * granule)


def _tasks(m: int, n: int, k: int, tile: int, split: bool) -> int:
    """Tasks a GEMM gets with ``tile``: its C tiles, times the partial sums a long k allows when
    split-k is on (a tall-skinny product keeps its large tile and splits k instead)."""
    tiles = -(-m // tile) * -(-n // tile)
    return tiles * max(1, -(-k // tile) // MIN_PART_TILES) if split else tiles


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


# ---------------------------------------------------------------- perf-db look-up

_db_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _db_lock
    _db_lock = threading.Lock()  # (a parent thread may have held it at the fork)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

# engine -> ((db generation, db location), {(dtype, routine, shape): tile}) of its device model and count
_db_tables: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def db_tile(eng, m: int, n: int, k: int, dtype, routine: str = "gemm") -> int | None:
    """The perf-db's tile for this call on ``eng`` (the routine's own entry, else gemm's), or None.
    Never raises: a missing or unreadable db, or anything odd in it, means no entry."""
    try:
        if perfdb.disabled() or not (table := _table(eng)):
            return None
        dt, shape = perfdb.dtype_char(dtype), perfdb.shape_class(m, n, k)
        return table.get((dt, routine, shape)) or table.get((dt, "gemm", shape))
    except Exception:  # noqa: BLE001 - the perf-db is advice: never break a BLAS call over it
        return None


def _table(eng) -> dict:
    state = (perfdb.generation(), perfdb.location_state())
    with _db_lock:
        entry = _db_tables.get(eng)
        if entry is None or entry[0] != state:
            rows = perfdb.PerfDb().table(*perfdb.device_key(eng.devices))
            entry = _db_tables[eng] = (state, {(key.dtype, key.routine, key.shape): t for key, t in rows.items()})
        return entry[1]
