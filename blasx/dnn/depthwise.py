"""Depthwise convolutions on one GPU (blasx.dnn's device route for CuPy operands), where per-group GEMMs
would have a handful of rows each: groups > 1 with one input channel per group (depthwise and
transposed-depthwise convolutions, any channel multiplier), or one output channel per group from at most
MAX_CG input channels (a depthwise convolution's backward-data, whose groups sum the multiplier's channels).

Forward and backward-data (a convolution of the zero-inserted dY with the flipped kernel, ConvGeometry's
``insert``): one CuPy ElementwiseKernel over the output elements in y's memory order (NCHW or
channels-last); each sums its group's input channels times the kernel window (3x3: 9 FMAs) in float64 for
float64 and float32 otherwise, then applies ``act(conv * scale + (bias * scale + shift) + residual)`` and
rounds once. Backward-weights: an ElementwiseKernel of partial sums, one per (weight element, split), each
summing every SPLIT-th (image, pixel) in the compute type, then one sum over the splits (deterministic).

The index arithmetic is written once, as small programs of integer statements (``forward_program``,
``weight_program``) that render to CUDA (``render``) and run on numpy with C's integer semantics
(``execute``), so the CPU tests check the arithmetic the GPU runs. A kernel is made on first use per
(element type, rank, layout, activation, residual, zero insertion, index type).
"""

from __future__ import annotations

import ast

import numpy as np

from ..operands import array_module, is_cupy
from ..runtime.devices import cuda_epilogue
from . import depthwise_vec, direct_cache
from .arrays import compute_dtype
from .epilogue import parts, vector_module
from .geometry import ConvGeometry
from .im2col import x_strides

MAX_CG = 16  # input channels per group the kernels loop over at most (cg > 1 only with one output a group)
WEIGHT_THREADS = 1 << 17  # threads the weight kernel aims at, by splitting the pixel range
WEIGHT_MIN_RUN = 32  # (image, pixel) terms a weight thread sums at least
LETTERS = "ORSDLIX"  # per spatial dim: output size, kernel, stride, dilation, pad_lo, input size, x's stride


def applies(geo: ConvGeometry) -> bool:
    """Whether these kernels run ``geo``: groups > 1 and one input channel a group, or one output
    channel a group from at most MAX_CG input channels."""
    return geo.groups > 1 and (geo.cg == 1 or (geo.kg == 1 and geo.cg <= MAX_CG))


def inserted(geo: ConvGeometry) -> bool:
    """Whether the input is zero-inserted (a transposed convolution or backward-data with stride > 1)."""
    return any(z != 1 for z in geo.insert)


# ---------------------------------------------------------------- the programs
# Statements: ("let", name, expr), ("need", cond, ...) (the rest of the enclosing loop's iteration runs
# only where every cond holds), ("for", var, bound, body) (var = 0 .. bound - 1; bound a parameter),
# ("fma", (buffer, index), (buffer, index)) (acc += product). Expressions are C integer arithmetic on
# parameters (upper case) and earlier names; ``e`` is the thread's element.

def _unravel(src: str, names: list, sizes: list) -> list:
    """Lets of ``names`` (outermost first) from the row-major index ``src`` over ``sizes`` (the first unused)."""
    out, cur = [], src
    for j in range(len(names) - 1, 0, -1):
        out += [("let", names[j], f"{cur} % {sizes[j]}"), ("let", f"{src}{j}", f"{cur} / {sizes[j]}")]
        cur = f"{src}{j}"
    return out + [("let", names[0], cur)]


