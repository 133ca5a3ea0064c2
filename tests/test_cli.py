"""The ``blasx`` command line (blasx/cli.py), its progress line (blasx/progress.py) and the
``blasx info`` facts, measurements and formatting (blasx/probe.py). Everything runs on the
``sim`` and ``cpu`` backends; the CUDA measurements only show that they fail politely here."""

import io
import os
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import blasx
import blasx.cli as cli
import blasx.probe as probe
import blasx.progress as progress
from blasx.perfdb import PerfDb, key_for

SLOW_SIM = "sim:2,rate=2e7"  # 16 tiles of 64: a call of about 0.9 s


def progress_threads():
    return [t for t in threading.enumerate() if t.name == progress.THREAD_NAME]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BLASX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("BLASX_PERFDB", raising=False)
    return tmp_path / "cache"


@pytest.fixture
def fast_progress(monkeypatch):
    monkeypatch.setattr(progress, "INTERVAL_S", 0.05)


def updates(err: str) -> list[tuple[int, int]]:
    """(done, total) of every progress line drawn on stderr."""
    out = []
    for chunk in err.replace("\n", "\r").split("\r"):
        if " tiles " in chunk:
            done, total = chunk.split(" tiles ")[0].split()[-1].split("/")
            out.append((int(done), int(total)))
    return out


# --------------------------------------------------------------------------- help

