// attention_portable.cu -- tiled online-softmax attention on CUDA cores, every dtype.
//
// Computes:   out[b, i, :] = sum_j softmax_j(s[b, i, j]) v[b, j, :] and
//             lse[b, i] = log sum_j exp(s[b, i, j]), with s = scale * q_i . k_j, then
//             softcap, bias and masking exactly as
//             cuattn/reference.py::attention_reference defines them.
// Layout:     q (batch, Sq, D), k (batch, Sk, D), v (batch, Sk, Dv), out (batch, Sq, Dv),
//             lse (batch, Sq); mask and bias (batch, Sq, Sk); every tensor is addressed
//             through explicit element strides in AttnParams (common.cuh), with three
//             collapsed batch axes, so broadcast axes (stride 0), GQA views, (B, S, H, D)
//             layouts and key-padding masks cost no copy.
// Ownership:  one block of 256 threads owns BLOCK_M query rows and DV_TILE output columns
//             of one batch entry (grid: m blocks fastest, then Dv tiles, then batch). The
//             threads form a 16 x 16 grid: thread (ty, tx) owns rows ty*TM .. ty*TM+TM-1 of
//             the tile, score columns tx + 16*j, and output columns (tx + 16*u)*VEC + e.
//             The 16 threads of one row group sit in one half-warp, so row reductions are
//             four shuffles.
// Algorithm:  for each BLOCK_N-key tile that the causal/window band reaches:
//             S = Q K^T (D in chunks of D_TILE; Q stays in shared memory when D <= D_TILE),
//             then scale, softcap, bias, mask in log2 units; update the row state
//             (m, l, alpha); P -> shared memory; acc = alpha * acc + P V.
//             Nothing of size Sq x Sk is written to global memory.
// Template:   T storage type; BiasT bias storage type (NoBias: no bias); HAS_MASK whether a
//             bool mask is read (both compile out of the plain path, which saves registers);
//             PIPELINED: tiles arrive by cp.async (float32/float64 with D <= D_TILE; 16-bit
//             inputs convert on load instead): K one tile ahead into two stages, V into one
//             buffer while the scores of its own tile are computed; two barriers per tile;
//             BLOCK_M, BLOCK_N tile rows of Q and K; D_TILE contraction chunk; DV_TILE output
//             columns per block (all multiples of 16); MIN_BLOCKS for __launch_bounds__;
//             ALIGNED (pipelined only): the copies move 16-byte chunks (unit column strides,
//             16-byte row strides and pointers, head dims multiples of 16 bytes); CHUNKED:
//             D > D_TILE, each chunk's dot products summed apart and then added to the
//             scores (a blocked sum, as BLAS adds: one chain of 400-odd float32 products
//             is less accurate), in registers that one-chunk instances do not hold.
// Shared mem: (BLOCK_M*(D_TILE+PAD) + KV + BLOCK_M*(BLOCK_N+PAD)) * sizeof(Acc<T>),
//             PAD = 16 bytes of Acc<T>, KV = BLOCK_N*(max(D_TILE, DV_TILE)+PAD), or
//             2*BLOCK_N*(D_TILE+PAD) + BLOCK_N*(DV_TILE+PAD) when PIPELINED;
//             the layout: FwdPortableSmem (layouts.cuh, from cuattn/families/portable.py).
// Reference:  cuattn/reference.py::attention_reference (float64) and ::attention_blocked
//             (this loop, in NumPy).
#include "portable/portable_tiles.cuh"

namespace {

using namespace cuattn;
using namespace cuattn::portable;

// Turn raw dot products into log2-unit scores: scale (with softcap), bias, mask. Disallowed
// positions (outside the sequence, the causal/window band or the bool mask) become -inf.
// `interior` (block-uniform) says the whole tile lies inside the sequences and the band
// and no bool mask is read: then only the scaling (and bias) is applied.
// Element (i, j) of s is row row0 + ROW_STEP i, column c0 + COL_STEP j.
template <int TM, int TN, bool HAS_MASK, int ROW_STEP = 1, int COL_STEP = 16, typename A,
          typename BiasT>
__device__ __forceinline__ void mask_scores(A (&s)[TM][TN], const AttnParams& p,
                                            long long row0, long long c0, bool interior,
                                            const unsigned char* mask, const BiasT* bias) {
    const A scale_log2 = A(p.scale * LOG2E);
    const A softcap = A(p.softcap);
    const A cap_over_scale = p.softcap > 0 ? A(p.scale / p.softcap) : A(0);
    if (interior && softcap == A(0) && is_same_v<BiasT, NoBias>) {
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) s[i][j] *= scale_log2;
        return;
    }
    // The sequence ends and the band (in_window in common.cuh) become 32-bit limits on
    // ROW_STEP i, COL_STEP j and their difference, compared against compile-time constants
    // in the loop.
    const long long off = p.seqlen_k - p.seqlen_q;
    auto clamp = [](long long x) { return (int)max(-(1LL << 30), min(x, 1LL << 30)); };
    const int rows_in = clamp(p.seqlen_q - row0), cols_in = clamp(p.seqlen_k - c0);
    const int band_hi = p.window_right < 0 ? (1 << 30) : clamp(row0 + off + p.window_right - c0);
    const int band_lo = p.window_left < 0 ? -(1 << 30) : clamp(row0 + off - p.window_left - c0);
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int ri = ROW_STEP * i;
        const long long r = row0 + ri;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int cj = COL_STEP * j;
            const long long c = c0 + cj;
            bool allowed = ri < rows_in && cj < cols_in && cj - ri <= band_hi &&
                           cj - ri >= band_lo;
            if constexpr (HAS_MASK)
                if (allowed) allowed = mask[r * p.mask_s.row + c * p.mask_s.col] != 0;
            A x = s[i][j];
            x = softcap > 0 ? softcap * A(LOG2E) * tanh_acc(x * cap_over_scale) : x * scale_log2;
            if constexpr (!is_same_v<BiasT, NoBias>)
                if (allowed) x += to_acc(bias[r * p.bias_s.row + c * p.bias_s.col]) * A(LOG2E);
            s[i][j] = allowed ? x : neg_inf<A>();
        }
    }
}

