"""DMMA microbenchmark: throughput and dependent-step latency of mma.sync m16n8k8 and
m16n8k16 float64 (sm_90) on this GPU.

    python tools/bench_dmma.py

One block per SM of 1, 4, 8 or 16 warps; each warp runs CHAINS independent accumulator
chains. Prints TFLOP/s over all SMs and cycles per mma per warp at 1.98 GHz (the H200's
maximum SM clock). Used for docs/kernels.rst (attention_mma_wide, fourth session).
"""
import cupy as cp

SRC = r"""
template <int CHAINS, int K16>
__global__ void dmma(double* out, int iters) {
    double d[CHAINS][4], a[8], b[4];
    for (int i = 0; i < 8; ++i) a[i] = 1e-3 * (threadIdx.x + i);
    for (int i = 0; i < 4; ++i) b[i] = 1e-3 * (threadIdx.x - i);
    for (int c = 0; c < CHAINS; ++c)
        for (int e = 0; e < 4; ++e) d[c][e] = 0;
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) {
            if (K16) {
                asm volatile(
                    "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, "
                    "{%4,%5,%6,%7,%8,%9,%10,%11}, {%12,%13,%14,%15}, {%0,%1,%2,%3};\n"
                    : "+d"(d[c][0]), "+d"(d[c][1]), "+d"(d[c][2]), "+d"(d[c][3])
                    : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]),
                      "d"(a[6]), "d"(a[7]), "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));
            } else {
                asm volatile(
                    "mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, "
                    "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                    : "+d"(d[c][0]), "+d"(d[c][1]), "+d"(d[c][2]), "+d"(d[c][3])
                    : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
            }
        }
    }
    double s = 0;
    for (int c = 0; c < CHAINS; ++c)
        for (int e = 0; e < 4; ++e) s += d[c][e];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;  // keeps the chains alive
}
"""
CLOCK_HZ = 1.98e9


def main():
    configs = [(c, k16) for c in (1, 2, 4, 8) for k16 in (0, 1)]
    names = [f"dmma<{c}, {k16}>" for c, k16 in configs]
    mod = cp.RawModule(code=SRC, options=("-std=c++17", "-arch=sm_90"), name_expressions=names)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    out = cp.zeros(sms * 16 * 32, dtype=cp.float64)
    iters = 2000
    print(f"{'chains':>6} {'k':>3} {'warps/SM':>8} {'TFLOP/s':>8} {'cyc/mma/warp':>12}")
    for (chains, k16), name in zip(configs, names):
        fn = mod.get_function(name)
        for warps in (1, 4, 8, 16):
            args = ((sms,), (32 * warps,), (out, cp.int32(iters)))
            fn(*args)  # warm-up
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            fn(*args)
            stop.record()
            stop.synchronize()
            ms = cp.cuda.get_elapsed_time(start, stop)
            flops = 2.0 * 16 * 8 * (16 if k16 else 8) * chains * iters * warps * sms
            cycles = ms * 1e-3 * CLOCK_HZ / (iters * chains)
            print(f"{chains:6d} {16 if k16 else 8:3d} {warps:8d} {flops / ms / 1e9:8.1f} "
                  f"{cycles:12.1f}")


if __name__ == "__main__":
    main()
