"""Where the floor of a C host call goes: blasx's C entry points (``blasx/_hostcall.py``) built again
with pieces of their work taken out, each timed against numpy's / scipy's own call in one process.

    python -m bench.scripts.hostcall_breakdown                    # N = 16, float64, one BLAS thread
    python -m bench.scripts.hostcall_breakdown --n 32 --rounds 400 --cases matmul,linalg-gemm

``HOSTCALL_C`` is compiled once per variant (text substitutions of its source; a variant whose
text is not found in the source is skipped with a note), each into a library of its own with its
own globals, and each gives a callable per case made exactly as blasx makes its entry points (the
arguments blasx passed to ``_hostcall.matmul`` / ``lane`` / ``gemm`` at import, recorded by
loading ``blasx._hostcall`` before ``blasx``). The variants of a case and its peer are timed in
rounds, one timing each per round in a rotating order, ``number`` calls per timing (about
``--target-ms``); reported: the median per-call time and the paired overhead over the peer (the
median over the rounds of a variant's timing minus the peer's of the same round). The difference
between two consecutive variants is what the piece taken out cost. ``--micro`` adds the C cost of
single operations (a clock read, a float, a tuple, a setattr on the threading.local), timed in
loops of 10^6 in C. Variants made for the design measured are listed in ``VARIANTS``; the numbers
are only meaningful for the source they were written against. The variants' libraries are not
given the direct BLAS calls (``_hostcall.set_direct``): they time the calls of numpy's / scipy's
functions, the path blasx takes with ``$BLASX_HOST_DIRECT=0``.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import statistics
import sys
import timeit

import numpy as np

#: the callable forwards its arguments to numpy's / scipy's function at once (gemm: scipy's ?gemm
#: of a's dtype, for three positional arguments): what is left is the extra call layer
_FORWARD = [("    PyObject *res;\n    switch (self->kind) {",
             "    PyObject *res;\n    if (self->kind != HC_GEMM) return PyObject_Vectorcall(self->fn, args, nargsf, kwnames);\n"
             "    switch (self->kind) {"),
            ("        return NULL;\n    alpha = v[0]; beta = v[3] == NULL ? hc_zero : v[3];",
             "        return NULL;\n    if (PyVectorcall_NARGS(nargsf) == 3 && kwnames == NULL && (i = hc_dtype(v[1])) >= 0)\n"
             "        return PyObject_Vectorcall(PyTuple_GET_ITEM(self->fn, i), args, 3, NULL);\n"
             "    alpha = v[0]; beta = v[3] == NULL ? hc_zero : v[3];")]

#: name -> [(text in HOSTCALL_C, replacement)], cumulative: each takes out one more piece
VARIANTS_BEFORE = {
    "full": [],
    "-setattr": [("rc = PyObject_SetAttr(hc_tls, s_stats, rec);", "rc = 0;")],
    "-record": [("static int hc_record(PyObject *dev, PyObject *t0, PyObject *dtype, double flops) {",
                 "static int hc_record(PyObject *dev, PyObject *t0, PyObject *dtype, double flops) {\n"
                 "    Py_DECREF(t0); return 0; }\n"
                 "static int hc_record_off(PyObject *dev, PyObject *t0, PyObject *dtype, double flops) {")],
    "-clock": [("static PyObject *hc_now(void) {",
                "static PyObject *hc_now(void) { Py_INCREF(hc_zero); return hc_zero; }\n"
                "static PyObject *hc_now_off(void) {")],
    "-session": [("static PyObject *hc_device(void) {",
                  "static PyObject *hc_device_on(void);\nstatic PyObject *hc_dev_cache;\n"
                  "static PyObject *hc_device(void) {\n"
                  "    if (hc_dev_cache == NULL) hc_dev_cache = hc_device_on();\n"
                  "    Py_XINCREF(hc_dev_cache); return hc_dev_cache; }\n"
                  "static PyObject *hc_device_on(void) {")],
    "-checks": _FORWARD,
}

#: after the C record (issue5-record): the record is C values in thread-local storage
VARIANTS_AFTER = {
    "full": [],
    "-record": [("    if (r->dev != dev && hc_adopt(r, dev) < 0) return -1;\n"
                 "    r->t0 = t0; r->t1 = t1; r->flops = flops; r->di = di;",
                 "    (void)r; (void)dev; (void)t0; (void)di; (void)flops;")],
    "-clock": [("static inline double hc_now(void) {",
                "static inline double hc_now(void) { return 1.0; }\nstatic inline double hc_now_off(void) {")],
    "-session": VARIANTS_BEFORE["-session"],
    "-checks": _FORWARD,
}

#: _FORWARD for the source with gemm's plain-call fast path (forwarded before it, as before the binding)
_FORWARD_FLOOR = [_FORWARD[0],
                  ("    if (kwnames == NULL && PyVectorcall_NARGS(nargsf) == 3) {\n        /* gemm(alpha, a, b)",
                   "    if (PyVectorcall_NARGS(nargsf) == 3 && kwnames == NULL && (i = hc_dtype(args[1])) >= 0)\n"
                   "        return PyObject_Vectorcall(PyTuple_GET_ITEM(self->fn, i), args, 3, NULL);\n"
                   "    if (kwnames == NULL && PyVectorcall_NARGS(nargsf) == 3) {\n        /* gemm(alpha, a, b)")]

#: after the host-call floor (issue5-floor): stamps of the TSC (or the fallback clock), the record's
#: order kept in program order (hc_take / hc_end)
VARIANTS_FLOOR = {
    "full": [],
    "-record": [("    if (r->dev != dev && hc_adopt(r, dev) < 0) return -1;\n"
                 "    r->t0 = t0; r->t1 = t1; r->flops = flops; r->di = di; r->fresh = 1;",
                 "    (void)r; (void)dev; (void)t0; (void)t1; (void)di; (void)flops;")],
    "-clock": [("static inline int hc_stamp_now(hc_stamp *t) {",
                "static inline int hc_stamp_now(hc_stamp *t) { t->tick = 1; return 0; }\n"
                "static inline int hc_stamp_now_off(hc_stamp *t) {")],
    "-session": VARIANTS_BEFORE["-session"],
    "-checks": _FORWARD_FLOOR,
}

MICRO_C = r"""
#include <stdint.h>
/* ns per operation, over n of them: 0 clock_gettime(CLOCK_MONOTONIC), 1 a float made and freed,
   2 a 5-tuple of borrowed items made and freed, 3 a setattr of one tuple on the threading.local,
   4 the session look-up, 5 PySet_Contains of a type in a frozenset of 6 types, 6 rdtsc (x86-64; else
   nothing) */
