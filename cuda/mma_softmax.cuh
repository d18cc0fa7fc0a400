// mma_softmax.cuh -- the forward's score transform and online softmax in the m16n8
// accumulator layout (lane g = lane/4, t = lane%4 holds rows g, g+8 and columns 2t, 2t+1 of
// each 8-column tile), shared by the tensor-core forwards: attention_mma.cu (16-bit inputs,
// m16n8k16) and attention_mma_wide.cu (float32 through TF32, m16n8k8; float64 through DMMA,
// m16n8k8), whose accumulators have the same layout. A is the accumulator type: float, or
// double for float64 inputs.
#pragma once

#include "common.cuh"

namespace cuattn {
namespace mma {

// Scores to log2 units with softcap, bias and masking (see attention_portable.cu). Element
// (j, e) of the accumulator is row g + 8*(e/2), column 8j + 2t + e%2 of the warp's tile.
template <int BLOCK_N, bool HAS_MASK, typename BiasT, typename A>
__device__ __forceinline__ void mask_scores(A (&s)[BLOCK_N / 8][4], const AttnParams& p,
                                            long long row0, long long col0, int lane,
                                            bool interior, const unsigned char* mask,
                                            const BiasT* bias) {
    const A scale_log2 = A(p.scale * LOG2E);
    const A softcap = A(p.softcap);
    if (interior && softcap == A(0) && is_same_v<BiasT, NoBias>) {
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] *= scale_log2;
        return;
    }
    const A cap_over_scale = softcap > A(0) ? A(p.scale / p.softcap) : A(0);
    const long long off = p.seqlen_k - p.seqlen_q;
#pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const long long r = row0 + lane / 4 + 8 * (e / 2);
            const long long c = col0 + 8 * j + 2 * (lane % 4) + e % 2;
            bool allowed = r < p.seqlen_q && c < p.seqlen_k &&
                           in_window(r, c, off, p.window_left, p.window_right);
            if constexpr (HAS_MASK)
                if (allowed) allowed = mask[r * p.mask_s.row + c * p.mask_s.col] != 0;
            A x = s[j][e];
            x = softcap > A(0) ? softcap * A(LOG2E) * tanh_acc(x * cap_over_scale) : x * scale_log2;
            if constexpr (!is_same_v<BiasT, NoBias>)
                if (allowed) x += A(to_acc(bias[r * p.bias_s.row + c * p.bias_s.col])) * A(LOG2E);
            s[j][e] = allowed ? x : neg_inf<A>();
        }
}

// Online softmax over one tile for the lane's two rows (h = 0: row g, h = 1: row g + 8).
template <int BLOCK_N, int DV_TILES, typename A>
__device__ __forceinline__ void update_row_state(A (&s)[BLOCK_N / 8][4], A (&m)[2], A (&l)[2],
                                                 A (&o)[DV_TILES][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        A tile_max = neg_inf<A>();
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j)
            tile_max = max_acc(tile_max, max_acc(s[j][2 * h], s[j][2 * h + 1]));
        // the four lanes of a quad hold the row's columns
        tile_max = max_acc(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = max_acc(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        const A m_new = max_acc(m[h], tile_max);
        const A m_use = m_new == neg_inf<A>() ? A(0) : m_new;  // nothing allowed yet
        const A alpha = fast_exp2(m[h] - m_use);
        A tile_sum = A(0);
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
            for (int e = 2 * h; e < 2 * h + 2; ++e) {
                s[j][e] = fast_exp2(s[j][e] - m_use);
                tile_sum += s[j][e];
            }
        // the quad's partial sums are combined once, at the end (l is per lane until then)
        l[h] = l[h] * alpha + tile_sum;
        m[h] = m_new;
#pragma unroll
        for (int d = 0; d < DV_TILES; ++d) {
            o[d][2 * h] *= alpha;
            o[d][2 * h + 1] *= alpha;
        }
    }
}

}  // namespace mma
}  // namespace cuattn
