// backward.cuh -- the element-wise part of the attention backward, shared by its kernel
// families (attention_backward_portable.cu, attention_backward_mma.cu,
// attention_backward_sm90.cu): rebuilding P and dS from a raw score, the forward's lse and
// delta (p_and_ds per element; p_and_ds_tile per m16n8 accumulator tile, the sm90 kernels);
// a block's input arrays (BackwardInputs, DkdvInputs, DqInputs) and the tiles of the band
// it walks (band_queries, band_keys); the lse and delta loads (stage_row_stats,
// load_row_stats) and the gradient-tile store of the tensor-core kernels; and the first
// kernel of every family, attention_bwd_delta (grid: num_row_blocks = batch x Sq
// rows, one warp per row).
#pragma once

#include "common/common.cuh"

namespace cuattn {

// The arrays of batch entry b that a backward block reads, at their first rows: q, k, v,
// dout (storage type T), lse and delta (accumulator type A), mask and bias (null when
// absent). The dK/dV kernels add their first key row to k and v, the dQ kernels their
// first query row to q and dout (DkdvInputs, DqInputs below).
template <typename T, typename A, typename BiasT> struct BackwardInputs {
    const T *q, *k, *v, *dout;
    const A *lse, *delta;
    const unsigned char* mask;
    const BiasT* bias;
    __device__ __forceinline__ BackwardInputs(const AttnBwdParams& bp, long long b) {
        const AttnParams& p = bp.f;
        q = reinterpret_cast<const T*>(p.q) + batch_offset(p.q_s, b, p.batch1, p.batch2);
        k = reinterpret_cast<const T*>(p.k) + batch_offset(p.k_s, b, p.batch1, p.batch2);
        v = reinterpret_cast<const T*>(p.v) + batch_offset(p.v_s, b, p.batch1, p.batch2);
        dout = reinterpret_cast<const T*>(bp.dout) + batch_offset(bp.dout_s, b, p.batch1, p.batch2);
        lse = reinterpret_cast<const A*>(p.lse) + batch_offset(p.lse_s, b, p.batch1, p.batch2);
        delta = reinterpret_cast<const A*>(bp.delta) + batch_offset(bp.delta_s, b, p.batch1, p.batch2);
        mask = p.mask ? reinterpret_cast<const unsigned char*>(p.mask) +
                            batch_offset(p.mask_s, b, p.batch1, p.batch2) : nullptr;
        bias = p.bias ? reinterpret_cast<const BiasT*>(p.bias) +
                            batch_offset(p.bias_s, b, p.batch1, p.batch2) : nullptr;
    }
};

// The inputs of a dK/dV block whose first key is n0: BackwardInputs with k and v from key n0.
template <typename T, typename A, typename BiasT>
struct DkdvInputs : BackwardInputs<T, A, BiasT> {
    __device__ __forceinline__ DkdvInputs(const AttnBwdParams& bp, long long b, long long n0)
        : BackwardInputs<T, A, BiasT>(bp, b) {
        this->k += n0 * bp.f.k_s.row;
        this->v += n0 * bp.f.v_s.row;
    }
};

// The inputs of a dQ block whose first query row is m0: BackwardInputs with q and dout from
// row m0.
template <typename T, typename A, typename BiasT>
struct DqInputs : BackwardInputs<T, A, BiasT> {
    __device__ __forceinline__ DqInputs(const AttnBwdParams& bp, long long b, long long m0)
        : BackwardInputs<T, A, BiasT>(bp, b) {
        this->q += m0 * bp.f.q_s.row;
        this->dout += m0 * bp.dout_s.row;
    }
};

// The query rows [lo, hi) (whole BLOCK_M tiles) whose band reaches the BLOCK_N keys from n0.
template <int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ Range band_queries(const AttnParams& p, long long n0) {
    const long long n_last = min(n0 + BLOCK_N, p.seqlen_k) - 1;
    return query_band(p, n0, n_last, BLOCK_M);
}

// The keys [lo, hi) (whole BLOCK_N tiles) that the band reaches from the BLOCK_M query rows
// from m0.
template <int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ Range band_keys(const AttnParams& p, long long m0) {
    const long long m_last = min(m0 + BLOCK_M, p.seqlen_q) - 1;
    return key_band(p, m0, m_last, BLOCK_N);
}

// Constants of the score transform, in log2 units.
template <typename A> struct ScoreConsts {
    A scale_log2, softcap, cap_over_scale;
    __device__ explicit ScoreConsts(const AttnParams& p)
        : scale_log2(A(p.scale * LOG2E)), softcap(A(p.softcap)),
          cap_over_scale(p.softcap > 0 ? A(p.scale / p.softcap) : A(0)) {}
};

// One element: s holds q_r . k_c and becomes P = exp(s - lse_r); dp holds dO_r . v_c and
// becomes dS = P (dp - delta_r), times 1 - tanh^2 under softcap. A key that is not allowed
// for row r (outside the sequences, the band or the bool mask), or a row with lse = -inf
// (nothing allowed), gives P = dS = 0. `interior` (block-uniform): the tile lies inside both
// sequences and the band and no mask is read, so only the arithmetic remains.
template <bool HAS_MASK, typename A, typename BiasT>
__device__ __forceinline__ void p_and_ds(A& s, A& dp, const AttnParams& p, const ScoreConsts<A>& k,
                                         long long r, long long c, A lse_log2, A delta,
                                         bool interior, const unsigned char* mask,
                                         const BiasT* bias) {
    bool allowed = interior;
    if (!interior) {
        allowed = r < p.seqlen_q && c < p.seqlen_k &&
                  in_window(r, c, p.seqlen_k - p.seqlen_q, p.window_left, p.window_right);
        if constexpr (HAS_MASK)
            if (allowed) allowed = mask[r * p.mask_s.row + c * p.mask_s.col] != 0;
    }
    allowed = allowed && lse_log2 != neg_inf<A>();
    A x, dcap = A(1);
    if (k.softcap > A(0)) {
        const A t = tanh_acc(s * k.cap_over_scale);
        x = k.softcap * A(LOG2E) * t;
        dcap = A(1) - t * t;
    } else {
        x = s * k.scale_log2;
    }
    if constexpr (!is_same_v<BiasT, NoBias>)
        if (allowed) x += to_acc(bias[r * p.bias_s.row + c * p.bias_s.col]) * A(LOG2E);
    const A prob = allowed ? fast_exp2(x - lse_log2) : A(0);
    s = prob;
    dp = allowed ? prob * (dp - delta) * dcap : A(0);
}

// p_and_ds over a warp's m16n8 accumulator tiles (the tensor-core backwards): element
// (j, e) is row g + 8(e/2) (g = lane/4) from row0 and column 8j + 2t + e%2 (t = lane%4) from
// col0. KEYS_ARE_ROWS: rows are keys and columns queries (S^T and dP^T of the dK/dV
// kernels), else rows are queries (dQ). stat(j, e) gives the element's query's lse (log2
// units) and delta. As the forward's mask_scores: softcap and the interior test are decided
// once per tile, and a boundary tile turns the sequences and the band into two 32-bit limits
// per row, relative to the lane's first column.
// The mask and bias come as views (common.cuh): the arrays in global memory, or this
// tile's staged in shared memory.
template <bool HAS_MASK, bool KEYS_ARE_ROWS, int N8, typename BiasT, typename Stat,
          typename MaskV, typename BiasV>
__device__ __forceinline__ void p_and_ds_tile(float (&s)[N8][4], float (&dp)[N8][4],
                                              const AttnParams& p, const ScoreConsts<float>& k,
                                              long long row0, long long col0, int lane,
                                              bool interior, const MaskV& mask,
                                              const BiasV& bias, const Stat& stat) {
    constexpr bool HAS_BIAS = !is_same_v<BiasT, NoBias>;
    constexpr int COLS = 8 * N8;
    const long long c0 = col0 + 2 * (lane % 4), off = p.seqlen_k - p.seqlen_q;
    int lo[2] = {-1, -1}, hi[2] = {COLS + 1, COLS + 1};
    const unsigned char* mask_row[2];  // the mask and bias at (row h, column c0)
    const BiasT* bias_row[2];
    // ALL: every element allowed and lse finite -- an interior tile without mask or bias,
    // where every row of the tile has an allowed key: no limits, no lse test, no selects, and
    // the scale folded into the exp2 argument (one rounding); about 4 instructions per
    // element where the general pass takes over 15 (predicates)
    auto pass = [&](auto softcap_flag, auto all_flag) {
        constexpr bool SOFTCAP = decltype(softcap_flag)::value, ALL = decltype(all_flag)::value;
#pragma unroll
        for (int j = 0; j < N8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int x = 8 * j + e % 2, h = e / 2;
                bool allowed = true;
                if constexpr (!ALL) {
                    allowed = interior || (x >= lo[h] && x < hi[h]);
                    if constexpr (HAS_MASK) {
                        if constexpr (MaskV::safe())  // a load for every element, then a select
                            allowed = allowed & (mask_row[h][mask.step(x)] != 0);
                        else if (allowed)
                            allowed = mask_row[h][mask.step(x)] != 0;
                    }
                }
                const float2 st = stat(j, e);  // lse (log2 units), delta
                if constexpr (!ALL) allowed = allowed && st.x != neg_inf<float>();
                float y, dcap = 1.f;  // y: log2-unit score; less lse already when ALL
                if constexpr (SOFTCAP) {
                    const float t = tanh_acc(s[j][e] * k.cap_over_scale);
                    y = ALL ? fmaf(k.softcap * float(LOG2E), t, -st.x) : k.softcap * float(LOG2E) * t;
                    dcap = 1.f - t * t;
                } else {
                    y = ALL ? fmaf(s[j][e], k.scale_log2, -st.x) : s[j][e] * k.scale_log2;
                }
                if constexpr (HAS_BIAS) {
                    if constexpr (BiasV::safe()) {
                        const float add = to_acc(bias_row[h][bias.step(x)]) * float(LOG2E);
                        y += allowed ? add : 0.f;
                    } else if (allowed) {
                        y += to_acc(bias_row[h][bias.step(x)]) * float(LOG2E);
                    }
                }
                const float prob = ALL ? fast_exp2(y) : allowed ? fast_exp2(y - st.x) : 0.f;
                s[j][e] = prob;
                dp[j][e] = allowed ? prob * (dp[j][e] - st.y) * dcap : 0.f;
            }
    };
    if (!HAS_MASK && !HAS_BIAS && interior) {
        if (k.softcap > 0.f)
            pass(Bool<true>(), Bool<true>());
        else
            pass(Bool<false>(), Bool<true>());
        return;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const long long r = row0 + lane / 4 + 8 * h;
        if constexpr (HAS_MASK) mask_row[h] = mask.at(r, c0);
        if constexpr (HAS_BIAS) bias_row[h] = bias.at(r, c0);
        if (interior) continue;
        long long a = -1, z;
        if (KEYS_ARE_ROWS) {  // key r, queries c0 + x: r + off - right <= q <= r + off + left
            z = r < p.seqlen_k ? p.seqlen_q - c0 : -1;
            if (p.window_right >= 0) a = r - off - p.window_right - c0;
            if (p.window_left >= 0) z = min(z, r - off + p.window_left + 1 - c0);
        } else {              // query r, keys c0 + x: r + off - left <= key <= r + off + right
            z = r < p.seqlen_q ? p.seqlen_k - c0 : -1;
            if (p.window_left >= 0) a = r + off - p.window_left - c0;
            if (p.window_right >= 0) z = min(z, r + off + p.window_right + 1 - c0);
        }
        lo[h] = (int)max(-1LL, min(a, (long long)COLS + 1));
        hi[h] = (int)max(-1LL, min(z, (long long)COLS + 1));
    }
    if (k.softcap > 0.f)
        pass(Bool<true>(), Bool<false>());
    else
        pass(Bool<false>(), Bool<false>());
}

// The same with the mask and bias read from global memory (strides swapped where the
// accumulator's rows are keys).
template <bool HAS_MASK, bool KEYS_ARE_ROWS, int N8, typename BiasT, typename Stat>
__device__ __forceinline__ void p_and_ds_tile(float (&s)[N8][4], float (&dp)[N8][4],
                                              const AttnParams& p, const ScoreConsts<float>& k,
                                              long long row0, long long col0, int lane,
                                              bool interior, const unsigned char* mask,
                                              const BiasT* bias, const Stat& stat) {
    const GlobalView<unsigned char> mv{mask, KEYS_ARE_ROWS ? p.mask_s.col : p.mask_s.row,
                                       KEYS_ARE_ROWS ? p.mask_s.row : p.mask_s.col};
    const GlobalView<BiasT> bv{bias, KEYS_ARE_ROWS ? p.bias_s.col : p.bias_s.row,
                               KEYS_ARE_ROWS ? p.bias_s.row : p.bias_s.col};
    p_and_ds_tile<HAS_MASK, KEYS_ARE_ROWS, N8, BiasT>(s, dp, p, k, row0, col0, lane, interior,
                                                      mv, bv, stat);
}

// The same with the mask and bias that `side` (SideTiles, mma_tiles.cuh) staged in its stage
// st with the streamed tile (queries from q0, keys from k0), or, where it stages none, the
// arrays in place.
template <bool HAS_MASK, bool KEYS_ARE_ROWS, int N8, typename BiasT, typename Side,
          typename Stat>
__device__ __forceinline__ void p_and_ds_tile(float (&s)[N8][4], float (&dp)[N8][4],
                                              const AttnParams& p, const ScoreConsts<float>& k,
                                              long long row0, long long col0, int lane,
                                              bool interior, const Side& side, int st,
                                              long long q0, long long k0,
                                              const unsigned char* mask, const BiasT* bias,
                                              const Stat& stat) {
    if (side.staged)
        p_and_ds_tile<HAS_MASK, KEYS_ARE_ROWS, N8, BiasT>(s, dp, p, k, row0, col0, lane,
                                                          interior, side.mask_view(st, q0, k0),
                                                          side.bias_view(st, q0, k0), stat);
    else
        p_and_ds_tile<HAS_MASK, KEYS_ARE_ROWS>(s, dp, p, k, row0, col0, lane, interior, mask,
                                               bias, stat);
}

// The lse (log2 units) and delta of query rows m0 .. m0 + ROWS - 1 into stage st of lse_s and
// delta_s (ROWS floats a stage) by plain loads, THREADS threads; rows past seqlen_q get -inf
// and 0. The variables that the calling lambda captures come by reference, as it holds them.
template <int ROWS, int THREADS>
__device__ __forceinline__ void stage_row_stats(float* const& lse_s, float* const& delta_s,
                                                int st, const float* const& lse,
                                                const float* const& delta,
                                                const AttnBwdParams& bp, long long m0) {
    const AttnParams& p = bp.f;
    for (int i = threadIdx.x; i < ROWS; i += THREADS) {
        const long long r = m0 + i;
        lse_s[st * ROWS + i] = r < p.seqlen_q ? lse[r * p.lse_s.row] * float(LOG2E)
                                              : neg_inf<float>();
        delta_s[st * ROWS + i] = r < p.seqlen_q ? delta[r * bp.delta_s.row] : 0.f;
    }
}

// The lse (log2 units) and delta of this lane's two rows of its warp's m16n8 accumulator
// tile in the dQ kernels: rows m0 + 16 warp + g and + g + 8 (g = lane/4); rows past
// seqlen_q get -inf and 0, which make their P and dS 0.
template <typename A>
__device__ __forceinline__ void load_row_stats(A (&lse_log2)[2], A (&dl)[2], const A* lse,
                                               const A* delta, const AttnBwdParams& bp,
                                               long long m0, int warp, int lane) {
    const AttnParams& p = bp.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const long long r = m0 + warp * 16 + lane / 4 + 8 * h;
        lse_log2[h] = r < p.seqlen_q ? lse[r * p.lse_s.row] * A(LOG2E) : neg_inf<A>();
        dl[h] = r < p.seqlen_q ? delta[r * bp.delta_s.row] : A(0);
    }
}

