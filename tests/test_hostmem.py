"""The registration cache's bookkeeping that runs without CUDA: chunking, the registration
order, the splitting of tile copies at region boundaries, waiting for chunks, release."""

import itertools
import threading
import time

import numpy as np
import pytest

from blasx.runtime.hostmem import (PAGE, Pinning, RegistrationCache, root_of, chunk_spans, interior_pages,
                                   round_robin, split_2d)



def registered(reg) -> int:
    """Bytes blasx has page-locked through ``reg`` (its registrations that succeeded)."""
    return sum(p.pinned_bytes for p in reg._ours.values())

def test_root_follows_views_to_the_owner():
    a = np.zeros((8, 8))
    assert root_of(a[2:, ::2].T) is a and root_of(a) is a


def test_interior_pages_never_reach_a_neighbour():
    # an array that starts and ends inside pages: only its whole pages are registered
    assert interior_pages(PAGE + 16, 10 * PAGE) == (2 * PAGE, 11 * PAGE)
    assert interior_pages(4 * PAGE, 3 * PAGE) == (4 * PAGE, 7 * PAGE)  # aligned: all of it
    start, end = interior_pages(123, 5 * PAGE)
    assert start >= 123 and end <= 123 + 5 * PAGE and start % PAGE == 0 == end % PAGE


def test_chunks_cover_the_interior_page_aligned():
    assert chunk_spans(2 * PAGE, 11 * PAGE, 4 * PAGE) == [(2 * PAGE, 6 * PAGE), (6 * PAGE, 10 * PAGE),
                                                          (10 * PAGE, 11 * PAGE)]
    assert chunk_spans(0, 3 * PAGE, PAGE + 5) == [(0, PAGE), (PAGE, 2 * PAGE), (2 * PAGE, 3 * PAGE)]
    assert chunk_spans(5 * PAGE, 5 * PAGE) == []


def test_round_robin_interleaves_in_order():
    assert round_robin([[1, 2, 3], ["a"], [10, 20]]) == [1, "a", 10, 2, 20, 3]
    assert round_robin([]) == []


def _covered(pieces, ptr, pitch):
    """Every byte each piece copies, as absolute addresses."""
    out = []
    for c0, n, b0, b1 in pieces:
        for c in range(c0, c0 + n):
            out += range(ptr + c * pitch + b0, ptr + c * pitch + b1)
    return out


@pytest.mark.parametrize("width,pitch,cols", [(4, 4, 5), (3, 7, 4), (5, 9, 1), (8, 8, 3)])
def test_split_2d_copies_every_byte_once_and_no_piece_spans_a_cut(width, pitch, cols):
    ptr = 1000
    want = _covered([(0, cols, 0, width)], ptr, pitch)
    extent = range(ptr - 2, ptr + (cols - 1) * pitch + width + 2)
    for ncuts in (0, 1, 2, 3):
        for cuts in itertools.combinations(extent, ncuts):
            pieces = split_2d(ptr, pitch, width, cols, cuts)
            assert sorted(_covered(pieces, ptr, pitch)) == want, cuts
            for c0, n, b0, b1 in pieces:
                first, last = ptr + c0 * pitch + b0, ptr + (c0 + n - 1) * pitch + b1  # last: one past
                assert 0 < b1 - b0 and n >= 1
                assert not any(first < x < last for x in cuts), (cuts, (c0, n, b0, b1))


def test_split_2d_exact_pieces():
    # 4 columns of 10 bytes, pitch 16, at 0: a cut inside column 1, one in the gap after column 2
    assert split_2d(0, 16, 10, 4, [20, 44]) == [(0, 1, 0, 10), (1, 1, 0, 4), (1, 1, 4, 10), (2, 1, 0, 10),
                                               (3, 1, 0, 10)]
    assert split_2d(0, 16, 10, 4, []) == [(0, 4, 0, 10)]
    assert split_2d(0, 16, 10, 4, [32]) == [(0, 2, 0, 10), (2, 2, 0, 10)]  # at a column's first byte


