"""CPU tests of bench/level3.py: options, arrays, the per-dtype checks, the cuBLAS-XT call table,
the tables, and the run loop itself on sim devices with cuBLAS-XT and page-locking replaced by
numpy stand-ins (nothing here needs a GPU or CuPy)."""

import contextlib
import ctypes
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import level3 as L  # noqa: E402

import blasx  # noqa: E402


# --------------------------------------------------------------------------- options

def test_defaults_and_dtypes():
    args = L.parse_args([])
    assert args.dtypes == ["d", "s"] and args.n == [8192, 16384] and args.routines == list(L.ROUTINES)
    args = L.parse_args(["--dtypes", "s", "--n", "32768", "--routines", "gemm,trsm"])
    assert args.dtypes == ["s"] and args.n == [32768] and args.routines == ["gemm", "trsm"]
    assert L.parse_dtypes(" d , s ,d") == ["d", "s"]


@pytest.mark.parametrize("argv, words", [
    (["--dtypes", "d,z"], ["--dtypes", "'d,z'", "s, d"]),
    (["--dtypes", ""], ["--dtypes", "''"]),
    (["--n", "0"], ["--n", "'0'", "positive"]),
    (["--routines", "gemm,gemv"], ["--routines", "'gemm,gemv'", "trsm"]),
    (["--runs", "-1"], ["--runs", "'-1'", "positive"]),
])
def test_bad_options_name_parameter_value_and_allowed(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        L.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err


def test_parse_dtypes_raises_value_error_outside_argparse():
    with pytest.raises(ValueError, match=r"--dtypes: got 'q'; allowed: a comma list of s, d"):
        L.parse_dtypes("q")


# --------------------------------------------------------------------------- arrays

def test_random_matrix_float32_is_the_float64_draws_cast():
    d = L.random_matrix(300, 600, np.float64, [1, 2], scale=0.5)
    s = L.random_matrix(300, 600, np.float32, [1, 2], scale=0.5)
    assert d.flags.f_contiguous and s.flags.f_contiguous and s.dtype == np.float32
    assert np.array_equal(d.astype(np.float32), s)
    assert np.array_equal(d, L.random_matrix(300, 600, np.float64, [1, 2], scale=0.5, threads=1))
    assert not np.array_equal(d, L.random_matrix(300, 600, np.float64, [1, 3], scale=0.5))
    assert 0.45 < d.std() < 0.55


def test_sample_rows_spread():
    r = L.sample_rows(1000, 64)
    assert len(r) == 64 and r[0] == 0 and r[-1] == 999 and np.all(np.diff(r) > 0)
    assert np.array_equal(L.sample_rows(10, 64), np.arange(10))
    assert np.array_equal(r, L.sample_rows(1000, 64))


def test_make_arrays_and_parallel_copy():
    A, B, C0, out = L.make_arrays(40, "s", seed=3)
    assert all(x.dtype == np.float32 and x.flags.f_contiguous for x in (A, B, C0, out))
    assert np.all(np.diag(A) > 3)
    L.parallel_copy(out, C0, threads=3)
    assert np.array_equal(out, C0)
    with pytest.raises(ValueError, match="shape"):
        L.parallel_copy(out[:3], C0)


def test_rows_times_chunks_and_strided_right():
    rng = np.random.default_rng(0)
    a = np.asfortranarray(rng.standard_normal((50, 70)).astype(np.float32))
    left = rng.standard_normal((5, 50))
    np.testing.assert_allclose(L.rows_times(left, a, width=7), left @ a.astype(np.float64), rtol=1e-12)
    b = np.asfortranarray(rng.standard_normal((70, 50)))
    np.testing.assert_allclose(L.rows_times(left, b.T, width=9), left @ b.T, rtol=1e-12)


def test_symmetric_and_triangular_rows():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((9, 9))
    rows = [0, 4, 8]
    sym = np.triu(a) + np.triu(a, 1).T
    assert np.array_equal(L.symmetric_rows(a, rows), sym[rows])
    assert np.array_equal(L.triu_rows(a, rows), np.triu(a)[rows])


# --------------------------------------------------------------------------- checks

def numpy_result(routine, A, B, C0, alpha, beta):
    """A correct result of each routine, in the arrays' dtype."""
    A64, B64, C64 = (x.astype(np.float64) for x in (A, B, C0))
    U = np.triu(A64)
    res = {"gemm": lambda: alpha * A64 @ B64 + beta * C64,
           "symm": lambda: alpha * (U + np.triu(A64, 1).T) @ B64 + beta * C64,
           "syrk": lambda: alpha * A64 @ A64.T + beta * C64,
           "syr2k": lambda: alpha * (A64 @ B64.T + B64 @ A64.T) + beta * C64,
           "trmm": lambda: alpha * U @ B64,
           "trsm": lambda: np.linalg.solve(U, alpha * B64)}[routine]()
    return np.asfortranarray(res.astype(A.dtype))


@pytest.mark.parametrize("dtype", ["d", "s"])
@pytest.mark.parametrize("routine", L.ROUTINES)
def test_check_accepts_right_and_catches_wrong(routine, dtype):
    n = 40
    A, B, C0, _ = L.make_arrays(n, dtype, seed=1)
    rows = L.sample_rows(n, 8)
    out = numpy_result(routine, A, B, C0, 1.5, 0.5)
    err = L.check(routine, A, B, C0, out, 1.5, 0.5, rows)
    assert err <= L.tolerance(dtype, n)
    assert err < (1e-13 if dtype == "d" else 1e-5)
    wrong = out.copy(order="F")
    i = rows[2]
    wrong[i, min(n - 1, i + 1)] += 0.05 * np.abs(out[i]).max() * 40  # upper triangle: seen by syrk too
    assert L.check(routine, A, B, C0, wrong, 1.5, 0.5, rows) > L.tolerance(dtype, n)
    wrong[...] = out
    wrong[i, :] = np.nan
    assert not L.check(routine, A, B, C0, wrong, 1.5, 0.5, rows) <= L.tolerance(dtype, n)


def test_tolerance_per_dtype():
    assert L.tolerance("d", 4096) == 1e-9 and L.tolerance("s", 8192) == 1e-4
    assert L.tolerance("s", 32768) == pytest.approx(2e-4)


@pytest.mark.parametrize("dtype", ["d", "s"])
def test_blasx_routines_on_sim_pass_the_check(dtype):
    blasx.configure(devices="sim:2", tile=16)
    n = 48
    A, B, C0, out = L.make_arrays(n, dtype, seed=2)
    rows = L.sample_rows(n, 12)
    for rt in L.ROUTINES:
        L.parallel_copy(out, C0 if rt in ("gemm", "symm", "syrk", "syr2k") else B)
        L.run_blasx(blasx, dtype, rt, n, A, B, C0, out, 1.5, 0.5)
        assert L.check(rt, A, B, C0, out, 1.5, 0.5, rows) <= L.tolerance(dtype, n), rt
        assert out.dtype == L.DTYPES[dtype]


# --------------------------------------------------------------------------- cuBLAS-XT table

def test_xt_symbols_scalars_and_argument_counts():
    assert L.xt_symbol("s", "gemm") == "cublasXtSgemm" and L.xt_symbol("d", "syr2k") == "cublasXtDsyr2k"
    al, be = L.xt_scalars("s", 1.5, 0.5)
    assert type(al) is ctypes.c_float and type(be) is ctypes.c_float and al.value == 1.5 and be.value == 0.5
    al, be = L.xt_scalars("d", 1.5, 0.5)
    assert type(al) is ctypes.c_double and al.value == 1.5
    for rt in L.ROUTINES:
        args = L.xt_args(rt, 7, 101, 102, 103, 104, 105)
        assert len(args) + 1 == len(L.XT_ARGTYPES[rt]), rt  # + the handle
        assert args.count(7) >= 3 and 105 in args and 101 in args
        assert (104 in args) == (rt not in ("trmm", "trsm"))  # beta only where the routine has one
    with pytest.raises(ValueError, match="dtype: got 'z'"):
        L.xt_symbol("z", "gemm")
    with pytest.raises(ValueError, match="routine: got 'gemv'"):
        L.xt_symbol("d", "gemv")


def test_blasx_routine_names():
    assert L.blasx_routine(blasx, "s", "syrk") is blasx.ssyrk
    assert L.blasx_routine(blasx, "d", "trsm") is blasx.dtrsm
    gemm = L.blasx_routine(blasx, "s", "gemm")
    assert gemm is getattr(blasx, "sgemm", blasx.gemm)


# --------------------------------------------------------------------------- tables

def fake_results():
    out = []
    for d, scale in (("d", 1.0), ("s", 2.0)):
        for rt, (bx, xt) in {"gemm": (0.10, 0.20), "syrk": (0.10, 0.125)}.items():
            for who, t in (("blasx", bx), ("cublasxt", xt)):
                for k, extra in ((1, 0.01), (2, 0.0)):
                    sec = (t + extra) / scale
                    out.append({"who": who, "routine": rt, "dtype": d, "n": 10000, "run": k, "seconds": sec,
                                "rel_err": 1e-12, "tflops": L.FLOPS[rt] * 1e12 / sec / 1e12,
                                "ok": not (d == "s" and rt == "syrk" and who == "cublasxt" and k == 1)})
    return out


def test_format_table_has_dtype_column_and_per_dtype_gemm_share():
    text = L.format_table(fake_results(), ["gemm", "syrk"], ["d", "s"])
    lines = text.splitlines()
    assert lines[0].startswith("| N | dtype | routine | blasx TFLOPS | cuBLAS-XT TFLOPS |")
    assert all(x.count("|") == lines[0].count("|") for x in lines)
    body = {x.split("|")[3].strip(): [c.strip() for c in x.split("|")[1:-1]] for x in lines[2:]}
    assert list(body) == ["dgemm", "dsyrk", "sgemm", "ssyrk"]
    assert body["dgemm"][1] == "d" and body["sgemm"][1] == "s"
    assert body["dgemm"][3] == "20.0" and body["dgemm"][4] == "10.0" and body["dgemm"][5] == "2.00x"
    assert body["sgemm"][3] == "40.0"                       # best of the runs, own dtype
    assert body["dsyrk"][6] == "0.50" and body["ssyrk"][6] == "0.50"   # vs the same dtype's GEMM
    assert body["dsyrk"][5] == "1.25x"
    assert body["ssyrk"][7] == "WRONG" and body["dsyrk"][7] == "ok"


def test_markdown_header_states_dtypes():
    report = {"tag": "t", "date": "2026-01-01 00:00:00", "command": "python -m bench.level3 --dtypes d,s",
              "machine": "box: 2x GPU", "dtypes": ["d", "s"], "runs": 2, "alpha": 1.5, "beta": 0.5,
              "table": L.format_table(fake_results(), ["gemm"], ["d", "s"])}
    md = L.format_markdown(report)
    first = md.splitlines()[0]
    assert first.startswith("# Level-3 routines: blasx vs cuBLAS-XT (t, ") and "double (d), single (s)" in first
    assert "1e-09 (d), 0.0001 (s)" in md and "| N | dtype | routine |" in md


# --------------------------------------------------------------------------- the run loop, without a GPU

class FakeXt:
    def __init__(self, gpus, block_dim):
        self.gpus, self.block_dim = gpus, block_dim

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@contextlib.contextmanager
def fake_registered(*arrays):
    class Reg:
        nbytes = sum(a.nbytes for a in arrays)
        seconds = 0.0
        unregister_seconds = 0.0
    yield Reg()


def numpy_xt(xt, dtype, routine, n, A, B, C0, out, alpha, beta):
    """cuBLAS-XT's effect on `out`, by numpy (out holds C0 for the C routines, B for TRMM/TRSM)."""
    assert isinstance(xt, FakeXt)
    al, be = L.xt_scalars(dtype, alpha, beta)
    assert type(al) is L.XT_SCALAR[dtype]
    if routine == "trsm":
        out[...] = numpy_result("trsm", A, out, C0, alpha, beta)
    elif routine == "trmm":      # out of place: C = alpha A B
        out[...] = numpy_result("trmm", A, B, C0, alpha, beta)
    else:
        out[...] = numpy_result(routine, A, B, out, alpha, beta)


def test_main_loop_on_sim_with_numpy_standins(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(L, "CublasXt", FakeXt)
    monkeypatch.setattr(L, "registered", fake_registered)
    monkeypatch.setattr(L, "run_xt", numpy_xt)
    rc = L.main(["--n", "40", "--dtypes", "d,s", "--runs", "1", "--devices", "sim:2", "--out", str(tmp_path),
                 "--tag", "cpu", "--routines", "gemm,symm,syrk,syr2k,trmm,trsm"])
    assert rc == 0
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2 and files[0].startswith("level3-cpu-") and files[0].endswith(".json")
    data = json.load(open(tmp_path / files[0]))
    res = data["results"]
    assert len(res) == 2 * 6 * 2 and all(r["ok"] for r in res)
    assert {r["dtype"] for r in res} == {"d", "s"} and {r["who"] for r in res} == {"blasx", "cublasxt"}
    assert data["dtypes"] == ["d", "s"] and len(data["registration"]) == 2
    md = open(tmp_path / files[1]).read()
    assert "double (d), single (s)" in md.splitlines()[0]
    assert "| 40 | s | ssyr2k |" in md and "WRONG" not in md


def test_main_records_a_failing_routine_and_goes_on(tmp_path, monkeypatch):
    def flaky_xt(xt, dtype, routine, *rest):
        if routine == "trmm":
            raise RuntimeError("cublasXtStrmm failed: CUBLAS_STATUS_ALLOC_FAILED")
        numpy_xt(xt, dtype, routine, *rest)

    monkeypatch.setattr(L, "CublasXt", FakeXt)
    monkeypatch.setattr(L, "registered", fake_registered)
    monkeypatch.setattr(L, "run_xt", flaky_xt)
    rc = L.main(["--n", "32", "--dtypes", "s", "--runs", "2", "--devices", "sim:2", "--out", str(tmp_path),
                 "--routines", "gemm,trmm"])
    assert rc == 1
    data = json.load(open(tmp_path / sorted(os.listdir(tmp_path))[0]))
    fails = [r for r in data["results"] if r.get("failure")]
    assert len(fails) == 1 and fails[0]["run"] == 0 and fails[0]["who"] == "cublasxt"   # tried once only
    assert sum(r["who"] == "blasx" and r["routine"] == "trmm" and r["ok"] for r in data["results"]) == 2
    md = open(tmp_path / sorted(os.listdir(tmp_path))[1]).read()
    assert "| 32 | s | strmm |" in md and "FAILED (cuBLAS-XT)" in md and "| 32 | s | sgemm |" in md
    assert "## Failures" in md and "CUBLAS_STATUS_ALLOC_FAILED" in md


def test_failed_rows_in_table():
    res = [{"who": "blasx", "routine": "gemm", "dtype": "d", "n": 8, "run": 0, "seconds": None, "rel_err": None,
            "tflops": None, "ok": False, "failure": "MemoryError: x"},
           {"who": "cublasxt", "routine": "gemm", "dtype": "d", "n": 8, "run": 1, "seconds": 0.1, "rel_err": 0.0,
            "tflops": 1.0, "ok": True}]
    line = L.format_table(res, ["gemm"], ["d"]).splitlines()[2]
    assert line == "| 8 | d | dgemm | - | 1.0 | - | - | FAILED (blasx) |"


def test_gpu_tag_names_the_model_and_count():
    assert L.gpu_tag(2, ["NVIDIA H200", "NVIDIA H200"]) == "h200x2"
    assert L.gpu_tag(1, ["NVIDIA H100 80GB HBM3"]) == "h100x1"
    assert L.gpu_tag(4, ["NVIDIA L40S"]) == "l40sx4"
    assert L.gpu_tag(1, []) == "gpux1"
