"""Runs a validated recurrent problem (rnn.py's Problem): the layers in order, each direction's input projection
as one engine GEMM (MIOpen eq. 12), its step loop (rnn_layer.py), and backward's single GEMMs for the input and
weight gradients of all steps (eq. 17, 19, 21). Directions and layers go to devices as rnn_plan.py decides.
"""

from __future__ import annotations

import numpy as np

from .. import numpy_api
from . import rnn_cells, rnn_layer
from .rnn_layer import CudaOps, HostOps, compute_type


def ops_for(xp, math: str):
    return HostOps(math) if xp is np else CudaOps(math)


def _mm(a, b, pb, out_dtype=None):
    """a . b on the engine (every configured device); float32 products in the call's math mode."""
    if rnn_layer.capturing_whole_call():  # the engine's workers would run it once, outside the graph
        raise rnn_layer.NotCapturable("an engine GEMM cannot be part of a captured call")
    f32 = a.dtype == np.float32 or out_dtype is not None
    return numpy_api.matmul(a, b, out_dtype=out_dtype, math=pb.math if f32 else None)


def _f(xp, a, f):
    return a if a.dtype == f else a.astype(f)


def project(pb, cell, inp, f, mm=None, into=None):
    """``inp . W_ih^T`` for all steps at once: (T, B, G*H) in F. ``mm``: a local GEMM instead of the engine's.
    ``into``: the F buffer to write (a local GEMM writes it directly)."""
    xp = pb.xp
    T, B, n_in = inp.shape
    x2 = xp.ascontiguousarray(inp).reshape(T * B, n_in)
    w = cell.w_ih
    if mm is None and rnn_layer.capturing_whole_call():  # on x's device's stream, into the graph
        from .rnn_multi import local_mm
        mm = local_mm(xp, f, pb.math)
    if mm is not None and into is None:
        return mm(x2, w.T).reshape(T, B, -1)
    if mm is not None:  # (rnn_multi.local_mm: the GEMM writes into it)
        mm(x2, w.T, out=into.reshape(T * B, -1))
        return into
    y = _mm(x2, w.T, pb, out_dtype=np.float32 if inp.dtype.itemsize < 4 else None).reshape(T, B, -1)
    if into is None:
        return y
    into[...] = y
    return into


def biases(pb, cell, f, out=None):
    """The step cell's bias in F (rnn_cells: the kernel adds it): ``b_ih + b_hh`` (G*H); GRU ``(b_ir + b_hr,
    b_iz + b_hz, b_in, b_hn)`` (4*H: b_hn sits inside the reset product); None for a layer without biases.
    ``out``: the F buffer to write (a graph entry's)."""
    if cell.b_ih is None:
        return None
    if out is None:
        out = pb.xp.empty(bias_size(pb.spec), dtype=f)
    rnn_cells.bias_sum(out, cell.b_ih, cell.b_hh, pb.spec.mode == "gru")
    return out


def bias_size(spec) -> int:
    """Elements of the step cell's bias (:func:`biases`): G*H, GRU 4*H (its b_hn kept apart)."""
    return (spec.gates + (spec.mode == "gru")) * spec.hidden_size


def input_projection(pb, cell, inp, f, mm=None):
    """(gx (T, B, G*H) in F, the cell's bias or None): :func:`project` and :func:`biases`."""
    return project(pb, cell, inp, f, mm=mm), biases(pb, cell, f)


