"""Epilogues: work a device does on a finished C tile before its write-back (``Call.epilogue``).

An epilogue is called as ``epilogue(device, stream, loc, task)`` by the worker (stream devices)
or the CPU device, with the tile's location in the device's form (a numpy view on sim and cpu,
``(pointer, ld)`` on cuda). On a stream device it is called when the tile's kernels are issued,
not done: it issues its work on ``stream`` (sim: ``device.streams[stream].submit``). One with a
``dtype`` attribute converts the tile in place to that type (same item size); the write-back then
reads it as such (``Call.wb_dtype``). ``transposed()`` gives the epilogue of C^T, for a front end
that computes the transposed product (``dispatch.gemm``). The tile an epilogue sees is the whole
sum, ``alpha op(A) op(B) + beta C``, in the call's accumulation type (``Call.acc_dtype``: a mixed
call's float32 accumulator, rounded to C's type after the epilogue, at the write-back).
"""

from __future__ import annotations

import threading

import numpy as np

from . import dtypes
from .activations import parse_activation
from .devices.cupy_streams import on_stream


def _on_device(cache: dict, lock, dev, key, make):
    """``cache[key]``, made by ``make(cupy)`` on ``dev`` the first time and waited for there (any stream of the
    device may read it after)."""
    got = cache.get(key)
    if got is None:
        import cupy
        with lock, cupy.cuda.Device(dev.ordinal):
            got = cache.get(key)
            if got is None:
                got = make(cupy)
                cupy.cuda.get_current_stream().synchronize()
                cache[key] = got
    return got


class Dequantize:
    """int8 gemm's epilogue: the int32 tile -> float32 ``tile * row_scale[i] * col_scale[j]`` in
    place (the scales of the quantized operands, on the canonical C's rows and columns)."""

    dtype = np.dtype(np.float32)

    def __init__(self, row_scale, col_scale) -> None:
        self.row_scale = np.ascontiguousarray(row_scale, dtype=np.float32)
        self.col_scale = np.ascontiguousarray(col_scale, dtype=np.float32)
        self._on_device: dict = {}  # device index -> the scales in its memory (CuPy)
        self._lock = threading.Lock()

    def transposed(self) -> "Dequantize":
        """The epilogue of the transposed product (C^T: row and column scales swapped)."""
        return Dequantize(self.col_scale, self.row_scale)

    def __call__(self, dev, s, loc, task) -> None:
        ref = task.c
        rows, cols = slice(ref.r0, ref.r0 + ref.rows), slice(ref.c0, ref.c0 + ref.cols)
        if dev.kind == "cuda":
            r, c = self._device_scales(dev)
            dev.dequantize(s, loc, ref.rows, ref.cols, r[rows], c[cols])
            return
        r, c = self.row_scale[rows, None], self.col_scale[None, cols]

        def work():
            scaled = loc.astype(np.float32)
            scaled *= r
            scaled *= c
            loc.view(np.float32)[...] = scaled
        if dev.kind == "sim":  # behind the tile's kernels on its stream (none in timing mode)
            if not dev.timing:
                dev.streams[s].submit(work)
            return
        work()  # cpu: the finished tile, in this thread

    def _device_scales(self, dev):
        """The scales on ``dev`` (copied once per device, the first time it finishes a tile)."""
        return _on_device(self._on_device, self._lock, dev, dev.index,
                          lambda cupy: (cupy.asarray(self.row_scale), cupy.asarray(self.col_scale)))