// Online softmax: fold one tile of scores into the row state (m, l) and turn the scores
// into probabilities p = exp2(s - m_new); returns alpha = exp2(m_old - m_new) per row.
template <int TM, int TN, typename A>
__device__ __forceinline__ void update_row_state(A (&s)[TM][TN], A (&m)[TM], A (&l)[TM],
                                                 A (&alpha)[TM]) {
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        A tile_max = neg_inf<A>();
#pragma unroll
        for (int j = 0; j < TN; ++j) tile_max = max_acc(tile_max, s[i][j]);
        // the 16 threads that share a row are lanes 0-15 or 16-31 of one warp
#pragma unroll
        for (int offset = 8; offset > 0; offset >>= 1)
            tile_max = max_acc(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
        const A m_new = max_acc(m[i], tile_max);
        // a row with nothing allowed so far keeps m = -inf; subtract 0 instead so that
        // exp2 gives 0 rather than exp2(-inf - -inf) = NaN
        const A m_use = m_new == neg_inf<A>() ? A(0) : m_new;
        alpha[i] = fast_exp2(m[i] - m_use);
        A tile_sum = A(0);
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            s[i][j] = fast_exp2(s[i][j] - m_use);
            tile_sum += s[i][j];
        }
#pragma unroll
        for (int offset = 8; offset > 0; offset >>= 1)
            tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, offset);
        l[i] = l[i] * alpha[i] + tile_sum;
        m[i] = m_new;
    }
}

// S = Q K^T for key tile n0 on the cp.async pipeline, its K in stage `stage`; the copies of
// the next tile's K and of this tile's V are issued around the barrier. rows_out: this
// thread's rows take nothing from the tile (no product).
template <int BLOCK_N, int D_TILE, int PAD, int K_ELEMS, int TM, int TN, typename A,
          typename RequestK, typename RequestV>
__device__ __forceinline__ void pipelined_scores(A (&s)[TM][TN], A* q_s, A* kv_s,
                                                 long long n0, long long n_hi, int stage,
                                                 bool rows_out, int tx, int ty,
                                                 const RequestK& request_k,
                                                 const RequestV& request_v) {
    // the next tile's K into the other stage, which the previous iteration's scores
    // read before its second barrier
    if (n0 + BLOCK_N < n_hi) request_k(n0 + BLOCK_N, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();  // everything but the group just issued has landed ...
    __syncthreads();     // ... for every thread: this tile's K (and Q); and every
                         // thread is past the previous P V, so V and P are free
    request_v(n0);       // lands while the scores are computed
    cp_async_commit();
    if (!rows_out) scores<TM, TN, D_TILE, PAD>(s, q_s, kv_s + stage * K_ELEMS, tx, ty);
}

// P (the probabilities in s) into its shared tile of pitch PP: row ty*TM + i, column tx + 16 j
template <int PP, int TM, int TN, typename A>
__device__ __forceinline__ void store_p(A* p_s, const A (&s)[TM][TN], int tx, int ty) {
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) p_s[(ty * TM + i) * PP + tx + 16 * j] = s[i][j];
}

// acc = alpha * acc + P V for one key tile
template <int TM, int TV, int BLOCK_N, int DV_TILE, int PAD, typename A>
__device__ __forceinline__ void rescale_and_accumulate(A (&acc)[TM][TV], const A (&alpha)[TM],
                                                       const A* p_s, const A* v_s, int tx,
                                                       int ty) {
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int c = 0; c < TV; ++c) acc[i][c] *= alpha[i];
    accumulate<TM, TV, BLOCK_N, DV_TILE, PAD>(acc, p_s, v_s, tx, ty);
}

// The row state before the first tile: m -inf, l 0, acc 0.
template <int TM, int TV, typename A>
__device__ __forceinline__ void clear_row_state(A (&m)[TM], A (&l)[TM], A (&acc)[TM][TV]) {
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        m[i] = neg_inf<A>();
        l[i] = A(0);
#pragma unroll
        for (int c = 0; c < TV; ++c) acc[i][c] = A(0);
    }
}

// The end of the online softmax: out = acc / l for this thread's rows
// row0 + Y_STEP y + ROW_STEP i and columns col0 + (x + COL_STEP u) VEC + e (computed in
// col0's type: int where the columns are the tile's own), and lse = m ln 2 + log l, written
// by the thread with x == 0 of column tile 0. A row with no allowed key has l == 0: out 0,
// lse -inf.
template <typename T, int Y_STEP, int ROW_STEP, int COL_STEP, int TM, int TV, typename A,
          typename C>
