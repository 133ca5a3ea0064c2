"""Device selection: ``blasx.configure(devices=...)`` and ``BLASX_DEVICES``.

A spec names one backend and its arguments:

==================  ==========================================================
``cuda``            every CUDA GPU
``cuda:0,1``        those GPU ordinals
``sim:4``           four simulated GPUs
``sim:2,slow=4``    two sims, the last one 4x slower
``sim:3,speeds=1/1/4``  per-device slowdown factors
``sim:2,fail=1@5``  sim 1 raises at its 5th kernel (fault injection)
``sim:2,peers=0``   sims without peer links (no L2 copies)
``cpu``             the host only, through numpy's BLAS
==================  ==========================================================

Sim options ``rate=`` (flop/s), ``h2d=``, ``d2h=``, ``p2p=`` (bytes/s) set its
cost model. The CPU worker joins GPU workers with ``configure(cpu=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KNOWN_KINDS = ("cuda", "sim", "cpu")
SIM_FLOAT_OPTIONS = ("slow", "rate", "h2d", "d2h", "p2p")


@dataclass(frozen=True)
class DeviceSpec:
    kind: str
    ids: tuple[int, ...] = ()  # cuda ordinals; for sim a single count
    options: dict = field(default_factory=dict)


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
        if ids and ids[0] < 1:
            raise ValueError(f"devices: sim count must be >= 1, got {ids[0]} in {spec!r}")
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


def _check_sim_options(options: dict, spec: str) -> None:
    allowed = SIM_FLOAT_OPTIONS + ("speeds", "fail", "peers")
    for k, v in options.items():
        if k not in allowed:
            raise ValueError(f"devices: unknown sim option {k!r} in {spec!r}; allowed: {', '.join(allowed)}")
        try:
            if k in SIM_FLOAT_OPTIONS:
                if float(v) <= 0:
                    raise ValueError
            elif k == "speeds":
                if any(float(x) <= 0 for x in v.split("/")):
                    raise ValueError
            elif k == "fail":
                d, _, n = v.partition("@")
                int(d), int(n)
            elif k == "peers" and v not in ("0", "1"):
                raise ValueError
        except ValueError:
            raise ValueError(f"devices: bad value {v!r} for sim option {k!r} in {spec!r}") from None


def sim_factors(spec: DeviceSpec) -> list[float]:
    """Slowdown factor of each simulated device."""
    n = spec.ids[0] if spec.ids else 2
    if "speeds" in spec.options:
        f = [float(x) for x in spec.options["speeds"].split("/")]
        if len(f) != n:
            raise ValueError(f"devices: speeds lists {len(f)} factors for {n} sim devices")
        return f
    f = [1.0] * n
    if "slow" in spec.options:
        f[-1] = float(spec.options["slow"])
    return f
