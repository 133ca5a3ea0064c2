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

// The k-loop both kernels run (their `load(stage, kt)`, `KT`, `smem` and `acc` in scope): DIST k-tiles loaded
// ahead into the STAGES-deep ring; per k-tile its loads awaited and made visible to wgmma, the ring refilled, and
// MMA (four instructions over the stage's A at `as`, B at `bs` = as + B_OFFSET, index kk) issued as one wgmma
// group with PIPE groups left in flight; all drained at the end.
#define WGMMA_K_LOOP(B_OFFSET, MMA)                                                                  \
    _Pragma("unroll")                                                                                \
    for (int s = 0; s < DIST; ++s) {                                                                 \
        if (s < KT) load(s, s);                                                                      \
        asm volatile("cp.async.commit_group;\n" ::);                                                 \
    }                                                                                                \
    for (int kt = 0; kt < KT; ++kt) {                                                                \
        asm volatile("cp.async.wait_group %0;\n" :: "n"(DIST - 1));                                  \
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");                               \
        __syncthreads();                                                                             \
        if (kt + DIST < KT) load((kt + DIST) % STAGES, kt + DIST);                                   \
        asm volatile("cp.async.commit_group;\n" ::);                                                 \
        const unsigned as = smem_u32(smem + (kt % STAGES) * STAGE_BYTES);                            \
        const unsigned bs = as + (B_OFFSET);                                                         \
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");                                    \
        _Pragma("unroll")                                                                            \
        for (int kk = 0; kk < 4; ++kk)                                                               \
            MMA;                                                                                     \
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");                             \
        asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(PIPE) : "memory");                 \
    }                                                                                                \
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");                                 \
    asm volatile("cp.async.wait_group 0;\n" ::)

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
