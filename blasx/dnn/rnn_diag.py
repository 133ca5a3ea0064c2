"""A unidirectional stack run diagonally: at diagonal step s, layer l computes time t = s - l, so every layer of a
group advances at once with one GEMM step (CudaOps.gemm_layers: one batched call, or in float32 IEEE one call per
layer on parallel branches) and one fused cell kernel (rnn_diag_cells.py) per step.

Layer l >= 1 takes the concatenated weight [W_ih | W_hh] (GW x 2*out) times its stacked input [h^{l-1}_t ;
h^l_{t-1}]; layer 0 takes [0 | W_hh], its input projection of all T steps being one engine GEMM before the loop
(so every layer has the same K and the GEMMs batch). The stacked inputs are strided views of one diagonal buffer
``D`` (S+1, B, n+1, out): ``D[s]`` slot l+1 holds layer l's h at time s-1-l, slot 0 the group's input at time s,
so layer l reads slots l and l+1 of ``D[s]``. Cell states and saved gates are indexed by diagonal step too.

Backward runs the same diagonal in reverse: ``E[s]`` (n, B, 2*out) holds the gradient of each layer's stacked
input, one batched GEMM ``E[s] += dG[s] . W`` per step; the weight gradients are single GEMMs after the loop.
On several devices the layers form contiguous groups (rnn_plan.py), group g on device g, a chunk behind group
g-1; the states cross once per chunk (rnn_diag_groups.py: threads, set-up order, hand-offs), and layer 0's
projection is computed part by part beside the first group's loop (_Layer0). The loops issue GEMMs and kernels
only, so on CUDA each chunk of steps, with its hand-off copies, is captured into a graph and replayed
(rnn_graph.run_part).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..operands import is_cupy
from ..runtime.devices.cupy_streams import on_stream
from . import rnn_diag_cells, rnn_layer, rnn_params
from .rnn_diag_groups import Progress, give_back, hand_over, record, run_groups, wait_for
from .rnn_layer import col_sum, compute_type


@dataclass
class Bufs:
    """One group's diagonal buffers (forward ones, then those backward adds; None where the mode has none)."""
    D: object  # (S+1, B, n+1, out) storage type
    C: object  # (S+1, n, B, H) F, LSTM
    G: object  # (S, n, B, 4H) F saved gates, LSTM and GRU
    O: object  # (n, B, GW) F: the step's GEMM output
    W: object  # (n, GW, 2*out): [W_ih | W_hh] per layer
    bias: object  # (n, GW) F
    P0: object  # (T, B, G*H) F: layer 0's input projection (first group only)
    acts: object  # (S, n) int32: active rows of layer l at step s, -1 where idle
    E: object = None  # (S+1, n, B, 2*out) F
    DG: object = None  # (S, n, B, GW) F
    DC: object = None  # (n, B, H) F, LSTM
    X: object = None  # (T, B, out) F: the gradient reaching the group's last layer from above (dy or handed)
    dhn: object = None  # (n, B, out) F
    Din: object = None  # (T, B, out) F: the gradient of the group's input, handed down (backward, not the first)
    Y: object = None  # (T, B, out) storage type: the group's last layer's y (forward)
    Xin: object = None  # (T, B, out) storage type: the y handed up by the group below (forward, not the first)


def acts_table(bs, n: int) -> np.ndarray:
    T = len(bs)
    a = np.full((T + n - 1, n), -1, dtype=np.int32)
    for l in range(n):
        a[l:l + T, l] = bs
    return a


def window(d, n: int):
    """The stacked GEMM inputs of step ``d`` = D[s] (B, n+1, out): (n, B, 2*out), layer l at slots l, l+1."""
    B, _, out = d.shape
    st = __import__("cupy").lib.stride_tricks if is_cupy(d) else np.lib.stride_tricks
    isz = d.itemsize
    return st.as_strided(d, shape=(n, B, 2 * out), strides=(out * isz, d.strides[0], isz))


def forward_steps(ops, mode: str, b: Bufs, first: bool, steps) -> None:
    """Diagonal steps ``steps`` of the forward loop (GEMMs and kernels only: capturable)."""
    n = b.O.shape[0]
    T = b.acts.shape[0] - n + 1
    ph = ops.placeholder(b.O.dtype)
    for s in steps:
        ops.gemm_layers(window(b.D[s], n), b.W, b.O, True, 0)
        ops.diag_forward(mode, b.O, b.bias, b.P0[min(s, T - 1)] if first else ph,
                         ph if b.C is None else b.C[s], ph if b.C is None else b.C[s + 1],
                         ph if b.G is None else b.G[s], b.D[s], b.D[s + 1], b.acts[s], first)


