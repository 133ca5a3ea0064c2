// A whole recurrent layer-direction forward in one launch (rnn_persist.py): every block owns J hidden units (all
// G gates of each); its warps hold those units' recurrent weight rows in registers for the whole loop, warp w
// the k range [w*KT*16, (w+1)*KT*16). A step loads each warp's slice of h_prev from L2 straight into its mma
// fragments, multiplies on tensor cores (mma m16n8k16, float32 accumulation), sums the warps' partial products
// in shared memory, applies the cell and writes the block's slice of h; the steps are ordered by a grid-wide
// barrier (FLAGS 0: one counter all blocks add to) or by per-block step flags every block waits on (FLAGS 1;
// faster for small grids). Blocks are co-resident (cooperative launch).
// Set by -D: MODE (0 lstm, 1 gru, 2 rnn_tanh, 3 rnn_relu), NT (8-column tiles of the block: G*J/8), KW (warps
// splitting k), KT (16-wide k steps a warp), MT (16-row tiles a pass), FLAGS. Data in float16 (CuPy has no
// bfloat16).
#include <cuda_fp16.h>
#define STYPE __half

#if MODE == 0
#define G 4
#elif MODE == 1
#define G 3
#else
#define G 1
#endif
#define J (NT * 8 / G)  // hidden units a block owns

__device__ __forceinline__ float tof(__half v) { return __half2float(v); }
__device__ __forceinline__ void put(__half* p, float x) { *p = __float2half_rn(x); }
// The activations in one MUFU instruction each (tanh.approx: relative error 2^-11, the float16 rounding of h).
__device__ __forceinline__ float tanh_fast(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float sigm(float x) { return fmaf(0.5f, tanh_fast(0.5f * x), 0.5f); }

__device__ __forceinline__ void mma16816(float* d, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {  // global -> shared, from L2
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// The step's gx slice of rows b0 .. b0+rows (this block's G*J gate columns) into sX, asynchronously.
// Laid out (G, MC, J): the cell's threads (unit fastest, then row) read consecutive words. 16-byte copies where
// the block's J units make whole 16-byte pieces (J % 4 == 0), else 4-byte ones.
__device__ __forceinline__ void stage_gx(float* sX, const float* gx, int t, int B, int H, int b0, int rows, int j0) {
    const float* src = gx + ((size_t)t * B + b0) * G * H + j0;
    if (J % 4 == 0) {
        constexpr int Q = (J + 3) / 4;  // 16-byte pieces of one row's gate slice (J / 4 here)
        for (int idx = threadIdx.x; idx < rows * G * Q; idx += blockDim.x) {
            const int r = idx / (G * Q), g = (idx % (G * Q)) / Q, q = idx % Q;
            cp_async16(sX + (g * (MT * 16) + r) * J + q * 4, src + (size_t)r * G * H + g * H + q * 4);
        }
    } else {
        for (int idx = threadIdx.x; idx < rows * G * J; idx += blockDim.x) {
            const int r = idx / (G * J), g = (idx % (G * J)) / J, u = idx % J;
            cp_async4(sX + (g * (MT * 16) + r) * J + u, src + (size_t)r * G * H + g * H + u);
        }
    }
}

// FLAGS 1: this block's h of `step` is written (the block barrier after the cell orders every thread's writes
// before thread 0's flag, released at gpu scope) ...
__device__ __forceinline__ void publish(unsigned* flags, unsigned step) {
    if (threadIdx.x == 0)
        asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flags + blockIdx.x), "r"(step) : "memory");
}

// ... and every block's is: thread i waits for block i's flag.
__device__ __forceinline__ void await_all(const unsigned* flags, unsigned step) {
    for (int i = threadIdx.x; i < gridDim.x; i += blockDim.x) {
        unsigned v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flags + i) : "memory");
        } while (v < step);
    }
    __syncthreads();
}

// FLAGS 0: all blocks arrive before any leaves (the block's writes ordered as in publish); `target` grows by
// gridDim.x a step (counter 0 at launch).
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target) {
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
        unsigned v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
        } while (v < target);
    }
    __syncthreads();
}

