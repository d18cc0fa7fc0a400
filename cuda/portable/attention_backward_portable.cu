// attention_backward_portable.cu -- the backward of attention on CUDA cores, every dtype.
//
// Computes:   the gradients of out = softmax(s) v with respect to q, k and v, where s is the
//             forward's score (scale, softcap, bias, masking as cuattn/reference.py), by
//             FlashAttention-2's recomputation: with delta_i = sum_c dout[i, c] out[i, c]
//             and the forward's lse, each tile of
//                 P  = exp(s - lse)                      (0 where the key is not allowed)
//                 dP = dO V^T
//                 dS = P o (dP - delta)                  (times 1 - tanh^2 under softcap)
//             is rebuilt on chip, and dV = P^T dO, dK = scale dS^T Q, dQ = scale dS K.
//             Nothing of size Sq x Sk is written to global memory.
// Kernels:    attention_bwd_delta   (backward.cuh) one warp per query row: delta.
//             attention_bwd_dkdv    one block owns BLOCK_N keys and one D_TILE-column tile
//                                   of dK and dV; it walks the query tiles that the band
//                                   reaches and keeps dK, dV in registers.
//             attention_bwd_dq      one block owns BLOCK_M query rows and one column tile of
//                                   dQ; it walks the key tiles of the band.
//             Each gradient element is written by exactly one thread, once, after a loop
//             in a fixed order: no atomics, so repeated calls are bit-identical.
// Layout:     every tensor through explicit element strides (AttnBwdParams, common.cuh) with
//             three collapsed batch axes; dq, dk, dv have the full broadcast batch shape here
//             (cuattn/attention.py sums them over broadcast axes afterwards).
// Threads:    256 as a 16 x 16 grid (portable_tiles.cuh). dK/dV kernel: thread (ty, tx) owns
//             keys ty*TN .. ty*TN+TN-1 of the block and query columns tx + 16*j of each score
//             tile; dQ kernel: query rows ty*TM .. and key columns tx + 16*j.
// Template:   T storage type of the inputs; G of the gradients (T, or Acc<T> for a gradient
//             that Python sums over broadcast axes afterwards); BiasT (NoBias: none); HAS_MASK; BLOCK_M, BLOCK_N tile rows of Q
//             and K; D_TILE contraction chunk and output-column tile; RESIDENT: both head dims
//             fit in one D_TILE, so the block's own K, V (dK/dV) or Q, dO (dQ) stay in shared
//             memory and serve both the scores and the gradient products; otherwise every
//             tile is re-read per chunk and the column tiles recompute the scores. TF32:
//             q, k and v as TF32 tensor cores read them (a TF32 forward's operands), so
//             that P = exp(s - lse) is rebuilt from the scores whose lse the forward wrote.
// Shared mem: dK/dV: 2*BLOCK_N*(D_TILE+PAD) + 2*BLOCK_M*(D_TILE+PAD) + 2*BLOCK_N*(BLOCK_M+PAD);
//             dQ:    2*BLOCK_M*(D_TILE+PAD) + 2*BLOCK_N*(D_TILE+PAD) + BLOCK_M*(BLOCK_N+PAD)
//             elements of Acc<T>, PAD = 16 bytes; the layouts: BwdPortableDkdvSmem, BwdPortableDqSmem.
// Reference:  cuattn/reference.py::attention_backward_reference (float64, dense) and
//             ::attention_backward_blocked (this loop order, in NumPy).
#include "common/backward.cuh"
#include "portable/portable_tiles.cuh"

using namespace cuattn;
using namespace cuattn::portable;

