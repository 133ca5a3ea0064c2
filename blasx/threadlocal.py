"""A thread-local setting changed for a block of code."""

from __future__ import annotations

import contextlib
import threading

_MISSING = object()


@contextlib.contextmanager
def setting(local: threading.local, name: str, value):
    """``local.<name> = value`` inside the block, in this thread only; its previous value (or its absence)
    after, however the block ends. Yields ``value``."""
    before = getattr(local, name, _MISSING)
    setattr(local, name, value)
    try:
        yield value
    finally:
        if before is _MISSING:
            delattr(local, name)
        else:
            setattr(local, name, before)