// At exit, every wait of this block is over (the last pass's block barrier): count the block out; the last one
// clears the step words and the count for the next launch on the buffer.
__device__ __forceinline__ void leave(unsigned* sync) {
    if (threadIdx.x == 0) {
        const int words = FLAGS ? gridDim.x : 1;
        if (atomicAdd(sync + words, 1u) == gridDim.x - 1) {
            for (int i = 0; i <= words; ++i) sync[i] = 0u;
        }
    }
}

// A fragments of rows r and r+8 for the k steps kt, kt+1 (KT even) or kt alone (KT odd), straight from global
// memory (L2): inside each 32-wide pair of k steps thread tig holds k 8*tig .. 8*tig+7 (one 16-byte load a row),
// and the weight fragments are loaded in the same k order (wk), so the products are unchanged.
__device__ __forceinline__ void load_a(unsigned (*af)[4], const STYPE* h, int r, int rows, int H, int k, int tig) {
    const STYPE* p0 = h + (size_t)r * H + k;
    const bool v0 = r < rows, v1 = r + 8 < rows;
    if (KT % 2 == 0) {
        uint4 x = v0 ? __ldcg((const uint4*)(p0 + tig * 8)) : make_uint4(0, 0, 0, 0);
        uint4 y = v1 ? __ldcg((const uint4*)(p0 + (size_t)8 * H + tig * 8)) : make_uint4(0, 0, 0, 0);
        af[0][0] = x.x; af[0][2] = x.y; af[1][0] = x.z; af[1][2] = x.w;
        af[0][1] = y.x; af[0][3] = y.y; af[1][1] = y.z; af[1][3] = y.w;
    } else {
        uint2 x = v0 ? __ldcg((const uint2*)(p0 + tig * 4)) : make_uint2(0, 0);
        uint2 y = v1 ? __ldcg((const uint2*)(p0 + (size_t)8 * H + tig * 4)) : make_uint2(0, 0);
        af[0][0] = x.x; af[0][2] = x.y; af[0][1] = y.x; af[0][3] = y.y;
    }
}

// The physical k (within the warp's range) of the weight fragment register `half` (0, 1) of k step kt.
__device__ __forceinline__ int wk(int kt, int half, int tig) {
    return KT % 2 == 0 ? (kt / 2) * 32 + tig * 8 + (kt % 2) * 4 + half * 2 : kt * 16 + tig * 4 + half * 2;
}

// A warp's tensor-core products for one pass: acc[mi][ni] = rows mi*16 .. (of `rows`) of A, row stride `ld`, `a`
// at the warp's k range of the pass's first row, times the warp's weight fragments `wf`; zeros where `a` is null.
__device__ __forceinline__ void warp_products(float (&acc)[MT][NT][4], const STYPE* a, int rows, int ld, int gid,
                                              int tig, const unsigned (&wf)[NT][KT][2]) {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int ni = 0; ni < NT; ++ni) acc[mi][ni][0] = acc[mi][ni][1] = acc[mi][ni][2] = acc[mi][ni][3] = 0.f;
    if (!a) return;
    constexpr int KS = KT % 2 == 0 ? 2 : 1;  // k steps a load covers
#pragma unroll
    for (int kt = 0; kt < KT; kt += KS) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
            unsigned af[KS][4];
            load_a(af, a, mi * 16 + gid, rows, ld, kt * 16, tig);
#pragma unroll
            for (int s = 0; s < KS; ++s)
#pragma unroll
                for (int ni = 0; ni < NT; ++ni) mma16816(acc[mi][ni], af[s], wf[ni][kt + s]);
        }
    }
}

