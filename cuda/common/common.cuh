// common.cuh -- shared device code for every cuattn kernel.
//
// What lives here: the numeric traits (storage type T -> accumulator type), conversions
// between storage and accumulator, the parameter block of the attention kernels
// (AttnParams, which cuattn/_params.py reads from this file), and the
// online-softmax row-state helpers: m (running row max, in
// log2 units), l (running row sum), acc (unnormalised output), alpha = exp2(m_old - m_new);
// the grid order (block_coords), the band's reach in tiles and the interior-tile test.
//
// This header is inlined into each .cu file by cuattn/_kernels.py before compilation, so
// CuPy's cache key (a hash of the source text) changes whenever this file changes.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// the kernels' shared-memory layouts, generated from cuattn/families
#include "common/layouts.cuh"

namespace cuattn {

// ---- numeric traits ---------------------------------------------------------------
// Store in T, accumulate in Acc<T>: float for 16-bit and float32 inputs, double for double.
template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };
template <typename T> using Acc = typename AccOf<T>::type;

__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(unsigned char x) { return x; }

template <typename T> __device__ __forceinline__ T from_acc(Acc<T> x) { return x; }
template <> __device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float fast_exp2(float x) { return exp2f(x); }
// exp2 for double on the attention domain x <= 1023 (softmax arguments are <= 0 up to
// rounding): 2^x = 2^n 2^r with n = rint(x), |r| <= 1/2, and 2^r from its degree-13 Taylor
// polynomial (under 1 ulp), with no branches. x < -1022 gives 0 (the true value is below
// 2^-1022, nothing next to a row maximum of 1); NaN stays NaN; -inf gives 0. CUDA's
// exp2(double) also serves large |x| through a slow path whose branches every softmax
// element would pay for.
__device__ __forceinline__ double fast_exp2(double x) {
    constexpr double ROUND = 0x1.8p52;  // x + ROUND rounds x (|x| < 2^51) to an integer
    const double t = x + ROUND;
    const double r = x - (t - ROUND);
    const int n = __double2loint(t);  // the integer, in the low word of t
    double p = 0x1.816193166d0f9p-40;  // (ln 2)^k / k!, k = 13 .. 0
    p = fma(p, r, 0x1.c3bd650fc2986p-36);
    p = fma(p, r, 0x1.e8cac7351bb25p-32);
    p = fma(p, r, 0x1.e4cf5158b8ecap-28);
    p = fma(p, r, 0x1.b5253d395e7c4p-24);
    p = fma(p, r, 0x1.62c0223a5c824p-20);
    p = fma(p, r, 0x1.ffcbfc588b0c7p-17);
    p = fma(p, r, 0x1.430912f86c787p-13);
    p = fma(p, r, 0x1.5d87fe78a6731p-10);
    p = fma(p, r, 0x1.3b2ab6fba4e77p-7);
    p = fma(p, r, 0x1.c6b08d704a0c0p-5);
    p = fma(p, r, 0x1.ebfbdff82c58fp-3);
    p = fma(p, r, 0x1.62e42fefa39efp-1);
    p = fma(p, r, 1.0);
    const double two_n = __hiloint2double((n + 1023) << 20, 0);
    return x < -1022.0 ? 0.0 : p * two_n;
}
// exp2 for double in the tensor-core softmax (mma_softmax.cuh::SoftmaxExp2): 2^x =
// 2^n 2^(j/32) 2^r with 32 n + j = rint(32 x), |r| <= 1/64. The 32 fractions 2^(j/32)
// (correctly rounded) live one per lane of the warp, so the lookup is a shuffle; 2^r - 1 is
// its degree-6 Taylor polynomial (truncation below 4e-18) and 2^(j/32) 2^r one fma, so the
// result is within about 1 ulp. 11 FP64 instructions where fast_exp2(double) takes 19, and
// the coefficients come from the constant bank (64-bit immediates cost two uniform moves
// each per use). Same domain and special values as fast_exp2(double): x < -1020 gives 0.
__constant__ double EXP2_FRACTIONS[32] = {
    0x1.0000000000000p+0, 0x1.059b0d3158574p+0, 0x1.0b5586cf9890fp+0, 0x1.11301d0125b51p+0,
    0x1.172b83c7d517bp+0, 0x1.1d4873168b9aap+0, 0x1.2387a6e756238p+0, 0x1.29e9df51fdee1p+0,
    0x1.306fe0a31b715p+0, 0x1.371a7373aa9cbp+0, 0x1.3dea64c123422p+0, 0x1.44e086061892dp+0,
    0x1.4bfdad5362a27p+0, 0x1.5342b569d4f82p+0, 0x1.5ab07dd485429p+0, 0x1.6247eb03a5585p+0,
    0x1.6a09e667f3bcdp+0, 0x1.71f75e8ec5f74p+0, 0x1.7a11473eb0187p+0, 0x1.82589994cce13p+0,
    0x1.8ace5422aa0dbp+0, 0x1.93737b0cdc5e5p+0, 0x1.9c49182a3f090p+0, 0x1.a5503b23e255dp+0,
    0x1.ae89f995ad3adp+0, 0x1.b7f76f2fb5e47p+0, 0x1.c199bdd85529cp+0, 0x1.cb720dcef9069p+0,
    0x1.d5818dcfba487p+0, 0x1.dfc97337b9b5fp+0, 0x1.ea4afa2a490dap+0, 0x1.f50765b6e4540p+0};
