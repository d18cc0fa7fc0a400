// attention_mma_wide.cu -- float32 and float64 attention forward on tensor cores:
// float32 through TF32 (sm_80 and newer), float64 through DMMA (the FP64 tensor cores of
// sm_80, sm_90 and sm_100; dispatch picks it only there).
//
// Computes:   the same function as attention_mma.cu (reference
//             cuattn/reference.py::attention_reference). The products S = Q K^T and O += P V
//             run on m16n8k8 tensor-core steps:
//             - T = float, precision="tf32": mma.sync m16n8k8 .tf32 with float32
//               accumulators, each operand (q, k, P, v) rounded to TF32 (10-bit mantissa,
//               cvt.rna) once; the softmax is float32. Its yardstick is
//               cuattn/reference.py::naive_attention with the same roundings.
//               precision="highest" stays on the portable family (and sm90_3xf16 on
//               Hopper): a 3xTF32 form of this kernel (hi/lo operand splits, three
//               products, P V accumulated into O) misses the accuracy rule by up to 2.0x.
//             - T = double: DMMA, IEEE double products and sums (mma.sync m16n8k8 .f64 on
//               sm_90 and newer, four m8n8k4 on sm_80); the softmax is double.
// Layout:     as attention_mma.cu: AttnParams with element strides. ALIGNED instances copy
//             rows in 16-byte cp.async chunks (unit column strides, row strides multiples of
//             16 bytes, 16-byte aligned pointers, head dims multiples of 16 bytes).
// Ownership:  a block of NUM_WARPS warps owns BLOCK_M = 16 * M_TILES * NUM_WARPS query rows of
//             one batch entry and all Dv columns; warp w owns M_TILES tiles of 16 rows (lane
//             g = lane/4, t = lane%4 holds rows g, g+8 of each accumulator tile). Each K and
//             V fragment feeds M_TILES steps.
// Fragments:  T tiles in shared memory, loaded by plain LDS (ldmatrix moves 16-bit units).
//             The contraction index inside each k8 step is permuted consistently for both
//             operands -- lane t holds k = 2t, 2t+1 instead of t, t+4 -- so that a lane's B
//             elements are adjacent. Q is stored in "row pairs" (rows g and g+8 of a 16-row
//             tile interleaved element by element), so a lane's four A elements of a step are
//             adjacent and already in the instruction's register order: one 128-bit (float)
//             or two (double) loads, and no register copies (ptxas copies an A group before
//             every mma when its elements come from loads in another order). For O += P V the
//             permutation is the one the accumulator layout already has: the S accumulator's
//             columns 2t, 2t+1 of key tile j are the A operand's k = t, t+4, and V rows
//             8j + 2t, 8j + 2t + 1 are loaded as B's k = t, t+4. No shuffles.
// Template:   T (float or double); BiasT; HAS_MASK; HEAD_DIM, HEAD_DIM_V: head dims padded to
//             multiples of 32 (zero-filled); BLOCK_N keys per tile; NUM_WARPS; M_TILES;
//             MIN_BLOCKS (__launch_bounds__ blocks per SM); ALIGNED.
// Shared mem: (BLOCK_M/2 * QP2 + 2*BLOCK_N*(HEAD_DIM+8) + 2*BLOCK_N*(HEAD_DIM_V+V_PAD))
//             * sizeof(T), QP2 = 2*HEAD_DIM + (2 for double, 16 for float), V_PAD = 16 bytes
//             of T: Q pair rows, two stages of K and V. The pitches make the fragment loads
//             conflict-free: a quarter-warp's 128-bit Q loads (2 pair rows x 4 lanes) and K
//             loads (double: 2 rows x 4 lanes; float: 64-bit loads of 4 rows x 4 lanes per
//             half-warp) hit distinct banks, and HEAD_DIM_V+V_PAD puts V rows 2t, 2t+1 of the
//             B loads in distinct banks.
//             the layout: FwdMmaWideSmem (layouts.cuh, from cuattn/families/mma_wide.py).
#include "common/mma_softmax.cuh"
#include "common/mma_tiles.cuh"

using namespace cuattn;
using namespace cuattn::mma;

