// attention_backward_sm90.cu -- tensor-core attention backward for float16 / bfloat16 on
// Hopper (sm_90a: wgmma).
//
// Computes:   the same gradients as attention_backward_mma.cu (reference
//             cuattn/reference.py::attention_backward_reference), with the same two kernels
//             after delta (backward.cuh) and the same element-wise rule (p_and_ds); the
//             products run as warpgroup MMAs, whose accumulators have the m16n8 layout of
//             mma.sync in each of the four warps (attention_sm90.cu).
// Kernels:    attention_bwd_dkdv_sm90: one warpgroup owns 64 keys (warp w: keys 16w ..
//             16w + 15) and all columns of dK and dV. It walks the query tiles (BLOCK_M rows)
//             of the band: S^T = K Q^T and dP^T = V dO^T with every operand in shared
//             memory (K, V as A; Q, dO as B, all K-contiguous); P^T and dS^T are rounded to
//             T in registers and feed dV += P^T dO and dK += dS^T Q as register A operands,
//             with Q and dO read N-contiguous through transposed descriptors. Q, dO, lse
//             and delta tiles arrive by cp.async one tile ahead.
//             attention_bwd_dq_sm90: one warpgroup owns 64 query rows and all columns of
//             dQ; it walks the key tiles (BLOCK_N keys, double-buffered): S = Q K^T,
//             dP = dO V^T, dS in registers, dQ += dS K (K transposed).
//             Each gradient element is written once by one thread: no atomics, repeated
//             calls are bit-identical. With OVERLAP the tile loops are dkdv_overlapped and
//             dq_overlapped (below), each step a lambda; otherwise the kernels' own loops.
// Template:   T; G gradient storage (T, or float for a gradient that Python sums over
//             broadcast axes); BiasT; HAS_MASK; HEAD_DIM, HEAD_DIM_V (64 or 128,
//             zero-padded); the tile of the other sequence (BLOCK_M for dK/dV: 32, 64 or
//             128; BLOCK_N for dQ: 64 or 128); ALIGNED; MIN_BLOCKS; OVERLAP (the next tile's
//             S and dP issued before this tile's gradient products, so that the
//             element-wise part runs under them; three stages of the streamed tiles instead
//             of two); STATS_AHEAD (dK/dV only: each query tile's lse and delta loaded one
//             request earlier into registers; dispatch sets it without mask and bias);
//             RAGGED (PACKED: a packed call, backward_unit in common.cuh).
// Shared mem: dK/dV: (64*(HEAD_DIM+HEAD_DIM_V) + S*BLOCK_M*(HEAD_DIM+HEAD_DIM_V))*2
//             + S*2*BLOCK_M*4 bytes;  dQ: (64 + S*BLOCK_N)*(HEAD_DIM+HEAD_DIM_V)*2 bytes,
//             S = 3 stages with OVERLAP, else 2, plus the staged mask and bias tiles;
//             every operand tile in the 128-byte-swizzle layout of attention_sm90.cu;
//             the layout: BwdSm90DkdvSmem, BwdSm90DqSmem (layouts.cuh, from cuattn/families/sm90.py).
#include "common/backward.cuh"
#include "sm90/sm90_tiles.cuh"

using namespace cuattn;
using namespace cuattn::mma;
using namespace cuattn::sm90;

