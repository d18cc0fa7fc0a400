// mma_tiles.cuh -- the tensor-core tile machinery shared by the mma.sync attention kernels
// (attention_mma.cu, the forward; attention_backward_mma.cu, the backward; its 16-byte tile
// copier load_tile and the cp.async helpers also serve attention_mma_wide.cu).
//
// Operands are 16-bit (T = __half or __nv_bfloat16) tiles in shared memory, row-major with
// COLS (a multiple of 64) columns and a 16-byte-chunk XOR swizzle (chunk ^ row % 8), read
// by ldmatrix; products run on mma.sync m16n8k16 with float accumulators. In the m16n8
// accumulator layout lane (g = lane/4, t = lane%4) holds rows g and g+8, columns 2t and
// 2t+1 of each 8-column tile -- which is also the A-operand layout, so a tile of scores
// computed by one product feeds the next product from registers.
//   scores     X Y^T  for a warp's 16*M_TILES rows of X against BLOCK_N rows of Y
//   accumulate_cols O += P Z  with P from registers and Z by ldmatrix.trans (accumulate_pv:
//                   all of Z's columns)
//   zero       accumulators cleared (also the Hopper kernels')
#pragma once

#include "common/common.cuh"

namespace cuattn {
namespace mma {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// d += a * b on one m16n8k16 tile, float accumulators
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1);
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const unsigned (&a)[4],
                                                  unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4],
                                                         unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// two floats -> one register of two T, rounded to nearest (the low half is `lo`)
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}

// TF32 operand: x rounded to nearest (ties away), the bits a TF32 instruction reads
// (attention_mma_wide.cu, attention_sm90_tf32.cu)
__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

