"""The idle audit: what an engine with no call in flight must not hold (interrupt tests, the soak).

Every task accounted; no line with readers or a fill in flight; no heap block outside the tile
cache; no directory entry of a dead or per-call tile; no queued or stationed task. Cached tiles of
live read-only arrays are the cache, not leaks.
"""

from __future__ import annotations

import time


def leaks(engine, settle: float = 2.0) -> list[str]:
    """Problems found on ``engine`` (empty: none). Retries for up to ``settle`` seconds, since a
    worker retires the events of a finished call just after its caller returns."""
    deadline = time.monotonic() + settle
    while True:
        found = _leaks_now(engine)
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.02)


def _leaks_now(engine) -> list[str]:
    out = []
    if engine.inline:
        return out
    for name, q in engine.queues.items():
        n = len(q)
        if n and not engine.closed:
            out.append(f"queue {name!r} holds {n} tasks")
    for st in engine.stations:
        if len(st):
            out.append(f"station of device {st.owner} holds {len(st)} tasks")
    running = [c for c in engine._live_calls() if not c.done]
    if running:
        out.append(f"{len(running)} calls not finished: {[c.name for c in running]}")
    for w in engine.workers:
        if not w.alive:
            continue
        held = w.held_snapshot()
        if held:
            out.append(f"{w.dev.name} holds {len(held)} tasks")
        if getattr(w, "inflight", 0):
            out.append(f"{w.dev.name}: {w.inflight} tasks in flight")
        if any(getattr(w, "pending", ())):
            out.append(f"{w.dev.name}: {sum(len(d) for d in w.pending)} events not retired")
    directory = engine.directory
    with directory.lock:
        for w, alru in zip(engine.workers, directory.alrus):
            if not w.dev.streamed or not w.alive or w.dev.heap is None:
                continue
            busy = [line for line in alru if line.readers or line.ready is not None]
            if busy:
                out.append(f"{w.dev.name}: {len(busy)} lines with readers or a fill in flight, e.g. {busy[0]!r}")
            heap = w.dev.heap
            if heap.n_allocated != len(alru):
                out.append(f"{w.dev.name}: {heap.n_allocated} heap blocks for {len(alru)} cached lines")
        for key, holders in directory._holders.items():
            for d, line in holders.items():
                if line.dead or directory.alrus[d].peek(key) is not line:
                    out.append(f"directory lists {key!r} on {d}, which is not its live line there")
                elif key[0][0] < 0:
                    out.append(f"directory lists a tile of a finished call: {key!r} on {d}")
    return out
