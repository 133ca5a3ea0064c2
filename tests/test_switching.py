"""The switch-interval setting around calls: set by the first call in flight, restored by the
last, never clobbering a change made by someone else meanwhile."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import blasx
from blasx.runtime.switching import SwitchInterval


@pytest.fixture
def restore_interval():
    saved = sys.getswitchinterval()
    yield
    sys.setswitchinterval(saved)


def test_nested_users_set_once_and_restore(restore_interval):
    sys.setswitchinterval(0.005)
    s = SwitchInterval(0.0002)
    with s:
        assert sys.getswitchinterval() == pytest.approx(0.0002)
        with s:
            assert sys.getswitchinterval() == pytest.approx(0.0002)
        assert sys.getswitchinterval() == pytest.approx(0.0002)  # one user still in
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_change_made_meanwhile_is_kept(restore_interval):
    sys.setswitchinterval(0.005)
    with SwitchInterval(0.0002):
        sys.setswitchinterval(0.001)  # the user changed it during the call
    assert sys.getswitchinterval() == pytest.approx(0.001)


def test_none_leaves_it_alone_and_bad_values_are_rejected(restore_interval):
    sys.setswitchinterval(0.003)
    with SwitchInterval(None):
        assert sys.getswitchinterval() == pytest.approx(0.003)
    for bad in (0, -1, 2.0, "fast"):
        with pytest.raises(ValueError, match="switch_interval"):
            SwitchInterval(bad)


def test_engine_sets_it_during_a_call_only(monkeypatch, restore_interval, rand):
    from blasx.runtime.devices import numpy_kernels
    monkeypatch.setenv("BLASX_SWITCH_INTERVAL", "0.0003")
    sys.setswitchinterval(0.004)
    seen = []
    gemm = numpy_kernels.KERNELS["gemm"]

    def spy(*args):
        seen.append(sys.getswitchinterval())
        return gemm(*args)

    monkeypatch.setitem(numpy_kernels.KERNELS, "gemm", spy)
    blasx.configure(devices="sim:2", tile=16)
    a, b = rand((40, 30)), rand((30, 20), seed=1)
    assert np.allclose(blasx.gemm(1.0, a, b), a @ b)
    assert seen and all(v == pytest.approx(0.0003) for v in seen)  # inside the call
    assert sys.getswitchinterval() == pytest.approx(0.004)  # restored after it
