"""The implicit-GEMM form of the device route's forward pass (conv_direct.py): one kernel computes
``Y[N*O*P*Q, K] = im2col(X)[N*O*P*Q, T*R*S*C] W[K, T*R*S*C]^T`` on Hopper's warpgroup tensor-core
instructions (wgmma, sm_90a), gathering each im2col tile from channels-last X straight into shared memory,
so no col buffer is written or read.

The kernel: a block computes a BM x BN tile of Y (BM = 128 output pixels, BN output channels) with two
warpgroups of 64 rows each. The reduction runs over k-tiles of 128 bytes of channels within one kernel tap
(C a multiple of a k-tile), each tile loaded by cp.async into a ``STAGES``-deep ring of shared-memory stages
in the 128-byte swizzled K-major layout wgmma's descriptors read; ``PIPE`` wgmma groups stay in flight, so
a stage is refilled ``PIPE + 1`` iterations after it was read. The accumulators (float32) go out through
shared memory in 16-byte row pieces; with split-k (``Config.split`` > 1) each split writes float32 partials
that a second kernel sums in split order (deterministic) into Y.

Types: float16 and bfloat16 (k16 instructions), float32 in TF32 math (k8). Operands: X (N, D, H, W, C) and
W (K, T, R, S, C) compact, Y (N, O, P, Q, K) compact, all 16-byte aligned. ``config`` (pure) picks the tile
and split from the problem; ``plan_launch`` (pure) the grid and arguments.
"""

from __future__ import annotations

from math import prod
from typing import NamedTuple

import numpy as np

from . import driver_launch
from .geometry import ConvGeometry

ROW_BYTES = 128  # a k-tile row: one 128-byte swizzle atom
STAGES = 4
THREADS = 256  # two warpgroups
BM = 128
ALIGN = 16  # bytes: the kernel's loads and stores move 16-byte pieces, so every operand starts on such a boundary


class TypeRow(NamedTuple):
    """What the kernel needs of an operand type: bytes an element, the wgmma type and k per instruction,
    whether the transpose immediates are written (16-bit types only)."""

    itemsize: int
    mma: str
    k_step: int
    trans_imm: bool


TYPES = {"float16": TypeRow(2, "f16", 16, True), "bfloat16": TypeRow(2, "bf16", 16, True),
         "float32": TypeRow(4, "tf32", 8, False)}


class Config(NamedTuple):
    bn: int  # output channels a block computes: 64, 128 or 256
    pipe: int  # wgmma groups left in flight per k-tile
    split: int  # k splits (1: Y written directly)


def type_name(dtype, math: str | None) -> str | None:
    """The kernel's type for operands of ``dtype`` in ``math``, or None (float32 runs only in TF32 math)."""
    name = np.dtype(dtype).name
    if name == "float32":
        return name if math == "tf32" else None
    return name if name in TYPES else None


def applies(geo: ConvGeometry, dtype, cl: bool, math: str | None) -> bool:
    """Whether the kernel runs ``geo``: channels-last operands of a kernel type, one group, no zero insertion
    (transposed convolutions), C a whole number of k-tiles, K a whole number of 16-byte pieces."""
    t = type_name(dtype, math)
    if t is None or not cl or geo.groups != 1 or any(z != 1 for z in geo.insert):
        return False
    per_row, per_piece = ROW_BYTES // TYPES[t].itemsize, ALIGN // TYPES[t].itemsize
    return geo.c % per_row == 0 and geo.k % per_piece == 0


def k_tiles(geo: ConvGeometry, itemsize: int) -> int:
    """The k-tiles of ``geo``'s reduction: 128-byte runs of channels, per kernel tap."""
    return prod(geo.kernel) * geo.c * itemsize // ROW_BYTES


