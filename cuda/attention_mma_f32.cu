// attention_mma_f32.cu -- float32 attention forward on tensor cores through TF32
// (sm_80 and newer).
//
// Computes:   the same function as attention_mma.cu (API.md semantics; reference
//             cuattn/reference.py::attention_reference) for float32 inputs with
//             precision="tf32": the products S = Q K^T and O += P V run on mma.sync m16n8k8
//             .tf32 with float32 accumulators, each operand (q, k, P, v) rounded to TF32
//             (10-bit mantissa, cvt.rna) once; the softmax is float32. Its yardstick is
//             cuattn/reference.py::naive_attention with the same roundings. precision=
//             "highest" stays on the portable family: a 3xTF32 variant of this kernel
//             (hi/lo operand splits, three products) ran at 39 TFLOP/s but missed the
//             accuracy rule by up to 2.0x (docs/kernels.rst).
// Layout:     as attention_mma.cu: AttnParams with element strides. ALIGNED instances copy
//             rows in 16-byte cp.async chunks (unit column strides, row strides multiples of
//             4 elements, 16-byte aligned pointers, head dims multiples of 4).
// Ownership:  a block of NUM_WARPS warps owns BLOCK_M = 16 * NUM_WARPS query rows of one
//             batch entry and all Dv columns; warp w owns rows 16w .. 16w+15 (lane g = lane/4,
//             t = lane%4 holds rows g, g+8 of each accumulator tile).
// Fragments:  float32 tiles in shared memory, loaded by plain LDS (ldmatrix moves 16-bit
//             units). The contraction index inside each k8 step is permuted consistently
//             for both operands -- lane t holds k = 2t, 2t+1 instead of t, t+4 -- so that a
//             lane's two A (and two B) elements are adjacent: one 64-bit load each. For
//             O += P V the permutation is the one the accumulator layout already has: the
//             S accumulator's columns 2t, 2t+1 of key tile j are the A operand's k = t, t+4,
//             and V rows 8j + 2t, 8j + 2t + 1 are loaded as B's k = t, t+4. No shuffles.
// Template:   BiasT; HAS_MASK; HEAD_DIM, HEAD_DIM_V: head dims padded to multiples of 32
//             (zero-filled); BLOCK_N keys per tile; NUM_WARPS; ALIGNED.
// Shared mem: (BLOCK_M*(HEAD_DIM+8) + 2*BLOCK_N*(HEAD_DIM+8) + 2*BLOCK_N*(HEAD_DIM_V+4)) * 4
//             bytes: Q, two stages of K and V. Row pitches HEAD_DIM+8 (64-bit loads of 8
//             rows x 4 lanes hit 32 distinct banks per half-warp) and HEAD_DIM_V+4 (V rows
//             2t, 2t+1 apart by 8 banks); cuattn/_dispatch.py::mma_f32_smem_bytes agrees.
#include "mma_softmax.cuh"
#include "mma_tiles.cuh"

using namespace cuattn;
using namespace cuattn::mma;

namespace {

__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

// d += a b for one m16n8k8 step: A elements (a0, a1, a2, a3) = rows (g, g+8, g, g+8) and
// k = (t, t, t+4, t+4); B elements (b0, b1) = k (t, t+4); operands already TF32
__device__ __forceinline__ void mma_1688(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                         unsigned a3, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Copy ROWS x COLS floats of a strided tensor into shared memory with row pitch PITCH;
// rows >= nrows and columns >= ncols become 0. ALIGNED: 16-byte cp.async chunks
// (ncols % 4 == 0, so chunks are all or nothing); otherwise synchronous element loads.
template <int ROWS, int COLS, int PITCH, int THREADS, bool ALIGNED>
__device__ __forceinline__ void load_tile_f32(float* dst, const float* src, long long row_stride,
                                              long long col_stride, long long nrows,
                                              long long ncols) {
    constexpr int CHUNKS = COLS / 4;
#pragma unroll 4
    for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS) {
        const int r = idx / CHUNKS, c = (idx % CHUNKS) * 4;
        float* d = dst + r * PITCH + c;
        if constexpr (ALIGNED) {
            const bool ok = r < nrows && c < ncols;
            const float* s = ok ? src + r * row_stride + c : src;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(d)),
                         "l"(s), "r"(ok ? 16 : 0));
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const bool ok = r < nrows && c + e < ncols;
                d[e] = ok ? src[r * row_stride + (c + e) * col_stride] : 0.f;
            }
        }
    }
}

