"""``blasx.tune``: measure the candidate tile sizes and store the winners in the perf-db.

The tile is BLASX's one tuning parameter (Section V-B): large tiles saturate the GPU and the link,
small ones give more parallelism. Per candidate: an engine with that tile, a warm-up and ``runs``
timed ``blasx.gemm`` calls on random host arrays, a check of a few rows against numpy. Tuning
reconfigures the process-wide engine (run it while no other thread uses blasx) and restores the
previous settings at the end, also when it fails.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from . import perfdb, precision, session
from .runtime import dtypes as blas_types
from .tile import MIN_TILE

#: Candidate tiles per backend (capped by the problem's largest dimension).
DEFAULT_TILES = {"cuda": (2048, 3072, 4096, 6144, 8192), "sim": (32, 64, 128, 256), "cpu": (256, 512, 1024, 2048)}
#: Problem sizes N (M = N = K) tuned when ``sizes`` is None.
DEFAULT_SIZES = {"cuda": (8192, 16384), "sim": (256, 512), "cpu": (1024, 2048)}


def default_tiles(kind: str, m: int, n: int, k: int) -> list[int]:
    """The backend's candidates, each capped at max(M, N, K) (larger tiles cut nothing more)."""
    if kind not in DEFAULT_TILES:
        raise ValueError(f"kind: got {kind!r}, need one of {sorted(DEFAULT_TILES)}")
    cap = max(m, n, k, 1)
    return sorted({min(t, cap) for t in DEFAULT_TILES[kind]})


def tune(sizes=None, dtypes=("d", "s"), tiles=None, runs: int = 2, devices: str | None = None, db=None,
         check_rows: int = 64, seed: int = 0, progress: Callable[[str], None] | None = None) -> list[dict]:
    """Measure GEMM for every candidate tile and store each winner in the perf-db.

    sizes: N, or a list of N (M = N = K) or (M, N, K) triples, e.g. ``[4096, (8192, 8192, 16384)]``;
        None: the backend's ``DEFAULT_SIZES``. Sizes of one shape class share one entry (the last wins).
    dtypes: BLAS prefixes or numpy dtypes, e.g. ``("d", "s")`` or ``"d,s"``.
    tiles: candidate tile sizes; None: the backend's ``DEFAULT_TILES``, capped by the problem size.
    runs: timed calls per candidate (after one warm-up); the fastest counts.
    devices: device spec as in ``blasx.configure`` (None: the current setting).
    db: a :class:`blasx.perfdb.PerfDb`, a file path, or None for the perf-db the runtime reads.
    check_rows: rows of C compared against numpy after each candidate (0: no check).
    progress: called with one line of text per measured candidate.

    Returns one dict per (dtype, size): key (text), device, ndev, dtype, routine, m, n, k, shape (the
    shape class), tiles (the candidates), tflops ({tile: best TFLOPS}), seconds ({tile: [timed runs]}),
    errors ({tile: relative error of the checked rows}), bad (tiles that failed the check: never
    winners), skipped ({tile: why}), tile (the winner, or None) and stored (True once in the db).
    """
    problems = _check_sizes(sizes)
    dtype_chars = _check_dtypes(dtypes)
    candidates = _check_tiles(tiles)
    if not isinstance(runs, int) or isinstance(runs, bool) or runs < 1:
        raise ValueError(f"runs: got {runs!r}, need an int >= 1")
    if not isinstance(check_rows, int) or isinstance(check_rows, bool) or check_rows < 0:
        raise ValueError(f"check_rows: got {check_rows!r}, need an int >= 0")
    if isinstance(db, perfdb.PerfDb):
        pdb = db
    elif db is None or isinstance(db, (str, os.PathLike)):
        pdb = perfdb.PerfDb(db)
    else:
        raise ValueError(f"db: got {db!r}, need a blasx.perfdb.PerfDb, a file path, or None for the user perf-db")
    why = perfdb.file_problem(pdb.path, foreign=True)  # (found before measuring, not when a winner is stored)
    if why is not None:  # (--clear removes a damaged default perf-db, never another file)
        default = Path(pdb.path).resolve() == perfdb.default_path().resolve()
        raise ValueError(f"db: {str(pdb.path)!r} {why}" + ("; `blasx tune --clear` removes it" if default and not
                                                            why.startswith("is a folder") else ""))
    if progress is not None and not callable(progress):
        raise TypeError(f"progress: got {type(progress).__name__}, need a function taking a line of text, or None")
    say = progress or (lambda line: None)

    prev = session.settings()
    base = dataclasses.replace(prev, tile=None, trace=False,
                               devices=devices if devices is not None else prev.devices)
    rows: list[dict] = []
    try:
        session.configure(**dataclasses.asdict(base))  # validates the device spec
        devs = session.engine().devices
        kind = next((d.kind for d in devs if d.streamed), "cpu")
        if candidates is not None and min(candidates) < MIN_TILE[kind]:
            raise ValueError(f"tiles: got {tiles!r}; {kind} devices take tiles of at least {MIN_TILE[kind]}")
        if problems is None:
            problems = [(s, s, s) for s in DEFAULT_SIZES[kind]]
        precision.check_host_memory(problems, [blas_types.GEMM_BY_PREFIX[dc] for dc in dtype_chars])
        rng = np.random.default_rng(seed)
        for dc in dtype_chars:
            for m, n, k in problems:
                row = _tune_one(base, devs, kind, dc, m, n, k, candidates, runs, check_rows, rng, say)
                if row["tile"] is not None:
                    try:
                        pdb.store(perfdb.PerfKey.parse(row["key"]), row["tile"],
                                  {t: row["tflops"][t] for t in row["tflops"] if t not in row["bad"]})
                        row["stored"] = True
                    except perfdb.PerfDbError as e:
                        warnings.warn(f"blasx.tune: {e}", RuntimeWarning, stacklevel=2)
                rows.append(row)
    finally:
        session.configure(**dataclasses.asdict(prev))
    return rows


