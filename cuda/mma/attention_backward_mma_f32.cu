// attention_backward_mma_f32.cu -- float32 attention backward for precision="tf32" on
// tensor cores (sm_80 and newer).
//
// Computes:   the gradients of the float32 forward (reference
//             cuattn/reference.py::attention_backward_reference) with FlashAttention-2's
//             recomputation, as attention_backward_mma.cu: delta first (backward.cuh), then
//             per tile P = exp(s - lse), dP = dO V^T, dS = P o (dP - delta) (softcap
//             derivative included), dV += P^T dO, dK += scale dS^T Q, dQ += scale dS K.
//             Every product runs on mma.sync m16n8k8 TF32 steps with float32 accumulators,
//             each operand rounded to TF32 once (cvt.rna), P and dS included; the yardstick
//             is reference.py::naive_attention_backward with the same roundings.
// Kernels:    attention_bwd_dkdv_mma_f32: a block of NUM_WARPS warps owns BLOCK_N =
//             16*NUM_WARPS keys and all columns of dK and dV; warp w owns keys 16w .. 16w+15
//             and walks the query tiles (BLOCK_M rows) of the band. S^T = K Q^T and
//             dP^T = V dO^T land in m16n8 accumulators, which are the A operands of
//             dV += P^T dO and dK += dS^T Q as they stand (below). Q, dO, lse and delta
//             arrive by cp.async one tile ahead.
//             attention_bwd_dq_mma_f32: a block owns BLOCK_M = 16*NUM_WARPS query rows and
//             all columns of dQ and walks the key tiles (BLOCK_N keys, double-buffered):
//             S = Q K^T, dP = dO V^T, dS in registers, dQ += dS K.
//             Each gradient element is written once by one thread: no atomics, repeated calls
//             are bit-identical.
// Fragments:  plain LDS (ldmatrix moves 16-bit units). The block's own operand of the score
//             products (K and V for dK/dV, Q and dO for dQ) is stored once in fragment
//             order: for each 16-row tile, k8 step and lane, the four A elements (rows g,
//             g+8 at k = t, t+4) as one float4, so a step's A is one 128-bit load. The
//             streamed tiles (Q, dO; K, V) are plain rows with a pitch of COLS + 4 floats,
//             read two ways without bank conflicts: as B of the score products, element
//             (row 8j + g, k0 + t) and (8j + g, k0 + t + 4) (banks 4g + t); as B of the
//             gradient products, rows 8j + 2t and 8j + 2t + 1 at column 8d + g (banks
//             8t + g), because there the contraction index of lane t's two slots is the
//             accumulator's columns 2t and 2t + 1 (the slots of a k8 step can hold any two
//             indices as long as A and B agree), which lets P^T, dS^T and dS feed the
//             gradient products from registers: no shuffles, no transposed copies.
// Template:   BiasT; HAS_MASK; HEAD_DIM, HEAD_DIM_V padded to multiples of 64 (zero-filled);
//             the tile of the other sequence (BLOCK_M for dK/dV, BLOCK_N for dQ); NUM_WARPS;
//             PRE (the streamed tiles rounded once in shared memory by the threads that
//             copied them, instead of at every use); ALIGNED (16-byte cp.async copies of the
//             streamed tiles: unit column strides, 16-byte row strides and pointers);
//             MIN_BLOCKS (__launch_bounds__).
//             Gradients are float32 (the accumulator type of float32 inputs).
// Shared mem: dK/dV: (BLOCK_N*(HEAD_DIM+HEAD_DIM_V) + 2*BLOCK_M*(HEAD_DIM+HEAD_DIM_V+8)
//             + 2*2*BLOCK_M)*4 bytes;  dQ: (BLOCK_M*(HEAD_DIM+HEAD_DIM_V)
//             + 2*BLOCK_N*(HEAD_DIM+HEAD_DIM_V+8))*4 bytes;
//             the layout: BwdMmaF32DkdvSmem, BwdMmaF32DqSmem (layouts.cuh, from cuattn/families/mma_wide.py).
#include "common/backward.cuh"
#include "common/mma_tiles.cuh"

using namespace cuattn;
using namespace cuattn::mma;

