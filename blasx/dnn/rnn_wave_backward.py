"""A wavefront stack's backward in its time pieces, so that its layer groups' devices work side by side.

Layer l's backward over steps t0..t1-1 needs the gradient of its output there, which is layer l+1's input
gradient over the same steps, and the state gradients its steps after t1 left. Run piece by piece, the last piece
first: layer l's piece p runs on the device and lane (stream) its forward ran on once layer l+1's piece p has
given its input gradient, from the state gradients of its own piece p+1; so the upper group works on piece p-1
while the lower one works on piece p. A layer's weight gradients are one GEMM each on its device after its first
piece, over the rows of all its pieces (their gate gradients kept until then).

Each piece is a one-layer backward (rnn_exec.direction_backward), so the pieces cost the host several times the
launches of a layer's backward: worth it where no host time is spent per piece, inside a whole-call capture of the
backward (rnn_replay_backward.py), which is where :func:`applies` takes it, for stacks over several devices (one
device's lanes run their backward layer after layer: the backward's loops overlap less than the forward's, and
the pieces cost more than that gains). Float16 and bfloat16 keep one weight GEMM a layer
(their gradients rounded once, as cuDNN's) and run layer after layer. :data:`ALWAYS` takes it outside captures
too (tests: it gives the layer-after-layer answer up to the order of the input-gradient sums).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import rnn_layer
from .args import same_view
from .rnn_layer import compute_type

ALWAYS = False  # pieces outside whole-call captures too


def applies(pb, layers) -> bool:
    """Whether the backward of ``layers`` (rnn_multi.Kept by layer) runs in the pieces of their wavefront."""
    if not layers or not layers[0] or not layers[0][0].pieces or len(layers[0]) != 1 or \
            np.dtype(pb.x.dtype).itemsize < 4:
        return False
    # (one device's lanes: layer after layer is faster, the backward's loops gaining less from overlapping)
    return ALWAYS or (pb.xp is not np and rnn_layer.capturing_whole_call() and len({k[0].dev for k in layers}) > 1)


def _same(a, b) -> bool:
    """Whether a and b are the same view of the same memory (a piece's gate gradient serves several operands)."""
    if a is None or b is None:
        return a is b
    return a is b or (a.dtype == b.dtype and same_view(a, b))


def run(pb, layers, dy, gh, gc, direction):
    """The backward of a wavefront stack in its pieces (module docstring). ``direction(lp, ops, layer, kept_piece,
    mm, (dy, dh, dc), defer)`` -> (_, dx, dh, dc) runs one piece of one layer on the current device, its weight
    gradients deferred (rnn_exec.direction_backward's ``defer``) to one GEMM each over the pieces; ``dy`` the
    top layer's output gradient in F (time-major) or None, ``gh``/``gc`` the final states' gradients or None.
    CuPy: issued from this thread, a stream a device (forked from the capture inside one), events where a piece's
    output gradient comes from another device. Returns (the weight gradients, the stack's input gradient, dh0 and
    dc0 by layer), on x's device."""
    from . import rnn_multi
    from .rnn_exec import ops_for
    xp, spec = pb.xp, pb.spec
    T = pb.x.shape[0]
    cuda = xp is not np
    home = pb.x.device.id if cuda else None
    L = spec.num_layers
    on = [layers[layer][0].dev for layer in range(L)]
    lanes = [(layers[layer][0].lane, on[layer]) for layer in range(L)]
    pieces = layers[0][0].pieces
    streams, cap = rnn_multi.fork_streams(xp, list(dict.fromkeys(lanes)), "wave_back") if cuda else ({}, None)
    mm = rnn_multi.local_mm(xp, compute_type(pb.x.dtype), pb.math) if cuda else None
    lps, sums, outs, events, carry = {}, [None] * L, {}, {}, {}
    parts = [[] for _ in range(L)]  # by layer: its pieces' weight-gradient operands, last piece first
    dx = [None]

    def piece(layer, p, t0, t1):
        dev, k = on[layer], layers[layer][0]
        if layer not in lps:
            lps[layer] = rnn_multi._local(pb, dev, home, only=((layer, 0),))
        if layer == L - 1:
            dy_p = None if dy is None else dy[t0:t1]
        else:
            if cuda and lanes[layer + 1] != lanes[layer]:
                streams[lanes[layer]].wait_event(events[(layer + 1, p)])
            dy_p = outs[(layer + 1, p)] if on[layer + 1] == dev else rnn_multi._here(xp, outs[(layer + 1, p)])
        last = p == len(pieces) - 1
        dh, dc = ((None if gh is None else gh[layer], None if gc is None else gc[layer]) if last
                  else carry[layer])
        sub = dataclasses.replace(lps[layer], x=k.inp[t0:t1], bs=tuple(pb.bs[t0:t1]), lengths=None)
        kp = rnn_multi.Kept(dev, k.inp[t0:t1], rnn_multi.piece_view(k.st, t0, t1), True)
        _, dxp, dh, dc = direction(sub, ops_for(xp, pb.math), layer, kp, mm, (dy_p, dh, dc), parts[layer])
        carry[layer] = (dh, dc)
        if p == 0:  # the layer's weight gradients: one GEMM each over its pieces' rows, in time order
            ops_of = parts[layer][::-1]
            joined = []
            for i in range(len(ops_of[0][0])):  # (operands that are one array in every piece: joined once)
                j = next((j for j in range(i) if all(_same(o[j], o[i]) for o, _ in ops_of)), None)
                joined.append(None if ops_of[0][0][i] is None else joined[j] if j is not None else
                              xp.concatenate([o[i] for o, _ in ops_of]))
            sums[layer] = ops_of[0][1](tuple(joined))
        if layer:
            outs[(layer, p)] = dxp  # (held to the end: another device's stream may still read it)
            if cuda and lanes[layer - 1] != lanes[layer]:
                events[(layer, p)] = streams[lanes[layer]].record()
        else:
            if dx[0] is None:
                dx[0] = xp.empty((T,) + dxp.shape[1:], dtype=dxp.dtype)
            dx[0][t0:t1] = dxp

    try:
        for p in range(len(pieces) - 1, -1, -1):
            t0, t1 = pieces[p]
            for layer in range(L - 1, -1, -1):
                rnn_multi.issue_on(xp, streams, lanes[layer], lambda layer=layer: piece(layer, p, t0, t1))
    except BaseException:
        for st in streams.values() if cap is None else ():  # (a capture ran nothing)
            st.synchronize()
        raise
    if cuda:
        rnn_multi.join_streams(xp, streams, cap)
    backward_on = rnn_multi.last_run().setdefault("backward_on", {})
    grads = {}
    for layer in range(L):
        grads.update({name: rnn_multi.at(xp, a, home) for name, a in sums[layer].items()})
        backward_on[(layer, 0)] = on[layer]
    dhs = [rnn_multi.at(xp, carry[layer][0], home) for layer in range(L)]
    dcs = [None if carry[layer][1] is None else rnn_multi.at(xp, carry[layer][1], home) for layer in range(L)]
    return grads, dx[0], dhs, dcs
