// backward.cuh -- the element-wise part of the attention backward, shared by its kernel
// families (attention_backward_portable.cu, attention_backward_mma.cu,
// attention_backward_sm90.cu): rebuilding P and dS from a raw score, the forward's lse and
// delta; the interior-tile test; the gradient-tile store of the tensor-core kernels; and
// the first kernel of every family, attention_bwd_delta (grid: num_row_blocks = batch x Sq
// rows, one warp per row).
#pragma once

#include "common.cuh"

namespace cuattn {

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

// Does the tile [r0, r0 + rows) x [c0, c0 + cols) lie inside both sequences and inside the
// causal/window band for every one of its elements?
__device__ __forceinline__ bool tile_is_interior(const AttnParams& p, long long r0, int rows,
                                                 long long c0, int cols) {
    const long long off = p.seqlen_k - p.seqlen_q;
    const long long r1 = r0 + rows - 1, c1 = c0 + cols - 1;
    return r1 < p.seqlen_q && c1 < p.seqlen_k &&
           (p.window_left < 0 || c0 >= r1 + off - p.window_left) &&
           (p.window_right < 0 || c1 <= r0 + off + p.window_right);
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
    const long long b = row / p.seqlen_q, i = row % p.seqlen_q;
    const T* dout = reinterpret_cast<const T*>(bp.dout) +
                    batch_offset(bp.dout_s, b, p.batch1, p.batch2) + i * bp.dout_s.row;
    const T* out = reinterpret_cast<const T*>(p.out) +
                   batch_offset(p.out_s, b, p.batch1, p.batch2) + i * p.out_s.row;
    A sum = A(0);
    for (long long c = lane; c < p.head_dim_v; c += 32)
        sum = fma(cuattn::to_acc(dout[c * bp.dout_s.col]), cuattn::to_acc(out[c * p.out_s.col]), sum);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) {
        A* delta = reinterpret_cast<A*>(bp.delta) + batch_offset(bp.delta_s, b, p.batch1, p.batch2);
        delta[i * bp.delta_s.row] = sum;
    }
}