namespace {

// N operand elements of one k8 step as the instruction reads them: TF32 bits.
template <int N> struct Operand {
    unsigned hi[N];
    __device__ __forceinline__ void set(int i, float x) { hi[i] = to_tf32(x); }
    // an element already rounded in shared memory
    __device__ __forceinline__ void take(int i, const float* x) { hi[i] = __float_as_uint(*x); }
};

// Element i of a B operand from shared memory at x: as stored (PRE: rounded in place by
// round_own_tf32), or rounded here.
template <bool PRE, int N>
__device__ __forceinline__ void operand_from(Operand<N>& b, int i, const float* x) {
    if constexpr (PRE)
        b.take(i, x);
    else
        b.set(i, *x);
}

// d += a b on one m16n8k8 step
__device__ __forceinline__ void step(float (&d)[4], const Operand<4>& a, const Operand<2>& b) {
    mma_k8(d, a.hi[0], a.hi[1], a.hi[2], a.hi[3], b.hi[0], b.hi[1]);
}

// Copy a ROWS x COLS tile of a strided float tensor into fragment order (module header):
// element (r, c) goes to float4 ((r/16) * COLS/8 + c/8) * 32 + lane, lane = (r%8)*4 + c%4,
// component (r%16)/8 + 2*((c%8)/4). Rows >= nrows and columns >= ncols become 0. Plain
// loads, once per block.
template <int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void load_fragments(float* dst, const float* src,
                                               long long row_stride, long long col_stride,
                                               long long nrows, long long ncols) {
#pragma unroll 8
    for (int idx = threadIdx.x; idx < ROWS * COLS; idx += THREADS) {
        const int r = idx / COLS, c = idx % COLS;
        const int lane = (r % 8) * 4 + c % 4, e = (r % 16) / 8 + 2 * ((c % 8) / 4);
        dst[(((r / 16) * (COLS / 8) + c / 8) * 32 + lane) * 4 + e] =
            r < nrows && c < ncols ? src[r * row_stride + c * col_stride] : 0.f;
    }
}

// S (16 x N per warp) = A B^T over K_DIM: A from the warp's fragment-order tile (a_frag:
// this lane's float4 of step 0), B from a plain tile at b_lane = tile + g*PITCH + t
// (rows 8j + g, contraction index k0 + t and k0 + t + 4).
template <int K_DIM, int N, int PITCH, bool PRE>
__device__ __forceinline__ void scores_f32(float (&s)[N / 8][4], const float4* a_frag,
                                           const float* b_lane) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll 2
    for (int ks = 0; ks < K_DIM / 8; ++ks) {
        const float4 af = a_frag[ks * 32];
        Operand<4> a;
        a.set(0, af.x);
        a.set(1, af.y);
        a.set(2, af.z);
        a.set(3, af.w);
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
            Operand<2> b;
            operand_from<PRE>(b, 0, b_lane + 8 * j * PITCH + 8 * ks);
            operand_from<PRE>(b, 1, b_lane + 8 * j * PITCH + 8 * ks + 4);
            step(s[j], a, b);
        }
    }
}

// O (16 x COLS per warp) += P Z over the N columns of P (accumulator layout, registers) and
// the N rows of Z (plain tile, b_lane = tile + 2t*PITCH + g): lane t's slots are P's columns
// 2t, 2t+1 of each 8-column tile and Z's rows 8j + 2t, 8j + 2t + 1.
template <int N, int COLS, int PITCH, bool PRE>
__device__ __forceinline__ void accumulate_f32(float (&acc)[COLS / 8][4],
                                               const float (&pm)[N / 8][4], const float* b_lane) {
    Operand<4> a[N / 8];  // register order: rows g, g+8 at column 2t, then 2t + 1
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        a[j].set(0, pm[j][0]);
        a[j].set(1, pm[j][2]);
        a[j].set(2, pm[j][1]);
        a[j].set(3, pm[j][3]);
    }
#pragma unroll
    for (int d = 0; d < COLS / 8; ++d) {
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
            Operand<2> b;
            operand_from<PRE>(b, 0, b_lane + 8 * j * PITCH + 8 * d);
            operand_from<PRE>(b, 1, b_lane + (8 * j + 1) * PITCH + 8 * d);
            step(acc[d], a[j], b);
        }
    }
}

}  // namespace

