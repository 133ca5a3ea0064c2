"""blasx.threadlocal.setting: a thread-local value for a block, restored (or removed) however it ends."""

from __future__ import annotations

import threading

import pytest

from blasx.threadlocal import setting


def test_set_inside_restored_after_and_per_thread():
    local = threading.local()
    local.x = 1
    seen = []
    with setting(local, "x", 2) as v:
        assert v == 2 and local.x == 2
        t = threading.Thread(target=lambda: seen.append(getattr(local, "x", None)))
        t.start()
        t.join()
        with setting(local, "x", 3):
            assert local.x == 3
        assert local.x == 2
    assert local.x == 1 and seen == [None]


def test_absent_before_is_absent_after_even_on_error():
    local = threading.local()
    with pytest.raises(KeyboardInterrupt):
        with setting(local, "y", 5):
            raise KeyboardInterrupt
    assert not hasattr(local, "y")
