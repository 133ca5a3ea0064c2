"""CuPy's current stream, switched for a block and given back.

CuPy's ``with stream:`` makes the null stream current on exit when the stream current before it was
set by ``Stream.use()`` (CuPy 14), so work issued after such a block lands on the legacy null stream,
unordered with non-blocking streams. :func:`on_stream` restores whatever was current.
"""

from __future__ import annotations

from contextlib import contextmanager


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
