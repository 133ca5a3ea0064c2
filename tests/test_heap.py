"""Tests of the device heap (blasx.heap): exact values, errors, and a fuzz
against a reference model of first fit with full coalescing."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from blasx.heap import HeapExhausted, OffsetHeap

A = 256  # default alignment


def heap_with_holes(sizes_and_keep, capacity=64 * A, alignment=A):
    """Allocate the sizes in order, then free those marked False; return the
    heap and the offsets (in allocation order)."""
    h = OffsetHeap(capacity, alignment)
    offs = [h.alloc(n) for n, _ in sizes_and_keep]
    for off, (_, keep) in zip(offs, sizes_and_keep):
        if not keep:
            h.free(off)
    h.check()
    return h, offs


# ------------------------------------------------------------ construction


def test_fresh_heap_is_one_free_block():
    h = OffsetHeap(4096)
    assert h.blocks() == [(0, 4096, True)]
    assert (h.capacity, h.alignment) == (4096, 256)
    assert (h.bytes_used, h.bytes_free, h.largest_free, h.n_allocated) == (0, 4096, 4096, 0)
    h.check()


@pytest.mark.parametrize(
    "capacity, alignment, name, shown",
    [
        (0, 256, "capacity", "0"),
        (-512, 256, "capacity", "-512"),
        (1000, 256, "capacity", "1000"),
        (4096.0, 256, "capacity", "4096.0"),
        (True, 1, "capacity", "True"),
        (4096, 0, "alignment", "0"),
        (4096, -256, "alignment", "-256"),
        (4096, 3, "alignment", "3"),
        (4096, 96, "alignment", "96"),
        (4096, "256", "alignment", "'256'"),
    ],
)
def test_bad_construction(capacity, alignment, name, shown):
    with pytest.raises(ValueError) as exc:
        OffsetHeap(capacity, alignment)
    msg = str(exc.value)
    assert msg.startswith(name) and shown in msg
    assert ("power of two" if name == "alignment" else "multiple of alignment") in msg


def test_numpy_ints_accepted():
    h = OffsetHeap(np.int64(4096), np.int32(256))
    assert h.alloc(np.int64(300)) == 0
    assert h.size_of(0) == 512
    h.free(np.int64(0))
    assert h.blocks() == [(0, 4096, True)]


def test_a_float_or_bool_equal_to_an_offset_names_no_allocation():
    """0.0, False and np.float64(0) hash like 0, and True like 1: free() took them for those offsets."""
    h = OffsetHeap(4096, 1)
    assert h.alloc(1) == 0 and h.alloc(1) == 1
    for bad in (0.0, False, np.float64(0), True, 1.0):
        with pytest.raises(ValueError, match="offsets are the ints that alloc"):
            h.free(bad)
        with pytest.raises(ValueError, match="offsets are the ints that alloc"):
            h.size_of(bad)
        assert not h.is_allocated(bad)
    assert h.is_allocated(np.int64(1)) and h.size_of(0) == 1
    h.free(0)
    h.free(np.int32(1))
    assert h.blocks() == [(0, 4096, True)]


def test_heap_exhausted_is_a_memory_error():
    assert issubclass(HeapExhausted, MemoryError)


# ------------------------------------------------------------------ alloc


def test_alloc_sequence_rounds_and_splits():
    h = OffsetHeap(16 * A)
    assert h.alloc(1) == 0
    assert h.alloc(A) == A
    assert h.alloc(A + 1) == 2 * A
    assert h.alloc(3 * A - 1) == 4 * A
    assert [h.size_of(o) for o in (0, A, 2 * A, 4 * A)] == [A, A, 2 * A, 3 * A]
    assert h.blocks() == [
        (0, A, False),
        (A, A, False),
        (2 * A, 2 * A, False),
        (4 * A, 3 * A, False),
        (7 * A, 9 * A, True),  # the split remainder stays free
    ]
    assert (h.bytes_used, h.bytes_free, h.largest_free, h.n_allocated) == (7 * A, 9 * A, 9 * A, 4)
    h.check()


def test_rounding_uses_the_alignment():
    h = OffsetHeap(1 << 20, alignment=4096)
    assert h.alloc(1) == 0
    assert h.alloc(4097) == 4096
    assert h.alloc(4096) == 3 * 4096
    assert h.size_of(4096) == 8192
    h1 = OffsetHeap(8, alignment=1)
    assert [h1.alloc(3), h1.alloc(5), h1.alloc(1)] == [0, 3, None]


def test_exact_fit_leaves_no_remainder():
    h, (a, b, c) = heap_with_holes([(2 * A, True), (3 * A, False), (A, True)], capacity=6 * A)
    assert h.alloc(3 * A) == b
    assert h.blocks() == [(0, 2 * A, False), (2 * A, 3 * A, False), (5 * A, A, False)]
    assert h.largest_free == 0 and h.bytes_free == 0
    h.check()


def test_exhaustion_returns_none_not_raise():
    h = OffsetHeap(4 * A)
    assert h.alloc(4 * A) == 0
    assert h.alloc(1) is None
    assert not h.can_fit(1)
    h.free(0)
    assert h.alloc(4 * A + 1) is None  # larger than the whole arena
    assert h.alloc(10**18) is None
    assert h.can_fit(4 * A) and not h.can_fit(4 * A + 1)
    assert h.blocks() == [(0, 4 * A, True)]


def test_fragmented_free_space_that_does_not_fit():
    # 4 free bytes-units in total but no 2 contiguous: alloc must say None.
    h, _ = heap_with_holes([(A, k) for k in (False, True) * 4], capacity=8 * A)
    assert h.bytes_free == 4 * A and h.largest_free == A
    assert h.alloc(2 * A) is None
    assert not h.can_fit(A + 1) and h.can_fit(A)
    assert h.alloc(A) == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8", None, True, [256]])
def test_bad_nbytes(bad):
    h = OffsetHeap(4096)
    for call in (h.alloc, h.can_fit):
        with pytest.raises(ValueError) as exc:
            call(bad)
        msg = str(exc.value)
        assert msg.startswith("nbytes must be a positive int"), msg
        assert repr(bad) in msg, msg
    assert h.blocks() == [(0, 4096, True)]


# -------------------------------------------------------------- first fit


def test_first_fit_takes_lowest_address_hole():
    # holes: [A, 3A) size 2A, [4A, 8A) size 4A, tail [9A, 16A) size 7A
    h, offs = heap_with_holes(
        [(A, True), (2 * A, False), (A, True), (4 * A, False), (A, True)], capacity=16 * A
    )
    assert h.blocks()[1] == (A, 2 * A, True)
    assert h.alloc(A) == A  # first hole, although a later one is larger
    assert h.alloc(2 * A) == 4 * A  # the rest of hole 1 (A) is too small
    assert h.alloc(2 * A) == 6 * A
    assert h.alloc(A) == 2 * A  # back to the leftover of hole 1
    assert h.alloc(5 * A) == 9 * A
    h.check()


def test_first_fit_prefers_low_big_hole_over_later_exact_hole():
    # A large hole at a low address must win over a later exact-size hole.
    h, _ = heap_with_holes(
        [(A, True), (16 * A, False), (A, True), (3 * A, False), (A, True)], capacity=64 * A
    )
    assert h.alloc(3 * A) == A


def test_first_fit_skips_too_small_hole_of_the_same_size_class():
    # holes of 5A (too small) then 7A (fits) and a larger one later: 6A goes in 7A.
    h, _ = heap_with_holes(
        [(A, True), (5 * A, False), (A, True), (7 * A, False), (A, True), (32 * A, False)],
        capacity=64 * A,
    )
    assert h.alloc(6 * A) == 7 * A
    assert h.blocks()[3:5] == [(7 * A, 6 * A, False), (13 * A, A, True)]
    h.check()


# ------------------------------------------------------------- coalescing


def test_free_with_no_free_neighbour():
    h = OffsetHeap(4 * A)
    a, b, c = h.alloc(A), h.alloc(A), h.alloc(A)
    h.free(b)
    assert h.blocks() == [(0, A, False), (A, A, True), (2 * A, A, False), (3 * A, A, True)]
    h.check()


def test_coalesce_with_left():
    h = OffsetHeap(4 * A)
    a, b, c = h.alloc(A), h.alloc(A), h.alloc(A)
    h.free(a)
    h.free(b)
    assert h.blocks() == [(0, 2 * A, True), (2 * A, A, False), (3 * A, A, True)]
    h.check()


def test_coalesce_with_right():
    h = OffsetHeap(4 * A)
    a, b, c = h.alloc(A), h.alloc(A), h.alloc(A)
    h.free(b)
    h.free(a)
    assert h.blocks() == [(0, 2 * A, True), (2 * A, A, False), (3 * A, A, True)]
    h.check()


def test_coalesce_with_both():
    h = OffsetHeap(4 * A)
    a, b, c = h.alloc(A), h.alloc(A), h.alloc(A)
    h.free(a)
    h.free(c)  # merges with the free tail on its right
    assert h.blocks() == [(0, A, True), (A, A, False), (2 * A, 2 * A, True)]
    h.free(b)
    assert h.blocks() == [(0, 4 * A, True)]
    assert (h.bytes_used, h.largest_free, h.n_allocated) == (0, 4 * A, 0)
    h.check()


def test_coalesced_space_is_reusable_as_one_block():
    h = OffsetHeap(8 * A)
    offs = [h.alloc(A) for _ in range(8)]
    assert h.alloc(1) is None
    for o in offs[2:6]:
        h.free(o)
    assert h.largest_free == 4 * A
    assert h.alloc(4 * A) == 2 * A
    h.check()


# ----------------------------------------------------------------- errors


def test_double_free_is_an_error():
    h = OffsetHeap(4 * A)
    a = h.alloc(A)
    h.alloc(A)
    h.free(a)
    with pytest.raises(ValueError, match=rf"offset {a} is not allocated: it lies in free space.*double free"):
        h.free(a)
    h.check()


def test_double_free_after_coalescing_is_an_error():
    h = OffsetHeap(4 * A)
    a, b = h.alloc(A), h.alloc(A)
    h.free(a)
    h.free(b)  # b merges into a's block: b is no longer a block start
    with pytest.raises(ValueError, match=rf"offset {b} is not allocated: it lies in free space"):
        h.free(b)


@pytest.mark.parametrize(
    "offset, why",
    [
        (A + 16, rf"offset {A + 16} is not allocated: it lies inside the allocation at offset {A}"),
        (3 * A, rf"offset {3 * A} is not allocated: it lies in free space"),
        (-A, rf"offset {-A} is not allocated: it lies outside the heap \[0, {4 * A}\)"),
        (4 * A, rf"offset {4 * A} is not allocated: it lies outside the heap"),
        ("0", r"offset '0' is not allocated: offsets are the ints that alloc\(\) returned"),
        ([0], r"offset \[0\] is not allocated: offsets are the ints"),
        (None, r"offset None is not allocated"),
    ],
)
def test_free_of_something_never_allocated(offset, why):
    h = OffsetHeap(4 * A)
    h.alloc(A)
    h.alloc(2 * A)
    with pytest.raises(ValueError, match=why):
        h.free(offset)
    with pytest.raises(ValueError, match=why):
        h.size_of(offset)
    assert h.n_allocated == 2
    h.check()


def test_is_allocated_and_reset():
    h = OffsetHeap(4 * A)
    a = h.alloc(A)
    assert h.is_allocated(a) and not h.is_allocated(A)
    h.reset()
    assert not h.is_allocated(a)
    assert h.blocks() == [(0, 4 * A, True)] and h.bytes_used == 0
    assert h.alloc(4 * A) == 0
    h.check()


# ------------------------------------------------------------------ check()


def _corrupt_size(h):
    h._head.size += A


def _corrupt_merge(h):
    # Mark an allocated block free behind the heap's back.
    h._used[A].free = True


def _corrupt_used_hash(h):
    del h._used[0]


def _corrupt_buckets(h):
    h._buckets.reverse()


def _corrupt_bytes(h):
    h._bytes_used += 1


def _corrupt_prev(h):
    h._head.next.prev = None


@pytest.mark.parametrize(
    "corrupt, what",
    [
        (_corrupt_size, "overlap"),
        (_corrupt_merge, "adjacent free blocks"),
        (_corrupt_used_hash, "occupied hash"),
        (_corrupt_buckets, "size-class buckets"),
        (_corrupt_bytes, "bytes_used"),
        (_corrupt_prev, "prev link"),
    ],
)
def test_check_names_the_broken_invariant(corrupt, what):
    h = OffsetHeap(8 * A)
    h.alloc(A)
    h.alloc(A)
    b = h.alloc(A)
    h.alloc(A)
    h.free(b)
    h.check()
    corrupt(h)
    with pytest.raises(RuntimeError, match=f"invariant broken: .*{what}"):
        h.check()


# ------------------------------------------------------------------- model


class Model:
    """Reference: the allocations as a dict offset -> size.  With eager
    coalescing the free blocks are exactly the maximal gaps, so first fit is
    the lowest gap that is long enough."""

    def __init__(self, capacity: int, alignment: int):
        self.capacity = capacity
        self.alignment = alignment
        self.used: dict[int, int] = {}

    def blocks(self) -> list[tuple[int, int, bool]]:
        out, pos = [], 0
        for off in sorted(self.used):
            if off > pos:
                out.append((pos, off - pos, True))
            out.append((off, self.used[off], False))
            pos = off + self.used[off]
        if pos < self.capacity:
            out.append((pos, self.capacity - pos, True))
        return out

    def alloc(self, nbytes: int) -> int | None:
        size = -(-nbytes // self.alignment) * self.alignment
        for off, n, is_free in self.blocks():
            if is_free and n >= size:
                self.used[off] = size
                return off
        return None

    def free(self, off: int) -> None:
        del self.used[off]


def assert_matches(h: OffsetHeap, m: Model) -> None:
    h.check()
    blocks = h.blocks()
    assert blocks == m.blocks()
    used = [(o, n) for o, n, f in blocks if not f]
    for (o1, n1), (o2, _) in zip(used, used[1:]):
        assert o1 + n1 <= o2  # no overlap
    assert all(0 <= o and o + n <= h.capacity for o, n in used)
    free_sizes = [n for _, n, f in blocks if f]
    assert h.bytes_used == sum(m.used.values()) == h.capacity - sum(free_sizes)
    assert h.largest_free == max(free_sizes, default=0)
    assert h.n_allocated == len(m.used)


class HeapMachine(RuleBasedStateMachine):
    @initialize(
        log2_align=st.integers(0, 6),
        units=st.integers(1, 80),
    )
    def setup(self, log2_align, units):
        align = 1 << log2_align
        self.heap = OffsetHeap(units * align, align)
        self.model = Model(units * align, align)

    @rule(nbytes=st.integers(1, 100 * 64))
    def alloc_any(self, nbytes):
        self._alloc(nbytes)

    @rule(units=st.integers(1, 8), slack=st.integers(0, 63))
    def alloc_small(self, units, slack):
        # Sizes near multiples of the alignment: rounding edges, many blocks.
        a = self.heap.alignment
        self._alloc(max(1, (units - 1) * a + slack % a + 1))

    def _alloc(self, nbytes):
        expect = self.model.alloc(nbytes)
        assert self.heap.can_fit(nbytes) == (expect is not None)
        assert self.heap.alloc(nbytes) == expect

    @precondition(lambda self: self.model.used)
    @rule(data=st.data())
    def free(self, data):
        off = data.draw(st.sampled_from(sorted(self.model.used)))
        assert self.heap.size_of(off) == self.model.used[off]
        self.heap.free(off)
        self.model.free(off)

    @rule(off=st.integers(-2, 100 * 64))
    def free_unallocated(self, off):
        if off not in self.model.used:
            with pytest.raises(ValueError, match=f"offset {off} is not allocated"):
                self.heap.free(off)

    @invariant()
    def consistent(self):
        assert_matches(self.heap, self.model)

    def teardown(self):
        # Freeing everything must leave exactly one free block of full capacity.
        for off in list(self.model.used):
            self.heap.free(off)
            self.model.free(off)
        self.heap.check()
        assert self.heap.blocks() == [(0, self.heap.capacity, True)]


HeapMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHeapMachine = HeapMachine.TestCase


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    log2_align=st.sampled_from([0, 4, 8, 12]),
    units=st.integers(64, 4096),
)
def test_random_churn_matches_model(seed, log2_align, units):
    """Long churn on bigger heaps: many blocks and size classes (the bucket
    bookkeeping), with free chosen at random (scattered holes)."""
    rng = random.Random(seed)
    align = 1 << log2_align
    h, m = OffsetHeap(units * align, align), Model(units * align, align)
    tile_units = [rng.randint(1, max(1, units // 8)) for _ in range(4)]
    for step in range(300):
        if m.used and rng.random() < 0.45:
            off = rng.choice(list(m.used))
            h.free(off)
            m.free(off)
        else:
            n = rng.choice(tile_units) * align - rng.randrange(align)
            assert h.alloc(n) == m.alloc(n)
        if step % 25 == 0:
            assert_matches(h, m)
    assert_matches(h, m)
    for off in list(m.used):
        h.free(off)
    h.check()
    assert h.blocks() == [(0, units * align, True)]
