/* blasx._matmul_loops: the C side of blasx.offload.
 *
 * 1. Replaces numpy's matmul inner loops for float32/64, complex64/128 and float16 with a trampoline
 *    (PyUFunc_ReplaceLoopBySignature, numpy's public ufunc C API). Below the offload threshold it
 *    calls numpy's own loop at once; at or above, it takes the GIL, wraps the operands in ndarray
 *    views and calls a Python hook, which returns True when it computed the product.
 * 2. Forwarders put in front of np.dot and scipy.linalg.blas's level-3 functions: the original when
 *    the operands' sizes bound the flops below the threshold, else the Python wrapper (which decides).
 *
 * The threshold is process-wide with a per-thread override. The gufunc loop signature is
 * (n?,k),(k,m?)->(n?,m?): dims = [N, n, k, m], steps = [sA, sB, sC, a_n, a_k, b_k, b_m, c_n, c_m]
 * in bytes (numpy/_core/src/umath/matmul.c.src).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stddef.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <numpy/ufuncobject.h>

#define NSLOTS 5
static const int slot_type[NSLOTS] = {NPY_FLOAT, NPY_DOUBLE, NPY_CFLOAT, NPY_CDOUBLE, NPY_HALF};
static const double slot_factor[NSLOTS] = {2.0, 2.0, 8.0, 8.0, 2.0};
static const char *const slot_name[NSLOTS] = {"float32", "float64", "complex64", "complex128", "float16"};

/* numpy's loops (the trampoline calls them), the hook, and the ufunc they were replaced in.
 * orig[] is written before the trampoline goes in and never cleared, so a call still inside the
 * trampoline after uninstall finds numpy's loop. hook and matmul change only with the GIL held. */
static PyUFuncGenericFunction orig[NSLOTS];
static int active = 0;                 /* 1 while the trampolines are installed */
static PyObject *hook = NULL;
static PyUFuncObject *matmul = NULL;

static double global_thr = INFINITY;
static _Thread_local int local_set = 0;
static _Thread_local double local_thr = 0.0;
static _Thread_local unsigned long hits[NSLOTS];   /* trampoline calls, per thread (install's probe) */

static double threshold_now(void)
{
    double t;
    if (local_set) return local_thr;
    __atomic_load(&global_thr, &t, __ATOMIC_RELAXED);
    return t;
}

/* ------------------------------------------------------------------ the trampoline */

static PyObject *view(int slot, char *data, npy_intp n0, npy_intp n1, npy_intp n2, npy_intp s0, npy_intp s1,
                      npy_intp s2, int writeable)
{
    npy_intp shape[3] = {n0, n1, n2}, strides[3] = {s0, s1, s2};
    return PyArray_NewFromDescr(&PyArray_Type, PyArray_DescrFromType(slot_type[slot]), 3, shape, strides, data,
                                writeable ? NPY_ARRAY_WRITEABLE : 0, NULL);
}

/* 1 when the Python hook computed the product, 0 when numpy's loop must. Never leaves an exception. */
static int call_hook(int slot, char **args, npy_intp const *d, npy_intp const *s)
{
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *h = hook, *a = NULL, *b = NULL, *c = NULL, *res = NULL;
    int done = 0;
    if (h == NULL) goto out;
    Py_INCREF(h);
    a = view(slot, args[0], d[0], d[1], d[2], s[0], s[3], s[4], 0);
    b = view(slot, args[1], d[0], d[2], d[3], s[1], s[5], s[6], 0);
    c = view(slot, args[2], d[0], d[1], d[3], s[2], s[7], s[8], 1);
    if (a && b && c) res = PyObject_CallFunctionObjArgs(h, a, b, c, NULL);
    if (res != NULL) {
        done = PyObject_IsTrue(res) == 1;
    }
    if (PyErr_Occurred()) {
        /* numpy's loop cannot raise: a Ctrl-C is raised again in this thread once the ufunc returns (numpy's
           loop having written c; an asynchronous exception, so no SIGINT handler runs twice), anything else
           reported */
        if (PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
            PyErr_Clear();
            PyThreadState_SetAsyncExc(PyThread_get_thread_ident(), PyExc_KeyboardInterrupt);
        } else {
            PyErr_WriteUnraisable(h);
        }
    }
    Py_XDECREF(res); Py_XDECREF(a); Py_XDECREF(b); Py_XDECREF(c);
    Py_DECREF(h);
out:
    PyGILState_Release(g);
    return done;
}

