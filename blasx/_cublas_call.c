/* blasx._cublas_call: cublasGemmStridedBatchedEx called from Python with one C call.
 *
 * The device routes of blasx.dnn issue one cuBLAS GEMM per small convolution or RNN step, whose host
 * time is the layer's time: converting the 23 arguments through ctypes on every call adds to it.
 * The function is reached through its address (taken from the libcublas CuPy loaded), so this
 * module links against nothing but Python; the GIL is released during the call, as ctypes does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>

typedef int (*gemm_sb_ex_t)(void *handle, int transa, int transb, int m, int n, int k, const void *alpha,
                            const void *a, int a_type, int lda, long long stride_a,
                            const void *b, int b_type, int ldb, long long stride_b, const void *beta,
                            void *c, int c_type, int ldc, long long stride_c, int batch, int compute, int algo);

#define NARGS 24

/* 'p' pointer, 'i' C int, 'q' 64-bit stride, after the function's address (argument 0) */
static const char kinds[NARGS] = "ppiiiiippiiqpiiqppiiqiii";

static int as_int(PyObject *o, int *out)
{
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < INT_MIN || v > INT_MAX) {
        PyErr_Format(PyExc_OverflowError, "gemm_strided_batched_ex: %ld does not fit a C int", v);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static PyObject *gemm_strided_batched_ex(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *p[NARGS];
    int i32[NARGS];
    long long q[NARGS];
    if (nargs != NARGS) {
        PyErr_Format(PyExc_TypeError,
                     "gemm_strided_batched_ex: takes the function's address and its 23 arguments (%d), got %zd",
                     NARGS, nargs);
        return NULL;
    }
    for (Py_ssize_t j = 0; j < NARGS; j++) {
        switch (kinds[j]) {
        case 'p':
            p[j] = PyLong_AsVoidPtr(args[j]);
            if (p[j] == NULL && PyErr_Occurred()) return NULL;
            break;
        case 'i':
            if (as_int(args[j], &i32[j]) < 0) return NULL;
            break;
        default:
            q[j] = PyLong_AsLongLong(args[j]);
            if (q[j] == -1 && PyErr_Occurred()) return NULL;
        }
    }
    if (p[0] == NULL) {
        PyErr_SetString(PyExc_ValueError, "gemm_strided_batched_ex: the function's address is 0");
        return NULL;
    }
    gemm_sb_ex_t fn = (gemm_sb_ex_t)p[0];
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = fn(p[1], i32[2], i32[3], i32[4], i32[5], i32[6], p[7], p[8], i32[9], i32[10], q[11],
                p[12], i32[13], i32[14], q[15], p[16], p[17], i32[18], i32[19], q[20], i32[21], i32[22], i32[23]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

static PyMethodDef methods[] = {
    {"gemm_strided_batched_ex", (PyCFunction)(void (*)(void))gemm_strided_batched_ex, METH_FASTCALL,
     "gemm_strided_batched_ex(address, handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, "
     "ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo) -> cublasStatus_t: calls the "
     "cublasGemmStridedBatchedEx at address (pointers as ints; alpha and beta host pointers)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "blasx._cublas_call", "cublasGemmStridedBatchedEx in one C call (blasx.dnn's device routes).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__cublas_call(void)
{
    return PyModule_Create(&module);
}
