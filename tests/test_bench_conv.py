"""bench.conv on the CPU: the layer set, its arithmetic, and both modes end to end on sims with
torch on the CPU as the peer (blasx.dnn where it exists, else a torch stand-in)."""

from __future__ import annotations

import glob
import importlib
import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bench import conv as C  # noqa: E402
from bench import conv_layers as CL  # noqa: E402
from bench import report  # noqa: E402

SMALL = ["--devices", "sim:2", "--shrink", "16", "--batch", "2", "--reps", "1", "--warmup", "1", "--quiet"]
LAYERS = "conv1,layer2.0.conv2,layer3.0.conv3,depthwise3x3,dilated3x3,conv3d3x3x3,conv1d-k3,transposed4x4"


class StandIn:
    """blasx.dnn's functions done by torch on the CPU over numpy arrays (``scale`` spoils results,
    ``fail`` names a function that raises)."""

    def __init__(self, scale=1.0, fail=None):
        self.scale, self.fail = scale, fail

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        fn = getattr(torch.nn.grad if name.endswith(("_input", "_weight")) else torch.nn.functional, name)

        def call(*args, out=None):
            if name == self.fail:
                raise RuntimeError(f"{name} is not there")
            t = [_tensor(a) if isinstance(a, np.ndarray) else a for a in args]
            y = _array(fn(*t) * self.scale)
            if out is None:
                return y
            out[...] = y
            return out
        return call


def _tensor(a: np.ndarray):
    a = np.ascontiguousarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _array(t) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        from ml_dtypes import bfloat16
        return t.view(torch.int16).numpy().view(bfloat16)
    return t.numpy()


@pytest.fixture
def dnn():
    try:
        return importlib.import_module("blasx.dnn")
    except ImportError:
        return StandIn()


def _doc(folder, prefix):
    (path,) = glob.glob(str(folder / f"{prefix}-*.json"))
    with open(path, encoding="utf-8") as f:
        return json.load(f), path[:-5] + ".md"


