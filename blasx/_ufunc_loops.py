"""Replacing the inner loops of numpy's ``matmul`` ufunc (what ``a @ b`` runs), through numpy's C-API.

``PyUFunc_ReplaceLoopBySignature`` (entry 30 of the ufunc C-API table, the
``_UFUNC_API`` capsule of ``numpy._core._multiarray_umath``; the index is read
from numpy's own ``__ufunc_api.h`` when the headers are installed) swaps the
loop for one type signature (``dd->d`` ...) and hands back the old one. On
NumPy 2.x the legacy loops are wrapped into ArrayMethods; up to 2.4 the wrapper
looks the loop up in the ufunc's table on every call, and from numpy PR #31068
(loops cached on the ArrayMethod, NumPy 2.5) ReplaceLoopBySignature also
updates that cache (tested upstream by PR #31097). Either way the replacement
is checked right after it is made: a probe ``np.matmul`` per dtype must reach
the new loop, else the original loops are put back and RuntimeError is
raised; it never fails silently.

The gufunc loop is ``void loop(char **args, npy_intp const *dimensions,
npy_intp const *steps, void *data)`` for the signature
``(n?,k),(k,m?)->(n?,m?)``: ``dimensions = [N, n, k, m]`` (N the batch count of
this call), ``steps = [sA, sB, sC, a_n, a_k, b_k, b_m, c_n, c_m]`` (the batch
strides of the three operands, then the core strides), in bytes; a missing
``n?``/``m?`` (1-D operand) has size 1 and stride 0 (numpy's
``numpy/_core/src/umath/matmul.c.src``).

The replacement is a trampoline: below the offload threshold it calls the
original loop straight away, without the GIL and without Python; at or above
it, it calls a Python hook (a ctypes callback, which takes the GIL). A
ctypes-only trampoline would run Python for every ``@`` (about +2.6 us a call
here, +100% and more for small matrices), so the trampoline is a few lines of
C (``TRAMPOLINE_C`` below), compiled once with the system C compiler into the
blasx cache directory (``$BLASX_CACHE_DIR``, ``$XDG_CACHE_HOME/blasx``,
``~/.cache/blasx``) and loaded with ctypes. Without a C compiler (or with
``$BLASX_OFFLOAD_PURE_CTYPES`` set) the same logic runs as ctypes callbacks
(``trampoline().kind`` is ``"c"`` or ``"ctypes"``) and a RuntimeWarning says
what that costs.

The same library carries the C forwarders of blasx.offload's ``numpy.dot`` and
scipy wrappers (``FORWARD_C``, compiled in when Python's headers are installed),
which read the trampoline's thresholds.

Install order: numpy's loop is read from the ufunc object first (``peek_loop``:
the ``functions``/``types`` fields of the public PyUFuncObject struct, used
only when they agree with the ufunc's Python attributes) and handed to the
trampoline before the trampoline goes in, so a thread running ``@`` meanwhile
never finds it without a loop to call; ``oldfunc`` is then checked against it.

Threshold: calls whose flop count ``f * N * n * k * m`` (f = 2 real, 8
complex) is >= the threshold go to the hook; zero-flop calls never do. The
threshold is global, with a per-thread override (C thread-local storage set
from the thread itself).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np

from .perfdb import cache_dir  # one cache directory for the perf-db and the compiled trampoline

#: the dtypes whose matmul loops are replaced, in slot order
SLOT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.complex64), np.dtype(np.complex128))
FLOP_FACTOR = (2.0, 2.0, 8.0, 8.0)

#: index of PyUFunc_ReplaceLoopBySignature in numpy's ufunc C-API table (numpy 1.x and 2.x)
REPLACE_LOOP_INDEX = 30

LOOP = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_ssize_t),
                        ctypes.POINTER(ctypes.c_ssize_t), ctypes.c_void_p)
# PYFUNCTYPE: the GIL stays held while numpy edits the ufunc (NumPy 2.5 looks up dicts there)
_REPLACE = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                             ctypes.POINTER(ctypes.c_void_p))

TRAMPOLINE_C = r"""
/* blasx: matmul inner-loop trampoline (see blasx/_ufunc_loops.py). */
#include <stdint.h>
typedef intptr_t npy_intp;
typedef void (*loop_fn)(char **, const npy_intp *, const npy_intp *, void *);

