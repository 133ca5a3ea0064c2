"""The perf-db (blasx.perfdb), the tile choice that reads it, ``blasx.tune`` and ``blasx tune``.

Everything runs on sim devices with tiny sizes and tiles of 16..64; every test
points the user cache at its own temporary directory.
"""

from __future__ import annotations

import importlib
import os
import sqlite3
import threading

import numpy as np
import pytest

import blasx
import blasx.cli
from blasx import perfdb
from blasx.perfdb import PerfDb, PerfDbError, PerfKey, key_for, shape_class
from blasx.tile import MIN_TILE, choose_tile

tune_module = importlib.import_module("blasx.tune")  # blasx.tune is the function


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BLASX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BLASX_PERFDB", raising=False)
    return tmp_path


def key(tile_shape=(64, 64, 64), dtype="d", device="sim", ndev=2, routine="gemm") -> PerfKey:
    return PerfKey(device, ndev, dtype, routine, tile_shape)


# --------------------------------------------------------------------------- keys

def test_shape_class_rounds_each_dimension_to_the_nearest_power_of_two_in_log_scale():
    assert shape_class(4096, 4096, 4096) == (4096, 4096, 4096)
    # 4096 * sqrt(2) = 5792.6 splits the 4096 and 8192 classes
    assert shape_class(5792, 5793, 3000) == (4096, 8192, 4096)
    assert shape_class(1, 2, 3) == (1, 2, 4)
    assert shape_class(0, 100, 181) == (0, 128, 128)
    assert shape_class(182, 1 << 40, 12345) == (256, 1 << 40, 16384)


@pytest.mark.parametrize("args, name", [((-1, 4, 4), "m"), ((4, 2.5, 4), "n"), ((4, 4, True), "k")])
def test_shape_class_rejects_non_sizes_naming_the_dimension(args, name):
    with pytest.raises(ValueError, match=rf"^{name}: got .*need an int >= 0"):
        shape_class(*args)


def test_key_for_cuda_names_drops_the_ordinal_and_counts_the_gpus():
    k = key_for(["cuda:0 NVIDIA H200", "cuda:1 NVIDIA H200"], np.float64, 8000, 8192, 16384)
    assert k == PerfKey("NVIDIA H200", 2, "d", "gemm", (8192, 8192, 16384))
    assert k.text == "NVIDIA H200|2|d|gemm|8192x8192x16384"
    assert PerfKey.parse(k.text) == k
    assert key_for(["cuda:3 NVIDIA H100 80GB HBM3"], "c", 10, 20, 30, routine="syrk").text == \
        "NVIDIA H100 80GB HBM3|1|c|syrk|8x16x32"
    # a CPU worker beside the GPUs changes the balance: its own key
    assert key_for(["cuda:0 NVIDIA H200", "cpu"], np.complex128, 64, 64, 64).device == "NVIDIA H200+cpu"
    assert key_for(["cpu"], np.float32, 64, 64, 64) == PerfKey("cpu", 1, "s", "gemm", (64, 64, 64))


def test_key_for_engine_devices():
    blasx.configure(devices="sim:2,slow=4")
    assert key_for(blasx.engine().devices, np.float32, 100, 100, 100) == PerfKey("sim", 2, "s", "gemm", (128, 128, 128))
    blasx.configure(devices="sim:3", cpu=True)
    assert key_for(blasx.engine().devices, np.complex64, 64, 64, 64).device == "sim+cpu"
    assert key_for(blasx.engine().devices, np.complex64, 64, 64, 64).ndev == 3


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(dtype=np.int32), "dtype: got"),
    (dict(dtype="q"), "dtype: got 'q'"),
    (dict(routine="GEMM"), "routine: got 'GEMM'"),
    (dict(devices=[]), "devices: got an empty list"),
])
def test_key_for_errors_name_the_parameter(kwargs, fragment):
    args = dict(devices=["sim:0"], dtype="d", m=8, n=8, k=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=fragment):
        key_for(**args)