static PyObject *hc_micro_set;
double blasx_hc_micro(int what, long n) {
    struct timespec a, b;
    PyObject *keep = PyTuple_Pack(5, Py_None, Py_None, Py_None, Py_None, Py_None);
    PyObject *name = PyUnicode_InternFromString("micro_stats");
    long i;
    volatile long sink = 0;
    if (hc_micro_set == NULL) {
        PyObject *l = Py_BuildValue("[OOOOOO]", &PyLong_Type, &PyComplex_Type, &PyBool_Type, &PyTuple_Type,
                                    &PyList_Type, &PyFloat_Type);
        hc_micro_set = PyFrozenSet_New(l);
        Py_DECREF(l);
    }
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (i = 0; i < n; i++) {
        if (what == 0) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); sink += t.tv_nsec; }
        else if (what == 1) { PyObject *f = PyFloat_FromDouble((double)i); Py_DECREF(f); }
        else if (what == 2) { PyObject *t = PyTuple_New(5); int j;
            for (j = 0; j < 5; j++) { Py_INCREF(Py_None); PyTuple_SET_ITEM(t, j, Py_None); } Py_DECREF(t); }
        else if (what == 3) { if (PyObject_SetAttr(hc_tls, name, keep) < 0) { PyErr_Clear(); break; } }
        else if (what == 4) { PyObject *d = PyDict_GetItemWithError(hc_session, s_host_device); sink += d != NULL; }
        else if (what == 5) sink += PySet_Contains(hc_micro_set, (PyObject *)&PyFloat_Type);
        else {
#if defined(HC_HAVE_TSC) && HC_HAVE_TSC
            sink += (long)__rdtsc();
#endif
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    if (what == 3) PyObject_DelAttr(hc_tls, name);
    Py_DECREF(keep); Py_DECREF(name);
    return ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / (double)n;
}
"""

MICRO_OPS = ("clock_gettime(CLOCK_MONOTONIC)", "PyFloat made + freed", "5-tuple made + freed",
             "setattr on level3.last_call (threading.local)", "session dict look-up",
             "PySet_Contains(frozenset of 6 types, float)", "rdtsc")


def _preload():
    """blasx._hostcall loaded before blasx, its constructors wrapped to record their arguments."""
    spec = importlib.util.find_spec("blasx")
    path = spec.submodule_search_locations[0] + "/_hostcall.py"
    mspec = importlib.util.spec_from_file_location("blasx._hostcall", path)
    mod = importlib.util.module_from_spec(mspec)
    sys.modules["blasx._hostcall"] = mod
    mspec.loader.exec_module(mod)
    made = {}
    for name in ("matmul", "dot", "gemm", "lane", "tensordot"):
        orig = getattr(mod, name)

        def wrapper(*args, _orig=orig, _name=name, **kwargs):
            obj = _orig(*args, **kwargs)
            made[obj] = (_orig, args, kwargs)
            return obj
        setattr(mod, name, wrapper)
    return mod, made


def _build(hc, source: str):
    """source compiled and loaded as a library of its own, its globals set as blasx sets its own.
    (Every library keeps its record's guard in the one attribute ``level3.last_call.c_guard``: a
    call of another variant's callable replaces it, so the first call of each timing makes a new
    guard; one setattr per ``number`` calls.)"""
    from blasx import _ufunc_loops as loops
    cc, inc = loops._compiler(), loops._python_include()
    path = loops._compile(cc, source + MICRO_C, ["-I", inc])
    if path is None:
        raise RuntimeError("the variant did not compile")
    lib = hc.declare(ctypes.PyDLL(str(path)))
    lib.blasx_hc_micro.restype = ctypes.c_double
    lib.blasx_hc_micro.argtypes = [ctypes.c_int, ctypes.c_long]
    if hc._init(lib, hc.NUMPY_COPIES_STRIDES) != 0:
        raise RuntimeError("blasx_hc_init failed")
    return lib


def _remake(hc, made, entry, lib):
    """entry (a C callable of blasx) made again on lib."""
    orig, args, kwargs = made[entry]
    saved = hc._lib
    hc._lib = lib
    try:
        return orig(*args, **kwargs)
    finally:
        hc._lib = saved


def _time(fns: dict, rounds: int, target_s: float) -> dict:
    timers = {k: timeit.Timer(f) for k, f in fns.items()}
    peer = timers["peer"]
    number = max(1, int(target_s / max(peer.timeit(200) / 200, 1e-9)))
    names = list(timers)
    got = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            got[k].append(timers[k].timeit(number) / number)
    return {k: (statistics.median(v), statistics.median(x - p for x, p in zip(v, got["peer"]))) for k, v in got.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--dtype", default="d", choices=list("sdcz"))
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--target-ms", type=float, default=1.0)
    p.add_argument("--cases", default="matmul,dot,gemm-F,linalg-gemm,linalg-gemm-c,linalg-syrk-ow")
    p.add_argument("--variants", default="auto",
                   help="before, after, floor or auto (the set written for the source: floor, after, before)")
    p.add_argument("--micro", action="store_true", help="also the C cost of single operations")
    args = p.parse_args(argv)

    hc, made = _preload()
    import threadpoolctl

    import blasx
    from blasx import numpy_api
    from blasx.linalg import blas as bl
    import scipy.linalg.blas as sp

    blasx.configure(devices="cpu")
    blasx.engine()
    kind = args.variants
    if kind == "auto":
        kind = "floor" if "hc_take" in hc.HOSTCALL_C else "after" if "hc_last_record" in hc.HOSTCALL_C else "before"
    variants = {"floor": VARIANTS_FLOOR, "after": VARIANTS_AFTER, "before": VARIANTS_BEFORE}[kind]
    libs, src = {}, hc.HOSTCALL_C
    for name, subs in variants.items():
        for old, new in subs:
            if src.count(old) != 1:
                print(f"# variant {name}: {old[:50]!r} found {src.count(old)} times in HOSTCALL_C: stopped here")
                break
            src = src.replace(old, new)
        else:
            libs[name] = _build(hc, src)
            continue
        break

    dt = {"s": np.float32, "d": np.float64, "c": np.complex64, "z": np.complex128}[args.dtype]
    rng = np.random.default_rng(0)
    n = args.n
    a, b = (np.ascontiguousarray(rng.uniform(0.5, 1.5, (n, n)).astype(dt)) for _ in range(2))
    af, bf, cf = (np.asfortranarray(x) for x in (a, b, a + b))
    co, cp = cf.copy(order="F"), cf.copy(order="F")
    pre = args.dtype
    g, k = sp.get_blas_funcs("gemm", dtype=dt), sp.get_blas_funcs("syrk", dtype=dt)
    cases = {
        "matmul": (blasx.matmul, lambda f: (lambda: f(a, b)), lambda: numpy_api._np_matmul(a, b)),
        "dot": (blasx.dot, lambda f: (lambda: f(a, b)), lambda: numpy_api._np_dot(a, b)),
        "tensordot": (blasx.tensordot, lambda f: (lambda: f(a, b, 1)), lambda: numpy_api._np_tensordot(a, b, 1)),
        "gemm-F": (blasx.gemm, lambda f: (lambda: f(1.0, af, bf)), lambda: g(1.0, af, bf)),
        "linalg-gemm": (getattr(bl, pre + "gemm"), lambda f: (lambda: f(1.0, af, bf)), lambda: g(1.0, af, bf)),
        "linalg-gemm-c": (getattr(bl, pre + "gemm"), lambda f: (lambda: f(1.0, af, bf, 0.5, cf)),
                          lambda: g(1.0, af, bf, 0.5, cf)),
        "linalg-syrk-ow": (getattr(bl, pre + "syrk"), lambda f: (lambda: f(1.0, af, 0.5, co, overwrite_c=1)),
                           lambda: k(1.0, af, 0.5, cp, overwrite_c=1)),
    }
    print(f"# hostcall breakdown ({kind} variants), N={n}, {args.dtype}, {args.rounds} rounds, "
          f"python {sys.version.split()[0]}, numpy {np.__version__}; us per call (median), paired overhead over the peer")
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        if args.micro:
            lib = libs["full"]
            for i, op in enumerate(MICRO_OPS):
                ns = min(lib.blasx_hc_micro(i, 1_000_000) for _ in range(5))
                print(f"# micro: {op:<48} {ns:6.1f} ns")
        for case in args.cases.split(","):
            entry, call, peer = cases[case]
            fns = {"peer": peer}
            for name, lib in libs.items():
                fns[name] = call(_remake(hc, made, entry, lib))
            res = _time(fns, args.rounds, args.target_ms / 1e3)
            row = [f"{name} {med * 1e6:.3f}" + ("" if name == "peer" else f" / {paired * 1e6:+.3f}")
                   for name, (med, paired) in res.items()]
            print(f"{case:<15} " + " | ".join(row), flush=True)
            pieces = [f"{n2}: {(p1 - p2) * 1e6:.3f}" for (n1, (_, p1)), (n2, (_, p2))
                      in zip(list(res.items())[1:], list(res.items())[2:])]
            print(f"{'':<15} cost of each piece taken out (us): " + ", ".join(pieces), flush=True)
    blasx.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
