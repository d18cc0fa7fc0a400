// sm90_tiles.cuh -- the warpgroup-MMA (wgmma, sm_90a) tile machinery shared by the Hopper
// kernels (attention_sm90.cu, attention_sm90_tf32.cu and attention_sm90_3xf16.cu, the
// forwards; attention_backward_sm90.cu and attention_backward_sm90_3xf16.cu, the backwards).
//
// Operand tiles are 16-bit (T = __half or __nv_bfloat16) or float (read as TF32) in shared
// memory, in the canonical 128-byte-swizzle layout of wgmma: column groups of 128 bytes (64
// 16-bit or 32 float columns) stored one after another, each group's rows 128 bytes apart
// with 16-byte chunk c of row r at chunk c ^ (r % 8); tiles start 1024-byte aligned. A
// warpgroup's accumulators (64 x N, float) have the m16n8 layout of mma.sync in each of its
// four warps (wgmma.cuh), so the tensor-core softmax and the backward's element-wise rule
// run on them unchanged.
//   product_ss  acc = A B^T, A (64 rows) and B (N rows) K-contiguous in shared memory
//   stacked_product_ss  the split score product from a stacked [B_hi; B_lo] (split16.cuh)
//   product_rs  acc += X Z, X from float registers (rounded to T), Z read N-contiguous
//   pack_a, product_ra  the same in two steps: X's A fragments made once, then the product
//   request_query_tile  a dK/dV kernel's query-tile stage (the backwards;
//               request_query_operands and QueryRowStats: the same in two parts, lse and
//               delta a tile ahead through registers)
//   transpose_v  a staged float tile transposed (V^T) and rounded to TF32 for the TF32
//               register-A product
//   product_rs_tf32  acc (+)= A B^T for TF32: A fragments in registers (tf32_fragments
//               makes them from accumulators, contraction permuted), B K-contiguous
#pragma once

#include "common/mma_tiles.cuh"
#include "sm90/wgmma.cuh"

namespace cuattn {
namespace sm90 {

// Element offset of (row, col) in a ROWS-row tile of ELEM-byte elements in the
// 128-byte-swizzle layout: W = 128 / ELEM columns per group, C = 16 / ELEM per chunk.
template <int ROWS, int ELEM = 2> struct Sw128 {
    static_assert(ELEM == 2 || ELEM == 4, "16-bit or 32-bit elements");
    static constexpr int LOG_W = ELEM == 2 ? 6 : 5, LOG_C = LOG_W - 3, W = 1 << LOG_W;
    static constexpr int ROW_PERIOD = 8, ROW_ELEMS = W;  // as the layouts of mma_tiles.cuh
    __device__ __forceinline__ int operator()(int row, int col) const {
        return (col >> LOG_W) * ROWS * W + row * W +
               ((((col >> LOG_C) & 7) ^ (row & 7)) << LOG_C) + (col & ((1 << LOG_C) - 1));
    }
};

// Matrix descriptor of a 128-byte-swizzled operand at shared address `addr`: leading byte
// offset `lbo` (between 64-column groups of an N-contiguous operand; unused when K is
// contiguous), stride byte offset 1024 (between groups of eight 128-byte rows).
__device__ __forceinline__ unsigned long long sw128_desc(unsigned addr, unsigned lbo) {
    return static_cast<unsigned long long>((addr & 0x3FFFF) >> 4) |
           (static_cast<unsigned long long>(lbo >> 4) << 16) |
           (static_cast<unsigned long long>(1024 >> 4) << 32) | (1ull << 62);
}

// Generic-proxy writes (cp.async, plain stores) to shared memory become visible to the
// tensor cores' async proxy after this fence (then a barrier orders them for other threads).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Transaction barriers (mbarrier) and bulk copies, for kernels whose tiles arrive by the
// copy engine while the warpgroups compute (attention_fwd_sm90_tf32_piped). A barrier is a
// 64-bit word in shared memory; it completes a phase when its expected arrivals (and, after
// mbar_expect_tx, the expected bytes of the bulk copies that name it) are in, and waiters
// name the phase they wait for by its parity (0, 1, 0, ...).
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
// Makes initialised barriers visible to the copy engine (then a block barrier to the threads).
__device__ __forceinline__ void fence_mbar_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// The barriers of SLOTS tile slots, 8 bytes apart from `full` and from `empty`: `full`
// completes with `fills` arrivals (the producer's, the first with the copies' bytes),
// `empty` with one arrival per consumer warp (each releasing the slot once its products
// are done).
template <int SLOTS>
__device__ __forceinline__ void init_slot_barriers(unsigned full, unsigned empty,
                                                   unsigned consumer_warps, unsigned fills = 1) {
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
        mbar_init(full + 8 * s, fills);
        mbar_init(empty + 8 * s, consumer_warps);
    }
}
// One arrival that also announces `bytes` of bulk copies completing on this phase.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
// One arrival on `bar` once this thread's earlier cp.async copies have landed (one of the
// arrivals the barrier counts).
__device__ __forceinline__ void cp_async_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// `count` arrivals at once (on behalf of threads that have nothing to add to this phase).
__device__ __forceinline__ void mbar_arrive_count(unsigned bar, unsigned count) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(count)
                 : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global `src` to shared
// `dst` by the copy engine, counted on barrier `bar` when they have landed.
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes,
                                          unsigned bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}
