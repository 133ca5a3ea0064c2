"""blasx.dnn.find on a real CUDA GPU (marker ``gpu``; skipped where CuPy finds none): the find step on two
ResNet-50 layers (a 56x56 and a 7x7 3x3 conv, strict float32: winograd among the forms), every form checked and
timed, the winner stored and then chosen by conv_direct.forward_form on that GPU."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn
from blasx.dnn import conv_direct, conv_sets, finddb

cupy = pytest.importorskip("cupy")
NGPU = blasx.session._cuda_count()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="no CUDA GPU")]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BLASX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BLASX_PERFDB", raising=False)
    monkeypatch.setattr(conv_direct, "FORM", None)
    yield tmp_path
    blasx.shutdown()


@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_find_on_two_resnet_layers(layout):
    for p in conv_sets.problems("layer1.0.conv2,layer4.1.conv2", 8):
        r = dnn.find(p["x_shape"], p["weight_shape"], p["stride"], p["padding"], layout=layout, runs=2)
        assert r["forms"] == ["im2col", "shifted", "winograd"] and r["bad"] == [] and r["stored"]
        assert max(r["errors"][f] for f in ("shifted", "winograd")) < 1e-4 and all(t > 0 for t in r["best"].values())
        key = r["key"]
        assert key.device == finddb.gpu_name(0) and finddb.lookup(key) == r["form"]
        geo = finddb.forward_geometry(p["x_shape"], p["weight_shape"], 1, 1, 1, 1, np.float32)
        assert key.layout == conv_direct.device_layout(layout, geo, np.float32) == "cl"  # (NCHW runs channels-last)
        with cupy.cuda.Device(0):
            assert conv_direct.forward_form(geo, np.float32, None, key.layout, "ieee") == r["form"]
    assert len(finddb.entries()) == 2


def test_find_backward_directions():
    r = dnn.find((4, 64, 28, 28), (64, 64, 3, 3), 1, 1, direction="bwd-data", runs=1)
    assert r["forms"] == ["im2col", "shifted", "winograd"] and r["bad"] == [] and r["key"].direction == "bwd-data"
    r = dnn.find((4, 64, 28, 28), (64, 64, 3, 3), 1, 1, direction="bwd-weight", runs=1)
    assert r["forms"] == ["im2col", "shifted", "winograd"] and r["key"].layout == "cl"  # (NCHW runs channels-last)
    r = dnn.find((4, 64, 28, 28), (64, 1, 3, 3), 1, 1, groups=64, runs=1)
    assert r["forms"] == ["depthwise"] and r["stored"]


def test_find_times_the_find_only_forms_and_the_route_takes_the_stored_one():
    """Channels-last: a 3x3 stride-1 weight gradient times im2col, shifted and winograd (weight_forms.py), each
    checked against the first, stored, and then taken by the route."""
    from blasx.dnn import weight_forms
    r = dnn.find((4, 64, 28, 28), (64, 64, 3, 3), 1, 1, direction="bwd-weight", layout="cl", runs=2)
    assert r["forms"] == ["im2col", "shifted", "winograd"] and r["bad"] == [] and r["stored"]
    geo = finddb.forward_geometry((4, 64, 28, 28), (64, 64, 3, 3), 1, 1, 1, 1, np.float32)
    with cupy.cuda.Device(0):
        assert weight_forms.weight_form(geo, np.float32, None, "cl", "ieee") == r["form"]


def test_find_times_the_implicit_weight_kernel_on_hopper():
    """A float16 3x3 weight gradient (NCHW operands, run channels-last) times im2col, shifted and, on sm_90,
    the implicit weight-gradient kernel, each checked against the first."""
    from blasx.dnn import igemm
    r = dnn.find((8, 64, 28, 28), (128, 64, 3, 3), 1, 1, direction="bwd-weight", dtype=np.float16, runs=2)
    want = ["im2col", "shifted"] + (["implicit"] if igemm.capable(0) else [])
    assert r["forms"] == want and r["bad"] == [] and r["key"].layout == "cl"


@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_find_strided_backward_data_times_col2im_and_phases(layout):
    """A stride-2 backward-data problem runs GEMMs into columns and col2im, or its phases (stride-1 convolutions
    of the sub-kernels): the find step times both (checked against each other), stores the faster, and the
    route takes it; with dilation 2 (no phases) col2im alone is timed and nothing stored."""
    from blasx.dnn import conv_transpose as conv
    r = dnn.find((4, 64, 28, 28), (128, 64, 3, 3), 2, 1, direction="bwd-data", layout=layout, runs=1)
    assert r["forms"] == ["col2im", "phases"] and r["bad"] == [] and r["stored"]
    assert finddb.lookup(r["key"]) == r["form"] and all(r["best"][f] > 0 for f in r["forms"])
    t = conv.transpose_geometry("t", 2, np.empty((4, 128, 14, 14)), np.empty((128, 64, 3, 3)), 2, 1, 1, 1, 1)
    assert conv._strided_form(t, np.float32, r["key"].layout, None) == r["form"]
    r = dnn.find((4, 64, 28, 28), (128, 64, 3, 3), 2, 2, 2, direction="bwd-data", layout=layout, runs=1)
    assert r["forms"] == ["col2im"] and not r["stored"] and finddb.lookup(r["key"]) is None


