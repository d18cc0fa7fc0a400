// attention_sm90.cu -- tensor-core attention forward for float16 / bfloat16 on Hopper
// (sm_90a: wgmma).
//
// Computes:   the same function as attention_mma.cu (reference
//             cuattn/reference.py::attention_reference), with the same score transform and
//             online softmax (mma_softmax.cuh): the accumulators of a warpgroup MMA have the
//             m16n8 layout of mma.sync in each of its four warps.
// Layout:     as attention_mma.cu: AttnParams (common.cuh) with element strides; ALIGNED
//             instances need unit column strides, 16-byte aligned rows and D, Dv multiples
//             of 8 (checked in Python); the others load element by element.
// Ownership:  a block of NUM_WG warpgroups owns BLOCK_M = 64 * NUM_WG query rows of one
//             batch entry and all Dv columns; warpgroup w owns rows 64w .. 64w + 63 and its
//             warp v rows 64w + 16v .. + 15 of every accumulator tile.
// Algorithm:  K and V tiles of BLOCK_N keys arrive by cp.async STAGES - 1 tiles ahead into a
//             ring of STAGES stages (two: as attention_mma.cu; more for short loops, whose
//             few tiles would otherwise each wait for their copy); per tile: S = Q K^T by HEAD_DIM / 16 wgmma
//             steps with Q and K in shared memory; score transform and online softmax in
//             registers; P converted to T in registers and used as the A operand of
//             O += P V (HEAD_DIM_V = N of the instruction, V through a transposed
//             descriptor). At head dims up to 64, a last tile of at most TAIL_N = 16 keys
//             runs as a 16-key tile.
// Shared mem: (BLOCK_M*HEAD_DIM + STAGES*BLOCK_N*(HEAD_DIM + HEAD_DIM_V)) * sizeof(T),
//             every tile in the canonical 128-byte-swizzle layout of wgmma: 64-column
//             groups stored one after another, each group's rows 128 bytes apart with
//             16-byte chunk c of row r at chunk c ^ (r % 8); tiles start 1024-byte aligned.
//             the layout: FwdSm90Smem (layouts.cuh, from cuattn/families/sm90.py).
// Template:   T; BiasT; HAS_MASK; HEAD_DIM, HEAD_DIM_V (64 or 128, zero-padded); BLOCK_N (64
//             or 128); NUM_WG; STAGES (2 to 4); ALIGNED; MIN_BLOCKS; RAGGED (a dense call,
//             packed sequences or key lengths: sequence_unit, common.cuh).
#include "common/mma_softmax.cuh"
#include "sm90/pipeline.cuh"

using namespace cuattn;
using namespace cuattn::mma;
using namespace cuattn::sm90;

namespace {
template <int N> struct Keys {  // a key-tile width as a type, for the generic tile lambda
    static constexpr int value = N;
};
constexpr int TAIL_N = 16;  // the width of a short last key tile
}  // namespace

template <typename T, typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N,
          int NUM_WG, int STAGES, bool ALIGNED, int MIN_BLOCKS, int RAGGED = DENSE>
