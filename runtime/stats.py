"""Statistics of one blasx call: counters, timed operations, and views of them.

The workers of all devices feed one `CallStats` concurrently (`count`, `add_record`); `profile()`
takes a `Profile` snapshot, and every view is a pure function of it. The time breakdown is Fig. 8
of the BLASX paper, per device inside the call's window (records clipped to it): busy (COMPT,
covered by kernels or host-side work), comm (COMM, covered by copies while nothing computes; copy
time under computation is `overlapped_comm`) and idle (OTHER, covered by nothing). Each is the
length of a union of intervals, so streams are never counted twice and busy + comm + idle == wall.
"""

from __future__ import annotations

import json
import numbers
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator, Sequence

__all__ = [
    "COUNTER_FIELDS", "KIND_CLASS", "HOST_TID", "OpRecord", "DeviceInfo", "CallStats",
    "DeviceBreakdown", "Profile", "KIND_COLORS", "union", "measure", "human_bytes",
]

COUNTER_FIELDS = ("tasks", "steps", "flops", "steals", "l1_hits", "l2_hits", "misses", "evictions",
                  "bytes_h2d", "bytes_d2h", "bytes_p2p")

#: The breakdown class of each record kind.
KIND_CLASS = {"kernel": "compute", "host": "compute", "h2d": "copy", "d2h": "copy", "p2p": "copy"}

#: Chrome-trace / timeline thread of a device's host-side work (device streams use tid = stream).
HOST_TID = 1000

#: The clock of all times in this module.
clock = time.perf_counter


@dataclass(slots=True)
class OpRecord:
    """One operation on one device; times in seconds on `clock`."""
    device: int            # worker index: position in CallStats.devices
    kind: str              # a key of KIND_CLASS: "kernel" | "h2d" | "d2h" | "p2p" | "host"
    start: float
    end: float
    stream: int = 0
    nbytes: int = 0
    flops: float = 0.0
    task: int = -1         # task id, -1 if none
    name: str = ""         # e.g. "gemm", "syrk", "A(1,2)"


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str              # e.g. "cuda:0 NVIDIA H200", "sim:1 (slow=4)", "cpu"
    kind: str              # "cuda" | "sim" | "cpu"


# ------------------------------------------------------------------------------- intervals

def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of the intervals [s, e); empty ones are dropped. O(n log n)."""
    merged: list[list[float]] = []
    for s, e in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def _length(disjoint: Iterable[tuple[float, float]]) -> float:
    return sum((e - s for s, e in disjoint), 0.0)


def measure(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    return _length(union(intervals))


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def human_bytes(n: float) -> str:
    """1234567 -> '1.23 MB' (decimal units, like GB/s link rates)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


# ------------------------------------------------------------------------------- collector

class CallStats:
    """Thread-safe collector for one call (or profiling window), fed by several devices' workers. `device`
    arguments and `OpRecord.device` are worker indices: positions in `devices`. The window starts at
    construction unless `start` is called; an unfinished window ends when `profile` is called."""

    def __init__(self, devices: Sequence[DeviceInfo], keep_records: bool = True):
        self.devices = tuple(devices)
        self.keep_records = keep_records
        self._lock = threading.Lock()
        self._counters = [dict.fromkeys(COUNTER_FIELDS, 0) for _ in self.devices]
        self._records: list[OpRecord] = []
        self._start = clock()
        self._finish: float | None = None
        # Host-side work outside the devices' timelines (set by the backends): "pin_seconds", "pinned_bytes".
        self.host: dict[str, float] = {}

    def _check_device(self, device: int) -> None:
        if not 0 <= device < len(self.devices):
            raise IndexError(f"device {device} out of range for {len(self.devices)} devices")

    def count(self, device: int, field: str, n: int | float = 1) -> None:
        if field not in COUNTER_FIELDS:
            raise ValueError(f"unknown counter {field!r}; expected one of {COUNTER_FIELDS}")
        self._check_device(device)
        if type(n) is not int and type(n) is not float:  # numpy scalars would not serialise to JSON
            n = int(n) if isinstance(n, numbers.Integral) else float(n)
        with self._lock:
            self._counters[device][field] += n

    def owned_row(self, device: int) -> dict:
        """The counters of ``device``, for its worker (their one writer) to increment without the lock."""
        self._check_device(device)
        return self._counters[device]

    def add_record(self, rec: OpRecord) -> None:
        if not self.keep_records:
            return
        self._check_device(rec.device)
        if rec.kind not in KIND_CLASS:
            raise ValueError(f"unknown record kind {rec.kind!r}; expected one of {tuple(KIND_CLASS)}")
        if rec.end < rec.start:
            raise ValueError(f"record ends before it starts: {rec}")
        with self._lock:
            self._records.append(rec)

    def start(self, t: float | None = None) -> None:
        with self._lock:
            self._start = clock() if t is None else float(t)

    def finish(self, t: float | None = None) -> None:
        with self._lock:
            self._finish = clock() if t is None else float(t)

    @property
    def finished(self) -> bool:
        return self._finish is not None

    def __enter__(self) -> CallStats:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.finish()

    def profile(self) -> Profile:
        """Snapshot; an unfinished window ends now."""
        with self._lock:
            start, finish = self._start, self._finish
            counters, records = [dict(c) for c in self._counters], tuple(self._records)
        return Profile(devices=self.devices, start=start, finish=clock() if finish is None else finish,
                       counters=dict(enumerate(counters)), records=records, host=dict(self.host))


