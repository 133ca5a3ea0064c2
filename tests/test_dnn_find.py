"""The convolution find-db (blasx.dnn.finddb), the find step's logic (blasx.dnn.find, with a fake timer),
forward_form's precedence, the layer sets, ``blasx tune --conv`` without a GPU and Network.algos.

No GPU here: keys, storage and choices are pure; the timing runs through injected functions."""

from __future__ import annotations

import importlib
import json
import os
import sqlite3

import numpy as np
import pytest

import blasx
from blasx import cli, dnn, perfdb
from blasx.dnn import conv_direct as cd
from blasx.dnn import conv_sets, finddb
from blasx.dnn.finddb import ConvKey
from blasx.dnn.geometry import conv_geometry, transpose_geometry

find_mod = importlib.import_module("blasx.dnn.find")  # blasx.dnn.find is the function
H200 = "NVIDIA H200"
Z = np.zeros(())


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BLASX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BLASX_PERFDB", raising=False)
    monkeypatch.setattr(cd, "FORM", None)
    return tmp_path


def shapes(*s):
    return np.broadcast_to(Z, s)


def geo3x3(n=32, c=64, size=56):
    return conv_geometry("t", 2, shapes(n, c, size, size), shapes(c, c, 3, 3), 1, 1, 1, 1)


# --------------------------------------------------------------------------- keys

def test_key_text_by_exact_value_and_parse_round_trip():
    k = finddb.problem_key((32, 64, 56, 56), (64, 64, 3, 3), 1, 1, device="cuda:0 NVIDIA H200", dtype=np.float32)
    assert k == ConvKey(H200, "fwd", 32, 64, 64, (56, 56), (56, 56), (3, 3), (1, 1), (1, 1), (1, 1), 1, "nchw", "s",
                        "ieee")
    assert k.text == "NVIDIA H200|fwd|n32|c64|k64|i56x56|o56x56|r3x3|s1x1|p1x1|d1x1|g1|nchw|s|ieee"
    assert ConvKey.parse(k.text) == k
    k2 = finddb.problem_key((8, 256, 28, 28), (512, 128, 3, 3), 2, 1, 1, 2, direction="bwd-weight", device=H200,
                            dtype="h", layout="cl", math="tf32")
    assert k2.text == "NVIDIA H200|bwd-weight|n8|c256|k512|i28x28|o14x14|r3x3|s2x2|p1x1|d1x1|g2|cl|h|ieee"
    k3 = finddb.problem_key((4, 16, 100), (32, 16, 5), 1, 4, 2, direction="bwd-data", device=H200,
                            dtype=np.float32, math="tf32")
    assert k3.text == "NVIDIA H200|bwd-data|n4|c16|k32|i100|o100|r5|s1|p4|d2|g1|nchw|s|tf32"
    assert ConvKey.parse(k3.text) == k3 and k3.problem == k3[:2] + k3[3:]


def test_backward_data_gather_maps_back_to_its_forward_problem():
    """conv2d_input's transposed geometry (what forward_form sees) keys as the bwd-data of the forward conv."""
    t = transpose_geometry("t", 2, shapes(8, 256, 28, 28), shapes(256, 128, 4, 4), 2, 1, 0, 1, 1,
                           output_size=(8, 128, 56, 56))
    keys = finddb.runtime_keys(t, H200, np.float32, "nchw", "ieee")
    assert [k.text for k in keys] == \
        ["NVIDIA H200|bwd-data|n8|c128|k256|i56x56|o28x28|r4x4|s2x2|p1x1|d1x1|g1|nchw|s|ieee"]
    fwd = finddb.forward_geometry((8, 128, 56, 56), (256, 128, 4, 4), 2, 1, 1, 1, "s")
    assert find_mod.runtime_geometry(fwd, "bwd-data") == t
    # stride 1: the gather is a forward problem too; both keys decide it, the forward's first
    keys = finddb.runtime_keys(geo3x3(), H200, np.float32, "nchw", "ieee")
    assert [k.direction for k in keys] == ["fwd", "bwd-data"] and keys[0][2:] == keys[1][2:]


