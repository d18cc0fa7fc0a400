// attention_backward_sm90_3xf16.cu -- float32 attention backward for precision="highest" on
// Hopper's float16 tensor cores (sm_90a: wgmma .f16): the 3xTF32 split, carried by float16
// operands scaled by powers of two (split16.cuh).
//
// Computes:   the gradients of the float32 forward (reference
//             cuattn/reference.py::attention_backward_reference) with the two kernels of
//             attention_backward_sm90.cu after delta (backward.cuh) and its element-wise rule
//             (p_and_ds_tile), every product by the split: score products
//             [A_hi B_hi^T | A_hi B_lo^T] and A_lo B_hi^T summed hh + (hl + lh) in float32
//             (stacked_product_ss); gradient products of each tile into fresh accumulators,
//             small terms first, added to the running gradient.
// The split:  x = hi + lo with hi = x rounded to TF32 (11 significant bits, to nearest) and lo
//             = x - hi read to 11 significant bits toward zero -- exactly the values that the
//             3xTF32 split feeds a TF32 instruction (split_tf32; the instruction truncates
//             lo). float16 holds 11 significant bits too, so hi * s and lo * s are float16
//             values for a power of two s that puts the operand's largest magnitude in
//             [2^14, 2^15): the products are those of 3xTF32 times s_a s_b (exact), taken out
//             again by exact multiplies. The recomputed scores are the sm90_3xf16 forward's
//             (attention_sm90_3xf16.cu: the same products, summed the same way, with the same
//             scales), so their errors cancel in P = exp(S - lse); against the lse of a
//             forward with TF32 products they would not once the logits grow (the tensor
//             cores round float16 and TF32 products differently). Where lo * s falls below
//             float16's normal range (|x| below 2^-16 of the largest magnitude of its
//             operand) lo keeps fewer bits: an absolute error under 2^-38 of that magnitude.
//             Scales per batch entry (attention_bwd_magnitudes: the largest finite |q|, |k|,
//             |v|, |dout|, |out|); P by 2^15 (P <= 1); dS by its bound Dv |dout| (|v| + |out|)
//             (|dP| <= Dv |dout| |v|, |delta| <= Dv |dout| |out|, P <= 1, the softcap factor
//             <= 1). Exponents are clamped to [-100, 100]: entries whose largest magnitude lies
//             outside about 2^-86 .. 2^100 lose precision (below) or overflow (above).
//             Against TF32 operands: the products run at the 16-bit rate (twice TF32's), and
//             16-bit wgmma reads B N-contiguous, so the gradient products read the streamed
//             split tiles as stored -- no transposed copies, and a split tile takes the bytes
//             of one float tile, which is what lets head dim 128 fit.
// Kernels:    attention_bwd_magnitudes: the largest finite magnitudes per batch entry (grid:
//             num_row_blocks chunks of MAG_ROWS rows x batch; atomicMax on the float bits,
//             which order as unsigned integers for non-negative floats: order-independent).
//             attention_bwd_dkdv_sm90_3xf16: each warpgroup owns 64 keys (warp w: keys 16w ..
//             16w + 15 of them) and all columns of dK and dV (ROLES = 1), or of one of them
//             (ROLES = 2: the grid's column tile 0 computes dV -- S^T and dV += P^T dO -- and
//             tile 1 dK -- S^T, dP^T and dK += dS^T Q --, so that a head dim of 128 fits the
//             registers; ROLES = 3: the block's two warpgroups own the same 64 keys,
//             warpgroup 0 computing S^T, P^T and dV, and 1 dP^T and dK, with P^T (times the
//             softcap factor) handed from 0 to 1 through shared memory, one named barrier
//             per tile: K and V are split once for both, each warpgroup runs two split
//             products per tile pair, and the shared memory leaves room for OVERLAP at head
//             dim 128); K and V split once
//             (from global memory through registers); the block walks the query tiles
//             (BLOCK_M rows) of its keys' band.
//             attention_bwd_dq_sm90_3xf16: each warpgroup owns 64 query rows and all columns
//             of dQ, Q and dO split once; the block walks the key tiles (BLOCK_N keys).
//             With WARPGROUPS = 2 the two warpgroups share each streamed tile (its split tile
//             is written once for both, by all 256 threads). Each gradient element is written
//             once by one thread: no atomics, repeated calls are bit-identical.
// Template:   BiasT; HAS_MASK; HEAD_DIM, HEAD_DIM_V (64 or 128, zero-padded); the tile of the
//             other sequence (BLOCK_M for dK/dV, BLOCK_N for dQ: 32 or 64); ALIGNED (16-byte
//             copies and loads: unit column strides, 16-byte rows and pointers; otherwise
//             element loads); MIN_BLOCKS; OVERLAP (the next tile is split while the tensor
//             cores run this tile's gradient products: two buffers of split tiles);
//             WARPGROUPS (1 or 2); ROLES (dK/dV: 1, 2 or 3, above); STAGGER (two
//             warpgroups: the second issues its score products only once the first has
//             issued its own, so that the first's element-wise pass runs while the tensor
//             cores compute the second's).
//             Gradients are float32.
// Schedule:   per tile t (both kernels): S and dP (S^T and dP^T) by the split, wait, sum,
//             unscale; the element-wise pass, the split fragments and the gradient products
//             issued into fresh accumulators; then either (plain) wait, add, and prepare tile
//             t + 1 -- a barrier, the request of tile t + 2's raw tiles into the stage that tile
//             t used, the split tiles of t + 1, a proxy fence and a barrier -- or (OVERLAP)
//             prepare t + 1 first and wait and add after.
// Shared mem: dK/dV: O*2*64*(HEAD_DIM+HEAD_DIM_V)*2 + 2*BLOCK_M*(HEAD_DIM+HEAD_DIM_V)*4
//             + B*2*BLOCK_M*(HEAD_DIM+HEAD_DIM_V)*2 + 2*2*BLOCK_M*4 + X*64*BLOCK_M*4
//             bytes: K and V (hi, lo; per warpgroup), two raw stages of Q and dO, B buffers
//             of their stacked split tiles (hi rows; lo rows), lse and delta, and (X = 1 with
//             ROLES = 3, else 0) the exchanged P^T;
//             dQ: W*2*64*(HEAD_DIM+HEAD_DIM_V)*2 + 2*BLOCK_N*(HEAD_DIM+HEAD_DIM_V)*4
//             + B*2*BLOCK_N*(HEAD_DIM+HEAD_DIM_V)*2 bytes: Q and dO (hi, lo; per warpgroup),
//             two raw stages of K and V, B buffers of their stacked split tiles;
//             B = 2 with OVERLAP, else 1; W = WARPGROUPS; O = 1 with ROLES = 3, else W.
//             Split tiles in the 16-bit
//             128-byte-swizzle layout (Sw128<ROWS, 2>), raw tiles in the float one
//             (Sw128<ROWS, 4>). The layouts: BwdSplit16DkdvSmem, BwdSplit16DqSmem (layouts.cuh,
//             from cuattn/families/sm90_3xf16.py).
#include "common/backward.cuh"
#include "sm90/split16.cuh"

