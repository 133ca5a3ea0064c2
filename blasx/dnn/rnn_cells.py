"""The fused per-step elementwise kernels of recurrent cells (MIOpen eq. 5-10 and their gradients).

One step of a layer is one GEMM (``gh = h_prev . W_hh^T``, gates stacked as in eq. 11) and one of these kernels,
which applies every gate nonlinearity and the state update in one pass over the ``a x H`` active rows. Arrays are
row-major ``(a, G*H)`` gate blocks in torch's gate order (LSTM i, f, g, o; GRU r, z, n); ``gx`` holds the input
projection alone and the kernel adds ``bias`` itself (no pass over gx for it): ``b_ih + b_hh`` (G*H), for GRU
``(b_ir + b_hr, b_iz + b_hz, b_in, b_hn)`` (4*H; ``b_hn`` sits inside the reset product), or None.
A backward step is one kernel over all B rows (the step's dy added, rows past a sequence's end carried over)
and one GEMM, so a captured backward loop has two launches a step like the forward one.

Two implementations with one signature: numpy (host, sims) and CuPy ElementwiseKernels (made on first use). The
compute type F is float64 for float64 data and float32 otherwise; the hidden output ``h`` may have the storage type
(float16 rounds there), states and saved gates stay in F.

Saved per step for the backward pass (``gates``): LSTM the activated i, f, g, o; GRU r, z, n and the hidden
n-part ``gh_n + b_hn``; RNN nothing (its gradient needs only h).
"""

from __future__ import annotations

import numpy as np

SAVED = {"lstm": 4, "gru": 4, "rnn_tanh": 0, "rnn_relu": 0}  # gate blocks saved per step for backward


def _sig(x):
    with np.errstate(over="ignore"):  # (exp(-x) of a large negative x is inf: the sigmoid is 0, exactly)
        return 1.0 / (1.0 + np.exp(-x))


# ---------------------------------------------------------------- numpy

def np_forward(mode, gx, gh, bias, c_prev, h_prev, gates, c_out, h_out) -> None:
    """One step on the host: writes ``h_out`` (and ``c_out``, ``gates`` where the mode has them)."""
    hh = h_out.shape[1]
    bhn = None if bias is None or mode != "gru" else bias[3 * hh:]
    if bias is not None:
        gx = gx + bias[:gx.shape[1]]
    if mode == "lstm":
        s = gx + gh
        i, f, g, o = _sig(s[:, :hh]), _sig(s[:, hh:2 * hh]), np.tanh(s[:, 2 * hh:3 * hh]), _sig(s[:, 3 * hh:])
        c = f * c_prev + i * g
        c_out[...] = c
        h_out[...] = o * np.tanh(c)
        gates[:, :hh], gates[:, hh:2 * hh], gates[:, 2 * hh:3 * hh], gates[:, 3 * hh:] = i, f, g, o
    elif mode == "gru":
        ghn = gh[:, 2 * hh:] + bhn if bhn is not None else gh[:, 2 * hh:]
        r = _sig(gx[:, :hh] + gh[:, :hh])
        z = _sig(gx[:, hh:2 * hh] + gh[:, hh:2 * hh])
        n = np.tanh(gx[:, 2 * hh:] + r * ghn)
        h_out[...] = (1.0 - z) * n + z * h_prev
        gates[:, :hh], gates[:, hh:2 * hh], gates[:, 2 * hh:3 * hh], gates[:, 3 * hh:] = r, z, n, ghn
    else:
        s = gx + gh
        h_out[...] = np.tanh(s) if mode == "rnn_tanh" else np.maximum(s, 0)


