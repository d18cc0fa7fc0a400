// vector_add.cu -- c = a + b over n contiguous elements: the teaching kernel of cuattn.
//
// Computes:   c[i] = a[i] + b[i] for 0 <= i < n, rounded once to T (numpy.add semantics).
// Layout:     a, b, c contiguous, same dtype T (Python broadcasts and casts beforehand).
// Ownership:  grid-stride loop; each thread handles one 16-byte pack (16 / sizeof(T)
//             elements) per step when all three pointers are 16-byte aligned, then a
//             scalar tail; unaligned views take the scalar loop for everything.
// Template:   T in {__half, __nv_bfloat16, float, double, int, long long}.
// Shared mem: none.
// Reference:  numpy.add (cuattn.elementwise.vector_add on NumPy inputs).
#include "common.cuh"

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

template <typename T>
__global__ void vector_add(const T* __restrict__ a, const T* __restrict__ b,
                           T* __restrict__ c, long long n) {
    using P = Pack<T>;
    const long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const bool aligned = ((reinterpret_cast<unsigned long long>(a) |
                           reinterpret_cast<unsigned long long>(b) |
                           reinterpret_cast<unsigned long long>(c)) % 16) == 0;
    const long long n_packs = aligned ? n / P::N : 0;
    for (long long i = tid; i < n_packs; i += stride) {
        // 16-byte loads and stores: one LDG.128 per operand per pack.
        const P x = reinterpret_cast<const P*>(a)[i];
        const P y = reinterpret_cast<const P*>(b)[i];
        P z;
#pragma unroll
        for (int e = 0; e < P::N; ++e) z.v[e] = add(x.v[e], y.v[e]);
        reinterpret_cast<P*>(c)[i] = z;
    }
    // Scalar tail: the last n % N elements, or everything when a view is unaligned.
    for (long long i = n_packs * P::N + tid; i < n; i += stride) c[i] = add(a[i], b[i]);
}
