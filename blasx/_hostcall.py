"""C entry points of the CPU-only fast paths: ``blasx.matmul``, ``dot``, ``gemm`` and the scipy-signature
level-3 functions (``blasx.linalg.blas.?xxx``, ``blasx.<prefix>xxx``) as C callables.

With the CPU as the only device (``session.host_device`` set), a plain call of these runs numpy's or
scipy's own function, and the Python that decides so (the call of a Python function, a dozen checks,
two clock reads, the record of the call) costs 0.6-0.9 us, about half of a 16 x 16 product. Here the
same decision is made in C (``HOSTCALL_C``): a callable whose vectorcall checks the arguments, calls
the original function with them (as they came, or as the Python path passes them) or its BLAS
routine directly ("Direct BLAS" below), and records the call; any other call goes, with its
arguments unchanged, to the Python function (``slow``), which decides everything as before.
Without the direct calls, a call taken here costs 0.03-0.13 us over numpy's / scipy's own at
N = 16-32 (median per family on a 2-core VM: ``matmul`` / ``dot`` / ``gemm`` 0.03-0.05,
``tensordot`` 0.08, the level-3 functions 0.07, with c / beta, converted arrays or matmul's
keywords 0.07-0.12, alpha 0 0.13 against scipy's quick return; outputs written in place below
scipy's call, which parses its keyword): two TSC stamps ~15 ns in all (rdtsc ~10 ns each, partly
overlapped; 18-22 ns each on a GPU host's Xeon), the ``session.host_device`` look-up ~10-20 ns (on
Python >= 3.12 a cached pointer, which a dict watcher on the session's dict drops at any change:
2-7 ns), the checks ~10-20 ns (the second lane's ~50), the record ~5 ns
(``bench/scripts/hostcall_breakdown.py`` rebuilds this source with each piece taken out;
bench/results/NOTES.md, "The C record of host calls", "Seventh session" and "Eighth session").

The record (``(device, t0, t1, dtype, real flops)``, what the Python paths put in
``level3.last_call.stats``) is kept as C values in thread-local storage, no Python object made per
call: ``record_reader()`` gives ``level3`` ``take_record`` (the thread's record when it is newer
than the Python paths' one, which it then becomes) and ``end_clock`` (perf_counter's value, read by
the Python paths at the end of a call right before they write their record: the C record is then
older). The order is program order, never a comparison of times, which TSC stamps converted to
seconds could get wrong within some ns; ``last_profile()`` turns the newer into the profile. The
record's device is held by a guard object in the thread's ``level3.last_call`` (``c_guard``), so it
is let go when the thread ends, as the Python paths' records are. What the C code takes, per kind:

* ``matmul(x1, x2)``: two exact ndarrays of one BLAS dtype on which numpy's matmul runs BLAS
  (any strides from numpy 2.3.1, which copies the others into a buffer, numpy PR #23752; before,
  C-/F-contiguous ones or matrices with a unit stride, numpy's ``is_blasable2d``); numpy's errors;
  with ``out`` (by keyword or position), ``dtype=`` and ``casting=`` as
  ``numpy_api._host_matmul_out`` takes them (a computation type of a BLAS type, out None or a C- or
  F-contiguous exact ndarray of that type, casting a str), numpy's matmul with them as given;
* ``dot(a, b[, out])``: two exact 1-D / 2-D ndarrays of one BLAS dtype (numpy copies other strides),
  ``out`` by position or keyword as it came (numpy checks it), not with out where both are 1-D;
* ``tensordot(a, b[, axes])``: two exact ndarrays of one BLAS dtype: numpy's tensordot
  (``numpy_api._host_tensordot``; K for the flop count from the sizes, as there);
* ``gemm`` (arguments bound to its signature in C): 2-D exact ndarrays of one BLAS dtype (c too),
  alpha and beta of the types ``level3.gemm``'s host path takes, trans flags 0-2, dimensions > 0
  that fit: scipy's ?gemm on F-ordered views (a C-ordered operand through its transpose), c copied
  or written in place (an F-ordered one; a C-ordered one through c.T, C^T = op(B)^T op(A)^T), as
  ``level3._host_gemm`` and ``_c_mode`` decide;
* a scipy-signature routine (``lane``): hostpath's plain call (required arguments positionally,
  alpha of the routine's plain types and not 0, 2-D exact ndarrays of its dtype, flags by keyword
  within what blasx allows, dimensions > 0 that fit): scipy's routine with the arguments as given;
  else hostpath's second lane (``LANES``: the arguments bound to scipy's signature, c and beta,
  ``overwrite_*``, alpha 0, arrays scipy converts), checked as the lane checks them and scipy's
  routine called as the lane calls it.

Direct BLAS (``_blas_symbols``; ``direct()`` says which are on, ``$BLASX_HOST_DIRECT=0`` turns them
off): where numpy's / scipy's function would only wrap one BLAS call, the C code makes that call
itself, with the arguments the function would pass, into an array made as the function makes it:
``matmul`` / ``dot`` of two 2-D C- or F-contiguous operands (numpy's ``cblas_?gemm``; not a @ a.T,
numpy's syrk, nor a dimension 1, numpy's gemv; blocks of larger arrays for matmul, out=), ``gemm``
and every scipy-signature routine on 2-D operands, with Python's or numpy's scalars, c and
overwrite_* too (scipy's own routine from ``scipy.linalg.cython_blas``, called as its f2py wrapper
calls it, on what the wrapper would make of the operands: the same arrays, or F-ordered copies of
another order or type made by the same numpy functions). That skips numpy's ufunc / dot
machinery (~0.7 us) and f2py's parsing (~0.1-0.25 us): the same bits, checked at load
(``_direct_ok``, ``_lane_ok``) and by the tests, bit for bit, against the functions themselves.
numpy's floating-point warnings are kept: a flag raised in a direct matmul / dot hands the call to
numpy's function, which computes it again and warns or raises as ``np.errstate`` says.

An output written in place (and ?gemm's c, always) must provably alias no input: arrays that each
own their buffer, else numpy's bounds test (``np.may_share_memory``) written in C; a maybe, a
misaligned output, or anything else goes to the Python function, which decides (and raises blasx's
error where they do share memory). Trailing arguments that hold scipy's defaults (beta 0.0 without
c, c None, flags 0, overwrite 0) are left out of scipy's call: f2py parses each positional one.

The arrays are read through numpy's public ``PyArrayObject`` layout (data, nd, dimensions, strides,
base, descr, flags: the fields every numpy since 1.7 starts with), checked against Python's view
of a few probe arrays when the library loads. Built with the system C compiler into the blasx
cache directory (next to the matmul trampoline, ``_ufunc_loops._compile``) on first import (~0.2 s,
once per source, Python version and platform); without
a compiler, without Python's headers, on a free-threaded build or with ``$BLASX_HOST_PYTHON`` set,
the Python functions stand alone (``kind()`` says which). The clock (``clock()`` says which): on
x86-64 Linux with an invariant TSC (constant_tsc and nonstop_tsc, tsc an available clock source;
``$BLASX_HOST_TSC=0`` turns it off) and CLOCK_MONOTONIC as perf_counter's clock, raw rdtsc stamps,
converted to perf_counter's seconds when the record is read (against a TSC / CLOCK_MONOTONIC pair
read then and one read at load: within ~10 ns plus the record's age times CLOCK_MONOTONIC's NTP
drift against the TSC, a few ppm); else CLOCK_MONOTONIC read in C, converted as CPython converts it
(Linux), else perf_counter called from C (two calls a call). The record reads as perf_counter's values.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import platform
import sys
import sysconfig
import time

import numpy as np

HOSTCALL_C = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#include "pythread.h"
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HC_HAVE_TSC 1
#include <x86intrin.h>
#else
#define HC_HAVE_TSC 0
#endif

typedef struct {
    PyObject_HEAD char *data; int nd; Py_ssize_t *dimensions; Py_ssize_t *strides;
    PyObject *base; PyObject *descr; int flags;
} hc_array;
#define HC_CONTIG 0x3                     /* NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_F_CONTIGUOUS */
#define HC_C 0x1
#define HC_F 0x2
#define HC_OWN 0x4                        /* NPY_ARRAY_OWNDATA */
#define HC_ALIGNED 0x100
#define HC_WRITE 0x400

enum { HC_MATMUL, HC_DOT, HC_GEMM, HC_LANE, HC_TENSORDOT };
enum { HC_FL_GEMM, HC_FL_SYMM, HC_FL_SYRK, HC_FL_SYR2K, HC_FL_TRI };

static PyTypeObject *hc_ndarray;
static PyObject *hc_descr[4];             /* float32, float64, complex64, complex128 */
static Py_ssize_t hc_itemsize[4] = {4, 8, 8, 16};
static PyObject *hc_session;              /* session.__dict__ */
static PyObject *hc_tls;                  /* level3.last_call: holds each thread's record guard (hc_guard) */
static PyObject *hc_clock;                /* time.perf_counter */
static PyObject *hc_scale;                /* level3.host_scale (set_scale); NULL: alpha-0 gemms go to Python */
static PyObject *hc_multiply;             /* np.multiply (set_scale): host_scale's complex products, called here */
static PyObject *s_order, *hc_kw_order, *hc_kw_out, *hc_F;
static int hc_native_clock, hc_any_strides, hc_tsc;
static PyObject *s_host_device, *s_T, *s_qualname, *s_out, *s_dtype, *s_casting, *s_axes, *hc_flag[3],
    *hc_zero;

/* the scipy-signature families (hostpath.LANES), by flop code: where each parameter is in the
   signature (names), -1 where the family has none */
typedef struct { int n, b, beta, c, f0, nf, ow; } hc_family;
static const hc_family hc_fam[5] = {
    {8, 2, 3, 4, 5, 2, 7},      /* gemm:  alpha a b beta c trans_a trans_b overwrite_c */
    {8, 2, 3, 4, 5, 2, 7},      /* symm:  alpha a b beta c side lower overwrite_c */
    {7, -1, 2, 3, 4, 2, 6},     /* syrk:  alpha a beta c trans lower overwrite_c */
    {8, 2, 3, 4, 5, 2, 7},      /* syr2k: alpha a b beta c trans lower overwrite_c */
    {8, 2, -1, -1, 3, 4, 7},    /* trmm:  alpha a b side lower trans_a diag overwrite_b */
};

/* a few types, borrowed from the frozenset a hc_call holds: a scan of pointers costs ~1 ns a type
   where a frozenset look-up costs ~6-15 ns */
#define HC_NTYPES 16
typedef struct { int n; PyObject *t[HC_NTYPES]; } hc_types;

static inline int hc_of_type(const hc_types *ts, PyObject *x) {
    PyObject *t = (PyObject *)Py_TYPE(x);
    int i;
    for (i = 0; i < ts->n; i++) if (ts->t[i] == t) return 1;
    return 0;
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    int kind, flops, nargs;
    PyObject *slow;       /* the Python function: every other call */
    PyObject *fn;         /* numpy's / scipy's function; GEMM: scipy's ?gemm per dtype (4-tuple) */
    PyObject *dtype;      /* LANE: the routine's dtype */
    PyObject *alpha;      /* LANE: frozenset of alpha's types; GEMM: one per dtype (4-tuple) */
    PyObject *flags;      /* LANE: keyword -> (frozenset of allowed ints, role 0/1/2) */
    PyObject *names;      /* LANE, GEMM: the parameter names in order; MATMUL: dtype= -> dtype (numpy_api._DTYPE_KW) */
    PyObject *beta;       /* LANE: frozenset of beta's types */
    int convert;          /* LANE: bit i: arrays of hc_descr[i] are converted (hostpath.CONVERTIBLE) */
    int di;               /* LANE: the index of dtype in hc_descr */
    hc_types types[4];    /* GEMM: alpha's (and beta's) types per dtype; LANE: [0] alpha's, [1] beta's */
    unsigned long fmask[4];   /* LANE: per flag of the family (names[f0 + j]): bit v: the int v allowed */
    void *f77;            /* LANE: scipy's routine itself (cython_blas), or NULL: its wrapper is called */
    int lists;            /* nested lists as operands are made arrays (matmul, dot, blasx.linalg.blas's lanes) */
    int frole[4];         /* LANE: per flag: its role (where hc_flags puts it) */
    PyObject *dict;
} hc_call;

/* time.perf_counter's value (a failed fallback call: -1.0 with the exception set) */
static double hc_now_python(void) {
    PyObject *t = PyObject_CallNoArgs(hc_clock);
    double d;
    if (t == NULL) return -1.0;
    d = PyFloat_AsDouble(t);
    Py_DECREF(t);
    return d;
}

/* CLOCK_MONOTONIC in perf_counter's seconds, converted as CPython converts it (int64 ns / 1e9:
   the same double) */
static inline double hc_mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)((int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec) / 1e9;
}

/* time.perf_counter's value now: CLOCK_MONOTONIC read here where that is perf_counter's clock,
   else perf_counter called. (CLOCK_MONOTONIC_COARSE would cost ~5 ns instead of ~22, at a
   resolution of 1-4 ms: a small call would end when it started.) */
static inline double hc_now(void) {
#if defined(__linux__)
    if (hc_native_clock) return hc_mono();
#endif
    return hc_now_python();
}
#define HC_NOW_FAILED(t) ((t) == -1.0 && PyErr_Occurred())

/* A call's start and end as the record keeps them: with hc_tsc (x86-64, an invariant TSC, and
   CLOCK_MONOTONIC perf_counter's clock) the raw time-stamp counter (rdtsc ~10 ns; a clock_gettime
   ~23 ns and its division), converted to perf_counter's seconds only when the record is read
   (hc_seconds); else perf_counter's value. rdtsc is not ordered with the instructions around it:
   a few ns either way on a call of ~0.5 us or more. */
typedef union { double s; uint64_t tick; } hc_stamp;

static inline int hc_stamp_now(hc_stamp *t) {
#if HC_HAVE_TSC
    if (hc_tsc) { t->tick = __rdtsc(); return 0; }
#endif
    t->s = hc_now();
    return HC_NOW_FAILED(t->s) ? -1 : 0;
}

#if HC_HAVE_TSC
/* The TSC against CLOCK_MONOTONIC: one pair read at load (hc_cal_*), one when a record is read; a
   tick is then (m - m0) / (k - k0) seconds over a baseline of >= 2 ms (at most 2 ms spent waiting
   once, where a record is read that early), and a stamp k' is m - (k - k') * that. Its error: the
   pairs' read skew (each pair the tightest of 3 reads, <~10 ns) plus the record's age times the
   drift of CLOCK_MONOTONIC's rate (NTP slew) against its mean since load, a few ppm: ns for a
   record read within a ms of its call; a duration t1 - t0 within the same ppm. */
static uint64_t hc_cal_tick;
static double hc_cal_mono;
#define HC_CAL_MIN 2e-3

static void hc_pair(uint64_t *tick, double *mono) {
    uint64_t a, b, best = UINT64_MAX;
    double m;
    int i;
    for (i = 0; i < 3; i++) {
        _mm_lfence(); a = __rdtsc(); _mm_lfence();
        m = hc_mono();
        _mm_lfence(); b = __rdtsc(); _mm_lfence();
        if (b - a < best) { best = b - a; *tick = a + (b - a) / 2; *mono = m; }
    }
}

/* the stamps t[0..n) in perf_counter's seconds, in place */
static void hc_seconds(hc_stamp *t, int n) {
    uint64_t k;
    double m, per;
    int i;
    hc_pair(&k, &m);
    while (m - hc_cal_mono < HC_CAL_MIN) hc_pair(&k, &m);
    per = (m - hc_cal_mono) / (double)(k - hc_cal_tick);
    for (i = 0; i < n; i++) t[i].s = m - (double)(int64_t)(k - t[i].tick) * per;
}
#endif

PyObject *blasx_hc_now(void) {
    double t = hc_now();
    return HC_NOW_FAILED(t) ? NULL : PyFloat_FromDouble(t);
}

/* This thread's last call taken here, kept as C values in thread-local storage: no Python object
   is made, and no attribute set, per call (the tuple and the setattr on level3.last_call cost
   ~0.13 us of a ~0.2 us floor). Which of it and the Python paths' record (level3.last_call.stats)
   is the thread's last call is kept in program order, not read from the clocks (a stamp converted
   from the TSC may be off by some ns, and two calls can end within that): a call here marks the
   record fresh; the Python paths read the end of their call through hc_end, which marks it stale,
   right before they write their record; blasx.level3.last_record takes a fresh record (hc_take:
   it becomes last_call.stats, and stale here).

   The device is held by a guard object in this thread's level3.last_call (attribute c_guard, set
   on the thread's first call here; it takes the new device when the device changes): a record
   lives as long as the thread's last_call, as the Python paths' records do, and a thread that
   ends drops its device with its last_call (threading.local clears a thread's attributes in that
   thread). A guard released in another thread (a thread state cleared by another: other threads'
   at exit, and in a child after fork) cannot tell whether its thread still points at it: it keeps
   its memory and its device (a small leak, there only), so that no record ever points at freed
   memory. */
typedef struct {
    PyObject_HEAD
    PyObject *dev;            /* the device of its thread's record (a reference) */
    unsigned long owner;      /* PyThread_get_thread_ident() of its thread */
} hc_guard;

typedef struct {
    PyObject *dev;            /* borrowed from guard->dev; NULL: no record */
    hc_guard *guard;          /* borrowed from this thread's last_call; NULL: none */
    hc_stamp t0, t1;          /* the call's start and end (hc_stamp_now) */
    double flops;             /* real flops */
    int di;                   /* the dtype: an index in hc_descr */
    int fresh;                /* newer than the Python paths' record (see above) */
} hc_rec;

static _Thread_local hc_rec hc_last;
static PyObject *s_guard;

static void hc_guard_dealloc(PyObject *obj) {
    hc_guard *g = (hc_guard *)obj;
    hc_rec *r;
    if (g->owner != PyThread_get_thread_ident()) return;   /* kept (see above) */
    r = &hc_last;
    if (r->guard == g) { r->guard = NULL; r->dev = NULL; }   /* the thread's last_call let it go */
    Py_XDECREF(g->dev);
    PyObject_Free(obj);
}

static PyTypeObject hc_guard_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "blasx.hostcall_record",
    .tp_basicsize = sizeof(hc_guard),
    .tp_dealloc = hc_guard_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Holds the device of this thread's last call taken by blasx's C entry points.",
};

/* r's guard (made, and set on this thread's last_call, where r has none) takes dev */
static int hc_adopt(hc_rec *r, PyObject *dev) {
    hc_guard *g;
    PyObject *old;
    if (r->guard == NULL) {
        r->dev = NULL;
        g = PyObject_New(hc_guard, &hc_guard_type);
        if (g == NULL) return -1;
        g->dev = NULL;
        g->owner = PyThread_get_thread_ident();
        r->guard = g;   /* (first: a guard this one replaces on last_call is not r's) */
        if (PyObject_SetAttr(hc_tls, s_guard, (PyObject *)g) < 0) {
            r->guard = NULL;
            Py_DECREF(g);
            return -1;
        }
        Py_DECREF(g);   /* last_call holds it */
        if (r->guard != g) return 0;   /* (dropped at once by code the setattr ran: no record) */
    }
    g = r->guard;
    Py_INCREF(dev);
    old = g->dev;
    g->dev = dev; r->dev = dev;
    Py_XDECREF(old);   /* last: freeing a device may run Python code */
    return 0;
}

/* the call that ran from t0 until now becomes this thread's record */
static inline int hc_record(PyObject *dev, hc_stamp t0, int di, double flops) {
    hc_rec *r = &hc_last;
    hc_stamp t1;
    if (hc_stamp_now(&t1) < 0) return -1;
    if (r->dev != dev && hc_adopt(r, dev) < 0) return -1;
    r->t0 = t0; r->t1 = t1; r->flops = flops; r->di = di; r->fresh = 1;
    return 0;
}

/* level3.last_record's question: this thread's record as (dev, t0, t1, dtype, real flops), t0 and
   t1 on perf_counter's clock, when it is newer than the Python paths' record (then it is taken:
   the caller keeps it as that record), else None */
static PyObject *hc_take(PyObject *unused, PyObject *unused2) {
    hc_rec *r = &hc_last;
    hc_stamp t[2];
    if (r->dev == NULL || !r->fresh) Py_RETURN_NONE;
    r->fresh = 0;
    t[0] = r->t0; t[1] = r->t1;
#if HC_HAVE_TSC
    if (hc_tsc) hc_seconds(t, 2);
#endif
    return Py_BuildValue("(OddOd)", r->dev, t[0].s, t[1].s, hc_descr[r->di], r->flops);
}

/* the Python paths' clock for the end of a call, read right before they write their record:
   perf_counter's value now (as hc_now), and this thread's C record is older than that record */
static PyObject *hc_end(PyObject *unused, PyObject *unused2) {
    double t;
    hc_last.fresh = 0;
    t = hc_now();
    return HC_NOW_FAILED(t) ? NULL : PyFloat_FromDouble(t);
}

static PyMethodDef hc_take_def = {
    "take_record", hc_take, METH_NOARGS,
    "take_record(): this thread's last call taken by blasx's C entry points, (device, t0, t1, dtype, "
    "real flops), if it is newer than level3.last_call.stats (it is then taken), else None."};
static PyMethodDef hc_end_def = {
    "end_clock", hc_end, METH_NOARGS,
    "end_clock(): time.perf_counter(), for the end of a call whose record level3.last_call.stats is "
    "about to take: this thread's record of blasx's C entry points is then older."};

/* the index of an ndarray's descr in hc_descr (one of them) */
static inline int hc_index(PyObject *descr) {
    int i;
    for (i = 0; i < 3 && hc_descr[i] != descr; i++) ;
    return i;
}

#if PY_VERSION_HEX >= 0x030C0000
/* Python >= 3.12: session.host_device cached, kept right by a dict watcher on the session's dict,
   which runs before any change of that key (or of the whole dict) and drops the cache: the
   borrowed pointer is only used while the dict still holds it. Without a free watcher (8 per
   interpreter), the look-up every call. */
static int hc_watcher = -1;
static int hc_cached;                     /* hc_cache holds the dict's value (NULL: no such key) */
static PyObject *hc_cache;                /* borrowed from hc_session */

static int hc_session_changed(PyDict_WatchEvent event, PyObject *dict, PyObject *key, PyObject *new_value) {
    if (dict == hc_session && (key == NULL || key == s_host_device
                               || (PyUnicode_Check(key) && PyUnicode_Compare(key, s_host_device) == 0)))
        hc_cached = 0;
    return 0;
}

static void hc_watch(PyObject *session_dict) {
    hc_cached = 0;
    if (hc_watcher < 0) hc_watcher = PyDict_AddWatcher(hc_session_changed);
    if (hc_watcher < 0 || PyDict_Watch(hc_watcher, session_dict) < 0) { PyErr_Clear(); hc_watcher = -1; }
}
#endif

/* session.host_device (a new reference), or NULL when the CPU is not the only device */
static PyObject *hc_device(void) {
    PyObject *d;
#if PY_VERSION_HEX >= 0x030C0000
    if (hc_cached) d = hc_cache;
    else {
        d = PyDict_GetItemWithError(hc_session, s_host_device);
        if (d == NULL && PyErr_Occurred()) { PyErr_Clear(); return NULL; }
        if (hc_watcher >= 0) { hc_cache = d; hc_cached = 1; }
    }
#else
    d = PyDict_GetItemWithError(hc_session, s_host_device);
#endif
    if (d == NULL || d == Py_None) { PyErr_Clear(); return NULL; }
    Py_INCREF(d);
    return d;
}

static int hc_dtype(PyObject *x) {        /* index of x's dtype for an exact ndarray of a BLAS type, else -1 */
    int i;
    if (Py_TYPE(x) != hc_ndarray) return -1;
    for (i = 0; i < 4; i++) if (((hc_array *)x)->descr == hc_descr[i]) return i;
    return -1;
}

static double hc_size(PyObject *x) {      /* elements of an ndarray; 1 for a numpy scalar */
    double s = 1.0;
    int d;
    if (!PyObject_TypeCheck(x, hc_ndarray)) return 1.0;
    for (d = 0; d < ((hc_array *)x)->nd; d++) s *= (double)((hc_array *)x)->dimensions[d];
    return s;
}

#define HC_INT_MAX 2147483647

/* numpy's is_blasable2d: a matrix of d1 x d2 with byte strides s1, s2 BLAS reads row-major, leading
   dimension s1 / itemsize */
static inline int hc_blasable(Py_ssize_t s1, Py_ssize_t s2, Py_ssize_t d2, Py_ssize_t sz) {
    return s2 == sz && s1 % sz == 0 && s1 / sz >= d2 && s1 / sz <= HC_INT_MAX;
}

/* numpy's matmul runs BLAS on x as it is: numpy's is_blasable2d on the last two dimensions */
static int hc_blas_ready(hc_array *x, Py_ssize_t sz) {
    Py_ssize_t s0, s1, d0, d1;
    if (hc_any_strides || (x->flags & HC_CONTIG)) return 1;
    if (x->nd == 1) return x->strides[0] == sz;
    if (x->nd < 2) return 0;
    s0 = x->strides[x->nd - 2]; s1 = x->strides[x->nd - 1];
    d0 = x->dimensions[x->nd - 2]; d1 = x->dimensions[x->nd - 1];
    return hc_blasable(s0, s1, d1, sz) || hc_blasable(s1, s0, d0, sz);
}

/* fn(*args, **kw) as one host call: timed and recorded; steals dev */
static PyObject *hc_run(PyObject *fn, PyObject *const *args, size_t nargsf, PyObject *kwnames, PyObject *dev,
                        int di, double flops, PyObject *x1) {
    PyObject *res = NULL;
    hc_stamp t0;
    if (hc_stamp_now(&t0) == 0) {
        res = PyObject_Vectorcall(fn, args, nargsf, kwnames);
        if (res != NULL) {
            if (flops < 0.0)    /* matmul: from the result */
                flops = 2.0 * hc_size(res) * (double)((hc_array *)x1)->dimensions[((hc_array *)x1)->nd - 1];
            if (hc_record(dev, t0, di, flops) < 0) Py_CLEAR(res);
        }
    }
    Py_DECREF(dev);
    return res;
}

/* ---- Direct BLAS: the plain 2-D products call numpy's / scipy's own gemm (blasx._blas_symbols)

   numpy's matmul and dot cost ~0.7 us around their BLAS call (the ufunc / dot machinery), scipy's
   ?gemm ~0.25 (f2py's parsing); a 16 x 16 product itself ~0.3. For the calls below the C code
   calls the routine they would call, with the arguments they would pass, into an array made as
   theirs is: the same bits (checked when the library loads, _hostcall._direct_ok), in 0.3-0.7 us
   less. A NULL pointer leaves that family to numpy's / scipy's function.

   * matmul(a, b), dot(a, b): 2-D exact ndarrays of one BLAS dtype, aligned, each C- or
     F-contiguous, every dimension >= 2 (numpy's gemv / dot cases are others), not one buffer
     (numpy's syrk case: a @ a.T); numpy's cblas_?gemm row-major, an F-ordered operand transposed
     (numpy's matmul and dot both call it so), into a new C-ordered array. Both check the
     floating-point status after the call (the warnings of np.errstate): a flag raised here hands
     the call to numpy's function, which computes it again and warns or raises as numpy does.
   * ?gemm with no c, with c written in place (hc_gemm's HC_C_NONE / HC_C_IN_PLACE(_T)) or c
     copied (HC_C_COPY): aligned C-ordered operands transposed (blasx.gemm's own rule), the others
     as scipy's wrapper takes them (hc_as_fortran), alpha / beta converted as f2py converts them;
     into a new F-ordered array (f2py's zeros: beta is 0, so C is not read), into c, or into the
     wrapper's copy of c.
   * the scipy-signature routines (both lanes): hc_f77_call, below, with each lane's own routine.

   The GIL is let go for products of m n k >= HC_NOGIL (numpy's matmul lets it go for all; a
   16 x 16 product would pay ~0.1 us for it). */
#include <fenv.h>
#include <string.h>
#define HC_FE (FE_DIVBYZERO | FE_OVERFLOW | FE_UNDERFLOW | FE_INVALID)
#define HC_NOGIL 262144.0
typedef PyObject *(*hc_new_fn)(PyTypeObject *, PyObject *, int, const Py_ssize_t *, const Py_ssize_t *, void *, int,
                               PyObject *);
typedef void (*hc_cblas_s)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, const void *, int64_t,
                           const void *, int64_t, float, void *, int64_t);
typedef void (*hc_cblas_d)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, const void *, int64_t,
                           const void *, int64_t, double, void *, int64_t);
typedef void (*hc_cblas_c)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const void *, const void *, int64_t,
                           const void *, int64_t, const void *, void *, int64_t);
typedef void (*hc_f77_fn)(char *, char *, int *, int *, int *, void *, void *, int *, void *, int *, void *, void *,
                          int *);
typedef int (*hc_copy_into_fn)(PyObject *, PyObject *);
typedef PyObject *(*hc_from_any_fn)(PyObject *, PyObject *, int, int, int, PyObject *);
static hc_new_fn hc_new_array;            /* numpy's PyArray_NewFromDescr */
static hc_copy_into_fn hc_copy_into;      /* numpy's PyArray_CopyInto */
static hc_from_any_fn hc_from_any;        /* numpy's PyArray_FromAny */
static void *hc_cblas[4];                 /* numpy's cblas_?gemm, by dtype; NULL: no direct matmul / dot */
static void *hc_f77[4];                   /* scipy's ?gemm (scipy.linalg.cython_blas), by dtype; NULL: none */
static unsigned long long hc_direct_calls;   /* direct calls made (with the GIL held: no race), for tests */
static const float hc_one_c[2] = {1.0f, 0.0f}, hc_zero_c[2] = {0.0f, 0.0f};
static const double hc_one_z[2] = {1.0, 0.0}, hc_zero_z[2] = {0.0, 0.0};
enum { HC_ROW_MAJOR = 101, HC_NO_TRANS = 111, HC_TRANS = 112 };

/* a new m x n array of hc_descr[i], C- or F-ordered (fortran) */
static PyObject *hc_empty(int i, Py_ssize_t m, Py_ssize_t n, int fortran) {
    Py_ssize_t d[2] = {m, n};
    Py_INCREF(hc_descr[i]);   /* (stolen) */
    return hc_new_array(hc_ndarray, hc_descr[i], 2, d, NULL, NULL, fortran, NULL);
}

static int hc_may_share(hc_array *x, hc_array *y);

/* an operand or an output numpy's matmul hands BLAS as it is: 2-D, aligned, dimensions 2..INT_MAX,
   blasable row- or column-major (contiguous only: numpy's dot copies the others) */
static int hc_copies[2];                  /* [0] matmul, [1] dot: operands numpy copies first are copied here
                                             too, 1: to C order, 2: to the order nearest their strides (F
                                             where the row stride is the smaller); 0: not (_copies_ok
                                             finds which gives numpy's bits) */

/* an operand or an output as numpy's matmul (matmul) / dot hands it to BLAS: 2-D, aligned, dimensions
   2..INT_MAX; 1: as it is (matmul: blasable row- or column-major; dot: contiguous), 2: a C-ordered
   copy of it (what numpy copies, where hc_copies says numpy does), 0: neither */
static inline int hc_plain(hc_array *x, int i, int matmul) {
    Py_ssize_t sz = hc_itemsize[i];
    if (x->nd != 2 || !(x->flags & HC_ALIGNED) || x->dimensions[0] < 2 || x->dimensions[1] < 2
            || x->dimensions[0] > HC_INT_MAX || x->dimensions[1] > HC_INT_MAX)
        return 0;
    if (matmul ? hc_blasable(x->strides[0], x->strides[1], x->dimensions[1], sz)
                 || hc_blasable(x->strides[1], x->strides[0], x->dimensions[0], sz)
               : (x->flags & HC_CONTIG) != 0)
        return 1;
    return hc_copies[!matmul] ? 2 : 0;
}

/* numpy's @TYPE@_matmul_matrixmatrix: op (m x p, row stride os_m) = ip1 (m x n) ip2 (n x p) through
   numpy's cblas_?gemm, row-major, an operand that is not row-major blasable transposed; the
   floating-point flags raised (those raised before are cleared first: numpy's order; testing is
   cheap where clearing is not) */
static int hc_cblas_mm(int i, char *ip1, Py_ssize_t is1_m, Py_ssize_t is1_n, char *ip2, Py_ssize_t is2_n,
                       Py_ssize_t is2_p, char *op, Py_ssize_t os_m, Py_ssize_t m, Py_ssize_t n, Py_ssize_t p) {
    Py_ssize_t sz = hc_itemsize[i];
    int64_t ta = HC_NO_TRANS, tb = HC_NO_TRANS, lda = is1_m / sz, ldb = is2_n / sz, ldc = os_m / sz;
    PyThreadState *ts;
    int fe;
    if (!hc_blasable(is1_m, is1_n, n, sz)) { ta = HC_TRANS; lda = is1_n / sz; }
    if (!hc_blasable(is2_n, is2_p, p, sz)) { tb = HC_TRANS; ldb = is2_p / sz; }
    if (fetestexcept(HC_FE)) feclearexcept(HC_FE);
    hc_direct_calls++;
    ts = (double)m * (double)n * (double)p >= HC_NOGIL ? PyEval_SaveThread() : NULL;
    switch (i) {
    case 0: ((hc_cblas_s)hc_cblas[0])(HC_ROW_MAJOR, ta, tb, m, p, n, 1.0f, ip1, lda, ip2, ldb, 0.0f, op, ldc); break;
    case 1: ((hc_cblas_d)hc_cblas[1])(HC_ROW_MAJOR, ta, tb, m, p, n, 1.0, ip1, lda, ip2, ldb, 0.0, op, ldc); break;
    case 2: ((hc_cblas_c)hc_cblas[2])(HC_ROW_MAJOR, ta, tb, m, p, n, hc_one_c, ip1, lda, ip2, ldb, hc_zero_c, op, ldc); break;
    default: ((hc_cblas_c)hc_cblas[3])(HC_ROW_MAJOR, ta, tb, m, p, n, hc_one_z, ip1, lda, ip2, ldb, hc_zero_z, op, ldc); break;
    }
    fe = fetestexcept(HC_FE);
    if (ts != NULL) PyEval_RestoreThread(ts);
    return fe;
}

/* the product a b into out (row- or column-major blasable; numpy's matmul writes a column-major one
   as matmul(b.T, a.T, out.T)); the floating-point flags raised */
static int hc_cblas_into(int i, hc_array *a, hc_array *b, hc_array *out) {
    Py_ssize_t m = a->dimensions[0], n = a->dimensions[1], p = b->dimensions[1];
    if (hc_blasable(out->strides[0], out->strides[1], p, hc_itemsize[i]))
        return hc_cblas_mm(i, a->data, a->strides[0], a->strides[1], b->data, b->strides[0], b->strides[1],
                           out->data, out->strides[0], m, n, p);
    return hc_cblas_mm(i, b->data, b->strides[1], b->strides[0], a->data, a->strides[1], a->strides[0],
                       out->data, out->strides[1], p, n, m);
}

/* matmul(a, b[, out]) / dot(a, b[, out]) where numpy's function makes one cblas_?gemm call that
   hc_product_into makes too (operands as hc_plain takes them; out as it is, C-ordered for dot): a
   and b 2-D exact ndarrays of dtype i, not one buffer (numpy's syrk, a @ a.T), every dimension >= 2
   (numpy's gemv and dot cases); out (NULL: a new C-ordered array) an exact ndarray of dtype i of
   their product's shape, writable, that shares no memory with them. 0: another call */
static int hc_product_ready(PyObject *const *args, PyObject *out, int i, int matmul) {
    hc_array *a = (hc_array *)args[0], *b = (hc_array *)args[1], *o = (hc_array *)out;
    if (hc_cblas[i] == NULL || !hc_plain(a, i, matmul) || !hc_plain(b, i, matmul)
            || a->dimensions[1] != b->dimensions[0] || a->data == b->data)
        return 0;
    return out == NULL || (Py_TYPE(out) == hc_ndarray && o->descr == hc_descr[i] && (o->flags & HC_WRITE)
                           && hc_plain(o, i, matmul) == 1 && (matmul || (o->flags & HC_C))
                           && o->dimensions[0] == a->dimensions[0] && o->dimensions[1] == b->dimensions[1]
                           && !hc_may_share(o, a) && !hc_may_share(o, b));
}

/* a new C- or F-ordered (fortran) 2-D array of dtype i with x's values: numpy's PyArray_CopyInto (its
   cast), a memcpy where x is of that type and order already; NULL: numpy's error */
static PyObject *hc_copy(hc_array *x, int i, int fortran) {
    PyObject *res = hc_empty(i, x->dimensions[0], x->dimensions[1], fortran);
    if (res == NULL) return NULL;
    if (x->descr == hc_descr[i] && (x->flags & (fortran ? HC_F : HC_C)))
        memcpy(((hc_array *)res)->data, x->data, (size_t)(x->dimensions[0] * x->dimensions[1] * hc_itemsize[i]));
    else if (hc_copy_into(res, (PyObject *)x) < 0)
        Py_CLEAR(res);
    return res;
}

/* x, or its copy (hc_copies' order) where hc_plain says numpy copies it (new reference; NULL: numpy's error) */
static PyObject *hc_operand(hc_array *x, int i, int matmul) {
    if (hc_plain(x, i, matmul) != 2) { Py_INCREF((PyObject *)x); return (PyObject *)x; }
    return hc_copy(x, i, hc_copies[!matmul] == 2 && Py_ABS(x->strides[0]) < Py_ABS(x->strides[1]));
}

/* the product of a and b (hc_product_ready's) into out: the floating-point flags raised, -1: an error */
static int hc_product_into(int i, hc_array *a, hc_array *b, hc_array *out, int matmul) {
    PyObject *x = hc_operand(a, i, matmul), *y = x == NULL ? NULL : hc_operand(b, i, matmul);
    int fe = -1;
    if (y != NULL) fe = hc_cblas_into(i, (hc_array *)x, (hc_array *)y, out);
    Py_XDECREF(x); Py_XDECREF(y);
    return fe;
}

/* the call hc_product_ready took, timed and recorded: out, or a new array; a floating-point flag
   raised hands the call to numpy's function fn (computed again: numpy's warnings and errors); steals dev */
static PyObject *hc_product(PyObject *fn, PyObject *const *args, size_t nargsf, PyObject *kwnames, PyObject *out,
                            int i, PyObject *dev, int matmul) {
    hc_array *a = (hc_array *)args[0], *b = (hc_array *)args[1];
    PyObject *res;
    hc_stamp t0;
    int fe;
    if (hc_stamp_now(&t0) < 0) { Py_DECREF(dev); return NULL; }
    if (out != NULL) { Py_INCREF(out); res = out; }
    else if ((res = hc_empty(i, a->dimensions[0], b->dimensions[1], 0)) == NULL) { Py_DECREF(dev); return NULL; }
    if ((fe = hc_product_into(i, a, b, (hc_array *)res, matmul)) < 0) { Py_DECREF(res); Py_DECREF(dev); return NULL; }
    if (fe) {
        Py_DECREF(res);
        feclearexcept(HC_FE);
        return hc_run(fn, args, nargsf, kwnames, dev, i, -1.0, args[0]);
    }
    if (hc_record(dev, t0, i, 2.0 * (double)a->dimensions[0] * (double)b->dimensions[1] * (double)a->dimensions[1]) < 0)
        Py_CLEAR(res);
    Py_DECREF(dev);
    return res;
}

/* a scalar as f2py converts it for a routine of dtype i (a double, or a complex pair, cast to float for
   s / c): through float() (f2py's double_from_pyobj: a Python float as it is, anything else by
   PyNumber_Float), complex() for c / z (complex_double_from_pyobj: numpy's complex scalars by
   value, real numbers with imaginary part 0), for the types the callers took (hc_of_type: Python's
   and numpy's numbers); 0: it cannot be converted (f2py raises: the wrapper's error then) */
static int hc_scalar(PyObject *x, int i, double v[2]) {
    if (PyFloat_CheckExact(x)) { v[0] = PyFloat_AS_DOUBLE(x); v[1] = 0.0; return 1; }
    if (i < 2) {
        v[0] = PyFloat_AsDouble(x); v[1] = 0.0;
        if (v[0] == -1.0 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
    } else {
        Py_complex z = PyComplex_AsCComplex(x);
        if (z.real == -1.0 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
        v[0] = z.real; v[1] = z.imag;
    }
    return 1;
}

/* alpha and beta as a routine of dtype i reads them (hc_scalar's values; floats for s and c): *pa and
   *pb point into v; 0: hc_scalar's 0 */
typedef struct { double d[2][2]; float f[2][2]; } hc_scalars;
static int hc_scalars_of(PyObject *alpha, PyObject *beta, int i, hc_scalars *v, void **pa, void **pb) {
    int j;
    if (!hc_scalar(alpha, i, v->d[0]) || !hc_scalar(beta, i, v->d[1])) return 0;
    if (i == 1 || i == 3) { *pa = v->d[0]; *pb = v->d[1]; return 1; }
    for (j = 0; j < 2; j++) { v->f[j][0] = (float)v->d[j][0]; v->f[j][1] = (float)v->d[j][1]; }
    *pa = v->f[0]; *pb = v->f[1];
    return 1;
}

/* x as scipy's f2py wrapper hands it to BLAS (numpy's f2py, ndarray_from_pyobj): x itself where it is
   an aligned F-contiguous array of dtype i (and no copy is asked: intent(in,out,copy) arrays are
   copied), else a new F-ordered array of dtype i with x's values (the wrapper's PyArray_NewFromDescr
   and PyArray_CopyInto: numpy's cast; a plain copy of an F-ordered array of that type with memcpy);
   a new reference; NULL: numpy's error */
static PyObject *hc_as_fortran(hc_array *x, int i, int copy) {
    if (!copy && x->descr == hc_descr[i] && (x->flags & HC_F) && (x->flags & HC_ALIGNED)) {
        Py_INCREF((PyObject *)x);
        return (PyObject *)x;
    }
    return hc_copy(x, i, 1);
}

static inline int hc_fits(hc_array *x) {   /* a 2-D array whose dimensions BLAS's int holds */
    return x->nd == 2 && x->dimensions[0] <= HC_INT_MAX && x->dimensions[1] <= HC_INT_MAX;
}

/* blasx.gemm's operand x for scipy's ?gemm: an aligned C-ordered one (not with op C) as its F-ordered
   transpose x.T, op N <-> T (level3._host_gemm's choice), else as scipy's wrapper takes x
   (hc_as_fortran; *copied: 1 where that is a copy); its F-ordered rows and columns, op in *op */
static int hc_gemm_operand(hc_array *x, long *op, Py_ssize_t *rows, Py_ssize_t *cols, int *transposed) {
    *transposed = !(x->flags & HC_F) && (x->flags & HC_C) && (x->flags & HC_ALIGNED) && *op != 2;
    if (*transposed) { *rows = x->dimensions[1]; *cols = x->dimensions[0]; *op = 1 - *op; }
    else { *rows = x->dimensions[0]; *cols = x->dimensions[1]; }
    return hc_fits(x);
}

/* scipy's ?gemm(alpha, a, b, beta, c, ta, tb) as its wrapper calls BLAS (operands by hc_gemm_operand),
   with c None (a new F-ordered result), c written in place (an F-ordered c, or c.T's view for a
   C-ordered c: transposed_c) or copied first (copy_c: the wrapper's copy, hc_as_fortran); NULL
   without an exception: not such a call (the caller then calls scipy's); recorded on dev (NULL: not) */
static PyObject *hc_f77_gemm(int i, PyObject *alpha, PyObject *beta, hc_array *a, hc_array *b, long ta, long tb,
                             PyObject *cobj, int transposed_c, int copy_c, PyObject *dev) {
    static char ops[3] = {'N', 'T', 'C'};
    Py_ssize_t ra, ca, rb, cb, mm, nn, kk;
    int m, n, k, lda, ldb, ldc, tra, trb;
    hc_scalars sc;
    void *pa, *pb;
    char opa, opb;
    PyObject *res = NULL, *x = NULL, *y = NULL;
    hc_stamp t0;
    if (hc_f77[i] == NULL || !hc_scalars_of(alpha, beta, i, &sc, &pa, &pb)
            || !hc_gemm_operand(a, &ta, &ra, &ca, &tra) || !hc_gemm_operand(b, &tb, &rb, &cb, &trb))
        return NULL;
    mm = ta ? ca : ra; kk = ta ? ra : ca; nn = tb ? rb : cb;
    if (kk != (tb ? cb : rb) || !mm || !nn || !kk) return NULL;
    if (cobj != Py_None) {
        hc_array *c = (hc_array *)cobj;
        if ((transposed_c ? c->dimensions[1] : c->dimensions[0]) != mm
                || (transposed_c ? c->dimensions[0] : c->dimensions[1]) != nn)
            return NULL;
    }
    m = (int)mm; n = (int)nn; k = (int)kk;
    lda = ra > 1 ? (int)ra : 1; ldb = rb > 1 ? (int)rb : 1; ldc = m > 1 ? m : 1;
    opa = ops[ta]; opb = ops[tb];
    if (dev != NULL && hc_stamp_now(&t0) < 0) return NULL;
    /* (a transposed operand is read where it is; the others as the wrapper takes them) */
    if (tra) { Py_INCREF((PyObject *)a); x = (PyObject *)a; } else x = hc_as_fortran(a, i, 0);
    if (x != NULL) { if (trb) { Py_INCREF((PyObject *)b); y = (PyObject *)b; } else y = hc_as_fortran(b, i, 0); }
    if (x != NULL && y != NULL) {
        if (cobj == Py_None) res = hc_empty(i, mm, nn, 1);
        else if (copy_c) res = hc_as_fortran((hc_array *)cobj, i, 1);
        else { Py_INCREF(cobj); res = cobj; }
    }
    if (res != NULL) {
        PyThreadState *ts;
        hc_direct_calls++;
        ts = (double)mm * (double)nn * (double)kk >= HC_NOGIL ? PyEval_SaveThread() : NULL;
        ((hc_f77_fn)hc_f77[i])(&opa, &opb, &m, &n, &k, pa, ((hc_array *)x)->data, &lda, ((hc_array *)y)->data, &ldb,
                               pb, ((hc_array *)res)->data, &ldc);
        if (ts != NULL) PyEval_RestoreThread(ts);
        if (dev != NULL && hc_record(dev, t0, i, 2.0 * (double)mm * (double)nn * (double)kk) < 0) Py_CLEAR(res);
    }
    Py_XDECREF(x); Py_XDECREF(y);
    return res;
}

/* HC_GEMM_ALPHA0: a ?gemm with alpha 0 is never handed to the host BLAS; hc_alpha0 makes C = beta C
   through level3.host_scale instead, as the Python function's host path does. BLAS says A and B are
   then not read, but some OpenBLAS builds (scipy's wheels on the GPU hosts, 2026-11-23) still
   multiply them: a NaN in A or B leaked into C. */

/* alpha's truth value (PyObject_IsTrue; a float's inline: a call through the PLT costs more) */
static inline int hc_truth(PyObject *x) {
    return PyFloat_CheckExact(x) ? PyFloat_AS_DOUBLE(x) != 0.0 : PyObject_IsTrue(x);
}

/* an alpha-0 gemm (HC_GEMM_ALPHA0): host_scale(beta, c or None, in_place, (m, n), dtype), recorded with
   no flops as the Python paths record it; steals dev. NULL without an error when no host_scale is set */
/* host_scale's C = beta C for a real type (one IEEE product an element, as numpy's multiply; beta 0:
   zeros, c not read) of a C- or F-contiguous c of that type, in place or into a new F-ordered
   array; beta a Python / numpy float, or an int float32 holds exactly (dtype.type(beta) rounds
   once). Py_None: not such a call; NULL: an error. The caller stamps t0 first (hc_stamp_now). */
static PyObject *hc_scale_real(int di, PyObject *beta, PyObject *cobj, int in_place, Py_ssize_t m, Py_ssize_t n) {
    hc_array *c = (hc_array *)cobj, *out;
    PyObject *res;
    double bv;
    Py_ssize_t r, q, len = m * n;
    int fortran;
    if (Py_TYPE(cobj) != hc_ndarray || c->descr != hc_descr[di] || !(c->flags & HC_CONTIG) || !(c->flags & HC_ALIGNED)
            || c->nd != 2 || c->dimensions[0] != m || c->dimensions[1] != n)
        Py_RETURN_NONE;
    if (PyFloat_Check(beta)) bv = PyFloat_AS_DOUBLE(beta);
    else if (PyLong_CheckExact(beta)) {
        long v = PyLong_AsLong(beta);
        if ((v == -1 && PyErr_Occurred()) || v > (1L << 24) || v < -(1L << 24)) { PyErr_Clear(); Py_RETURN_NONE; }
        bv = (double)v;
    } else Py_RETURN_NONE;
    fortran = (c->flags & HC_F) != 0;
    if (in_place) { Py_INCREF(cobj); res = cobj; }
    else if ((res = hc_empty(di, m, n, 1)) == NULL) return NULL;
    out = (hc_array *)res;
    if (bv == 0.0) memset(out->data, 0, (size_t)(len * hc_itemsize[di]));
    else if (di == 0) {
        float b = (float)bv, *x = (float *)c->data, *y = (float *)out->data;
        if (in_place || fortran) for (r = 0; r < len; r++) y[r] = b * x[r];
        else for (r = 0; r < m; r++) for (q = 0; q < n; q++) y[r + q * m] = b * x[r * n + q];
    } else {
        double *x = (double *)c->data, *y = (double *)out->data;
        if (in_place || fortran) for (r = 0; r < len; r++) y[r] = bv * x[r];
        else for (r = 0; r < m; r++) for (q = 0; q < n; q++) y[r + q * m] = bv * x[r * n + q];
    }
    return res;
}

/* host_scale's C = beta C for a complex type, its very calls of np.multiply (c * beta into a new F-ordered
   array, or c *= beta), for a C- or F-contiguous c of that type and beta a Python number (numpy casts it
   to c's type, as host_scale's dtype.type(beta); a numpy scalar would promote: host_scale's); beta 0:
   zeros, c not read. Py_None: not such a call; NULL: an error */
static PyObject *hc_scale_complex(int di, PyObject *beta, PyObject *cobj, int in_place, Py_ssize_t m, Py_ssize_t n) {
    hc_array *c = (hc_array *)cobj;
    PyObject *call[3] = {cobj, beta, in_place ? cobj : hc_F}, *res;
    Py_complex z;
    if (Py_TYPE(cobj) != hc_ndarray || c->descr != hc_descr[di] || !(c->flags & HC_CONTIG) || !(c->flags & HC_ALIGNED)
            || c->nd != 2 || c->dimensions[0] != m || c->dimensions[1] != n
            || !(PyFloat_CheckExact(beta) || PyComplex_CheckExact(beta) || PyLong_CheckExact(beta)))
        Py_RETURN_NONE;
    z = PyComplex_AsCComplex(beta);
    if (z.real == -1.0 && PyErr_Occurred()) { PyErr_Clear(); Py_RETURN_NONE; }
    if (z.real == 0.0 && z.imag == 0.0) {
        if (in_place) { Py_INCREF(cobj); res = cobj; }
        else if ((res = hc_empty(di, m, n, 1)) == NULL) return NULL;
        memset(((hc_array *)res)->data, 0, (size_t)(m * n * hc_itemsize[di]));
        return res;
    }
    return PyObject_Vectorcall(hc_multiply, call, 2, in_place ? hc_kw_out : hc_kw_order);
}

static PyObject *hc_alpha0(PyObject *dev, int di, PyObject *beta, PyObject *cobj, int in_place, Py_ssize_t m,
                           Py_ssize_t n) {
    PyObject *shape, *call[5], *res = NULL;
    hc_stamp t0;
    if (!in_place && (cobj == Py_None || (PyFloat_CheckExact(beta) && PyFloat_AS_DOUBLE(beta) == 0.0))
            && hc_new_array != NULL) {   /* host_scale's zeros, made here */
        if (hc_stamp_now(&t0) == 0 && (res = hc_empty(di, m, n, 1)) != NULL) {
            memset(((hc_array *)res)->data, 0, (size_t)(m * n * hc_itemsize[di]));
            if (hc_record(dev, t0, di, 0.0) < 0) Py_CLEAR(res);
        }
        Py_DECREF(dev);
        return res;
    }
    /* C = beta C made here: a real type's products in C, a complex type's host_scale's ufunc call */
    if (cobj != Py_None && (di >= 2 ? hc_multiply != NULL : hc_new_array != NULL)) {
        if (hc_stamp_now(&t0) < 0
                || (res = (di >= 2 ? hc_scale_complex : hc_scale_real)(di, beta, cobj, in_place, m, n)) == NULL) {
            Py_DECREF(dev);
            return NULL;
        }
        if (res != Py_None) {
            if (hc_record(dev, t0, di, 0.0) < 0) Py_CLEAR(res);
            Py_DECREF(dev);
            return res;
        }
        Py_CLEAR(res);   /* (not such a call: host_scale's) */
    }
    if (hc_scale != NULL && (shape = Py_BuildValue("(nn)", m, n)) != NULL) {
        call[0] = beta; call[1] = cobj; call[2] = in_place ? Py_True : Py_False; call[3] = shape;
        call[4] = hc_descr[di];
        if (hc_stamp_now(&t0) == 0) {
            res = PyObject_Vectorcall(hc_scale, call, 5, NULL);
            if (res != NULL && hc_record(dev, t0, di, 0.0) < 0) Py_CLEAR(res);
        }
        Py_DECREF(shape);
    }
    Py_DECREF(dev);
    return res;
}

/* an exact int: its value when it is CPython's cached 0, 1 or 2 (flags as written; one compare
   each where PyLong_AsLong is a call), else PyLong_AsLong's */
static inline long hc_int(PyObject *v) {
    return v == hc_flag[0] ? 0 : v == hc_flag[1] ? 1 : v == hc_flag[2] ? 2 : PyLong_AsLong(v);
}

/* flag j of the family (self->names[f0 + j]) given as v: its value when v is an exact int that blasx
   allows there, else -1 */
static inline long hc_flag_value(hc_call *self, int j, PyObject *v) {
    long x;
    if (!PyLong_CheckExact(v)) return -1;
    x = hc_int(v);
    if (x < 0 || x > 63) { PyErr_Clear(); return -1; }
    return (self->fmask[j] >> x) & 1 ? x : -1;
}

/* the keyword flags: each one a flag of the family with an allowed int; roles 1 and 2 into f[1], f[2] */
static int hc_flags(hc_call *self, PyObject *const *kw, PyObject *kwnames, long f[3], long fv[4]) {
    const hc_family *fm = &hc_fam[self->flops];
    Py_ssize_t i, n = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    int j;
    long x;
    f[1] = f[2] = 0;
    for (i = 0; i < n; i++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, i);
        for (j = 0; j < fm->nf && PyTuple_GET_ITEM(self->names, fm->f0 + j) != key; j++) ;
        if (j == fm->nf)   /* (a keyword name that is not interned) */
            for (j = 0; j < fm->nf && PyUnicode_Compare(PyTuple_GET_ITEM(self->names, fm->f0 + j), key) != 0; j++) ;
        if (PyErr_Occurred()) { PyErr_Clear(); return 0; }
        if (j == fm->nf || (x = hc_flag_value(self, j, kw[i])) < 0) return 0;
        f[self->frole[j]] = x;
        fv[j] = x;
    }
    return 1;
}

/* the arguments bound to names (as Python binds them to parameters of these names, none
   positional-only) into v (NULL: not given); 0 when they do not bind (too many, an unknown or a
   repeated keyword: the Python function raises Python's TypeError) */
static int hc_bind(PyObject *names, PyObject *const *args, size_t nargsf, PyObject *kwnames, PyObject **v) {
    Py_ssize_t n = PyTuple_GET_SIZE(names), np = PyVectorcall_NARGS(nargsf), i, j;
    Py_ssize_t nk = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (np > n) return 0;
    for (i = 0; i < n; i++) v[i] = i < np ? args[i] : NULL;
    for (i = 0; i < nk; i++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, i);
        for (j = 0; j < n && PyTuple_GET_ITEM(names, j) != key; j++) ;
        if (j == n)   /* (a keyword name that is not interned) */
            for (j = 0; j < n && PyUnicode_Compare(PyTuple_GET_ITEM(names, j), key) != 0; j++) ;
        if (PyErr_Occurred()) { PyErr_Clear(); return 0; }
        if (j == n || v[j] != NULL) return 0;
        v[j] = args[np + i];
    }
    return 1;
}

/* numpy's np.may_share_memory (max_work=None: the bounds of the memory each array spans meet) */
static void hc_extent(hc_array *x, Py_ssize_t itemsize, size_t *lo, size_t *hi) {
    Py_ssize_t low = 0, up = 0, o;
    int d;
    for (d = 0; d < x->nd; d++) {
        if (x->dimensions[d] == 0) { *lo = *hi = (size_t)x->data; return; }
        o = x->strides[d] * (x->dimensions[d] - 1);
        if (o > 0) up += o; else low += o;
    }
    *lo = (size_t)x->data + (size_t)low;
    *hi = (size_t)x->data + (size_t)(up + itemsize);
}

static Py_ssize_t hc_itemsize_of(hc_array *x) {
    int i;
    for (i = 0; i < 4; i++) if (x->descr == hc_descr[i]) return hc_itemsize[i];
    return -1;
}

static int hc_may_share(hc_array *x, hc_array *y) {
    size_t s1, e1, s2, e2;
    Py_ssize_t ix = hc_itemsize_of(x), iy = hc_itemsize_of(y);
    if (ix < 0 || iy < 0) return 1;
    hc_extent(x, ix, &s1, &e1); hc_extent(y, iy, &s2, &e2);
    return s1 < e2 && s2 < e1 && s1 < e1 && s2 < e2;
}

/* hostpath._in_place: 1 when out is written in place, 0 when not, -1 when the C code cannot
   take the call (a misaligned output; one that may alias a or b where blasx checks); b may be NULL */
static int hc_in_place(hc_array *out, PyObject *dtype, int overwrite, hc_array *a, hc_array *b, int always) {
    int in_place = 0;
    if (overwrite && out->descr == dtype && (out->flags & HC_F) && (out->flags & HC_WRITE)) {
        if (!(out->flags & HC_ALIGNED)) return -1;
        in_place = 1;
    }
    if (in_place || always) {
        if (a == out || b == out) return -1;
        if (!((out->flags & HC_OWN) && (a->flags & HC_OWN) && (b == NULL || (b->flags & HC_OWN)))
                && (hc_may_share(out, a) || (b != NULL && hc_may_share(out, b))))
            return -1;
    }
    return in_place;
}

/* overwrite_*: absent (0), else an int or a bool (f2py and blasx read it by truth value): its
   truth value; -1 for any other type */
static int hc_overwrite(PyObject *x) {
    if (x == NULL) return 0;
    if (!PyLong_CheckExact(x) && !PyBool_Check(x)) return -1;
    return PyObject_IsTrue(x);
}

/* numpy_api.matmul's host paths: matmul(x1, x2) as it came; with out= (also positional), dtype=
   and casting= (numpy_api._host_matmul_out): a computation type ct (dtype=, else the operands')
   of a BLAS type, casting a str, out None or a C- or F-contiguous exact ndarray of type ct */
static PyObject *hc_matmul(hc_call *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *dev, *out = NULL, *want = NULL, *casting = NULL, *ct;
    Py_ssize_t np = PyVectorcall_NARGS(nargsf), nk = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames), j;
    int i;
    if (np < 2 || np > 3) return NULL;
    if (np == 3) out = args[2];
    for (j = 0; j < nk; j++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, j), **slot;
        if (key == s_out || PyUnicode_Compare(key, s_out) == 0) slot = &out;
        else if (key == s_dtype || PyUnicode_Compare(key, s_dtype) == 0) slot = &want;
        else if (key == s_casting || PyUnicode_Compare(key, s_casting) == 0) slot = &casting;
        else { PyErr_Clear(); return NULL; }
        if (*slot != NULL) return NULL;   /* out twice: Python's TypeError */
        *slot = args[np + j];
    }
    i = hc_dtype(args[0]);
    if (i < 0 || hc_dtype(args[1]) != i || !hc_blas_ready((hc_array *)args[0], hc_itemsize[i])
            || !hc_blas_ready((hc_array *)args[1], hc_itemsize[i]))
        return NULL;
    ct = hc_descr[i];
    if (want != NULL && want != Py_None) {
        ct = PyDict_GetItemWithError(self->names, want);   /* (an unhashable dtype=: numpy raises) */
        if (ct == NULL || hc_descr[hc_index(ct)] != ct) { PyErr_Clear(); return NULL; }   /* (one of the four) */
    }
    if (casting != NULL && !PyUnicode_CheckExact(casting)) return NULL;
    if (out != NULL && out != Py_None && !(Py_TYPE(out) == hc_ndarray && ((hc_array *)out)->descr == ct
                                           && (((hc_array *)out)->flags & HC_CONTIG)))
        return NULL;
    if ((dev = hc_device()) == NULL) return NULL;
    if (casting == NULL && ct == hc_descr[i] && hc_product_ready(args, out == Py_None ? NULL : out, i, 1))
        return hc_product(self->fn, args, nargsf, kwnames, out == Py_None ? NULL : out, i, dev, 1);
    return hc_run(self->fn, args, nargsf, kwnames, dev, hc_index(ct), -1.0, args[0]);
}

/* numpy_api.dot's host path: dot(a, b[, out]) of two exact 1-D / 2-D ndarrays of one BLAS dtype, out
   (by position or keyword) as it came: numpy checks it; not with out where both are 1-D (numpy
   returns a scalar there, blasx out) */
static PyObject *hc_dot(hc_call *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    hc_array *a, *b;
    PyObject *dev, *out = NULL;
    Py_ssize_t k, np = PyVectorcall_NARGS(nargsf), nk = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    int i;
    if (np < 2 || np + nk > 3) return NULL;
    if (nk) {
        if (PyTuple_GET_ITEM(kwnames, 0) != s_out && PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, 0), s_out) != 0) {
            PyErr_Clear();
            return NULL;
        }
        out = args[2];
    } else if (np == 3) out = args[2];
    i = hc_dtype(args[0]);
    a = (hc_array *)args[0]; b = (hc_array *)args[1];
    if (i < 0 || hc_dtype(args[1]) != i || a->nd < 1 || a->nd > 2 || b->nd < 1 || b->nd > 2
            || (out != NULL && out != Py_None && a->nd + b->nd == 2) || (dev = hc_device()) == NULL)
        return NULL;
    if (hc_product_ready(args, out == Py_None ? NULL : out, i, 0))
        return hc_product(self->fn, args, nargsf, kwnames, out == Py_None ? NULL : out, i, dev, 0);
    k = a->dimensions[a->nd - 1];
    return hc_run(self->fn, args, nargsf, kwnames, dev, i,
                  k ? 2.0 * hc_size(args[0]) * hc_size(args[1]) / (double)k : 0.0, NULL);
}

/* the call's length without its trailing arguments that hold scipy's defaults (beta 0.0 without c,
   c None, flags 0, overwrite False): f2py parses each positional argument (~12 ns each) */
static size_t hc_trim(PyObject *const *call, size_t nc, size_t keep) {
    while (nc > keep && (call[nc - 1] == Py_False || call[nc - 1] == Py_None || call[nc - 1] == hc_flag[0]
                         || call[nc - 1] == hc_zero))
        nc--;
    return nc;
}

/* a trans flag: absent (0), else an exact int in 0..2; -1 for anything else */
static long hc_op(PyObject *x) {
    long v;
    if (x == NULL) return 0;
    if (!PyLong_CheckExact(x)) return -1;
    v = hc_int(x);
    if (v == -1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
    return v >= 0 && v <= 2 ? v : -1;
}

/* level3.gemm's host path (level3._host_gemm and _c_mode): how c is written */
enum { HC_C_NONE, HC_C_COPY, HC_C_IN_PLACE, HC_C_IN_PLACE_T };

static PyObject *hc_gemm(hc_call *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *v[8], *alpha, *beta, *cobj, *x[2], *dev, *call[8], *res;
    hc_array *a, *b, *c = NULL;
    Py_ssize_t m, k, kb, n;
    long f[3];
    int i, j, mode = HC_C_NONE, ow;
    hc_stamp t0;
    if (kwnames == NULL && PyVectorcall_NARGS(nargsf) == 3) {
        /* gemm(alpha, a, b) of operands that are not C-ordered only: what the code below calls,
           scipy's ?gemm with the arguments as they came (the defaults trimmed), without binding
           eight parameters and building the call */
        a = (hc_array *)args[1]; b = (hc_array *)args[2];
        if ((i = hc_dtype(args[1])) < 0 || hc_dtype(args[2]) != i || a->nd != 2 || b->nd != 2
                || (a->flags & HC_CONTIG) == HC_C || (b->flags & HC_CONTIG) == HC_C
                || !hc_of_type(&self->types[i], args[0]) || !hc_of_type(&self->types[i], hc_zero))
            goto general;
        m = a->dimensions[0]; k = a->dimensions[1]; n = b->dimensions[1];
        if (k != b->dimensions[0] || !m || !n || !k) return NULL;
        if ((j = hc_truth(args[0])) < 0) { PyErr_Clear(); return NULL; }
        if ((dev = hc_device()) == NULL) return NULL;
        if (!j) return hc_alpha0(dev, i, hc_zero, Py_None, 0, m, n);   /* HC_GEMM_ALPHA0 */
        res = hc_f77_gemm(i, args[0], hc_zero, a, b, 0, 0, Py_None, 0, 0, dev);
        if (res != NULL || PyErr_Occurred()) { Py_DECREF(dev); return res; }
        if (hc_stamp_now(&t0) == 0) {
            res = PyObject_Vectorcall(PyTuple_GET_ITEM(self->fn, i), args, 3, NULL);
            if (res != NULL && hc_record(dev, t0, i, 2.0 * (double)m * (double)n * (double)k) < 0)
                Py_CLEAR(res);
        }
        Py_DECREF(dev);
        return res;
    }
general:
    if (!hc_bind(self->names, args, nargsf, kwnames, v) || v[0] == NULL || v[1] == NULL || v[2] == NULL)
        return NULL;
    alpha = v[0]; beta = v[3] == NULL ? hc_zero : v[3]; cobj = v[4] == NULL ? Py_None : v[4];
    i = hc_dtype(v[1]);
    a = (hc_array *)v[1]; b = (hc_array *)v[2];
    if (i < 0 || hc_dtype(v[2]) != i || a->nd != 2 || b->nd != 2 || (f[1] = hc_op(v[5])) < 0 || (f[2] = hc_op(v[6])) < 0)
        return NULL;
    if (!hc_of_type(&self->types[i], alpha) || !hc_of_type(&self->types[i], beta)
            || (cobj != Py_None && (hc_dtype(cobj) != i || ((hc_array *)cobj)->nd != 2)))
        return NULL;
    m = a->dimensions[0]; k = a->dimensions[1];
    if (f[1]) { m = k; k = a->dimensions[0]; }
    kb = b->dimensions[0]; n = b->dimensions[1];
    if (f[2]) { kb = n; n = b->dimensions[0]; }
    if (k != kb || !m || !n || !k) return NULL;
    if ((j = hc_truth(alpha)) < 0) { PyErr_Clear(); return NULL; }
    if (cobj != Py_None) {   /* _c_mode */
        c = (hc_array *)cobj;
        if (c->dimensions[0] != m || c->dimensions[1] != n || (ow = hc_overwrite(v[7])) < 0 || a == c || b == c) {
            PyErr_Clear();
            return NULL;
        }
        if (!((a->flags & HC_OWN) && (b->flags & HC_OWN) && (c->flags & HC_OWN)) && (hc_may_share(c, a) || hc_may_share(c, b)))
            return NULL;
        if (!ow) mode = HC_C_COPY;
        else if (!((c->flags & HC_WRITE) && (c->flags & HC_ALIGNED))) return NULL;
        else if (c->flags & HC_F) mode = HC_C_IN_PLACE;
        else if (c->flags & HC_C) mode = HC_C_IN_PLACE_T;
        else return NULL;
        if (mode == HC_C_IN_PLACE_T && j) {   /* C^T = op(B)^T op(A)^T, written into the F-ordered c.T */
            int cplx = i >= 2;
            long ta = f[1], tb = f[2];
            hc_array *t;
            if (cplx && (ta == 2 || tb == 2)) return NULL;   /* (op C transposed: no BLAS form) */
            f[1] = tb == 0 ? 1 : 0; f[2] = ta == 0 ? 1 : 0;   /* N -> T; T, C (real: T) -> N */
            t = a; a = b; b = t;
        }
    }
    if ((dev = hc_device()) == NULL) return NULL;
    if (!j) return hc_alpha0(dev, i, beta, cobj, mode >= HC_C_IN_PLACE, m, n);   /* HC_GEMM_ALPHA0 */
    res = hc_f77_gemm(i, alpha, mode == HC_C_NONE ? hc_zero : beta, a, b, f[1], f[2], cobj, mode == HC_C_IN_PLACE_T,
                      mode == HC_C_COPY, dev);
    if (res != NULL || PyErr_Occurred()) { Py_DECREF(dev); return res; }
    /* a C-ordered x is the F-ordered x.T: op N of x is op T of x.T and back (not op C: no BLAS form) */
    for (j = 0; j < 2; j++) {
        hc_array *y = j ? b : a;
        if (f[j + 1] != 2 && (y->flags & HC_CONTIG) == HC_C) {
            x[j] = PyObject_GetAttr((PyObject *)y, s_T);
            f[j + 1] = 1 - f[j + 1];
        } else {
            x[j] = (PyObject *)y;
            Py_INCREF(x[j]);
        }
    }
    call[0] = alpha; call[1] = x[0]; call[2] = x[1]; call[5] = hc_flag[f[1]]; call[6] = hc_flag[f[2]];
    call[7] = mode == HC_C_IN_PLACE || mode == HC_C_IN_PLACE_T ? Py_True : Py_False;
    if (mode == HC_C_NONE) { call[3] = hc_zero; call[4] = Py_None; }   /* beta is ignored without c */
    else {
        call[3] = beta;
        call[4] = mode == HC_C_IN_PLACE_T ? PyObject_GetAttr(cobj, s_T) : (Py_INCREF(cobj), cobj);
    }
    res = NULL;
    if (x[0] != NULL && x[1] != NULL && (mode == HC_C_NONE || call[4] != NULL) && hc_stamp_now(&t0) == 0) {
        res = PyObject_Vectorcall(PyTuple_GET_ITEM(self->fn, i), call, hc_trim(call, 8, 3), NULL);
        if (res != NULL) {
            if (mode == HC_C_IN_PLACE || mode == HC_C_IN_PLACE_T) {   /* c itself */
                Py_DECREF(res);
                Py_INCREF(cobj);
                res = cobj;
            }
            if (hc_record(dev, t0, i, 2.0 * (double)m * (double)n * (double)k) < 0) Py_CLEAR(res);
        }
    }
    if (mode != HC_C_NONE) Py_XDECREF(call[4]);
    Py_XDECREF(x[0]); Py_XDECREF(x[1]); Py_DECREF(dev);
    return res;
}

/* scipy's level-3 routine of a lane (hc_call.f77: scipy.linalg.cython_blas's), called as scipy's f2py
   wrapper calls it (scipy/linalg/fblas_l3.pyf.src): flags as its characters, dimensions and leading
   dimensions from the shapes, the operands as the wrapper takes them (hc_as_fortran: as they are,
   or numpy's F-ordered copy of another order or type), the result a new F-ordered array of zeros
   (the wrapper's; only ?gemm's is left unset: beta is 0 there and BLAS does not read C), or a
   copy of c / of trmm's and trsm's b, or that array itself (in_place); alpha / beta of the types
   the lane took (hc_scalars_of). a, b, c: 2-D exact ndarrays (the lanes' checks). f: the family's
   flags in the signature's order (hc_fam). NULL without an exception: not such a call; with one:
   numpy's error converting an array (the wrapper's too). */
typedef void (*hc_f77_symm_fn)(char *, char *, int *, int *, void *, void *, int *, void *, int *, void *, void *, int *);
typedef void (*hc_f77_syrk_fn)(char *, char *, int *, int *, void *, void *, int *, void *, void *, int *);
typedef void (*hc_f77_tri_fn)(char *, char *, char *, char *, int *, int *, void *, void *, int *, void *, int *);
static int hc_f77_lanes;                  /* the lanes' direct calls are on (blasx_hc_set_direct) */

static PyObject *hc_f77_call(hc_call *self, PyObject *alpha, PyObject *beta, hc_array *a, hc_array *b, hc_array *c,
                             const long *f, int in_place, PyObject *dev, double flops) {
    static char trans[3] = {'N', 'T', 'C'};
    hc_scalars sc;
    void *pa, *pb;
    char c1, c2, c3, c4;
    int m, n, k, lda, ldb, ldc, fam = self->flops, i = self->di;
    Py_ssize_t rm, rn;
    hc_array *src;   /* what the result starts as (NULL: zeros) */
    PyObject *res = NULL, *x, *y = NULL;
    hc_stamp t0;
    if (!hc_f77_lanes || self->f77 == NULL || !hc_scalars_of(alpha, beta, i, &sc, &pa, &pb) || !hc_fits(a)
            || (b != NULL && !hc_fits(b)) || (c != NULL && !hc_fits(c)))
        return NULL;
    lda = a->dimensions[0] > 1 ? (int)a->dimensions[0] : 1;
    ldb = b == NULL ? 0 : b->dimensions[0] > 1 ? (int)b->dimensions[0] : 1;
    switch (fam) {
    case HC_FL_GEMM:
        m = (int)a->dimensions[f[0] ? 1 : 0]; k = (int)a->dimensions[f[0] ? 0 : 1];
        n = (int)b->dimensions[f[1] ? 0 : 1];
        rm = m; rn = n;
        break;
    case HC_FL_SYMM: case HC_FL_TRI:
        m = (int)b->dimensions[0]; n = (int)b->dimensions[1]; k = 0;
        rm = m; rn = n;
        break;
    default:   /* syrk, syr2k */
        n = (int)a->dimensions[f[0] ? 1 : 0]; k = (int)a->dimensions[f[0] ? 0 : 1]; m = n;
        rm = n; rn = n;
        break;
    }
    ldc = m > 1 ? m : 1;
    src = fam == HC_FL_TRI ? b : c;
    if (dev != NULL && hc_stamp_now(&t0) < 0) return NULL;
    /* the operands and the result as the wrapper makes them: b of trmm / trsm is the result */
    if ((x = hc_as_fortran(a, i, 0)) == NULL) return NULL;
    if (b != NULL && fam != HC_FL_TRI && (y = hc_as_fortran(b, i, 0)) == NULL) { Py_DECREF(x); return NULL; }
    if (in_place) { Py_INCREF((PyObject *)src); res = (PyObject *)src; }
    else if (src != NULL) res = hc_as_fortran(src, i, 1);
    else if ((res = hc_empty(i, rm, rn, 1)) != NULL && fam != HC_FL_GEMM)
        memset(((hc_array *)res)->data, 0, (size_t)(rm * rn * hc_itemsize[i]));
    if (res != NULL) {
        char *ad = ((hc_array *)x)->data, *bd = y == NULL ? NULL : ((hc_array *)y)->data, *out = ((hc_array *)res)->data;
        PyThreadState *ts;
        hc_direct_calls++;
        ts = flops >= 2.0 * HC_NOGIL ? PyEval_SaveThread() : NULL;
        switch (fam) {
        case HC_FL_GEMM:
            c1 = trans[f[0]]; c2 = trans[f[1]];
            ((hc_f77_fn)self->f77)(&c1, &c2, &m, &n, &k, pa, ad, &lda, bd, &ldb, pb, out, &ldc);
            break;
        case HC_FL_SYMM:
            c1 = f[0] ? 'R' : 'L'; c2 = f[1] ? 'L' : 'U';
            ((hc_f77_symm_fn)self->f77)(&c1, &c2, &m, &n, pa, ad, &lda, bd, &ldb, pb, out, &ldc);
            break;
        case HC_FL_SYRK:
            c1 = f[1] ? 'L' : 'U'; c2 = trans[f[0]];
            ((hc_f77_syrk_fn)self->f77)(&c1, &c2, &n, &k, pa, ad, &lda, pb, out, &ldc);
            break;
        case HC_FL_SYR2K:
            c1 = f[1] ? 'L' : 'U'; c2 = trans[f[0]];
            ((hc_f77_symm_fn)self->f77)(&c1, &c2, &n, &k, pa, ad, &lda, bd, &ldb, pb, out, &ldc);
            break;
        default:   /* trmm, trsm: B in place */
            c1 = f[0] ? 'R' : 'L'; c2 = f[1] ? 'L' : 'U'; c3 = trans[f[2]]; c4 = f[3] ? 'U' : 'N';
            ((hc_f77_tri_fn)self->f77)(&c1, &c2, &c3, &c4, &m, &n, pa, ad, &lda, out, &ldc);
            break;
        }
        if (ts != NULL) PyEval_RestoreThread(ts);
        if (dev != NULL && hc_record(dev, t0, i, flops) < 0) Py_CLEAR(res);
    }
    Py_DECREF(x); Py_XDECREF(y);
    return res;
}

static PyObject *hc_lane(hc_call *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *alpha, *dev;
    hc_array *a, *b;
    Py_ssize_t d0, d1, s;
    long f[3], fv[4] = {0, 0, 0, 0};
    double flops = 0.0;
    if (PyVectorcall_NARGS(nargsf) != self->nargs) return NULL;
    alpha = args[0];
    a = (hc_array *)args[1]; b = (hc_array *)args[self->nargs - 1];
    /* (alpha 0 first: the second lane takes it, and pays for this lane's checks otherwise) */
    if (!hc_of_type(&self->types[0], alpha) || hc_truth(alpha) != 1
            || Py_TYPE(a) != hc_ndarray || Py_TYPE(b) != hc_ndarray || a->descr != self->dtype || b->descr != self->dtype
            || a->nd != 2 || b->nd != 2 || !hc_flags(self, args + self->nargs, kwnames, f, fv)) {
        PyErr_Clear();
        return NULL;
    }
    switch (self->flops) {   /* hostpath.FAST_SHAPES; 0 when the shapes do not fit or a dimension is 0 */
    case HC_FL_GEMM: {
        Py_ssize_t m = a->dimensions[0], k = a->dimensions[1], kb = b->dimensions[0], n = b->dimensions[1];
        if (f[1]) { m = k; k = a->dimensions[0]; }
        if (f[2]) { kb = n; n = b->dimensions[0]; }
        if (k == kb) flops = 2.0 * (double)m * (double)n * (double)k;
        break;
    }
    case HC_FL_SYMM: case HC_FL_TRI:
        d0 = b->dimensions[0]; d1 = b->dimensions[1];
        s = f[1] ? d1 : d0;
        if (a->dimensions[0] == s && a->dimensions[1] == s)
            flops = (self->flops == HC_FL_SYMM ? 2.0 : 1.0) * (double)d0 * (double)d1 * (double)s;
        break;
    case HC_FL_SYRK: case HC_FL_SYR2K:
        d0 = a->dimensions[f[1] ? 1 : 0]; d1 = a->dimensions[f[1] ? 0 : 1];
        if (self->flops == HC_FL_SYRK) flops = (double)d0 * (d0 + 1.0) * (double)d1;
        else if (b->dimensions[0] == a->dimensions[0] && b->dimensions[1] == a->dimensions[1])
            flops = 2.0 * (double)d0 * (d0 + 1.0) * (double)d1;
        break;
    }
    if (flops == 0.0 || (dev = hc_device()) == NULL) return NULL;
    if (self->f77 != NULL) {   /* scipy's routine itself */
        PyObject *res = hc_f77_call(self, alpha, hc_zero, a, hc_fam[self->flops].b >= 0 ? b : NULL, NULL, fv, 0, dev,
                                    flops);
        if (res != NULL || PyErr_Occurred()) { Py_DECREF(dev); return res; }
    }
    return hc_run(self->fn, args, nargsf, kwnames, dev, self->di, flops, NULL);
}

/* an array the second lane takes: an exact 2-D ndarray of the routine's dtype or one it converts */
static int hc_lane_array(hc_call *self, PyObject *x) {
    int i;
    if (Py_TYPE(x) != hc_ndarray || ((hc_array *)x)->nd != 2) return 0;
    if (((hc_array *)x)->descr == self->dtype) return 1;
    for (i = 0; i < 4; i++) if (((hc_array *)x)->descr == hc_descr[i]) return (self->convert >> i) & 1;
    return 0;
}

/* hostpath's second lane (LANES: c and beta, overwrite_*, alpha 0, arrays converted by scipy):
   the arguments bound to scipy's signature, checked as the lane checks them, and scipy's routine
   called as the lane calls it (positionally: beta 0.0 without c, overwrite as in_place) */
static PyObject *hc_lane2(hc_call *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    const hc_family *fm = &hc_fam[self->flops];
    PyObject *v[8], *alpha, *beta, *cobj, *dev, *call[8], *res;
    hc_array *a, *b = NULL, *c = NULL;
    Py_ssize_t m, n, k, s = 0;
    long f[4];
    int j, ow, nz, in_place = 0, nc = 0;
    double flops;
    hc_stamp t0;
    if (!hc_bind(self->names, args, nargsf, kwnames, v) || v[0] == NULL || v[1] == NULL
            || (fm->b >= 0 && v[fm->b] == NULL))
        return NULL;
    alpha = v[0];
    beta = fm->beta >= 0 && v[fm->beta] != NULL ? v[fm->beta] : hc_zero;
    cobj = fm->c >= 0 && v[fm->c] != NULL ? v[fm->c] : Py_None;
    if (!hc_of_type(&self->types[0], alpha) || (fm->beta >= 0 && !hc_of_type(&self->types[1], beta))
            || (ow = hc_overwrite(v[fm->ow])) < 0) {
        PyErr_Clear();
        return NULL;
    }
    for (j = 0; j < fm->nf; j++) {
        PyObject *x = v[fm->f0 + j];
        if (x == NULL) f[j] = 0;
        else if ((f[j] = hc_flag_value(self, j, x)) < 0) return NULL;
    }
    a = (hc_array *)v[1];
    if (!hc_lane_array(self, v[1]) || (fm->b >= 0 && !hc_lane_array(self, v[fm->b]))
            || (cobj != Py_None && !hc_lane_array(self, cobj)))
        return NULL;
    if (fm->b >= 0) b = (hc_array *)v[fm->b];
    if (cobj != Py_None) c = (hc_array *)cobj;
    /* the shapes: every dimension > 0, c's shape; the flops */
    switch (self->flops) {
    case HC_FL_GEMM:
        m = a->dimensions[0]; k = a->dimensions[1];
        if (f[0]) { m = k; k = a->dimensions[0]; }
        s = b->dimensions[0]; n = b->dimensions[1];   /* s: op(b)'s rows */
        if (f[1]) { s = n; n = b->dimensions[0]; }
        if (!(k == s && m && n && k)) return NULL;
        flops = 2.0 * (double)m * (double)n * (double)k;
        break;
    case HC_FL_SYMM: case HC_FL_TRI:
        m = b->dimensions[0]; n = b->dimensions[1];
        s = f[0] ? n : m;
        if (!(m && n && a->dimensions[0] == s && a->dimensions[1] == s)) return NULL;
        flops = (self->flops == HC_FL_SYMM ? 2.0 : 1.0) * (double)m * (double)n * (double)s;
        break;
    default:   /* syrk, syr2k */
        n = a->dimensions[0]; k = a->dimensions[1];
        if (f[0]) { n = k; k = a->dimensions[0]; }
        if (!(n && k) || (b != NULL && (b->dimensions[0] != a->dimensions[0] || b->dimensions[1] != a->dimensions[1])))
            return NULL;
        m = n;
        flops = (self->flops == HC_FL_SYRK ? 1.0 : 2.0) * (double)n * ((double)n + 1.0) * (double)k;
        break;
    }
    if (c != NULL && (c->dimensions[0] != m || c->dimensions[1] != n)) return NULL;
    /* the output written in place (hostpath._in_place) */
    if (self->flops == HC_FL_TRI) {
        if (ow && (in_place = hc_in_place(b, self->dtype, ow, a, NULL, 0)) < 0) return NULL;
    } else if (c != NULL && (self->flops == HC_FL_GEMM || ow)) {
        if ((in_place = hc_in_place(c, self->dtype, ow, a, b, self->flops == HC_FL_GEMM)) < 0) return NULL;
    }
    if ((nz = hc_truth(alpha)) < 0) { PyErr_Clear(); return NULL; }
    if (!nz)   /* the general path's plan records C = beta C (B = 0): m n flops, or none */
        flops = self->flops == HC_FL_SYMM || self->flops == HC_FL_TRI ? (double)m * (double)n : 0.0;
    if ((dev = hc_device()) == NULL) return NULL;
    if (!nz && self->flops == HC_FL_GEMM)   /* HC_GEMM_ALPHA0 */
        return hc_alpha0(dev, self->di, beta, cobj, in_place, m, n);
    if (self->f77 != NULL) {   /* scipy's routine itself */
        res = hc_f77_call(self, alpha, c != NULL ? beta : hc_zero, a, b, c, f, in_place, dev, flops);
        if (res != NULL || PyErr_Occurred()) { Py_DECREF(dev); return res; }
    }
    call[nc++] = alpha; call[nc++] = v[1];
    if (b != NULL) call[nc++] = (PyObject *)b;
    if (fm->c >= 0) { call[nc++] = c != NULL ? beta : hc_zero; call[nc++] = cobj; }
    for (j = 0; j < fm->nf; j++) call[nc++] = v[fm->f0 + j] != NULL ? v[fm->f0 + j] : hc_flag[0];
    call[nc++] = in_place ? Py_True : Py_False;
    res = NULL;
    if (hc_stamp_now(&t0) == 0) {
        res = PyObject_Vectorcall(self->fn, call, hc_trim(call, nc, b != NULL ? 3 : 2), NULL);
        if (res != NULL && hc_record(dev, t0, self->di, flops) < 0) Py_CLEAR(res);
    }
    Py_DECREF(dev);
    return res;
}

#if defined(__SIZEOF_INT128__)
typedef unsigned __int128 hc_u128;

static double hc_isqrt(hc_u128 q) {   /* floor(sqrt(q)) (math.isqrt) */
    hc_u128 x, y;
    int bits = 0;
    if (q == 0) return 0.0;
    if (q < ((hc_u128)1 << 52)) {   /* exact as a double: its sqrt, corrected (128-bit Newton steps cost ~40 ns) */
        uint64_t z = (uint64_t)__builtin_sqrt((double)q), v = (uint64_t)q;
        while (z * z > v) z--;
        while ((z + 1) * (z + 1) <= v) z++;
        return (double)z;
    }
    for (x = q; x; x >>= 1) bits++;
    x = (hc_u128)1 << ((bits + 1) / 2);   /* >= sqrt(q): Newton from above */
    for (;;) {
        y = (x + q / x) / 2;
        if (y >= x) return (double)x;
        x = y;
    }
}

static hc_u128 hc_count(PyObject *x) {
    hc_u128 s = 1;
    int d;
    if (!PyObject_TypeCheck(x, hc_ndarray)) return 1;
    for (d = 0; d < ((hc_array *)x)->nd; d++) s *= (hc_u128)((hc_array *)x)->dimensions[d];
    return s;
}

/* numpy's tensordot(a, b, axes) with axes an int n (absent: 2) of C-ordered a and b: a.reshape(M, K)
   and b.reshape(K, N) are views, numpy's dot of them one cblas_?gemm call (M, K, N >= 2: not its
   gemv / dot cases), the result that call's C-ordered output as a.shape[:-n] + b.shape[n:]; made
   directly here (hc_cblas_into), into an array of that shape. NULL without an exception: not such a
   call, or a floating-point flag raised (numpy's function then computes it: its warnings), dev
   kept; else dev taken */
static PyObject *hc_tensordot_direct(PyObject *const *args, PyObject *axes, int i, PyObject *dev) {
    hc_array *a = (hc_array *)args[0], *b = (hc_array *)args[1], av, bv, ov;
    Py_ssize_t shape[64], m = 1, k = 1, n = 1, sz = hc_itemsize[i];
    Py_ssize_t da[2], db[2], dc[2], sa[2], sb[2], sc[2];
    long nax = 2;
    int j, nd, fe;
    PyObject *res;
    hc_stamp t0;
    if (hc_cblas[i] == NULL || !(a->flags & HC_C) || !(b->flags & HC_C) || !(a->flags & HC_ALIGNED)
            || !(b->flags & HC_ALIGNED) || a->data == b->data)
        return NULL;
    if (axes != NULL) {
        if (!PyLong_CheckExact(axes)) return NULL;
        nax = PyLong_AsLong(axes);
        if (nax == -1 && PyErr_Occurred()) { PyErr_Clear(); return NULL; }
    }
    if (nax < 1 || nax > a->nd || nax > b->nd || a->nd + b->nd - 2 * nax > 64) return NULL;
    for (j = 0; j < nax; j++)
        if (a->dimensions[a->nd - nax + j] != b->dimensions[j]) return NULL;   /* (numpy's error) */
    nd = 0;
    for (j = 0; j < a->nd - nax; j++) { m *= a->dimensions[j]; shape[nd++] = a->dimensions[j]; }
    for (j = a->nd - (int)nax; j < a->nd; j++) k *= a->dimensions[j];
    for (j = (int)nax; j < b->nd; j++) { n *= b->dimensions[j]; shape[nd++] = b->dimensions[j]; }
    if (m < 2 || k < 2 || n < 2 || m > HC_INT_MAX || k > HC_INT_MAX || n > HC_INT_MAX) return NULL;
    if (hc_stamp_now(&t0) < 0) { Py_DECREF(dev); return NULL; }
    Py_INCREF(hc_descr[i]);   /* (stolen) */
    if ((res = hc_new_array(hc_ndarray, hc_descr[i], nd, shape, NULL, NULL, 0, NULL)) == NULL) {
        Py_DECREF(dev);
        return NULL;
    }
    /* the C-ordered 2-D views numpy's tensordot hands dot, as the fields hc_cblas_into reads */
    av = *a; bv = *b; ov = *(hc_array *)res;
    da[0] = m; da[1] = k; sa[0] = k * sz; sa[1] = sz;
    db[0] = k; db[1] = n; sb[0] = n * sz; sb[1] = sz;
    dc[0] = m; dc[1] = n; sc[0] = n * sz; sc[1] = sz;
    av.nd = bv.nd = ov.nd = 2;
    av.dimensions = da; av.strides = sa; bv.dimensions = db; bv.strides = sb; ov.dimensions = dc; ov.strides = sc;
    if ((fe = hc_cblas_into(i, &av, &bv, &ov)) != 0) {   /* numpy's function: its warnings, its errors */
        Py_DECREF(res);
        feclearexcept(HC_FE);
        return NULL;
    }
    if (hc_record(dev, t0, i, 2.0 * (double)m * (double)n * (double)k) < 0) Py_CLEAR(res);
    Py_DECREF(dev);
    return res;
}

/* numpy_api._host_tensordot: tensordot(a, b[, axes]) of two exact ndarrays of one BLAS dtype */
static PyObject *hc_tensordot(hc_call *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *dev, *res;
    Py_ssize_t np = PyVectorcall_NARGS(nargsf), nk = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    int i;
    hc_stamp t0;
    if (np < 2 || np + nk > 3 || (nk && PyTuple_GET_ITEM(kwnames, 0) != s_axes
                                  && PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, 0), s_axes) != 0)) {
        PyErr_Clear();
        return NULL;
    }
    i = hc_dtype(args[0]);
    if (i < 0 || hc_dtype(args[1]) != i || (dev = hc_device()) == NULL) return NULL;
    if ((res = hc_tensordot_direct(args, np + nk == 3 ? args[2] : NULL, i, dev)) != NULL || PyErr_Occurred())
        return res;   /* (it took dev) */
    if (hc_stamp_now(&t0) == 0) {
        res = PyObject_Vectorcall(self->fn, args, nargsf, kwnames);
        if (res != NULL) {
            hc_u128 r = hc_count(res), q = hc_count(args[0]) * hc_count(args[1]);
            double kk = r ? hc_isqrt(q >> 64 ? q / r : (hc_u128)((uint64_t)q / (uint64_t)r)) : 0.0;   /* (64-bit division where it fits) */
            if (hc_record(dev, t0, i, 2.0 * (double)r * kk) < 0) Py_CLEAR(res);
        }
    }
    Py_DECREF(dev);
    return res;
}
#else
static PyObject *hc_tensordot(hc_call *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return NULL;
}
#endif

/* the call taken in C, or NULL without an exception */
static PyObject *hc_dispatch(hc_call *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *res;
    switch (self->kind) {
    case HC_MATMUL: return hc_matmul(self, args, nargsf, kwnames);
    case HC_DOT: return hc_dot(self, args, nargsf, kwnames);
    case HC_GEMM: return hc_gemm(self, args, nargsf, kwnames);
    case HC_TENSORDOT: return hc_tensordot(self, args, nargsf, kwnames);
    default:
        res = hc_lane(self, args, nargsf, kwnames);
        if (res == NULL && !PyErr_Occurred()) res = hc_lane2(self, args, nargsf, kwnames);
        return res;
    }
}

/* the operands given as nested lists, numpy's arrays of them, then the call again: matmul's / dot's
   two operands as numpy makes them (PyArray_FromAny with no type: np.asarray), blasx.linalg.blas's
   a and b (hc_call.lists; blasx's own functions reject lists) as scipy's wrapper does (of the
   routine's type), by position; NULL without an exception: another call (the Python function then
   converts them itself: ragged lists, lists of ints for matmul, complex numbers for a real
   routine, ...) */
#define HC_LIST_ARGS 8

static PyObject *hc_dispatch_lists(hc_call *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t np = PyVectorcall_NARGS(nargsf), nk = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames), j;
    Py_ssize_t first = self->kind == HC_MATMUL || self->kind == HC_DOT ? 0 : 1, last = first + 1, n = np + nk;
    PyObject *conv[HC_LIST_ARGS], *res = NULL;
    int any = 0, ok = 1;
    if (hc_from_any == NULL || !self->lists || n > HC_LIST_ARGS) return NULL;
    if (self->kind == HC_LANE && hc_fam[self->flops].b < 0) last = first;   /* (syrk, herk: a only) */
    for (j = 0; j < n; j++) {
        PyObject *x = args[j];
        if (ok && j >= first && j <= last && j < np && PyList_CheckExact(x)) {
            any = 1;
            /* (scipy's routines: F-ordered arrays of the routine's type, HC_F being numpy's
               NPY_ARRAY_F_CONTIGUOUS, as scipy's wrapper converts lists (no FORCECAST: complex
               numbers for a real routine fail here and the Python path decides); numpy's matmul and
               dot: C-ordered ones of the type numpy finds, as numpy makes them) */
            PyObject *want = NULL;
            if (self->kind == HC_LANE) { want = self->dtype; Py_INCREF(want); }   /* (stolen) */
            if ((x = hc_from_any(x, want, 0, 0, self->kind == HC_LANE ? HC_F : 0, NULL)) == NULL) {
                PyErr_Clear(); ok = 0; x = Py_None; Py_INCREF(x);
            }
        } else Py_INCREF(x);
        conv[j] = x;
    }
    if (any && ok) res = hc_dispatch(self, conv, nargsf, kwnames);
    for (j = 0; j < n; j++) Py_DECREF(conv[j]);
    return res;
}

static PyObject *hc_vectorcall(PyObject *obj, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    hc_call *self = (hc_call *)obj;
    PyObject *res = hc_dispatch(self, args, nargsf, kwnames);
    if (res == NULL && !PyErr_Occurred()) res = hc_dispatch_lists(self, args, nargsf, kwnames);
    if (res != NULL || PyErr_Occurred()) return res;   /* taken here (its result or its error) */
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

/* pickled as what it stands for: the module attribute named by __qualname__ */
static PyObject *hc_reduce(PyObject *self, PyObject *unused) { return PyObject_GetAttr(self, s_qualname); }

static PyMethodDef hc_methods[] = {{"__reduce__", hc_reduce, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static PyGetSetDef hc_getset[] = {{"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
                                  {NULL, NULL, NULL, NULL, NULL}};

static void hc_dealloc(PyObject *obj) {
    hc_call *self = (hc_call *)obj;
    Py_XDECREF(self->slow); Py_XDECREF(self->fn); Py_XDECREF(self->dtype); Py_XDECREF(self->alpha);
    Py_XDECREF(self->flags); Py_XDECREF(self->names); Py_XDECREF(self->beta); Py_XDECREF(self->dict);
    Py_TYPE(obj)->tp_free(obj);
}

static PyTypeObject hc_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "blasx.hostcall",
    .tp_basicsize = sizeof(hc_call),
    .tp_dealloc = hc_dealloc,
    .tp_vectorcall_offset = offsetof(hc_call, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_dictoffset = offsetof(hc_call, dict),
    .tp_methods = hc_methods,
    .tp_getset = hc_getset,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A blasx entry point: numpy's / scipy's own function for a plain CPU-only call, else the Python one.",
};

int blasx_hc_init(PyObject *ndarray, PyObject *descrs, PyObject *session_dict, PyObject *tls, PyObject *clock,
                  int native_clock, int any_strides, int tsc) {
    int i;
    if (!PyType_Check(ndarray) || !PyTuple_Check(descrs) || PyTuple_GET_SIZE(descrs) != 4
            || !PyDict_Check(session_dict)) {
        PyErr_SetString(PyExc_TypeError, "blasx_hc_init: bad arguments");
        return -1;
    }
    if (!(hc_type.tp_flags & Py_TPFLAGS_READY) && PyType_Ready(&hc_type) < 0) return -1;
    if (!(hc_guard_type.tp_flags & Py_TPFLAGS_READY) && PyType_Ready(&hc_guard_type) < 0) return -1;
    if (s_guard == NULL) {
        s_host_device = PyUnicode_InternFromString("host_device");
        s_guard = PyUnicode_InternFromString("c_guard");
        s_T = PyUnicode_InternFromString("T");
        s_qualname = PyUnicode_InternFromString("__qualname__");
        s_out = PyUnicode_InternFromString("out");
        s_dtype = PyUnicode_InternFromString("dtype");
        s_casting = PyUnicode_InternFromString("casting");
        s_axes = PyUnicode_InternFromString("axes");
        for (i = 0; i < 3; i++) hc_flag[i] = PyLong_FromLong(i);
        hc_zero = PyFloat_FromDouble(0.0);
        if (PyErr_Occurred()) return -1;
    }
    Py_INCREF(ndarray); Py_XSETREF(hc_ndarray, (PyTypeObject *)ndarray);
    for (i = 0; i < 4; i++) {
        Py_INCREF(PyTuple_GET_ITEM(descrs, i));
        Py_XSETREF(hc_descr[i], PyTuple_GET_ITEM(descrs, i));
    }
    Py_INCREF(session_dict); Py_XSETREF(hc_session, session_dict);
#if PY_VERSION_HEX >= 0x030C0000
    hc_watch(session_dict);
#endif
    Py_INCREF(tls); Py_XSETREF(hc_tls, tls);
    Py_INCREF(clock); Py_XSETREF(hc_clock, clock);
    hc_native_clock = native_clock;
    hc_tsc = 0;
#if HC_HAVE_TSC && defined(__linux__)
    if (tsc && native_clock) {   /* the caller checked that the TSC is invariant */
        uint64_t k;
        double m;
        hc_pair(&hc_cal_tick, &hc_cal_mono);
        hc_pair(&k, &m);
        hc_tsc = k > hc_cal_tick && m >= hc_cal_mono;
    }
#endif
    hc_any_strides = any_strides;
    return 0;
}

/* ts: the types in set (none for None) */
static int hc_fill_types(hc_types *ts, PyObject *set) {
    PyObject *it, *x;
    ts->n = 0;
    if (set == Py_None) return 0;
    if (!PyAnySet_Check(set) || PySet_GET_SIZE(set) > HC_NTYPES) {
        PyErr_Format(PyExc_TypeError, "blasx_hc_new: a set of at most %d types expected", HC_NTYPES);
        return -1;
    }
    if ((it = PyObject_GetIter(set)) == NULL) return -1;
    while ((x = PyIter_Next(it)) != NULL) {
        ts->t[ts->n++] = x;
        if (x == (PyObject *)&PyFloat_Type) { ts->t[ts->n - 1] = ts->t[0]; ts->t[0] = x; }   /* (alpha's usual type first) */
        Py_DECREF(x);   /* (the set keeps it) */
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

/* the C tables of a new hc_call: GEMM's types per dtype, LANE's types and flags */
static int hc_tables(hc_call *self) {
    int i, j;
    if (self->kind == HC_GEMM) {
        if (!PyTuple_Check(self->alpha) || PyTuple_GET_SIZE(self->alpha) != 4) {
            PyErr_SetString(PyExc_TypeError, "blasx_hc_new: gemm's alpha types: a set per dtype");
            return -1;
        }
        for (i = 0; i < 4; i++) if (hc_fill_types(&self->types[i], PyTuple_GET_ITEM(self->alpha, i)) < 0) return -1;
    } else if (self->kind == HC_LANE) {
        const hc_family *fm = &hc_fam[self->flops];
        if (hc_fill_types(&self->types[0], self->alpha) < 0 || hc_fill_types(&self->types[1], self->beta) < 0) return -1;
        if (!PyDict_Check(self->flags) || PyDict_GET_SIZE(self->flags) != fm->nf) goto bad_flags;
        for (j = 0; j < fm->nf; j++) {   /* flags: name -> (frozenset of allowed ints, role) */
            PyObject *spec = PyDict_GetItemWithError(self->flags, PyTuple_GET_ITEM(self->names, fm->f0 + j)), *it, *x;
            long v;
            if (spec == NULL || !PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 2) goto bad_flags;
            self->frole[j] = (int)PyLong_AsLong(PyTuple_GET_ITEM(spec, 1));
            if (self->frole[j] < 0 || self->frole[j] > 2) goto bad_flags;
            self->fmask[j] = 0;
            if ((it = PyObject_GetIter(PyTuple_GET_ITEM(spec, 0))) == NULL) return -1;
            while ((x = PyIter_Next(it)) != NULL) {
                v = PyLong_AsLong(x);
                Py_DECREF(x);
                if (v < 0 || v > 63) { Py_DECREF(it); goto bad_flags; }
                self->fmask[j] |= 1UL << v;
            }
            Py_DECREF(it);
            if (PyErr_Occurred()) return -1;
        }
    }
    return 0;
bad_flags:
    PyErr_Clear();
    PyErr_SetString(PyExc_TypeError, "blasx_hc_new: flags: each flag of the routine -> (ints in 0..63, role 0-2)");
    return -1;
}

PyObject *blasx_hc_new(int kind, PyObject *slow, PyObject *fn, PyObject *dtype, PyObject *alpha, PyObject *flags,
                       int flops, int nargs, PyObject *names, PyObject *beta, int convert) {
    hc_call *self;
    if (hc_session == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "blasx_hc_new before blasx_hc_init");
        return NULL;
    }
    if (((kind == HC_LANE || kind == HC_GEMM) && !(PyTuple_CheckExact(names)
                                                  && PyTuple_GET_SIZE(names) == (kind == HC_GEMM ? 8 : hc_fam[flops].n)))
            || (kind == HC_MATMUL && !PyDict_CheckExact(names)) || (kind == HC_LANE && !PyAnySet_Check(beta))
            || flops < 0 || flops > 4 || (kind == HC_LANE && hc_descr[hc_index(dtype)] != dtype)) {
        PyErr_SetString(PyExc_TypeError, "blasx_hc_new: bad arguments");
        return NULL;
    }
    self = PyObject_New(hc_call, &hc_type);
    if (self == NULL) return NULL;
    self->vectorcall = hc_vectorcall;
    self->kind = kind; self->flops = flops; self->nargs = nargs;
    Py_INCREF(slow); self->slow = slow;
    Py_INCREF(fn); self->fn = fn;
    Py_INCREF(dtype); self->dtype = dtype;
    Py_INCREF(alpha); self->alpha = alpha;
    Py_INCREF(flags); self->flags = flags;
    Py_INCREF(names); self->names = names;
    Py_INCREF(beta); self->beta = beta;
    self->convert = convert;
    self->di = kind == HC_LANE ? hc_index(dtype) : 0;
    self->f77 = NULL;
    self->lists = kind == HC_MATMUL || kind == HC_DOT;
    self->dict = NULL;
    if (hc_tables(self) < 0) { Py_DECREF(self); return NULL; }
    return (PyObject *)self;
}

/* the direct calls' routines (blasx._blas_symbols): numpy's PyArray_NewFromDescr, PyArray_CopyInto and
   PyArray_FromAny (a 3-tuple of addresses, or None: no direct calls), numpy's cblas_?gemm and scipy's ?gemm (4-tuples
   of addresses, or None: that family calls numpy's / scipy's function) */
int blasx_hc_set_direct(PyObject *numpy_api, PyObject *cblas, PyObject *f77) {
    void *p[9] = {NULL}, *api[3] = {NULL, NULL, NULL};
    int i, j;
    PyObject *t[2] = {cblas, f77};
    if (numpy_api != Py_None) {
        if (!PyTuple_Check(numpy_api) || PyTuple_GET_SIZE(numpy_api) != 3) {
            PyErr_SetString(PyExc_TypeError, "blasx_hc_set_direct: 3 addresses or None expected");
            return -1;
        }
        for (i = 0; i < 3; i++)
            if ((api[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(numpy_api, i))) == NULL && PyErr_Occurred()) return -1;
        if (api[1] != NULL && api[2] != NULL) p[0] = api[0];
    }
    for (j = 0; j < 2; j++) {
        if (t[j] == Py_None) continue;
        if (!PyTuple_Check(t[j]) || PyTuple_GET_SIZE(t[j]) != 4) {
            PyErr_SetString(PyExc_TypeError, "blasx_hc_set_direct: 4 addresses or None expected");
            return -1;
        }
        for (i = 0; i < 4; i++)
            if ((p[1 + 4 * j + i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(t[j], i))) == NULL && PyErr_Occurred()) return -1;
    }
    hc_new_array = (hc_new_fn)p[0];
    hc_copy_into = (hc_copy_into_fn)api[1];
    hc_from_any = (hc_from_any_fn)api[2];
    for (i = 0; i < 4; i++) {
        hc_cblas[i] = hc_new_array != NULL ? p[1 + i] : NULL;
        hc_f77[i] = hc_new_array != NULL ? p[5 + i] : NULL;
    }
    hc_f77_lanes = hc_new_array != NULL && f77 != Py_None;   /* (the lanes' routines: blasx_hc_lane_direct) */
    return 0;
}

/* whether a lane makes nested lists given as a and b arrays (blasx.linalg.blas's lanes) */
int blasx_hc_lane_lists(PyObject *obj, int lists) {
    if (Py_TYPE(obj) != &hc_type || ((hc_call *)obj)->kind != HC_LANE) {
        PyErr_SetString(PyExc_TypeError, "blasx_hc_lane_lists: a lane expected");
        return -1;
    }
    ((hc_call *)obj)->lists = lists != 0;
    return 0;
}

/* a lane's own scipy routine (an address, or None) */
int blasx_hc_lane_direct(PyObject *obj, PyObject *addr) {
    void *p = NULL;
    if (Py_TYPE(obj) != &hc_type || ((hc_call *)obj)->kind != HC_LANE) {
        PyErr_SetString(PyExc_TypeError, "blasx_hc_lane_direct: a lane expected");
        return -1;
    }
    if (addr != Py_None && (p = PyLong_AsVoidPtr(addr)) == NULL && PyErr_Occurred()) return -1;
    ((hc_call *)obj)->f77 = p;
    return 0;
}

/* whether operands numpy copies before its BLAS call are copied and the call made directly: matmul's
   (numpy >= 2.3.1 copies what BLAS cannot read), dot's (numpy copies what is not contiguous) */
void blasx_hc_set_copies(int matmul, int dot) { hc_copies[0] = matmul; hc_copies[1] = dot; }

/* the number of direct calls made so far */
PyObject *blasx_hc_direct_calls(void) { return PyLong_FromUnsignedLongLong(hc_direct_calls); }

/* a lane's own scipy routine: its address, or None */
PyObject *blasx_hc_lane_routine(PyObject *obj) {
    if (Py_TYPE(obj) != &hc_type || ((hc_call *)obj)->kind != HC_LANE || ((hc_call *)obj)->f77 == NULL) Py_RETURN_NONE;
    return PyLong_FromVoidPtr(((hc_call *)obj)->f77);
}

/* a lane's direct call alone, unrecorded: routine(alpha, a[, b], flags...) (flags: the family's, in
   order), a new result; None where it does not apply */
PyObject *blasx_hc_lane_probe(PyObject *obj, PyObject *alpha, PyObject *a, PyObject *b, PyObject *flags) {
    hc_call *self = (hc_call *)obj;
    long f[4] = {0, 0, 0, 0};
    Py_ssize_t j;
    PyObject *res;
    if (Py_TYPE(obj) != &hc_type || self->kind != HC_LANE || !PyTuple_Check(flags) || PyTuple_GET_SIZE(flags) > 4
            || Py_TYPE(a) != hc_ndarray || ((hc_array *)a)->nd != 2
            || (b != Py_None && (Py_TYPE(b) != hc_ndarray || ((hc_array *)b)->nd != 2)))
        Py_RETURN_NONE;
    for (j = 0; j < PyTuple_GET_SIZE(flags); j++)
        if ((f[j] = PyLong_AsLong(PyTuple_GET_ITEM(flags, j))) < 0 || f[j] > 2) { PyErr_Clear(); Py_RETURN_NONE; }
    res = hc_f77_call(self, alpha, hc_zero, (hc_array *)a, b == Py_None ? NULL : (hc_array *)b, NULL, f, 0, NULL, 0.0);
    if (res == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return res;
}

/* the direct call alone, unrecorded, whatever the session: which 0, matmul(a, b) (numpy's cblas); 2,
   dot(a, b); 1, scipy's ?gemm(alpha, a, b, trans_a=ta, trans_b=tb); None where it does not apply */
PyObject *blasx_hc_direct(int which, PyObject *alpha, PyObject *a, PyObject *b, int ta, int tb) {
    PyObject *args[2] = {a, b}, *res;
    int i = hc_dtype(a);
    if (i < 0 || hc_dtype(b) != i || ((hc_array *)a)->nd != 2 || ((hc_array *)b)->nd != 2 || ta < 0 || ta > 2
            || tb < 0 || tb > 2)
        Py_RETURN_NONE;
    if (which == 0 || which == 2) {
        if (!hc_product_ready(args, NULL, i, which == 0)) Py_RETURN_NONE;
        res = hc_empty(i, ((hc_array *)a)->dimensions[0], ((hc_array *)b)->dimensions[1], 0);
        if (res != NULL && hc_product_into(i, (hc_array *)a, (hc_array *)b, (hc_array *)res, which == 0) < 0)
            Py_CLEAR(res);
        return res;
    }
    res = hc_f77_gemm(i, alpha, hc_zero, (hc_array *)a, (hc_array *)b, ta, tb, Py_None, 0, 0, NULL);
    if (res == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return res;
}

/* level3.host_scale, for the alpha-0 gemms (hc_alpha0) */
int blasx_hc_set_scale(PyObject *fn, PyObject *multiply) {
    if (!PyCallable_Check(fn) || !PyCallable_Check(multiply)) {
        PyErr_SetString(PyExc_TypeError, "blasx_hc_set_scale: not callable");
        return -1;
    }
    if (s_order == NULL && ((s_order = PyUnicode_InternFromString("order")) == NULL
                            || (hc_kw_order = PyTuple_Pack(1, s_order)) == NULL
                            || (hc_kw_out = Py_BuildValue("(s)", "out")) == NULL || (hc_F = PyUnicode_FromString("F")) == NULL))
        return -1;
    Py_INCREF(fn); Py_XSETREF(hc_scale, fn);
    Py_INCREF(multiply); Py_XSETREF(hc_multiply, multiply);
    return 0;
}

/* (take_record, end_clock) as builtin functions (hc_take, hc_end) */
PyObject *blasx_hc_reader(void) {
    if (hc_session == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "blasx_hc_reader before blasx_hc_init");
        return NULL;
    }
    return Py_BuildValue("(NN)", PyCFunction_New(&hc_take_def, NULL), PyCFunction_New(&hc_end_def, NULL));
}

/* the clock of the records: "tsc", "monotonic" (CLOCK_MONOTONIC read here) or "perf_counter" (called) */
PyObject *blasx_hc_clock(void) {
    return PyUnicode_FromString(hc_tsc ? "tsc" : hc_native_clock ? "monotonic" : "perf_counter");
}

/* what the C code reads of x: (nd, shape, strides, flags, dtype), for the layout check */
PyObject *blasx_hc_probe(PyObject *x) {
    hc_array *a = (hc_array *)x;
    PyObject *shape, *strides;
    int d;
    if (Py_TYPE(x) != hc_ndarray) Py_RETURN_NONE;
    shape = PyTuple_New(a->nd); strides = PyTuple_New(a->nd);
    if (shape == NULL || strides == NULL) { Py_XDECREF(shape); Py_XDECREF(strides); return NULL; }
    for (d = 0; d < a->nd; d++) {
        PyTuple_SET_ITEM(shape, d, PyLong_FromSsize_t(a->dimensions[d]));
        PyTuple_SET_ITEM(strides, d, PyLong_FromSsize_t(a->strides[d]));
    }
    return Py_BuildValue("(iNNiO)", a->nd, shape, strides, a->flags, a->descr);
}
"""

