"""Derived operands on the engine (runtime/derived.py): a Hankel matrix made from a vector on the device
(1-D im2col), multiplied by the engine's gemm tasks on the sim and the CPU, against numpy."""

from __future__ import annotations

import numpy as np
import pytest

import blasx
from blasx import dispatch
from blasx.runtime.derived import Derivation
from blasx.runtime.plans import plan_gemm


class Hankel(Derivation):
    """H[i, j] = v[i + j]: an m x n matrix from a vector of m + n - 1 values (slot ``source_slot``)."""

    key = ()

    def host_tile(self, source, ref):
        v = source.array[:, 0]
        i = np.arange(ref.r0, ref.r0 + ref.rows)[:, None]
        j = np.arange(ref.c0, ref.c0 + ref.cols)[None, :]
        return v[i + j]

    def nbytes_read(self, ref):
        return (ref.rows + ref.cols - 1) * self.source_view.itemsize


def hankel_gemm(v, b):
    """H(v) @ b through the engine, H never built in host memory."""
    m, n = len(v) - b.shape[0] + 1, b.shape[0]
    vs = np.asfortranarray(v.reshape(-1, 1))
    bf = np.asfortranarray(b)
    c = np.empty((m, b.shape[1]), dtype=v.dtype, order="F")
    h = Hankel(m, n, vs, 3)
    dispatch.submit_planned("dgemm", [h, bf, c, vs], lambda tile, block: plan_gemm(
        m, b.shape[1], n, tile, 0, 0, block=block), v.dtype, 1.0, 0.0, (m, b.shape[1], n))
    return c


@pytest.mark.parametrize("devices", ["sim:1", "sim:3", "cpu"])
def test_hankel_gemm(devices, rel_err):
    blasx.configure(devices=devices, tile=16)
    rng = np.random.default_rng(1)
    for m, n, k in ((40, 33, 7), (16, 16, 16), (1, 5, 3), (70, 20, 45)):
        v = rng.standard_normal(m + n - 1)
        b = rng.standard_normal((n, k))
        ref = np.lib.stride_tricks.sliding_window_view(v, n)[:m] @ b
        assert rel_err(hankel_gemm(v, b), ref) < 1e-13
    prof = blasx.last_profile()
    assert prof is not None


def test_hankel_tiles_read_source_bytes(rel_err):
    """A derived tile's load counts the source bytes it reads; each tile is made once per device and
    then read as an ordinary cache line (hits), never re-derived for every C tile."""
    blasx.configure(devices="sim:1", tile=16)
    rng = np.random.default_rng(2)
    m, n, k = 64, 48, 64
    v = rng.standard_normal(m + n - 1)
    b = rng.standard_normal((n, k))
    ref = np.lib.stride_tricks.sliding_window_view(v, n)[:m] @ b
    assert rel_err(hankel_gemm(v, b), ref) < 1e-13
    totals = blasx.last_profile().totals()
    h_tiles = (m // 16) * (n // 16)
    b_bytes = n * k * 8
    assert totals["bytes_h2d"] <= b_bytes + h_tiles * (16 + 16 - 1) * 8
    assert totals["l1_hits"] > 0


def test_derived_c_refused():
    from blasx.runtime.call import Call
    from blasx.runtime.stats import CallStats, DeviceInfo
    from blasx.operands import TokenTable, make_operand
    vs = np.asfortranarray(np.ones((8, 1)))
    h = Hankel(4, 5, vs, 1)
    tokens = TokenTable(4)
    ops = [make_operand(h, tokens), make_operand(vs, tokens)]
    tasks = plan_gemm(4, 5, 0, 4, 0, 0)
    for t in tasks:
        t.c = t.c._replace(slot=0)
    with pytest.raises(ValueError, match="derived"):
        Call("dgemm", ops, tasks, np.float64, 1.0, 0.0, CallStats([DeviceInfo(0, "x", "sim")]))