@pytest.mark.parametrize("kwargs, fragment", [
    ({"direction": "bwd"}, "direction: got 'bwd'"),
    ({"layout": "nhwc"}, "layout: got 'nhwc'"),
    ({"dtype": np.int8}, "dtype: got"),
    ({"math": "fast"}, "math: got 'fast'"),
])
def test_bad_key_arguments_are_named(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        finddb.problem_key((2, 8, 9, 9), (8, 8, 3, 3), device=H200, **kwargs)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="weight: expected weight.shape\\[1\\] == 8"):
        finddb.problem_key((2, 8, 9, 9), (8, 3, 3, 3), device=H200)
    with pytest.raises(ValueError, match="x_shape"):
        finddb.problem_key((2, -8, 9, 9), (8, 8, 3, 3), device=H200)
    with pytest.raises(ValueError, match="key: got 'x|y'"):
        ConvKey.parse("x|y")


# --------------------------------------------------------------------------- storage and lookup

def test_store_and_lookup_round_trip_with_the_nearest_batch(cache):
    k = finddb.problem_key((32, 64, 56, 56), (64, 64, 3, 3), 1, 1, device=H200)
    finddb.store(k, "im2col", {"im2col": 0.002, "shifted": 0.003})
    [e] = finddb.entries()
    assert e["key"] == k and e["form"] == "im2col" and e["seconds"] == {"im2col": 0.002, "shifted": 0.003}
    assert finddb.lookup(k) == "im2col"
    assert finddb.lookup(k._replace(n=20)) == "im2col"  # nearest batch
    finddb.store(k._replace(n=8), "shifted", {"im2col": 0.002, "shifted": 0.001})
    assert finddb.lookup(k._replace(n=8)) == "shifted" and finddb.lookup(k._replace(n=12)) == "shifted"
    assert finddb.lookup(k._replace(n=16)) == "im2col"  # 16 is as near to 8 as to 32 (log scale): the larger
    assert finddb.lookup(k._replace(layout="cl")) is None and finddb.lookup(k._replace(device="other")) is None
    assert perfdb.PerfDb().clear() == 2 and finddb.lookup(k) is None


def test_lookup_reloads_when_the_file_changes(cache):
    k = finddb.problem_key((32, 64, 56, 56), (64, 64, 3, 3), 1, 1, device=H200)
    finddb.store(k, "im2col", {"im2col": 0.002})
    assert finddb.lookup(k) == "im2col"
    path = perfdb.default_path()
    with sqlite3.connect(path) as conn:  # another process's write: no generation bump here
        conn.execute("UPDATE conv_entries SET form = 'shifted'")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert finddb.lookup(k) == "shifted"


def test_store_rejects_bad_entries(cache):
    k = finddb.problem_key((2, 8, 9, 9), (8, 8, 3, 3), device=H200)
    with pytest.raises(ValueError, match="form: got 'fft'"):
        finddb.store(k, "fft", {"fft": 1.0})
    with pytest.raises(ValueError, match="seconds: got"):
        finddb.store(k, "im2col", {"shifted": 1.0})
    with pytest.raises(ValueError, match="seconds: got"):
        finddb.store(k, "im2col", {"im2col": float("nan")})
    assert finddb.entries() == []


def test_a_perfdb_file_without_the_conv_table_reads_empty_and_takes_entries(cache):
    path = perfdb.default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as conn:  # as a blasx before the find-db wrote it
        conn.execute("CREATE TABLE schema (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO schema VALUES (1)")
    assert finddb.entries() == []
    k = finddb.problem_key((2, 8, 9, 9), (8, 8, 3, 3), device=H200)
    finddb.store(k, "im2col", {"im2col": 1.0})
    assert [e["form"] for e in finddb.entries()] == ["im2col"]


# --------------------------------------------------------------------------- forward_form's precedence

def test_forward_form_precedence_force_then_db_then_heuristic(cache, monkeypatch):
    geo, f32 = geo3x3(), np.float32
    assert cd.forward_form(geo, f32, device=H200) == "winograd"  # the heuristic (strict float32 3x3)
    finddb.store(finddb.key_of(geo, "fwd", H200, f32), "shifted", {"im2col": 2.0, "shifted": 1.0})
    assert cd.forward_form(geo, f32, device=H200) == "shifted"  # the db over the heuristic
    assert cd.forward_form(geo, f32, "im2col", device=H200) == "im2col"  # a force over the db
    assert cd.forward_form(geo, f32, device="NVIDIA A100") == "winograd"  # another GPU model: no entry
    assert cd.forward_form(geo, f32, layout="cl", device=H200) == "winograd"  # another layout
    assert cd.forward_form(geo, f32) == "winograd"  # no CuPy here: no GPU, no entry
    monkeypatch.setenv("BLASX_PERFDB", "off")
    assert cd.forward_form(geo, f32, device=H200) == "winograd"
    monkeypatch.delenv("BLASX_PERFDB")
    assert cd.forward_form(geo, f32, device=H200) == "shifted"
    small = geo3x3(c=8)  # the heuristic's im2col; a bwd-data entry of the same gather decides it
    fwd = finddb.forward_of_transposed(small)
    finddb.store(finddb.key_of(fwd, "bwd-data", H200, f32), "shifted", {"im2col": 2.0, "shifted": 1.0})
    assert cd.forward_form(small, f32, device=H200) == "shifted"
    strided = conv_geometry("t", 2, shapes(32, 64, 56, 56), shapes(64, 64, 3, 3), 2, 1, 1, 1)
    finddb.store(finddb.key_of(strided, "fwd", H200, f32), "im2col", {"im2col": 1.0})
    assert cd.forward_form(strided, f32, "shifted", device=H200) == "im2col"  # shifted does not apply