__device__ __forceinline__ void store_rows(const A (&acc)[TM][TV], const A (&m)[TM],
                                           const A (&l)[TM], const AttnParams& p, long long b,
                                           long long row0, int y, C col0, long long col_tile,
                                           int x) {
    constexpr int VEC = 16 / sizeof(A);
    T* out = reinterpret_cast<T*>(p.out) + batch_offset(p.out_s, b, p.batch1, p.batch2);
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const long long r = row0 + y * Y_STEP + ROW_STEP * i;
        if (r >= p.seqlen_q) continue;  // rows past the end of a partial tile
        const A inv_l = l[i] == A(0) ? A(0) : A(1) / l[i];
#pragma unroll
        for (int u = 0; u < TV / VEC; ++u)
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const long long c = col0 + (x + COL_STEP * u) * VEC + e;
                if (c < p.head_dim_v)  // columns past Dv in the last tile
                    out[r * p.out_s.row + c * p.out_s.col] = from_acc<T>(acc[i][u * VEC + e] * inv_l);
            }
        if (p.lse && col_tile == 0 && x == 0) {
            A* lse = reinterpret_cast<A*>(p.lse) + batch_offset(p.lse_s, b, p.batch1, p.batch2);
            lse[r * p.lse_s.row] = l[i] == A(0) ? neg_inf<A>() : m[i] * A(LN2) + log_acc(l[i]);
        }
    }
}

}  // namespace

template <typename T, typename BiasT, bool HAS_MASK, int BLOCK_M, int BLOCK_N, int D_TILE,
          int DV_TILE, int MIN_BLOCKS, bool PIPELINED, bool ALIGNED, bool CHUNKED = false>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS) attention_fwd_portable(const AttnParams p) {
    using A = Acc<T>;
    static_assert(!PIPELINED || sizeof(T) == sizeof(A), "the cp.async pipeline copies T as is");
    static_assert(PIPELINED || !ALIGNED, "16-byte copies are a pipelined path");
    constexpr int VEC = 16 / sizeof(A);
    constexpr int PAD = VEC;
    constexpr int TM = BLOCK_M / 16, TN = BLOCK_N / 16, TV = DV_TILE / 16;
    static_assert(BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0 && D_TILE % 16 == 0 &&
                  DV_TILE % (16 * VEC) == 0, "tile sizes must be multiples of 16 (DV_TILE of 16*VEC)");

    // Shared memory. Pipelined: Q, two K stages, one V buffer, P. Otherwise: Q, one buffer
    // that holds K and then V, P.
    constexpr int K_ELEMS = BLOCK_N * (D_TILE + PAD);
    using L = FwdPortableSmem<A, BLOCK_M, BLOCK_N, D_TILE, DV_TILE, PIPELINED>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* q_s = reinterpret_cast<A*>(smem_raw + L::q_s);    // [BLOCK_M][D_TILE + PAD]
    A* kv_s = reinterpret_cast<A*>(smem_raw + L::kv_s);  // see above
    A* p_s = reinterpret_cast<A*>(smem_raw + L::p_s);    // [BLOCK_M][BLOCK_N + PAD]

    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    // heaviest query blocks first: under causal masking the last rows see the most keys
    const BlockCoords blk = block_coords(p.num_m_blocks, p.num_dv_tiles,
                                         p.window_left >= 0 || p.window_right >= 0, true);
    const long long m_block = blk.row_block, dv_tile = blk.col_tile, b = blk.b;
    const long long m0 = m_block * BLOCK_M, c0 = dv_tile * DV_TILE;

    const T* q = reinterpret_cast<const T*>(p.q) + batch_offset(p.q_s, b, p.batch1, p.batch2) + m0 * p.q_s.row;
    const T* k = reinterpret_cast<const T*>(p.k) + batch_offset(p.k_s, b, p.batch1, p.batch2);
    const T* v = reinterpret_cast<const T*>(p.v) + batch_offset(p.v_s, b, p.batch1, p.batch2) + c0 * p.v_s.col;
    const unsigned char* mask = p.mask ? reinterpret_cast<const unsigned char*>(p.mask) +
                                             batch_offset(p.mask_s, b, p.batch1, p.batch2) : nullptr;
    const BiasT* bias = p.bias ? reinterpret_cast<const BiasT*>(p.bias) +
                                     batch_offset(p.bias_s, b, p.batch1, p.batch2) : nullptr;

    // The key range that the causal/window band reaches from rows m0 .. m_last; key tiles
    // outside it are skipped entirely.
    const long long off = p.seqlen_k - p.seqlen_q;
    const long long m_last = min(m0 + BLOCK_M, p.seqlen_q) - 1;
    const Range keys = key_band(p, m0, m_last, BLOCK_N);
    const long long n_lo = keys.lo, n_hi = keys.hi;

    const long long rows_q = p.seqlen_q - m0;
    const int num_d_chunks = (int)((p.head_dim + D_TILE - 1) / D_TILE);
    // pipelined copies: K of key tile n0 into stage `st`, V of key tile n0 into its buffer
    auto request_k = [&](long long n0, int st) {
        if constexpr (PIPELINED)
            load_tile_async<BLOCK_N, D_TILE, PAD, ALIGNED>(kv_s + st * K_ELEMS, k + n0 * p.k_s.row,
                                                  p.k_s.row, p.k_s.col, p.seqlen_k - n0, p.head_dim);
    };
    auto request_v = [&](long long n0) {
        if constexpr (PIPELINED)
            load_tile_async<BLOCK_N, DV_TILE, PAD, ALIGNED>(kv_s + 2 * K_ELEMS, v + n0 * p.v_s.row,
                                                   p.v_s.row, p.v_s.col, p.seqlen_k - n0,
                                                   p.head_dim_v - c0);
    };
    // Q stays in shared memory for the whole loop when the head dim fits one chunk (always
    // so when pipelined); the first loop iteration's barrier makes it visible.
    if constexpr (PIPELINED) {
        load_tile_async<BLOCK_M, D_TILE, PAD, ALIGNED>(q_s, q, p.q_s.row, p.q_s.col, rows_q, p.head_dim);
        if (n_lo < n_hi) request_k(n_lo, 0);
        cp_async_commit();
    } else if (num_d_chunks == 1) {
        load_tile<BLOCK_M, D_TILE, PAD>(q_s, q, p.q_s.row, p.q_s.col, rows_q, p.head_dim);
    }

    A m[TM], l[TM], acc[TM][TV];
    clear_row_state(m, l, acc);

    int stage = 0;
    for (long long n0 = n_lo; n0 < n_hi; n0 += BLOCK_N, stage ^= 1) {
        // this thread's rows may all lie outside the band for this tile (the upper rows of
        // a causal block on its last tiles) or past the end: their scores become -inf and
        // they take nothing from V, so both products are skipped (alpha is then 1, or the
        // row is still empty)
        const long long r0 = m0 + ty * TM;
        const bool rows_out = r0 >= p.seqlen_q ||
                              (p.window_right >= 0 && n0 > r0 + TM - 1 + off + p.window_right) ||
                              (p.window_left >= 0 && n0 + BLOCK_N - 1 < r0 + off - p.window_left);
        A s[TM][TN];
        clear_tile(s);
        if constexpr (PIPELINED)
            pipelined_scores<BLOCK_N, D_TILE, PAD, K_ELEMS>(s, q_s, kv_s, n0, n_hi, stage,
                                                            rows_out, tx, ty, request_k,
                                                            request_v);
        for (int dc = 0; !PIPELINED && dc < num_d_chunks; ++dc) {
            const long long d0 = (long long)dc * D_TILE;
            if (num_d_chunks > 1)
                load_tile<BLOCK_M, D_TILE, PAD>(q_s, q + d0 * p.q_s.col, p.q_s.row, p.q_s.col,
                                                rows_q, p.head_dim - d0);
            load_tile<BLOCK_N, D_TILE, PAD>(kv_s, k + n0 * p.k_s.row + d0 * p.k_s.col, p.k_s.row,
                                            p.k_s.col, p.seqlen_k - n0, p.head_dim - d0);
            __syncthreads();  // the Q and K chunks are in shared memory
            if (!rows_out) chunk_scores<TM, TN, D_TILE, PAD, CHUNKED>(s, q_s, kv_s, tx, ty);
            __syncthreads();  // every thread is done with this chunk before it is overwritten
        }
        // interior tile: inside both sequences and inside the band for every row of the block
        const bool interior = !HAS_MASK && n0 + BLOCK_N <= p.seqlen_k && m0 + BLOCK_M <= p.seqlen_q &&
                              (p.window_left < 0 || n0 >= m_last + off - p.window_left) &&
                              (p.window_right < 0 || n0 + BLOCK_N - 1 <= m0 + off + p.window_right);
        mask_scores<TM, TN, HAS_MASK>(s, p, r0, n0 + tx, interior, mask, bias);
        A alpha[TM];
        update_row_state(s, m, l, alpha);
        store_p<BLOCK_N + PAD>(p_s, s, tx, ty);
        // not pipelined: V reuses the K buffer, which the barrier after the last score
        // chunk freed
        if constexpr (!PIPELINED)
            load_tile<BLOCK_N, DV_TILE, PAD>(kv_s, v + n0 * p.v_s.row, p.v_s.row, p.v_s.col,
                                             p.seqlen_k - n0, p.head_dim_v - c0);
        else
            cp_async_wait<0>();  // this tile's V has landed (and the next K, issued earlier)
        __syncthreads();  // P and V are in shared memory
        const A* v_s = PIPELINED ? kv_s + 2 * K_ELEMS : kv_s;
        if (!rows_out)
            rescale_and_accumulate<TM, TV, BLOCK_N, DV_TILE, PAD>(acc, alpha, p_s, v_s, tx, ty);
        // P and the K/V buffer are consumed before the next tile overwrites them (pipelined:
        // the next iteration's first barrier does this)
        if constexpr (!PIPELINED) __syncthreads();
    }
    if constexpr (PIPELINED) cp_async_wait<0>();  // no copy may outlive the block

    store_rows<T, TM, 1, 16>(acc, m, l, p, b, m0, ty, c0, dv_tile, tx);  // normalise and store
}

