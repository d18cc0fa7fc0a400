// attention_sm90_tf32.cu -- float32 attention forward for precision="tf32" on Hopper's TF32
// tensor cores (sm_90a: wgmma .tf32).
//
// Computes:   the same function as attention_mma_wide.cu with T = float (reference
//             cuattn/reference.py::attention_reference; yardstick naive_attention with the
//             same roundings): the operands of both products (q, k, P, v) are rounded to TF32
//             (to nearest, cvt.rna) on chip. The instruction itself would truncate (it
//             ignores the low 13 bits), and truncating K misses the accuracy rule by up to
//             1.8x. Score transform and online softmax as the other tensor-core forwards
//             (mma_softmax.cuh), float32 throughout.
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
//             transposed. Q stays in shared memory: held as register fragments here, its
//             loop-invariant registers are handed to P's fragments by ptxas without being
//             restored (wrong results). The piped instance below holds Q in registers
//             correctly (QREG).
//             Long calls take the piped instance at the end of this file instead: K and V^T
//             prepared once per call, the tiles brought by the copy engine.
// Shared mem: (BLOCK_M*HEAD_DIM + 2*BLOCK_N*HEAD_DIM + 2*BLOCK_N*HEAD_DIM_V) * 4 bytes: Q,
//             two stages of K, the V staging tile and V^T, every tile in the
//             128-byte-swizzle layout of wgmma (sm90_tiles.cuh) with 32-float column groups.
//             the layout: FwdSm90Tf32Smem (layouts.cuh, from cuattn/families/sm90_tf32.py).
// Template:   BiasT; HAS_MASK; HEAD_DIM, HEAD_DIM_V (64 or 128, zero-padded); BLOCK_N (32,
//             64 or 128); NUM_WG; ALIGNED; MIN_BLOCKS.
#include "common/mma_softmax.cuh"
#include "sm90/pipeline.cuh"

using namespace cuattn;
using namespace cuattn::mma;
using namespace cuattn::sm90;

template <typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N, int NUM_WG,
          bool ALIGNED, int MIN_BLOCKS>
__global__ void __launch_bounds__(NUM_WG * 128, MIN_BLOCKS)
    attention_fwd_sm90_tf32(const AttnParams p) {
    constexpr int THREADS = NUM_WG * 128, BLOCK_M = 64 * NUM_WG, DV_TILES = HEAD_DIM_V / 8;
    static_assert((HEAD_DIM == 64 || HEAD_DIM == 128) && (HEAD_DIM_V == 64 || HEAD_DIM_V == 128) &&
                      (BLOCK_N == 32 || BLOCK_N == 64 || BLOCK_N == 128),
                  "wgmma shapes of wgmma.cuh");
    constexpr int Q_ELEMS = 64 * HEAD_DIM, K_ELEMS = BLOCK_N * HEAD_DIM, V_ELEMS = BLOCK_N * HEAD_DIM_V;

    using L = FwdSm90Tf32Smem<HEAD_DIM, HEAD_DIM_V, NUM_WG, BLOCK_N>;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    float* q_s = reinterpret_cast<float*>(smem_raw + L::q_s);    // [NUM_WG][64 x HEAD_DIM]
    float* k_s = reinterpret_cast<float*>(smem_raw + L::k_s);    // [2][BLOCK_N x HEAD_DIM]
    float* v_s = reinterpret_cast<float*>(smem_raw + L::v_s);    // [BLOCK_N x HEAD_DIM_V]
    float* vt_s = reinterpret_cast<float*>(smem_raw + L::vt_s);  // [HEAD_DIM_V x BLOCK_N]

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
        float* dst = k_s + stage * K_ELEMS;
        load_tile<BLOCK_N, HEAD_DIM, THREADS, ALIGNED>(dst, k + n0 * p.k_s.row, p.k_s.row,
                                                       p.k_s.col, p.seqlen_k - n0,
                                                       p.head_dim, Sw128<BLOCK_N, 4>());
    };
    auto request_v = [&](int n0) {  // into the staging tile
        load_tile<BLOCK_N, HEAD_DIM_V, THREADS, ALIGNED>(v_s, v + n0 * p.v_s.row, p.v_s.row,
                                                         p.v_s.col, p.seqlen_k - n0,
                                                         p.head_dim_v, Sw128<BLOCK_N, 4>());
    };
    auto round_own_k = [&](float* tile) {
        round_own_tf32<BLOCK_N, HEAD_DIM, THREADS, ALIGNED, false, 0>(tile, Sw128<BLOCK_N, 4>());
    };
    // each warpgroup's 64 rows of Q form one 64-row tile; Q and the first K tile are one
    // group, rounded to TF32 in place as soon as they land
