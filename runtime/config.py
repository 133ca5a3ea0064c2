"""Device selection: ``blasx.configure(devices=...)`` and ``BLASX_DEVICES`` (docs/usage.md lists it all).

A spec names one backend and its arguments: ``cuda`` (every GPU), ``cuda:0,1``, ``sim:4`` (simulated
GPUs) with options (cost model, speeds, fault injection, peers, the timing mode of ``devices/sim.py``),
``cpu`` (the host's BLAS).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

KNOWN_KINDS = ("cuda", "sim", "cpu")
SIM_FLOAT_OPTIONS = ("slow", "rate", "h2d", "d2h", "p2p")
#: Options of the data-free timing mode and of the shared host link (see the module docstring).
SIM_TIMING_OPTIONS = ("timing", "data", "mem", "dilate", "issue", "host", "hostgroup", "hostduplex", "krate")
#: Tile kernels a sim runs (``devices/numpy_kernels.KERNELS``), the names ``krate=`` accepts.
SIM_KERNELS = ("gemm", "scale", "axpby", "syrk", "herk", "syr2k", "her2k", "symm", "hemm", "trmm", "trsm", "invmm",
               "trtri", "add")
SIM_OPTIONS = SIM_FLOAT_OPTIONS + ("speeds", "fail", "peers") + SIM_TIMING_OPTIONS
MIN_SIM_MEM = 1 << 16  # the smallest tile-cache heap (configure's cache_bytes has the same floor)

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
           "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]i?)?[bB]?\s*$")


@dataclass(frozen=True)
class DeviceSpec:
    kind: str
    ids: tuple[int, ...] = ()  # cuda ordinals; for sim a single count
    options: dict = field(default_factory=dict)


MAX_SIMS = 64  # sims an engine may have (each runs a worker and its streams' threads)


def parse_devices(spec: str) -> DeviceSpec:
    """Parse a device spec string; errors name the parameter, the value and the grammar."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"devices: got {spec!r}, expected a spec such as 'cuda', 'cuda:0,1', 'sim:4', 'sim:2,slow=4' or 'cpu'")
    kind, _, rest = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in KNOWN_KINDS:
        raise ValueError(f"devices: unknown backend {kind!r} in {spec!r}; allowed: {', '.join(KNOWN_KINDS)}")
    ids: list[int] = []
    options: dict = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        if "=" in item:
            k, _, v = item.partition("=")
            if k.strip() in options:
                raise ValueError(f"devices: option {k.strip()!r} given twice in {spec!r}")
            options[k.strip()] = v.strip()
        else:
            try:
                ids.append(int(item))
            except ValueError:
                raise ValueError(f"devices: {item!r} in {spec!r} is neither a device number nor key=value") from None
    if kind == "cpu" and (ids or options):
        raise ValueError(f"devices: 'cpu' takes no arguments, got {spec!r}")
    if kind == "sim":
        if len(ids) > 1:
            raise ValueError(f"devices: 'sim:N' takes one count, got {spec!r}")
        if ids and not 1 <= ids[0] <= MAX_SIMS:
            raise ValueError(f"devices: sim count must be from 1 to {MAX_SIMS}, got {ids[0]} in {spec!r}")
        _check_sim_options(options, spec)
        n = ids[0] if ids else 2
        if "speeds" in options and len(options["speeds"].split("/")) != n:
            raise ValueError(f"devices: speeds lists {len(options['speeds'].split('/'))} factors "
                             f"for {n} sim devices in {spec!r}")
        if "fail" in options and not 0 <= int(options["fail"].partition("@")[0]) < n:
            raise ValueError(f"devices: fail names sim device {options['fail'].partition('@')[0]}, "
                             f"but {spec!r} has devices 0..{n - 1}")
    if kind == "cuda" and options:
        raise ValueError(f"devices: 'cuda' takes GPU numbers only, got options {sorted(options)} in {spec!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"devices: repeated device number in {spec!r}")
    return DeviceSpec(kind, tuple(ids), options)


#: what turns a switch given in the environment off (``BLASX_PERFDB``, ``BLASX_RESULT_POOL``), lower case
OFF_WORDS = ("0", "off", "no", "false")
ON_WORDS = ("1", "on", "yes", "true")


def env_switch(name: str, default: bool = True) -> bool:
    """An on/off switch read from the environment variable ``name`` (unset or empty: ``default``); any word but
    those of OFF_WORDS / ON_WORDS raises ValueError naming the variable (a typo must not leave it as it was)."""
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in OFF_WORDS or text in ON_WORDS:
        return text in ON_WORDS
    raise ValueError(f"${name}: got {os.environ[name]!r}; allowed: {', '.join(ON_WORDS)} (on) or "
                     f"{', '.join(OFF_WORDS)} (off)")


def parse_size(value: str) -> float:
    """'141G' -> 141e9, '64Mi' -> 2**26, '1.5e9' -> 1.5e9 (K M G T decimal, Ki Mi Gi Ti binary,
    an optional trailing B). Raises ValueError naming the value and the grammar."""
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"got {value!r}; expected a number with an optional suffix "
                         f"K, M, G, T (powers of 1000) or Ki, Mi, Gi, Ti (powers of 1024), e.g. 141G or 64Mi")
    size = float(m.group(1)) * _SUFFIX[(m.group(2) or "").lower()]
    if not size < float("inf"):  # (1e400 reads as inf)
        raise ValueError(f"got {value!r}; expected a finite size")
    return size