KINDS = {"matmul": 0, "dot": 1, "gemm": 2, "lane": 3, "tensordot": 4}
#: routine -> how the C code counts its flops (hostpath.FAST_SHAPES)
FLOPS = {"gemm": 0, "symm": 1, "hemm": 1, "syrk": 2, "herk": 2, "syr2k": 3, "her2k": 3, "trmm": 4, "trsm": 4}
ROLE = {"trans_a": 1, "trans_b": 2, "side": 1, "trans": 1}  # flags the flop count reads (others: 0)
#: flop code -> where the second lane's C code reads each parameter (HOSTCALL_C's hc_fam): the
#: number of parameters, b, beta, c (-1: none), the first flag, the number of flags, overwrite_*
FAMILY = {0: (8, 2, 3, 4, 5, 2, 7), 1: (8, 2, 3, 4, 5, 2, 7), 2: (7, -1, 2, 3, 4, 2, 6), 3: (8, 2, 3, 4, 5, 2, 7),
          4: (8, 2, -1, -1, 3, 4, 7)}
GEMM_NAMES = ("alpha", "a", "b", "beta", "c", "trans_a", "trans_b", "overwrite_c")

BLAS = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.complex64), np.dtype(np.complex128))
#: numpy's matmul copies operands BLAS cannot read as they are and runs BLAS on the copies
#: from 2.3 (numpy PR #23752; 2.3.0's bug with a non-contiguous out, fixed in 2.3.1)
NUMPY_COPIES_STRIDES = np.lib.NumpyVersion(np.__version__) >= "2.3.1"