namespace {

// S = A_s B_s^T and dP = A_dp B_dp^T (N columns each, over HEAD_DIM and HEAD_DIM_V) issued as
// one wgmma group: fenced before, committed after; the caller waits
template <int N, int HEAD_DIM, int HEAD_DIM_V, typename T>
__device__ __forceinline__ void issue_score_products(float (&s)[N / 8][4], float (&dp)[N / 8][4],
                                                     unsigned s_a, unsigned s_b, unsigned dp_a,
                                                     unsigned dp_b) {
    wgmma_fence();
    product_ss<N, HEAD_DIM, T>(s, s_a, s_b);
    product_ss<N, HEAD_DIM_V, T>(dp, dp_a, dp_b);
    wgmma_commit();
}

// P^T and dS^T (p_and_ds_tile) of query tile m0 for this warp's 16 keys n0 + 16 warp ..: the
// tile's lse (log2 units) and delta from stage st of lse_s and delta_s, its mask and bias
// staged with it (side) or the arrays in place. interior: tile_is_interior, and no mask.
// The variables that the calling lambda captures come by reference, as it holds them.
template <bool HAS_MASK, int BLOCK_M, typename BiasT, typename Side>
__device__ __forceinline__ void keys_p_and_ds(float (&s)[BLOCK_M / 8][4],
                                              float (&dp)[BLOCK_M / 8][4], const AttnParams& p,
                                              const ScoreConsts<float>& consts, long long m0,
                                              const long long& n0, bool interior,
                                              const Side& side, int st, float* const& lse_s,
                                              float* const& delta_s, const int& warp,
                                              const int& lane, const unsigned char* const& mask,
                                              const BiasT* const& bias) {
    const float* lse_t = lse_s + st * BLOCK_M;
    const float* delta_t = delta_s + st * BLOCK_M;
    const auto stat = [&](int j, int e) {
        const int col = 8 * j + 2 * (lane % 4) + e % 2;
        return make_float2(lse_t[col], delta_t[col]);
    };
    p_and_ds_tile<HAS_MASK, true, BLOCK_M / 8>(s, dp, p, consts, n0 + warp * 16, m0, lane,
                                               interior, side, st, m0, n0, mask, bias, stat);
}

// The overlapped tile loop: tile t + 1's score products are issued before tile t's gradient
// products, so that each tile's element-wise part (p_and_ds) runs while the tensor cores
// work; wgmma groups in flight: [scores (t + 1), gradients (t)].
template <typename IssueScores, typename PAndDs, typename IssueGrads>
__device__ __forceinline__ void overlapped_tiles(int tiles, const IssueScores& issue_scores,
                                                 const PAndDs& p_and_ds,
                                                 const IssueGrads& issue_grads) {
    if (tiles > 0) {
        issue_scores(0);
        wgmma_wait<0>();
        for (int t = 0; t + 1 < tiles; ++t) {
            p_and_ds(t);
            issue_scores(t + 1);
            issue_grads(t);
            wgmma_wait<1>();  // S dP (t + 1) done (ptxas follows this count in straight code)
        }
        p_and_ds(tiles - 1);
        issue_grads(tiles - 1);
        wgmma_wait<0>();
    }
}

// The dK/dV kernel's overlapped loop over its query tiles (OVERLAP): tile t + 1's S^T and
// dP^T are issued before tile t's dV and dK, so that the element-wise part of each tile runs
// while the tensor cores do the previous tile's gradient products. wgmma groups in flight:
// [S dP (t + 1), dV dK (t)]. The kernel's variables come by reference, so that the lambdas
// below capture them as they would in the kernel (and the compiler sees the same code).
template <typename T, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, int BLOCK_N,
          int STAGES, typename BiasT, typename Side, typename RequestQ>
__device__ __forceinline__ void dkdv_overlapped(
    float (&dk)[HEAD_DIM / 8][4], float (&dv)[HEAD_DIM_V / 8][4], const AttnParams& p,
    const ScoreConsts<float>& consts, const Side& side, const RequestQ& request_q,
    const int& tiles, const long long& m_lo, const long long& n0, const unsigned& k_base,
    const unsigned& v_base, const unsigned& q_base, const unsigned& do_base,
    float* const& lse_s, float* const& delta_s, const int& warp, const int& lane,
    const unsigned char* const& mask, const BiasT* const& bias) {
    constexpr int Q_ELEMS = BLOCK_M * HEAD_DIM, DO_ELEMS = BLOCK_M * HEAD_DIM_V;
    float s[BLOCK_M / 8][4], dp[BLOCK_M / 8][4];         // S^T, dP^T: keys x queries
    unsigned p_a[BLOCK_M / 16][4], ds_a[BLOCK_M / 16][4];  // P^T, dS^T: A of dV, dK
    auto q_tile = [&](int t) { return q_base + (t % STAGES) * Q_ELEMS * 2; };
    auto do_tile = [&](int t) { return do_base + (t % STAGES) * DO_ELEMS * 2; };
    // tile t has landed (requested one tile earlier) and every warp is done with tile
    // t - 2 (its dV dK waited for in p_and_ds): tile t + 1 into that stage, S dP (t)
    auto issue_scores = [&](int t) {
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();
        if (t + 1 < tiles) request_q(m_lo + (long long)(t + 1) * BLOCK_M, (t + 1) % STAGES);
        cp_async_commit();
        wgmma_fence();
        product_ss<BLOCK_M, HEAD_DIM, T>(s, k_base, q_tile(t));
        product_ss<BLOCK_M, HEAD_DIM_V, T>(dp, v_base, do_tile(t));
        wgmma_commit();
    };
    // S dP (t) done: P^T and dS^T of tile t; once dV dK (t - 1) are done, their fragments
    auto p_and_ds = [&](int t) {
        const long long m0 = m_lo + (long long)t * BLOCK_M;
        keys_p_and_ds<HAS_MASK, BLOCK_M>(
            s, dp, p, consts, m0, n0, !HAS_MASK && tile_is_interior(p, m0, BLOCK_M, n0, BLOCK_N),
            side, t % STAGES, lse_s, delta_s, warp, lane, mask, bias);
        wgmma_wait<0>();
        pack_a<BLOCK_M, T>(p_a, s);
        pack_a<BLOCK_M, T>(ds_a, dp);
    };
    auto issue_grads = [&](int t) {
        product_ra<HEAD_DIM_V, BLOCK_M, T>(dv, p_a, do_tile(t));
        product_ra<HEAD_DIM, BLOCK_M, T>(dk, ds_a, q_tile(t));
        wgmma_commit();
    };
    fence_accumulators(dk);
    fence_accumulators(dv);
    overlapped_tiles(tiles, issue_scores, p_and_ds, issue_grads);
}

// The dQ kernel's overlapped loop over its key tiles (OVERLAP), as dkdv_overlapped: key tile
// t + 1's S and dP are issued before tile t's dQ product; wgmma groups in flight:
// [S dP (t + 1), dQ (t)]. lse_log2, dl: this lane's two rows' lse (log2 units) and delta.
template <typename T, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, int BLOCK_N,
          int STAGES, typename BiasT, typename Side, typename RequestKV>
__device__ __forceinline__ void dq_overlapped(
    float (&dq)[HEAD_DIM / 8][4], const AttnParams& p, const ScoreConsts<float>& consts,
    const Side& side, const RequestKV& request_kv, const int& tiles, const long long& n_lo,
    const long long& m0, const unsigned& q_base, const unsigned& do_base,
    const unsigned& k_base, const unsigned& v_base, const float (&lse_log2)[2],
    const float (&dl)[2], const int& warp, const int& lane, const unsigned char* const& mask,
    const BiasT* const& bias) {
    constexpr int K_ELEMS = BLOCK_N * HEAD_DIM, V_ELEMS = BLOCK_N * HEAD_DIM_V;
    float s[BLOCK_N / 8][4], dp[BLOCK_N / 8][4];
    unsigned ds_a[BLOCK_N / 16][4];  // dS: A of dQ
    auto k_tile = [&](int t) { return k_base + (t % STAGES) * K_ELEMS * 2; };
    auto issue_scores = [&](int t) {  // as in the dK/dV kernel: key tile t + 1 requested
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();  // Q, dO (first time) and key tile t are in shared memory
        if (t + 1 < tiles) request_kv(n_lo + (long long)(t + 1) * BLOCK_N, (t + 1) % STAGES);
        cp_async_commit();
        wgmma_fence();
        product_ss<BLOCK_N, HEAD_DIM, T>(s, q_base, k_tile(t));
        product_ss<BLOCK_N, HEAD_DIM_V, T>(dp, do_base, v_base + (t % STAGES) * V_ELEMS * 2);
        wgmma_commit();
    };
    auto p_and_ds = [&](int t) {  // S dP (t) done: dS; once dQ (t - 1) is done, its fragments
        const long long n0 = n_lo + (long long)t * BLOCK_N;
        const bool interior = !HAS_MASK && tile_is_interior(p, m0, BLOCK_M, n0, BLOCK_N);
        const auto stat = [&](int, int e) { return make_float2(lse_log2[e / 2], dl[e / 2]); };
        if (side.staged)  // the tiles staged with this key tile, or the arrays in place
            p_and_ds_tile<HAS_MASK, false, BLOCK_N / 8, BiasT>(
                s, dp, p, consts, m0 + warp * 16, n0, lane, interior,
                side.mask_view(t % STAGES, m0, n0), side.bias_view(t % STAGES, m0, n0), stat);
        else
            p_and_ds_tile<HAS_MASK, false>(s, dp, p, consts, m0 + warp * 16, n0, lane,
                                           interior, mask, bias, stat);
        wgmma_wait<0>();
        pack_a<BLOCK_N, T>(ds_a, dp);
    };
    auto issue_dq = [&](int t) {
        product_ra<HEAD_DIM, BLOCK_N, T>(dq, ds_a, k_tile(t));
        wgmma_commit();
    };
    fence_accumulators(dq);
    overlapped_tiles(tiles, issue_scores, p_and_ds, issue_dq);
}

}  // namespace