template <typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M,
          int NUM_WARPS, bool PRE, bool ALIGNED, int MIN_BLOCKS>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_BLOCKS)
    attention_bwd_dkdv_mma_f32(const AttnBwdParams bp) {
    constexpr int THREADS = NUM_WARPS * 32, BLOCK_N = 16 * NUM_WARPS;
    constexpr int QP = HEAD_DIM + 4, DOP = HEAD_DIM_V + 4;  // pitches (module header)
    static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM_V % 64 == 0 && BLOCK_M % 8 == 0,
                  "head dims are padded to multiples of 64, query tiles to multiples of 8");
    constexpr int Q_ELEMS = BLOCK_M * QP, DO_ELEMS = BLOCK_M * DOP;
    const AttnParams& p = bp.f;

    using L = BwdMmaF32DkdvSmem<HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N>;
    static_assert(L::do_s - L::q_s == 8LL * Q_ELEMS && L::lse_s - L::do_s == 8LL * DO_ELEMS,
                  "the pitches are the layout's");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    float* k_f = reinterpret_cast<float*>(smem_raw + L::k_f);  // fragment order, N x HEAD_DIM
    float* v_f = reinterpret_cast<float*>(smem_raw + L::v_f);  // fragment order, N x HEAD_DIM_V
    float* q_s = reinterpret_cast<float*>(smem_raw + L::q_s);          // [2][BLOCK_M][QP]
    float* do_s = reinterpret_cast<float*>(smem_raw + L::do_s);        // [2][BLOCK_M][DOP]
    float* lse_s = reinterpret_cast<float*>(smem_raw + L::lse_s);      // [2][BLOCK_M], log2
    float* delta_s = reinterpret_cast<float*>(smem_raw + L::delta_s);  // [2][BLOCK_M]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    // heaviest key blocks first: under causal masking the first keys are seen by the most rows
    const BlockCoords blk = block_coords(bp.num_row_blocks, bp.num_col_tiles,
                                         p.window_left >= 0 || p.window_right >= 0, false);
    const long long n0 = blk.row_block * BLOCK_N, b = blk.b;

    const DkdvInputs<float, float, BiasT> in(bp, b, n0);  // entry b from key n0 (backward.cuh)
    const Range queries = band_queries<BLOCK_M, BLOCK_N>(p, n0);  // the band's query tiles
    const long long m_lo = queries.lo, m_hi = queries.hi;

    // Q, dO, lse and delta of query tile m0 into stage `st` (lse and delta by plain loads)
    auto request_q = [&](long long m0, int st) {
        load_tile<BLOCK_M, HEAD_DIM, THREADS, ALIGNED>(q_s + st * Q_ELEMS, in.q + m0 * p.q_s.row,
                                                       p.q_s.row, p.q_s.col, p.seqlen_q - m0,
                                                       p.head_dim, Pitched<QP>());
        load_tile<BLOCK_M, HEAD_DIM_V, THREADS, ALIGNED>(
            do_s + st * DO_ELEMS, in.dout + m0 * bp.dout_s.row, bp.dout_s.row, bp.dout_s.col,
            p.seqlen_q - m0, p.head_dim_v, Pitched<DOP>());
        stage_row_stats<BLOCK_M, THREADS>(lse_s, delta_s, st, in.lse, in.delta, bp, m0);
    };
    // PRE: round the Q and dO chunks this thread copied into stage `st`, once they have
    // landed (the barrier after makes them visible)
    auto preround_q = [&](int st) {
        if constexpr (PRE) {
            cp_async_wait<0>();
            round_own_tf32<BLOCK_M, HEAD_DIM, THREADS, ALIGNED, false, 0>(q_s + st * Q_ELEMS,
                                                                         Pitched<QP>());
            round_own_tf32<BLOCK_M, HEAD_DIM_V, THREADS, ALIGNED, false, 0>(do_s + st * DO_ELEMS,
                                                                           Pitched<DOP>());
        }
    };
    if (m_lo < m_hi) request_q(m_lo, 0);
    cp_async_commit();
    load_fragments<BLOCK_N, HEAD_DIM, THREADS>(k_f, in.k, p.k_s.row, p.k_s.col, p.seqlen_k - n0,
                                               p.head_dim);
    load_fragments<BLOCK_N, HEAD_DIM_V, THREADS>(v_f, in.v, p.v_s.row, p.v_s.col, p.seqlen_k - n0,
                                                 p.head_dim_v);
    if (m_lo < m_hi) preround_q(0);

    const float4* k_w = reinterpret_cast<const float4*>(k_f) + warp * (HEAD_DIM / 8) * 32 + lane;
    const float4* v_w = reinterpret_cast<const float4*>(v_f) + warp * (HEAD_DIM_V / 8) * 32 + lane;
    const ScoreConsts<float> consts(p);

    float dk[HEAD_DIM / 8][4], dv[HEAD_DIM_V / 8][4];
    zero(dk);
    zero(dv);

    int stage = 0;
    for (long long m0 = m_lo; m0 < m_hi; m0 += BLOCK_M, stage ^= 1) {
        const bool more = m0 + BLOCK_M < m_hi;
        if (more) request_q(m0 + BLOCK_M, stage ^ 1);
        cp_async_commit();
        if constexpr (!PRE) cp_async_wait<1>();  // all but the group just issued have
                                                 // landed (PRE: this tile did earlier) ...
        __syncthreads();  // ... for every thread: K, V (first time), this query tile
        const float* q_t = q_s + stage * Q_ELEMS;
        const float* do_t = do_s + stage * DO_ELEMS;
        float s[BLOCK_M / 8][4], dp[BLOCK_M / 8][4];  // S^T, dP^T: keys x queries
        scores_f32<HEAD_DIM, BLOCK_M, QP, PRE>(s, k_w, q_t + g * QP + t);
        scores_f32<HEAD_DIM_V, BLOCK_M, DOP, PRE>(dp, v_w, do_t + g * DOP + t);
        const bool interior = !HAS_MASK && tile_is_interior(p, m0, BLOCK_M, n0, BLOCK_N);
        const float* lse_t = lse_s + stage * BLOCK_M;
        const float* delta_t = delta_s + stage * BLOCK_M;
        p_and_ds_tile<HAS_MASK, true>(s, dp, p, consts, n0 + warp * 16, m0, lane, interior,
                                      in.mask, in.bias, [&](int j, int e) {
                                          const int col = 8 * j + 2 * t + e % 2;
                                          return make_float2(lse_t[col], delta_t[col]);
                                      });
        accumulate_f32<BLOCK_M, HEAD_DIM_V, DOP, PRE>(dv, s, do_t + 2 * t * DOP + g);
        accumulate_f32<BLOCK_M, HEAD_DIM, QP, PRE>(dk, dp, q_t + 2 * t * QP + g);
        if (more) preround_q(stage ^ 1);
        __syncthreads();  // this stage is consumed before the next iteration refills it
    }
    cp_async_wait<0>();  // no copy may outlive the block

    const long long row0 = n0 + warp * 16;
    float* dk_out = reinterpret_cast<float*>(bp.dk) + batch_offset(bp.dk_s, b, p.batch1, p.batch2);
    store_tile(dk, dk_out, bp.dk_s.row, bp.dk_s.col, row0, p.seqlen_k, p.head_dim, lane,
               float(p.scale));
    float* dv_out = reinterpret_cast<float*>(bp.dv) + batch_offset(bp.dv_s, b, p.batch1, p.batch2);
    store_tile(dv, dv_out, bp.dv_s.row, bp.dv_s.col, row0, p.seqlen_k, p.head_dim_v, lane, 1.f);
}