// One TF32 m16n8k8 step, d += a b, operands already TF32 bits: A elements (a0, a1, a2, a3)
// = rows (g, g+8, g, g+8) and k = (t, t, t+4, t+4); B elements (b0, b1) = k (t, t+4), column
// g; accumulators rows (g, g, g+8, g+8), columns 2t, 2t+1 (attention_mma_wide.cu,
// attention_backward_mma_f32.cu)
__device__ __forceinline__ void mma_k8(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                       unsigned a3, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The 3xTF32 split x = hi + lo (attention_sm90_tf32.cu): hi = x rounded to TF32 as to_tf32
// rounds it, by an integer add and mask (two instructions where cvt.rna takes four), and
// lo = x - hi, exact. The add-and-mask alone mishandles NaN (0x7fffffff wraps to -0) and
// rounds values near FLT_MAX up to infinity; lo is then NaN or infinite, so products of the
// split still come out NaN or infinite: use hi only together with lo.
__device__ __forceinline__ void split_tf32(float x, float& hi, float& lo) {
    hi = __uint_as_float((__float_as_uint(x) + 0x1000u) & 0xFFFFE000u);
    lo = x - hi;
}
// split_tf32 of a 16-byte chunk
__device__ __forceinline__ void split_tf32(const float4& x, float4& hi, float4& lo) {
    split_tf32(x.x, hi.x, lo.x);
    split_tf32(x.y, hi.y, lo.y);
    split_tf32(x.z, hi.z, lo.z);
    split_tf32(x.w, hi.w, lo.w);
}

// element offset of (row, col) in a swizzled tile of COLS columns (COLS % 64 == 0)
template <int COLS>
__device__ __forceinline__ int swizzle(int row, int col) {
    return row * COLS + ((((col >> 3) ^ (row & 7)) << 3) | (col & 7));
}

// Shared-memory layouts of a copied tile: element offset of (row, col). Moving down by a
// multiple of ROW_PERIOD rows adds that many ROW_ELEMS to the offset, whatever the column
// (the tile copiers below turn their per-row offsets into immediates with it).
template <int COLS> struct Swizzled {  // the 16-bit operand tiles read by ldmatrix
    static constexpr int ROW_PERIOD = 8, ROW_ELEMS = COLS;
    __device__ __forceinline__ int operator()(int row, int col) const {
        return swizzle<COLS>(row, col);
    }
};
template <int PITCH> struct Pitched {  // plain rows of PITCH elements (attention_mma_wide.cu)
    static constexpr int ROW_PERIOD = 1, ROW_ELEMS = PITCH;
    __device__ __forceinline__ int operator()(int row, int col) const {
        return row * PITCH + col;
    }
};

// Copy ROWS x COLS elements of a strided tensor into a shared tile laid out by `at`; rows >=
// nrows and columns >= ncols become 0. ALIGNED (unit column stride, 16-byte aligned rows,
// ncols a multiple of a chunk, so chunks are all or nothing): 16-byte cp.async chunks, finish
// with cp_async_wait. A thread's chunks sit in one column c, rows r0 + i * ROW_STEP: one
// pointer step, one compare and one cp.async each, the destination the first chunk's
// address plus an immediate when ROW_STEP is a multiple of the layout's row period. A chunk
// outside the tensor reads nothing (source size 0, from the tile's first address) and is
// zero-filled.
// Otherwise synchronous element loads. `tid`: the thread's index among the THREADS copying.
template <int ROWS, int COLS, int THREADS, bool ALIGNED, typename T, typename At>
__device__ __forceinline__ void load_tile(T* dst, const T* src, long long row_stride,
                                          long long col_stride, long long nrows,
                                          long long ncols, At at, unsigned tid = threadIdx.x) {
    constexpr int CHUNK = 16 / sizeof(T), CHUNKS = COLS / CHUNK;
    static_assert(COLS % CHUNK == 0, "whole 16-byte chunks per row");
    if constexpr (ALIGNED && THREADS % CHUNKS != 0) {
        // rows of a chunk count that does not divide the block (head dims 96, 192):
        // the chunks taken in flat order, each thread's column changing from step to step
#pragma unroll 4
        for (int idx = tid; idx < ROWS * CHUNKS; idx += THREADS) {
            const int r = idx / CHUNKS, c = (idx % CHUNKS) * CHUNK;
            const bool ok = r < nrows && c < ncols;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                             smem_addr(dst + at(r, c))),
                         "l"(ok ? src + r * row_stride + c : src), "r"(ok ? 16 : 0));
        }
    } else if constexpr (ALIGNED) {
        constexpr int ROW_STEP = THREADS / CHUNKS;
        constexpr bool AFFINE = ROW_STEP % At::ROW_PERIOD == 0;
        const int r0 = tid / CHUNKS, c = tid % CHUNKS * CHUNK;
        // this thread's chunk i lies inside the tensor iff i * ROW_STEP < lim
        const int lim = c < ncols ? static_cast<int>(nrows < ROWS ? nrows : ROWS) - r0 : 0;
        const long long step = ROW_STEP * row_stride;
        const T* s = src + r0 * row_stride + c;
        const unsigned d0 = smem_addr(dst + at(r0, c));
#pragma unroll
        for (int i = 0; i < (ROWS + ROW_STEP - 1) / ROW_STEP; ++i, s += step) {
            const int r = r0 + i * ROW_STEP;
            if (ROWS % ROW_STEP != 0 && r >= ROWS) break;
            const unsigned d = AFFINE ? d0 + i * ROW_STEP * At::ROW_ELEMS * (int)sizeof(T)
                                      : smem_addr(dst + at(r, c));
            const bool ok = i * ROW_STEP < lim;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d),
                         "l"(ok ? s : src), "r"(ok ? 16 : 0));
        }
    } else {
#pragma unroll 4
        for (int idx = tid; idx < ROWS * CHUNKS; idx += THREADS) {
            const int r = idx / CHUNKS, c = (idx % CHUNKS) * CHUNK;
            T* d = dst + at(r, c);
#pragma unroll
            for (int e = 0; e < CHUNK; ++e) {
                const bool ok = r < nrows && c + e < ncols;
                d[e] = ok ? src[r * row_stride + (c + e) * col_stride] : from_acc<T>(0.f);
            }
        }
    }
}