ENV_PYTHON = "BLASX_HOST_PYTHON"
ENV_TSC = "BLASX_HOST_TSC"
ENV_DIRECT = "BLASX_HOST_DIRECT"  # "0": no direct BLAS calls (numpy's / scipy's functions are called)

_lib = None
_state = None  # None: not tried; "c" or "python"
_direct = {"numpy": None, "scipy": False, "copies": (False, False), "copy_order": (None, None)}  # direct()


def kind() -> str:
    """``"c"`` when the entry points are C callables, else ``"python"``."""
    _library()
    return _state


def _library():
    """The loaded library (ctypes.PyDLL) with its globals set, or None (the Python functions then)."""
    global _lib, _state
    if _state is not None:
        return _lib
    _state = "python"
    if os.environ.get(ENV_PYTHON) or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    try:
        lib = _load()
    except Exception:  # noqa: BLE001 - whatever fails here, the Python functions do the work
        return None
    if lib is not None:
        _lib, _state = lib, "c"
    return lib


def declare(lib):
    """``lib`` (a build of HOSTCALL_C, or of a variant of it) with its functions' C signatures."""
    lib.blasx_hc_init.restype = ctypes.c_int
    lib.blasx_hc_init.argtypes = [ctypes.py_object] * 5 + [ctypes.c_int] * 3
    lib.blasx_hc_new.restype = ctypes.py_object
    lib.blasx_hc_new.argtypes = ([ctypes.c_int] + [ctypes.py_object] * 5 + [ctypes.c_int, ctypes.c_int]
                                 + [ctypes.py_object] * 2 + [ctypes.c_int])
    lib.blasx_hc_probe.restype = ctypes.py_object
    lib.blasx_hc_probe.argtypes = [ctypes.py_object]
    lib.blasx_hc_now.restype = ctypes.py_object
    lib.blasx_hc_now.argtypes = []
    lib.blasx_hc_reader.restype = ctypes.py_object
    lib.blasx_hc_reader.argtypes = []
    lib.blasx_hc_clock.restype = ctypes.py_object
    lib.blasx_hc_clock.argtypes = []
    lib.blasx_hc_set_scale.restype = ctypes.c_int
    lib.blasx_hc_set_scale.argtypes = [ctypes.py_object] * 2
    lib.blasx_hc_set_direct.restype = ctypes.c_int
    lib.blasx_hc_set_direct.argtypes = [ctypes.py_object] * 3
    lib.blasx_hc_direct.restype = ctypes.py_object
    lib.blasx_hc_direct.argtypes = [ctypes.c_int] + [ctypes.py_object] * 3 + [ctypes.c_int] * 2
    lib.blasx_hc_set_copies.restype = None
    lib.blasx_hc_set_copies.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.blasx_hc_lane_lists.restype = ctypes.c_int
    lib.blasx_hc_lane_lists.argtypes = [ctypes.py_object, ctypes.c_int]
    lib.blasx_hc_lane_direct.restype = ctypes.c_int
    lib.blasx_hc_lane_direct.argtypes = [ctypes.py_object] * 2
    lib.blasx_hc_lane_probe.restype = ctypes.py_object
    lib.blasx_hc_lane_probe.argtypes = [ctypes.py_object] * 5
    lib.blasx_hc_lane_routine.restype = ctypes.py_object
    lib.blasx_hc_lane_routine.argtypes = [ctypes.py_object]
    lib.blasx_hc_direct_calls.restype = ctypes.py_object
    lib.blasx_hc_direct_calls.argtypes = []
    return lib


