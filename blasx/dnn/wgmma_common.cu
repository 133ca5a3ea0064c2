// Pieces both wgmma kernels use (igemm_kernel.cu, igemm_weight_kernel.cu; see igemm.py). Defined before this
// text: ELEM_BYTES (2 or 4), OUT_BF16.
#define ROW 128                        // bytes of a shared-memory tile row: one 128-byte swizzle atom

#if ELEM_BYTES == 2
typedef unsigned short T;
#else
typedef float T;
#endif

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
#if OUT_BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

// Row `row`, 16-byte piece `ch` of a tile, swizzled as wgmma's 128-byte mode reads it.
__device__ __forceinline__ int tile_off(int row, int ch) { return row * ROW + ((ch ^ (row & 7)) << 4); }

// y = the sum of the splits' float32 partials, in split order; four elements a thread (MK % 4 == 0).
extern "C" __global__ void blasx_split_reduce(const float* __restrict__ part, T* __restrict__ y, long long MK,
                                              int splits) {
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i >= MK) return;
    float4 s = *reinterpret_cast<const float4*>(part + i);
    for (int z = 1; z < splits; ++z) {
        float4 t = *reinterpret_cast<const float4*>(part + z * MK + i);
        s.x += t.x; s.y += t.y; s.z += t.z; s.w += t.w;
    }
#if ELEM_BYTES == 2
    uint2 o;
    o.x = pack2(s.x, s.y);
    o.y = pack2(s.z, s.w);
    *reinterpret_cast<uint2*>(y + i) = o;
#else
    *reinterpret_cast<float4*>(y + i) = s;
#endif
}