def test_pieces_wait_for_the_chunks_they_touch_only():
    p = Pinning(0, 10 * PAGE, [(PAGE, 4 * PAGE), (4 * PAGE, 7 * PAGE), (7 * PAGE, 9 * PAGE)])
    assert p.cuts == [PAGE, 4 * PAGE, 7 * PAGE, 9 * PAGE]
    p.ok[0] = True
    p.ready[0].set()
    # inside chunk 0: no wait, one piece
    assert p.pieces(PAGE, PAGE, PAGE // 2, 3) == [(0, 3, 0, PAGE // 2)]
    # across chunks 0 and 1: blocks until chunk 1 is ready, then two pieces
    got = []
    t = threading.Thread(target=lambda: got.append(p.pieces(2 * PAGE, PAGE, PAGE, 4)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got
    p.ready[1].set()
    t.join(5)
    assert got == [[(0, 2, 0, PAGE), (2, 2, 0, PAGE)]]
    assert p.pinned_bytes == 3 * PAGE


def test_foreign_memory_is_one_ready_region():
    p = Pinning.whole(100, 100 + 5 * PAGE)
    assert p.cuts == [] and p.pieces(100, 64, 32, 10) == [(0, 10, 0, 32)]


def test_describe_names_the_range_and_overlapping_registrations():
    reg = RegistrationCache()
    p = reg._ours[1] = Pinning(0x10000, 0x50000, [(0x10000, 0x14000), (0x40000, 0x41000)])
    p.ok[0] = True
    text = reg.describe(0x12000, 0x20000)
    assert "[0x12000, 0x20000)" in text and "[0x10000, 0x14000)" in text and "0x40000" not in text
    assert "pinned" in text  # the first/last byte state, or why it is unknown here
    assert "overlapping: none" in reg.describe(0x20000, 0x30000)
    assert "(failed)" in reg.describe(0x40000, 0x40010)


def test_release_forgets_only_blasx_registrations_of_that_root():
    reg = RegistrationCache()
    a, b = np.ones((64, 64)), np.ones((64, 64))
    p = reg._ours[id(a)] = Pinning(a.ctypes.data, a.ctypes.data + a.nbytes, [(a.ctypes.data, a.ctypes.data + a.nbytes)])
    p.ok[0] = True
    p.ready[0].set()
    assert reg.release(a[3:, ::2]) is True  # a view releases its root
    assert id(a) not in reg._ours
    assert reg.release(a) is False and reg.release(b) is False  # nothing (left) to release


def test_pin_registers_the_operands_chunks_round_robin(fake_cuda, monkeypatch):
    from blasx.runtime import hostmem
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "PIN_THREADS", 1)  # one thread: the registrations in exactly the call's order
    rt = fake_cuda()
    reg = RegistrationCache()
    a, b, c = (np.ones((1 << 14,)) for _ in range(3))  # 128 KiB each: 1-2 interior chunks
    small = np.ones(16)
    pinnings, job = reg.pin([a, b, small, c])
    job.join()
    assert pinnings[2] is None  # too small: pageable
    chunks = [p.chunks for p in (pinnings[0], pinnings[1], pinnings[3])]
    want = round_robin(chunks)
    assert [(s, n) for s, n in rt.registered] == [(s, e - s) for s, e in want]
    assert all(all(p.ok) for p in (pinnings[0], pinnings[1], pinnings[3]))
    assert registered(reg) == sum(e - s for s, e in want) == job.pinned_bytes and job.seconds >= 0
    # a second call finds everything registered: no job, the same Pinning objects
    again, job2 = reg.pin([b, a[10:]])
    assert job2 is None and again[0] is pinnings[1] and again[1] is pinnings[0]
    assert reg.release(a) and [x for x in rt.unregistered] == [s for s, _ in chunks[0]]


def test_outputs_chunks_are_registered_after_the_inputs(fake_cuda, monkeypatch):
    from blasx.runtime import hostmem
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "PIN_THREADS", 1)
    rt = fake_cuda()
    reg = RegistrationCache()
    a, b, c = (np.ones((1 << 15,)) for _ in range(3))
    (pa, pb, pc), job = reg.pin([a, b, c], late=lambda: {2})
    job.join()
    want = round_robin([pa.chunks, pb.chunks]) + pc.chunks
    assert [s for s, _ in rt.registered] == [s for s, _ in want]

    def never():
        raise AssertionError("worked out with nothing to register")
    assert reg.pin([a, b, c], late=never)[1] is None  # all registered already: no job, no ordering
    d = np.ones((1 << 15,))
    (p1, p2), job = reg.pin([d, d[1:]], late={1})  # an output sharing an input's root registers with the input
    job.join()
    assert p1 is p2 and [s for s, _ in rt.registered[len(want):]] == [s for s, _ in p1.chunks]
    reg.release(d)
    for x in (a, b, c):
        reg.release(x)


def test_a_calls_written_only_operands():
    """C is written only by GEMM (slot 2), SYRK (slot 1) and TRMM (slot 2; in place slot 2 is B, which slot 1 reads:
    the same root, whose chunks the first operand claims, so B registers early); TRSM's steps read the tiles it has
    solved, so its C is an input too."""
    import types
    from blasx.runtime.call import Call
    from blasx.runtime.plans import plan_gemm, plan_syrk, plan_trmm, plan_trsm

    def written(tasks):
        return Call.written_only(types.SimpleNamespace(tasks=tasks))
    assert written(plan_gemm(300, 200, 500, 128, 0, 0, beta_zero=False)) == {2}
    assert written(plan_syrk(300, 200, 128, 0, 0)) == {1}
    assert written(plan_trmm(300, 200, 128, 0, 0, 0, 0)) == written(plan_trmm(300, 200, 128, 0, 0, 0, 0, in_place=True)) == {2}
    assert written(plan_trsm(300, 200, 128, 0, 0, 0, 0)) == written(plan_trsm(300, 200, 128, 0, 0, 0, 0, inverse=True)) == set()
    assert written([]) == frozenset()
    # every slot written at all (never staged): TRSM's in-place B too
    slots = lambda tasks: Call.written_slots(types.SimpleNamespace(tasks=tasks))  # noqa: E731
    assert slots(plan_trsm(300, 200, 128, 0, 0, 0, 0)) == {2} and slots(plan_gemm(300, 200, 500, 128, 0, 0)) == {2}
    assert slots(plan_syrk(300, 200, 128, 0, 0)) == {1}


def test_several_threads_register_each_chunk_once_taking_them_in_order(fake_cuda, monkeypatch):
    from blasx.runtime import hostmem
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "PIN_THREADS", 3)
    rt = fake_cuda()
    started, busy, most = [], [0], [0]
    lock = threading.Lock()
    plain = rt.hostRegister

    def slow(start, size, flags):  # a registration that takes a while, as the driver's does
        with lock:
            started.append(start)
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        time.sleep(0.02)
        plain(start, size, flags)
        with lock:
            busy[0] -= 1
    rt.hostRegister = slow
    reg = RegistrationCache()
    arrays = [np.ones((1 << 15,)) for _ in range(3)]  # 256 KiB each: 3-4 interior chunks
    pinnings, job = reg.pin(arrays)
    assert not job.done  # each registration takes 20 ms
    time.sleep(0.5)  # the call runs on; its job's time is the registering, not the wait for the join
    assert job.done
    job.join()
    want = round_robin([p.chunks for p in pinnings])
    assert job.threads == 3 and most[0] > 1  # the registrations overlapped
    assert 0 < job.seconds < 0.4
    assert sorted(rt.registered) == sorted((s, e - s) for s, e in want)  # each chunk once
    assert started[:3] == [s for s, _ in want[:3]] and set(started) == {s for s, _ in want}
    assert all(all(p.ok) and all(ev.is_set() for ev in p.ready) for p in pinnings)
    assert job.pinned_bytes == sum(e - s for s, e in want)
    for a in arrays:
        reg.release(a)


