"""The registration cache's bookkeeping that runs without CUDA."""

import numpy as np

from blasx.runtime.hostmem import RegistrationCache, _root


def test_root_follows_views_to_the_owner():
    a = np.zeros((8, 8))
    assert _root(a[2:, ::2].T) is a and _root(a) is a


def test_describe_names_the_range_and_overlapping_registrations():
    reg = RegistrationCache()
    reg._ours[1] = (0x10000, 0x4000)  # as ensure_pinned records it
    reg._ours[2] = (0x40000, 0x1000)
    text = reg.describe(0x12000, 0x20000)
    assert "[0x12000, 0x20000)" in text and "[0x10000, 0x14000)" in text and "0x40000" not in text
    assert "pinned" in text  # the first/last byte state, or why it is unknown here
    assert "overlapping: none" in reg.describe(0x20000, 0x30000)
