// portable_tiles.cuh -- the shared-memory tile machinery of the CUDA-core ("portable")
// attention kernels: the forward (attention_portable.cu) and the backward
// (attention_backward_portable.cu).
//
// Every kernel that includes it runs THREADS = 256 threads as a 16 x 16 grid (ty, tx).
// Tiles live in shared memory in the accumulator type A (float or double), row-major with a
// row pitch of (width + PAD) elements, PAD = 16 bytes of A. Products:
//   scores     s[i][j]   += X[ty*TM + i, :] . Y[tx + 16*j, :]     (both operands row-major)
//   accumulate acc[i][c] += sum_n P[ty*TM + i, n] V[n, (tx + 16*u)*VEC + e]   (c = u*VEC + e)
// so a thread owns TM rows, every 16th column of a score tile and 16-byte groups of output
// columns. The 16 threads of one row group are one half-warp. scores_strided and
// accumulate_strided are the same products with other row and column steps (the forward's
// warp-tiled form: rows 4 apart, columns 8 apart).
#pragma once

#include "common/common.cuh"

namespace cuattn {
namespace portable {

constexpr int THREADS = 256;

// 16 bytes of A: the unit of every shared-memory read in the inner loops. A padded row of
// (width + VEC) elements is an odd number of 16-byte units, so the eight threads of one
// LDS.128 phase that read eight different rows hit eight different bank groups.
template <typename A> struct Vec16;
template <> struct Vec16<float> { using type = float4; };
template <> struct Vec16<double> { using type = double2; };

template <typename A, int N>
__device__ __forceinline__ void lds16(A (&dst)[N], const A* src) {
    static_assert(N * sizeof(A) == 16, "lds16 moves exactly 16 bytes");
    *reinterpret_cast<typename Vec16<A>::type*>(dst) =
        *reinterpret_cast<const typename Vec16<A>::type*>(src);
}

// x as a TF32 tensor core reads it when TF32 (sm_80+): rounded to nearest, ties away
// (cvt.rna), the low 13 bits clear; x itself otherwise
template <bool TF32, typename A> __device__ __forceinline__ A tf32_if(A x) {
    if constexpr (TF32) {
        static_assert(sizeof(A) == 4, "TF32 rounds float32 operands");
        unsigned r;
        asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
        return __uint_as_float(r & 0xFFFFE000u);
    } else {
        return x;
    }
}

// Copy a ROWS x COLS tile of a strided global tensor into shared memory (row pitch
// COLS + PAD), converting to the accumulator type. Elements outside [0, nrows) x [0, ncols)
// become 0 so that partial tiles contribute nothing to the dot products. Each thread keeps
// one column and walks rows THREADS / COLS apart, so its address advances by one add.
// TF32: each element as a TF32 tensor core reads it (tf32_if).
template <int ROWS, int COLS, int PAD, bool TF32 = false, typename T, typename A>
__device__ __forceinline__ void load_tile(A* dst, const T* src, long long row_stride,
                                          long long col_stride, long long nrows,
                                          long long ncols) {
    static_assert(THREADS % COLS == 0, "a tile row must divide the block");
    constexpr int ROW_STEP = THREADS / COLS;
    const int c = threadIdx.x % COLS;  // consecutive threads: consecutive columns
    const bool col_ok = c < ncols;
    const T* ptr = src + (threadIdx.x / COLS) * row_stride + c * col_stride;
#pragma unroll 4
    for (int r = threadIdx.x / COLS; r < ROWS; r += ROW_STEP, ptr += ROW_STEP * row_stride)
        dst[r * (COLS + PAD) + c] = col_ok && r < nrows ? tf32_if<TF32>(to_acc(*ptr)) : A(0);
}

// The ALIGNED copy of load_tile_async (below) one row step at a time: each next() issues
// this thread's next 16-byte chunk (load_tile_async's chunks, in rows ROW_STEP apart), so that
// a kernel can spread a tile's copy over the free issue slots of a phase (between a
// product's FMAs, or a softmax's exp2 chains) instead of issuing it in one burst after a
// barrier, which every warp then waits out. The state advances by increments (a source
// pointer, a shared address, the rows left), which keeps it at four registers. Same zero
// fill outside [0, nrows) x [0, ncols). A tile is PARTS row steps when FITS; otherwise the
// caller stops at row ROWS (load_tile_async's loop), since a step past it writes past the tile.
template <int ROWS, int COLS, int PAD, typename A> struct RowCopy {
    static constexpr int VEC = 16 / sizeof(A), CHUNKS = COLS / VEC, ROW_STEP = THREADS / CHUNKS;
    static constexpr int PARTS = ROWS / ROW_STEP;
    static constexpr bool CHUNKED = COLS % VEC == 0 && THREADS % CHUNKS == 0;
    static constexpr bool FITS = CHUNKED && ROWS % ROW_STEP == 0;
    const A* src;
    unsigned dst;
    int rows_left;  // rows of the tile from this thread's next row on; <= 0 past the end
    __device__ __forceinline__ RowCopy(A* tile, const A* g, long long row_stride,
                                       long long nrows, long long ncols) {
        static_assert(CHUNKED, "a tile row is whole 16-byte chunks, and its chunks divide the block");
        const int c = (threadIdx.x % CHUNKS) * VEC, r = threadIdx.x / CHUNKS;
        src = g + r * row_stride + c;
        dst = static_cast<unsigned>(__cvta_generic_to_shared(tile + r * (COLS + PAD) + c));
        // a chunk past the columns never copies: no rows left for it
        rows_left = c < ncols ? (int)min(nrows - r, (long long)ROWS) : 0;
    }
    __device__ __forceinline__ void next(long long row_stride) {
        const bool ok = rows_left > 0;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                     "r"(ok ? 16 : 0));
        src += ROW_STEP * row_stride;
        dst += ROW_STEP * (COLS + PAD) * sizeof(A);
        rows_left -= ROW_STEP;
    }
};

// load_tile through cp.async (sm_80+): the copy runs in the background until
// cp_async_wait; elements outside the tile's valid range are zero-filled (src-size 0).
// Only for T == A (float32, float64): 16-bit inputs are converted on load instead.
// ALIGNED: 16-byte chunks, one cp.async per 16 bytes, for unit column strides, row strides
// and pointers on 16-byte boundaries and ncols a multiple of a chunk (so chunks are all or
// nothing); otherwise one cp.async per element.
template <int ROWS, int COLS, int PAD, bool ALIGNED, typename A>
__device__ __forceinline__ void load_tile_async(A* dst, const A* src, long long row_stride,
                                                long long col_stride, long long nrows,
                                                long long ncols) {
    if constexpr (ALIGNED && THREADS % (COLS / (16 / sizeof(A))) == 0) {
        // a thread keeps one chunk column and walks rows THREADS / CHUNKS apart, its
        // addresses advancing by one add each (the general loop below spent about ten
        // integer instructions per chunk on the row's address): RowCopy's row steps in a loop
        using Copy = RowCopy<ROWS, COLS, PAD, A>;
        Copy copy(dst, src, row_stride, nrows, ncols);
#pragma unroll 8
        for (int r = threadIdx.x / Copy::CHUNKS; r < ROWS; r += Copy::ROW_STEP) copy.next(row_stride);
        return;
    }
    if constexpr (ALIGNED) {
        constexpr int VEC = 16 / sizeof(A), CHUNKS = COLS / VEC;
        static_assert(COLS % VEC == 0, "a tile row is a whole number of 16-byte chunks");
#pragma unroll 4
        for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS) {
            const int r = idx / CHUNKS, c = (idx % CHUNKS) * VEC;
            const bool ok = r < nrows && c < ncols;
            const unsigned dst_addr =
                static_cast<unsigned>(__cvta_generic_to_shared(dst + r * (COLS + PAD) + c));
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_addr),
                         "l"(ok ? src + r * row_stride + c : src), "r"(ok ? 16 : 0));
        }
        return;
    }
    static_assert(THREADS % COLS == 0, "a tile row must divide the block");
    constexpr int ROW_STEP = THREADS / COLS;
    const int c = threadIdx.x % COLS;
    const bool col_ok = c < ncols;
    const A* ptr = src + (threadIdx.x / COLS) * row_stride + c * col_stride;
