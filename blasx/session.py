"""The process-wide engine serving every calling thread: ``configure``, ``shutdown`` and lazy start.

It is built on first use from ``configure()``'s settings, else ``$BLASX_DEVICES``, else what the
machine has (all CUDA GPUs, or the CPU); ``configure`` replaces it once the running calls finish.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from dataclasses import dataclass

from .operands import READONLY
from .runtime.config import DeviceSpec, parse_devices
from .runtime.devices.base import backend
from .runtime.dtypes import MATH_MODES
from .runtime.engine import Engine, EngineClosed, EngineConfig

DEFAULT_STREAMS = 4


@dataclass(frozen=True)
class Settings:
    devices: str | None = None
    tile: int | None = None
    streams: int = DEFAULT_STREAMS
    cache_bytes: int | None = None
    cpu: bool | str | None = None
    trace: bool = True
    math: str = "ieee"  # float32 gemm's math: "ieee" or "tf32" (blasx.precision)


_lock = threading.RLock()
_settings = Settings()
_engine: Engine | None = None

#: The CPU device of the running engine while it runs every call on the host BLAS in the caller's thread
#: (the CPU alone, ``tile=None``), else None: blasx.dispatch's route for a call. Set by engine() once its
#: engine has started; cleared by shutdown() before it stops one.
host_device = None


def configure(devices: str | None = None, tile: int | None = None, streams: int = DEFAULT_STREAMS,
              cache_bytes: int | None = None, cpu: bool | str | None = None, trace: bool = True,
              math: str = "ieee") -> None:
    """Choose the devices and knobs of the blasx engine (replacing a running one).

    devices: a spec (``"cuda"``, ``"cuda:0,1"``, ``"sim:4"``, ``"sim:2,slow=4"``, ``"cpu"``);
        None means ``$BLASX_DEVICES``, else all CUDA GPUs, else the CPU.
    tile: tile size T (None: chosen per call).
    streams: streams (and concurrent tasks) per GPU, the paper's 4 by default.
    cache_bytes: tile-cache heap per device (None: half the GPU memory free when the engine starts; 64 MiB
        per sim).
    cpu: the CPU worker beside the GPUs. None (default): auto mode beside CUDA GPUs (a task only where
        predicted to finish before the GPUs would finish the rest, runtime/admission.py), none beside
        sims. ``"auto"``: auto mode beside any GPUs or sims. True: always, by demand. False: never.
    trace: keep a per-operation timeline in the profiles.
    math: float32 gemm's math, ``"ieee"`` (default: float32 products) or ``"tf32"`` (tensor cores:
        inputs rounded to 10 mantissa bits, float32 accumulation); a call's ``math=`` overrides it.
    """
    spec = parse_devices(devices) if devices is not None else None  # validated now, not at the first call
    if tile is not None and (not isinstance(tile, int) or isinstance(tile, bool) or tile < 1):
        raise ValueError(f"tile: got {tile!r}, need a positive int (or None to choose per call)")
    if not isinstance(streams, int) or isinstance(streams, bool) or not 1 <= streams <= 32:
        raise ValueError(f"streams: got {streams!r}, need an int from 1 to 32")
    if cache_bytes is not None and (not isinstance(cache_bytes, int) or cache_bytes < 1 << 16):
        raise ValueError(f"cache_bytes: got {cache_bytes!r}, need an int >= 65536 (or None)")
    if not (cpu is None or isinstance(cpu, bool) or (isinstance(cpu, str) and cpu == "auto")):
        raise ValueError(f"cpu: got {cpu!r}, need True, False, 'auto' or None")
    if not isinstance(trace, bool):
        raise ValueError(f"trace: got {trace!r}, need True or False")
    if spec is not None:
        _check_sim_settings(spec, cache_bytes, cpu)
    math = math.lower() if isinstance(math, str) else math  # (as a call's math= takes it)
    if math not in MATH_MODES:
        raise ValueError(f"math: got {math!r}, allowed: {', '.join(map(repr, MATH_MODES))}")
    global _settings
    with _lock:
        shutdown()
        _settings = Settings(devices, tile, streams, cache_bytes, cpu, trace, math)


def settings() -> Settings:
    return _settings


def engine() -> Engine:
    """The running engine, started on first use."""
    global _engine
    for attempt in range(3):  # (configure() in another thread may close the one built here before it starts)
        with _lock:
            if _engine is not None and _engine.dead:  # every device failed: start them again
                _engine.shutdown()
            if _engine is None or _engine.closed:
                _engine = _build(_settings)
            eng = _engine
        try:
            eng.start()
            break
        except EngineClosed:
            if attempt == 2:
                raise
    if host_device is None and eng.inline and eng.config.tile is None:  # the CPU alone, no fixed tile
        _publish_host(eng)
    return eng


def on_cuda() -> bool:
    """Whether the running engine has CUDA devices (its large host results then come page-locked,
    runtime/hostpool.py). Starts nothing: before the first call, False."""
    eng = _engine
    return eng is not None and not eng.closed and any(d.kind == "cuda" for d in eng.devices)


def _publish_host(eng: Engine) -> None:
    """Set ``host_device``, unless ``eng`` was replaced or shut down since this thread started it
    (a stale device would send calls to the host after configure() chose other devices)."""
    global host_device
    with _lock:
        if _engine is eng and not eng.closed:
            host_device = eng.devices[0]


def shutdown() -> None:
    """Stop the workers and free device memory; the next call starts a new engine."""
    _stop(cancel=False)


def _stop(cancel: bool, keep=frozenset()) -> None:
    """Stop the engine and free what blasx holds idle; ``cancel`` (interpreter exit): the calls still in
    flight are cancelled (their threads are about to vanish), the tasks already on devices end; those in
    ``keep`` finish."""
    global _engine, host_device
    eng = None
    try:
        with _lock:
            eng, _engine = _engine, None
            host_device = None
    finally:  # (an interrupt after the swap still stops the engine: nothing else refers to it)
        if eng is not None:
            try:
                eng.shutdown(cancel=cancel, keep=keep)
            except KeyboardInterrupt:
                if not eng.closed:  # (it came before shutdown began: once more, then raised)
                    eng.shutdown(cancel=cancel, keep=keep)
                raise
    pool = sys.modules.get("blasx.runtime.hostpool")  # idle page-locked result buffers
    if pool is not None and not cancel:
        pool.POOL.clear()
    lanes = sys.modules.get("blasx.dnn.lanes")  # blasx.dnn's long-lived threads, where it was used
    if lanes is not None:
        lanes.stop_idle()
    host_batch = sys.modules.get("blasx.dnn.host_batch")  # its idle streams, staging and scratch
    if host_batch is not None:
        host_batch.release()


# Workers are non-daemon threads, and the interpreter joins those *before* running atexit
# hooks: register where concurrent.futures does, so shutdown runs first (a script that never
# calls blasx.shutdown() must still exit). atexit stays as a fallback for other runtimes.
_exiting = False  # the exit hook ran: an engine threads still calling start then has daemon threads


def _at_exit() -> None:
    global _exiting
    _exiting = True
    _stop(cancel=True, keep=_calls_the_interpreter_waits_for())


def _calls_the_interpreter_waits_for() -> frozenset:
    """The calls in flight of live non-daemon threads: the interpreter joins those threads after this hook, so
    their calls finish (daemon threads' are cancelled: those threads vanish)."""
    dispatch = sys.modules.get("blasx.dispatch")
    if dispatch is None:
        return frozenset()
    me = threading.current_thread()
    alive = {t.ident for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()}
    with dispatch._running_lock:
        return frozenset(c for ident, c in dispatch._running.items() if ident in alive)


if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_at_exit)
atexit.register(_at_exit)


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's worker threads (nor a usable CUDA context): it forgets the
    parent's engine, unstopped, and builds its own at its first call (sims and the CPU work there; CUDA then
    raises CUDA's own initialization error). The lock is made anew: another parent thread may have held it."""
    global _engine, host_device, _lock
    _engine, host_device, _lock = None, None, threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _retire_readonly(base: int) -> None:
    """A read-only array was collected: its cached tiles become dead in the running engine."""
    eng = _engine
    if eng is not None and not eng.closed:
        eng.retire_base(base)


