// attention_sm90_3xf16.cu -- float32 attention forward for precision="highest" on Hopper's
// float16 tensor cores (sm_90a: wgmma .f16): the 3xTF32 split carried by scaled float16
// operands (split16.cuh), the forward of the sm90_3xf16 backward.
//
// Computes:   the float32 attention forward (reference
//             cuattn/reference.py::attention_reference; yardstick plain float32):
//             S = [Q_hi K_hi^T | Q_hi K_lo^T] and Q_lo K_hi^T summed hh + (hl + lh) with the
//             scales taken out -- the calls and order of the sm90_3xf16 dQ kernel, so that
//             the backward recomputes the same products summed the same way and P = exp(S -
//             lse) carries no difference between two roundings (scores formed otherwise, by
//             TF32 products say, differ in the tensor cores' rounding, which the gradients
//             show once the logits grow); the score transform and online softmax of the
//             tensor-core forwards (mma_softmax.cuh); O += P V by the split, each key tile's
//             P V into fresh accumulators (small terms first) added to O in float32.
// Scales:     per batch entry, from attention_fwd_magnitudes (the largest finite |q|, |k|,
//             |v|; the backward finds the same for q and k); P (<= 2^8 here) by 2^7.
// Ownership:  a block of NUM_WG warpgroups owns BLOCK_M = 64 * NUM_WG query rows of one
//             batch entry and all Dv columns; warpgroup w owns rows 64w .. 64w + 63 and its
//             warp v rows 64w + 16v .. + 15 of every accumulator tile.
// Algorithm:  Q split once (from global memory through registers); K and V tiles of BLOCK_N
//             keys arrive raw (float) by cp.async one tile ahead into two stages; per tile,
//             after a barrier, the block writes their stacked split tiles (the next tile is
//             requested first), then S, the softmax, and P V with P's split fragments from
//             registers and V read N-contiguous (no transposed copy).
// Shared mem: (NUM_WG*2*64*HEAD_DIM + 2*BLOCK_N*(HEAD_DIM+HEAD_DIM_V)) * 2
//             + 2*BLOCK_N*(HEAD_DIM+HEAD_DIM_V) * 4 bytes: Q (hi, lo; per warpgroup), the
//             stacked split K and V tiles, two raw stages of K and V;
//             the layout: FwdSplit16Smem (layouts.cuh, from cuattn/families/sm90_3xf16.py).
// Template:   BiasT; HAS_MASK; HEAD_DIM, HEAD_DIM_V (64 or 128, zero-padded); BLOCK_N (32 or
//             64); NUM_WG (1 or 2); ALIGNED; MIN_BLOCKS.
#include "common/mma_softmax.cuh"
#include "sm90/split16.cuh"

using namespace cuattn;
using namespace cuattn::mma;
using namespace cuattn::sm90;
using namespace cuattn::split16;

// The largest magnitudes of q, k and v per batch entry (magnitudes_of_rows; p.num_m_blocks:
// chunks of MAG_ROWS rows per entry)
__global__ void __launch_bounds__(MAG_THREADS) attention_fwd_magnitudes(const AttnParams p) {
    magnitudes_of_rows(p, 0, p.q_s, (unsigned)p.num_m_blocks);
}

template <typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N, int NUM_WG,
          bool ALIGNED, int MIN_BLOCKS>