def config(geo: ConvGeometry, type_: str, sms: int) -> Config:
    """The tile and split for ``geo`` in kernel type ``type_`` on a GPU of ``sms`` multiprocessors: BN as wide
    as K allows (64, 128, 256), narrowed to 128 where that leaves under half the multiprocessors a block; then
    k splits (at most 4, each at least 8 k-tiles) while the blocks fill at most half the multiprocessors (a
    second partial wave costs more than the split gains)."""
    m, k = geo.n * geo.p, geo.k
    bn = 64 if k <= 64 else 128 if k <= 128 else 256
    rows = -(-m // BM)
    if bn == 256 and rows * -(-k // bn) < sms // 2:
        bn = 128
    blocks = rows * -(-k // bn)
    tiles = k_tiles(geo, TYPES[type_].itemsize)
    split = 1
    while split < 4 and blocks * split * 2 <= sms and tiles // (split * 2) >= 8:
        split *= 2
    return Config(bn, 0 if bn == 64 else 1, split)


def pays_pointwise(geo: ConvGeometry, dtype) -> bool:
    """Whether the kernel beats the cuBLAS GEMM on a 1x1 stride-1 convolution (a plain GEMM on x): for 2-byte
    types with at least 4 k-tiles, on at most 65,536 output pixels or at most 64 output channels (there the
    GEMM's call costs the host more than the GPU spends on either; on more, few k-tiles a block leave this
    kernel's pipeline idle). TF32's GEMMs take long enough on the GPU to keep cuBLAS."""
    size = np.dtype(dtype).itemsize
    return size == 2 and k_tiles(geo, size) >= 4 and (geo.n * geo.p <= 65536 or geo.k <= 64)


class Launch(NamedTuple):
    """One call's launches: the main kernel's grid, shared memory bytes and integer arguments (int32, as the
    kernel takes them; the last the k-tiles a split covers), the partials' float32 elements (0: none) and the
    reduce kernel's grid and arguments."""

    type: str
    config: Config
    grid: tuple
    smem: int
    ints: tuple
    part: int
    reduce_grid: tuple
    reduce_ints: tuple


def _dims3(v: tuple, fill: int) -> tuple:
    """A spatial tuple of 1-3 dims as 3 (leading dims ``fill``)."""
    return (fill,) * (3 - len(v)) + tuple(v)


def smem_bytes(type_: str, bn: int) -> int:
    """The dynamic shared memory of the main kernel of tile width ``bn``: the stages or the staged output tile,
    whichever is larger, and room to align them to 1024 bytes."""
    row = TYPES[type_]
    return max(STAGES * (BM + bn) * ROW_BYTES, BM * (bn + ALIGN // row.itemsize) * row.itemsize) + 1024


def plan_launch(geo: ConvGeometry, type_: str, cfg: Config) -> Launch:
    """The launches for ``geo`` in kernel type ``type_`` with ``cfg`` (pure)."""
    m, k = geo.n * geo.p, geo.k
    tiles = k_tiles(geo, TYPES[type_].itemsize)
    per = -(-tiles // cfg.split)
    split = -(-tiles // per)
    bn = cfg.bn
    smem = smem_bytes(type_, bn)
    d, h, w = _dims3(geo.in_size, 1)
    t, r, s = _dims3(geo.kernel, 1)
    o, p, q = _dims3(geo.out_size, 1)
    ints = tuple(np.int32(v) for v in (geo.n, d, h, w, geo.c, k, t, r, s, o, p, q, *_dims3(geo.stride, 1),
                                        *_dims3(geo.pad_lo, 0), *_dims3(geo.dilation, 1), per))
    part = split * m * k if split > 1 else 0
    mk = m * k
    return Launch(type_, cfg._replace(split=split), (-(-m // BM), -(-k // bn), split), smem, ints, part,
                  (-(-mk // 4 // 256),), (mk, split))


def wgmma_source(n: int, row: TypeRow, transpose: bool = False) -> str:
    """``wgmma_n{n}(acc, desc_a, desc_b)``: acc (float32 m64 x n fragments) += A B on one warpgroup; operands
    K-major, or both MN-major (``transpose``: 2-byte types only)."""
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    t = int(transpose)
    imm = f"p, 1, 1, {t}, {t}" if row.trans_imm else "p, 1, 1"
    return (f"__device__ __forceinline__ void wgmma_n{n}(float (&d)[{regs}], unsigned long long da, "
            f"unsigned long long db) {{\n"
            f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n"\n'
            f'    "wgmma.mma_async.sync.aligned.m64n{n}k{row.k_step}.f32.{row.mma}.{row.mma} '
            f'{{{outs}}}, %{regs}, %{regs + 1}, {imm};\\n}}\\n"\n'
            f'    : {cons} : "l"(da), "l"(db), "r"(1));\n}}\n')


def source(defines: dict, wgmma: str, body_file: str, n: int) -> str:
    """A kernel module's CUDA text: ``defines``, wgmma_common.cu, the wgmma function ``wgmma`` and
    ``body_file`` with its WGMMA( calls naming it."""
    from importlib import resources
    files = resources.files(__package__)
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    body = files.joinpath(body_file).read_text().replace("WGMMA(", f"wgmma_n{n}(")
    return head + files.joinpath("wgmma_common.cu").read_text() + wgmma + body


def kernel_source(type_: str, cfg: Config) -> str:
    """The CUDA source of the main and reduce kernels for ``type_`` and ``cfg``'s tile (see igemm_kernel.cu)."""
    row = TYPES[type_]
    defines = {"ELEM_BYTES": row.itemsize, "BN": cfg.bn, "STAGES": STAGES, "PIPE": cfg.pipe,
               "OUT_BF16": int(type_ == "bfloat16")}
    return source(defines, wgmma_source(cfg.bn, row), "igemm_kernel.cu", cfg.bn)


_MODULES: dict = {}


def compiled(key, source, main: str):
    """(``main``, the split reduce) CuPy functions of the CUDA text ``source()``, compiled once per ``key`` and
    process (CuPy keeps the binary in its kernel cache across processes)."""
    got = _MODULES.get(key)
    if got is None:
        import cupy
        mod = cupy.RawModule(code=source(), options=("-arch=sm_90a", "-std=c++17"))
        got = _MODULES[key] = (mod.get_function(main), mod.get_function("blasx_split_reduce"), mod)
    return got[0], got[1]


def kernels(type_: str, cfg: Config):
    """(main, reduce) CuPy functions for ``type_`` and ``cfg``'s tile."""
    return compiled(("fwd", type_, cfg.bn, cfg.pipe), lambda: kernel_source(type_, cfg), "blasx_igemm")


_CAPABLE: dict = {}


def capable(device: int) -> bool:
    """Whether GPU ``device`` runs sm_90a code (compute capability 9.0: H100, H200)."""
    got = _CAPABLE.get(device)
    if got is None:
        import cupy
        got = _CAPABLE[device] = cupy.cuda.Device(device).compute_capability == "90"
    return got


def current_capable() -> bool:
    """``capable`` of CuPy's current device; False where CuPy is not loaded or finds no GPU."""
    import sys
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return False
    try:
        return capable(cupy.cuda.Device().id)
    except Exception:  # noqa: BLE001 - no driver or no GPU: the kernel cannot run
        return False


def aligned(*arrays) -> bool:
    """Whether every array's memory starts on a 16-byte boundary (the kernel's 16-byte loads and stores)."""
    return all(a.data.ptr % ALIGN == 0 for a in arrays)


class Pair:
    """A main kernel launched with its integer arguments packed once (``tail``, ctypes) and, where ``launch``
    splits, the reduce kernel summing its partials: ``(a, b, y, part)`` pointers in, launched on ``stream``."""

    def __init__(self, main, reduce, launch, threads: int, tail: tuple) -> None:
        import ctypes
        main.max_dynamic_shared_size_bytes = launch.smem  # (CuPy sets it on the current device's function)
        self.launch = launch
        self.main = driver_launch.DriverLaunch(main, launch.grid, (threads, 1, 1), launch.smem, 4, tail)
        self.reduce = None if not launch.part else driver_launch.DriverLaunch(
            reduce, (*launch.reduce_grid, 1, 1), (256, 1, 1), 0, 2,
            (ctypes.c_int64(launch.reduce_ints[0]), ctypes.c_int32(launch.reduce_ints[1])))

    def __call__(self, stream: int, a: int, b: int, y: int, part: int = 0) -> None:
        self.main(stream, a, b, y, part or y)
        if self.reduce is not None:
            self.reduce(stream, part, y)


class Launcher(Pair):
    """``launch``'s kernels on the current device, ready: ``(x, w, y, part)`` pointers in."""

    def __init__(self, launch: Launch) -> None:
        import ctypes
        super().__init__(*kernels(launch.type, launch.config), launch, THREADS,
                         tuple(ctypes.c_int32(int(v)) for v in launch.ints))


_LAUNCHERS: dict = {}


def launcher(launch, make=Launcher) -> Pair:
    """``make(launch)`` (a Pair) on the current device, made once per launch and device."""
    import cupy
    key = (type(launch), launch, cupy.cuda.runtime.getDevice())
    got = _LAUNCHERS.get(key)
    if got is None:
        got = _LAUNCHERS[key] = make(launch)
    return got


def run(launch: Launch, x, w, y, part) -> None:
    """The launches on the current device and stream: x, w, y CuPy arrays (compact, aligned), ``part``
    float32 scratch of ``launch.part`` elements (None where there is no split)."""
    import cupy
    launcher(launch)(cupy.cuda.get_current_stream().ptr, x.data.ptr, w.data.ptr, y.data.ptr,
                     0 if part is None else part.data.ptr)