template <typename T, typename G, typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V,
          int BLOCK_M, bool ALIGNED, int MIN_BLOCKS, bool OVERLAP, bool STATS_AHEAD = false,
          int RAGGED = DENSE>
__global__ void __launch_bounds__(128, MIN_BLOCKS)
    attention_bwd_dkdv_sm90(const AttnBwdParams params) {
    constexpr int THREADS = 128, BLOCK_N = 64, STAGES = OVERLAP ? 3 : 2;
    static_assert((HEAD_DIM == 64 || HEAD_DIM == 128) && (HEAD_DIM_V == 64 || HEAD_DIM_V == 128) &&
                      (BLOCK_M == 32 || BLOCK_M == 64 || BLOCK_M == 128),
                  "wgmma shapes of wgmma.cuh");
    constexpr int Q_ELEMS = BLOCK_M * HEAD_DIM, DO_ELEMS = BLOCK_M * HEAD_DIM_V;
    // the mask and bias tiles of a query tile, staged with its Q and dO (mma_tiles.cuh)
    using Side = SideTiles<BiasT, HAS_MASK, BLOCK_M, BLOCK_N, STAGES, THREADS, true>;
    // a packed call's block: its sequence as a dense call (common.cuh)
    const BackwardUnit bu = backward_unit<RAGGED, true, T, G>(params, false);
    const AttnBwdParams& bp = RAGGED != DENSE ? bu.bp : params;
    const AttnParams& p = bp.f;

    using L = BwdSm90DkdvSmem<T, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, STAGES, HAS_MASK,
                              Side::BIAS_SIZE>;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    T* k_s = reinterpret_cast<T*>(smem_raw + L::k_s);    // [64 x HEAD_DIM]
    T* v_s = reinterpret_cast<T*>(smem_raw + L::v_s);    // [64 x HEAD_DIM_V]
    T* q_s = reinterpret_cast<T*>(smem_raw + L::q_s);    // [STAGES][BLOCK_M x HEAD_DIM]
    T* do_s = reinterpret_cast<T*>(smem_raw + L::do_s);  // [STAGES][BLOCK_M x HEAD_DIM_V]
    float* lse_s = reinterpret_cast<float*>(smem_raw + L::lse_s);      // [STAGES][BLOCK_M], log2
    float* delta_s = reinterpret_cast<float*>(smem_raw + L::delta_s);  // [STAGES][BLOCK_M]
    unsigned char* side_s = smem_raw + L::side_s;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // heaviest key blocks first: under causal masking the first keys are seen by the most rows
    const BlockCoords blk = bu.blk;
    const long long n_block = blk.row_block, b = blk.b;
    const long long n0 = n_block * BLOCK_N;

    const BackwardInputs<T, float, BiasT> in(bp, b);  // batch entry b (backward.cuh)
    const T *q = in.q, *k = in.k + n0 * p.k_s.row;
    G* dk_out = reinterpret_cast<G*>(bp.dk) + batch_offset(bp.dk_s, b, p.batch1, p.batch2);
    G* dv_out = reinterpret_cast<G*>(bp.dv) + batch_offset(bp.dv_s, b, p.batch1, p.batch2);
    const T *v = in.v + n0 * p.v_s.row, *dout = in.dout;
    const float *lse = in.lse, *delta = in.delta;
    const unsigned char* mask = in.mask;
    const BiasT* bias = in.bias;
    const Side side(side_s, mask, bias, p);

    const Range queries = band_queries<BLOCK_M, BLOCK_N>(p, n0);  // the band's query tiles
    const long long m_lo = queries.lo, m_hi = queries.hi;

    load_tile<BLOCK_N, HEAD_DIM, THREADS, ALIGNED>(k_s, k, p.k_s.row, p.k_s.col, p.seqlen_k - n0,
                                                   p.head_dim, Sw128<BLOCK_N>());
    load_tile<BLOCK_N, HEAD_DIM_V, THREADS, ALIGNED>(v_s, v, p.v_s.row, p.v_s.col,
                                                     p.seqlen_k - n0, p.head_dim_v,
                                                     Sw128<BLOCK_N>());
    // Q, dO, lse and delta of query tile m0 into stage `st` (tiles are requested in order).
    // STATS_AHEAD: lse and delta from registers loaded one request earlier, then the next
    // tile's into them (QueryRowStats), so that the warps that store them do not wait for
    // global memory before this tile's S and dP products are issued
    QueryRowStats<BLOCK_M> stats;
    auto request_q = [&](long long m0, int st) {
        side.request(st, m0, n0);
        if constexpr (STATS_AHEAD) {
            request_query_operands<BLOCK_M, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED>(
                q_s + st * Q_ELEMS, do_s + st * DO_ELEMS, q, dout, bp, m0);
            stats.store(lse_s + st * BLOCK_M, delta_s + st * BLOCK_M);
            if (m0 + BLOCK_M < m_hi) stats.load(lse, delta, bp, m0 + BLOCK_M);
        } else {
            request_query_tile<BLOCK_M, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED>(
                q_s + st * Q_ELEMS, do_s + st * DO_ELEMS, lse_s + st * BLOCK_M,
                delta_s + st * BLOCK_M, q, dout, lse, delta, bp, m0);
        }
    };
    const int tiles = m_lo < m_hi ? (int)((m_hi - m_lo + BLOCK_M - 1) / BLOCK_M) : 0;
    if constexpr (STATS_AHEAD)
        if (tiles > 0) stats.load(lse, delta, bp, m_lo);
#pragma unroll
    for (int i = 0; i < (OVERLAP ? 1 : STAGES - 1); ++i) {  // K and V join the first group
        if (i < tiles) request_q(m_lo + i * BLOCK_M, i);
        cp_async_commit();
    }

    float dk[HEAD_DIM / 8][4], dv[HEAD_DIM_V / 8][4];
    zero(dk);
    zero(dv);
    const unsigned k_base = smem_addr(k_s), v_base = smem_addr(v_s);
    const unsigned q_base = smem_addr(q_s), do_base = smem_addr(do_s);
    const ScoreConsts<float> consts(p);

    if constexpr (OVERLAP) {
        dkdv_overlapped<T, HAS_MASK, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, STAGES>(
            dk, dv, p, consts, side, request_q, tiles, m_lo, n0, k_base, v_base, q_base, do_base,
            lse_s, delta_s, warp, lane, mask, bias);
    } else {
        int stage = 0;
        for (long long m0 = m_lo; m0 < m_hi; m0 += BLOCK_M, stage ^= 1) {
            if (m0 + BLOCK_M < m_hi) request_q(m0 + BLOCK_M, stage ^ 1);
            cp_async_commit();
            cp_async_wait<1>();   // all but the group just issued have landed ...
            fence_proxy_async();  // ... are visible to the tensor cores ...
            __syncthreads();      // ... for every thread: K, V (first time), this query tile
            const unsigned q_tile = q_base + stage * Q_ELEMS * 2;
            const unsigned do_tile = do_base + stage * DO_ELEMS * 2;
            float s[BLOCK_M / 8][4], dp[BLOCK_M / 8][4];  // S^T, dP^T: keys x queries
            issue_score_products<BLOCK_M, HEAD_DIM, HEAD_DIM_V, T>(s, dp, k_base, q_tile, v_base,
                                                                   do_tile);
            wgmma_wait<0>();
            keys_p_and_ds<HAS_MASK, BLOCK_M>(
                s, dp, p, consts, m0, n0, !HAS_MASK && tile_is_interior(p, m0, BLOCK_M, n0, BLOCK_N),
                side, stage, lse_s, delta_s, warp, lane, mask, bias);
            // one product in flight at a time: its A fragments stay live until it completes
            product_rs<HEAD_DIM_V, BLOCK_M, T>(dv, s, do_tile);
            wgmma_commit();
            wgmma_wait<0>();
            product_rs<HEAD_DIM, BLOCK_M, T>(dk, dp, q_tile);
            wgmma_commit();
            wgmma_wait<0>();
            __syncthreads();  // this stage is consumed before the next iteration refills it
        }
    }
    cp_async_wait<0>();  // no copy may outlive the block

    const long long row0 = n0 + warp * 16;
    store_tile(dk, dk_out, bp.dk_s.row, bp.dk_s.col, row0, p.seqlen_k, p.head_dim, lane,
               float(p.scale));
    store_tile(dv, dv_out, bp.dv_s.row, bp.dv_s.col, row0, p.seqlen_k, p.head_dim_v, lane, 1.f);
}

