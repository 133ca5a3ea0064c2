"""The groups of a diagonal stack (rnn_diag.py) side by side: one thread per group on its own device and stream,
the order the groups set up and issue in, the hand-offs between neighbours (a published time bound with the
CUDA event that orders it, one peer copy a chunk) and the graph entries given back once every group is done.

A group's body only issues work and holds the GIL while it does; the group that starts the wavefront (group 0
forward, the top group backward) sets up first and each other group once its predecessor has issued its first
chunk. A failing group fails every hand-off, so no neighbour waits forever, and the first real error is raised.
"""

from __future__ import annotations

import threading

import numpy as np


class Aborted(RuntimeError):
    """Raised in a group whose neighbour failed (the neighbour's own error is the one re-raised)."""


class Progress:
    """What a group has handed on so far: each published time bound with the CUDA event that orders it. A waiter
    gets the event of the *first* bound that satisfies it, not the latest: the publishing thread issues ahead of
    its device, so the latest event may stand several chunks further on."""

    def __init__(self, start: int) -> None:
        self.history, self.failed = [(start, None)], False
        self.cv = threading.Condition()

    @property
    def value(self) -> int:
        return self.history[-1][0]

    def publish(self, value: int, event) -> None:
        with self.cv:
            self.history.append((value, event))
            self.cv.notify_all()

    def fail(self) -> None:
        with self.cv:
            self.failed = True
            self.cv.notify_all()

    def wait(self, ok):
        with self.cv:
            self.cv.wait_for(lambda: self.failed or ok(self.value))
            if self.failed:
                raise Aborted("another group of the stack failed")
            return next(ev for v, ev in self.history if ok(v))


def run_groups(pb, devs, n: int, body, progress, first: int = 0) -> None:
    """body(g, dev, started) on one thread per group (rnn_multi._Threads: own stream per device); a failing
    group releases the others' waits; the first real error is re-raised.

    CuPy: group ``first`` (0: forward, n - 1: backward) sets up first, and each later group only once its
    predecessor has issued its first part (``started()``): a body holds the GIL while it issues, so a later
    group's setup would otherwise delay the group whose device starts the wavefront."""
    from .rnn_multi import _Threads
    pool = _Threads(pb, devs[:n])
    step = 1 if first == 0 else -1
    gates = [threading.Event() for _ in range(n)]
    gated = pb.xp is not np

    def guarded(g, dev):
        try:
            if gated and g != first:
                gates[g - step].wait()
                if progress[g - step].failed:
                    raise Aborted("another group of the stack failed")
            body(g, dev, gates[g].set)
        except BaseException:
            for p in progress:
                p.fail()
            raise
        finally:
            gates[g].set()
    for g in range(n):
        pool.start(devs[g], guarded, g, devs[g])
    pool.join(prefer=lambda e: not isinstance(e, Aborted))


def record(xp):
    return None if xp is np else xp.cuda.get_current_stream().record()


def wait_for(xp, ev) -> None:
    if ev is not None:
        xp.cuda.get_current_stream().wait_event(ev)


def hand_over(xp, dst, src) -> None:
    """Contiguous ``src`` (another group's, on its device) into ``dst`` on the current stream: one peer copy."""
    if xp is np:
        dst[...] = src
    elif dst.size:
        xp.cuda.runtime.memcpyPeerAsync(dst.data.ptr, dst.device.id, src.data.ptr, src.device.id, dst.nbytes,
                                        xp.cuda.get_current_stream().ptr)


def give_back(xp, held, devs) -> None:
    """A diagonal's graph entries (``held``: per group (entry, event after the group's work) or None) given back,
    each after every group's work: a group reads the y of the group below, or the input gradient of the group
    above, from that group's entry."""
    from . import rnn_graph
    ends = [h[1] for h in held if h is not None]
    for g, h in enumerate(held):
        if h is not None:
            with xp.cuda.Device(devs[g]):
                for ev in ends:
                    xp.cuda.get_current_stream().wait_event(ev)
                rnn_graph.release(h[0])