def parse_krate(value: str) -> tuple[tuple[str, float], ...]:
    """'trmm:0.9/trsm:0.35' -> (('trmm', 0.9), ('trsm', 0.35)); ValueError on a bad item."""
    out: dict[str, float] = {}
    for item in value.split("/"):
        name, sep, factor = item.partition(":")
        name = name.strip()
        f = float(factor) if sep else float("nan")  # ValueError for a non-number
        if name not in SIM_KERNELS or name in out or not FACTOR_RANGE[0] <= f <= FACTOR_RANGE[1]:
            raise ValueError(f"krate: bad item {item!r}")
        out[name] = f
    return tuple(out.items())


#: The range of a sim's slowdown and rate factors (beyond it a tile op's duration overflows a sleep).
FACTOR_RANGE = (1e-6, 1e6)


def _factor(v) -> bool:
    return FACTOR_RANGE[0] <= float(v) <= FACTOR_RANGE[1]


_FACTORS = f"a number from {FACTOR_RANGE[0]:g} to {FACTOR_RANGE[1]:g}"

#: Each sim option's check (True, or ValueError, when good) and what it allows (None: not spelled out).
_SIM_RULES = {
    **dict.fromkeys(SIM_FLOAT_OPTIONS, (lambda v: 1 <= float(v) < float("inf"), "a finite rate >= 1 (per second)")),
    "slow": (_factor, _FACTORS),
    "speeds": (lambda v: all(_factor(x) for x in v.split("/")), f"factors joined by '/', each {_FACTORS}"),
    "fail": (lambda v: all(int(x) >= 0 for x in v.partition("@")[::2]), "DEVICE@KERNEL_COUNT, ints >= 0"),
    "peers": (lambda v: v in ("0", "1"), "0 or 1"),
    **dict.fromkeys(("timing", "data", "hostduplex"), (lambda v: v in ("0", "1"), "0 or 1")),
    "mem": (lambda v: parse_size(v) >= MIN_SIM_MEM and parse_size(v) == int(parse_size(v)),
            f"a byte count >= {MIN_SIM_MEM}, e.g. 70G, 64Mi or 1e9"),
    "dilate": (_factor, _FACTORS),
    "issue": (lambda v: 0 <= float(v) < 1, "seconds, at least 0 and below 1, e.g. 2e-5"),
    "host": (lambda v: 1 <= parse_size(v) < float("inf"), "a bandwidth in bytes/s >= 1, e.g. 200G or 5.5e10"),
    "hostgroup": (lambda v: int(v) >= 1, "an int >= 1"),
    "krate": (lambda v: parse_krate(v) is not None,
              f"KERNEL:FACTOR pairs joined by '/', each kernel once, factors {FACTOR_RANGE[0]:g} to "
              f"{FACTOR_RANGE[1]:g}, kernels of {', '.join(SIM_KERNELS)}"),
}


