"""The sim backend's data-free timing mode (``sim:N,timing=1``), its options, and the shared host link.

Calls are built as ``bench/scaling_sim.py`` builds them: ``Operand`` objects with no array behind
them (``array=None``, fake addresses), planned with ``plan_gemm`` and submitted to an engine of
timing sims; a sim that touched a host operand or ran a numpy kernel would fail.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from blasx.runtime.call import Call, Operand
from blasx.runtime.config import SIM_KERNELS, SimSettings, parse_devices, parse_size, sim_settings
from blasx.runtime.devices import sim as sim_mod
from blasx.runtime.devices.sim import HostLink, SimModel, TimingLoc, build_sim_devices
from blasx.runtime.engine import Engine, EngineConfig
from blasx.runtime.knobs import Knobs
from blasx.runtime.plans import plan_trmm
from blasx.runtime.stats import CallStats, DeviceInfo
from blasx.runtime.plans import plan_gemm
from blasx.runtime.tiling import OP_N

_bases = itertools.count(-(10 ** 9), -1)


def run_gemm(spec: str, m: int, n: int, k: int, tile: int, beta: float = 0.0, dtype=np.float64, streams=2):
    """Submit C = A B + beta C on host operands that do not exist; returns (devices, profile, seconds)."""
    devs = build_sim_devices(parse_devices(spec), streams=streams)
    eng = Engine(EngineConfig(devices=devs, streams=streams, knobs=Knobs()))
    dt = np.dtype(dtype)
    shapes = ((m, k), (k, n), (m, n))
    ops = [Operand(None, r, c, r, (i + 1) << 40, -1, (next(_bases), r, c, r, dt.str, tile))
           for i, (r, c) in enumerate(shapes)]
    tasks = plan_gemm(m, n, k, tile, OP_N, OP_N, beta_zero=(beta == 0))
    stats = CallStats([DeviceInfo(d.index, d.name, d.kind) for d in devs])
    call = Call("gemm", ops, tasks, dt, 1.0, beta, stats)
    try:
        eng.start()
        assert all(d.arena is None and d.heap is not None for d in devs)  # no arena bytes, a real heap
        t0 = time.perf_counter()
        eng.submit(call)
        wall = time.perf_counter() - t0
    finally:
        eng.shutdown()
    assert call.error is None and call.remaining == 0
    return devs, stats.profile(), wall


@pytest.fixture
def no_numpy_kernels(monkeypatch):
    """Data mode would look kernels up here: in timing mode nothing may."""
    monkeypatch.setattr(sim_mod, "KERNELS", {})


# --------------------------------------------------------------------------- timing mode runs

@pytest.mark.parametrize("ndev", [2, 4])
def test_timing_mode_runs_gemm_without_data(no_numpy_kernels, ndev):
    devs, prof, _ = run_gemm(f"sim:{ndev},timing=1,mem=1Mi", 96, 80, 64, 16, beta=0.5)
    assert all(d.timing and d.heap.capacity == 1 << 20 for d in devs)
    assert prof.totals()["tasks"] == 6 * 5
    assert prof.totals()["flops"] == 2.0 * 96 * 80 * 64
    assert sum(d.bytes_out for d in devs) == 96 * 80 * 8  # every C tile written back once


def test_timing_mode_heap_has_full_size_and_evicts(no_numpy_kernels):
    # 4 KiB tiles (32 x 32 doubles) in a 64 KiB heap: the A and B tiles (32 + 32) cannot all stay.
    devs, prof, _ = run_gemm("sim:1,timing=1,mem=65536", 256, 128, 128, 32)
    assert devs[0].heap.capacity == 65536
    assert prof.totals()["evictions"] > 0


@pytest.mark.serial  # wall-clock bounds: run alone (make test's second pass)
def test_compute_bound_wall_time_is_near_the_cost_model_bound(no_numpy_kernels):
    # One device, copies 1e6x faster than kernels: the call lasts about flops / rate * dilate.
    m = n = k = 64
    flops = 2.0 * m * n * k
    rate, dilate = 5e6, 3.0  # 8 kernels of 65536 flops: 0.105 s x 3 = 0.31 s
    bound = flops / rate * dilate
    for attempt in range(3):  # a stall of the machine (a VM's) lengthens one run: the upper bounds get three
        devs, prof, wall = run_gemm(f"sim:1,timing=1,rate={rate:g},h2d=1e12,d2h=1e12,p2p=1e12,dilate={dilate:g}",
                                    m, n, k, 32)
        assert bound <= prof.wall and bound <= wall, (prof.wall, wall, bound)  # never faster than the model
        if prof.wall <= 1.5 * bound and wall <= 1.5 * bound + 0.05:
            break
    assert prof.wall <= 1.5 * bound, (prof.wall, bound)
    assert wall <= 1.5 * bound + 0.05, (wall, bound)
    busy = prof.breakdown()[0].busy
    assert bound * 0.99 <= busy <= 1.2 * bound  # kernels hold the compute engine for their cost each


def test_byte_counters_equal_the_host_traffic_of_a_tiny_case(no_numpy_kernels):
    # 1 device, 2 x 2 tiles of 16 x 16 doubles (2 KiB) per operand, cache large enough for all:
    # every A and B tile crosses once, C comes in once (beta != 0) and goes out once.
    tile_bytes = 16 * 16 * 8
    devs, prof, _ = run_gemm("sim:1,timing=1", 32, 32, 32, 16, beta=0.5)
    d = devs[0]
    assert (d.bytes_in, d.bytes_out, d.bytes_p2p) == (12 * tile_bytes, 4 * tile_bytes, 0)
    c = prof.counters[0]
    assert (c["bytes_h2d"], c["bytes_d2h"], c["bytes_p2p"]) == (d.bytes_in, d.bytes_out, d.bytes_p2p)
    assert (c["misses"], c["l2_hits"]) == (8, 0)


def test_byte_counters_agree_with_the_stats_on_several_devices(no_numpy_kernels):
    tile_bytes = 16 * 16 * 4
    devs, prof, _ = run_gemm("sim:3,timing=1", 64, 64, 64, 16, beta=0.0, dtype=np.float32)
    for i, d in enumerate(devs):
        c = prof.counters[i]
        assert (c["bytes_h2d"], c["bytes_d2h"], c["bytes_p2p"]) == (d.bytes_in, d.bytes_out, d.bytes_p2p)
        assert d.bytes_in == c["misses"] * tile_bytes and d.bytes_p2p == c["l2_hits"] * tile_bytes
    assert sum(d.bytes_out for d in devs) == 16 * tile_bytes


@pytest.mark.serial  # wall-clock bounds: run alone (make test's second pass)
def test_shared_host_link_caps_the_aggregate_rate(no_numpy_kernels):
    # Copy-bound (fast kernels, no peers): 2 devices with 2 MB/s links each way; with host=2e6 all
    # their host copies, both directions, share one 2 MB/s channel.
    m, n, k = 128, 128, 32  # 16 one-step tasks on 8 KiB tiles: 128 KiB of C goes out
    common = "sim:2,timing=1,peers=0,rate=1e12,h2d=2e6,d2h=2e6"
    # Each run's bound from its own host bytes: a tile both devices read crosses twice, and which tasks each
    # device took varies from run to run.
    least = (m * k + k * n + m * n) * 8  # A and B in, C out, once each
    devs, indep, _ = run_gemm(common, m, n, k, 32)
    host = sum(d.bytes_in + d.bytes_out for d in devs)
    devs, shared, _ = run_gemm(common + ",host=2e6", m, n, k, 32)
    shared_host = sum(d.bytes_in + d.bytes_out for d in devs)
    assert host >= least and shared_host >= least
    assert devs[0].host_link is devs[1].host_link
    bound = shared_host / 2e6  # all its host bytes through one 2 MB/s channel
    assert shared.wall >= 0.98 * bound, (shared.wall, bound)
    indep_bound = host / 2e6
    assert indep.wall < 0.75 * indep_bound, (indep.wall, indep_bound)  # 2 links, 2 directions each: up to 4x


def test_host_link_reservations():
    link = HostLink(100.0, dilate=2.0)
    assert link.reserve("h2d", 0.0, 100) == 2.0
    assert link.reserve("d2h", 0.0, 100) == 4.0  # one channel for both directions
    assert link.reserve("h2d", 10.0, 50) == 11.0  # idle link: starts at once
    duplex = HostLink(100.0, duplex=True)
    assert duplex.reserve("h2d", 0.0, 100) == 1.0
    assert duplex.reserve("d2h", 0.0, 100) == 1.0
    assert duplex.bytes == {"h2d": 100, "d2h": 100}


def test_host_groups():
    devs = build_sim_devices(parse_devices("sim:5,timing=1,host=55G,hostgroup=2,hostduplex=1"), streams=1)
    links = [d.host_link for d in devs]
    assert links[0] is links[1] and links[2] is links[3] and links[4] is not links[3]
    assert len({id(x) for x in links}) == 3
    assert links[0].bandwidth == 55e9 and links[0].duplex


# --------------------------------------------------------------------------- defaults unchanged

def test_defaults_are_the_data_mode_sim():
    devs = build_sim_devices(parse_devices("sim:2"), streams=2)
    assert [d.timing for d in devs] == [False, False]
    assert all(d.host_link is None and d.cache_bytes == 64 << 20 and d.model == SimModel() for d in devs)
    assert sim_settings(parse_devices("sim:2")) == SimSettings()
    slow = build_sim_devices(parse_devices("sim:3,slow=4,dilate=10"), streams=1)
    assert [d.model.slow for d in slow] == [1.0, 1.0, 4.0] and {d.model.dilate for d in slow} == {10.0}
    assert slow[2].model.kernel_time(4e9) == 40.0  # 1 s at 4e9 flop/s, x slow 4, x dilate 10


def test_timing_loc():
    loc = TimingLoc(512, 16, 8, 8)
    assert (loc.offset, loc.rows, loc.cols, loc.nbytes) == (512, 16, 8, 1024)


# --------------------------------------------------------------------------- options

def test_parse_size():
    assert parse_size("141G") == 141e9
    assert parse_size("64Mi") == 2 ** 26
    assert parse_size("64MB") == 64e6
    assert parse_size("1.5e9") == 1.5e9
    assert parse_size("65536") == 65536
    with pytest.raises(ValueError, match=r"'12X'.*K, M, G, T"):
        parse_size("12X")


def test_sim_settings():
    s = sim_settings(parse_devices("sim:8,data=0,mem=70.5G,dilate=20,issue=2e-5,host=200G"))
    assert s == SimSettings(timing=True, mem=70_500_000_000, dilate=20.0, issue=2e-5, host=200e9)
    assert sim_settings(parse_devices("sim:2,timing=0")).timing is False
    assert sim_settings(parse_devices("sim:2,krate=trsm:0.35/trmm:0.9")).krate == (("trsm", 0.35), ("trmm", 0.9))


def test_krate_names_every_sim_kernel():
    assert set(SIM_KERNELS) == set(sim_mod.KERNELS)


def test_kernel_rate_factors():
    model = SimModel(rate=4e9, dilate=2.0, krate=(("trsm", 0.25), ("trmm", 0.5)))
    assert model.kernel_time(4e9) == 2.0  # gemm (and any kernel not named) at rate
    assert model.kernel_time(4e9, "syrk") == 2.0
    assert model.kernel_time(4e9, "trmm") == 4.0
    assert model.kernel_time(4e9, "trsm") == 8.0
    devs = build_sim_devices(parse_devices("sim:2,slow=3,krate=trsm:0.25"), streams=1)
    assert [d.model.krate for d in devs] == [(("trsm", 0.25),)] * 2
    assert devs[1].model.kernel_time(4e9, "trsm") == 12.0  # slow applies on top


@pytest.mark.serial  # wall-clock bounds: run alone (make test's second pass)
def test_timing_mode_kernels_take_their_own_rate(no_numpy_kernels):
    # One 32 x 32 TRMM tile (32^3 flops, one trmm step): at rate 1e6 it lasts 32.8 ms; krate=trmm:0.25 x4.
    tile, rate = 32, 1e6
    busy = {}
    for extra in ("", ",krate=trmm:0.25"):
        devs = build_sim_devices(parse_devices(f"sim:1,timing=1,rate={rate:g},h2d=1e12,d2h=1e12{extra}"),
                                 streams=1)
        eng = Engine(EngineConfig(devices=devs, streams=1, knobs=Knobs()))
        dt = np.dtype(np.float64)
        ops = [Operand(None, tile, tile, tile, (i + 1) << 40, -1, (next(_bases), tile, tile, tile, dt.str, tile))
               for i in range(3)]
        stats = CallStats([DeviceInfo(d.index, d.name, d.kind) for d in devs])
        call = Call("trmm", ops, plan_trmm(tile, tile, tile, 0, 0, OP_N, 0), dt, 1.0, 0.0, stats)
        try:
            eng.start()
            eng.submit(call)
        finally:
            eng.shutdown()
        assert call.error is None
        busy[extra] = stats.profile().breakdown()[0].busy
    bound = tile ** 3 / rate
    assert bound <= busy[""] <= 1.3 * bound, busy
    assert 4 * bound <= busy[",krate=trmm:0.25"] <= 1.3 * 4 * bound, busy


@pytest.mark.parametrize("text,option,allowed", [
    ("sim:2,timing=yes", "timing", "0 or 1"),
    ("sim:2,data=2", "data", "0 or 1"),
    ("sim:2,mem=12X", "mem", "a byte count >= 65536"),
    ("sim:2,mem=1K", "mem", "a byte count >= 65536"),
    ("sim:2,mem=100000.5", "mem", "a byte count"),
    ("sim:2,dilate=0", "dilate", "a number from 1e-06 to 1e+06"),
    ("sim:2,dilate=abc", "dilate", "a number from 1e-06 to 1e+06"),
    ("sim:2,dilate=1e300", "dilate", "a number from 1e-06 to 1e+06"),
    ("sim:2,slow=1e300", "slow", "a number from 1e-06 to 1e+06"),
    ("sim:2,speeds=1/1e-300", "speeds", "factors joined by '/', each a number from 1e-06 to 1e+06"),
    ("sim:2,rate=1e-300", "rate", "a finite rate >= 1 (per second)"),
    ("sim:2,h2d=0.5", "h2d", "a finite rate >= 1 (per second)"),
    ("sim:2,issue=-1e-5", "issue", "seconds"),
    ("sim:2,host=0", "host", "a bandwidth in bytes/s >= 1"),
    ("sim:2,host=1e-300", "host", "a bandwidth in bytes/s >= 1"),
    ("sim:2,host=fast", "host", "a bandwidth in bytes/s >= 1"),
    ("sim:2,host=1G,hostgroup=0", "hostgroup", "an int >= 1"),
    ("sim:2,host=1G,hostduplex=2", "hostduplex", "0 or 1"),
    ("sim:2,krate=trsm", "krate", "KERNEL:FACTOR pairs"),
    ("sim:2,krate=trsm:0", "krate", "KERNEL:FACTOR pairs"),
    ("sim:2,krate=gemm:1e-300", "krate", "KERNEL:FACTOR pairs joined by '/', each kernel once, factors 1e-06 to 1e+06"),
    ("sim:2,krate=trsm:x", "krate", "KERNEL:FACTOR pairs"),
    ("sim:2,krate=potrf:0.5", "krate", "KERNEL:FACTOR pairs"),
    ("sim:2,krate=trsm:0.3/trsm:0.4", "krate", "KERNEL:FACTOR pairs joined by '/', each kernel once"),
])
def test_bad_option_values_name_option_value_and_what_is_allowed(text, option, allowed):
    with pytest.raises(ValueError) as info:
        parse_devices(text)
    msg = str(info.value)
    value = text.rpartition(f"{option}=")[2].partition(",")[0]
    assert msg.startswith("devices:") and repr(option) in msg and repr(value) in msg, msg
    assert "allowed: " + allowed in msg and repr(text) in msg, msg


@pytest.mark.parametrize("text,needle", [
    ("sim:2,timing=1,data=1", r"timing=1 and data=1 contradict"),
    ("sim:2,hostgroup=2", r"hostgroup=2 .* needs host="),
    ("sim:2,hostduplex=1", r"hostduplex=1 .* needs host="),
    ("sim:2,speed=3", r"unknown sim option 'speed'.*allowed: .*timing, data, mem, dilate"),
])
def test_bad_option_combinations(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_devices(text)


def test_cache_bytes_and_mem_conflict():
    spec = parse_devices("sim:2,timing=1,mem=1Mi")
    assert build_sim_devices(spec, streams=1, cache_bytes=1 << 20)[0].cache_bytes == 1 << 20
    with pytest.raises(ValueError, match=r"^cache_bytes: got 2097152, but the device spec sets mem=1Mi"):
        build_sim_devices(spec, streams=1, cache_bytes=2 << 20)


@pytest.mark.parametrize("text", ["sim", "sim:3", "sim:2,slow=4", "sim:3,speeds=1/1/4", "sim:2,fail=1@5",
                                  "sim:2,peers=0,rate=1e9,h2d=2e9,d2h=3e9,p2p=4e9"])
def test_builder_makes_the_devices_the_session_makes(text):
    """build_sim_devices gives what blasx.session builds from the options it knows (so the session
    may call it and gain the timing options)."""
    from blasx import session

    spec = parse_devices(text)
    settings = session.Settings(devices=text, streams=3, trace=False)
    want = session._make_devices(spec, settings)
    got = build_sim_devices(spec, streams=3, trace=False)
    key = lambda d: (d.index, d.name, d.nstreams, d.cache_bytes, d.model, d.fail_at, d.peers, d.trace)  # noqa: E731
    assert [key(d) for d in got] == [key(d) for d in want]


def test_the_engine_hands_its_knobs_to_every_device():
    """Kernels read their switches (Knobs.trsm_inverse) from the device, set by the engine."""
    devs = build_sim_devices(parse_devices("sim:2"), streams=1)
    knobs = Knobs(trsm_inverse=False)
    Engine(EngineConfig(devices=devs, streams=1, knobs=knobs))
    assert all(d.knobs is knobs for d in devs)


@pytest.mark.parametrize("settings, n, message", [
    # a tile cache beyond host memory names the parameter
    ({"devices": "sim:2", "cache_bytes": 2 ** 60}, 8,
     r"tile cache \(configure's cache_bytes, or the sim's mem=\) does not fit in host memory"),
    # each option within its range, together a kernel of 1.7e10 s: named, not an overflowing sleep
    ({"devices": "sim:1,timing=1,rate=1,mem=1G", "tile": 2048}, 2048,
     r"one kernel of 1.72e\+10 flops would take 1.72e\+10 s, past the longest simulated operation \(3600 s\)"),
])
def test_sims_that_cannot_run_fail_at_the_first_call_saying_why(settings, n, message):
    import blasx
    from blasx.runtime.devices.base import DeviceError
    blasx.configure(**settings)
    try:
        with pytest.raises(DeviceError, match=message):
            blasx.gemm(1.0, np.ones((n, n)), np.ones((n, n)))
    finally:
        blasx.configure(devices="sim:2")
    assert blasx.gemm(1.0, np.ones((8, 8)), np.ones((8, 8)))[0, 0] == 8


def test_warnings_as_errors_do_not_break_a_sim_on_a_calls_inf():
    """A sim's stream threads ignore floating-point warnings, as a GPU signals none: a caller's warning filter
    (-W error, applied in every thread) turning inf - inf into an exception there broke the device."""
    import warnings
    import blasx
    blasx.configure(devices="sim:2", tile=16)
    a = np.ones((32, 32))
    a[3] = np.inf
    a[4, ::2], a[4, 1::2] = np.inf, -np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = blasx.gemm(1.0, a, np.ones((32, 32)))
    assert np.isnan(c[4]).all() and np.isinf(c[3]).all() and not blasx.engine().failures
