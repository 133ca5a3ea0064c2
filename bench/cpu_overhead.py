"""What a blasx call costs over the library it stands in for, with the CPU as the only device.

    python -m bench.cpu_overhead                                   # N = 16..512, d and z, the default entries
    python -m bench.cpu_overhead --sizes 64,128,256,512 --dtypes s,d,c,z --rounds 9
    python -m bench.cpu_overhead --entries all --sizes 128         # every entry

With the CPU alone every blasx call is one call of numpy's or scipy's own function after blasx's
checks (blasx.dispatch), so the overhead is those checks: a few microseconds, visible at N = 16,
lost in the noise from N = 128 up. Each entry point is timed against its peer on the same arrays:
``blasx.matmul`` / ``dot`` / ``tensordot`` against numpy's own function, ``blasx.gemm``, the
prefixed functions and the ``blasx.linalg.blas`` level-3 functions against ``scipy.linalg.blas``'s.
Entries with a suffix are calls with c and beta (``-c``), outputs written in place (``-ow``),
alpha 0 (``-a0``), arrays converted to the routine's type (``-conv``), matmul's ``out=`` /
``dtype=`` and dot's ``out=``, alpha a numpy scalar (``-np``), operands given as nested lists
(``-list``), blocks of larger arrays (``-sub``) and every other row and column (``-strided``);
``DEFAULT_ENTRIES`` are run unless ``--entries`` names others (``all``: every one).

The two are interleaved: each round times ``number`` calls of one, then of the other (the order
alternates), with ``number`` calibrated so that one timing takes ``--target-ms``; per-call times
are the best and the median over ``--rounds`` rounds, the overhead blasx minus peer (best, median,
and "paired": the median over the rounds of the difference of a round's two timings). Every blasx
result is checked against the peer's (relative error).

Noise: each round also times the peer a second time (the six orders of the three timings in
turn); ``noise`` is the median over the rounds of the gap between the peer's two timings. An entry
whose paired overhead is within it is "noise"; the run ends with the entries slower by more
(``--no-noise`` skips the A/A timing).
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import timeit

import numpy as np

from blasx.runtime import dtypes

from .offload_threshold import ORDERS, add_blas_threads_option, blas_thread_limits

DEFAULT_SIZES = (16, 64, 128, 256, 512)

#: the entries run unless --entries names others
DEFAULT_ENTRIES = ("matmul", "dot", "tensordot", "gemm-C", "gemm-F", "gemm-c", "gemm-ow", "matmul-out",
                   "linalg-gemm", "linalg-symm", "linalg-hemm", "linalg-syrk", "linalg-herk", "linalg-syr2k",
                   "linalg-her2k", "linalg-trmm", "linalg-trsm", "blasx-syrk-c", "linalg-trsm-ow")


def _arrays(n: int, dtype, order: str, seed: int = 0):
    """Random n x n operands (never zero), a triangular-safe square a (diagonal boosted for TRSM)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)

    def one():
        x = rng.uniform(0.25, 1.25, (n, n)) * rng.choice([-1.0, 1.0], (n, n))
        if dt.kind == "c":
            x = x + 1j * rng.uniform(0.25, 1.25, (n, n))
        return np.asarray(x, dtype=dt, order=order).copy(order=order)

    a, b = one(), one()
    a_tri = np.asarray(a + n * np.eye(n, dtype=dt), order=order)
    return a, b, a_tri


