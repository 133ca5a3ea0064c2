"""The stream worker: Algorithm 1, lines 8-25 (``ComputingKernel``), for ``cuda`` and ``sim`` devices.

One thread per device (queue side: :mod:`.worker_base`; assign step: :mod:`.assign`; in-flight records:
:mod:`.inflight`; the CPU thread: :mod:`.cpu_worker`). Its loop: **retire** what completed events end;
**fill** the station from the queues, or steal; **assign** free streams their tasks (Eq. 3); **issue** one
k-step of every active task in turn: acquire A and B through the cache (L1 hit, L2 peer copy or host load),
launch the kernel, record one event; after the last step, epilogue, write-back (M -> I) and completion event.
Only allocation blocks, when every line is busy. An error of one call fails that call alone (``issue``);
a device error ends in ``Worker.fail``, which hands the unfinished tasks to the engine.
"""

from __future__ import annotations

import time
from collections import deque

from .cache import Line
from .cpu_worker import CpuWorker
from .derived import source_of
from .devices.base import ArraySource, DerivedSource, HostSource, PeerSource
from .inflight import _Active, _Pending, _StepWork
from .assign import StreamAssign
from .tasks import SC_ZERO
from .worker_base import Worker

__all__ = ["CacheFull", "CpuWorker", "StreamWorker", "Worker"]


def _loc(dev, offset: int, call, slot: int, rows: int, cols: int, dtype=None):
    """The Loc of a tile of ``call``'s operand ``slot`` in a heap block: its device type (or ``dtype``) and ld."""
    dt = call.tile_dtype(slot) if dtype is None else dtype
    ld = call.tile_ld(slot, rows)
    if ld == rows:
        return dev.arena_loc(offset, rows, cols, dt)
    return dev.arena_loc(offset, rows, cols, dt, ld=ld)


class CacheFull(MemoryError):
    """A device's tile cache cannot hold what a call needs now (that call fails; the device lives)."""


FILLING = object()  # a line's ready marker while its fill is being issued on this very stream


