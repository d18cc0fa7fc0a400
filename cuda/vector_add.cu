// vector_add.cu -- c = a + b over n contiguous elements: the teaching kernel of cuattn.
//
// Computes:   c[i] = a[i] + b[i] for 0 <= i < n, rounded once to T (numpy.add semantics).
// Layout:     a, b, c contiguous, same dtype T (Python broadcasts and casts beforehand).
// Ownership:  grid-stride loop; each thread handles UNROLL 16-byte packs
//             (16 / sizeof(T) elements each, a block's threads on consecutive packs) per
//             step when all three pointers are 16-byte aligned, then a scalar tail;
//             unaligned views take the scalar loop for everything.
// Template:   T in {__half, __nv_bfloat16, float, double, int, long long}; UNROLL packs
//             per thread per step (cuattn/elementwise.py::VECTOR_ADD_UNROLL).
// Shared mem: none.
// Reference:  numpy.add (cuattn.elementwise.vector_add on NumPy inputs).
#include "common/common.cuh"

namespace {

template <typename T>
__device__ __forceinline__ T add(T x, T y) { return x + y; }
// 16-bit floats: add in float and round once, exactly as NumPy / ml_dtypes do.
template <>
__device__ __forceinline__ __half add(__half x, __half y) {
    return __float2half_rn(__half2float(x) + __half2float(y));
}
template <>
__device__ __forceinline__ __nv_bfloat16 add(__nv_bfloat16 x, __nv_bfloat16 y) {
    return __float2bfloat16_rn(__bfloat162float(x) + __bfloat162float(y));
}

template <typename T>
struct alignas(16) Pack {
    static constexpr int N = 16 / sizeof(T);
    T v[N];
};

}  // namespace

template <typename T, int UNROLL>
__global__ void vector_add(const T* __restrict__ a, const T* __restrict__ b,
                           T* __restrict__ c, long long n) {
    using P = Pack<T>;
    // UNROLL packs per thread per step, all loaded before the first add: 2 * UNROLL
    // 16-byte loads in flight per thread keep enough bytes moving to near the copy rate.
    const long long step = (long long)gridDim.x * blockDim.x * UNROLL;
    const bool aligned = ((reinterpret_cast<unsigned long long>(a) |
                           reinterpret_cast<unsigned long long>(b) |
                           reinterpret_cast<unsigned long long>(c)) % 16) == 0;
    const long long n_packs = aligned ? n / P::N : 0;
    const P* pa = reinterpret_cast<const P*>(a);
    const P* pb = reinterpret_cast<const P*>(b);
    P* pc = reinterpret_cast<P*>(c);
    for (long long base = blockIdx.x * (long long)blockDim.x * UNROLL + threadIdx.x;
         base < n_packs; base += step) {
        P x[UNROLL], y[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long i = base + u * blockDim.x;  // consecutive threads: consecutive packs
            if (i < n_packs) {  // the last step may be partial
                x[u] = pa[i];
                y[u] = pb[i];
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long i = base + u * blockDim.x;
            if (i < n_packs) {
                P z;
#pragma unroll
                for (int e = 0; e < P::N; ++e) z.v[e] = add(x[u].v[e], y[u].v[e]);
                pc[i] = z;
            }
        }
    }
    // Scalar tail: the last n % N elements, or everything when a view is unaligned.
    const long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    for (long long i = n_packs * P::N + tid; i < n; i += (long long)gridDim.x * blockDim.x)
        c[i] = add(a[i], b[i]);
}
