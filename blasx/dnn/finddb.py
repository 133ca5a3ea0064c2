"""The convolution find-db: per GPU model and problem, the device-route form that measured fastest
(``blasx.dnn.find`` stores it; ``conv_direct.forward_form`` reads it before its heuristic).

A :class:`ConvKey` names a convolution as its forward problem -- x (n, c, *in_size), weight (k, c/groups,
*kernel), stride, the low padding, dilation, groups and the output size (which fixes the high padding) --
plus the direction that was timed ("fwd", "bwd-data", "bwd-weight"), the layout ("nchw" or "cl"), the
dtype prefix and the math ("ieee" or "tf32"; float32 only, "ieee" for the others). Text form::

    NVIDIA H200|fwd|n32|c64|k64|i56x56|o56x56|r3x3|s1x1|p1x1|d1x1|g1|nchw|s|ieee

Entries live in the perf-db file (:class:`blasx.perfdb.PerfDb`, table ``conv_entries``). Lookups read
a per-process table, reloaded when the file (its path, size or mtime) or the process's own writes
change; a missing or unreadable file reads as "no entry". A lookup takes the entry of the exact batch,
else that of the nearest batch (log scale; ties: the larger) of the same problem otherwise: the
winning form depends little on the batch, and a network's chunk rarely matches the tuned one.
``BLASX_PERFDB=off`` makes lookups ignore the db.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from typing import NamedTuple

import numpy as np

from .. import perfdb
from ..runtime import dtypes
from .args import allowed_dtypes
from .geometry import ConvGeometry, conv_geometry

DIRECTIONS = ("fwd", "bwd-data", "bwd-weight")
LAYOUTS = ("nchw", "cl")
FORMS = ("im2col", "shifted", "implicit", "winograd", "depthwise", "batched", "col2im", "phases")  # every route form
_SEP = "|"
_TAGS = ("n", "c", "k", "i", "o", "r", "s", "p", "d", "g")


def _dims(t) -> str:
    return "x".join(str(int(v)) for v in t)


class ConvKey(NamedTuple):
    """What a find-db entry is keyed by (see the module docstring)."""

    device: str
    direction: str
    n: int
    c: int
    k: int
    in_size: tuple
    out_size: tuple
    kernel: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int
    layout: str
    dtype: str
    math: str

    @property
    def text(self) -> str:
        vals = (self.n, self.c, self.k, _dims(self.in_size), _dims(self.out_size), _dims(self.kernel),
                _dims(self.stride), _dims(self.padding), _dims(self.dilation), self.groups)
        return _SEP.join((self.device, self.direction, *(f"{t}{v}" for t, v in zip(_TAGS, vals)),
                          self.layout, self.dtype, self.math))

    def __str__(self) -> str:
        return self.text

    @property
    def problem(self) -> tuple:
        """The key without its batch: entries that differ only in n share it."""
        return self[:2] + self[3:]

    @classmethod
    def parse(cls, text: str) -> "ConvKey":
        """The key of a text form (see the module docstring)."""
        try:
            device, direction, *tagged, layout, dtype, math_ = text.split(_SEP)
            if len(tagged) != len(_TAGS) or any(not f.startswith(t) for f, t in zip(tagged, _TAGS)):
                raise ValueError
            v = [f[1:] for f in tagged]
            tup = [tuple(int(x) for x in s.split("x")) for s in v[3:9]]
            return _checked(cls(device, direction, int(v[0]), int(v[1]), int(v[2]), *tup, int(v[9]),
                                layout, dtype, math_))
        except (ValueError, AttributeError):
            raise ValueError(f"key: got {text!r}, expected a find-db key such as 'NVIDIA H200|fwd|n32|c64|k64|"
                             f"i56x56|o56x56|r3x3|s1x1|p1x1|d1x1|g1|nchw|s|ieee'") from None


def conv_dtype(dtype) -> str:
    """The prefix of a convolution dtype (d, s, h, b)."""
    allowed = {perfdb.dtype_char(dt): name for dt, name in allowed_dtypes().items()}
    try:
        p = perfdb.dtype_char(dtype)
    except ValueError:
        p = None
    if p not in allowed:
        raise ValueError(f"dtype: got {dtype!r}, need one of {', '.join(allowed.values())} "
                         f"(or their prefixes {', '.join(allowed)})")
    return p


def norm_math(math_, dtype: str) -> str:
    """``math`` as keyed: "ieee" or "tf32" for float32 (None: the default math), "ieee" for other types."""
    from .. import precision
    m = precision.check_math(math_)
    return m if dtype == "s" else "ieee"


def _checked(key: ConvKey) -> ConvKey:
    nd = len(key.in_size)
    if not isinstance(key.device, str) or not key.device or _SEP in key.device:
        raise ValueError(f"key: device {key.device!r} must be a non-empty name without {_SEP!r}")
    if key.direction not in DIRECTIONS:
        raise ValueError(f"key: direction {key.direction!r} must be one of {', '.join(DIRECTIONS)}")
    if key.layout not in LAYOUTS or conv_dtype(key.dtype) != key.dtype or key.math not in ("ieee", "tf32") \
            or (key.math == "tf32" and key.dtype != "s"):
        raise ValueError(f"key: layout/dtype/math {key.layout!r}/{key.dtype!r}/{key.math!r} must be one of "
                         f"{LAYOUTS}, a conv dtype prefix, and 'ieee' (or 'tf32' for 's')")
    if nd not in (1, 2, 3) or any(len(t) != nd for t in key[5:11]) or min(key.n, key.c, key.k, key.groups) < 1:
        raise ValueError(f"key: {key!r} is not a convolution problem")
    return key


def key_of(geo: ConvGeometry, direction: str, device: str, dtype, layout: str = "nchw", math_=None) -> ConvKey:
    """The key of the forward problem ``geo`` (a ``conv_geometry``: no zero insertion) timed in ``direction``."""
    if any(z != 1 for z in geo.insert):
        raise ValueError(f"geo: got a zero-inserted geometry ({geo}); need a forward problem's")
    dt = conv_dtype(dtype)
    return _checked(ConvKey(perfdb.device_model(device), direction, geo.n, geo.c, geo.k, tuple(geo.in_size),
                            tuple(geo.out_size), tuple(geo.kernel), tuple(geo.stride), tuple(geo.pad_lo),
                            tuple(geo.dilation), geo.groups, layout, dt, norm_math(math_, dt)))


def problem_key(x_shape, weight_shape, stride=1, padding=0, dilation=1, groups=1, *, direction: str = "fwd",
                device: str, dtype=np.float32, layout: str = "nchw", math=None) -> ConvKey:
    """The key of conv(x, weight) as torch.nn.functional.conv{1,2,3}d takes it (shapes only), timed in
    ``direction`` on GPU model ``device``."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction: got {direction!r}, need one of {', '.join(DIRECTIONS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: got {layout!r}, need one of {', '.join(LAYOUTS)}")
    return key_of(forward_geometry(x_shape, weight_shape, stride, padding, dilation, groups, dtype), direction,
                  device, dtype, layout, math)