def test_a_pin_thread_dying_leaves_the_untaken_chunks_pageable(fake_cuda, monkeypatch):
    """An unexpected error outside a registration: the chunks no thread took are released to the copies as
    pageable (their events set), so no copy waits for them."""
    from blasx.runtime import hostmem
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "PIN_THREADS", 1)
    fake_cuda()
    reg = RegistrationCache()
    a = np.ones((1 << 15,))
    calls = []

    def broken(p, i):
        calls.append(i)
        if len(calls) == 2:
            raise MemoryError("a thread's own failure, not the driver's")
        p.ok[i] = True
        p.ready[i].set()
    monkeypatch.setattr(reg, "register_chunk", broken)
    threading.excepthook, old = (lambda args: None), threading.excepthook
    try:
        (p,), job = reg.pin([a])
        job.join()
    finally:
        threading.excepthook = old
    assert calls == [0, 1] and p.ok[0] and not any(p.ok[2:])
    assert all(ev.is_set() for i, ev in enumerate(p.ready) if i != 1)  # chunk 1 was the failing call's own


def test_a_cancelled_job_ends_after_its_chunk_and_leaves_the_rest_claimable(fake_cuda, monkeypatch):
    """A failed or interrupted call cancels its job: the thread ends after the chunk it is registering; the
    chunks nobody took are released to the copies as pageable and claimable again, so the next call on the array
    registers them."""
    from blasx.runtime import hostmem
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "PIN_THREADS", 1)
    rt = fake_cuda()
    reg = RegistrationCache()
    a = np.ones((1 << 16,))
    inside, go = threading.Event(), threading.Event()
    real = reg.register_chunk

    def slow(p, i):
        inside.set()
        go.wait(10)
        real(p, i)
    monkeypatch.setattr(reg, "register_chunk", slow)
    (p,), job = reg.pin([a])
    assert inside.wait(10) and len(p.chunks) > 2
    job.cancel()
    go.set()
    job.join()
    assert p.ok[0] and not any(p.ok[1:]) and all(ev.is_set() for ev in p.ready)
    assert p.claimed == [True] + [False] * (len(p.chunks) - 1) and len(rt.registered) == 1
    monkeypatch.setattr(reg, "register_chunk", real)
    (again,), job2 = reg.pin([a])
    job2.join()
    assert again is p and all(p.ok) and len(rt.registered) == len(p.chunks)