def direction_forward(pb, ops, layer: int, d: int, inp, keep: bool = True, mm=None,
                      finals=None, lease: bool = False, into=None) -> rnn_layer.Forward:
    """One layer-direction's forward: projection, buffers with h0/c0, the step loop. ``keep=False`` (inference):
    a CUDA graph hands back only what the output needs (rnn_graph.run). ``mm``: the projection's GEMM on this
    device instead of the engine's. ``finals``: (h_n, c_n or None, written) of the whole stack: a persistent loop
    of the whole batch on h_n's device writes its final states there itself and adds its index to ``written``.
    ``lease`` (training, on x's device: the caller's stream, or a pool stream it then waits for): a graph loop's
    saved states stay in its entry (rnn_graph.run). ``into``: the Forward to write (views of a whole layer's
    buffers: a wavefront piece), with gates wherever the loop needs them."""
    spec, xp = pb.spec, pb.xp
    cell = spec.cells[layer][d]
    T, B = inp.shape[:2]
    store = inp.dtype
    f = compute_type(store)
    host = xp is np
    # (persistent loops also inside a caller's capture, where the graph entries are off)
    pl = None if host or not (pb.graphs or _capturing_with_graphs(xp)) else _persistent(pb, cell, store, B)
    graph = pl is None and not host and pb.graphs
    lease = lease and keep and graph and into is None
    st = into if into is not None else rnn_layer.forward_buffers(
        xp, spec.mode, T, B, spec.hidden_size, spec.out_size, bool(spec.proj_size), store, f,
        gates=keep or (pl is None and not graph), lean=lease)
    if graph and not keep and rnn_cells.SAVED[spec.mode]:  # the graph entry's own gates (no copy comes back)
        st.gates = rnn_layer.Like((T, B, rnn_cells.SAVED[spec.mode] * spec.hidden_size), f)
    k = layer * spec.num_dirs + d
    if pl is not None:  # the kernel adds the biases and writes zero initial states itself
        from . import rnn_persist
        if pb.h0 is not None:
            st.S[0] = pb.h0[k]
        if pb.c0 is not None and st.C is not None:
            st.C[0] = pb.c0[k]
        hn = cn = None
        if finals is not None and finals[0].shape[1] == B and finals[0].device.id == inp.device.id:
            hn, cn = finals[0][k], None if finals[1] is None else finals[1][k]
            finals[2].add(k)
        rnn_persist.run(pl, spec.mode, project(pb, cell, inp, f, mm=mm), cell.b_ih, cell.b_hh, cell.w_hh, st, pb.bs,
                        d == 1, pb.h0 is not None, pb.c0 is not None, hn=hn, cn=cn)
        return st
    if not host and pb.graphs:  # projection, biases and first states straight into the graph's buffers
        from . import rnn_graph
        gates = spec.gates * spec.hidden_size
        bias = None if cell.b_ih is None else rnn_graph.Like((bias_size(spec),), f)

        small = _small_prologue(mm, cell, inp)

        def fill(e):  # (with the prologue: only the first states given)
            if not small:
                project(pb, cell, inp, f, mm=mm, into=e.gx)
                if e.bias is not None:
                    biases(pb, cell, f, out=e.bias)
            if pb.h0 is not None or not small:
                e.st.S[0] = 0 if pb.h0 is None else pb.h0[k]
            if e.st.C is not None and (pb.c0 is not None or not small):
                e.st.C[0] = 0 if pb.c0 is None else pb.c0[k]

        def prologue(e):  # the projection of e.x, the bias and zero first states, on e's buffers (no allocation)
            ops.gemm(e.x.reshape(T * B, -1), cell.w_ih, e.gx.reshape(T * B, -1), True)
            if e.bias is not None:
                ops.bias(e.bias, cell.b_ih, cell.b_hh, spec.mode == "gru")
            if pb.h0 is None:
                ops.copy(e.st.S[0], 0)
            if e.st.C is not None and pb.c0 is None:
                ops.copy(e.st.C[0], 0)
        sources = None if not small else (
            tuple(None if a is None else (a.data.ptr, a.strides, a.dtype)
                  for a in (cell.w_ih, cell.w_hh, cell.w_hr, cell.b_ih, cell.b_hh)), pb.h0 is None, pb.c0 is None)
        rnn_graph.run(ops, spec.mode, rnn_graph.Like((T, B, gates), f), cell.w_hh, cell.w_hr, bias, st,
                      rnn_graph.Like((B, gates), f), pb.bs, d == 1, keep=keep, fill=fill, lease=lease,
                      x=inp if small else None, prologue=prologue if small else None, sources=sources)
        return st
    gx, bias = input_projection(pb, cell, inp, f, mm=mm)
    if pb.h0 is None:
        st.S[0] = 0
    else:
        st.S[0] = pb.h0[k]
    if st.C is not None:
        st.C[0] = 0 if pb.c0 is None else pb.c0[k]
    w_hh = _f(xp, cell.w_hh, f) if host else cell.w_hh
    w_hr = None if cell.w_hr is None else (_f(xp, cell.w_hr, f) if host else cell.w_hr)
    gh = xp.empty((B, gx.shape[2]), dtype=f)
    if not host:  # launched from Python (graphs off), with the graph loop's GEMM settings
        from . import rnn_graph
        rnn_graph.run_eager(ops, spec.mode, gx, w_hh, w_hr, bias, st, gh, pb.bs, d == 1)
    else:
        rnn_layer.forward_loop(ops, spec.mode, gx, w_hh, w_hr, bias, st, gh, pb.bs, d == 1)
    return st


