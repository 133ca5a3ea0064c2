"""CPU-only tests of the GEMM benchmark driver (bench/gemm.py and its gemm_problem.py,
gemm_contenders.py, gemm_table.py) and of the cuBLAS-XT layout planning (bench/cublasxt.py):
argument parsing, summaries, tables, markdown, the run loop with fake contenders, and the
column-major call plan checked by a NumPy emulation of cuBLAS. Nothing here needs a GPU or
imports CuPy."""

import itertools
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import gemm as G  # noqa: E402
from bench import gemm_contenders as GC  # noqa: E402
from bench import gemm_lp  # noqa: E402
from bench import gemm_problem as GP  # noqa: E402
from bench import gemm_table as GT  # noqa: E402
from bench.cublasxt import (  # noqa: E402
    CUBLAS_OP_C, CUBLAS_OP_N, CUBLAS_OP_T, CUBLAS_STATUS, _check, plan_gemm,
)


# --------------------------------------------------------------------------- arguments

def test_defaults():
    args = G.parse_args([])
    assert args.n == [16384] and args.runs == 3 and args.warmup == 1
    assert args.dtypes == ["d", "s"] and args.modes == ["registered", "pageable"]
    assert args.contenders == ["blasx", "cublasxt", "cupy", "numpy"]
    assert args.xt_blocks == [2048, 4096, 8192] and args.xt_pinning == "auto"
    assert args.numpy_max_n == 8192 and args.gpus is None and args.tile is None
    assert args.alpha == 1.5 and args.beta == 0.5 and args.seed == 0
    assert args.sizes == [(16384, 16384, 16384)]
    assert args.out == os.path.join("bench", "results") and args.tag


def test_the_lead_command_line():
    args = G.parse_args("--n 16384 --dtypes d,s --gpus 2 --runs 3 "
                        "--modes registered,pageable --out bench/results".split())
    assert args.n == [16384] and args.dtypes == ["d", "s"] and args.gpus == [0, 1]
    assert args.runs == 3 and args.modes == ["registered", "pageable"]


def test_lists_sizes_and_tags():
    args = G.parse_args(["--n", "1024,2048", "--m", "512", "--k", "256", "--dtypes", "Z,c,z",
                         "--gpus", "1,0", "--xt-blocks", "1024", "--beta", "0",
                         "--tag", "my box/1", "--contenders", "blasx,cupy"])
    assert args.sizes == [(512, 1024, 256), (512, 2048, 256)]
    assert args.dtypes == ["z", "c"]             # lower-cased, duplicates dropped
    assert args.gpus == [1, 0] and args.xt_blocks == [1024] and args.beta == 0
    assert args.tag == "my_box_1" and args.contenders == ["blasx", "cupy"]
    assert G.parse_args(["--gpus", "1,"]).gpus == [1]
    assert G.parse_args(["--gpus", "1"]).gpus == [0]


def test_quick_defaults_and_explicit_values_win():
    q = G.parse_args(["--quick"])
    assert q.n == list(G.QUICK_N) and q.runs == G.QUICK_RUNS
    assert q.xt_blocks == list(G.QUICK_XT_BLOCKS)
    q = G.parse_args(["--quick", "--n", "4096", "--runs", "5", "--xt-blocks", "2048"])
    assert q.n == [4096] and q.runs == 5 and q.xt_blocks == [2048]


def test_complex_scalars_only_with_complex_dtypes():
    args = G.parse_args(["--dtypes", "z", "--alpha", "1.5+0.5j"])
    assert args.alpha == complex(1.5, 0.5)
    assert GP.typed_scalar(args.alpha, "z") == complex(1.5, 0.5)
    assert GP.typed_scalar(complex(2), "d") == 2.0 and isinstance(GP.typed_scalar(2, "s"), float)
    with pytest.raises(SystemExit):
        G.parse_args(["--dtypes", "d,z", "--alpha", "1+1j"])


