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
//             PREPARED: k and v are the planes that tf32_prepare_k and tf32_prepare_vt
//             (below) made once per call: K already rounded (or split), V already
//             transposed (and rounded or split), so tiles of K and of V^T arrive by cp.async
//             as they are, V^T into two stages, with one barrier per tile and neither the
//             rounding pass nor the transpose (bit for bit the same results).
// Shared mem: (BLOCK_M*HEAD_DIM*P + K_STAGES*P*BLOCK_N*HEAD_DIM + V*BLOCK_N*HEAD_DIM_V)
//             * 4 bytes with P = 2 parts (hi, lo) when SPLIT, else 1, and V = 1 + P (the V
//             staging tile and V^T) or, PREPARED, 2P (two stages of V^T): Q, K_STAGES stages
//             of K and V, every tile in the 128-byte-swizzle layout of wgmma
//             (sm90_tiles.cuh) with 32-float column groups, each lo part right after its hi
//             part. cuattn/_dispatch.py::sm90_tf32_smem_bytes computes the same number.
// Template:   BiasT; HAS_MASK; HEAD_DIM, HEAD_DIM_V (64 or 128, zero-padded); BLOCK_N (32,
//             64 or 128); NUM_WG; SPLIT; K_STAGES (1 or 2); PREPARED; ALIGNED; MIN_BLOCKS.
#include "mma_softmax.cuh"
#include "sm90_tiles.cuh"

using namespace cuattn;
using namespace cuattn::mma;
using namespace cuattn::sm90;

namespace {

// V^T (HEAD_DIM_V rows, keys K-contiguous at tf32_key_position) from the staged V tile
// (BLOCK_N key rows), rounded to TF32; with SPLIT the remainders go to the lo tile that
// follows V^T (HEAD_DIM_V * BLOCK_N floats on). A warp moves 16 keys x 8 columns per step:
// lane (n = lane % 16, h = lane / 16) reads 4 columns of key n (one 16-byte load; eight
// consecutive keys hit eight distinct chunks) and writes them to 4 rows of V^T; rows
// 4h + e of the two half-warps differ in bit 2 of the swizzle, so the 32 scalar stores of
// a step hit 32 distinct banks.
// Steps: warp w starts at key block w % KB (KB = BLOCK_N / 16) and column group w / KB
// (of 8 columns) and moves CS = WARPS / KB column groups on (or, with more key blocks than
// warps, WARPS key blocks on). A lane's key then changes by multiples of 16 and its
// columns by multiples of 8 CS: every address is one of two bases (computed once per
// tile) plus a constant, the read's swizzle at most one XOR with a constant.
template <int BLOCK_N, int HEAD_DIM_V, int THREADS, bool SPLIT>
__device__ __forceinline__ void transpose_v(float* vt, const float* vs) {
    constexpr int WARPS = THREADS / 32, KB = BLOCK_N / 16, CG = HEAD_DIM_V / 8;
    constexpr bool WIDE = WARPS >= KB;  // every warp keeps its key block
    constexpr int CS = WIDE ? WARPS / KB : 1, KSTEP = WIDE ? 0 : WARPS;
    constexpr int NA = CG / CS, NB = WIDE ? 1 : KB / WARPS;
    static_assert((WIDE ? WARPS % KB == 0 && (CS == 1 || CS == 2 || CS == 4) && CG % CS == 0
                        : KB % WARPS == 0),
                  "warps tile the V tile in whole key blocks and column groups");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n = (warp % KB) * 16 + lane % 16;             // key of step (0, 0)
    const int c = (WIDE ? warp / KB : 0) * 8 + 4 * (lane / 16);  // first column, < 8 CS
    const int pos = tf32_key_position(n);
    const int rd = Sw128<BLOCK_N, 4>()(n, c);
    int wr[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) wr[e] = Sw128<HEAD_DIM_V, 4>()(c + e, pos);
#pragma unroll
    for (int a = 0; a < NA; ++a)
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            // columns c + 8 CS a: column group (8 CS a) / 32, swizzle chunk XOR ((8 CS a) % 32) / 4
            // (c < 8 CS shares no bits with it); keys n + 16 KSTEP b: rows further on, and
            // V^T columns (pos + 16 KSTEP b, a multiple of 32 further) whole groups on
            const int col = 8 * CS * a, key = 16 * KSTEP * b;
            const float4 x = *reinterpret_cast<const float4*>(
                vs + ((rd ^ (((col % 32) / 4) << 2)) + (col / 32) * BLOCK_N * 32 + key * 32));
            const float xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int at = wr[e] + col * 32 + (key / 32) * HEAD_DIM_V * 32;
                if constexpr (SPLIT) {
                    float hi, lo;
                    split_tf32(xs[e], hi, lo);
                    vt[at] = hi;
                    vt[HEAD_DIM_V * BLOCK_N + at] = lo;
                } else {
                    vt[at] = __uint_as_float(to_tf32(xs[e]));
                }
            }
        }
}

}  // namespace