def _load():
    from . import _ufunc_loops as loops
    cc, inc = loops._compiler(), loops._python_include()
    path = loops._compile(cc, HOSTCALL_C, ["-I", inc]) if cc and inc else None
    if path is None:
        return None
    lib = declare(ctypes.PyDLL(str(path)))
    if _init(lib, NUMPY_COPIES_STRIDES) != 0 or not _layout_ok(lib) or not _clock_ok(lib):
        return None
    direct_on = os.environ.get(ENV_DIRECT, "1") != "0"
    set_direct(lib, direct_on, direct_on)
    return lib


def set_direct(lib, numpy_gemm=True, scipy_gemm=True) -> dict:
    """Give ``lib`` the routines of its direct calls (_blas_symbols), keep those whose results are
    numpy's / scipy's bit for bit (``_direct_ok``), and return ``direct()``'s value; False for either
    family: that family calls numpy's / scipy's function."""
    from . import _blas_symbols as sym
    global _direct
    new = sym.numpy_api()
    found = sym.numpy_gemm() if numpy_gemm else None
    f77 = sym.scipy_gemm() if scipy_gemm else None
    lib.blasx_hc_set_direct(new, found and found[1], f77)
    try:
        ok = _direct_ok(lib, found is not None, f77 is not None)
    except Exception:  # noqa: BLE001 - whatever fails here, numpy's / scipy's functions do the work
        ok = (False, False)
    if (found is not None, f77 is not None) != ok:
        lib.blasx_hc_set_direct(new, found[1] if ok[0] else None, f77 if ok[1] else None)
    modes = [0, 0]
    if ok[0]:
        for mode in (1, 2):  # (C order, as numpy 2.4 copies; the operand's nearest order)
            lib.blasx_hc_set_copies(mode, mode)
            try:
                found_ok = _copies_ok(lib)
            except Exception:  # noqa: BLE001 - numpy's functions then copy them
                found_ok = (False, False)
            modes = [m or (mode if f else 0) for m, f in zip(modes, found_ok)]
    lib.blasx_hc_set_copies(*modes)
    _direct = {"numpy": found[0] if ok[0] else None, "scipy": ok[1], "copies": tuple(m != 0 for m in modes),
               "copy_order": tuple({0: None, 1: "C", 2: "nearest"}[m] for m in modes)}
    return dict(_direct)


