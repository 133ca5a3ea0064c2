"""The soak (``bench/soak.py``) for a quarter of a minute: random calls from 16 threads on the sim with device
faults and Ctrl-C injected; no wrong answer and no leak (``python -m bench.soak --minutes N`` runs longer)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_soak_a_quarter_minute(capsys):
    soak = pytest.importorskip("bench.soak")  # run from the repository root
    rc = soak.main(["--minutes", "0.25", "--threads", "16", "--seed", "1", "--check", "5"])
    out = capsys.readouterr().out
    assert "wrong answers:     0" in out and "leaks:             0" in out, out
    assert rc == 0