class ChannelAffine:
    """``tile -> act(tile * scale + shift)`` in place: a per-channel affine map (bias, folded
    inference batchnorm) and an activation fused into the gemm. ``axis`` says which index of the
    canonical C the vectors run along: 0, its rows; 1, its columns. ``scale`` and ``shift``
    (each optional) are real 1-D arrays (numpy or CuPy) of one length, the channel count; they
    repeat along the axis: row (column) i takes value ``i % len`` (a C of N images' channels
    side by side, NCHW conv's ``(P, N*K)``, passes K values). ``activation`` is anything
    :func:`~blasx.runtime.activations.parse_activation` takes.
    Tiles of float64, float32, float16 and bfloat16 are computed in float32 (float64 for
    float64) and rounded once to the tile's type."""

    def __init__(self, axis: int, scale=None, shift=None, activation=None) -> None:
        if isinstance(axis, bool) or axis not in (0, 1):
            raise ValueError(f"axis: got {axis!r}; allowed: 0 (vectors along C's rows) or 1 (along its columns)")
        self.axis = int(axis)
        self.scale = _vector("scale", scale)
        self.shift = _vector("shift", shift)
        if self.scale is not None and self.shift is not None and self.scale.size != self.shift.size:
            raise ValueError(f"shift: got {self.shift.size} values, scale has {self.scale.size}; "
                             f"they must have one value per channel each")
        self.activation = parse_activation(activation)
        self._host: dict = {}  # compute dtype -> (scale, shift) of that type
        self._on_device: dict = {}  # (device index, compute dtype) -> (scale, shift) in its memory (CuPy)
        self._lock = threading.Lock()

    @property
    def size(self) -> int | None:
        """The number of channels the vectors have (None: neither vector given)."""
        v = self.scale if self.scale is not None else self.shift
        return None if v is None else v.size

    def check(self, rows: int, cols: int) -> None:
        """Raise ValueError unless the vectors fit a ``rows x cols`` C (canonical, as this
        epilogue's axis reads it: its extent a multiple of the channel count); a front end
        calls it before the call."""
        n = rows if self.axis == 0 else cols
        if self.size is not None and n % self.size != 0:
            name = "scale" if self.scale is not None else "shift"
            raise ValueError(f"{name}: got {self.size} values, the output has {n} "
                             f"{'rows' if self.axis == 0 else 'columns'} (C's channel axis), "
                             f"not a multiple of {self.size}")

    def transposed(self) -> "ChannelAffine":
        """The epilogue of the transposed product (C^T: the vectors run along the other axis)."""
        return ChannelAffine(1 - self.axis, self.scale, self.shift, self.activation)

    def __call__(self, dev, s, loc, task) -> None:
        ref = task.c
        lo, n = (ref.r0, ref.rows) if self.axis == 0 else (ref.c0, ref.cols)
        act = self.activation
        if dev.kind == "cuda":
            from .devices.cuda_epilogue import affine_activation
            dtype = task.call.acc_dtype
            scale, shift = self._device_vectors(dev, _compute_dtype(dtype))
            with on_stream(dev.streams[s]):
                scale, shift = self._part(scale, lo, n), self._part(shift, lo, n)
            affine_activation(dev.streams[s], loc, ref.rows, ref.cols, dtype, scale, shift,
                              None if act is None else act.name, (act.param if act is not None else None) or 0.0)
            return
        if dev.kind == "sim" and dev.timing:
            return  # data-free: no tile to work on
        ct = _compute_dtype(loc.dtype)
        scale, shift = self._typed(ct)
        scale = None if scale is None else self._part(scale, lo, n)
        shift = None if shift is None else self._part(shift, lo, n)

        def work():
            with np.errstate(over="ignore", invalid="ignore", under="ignore"):
                v = loc if loc.dtype == ct else loc.astype(ct)
                if scale is not None:
                    np.multiply(v, scale, out=v)
                if shift is not None:
                    np.add(v, shift, out=v)
                if act is not None:
                    v = act.host(v)
                if v is not loc:
                    loc[...] = v  # rounds once to the tile's type
        if dev.kind == "sim":  # behind the tile's kernels on its stream
            dev.streams[s].submit(work)
            return
        work()  # cpu: the finished tile, in this thread

    def _part(self, v, lo: int, n: int):
        """The values of rows (columns) ``[lo, lo + n)`` from vector ``v`` (repeating), shaped to
        broadcast over the tile (a placeholder of shape (1, 1) as it is)."""
        if v.ndim == 2:
            return v
        start = lo % v.shape[0]
        if start + n <= v.shape[0]:
            v = v[start:start + n]
        else:  # the tile spans the end of a repetition: gathered (CuPy: on the current stream)
            idx = np.arange(start, start + n) % v.shape[0]
            if not isinstance(v, np.ndarray):
                import cupy
                idx = cupy.asarray(idx)
            v = v.take(idx)
        return v[:, None] if self.axis == 0 else v[None, :]

    def _typed(self, ct: np.dtype) -> tuple:
        """The vectors in the compute type ``ct`` (None where not given), made once per type."""
        got = self._host.get(ct)
        if got is None:
            got = self._host[ct] = tuple(None if v is None else v.astype(ct) for v in (self.scale, self.shift))
        return got

    def _device_vectors(self, dev, ct: np.dtype):
        """The vectors on ``dev`` in the compute type ``ct`` (copied once per device, the first
        time it finishes a tile); a vector not given is a (1, 1) one or zero."""
        return _on_device(self._on_device, self._lock, dev, (dev.index, ct), lambda cupy: (
            cupy.asarray(self.scale, dtype=ct) if self.scale is not None else cupy.ones((1, 1), ct),
            cupy.asarray(self.shift, dtype=ct) if self.shift is not None else cupy.zeros((1, 1), ct)))


class PerSlot:
    """One epilogue per C slot of a call (a grouped convolution writes one C per group)."""

    def __init__(self, by_slot: dict) -> None:
        self.by_slot = dict(by_slot)

    def transposed(self) -> "PerSlot":
        return PerSlot({slot: e.transposed() for slot, e in self.by_slot.items()})

    def __call__(self, dev, s, loc, task) -> None:
        self.by_slot[task.c.slot](dev, s, loc, task)


def _vector(name: str, v) -> np.ndarray | None:
    """A scale or shift vector as a float64 host array (None stays None), checked."""
    if v is None:
        return None
    if hasattr(v, "__cuda_array_interface__"):
        v = v.get()  # CuPy: copied to the host once; each device gets its own copy
    v = np.asarray(v)
    if v.dtype.kind not in "fiu" and not _is_bfloat16(v.dtype):
        raise TypeError(f"{name}: got an array of {v.dtype.name}; allowed: a real (integer or floating) vector")
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"{name}: got shape {v.shape}; allowed: a 1-D vector, one value per channel")
    return np.ascontiguousarray(v, dtype=np.float64)


def _is_bfloat16(dt) -> bool:
    bf = dtypes.GEMM_BY_PREFIX.get("b")
    return bf is not None and np.dtype(dt) == bf.dtype


def _compute_dtype(dtype) -> np.dtype:
    """The type a C tile of ``dtype`` is computed in (TypeError for tiles that are not real floats)."""
    dt = np.dtype(dtype)
    if dt == np.float64:
        return dt
    if dt in (np.dtype(np.float32), np.dtype(np.float16)) or _is_bfloat16(dt):
        return np.dtype(np.float32)
    raise TypeError(f"ChannelAffine: a C tile of type {dt.name} cannot take it; "
                    f"allowed: float64, float32, float16, bfloat16")