def test_parse_rejects_malformed_keys():
    with pytest.raises(ValueError, match="key: got 'sim|2|d|gemm'"):
        PerfKey.parse("sim|2|d|gemm")
    with pytest.raises(ValueError, match="key: got"):
        PerfKey.parse("sim|2|d|gemm|100x64x64")  # 100 is not a shape class


# --------------------------------------------------------------------------- the db

def test_default_path_follows_the_cache_dir_variables(cache, monkeypatch, tmp_path_factory):
    assert perfdb.default_path() == cache / "perfdb.sqlite"
    monkeypatch.delenv("BLASX_CACHE_DIR")
    xdg = tmp_path_factory.mktemp("xdg")
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    assert perfdb.default_path() == xdg / "blasx" / "perfdb.sqlite"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(xdg))
    assert perfdb.default_path() == xdg / ".cache" / "blasx" / "perfdb.sqlite"


def test_no_home_directory_places_the_db_in_a_private_temporary_folder(monkeypatch, tmp_path):
    """A container's user with no $HOME and no password entry: Path.home() raises; the db goes to a per-user
    folder in the temporary folder instead of failing every caller (info, tune, the find-db's readers)."""
    import pathlib
    import tempfile
    monkeypatch.delenv("BLASX_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(pathlib.Path, "home", staticmethod(no_home))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = perfdb.default_path()
    assert path.parent == tmp_path / f"blasx-cache-{os.getuid()}" and path.parent.stat().st_mode & 0o777 == 0o700
    path.parent.chmod(0o777)  # (as another user could have left it): not used
    other = perfdb.default_path()
    assert other.parent.parent == tmp_path and other.parent != path.parent and other.parent.stat().st_mode & 0o077 == 0


def test_rows_of_a_foreign_type_are_skipped_by_every_reader(cache):
    """A tile stored as a BLOB, a date or version that is not text (another tool's row): skipped, as a
    bad key is; `entries` (blasx info, tune --show) and lookups keep the good rows."""
    db = PerfDb()
    db.store(key(), 64, {64: 1.0})
    db.store(key((128, 128, 128)), 64, {64: 1.0})
    db.store(key((256, 256, 256)), 64, {64: 1.0})
    conn = sqlite3.connect(str(db.path))
    conn.execute("UPDATE entries SET tile=X'4142' WHERE m=64")
    conn.execute("UPDATE entries SET date=X'00' WHERE m=128")
    conn.commit()
    conn.close()
    rows = db.entries()
    assert [r["shape"] for r in rows] == [(256, 256, 256)]
    from blasx.probe import format_perfdb
    assert "256x256x256" in "\n".join(format_perfdb(db.path, db.entries()))


def test_clear_takes_a_db_whose_path_needs_quoting_in_a_uri(tmp_path):
    for name in ("run #1", "q?x", "p%41x"):
        folder = tmp_path / name
        folder.mkdir()
        db = PerfDb(folder / "perf.sqlite")
        db.store(key(), 64, {64: 1.0})
        assert db.clear() == 1 and db.entries() == []


def test_store_lookup_round_trip(cache):
    db = PerfDb()
    assert db.lookup(key()) is None
    assert db.entries() == []
    assert not (cache / "perfdb.sqlite").exists()  # reading never creates the file
    db.store(key(), 32, {16: 1.5, 32: 2.25, 64: 2.0})
    db.store(key(dtype="s"), 64, {64: 3.0})
    assert PerfDb().lookup(key()) == 32
    assert PerfDb(cache / "perfdb.sqlite").lookup(key(dtype="s")) == 64
    assert db.lookup(key(dtype="z")) is None
    assert db.lookup(key(ndev=4)) is None
    (e, _) = db.entries()  # ordered by key: d before s
    assert e["key"] == key() and e["text"] == "sim|2|d|gemm|64x64x64"
    assert (e["tile"], e["results"], e["shape"]) == (32, {16: 1.5, 32: 2.25, 64: 2.0}, (64, 64, 64))
    assert e["version"] == blasx.__version__ and e["date"][:2] == "20"
    db.store(key(), 16, {16: 9.0})  # replaces
    assert db.lookup(key()) == 16 and len(db.entries()) == 2
    with sqlite3.connect(cache / "perfdb.sqlite") as conn:
        assert conn.execute("SELECT version FROM schema").fetchall() == [(perfdb.SCHEMA_VERSION,)]
    assert db.clear() == 2
    assert db.lookup(key()) is None and db.entries() == []


@pytest.mark.parametrize("tile, results, fragment", [
    (0, {}, "tile: got 0"),
    (32, {16: 1.0}, r"tile: 32 is not among the measured tiles \[16\]"),
    (16, {16: float("nan")}, "results: TFLOPS of tile 16 is nan"),
    (16, {"16": 1.0}, "results: tile '16' is not a positive int"),
    (16, [1.0], "results: got list"),
])
def test_store_rejects_bad_entries(tile, results, fragment):
    with pytest.raises(ValueError, match=fragment):
        PerfDb().store(key(), tile, results)


def test_store_rejects_keys_that_are_not_keys():
    with pytest.raises(ValueError, match="key: shape"):
        PerfDb().store(key(tile_shape=(100, 64, 64)), 16, {})
    with pytest.raises(ValueError, match="key: got"):
        PerfDb().lookup("sim|2|d|gemm|64x64x64")


def test_corrupt_db_reads_as_no_entry_and_clear_resets_it(cache):
    path = cache / "perfdb.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    db = PerfDb()
    assert db.lookup(key()) is None
    assert db.entries() == [] and db.table() == {}
    blasx.configure(devices="sim:2")
    a = np.ones((64, 64))
    np.testing.assert_allclose(blasx.gemm(1.0, a, a), a @ a)  # a BLAS call never notices
    with pytest.raises(PerfDbError, match="perfdb.sqlite: could not store sim|2|d|gemm|64x64x64"):
        db.store(key(), 16, {16: 1.0})
    assert db.clear() == 0 and not path.exists()
    db.store(key(), 16, {16: 1.0})
    assert db.lookup(key()) == 16


def test_foreign_schema_version_reads_as_no_entry(cache):
    PerfDb().store(key(), 16, {16: 1.0})
    with sqlite3.connect(cache / "perfdb.sqlite") as conn:
        conn.execute("UPDATE schema SET version = 99")
    assert PerfDb().lookup(key()) is None
    with pytest.raises(PerfDbError, match="schema version 99"):
        PerfDb().store(key(), 16, {16: 1.0})
    PerfDb().clear()
    PerfDb().store(key(), 32, {32: 1.0})
    assert PerfDb().lookup(key()) == 32


def test_locked_db_reads_as_no_entry_and_a_writer_waits(cache, monkeypatch):
    monkeypatch.setattr(perfdb, "READ_TIMEOUT_S", 0.05)
    monkeypatch.setattr(perfdb, "TIMEOUT_S", 0.05)
    PerfDb().store(key(), 16, {16: 1.0})
    holder = sqlite3.connect(cache / "perfdb.sqlite", isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        assert PerfDb().lookup(key()) is None
        assert PerfDb().entries() == []
        with pytest.raises(PerfDbError, match="could not store .*locked"):
            PerfDb().store(key(), 32, {32: 1.0})
        with pytest.raises(PerfDbError, match="could not clear it: database is locked"):
            PerfDb().clear()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert PerfDb().lookup(key()) == 16


def test_two_threads_store_at_once(cache):
    errors, start = [], threading.Barrier(2)

    def writer(dtype):
        try:
            db = PerfDb()
            start.wait()
            for i in range(25):
                db.store(key(tile_shape=(1 << i, 64, 64), dtype=dtype), 16, {16: float(i)})
                db.store(key(tile_shape=(1, 1, 1)), 16 if dtype == "s" else 32, {16: 1.0, 32: 1.0})
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(dt,)) for dt in ("s", "d")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    entries = PerfDb().entries()
    assert len(entries) == 51
    assert {e["results"][16] for e in entries if e["dtype"] == "s"} == {float(i) for i in range(25)}
    assert PerfDb().lookup(key(tile_shape=(1, 1, 1))) in (16, 32)


# --------------------------------------------------------------------------- choose_tile

def test_choose_tile_uses_the_db_and_a_configured_tile_still_wins(rand, rel_err):
    blasx.configure(devices="sim:2")
    eng = blasx.engine()
    assert choose_tile(eng, 128, 128, 128, np.float64) == 64  # the heuristic: 2 x 2 tasks for 2 devices
    PerfDb().store(key_for(eng.devices, np.float64, 128, 128, 128), 32, {32: 2.0, 64: 1.0})
    assert choose_tile(eng, 128, 128, 128, np.float64) == 32
    assert choose_tile(eng, 100, 150, 181, np.float64) == 32  # same shape class
    assert choose_tile(eng, 128, 128, 128, np.float64, routine="syrk") == 32  # falls back to gemm's entry
    assert choose_tile(eng, 128, 128, 128, np.float32) == 64  # no entry for s
    assert choose_tile(eng, 256, 128, 128, np.float64) == 64  # another class
    a, b = rand((128, 128), np.float64, 1), rand((128, 128), np.float64, 2)
    assert rel_err(blasx.gemm(1.0, a, b), a @ b) < 1e-12
    assert blasx.last_profile().summary()["tasks"] == 16  # 4 x 4 tiles of 32
    blasx.configure(devices="sim:2", tile=16)
    assert choose_tile(blasx.engine(), 128, 128, 128, np.float64) == 16
    blasx.gemm(1.0, a, b)
    assert blasx.last_profile().summary()["tasks"] == 64


def test_choose_tile_shrinks_a_db_tile_that_does_not_fit_the_cache():
    blasx.configure(devices="sim:2", cache_bytes=1 << 20)  # 1 MiB: 24 tiles of 64x64 doubles fit, of 128x128 not
    eng = blasx.engine()
    PerfDb().store(key_for(eng.devices, np.float64, 256, 256, 256), 4096, {4096: 1.0})
    assert choose_tile(eng, 256, 256, 256, np.float64) == 64
    blasx.gemm(1.0, np.ones((256, 256)), np.ones((256, 256)))


def test_choose_tile_ignores_a_db_tile_below_the_backends_floor():
    """A tile of 2 (a hand-edited db, another version's) would run a 128^3 call in ~16,000 tasks."""
    blasx.configure(devices="sim:2")
    eng = blasx.engine()
    PerfDb().store(key_for(eng.devices, np.float64, 128, 128, 128), 2, {2: 1.0})
    assert choose_tile(eng, 128, 128, 128, np.float64) >= MIN_TILE["sim"]


def test_choose_tile_reads_the_db_once_per_engine(monkeypatch):
    blasx.configure(devices="sim:2")
    eng = blasx.engine()
    PerfDb().store(key_for(eng.devices, np.float64, 64, 64, 64), 16, {16: 1.0})
    loads = []
    real = PerfDb.table
    monkeypatch.setattr(PerfDb, "table", lambda self, *a: loads.append(1) or real(self, *a))
    for _ in range(5):
        assert choose_tile(eng, 64, 64, 64, np.float64) == 16
    assert len(loads) == 1
    PerfDb().store(key_for(eng.devices, np.float64, 64, 64, 64), 32, {32: 1.0})  # this process wrote: reload
    assert choose_tile(eng, 64, 64, 64, np.float64) == 32 and len(loads) == 2
    blasx.configure(devices="sim:2")  # a new engine reads it again
    assert choose_tile(blasx.engine(), 64, 64, 64, np.float64) == 32 and len(loads) == 3


def test_choose_tile_ignores_the_db_when_told_or_when_it_breaks(monkeypatch):
    blasx.configure(devices="sim:2")
    eng = blasx.engine()
    PerfDb().store(key_for(eng.devices, np.float64, 128, 128, 128), 32, {32: 1.0})
    monkeypatch.setenv("BLASX_PERFDB", "off")
    assert choose_tile(eng, 128, 128, 128, np.float64) == 64
    monkeypatch.delenv("BLASX_PERFDB")

    def broken(self, *a):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(PerfDb, "table", broken)
    blasx.configure(devices="sim:2")
    assert choose_tile(blasx.engine(), 128, 128, 128, np.float64) == 64


# --------------------------------------------------------------------------- tune

def test_tune_stores_the_winners_and_restores_the_configuration(cache):
    blasx.configure(devices="sim:3", streams=2, trace=False, cache_bytes=1 << 22)
    before = blasx.session.settings()
    lines = []
    rows = blasx.tune(sizes=[64, (48, 96, 64)], dtypes="d", tiles=[16, 32, 64], runs=1, devices="sim:2",
                      progress=lines.append)
    assert blasx.session.settings() == before
    assert len(rows) == 2 and len(lines) == 6
    for r, shape in zip(rows, [(64, 64, 64), (64, 128, 64)]):
        assert r["key"] == f"sim|2|d|gemm|{shape[0]}x{shape[1]}x{shape[2]}" and r["shape"] == shape
        assert set(r["tflops"]) == {16, 32, 64} and all(v > 0 for v in r["tflops"].values())
        assert all(len(v) == 1 for v in r["seconds"].values())
        assert all(e < 1e-10 for e in r["errors"].values()) and r["bad"] == [] and r["skipped"] == {}
        assert r["tile"] == max(r["tflops"], key=r["tflops"].get) and r["stored"]
        assert PerfDb().lookup(PerfKey.parse(r["key"])) == r["tile"]
    assert {e["text"] for e in PerfDb().entries()} == {r["key"] for r in rows}
    # the runtime now takes the tuned tile for that class
    blasx.configure(devices="sim:2")
    assert choose_tile(blasx.engine(), 64, 64, 64, np.float64) == rows[0]["tile"]


def test_tune_skips_tiles_too_big_for_the_cache_and_checks_results():
    blasx.configure(devices="sim:2", cache_bytes=1 << 16)  # 64 KiB: 16x16 doubles fit, 64x64 do not
    rows = blasx.tune(sizes=40, dtypes=("d",), tiles=(64, 16), runs=1)
    (r,) = rows
    assert r["tiles"] == [16, 64] and list(r["skipped"]) == [64] and "tile cache" in r["skipped"][64]
    assert r["tile"] == 16 and r["stored"] and r["errors"][16] < 1e-10
    assert blasx.session.settings().cache_bytes == 1 << 16


def test_tune_restores_the_configuration_when_it_fails(monkeypatch):
    blasx.configure(devices="sim:2", tile=48, streams=3)
    before = blasx.session.settings()

    def broken(*a, **k):
        raise RuntimeError("device on fire")

    monkeypatch.setattr(importlib.import_module("blasx.level3"), "gemm", broken)
    with pytest.raises(RuntimeError, match="device on fire"):
        blasx.tune(sizes=32, dtypes="s", tiles=[16], runs=1)
    assert blasx.session.settings() == before
    assert PerfDb().entries() == []


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(sizes=0), "sizes: got 0"),
    (dict(sizes=[(4, 4)]), r"sizes: got \[\(4, 4\)\]"),
    (dict(dtypes="q"), "dtypes: got 'q'"),
    (dict(dtypes=()), "dtypes: got ()"),
    (dict(tiles=[16, 0]), r"tiles: got \[16, 0\]"),
    (dict(tiles=[8, 32]), r"tiles: got \[8, 32\]; sim devices take tiles of at least 16"),
    (dict(runs=0), "runs: got 0"),
    (dict(check_rows=-1), "check_rows: got -1"),
    (dict(db=3), "db: got 3"),
])
def test_tune_errors_name_the_parameter(kwargs, fragment):
    blasx.configure(devices="sim:2", tile=16)
    before = blasx.session.settings()
    with pytest.raises(ValueError, match=fragment):
        blasx.tune(**kwargs)
    assert blasx.session.settings() == before