namespace {

// One m16n8k8 tensor-core step, d += a b, in the layout of the TF32 m16n8k8 instruction:
// A elements (a0, a1, a2, a3) = rows (g, g+8, g, g+8) and k = (t, t, t+4, t+4); B elements
// (b0, b1) = k (t, t+4); accumulators (rows g, g, g+8, g+8; columns 2t, 2t+1). Operands
// come through operand(), which rounds float to TF32 and passes double through.
__device__ __forceinline__ unsigned operand(float x) { return to_tf32(x); }
__device__ __forceinline__ double operand(double x) { return x; }

using cuattn::mma::mma_k8;  // the TF32 step (mma_tiles.cuh); the DMMA step follows
__device__ __forceinline__ void mma_k8(double (&d)[4], double a0, double a1, double a2,
                                       double a3, double b0, double b1) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
        : "d"(a0), "d"(a1), "d"(a2), "d"(a3), "d"(b0), "d"(b1));
#else
    // sm_80: four m8n8k4 steps (A (g, t), B (t, g), accumulators row g, columns 2t, 2t+1):
    // rows g and g+8, k halves t and t+4
    asm volatile(
        "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%4}, {%6}, {%0, %1};\n"
        "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%5}, {%7}, {%0, %1};\n"
        "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%2, %3}, {%8}, {%6}, {%2, %3};\n"
        "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%2, %3}, {%9}, {%7}, {%2, %3};\n"
        : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
        : "d"(a0), "d"(a2), "d"(b0), "d"(b1), "d"(a1), "d"(a3));
#endif
}

// N adjacent elements of T from shared memory (N even), in 8-byte (float) or 16-byte
// (double) vector loads.
template <typename T> struct Pair;
template <> struct Pair<float> { using type = float2; };
template <> struct Pair<double> { using type = double2; };
template <int N, typename T>
__device__ __forceinline__ void load_run(T (&r)[N], const T* p) {
#pragma unroll
    for (int c = 0; c < N; c += 2) {
        const auto v = *reinterpret_cast<const typename Pair<T>::type*>(p + c);
        r[c] = v.x;
        r[c + 1] = v.y;
    }
}

// One m16n8k8 step with operands in register order: a[2e + h] is row g + 8h and b[e]
// column g, both at the lane's e-th contraction index (e = 0, 1; the same k for both: which
// k that is does not matter as long as A and B agree). Operands that sit in this order in
// shared memory or in registers reach the instruction without copies: ptxas copies a DMMA
// A group for every instruction when its elements come from different loads.
template <typename T>
__device__ __forceinline__ void mma_step(T (&d)[4], const T (&a)[4], const T (&b)[2]) {
    mma_k8(d, operand(a[0]), operand(a[1]), operand(a[2]), operand(a[3]), operand(b[0]),
           operand(b[1]));
}

// Q in "row pairs": rows g and g + 8 of each 16-row tile interleaved element by element,
// pair row (tile, g) holding Q[16 tile + g][c] at 2c and Q[16 tile + g + 8][c] at 2c + 1,
// pitch QP2. A lane's A operand of one k8 step (rows g, g+8 at columns 2t, 2t+1) is then
// four adjacent elements in register order. Loaded once per block, by plain loads.
template <int ROWS, int COLS, int QP2, int THREADS, typename T>
__device__ __forceinline__ void load_q_pairs(T* dst, const T* src, long long row_stride,
                                             long long col_stride, long long nrows,
                                             long long ncols) {
    for (int idx = threadIdx.x; idx < ROWS * COLS; idx += THREADS) {
        const int r = idx / COLS, c = idx % COLS;
        const int pair_row = (r / 16) * 8 + r % 8, h = (r % 16) / 8;
        dst[pair_row * QP2 + 2 * c + h] =
            r < nrows && c < ncols ? src[r * row_stride + c * col_stride] : T(0);
    }
}

// S (M_TILES x 16 x BLOCK_N) = Q K^T for the warp's rows: A from the Q pair rows of tile i;
// B from K rows 8j + g (pitch KP). The lane's contraction indices in the step at k0 are
// k0 + 2t and k0 + 2t + 1, for A and B alike. Each K fragment feeds M_TILES steps.
template <int HEAD_DIM, int BLOCK_N, int M_TILES, int QP2, int KP, typename T>
__device__ __forceinline__ void scores_wide(T (&s)[M_TILES][BLOCK_N / 8][4], const T* q_w,
                                            const T* k_s, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int i = 0; i < M_TILES; ++i)
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[i][j][e] = T(0);
    const T* q_lane = q_w + g * QP2 + 4 * t;
    const T* k_lane = k_s + g * KP + 2 * t;
