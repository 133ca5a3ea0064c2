"""The part every device worker shares (Algorithm 1's queue side): station filling from the global
queues, the fair share of small calls, work stealing, the thread's lifecycle and failure hand-off."""

from __future__ import annotations

import contextlib
import threading

from .devices.base import DeviceError
from .latch import Latch
from .station import most_loaded


class Worker(threading.Thread):
    def __init__(self, engine, device, station, core=None) -> None:
        super().__init__(name=f"blasx-worker-{device.name}", daemon=engine.config.daemon_threads)
        self.engine = engine
        self.dev = device
        self.idx = device.index
        self.station = station
        self.core = core
        self.alive = True
        self.stopping = False
        self.opened = Latch()
        self.open_error: BaseException | None = None

    # -- work intake --
    @staticmethod
    def ready(task) -> bool:
        """``task`` may start here: a whole-task worker waits for every dependency."""
        return task.call.is_ready(task)

    def _head(self):
        """(queue, head, whether this worker takes that head now) of the first queue it serves that holds
        anything (a sentinel is always taken); (None, None, False) when every queue is empty."""
        for q in self.engine.queues_for(self):
            head = q.peek()
            if head is not None:
                return q, head, head is self.engine.SENTINEL or self._takes(head)
        return None, None, False

    def _takes(self, task) -> bool:
        """A stream worker takes ``task`` (a queue's head) now unless it is left for a peer or its line's home."""
        peers = self._stream_peers(task.call)
        return not self._leave_for_peer(task.call, peers) and not self._leave_for_home(task, peers)

    def _leave_for_home(self, task, peers=None) -> bool:
        """With ``Knobs.line_homes``: True if ``task``'s line (``Task.line``) belongs to another stream worker that
        is alive and has room, unless this worker has nothing it can run. Only for a call of at most two lines a
        device: with more, the steals at the tail balance better than whole lines."""
        if not task.line or not self.dev.streamed or not self.engine.config.knobs.line_homes:
            return False
        peers = self._stream_peers(task.call) if peers is None else peers
        index, count = task.line
        if count > 2 * len(peers):
            return False
        home = peers[index * len(peers) // count]
        return home is not self and home.alive and home.station.free_slots() > 0 and self.has_runnable()

    def _may_steal(self, task) -> bool:
        """This worker may steal ``task`` from a peer's station (one it can run)."""
        return True

    def _pull(self):
        """Next task from the queues this worker serves; None when empty, left for a peer, or taken first."""
        q, _, takes = self._head()
        return q.get() if takes else None

    def _leave_for_peer(self, call, peers=None) -> bool:
        """The fair share of small calls (else one goes wholly to the first worker to wake): True if this stream
        worker holds max(1, tasks // eligible stream workers) of ``call`` and a stream peer with room holds
        less; never while this worker has nothing it can run, so no device idles and no gated task's
        dependency waits. Nothing is left for the CPU worker, far slower per tile (``admission.py``)."""
        if not self.dev.streamed:
            return False
        peers = self._stream_peers(call) if peers is None else peers
        share = max(1, call.n_tasks // max(1, len(peers)))
        if self.holding(call) < share or not self.has_runnable():
            return False
        return any(w is not self and w.station.free_slots() > 0 and w.holding(call) < share for w in peers)

    def _stream_peers(self, call) -> list:
        """The stream workers (this one too) that can run ``call``, in engine order."""
        return [w for w in self.engine.workers if w.dev.streamed and self.engine.can_run(w, call)]

    def holding(self, call) -> int:
        """Tasks of ``call`` this worker holds (station and started); read by peers, lock-free."""
        return sum(1 for t in self.station.snapshot() if t.call is call)

    def has_runnable(self) -> bool:
        """This worker holds a task it can run now (or is running one)."""
        return self.station.any_ready(self.ready)

    def fill_station(self) -> None:
        st = self.station
        # Beyond capacity only while nothing held is ready, so a station full of tasks waiting on dependencies
        # cannot starve the tasks they wait for (handed back by a failed device, at the queue's head).
        while not self.stopping and (st.free_slots() > 0 or not st.any_ready(self.ready)):
            t = self._pull()
            if t is None:
                break
            if t is self.engine.SENTINEL:
                self.stopping = True
                break
            if t.call.failed:
                t.call.account(t)  # cancelled: its call already failed
                continue
            st.push(t)
        if len(st) > 0 or self.stopping:
            return
        # Steal any task this worker can run, even with no stream free now: the one whose station empties
        # first (the faster device) claims the tail's tasks early (taking only what it could start at once
        # balanced worse).
        victim = most_loaded(self.engine.stations_for(self), self.idx)
        if victim is None:
            return
        t = victim.steal(lambda task: self.engine.can_run(self, task.call) and self._may_steal(task))
        if t is not None:
            st.push(t)
            t.call.stats.count(self.idx, "steals")

    # -- thread body --
    def run(self) -> None:
        try:
            self.dev.bind_thread(self.core)
            self.dev.open()
        except BaseException as exc:  # noqa: BLE001 - reported to configure()/the engine
            self.open_error = exc
            self.alive = False
            self.opened.set()
            self.engine.worker_failed(self, exc, [])
            return
        self.opened.set()
        try:
            self.loop()
            self.alive = False  # stopped (shutdown): no call may count on this worker any more
        except BaseException as exc:  # noqa: BLE001 - travels to the callers whose tasks we held
            self.fail(exc)
        finally:
            with contextlib.suppress(BaseException):  # closing a broken device may fail too
                self.until_peers_done()
                self.dev.close()

    def until_peers_done(self) -> None:
        """Before the device's memory is freed: peers' copies from it that are under way finish (none here)."""

    def _work_waiting(self) -> bool:
        """A queue this worker serves holds a task it would take now, and the station has room for it."""
        return self.station.free_slots() > 0 and self._head()[2]

    def device_error(self, exc: BaseException) -> bool:
        """``exc`` means the device is broken (it dies, its tasks go to others), not one call (that fails)."""
        return isinstance(exc, DeviceError) or self.dev.error is not None or self.dev.is_device_error(exc)

    def held_snapshot(self) -> tuple:
        """Tasks held now, for a cancelling caller's sweep (lock-free: a task is held before its call is checked)."""
        return self.station.snapshot()

    def fail(self, exc: BaseException) -> None:
        self.alive = False
        with contextlib.suppress(BaseException):  # (its queued write-backs land before its tasks are redone)
            self.dev.quiesce()
        if self.dev.error is None:
            self.dev.error = exc
        self.engine.worker_failed(self, exc, self.held_tasks())

    def held_tasks(self):
        """[(task, writeback_issued)] of every unfinished task this worker holds."""
        return [(t, False) for t in self.station.drain()]