def test_weight_form_precedence_force_then_db_then_im2col(cache):
    from blasx.dnn import weight_forms as wf
    geo, f32 = geo3x3(), np.float32
    assert wf.weight_form(geo, f32, layout="cl", device=H200) == "winograd"  # no entry: the heuristic
    finddb.store(finddb.key_of(geo, "bwd-weight", H200, f32, "cl"), "shifted", {"im2col": 2.0, "shifted": 1.0})
    assert wf.weight_form(geo, f32, layout="cl", device=H200) == "shifted"  # the db's
    assert cd.forward_form(geo, f32, layout="cl", device=H200) == "winograd"  # (the forward's heuristic, not that entry)
    finddb.store(finddb.key_of(geo, "fwd", H200, f32, "cl"), "shifted", {"im2col": 2.0, "shifted": 1.0})
    assert cd.forward_form(geo, f32, layout="cl", device=H200) == "shifted"
    finddb.store(finddb.key_of(geo, "fwd", H200, f32, "cl"), "im2col", {"im2col": 1.0, "shifted": 2.0})
    assert wf.weight_form(geo, f32, layout="cl", device=H200) == "shifted"  # a forward entry does not decide it
    assert wf.weight_form(geo, f32, "im2col", "cl", device=H200) == "im2col"  # a force over the db
    assert wf.weight_form(geo, f32, layout="nchw", device=H200) == "winograd"  # the cl entry: not NCHW's
    assert wf.weight_form(geo, f32, layout="cl", device="NVIDIA A100") == "winograd"  # another GPU model
    pw = conv_geometry("t", 2, shapes(32, 64, 7, 7), shapes(64, 64, 1, 1), 1, 0, 1, 1)  # every stored form counts
    for form in ("batched", "im2col"):
        finddb.store(finddb.key_of(pw, "bwd-weight", H200, f32), form, {"im2col": 1.0, "batched": 1.0})
        assert wf.weight_form(pw, f32, device=H200) == form
    finddb.store(finddb.key_of(geo, "bwd-weight", H200, f32), "im2col", {"im2col": 1.0, "winograd": 2.0})
    assert wf.weight_form(geo, f32, device=H200) == "im2col"


def test_strided_form_precedence_force_then_db_then_default(cache, monkeypatch):
    """A strided transposed call (a strided backward-data) runs as forced, else as the find-db's entry for the
    backward-data problem it is says, else as phases.preferred says (col2im on 7x7 inputs)."""
    from blasx.dnn import conv_transpose as conv
    monkeypatch.setattr(finddb, "gpu_name", lambda ordinal=None: H200)
    t, f32 = transpose_geometry("t", 2, shapes(8, 64, 7, 7), shapes(64, 32, 3, 3), 2, 1, 1, 1, 1), np.float32
    assert conv._strided_form(t, f32, "cl", None) == "col2im"  # no entry
    finddb.store(finddb.key_of(finddb.forward_of_transposed(t), "bwd-data", H200, f32, "cl"), "phases",
                 {"col2im": 2.0, "phases": 1.0})
    assert conv._strided_form(t, f32, "cl", None) == "phases"  # the db's
    assert conv._strided_form(t, f32, "nchw", None) == "col2im"  # another layout's problem
    big = transpose_geometry("t", 2, shapes(8, 64, 28, 28), shapes(64, 32, 3, 3), 2, 1, 1, 1, 1)
    assert conv._strided_form(big, f32, "cl", None) == "phases"  # no entry, preferred
    finddb.store(finddb.key_of(finddb.forward_of_transposed(big), "bwd-data", H200, f32, "cl"), "col2im",
                 {"col2im": 1.0, "phases": 2.0})
    assert conv._strided_form(big, f32, "cl", None) == "col2im"  # the db's over the default
    monkeypatch.setattr(cd, "FORM", "col2im")
    assert conv._strided_form(t, f32, "cl", None) == "col2im"  # a force over the db