class StreamWorker(StreamAssign, Worker):
    """Drives one stream device: retire, fill, assign, issue (the module docstring)."""

    def __init__(self, engine, device, station, core=None) -> None:
        super().__init__(engine, device, station, core)
        n = device.nstreams
        self.slots: list[_Active | None] = [None] * n
        # One deque per stream, compute and copy streams alike (events complete in order within one).
        self.pending: list[deque[_Pending]] = [deque() for _ in range(device.n_all_streams)]
        self.inflight = 0  # tasks started and not yet retired
        self.inflight_of: dict = {}  # call -> its tasks among them (read lock-free by peers)
        self.max_inflight = 2 * n
        self.issued_work = 0.0  # flops of issued kernels whose events have not retired
        self.seq = 0
        self.directory = engine.directory
        self.alru = engine.directory.alrus[self.idx]
        streamed = [d for d in engine.devices if d.streamed]
        self.n_devices = len(streamed)
        self.rank = streamed.index(device)
        self.knobs = engine.config.knobs  # for chain_kernels, late_c, peer_wait_if_sooner: read at start
        self._chain = None  # (event after the last kernel issued, its stream)
        # Host-link backlog in bytes, issued and retired: peers read it to decide whether to wait for our fills.
        self.h2d_issued = 0
        self.h2d_done = 0
        self._h2d_pushed = 0  # h2d_issued as of the last event pushed on the h2d stream
        self._work: _StepWork | None = None  # what the step being issued holds (issue)

    # ---------------------------------------------------------------- loop
    def loop(self) -> None:
        eng = self.engine
        while True:
            gen = eng.work_generation
            self.retire()
            self.fill_station()
            self.assign()
            active = [s for s, a in enumerate(self.slots) if a is not None]
            if active:
                progressed = [self.issue(s) for s in active]  # one step of every active task
                if any(progressed) or self._abandon_lost():
                    continue
                # Every active task waits at a gate: sleep until our oldest operation or another device's task ends.
            if any(self.pending):
                self.wait_oldest()
                continue
            if self.stopping and len(self.station) == 0 and not active:
                return
            if self._work_waiting():
                continue  # e.g. assign() just dropped cancelled tasks: pull again, don't sleep
            eng.wait_for_work(gen)

    # ---------------------------------------------------------------- retire
    def retire(self) -> bool:
        finished = []
        try:
            for dq in self.pending:
                while dq and self.dev.done(dq[0].event):
                    finished.append(dq.popleft())
        finally:
            # Even if done() raised (the device broke), completed tasks are accounted, their peer reads released.
            if finished:
                # Records first: a call may complete below, and its caller then reads the profile.
                for stats, rec in self.dev.take_records():
                    stats.add_record(rec)
                for p in finished:
                    self._complete(p)
                    if self._chain is not None and self._chain[0] is p.event:
                        self._chain = None  # done: nothing left to wait for (and never wait on a reused event)
                    self.dev.release_event(p.event)
                if not self.pending[self.dev.h2d_stream]:
                    self.h2d_done = self._h2d_pushed  # every host load pushed so far is done
        return bool(finished)

    def _complete(self, p: _Pending) -> None:
        if p.release or p.ready:
            directory = self.directory
            with directory.lock:
                for line in p.release:
                    if line.device != self.idx:
                        directory.unlend(line)
                    else:
                        line.readers -= 1
                for line in p.ready:
                    if line.ready is p.event:
                        line.ready = None
        for off in p.free:
            self.dev.heap.free(off)
        self.h2d_done += p.h2d_bytes
        self.issued_work -= p.work
        if p.computed is not None:
            p.computed.call.computed(p.computed)
        # Steps, tasks and flops count as they complete, for a call still running (a task handed on from a broken
        # device counts once, where it completes; a cancelled call's skipped work not at all).
        if p.step_of is not None and not p.step_of.call.failed:
            p.step_of.call.stats.owned_row(self.idx)["steps"] += 1
        if p.finished and not p.task.call.failed:
            row = p.task.call.stats.owned_row(self.idx)
            row["tasks"] += 1
            row["flops"] += p.task.flops
        if p.finished:
            self._ended(p.task)
            p.task.call.account(p.task, self.idx)

    def wait_oldest(self) -> None:
        oldest = min((dq[0] for dq in self.pending if dq), key=lambda p: p.seq)
        self.dev.sync(oldest.event)
        self.retire()

    def _push(self, s: int, event, **kw) -> None:
        if s == self.dev.h2d_stream:  # this event ends every host load issued since the last one
            kw["h2d_bytes"] = self.h2d_issued - self._h2d_pushed
            self._h2d_pushed = self.h2d_issued
        self.seq += 1
        self.pending[s].append(_Pending(event, self.seq, **kw))

    def _ended(self, task) -> None:
        """``task`` is retired from this device, or handed back."""
        self.inflight -= 1
        self.inflight_of[task.call] -= 1
        if not self.inflight_of[task.call]:
            del self.inflight_of[task.call]

    def holding(self, call) -> int:
        return super().holding(call) + self.inflight_of.get(call, 0)

    def held_snapshot(self) -> tuple:
        slots = tuple(a.task for a in tuple(self.slots) if a is not None)  # before pending: tasks move on
        pending = tuple(p.task for dq in tuple(self.pending) for p in tuple(dq) if p.task is not None)
        return super().held_snapshot() + slots + pending

    def has_runnable(self) -> bool:
        return self.inflight > 0 or super().has_runnable()

    # ---------------------------------------------------------------- issue
    def issue(self, s: int) -> bool:
        """Issue the next k-step (or write-back) of stream ``s``'s task; False at a gate. A call's own error ends it."""
        act = self.slots[s]
        work = self._work = _StepWork()
        try:
            progressed = self._issue(s, act, work)
        except Exception as exc:  # noqa: BLE001 - a device error goes on to fail(); a call error stops here
            if self.device_error(exc):
                raise  # self._work stays: held_tasks unpins the peer lines it read
            act.task.call.fail(exc)  # its other tasks stop too; this step's lines and buffers go with the task
            self._flush(s, work.fills)
            self._stop_task(s, act, tuple(work.release), tuple(work.extra))
            progressed = True
        self._work = None
        return progressed

    def _stop_task(self, s: int, act: _Active, release: tuple = (), extra: tuple = ()) -> None:
        """Take the task off stream ``s``: its lines and buffers are released, and it is accounted, at an
        event after what was issued (a C or late-C copy may still be filling a buffer)."""
        dev = self.dev
        self.slots[s] = None
        h2d = dev.record(dev.h2d_stream)
        self._push(dev.h2d_stream, h2d)
        dev.wait(s, h2d)
        self._push(s, dev.record(s), release=release, free=act.buffers() + extra, task=act.task, finished=True)

    def _issue(self, s: int, act: _Active, work: "_StepWork") -> bool:
        task, call, dev = act.task, act.task.call, self.dev
        if call.failed:  # stop early; free the buffers once the issued work is done
            self._stop_task(s, act)
            return True
        nsteps = len(act.steps)
        if task.gates and not call.gate_open(task, act.k):
            return False
        if act.k == nsteps:  # a write-back that waited for its gate
            self._finish(s, act, None)
            return True
        row = call.stats.owned_row(self.idx)
        fills = work.fills
        if act.k == 0 and act.c_loc is None:
            self._start_c(s, act, fills)
        if act.late and act.k == nsteps - 2:
            # Fetch the old C now, one step before it is folded in (Knobs.late_c).
            src = task.c_init or task.c
            act.old_off = self._alloc(call.tile_nbytes(src.slot, src.rows, src.cols), call)
            act.old_loc = _loc(dev, act.old_off, call, src.slot, src.rows, src.cols)
            cs = self._load(act.old_loc, src, call, task)
            act.old_ready = dev.record(cs)
            self._push(cs, act.old_ready)
        step = act.steps[act.k]
        release = work.release
        a = self._acquire(s, call, step.a, release, fills, task) if step.a is not None else None
        b = self._acquire(s, call, step.b, release, fills, task) if step.b is not None else None
        self._flush(s, fills)
        out_off, freed = None, ()
        if step.kernel in dev.OUT_OF_PLACE and act.c_off is not None and self.engine.config.knobs.invmm_new_block:
            # Knobs.invmm_new_block: the product's fresh block becomes C (no copy back); the old one is freed.
            out_off = self._alloc(call.tile_nbytes(task.c.slot, task.c.rows, task.c.cols), call)
            work.extra.append(out_off)
        chain = self._chain
        if chain is not None and chain[1] != s:
            dev.wait(s, chain[0])  # Knobs.chain_kernels: after the device's previous kernel
        h = dev.begin_op(s)
        if out_off is None:
            dev.run_step(s, step, call, a, b, act.c_loc, task)
        else:
            out_loc = _loc(dev, out_off, call, task.c.slot, task.c.rows, task.c.cols)
            dev.run_step(s, step, call, a, b, act.c_loc, task, out=out_loc)
            freed = (act.c_off,)
            act.c_off, act.c_loc = out_off, out_loc
            work.extra.clear()
        if act.late and act.k == nsteps - 1:
            dev.wait(s, act.old_ready)
            dev.run_step(s, act.fold_step(), call, None, act.old_loc, act.c_loc, task)
        flops = call.step_flops(step)
        dev.end_op(s, h, "kernel", 0, flops, task)
        act.k += 1
        self.issued_work += flops
        ev = dev.record(s)  # ends this step's kernel: its A/B readers are released here
        if self.knobs.chain_kernels:
            self._chain = (ev, s)
        last = act.k == nsteps
        self._push(s, ev, release=tuple(release), computed=task if last and call.war_gated else None, work=flops,
                   free=freed, step_of=task)
        release.clear()  # handed to that event
        if not last or (task.gates and not call.gate_open(task, nsteps)):
            return True
        self._finish(s, act, ev)
        return True

    def _finish(self, s: int, act: _Active, ev) -> None:
        """After the last step (its event on ``s``: ``ev``, or None): epilogue, write-back (M -> I), completion."""
        task, call, dev = act.task, act.task.call, self.dev
        row = call.stats.owned_row(self.idx)
        if call.epilogue is not None:
            call.epilogue(dev, s, act.c_loc, task)
            ev = None  # the write-back must follow the epilogue too
            if call.wb_dtype != call.acc_dtype and act.c_off is not None:  # it converted C in place
                act.c_loc = _loc(dev, act.c_off, call, task.c.slot, task.c.rows, task.c.cols, call.wb_dtype)
        if ev is None:
            ev = dev.record(s)
            self._push(s, ev)
        out = s
        if act.c_off is not None:
            # Write-back on the D2H stream, after this kernel: the compute stream goes on.
            out = dev.d2h_stream
            dev.wait(out, ev)
            h = dev.begin_op(out)
            dev.copy_out(out, call.operands[task.c.slot], task.c, act.c_loc, task)
            nbytes = call.home_nbytes(task.c)
            dev.end_op(out, h, "d2h", nbytes, 0.0, task)
            row["bytes_d2h"] += nbytes
        ev = dev.record(out)
        free, kept = act.buffers(), ()
        if task.keep_c and act.c_off is not None:
            # M -> E, not I: later tasks read it (TRSM). One reader: its kernel and write-back are queued until ev.
            ref = task.c
            line = Line((call.tokens[ref.slot], ref.bi, ref.bj), self.idx, act.c_off,
                        call.tile_nbytes(ref.slot, ref.rows, ref.cols), ref.rows, ref.cols, readers=1, ready=ev)
            with self.directory.lock:
                if self.alru.peek(line.key) is None:
                    self.directory.add(line)
                    free, kept = tuple(o for o in free if o != act.c_off), (line,)
        self._push(out, ev, ready=kept, release=kept, free=free, task=task, finished=True, writeback=True)
        self.slots[s] = None

    def _abandon_lost(self) -> bool:
        """Hand back one waiting task whose gate names a task that went back to the queue (its
        device failed): the waiter might otherwise hold every slot that task could run in."""
        for s, act in enumerate(self.slots):
            if act is None or not act.task.gates:
                continue
            task, call = act.task, act.task.call
            # Not once a write-after-read gate let a tile it read be overwritten: it must finish here (its lost
            # dependency runs in another slot), never run again from the start.
            if call.gate_open(task, act.k) or not call.gate_lost(task, act.k) or not call.recompute_safe(task):
                continue
            self.slots[s] = None
            self._push(s, self.dev.record(s), free=act.buffers())  # after the steps already issued
            self._ended(task)
            call.unstarted(task)
            task.worker = -1
            self.engine.requeue(task)
            return True
        return False

    def _start_c(self, s: int, act: _Active, fills: dict) -> None:
        task, call, dev = act.task, act.task.call, self.dev
        c_op = call.operands[task.c.slot]
        # In-core: compute into the array itself; not a mixed call (it accumulates in a wider buffer), nor a task
        # whose tile other tasks still read (in-place TRMM's write-after-read gates hold back its write-back only).
        if dev.holds_array(c_op) and not call.mixed and not task.war:
            act.c_loc = dev.array_loc(c_op, task.c)
            src = task.c_init
            if task.load_c and src is not None and (call.tokens[src.slot], src.bi, src.bj) != (
                    call.tokens[task.c.slot], task.c.bi, task.c.bj):
                # C starts from another tile (TRSM's inversions start from A's): copy it in first
                cs = self._load(act.c_loc, src, call, task)
                fills.setdefault(cs, ([], []))
            return
        act.c_off = self._alloc(call.tile_nbytes(task.c.slot, task.c.rows, task.c.cols), call)
        act.c_loc = _loc(dev, act.c_off, call, task.c.slot, task.c.rows, task.c.cols)
        if not task.load_c:
            return
        if self.knobs.late_c and task.rotatable and len(act.steps) >= 2 and not call.mixed:
            # Knobs.late_c: start from beta = 0; the old C is fetched near the end and folded in.
            act.late = True
            act.steps = (act.steps[0]._replace(beta=SC_ZERO),) + act.steps[1:]
            return
        src = task.c_init or task.c  # TRSM starts from B's tile, written to X's
        cs = self._load(act.c_loc, src, call, task)
        fills.setdefault(cs, ([], []))  # the step's kernel waits for this copy too

    def _load(self, dst, ref, call, task, peer_line=None, peer_wait=None) -> int:
        """Issue the copy filling ``dst`` with tile ``ref`` on the copy stream for its source, and return
        that stream: from a peer line (after its fill event ``peer_wait``, if still in flight), from the
        tile's home, or (a derived operand) made from the operand it derives from."""
        dev, operand = self.dev, call.operands[ref.slot]
        if peer_line is not None:
            nbytes, dtype = call.tile_nbytes(ref.slot, ref.rows, ref.cols), call.tile_dtype(ref.slot)
            peer = self.engine.devices[peer_line.device]
            src = PeerSource(peer, _loc(peer, peer_line.offset, call, ref.slot, ref.rows, ref.cols),
                             peer_wait, operand, ref)
            kind, cs = "p2p", dev.p2p_stream
        elif operand.derive is not None:  # made here from its source, on the host-copy stream
            source = source_of(call, operand)
            nbytes, dtype = operand.derive.nbytes_read(ref), call.home_dtype(ref.slot)
            src = DerivedSource(operand, ref, source)
            kind, cs = "p2p" if source.device >= 0 else "h2d", dev.h2d_stream
        elif operand.device >= 0:
            nbytes, dtype = call.home_nbytes(ref), call.home_dtype(ref.slot)
            src = ArraySource(operand, ref)
            kind, cs = "p2p", dev.p2p_stream
        else:
            nbytes, dtype = call.home_nbytes(ref), call.home_dtype(ref.slot)
            src = HostSource(operand, ref)
            kind, cs = "h2d", dev.h2d_stream
        if kind == "h2d":
            self.h2d_issued += nbytes
        h = dev.begin_op(cs)
        dev.copy_in(cs, dst, src, ref.rows, ref.cols, dtype, task)
        dev.end_op(cs, h, kind, nbytes, 0.0, task)
        call.stats.owned_row(self.idx)["bytes_" + kind] += nbytes
        return cs

    def _flush(self, s: int, fills: dict) -> None:
        """An event per copy stream of this step: new lines ready, peer lines released, and ``s`` waits for it."""
        dev = self.dev
        for cs in list(fills):
            lines, peers = fills[cs]
            ev = dev.record(cs)
            if lines:
                mark = self.h2d_issued if cs == dev.h2d_stream else None
                with self.directory.lock:
                    for line in lines:
                        line.ready = ev
                        line.fill_mark = mark
            self._push(cs, ev, ready=tuple(lines), release=tuple(peers))
            del fills[cs]  # (pushed: a device error from here on unpins its peer lines once, through pending)
            dev.wait(s, ev)

    def _acquire(self, s, call, ref, release, fills, task):
        """Algorithm 2's Translate plus Algorithm 1 lines 22-23: a Loc holding tile ``ref``. An L1 hit makes
        ``s`` wait for a fill still in flight; a miss allocates a line and issues its copy (peer or home), noted
        in ``fills``. Every line used goes to ``release`` (its readers drop when this step's kernel is done)."""
        dev = self.dev
        operand = call.operands[ref.slot]
        row = call.stats.owned_row(self.idx)
        if dev.holds_array(operand):
            row["l1_hits"] += 1
            return dev.array_loc(operand, ref)
        key = (call.tokens[ref.slot], ref.bi, ref.bj)
        directory = self.directory
        with directory.lock:
            line, peer_line, peer_wait = self.alru.get(key), None, None
            if line is not None and not line.dead:
                line.readers += 1
                wait_for = line.ready
            else:
                line = None
                peer_line = directory.peer_source(key, self.idx, self._can_read, FILLING,
                                                  self._peer_fill_sooner if self.knobs.peer_wait_if_sooner else None)
                if peer_line is not None:
                    directory.lend(peer_line)
                    # Under the lock: the owner clears ``ready`` (then reuses the event) under it too.
                    peer_wait = peer_line.ready
        if line is not None:
            if wait_for is not None and wait_for is not FILLING:
                dev.wait(s, wait_for)  # its fill is still in flight on a copy stream
            release.append(line)
            row["l1_hits"] += 1
            return _loc(dev, line.offset, call, ref.slot, line.rows, line.cols)
        off = None
        try:
            nbytes = call.tile_nbytes(ref.slot, ref.rows, ref.cols)
            off = self._alloc(nbytes, call)
            loc = _loc(dev, off, call, ref.slot, ref.rows, ref.cols)
            cs = self._load(loc, ref, call, task, peer_line, peer_wait)
        except BaseException:
            if off is not None:
                dev.heap.free(off)  # nothing was queued into it
            if peer_line is not None:
                with directory.lock:
                    directory.unlend(peer_line)
            raise
        row["l2_hits" if peer_line is not None else "misses"] += 1
        # FILLING until _flush records the fill event; only this thread sees it meanwhile
        new = Line(key, self.idx, off, nbytes, ref.rows, ref.cols, readers=1, ready=FILLING)
        with directory.lock:
            directory.add(new)
        release.append(new)
        lines, peers = fills.setdefault(cs, ([], []))
        lines.append(new)
        if peer_line is not None:
            peers.append(peer_line)  # released when the peer copy is done
        return loc

    def _peer_fill_sooner(self, line) -> bool:
        """Wait for a peer's in-flight host load of ``line`` only if it is done before a load on this device's
        link (equal speeds: at most as many host bytes ahead of it there as ahead of a load issued here now);
        else two devices starting a call together queue every shared tile on one link while the other idles."""
        mark = line.fill_mark
        if mark is None:
            return True  # filled over a peer link: no host backlog ahead of it
        ahead = mark - self.engine.workers[line.device].h2d_done
        return ahead <= self.h2d_issued - self.h2d_done + line.nbytes

    def _can_read(self, holder: int) -> bool:
        return self.dev.can_read_from(self.engine.devices[holder]) and self.engine.workers[holder].alive

    def _alloc(self, nbytes: int, call) -> int:
        """A heap block, evicting idle lines (Algorithm 2, Dequeue) down to the device's ``cache_limit``
        (other allocations took device memory); waits while work is pending, and raises CacheFull (the
        call fails, the device goes on) when nothing more can be freed."""
        heap, directory, dev = self.dev.heap, self.directory, self.dev
        spins = 0
        while True:
            limit = dev.cache_limit()
            if limit is None or heap.bytes_used + nbytes <= limit:
                off = heap.alloc(nbytes)
                if off is not None:
                    return off
            with directory.lock:
                victim = self.alru.victim()
                if victim is not None:
                    directory.drop(victim)
            if victim is not None:
                heap.free(victim.offset)
                call.stats.owned_row(self.idx)["evictions"] += 1
                continue
            if any(self.pending):
                if not self.retire():
                    self.wait_oldest()
                continue
            own = self._work.release if self._work is not None else ()  # this step's own readers
            with directory.lock:
                peer_readers = sum(line.readers for line in self.alru) - sum(1 for line in own if line.device == self.idx)
            if peer_readers > 0 and spins < 200_000:
                spins += 1
                time.sleep(0.0002)  # peers are copying from our lines; they release at their events
                continue
            room = heap.capacity if limit is None else min(limit, heap.capacity)
            raise CacheFull(
                f"{dev.name}: {call.name} needed a {nbytes}-byte block in the tile cache, which had "
                f"{max(0, room - heap.bytes_used)} bytes free of the {room} it may use now "
                f"(capacity {heap.capacity}; largest hole {heap.largest_free}); every other block is held "
                f"by this device's active tasks. Free device memory, raise cache_bytes or lower the tile size.")

    # ---------------------------------------------------------------- failure
    def until_peers_done(self, timeout: float = 30.0) -> None:
        """Peers' copies from this device's lines, picked before its lines were dropped, are done before its
        memory is freed (a copy from a freed arena would read garbage); bounded, as a broken peer never reports."""
        deadline = time.monotonic() + timeout
        while self.directory.lent[self.idx] > 0 and time.monotonic() < deadline:
            time.sleep(0.001)

    def held_tasks(self):
        out = super().held_tasks() + [(a.task, False) for a in self.slots if a is not None]
        self.slots = [None] * len(self.slots)
        peer_reads = []
        if self._work is not None:  # the step being issued when the device broke
            peer_reads += [line for _lines, peers in self._work.fills.values() for line in peers]
            self._work = None
        for dq in self.pending:
            for p in dq:
                if p.finished:
                    out.append((p.task, p.writeback))
                peer_reads += [line for line in p.release if line.device != self.idx]
            dq.clear()
        self.issued_work = 0.0
        with self.directory.lock:
            for line in peer_reads:  # our copies from peers will never complete: unpin their lines
                self.directory.unlend(line)
            for line in list(self.alru):
                self.directory.drop(line)
        return out