def entries(prefix: str, n: int):
    """name -> (blasx call, peer call) on fresh n x n operands of the prefix's dtype."""
    import scipy.linalg.blas as sp

    import blasx
    from blasx import numpy_api
    from blasx.linalg import blas as bl

    dtype = dtypes.BY_PREFIX[prefix].dtype
    a, b, _ = _arrays(n, dtype, "C")
    af, bf, tri = _arrays(n, dtype, "F", seed=1)
    np_matmul, np_dot, np_tensordot = numpy_api._np_matmul, numpy_api._np_dot, numpy_api._np_tensordot
    spf = {r: sp.get_blas_funcs(r, dtype=dtype) for r in bl.LEVEL3 if prefix in bl.LEVEL3[r]}
    table = {
        "matmul": (lambda: blasx.matmul(a, b), lambda: np_matmul(a, b)),
        "dot": (lambda: blasx.dot(a, b), lambda: np_dot(a, b)),
        "tensordot": (lambda: blasx.tensordot(a, b, 1), lambda: np_tensordot(a, b, 1)),
        "gemm-C": (lambda: blasx.gemm(1.0, a, b), lambda: spf["gemm"](1.0, a, b)),
        "gemm-F": (lambda: blasx.gemm(1.0, af, bf), lambda: spf["gemm"](1.0, af, bf)),
    }
    two = {"gemm": (af, bf), "symm": (af, bf), "hemm": (af, bf), "syrk": (af,), "herk": (af,),
           "syr2k": (af, bf), "her2k": (af, bf), "trmm": (tri, bf), "trsm": (tri, bf)}
    for r, ops in two.items():
        if r in spf:
            ours, theirs = getattr(bl, prefix + r), spf[r]
            table[f"linalg-{r}"] = (lambda f=ours, o=ops: f(1.0, *o), lambda f=theirs, o=ops: f(1.0, *o))
    table.update(general_entries(prefix, n, spf, two))
    table.update(common_entries(prefix, n, spf))
    return table


def common_entries(prefix: str, n: int, spf: dict) -> dict:
    """Calls of the forms users write besides the plain one: alpha a numpy scalar of the routine's
    type (``-np``), operands given as nested lists (``-list``), blocks of larger arrays (``-sub``: a
    unit stride and a leading dimension of 2 n) and every other row and column of one (``-strided``)."""
    import blasx
    from blasx import numpy_api
    from blasx.linalg import blas as bl

    dtype = dtypes.BY_PREFIX[prefix].dtype
    big = _arrays(2 * n, dtype, "C", seed=6)[0]
    af, bf, _ = _arrays(n, dtype, "F", seed=7)
    sub_a, sub_b = big[:n, :n], big[n:, n:]
    st_a, st_b = big[::2, ::2], big[1::2, 1::2]
    la, lb = af.tolist(), bf.tolist()
    alpha = np.dtype(dtype).type(1.5)
    np_matmul, np_dot = numpy_api._np_matmul, numpy_api._np_dot
    g, k = spf["gemm"], spf["syrk"]
    lg, ls, bs = getattr(bl, prefix + "gemm"), getattr(bl, prefix + "syrk"), getattr(blasx, prefix + "syrk")
    return {
        "matmul-sub": (lambda: blasx.matmul(sub_a, sub_b), lambda: np_matmul(sub_a, sub_b)),
        "matmul-strided": (lambda: blasx.matmul(st_a, st_b), lambda: np_matmul(st_a, st_b)),
        "matmul-list": (lambda: blasx.matmul(la, lb), lambda: np_matmul(la, lb)),
        "dot-sub": (lambda: blasx.dot(sub_a, sub_b), lambda: np_dot(sub_a, sub_b)),
        "dot-list": (lambda: blasx.dot(la, lb), lambda: np_dot(la, lb)),
        "gemm-sub": (lambda: blasx.gemm(1.0, sub_a, sub_b), lambda: g(1.0, sub_a, sub_b)),
        "gemm-np": (lambda: blasx.gemm(alpha, af, bf), lambda: g(alpha, af, bf)),
        "linalg-gemm-np": (lambda: lg(alpha, af, bf), lambda: g(alpha, af, bf)),
        "linalg-gemm-list": (lambda: lg(1.0, la, lb), lambda: g(1.0, la, lb)),
        "linalg-syrk-np": (lambda: ls(alpha, af), lambda: k(alpha, af)),
        "blasx-syrk-np": (lambda: bs(alpha, af), lambda: k(alpha, af)),
    }