#pragma unroll(M_TILES == 1 ? 2 : 1)
    for (int k0 = 0; k0 < HEAD_DIM; k0 += 8) {
        T a[M_TILES][4];
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) load_run(a[i], q_lane + i * 8 * QP2 + 2 * k0);
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j) {
            T b[2];
            load_run(b, k_lane + 8 * j * KP + k0);
#pragma unroll
            for (int i = 0; i < M_TILES; ++i) mma_step(s[i][j], a[i], b);
        }
    }
}

// O (M_TILES x 16 x HEAD_DIM_V) += P V over the tile's keys, 8 per step. The lane's
// contraction indices in key tile j are keys 8j + 2t and 8j + 2t + 1: the S accumulator
// columns 2t, 2t+1 (A straight from registers), and B takes V rows of the same keys at
// column 8d + g. Each V fragment feeds M_TILES steps.
template <int BLOCK_N, int HEAD_DIM_V, int M_TILES, typename T>
__device__ __forceinline__ void accumulate_pv_wide(T (&acc)[M_TILES][HEAD_DIM_V / 8][4],
                                                   const T (&s)[M_TILES][BLOCK_N / 8][4],
                                                   const T* v_s, int lane) {
    constexpr int VP = HEAD_DIM_V + 16 / sizeof(T);
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j) {
        T a[M_TILES][4];  // register order: rows g, g+8 of key 2t, then of key 2t + 1
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
            a[i][0] = s[i][j][0];
            a[i][1] = s[i][j][2];
            a[i][2] = s[i][j][1];
            a[i][3] = s[i][j][3];
        }
        const T* v0 = v_s + (8 * j + 2 * t) * VP + g;
#pragma unroll
        for (int d = 0; d < HEAD_DIM_V / 8; ++d) {
            const T b[2] = {v0[8 * d], v0[VP + 8 * d]};
#pragma unroll
            for (int i = 0; i < M_TILES; ++i) mma_step(acc[i][d], a[i], b);
        }
    }
}

}  // namespace

template <typename T, typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N,
          int NUM_WARPS, int M_TILES, int MIN_BLOCKS, bool ALIGNED>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_BLOCKS)
    attention_fwd_mma_wide(const AttnParams p) {
    constexpr int THREADS = NUM_WARPS * 32, WARP_ROWS = 16 * M_TILES;
    constexpr int BLOCK_M = WARP_ROWS * NUM_WARPS, DV_TILES = HEAD_DIM_V / 8;
    // pitches: Q pair rows (module header), K rows, V rows
    constexpr int QP2 = 2 * HEAD_DIM + (sizeof(T) == 8 ? 2 : 16), KP = HEAD_DIM + 8;
    constexpr int VP = HEAD_DIM_V + 16 / sizeof(T);
    static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM_V % 32 == 0 && BLOCK_N % 8 == 0,
                  "head dims are padded to multiples of 32, key tiles to multiples of 8");
    constexpr int K_ELEMS = BLOCK_N * KP, V_ELEMS = BLOCK_N * VP;

    using L = FwdMmaWideSmem<T, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N>;
    static_assert(L::k_s == (long long)sizeof(T) * (BLOCK_M / 2 * QP2) &&
                      L::v_s - L::k_s == (long long)sizeof(T) * 2 * BLOCK_N * KP &&
                      L::BYTES - L::v_s == (long long)sizeof(T) * 2 * BLOCK_N * VP,
                  "the pitches are the layout's");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw + L::q_s);  // [BLOCK_M / 2][QP2]
    T* k_s = reinterpret_cast<T*>(smem_raw + L::k_s);  // [2][BLOCK_N][KP]
    T* v_s = reinterpret_cast<T*>(smem_raw + L::v_s);  // [2][BLOCK_N][VP]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // this block's rows and batch entry, heaviest query blocks first (common.cuh)
    const ForwardBlock<T, BiasT> blk = forward_block<T, BiasT>(p, BLOCK_M);
    const long long b = blk.b, m0 = blk.m0;
    const T *q = blk.q, *k = blk.k, *v = blk.v;
    const unsigned char* mask = blk.mask;
    const BiasT* bias = blk.bias;

    // key tiles that the causal/window band reaches from rows m0 .. m_last
    const long long off = p.seqlen_k - p.seqlen_q;
    const long long m_last = min(m0 + BLOCK_M, p.seqlen_q) - 1;
    const Range keys = key_band(p, m0, m_last, BLOCK_N);
    const long long n_lo = keys.lo, n_hi = keys.hi;

    auto request_kv = [&](long long n0, int stage) {
        load_tile<BLOCK_N, HEAD_DIM, THREADS, ALIGNED>(k_s + stage * K_ELEMS, k + n0 * p.k_s.row,
                                                       p.k_s.row, p.k_s.col, p.seqlen_k - n0,
                                                       p.head_dim, Pitched<KP>());
        load_tile<BLOCK_N, HEAD_DIM_V, THREADS, ALIGNED>(v_s + stage * V_ELEMS, v + n0 * p.v_s.row,
                                                         p.v_s.row, p.v_s.col, p.seqlen_k - n0,
                                                         p.head_dim_v, Pitched<VP>());
    };
    load_q_pairs<BLOCK_M, HEAD_DIM, QP2, THREADS>(q_s, q, p.q_s.row, p.q_s.col, p.seqlen_q - m0,
                                                  p.head_dim);
    if (n_lo < n_hi) request_kv(n_lo, 0);
    cp_async_commit();

    T acc[M_TILES][DV_TILES][4], m[M_TILES][2], l[M_TILES][2];
