"""CPU tests of bench/efficiency.py: options, device specs, GEMM on views of larger arrays, the
per-call check, the efficiency arithmetic, and the whole sweep on sim devices (everything but the
page-locking, which needs CUDA)."""

import contextlib
import gc
import json
import os
import sys
import weakref

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import efficiency as E  # noqa: E402
from bench import level3_check as LC  # noqa: E402
from bench import level3_contenders as LX  # noqa: E402

import blasx  # noqa: E402


# --------------------------------------------------------------------------- options

def test_parse_sizes():
    assert E.parse_sizes("4096:40960:4096") == [4096 * k for k in range(1, 11)]
    assert E.parse_sizes("64:128:64") == [64, 128]
    assert E.parse_sizes("8192,4096,8192") == [4096, 8192]
    assert E.parse_sizes("100:150:100") == [100]


@pytest.mark.parametrize("text", ["0:10:2", "10:5:1", "1:2", "a", "", "64:128:0", "-5"])
def test_parse_sizes_errors(text):
    with pytest.raises(ValueError, match=r"--n: got .*; allowed: start:stop:step"):
        E.parse_sizes(text)


def test_parse_counts_and_scalars():
    assert E.parse_counts("2,1,2") == [1, 2]
    with pytest.raises(ValueError, match=r"--gpus: got '0,1'; allowed: a comma list of positive GPU counts"):
        E.parse_counts("0,1")
    with pytest.raises(ValueError, match=r"--beta: got 'nan'; allowed: a finite real number"):
        E.parse_scalar("--beta")("nan")


def test_device_spec():
    assert E.device_spec("cuda", 1) == "cuda:0" and E.device_spec("cuda", 2) == "cuda:0,1"
    assert E.device_spec("sim", 3) == "sim:3" and E.device_spec("cpu", 1) == "cpu"
    assert E.device_spec("cuda", 2, "sim:{g},slow=2") == "sim:2,slow=2"
    assert E.device_spec("sim", 2, "cuda:{ids}") == "cuda:0,1"
    with pytest.raises(ValueError, match=r"--devices-spec: got 'sim:2'; allowed: .*\{g\}"):
        E.device_spec("sim", 2, "sim:2")
    with pytest.raises(ValueError, match=r"--devices-spec: got 'sim:\{n\}'"):
        E.device_spec("sim", 2, "sim:{n}")
    with pytest.raises(ValueError, match=r"--gpus: got a count of 2 with --backend cpu; allowed: 1 only"):
        E.device_spec("cpu", 2)


def test_parse_args(capsys, monkeypatch):
    monkeypatch.setattr(E, "gpu_tag", lambda count: f"h200x{count}")  # as on 2 H200s, without nvidia-smi
    args = E.parse_args([])
    assert args.n == [4096 * k for k in range(1, 11)] and args.gpus == [1, 2] and args.runs == 2
    assert args.dtypes == ["d"] and args.specs == {1: "cuda:0", 2: "cuda:0,1"} and args.tag == "h200x2"
    assert (args.alpha, args.beta, args.warmup, args.pin) == (1.5, 0.5, 1, "auto")
    args = E.parse_args(["--dtypes", "s,d", "--backend", "sim"])
    assert args.dtypes == ["d", "s"] and args.specs == {1: "sim:1", 2: "sim:2"} and args.tag == "sim"
    with pytest.raises(SystemExit):
        E.parse_args(["--backend", "cpu", "--gpus", "1,2"])
    assert "--gpus: got a count of 2 with --backend cpu" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        E.parse_args(["--dtypes", "c"])
    assert "--dtypes: got 'c'; allowed: a comma list of s, d" in capsys.readouterr().err


# --------------------------------------------------------------------------- arrays, views, the check

def test_cast_arrays_matches_direct_float32_draws():
    d = E.allocate(64, "d", seed=5)
    direct = E.allocate(64, "s", seed=5)
    s = E.cast_arrays(d, "s")
    assert d == {}                       # the float64 arrays were handed over
    for k in "abc":
        assert s[k].dtype == np.float32 and s[k].flags.f_contiguous
        assert np.array_equal(s[k], direct[k])
    assert E.arrays_for("s", 64, 5, None)["a"].dtype == np.float32