using namespace cuattn;
using namespace cuattn::mma;
using namespace cuattn::sm90;

namespace {

using namespace cuattn::split16;

// The dK/dV kernel's body for one role: DV (S^T, dV += P^T dO), DK (S^T, dP^T, dK += dS^T
// Q), or both. SHARED_KEYS: the block's two warpgroups own the same 64 keys, one role each
// (K and V split once for both); otherwise each warpgroup owns 64 keys of its own. The
// block barriers are named (bar_sync) since the two roles reach them from different code.
// With SHARED_KEYS the dK role forms no S^T: the dV role hands it P^T (times the softcap
// factor, 0 where masked) through shared memory, so each role runs two split products per
// tile (a dK role that formed S^T itself would run three, 2-4 % slower). STAGGER: warpgroup
// 1 issues its score products only after warpgroup 0 has issued its own (a named barrier).
template <bool DV, bool DK, bool SHARED_KEYS, bool STAGGER, typename BiasT, bool HAS_MASK,
          int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, bool ALIGNED, bool OVERLAP, int WARPGROUPS>
__device__ __forceinline__ void dkdv_3xf16(const AttnBwdParams& bp, const BlockCoords& blk,
                                           unsigned char* smem_raw) {
    constexpr int THREADS = 128 * WARPGROUPS;
    constexpr int OWNERS = SHARED_KEYS ? 1 : WARPGROUPS;  // warpgroups with keys of their own
    constexpr int BLOCK_N = 64 * OWNERS;                   // 64 keys an owner
    constexpr int K_ELEMS = 64 * HEAD_DIM, V_ELEMS = 64 * HEAD_DIM_V;  // one owner's keys
    constexpr int Q_ELEMS = BLOCK_M * HEAD_DIM, DO_ELEMS = BLOCK_M * HEAD_DIM_V;
    constexpr int BUFS = OVERLAP ? 2 : 1;  // split tiles: one per tile in flight
    constexpr bool EXCHANGE = SHARED_KEYS;
    const AttnParams& p = bp.f;

    using L = BwdSplit16DkdvSmem<HEAD_DIM, HEAD_DIM_V, BLOCK_M, OWNERS, OVERLAP, EXCHANGE>;
    __half* k_s = reinterpret_cast<__half*>(smem_raw + L::k_s);  // [OWNERS][hi, lo][64 x D]
    __half* v_s = reinterpret_cast<__half*>(smem_raw + L::v_s);  // [OWNERS][hi, lo][64 x Dv]
    float* q_raw = reinterpret_cast<float*>(smem_raw + L::q_raw);    // [2][BLOCK_M x D]
    float* do_raw = reinterpret_cast<float*>(smem_raw + L::do_raw);  // [2][BLOCK_M x Dv]
    __half* q_s = reinterpret_cast<__half*>(smem_raw + L::q_s);    // [BUFS][2 BLOCK_M x D]
    __half* do_s = reinterpret_cast<__half*>(smem_raw + L::do_s);  // [BUFS][2 BLOCK_M x Dv]
    float* lse_s = reinterpret_cast<float*>(smem_raw + L::lse_s);      // [2][BLOCK_M], log2
    float* delta_s = reinterpret_cast<float*>(smem_raw + L::delta_s);  // [2][BLOCK_M]
    // EXCHANGE: [BLOCK_M / 8][128 threads] float4: P^T times the softcap factor, in the
    // accumulator order of the dV role's thread (the dK role's thread 128 further reads it)
    float4* pf_s = reinterpret_cast<float4*>(smem_raw + L::pf_s);
    static_assert(!SHARED_KEYS || DV != DK, "the exchange joins the two roles");

    // warpgroup wg owns keys n0 + 64 wg .. + 63 (its warp w: 16 w .. 16 w + 15 of them), or
    // n0 .. n0 + 63 with SHARED_KEYS
    const int wg = OWNERS == 1 ? 0 : threadIdx.x / 128, lane = threadIdx.x % 32;
    const int wg_index = threadIdx.x / 128;  // (with SHARED_KEYS too)
    static_assert(!STAGGER || WARPGROUPS == 2, "the stagger orders two warpgroups");
    const int warp = WARPGROUPS == 1 ? threadIdx.x / 32 : threadIdx.x / 32 % 4;
    const long long n_block = blk.row_block, b = blk.b;
    const long long n0 = n_block * BLOCK_N, n_own = n0 + 64 * wg;

    const BackwardInputs<float, float, BiasT> in(bp, b);  // batch entry b (backward.cuh)
    const float *q = in.q, *k = in.k + n0 * p.k_s.row;
    const float *v = in.v + n0 * p.v_s.row, *dout = in.dout;
    const float *lse = in.lse, *delta = in.delta;
    const SplitScales sc(p, b);

    const Range queries = band_queries<BLOCK_M, BLOCK_N>(p, n0);  // the band's query tiles
    const long long m_lo = queries.lo, m_hi = queries.hi;
    const int tiles = m_lo < m_hi ? (int)((m_hi - m_lo + BLOCK_M - 1) / BLOCK_M) : 0;

    // Q and dO of query tile t into raw stage t % 2 by cp.async, and its lse (log2 units)
    // and delta (two warpgroups: from registers loaded one request earlier, as
    // attention_bwd_dkdv_sm90 does with STATS_AHEAD)
    QueryRowStats<BLOCK_M> stats;
    auto request_q = [&](int t) {
        const int st = t & 1;
        const long long m0 = m_lo + (long long)t * BLOCK_M;
        if constexpr (WARPGROUPS == 1) {
            request_query_tile<BLOCK_M, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED>(
                q_raw + st * Q_ELEMS, do_raw + st * DO_ELEMS, lse_s + st * BLOCK_M,
                delta_s + st * BLOCK_M, q, dout, lse, delta, bp, m0);
        } else {
            request_query_operands<BLOCK_M, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED>(
                q_raw + st * Q_ELEMS, do_raw + st * DO_ELEMS, q, dout, bp, m0);
            stats.store(lse_s + st * BLOCK_M, delta_s + st * BLOCK_M);
            if (t + 1 < tiles) stats.load(lse, delta, bp, m0 + BLOCK_M);
        }
    };
    if (tiles > 0) {
        if constexpr (WARPGROUPS > 1) stats.load(lse, delta, bp, m_lo);
        request_q(0);
    }
    cp_async_commit();  // the first query tile
    // each warpgroup's 64 keys of K (and V for dK), split through registers meanwhile
    split_own_tiles<OWNERS, HEAD_DIM, THREADS, ALIGNED>(k_s, k, p.k_s, p.seqlen_k - n0,
                                                        p.head_dim, sc.k);
    if constexpr (DK || SHARED_KEYS)  // (shared: every thread copies its part for the dK role)
        split_own_tiles<OWNERS, HEAD_DIM_V, THREADS, ALIGNED>(v_s, v, p.v_s, p.seqlen_k - n0,
                                                              p.head_dim_v, sc.v);
    cp_async_wait<0>();  // (the first prepare's barrier orders the own tiles' stores too)

    float dk[DK ? HEAD_DIM / 8 : 1][4], dv[DV ? HEAD_DIM_V / 8 : 1][4];
    zero(dk);
    zero(dv);
    const unsigned k_base = smem_addr(k_s + wg * 2 * K_ELEMS);  // this warpgroup's keys
    const unsigned v_base = smem_addr(v_s + wg * 2 * V_ELEMS);
    const unsigned q_base = smem_addr(q_s), do_base = smem_addr(do_s);
    const ScoreConsts<float> consts(p);
    const float inv_qk[2] = {1.f / sc.q, 1.f / sc.k}, inv_dov[2] = {1.f / sc.dout, 1.f / sc.v};

    using Acc = float[BLOCK_M / 8][4];       // S^T, dP^T: keys x queries
    using Frag = unsigned[BLOCK_M / 16][4];  // P^T, dS^T as A fragments (hi or lo)
    auto q_tile = [&](int t) { return q_base + (OVERLAP ? t & 1 : 0) * 2 * Q_ELEMS * 2; };
    auto do_tile = [&](int t) { return do_base + (OVERLAP ? t & 1 : 0) * 2 * DO_ELEMS * 2; };
    // tile t's raw stage has landed for this thread: once it has for every thread (and every
    // thread is done with the split tiles that the writes below replace), the next tile is
    // requested into the other stage and tile t's split tiles written
    auto prepare = [&](int t) {
        const int st = t & 1, buf = OVERLAP ? t & 1 : 0;
        bar_sync(1, THREADS);
        if (t + 1 < tiles) request_q(t + 1);
        cp_async_commit();
        split_stacked16<BLOCK_M, HEAD_DIM, THREADS>(q_s + buf * 2 * Q_ELEMS, q_raw + st * Q_ELEMS,
                                                    sc.q);
        split_stacked16<BLOCK_M, HEAD_DIM_V, THREADS>(do_s + buf * 2 * DO_ELEMS,
                                                      do_raw + st * DO_ELEMS, sc.dout);
        fence_proxy_async();   // visible to the tensor cores ...
        bar_sync(1, THREADS);  // ... once every thread has written its part
    };
    // S^T (and dP^T) of the prepared tile, each split term apart, summed once they are done
    constexpr bool NEED_S = !EXCHANGE || DV;  // the exchange's dK role takes P from dV's
    auto scores = [&](int t, Acc& s, Acc& dp) {
        float s_w[NEED_S ? 2 * BLOCK_M / 8 : 1][4], dp_w[DK ? 2 * BLOCK_M / 8 : 1][4];
        float s_y[NEED_S ? BLOCK_M / 8 : 1][4], dp_y[DK ? BLOCK_M / 8 : 1][4];
        if (STAGGER && wg_index == 1) bar_sync(3, THREADS);  // warpgroup 0's are issued
        if constexpr (NEED_S)
            stacked_product_ss<BLOCK_M, HEAD_DIM, __half>(s_w, s_y, k_base, K_ELEMS * 2,
                                                          q_tile(t));
        if constexpr (DK)
            stacked_product_ss<BLOCK_M, HEAD_DIM_V, __half>(dp_w, dp_y, v_base, V_ELEMS * 2,
                                                            do_tile(t));
        wgmma_commit();
        if (STAGGER && wg_index == 0) bar_arrive(3, THREADS);
        wgmma_wait<0>();
        if constexpr (NEED_S) stacked_sum_unscaled(s, s_w, s_y, inv_qk[0], inv_qk[1]);
        if constexpr (DK)
            stacked_sum_unscaled(dp, dp_w, dp_y, inv_dov[0], inv_dov[1]);
        else  // dS is not used; with the exchange, dp = 1 and delta 0 leave P times the factor
#pragma unroll
            for (int j = 0; j < BLOCK_M / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) dp[j][e] = EXCHANGE ? 1.f : 0.f;
    };
    // S^T, dP^T of tile t done: P^T and dS^T, their split fragments, and tile t's dV and dK
    // issued into the fresh accumulators (the fragments stay untouched until they are done)
    auto grads = [&](int t, Acc& s, Acc& dp, Frag& p_hi, Frag& p_lo, Frag& ds_hi, Frag& ds_lo,
                     float (&dv_t)[DV ? HEAD_DIM_V / 8 : 1][4],
                     float (&dk_t)[DK ? HEAD_DIM / 8 : 1][4]) {
        const long long m0 = m_lo + (long long)t * BLOCK_M;
        const int st = t & 1;
        const bool interior = !HAS_MASK && tile_is_interior(p, m0, BLOCK_M, n_own, 64);
        const float* lse_t = lse_s + st * BLOCK_M;
        const float* delta_t = delta_s + st * BLOCK_M;
        if constexpr (EXCHANGE && DK) {  // dS^T = (P^T times the factor) (dP^T - delta)
            bar_sync(2, THREADS);          // the dV role's P^T of this tile is written
#pragma unroll
            for (int j = 0; j < BLOCK_M / 8; ++j) {
                const float4 f = pf_s[j * 128 + threadIdx.x % 128];
                const float pf[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float d = delta_t[8 * j + 2 * (lane % 4) + e % 2];
                    dp[j][e] = pf[e] != 0.f ? pf[e] * (dp[j][e] - d) : 0.f;
                }
            }
        } else {
            p_and_ds_tile<HAS_MASK, true>(
                s, dp, p, consts, n_own + warp * 16, m0, lane, interior, in.mask, in.bias,
                [&](int j, int e) {
                    const int col = 8 * j + 2 * (lane % 4) + e % 2;
                    return make_float2(lse_t[col], EXCHANGE ? 0.f : delta_t[col]);
                });
        }
        if constexpr (EXCHANGE && DV) {  // P^T times the factor to the dK role
            // (the prepare barrier of the next tile orders the next write after this read)
#pragma unroll
            for (int j = 0; j < BLOCK_M / 8; ++j)
                pf_s[j * 128 + threadIdx.x % 128] = make_float4(dp[j][0], dp[j][1], dp[j][2],
                                                                dp[j][3]);
            bar_arrive(2, THREADS);
        }
        if constexpr (DV) {
            split_fragments<BLOCK_M>(p_hi, p_lo, s, P_SCALE);
            split_product_ra16<HEAD_DIM_V, BLOCK_M>(dv_t, p_hi, p_lo, do_tile(t));
        }
        if constexpr (DK) {
            split_fragments<BLOCK_M>(ds_hi, ds_lo, dp, sc.ds);
            split_product_ra16<HEAD_DIM, BLOCK_M>(dk_t, ds_hi, ds_lo, q_tile(t));
        }
        wgmma_commit();
    };

    if (tiles > 0) prepare(0);
    // OVERLAP: tile t + 1 is prepared (split) while the tensor cores run tile t's dV and dK.
    // Every wgmma is issued outside a branch, and each tile's accumulators and fragments are
    // the loop body's own (nothing of them lives across iterations).
    for (int t = 0; t < tiles; ++t) {
        Acc s, dp;
        scores(t, s, dp);
        Frag p_hi, p_lo, ds_hi, ds_lo;
        float dv_t[DV ? HEAD_DIM_V / 8 : 1][4], dk_t[DK ? HEAD_DIM / 8 : 1][4];
        grads(t, s, dp, p_hi, p_lo, ds_hi, ds_lo, dv_t, dk_t);
        if constexpr (!OVERLAP) {
            wgmma_wait<0>();
            if constexpr (DV) add_into(dv, dv_t);
            if constexpr (DK) add_into(dk, dk_t);
        }
        if (t + 1 < tiles) {
            cp_async_wait<0>();  // tile t + 1 (requested by prepare(t)) has landed
            prepare(t + 1);
        }
        if constexpr (OVERLAP) {
            wgmma_wait<0>();
            if constexpr (DV) add_into(dv, dv_t);
            if constexpr (DK) add_into(dk, dk_t);
        }
    }
    cp_async_wait<0>();  // no copy may outlive the block

    const long long row0 = n_own + warp * 16;
    if constexpr (DK) {
        float* dk_out = reinterpret_cast<float*>(bp.dk) + batch_offset(bp.dk_s, b, p.batch1, p.batch2);
        scale_by(dk, 1.f / sc.ds, 1.f / sc.q);
        store_tile(dk, dk_out, bp.dk_s.row, bp.dk_s.col, row0, p.seqlen_k, p.head_dim, lane,
                   float(p.scale));
    }
    if constexpr (DV) {
        float* dv_out = reinterpret_cast<float*>(bp.dv) + batch_offset(bp.dv_s, b, p.batch1, p.batch2);
        scale_by(dv, 1.f / P_SCALE, 1.f / sc.dout);
        store_tile(dv, dv_out, bp.dv_s.row, bp.dv_s.col, row0, p.seqlen_k, p.head_dim_v, lane,
                   1.f);
    }
}

// The dQ kernel's loop over its key tiles, as in the dK/dV kernel: per tile, S and dP, then
// dS and this tile's dQ product into fresh accumulators, added to dq once done; the next
// tile is prepared before that wait with OVERLAP, after it otherwise.
template <bool OVERLAP, int BLOCK_N, int D8, typename Prepare, typename Scores, typename Grads>
__device__ __forceinline__ void dq_tiles(float (&dq)[D8][4], int tiles, const Prepare& prepare,
                                         const Scores& scores, const Grads& grads) {
    using Acc = float[BLOCK_N / 8][4];       // S, dP: queries x keys
    using Frag = unsigned[BLOCK_N / 16][4];  // dS as A fragments (hi or lo)
    if (tiles > 0) prepare(0);
    for (int t = 0; t < tiles; ++t) {
        Acc s, dp;
        scores(t, s, dp);
        Frag ds_hi, ds_lo;
        float dq_t[D8][4];  // this tile's dQ
        grads(t, s, dp, ds_hi, ds_lo, dq_t);
        if constexpr (!OVERLAP) {
            wgmma_wait<0>();
            add_into(dq, dq_t);
        }
        if (t + 1 < tiles) {
            cp_async_wait<0>();
            prepare(t + 1);
        }
        if constexpr (OVERLAP) {
            wgmma_wait<0>();
            add_into(dq, dq_t);
        }
    }
}

}  // namespace

