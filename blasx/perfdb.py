"""The perf-db: measured best tile sizes (the one tuning knob of BLASX, the paper's Section V-B).

``blasx.tune()`` stores the winner per :class:`PerfKey`; ``blasx.tile.choose_tile`` reads it back
before its heuristic. A key is the device model (``device_key``: mixed models join with ``+``, a
CPU worker beside GPUs, not in auto mode, adds ``+cpu``), the number of GPUs, the dtype prefix,
the routine (other level-3 routines fall back to ``gemm``) and the shape class (:func:`shape_class`);
text form ``"NVIDIA H200|2|d|gemm|4096x4096x4096"``. A missing, corrupt, locked or foreign-version
file reads as "no entry" (a BLAS call never fails because of it); writers use one connection per
operation and ``BEGIN IMMEDIATE``. The same file holds the convolution find-db (table ``conv_entries``,
keys and lookups in :mod:`blasx.dnn.finddb`), added without a schema version bump: an older blasx
ignores the table.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import tempfile
import threading
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .runtime import dtypes
from .runtime.config import env_switch

SCHEMA_VERSION = 1
FILENAME = "perfdb.sqlite"
TIMEOUT_S = 10.0  # sqlite busy timeout: how long a writer waits for another one
READ_TIMEOUT_S = 1.0  # how long a read waits for a writer's lock before it counts as "no entry"
_SEP = "|"

# Bumped by every store/clear in this process, so cached tables (blasx.tile) reload.
_generation = 0
_gen_lock = threading.Lock()


class PerfDbError(RuntimeError):
    """The perf-db file could not be written (corrupt, locked too long, not writable)."""


class PerfKey(NamedTuple):
    """What an entry is keyed by (see the module docstring)."""

    device: str
    ndev: int
    dtype: str
    routine: str
    shape: tuple[int, int, int]

    @property
    def text(self) -> str:
        m, n, k = self.shape
        return _SEP.join((self.device, str(self.ndev), self.dtype, self.routine, f"{m}x{n}x{k}"))

    def __str__(self) -> str:
        return self.text

    @classmethod
    def parse(cls, text: str) -> "PerfKey":
        """The key of a text form ``"device|ndev|dtype|routine|MxNxK"``."""
        parts = text.split(_SEP) if isinstance(text, str) else []
        try:
            device, ndev, dtype, routine, shape = parts
            dims = tuple(int(x) for x in shape.split("x"))  # not 3 of them: _checked_key refuses it
            return _checked_key(cls(device, int(ndev), dtype, routine, dims))
        except ValueError:
            raise ValueError(f"key: got {text!r}, expected 'device|ndev|dtype|routine|MxNxK' "
                             f"such as 'NVIDIA H200|2|d|gemm|4096x4096x4096'") from None


def generation() -> int:
    return _generation


def _bump() -> None:
    global _generation
    with _gen_lock:
        _generation += 1


def disabled() -> bool:
    """True when ``$BLASX_PERFDB`` is off/0/no/false: the runtime ignores the db. Another word warns (once
    per value) and leaves the db on: the perf-db is advice, never a reason for a BLAS call to fail."""
    try:
        return not env_switch("BLASX_PERFDB")
    except ValueError as exc:
        if str(exc) not in _warned:
            _warned.add(str(exc))
            warnings.warn(f"{exc}; the perf-db stays on", RuntimeWarning, stacklevel=2)
        return False


_warned: set = set()


def cache_dir() -> Path:
    """``$BLASX_CACHE_DIR``, else ``$XDG_CACHE_HOME/blasx``, else ``~/.cache/blasx``; with no home directory to
    be found (a container's user without one), ``blasx-cache-<uid>`` in the temporary folder."""
    d = os.environ.get("BLASX_CACHE_DIR", "").strip()
    if d:
        return Path(d).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "blasx"
    try:
        return Path.home() / ".cache" / "blasx"
    except RuntimeError:  # (Path.home: no $HOME and no password entry)
        return _private_temp_dir()


def _private_temp_dir() -> Path:
    """``blasx-cache-<uid>`` in the temporary folder, made private (0700) to this user; if another user made
    it, or anyone may write it, a fresh private folder for this process instead (no db planted by another)."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    d = Path(tempfile.gettempdir()) / f"blasx-cache-{uid if uid is not None else 'user'}"
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        st = d.lstat()
        import stat
        if stat.S_ISDIR(st.st_mode) and (uid is None or st.st_uid == uid) and not st.st_mode & 0o022:
            return d
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="blasx-cache-"))


def is_sqlite(path) -> bool:
    """Whether the file at ``path`` begins as an SQLite database does (an empty one: not yet, False)."""
    try:
        with open(path, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


def file_problem(path, foreign: bool = False) -> str | None:
    """Why the file at ``path`` cannot be a blasx perf-db ("is a folder; ...", "is not a blasx perf-db (...)"), or
    None (a missing or empty file is an empty db); ``foreign``: another program's SQLite database counts too."""
    path = Path(path)
    if path.is_dir():
        return "is a folder; need a perf-db file"
    if not path.is_file() or not path.stat().st_size:
        return None
    if not is_sqlite(path):
        return "is not a blasx perf-db (not an SQLite file)"
    if foreign and not PerfDb(path).is_blasx_file():
        return "is not a blasx perf-db (an SQLite database of another program)"
    return None


def default_path() -> Path:
    return cache_dir() / FILENAME


def location_state() -> tuple:
    """The variables :func:`default_path` depends on (cheap to compare; the runtime reloads when they change)."""
    env = os.environ
    return env.get("BLASX_CACHE_DIR"), env.get("XDG_CACHE_HOME"), env.get("HOME")


# ---------------------------------------------------------------- keys

def _round_pow2(name: str, x) -> int:
    if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < 0:
        raise ValueError(f"{name}: got {x!r}, need an int >= 0")
    x = int(x)
    if x == 0:
        return 0
    p = 1 << (x.bit_length() - 1)  # p <= x < 2p
    return 2 * p if x * x >= 2 * p * p else p  # nearest power of two in log scale (p * sqrt 2 splits)


def shape_class(m: int, n: int, k: int) -> tuple[int, int, int]:
    """The size bucket of an M x N x K problem: each dimension rounded to the
    nearest power of two in log scale (5792 -> 4096, 5793 -> 8192; 0 stays 0)."""
    return _round_pow2("m", m), _round_pow2("n", n), _round_pow2("k", k)


def dtype_char(dtype) -> str:
    """The prefix (``s``/``d``/``c``/``z``, ``h``/``b``/``i8``) of a numpy dtype (or of the prefix itself)."""
    if isinstance(dtype, str) and dtype in dtypes.GEMM_BY_PREFIX:
        return dtype
    t = dtypes.gemm_of(dtype)
    if t is None:
        raise ValueError(f"dtype: got {dtype!r}, need {dtypes.GEMM_ALLOWED} "
                         f"(or their prefixes {', '.join(dtypes.GEMM_PREFIXES)})")
    return t.prefix


def device_model(device) -> str:
    """The model part of a device name: ``"cuda:0 NVIDIA H200"`` -> ``"NVIDIA H200"``;
    sims and the CPU are ``"sim"`` and ``"cpu"``. Takes a Device or a name."""
    name = device if isinstance(device, str) else getattr(device, "name", None)
    if not isinstance(name, str):
        raise ValueError(f"devices: got {device!r}, need Device objects or device names such as 'cuda:0 NVIDIA H200'")
    kind = name.partition(":")[0].partition(" ")[0].strip() if isinstance(device, str) else device.kind
    if kind in ("sim", "cpu"):
        return kind
    head, _, rest = name.partition(" ")
    model = rest.strip() if ":" in head else name.strip()
    return (model or kind).replace(_SEP, "/")


def _is_streamed(device) -> bool:
    if isinstance(device, str):
        return device.partition(":")[0].strip() != "cpu"
    return bool(getattr(device, "streamed", True))


def device_key(devices) -> tuple[str, int]:
    """``(device model, number of GPUs)`` of an engine's device list (see the module docstring)."""
    devices = list(devices)
    if not devices:
        raise ValueError("devices: got an empty list, need at least one device")
    streamed = [d for d in devices if _is_streamed(d)]
    if not streamed:
        return "cpu", 1
    model = "+".join(sorted({device_model(d) for d in streamed}))
    if any(not _is_streamed(d) and not getattr(d, "auto", False) for d in devices):
        model += "+cpu"
    return model, len(streamed)


def _check_routine(routine) -> str:
    if not isinstance(routine, str) or not routine or not routine.replace("_", "").isalnum() \
            or routine.lower() != routine:
        raise ValueError(f"routine: got {routine!r}, need a lower-case routine name such as 'gemm'")
    return routine


def key_for(devices, dtype, m: int, n: int, k: int, routine: str = "gemm") -> PerfKey:
    """The perf-db key of an M x N x K ``routine`` call in ``dtype`` on ``devices``
    (Device objects, e.g. ``blasx.engine().devices``, or their names)."""
    model, ndev = device_key(devices)
    return _checked_key(PerfKey(model, ndev, dtype_char(dtype), _check_routine(routine), shape_class(m, n, k)))


def _checked_key(key) -> PerfKey:
    if not isinstance(key, tuple) or len(key) != 5:
        raise ValueError(f"key: got {key!r}, need a PerfKey from blasx.perfdb.key_for(...)")
    key = PerfKey(*key)
    if not isinstance(key.device, str) or not key.device or _SEP in key.device:
        raise ValueError(f"key: device {key.device!r} must be a non-empty name without {_SEP!r}")
    if not isinstance(key.ndev, int) or isinstance(key.ndev, bool) or key.ndev < 1:
        raise ValueError(f"key: ndev {key.ndev!r} must be an int >= 1")
    if key.dtype not in dtypes.GEMM_BY_PREFIX:
        raise ValueError(f"key: dtype {key.dtype!r} must be one of {', '.join(dtypes.GEMM_PREFIXES)}")
    if not dtypes.GEMM_BY_PREFIX[key.dtype].level3 and key.routine != "gemm":
        raise ValueError(f"key: dtype {key.dtype!r} has gemm alone, got routine {key.routine!r}")
    _check_routine(key.routine)
    if not (isinstance(key.shape, tuple) and len(key.shape) == 3):
        raise ValueError(f"key: shape {key.shape!r} must be a shape class (M, N, K) from shape_class()")
    if shape_class(*key.shape) != key.shape:
        raise ValueError(f"key: shape {key.shape!r} is not a shape class; shape_class() gives "
                         f"{shape_class(*key.shape)}")
    return key


# ---------------------------------------------------------------- the db

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS schema (version INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS entries ("
    " device TEXT NOT NULL, ndev INTEGER NOT NULL, dtype TEXT NOT NULL, routine TEXT NOT NULL,"
    " m INTEGER NOT NULL, n INTEGER NOT NULL, k INTEGER NOT NULL,"
    " tile INTEGER NOT NULL, results TEXT NOT NULL, date TEXT NOT NULL, version TEXT NOT NULL,"
    " PRIMARY KEY (device, ndev, dtype, routine, m, n, k))",
    "CREATE TABLE IF NOT EXISTS conv_entries ("
    " key TEXT PRIMARY KEY, device TEXT NOT NULL, direction TEXT NOT NULL, form TEXT NOT NULL,"
    " results TEXT NOT NULL, date TEXT NOT NULL, version TEXT NOT NULL)",
)
_CONV_COLS = "key, device, direction, form, results, date, version"
_COLS = "device, ndev, dtype, routine, m, n, k, tile, results, date, version"


def _positive_tile(v) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


class PerfDb:
    """The perf-db file (default: :func:`default_path`, resolved when the object is made)."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"path: got {path!r}, need a file path (str or os.PathLike) or None for the default")
        self.path = Path(path).expanduser() if path is not None else default_path()

    def __repr__(self) -> str:
        return f"PerfDb({str(self.path)!r})"

    # -- connections: one per operation --

    def _write(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return sqlite3.connect(str(self.path), timeout=TIMEOUT_S, isolation_level=None)
        except (sqlite3.Error, OSError) as e:
            raise PerfDbError(f"perf-db {self.path}: cannot open it for writing: {e}") from e

    # -- reads (never raise for a bad file) --

    def lookup(self, key: PerfKey) -> int | None:
        """The stored tile for ``key``, or None (no entry, or no readable db)."""
        key = _checked_key(key)
        return self.table(key.device, key.ndev).get(key)

    def table(self, device: str | None = None, ndev: int | None = None) -> dict[PerfKey, int]:
        """Every valid entry as ``{key: tile}`` (optionally of one device model and count);
        empty when the db is missing or unreadable. The runtime loads this once per engine."""
        return {e["key"]: t for e in self._rows(device, ndev) if (t := _positive_tile(e["tile"])) is not None}

    def entries(self) -> list[dict]:
        """Every entry, as dicts: key (PerfKey), text, device, ndev, dtype, routine,
        shape, tile, results ({tile: TFLOPS}), date, version."""
        return self._rows(None, None)

    def _select(self, sql: str, args: tuple = ()) -> list[tuple]:
        """The rows of a query on a read-only connection; empty when the db (or the table: a file of an
        older blasx) is missing, corrupt, of another schema version or unreadable."""
        if not self.path.is_file():
            return []
        conn = None
        try:
            conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=READ_TIMEOUT_S)
            row = conn.execute("SELECT version FROM schema").fetchone()
            return conn.execute(sql, args).fetchall() if row is not None and row[0] == SCHEMA_VERSION else []
        except (sqlite3.Error, OSError, ValueError):
            return []
        finally:
            if conn is not None:
                conn.close()

    def _rows(self, device, ndev) -> list[dict]:
        sql, args = f"SELECT {_COLS} FROM entries", ()
        if device is not None and ndev is not None:
            sql, args = sql + " WHERE device=? AND ndev=?", (device, ndev)
        rows = self._select(sql + " ORDER BY device, ndev, dtype, routine, m, n, k", args)
        out = []
        for device_, ndev_, dtype, routine, m, n, k, tile, results, date, version in rows:
            try:
                key = _checked_key((device_, ndev_, dtype, routine, (m, n, k)))
                res = {int(t): float(v) for t, v in json.loads(results).items()}
                if type(tile) is not int or not isinstance(date, str) or not isinstance(version, str):
                    raise TypeError("tile, date, version")
            except (ValueError, TypeError, AttributeError):
                continue  # a row some other tool wrote badly: skip it, keep the rest
            out.append({"key": key, "text": key.text, "device": device_, "ndev": ndev_, "dtype": dtype,
                        "routine": routine, "shape": (m, n, k), "tile": tile, "results": res,
                        "date": date, "version": version})
        return out

    def conv_rows(self) -> list[tuple]:
        """The find-db's rows as (key, device, direction, form, results JSON, date, version), by key;
        empty when the db (or its conv table) is missing or unreadable. :mod:`blasx.dnn.finddb` parses them."""
        return self._select(f"SELECT {_CONV_COLS} FROM conv_entries ORDER BY key")

    # -- writes (raise PerfDbError when the file cannot take them) --

    def store_conv(self, key: str, device: str, direction: str, form: str, results: dict[str, float]) -> None:
        """Record ``form`` as the fastest for the find-db key ``key`` (text; validated by the caller,
        :func:`blasx.dnn.finddb.store`), with the seconds of every form measured; replaces an older entry."""
        self._insert("conv_entries", _CONV_COLS, (key, device, direction, form, json.dumps(results)), key)

    def store(self, key: PerfKey, tile: int, results: dict[int, float]) -> None:
        """Record ``tile`` as the best for ``key``, with the TFLOPS measured for every candidate
        (``results``: {tile: TFLOPS}); replaces an older entry of the same key."""
        key = _checked_key(key)
        if _positive_tile(tile) is None:
            raise ValueError(f"tile: got {tile!r}, need a positive int")
        if not isinstance(results, dict):
            raise ValueError(f"results: got {type(results).__name__}, need a dict {{tile: TFLOPS}}")
        clean = {}
        for t, v in results.items():
            if _positive_tile(t) is None:
                raise ValueError(f"results: tile {t!r} is not a positive int")
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"results: TFLOPS of tile {t} is {v!r}, need a finite number >= 0")
            clean[str(int(t))] = float(v)
        if clean and str(tile) not in clean:
            raise ValueError(f"tile: {tile} is not among the measured tiles {sorted(int(t) for t in clean)}")
        self._insert("entries", _COLS, (key.device, key.ndev, key.dtype, key.routine, *key.shape, int(tile),
                                        json.dumps(clean)), key.text)

    def _insert(self, table: str, cols: str, row: tuple, what: str) -> None:
        """``row``, then the date and blasx's version, into ``table`` (replacing a row of its key), in its own
        transaction (PerfDbError naming ``what`` when the file refuses it)."""
        from . import __version__

        row += (datetime.now(timezone.utc).isoformat(timespec="seconds"), __version__)
        conn = self._write()
        try:
            conn.execute("BEGIN IMMEDIATE")
            self._ensure_schema(conn)
            conn.execute(f"INSERT OR REPLACE INTO {table} ({cols}) VALUES ({','.join('?' * len(row))})", row)
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            _rollback(conn)
            raise PerfDbError(f"perf-db {self.path}: could not store {what}: {e} "
                              f"(`blasx tune --clear` resets a damaged file)") from e
        finally:
            conn.close()
        _bump()

    def clear(self) -> int:
        """Remove every entry (tiles and the find-db's); returns how many there were. A damaged or
        foreign-version file is deleted when it is blasx's: the default perf-db, or an SQLite file with a
        ``schema`` table (a blasx perf-db of another version); any other file is left alone (PerfDbError)."""
        if not self.path.exists():
            return 0
        if not self.path.is_file():
            raise PerfDbError(f"perf-db {self.path}: not a file; left alone")
        if self.path.stat().st_size and is_sqlite(self.path) and not self.is_blasx_file():  # (another program's)
            raise PerfDbError(f"perf-db {self.path}: an SQLite database that is not a blasx perf-db; left alone")
        conn = self._write()
        damaged = False
        try:
            conn.execute("BEGIN IMMEDIATE")
            self._ensure_schema(conn)
            n = conn.execute("DELETE FROM entries").rowcount + conn.execute("DELETE FROM conv_entries").rowcount
            conn.execute("COMMIT")
        except (PerfDbError, sqlite3.DatabaseError) as e:  # another schema version, or not a database
            _rollback(conn)
            if isinstance(e, sqlite3.OperationalError):  # locked, unreadable: leave the file alone
                raise PerfDbError(f"perf-db {self.path}: could not clear it: {e}") from e
            damaged, n = True, 0
        finally:
            conn.close()
        if damaged:
            if not self.is_blasx_file():
                raise PerfDbError(f"perf-db {self.path}: not a blasx perf-db (nor the default one); left alone")
            try:
                self.path.unlink(missing_ok=True)
            except OSError as e:
                raise PerfDbError(f"perf-db {self.path}: damaged and cannot be removed: {e}") from e
        _bump()
        return max(n, 0)

    def is_blasx_file(self) -> bool:
        """Whether the file is blasx's to delete: the default perf-db, or SQLite with a ``schema`` table."""
        try:
            if self.path.resolve() == default_path().resolve():
                return True
            if not is_sqlite(self.path):
                return False
            conn = sqlite3.connect(self.path.resolve().as_uri() + "?mode=ro", uri=True, timeout=TIMEOUT_S)
            try:
                return conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='schema'").fetchone() \
                    is not None
            finally:
                conn.close()
        except (OSError, sqlite3.Error):
            return False

    def _ensure_schema(self, conn: sqlite3.Connection) -> None:
        for stmt in _SCHEMA:
            conn.execute(stmt)
        row = conn.execute("SELECT version FROM schema").fetchone()
        if row is None:
            conn.execute("INSERT INTO schema (version) VALUES (?)", (SCHEMA_VERSION,))
        elif row[0] != SCHEMA_VERSION:
            raise PerfDbError(f"perf-db {self.path}: schema version {row[0]}, this blasx uses {SCHEMA_VERSION}; "
                              f"`blasx tune --clear` starts a new one")


def _rollback(conn: sqlite3.Connection) -> None:
    with contextlib.suppress(sqlite3.Error):  # nothing to roll back
        conn.execute("ROLLBACK")
