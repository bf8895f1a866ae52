// SageAttention's algorithm for sm_75 and newer: INT8 Q.K^T on m8n8k16 IMMA, fp32 online softmax,
// FP16 P.V on m16n8k8 HMMA accumulating in fp32, bf16 out. Compiled at first use by NVRTC
// (h3serve/runtime/kernels/nvrtc_cache.py); the inputs come from h3serve/runtime/kernels/sage_prepare.py.
//
// Only instructions Turing has: no cp.async (plain ld.global + st.shared, the next tile prefetched into
// registers while this one is computed), no ldmatrix (fragments read as 32-bit words from padded shared
// rows, so no bank conflicts), no bf16 mma or cvt (bf16 out by integer rounding), static shared memory
// 27 KB (Turing: 48 KB per block without opt-in). No headers: NVRTC needs no include path.
//
// One block: 64 query rows of one (batch, head), 4 warps of 16 rows. Keys in tiles of 64.
// Inputs (n_pad = rows rounded up to 64, padding zero):
//   q  int8 (B*H, n_pad, 128), q_scale fp32 (B*H, n_pad): one scale per query row, times the softmax
//      scale and log2(e), so scores come out in the exp2 domain;
//   k  int8 (B*H, n_pad, 128) of K minus its mean over rows, k_scale fp32 (B*H, n_pad): one per key;
//   shift int32 (B*H): see below.
//   Per-row scales because outlier channels sit in every row: a block's scale is the largest outlier of
//   all its rows, a row's only its own (docs/turing.md has the measurements). A score is
//   int32 * (q_scale[row] * k_scale[key]) in fp32; the tile's 64 key scales go through shared memory.
//   Channels 0..15 of q and k are the head's outlier channels, divided by a power of two before the row's
//   scale was taken (the pre-pass ordered them so: exact for Q.K^T); their step's int32 sum is multiplied
//   by 2**shift[bh] (<= 8: it stays in int32) before the other 7 steps add to it;
//   vt fp16 (B*H, 128, n_pad): V transposed (channel-major, so P.V's B fragments are two adjacent keys),
//      divided by v_scale fp32 (B*H, 128), a power of two per channel that keeps |V| < 256 in fp16;
//   out bf16 (B, rows, H, 128), the caller's NHD layout.
// Tail keys (>= rows) are masked to -inf in the last tile; tail query rows are computed and not stored.

#define HEAD_DIM 128
#define BLOCK_Q 64
#define WARP_ROWS 16
#define BLOCK_K 64
#define THREADS 128
#define NEG_INF __int_as_float(0xff800000)
#define K_STRIDE 144  // bytes per key row in shared: 128 + 16, so 8 rows x 4 words hit 32 distinct banks
#define V_STRIDE 72   // halves per channel row in shared: 64 + 8, the same reason

typedef signed char s8;
typedef unsigned short u16;
typedef unsigned int u32;

// C[8x8 s32] += A[8x16 s8, row] * B[16x8 s8, col]. Lane l: g = l/4, t = l%4.
// A: row g, columns 4t..4t+3 (one word). B: column g, rows 4t..4t+3 (one word: 4 bytes of key row g).
// C: row g, columns 2t, 2t+1.
__device__ __forceinline__ void mma_s8(int& c0, int& c1, u32 a, u32 b) {
    asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32 {%0,%1}, {%2}, {%3}, {%0,%1};"
                 : "+r"(c0), "+r"(c1) : "r"(a), "r"(b));
}

// D[16x8 f32] += A[16x8 f16, row] * B[8x8 f16, col]. A: a0 = row g, columns 2t, 2t+1; a1 = row g+8, same
// columns. B: column g, rows 2t, 2t+1. D: d0, d1 = row g, columns 2t, 2t+1; d2, d3 = row g+8.
// The C fragment of two m8n8k16 (rows g and g+8, keys 2t, 2t+1 of an 8-key tile) is exactly this A
// fragment, so the probabilities go from the score registers to P.V with no shuffle.
__device__ __forceinline__ void mma_f16(float* d, u32 a0, u32 a1, u32 b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(b));
}

