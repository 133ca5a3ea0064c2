"""The backward of a replayed training forward, replayed from one CUDA graph of its own.

A training forward replayed by rnn_replay returns a saved state that reads its slot's activations in place, at
addresses fixed for the slot's life. Its backward is then the same launches on the same buffers every time: the
general path issues them from Python (validation, per layer the step loop, the weight and input gradients' GEMMs,
copies between GPUs), which sets the time of a short call. Per slot and gradients' signature (:func:`key`: which
of grad_y, grad_h_n, grad_c_n are given, their shapes and types, the caller's stream) the first backward runs the
general path; the second runs it too (its answer is the call's) and then captures it on a stream of its own, with
the step loops inline (graph entries off; persistent loops allowed), every GEMM local with graph-owned cuBLAS
workspaces, temporaries and gradients in a private pool, its gradient buffers NaN while it captures; the graph is
then launched once on the call's gradients and kept only if it gives the general path's answer
(rnn_replay.CHECK_TOL). Later calls copy the gradients in, launch, and
copy fresh gradients out.

Invariants: a graph reads only its gradient buffers, the slot's activations and x, the parameters (the slot's
entry checks them on every forward) and its own memory; one backward at a time uses a graph's buffers (the slot's
lock; the next caller's stream waits for the last one's event); the slot's next forward replay waits for the
backward (the caller's ``rnn_replay.touched`` after it, whichever path ran it). A capture that fails or differs leaves the signature on the general path after
rnn_replay.TRIES; a dropped slot's backward graphs go with it (their pools retired).
"""

from __future__ import annotations

import dataclasses

import numpy as np


class _Back:
    """One slot's captured backward: its graph, gradient buffers, outputs and memory."""

    def __init__(self, graph, ins, out, keep, nbytes: int) -> None:
        self.graph, self.ins, self.out, self.keep, self.nbytes = graph, ins, out, keep, nbytes
        self.done = None  # event after its last replay


def key(grads):
    """The gradients' signature of a backward on the current stream, or None where this path never applies
    (a gradient not a CuPy array, a capture of the caller's under way)."""
    from . import rnn_replay
    if any(g is not None and type(g).__module__.split(".")[0] != "cupy" for g in grads):
        return None
    import cupy
    stream = cupy.cuda.get_current_stream()
    if stream.is_capturing():
        return None
    return tuple(rnn_replay._sig(g) for g in grads), stream.ptr


def call(saved, grads, general):
    """The gradients of ``saved``'s backward from its slot's graph, or None (the general path runs the call).
    ``grads``: (grad_y, grad_h_n, grad_c_n); ``general(saved, grads)``: the general backward (no ``touched``).
    A call that captures returns the general path's answer, computed first."""
    from . import rnn_replay
    s = getattr(saved, "replay_slot", None)
    if s is None or not rnn_replay.ENABLED:
        return None
    k = key(grads)
    if k is None:
        return None
    with s.lock:
        if s.graph is None:  # the slot was dropped (its memory lives on with this state): the general path
            return None
        b = s.backs.get(k)
        seen = s.back_seen.get(k, 0)
        if b is None:
            s.back_seen[k] = seen + 1
    if b is not None:
        return _replay(s, k, b, grads)
    if seen == 0 or s.back_fails.get(k, 0) >= rnn_replay.TRIES:
        return None
    res = _capture(s, k, saved, grads, general)
    rnn_replay._sweep()  # (a failed capture's pool, its arrays gone with its frames, as rnn_replay.call does)
    return res


def _replay(s, k, b: _Back, grads):
    """b's gradients for ``grads``, or None when the slot lost b since it was looked up (dropped, its pool freed):
    the general path runs the call."""
    import cupy

    from . import rnn_replay
    stream = cupy.cuda.get_current_stream()
    with s.lock:
        if s.backs.get(k) is not b:
            return None
        for ev in (s.done, b.done):  # the forward's replay, this graph's last user
            if ev is not None:
                stream.wait_event(ev)
        for buf, g in zip(b.ins, grads):
            if buf is not None:
                buf[...] = g
        b.graph.launch(stream)
        res = {name: a.copy() for name, a in b.out.items()}
        b.done = stream.record()
    with rnn_replay._lock:
        rnn_replay._stats["backward_replayed"] += 1
    return res


def _eager(saved):
    """``saved`` as the capture runs it: graph entries off (their events and graphs cannot be captured), no
    replay slot (the capture is the general path)."""
    return dataclasses.replace(saved, problem=dataclasses.replace(saved.problem, graphs=False))


def _capture(s, k, saved, grads, general) -> dict:
    """The call's gradients by the general path; then its backward captured, launched on the same gradients and
    kept as ``s.backs[k]`` if it gives the same answer."""
    import cupy

    from . import rnn_layer, rnn_replay
    caller = cupy.cuda.get_current_stream()
    want = general(saved, grads)  # (also builds what the capture needs: kernels, the ones rows)
    stream = cupy.cuda.Stream(non_blocking=True)
    ins = tuple(None if g is None else cupy.empty_like(g) for g in grads)
    workspaces = rnn_replay._workspaces(s.devices)
    pool = cupy.cuda.MemoryPool()
    plain = _eager(saved)
    stream.wait_event(caller.record())
    try:
        with stream:
            for buf in ins:  # NaN while capturing: work run then, outside the graph, cannot match below
                if buf is not None:
                    buf.fill(np.nan)
            with cupy.cuda.using_allocator(pool.malloc), rnn_layer.whole_call_capture(workspaces):
                stream.begin_capture()
                try:
                    out = general(plain, ins)
                except BaseException:
                    rnn_replay._end_quietly(stream)
                    raise
                graph = stream.end_capture()
            for buf, g in zip(ins, grads):
                if buf is not None:
                    buf[...] = g
            graph.launch(stream)
        caller.wait_event(stream.record())
        names = sorted(want)
        err = rnn_replay._worst(tuple(out[n] for n in names), tuple(want[n] for n in names))
        tol = rnn_replay.CHECK_TOL.get(np.dtype(saved.problem.x.dtype), 1e-3)
        if not err <= tol:
            raise rnn_layer.NotCapturable(f"the replayed backward differs from the general path by {err:.2e}")
    except Exception as exc:  # noqa: BLE001 - the general path's answer stands; the reason is kept
        caller.wait_event(stream.record())  # (ins, of the caller's stream, freed now: after the fills queued there)
        with s.lock:
            s.back_fails[k] = s.back_fails.get(k, 0) + 1
        rnn_replay._failed(exc)
        rnn_replay._retire(pool, s.devices)
        return want
    nbytes = rnn_replay._pool_bytes(pool, s.devices) + rnn_replay._own_bytes(workspaces) + \
        sum(a.nbytes for a in ins if a is not None)
    b = _Back(graph, ins, out, [pool, workspaces, stream], nbytes)
    b.done = caller.record()
    with s.lock:
        if s.graph is None:  # dropped meanwhile: nothing keeps this graph
            rnn_replay._retire(pool, s.devices)
            return want
        s.backs[k] = b
        s.nbytes += nbytes
    with rnn_replay._lock:
        rnn_replay._stats["backward_captured"] += 1
    return want