def np_backward(mode, dh, dc, gates, c, c_prev, h, h_prev, dgx, dgh, dc_prev, dh_direct) -> None:
    """The gradient of one step: from ``dh`` (of the step's h, before any projection) and ``dc`` (of its
    cell state) it writes the gate pre-activation gradients ``dgx`` (input side) and ``dgh`` (hidden side;
    the same array as dgx except for GRU), ``dc_prev`` (LSTM) and the part of dh_prev not through W_hh
    (``dh_direct``, GRU)."""
    if mode == "lstm":
        hh = c.shape[1]
        i, f, g, o = gates[:, :hh], gates[:, hh:2 * hh], gates[:, 2 * hh:3 * hh], gates[:, 3 * hh:]
        tc = np.tanh(c)
        dct = dc + dh * o * (1.0 - tc * tc)
        dgx[:, :hh] = dct * g * i * (1.0 - i)
        dgx[:, hh:2 * hh] = dct * c_prev * f * (1.0 - f)
        dgx[:, 2 * hh:3 * hh] = dct * i * (1.0 - g * g)
        dgx[:, 3 * hh:] = dh * tc * o * (1.0 - o)
        dc_prev[...] = dct * f
    elif mode == "gru":
        hh = h_prev.shape[1]
        r, z, n, ghn = gates[:, :hh], gates[:, hh:2 * hh], gates[:, 2 * hh:3 * hh], gates[:, 3 * hh:]
        dsn = dh * (1.0 - z) * (1.0 - n * n)
        dsr = dsn * ghn * r * (1.0 - r)
        dsz = dh * (h_prev - n) * z * (1.0 - z)
        dgx[:, :hh], dgx[:, hh:2 * hh], dgx[:, 2 * hh:] = dsr, dsz, dsn
        dgh[:, :hh], dgh[:, hh:2 * hh], dgh[:, 2 * hh:] = dsr, dsz, dsn * r
        dh_direct[...] = dh * z
    elif mode == "rnn_tanh":
        dgx[...] = dh * (1.0 - h * h)
    else:
        dgx[...] = np.where(h <= 0, 0, dh)  # (selected, not multiplied: 0 * inf is NaN; a NaN h passes, as torch's)


def np_backward_step(mode, a, dh, dy, dc, gates, c, c_prev, h, h_prev, dgx, dgh, dc_out, dh_out, g16=None,
                     x16=None) -> None:
    """One step of a layer's backward loop over all B rows (rnn_layer.backward_steps): rows ``< a`` as
    :func:`np_backward` with ``dh + dy`` (``dy`` None: no add), writing ``dgx``/``dgh``, ``dc_out`` (LSTM) and, GRU,
    ``dh_out`` = the part of dh_prev not through W_hh (the recurrent GEMM then adds to it), and ``dgh`` (``dgx``)
    rounded to the storage type into ``g16`` (``x16``) when given; rows ``>= a`` carry ``dh`` and ``dc`` over into
    ``dh_out`` and ``dc_out``. ``dgx`` and ``dgh`` None (CUDA's narrow form, rnn_layer.backward_buffers): only
    the rounded copies are kept. ``dh`` and ``dh_out`` may be (n, B, out) stacks of partial sums (the recurrent
    GEMM in k slices, rnn_layer.backward_steps): dh is their sum; carried rows go to ``dh_out[0]`` (the other
    parts zeroed) and GRU's part not through W_hh to ``dh_out[-1]``."""
    stack = dh.ndim == 3
    if stack:
        dh, parts = dh.sum(axis=0), dh_out
        dh_out = parts[-1]
    d = dh[:a] + dy[:a] if dy is not None else dh[:a]
    lstm = mode == "lstm"
    if dgx is None:
        dgx = np.empty(dh.shape[:1] + g16.shape[1:], dtype=dh.dtype)
        dgh = np.empty_like(dgx) if mode == "gru" else dgx
    np_backward(mode, d, dc[:a] if lstm else None, gates[:a] if gates is not None else None,
                c[:a] if lstm else None, c_prev[:a] if lstm else None, h[:a], h_prev[:a], dgx[:a], dgh[:a],
                dc_out[:a] if lstm else None, dh_out[:a] if mode == "gru" else None)
    if g16 is not None:
        g16[:a] = dgh[:a]
    if x16 is not None:
        x16[:a] = dgx[:a]
    if stack:
        parts[:, a:] = 0
        parts[0, a:] = dh[a:]
    else:
        dh_out[a:] = dh[a:]
    if lstm:
        dc_out[a:] = dc[a:]


# ---------------------------------------------------------------- CuPy

_FWD_ARGS = ("raw F gx, raw F gh, raw F bias, int32 hb, raw F cp, raw S hp, int32 H",
             "raw F gates, raw F c, raw S h")  # hb: 0 where there is no bias (``bias`` a placeholder)