// The K and V tiles of keys n0 .. n0 + ROWS - 1 of batch entry b (k and v at its first
// key; PAGED: its pools', tile_page and key_rows in common.cuh), one load_tile each, into k_dst and v_dst
// laid out by at_k and at_v: the per-tile request of the kernels that stream key tiles (the
// mma forward, the dQ kernels of the backward; attention_mma_wide.cu still spells it out:
// with this helper its PTX orders one multiply differently, so it moves over once that can
// be rerun on a GPU).
template <int ROWS, int HEAD_DIM, int HEAD_DIM_V, int THREADS, bool ALIGNED, int RAGGED = DENSE,
          typename T, typename AtK, typename AtV>
__device__ __forceinline__ void load_kv_tiles(T* k_dst, T* v_dst, const T* k, const T* v,
                                              long long n0, const AttnParams& p, AtK at_k,
                                              AtV at_v, long long b = 0) {
    const KeyPage kp = tile_page<RAGGED>(p, b, n0);
    load_tile<ROWS, HEAD_DIM, THREADS, ALIGNED>(
        k_dst, key_rows<RAGGED>(k, n0, kp, p.k_s.row, p.k_page), p.k_s.row, p.k_s.col,
        p.seqlen_k - n0, p.head_dim, at_k);
    load_tile<ROWS, HEAD_DIM_V, THREADS, ALIGNED>(
        v_dst, key_rows<RAGGED>(v, n0, kp, p.v_s.row, p.v_page), p.v_s.row, p.v_s.col,
        p.seqlen_k - n0, p.head_dim_v, at_v);
}

// f(offset) for each 16-byte chunk that load_tile<ROWS, COLS, THREADS, ALIGNED> (same
// arguments) assigns to the calling thread, offset = at(row, col) of the chunk's first
// element: the same thread-to-chunk mapping, so a thread can post-process what it copied
// itself once its copies have landed (cp_async_wait), with no barrier.
template <int ROWS, int COLS, int THREADS, bool ALIGNED, typename T, typename At, typename F>
__device__ __forceinline__ void for_own_chunks(At at, F f) {
    constexpr int CHUNK = 16 / sizeof(T), CHUNKS = COLS / CHUNK;
    if constexpr (ALIGNED && THREADS % CHUNKS == 0) {
        constexpr int ROW_STEP = THREADS / CHUNKS;
        constexpr bool AFFINE = ROW_STEP % At::ROW_PERIOD == 0;
        const int r0 = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS * CHUNK;
        const int off0 = at(r0, c);
#pragma unroll
        for (int i = 0; i < (ROWS + ROW_STEP - 1) / ROW_STEP; ++i) {
            const int r = r0 + i * ROW_STEP;
            if (ROWS % ROW_STEP != 0 && r >= ROWS) break;
            f(AFFINE ? off0 + i * ROW_STEP * At::ROW_ELEMS : at(r, c));
        }
    } else {
#pragma unroll 4
        for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS)
            f(at(idx / CHUNKS, (idx % CHUNKS) * CHUNK));
    }
}

// Row pitch of a staged mask or bias tile of COLS elements (layouts.cuh side_pitch_bytes:
// its 16-byte chunks, one more for a misaligned start).
template <typename E, int COLS> constexpr int side_pitch() {
    return side_pitch_bytes((int)sizeof(E), COLS);
}

