// attention_backward_sm90_tf32.cu -- float32 attention backward for precision="highest" on
// Hopper's TF32 tensor cores (sm_90a: wgmma .tf32), every product by the 3xTF32 split.
//
// Computes:   the gradients of attention_backward_mma_f32.cu with SPLIT (API.md semantics;
//             reference cuattn/reference.py::attention_backward_reference), with the same
//             two kernels after delta (backward.cuh) and the same element-wise rule
//             (p_and_ds_tile); the products run as warpgroup MMAs. Each operand x is split
//             into hi = tf32(x) (to nearest) and lo = x - hi, and every product is
//             A_hi B_hi + A_hi B_lo + A_lo B_hi. In the score products (S, dP) the small
//             terms accumulate apart from hi.hi and join it in float32 (S as the sm90_3xtf32
//             forward forms it: stacked_product_ss); the gradient products of each tile (one
//             query tile for dK/dV, one key tile for dQ) go into fresh accumulators, the
//             small terms first, that are added to the running gradient in float32, since
//             the tensor cores' accumulation truncates (tools/emulate_3xtf32.py --backward:
//             in place 1.30x the accuracy bound, fresh 0.83x; a hi part that the
//             instruction truncates instead of one rounded to nearest 1.54x).
// Operands:   TF32 wgmma reads both shared-memory operands K-contiguous (no transposed
//             descriptors for 32-bit types). S^T = K Q^T and dP^T = V dO^T (dK/dV), S = Q K^T
//             and dP = dO V^T (dQ) read their tiles as stored; dV += P^T dO, dK += dS^T Q and
//             dQ += dS K take P^T, dS^T and dS from registers as A (tf32_split_fragments:
//             the contraction permuted within groups of eight) and need dO^T, Q^T and K^T as
//             B, with the contraction (queries, keys) at tf32_key_position. Each streamed tile
//             arrives raw by cp.async into one of two stages; after a barrier the block
//             writes its split tile (hi rows, then lo rows: the score products read
//             [X_hi; X_lo] as one B operand of twice the width) and its transposed split
//             tiles (transpose_v, sm90_tiles.cuh, which the forward uses for V^T), so no
//             scratch in global memory is needed.
// Kernels:    attention_bwd_dkdv_sm90_3xtf32: each warpgroup owns 64 keys (warp w: keys 16w
//             .. 16w + 15 of them) and all columns of dK and dV, K and V split once; the block
//             walks the query tiles (BLOCK_M rows) of its keys' band.
//             attention_bwd_dq_sm90_3xtf32: each warpgroup owns 64 query rows and all columns
//             of dQ, Q and dO split once; the block walks the key tiles (BLOCK_N keys).
//             With WARPGROUPS = 2 the two warpgroups share each streamed tile (its split and
//             transposed tiles are written once for both, by all 256 threads) and the SM has
//             two warpgroups whose latencies overlap (one block per SM either way).
//             Each gradient element is written once by one thread: no atomics, repeated
//             calls are bit-identical.
// Template:   BiasT; HAS_MASK; HEAD_DIM, HEAD_DIM_V (64, zero-padded: the shared memory of
//             the split tiles); the tile of the other sequence (BLOCK_M for dK/dV: 32;
//             BLOCK_N for dQ: 32 or 64: a transposed tile fills whole 128-byte rows); ALIGNED
//             (16-byte cp.async copies: unit column strides, 16-byte rows and pointers;
//             otherwise element loads); MIN_BLOCKS; OVERLAP (the next tile is split and
//             transposed while the tensor cores run this tile's gradient products: two
//             buffers of the transposed tiles); WARPGROUPS (1, or 2 without OVERLAP for
//             dK/dV and at BLOCK_N = 32 for dQ: shared memory). Gradients are float32.
// Schedule:   per tile t (both kernels): S and dP (S^T and dP^T) by the split, wait, sum; the
//             element-wise pass, the fragments and the gradient products issued into fresh
//             accumulators; then either (plain) wait, add, and prepare tile t + 1 -- a
//             barrier, the request of tile t + 2's raw tiles into the stage that tile t used,
//             the split and transposed tiles of t + 1, a proxy fence and a barrier -- or
//             (OVERLAP) prepare t + 1 first and wait and add after.
// Shared mem: dK/dV: (2*64*W*(HEAD_DIM+HEAD_DIM_V) + (4+2*B)*BLOCK_M*(HEAD_DIM+HEAD_DIM_V)
//             + 2*2*BLOCK_M)*4 bytes: K and V (hi, lo; per warpgroup), two raw stages of Q and
//             dO, their stacked split tiles (hi; lo) and B buffers of their transposed split
//             tiles;
//             dQ: (2*64*W*(HEAD_DIM+HEAD_DIM_V) + 4*BLOCK_N*(HEAD_DIM+HEAD_DIM_V)
//             + 2*B*BLOCK_N*HEAD_DIM)*4 bytes: Q and dO (hi, lo; per warpgroup), two raw
//             stages of K and V, their stacked split tiles and B buffers of the transposed
//             split K;
//             B = 2 with OVERLAP, else 1; W = WARPGROUPS. Every tile in the 128-byte-swizzle
//             layout (sm90_tiles.cuh) with 32-float column groups, each lo tile right after
//             its hi tile (the streamed split tiles: lo rows after hi rows, one tile).
//             cuattn/_dispatch.py::sm90_f32_backward_smem_bytes computes the same numbers.
#include "backward.cuh"
#include "sm90_tiles.cuh"

