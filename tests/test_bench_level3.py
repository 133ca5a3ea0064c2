"""CPU tests of bench/level3.py and its level3_*.py modules: options, arrays, the per-dtype checks,
the cuBLAS-XT call table, the tables, and the run loop itself on sim devices with cuBLAS-XT and
page-locking replaced by numpy stand-ins (nothing here needs a GPU or CuPy)."""

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
from bench import level3_check as LC  # noqa: E402
from bench import level3_contenders as LX  # noqa: E402
from bench import level3_routines as LR  # noqa: E402
from bench import level3_table as LT  # noqa: E402
from bench import machine  # noqa: E402

import blasx  # noqa: E402
from blasx.runtime.dtypes import BY_PREFIX  # noqa: E402


# --------------------------------------------------------------------------- options

def test_defaults_and_dtypes():
    args = L.parse_args([])
    assert args.dtypes == ["d", "s"] and args.n == [8192, 16384] and args.routines == list(LR.ROUTINES)
    args = L.parse_args(["--dtypes", "s", "--n", "32768", "--routines", "gemm,trsm"])
    assert args.dtypes == ["s"] and args.n == [32768] and args.routines == ["gemm", "trsm"]
    assert L.parse_dtypes(" d , s ,d") == ["d", "s"]


@pytest.mark.parametrize("argv, words", [
    (["--dtypes", "d,q"], ["--dtypes", "'d,q'", "s, d, c, z", "complex128"]),
    (["--routines", "gemm,hemm", "--dtypes", "d,s"], ["--routines", "'gemm,hemm'", "hemm: c, z only", "'d,s'"]),
    (["--routines", "herk,her2k,trsm"],
     ["--routines", "'herk,her2k,trsm'", "herk, her2k: c, z only", "--dtypes is 'd,s'"]),
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


def test_complex_dtypes_and_default_routines_per_dtype():
    assert LR.ALL_ROUTINES == ("gemm", "symm", "hemm", "syrk", "herk", "syr2k", "her2k", "trmm", "trsm")
    assert LR.ROUTINES == ("gemm", "symm", "syrk", "syr2k", "trmm", "trsm")
    assert LR.HERMITIAN == ("hemm", "herk", "her2k")
    args = L.parse_args(["--dtypes", "z,c"])
    assert args.dtypes == ["z", "c"] and args.routines == list(LR.ALL_ROUTINES)   # default: + the Hermitian ones
    assert L.parse_args(["--dtypes", "d,z"]).routines == list(LR.ALL_ROUTINES)
    assert L.parse_args(["--dtypes", "s"]).routines == list(LR.ROUTINES)          # as before for real dtypes
    args = L.parse_args(["--n", "16384,32768", "--dtypes", "z,c", "--gpus", "1", "--runs", "1",
                         "--routines", "gemm,symm,hemm,syrk,herk,syr2k,her2k,trmm,trsm"])
    assert args.routines == list(LR.ALL_ROUTINES) and args.gpus == 1 and args.n == [16384, 32768]
    args = L.parse_args(["--dtypes", "d,z", "--routines", "herk,gemm"])          # mixed: herk for z only
    assert args.routines == ["herk", "gemm"]
    assert LR.routines_for("d", args.routines) == ["gemm"] and LR.routines_for("z", args.routines) == ["herk", "gemm"]


def test_dtype_and_routine_errors_outside_argparse():
    # parse_dtypes' default stays s, d: bench.efficiency's --dtypes takes it as is
    with pytest.raises(ValueError,
                       match=r"--dtypes: got 'z'; allowed: a comma list of s, d \(s = float32, d = float64\)"):
        L.parse_dtypes("z")
    assert L.parse_level3_dtypes("Z, c,z") == ["z", "c"]
    with pytest.raises(ValueError, match=r"--dtypes: got 'x'; allowed: a comma list of s, d, c, z \(.*c = complex64, "
                                         r"z = complex128\)"):
        L.parse_level3_dtypes("x")
    with pytest.raises(ValueError, match=r"--routines: got 'gemv'; allowed: .*hemm, herk, her2k: c, z only"):
        L.parse_routines("gemv")
    with pytest.raises(ValueError, match=r"--routines: got 'hemm,gemm'; hemm: c, z only, and --dtypes is 's'"):
        L.resolve_routines(["hemm", "gemm"], ["s"])


# --------------------------------------------------------------------------- arrays

def test_random_matrix_float32_is_the_float64_draws_cast():
    d = LC.random_matrix(300, 600, np.float64, [1, 2], scale=0.5)
    s = LC.random_matrix(300, 600, np.float32, [1, 2], scale=0.5)
    assert d.flags.f_contiguous and s.flags.f_contiguous and s.dtype == np.float32
    assert np.array_equal(d.astype(np.float32), s)
    assert np.array_equal(d, LC.random_matrix(300, 600, np.float64, [1, 2], scale=0.5, threads=1))
    assert not np.array_equal(d, LC.random_matrix(300, 600, np.float64, [1, 3], scale=0.5))
    assert 0.45 < d.std() < 0.55


def test_sample_rows_spread():
    r = LC.sample_rows(1000, 64)
    assert len(r) == 64 and r[0] == 0 and r[-1] == 999 and np.all(np.diff(r) > 0)
    assert np.array_equal(LC.sample_rows(10, 64), np.arange(10))
    assert np.array_equal(r, LC.sample_rows(1000, 64))


def test_make_arrays_and_parallel_copy():
    A, B, C0, out = LC.make_arrays(40, "s", seed=3)
    assert all(x.dtype == np.float32 and x.flags.f_contiguous for x in (A, B, C0, out))
    assert np.all(np.diag(A) > 3)
    LC.parallel_copy(out, C0, threads=3)
    assert np.array_equal(out, C0)
    with pytest.raises(ValueError, match="shape"):
        LC.parallel_copy(out[:3], C0)


def test_rows_times_chunks_and_strided_right():
    rng = np.random.default_rng(0)
    a = np.asfortranarray(rng.standard_normal((50, 70)).astype(np.float32))
    left = rng.standard_normal((5, 50))
    np.testing.assert_allclose(LC.rows_times(left, a, width=7), left @ a.astype(np.float64), rtol=1e-12)
    b = np.asfortranarray(rng.standard_normal((70, 50)))
    np.testing.assert_allclose(LC.rows_times(left, b.T, width=9), left @ b.T, rtol=1e-12)


def test_symmetric_and_triangular_rows():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((9, 9))
    rows = [0, 4, 8]
    sym = np.triu(a) + np.triu(a, 1).T
    assert np.array_equal(LC.symmetric_rows(a, rows), sym[rows])
    assert np.array_equal(LC.triu_rows(a, rows), np.triu(a)[rows])


def test_random_matrix_complex_parts_and_make_arrays():
    z = LC.random_matrix(30, 600, np.complex128, [1, 2], scale=0.5)
    c = LC.random_matrix(30, 600, np.complex64, [1, 2], scale=0.5)
    assert z.flags.f_contiguous and c.flags.f_contiguous and c.dtype == np.complex64
    assert np.array_equal(z.astype(np.complex64), c)
    assert np.array_equal(z.real, LC.random_matrix(30, 600, np.float64, [1, 2], scale=0.5))  # real parts: the d draws
    assert np.all(z.imag != 0) and 0.45 < z.imag.std() < 0.55 and not np.array_equal(z.real, z.imag)
    assert np.array_equal(z, LC.random_matrix(30, 600, np.complex128, [1, 2], scale=0.5, threads=1))
    for d in "zc":
        A, B, C0, out = LC.make_arrays(40, d, seed=3)
        assert all(x.dtype == BY_PREFIX[d].dtype and x.flags.f_contiguous for x in (A, B, C0, out))
        assert np.all(np.diag(A).real > 3) and all(np.all(x.real != 0) and np.all(x.imag != 0) for x in (A, B, C0))


def test_complex_rows_times_and_hermitian_rows():
    rng = np.random.default_rng(2)
    b = np.asfortranarray((rng.standard_normal((70, 50)) + 1j * rng.standard_normal((70, 50))).astype(np.complex64))
    left = rng.standard_normal((5, 50)) + 1j * rng.standard_normal((5, 50))
    b128 = b.astype(np.complex128)
    got = LC.rows_times(left, b.T, width=9)
    assert got.dtype == np.complex128
    np.testing.assert_allclose(got, left @ b128.T, rtol=1e-12)
    np.testing.assert_allclose(LC.rows_times_h(left, b, width=7), left @ b128.conj().T, rtol=1e-12)
    assert LC.rows_times(rng.standard_normal((2, 70)), b).dtype == np.complex128
    a = rng.standard_normal((9, 9)) + 1j * rng.standard_normal((9, 9))
    rows = [0, 4, 8]
    her = np.triu(a, 1) + np.triu(a, 1).conj().T + np.diag(np.diag(a).real)
    assert np.array_equal(LC.symmetric_rows(a, rows, hermitian=True), her[rows])
    assert np.array_equal(LC.symmetric_rows(a, rows), (np.triu(a) + np.triu(a, 1).T)[rows])   # csymm: no conjugate


# --------------------------------------------------------------------------- checks

def numpy_result(routine, A, B, C0, alpha, beta):
    """A correct result of each routine, in the arrays' dtype, from full matrices (float64 or
    complex128): HEMM's Hermitian matrix from A's upper triangle and the real part of its diagonal;
    HERK / HER2K with a real diagonal."""
    A64, B64, C64 = (x.astype(np.promote_types(x.dtype, np.float64)) for x in (A, B, C0))
    U = np.triu(A64)
    H = np.triu(A64, 1) + np.triu(A64, 1).conj().T + np.diag(np.diag(A64).real)
    res = {"gemm": lambda: alpha * A64 @ B64 + beta * C64,
           "symm": lambda: alpha * (U + np.triu(A64, 1).T) @ B64 + beta * C64,
           "hemm": lambda: alpha * H @ B64 + beta * C64,
           "syrk": lambda: alpha * A64 @ A64.T + beta * C64,
           "herk": lambda: alpha * A64 @ A64.conj().T + beta * C64,
           "syr2k": lambda: alpha * (A64 @ B64.T + B64 @ A64.T) + beta * C64,
           "her2k": lambda: alpha * A64 @ B64.conj().T + np.conj(alpha) * B64 @ A64.conj().T + beta * C64,
           "trmm": lambda: alpha * U @ B64,
           "trsm": lambda: np.linalg.solve(U, alpha * B64)}[routine]()
    if routine in ("herk", "her2k"):
        res[np.diag_indices(len(res))] = np.diag(res).real
    return np.asfortranarray(res.astype(A.dtype))


@pytest.mark.parametrize("routine, dtype", [(rt, d) for d in "dszc" for rt in LR.routines_for(d, LR.ALL_ROUTINES)])
def test_check_accepts_right_and_catches_wrong(routine, dtype):
    """The check passes numpy's result and catches one wrong element (imaginary for c and z) in the
    upper triangle (seen by the rank-k routines too), and a row of NaN."""
    n = 40
    A, B, C0, _ = LC.make_arrays(n, dtype, seed=1)
    rows = LC.sample_rows(n, 8)
    alpha, beta = LR.scalars(dtype, routine)
    out = numpy_result(routine, A, B, C0, alpha, beta)
    err = LC.check(routine, A, B, C0, out, alpha, beta, rows)
    assert err <= LC.tolerance(dtype, n)
    assert err < (1e-13 if dtype in "dz" else 1e-5)
    wrong = out.copy(order="F")
    i = rows[2]
    wrong[i, min(n - 1, i + 1)] += (0.05j if dtype in "cz" else 0.05) * np.abs(out[i]).max() * 40
    assert LC.check(routine, A, B, C0, wrong, alpha, beta, rows) > LC.tolerance(dtype, n)
    wrong[...] = out
    wrong[i, :] = np.nan
    assert not LC.check(routine, A, B, C0, wrong, alpha, beta, rows) <= LC.tolerance(dtype, n)


def test_complex_references_equal_numpy_on_every_row():
    """reference() against the full numpy computation, all rows, complex128: what each routine reads
    (the upper triangle; HEMM: no imaginary diagonal) and writes (HERK / HER2K: a real diagonal)."""
    n = 24
    A, B, C0, _ = LC.make_arrays(n, "z", seed=5)
    rows = np.arange(n)
    for rt in LR.ALL_ROUTINES:
        alpha, beta = LR.scalars("z", rt)
        ref = LC.reference(rt, A, B, C0, alpha, beta, rows)
        want = alpha * B if rt == "trsm" else numpy_result(rt, A, B, C0, alpha, beta)
        np.testing.assert_allclose(ref, want, rtol=0, atol=1e-12 * np.abs(want).max(), err_msg=rt)
    A2 = A.copy(order="F")
    A2[np.diag_indices(n)] += 3j        # HEMM does not read the imaginary part of A's diagonal ...
    al, be = LR.scalars("z", "hemm")
    assert np.array_equal(LC.reference("hemm", A2, B, C0, al, be, rows), LC.reference("hemm", A, B, C0, al, be, rows))
    assert not np.allclose(LC.reference("symm", A2, B, C0, al, be, rows),   # ... CSYMM/ZSYMM do
                           LC.reference("symm", A, B, C0, al, be, rows))


def test_complex_checks_tell_the_hermitian_routines_from_their_symmetric_twins():
    n = 40
    A, B, C0, _ = LC.make_arrays(n, "z", seed=4)
    rows = LC.sample_rows(n, 10)
    tol = LC.tolerance("z", n)
    for her, sym in (("hemm", "symm"), ("herk", "syrk"), ("her2k", "syr2k")):
        al, be = LR.scalars("z", her)
        assert LC.check(her, A, B, C0, numpy_result(sym, A, B, C0, al, be), al, be, rows) > tol, her
        al, be = LR.scalars("z", sym)
        assert LC.check(sym, A, B, C0, numpy_result(her, A, B, C0, al, be), al, be, rows) > tol, sym
    for rt in ("herk", "her2k"):   # a diagonal left with beta * Im(C0) fails
        al, be = LR.scalars("z", rt)
        out = numpy_result(rt, A, B, C0, al, be)
        out[np.diag_indices(n)] += 1j * be * np.diag(C0).imag
        assert LC.check(rt, A, B, C0, out, al, be, rows) > tol, rt
    al, be = LR.scalars("z", "her2k")   # alpha for conj(alpha) in the second term fails
    A64 = A.astype(np.complex128)
    bad = al * (A64 @ B.conj().T + B @ A64.conj().T) + be * C0
    bad[np.diag_indices(n)] = np.diag(bad).real
    assert LC.check("her2k", A, B, C0, np.asfortranarray(bad), al, be, rows) > tol


def test_scalars_per_dtype_and_routine():
    assert LR.scalars("d", "gemm") == (1.5, 0.5) and LR.scalars("s", "syrk") == (1.5, 0.5)
    assert LR.scalars("z", "gemm") == (1.5 - 0.5j, 0.5 + 0.25j) == LR.scalars("c", "trsm")
    assert LR.scalars("z", "hemm") == (1.5 - 0.5j, 0.5 + 0.25j)
    al, be = LR.scalars("c", "herk")
    assert (al, be) == (1.5, 0.5) and type(al) is float and type(be) is float        # BLAS: real alpha, beta
    al, be = LR.scalars("z", "her2k")
    assert al == 1.5 - 0.5j and be == 0.5 and type(be) is float                      # real beta
    assert {d: BY_PREFIX[d].flop_factor for d in "sdcz"} == {"s": 1, "d": 1, "c": 4, "z": 4}
    assert {r: LR.FLOPS[r] for r in LR.HERMITIAN} == {"hemm": 2, "herk": 1, "her2k": 2}


def test_tolerance_per_dtype():
    assert LC.tolerance("d", 4096) == 1e-9 and LC.tolerance("s", 8192) == 1e-4
    assert LC.tolerance("s", 32768) == pytest.approx(2e-4)


@pytest.mark.parametrize("dtype", ["d", "s", "z", "c"])
def test_blasx_routines_on_sim_pass_the_check(dtype):
    """Every routine of the dtype (the Hermitian ones for c and z), with its scalars, on 2 sims."""
    blasx.configure(devices="sim:2", tile=16)
    n = 48
    A, B, C0, out = LC.make_arrays(n, dtype, seed=2)
    rows = LC.sample_rows(n, 12)
    for rt in LR.routines_for(dtype, LR.ALL_ROUTINES):
        alpha, beta = LR.scalars(dtype, rt)
        LC.parallel_copy(out, C0 if rt in LR.C_ROUTINES else B)
        LX.run_blasx(blasx, dtype, rt, n, A, B, C0, out, alpha, beta)
        assert LC.check(rt, A, B, C0, out, alpha, beta, rows) <= LC.tolerance(dtype, n), rt
        assert out.dtype == BY_PREFIX[dtype].dtype


# --------------------------------------------------------------------------- cuBLAS-XT table

def test_xt_symbols_scalars_and_argument_counts():
    assert LX.xt_symbol("s", "gemm") == "cublasXtSgemm" and LX.xt_symbol("d", "syr2k") == "cublasXtDsyr2k"
    al, be = LX.xt_scalars("s", 1.5, 0.5)
    assert type(al) is ctypes.c_float and type(be) is ctypes.c_float and al.value == 1.5 and be.value == 0.5
    al, be = LX.xt_scalars("d", 1.5, 0.5)
    assert type(al) is ctypes.c_double and al.value == 1.5
    for rt in LR.ROUTINES:
        args = LX.xt_args(rt, 7, 101, 102, 103, 104, 105)
        assert len(args) + 1 == len(LX.XT_ARGTYPES[rt]), rt  # + the handle
        assert args.count(7) >= 3 and 105 in args and 101 in args
        assert (104 in args) == (rt not in ("trmm", "trsm"))  # beta only where the routine has one
    with pytest.raises(ValueError, match="dtype: got 'q'"):
        LX.xt_symbol("q", "gemm")
    with pytest.raises(ValueError, match="routine: got 'gemv'"):
        LX.xt_symbol("d", "gemv")


#: cublasXt.h: each level-3 entry point's parameters (the handle first); HEMM's are SYMM's, HERK's SYRK's,
#: HER2K's SYR2K's
XT_HEADER = {
    "gemm": "handle transa transb m n k alpha A lda B ldb beta C ldc",
    "symm": "handle side uplo m n alpha A lda B ldb beta C ldc",
    "hemm": "handle side uplo m n alpha A lda B ldb beta C ldc",
    "syrk": "handle uplo trans n k alpha A lda beta C ldc",
    "herk": "handle uplo trans n k alpha A lda beta C ldc",
    "syr2k": "handle uplo trans n k alpha A lda B ldb beta C ldc",
    "her2k": "handle uplo trans n k alpha A lda B ldb beta C ldc",
    "trmm": "handle side uplo trans diag m n alpha A lda B ldb C ldc",
    "trsm": "handle side uplo trans diag m n alpha A lda B ldb",
}
#: the scalars cublasXt.h declares real (const float* / const double*) in the C and Z routines
XT_HEADER_REAL = {"herk": ("alpha", "beta"), "her2k": ("beta",)}
XT_ENUMS = {"transa", "transb", "trans", "side", "uplo", "diag"}   # cublas*_t enums: int
XT_SIZES = {"m", "n", "k", "lda", "ldb", "ldc"}                    # size_t


def header_argtypes(routine):
    return [ctypes.c_int if p in XT_ENUMS else ctypes.c_size_t if p in XT_SIZES else ctypes.c_void_p
            for p in XT_HEADER[routine].split()]


def header_scalar_type(dtype, routine, which):
    """(precision, is complex) of the scalar `which` of cublasXt<dtype><routine>."""
    prec = ctypes.c_float if dtype in "sc" else ctypes.c_double
    return prec, dtype in "cz" and which not in XT_HEADER_REAL.get(routine, ())


def read_scalar(dtype, routine, which, address):
    prec, cplx = header_scalar_type(dtype, routine, which)
    vals = (prec * (2 if cplx else 1)).from_address(address)
    return complex(vals[0], vals[1]) if cplx else vals[0]


def test_xt_table_of_every_dtype_and_routine():
    names = {LX.xt_symbol(d, rt) for rt in LR.ALL_ROUTINES for d in LR.ROUTINE_DTYPES[rt]}
    assert {x for x in names if x[8] in "CZ" and x[9:] in LR.HERMITIAN} == {
        "cublasXtChemm", "cublasXtCherk", "cublasXtCher2k", "cublasXtZhemm", "cublasXtZherk", "cublasXtZher2k"}
    assert len(names) == 6 * 4 + 3 * 2
    assert [ctypes.sizeof(LX.xt_scalar_types(d)[0]) for d in "sdcz"] == [4, 8, 8, 16]
    assert [ctypes.sizeof(t) for t in LX.xt_scalar_types("z", "herk")] == [8, 8]  # HERK's real alpha, beta
    for rt in LR.ALL_ROUTINES:
        assert LX.XT_ARGTYPES[rt] == header_argtypes(rt), rt
        params = XT_HEADER[rt].split()[1:]
        args = LX.xt_args(rt, 7, 101, 102, 103, 104, 105)
        assert len(args) == len(params), rt
        got = dict(zip(params, args))
        assert got["alpha"] == 101 and got["A"] == 102 and got.get("beta", 104) == 104
        assert (got["B"] == 105) if rt == "trsm" else (got.get("B", 103) == 103 and got["C"] == 105)
        assert got.get("uplo") in (1, None) and all(got.get(p, 0) == 0 for p in ("side", "trans", "transa",
                                                                                   "transb", "diag"))
        assert all(v == 7 for p, v in got.items() if p in XT_SIZES)
        for d in "sdcz":
            if d not in LR.ROUTINE_DTYPES[rt]:
                with pytest.raises(ValueError,
                                   match=f"routine: got '{rt}' for dtype '{d}'; {rt} exists for dtypes c, z"):
                    LX.xt_symbol(d, rt)
                continue
            assert LX.xt_symbol(d, rt) == f"cublasXt{d.upper()}{rt}"
            alpha, beta = LR.scalars(d, rt)
            scal = LX.xt_scalars(d, alpha, beta, rt)
            assert tuple(type(x) for x in scal) == LX.xt_scalar_types(d, rt)
            for which, value, obj in zip(("alpha", "beta"), (alpha, beta), scal):
                prec, cplx = header_scalar_type(d, rt, which)
                if cplx:
                    assert isinstance(obj, ctypes.Structure) and [f[1] for f in obj._fields_] == [prec, prec]
                else:
                    assert type(obj) is prec
                assert read_scalar(d, rt, which, ctypes.addressof(obj)) == value, (d, rt, which)
    with pytest.raises(ValueError, match=r"alpha: got \(1.5-0.5j\); allowed: a real value for zherk"):
        LX.xt_scalars("z", 1.5 - 0.5j, 0.5, "herk")
    with pytest.raises(ValueError, match=r"beta: got \(0.5\+0.25j\); allowed: a real value for cher2k"):
        LX.xt_scalars("c", 1.5 - 0.5j, 0.5 + 0.25j, "her2k")


def test_blasx_routine_names():
    assert LX.blasx_routine(blasx, "s", "syrk") is blasx.ssyrk
    assert LX.blasx_routine(blasx, "d", "trsm") is blasx.dtrsm
    gemm = LX.blasx_routine(blasx, "s", "gemm")
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
                                "rel_err": 1e-12, "tflops": LR.FLOPS[rt] * 1e12 / sec / 1e12,
                                "ok": not (d == "s" and rt == "syrk" and who == "cublasxt" and k == 1)})
    return out