// S (16 x BLOCK_N) = Q K^T for the warp's rows: A from Q rows g, g+8; B from K rows
// 8j + g; inside each k8 step lane t reads columns k0 + 2t, k0 + 2t + 1 of both.
template <int HEAD_DIM, int BLOCK_N>
__device__ __forceinline__ void scores_f32(float (&s)[BLOCK_N / 8][4], const float* q_w,
                                           const float* k_s, int lane) {
    constexpr int QP = HEAD_DIM + 8;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll 2
    for (int k0 = 0; k0 < HEAD_DIM; k0 += 8) {
        const float2 q0 = *reinterpret_cast<const float2*>(q_w + g * QP + k0 + 2 * t);
        const float2 q1 = *reinterpret_cast<const float2*>(q_w + (g + 8) * QP + k0 + 2 * t);
        const unsigned a0 = to_tf32(q0.x), a1 = to_tf32(q1.x), a2 = to_tf32(q0.y),
                       a3 = to_tf32(q1.y);
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j) {
            const float2 kv = *reinterpret_cast<const float2*>(k_s + (8 * j + g) * QP + k0 + 2 * t);
            mma_1688(s[j], a0, a1, a2, a3, to_tf32(kv.x), to_tf32(kv.y));
        }
    }
}

// O (16 x HEAD_DIM_V) += P V: P's accumulator columns (2t, 2t+1) of key tile j are A's
// k = (t, t+4); B takes V rows 8j + 2t, 8j + 2t + 1 at column 8d + g.
template <int BLOCK_N, int HEAD_DIM_V>
__device__ __forceinline__ void accumulate_pv_f32(float (&o)[HEAD_DIM_V / 8][4],
                                                  const float (&s)[BLOCK_N / 8][4],
                                                  const float* v_s, int lane) {
    constexpr int VP = HEAD_DIM_V + 4;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j) {
        const unsigned a0 = to_tf32(s[j][0]), a1 = to_tf32(s[j][2]), a2 = to_tf32(s[j][1]),
                       a3 = to_tf32(s[j][3]);
        const float* v0 = v_s + (8 * j + 2 * t) * VP + g;
#pragma unroll
        for (int d = 0; d < HEAD_DIM_V / 8; ++d) {
            mma_1688(o[d], a0, a1, a2, a3, to_tf32(v0[8 * d]), to_tf32(v0[VP + 8 * d]));
        }
    }
}

}  // namespace

