// attention_sm90_tf32.cu -- float32 attention forward on Hopper's TF32 tensor cores
// (sm_90a: wgmma .tf32), precision="tf32" and, by the 3xTF32 split, "highest".
//
// Computes:   the same function as attention_mma_wide.cu with T = float (API.md semantics;
//             reference cuattn/reference.py::attention_reference). SPLIT = false
//             (precision="tf32"; yardstick naive_attention with the same roundings): the
//             operands of both products (q, k, P, v) are rounded to TF32 (to nearest,
//             cvt.rna) on chip. The instruction itself would truncate (it ignores the low 13
//             bits); truncating K missed the accuracy rule by up to 1.8x (docs/kernels.rst).
//             SPLIT = true (precision="highest"; yardstick plain float32): each operand x is
//             split into hi = tf32(x) and lo = x - hi (the instruction reads lo's top 19
//             bits), and every product is A_hi B_lo + A_lo B_hi + A_hi B_hi, the two small
//             terms first so that the accumulator's truncation happens on small partial
//             sums; P V of each key tile goes into fresh accumulators added to O in float32
//             (accumulating into O itself truncates O once per step and missed the accuracy
//             rule by 2x: docs/kernels.rst). Score transform and online softmax as the other
//             tensor-core forwards (mma_softmax.cuh), float32 throughout.
// Layout:     AttnParams (common.cuh) with element strides; ALIGNED instances need unit
//             column strides, 16-byte aligned rows and D, Dv multiples of 4 (checked in
//             Python); the others load element by element.
// Ownership:  a block of NUM_WG warpgroups owns BLOCK_M = 64 * NUM_WG query rows of one
//             batch entry and all Dv columns; warpgroup w owns rows 64w .. 64w + 63 and its
//             warp v rows 64w + 16v .. + 15 of every accumulator tile.
// Algorithm:  per tile of BLOCK_N keys: S = Q K^T by HEAD_DIM / 8 wgmma steps (Q, K in
//             shared memory, rounded to TF32 in place); while they run, the block
//             transposes the tile of V into V^T (TF32 takes both operands K-contiguous, and V
//             arrives key-major) with its keys at tf32_key_position (sm90_tiles.cuh), so that
//             P goes from the score accumulators into the A fragments of O += P V without
//             shuffles; then the softmax, and O += P V by BLOCK_N / 8 steps with P from
//             registers. K tiles arrive by cp.async one tile ahead into two stages, and each
//             thread rounds the chunks it copied itself while the P V steps run; a V tile
//             arrives into one staging buffer, requested as soon as the previous one is
//             transposed. Q as register fragments (S by the register form) was tried: ptxas
//             gave P's fragments the registers of the loop-invariant Q fragments without
//             restoring them (wrong results; docs/kernels.rst).
//             With K_STAGES = 1 (the split's D128 tiles, for shared memory) the next K tile
//             is requested as soon as every warpgroup's S product has read the current one.
// Shared mem: (BLOCK_M*HEAD_DIM*P + K_STAGES*P*BLOCK_N*HEAD_DIM + (1 + P)*BLOCK_N*HEAD_DIM_V)
//             * 4 bytes with P = 2 parts (hi, lo) when SPLIT, else 1: Q, K_STAGES stages of
//             K, the V staging tile and V^T, every tile in the 128-byte-swizzle layout of
//             wgmma (sm90_tiles.cuh) with 32-float column groups, each lo part right after its
//             hi part. cuattn/_dispatch.py::sm90_tf32_smem_bytes computes the same number.
// Template:   BiasT; HAS_MASK; HEAD_DIM, HEAD_DIM_V (64 or 128, zero-padded); BLOCK_N (32,
//             64 or 128); NUM_WG; SPLIT; K_STAGES (1 or 2); ALIGNED; MIN_BLOCKS.
#include "mma_softmax.cuh"
#include "sm90_tiles.cuh"

using namespace cuattn;
using namespace cuattn::mma;
using namespace cuattn::sm90;