def test_the_resnet50_table_has_its_23_distinct_shapes():
    layers = CL.resnet50_table(64)
    assert len(layers) == 23 and len({(x.c, x.k, x.size, x.kernel, x.stride, x.padding) for x in layers}) == 23
    assert sum(x.flops for x in layers if x.name.startswith("layer1.0")) == pytest.approx(
        2 * 64 * 56 * 56 * 64 * (64 + 64 * 9 + 256))
    assert all(x.family == "resnet50" and x.out_size == ((x.size[0] + 2 * x.padding[0] - x.kernel[0]) // x.stride[0] + 1,) * 2
               for x in layers)


def test_tracing_torchvision_gives_the_table():
    pytest.importorskip("torchvision")
    assert CL.trace_resnet50(64) == CL.resnet50_table(64)


def test_the_lowered_gemm_shapes_and_im2col_sizes():
    by = {x.name: x for x in CL.resnet50_table(64) + CL.own_layers(64)}
    s2 = by["layer2.0.conv2"]  # 128 -> 128, 3x3 stride 2 on 56x56: 28x28 out
    assert s2.y_shape == (64, 128, 28, 28)
    assert s2.gemm("fwd") == (128, 64 * 28 * 28, 128 * 9)
    assert s2.gemm("bwd-data") == (128, 64 * 56 * 56, 128 * 9)
    assert s2.gemm("bwd-weight") == (128, 128 * 9, 64 * 28 * 28)
    assert s2.col_elements("fwd") == 128 * 9 * 64 * 28 * 28 and s2.expanded_elements("fwd") == 64 * 128 * 56 * 56
    one = by["layer1.0.conv1"]
    assert one.direct and one.col_elements("fwd") == one.col_elements("bwd-data") == 0
    dw = by["depthwise3x3"]
    assert dw.gemm("fwd") == (1, 64 * 28 * 28, 9) and dw.w_shape == (384, 1, 3, 3)
    t = by["transposed4x4"]
    assert t.out_size == (56, 56) and t.w_shape == (256, 128, 4, 4) and t.directions == ("fwd",)
    assert t.flops == 2.0 * 64 * 256 * 28 * 28 * 128 * 16
    assert by["conv1d-k3"].y_shape == (64, 256, 2048) and by["conv3d3x3x3"].out_size == (8, 28, 28)


def test_shrink_keeps_groups_and_the_kernel():
    dw = CL.shrink(CL.own_layers(64)[0], 16)
    assert dw.groups == dw.c == dw.k == 24
    c1 = CL.shrink(CL.resnet50_table(64)[0], 64)
    assert c1.c == 1 and c1.k == 1 and c1.size == (7, 7) and c1.kernel == (7, 7)


def test_options_are_checked():
    with pytest.raises(SystemExit):
        C.parse_args(["--modes", "fp8"])
    with pytest.raises(SystemExit):
        C.parse_args(["--devices", "tpu"])
    args = C.parse_args(["--host"])
    assert args.batch == 512 and args.devices == "cuda:0,1" and args.modes == ["fp32", "tf32", "fp16"]
    with pytest.raises(SystemExit, match="nosuch"):
        C.select_layers(C.parse_args(["--layers", "resnet50,nosuch"]))


def test_geomeans_count_checked_layers_only():
    rows = [{"mode": "fp32", "direction": "fwd", "family": "resnet50", "status": "ok", "ratio": 0.5},
            {"mode": "fp32", "direction": "fwd", "family": "resnet50", "status": "ok", "ratio": 2.0},
            {"mode": "fp32", "direction": "fwd", "family": "own", "status": "FAIL", "ratio": 9.0}]
    r50, everything = C.geomeans(rows)
    assert r50["set"] == "ResNet-50" and r50["geomean"] == pytest.approx(1.0) and r50["goal_met"]
    assert everything["ok"] == 2 and everything["failed"] == 1 and not everything["goal_met"]


@pytest.mark.parametrize("layout", ["nchw", "channels-last"])
def test_device_mode_runs_every_direction_and_writes_its_files(tmp_path, dnn, layout):
    modes = "fp32,fp16,bf16" if layout == "nchw" else "tf32"
    assert C.main(SMALL + ["--modes", modes, "--layers", LAYERS, "--layout", layout, "--out", str(tmp_path)],
                  dnn=dnn) == 0
    doc, md = _doc(tmp_path, "conv")
    assert {(r["mode"], r["direction"]) for r in doc["rows"]} == {
        (m, d) for m in modes.split(",") for d in CL.DIRECTIONS}
    assert len(doc["rows"]) == len(modes.split(",")) * (7 * 3 + 1)
    assert all(r["status"] == "ok" and r["blasx_err"] <= r["tolerance"] for r in doc["rows"])
    assert "engine" in {r["form"] for r in doc["rows"]} <= {"engine", "phases"}  # sims: tile tasks (strided transposed: phases)
    assert {g["set"] for g in doc["geomeans"]} == {"ResNet-50", "all"}
    text = open(md, encoding="utf-8").read()
    assert "## Geometric means of blasx / cuDNN throughput" in text and "| transposed4x4 |" in text
    assert doc["peer"] == "torch on the CPU" and doc["layout"] == layout
    page = report.render(str(tmp_path))
    assert "## Convolution against cuDNN" in page and "| fp32 | bwd-weight | ResNet-50 |" in page.replace(
        "tf32", "fp32")


def test_weights_contiguous_beside_channels_last_activations(tmp_path, dnn):
    assert C.main(SMALL + ["--modes", "fp32", "--layers", "layer1.0.conv2,conv1", "--layout", "channels-last",
                           "--weight-layout", "nchw", "--out", str(tmp_path)], dnn=dnn) == 0
    doc, md = _doc(tmp_path, "conv")
    assert doc["weight_layout"] == "nchw" and all(r["status"] == "ok" for r in doc["rows"])
    assert "weights contiguous NCHW" in open(md, encoding="utf-8").read()


def test_a_wrong_result_is_a_fail_and_an_exception_an_error(tmp_path):
    args = SMALL + ["--modes", "fp32", "--layers", "layer3.0.conv3,conv1d-k3", "--out"]
    assert C.main(args + [str(tmp_path / "a")], dnn=StandIn(scale=1.01)) == 1
    doc, md = _doc(tmp_path / "a", "conv")
    assert {r["status"] for r in doc["rows"]} == {"FAIL"} and all(r["blasx_err"] > 1e-3 for r in doc["rows"])
    assert all(g["geomean"] is None and not g["goal_met"] for g in doc["geomeans"])
    assert "| FAIL |" in open(md, encoding="utf-8").read()
    assert C.main(args + [str(tmp_path / "b")], dnn=StandIn(fail="conv1d_weight")) == 1
    doc, md = _doc(tmp_path / "b", "conv")
    bad = [r for r in doc["rows"] if r["status"] != "ok"]
    assert [(r["layer"], r["direction"], r["status"]) for r in bad] == [("conv1d-k3", "bwd-weight", "ERROR")]
    assert "conv1d_weight is not there" in open(md, encoding="utf-8").read()
    assert "ERROR" in report.render(str(tmp_path / "b"))


@pytest.mark.parametrize("layout", ["nchw", "channels-last"])
def test_host_mode_runs_and_writes_its_files(tmp_path, dnn, layout):
    assert C.main(SMALL + ["--host", "--batch", "4", "--modes", "fp32,fp16", "--layout", layout, "--layers",
                           "layer1.0.conv2,conv1d-k3,transposed4x4", "--out", str(tmp_path)], dnn=dnn) == 0
    doc, md = _doc(tmp_path, "convhost")
    assert {(r["mode"], r["host_mode"]) for r in doc["rows"]} == {
        (m, h) for m in ("fp32", "fp16") for h in ("pinned", "pageable", "fresh")}
    assert all(r["status"] == "ok" and r["blasx_images_s"] > 0 and math.isfinite(r["ratio"]) for r in doc["rows"])
    assert len(doc["summary"]) == 6 and "goal 1.6x" in open(md, encoding="utf-8").read()
    assert "## Convolution from host memory" in report.render(str(tmp_path))


def test_a_peer_failure_is_an_error_and_the_run_goes_on(tmp_path, monkeypatch):
    def broken(*args, **kw):
        raise MemoryError("out of memory")
    monkeypatch.setattr(torch.nn.grad, "conv1d_input", broken)
    assert C.main(SMALL + ["--modes", "fp32", "--layers", "conv1d-k3", "--out", str(tmp_path)], dnn=StandIn()) == 1
    doc, _ = _doc(tmp_path, "conv")
    assert [(r["direction"], r["status"]) for r in doc["rows"]] == [
        ("fwd", "ok"), ("bwd-data", "ERROR"), ("bwd-weight", "ok")]
    assert doc["rows"][1]["error"] == "torch: MemoryError: out of memory"


def test_limit_names_a_host_bound_layer():
    """A layer short of the goal whose issue time reaches its call time is named host-bound first; a layer at
    the goal has no limit."""
    row = {"status": "ok", "ratio": 0.3, "gemm": [256, 50176, 512], "groups": 1, "cublas_tflops": None,
           "cudnn_tflops": 90.0, "expansion": 1.0, "blasx_s": 200e-6, "blasx_issue_s": 190e-6}
    assert C.limit_note(row) == "host-bound (190 us to issue a call)"
    assert C.limit_note({**row, "blasx_issue_s": 50e-6}) == "-"
    assert C.limit_note({**row, "blasx_device_allocs": 3}) == "host-bound (190 us to issue a call; 3 cudaMalloc in the timed calls)"
    assert C.limit_note({**row, "ratio": 0.9}) == ""
    short = {**row, "blasx_issue_s": 50e-6, "expansion": 9.0}
    assert C.limit_note({**short, "form": "im2col"}) == "im2col 9.0x its input"
    assert C.limit_note({**short, "form": "channels-last copies+implicit"}) == \
        "NCHW operands copied to channels-last and back; the implicit kernel's tile loads"
    assert C.limit_note({**short, "form": "shifted"}) == "-"  # no col buffer: no lowered-GEMM notes
    assert C.limit_note({**short, "form": "winograd"}) == "the Winograd transforms' passes over memory"


def test_forms_recorded_from_the_route_s_plan_makers():
    """bench.conv_forms: each form once, in the order met; the wrapped functions restored after the block."""
    from bench import conv_forms
    from blasx.dnn import direct_cuda
    from blasx.dnn.geometry import conv_geometry
    made = direct_cuda.forward_plan
    geo = conv_geometry("conv2d", 2, np.empty((2, 8, 9, 9), np.float32), np.empty((4, 8, 3, 3), np.float32), 1, 1,
                        1, 1)
    with conv_forms.recorded([]) as forms:
        direct_cuda.forward_plan(geo, True, np.float32, 0.0, 1 << 30, "ieee")
        direct_cuda.weight_plan(geo, True, np.float32, 1 << 30, "ieee")
        direct_cuda.forward_plan(geo, False, np.float32, 0.0, 1 << 30, "ieee")
    assert forms == ["im2col"] and direct_cuda.forward_plan is made