#if !BWD
// gx (T, B, G*H) float in time order (the input projection); b_ih, b_hh (G*H) the biases or null (both add to gx
// except GRU's b_hn, which sits inside the reset product); W (G*H, H) row-major; S (T+1, B, H) with S[0] = h0, or
// zeros written here (`zero_h`); C (T+1, B, H) float with C[0] = c0, or zeros written here (`zero_c`; LSTM);
// gates (T, B, 4*H) float or null (the activations saved for the backward pass); bs[t] the active rows at time t
// (sorted lengths); hn, cn (B, H) or null: the final h and (LSTM) c in the storage type, written at the last
// step; sync the barrier's counter (FLAGS 0) or the blocks' step flags (FLAGS 1), then a word counting the blocks
// done: zeros at launch, and zeros again at exit (the last block out clears them, so a buffer serves the next
// launch on its stream); steps run in processing order p, time t = p or T-1-p.
// Shared memory: the warps' partial products (KW x G x MC x J), the step's gx slice (G x MC x J), the bias slice
// (NJ; GRU: then b_hn's J) and, LSTM, the block's cell states (B x J).
extern "C" __global__ void __launch_bounds__(256, 1)
rnn_persist_fwd(const float* __restrict__ gx, const STYPE* __restrict__ b_ih, const STYPE* __restrict__ b_hh,
                const STYPE* __restrict__ W, STYPE* S, float* C, float* gates, const int* __restrict__ bs,
                STYPE* hn_out, STYPE* cn_out, unsigned* sync, int T, int B, int H, int reverse, int zero_h,
                int zero_c) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int NJ = NT * 8, MC = MT * 16;
    const int j0 = blockIdx.x * J;
    float* sG = (float*)smem;
    float* sX = sG + (size_t)KW * MC * NJ;
    float* sB = sX + (size_t)MC * NJ;
    float* sBn = sB + NJ;  // GRU's b_hn slice
    float* sC = sBn + J;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    const bool mma_warp = warp < KW;
    const int kbase = warp * KT * 16;
    const size_t BH = (size_t)B * H;

    // this warp's weight fragments: local column n = g*J + u is W's row g*H + j0 + u
    unsigned wf[NT][KT][2];
