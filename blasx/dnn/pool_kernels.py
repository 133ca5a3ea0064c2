"""The pooling kernels: numpy (host) and CuPy (the array's GPU) twins with one signature.

Arrays are in the *working form* ``(lead, S1, S2, S3, T)``, C-contiguous: NCHW data is ``(N*C, *S, 1)`` and
channels-last data ``(N, *S, C)``; the geometry is lifted to 3 spatial dims (pool_geometry.py). Indices are flat
positions ``(u1*S2 + u2)*S3 + u3`` in one (n, c) plane, as torch's.

The compute type F is float64 for float64 data and float32 otherwise; results are rounded once to the data's
type. Max pools follow torch: a value replaces the running maximum when it is greater or NaN (so the last NaN
of a window wins, and among equal values the first), the initial index being the window's first position.
Forward kernels run over outputs; backward of max pools scatter into the input (atomics on the device,
float32 accumulation for float16), of average pools gather per input element over the windows that hold it.
"""

from __future__ import annotations

import itertools
from math import prod

import numpy as np

from ..operands import is_cupy
from .arrays import compute_dtype
from .pool_geometry import PoolGeometry, divisor, windows


def forward(geo: PoolGeometry, xw, yw, iw=None) -> None:
    """Writes the pool of ``xw`` to ``yw`` (and max pools' indices to ``iw``, int64, when given)."""
    if yw.size == 0:
        return
    (_cp_forward if is_cupy(xw) else _np_forward)(geo, xw, yw, iw)


def max_backward(geo: PoolGeometry, gw, iw, giw) -> None:
    """``giw`` (the input's working form) = the scatter-add of ``gw`` at the indices ``iw``."""
    (_cp_max_backward if is_cupy(gw) else _np_max_backward)(geo, gw, iw, giw)


def avg_backward(geo: PoolGeometry, gw, giw) -> None:
    """``giw`` = the gradient of an average (or adaptive average) pool for the output gradient ``gw``."""
    (_cp_avg_backward if is_cupy(gw) else _np_avg_backward)(geo, gw, giw)


# ---------------------------------------------------------------- numpy

def _offsets(geo: PoolGeometry):
    """Per window offset (r1, r2, r3): the three per-dim position arrays (clipped into the input) shaped
    to broadcast over (O1, O2, O3), and the mask of the positions that are in the window and the input."""
    wins = windows(geo)
    shapes = [(-1, 1, 1), (1, -1, 1), (1, 1, -1)]
    for r in itertools.product(*(range(w.kmax) for w in wins)):
        pos, ok = [], None
        for w, rj, shp in zip(wins, r, shapes):
            p = w.start + rj * w.step
            v = (rj < w.length) & (p >= 0) & (p < w.size)
            pos.append(np.where(v, p, 0).reshape(shp))
            ok = v.reshape(shp) if ok is None else ok & v.reshape(shp)
        yield pos, ok[None, ..., None]


def _flat(geo: PoolGeometry, p1, p2, p3):
    _, s2, s3 = geo.in_size
    return (p1 * s2 + p2) * s3 + p3


