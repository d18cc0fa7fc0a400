// mma_softmax.cuh -- the forward's score transform and online softmax in the m16n8
// accumulator layout (lane g = lane/4, t = lane%4 holds rows g, g+8 and columns 2t, 2t+1 of
// each 8-column tile), shared by the tensor-core forwards: attention_mma.cu (16-bit inputs,
// m16n8k16), attention_sm90.cu (16-bit inputs, wgmma) and attention_mma_wide.cu (float32
// through TF32, m16n8k8; float64 through DMMA, m16n8k8), whose accumulators have the same
// layout; store_rows ends the forwards with float accumulators and output T (16-bit, or
// float in attention_sm90_tf32.cu). A is the accumulator type: float, or double for float64
// inputs.
#pragma once

#include "common/common.cuh"
#include "common/mma_tiles.cuh"

namespace cuattn {
namespace mma {

// Do the keys n0 .. n0 + BLOCK_N - 1 lie inside the key sequence and inside the
// causal/window band of every row m0 .. m_last (m_last = min(m0 + BLOCK_M, seqlen_q) - 1),
// so that mask_scores may skip the masking? Rows past seqlen_q do not count (mask_scores:
// they are never stored). Positions in 32 bits (checked in Python), off = seqlen_k -
// seqlen_q: the 16-bit and sm90_tf32 forwards. attention_mma_wide.cu spells out a 64-bit
// copy that still asks for full rows (stricter, so also correct), and common.cuh's
// tile_is_interior (64-bit) is the backwards' and the portable warp-tiled forward's.
template <int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ bool forward_tile_interior(const AttnParams& p, long long m0,
                                                      int m_last, int n0, int seqlen_q,
                                                      int seqlen_k, int off) {
    return n0 + BLOCK_N <= seqlen_k &&
           (p.window_left < 0 || n0 >= m_last + off - p.window_left) &&
           (p.window_right < 0 || n0 + BLOCK_N - 1 <= m0 + off + p.window_right);
}

// Scores to log2 units with softcap, bias and masking (see attention_portable.cu). Element
// (j, e) of the accumulator is row g + 8*(e/2), column 8j + 2t + e%2 of the warp's tile.
// Returns the factor still to be applied: an interior tile without softcap or bias is left
// in raw units and update_row_state folds scale_log2 into its exp2 argument (one fma in
// place of a multiply and a subtraction); otherwise the scores are final and the factor 1.
// Rows at or beyond seqlen_q are never stored, so they need no masking; with a mask or bias
// they are masked all the same, which keeps those reads in bounds. Softcap and the band are
// decided once per tile (uniform branches), not per element.
// The mask and bias come as views (common.cuh): the arrays in global memory, or the tiles
// of this key tile staged in shared memory.
template <int BLOCK_N, bool HAS_MASK, typename BiasT, typename A, typename MaskV, typename BiasV>
__device__ __forceinline__ A mask_scores(A (&s)[BLOCK_N / 8][4], const AttnParams& p,
                                            long long row0, long long col0, int lane,
                                            bool interior, const MaskV& mask, const BiasV& bias) {
    constexpr bool HAS_BIAS = !is_same_v<BiasT, NoBias>;
    const A scale_log2 = A(p.scale * LOG2E);
    const A softcap = A(p.softcap);
    if (interior && softcap == A(0) && !HAS_BIAS) return scale_log2;
    if (softcap > A(0)) {
        const A cap_over_scale = A(p.scale / p.softcap), cap_log2 = softcap * A(LOG2E);
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = cap_log2 * tanh_acc(s[j][e] * cap_over_scale);
    } else {
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] *= scale_log2;
    }
    if (interior && !HAS_BIAS) return A(1);
    // Element (j, e) is key 8j + e%2 past this lane's first column c0 and row h = e/2 of
    // the lane's two: it is allowed when lo[h] <= 8j + e%2 < hi[h], the key bound and the
    // band of row h as limits relative to c0, clamped to the tile (32-bit compares with
    // immediates in the unrolled loop).
    const long long c0 = col0 + 2 * (lane % 4), off = p.seqlen_k - p.seqlen_q;
    int lo[2], hi[2];
    const unsigned char* mask_row[2];  // the mask and bias at (row h, column c0)
    const BiasT* bias_row[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const long long r = row0 + lane / 4 + 8 * h;
        if constexpr (HAS_MASK) mask_row[h] = mask.at(r, c0);
        if constexpr (HAS_BIAS) bias_row[h] = bias.at(r, c0);
        long long a = -1, z = BLOCK_N + 1;
        if (!interior) {
            z = p.seqlen_k - c0;
            if (p.window_left >= 0) a = r + off - p.window_left - c0;
            if (p.window_right >= 0) z = min(z, r + off + p.window_right + 1 - c0);
        }
        if ((HAS_MASK || HAS_BIAS) && r >= p.seqlen_q) z = -1;  // keeps the reads in bounds
        lo[h] = (int)max(-1LL, min(a, (long long)BLOCK_N + 1));
        hi[h] = (int)max(-1LL, min(z, (long long)BLOCK_N + 1));
    }
#pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int x = 8 * j + e % 2, h = e / 2;
            bool allowed = x >= lo[h] && x < hi[h];
            if constexpr (HAS_MASK) {
                if constexpr (MaskV::safe())  // a load for every element, then a select
                    allowed = allowed & (mask_row[h][mask.step(x)] != 0);
                else if (allowed)
                    allowed = mask_row[h][mask.step(x)] != 0;
            }
            if constexpr (HAS_BIAS) {
                if constexpr (BiasV::safe()) {
                    const A add = A(to_acc(bias_row[h][bias.step(x)])) * A(LOG2E);
                    s[j][e] += allowed ? add : A(0);
                } else if (allowed) {
                    s[j][e] += A(to_acc(bias_row[h][bias.step(x)])) * A(LOG2E);
                }
            }
            if (!allowed) s[j][e] = neg_inf<A>();
        }
    return A(1);
}