#pragma unroll
    for (int w = 0; w < NUM_WG; ++w)
        load_tile<64, HEAD_DIM, THREADS, ALIGNED>(q_s + w * Q_ELEMS, q + w * 64 * p.q_s.row,
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
        round_own_tf32<64, HEAD_DIM, THREADS, ALIGNED, false, 0>(q_s + w * Q_ELEMS, Sw128<64, 4>());

    float acc[DV_TILES][4], m[2], l[2];
    clear_row_state(acc, m, l);
    const SoftmaxExp2<float> exp2_fn(lane);

    const unsigned q_base = smem_addr(q_s + wg * Q_ELEMS), k_base = smem_addr(k_s),
                   vt_base = smem_addr(vt_s);
    const int row0 = (int)m0 + 64 * wg + 16 * (warp % 4);  // first row of this warp's tile

    int stage = 0;
    for (int n0 = n_lo; n0 < n_hi; n0 += BLOCK_N, stage = (stage + 1) % 2) {
        const bool more = n0 + BLOCK_N < n_hi;
        const int next = (stage + 1) % 2;
        if (more) request_k(n0 + BLOCK_N, next);
        cp_async_commit();
        cp_async_wait<1>();   // all but the group just committed have landed ...
        fence_proxy_async();  // ... are visible to the tensor cores (with the rounded K) ...
        __syncthreads();      // ... for every thread: this K tile and the staged V tile

        // S = Q K^T, both operands K-contiguous in shared memory; V^T while it runs
        float s[BLOCK_N / 8][4];
        wgmma_fence();
        product_ss<BLOCK_N, HEAD_DIM, float>(s, q_base, k_base + stage * K_ELEMS * 4);
        wgmma_commit();
        transpose_v<BLOCK_N, HEAD_DIM_V, THREADS>(vt_s, v_s);
        wgmma_wait<0>();

        const bool interior = !HAS_MASK && forward_tile_interior<BLOCK_M, BLOCK_N>(
                                               p, m0, m_last, n0, seqlen_q, seqlen_k, off);
        const float scale = mask_scores<BLOCK_N, HAS_MASK>(s, p, row0, n0, lane, interior, mask, bias);
        update_row_state<BLOCK_N, DV_TILES>(s, m, l, acc, scale, exp2_fn);

        fence_proxy_async();  // V^T, written by every thread, visible to the tensor cores
        __syncthreads();      // ... and the staging buffer free for the next V tile
        if (more) request_v(n0 + BLOCK_N);
        cp_async_commit();

        // O += P V: P from registers (keys permuted), V^T K-contiguous in the same order
        unsigned p_frag[BLOCK_N / 8][4];
        tf32_fragments<BLOCK_N>(p_frag, s);
        product_rs_tf32<HEAD_DIM_V, BLOCK_N>(acc, p_frag, vt_base, true);
        wgmma_commit();
        if (more) {  // while it runs: round the next K tile (landed: only V is younger)
            cp_async_wait<1>();
            round_own_k(k_s + next * K_ELEMS);
        }
        wgmma_wait<0>();
        // no barrier here: V^T is rewritten only after the next iteration's first barrier,
        // which every thread reaches after its own P V, and the K stage refilled next was
        // read by the S before this iteration's second barrier
    }
    cp_async_wait<0>();  // no copy may outlive the block

    store_rows<float, DV_TILES>(acc, l, m, p, b, row0, lane);  // normalise and store
}

// ---------------------------------------------------------------------------------------
// The piped instance (precision="tf32" with prepared operands): K and V^T arrive as tile
// images, each one bulk copy by the copy engine, and the two warpgroups meet at no block
// barrier inside the loop.
//
// Images (tf32_image_k, tf32_image_vt below; cuattn/attention.py launches them once per
// call): per batch entry of k (of v) and per tile of BLOCK_N keys, the tile exactly as the
// kernel wants it in shared memory: K rounded to TF32 in the 128-byte-swizzle layout of a
// BLOCK_N-row tile of HEAD_DIM columns, V^T rounded, keys at tf32_key_position, in that
// layout for a HEAD_DIM_V-row tile of BLOCK_N columns; zeros past the keys and head dims.
// Tf32Prep: rows = BLOCK_N, cols = HEAD_DIM (or HEAD_DIM_V), src_rows = keys.