def general_entries(prefix: str, n: int, spf: dict, two: dict) -> dict:
    """Calls with c and beta, overwrite_* (the output written in place), alpha == 0, arrays of
    another BLAS type (converted), matmul with out= or dtype=, and dot with out=.

    In-place calls get an output of their own on each side (blasx's and the peer's), so that
    neither reads what the other wrote; each converges (c = alpha op(a) op(b) + c / 2) or stays
    put (trmm / trsm in place use a diagonal of +-1: the BLAS does the same work whatever the
    values, and repeated calls neither overflow nor sink into subnormals)."""
    import blasx
    from blasx import numpy_api
    from blasx.linalg import blas as bl

    dtype = dtypes.BY_PREFIX[prefix].dtype
    a, b, _ = _arrays(n, dtype, "C", seed=2)
    af, bf, _ = _arrays(n, dtype, "F", seed=3)
    cf = _arrays(n, dtype, "F", seed=4)[0]
    other = dtypes.BY_PREFIX[OTHER_PRECISION[prefix]].dtype  # converted to the routine's type by both
    conv = {r: tuple(x.astype(other) for x in ops) for r, ops in two.items()}
    signs = np.asfortranarray(np.diag(np.random.default_rng(5).choice([-1.0, 1.0], n)).astype(dtype))
    np_matmul, np_dot = numpy_api._np_matmul, numpy_api._np_dot

    def fresh():
        return cf.copy(order="F")

    def pair(ours, theirs, make):
        """(blasx call, peer call) of fn(out), each side on an output of its own."""
        mine, peers = make(), make()
        return (lambda: ours(mine), lambda: theirs(peers))

    g = spf["gemm"]
    table = {
        "gemm-c": (lambda: blasx.gemm(1.0, af, bf, 0.5, cf), lambda: g(1.0, af, bf, 0.5, cf)),
        "gemm-c-C": (lambda: blasx.gemm(1.0, a, b, 0.5, cf), lambda: g(1.0, a, b, 0.5, cf)),
        "gemm-ow": pair(lambda c: blasx.gemm(1.0, af, bf, 0.5, c, overwrite_c=True),
                        lambda c: g(1.0, af, bf, 0.5, c, overwrite_c=True), fresh),
        "matmul-out": pair(lambda o: blasx.matmul(a, b, out=o), lambda o: np_matmul(a, b, out=o),
                           lambda: np.empty((n, n), dtype)),
        "matmul-dtype": (lambda: blasx.matmul(a, b, dtype=dtype), lambda: np_matmul(a, b, dtype=dtype)),
        "dot-out": pair(lambda o: blasx.dot(a, b, out=o), lambda o: np_dot(a, b, out=o), lambda: np.empty((n, n), dtype)),
    }
    for r, ops in two.items():
        if r not in spf:
            continue
        ours, theirs, pre = getattr(bl, prefix + r), spf[r], getattr(blasx, prefix + r, None)
        cv = conv[r]
        if r in ("trmm", "trsm"):  # no c: b in place, alpha 0 (b = 0)
            table[f"linalg-{r}-ow"] = pair(lambda x, f=ours: f(1.0, signs, x, overwrite_b=1),
                                           lambda x, f=theirs: f(1.0, signs, x, overwrite_b=1), lambda: bf.copy(order="F"))
            table[f"linalg-{r}-a0"] = (lambda f=ours, o=ops: f(0.0, *o), lambda f=theirs, o=ops: f(0.0, *o))
            table[f"linalg-{r}-conv"] = (lambda f=ours, o=cv: f(1.0, *o), lambda f=theirs, o=cv: f(1.0, *o))
            if pre is not None:
                table[f"blasx-{r}-ow"] = pair(lambda x, f=pre: f(1.0, signs, x, overwrite_b=1),
                                              lambda x, f=theirs: f(1.0, signs, x, overwrite_b=1),
                                              lambda: bf.copy(order="F"))
            continue
        table[f"linalg-{r}-c"] = (lambda f=ours, o=ops: f(1.0, *o, 0.5, cf), lambda f=theirs, o=ops: f(1.0, *o, 0.5, cf))
        table[f"linalg-{r}-ow"] = pair(lambda c, f=ours, o=ops: f(1.0, *o, 0.5, c, overwrite_c=1),
                                       lambda c, f=theirs, o=ops: f(1.0, *o, 0.5, c, overwrite_c=1), fresh)
        table[f"linalg-{r}-a0"] = (lambda f=ours, o=ops: f(0.0, *o, 0.5, cf), lambda f=theirs, o=ops: f(0.0, *o, 0.5, cf))
        table[f"linalg-{r}-conv"] = (lambda f=ours, o=cv: f(1.0, *o, 0.5, cf), lambda f=theirs, o=cv: f(1.0, *o, 0.5, cf))
        if pre is not None:
            table[f"blasx-{r}-c"] = (lambda f=pre, o=ops: f(1.0, *o, 0.5, cf), lambda f=theirs, o=ops: f(1.0, *o, 0.5, cf))
    return table