__global__ void __launch_bounds__(NUM_WG * 128, MIN_BLOCKS)
    attention_fwd_sm90(const AttnParams params) {
    constexpr int THREADS = NUM_WG * 128, BLOCK_M = 64 * NUM_WG, DV_TILES = HEAD_DIM_V / 8;
    static_assert((HEAD_DIM == 64 || HEAD_DIM == 128) && (HEAD_DIM_V == 64 || HEAD_DIM_V == 128) &&
                      (BLOCK_N == 64 || BLOCK_N == 128),
                  "wgmma shapes of wgmma.cuh");
    static_assert(STAGES >= 2 && STAGES <= 4, "cp_async_wait takes STAGES - 1");
    constexpr int Q_ELEMS = 64 * HEAD_DIM, K_ELEMS = BLOCK_N * HEAD_DIM, V_ELEMS = BLOCK_N * HEAD_DIM_V;
    // the mask and bias tiles of a key tile, staged with its K and V (mma_tiles.cuh)
    using Side = SideTiles<BiasT, HAS_MASK, BLOCK_M, BLOCK_N, STAGES, THREADS, false>;

    using L = FwdSm90Smem<T, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, STAGES, HAS_MASK,
                          Side::BIAS_SIZE>;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw + L::q_s);  // [NUM_WG][64 x HEAD_DIM]
    T* k_s = reinterpret_cast<T*>(smem_raw + L::k_s);  // [STAGES][BLOCK_N x HEAD_DIM]
    T* v_s = reinterpret_cast<T*>(smem_raw + L::v_s);  // [STAGES][BLOCK_N x HEAD_DIM_V]
    unsigned char* side_s = smem_raw + L::side_s;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
    // a packed call's or key lengths' block: its sequence as a dense call (common.cuh)
    const SequenceUnit su = sequence_unit<RAGGED, T, float>(params, blockIdx.x, gridDim.x);
    const AttnParams& p = RAGGED != DENSE ? su.p : params;
    // this block's rows and batch entry, heaviest query blocks first (common.cuh)
    const ForwardBlock<T, BiasT> blk = forward_block_of<RAGGED, T, BiasT>(p, su, BLOCK_M);
    const long long b = blk.b, m0 = blk.m0;
    const T *q = blk.q, *k = blk.k, *v = blk.v;
    const unsigned char* mask = blk.mask;
    const BiasT* bias = blk.bias;
    const Side side(side_s, mask, bias, p);

    // sequence positions fit in 32 bits (checked in Python)
    const int seqlen_q = (int)p.seqlen_q, seqlen_k = (int)p.seqlen_k;
    const int off = seqlen_k - seqlen_q;
    const int m_last = min((int)m0 + BLOCK_M, seqlen_q) - 1;
    const Range keys = key_band(p, m0, m_last, BLOCK_N);
    const int n_lo = (int)keys.lo, n_hi = (int)keys.hi;

    auto request_kv = [&](int n0, int stage) {
        load_kv_tiles<BLOCK_N, HEAD_DIM, HEAD_DIM_V, THREADS, ALIGNED, RAGGED>(
            k_s + stage * K_ELEMS, v_s + stage * V_ELEMS, k, v, n0, p, Sw128<BLOCK_N>(),
            Sw128<BLOCK_N>(), b);
        side.request(stage, m0, n0);
    };
    // each warpgroup's 64 rows of Q form one 64-row tile