// The parameter block of tf32_image_k and tf32_image_vt (cuattn/_params.py reads it from here).
struct Tf32Prep {
    long long src, dst;            // device addresses: the input (k or v), the images
    long long entries;             // batch entries of the input
    long long batch1, batch2;      // extents of its batch axes 1 and 2 (axis 0 is implied)
    long long rows, cols;          // keys per tile (BLOCK_N), the padded head dim
    long long src_rows, src_cols;  // of the input: keys and head dim
    Strides src_s;
};

// K images: one thread per 16-byte chunk of a tile (four columns of one key), which it
// writes rounded; consecutive threads write consecutive chunks and read one 128-byte row
// segment per eight; block rows y take batch entries y, y + gridDim.y, ... rows (keys per
// tile) and cols (the padded head dim) are powers of two, so the index arithmetic is shifts
// and masks: 64-bit divisions by run-time values per element hold this kernel to 1 TB/s.
__global__ void __launch_bounds__(256) tf32_image_k(const Tf32Prep p) {
    const int log_rows = __ffs((int)p.rows) - 1;
    const int log_chunks = log_rows + __ffs((int)p.cols) - 3;  // of a tile's keys
    const long long chunks = ((p.src_rows + p.rows - 1) >> log_rows) << log_chunks;
    // whole 16-byte chunks of the input (else element by element)
    const bool vec = p.src_s.col == 1 && p.src_cols % 4 == 0 && p.src_s.row % 4 == 0 &&
                     p.src_s.b0 % 4 == 0 && p.src_s.b1 % 4 == 0 && p.src_s.b2 % 4 == 0 &&
                     p.src % 16 == 0;
    for (long long b = blockIdx.y; b < p.entries; b += gridDim.y) {
        const float* src = reinterpret_cast<const float*>(p.src) +
                           batch_offset(p.src_s, b, p.batch1, p.batch2);
        float4* dst = reinterpret_cast<float4*>(p.dst) + b * chunks;
        for (long long i = blockIdx.x * 256LL + threadIdx.x; i < chunks; i += 256LL * gridDim.x) {
            // chunk ch of its tile: column block ch / (8 rows), key row, chunk w of the row
            const int ch = (int)i & ((1 << log_chunks) - 1), w = ch & 7;
            const int cb = ch >> (log_rows + 3), row = (ch >> 3) & ((int)p.rows - 1);
            const int col = (cb << 5) | ((w ^ (row & 7)) << 2);
            const long long key = ((i >> log_chunks) << log_rows) + row;
            float e[4] = {0.f, 0.f, 0.f, 0.f};
            if (key < p.src_rows) {
                const float* r = src + key * p.src_s.row;
                if (vec) {
                    if (col < p.src_cols) {
                        const float4 x = *reinterpret_cast<const float4*>(r + col);
                        e[0] = x.x, e[1] = x.y, e[2] = x.z, e[3] = x.w;
                    }
                } else {
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        if (col + c < p.src_cols) e[c] = r[(col + c) * p.src_s.col];
                }
            }
            // the image chunk: tile, column block of rows rows, row, chunk
            const long long at = ((i >> log_chunks) << log_chunks) +
                                 ((long long)cb << (log_rows + 3)) + (row << 3) + w;
            float4 hi;
            float* hs = reinterpret_cast<float*>(&hi);
#pragma unroll
            for (int c = 0; c < 4; ++c) hs[c] = __uint_as_float(to_tf32(e[c]));
            dst[at] = hi;
        }
    }
}