@pytest.mark.parametrize("argv", [
    ["--dtypes", "q"], ["--modes", "pinned"], ["--n", "0"], ["--n", "x"], ["--runs", "0"],
    ["--gpus", "0"], ["--gpus", "a"], ["--gpus", "0,0"], ["--contenders", "magma"],
    ["--xt-pinning", "maybe"], ["--warmup", "-1"], ["--m", "0"], ["--alpha", "one"],
])
def test_bad_arguments_exit(argv, capsys):
    with pytest.raises(SystemExit):
        G.parse_args(argv)
    assert "usage" in capsys.readouterr().err


def test_help_runs_without_a_gpu():
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-m", "bench.gemm", "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--xt-blocks" in res.stdout


def test_importing_does_not_import_cupy():
    code = "import sys, bench.gemm, bench.cublasxt; assert 'cupy' not in sys.modules"
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=60)


# --------------------------------------------------------------------------- numbers

def test_flops_tflops_tolerance():
    assert GP.flop_count("d", 2, 3, 4) == 48 and GP.flop_count("z", 2, 3, 4) == 192
    assert GP.tflops("s", 1000, 1000, 1000, 1e-3) == pytest.approx(2.0)
    assert GP.tflops("s", 10, 10, 10, None) is None and GP.tflops("s", 10, 10, 10, 0.0) is None
    assert GP.tolerance("s", 4096) == 1e-4 and GP.tolerance("d", 8192) == 1e-10
    assert GP.tolerance("c", 32768) == pytest.approx(2e-4)


def test_random_matrix_is_f_ordered_seeded_and_complex():
    rng = lambda: np.random.default_rng([0, 1])  # noqa: E731
    x = GP.random_matrix(rng(), 37, 23, np.complex64)
    assert x.flags.f_contiguous and x.dtype == np.complex64 and x.shape == (37, 23)
    assert np.all(np.abs(x.real) <= 1) and np.abs(x.imag).max() > 0
    assert np.array_equal(x, GP.random_matrix(rng(), 37, 23, np.complex64))


def test_rel_error_chunked_matches_numpy():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((300, 70))
    res = (ref + 1e-6 * rng.standard_normal(ref.shape)).astype(np.float32)
    expect = np.linalg.norm(res.astype(np.float64) - ref) / np.linalg.norm(ref)
    assert GP.rel_error(res, ref, GP.frobenius(ref)) == pytest.approx(expect, rel=1e-9)
    bad = res.copy()
    bad[3, 4] = np.nan
    assert math.isnan(GP.rel_error(bad, ref, 1.0))
    assert GP.rel_error(None, ref, 1.0) == math.inf
    assert GP.rel_error(res[:, :5], ref, 1.0) == math.inf


# --------------------------------------------------------------------------- fake records

def rec(label, mode, seconds, err=1e-15, ok=True, dtype="d", n=1000, run=0, contender=None,
        variant=None, failure=None, warmup=False, extra=None):
    contender = contender or label.split("[")[0].split("+")[0]
    return GT.Record(label, contender, variant, mode, dtype, n, n, n, run, seconds, err, ok,
                    failure, warmup, extra or {})


PROFILE = {"wall": 0.08, "tflops": 20.0, "host": {"pin_seconds": 0.03},
           "totals": {"bytes_h2d": 2**31, "bytes_d2h": 2**30, "bytes_p2p": 0, "l1_hits": 5,
                      "l2_hits": 1, "misses": 8, "steals": 2},
           "devices": [{"name": "cuda:0", "tasks": 4, "busy": 0.08, "comm": 0.01, "idle": 0.01},
                       {"name": "cuda:1", "tasks": 4, "busy": 0.07, "comm": 0.02, "idle": 0.01}]}


def fake_records():
    out = []
    for mode in ("pageable", "registered"):
        for i, t in enumerate((0.12, 0.10, 0.11)):
            extra = {"profile": PROFILE} if t == 0.10 else {}
            out.append(rec("blasx", mode, t, run=i, extra=extra))
            out.append(rec("cublasxt[b=4096]", mode, t * 2, run=i, variant=4096))
            out.append(rec("cublasxt[b=512]", mode, t * 3, run=i, variant=512))
            out.append(rec("cupy", mode, 0.08, run=i))
            out.append(rec("cupy+copies", mode, 0.3, run=i, contender="cupy"))
        out.append(rec("blasx", mode, 9.0, run=-1, warmup=True))           # ignored
    out.append(rec("numpy", "pageable", 1.0, err=0.5, ok=False))            # WRONG
    out.append(rec("blasx", "pageable", None, err=None, ok=False, dtype="s",
                   failure="RuntimeError: boom"))                             # FAILED
    return out