// The largest magnitudes of q, k, v, dout and out per batch entry (magnitudes_of_rows;
// bp.num_row_blocks: chunks of MAG_ROWS rows per entry)
__global__ void __launch_bounds__(MAG_THREADS) attention_bwd_magnitudes(const AttnBwdParams bp) {
    magnitudes_of_rows(bp.f, bp.dout, bp.dout_s, (unsigned)bp.num_row_blocks);
}

template <typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, bool ALIGNED,
          int MIN_BLOCKS, bool OVERLAP, int WARPGROUPS, int ROLES, bool STAGGER>
__global__ void __launch_bounds__(128 * WARPGROUPS, MIN_BLOCKS)
    attention_bwd_dkdv_sm90_3xf16(const AttnBwdParams bp) {
    static_assert((HEAD_DIM == 64 || HEAD_DIM == 128) && (HEAD_DIM_V == 64 || HEAD_DIM_V == 128) &&
                      (BLOCK_M == 32 || BLOCK_M == 64) && (WARPGROUPS == 1 || WARPGROUPS == 2) &&
                      (ROLES == 1 || ROLES == 2 || (ROLES == 3 && WARPGROUPS == 2)),
                  "wgmma shapes of wgmma.cuh");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // heaviest key blocks first: under causal masking the first keys are seen by the most rows
    const BlockCoords blk = block_coords(bp.num_row_blocks, bp.num_col_tiles,
                                         bp.f.window_left >= 0 || bp.f.window_right >= 0, false);
    constexpr bool SHARED = ROLES == 3;
    if constexpr (ROLES == 1) {
        dkdv_3xf16<true, true, false, STAGGER, BiasT, HAS_MASK, HEAD_DIM, HEAD_DIM_V, BLOCK_M,
                   ALIGNED, OVERLAP, WARPGROUPS>(bp, blk, smem_raw);
    } else if (ROLES == 2 ? blk.col_tile == 0 : threadIdx.x < 128) {
        dkdv_3xf16<true, false, SHARED, STAGGER, BiasT, HAS_MASK, HEAD_DIM, HEAD_DIM_V, BLOCK_M,
                   ALIGNED, OVERLAP, WARPGROUPS>(bp, blk, smem_raw);
    } else {
        dkdv_3xf16<false, true, SHARED, STAGGER, BiasT, HAS_MASK, HEAD_DIM, HEAD_DIM_V, BLOCK_M,
                   ALIGNED, OVERLAP, WARPGROUPS>(bp, blk, smem_raw);
    }
}

