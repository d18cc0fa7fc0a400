// attention_mma.cu -- tensor-core attention forward for float16 / bfloat16 (sm_80 and newer).
//
// Computes:   the same function as attention_portable.cu (reference
//             cuattn/reference.py::attention_reference): out = softmax(s) v and lse, with
//             s = scale * q k^T, softcap, bias, bool mask, causal/window band.
// Layout:     as attention_portable.cu: AttnParams (common.cuh) with element strides for
//             three collapsed batch axes, rows and columns. ALIGNED instances need unit
//             column strides, 16-byte aligned rows and D, Dv multiples of 8 (checked in
//             Python); the others load element by element.
// Ownership:  a block of NUM_WARPS warps owns BLOCK_M = 16 * M_TILES * NUM_WARPS query
//             rows of one batch entry and all Dv output columns; warp w owns M_TILES tiles of
//             16 rows from row 16 * M_TILES * w (every K and V fragment it loads feeds all of
//             them). Within a tile the m16n8 accumulator layout gives lane (g = lane/4,
//             t = lane%4) rows g and g+8 and columns 2t, 2t+1 of every 8-column tile, so a
//             row's statistics are reduced over the four lanes of a quad.
// Algorithm:  K and V tiles of BLOCK_N keys arrive by cp.async one tile ahead into two
//             stages; per tile: S = Q K^T (mma.sync m16n8k16, operands by ldmatrix), scale /
//             softcap / bias / mask in log2 units (interior tiles skip the mask arithmetic),
//             online softmax (m, l, alpha) in registers, P converted to T in registers and
//             used directly as the A operand of O += P V (V through ldmatrix.trans).
// Template:   T (__half or __nv_bfloat16); BiasT (NoBias or a float type); HAS_MASK;
//             HEAD_DIM, HEAD_DIM_V: q/k and v head dims padded to a multiple of 64 (the pad
//             is zero-filled in shared memory); BLOCK_N keys per tile; NUM_WARPS; M_TILES
//             row tiles of 16 per warp; ALIGNED; MIN_BLOCKS resident blocks per SM for
//             __launch_bounds__ (a register cap); RAGGED: a dense call, packed sequences or
//             key lengths (sequence_unit, common.cuh).
// Shared mem: (BLOCK_M*HEAD_DIM + 2*BLOCK_N*HEAD_DIM + 2*BLOCK_N*HEAD_DIM_V) * sizeof(T);
//             rows are stored with a 16-byte-chunk XOR swizzle (chunk ^ row % 8) so that the
//             eight row addresses of every ldmatrix phase fall in distinct banks.
//             the layout: FwdMmaSmem (layouts.cuh, from cuattn/families/mma.py).
#include "common/mma_softmax.cuh"
#include "common/mma_tiles.cuh"

using namespace cuattn;
using namespace cuattn::mma;