def _probe_array(rng, shape, dtype: np.dtype, order: str = "C") -> np.ndarray:
    """Random values of ``dtype`` (complex ones with an imaginary part) for the load checks."""
    x = rng.standard_normal(shape) + (1j * rng.standard_normal(shape) if dtype.kind == "c" else 0)
    return np.asarray(x, dtype=dtype, order=order)


def _copies_ok(lib) -> tuple[bool, bool]:
    """Whether direct calls that first copy the operands numpy copies give numpy's bits: matmul of
    operands BLAS cannot read (every other row and column), dot of blocks of larger arrays."""
    rng = np.random.default_rng(20261124)
    ok = [True, True]
    for dt in BLAS:
        big = _probe_array(rng, (40, 36), dt)
        for which, (a, b), ref in ((0, (big[::2, ::2], big[1::2, 1::2].T), np.matmul),
                                   (2, (big[:17, 3:12], big[20:29, 1:6]), np.dot),
                                   (2, (big[:9, :7], np.asfortranarray(big)[5:12, 2:10]), np.dot)):
            got = lib.blasx_hc_direct(which, None, a, b, 0, 0)
            ok[which // 2] = ok[which // 2] and got is not None and got.tobytes() == ref(a, b).tobytes()
    return ok[0], ok[1]


def direct() -> dict:
    """Which direct calls the C entry points make (none without the library): ``"numpy"``, the
    names of numpy's cblas gemm routines that matmul and dot call (None: numpy's functions do),
    ``"scipy"``, whether gemm and the scipy-signature routines call scipy's routines themselves,
    ``"copies"``, whether matmul / dot copy the operands numpy copies before its BLAS call (else
    numpy's functions take those calls), ``"copy_order"`` in which order ("C", or "nearest" the
    operand's strides)."""
    _library()
    return dict(_direct)


def describe() -> str:
    """One line for ``blasx info``: how CPU-only calls are made."""
    if kind() != "c":
        return "host calls: Python entry points (no C compiler or Python headers, or $BLASX_HOST_PYTHON)"
    d = direct()
    numpy_part = (f"numpy's {d['numpy'][1]} (and s/c/z; operands numpy copies copied too: matmul "
                  f"{'yes' if d['copies'][0] else 'no'}, dot {'yes' if d['copies'][1] else 'no'})"
                  if d["numpy"] else "off")
    return (f"host calls: C entry points, clock {clock()}; direct BLAS for matmul/dot: {numpy_part}, "
            f"for the scipy routines: {'scipy.linalg.cython_blas' if d['scipy'] else 'off'}"
            + (f" (${ENV_DIRECT}=0)" if os.environ.get(ENV_DIRECT, "1") == "0" else ""))


def direct_calls() -> int:
    """How many direct BLAS calls the C entry points have made in this process (0 without the library)."""
    lib = _library()
    return 0 if lib is None else lib.blasx_hc_direct_calls()


def _direct_ok(lib, numpy_gemm: bool, scipy_gemm: bool) -> tuple[bool, bool]:
    """Whether each family's direct call gives numpy's (matmul and dot) / scipy's (?gemm) bits, on
    products of every type, operand order and op."""
    import scipy.linalg.blas as sblas
    rng = np.random.default_rng(20261123)
    ok_np, ok_sp = numpy_gemm, scipy_gemm
    for dt in BLAS:
        for (m, k, n), oa, ob in ((s, oa, ob) for s in ((5, 3, 4), (33, 17, 9)) for oa in "CF" for ob in "CF"):
            a, b = _probe_array(rng, (m, k), dt, oa), _probe_array(rng, (k, n), dt, ob)
            if ok_np:
                got, ref = lib.blasx_hc_direct(0, None, a, b, 0, 0), np.matmul(a, b)
                ok_np = (got is not None and got.flags.c_contiguous and got.dtype == dt
                         and got.tobytes() == ref.tobytes() == np.dot(a, b).tobytes())
            if ok_sp:
                gemm = sblas.get_blas_funcs("gemm", dtype=dt)
                for alpha, ta, tb in ((1.0, 0, 0), (0.75, 1, 0), (-1.25, 0, 2), (2, 2, 1)):
                    # F-ordered operands: the wrapper makes the very call the direct one makes (it copies
                    # a C-ordered one, which blasx.gemm hands BLAS as its transpose: another call, whose
                    # bits may differ, 1 ulp with OpenBLAS's small-matrix kernels on a Xeon)
                    x = np.asfortranarray(a if ta == 0 else a.T)
                    y = np.asfortranarray(b if tb == 0 else b.T)
                    got, ref = lib.blasx_hc_direct(1, alpha, x, y, ta, tb), gemm(alpha, x, y, trans_a=ta, trans_b=tb)
                    ok_sp = ok_sp and (got is not None and got.flags.f_contiguous and got.dtype == dt
                                       and got.tobytes(order="F") == ref.tobytes(order="F"))
    return ok_np, ok_sp


def set_scale(host_scale) -> None:
    """The C entry points make an alpha-0 gemm's C = beta C with ``host_scale(beta, c or None, in_place,
    (m, n), dtype)`` (level3.host_scale); before this they hand it to the Python function."""
    lib = _library()
    if lib is not None and lib.blasx_hc_set_scale(host_scale, np.multiply) != 0:
        raise TypeError("set_scale: host_scale is not callable")


def record_reader():
    """``(take_record, end_clock)`` of the C entry points' record, or None without the library
    (level3.last_record). ``take_record()``: the last call they took on this thread, ``(device, t0,
    t1, dtype, real flops)`` (perf_counter's clock), when it is newer than ``level3.last_call.stats``
    (the caller then keeps it there), else None. ``end_clock()``: ``time.perf_counter()``, read by
    the Python paths at the end of a call right before they write ``last_call.stats``: the C record
    is then older (the order is kept in program order, not by comparing clocks)."""
    lib = _library()
    return None if lib is None else lib.blasx_hc_reader()


def clock() -> str:
    """The clock of the C record: ``"tsc"`` (raw time-stamp counter, converted when read),
    ``"monotonic"`` (CLOCK_MONOTONIC read in C), ``"perf_counter"`` (called from C), or ``"python"``
    without the library."""
    lib = _library()
    return "python" if lib is None else lib.blasx_hc_clock()


def _invariant_tsc() -> bool:
    """x86-64 Linux whose kernel reports an invariant TSC (constant_tsc and nonstop_tsc: one rate,
    running in every C-state) and keeps it as a clock source (not marked unstable, e.g. unsynchronized
    between sockets); ``$BLASX_HOST_TSC=0`` turns the TSC off."""
    if os.environ.get(ENV_TSC, "1") == "0" or not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), ())
        with open("/sys/devices/system/clocksource/clocksource0/available_clocksource") as f:
            sources = f.read().split()
    except OSError:
        return False
    return "constant_tsc" in flags and "nonstop_tsc" in flags and "tsc" in sources