READONLY.on_retire = _retire_readonly


def cuda_ordinals() -> tuple[int, ...]:
    """The CUDA GPUs the engine uses (or will use, as configured), without starting it: device
    routes that need no engine (blasx.dnn on CuPy arrays) ask this, so the engine's tile cache
    does not take GPU memory they need."""
    with _lock:
        eng = _engine if _engine is not None and not _engine.closed else None
        s = _settings
    if eng is not None:
        return tuple(d.ordinal for d in eng.devices if d.kind == "cuda")
    n = _cuda_count()
    text = s.devices or os.environ.get("BLASX_DEVICES") or ("cuda" if n else "cpu")
    got = _ORDINALS.get((text, n))
    if got is None:
        spec = parse_devices(text)
        got = _ORDINALS[(text, n)] = () if spec.kind != "cuda" else tuple(i for i in (spec.ids or range(n))
                                                                          if 0 <= i < n)
    return got


_ORDINALS: dict = {}  # (device spec, GPUs seen) -> cuda_ordinals' answer (a spec parses the same every time)


_NO_CUPY: list = []  # [True] once CuPy failed to import: not tried again (a failed import takes CPython's
# module lock each time, and a child forked while another thread held it would hang on its own first try)


def _cuda_count() -> int:
    if _NO_CUPY:
        return 0
    try:
        import cupy
    except Exception:  # noqa: BLE001 - no CuPy (or a broken one): no CUDA here
        _NO_CUPY.append(True)
        return 0
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver or no GPU: no CUDA here
        return 0