@pytest.mark.parametrize("dtype", ["d", "s"])
def test_blasx_gemm_on_views_of_larger_f_arrays_on_sim(dtype):
    blasx.configure(devices="sim:2", tile=16)
    arrs = E.allocate(80, dtype, seed=1)
    before = {k: v.copy(order="F") for k, v in arrs.items()}
    a, b, c = E.views(arrs, 48)
    assert not c.flags.f_contiguous and c.strides[1] == 80 * c.itemsize   # a view with ld 80
    fn = LX.blasx_routine(blasx, dtype, "gemm")
    res = fn(1.5, a, b, beta=0.5, c=c, overwrite_c=True)
    assert res is c or np.shares_memory(res, c)
    A64, B64, C64 = (before[k][:48, :48].astype(np.float64) for k in "abc")
    ref = 1.5 * A64 @ B64 + 0.5 * C64
    assert LC.rel_err(arrs["c"][:48, :48], ref) < (1e-14 if dtype == "d" else 1e-6)
    assert np.array_equal(arrs["c"][48:], before["c"][48:])           # outside the view: untouched
    assert np.array_equal(arrs["c"][:48, 48:], before["c"][:48, 48:])
    assert all(np.array_equal(arrs[k], before[k]) for k in "ab")


class FakeBlasx:
    """A 'blasx' whose gemm is wrong in a chosen way."""

    def __init__(self, mode):
        self.mode = mode

    def gemm(self, alpha, a, b, beta=0.0, c=None, overwrite_c=False):
        res = alpha * a.astype(np.float64) @ b + beta * c
        if self.mode == "copy":
            return res                       # right numbers, but not written into c
        if self.mode == "missing-beta":
            res -= beta * c
        if self.mode == "nan":
            res[-1, 0] = np.nan
        c[...] = res
        return c

    def last_profile(self):
        raise RuntimeError("no profile here")


@pytest.mark.parametrize("mode, ok", [("right", True), ("copy", False), ("missing-beta", False), ("nan", False)])
def test_checked_gemm(mode, ok):
    arrs = E.allocate(40, "d", seed=2)
    a, b, c = E.views(arrs, 32)
    rows = LC.sample_rows(32, 8)
    ab = E.product_rows(a, b, rows)
    r = E.checked_gemm(FakeBlasx(mode), "d", a, b, c, 1.5, 0.5, rows, ab, LC.tolerance("d", 32))
    assert r["ok"] is ok and r["seconds"] >= 0
    assert r["in_place"] is (mode != "copy")
    assert "profile_error" in r and "profile" not in r
    if mode == "nan":
        assert r["rel_err"] is None          # NaN: fails, and stays strict JSON


def test_checked_gemm_float32_tolerance_and_profile():
    blasx.configure(devices="sim:2", tile=16)
    arrs = E.allocate(64, "s", seed=3)
    a, b, c = E.views(arrs, 64)
    rows = LC.sample_rows(64, 16)
    ab = E.product_rows(a, b, rows)
    for _ in range(3):                   # C accumulates call after call; every call checks out
        r = E.checked_gemm(blasx, "s", a, b, c, 1.5, 0.5, rows, ab, LC.tolerance("s", 64))
        assert r["ok"] and 0 < r["rel_err"] < 1e-5
    prof = r["profile"]
    assert [d["kind"] for d in prof["devices"]] == ["sim", "sim"]
    assert sum(d["tasks"] for d in prof["devices"]) == prof["tasks"] == 16
    assert sum(d["flops_share"] for d in prof["devices"]) == pytest.approx(1.0)


# --------------------------------------------------------------------------- efficiency arithmetic

def rec(dtype, n, g, seconds, warmup=False, ok=True):
    return {"dtype": dtype, "n": n, "gpus": g, "seconds": seconds, "warmup": warmup, "ok": ok}