def backward_steps(ops, mode: str, b: Bufs, W, steps) -> None:
    """Diagonal steps ``steps`` (descending) of the backward loop; ``W`` the weights in F."""
    n = b.O.shape[0]
    T = b.acts.shape[0] - n + 1
    ph = ops.placeholder(b.O.dtype)
    for s in steps:
        t = s - (n - 1)
        ext = b.X[t] if b.X is not None and 0 <= t < T else None
        ops.diag_backward(mode, b.E[s + 1], b.E[s], ext, b.dhn, ph if b.DC is None else b.DC,
                          ph if b.G is None else b.G[s], ph if b.C is None else b.C[s + 1],
                          ph if b.C is None else b.C[s], b.D[s + 1], b.D[s], b.DG[s], b.acts[s], s, T)
        ops.gemm_layers(b.DG[s], W, b.E[s], False, 1)


# ---------------------------------------------------------------- building a group's buffers

def weights(spec, cells, layers, W, bias) -> None:
    """A group's layers' weights into ``W`` (n, GW, 2*out), storage type, and biases into ``bias`` (n, GW), F;
    what no parameter fills (layer 0's input half, GRU's gaps, absent biases) is zero. Each region is written
    once (a group's setup delays its loop: few launches)."""
    H, out = spec.hidden_size, spec.out_size
    f = bias.dtype
    add = __import__("cupy").add if is_cupy(W) else np.add
    if cells[layers[0]][0].b_ih is None:
        bias.fill(0)
    for i, layer in enumerate(layers):
        c = cells[layer][0]
        if not layer:
            W[i, :, :out] = 0
        if spec.mode == "gru":  # rows: r, z (input and hidden parts), n's input part, n's hidden part
            if layer:
                W[i, :3 * H, :out] = c.w_ih
            W[i, 3 * H:, :out] = 0
            W[i, :2 * H, out:] = c.w_hh[:2 * H]
            W[i, 2 * H:3 * H, out:] = 0
            W[i, 3 * H:, out:] = c.w_hh[2 * H:]
            if c.b_ih is not None:
                add(c.b_ih[:2 * H], c.b_hh[:2 * H], out=bias[i, :2 * H], dtype=f)
                bias[i, 2 * H:3 * H] = c.b_ih[2 * H:]
                bias[i, 3 * H:] = c.b_hh[2 * H:]
        else:
            if layer:
                W[i, :, :out] = c.w_ih
            W[i, :, out:] = c.w_hh
            if c.b_ih is not None:
                add(c.b_ih, c.b_hh, out=bias[i], dtype=f)


def forward_bufs(xp, pb, n: int, first: bool) -> Bufs:
    """A group's forward buffers (D zeroed: slot 0 of the first group stays zero, times its zero weights)."""
    spec = pb.spec
    T, B = pb.x.shape[:2]
    H, out = spec.hidden_size, spec.out_size
    S = T + n - 1
    store = pb.x.dtype
    f = compute_type(store)
    gw = rnn_diag_cells.gate_width(spec.mode, H)
    return Bufs(D=xp.zeros((S + 1, B, n + 1, out), dtype=store),
                C=xp.zeros((S + 1, n, B, H), dtype=f) if spec.mode == "lstm" else None,
                G=xp.zeros((S, n, B, 4 * H), dtype=f) if spec.mode in ("lstm", "gru") else None,
                O=xp.empty((n, B, gw), dtype=f), W=xp.empty((n, gw, 2 * out), dtype=store),
                bias=xp.empty((n, gw), dtype=f),
                P0=xp.empty((T, B, spec.gates * H), dtype=f) if first else None,
                acts=xp.asarray(acts_table(pb.bs, n)), Y=xp.empty((T, B, out), dtype=store),
                Xin=None if first else xp.empty((T, B, out), dtype=store))


def fill(b: Bufs, pb, cells, layers, P0, h0, c0) -> None:
    """Puts a call's weights, layer 0's projection and the initial states into ``b``."""
    weights(pb.spec, cells, layers, b.W, b.bias)
    if P0 is not None:
        b.P0[...] = P0
    for i, layer in enumerate(layers):
        b.D[i, :, i + 1] = 0 if h0 is None else h0[layer]
        if b.C is not None:
            b.C[i, i] = 0 if c0 is None else c0[layer]