__global__ void __launch_bounds__(NUM_WG * 128, MIN_BLOCKS)
    attention_fwd_sm90_3xf16(const AttnParams p) {
    constexpr int THREADS = NUM_WG * 128, BLOCK_M = 64 * NUM_WG, DV_TILES = HEAD_DIM_V / 8;
    static_assert((HEAD_DIM == 64 || HEAD_DIM == 128) && (HEAD_DIM_V == 64 || HEAD_DIM_V == 128) &&
                      (BLOCK_N == 32 || BLOCK_N == 64) && (NUM_WG == 1 || NUM_WG == 2),
                  "wgmma shapes of wgmma.cuh");
    constexpr int Q_ELEMS = 64 * HEAD_DIM, K_ELEMS = BLOCK_N * HEAD_DIM, V_ELEMS = BLOCK_N * HEAD_DIM_V;

    using L = FwdSplit16Smem<HEAD_DIM, HEAD_DIM_V, NUM_WG, BLOCK_N>;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __half* q_s = reinterpret_cast<__half*>(smem_raw + L::q_s);  // [NUM_WG][hi, lo][64 x D]
    __half* k_s = reinterpret_cast<__half*>(smem_raw + L::k_s);  // [2 BLOCK_N x D]: hi; lo rows
    __half* v_s = reinterpret_cast<__half*>(smem_raw + L::v_s);  // [2 BLOCK_N x HEAD_DIM_V]
    float* k_raw = reinterpret_cast<float*>(smem_raw + L::k_raw);  // [2 stages][BLOCK_N x D]
    float* v_raw = reinterpret_cast<float*>(smem_raw + L::v_raw);  // [2 stages][BLOCK_N x Dv]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
    // this block's rows and batch entry, heaviest query blocks first (common.cuh)
    const ForwardBlock<float, BiasT> blk = forward_block<float, BiasT>(p, BLOCK_M);
    const long long b = blk.b, m0 = blk.m0;
    const float *q = blk.q, *k = blk.k, *v = blk.v;
    const unsigned char* mask = blk.mask;
    const BiasT* bias = blk.bias;
    const SplitScales sc(p, b);

    // sequence positions fit in 32 bits (checked in Python)
    const int seqlen_q = (int)p.seqlen_q, seqlen_k = (int)p.seqlen_k;
    const int off = seqlen_k - seqlen_q;
    const int m_last = min((int)m0 + BLOCK_M, seqlen_q) - 1;
    const Range keys = key_band(p, m0, m_last, BLOCK_N);
    const long long n_lo = keys.lo, n_hi = keys.hi;
    const int tiles = n_lo < n_hi ? (int)((n_hi - n_lo + BLOCK_N - 1) / BLOCK_N) : 0;

    auto request_kv = [&](int t) {  // key tile t into raw stage t % 2
        load_kv_tiles<BLOCK_N, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED>(
            k_raw + (t & 1) * K_ELEMS, v_raw + (t & 1) * V_ELEMS, k, v,
            n_lo + (long long)t * BLOCK_N, p, Sw128<BLOCK_N, 4>(), Sw128<BLOCK_N, 4>());
    };
    if (tiles > 0) request_kv(0);
    cp_async_commit();  // the first key tile
    // each warpgroup's 64 rows of Q, split through registers meanwhile
    split_own_tiles<NUM_WG, HEAD_DIM, THREADS, ALIGNED>(q_s, q, p.q_s, p.seqlen_q - m0,
                                                        p.head_dim, sc.q);
    cp_async_wait<0>();

    float acc[DV_TILES][4], m[2], l[2];
    clear_row_state(acc, m, l);
    const SoftmaxExp2<float> exp2_fn(lane);
    const unsigned q_base = smem_addr(q_s + wg * 2 * Q_ELEMS);  // this warpgroup's rows
    const unsigned k_base = smem_addr(k_s), v_base = smem_addr(v_s);
    const float inv_qk[2] = {1.f / sc.q, 1.f / sc.k};
    // P = exp2(s - m) <= 2^8 here (RESCALE_SLACK, mma_softmax.cuh: m may trail the row's
    // max by up to 8), so P takes 2^7, not the backward's 2^15 (P <= 1 there)
    constexpr float FWD_P_SCALE = 128.f;
    const float pv_unscale = 1.f / (FWD_P_SCALE * sc.v);  // a power of two
    const int row0 = (int)m0 + 64 * wg + 16 * (warp % 4);  // first row of this warp's tile

    // key tile t landed here: once it has for every thread (and every warpgroup is done
    // with the split tiles of t - 1), the next is requested and t's split tiles written
    auto prepare = [&](int t) {
        const int st = t & 1;
        __syncthreads();
        if (t + 1 < tiles) request_kv(t + 1);
        cp_async_commit();
        split_stacked16<BLOCK_N, HEAD_DIM, THREADS>(k_s, k_raw + st * K_ELEMS, sc.k);
        split_stacked16<BLOCK_N, HEAD_DIM_V, THREADS>(v_s, v_raw + st * V_ELEMS, sc.v);
        fence_proxy_async();  // visible to the tensor cores ...
        __syncthreads();      // ... once every thread has written its part
    };

    if (tiles > 0) prepare(0);
    for (int t = 0; t < tiles; ++t) {
        const int n0 = (int)(n_lo + (long long)t * BLOCK_N);
        // S as the sm90_3xf16 dQ kernel forms it (the same calls, the same order)
        float s[BLOCK_N / 8][4];
        {
            float s_w[2 * BLOCK_N / 8][4], s_y[BLOCK_N / 8][4];
            stacked_product_ss<BLOCK_N, HEAD_DIM, __half>(s_w, s_y, q_base, Q_ELEMS * 2, k_base);
            wgmma_commit();
            wgmma_wait<0>();
            stacked_sum_unscaled(s, s_w, s_y, inv_qk[0], inv_qk[1]);
        }
        const bool interior = !HAS_MASK && forward_tile_interior<BLOCK_M, BLOCK_N>(
                                               p, m0, m_last, n0, seqlen_q, seqlen_k, off);
        const float scale = mask_scores<BLOCK_N, HAS_MASK>(s, p, row0, n0, lane, interior, mask, bias);
        update_row_state<BLOCK_N, DV_TILES>(s, m, l, acc, scale, exp2_fn);

        // this tile's P V in fresh accumulators by the split, then added to O
        unsigned p_hi[BLOCK_N / 16][4], p_lo[BLOCK_N / 16][4];
        float pv[DV_TILES][4];  // read by the tensor cores until the wait below
        split_fragments<BLOCK_N>(p_hi, p_lo, s, FWD_P_SCALE);
        split_product_ra16<HEAD_DIM_V, BLOCK_N>(pv, p_hi, p_lo, v_base);
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int d = 0; d < DV_TILES; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[d][e] = fmaf(pv[d][e], pv_unscale, acc[d][e]);
        if (t + 1 < tiles) {
            cp_async_wait<0>();  // tile t + 1 (requested by prepare(t)) has landed
            prepare(t + 1);
        }
    }
    cp_async_wait<0>();  // no copy may outlive the block

    store_rows<float, DV_TILES>(acc, l, m, p, b, row0, lane);  // normalise and store
}