PROLOGUE_BYTES = 8 << 20  # inputs at most this large are copied into a graph entry, whose graph projects them


def _small_prologue(mm, cell, inp) -> bool:
    """Whether a graph loop's projection, bias and zero first states replay from a graph of their own
    (rnn_graph.run's ``prologue``): a local GEMM (``mm``) of one type on contiguous weights, a small input (the
    copy into the entry costs the GPU little, the launches it saves cost the host more)."""
    w = cell.w_ih
    return mm is not None and inp.nbytes <= PROLOGUE_BYTES and w.dtype == inp.dtype \
        and (w.flags.c_contiguous or w.flags.f_contiguous)


def _capturing_with_graphs(xp) -> bool:
    from . import rnn_graph
    return rnn_graph.enabled() and xp.cuda.get_current_stream().is_capturing()


def _persistent(pb, cell, store, B: int):
    """rnn_persist's plan for this layer-direction on the current GPU, or None (the graph loop runs)."""
    from . import rnn_persist
    w = cell.w_hh
    if cell.w_hr is not None or any(a is not None and (a.dtype != store or not a.flags.c_contiguous)
                                    for a in (w, cell.b_ih, cell.b_hh)) or w.data.ptr % 16:
        return None
    return rnn_persist.applies(pb.spec.mode, store, B, pb.spec.hidden_size, pb.xp.cuda.Device())


def _persistent_backward(pb, cell, store, st):
    """rnn_persist's backward plan for this LSTM layer-direction on the current GPU, or None (the graph loop)."""
    from . import rnn_persist
    if cell.w_hr is not None or st.gates is None or st.C is None or cell.w_hh.dtype != store \
            or not cell.w_hh.flags.c_contiguous:
        return None
    return rnn_persist.applies_backward(pb.spec.mode, store, st.S.shape[1], pb.spec.hidden_size, pb.xp.cuda.Device())


def direction_output(pb, st: rnn_layer.Forward, reverse: bool):
    """The direction's y (T, B, out) in time order, zero past each sequence's end."""
    T = st.S.shape[0] - 1
    y = st.S[T:0:-1] if reverse else st.S[1:]
    if pb.lengths is not None:
        y = y.copy()
        for t, a in enumerate(pb.bs):
            if a < y.shape[1]:
                y[t, a:] = 0
    return y


def forward(pb, keep: bool):
    """(y (T, B, D*out), h_n, c_n, saved layers) of the whole stack, all time-major; the loops placed by
    rnn_plan.py (rnn_multi.py runs them)."""
    from . import rnn_diag, rnn_graph, rnn_multi
    spec, xp = pb.spec, pb.xp
    T, B = pb.x.shape[:2]
    store = pb.x.dtype
    dirs = spec.num_dirs
    pl, devs = rnn_multi.placement(pb, training=keep)
    if pl.kind == "diagonal":
        rnn_multi.last_run()["ran_on"].update({(layer, 0): devs[row[0]] for layer, row in enumerate(pl.cells)})
        return rnn_diag.forward(pb, pl, devs, keep)
    h_n = xp.empty((spec.num_layers * dirs, B, spec.out_size), dtype=store)
    c_n = xp.empty((spec.num_layers * dirs, B, spec.hidden_size), dtype=store) if spec.mode == "lstm" else None
    written: set = set()  # layer-directions whose loop wrote its final states into h_n / c_n
    finals = None if xp is np else (h_n, c_n, written)
    layers, y = rnn_multi.run_forward(
        pb, pl, devs, lambda lp, ops, layer, d, inp, mm=None, lease=False, into=None: direction_forward(
            lp, ops, layer, d, inp, keep=keep, mm=mm, finals=finals if into is None else None, lease=lease,
            into=into),
        direction_output, keep)
    for layer, kept in enumerate(layers):
        for d, k in enumerate(kept):
            if layer * dirs + d in written:
                continue
            h_n[layer * dirs + d] = rnn_multi.at(xp, k.st.S[T], devs[0])
            if c_n is not None:
                c_n[layer * dirs + d] = rnn_multi.at(xp, k.st.C[-1], devs[0])  # rounded to x's type as it is stored
                rnn_graph.touched(k.st)
    return y, h_n, c_n, (layers if keep else None)