// Write a warp's 16 x (8*COLS8) float accumulator tile of a tensor-core backward (m16n8
// layout: lane g = lane/4, t = lane%4 holds rows g, g+8 and columns 2t, 2t+1 of each
// 8-column tile), times `mul`, to rows row0 + g and row0 + g + 8 of a strided gradient;
// rows >= nrows and columns >= ncols (the pad) are not written.
template <int COLS8, typename G>
__device__ __forceinline__ void store_tile(const float (&acc)[COLS8][4], G* out,
                                           long long row_stride, long long col_stride,
                                           long long row0, long long nrows, long long ncols,
                                           int lane, float mul) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const long long r = row0 + lane / 4 + 8 * h;
        if (r >= nrows) continue;
#pragma unroll
        for (int d = 0; d < COLS8; ++d) {
            const int c = 8 * d + 2 * (lane % 4);
            if (c < ncols) out[r * row_stride + c * col_stride] = from_acc<G>(acc[d][2 * h] * mul);
            if (c + 1 < ncols)
                out[r * row_stride + (c + 1) * col_stride] = from_acc<G>(acc[d][2 * h + 1] * mul);
        }
    }
}

}  // namespace cuattn

constexpr int DELTA_THREADS = 256;  // attention_bwd_delta: 8 rows per block