def test_summarize_best_median_status_and_order():
    rows = GT.summarize(fake_records())
    keys = [(r.dtype, r.mode, r.label) for r in rows]
    assert keys[:5] == [("d", "registered", "blasx"), ("d", "registered", "cublasxt[b=512]"),
                        ("d", "registered", "cublasxt[b=4096]"), ("d", "registered", "cupy"),
                        ("d", "registered", "cupy+copies")]
    assert keys[-1] == ("s", "pageable", "blasx")    # dtypes in the order they ran
    bx = next(r for r in rows if r.label == "blasx" and r.mode == "registered")
    assert bx.runs == 3 and bx.best == 0.10 and bx.median == 0.11 and bx.status == "ok"
    assert bx.tflops_best == pytest.approx(2e9 / 0.10 / 1e12)
    assert bx.best_extra["profile"]["tflops"] == 20.0
    wrong = next(r for r in rows if r.label == "numpy")
    assert wrong.status == "WRONG" and wrong.error == 0.5
    failed = rows[-1]
    assert failed.status == "FAILED" and failed.best is None and failed.runs == 0
    assert failed.failure == "RuntimeError: boom"


def test_ratios():
    rows = GT.summarize(fake_records())
    ratios = {r["mode"]: r for r in GT.compute_ratios(rows, n_gpus=2)}
    reg = ratios["registered"]
    assert reg["xt_label"] == "cublasxt[b=4096]"
    assert reg["blasx_over_xt_best"] == pytest.approx(2.0)
    assert reg["blasx_over_xt_median"] == pytest.approx(2.0)
    assert reg["blasx_over_cupy_x_gpus_best"] == pytest.approx(0.08 / 0.10 / 2)
    assert set(ratios) == {"registered", "pageable"}     # the failed s case has none
    lines = GT.format_ratios(GT.compute_ratios(rows, 2))
    assert any("blasx / cuBLAS-XT (b=4096): 2.00x best" in x for x in lines)
    assert any("(in-core cupy x 2 GPUs): 0.40 best" in x for x in lines)


def test_text_table():
    rows = GT.summarize(fake_records())
    table = GT.format_table(rows)
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["contender", "mode", "dtype", "N"]
    assert set(lines[1]) <= {"-", " "}
    assert len(lines) == 2 + len(rows)
    assert len(lines[0]) <= len(lines[1])                         # header over its rule
    assert any("cublasxt[b=4096] *" in x for x in lines)          # the best block is marked
    assert not any("cublasxt[b=512] *" in x for x in lines)
    blasx = next(x for x in lines if x.startswith("blasx ") and "registered" in x)
    assert "0.1000" in blasx and "0.1100" in blasx and "0.02" in blasx and blasx.endswith("ok")
    assert any(x.rstrip().endswith("WRONG") for x in lines)
    failed = next(x for x in lines if "FAILED" in x)
    assert " - " in failed


def fake_report():
    rows = GT.summarize(fake_records())
    return {
        "tag": "h200x2", "date": "2025-01-01T00:00:00+00:00", "stamp": "20250101-000000",
        "command": "python -m bench.gemm --n 1000 --gpus 2",
        "config": {"alpha": complex(1.5), "beta": 0.5, "seed": 0, "runs": 3, "warmup": 1,
                   "modes": ["registered", "pageable"], "gpus": [0, 1], "xt_blocks": [512, 4096],
                   "xt_pinning": "auto", "tile": None},
        "env": {"host": "box", "cpu": "Xeon", "cpus": 64, "host_mem_gib": 256.0,
                "gpus": [{"id": 0, "name": "NVIDIA H200", "mem_gib": 139.8},
                         {"id": 1, "name": "NVIDIA H200", "mem_gib": 139.8}],
                "cuda_driver": "13.0", "cuda_runtime": "13.0", "cublas": "13.0.0",
                "libcublas": "/x/libcublas.so.13", "python": "3.12.3", "numpy": "2.1",
                "cupy": "14.0.0", "scipy": "1.14", "blasx": "0.1.0", "git_commit": "abc123"},
        "cases": [{"dtype": "d", "m": 1000, "n": 1000, "k": 1000,
                   "modes": {"registered": {"registration": {
                       "gib": 0.0224, "seconds": 0.01, "seconds_per_gib": 0.4464,
                       "unregister_seconds": 0.002}}}}],
        "records": [], "summary": rows, "ratios": GT.compute_ratios(rows, 2),
    }


