// sm90_tiles.cuh -- the warpgroup-MMA (wgmma, sm_90a) tile machinery shared by the Hopper
// kernels (attention_sm90.cu, the forward; attention_backward_sm90.cu, the backward).
//
// Operand tiles are 16-bit (T = __half or __nv_bfloat16) in shared memory, in the canonical
// 128-byte-swizzle layout of wgmma: 64-column groups stored one after another, each group's
// rows 128 bytes apart with 16-byte chunk c of row r at chunk c ^ (r % 8); tiles start
// 1024-byte aligned. A warpgroup's accumulators (64 x N, float) have the m16n8 layout of
// mma.sync in each of its four warps (wgmma.cuh), so the tensor-core softmax and the
// backward's element-wise rule run on them unchanged.
//   product_ss  acc = A B^T, A (64 rows) and B (N rows) K-contiguous in shared memory
//   product_rs  acc += X Z, X from float registers (rounded to T), Z read N-contiguous
#pragma once

#include "mma_tiles.cuh"
#include "wgmma.cuh"

namespace cuattn {
namespace sm90 {

// Element offset of (row, col) in a ROWS-row tile in the 128-byte-swizzle layout.
template <int ROWS> struct Sw128 {
    __device__ __forceinline__ int operator()(int row, int col) const {
        return (col >> 6) * ROWS * 64 + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) +
               (col & 7);
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

// acc (64 x N per warpgroup) = A B^T over CONTRACT columns, A (64 rows) and B (N rows) both
// K-contiguous tiles in shared memory: 16 columns (32 bytes) per step inside a 64-column
// group; groups 64 * 128 bytes (A) and N * 128 bytes (B) apart. Issues only: the caller
// fences before and commits and waits after.
template <int N, int CONTRACT, typename T>
__device__ __forceinline__ void product_ss(float (&acc)[N / 8][4], unsigned a_tile,
                                           unsigned b_tile) {
#pragma unroll
    for (int kk = 0; kk < CONTRACT / 16; ++kk) {
        const unsigned col = (kk % 4) * 32;
        Wgmma<N, T>::ss(acc, sw128_desc(a_tile + (kk / 4) * 64 * 128 + col, 0),
                        sw128_desc(b_tile + (kk / 4) * N * 128 + col, 0), kk > 0);
    }
}

// acc (64 x N) += X Z with X (64 x ROWS) the T-rounded values of x (m16n8 layout, from
// registers: the A fragments of each warp's 16 rows) and Z the ROWS-row tile z_tile read
// N-contiguous (transposed descriptor): 16 rows (2048 bytes) per step, 64-column groups
// ROWS * 128 bytes apart. Fences and issues; the caller commits and waits.
template <int N, int ROWS, typename T>
__device__ __forceinline__ void product_rs(float (&acc)[N / 8][4], const float (&x)[ROWS / 8][4],
                                           unsigned z_tile) {
    unsigned a[ROWS / 16][4];
#pragma unroll
    for (int kk = 0; kk < ROWS / 16; ++kk) {
        a[kk][0] = mma::pack2<T>(x[2 * kk][0], x[2 * kk][1]);
        a[kk][1] = mma::pack2<T>(x[2 * kk][2], x[2 * kk][3]);
        a[kk][2] = mma::pack2<T>(x[2 * kk + 1][0], x[2 * kk + 1][1]);
        a[kk][3] = mma::pack2<T>(x[2 * kk + 1][2], x[2 * kk + 1][3]);
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < ROWS / 16; ++kk)
        Wgmma<N, T>::rs(acc, a[kk], sw128_desc(z_tile + kk * 16 * 128, ROWS * 128), 1);
}

}  // namespace sm90
}  // namespace cuattn