def _window(d: int, nd: int, zero_inserted: bool) -> tuple:
    """The loop over kernel dim ``d`` (and those inside it) of the forward program."""
    px, pw = ("xc", "wc") if d == 0 else (f"xo{d - 1}", f"wo{d - 1}")
    u = f"u{d}"
    body = [("let", u, f"o{d} * S{d} - L{d} + r{d} * D{d}")]  # in the (zero-inserted) input
    if zero_inserted:
        body += [("need", f"{u} >= 0", f"{u} % Z{d} == 0"), ("let", f"v{d}", f"{u} / Z{d}"), ("need", f"v{d} < I{d}")]
        u = f"v{d}"
    else:
        body.append(("need", f"{u} >= 0", f"{u} < I{d}"))
    body += [("let", f"xo{d}", f"{px} + {u} * X{d}"), ("let", f"wo{d}", f"{pw} * R{d} + r{d}")]
    body.append(("fma", ("x", f"xo{d}"), ("w", f"wo{d}")) if d == nd - 1 else _window(d + 1, nd, zero_inserted))
    return ("for", f"r{d}", f"R{d}", body)


def forward_program(nd: int, cl: bool, zero_inserted: bool) -> list:
    """acc of output element ``e`` (y's memory order): the sum over its group's input channels c and the
    window of x times the weight, stored (K, CG, *R) row-major."""
    o, sizes = [f"o{d}" for d in range(nd)], [f"O{d}" for d in range(nd)]
    order = (["n", *o, "k"], [None, *sizes, "K"]) if cl else (["n", "k", *o], [None, "K", *sizes])
    body = [("let", "xc", "xg + c * XC"), ("let", "wc", "k * CG + c"), _window(0, nd, zero_inserted)]
    return [*_unravel("e", *order), ("let", "xg", "n * XN + k / KG * CG * XC"), ("for", "c", "CG", body)]


def weight_program(nd: int, cl: bool) -> list:
    """acc of partial ``e`` = (weight element (k, c, r...), split s): the sum over (image, pixel) j = s,
    s + SPLIT, ... of x at the element's tap times dY; s is the fastest index for NCHW, k for channels-last
    (neighbouring threads read neighbouring memory)."""
    o, r = [f"o{d}" for d in range(nd)], [f"r{d}" for d in range(nd)]
    order = (["s", "ct", "k"], [None, "CGT", "K"]) if cl else (["k", "ct", "s"], [None, "CGT", "SPLIT"])
    head = [*_unravel("e", *order), *_unravel("ct", ["c", *r], [None, *(f"R{d}" for d in range(nd))]),
            ("let", "xg", "(k / KG * CG + c) * XC"), *(("let", f"h{d}", f"r{d} * D{d} - L{d}") for d in range(nd))]
    body = [("let", "j", "s + jj * SPLIT"), ("need", "j < NP"), ("let", "n", "j / P"), ("let", "q", "j % P"),
            *_unravel("q", o, [None, *(f"O{d}" for d in range(1, nd))])]
    for d in range(nd):
        body += [("let", f"u{d}", f"o{d} * S{d} + h{d}"), ("need", f"u{d} >= 0", f"u{d} < I{d}")]
    xo = " + ".join(["n * XN", "xg", *(f"u{d} * X{d}" for d in range(nd))])
    body += [("let", "xo", xo), ("let", "go", "j * K + k" if cl else "(n * K + k) * P + q"),
             ("fma", ("x", "xo"), ("dy", "go"))]
    return [*head, ("for", "jj", "JN", body)]


def render(stmts: list, depth: int = 0) -> list[str]:
    """A program as lines of CUDA (index type I; acc and blasx_ld declared by the kernel)."""
    lines = []
    for s in stmts:
        if s[0] == "let":
            lines.append(f"const I {s[1]} = {s[2]};")
        elif s[0] == "need":
            if depth == 0:
                raise ValueError(f"depthwise: a need outside a loop: {s}")
            cond = s[1] if len(s) == 2 else " && ".join(f"({c})" for c in s[1:])
            lines.append(f"if (!({cond})) continue;")
        elif s[0] == "for":
            lines += [f"for (I {s[1]} = 0; {s[1]} < {s[2]}; ++{s[1]}) {{",
                      *("  " + x for x in render(s[3], depth + 1)), "}"]
        else:
            (a, ia), (b, ib) = s[1:]
            lines.append(f"acc += blasx_ld({a}[{ia}]) * blasx_ld({b}[{ib}]);")
    return lines