def test_a_ctrl_c_while_joining_cancels_the_job_and_still_waits_for_it(fake_cuda, monkeypatch):
    """Ctrl-C in the call's join: the job is cancelled, every thread is waited for (no registration outlives the
    call), then the interrupt is raised."""
    from blasx.runtime import hostmem
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "PIN_THREADS", 1)
    fake_cuda()
    reg = RegistrationCache()
    (p,), job = reg.pin([np.ones((1 << 16,))])
    (thread,) = job._threads
    real_join, joins = thread.join, []

    def interrupted_once():
        joins.append(1)
        if len(joins) == 1:
            raise KeyboardInterrupt
        real_join()
    monkeypatch.setattr(thread, "join", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        job.join()
    assert len(joins) == 2 and job.done and job._cancelled and all(ev.is_set() for ev in p.ready)


def test_a_failed_chunk_is_copied_as_pageable_memory(fake_cuda, monkeypatch):
    from blasx.runtime import hostmem
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 1 << 16)
    a = np.ones((1 << 15,))  # 256 KiB
    start, end = interior_pages(a.ctypes.data, a.nbytes)
    rt = fake_cuda(fail_at=start + (1 << 16))
    reg = RegistrationCache()
    (p,), job = reg.pin([a])
    job.join()
    assert p.ok[0] and not p.ok[1] and all(ev.is_set() for ev in p.ready)
    assert registered(reg) == p.pinned_bytes == end - start - (1 << 16)
    # the cuts still separate the failed chunk from its registered neighbours
    assert start + (1 << 16) in p.cuts and start + (2 << 16) in p.cuts
    reg.release(a)
    assert start + (1 << 16) not in rt.unregistered and start in rt.unregistered