def test_markdown():
    md = GT.format_markdown(fake_report())
    assert md.startswith("# GEMM benchmark: h200x2 2025-01-01")
    assert "```\npython -m bench.gemm --n 1000 --gpus 2\n```" in md
    assert "cuda:0 NVIDIA H200 (140 GiB)" in md and "CUDA driver 13.0" in md
    assert "alpha 1.5, beta 0.5" in md
    table = [x for x in md.splitlines() if x.startswith("|")]
    assert table[0].startswith("| contender | mode | dtype | N | best s |")
    assert table[1].startswith("| :-- | :-- | :-- | --: |")
    assert len(table) == 2 + len(fake_report()["summary"])
    assert all(x.count("|") == table[0].count("|") for x in table)
    assert "## Same-run ratios" in md and "## Host registration cost" in md
    assert "registered 0.02 GiB in 0.010 s (0.4464 s/GiB)" in md
    assert "## blasx profile of the best run" in md and "H2D 2.00 GiB" in md
    assert "call 0.100 s, engine 0.080 s (outside it 0.020 s), registering 0.030 s; H2D" in md
    assert "steals 2" in md and "cuda:1: 4 tasks busy 0.070" in md
    assert "## Failures" in md and "RuntimeError: boom" in md


def test_report_round_trips_through_json(tmp_path):
    report = fake_report()
    report["records"] = fake_records()
    json_path, md_path = G.write_outputs(report, str(tmp_path))
    assert os.path.basename(json_path) == "gemm-h200x2-20250101-000000.json"
    assert md_path.endswith(".md")
    data = json.loads(open(json_path).read())       # strict JSON: no NaN
    assert data["config"]["alpha"] == 1.5
    assert len(data["records"]) == len(fake_records())
    assert data["summary"][-1]["status"] == "FAILED"
    # the markdown can be regenerated from the JSON alone
    assert GT.format_markdown(data) == open(md_path).read()


def test_jsonable():
    out = G.jsonable({"a": np.float32(1.5), "b": float("nan"), "c": complex(1, 2),
                      "d": (1, np.int64(2)), "e": np.zeros(3), 4: complex(2, 0)})
    assert out == {"a": 1.5, "b": None, "c": "(1+2j)", "d": [1, 2],
                   "e": "<array (3,) float64>", "4": 2.0}
    json.dumps(out, allow_nan=False)


# --------------------------------------------------------------------------- the run loop (CPU)

class NumpyLike(GC.Contender):
    """A CPU contender: correct, or wrong, or raising."""

    def __init__(self, args, name, behaviour="ok"):
        super().__init__(args)
        self.name, self.behaviour, self.calls = name, behaviour, []

    def variants(self, p):
        return [1, 2] if self.name == "multi" else [None]

    def labels(self, variant):
        return [self.name if variant is None else f"{self.name}[{variant}]"]

    def run(self, p, variant):
        self.calls.append(variant)
        if self.behaviour == "raise":
            raise MemoryError("out of memory")
        res = p.alpha * (p.a @ p.b) + (p.beta * p.c_out if p.c_init is not None else 0)
        if self.behaviour == "wrong":
            res = res * (1 + 1e-6)
        return GC.Outcome({self.labels(variant)[0]: 0.01}, res)