// A mask or bias tile for the element-wise passes (TileView, common.cuh): queries q0 ..
// q0 + ROWS - 1 (row i at dst + i * PITCH) and keys k0 .. k0 + COLS - 1 of the array whose
// element (q0, k0) is at src (strides in elements), for an array of unit column stride
// whose rows lie 16 bytes apart (SideTiles::staged): cp.async copies each row in 16-byte
// chunks from the aligned chunk that holds its first element, so the tile's elements start
// src % 16 bytes into each row (the same for every row and, since k0 steps by whole
// chunks, every tile). Chunks past the last key (nrows, ncols: what is left of the array
// from (q0, k0)) are zero-filled, rows past the last query not copied (never read). An
// array of row stride 0 (a key-padding mask) gives one row (the view's pitch 0), so that a
// whole grid's copies do not converge on one L2 line. Every byte read shares an aligned
// 16-byte chunk with an element of the array, so no read leaves the array's pages. The
// caller commits the cp.async group and orders the tile before its reads (cp_async_wait,
// barrier). THREADS threads copy, this one as `tid` of them.
template <int ROWS, int COLS, int PITCH, int THREADS, typename E>
__device__ __forceinline__ void stage_side_tile(unsigned char* dst, const E* src,
                                                long long row_stride, long long nrows,
                                                long long ncols, int tid) {
    constexpr int CHUNKS = (COLS * (int)sizeof(E)) / 16 + 1;  // with a misaligned start
    static_assert(PITCH % 16 == 0 && PITCH >= 16 * CHUNKS, "room for the chunks of a row");
    const int shift = (int)(reinterpret_cast<unsigned long long>(src) & 15);
    const char* base = reinterpret_cast<const char*>(src) - shift;
    const int rows = row_stride == 0 ? 1 : (int)(nrows < ROWS ? nrows : ROWS);
    const int bytes = (int)((ncols < COLS ? ncols : COLS) * (long long)sizeof(E)) + shift;
#pragma unroll
    for (int idx = tid; idx < ROWS * CHUNKS; idx += THREADS) {
        const int r = idx / CHUNKS, c = idx % CHUNKS * 16;
        if (r >= rows) break;  // idx grows with r
        const int n = max(0, min(16, bytes - c));
        const unsigned d = smem_addr(dst + r * PITCH + c);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d),
                     "l"(n > 0 ? base + r * row_stride * (long long)sizeof(E) + c : base), "r"(n));
    }
}

// The staged mask and bias of a kernel (the sm90 16-bit forward and backward): STAGES
// stages of ROWS queries x COLS keys at `smem`, the mask's stages first (STAGES x (M_BYTES
// + B_BYTES) bytes; SIDE in cuattn/families/sm90.py per stage), for the block's
// mask and bias (at its batch entry). `staged`: this call's mask and bias are of unit
// column stride with rows 16 bytes apart (or one row for every query), so the passes read
// them from the stages (request, then mask_view / bias_view); other layouts are read where
// they lie (GlobalView), as the families without staging do. KEYS_ARE_ROWS: the passes'
// accumulator rows are keys (the dK/dV kernels; TileView).
template <typename BiasT, bool HAS_MASK, int ROWS, int COLS, int STAGES, int THREADS,
          bool KEYS_ARE_ROWS>
struct SideTiles {
    // (an enum, not static data members, which NVRTC would emit as unused globals)
    enum : int {
        HAS_BIAS = !is_same_v<BiasT, NoBias>,
        BIAS_SIZE = HAS_BIAS ? (int)sizeof(BiasT) : 0,  // the layouts' (layouts.cuh)
        M_PITCH = side_pitch<unsigned char, COLS>(),
        B_PITCH = side_pitch<BiasT, COLS>(),
        M_BYTES = HAS_MASK ? ROWS * M_PITCH : 0,  // a stage's mask tile
        B_BYTES = HAS_BIAS ? ROWS * B_PITCH : 0,  // and bias tile
    };

    unsigned char* smem;
    const unsigned char* mask;
    const BiasT* bias;
    const AttnParams& p;
    bool staged;

    template <typename E> static __device__ bool stages(const Strides& s) {
        return s.col == 1 && s.row * (long long)sizeof(E) % 16 == 0;
    }
    static __device__ bool staged_for(const AttnParams& p) {  // `staged`, of every block
        return (!HAS_MASK || stages<unsigned char>(p.mask_s)) &&
               (!HAS_BIAS || stages<BiasT>(p.bias_s));
    }
    __device__ SideTiles(unsigned char* smem, const unsigned char* mask, const BiasT* bias,
                         const AttnParams& p)
        : smem(smem), mask(mask), bias(bias), p(p), staged(staged_for(p)) {}