def forward_geometry(x_shape, weight_shape, stride, padding, dilation, groups, dtype) -> ConvGeometry:
    """conv_geometry of the forward problem from shapes (validated as conv{nd}d validates arrays)."""
    dt = dtypes.GEMM_BY_PREFIX[conv_dtype(dtype)].dtype
    for name, shape in (("x_shape", x_shape), ("weight_shape", weight_shape)):
        if not isinstance(shape, (tuple, list)) or not all(isinstance(v, (int, np.integer)) and v >= 1 for v in shape):
            raise ValueError(f"{name}: got {shape!r}, need a tuple of positive ints")
    nd = len(weight_shape) - 2
    if nd not in (1, 2, 3) or len(x_shape) != nd + 2:
        raise ValueError(f"x_shape, weight_shape: got {tuple(x_shape)} and {tuple(weight_shape)}; need (N, C, "
                         f"spatial...) and (K, C/groups, kernel...) of 1, 2 or 3 spatial dims")
    zeros = np.zeros((), dt)
    return conv_geometry(f"conv{nd}d", nd, np.broadcast_to(zeros, tuple(x_shape)),
                         np.broadcast_to(zeros, tuple(weight_shape)), stride, padding, dilation, groups)


def forward_of_transposed(geo: ConvGeometry) -> ConvGeometry | None:
    """The forward problem whose backward-data is the gather ``geo`` (a ``transpose_geometry``: the
    flipped kernel over dY zero-inserted by the stride), or None if no forward problem has it."""
    pad = tuple(d * (r - 1) - lo for d, r, lo in zip(geo.dilation, geo.kernel, geo.pad_lo))
    if any(p < 0 for p in pad):
        return None
    return ConvGeometry(geo.n, geo.k, geo.c, geo.groups, tuple(geo.out_size), tuple(geo.kernel), tuple(geo.insert),
                        tuple(geo.dilation), pad, (1,) * geo.nd, tuple(geo.in_size))