#pragma unroll
    for (int ni = 0; ni < NT; ++ni) {
        const int n = ni * 8 + gid;
        const STYPE* row = W + (size_t)((n / J) * H + j0 + n % J) * H + kbase;
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
            wf[ni][kt][0] = mma_warp ? *(const unsigned*)(row + wk(kt, 0, tig)) : 0u;
            wf[ni][kt][1] = mma_warp ? *(const unsigned*)(row + wk(kt, 1, tig)) : 0u;
        }
    }
    for (int n = threadIdx.x; n < NJ; n += blockDim.x) {
        const int row = (n / J) * H + j0 + n % J;
        sB[n] = b_ih ? tof(b_ih[row]) + ((MODE == 1 && n / J == 2) ? 0.f : tof(b_hh[row])) : 0.f;
    }
    for (int u = threadIdx.x; u < J; u += blockDim.x) sBn[u] = (MODE == 1 && b_hh) ? tof(b_hh[2 * H + j0 + u]) : 0.f;
    for (int idx = threadIdx.x; idx < B * J; idx += blockDim.x) {
        const size_t o = (size_t)(idx / J) * H + j0 + idx % J;
        if (zero_h) S[o] = __float2half_rn(0.f);
#if MODE == 0
        if (zero_c) C[o] = 0.f;
        sC[idx] = zero_c ? 0.f : C[o];
#endif
    }

    const bool save = gates != nullptr;  // training: every step's c; inference: c_T only
    int a = bs[reverse ? T - 1 : 0];
    bool gx_ready = false;  // the first pass's gx slice was prefetched before the step's wait

    for (int p = 0; p < T; ++p) {
        const int t = reverse ? T - 1 - p : p;
        const STYPE* hp = S + (size_t)p * BH;
        STYPE* hn = S + (size_t)(p + 1) * BH;
        STYPE* const hf = p == T - 1 ? hn_out : nullptr;  // the final states' own outputs, at the last step
        STYPE* const cf = p == T - 1 ? cn_out : nullptr;
        for (int b0 = 0; b0 < B; b0 += MC) {
            const int rows = min(MC, B - b0);
#if FLAGS
            if (p > 0 && b0 == 0) await_all(sync, (unsigned)p);
#endif
            if (!gx_ready) stage_gx(sX, gx, t, B, H, b0, rows, j0);
            gx_ready = false;
            if (mma_warp) {
                const bool zero = p == 0 && zero_h;  // h0 = 0: nothing to read
                float acc[MT][NT][4];
                warp_products(acc, zero ? nullptr : hp + (size_t)b0 * H + kbase, rows, H, gid, tig, wf);
                float* o = sG + (size_t)warp * MC * NJ;
#pragma unroll
                for (int mi = 0; mi < MT; ++mi)
#pragma unroll
                    for (int ni = 0; ni < NT; ++ni) {  // column n = g*J + u goes to (g, row, u); J is even
                        const int r0 = mi * 16 + gid, n = ni * 8 + tig * 2, g = n / J, u = n % J;
                        *(float2*)(o + (g * MC + r0) * J + u) = make_float2(acc[mi][ni][0], acc[mi][ni][1]);
                        *(float2*)(o + (g * MC + r0 + 8) * J + u) = make_float2(acc[mi][ni][2], acc[mi][ni][3]);
                    }
            }
            cp_async_wait();
            __syncthreads();
            for (int idx = threadIdx.x; idx < rows * J; idx += blockDim.x) {  // the cell, one (row, unit) each
                const int r = idx / J, u = idx % J, b = b0 + r, j = j0 + u;
                const size_t o = (size_t)b * H + j;
                if (b >= a) {  // finished (forward) or not yet started (reverse): the state carries over
                    const STYPE h = __ldcg(hp + o);
                    hn[o] = h;
                    if (hf) hf[o] = h;
#if MODE == 0
                    if (save || p == T - 1) C[(p + 1) * BH + o] = sC[b * J + u];
                    if (cf) put(cf + o, sC[b * J + u]);
#endif
                    continue;
                }
                float s[G], xv[G];
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    float acc = 0.f;
#pragma unroll
                    for (int q = 0; q < KW; ++q) acc += sG[q * MC * NJ + (g * MC + r) * J + u];
                    s[g] = acc;
                    xv[g] = sX[(g * MC + r) * J + u] + sB[g * J + u];
                }
#if MODE == 0
                float ig = sigm(xv[0] + s[0]), fg = sigm(xv[1] + s[1]), gg = tanh_fast(xv[2] + s[2]),
                      og = sigm(xv[3] + s[3]);
                float cn = fg * sC[b * J + u] + ig * gg;
                sC[b * J + u] = cn;
                if (save || p == T - 1) C[(p + 1) * BH + o] = cn;
                if (cf) put(cf + o, cn);
                put(hn + o, og * tanh_fast(cn));
                if (hf) hf[o] = hn[o];
                if (gates) {
                    float* q = gates + ((size_t)p * B + b) * 4 * H + j;
                    q[0] = ig; q[H] = fg; q[2 * H] = gg; q[3 * H] = og;
                }
#elif MODE == 1
                float ghn = s[2] + sBn[u];
                float rg = sigm(xv[0] + s[0]), zg = sigm(xv[1] + s[1]);
                float ng = tanh_fast(xv[2] + rg * ghn);
                put(hn + o, (1.f - zg) * ng + zg * tof(__ldcg(hp + o)));
                if (hf) hf[o] = hn[o];
                if (gates) {
                    float* q = gates + ((size_t)p * B + b) * 4 * H + j;
                    q[0] = rg; q[H] = zg; q[2 * H] = ng; q[3 * H] = ghn;
                }
#elif MODE == 2
                put(hn + o, tanh_fast(xv[0] + s[0]));
                if (hf) hf[o] = hn[o];
#else
                float v = xv[0] + s[0];
                put(hn + o, v <= 0.f ? 0.f : v);
                if (hf) hf[o] = hn[o];
#endif
            }
            __syncthreads();
        }
        if (p + 1 < T) {  // the next step's active rows and first gx slice do not depend on h: fetch them first
#if FLAGS
            publish(sync, (unsigned)(p + 1));
#endif
            const int tn = reverse ? T - 2 - p : p + 1;
            a = bs[tn];
            stage_gx(sX, gx, tn, B, H, 0, min(MC, B), j0);
            gx_ready = true;
#if !FLAGS
            grid_barrier(sync, gridDim.x * (unsigned)(p + 1));
#endif
        }
    }
    leave(sync);
}
#endif