// The operands prepared once per call for PREPARED instances (tf32_prepare_k,
// tf32_prepare_vt below; cuattn/attention.py launches them): per batch entry of k (of v),
// PARTS planes (hi, then lo with SPLIT) of `rows` x `cols` floats, row-major and contiguous.
// K: rows = keys, cols = the head dim rounded up to a multiple of 4 (zeros past it), each
// value as the kernel's own round_own_tf32 would leave it. V^T: rows = the value head dim,
// cols = keys rounded up to a multiple of 8 (zeros past them) at tf32_key_position, each
// value as transpose_v would write it. So a PREPARED instance computes bit for bit what the
// other instance computes, without the per-block rounding pass over K and transpose of V.
struct Tf32Prep {
    long long src, dst;            // device addresses: the input (k or v), the planes
    long long entries;             // batch entries of the input
    long long batch1, batch2;      // extents of its batch axes 1 and 2 (axis 0 is implied)
    long long rows, cols;          // of one plane
    long long src_rows, src_cols;  // of the input: keys and head dim
    Strides src_s;
};

template <bool SPLIT>
__device__ __forceinline__ void put_tf32(float* dst, long long plane, float x) {
    if constexpr (SPLIT) {
        float hi, lo;
        split_tf32(x, hi, lo);
        dst[0] = hi;
        dst[plane] = lo;
    } else {
        dst[0] = __uint_as_float(to_tf32(x));
    }
}

// K: one thread per output element; block rows y take batch entries y, y + gridDim.y, ...
template <bool SPLIT>
__global__ void __launch_bounds__(256) tf32_prepare_k(const Tf32Prep p) {
    const long long plane = p.rows * p.cols;
    for (long long b = blockIdx.y; b < p.entries; b += gridDim.y) {
        const float* src = reinterpret_cast<const float*>(p.src) +
                           batch_offset(p.src_s, b, p.batch1, p.batch2);
        float* dst = reinterpret_cast<float*>(p.dst) + b * (SPLIT ? 2 : 1) * plane;
        for (long long i = blockIdx.x * 256LL + threadIdx.x; i < plane; i += 256LL * gridDim.x) {
            const long long r = i / p.cols, c = i % p.cols;
            put_tf32<SPLIT>(dst + i, plane,
                            c < p.src_cols ? src[r * p.src_s.row + c * p.src_s.col] : 0.f);
        }
    }
}