_FWD = {
    "lstm": """
        int b = i / H, j = i % H; long k = (long)b * 4 * H + j;
        F si = gx[k] + gh[k], sf = gx[k + H] + gh[k + H], sg = gx[k + 2 * H] + gh[k + 2 * H],
          so = gx[k + 3 * H] + gh[k + 3 * H];
        if (hb) { si += bias[j]; sf += bias[j + H]; sg += bias[j + 2 * H]; so += bias[j + 3 * H]; }
        F ig = 1 / (1 + exp(-si)), fg = 1 / (1 + exp(-sf)), gg = tanh(sg), og = 1 / (1 + exp(-so));
        F cn = fg * cp[i] + ig * gg;
        c[i] = cn; h[i] = (S)(og * tanh(cn));
        gates[k] = ig; gates[k + H] = fg; gates[k + 2 * H] = gg; gates[k + 3 * H] = og;""",
    "gru": """
        int b = i / H, j = i % H; long k = (long)b * 3 * H + j, q = (long)b * 4 * H + j;
        F sr = gx[k] + gh[k], sz = gx[k + H] + gh[k + H], xn = gx[k + 2 * H], ghn = gh[k + 2 * H];
        if (hb) { sr += bias[j]; sz += bias[j + H]; xn += bias[j + 2 * H]; ghn += bias[j + 3 * H]; }
        F r = 1 / (1 + exp(-sr)), z = 1 / (1 + exp(-sz));
        F n = tanh(xn + r * ghn);
        h[i] = (S)((1 - z) * n + z * (F)hp[i]);
        gates[q] = r; gates[q + H] = z; gates[q + 2 * H] = n; gates[q + 3 * H] = ghn;""",
    "rnn_tanh": "F s = gx[i] + gh[i]; if (hb) s += bias[i % H]; h[i] = (S)tanh(s);",
    "rnn_relu": "F s = gx[i] + gh[i]; if (hb) s += bias[i % H]; h[i] = (S)(s <= (F)0 ? (F)0 : s);",
}

# half: 0 the gradients in F only, 1 also dgh rounded into g16, 2 only the rounded g16 (and GRU's dgx into x16)
# dh and dhn: ``np`` parts of ``part`` elements each (np_backward_step's stacks; one part: plain arrays)
_STEP_ARGS = ("raw F dh, raw F dy, int32 has_dy, raw F dc, raw F gates, raw F c, raw F cp, raw S h, raw S hp, "
              "int32 H, int32 a, int32 half, int32 np, int64 part",
              "raw F dgx, raw F dgh, raw F dcn, raw F dhn, raw S g16, raw S x16")
_SUM = "F dhs = dh[i]; for (int q = 1; q < np; ++q) dhs += dh[q * part + i];"
_CARRY = "dhn[i] = dhs; for (int q = 1; q < np; ++q) dhn[q * part + i] = 0;"
_STEP = {  # np_backward_step over every row: i = b * H + j
    "lstm": _SUM + """
        if (i / H >= a) { """ + _CARRY + """ dcn[i] = dc[i]; } else {
        int b = i / H, j = i % H; long k = (long)b * 4 * H + j;
        F d = has_dy ? dhs + dy[i] : dhs;
        F ig = gates[k], fg = gates[k + H], gg = gates[k + 2 * H], og = gates[k + 3 * H];
        F tc = tanh(c[i]); F dct = dc[i] + d * og * (1 - tc * tc);
        F d0 = dct * gg * ig * (1 - ig), d1 = dct * cp[i] * fg * (1 - fg), d2 = dct * ig * (1 - gg * gg),
          d3 = d * tc * og * (1 - og);
        if (half != 2) { dgx[k] = d0; dgx[k + H] = d1; dgx[k + 2 * H] = d2; dgx[k + 3 * H] = d3; }
        if (half) { g16[k] = (S)d0; g16[k + H] = (S)d1; g16[k + 2 * H] = (S)d2; g16[k + 3 * H] = (S)d3; }
        dcn[i] = dct * fg; }""",
    "gru": _SUM + """
        if (i / H >= a) { """ + _CARRY + """ } else {
        int b = i / H, j = i % H; long q = (long)b * 4 * H + j, k = (long)b * 3 * H + j;
        F d = has_dy ? dhs + dy[i] : dhs;
        F r = gates[q], z = gates[q + H], n = gates[q + 2 * H], ghn = gates[q + 3 * H];
        F dsn = d * (1 - z) * (1 - n * n), dsr = dsn * ghn * r * (1 - r),
          dsz = d * ((F)hp[i] - n) * z * (1 - z);
        if (half != 2) { dgx[k] = dsr; dgx[k + H] = dsz; dgx[k + 2 * H] = dsn;
                         dgh[k] = dsr; dgh[k + H] = dsz; dgh[k + 2 * H] = dsn * r; }
        if (half) { g16[k] = (S)dsr; g16[k + H] = (S)dsz; g16[k + 2 * H] = (S)(dsn * r); }
        if (half == 2) { x16[k] = (S)dsr; x16[k + H] = (S)dsz; x16[k + 2 * H] = (S)dsn; }
        dhn[(np - 1) * part + i] = d * z; }""",
    "rnn_tanh": _SUM + """
        if (i / H >= a) { """ + _CARRY + """ } else {
        F d = has_dy ? dhs + dy[i] : dhs; F y = (F)h[i]; F v = d * (1 - y * y); if (half != 2) dgx[i] = v;
        if (half) g16[i] = (S)v; }""",
    "rnn_relu": _SUM + """
        if (i / H >= a) { """ + _CARRY + """ } else {
        F d = has_dy ? dhs + dy[i] : dhs; F v = (F)h[i] <= 0 ? (F)0 : d; if (half != 2) dgx[i] = v;
        if (half) g16[i] = (S)v; }""",
}