// Register budgets of warp-specialised blocks: every warp of a warpgroup gives up (dec) or
// takes (inc) registers to REGS per thread, within the block's allocation at launch.
template <int REGS> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
// Named barriers 1 .. 15 among `threads` threads (a multiple of 32): bar_sync waits for
// them, bar_arrive counts this warp's threads without waiting. The non-.aligned forms:
// warpgroups of different roles reach one barrier from different code, which the .aligned
// bar.sync leaves undefined (compute-sanitizer synccheck reports it and stops the kernel).
__device__ __forceinline__ void bar_sync(int id, int threads) {
    asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
    asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// acc (64 x N per warpgroup) (+)= A B^T over CONTRACT columns, A (64 rows) and B (N rows;
// the first N of a B_ROWS-row tile) both K-contiguous tiles in shared memory: 32 bytes of
// columns per step (16 of 16-bit T, 8 of TF32) inside a 128-byte column group; groups
// 64 * 128 bytes (A) and B_ROWS * 128 bytes (B) apart. Without `accumulate` the first step
// overwrites acc. Issues only: the caller fences before and commits and waits after.
template <int N, int CONTRACT, typename T, int B_ROWS = N>
__device__ __forceinline__ void product_ss(float (&acc)[N / 8][4], unsigned a_tile,
                                           unsigned b_tile, bool accumulate = false) {
#pragma unroll
    for (int kk = 0; kk < CONTRACT * (int)sizeof(T) / 32; ++kk) {
        const unsigned col = (kk % 4) * 32;
        Wgmma<N, T>::ss(acc, sw128_desc(a_tile + (kk / 4) * 64 * 128 + col, 0),
                        sw128_desc(b_tile + (kk / 4) * B_ROWS * 128 + col, 0),
                        accumulate || kk > 0);
    }
}

// The split score product of the sm90_3xf16 forward and backward (split16.cuh: the 3xTF32
// split carried by scaled T = __half operands): acc (64 x N) = A B^T by the split, A (64
// rows; its lo tile a_lo bytes on) a K-contiguous tile and B the stacked tile [B_hi; B_lo]
// (2 N rows: lo rows after hi rows) in shared memory. One product of width 2 N gives
// [A_hi B_hi^T | A_hi B_lo^T] in `wide`, another A_lo B_hi^T in y; stacked_sum_unscaled
// (split16.cuh) then forms hh + (hl + lh), each term in accumulators of its own, so the
// tensor cores' accumulation of the large term never adds the small ones. The forward's S
// and the backward's (S, or S^T with the operands' roles swapped) are the same terms summed
// the same way, so that their split errors cancel in P = exp(S - lse). A_hi is read once
// for two terms: 2/3 of the shared-memory bytes of A that three products of width N read.
// Fences and issues; the caller commits and waits.
template <int N, int CONTRACT, typename T>
__device__ __forceinline__ void stacked_product_ss(float (&wide)[2 * N / 8][4],
                                                   float (&y)[N / 8][4], unsigned a_tile,
                                                   unsigned a_lo, unsigned b_stacked) {
    wgmma_fence();
    product_ss<2 * N, CONTRACT, T>(wide, a_tile, b_stacked);
    product_ss<N, CONTRACT, T, 2 * N>(y, a_tile + a_lo, b_stacked);
}

// Pins accumulator values where they stand: their definitions above (zeroing, say) may not
// sink below this point, past a wgmma issued later while they would be defined (ptxas then
// serializes the warpgroup's wgmmas: C7515).
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&acc)[N][4]) {
#pragma unroll
    for (int d = 0; d < N; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[d][e])::"memory");
}