def backward_bufs(xp, b: Bufs, mode: str) -> Bufs:
    """The backward buffers added to a copy of the saved forward ones (E and dG zeroed: idle slots stay zero)."""
    S1, n, B = b.D.shape[0], b.O.shape[0], b.D.shape[1]
    out, H = b.D.shape[3], b.O.shape[2] // (4 if mode in ("lstm", "gru") else 1)
    f = b.O.dtype
    T = S1 - n
    return Bufs(*(None if a is None else xp.empty_like(a) for a in (b.D, b.C, b.G)), O=b.O, W=None,
                bias=None, P0=None, acts=b.acts, E=xp.zeros((S1, n, B, 2 * out), dtype=f),
                DG=xp.zeros((S1 - 1, n, B, b.O.shape[2]), dtype=f),
                DC=xp.empty((n, B, H), dtype=f) if mode == "lstm" else None,
                X=xp.empty((T, B, out), dtype=f), dhn=xp.empty((n, B, out), dtype=f),
                Din=xp.empty((T, B, out), dtype=f))


def layer0_projection(pb, into=None):
    """x . W_ih_l0^T for all steps (T, B, G*H) in F (biases are in Bufs). Host arrays: one engine GEMM over every
    device; CuPy (``into``, group 0's buffer on x's device): one local GEMM on the calling stream, since the
    operands already sit there and an engine call would wait for both devices."""
    from .rnn_exec import _mm
    from .rnn_layer import CudaOps
    xp = pb.xp
    T, B, n_in = pb.x.shape
    x2 = xp.ascontiguousarray(pb.x).reshape(T * B, n_in)
    w = pb.spec.cells[0][0].w_ih
    if into is not None:  # (x and W_ih have one dtype: rnn_params checks it)
        CudaOps(pb.math).matmul(x2, xp.ascontiguousarray(w).T, into.reshape(T * B, -1))
        return into
    return _mm(x2, w.T, pb).reshape(T, B, -1)  # (float32 IEEE or float64 only: F is x's type)


class _Layer0:
    """Layer 0's projection (CuPy, several parts) computed part by part on a side stream, one part ahead of the
    loop: the loop's small-row GEMMs leave most of the device idle, so the projection fills it instead of
    delaying the first step by a whole T-step GEMM."""

    def __init__(self, pb, f, into, parts) -> None:
        from .rnn_layer import CudaOps, _side_stream
        xp = pb.xp
        T, B, n_in = pb.x.shape
        self.xp, self.into, self.T, self.B = xp, into.reshape(T * B, -1), T, B
        self.x2 = xp.ascontiguousarray(pb.x).reshape(T * B, n_in)
        self.w = xp.ascontiguousarray(pb.spec.cells[0][0].w_ih).T  # (a caller's parameter may be a strided view)
        self.rows = [(min(a, T), min(z, T)) for a, z in parts]
        self.ops = CudaOps(pb.math)
        self.side = _side_stream(xp.cuda.Device().id, "layer0")
        self.side.wait_event(xp.cuda.get_current_stream().record())
        self.events: dict = {}

    def _issue(self, part: int) -> None:
        if part < len(self.rows) and part not in self.events:
            t0, t1 = self.rows[part]
            if t1 > t0:
                with on_stream(self.side, self.xp):
                    self.ops.matmul(self.x2[t0 * self.B:t1 * self.B], self.w, self.into[t0 * self.B:t1 * self.B])
            self.events[part] = self.side.record()

    def join(self) -> None:
        """The current stream waits for every piece issued (also after an error: the buffer is the entry's)."""
        self.xp.cuda.get_current_stream().wait_event(self.side.record())

    def ready(self, part: int) -> None:
        """Before loop part ``part``: its rows are ordered before the current stream; the next part's issued."""
        self._issue(part)
        self._issue(part + 1)
        self.xp.cuda.get_current_stream().wait_event(self.events[part])


# ---------------------------------------------------------------- the executor

def groups_of(pl) -> list:
    return [tuple(l for l, row in enumerate(pl.cells) if row[0] == g) for g in range(pl.devices)]


def chunks(S: int, k: int) -> list:
    k = k or S
    return [(a, min(S, a + k)) for a in range(0, S, k)]


@dataclass
class Saved:
    """A diagonal forward's training state: per group its buffers (on its device) and its device."""
    groups: list  # [(layers, Bufs, device)]