@pytest.mark.parametrize("argv, words", [
    ([], ["gemm", "info", "tune", "examples:"]),
    (["gemm"], ["--n N", "--dtype {s,d,c,z,h,b,i8}", "--devices SPEC", "--progress", "--no-progress", "exit status"]),
    (["info"], ["--measure", "--devices SPEC", "--db FILE", "perf-db", "cuBLAS"]),
    (["tune"], ["--tiles", "--show", "--clear", "perf-db"]),
])
def test_help_reads_well(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: blasx")
    for w in words:
        assert w in out, w
    assert max(map(len, out.splitlines())) <= 100


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and blasx.__version__ in capsys.readouterr().out


# --------------------------------------------------------------------------- bad options

@pytest.mark.parametrize("argv, fragment", [
    (["gemm", "--n", "-5"], "argument --n: got -5, need a positive integer"),
    (["gemm", "--n", "0"], "argument --n: got 0, need a positive integer"),
    (["gemm", "--m", "x"], "argument --m: got 'x', need a positive integer"),
    (["gemm", "--dtype", "q"], "argument --dtype: got 'q', need one of s, d, c, z, h, b, i8"),
    (["gemm", "--devices", "gpu"], "argument --devices: unknown backend 'gpu' in 'gpu'; allowed: cuda, sim, cpu"),
    (["gemm", "--devices", "sim:0"], "argument --devices: sim count must be from 1 to 64"),
    (["gemm", "--devices", "cpu:1"], "argument --devices: 'cpu' takes no arguments"),
    (["gemm", "--cache-bytes", "10"], "argument --cache-bytes: got '10' (10 bytes), need at least 65536"),
    (["gemm", "--cache-bytes", "lots"], "argument --cache-bytes: got 'lots', need a byte count"),
    (["gemm", "--check-rows", "-1"], "argument --check-rows: got -1, need an integer >= 0"),
    (["gemm", "--runs", "0"], "argument --runs: got 0, need a positive integer"),
    (["gemm", "--progress", "--no-progress"], "not allowed with argument --progress"),
    (["gemm", "--trace", "/no/such/folder/t.json"], "argument --trace: got '/no/such/folder/t.json', but its folder"),
    (["gemm", "--n", "10000000", "--devices", "sim:1"], "of host memory is available"),
    (["info", "--devices", "sim:2,speeds=1"], "argument --devices: speeds lists 1 factors for 2 sim devices"),
    (["info", "--bogus"], "unrecognized arguments: --bogus"),
    (["gemm", "--devices", "sim:65"], "argument --devices: sim count must be from 1 to 64"),
    (["gemm", "--devices", "sim:2,mem=1e400"], "bad value '1e400' for sim option 'mem'"),
    (["gemm", "--devices", "sim:2,slow=inf"], "bad value 'inf' for sim option 'slow'"),
    (["gemm", "--devices", "sim:2,rate=nan"], "bad value 'nan' for sim option 'rate'"),
    (["gemm", "--devices", "sim:2,speeds=1/nan"], "bad value '1/nan' for sim option 'speeds'"),
    (["gemm", "--devices", "sim:2,slow=2,slow=3"], "option 'slow' given twice"),
    (["gemm", "--trace", ""], "argument --trace: got an empty file name"),
    (["tune", "--devices", "sim:2", "--n", "64", "--tiles", "8"], "argument --tiles: got [8]; sim devices take"),
    (["tune", "--m", "64"], "arguments --m/--k: need --n"),
    (["tune", "--check-rows", "-2"], "argument --check-rows: got -2, need an integer >= 0"),
    (["tune", "--dtype", "d,q"], "argument --dtype: got 'd,q'"),
    (["tune", "--devices", "sim:2", "--n", "200000", "--tiles", "64", "--dtype", "i8"],
     "arguments --m/--n/--k: 200000x200000x200000 int8 operands take"),
    (["frob"], "invalid choice: 'frob'"),
    ([], "the following arguments are required: COMMAND"),
])
def test_bad_options_are_one_line_errors_with_status_2(capsys, argv, fragment):
    before = blasx.session.settings()
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("blasx") and ": error: " in last and fragment in last, err
    assert blasx.session.settings() == before


def test_a_bad_blasx_devices_variable_is_named(capsys, monkeypatch):
    monkeypatch.setenv("BLASX_DEVICES", "gpu:1")
    with pytest.raises(SystemExit) as e:
        cli.main(["info"])
    assert e.value.code == 2
    assert "blasx info: error: $BLASX_DEVICES: unknown backend 'gpu'" in capsys.readouterr().err


def test_running_out_of_host_memory_is_one_line_with_status_1(capsys, monkeypatch):
    """A limit the estimate cannot see (a cgroup's, ulimit's): numpy's MemoryError, said in one line."""
    def no_memory(*args):
        raise MemoryError("Unable to allocate 1.07 GiB")
    monkeypatch.setattr(blasx.precision, "random_operand", no_memory)
    assert cli.main(["gemm", "--devices", "sim:2", "--n", "64", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip() == ("blasx gemm: error: out of host memory: Unable to allocate "
                                                      "1.07 GiB; try smaller sizes")


def test_a_device_memory_error_is_said_as_it_is(capsys, monkeypatch):
    """A MemoryError of the devices (the tile cache full, CuPy's out of memory) is not host memory."""
    class CacheFull(MemoryError):
        pass

    def full(*args):
        raise CacheFull("cuda:0: the tile cache is full")
    monkeypatch.setattr(blasx.precision, "random_operand", full)
    assert cli.main(["gemm", "--devices", "sim:2", "--n", "64", "--no-progress"]) == 1
    assert capsys.readouterr().err.strip() == "blasx gemm: error: cuda:0: the tile cache is full"


def test_a_bad_variable_read_where_blasx_dnn_loads_is_one_line_with_status_2(tmp_path):
    import subprocess
    env = {**os.environ, "BLASX_RNN_REPLAY": "maybe", "BLASX_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "blasx.cli", "tune", "--show"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("blasx tune: error: $BLASX_RNN_REPLAY: got 'maybe'")


def test_missing_cuda_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setattr(blasx.session, "_cuda_count", lambda: 0)
    with pytest.raises(SystemExit) as e:
        cli.main(["gemm", "--devices", "cuda", "--n", "8"])
    assert e.value.code == 2
    assert "argument --devices: 'cuda' asked for, but CuPy finds no CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("text, value", [("65536", 65536), ("64K", 65536), ("64k", 65536), ("1M", 1 << 20),
                                         ("1.5GiB", 3 << 29), ("2gb", 2 << 30), ("256 MiB", 256 << 20)])
def test_byte_counts(text, value):
    assert cli._bytes(text) == value


@pytest.mark.parametrize("args, want", [
    (["--tile", "100000"], "argument --tile: 100000 needs a tile cache"),
    (["--devices", "sim:2,mem=64M", "--cache-bytes", "64M"], "argument --cache-bytes: got 67108864, but the device "
                                                            "spec sets mem=64M")])
def test_setting_errors_name_the_flag_once(args, want, capsys):
    """A setting refused when the engine starts names the flag that gave it, once ('argument --tile: tile:' and a
    bare 'cache_bytes:' before)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["gemm", "--n", "256", "--devices", "sim:2", *args])
    assert e.value.code == 2 and want in capsys.readouterr().err


def test_dtype_names():
    assert [cli._dtype(x) for x in ("s", "D", "float64", "complex64", "double")] == ["s", "d", "d", "c", "d"]
    assert cli._dtype_list("d,float32,d") == ["d", "s"]


# --------------------------------------------------------------------------- gemm

def test_gemm_on_sims_checks_and_restores_the_settings(capsys):
    blasx.configure(devices="sim:3", tile=48)
    before = blasx.session.settings()
    assert cli.main(["gemm", "--n", "96", "--k", "64", "--devices", "sim:2", "--tile", "32", "--runs", "1",
                     "--dtype", "z"]) == 0
    cap = capsys.readouterr()
    assert "blasx gemm: 96x96x64 complex128" in cap.out and "sim:2 (sim:0, sim:1)" in cap.out
    assert "run 0:" in cap.out and "check: 96 rows" in cap.out and "(ok," in cap.out
    assert "\r" not in cap.err  # stderr is not a terminal: no progress line
    assert blasx.session.settings() == before


def test_gemm_says_what_it_runs_and_its_result_when_stderr_is_not_a_terminal(capsys):
    # `make run` in a log or CI: no progress line, so the start and the result are printed lines.
    assert cli.main(["gemm", "--n", "192", "--k", "64", "--devices", "sim:2", "--tile", "64", "--runs", "2",
                     "--dtype", "s"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("blasx gemm: 192x192x64 float32 (s)")
    assert "sim:2 (sim:0, sim:1)" in out[0] and "tile 64 (9 tile(s) of C)" in out[0] and "2 run(s)" in out[0]
    assert out[1].startswith("  run 0:") and "TFLOPS" in out[1]
    assert out[-1].startswith("result: best of 2 run(s) ") and out[-1].endswith("TFLOPS, check ok")


def test_gemm_on_the_cpu_alone_is_one_tile(capsys):
    assert cli.main(["gemm", "--n", "128", "--devices", "cpu", "--runs", "1", "--check-rows", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "on cpu (cpu), tile 128 (1 tile(s) of C)" in out[0]
    assert out[-1].startswith("result: best of 1 run(s) ") and out[-1].endswith("not checked")


def test_progress_line_with_a_slow_sim(capsys, fast_progress):
    assert cli.main(["gemm", "--n", "256", "--tile", "64", "--devices", SLOW_SIM, "--runs", "1",
                     "--check-rows", "8", "--progress"]) == 0
    cap = capsys.readouterr()
    seen = updates(cap.err)
    assert seen and all(total == 16 for _, total in seen)
    assert any(0 < done < 16 for done, _ in seen), cap.err  # drawn while the call ran
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # never goes back
    assert seen[-1] == (16, 16) and cap.err.endswith("\n")  # finished with a newline
    assert "run 0 [" in cap.err and "tiles/s" in cap.err
    assert "\r" not in cap.out  # the progress line is on stderr only
    assert progress_threads() == []


def test_no_progress_and_not_a_terminal(capsys, fast_progress):
    for extra in (["--no-progress"], []):
        assert cli.main(["gemm", "--n", "128", "--tile", "32", "--devices", "sim:2,rate=1e8", "--runs", "1",
                         "--check-rows", "0", *extra]) == 0
        assert "tiles" not in capsys.readouterr().err
    assert progress_threads() == []


def test_progress_thread_is_joined_when_the_call_fails(capsys, fast_progress):
    assert cli.main(["gemm", "--n", "256", "--tile", "32", "--devices", "sim:1,rate=2e7,fail=0@60",
                     "--runs", "1", "--progress"]) == 1
    err = capsys.readouterr().err
    assert "blasx gemm: error: gemm failed" in err and "injected fault" in err
    assert "Traceback" not in err
    lines = [x for x in err.split("\n") if " tiles " in x]
    assert lines and lines[-1].rstrip().endswith("failed")
    assert progress_threads() == []


# --------------------------------------------------------------------------- progress (unit)

def test_render():
    line = progress.render("run 0", 4, 16, 2.0, flops=16e12)
    assert line.startswith("run 0 [######------------------]")
    assert " 4/16 tiles" in line and " 25%" in line and "2 tiles/s" in line and "2 TFLOPS" in line
    assert line.endswith("2.0 s")
    assert progress.flop_rate(5e11) == "500 GFLOPS" and progress.flop_rate(2.09e7) == "20.9 MFLOPS"
    assert progress.render("", 0, 0, 0.0, state="failed").startswith("[------------------------]  0/0 tiles")
    assert progress.render("x", 9, 4, 1.0).count("#") == progress.BAR_WIDTH  # clipped


class _Tty(io.StringIO):
    def isatty(self):
        return True


class _Closed(io.StringIO):
    def isatty(self):
        raise ValueError("I/O operation on closed file")


def test_wanted():
    assert progress.wanted(None, _Tty()) and not progress.wanted(None, io.StringIO())
    assert progress.wanted(True, io.StringIO()) and not progress.wanted(False, _Tty())
    assert not progress.wanted(None, _Closed()) and not progress.wanted(None, object())


class _FakeCall:
    def __init__(self, total):
        self.n_tasks = total
        self.remaining = total


def test_progress_monitor_reads_the_running_call(monkeypatch):
    import time

    call = _FakeCall(10)
    asked = []
    monkeypatch.setattr(progress, "running_call", lambda ident: asked.append(ident) or call)
    out = io.StringIO()
    with pytest.raises(RuntimeError, match="boom"):
        with progress.Progress(out, label="x", interval=0.01) as p:
            for left in (7, 3):
                call.remaining = left
                drawn = p.updates
                deadline = time.monotonic() + 5
                while p.updates < drawn + 2 and time.monotonic() < deadline:
                    time.sleep(0.005)
            raise RuntimeError("boom")
    assert progress_threads() == []
    assert set(asked) == {threading.get_ident()}  # the thread that entered
    text = out.getvalue()
    assert " 3/10 tiles" in text and " 7/10 tiles" in text and text.endswith("failed\n")
    assert text.count("\n") == 1 and p.updates >= 4


def test_progress_disabled_starts_nothing():
    out = io.StringIO()
    with progress.Progress(out, enabled=False):
        assert progress_threads() == []
    assert out.getvalue() == ""
    with pytest.raises(ValueError, match="interval: got 0"):
        progress.Progress(out, interval=0)


def test_running_call_is_set_only_during_the_call():
    blasx.configure(devices="sim:2,rate=1e8", tile=64)
    a = np.ones((256, 256))
    ident = threading.get_ident()
    seen = []
    assert blasx.level3.running_call(ident) is None

    def watch():
        import time
        for _ in range(200):
            c = blasx.level3.running_call(ident)
            if c is not None:
                seen.append(progress.call_counts(c))
                return
            time.sleep(0.01)

    t = threading.Thread(target=watch)
    t.start()
    blasx.gemm(1.0, a, a)
    t.join()
    assert seen and seen[0][1] == 16 and 0 <= seen[0][0] <= 16
    assert blasx.level3.running_call(ident) is None


# --------------------------------------------------------------------------- info

def test_info_on_sims(capsys, cache):
    PerfDb().store(key_for(["sim:0", "sim:1"], np.float64, 256, 256, 256), 64, {32: 0.5, 64: 0.75})
    PerfDb().store(key_for(["cpu"], np.float32, 512, 512, 512), 256, {256: 0.1})
    assert cli.main(["info", "--devices", "sim:2,slow=2"]) == 0
    out = capsys.readouterr().out
    assert f"blasx {blasx.__version__}" in out
    assert "devices (sim:2,slow=2):" in out and "[1] sim:1 (slow=2) (sim, 4 streams, tile cache 64.00 MiB)" in out
    assert "peer links: [0] <-> [1]" in out
    assert "rates" not in out  # measurements only with --measure
    assert "perf-db" in out and "2 entries" in out and "(* 1 entry for these devices: sim, 2 GPUs)" in out
    marked = [x for x in out.splitlines() if x.startswith("* ")]
    assert len(marked) == 1 and "256x256x256" in marked[0] and "0.75" in marked[0]


def test_info_measure_on_sims_reports_the_model(capsys, cache):
    assert cli.main(["info", "--devices", "sim:2,slow=4,h2d=2e9,p2p=1e10,rate=1e12", "--measure"]) == 0
    out = capsys.readouterr().out
    assert "rates (blasx info --measure):" in out and "no entries" in out
    lines = out.splitlines()
    i = lines.index("  [1] sim:1 (slow=4)")
    assert lines[i + 1].split()[:3] == ["H2D", "0.5", "GB/s"] and "sim model (slow=4)" in lines[i + 1]
    assert lines[i + 3].split()[:5] == ["P2P", "<-", "[0]", "2.5", "GB/s"]
    assert lines[i + 4].split()[:3] == ["GEMM", "250", "GFLOPS"]


def test_info_measure_on_the_cpu(capsys, cache, monkeypatch):
    monkeypatch.setattr(probe, "CPU_GEMM_SIZES", (64, 128))
    assert cli.main(["info", "--devices", "cpu", "--measure", "--db", str(cache / "none.sqlite")]) == 0
    out = capsys.readouterr().out
    assert "[0] cpu (cpu, 1 stream, host memory" in out and "peer links" not in out
    assert "DGEMM" in out and "SGEMM" in out and "numpy (host BLAS), N=128" in out
    assert "none.sqlite: no entries" in out


def test_measure_never_raises_for_a_gpu_it_cannot_use(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # "import cupy" fails, as without CuPy
    dev = SimpleNamespace(index=0, kind="cuda", ordinal=0, streamed=True, can_read_from=lambda o: False)
    rates = probe.measure([dev])
    assert rates and all(r.value is None and r.how.startswith("failed: ") for r in rates)
    with pytest.raises(ValueError, match="gemm_n: got 0, need a positive int"):
        probe.measure([dev], gemm_n=0)
    with pytest.raises(ValueError, match="dtypes: got"):
        probe.measure([dev], dtypes=("z",))


# --------------------------------------------------------------------------- probe formatting

FACTS = [probe.DeviceFacts(0, "cuda:0 NVIDIA H200", "cuda", 4, 70 << 30, 143 << 30, 60 << 30),
         probe.DeviceFacts(1, "cuda:1 NVIDIA H200", "cuda", 4, 70 << 30, 143 << 30, None),
         probe.DeviceFacts(2, "cpu", "cpu", 1, None, 512 << 30, None)]


def test_format_devices_and_links():
    lines = probe.format_devices("cuda", FACTS)
    assert lines == ["devices (cuda):",
                     "  [0] cuda:0 NVIDIA H200 (cuda, 4 streams, memory 143.00 GiB, tile cache 70.00 GiB, 60.00 GiB free)",
                     "  [1] cuda:1 NVIDIA H200 (cuda, 4 streams, memory 143.00 GiB, tile cache 70.00 GiB)",
                     "  [2] cpu (cpu, 1 stream, host memory 512.00 GiB)"]
    assert probe.format_links(FACTS, [(0, 1), (1, 0)]) == ["peer links: [0] <-> [1]"]
    assert probe.format_links(FACTS, [(1, 0)]) == ["peer links: [1] -> [0]"]
    assert probe.format_links(FACTS, [])[0].startswith("peer links: none")
    assert probe.format_links(FACTS[:1] + FACTS[2:], []) == []


def test_format_rates_with_made_up_numbers():
    rates = [probe.Rate(0, "H2D", 55.25e9, "pinned host memory, 256 MiB"),
             probe.Rate(0, "P2P", 389.9e9, "from cuda:1, 256 MiB", peer=1),
             probe.Rate(0, "DGEMM", 59.81e12, "cuBLAS (CuPy matmul), N=8192"),
             probe.Rate(1, "SGEMM", None, "failed: OutOfMemoryError: out of memory"),
             probe.Rate(2, "DGEMM", 1.5e11, "numpy (host BLAS), N=2048")]
    lines = probe.format_rates(FACTS, rates)
    assert lines[0] == "rates (blasx info --measure):"
    assert lines[1] == "  [0] cuda:0 NVIDIA H200"
    assert lines[2].split() == ["H2D", "55.25", "GB/s", "pinned", "host", "memory,", "256", "MiB"]
    assert lines[3].split()[:5] == ["P2P", "<-", "[1]", "389.9", "GB/s"]
    assert lines[4].split()[:3] == ["DGEMM", "59.81", "TFLOPS"]
    assert lines[6].split()[:2] == ["SGEMM", "failed"] and "out of memory" in lines[6]
    assert lines[8].split()[:3] == ["DGEMM", "150", "GFLOPS"]
    assert probe.format_rates(FACTS, []) == ["rates (blasx info --measure):", "  (nothing measured)"]
    assert probe.format_bytes(None) == "?" and probe.format_bytes(512) == "512 B"


def test_format_perfdb():
    e = {"device": "NVIDIA H200", "ndev": 2, "dtype": "d", "routine": "gemm", "shape": (16384, 16384, 16384),
         "tile": 4096, "results": {4096: 95.5, 8192: 90.0}, "date": "2026-11-22T03:39:52+00:00", "version": "0.1.0"}
    lines = probe.format_perfdb("/x/perfdb.sqlite", [e, dict(e, ndev=1)], ("NVIDIA H200", 2))
    assert lines[0] == "perf-db /x/perfdb.sqlite: 2 entries"
    assert lines[2].startswith("* NVIDIA H200") and "95.5" in lines[2] and lines[3].startswith("  NVIDIA H200")
    assert lines[-1] == "(* 1 entry for these devices: NVIDIA H200, 2 GPUs)"
    assert probe.format_perfdb("p", [], disabled=True) == ["perf-db p: no entries (ignored by the runtime: "
                                                           "BLASX_PERFDB is off)"]
    # the CPU alone reads no entry (one host BLAS call a gemm): none is marked as used
    cpu = dict(e, device="cpu", ndev=1)
    lines = probe.format_perfdb("p", [cpu], ("cpu", 1))
    assert lines[2].startswith("  cpu") and lines[-1].startswith("(the CPU alone: each gemm is one host BLAS call")


# --------------------------------------------------------------------------- no bench command

def test_bench_is_not_a_command(capsys):
    """The benchmarks live in a source checkout (python -m bench.gemm), not in the installed CLI."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "gemm"])
    assert e.value.code == 2
    assert "invalid choice: 'bench'" in capsys.readouterr().err


# --------------------------------------------------------------------------- CUDA measurements, faked

class _FakeCupy:
    """Just enough of CuPy for blasx.probe's CUDA measurements: every timed span lasts 2 ms."""

    uint8, float32, float64 = "uint8", "float32", "float64"

    def __init__(self):
        self.calls = []
        self.current = [0]
        fake = self

        class Err(Exception):
            pass

        class Device:
            def __init__(self, ordinal):
                self.ordinal = ordinal

            def __enter__(self):
                fake.current.append(self.ordinal)

            def __exit__(self, *exc):
                fake.current.pop()

        class Stream:
            def __init__(self, non_blocking=False):
                self.ptr = 1000 + fake.current[-1]

            def synchronize(self):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                pass

            def use(self):
                return self

        class Event:
            def record(self, stream=None):
                pass

            def synchronize(self):
                pass

        def enable(peer):
            fake.calls.append(("enable", fake.current[-1], peer))
            if peer == 0:
                raise Err("cudaErrorPeerAccessAlreadyEnabled: peer access is already enabled")

        runtime = SimpleNamespace(
            memcpyHostToDevice=1, memcpyDeviceToHost=2, CUDARuntimeError=Err,
            memcpyAsync=lambda *a: fake.calls.append(("memcpy", *a)),
            memcpyPeerAsync=lambda *a: fake.calls.append(("peer", *a)),
            deviceEnablePeerAccess=enable, memGetInfo=lambda: (60 << 30, 143 << 30))
        pool = SimpleNamespace(free_all_blocks=lambda: None)
        self.cuda = SimpleNamespace(Device=Device, Stream=Stream, Event=Event, runtime=runtime,
                                    alloc_pinned_memory=lambda n: SimpleNamespace(ptr=7),
                                    get_elapsed_time=lambda a, b: 2.0,
                                    get_current_stream=lambda: SimpleNamespace(ptr=0, use=lambda: None))
        self.random = SimpleNamespace(random=lambda shape: SimpleNamespace(astype=lambda dt: ("array", dt)))
        self.get_default_memory_pool = self.get_default_pinned_memory_pool = lambda: pool

    def empty(self, shape, dtype=None):
        return SimpleNamespace(data=SimpleNamespace(ptr=100 + self.current[-1]))

    def matmul(self, a, b, out=None):
        self.calls.append(("matmul", a[1], self.current[-1]))


def test_cuda_measurements_with_a_fake_cupy(monkeypatch):
    fake = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake.cuda)
    monkeypatch.setattr(probe, "GPU_WARM_S", 0.0)  # one warm-up call each (test_gpu_warm_up_lasts: the duration)
    devs = [SimpleNamespace(index=i, kind="cuda", ordinal=o, streamed=True, name=f"cuda:{o} X",
                            can_read_from=lambda other: True) for i, o in ((0, 0), (1, 1))]
    rates = probe.measure(devs, copy_bytes=1 << 20, gemm_n=1000, reps=2)
    got = {(r.device, r.what, r.peer): r for r in rates}
    assert all(r.value is not None for r in rates), [r.how for r in rates if r.value is None]
    assert sorted(got) == sorted((d, w, p) for d in (0, 1) for w, p in
                                 (("H2D", None), ("D2H", None), ("P2P", 1 - d), ("DGEMM", None), ("SGEMM", None)))
    assert got[0, "H2D", None].value == pytest.approx((1 << 20) / 2e-3)
    assert got[1, "DGEMM", None].value == pytest.approx(2e9 / 2e-3)
    assert got[0, "P2P", 1].how == "from cuda:1, 1 MiB"
    # device 0 reads device 1: the copy goes into 0's buffer from 1's, on a stream of device 0
    assert ("peer", 100, 0, 101, 1, 1 << 20, 1000) in fake.calls
    assert ("memcpy", 101, 7, 1 << 20, 1, 1001) in fake.calls  # H2D on device 1
    assert ("matmul", "float32", 1) in fake.calls
    facts = probe.device_facts([SimpleNamespace(index=0, kind="cuda", ordinal=0, streamed=True, name="cuda:0 X",
                                                nstreams=4, cache_capacity=lambda: 1 << 30)])
    assert facts[0].memory_total == 143 << 30 and facts[0].memory_free == 60 << 30
    text = "\n".join(probe.format_rates(facts + [probe.DeviceFacts(1, "cuda:1 X", "cuda", 4)], rates))
    assert "P2P <- [1]" in text and "DGEMM" in text and "failed" not in text


def test_gpu_warm_up_lasts(monkeypatch):
    """A GPU measurement repeats the operation for GPU_WARM_S before it times any (an idle H200's first
    host -> device copies ran at half speed for tens of ms), at least once, then times ``reps``."""
    fake = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake.cuda)
    stream = SimpleNamespace(synchronize=lambda: None)
    calls = []

    def issue():
        calls.append(time.perf_counter())
        time.sleep(0.004)

    assert probe._best_gpu_seconds(issue, stream, 3, warm_s=0.03) == 2e-3  # (the fake events' time)
    warm = len(calls) - 3
    assert warm >= 2 and calls[warm] - calls[0] >= 0.03 and calls[warm - 1] - calls[0] < 0.03
    calls.clear()
    probe._best_gpu_seconds(issue, stream, 2, warm_s=0.0)
    assert len(calls) == 3  # one warm-up call at least
    assert probe.GPU_WARM_S >= 0.05