// X (64 x ROWS, m16n8 layout in float registers: each warp's 16 rows) rounded to T as the
// A fragments of product_ra: a[kk] holds columns 16 kk .. 16 kk + 15.
template <int ROWS, typename T>
__device__ __forceinline__ void pack_a(unsigned (&a)[ROWS / 16][4], const float (&x)[ROWS / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < ROWS / 16; ++kk) {
        a[kk][0] = mma::pack2<T>(x[2 * kk][0], x[2 * kk][1]);
        a[kk][1] = mma::pack2<T>(x[2 * kk][2], x[2 * kk][3]);
        a[kk][2] = mma::pack2<T>(x[2 * kk + 1][0], x[2 * kk + 1][1]);
        a[kk][3] = mma::pack2<T>(x[2 * kk + 1][2], x[2 * kk + 1][3]);
    }
}

// acc (64 x N) += X Z with X (64 x ROWS) given as A fragments (pack_a) and Z the first
// ROWS rows of the Z_ROWS-row tile z_tile read N-contiguous (transposed descriptor): 16 rows
// (2048 bytes) per step, 64-column groups Z_ROWS * 128 bytes apart. Fences and issues; the
// caller commits and waits, and keeps `a` unchanged until the product is done.
template <int N, int ROWS, typename T, int Z_ROWS = ROWS>
__device__ __forceinline__ void product_ra(float (&acc)[N / 8][4], const unsigned (&a)[ROWS / 16][4],
                                           unsigned z_tile) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < ROWS / 16; ++kk)
        Wgmma<N, T>::rs(acc, a[kk], sw128_desc(z_tile + kk * 16 * 128, Z_ROWS * 128), 1);
}

// acc (64 x N) += X Z as product_ra for N past one instruction's 128 columns (head dims
// 192 and 256): one product per 128 columns (64 for a last 64), each on its own
// accumulators and Z's column groups from its first.
template <int N, int ROWS, typename T, int Z_ROWS = ROWS>
__device__ __forceinline__ void product_ra_wide(float (&acc)[N / 8][4],
                                                const unsigned (&a)[ROWS / 16][4], unsigned z_tile) {
    if constexpr (N <= 128) {
        product_ra<N, ROWS, T, Z_ROWS>(acc, a, z_tile);
    } else {
        product_ra<128, ROWS, T, Z_ROWS>(*reinterpret_cast<float(*)[16][4]>(&acc[0]), a, z_tile);
        product_ra_wide<N - 128, ROWS, T, Z_ROWS>(
            *reinterpret_cast<float(*)[(N - 128) / 8][4]>(&acc[16]), a, z_tile + 2 * Z_ROWS * 128);
    }
}

// acc (64 x N) += X Z as product_ra, X from float registers (rounded to T here).
template <int N, int ROWS, typename T, int Z_ROWS = ROWS>
__device__ __forceinline__ void product_rs(float (&acc)[N / 8][4], const float (&x)[ROWS / 8][4],
                                           unsigned z_tile) {
    unsigned a[ROWS / 16][4];
    pack_a<ROWS, T>(a, x);
    product_ra<N, ROWS, T, Z_ROWS>(acc, a, z_tile);
}

// Where key n sits along the contraction of P V in product_rs_tf32 when P's fragments come
// from tf32_fragments: within each group of eight, key 2t at position t and key 2t + 1 at
// position t + 4.
__device__ __forceinline__ int tf32_key_position(int n) {
    return (n & ~7) | ((n & 1) << 2) | ((n & 7) >> 1);
}

// acc (64 x N) (+)= A B^T for TF32 with A (64 x CONTRACT) in registers -- a[kk] the
// m16n8k8 A fragment of the warp's 16 rows for contraction columns 8kk .. 8kk + 7 -- and B
// the N-row tile b_tile, K-contiguous (32-column groups N * 128 bytes apart): 8 columns (32
// bytes) per step. Without `accumulate` the first step overwrites acc. Fences (unless
// FENCE is false: a later product of the same batch) and issues; the caller commits and
// waits.
template <int N, int CONTRACT, bool FENCE = true>
__device__ __forceinline__ void product_rs_tf32(float (&acc)[N / 8][4],
                                                const unsigned (&a)[CONTRACT / 8][4],
                                                unsigned b_tile, bool accumulate) {
    if constexpr (FENCE) wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < CONTRACT / 8; ++kk)
        Wgmma<N, float>::rs(acc, a[kk], sw128_desc(b_tile + (kk / 4) * N * 128 + (kk % 4) * 32, 0),
                            accumulate || kk > 0);
}

