"""rnn_layer.CudaOps.matmul's cuBLAS arguments (gemm_ex_layout) checked by emulating cublasGemmEx's column-major
product on the operands' raw memory with numpy: every C/F layout pair gives a . b."""

from __future__ import annotations

import numpy as np
import pytest

from blasx.dnn.rnn_layer import gemm_ex_layout


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