// V^T images: a block transposes 32 keys x 32 columns at a time through shared memory
// (reads along the head dim; the writes of 32 keys of one column land in one 128-byte row
// segment); blockIdx.x picks the 32 x 32 piece, block rows y the batch entries. rows and
// cols are powers of two, as for tf32_image_k.
__global__ void __launch_bounds__(256) tf32_image_vt(const Tf32Prep p) {
    __shared__ float piece[32][33];
    const int log_rows = __ffs((int)p.rows) - 1, rows = (int)p.rows, cols = (int)p.cols;
    const long long tiles = (p.src_rows + p.rows - 1) >> log_rows;
    const long long key_pieces = (tiles << log_rows) >> 5;
    const long long n0 = (blockIdx.x % key_pieces) * 32, d0 = (blockIdx.x / key_pieces) * 32;
    const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    const long long n = n0 + tx;  // the key this thread writes
    const int pos = tf32_key_position((int)n & (rows - 1));
    const long long at = ((n >> log_rows) << log_rows) * cols;  // its tile
    for (long long b = blockIdx.y; b < p.entries; b += gridDim.y) {
        const float* src = reinterpret_cast<const float*>(p.src) +
                           batch_offset(p.src_s, b, p.batch1, p.batch2);
        __syncthreads();  // the previous entry's piece is read
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const long long key = n0 + ty + 8 * i, d = d0 + tx;
            piece[ty + 8 * i][tx] = key < p.src_rows && d < p.src_cols
                                        ? src[key * p.src_s.row + d * p.src_s.col]
                                        : 0.f;
        }
        __syncthreads();
        float* tile =
            reinterpret_cast<float*>(p.dst) + (b * tiles << log_rows) * cols + at;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int d = (int)d0 + ty + 8 * i;
            float* to =
                tile + (pos >> 5) * cols * 32 + d * 32 + ((((pos >> 2) & 7) ^ (d & 7)) << 2) + (pos & 3);
            to[0] = __uint_as_float(to_tf32(piece[tx][ty + 8 * i]));
        }
    }
}

namespace {

// The consumers' Q: each warpgroup's 64 rows (from query row m0; q at that row) into
// q_s, rounded to TF32 in place, visible to the tensor cores and to every consumer.
template <int NUM_WG, int HEAD_DIM, bool ALIGNED>
__device__ __forceinline__ void load_q_tf32(float* q_s, const float* q, const AttnParams& p,
                                            long long m0) {
    constexpr int CONSUMERS = NUM_WG * 128, Q_ELEMS = 64 * HEAD_DIM;
#pragma unroll
    for (int w = 0; w < NUM_WG; ++w)
        load_tile<64, HEAD_DIM, CONSUMERS, ALIGNED>(
            q_s + w * Q_ELEMS, q + w * 64 * p.q_s.row, p.q_s.row, p.q_s.col,
            p.seqlen_q - m0 - w * 64, p.head_dim, Sw128<64, 4>());
    cp_async_commit();
    cp_async_wait<0>();
#pragma unroll
    for (int w = 0; w < NUM_WG; ++w)
        round_own_tf32<64, HEAD_DIM, CONSUMERS, ALIGNED, false, Q_ELEMS>(q_s + w * Q_ELEMS,
                                                                        Sw128<64, 4>());
    fence_proxy_async();     // Q visible to the tensor cores ...
    bar_sync(NUM_WG + 1, CONSUMERS);  // ... and to every consumer
}

// This warp's 16 rows of its warpgroup's Q tile (qw: TF32 in the 128-byte swizzle) as TF32
// A fragments: rows g, g + 8 and k = t, t + 4 of every 8 columns.
template <int K8>
__device__ __forceinline__ void q_fragments(unsigned (&q_frag)[K8][4], const float* qw,
                                            int warp, int lane) {
    const int r = 16 * (warp % 4) + lane / 4, c = lane % 4;
#pragma unroll
    for (int kk = 0; kk < K8; ++kk) {
        q_frag[kk][0] = __float_as_uint(qw[Sw128<64, 4>()(r, 8 * kk + c)]);
        q_frag[kk][1] = __float_as_uint(qw[Sw128<64, 4>()(r + 8, 8 * kk + c)]);
        q_frag[kk][2] = __float_as_uint(qw[Sw128<64, 4>()(r, 8 * kk + c + 4)]);
        q_frag[kk][3] = __float_as_uint(qw[Sw128<64, 4>()(r + 8, 8 * kk + c + 4)]);
    }
}

}  // namespace

