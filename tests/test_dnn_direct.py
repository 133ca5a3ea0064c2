"""blasx.dnn's device route (conv_direct.py) on the CPU: its plans run by a numpy stand-in of the CUDA
steps (the gather kernel's body line by line, cuBLAS's strided-batched GEMM on flat buffers with every
operand's extent checked, the shifted form's pad and crop copies), against torch in float64; and the
front end's wiring of the route (weight layout, folded scale, epilogue, dW's layout) with the route's
CUDA parts replaced by that stand-in."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from blasx import dnn
from blasx.dnn import conv_transpose as conv_mod
from blasx.dnn import col2im as c2
from blasx.dnn import conv_direct as cd
from blasx.dnn import direct_cache, direct_cuda
from blasx.dnn import gather_kernel as gk
from blasx.dnn import weight_forms as wf
from blasx.dnn import winograd as wg
from blasx.dnn.geometry import conv_geometry, transpose_geometry
from dnn_ref import from_memory, memory
from host_cc import compile_host


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def _wrows(w, cl):
    """The (K, CRS) weight matrix: reduction order (c, r, s), or (r, s, c) for channels-last."""
    return np.ascontiguousarray(np.moveaxis(w, 1, -1) if cl else w).reshape(w.shape[0], -1)


_HOST: dict = {}


def _host_fn(lib_key: str, make_sources, name: str, pointers: int, ints: int):
    """Function ``name`` of the host library ``lib_key`` (built once from ``make_sources()``: kernel operations
    as loops over i), taking ``pointers`` pointers then ``ints`` long longs; None without a C++ compiler."""
    if lib_key not in _HOST:
        _HOST[lib_key] = compile_host(make_sources())
    lib = _HOST[lib_key]
    if lib is None:
        return None
    import ctypes
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_longlong] * ints
    return fn


# a raw kernel's launch as one thread looping over every i, and the CUDA intrinsics it uses
_ONE_THREAD = ("#define __global__\n#define __device__\n#define __forceinline__ inline\n"
               "#define __align__(n) alignas(n)\n"
               "struct blasx_dim3 { unsigned int x, y, z; };\n"
               "static const blasx_dim3 blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0}, blockDim = {1, 1, 1}, "
               "gridDim = {1, 1, 1};\nstruct ulonglong2 { unsigned long long x, y; };\n"
               "static inline unsigned int __umulhi(unsigned int a, unsigned int b) "
               "{ return (unsigned int)(((unsigned long long)a * b) >> 32); }\n")


def host_gather(nd: int, insert: bool, unit: int = 8, index: str = "int32"):
    """The real gather kernel (gather_kernel.source: ``unit``-byte elements, ``index`` indices)
    compiled for the host and launched as one thread, as ``fn(x, col, args, total)`` (the divisors'
    multipliers added); None without a C++ compiler."""
    import ctypes
    if "gather" not in _HOST:
        _HOST["gather"] = compile_host([_ONE_THREAD] + [
            gk.source(u, ix, d, z)[0] for u in (2, 8, 16) for ix in ("int32", "int64") for d in (1, 2, 3)
            for z in (False, True)])
    lib = _HOST["gather"]
    if lib is None:
        return None
    fn = getattr(lib, gk.source(unit, index, nd, insert)[1])
    it = ctypes.c_int if index == "int32" else ctypes.c_longlong
    fn.argtypes = ([ctypes.c_void_p] * 2 + [it] * len(gk.ARG_NAMES) + [ctypes.c_uint] * len(gk.MAGIC_NAMES)
                   + [ctypes.c_longlong])

    def call(x, col, args, total):
        args = tuple(int(a) for a in args)
        fn(x, col, *args, *gk.magic_args(args), total)
    return call


def host_run_gather(nd: int, itemsize: int = 8, index: str = "int32"):
    """The run gather (gather_kernel.run_source) compiled for the host and launched as one thread, as
    ``fn(x, col, args, total)``; None without a C++ compiler."""
    import ctypes
    if "run" not in _HOST:
        _HOST["run"] = compile_host([_ONE_THREAD] + [gk.run_source(u, ix, d)[0] for u in (2, 4, 8)
                                                     for ix in ("int32", "int64") for d in (1, 2, 3)])
    lib = _HOST["run"]
    if lib is None:
        return None
    fn = getattr(lib, gk.run_source(itemsize, index, nd)[1])
    it = ctypes.c_int if index == "int32" else ctypes.c_longlong
    fn.argtypes = ([ctypes.c_void_p] * 2 + [it] * len(gk.RUN_ARG_NAMES) + [ctypes.c_uint] * len(gk.RUN_MAGIC_NAMES)
                   + [ctypes.c_longlong])

    def call(x, col, args, total):
        args = tuple(int(a) for a in args)
        fn(x, col, *args, *gk.magic_args(args, gk.RUN_ARG_NAMES, gk.RUN_DIVISORS), total)
    return call


def run_threads(s, p: int) -> int:
    """The run gather's thread count for step ``s`` over maps of ``p`` pixels."""
    return -(-s.nb * p // gk.RUN_PIXELS) * (s.op // s.run)


def _host_grid(lib_key: str, make_sources, name: str, index: str, pointers: int, ints: int, divisors: int):
    """Grid-stride kernel ``name`` of the host library ``lib_key`` (built once from ``make_sources()``, launched
    as one thread): ``pointers`` pointers, ``ints`` of the ``index`` type, each divisor's multiplier and shift,
    total; None without a C++ compiler."""
    import ctypes
    if lib_key not in _HOST:
        _HOST[lib_key] = compile_host([_ONE_THREAD] + make_sources())
    lib = _HOST[lib_key]
    if lib is None:
        return None
    fn = getattr(lib, name)
    it = ctypes.c_int if index == "int32" else ctypes.c_longlong
    fn.argtypes = [ctypes.c_void_p] * pointers + [it] * ints + [ctypes.c_uint] * 2 * divisors + [ctypes.c_longlong]
    return fn


def host_wino(kind: str, index: str = "int32", m: int = 2):
    """winograd.py's ``kind`` transform of F(m x m, 3x3) (float64, ``index`` indices) compiled for the host and
    launched as one thread, as ``fn(read, written, args..., magic..., total)``; None without a C++ compiler."""
    return _host_grid("wino", lambda: [wg.source(k, np.float64, ix, t)[0] for k in wg.ARG_NAMES
                                       for ix in ("int32", "int64") for t in wg.MATRICES],
                      wg.source(kind, np.float64, index, m)[1], index, 2, len(wg.ARG_NAMES[kind]),
                      len(wg.DIVISORS[kind]))


def host_col2im(nd: int, index: str = "int32", vec: int = 1):
    """col2im.py's kernel (T = A = double, ``index`` indices, ``vec`` outputs a thread) compiled for the host and
    launched as one thread, as ``fn(col, bias or 0, y, args, total)`` (the divisors' multipliers added); None
    without a C++ compiler."""
    fn = _host_grid("col2im", lambda: [c2.source(np.float64, d, ix, v)[0] for d in (1, 2, 3)
                                       for ix in ("int32", "int64") for v in (1, 2)],
                    c2.source(np.float64, nd, index, vec)[1], index, 3, len(c2.ARG_NAMES), len(c2.DIVISORS))
    if fn is None:
        return None

    def call(col, bias, y, args, total):
        args = tuple(int(a) for a in args)
        fn(col, bias, y, *args, *c2.magic_args(args), total)
    return call


class NumpyOps:
    """The CUDA steps in numpy on flat float64 buffers; each gather also run by the real kernel's operation
    compiled for the host (host_gather), whose col must equal the numpy form's bit for bit."""

    def __init__(self, geo, cl, bufs):
        self.geo, self.cl, self.bufs = geo, cl, bufs

    def _mat(self, ref, rows, cols, ld, b, stride):
        buf = self.bufs[ref[0]]
        off = ref[1] + b * stride
        assert ld >= max(1, rows), "cuBLAS needs ld >= the stored rows"
        assert off >= 0 and off + (cols - 1) * ld + rows <= buf.size, f"{ref[0]} read/written out of bounds"
        return np.lib.stride_tricks.as_strided(buf[off:], (rows, cols), (8, ld * 8), writeable=True)

    def ones(self, s):
        self.bufs[s.name][s.offset:s.offset + s.count] = 1.0

    def gemm(self, s):
        for b in range(s.batch):
            a = self._mat(s.a, *((s.m, s.k) if s.op_a == cd.OP_N else (s.k, s.m)), s.lda, b, s.stride_a)
            bb = self._mat(s.b, *((s.k, s.n) if s.op_b == cd.OP_N else (s.n, s.k)), s.ldb, b, s.stride_b)
            c = self._mat(s.c, s.m, s.n, s.ldc, b, s.stride_c)
            prod = (a if s.op_a == cd.OP_N else a.T) @ (bb if s.op_b == cd.OP_N else bb.T)
            assert not np.isnan(prod).any(), "a GEMM read scratch the gather did not write"
            c[...] = prod + (s.beta * c if s.beta else 0.0)

    def gather(self, s):
        """The kernel's operation (gather_kernel.py) on every i < nb * CRS * P."""
        g = self.geo
        (P, CRS, KS, Cg, cl, pf, goff, K1, K2, O1, O2, st0, st1, st2, dl0, dl1, dl2, pl0, pl1, pl2, z0, z1, z2,
         I0, I1, I2, sn, sc, s0, s1, s2, n0, on, orr, op) = cd.gather_args(g, self.cl, s)[:len(gk.ARG_NAMES)]
        if s.run > 1:  # every element of the padded rows (op long): r past CRS is zero
            assert not pf and orr == 1 and op % s.run == 0 and on % s.run == 0 and op >= CRS
            i = np.arange(s.nb * g.p * op)
            r, t = i % op, i // op
            p, j = t % P, t // P
            real = r < CRS
            r = np.minimum(r, CRS - 1)
        elif pf:
            i = np.arange(s.nb * g.crs * g.p)
            p, t = i % P, i // P
            r, j = t % CRS, t // CRS
        else:
            i = np.arange(s.nb * g.crs * g.p)
            r, t = i % CRS, i // CRS
            p, j = t % P, t // P
        if cl or s.run > 1:  # (a run gather's order is (r..., c) in both layouts)
            k, c = r // Cg, r % Cg
        else:
            c, k = r // KS, r % KS
        k2, k1, k0 = k % K2, (k // K2) % K1, k // (K1 * K2)
        o2, o1, o0 = p % O2, (p // O2) % O1, p // (O1 * O2)
        u0, u1, u2 = o0 * st0 - pl0 + k0 * dl0, o1 * st1 - pl1 + k1 * dl1, o2 * st2 - pl2 + k2 * dl2
        ok = (u0 >= 0) & (u1 >= 0) & (u2 >= 0)
        ok &= (np.fmod(u0, z0) == 0) & (np.fmod(u1, z1) == 0) & (np.fmod(u2, z2) == 0)
        u0, u1, u2 = np.trunc(u0 / z0).astype(int), np.trunc(u1 / z1).astype(int), np.trunc(u2 / z2).astype(int)
        ok &= (u0 < I0) & (u1 < I1) & (u2 < I2)
        x, col = self.bufs["x"], self.bufs["col"]
        src = (n0 + j) * sn + (goff + c) * sc + u0 * s0 + u1 * s1 + u2 * s2
        if s.run > 1:
            ok &= real
            r = i % op
        dst = j * on + r * orr + p * op
        assert dst.max() < col.size and len(np.unique(dst)) == dst.size, "the gather's writes collide or overflow"
        assert src[ok].min(initial=0) >= 0 and src[ok].max(initial=0) < x.size
        col[dst] = np.where(ok, x[np.where(ok, src, 0)], 0.0)
        if s.run > 1:  # (a float64 plan's runs: other element sizes, test_run_gather_moves_bits_...)
            for index in ("int32", "int64") if s.run == gk.RUN_BYTES // 8 else ():
                fn = host_run_gather(g.nd, 8, index)
                if fn is None:
                    break
                got = np.full(col.size, np.nan)
                fn(x.ctypes.data, got.ctypes.data, cd.gather_args(g, self.cl, s), run_threads(s, g.p))
                assert np.array_equal(got[dst], col[dst]), f"the run gather ({index}) differs from its numpy form"
                assert np.isnan(np.delete(got, dst)).all(), "the run gather wrote outside its elements"
            return
        for index in ("int32", "int64"):  # divisions by multipliers, and plain ones
            fn = host_gather(g.nd, any(z != 1 for z in g.insert), 8, index)
            if fn is None:
                break
            got = np.full(col.size, np.nan)
            fn(x.ctypes.data, got.ctypes.data, cd.gather_args(g, self.cl, s), i.size)
            assert np.array_equal(got[dst], col[dst]), f"the compiled gather ({index}) differs from its numpy form"
            assert np.isnan(np.delete(got, dst)).all(), "the compiled gather wrote outside its elements"

    def weight_order(self, s):
        g = self.geo
        self.bufs["wt"][...] = self.bufs["w"].reshape(g.c, g.kg, -1).transpose(0, 2, 1).ravel()

    def col2im(self, s):
        """y's chunk summed from col tap by tap (an independent numpy form of col2im.py's kernel), and the real
        kernel's body compiled for the host (host_col2im), whose y must equal it to rounding."""
        g, col, y = self.geo, self.bufs["col"], self.bufs["y"]
        bias = self.bufs.get("bias")
        assert not np.isnan(col[:s.nb * g.k * int(np.prod(g.kernel)) * int(np.prod(g.in_size))]).any()
        nd, taps, pin = g.nd, int(np.prod(g.kernel)), int(np.prod(g.in_size))
        pad = [d * (k - 1) - lo for d, k, lo in zip(g.dilation, g.kernel, g.pad_lo)]
        rows = (g.groups, *((taps, g.kg) if s.wcl else (g.kg, taps)))  # a group's rows
        cols = col[:s.nb * pin * g.k * taps]
        if self.cl:
            cols = cols.reshape(s.nb, *g.in_size, *rows)  # (n, i..., group, rows of a group)
        else:  # NCHW: (n, rows, i...) pixels contiguous
            cols = np.moveaxis(cols.reshape(s.nb, *rows, *g.in_size), tuple(range(1, 4)), tuple(range(-3, 0)))
        if not s.wcl:
            cols = np.swapaxes(cols, -1, -2)  # (n, i..., group, tap, co)
        acc = np.zeros((s.nb, *g.out_size, g.groups, g.kg))
        for t, tap in enumerate(np.ndindex(*g.kernel)):
            idx = []
            for o, stride, d, p, r, n_in in zip(g.out_size, g.insert, g.dilation, pad, tap, g.in_size):
                h = np.arange(o)
                num = h + p - r * d
                ok = (num >= 0) & (num % stride == 0) & (num // stride < n_in)
                idx.append((h[ok], (num // stride)[ok]))
            sel_out = np.ix_(*[a for a, _ in idx]) if nd > 1 else (idx[0][0],)
            sel_in = np.ix_(*[b for _, b in idx]) if nd > 1 else (idx[0][1],)
            acc[(slice(None), *sel_out)] += cols[(slice(None), *sel_in)][..., t, :]
        acc = acc.reshape(s.nb, *g.out_size, g.k)
        if bias is not None:
            acc = acc + bias
        if not self.cl:
            acc = np.moveaxis(acc, -1, 1)
        base = s.n0 * g.k * int(np.prod(g.out_size))
        y[base:base + acc.size] = acc.ravel()
        vec = c2.vector(g, self.cl, np.float64)
        for index, v, off in (("int32", 1, 0), ("int64", 1, 0), ("int32", vec, 0), ("int32", vec, 1)):
            fn = host_col2im(nd, index, v)  # divisions by multipliers and plain ones; runs of v outputs, y's
            if fn is None:                  # start aligned to 16 bytes and not (off 1: the kernel's scalar stores)
                break
            mem = np.full(acc.size + base + 2, np.nan)
            mem = mem[(-mem.ctypes.data // 8) % 2 + off:]  # 16-byte aligned, then one element on where off
            got = mem[:acc.size + base]
            fn(col.ctypes.data, None if bias is None else np.asarray(bias, np.float64).ctypes.data,
               got.ctypes.data, c2.kernel_args(g, self.cl, s), c2.threads(g, s, v))
            assert np.isnan(got[:base]).all() and np.allclose(got[base:], acc.ravel(), rtol=1e-12, atol=1e-12)
            assert np.isnan(mem[acc.size + base:]).all(), "the col2im kernel wrote past y"

    def wino(self, s):
        """A Winograd transform (winograd.py) in numpy from its matrices, and the real kernel's body compiled for
        the host (host_wino), whose output must equal it to rounding."""
        g, b, m = self.geo, self.bufs, s.m
        a = m + 2
        th, tw = wg.tiles(g, m)
        BT, G, AT = (np.array(mat, float) for mat in wg.MATRICES[m])
        if s.kind == "filter":  # u[xi] (K x C) column-major: (xi, c, k)
            w = b["w"][:g.k * g.crs].reshape(g.k, *((3, 3, g.c) if self.cl else (g.c, 3, 3)))
            w = np.moveaxis(w, -1, 1) if self.cl else w
            want = np.einsum("ar,kcrs,bs->abck", G, w, G).ravel()
            dst, src = "u", "w"
        elif s.kind == "input":  # v[xi] (C x Pc): (xi, n, th, tw, c)
            x = from_memory(b["x"], (g.n, g.c, *g.in_size), self.cl)[s.n0:s.n0 + s.nb]
            lo = g.pad_lo
            hi = [m * t + 2 - lo_ - n for t, lo_, n in zip((th, tw), lo, g.in_size)]
            xp = np.pad(x, ((0, 0), (0, 0), *((max(0, q), max(0, z)) for q, z in zip(lo, hi))))
            xp = xp[:, :, max(0, -lo[0]):, max(0, -lo[1]):]
            d = np.lib.stride_tricks.sliding_window_view(xp, (a, a), axis=(2, 3))[:, :, ::m, ::m][:, :, :th, :tw]
            want = np.einsum("ai,ncpqij,bj->abnpqc", BT, d, BT).ravel()
            dst, src = "v", "x"
        elif s.kind == "weight":  # dW (K, CRS) from u[xi] (K x C): (xi, c, k)
            mm = b["u"][:a * a * g.c * g.k].reshape(a, a, g.c, g.k)
            dw = np.einsum("ar,abck,bs->kcrs", G, mm, G)
            want = (np.moveaxis(dw, 1, -1) if self.cl else dw).ravel()
            dst, src = "dw", "u"
        elif s.kind == "dy":  # e[xi] (K x Pc): (xi, n, th, tw, k) from dY's m x m tiles, zero past its end
            dy = from_memory(b["dy"], (g.n, g.k, *g.out_size), self.cl)[s.n0:s.n0 + s.nb]
            dy = np.pad(dy, ((0, 0), (0, 0), (0, m * th - g.out_size[0]), (0, m * tw - g.out_size[1])))
            t = dy.reshape(s.nb, g.k, th, m, tw, m)
            want = np.einsum("ia,nkpiqj,jb->abnpqk", AT, t, AT).ravel()
            dst, src = "e", "dy"
        else:  # y's chunk from m[xi] (K x Pc): (xi, n, th, tw, k)
            mm = b["m"][:a * a * g.k * s.nb * th * tw].reshape(a, a, s.nb, th, tw, g.k)
            out = np.einsum("ia,abnpqk,jb->nkpiqj", AT, mm, AT).reshape(s.nb, g.k, m * th, m * tw)
            out = out[:, :, :g.out_size[0], :g.out_size[1]]
            base = s.n0 * g.k * g.p
            want = memory(out, self.cl)
            b["y"][base:base + want.size] = want
            dst, src = None, "m"
        if dst is not None:
            b[dst][:want.size] = want
        for index in ("int32", "int64"):  # divisions by multipliers, and plain ones
            fn = host_wino(s.kind, index, m)
            if fn is None:
                break
            got = np.full((b["y"].size if dst is None else want.size) + 8, np.nan)
            if dst is None:
                got[:base] = b["y"][:base]
            args = wg.kernel_args(g, self.cl, s)
            fn(b[src].ctypes.data, got.ctypes.data, *args,
               *gk.magic_args(args, wg.ARG_NAMES[s.kind], wg.DIVISORS[s.kind]), wg.threads(g, s))
            ref = b["y"][:base + want.size] if dst is None else want
            assert np.allclose(got[:ref.size], ref, rtol=1e-12, atol=1e-12), f"the {s.kind} kernel ({index})"
            assert np.isnan(got[ref.size:]).all(), f"the {s.kind} kernel wrote past its output"

    def copy_dy(self, s):
        g = self.geo
        dy = self.bufs["dy"].reshape(g.n, g.k, g.p)
        self.bufs["dyc"][:g.k * s.nb * g.p] = dy[s.n0:s.n0 + s.nb].transpose(1, 0, 2).ravel()

    def pad(self, s):
        xp = self.bufs["xp"]
        if s.clear:
            xp[...] = 0.0
        dst, src = cd.pad_views(self.geo, self.cl, s, self.bufs["x"], xp)
        assert np.shares_memory(dst, xp) and dst.shape == src.shape
        dst[...] = src

    def crop(self, s):
        if s.clear:
            self.bufs["yw"][...] = 0.0
        yv, wv = cd.crop_views(self.geo, self.cl, s, self.bufs["y"], self.bufs["yw"])
        assert np.shares_memory(yv, self.bufs["y"]) and np.shares_memory(wv, self.bufs["yw"])
        assert yv.shape == wv.shape
        if s.to_y:
            assert not np.isnan(wv).any(), "a crop read wide output no GEMM wrote"
            yv[...] = wv
        else:
            wv[...] = yv


def emulated_forward(geo, xmem, cl, wrows, ymem, residual, budget, form=None):
    """conv_direct.forward's steps on numpy buffers (y's memory written in place); ``form`` None:
    conv_direct's choice (``FORM`` included). Returns (image chunks, form)."""
    form = cd.forward_form(geo, np.float64, cd.FORM) if form is None else form
    if form in ("implicit", "winograd") and residual is not None:  # as direct_cuda.forward_plan: a sum into y
        form = "im2col"
    steps, scratch = cd.forward_plan(geo, cl, np.float64, 0.0 if residual is None else 1.0, budget, form)
    rows = cd.padded_rows(steps)
    w = wrows if rows is None else cd.pad_reduction(np, wrows, rows, channels=0 if cl else geo.c)
    bufs = {"x": xmem, "w": w.ravel(), "y": ymem, **{k: np.full(v, np.nan) for k, v in scratch.items()}}
    if form == "shifted":
        bufs["wt"] = cd.tap_major(np, geo, cl, wrows).ravel()
    if residual is not None:
        ymem[...] = residual
    cd.run(steps, NumpyOps(geo, cl, bufs))
    return [(s.n0, s.nb) for s in steps if isinstance(s, (cd.Gather, cd.Pad))] or [(0, geo.n)], form


def emulated_weight(geo, xmem, dymem, cl, budget, form="im2col", slots=None):
    """The weight plan of ``form`` on numpy buffers: (dW as (K, CRS), the image chunks)."""
    if form == "winograd":
        steps, scratch = wg.weight_plan(geo, np.float64, budget)
        parts = [(s.n0, s.nb) for s in steps if isinstance(s, wg.Wino) and s.kind == "input"]
    elif form == "shifted":
        parts = cd.chunks(geo.n, wf.shifted_scratch(geo) * 8, budget)
        steps = wf.shifted_steps(geo, parts)
        scratch = cd.shifted_buffers(geo, True, max(nb for _, nb in parts))
    elif form == "batched":
        parts = cd.chunks(geo.n, (geo.k * geo.c + 1) * 8, budget)
        slots = slots or max(nb for _, nb in parts)
        steps = wf.batched_steps(geo, parts, slots)
        scratch = {"dwp": wf.batched_scratch(geo, slots, np.float64)}
    else:
        pad = cd.reduction_pad(geo, cl, 8)
        per = wf.weight_scratch(geo, cl, pad)
        parts = cd.chunks(geo.n, per * 8, budget)
        nb = max(nb for _, nb in parts)
        steps = wf.weight_steps(geo, cl, parts, pad)
        scratch = {"col": nb * (geo.crs if pad is None else pad[0]) * geo.p, "dyc": nb * geo.k * geo.p}
    rows = cd.padded_rows(steps)  # (K, rows) in the order (r..., c): as direct_cuda.run_weight_plan takes it
    bufs = {"x": xmem, "dy": dymem, "y": dymem, "dw": np.full(geo.k * (rows or geo.crs), np.nan),
            **{k: np.full(v, np.nan) for k, v in scratch.items()}}
    cd.run(steps, NumpyOps(geo, cl, bufs))
    dw = bufs["dw"].reshape(geo.k, rows or geo.crs)
    if rows is not None:
        assert not dw[:, geo.crs:].any()  # the padding's columns: zero
        dw = dw[:, :geo.crs]
        if not cl:
            dw = dw.reshape(geo.k, -1, geo.c).transpose(0, 2, 1)
        dw = np.ascontiguousarray(dw).reshape(geo.k, geo.crs)
    return dw, parts


def emulated_transposed(geo, xmem, cl, wmem, wcl, ymem, bias, budget):
    """direct_cuda.transposed's plan (col2im.py) on numpy buffers; returns the image chunks."""
    per = c2.scratch_per_image(geo)
    parts = cd.chunks(geo.n, per * 8, budget)
    bufs = {"x": xmem, "w": wmem, "y": ymem, "col": np.full(max(nb for _, nb in parts) * per, np.nan),
            "wt": np.full(wmem.size, np.nan)}
    if bias is not None:
        bufs["bias"] = np.asarray(bias, np.float64)
    cd.run(c2.steps(geo, cl, wcl, parts), NumpyOps(geo, cl, bufs))
    return parts


TRANSPOSED = st.tuples(st.sampled_from([1, 2, 3]), st.booleans(), st.booleans(), st.sampled_from([2, 3]),
                       st.integers(0, 2), st.integers(1, 2), st.sampled_from([1, 2]), st.sampled_from([1, 2, 3]),
                       st.booleans(), st.integers(0, 1000))


@settings(max_examples=40, deadline=None)
@given(TRANSPOSED, st.sampled_from([1 << 30, 1]))
def test_col2im_plans_vs_torch(case, budget):
    """Strided transposed convolutions (and backward-data) by col2im.py's plan: both layouts of x and y, both
    orders of the weight, groups, dilation, output padding, bias; budget 1: one image a chunk."""
    nd, cl, wcl, stride, pad, dil, groups, ks, with_bias, seed = case
    rng = np.random.default_rng(seed)
    kg = 3 + seed % 2  # 4: channels-last runs of two outputs a thread (col2im.vector)
    x, _ = _case(rng, nd, groups, 2, 3, 3)
    w = rng.standard_normal((2 * groups, kg, *(ks,) * nd))
    b = rng.standard_normal(kg * groups) if with_bias else None
    opad = min(stride, dil) - 1 if (stride > 1 or dil > 1) else 0
    try:
        geo = transpose_geometry("t", nd, x, w, stride, pad, opad, groups, dil)
    except ValueError:
        return  # no positive output
    ref = getattr(F, f"conv_transpose{nd}d")(torch.from_numpy(x), torch.from_numpy(w),
                                             None if b is None else torch.from_numpy(b), stride, pad, opad, groups,
                                             dil).numpy()
    assert c2.applies(geo, np.float64)
    wmem = (np.ascontiguousarray(np.moveaxis(w, 1, -1)) if wcl else w).ravel()
    ymem = np.full(ref.size, np.nan)
    parts = emulated_transposed(geo, memory(x, cl), cl, wmem, wcl, ymem, b, budget)
    assert len(parts) == (1 if budget > 1 else geo.n)
    assert _rel(from_memory(ymem, ref.shape, cl), ref) < 1e-13


def _case(rng, nd, groups, cg, kg, n):
    size = (11, 7, 5)[:nd] if nd < 3 else (5, 6, 4)
    x = rng.standard_normal((n, cg * groups, *size))
    return x, size


CASES = st.tuples(st.sampled_from([1, 2, 3]), st.booleans(), st.integers(1, 3), st.integers(0, 2),
                  st.integers(1, 2), st.sampled_from([1, 2]), st.sampled_from([1, 3]), st.integers(0, 1000))


@settings(max_examples=40, deadline=None)
@given(CASES, st.sampled_from([1 << 30, 1]))
def test_forward_and_weight_plans_vs_torch(case, budget):
    """Forward (and backward-weights) by the route's plans; budget 1: one image a chunk."""
    nd, cl, stride, pad, dil, groups, ks, seed = case
    rng = np.random.default_rng(seed)
    x, _ = _case(rng, nd, groups, 2, 3, 3)
    w = rng.standard_normal((3 * groups, 2, *(ks,) * nd))
    try:
        geo = conv_geometry("conv", nd, x, w, stride, pad, dil, groups)
    except ValueError:
        return  # kernel larger than the padded input
    ref = getattr(F, f"conv{nd}d")(torch.from_numpy(x), torch.from_numpy(w), None, stride, pad, dil, groups).numpy()
    ymem = np.full(ref.size, np.nan)
    parts, _ = emulated_forward(geo, memory(x, cl), cl, _wrows(w, cl), ymem, None, budget, "im2col")
    assert len(parts) // (1 if cd.pointwise(geo) else groups) == (1 if budget > 1 or cd.pointwise(geo) else geo.n)
    assert _rel(from_memory(ymem, ref.shape, cl), ref) < 1e-13
    dy = rng.standard_normal(ref.shape)
    dw, _ = emulated_weight(geo, memory(x, cl), memory(dy, cl), cl, budget)
    want = getattr(torch.nn.grad, f"conv{nd}d_weight")(torch.from_numpy(x), w.shape, torch.from_numpy(dy), stride,
                                                        pad, dil, groups).numpy()
    got = np.moveaxis(dw.reshape(w.shape[0], *w.shape[2:], w.shape[1]), -1, 1) if cl else dw.reshape(w.shape)
    assert _rel(got, want) < 1e-13


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([1, 2, 3]), st.booleans(), st.integers(1, 3), st.integers(0, 1), st.integers(1, 2),
       st.sampled_from([1, 2]), st.integers(0, 1000))
def test_transposed_plan_with_residual_vs_torch(nd, cl, stride, pad, dil, groups, seed):
    """conv_transpose (zero insertion in the gather) with a residual (beta 1 on y)."""
    rng = np.random.default_rng(seed)
    x, _ = _case(rng, nd, groups, 2, 2, 2)
    wt = rng.standard_normal((2 * groups, 3, *(3,) * nd))
    opad = 1 if stride > 1 else 0
    geo = transpose_geometry("t", nd, x, wt, stride, pad, opad, groups, dil)
    ref = getattr(F, f"conv_transpose{nd}d")(torch.from_numpy(x), torch.from_numpy(wt), None, stride, pad, opad,
                                             groups, dil).numpy()
    res = rng.standard_normal(ref.shape)
    wf = conv_mod._flipped_transposed(np, wt, groups)
    ymem = np.full(ref.size, np.nan)
    emulated_forward(geo, memory(x, cl), cl, _wrows(wf, cl), ymem, memory(res, cl), 1, "im2col")
    assert _rel(from_memory(ymem, ref.shape, cl), ref + res) < 1e-13


# ---------------------------------------------------------------- the shifted form

SHIFTED = st.tuples(st.sampled_from([1, 2, 3]), st.booleans(), st.sampled_from([0, 1, 2, ((0, 2), (1, 0), (2, 1))]),
                    st.integers(1, 2), st.sampled_from([2, 3]), st.booleans(), st.integers(0, 1000))


def _shifted_case(case):
    """(rng, geo, x, w, x padded explicitly where the padding is asymmetric, torch's padding) of a SHIFTED case;
    None where its geometry is not a valid one."""
    nd, _, pad, dil, ks, _, seed = case
    rng = np.random.default_rng(seed)
    x, _ = _case(rng, nd, 1, 3, 4, 3)
    w = rng.standard_normal((4, 3, *(ks,) * nd))
    pad = pad if isinstance(pad, int) else pad[:nd]
    try:
        geo = conv_geometry("conv", nd, x, w, 1, pad, dil, 1)
    except ValueError:
        return None
    tpad = pad if isinstance(pad, int) else 0
    xt = x if isinstance(pad, int) else np.pad(x, ((0, 0), (0, 0), *pad))
    return rng, geo, x, w, xt, tpad


@settings(max_examples=60, deadline=None)
@given(SHIFTED, st.sampled_from([1 << 30, 1]))
def test_shifted_plan_vs_torch(case, budget):
    """Stride-1 convolution in the shifted form, any padding (asymmetric too) and dilation, with and
    without a residual; budget 1: one image a chunk (xp and yw exactly one image: every GEMM's extent
    is checked against them)."""
    nd, cl, _, dil, _, with_res, _ = case
    made = _shifted_case(case)
    if made is None:
        return
    rng, geo, x, w, xt, tpad = made
    ref = getattr(F, f"conv{nd}d")(torch.from_numpy(xt), torch.from_numpy(w), None, 1, tpad, dil).numpy()
    res = rng.standard_normal(ref.shape) if with_res else None
    ymem = np.full(ref.size, np.nan)
    parts, form = emulated_forward(geo, memory(x, cl), cl, _wrows(w, cl), ymem,
                                   None if res is None else memory(res, cl), budget, "shifted")
    assert len(parts) == (1 if budget > 1 else geo.n)
    want = ref if res is None else ref + res
    assert _rel(from_memory(ymem, ref.shape, cl), want) < 1e-13


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([1, 2, 3]), st.booleans(), st.integers(0, 2), st.integers(1, 2), st.integers(0, 1000))
def test_shifted_transposed_stride1_vs_torch(nd, cl, pad, dil, seed):
    """A stride-1 conv_transpose (backward-data's form) runs shifted too, padding beyond the kernel's
    reach (a negative pad_lo: x cropped) included."""
    rng = np.random.default_rng(seed)
    x, _ = _case(rng, nd, 1, 3, 2, 2)
    wt = rng.standard_normal((3, 2, *(3,) * nd))
    try:
        geo = transpose_geometry("t", nd, x, wt, 1, pad + dil, 0, 1, dil)
    except ValueError:
        return
    assert cd.shifted_applies(geo)
    ref = getattr(F, f"conv_transpose{nd}d")(torch.from_numpy(x), torch.from_numpy(wt), None, 1, pad + dil, 0, 1,
                                             dil).numpy()
    wf = conv_mod._flipped_transposed(np, wt, 1)
    ymem = np.full(ref.size, np.nan)
    emulated_forward(geo, memory(x, cl), cl, _wrows(wf, cl), ymem, None, 1, "shifted")
    assert _rel(from_memory(ymem, ref.shape, cl), ref) < 1e-13


def test_forward_form_choice():
    """Shifted where it applies, for tensor-core types inside a Workspace, and C >= 64 with 16-byte rows and a wide
    grid at most 1.5 times the output; strict 4- and 8-byte types take im2col; a forced form only where shifted
    applies; a bad force names the switch."""
    def geo(c=64, k=3, stride=1, pad=1, groups=1, size=14):
        return conv_geometry("conv", 2, np.zeros((2, c, size, size)), np.zeros((8, c // groups, k, k)), stride,
                             pad, 1, groups)
    f32, f16 = np.float32, np.float16
    assert cd.forward_form(geo(), f32) == "im2col" and cd.forward_form(geo(), np.float64) == "im2col"
    assert cd.forward_form(geo(), f16) == "im2col" and cd.forward_form(geo(), f32, math="tf32") == "im2col"
    with direct_cache.using(direct_cache.Workspace()):  # a network's worker: GPU time alone decides
        assert cd.forward_form(geo(), f16) == "shifted" and cd.forward_form(geo(), f32, math="tf32") == "shifted"
        assert cd.forward_form(geo(), f32) == "im2col"  # strict: the one GEMM at k = C R S
        assert cd.forward_form(geo(c=32), f16) == "im2col"  # k = C too small for cuBLAS
        assert cd.forward_form(geo(c=72), f16) == "shifted" and cd.forward_form(geo(c=68), f16) == "im2col"  # 136-B rows
        assert cd.forward_form(geo(size=4), f16) == "im2col"  # 6x6 wide grid for 4x4 outputs
    for g in (geo(stride=2), geo(groups=2), geo(k=1, pad=0)):
        assert cd.forward_form(g, f32) == "im2col" and cd.forward_form(g, f32, "shifted") == "im2col"
    assert cd.forward_form(geo(c=8), f32, "shifted") == "shifted"
    assert cd.forward_form(geo(), f32, "im2col") == "im2col"
    with pytest.raises(ValueError, match="BLASX_CONV_FORM.*'wide'"):
        cd.forward_form(geo(), f32, "wide")


def test_shifted_plan_exact():
    """Channels-last: per tap yw^T (K x m) = wt_t xp_off^T; NCHW: yw (m x K, ld rounded to 8) = xp_off
    wt_t^T; m ends at the last valid output pixel; a residual goes into yw before beta-1 GEMMs."""
    x = np.zeros((2, 4, 5, 6))
    geo = conv_geometry("conv", 2, x, np.zeros((3, 4, 3, 3)), 1, 2, 2, 1)  # dilation 2: 9x10 padded, 5x6 out
    assert cd.padded_size(geo) == (9, 10) and cd.wide_rows(geo, 2) == 90 + 4 * 10 + 5 + 1
    cl = cd.shifted_steps(geo, True, [(0, 2)], 1.0)
    assert [type(s).__name__ for s in cl] == ["Pad", "Crop"] + ["Gemm"] * 9 + ["Crop"]
    assert cl[0] == cd.Pad(0, 2, True) and cl[1] == cd.Crop(0, 2, False) and cl[-1] == cd.Crop(0, 2, True)
    m = 136
    assert cl[2] == cd.Gemm(("wt", 0), ("xp", 0), ("yw", 0), 1, 0, 3, m, 4, 36, 4, 3, 0, 0, 0, 1, 1.0)
    assert cl[2 + 4] == cd.Gemm(("wt", 16), ("xp", (2 * 10 + 2) * 4), ("yw", 0), 1, 0, 3, m, 4, 36, 4, 3, 0, 0, 0,
                                1, 1.0)
    nchw = cd.shifted_steps(geo, False, [(0, 1), (1, 1)], 0.0)
    assert len(nchw) == 2 * 11 and nchw[11] == cd.Pad(1, 1, False)
    assert nchw[1] == cd.Gemm(("xp", 0), ("wt", 0), ("yw", 0), 1, 0, 46, 3, 4, 4, 36, 96, 0, 0, 0, 1, 0.0)
    assert nchw[2].beta == 1.0 and nchw[-2].b == ("wt", 32) and nchw[-2].a == ("xp", 44 * 4)
    assert cd.shifted_buffers(geo, False, 1) == {"xp": 90 * 4, "yw": 3 * 96}
    assert cd.shifted_buffers(geo, True, 2) == {"xp": 180 * 4, "yw": 180 * 3}


def test_chunks():
    assert cd.chunks(10, 100, 350) == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert cd.chunks(4, 100, 10) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert cd.chunks(4, 0, 10) == [(0, 4)]
    assert cd.chunks(4, 100, 1 << 40) == [(0, 4)]


def test_plan_shapes_exact():
    """NCHW: one strided-batched GEMM per chunk and group (W with stride 0, Y_n with stride K*P);
    channels-last: one GEMM over the chunk's pixels; pointwise: no gather, no scratch."""
    x = np.zeros((4, 6, 5, 5))
    geo = conv_geometry("conv", 2, x, np.zeros((8, 3, 3, 3)), 1, 1, 1, 2)
    steps = cd.forward_steps(geo, False, [(0, 3), (3, 1)], 0.0)
    assert [type(s).__name__ for s in steps] == ["Gather", "Gemm"] * 4
    g = steps[3]  # chunk 0, group 1
    assert g == cd.Gemm(("col", 0), ("w", 4 * 27), ("y", 4 * 25), 0, 0, 25, 4, 27, 25, 27, 25, 27 * 25, 0, 8 * 25,
                        3, 0.0)
    cl = cd.forward_steps(geo, True, [(0, 4)], 1.0)
    assert cl[1] == cd.Gemm(("w", 0), ("col", 0), ("y", 0), 1, 0, 4, 100, 27, 27, 27, 8, 0, 0, 0, 1, 1.0)
    pw = conv_geometry("conv", 2, x, np.zeros((8, 6, 1, 1)), 1, 0, 1, 1)
    assert cd.forward_scratch(pw) == 0
    assert cd.forward_steps(pw, False, [(0, 4)], 0.0) == [
        cd.Gemm(("x", 0), ("w", 0), ("y", 0), 0, 0, 25, 8, 6, 25, 6, 25, 150, 0, 200, 4, 0.0)]


# ---------------------------------------------------------------- the front end's wiring, CUDA parts emulated

class Calls(list):
    """The route's calls in order, and the forward form of each forward call."""

    def __init__(self):
        super().__init__()
        self.forms = []


@pytest.fixture
def emulated_route(monkeypatch):
    """conv.py takes the device route for numpy arrays, whose CUDA parts run as the numpy stand-in."""
    calls = Calls()

    def forward(geo, x, cl, wrows, y, residual, affine, math):
        calls.append("forward")
        ymem = np.full(y.size, np.nan)
        res = None if residual is None else memory(np.asarray(residual), cl)
        calls.forms.append(emulated_forward(geo, memory(x, cl), cl, np.asarray(wrows, np.float64), ymem, res, 1)[1])
        out = from_memory(ymem, y.shape, cl)
        if affine is not None:
            shape = (1, -1) + (1,) * geo.nd
            if affine.scale is not None:
                out = out * affine.scale.reshape(shape)
            if affine.shift is not None:
                out = out + affine.shift.reshape(shape)
            if affine.activation is not None:
                out = affine.activation.host(out)
        y[...] = out

    def weight(geo, x, dy, cl, math):
        calls.append("weight")
        return emulated_weight(geo, memory(x, cl), memory(dy, cl), cl, 1)[0], None  # (dW, no plan to replay)
    def transposed(geo, x, cl, w, wcl, y, bias, math):
        calls.append("col2im")
        ymem = np.full(y.size, np.nan)
        emulated_transposed(geo, memory(x, cl), cl, memory(np.asarray(w), wcl), wcl, ymem, bias, 1)
        y[...] = from_memory(ymem, y.shape, cl)
    monkeypatch.setattr(cd, "applies", lambda x, flops: True)
    monkeypatch.setattr(cd, "forward", forward)
    monkeypatch.setattr(cd, "weight", weight)
    monkeypatch.setattr(direct_cuda, "transposed", transposed)
    return calls


def _cl(x):
    return np.ascontiguousarray(np.moveaxis(x, 1, -1)).transpose(0, x.ndim - 1, *range(1, x.ndim - 1))


@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_front_end_routes_forward_weight_and_input(emulated_route, layout):
    rng = np.random.default_rng(7)
    lay = _cl if layout == "cl" else (lambda a: a)
    x = rng.standard_normal((3, 4, 9, 8))
    w = rng.standard_normal((6, 2, 3, 3))
    b, sc, sh = rng.standard_normal(6), rng.uniform(0.5, 2, 6), rng.standard_normal(6)
    r = rng.standard_normal((3, 6, 5, 4))
    y = dnn.conv2d(lay(x), w, b, stride=2, padding=1, groups=2, scale=sc, shift=sh, residual=lay(r),
                   activation="relu")
    t = torch.from_numpy
    conv = F.conv2d(t(x), t(w), t(b), 2, 1, 1, 2)
    ref = F.relu(conv * t(sc)[:, None, None] + t(sh)[:, None, None] + t(r)).numpy()
    assert _rel(y, ref) < 1e-13 and (layout == "cl") == (not y.flags.c_contiguous)
    dy = rng.standard_normal((3, 6, 5, 4))
    gw = dnn.conv2d_weight(lay(x), w.shape, lay(dy), stride=2, padding=1, groups=2)
    assert _rel(gw, torch.nn.grad.conv2d_weight(t(x), w.shape, t(dy), 2, 1, 1, 2).numpy()) < 1e-13
    gi = dnn.conv2d_input(x.shape, w, lay(dy), stride=2, padding=1, groups=2)
    assert _rel(gi, torch.nn.grad.conv2d_input(x.shape, t(w), t(dy), 2, 1, 1, 2).numpy()) < 1e-13
    wt = rng.standard_normal((4, 3, 4, 4))
    yt = dnn.conv_transpose2d(lay(x), lay(wt), b[:6], stride=2, padding=1, output_padding=1, groups=2)
    assert _rel(yt, F.conv_transpose2d(t(x), t(wt), t(b[:6]), 2, 1, 1, 2).numpy()) < 1e-13
    assert emulated_route == ["forward", "weight", "col2im", "col2im"]  # strided: GEMMs into columns, col2im


@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_front_end_shifted_forward_and_input(emulated_route, monkeypatch, layout):
    """With the shifted form forced (conv_direct.FORM): a stride-1 forward with bias, folded scale,
    shift, residual and activation, and a stride-1 backward-data, both through the shifted plans."""
    monkeypatch.setattr(cd, "FORM", "shifted")
    rng = np.random.default_rng(8)
    lay = _cl if layout == "cl" else (lambda a: a)
    x = rng.standard_normal((2, 5, 9, 8))
    w = rng.standard_normal((6, 5, 3, 3))
    b, sc, sh = rng.standard_normal(6), rng.uniform(0.5, 2, 6), rng.standard_normal(6)
    r = rng.standard_normal((2, 6, 9, 4))
    y = dnn.conv2d(lay(x), w, b, padding=(1, 0), dilation=(1, 2), scale=sc, shift=sh, residual=lay(r),
                   activation="relu")
    t = torch.from_numpy
    conv = F.conv2d(t(x), t(w), t(b), 1, (1, 0), (1, 2))
    ref = F.relu(conv * t(sc)[:, None, None] + t(sh)[:, None, None] + t(r)).numpy()
    assert _rel(y, ref) < 1e-13
    dy = rng.standard_normal((2, 6, 9, 4))
    gi = dnn.conv2d_input(x.shape, w, lay(dy), padding=(1, 0), dilation=(1, 2))
    assert _rel(gi, torch.nn.grad.conv2d_input(x.shape, t(w), t(dy), 1, (1, 0), (1, 2)).numpy()) < 1e-13
    assert emulated_route == ["forward", "forward"] and emulated_route.forms == ["shifted", "shifted"]


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([1, 2, 3]), st.integers(1, 2), st.integers(0, 2), st.integers(1, 2), st.sampled_from([1, 2]),
       st.sampled_from([1, 3]), st.booleans(), st.integers(0, 1000))
def test_a_widened_gather_moves_the_same_bytes(nd, stride, pad, dil, groups, ks, transposed, seed):
    """Channels-last gathers of 2-byte elements run over 8- and 16-byte units of four and eight channels
    (conv_direct.widened): the real kernel on the widened arguments writes the bytes the element-wise kernel writes, for forward,
    transposed (zero-inserting) and backward-weight gathers. Where a group's channels do not come in whole
    units, there is no widened form."""
    rng = np.random.default_rng(seed)
    x = np.zeros((2, 8 * groups, *(3,) * nd))
    if transposed:
        geo = transpose_geometry("t", nd, x, np.zeros((8 * groups, 2, *(ks,) * nd)), stride, min(pad, ks - 1),
                                 stride - 1, groups, dil)
    else:
        try:
            geo = conv_geometry("conv", nd, x, np.zeros((2 * groups, 8, *(ks,) * nd)), stride, pad, dil, groups)
        except ValueError:
            return
    narrow, wide, wider = (host_gather(nd, transposed, u) for u in (2, 8, 16))
    if narrow is None:
        pytest.skip("no C++ compiler")
    xb = rng.integers(1, 1 << 16, geo.n * geo.c * int(np.prod(geo.in_size)), dtype=np.uint16)
    gathers = [s for s in cd.forward_steps(geo, True, [(0, 1), (1, 1)], 0.0) + wf.weight_steps(geo, True,
               [(0, 2)]) if isinstance(s, cd.Gather)]
    assert gathers or cd.pointwise(geo)
    for s in gathers:
        size = s.nb * geo.crs * geo.p
        want, got = np.zeros(size, np.uint16), np.zeros(size, np.uint16)
        narrow(xb.ctypes.data, want.ctypes.data, cd.gather_args(geo, True, s), size)
        for fn, v in ((wide, 4), (wider, 8)):  # 8- and 16-byte units
            wgeo, ws = cd.widened(geo, True, s, v)
            assert wgeo.crs * v == geo.crs and wgeo.groups == geo.groups
            got[:] = 0
            fn(xb.ctypes.data, got.ctypes.data, cd.gather_args(wgeo, True, ws), size // v)
            assert np.array_equal(got, want) and want.any()
        assert cd.widened(geo, False, s, 4) is None and cd.widened(geo, True, s, 16) is None  # NCHW; 8 % 16


def test_which_calls_pad_their_rows():
    """col's rows are padded (conv_direct.reduction_pad) for an ungrouped convolution with a kernel window over at
    most PAD_C_MAX channels whose rows are not whole 16-byte runs, in either layout; grouped, pointwise,
    transposed (zero insertion), whole-run and wider inputs are left as they are."""
    def geo(c, ks=3, groups=1, size=(9, 8)):
        return conv_geometry("conv2d", 2, np.zeros((2, c * groups, *size)), np.zeros((4, c, ks, ks)), 2, 1, 1, groups)
    assert cd.reduction_pad(geo(3), True, 2) == (32, 8) and cd.reduction_pad(geo(3), True, 4) == (28, 4)
    assert cd.reduction_pad(geo(1), True, 2) == (16, 8) and cd.reduction_pad(geo(5), True, 8) == (46, 2)
    assert cd.reduction_pad(geo(7, 7), True, 2) == (344, 8)
    pointwise = conv_geometry("conv2d", 2, np.zeros((2, 3, 9, 8)), np.zeros((4, 3, 1, 1)), 1, 0, 1, 1)
    for g, itemsize in ((geo(8), 2), (geo(4), 4), (geo(2), 8), (geo(9), 2), (pointwise, 2), (geo(3, groups=2), 2)):
        assert cd.reduction_pad(g, True, itemsize) is None
    assert cd.reduction_pad(geo(3), False, 2) == (32, 8)
    t = transpose_geometry("t", 2, np.zeros((2, 3, 9, 8)), np.zeros((3, 4, 3, 3)), 2, 1, 1, 1, 1)
    assert cd.reduction_pad(t, True, 2) is None


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([1, 2, 3]), st.booleans(), st.sampled_from([1, 3, 5]), st.integers(1, 2), st.integers(0, 3),
       st.integers(1, 2), st.sampled_from([3, 5]), st.integers(0, 1000), st.sampled_from([1 << 30, 1]))
def test_padded_rows_plans_vs_torch(nd, cl, c, stride, pad, dil, ks, seed, budget):
    """A convolution over a few input channels (an image's first layer), both layouts, with col's rows padded to
    whole runs in the order (r..., c) (conv_direct.reduction_pad; float64's runs are 2 elements) and the weight
    matrix alike: forward and weight gradient, every run gather also run compiled for the host; budget 1: one
    image a chunk."""
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((3, c, *(9, 8, 5)[:nd])), rng.standard_normal((4, c, *(ks,) * nd))
    try:
        geo = conv_geometry("conv", nd, x, w, stride, pad, dil, 1)
    except ValueError:
        return  # kernel larger than the padded input
    assert cd.reduction_pad(geo, cl, 8) == (geo.crs + 1, 2)  # (an odd CRS)
    steps, _ = cd.forward_plan(geo, cl, np.float64, 0.0, budget, "im2col")
    assert cd.padded_rows(steps) == geo.crs + 1 and all(s.run == 2 for s in steps if isinstance(s, cd.Gather))
    ref = getattr(F, f"conv{nd}d")(torch.from_numpy(x), torch.from_numpy(w), None, stride, pad, dil).numpy()
    ymem = np.full(ref.size, np.nan)
    emulated_forward(geo, memory(x, cl), cl, _wrows(w, cl), ymem, None, budget, "im2col")
    assert _rel(from_memory(ymem, ref.shape, cl), ref) < 1e-13
    dy = rng.standard_normal(ref.shape)
    dw, _ = emulated_weight(geo, memory(x, cl), memory(dy, cl), cl, budget)
    want = getattr(torch.nn.grad, f"conv{nd}d_weight")(torch.from_numpy(x), w.shape, torch.from_numpy(dy), stride,
                                                        pad, dil).numpy()
    got = np.moveaxis(dw.reshape(w.shape[0], *w.shape[2:], c), -1, 1) if cl else dw.reshape(w.shape)
    assert _rel(got, want) < 1e-13


@pytest.mark.parametrize("cl", [True, False])
@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_run_gather_moves_bits_of_every_element_size(itemsize, cl):
    """ResNet's first layer (3 channels, 7x7, stride 2, pad 3) on a small map: its rows padded to whole 16-byte
    runs (float16 147 -> 152, float32 148, float64 148); the run kernel compiled for the host moves the bits of
    every element as the numpy form of the gather says, zeros past CRS, and writes nothing else; x in either
    layout (read by its strides)."""
    x = np.random.default_rng(itemsize).integers(1, 2**15, (2, 3, 13, 11)).astype(np.float64)
    geo = conv_geometry("conv2d", 2, x, np.zeros((5, 3, 7, 7)), 2, 3, 1, 1)
    rows, run = cd.reduction_pad(geo, cl, itemsize)
    assert run == 16 // itemsize and rows == {2: 152, 4: 148, 8: 148}[itemsize]
    step = cd.forward_steps(geo, cl, [(0, 2)], 0.0, (rows, run))[0]
    assert step == cd.Gather(0, 0, 2, geo.p * rows, 1, rows, False, run)
    want = np.full(2 * geo.p * rows, np.nan)
    NumpyOps(geo, cl, {"x": memory(x, cl), "col": want}).gather(step)
    fn = host_run_gather(2, itemsize)
    if fn is None:
        pytest.skip("no C++ compiler")
    xb = memory(x, cl).astype(f"u{itemsize}")
    got = np.full(want.size + run, 2**15, dtype=f"u{itemsize}")  # one run more: nothing is written past col
    fn(xb.ctypes.data, got.ctypes.data, cd.gather_args(geo, cl, step), run_threads(step, geo.p))
    assert np.array_equal(got[:want.size].astype(np.float64), want) and (got[want.size:] == 2**15).all()
    assert not want.reshape(-1, rows)[:, geo.crs:].any()
    launch = direct_cuda.gather_launch(geo, cl, step, x.size, itemsize)
    assert (launch.run, launch.unit, launch.total, launch.narrow) == (run, itemsize, run_threads(step, geo.p), None)
    assert launch.magic == gk.magic_args(launch.args, gk.RUN_ARG_NAMES, gk.RUN_DIVISORS)


@settings(max_examples=60, deadline=None)
@given(SHIFTED, st.sampled_from([1 << 30, 1]))
def test_shifted_weight_plan_vs_torch(case, budget):
    """The weight gradient in the shifted form (channels-last), any padding (asymmetric too) and dilation, 1-3
    spatial dims; budget 1: one image a chunk (xp and yw exactly one image, dW accumulated over chunks)."""
    nd, _, _, dil, ks, _, _ = case
    made = _shifted_case(case)
    if made is None:
        return
    rng, geo, x, w, xt, tpad = made
    y = getattr(F, f"conv{nd}d")(torch.from_numpy(xt), torch.from_numpy(w), None, 1, tpad, dil)
    dy = rng.standard_normal(tuple(y.shape))
    ref = getattr(torch.nn.grad, f"conv{nd}d_weight")(torch.from_numpy(xt), w.shape, torch.from_numpy(dy), 1, tpad,
                                                       dil).numpy()
    dw, parts = emulated_weight(geo, memory(x, True), memory(dy, True), True, budget, "shifted")
    assert len(parts) == (1 if budget > 1 else geo.n)
    assert _rel(np.moveaxis(dw.reshape(4, *(ks,) * nd, 3), -1, 1), ref) < 1e-13


def test_shifted_weight_plan_exact_and_its_choice():
    x, w = np.empty((2, 64, 8, 8)), np.empty((32, 64, 3, 3))
    geo = conv_geometry("conv", 2, x, w, 1, 1, 1, 1)
    steps = wf.shifted_steps(geo, [(0, 2)])
    rows = (2 - 1) * 100 + 7 * 10 + 7 + 1  # through the last valid output of the 10 x 10 padded grid
    assert steps[:2] == [cd.Pad(0, 2, True), cd.Crop(0, 2, False, True)]
    assert steps[2:] == [cd.Gemm(("xp", (r * 10 + s) * 64), ("yw", 0), ("dw", (r * 3 + s) * 64), cd.OP_N, cd.OP_T, 64,
                                 32, rows, 64, 32, 9 * 64, 0, 0, 0, 1, 0.0) for r in range(3) for s in range(3)]
    assert wf.weight_forms(geo, "cl") == ("im2col", "shifted") and wf.weight_forms(geo, "nchw") == ("im2col",)
    assert wf.weight_form(geo, np.float32, None, "cl") == "im2col"  # never by default
    assert wf.weight_form(geo, np.float32, "shifted", "cl") == "shifted"
    assert wf.weight_form(geo, np.float32, "shifted", "nchw") == "im2col"
    for bad in (conv_geometry("conv", 2, x, w, 2, 1, 1, 1), conv_geometry("conv", 2, x, w[:, :32], 1, 1, 1, 2),
                conv_geometry("conv", 2, x, w[:, :, :1, :1], 1, 0, 1, 1)):  # strided, grouped, 1x1
        assert wf.weight_forms(bad, "cl") == ("im2col",)


@pytest.mark.parametrize("budget", [1 << 30, 1, 3 * 16 * 8])  # one chunk; an image a chunk; 3 images a chunk
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_batched_weight_plan_vs_torch_and_exact(budget, nd):
    """The batched form (NCHW pointwise dW): X and dY read where they lie, the per-image partial sums summed by a
    GEMM with ones, chunk by chunk; against torch, and its steps by exact value."""
    rng = np.random.default_rng(nd)
    x = rng.standard_normal((7, 5, *(4, 3, 2)[:nd]))
    w = np.empty((3, 5, *(1,) * nd))
    geo = conv_geometry("conv", nd, x, w, 1, 0, 1, 1)
    dy = rng.standard_normal((7, 3, *geo.out_size))
    ref = torch.nn.grad.__dict__[f"conv{nd}d_weight"](torch.from_numpy(x), w.shape, torch.from_numpy(dy)).numpy()
    dw, parts = emulated_weight(geo, x.ravel().copy(), dy.ravel().copy(), False, budget, "batched")
    assert _rel(dw.reshape(w.shape), ref) < 1e-13
    for slots in (1, 2, 3):  # images sharing partial sums
        shared = emulated_weight(geo, x.ravel().copy(), dy.ravel().copy(), False, budget, "batched", slots)[0]
        assert _rel(shared.reshape(w.shape), ref) < 1e-13
    assert len(parts) == {1 << 30: 1, 1: 7, 3 * 16 * 8: 3}[budget]
    p = geo.p
    assert wf.batched_steps(geo, [(0, 4), (4, 3)]) == [
        cd.Ones("dwp", 60, 4),
        cd.Gemm(("x", 0), ("dy", 0), ("dwp", 0), cd.OP_T, cd.OP_N, 5, 3, p, p, p, 5, 5 * p, 3 * p, 15, 4, 0.0),
        cd.Gemm(("dwp", 0), ("dwp", 60), ("dw", 0), cd.OP_N, cd.OP_N, 15, 1, 4, 15, 4, 15, 0, 0, 0, 1, 0.0),
        cd.Gemm(("x", 4 * 5 * p), ("dy", 4 * 3 * p), ("dwp", 0), cd.OP_T, cd.OP_N, 5, 3, p, p, p, 5, 5 * p, 3 * p, 15,
                3, 0.0),
        cd.Gemm(("dwp", 0), ("dwp", 60), ("dw", 0), cd.OP_N, cd.OP_N, 15, 1, 3, 15, 3, 15, 0, 0, 0, 1, 1.0)]
    assert wf.batched_steps(geo, [(0, 5), (5, 2)], 2) == [  # two partial sums: images 0-1, 2-3, 4 then 5-6
        cd.Ones("dwp", 30, 2),
        cd.Gemm(("x", 0), ("dy", 0), ("dwp", 0), cd.OP_T, cd.OP_N, 5, 3, p, p, p, 5, 5 * p, 3 * p, 15, 2, 0.0),
        cd.Gemm(("x", 2 * 5 * p), ("dy", 2 * 3 * p), ("dwp", 0), cd.OP_T, cd.OP_N, 5, 3, p, p, p, 5, 5 * p, 3 * p, 15,
                2, 1.0),
        cd.Gemm(("x", 4 * 5 * p), ("dy", 4 * 3 * p), ("dwp", 0), cd.OP_T, cd.OP_N, 5, 3, p, p, p, 5, 5 * p, 3 * p, 15,
                1, 1.0),
        cd.Gemm(("dwp", 0), ("dwp", 30), ("dw", 0), cd.OP_N, cd.OP_N, 15, 1, 2, 15, 2, 15, 0, 0, 0, 1, 0.0),
        cd.Gemm(("x", 5 * 5 * p), ("dy", 5 * 3 * p), ("dwp", 0), cd.OP_T, cd.OP_N, 5, 3, p, p, p, 5, 5 * p, 3 * p, 15,
                2, 0.0),
        cd.Gemm(("dwp", 0), ("dwp", 30), ("dw", 0), cd.OP_N, cd.OP_N, 15, 1, 2, 15, 2, 15, 0, 0, 0, 1, 1.0)]
    assert wf.batched_scratch(geo, 4, np.float64) == 64 and wf.batched_scratch(geo, 4, np.float16) == 128
    assert wf.batched_scratch(geo, 3, np.float32) == 48  # (3 * 16 = 48: even already)


def test_batched_slots_keep_the_partial_sums_within_their_budget():
    g = conv_geometry("conv", 2, np.empty((64, 1024, 14, 14)), np.empty((512, 1024, 1, 1)), 1, 0, 1, 1)
    assert wf.batched_slots(g, 64, 4) == 8  # 2 MiB a float32 partial sum: 8 in 16 MiB
    assert wf.batched_slots(g, 64, 8) == 4 and wf.batched_slots(g, 3, 4) == 3  # the chunk's images if fewer
    huge = conv_geometry("conv", 2, np.empty((2, 8192, 1, 1)), np.empty((8192, 8192, 1, 1)), 1, 0, 1, 1)
    assert wf.batched_slots(huge, 2, 4) == 1  # at least one


def test_the_batched_weight_form_and_its_choice():
    big = conv_geometry("conv", 2, np.empty((2, 64, 28, 28)), np.empty((32, 64, 1, 1)), 1, 0, 1, 1)
    small = conv_geometry("conv", 2, np.empty((2, 64, 14, 14)), np.empty((32, 64, 1, 1)), 1, 0, 1, 1)
    assert wf.weight_forms(big, "nchw") == ("im2col", "batched") and wf.weight_forms(big, "cl") == ("im2col",)
    assert wf.weight_form(big, np.float32, None, "nchw") == "batched"  # 784 pixels: by default
    assert wf.weight_form(small, np.float32, None, "nchw") == "batched"  # 196 pixels: 4-byte ones too
    assert wf.weight_form(small, np.float16, None, "nchw") == "batched"  # 2-byte: C * K = 2048, small
    assert wf.weight_form(small, np.float64, None, "nchw") == "batched"
    wide = conv_geometry("conv", 2, np.empty((2, 1024, 14, 14)), np.empty((512, 1024, 1, 1)), 1, 0, 1, 1)
    assert wf.weight_form(wide, np.float16, None, "nchw") == "im2col"  # 2-byte, C * K = 2 ** 19: im2col's GEMM pays
    assert wf.weight_form(wide, np.float32, None, "nchw") == "batched"  # 4-byte: from 196 pixels
    tiny = conv_geometry("conv", 2, np.empty((2, 64, 7, 7)), np.empty((32, 64, 1, 1)), 1, 0, 1, 1)
    assert wf.weight_form(tiny, np.float32, None, "nchw") == "im2col"  # 49 pixels: per-image GEMMs too thin
    assert wf.weight_form(small, np.float16, "batched", "nchw") == "batched"
    assert wf.weight_form(big, np.float32, "im2col", "nchw") == "im2col"
    for bad in (conv_geometry("conv", 2, np.empty((2, 64, 28, 28)), np.empty((32, 64, 1, 1)), 2, 0, 1, 1),
                conv_geometry("conv", 2, np.empty((2, 64, 28, 28)), np.empty((32, 32, 1, 1)), 1, 0, 1, 2),
                conv_geometry("conv", 2, np.empty((2, 64, 28, 28)), np.empty((32, 64, 1, 1)), 1, 1, 1, 1),
                conv_geometry("conv", 2, np.empty((2, 64, 28, 28)), np.empty((32, 64, 3, 3)), 1, 1, 1, 1)):
        assert wf.weight_forms(bad, "nchw") == ("im2col",)  # strided, grouped, padded, a window


def test_fast_divisor_quotients():
    """a // d == (a * m >> 32) >> s for every a < 2**31: each d up to 4096, powers of two and their
    neighbours, large d, against a spread of dividends with the edges of each quotient step."""
    rng = np.random.default_rng(0)
    ds = list(range(1, 4097)) + [v + e for b in range(12, 31) for v in (1 << b,) for e in (-1, 0, 1)] + \
        [int(v) for v in rng.integers(4097, 2**31, 500)] + [2**31 - 1]
    top = 2**31 - 1
    for d in ds:
        m, s = gk.fast_divisor(d)
        assert 0 <= m < 2**32 and 0 <= s < 32
        a = np.concatenate([rng.integers(0, 2**31, 200), [0, 1, d - 1, d, d + 1, top, top - 1],
                            [q * d + e for q in (1, 2, 3, top // d) for e in (-1, 0, 1) if 0 <= q * d + e <= top]])
        a = a.astype(object)
        got = a if m == 0 else [((int(v) * m) >> 32) >> s for v in a]
        assert list(got) == [int(v) // d for v in a], d
    for bad in (0, -3, 2**31):
        with pytest.raises(ValueError, match="d: got"):
            gk.fast_divisor(bad)
