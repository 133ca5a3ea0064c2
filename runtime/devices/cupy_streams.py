"""CuPy's current stream, switched for a block and given back.

CuPy's ``with stream:`` makes the null stream current on exit when the stream current before it was
set by ``Stream.use()`` (CuPy 14), so work issued after such a block lands on the legacy null stream,
unordered with non-blocking streams. :func:`on_stream` restores whatever was current.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

# handles that name another stream in each thread: cudaStreamPerThread, and the default stream when CuPy runs
# with per-thread default streams
PER_THREAD = (2, 0) if os.environ.get("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", "0") == "1" else (2,)


def stream_key(ptr: int) -> tuple:
    """A stream handle as a cache key: (handle, the thread where the handle is another stream in each thread,
    else 0)."""
    return ptr, threading.get_ident() if ptr in PER_THREAD else 0


@contextmanager
def on_stream(stream, xp=None):
    """``stream`` current inside the block (on its device, which must be current); the stream that
    was current before it current again afterwards, however it was made current. ``xp``: the array
    module the stream is of (None: CuPy)."""
    if xp is None:
        import cupy as xp
    prev = xp.cuda.get_current_stream()
    if prev.ptr == stream.ptr:
        yield stream
        return
    stream.use()
    try:
        yield stream
    finally:
        prev.use()