__constant__ double EXP2_TAYLOR[6] = {  // (ln 2)^k / k!, k = 1 .. 6
    0x1.62e42fefa39efp-1, 0x1.ebfbdff82c58fp-3, 0x1.c6b08d704a0c0p-5,
    0x1.3b2ab6fba4e77p-7, 0x1.5d87fe78a6731p-10, 0x1.430912f86c787p-13};
// lane_fraction: this lane's EXP2_FRACTIONS[lane]; every lane of the warp must call.
__device__ __forceinline__ double exp2_lanes(double x, double lane_fraction) {
    constexpr double ROUND = 0x1.8p47;  // x + ROUND rounds x (|x| < 2^46) to a multiple of 1/32
    const double t = x + ROUND;
    const double r = x - (t - ROUND);
    const int k = __double2loint(t);  // rint(32 x), in the low word of t
    const double f = __shfl_sync(0xffffffffu, lane_fraction, k & 31);
    // 2^n 2^(j/32) by the exponent field: normal for every x >= -1020 kept below
    const double scaled = __hiloint2double(
        __double2hiint(f) + static_cast<int>(static_cast<unsigned>(k >> 5) << 20),
        __double2loint(f));
    double q = EXP2_TAYLOR[5];
    q = fma(q, r, EXP2_TAYLOR[4]);
    q = fma(q, r, EXP2_TAYLOR[3]);
    q = fma(q, r, EXP2_TAYLOR[2]);
    q = fma(q, r, EXP2_TAYLOR[1]);
    q = fma(q, r, EXP2_TAYLOR[0]);
    q *= r;  // 2^r - 1
    const double y = fma(scaled, q, scaled);
    return x < -1020.0 ? 0.0 : y;  // -inf too; NaN stays NaN (through r)
}
__device__ __forceinline__ float tanh_acc(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_acc(double x) { return tanh(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }
// fmax ignores a NaN operand, so a NaN score never becomes a row's max; it still reaches
// l and acc through exp2 and poisons only its own row, as in the reference.
__device__ __forceinline__ float max_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_acc(double a, double b) { return fmax(a, b); }

template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double neg_inf<double>() {
    return -__longlong_as_double(0x7ff0000000000000LL);
}

constexpr double LOG2E = 1.4426950408889634;
constexpr double LN2 = 0.6931471805599453;

// Marks "no bias" in the BiasT template parameter of the attention kernels.
struct NoBias {};
template <typename X, typename Y> constexpr bool is_same_v = false;
template <typename X> constexpr bool is_same_v<X, X> = true;
template <bool B> struct Bool { static constexpr bool value = B; };  // a flag as a type
__device__ __forceinline__ float to_acc(NoBias) { return 0.f; }

// ---- where the element-wise passes read a mask or a bias -----------------------------
// mask_scores (mma_softmax.cuh) and p_and_ds_tile (backward.cuh) read element (r, c) of a
// mask or bias, r a row and c a column of the accumulator tile (rows are queries, or keys
// in the dK/dV kernels), through a view: at(r, c) points at the element, at(r, c) + step(x)
// at (r, c + x).
// GlobalView: the array itself in global memory, strides along the accumulator's rows and
// columns (its own row and column strides, swapped where rows are keys).
// safe(): every (r, c) of the tile may be read, allowed or not (a staged tile), so the passes
// load unconditionally and select, instead of branching around each load.
template <typename E> struct GlobalView {
    static constexpr bool safe() { return false; }
    const E* ptr;
    long long row, col;
    __device__ const E* at(long long r, long long c) const { return ptr + r * row + c * col; }
    __device__ long long step(int x) const { return x * col; }
};
// TileView: a tile staged in shared memory by stage_side_tile (mma_tiles.cuh): query q0 + i
// in row i, `pitch` bytes apart (0: one row serves every query, for an array whose row
// stride is 0), key k0 + j at byte j * sizeof(E) past `tile` (the stage plus the tile's
// shift). KEYS_ARE_ROWS: the accumulator's rows are keys and its columns queries.
template <typename E, bool KEYS_ARE_ROWS> struct TileView {
    static constexpr bool safe() { return true; }
    const unsigned char* tile;
    long long q0, k0;
    int pitch;  // a multiple of sizeof(E)
    __device__ const E* at(long long r, long long c) const {
        const long long q = KEYS_ARE_ROWS ? c : r, k = KEYS_ARE_ROWS ? r : c;
        return reinterpret_cast<const E*>(tile + (q - q0) * pitch) + (k - k0);
    }
    __device__ int step(int x) const { return KEYS_ARE_ROWS ? x * (pitch / (int)sizeof(E)) : x; }
};

// ---- attention parameter block ------------------------------------------------------
// Passed by value. cuattn/_params.py reads this struct's fields into a NumPy structured dtype;
// every field is 8 bytes, so no padding rule can differ. Pointers are device addresses
// (0 = argument absent). Strides are in elements, per axis: three collapsed batch axes,
// then the row axis, then the column axis; a broadcast axis has stride 0.
struct Strides {
    long long b0, b1, b2, row, col;
};

struct AttnParams {
    long long q, k, v, out, lse, mask, bias, k_lengths, pages;  // device addresses
    long long batch1, batch2;                 // extents of batch axes 1 and 2 (axis 0 is implied)
    long long seqlen_q, seqlen_k, head_dim, head_dim_v;
    long long window_left, window_right;      // -1: unbounded; causal is window_right = 0
    long long num_m_blocks, num_dv_tiles;     // grid decomposition, computed in Python
    double scale;                             // softmax scale (natural units)
    double softcap;                           // 0: no softcap
    Strides q_s, k_s, v_s, out_s, lse_s, mask_s, bias_s, k_lengths_s, pages_s;
    // the sm90_3xf16 kernels' float[batch][5] of largest magnitudes (split16.cuh; zero for
    // the others), written per call
    long long magnitudes;
    // a packed call's row blocks (PackedBlock, below): device address and count; 0 for a dense call
    long long packed, num_packed;
    // key lengths (KEY_LENGTHS and PAGED, below): bytes per length (4 or 8), and the first key of this
    // call's chunk of the keys: k_lengths_from + (index along batch axis 2) x k_lengths_step
    long long k_lengths_size, k_lengths_from, k_lengths_step;
    // paged keys and values (PAGED, below): rows per page, pages in the pools, and the
    // elements from one page to the next in the pools of k and of v
    long long page_size, num_pages, k_page, v_page;
};

// The backward's parameter block: the forward's (q, k, v, out, lse, mask, bias, sizes and
// their strides) plus the arrays only the backward reads or writes. The grids of the two
// backward kernels are num_row_blocks (key blocks for dK/dV, query blocks for dQ) x
// num_col_tiles (output-column tiles) x batch; f.num_m_blocks and f.num_dv_tiles are unused.
// cuattn/_params.py reads it from this file.
struct AttnBwdParams {
    AttnParams f;
    long long dout, delta, dq, dk, dv;        // device addresses; delta: acc type, (batch, Sq)
    long long num_row_blocks, num_col_tiles;  // grid decomposition, computed in Python
    Strides dout_s, delta_s, dq_s, dk_s, dv_s;
};

// Offset of element (b, row, col) of a tensor described by strides s, where b is the
// flattened batch index decomposed with the extents batch1, batch2.
__device__ __forceinline__ long long batch_offset(const Strides& s, long long b,
                                                  long long batch1, long long batch2) {
    const long long b2 = b % batch2;
    const long long b01 = b / batch2;
    return (b01 / batch1) * s.b0 + (b01 % batch1) * s.b1 + b2 * s.b2;
}

// Which (row block, column tile, batch entry) work unit idx computes, of `units` =
// num_row_blocks x num_col_tiles x batch (block_coords: this thread block's, one unit per block
// of the grid; a persistent block takes several). rank 0 is the costliest row block under a
// causal band: heavy_last says it is the last one (query blocks, bottom-right aligned) rather
// than the first (key blocks). Without a band every block costs the same and the row blocks of
// one batch entry run side by side, sharing K and V in L2. With a band (banded: causal or
// window) the entries are taken in groups of BAND_GROUP_BLOCKS blocks (at least one entry), and
// within a group the row blocks are dealt by cost across its entries, costliest first: the last
// wave holds only cheap blocks instead of a late heavy one, and the blocks in flight read the K
// and V of one or two groups, not of every entry (L2).
constexpr long long BAND_GROUP_BLOCKS = 1024;
struct BlockCoords {
    long long row_block, col_tile, b;
};
__device__ __forceinline__ BlockCoords block_coords_at(unsigned idx, unsigned units,
                                                       long long num_row_blocks,
                                                       long long num_col_tiles, bool banded,
                                                       bool heavy_last) {
    // 32-bit: a grid has fewer than 2^31 blocks (and 64-bit divisions cost registers)
    const unsigned rows = (unsigned)num_row_blocks;
    unsigned rank, rest;
    if (banded) {
        const unsigned entries = units / rows;  // column tiles x batch
        const unsigned group = max(1u, (unsigned)BAND_GROUP_BLOCKS / rows);
        const unsigned first = idx / (group * rows) * group;  // of idx's group
        const unsigned in_group = min(group, entries - first);
        const unsigned j = idx - first * rows;
        rank = j / in_group;
        rest = first + j % in_group;
    } else {
        rank = idx % rows;
        rest = idx / rows;
    }
    const unsigned cols = (unsigned)num_col_tiles;
    return {heavy_last ? num_row_blocks - 1 - rank : (long long)rank, (long long)(rest % cols),
            (long long)(rest / cols)};
}
__device__ __forceinline__ BlockCoords block_coords(long long num_row_blocks,
                                                    long long num_col_tiles, bool banded,
                                                    bool heavy_last) {
    return block_coords_at(blockIdx.x, gridDim.x, num_row_blocks, num_col_tiles, banded,
                           heavy_last);
}

// A tensor-core forward block's work and its batch entry's arrays: the row block (heaviest
// query blocks first, block_coords; one Dv tile), its first row m0, and q (at row m0), k,
// v, mask and bias (null when absent) of batch entry b.
template <typename T, typename BiasT>
struct ForwardBlock {
    long long b, m0;
    const T *q, *k, *v;
    const unsigned char* mask;
    const BiasT* bias;
};
// forward_block_for: the same for row block `row_block` of batch entry b.
template <typename T, typename BiasT>
__device__ __forceinline__ ForwardBlock<T, BiasT> forward_block_for(const AttnParams& p,
                                                                   int block_m,
                                                                   long long row_block,
                                                                   long long b) {
    const long long m0 = row_block * block_m;
    return {b,
            m0,
            reinterpret_cast<const T*>(p.q) + batch_offset(p.q_s, b, p.batch1, p.batch2) +
                m0 * p.q_s.row,
            reinterpret_cast<const T*>(p.k) + batch_offset(p.k_s, b, p.batch1, p.batch2),
            reinterpret_cast<const T*>(p.v) + batch_offset(p.v_s, b, p.batch1, p.batch2),
            p.mask ? reinterpret_cast<const unsigned char*>(p.mask) +
                         batch_offset(p.mask_s, b, p.batch1, p.batch2) : nullptr,
            p.bias ? reinterpret_cast<const BiasT*>(p.bias) +
                         batch_offset(p.bias_s, b, p.batch1, p.batch2) : nullptr};
}
// forward_block_at: the same for work unit idx of `units` (block_coords_at).
template <typename T, typename BiasT>
__device__ __forceinline__ ForwardBlock<T, BiasT> forward_block_at(const AttnParams& p,
                                                                  int block_m, unsigned idx,
                                                                  unsigned units) {
    const BlockCoords blk = block_coords_at(idx, units, p.num_m_blocks, 1,
                                            p.window_left >= 0 || p.window_right >= 0, true);
    return forward_block_for<T, BiasT>(p, block_m, blk.row_block, blk.b);
}
template <typename T, typename BiasT>
__device__ __forceinline__ ForwardBlock<T, BiasT> forward_block(const AttnParams& p,
                                                               int block_m) {
    return forward_block_at<T, BiasT>(p, block_m, blockIdx.x, gridDim.x);
}

// ---- packed sequences and key lengths -------------------------------------------------
// A forward instance's RAGGED mode: a dense call; a packed call (q_offsets, k_offsets), one
// grid over the work units of every sequence; key lengths (k_lengths), a dense grid whose
// batch entries each have their own key count; or key lengths over paged keys and values
// (block_table; key_rows, below).
enum Ragged : int { DENSE = 0, PACKED = 1, KEY_LENGTHS = 2, PAGED = 3 };
// PACKED: p.packed holds, in device memory, a PackedBlock for each of the p.num_packed row
// blocks of the kernel (query blocks, or the backward's key blocks) over every sequence, in
// the order the grid takes them (Python deals them by cost, costliest first); work unit u
// is row block u % num_packed of index u / num_packed among the row block's units (its
// output-column tiles x batch entries). p.seqlen_q and p.seqlen_k are the packed totals
// (the tensor maps' rows).
struct PackedBlock {
    int q_row0, k_row0, seqlen_q, seqlen_k;  // the sequence's first rows and lengths
    int row_block, pad0, pad1, pad2;         // the block within it
};
// A block's work unit as a dense call of its own: p with the unit's lengths (PACKED: its
// sequence's, and its first rows of q, k, v, out and lse; KEY_LENGTHS and PAGED: its batch
// entry's key count) and the unit: DENSE, KEY_LENGTHS and PAGED: its index among `units`
// (block_coords_at);
// PACKED: its row block and its index among that row block's units (`rest`), and the
// sequence's first rows (for the tensor maps, which span the packed totals). T: the type
// of q, k, v and out; AccT: of the lse.
struct SequenceUnit {
    AttnParams p;
    unsigned unit, units;
    long long row_block, rest;
    int q_row0, k_row0;
};
template <int RAGGED, typename T, typename AccT>
__device__ __forceinline__ SequenceUnit sequence_unit(const AttnParams& p, unsigned unit,
                                                      unsigned units) {
    if constexpr (RAGGED == KEY_LENGTHS || RAGGED == PAGED) {
        // batch entry b's keys: k_lengths[b] (int32 or int64, by k_lengths_size) less the
        // first key of this call's chunk of them, k_lengths_from + (b's index along batch
        // axis 2) x k_lengths_step (a split call's chunks, cuattn/_split.py), within 0 .. Sk
        const long long b = block_coords_at(unit, units, p.num_m_blocks, 1,
                                            p.window_left >= 0 || p.window_right >= 0, true).b;
        const long long at = batch_offset(p.k_lengths_s, b, p.batch1, p.batch2);
        const long long n = (p.k_lengths_size == 8
                                 ? reinterpret_cast<const long long*>(p.k_lengths)[at]
                                 : (long long)reinterpret_cast<const int*>(p.k_lengths)[at]) -
                            p.k_lengths_from - (b % p.batch2) * p.k_lengths_step;
        SequenceUnit r{p, unit, units, 0, 0, 0, 0};
        r.p.seqlen_k = min(max(n, 0LL), p.seqlen_k);
        return r;
    } else if constexpr (RAGGED == PACKED) {
        const unsigned n = (unsigned)p.num_packed;
        const int4* at = reinterpret_cast<const int4*>(p.packed) + 2 * (unit % n);
        const int4 s = at[0], blk = at[1];  // PackedBlock: two independent loads
        SequenceUnit r{p, unit, units, blk.x, unit / n, s.x, s.y};
        r.p.seqlen_q = s.z;
        r.p.seqlen_k = s.w;
        r.p.q += (long long)sizeof(T) * s.x * p.q_s.row;
        r.p.k += (long long)sizeof(T) * s.y * p.k_s.row;
        r.p.v += (long long)sizeof(T) * s.y * p.v_s.row;
        r.p.out += (long long)sizeof(T) * s.x * p.out_s.row;
        if (p.lse) r.p.lse += (long long)sizeof(AccT) * s.x * p.lse_s.row;
        return r;
    } else {
        return {p, unit, units, 0, 0, 0, 0};
    }
}

// PAGED: key lengths (KEY_LENGTHS) whose keys and values live in the pages of two pools
// (block_table). k and v then hold the pools' first element plus batch entry b's offset
// along the pools' other axes, k_s.row and v_s.row are the rows' strides within a page, and
// p.pages (int32) lists b's pages in order (batch strides pages_s, pages_s.col between
// columns): key j of the whole sequence is row j % page_size of page pages[b][j / page_size],
// where j counts from the first key of this call's chunk (k_lengths_from + (b's index along
// batch axis 2) x k_lengths_step, as for the lengths). A key tile lies inside one page:
// Python runs only page sizes that are a multiple of every key tile and chunks that start
// on a page.
// key_page: the page and the row in it of key n0 of batch entry b (PAGED).
struct KeyPage {
    int page, row;
};
__device__ __forceinline__ KeyPage key_page(const AttnParams& p, long long b, long long n0) {
    // 32-bit: key positions fit (checked in Python), and 64-bit divisions cost registers
    const unsigned j = (unsigned)(p.k_lengths_from + (b % p.batch2) * p.k_lengths_step + n0);
    const unsigned size = (unsigned)p.page_size;
    const int* row = reinterpret_cast<const int*>(p.pages) +
                     batch_offset(p.pages_s, b, p.batch1, p.batch2);
    // a page number outside the pools (a device table's, unchecked) reads the nearest page:
    // never out of bounds
    return {min(max(row[(long long)(j / size) * p.pages_s.col], 0), (int)p.num_pages - 1),
            (int)(j % size)};
}
// tile_page: key_page under PAGED (one table read per key tile, for its K and V alike),
// nothing for the other modes. key_rows: the first row of the tile of keys n0 .. in x (k
// or v, with row_stride and page_stride its pool's) at that page; n0 * row_stride past x
// for the other modes.
template <int RAGGED>
__device__ __forceinline__ KeyPage tile_page(const AttnParams& p, long long b, long long n0) {
    if constexpr (RAGGED == PAGED) return key_page(p, b, n0);
    else return {0, 0};
}
template <int RAGGED, typename T>
__device__ __forceinline__ const T* key_rows(const T* x, long long n0, KeyPage kp,
                                            long long row_stride, long long page_stride) {
    if constexpr (RAGGED == PAGED) return x + kp.page * page_stride + (long long)kp.row * row_stride;
    else return x + n0 * row_stride;
}

// A forward block's work: forward_block_at (DENSE, KEY_LENGTHS, PAGED), or the row block and
// batch entry a packed block names (PACKED).
template <int RAGGED, typename T, typename BiasT>
__device__ __forceinline__ ForwardBlock<T, BiasT> forward_block_of(const AttnParams& p,
                                                                   const SequenceUnit& su,
                                                                   int block_m) {
    if constexpr (RAGGED == PACKED)
        return forward_block_for<T, BiasT>(p, block_m, su.row_block, su.rest);
    else
        return forward_block_at<T, BiasT>(p, block_m, su.unit, su.units);
}

// The backward's work unit of a packed call (PACKED): bp with its sequence's lengths and
// first rows of every array read or written, and its coordinates (row block, column tile,
// batch entry). KEYS: the dK/dV kernels' units (key blocks), else the dQ kernels' (query
// blocks). T: the type of q, k, v and dout; G: of the gradients this kernel writes (dK and
// dV, or dQ). DENSE: bp, and the coordinates of block_coords_at (heavy_last as there).
struct BackwardUnit {
    AttnBwdParams bp;
    BlockCoords blk;
};
template <int RAGGED, bool KEYS, typename T, typename G>
__device__ __forceinline__ BackwardUnit backward_unit(const AttnBwdParams& bp, bool heavy_last) {
    if constexpr (RAGGED != PACKED) {
        return {bp, block_coords_at(blockIdx.x, gridDim.x, bp.num_row_blocks, bp.num_col_tiles,
                                    bp.f.window_left >= 0 || bp.f.window_right >= 0,
                                    heavy_last)};
    } else {
        const SequenceUnit su = sequence_unit<PACKED, T, float>(bp.f, blockIdx.x, gridDim.x);
        const long long cols = bp.num_col_tiles;
        BackwardUnit r{bp, {su.row_block, su.rest % cols, su.rest / cols}};
        r.bp.f = su.p;
        r.bp.dout += (long long)sizeof(T) * su.q_row0 * bp.dout_s.row;
        r.bp.delta += (long long)sizeof(float) * su.q_row0 * bp.delta_s.row;
        if constexpr (KEYS) {
            r.bp.dk += (long long)sizeof(G) * su.k_row0 * bp.dk_s.row;
            r.bp.dv += (long long)sizeof(G) * su.k_row0 * bp.dv_s.row;
        } else {
            r.bp.dq += (long long)sizeof(G) * su.q_row0 * bp.dq_s.row;
        }
        return r;
    }
}

// The reach of the causal/window band in whole tiles. key_band: the keys [lo, hi) that query
// rows first .. last reach (lo rounded down to a multiple of tile, so key tiles start on tile
// boundaries); query_band: its transpose, the query rows [lo, hi) that reach keys
// first .. last. Tiles outside are skipped; in_window below decides element by element.
struct Range {
    long long lo, hi;
};
__device__ __forceinline__ Range key_band(const AttnParams& p, long long first, long long last,
                                          int tile) {
    const long long off = p.seqlen_k - p.seqlen_q;
    long long lo = 0, hi = p.seqlen_k;
    if (p.window_left >= 0) lo = max(0LL, first + off - p.window_left);
    if (p.window_right >= 0) hi = min(hi, last + off + p.window_right + 1);
    return {lo / tile * tile, hi};
}
__device__ __forceinline__ Range query_band(const AttnParams& p, long long first,
                                            long long last, int tile) {
    const long long off = p.seqlen_k - p.seqlen_q;
    long long lo = 0, hi = p.seqlen_q;
    if (p.window_right >= 0) lo = max(0LL, first - off - p.window_right);
    if (p.window_left >= 0) hi = min(hi, last - off + p.window_left + 1);
    return {lo / tile * tile, hi};
}

// Is key column j allowed for query row i under causal/window? off = seqlen_k - seqlen_q
// aligns the band to the bottom-right corner (as cuattn/reference.py does).
__device__ __forceinline__ bool in_window(long long i, long long j, long long off,
                                          long long left, long long right) {
    const long long center = i + off;
    return (left < 0 || j >= center - left) && (right < 0 || j <= center + right);
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

}  // namespace cuattn