def _flat(xp, a, f):
    return xp.ascontiguousarray(_f(xp, a, f)).reshape(-1, a.shape[-1])


def backward(pb, layers, gy, gh, gc) -> dict:
    """Every gradient (MIOpen eq. 15-21): step loops in reverse (on CUDA replayed from graphs, rnn_graph.py),
    then one GEMM per weight and per input. A layer's directions run on the devices their forward ran on (at once
    when those differ, rnn_multi.run_backward); only the gradients come home. A wavefront's stack inside a
    whole-call capture runs in its time pieces (rnn_wave_backward.py)."""
    from . import rnn_diag, rnn_graph, rnn_multi, rnn_params, rnn_wave_backward
    if isinstance(layers, rnn_diag.Saved):
        return rnn_diag.backward(pb, layers, gy, gh, gc)
    spec, xp = pb.spec, pb.xp
    store = pb.x.dtype
    f = compute_type(store)
    T, B = pb.x.shape[:2]
    out, dirs, hh = spec.out_size, spec.num_dirs, spec.hidden_size
    home = None if xp is np else pb.x.device.id
    loop = rnn_layer.backward_loop
    if xp is not np and pb.graphs:
        loop = rnn_graph.run_backward
    grads = {}
    dh0 = xp.empty((spec.num_layers * dirs, B, out), dtype=store)
    dc0 = xp.empty((spec.num_layers * dirs, B, hh), dtype=store) if spec.mode == "lstm" else None
    dy = None if gy is None else _f(xp, gy, f)
    rnn_multi.last_run()["backward_on"] = {}

    def away(a, k):
        """A slice another device will read: contiguous, so that it copies there in one piece."""
        return a if a is None or xp is np or k.dev == home else xp.ascontiguousarray(a)

    if rnn_wave_backward.applies(pb, layers):
        g, dy, dhs, dcs = rnn_wave_backward.run(
            pb, layers, dy, gh, gc, lambda lp, ops, layer, k, mm, args, defer: direction_backward(
                pb, loop, layer, lp, ops, 0, k, mm, args, defer))
        grads.update(g)
        for layer in range(spec.num_layers):
            dh0[layer] = dhs[layer]
            if dc0 is not None:
                dc0[layer] = dcs[layer]
        layers = []
    side = _side_weights(pb, layers, home)
    deferred, held, forked = [], [], None
    for layer in range(len(layers) - 1, -1, -1):
        kept = layers[layer]
        args = [tuple(away(a, k) for a in (None if dy is None else dy[..., d * out:(d + 1) * out],
                                           None if gh is None else gh[layer * dirs + d],
                                           None if gc is None else gc[layer * dirs + d]))
                for d, k in enumerate(kept)]

        def direction(lp, ops, d, k, mm, layer=layer, args=args):
            return direction_backward(pb, loop, layer, lp, ops, d, k, mm, args[d], deferred if side else None)

        dx = None
        for d, (g, dxd, dh, dc) in enumerate(rnn_multi.run_backward(pb, layer, kept, direction)):
            grads.update({name: rnn_multi.at(xp, a, home) for name, a in g.items()})
            dxd = rnn_multi.at(xp, dxd, home)
            part = dxd[::-1] if d == 1 else dxd
            dx = part if dx is None else dx + part  # (direction 0's is a fresh array of this call's)
            dh0[layer * dirs + d] = rnn_multi.at(xp, dh, home)
            if dc0 is not None:
                dc0[layer * dirs + d] = rnn_multi.at(xp, dc, home)
        if deferred:  # this layer's weight GEMMs on a side stream, beside the layers below (operands held to the join)
            batch = list(deferred)
            deferred.clear()
            held.append(batch)
            if forked is None:
                forked = rnn_multi.fork_streams(xp, [(1, home)], "weights")
            else:  # (the side stream after this layer's work too)
                forked[0][(1, home)].wait_event(forked[1].record())
            rnn_multi.issue_on(xp, forked[0], (1, home), lambda b=batch: [grads.update(fn(p)) for p, fn in b])
        dy = dx
    if forked is not None:
        rnn_multi.join_streams(xp, *forked)
    rnn_multi.last_run()["weights_beside"] = len(held)
    grads["input"] = dy if dy.dtype == store else dy.astype(store)  # (dy: this call's own array)
    grads["h0"] = dh0
    if dc0 is not None:
        grads["c0"] = dc0
    return {k: grads[k] for k in ["input", "h0"] + (["c0"] if dc0 is not None else []) + rnn_params.names(spec)}