def _init(lib, any_strides: bool) -> int:
    """The library's globals; ``any_strides``: numpy's matmul takes operands of any strides."""
    session = importlib.import_module("blasx.session")
    last_call = importlib.import_module("blasx.level3").last_call  # (level3 may be importing: it is set first)
    native = time.get_clock_info("perf_counter").implementation == "clock_gettime(CLOCK_MONOTONIC)"
    return lib.blasx_hc_init(np.ndarray, BLAS, vars(session), last_call, time.perf_counter, int(native),
                             int(any_strides), int(native and _invariant_tsc()))


def _layout_ok(lib) -> bool:
    """What the C code reads of an array is what Python sees, on arrays of every layout it looks at."""
    x = np.zeros((6, 4), dtype=np.complex64)
    ro = np.ones((3, 5), order="F")
    ro.flags.writeable = False
    odd = np.frombuffer(bytearray(8 * 13), dtype=np.uint8)[1:97].view(np.float64).reshape(4, 3)  # misaligned
    for y in (x, x.T, x[::2, 1:], x[0], np.ones(7, np.float32)[::-3], ro, np.empty((2, 0, 3)), odd):
        got = lib.blasx_hc_probe(y)
        fl = y.flags
        bits = (fl.c_contiguous, fl.f_contiguous, fl.owndata, fl.writeable, fl.aligned)
        if got is None or got[:3] != (y.ndim, y.shape, y.strides) or got[4] is not y.dtype or tuple(
                bool(got[3] & m) for m in (0x1, 0x2, 0x4, 0x400, 0x100)) != bits:
            return False
    return True