#pragma unroll 4
    for (int r = threadIdx.x / COLS; r < ROWS; r += ROW_STEP, ptr += ROW_STEP * row_stride) {
        const unsigned dst_addr =
            static_cast<unsigned>(__cvta_generic_to_shared(dst + r * (COLS + PAD) + c));
        const bool ok = col_ok && r < nrows;
        // an invalid element reads 0 bytes; the address must still be a global one
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst_addr),
                     "l"(ok ? ptr : src), "n"(sizeof(A)), "r"(ok ? (int)sizeof(A) : 0));
    }
}

// x = 0: one thread's accumulator tile (scores, or its part of the output), before the
// products accumulate into it
template <int R, int C, typename A>
__device__ __forceinline__ void clear_tile(A (&x)[R][C]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < C; ++j) x[i][j] = A(0);
}

// x += y, elementwise
template <int R, int C, typename A>
__device__ __forceinline__ void add_tile(A (&x)[R][C], const A (&y)[R][C]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < C; ++j) x[i][j] += y[i][j];
}

// scores_strided calls `between(step)` at the head of each contraction step; NoSteps does
// nothing.
struct NoSteps {
    __device__ __forceinline__ void operator()(int) const {}
};

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

// s[i][j] += X[x0 + ROW_STEP*i, :] . Y[y0 + COL_STEP*j, :] over one D_TILE chunk held in
// shared memory (two row-major tiles of pitch D_TILE + PAD); UNROLL steps of the
// contraction (VEC values each) unrolled; between(d / VEC) heads each step.
template <int TM, int TN, int D_TILE, int PAD, int ROW_STEP, int COL_STEP, int UNROLL,
          typename A, typename Between = NoSteps>
