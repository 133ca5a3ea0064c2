"""First-fit offset heap: the BLASX device-memory allocator (paper Sec. IV-E, Fig. 6).

A cudaMalloc/cudaFree per tile would dominate at scale (Fig. 5), so each device allocates one arena
and carves it with this heap of integer offsets (fuzzed on the CPU). Fig. 6's three lists: the
address-ordered meta-data list of ``_Block`` nodes (the block at offset 0 is the permanent head);
the empty list ``_free``, indexed by size class ``(size // alignment).bit_length()`` in sorted
``_buckets`` with a ``_nonempty`` bitmask, and the sorted ``_free_sizes``; the occupied ``_used``.
``alloc`` takes the lowest-address free block that fits and splits it, ``free`` coalesces, a request
that does not fit gets ``None`` (the cache evicts and retries); ``check()`` verifies the invariants.
One owner thread per heap: not thread-safe.
"""

from __future__ import annotations

import operator
from bisect import bisect_left, insort


class HeapExhausted(MemoryError):
    """For callers that must have memory and still got ``None`` (the heap itself never raises it)."""


class _Block:
    """One node of the meta-data list: a segment ``[off, off + size)``."""

    __slots__ = ("off", "size", "free", "prev", "next")

    def __init__(self, off: int, size: int, free: bool, prev: _Block | None, next: _Block | None):
        self.off = off
        self.size = size
        self.free = free
        self.prev = prev
        self.next = next