static void dispatch(int slot, char **args, npy_intp const *d, npy_intp const *s, void *data)
{
    double flops = slot_factor[slot] * (double)d[0] * (double)d[1] * (double)d[2] * (double)d[3];
    hits[slot]++;
    if (flops > 0.0 && flops >= threshold_now() && __atomic_load_n(&active, __ATOMIC_ACQUIRE)
            && call_hook(slot, args, d, s))
        return;
    orig[slot](args, d, s, data);
}

static void loop0(char **a, npy_intp const *d, npy_intp const *s, void *p) { dispatch(0, a, d, s, p); }
static void loop1(char **a, npy_intp const *d, npy_intp const *s, void *p) { dispatch(1, a, d, s, p); }
static void loop2(char **a, npy_intp const *d, npy_intp const *s, void *p) { dispatch(2, a, d, s, p); }
static void loop3(char **a, npy_intp const *d, npy_intp const *s, void *p) { dispatch(3, a, d, s, p); }
static void loop4(char **a, npy_intp const *d, npy_intp const *s, void *p) { dispatch(4, a, d, s, p); }
static const PyUFuncGenericFunction trampoline[NSLOTS] = {loop0, loop1, loop2, loop3, loop4};

/* numpy's loop for (t, t) -> t in the ufunc's table (the public PyUFuncObject fields), or NULL */
static PyUFuncGenericFunction loop_in_table(PyUFuncObject *u, int t)
{
    int i, j;
    for (i = 0; i < u->ntypes; i++) {
        for (j = 0; j < u->nargs; j++)
            if ((unsigned char)u->types[i * u->nargs + j] != t) break;
        if (j == u->nargs) return u->functions[i];
    }
    return NULL;
}

static int replace(PyUFuncObject *u, int slot, PyUFuncGenericFunction fn, PyUFuncGenericFunction *old)
{
    int sig[3] = {slot_type[slot], slot_type[slot], slot_type[slot]};
    if (PyUFunc_ReplaceLoopBySignature(u, fn, sig, old) == 0) return 0;
    PyErr_Format(PyExc_RuntimeError, "PyUFunc_ReplaceLoopBySignature(matmul, %s) failed: this numpy has no such loop",
                 slot_name[slot]);
    return -1;
}

static PyObject *np_matmul(void)
{
    PyObject *np = PyImport_ImportModule("numpy"), *m;
    if (np == NULL) return NULL;
    m = PyObject_GetAttrString(np, "matmul");
    Py_DECREF(np);
    if (m != NULL && !PyObject_TypeCheck(m, &PyUFunc_Type)) {
        PyErr_SetString(PyExc_RuntimeError, "numpy.matmul is not a ufunc: cannot replace its loops");
        Py_CLEAR(m);
    }
    return m;
}

PyDoc_STRVAR(install_doc, "install(hook): replace np.matmul's loops of the four BLAS types and float16 with the trampoline.\n\n"
             "hook(a, b, c) gets (N, n, k), (N, k, m) and (N, n, m) views and returns True when it wrote c.\n"
             "Raises RuntimeError (nothing replaced) when a loop cannot be replaced.");

static PyObject *install(PyObject *self, PyObject *h)
{
    PyUFuncGenericFunction old;
    PyUFuncObject *u;
    int i, k;
    if (matmul != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "blasx._matmul_loops.install: already installed");
        return NULL;
    }
    if (!PyCallable_Check(h)) {
        PyErr_Format(PyExc_TypeError, "hook: got %R; allowed: a callable", h);
        return NULL;
    }
    u = (PyUFuncObject *)np_matmul();
    if (u == NULL) return NULL;
    for (i = 0; i < NSLOTS; i++) {   /* numpy's loops known before numpy can call the trampoline */
        PyUFuncGenericFunction f = loop_in_table(u, slot_type[i]);
        if (f == NULL || f == trampoline[i]) {
            PyErr_Format(PyExc_RuntimeError, "np.matmul's %s loop is %s", slot_name[i],
                         f ? "already blasx's trampoline (a previous install was not undone)" : "missing");
            Py_DECREF(u);
            return NULL;
        }
        orig[i] = f;
    }
    Py_INCREF(h);
    hook = h;
    __atomic_store_n(&active, 1, __ATOMIC_RELEASE);
    for (i = 0; i < NSLOTS; i++) {
        if (replace(u, i, trampoline[i], &old) < 0) {
            for (k = 0; k < i; k++) replace(u, k, orig[k], NULL);
            __atomic_store_n(&active, 0, __ATOMIC_RELEASE);
            Py_CLEAR(hook);
            Py_DECREF(u);
            return NULL;
        }
        orig[i] = old;
    }
    matmul = u;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(uninstall_doc, "uninstall() -> list of str: put numpy's loops back (a no-op when not installed).\n\n"
             "Returns the types whose loop was no longer the trampoline (replaced by someone else meanwhile).");