#pragma unroll
    for (int w = 0; w < NUM_WG; ++w)
        load_tile<64, HEAD_DIM, THREADS, ALIGNED>(q_s + w * Q_ELEMS, q + w * 64 * p.q_s.row,
                                                  p.q_s.row, p.q_s.col, p.seqlen_q - m0 - w * 64,
                                                  p.head_dim, Sw128<64>());
    // Q and the first STAGES - 1 tiles, one group each (Q with the first)
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
        if (n_lo + t * BLOCK_N < n_hi) request_kv(n_lo + t * BLOCK_N, t);
        cp_async_commit();
    }

    float acc[DV_TILES][4], m[2], l[2];
    clear_row_state(acc, m, l);
    const SoftmaxExp2<float> exp2_fn(lane);

    const unsigned q_base = smem_addr(q_s + wg * Q_ELEMS), k_base = smem_addr(k_s),
                   v_base = smem_addr(v_s);
    const int row0 = (int)m0 + 64 * wg + 16 * (warp % 4);  // first row of this warp's tile

    // One key tile of N keys (the first N rows of the stage's BLOCK_N-row K and V tiles),
    // once its copies have landed: S = Q K^T, both operands K-contiguous in shared memory;
    // score transform and online softmax; O += P V with P from registers (the A fragments
    // of the warp's rows) and V read N-contiguous through a transposed descriptor. N =
    // BLOCK_N, or TAIL_N for a last tile of at most TAIL_N keys (a sequence of 64j + 1 ..
    // 64j + 16 keys, such as ViT's 197, would otherwise spend a whole tile's products and
    // softmax on a few keys).
    auto tile = [&](int n0, int stage, auto n_keys) {
        constexpr int N = decltype(n_keys)::value;
        const int ahead = n0 + (STAGES - 1) * BLOCK_N;  // into the stage consumed last
        if (ahead < n_hi) request_kv(ahead, (stage + STAGES - 1) % STAGES);
        cp_async_commit();
        cp_async_wait<STAGES - 1>();  // all but the groups of later tiles have landed ...
        fence_proxy_async();  // ... are visible to the tensor cores ...
        __syncthreads();      // ... for every thread: Q (first time), this tile's K and V

        float s[N / 8][4];
        wgmma_fence();
        product_ss<N, HEAD_DIM, T, BLOCK_N>(s, q_base, k_base + stage * K_ELEMS * 2);
        wgmma_commit();
        wgmma_wait<0>();

        const bool interior = !HAS_MASK && forward_tile_interior<BLOCK_M, N>(
                                               p, m0, m_last, n0, seqlen_q, seqlen_k, off);
        const float scale =
            side.staged ? mask_scores<N, HAS_MASK, BiasT>(s, p, row0, n0, lane, interior,
                                                          side.mask_view(stage, m0, n0),
                                                          side.bias_view(stage, m0, n0))
                        : mask_scores<N, HAS_MASK>(s, p, row0, n0, lane, interior, mask, bias);
        update_row_state<N, DV_TILES>(s, m, l, acc, scale, exp2_fn);

        product_rs<HEAD_DIM_V, N, T, BLOCK_N>(acc, s, v_base + stage * V_ELEMS * 2);
        wgmma_commit();
        wgmma_wait<0>();
        __syncthreads();  // this stage is consumed before the next iteration refills it
    };

    // the last tile starts at n_last; it runs as a TAIL_N-key tile when that covers it.
    // Head dims up to 64 only: at 128 the second copy of the tile costs the causal D128
    // S4096 rows 7 % (register allocation of the masked path)
    constexpr bool TAIL = HEAD_DIM <= 64 && HEAD_DIM_V <= 64;
    const int n_last = n_lo + (n_hi - n_lo - 1) / BLOCK_N * BLOCK_N;
    const bool short_last = TAIL && n_lo < n_hi && n_hi - n_last <= TAIL_N;
    const int n_full = short_last ? n_last : n_hi;
    int stage = 0;
    for (int n0 = n_lo; n0 < n_full; n0 += BLOCK_N, stage = (stage + 1) % STAGES)
        tile(n0, stage, Keys<BLOCK_N>());
    if constexpr (TAIL)
        if (short_last) tile(n_last, stage, Keys<TAIL_N>());
    cp_async_wait<0>();  // no copy may outlive the block

    store_rows<T, DV_TILES>(acc, l, m, p, b, row0, lane);  // normalise and store (mma_softmax.cuh)
}

// ---------------------------------------------------------------------------------------
// The piped instance: the same function with the tiles brought by the copy engine
// (pipeline.cuh). Block: NUM_WG = 2 consumer warpgroups (64 query rows each: the products
// and the softmax, BLOCK_M = 128) and one producer warpgroup, whose first lane copies Q once
// and each key tile's K and V into STAGES slots by bulk tensor copies (TMA, 128-byte
// swizzle: the layout above), with zeros past the sequences and head dims. Per key tile t a
// consumer warpgroup issues O += P(t-1) V(t-1) and S(t) = Q K(t)^T together, releases slot
// t - 1 once the first is done, then runs the softmax of tile t while the other warpgroup
// issues (pingpong_tiles: FlashAttention-3's schedule). With STAGE_SIDE, the producer
// warpgroup's threads also copy each key tile's mask and bias tiles into its slot
// (cp.async, SideTiles: where their strides allow) and arrive on the slot's barrier once
// they have landed; otherwise the softmax reads them from global memory. Python takes this
// instance where the tensor maps exist: q, k and v with unit column strides and 16-byte
// aligned starts and strides (_tma.py).
// RAGGED: under PACKED the maps span the packed sequences, and a block's boxes start at its
// sequence's rows; a box past a sequence's end (or past a key length) holds other rows, which
// count as keys past the end (masked) and as query rows past the end (never stored). Under
// PAGED the maps of k and v span the pools: rows within a page, and the page along the batch
// axis that page_axis names (one the call's k and v do not walk); a key tile's box is at its
// page's row (key_page, common.cuh).