def test_format_table_has_dtype_column_and_per_dtype_gemm_share():
    text = LT.format_table(fake_results(), ["gemm", "syrk"], ["d", "s"])
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
    assert body["dsyrk"][7] == "0.50"                       # run by run: syrk over gemm, the lower of two runs
    assert body["ssyrk"][8] == "WRONG" and body["dsyrk"][8] == "ok"


def test_worst_share_pairs_runs_and_counts_failed_runs_as_zero():
    def rec(rt, k, tf, ok=True):
        return {"who": "blasx", "routine": rt, "dtype": "d", "n": 8, "run": k, "tflops": tf, "ok": ok}
    res = [rec("gemm", 1, 100.0), rec("gemm", 2, 80.0), rec("syrk", 1, 90.0), rec("syrk", 2, 76.0),
           rec("trmm", 1, 50.0), rec("trmm", 2, 79.0, ok=False), rec("trsm", 3, 70.0),
           {"who": "cublasxt", "routine": "syrk", "dtype": "d", "n": 8, "run": 1, "tflops": 1.0, "ok": True}]
    worst = LT.worst_share(res)
    assert worst == {(8, "d", "gemm"): 1.0, (8, "d", "syrk"): 0.9, (8, "d", "trmm"): 0.0}  # trsm: no run 3 GEMM


