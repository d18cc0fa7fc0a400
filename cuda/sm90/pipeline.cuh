// pipeline.cuh -- the warp-specialised skeleton of the piped Hopper forwards
// (attention_fwd_sm90_piped, 16-bit; attention_fwd_sm90_tf32_piped, TF32): a producer
// warpgroup whose first lane fills a ring of tile slots by the copy engine, and consumer
// warpgroups that only compute, taking turns to issue their products.
//
//   TensorMap, tma_load  a bulk tensor copy (TMA) of one box through a tensor map that the
//               host encodes (cuTensorMapEncodeTiled; cuattn/_tma.py)
//   produce_tiles  the producer's loop: slot t % STAGES refilled once its consumers release it
//   pingpong_tiles  a consumer warpgroup's loop over the key tiles (the schedule below)
#pragma once

#include "sm90/sm90_tiles.cuh"

namespace cuattn {
namespace sm90 {

// A tensor map (CUtensorMap): 128 opaque bytes, encoded on the host, passed in the kernel's
// __grid_constant__ parameter block (cuattn/_params.py gives it 64-byte alignment there).
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

// The box at coordinates (c0 innermost .. c4) of a rank-5 tensor map into shared `dst`
// (1024-byte aligned for the 128-byte swizzle), counted on barrier `bar` when it has landed.
// Elements outside the tensor arrive as zeros and count all the same.
__device__ __forceinline__ void tma_load(unsigned dst, const TensorMap* map, int c0, int c1, int c2,
                                         int c3, int c4, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
        "r"(c4), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map))
                 : "memory");
}

// The producer's loop over `tiles` key tiles: tile t is the ring's tile g = first + t (first:
// the tiles of a persistent block's earlier work units) and goes to slot s = g % STAGES once
// the consumers have released the tile the slot held (its `empty` barrier, STAGES tiles
// back); fill(t, s, bar) announces the slot's bytes on `bar` (mbar_expect_tx) and issues its
// copies.
template <int STAGES, typename Fill>
__device__ __forceinline__ void produce_tiles(int tiles, unsigned full, unsigned empty,
                                              const Fill& fill, int first = 0) {
    for (int t = 0; t < tiles; ++t) {
        const int g = first + t, s = g % STAGES;
        if (g >= STAGES) mbar_wait(empty + 8 * s, (g / STAGES - 1) & 1);
        fill(t, s, full + 8 * s);
    }
}

// A consumer warpgroup's turns over the key tiles: S(0); then P V(t - 1) with S(t); then
// the last P V; it issues in its turn of the ring of named barriers (my_turn, then
// next_turn granted) and runs each tile's softmax while the others issue: `stats` (scores,
// row max and sum, P in place), then `apply` (the accumulators' rescale, P into the A
// fragments of the next P V). Every wgmma is issued outside a branch (ptxas serializes the
// ones it finds in divergent paths).
// OVERLAP: its own products run under its softmax as well (FlashAttention-3's
// intra-warpgroup overlap): S(t) is issued before P V(t - 1), stats(t) runs once S(t) is
// done while P V(t - 1) still runs, and slot t - 1 is released, and apply(t) run, once that
// is done too; the slot is released a softmax later than without.
// Tile t is the ring's tile first + t (produce_tiles); the callbacks take t.
template <int NUM_WG, int STAGES, bool OVERLAP, typename IssueS, typename IssuePv,
          typename Release, typename Stats, typename Apply>
__device__ __forceinline__ void pingpong_tiles(int tiles, unsigned full, int my_turn,
                                               int next_turn, int wg, const IssueS& issue_s,
                                               const IssuePv& issue_pv, const Release& release,
                                               const Stats& stats, const Apply& apply,
                                               int first = 0) {
    auto wait_full = [&](int t) {
        const int g = first + t;
        mbar_wait(full + 8 * (g % STAGES), (g / STAGES) & 1);
    };
    if (tiles > 0) {
        wait_full(0);
        bar_sync(my_turn, 256);
        issue_s(0);
        wgmma_commit();
        bar_arrive(next_turn, 256);
        wgmma_wait<0>();
        stats(0);
        apply(0);
        for (int t = 1; t < tiles; ++t) {
            wait_full(t);
            bar_sync(my_turn, 256);
            if constexpr (OVERLAP) {
                issue_s(t);
                wgmma_commit();
                issue_pv(t - 1);
                wgmma_commit();
            } else {
                issue_pv(t - 1);
                wgmma_commit();
                issue_s(t);
                wgmma_commit();
            }
            bar_arrive(next_turn, 256);
            wgmma_wait<1>();  // the first group done (groups complete in order)
            if constexpr (OVERLAP) {
                stats(t);  // S(t) done, P V(t - 1) still running
                wgmma_wait<0>();
                release(t - 1);
            } else {
                release(t - 1);  // P V(t - 1) done: its slot is free
                wgmma_wait<0>();
                stats(t);
            }
            apply(t);
        }
        bar_sync(my_turn, 256);
        issue_pv(tiles - 1);
        wgmma_commit();
        if (wg < NUM_WG - 1) bar_arrive(next_turn, 256);
        wgmma_wait<0>();
        release(tiles - 1);
    }
}

// A block's work units in turn: work(u, n, ring) for its n-th unit u, after the `ring` tiles
// of its earlier units, returns the unit's tiles. One unit (blockIdx.x) per block, or
// (PERSISTENT) every gridDim.x-th of `units` from blockIdx.x.
template <bool PERSISTENT, typename Work>
__device__ __forceinline__ void for_each_unit(unsigned units, const Work& work) {
    if constexpr (PERSISTENT) {
        int ring = 0, n = 0;
        for (unsigned u = blockIdx.x; u < units; u += gridDim.x, ++n) ring += work(u, n, ring);
    } else {
        work(blockIdx.x, 0, 0);
    }
}

// The ring's turns: warpgroup w issues after named barrier 1 + w and then grants barrier
// 1 + (w + 1) % NUM_WG (two warpgroups, 256 threads, per barrier); the last warpgroup grants
// the first one's first turn. Barrier 0 is __syncthreads'. A persistent block makes one per
// work unit: every grant of a unit is taken within it (the last warpgroup's last turn grants
// none), so a barrier never holds two grants.
struct Turns {
    int mine, next;
    __device__ __forceinline__ Turns(int wg, int num_wg, int tiles)
        : mine(1 + wg), next(1 + (wg + 1) % num_wg) {
        if (wg == num_wg - 1 && tiles > 0) bar_arrive(1, 256);
    }
};

}  // namespace sm90
}  // namespace cuattn