// ---- the warp-tiled form ---------------------------------------------------------------
// attention_fwd_portable_warps: the same computation for float64 (and float32) with head
// dims up to 64, arranged to feed the FMA pipe with as few shared-memory passes per FMA as
// its registers allow (about half the DFMA peak on an H200). Eight warps; each owns 16
// query rows outright -- their scores, row state and P, which goes through a shared tile
// private to the warp, so the two products need no block barrier between them. The block
// shares Q (in shared memory for the whole loop) and the K and V tiles (cp.async; K in two
// stages, V in three; one barrier per key tile). Lane (ly, lx) owns rows ly + 4 i of its
// warp's 16 (i < 4), score columns lx + 8 j (j < BLOCK_N / 8) and output columns
// (lx + 8 u) VEC + e: every shared-memory read of the inner loops is one 16-byte load per
// lane without bank conflicts (four distinct Q or P rows, eight distinct K rows or one
// contiguous 128 bytes of V), with the lanes placed so that pairs share addresses (below),
// and row reductions are three shuffles.
// Two groups of four warps, one warp of each on every scheduler, run the same steps half a
// tile apart: between two barriers the early group does S = Q K^T, the softmax and P V of
// key tile t; the late group the softmax and P V of tile t - 1 (its scores kept in
// registers across the barrier), then S of tile t, so that one group's softmax (short on
// FMAs, long on dependent latency) runs beside the other's products (measured: +6 % causal,
// nothing non-causal; the softmax phase was not the main loss).
// LOCKSTEP: one K and one V buffer instead, every warp in step, two barriers per tile (K of
// the next tile is requested once every warp has its scores, V of this tile once every warp
// is done with the last one's P V): the shared memory that lets 64-key tiles fit, whose
// lane tiles of 4 x 8 in Q K^T take 0.75 of the shared-memory return rate per DFMA where
// 32-key tiles take all of it. With 16-byte copies (ALIGNED) the lockstep loop spreads
// each copy over a phase instead of issuing it after a barrier: V of tile t a row step at
// a time in the first half of Q K^T, K of tile t + 1 in the softmax, whose barrier moves
// before it (RowCopy, portable_tiles.cuh).
// P row ly + 4 i of a warp lives at row 4 ly + i of its tile, so that the four rows one
// store instruction writes fall in two bank halves (two ways of conflict, the least 256
// bytes take, where the plain order took four); P V reads its operands one step ahead
// (accumulate_ahead). For double the row max may go stale (LAZY_LOG2, below): most tiles
// then need no max, no rescale and no dependent chain before their exp2.
// Structure: the kernel's steps are lambdas (scores_of, softmax, pv, takes and the copies),
// and one of three tile loops composes them: staggered_loop (the two groups), lockstep_loop
// and spread_loop (LOCKSTEP, without and with the spread copies); softmax_tile is the
// softmax step.
// Shared mem: (BLOCK_M*(HEAD_DIM+PAD) + KS*BLOCK_N*(HEAD_DIM+PAD) + VS*BLOCK_N*(HEAD_DIM_V+PAD)
//             + BLOCK_M*(BLOCK_N+PAD)) * sizeof(T), BLOCK_M = 128, PAD = 16 bytes of T, K and
//             V stages KS, VS = 2, 3 (1, 1 with LOCKSTEP);
//             the layout: FwdPortableWarpsSmem (layouts.cuh, from cuattn/families/portable.py).
// The stale max (double only): a tile whose scores all lie within LAZY_LOG2 (log2 units)
// above their row's m is summed against that m as it stands: terms up to 2^LAZY_LOG2, far
// inside double's range, and acc / l and m ln 2 + log l unchanged. m stays the max of the
// tiles that took the exact step, so every score seen is at most m + LAZY_LOG2.
constexpr double LAZY_LOG2 = 8.0;

