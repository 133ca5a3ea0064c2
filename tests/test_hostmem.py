"""The registration cache's bookkeeping that runs without CUDA."""

import numpy as np

from blasx.runtime.hostmem import PAGE, RegistrationCache, _root, interior_pages, straddles


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


def test_interior_pages_never_reach_a_neighbour():
    # an array that starts and ends inside pages: only its whole pages are registered
    assert interior_pages(PAGE + 16, 10 * PAGE) == (2 * PAGE, 11 * PAGE)
    assert interior_pages(4 * PAGE, 3 * PAGE) == (4 * PAGE, 7 * PAGE)  # aligned: all of it
    start, end = interior_pages(123, 5 * PAGE)
    assert start >= 123 and end <= 123 + 5 * PAGE and start % PAGE == 0 == end % PAGE


def test_straddles_only_ranges_cut_by_the_span_edges():
    span = (2 * PAGE, 11 * PAGE)
    assert not straddles(None, 0, 10)  # pageable operand: nothing pinned
    assert not straddles(span, 3 * PAGE, 5 * PAGE)  # inside: pinned copy
    assert not straddles(span, PAGE + 16, 2 * PAGE)  # the partial head page alone: pageable copy
    assert not straddles(span, 11 * PAGE, 11 * PAGE + 40)  # the partial tail page alone
    assert straddles(span, PAGE + 16, 3 * PAGE)  # the first tile: head page + pinned pages
    assert straddles(span, 10 * PAGE, 11 * PAGE + 40)  # the last tile
    assert straddles(span, PAGE, 12 * PAGE)  # the whole array


def test_release_forgets_only_blasx_registrations_of_that_root():
    reg = RegistrationCache()
    a, b = np.ones((64, 64)), np.ones((64, 64))
    reg._ours[id(a)] = (a.ctypes.data, a.nbytes)  # as ensure_pinned records it
    reg.registered_bytes = a.nbytes
    assert reg.release(a[3:, ::2]) is True  # a view releases its root
    assert not reg.is_ours(a) and reg.registered_bytes == 0
    assert reg.release(a) is False and reg.release(b) is False  # nothing (left) to release