// The piped instance's parameter block: the forward's, and the tensor maps of q, k and v
// (rank 5: head dim, sequence, batch axes 2, 1, 0 of AttnParams; a broadcast axis has
// extent 1; boxes of 64 columns x 64 rows for q, x BLOCK_N rows for k and v), and the
// call's work units (query blocks x batch entries: the grid of a block per unit; a
// persistent grid takes them in turn), and under PAGED the map dimension of the pages in the
// maps of k and v (2, 3 or 4: batch axis 2, 1 or 0). cuattn/_params.py reads it from here.
struct FwdTmaParams {
    AttnParams p;
    long long units, page_axis;
    TensorMap q_map, k_map, v_map;
};

namespace {
// The coordinates of batch entry b along the three batch axes, for a tensor whose strides s
// say which axes it walks (zero: broadcast, the map's extent 1 there).
struct BatchCoords {
    int c2, c1, c0;
    __device__ __forceinline__ BatchCoords(const Strides& s, long long b, long long batch1,
                                           long long batch2) {
        const long long b01 = b / batch2;
        c2 = s.b2 ? (int)(b % batch2) : 0;
        c1 = s.b1 ? (int)(b01 % batch1) : 0;
        c0 = s.b0 ? (int)(b01 / batch1) : 0;
    }
};
}  // namespace

template <typename T, typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N,
          int STAGES, bool STAGE_SIDE = true, bool OVERLAP = false, bool PERSISTENT = false,
          int RAGGED = DENSE>