class _CIntegers(ast.NodeTransformer):
    """/ and % as calls of C's truncating forms."""

    def visit_BinOp(self, node):
        self.generic_visit(node)
        fn = {ast.Div: "_cdiv", ast.Mod: "_cmod"}.get(type(node.op))
        if fn is None:
            return node
        return ast.copy_location(ast.Call(ast.Name(fn, ast.Load()), [node.left, node.right], []), node)


_CODE: dict = {}
_C_OPS = {"_cmod": np.fmod, "_cdiv": lambda a, b: (a - np.fmod(a, b)) // b}


def _eval(expr: str, env: dict):
    code = _CODE.get(expr)
    if code is None:
        tree = ast.fix_missing_locations(_CIntegers().visit(ast.parse(expr, mode="eval")))
        code = _CODE[expr] = compile(tree, "<depthwise>", "eval")
    return eval(code, {"__builtins__": {}, **_C_OPS}, env)  # noqa: S307 - our own expressions


def execute(stmts: list, env: dict, bufs: dict, acc, mask=True, bits: int = 64) -> None:
    """Runs a program on numpy, every thread at once: ``env`` maps parameters to ints and ``e`` to the
    threads' elements (an int64 array), ``bufs`` names flat arrays; ``acc`` (one value a thread) is added
    to. Asserts what the kernel can't check: reads inside their buffers, lets within ``bits``-bit ints."""
    for s in stmts:
        if s[0] == "let":
            env[s[1]] = v = _eval(s[2], env)
            assert np.all(np.abs(np.where(mask, v, 0)) < 2 ** (bits - 1)), f"{s[1]} = {s[2]} overflows {bits} bits"
        elif s[0] == "need":
            for c in s[1:]:
                mask = mask & _eval(c, env)
        elif s[0] == "for":
            bound = _eval(s[2], env)
            assert np.ndim(bound) == 0, f"loop bound {s[2]} differs between threads"
            for v in range(int(bound)):
                execute(s[3], {**env, s[1]: v}, bufs, acc, mask, bits)
        else:
            m = np.broadcast_to(mask, acc.shape)
            vals = []
            for name, expr in s[1:]:
                idx = np.broadcast_to(_eval(expr, env), acc.shape)
                used, buf = idx[m], bufs[name]
                assert used.size == 0 or (used.min() >= 0 and used.max() < buf.size), f"{name} read out of bounds"
                vals.append(buf[np.where(m, idx, 0)])
            acc += np.where(m, vals[0] * vals[1], 0)


# ---------------------------------------------------------------- parameters

def _names(nd: int, zero_inserted: bool) -> list[str]:
    return ["K", "CG", "KG", "XN", "XC", *(f"{a}{d}" for d in range(nd) for a in LETTERS + "Z" * zero_inserted)]


WEIGHT_NAMES = ["CGT", "P", "NP", "SPLIT", "JN"]


def forward_params(geo: ConvGeometry, cl: bool) -> dict:
    """The forward program's parameters for ``geo`` with x's memory in the layout ``cl`` says."""
    sn, sc, ssp = x_strides(geo, cl)
    per = {"O": geo.out_size, "R": geo.kernel, "S": geo.stride, "D": geo.dilation, "L": geo.pad_lo,
           "I": geo.in_size, "X": ssp, "Z": geo.insert}
    vals = {"K": geo.k, "CG": geo.cg, "KG": geo.kg, "XN": sn, "XC": sc}
    return {name: int(vals[name] if name in vals else per[name[0]][int(name[1:])])
            for name in _names(geo.nd, inserted(geo))}


def weight_split(geo: ConvGeometry) -> int:
    """Splits of the (image, pixel) range: about WEIGHT_THREADS threads, each summing at least WEIGHT_MIN_RUN terms."""
    npix = geo.n * geo.p
    return max(1, min(-(-WEIGHT_THREADS // (geo.k * geo.crs)), -(-npix // WEIGHT_MIN_RUN)))


def weight_params(geo: ConvGeometry, cl: bool, split: int) -> dict:
    """The weight program's parameters (``geo`` not zero-inserted)."""
    npix = geo.n * geo.p
    return {**forward_params(geo, cl), "CGT": geo.crs, "P": geo.p, "NP": npix, "SPLIT": split,
            "JN": -(-npix // split)}


def index_type(params: dict, sizes) -> str:
    """"int32" where every buffer (``sizes``: elements) and every index the programs compute fit it, else "int64"."""
    nd = sum(1 for name in params if name.startswith("O"))
    reach = max((params[f"O{d}"] - 1) * params[f"S{d}"] + abs(params[f"L{d}"]) + params[f"R{d}"] * params[f"D{d}"]
                for d in range(nd))
    big = max(*sizes, reach, 2 * params.get("NP", 0) + params.get("SPLIT", 0), *(abs(v) for v in params.values()))
    return "int32" if big < 2**31 else "int64"


def affine_vectors(k: int, bias, scale, shift) -> tuple:
    """(s, t) in float64 with the epilogue's y = conv * s + t (+ residual): s = scale (1), t = bias * scale + shift;
    CuPy arrays where any vector is one (computed on its device, never read on the host)."""
    s, t = parts(bias, scale, shift)
    xp = vector_module(bias, scale, shift)
    return (xp.ones(k) if s is None else s), (xp.zeros(k) if t is None else t)


def memory(a, cl: bool):
    """A compact (N, C, ...) array's memory as a flat view (channels-last: N(spatial)C order)."""
    return (a.transpose(0, *range(2, a.ndim), 1) if cl else a).reshape(-1)


def reduce_partials(part, geo: ConvGeometry, cl: bool, split: int):
    """The (K, CG * taps) weight gradient from the weight kernel's partials (their type)."""
    if cl:
        return part.reshape(split, geo.crs, geo.k).sum(axis=0).T
    return part.reshape(geo.k, geo.crs, split).sum(axis=2)


# ---------------------------------------------------------------- kernel sources

def _element(dtype) -> tuple:
    """(CuPy parameter type, compute type, load of ``y`` as F, store of ``r`` into ``y``) of ``dtype``:
    the epilogue kernel's table (bfloat16 as its uint16 bits)."""
    ptype, ctype, load, store = cuda_epilogue.TILE_TYPES[cuda_epilogue.tile_type(dtype)]
    return ptype, ctype, load.format("y"), store.format("y", "r")  # the table's templates, on y and r


def _head(dtype, index: str) -> tuple:
    """(parameter type, CuPy type of the compute type, the body's typedefs, the preamble's load function)."""
    ptype, ctype, load, _ = _element(dtype)
    vtype = "float64" if ctype == "double" else "float32"
    typedefs = f"typedef {'int' if index == 'int32' else 'long long'} I; typedef {ctype} F; const I e = (I)i;"
    preamble = f"template <typename T> __device__ __forceinline__ {ctype} blasx_ld(const T& y) {{ return {load}; }}"
    return ptype, vtype, typedefs, preamble


def forward_source(dtype, nd: int, cl: bool, zero_inserted: bool, activation, residual: bool, index: str) -> dict:
    """The forward ElementwiseKernel's arguments: params x, w, sc, sh (res), p (the activation's
    parameter), the integer parameters; output y (y's memory, one element a thread)."""
    ptype, vtype, typedefs, preamble = _head(dtype, index)
    _, ctype, _, store = _element(dtype)
    act = cuda_epilogue.EXPRESSIONS[activation].format(**cuda_epilogue.MATH_FUNCTIONS[ctype])
    params = [f"raw {ptype} x", f"raw {ptype} w", f"raw {vtype} sc", f"raw {vtype} sh",
              *([f"raw {ptype} res"] if residual else []), f"{vtype} p",
              *(f"{index} {n}" for n in _names(nd, zero_inserted))]
    body = [typedefs, "F acc = (F)0;", *render(forward_program(nd, cl, zero_inserted)), "F v = acc * sc[k] + sh[k];",
            *(["v += blasx_ld(res[e]);"] if residual else []), f"F r = {act};", f"{store};"]
    name = (f"blasx_depthwise_{cuda_epilogue.tile_type(dtype)}_{nd}d_{'cl' if cl else 'nchw'}_{activation or 'none'}"
            f"{'_res' if residual else ''}{'_z' if zero_inserted else ''}_{index}")
    return {"in_params": ", ".join(params), "out_params": f"{ptype} y", "operation": "\n".join(body), "name": name,
            "preamble": preamble}


def weight_source(dtype, nd: int, cl: bool, index: str) -> dict:
    """The weight ElementwiseKernel's arguments: params x, dy, the integer parameters; output part (one
    partial sum a thread, in the compute type)."""
    ptype, vtype, typedefs, preamble = _head(dtype, index)
    params = [f"raw {ptype} x", f"raw {ptype} dy", *(f"{index} {n}" for n in _names(nd, False) + WEIGHT_NAMES)]
    body = [typedefs, "F acc = (F)0;", *render(weight_program(nd, cl)), "part = acc;"]
    name = f"blasx_depthwise_weight_{cuda_epilogue.tile_type(dtype)}_{nd}d_{'cl' if cl else 'nchw'}_{index}"
    return {"in_params": ", ".join(params), "out_params": f"{vtype} part", "operation": "\n".join(body), "name": name,
            "preamble": preamble}


# ---------------------------------------------------------------- CUDA

_KERNELS: dict = {}


def _kernel(source: dict):
    k = _KERNELS.get(source["name"])  # the name spells out everything the source depends on
    if k is None:  # two threads may both make it: the same kernel, either kept
        import cupy
        k = _KERNELS[source["name"]] = cupy.ElementwiseKernel(**source)
    return k


def _ints(params: dict, index: str) -> list:
    it = np.int32 if index == "int32" else np.int64
    return [it(v) for v in params.values()]


_LAUNCHES = direct_cache.table(512)


def launch_forward(geo: ConvGeometry, cl: bool, dtype, activation, bufs: dict) -> None:
    """The forward kernel on the current device and stream: ``bufs`` x, w, y, sc, sh (and res) as flat
    CuPy arrays (see ``forward``); ``activation`` a parsed Activation or None. The kernel's source and
    integer arguments are made once per (geometry, layout, type, activation, residual, buffer sizes)."""
    name = None if activation is None else activation.name
    sizes = tuple(b.size for b in bufs.values())
    residual = "res" in bufs

    def make():
        params = forward_params(geo, cl)
        index = index_type(params, sizes)
        return forward_source(dtype, geo.nd, cl, inserted(geo), name, residual, index), _ints(params, index)
    src, ints = _LAUNCHES.get((geo, cl, np.dtype(dtype).str, name, residual, sizes), make)
    vt = np.float64 if np.dtype(bufs["sc"].dtype) == np.float64 else np.float32
    p = vt((activation.param if activation is not None else None) or 0.0)
    res = [bufs["res"]] if residual else []
    _kernel(src)(bufs["x"], bufs["w"], bufs["sc"], bufs["sh"], *res, p, *ints, bufs["y"])


def launch_weight(geo: ConvGeometry, cl: bool, dtype, bufs: dict, split: int) -> None:
    """The weight kernel on the current device and stream: ``bufs`` x, dy (flat, x's layout) and part
    (K * CG * taps * split elements of the compute type), written."""
    params = weight_params(geo, cl, split)
    index = index_type(params, [b.size for b in bufs.values()])
    _kernel(weight_source(dtype, geo.nd, cl, index))(bufs["x"], bufs["dy"], *_ints(params, index), bufs["part"])


def _cast(xp, a, dtype):
    """``a`` (compute type) as a C-contiguous array of ``dtype`` (bfloat16 as its uint16 bits on CuPy)."""
    dt = np.dtype(dtype)
    if xp is np or cuda_epilogue.tile_type(dt) != "bfloat16":
        return xp.ascontiguousarray(a.astype(dt, copy=False))
    ptype, _, _, store = _element(dt)
    return _kernel({"in_params": "float32 r", "out_params": f"{ptype} y", "operation": store,
                    "name": "blasx_depthwise_store_bfloat16"})(xp.ascontiguousarray(a))


def _overlap(a, b) -> bool:
    """Whether compact arrays ``a`` and ``b`` share memory."""
    if not is_cupy(a):
        return np.shares_memory(a, b)
    return a.data.ptr < b.data.ptr + b.nbytes and b.data.ptr < a.data.ptr + a.nbytes


# ---------------------------------------------------------------- entry points (conv.py's device route)

def forward(geo: ConvGeometry, x, cl: bool, w, y, residual, epilogue_args, dtype=None) -> None:
    """y = act(conv(x, w) * scale + bias * scale + shift + residual) on x's device: x, y, residual
    compact in the layout ``cl`` says (y may be the residual; x it may be too: then x is copied first),
    w (K, CG, *kernel) in the forward form, ``epilogue_args`` = (bias, scale, shift, parsed activation);
    ``dtype`` the element type where the arrays hold its bits (bfloat16 as uint16), else x's."""
    bias, scale, shift, act = epilogue_args
    xp = array_module(is_cupy(x))
    dt = np.dtype(dtype or x.dtype)
    ct = compute_dtype(dt)
    s, t = affine_vectors(geo.k, bias, scale, shift)
    xm = memory(x, cl)
    if xp is np:
        sc, sh = s.astype(ct), t.astype(ct)
    else:  # uploaded once per stream (direct_cache)
        sc, sh = direct_cache.device_vector(s, ct), direct_cache.device_vector(t, ct)
    bufs = {"x": xm.copy() if _overlap(x, y) else xm, "w": xp.ascontiguousarray(w).reshape(-1), "y": memory(y, cl),
            "sc": sc, "sh": sh}
    if residual is not None:
        bufs["res"] = memory(residual, cl)
    if xp is not np and depthwise_vec.applies(geo, cl, dt) and \
            not any(bufs[b].data.ptr % depthwise_vec.UNIT for b in ("x", "y", "res") if b in bufs):
        wt = direct_cache.derived(w, ("taps",), lambda: xp.ascontiguousarray(w.reshape(geo.k, -1).T))
        launch_vector(geo, dt, act, {**bufs, "w": wt})
        return
    launch_forward(geo, cl, dt, act, bufs)


def launch_vector(geo: ConvGeometry, dtype, activation, bufs: dict) -> None:
    """depthwise_vec's kernel on the current device and stream: ``bufs`` as for :func:`launch_forward`, w the
    tap-major (taps, K) weight."""
    name = None if activation is None else activation.name
    sizes = tuple(b.size for b in bufs.values())
    residual = "res" in bufs

    def make():
        params = depthwise_vec.params(geo, dtype)
        index = index_type(params, sizes)
        return depthwise_vec.source(dtype, name, residual, index), _ints(params, index)
    src, ints = _LAUNCHES.get(("vec", geo, np.dtype(dtype).str, name, residual, sizes), make)
    vt = np.float64 if np.dtype(bufs["sc"].dtype) == np.float64 else np.float32
    p = vt((activation.param if activation is not None else None) or 0.0)
    res = [bufs["res"]] if residual else []
    _kernel(src)(bufs["x"], bufs["w"], bufs["sc"], bufs["sh"], *res, p, *ints, bufs["y"],
                 size=bufs["y"].size // depthwise_vec.per_unit(dtype))


def weight(geo: ConvGeometry, x, dy, cl: bool, dtype=None):
    """dW (K, CG, *kernel), C-contiguous, of x's type (``dtype``: as in ``forward``), from x and dY
    compact in the layout ``cl`` says."""
    xp = array_module(is_cupy(x))
    dt = np.dtype(dtype or x.dtype)
    split = weight_split(geo)
    part = xp.empty(geo.k * geo.crs * split, dtype=compute_dtype(dt))
    launch_weight(geo, cl, dt, {"x": memory(x, cl), "dy": memory(dy, cl), "part": part}, split)
    return _cast(xp, reduce_partials(part, geo, cl, split), dt).reshape(geo.k, geo.cg, *geo.kernel)