template <typename T, typename G, typename BiasT, bool HAS_MASK, int BLOCK_M, int BLOCK_N,
          int D_TILE, bool RESIDENT, int MIN_BLOCKS, bool TF32 = false>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS) attention_bwd_dkdv(const AttnBwdParams bp) {
    using A = Acc<T>;
    constexpr int VEC = 16 / sizeof(A), PAD = VEC;
    constexpr int TN = BLOCK_N / 16, TQ = BLOCK_M / 16, TC = D_TILE / 16;
    static_assert(BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0 && D_TILE % (16 * VEC) == 0,
                  "BLOCK_M, BLOCK_N must be multiples of 16, D_TILE of 16*VEC");
    const AttnParams& p = bp.f;

    using L = BwdPortableDkdvSmem<A, BLOCK_M, BLOCK_N, D_TILE>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* k_s = reinterpret_cast<A*>(smem_raw + L::k_s);    // [BLOCK_N][D_TILE + PAD]
    A* v_s = reinterpret_cast<A*>(smem_raw + L::v_s);    // [BLOCK_N][D_TILE + PAD]
    A* q_s = reinterpret_cast<A*>(smem_raw + L::q_s);    // [BLOCK_M][D_TILE + PAD]
    A* do_s = reinterpret_cast<A*>(smem_raw + L::do_s);  // [BLOCK_M][D_TILE + PAD]
    A* p_s = reinterpret_cast<A*>(smem_raw + L::p_s);    // [BLOCK_N][BLOCK_M + PAD]: P^T
    A* ds_s = reinterpret_cast<A*>(smem_raw + L::ds_s);  // [BLOCK_N][BLOCK_M + PAD]: dS^T

    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    // heaviest key blocks first: under causal masking the first keys are seen by the most rows
    const BlockCoords blk = block_coords(bp.num_row_blocks, bp.num_col_tiles,
                                         bp.f.window_left >= 0 || bp.f.window_right >= 0, false);
    const long long n_block = blk.row_block, col_tile = blk.col_tile, b = blk.b;
    const long long n0 = n_block * BLOCK_N, c0 = col_tile * D_TILE;

    const BackwardInputs<T, A, BiasT> in(bp, b);  // batch entry b (backward.cuh)
    const T *q = in.q, *k = in.k + n0 * p.k_s.row;
    const T *v = in.v + n0 * p.v_s.row, *dout = in.dout;
    const A *lse = in.lse, *delta = in.delta;
    const unsigned char* mask = in.mask;
    const BiasT* bias = in.bias;

    // the query tiles whose band reaches the block's keys; the others are skipped
    const Range queries = band_queries<BLOCK_M, BLOCK_N>(p, n0);
    const long long m_lo = queries.lo, m_hi = queries.hi;

    const long long rows_k = p.seqlen_k - n0;
    const long long head = max(p.head_dim, p.head_dim_v);
    const int num_chunks = RESIDENT ? 1 : (int)((head + D_TILE - 1) / D_TILE);
    if constexpr (RESIDENT) {  // this block's K and V, whole; visible after the first barrier
        load_tile<BLOCK_N, D_TILE, PAD, TF32>(k_s, k, p.k_s.row, p.k_s.col, rows_k, p.head_dim);
        load_tile<BLOCK_N, D_TILE, PAD, TF32>(v_s, v, p.v_s.row, p.v_s.col, rows_k, p.head_dim_v);
    }
    const ScoreConsts<A> consts(p);

    A dk[TN][TC], dv[TN][TC];
    clear_tile(dk);
    clear_tile(dv);

    for (long long m0 = m_lo; m0 < m_hi; m0 += BLOCK_M) {
        const long long rows_q = p.seqlen_q - m0;
        A s[TN][TQ], dp[TN][TQ];  // S^T and dP^T: keys down, queries across
        clear_tile(s);
        clear_tile(dp);
        for (int dc = 0; dc < num_chunks; ++dc) {
            const long long d0 = (long long)dc * D_TILE;
            if constexpr (!RESIDENT) {
                load_tile<BLOCK_N, D_TILE, PAD, TF32>(k_s, k + d0 * p.k_s.col, p.k_s.row, p.k_s.col,
                                                      rows_k, p.head_dim - d0);
                load_tile<BLOCK_N, D_TILE, PAD, TF32>(v_s, v + d0 * p.v_s.col, p.v_s.row, p.v_s.col,
                                                      rows_k, p.head_dim_v - d0);
            }
            load_tile<BLOCK_M, D_TILE, PAD, TF32>(q_s, q + m0 * p.q_s.row + d0 * p.q_s.col,
                                                  p.q_s.row, p.q_s.col, rows_q, p.head_dim - d0);
            load_tile<BLOCK_M, D_TILE, PAD>(do_s, dout + m0 * bp.dout_s.row + d0 * bp.dout_s.col,
                                            bp.dout_s.row, bp.dout_s.col, rows_q, p.head_dim_v - d0);
            __syncthreads();  // the chunks are in shared memory
            // chunk by chunk, as the forward sums its scores
            chunk_scores<TN, TQ, D_TILE, PAD, !RESIDENT>(s, k_s, q_s, tx, ty);
            chunk_scores<TN, TQ, D_TILE, PAD, !RESIDENT>(dp, v_s, do_s, tx, ty);
            if constexpr (!RESIDENT) __syncthreads();  // before the next chunk overwrites them
        }
        const bool interior = !HAS_MASK && tile_is_interior(p, m0, BLOCK_M, n0, BLOCK_N);
#pragma unroll
        for (int j = 0; j < TQ; ++j) {
            const long long r = m0 + tx + 16 * j;
            const A lse_log2 = r < p.seqlen_q ? lse[r * p.lse_s.row] * A(LOG2E) : neg_inf<A>();
            const A dl = r < p.seqlen_q ? delta[r * bp.delta_s.row] : A(0);
#pragma unroll
            for (int i = 0; i < TN; ++i) {
                p_and_ds<HAS_MASK>(s[i][j], dp[i][j], p, consts, r, n0 + ty * TN + i, lse_log2,
                                   dl, interior, mask, bias);
                p_s[(ty * TN + i) * (BLOCK_M + PAD) + tx + 16 * j] = s[i][j];
                ds_s[(ty * TN + i) * (BLOCK_M + PAD) + tx + 16 * j] = dp[i][j];
            }
        }
        if constexpr (!RESIDENT) {  // this block's output columns of Q and dO
            load_tile<BLOCK_M, D_TILE, PAD, TF32>(q_s, q + m0 * p.q_s.row + c0 * p.q_s.col,
                                                  p.q_s.row, p.q_s.col, rows_q, p.head_dim - c0);
            load_tile<BLOCK_M, D_TILE, PAD>(do_s, dout + m0 * bp.dout_s.row + c0 * bp.dout_s.col,
                                            bp.dout_s.row, bp.dout_s.col, rows_q, p.head_dim_v - c0);
        }
        __syncthreads();  // P^T, dS^T, Q and dO are in shared memory
        accumulate<TN, TC, BLOCK_M, D_TILE, PAD>(dv, p_s, do_s, tx, ty);
        accumulate<TN, TC, BLOCK_M, D_TILE, PAD>(dk, ds_s, q_s, tx, ty);
        __syncthreads();  // consumed before the next query tile overwrites them
    }

    // Every element of the block's tile is written, zero where no query reached the key.
    G* dk_out = reinterpret_cast<G*>(bp.dk) + batch_offset(bp.dk_s, b, p.batch1, p.batch2);
    G* dv_out = reinterpret_cast<G*>(bp.dv) + batch_offset(bp.dv_s, b, p.batch1, p.batch2);
    const A scale = A(p.scale);
#pragma unroll
    for (int i = 0; i < TN; ++i) {
        const long long n = n0 + ty * TN + i;
        if (n >= p.seqlen_k) continue;
#pragma unroll
        for (int u = 0; u < TC / VEC; ++u)
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const long long c = c0 + (tx + 16 * u) * VEC + e;
                if (c < p.head_dim)
                    dk_out[n * bp.dk_s.row + c * bp.dk_s.col] = from_acc<G>(dk[i][u * VEC + e] * scale);
                if (c < p.head_dim_v)
                    dv_out[n * bp.dv_s.row + c * bp.dv_s.col] = from_acc<G>(dv[i][u * VEC + e]);
            }
    }
}