def _clock_ok(lib) -> bool:
    """The C clock reads time.perf_counter's clock."""
    for _ in range(3):
        t0 = time.perf_counter()
        t = lib.blasx_hc_now()
        if t0 <= t <= time.perf_counter():
            return True
    return False


def _new(slow, kind_: str, fn, dtype=None, alpha=None, flags=None, flops: int = 0, nargs: int = 0, names=None):
    lib = _library()
    if lib is None:
        return slow
    obj = lib.blasx_hc_new(KINDS[kind_], slow, fn, dtype, alpha, flags or {}, flops, nargs, names, None, 0)
    functools.update_wrapper(obj, slow)  # __name__, __doc__, __module__, __qualname__, __wrapped__ ...
    return obj


def matmul(slow, numpy_matmul, dtype_kw: dict):
    """``slow`` (blasx.matmul in Python) behind the C check, or ``slow`` itself without the library.
    ``dtype_kw``: the ``dtype=`` values taken (-> the computation type; numpy_api._DTYPE_KW)."""
    return _new(slow, "matmul", numpy_matmul, names=dtype_kw)


def tensordot(slow, numpy_tensordot):
    return _new(slow, "tensordot", numpy_tensordot)


def dot(slow, numpy_dot):
    return _new(slow, "dot", numpy_dot)