using namespace cuattn;
using namespace cuattn::mma;
using namespace cuattn::sm90;

namespace {

// The split of a ROWS x COLS raw tile (laid out by Sw128<ROWS, 4>) into one stacked tile of
// 2 ROWS rows (Sw128<2 ROWS, 4>): hi in rows 0 .. ROWS - 1, lo in rows ROWS .. 2 ROWS - 1,
// so that one product reads [X_hi; X_lo] as a B operand of twice the width (as the
// sm90_3xtf32 forward's K stages). The block's threads take 16-byte chunks in load_tile's
// order; a raw chunk in 32-column group g lands g group-heights of ROWS rows further on.
template <int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void split_stacked(float* dst, const float* raw) {
    constexpr int GROUP = ROWS * 32;  // floats of one raw column group
    static_assert((GROUP & (GROUP - 1)) == 0, "a power-of-two group");
    for_own_chunks<ROWS, COLS, THREADS, true, float>(Sw128<ROWS, 4>(), [&](int off) {
        const float4 x = *reinterpret_cast<const float4*>(raw + off);
        float4 h, l;
        split_tf32(x, h, l);
        const int at = off + (off & ~(GROUP - 1));  // group g: g * 2 GROUP + the same row, chunk
        *reinterpret_cast<float4*>(dst + at) = h;
        *reinterpret_cast<float4*>(dst + at + GROUP) = l;
    });
}

// acc (64 x N) = X Z by the split, X given as its hi and lo A fragments
// (tf32_split_fragments) and Z^T the N-row tile z_tile (lo z_lo bytes on), K-contiguous in
// the fragments' order. Fences and issues; the caller commits, waits and keeps the fragments
// until then.
template <int N, int CONTRACT>
__device__ __forceinline__ void split_product_rs(float (&acc)[N / 8][4],
                                                 const unsigned (&hi)[CONTRACT / 8][4],
                                                 const unsigned (&lo)[CONTRACT / 8][4],
                                                 unsigned z_tile, unsigned z_lo) {
    product_rs_tf32<N, CONTRACT>(acc, hi, z_tile + z_lo, false);
    product_rs_tf32<N, CONTRACT, false>(acc, lo, z_tile, true);
    product_rs_tf32<N, CONTRACT, false>(acc, hi, z_tile, true);
}

// A block's stationary operands (dK/dV: K and V; dQ: Q and dO), 64 rows per warpgroup:
// warpgroup g's rows g * 64 .. of a (b) into a split tile of its own at a_s (b_s) + g * 2 *
// 64 * HEAD_DIM (HEAD_DIM_V) floats, hi then lo, for the tensor cores' A operand. `rows`
// rows are left from a's and b's first; every thread of the block copies, and a warpgroup
// past the last row gets zeros and reads nothing (its source is the first row).
// load_own_tiles requests the copies; split_own_tiles, once they have landed, splits the
// chunks each thread copied itself (no barrier between).
template <int WARPGROUPS, int HEAD_DIM, int HEAD_DIM_V, int THREADS, bool ALIGNED>
__device__ __forceinline__ void load_own_tiles(float* a_s, float* b_s, const float* a,
                                               const Strides& a_str, const float* b,
                                               const Strides& b_str, long long rows,
                                               long long a_cols, long long b_cols) {
#pragma unroll
    for (int g = 0; g < WARPGROUPS; ++g) {
        const long long left = rows - 64 * g, at = left > 0 ? 64 * g : 0;
        load_tile<64, HEAD_DIM, THREADS, ALIGNED>(a_s + g * 2 * 64 * HEAD_DIM, a + at * a_str.row,
                                                  a_str.row, a_str.col, left, a_cols,
                                                  Sw128<64, 4>());
        load_tile<64, HEAD_DIM_V, THREADS, ALIGNED>(b_s + g * 2 * 64 * HEAD_DIM_V,
                                                    b + at * b_str.row, b_str.row, b_str.col,
                                                    left, b_cols, Sw128<64, 4>());
    }
}

template <int WARPGROUPS, int HEAD_DIM, int HEAD_DIM_V, int THREADS, bool ALIGNED>
__device__ __forceinline__ void split_own_tiles(float* a_s, float* b_s) {
    constexpr int A_ELEMS = 64 * HEAD_DIM, B_ELEMS = 64 * HEAD_DIM_V;
#pragma unroll
    for (int g = 0; g < WARPGROUPS; ++g) {
        round_own_tf32<64, HEAD_DIM, THREADS, ALIGNED, true, A_ELEMS>(a_s + g * 2 * A_ELEMS,
                                                                      Sw128<64, 4>());
        round_own_tf32<64, HEAD_DIM_V, THREADS, ALIGNED, true, B_ELEMS>(b_s + g * 2 * B_ELEMS,
                                                                        Sw128<64, 4>());
    }
}

template <int N>
__device__ __forceinline__ void add_into(float (&acc)[N][4], const float (&x)[N][4]) {
#pragma unroll
    for (int d = 0; d < N; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[d][e] += x[d][e];
}

}  // namespace

template <typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, bool ALIGNED,
          int MIN_BLOCKS, bool OVERLAP, int WARPGROUPS>
__global__ void __launch_bounds__(128 * WARPGROUPS, MIN_BLOCKS)
    attention_bwd_dkdv_sm90_3xtf32(const AttnBwdParams bp) {
    constexpr int THREADS = 128 * WARPGROUPS, BLOCK_N = 64 * WARPGROUPS;  // 64 keys a warpgroup
    // BLOCK_M = 16 would leave half of each 128-byte row of Q^T and dO^T unused (their lo
    // tiles would need 128-row spacing); 64 does not fit (registers, shared memory)
    static_assert(HEAD_DIM == 64 && HEAD_DIM_V == 64 && BLOCK_M == 32 &&
                      (WARPGROUPS == 1 || (WARPGROUPS == 2 && !OVERLAP)),
                  "the shared memory of the split tiles");
    constexpr int K_ELEMS = 64 * HEAD_DIM, V_ELEMS = 64 * HEAD_DIM_V;  // one warpgroup's keys
    constexpr int Q_ELEMS = BLOCK_M * HEAD_DIM, DO_ELEMS = BLOCK_M * HEAD_DIM_V;
    constexpr int T_BUFS = OVERLAP ? 2 : 1;  // transposed tiles: one per tile in flight
    const AttnParams& p = bp.f;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    float* k_s = reinterpret_cast<float*>(smem_raw);  // [WARPGROUPS][hi, lo][64 x HEAD_DIM]
    float* v_s = k_s + WARPGROUPS * 2 * K_ELEMS;       // [WARPGROUPS][hi, lo][64 x HEAD_DIM_V]
    float* q_raw = v_s + WARPGROUPS * 2 * V_ELEMS;     // [2 stages][BLOCK_M x HEAD_DIM]
    float* do_raw = q_raw + 2 * Q_ELEMS;               // [2 stages][BLOCK_M x HEAD_DIM_V]
    float* q_s = do_raw + 2 * DO_ELEMS;                // [2 BLOCK_M x HEAD_DIM]: hi; lo rows
    float* do_s = q_s + 2 * Q_ELEMS;                   // [2 BLOCK_M x HEAD_DIM_V]: hi; lo rows
    float* qt_s = do_s + 2 * DO_ELEMS;                 // [T_BUFS][hi, lo][HEAD_DIM x BLOCK_M]
    float* dot_s = qt_s + T_BUFS * 2 * Q_ELEMS;        // [T_BUFS][hi, lo][HEAD_DIM_V x BLOCK_M]
    float* lse_s = dot_s + T_BUFS * 2 * DO_ELEMS;      // [2 stages][BLOCK_M], log2 units
    float* delta_s = lse_s + 2 * BLOCK_M;              // [2 stages][BLOCK_M]

    // warpgroup wg owns keys n0 + 64 wg .. + 63 (its warp w: 16 w .. 16 w + 15 of them)
    const int wg = WARPGROUPS == 1 ? 0 : threadIdx.x / 128, lane = threadIdx.x % 32;
    const int warp = WARPGROUPS == 1 ? threadIdx.x / 32 : threadIdx.x / 32 % 4;
    // heaviest key blocks first: under causal masking the first keys are seen by the most rows
    const BlockCoords blk = block_coords(bp.num_row_blocks, bp.num_col_tiles,
                                         bp.f.window_left >= 0 || bp.f.window_right >= 0, false);
    const long long n_block = blk.row_block, b = blk.b;
    const long long n0 = n_block * BLOCK_N, n_own = n0 + 64 * wg;

    const BackwardInputs<float, float, BiasT> in(bp, b);  // batch entry b (backward.cuh)
    const float *q = in.q, *k = in.k + n0 * p.k_s.row;
    const float *v = in.v + n0 * p.v_s.row, *dout = in.dout;
    const float *lse = in.lse, *delta = in.delta;

    const long long n_last = min(n0 + BLOCK_N, p.seqlen_k) - 1;
    const Range queries = query_band(p, n0, n_last, BLOCK_M);
    const long long m_lo = queries.lo, m_hi = queries.hi;
    const int tiles = m_lo < m_hi ? (int)((m_hi - m_lo + BLOCK_M - 1) / BLOCK_M) : 0;

    // each warpgroup's 64 keys of K and V
    load_own_tiles<WARPGROUPS, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED>(
        k_s, v_s, k, p.k_s, v, p.v_s, p.seqlen_k - n0, p.head_dim, p.head_dim_v);
    // Q and dO of query tile t into raw stage t % 2 by cp.async, and its lse (log2 units)
    // and delta. Two warpgroups: lse and delta from the registers that were loaded one
    // request earlier, then tile t + 1's into them (no warp waits on those loads before the
    // next request; one warpgroup keeps the plain loads: the registers would spill its
    // overlapped form)
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
    cp_async_commit();  // K, V and the first query tile
    cp_async_wait<0>();
    split_own_tiles<WARPGROUPS, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED>(k_s, v_s);

    float dk[HEAD_DIM / 8][4], dv[HEAD_DIM_V / 8][4];
    zero(dk);
    zero(dv);
    const unsigned k_base = smem_addr(k_s + wg * 2 * K_ELEMS);  // this warpgroup's keys
    const unsigned v_base = smem_addr(v_s + wg * 2 * V_ELEMS);
    const unsigned q_base = smem_addr(q_s), do_base = smem_addr(do_s);
    const unsigned qt_base = smem_addr(qt_s), dot_base = smem_addr(dot_s);
    const ScoreConsts<float> consts(p);

    using Acc = float[BLOCK_M / 8][4];      // S^T, dP^T: keys x queries
    using Frag = unsigned[BLOCK_M / 8][4];  // P^T, dS^T as A fragments (hi or lo)
    // tile t's raw stage has landed for this thread: once it has for every thread (and every
    // thread is done with the tiles that the writes below replace), the next tile is
    // requested into the other stage and tile t's split and transposed split tiles written
    auto prepare = [&](int t) {
        const int st = t & 1, buf = OVERLAP ? t & 1 : 0;
        __syncthreads();
        if (t + 1 < tiles) request_q(t + 1);
        cp_async_commit();
        split_stacked<BLOCK_M, HEAD_DIM, THREADS>(q_s, q_raw + st * Q_ELEMS);
        split_stacked<BLOCK_M, HEAD_DIM_V, THREADS>(do_s, do_raw + st * DO_ELEMS);
        transpose_v<BLOCK_M, HEAD_DIM, THREADS, true>(qt_s + buf * 2 * Q_ELEMS,
                                                      q_raw + st * Q_ELEMS);
        transpose_v<BLOCK_M, HEAD_DIM_V, THREADS, true>(dot_s + buf * 2 * DO_ELEMS,
                                                        do_raw + st * DO_ELEMS);
        fence_proxy_async();  // visible to the tensor cores ...
        __syncthreads();      // ... once every thread has written its part
    };
    // S^T, dP^T of the prepared tile, each split term apart, summed once they are done
    auto scores = [&](Acc& s, Acc& dp) {
        float s_w[2 * BLOCK_M / 8][4], dp_w[2 * BLOCK_M / 8][4];
        Acc s_y, dp_y;
        stacked_product_ss<BLOCK_M, HEAD_DIM>(s_w, s_y, k_base, K_ELEMS * 4, q_base);
        stacked_product_ss<BLOCK_M, HEAD_DIM_V>(dp_w, dp_y, v_base, V_ELEMS * 4, do_base);
        wgmma_commit();
        wgmma_wait<0>();
        stacked_sum(s, s_w, s_y);
        stacked_sum(dp, dp_w, dp_y);
    };
    // S^T, dP^T of tile t done: P^T and dS^T, their fragments, and tile t's dV and dK issued
    // into the fresh accumulators (the fragments stay untouched until they are done)
    auto grads = [&](int t, Acc& s, Acc& dp, Frag& p_hi, Frag& p_lo, Frag& ds_hi, Frag& ds_lo,
                     float (&dv_t)[HEAD_DIM_V / 8][4], float (&dk_t)[HEAD_DIM / 8][4]) {
        const long long m0 = m_lo + (long long)t * BLOCK_M;
        const int st = t & 1, buf = OVERLAP ? t & 1 : 0;
        const bool interior = !HAS_MASK && tile_is_interior(p, m0, BLOCK_M, n_own, 64);
        const float* lse_t = lse_s + st * BLOCK_M;
        const float* delta_t = delta_s + st * BLOCK_M;
        p_and_ds_tile<HAS_MASK, true>(s, dp, p, consts, n_own + warp * 16, m0, lane, interior,
                                      in.mask, in.bias, [&](int j, int e) {
                                          const int col = 8 * j + 2 * (lane % 4) + e % 2;
                                          return make_float2(lse_t[col], delta_t[col]);
                                      });
        tf32_split_fragments<BLOCK_M>(p_hi, p_lo, s);
        tf32_split_fragments<BLOCK_M>(ds_hi, ds_lo, dp);
        split_product_rs<HEAD_DIM_V, BLOCK_M>(dv_t, p_hi, p_lo, dot_base + buf * 2 * DO_ELEMS * 4,
                                              DO_ELEMS * 4);
        split_product_rs<HEAD_DIM, BLOCK_M>(dk_t, ds_hi, ds_lo, qt_base + buf * 2 * Q_ELEMS * 4,
                                            Q_ELEMS * 4);
        wgmma_commit();
    };

    if (tiles > 0) prepare(0);
    // OVERLAP: tile t + 1 is prepared (split, transposed) while the tensor cores run tile
    // t's dV and dK. Every wgmma is issued outside a branch, and each tile's accumulators
    // and fragments are the loop body's own (nothing of them lives across iterations).
    for (int t = 0; t < tiles; ++t) {
        Acc s, dp;
        scores(s, dp);
        Frag p_hi, p_lo, ds_hi, ds_lo;
        float dv_t[HEAD_DIM_V / 8][4], dk_t[HEAD_DIM / 8][4];  // this tile's dV, dK
        grads(t, s, dp, p_hi, p_lo, ds_hi, ds_lo, dv_t, dk_t);
        if constexpr (!OVERLAP) {
            wgmma_wait<0>();
            add_into(dv, dv_t);
            add_into(dk, dk_t);
        }
        if (t + 1 < tiles) {
            cp_async_wait<0>();  // tile t + 1 (requested by prepare(t)) has landed
            prepare(t + 1);
        }
        if constexpr (OVERLAP) {
            wgmma_wait<0>();
            add_into(dv, dv_t);
            add_into(dk, dk_t);
        }
    }
    cp_async_wait<0>();  // no copy may outlive the block

    float* dk_out = reinterpret_cast<float*>(bp.dk) + batch_offset(bp.dk_s, b, p.batch1, p.batch2);
    float* dv_out = reinterpret_cast<float*>(bp.dv) + batch_offset(bp.dv_s, b, p.batch1, p.batch2);
    const long long row0 = n_own + warp * 16;
    store_tile(dk, dk_out, bp.dk_s.row, bp.dk_s.col, row0, p.seqlen_k, p.head_dim, lane,
               float(p.scale));
    store_tile(dv, dv_out, bp.dv_s.row, bp.dv_s.col, row0, p.seqlen_k, p.head_dim_v, lane, 1.f);
}

template <typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N, bool ALIGNED,
          int MIN_BLOCKS, bool OVERLAP, int WARPGROUPS>
__global__ void __launch_bounds__(128 * WARPGROUPS, MIN_BLOCKS)
    attention_bwd_dq_sm90_3xtf32(const AttnBwdParams bp) {
    constexpr int THREADS = 128 * WARPGROUPS, BLOCK_M = 64 * WARPGROUPS;  // 64 rows a warpgroup
    static_assert(HEAD_DIM == 64 && HEAD_DIM_V == 64 && (BLOCK_N == 32 || BLOCK_N == 64) &&
                      (WARPGROUPS == 1 || (WARPGROUPS == 2 && BLOCK_N == 32)),
                  "the shared memory of the split tiles (K^T rows of whole 128 bytes)");
    constexpr int Q_ELEMS = 64 * HEAD_DIM, DO_ELEMS = 64 * HEAD_DIM_V;  // one warpgroup's rows
    constexpr int K_ELEMS = BLOCK_N * HEAD_DIM, V_ELEMS = BLOCK_N * HEAD_DIM_V;
    const AttnParams& p = bp.f;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    float* q_s = reinterpret_cast<float*>(smem_raw);  // [WARPGROUPS][hi, lo][64 x HEAD_DIM]
    float* do_s = q_s + WARPGROUPS * 2 * Q_ELEMS;      // [WARPGROUPS][hi, lo][64 x HEAD_DIM_V]
    float* k_raw = do_s + WARPGROUPS * 2 * DO_ELEMS;   // [2 stages][BLOCK_N x HEAD_DIM]
    float* v_raw = k_raw + 2 * K_ELEMS;                // [2 stages][BLOCK_N x HEAD_DIM_V]
    float* k_s = v_raw + 2 * V_ELEMS;                  // [2 BLOCK_N x HEAD_DIM]: hi; lo rows
    float* v_s = k_s + 2 * K_ELEMS;                    // [2 BLOCK_N x HEAD_DIM_V]: hi; lo rows
    float* kt_s = v_s + 2 * V_ELEMS;  // [OVERLAP ? 2 : 1][hi, lo][HEAD_DIM x BLOCK_N]

    // warpgroup wg owns rows m0 + 64 wg .. + 63 (its warp w: 16 w .. 16 w + 15 of them)
    const int wg = WARPGROUPS == 1 ? 0 : threadIdx.x / 128, lane = threadIdx.x % 32;
    const int warp = WARPGROUPS == 1 ? threadIdx.x / 32 : threadIdx.x / 32 % 4;
    // heaviest query blocks first: under causal masking the last rows see the most keys
    const BlockCoords blk = block_coords(bp.num_row_blocks, bp.num_col_tiles,
                                         bp.f.window_left >= 0 || bp.f.window_right >= 0, true);
    const long long m_block = blk.row_block, b = blk.b;
    const long long m0 = m_block * BLOCK_M, m_own = m0 + 64 * wg;

    const BackwardInputs<float, float, BiasT> in(bp, b);  // batch entry b (backward.cuh)
    const float *q = in.q + m0 * p.q_s.row, *k = in.k;
    const float *v = in.v, *dout = in.dout + m0 * bp.dout_s.row;
    const float *lse = in.lse, *delta = in.delta;

    const long long m_last = min(m0 + BLOCK_M, p.seqlen_q) - 1;
    const Range keys = key_band(p, m0, m_last, BLOCK_N);
    const long long n_lo = keys.lo, n_hi = keys.hi;
    const int tiles = n_lo < n_hi ? (int)((n_hi - n_lo + BLOCK_N - 1) / BLOCK_N) : 0;

    auto request_kv = [&](int t) {  // key tile t into raw stage t % 2
        load_kv_tiles<BLOCK_N, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED>(
            k_raw + (t & 1) * K_ELEMS, v_raw + (t & 1) * V_ELEMS, k, v,
            n_lo + (long long)t * BLOCK_N, p, Sw128<BLOCK_N, 4>(), Sw128<BLOCK_N, 4>());
    };
    // each warpgroup's 64 rows of Q and dO
    load_own_tiles<WARPGROUPS, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED>(
        q_s, do_s, q, p.q_s, dout, bp.dout_s, p.seqlen_q - m0, p.head_dim, p.head_dim_v);
    if (tiles > 0) request_kv(0);
    cp_async_commit();  // Q, dO and the first key tile
    cp_async_wait<0>();
    split_own_tiles<WARPGROUPS, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED>(q_s, do_s);

    // this lane's two rows (g and g + 8 of the warp's 16)
    float lse_log2[2], dl[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const long long r = m_own + warp * 16 + lane / 4 + 8 * h;
        lse_log2[h] = r < p.seqlen_q ? lse[r * p.lse_s.row] * float(LOG2E) : neg_inf<float>();
        dl[h] = r < p.seqlen_q ? delta[r * bp.delta_s.row] : 0.f;
    }
    float dq[HEAD_DIM / 8][4];
    zero(dq);
    const unsigned q_base = smem_addr(q_s + wg * 2 * Q_ELEMS);  // this warpgroup's rows
    const unsigned do_base = smem_addr(do_s + wg * 2 * DO_ELEMS);
    const unsigned k_base = smem_addr(k_s), v_base = smem_addr(v_s), kt_base = smem_addr(kt_s);
    const ScoreConsts<float> consts(p);

    using Acc = float[BLOCK_N / 8][4];      // S, dP: queries x keys
    using Frag = unsigned[BLOCK_N / 8][4];  // dS as A fragments (hi or lo)
    // as in the dK/dV kernel: key tile t landed here; the next requested, t's tiles written
    auto prepare = [&](int t) {
        const int st = t & 1, buf = OVERLAP ? t & 1 : 0;
        __syncthreads();
        if (t + 1 < tiles) request_kv(t + 1);
        cp_async_commit();
        split_stacked<BLOCK_N, HEAD_DIM, THREADS>(k_s, k_raw + st * K_ELEMS);
        split_stacked<BLOCK_N, HEAD_DIM_V, THREADS>(v_s, v_raw + st * V_ELEMS);
        transpose_v<BLOCK_N, HEAD_DIM, THREADS, true>(kt_s + buf * 2 * K_ELEMS,
                                                      k_raw + st * K_ELEMS);
        fence_proxy_async();  // visible to the tensor cores ...
        __syncthreads();      // ... once every thread has written its part
    };
    auto scores = [&](Acc& s, Acc& dp) {  // S, dP of the prepared tile, as in dK/dV
        float s_w[2 * BLOCK_N / 8][4], dp_w[2 * BLOCK_N / 8][4];
        Acc s_y, dp_y;
        stacked_product_ss<BLOCK_N, HEAD_DIM>(s_w, s_y, q_base, Q_ELEMS * 4, k_base);
        stacked_product_ss<BLOCK_N, HEAD_DIM_V>(dp_w, dp_y, do_base, DO_ELEMS * 4, v_base);
        wgmma_commit();
        wgmma_wait<0>();
        stacked_sum(s, s_w, s_y);
        stacked_sum(dp, dp_w, dp_y);
    };
    // S, dP of tile t done: dS, its fragments, tile t's dQ issued
    auto grads = [&](int t, Acc& s, Acc& dp, Frag& ds_hi, Frag& ds_lo,
                     float (&dq_t)[HEAD_DIM / 8][4]) {
        const long long n0 = n_lo + (long long)t * BLOCK_N;
        const int buf = OVERLAP ? t & 1 : 0;
        const bool interior = !HAS_MASK && tile_is_interior(p, m_own, 64, n0, BLOCK_N);
        p_and_ds_tile<HAS_MASK, false>(s, dp, p, consts, m_own + warp * 16, n0, lane, interior,
                                       in.mask, in.bias, [&](int, int e) {
                                           return make_float2(lse_log2[e / 2], dl[e / 2]);
                                       });
        tf32_split_fragments<BLOCK_N>(ds_hi, ds_lo, dp);
        split_product_rs<HEAD_DIM, BLOCK_N>(dq_t, ds_hi, ds_lo, kt_base + buf * 2 * K_ELEMS * 4,
                                            K_ELEMS * 4);
        wgmma_commit();
    };

    if (tiles > 0) prepare(0);
    for (int t = 0; t < tiles; ++t) {  // as in the dK/dV kernel
        Acc s, dp;
        scores(s, dp);
        Frag ds_hi, ds_lo;
        float dq_t[HEAD_DIM / 8][4];  // this tile's dQ
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
    cp_async_wait<0>();

    float* dq_out = reinterpret_cast<float*>(bp.dq) + batch_offset(bp.dq_s, b, p.batch1, p.batch2);
    store_tile(dq, dq_out, bp.dq_s.row, bp.dq_s.col, m_own + warp * 16, p.seqlen_q, p.head_dim,
               lane, float(p.scale));
}