def forward_part(ops, mode: str, b: Bufs, first: bool, steps, into: tuple, out: tuple, n: int) -> None:
    """A forward part's work on a group's buffers (what its graph holds): the rows handed up for times
    ``into`` (lo, hi) put into layer slot 0, the steps, then the group's y for times ``out`` (lo, hi) copied out
    (a part's ranges are fixed by the chunking, so each part's graph replays the same ones)."""
    if into[1] > into[0]:
        b.D[into[0]:into[1], :, 0] = b.Xin[into[0]:into[1]]
    forward_steps(ops, mode, b, first, steps)
    if out[1] > out[0]:
        b.Y[out[0]:out[1]] = b.D[out[0] + n:out[1] + n, :, n]


def forward(pb, pl, devs, keep: bool):
    """(y, h_n, c_n, Saved or None) of a unidirectional stack run diagonally as ``pl`` places it."""
    from . import rnn_graph
    from .rnn_exec import ops_for
    from .rnn_multi import _here, _local
    if rnn_layer.capturing_whole_call():
        raise rnn_layer.NotCapturable("the diagonal's groups issue from threads of their own")
    xp, spec = pb.xp, pb.spec
    T, B = pb.x.shape[:2]
    store, out, L = pb.x.dtype, spec.out_size, spec.num_layers
    f = compute_type(store)
    home = devs[0]
    groups = groups_of(pl)
    # an engine GEMM for host arrays, and inside a caller's graph capture (a network's chunk graph), where the local
    # GEMM's CuPy handle refuses to run; otherwise each group's own (rnn_multi.local_mm, _Layer0)
    capturing = xp is not np and xp.cuda.get_current_stream().is_capturing()
    P0 = layer0_projection(pb) if xp is np or capturing else None
    progress = [Progress(0) for _ in groups]
    ys = [None] * len(groups)  # each group's last layer's y (T, B, out): its buffers' Y, on its device
    done = [None] * len(groups)
    graphs = xp is not np and pb.graphs
    held = [None] * len(groups)  # (graph entry, event after the group's work): given back once every group is done

    def body(g, dev, started):
        layers = groups[g]
        lp = _local(pb, dev, home, only=[(layer, 0) for layer in layers])
        ops = ops_for(xp, pb.math)
        n, first = len(layers), layers[0] == 0
        S = T + n - 1
        parts = chunks(S, pl.chunk)
        if graphs:
            key = ("diag-fwd", dev, spec.mode, layers, T, B, out, spec.hidden_size, str(store), tuple(pb.bs),
                   ops.math, tuple(parts))
            e = rnn_graph.diag_entry(key, lambda: rnn_graph.Diag(xp, forward_bufs(xp, lp, n, first)))
            b = e.b
        else:
            b = forward_bufs(xp, lp, n, first)
        l0 = None
        try:
            if first and P0 is None:
                if len(parts) > 1:
                    l0 = _Layer0(lp, f, b.P0, parts)
                else:
                    layer0_projection(lp, into=b.P0)
            fill(b, lp, lp.spec.cells, layers, P0 if first else None, lp.h0, lp.c0)
            ys[g] = b.Y
            got, sent = 0, 0
            for part, (a, z) in enumerate(parts):
                into = (got, got)
                if g:
                    need = min(z, T)
                    if need > got:
                        wait_for(xp, progress[g - 1].wait(lambda v, need=need: v >= need))
                        hand_over(xp, b.Xin[got:need], ys[g - 1][got:need])
                        into, got = (got, need), need
                hi = max(sent, min(T, z - n + 1))
                if l0 is not None:
                    l0.ready(part)
                run = (lambda steps=range(a, z), into=into, o=(sent, hi):
                       forward_part(ops, spec.mode, b, first, steps, into, o, n))
                if graphs:
                    rnn_graph.run_part(ops, e, part, f, run)
                else:
                    run()
                started()
                if hi > sent:
                    sent = hi
                    progress[g].publish(hi, record(xp))
            if keep and graphs:
                b = Bufs(*(None if a is None else a.copy() for a in (b.D, b.C, b.G)), O=b.O, W=b.W.copy(),
                         bias=None, P0=None, acts=b.acts)
            hn = [b.D[T + i, :, i + 1].copy() for i in range(n)]
            cn = [b.C[T + i, i].copy() for i in range(n)] if b.C is not None else None
            done[g] = (b, hn, cn)
        finally:
            if l0 is not None:
                l0.join()
            if graphs:
                held[g] = (e, record(xp))

    try:
        run_groups(pb, devs, len(groups), body, progress)
        if held[-1] is not None:
            wait_for(xp, held[-1][1])
        y = xp.empty((T, B, out), dtype=store)
        hand_over(xp, y, ys[-1])
    finally:
        give_back(xp, held, devs)
    h_n = xp.empty((L, B, out), dtype=store)
    c_n = xp.empty((L, B, spec.hidden_size), dtype=store) if spec.mode == "lstm" else None
    for g, layers in enumerate(groups):
        _, hn, cn = done[g]
        for i, layer in enumerate(layers):
            h_n[layer] = _here(xp, hn[i])
            if c_n is not None:
                c_n[layer] = _here(xp, cn[i]).astype(store)
    if pb.lengths is not None:
        for t, a in enumerate(pb.bs):
            if a < B:
                y[t, a:] = 0
    saved = Saved([(layers, done[g][0], devs[g]) for g, layers in enumerate(groups)]) if keep else None
    return y, h_n, c_n, saved