# ------------------------------------------------------------------- snapshot and its views

@dataclass(frozen=True)
class DeviceBreakdown:
    device: int
    name: str
    tasks: int
    flops: float
    busy: float              # union of compute intervals (COMPT)
    comm: float              # union of copy intervals minus busy (COMM, unoverlapped)
    idle: float              # wall minus union of all intervals (OTHER)
    overlapped_comm: float   # copy time hidden under compute
    counters: dict[str, float]
    lead: float = 0.0        # idle before the device's first operation (all of wall if it had none)
    tail: float = 0.0        # idle after its last operation ends (none if it had none: lead + gaps + tail = idle)


#: report columns: header, key of a report row, cell formatter
_REPORT_COLUMNS = (
    ("tasks", "tasks", "{:.0f}".format),
    ("share", "share", "{:.1%}".format),
    ("TFLOPS", "tflops", "{:.3f}".format),
    ("busy s", "busy", "{:.4f}".format),
    ("comm s", "comm", "{:.4f}".format),
    ("idle s", "idle", "{:.4f}".format),
    ("H2D", "bytes_h2d", human_bytes),
    ("D2H", "bytes_d2h", human_bytes),
    ("P2P", "bytes_p2p", human_bytes),
    ("L1 hits", "l1_hits", "{:.0f}".format),
    ("L2 hits", "l2_hits", "{:.0f}".format),
    ("misses", "misses", "{:.0f}".format),
    ("steals", "steals", "{:.0f}".format),
)

#: plot: the stacked Fig. 8 bars (label, DeviceBreakdown attribute, colour)
_BREAKDOWN_BARS = (("COMPT (busy)", "busy", "tab:green"),
                   ("COMM (unoverlapped)", "comm", "tab:orange"),
                   ("OTHER (idle)", "idle", "lightgray"))

#: plot: timeline colour of each record kind
KIND_COLORS = {"kernel": "tab:green", "host": "tab:purple", "h2d": "tab:blue",
               "d2h": "tab:red", "p2p": "tab:orange"}


def _tid(rec: OpRecord) -> int:
    return HOST_TID if rec.kind == "host" else rec.stream


def _thread_name(tid: int) -> str:
    return "host" if tid == HOST_TID else f"stream {tid}"


def combined(profiles: list["Profile"]) -> "Profile":
    """One profile of several calls on the same devices (a batched front end's items): counters summed, records
    joined, from the first start to the last finish; host figures summed where numbers, else the last's."""
    first = profiles[0]
    counters = {d: {f: sum(p.counters[d][f] for p in profiles) for f in COUNTER_FIELDS} for d in first.counters}
    host: dict = {}
    for p in profiles:
        for k, v in p.host.items():
            host[k] = host.get(k, 0) + v if isinstance(v, (int, float)) and isinstance(host.get(k, 0), (int, float)) \
                else v
    return Profile(first.devices, min(p.start for p in profiles), max(p.finish for p in profiles), counters,
                   tuple(r for p in profiles for r in p.records), host)