def test_info_into_a_pipe_closed_early(cache):
    """`blasx info | head -1`: the reader leaves (here stdout raises BrokenPipeError after its first
    line, as a closed pipe does); blasx ends quietly, status 0, no traceback."""
    import subprocess
    code = ("import sys\n"
            "from blasx import cli\n"
            "class Closed:\n"
            "    lines = 0\n"
            "    def write(self, text):\n"
            "        Closed.lines += 1\n"
            "        if Closed.lines > 1:\n"
            "            raise BrokenPipeError(32, 'Broken pipe')\n"
            "        return len(text)\n"
            "    def flush(self): pass\n"
            "    def fileno(self): return 1\n"
            "sys.stdout = Closed()\n"
            "sys.exit(cli.main(['info', '--devices', 'sim:2']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "Broken" not in proc.stderr, proc.stderr


def test_clear_leaves_a_file_that_is_not_a_perf_db_alone(capsys, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--db", str(notes), "--clear"])
    assert e.value.code == 2 and notes.read_text() == "mine"
    err = capsys.readouterr().err
    assert "Traceback" not in err and "not a blasx perf-db" in err
    from blasx.perfdb import PerfDb, PerfDbError
    with pytest.raises(PerfDbError, match="not a blasx perf-db"):  # (the API refuses it too)
        PerfDb(notes).clear()
    assert notes.read_text() == "mine"
    import sqlite3
    other = tmp_path / "other.sqlite"  # another program's database: not touched
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE t (x)")
    assert cli.main(["tune", "--db", str(other), "--clear"]) == 1
    with sqlite3.connect(other) as conn:
        assert conn.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall() == [("t",)]


def test_a_device_failure_is_reported_with_status_1(capsys):
    assert cli.main(["gemm", "--n", "256", "--devices", "sim:2,fail=0@1", "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "check ok" in captured.out and "device failure: sim:0" in captured.err


def test_timing_mode_sims_are_not_checked(capsys, tmp_path):
    assert cli.main(["gemm", "--n", "256", "--devices", "sim:2,timing=1", "--no-progress"]) == 0
    assert "not checked (timing-mode sims compute no data)" in capsys.readouterr().out
    # tune too (it called each tile WRONG and stored nothing, exit 1)
    db = str(tmp_path / "t.sqlite")
    assert cli.main(["tune", "--devices", "sim:2,timing=1", "--n", "256", "--tiles", "64,128", "--db", db]) == 0
    out = capsys.readouterr().out
    assert "not checked (timing-mode sims compute no data)" in out and "WRONG" not in out


def test_a_db_that_is_a_folder_or_another_file_is_a_usage_error(capsys, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for argv, fragment in ((["info", "--devices", "sim:2", "--db", str(tmp_path)], "which is a folder"),
                           (["tune", "--show", "--db", str(notes)], "not a blasx perf-db"),
                           (["tune", "--devices", "sim:2", "--n", "64", "--db", str(notes)], "not a blasx perf-db"),
                           (["tune", "--devices", "sim:2", "--n", "64", "--db", str(tmp_path / "no" / "x.db")],
                            "does not exist")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and fragment in capsys.readouterr().err
    assert notes.read_text() == "mine" and not (tmp_path / "no").exists()


def test_python_dash_m_blasx_is_the_command():
    import subprocess
    r = subprocess.run([sys.executable, "-m", "blasx", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and blasx.__version__ in r.stdout