namespace {

// v[i] = max or sum of v[i] over the eight lanes that hold row ly + 4 i of the warp-tiled
// form (lane bits 0, 2 and 3: lx)
template <int RM, typename A> __device__ __forceinline__ void row_max(A (&v)[RM]) {
#pragma unroll
    for (int offset = 1; offset <= 8; offset = offset == 1 ? 4 : 2 * offset)
#pragma unroll
        for (int i = 0; i < RM; ++i) v[i] = max_acc(v[i], __shfl_xor_sync(0xffffffffu, v[i], offset));
}
template <int RM, typename A> __device__ __forceinline__ void row_sum(A (&v)[RM]) {
#pragma unroll
    for (int offset = 1; offset <= 8; offset = offset == 1 ? 4 : 2 * offset)
#pragma unroll
        for (int i = 0; i < RM; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], offset);
}

// The tile's terms against the row max as it stands (LAZY_LOG2, double): P = exp2(c s - m)
// into the warp's tile, part = this lane's row sums. Returns (warp-uniformly) whether some
// term exceeds 2^LAZY_LOG2, so that the exact step must run instead.
template <int PP, int RM, int TN, typename A, typename Exp2, typename Between>
__device__ __forceinline__ bool stale_max_terms(const A (&s)[RM][TN], const A (&m)[RM],
                                                A (&part)[RM], A c, A* p_w, int lx, int ly,
                                                const Exp2& exp2_row, const Between& between) {
    bool over = false;
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        part[i] = A(0);
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            if (j % 4 == 0) between((i * TN + j) / 4);
            const A x = fma(s[i][j], c, -m[i]);
            over |= x > A(LAZY_LOG2);
            const A pij = exp2_row(x);
            part[i] += pij;
            p_w[(4 * ly + i) * PP + lx + 8 * j] = pij;
        }
    }
    return __any_sync(0xffffffffu, over);
}

// The exact online-softmax step of the warp-tiled form, all RM rows at once so that their
// reductions and exp2 chains interleave: m rises to the row max of c s, P = exp2(c s - m)
// goes into the warp's tile (row ly + 4 i at 4 ly + i), l = alpha l + the row sums. Returns
// (warp-uniformly) whether some row's max moved, so that acc must be rescaled by alpha.
template <int RM, int TN, int PP, typename A, typename Exp2, typename Between>
__device__ __forceinline__ bool update_row_stats(const A (&s)[RM][TN], A (&m)[RM], A (&l)[RM],
                                                 A (&alpha)[RM], A c, A* p_w, int lx, int ly,
                                                 const Exp2& exp2_row, const Between& between) {
    A mx[RM], sum[RM];
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        mx[i] = s[i][0];
#pragma unroll
        for (int j = 1; j < TN; ++j) mx[i] = max_acc(mx[i], s[i][j]);
    }
    row_max(mx);
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        const A m_new = max_acc(m[i], mx[i] * c);
        mx[i] = m_new == neg_inf<A>() ? A(0) : m_new;  // m_use, as update_row_state
        alpha[i] = exp2_row(m[i] - mx[i]);
        m[i] = m_new;
        sum[i] = A(0);
    }
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            if (j % 4 == 0) between((i * TN + j) / 4);
            const A pij = exp2_row(fma(s[i][j], c, -mx[i]));
            sum[i] += pij;
            p_w[(4 * ly + i) * PP + lx + 8 * j] = pij;  // row ly + 4 i at 4 ly + i
        }
    row_sum(sum);
    bool moved = false;
#pragma unroll
    for (int i = 0; i < RM; ++i) {
        l[i] = l[i] * alpha[i] + sum[i];
        moved |= alpha[i] != A(1);
    }
    return __any_sync(0xffffffffu, moved);
}