// delta[b, i] = sum_c dout[b, i, c] * out[b, i, c] in the accumulator type; one warp per row.
template <typename T>
__global__ void __launch_bounds__(DELTA_THREADS) attention_bwd_delta(const cuattn::AttnBwdParams bp) {
    using A = cuattn::Acc<T>;
    const cuattn::AttnParams& p = bp.f;
    const long long row = (long long)blockIdx.x * (DELTA_THREADS / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= bp.num_row_blocks) return;  // for this kernel: the number of rows, batch x Sq
    // row = ((b0 * batch1 + b1) * batch2 + b2) * Sq + i, split with 32-bit divisions when
    // the numbers fit (64-bit ones are a subroutine call each, most of this kernel's time)
    long long b0, b1, b2, i;
    if ((bp.num_row_blocks | p.batch1 | p.batch2 | p.seqlen_q) >> 31 == 0) {
        const unsigned r = (unsigned)row, b = r / (unsigned)p.seqlen_q, b01 = b / (unsigned)p.batch2;
        i = r - b * (unsigned)p.seqlen_q;
        b2 = b - b01 * (unsigned)p.batch2;
        b0 = b01 / (unsigned)p.batch1;
        b1 = b01 - (unsigned)b0 * (unsigned)p.batch1;
    } else {
        const long long b = row / p.seqlen_q, b01 = b / p.batch2;
        i = row % p.seqlen_q;
        b2 = b % p.batch2;
        b0 = b01 / p.batch1;
        b1 = b01 % p.batch1;
    }
    auto offset = [&](const cuattn::Strides& s) { return b0 * s.b0 + b1 * s.b1 + b2 * s.b2 + i * s.row; };
    const T* dout = reinterpret_cast<const T*>(bp.dout) + offset(bp.dout_s);
    const T* out = reinterpret_cast<const T*>(p.out) + offset(p.out_s);
    A sum = A(0);
    for (long long c = lane; c < p.head_dim_v; c += 32)
        sum = fma(cuattn::to_acc(dout[c * bp.dout_s.col]), cuattn::to_acc(out[c * p.out_s.col]), sum);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) reinterpret_cast<A*>(bp.delta)[offset(bp.delta_s)] = sum;
}