    // the tiles of queries q0 .. and keys k0 .. into stage st, when staged (cp.async by
    // THREADS threads, this one as `tid`, the block's threads by default; the caller commits
    // and waits)
    __device__ void request(int st, long long q0, long long k0, int tid) const {
        if (!staged) return;
        if constexpr (HAS_MASK)
            stage_side_tile<ROWS, COLS, M_PITCH, THREADS>(
                smem + st * M_BYTES, mask + q0 * p.mask_s.row + k0, p.mask_s.row,
                p.seqlen_q - q0, p.seqlen_k - k0, tid);
        if constexpr (HAS_BIAS)
            stage_side_tile<ROWS, COLS, B_PITCH, THREADS>(
                smem + STAGES * M_BYTES + st * B_BYTES, bias + q0 * p.bias_s.row + k0,
                p.bias_s.row, p.seqlen_q - q0, p.seqlen_k - k0, tid);
    }
    __device__ void request(int st, long long q0, long long k0) const {
        request(st, q0, k0, (int)threadIdx.x);
    }
    // stage st as requested for (q0, k0): where its elements start (the array's offset in
    // its 16-byte chunk) and the row pitch (0 for one row)
    __device__ TileView<unsigned char, KEYS_ARE_ROWS> mask_view(int st, long long q0,
                                                                long long k0) const {
        return {smem + st * M_BYTES + shift(mask), q0, k0, p.mask_s.row == 0 ? 0 : M_PITCH};
    }
    __device__ TileView<BiasT, KEYS_ARE_ROWS> bias_view(int st, long long q0, long long k0) const {
        return {smem + STAGES * M_BYTES + st * B_BYTES + shift(bias), q0, k0,
                p.bias_s.row == 0 ? 0 : B_PITCH};
    }
    template <typename E> static __device__ int shift(const E* src) {
        return (int)(reinterpret_cast<unsigned long long>(src) & 15);
    }
};

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}
// Every cp.async copy of this thread, committed or not, has landed.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Round to TF32 in place the 16-byte chunks of a ROWS x COLS float tile (laid out by `at`)
// that this thread copied itself (for_own_chunks), once they have landed; with SPLIT, the
// remainders x - tf32(x) go LO floats further on (a lo tile, or lo rows of the same tile).
// Once per tile instead of once per use (attention_sm90_tf32.cu,
// attention_backward_mma_f32.cu).
template <int ROWS, int COLS, int THREADS, bool ALIGNED, bool SPLIT, int LO, typename At>
__device__ __forceinline__ void round_own_tf32(float* tile, At at) {
    for_own_chunks<ROWS, COLS, THREADS, ALIGNED, float>(at, [&](int off) {
        float4* c = reinterpret_cast<float4*>(tile + off);
        const float4 x = *c;
        float4 h, l;
        if constexpr (SPLIT) {
            split_tf32(x, h, l);
            c[LO / 4] = l;
        } else {
            h.x = __uint_as_float(to_tf32(x.x));
            h.y = __uint_as_float(to_tf32(x.y));
            h.z = __uint_as_float(to_tf32(x.z));
            h.w = __uint_as_float(to_tf32(x.w));
        }
        *c = h;
    });
}

// Byte offsets, within a swizzled tile of COLS columns, of the 16-byte chunk that this lane
// hands to ldmatrix for row `row` and column chunks 2*ph + half (ph = 0..3). Chunk 2*kk +
// half lies at offsets[kk % 4] + (kk / 4) * 128: the swizzle only permutes chunks inside
// each group of eight, so every ldmatrix address is a register plus an immediate.
template <int COLS>
struct LaneOffsets {
    unsigned at[4];
    __device__ __forceinline__ LaneOffsets(int row, int half) {
#pragma unroll
        for (int ph = 0; ph < 4; ++ph)
            at[ph] = 2u * static_cast<unsigned>(swizzle<COLS>(row, (2 * ph + half) * 8));
    }
    __device__ __forceinline__ unsigned operator()(int kk) const {
        return at[kk % 4] + (kk / 4) * 128;
    }
};