__device__ __forceinline__ void scores_strided(A (&s)[TM][TN], const A* x_s, const A* y_s,
                                               int x0, int y0,
                                               const Between& between = Between()) {
    constexpr int VEC = 16 / sizeof(A);
#pragma unroll UNROLL
    for (int d = 0; d < D_TILE; d += VEC) {
        between(d / VEC);
        A qf[TM][VEC], kf[TN][VEC];
#pragma unroll
        for (int i = 0; i < TM; ++i) lds16(qf[i], x_s + (x0 + ROW_STEP * i) * (D_TILE + PAD) + d);
#pragma unroll
        for (int j = 0; j < TN; ++j) lds16(kf[j], y_s + (y0 + COL_STEP * j) * (D_TILE + PAD) + d);
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j)
#pragma unroll
                for (int e = 0; e < VEC; ++e) s[i][j] = fma(qf[i][e], kf[j][e], s[i][j]);
    }
}

// s[i][j] += Q[ty*TM + i, :] . K[tx + 16*j, :] over one D_TILE chunk held in shared memory.
template <int TM, int TN, int D_TILE, int PAD, typename A>
__device__ __forceinline__ void scores(A (&s)[TM][TN], const A* q_s, const A* k_s, int tx,
                                       int ty) {
    scores_strided<TM, TN, D_TILE, PAD, 1, 16, 2>(s, q_s, k_s, ty * TM, tx);
}

// scores() of one chunk of a longer contraction; APART: each 64 columns' products summed
// on their own and then added to s, a blocked sum (a chain of 100-odd float32 products is
// less accurate than BLAS's blocked sums), in registers a one-chunk kernel does not hold.
template <int TM, int TN, int D_TILE, int PAD, bool APART, typename A>
__device__ __forceinline__ void chunk_scores(A (&s)[TM][TN], const A* q_s, const A* k_s,
                                             int tx, int ty) {
    if constexpr (APART) {
        constexpr int SUB = D_TILE < 64 ? D_TILE : 64;
#pragma unroll 1
        for (int c = 0; c < D_TILE; c += SUB) {
            A part[TM][TN];
            clear_tile(part);
            // SUB columns of rows D_TILE + PAD apart
            scores<TM, TN, SUB, PAD + D_TILE - SUB>(part, q_s + c, k_s + c, tx, ty);
            add_tile(s, part);
        }
    } else {
        scores<TM, TN, D_TILE, PAD>(s, q_s, k_s, tx, ty);
    }
}

