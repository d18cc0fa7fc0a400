// attention_backward_mma.cu -- tensor-core attention backward for float16 / bfloat16
// (sm_80 and newer).
//
// Computes:   the gradients of attention_mma.cu's forward (reference
//             cuattn/reference.py::attention_backward_reference) with FlashAttention-2's
//             recomputation, as attention_backward_portable.cu: delta first
//             (backward.cuh), then per tile P = exp(s - lse), dP = dO V^T,
//             dS = P o (dP - delta) (softcap derivative included), dV += P^T dO,
//             dK += scale dS^T Q, dQ += scale dS K.
// Kernels:    attention_bwd_dkdv_mma: a block of NUM_WARPS warps owns BLOCK_N = 16*NUM_WARPS
//             keys and one tile of COLS output columns of dK and dV (all of them for head
//             dims up to 128; wider heads split the grid and recompute S and dP per tile);
//             warp w owns keys 16w .. 16w+15.
//             It walks the query tiles (BLOCK_M rows) of the band; S^T = K Q^T and
//             dP^T = V dO^T land in m16n8 accumulators whose layout is also the A-operand
//             layout, so P^T and dS^T feed dV += P^T dO and dK += dS^T Q straight from
//             registers (rounded to T, as FlashAttention does); Q, dO (ldmatrix and
//             ldmatrix.trans), lse and delta tiles arrive by cp.async one tile ahead.
//             attention_bwd_dq_mma: a block owns BLOCK_M = 16*NUM_WARPS query rows and one
//             COLS-column tile of dQ; it walks the key tiles (BLOCK_N keys, double-buffered):
//             S = Q K^T, dP = dO V^T, dS in registers, dQ += dS K (K by ldmatrix.trans).
//             Each gradient element is written once by one thread: no atomics, repeated
//             calls are bit-identical.
// Template:   T (__half or __nv_bfloat16); G gradient storage (T, or float for a gradient
//             that Python sums over broadcast axes); BiasT; HAS_MASK; HEAD_DIM, HEAD_DIM_V
//             padded to multiples of 64 (zero-filled in shared memory); COLS output columns
//             per block (a multiple of 64 dividing the padded head dims); the tile of the other
//             sequence (BLOCK_M for dK/dV, BLOCK_N for dQ); NUM_WARPS; ALIGNED as in
//             attention_mma.cu (q, k, v and dout all qualify); MIN_BLOCKS resident blocks per
//             SM for __launch_bounds__ (a register cap); RAGGED (PACKED: a packed call,
//             backward_unit in common.cuh).
// Shared mem: dK/dV: (BLOCK_N*(HEAD_DIM+HEAD_DIM_V) + 2*BLOCK_M*(HEAD_DIM+HEAD_DIM_V))*2
//             + 2*2*BLOCK_M*4 bytes;  dQ: (BLOCK_M + 2*BLOCK_N)*(HEAD_DIM+HEAD_DIM_V)*2 bytes;
//             swizzled as in mma_tiles.cuh; the layouts: BwdMmaDkdvSmem, BwdMmaDqSmem (layouts.cuh).
#include "common/backward.cuh"
#include "common/mma_tiles.cuh"

using namespace cuattn;
using namespace cuattn::mma;

