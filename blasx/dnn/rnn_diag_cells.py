"""The fused cell kernels of a diagonal step (rnn_diag.py): every layer of a group in one pass.

At diagonal step s, local layer l works on time t = s - l. Its gate pre-activations come from one batched GEMM
into ``o`` (n, B, GW) plus ``bias`` (n, GW) (and, for the stack's layer 0, its precomputed input projection
``p0``). GW is G*H, except GRU: 4H columns (r, z, the input and the hidden n parts kept apart, since the hidden
one sits inside the reset product). ``act[l]``: the active rows of layer l at this step, or -1 where the layer
is idle (t outside 0..T-1: it writes nothing); rows past ``act[l]`` carry their state over. Hidden states live
in the diagonal buffer ``d[s]`` (B, n+1, H): slot l+1 is layer l's h, slot 0 the group's input.

Backward at step s reads ``e[s+1]`` (n, B, 2H), the gradients of each layer's stacked GEMM input
[input ; h_prev] from the step after, and writes ``dg[s]`` (the gate gradients, zero for inactive rows) and
``e[s]``'s non-GEMM part (the carried gradient of inactive rows, GRU's direct h_prev term), to which the batched
GEMM ``e[s] += dg[s] . W`` then adds. Two implementations with one signature: numpy and CuPy.
"""

from __future__ import annotations

import numpy as np

from . import rnn_cells


def gate_width(mode: str, H: int) -> int:
    """GW: columns of a layer's batched-GEMM output."""
    return 4 * H if mode in ("lstm", "gru") else H


# ---------------------------------------------------------------- numpy

def np_forward(mode, o, bias, p0, c_prev, c_out, gates, d_prev, d_out, act, first) -> None:
    n, B, _ = o.shape
    H = d_out.shape[2]
    for l in range(n):
        a = int(act[l])
        if a < 0:
            continue
        hp, ho = d_prev[:, l + 1], d_out[:, l + 1]
        pre = o[l, :a] + bias[l]
        if first and l == 0:
            pre[:, :p0.shape[1]] += p0[:a]
        lstm = mode == "lstm"
        cp = c_prev[l, :a] if lstm else None
        co = c_out[l, :a] if lstm else None
        g = gates[l, :a] if gates is not None and gates.ndim == 3 else None
        if mode == "gru":
            gh = np.zeros((a, 3 * H), dtype=pre.dtype)
            gh[:, 2 * H:] = pre[:, 3 * H:]
            rnn_cells.np_forward(mode, pre[:, :3 * H], gh, None, cp, hp[:a], g, co, ho[:a])
        else:
            rnn_cells.np_forward(mode, pre, 0.0, None, cp, hp[:a], g, co, ho[:a])
        ho[a:] = hp[a:]
        if lstm:
            c_out[l, a:] = c_prev[l, a:]


def np_backward(mode, e_next, e_cur, ext, dhn, dc, gates, c, c_prev, d, d_prev, dg, act, s, T) -> None:
    n, B, _ = dg.shape
    H = dhn.shape[2]
    for l in range(n):
        a = int(act[l])
        if a < 0:
            continue
        rec = dhn[l] if s - l == T - 1 else e_next[l, :, H:]
        dh = rec[:a].copy()
        if l < n - 1:
            dh += e_next[l + 1, :a, :H]
        elif ext is not None:
            dh += ext[:a]
        lstm, gru = mode == "lstm", mode == "gru"
        e_cur[l, :, :H] = 0
        e_cur[l, :a, H:] = 0
        e_cur[l, a:, H:] = rec[a:]
        dg[l, a:] = 0
        g = gates[l, :a] if gru or lstm else None
        if gru:
            dgh = np.empty((a, 3 * H), dtype=dg.dtype)
            rnn_cells.np_backward(mode, dh, None, g, None, None, None, d_prev[:a, l + 1], dg[l, :a, :3 * H],
                                  dgh, None, e_cur[l, :a, H:])
            dg[l, :a, 3 * H:] = dgh[:, 2 * H:]
        else:
            rnn_cells.np_backward(mode, dh, dc[l, :a] if lstm else None, g, c[l, :a] if lstm else None,
                                  c_prev[l, :a] if lstm else None, d[:a, l + 1], None, dg[l, :a], dg[l, :a],
                                  dc[l, :a] if lstm else None, None)


# ---------------------------------------------------------------- CuPy

_PRE = """
int l = i / (B * H); int r = i - l * B * H; int b = r / H; int j = r - b * H;
long hs = ((long)b * (n + 1) + l + 1) * H + j;
int a = act[l];
"""