// V^T: a block transposes 32 keys x 32 columns at a time through shared memory (coalesced
// reads along the head dim, coalesced writes along the keys); blockIdx.x picks the tile,
// block rows y take batch entries y, y + gridDim.y, ...
template <bool SPLIT>
__global__ void __launch_bounds__(256) tf32_prepare_vt(const Tf32Prep p) {
    __shared__ float tile[32][33];
    const long long key_tiles = (p.cols + 31) / 32;
    const long long n0 = (blockIdx.x % key_tiles) * 32, d0 = (blockIdx.x / key_tiles) * 32;
    const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    const long long plane = p.rows * p.cols;
    for (long long b = blockIdx.y; b < p.entries; b += gridDim.y) {
        const float* src = reinterpret_cast<const float*>(p.src) +
                           batch_offset(p.src_s, b, p.batch1, p.batch2);
        __syncthreads();  // the previous entry's tile is read
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const long long n = n0 + ty + 8 * i, d = d0 + tx;
            tile[ty + 8 * i][tx] =
                n < p.src_rows && d < p.src_cols ? src[n * p.src_s.row + d * p.src_s.col] : 0.f;
        }
        __syncthreads();
        float* dst = reinterpret_cast<float*>(p.dst) + b * (SPLIT ? 2 : 1) * plane;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const long long d = d0 + ty + 8 * i, n = n0 + tx;
            if (d < p.rows && n < p.cols)
                put_tf32<SPLIT>(dst + d * p.cols + tf32_key_position((int)n), plane,
                                tile[tx][ty + 8 * i]);
        }
    }
}