namespace {

// V^T (HEAD_DIM_V rows, keys K-contiguous at tf32_key_position) from the staged V tile
// (BLOCK_N key rows), rounded to TF32; with SPLIT the remainders go to the lo tile that
// follows V^T (HEAD_DIM_V * BLOCK_N floats on). A warp moves 16 keys x 8 columns per step: lane
// (n = lane % 16, h = lane / 16) reads 4 columns of key n (one 16-byte load; eight
// consecutive keys hit eight distinct chunks) and writes them to 4 rows of V^T; rows
// 4h + e of the two half-warps differ in bit 2 of the swizzle, so the 32 scalar stores of
// a step hit 32 distinct banks.
template <int BLOCK_N, int HEAD_DIM_V, int THREADS, bool SPLIT>
__device__ __forceinline__ void transpose_v(float* vt, const float* vs) {
    constexpr int KEY_BLOCKS = BLOCK_N / 16, STEPS = KEY_BLOCKS * HEAD_DIM_V / 8;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n_in = lane % 16, h = lane / 16;
#pragma unroll 4
    for (int u = warp; u < STEPS; u += THREADS / 32) {
        const int n = (u % KEY_BLOCKS) * 16 + n_in, c = (u / KEY_BLOCKS) * 8 + 4 * h;
        const float4 x = *reinterpret_cast<const float4*>(vs + Sw128<BLOCK_N, 4>()(n, c));
        const int pos = tf32_key_position(n);
        auto put = [&](int col, float value) {
            const int at = Sw128<HEAD_DIM_V, 4>()(col, pos);
            if constexpr (SPLIT) {
                float h, l;
                split_tf32(value, h, l);
                vt[at] = h;
                vt[HEAD_DIM_V * BLOCK_N + at] = l;
            } else {
                vt[at] = __uint_as_float(to_tf32(value));
            }
        };
        put(c, x.x);
        put(c + 1, x.y);
        put(c + 2, x.z);
        put(c + 3, x.w);
    }
}

}  // namespace

template <typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N, int NUM_WG,
          bool SPLIT, int K_STAGES, bool ALIGNED, int MIN_BLOCKS>
