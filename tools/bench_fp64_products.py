"""What the FP64 pipe gives the portable warp form's inner loops (docs/kernels.rst,
twenty-third session), with one 256-thread block per SM as in the kernel:

    PYTHONPATH=. python tools/bench_fp64_products.py [KERNEL_DIR]

1. DFMA streams from registers by operand pattern (no loads): A and B the same registers;
   a 4 x 8 tile with A shared along a row; a 4 x 8 tile in an order where consecutive FMAs
   share no operand. Run at 8 and at 32 warps per SM.
2. The form's two products alone, in a loop over shared-memory tiles, from KERNEL_DIR's
   portable_tiles.cuh (default: cuda/): Q K^T (scores_strided, 4 x 8 lane tiles, the output
   accumulator kept live as in the kernel), P V (accumulate_strided and accumulate_ahead),
   and both in turn.

TFLOP/s counts 2 per DFMA. Nothing is checked: this measures the pipe, not attention.
"""
import os
import sys

import cupy as cp
import numpy as np

STREAMS = r'''
template <int PAT>
__global__ void __launch_bounds__(256) stream(double* out, const double* in, int iters) {
    const int t = threadIdx.x + blockIdx.x * blockDim.x;
    double a[4], b[8], c[32];
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = in[(t + i) & 1023];
#pragma unroll
    for (int j = 0; j < 8; ++j) b[j] = in[(t + 7 * j + 5) & 1023];
#pragma unroll
    for (int k = 0; k < 32; ++k) c[k] = 0.0;
    for (int it = 0; it < iters; ++it) {
        if (PAT == 0) {
#pragma unroll
            for (int k = 0; k < 16; ++k) c[k] = fma(a[0], b[0], c[k]);
        } else if (PAT == 1) {
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) c[8 * i + j] = fma(a[i], b[j], c[8 * i + j]);
        } else {
#pragma unroll
            for (int d = 0; d < 8; ++d)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int j = (i + d) & 7;
                    c[8 * i + j] = fma(a[i], b[j], c[8 * i + j]);
                }
        }
        if (PAT > 0) {  // the operands change, as loads would change them
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = c[i] * 1e-300 + a[i];
        }
    }
    double s = 0;
#pragma unroll
    for (int k = 0; k < 32; ++k) s += c[k];
    out[t] = s;
}
'''
STREAM_DFMA = {0: 16, 1: 36, 2: 36}  # per iteration and thread
STREAM_NAMES = {0: "A and B the same registers, 16 accumulators",
                1: "4 x 8 tile, A shared along a row",
                2: "4 x 8 tile, consecutive FMAs share no operand"}

PRODUCTS = r'''
#include "portable_tiles.cuh"
using namespace cuattn::portable;
constexpr int PAD = 2, D = 64, BN = 64, QP = D + PAD, PP = BN + PAD;
template <int MODE>  // 0 Q K^T, 1 P V, 2 P V one step ahead, 3 Q K^T then P V
__global__ void __launch_bounds__(256, 1) products(double* out, int iters) {
    extern __shared__ __align__(16) double sm[];
    double* q_s = sm;
    double* k_s = q_s + 128 * QP;
    double* v_s = k_s + BN * QP;
    double* p_s = v_s + BN * QP;
    for (int i = threadIdx.x; i < 128 * QP + 2 * BN * QP + 128 * PP; i += 256)
        sm[i] = 1e-3 * (i % 97);
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;  // the kernel's lane placement
    const int lx = (lane & 1) | ((lane >> 1) & 6), ly = ((lane >> 1) & 1) | ((lane >> 3) & 2);
    const double* q_w = q_s + (warp * 16 + ly) * QP;
    double* p_w = p_s + warp * 16 * PP;
    double s[4][8], acc[4][8];
    for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 8; ++j) acc[i][j] = 0;
    for (int it = 0; it < iters; ++it) {
        if (MODE == 0 || MODE == 3) {
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) s[i][j] = 0;
            scores_strided<4, 8, D, PAD, 4, 8, D / 2>(s, q_w, k_s + lx * QP, 0, 0);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] += s[i][j] * 1e-9;  // 32 DFMA
        }
        if (MODE == 1 || MODE == 3)
            accumulate_strided<4, 8, BN, D, PAD, 1, 8>(acc, p_w, v_s, 4 * ly, lx);
        if (MODE == 2) accumulate_ahead<4, 8, BN, D, PAD, 1, 8>(acc, p_w, v_s, 4 * ly, lx);
        __syncwarp();
    }
    double t = 0;
    for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 8; ++j) t += acc[i][j];
    out[blockIdx.x * 256 + threadIdx.x] = t;
}
'''
PRODUCT_DFMA = {0: 2048 + 32, 1: 2048, 2: 2048, 3: 4096 + 32}
PRODUCT_NAMES = {0: "Q K^T (scores_strided)", 1: "P V (accumulate_strided)",
                 2: "P V (accumulate_ahead)", 3: "Q K^T then P V"}
SMEM = (128 * 66 + 2 * 64 * 66 + 128 * 66) * 8  # also keeps one block per SM


def _time(f, grid, args, smem):
    f(grid, (256,), args, shared_mem=smem)  # warm-up (and compile)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    f(grid, (256,), args, shared_mem=smem)
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop)


def main():
    kdir = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    opts = ("-std=c++17", "--device-as-default-execution-space")
    streams = cp.RawModule(code=STREAMS, options=opts,
                           name_expressions=[f"stream<{i}>" for i in STREAM_DFMA])
    inp = cp.random.random(1024)
    iters = 20000
    for i, dfma in STREAM_DFMA.items():
        f = streams.get_function(f"stream<{i}>")
        for smem, blocks in ((200 * 1024, sms), (0, 4 * sms)):
            f.max_dynamic_shared_size_bytes = smem
            out = cp.empty(blocks * 256)
            ms = _time(f, (blocks,), (out, inp, np.int32(iters)), smem)
            tflops = 2.0 * dfma * iters * blocks * 256 / ms / 1e9
            print(f"stream, {STREAM_NAMES[i]}, {blocks // sms * 8} warps/SM: "
                  f"{tflops:6.2f} TFLOP/s")
    products = cp.RawModule(code=PRODUCTS, options=opts + (f"-I{kdir}",),
                            name_expressions=[f"products<{i}>" for i in PRODUCT_DFMA])
    iters = 2000
    for i, dfma in PRODUCT_DFMA.items():
        f = products.get_function(f"products<{i}>")
        f.max_dynamic_shared_size_bytes = SMEM
        out = cp.empty(sms * 256)
        ms = _time(f, (sms,), (out, np.int32(iters)), SMEM)
        tflops = 2.0 * dfma * iters * sms * 256 / ms / 1e9
        print(f"{PRODUCT_NAMES[i]} ({os.path.basename(kdir)}), 8 warps/SM: "
              f"{tflops:6.2f} TFLOP/s ({f.num_regs} registers)")


if __name__ == "__main__":
    main()