def _blocks(geo: PoolGeometry):
    """Per dim the block size where the windows tile the input's leading part exactly (adaptive pools of
    divisible sizes; kernel = stride, no padding nor dilation, no partial window), else None."""
    if 0 in geo.out_size:
        return None
    if geo.adaptive:
        ok = all(s % o == 0 for s, o in zip(geo.in_size, geo.out_size))
        return tuple(s // o for s, o in zip(geo.in_size, geo.out_size)) if ok else None
    ok = all(k == st and p == 0 and d == 1 and o * k <= s for k, st, p, d, o, s in
             zip(geo.kernel, geo.stride, geo.padding, geo.dilation, geo.out_size, geo.in_size))
    return geo.kernel if ok else None


def _block_view(geo, a, ks):
    """``a``'s (lead, O1, O2, O3, T, k1*k2*k3) view of the tiled part of its input (a copy where needed)."""
    (o1, o2, o3), (k1, k2, k3) = geo.out_size, ks
    a = a[:, :o1 * k1, :o2 * k2, :o3 * k3, :].reshape(a.shape[0], o1, k1, o2, k2, o3, k3, a.shape[-1])
    return a.transpose(0, 1, 3, 5, 7, 2, 4, 6).reshape(a.shape[0], o1, o2, o3, a.shape[-1], k1 * k2 * k3)


def _np_forward(geo, xw, yw, iw) -> None:
    xf = xw.astype(compute_dtype(xw.dtype), copy=False)
    ks = _blocks(geo)
    if ks is not None:
        _np_block_forward(geo, ks, xf, yw, iw)
    elif geo.reduce == "max":
        best = np.full(yw.shape, -np.inf, dtype=xf.dtype)
        f = [w.first.reshape(s) for w, s in zip(windows(geo), [(-1, 1, 1), (1, -1, 1), (1, 1, -1)])]
        idx = np.broadcast_to(_flat(geo, *f)[None, ..., None], yw.shape).copy()
        for pos, ok in _offsets(geo):
            v = xf[:, pos[0], pos[1], pos[2], :]
            take = ok & ((v > best) | np.isnan(v))
            best = np.where(take, v, best)
            idx = np.where(take, _flat(geo, *pos)[None, ..., None], idx)
        yw[...] = best
        if iw is not None:
            iw[...] = idx
    else:
        acc = np.zeros(yw.shape, dtype=xf.dtype)
        for pos, ok in _offsets(geo):
            acc += np.where(ok, xf[:, pos[0], pos[1], pos[2], :], 0)
        yw[...] = acc / divisor(geo).astype(xf.dtype)[None, ..., None]


def _np_block_forward(geo, ks, xf, yw, iw) -> None:
    """Windows that tile the input: one reduction over the last axis of the block view."""
    v = _block_view(geo, xf, ks)
    if geo.reduce == "avg":
        yw[...] = v.sum(axis=-1) / divisor(geo).astype(xf.dtype)[None, ..., None]
        return
    nan = np.isnan(v)  # the last NaN of a window wins, else its first maximum
    last_nan = v.shape[-1] - 1 - np.argmax(nan[..., ::-1], axis=-1)
    k = np.where(nan.any(axis=-1), last_nan, np.argmax(v, axis=-1))
    yw[...] = np.take_along_axis(v, k[..., None], axis=-1)[..., 0]
    if iw is not None:
        r1, r2, r3 = np.unravel_index(k, ks)
        o1, o2, o3 = (np.arange(o).reshape(sh) for o, sh in
                      zip(geo.out_size, [(1, -1, 1, 1, 1), (1, 1, -1, 1, 1), (1, 1, 1, -1, 1)]))
        iw[...] = _flat(geo, o1 * ks[0] + r1, o2 * ks[1] + r2, o3 * ks[2] + r3)


def _np_max_backward(geo, gw, iw, giw) -> None:
    lead, t = gw.shape[0], gw.shape[-1]
    base = (np.arange(lead, dtype=np.int64) * prod(geo.in_size)).reshape(-1, 1, 1, 1, 1)
    flat = (base + iw) * t + np.arange(t, dtype=np.int64)
    acc = np.bincount(flat.ravel(), weights=gw.astype(np.float64).ravel(), minlength=giw.size)
    giw[...] = acc.reshape(giw.shape)


def _np_avg_backward(geo, gw, giw) -> None:
    F = compute_dtype(gw.dtype)
    g = gw.astype(F) / divisor(geo).astype(F)[None, ..., None]
    ks = _blocks(geo)
    if ks is not None:  # each input element in at most one window
        giw[...] = 0
        (o1, o2, o3), (k1, k2, k3) = geo.out_size, ks
        tiled = np.broadcast_to(g[:, :, None, :, None, :, None, :], (g.shape[0], o1, k1, o2, k2, o3, k3, g.shape[-1]))
        giw[:, :o1 * k1, :o2 * k2, :o3 * k3, :] = tiled.reshape(g.shape[0], o1 * k1, o2 * k2, o3 * k3, g.shape[-1])
        return
    acc = np.zeros(giw.shape, dtype=F)
    every = slice(None)
    for pos, ok in _offsets(geo):  # (unbuffered: windows of one offset may share positions)
        np.add.at(acc, (every, *pos, every), np.where(ok, g, 0))
    giw[...] = acc


# ---------------------------------------------------------------- CuPy

# data type -> (CuPy parameter type, its C type, compute type F, accumulation array type of the max scatter)
_TYPES = {"float64": ("float64", "double", "double", "float64"), "float32": ("float32", "float", "float", "float32"),
          "float16": ("float16", "float16", "float", "float32")}

_GEO = ("int64 S1, int64 S2, int64 S3, int64 O1, int64 O2, int64 O3, int64 T, int64 k1, int64 k2, int64 k3, "
        "int64 s1, int64 s2, int64 s3, int64 p1, int64 p2, int64 p3, int64 d1, int64 d2, int64 d3, "
        "int64 inc, int64 dv")

# Per spatial dim j of output o{j}: its positions u = b{j}, b{j}+q{j}, ... < e{j}, all inside the input;
# n{j}: the window's size clipped to the padded input (average pools' count_include_pad divisor).
_BOUNDS = {
    "max": "long long a{j} = o{j} * s{j} - p{j}; long long b{j} = a{j}; while (b{j} < 0) b{j} += d{j};"
           " long long e{j} = a{j} + (k{j} - 1) * d{j} + 1; if (e{j} > S{j}) e{j} = S{j};"
           " const long long q{j} = d{j};",
    "avg": "long long a{j} = o{j} * s{j} - p{j}; long long e{j} = a{j} + k{j};"
           " if (e{j} > S{j} + p{j}) e{j} = S{j} + p{j}; const long long n{j} = e{j} - a{j};"
           " const long long b{j} = a{j} < 0 ? 0 : a{j}; if (e{j} > S{j}) e{j} = S{j};"
           " const long long q{j} = 1;",
    "adaptive": "const long long b{j} = (o{j} * S{j}) / O{j};"
                " const long long e{j} = ((o{j} + 1) * S{j} + O{j} - 1) / O{j};"
                " const long long n{j} = e{j} - b{j}; const long long q{j} = 1;",
}
_DIVISOR = {"avg": "dv != 0 ? dv : (inc ? n1 * n2 * n3 : (e1 - b1) * (e2 - b2) * (e3 - b3))",
            "adaptive": "n1 * n2 * n3"}


def _form(geo: PoolGeometry) -> str:
    return "adaptive" if geo.adaptive else geo.reduce


def _bounds(form: str) -> str:
    return " ".join(_BOUNDS[form].format(j=j) for j in (1, 2, 3))


def forward_source(form: str, reduce: str, dtype: str, with_indices: bool) -> tuple[str, str, str, str]:
    """(in_params, out_params, operation, name) of the forward ElementwiseKernel over the outputs."""
    ptype, ctype, F, _ = _TYPES[dtype]
    head = ("long long t = i % T, r_ = i / T; const long long o3 = r_ % O3; r_ /= O3;"
            " const long long o2 = r_ % O2; r_ /= O2; const long long o1 = r_ % O1; const long long l = r_ / O1;"
            " const long long P = S1 * S2 * S3; " + _bounds(form))
    loop = ("for (long long u1 = b1; u1 < e1; u1 += q1) for (long long u2 = b2; u2 < e2; u2 += q2)"
            " for (long long u3 = b3; u3 < e3; u3 += q3) { const long long sp = (u1 * S2 + u2) * S3 + u3;"
            " const F v = (F)x[(l * P + sp) * T + t]; ")
    if reduce == "max":
        body = loop + "if (v > best || isnan(v)) { best = v; bi = sp; } }"
        op = (f"typedef {F} F; {head} F best = (F)__int_as_float(0xff800000);"
              f" long long bi = (b1 * S2 + b2) * S3 + b3; {body} y = ({ctype})best;"
              + (" ind = bi;" if with_indices else ""))
    else:
        body = loop + "acc += v; }"
        op = f"typedef {F} F; {head} F acc = 0; {body} y = ({ctype})(acc / (F)({_DIVISOR[form]}));"
    outs = f"{ptype} y" + (", int64 ind" if with_indices else "")
    name = f"blasx_pool_{form}_{reduce}_{dtype}" + ("_ind" if with_indices else "")
    return f"raw {ptype} x, {_GEO}", outs, op, name


def max_backward_source(dtype: str) -> tuple[str, str, str, str]:
    """The max pools' backward ElementwiseKernel over the outputs: atomically adds g at its index."""
    ptype, _, F, atype = _TYPES[dtype]
    op = (f"const long long t = i % T, l = i / T / Q;"
          f" atomicAdd(&acc[(l * P + ind) * T + t], ({F})g);")
    return f"{ptype} g, int64 ind, int64 P, int64 Q, int64 T", f"raw {atype} acc", op, f"blasx_pool_maxbw_{dtype}"


# Per spatial dim j of input position u{j}: the outputs whose window holds it are lo{j}..hi{j}.
_CANDIDATES = {
    "avg": "const long long m{j} = u{j} + p{j} - k{j} + 1; const long long lo{j} = m{j} <= 0 ? 0 :"
           " (m{j} + s{j} - 1) / s{j}; long long hi{j} = (u{j} + p{j}) / s{j}; if (hi{j} > O{j} - 1) hi{j} = O{j} - 1;",
    "adaptive": "const long long lo{j} = (u{j} * O{j}) / S{j}; const long long hi{j} = ((u{j} + 1) * O{j} - 1) / S{j};",
}


def avg_backward_source(form: str, dtype: str) -> tuple[str, str, str, str]:
    """The average pools' backward ElementwiseKernel over the inputs: sums g/divisor of the windows holding it."""
    ptype, ctype, F, _ = _TYPES[dtype]
    cand = " ".join(_CANDIDATES[form].format(j=j) for j in (1, 2, 3))
    op = (f"typedef {F} F; long long t = i % T, r_ = i / T; const long long u3 = r_ % S3; r_ /= S3;"
          f" const long long u2 = r_ % S2; r_ /= S2; const long long u1 = r_ % S1; const long long l = r_ / S1;"
          f" {cand} F acc = 0;"
          f" for (long long o1 = lo1; o1 <= hi1; ++o1) for (long long o2 = lo2; o2 <= hi2; ++o2)"
          f" for (long long o3 = lo3; o3 <= hi3; ++o3) {{ {_bounds(form)}"
          f" acc += (F)g[(((l * O1 + o1) * O2 + o2) * O3 + o3) * T + t] / (F)({_DIVISOR[form]}); }}"
          f" gi = ({ctype})acc;")
    return f"raw {ptype} g, {_GEO}", f"{ptype} gi", op, f"blasx_pool_{form}_bw_{dtype}"


_KERNELS: dict = {}


def _kernel(make, *key):
    k = _KERNELS.get((make, *key))
    if k is None:  # two threads may both make it: the same kernel, either kept
        import cupy
        k = _KERNELS[(make, *key)] = cupy.ElementwiseKernel(*make(*key))
    return k


def _geo_args(geo: PoolGeometry, t: int) -> tuple[int, ...]:
    return (*geo.in_size, *geo.out_size, t, *geo.kernel, *geo.stride, *geo.padding, *geo.dilation,
            int(geo.count_include_pad), geo.divisor_override)


def _cp_forward(geo, xw, yw, iw) -> None:
    k = _kernel(forward_source, _form(geo), geo.reduce, np.dtype(xw.dtype).name, iw is not None)
    args = (xw, *_geo_args(geo, xw.shape[-1]), yw) + ((iw,) if iw is not None else ())
    k(*args)


def _cp_max_backward(geo, gw, iw, giw) -> None:
    import cupy
    dt = np.dtype(gw.dtype).name
    acc = giw if _TYPES[dt][3] == dt else cupy.empty(giw.shape, dtype=_TYPES[dt][3])
    acc.fill(0)
    if gw.size:
        _kernel(max_backward_source, dt)(gw, iw, prod(geo.in_size), prod(geo.out_size),
                                         gw.shape[-1], acc)
    if acc is not giw:
        giw[...] = acc


def _cp_avg_backward(geo, gw, giw) -> None:
    if giw.size == 0:
        return
    if gw.size == 0:
        giw[...] = 0
        return
    _kernel(avg_backward_source, _form(geo), np.dtype(gw.dtype).name)(gw, *_geo_args(geo, gw.shape[-1]), giw)