// acc row i *= alpha[i] (the rescale update_row_stats asks for)
template <int RM, int TV, typename A>
__device__ __forceinline__ void rescale_rows(A (&acc)[RM][TV], const A (&alpha)[RM]) {
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int c = 0; c < TV; ++c) acc[i][c] *= alpha[i];
}

// The softmax of the held key tile, n0 = n_lo + held BLOCK_N, for the warp's rows
// w0 .. w0 + WARP_M - 1 (this lane's: r0 + 4 i, r0 = w0 + ly): scores to log2 units, the row
// state m, l, acc, and P into the warp's tile p_w. between(k) before every fourth exp2 of a
// row, k counting them (eight times a path for 64-key tiles). The kernel's scalars come by
// reference, as the softmax lambda that calls this captures them: taken by value, they
// change the code the compiler makes of the loop.
template <bool HAS_MASK, int WARP_M, int BLOCK_N, int PP, int RM, int TN, int TV, typename A,
          typename T, typename BiasT, typename Exp2, typename Between>
__device__ __forceinline__ void softmax_tile(A (&s)[RM][TN], A (&m)[RM], A (&l)[RM],
                                             A (&acc)[RM][TV], A* const& p_w,
                                             const AttnParams& p,
                                             const ForwardBlock<T, BiasT>& blk,
                                             const long long& w0, const long long& r0,
                                             const long long& n_lo, const int& held,
                                             const int& lx, const int& ly, const A& scale_log2,
                                             const bool& plain, const Exp2& exp2_row,
                                             const Between& between) {
    const long long n0 = n_lo + (long long)held * BLOCK_N;
    const bool interior = !HAS_MASK && tile_is_interior(p, w0, WARP_M, n0, BLOCK_N);
    // an interior tile without softcap or bias keeps its raw dot products: the scale
    // goes into the max and into the exp2 argument, fma(s, scale, -m)
    A c = scale_log2;
    if (!(interior && plain)) {
        mask_scores<RM, TN, HAS_MASK, 4, 8>(s, p, r0, n0 + lx, interior, blk.mask, blk.bias);
        c = A(1);
    }
    // double: where every row of the warp has a finite m and no score of the tile lies
    // more than LAZY_LOG2 above it, the tile is summed against m as it stands (no max,
    // no rescale). Otherwise (a row's first tile; a max that rose further) the P just
    // written is discarded and the exact step below runs. NaN scores give NaN terms on
    // both paths.
    if constexpr (sizeof(A) == 8) {
        bool finite = true;
#pragma unroll
        for (int i = 0; i < RM; ++i) finite &= m[i] - m[i] == A(0);
        if (__all_sync(0xffffffffu, finite)) {
            A part[RM];
            if (!stale_max_terms<PP>(s, m, part, c, p_w, lx, ly, exp2_row, between)) {
                row_sum(part);
#pragma unroll
                for (int i = 0; i < RM; ++i) l[i] += part[i];
                __syncwarp();
                return;
            }
        }
    }
    A alpha[RM];
    // rows whose max stayed put keep their acc as it is (alpha 1): most tiles of a row
    if (update_row_stats<RM, TN, PP>(s, m, l, alpha, c, p_w, lx, ly, exp2_row, between))
        rescale_rows(acc, alpha);
    __syncwarp();  // the warp's P is in shared memory
}

// The lockstep loop with 16-byte copies: V's copy (tile t) is spread over the first half of
// Q K^T, one row step every V_EVERY contraction steps, so that it issues between the FMAs
// and lands by the end of Q K^T; the second barrier then comes before the softmax (K (t) is
// free once every warp has its scores), and K's copy (tile t + 1) is spread over the
// softmax, a row step every four exp2 per row, where the exp2 chains leave issue slots.
// Issued in one burst after each barrier, the copies hold every warp for about 1,600
// cycles a tile (clock64 per phase); spread, the kernel runs 2 % faster. A warp that
// skips the tile's products issues its row steps at once. QK_STEPS: the contraction steps
// of Q K^T; k_copy(t), v_copy(t): the RowCopy of key tile t's K and V.
template <int QK_STEPS, typename Takes, typename ScoresOf, typename Softmax, typename Pv,
          typename KCopyOf, typename VCopyOf>
__device__ __forceinline__ void spread_loop(int tiles, const AttnParams& p, const Takes& takes,
                                            const ScoresOf& scores_of, const Softmax& softmax,
                                            const Pv& pv, const KCopyOf& k_copy,
                                            const VCopyOf& v_copy) {
    using KCopy = decltype(k_copy(0));
    using VCopy = decltype(v_copy(0));
    constexpr int V_EVERY = QK_STEPS >= 2 * VCopy::PARTS ? QK_STEPS / (2 * VCopy::PARTS) : 1;
    for (int t = 0; t < tiles; ++t) {
        cp_async_wait<0>();  // K (t) has landed ...
        __syncthreads();     // ... for every thread, and every warp is done with V (t - 1)
        const bool take = takes(t);
        VCopy vc = v_copy(t);
        int left = VCopy::PARTS;  // row steps of V still to issue
        if (take)
            scores_of(t, [&](int step) {
                if (step % V_EVERY == 0 && step / V_EVERY < VCopy::PARTS) {
                    vc.next(p.v_s.row);
                    --left;
                }
            });
        for (; left > 0; --left) vc.next(p.v_s.row);
        cp_async_commit();
        cp_async_wait<0>();  // V (t) has landed ...
        __syncthreads();     // ... for every thread, and every warp is done with K (t)
        // K of tile t + 1 (none after the last tile) between the softmax's exp2 chains
        KCopy kc = k_copy(t + 1);
        left = t + 1 < tiles ? KCopy::PARTS : 0;
        if (take)
            softmax([&](int) {
                if (left > 0) {
                    kc.next(p.k_s.row);
                    --left;
                }
            });
        for (; left > 0; --left) kc.next(p.k_s.row);
        cp_async_commit();
        if (take) pv();
    }
}

