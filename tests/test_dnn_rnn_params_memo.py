"""rnn_params.parse keeps the Spec of a mapping of CUDA torch tensors and hands it out again only while the
names, tensor objects and their layouts are unchanged (stand-in tensors, no GPU)."""

from __future__ import annotations

import gc
import types

import numpy as np
import pytest

from blasx.dnn import rnn_params

H = 8


class FakeTensor:
    """What parse reads of a CUDA torch tensor (module name, device, layout)."""
    __module__ = "torch.fake"

    def __init__(self, arr, ptr):
        self.arr, self.ptr = arr, ptr
        self.shape, self.dtype = arr.shape, arr.dtype
        self.device = types.SimpleNamespace(type="cuda", index=0)

    def data_ptr(self):
        return self.ptr

    def stride(self):
        return tuple(s // self.arr.itemsize for s in self.arr.strides)


@pytest.fixture
def parsed(monkeypatch):
    """parse with stand-in views and streams; returns (parse, the count of full parses, streams switch)."""
    monkeypatch.setattr(rnn_params, "_specs", {})
    monkeypatch.setattr(rnn_params, "_cuda_view", lambda t, xp: t.arr)
    streams = {"default": True}
    monkeypatch.setattr(rnn_params, "_default_streams", lambda device, xp: streams["default"])
    calls = []
    full = rnn_params._parse

    def counted(*args, **kwargs):
        calls.append(1)
        return full(*args, **kwargs)
    monkeypatch.setattr(rnn_params, "_parse", counted)
    xp = types.SimpleNamespace(name="cupy stand-in")

    def parse(params, xp=xp):
        return rnn_params.parse(params, "lstm", H, num_layers=1, bidirectional=False, proj_size=0, xp=xp,
                                dtype=np.float32)
    return parse, calls, streams


def _params(start=1):
    rng = np.random.default_rng(start)
    shapes = {"weight_ih_l0": (4 * H, H), "weight_hh_l0": (4 * H, H), "bias_ih_l0": (4 * H,), "bias_hh_l0": (4 * H,)}
    return {k: FakeTensor(rng.standard_normal(s).astype(np.float32), 4096 * (start + i))
            for i, (k, s) in enumerate(shapes.items())}


def test_an_unchanged_mapping_is_parsed_once(parsed):
    parse, calls, _ = parsed
    p = _params()
    s1 = parse(p)
    s2 = parse(p)
    assert s2 is s1 and len(calls) == 1
    assert s1.cells[0][0].w_hh is p["weight_hh_l0"].arr


@pytest.mark.parametrize("change", ["new tensor", "new storage", "new shape", "streams", "extra name"])
def test_any_change_parses_again(parsed, change):
    parse, calls, streams = parsed
    p = _params()
    s1 = parse(p)
    if change == "new tensor":
        p["bias_hh_l0"] = FakeTensor(p["bias_hh_l0"].arr + 1, 999 * 4096)
    elif change == "new storage":  # torch's set_(): the same object over other memory
        p["weight_hh_l0"].ptr += 4096
        p["weight_hh_l0"].arr = p["weight_hh_l0"].arr * 2
    elif change == "new shape":
        t = p["weight_ih_l0"]
        t.arr = t.arr[:, :H - 1].copy()
        t.shape = t.arr.shape
    elif change == "streams":  # a side stream: the views are made again, with DLPack's stream hand-over
        streams["default"] = False
    else:
        p["weight_hr_l0"] = FakeTensor(np.zeros((2, H), np.float32), 77 * 4096)
    if change in ("new shape", "extra name"):
        with pytest.raises((ValueError, KeyError)):
            parse(p)
        assert len(calls) == 2
        return
    s2 = parse(p)
    assert len(calls) == 2 and s2 is not s1
    if change == "new tensor":
        assert s2.cells[0][0].b_hh is p["bias_hh_l0"].arr
    if change == "new storage":
        assert s2.cells[0][0].w_hh is p["weight_hh_l0"].arr


def test_an_entry_goes_with_its_tensors(parsed):
    parse, _, _ = parsed
    p = _params()
    parse(p)
    assert len(rnn_params._specs) == 1
    del p["bias_ih_l0"]
    gc.collect()
    assert rnn_params._specs == {}


def test_host_calls_and_array_values_are_not_kept(parsed):
    parse, calls, _ = parsed
    p = {k: t.arr for k, t in _params().items()}
    parse(p, xp=np)
    parse(p, xp=np)
    mixed = {k: FakeTensor(v, 1) if k == "weight_ih_l0" else v for k, v in p.items()}
    with pytest.raises(TypeError, match="pass cupy arrays"):
        parse(mixed)  # (a numpy array for a GPU call)
    assert len(calls) == 3 and rnn_params._specs == {}


class FakeCupy(np.ndarray):
    """What parse reads of a CuPy array (module name, device pointer, layout)."""
    device = types.SimpleNamespace(id=0)

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


FakeCupy.__module__ = "cupy.fake"


def test_a_mapping_of_cupy_arrays_is_kept_on_any_stream(parsed):
    """CuPy arrays are held by the Spec as they are (no views, no stream hand-over): the Spec is handed out
    again while the mapping holds the same array objects of unchanged memory and layout, on any stream; an
    in-place write keeps it (the Spec reads the array itself), a new array or a reshape in place does not."""
    parse, calls, streams = parsed
    p = {k: t.arr.view(FakeCupy) for k, t in _params().items()}
    s1 = parse(p)
    streams["default"] = False  # (only torch tensors' views depend on it)
    assert parse(p) is s1 and len(calls) == 1 and s1.cells[0][0].w_hh is p["weight_hh_l0"]
    p["weight_hh_l0"] *= 2  # in place: the same Spec, which reads the new values
    assert parse(p) is s1 and len(calls) == 1
    p["bias_hh_l0"] = (p["bias_hh_l0"] + 1).view(FakeCupy)
    s2 = parse(p)
    assert s2 is not s1 and len(calls) == 2 and s2.cells[0][0].b_hh is p["bias_hh_l0"]
    w = p["weight_ih_l0"]
    w.shape = (H, 4 * H)  # reshaped in place: the same object, another layout
    with pytest.raises(ValueError):
        parse(p)
    assert len(calls) == 3