def test_markdown_header_states_dtypes():
    report = {"tag": "t", "date": "2026-01-01 00:00:00", "command": "python -m bench.level3 --dtypes d,s",
              "machine": "box: 2x GPU", "dtypes": ["d", "s"], "runs": 2, "alpha": 1.5, "beta": 0.5,
              "table": LT.format_table(fake_results(), ["gemm"], ["d", "s"])}
    md = LT.format_markdown(report)
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
    al, be = LX.xt_scalars(dtype, alpha, beta)
    assert type(al) is LX.xt_scalar_types(dtype)[0]
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
    # where blasx's time went: each device's shares of the call, which with its copying-alone time add up to 1
    for r in (r for r in res if r["who"] == "blasx"):
        assert len(r["devices"]) == 2 and sum(dev["tasks"] for dev in r["devices"]) > 0, r
        for dev in r["devices"]:
            assert abs(sum(dev[k] for k in ("busy", "comm", "lead", "gaps", "tail")) - 1) < 1e-6, dev
    assert all("devices" not in r for r in res if r["who"] == "cublasxt")
    assert "## Where blasx's time went" in md and "| 40 | dtrsm | sim:1 |" in md


class FakeXtLib:
    """cuBLAS-XT's level-3 entry points by numpy, on the host memory behind the pointers: a call
    checks its argtypes and flags against cublasXt.h (XT_HEADER), reads alpha and beta as the
    header's types, and writes C (B for TRSM; the upper triangle only for the rank-k updates)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if not name.startswith("cublasXt"):
            raise AttributeError(name)
        return FakeXtFn(self, name)


class FakeXtFn:
    def __init__(self, lib, name):
        self.lib, self.name, self.argtypes, self.restype = lib, name, None, None

    def __call__(self, handle, *args):
        d, rt = self.name[8].lower(), self.name[9:]
        assert handle == FakeXtSession._handle and d in LR.ROUTINE_DTYPES[rt], self.name
        assert self.argtypes == header_argtypes(rt) and self.restype is ctypes.c_int, self.name
        v = dict(zip(XT_HEADER[rt].split()[1:], args, strict=True))
        assert v.get("uplo", 1) == 1 and all(v.get(p, 0) == 0 for p in ("side", "trans", "transa", "transb", "diag"))
        n = v["n"]
        assert all(v[p] == n for p in XT_SIZES if p in v)
        dtype = BY_PREFIX[d].dtype

        def mat(p):
            buf = (ctypes.c_char * (n * n * dtype.itemsize)).from_address(p)
            return np.frombuffer(buf, dtype=dtype).reshape((n, n), order="F")

        alpha = read_scalar(d, rt, "alpha", v["alpha"])
        beta = read_scalar(d, rt, "beta", v["beta"]) if "beta" in v else 0.0
        A = mat(v["A"])
        B = mat(v["B"]) if "B" in v else A
        if rt == "trsm":
            B[...] = numpy_result("trsm", A, B, B, alpha, 0.0)
        else:
            C = mat(v["C"])
            res = numpy_result(rt, A, B, C, alpha, beta)
            if rt in ("syrk", "herk", "syr2k", "her2k"):
                C[np.triu_indices(n)] = res[np.triu_indices(n)]
            else:
                C[...] = res
        self.lib.calls.append(self.name)
        return 0


class FakeXtSession(FakeXt):
    """What bench.cublasxt.CublasXt gives run_xt: _lib (here FakeXtLib) and _handle."""
    _handle = 4242

    def __init__(self, lib, gpus=(0,), block_dim=8192):
        super().__init__(gpus, block_dim)
        self._lib = lib


@pytest.mark.parametrize("dtype", ["s", "d", "c", "z"])
def test_run_xt_calls_every_routine_as_the_header_declares(dtype):
    n = 24
    lib = FakeXtLib()
    xt = FakeXtSession(lib)
    A, B, C0, out = LC.make_arrays(n, dtype, seed=6)
    rows = np.arange(n)
    routines = LR.routines_for(dtype, LR.ALL_ROUTINES)
    for rt in routines:
        alpha, beta = LR.scalars(dtype, rt)
        LC.parallel_copy(out, C0 if rt in LR.C_ROUTINES else B)
        LX.run_xt(xt, dtype, rt, n, A, B, C0, out, alpha, beta)
        assert LC.check(rt, A, B, C0, out, alpha, beta, rows) < (1e-13 if dtype in "dz" else 1e-5), rt
    assert lib.calls == [f"cublasXt{dtype.upper()}{rt}" for rt in routines]


def table_rows(md):
    """The rows of the main table (not the per-device breakdown after it), by routine."""
    lines = [x for x in md.split("\n## ")[0].splitlines() if x.startswith("| ") and not x.startswith("| N ")]
    return {x.split("|")[3].strip(): [c.strip() for c in x.split("|")[1:-1]] for x in lines[1:]}


def test_main_loop_complex_on_sim_through_the_fake_library(tmp_path, monkeypatch):
    lib = FakeXtLib()
    monkeypatch.setattr(L, "CublasXt", lambda gpus, block_dim: FakeXtSession(lib, gpus, block_dim))
    monkeypatch.setattr(L, "registered", fake_registered)
    rc = L.main(["--n", "40", "--dtypes", "z,c", "--runs", "1", "--devices", "sim:2", "--out", str(tmp_path),
                 "--tag", "cpu", "--routines", "gemm,symm,hemm,syrk,herk,syr2k,her2k,trmm,trsm"])
    assert rc == 0
    js, md_path = sorted(tmp_path.iterdir())
    data = json.loads(js.read_text())
    res = data["results"]
    assert len(res) == 2 * 9 * 2 and all(r["ok"] for r in res)
    assert {(r["dtype"], r["routine"]) for r in res} == {(d, rt) for d in "zc" for rt in LR.ALL_ROUTINES}
    assert sorted(lib.calls) == sorted(f"cublasXt{d}{rt}" for d in "ZC" for rt in LR.ALL_ROUTINES for _ in range(2))
    for r in res:   # complex rates: 4x the real flops
        assert r["tflops"] == pytest.approx(4 * LR.FLOPS[r["routine"]] * 40**3 / r["seconds"] / 1e12)
    assert data["dtypes"] == ["z", "c"] and data["flop_factor"] == {"z": 4, "c": 4}
    assert data["scalars"]["z"]["gemm"] == [[1.5, -0.5], [0.5, 0.25]]
    assert data["scalars"]["c"]["herk"] == [1.5, 0.5] and data["scalars"]["z"]["her2k"] == [[1.5, -0.5], 0.5]
    md = md_path.read_text()
    assert "double complex (z), single complex (c)" in md.splitlines()[0]
    assert "alpha 1.5-0.5j, beta 0.5+0.25j (herk: alpha 1.5, beta 0.5; her2k: beta 0.5)" in md
    assert "1e-09 (z), 0.0001 (c)" in md and "complex128" in md and "WRONG" not in md
    body = table_rows(md)
    assert list(body) == [d + rt for d in "zc" for rt in LR.ALL_ROUTINES]
    assert all(row[5].endswith("x") and row[6] != "-" and row[7] != "-" and row[8] == "ok" for row in body.values())
    assert body["zgemm"][6] == "1.00" and body["cher2k"][1] == "c"


def test_main_mixed_dtypes_run_the_hermitian_routines_for_complex_only(tmp_path, monkeypatch):
    lib = FakeXtLib()
    monkeypatch.setattr(L, "CublasXt", lambda gpus, block_dim: FakeXtSession(lib, gpus, block_dim))
    monkeypatch.setattr(L, "registered", fake_registered)
    rc = L.main(["--n", "32", "--dtypes", "d,z", "--runs", "1", "--devices", "sim:2", "--out", str(tmp_path),
                 "--routines", "gemm,herk,trsm"])
    assert rc == 0
    data = json.loads(sorted(tmp_path.glob("*.json"))[0].read_text())
    assert {(r["dtype"], r["routine"]) for r in data["results"]} == {
        ("d", "gemm"), ("d", "trsm"), ("z", "gemm"), ("z", "herk"), ("z", "trsm")}
    assert all(r["ok"] for r in data["results"]) and data["routines"] == ["gemm", "herk", "trsm"]
    assert set(lib.calls) == {"cublasXtDgemm", "cublasXtDtrsm", "cublasXtZgemm", "cublasXtZherk", "cublasXtZtrsm"}
    md = sorted(tmp_path.glob("*.md"))[0].read_text()
    assert list(table_rows(md)) == ["dgemm", "dtrsm", "zgemm", "zherk", "ztrsm"]


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
    line = LT.format_table(res, ["gemm"], ["d"]).splitlines()[2]
    assert line == "| 8 | d | dgemm | - | 1.0 | - | - | - | FAILED (blasx) |"


def test_gpu_tag_names_the_model_and_count():
    assert machine.gpu_tag(2, ["NVIDIA H200", "NVIDIA H200"]) == "h200x2"
    assert machine.gpu_tag(1, ["NVIDIA H100 80GB HBM3"]) == "h100x1"
    assert machine.gpu_tag(4, ["NVIDIA L40S"]) == "l40sx4"
    assert machine.gpu_tag(1, []) == "gpux1"