def backward(pb, saved: Saved, gy, gh, gc) -> dict:
    """Every gradient of a diagonal forward: the diagonal loops in reverse (top group first, each a chunk
    ahead of the group below), then per layer the weight and bias gradients as single GEMMs on its device."""
    from . import rnn_graph
    from .rnn_exec import _f, _mm, ops_for
    from .rnn_multi import _here, local_mm
    xp, spec = pb.xp, pb.spec
    T, B = pb.x.shape[:2]
    store, out, H, L = pb.x.dtype, spec.out_size, spec.hidden_size, spec.num_layers
    f = compute_type(store)
    ng = len(saved.groups)
    devs = [dev for _, _, dev in saved.groups]
    progress = [Progress(T) for _ in range(ng)]
    dins = [None] * ng  # each group's gradient of its input (T, B, out): its buffers' Din, on its device
    res = [None] * ng
    graphs = xp is not np and pb.graphs
    dy = None if gy is None else _f(xp, gy, f)
    held = [None] * ng  # as in forward: (graph entry, event after the group's work)

    mm = (lambda a, b: _mm(a, b, pb)) if xp is np else local_mm(xp, f, pb.math)

    def body(g, dev, started):
        layers, fb, _ = saved.groups[g]
        ops = ops_for(xp, pb.math)
        n = len(layers)
        S = T + n - 1
        parts = chunks(S, 0 if ng == 1 else _chunk_of(pb, saved))
        W = fb.W.astype(f, copy=False)
        if graphs:
            key = ("diag-bwd", dev, spec.mode, layers, T, B, out, H, str(store), tuple(pb.bs), ops.math,
                   tuple(parts))
            e = rnn_graph.diag_entry(key, lambda: rnn_graph.Diag(xp, backward_bufs(xp, fb, spec.mode),
                                                                 xp.empty_like(W)))
            b = e.b
            for dst, src in ((b.D, fb.D), (b.C, fb.C), (b.G, fb.G), (e.w, W)):
                if src is not None:
                    dst[...] = src
            Wb = e.w
        else:
            b = backward_bufs(xp, fb, spec.mode)
            b.D, b.C, b.G = fb.D, fb.C, fb.G
            Wb = W
        try:
            for i, layer in enumerate(layers):
                b.dhn[i] = 0 if gh is None else _here(xp, gh[layer])
                if b.DC is not None:
                    b.DC[i] = 0 if gc is None else _here(xp, gc[layer])
            top = g == ng - 1
            if top:
                b.X[...] = 0 if dy is None else _here(xp, dy)
            dins[g] = b.Din if g else None
            have, sent = T, T
            for part in range(len(parts) - 1, -1, -1):
                a, z = parts[part]
                if not top:
                    need = max(0, a - n + 1)
                    if need < have:
                        wait_for(xp, progress[g + 1].wait(lambda v, need=need: v <= need))
                        hand_over(xp, b.X[need:have], dins[g + 1][need:have])
                        have = need
                lo = min(a, T) if g and a < sent else sent
                run = (lambda steps=range(z - 1, a - 1, -1), down=(lo, sent):
                       backward_part(ops, spec.mode, b, Wb, steps, down, out))
                if graphs:
                    rnn_graph.run_part(ops, e, part, f, run)
                else:
                    run()
                started()
                if lo < sent:
                    sent = lo
                    progress[g].publish(lo, record(xp))
            res[g] = _grads(xp, spec, layers, b, T, B, f, store, mm, pb)
        finally:
            if graphs:
                held[g] = (e, record(xp))

    try:
        run_groups(pb, devs, ng, body, progress, first=ng - 1)
    finally:
        give_back(xp, held, devs)
    grads = {}
    dh0 = xp.empty((L, B, out), dtype=store)
    dc0 = xp.empty((L, B, H), dtype=store) if spec.mode == "lstm" else None
    for g, (layers, _, _) in enumerate(saved.groups):
        gr, dh, dc = res[g]
        grads.update({k: _here(xp, v) for k, v in gr.items()})
        for i, layer in enumerate(layers):
            dh0[layer] = _here(xp, dh[i])
            if dc0 is not None:
                dc0[layer] = _here(xp, dc[i])
    dgx0 = grads.pop("_dgx0")
    cell = spec.cells[0][0]
    x2 = _f(xp, xp.ascontiguousarray(pb.x).reshape(T * B, -1), f)
    capturing = xp is not np and xp.cuda.get_current_stream().is_capturing()  # as in forward
    big = (lambda a, b: _mm(a, b, pb)) if xp is np or capturing else local_mm(xp, f, pb.math)
    grads["weight_ih_l0"] = big(dgx0.T, x2).astype(store)
    grads["input"] = big(dgx0, _f(xp, cell.w_ih, f)).reshape(T, B, -1).astype(store)
    grads["h0"] = dh0
    if dc0 is not None:
        grads["c0"] = dc0
    return {k: grads[k] for k in ["input", "h0"] + (["c0"] if dc0 is not None else []) + rnn_params.names(spec)}