# --------------------------------------------------------------------------- the find step's logic

def fake(times: dict, results: dict):
    """call(form) and timer(run) stand-ins: the result of each form, and its time as the timer's."""
    last = []

    def call(form):
        last.append(form)
        return results[form]

    def timer(run):
        run()
        return times[last[-1]]
    return call, timer


def test_measure_chooses_the_fastest_correct_form():
    ref = np.arange(1.0, 7.0)
    call, timer = fake({"im2col": 2.0, "shifted": 1.0}, {"im2col": ref, "shifted": ref + 1e-9})
    r = find_mod.measure(("im2col", "shifted"), call, timer, 3, 1e-6)
    assert r["form"] == "shifted" and r["bad"] == [] and r["best"] == {"im2col": 2.0, "shifted": 1.0}
    assert r["seconds"]["shifted"] == [1.0, 1.0, 1.0] and r["errors"]["im2col"] == 0.0


def test_measure_rejects_a_form_whose_result_differs():
    ref = np.arange(1.0, 7.0)
    call, timer = fake({"im2col": 2.0, "shifted": 1.0}, {"im2col": ref, "shifted": ref * 1.5})
    r = find_mod.measure(("im2col", "shifted"), call, timer, 2, 1e-6)
    assert r["form"] == "im2col" and r["bad"] == ["shifted"] and r["errors"]["shifted"] > 0.1
    nan = np.full(6, np.nan)
    call, timer = fake({"im2col": 2.0, "shifted": 1.0}, {"im2col": ref, "shifted": nan})
    assert find_mod.measure(("im2col", "shifted"), call, timer, 1, 1e-6)["form"] == "im2col"
    call, timer = fake({"im2col": 1.0, "shifted": 1.0}, {"im2col": ref, "shifted": ref})
    assert find_mod.measure(("im2col", "shifted"), call, timer, 1, 1e-6)["form"] == "im2col"  # a tie: the first


def test_measure_reports_a_form_that_raises_and_times_the_others():
    """A form whose call raises (a kernel that does not build, a device error) is failed and bad, with its
    exception as text; the next working form is the reference; no form working: no winner."""
    ref = np.arange(1.0, 7.0)
    call, timer = fake({"im2col": 2.0, "shifted": 1.0, "winograd": 0.5}, {"im2col": ref, "shifted": ref + 1e-9})

    def failing(form):
        if form == "winograd":
            raise RuntimeError("nvrtc: no kernel")
        return call(form)
    r = find_mod.measure(("winograd", "im2col", "shifted"), failing, timer, 2, 1e-6)
    assert r["failed"] == {"winograd": "RuntimeError: nvrtc: no kernel"} and r["bad"] == ["winograd"]
    assert r["form"] == "shifted" and r["errors"]["im2col"] == 0.0 and r["errors"]["shifted"] < 1e-6
    assert set(r["errors"]) == set(r["best"]) == {"im2col", "shifted"}
    r = find_mod.measure(("winograd",), failing, timer, 1, 1e-6)
    assert r["form"] is None and r["bad"] == ["winograd"]


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_entry_points_are_the_public_functions(nd):
    assert find_mod.entry_points(nd) == tuple(getattr(dnn, f"conv{nd}d{s}") for s in ("", "_input", "_weight"))