template <typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N, int NUM_WG,
          bool SPLIT, int K_STAGES, bool PREPARED, bool ALIGNED, int MIN_BLOCKS>
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
    // PREPARED: V^T tiles arrive as they are, into two stages; otherwise V arrives into a
    // staging tile and is transposed into one V^T tile
    constexpr int VT_STAGES = PREPARED ? 2 : 1;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    float* q_s = reinterpret_cast<float*>(smem_raw);  // [NUM_WG][PARTS][64 x HEAD_DIM]
    float* k_s = q_s + NUM_WG * PARTS * Q_ELEMS;      // [K_STAGES][K_ROWS x HEAD_DIM]
    float* v_s = k_s + K_STAGES * PARTS * K_ELEMS;    // [BLOCK_N x HEAD_DIM_V], as stored
    float* vt_s = v_s + (PREPARED ? 0 : V_ELEMS);     // [VT_STAGES][PARTS][HEAD_DIM_V x BLOCK_N]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
    // this block's rows and batch entry, heaviest query blocks first (common.cuh); PREPARED:
    // k and v are the planes of tf32_prepare_k and tf32_prepare_vt
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
        float* dst = k_s + stage * K_ROWS * HEAD_DIM;
        load_tile<BLOCK_N, HEAD_DIM, THREADS, ALIGNED>(dst, k + n0 * p.k_s.row, p.k_s.row,
                                                       p.k_s.col, p.seqlen_k - n0,
                                                       p.head_dim, Sw128<K_ROWS, 4>());
        if constexpr (PREPARED && SPLIT)  // the lo plane, into the lo rows
            load_tile<BLOCK_N, HEAD_DIM, THREADS, ALIGNED>(
                dst + BLOCK_N * 32, k + (p.seqlen_k + n0) * p.k_s.row, p.k_s.row, p.k_s.col,
                p.seqlen_k - n0, p.head_dim, Sw128<K_ROWS, 4>());
    };
    auto request_v = [&](int n0) {  // into the staging tile
        load_tile<BLOCK_N, HEAD_DIM_V, THREADS, ALIGNED>(v_s, v + n0 * p.v_s.row, p.v_s.row,
                                                         p.v_s.col, p.seqlen_k - n0,
                                                         p.head_dim_v, Sw128<BLOCK_N, 4>());
    };
    // PREPARED: V^T (rows: the head dim; columns: keys, padded to a multiple of 8)
    const int keys_pad = (seqlen_k + 7) / 8 * 8;
    auto request_vt = [&](int n0, int stage) {
#pragma unroll
        for (int part = 0; part < PARTS; ++part)
            load_tile<HEAD_DIM_V, BLOCK_N, THREADS, ALIGNED>(
                vt_s + (stage * PARTS + part) * V_ELEMS,
                v + part * p.head_dim_v * p.v_s.row + n0 * p.v_s.col, p.v_s.row, p.v_s.col,
                p.head_dim_v, keys_pad - n0, Sw128<HEAD_DIM_V, 4>());
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
    if (n_lo < n_hi) {
        if constexpr (PREPARED)
            request_vt(n_lo, 0);
        else
            request_v(n_lo);
    }
    cp_async_commit();
    cp_async_wait<1>();
    if (!PREPARED && n_lo < n_hi) round_own_k(k_s);
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

    int stage = 0, vt_stage = 0;
    for (int n0 = n_lo; n0 < n_hi; n0 += BLOCK_N, stage = (stage + 1) % K_STAGES,
             vt_stage = (vt_stage + 1) % VT_STAGES) {
        const bool more = n0 + BLOCK_N < n_hi;
        const int next = (stage + 1) % K_STAGES;
        if constexpr (PREPARED) {
            // one barrier per tile: this tile's K and V^T have landed, every thread is past
            // the previous tile (its S and P V have read the other stages), which the next
            // tile's copies may then overwrite
            cp_async_wait<0>();
            fence_proxy_async();
            __syncthreads();
            if (more) {
                request_vt(n0 + BLOCK_N, vt_stage ^ 1);
                if (K_STAGES == 2) request_k(n0 + BLOCK_N, next);
            }
            cp_async_commit();
        } else {
            if (K_STAGES == 2 && more) request_k(n0 + BLOCK_N, next);
            cp_async_commit();    // (empty with one K stage)
            cp_async_wait<1>();   // all but the group just committed have landed ...
            fence_proxy_async();  // ... are visible to the tensor cores (with the rounded K) ...
            __syncthreads();      // ... for every thread: this K tile and the staged V tile
        }

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
        if constexpr (!PREPARED) transpose_v<BLOCK_N, HEAD_DIM_V, THREADS, SPLIT>(vt_s, v_s);
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

        if constexpr (!PREPARED) {
            fence_proxy_async();  // V^T, written by every thread, visible to the tensor cores
            __syncthreads();      // ... and the staging buffer free for the next V tile
            if (more) request_v(n0 + BLOCK_N);
            cp_async_commit();
        }

        // O += P V: P from registers (keys permuted), V^T K-contiguous in the same order.
        // SPLIT: this tile's P V in fresh accumulators, the small terms first, then added
        const unsigned vt_tile = vt_base + vt_stage * PARTS * V_ELEMS * 4;
        unsigned p_frag[BLOCK_N / 8][4], p_lo[SPLIT ? BLOCK_N / 8 : 1][4];
        float pv[SPLIT ? DV_TILES : 1][4];  // read by the tensor cores until the wait below
        if constexpr (SPLIT) {
            tf32_split_fragments<BLOCK_N>(p_frag, p_lo, s);
            product_rs_tf32<HEAD_DIM_V, BLOCK_N>(pv, p_frag, vt_tile + VT_LO, false);
            product_rs_tf32<HEAD_DIM_V, BLOCK_N, false>(pv, p_lo, vt_tile, true);
            product_rs_tf32<HEAD_DIM_V, BLOCK_N, false>(pv, p_frag, vt_tile, true);
        } else {
            tf32_fragments<BLOCK_N>(p_frag, s);
            product_rs_tf32<HEAD_DIM_V, BLOCK_N>(o, p_frag, vt_tile, true);
        }
        wgmma_commit();
        if (!PREPARED && more) {  // while it runs: round the next K tile (landed: only V is younger)
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
        // read by the S before this iteration's second barrier (PREPARED: the stages of K
        // and V^T that the copies of the tile after next refill are this tile's, refilled
        // only after the next iteration's barrier)
    }
    cp_async_wait<0>();  // no copy may outlive the block

    store_rows<float, DV_TILES>(o, l, m, p, b, row0, lane);  // normalise and store
}