#if BWD && MODE == 0
// The inputs of one (row b, unit j) cell gradient at step p: i, f, g, o, c, c_prev, dy (0 without dy), all loaded
// before any is used, so their latencies overlap instead of each load stalling the arithmetic after it.
__device__ __forceinline__ void cell_inputs(float* v, const float* gates, const float* C, const float* dy, int p,
                                            int t, int b, int j, int B, int H) {
    const size_t k = ((size_t)p * B + b) * 4 * H + j, o = (size_t)b * H + j, BH = (size_t)B * H;
    v[0] = gates[k]; v[1] = gates[k + H]; v[2] = gates[k + 2 * H]; v[3] = gates[k + 3 * H];
    v[4] = C[(size_t)(p + 1) * BH + o]; v[5] = C[(size_t)p * BH + o];
    v[6] = dy ? dy[(size_t)t * BH + o] : 0.f;
}

// The backward loop of an LSTM layer-direction (rnn_layer.backward_steps without a projection) in one launch. Here
// a block owns NT*8 hidden units as outputs of the recurrent product dh = dgates . W_hh: its warps hold W_hh's
// columns of those units (all 4H rows, warp w the k range [w*KT*16, (w+1)*KT*16)) in registers. Step n runs the
// cell gradient of processing step p = T-1-n: dh of the block's units is the previous step's gate gradients
// (all blocks', rounded to the storage type, from L2) times those columns where the row was active there, else
// carried; then the cell's gradient writes the block's slice of the gate gradients (dgx in float, g16 rounded)
// and keeps dc; the wait as in the forward kernel. A last pass gives dh0 (and dc0).
// gates (T, B, 4H) and C (T+1, B, H) float as the forward saved them (processing order); W (4H, H) row-major;
// dy (T, B, H) float in time order or null; dh_n, dc_n (B, H) float or null (zeros); bs as forward; dgx (T, B, 4H)
// float and g16 (same, storage type) written whole (zeros for inactive rows); dh0, dc0 (B, H) float.
// Shared memory: the warps' partial products (KW x MC x U), the block's dh and dc (B x U each).
extern "C" __global__ void __launch_bounds__(256, 1)
rnn_persist_bwd(const float* __restrict__ gates, const float* __restrict__ C, const STYPE* __restrict__ W,
                const float* __restrict__ dy, const float* __restrict__ dh_n, const float* __restrict__ dc_n,
                const int* __restrict__ bs, float* dgx, STYPE* g16, float* dh0, float* dc0, unsigned* sync,
                int T, int B, int H, int reverse) {
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int U = NT * 8;  // hidden units a block owns
    const int MC = MT * 16, GH = 4 * H;
    const int j0 = blockIdx.x * U;
    float* sG = (float*)smem;
    float* sDH = sG + (size_t)KW * MC * U;
    float* sDC = sDH + (size_t)B * U;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    const bool mma_warp = warp < KW;
    const int kbase = warp * KT * 16;
    const size_t BG = (size_t)B * GH;

    // this warp's fragments of W_hh's columns: (k, n) is W[kbase + k][j0 + n], k ordered as load_a's
    unsigned wf[NT][KT][2];
#pragma unroll
    for (int ni = 0; ni < NT; ++ni) {
        const int col = j0 + ni * 8 + gid;
#pragma unroll
        for (int kt = 0; kt < KT; ++kt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const size_t k = (size_t)kbase + wk(kt, half, tig);
                wf[ni][kt][half] = mma_warp ? (unsigned)__half_as_ushort(W[k * H + col]) |
                                              ((unsigned)__half_as_ushort(W[(k + 1) * H + col]) << 16) : 0u;
            }
    }
    for (int idx = threadIdx.x; idx < B * U; idx += blockDim.x) {
        const size_t o = (size_t)(idx / U) * H + j0 + idx % U;
        sDH[idx] = dh_n ? dh_n[o] : 0.f;
        sDC[idx] = dc_n ? dc_n[o] : 0.f;
    }
    __syncthreads();

    for (int n = 0; n <= T; ++n) {
        const int p = T - 1 - n;  // the step whose cell gradient runs (-1: the last pass, dh0 only)
        const int t = reverse ? T - 1 - p : p;
        const int a = p >= 0 ? bs[t] : 0;
        const int a_prev = n > 0 ? bs[reverse ? T - 2 - p : p + 1] : 0;  // active rows of step p+1
        const STYPE* gp = g16 + (size_t)(p + 1) * BG;
        for (int b0 = 0; b0 < B; b0 += MC) {
            const int rows = min(MC, B - b0);
#if FLAGS
            if (n > 0 && b0 == 0) await_all(sync, (unsigned)n);
#endif
            if (n > 0 && mma_warp) {
                float acc[MT][NT][4];
                warp_products(acc, gp + (size_t)b0 * GH + kbase, rows, GH, gid, tig, wf);
                float* o = sG + (size_t)warp * MC * U;
#pragma unroll
                for (int mi = 0; mi < MT; ++mi)
#pragma unroll
                    for (int ni = 0; ni < NT; ++ni) {
                        const int r0 = mi * 16 + gid, c0 = ni * 8 + tig * 2;
                        *(float2*)(o + r0 * U + c0) = make_float2(acc[mi][ni][0], acc[mi][ni][1]);
                        *(float2*)(o + (r0 + 8) * U + c0) = make_float2(acc[mi][ni][2], acc[mi][ni][3]);
                    }
            }
            __syncthreads();
            for (int idx = threadIdx.x; idx < rows * U; idx += blockDim.x) {  // one (row, unit) each
                const int r = idx / U, u = idx % U, b = b0 + r, j = j0 + u;
                float dh = sDH[b * U + u];
                if (b < a_prev) {  // active at step p+1: its gate gradients times W_hh
                    dh = 0.f;
#pragma unroll
                    for (int q = 0; q < KW; ++q) dh += sG[(q * MC + r) * U + u];
                }
                if (p < 0) {
                    dh0[(size_t)b * H + j] = dh;
                    dc0[(size_t)b * H + j] = sDC[b * U + u];
                    continue;
                }
                const size_t k = ((size_t)p * B + b) * GH + j;
                if (b >= a) {  // past the sequence's end: nothing flows, dh and dc carry over
                    dgx[k] = dgx[k + H] = dgx[k + 2 * H] = dgx[k + 3 * H] = 0.f;
                    g16[k] = g16[k + H] = g16[k + 2 * H] = g16[k + 3 * H] = __float2half_rn(0.f);
                    sDH[b * U + u] = dh;
                    continue;
                }
                float v[7];
                cell_inputs(v, gates, C, dy, p, t, b, j, B, H);
                const float d = dh + v[6], ig = v[0], fg = v[1], gg = v[2], og = v[3];
                const float tc = tanh_fast(v[4]);
                const float dct = sDC[b * U + u] + d * og * (1.f - tc * tc);
                const float d0 = dct * gg * ig * (1.f - ig), d1 = dct * v[5] * fg * (1.f - fg),
                            d2 = dct * ig * (1.f - gg * gg), d3 = d * tc * og * (1.f - og);
                dgx[k] = d0; dgx[k + H] = d1; dgx[k + 2 * H] = d2; dgx[k + 3 * H] = d3;
                put(g16 + k, d0); put(g16 + k + H, d1); put(g16 + k + 2 * H, d2); put(g16 + k + 3 * H, d3);
                sDC[b * U + u] = dct * fg;
            }
            __syncthreads();
        }
        if (n < T) {
#if FLAGS
            publish(sync, (unsigned)(n + 1));
#else
            grid_barrier(sync, gridDim.x * (unsigned)(n + 1));
#endif
        }
    }
    leave(sync);
}
#endif