def _check_sim_options(options: dict, spec: str) -> None:
    for k, v in options.items():
        if k not in SIM_OPTIONS:
            raise ValueError(f"devices: unknown sim option {k!r} in {spec!r}; allowed: {', '.join(SIM_OPTIONS)}")
        check, allowed = _SIM_RULES[k]
        try:
            ok = check(v)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"devices: bad value {v!r} for sim option {k!r} in {spec!r}"
                             + (f"; allowed: {allowed}" if allowed else ""))
    if "timing" in options and "data" in options and options["timing"] == options["data"]:
        raise ValueError(f"devices: sim options timing={options['timing']} and data={options['data']} "
                         f"contradict each other in {spec!r}; timing=1 is data=0 (give one of them)")
    for k in ("hostgroup", "hostduplex"):
        if k in options and "host" not in options:
            raise ValueError(f"devices: sim option {k}={options[k]} in {spec!r} needs host=BYTES_PER_S "
                             f"(the shared host cap it shapes)")


def sim_factors(spec: DeviceSpec) -> list[float]:
    """Slowdown factor of each simulated device."""
    n = spec.ids[0] if spec.ids else 2
    if "speeds" in spec.options:
        return [float(x) for x in spec.options["speeds"].split("/")]  # parse_devices checked the count
    f = [1.0] * n
    if "slow" in spec.options:
        f[-1] = float(spec.options["slow"])
    return f


@dataclass(frozen=True)
class SimSettings:
    """The typed sim options of a spec that are not per-device factors (see the module docstring)."""

    timing: bool = False  # data-free timing mode
    mem: int | None = None  # tile-cache heap bytes per sim (None: the caller's default)
    dilate: float = 1.0  # every duration of every sim times this
    issue: float = 0.0  # host seconds per launched kernel or copy (times dilate)
    host: float | None = None  # shared host cap, bytes/s (None: independent links)
    hostgroup: int | None = None  # sims per shared cap (None: all of them)
    hostduplex: bool = False  # separate H2D and D2H caps
    krate: tuple[tuple[str, float], ...] = ()  # (kernel, rate factor) pairs; others run at ``rate``


def check_sim_heap(spec: DeviceSpec, cache_bytes: int | None) -> None:
    """configure's cache_bytes and a sim spec's mem= both set the heap: given both, they must agree."""
    mem = sim_settings(spec).mem
    if cache_bytes is not None and mem is not None and cache_bytes != mem:
        raise ValueError(f"cache_bytes: got {cache_bytes!r}, but the device spec sets mem={spec.options['mem']} "
                         f"({mem} bytes); give one of them")


def sim_settings(spec: DeviceSpec) -> SimSettings:
    """Typed timing-mode and host-link options of a parsed sim spec."""
    o = spec.options
    return SimSettings(
        timing=o.get("timing") == "1" or o.get("data") == "0",
        mem=int(parse_size(o["mem"])) if "mem" in o else None,
        dilate=float(o.get("dilate", 1.0)),
        issue=float(o.get("issue", 0.0)),
        host=parse_size(o["host"]) if "host" in o else None,
        hostgroup=int(o["hostgroup"]) if "hostgroup" in o else None,
        hostduplex=o.get("hostduplex") == "1",
        krate=parse_krate(o["krate"]) if "krate" in o else (),
    )
