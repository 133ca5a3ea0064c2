"""Standalone activations with torch.nn.functional's names and parameters, and their gradients.

The formulas are the fused epilogues' (the one table: runtime/activations.py on the host,
runtime/devices/cuda_epilogue.py as CUDA expressions): numpy input is computed with the host forms,
CuPy input by one ElementwiseKernel of the CUDA forms on the array's device. Half types compute in
float32 and round once. The result keeps the input's memory layout (any dense strides, as torch).

``inplace=True`` writes into ``input`` and returns it (as torch); ``out=`` (keyword-only) is written and
returned instead of a new array. Each ``<name>_backward(grad_output, saved, ...)`` takes what torch's
backward reads -- the forward's output for relu, sigmoid and tanh, its input for the others -- and
returns the input's gradient.
"""

from __future__ import annotations

import numpy as np

from ..runtime.activations import Activation
from .args import check_array, check_inplace, check_like, check_out, check_real
from .arrays import compute_dtype, on_device_of, xp_of

__all__ = ["relu", "relu6", "leaky_relu", "elu", "gelu", "silu", "sigmoid", "tanh", "hardswish", "hardsigmoid",
           "relu_backward", "relu6_backward", "leaky_relu_backward", "elu_backward", "gelu_backward",
           "silu_backward", "sigmoid_backward", "tanh_backward", "hardswish_backward", "hardsigmoid_backward"]


def _act(name: str, param_name: str | None = None, param=None) -> Activation:
    if name == "gelu":
        if not isinstance(param, str) or param not in ("none", "tanh"):
            raise ValueError(f"approximate: got {param!r}; allowed: 'none', 'tanh'")
        return Activation("gelu_tanh" if param == "tanh" else "gelu")
    return Activation(name, None if param_name is None else check_real(param_name, param))


def _run(act: Activation, arrays, y, xp):
    """y = act(x) (arrays = (x,)) or its gradient (arrays = (grad, saved)) into y."""
    dt = np.dtype(y.dtype)
    if xp is np:
        ct = compute_dtype(dt)
        wide = [a.astype(ct, copy=False) for a in arrays]
        y[...] = act.host(*wide) if len(wide) == 1 else act.host_grad(*wide)
        return y
    from ..runtime.devices.cuda_epilogue import pointwise_kernel
    with on_device_of(y):
        pointwise_kernel(dt, act.name, len(arrays) == 2)(*arrays, compute_dtype(dt).type(act.param or 0.0), y)
    return y


def _forward(act: Activation, input, inplace, out):
    check_array("input", input)
    xp = xp_of(input, out)
    inplace = check_inplace(inplace, input, out)
    check_out(out, input.shape, input.dtype, input, input)
    if inplace:
        y = input
    elif out is not None:
        y = out
    else:
        with on_device_of(input):
            y = xp.empty_like(input)
    return _run(act, (input,), y, xp)


def _backward(act: Activation, grad_output, saved, saved_name: str, out):
    check_array("grad_output", grad_output)
    check_like(saved_name, saved, "grad_output", grad_output)
    xp = xp_of(grad_output, saved, out)
    check_out(out, grad_output.shape, grad_output.dtype, grad_output, grad_output, saved)
    if out is None:
        with on_device_of(grad_output):
            out = xp.empty_like(grad_output)
    return _run(act, (grad_output, saved), out, xp)


# ---------------------------------------------------------------- forward

def relu(input, inplace=False, *, out=None):
    """max(x, 0). Backward: :func:`relu_backward` (reads the output)."""
    return _forward(_act("relu"), input, inplace, out)


def relu6(input, inplace=False, *, out=None):
    """min(max(x, 0), 6). Backward: :func:`relu6_backward` (reads the input)."""
    return _forward(_act("relu6"), input, inplace, out)