_FWD = {
    "lstm": """
        long k = ((long)l * B + b) * 4 * H + j, q = (long)l * 4 * H + j, p = (long)b * 4 * H + j;
        F si = o[k] + bias[q], sf = o[k + H] + bias[q + H], sg = o[k + 2 * H] + bias[q + 2 * H],
          so = o[k + 3 * H] + bias[q + 3 * H];
        if (x0) { si += p0[p]; sf += p0[p + H]; sg += p0[p + 2 * H]; so += p0[p + 3 * H]; }
        F ig = 1 / (1 + exp(-si)), fg = 1 / (1 + exp(-sf)), gg = tanh(sg), og = 1 / (1 + exp(-so));
        F cn = fg * cp[i] + ig * gg;
        c[i] = cn; h[hs] = (S)(og * tanh(cn));
        gates[k] = ig; gates[k + H] = fg; gates[k + 2 * H] = gg; gates[k + 3 * H] = og;""",
    "gru": """
        long k = ((long)l * B + b) * 4 * H + j, q = (long)l * 4 * H + j, p = (long)b * 3 * H + j;
        F rg = 1 / (1 + exp(-(o[k] + bias[q] + (x0 ? p0[p] : (F)0))));
        F zg = 1 / (1 + exp(-(o[k + H] + bias[q + H] + (x0 ? p0[p + H] : (F)0))));
        F ghn = o[k + 3 * H] + bias[q + 3 * H];
        F ng = tanh(o[k + 2 * H] + bias[q + 2 * H] + (x0 ? p0[p + 2 * H] : (F)0) + rg * ghn);
        h[hs] = (S)((1 - zg) * ng + zg * (F)hp[hs]);
        gates[k] = rg; gates[k + H] = zg; gates[k + 2 * H] = ng; gates[k + 3 * H] = ghn;""",
    "rnn_tanh": """
        long k = ((long)l * B + b) * H + j;
        h[hs] = (S)tanh(o[k] + bias[(long)l * H + j] + (x0 ? p0[(long)b * H + j] : (F)0));""",
    "rnn_relu": """
        long k = ((long)l * B + b) * H + j;
        F sr = o[k] + bias[(long)l * H + j] + (x0 ? p0[(long)b * H + j] : (F)0);
        h[hs] = (S)(sr <= (F)0 ? (F)0 : sr);""",
}

_BWD = {
    "lstm": """
        F ig = gates[k], fg = gates[k + H], gg = gates[k + 2 * H], og = gates[k + 3 * H];
        F tc = tanh(c[i]); F dct = dc[i] + d * og * (1 - tc * tc);
        dg[k] = dct * gg * ig * (1 - ig); dg[k + H] = dct * cp[i] * fg * (1 - fg);
        dg[k + 2 * H] = dct * ig * (1 - gg * gg); dg[k + 3 * H] = d * tc * og * (1 - og);
        dc[i] = dct * fg; ec[eo + H] = 0;""",
    "gru": """
        F rg = gates[k], zg = gates[k + H], ng = gates[k + 2 * H], ghn = gates[k + 3 * H];
        F dsn = d * (1 - zg) * (1 - ng * ng), dsr = dsn * ghn * rg * (1 - rg),
          dsz = d * ((F)hp[hs] - ng) * zg * (1 - zg);
        dg[k] = dsr; dg[k + H] = dsz; dg[k + 2 * H] = dsn; dg[k + 3 * H] = dsn * rg; ec[eo + H] = d * zg;""",
    "rnn_tanh": "F y = (F)h[hs]; dg[k] = d * (1 - y * y); ec[eo + H] = 0;",
    "rnn_relu": "dg[k] = (F)h[hs] <= 0 ? (F)0 : d; ec[eo + H] = 0;",
}

_KERNELS: dict = {}


def _kernel(direction: str, mode: str):
    key = (direction, mode)
    if key not in _KERNELS:
        import cupy
        if direction == "fwd":
            ins = "raw F o, raw F bias, raw F p0, raw F cp, raw S hp, int32 H, int32 B, int32 n, int32 first, raw int32 act"
            outs = "raw F gates, raw F c, raw S h"
            carry = "h[hs] = hp[hs];" + (" c[i] = cp[i];" if mode == "lstm" else "")
            body = _PRE + ("if (a >= 0) { if (b < a) { bool x0 = first && l == 0; " + _FWD[mode] +
                           " } else { " + carry + " } }")
        else:
            gw = 4 if mode in ("lstm", "gru") else 1
            ins = ("raw F en, raw F ext, raw F dhn, raw F gates, raw F c, raw F cp, raw S h, raw S hp, int32 H, "
                   "int32 B, int32 n, int32 s, int32 T, int32 has_ext, raw int32 act")
            outs = "raw F ec, raw F dc, raw F dg"
            body = _PRE + f"""
if (a >= 0) {{
  long eo = ((long)l * B + b) * 2 * H + j, k = ((long)l * B + b) * {gw} * H + j;
  F rec = (s - l == T - 1) ? dhn[i] : en[eo + H];
  ec[eo] = 0;
  if (b < a) {{
    F d = rec + ((l == n - 1) ? (has_ext ? ext[(long)b * H + j] : (F)0) : en[((long)(l + 1) * B + b) * 2 * H + j]);
    {_BWD[mode]}
  }} else {{
    for (int g = 0; g < {gw}; ++g) dg[k + (long)g * H] = 0;
    ec[eo + H] = rec;
  }}
}}"""
        _KERNELS[key] = cupy.ElementwiseKernel(ins, outs, body, f"blasx_rnn_diag_{mode}_{direction}")
    return _KERNELS[key]


def cupy_forward(mode, o, bias, p0, c_prev, c_out, gates, d_prev, d_out, act, first) -> None:
    n, B, _ = o.shape
    H = d_out.shape[2]
    _kernel("fwd", mode)(o, bias, p0, c_prev, d_prev, np.int32(H), np.int32(B), np.int32(n), np.int32(first),
                         act, gates, c_out, d_out, size=n * B * H)


def cupy_backward(mode, e_next, e_cur, ext, dhn, dc, gates, c, c_prev, d, d_prev, dg, act, s, T) -> None:
    n, B, _ = dg.shape
    H = dhn.shape[2]
    has = ext is not None
    _kernel("bwd", mode)(e_next, ext if has else dhn, dhn, gates, c, c_prev, d, d_prev, np.int32(H), np.int32(B),
                         np.int32(n), np.int32(s), np.int32(T), np.int32(has), act, e_cur, dc, dg, size=n * B * H)