@pytest.mark.parametrize("beta", ["0.5", "0"])
def test_run_mode_with_fake_contenders(beta):
    args = G.parse_args(["--quick", "--runs", "2", "--beta", beta, "--dtypes", "d"])
    p = GP.make_problem(args, "d", 40, 30, 20, [0])
    assert (p.c_init is None) == (beta == "0")
    p.ref = GC._reference_cpu(p, np.dtype(np.float64))
    p.ref_norm = GP.frobenius(p.ref)
    p.mode = "pageable"
    good, wrong = NumpyLike(args, "good"), NumpyLike(args, "wrong", "wrong")
    boom, multi = NumpyLike(args, "boom", "raise"), NumpyLike(args, "multi")
    records, skipped = G.run_mode(p, [good, wrong, boom, multi], args)
    assert skipped == {}
    assert len(good.calls) == 1 + 2 and len(multi.calls) == 2 * (1 + 2)
    assert len(boom.calls) == 1                        # failed in warm-up: not run again
    rows = {r.label: r for r in GT.summarize(records)}
    assert rows["good"].status == "ok" and rows["good"].runs == 2
    assert rows["good"].error < 1e-14
    assert rows["wrong"].status == "WRONG"
    assert rows["boom"].status == "FAILED" and "MemoryError" in rows["boom"].failure
    assert rows["multi[1]"].status == rows["multi[2]"].status == "ok"
    timed = [r for r in records if not r.warmup]
    order = [r.label for r in timed]
    assert sorted(order) == sorted(["good"] * 2 + ["wrong"] * 2 + ["multi[1]"] * 2
                                   + ["multi[2]"] * 2)


def test_pageable_runs_start_from_unpinned_arrays(monkeypatch):
    from blasx.runtime import hostmem
    released = []
    monkeypatch.setattr(hostmem.REGISTRY, "release", lambda x: released.append(x) or False)
    args = G.parse_args(["--quick", "--dtypes", "d"])
    p = GP.make_problem(args, "d", 40, 30, 20, [0])
    p.ref = GC._reference_cpu(p, np.dtype(np.float64))
    p.ref_norm = GP.frobenius(p.ref)
    for mode, expect in (("registered", []), ("pageable", [p.a, p.b, p.c_init, p.c_out])):
        p.mode = mode
        released.clear()
        G.execute(NumpyLike(args, "good"), None, p, 0)
        assert [id(x) for x in released] == [id(x) for x in expect]


def test_fresh_runs_get_new_input_arrays_of_the_same_values(monkeypatch):
    from blasx.runtime import hostmem
    released = []
    monkeypatch.setattr(hostmem.REGISTRY, "release", lambda x: released.append(x) or False)
    args = G.parse_args(["--quick", "--dtypes", "d", "--modes", "fresh"])
    assert args.modes == ["fresh"]
    p = GP.make_problem(args, "d", 40, 30, 20, [0])
    p.ref = GC._reference_cpu(p, np.dtype(np.float64))
    p.ref_norm = GP.frobenius(p.ref)
    p.mode = "fresh"
    a0, b0 = p.a, p.b
    (rec,) = G.execute(NumpyLike(args, "good"), None, p, 0)
    assert rec.ok and p.a is not a0 and p.b is not b0 and not np.shares_memory(p.a, a0)
    assert (p.a == a0).all() and (p.b == b0).all() and p.a.flags.f_contiguous == a0.flags.f_contiguous
    assert len(released) == 4  # blasx's registrations of the old arrays released first
    xt = GC.CublasXtContender(args)
    assert xt.pinning("fresh") and xt.pinning("pageable") and not xt.pinning("registered")


def test_host_bytes_count_the_fresh_copies():
    base = GP.host_bytes_needed("d", 100, 200, 300, 0.5, None)
    assert base == (100 * 300 + 300 * 200) * 8 + 2 * 100 * 200 * 8 + 100 * 200 * 8
    assert (GP.host_bytes_needed("d", 100, 200, 300, 0.5, None, fresh=True)
            == base + (100 * 300 + 300 * 200) * 8 + 100 * 200 * 8)