// The kernel. Block: NUM_WG (2 or 3) consumer warpgroups (64 query rows each: the products
// and the softmax) and one producer warpgroup, whose first lane hands tiles of K and V^T to
// the copy engine into STAGES slots: slot s is filled when its `empty` barrier says every
// consumer warp has finished the tile it held (products waited for), and each consumer
// waits on the slot's `full` barrier (one arrival plus the bytes of both copies). Per key
// tile t a consumer warpgroup issues O += P(t-1) V(t-1) and S(t) = Q K(t)^T together,
// releases slot t - 1 once the first is done, then runs the softmax of tile t while the
// tensor cores serve the others: the warpgroups take turns to issue (named barriers 1 ..
// NUM_WG in a ring), so that one's softmax runs under the others' products
// (FlashAttention-3's schedule). Q is copied and rounded by the consumers before the loop,
// as in the other instance, while the first tiles arrive; QREG keeps it as TF32 register
// fragments (S by the register form). Three warpgroups share each K and V^T tile among 192
// rows: two-thirds of the L2 traffic per FLOP of two, and L2 bandwidth (about 3.6 TB/s)
// bounds these kernels. Results are bit for bit those of
// attention_fwd_sm90_tf32 with the same key tiles and 128-row blocks (same products in the
// same order on the same operands); with 192-row blocks too where no band is set (a band
// can make a tile masked for one block height and interior for the other: mask_scores).
// Shared mem: (NUM_WG * 64 * HEAD_DIM + STAGES * BLOCK_N * (HEAD_DIM + HEAD_DIM_V)) * 4
// bytes + 16 * STAGES bytes of barriers (FwdSm90PipedSmem in layouts.cuh).
template <typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N, int NUM_WG,
          int STAGES, bool QREG, bool ALIGNED>