// acc[i][u*VEC + f] += sum_n P[p0 + ROW_STEP*i, n] V[n, (v0 + COL_STEP*u)*VEC + f] (P of
// pitch BLOCK_N + PAD, V of pitch DV_TILE + PAD).
template <int TM, int TV, int BLOCK_N, int DV_TILE, int PAD, int ROW_STEP, int COL_STEP,
          typename A>
__device__ __forceinline__ void accumulate_strided(A (&acc)[TM][TV], const A* p_s,
                                                   const A* v_s, int p0, int v0) {
    constexpr int VEC = 16 / sizeof(A);
#pragma unroll 2
    for (int n = 0; n < BLOCK_N; n += VEC) {
        A pf[TM][VEC];
#pragma unroll
        for (int i = 0; i < TM; ++i) lds16(pf[i], p_s + (p0 + ROW_STEP * i) * (BLOCK_N + PAD) + n);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
#pragma unroll
            for (int u = 0; u < TV / VEC; ++u) {
                A vf[VEC];
                lds16(vf, v_s + (n + e) * (DV_TILE + PAD) + (v0 + COL_STEP * u) * VEC);
#pragma unroll
                for (int i = 0; i < TM; ++i)
#pragma unroll
                    for (int f = 0; f < VEC; ++f)
                        acc[i][u * VEC + f] = fma(pf[i][e], vf[f], acc[i][u * VEC + f]);
            }
        }
    }
}

// accumulate_strided with its operands loaded one step (VEC keys) ahead, into registers of
// their own, so that the loads of a step are in flight while the previous step's FMAs run
// (the forward's warp-tiled form: +3 % at float64 D64 on an H200). The last two steps are
// peeled, so no load is conditional.
template <int TM, int TV, int BLOCK_N, int DV_TILE, int PAD, int ROW_STEP, int COL_STEP,
          typename A>
__device__ __forceinline__ void accumulate_ahead(A (&acc)[TM][TV], const A* p_s, const A* v_s,
                                                 int p0, int v0) {
    constexpr int VEC = 16 / sizeof(A), TU = TV / VEC;
    static_assert(BLOCK_N % (2 * VEC) == 0, "two steps per pass");
    A pf[2][TM][VEC], vf[2][VEC][TU][VEC];
    auto load = [&](int b, int n) {
#pragma unroll
        for (int i = 0; i < TM; ++i)
            lds16(pf[b][i], p_s + (p0 + ROW_STEP * i) * (BLOCK_N + PAD) + n);
#pragma unroll
        for (int e = 0; e < VEC; ++e)
#pragma unroll
            for (int u = 0; u < TU; ++u)
                lds16(vf[b][e][u], v_s + (n + e) * (DV_TILE + PAD) + (v0 + COL_STEP * u) * VEC);
    };
    auto step = [&](int b) {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
#pragma unroll
            for (int u = 0; u < TU; ++u)
#pragma unroll
                for (int i = 0; i < TM; ++i)
#pragma unroll
                    for (int f = 0; f < VEC; ++f)
                        acc[i][u * VEC + f] =
                            fma(pf[b][i][e], vf[b][e][u][f], acc[i][u * VEC + f]);
    };
    load(0, 0);
#pragma unroll 1
    for (int n = 0; n < BLOCK_N - 2 * VEC; n += 2 * VEC) {
        load(1, n + VEC);
        step(0);
        load(0, n + 2 * VEC);
        step(1);
    }
    load(1, BLOCK_N - VEC);  // the last two steps
    step(0);
    step(1);
}

// acc[i][u*VEC + f] += sum_n P[ty*TM + i, n] V[n, (tx + 16*u)*VEC + f]: the P.V product of
// the forward and the P^T.dO and dS^T.Q products of the backward.
template <int TM, int TV, int BLOCK_N, int DV_TILE, int PAD, typename A>
__device__ __forceinline__ void accumulate(A (&acc)[TM][TV], const A* p_s, const A* v_s,
                                           int tx, int ty) {
    accumulate_strided<TM, TV, BLOCK_N, DV_TILE, PAD, 1, 16>(acc, p_s, v_s, ty * TM, tx);
}

}  // namespace portable
}  // namespace cuattn