static PyObject *uninstall(PyObject *self, PyObject *unused)
{
    PyObject *displaced = PyList_New(0);
    PyUFuncGenericFunction cur;
    int i;
    if (displaced == NULL || matmul == NULL) return displaced;
    __atomic_store_n(&active, 0, __ATOMIC_RELEASE);   /* calls still inside go to numpy's loop */
    for (i = 0; i < NSLOTS; i++) {
        if (replace(matmul, i, orig[i], &cur) < 0 || cur != trampoline[i]) {
            PyObject *name = PyUnicode_FromString(slot_name[i]);
            PyErr_Clear();
            if (name == NULL || PyList_Append(displaced, name) < 0) PyErr_Clear();
            Py_XDECREF(name);
        }
    }
    Py_CLEAR(matmul);
    Py_CLEAR(hook);
    return displaced;
}

static PyObject *installed(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(matmul != NULL);
}

PyDoc_STRVAR(loops_doc, "loops() -> tuple of 5 int: the addresses np.matmul's table holds now for f4, f8, c8, c16, f2.");

static PyObject *loops(PyObject *self, PyObject *unused)
{
    PyObject *u = np_matmul(), *out;
    int i;
    if (u == NULL) return NULL;
    out = PyTuple_New(NSLOTS);
    for (i = 0; out != NULL && i < NSLOTS; i++)
        PyTuple_SET_ITEM(out, i, PyLong_FromVoidPtr((void *)loop_in_table((PyUFuncObject *)u, slot_type[i])));
    Py_DECREF(u);
    return out;
}

static PyObject *hits_of(PyObject *self, PyObject *arg)
{
    long slot = PyLong_AsLong(arg);
    if (slot == -1 && PyErr_Occurred()) return NULL;
    if (slot < 0 || slot >= NSLOTS) {
        PyErr_Format(PyExc_ValueError, "slot: got %ld; allowed: 0 to %d", slot, NSLOTS - 1);
        return NULL;
    }
    return PyLong_FromUnsignedLong(hits[slot]);
}

/* ------------------------------------------------------------------ thresholds */

static int as_threshold(PyObject *arg, double *t)
{
    *t = PyFloat_AsDouble(arg);
    if (*t == -1.0 && PyErr_Occurred()) return -1;
    if (!(*t >= 0.0)) {
        PyErr_Format(PyExc_ValueError, "threshold: got %R; allowed: a number of flops >= 0", arg);
        return -1;
    }
    return 0;
}