def test_forms_per_direction():
    geo = finddb.forward_geometry((8, 64, 56, 56), (64, 64, 3, 3), 1, 1, 1, 1, "s")
    assert find_mod.forms_for(geo, "fwd") == ("im2col", "shifted", "winograd")  # strict float32 3x3 stride 1
    assert find_mod.forms_for(geo, "bwd-data") == ("im2col", "shifted", "winograd")
    assert find_mod.forms_for(geo, "bwd-weight") == ("im2col", "winograd")  # NCHW
    assert find_mod.forms_for(geo, "bwd-weight", layout="cl") == ("im2col", "shifted", "winograd")
    assert find_mod.forms_for(geo, "bwd-weight", np.float32, "cl", "tf32") == ("im2col", "shifted")
    strided = finddb.forward_geometry((8, 64, 56, 56), (64, 64, 3, 3), 2, 1, 1, 1, "s")
    assert find_mod.forms_for(strided, "fwd") == ("im2col",) and find_mod.forms_for(strided, "bwd-data") == ("im2col",)
    dw = finddb.forward_geometry((8, 64, 56, 56), (64, 1, 3, 3), 1, 1, 1, 64, "s")
    assert all(find_mod.forms_for(dw, d) == ("depthwise",) for d in finddb.DIRECTIONS)
    pw = finddb.forward_geometry((8, 64, 56, 56), (256, 64, 1, 1), 1, 0, 1, 1, "s")
    assert find_mod.forms_for(pw, "bwd-weight") == ("im2col", "batched")  # NCHW
    assert find_mod.forms_for(pw, "bwd-weight", layout="cl") == ("im2col",)


def test_find_without_a_gpu_says_so_and_stores_nothing(cache, monkeypatch):
    monkeypatch.setattr(blasx.session, "_cuda_count", lambda: 0)
    with pytest.raises(find_mod.NoGpuError, match="CUDA GPU, and CuPy finds none.*nothing was measured"):
        dnn.find((2, 8, 9, 9), (8, 8, 3, 3), padding=1)
    with pytest.raises(ValueError, match="direction: got 'up'"):  # bad input first
        dnn.find((2, 8, 9, 9), (8, 8, 3, 3), direction="up")
    with pytest.raises(ValueError, match="runs: got 0"):
        dnn.find((2, 8, 9, 9), (8, 8, 3, 3), runs=0)
    assert finddb.entries() == []


# --------------------------------------------------------------------------- layer sets and the CLI

def test_layer_sets():
    res = conv_sets.problems("resnet50", 16)
    assert len(res) == 23 and res[2] == {"name": "layer1.0.conv2", "x_shape": (16, 64, 56, 56),
                                         "weight_shape": (64, 64, 3, 3), "stride": 1, "padding": 1, "dilation": 1,
                                         "groups": 1, "direction": "fwd"}
    [t] = conv_sets.problems("transposed4x4", 8, ("fwd", "bwd-weight"))
    assert (t["x_shape"], t["weight_shape"], t["direction"]) == ((8, 128, 56, 56), (256, 128, 4, 4), "bwd-data")
    both = conv_sets.problems("layer4.1.conv2,depthwise3x3", 4, ("fwd", "bwd-data", "bwd-weight"))
    assert [(p["name"], p["direction"]) for p in both][:2] == [("layer4.1.conv2", "fwd"),
                                                               ("layer4.1.conv2", "bwd-data")]
    assert len(both) == 6 and both[3]["groups"] == 384
    with pytest.raises(ValueError, match="'resnet18' is not"):
        conv_sets.problems("resnet18")


def test_layer_set_from_json(tmp_path):
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps([{"x": [None, 64, 28, 28], "weight": [64, 64, 3, 3], "padding": [1, 1]}]))
    [p] = conv_sets.problems(str(path), 8)
    assert p["x_shape"] == (8, 64, 28, 28) and p["padding"] == (1, 1) and p["name"] == "shapes.json[0]"


@pytest.mark.parametrize("items, fragment", [
    ([{"x": 5, "weight": [8, 4, 3, 3]}], "item 0: 'x' must be a list of sizes, got 5"),
    ([{"x": [1, 4, 8, 8], "weight": None}], "item 0: 'weight' must be a list of sizes, got None"),
    ([{"x": [1, 4, 8, 8], "weight": [8, 4, 3, 3], "strides": 2, "pading": 1}],
     "item 0: unknown key(s) 'pading', 'strides'; allowed: dilation, groups, name, padding, stride, weight, x"),
    ([], "names no layer"),
])
def test_a_json_layer_set_is_checked_key_by_key(tmp_path, items, fragment):
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps(items))
    with pytest.raises(ValueError) as e:
        conv_sets.problems(str(path), 8)
    assert fragment in str(e.value)
    with pytest.raises(ValueError, match="',' names no layer"):
        conv_sets.problems(",", 8)


def test_cli_tune_conv_without_a_gpu_exits_1_with_a_message(capsys, cache, monkeypatch):
    monkeypatch.setattr(blasx.session, "_cuda_count", lambda: 0)
    assert cli.main(["tune", "--conv", "resnet50"]) == 1
    err = capsys.readouterr().err
    assert "blasx tune: error: the find step times convolutions on a CUDA GPU, and CuPy finds none" in err
    assert finddb.entries() == []