def gemm(slow, routines: dict, scalars: dict):
    """blasx.gemm: ``routines`` (dtype -> scipy's ?gemm) and ``scalars`` (dtype -> alpha's types)."""
    names = _names(slow)
    if names != GEMM_NAMES:
        raise TypeError(f"gemm: parameters {names}, the C code reads {GEMM_NAMES}")
    return _new(slow, "gemm", tuple(routines[d] for d in BLAS), alpha=tuple(frozenset(scalars[d]) for d in BLAS),
                names=names)


def _names(fn) -> tuple:
    """The names of fn's parameters (positional-or-keyword, in order), interned (the C code
    compares keywords by identity first)."""
    code = fn.__code__
    if code.co_posonlyargcount or code.co_kwonlyargcount or code.co_flags & 0x0C:  # (no / * ** in the signature)
        raise TypeError(f"{fn.__qualname__}: only positional-or-keyword parameters")
    return tuple(sys.intern(n) for n in code.co_varnames[:code.co_argcount])


def lane(slow, wrapped, native, routine: str, dtype: np.dtype, alpha_types, flags: dict, nargs: int,
         second, beta_types, convertible, lists: bool = False):
    """A scipy-signature routine in C (hostpath.with_host_path): ``native`` (scipy's routine) for
    the plain call (``nargs`` positional arguments, alpha of ``alpha_types`` and not 0, flags by
    keyword in ``flags``: name -> allowed ints, 2-D arrays of ``dtype`` that fit) as it came, and
    for a call of the second lane (``second``: hostpath.LANES' function, whose parameters name
    scipy's; beta of ``beta_types``, arrays of ``dtype`` or ``convertible`` dtypes) as that
    function calls it; else ``slow``. ``wrapped``: what ``__wrapped__`` names (the whole Python
    function). ``lists``: nested lists as a and b are made arrays first (blasx.linalg.blas)."""
    lib = _library()
    if lib is None:
        return wrapped
    names = _names(second)
    n, b, beta, c, f0, nf, ow = FAMILY[FLOPS[routine]]
    if (len(names) != n or names[:2] != ("alpha", "a") or (b >= 0 and names[b] != "b")
            or (beta >= 0 and names[beta] != "beta") or (c >= 0 and names[c] != "c")
            or not names[ow].startswith("overwrite_") or set(names[f0:f0 + nf]) != set(flags)):
        raise TypeError(f"{routine}: parameters {names} are not where the C code reads them")
    obj = lib.blasx_hc_new(KINDS["lane"], slow, native, dtype, frozenset(alpha_types),
                           {k: (frozenset(v), ROLE.get(k, 0)) for k, v in flags.items()}, FLOPS[routine], nargs,
                           names, frozenset(beta_types), sum(1 << i for i, d in enumerate(BLAS) if d in convertible))
    obj.__wrapped__ = wrapped
    lib.blasx_hc_lane_lists(obj, int(lists))
    _lane_direct(lib, obj, routine, np.dtype(dtype), native, flags, names[f0:f0 + nf])
    return obj


def _lane_direct(lib, obj, routine: str, dtype: np.dtype, native, flags: dict, order: tuple) -> None:
    """Give the lane ``obj`` its scipy routine itself (_blas_symbols.scipy_routine), kept where its
    results are the bits of ``native`` (scipy's wrapper) with each flag at its smallest and at its
    largest allowed value. ``order``: the family's flags in the order the C code reads them."""
    from . import _blas_symbols as sym
    addr = sym.scipy_routine("sdcz"[BLAS.index(dtype)], routine)
    if addr is None:
        return
    lib.blasx_hc_lane_direct(obj, addr)
    try:
        ok = all(_lane_ok(lib, obj, FLOPS[routine], dtype, native, dict(zip(order, (pick(flags[f]) for f in order))))
                 for pick in (min, max))
    except Exception:  # noqa: BLE001 - whatever fails here, scipy's wrapper does the work
        ok = False
    if not ok:
        lib.blasx_hc_lane_direct(obj, None)


def _lane_ok(lib, obj, family: int, dtype: np.dtype, native, flags: dict) -> bool:
    """The lane's direct call gives ``native(1.5, a[, b], **flags)``'s bits on F-ordered operands
    of ``dtype``, m, n, k = 5, 4, 3."""
    rng = np.random.default_rng(20261123)
    fl = tuple(flags.values())

    def rand(shape, diag=0.0):
        return np.asfortranarray(_probe_array(rng, shape, dtype) + diag * np.eye(*shape, dtype=dtype))
    m, n, k = 5, 4, 3
    if family == 0:  # gemm
        a, b = rand((k, m) if fl[0] else (m, k)), rand((n, k) if fl[1] else (k, n))
    elif family in (1, 4):  # symm / hemm, trmm / trsm: a is s x s (a well-conditioned triangle)
        s = n if fl[0] else m
        a, b = rand((s, s), diag=4.0), rand((m, n))
    else:  # syrk / herk, syr2k / her2k
        a = rand((k, n) if fl[0] else (n, k))
        b = rand(a.shape) if family == 3 else None
    got = lib.blasx_hc_lane_probe(obj, 1.5, a, b, fl)
    ref = native(1.5, a, **flags) if b is None else native(1.5, a, b, **flags)
    return (got is not None and got.dtype == ref.dtype and got.shape == ref.shape and got.flags.f_contiguous
            and got.tobytes(order="F") == ref.tobytes(order="F"))
