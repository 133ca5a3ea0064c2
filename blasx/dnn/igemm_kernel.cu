// Implicit-GEMM convolution forward on sm_90a (see igemm.py). Defined before this text: ELEM_BYTES (2 or 4),
// BN, STAGES, PIPE, OUT_BF16, wgmma_common.cu, and wgmma_n<BN>(acc, desc_a, desc_b), called as WGMMA(.
#define BM 128
#define THREADS 256
#define BK (ROW / ELEM_BYTES)          // elements of a k-tile row
#define CHE (16 / ELEM_BYTES)          // elements of a 16-byte piece
#define A_IT (BM * 8 / THREADS)        // A pieces a thread loads per k-tile
#define B_IT (BN * 8 / THREADS)
#define NACC (BN / 2)
#define STAGE_BYTES ((BM + BN) * ROW)
#define DIST (STAGES - 1 - PIPE)       // k-tiles loaded ahead

// A K-major shared-memory matrix in the 128-byte swizzle: 8-row groups 1024 bytes apart.
__device__ __forceinline__ unsigned long long desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

extern "C" __global__ void __launch_bounds__(THREADS) blasx_igemm(
    const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, float* __restrict__ part,
    int N, int D, int H, int W, int C, int K, int KD, int R, int S, int O, int P, int Q,
    int sd, int sh, int sw, int pd, int ph, int pw, int dd, int dh, int dw, int kt_per_split)
{
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid & 127) >> 5, lane = tid & 31;
    const long long M = (long long)N * O * P * Q;
    const long long m0 = (long long)blockIdx.x * BM;
    const int n0 = blockIdx.y * BN;
    const int cchunks = C / BK, taps_rs = R * S;
    const int kt0 = blockIdx.z * kt_per_split;
    const int KT = min(KD * taps_rs * cchunks - kt0, kt_per_split);
    const long long RSC = (long long)KD * taps_rs * C;
    const int my_ch = tid & 7, row_base = tid >> 3;

    // per A row this thread loads: its pixel's offset at tap (0, 0, 0) and its corner, out of range if m >= M
    long long a_pix[A_IT];
    int a_d0[A_IT], a_h0[A_IT], a_w0[A_IT];
#pragma unroll
    for (int i = 0; i < A_IT; ++i) {
        long long m = m0 + row_base + i * (THREADS / 8);
        bool ok = m < M;
        long long mm = ok ? m : 0;
        int q = (int)(mm % Q); long long t = mm / Q;
        int p = (int)(t % P); t /= P;
        int o = (int)(t % O); long long n = t / O;
        a_d0[i] = ok ? o * sd - pd : -(1 << 29);
        a_h0[i] = p * sh - ph;
        a_w0[i] = q * sw - pw;
        a_pix[i] = (((n * D + a_d0[i]) * H + a_h0[i]) * W + a_w0[i]) * C + my_ch * CHE;
    }
    const T* wrow[B_IT];
    bool b_ok[B_IT];
#pragma unroll
    for (int i = 0; i < B_IT; ++i) {
        int k = n0 + row_base + i * (THREADS / 8);
        b_ok[i] = k < K;
        wrow[i] = w + (b_ok[i] ? (long long)k * RSC : 0) + my_ch * CHE;
    }

    auto load = [&](int stage, int kt) {
        int kg = kt0 + kt;
        int tap = kg / cchunks, c0 = (kg - tap * cchunks) * BK;
        int tt = tap / taps_rs, rem = tap - tt * taps_rs;
        int r = rem / S, s = rem - r * S;
        int od = tt * dd, oh = r * dh, ow = s * dw;
        long long toff = (((long long)od * H + oh) * W + ow) * C + c0;
        unsigned char* as = smem + stage * STAGE_BYTES;
        unsigned char* bs = as + BM * ROW;
#pragma unroll
        for (int i = 0; i < A_IT; ++i) {
            int row = row_base + i * (THREADS / 8);
            bool ok = (unsigned)(a_d0[i] + od) < (unsigned)D && (unsigned)(a_h0[i] + oh) < (unsigned)H &&
                      (unsigned)(a_w0[i] + ow) < (unsigned)W;
            const T* src = ok ? x + a_pix[i] + toff : x;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                         :: "r"(smem_u32(as + tile_off(row, my_ch))), "l"(src), "r"(ok ? 16 : 0));
        }
#pragma unroll
        for (int i = 0; i < B_IT; ++i) {
            int row = row_base + i * (THREADS / 8);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                         :: "r"(smem_u32(bs + tile_off(row, my_ch))), "l"(wrow[i] + (long long)kg * BK),
                            "r"(b_ok[i] ? 16 : 0));
        }
    };

    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = 0.f;

    // 32 bytes of k per instruction
    WGMMA_K_LOOP(BM * ROW, WGMMA(acc, desc(as + wg * 64 * ROW + kk * 32), desc(bs + kk * 32)));
    __syncthreads();

    // fragment (row g / g + 8 of the warp's 16, columns 8j + 2 t4, +1) of the warpgroup's 64 x BN tile
    const int g = lane >> 2, t4 = lane & 3;
    const int lrow = wg * 64 + warp * 16 + g;
    if (gridDim.z == 1) {
        const int LD = BN + CHE;  // staged tile row, padded a piece against bank conflicts
        T* st = reinterpret_cast<T*>(smem);
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            int col = j * 8 + t4 * 2;
#if ELEM_BYTES == 2
            *reinterpret_cast<unsigned*>(&st[lrow * LD + col]) = pack2(acc[4 * j], acc[4 * j + 1]);
            *reinterpret_cast<unsigned*>(&st[(lrow + 8) * LD + col]) = pack2(acc[4 * j + 2], acc[4 * j + 3]);
#else
            *reinterpret_cast<float2*>(&st[lrow * LD + col]) = make_float2(acc[4 * j], acc[4 * j + 1]);
            *reinterpret_cast<float2*>(&st[(lrow + 8) * LD + col]) = make_float2(acc[4 * j + 2], acc[4 * j + 3]);
#endif
        }
        __syncthreads();
        for (int idx = tid; idx < BM * (BN / CHE); idx += THREADS) {
            int row = idx / (BN / CHE), pc = idx % (BN / CHE);
            long long rr = m0 + row;
            int col = n0 + pc * CHE;
            if (rr < M && col < K)
                *reinterpret_cast<uint4*>(&y[rr * K + col]) = *reinterpret_cast<const uint4*>(&st[row * LD + pc * CHE]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            int col = n0 + j * 8 + t4 * 2;
            if (col >= K) continue;
#pragma unroll
            for (int hlf = 0; hlf < 2; ++hlf) {
                long long rr = m0 + lrow + hlf * 8;
                if (rr < M)
                    *reinterpret_cast<float2*>(part + ((long long)blockIdx.z * M + rr) * K + col) =
                        make_float2(acc[4 * j + 2 * hlf], acc[4 * j + 2 * hlf + 1]);
            }
        }
    }
}