@pytest.mark.parametrize("bad, status", [(None, 0), ("wrong", 1), ("unstored", 1)])
def test_cli_tune_conv_status_counts_col2im_problems_as_done(capsys, cache, monkeypatch, bad, status):
    """A (dilated) strided backward-data problem runs col2im alone and stores nothing by design: not a failure. A
    form whose result differs, or a storable problem left unstored, is one (exit 1)."""
    monkeypatch.setattr(find_mod, "_gpu", lambda device: 0)
    monkeypatch.setattr(finddb, "gpu_name", lambda ordinal: "Test GPU")

    def fake_find(x_shape, weight_shape, *, direction, **kw):
        alone = direction == "bwd-data" and kw["stride"] != 1 and kw["stride"] != (1, 1)
        r = dict(forms=["col2im"] if alone else ["im2col"], best={"col2im" if alone else "im2col": 1e-3}, bad=[],
                 failed={}, form="col2im" if alone else "im2col", storable=not alone, stored=not alone)
        if bad == "wrong" and not alone:
            r["bad"] = ["im2col"]
        if bad == "unstored" and not alone:
            r["stored"] = False
        return r
    monkeypatch.setattr(find_mod, "find", fake_find)
    assert cli.main(["tune", "--conv", "layer2.0.conv2,layer2.0.conv1", "--direction", "bwd-data"]) == status
    out = capsys.readouterr().out
    if bad is None:
        assert "stored 1 of 2 entries" in out and "(1 dilated strided backward-data problem(s) run col2im alone" in out


@pytest.mark.parametrize("argv, fragment", [
    (["--conv", "resnet18"], "argument --conv: 'resnet18' is not"),
    (["--conv", "resnet50", "--dtype", "z"], "argument --dtype: got 'z'"),
    (["--conv", "resnet50", "--direction", "up"], "argument --direction: got 'up'"),
    (["--conv", "resnet50", "--tiles", "64"], "--tiles tune GEMM tiles"),
])
def test_cli_tune_conv_bad_options(capsys, argv, fragment):
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", *argv])
    assert e.value.code == 2 and fragment in capsys.readouterr().err


def test_cli_show_lists_the_find_db(capsys, cache):
    k = finddb.problem_key((32, 64, 56, 56), (64, 64, 3, 3), 1, 1, device=H200)
    finddb.store(k, "shifted", {"im2col": 0.002, "shifted": 0.001})
    assert cli.main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert f"{k.text}  shifted  im2col 2.000 ms  shifted 1.000 ms*" in out


# --------------------------------------------------------------------------- Network's record

def test_network_records_each_convs_algorithm(cache):
    torch = pytest.importorskip("torch")
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
                            torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.Conv2d(64, 64, 3, padding=1, groups=64),
                            torch.nn.Conv2d(64, 64, 3, stride=2))
    net = dnn.from_torch(m, (1, 3, 16, 16)).compile(dtype=np.float32)
    assert set(net.algo.values()) == {"engine"}  # no GPU here: the host engine runs the layers
    assert "algo=engine" in net.summary()
    names = list(net.algo)
    assert net.algos(device=H200) == dict(zip(names, ["im2col", "winograd", "depthwise", "im2col"]))
    geo = conv_geometry("t", 2, shapes(1, 64, 16, 16), shapes(64, 64, 3, 3), 1, 1, 1, 1)
    # (the NCHW network's 3x3 runs channels-last on the device: its entry is the channels-last problem's)
    finddb.store(finddb.key_of(geo, "fwd", H200, np.float32, "cl"), "shifted", {"im2col": 2.0, "shifted": 1.0})
    assert net.algos(device=H200)[names[1]] == "shifted"
    assert net.algos((5, 3, 16, 16), device=H200)[names[1]] == "shifted"  # the nearest batch


def test_store_names_a_key_that_is_not_a_conv_key(tmp_path):
    """The key's text (or any non-tuple) is named (ConvKey(*text) gave a TypeError about 70 arguments)."""
    db = perfdb.PerfDb(tmp_path / "db.sqlite")
    with pytest.raises(TypeError, match="key: got str; need a ConvKey"):
        finddb.store("H200|fwd|s|ieee|nchw", "im2col", {"im2col": 1.0}, db)
    assert finddb.entries(db) == []
