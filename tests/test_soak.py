"""The soak (``bench/soak.py``) for half a minute: random calls from 16 threads on the sim with device
faults and Ctrl-C injected; no wrong answer and no leak (``python -m bench.soak --minutes N`` runs longer)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_soak_half_a_minute(capsys):
    soak = pytest.importorskip("bench.soak")  # run from the repository root
    rc = soak.main(["--minutes", "0.5", "--threads", "16", "--seed", "1", "--check", "10"])
    out = capsys.readouterr().out
    assert "wrong answers:     0" in out and "leaks:             0" in out, out
    assert rc == 0