__global__ void __launch_bounds__(NUM_WG * 128 + 128, 1)
    attention_fwd_sm90_tf32_piped(const AttnParams p) {
    constexpr int BLOCK_M = 64 * NUM_WG, DV_TILES = HEAD_DIM_V / 8;
    static_assert((HEAD_DIM == 64 || HEAD_DIM == 128) && (HEAD_DIM_V == 64 || HEAD_DIM_V == 128) &&
                      (BLOCK_N == 32 || BLOCK_N == 64 || BLOCK_N == 128),
                  "wgmma shapes of wgmma.cuh");
    static_assert(NUM_WG == 2 || NUM_WG == 3, "two or three consumer warpgroups");
    // registers per thread: the producer keeps 24, the consumers share the rest of the
    // block's allocation at launch ((NUM_WG + 1) x 128 threads x 65536 / that)
    constexpr int CONSUMER_REGS = NUM_WG == 2 ? 240 : 160;
    static_assert(NUM_WG * 128 * CONSUMER_REGS + 128 * 24 <= 65536, "register budgets");
    constexpr int Q_ELEMS = 64 * HEAD_DIM, K_ELEMS = BLOCK_N * HEAD_DIM,
                  VT_ELEMS = HEAD_DIM_V * BLOCK_N;
    constexpr unsigned K_BYTES = K_ELEMS * 4, SLOT_BYTES = (K_ELEMS + VT_ELEMS) * 4;

    using L = FwdSm90PipedSmem<HEAD_DIM, HEAD_DIM_V, NUM_WG, BLOCK_N, STAGES>;
    static_assert(L::full - L::slots == (long long)STAGES * SLOT_BYTES, "a slot's bytes");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    float* q_s = reinterpret_cast<float*>(smem_raw + L::q_s);      // [NUM_WG][64 x HEAD_DIM]
    float* slots = reinterpret_cast<float*>(smem_raw + L::slots);  // [STAGES][K, V^T tiles]
    static_assert(L::empty - L::full == 8 * STAGES, "one 8-byte barrier a slot");
    const unsigned full = smem_addr(smem_raw + L::full),  // [STAGES] barriers each
                   empty = full + 8 * STAGES;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
    const ForwardBlock<float, BiasT> blk = forward_block<float, BiasT>(p, BLOCK_M);
    const long long b = blk.b, m0 = blk.m0;
    const int seqlen_q = (int)p.seqlen_q, seqlen_k = (int)p.seqlen_k;
    const int off = seqlen_k - seqlen_q;
    const int m_last = min((int)m0 + BLOCK_M, seqlen_q) - 1;
    const Range keys = key_band(p, m0, m_last, BLOCK_N);
    const int n_lo = (int)keys.lo, n_hi = (int)keys.hi;

    const int tiles = n_lo < n_hi ? (n_hi - n_lo + BLOCK_N - 1) / BLOCK_N : 0;

    if (threadIdx.x == 0) {
        init_slot_barriers<STAGES>(full, empty, NUM_WG * 4);
        fence_mbar_init();
    }
    __syncthreads();  // the barriers ready for everyone: the first tiles' copies start now

    if (wg == NUM_WG) {  // the producer warpgroup: its registers go to the consumers
        setmaxnreg_dec<24>();
        if (warp == NUM_WG * 4 && lane == 0) {
            // tile t's K and V^T images (tf32_image_k, tf32_image_vt), one bulk copy each
            const float *k = blk.k, *v = blk.v;
            const int tile0 = n_lo / BLOCK_N;
            produce_tiles<STAGES>(tiles, full, empty, [&](int t, int s, unsigned bar) {
                mbar_expect_tx(bar, SLOT_BYTES);
                const unsigned dst = smem_addr(slots) + s * SLOT_BYTES;
                const long long tile = tile0 + t;
                bulk_copy(dst, k + tile * K_ELEMS, K_BYTES, bar);
                bulk_copy(dst + K_BYTES, v + tile * VT_ELEMS, VT_ELEMS * 4, bar);
            });
        }
        return;
    }

    // the consumers: Q, rounded to TF32 in place while the first tiles arrive
    load_q_tf32<NUM_WG, HEAD_DIM, ALIGNED>(q_s, blk.q, p, m0);
    setmaxnreg_inc<CONSUMER_REGS>();

    float acc[DV_TILES][4], m[2], l[2];
    clear_row_state(acc, m, l);
    const SoftmaxExp2<float> exp2_fn(lane);
    const unsigned q_base = smem_addr(q_s + wg * Q_ELEMS), slot_base = smem_addr(slots);
    const int row0 = (int)m0 + 64 * wg + 16 * (warp % 4);  // first row of this warp's tile
    const Turns turns(wg, NUM_WG, tiles);  // ping-pong (pipeline.cuh)

    // QREG: this warp's 16 rows of Q as TF32 A fragments, so that S reads only K from shared
    // memory
    unsigned q_frag[QREG ? HEAD_DIM / 8 : 1][4];
    if constexpr (QREG) q_fragments(q_frag, q_s + wg * Q_ELEMS, warp, lane);
    unsigned p_frag[BLOCK_N / 8][4];  // P of the previous tile (the A operand of its P V)
    float sc[BLOCK_N / 8][4];
    auto issue_s = [&](int t) {
        const unsigned k_tile = slot_base + (t % STAGES) * SLOT_BYTES;
        if constexpr (QREG) {
            product_rs_tf32<BLOCK_N, HEAD_DIM>(sc, q_frag, k_tile, false);
        } else {
            wgmma_fence();
            product_ss<BLOCK_N, HEAD_DIM, float>(sc, q_base, k_tile);
        }
    };
    auto issue_pv = [&](int t) {  // O += P(t) V(t)
        product_rs_tf32<HEAD_DIM_V, BLOCK_N>(
            acc, p_frag, slot_base + (t % STAGES) * SLOT_BYTES + K_BYTES, true);
    };
    auto release = [&](int t) {  // every product on slot t % STAGES is done
        if (lane == 0) mbar_arrive(empty + 8 * (t % STAGES));
    };
    auto softmax = [&](int t) {  // of S(t), into the row state, O's rescale and P(t)
        const int n0 = n_lo + t * BLOCK_N;
        const bool interior = !HAS_MASK && forward_tile_interior<BLOCK_M, BLOCK_N>(
                                               p, m0, m_last, n0, seqlen_q, seqlen_k, off);
        const float scale = mask_scores<BLOCK_N, HAS_MASK>(sc, p, row0, n0, lane, interior,
                                                           blk.mask, blk.bias);
        update_row_state<BLOCK_N, DV_TILES>(sc, m, l, acc, scale, exp2_fn);
        tf32_fragments<BLOCK_N>(p_frag, sc);
    };
    pingpong_tiles<NUM_WG, STAGES, false>(tiles, full, turns.mine, turns.next, wg, issue_s,
                                          issue_pv, release, softmax, [](int) {});

    store_rows<float, DV_TILES>(acc, l, m, p, b, row0, lane);  // normalise and store
}