template <typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N,
          int NUM_WARPS, bool ALIGNED>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) attention_fwd_mma_f32(const AttnParams p) {
    constexpr int THREADS = NUM_WARPS * 32, BLOCK_M = 16 * NUM_WARPS;
    constexpr int QP = HEAD_DIM + 8, VP = HEAD_DIM_V + 4, DV_TILES = HEAD_DIM_V / 8;
    static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM_V % 32 == 0 && BLOCK_N % 8 == 0,
                  "head dims are padded to multiples of 32, key tiles to multiples of 8");
    constexpr int K_ELEMS = BLOCK_N * QP, V_ELEMS = BLOCK_N * VP;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    float* q_s = reinterpret_cast<float*>(smem_raw);  // [BLOCK_M][QP]
    float* k_s = q_s + BLOCK_M * QP;                  // [2][BLOCK_N][QP]
    float* v_s = k_s + 2 * K_ELEMS;                   // [2][BLOCK_N][VP]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long m_block = p.num_m_blocks - 1 - blockIdx.x % p.num_m_blocks;  // heavy first
    const long long b = blockIdx.x / p.num_m_blocks;
    const long long m0 = m_block * BLOCK_M;

    const float* q = reinterpret_cast<const float*>(p.q) + batch_offset(p.q_s, b, p.batch1, p.batch2) + m0 * p.q_s.row;
    const float* k = reinterpret_cast<const float*>(p.k) + batch_offset(p.k_s, b, p.batch1, p.batch2);
    const float* v = reinterpret_cast<const float*>(p.v) + batch_offset(p.v_s, b, p.batch1, p.batch2);
    const unsigned char* mask = p.mask ? reinterpret_cast<const unsigned char*>(p.mask) +
                                             batch_offset(p.mask_s, b, p.batch1, p.batch2) : nullptr;
    const BiasT* bias = p.bias ? reinterpret_cast<const BiasT*>(p.bias) +
                                     batch_offset(p.bias_s, b, p.batch1, p.batch2) : nullptr;

    // key tiles that the causal/window band reaches from rows m0 .. m_last
    const long long off = p.seqlen_k - p.seqlen_q;
    const long long m_last = min(m0 + BLOCK_M, p.seqlen_q) - 1;
    long long n_lo = 0, n_hi = p.seqlen_k;
    if (p.window_left >= 0) n_lo = max(0LL, m0 + off - p.window_left);
    if (p.window_right >= 0) n_hi = min(n_hi, m_last + off + p.window_right + 1);
    n_lo = n_lo / BLOCK_N * BLOCK_N;

    auto request_kv = [&](long long n0, int stage) {
        load_tile_f32<BLOCK_N, HEAD_DIM, QP, THREADS, ALIGNED>(
            k_s + stage * K_ELEMS, k + n0 * p.k_s.row, p.k_s.row, p.k_s.col, p.seqlen_k - n0,
            p.head_dim);
        load_tile_f32<BLOCK_N, HEAD_DIM_V, VP, THREADS, ALIGNED>(
            v_s + stage * V_ELEMS, v + n0 * p.v_s.row, p.v_s.row, p.v_s.col, p.seqlen_k - n0,
            p.head_dim_v);
    };
    load_tile_f32<BLOCK_M, HEAD_DIM, QP, THREADS, ALIGNED>(q_s, q, p.q_s.row, p.q_s.col,
                                                           p.seqlen_q - m0, p.head_dim);
    if (n_lo < n_hi) request_kv(n_lo, 0);
    cp_async_commit();

    float o[DV_TILES][4], m[2] = {neg_inf<float>(), neg_inf<float>()}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int d = 0; d < DV_TILES; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[d][e] = 0.f;
    const float* q_w = q_s + warp * 16 * QP;

    int stage = 0;
    for (long long n0 = n_lo; n0 < n_hi; n0 += BLOCK_N, stage ^= 1) {
        if (n0 + BLOCK_N < n_hi) request_kv(n0 + BLOCK_N, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();  // all but the group just issued have landed ...
        __syncthreads();     // ... for every thread: Q (first time), this tile's K and V
        float s[BLOCK_N / 8][4];
        scores_f32<HEAD_DIM, BLOCK_N>(s, q_w, k_s + stage * K_ELEMS, lane);
        const bool interior = !HAS_MASK && n0 + BLOCK_N <= p.seqlen_k && m0 + BLOCK_M <= p.seqlen_q &&
                              (p.window_left < 0 || n0 >= m_last + off - p.window_left) &&
                              (p.window_right < 0 || n0 + BLOCK_N - 1 <= m0 + off + p.window_right);
        mask_scores<BLOCK_N, HAS_MASK>(s, p, m0 + warp * 16, n0, lane, interior, mask, bias);
        update_row_state<BLOCK_N, DV_TILES>(s, m, l, o);
        accumulate_pv_f32<BLOCK_N, HEAD_DIM_V>(o, s, v_s + stage * V_ELEMS, lane);
        __syncthreads();  // this stage is consumed before the next iteration refills it
    }
    cp_async_wait<0>();  // no copy may outlive the block

    // Normalise and store; a row with no allowed key gives out 0 and lse -inf (API.md 6).
    float* out = reinterpret_cast<float*>(p.out) + batch_offset(p.out_s, b, p.batch1, p.batch2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float row_l = l[h];
        row_l += __shfl_xor_sync(0xffffffffu, row_l, 1);  // the quad's partial row sums
        row_l += __shfl_xor_sync(0xffffffffu, row_l, 2);
        const long long r = m0 + warp * 16 + lane / 4 + 8 * h;
        if (r >= p.seqlen_q) continue;  // rows past the end of a partial tile
        const float inv_l = row_l == 0.f ? 0.f : 1.f / row_l;
        float* out_row = out + r * p.out_s.row;
#pragma unroll
        for (int d = 0; d < DV_TILES; ++d) {
            const long long c = 8 * d + 2 * (lane % 4);
            if (c < p.head_dim_v) out_row[c * p.out_s.col] = o[d][2 * h] * inv_l;
            if (c + 1 < p.head_dim_v) out_row[(c + 1) * p.out_s.col] = o[d][2 * h + 1] * inv_l;
        }
        if (p.lse && lane % 4 == 0) {
            float* lse = reinterpret_cast<float*>(p.lse) + batch_offset(p.lse_s, b, p.batch1, p.batch2);
            lse[r * p.lse_s.row] = row_l == 0.f ? neg_inf<float>() : m[h] * float(LN2) + logf(row_l);
        }
    }
}