template <typename T, typename G, typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V,
          int BLOCK_N, bool ALIGNED, int MIN_BLOCKS, bool OVERLAP, int RAGGED = DENSE>
__global__ void __launch_bounds__(128, MIN_BLOCKS)
    attention_bwd_dq_sm90(const AttnBwdParams params) {
    constexpr int THREADS = 128, BLOCK_M = 64, STAGES = OVERLAP ? 3 : 2;
    static_assert((HEAD_DIM == 64 || HEAD_DIM == 128) && (HEAD_DIM_V == 64 || HEAD_DIM_V == 128) &&
                      (BLOCK_N == 64 || BLOCK_N == 128),
                  "wgmma shapes of wgmma.cuh");
    constexpr int K_ELEMS = BLOCK_N * HEAD_DIM, V_ELEMS = BLOCK_N * HEAD_DIM_V;
    // the mask and bias tiles of a key tile, staged with its K and V (mma_tiles.cuh)
    using Side = SideTiles<BiasT, HAS_MASK, BLOCK_M, BLOCK_N, STAGES, THREADS, false>;
    // a packed call's block: its sequence as a dense call (common.cuh)
    const BackwardUnit bu = backward_unit<RAGGED, false, T, G>(params, true);
    const AttnBwdParams& bp = RAGGED != DENSE ? bu.bp : params;
    const AttnParams& p = bp.f;

    using L = BwdSm90DqSmem<T, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, STAGES, HAS_MASK,
                            Side::BIAS_SIZE>;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw + L::q_s);    // [64 x HEAD_DIM]
    T* do_s = reinterpret_cast<T*>(smem_raw + L::do_s);  // [64 x HEAD_DIM_V]
    T* k_s = reinterpret_cast<T*>(smem_raw + L::k_s);    // [STAGES][BLOCK_N x HEAD_DIM]
    T* v_s = reinterpret_cast<T*>(smem_raw + L::v_s);    // [STAGES][BLOCK_N x HEAD_DIM_V]
    unsigned char* side_s = smem_raw + L::side_s;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // heaviest query blocks first: under causal masking the last rows see the most keys
    const BlockCoords blk = bu.blk;
    const long long m_block = blk.row_block, b = blk.b;
    const long long m0 = m_block * BLOCK_M;

    const DqInputs<T, float, BiasT> in(bp, b, m0);  // batch entry b from row m0 (backward.cuh)
    const Side side(side_s, in.mask, in.bias, p);
    const Range keys = band_keys<BLOCK_M, BLOCK_N>(p, m0);  // the band's key tiles
    const long long n_lo = keys.lo, n_hi = keys.hi;

    auto request_kv = [&](long long n0, int st) {
        load_kv_tiles<BLOCK_N, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED>(
            k_s + st * K_ELEMS, v_s + st * V_ELEMS, in.k, in.v, n0, p, Sw128<BLOCK_N>(),
            Sw128<BLOCK_N>());
        side.request(st, m0, n0);
    };
    load_tile<BLOCK_M, HEAD_DIM, THREADS, ALIGNED>(q_s, in.q, p.q_s.row, p.q_s.col,
                                                   p.seqlen_q - m0, p.head_dim, Sw128<BLOCK_M>());
    load_tile<BLOCK_M, HEAD_DIM_V, THREADS, ALIGNED>(do_s, in.dout, bp.dout_s.row, bp.dout_s.col,
                                                     p.seqlen_q - m0, p.head_dim_v,
                                                     Sw128<BLOCK_M>());
    const int tiles = n_lo < n_hi ? (int)((n_hi - n_lo + BLOCK_N - 1) / BLOCK_N) : 0;