// S (16*M_TILES x BLOCK_N per warp) = Q K^T: A fragments of Q and B fragments of K by
// ldmatrix; each K fragment serves the warp's M_TILES row tiles
template <int HEAD_DIM, int BLOCK_N, int M_TILES, typename T>
__device__ __forceinline__ void scores(float (&s)[M_TILES][BLOCK_N / 8][4], unsigned q_base,
                                       unsigned k_base, const LaneOffsets<HEAD_DIM>& q_off,
                                       const LaneOffsets<HEAD_DIM>& k_off) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][j][e] = 0.f;
    // groups of four 16-wide steps: unrolled inside a group, rolled across groups, so that
    // ptxas does not hoist the fragments of the whole head dim into registers
#pragma unroll 1
    for (int k4 = 0; k4 < HEAD_DIM / 64; ++k4)
#pragma unroll
    for (int ph = 0; ph < 4; ++ph) {
        unsigned a[M_TILES][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
            ldmatrix_x4(a[mt], q_base + q_off.at[ph] + k4 * 128 + mt * 16 * HEAD_DIM * 2);
#pragma unroll
        for (int jj = 0; jj < BLOCK_N / 16; ++jj) {
            unsigned b[4];  // two 8-key tiles: (b0, b1) of keys 16jj.., then of 16jj+8..
            ldmatrix_x4(b, k_base + k_off.at[ph] + k4 * 128 + jj * 16 * HEAD_DIM * 2);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                mma_16816<T>(s[mt][2 * jj], a[mt], b[0], b[1]);
                mma_16816<T>(s[mt][2 * jj + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// O += P Z for COLS columns of Z: P from the score registers (accumulator layout == A-operand
// layout), Z (BLOCK_N rows, row pitch PITCH) by ldmatrix.trans from z_base, which may point
// at a column that is a multiple of 64 (the swizzle keeps 64-column groups in place); each Z
// fragment serves the warp's M_TILES row tiles
template <int BLOCK_N, int PITCH, int COLS, int M_TILES, typename T>
__device__ __forceinline__ void accumulate_cols(float (&acc)[M_TILES][COLS / 8][4],
                                                const float (&s)[M_TILES][BLOCK_N / 8][4],
                                                unsigned z_base, const LaneOffsets<PITCH>& z_off) {
    static_assert(COLS <= PITCH && COLS % 16 == 0, "COLS columns of a PITCH-wide tile");
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        unsigned a[M_TILES][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            a[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
            a[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
            a[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
            a[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dd = 0; dd < COLS / 16; ++dd) {
            unsigned b[4];  // (b0, b1) of columns 16dd.., then of 16dd+8..
            ldmatrix_x4_trans(b, z_base + z_off(dd) + kk * 16 * PITCH * 2);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                mma_16816<T>(acc[mt][2 * dd], a[mt], b[0], b[1]);
                mma_16816<T>(acc[mt][2 * dd + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// O += P V over all HEAD_DIM_V columns of V
template <int BLOCK_N, int HEAD_DIM_V, int M_TILES, typename T>
__device__ __forceinline__ void accumulate_pv(float (&acc)[M_TILES][HEAD_DIM_V / 8][4],
                                              const float (&s)[M_TILES][BLOCK_N / 8][4],
                                              unsigned v_base,
                                              const LaneOffsets<HEAD_DIM_V>& v_off) {
    accumulate_cols<BLOCK_N, HEAD_DIM_V, HEAD_DIM_V, M_TILES, T>(acc, s, v_base, v_off);
}

// accumulators cleared
template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
    for (int d = 0; d < N; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[d][e] = 0.f;
}

}  // namespace mma
}  // namespace cuattn
