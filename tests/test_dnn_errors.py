"""blasx.dnn's argument errors: each names the argument, what was received and what is allowed; raised
before any work, the caller's arrays untouched, the engine usable afterwards."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dnn

X = np.ones((2, 4, 8, 8))
W = np.ones((6, 2, 3, 3))


@pytest.fixture(autouse=True)
def sim():
    blasx.configure(devices="sim:2", tile=16)


CASES = [
    (ValueError, ("x must be 4-D", "(5, 8)"), lambda: dnn.conv2d(np.ones((5, 8)), W)),
    (ValueError, ("weight must be 4-D",), lambda: dnn.conv2d(X, np.ones((6, 2, 3)))),
    (ValueError, ("groups", "divisible by groups=3"), lambda: dnn.conv2d(X, np.ones((6, 1, 3, 3)), groups=3)),
    (ValueError, ("groups", "output channels 5"), lambda: dnn.conv2d(X, np.ones((5, 2, 3, 3)), groups=2)),
    (ValueError, ("weight.shape[1] == 4",), lambda: dnn.conv2d(X, W)),
    (ValueError, ("groups: got 0",), lambda: dnn.conv2d(X, W, groups=0)),
    (ValueError, ("kernel size", "padded input size 8"), lambda: dnn.conv2d(X, np.ones((6, 4, 9, 3)))),
    (ValueError, ("stride", "positive"), lambda: dnn.conv2d(X, W, stride=0, groups=2)),
    (ValueError, ("dilation", "(1, -1)"), lambda: dnn.conv2d(X, W, dilation=(1, -1), groups=2)),
    (ValueError, ("padding", "non-negative"), lambda: dnn.conv2d(X, W, padding=-1, groups=2)),
    (ValueError, ("padding", "'same'", "strided"), lambda: dnn.conv2d(X, W, padding="same", stride=2, groups=2)),
    (ValueError, ("padding", "'full'", "'valid'"), lambda: dnn.conv2d(X, W, padding="full", groups=2)),
    (ValueError, ("stride", "tuple of 1 or 2 ints"), lambda: dnn.conv2d(X, W, stride=(1, 1, 1), groups=2)),
    (TypeError, ("x is float64 but weight is float32",), lambda: dnn.conv2d(X, W.astype(np.float32), groups=2)),
    (TypeError, ("dtype int64", "allowed: float64, float32, float16"), lambda: dnn.conv2d(X.astype(np.int64), W)),
    (TypeError, ("complex128",), lambda: dnn.conv2d(X.astype(complex), W.astype(complex), groups=2)),
    (ValueError, ("bias", "(6,)", "(5,)"), lambda: dnn.conv2d(X, W, np.ones(5), groups=2)),
    (ValueError, ("activation", "'swish'", "'relu'"), lambda: dnn.conv2d(X, W, groups=2, activation="swish")),
    (ValueError, ("out", "(2, 6, 6, 6)", "(2, 6, 8, 8)"),
     lambda: dnn.conv2d(X, W, groups=2, out=np.ones((2, 6, 8, 8)))),
    (TypeError, ("out", "float32"), lambda: dnn.conv2d(X, W, groups=2, out=np.ones((2, 6, 6, 6), np.float32))),
    (ValueError, ("out", "C-contiguous"),
     lambda: dnn.conv2d(X, W, groups=2, out=np.ones((2, 6, 6, 6)).transpose(0, 1, 3, 2))),
    (ValueError, ("residual", "(2, 6, 6, 6)"), lambda: dnn.conv2d(X, W, groups=2, residual=np.ones((2, 6, 5, 6)))),
    (ValueError, ("math", "'fast'"), lambda: dnn.conv2d(X, W, groups=2, math="fast")),
    (ValueError, ("output_padding", "smaller than either stride"),
     lambda: dnn.conv_transpose2d(X, np.ones((4, 3, 3, 3)), stride=2, output_padding=2)),
    (ValueError, ("weight.shape[0] == 4",), lambda: dnn.conv_transpose2d(X, np.ones((3, 3, 3, 3)))),
    (ValueError, ("input_size", "cannot be reached"),
     lambda: dnn.conv2d_input((2, 4, 20, 20), W, np.ones((2, 6, 6, 6)), groups=2)),
    (ValueError, ("grad_output", "(2, 6, 6, 6)"),
     lambda: dnn.conv2d_weight(X, W.shape, np.ones((2, 6, 7, 6)), groups=2)),
    (ValueError, ("weight_size",), lambda: dnn.conv2d_weight(X, (6, 2, 3), np.ones((2, 6, 6, 6)), groups=2)),
    # empty sums torch refuses too (the result would be left unwritten), sizes that are not counts
    (ValueError, ("weight", "kernel size must be positive", "(6, 2, 0, 3)"),
     lambda: dnn.conv2d(X, np.ones((6, 2, 0, 3)), groups=2)),
    (ValueError, ("weight", "kernel size must be positive"), lambda: dnn.conv_transpose2d(X, np.ones((4, 3, 3, 0)))),
    (ValueError, ("x", "spatial size must be positive", "(2, 4, 0, 8)"),
     lambda: dnn.conv2d(np.ones((2, 4, 0, 8)), W, padding=2, groups=2)),
    (ValueError, ("x", "spatial size must be positive"),
     lambda: dnn.conv_transpose2d(np.ones((2, 4, 8, 0)), np.ones((4, 3, 3, 3)), padding=1)),
    (ValueError, ("weight_size", "(6, 2, 3.5, 3)", "non-negative ints"),
     lambda: dnn.conv2d_weight(X, (6, 2, 3.5, 3), np.ones((2, 6, 6, 6)), groups=2)),
    (ValueError, ("input_size", "(2.7, 4, 8, 8)"), lambda: dnn.conv2d_input((2.7, 4, 8, 8), W, np.ones((2, 6, 6, 6)))),
    # an input size whose forward gives another output size (dilation 2 > stride 1), a batch not grad_output's
    (ValueError, ("input_size", "cannot be reached", "[0, stride)"),
     lambda: dnn.conv1d_input((1, 3, 7), np.ones((4, 3, 3)), np.ones((1, 4, 2)), dilation=2)),
    (ValueError, ("input_size", "batch 3 differs from grad_output's 2"),
     lambda: dnn.conv2d_input((3, 4, 8, 8), W, np.ones((2, 6, 6, 6)), groups=2)),
    # the backwards name their own arguments, before any work (they named x and blamed the weight)
    (TypeError, ("conv2d_input: weight is float64 but grad_output is float32",),
     lambda: dnn.conv2d_input(X.shape, W, np.ones((2, 6, 6, 6), np.float32), groups=2)),
    (ValueError, ("grad_output: (2, 4, 6, 6) has 4 channels", "gives 6"),
     lambda: dnn.conv2d_input(X.shape, W, np.ones((2, 4, 6, 6)), groups=2)),
    (TypeError, ("grad_output: got list",), lambda: dnn.conv2d_input(X.shape, W, np.ones((2, 6, 6, 6)).tolist(),
                                                                      groups=2)),
    (ValueError, ("groups: got 0",), lambda: dnn.conv2d_input(X.shape, W, np.ones((2, 6, 6, 6)), groups=0)),
    (TypeError, ("weight: got list",), lambda: dnn.conv2d_input(X.shape, W.tolist(), np.ones((2, 6, 6, 6)), groups=2)),
    (ValueError, ("must both be 4-D (batched) or both 3-D",),
     lambda: dnn.conv2d_input(X.shape[1:], W, np.ones((2, 6, 6, 6)), groups=2)),
    (ValueError, ("weight_size (6, 3, 3, 3) with groups=2 takes 6 input channels",),
     lambda: dnn.conv2d_weight(X, (6, 3, 3, 3), np.ones((2, 6, 6, 6)), groups=2)),
    (TypeError, ("input: got list",), lambda: dnn.conv2d_weight(X.tolist(), W.shape, np.ones((2, 6, 6, 6)), groups=2)),
    (ValueError, ("input (4, 8, 8) and grad_output (1, 6, 6, 6) must both be",),
     lambda: dnn.conv2d_weight(X[0], W.shape, np.ones((1, 6, 6, 6)), groups=2)),
    (TypeError, ("grad_output: got list",), lambda: dnn.conv_bias_grad(np.ones((2, 6, 6, 6)).tolist())),
    # out= the residual is refused whatever the residual's layout (a strided one was taken: checked on its copy)
    (ValueError, ("out: overlaps an input array",),
     lambda: (lambda v: dnn.conv2d(X[0], W, groups=2, residual=v, out=v))(np.zeros((6, 6, 12))[..., ::2])),
    (TypeError, ("bias", "complex128", "real"), lambda: dnn.conv2d(X, W, np.ones(6, complex), groups=2)),
    (TypeError, ("scale", "object"), lambda: dnn.conv2d(X, W, groups=2, scale=np.array([None] * 6))),
    (TypeError, ("x: got list",), lambda: dnn.conv2d(X.tolist(), W, groups=2)),
    (TypeError, ("out: got list",), lambda: dnn.conv2d(X, W, groups=2, out=[0.0])),
    (TypeError, ("weight: got list",), lambda: dnn.conv_transpose2d(X, np.ones((4, 3, 3, 3)).tolist())),
    (TypeError, ("padding", "'same'", "int or a tuple"),
     lambda: dnn.conv_transpose2d(X, np.ones((4, 3, 3, 3)), padding="same")),
]


@pytest.mark.parametrize("exc,fragments,call", CASES, ids=[c[1][0] + str(i) for i, c in enumerate(CASES)])
def test_errors(exc, fragments, call, expect):
    x0 = X.copy()
    expect(exc, *fragments, call=call)
    assert np.array_equal(X, x0)


def test_out_untouched_on_error_and_engine_usable(expect):
    out = np.full((2, 6, 6, 6), 7.0)
    expect(ValueError, "bias", call=lambda: dnn.conv2d(X, W, np.ones(3), groups=2, out=out))
    assert (out == 7.0).all()
    expect(ValueError, "overlaps", call=lambda: dnn.conv2d(X, np.ones((4, 4, 1, 1)), out=X))
    y = dnn.conv2d(X, W, groups=2, out=out)
    assert y is out and np.allclose(out, 18.0)


def test_batch_norm_leaves_its_running_stats_alone_when_one_is_read_only():
    """Training updates running_mean, running_var and num_batches_tracked in place: a read-only one is named
    before any is written (running_mean and the batch count were updated, then numpy's unnamed error came)."""
    blasx.configure(devices="sim:2", tile=16)
    x = np.random.default_rng(0).random((4, 3, 5, 5)).astype(np.float32)
    rm, rv = np.zeros(3, np.float32), np.ones(3, np.float32)
    rv.flags.writeable = False
    with pytest.raises(ValueError, match="running_var: is read-only"):
        dnn.batch_norm(x, rm, rv, None, None, True, 0.1, 1e-5)
    assert (rm == 0).all()
    rm, rv, nbt = np.zeros(3, np.float32), np.ones(3, np.float32), np.array([0])
    rm.flags.writeable = False
    with pytest.raises(ValueError, match="running_mean: is read-only"):
        dnn.batch_norm(x, rm, rv, None, None, True, None, 1e-5, num_batches_tracked=nbt)
    assert nbt[0] == 0
    dnn.batch_norm(x, rm, rv, None, None, False, 0.1, 1e-5)  # (evaluation reads them only)


def test_masked_arrays_flags_and_network_options_are_named():
    """A masked array is refused (its mask was ignored); the recurrent layers' flags are booleans (a string was
    taken as True); Network.compile names a dtype numpy does not know and takes fuse as a flag; a numpy integer
    chunk is taken."""
    import torch
    blasx.configure(devices="sim:2", tile=16)
    xm = np.ma.masked_array(np.ones((1, 3, 4, 4), np.float32), mask=True)
    with pytest.raises(TypeError, match="x: got a masked array"):
        dnn.conv2d(xm, np.ones((1, 3, 3, 3), np.float32))
    lstm = torch.nn.LSTM(4, 5)
    params = {k: v.detach().numpy() for k, v in lstm.state_dict().items()}
    seq = np.ones((3, 2, 4), np.float32)
    for flag in ("batch_first", "bidirectional", "training"):
        with pytest.raises(TypeError, match=f"{flag}: got 'no'"):
            dnn.lstm(seq, None, params, **{flag: "no"})
    net = dnn.from_torch(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), (1, 3, 6, 6))
    with pytest.raises(TypeError, match="dtype: got 'float8'"):
        net.compile(dtype="float8")
    with pytest.raises(TypeError, match="fuse: got 'no'"):
        net.compile(fuse="no")
    assert net(np.ones((4, 3, 6, 6), np.float32), chunk=np.int64(2)).shape == (4, 4, 4, 4)


def test_from_torch_names_a_bad_example_shape():
    """A float size was taken as an int; a shape the module cannot run on gave torch.fx's ShapeProp error (a
    RuntimeError naming a graph node): both name example_input_shape, the second with torch's own reason."""
    import torch
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
    with pytest.raises(ValueError, match="example_input_shape: got \\(1, 3, 6.0, 6\\)"):
        dnn.from_torch(m, (1, 3, 6.0, 6))
    with pytest.raises(ValueError, match="example_input_shape: the module does not run on an input of shape "
                                         "\\(1, 5, 6, 6\\): .*to have 3 channels"):
        dnn.from_torch(m, (1, 5, 6, 6))
    assert dnn.from_torch(m, (1, 3, 6, 6)) is not None