template <typename T, typename G, typename BiasT, bool HAS_MASK, int BLOCK_M, int BLOCK_N,
          int D_TILE, bool RESIDENT, int MIN_BLOCKS, bool TF32 = false>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS) attention_bwd_dq(const AttnBwdParams bp) {
    using A = Acc<T>;
    constexpr int VEC = 16 / sizeof(A), PAD = VEC;
    constexpr int TM = BLOCK_M / 16, TN = BLOCK_N / 16, TC = D_TILE / 16;
    static_assert(BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0 && D_TILE % (16 * VEC) == 0,
                  "BLOCK_M, BLOCK_N must be multiples of 16, D_TILE of 16*VEC");
    const AttnParams& p = bp.f;

    using L = BwdPortableDqSmem<A, BLOCK_M, BLOCK_N, D_TILE>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* q_s = reinterpret_cast<A*>(smem_raw + L::q_s);    // [BLOCK_M][D_TILE + PAD]
    A* do_s = reinterpret_cast<A*>(smem_raw + L::do_s);  // [BLOCK_M][D_TILE + PAD]
    A* k_s = reinterpret_cast<A*>(smem_raw + L::k_s);    // [BLOCK_N][D_TILE + PAD]
    A* v_s = reinterpret_cast<A*>(smem_raw + L::v_s);    // [BLOCK_N][D_TILE + PAD]
    A* ds_s = reinterpret_cast<A*>(smem_raw + L::ds_s);  // [BLOCK_M][BLOCK_N + PAD]

    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    // heaviest query blocks first: under causal masking the last rows see the most keys
    const BlockCoords blk = block_coords(bp.num_row_blocks, bp.num_col_tiles,
                                         bp.f.window_left >= 0 || bp.f.window_right >= 0, true);
    const long long m_block = blk.row_block, col_tile = blk.col_tile, b = blk.b;
    const long long m0 = m_block * BLOCK_M, c0 = col_tile * D_TILE;

    const BackwardInputs<T, A, BiasT> in(bp, b);  // batch entry b (backward.cuh)
    const T *q = in.q + m0 * p.q_s.row, *k = in.k;
    const T *v = in.v, *dout = in.dout + m0 * bp.dout_s.row;
    const A *lse = in.lse, *delta = in.delta;
    const unsigned char* mask = in.mask;
    const BiasT* bias = in.bias;

    const Range keys = band_keys<BLOCK_M, BLOCK_N>(p, m0);  // the band's key tiles
    const long long n_lo = keys.lo, n_hi = keys.hi;

    const long long rows_q = p.seqlen_q - m0;
    const long long head = max(p.head_dim, p.head_dim_v);
    const int num_chunks = RESIDENT ? 1 : (int)((head + D_TILE - 1) / D_TILE);
    if constexpr (RESIDENT) {  // this block's Q and dO, whole; visible after the first barrier
        load_tile<BLOCK_M, D_TILE, PAD, TF32>(q_s, q, p.q_s.row, p.q_s.col, rows_q, p.head_dim);
        load_tile<BLOCK_M, D_TILE, PAD>(do_s, dout, bp.dout_s.row, bp.dout_s.col, rows_q,
                                        p.head_dim_v);
    }
    const ScoreConsts<A> consts(p);
    A lse_log2[TM], dl[TM];
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const long long r = m0 + ty * TM + i;
        lse_log2[i] = r < p.seqlen_q ? lse[r * p.lse_s.row] * A(LOG2E) : neg_inf<A>();
        dl[i] = r < p.seqlen_q ? delta[r * bp.delta_s.row] : A(0);
    }

    A dq[TM][TC];
    clear_tile(dq);

    for (long long n0 = n_lo; n0 < n_hi; n0 += BLOCK_N) {
        const long long rows_k = p.seqlen_k - n0;
        A s[TM][TN], dp[TM][TN];
        clear_tile(s);
        clear_tile(dp);
        for (int dc = 0; dc < num_chunks; ++dc) {
            const long long d0 = (long long)dc * D_TILE;
            if constexpr (!RESIDENT) {
                load_tile<BLOCK_M, D_TILE, PAD, TF32>(q_s, q + d0 * p.q_s.col, p.q_s.row, p.q_s.col,
                                                      rows_q, p.head_dim - d0);
                load_tile<BLOCK_M, D_TILE, PAD>(do_s, dout + d0 * bp.dout_s.col, bp.dout_s.row,
                                                bp.dout_s.col, rows_q, p.head_dim_v - d0);
            }
            load_tile<BLOCK_N, D_TILE, PAD, TF32>(k_s, k + n0 * p.k_s.row + d0 * p.k_s.col,
                                                  p.k_s.row, p.k_s.col, rows_k, p.head_dim - d0);
            load_tile<BLOCK_N, D_TILE, PAD, TF32>(v_s, v + n0 * p.v_s.row + d0 * p.v_s.col,
                                                  p.v_s.row, p.v_s.col, rows_k, p.head_dim_v - d0);
            __syncthreads();  // the chunks are in shared memory
            // chunk by chunk, as the forward sums its scores
            chunk_scores<TM, TN, D_TILE, PAD, !RESIDENT>(s, q_s, k_s, tx, ty);
            chunk_scores<TM, TN, D_TILE, PAD, !RESIDENT>(dp, do_s, v_s, tx, ty);
            if constexpr (!RESIDENT) __syncthreads();  // before the next chunk overwrites them
        }
        const bool interior = !HAS_MASK && tile_is_interior(p, m0, BLOCK_M, n0, BLOCK_N);
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) {
                p_and_ds<HAS_MASK>(s[i][j], dp[i][j], p, consts, m0 + ty * TM + i,
                                   n0 + tx + 16 * j, lse_log2[i], dl[i], interior, mask, bias);
                ds_s[(ty * TM + i) * (BLOCK_N + PAD) + tx + 16 * j] = dp[i][j];
            }
        if constexpr (!RESIDENT)  // this block's output columns of K
            load_tile<BLOCK_N, D_TILE, PAD, TF32>(k_s, k + n0 * p.k_s.row + c0 * p.k_s.col,
                                                  p.k_s.row, p.k_s.col, rows_k, p.head_dim - c0);
        __syncthreads();  // dS and K are in shared memory
        accumulate<TM, TC, BLOCK_N, D_TILE, PAD>(dq, ds_s, k_s, tx, ty);
        __syncthreads();  // consumed before the next key tile overwrites them
    }

    G* dq_out = reinterpret_cast<G*>(bp.dq) + batch_offset(bp.dq_s, b, p.batch1, p.batch2);
    const A scale = A(p.scale);
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const long long r = m0 + ty * TM + i;
        if (r >= p.seqlen_q) continue;
#pragma unroll
        for (int u = 0; u < TC / VEC; ++u)
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const long long c = c0 + (tx + 16 * u) * VEC + e;
                if (c < p.head_dim)
                    dq_out[r * bp.dq_s.row + c * bp.dq_s.col] = from_acc<G>(dq[i][u * VEC + e] * scale);
            }
    }
}