def leaky_relu(input, negative_slope=0.01, inplace=False, *, out=None):
    """x for x >= 0, negative_slope * x below. Backward: :func:`leaky_relu_backward` (reads the input)."""
    return _forward(_act("leaky_relu", "negative_slope", negative_slope), input, inplace, out)


def elu(input, alpha=1.0, inplace=False, *, out=None):
    """x for x > 0, alpha * (exp(x) - 1) below. Backward: :func:`elu_backward` (reads the input)."""
    return _forward(_act("elu", "alpha", alpha), input, inplace, out)


def gelu(input, *, approximate="none", out=None):
    """x * Phi(x) (approximate='none') or torch's tanh form (approximate='tanh'). Backward:
    :func:`gelu_backward` (reads the input)."""
    return _forward(_act("gelu", "approximate", approximate), input, False, out)


def silu(input, inplace=False, *, out=None):
    """x * sigmoid(x). Backward: :func:`silu_backward` (reads the input)."""
    return _forward(_act("silu"), input, inplace, out)


def sigmoid(input, *, out=None):
    """1 / (1 + exp(-x)). Backward: :func:`sigmoid_backward` (reads the output)."""
    return _forward(_act("sigmoid"), input, False, out)


def tanh(input, *, out=None):
    """tanh(x). Backward: :func:`tanh_backward` (reads the output)."""
    return _forward(_act("tanh"), input, False, out)


def hardswish(input, inplace=False, *, out=None):
    """x * relu6(x + 3) / 6. Backward: :func:`hardswish_backward` (reads the input)."""
    return _forward(_act("hardswish"), input, inplace, out)


def hardsigmoid(input, inplace=False, *, out=None):
    """relu6(x + 3) / 6. Backward: :func:`hardsigmoid_backward` (reads the input)."""
    return _forward(_act("hardsigmoid"), input, inplace, out)


# ---------------------------------------------------------------- backward (the input's gradient)

def relu_backward(grad_output, output, *, out=None):
    """grad_output where relu's output > 0, else 0 (torch's threshold_backward)."""
    return _backward(_act("relu"), grad_output, output, "output", out)


def relu6_backward(grad_output, input, *, out=None):
    """grad_output where 0 < input < 6, else 0 (torch's hardtanh_backward)."""
    return _backward(_act("relu6"), grad_output, input, "input", out)


def leaky_relu_backward(grad_output, input, negative_slope=0.01, *, out=None):
    """grad_output where input > 0, else negative_slope * grad_output."""
    return _backward(_act("leaky_relu", "negative_slope", negative_slope), grad_output, input, "input", out)


def elu_backward(grad_output, input, alpha=1.0, *, out=None):
    """grad_output where input > 0, else grad_output * alpha * exp(input)."""
    return _backward(_act("elu", "alpha", alpha), grad_output, input, "input", out)


def gelu_backward(grad_output, input, *, approximate="none", out=None):
    """grad_output * gelu'(input), of the form ``approximate`` says."""
    return _backward(_act("gelu", "approximate", approximate), grad_output, input, "input", out)


def silu_backward(grad_output, input, *, out=None):
    """grad_output * s * (1 + input * (1 - s)), s = sigmoid(input)."""
    return _backward(_act("silu"), grad_output, input, "input", out)


def sigmoid_backward(grad_output, output, *, out=None):
    """grad_output * (1 - output) * output."""
    return _backward(_act("sigmoid"), grad_output, output, "output", out)


def tanh_backward(grad_output, output, *, out=None):
    """grad_output * (1 - output^2)."""
    return _backward(_act("tanh"), grad_output, output, "output", out)


def hardswish_backward(grad_output, input, *, out=None):
    """0 below -3, grad_output * (input / 3 + 1/2) up to 3, grad_output above."""
    return _backward(_act("hardswish"), grad_output, input, "input", out)


def hardsigmoid_backward(grad_output, input, *, out=None):
    """grad_output / 6 where -3 < input < 3, else 0."""
    return _backward(_act("hardsigmoid"), grad_output, input, "input", out)
