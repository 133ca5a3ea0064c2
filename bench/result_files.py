"""The benchmarks' result files: a UTC stamp, the command line, and a JSON + markdown pair whose JSON is a
strict JSON-safe copy (NaN and inf as null)."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import shlex
import sys

import numpy as np


def utc_stamp() -> tuple[str, str]:
    now = dt.datetime.now(dt.timezone.utc)
    return now.strftime("%Y%m%d-%H%M%S"), now.strftime("%Y-%m-%d %H:%M:%S")


def command_line(module: str, argv) -> str:
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else list(argv))])


def write_json_md(base: str, data: dict, markdown: str) -> tuple[str, str]:
    """base.json (strict JSON: NaN and inf become null) and base.md."""
    os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
    with open(base + ".json", "w") as f:
        json.dump(jsonable(data), f, indent=1, allow_nan=False)
    with open(base + ".md", "w") as f:
        f.write(markdown)
    return base + ".json", base + ".md"


def jsonable(x):
    """A JSON-safe copy: numpy scalars and arrays to Python, NaN / inf to None, keys to str."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


#: a peer's error widens a tolerance at most this many times (a broken peer must not let anything pass)
PEER_WIDENING = 10


def beside_peer(tol: float, peer_err) -> float:
    """The tolerance of a result checked beside a peer's: ``tol``, or twice the peer's error where larger (its
    own rounding), at most PEER_WIDENING x ``tol``; a missing or non-finite peer error widens nothing."""
    if peer_err is None or not math.isfinite(peer_err):
        return tol
    return max(tol, min(2 * peer_err, PEER_WIDENING * tol))


def finite(x):
    """NaN / inf -> None (strict JSON)."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None