def test_a_chunk_never_registered_fails_the_wait_instead_of_hanging(monkeypatch):
    from blasx.runtime import hostmem
    monkeypatch.setattr(hostmem, "WAIT_SECONDS", 0.05)
    p = Pinning(0, 4 * PAGE, [(0, 2 * PAGE), (2 * PAGE, 4 * PAGE)])
    p.ready[0].set()
    assert p.pieces(0, PAGE, PAGE, 2) == [(0, 2, 0, PAGE)]
    with pytest.raises(TimeoutError, match=r"\[0x2000, 0x4000\) were not page-locked within 0.05 s"):
        p.pieces(0, PAGE, PAGE, 3)


def test_a_root_freed_inside_the_cache_lock_unregisters_without_hanging(fake_cuda, monkeypatch):
    """A root's finalizer runs wherever the garbage collector frees the root; on 2x H200 that was
    inside ``_pinning``'s critical section of the same thread (a GC pass while making the next
    call's Pinning), and with a non-reentrant lock the call hung forever."""
    import gc

    from blasx.runtime import hostmem
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 1 << 16)
    rt = fake_cuda()
    reg = RegistrationCache()
    a = np.ones((1 << 15,))
    a_cycle = [a]
    a_cycle.append(a_cycle)  # only the cyclic collector frees it: at any allocation, in any frame
    (p,), job = reg.pin([a])
    job.join()
    start = p.chunks[0][0]
    del a, p
    done = threading.Event()

    def free_inside_the_lock():
        with reg._lock:  # as _pinning holds it when the collector runs
            a_cycle.clear()
            gc.collect()
        done.set()
    t = threading.Thread(target=free_inside_the_lock, daemon=True)  # a deadlocked one must not block exit
    t.start()
    t.join(10)
    assert done.is_set(), "the finalizer deadlocked on the registration cache's lock"
    assert start in rt.unregistered and registered(reg) == 0


def test_an_interrupted_pin_leaves_no_chunk_claimed(fake_cuda, monkeypatch):
    """Ctrl-C while a call makes a later operand's staging buffer, after it claimed an earlier operand's chunks:
    those chunks are claimable again, so the next call registers them (they would otherwise wait for a job that
    never ran, each copy stalling WAIT_SECONDS and failing)."""
    from blasx.runtime import hostmem
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 1 << 16)
    rt = fake_cuda()
    reg = RegistrationCache()
    a, b = np.ones((1 << 15,)), np.ones((1 << 15,))
    reg._seen[id(a)] = a  # (seen before: pinned in place, its chunks claimed first)

    def interrupted(nbytes):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        reg.pin([a, b], readonly=(0, 1), buffer=interrupted)
    p = reg._ours[id(a)]
    assert not any(p.claimed) and p.owner == [None] * len(p.chunks) and not rt.registered
    (again, _), job = reg.pin([a, b])
    job.join()
    assert again is p and all(p.ok) and all(ev.is_set() for ev in p.ready)


def test_a_registered_root_cannot_move(fake_cuda, monkeypatch):
    """The registry's finalizer holds a weak reference to every root it pins, which numpy's ndarray.resize
    refuses: a root's memory never moves under its Pinning."""
    from blasx.runtime import hostmem
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 1 << 16)
    fake_cuda()
    reg = RegistrationCache()
    a = np.ones((1 << 15,))
    (p,), job = reg.pin([a])
    job.join()
    with pytest.raises(ValueError):
        a.resize((1 << 17,), refcheck=False)