__global__ void __launch_bounds__(3 * 128, 1)
    attention_fwd_sm90_piped(const __grid_constant__ FwdTmaParams w) {
    constexpr int NUM_WG = 2, BLOCK_M = 64 * NUM_WG, DV_TILES = HEAD_DIM_V / 8;
    static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 256 && HEAD_DIM_V % 64 == 0 &&
                      HEAD_DIM_V <= 256 && (BLOCK_N == 64 || BLOCK_N == 128),
                  "wgmma shapes of wgmma.cuh (P V in 128-column products)");
    // the mask and bias tiles of each slot, copied by the producer warpgroup's threads
    constexpr bool SIDE = STAGE_SIDE && (HAS_MASK || !is_same_v<BiasT, NoBias>);
    using Side = SideTiles<BiasT, HAS_MASK, BLOCK_M, BLOCK_N, STAGES, 128, false>;
    // registers per thread: the producer keeps 24 (40 where it also copies the mask and
    // bias tiles, or a ragged call's last V tile), the consumers take the rest of the
    // block's allocation at launch (384 threads x 168)
    constexpr bool RAGGED_KEYS = RAGGED != DENSE;  // keys end before the maps' rows do
    // the producer warpgroup's named barrier (the consumers' turns take 1 .. NUM_WG)
    constexpr int PRODUCER_BAR = NUM_WG + 1;
    constexpr int PRODUCER_REGS = SIDE || RAGGED_KEYS ? 40 : 24,
                  CONSUMER_REGS = SIDE || RAGGED_KEYS ? 232 : 240;
    static_assert(NUM_WG * 128 * CONSUMER_REGS + 128 * PRODUCER_REGS <= 65536,
                  "register budgets");
    constexpr int Q_ELEMS = 64 * HEAD_DIM, K_ELEMS = BLOCK_N * HEAD_DIM;
    constexpr unsigned Q_BYTES = NUM_WG * Q_ELEMS * sizeof(T), K_BYTES = K_ELEMS * sizeof(T),
                       SLOT_BYTES = BLOCK_N * (HEAD_DIM + HEAD_DIM_V) * sizeof(T);
    static_assert(!(RAGGED_KEYS && PERSISTENT), "a ragged call has a block per work unit");
    // a packed call's or key lengths' block: its sequence as a dense call, whose rows start
    // at su.q_row0 and su.k_row0 of the tensor maps (common.cuh)
    const SequenceUnit su = sequence_unit<RAGGED, T, float>(w.p, blockIdx.x, gridDim.x);
    const AttnParams& p = RAGGED != DENSE ? su.p : w.p;

    using L = FwdSm90TmaSmem<T, HEAD_DIM, HEAD_DIM_V, NUM_WG, BLOCK_N, STAGES, HAS_MASK && SIDE,
                             SIDE ? (int)Side::BIAS_SIZE : 0>;
    static_assert(L::side_s - L::slots == (long long)STAGES * SLOT_BYTES, "a slot's bytes");
    static_assert(L::full - L::q_full == 8 && L::empty - L::full == 8 * STAGES &&
                      L::q_empty - L::empty == 8 * STAGES, "barriers");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned q_s = smem_addr(smem_raw + L::q_s),  // [NUM_WG][64 x HEAD_DIM]
                   slots = smem_addr(smem_raw + L::slots),  // [STAGES][K, V tiles]
                   q_full = smem_addr(smem_raw + L::q_full),
                   full = smem_addr(smem_raw + L::full),  // [STAGES] barriers each
                   empty = smem_addr(smem_raw + L::empty),
                   q_empty = smem_addr(smem_raw + L::q_empty);  // PERSISTENT: Q read

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
    // the block's work units: its own (one per block), or every gridDim.x-th from its index
    // (PERSISTENT), each of 128 query rows of one batch entry. Each unit's key tiles continue
    // the ring of slots (`ring`: the tiles of the block's earlier units) and its Q takes the
    // next phase of q_full, refilled once the consumers are done with the last one (q_empty).
    const unsigned units = PERSISTENT ? (unsigned)w.units : gridDim.x;
    const bool staged = SIDE && Side::staged_for(p);  // the same for every block of the call
    struct Unit {
        ForwardBlock<T, BiasT> blk;
        int m_last, n_lo, tiles;
    };
    auto unit_at = [&](unsigned u) {
        const ForwardBlock<T, BiasT> blk =
            RAGGED_KEYS ? forward_block_of<RAGGED, T, BiasT>(p, su, BLOCK_M)
                        : forward_block_at<T, BiasT>(p, BLOCK_M, u, units);
        const int m_last = min((int)blk.m0 + BLOCK_M, (int)p.seqlen_q) - 1;
        const Range keys = key_band(p, blk.m0, m_last, BLOCK_N);
        const int n_lo = (int)keys.lo, n_hi = (int)keys.hi;
        return Unit{blk, m_last, n_lo, n_lo < n_hi ? (n_hi - n_lo + BLOCK_N - 1) / BLOCK_N : 0};
    };

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        mbar_init(q_empty, NUM_WG * 4);  // a lane of each consumer warp
        // a slot is full with the copy engine's bytes, and the staged tiles of every
        // producer thread (RAGGED: or their part of a last V tile)
        init_slot_barriers<STAGES>(full, empty, NUM_WG * 4, staged || RAGGED_KEYS ? 1 + 128 : 1);
        fence_mbar_init();
    }
    __syncthreads();  // the barriers ready for everyone: the copies start now

    if (wg == NUM_WG) {  // the producer warpgroup: its registers go to the consumers
        setmaxnreg_dec<PRODUCER_REGS>();
        const int tid = threadIdx.x - NUM_WG * 128;
        const bool copier = tid == 0;  // the lane that issues the bulk tensor copies
        // RAGGED: the other producer threads copy a last V tile that reaches past the keys'
        // end with the copier, and only that tile (unless they stage every tile's mask and
        // bias tiles, and copy it with them)
        const bool tail_only = RAGGED_KEYS && !staged && !copier;
        if (!copier && !staged && !tail_only) return;
        if (copier) {
            prefetch_tensor_map(&w.q_map);
            prefetch_tensor_map(&w.k_map);
            prefetch_tensor_map(&w.v_map);
        }
        // one work unit (the n-th of the block, after `ring` tiles); returns its tiles
        auto produce = [&](unsigned u, int n, int ring) {
            const Unit un = unit_at(u);
            const long long b = un.blk.b, m0 = un.blk.m0;
            const BatchCoords kb(p.k_s, b, p.batch1, p.batch2), vb(p.v_s, b, p.batch1, p.batch2);
            auto load_q = [&] {
                if (!copier) return;
                const BatchCoords qb(p.q_s, b, p.batch1, p.batch2);
                if (PERSISTENT && n > 0) mbar_wait(q_empty, (n - 1) & 1);
                mbar_expect_tx(q_full, Q_BYTES);
#pragma unroll
                for (int r = 0; r < NUM_WG; ++r)
#pragma unroll
                    for (int g = 0; g < HEAD_DIM / 64; ++g)
                        tma_load(q_s + (r * Q_ELEMS + g * 64 * 64) * sizeof(T), &w.q_map,
                                 64 * g, su.q_row0 + (int)m0 + 64 * r, qb.c2, qb.c1, qb.c0,
                                 q_full);
            };
            const Side side(smem_raw + L::side_s, un.blk.mask, un.blk.bias, p);
            auto fill = [&](int t, int s, unsigned bar) {
                const int n0 = un.n_lo + t * BLOCK_N;
                const KeyPage kp = tile_page<RAGGED>(p, b, n0);  // PAGED: the tile's page
                // RAGGED: V rows past the sequence's end would be the next sequence's (or
                // rows past a key length), and P V multiplies them by 0 (an inf or NaN there
                // would spread): that tile's V is copied by the warpgroup's threads instead,
                // zero past the end
                const bool v_by_threads = RAGGED_KEYS && n0 + BLOCK_N > p.seqlen_k;
                if (copier) {
                    mbar_expect_tx(bar, v_by_threads ? K_BYTES : SLOT_BYTES);
                    // the arrivals of every producer thread, where they copy nothing
                    if (RAGGED_KEYS && !staged && !v_by_threads) mbar_arrive_count(bar, 128);
                    const unsigned k_dst = slots + s * SLOT_BYTES, v_dst = k_dst + K_BYTES;
                    // PAGED: the tile's row in its page, and the page on the maps' page
                    // axis, which k and v do not walk (their coordinate there is 0)
                    int row = su.k_row0 + n0, page2 = 0, page1 = 0, page0 = 0;
                    if constexpr (RAGGED == PAGED) {
                        row = kp.row;
                        page2 = w.page_axis == 2 ? kp.page : 0;
                        page1 = w.page_axis == 3 ? kp.page : 0;
                        page0 = w.page_axis == 4 ? kp.page : 0;
                    }
#pragma unroll
                    for (int g = 0; g < HEAD_DIM / 64; ++g)
                        tma_load(k_dst + g * BLOCK_N * 128, &w.k_map, 64 * g, row, kb.c2 + page2,
                                 kb.c1 + page1, kb.c0 + page0, bar);
                    if (!v_by_threads)
#pragma unroll
                        for (int g = 0; g < HEAD_DIM_V / 64; ++g)
                            tma_load(v_dst + g * BLOCK_N * 128, &w.v_map, 64 * g, row,
                                     vb.c2 + page2, vb.c1 + page1, vb.c0 + page0, bar);
                }
                // the copier comes here once the slot is free (produce_tiles waited for
                // it): the other producer threads wait for it at a named barrier
                if (v_by_threads) {
                    bar_sync(PRODUCER_BAR, 128);
                    load_tile<BLOCK_N, HEAD_DIM_V, 128, true>(
                        reinterpret_cast<T*>(smem_raw + L::slots + s * SLOT_BYTES + K_BYTES),
                        key_rows<RAGGED>(un.blk.v, n0, kp, p.v_s.row, p.v_page), p.v_s.row,
                        p.v_s.col, p.seqlen_k - n0, p.head_dim_v, Sw128<BLOCK_N>(), tid);
                }
                if (staged) side.request(s, m0, n0, tid);
                if (staged || v_by_threads) cp_async_arrive(bar);
            };
            if (tail_only) {  // the last tile alone, where its V reaches past the keys' end
                // its slot is free when the copier reaches it (fill's named barrier): a
                // parity wait here could take an earlier phase of the slot for its own
                const int t = un.tiles - 1, g = ring + t;  // its fill in produce_tiles
                if (t < 0 || un.n_lo + t * BLOCK_N + BLOCK_N <= p.seqlen_k) return 0;
                fill(t, g % STAGES, full + 8 * (g % STAGES));
                return 0;
            }
            // PERSISTENT: the unit's first tiles while the consumers finish the last unit
            // (their slots' releases need no Q), then its Q once they are done with the last
            const int ahead = PERSISTENT ? min(STAGES, un.tiles) : 0;
            produce_tiles<STAGES>(ahead, full, empty, fill, ring);
            load_q();
            produce_tiles<STAGES>(un.tiles - ahead, full, empty,
                                  [&](int t, int s, unsigned bar) { fill(ahead + t, s, bar); },
                                  ring + ahead);
            return un.tiles;
        };
        for_each_unit<PERSISTENT>(units, produce);
        if (staged || tail_only) cp_async_wait_all();  // no copy outlives its thread
        return;
    }
    setmaxnreg_inc<CONSUMER_REGS>();

    float acc[DV_TILES][4], m[2], l[2];
    const SoftmaxExp2<float> exp2_fn(lane);
    const unsigned q_base = q_s + wg * Q_ELEMS * sizeof(T);
    unsigned p_frag[BLOCK_N / 16][4];  // P of the previous tile (the A operand of its P V)
    float sc[BLOCK_N / 8][4];
    float alpha[2];
    bool rescale = false;
    // one work unit (the n-th of the block, after `ring` tiles); returns its tiles
    auto consume = [&](unsigned u, int n, int ring) {
        const Unit un = unit_at(u);
        const ForwardBlock<T, BiasT>& blk = un.blk;
        const long long b = blk.b, m0 = blk.m0;
        const int seqlen_q = (int)p.seqlen_q, seqlen_k = (int)p.seqlen_k;
        const int off = seqlen_k - seqlen_q, m_last = un.m_last, n_lo = un.n_lo;
        const Side side(smem_raw + L::side_s, blk.mask, blk.bias, p);
        const int row0 = (int)m0 + 64 * wg + 16 * (warp % 4);  // first row of this warp's tile
        const Turns turns(wg, NUM_WG, un.tiles);                // ping-pong (pipeline.cuh)
        clear_row_state(acc, m, l);
        mbar_wait(q_full, n & 1);

        auto slot = [&](int t) { return slots + ((ring + t) % STAGES) * SLOT_BYTES; };
        auto issue_s = [&](int t) {
            wgmma_fence();
            product_ss<BLOCK_N, HEAD_DIM, T>(sc, q_base, slot(t));
        };
        auto issue_pv = [&](int t) {  // O += P(t) V(t)
            // a V tile copied by threads (RAGGED) to the tensor cores' proxy
            if (RAGGED_KEYS && n_lo + (t + 1) * BLOCK_N > seqlen_k) fence_proxy_async();
            product_ra_wide<HEAD_DIM_V, BLOCK_N, T>(acc, p_frag, slot(t) + K_BYTES);
        };
        auto release = [&](int t) {  // every product and read on slot t is done
            if constexpr (SIDE) __syncwarp();  // the warp's reads of the staged tiles, too
            if (lane == 0) mbar_arrive(empty + 8 * ((ring + t) % STAGES));
        };
        auto stats = [&](int t) {  // of S(t): scores, row max and sum, P(t) in place (sc)
            const int n0 = n_lo + t * BLOCK_N;
            const bool interior = !HAS_MASK && forward_tile_interior<BLOCK_M, BLOCK_N>(
                                                   p, m0, m_last, n0, seqlen_q, seqlen_k, off);
            const int st = (ring + t) % STAGES;
            const float scale =
                staged ? mask_scores<BLOCK_N, HAS_MASK, BiasT>(sc, p, row0, n0, lane, interior,
                                                               side.mask_view(st, m0, n0),
                                                               side.bias_view(st, m0, n0))
                       : mask_scores<BLOCK_N, HAS_MASK>(sc, p, row0, n0, lane, interior,
                                                        blk.mask, blk.bias);
            rescale = update_row_stats<BLOCK_N>(sc, m, l, alpha, scale, exp2_fn);
        };
        auto apply = [&](int) {  // O's rescale, and P(t) into the A fragments
            if (rescale) rescale_rows(acc, alpha);
            pack_a<BLOCK_N, T>(p_frag, sc);
        };
        pingpong_tiles<NUM_WG, STAGES, OVERLAP>(un.tiles, full, turns.mine, turns.next, wg,
                                                issue_s, issue_pv, release, stats, apply, ring);
        // Q is read by the S products alone, all done: the producer may refill it while
        // this unit's rows are stored
        if (PERSISTENT && lane == 0) mbar_arrive(q_empty);
        store_rows<T, DV_TILES>(acc, l, m, p, b, row0, lane);  // normalise and store
        return un.tiles;
    };
    for_each_unit<PERSISTENT>(units, consume);
}
