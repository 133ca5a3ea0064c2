"""rnn_layer.CudaOps.matmul's cuBLAS arguments (gemm_ex_layout) checked by emulating cublasGemmEx's column-major
product on the operands' raw memory with numpy: every C/F layout pair gives a . b."""

from __future__ import annotations

import numpy as np
import pytest

from blasx.dnn.rnn_layer import gemm_ex_layout
from blasx.dnn.rnn_params import GATES


def _col_major(mem, rows: int, cols: int, ld: int):
    """The column-major rows x cols matrix at ``mem`` with leading dimension ld (element (i, j) at i + j ld)."""
    assert ld >= max(1, rows)
    return np.lib.stride_tricks.as_strided(mem, (rows, cols), (mem.itemsize, ld * mem.itemsize))


def gemm_ex(op_b: int, op_a: int, n: int, m: int, k: int, b_mem, ldb: int, a_mem, lda: int):
    """cublasGemmEx(op_b, op_a, n, m, k, B, ldb, A, lda) -> the n x m column-major C, as numpy."""
    b = _col_major(b_mem, *((n, k) if op_b == 0 else (k, n)), ldb)
    a = _col_major(a_mem, *((k, m) if op_a == 0 else (m, k)), lda)
    return (b if op_b == 0 else b.T) @ (a if op_a == 0 else a.T)


@pytest.mark.parametrize("m,k,n", [(5, 3, 4), (1, 7, 2), (6, 1, 3), (4, 5, 1)])
@pytest.mark.parametrize("a_order", ["C", "F"])
@pytest.mark.parametrize("b_order", ["C", "F"])
def test_every_layout_pair_gives_the_product(m, k, n, a_order, b_order):
    rng = np.random.default_rng(m * 100 + k * 10 + n)
    a = np.asarray(rng.standard_normal((m, k)), order=a_order)
    b = np.asarray(rng.standard_normal((k, n)), order=b_order)
    (op_a, lda), (op_b, ldb) = gemm_ex_layout(a), gemm_ex_layout(b)
    c = gemm_ex(op_b, op_a, n, m, k, b.ravel(order="K"), ldb,
                a.ravel(order="K"), lda)
    out = np.ascontiguousarray(c.T)  # the n x m column-major C is the row-major m x n product
    assert np.allclose(out, a @ b, rtol=1e-12, atol=1e-12)


def test_a_strided_operand_is_refused():
    with pytest.raises(ValueError, match="neither C- nor F-contiguous"):
        gemm_ex_layout(np.zeros((4, 6))[:, ::2])


@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_backward_loop_with_half_weights_takes_rounded_gate_gradients(mode):
    """Weights given in float16 (the CUDA path of a float16 layer): the loop keeps dgh rounded to float16 (g16,
    zero past each sequence's end) and its GEMMs take that; the result is the float32-weight loop's within the
    rounding."""
    from blasx.dnn import rnn_layer
    rng = np.random.default_rng(5)
    bs = (4, 4, 3, 2, 1)
    T, B, H = len(bs), 4, 8
    G = GATES[mode]
    ops = rnn_layer.HostOps()
    st = rnn_layer.forward_buffers(np, mode, T, B, H, H, False, np.float16, np.float32)
    st.S[0] = rng.standard_normal((B, H)) * 0.5
    if st.C is not None:
        st.C[0] = rng.standard_normal((B, H)) * 0.5
    w16 = (rng.standard_normal((G * H, H)) * 0.3).astype(np.float16)
    gx = (rng.standard_normal((T, B, G * H)) * 0.5).astype(np.float32)
    rnn_layer.forward_loop(ops, mode, gx, w16.astype(np.float32), None, None, st, np.empty((B, G * H), np.float32),
                           bs, False)
    dy = (rng.standard_normal((T, B, H)) * 0.5).astype(np.float32)
    full = rnn_layer.backward_loop(ops, mode, st, w16.astype(np.float32), None, dy, None, None, bs, False, H)
    half = rnn_layer.backward_loop(ops, mode, st, w16, None, dy, None, None, bs, False, H)
    assert full.g16 is None and half.g16 is not None and half.g16.dtype == np.float16
    for t, a in enumerate(bs):
        assert not half.g16[t, a:].any()
    assert np.array_equal(half.g16, half.dgh.astype(np.float16))
    for name in ("dgx", "dh"):
        a, b = getattr(half, name), getattr(full, name)
        assert np.linalg.norm(a - b) <= 5e-3 * np.linalg.norm(b), name


@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_forward_cell_adds_its_bias(mode):
    """rnn_cells.np_forward with the cell's bias equals the step on the projection with the biases added (GRU:
    b_hn inside the reset product, as torch's n = tanh(W_in x + b_in + r * (W_hn h + b_hn)))."""
    from blasx.dnn import rnn_cells
    rng = np.random.default_rng(7)
    a, H = 3, 4
    G = GATES[mode]
    gx, gh = rng.standard_normal((a, G * H)), rng.standard_normal((a, G * H))
    bias = rng.standard_normal((G + (mode == "gru")) * H)
    cp, hp = rng.standard_normal((a, H)), rng.standard_normal((a, H))

    def step(gx, gh, bias):
        gates, c, h = np.zeros((a, 4 * H)), np.zeros((a, H)), np.zeros((a, H))
        rnn_cells.np_forward(mode, gx, gh, bias, cp, hp, gates, c, h)
        return gates, c, h
    if mode == "gru":  # b_hn adds to the hidden n-part only
        gh_n = gh.copy()
        gh_n[:, 2 * H:] += bias[3 * H:]
        want = step(gx + bias[:3 * H], gh_n, None)
    else:
        want = step(gx + bias, gh, None)
    for got, ref in zip(step(gx, gh, bias), want):
        np.testing.assert_allclose(got, ref, rtol=1e-13, atol=1e-13)
