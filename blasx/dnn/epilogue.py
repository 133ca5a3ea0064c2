"""The convolution's fused epilogue, per output channel: ``y = act(tile * scale + shift)`` on each finished
C tile before its write-back (the ``Call.epilogue`` contract, runtime/epilogues.py).

Reference implementation of blasx.dnn until runtime/epilogues.py's per-channel epilogue takes its place
(the seam: :func:`make_epilogue`): numpy on sim and cpu tiles, CuPy element-wise operations on CUDA tiles.
"""

from __future__ import annotations

import threading

import numpy as np

ACTIVATIONS = ("relu", "relu6", "leaky_relu", "elu", "sigmoid", "tanh", "gelu", "hardswish", "silu")


def check_activation(activation):
    """(name, parameter) of ``activation``: None, a name of ACTIVATIONS or ("leaky_relu", slope)."""
    if activation is None:
        return None
    if isinstance(activation, tuple) and len(activation) == 2 and activation[0] == "leaky_relu":
        return ("leaky_relu", float(activation[1]))
    if isinstance(activation, str) and activation in ACTIVATIONS:
        return (activation, 0.01 if activation == "leaky_relu" else 1.0)
    raise ValueError(f"activation: got {activation!r}; allowed: None, {', '.join(map(repr, ACTIVATIONS))} "
                     f"or ('leaky_relu', slope)")


def activate(xp, erf, t, act) -> None:
    """Apply activation ``act`` ((name, parameter)) to the float array ``t`` in place."""
    name, a = act
    if name == "relu":
        xp.maximum(t, 0, out=t)
    elif name == "relu6":
        xp.clip(t, 0, 6, out=t)
    elif name == "leaky_relu":
        t[...] = xp.where(t >= 0, t, t * a)
    elif name == "elu":
        t[...] = xp.where(t > 0, t, a * xp.expm1(xp.minimum(t, 0)))
    elif name == "sigmoid":
        t[...] = 1 / (1 + xp.exp(-t))
    elif name == "tanh":
        xp.tanh(t, out=t)
    elif name == "gelu":
        t[...] = 0.5 * t * (1 + erf(t * (1 / np.sqrt(2))))
    elif name == "hardswish":
        t[...] = t * xp.clip(t + 3, 0, 6) / 6
    elif name == "silu":
        t[...] = t / (1 + xp.exp(-t))


class ChannelEpilogue:
    """Per output channel ``scale`` (or None) and ``shift`` (or None) vectors and an activation.
    ``slots`` maps each C slot of the call to (axis, first channel, channels): the tile's rows
    (axis 0) or columns (axis 1) are channels ``(first + index) % channels``."""

    def __init__(self, scale, shift, act, slots: dict, dtype) -> None:
        self.scale = None if scale is None else np.ascontiguousarray(scale, dtype=dtype)
        self.shift = None if shift is None else np.ascontiguousarray(shift, dtype=dtype)
        self.act = act
        self.slots = slots
        self._on_device: dict = {}
        self._lock = threading.Lock()

    def _channels(self, ref):
        axis, first, count = self.slots[ref.slot]
        start, size = (ref.r0, ref.rows) if axis == 0 else (ref.c0, ref.cols)
        return axis, (first + np.arange(start, start + size)) % count

    def apply(self, xp, erf, t, axis, ch, scale, shift) -> None:
        shape = (-1, 1) if axis == 0 else (1, -1)
        if scale is not None:
            t *= scale[ch].reshape(shape)
        if shift is not None:
            t += shift[ch].reshape(shape)
        if self.act is not None:
            activate(xp, erf, t, self.act)

    def __call__(self, dev, s, loc, task) -> None:
        axis, ch = self._channels(task.c)
        if dev.kind == "cuda":
            self._cuda(dev, s, loc, task, axis, ch)
            return
        from scipy.special import erf

        def work():
            with np.errstate(over="ignore"):
                self.apply(np, erf, loc, axis, ch, self.scale, self.shift)
        if dev.kind == "sim":
            if not dev.timing:
                dev.streams[s].submit(work)
            return
        work()

    def _cuda(self, dev, s, loc, task, axis, ch) -> None:
        import cupy
        from cupyx.scipy.special import erf

        from ..runtime.devices.cuda_lowp import device_view
        scale, shift = self._device_vectors(dev)
        with dev.streams[s]:
            t = device_view(loc[0], task.c.rows, task.c.cols, loc[1], task.call.acc_dtype)
            self.apply(cupy, erf, t, axis, cupy.asarray(ch), scale, shift)

    def _device_vectors(self, dev):
        got = self._on_device.get(dev.index)
        if got is None:
            import cupy
            with self._lock, cupy.cuda.Device(dev.ordinal):
                got = self._on_device.get(dev.index)
                if got is None:
                    got = tuple(None if v is None else cupy.asarray(v) for v in (self.scale, self.shift))
                    cupy.cuda.get_current_stream().synchronize()
                    self._on_device[dev.index] = got
        return got


def make_epilogue(bias, scale, shift, act, residual: bool, slots: dict, dtype):
    """(epilogue or None, per-channel weight factor or None) for conv -> +bias -> *scale + shift
    -> +residual -> act. With a residual the C tile starts from it, so scale is folded into the
    weights (the factor returned) and bias*scale + shift is the epilogue's shift."""
    def f64(v):
        return None if v is None else np.asarray(v, dtype=np.float64)
    bias, scale, shift = f64(bias), f64(scale), f64(shift)
    total = bias
    if scale is not None and total is not None:
        total = total * scale
    if shift is not None:
        total = shift if total is None else total + shift
    fold = scale if residual else None
    epi_scale = None if residual else scale
    if epi_scale is None and total is None and act is None:
        return None, fold
    return ChannelEpilogue(epi_scale, total, act, slots, dtype), fold