def test_schedule_is_shuffled_and_seeded():
    args = G.parse_args(["--runs", "4"])
    p = GP.make_problem(args, "s", 4, 4, 4, [0])
    p.mode = "registered"
    cs = [NumpyLike(args, name) for name in ("a", "b", "c", "multi")]
    first = [(c.name, v, r) for c, v, r in G.schedule(cs, p, 4, seed=0)]
    assert first == [(c.name, v, r) for c, v, r in G.schedule(cs, p, 4, seed=0)]
    assert len(first) == 4 * 5 and len(set(first)) == 20
    assert first != sorted(first, key=lambda x: (x[0], x[1] or 0, x[2]))
    assert first != [(c.name, v, r) for c, v, r in G.schedule(cs, p, 4, seed=1)]


def test_poison():
    args = G.parse_args(["--beta", "0"])
    p = GP.make_problem(args, "s", 3, 3, 3, [0])
    p.poison()
    assert np.isnan(p.c_out).all()
    args = G.parse_args([])
    p = GP.make_problem(args, "z", 3, 3, 3, [0])
    p.c_out[...] = 7
    p.poison()
    assert np.array_equal(p.c_out, p.c_init) and p.c_out is not p.c_init


# --------------------------------------------------------------------------- cuBLAS-XT planning

def emulate(plan, a, b, c, alpha, beta):
    """What cuBLAS would do with the plan on the raw memory of a, b, c (column-major)."""
    arrays = {"a": a, "b": b}
    first, second = arrays[plan.first], arrays[plan.second]

    def colmajor(arr, rows, cols, ld):
        item = arr.itemsize
        return np.lib.stride_tricks.as_strided(arr, shape=(rows, cols), strides=(item, ld * item))

    def op(code, x):
        return {CUBLAS_OP_N: x, CUBLAS_OP_T: x.T, CUBLAS_OP_C: x.conj().T}[code]

    ra, ca = (plan.m, plan.k) if plan.transa == CUBLAS_OP_N else (plan.k, plan.m)
    rb, cb = (plan.k, plan.n) if plan.transb == CUBLAS_OP_N else (plan.n, plan.k)
    A = colmajor(first, ra, ca, plan.lda)
    B = colmajor(second, rb, cb, plan.ldb)
    C = colmajor(c, plan.m, plan.n, plan.ldc)
    C[...] = alpha * (op(plan.transa, A) @ op(plan.transb, B)) + beta * C


def operand(rng, shape, order, dtype):
    x = rng.standard_normal(shape) + (1j * rng.standard_normal(shape) if dtype.kind == "c" else 0)
    if order == "S":        # strided column-major: a slice of a taller F array
        big = np.zeros((shape[0] + 3, shape[1]), dtype=dtype, order="F")
        big[:shape[0]] = x
        return big[:shape[0]]
    return np.array(x, dtype=dtype, order=order)


OPS = {0: lambda x: x, 1: lambda x: x.T, 2: lambda x: x.conj().T}


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_plan_gemm_matches_numpy_for_every_layout(dtype):
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(3)
    m, n, k = 5, 4, 3
    checked = 0
    for ta, tb, oa, ob, oc in itertools.product((0, 1, 2), (0, 1, 2), "CFS", "CFS", "CFS"):
        a = operand(rng, (m, k) if ta == 0 else (k, m), oa, dtype)
        b = operand(rng, (k, n) if tb == 0 else (n, k), ob, dtype)
        c = operand(rng, (m, n), oc, dtype)
        alpha, beta = (1.5 - 0.5j, 0.25 + 1j) if dtype.kind == "c" else (1.5, 0.25)
        expect = alpha * OPS[ta](a) @ OPS[tb](b) + beta * c
        try:
            plan = plan_gemm(a, b, c, ta, tb)
        except ValueError as e:
            # only conj-without-transpose cases may be refused, and only for complex
            assert dtype.kind == "c" and "conjugate" in str(e)
            continue
        emulate(plan, a, b, c, alpha, beta)
        np.testing.assert_allclose(c, expect, rtol=1e-12, atol=1e-12)
        checked += 1
    assert checked >= (243 if dtype.kind == "f" else 150)