static loop_fn orig[4];
static loop_fn hook[4];
static const double factor[4] = {2.0, 2.0, 8.0, 8.0};
static double global_thr = 1.0 / 0.0;
static _Thread_local int local_set = 0;
static _Thread_local double local_thr = 0.0;
static unsigned long long ncalls[4];

void blasx_set_slot(int i, loop_fn o, loop_fn h) {
    __atomic_store_n(&orig[i], o, __ATOMIC_SEQ_CST);
    __atomic_store_n(&hook[i], h, __ATOMIC_SEQ_CST);
}
void blasx_set_global(double t) { __atomic_store(&global_thr, &t, __ATOMIC_SEQ_CST); }
void blasx_set_local(int set, double t) { local_thr = t; local_set = set; }
unsigned long long blasx_calls(int i) { return __atomic_load_n(&ncalls[i], __ATOMIC_RELAXED); }

static void dispatch(int i, char **args, const npy_intp *dims, const npy_intp *steps, void *data) {
    double thr, flops;
    loop_fn h;
    __atomic_fetch_add(&ncalls[i], 1, __ATOMIC_RELAXED);
    if (local_set) thr = local_thr; else __atomic_load(&global_thr, &thr, __ATOMIC_RELAXED);
    flops = factor[i] * (double)dims[0] * (double)dims[1] * (double)dims[2] * (double)dims[3];
    h = __atomic_load_n(&hook[i], __ATOMIC_ACQUIRE);
    if (h != 0 && flops > 0.0 && flops >= thr) h(args, dims, steps, data);
    else __atomic_load_n(&orig[i], __ATOMIC_ACQUIRE)(args, dims, steps, data);
}
void blasx_matmul_loop_0(char **a, const npy_intp *d, const npy_intp *s, void *p) { dispatch(0, a, d, s, p); }
void blasx_matmul_loop_1(char **a, const npy_intp *d, const npy_intp *s, void *p) { dispatch(1, a, d, s, p); }
void blasx_matmul_loop_2(char **a, const npy_intp *d, const npy_intp *s, void *p) { dispatch(2, a, d, s, p); }
void blasx_matmul_loop_3(char **a, const npy_intp *d, const npy_intp *s, void *p) { dispatch(3, a, d, s, p); }
"""


# Forwarders for the Python-level wrappers of blasx.offload (``numpy.dot``, the scipy.linalg.blas
# level-3 functions): a call object whose vectorcall reads the trampoline's threshold and, when
# the operands' sizes bound the flop count below it (or an operand is not an exact ndarray),
# hands the arguments as they came to the original function; only otherwise does it call the
# Python wrapper, which makes the exact decision. A Python wrapper in front of np.dot costs
# ~0.25 us a call (+25% for a 16 x 16 product, measured), a forwarder ~30 ns. Built with the
# trampoline when Python's headers are there (``FORWARD_C`` is appended to TRAMPOLINE_C).
#
# The operand sizes come from numpy's public PyArrayObject layout (data, nd, dimensions: the
# fields every numpy since 1.7 starts with), read only for objects whose type is exactly
# numpy.ndarray.
FORWARD_C = r"""
#include <math.h>
#include <stddef.h>

typedef struct { PyObject_HEAD char *data; int nd; Py_ssize_t *dimensions; } blasx_array_head;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *orig;                 /* numpy's / scipy's own function */
    PyObject *slow;                 /* the Python wrapper: the exact decision, the offload */
    PyTypeObject *ndarray;
    Py_ssize_t ia, ib;              /* positions of a and b; ib < 0: b is a (?syrk, ?herk) */
    PyObject *name_a, *name_b;      /* their keyword names */
    PyObject *dict;                 /* __name__, __doc__, __wrapped__ ... */
} blasx_forwarder;

static double blasx_threshold(void) {
    double thr;
    if (local_set) return local_thr;
    __atomic_load(&global_thr, &thr, __ATOMIC_RELAXED);
    return thr;
}