def backward_part(ops, mode: str, b: Bufs, W, steps, down: tuple, out: int) -> None:
    """A backward part's work (what its graph holds): the steps, then the input gradient for times ``down``
    (lo, hi) copied out for the group below."""
    backward_steps(ops, mode, b, W, steps)
    if down[1] > down[0]:
        b.Din[down[0]:down[1]] = b.E[down[0]:down[1], 0, :, :out]


def _chunk_of(pb, saved: Saved) -> int:
    from . import rnn_plan
    return rnn_plan.plan(pb.spec.num_layers, 1, pb.x.shape[1], pb.x.shape[0], len(saved.groups)).chunk


def _grads(xp, spec, layers, b: Bufs, T: int, B: int, f, store, mm, pb):
    """A group's parameter gradients (its layer 0's W_ih and the input gradient are the caller's, from
    ``_dgx0``), its dh0 and dc0 per layer."""
    H, out = spec.hidden_size, spec.out_size
    gru = spec.mode == "gru"
    grads, dh0, dc0 = {}, [], []
    for i, layer in enumerate(layers):
        s = rnn_params.suffix(layer, 0)
        dg = xp.ascontiguousarray(b.DG[i:i + T, i]).reshape(T * B, -1)
        z = xp.ascontiguousarray(b.D[i:i + T, :, i:i + 2]).reshape(T * B, 2 * out)
        z = z if z.dtype == f else z.astype(f)
        if layer == 0:  # its input half multiplies zeros; W_ih_l0's gradient comes from x (the caller's)
            dwi, dwh = None, mm(dg.T, xp.ascontiguousarray(z[:, out:]))
            grads["_dgx0"] = dg[:, :spec.gates * H].copy()  # a copy: dg may be a view of the graph entry's buffers
        else:
            dw = mm(dg.T, z)
            dwi, dwh = dw[:, :out], dw[:, out:]
        db = col_sum(xp, dg)
        if gru:
            if layer:
                grads["weight_ih" + s] = dwi[:3 * H].astype(store)
            grads["weight_hh" + s] = xp.concatenate([dwh[:2 * H], dwh[3 * H:]]).astype(store)
            if spec.bias:
                grads["bias_ih" + s] = db[:3 * H].astype(store)
                grads["bias_hh" + s] = xp.concatenate([db[:2 * H], db[3 * H:]]).astype(store)
        else:
            if layer:
                grads["weight_ih" + s] = dwi.astype(store)
            grads["weight_hh" + s] = dwh.astype(store)
            if spec.bias:
                grads["bias_ih" + s] = db.astype(store)
                grads["bias_hh" + s] = db.astype(store)
        dh0.append(b.E[i, i, :, out:].astype(store))
        dc0.append(None if b.DC is None else b.DC[i].astype(store))
    return grads, dh0, dc0