__global__ void __launch_bounds__(NUM_WG * 128, MIN_BLOCKS)
    attention_fwd_sm90_tf32(const AttnParams p) {
    constexpr int THREADS = NUM_WG * 128, BLOCK_M = 64 * NUM_WG, DV_TILES = HEAD_DIM_V / 8;
    static_assert((HEAD_DIM == 64 || HEAD_DIM == 128) && (HEAD_DIM_V == 64 || HEAD_DIM_V == 128) &&
                      (BLOCK_N == 32 || BLOCK_N == 64 || BLOCK_N == 128),
                  "wgmma shapes of wgmma.cuh");
    static_assert(K_STAGES == 1 || K_STAGES == 2, "one or two K stages");
    constexpr int PARTS = SPLIT ? 2 : 1;  // hi (and lo) of every operand tile
    constexpr int Q_ELEMS = 64 * HEAD_DIM, K_ELEMS = BLOCK_N * HEAD_DIM, V_ELEMS = BLOCK_N * HEAD_DIM_V;
    // a K stage is one tile of K_ROWS rows: with SPLIT the lo rows follow the hi rows, so
    // that Q_hi [K_hi; K_lo]^T is one product
    constexpr int K_ROWS = PARTS * BLOCK_N;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    float* q_s = reinterpret_cast<float*>(smem_raw);  // [NUM_WG][PARTS][64 x HEAD_DIM]
    float* k_s = q_s + NUM_WG * PARTS * Q_ELEMS;      // [K_STAGES][K_ROWS x HEAD_DIM]
    float* v_s = k_s + K_STAGES * PARTS * K_ELEMS;    // [BLOCK_N x HEAD_DIM_V], as stored
    float* vt_s = v_s + V_ELEMS;                      // [PARTS][HEAD_DIM_V x BLOCK_N], transposed

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
    // this block's rows and batch entry, heaviest query blocks first (common.cuh)
    const ForwardBlock<float, BiasT> blk = forward_block<float, BiasT>(p, BLOCK_M);
    const long long b = blk.b, m0 = blk.m0;
    const float *q = blk.q, *k = blk.k, *v = blk.v;
    const unsigned char* mask = blk.mask;
    const BiasT* bias = blk.bias;

    // sequence positions fit in 32 bits (checked in Python)
    const int seqlen_q = (int)p.seqlen_q, seqlen_k = (int)p.seqlen_k;
    const int off = seqlen_k - seqlen_q;
    const int m_last = min((int)m0 + BLOCK_M, seqlen_q) - 1;
    const Range keys = key_band(p, m0, m_last, BLOCK_N);
    const int n_lo = (int)keys.lo, n_hi = (int)keys.hi;

    auto request_k = [&](int n0, int stage) {
        load_tile<BLOCK_N, HEAD_DIM, THREADS, ALIGNED>(k_s + stage * K_ROWS * HEAD_DIM, k + n0 * p.k_s.row,
                                                       p.k_s.row, p.k_s.col, p.seqlen_k - n0,
                                                       p.head_dim, Sw128<K_ROWS, 4>());
    };
    auto request_v = [&](int n0) {
        load_tile<BLOCK_N, HEAD_DIM_V, THREADS, ALIGNED>(v_s, v + n0 * p.v_s.row, p.v_s.row,
                                                         p.v_s.col, p.seqlen_k - n0,
                                                         p.head_dim_v, Sw128<BLOCK_N, 4>());
    };
    auto round_own_k = [&](float* tile) {  // lo rows BLOCK_N rows (of 32 floats) further on
        round_own_tf32<BLOCK_N, HEAD_DIM, THREADS, ALIGNED, SPLIT, BLOCK_N * 32>(
            tile, Sw128<K_ROWS, 4>());
    };
    // each warpgroup's 64 rows of Q form one 64-row tile; Q and the first K tile are one
    // group, rounded to TF32 in place as soon as they land
#pragma unroll
    for (int w = 0; w < NUM_WG; ++w)
        load_tile<64, HEAD_DIM, THREADS, ALIGNED>(q_s + w * PARTS * Q_ELEMS, q + w * 64 * p.q_s.row,
                                                  p.q_s.row, p.q_s.col, p.seqlen_q - m0 - w * 64,
                                                  p.head_dim, Sw128<64, 4>());
    if (n_lo < n_hi) request_k(n_lo, 0);
    cp_async_commit();
    if (n_lo < n_hi) request_v(n_lo);
    cp_async_commit();
    cp_async_wait<1>();
    if (n_lo < n_hi) round_own_k(k_s);
#pragma unroll
    for (int w = 0; w < NUM_WG; ++w)
        round_own_tf32<64, HEAD_DIM, THREADS, ALIGNED, SPLIT, Q_ELEMS>(q_s + w * PARTS * Q_ELEMS,
                                                                    Sw128<64, 4>());

    float o[DV_TILES][4], m[2], l[2];
    m[0] = m[1] = neg_inf<float>();
    l[0] = l[1] = 0.f;
#pragma unroll
    for (int d = 0; d < DV_TILES; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[d][e] = 0.f;
    const SoftmaxExp2<float> exp2_fn(lane);

    const unsigned q_base = smem_addr(q_s + wg * PARTS * Q_ELEMS), k_base = smem_addr(k_s),
                   vt_base = smem_addr(vt_s);
    // byte distances from a hi tile to its lo tile
    constexpr unsigned Q_LO = Q_ELEMS * 4, VT_LO = V_ELEMS * 4;
    const int row0 = (int)m0 + 64 * wg + 16 * (warp % 4);  // first row of this warp's tile

    int stage = 0;
    for (int n0 = n_lo; n0 < n_hi; n0 += BLOCK_N, stage = (stage + 1) % K_STAGES) {
        const bool more = n0 + BLOCK_N < n_hi;
        const int next = (stage + 1) % K_STAGES;
        if (K_STAGES == 2 && more) request_k(n0 + BLOCK_N, next);
        cp_async_commit();    // (empty with one K stage)
        cp_async_wait<1>();   // all but the group just committed have landed ...
        fence_proxy_async();  // ... are visible to the tensor cores (with the rounded K) ...
        __syncthreads();      // ... for every thread: this K tile and the staged V tile

        // S = Q K^T, both operands K-contiguous in shared memory; V^T while it runs. SPLIT:
        // [Q_hi K_hi^T | Q_hi K_lo^T] by one product, Q_lo K_hi^T by another, each term in
        // its own accumulators (then summed in float32, the small terms first)
        float s[BLOCK_N / 8][4];
        float s_wide[SPLIT ? 2 * BLOCK_N / 8 : 1][4];
        const unsigned k_tile = k_base + stage * K_ROWS * HEAD_DIM * 4;
        wgmma_fence();
        if constexpr (SPLIT) {
            product_ss<2 * BLOCK_N, HEAD_DIM, float>(s_wide, q_base, k_tile);
            product_ss<BLOCK_N, HEAD_DIM, float, 2 * BLOCK_N>(s, q_base + Q_LO, k_tile);
        } else {
            product_ss<BLOCK_N, HEAD_DIM, float>(s, q_base, k_tile);
        }
        wgmma_commit();
        transpose_v<BLOCK_N, HEAD_DIM_V, THREADS, SPLIT>(vt_s, v_s);
        wgmma_wait<0>();
        if constexpr (SPLIT) {
#pragma unroll
            for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[j][e] = s_wide[j][e] + (s_wide[BLOCK_N / 8 + j][e] + s[j][e]);
        }
        if constexpr (K_STAGES == 1) {
            __syncthreads();  // every warpgroup's S has read the K tile: refill it
            if (more) request_k(n0 + BLOCK_N, 0);
            cp_async_commit();
        }

        const bool interior = !HAS_MASK && forward_tile_interior<BLOCK_M, BLOCK_N>(
                                               p, m0, m_last, n0, seqlen_q, seqlen_k, off);
        const float scale = mask_scores<BLOCK_N, HAS_MASK>(s, p, row0, n0, lane, interior, mask, bias);
        update_row_state<BLOCK_N, DV_TILES>(s, m, l, o, scale, exp2_fn);

        fence_proxy_async();  // V^T, written by every thread, visible to the tensor cores
        __syncthreads();      // ... and the staging buffer free for the next V tile
        if (more) request_v(n0 + BLOCK_N);
        cp_async_commit();

        // O += P V: P from registers (keys permuted), V^T K-contiguous in the same order.
        // SPLIT: this tile's P V in fresh accumulators, the small terms first, then added
        unsigned p_frag[BLOCK_N / 8][4], p_lo[SPLIT ? BLOCK_N / 8 : 1][4];
        float pv[SPLIT ? DV_TILES : 1][4];  // read by the tensor cores until the wait below
        if constexpr (SPLIT) {
            tf32_split_fragments<BLOCK_N>(p_frag, p_lo, s);
            product_rs_tf32<HEAD_DIM_V, BLOCK_N>(pv, p_frag, vt_base + VT_LO, false);
            product_rs_tf32<HEAD_DIM_V, BLOCK_N, false>(pv, p_lo, vt_base, true);
            product_rs_tf32<HEAD_DIM_V, BLOCK_N, false>(pv, p_frag, vt_base, true);
        } else {
            tf32_fragments<BLOCK_N>(p_frag, s);
            product_rs_tf32<HEAD_DIM_V, BLOCK_N>(o, p_frag, vt_base, true);
        }
        wgmma_commit();
        if (more) {  // while it runs: round the next K tile (landed: only V is younger)
            cp_async_wait<1>();
            round_own_k(k_s + next * K_ROWS * HEAD_DIM);
        }
        wgmma_wait<0>();
        if constexpr (SPLIT) {
#pragma unroll
            for (int d = 0; d < DV_TILES; ++d)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[d][e] += pv[d][e];
        }
        // no barrier here: V^T is rewritten only after the next iteration's first barrier,
        // which every thread reaches after its own P V, and the K stage refilled next was
        // read by the S before this iteration's second barrier
    }
    cp_async_wait<0>();  // no copy may outlive the block

    store_rows<float, DV_TILES>(o, l, m, p, b, row0, lane);  // normalise and store
}
