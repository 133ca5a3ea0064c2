"""bench.result_files' shared rules, by exact value."""

from __future__ import annotations

import math

from bench.result_files import PEER_WIDENING, beside_peer, finite


def test_a_peers_error_widens_a_tolerance_within_bounds():
    assert beside_peer(1e-4, None) == 1e-4
    assert beside_peer(1e-4, 1e-6) == 1e-4  # a better peer: the tolerance stands
    assert beside_peer(1e-4, 3e-4) == 6e-4  # twice a worse peer's rounding
    assert beside_peer(1e-4, 1.0) == PEER_WIDENING * 1e-4  # a broken peer widens no further
    assert beside_peer(1e-4, math.inf) == beside_peer(1e-4, math.nan) == 1e-4


def test_finite_gives_none_for_nan_and_inf():
    assert finite(1.5) == 1.5 and finite(math.nan) is None and finite(math.inf) is None and finite("x") is None