// The lockstep loop with copies issued after the barriers: V (t) once every warp is done
// with V (t - 1), K (t + 1) once every warp has its scores of K (t).
template <typename Takes, typename ScoresOf, typename Softmax, typename Pv, typename RequestK,
          typename RequestV>
__device__ __forceinline__ void lockstep_loop(int tiles, const Takes& takes,
                                              const ScoresOf& scores_of, const Softmax& softmax,
                                              const Pv& pv, const RequestK& request_k,
                                              const RequestV& request_v) {
    for (int t = 0; t < tiles; ++t) {
        cp_async_wait<0>();  // K (t) has landed ...
        __syncthreads();     // ... for every thread, and every warp is done with V (t - 1)
        request_v(t);
        cp_async_commit();
        const bool take = takes(t);
        if (take) {
            scores_of(t, NoSteps());
            softmax(NoSteps());
        }
        cp_async_wait<0>();  // V (t) has landed ...
        __syncthreads();     // ... for every thread, and every warp is done with K (t)
        if (t + 1 < tiles) request_k(t + 1);
        cp_async_commit();
        if (take) pv();
    }
}

// The two groups half a tile apart (K in two stages, V in three, one barrier per tile): the
// early group takes S, the softmax and P V of tile t; the late group the softmax and P V of
// the tile it holds (t - 1), then S of tile t. held: the tile whose scores a warp holds (-1:
// none).
template <typename Takes, typename ScoresOf, typename Softmax, typename Pv, typename RequestK,
          typename RequestV>
__device__ __forceinline__ void staggered_loop(int tiles, bool late, const int& held,
                                               const Takes& takes, const ScoresOf& scores_of,
                                               const Softmax& softmax, const Pv& pv,
                                               const RequestK& request_k,
                                               const RequestV& request_v) {
    // one pass more than there are tiles: the late group's last softmax and P V
    for (int t = 0; t <= tiles; ++t) {
        if (t < tiles) {
            cp_async_wait<0>();  // tile t has landed ...
            __syncthreads();     // ... for every thread; every warp is done with K (t - 1)
                                 // and V (t - 2), whose stages tile t + 1 takes
            if (t + 1 < tiles) {
                request_k(t + 1);
                request_v(t + 1);
            }
            cp_async_commit();
        }
        const bool take = takes(t);
        if (take && !late) scores_of(t, NoSteps());
        if (held >= 0) {
            softmax(NoSteps());
            pv();
        }
        if (take && late) scores_of(t, NoSteps());
    }
}

}  // namespace

template <typename T, typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V,
          int BLOCK_N, bool ALIGNED, bool LOCKSTEP>