template <typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N, bool ALIGNED,
          int MIN_BLOCKS, bool OVERLAP, int WARPGROUPS, bool STAGGER>
__global__ void __launch_bounds__(128 * WARPGROUPS, MIN_BLOCKS)
    attention_bwd_dq_sm90_3xf16(const AttnBwdParams bp) {
    constexpr int THREADS = 128 * WARPGROUPS, BLOCK_M = 64 * WARPGROUPS;  // 64 rows a warpgroup
    static_assert((HEAD_DIM == 64 || HEAD_DIM == 128) && (HEAD_DIM_V == 64 || HEAD_DIM_V == 128) &&
                      (BLOCK_N == 32 || BLOCK_N == 64) && (WARPGROUPS == 1 || WARPGROUPS == 2) &&
                      (!STAGGER || WARPGROUPS == 2),
                  "wgmma shapes of wgmma.cuh");
    constexpr int Q_ELEMS = 64 * HEAD_DIM, DO_ELEMS = 64 * HEAD_DIM_V;  // one warpgroup's rows
    constexpr int K_ELEMS = BLOCK_N * HEAD_DIM, V_ELEMS = BLOCK_N * HEAD_DIM_V;
    constexpr int BUFS = OVERLAP ? 2 : 1;
    const AttnParams& p = bp.f;

    using L = BwdSplit16DqSmem<HEAD_DIM, HEAD_DIM_V, WARPGROUPS, BLOCK_N, OVERLAP>;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __half* q_s = reinterpret_cast<__half*>(smem_raw + L::q_s);    // [WARPGROUPS][hi, lo][64 x D]
    __half* do_s = reinterpret_cast<__half*>(smem_raw + L::do_s);  // [WARPGROUPS][hi, lo][64 x Dv]
    float* k_raw = reinterpret_cast<float*>(smem_raw + L::k_raw);  // [2][BLOCK_N x D]
    float* v_raw = reinterpret_cast<float*>(smem_raw + L::v_raw);  // [2][BLOCK_N x Dv]
    __half* k_s = reinterpret_cast<__half*>(smem_raw + L::k_s);    // [BUFS][2 BLOCK_N x D]
    __half* v_s = reinterpret_cast<__half*>(smem_raw + L::v_s);    // [BUFS][2 BLOCK_N x Dv]

    // warpgroup wg owns rows m0 + 64 wg .. + 63 (its warp w: 16 w .. 16 w + 15 of them)
    const int wg = WARPGROUPS == 1 ? 0 : threadIdx.x / 128, lane = threadIdx.x % 32;
    const int warp = WARPGROUPS == 1 ? threadIdx.x / 32 : threadIdx.x / 32 % 4;
    // heaviest query blocks first: under causal masking the last rows see the most keys
    const BlockCoords blk = block_coords(bp.num_row_blocks, bp.num_col_tiles,
                                         bp.f.window_left >= 0 || bp.f.window_right >= 0, true);
    const long long m_block = blk.row_block, b = blk.b;
    const long long m0 = m_block * BLOCK_M, m_own = m0 + 64 * wg;

    const DqInputs<float, float, BiasT> in(bp, b, m0);  // entry b from row m0 (backward.cuh)
    const SplitScales sc(p, b);

    const Range keys = band_keys<BLOCK_M, BLOCK_N>(p, m0);  // the band's key tiles
    const long long n_lo = keys.lo, n_hi = keys.hi;
    const int tiles = n_lo < n_hi ? (int)((n_hi - n_lo + BLOCK_N - 1) / BLOCK_N) : 0;

    auto request_kv = [&](int t) {  // key tile t into raw stage t % 2
        load_kv_tiles<BLOCK_N, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED>(
            k_raw + (t & 1) * K_ELEMS, v_raw + (t & 1) * V_ELEMS, in.k, in.v,
            n_lo + (long long)t * BLOCK_N, p, Sw128<BLOCK_N, 4>(), Sw128<BLOCK_N, 4>());
    };
    if (tiles > 0) request_kv(0);
    cp_async_commit();  // the first key tile
    // each warpgroup's 64 rows of Q and dO, split through registers meanwhile
    split_own_tiles<WARPGROUPS, HEAD_DIM, THREADS, ALIGNED>(q_s, in.q, p.q_s, p.seqlen_q - m0,
                                                            p.head_dim, sc.q);
    split_own_tiles<WARPGROUPS, HEAD_DIM_V, THREADS, ALIGNED>(do_s, in.dout, bp.dout_s,
                                                              p.seqlen_q - m0, p.head_dim_v,
                                                              sc.dout);
    cp_async_wait<0>();

    float lse_log2[2], dl[2];  // this lane's two rows
    load_row_stats(lse_log2, dl, in.lse, in.delta, bp, m_own, warp, lane);
    float dq[HEAD_DIM / 8][4];
    zero(dq);
    const unsigned q_base = smem_addr(q_s + wg * 2 * Q_ELEMS);  // this warpgroup's rows
    const unsigned do_base = smem_addr(do_s + wg * 2 * DO_ELEMS);
    const unsigned k_base = smem_addr(k_s), v_base = smem_addr(v_s);
    const ScoreConsts<float> consts(p);
    const float inv_qk[2] = {1.f / sc.q, 1.f / sc.k}, inv_dov[2] = {1.f / sc.dout, 1.f / sc.v};

    using Acc = float[BLOCK_N / 8][4];       // S, dP: queries x keys
    using Frag = unsigned[BLOCK_N / 16][4];  // dS as A fragments (hi or lo)
    auto k_tile = [&](int t) { return k_base + (OVERLAP ? t & 1 : 0) * 2 * K_ELEMS * 2; };
    auto v_tile = [&](int t) { return v_base + (OVERLAP ? t & 1 : 0) * 2 * V_ELEMS * 2; };
    // as in the dK/dV kernel: key tile t landed here; the next requested, t's tiles written
    auto prepare = [&](int t) {
        const int st = t & 1, buf = OVERLAP ? t & 1 : 0;
        __syncthreads();
        if (t + 1 < tiles) request_kv(t + 1);
        cp_async_commit();
        split_stacked16<BLOCK_N, HEAD_DIM, THREADS>(k_s + buf * 2 * K_ELEMS, k_raw + st * K_ELEMS,
                                                    sc.k);
        split_stacked16<BLOCK_N, HEAD_DIM_V, THREADS>(v_s + buf * 2 * V_ELEMS,
                                                      v_raw + st * V_ELEMS, sc.v);
        fence_proxy_async();  // visible to the tensor cores ...
        __syncthreads();      // ... once every thread has written its part
    };
    auto scores = [&](int t, Acc& s, Acc& dp) {  // S, dP of the prepared tile, as in dK/dV
        float s_w[2 * BLOCK_N / 8][4], dp_w[2 * BLOCK_N / 8][4];
        Acc s_y, dp_y;
        if (STAGGER && wg == 1) bar_sync(3, THREADS);  // warpgroup 0's are issued
        stacked_product_ss<BLOCK_N, HEAD_DIM, __half>(s_w, s_y, q_base, Q_ELEMS * 2, k_tile(t));
        stacked_product_ss<BLOCK_N, HEAD_DIM_V, __half>(dp_w, dp_y, do_base, DO_ELEMS * 2,
                                                        v_tile(t));
        wgmma_commit();
        if (STAGGER && wg == 0) bar_arrive(3, THREADS);
        wgmma_wait<0>();
        stacked_sum_unscaled(s, s_w, s_y, inv_qk[0], inv_qk[1]);
        stacked_sum_unscaled(dp, dp_w, dp_y, inv_dov[0], inv_dov[1]);
    };
    // S, dP of tile t done: dS, its split fragments, tile t's dQ issued
    auto grads = [&](int t, Acc& s, Acc& dp, Frag& ds_hi, Frag& ds_lo,
                     float (&dq_t)[HEAD_DIM / 8][4]) {
        const long long n0 = n_lo + (long long)t * BLOCK_N;
        const bool interior = !HAS_MASK && tile_is_interior(p, m_own, 64, n0, BLOCK_N);
        p_and_ds_tile<HAS_MASK, false>(s, dp, p, consts, m_own + warp * 16, n0, lane, interior,
                                       in.mask, in.bias, [&](int, int e) {
                                           return make_float2(lse_log2[e / 2], dl[e / 2]);
                                       });
        split_fragments<BLOCK_N>(ds_hi, ds_lo, dp, sc.ds);
        split_product_ra16<HEAD_DIM, BLOCK_N>(dq_t, ds_hi, ds_lo, k_tile(t));
        wgmma_commit();
    };

    dq_tiles<OVERLAP, BLOCK_N>(dq, tiles, prepare, scores, grads);
    cp_async_wait<0>();

    float* dq_out = reinterpret_cast<float*>(bp.dq) + batch_offset(bp.dq_s, b, p.batch1, p.batch2);
    scale_by(dq, 1.f / sc.ds, 1.f / sc.k);
    store_tile(dq, dq_out, bp.dq_s.row, bp.dq_s.col, m_own + warp * 16, p.seqlen_q, p.head_dim,
               lane, float(p.scale));
}