def test_plan_gemm_row_major_swaps_operands():
    a = np.ones((6, 3), order="C")
    b = np.ones((3, 5), order="C")
    c = np.ones((6, 5), order="C")
    plan = plan_gemm(a, b, c)
    assert (plan.first, plan.second, plan.m, plan.n, plan.k) == ("b", "a", 5, 6, 3)
    assert (plan.transa, plan.transb, plan.lda, plan.ldb, plan.ldc) == (0, 0, 5, 3, 5)
    plan = plan_gemm(np.asfortranarray(a), np.asfortranarray(b), np.asfortranarray(c), "N", "n")
    assert (plan.first, plan.m, plan.n, plan.k) == ("a", 6, 5, 3)
    assert (plan.lda, plan.ldb, plan.ldc) == (6, 3, 6)


@pytest.mark.parametrize("bad, message", [
    (dict(a=np.ones((3, 3), np.float32)), "dtypes differ"),
    (dict(a=np.ones((3, 3), np.int64), b=np.ones((3, 3), np.int64),
          c=np.ones((3, 3), np.int64)), "unsupported dtype"),
    (dict(a=np.ones((3, 4))), "shape mismatch"),
    (dict(a=np.ones(3)), "2-D"),
    (dict(a=np.ones((6, 6))[::2, ::2]), "memory layout"),
    (dict(a=[[1.0]]), "numpy.ndarray"),
    (dict(trans_a="X"), "trans"),
])
def test_plan_gemm_errors(bad, message):
    kw = dict(a=np.ones((3, 3)), b=np.ones((3, 3)), c=np.ones((3, 3)), trans_a=0, trans_b=0)
    kw.update(bad)
    with pytest.raises((TypeError, ValueError), match=message):
        plan_gemm(**kw)
    ro = np.ones((3, 3))
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        plan_gemm(np.ones((3, 3)), np.ones((3, 3)), ro)


def test_status_names():
    _check(0, "ok")
    with pytest.raises(RuntimeError, match="cublasXtDgemm failed: CUBLAS_STATUS_ALLOC_FAILED"):
        _check(3, "cublasXtDgemm")
    with pytest.raises(RuntimeError, match="unknown cublasStatus_t 99"):
        _check(99, "x")
    assert CUBLAS_STATUS[7] == "CUBLAS_STATUS_INVALID_VALUE"


def test_half_random_matrices_are_float32_draws_rounded_once():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dt in (np.float16, ml_dtypes.bfloat16):
        a = GP.random_matrix(np.random.default_rng(3), 70, 50, dt)
        (g,) = np.random.default_rng(3).spawn(1)  # one column chunk: the first spawned generator's draws
        x = g.random((70, 50), dtype=np.float32) * 2 - 1
        assert a.dtype == np.dtype(dt) and a.flags.f_contiguous
        assert np.array_equal(a.astype(np.float32), x.astype(dt).astype(np.float32))


def test_random_matrices_do_not_depend_on_the_thread_count(monkeypatch):
    """Chunk i comes from the i-th spawned generator: one thread or several, the same matrix (several chunks)."""
    from bench import level3_check
    many = GP.random_matrix(np.random.default_rng(5), 1 << 12, 3000, np.float32)
    monkeypatch.setattr(level3_check, "_threads", lambda: 1)
    one = GP.random_matrix(np.random.default_rng(5), 1 << 12, 3000, np.float32)
    assert len(GP._column_chunks(1 << 12, 3000)) > 2 and np.array_equal(many, one)
    assert not np.array_equal(many[:, :1024], many[:, 1024:2048])


def test_the_row_reference_is_the_float64_product():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(6)
    for dt in (np.float16, ml_dtypes.bfloat16, np.int8):
        a, b, c = (GP.random_matrix(rng, 300, 300, dt) for _ in range(3))
        rows = np.array([0, 3, 150, 299])
        want = 1.5 * a[rows].astype(np.float64) @ b.astype(np.float64) + 0.5 * c[rows].astype(np.float64)
        got = gemm_lp.sample_reference(a, b, rows, 1.5, 0.5, c, chunk=128)
        assert got.shape == (4, 300) and np.allclose(got, want, rtol=1e-12, atol=1e-12)
