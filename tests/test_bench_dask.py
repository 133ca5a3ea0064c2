"""``python -m bench.dask`` on a tiny problem (CPU devices, one worker process): both contenders and the
one-process run are checked, the files are written, ``--group`` reaches blasx.dask's graph."""

from __future__ import annotations

import json
import shlex

import pytest

pytest.importorskip("distributed")


def test_smoke_run_writes_checked_results(tmp_path, capsys):
    from bench import dask as bench_dask
    argv = ["--n", "256", "--block", "64", "--devices", "cpu", "--workers", "1", "--group", "256", "--task-bytes",
            "300KB", "--contenders", "blasx.dask,dask.array,blasx (one process)", "--out", str(tmp_path / "new")]
    rc = bench_dask.main(argv)  # (the directory made)
    tmp_path = tmp_path / "new"
    assert rc == 0
    [js] = tmp_path.glob("dask-cpu-g256-tb300KB-w1t1-n256-b64-*.json")  # (a chain of links: 1 MB of blocks)
    res = json.loads(js.read_text())
    assert set(res["results"]) == {"blasx.dask", "dask.array", "blasx (one process)"}
    assert all(r["rel_err"] < 1e-10 and r["ok"] and r["tolerance"] == 1e-10 for r in res["results"].values())
    assert res["args"]["group"] == 256 and shlex.split(res["command"])[3:] == argv  # (pasted, it runs the same)
    assert "| ok |" in js.with_suffix(".md").read_text()
    assert js.with_suffix(".md").exists()


def test_the_check_catches_a_transposed_or_summed_c(capsys):
    """Rows of C against a numpy reference that no contender computes: a transposed C (which a checksum of the
    whole C accepts) is caught; the recorded command can be pasted (a contender name with spaces quoted)."""
    import dask.array as da
    import numpy as np
    from bench import dask as bench_dask
    rng = np.random.default_rng(0)
    a, b = (da.from_array(rng.random((96, 96)), chunks=32) for _ in range(2))
    rows = bench_dask.check_rows(96)
    assert rows[0] == 0 and rows[-1] == 95
    ref = bench_dask.reference_rows(a, b, rows)
    c = a @ b
    assert bench_dask._check(c, rows, ref) < 1e-12
    assert bench_dask._check(c.T, rows, ref) > 1e-3 and abs(float(c.T.sum() - c.sum())) < 1e-9


def test_group_must_be_auto_off_or_a_number():
    from bench import dask as bench_dask
    with pytest.raises(SystemExit):
        bench_dask.main(["--group", "several"])


@pytest.mark.parametrize("opt", ["--task-bytes", "--memory-limit"])
def test_sizes_must_be_sizes(capsys, opt):
    from bench import dask as bench_dask
    with pytest.raises(SystemExit):
        bench_dask.main([opt, "lots"])
    assert f"{opt}: got 'lots'; allowed: a size" in capsys.readouterr().err


def test_contenders_must_be_known(capsys):
    """A misspelt contender is refused before any cluster starts (once it ran dask.array under the wrong name)."""
    from bench import dask as bench_dask
    with pytest.raises(SystemExit):
        bench_dask.main(["--contenders", "blasx.dask,blasx"])
    assert "--contenders: got 'blasx.dask,blasx'; allowed: a comma list of blasx.dask, dask.array, blasx (one " \
           "process)" in capsys.readouterr().err


def test_default_contenders():
    """All three, except dask.array where GPU workers get host chunks (it would compute them on the CPUs)."""
    from bench import dask as bench_dask
    everyone = ["blasx.dask", "dask.array", "blasx (one process)"]
    assert bench_dask.default_contenders("cpu", False) == everyone
    assert bench_dask.default_contenders("sim:2", False) == everyone
    assert bench_dask.default_contenders("cuda", True) == everyone
    assert bench_dask.default_contenders("cuda", False) == ["blasx.dask", "blasx (one process)"]
    assert bench_dask.default_contenders("cuda:{name}", False) == ["blasx.dask", "blasx (one process)"]