def test_the_cuda_backend_pins_a_calls_output_after_its_inputs(monkeypatch):
    """CudaDevice.prepare_call (on the CPU stand-in for CuPy) hands the registration cache the host operands in slot
    order and, as ``late``, the host index of the operand the call only writes (device operands are not pinned)."""
    import types
    from bench import fake_cupy
    from blasx.runtime import hostmem
    from blasx.runtime.call import Call
    from blasx.runtime.devices.cuda import CudaDevice
    from blasx.runtime.knobs import Knobs
    from blasx.runtime.plans import plan_gemm
    seen, intos = [], []

    def pin(arrays, min_bytes=None, late=(), threads=None, readonly=(), buffer=None, on_demand=True, into=None):
        seen.append((arrays, late() if callable(late) else late, threads, readonly))
        intos.append(into)
        return [None] * len(arrays), None
    monkeypatch.setattr(hostmem.REGISTRY, "pin", pin)
    a, c = np.ones((8, 8)), np.ones((8, 8))

    def operand(x, device=-1):
        return types.SimpleNamespace(array=x, device=device, on_host=device < 0, pinning="unset")
    with fake_cupy.installed():
        ops = [operand(a), operand(None, device=0), operand(c)]  # B on a GPU: not pinned
        call = types.SimpleNamespace(operands=ops, tasks=plan_gemm(8, 8, 8, 4, 0, 0))
        call.written_only = lambda: Call.written_only(call)
        call.late_inputs = lambda: Call.late_inputs(call)
        call.written_slots = lambda: Call.written_slots(call)
        call.init_targets = lambda: Call.init_targets(call)
        CudaDevice.prepare_call(types.SimpleNamespace(knobs=Knobs()), call)
        CudaDevice.prepare_call(types.SimpleNamespace(knobs=Knobs(pin_threads=8)), call)  # BLASX_KNOBS=pin_threads=8
        CudaDevice.prepare_call(types.SimpleNamespace(knobs=Knobs(stage_inputs=False)), call)
    (arrays, late, threads, readonly), (_, _, eight, _), (_, _, _, none) = seen
    assert arrays[0] is a and arrays[1] is c and late == {1} and call.pin_job is None
    assert ops[0].pinning is None and ops[2].pinning is None and ops[1].pinning == "unset"
    assert threads is None and eight == 8  # the knob's 0: PIN_THREADS
    assert readonly == {0} and not none  # A may be staged, never C; stage_inputs=0: nothing
    assert intos == [{}, {}, {}]
    # a new result starting from the caller's c (slot 3): c's values are staged into the result (slot 2)
    c0 = np.ones((8, 8))
    with fake_cupy.installed():
        call.operands = ops + [operand(c0)]
        call.tasks = plan_gemm(8, 8, 8, 4, 0, 0, beta_zero=False, c_init=True)
        CudaDevice.prepare_call(types.SimpleNamespace(knobs=Knobs()), call)
        CudaDevice.prepare_call(types.SimpleNamespace(knobs=Knobs(stage_into_result=False)), call)
    assert seen[-2][3] == {0, 2} and seen[-2][1] == {2, 1}  # c0 read only, and late; C late
    assert intos[-2] == {2: c} and intos[-1] == {}


def test_a_chunk_a_copy_waits_for_is_taken_next(fake_cuda, monkeypatch):
    """On demand: while the job's one thread registers chunk 0, a copy waiting for chunk 5 makes chunk 5 the
    next one registered; the rest follow in order, each once. Off: strictly in order."""
    from blasx.runtime import hostmem
    monkeypatch.setattr(hostmem, "MIN_REGISTER_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 1 << 16)
    monkeypatch.setattr(hostmem, "PIN_THREADS", 1)
    for on_demand in (True, False):
        rt = fake_cuda()
        gate, started = threading.Event(), threading.Event()
        plain = rt.hostRegister

        def slow_first(start, size, flags, plain=plain, gate=gate, started=started, rt=rt):
            if not rt.registered:
                started.set()
                gate.wait(10)
            plain(start, size, flags)
        rt.hostRegister = slow_first
        reg = RegistrationCache()
        a = np.ones((1 << 17,))  # 1 MiB: 16 chunks of 64 KiB (15 whole ones inside its pages at least)
        (p,), job = reg.pin([a], on_demand=on_demand)
        assert started.wait(10)
        s5, e5 = p.chunks[5]
        waiter = threading.Thread(target=p.wait, args=(s5, e5))
        waiter.start()
        time.sleep(0.05)  # the waiter has asked for chunk 5
        gate.set()
        waiter.join(10)
        job.join()
        order = [p.chunks.index((s, s + n)) for s, n in rt.registered]
        rest = [i for i in range(len(p.chunks)) if i not in (0, 5)]
        assert order == ([0, 5] + rest if on_demand else list(range(len(p.chunks))))
        assert all(p.ok) and p.owner == [None] * len(p.chunks)  # a finished job is no pinning's
        reg.release(a)