def test_summarize_and_averages():
    records = [rec("d", 100, 1, 9.0, warmup=True), rec("d", 100, 1, 2.0), rec("d", 100, 1, 2.2),
               rec("d", 100, 2, 1.25), rec("d", 100, 2, 1.3),
               rec("d", 200, 1, 4.0), rec("d", 200, 2, 2.0, ok=False), rec("d", 200, 2, 2.5),
               rec("s", 100, 1, 1.0), rec("s", 100, 2, 0.5)]
    rows = E.summarize(records, [1, 2])
    assert [(r["dtype"], r["n"]) for r in rows] == [("d", 100), ("d", 200), ("s", 100)]
    r0 = rows[0]["per_g"]
    assert r0[1]["best"] == 2.0 and r0[2]["best"] == 1.25 and r0[2]["efficiency"] == pytest.approx(0.8)
    assert r0[1]["efficiency"] == pytest.approx(1.0) and r0[1]["median"] == pytest.approx(2.1)
    assert r0[1]["calls"] == 3 and rows[0]["ok"] and not rows[1]["ok"]
    assert rows[1]["per_g"][2]["efficiency"] is None  # a wrong call there: no efficiency, not in the mean
    avg = E.average_efficiency(rows, [1, 2])
    assert avg["d"][2]["mean"] == pytest.approx(0.8) and avg["d"][2]["sizes"] == 1 and avg["s"][2]["mean"] == 1.0
    table = E.format_table(rows, [1, 2]).splitlines()
    assert table[0] == "| dtype | N | 1 GPU s | 1 GPU TFLOPS | 2 GPU s | 2 GPU TFLOPS | eff. 2 GPUs | checked |"
    assert all(x.count("|") == table[0].count("|") for x in table)
    assert table[2].endswith("| 0.800 | ok |") and table[3].endswith("| WRONG |")
    assert E.format_averages(avg, [1, 2])[0].startswith("double (d), 2 GPUs vs 1: mean 0.800 over 1 sizes")
    # a sweep without 1 GPU: efficiency against the smallest count
    rows = E.summarize([rec("d", 100, 2, 1.0), rec("d", 100, 4, 0.6)], [2, 4])
    assert rows[0]["per_g"][4]["efficiency"] == pytest.approx(2 * 1.0 / (4 * 0.6))
    assert E.efficiency_formula(2) == "2 T(2) / (g T(g))"


# --------------------------------------------------------------------------- the whole sweep on sim

def test_sweep_on_sim(tmp_path):
    rc = E.main(["--backend", "sim", "--n", "64:128:64", "--gpus", "1,2", "--runs", "2", "--tile", "32",
                 "--dtypes", "d,s", "--out", str(tmp_path)])
    assert rc == 0
    files = sorted(os.listdir(tmp_path))
    assert [f.split("-")[0] + "-" + f.split("-")[1] for f in files] == ["efficiency-sim", "efficiency-sim"]
    assert files[0].endswith(".json") and files[1].endswith(".md")
    data = json.load(open(tmp_path / files[0]))
    recs = data["records"]
    assert len(recs) == 2 * 2 * 2 * 3                     # dtypes x g x N x (warm-up + 2 runs)
    assert all(r["ok"] and r["in_place"] for r in recs)
    assert [(r["gpus"], r["n"]) for r in recs[:6]] == [(1, 64)] * 3 + [(1, 128)] * 3   # ordered by g, then N
    assert {r["devices"] for r in recs} == {"sim:1", "sim:2"}
    assert sum(r["warmup"] for r in recs) == 8
    assert all(len(r["profile"]["devices"]) == r["gpus"] for r in recs)
    assert data["pinning"].startswith("skipped") and data["registration"] == []
    assert set(data["averages"]) == {"d", "s"} and data["averages"]["d"]["2"]["sizes"] == 2
    assert all(r["per_g"]["2"]["efficiency"] > 0 for r in data["summary"])
    md = open(tmp_path / files[1]).read()
    assert md.startswith("# Parallel efficiency of blasx GEMM (sim, ")
    assert "python -m bench.efficiency --backend sim --n 64:128:64" in md
    assert "eff. 2 GPUs" in md and "T(1) / (g T(g))" in md and "Average efficiency" in md
    assert "C is not reset between calls" in md and "sim:0:" in md


def test_pin_context_off_and_non_cuda():
    ctx, note = E.pin_context([np.zeros(4)], "off", "cuda:0")
    assert "off" in note
    with ctx as reg:
        assert reg is None
    ctx, note = E.pin_context([np.zeros(4)], "auto", "sim:2")
    assert note == "skipped: devices sim:2 are not CUDA"


# --------------------------------------------------------------------------- memory and failures

@contextlib.contextmanager
def fake_registered(*arrays):
    class Reg:
        nbytes = sum(a.nbytes for a in arrays)
        seconds = 0.5
        unregister_seconds = 0.1
    yield Reg()


def test_sweep_keeps_no_reference_to_the_arrays(monkeypatch):
    monkeypatch.setattr(E, "pin_context", lambda arrays, mode, spec: (fake_registered(*arrays), None))
    args = E.parse_args(["--backend", "sim", "--n", "32,64", "--gpus", "1,2", "--runs", "1", "--tile", "32",
                         "--dtypes", "d,s"])
    report = E.new_report(args, [], "bench.efficiency")
    arrays = E.allocate(64, "d", 0)
    refs = [weakref.ref(x) for x in arrays.values()]
    E.sweep_dtype(blasx, args, "d", arrays, report)
    assert len(report["records"]) == 2 * 2 * 2 and all(r["ok"] for r in report["records"])
    assert report["pinning"].startswith("0.0 GiB registered once per dtype")
    assert report["registration"] == [{"dtype": "d", "gib": 3 * 64 * 64 * 8 / 2**30, "seconds": 0.5,
                                       "unregister_seconds": 0.1}]
    single = E.cast_arrays(arrays, "s")
    gc.collect()
    assert all(r() is None for r in refs)          # the float64 arrays are gone once cast
    assert single["c"].dtype == np.float32