def test_default_tiles_are_capped_by_the_problem():
    assert tune_module.default_tiles("cuda", 16384, 16384, 16384) == [2048, 3072, 4096, 6144, 8192]
    assert tune_module.default_tiles("cuda", 4096, 4096, 4096) == [2048, 3072, 4096]
    assert tune_module.default_tiles("cuda", 1000, 1000, 1000) == [1000]
    assert tune_module.default_tiles("sim", 100, 50, 70) == [32, 64, 100]


# --------------------------------------------------------------------------- CLI

def test_cli_tune_show_and_clear(cache, capsys):
    assert blasx.cli.main(["tune", "--n", "64,32", "--k", "32", "--dtype", "d,s", "--devices", "sim:2",
                           "--tiles", "16,32", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert "blasx tune: sim:2 (sim:0, sim:1)" in out and str(cache / "perfdb.sqlite") in out
    assert "dgemm 64x64x32 tile 16:" in out and "sgemm 32x32x32 tile 32:" in out
    assert "stored 4 of 4 entries" in out
    assert sorted(e["text"] for e in PerfDb().entries()) == [
        "sim|2|d|gemm|32x32x32", "sim|2|d|gemm|64x64x32", "sim|2|s|gemm|32x32x32", "sim|2|s|gemm|64x64x32"]
    assert blasx.cli.main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert "4 entries" in out and "64x64x32" in out and "gemm" in out and blasx.__version__ in out
    assert blasx.cli.main(["tune", "--clear"]) == 0
    assert "removed 4 entries" in capsys.readouterr().out
    assert blasx.cli.main(["tune", "--show"]) == 0
    assert "no entries" in capsys.readouterr().out


def test_cli_tune_rejects_bad_lists(capsys):
    with pytest.raises(SystemExit):
        blasx.cli.main(["tune", "--tiles", "16,x"])
    assert "--tiles: got 'x', need a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        blasx.cli.main(["tune", "--dtype", "d,q"])
    assert "--dtype: got 'd,q'" in capsys.readouterr().err


def test_tune_checks_progress_host_memory_and_db_before_measuring(monkeypatch, tmp_path):
    before = blasx.session.settings()
    measured = []
    monkeypatch.setattr(tune_module, "_tune_one", lambda *a: measured.append(a))
    with pytest.raises(TypeError, match="progress: got int, need a function"):
        tune_module.tune(sizes=[64], dtypes="d", devices="sim:2", progress=123)
    from blasx import probe
    monkeypatch.setattr(probe, "host_memory", lambda: (1 << 30, 1 << 20))
    with pytest.raises(ValueError, match=r"sizes: 512x512x512 float64 operands take .* but only 1.00 MiB"):
        tune_module.tune(sizes=[64, 512], dtypes="d", devices="sim:2")
    monkeypatch.setattr(probe, "host_memory", lambda: (1 << 30, None))
    with pytest.raises(ValueError, match="is a folder; need a perf-db file"):
        tune_module.tune(sizes=[64], dtypes="d", devices="sim:2", db=tmp_path)
    (tmp_path / "junk").write_bytes(b"not a db")
    with pytest.raises(ValueError, match="is not a blasx perf-db"):
        tune_module.tune(sizes=[64], dtypes="d", devices="sim:2", db=tmp_path / "junk")
    other = tmp_path / "other.sqlite"
    conn = sqlite3.connect(str(other))
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    with pytest.raises(ValueError, match="an SQLite database of another program"):
        tune_module.tune(sizes=[64], dtypes="d", devices="sim:2", db=other)
    assert not measured and blasx.session.settings() == before