def _positive_int(name: str, value: object, allowed: str) -> int:
    """Return ``value`` as an int (numpy integers included; bool refused)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be {allowed}; got {value!r} (a bool)")
    try:
        ivalue = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be {allowed}; got {value!r} of type {type(value).__name__}") from None
    if ivalue <= 0:
        raise ValueError(f"{name} must be {allowed}; got {ivalue}")
    return ivalue


class OffsetHeap:
    """First-fit heap over the byte offsets ``[0, capacity)`` of one arena (one owner thread)."""

    __slots__ = ("_capacity", "_alignment", "_mask", "_shift", "_head", "_used", "_free", "_buckets", "_nonempty",
                 "_free_sizes", "_bytes_used")

    def __init__(self, capacity: int, alignment: int = 256):
        alignment = _positive_int("alignment", alignment, "a positive power of two")
        if alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two; got {alignment}")
        capacity = _positive_int("capacity", capacity, f"a positive multiple of alignment ({alignment})")
        if capacity % alignment:
            raise ValueError(f"capacity must be a positive multiple of alignment ({alignment}); "
                             f"got {capacity} (remainder {capacity % alignment})")
        self._capacity = capacity
        self._alignment = alignment
        self._mask = alignment - 1
        self._shift = alignment.bit_length() - 1
        self.reset()

    def reset(self) -> None:
        """Forget every allocation: one free block spanning the arena."""
        self._head = _Block(0, self._capacity, True, None, None)
        self._used: dict[int, _Block] = {}
        self._buckets: list[list[int]] = [[] for _ in range((self._capacity >> self._shift).bit_length() + 1)]
        self._nonempty = 0
        self._free: dict[int, _Block] = {}
        self._free_sizes: list[int] = []
        self._list(self._head)  # the whole arena, in the top class
        self._bytes_used = 0

    # ----------------------------------------------------------------- hot path

    def alloc(self, nbytes: int) -> int | None:
        """Reserve ``nbytes`` (rounded up) at the lowest address that fits: its offset, or None."""
        if nbytes.__class__ is not int or nbytes <= 0:
            nbytes = _positive_int("nbytes", nbytes, "a positive int (bytes to allocate)")
        size = (nbytes + self._mask) & ~self._mask
        if size > self.largest_free:
            return None  # fast refusal: larger than the largest hole
        buckets = self._buckets
        c = (size >> self._shift).bit_length()
        # Every block of a larger class fits: the candidate is the lowest head among those buckets.
        best = self._capacity
        m = self._nonempty >> (c + 1) << (c + 1)
        while m:
            low = m & -m
            best = min(best, buckets[low.bit_length() - 1][0])
            m ^= low
        # The request's own class may hold smaller blocks: walk it, below the candidate only.
        free = self._free
        for off in buckets[c]:
            if off >= best:
                break
            if free[off].size >= size:
                best = off
                break
        # A block was found: the largest free block fits (checked above).
        blk = free[best]
        self._unlist(blk)
        rest = blk.size - size
        if rest:  # the remainder stays free, right after
            tail = _Block(best + size, rest, True, blk, blk.next)
            if blk.next is not None:
                blk.next.prev = tail
            blk.next = tail
            blk.size = size
            self._list(tail)
        blk.free = False
        self._used[best] = blk
        self._bytes_used += size
        return best

    def free(self, offset: int) -> None:
        """Release the allocation at ``offset``, coalescing; ValueError if it is not allocated."""
        key = _offset_key(offset)
        blk = None if key is None else self._used.pop(key, None)
        if blk is None:
            raise ValueError(self._why_not_allocated(offset))
        self._bytes_used -= blk.size
        right = blk.next
        if right is not None and right.free:  # absorb the right neighbour
            self._unlist(right)
            blk.size += right.size
            blk.next = right.next
            if right.next is not None:
                right.next.prev = blk
        left = blk.prev
        if left is not None and left.free:
            # Merge into the left neighbour, which keeps its offset (the head is never dropped).
            self._unlist(left)
            left.size += blk.size
            left.next = blk.next
            if blk.next is not None:
                blk.next.prev = left
            blk = left
        self._list(blk)

    def _list(self, blk: _Block) -> None:
        """Enter ``blk`` in the empty list: free, in the free map, the sorted sizes and its class's bucket."""
        blk.free = True
        self._free[blk.off] = blk
        insort(self._free_sizes, blk.size)
        k = (blk.size >> self._shift).bit_length()
        insort(self._buckets[k], blk.off)
        self._nonempty |= 1 << k

    def _unlist(self, blk: _Block) -> None:
        """Take the free ``blk`` out of the empty list: the free map, the sorted sizes, its class's bucket."""
        del self._free[blk.off]
        del self._free_sizes[bisect_left(self._free_sizes, blk.size)]
        k = (blk.size >> self._shift).bit_length()
        bucket = self._buckets[k]
        del bucket[bisect_left(bucket, blk.off)]
        if not bucket:
            self._nonempty &= ~(1 << k)

    # -------------------------------------------------------------- inspection

    def can_fit(self, nbytes: int) -> bool:
        """Whether ``alloc(nbytes)`` would succeed right now."""
        nbytes = _positive_int("nbytes", nbytes, "a positive int (bytes to allocate)")
        return (nbytes + self._mask) & ~self._mask <= self.largest_free

    def size_of(self, offset: int) -> int:
        """Rounded size of the allocation at ``offset`` (ValueError if none)."""
        key = _offset_key(offset)
        blk = None if key is None else self._used.get(key)
        if blk is None:
            raise ValueError(self._why_not_allocated(offset))
        return blk.size

    def is_allocated(self, offset: int) -> bool:
        """Whether an allocation starts at ``offset`` (an int; anything else names none)."""
        key = _offset_key(offset)
        return key is not None and key in self._used

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def bytes_used(self) -> int:
        return self._bytes_used

    @property
    def bytes_free(self) -> int:
        return self._capacity - self._bytes_used

    @property
    def largest_free(self) -> int:
        """The biggest request that can succeed now (0 when full)."""
        return self._free_sizes[-1] if self._free_sizes else 0

    @property
    def n_allocated(self) -> int:
        return len(self._used)

    def blocks(self) -> list[tuple[int, int, bool]]:
        """``(offset, size, is_free)`` of every block, in address order."""
        out, blk = [], self._head
        while blk is not None:
            out.append((blk.off, blk.size, blk.free))
            blk = blk.next
        return out

    def __repr__(self) -> str:
        return (f"OffsetHeap(capacity={self._capacity}, alignment={self._alignment}, used={self._bytes_used}, "
                f"allocations={len(self._used)}, free_blocks={len(self._free)}, largest_free={self.largest_free})")

    def _why_not_allocated(self, offset: object) -> str:
        """Explain why ``offset`` names no allocation (error path only)."""
        if isinstance(offset, bool) or not hasattr(offset, "__index__"):
            return (f"offset {offset!r} is not allocated: offsets are the ints that alloc() returned, "
                    f"got type {type(offset).__name__}")
        offset = operator.index(offset)
        if not 0 <= offset < self._capacity:
            return f"offset {offset} is not allocated: it lies outside the heap [0, {self._capacity})"
        blk = self._head
        while blk.off + blk.size <= offset:
            blk = blk.next
        if blk.free:
            return (f"offset {offset} is not allocated: it lies in free space (the free block at offset {blk.off}, "
                    f"size {blk.size}); double free, or never allocated")
        return (f"offset {offset} is not allocated: it lies inside the allocation at offset {blk.off} "
                f"(size {blk.size}); free() takes the offset alloc() returned")

    # --------------------------------------------------------------- invariants

    def check(self) -> None:
        """Verify every invariant; raise RuntimeError naming the first broken one."""

        def fail(what: str) -> None:
            raise RuntimeError(f"OffsetHeap invariant broken: {what}")

        align = self._alignment
        max_blocks = self._capacity // align
        head = self._head
        if head is None or head.off != 0 or head.prev is not None:
            fail("the block list must start with a head block at offset 0 with no prev")
        end = n = used_bytes = 0
        prev, blk = None, head
        free_seen: list[_Block] = []
        used_seen: list[_Block] = []
        while blk is not None:
            n += 1
            if n > max_blocks:
                fail(f"more than capacity/alignment = {max_blocks} blocks (cycle in next links?)")
            if blk.prev is not prev:
                fail(f"block at {blk.off}: prev link does not point at the preceding block")
            if blk.off != end:
                kind = "gap" if blk.off > end else "overlap"
                fail(f"blocks must tile the heap: {kind} at {end}, next block starts at {blk.off}")
            if blk.off % align or blk.size % align:
                fail(f"block ({blk.off}, {blk.size}) is not aligned to {align}")
            if blk.size <= 0:
                fail(f"block at {blk.off} has non-positive size {blk.size}")
            if blk.free:
                if prev is not None and prev.free:
                    fail(f"adjacent free blocks at {prev.off} and {blk.off} were not coalesced")
                free_seen.append(blk)
            else:
                used_seen.append(blk)
                used_bytes += blk.size
            end = blk.off + blk.size
            prev = blk
            blk = blk.next
        if end != self._capacity:
            fail(f"blocks end at {end}, not at capacity {self._capacity}")

        if len(self._used) != len(used_seen) or any(self._used.get(b.off) is not b for b in used_seen):
            fail("the occupied hash does not match the allocated blocks of the list")
        if len(self._free) != len(free_seen) or any(self._free.get(b.off) is not b for b in free_seen):
            fail("the free-block map does not match the free blocks of the list")
        shift = self._shift
        expect: list[list[int]] = [[] for _ in self._buckets]
        for b in free_seen:  # address order, so each expected bucket is sorted
            expect[(b.size >> shift).bit_length()].append(b.off)
        if self._buckets != expect:
            fail("the size-class buckets do not match the free blocks of the list")
        if self._nonempty != sum(1 << k for k, bk in enumerate(expect) if bk):
            fail("the non-empty-bucket bitmask does not match the buckets")
        if self._free_sizes != sorted(b.size for b in free_seen):
            fail("the sorted free-size list does not match the free blocks of the list")
        if self._bytes_used != used_bytes:
            fail(f"bytes_used is {self._bytes_used} but allocated blocks sum to {used_bytes}")


def _offset_key(offset):
    """``offset`` as the int that names an allocation, or None where it is no int (a float or bool equal to an
    offset, which the table's hashing would match, names none)."""
    if type(offset) is int:
        return offset
    if isinstance(offset, bool) or not hasattr(offset, "__index__"):
        return None
    return operator.index(offset)