#pragma unroll
    for (int i = 0; i < M_TILES; ++i) {
        m[i][0] = m[i][1] = neg_inf<T>();
        l[i][0] = l[i][1] = T(0);
#pragma unroll
        for (int d = 0; d < DV_TILES; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][d][e] = T(0);
    }
    const T* q_w = q_s + warp * WARP_ROWS / 2 * QP2;
    const SoftmaxExp2<T> exp2_fn(lane);

    int stage = 0;
    for (long long n0 = n_lo; n0 < n_hi; n0 += BLOCK_N, stage ^= 1) {
        if (n0 + BLOCK_N < n_hi) request_kv(n0 + BLOCK_N, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();  // all but the group just issued have landed ...
        __syncthreads();     // ... for every thread: Q (first time), this tile's K and V
        T s[M_TILES][BLOCK_N / 8][4];
        scores_wide<HEAD_DIM, BLOCK_N, M_TILES, QP2, KP>(s, q_w, k_s + stage * K_ELEMS, lane);
        const bool interior = !HAS_MASK && n0 + BLOCK_N <= p.seqlen_k && m0 + BLOCK_M <= p.seqlen_q &&
                              (p.window_left < 0 || n0 >= m_last + off - p.window_left) &&
                              (p.window_right < 0 || n0 + BLOCK_N - 1 <= m0 + off + p.window_right);
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
            const T scale = mask_scores<BLOCK_N, HAS_MASK>(s[i], p, m0 + warp * WARP_ROWS + 16 * i,
                                                           n0, lane, interior, mask, bias);
            update_row_state<BLOCK_N, DV_TILES>(s[i], m[i], l[i], acc[i], scale, exp2_fn);
        }
        accumulate_pv_wide<BLOCK_N, HEAD_DIM_V, M_TILES>(acc, s, v_s + stage * V_ELEMS, lane);
        __syncthreads();  // this stage is consumed before the next iteration refills it
    }
    cp_async_wait<0>();  // no copy may outlive the block

    // Normalise and store; a row with no allowed key gives out 0 and lse -inf.
    T* out = reinterpret_cast<T*>(p.out) + batch_offset(p.out_s, b, p.batch1, p.batch2);
#pragma unroll
    for (int i = 0; i < M_TILES; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            T row_l = l[i][h];
            row_l += __shfl_xor_sync(0xffffffffu, row_l, 1);  // the quad's partial row sums
            row_l += __shfl_xor_sync(0xffffffffu, row_l, 2);
            const long long r = m0 + warp * WARP_ROWS + 16 * i + lane / 4 + 8 * h;
            if (r >= p.seqlen_q) continue;  // rows past the end of a partial tile
            const T inv_l = row_l == T(0) ? T(0) : T(1) / row_l;
            T* out_row = out + r * p.out_s.row;
#pragma unroll
            for (int d = 0; d < DV_TILES; ++d) {
                const long long c = 8 * d + 2 * (lane % 4);
                if (c < p.head_dim_v) out_row[c * p.out_s.col] = acc[i][d][2 * h] * inv_l;
                if (c + 1 < p.head_dim_v)
                    out_row[(c + 1) * p.out_s.col] = acc[i][d][2 * h + 1] * inv_l;
            }
            if (p.lse && lane % 4 == 0) {
                T* lse = reinterpret_cast<T*>(p.lse) + batch_offset(p.lse_s, b, p.batch1, p.batch2);
                lse[r * p.lse_s.row] =
                    row_l == T(0) ? neg_inf<T>() : m[i][h] * T(LN2) + log_acc(row_l);
            }
        }
}
