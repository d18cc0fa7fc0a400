// split16.cuh -- the 3xTF32 split carried by scaled float16 operands on 16-bit wgmma, shared
// by the sm90_3xf16 forward (attention_sm90_3xf16.cu) and backward
// (attention_backward_sm90_3xf16.cu), whose recomputed scores must be the forward's: the
// same split of the same values with the same scales, summed the same way.
//   range_scale, split_f16(x2)  the power-of-two scale of a largest magnitude; x's parts
//   split_stacked16             a raw float tile into a stacked [hi; lo] float16 tile
//   split_own_tiles             a block's stationary operand, split from global memory
//   split_fragments             accumulators as split A fragments
//   split_product_ra16          acc = X Z by the split, small terms first
//   stacked_sum_unscaled        hh + (hl + lh), the scales taken out
//   magnitudes_of_rows          the largest finite magnitudes of a batch entry's rows
#pragma once

#include "sm90/sm90_tiles.cuh"

namespace cuattn {
namespace split16 {

using namespace cuattn::mma;
using namespace cuattn::sm90;

constexpr int MAGS = 5;  // per batch entry, in this order:
enum Magnitude { MAG_Q, MAG_K, MAG_V, MAG_DOUT, MAG_OUT };
constexpr float P_SCALE = 32768.f;  // P <= 1 (to rounding) times 2^15 stays below 65504

// The power of two that puts a largest magnitude m in [2^14, 2^15) (exponent clamped to
// [-100, 100]); 1 for m = 0 (an entry of zeros) or a non-finite m.
__device__ __forceinline__ float range_scale(float m) {
    if (!(m > 0.f) || !isfinite(m)) return 1.f;
    return ldexpf(1.f, 14 - max(-100, min(100, ilogbf(m))));
}

// x's 3xTF32 parts (split_tf32: hi to nearest, lo as the TF32 instruction reads it, toward
// zero) times the power of two s, as float16
__device__ __forceinline__ void split_f16(float x, float s, __half& hi, __half& lo) {
    float h, l;
    split_tf32(x, h, l);
    hi = __float2half_rn(h * s);  // 11 significant bits: exact in the normal range
    lo = __float2half_rz(l * s);
}
__device__ __forceinline__ void split_f16x2(float x0, float x1, float s, unsigned& hi,
                                            unsigned& lo) {
    __half h0, l0, h1, l1;
    split_f16(x0, s, h0, l0);
    split_f16(x1, s, h1, l1);
    __half2 h = __halves2half2(h0, h1), l = __halves2half2(l0, l1);
    hi = *reinterpret_cast<unsigned*>(&h);
    lo = *reinterpret_cast<unsigned*>(&l);
}

// The split of a ROWS x COLS raw float tile (Sw128<ROWS, 4>) into one stacked float16 tile of
// 2 ROWS rows (Sw128<2 ROWS, 2>): hi * s in rows 0 .. ROWS - 1, lo * s in rows ROWS .. 2 ROWS -
// 1, so that one product reads [X_hi; X_lo] as a B operand of twice the width and the
// gradient products read either half N-contiguous. Thread i takes 4-column chunks i, i +
// THREADS, ..., consecutive threads along a row (four 128-byte reads and two 128-byte
// writes per warp and step).
template <int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void split_stacked16(__half* dst, const float* raw, float s) {
    constexpr int C4 = COLS / 4;
    static_assert(ROWS * C4 % THREADS == 0, "whole steps");
#pragma unroll
    for (int i = 0; i < ROWS * C4 / THREADS; ++i) {
        const int idx = threadIdx.x + i * THREADS, r = idx / C4, c = idx % C4 * 4;
        const float4 x = *reinterpret_cast<const float4*>(raw + Sw128<ROWS, 4>()(r, c));
        uint2 h, l;
        split_f16x2(x.x, x.y, s, h.x, l.x);
        split_f16x2(x.z, x.w, s, h.y, l.y);
        *reinterpret_cast<uint2*>(dst + Sw128<2 * ROWS, 2>()(r, c)) = h;
        *reinterpret_cast<uint2*>(dst + Sw128<2 * ROWS, 2>()(r + ROWS, c)) = l;
    }
}

// A block's stationary operand, 64 rows a warpgroup: warpgroup g's rows g * 64 .. of a
// (`rows` rows left from a's first, `cols` columns; rows and columns past them are zeros)
// split into its hi tile at dst + g * 2 * 64 * COLS and lo tile 64 * COLS halves on
// (Sw128<64, 2>), for the tensor cores' A operand. Loaded from global memory into registers
// (all of a thread's loads in flight before its first split), once per block.
template <int WARPGROUPS, int COLS, int THREADS, bool ALIGNED>
__device__ __forceinline__ void split_own_tiles(__half* dst, const float* a, const Strides& str,
                                                long long rows, long long cols, float s) {
    constexpr int C4 = COLS / 4, PER = 64 * C4 / THREADS;
    static_assert(64 * C4 % THREADS == 0, "whole steps");
#pragma unroll
    for (int g = 0; g < WARPGROUPS; ++g) {
        float4 x[PER];
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int idx = threadIdx.x + i * THREADS, r = idx / C4, c = idx % C4 * 4;
            const long long row = 64 * g + r;
            x[i] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (row >= rows) continue;
            const float* src = a + row * str.row;
            if (ALIGNED && c + 4 <= cols) {
                x[i] = *reinterpret_cast<const float4*>(src + c);
            } else {
                float e[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (c + j < cols) e[j] = src[(c + j) * str.col];
                x[i] = make_float4(e[0], e[1], e[2], e[3]);
            }
        }
        __half* hi = dst + g * 2 * 64 * COLS;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int idx = threadIdx.x + i * THREADS, r = idx / C4, c = idx % C4 * 4;
            uint2 h, l;
            split_f16x2(x[i].x, x[i].y, s, h.x, l.x);
            split_f16x2(x[i].z, x[i].w, s, h.y, l.y);
            *reinterpret_cast<uint2*>(hi + Sw128<64, 2>()(r, c)) = h;
            *reinterpret_cast<uint2*>(hi + 64 * COLS + Sw128<64, 2>()(r, c)) = l;
        }
    }
}

// X (64 x ROWS, m16n8 accumulator layout) times the power of two s, split, as the hi and lo
// A fragments of a 16-bit register-A product (pack_a's order)
template <int ROWS>
__device__ __forceinline__ void split_fragments(unsigned (&hi)[ROWS / 16][4],
                                                unsigned (&lo)[ROWS / 16][4],
                                                const float (&x)[ROWS / 8][4], float s) {
#pragma unroll
    for (int kk = 0; kk < ROWS / 16; ++kk) {
        split_f16x2(x[2 * kk][0], x[2 * kk][1], s, hi[kk][0], lo[kk][0]);
        split_f16x2(x[2 * kk][2], x[2 * kk][3], s, hi[kk][1], lo[kk][1]);
        split_f16x2(x[2 * kk + 1][0], x[2 * kk + 1][1], s, hi[kk][2], lo[kk][2]);
        split_f16x2(x[2 * kk + 1][2], x[2 * kk + 1][3], s, hi[kk][3], lo[kk][3]);
    }
}

// acc (64 x N) (+)= X Z, X (64 x ROWS) as A fragments and Z the stacked split tile z_tile
// (2 ROWS rows: hi, then lo; 64-column groups 2 ROWS * 128 bytes apart) read N-contiguous
template <int N, int ROWS>
__device__ __forceinline__ void product_ra16(float (&acc)[N / 8][4], const unsigned (&a)[ROWS / 16][4],
                                             unsigned z_tile, bool accumulate) {
#pragma unroll
    for (int kk = 0; kk < ROWS / 16; ++kk)
        Wgmma<N, __half>::rs(acc, a[kk], sw128_desc(z_tile + kk * 16 * 128, 2 * ROWS * 128),
                             accumulate || kk > 0);
}

// acc (64 x N) = X Z by the split into fresh accumulators, small terms first: X_hi Z_lo,
// X_lo Z_hi, X_hi Z_hi. Fences and issues; the caller commits, waits and keeps the fragments
// until then.
template <int N, int ROWS>
__device__ __forceinline__ void split_product_ra16(float (&acc)[N / 8][4],
                                                   const unsigned (&hi)[ROWS / 16][4],
                                                   const unsigned (&lo)[ROWS / 16][4],
                                                   unsigned z_stacked) {
    wgmma_fence();
    product_ra16<N, ROWS>(acc, hi, z_stacked + ROWS * 128, false);
    product_ra16<N, ROWS>(acc, lo, z_stacked, true);
    product_ra16<N, ROWS>(acc, hi, z_stacked, true);
}

// acc = (hh + (hl + lh)) / (s_a s_b): stacked_sum, then the scales out (two exact multiplies)
template <int N8>
__device__ __forceinline__ void stacked_sum_unscaled(float (&acc)[N8][4],
                                                     const float (&wide)[2 * N8][4],
                                                     const float (&y)[N8][4], float inv_a,
                                                     float inv_b) {
#pragma unroll
    for (int j = 0; j < N8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            acc[j][e] = (wide[j][e] + (wide[N8 + j][e] + y[j][e])) * inv_a * inv_b;
}

template <int N>
__device__ __forceinline__ void add_into(float (&acc)[N][4], const float (&x)[N][4]) {
#pragma unroll
    for (int d = 0; d < N; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[d][e] += x[d][e];
}

template <int N>
__device__ __forceinline__ void scale_by(float (&acc)[N][4], float a, float b) {
#pragma unroll
    for (int d = 0; d < N; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[d][e] = acc[d][e] * a * b;
}

// The scales of batch entry b (magnitudes_of_rows; dout and ds for the backward only)
struct SplitScales {
    float q, k, v, dout, ds;
    __device__ __forceinline__ SplitScales(const AttnParams& p, long long b) {
        const float* m = reinterpret_cast<const float*>(p.magnitudes) + b * MAGS;
        q = range_scale(m[MAG_Q]);
        k = range_scale(m[MAG_K]);
        v = range_scale(m[MAG_V]);
        dout = range_scale(m[MAG_DOUT]);
        ds = range_scale(float(p.head_dim_v) * m[MAG_DOUT] * (m[MAG_V] + m[MAG_OUT]));
    }
};

// attention_{fwd,bwd}_magnitudes: rows per block (two a warp), and the widest head dim read
constexpr int MAG_THREADS = 256, MAG_ROWS = 16, MAG_COLS = 128;

// The largest finite |q|, |k|, |v| (and, with dout, |dout| and |out|) of each batch entry
// into p.magnitudes[b * 5 + Magnitude] (zeroed by the caller): block (chunk c, entry b) of a
// grid of `chunks` chunks per entry takes rows c * MAG_ROWS .. of q (and dout, out) below
// Sq and of k and v below Sk. The forward and the backward read q and k through the same
// strides, so both find the same maxima (max is exact): the same scales.
__device__ __forceinline__ void magnitudes_of_rows(const AttnParams& p, long long dout_addr,
                                                   const Strides& dout_s, unsigned chunks) {
    // 32-bit: a grid has fewer than 2^31 blocks; the batch entry's three indices computed
    // once (64-bit divisions are a subroutine call each)
    const long long b = blockIdx.x / chunks, r0 = (long long)(blockIdx.x % chunks) * MAG_ROWS;
    const long long b2 = b % p.batch2, b01 = b / p.batch2, b1 = b01 % p.batch1, b0 = b01 / p.batch1;
    auto entry = [&](long long base, const Strides& s) {
        return reinterpret_cast<const float*>(base) + (b0 * s.b0 + b1 * s.b1 + b2 * s.b2);
    };
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const bool bwd = dout_addr != 0;
    const float *q = entry(p.q, p.q_s), *k = entry(p.k, p.k_s), *v = entry(p.v, p.v_s);
    const float *out = bwd ? entry(p.out, p.out_s) : nullptr;
    const float *dout = bwd ? entry(dout_addr, dout_s) : nullptr;
    // one running maximum per tensor (named, not an array: no local memory)
    float mq = 0.f, mk = 0.f, mv = 0.f, mdo = 0.f, mo = 0.f;
    auto take = [](float& m, float x) {
        if (isfinite(x)) m = fmaxf(m, fabsf(x));
    };
    // a warp's loads of a row all issued before their maxima are taken (a loop that took
    // each load's maximum in turn waited for memory once per load: 0.6 ms for B4 H32 S4096
    // D64, 0.45 with the rows merely unrolled, 0.26 so)
    for (int i = 0; i < MAG_ROWS / (MAG_THREADS / 32); ++i) {
        const long long r = r0 + warp + i * (MAG_THREADS / 32);
        const bool in_q = r < p.seqlen_q, in_k = r < p.seqlen_k, in_o = bwd && in_q;
        float x[5][MAG_COLS / 32];
#pragma unroll
        for (int j = 0; j < MAG_COLS / 32; ++j) {
            const long long c = lane + 32 * j;
            const bool d = c < p.head_dim, dv = c < p.head_dim_v;
            x[0][j] = in_q && d ? q[r * p.q_s.row + c * p.q_s.col] : 0.f;
            x[1][j] = in_o && dv ? dout[r * dout_s.row + c * dout_s.col] : 0.f;
            x[2][j] = in_o && dv ? out[r * p.out_s.row + c * p.out_s.col] : 0.f;
            x[3][j] = in_k && d ? k[r * p.k_s.row + c * p.k_s.col] : 0.f;
            x[4][j] = in_k && dv ? v[r * p.v_s.row + c * p.v_s.col] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < MAG_COLS / 32; ++j) {
            take(mq, x[0][j]);
            take(mdo, x[1][j]);
            take(mo, x[2][j]);
            take(mk, x[3][j]);
            take(mv, x[4][j]);
        }
    }
    __shared__ float part[MAGS][MAG_THREADS / 32];
    auto reduce = [&](float m, int i) {
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
        if (lane == 0) part[i][warp] = m;
    };
    reduce(mq, MAG_Q);
    reduce(mk, MAG_K);
    reduce(mv, MAG_V);
    reduce(mdo, MAG_DOUT);
    reduce(mo, MAG_OUT);
    __syncthreads();
    if (threadIdx.x < MAGS) {
        float x = 0.f;
        for (int w = 0; w < MAG_THREADS / 32; ++w) x = fmaxf(x, part[threadIdx.x][w]);
        atomicMax(reinterpret_cast<unsigned*>(p.magnitudes) + b * MAGS + threadIdx.x,
                  __float_as_uint(x));
    }
}

}  // namespace split16
}  // namespace cuattn