__global__ void __launch_bounds__(THREADS, 1) attention_fwd_portable_warps(const AttnParams p) {
    using A = Acc<T>;
    static_assert(sizeof(T) == sizeof(A), "the cp.async pipeline copies T as is");
    constexpr int VEC = 16 / sizeof(A), PAD = VEC;
    constexpr int WARP_M = 16, BLOCK_M = WARP_M * THREADS / 32;
    constexpr int RM = WARP_M / 4, TN = BLOCK_N / 8, TV = HEAD_DIM_V / 8;  // per lane
    constexpr int QP = HEAD_DIM + PAD, VP = HEAD_DIM_V + PAD, PP = BLOCK_N + PAD;  // pitches
    constexpr int K_ELEMS = BLOCK_N * QP, V_ELEMS = BLOCK_N * VP;
    constexpr int KS = LOCKSTEP ? 1 : 2, VS = LOCKSTEP ? 1 : 3;  // stages of K and V
    static_assert(HEAD_DIM % VEC == 0 && HEAD_DIM_V % (8 * VEC) == 0 && BLOCK_N % 8 == 0 &&
                      BLOCK_N % VEC == 0, "tile shapes of the warp-tiled form");

    using L = FwdPortableWarpsSmem<A, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, LOCKSTEP>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* q_s = reinterpret_cast<A*>(smem_raw + L::q_s);  // [BLOCK_M][QP]
    A* k_s = reinterpret_cast<A*>(smem_raw + L::k_s);  // [KS][BLOCK_N][QP]
    A* v_s = reinterpret_cast<A*>(smem_raw + L::v_s);  // [VS][BLOCK_N][VP]
    A* p_s = reinterpret_cast<A*>(smem_raw + L::p_s);  // [BLOCK_M][PP]: 16 rows per warp

    // lane bits (b4 .. b0) = (ly1, lx2, lx1, ly0, lx0): lanes n and n ^ 1 read the same Q and
    // P addresses, lanes n and n ^ 2 the same K and V addresses, so that each 16-byte load
    // returns in two passes instead of four (shared memory returns 128 bytes per clock)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int lx = (lane & 1) | ((lane >> 1) & 6), ly = ((lane >> 1) & 1) | ((lane >> 3) & 2);
    const bool late = !LOCKSTEP && warp >= THREADS / 64;  // the second group of warps
    const ForwardBlock<T, BiasT> blk = forward_block<T, BiasT>(p, BLOCK_M);
    const long long m0 = blk.m0, b = blk.b;
    const T *q = blk.q, *k = blk.k, *v = blk.v;

    const long long off = p.seqlen_k - p.seqlen_q;
    const Range keys = key_band(p, m0, min(m0 + BLOCK_M, p.seqlen_q) - 1, BLOCK_N);
    const long long n_lo = keys.lo;
    const int tiles = keys.lo < keys.hi ? (int)((keys.hi - keys.lo + BLOCK_N - 1) / BLOCK_N) : 0;
    auto request_k = [&](int t) {  // key tile t: K into stage t % KS
        const long long n0 = n_lo + (long long)t * BLOCK_N;
        load_tile_async<BLOCK_N, HEAD_DIM, PAD, ALIGNED>(k_s + t % KS * K_ELEMS, k + n0 * p.k_s.row,
                                                         p.k_s.row, p.k_s.col, p.seqlen_k - n0,
                                                         p.head_dim);
    };
    auto request_v = [&](int t) {  // V into stage t % VS
        const long long n0 = n_lo + (long long)t * BLOCK_N;
        load_tile_async<BLOCK_N, HEAD_DIM_V, PAD, ALIGNED>(v_s + t % VS * V_ELEMS, v + n0 * p.v_s.row,
                                                           p.v_s.row, p.v_s.col, p.seqlen_k - n0,
                                                           p.head_dim_v);
    };
    load_tile_async<BLOCK_M, HEAD_DIM, PAD, ALIGNED>(q_s, q, p.q_s.row, p.q_s.col,
                                                     p.seqlen_q - m0, p.head_dim);
    if (tiles > 0) {
        request_k(0);
        if (!LOCKSTEP) request_v(0);
    }
    cp_async_commit();

    // this warp's rows: r0 + 4 i
    const long long w0 = m0 + warp * WARP_M, r0 = w0 + ly;
    const A* q_w = q_s + (warp * WARP_M + ly) * QP;
    A* p_w = p_s + warp * WARP_M * PP;
    A m[RM], l[RM], acc[RM][TV];
    clear_row_state(m, l, acc);
    // exp2 of the softmax: float exp2f; double exp2_lanes (common.cuh), 2^(j/32) per lane
    const A lane_fraction = sizeof(A) == 8 ? A(EXP2_FRACTIONS[lane]) : A(0);
    auto exp2_row = [&](A x) -> A {
        if constexpr (sizeof(A) == 8) return exp2_lanes(x, lane_fraction);
        else return fast_exp2(x);
    };
    const A scale_log2 = A(p.scale * LOG2E);
    const bool plain = p.softcap == 0 && is_same_v<BiasT, NoBias>;

    A s[RM][TN];  // the scores of key tile `held` (-1: none)
    int held = -1;
    // s = Q K^T for key tile t: rows ly + 4 i, keys lx + 8 j; the contraction unrolled,
    // between(step) at the head of each step
    auto scores_of = [&](int t, const auto& between) {
        clear_tile(s);
        scores_strided<RM, TN, HEAD_DIM, PAD, 4, 8, HEAD_DIM / VEC>(
            s, q_w, k_s + t % KS * K_ELEMS + lx * QP, 0, 0, between);
        held = t;
    };
    auto softmax = [&](const auto& between) {  // the held tile's softmax (softmax_tile)
        softmax_tile<HAS_MASK, WARP_M, BLOCK_N, PP>(s, m, l, acc, p_w, p, blk, w0, r0, n_lo, held,
                                                    lx, ly, scale_log2, plain, exp2_row, between);
    };
    // acc[i][u VEC + f] += sum_n P[ly + 4 i, n] V[n, (lx + 8 u) VEC + f] (P row 4 ly + i)
    auto pv = [&]() {
        accumulate_ahead<RM, TV, BLOCK_N, HEAD_DIM_V, PAD, 1, 8>(
            acc, p_w, v_s + held % VS * V_ELEMS, 4 * ly, lx);
        __syncwarp();  // P is read before the warp's next tile overwrites it
        held = -1;
    };
    // the warp's 16 rows all past the end or outside the band for key tile t: they take
    // nothing from it (alpha 1), so the warp skips it
    auto takes = [&](int t) {
        const long long n0 = n_lo + (long long)t * BLOCK_N;
        return t < tiles && w0 < p.seqlen_q &&
               (p.window_right < 0 || n0 <= w0 + WARP_M - 1 + off + p.window_right) &&
               (p.window_left < 0 || n0 + BLOCK_N - 1 >= w0 + off - p.window_left);
    };

    // the copies spread over the phases of the lockstep loop when they are 16-byte row steps
    using KCopy = RowCopy<BLOCK_N, HEAD_DIM, PAD, A>;
    using VCopy = RowCopy<BLOCK_N, HEAD_DIM_V, PAD, A>;
    if constexpr (LOCKSTEP && ALIGNED && KCopy::FITS && VCopy::FITS) {
        auto v_copy = [&](int t) {
            const long long n0 = n_lo + (long long)t * BLOCK_N;
            return VCopy(v_s + t % VS * V_ELEMS, v + n0 * p.v_s.row, p.v_s.row, p.seqlen_k - n0,
                         p.head_dim_v);
        };
        auto k_copy = [&](int t) {
            const long long n0 = n_lo + (long long)t * BLOCK_N;
            return KCopy(k_s + t % KS * K_ELEMS, k + n0 * p.k_s.row, p.k_s.row, p.seqlen_k - n0,
                         p.head_dim);
        };
        spread_loop<HEAD_DIM / VEC>(tiles, p, takes, scores_of, softmax, pv, k_copy, v_copy);
    } else if constexpr (LOCKSTEP) {
        lockstep_loop(tiles, takes, scores_of, softmax, pv, request_k, request_v);
    } else {
        staggered_loop(tiles, late, held, takes, scores_of, softmax, pv, request_k, request_v);
    }
    cp_async_wait<0>();  // no copy may outlive the block
    store_rows<T, 0, 4, 8>(acc, m, l, p, b, r0, 0, 0, 0, lx);  // normalise and store
}