@dataclass(frozen=True)
class Profile:
    """Snapshot of a CallStats. All views clip records to [start, finish]."""
    devices: tuple[DeviceInfo, ...]
    start: float
    finish: float
    counters: dict[int, dict[str, float]]     # per worker index
    records: tuple[OpRecord, ...]
    host: dict[str, float] = field(default_factory=dict)  # CallStats.host

    @property
    def wall(self) -> float:
        return max(self.finish - self.start, 0.0)

    def clipped(self) -> Iterator[tuple[OpRecord, float, float]]:
        """(record, start, end) of each record that meets the window, its times clipped to it."""
        for r in self.records:
            s, e = max(r.start, self.start), min(r.end, self.finish)
            if s <= e:
                yield r, s, e

    def totals(self) -> dict[str, float]:
        return {f: sum((c[f] for c in self.counters.values()), 0) for f in COUNTER_FIELDS}

    def breakdown(self) -> list[DeviceBreakdown]:
        spans = [{"compute": [], "copy": []} for _ in self.devices]
        for r, s, e in self.clipped():
            spans[r.device][KIND_CLASS[r.kind]].append((s, e))
        out = []
        for d, (info, sp) in enumerate(zip(self.devices, spans)):
            compute, copy = union(sp["compute"]), union(sp["copy"])
            busy, copied = _length(compute), _length(copy)
            active = union(compute + copy)
            covered = _length(active)
            comm = max(covered - busy, 0.0)
            c = self.counters[d]
            out.append(DeviceBreakdown(
                device=d, name=info.name, tasks=int(c["tasks"]), flops=float(c["flops"]),
                busy=busy, comm=comm, idle=max(self.wall - covered, 0.0),
                overlapped_comm=max(copied - comm, 0.0), counters=dict(c),
                lead=active[0][0] - self.start if active else self.wall,
                tail=self.finish - active[-1][1] if active else 0.0))
        return out

    def _device_rows(self, bd: list[DeviceBreakdown], totals: dict[str, float]) -> list[dict]:
        return [{**asdict(b), "kind": info.kind,
                 "share": _ratio(b.tasks, totals["tasks"]),
                 "tflops": _ratio(b.flops, self.wall) / 1e12}
                for b, info in zip(bd, self.devices)]

    def summary(self) -> dict:
        """JSON-serialisable summary. Hit rates are fractions of all tile lookups; per-device tflops are
        device flops / wall, so they sum to the total; share is the device's fraction of all tasks."""
        t = self.totals()
        lookups = t["l1_hits"] + t["l2_hits"] + t["misses"]
        return {
            "wall": self.wall,
            "tflops": _ratio(t["flops"], self.wall) / 1e12,
            "tasks": t["tasks"],
            "l1_hit_rate": _ratio(t["l1_hits"], lookups),
            "l2_hit_rate": _ratio(t["l2_hits"], lookups),
            "miss_rate": _ratio(t["misses"], lookups),
            "host_bytes": t["bytes_h2d"] + t["bytes_d2h"],
            "p2p_bytes": t["bytes_p2p"],
            "totals": t,
            "devices": self._device_rows(self.breakdown(), t),
            "host": dict(self.host),
        }

    def report(self) -> str:
        """Text table: one row per device and a totals row."""
        t = self.totals()
        bd = self.breakdown()
        rows = [{**row["counters"], **row} for row in self._device_rows(bd, t)]
        total = {**t, "name": "total", "share": 1.0 if t["tasks"] else 0.0,
                 "tflops": _ratio(t["flops"], self.wall) / 1e12,
                 **{k: sum((getattr(b, k) for b in bd), 0.0) for k in ("busy", "comm", "idle")}}
        table = [["device", *(h for h, _, _ in _REPORT_COLUMNS)]]
        table += [[row["name"], *(fmt(row[k]) for _, k, fmt in _REPORT_COLUMNS)]
                  for row in [*rows, total]]
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        lines = ["  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])])
                 for r in table]
        lines.insert(len(lines) - 1, "-" * len(lines[0]))
        head = (f"blasx profile: {len(self.devices)} device(s), wall {self.wall:.4f} s, "
                f"{total['tflops']:.3f} TFLOPS, {t['tasks']:.0f} tasks, math {self.host.get('math', 'ieee')}  "
                f"(busy = COMPT, comm = unoverlapped COMM, idle = OTHER)")
        if self.host.get("pinned_bytes"):
            lines.append(f"host memory page-locked during the call: {human_bytes(self.host['pinned_bytes'])} in "
                         f"{self.host.get('pin_seconds', 0.0):.4f} s (beside the devices' work)")
        return "\n".join([head, *lines])

    def to_chrome_trace(self, path: str | os.PathLike | None = None) -> dict:
        """Chrome trace-event JSON (Perfetto): pid = device, tid = stream or HOST_TID, ts/dur in µs from start."""
        events, threads = [], set()
        for r, s, e in self.clipped():
            tid = _tid(r)
            threads.add((r.device, tid))
            events.append({"name": r.name or r.kind, "cat": r.kind, "ph": "X",
                           "pid": r.device, "tid": tid,
                           "ts": (s - self.start) * 1e6, "dur": (e - s) * 1e6,
                           "args": {"bytes": int(r.nbytes), "flops": float(r.flops),
                                    "task": int(r.task)}})
        meta = [{"name": name, "ph": "M", "pid": d, "tid": 0, "args": args}
                for d, info in enumerate(self.devices)
                for name, args in (("process_name", {"name": info.name}), ("process_sort_index", {"sort_index": d}))]
        meta += [{"name": "thread_name", "ph": "M", "pid": d, "tid": tid, "args": {"name": _thread_name(tid)}}
                 for d, tid in sorted(threads)]
        trace = {"traceEvents": meta + events, "displayTimeUnit": "ms"}
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(trace, f)
        return trace

    def plot(self, path: str | os.PathLike) -> None:
        """PNG with the Fig. 8 breakdown (stacked busy/comm/idle bars per device) above a
        timeline (one row per device stream, rectangles coloured by kind). Needs matplotlib."""
        try:
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as exc:
            raise ImportError("Profile.plot needs matplotlib, an optional extra of blasx: "
                              "pip install 'blasx[plot]'") from exc
        bd = self.breakdown()
        spans: dict[tuple[int, int], dict[str, list]] = {}
        for r, s, e in self.clipped():
            spans.setdefault((r.device, _tid(r)), {}).setdefault(r.kind, []).append(
                (s - self.start, e - s))
        lanes = sorted(spans)
        fig = Figure(figsize=(11, 2.5 + 0.35 * (len(bd) + len(lanes))), layout="constrained")
        ax_bar, ax_time = fig.subplots(2, 1, height_ratios=[max(len(bd), 1), max(len(lanes), 1)])

        y = list(range(len(bd)))
        left = [0.0] * len(bd)
        for label, attr, color in _BREAKDOWN_BARS:
            width = [getattr(b, attr) for b in bd]
            ax_bar.barh(y, width, left=left, color=color, label=label)
            left = [a + b for a, b in zip(left, width)]
        ax_bar.set_yticks(y, [b.name for b in bd])
        ax_bar.invert_yaxis()
        ax_bar.set_xlabel("seconds")
        ax_bar.set_title(f"time breakdown per device (wall {self.wall:.4f} s)")
        ax_bar.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")

        for row, lane in enumerate(lanes):
            for kind, bars in spans[lane].items():
                ax_time.broken_barh(bars, (row - 0.4, 0.8), facecolors=KIND_COLORS[kind])
        ax_time.set_yticks(list(range(len(lanes))),
                           [f"{self.devices[d].name} / {_thread_name(t)}" for d, t in lanes])
        ax_time.invert_yaxis()
        ax_time.set_xlim(0, self.wall or 1.0)
        ax_time.set_xlabel("seconds from start")
        ax_time.set_title("timeline")
        ax_time.legend(handles=[Patch(color=c, label=k) for k, c in KIND_COLORS.items()],
                       loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        fig.savefig(path, dpi=110)