__device__ __forceinline__ float exp2_approx(float x) {  // exp2(-inf) = 0: masked keys weigh nothing
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32 pack_f16(float lo, float hi) {  // two cvt.rn.f16.f32 (the f16x2 form is sm_80)
    u16 a, b;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(a) : "f"(lo));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(hi));
    return (u32)a | ((u32)b << 16);
}

__device__ __forceinline__ u32 bf16_bits(float x) {  // round to nearest even by integer arithmetic
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  // NaN stays NaN
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ float quad_max(float x) {  // the 4 lanes of a quad hold one row
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

extern "C" __global__ void __launch_bounds__(THREADS) sage_fp16_attention(
    const s8* __restrict__ q, const float* __restrict__ q_scale, const s8* __restrict__ k,
    const float* __restrict__ k_scale, const int* __restrict__ shift, const u16* __restrict__ vt,
    const float* __restrict__ v_scale, u16* __restrict__ out, int rows, int heads, int n_pad) {
    __shared__ __align__(16) s8 ks[BLOCK_K * K_STRIDE];              // 9,216 bytes
    __shared__ __align__(16) u16 vs[HEAD_DIM * V_STRIDE];            // 18,432 bytes
    __shared__ __align__(16) float kss[BLOCK_K];                      // 256 bytes: the tile's key scales

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int bh = blockIdx.y, row0 = blockIdx.x * BLOCK_Q + warp * WARP_ROWS;
    const s8* kh = k + (size_t)bh * n_pad * HEAD_DIM;
    const u16* vh = vt + (size_t)bh * HEAD_DIM * n_pad;

    // This warp's Q as A fragments, kept in registers: [m-tile of 8 rows][16-column step].
    u32 qf[2][8];
    for (int m = 0; m < 2; ++m)
        for (int s = 0; s < 8; ++s)
            qf[m][s] = *(const u32*)(q + ((size_t)bh * n_pad + row0 + m * 8 + g) * HEAD_DIM + s * 16 + t * 4);
    const float qs[2] = {q_scale[(size_t)bh * n_pad + row0 + g], q_scale[(size_t)bh * n_pad + row0 + 8 + g]};
    const float* ksh = k_scale + (size_t)bh * n_pad;
    const int outlier_factor = 1 << shift[bh];  // a multiply, not acc << shift: that is UB for acc < 0

    float o[16][4];  // O (16 rows x 128 channels) as 16 D fragments of 8 channels
    for (int n = 0; n < 16; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};  // rows g and g+8; l: this lane's share

    // A tile is 16-byte words: K 64 x 8 (4 a thread), V^T 128 x 8 (8 a thread); word i of the tile is
    // row i/8, column i%8 in both; key scale i is thread i's (i < 64). The next tile waits in these
    // registers while this one is computed.
    uint4 k_next[4], v_next[8];
    float ks_next = 0.f;
    const int tiles = n_pad / BLOCK_K;
    auto fetch = [&](int tile) {
        for (int j = 0; j < 4; ++j) {
            const int i = tid + j * THREADS;
            k_next[j] = *(const uint4*)(kh + ((size_t)tile * BLOCK_K + i / 8) * HEAD_DIM + (i % 8) * 16);
        }
        for (int j = 0; j < 8; ++j) {
            const int i = tid + j * THREADS;
            v_next[j] = *(const uint4*)(vh + (size_t)(i / 8) * n_pad + tile * BLOCK_K + (i % 8) * 8);
        }
        if (tid < BLOCK_K) ks_next = ksh[tile * BLOCK_K + tid];
    };
    fetch(0);
    for (int tile = 0; tile < tiles; ++tile) {
        __syncthreads();  // every warp is done with the previous tile
        for (int j = 0; j < 4; ++j) {
            const int i = tid + j * THREADS;
            *(uint4*)(ks + (i / 8) * K_STRIDE + (i % 8) * 16) = k_next[j];
        }
        for (int j = 0; j < 8; ++j) {
            const int i = tid + j * THREADS;
            *(uint4*)(vs + (i / 8) * V_STRIDE + (i % 8) * 8) = v_next[j];
        }
        if (tid < BLOCK_K) kss[tid] = ks_next;
        __syncthreads();
        if (tile + 1 < tiles) fetch(tile + 1);

        // S = Q K^T in int32: [m-tile][8-key tile][2 columns].
        int acc[2][8][2];
        for (int m = 0; m < 2; ++m)
            for (int n = 0; n < 8; ++n) acc[m][n][0] = acc[m][n][1] = 0;
        for (int s = 0; s < 8; ++s) {
            for (int n = 0; n < 8; ++n) {
                const u32 b = *(const u32*)(ks + (n * 8 + g) * K_STRIDE + s * 16 + t * 4);
                mma_s8(acc[0][n][0], acc[0][n][1], qf[0][s], b);
                mma_s8(acc[1][n][0], acc[1][n][1], qf[1][s], b);
            }
            if (s == 0)  // the outlier channels' step
                for (int m = 0; m < 2; ++m)
                    for (int n = 0; n < 8; ++n) {
                        acc[m][n][0] *= outlier_factor;
                        acc[m][n][1] *= outlier_factor;
                    }
        }

        // Online softmax in fp32, in the exp2 domain (log2(e) is in the Q scale).
        const int key0 = tile * BLOCK_K + t * 2;
        const bool tail = tile * BLOCK_K + BLOCK_K > rows;
        float p[2][8][2];
        for (int m = 0; m < 2; ++m) {
            float mx = NEG_INF;
            for (int n = 0; n < 8; ++n)
                for (int e = 0; e < 2; ++e) {
                    float sc = (float)acc[m][n][e] * (qs[m] * kss[n * 8 + t * 2 + e]);
                    if (tail && key0 + n * 8 + e >= rows) sc = NEG_INF;
                    p[m][n][e] = sc;
                    mx = fmaxf(mx, sc);
                }
            const float m_new = fmaxf(m_run[m], quad_max(mx));  // finite: key 0 is in the first tile
            const float alpha = exp2_approx(m_run[m] - m_new);
            m_run[m] = m_new;
            float sum = 0.f;
            for (int n = 0; n < 8; ++n)
                for (int e = 0; e < 2; ++e) {
                    p[m][n][e] = exp2_approx(p[m][n][e] - m_new);
                    sum += p[m][n][e];
                }
            l_run[m] = l_run[m] * alpha + sum;
            for (int n = 0; n < 16; ++n) {
                o[n][2 * m] *= alpha;
                o[n][2 * m + 1] *= alpha;
            }
        }

        // O += P V: P rounded to fp16 (in [0, 1]), V^T from shared, fp32 accumulation.
        for (int c = 0; c < 8; ++c) {
            const u32 a0 = pack_f16(p[0][c][0], p[0][c][1]), a1 = pack_f16(p[1][c][0], p[1][c][1]);
            for (int n = 0; n < 16; ++n) {
                const u32 b = *(const u32*)(vs + (n * 8 + g) * V_STRIDE + c * 8 + t * 2);
                mma_f16(o[n], a0, a1, b);
            }
        }
    }

    // out = O / l * v_scale, in fp32, then bf16; rows past the end are not stored.
    const int batch = bh / heads, head = bh % heads;
    const float* vsc = v_scale + (size_t)bh * HEAD_DIM;
    for (int m = 0; m < 2; ++m) {
        const int row = row0 + m * 8 + g;
        const float inv = 1.f / quad_sum(l_run[m]);
        if (row >= rows) continue;
        u32* dst = (u32*)(out + (((size_t)batch * rows + row) * heads + head) * HEAD_DIM);
        for (int n = 0; n < 16; ++n) {
            const int ch = n * 8 + t * 2;
            const u32 lo = bf16_bits(o[n][2 * m] * inv * vsc[ch]);
            const u32 hi = bf16_bits(o[n][2 * m + 1] * inv * vsc[ch + 1]);
            dst[ch / 2] = lo | (hi << 16);
        }
    }
}