def _build(s: Settings) -> Engine:
    spec_text = s.devices or os.environ.get("BLASX_DEVICES") or ("cuda" if _cuda_count() else "cpu")
    try:
        spec = parse_devices(spec_text)
    except ValueError as e:  # (a spec from the environment: the variable named)
        if s.devices:
            raise
        raise ValueError(f"$BLASX_DEVICES: {str(e).removeprefix('devices: ')}") from None
    devices = _make_devices(spec, s)
    text = os.environ.get("BLASX_SWITCH_INTERVAL")  # an experiment switch (runtime/switching.py)
    try:
        si = float(text) if text else None
    except ValueError:
        si = -1.0
    if si is not None and not 0 < si < 1:
        raise ValueError(f"BLASX_SWITCH_INTERVAL: got {text!r}, need seconds in (0, 1), e.g. 0.0002")
    eng = Engine(EngineConfig(devices=devices, tile=s.tile, streams=s.streams, switch_interval=si,
                              daemon_threads=_exiting))
    eng.spec = spec_text
    return eng


def _make_devices(spec: DeviceSpec, s: Settings) -> list:
    if spec.kind == "cpu":
        return [backend("cpu")(0, name="cpu", trace=s.trace)]
    if spec.kind == "sim":
        from .runtime.devices.sim import build_sim_devices
        _check_sim_settings(spec, s.cache_bytes, s.cpu)  # ($BLASX_DEVICES: first read here)
        devs = build_sim_devices(spec, streams=s.streams, cache_bytes=s.cache_bytes, trace=s.trace)
    else:
        from .runtime.devices import cuda  # noqa: F401 - registers the backend (needs CuPy)
        n = _cuda_count()
        if n == 0:
            raise RuntimeError("devices: 'cuda' asked for, but CuPy finds no CUDA GPU here; use 'cpu' or 'sim:N'")
        ids = spec.ids or tuple(range(n))
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"devices: GPU numbers {bad} do not exist; this machine has {n} (0..{n - 1})")
        devs = [backend("cuda")(w, ordinal=i, nstreams=s.streams, cache_bytes=s.cache_bytes, trace=s.trace)
                for w, i in enumerate(ids)]
    mode = cpu_mode(s.cpu, spec.kind)
    if mode:
        from .runtime.devices.cpu import default_threads
        devs.append(backend("cpu")(len(devs), name="cpu", threads=default_threads(len(devs)), trace=s.trace,
                                   auto=mode == "auto"))
    return devs


def _check_sim_settings(spec, cache_bytes, cpu) -> None:
    """A sim spec's options against configure's other settings: mem= and cache_bytes both set the heap (give
    one), and no CPU worker computes beside timing-mode sims (their operands hold no data)."""
    if spec.kind != "sim":
        return
    from .runtime.config import check_sim_heap, sim_settings
    check_sim_heap(spec, cache_bytes)
    if sim_settings(spec).timing and cpu_mode(cpu, spec.kind):
        raise ValueError("cpu: a CPU worker cannot run beside timing-mode sims (timing=1 / data=0): "
                         "their operands hold no data; use cpu=False")


def cpu_mode(cpu: bool | str | None, kind: str) -> str | None:
    """How the CPU worker joins stream devices of ``kind``: ``"always"`` (by demand), ``"auto"``
    (by the admission rule) or None (no CPU worker). ``cpu=None`` is auto beside CUDA GPUs and
    none beside sims, whose speed bears no relation to this host's CPU (and whose timing mode
    has no data for a CPU to compute on)."""
    if cpu is None:
        return "auto" if kind == "cuda" else None
    return "auto" if cpu == "auto" else "always" if cpu else None


def reset() -> None:
    """Bring failed devices back: the next call starts a fresh engine with the same settings (as it
    does by itself once every device has failed)."""
    shutdown()

