"""Device heap: first-fit offset bookkeeping for one preallocated arena per
device (the BLASX heap of paper Sec. IV-E / Fig. 6).  See ``allocator``."""

from .allocator import HeapExhausted, OffsetHeap

__all__ = ["HeapExhausted", "OffsetHeap"]