#pragma unroll
    for (int i = 0; i < (OVERLAP ? 1 : STAGES - 1); ++i) {  // Q and dO join the first group
        if (i < tiles) request_kv(n_lo + i * BLOCK_N, i);
        cp_async_commit();
    }

    float lse_log2[2], dl[2];  // this lane's two rows
    load_row_stats(lse_log2, dl, in.lse, in.delta, bp, m0, warp, lane);
    float dq[HEAD_DIM / 8][4];
    zero(dq);
    const unsigned q_base = smem_addr(q_s), do_base = smem_addr(do_s);
    const unsigned k_base = smem_addr(k_s), v_base = smem_addr(v_s);
    const ScoreConsts<float> consts(p);

    if constexpr (OVERLAP) {
        dq_overlapped<T, HAS_MASK, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, STAGES>(
            dq, p, consts, side, request_kv, tiles, n_lo, m0, q_base, do_base, k_base, v_base,
            lse_log2, dl, warp, lane, in.mask, in.bias);
    } else {
        int stage = 0;
        for (long long n0 = n_lo; n0 < n_hi; n0 += BLOCK_N, stage ^= 1) {
            if (n0 + BLOCK_N < n_hi) request_kv(n0 + BLOCK_N, stage ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
            fence_proxy_async();
            __syncthreads();  // Q, dO (first time) and this key tile are in shared memory
            const unsigned k_tile = k_base + stage * K_ELEMS * 2;
            const unsigned v_tile = v_base + stage * V_ELEMS * 2;
            float s[BLOCK_N / 8][4], dp[BLOCK_N / 8][4];
            issue_score_products<BLOCK_N, HEAD_DIM, HEAD_DIM_V, T>(s, dp, q_base, k_tile, do_base,
                                                                   v_tile);
            wgmma_wait<0>();
            const bool interior = !HAS_MASK && tile_is_interior(p, m0, BLOCK_M, n0, BLOCK_N);
            const auto stat = [&](int, int e) { return make_float2(lse_log2[e / 2], dl[e / 2]); };
            // the mask and bias tiles staged with this key tile, or the arrays in place
            p_and_ds_tile<HAS_MASK, false, BLOCK_N / 8>(s, dp, p, consts, m0 + warp * 16, n0,
                                                        lane, interior, side, stage, m0, n0,
                                                        in.mask, in.bias, stat);
            product_rs<HEAD_DIM, BLOCK_N, T>(dq, dp, k_tile);
            wgmma_commit();
            wgmma_wait<0>();
            __syncthreads();  // this stage is consumed before the next iteration refills it
        }
    }
    cp_async_wait<0>();

    G* dq_out = reinterpret_cast<G*>(bp.dq) + batch_offset(bp.dq_s, b, p.batch1, p.batch2);
    store_tile(dq, dq_out, bp.dq_s.row, bp.dq_s.col, m0 + warp * 16, p.seqlen_q, p.head_dim,
               lane, float(p.scale));
}