# prefix -> the prefix of the other precision of the same kind: the arrays of a "-conv" entry
OTHER_PRECISION = {"s": "d", "d": "s", "c": "z", "z": "c"}


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, dtype=np.complex128), np.asarray(ref, dtype=np.complex128)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-300))


def calibrate(fn, target_s: float) -> int:
    """Calls per timing so that one timing takes about ``target_s``."""
    t = timeit.Timer(fn).timeit(10) / 10
    return max(1, int(target_s / max(t, 1e-9)))


def compare(ours, peer, rounds: int, target_s: float, noise: bool = True) -> dict:
    """Interleaved timings of ours and peer: per-call best and median (seconds) of each.

    With ``noise``, each round also times the peer a second time (an A/A pair, in one of the six orders
    of the three timings, in turn): ``noise`` is the median over the rounds of |peer again - peer|, how
    far apart two timings of the very same call next to each other in time typically are on this
    machine. An overhead (``paired``) within ``noise`` is one a user cannot tell from numpy's / scipy's own spread.
    """
    number = calibrate(peer, target_s)
    timers = (timeit.Timer(ours), timeit.Timer(peer), timeit.Timer(peer))
    times: tuple[list, list, list] = ([], [], [])
    for r in range(rounds):
        order = ORDERS[r % len(ORDERS)] if noise else ((0, 1) if r % 2 else (1, 0))
        for i in order:
            times[i].append(timers[i].timeit(number) / number)
    t_ours, t_peer, t_again = times
    out = {"number": number, "ours_best": min(t_ours), "ours_med": statistics.median(t_ours),
           "peer_best": min(t_peer), "peer_med": statistics.median(t_peer),
           # each round's timings are next to each other in time: the median of their
           # differences is the least sensitive to drift and to one lucky timing
           "paired": statistics.median(o - p for o, p in zip(t_ours, t_peer))}
    if noise:
        out["noise"] = statistics.median(abs(q - p) for q, p in zip(t_again, t_peer))
    return out


