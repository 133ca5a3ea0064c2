"""Read-only arrays' cached tiles against what a call sees of them (usage.md's promise): a call that sees the array
writable again retires them, whatever the front end hands the engine, and a write blasx makes into its memory
retires them too, whatever the call returns."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import blasx
import blasx.dnn as dnn


def _rewritten_then_read_only(a, rand, call_while_writable):
    """Cache a's tiles, make it writable, let ``call_while_writable`` see it, rewrite it, freeze it again."""
    a.flags.writeable = False
    blasx.gemm(1.0, a[0], rand((64, 64), seed=9))
    a.flags.writeable = True
    a[...] = rand(a.shape, seed=10)  # rewritten through itself
    call_while_writable(a)
    a.flags.writeable = False


@pytest.mark.parametrize("how", ["strided view", "other type", "batched matmul", "quick return", "tensordot cast",
                                 "tensordot", "quantize", "conv2d strided", "linear"])
def test_a_call_seeing_the_array_writable_retires_its_tiles_whatever_the_engine_gets(rand, rel_err, how):
    """The front end hands the engine a copy (a cast, non-column-major strides), a view whose base chain never
    reaches the array (batched matmul's rows), or nothing at all (alpha 0, beta 1): the call still saw the
    caller's array writable, so its read-only tiles go."""
    blasx.configure(devices="sim:2", tile=16)
    b = rand((64, 64), seed=2)
    seen = {"strided view": lambda a: blasx.gemm(1.0, a[0, :, ::2], b[:32]),
            "other type": lambda a: blasx.sgemm(1.0, a[0], b),
            "batched matmul": lambda a: blasx.matmul(a, b),
            "quick return": lambda a: blasx.gemm(0.0, a[0], b, 1.0, np.zeros((64, 64)), overwrite_c=True),
            "tensordot cast": lambda a: blasx.tensordot(a, b.astype(np.complex128), axes=1),
            "tensordot": lambda a: blasx.tensordot(a, b, axes=([1], [0])),
            "quantize": lambda a: blasx.quantize(a[0]),
            "conv2d strided": lambda a: dnn.conv2d(a[None, :, :, ::2], np.ones((3, 2, 3, 3))),
            "linear": lambda a: dnn.linear(a, b)}[how]
    a = np.ascontiguousarray(rand((2, 64, 64), seed=1))
    _rewritten_then_read_only(a, rand, seen)
    assert rel_err(blasx.gemm(1.0, a[0], b), a[0] @ b) < 1e-12


def test_dot_into_a_0d_out_over_a_read_only_arrays_memory_retires_its_tiles(rand, rel_err):
    """np.dot's scalar result: blasx.dot writes a 0-d out (an alias of a read-only array's first element) through
    a copy-back and returns the scalar, not out; the read-only array's tiles must still go."""
    blasx.configure(devices="sim:2", tile=16)
    n = 48
    r = np.asfortranarray(rand((n, n), seed=4))
    alias = np.ctypeslib.as_array((ctypes.c_double * (n * n)).from_address(r.ctypes.data))
    r.flags.writeable = False
    z = rand((n,), seed=5)
    first = blasx.dot(z, r[:, 0])
    assert rel_err(first, z @ r[:, 0]) < 1e-12
    out = alias[:1].reshape(())  # r[0, 0]'s memory
    blasx.dot(alias[:n], alias[:n], out=out)  # out aliases the inputs: written by a copy-back
    assert r[0, 0] == out
    assert rel_err(blasx.dot(z, r[:, 0]), z @ r[:, 0]) < 1e-12
