// Implicit-GEMM weight gradient on sm_90a (see igemm_weight.py). Defined before this text: WGM (warpgroups,
// along M), BN, STAGES, PIPE, ELEM_BYTES (2: wgmma transposes no 4-byte operand), OUT_BF16, wgmma_common.cu, and
// wgmma_n<BN>(acc, desc_a, desc_b) with both operands MN-major, called as WGMMA(; gather_kernel.HELPERS'
// blasx_quo (a quotient by its fast_divisor pair).
#define THREADS (128 * WGM)
#define CHUNK (64 * ROW)               // a chunk: 64 pixels x 64 channels, eight 1024-byte swizzle atoms
#define NB (BN / 64)                   // B chunks
#define RPT (512 / THREADS)            // pixel rows a thread loads per chunk
#define NACC (BN / 2)
#define STAGE_BYTES ((WGM + NB) * CHUNK)
#define DIST (STAGES - 1 - PIPE)       // k-tiles loaded ahead

// An MN-major operand in the 128-byte swizzle: 64-element MN blocks a chunk (LBO) apart, 8-row K groups
// 1024 bytes (SBO) apart.
__device__ __forceinline__ unsigned long long desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(CHUNK >> 4) << 16) |
           (64ull << 32) | (1ull << 62);
}

// dW (K, T*R*S*C) (+ float32 split partials) from channels-last X (N, D, H, W, C) and dY (N, O, P, Q, K):
// dW[k, tap, c] = sum over pixels of dY[pixel, k] X[pixel's window at tap, c]. Block (blockIdx.x: BN columns,
// y: 64 WGM rows, z: a split's run of pixel k-tiles).
extern "C" __global__ void __launch_bounds__(THREADS) blasx_igemm_wgrad(
    const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dw, float* __restrict__ part,
    int N, int D, int H, int W, int C, int K, int KD, int R, int S, int O, int P, int Q,
    int sd, int sh, int sw, int pd, int ph, int pw, int dd, int dh, int dw_, int kt_per_split,
    unsigned mq, int shq, unsigned mp, int shp, unsigned mo, int sho)
{
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid & 127) >> 5, lane = tid & 31;
    const unsigned NPIX = (unsigned)N * O * P * Q;
    const int RSC = KD * R * S * C;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * (64 * WGM);
    const int KT_ALL = (int)((NPIX + 63) / 64);
    const int kt0 = blockIdx.z * kt_per_split;
    const int KT = min(KT_ALL - kt0, kt_per_split);
    const int my_ch = tid & 7, row_base = tid >> 3;

    // per B chunk: its tap's offsets (input pixels) and element offset in x; out of range past RSC
    int b_od[NB], b_oh[NB], b_ow[NB];
    long long b_off[NB];
#pragma unroll
    for (int j = 0; j < NB; ++j) {
        int col = n0 + j * 64;
        int tap = col / C, c0 = col - tap * C;
        int tt = tap / (R * S), rem = tap - tt * R * S;
        int r = rem / S, s = rem - r * S;
        b_od[j] = col < RSC ? tt * dd : (1 << 29);
        b_oh[j] = r * dh;
        b_ow[j] = s * dw_;
        b_off[j] = (((long long)b_od[j] * H + b_oh[j]) * W + b_ow[j]) * C + c0 + my_ch * 8;
    }

    auto load = [&](int stage, int kt) {
        unsigned char* as = smem + stage * STAGE_BYTES;
        unsigned char* bs = as + WGM * CHUNK;
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            int row = row_base + i * (THREADS / 8);
            unsigned pix = (unsigned)(kt0 + kt) * 64 + row;
            bool ok = pix < NPIX;
            unsigned pp = ok ? pix : 0;
            unsigned t1 = blasx_quo(pp, (unsigned)Q, mq, (unsigned)shq), q = pp - t1 * Q;
            unsigned t2 = blasx_quo(t1, (unsigned)P, mp, (unsigned)shp), p = t1 - t2 * P;
            unsigned n = blasx_quo(t2, (unsigned)O, mo, (unsigned)sho), o = t2 - n * O;
            int d0 = (int)o * sd - pd, h0 = (int)p * sh - ph, w0 = (int)q * sw - pw;
            long long xb = (((long long)n * D + d0) * H + h0) * (long long)W * C + (long long)w0 * C;
            const T* ay = dy + (long long)pp * K + m0 + my_ch * 8;
#pragma unroll
            for (int j = 0; j < WGM; ++j)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                             :: "r"(smem_u32(as + j * CHUNK + tile_off(row, my_ch))), "l"(ay + j * 64),
                                "r"(ok ? 16 : 0));
#pragma unroll
            for (int j = 0; j < NB; ++j) {
                bool in = ok && (unsigned)(d0 + b_od[j]) < (unsigned)D && (unsigned)(h0 + b_oh[j]) < (unsigned)H &&
                          (unsigned)(w0 + b_ow[j]) < (unsigned)W;
                const T* src = in ? x + xb + b_off[j] : x;
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                             :: "r"(smem_u32(bs + j * CHUNK + tile_off(row, my_ch))), "l"(src), "r"(in ? 16 : 0));
            }
        }
    };

    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = 0.f;

    // 16 pixels (two 8-row groups) per instruction
    WGMMA_K_LOOP(WGM * CHUNK, WGMMA(acc, desc(as + wg * CHUNK + kk * 2048), desc(bs + kk * 2048)));

    // fragment (row g / g + 8 of the warp's 16, columns 8j + 2 t4, +1) of the warpgroup's 64 x BN tile
    const int g = lane >> 2, t4 = lane & 3;
    const int row = m0 + wg * 64 + warp * 16 + g;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        int col = n0 + j * 8 + t4 * 2;
        if (col >= RSC) continue;
#pragma unroll
        for (int hlf = 0; hlf < 2; ++hlf) {
            long long at = (long long)(row + hlf * 8) * RSC + col;
            if (gridDim.z == 1)
                *reinterpret_cast<unsigned*>(dw + at) = pack2(acc[4 * j + 2 * hlf], acc[4 * j + 2 * hlf + 1]);
            else
                *reinterpret_cast<float2*>(part + (long long)blockIdx.z * K * RSC + at) =
                    make_float2(acc[4 * j + 2 * hlf], acc[4 * j + 2 * hlf + 1]);
        }
    }
}