// The same with the mask and bias read from global memory.
template <int BLOCK_N, bool HAS_MASK, typename BiasT, typename A>
__device__ __forceinline__ A mask_scores(A (&s)[BLOCK_N / 8][4], const AttnParams& p,
                                            long long row0, long long col0, int lane,
                                            bool interior, const unsigned char* mask,
                                            const BiasT* bias) {
    const GlobalView<unsigned char> mv{mask, p.mask_s.row, p.mask_s.col};
    const GlobalView<BiasT> bv{bias, p.bias_s.row, p.bias_s.col};
    return mask_scores<BLOCK_N, HAS_MASK, BiasT>(s, p, row0, col0, lane, interior, mv, bv);
}

// The exp2 of the softmax. float: exp2f (MUFU.EX2). double: exp2_lanes (common.cuh), whose
// table of 2^(j/32) lives one entry per lane; construct in warp-uniform code.
template <typename A> struct SoftmaxExp2;
template <> struct SoftmaxExp2<float> {
    __device__ explicit SoftmaxExp2(int) {}
    __device__ float operator()(float x) const { return exp2f(x); }
};
template <> struct SoftmaxExp2<double> {
    double lane_fraction;
    __device__ explicit SoftmaxExp2(int lane) : lane_fraction(EXP2_FRACTIONS[lane]) {}
    __device__ double operator()(double x) const { return exp2_lanes(x, lane_fraction); }
};

// max(running, x) for a running max that is never NaN: a NaN x is ignored (as fmax does),
// so a NaN score reaches only its own row, through exp2 into l and acc. For double this is
// one compare and two selects where fmax takes six instructions.
__device__ __forceinline__ float running_max(float running, float x) { return fmaxf(running, x); }
__device__ __forceinline__ double running_max(double running, double x) {
    return x > running ? x : running;
}

// How far (log2 units) a tile's row max may exceed the row's m before m is raised: the
// rescale of l and acc (an exp2 and DV_TILES * 4 multiplies per row) happens only when some
// row of the warp exceeds its m by more than this, and otherwise p = exp2(s - m) <= 2^8,
// which float, double and the 16-bit P operands hold exactly as well as p <= 1. Results
// are exact for any m (out = acc / l, lse = m ln 2 + log l); this only trades rescales for
// range. Rows reach their true max within a few tiles, so later tiles skip the rescale.
constexpr float RESCALE_SLACK = 8.f;

// Online softmax over one tile for the lane's two rows (h = 0: row g, h = 1: row g + 8),
// all but the rescale of the accumulators: s becomes p = exp2(s * scale - m), l and m are
// updated, and the result says (warp-uniformly) whether acc must still be multiplied row by
// row by alpha. scale: the factor mask_scores left to apply (scale_log2, or 1).
template <int BLOCK_N, typename A, typename Exp2>
__device__ __forceinline__ bool update_row_stats(A (&s)[BLOCK_N / 8][4], A (&m)[2], A (&l)[2],
                                                 A (&alpha)[2], A scale, const Exp2& exp2_fn) {
    A tile_max[2];
    bool grow = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        A x = neg_inf<A>();
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j)
            x = running_max(running_max(x, s[j][2 * h]), s[j][2 * h + 1]);
        // the four lanes of a quad hold the row's columns
        x = running_max(x, __shfl_xor_sync(0xffffffffu, x, 1));
        x = running_max(x, __shfl_xor_sync(0xffffffffu, x, 2));
        tile_max[h] = x * scale;  // scale > 0: the max of the scaled scores
        grow |= tile_max[h] > m[h] + A(RESCALE_SLACK);
    }
    const bool rescale = __any_sync(0xffffffffu, grow);
    if (rescale) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const A m_new = running_max(m[h], tile_max[h]);
            const A m_use = m_new == neg_inf<A>() ? A(0) : m_new;  // nothing allowed yet
            alpha[h] = exp2_fn(m[h] - m_use);
            l[h] *= alpha[h];
            m[h] = m_new;
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const A neg_m = m[h] == neg_inf<A>() ? A(0) : -m[h];
        A tile_sum = A(0);
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
            for (int e = 2 * h; e < 2 * h + 2; ++e) {
                s[j][e] = exp2_fn(fma(s[j][e], scale, neg_m));
                tile_sum += s[j][e];
            }
        // the quad's partial sums are combined once, at the end (l is per lane until then)
        l[h] += tile_sum;
    }
    return rescale;
}