SIDE_WEIGHTS = True  # (a switch for A/Bs)


def _side_weights(pb, layers, home) -> bool:
    """Whether each layer's weight gradients go to a side stream, off the path of the layers below it (whose step
    loops leave most SMs idle): inside a whole-call capture, with every direction on the caller's device."""
    return (SIDE_WEIGHTS and pb.xp is not np and rnn_layer.capturing_whole_call()
            and all(k.dev == home for kept in layers for k in kept))


def direction_backward(pb, loop, layer: int, lp, ops, d: int, k, mm, args, defer=None):
    """One layer-direction's backward loop and GEMMs on its device: (weight grads, dx in processing order, dh0,
    dc0). ``k``: its rnn_multi.Kept (states and input; a wavefront piece: views of its time slice), ``args``: (dy,
    the gradients of its final h and c) on its device or another, ``loop``: rnn_layer.backward_loop or
    rnn_graph.run_backward; ``mm``: a GEMM on this device (None: the engine's). ``defer`` (a list): the weight
    and bias gradients are not computed; (their operands, a function of the operands of several pieces joined in
    time order that gives them) is appended instead, and an empty dict returned in their place."""
    from . import rnn_graph, rnn_multi, rnn_params
    spec, xp = pb.spec, pb.xp
    store = pb.x.dtype
    f = compute_type(store)
    # the weight and input gradients' GEMMs take float16 operands (the gate gradients rounded once, as cuDNN keeps
    # them; float32 accumulation and result): tensor-core GEMMs instead of float32 ones on twice the bytes
    g_t = store if store == np.float16 else f
    T, B, n_in = k.inp.shape
    dirs, hh = spec.num_dirs, spec.hidden_size
    here = rnn_multi._here
    cell, st, rev = lp.spec.cells[layer][d], k.st, d == 1
    dy_d, gh_d, gc_d = (None if a is None else here(xp, a) for a in args)
    mul = (lambda a, b: _mm(a, b, pb, out_dtype=f if g_t != f else None)) if mm is None else mm

    def wgrad(a, b):
        """A weight gradient (or the stack's input gradient) in the storage type: float16 operands give it
        straight from the GEMM (float32 accumulation, rounded once), others through F."""
        if g_t == f:
            return mul(a, b).astype(store, copy=False)  # (a fresh array: no copy when F is the store)
        if mm is None:
            return _mm(a, b, pb)
        return mm(a, b, out=xp.empty((a.shape[0], b.shape[1]), dtype=store))
    # float16 on CUDA: the loop's GEMMs take dgh rounded to float16 and the weights as stored (tensor cores)
    half = xp is not np and store == np.float16 and cell.w_hr is None
    w_loop = xp.ascontiguousarray(cell.w_hh) if half else _f(xp, cell.w_hh, f)
    w_hr_f = None if cell.w_hr is None else _f(xp, cell.w_hr, f)

    def weights(parts) -> dict:
        """The weight and bias gradients from (input, gate gradients as the GEMMs take them (x side, h side), h
        before each step, the gate gradients in F (x side, h side or None: the same), the projection's output
        gradient and R or None), each with its time steps' rows."""
        xin, gx_t, gh_t, s_in, dgx, dgh, dhs, r = parts
        s, g = rnn_params.suffix(layer, d), {}
        g["weight_ih" + s] = wgrad(gx_t.T, xin)
        g["weight_hh" + s] = wgrad(gh_t.T, s_in)
        if cell.b_ih is not None:
            g["bias_ih" + s] = rnn_layer.col_sum(xp, dgx, f).astype(store, copy=False)
            g["bias_hh" + s] = g["bias_ih" + s].copy() if dgh is None else \
                rnn_layer.col_sum(xp, dgh, f).astype(store, copy=False)
        if dhs is not None:
            g["weight_hr" + s] = mul(dhs.T, r).astype(store, copy=False)
        return g

    def consume(bw, owned: bool = False):
        """The weight, bias and input gradients from the loop's result (a graph entry's own buffers, read in
        place before the entry goes back); dh and dc copied unless ``owned`` (arrays of this call's)."""
        g = {}
        if bw.dgx is None:  # the narrow form: only the rounded gradients (GRU's input side in x16)
            same = bw.x16 is None  # (all but GRU: one gate gradient for both sides)
            gh_t = bw.g16.reshape(T * B, -1)
            gx_t = gh_t if same else bw.x16.reshape(T * B, -1)
            dgx, dgh = gx_t, gh_t  # (their column sums accumulate in F)
        else:
            same = bw.dgh is bw.dgx
            dgx, dgh = bw.dgx.reshape(T * B, -1), bw.dgh.reshape(T * B, -1)
            if bw.g16 is not None:  # the rounded dgh the loop kept
                gh_t = bw.g16.reshape(T * B, -1)
                gx_t = gh_t if same else _f(xp, dgx, g_t)
            else:
                gx_t = _f(xp, dgx, g_t)
                gh_t = gx_t if same else _f(xp, dgh, g_t)
        parts = (_flat(xp, k.inp[::-1] if rev else k.inp, g_t), gx_t, gh_t, _flat(xp, st.S[:T], g_t), dgx,
                 None if same else dgh,
                 None if cell.w_hr is None else _f(xp, bw.dhs.reshape(T * B, -1), g_t),
                 None if cell.w_hr is None else _flat(xp, st.R, g_t))
        if defer is None:
            g = weights(parts)
        else:
            defer.append((parts if owned else tuple(None if a is None else a.copy() for a in parts), weights))
        dh, dc = (bw.dh, bw.dc) if owned else (bw.dh.copy(), None if bw.dc is None else bw.dc.copy())
        final = layer == 0 and dirs == 1 and g_t != f  # the input gradient itself: no F copy first
        return g, (wgrad if final else mul)(gx_t, _f(xp, cell.w_ih, g_t)).reshape(T, B, n_in), dh, dc
    # (persistent loops also inside a whole-call capture of the backward, where the graph entries are off)
    pbw = _persistent_backward(lp, cell, store, st) \
        if loop is not rnn_layer.backward_loop or (xp is not np and _capturing_with_graphs(xp)) else None
    if pbw is not None:  # the whole loop in one launch (rnn_persist_bwd)
        from . import rnn_persist

        def f32(a):
            return None if a is None else xp.ascontiguousarray(a, dtype=np.float32)
        dgx, g16, dh, dc = rnn_persist.run_backward(pbw, st.gates, st.C, cell.w_hh, f32(dy_d), f32(gh_d),
                                                    f32(gc_d), lp.bs, rev)
        rnn_graph.touched(st)  # (a graph entry's, when its forward leased them)
        return consume(rnn_layer.Backward(dgx, dgx, None, dh, dc, g16), owned=True)
    args_d = (ops, spec.mode, st, w_loop, w_hr_f, dy_d, gh_d, gc_d, lp.bs, rev, hh)
    if loop is rnn_layer.backward_loop:
        return consume(loop(*args_d), owned=True)
    return loop(*args_d, use=consume)