def runtime_keys(geo: ConvGeometry, device: str, dtype, layout: str, math_) -> list[ConvKey]:
    """The keys whose entry decides ``conv_direct.forward_form(geo)``: ``geo`` as a forward problem, and
    ``geo`` as the backward-data of one (they are the same computation)."""
    keys = []
    if all(z == 1 for z in geo.insert):
        keys.append(key_of(geo, "fwd", device, dtype, layout, math_))
    fwd = forward_of_transposed(geo)
    if fwd is not None:
        keys.append(key_of(fwd, "bwd-data", device, dtype, layout, math_))
    return keys


# ---------------------------------------------------------------- entries

def _db(db) -> perfdb.PerfDb:
    if isinstance(db, perfdb.PerfDb):
        return db
    if db is None or isinstance(db, (str, os.PathLike)):
        return perfdb.PerfDb(db)
    raise ValueError(f"db: got {db!r}, need a blasx.perfdb.PerfDb, a file path, or None for the user perf-db")


def store(key: ConvKey, form: str, seconds: dict, db=None) -> None:
    """Record ``form`` as the fastest for ``key``, with the best seconds of every form measured."""
    if not isinstance(key, tuple) or len(key) != len(ConvKey._fields):
        raise TypeError(f"key: got {type(key).__name__}; need a ConvKey (problem_key's), or a tuple of its "
                        f"{len(ConvKey._fields)} fields")
    key = _checked(ConvKey(*key))
    if form not in FORMS:
        raise ValueError(f"form: got {form!r}, need one of {', '.join(FORMS)}")
    if not isinstance(seconds, dict) or form not in seconds or any(
            f not in FORMS or not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0
            for f, v in seconds.items()):
        raise ValueError(f"seconds: got {seconds!r}, need {{form: seconds >= 0}} over {', '.join(FORMS)}, "
                         f"with {form!r} among them")
    _db(db).store_conv(key.text, key.device, key.direction, form, {f: float(v) for f, v in seconds.items()})


def entries(db=None) -> list[dict]:
    """Every valid entry: key (ConvKey), text, form, seconds ({form: s}), date, version."""
    out = []
    for text, _dev, _dir, form, results, date, version in _db(db).conv_rows():
        try:
            key = ConvKey.parse(text)
            secs = {str(f): float(v) for f, v in json.loads(results).items()}
        except (ValueError, TypeError, AttributeError):
            continue  # a row some other tool wrote badly
        if form in FORMS:
            out.append({"key": key, "text": text, "form": form, "seconds": secs, "date": date, "version": version})
    return out


def format_entries(rows: list[dict]) -> list[str]:
    """One line per entry: key, winner, seconds per form."""
    if not rows:
        return ["find-db: no convolution entries (`blasx tune --conv resnet50` measures some)"]
    lines = [f"find-db: {len(rows)} convolution entr{'y' if len(rows) == 1 else 'ies'} (* fastest)"]
    for r in rows:
        cells = "  ".join(f"{f} {s * 1e3:.3f} ms{'*' if f == r['form'] else ''}" for f, s in r["seconds"].items())
        lines.append(f"  {r['text']}  {r['form']}  {cells}")
    return lines


# ---------------------------------------------------------------- cached lookup (the runtime's)

_lock = threading.Lock()
_cache: dict = {"state": None, "table": {}}