def header() -> str:
    import scipy
    import threadpoolctl

    import blasx
    from blasx import session
    blas = "; ".join(f"{i.get('filepath', '?').rsplit('/', 1)[-1]} {i.get('internal_api')} {i.get('version')} "
                     f"x{i.get('num_threads')}" for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas")
    eng = blasx.engine()
    return (f"# {platform.node()} {platform.machine()}, {platform.python_implementation()} {platform.python_version()}, "
            f"numpy {np.__version__}, scipy {scipy.__version__}\n# BLAS: {blas}\n"
            f"# blasx devices: {', '.join(d.name for d in eng.devices)} (inline: {eng.inline}); "
            f"host route: {session.host_device is not None}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma list of N")
    p.add_argument("--dtypes", default="d,z", help="comma list of s,d,c,z (default d,z)")
    p.add_argument("--entries", default=",".join(DEFAULT_ENTRIES),
                   help="comma list of entry names, or 'all' (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds per entry (default 30)")
    p.add_argument("--target-ms", type=float, default=2.0, help="length of one timing in ms (default 2)")
    p.add_argument("--no-noise", dest="noise", action="store_false",
                   help="skip the A/A timing of each peer (the noise column; a third less time)")
    add_blas_threads_option(p)
    args = p.parse_args(argv)

    import blasx

    blasx.configure(devices="cpu")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    limits = blas_thread_limits(args.blas_threads)
    wanted = None if args.entries == "all" else set(args.entries.split(","))
    print(f"# command: python -m bench.cpu_overhead {' '.join(argv if argv is not None else sys.argv[1:])}")
    try:
        with limits:
            return _run(args, sizes, wanted)
    finally:
        blasx.shutdown()


def _run(args, sizes, wanted) -> int:
    print(header())
    print("# per-call us: best / median over the rounds; overhead = blasx - peer (best, median, paired: median of "
          "the rounds' differences)")
    if args.noise:
        print("# noise: median over the rounds of |peer - peer timed again| in the same round (A/A); verdict: "
              "'noise' when paired <= noise, 'SLOWER' when above it, 'faster' when paired < -noise")
    print(f"{'dtype':>6} {'N':>5} {'entry':<18} {'peer best':>9} {'peer med':>9} {'blasx best':>10} "
          f"{'blasx med':>10} {'ovh best':>9} {'ovh med':>8} {'paired':>7} {'ratio':>6} {'rel err':>8}"
          + (f" {'noise':>6} {'verdict':>7}" if args.noise else ""))
    slower = []
    for code in args.dtypes.split(","):
        for n in sizes:
            for name, (ours, peer) in entries(code.strip(), n).items():
                if wanted is not None and name not in wanted:
                    continue
                err = rel_err(ours(), peer())
                r = compare(ours, peer, args.rounds, args.target_ms / 1e3, noise=args.noise)
                us = {k: v * 1e6 for k, v in r.items() if k != "number"}
                line = (f"{code:>6} {n:>5} {name:<18} {us['peer_best']:>9.2f} {us['peer_med']:>9.2f} "
                        f"{us['ours_best']:>10.2f} {us['ours_med']:>10.2f} "
                        f"{us['ours_best'] - us['peer_best']:>9.2f} {us['ours_med'] - us['peer_med']:>8.2f} "
                        f"{us['paired']:>7.2f} "
                        f"{r['ours_best'] / r['peer_best']:>6.3f} {err:>8.1e}")
                if args.noise:
                    verdict = verdict_of(r["paired"], r["noise"])
                    if verdict == "SLOWER":
                        slower.append(f"{code} {n} {name} (+{us['paired']:.2f} us, noise {us['noise']:.2f})")
                    line += f" {us['noise']:>6.2f} {verdict:>7}"
                print(line, flush=True)
                if not err < (1e-4 if code in "sc" else 1e-12) * max(1.0, math.sqrt(n)):
                    print(f"# WRONG RESULT: {name} {code} N={n}: rel err {err:.1e}")
                    return 1
    if args.noise:
        print(f"# slower than the peer by more than its noise: {len(slower)}" + "".join(f"\n#   {x}" for x in slower))
    return 0


def verdict_of(paired: float, noise: float) -> str:
    """'SLOWER' when blasx's paired overhead exceeds the peer's A/A noise, 'faster' when it is below minus
    the noise, else 'noise'."""
    return "SLOWER" if paired > noise else "faster" if paired < -noise else "noise"


if __name__ == "__main__":
    raise SystemExit(main())