// The A fragments of X (64 x ROWS, m16n8 accumulator layout, float registers) for
// product_rs_tf32, rounded to TF32 with the contraction permuted: lane t holds a row's
// columns 2t, 2t + 1 of each 8-column tile, the A fragment wants k = t, t + 4 there, so
// column 2t goes to k = t and 2t + 1 to k = t + 4 (tf32_key_position); B's rows must be
// stored in the same order.
template <int ROWS>
__device__ __forceinline__ void tf32_fragments(unsigned (&a)[ROWS / 8][4],
                                               const float (&x)[ROWS / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < ROWS / 8; ++kk) {
        a[kk][0] = mma::to_tf32(x[kk][0]);  // (row g, k = t): column 2t
        a[kk][1] = mma::to_tf32(x[kk][2]);  // (row g + 8, k = t)
        a[kk][2] = mma::to_tf32(x[kk][1]);  // (row g, k = t + 4): column 2t + 1
        a[kk][3] = mma::to_tf32(x[kk][3]);  // (row g + 8, k = t + 4)
    }
}

// Q and dO of the query tile at row m0 into one stage of a dK/dV kernel of the backwards:
// the two tiles by cp.async (or element loads) in the Sw128<BLOCK_M, sizeof(T)> layout.
template <int BLOCK_M, int HEAD_DIM, int HEAD_DIM_V, int THREADS, bool ALIGNED, typename T>
__device__ __forceinline__ void request_query_operands(T* q_st, T* do_st, const T* q,
                                                       const T* dout, const AttnBwdParams& bp,
                                                       long long m0) {
    const AttnParams& p = bp.f;
    mma::load_tile<BLOCK_M, HEAD_DIM, THREADS, ALIGNED>(q_st, q + m0 * p.q_s.row, p.q_s.row,
                                                        p.q_s.col, p.seqlen_q - m0, p.head_dim,
                                                        Sw128<BLOCK_M, sizeof(T)>());
    mma::load_tile<BLOCK_M, HEAD_DIM_V, THREADS, ALIGNED>(
        do_st, dout + m0 * bp.dout_s.row, bp.dout_s.row, bp.dout_s.col, p.seqlen_q - m0,
        p.head_dim_v, Sw128<BLOCK_M, sizeof(T)>());
}

// Q, dO, lse (log2 units) and delta of the query tile at row m0 into one stage of a dK/dV
// kernel of the backwards (attention_bwd_dkdv_sm90, attention_bwd_dkdv_sm90_3xf16): the two
// tiles by request_query_operands, lse and delta by plain loads (rows past Sq: -inf and 0).
template <int BLOCK_M, int HEAD_DIM, int HEAD_DIM_V, int THREADS, bool ALIGNED, typename T>
__device__ __forceinline__ void request_query_tile(T* q_st, T* do_st, float* lse_st,
                                                   float* delta_st, const T* q, const T* dout,
                                                   const float* lse, const float* delta,
                                                   const AttnBwdParams& bp, long long m0) {
    const AttnParams& p = bp.f;
    request_query_operands<BLOCK_M, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED>(q_st, do_st, q, dout,
                                                                            bp, m0);
    for (int i = threadIdx.x; i < BLOCK_M; i += THREADS) {
        const long long r = m0 + i;
        lse_st[i] = r < p.seqlen_q ? lse[r * p.lse_s.row] * float(LOG2E) : neg_inf<float>();
        delta_st[i] = r < p.seqlen_q ? delta[r * bp.delta_s.row] : 0.f;
    }
}

