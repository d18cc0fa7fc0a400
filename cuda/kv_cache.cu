// kv_cache.cu -- kv_cache_append: new keys and values written into a batch of caches.
//
// Computes:   k_cache[b, lengths[b] + i, :] = k_new[b, i, :] and the same for v, for every
//             batch entry b and new row i < new_rows, in one launch for the whole batch.
// Layout:     caches (batch..., cache_rows, D), new rows (batch..., new_rows, D); any
//             strides (five per tensor, common.cuh's Strides, batch axes collapsed into
//             three by cuattn/_launch.py::layout); lengths, of type L, one per batch entry
//             (broadcast strides allowed).
// Ownership:  block (x, y) copies new rows x, x + gridDim.x, ... of batch entries
//             y, y + gridDim.y, ...; its threads take the columns. A row whose position
//             falls outside [0, cache_rows) is dropped: device lengths are not read on the
//             host, so this test is what keeps every write inside the cache.
// Template:   T in {__half, __nv_bfloat16, float, double}; L in {int, long long}.
// Shared mem: none.
// Reference:  the NumPy path of cuattn.cache.kv_cache_append.
#include "common/common.cuh"

using namespace cuattn;

// The parameter block (cuattn/_params.py reads it from here).
struct KvAppend {
    long long k_cache, v_cache, k_new, v_new, lengths;  // device addresses
    long long entries;                                  // batch entries
    long long batch1, batch2;           // extents of batch axes 1 and 2 (axis 0 is implied)
    long long cache_rows, new_rows, head_dim, head_dim_v;
    Strides kc_s, vc_s, kn_s, vn_s, len_s;
};

template <typename T>
__device__ __forceinline__ void copy_row(T* dst, long long dst_col, const T* src,
                                         long long src_col, long long cols) {
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) dst[c * dst_col] = src[c * src_col];
}

template <typename T, typename L>
__global__ void __launch_bounds__(128) kv_cache_append(const KvAppend p) {
    for (long long b = blockIdx.y; b < p.entries; b += gridDim.y) {
        const long long length = reinterpret_cast<const L*>(
            p.lengths)[batch_offset(p.len_s, b, p.batch1, p.batch2)];
        T* k_cache = reinterpret_cast<T*>(p.k_cache) + batch_offset(p.kc_s, b, p.batch1, p.batch2);
        T* v_cache = reinterpret_cast<T*>(p.v_cache) + batch_offset(p.vc_s, b, p.batch1, p.batch2);
        const T* k_new =
            reinterpret_cast<const T*>(p.k_new) + batch_offset(p.kn_s, b, p.batch1, p.batch2);
        const T* v_new =
            reinterpret_cast<const T*>(p.v_new) + batch_offset(p.vn_s, b, p.batch1, p.batch2);
        for (long long i = blockIdx.x; i < p.new_rows; i += gridDim.x) {
            const long long pos = length + i;
            if (pos < 0 || pos >= p.cache_rows) continue;  // dropped, never out of bounds
            copy_row(k_cache + pos * p.kc_s.row, p.kc_s.col, k_new + i * p.kn_s.row, p.kn_s.col,
                     p.head_dim);
            copy_row(v_cache + pos * p.vc_s.row, p.vc_s.col, v_new + i * p.vn_s.row, p.vn_s.col,
                     p.head_dim_v);
        }
    }
}