template <typename T, typename G, typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V,
          int COLS, int BLOCK_M, int NUM_WARPS, bool ALIGNED, int MIN_BLOCKS, int RAGGED = DENSE>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_BLOCKS)
    attention_bwd_dkdv_mma(const AttnBwdParams params) {
    constexpr int THREADS = NUM_WARPS * 32, BLOCK_N = 16 * NUM_WARPS;
    // this block's output columns: [c0, c0 + COLS) of dK and of dV, where they exist
    constexpr int DK_COLS = COLS < HEAD_DIM ? COLS : HEAD_DIM;
    constexpr int DV_COLS = COLS < HEAD_DIM_V ? COLS : HEAD_DIM_V;
    static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM_V % 64 == 0 && BLOCK_M % 16 == 0,
                  "head dims are padded to multiples of 64, query tiles to multiples of 16");
    static_assert(COLS % 64 == 0 && HEAD_DIM % DK_COLS == 0 && HEAD_DIM_V % DV_COLS == 0,
                  "column tiles are multiples of 64 that divide the padded head dims");
    constexpr int Q_ELEMS = BLOCK_M * HEAD_DIM, DO_ELEMS = BLOCK_M * HEAD_DIM_V;
    // a packed call's block: its sequence as a dense call (common.cuh)
    const BackwardUnit bu = backward_unit<RAGGED, true, T, G>(params, false);
    const AttnBwdParams& bp = RAGGED != DENSE ? bu.bp : params;
    const AttnParams& p = bp.f;

    using L = BwdMmaDkdvSmem<T, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N>;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* k_s = reinterpret_cast<T*>(smem_raw + L::k_s);    // [BLOCK_N][HEAD_DIM]
    T* v_s = reinterpret_cast<T*>(smem_raw + L::v_s);    // [BLOCK_N][HEAD_DIM_V]
    T* q_s = reinterpret_cast<T*>(smem_raw + L::q_s);    // [2][BLOCK_M][HEAD_DIM]
    T* do_s = reinterpret_cast<T*>(smem_raw + L::do_s);  // [2][BLOCK_M][HEAD_DIM_V]
    float* lse_s = reinterpret_cast<float*>(smem_raw + L::lse_s);      // [2][BLOCK_M], log2
    float* delta_s = reinterpret_cast<float*>(smem_raw + L::delta_s);  // [2][BLOCK_M]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // heaviest key blocks first: under causal masking the first keys are seen by the most rows
    const BlockCoords blk = bu.blk;
    const long long n_block = blk.row_block, col_tile = blk.col_tile, b = blk.b;
    const long long n0 = n_block * BLOCK_N;
    const int c0 = (int)col_tile * COLS;
    const bool has_dk = c0 < HEAD_DIM, has_dv = c0 < HEAD_DIM_V;  // block-uniform

    const DkdvInputs<T, float, BiasT> in(bp, b, n0);  // batch entry b from key n0 (backward.cuh)
    G* dk_out = reinterpret_cast<G*>(bp.dk) + batch_offset(bp.dk_s, b, p.batch1, p.batch2);
    G* dv_out = reinterpret_cast<G*>(bp.dv) + batch_offset(bp.dv_s, b, p.batch1, p.batch2);
    const Range queries = band_queries<BLOCK_M, BLOCK_N>(p, n0);  // the band's query tiles
    const long long m_lo = queries.lo, m_hi = queries.hi;

    load_tile<BLOCK_N, HEAD_DIM, THREADS, ALIGNED>(k_s, in.k, p.k_s.row, p.k_s.col,
                                                   p.seqlen_k - n0, p.head_dim,
                                                   Swizzled<HEAD_DIM>());
    load_tile<BLOCK_N, HEAD_DIM_V, THREADS, ALIGNED>(v_s, in.v, p.v_s.row, p.v_s.col,
                                                     p.seqlen_k - n0, p.head_dim_v,
                                                     Swizzled<HEAD_DIM_V>());
    // Q, dO, lse and delta of query tile m0 into stage `st` (lse and delta by plain loads)
    auto request_q = [&](long long m0, int st) {
        load_tile<BLOCK_M, HEAD_DIM, THREADS, ALIGNED>(q_s + st * Q_ELEMS, in.q + m0 * p.q_s.row,
                                                       p.q_s.row, p.q_s.col, p.seqlen_q - m0,
                                                       p.head_dim, Swizzled<HEAD_DIM>());
        load_tile<BLOCK_M, HEAD_DIM_V, THREADS, ALIGNED>(
            do_s + st * DO_ELEMS, in.dout + m0 * bp.dout_s.row, bp.dout_s.row, bp.dout_s.col,
            p.seqlen_q - m0, p.head_dim_v, Swizzled<HEAD_DIM_V>());
        stage_row_stats<BLOCK_M, THREADS>(lse_s, delta_s, st, in.lse, in.delta, bp, m0);
    };
    if (m_lo < m_hi) request_q(m_lo, 0);
    cp_async_commit();

    float dk[1][DK_COLS / 8][4], dv[1][DV_COLS / 8][4];
    zero(dk[0]);
    zero(dv[0]);

    // ldmatrix rows of this lane: K, V as A operands (the warp's 16 keys); Q, dO as B
    // operands of the score products and as transposed B operands of the gradient products
    const LaneOffsets<HEAD_DIM> k_a(warp * 16 + lane % 16, lane / 16);
    const LaneOffsets<HEAD_DIM_V> v_a(warp * 16 + lane % 16, lane / 16);
    const LaneOffsets<HEAD_DIM> q_b(lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
    const LaneOffsets<HEAD_DIM_V> do_b(lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
    const LaneOffsets<HEAD_DIM> q_t(lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
    const LaneOffsets<HEAD_DIM_V> do_t(lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
    const unsigned k_base = smem_addr(k_s), v_base = smem_addr(v_s);
    const unsigned q_base = smem_addr(q_s), do_base = smem_addr(do_s);
    const ScoreConsts<float> consts(p);

    int stage = 0;
    for (long long m0 = m_lo; m0 < m_hi; m0 += BLOCK_M, stage ^= 1) {
        if (m0 + BLOCK_M < m_hi) request_q(m0 + BLOCK_M, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();  // all but the group just issued have landed ...
        __syncthreads();     // ... for every thread: K, V (first time), this query tile
        float s[1][BLOCK_M / 8][4], dp[1][BLOCK_M / 8][4];  // S^T, dP^T: keys x queries
        scores<HEAD_DIM, BLOCK_M, 1, T>(s, k_base, q_base + stage * Q_ELEMS * 2, k_a, q_b);
        scores<HEAD_DIM_V, BLOCK_M, 1, T>(dp, v_base, do_base + stage * DO_ELEMS * 2, v_a, do_b);
        const bool interior = !HAS_MASK && tile_is_interior(p, m0, BLOCK_M, n0, BLOCK_N);
        const float* lse_t = lse_s + stage * BLOCK_M;
        const float* delta_t = delta_s + stage * BLOCK_M;
#pragma unroll
        for (int j = 0; j < BLOCK_M / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = 8 * j + 2 * (lane % 4) + e % 2;  // query within the tile
                p_and_ds<HAS_MASK>(s[0][j][e], dp[0][j][e], p, consts, m0 + col,
                                   n0 + warp * 16 + lane / 4 + 8 * (e / 2), lse_t[col],
                                   delta_t[col], interior, in.mask, in.bias);
            }
        if (has_dv)
            accumulate_cols<BLOCK_M, HEAD_DIM_V, DV_COLS, 1, T>(
                dv, s, do_base + (stage * DO_ELEMS + c0) * 2, do_t);
        if (has_dk)
            accumulate_cols<BLOCK_M, HEAD_DIM, DK_COLS, 1, T>(
                dk, dp, q_base + (stage * Q_ELEMS + c0) * 2, q_t);
        __syncthreads();  // this stage is consumed before the next iteration refills it
    }
    cp_async_wait<0>();  // no copy may outlive the block

    const long long row0 = n0 + warp * 16;
    if (has_dk)
        store_tile(dk[0], dk_out + c0 * bp.dk_s.col, bp.dk_s.row, bp.dk_s.col, row0, p.seqlen_k,
                   p.head_dim - c0, lane, float(p.scale));
    if (has_dv)
        store_tile(dv[0], dv_out + c0 * bp.dv_s.col, bp.dv_s.row, bp.dv_s.col, row0, p.seqlen_k,
                   p.head_dim_v - c0, lane, 1.f);
}

template <typename T, typename G, typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V,
          int COLS, int BLOCK_N, int NUM_WARPS, bool ALIGNED, int MIN_BLOCKS, int RAGGED = DENSE>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_BLOCKS)
    attention_bwd_dq_mma(const AttnBwdParams params) {
    constexpr int THREADS = NUM_WARPS * 32, BLOCK_M = 16 * NUM_WARPS;
    constexpr int DQ_COLS = COLS < HEAD_DIM ? COLS : HEAD_DIM;  // [c0, c0 + DQ_COLS) of dQ
    static_assert(COLS % 64 == 0 && HEAD_DIM % DQ_COLS == 0,
                  "column tiles are multiples of 64 that divide the padded head dim");
    static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM_V % 64 == 0 && BLOCK_N % 16 == 0,
                  "head dims are padded to multiples of 64, key tiles to multiples of 16");
    constexpr int K_ELEMS = BLOCK_N * HEAD_DIM, V_ELEMS = BLOCK_N * HEAD_DIM_V;
    // a packed call's block: its sequence as a dense call (common.cuh)
    const BackwardUnit bu = backward_unit<RAGGED, false, T, G>(params, true);
    const AttnBwdParams& bp = RAGGED != DENSE ? bu.bp : params;
    const AttnParams& p = bp.f;

    using L = BwdMmaDqSmem<T, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N>;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw + L::q_s);    // [BLOCK_M][HEAD_DIM]
    T* do_s = reinterpret_cast<T*>(smem_raw + L::do_s);  // [BLOCK_M][HEAD_DIM_V]
    T* k_s = reinterpret_cast<T*>(smem_raw + L::k_s);    // [2][BLOCK_N][HEAD_DIM]
    T* v_s = reinterpret_cast<T*>(smem_raw + L::v_s);    // [2][BLOCK_N][HEAD_DIM_V]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // heaviest query blocks first: under causal masking the last rows see the most keys
    const BlockCoords blk = bu.blk;
    const long long m_block = blk.row_block, col_tile = blk.col_tile, b = blk.b;
    const long long m0 = m_block * BLOCK_M;
    const int c0 = (int)col_tile * DQ_COLS;

    const DqInputs<T, float, BiasT> in(bp, b, m0);  // batch entry b from row m0 (backward.cuh)
    const Range keys = band_keys<BLOCK_M, BLOCK_N>(p, m0);  // the band's key tiles
    const long long n_lo = keys.lo, n_hi = keys.hi;

    auto request_kv = [&](long long n0, int st) {
        load_kv_tiles<BLOCK_N, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED>(
            k_s + st * K_ELEMS, v_s + st * V_ELEMS, in.k, in.v, n0, p, Swizzled<HEAD_DIM>(),
            Swizzled<HEAD_DIM_V>());
    };
    load_tile<BLOCK_M, HEAD_DIM, THREADS, ALIGNED>(q_s, in.q, p.q_s.row, p.q_s.col,
                                                   p.seqlen_q - m0, p.head_dim,
                                                   Swizzled<HEAD_DIM>());
    load_tile<BLOCK_M, HEAD_DIM_V, THREADS, ALIGNED>(do_s, in.dout, bp.dout_s.row, bp.dout_s.col,
                                                     p.seqlen_q - m0, p.head_dim_v,
                                                     Swizzled<HEAD_DIM_V>());
    if (n_lo < n_hi) request_kv(n_lo, 0);
    cp_async_commit();

    float lse_log2[2], dl[2];  // this lane's two rows
    load_row_stats(lse_log2, dl, in.lse, in.delta, bp, m0, warp, lane);
    float dq[1][DQ_COLS / 8][4];
    zero(dq[0]);

    const LaneOffsets<HEAD_DIM> q_a(warp * 16 + lane % 16, lane / 16);
    const LaneOffsets<HEAD_DIM_V> do_a(warp * 16 + lane % 16, lane / 16);
    const LaneOffsets<HEAD_DIM> k_b(lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
    const LaneOffsets<HEAD_DIM_V> v_b(lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
    const LaneOffsets<HEAD_DIM> k_t(lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
    const unsigned q_base = smem_addr(q_s), do_base = smem_addr(do_s);
    const unsigned k_base = smem_addr(k_s), v_base = smem_addr(v_s);
    const ScoreConsts<float> consts(p);

    int stage = 0;
    for (long long n0 = n_lo; n0 < n_hi; n0 += BLOCK_N, stage ^= 1) {
        if (n0 + BLOCK_N < n_hi) request_kv(n0 + BLOCK_N, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();  // Q, dO (first time) and this key tile are in shared memory
        float s[1][BLOCK_N / 8][4], dp[1][BLOCK_N / 8][4];
        scores<HEAD_DIM, BLOCK_N, 1, T>(s, q_base, k_base + stage * K_ELEMS * 2, q_a, k_b);
        scores<HEAD_DIM_V, BLOCK_N, 1, T>(dp, do_base, v_base + stage * V_ELEMS * 2, do_a, v_b);
        const bool interior = !HAS_MASK && tile_is_interior(p, m0, BLOCK_M, n0, BLOCK_N);
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                p_and_ds<HAS_MASK>(s[0][j][e], dp[0][j][e], p, consts,
                                   m0 + warp * 16 + lane / 4 + 8 * (e / 2),
                                   n0 + 8 * j + 2 * (lane % 4) + e % 2, lse_log2[e / 2],
                                   dl[e / 2], interior, in.mask, in.bias);
        accumulate_cols<BLOCK_N, HEAD_DIM, DQ_COLS, 1, T>(dq, dp, k_base + (stage * K_ELEMS + c0) * 2,
                                                          k_t);
        __syncthreads();  // this stage is consumed before the next iteration refills it
    }
    cp_async_wait<0>();

    G* dq_out = reinterpret_cast<G*>(bp.dq) + batch_offset(bp.dq_s, b, p.batch1, p.batch2);
    store_tile(dq[0], dq_out + c0 * bp.dq_s.col, bp.dq_s.row, bp.dq_s.col, m0 + warp * 16,
               p.seqlen_q, p.head_dim - c0, lane, float(p.scale));
}
