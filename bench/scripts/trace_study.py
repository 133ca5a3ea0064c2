"""Where a level-3 call's time went, from a profile saved by ``level3_knobs_ab --trace DIR``.

    python -m bench.scripts.trace_study FILE.json.gz [--bin-ms 20] [--tasks] [--after-ms 0]

Per device, in bins of ``--bin-ms``: the fraction of the bin covered by computation, and the
host-to-device, device-to-host and peer copy rates (GB/s) in it: a start or an end that waits
for copies shows as bins with low compute and a saturated host link. ``--tasks``: every task by
its first kernel, with its kernel span, and when it entered and left which reservation station
(``push@D``: into D's; ``pop_best@D``: D assigned it to a stream; ``steal@D``: a peer took it from
D's station, then ``push@P`` on the thief's), for the tasks whose last
kernel ends after ``--after-ms``: whether the tail waited for tasks committed early to one device.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json


def load(path: str) -> tuple[dict, list[dict]]:
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    return doc, [dict(zip(doc["fields"], r)) for r in doc["records"]]


def covered(intervals) -> float:
    """Length of the union of [s, e) intervals."""
    total, cur = 0.0, None
    for s, e in sorted(intervals):
        if cur is None or s > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    return total + (cur[1] - cur[0] if cur is not None else 0.0)


def timeline(doc: dict, recs: list[dict], bin_s: float) -> list[str]:
    t0, wall = doc["start"], doc["finish"] - doc["start"]
    out = [f"wall {wall * 1e3:.1f} ms"]
    for dev in sorted({r["device"] for r in recs}):
        rs = [r for r in recs if r["device"] == dev]
        out.append(f"device {dev}: {sum(r['kind'] == 'kernel' for r in rs)} kernels")
        for b in range(int(wall / bin_s) + 1):
            lo, hi = t0 + b * bin_s, t0 + (b + 1) * bin_s
            inside = [r for r in rs if r["end"] > lo and r["start"] < hi]
            comp = covered((max(r["start"], lo), min(r["end"], hi)) for r in inside if r["kind"] in ("kernel", "host"))
            rate = collections.Counter()
            for r in inside:
                if r["kind"] in ("h2d", "d2h", "p2p"):
                    share = (min(r["end"], hi) - max(r["start"], lo)) / max(r["end"] - r["start"], 1e-9)
                    rate[r["kind"]] += r["nbytes"] * share / bin_s / 1e9
            out.append(f"  {b * bin_s * 1e3:6.0f} ms  compute {comp / bin_s:4.2f}  h2d {rate['h2d']:5.1f}  "
                       f"d2h {rate['d2h']:5.1f}  p2p {rate['p2p']:5.1f} GB/s")
    return out


def tasks(doc: dict, recs: list[dict], after_s: float) -> list[str]:
    t0 = doc["start"]
    span: dict[int, list] = {}
    for r in recs:
        if r["kind"] == "kernel" and r["task"] >= 0:
            s = span.setdefault(r["task"], [r["start"], r["end"], r["device"]])
            s[0], s[1] = min(s[0], r["start"]), max(s[1], r["end"])
    moves = collections.defaultdict(list)
    for t, owner, op, tid in doc.get("stations", []):
        moves[tid].append(f"{op}@{owner}:{(t - t0) * 1e3:.0f}")
    out = [f"counters (tasks, steals) per device: "
           f"{ {k: (v['tasks'], v['steals']) for k, v in doc.get('counters', {}).items()} }"]
    for tid, (s, e, dev) in sorted(span.items(), key=lambda kv: kv[1][0]):
        if e - t0 >= after_s:
            out.append(f"task {tid:4d} device {dev} kernels {(s - t0) * 1e3:6.1f}-{(e - t0) * 1e3:6.1f} ms  "
                       + " ".join(moves[tid]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--bin-ms", type=float, default=20.0)
    ap.add_argument("--tasks", action="store_true")
    ap.add_argument("--after-ms", type=float, default=0.0)
    args = ap.parse_args(argv)
    if not args.bin_ms > 0:
        raise SystemExit(f"--bin-ms: got {args.bin_ms}; need a number > 0")
    doc, recs = load(args.path)
    print("\n".join(timeline(doc, recs, args.bin_ms / 1e3)))
    if args.tasks:
        print("\n".join(tasks(doc, recs, args.after_ms / 1e3)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