def _tune_one(base, devs, kind, dc, m, n, k, candidates, runs, check_rows, rng, say) -> dict:
    from .level3 import gemm

    blas_type = blas_types.GEMM_BY_PREFIX[dc]
    dtype = blas_type.dtype
    key = perfdb.key_for(devs, dtype, m, n, k)
    cands = candidates if candidates is not None else default_tiles(kind, m, n, k)
    a, b = precision.random_operand(rng, (m, k), dtype), precision.random_operand(rng, (k, n), dtype)
    c = np.empty((m, n), blas_type.out, order="F")
    poison = np.iinfo(c.dtype).min if c.dtype.kind in "iu" else np.nan
    flops = 2 * blas_type.flop_factor * m * n * k
    timing = any(getattr(d, "timing", False) for d in devs)  # (timing-mode sims compute no data: nothing to check)
    rows = 0 if timing else min(check_rows, m)
    out = {"key": key.text, "device": key.device, "ndev": key.ndev, "dtype": dc, "routine": key.routine,
           "m": m, "n": n, "k": k, "shape": key.shape, "tiles": list(cands), "tflops": {}, "seconds": {},
           "errors": {}, "skipped": {}, "bad": [], "tile": None, "stored": False}
    for t in cands:
        session.configure(**dataclasses.asdict(dataclasses.replace(base, tile=t)))
        try:
            gemm(1, a, b, c=c, overwrite_c=True)  # warm-up: engine start, caches, handles
        except ValueError as e:  # the tile does not fit a device's tile cache
            out["skipped"][t] = str(e)
            say(f"{dc}gemm {m}x{n}x{k} tile {t}: skipped ({e})")
            continue
        times = []
        for _ in range(runs):
            c[...] = poison  # every element must be written again
            t0 = time.perf_counter()
            gemm(1, a, b, c=c, overwrite_c=True)
            times.append(time.perf_counter() - t0)
        best = min(times)
        out["seconds"][t] = times
        out["tflops"][t] = flops / best / 1e12
        note = ", not checked (timing-mode sims compute no data)" if timing else ""
        if rows:
            err, tol = precision.check_rows(c[:rows], a[:rows], b, blas_type, session.settings().math)
            out["errors"][t] = err
            if not (np.isfinite(err) and err <= tol and (c.dtype.kind in "iu" or np.isfinite(c).all())):
                out["bad"].append(t)
                note = f", WRONG (relative error {err:.2e} > {tol:g})"
                warnings.warn(f"blasx.tune: {dc}gemm {m}x{n}x{k} with tile {t} gave a relative error of "
                              f"{err:.2e} on {rows} rows (tolerance {tol:g}); not a candidate",
                              RuntimeWarning, stacklevel=3)
        say(f"{dc}gemm {m}x{n}x{k} tile {t}: {best:.4f} s, {out['tflops'][t]:.4g} TFLOPS{note}")
    good = {t: v for t, v in out["tflops"].items() if t not in out["bad"]}
    if good:
        out["tile"] = max(good, key=lambda t: (good[t], -t))  # ties: the smaller tile (more parallelism)
    return out


def _positive_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1


def _check_sizes(sizes) -> list[tuple[int, int, int]] | None:
    if sizes is None:
        return None
    items = [sizes] if _positive_int(sizes) else sizes
    if not isinstance(items, (list, tuple)) or not items or not all(
            _positive_int(s) or (isinstance(s, (tuple, list)) and len(s) == 3 and all(map(_positive_int, s)))
            for s in items):
        raise ValueError(f"sizes: got {sizes!r}, need N or a non-empty list of sizes, each N (square) or an "
                         f"(M, N, K) triple of positive ints, e.g. [4096, (8192, 8192, 16384)]; "
                         f"or None for the backend's defaults")
    return [(int(s),) * 3 if _positive_int(s) else tuple(map(int, s)) for s in items]


def _check_dtypes(dtypes) -> list[str]:
    given = dtypes
    if isinstance(dtypes, str):  # "d,s", "d s", "ds", or one name: "i8", "float64"
        words = dtypes.replace(",", " ").split()
        dtypes = list(dtypes) if len(words) == 1 and set(dtypes) <= set(blas_types.PREFIXES) else words
    try:
        items = list(dtypes)
    except TypeError:
        items = [given]
    out: dict[str, None] = {}
    for d in items:
        try:
            out[perfdb.dtype_char(d)] = None
        except ValueError:
            raise ValueError(f"dtypes: got {given!r}; {d!r} is not one of {', '.join(blas_types.GEMM_PREFIXES)} "
                             f"({blas_types.GEMM_ALLOWED})") from None
    if not out:
        raise ValueError(f"dtypes: got {given!r}, need one or more of {', '.join(blas_types.GEMM_PREFIXES)}")
    return list(out)


def _check_tiles(tiles) -> list[int] | None:
    if tiles is None:
        return None
    items = [tiles] if _positive_int(tiles) else tiles
    try:
        items = list(items)
    except TypeError:
        items = []
    if not items or not all(_positive_int(t) for t in items):
        raise ValueError(f"tiles: got {tiles!r}, need positive ints (candidate tile sizes), or None for the "
                         f"backend's defaults")
    return sorted({int(t) for t in items})