_KERNELS: dict = {}


def cupy_kernel(direction: str, mode: str):
    """The CuPy ElementwiseKernel of ``mode``'s forward ("fwd") or backward step ("step") cell (compiled per type on
    first use)."""
    key = (direction, mode)
    if key not in _KERNELS:
        import cupy
        ins, outs, body = _FWD_ARGS + (_FWD[mode],) if direction == "fwd" else _STEP_ARGS + (_STEP[mode],)
        _KERNELS[key] = cupy.ElementwiseKernel(ins, outs, body, f"blasx_rnn_{mode}_{direction}")
    return _KERNELS[key]


_BIAS = ("raw T a, raw T b, int32 h, int32 gru", "F out",
         "if (gru && i >= 2 * h) out = i < 3 * h ? (F)a[i] : (F)b[i - h]; else out = (F)a[i] + (F)b[i];")


def bias_sum(out, b_ih, b_hh, gru: bool) -> None:
    """The step cell's bias ``out`` (in its type F) from a layer's two: ``b_ih + b_hh`` summed in F; GRU (``out``
    4H from two 3H): the r and z parts summed, then b_in, then b_hn (it stays inside the reset product). One
    kernel on CUDA, which allocates nothing (a captured graph may run it)."""
    if isinstance(out, np.ndarray):
        n = out.shape[0] // 2 if gru else out.shape[0]
        np.add(b_ih[:n], b_hh[:n], out=out[:n], dtype=out.dtype)
        if gru:
            out[n:n + n // 2] = b_ih[n:]
            out[n + n // 2:] = b_hh[n:]
        return
    key = ("bias",)
    if key not in _KERNELS:
        import cupy
        _KERNELS[key] = cupy.ElementwiseKernel(*_BIAS, "blasx_rnn_bias")
    _KERNELS[key](b_ih, b_hh, np.int32(out.shape[0] // 4), np.int32(gru), out)


def cupy_forward(mode, gx, gh, bias, c_prev, h_prev, gates, c_out, h_out) -> None:
    """:func:`np_forward` as one CUDA kernel on the current stream (every argument a CuPy array; absent
    ones are one-element placeholders of the compute type; ``bias`` None: no bias)."""
    rows, hh = h_out.shape
    cupy_kernel("fwd", mode)(gx, gh, gh if bias is None else bias, np.int32(bias is not None), c_prev, h_prev,
                             np.int32(hh), gates, c_out, h_out, size=rows * hh)


def cupy_backward_step(mode, a, dh, dy, dc, gates, c, c_prev, h, h_prev, dgx, dgh, dc_out, dh_out, g16, x16,
                       half: int) -> None:
    """:func:`np_backward_step` as one CUDA kernel on the current stream (absent arguments are placeholders; ``dy``
    None: no add; ``half`` as _STEP_ARGS says: 0 F only, 1 F and ``g16``, 2 ``g16`` and GRU's ``x16`` only)."""
    rows, hh = dh.shape[-2:]
    n = dh.shape[0] if dh.ndim == 3 else 1
    cupy_kernel("step", mode)(dh, dh if dy is None else dy, np.int32(dy is not None), dc, gates, c, c_prev, h, h_prev,
                              np.int32(hh), np.int32(a), np.int32(half), np.int32(n), np.int64(rows * hh),
                              dgx, dgh, dc_out, dh_out, g16, x16, size=rows * hh)