static PyObject *blasx_arg(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, Py_ssize_t i,
                           PyObject *name) {
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

static double blasx_size(blasx_forwarder *f, PyObject *x) {   /* -1: not an exact ndarray */
    blasx_array_head *h = (blasx_array_head *)x;
    double size = 1.0;
    int d;
    if (x == NULL || Py_TYPE(x) != f->ndarray) return -1.0;
    for (d = 0; d < h->nd; d++) size *= (double)h->dimensions[d];
    return size;
}

static PyObject *blasx_forward(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    blasx_forwarder *f = (blasx_forwarder *)self;
    double thr = blasx_threshold();
    if (thr < INFINITY) {
        Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
        double sa = blasx_size(f, blasx_arg(args, nargs, kwnames, f->ia, f->name_a));
        double sb = f->ib < 0 ? sa : blasx_size(f, blasx_arg(args, nargs, kwnames, f->ib, f->name_b));
        if (sa >= 0.0 && sb >= 0.0 && 8.0 * sa * sb >= thr)   /* the wrappers' own bound */
            return PyObject_Vectorcall(f->slow, args, nargsf, kwnames);
    }
    return PyObject_Vectorcall(f->orig, args, nargsf, kwnames);
}

static void blasx_forwarder_dealloc(PyObject *self) {
    blasx_forwarder *f = (blasx_forwarder *)self;
    Py_XDECREF(f->orig); Py_XDECREF(f->slow); Py_XDECREF(f->ndarray);
    Py_XDECREF(f->name_a); Py_XDECREF(f->name_b); Py_XDECREF(f->dict);
    Py_TYPE(self)->tp_free(self);
}

static PyTypeObject blasx_forwarder_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "blasx.offload.forwarder",
    .tp_basicsize = sizeof(blasx_forwarder),
    .tp_dealloc = blasx_forwarder_dealloc,
    .tp_vectorcall_offset = offsetof(blasx_forwarder, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_dictoffset = offsetof(blasx_forwarder, dict),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A blasx.offload wrapper: the original function below the threshold, the Python wrapper above.",
};

PyObject *blasx_forwarder_new(PyObject *orig, PyObject *slow, PyObject *ndarray, Py_ssize_t ia, PyObject *name_a,
                              Py_ssize_t ib, PyObject *name_b) {
    blasx_forwarder *f;
    if (!PyType_Check(ndarray) || !PyUnicode_Check(name_a) || !PyUnicode_Check(name_b)) {
        PyErr_SetString(PyExc_TypeError, "blasx_forwarder_new: ndarray must be a type, the names str");
        return NULL;
    }
    if (blasx_forwarder_type.tp_flags & Py_TPFLAGS_READY) { } else if (PyType_Ready(&blasx_forwarder_type) < 0) {
        return NULL;
    }
    f = PyObject_New(blasx_forwarder, &blasx_forwarder_type);
    if (f == NULL) return NULL;
    f->vectorcall = blasx_forward;
    Py_INCREF(orig); f->orig = orig;
    Py_INCREF(slow); f->slow = slow;
    Py_INCREF(ndarray); f->ndarray = (PyTypeObject *)ndarray;
    f->ia = ia; f->ib = ib;
    Py_INCREF(name_a); f->name_a = name_a;
    Py_INCREF(name_b); f->name_b = name_b;
    f->dict = NULL;
    return (PyObject *)f;
}
"""

# What goes in front of TRAMPOLINE_C when the forwarders are built with it.
_PY_PRELUDE = "#define PY_SSIZE_T_CLEAN\n#include <Python.h>\n"


# ---------------------------------------------------------------- numpy's C-API table

def _replace_index() -> int:
    """The table index of PyUFunc_ReplaceLoopBySignature, from the installed numpy's header if present."""
    header = Path(np.get_include()) / "numpy" / "__ufunc_api.h"
    try:
        text = header.read_text()
    except OSError:
        return REPLACE_LOOP_INDEX
    m = re.search(r"#define PyUFunc_ReplaceLoopBySignature\s*\\?\s*\([^#]*?PyUFunc_API\[(\d+)\]", text)
    return int(m.group(1)) if m else REPLACE_LOOP_INDEX


def _ufunc_api_table():
    try:
        from numpy._core import _multiarray_umath as umath
    except ImportError:  # numpy 1.x
        from numpy.core import _multiarray_umath as umath
    capsule = umath._UFUNC_API
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype = ctypes.c_char_p
    get_name.argtypes = [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    ptr = get_pointer(capsule, get_name(capsule))
    if not ptr:
        raise RuntimeError("numpy's _UFUNC_API capsule gave a NULL table; cannot replace matmul's loops")
    return ctypes.cast(ptr, ctypes.POINTER(ctypes.c_void_p))


_replace_fn = None


def peek_loop(ufunc, dtype: np.dtype) -> int | None:
    """The loop ufunc runs for (dtype, dtype) -> dtype, read from the PyUFuncObject (public ABI:
    nin, nout, nargs, identity, functions, data, ntypes, reserved1, name, types), or None when the
    object does not look as expected (the fields are checked against the ufunc's Python attributes)."""
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None

    class _Fields(ctypes.Structure):
        _fields_ = [("head", ctypes.c_byte * object.__basicsize__),
                    ("nin", ctypes.c_int), ("nout", ctypes.c_int), ("nargs", ctypes.c_int),
                    ("identity", ctypes.c_int), ("functions", ctypes.POINTER(ctypes.c_void_p)),
                    ("data", ctypes.c_void_p), ("ntypes", ctypes.c_int), ("reserved1", ctypes.c_int),
                    ("name", ctypes.c_char_p), ("types", ctypes.POINTER(ctypes.c_ubyte))]

    f = _Fields.from_address(id(ufunc))
    if (f.nin, f.nout, f.nargs, f.ntypes) != (ufunc.nin, ufunc.nout, ufunc.nargs, ufunc.ntypes):
        return None
    if f.name != ufunc.__name__.encode():
        return None
    nargs = ufunc.nargs
    expected = [np.dtype(c).num for t in ufunc.types for c in t.replace("->", "")]
    got = [f.types[i] for i in range(nargs * ufunc.ntypes)]
    if got != expected:
        return None
    for i in range(ufunc.ntypes):
        if got[i * nargs:(i + 1) * nargs] == [dtype.num] * nargs:
            return f.functions[i]
    return None


def replace_loop(ufunc, dtype: np.dtype, new_ptr: int) -> int:
    """Put ``new_ptr`` in as ufunc's loop for (dtype, dtype) -> dtype; returns the loop it replaced."""
    global _replace_fn
    if _replace_fn is None:
        table = _ufunc_api_table()
        _replace_fn = _REPLACE(table[_replace_index()])
    sig = (ctypes.c_int * ufunc.nargs)(*([dtype.num] * ufunc.nargs))
    old = ctypes.c_void_p()
    rc = _replace_fn(ufunc, ctypes.c_void_p(new_ptr), sig, ctypes.byref(old))
    if rc != 0 or not old.value:
        raise RuntimeError(f"PyUFunc_ReplaceLoopBySignature({ufunc.__name__}, {dtype.name}) failed (rc={rc}): "
                           f"numpy {np.__version__} has no {dtype.char * ufunc.nargs} loop to replace")
    return old.value


# ---------------------------------------------------------------- the trampoline

def _compiler() -> list[str] | None:
    for cand in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        if not cand:
            continue
        parts = cand.split()
        if shutil.which(parts[0]):
            return parts
    return None


def _python_include() -> str | None:
    """The directory of Python.h for this interpreter, or None when the headers are not installed."""
    inc = sysconfig.get_paths().get("include")
    return inc if inc and (Path(inc) / "Python.h").exists() else None


def _build():
    """(library path, has forwarders): TRAMPOLINE_C compiled once (cached by its hash) and loaded,
    with FORWARD_C when Python's headers are there (else the trampoline alone); None without a
    working compiler."""
    cc = _compiler()
    if cc is None:
        return None
    # the forwarders only where the GIL guards their reads of the arrays (as peek_loop's)
    inc = None if sysconfig.get_config_var("Py_GIL_DISABLED") else _python_include()
    variants = [(_PY_PRELUDE + TRAMPOLINE_C + FORWARD_C, ["-I", inc], True)] if inc else []
    variants.append((TRAMPOLINE_C, [], False))
    for source, flags, forwarders in variants:
        path = _compile(cc, source, flags)
        if path is not None:
            return path, forwarders
    return None


def _compile(cc: list[str], source: str, flags: list[str]) -> Path | None:
    """``source`` compiled into a shared library in the cache directory (once per source, Python
    version and platform) and loadable; None when that fails."""
    tag = hashlib.sha256((source + sys.platform + sys.version).encode()).hexdigest()[:16]
    for base in (cache_dir(), Path(tempfile.gettempdir()) / f"blasx-{os.getuid() if hasattr(os, 'getuid') else 0}"):
        lib = base / f"matmul_trampoline_{tag}.so"
        if not lib.exists():
            try:
                base.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=base) as tmp:
                    src = Path(tmp) / "trampoline.c"
                    src.write_text(source)
                    out = Path(tmp) / lib.name
                    subprocess.run([*cc, "-O2", "-std=gnu11", "-shared", "-fPIC", *flags, "-o", str(out), str(src)],
                                   check=True, capture_output=True, timeout=120)
                    os.replace(out, lib)  # atomic: concurrent builders are harmless
            except (OSError, subprocess.SubprocessError):
                continue
        try:
            ctypes.CDLL(str(lib))
            return lib
        except OSError:
            continue
    return None


class _CTrampoline:
    kind = "c"

    def __init__(self, path: Path, forwarders: bool) -> None:
        self.lib = lib = ctypes.CDLL(str(path))
        self._new_forwarder = None
        if forwarders:
            # the same library through PyDLL: called with the GIL held, Python errors raised
            new = ctypes.PyDLL(str(path)).blasx_forwarder_new
            new.restype = ctypes.py_object
            new.argtypes = [ctypes.py_object, ctypes.py_object, ctypes.py_object, ctypes.c_ssize_t,
                            ctypes.py_object, ctypes.c_ssize_t, ctypes.py_object]
            self._new_forwarder = new
        lib.blasx_set_slot.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.blasx_set_slot.restype = None
        lib.blasx_set_global.argtypes = [ctypes.c_double]
        lib.blasx_set_global.restype = None
        lib.blasx_set_local.argtypes = [ctypes.c_int, ctypes.c_double]
        lib.blasx_set_local.restype = None
        lib.blasx_calls.argtypes = [ctypes.c_int]
        lib.blasx_calls.restype = ctypes.c_ulonglong

    def loop_ptr(self, slot: int) -> int:
        return ctypes.cast(getattr(self.lib, f"blasx_matmul_loop_{slot}"), ctypes.c_void_p).value

    def set_slot(self, slot: int, orig_ptr: int, hook_ptr: int) -> None:
        self.lib.blasx_set_slot(slot, orig_ptr, hook_ptr)

    def set_global(self, threshold: float) -> None:
        self.lib.blasx_set_global(float(threshold))

    def set_local(self, threshold: float | None) -> None:
        self.lib.blasx_set_local(0 if threshold is None else 1, 0.0 if threshold is None else float(threshold))

    def calls(self, slot: int) -> int:
        return int(self.lib.blasx_calls(slot))

    def forwarder(self, orig, slow, a: tuple[int, str], b: tuple[int, str] | None):
        """A C callable in front of ``slow``: ``orig(*args, **kwargs)`` when both operands (a at
        position ``a[0]`` or keyword ``a[1]``, b likewise; None: b is a) are exact ndarrays with
        8 a.size b.size below this thread's threshold, or are not ndarrays; else ``slow(...)``.
        None when the library was built without Python's headers."""
        if self._new_forwarder is None:
            return None
        ib, name_b = b if b is not None else (-1, a[1])
        return self._new_forwarder(orig, slow, np.ndarray, a[0], a[1], ib, name_b)


class _PyTrampoline:
    """The same dispatch as TRAMPOLINE_C, as ctypes callbacks (runs Python on every matmul)."""
    kind = "ctypes"

    def __init__(self) -> None:
        self._orig = [None] * 4
        self._orig_ptr = [0] * 4
        self._hook = [None] * 4
        self._global = float("inf")
        self._tls = threading.local()
        self._calls = [0] * 4
        self._loops = [LOOP(self._make(i)) for i in range(4)]  # kept alive for the process' life

    def _make(self, slot: int):
        factor = FLOP_FACTOR[slot]

        def loop(args, dims, steps, data):
            self._calls[slot] += 1
            thr = getattr(self._tls, "threshold", None)
            if thr is None:
                thr = self._global
            flops = factor * dims[0] * dims[1] * dims[2] * dims[3]
            hook = self._hook[slot]
            if hook is not None and flops > 0 and flops >= thr:
                hook(args, dims, steps, data)
            else:
                self._orig[slot](args, dims, steps, data)
        return loop

    def loop_ptr(self, slot: int) -> int:
        return ctypes.cast(self._loops[slot], ctypes.c_void_p).value

    def set_slot(self, slot: int, orig_ptr: int, hook_ptr: int) -> None:
        if orig_ptr != self._orig_ptr[slot]:
            self._orig[slot] = LOOP(orig_ptr) if orig_ptr else None
            self._orig_ptr[slot] = orig_ptr
        self._hook[slot] = LOOP(hook_ptr) if hook_ptr else None

    def set_global(self, threshold: float) -> None:
        self._global = float(threshold)

    def set_local(self, threshold: float | None) -> None:
        self._tls.threshold = None if threshold is None else float(threshold)

    def calls(self, slot: int) -> int:
        return self._calls[slot]

    def forwarder(self, orig, slow, a, b):
        return None  # no C here: the Python wrappers stand alone


_trampoline = None
_trampoline_lock = threading.Lock()


def trampoline():
    """The process' trampoline, built on first use: a ``_CTrampoline``, or a ``_PyTrampoline`` without a
    C compiler (or with ``$BLASX_OFFLOAD_PURE_CTYPES`` set)."""
    global _trampoline
    with _trampoline_lock:
        if _trampoline is None:
            built = None if os.environ.get("BLASX_OFFLOAD_PURE_CTYPES") else _build()
            if built is not None:
                _trampoline = _CTrampoline(*built)
            else:
                warnings.warn("blasx.offload: no C compiler found to build the matmul trampoline; using a ctypes "
                              "callback instead, which adds about 3 us of Python to every `@` on float32/float64/"
                              "complex64/complex128 arrays while offload is on (set CC to a C compiler to avoid it)",
                              RuntimeWarning, stacklevel=3)
                _trampoline = _PyTrampoline()
        return _trampoline


# ---------------------------------------------------------------- install / uninstall

class MatmulLoops:
    """The four replaced loops of np.matmul: ``install(hooks)`` and ``uninstall()`` (callers serialise them)."""

    def __init__(self) -> None:
        self.installed = False
        self.orig = [0] * 4  # numpy's loops, as ReplaceLoopBySignature's oldfunc gave them

    def install(self, hooks) -> None:
        """Replace the loops; ``hooks[i]`` is a LOOP callback for SLOT_DTYPES[i] (kept alive by the caller)."""
        if self.installed:
            return
        t = trampoline()
        done = []
        try:
            for i, dt in enumerate(SLOT_DTYPES):
                ours = t.loop_ptr(i)
                hook = ctypes.cast(hooks[i], ctypes.c_void_p).value
                # The trampoline must know numpy's loop before numpy can call the trampoline (another
                # thread may run `@` meanwhile): read it from the ufunc first where its layout checks out.
                ahead = peek_loop(np.matmul, dt)
                if ahead is not None:
                    t.set_slot(i, ahead, hook)
                old = replace_loop(np.matmul, dt, ours)
                done.append(i)
                if old == ours:
                    raise RuntimeError(f"np.matmul's {dt.name} loop already is blasx's trampoline "
                                       f"(a previous install was not undone)")
                self.orig[i] = old
                if old != ahead:
                    t.set_slot(i, old, hook)
            self.installed = True
            self._probe(t)
        except BaseException:
            for i in done:
                if self.orig[i]:
                    replace_loop(np.matmul, SLOT_DTYPES[i], self.orig[i])
                    t.set_slot(i, self.orig[i], 0)
            self.installed = False
            raise

    def _probe(self, t) -> None:
        """Every replaced loop must be what ``@`` runs now; else raise (the caller restores)."""
        t.set_local(float("inf"))  # the probes stay on numpy's loop
        try:
            for i, dt in enumerate(SLOT_DTYPES):
                before = t.calls(i)
                x = np.ones((2, 2), dtype=dt)
                y = x @ x
                if t.calls(i) == before:
                    raise RuntimeError(
                        f"blasx.offload: PyUFunc_ReplaceLoopBySignature replaced np.matmul's {dt.name} loop, but "
                        f"`a @ b` does not call the new loop on numpy {np.__version__} (this numpy caches the "
                        f"loop elsewhere); `@` cannot be redirected here, offload is not enabled")
                if not np.array_equal(y, np.full((2, 2), 2, dtype=dt)):
                    raise RuntimeError(f"blasx.offload: the {dt.name} matmul trampoline gave a wrong result")
        finally:
            t.set_local(None)

    def uninstall(self) -> None:
        if not self.installed:
            return
        t = trampoline()
        errors = []
        for i, dt in enumerate(SLOT_DTYPES):
            try:
                cur = replace_loop(np.matmul, dt, self.orig[i])
                if cur != t.loop_ptr(i):
                    errors.append(f"{dt.name}: the loop replaced at disable was not blasx's (someone else replaced "
                                  f"it meanwhile); numpy's original was put back")
            except RuntimeError as e:
                errors.append(str(e))
            t.set_slot(i, self.orig[i], 0)  # a call still inside the trampoline goes to numpy's loop
        self.installed = False
        if errors:
            warnings.warn("blasx.offload_disable: " + "; ".join(errors), RuntimeWarning, stacklevel=3)