def test_a_failing_sweep_still_writes_the_report(tmp_path):
    args = E.parse_args(["--backend", "sim", "--n", "32", "--gpus", "1", "--runs", "1", "--out", str(tmp_path)])
    report = E.new_report(args, [], "bench.efficiency")

    def sweep(blasx_, args_, dtype, arrays, rep):
        rep["records"].append({"dtype": dtype, "n": 32, "gpus": 1, "seconds": 0.1, "warmup": False, "ok": True})
        raise MemoryError("out of host memory")

    with pytest.raises(MemoryError):
        E.run_dtypes(args, report, sweep, E.write_report)
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2
    md = open(tmp_path / files[1]).read()
    assert "## Failures" in md and "MemoryError: out of host memory" in md


def test_contiguous_layout_shares_the_buffers_and_is_compact():
    arrs = E.allocate(40, "d", seed=4)
    a, b, c = E.views(arrs, 24, "contiguous")
    for x, k in zip((a, b, c), "abc"):
        assert x.shape == (24, 24) and x.flags.f_contiguous
        assert np.shares_memory(x, arrs[k])
        assert np.array_equal(x.ravel(order="F"), arrs[k].ravel(order="F")[:24 * 24])


def test_blasx_gemm_on_contiguous_layout_on_sim():
    blasx.configure(devices="sim:2", tile=16)
    arrs = E.allocate(64, "d", seed=5)
    before = {k: v.copy(order="F") for k, v in arrs.items()}
    a, b, c = E.views(arrs, 40, "contiguous")
    A, B, C = (x.copy() for x in (a, b, c))
    blasx.gemm(1.5, a, b, beta=0.5, c=c, overwrite_c=True)
    assert LC.rel_err(c, 1.5 * A @ B + 0.5 * C) < 1e-14
    tail = before["c"].ravel(order="F")[40 * 40:]
    assert np.array_equal(arrs["c"].ravel(order="F")[40 * 40:], tail)   # beyond the N x N array: untouched


# --------------------------------------------------------------------------- --model h200 (a prediction)

def test_model_prediction_writes_a_labelled_report(tmp_path, monkeypatch):
    monkeypatch.setenv("BLASX_KNOBS", "small_n_tiles=1")
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"summary": [{"dtype": "s", "n": 8192, "per_g": {
        "1": {"best": 0.04, "efficiency": 1.0}, "2": {"best": 0.03, "efficiency": 0.667}}}]}))
    out = tmp_path / "out"
    assert E.main(["--model", "h200", "--n", "8192", "--dtypes", "s", "--gpus", "1,2", "--runs", "1",
                   "--dilate", "1", "--issue", "0", "--measured", str(measured), "--out", str(out)]) == 0
    files = sorted(os.listdir(out))
    assert len(files) == 2 and files[0].startswith("efficiency-model-h200x2-") and files[0].endswith(".json")
    data = json.load(open(out / files[0]))
    assert data["kind"] == "prediction" and "PREDICTION" in data["statement"]
    assert data["knobs"]["small_n_tiles"] is True
    assert {(r["gpus"], r["tile"]) for r in data["records"]} == {(1, 3072), (2, 2048)}
    assert [sum(r["tasks"]) for r in data["records"]] == [9, 16]
    md = open(out / files[1]).read()
    assert "PREDICTION, NOT A MEASUREMENT" in md and "| s | 8192 |" in md and "0.667" in md


def test_model_small_n_rule_and_option_errors(capsys):
    args = E.parse_args(["--model", "h200", "--small-n", "256:1024:1"])
    assert args.small_n == (256, 1024, 1) and args.tag == "h200x2" and args.issue > 0
    for bad in (["--small-n", "512:2048"], ["--small-n", "a:b:c"], ["--issue", "1"], ["--dilate", "0.5"]):
        with pytest.raises(SystemExit):
            E.parse_args(["--model", "h200", *bad])
        assert "allowed" in capsys.readouterr().err