def _state(path) -> tuple:
    """(path, the file's stamp, the in-process write generation): what the memos below are valid for."""
    try:
        st = os.stat(path)
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
    except OSError:
        stamp = None
    return str(path), stamp, perfdb.generation()


STAT_SECONDS = 1.0  # stored_form looks at the file again after this long (another process's writes show by then)
_recent: dict = {}  # path -> (monotonic time, _state)


def _recent_state(path) -> tuple:
    """:func:`_state`, the file looked at no more than once in ``STAT_SECONDS`` (writes in this process show at once)."""
    key, now = str(path), time.monotonic()
    got = _recent.get(key)
    if got is None or now - got[0] > STAT_SECONDS or got[1][2] != perfdb.generation():
        got = _recent[key] = (now, _state(path))
    return got[1]


def _db_path():
    """perfdb.default_path(), made again only when the variables it depends on change."""
    loc = perfdb.location_state()
    if _path["loc"] != loc:
        _path["path"], _path["loc"] = perfdb.default_path(), loc
    return _path["path"]


_path: dict = {"loc": None, "path": None}


def _table() -> dict:
    """problem (key without n) -> {n: form}, of the user perf-db; reloaded when the file changes."""
    path = perfdb.default_path()
    state = _state(path)
    if _cache["state"] != state:
        with _lock:
            if _cache["state"] != state:
                table: dict = {}
                for e in entries(perfdb.PerfDb(path)):
                    table.setdefault(e["key"].problem, {})[e["key"].n] = e["form"]
                _cache["table"], _cache["state"] = table, state
    return _cache["table"]


def lookup(key: ConvKey) -> str | None:
    """The stored form of ``key`` (exact batch, else the nearest one), or None."""
    if perfdb.disabled():
        return None
    by_n = _table().get(key.problem)
    if not by_n:
        return None
    if key.n in by_n:
        return by_n[key.n]
    return by_n[min(by_n, key=lambda n: (abs(math.log2(n / key.n)), -n))]


_forms: dict = {"state": None, "memo": {}}


def stored_form(geo: ConvGeometry, dtype, layout: str = "nchw", math_=None, device=None,
                direction: str = "fwd") -> str | None:
    """The find-db's device-route form (one of FORMS but "depthwise") for the gather ``geo`` in ``dtype``, ``layout``
    and ``math`` on GPU ``device`` (a model name, an ordinal, or None: CuPy's current device), or None
    (no entry, no GPU, or the db is off); ``direction`` "bwd-weight": the weight gradient of the forward
    problem ``geo`` instead. Memoized per problem until the db changes."""
    if perfdb.disabled():
        return None
    name = device if isinstance(device, str) else gpu_name(device)
    if name is None:
        return None
    from .. import precision
    math_ = precision.check_math(math_)
    state = _recent_state(_db_path())
    if _forms["state"] != state:
        _forms["memo"], _forms["state"] = {}, state
    memo = _forms["memo"]
    mkey = (geo, np.dtype(dtype).str if not isinstance(dtype, str) else dtype, layout, math_, name, direction)
    if mkey not in memo:
        form = None
        try:
            keys = [key_of(geo, direction, name, dtype, layout, math_)] if direction == "bwd-weight" else \
                runtime_keys(geo, name, dtype, layout, math_)
        except ValueError:  # a dtype or layout no entry can have
            keys = []
        for k in keys:
            form = lookup(k)
            if form in FORMS and form != "depthwise":
                break
            form = None
        memo[mkey] = form
    return memo[mkey]


def gpu_name(device=None) -> str | None:
    """The model of CUDA GPU ``device`` (an ordinal; None: CuPy's current device), or None where CuPy
    is not loaded or finds no GPU (lookups then find nothing)."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return None
    try:
        ordinal = cupy.cuda.Device().id if device is None else int(device)
        name = _NAMES.get(ordinal)
        if name is None:
            raw = cupy.cuda.runtime.getDeviceProperties(ordinal)["name"]
            name = _NAMES.setdefault(ordinal, raw.decode() if isinstance(raw, bytes) else str(raw))
        return name
    except Exception:  # noqa: BLE001 - no driver or no such GPU: no entry applies
        return None


_NAMES: dict = {}
