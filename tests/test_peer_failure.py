"""A device that fails while a peer is copying from its tile cache: its memory stays until those copies are done
(the peer read garbage from a freed arena and cached it as a valid line: wrong answers, call after call)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import blasx
from blasx.runtime import coherence, worker as W
from blasx.runtime.devices.base import DeviceError


def test_a_failed_device_keeps_its_memory_until_peers_copies_from_it_are_done(monkeypatch):
    """Device 1 picks a complete line of device 0 as its source; before device 1 issues the copy (its block
    allocation may wait), device 0 breaks and its worker fails. Device 0 must not free its arena while device
    1's copy from it is pending; every answer is right, the read-only operands' cached lines too."""
    blasx.configure(devices="sim:2", tile=16, cache_bytes=1 << 20, streams=1)
    eng = blasx.engine()
    armed, fired, seen = threading.Event(), threading.Event(), {}
    peer_source = coherence.Directory.peer_source

    def picking(self, key, device, *a, **k):
        line = peer_source(self, key, device, *a, **k)
        if line is not None and line.ready is None and device == 1 and line.device == 0 and armed.is_set() \
                and not fired.is_set():
            fired.set()
            threading.current_thread().break_peer = True
        return line
    monkeypatch.setattr(coherence.Directory, "peer_source", picking)
    alloc = W.StreamWorker._alloc

    def allocating(self, nbytes, call):
        if getattr(self, "break_peer", False):
            self.break_peer = False
            d0 = eng.devices[0]
            d0.error = DeviceError("sim:0: injected stream failure")
            deadline = time.monotonic() + 10
            while eng.workers[0].alive and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # time for device 0's worker to close its device, were it allowed to
            seen["failed"], seen["arena kept"] = not eng.workers[0].alive, d0.arena is not None
        return alloc(self, nbytes, call)
    monkeypatch.setattr(W.StreamWorker, "_alloc", allocating)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((128, 128)), rng.standard_normal((128, 128))
    a.flags.writeable = b.flags.writeable = False  # their lines stay cached across calls
    want = a @ b
    armed.set()
    for _ in range(3):
        assert np.abs(blasx.gemm(1.0, a, b) - want).max() < 1e-12
    assert fired.is_set() and seen == {"failed": True, "arena kept": True}
    deadline = time.monotonic() + 10
    while eng.devices[0].arena is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.devices[0].arena is None and eng.directory.lent == [0, 0]  # closed once the copy was done


def test_a_closed_sims_memory_is_never_handed_out():
    from blasx.runtime.devices.sim import SimDevice
    d = SimDevice(0, nstreams=1, cache_bytes=1 << 16, name="sim:0")
    d.open()
    d.close()
    with pytest.raises(RuntimeError, match="closed"):
        d.arena_loc(0, 4, 4, np.float64)


def test_a_device_error_inside_a_steps_flush_unpins_its_peer_lines_once(monkeypatch):
    """The copy stream's entry is pushed (its peer lines released when it completes or is handed back), then the
    stream's wait raises: the same lines stayed in the step's fills too and were unpinned twice (a lending device's
    ``lent`` went negative, so its memory could be freed under a live peer copy)."""
    from blasx.runtime.devices import sim
    blasx.configure(devices="sim:2", tile=16, streams=1)
    eng = blasx.engine()
    state = {"armed": False, "fired": False}
    flush = W.StreamWorker._flush

    def flushing(self, s, fills):
        if state["armed"] and not state["fired"] and any(peers for _lines, peers in fills.values()):
            state["fired"] = True
            self.dev.boom = True  # the first wait of this flush raises, after its _push
        return flush(self, s, fills)
    monkeypatch.setattr(W.StreamWorker, "_flush", flushing)
    wait = sim.SimDevice.wait

    def waiting(self, s, event):
        if getattr(self, "boom", False):
            self.boom = False
            raise DeviceError(f"{self.name}: injected at a stream wait")
        return wait(self, s, event)
    monkeypatch.setattr(sim.SimDevice, "wait", waiting)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((128, 128))
    a.flags.writeable = False
    blasx.gemm(1.0, a, rng.standard_normal((128, 16)))  # a's tiles cached, spread over both sims
    state["armed"] = True
    for _ in range(20):
        b = rng.standard_normal((128, 128))
        assert np.abs(blasx.gemm(1.0, a, b) - a @ b).max() < 1e-10
        if state["fired"]:
            break
    assert state["fired"]
    deadline = time.monotonic() + 10
    while any(eng.directory.lent) and time.monotonic() < deadline:
        time.sleep(0.01)
    with eng.directory.lock:
        assert eng.directory.lent == [0, 0]
        assert not [line for alru in eng.directory.alrus for line in alru if line.readers < 0]