// lse and delta of one query tile, held in registers from their load to their store into a
// stage, for the dK/dV kernels that load them a tile ahead (attention_bwd_dkdv_sm90,
// attention_bwd_dkdv_sm90_3xf16):
// with request_query_tile's plain loads the warp that stores them waits for global memory
// once per tile while the others wait for it at the next block barrier. Thread i <
// BLOCK_M (<= the block's threads) holds row m0 + i; rows past Sq give -inf and 0, and the
// store writes lse in log2 units, as request_query_tile does.
template <int BLOCK_M> struct QueryRowStats {
    float lse = 0.f, delta = 0.f;
    __device__ __forceinline__ void load(const float* lse_p, const float* delta_p,
                                         const AttnBwdParams& bp, long long m0) {
        const long long r = m0 + threadIdx.x;
        lse = neg_inf<float>();
        delta = 0.f;
        if (threadIdx.x < BLOCK_M && r < bp.f.seqlen_q) {
            lse = lse_p[r * bp.f.lse_s.row];
            delta = delta_p[r * bp.delta_s.row];
        }
    }
    __device__ __forceinline__ void store(float* lse_st, float* delta_st) const {
        if (threadIdx.x < BLOCK_M) {
            lse_st[threadIdx.x] = lse * float(LOG2E);
            delta_st[threadIdx.x] = delta;
        }
    }
};

// The transposed TF32 tile of a staged float tile: V^T for O += P V of the TF32 forward
// (attention_sm90_tf32.cu). From the BLOCK_N-row tile vs (Sw128<BLOCK_N, 4>: keys as rows)
// to vt, HEAD_DIM_V rows with the BLOCK_N keys K-contiguous at tf32_key_position
// (Sw128<HEAD_DIM_V, 4>), rounded to TF32. A warp moves 16 keys x 8
// columns per step: lane (n = lane % 16, h = lane / 16) reads 4 columns of key n (one
// 16-byte load; eight consecutive keys hit eight distinct chunks) and writes them to 4 rows
// of V^T; rows 4h + e of the two half-warps differ in bit 2 of the swizzle, so the 32 scalar
// stores of a step hit 32 distinct banks.
// Steps: warp w starts at key block w % KB (KB = BLOCK_N / 16) and column group w / KB
// (of 8 columns) and moves CS = WARPS / KB column groups on (or, with more key blocks than
// warps, WARPS key blocks on). A lane's key then changes by multiples of 16 and its
// columns by multiples of 8 CS: every address is one of two bases (computed once per
// tile) plus a constant, the read's swizzle at most one XOR with a constant.
template <int BLOCK_N, int HEAD_DIM_V, int THREADS>
__device__ __forceinline__ void transpose_v(float* vt, const float* vs) {
    constexpr int WARPS = THREADS / 32, KB = BLOCK_N / 16, CG = HEAD_DIM_V / 8;
    constexpr bool WIDE = WARPS >= KB;  // every warp keeps its key block
    constexpr int CS = WIDE ? WARPS / KB : 1, KSTEP = WIDE ? 0 : WARPS;
    constexpr int NA = CG / CS, NB = WIDE ? 1 : KB / WARPS;
    static_assert((WIDE ? WARPS % KB == 0 && (CS == 1 || CS == 2 || CS == 4) && CG % CS == 0
                        : KB % WARPS == 0),
                  "warps tile the V tile in whole key blocks and column groups");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n = (warp % KB) * 16 + lane % 16;             // key of step (0, 0)
    const int c = (WIDE ? warp / KB : 0) * 8 + 4 * (lane / 16);  // first column, < 8 CS
    const int pos = tf32_key_position(n);
    const int rd = Sw128<BLOCK_N, 4>()(n, c);
    int wr[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) wr[e] = Sw128<HEAD_DIM_V, 4>()(c + e, pos);
#pragma unroll
    for (int a = 0; a < NA; ++a)
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            // columns c + 8 CS a: column group (8 CS a) / 32, swizzle chunk XOR ((8 CS a) % 32) / 4
            // (c < 8 CS shares no bits with it); keys n + 16 KSTEP b: rows further on, and
            // V^T columns (pos + 16 KSTEP b, a multiple of 32 further) whole groups on
            const int col = 8 * CS * a, key = 16 * KSTEP * b;
            const float4 x = *reinterpret_cast<const float4*>(
                vs + ((rd ^ (((col % 32) / 4) << 2)) + (col / 32) * BLOCK_N * 32 + key * 32));
            const float xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int at = wr[e] + col * 32 + (key / 32) * HEAD_DIM_V * 32;
                vt[at] = __uint_as_float(mma::to_tf32(xs[e]));
            }
        }
}

}  // namespace sm90
}  // namespace cuattn
