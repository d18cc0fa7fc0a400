// merge.cu -- merge_parts: attention results over disjoint key sets combined into one.
//
// Computes:   for every row, with the parts' lse_p (natural log, -inf for a part with no
//             allowed key) and m = max_p lse_p:
//                 l = sum_p exp(lse_p - m),  out = sum_p exp(lse_p - m) out_p / l,
//                 lse = m + log l;
//             a row with no allowed key in any part gets out = 0 and lse = -inf. The parts
//             are summed in their order, in the accumulation type A, and rounded once.
// Layout:     out and the parts' outputs (batch..., rows, cols), lse and the parts' lse
//             (batch..., rows); the parts share one layout (one Strides each for outputs
//             and lse); batch axes collapsed into three by cuattn/_launch.py::layout. The
//             parts are up to eight addresses, or any number stacked on one axis: the
//             first part's address and the element step from one part to the next.
// Ownership:  thread (x, y) writes column x % cols of row x / cols of batch entries y,
//             y + gridDim.y, ...; the threads of column 0 write lse.
// Template:   T in {__half, __nv_bfloat16, float, double}; A = Acc<T> (common.cuh).
// Shared mem: none.
// Reference:  the NumPy path of cuattn.merge.merge_attention.
#include "common/common.cuh"

using namespace cuattn;

// The parameter block (cuattn/_params.py reads it from here). part_out0 .. part_out7 and
// part_lse0 .. part_lse7 are consecutive: the kernel indexes them as arrays. With
// part_out_step != 0 the parts are stacked: part i at part_out0 + i * part_out_step
// elements (its lse at part_lse0 + i * part_lse_step), for any number of parts.
struct MergeParams {
    long long out, lse;  // device addresses of the results
    long long part_out0, part_out1, part_out2, part_out3, part_out4, part_out5, part_out6,
        part_out7;
    long long part_lse0, part_lse1, part_lse2, part_lse3, part_lse4, part_lse5, part_lse6,
        part_lse7;
    long long parts, entries, batch1, batch2, rows, cols;
    long long part_out_step, part_lse_step;
    Strides out_s, lse_s, part_out_s, part_lse_s;
};

// Part i of a list of addresses, or of parts stacked ``step`` elements apart
template <typename X>
__device__ __forceinline__ const X* part_at(const long long* list, long long step, int i) {
    return step ? reinterpret_cast<const X*>(list[0]) + i * step
                : reinterpret_cast<const X*>(list[i]);
}

template <typename T>
__global__ void __launch_bounds__(256) merge_parts(const MergeParams p) {
    using A = Acc<T>;
    const long long* part_out = &p.part_out0;
    const long long* part_lse = &p.part_lse0;
    const long long items = p.rows * p.cols;
    for (long long b = blockIdx.y; b < p.entries; b += gridDim.y) {
        for (long long x = blockIdx.x * 256LL + threadIdx.x; x < items; x += 256LL * gridDim.x) {
            const long long row = x / p.cols, col = x % p.cols;
            const long long lse_at = batch_offset(p.part_lse_s, b, p.batch1, p.batch2) +
                                     row * p.part_lse_s.row;
            A m = neg_inf<A>();
            for (int i = 0; i < p.parts; ++i)
                m = max(m, part_at<A>(part_lse, p.part_lse_step, i)[lse_at]);
            const bool empty = m == neg_inf<A>();
            const A shift = empty ? A(0) : m;
            const long long out_at = batch_offset(p.part_out_s, b, p.batch1, p.batch2) +
                                     row * p.part_out_s.row + col * p.part_out_s.col;
            A l = A(0), acc = A(0);
            for (int i = 0; i < p.parts; ++i) {
                // exp through fast_exp2: the double exp's slow path spills on sm_90
                const A w =
                    fast_exp2((part_at<A>(part_lse, p.part_lse_step, i)[lse_at] - shift) * A(LOG2E));
                l += w;
                acc += w * to_acc(part_at<T>(part_out, p.part_out_step, i)[out_at]);
            }
            T* out = reinterpret_cast<T*>(p.out) + batch_offset(p.out_s, b, p.batch1, p.batch2);
            out[row * p.out_s.row + col * p.out_s.col] = from_acc<T>(empty ? A(0) : acc / l);
            if (col == 0) {
                A* lse = reinterpret_cast<A*>(p.lse) + batch_offset(p.lse_s, b, p.batch1, p.batch2);
                lse[row * p.lse_s.row] = empty ? neg_inf<A>() : m + log(l);
            }
        }
    }
}