// acc row h *= alpha[h] (the rescale update_row_stats asks for)
template <int DV_TILES, typename A>
__device__ __forceinline__ void rescale_rows(A (&acc)[DV_TILES][4], const A (&alpha)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int d = 0; d < DV_TILES; ++d) {
            acc[d][2 * h] *= alpha[h];
            acc[d][2 * h + 1] *= alpha[h];
        }
}

// The row state before the first tile: O zero, the running max -inf, the running sum 0.
template <int DV_TILES, typename A>
__device__ __forceinline__ void clear_row_state(A (&acc)[DV_TILES][4], A (&m)[2], A (&l)[2]) {
    m[0] = m[1] = neg_inf<A>();
    l[0] = l[1] = A(0);
#pragma unroll
    for (int d = 0; d < DV_TILES; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[d][e] = A(0);
}

// The whole online-softmax step of one tile: update_row_stats, then the rescale of acc.
template <int BLOCK_N, int DV_TILES, typename A, typename Exp2>
__device__ __forceinline__ void update_row_state(A (&s)[BLOCK_N / 8][4], A (&m)[2], A (&l)[2],
                                                 A (&acc)[DV_TILES][4], A scale,
                                                 const Exp2& exp2_fn) {
    A alpha[2];
    if (update_row_stats<BLOCK_N>(s, m, l, alpha, scale, exp2_fn)) rescale_rows(acc, alpha);
}

// Two adjacent output elements, 2 * sizeof(T)-byte aligned: one store.
template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float x0, float x1) {
    if constexpr (is_same_v<T, float>)
        *reinterpret_cast<float2*>(dst) = make_float2(x0, x1);
    else
        *reinterpret_cast<unsigned*>(dst) = pack2<T>(x0, x1);
}

// The end of the online softmax for one 16-row tile of a warp with output T: out =
// acc / l and lse = m ln 2 + log l for rows row0 + g and row0 + g + 8, after the quad's
// partial row sums are combined; a row with no allowed key gives out 0 and lse -inf.
// Rows past seqlen_q and the columns of the zero pad are not written.
template <typename T, int DV_TILES>
__device__ __forceinline__ void store_rows(const float (&acc)[DV_TILES][4], const float (&l)[2],
                                           const float (&m)[2], const AttnParams& p,
                                           long long b, long long row0, int lane) {
    T* out = reinterpret_cast<T*>(p.out) + batch_offset(p.out_s, b, p.batch1, p.batch2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float row_l = l[h];
        row_l += __shfl_xor_sync(0xffffffffu, row_l, 1);  // the quad's partial row sums
        row_l += __shfl_xor_sync(0xffffffffu, row_l, 2);
        const long long r = row0 + lane / 4 + 8 * h;
        if (r >= p.seqlen_q) continue;  // rows past the end of a partial tile
        const float inv_l = row_l == 0.f ? 0.f : 1.f / row_l;
        T* out_row = out + r * p.out_s.row;
        // columns 2t and 2t+1 of each 8-column tile: one store when they are adjacent in
        // memory and aligned (Dv even), else two element stores
        const bool pairs = p.out_s.col == 1 && p.head_dim_v % 2 == 0 &&
                           (reinterpret_cast<unsigned long long>(out_row) % (2 * sizeof(T))) == 0;
#pragma unroll
        for (int d = 0; d < DV_TILES; ++d) {
            const int c = 8 * d + 2 * (lane % 4);
            if (c >= p.head_dim_v) continue;  // columns of the zero pad
            const float x0 = acc[d][2 * h] * inv_l, x1 = acc[d][2 * h + 1] * inv_l;
            if (pairs) {
                store_pair(out_row + c, x0, x1);
            } else {
                out_row[c * p.out_s.col] = from_acc<T>(x0);
                if (c + 1 < p.head_dim_v) out_row[(c + 1) * p.out_s.col] = from_acc<T>(x1);
            }
        }
        if (p.lse && lane % 4 == 0) {
            float* lse = reinterpret_cast<float*>(p.lse) + batch_offset(p.lse_s, b, p.batch1, p.batch2);
            lse[r * p.lse_s.row] = row_l == 0.f ? neg_inf<float>() : m[h] * float(LN2) + logf(row_l);
        }
    }
}

}  // namespace mma
}  // namespace cuattn
