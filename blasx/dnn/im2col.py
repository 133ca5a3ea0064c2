"""im2col as a derived operand: tiles of one group's col(X) made on the device from the input X.

The virtual matrix ``col`` of group g is ``CRS x N*P``: row = a reduction index over (channel, kernel
position), in the order (c, r, s) for NCHW x and (r, s, c) for channels-last x; column = (image, output
pixel). Element = X[n, g*Cg + c, u // insert] at u = o*stride - pad_lo + r*dilation where that is a real
input position (see ``ConvGeometry``), else 0: padding and a transposed convolution's zero insertion
are done by the gather, never built. The source is X as a column-major 2-D view of its memory; ``strides``
give X[n, c, i...]'s element offset in it. Host tiles: a vectorised numpy gather. CUDA: the slab of X the
tile needs (its images, its channels, the outermost spatial rows it reaches) is copied into the copy
stream's scratch with pitched copies (read in place when X is on the device), then a CuPy kernel gathers
every element of the tile from it.
"""

from __future__ import annotations

from math import prod

import numpy as np

from ..runtime.derived import Derivation
from ..runtime.devices.cupy_streams import on_stream
from .geometry import ConvGeometry


class Im2col(Derivation):
    """col(X) of group ``group`` for geometry ``geo``; ``channels_last`` sets the reduction order and X's
    strides; ``per_image``: the planner's tiles never cross images (their ranges are part of the key)."""

    def __init__(self, geo: ConvGeometry, group: int, channels_last: bool, per_image: bool,
                 source_view, source_slot: int) -> None:
        super().__init__(geo.crs, geo.n * geo.p, source_view, source_slot)
        self.geo = geo
        self.group = group
        self.channels_last = channels_last
        self.per_image = per_image
        self.strides = x_strides(geo, channels_last)
        self.ks = prod(geo.kernel)

    @property
    def key(self):
        return (self.geo, self.group, self.channels_last, self.per_image)

    # ------------------------------------------------------------ index arithmetic
    def _rows(self, r):
        """(channel within the group, kernel multi-index) of reduction indices ``r``."""
        if self.channels_last:
            kidx, c = np.divmod(r, self.geo.cg)
        else:
            c, kidx = np.divmod(r, self.ks)
        return c, np.unravel_index(kidx, self.geo.kernel)

    def host_tile(self, source, ref):
        """The tile's values by a numpy gather from X's memory (zero where padding or zero insertion)."""
        g = self.geo
        c, kr = self._rows(np.arange(ref.r0, ref.r0 + ref.rows))
        n, p = np.divmod(np.arange(ref.c0, ref.c0 + ref.cols), g.p)
        o = np.unravel_index(p, g.out_size)
        sn, sc, ssp = self.strides
        off = (n * sn)[None, :] + ((c + self.group * g.cg) * sc)[:, None]
        ok = np.ones((ref.rows, ref.cols), dtype=bool)
        for d in range(g.nd):
            u = o[d][None, :] * g.stride[d] - g.pad_lo[d] + (kr[d] * g.dilation[d])[:, None]
            if g.insert[d] > 1:
                ok &= u % g.insert[d] == 0
                u = u // g.insert[d]
            ok &= (u >= 0) & (u < g.in_size[d])
            off = off + u * ssp[d]
        flat = source.array.reshape(-1, order="F")  # a view: the source is X's compact memory
        vals = flat[np.where(ok, off, 0)]
        vals[~ok] = 0
        return vals

    def slab(self, ref):
        """What a tile reads of X: (first image, last image, first channel, channels, first row, rows)
        in the group's channels and the outermost spatial dim (rows <= 0: the tile is all zeros)."""
        g = self.geo
        r1 = ref.r0 + ref.rows - 1
        if self.channels_last:
            same = ref.r0 // g.cg == r1 // g.cg
            c_lo, c_hi = (ref.r0 % g.cg, r1 % g.cg) if same else (0, g.cg - 1)
        else:
            c_lo, c_hi = ref.r0 // self.ks, r1 // self.ks
        n0, p0 = divmod(ref.c0, g.p)
        n1, p1 = divmod(ref.c0 + ref.cols - 1, g.p)
        inner = g.p // g.out_size[0]
        o_lo, o_hi = (p0 // inner, p1 // inner) if n0 == n1 else (0, g.out_size[0] - 1)
        u_lo = o_lo * g.stride[0] - g.pad_lo[0]
        u_hi = o_hi * g.stride[0] - g.pad_lo[0] + (g.kernel[0] - 1) * g.dilation[0]
        z = g.insert[0]
        i_lo, i_hi = max(0, -(-u_lo // z)), min(g.in_size[0] - 1, u_hi // z)
        return n0, n1, c_lo, c_hi - c_lo + 1, i_lo, i_hi - i_lo + 1

    def nbytes_read(self, ref) -> int:
        n0, n1, _c, nc, _i, ni = self.slab(ref)
        inner = prod(self.geo.in_size[1:])
        return max(0, (n1 - n0 + 1) * nc * ni * inner) * np.dtype(self.source_view.dtype).itemsize

    # ------------------------------------------------------------ CUDA
    def fill_plan(self, ref, in_place: bool):
        """How a CUDA fill makes tile ``ref``: (copies, slab elements, gather arguments). ``copies``:
        pitched copies (dst, src offset, width, height, dst pitch, src pitch; in elements, src from
        X's view's first element) staging the slab; none when X is read ``in_place``; None when the
        tile is all zeros. The arguments are those of the gather kernel after the slab."""
        g = self.geo
        n0, n1, c_lo, nc, i_lo, ni = self.slab(ref)
        if ni <= 0:
            return None, 0, ()
        sn, sc, ssp = self.strides
        inner = prod(g.in_size[1:])
        goff = self.group * g.cg
        copies = []
        if in_place:
            total = self.source_view.shape[0] * self.source_view.shape[1]
            b_n, b_c, b_i, tn, tc, tsp = 0, 0, 0, sn, sc, ssp
        else:
            per_img = nc * ni * inner
            total = (n1 - n0 + 1) * per_img
            for j, n in enumerate(range(n0, n1 + 1)):
                src = n * sn + (goff + c_lo) * sc + i_lo * ssp[0]
                if self.channels_last:  # ni*inner pixels of nc contiguous channels each
                    copies.append((j * per_img, src, nc, ni * inner, nc, g.c))
                else:  # nc channels of ni*inner contiguous elements each
                    copies.append((j * per_img, src, ni * inner, nc, ni * inner, sc))
            b_n, b_c, b_i = n0, goff + c_lo, i_lo
            tn, tc = per_img, (1 if self.channels_last else ni * inner)
            tsp = tuple(v // g.c * nc for v in ssp) if self.channels_last else ssp
        pad = 3 - g.nd

        def three(t, fill):
            return (*t, *(fill,) * pad)
        args = (ref.r0, ref.c0, ref.rows, g.p, self.ks, g.cg, int(self.channels_last), goff,
                *three(g.kernel, 1)[1:], *three(g.out_size, 1)[1:], *three(g.stride, 1), *three(g.dilation, 1),
                *three(g.pad_lo, 0), *three(g.insert, 1), *three(g.in_size, 1), tn, tc, *three(tsp, 0), b_n, b_c, b_i)
        return copies, total, args

    def fill(self, dev, s, dst, source, ref) -> None:
        """Stage the tile's slab of X on stream ``s`` (unless X is on ``dev``) and gather the tile there."""
        from ..runtime.devices.cuda_lowp import device_view
        isz = np.dtype(self.source_view.dtype).itemsize
        udt = {2: np.uint16, 4: np.uint32, 8: np.uint64}[isz]  # a gather moves bits: no arithmetic on values
        in_place = source.device == dev.ordinal
        copies, total, args = self.fill_plan(ref, in_place)
        with on_stream(dev.streams[s]):
            out = device_view(dst[0], ref.rows, ref.cols, dst[1], udt).T  # (cols, rows): C order = memory order
            if copies is None:
                out.fill(0)
                return
            base = source.ptr if in_place else dev._stage(s, total * isz)
            for d, src, width, height, dpitch, spitch in copies:
                dev._copy_2d(s, "in", source, base + d * isz, dpitch * isz, source.ptr + src * isz, spitch * isz,
                             width, height, isz)
            slab = device_view(base, total, 1, total, udt).ravel()
            _gather_kernel()(slab, *[np.int64(a) for a in args], out)


_KERNEL = []


def _gather_kernel():
    """The im2col gather as a CuPy ElementwiseKernel over the tile (element bits: no arithmetic on values)."""
    if not _KERNEL:
        import cupy
        names = ("r0 c0 rows P KS Cg cl goff K1 K2 O1 O2 st0 st1 st2 dl0 dl1 dl2 pl0 pl1 pl2 z0 z1 z2 "
                 "I0 I1 I2 sn sc s0 s1 s2 bn bc bi").split()
        params = "raw T slab, " + ", ".join(f"int64 {n}" for n in names)
        body = """
        long long row = i % rows, col = i / rows;
        long long gr = r0 + row, gc = c0 + col, c, k;
        if (cl) { k = gr / Cg; c = gr % Cg; } else { c = gr / KS; k = gr % KS; }
        long long k2 = k % K2, k1 = (k / K2) % K1, k0 = k / (K1 * K2);
        long long n = gc / P, p = gc % P;
        long long o2 = p % O2, o1 = (p / O2) % O1, o0 = p / (O1 * O2);
        long long u0 = o0 * st0 - pl0 + k0 * dl0;
        long long u1 = o1 * st1 - pl1 + k1 * dl1;
        long long u2 = o2 * st2 - pl2 + k2 * dl2;
        bool ok = u0 >= 0 && u1 >= 0 && u2 >= 0 && u0 % z0 == 0 && u1 % z1 == 0 && u2 % z2 == 0;
        u0 /= z0; u1 /= z1; u2 /= z2;
        ok = ok && u0 < I0 && u1 < I1 && u2 < I2;
        y = ok ? slab[(n - bn) * sn + (c + goff - bc) * sc + (u0 - bi) * s0 + u1 * s1 + u2 * s2] : (T)0;
        """
        _KERNEL.append(cupy.ElementwiseKernel(params, "T y", body, "blasx_im2col_gather"))
    return _KERNEL[0]


def x_strides(geo: ConvGeometry, channels_last: bool):
    """Element strides of X[n, c, i...] in its memory: (image, channel, per spatial dim)."""
    size = prod(geo.in_size)
    row_major = tuple(prod(geo.in_size[d + 1:]) for d in range(geo.nd))
    if channels_last:
        return size * geo.c, 1, tuple(v * geo.c for v in row_major)
    return geo.c * size, size, row_major