static PyObject *set_global(PyObject *self, PyObject *arg)
{
    double t;
    if (as_threshold(arg, &t) < 0) return NULL;
    __atomic_store(&global_thr, &t, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *set_local(PyObject *self, PyObject *arg)
{
    double t = 0.0;
    if (arg != Py_None && as_threshold(arg, &t) < 0) return NULL;
    local_thr = t;
    local_set = arg != Py_None;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ forwarders */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *orig;                 /* numpy's / scipy's own function */
    PyObject *slow;                 /* the Python wrapper: the exact decision, the offload */
    Py_ssize_t ia, ib;              /* positions of a and b; ib < 0: b is a (?syrk, ?herk) */
    PyObject *name_a, *name_b;      /* their keyword names */
    PyObject *dict;                 /* __name__, __doc__, __wrapped__ ... */
} forwarder;

static PyObject *arg_at(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, Py_ssize_t i, PyObject *name)
{
    Py_ssize_t k, n;
    if (i < nargs) return args[i];
    if (kwnames == NULL) return NULL;
    n = PyTuple_GET_SIZE(kwnames);
    for (k = 0; k < n; k++) {
        PyObject *kw = PyTuple_GET_ITEM(kwnames, k);
        if (kw == name || PyUnicode_Compare(kw, name) == 0) return args[nargs + k];
    }
    return NULL;
}

static double size_of(PyObject *x)   /* -1: not an exact ndarray (array-likes go to the original) */
{
    if (x == NULL || !PyArray_CheckExact(x)) return -1.0;
    return (double)PyArray_SIZE((PyArrayObject *)x);
}

static PyObject *forward(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    forwarder *f = (forwarder *)self;
    double thr = threshold_now();
    if (thr < INFINITY) {
        Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
        double sa = size_of(arg_at(args, nargs, kwnames, f->ia, f->name_a));
        double sb = f->ib < 0 ? sa : size_of(arg_at(args, nargs, kwnames, f->ib, f->name_b));
        if (sa >= 0.0 && sb >= 0.0 && 8.0 * sa * sb >= thr)   /* bounds the flops of every such call */
            return PyObject_Vectorcall(f->slow, args, nargsf, kwnames);
    }
    return PyObject_Vectorcall(f->orig, args, nargsf, kwnames);
}

static void forwarder_dealloc(PyObject *self)
{
    forwarder *f = (forwarder *)self;
    Py_XDECREF(f->orig); Py_XDECREF(f->slow);
    Py_XDECREF(f->name_a); Py_XDECREF(f->name_b); Py_XDECREF(f->dict);
    Py_TYPE(self)->tp_free(self);
}

/* pickled by reference, as the function it stands in for: its __module__ and __qualname__ (numpy.dot), which
   resolve to the forwarder here and to whatever numpy.dot is in the process that unpickles it */
static PyObject *forwarder_reduce(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyObject_GetAttrString(self, "__qualname__");
}

static PyMethodDef forwarder_methods[] = {
    {"__reduce__", forwarder_reduce, METH_NOARGS, "The forwarder's qualified name: pickled by reference."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject forwarder_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "blasx._matmul_loops.forwarder",
    .tp_basicsize = sizeof(forwarder),
    .tp_dealloc = forwarder_dealloc,
    .tp_vectorcall_offset = offsetof(forwarder, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_dictoffset = offsetof(forwarder, dict),
    .tp_methods = forwarder_methods,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A blasx.offload wrapper: the original function below the threshold, the Python wrapper above.",
};

PyDoc_STRVAR(forwarder_doc, "forwarder(orig, slow, ia, name_a, ib, name_b): a callable that calls slow(...) when\n"
             "a (position ia or keyword name_a) and b (likewise; ib < 0: b is a) are exact ndarrays with\n"
             "8 a.size b.size >= the calling thread's threshold, and orig(...) otherwise.");

static PyObject *new_forwarder(PyObject *self, PyObject *args)
{
    PyObject *orig_fn, *slow, *name_a, *name_b;
    Py_ssize_t ia, ib;
    forwarder *f;
    if (!PyArg_ParseTuple(args, "OOnUnU:forwarder", &orig_fn, &slow, &ia, &name_a, &ib, &name_b)) return NULL;
    f = PyObject_New(forwarder, &forwarder_type);
    if (f == NULL) return NULL;
    f->vectorcall = forward;
    Py_INCREF(orig_fn); f->orig = orig_fn;
    Py_INCREF(slow); f->slow = slow;
    f->ia = ia; f->ib = ib;
    Py_INCREF(name_a); f->name_a = name_a;
    Py_INCREF(name_b); f->name_b = name_b;
    f->dict = NULL;
    return (PyObject *)f;
}

/* ------------------------------------------------------------------ the module */

static PyMethodDef methods[] = {
    {"install", install, METH_O, install_doc},
    {"uninstall", uninstall, METH_NOARGS, uninstall_doc},
    {"installed", installed, METH_NOARGS, "installed() -> bool: the trampolines are in np.matmul."},
    {"loops", loops, METH_NOARGS, loops_doc},
    {"hits", hits_of, METH_O, "hits(slot) -> int: trampoline calls of this thread for slot 0-4 (f4, f8, c8, c16, f2)."},
    {"set_global", set_global, METH_O, "set_global(flops): the process-wide threshold."},
    {"set_local", set_local, METH_O, "set_local(flops or None): the calling thread's threshold (None: none)."},
    {"forwarder", new_forwarder, METH_VARARGS, forwarder_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "blasx._matmul_loops",
    "The C side of blasx.offload: np.matmul's loop trampoline, thresholds, np.dot/scipy forwarders.", -1, methods,
};

PyMODINIT_FUNC PyInit__matmul_loops(void)
{
    import_array();
    import_umath();
    if (PyType_Ready(&forwarder_type) < 0) return NULL;
    return PyModule_Create(&module);
}