template <typename T, typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N,
          int NUM_WARPS, int M_TILES, bool ALIGNED, int MIN_BLOCKS, int RAGGED = DENSE>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_BLOCKS)
    attention_fwd_mma(const AttnParams params) {
    constexpr int THREADS = NUM_WARPS * 32, WARP_M = 16 * M_TILES, BLOCK_M = WARP_M * NUM_WARPS;
    constexpr int DV_TILES = HEAD_DIM_V / 8;
    static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM_V % 64 == 0 && BLOCK_N % 16 == 0,
                  "head dims are padded to multiples of 64, key tiles to multiples of 16");
    constexpr int K_ELEMS = BLOCK_N * HEAD_DIM, V_ELEMS = BLOCK_N * HEAD_DIM_V;

    using L = FwdMmaSmem<T, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N>;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw + L::q_s);  // [BLOCK_M][HEAD_DIM]
    T* k_s = reinterpret_cast<T*>(smem_raw + L::k_s);  // [2][BLOCK_N][HEAD_DIM]
    T* v_s = reinterpret_cast<T*>(smem_raw + L::v_s);  // [2][BLOCK_N][HEAD_DIM_V]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // a packed call's or key lengths' block: its sequence as a dense call (common.cuh)
    const SequenceUnit su = sequence_unit<RAGGED, T, float>(params, blockIdx.x, gridDim.x);
    const AttnParams& p = RAGGED != DENSE ? su.p : params;
    // this block's rows and batch entry, heaviest query blocks first (common.cuh)
    const ForwardBlock<T, BiasT> blk = forward_block_of<RAGGED, T, BiasT>(p, su, BLOCK_M);
    const long long b = blk.b, m0 = blk.m0;
    const T *q = blk.q, *k = blk.k, *v = blk.v;
    const unsigned char* mask = blk.mask;
    const BiasT* bias = blk.bias;

    // key tiles that the causal/window band reaches from rows m0 .. m_last
    // sequence positions fit in 32 bits (checked in Python): 32-bit loop state saves
    // registers next to the accumulators
    const int seqlen_q = (int)p.seqlen_q, seqlen_k = (int)p.seqlen_k;
    const int off = seqlen_k - seqlen_q;
    const int m_last = min((int)m0 + BLOCK_M, seqlen_q) - 1;
    const Range keys = key_band(p, m0, m_last, BLOCK_N);
    const int n_lo = (int)keys.lo, n_hi = (int)keys.hi;

    auto request_kv = [&](int n0, int stage) {
        load_kv_tiles<BLOCK_N, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED, RAGGED>(
            k_s + stage * K_ELEMS, v_s + stage * V_ELEMS, k, v, n0, p, Swizzled<HEAD_DIM>(),
            Swizzled<HEAD_DIM_V>(), b);
    };
    load_tile<BLOCK_M, HEAD_DIM, THREADS, ALIGNED>(q_s, q, p.q_s.row, p.q_s.col, p.seqlen_q - m0,
                                                   p.head_dim, Swizzled<HEAD_DIM>());
    if (n_lo < n_hi) request_kv(n_lo, 0);
    cp_async_commit();

    float acc[M_TILES][DV_TILES][4], m[M_TILES][2], l[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        m[mt][0] = m[mt][1] = neg_inf<float>();
        l[mt][0] = l[mt][1] = 0.f;
#pragma unroll
        for (int d = 0; d < DV_TILES; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][d][e] = 0.f;
    }

    // ldmatrix rows of this lane: Q rows 16w + lane%16 (column half lane/16); K rows
    // lane%8 + 8*(lane/16) (half (lane/8)%2); V rows lane%8 + 8*((lane/8)%2) (half lane/16)
    const LaneOffsets<HEAD_DIM> q_off(warp * WARP_M + lane % 16, lane / 16);
    const LaneOffsets<HEAD_DIM> k_off(lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
    const LaneOffsets<HEAD_DIM_V> v_off(lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
    const unsigned q_base = smem_addr(q_s), k_base = smem_addr(k_s), v_base = smem_addr(v_s);
    const SoftmaxExp2<float> exp2_fn(lane);

    int stage = 0;
    for (int n0 = n_lo; n0 < n_hi; n0 += BLOCK_N, stage ^= 1) {
        // fetch the next tile into the other stage, last read before the previous
        // iteration's final barrier
        if (n0 + BLOCK_N < n_hi) request_kv(n0 + BLOCK_N, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();  // all but the group just issued have landed ...
        __syncthreads();     // ... for every thread: Q (first time), this tile's K and V
        float s[M_TILES][BLOCK_N / 8][4];
        scores<HEAD_DIM, BLOCK_N, M_TILES, T>(s, q_base, k_base + stage * K_ELEMS * 2, q_off, k_off);
        // interior tile: inside both sequences and the band for every row of the block
        const bool interior = !HAS_MASK && forward_tile_interior<BLOCK_M, BLOCK_N>(
                                               p, m0, m_last, n0, seqlen_q, seqlen_k, off);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            const float scale = mask_scores<BLOCK_N, HAS_MASK>(s[mt], p, m0 + warp * WARP_M + mt * 16,
                                                               n0, lane, interior, mask, bias);
            update_row_state<BLOCK_N, DV_TILES>(s[mt], m[mt], l[mt], acc[mt], scale, exp2_fn);
        }
        accumulate_pv<BLOCK_N, HEAD_DIM_V, M_TILES, T>(acc, s, v_base + stage * V_ELEMS * 2, v_off);
        __syncthreads();  // this stage is consumed before the next iteration refills it
    }
    cp_async_wait<0>();  // no copy may outlive the block

    // Normalise and store (mma_softmax.cuh)
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
        store_rows<T, DV_TILES>(acc[mt], l[mt], m[mt], p, b, m0 + warp * WARP_M + mt * 16, lane);
}