template <typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N,
          int NUM_WARPS, bool PRE, bool ALIGNED, int MIN_BLOCKS>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_BLOCKS)
    attention_bwd_dq_mma_f32(const AttnBwdParams bp) {
    constexpr int THREADS = NUM_WARPS * 32, BLOCK_M = 16 * NUM_WARPS;
    constexpr int KP = HEAD_DIM + 4, VP = HEAD_DIM_V + 4;
    static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM_V % 64 == 0 && BLOCK_N % 8 == 0,
                  "head dims are padded to multiples of 64, key tiles to multiples of 8");
    constexpr int K_ELEMS = BLOCK_N * KP, V_ELEMS = BLOCK_N * VP;
    const AttnParams& p = bp.f;

    using L = BwdMmaF32DqSmem<HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N>;
    static_assert(L::v_s - L::k_s == 8LL * K_ELEMS && L::BYTES - L::v_s == 8LL * V_ELEMS,
                  "the pitches are the layout's");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    float* q_f = reinterpret_cast<float*>(smem_raw + L::q_f);    // fragment order, M x HEAD_DIM
    float* do_f = reinterpret_cast<float*>(smem_raw + L::do_f);  // fragment order, M x HEAD_DIM_V
    float* k_s = reinterpret_cast<float*>(smem_raw + L::k_s);    // [2][BLOCK_N][KP]
    float* v_s = reinterpret_cast<float*>(smem_raw + L::v_s);    // [2][BLOCK_N][VP]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    // heaviest query blocks first: under causal masking the last rows see the most keys
    const BlockCoords blk = block_coords(bp.num_row_blocks, bp.num_col_tiles,
                                         p.window_left >= 0 || p.window_right >= 0, true);
    const long long m0 = blk.row_block * BLOCK_M, b = blk.b;

    const DqInputs<float, float, BiasT> in(bp, b, m0);  // batch entry b from row m0 (backward.cuh)
    const Range keys = band_keys<BLOCK_M, BLOCK_N>(p, m0);  // the band's key tiles
    const long long n_lo = keys.lo, n_hi = keys.hi;

    auto request_kv = [&](long long n0, int st) {
        load_kv_tiles<BLOCK_N, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED>(
            k_s + st * K_ELEMS, v_s + st * V_ELEMS, in.k, in.v, n0, p, Pitched<KP>(),
            Pitched<VP>());
    };
    // PRE: round the K and V chunks this thread copied into stage `st`
    auto preround_kv = [&](int st) {
        if constexpr (PRE) {
            cp_async_wait<0>();
            round_own_tf32<BLOCK_N, HEAD_DIM, THREADS, ALIGNED, false, 0>(k_s + st * K_ELEMS,
                                                                         Pitched<KP>());
            round_own_tf32<BLOCK_N, HEAD_DIM_V, THREADS, ALIGNED, false, 0>(v_s + st * V_ELEMS,
                                                                           Pitched<VP>());
        }
    };
    if (n_lo < n_hi) request_kv(n_lo, 0);
    cp_async_commit();
    load_fragments<BLOCK_M, HEAD_DIM, THREADS>(q_f, in.q, p.q_s.row, p.q_s.col, p.seqlen_q - m0,
                                               p.head_dim);
    load_fragments<BLOCK_M, HEAD_DIM_V, THREADS>(do_f, in.dout, bp.dout_s.row, bp.dout_s.col,
                                                 p.seqlen_q - m0, p.head_dim_v);
    if (n_lo < n_hi) preround_kv(0);

    float lse_log2[2], dl[2];  // this lane's two rows
    load_row_stats(lse_log2, dl, in.lse, in.delta, bp, m0, warp, lane);
    float dq[HEAD_DIM / 8][4];
    zero(dq);

    const float4* q_w = reinterpret_cast<const float4*>(q_f) + warp * (HEAD_DIM / 8) * 32 + lane;
    const float4* do_w = reinterpret_cast<const float4*>(do_f) + warp * (HEAD_DIM_V / 8) * 32 + lane;
    const ScoreConsts<float> consts(p);

    int stage = 0;
    for (long long n0 = n_lo; n0 < n_hi; n0 += BLOCK_N, stage ^= 1) {
        const bool more = n0 + BLOCK_N < n_hi;
        if (more) request_kv(n0 + BLOCK_N, stage ^ 1);
        cp_async_commit();
        if constexpr (!PRE) cp_async_wait<1>();  // (PRE: this tile landed earlier)
        __syncthreads();  // Q, dO (first time) and this key tile are in shared memory
        const float* k_t = k_s + stage * K_ELEMS;
        const float* v_t = v_s + stage * V_ELEMS;
        float s[BLOCK_N / 8][4], dp[BLOCK_N / 8][4];
        scores_f32<HEAD_DIM, BLOCK_N, KP, PRE>(s, q_w, k_t + g * KP + t);
        scores_f32<HEAD_DIM_V, BLOCK_N, VP, PRE>(dp, do_w, v_t + g * VP + t);
        const bool interior = !HAS_MASK && tile_is_interior(p, m0, BLOCK_M, n0, BLOCK_N);
        p_and_ds_tile<HAS_MASK, false>(s, dp, p, consts, m0 + warp * 16, n0, lane, interior,
                                       in.mask, in.bias, [&](int, int e) {
                                           return make_float2(lse_log2[e / 2], dl[e / 2]);
                                       });
        accumulate_f32<BLOCK_N, HEAD_DIM, KP, PRE>(dq, dp, k_t + 2 * t * KP + g);
        if (more) preround_kv(stage ^ 1);
        __syncthreads();  // this stage is consumed before the next iteration refills it
    }
    cp_async_wait<0>();

    float* dq_out = reinterpret_cast<float*>(bp.dq) + batch_offset(bp.dq_s, b, p.batch1, p.batch2);
    store_tile(dq, dq_out, bp.dq_s.row, bp.dq_s.col, m0 + warp * 16, p.seqlen_q, p.head_dim, lane,
               float(p.scale));
}
