"""blasx.dnn.cublas_call: cublasGemmStridedBatchedEx's one callable, through the C extension
blasx._cublas_call where it is built, else ctypes; both hand every argument over as its C type. Checked
here on libc's abs (which reads the first argument, the handle, and ignores the rest)."""

from __future__ import annotations

import ctypes

import pytest

from blasx.dnn import cublas_call

# handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB, beta, C, Ctype,
# ldc, strideC, batch, compute, algo: pointers past 32 bits, strides past 32 bits, algo negative
ARGS = (0, 0, 1, 64, 200704, 64, 1 << 45, (1 << 45) + 8, 0, 64, 1 << 40, (1 << 46) + 4, 0, 64, 0, 1 << 45,
        1 << 47, 0, 64, 0, 1, 68, -1)


def _binds():
    out = [cublas_call.bind(ctypes.CDLL(None).abs, use_extension=False)]
    if cublas_call._extension() is not None:
        out.append(cublas_call.bind(ctypes.CDLL(None).abs))
    return out


def test_the_extension_is_built_where_the_package_build_had_a_compiler():
    from blasx import _cublas_call  # make test's install builds it
    assert callable(_cublas_call.gemm_strided_batched_ex)


@pytest.mark.parametrize("which", ["ctypes", "extension"])
def test_both_callables_pass_the_arguments_and_return_the_status(which):
    binds = _binds()
    if which == "extension" and len(binds) < 2:
        pytest.skip("blasx._cublas_call is not built")
    fn = binds[0 if which == "ctypes" else 1]
    assert fn(*ARGS) == 0
    assert fn(-7, *ARGS[1:]) == 7  # abs of the handle's low 32 bits: the handle arrives first
    with pytest.raises((TypeError, ctypes.ArgumentError)):
        fn(*ARGS[:5])
    with pytest.raises((TypeError, ctypes.ArgumentError)):
        fn(*ARGS[:3], "64", *ARGS[4:])


def test_the_extension_rejects_what_does_not_fit_its_c_type():
    if cublas_call._extension() is None:
        pytest.skip("blasx._cublas_call is not built")
    fn = cublas_call.bind(ctypes.CDLL(None).abs)
    with pytest.raises(OverflowError, match="does not fit a C int"):
        fn(*ARGS[:3], 1 << 40, *ARGS[4:])
    with pytest.raises(ValueError, match="address is 0"):
        cublas_call._extension().gemm_strided_batched_ex(0, *ARGS)


def test_a_cublas_error_raises_with_its_status():
    cublas_call.check(0)
    with pytest.raises(RuntimeError, match=r"cublasStatus_t 13 \(a call\)"):
        cublas_call.check(13, "a call")


def test_without_the_extension_ctypes_stands_in(monkeypatch):
    import sys

    import blasx
    monkeypatch.setitem(sys.modules, "blasx._cublas_call", None)  # as if built without a C compiler
    monkeypatch.delattr(blasx, "_cublas_call", raising=False)
    assert cublas_call._extension() is None
    fn = cublas_call.bind(ctypes.CDLL(None).abs)
    assert not callable(getattr(fn, "func", None))  # the ctypes function itself, no partial
    assert fn(-5, *ARGS[1:]) == 5
