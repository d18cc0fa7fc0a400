"""The sm90_3xf16 family (``attention_sm90_3xf16.cu``, ``attention_backward_sm90_3xf16.cu``):
float32 "highest" on the Hopper float16 warpgroup MMA, each operand split into a scaled
float16 pair (split16.cuh), head dims to 128. A magnitudes kernel runs first and writes
each batch entry's largest magnitudes, the split's scales."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._common import (
    DELTA,
    BackwardChoice,
    BlockTiles,
    Kernel,
    KernelChoice,
    Request,
    candidates,
    ceil_to,
    first_fit,
)
from ._layout import Layout
from .sm90 import Sm90Tiles

FORWARD_FILE = "sm90/attention_sm90_3xf16.cu"
BACKWARD_FILE = "sm90/attention_backward_sm90_3xf16.cu"

FWD = Kernel("attention_fwd_sm90_3xf16", "BiasT HAS_MASK HEAD_DIM HEAD_DIM_V BLOCK_N NUM_WG "
                                         "ALIGNED MIN_BLOCKS")
FWD_MAGNITUDES = "attention_fwd_magnitudes"
DKDV = Kernel("attention_bwd_dkdv_sm90_3xf16", "BiasT HAS_MASK HEAD_DIM HEAD_DIM_V BLOCK_M "
                                               "ALIGNED MIN_BLOCKS OVERLAP WARPGROUPS ROLES "
                                               "STAGGER")
DQ = Kernel("attention_bwd_dq_sm90_3xf16", "BiasT HAS_MASK HEAD_DIM HEAD_DIM_V BLOCK_N ALIGNED "
                                           "MIN_BLOCKS OVERLAP WARPGROUPS STAGGER")
BWD_MAGNITUDES = "attention_bwd_magnitudes"

#: (largest head dim, candidate tiles, reason). ptxas (sm_90a), no spills: D64 64-key
#: tiles, two warpgroups 213 registers; D128 32-key tiles 225.
SM90_3XF16_TILES = (
    (64, (Sm90Tiles(128, 64), Sm90Tiles(64, 64)),
     "H200 fp32 D64 S4096: 94.0 / 88.7 TFLOP/s, two warpgroups, not swept"),
    (128, (Sm90Tiles(128, 32), Sm90Tiles(64, 32)),
     "H200 fp32 D128 S4096: 106.9 / 98.4 TFLOP/s, two warpgroups, not swept"),
)


#: attention_fwd_sm90_3xf16: Q split (hi, lo) per warpgroup, the split K and V tiles (hi
#: rows, then lo rows), two stages of K and V as loaded
FWD_SMEM = Layout("FwdSplit16Smem", "int HEAD_DIM, int HEAD_DIM_V, int NUM_WG, int BLOCK_N", (
    ("q_s", "__half", "NUM_WG * 2 * 64 * HEAD_DIM"),
    ("k_s", "__half", "2 * BLOCK_N * HEAD_DIM"),
    ("v_s", "__half", "2 * BLOCK_N * HEAD_DIM_V"),
    ("k_raw", "float", "2 * BLOCK_N * HEAD_DIM"),
    ("v_raw", "float", "2 * BLOCK_N * HEAD_DIM_V"),
))


def sm90_3xf16_smem_bytes(tiles: Sm90Tiles, hd: int, hdv: int) -> int:
    """Dynamic shared memory of attention_fwd_sm90_3xf16 (FWD_SMEM)."""
    return FWD_SMEM.bytes(HEAD_DIM=hd, HEAD_DIM_V=hdv, NUM_WG=tiles.block_m // 64,
                          BLOCK_N=tiles.block_n)


def forward(req: Request, tiles: Sm90Tiles | None = None) -> KernelChoice:
    hd, hdv = ceil_to(req.head_dim, 64), ceil_to(req.head_dim_v, 64)
    tiles, smem = first_fit(candidates(SM90_3XF16_TILES, req, tiles),
                            lambda t: sm90_3xf16_smem_bytes(t, hd, hdv), req, "sm90_3xf16")
    expr = FWD(BiasT=req.bias_dtype, HAS_MASK=req.has_mask, HEAD_DIM=hd, HEAD_DIM_V=hdv,
               BLOCK_N=tiles.block_n, NUM_WG=tiles.block_m // 64, ALIGNED=req.aligned,
               MIN_BLOCKS=tiles.min_blocks)
    return KernelChoice("sm90_3xf16", FORWARD_FILE, expr,
                        BlockTiles(tiles.block_m, tiles.block_n, hd, hdv, 1), hd, hdv, smem,
                        threads=tiles.num_warps * 32, magnitudes=FWD_MAGNITUDES)


# ---- backward -------------------------------------------------------------------------

@dataclass(frozen=True)
class Sm90F16SplitBwdTiles:
    block_m: int   # query tile of the dK/dV kernel (64 keys per warpgroup)
    block_n: int   # key tile of the dQ kernel (64 query rows per warpgroup)
    dkdv_min_blocks: int = 1
    dq_min_blocks: int = 1
    #: the overlapped forms: the next tile split while the tensor cores run this tile's
    #: gradient products (two buffers of the split tiles)
    dkdv_overlap: bool = False
    dq_overlap: bool = False
    #: warpgroups per block (1 or 2): 64 keys (dK/dV) or query rows (dQ) each, sharing the
    #: streamed tiles
    dkdv_warpgroups: int = 1
    dq_warpgroups: int = 1
    #: 2: dK and dV in separate blocks (grid column tile 0 dV, 1 dK), for the registers of
    #: head dim 128; 3: one block of two warpgroups per 64 keys, warpgroup 0 dV and 1 dK (K,
    #: V and every split tile shared: room for dkdv_overlap at 128), warpgroup 0 handing its
    #: P^T to warpgroup 1 through shared memory (two split products a warpgroup per tile)
    dkdv_roles: int = 1
    #: two warpgroups: the second issues its score products once the first has issued its
    #: own, so the first's element-wise pass runs under the second's products
    dkdv_stagger: bool = False
    dq_stagger: bool = False


#: (largest head dim, candidate tiles, reason). ptxas (sm_90a, the staggered forms), no
#: spills: D64 dK/dV (32-query tiles, two warpgroups, overlapped) 241 registers, dQ (64-key
#: tiles, two warpgroups, overlapped) 251; D128 dK/dV (warpgroup roles, overlapped) 237, dQ
#: (32-key tiles) 228. Reasons: backward ms non-causal / causal (tools/kernel_times.py).
#: One-warpgroup forms follow as fallbacks for smaller shared memory.
SM90_3XF16_BACKWARD_TILES = (
    (64, (Sm90F16SplitBwdTiles(32, 64, dkdv_overlap=True, dq_overlap=True, dkdv_warpgroups=2,
                               dq_warpgroups=2, dkdv_stagger=True, dq_stagger=True),
          Sm90F16SplitBwdTiles(32, 32, dkdv_overlap=True, dq_overlap=True)),
     "H200 D64 B4 H32 S4096: 16.5 / 9.0 ms without the stagger, which saves 7 %"),
    (128, (Sm90F16SplitBwdTiles(32, 32, dkdv_overlap=True, dkdv_warpgroups=2, dq_warpgroups=2,
                                dkdv_roles=3, dkdv_stagger=True, dq_stagger=True),
           Sm90F16SplitBwdTiles(32, 32, dkdv_roles=2)),
     "H200 D128 B4 H16 S4096: 17.8 / 9.8 ms without the stagger, which saves 4 %"),
)


#: attention_bwd_dkdv_sm90_3xf16: split K and V of each warpgroup that owns keys, two
#: stages of Q and dO as loaded, their split tiles (one per tile in flight), lse, delta and
#: the exchanged P^T of the two-role form (BLOCK_M / 8 x 128 float4)
DKDV_SMEM = Layout("BwdSplit16DkdvSmem", "int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, "
                       "int OWNERS, bool OVERLAP, bool EXCHANGE", (
    ("k_s", "__half", "OWNERS * 2 * 64 * HEAD_DIM"),
    ("v_s", "__half", "OWNERS * 2 * 64 * HEAD_DIM_V"),
    ("q_raw", "float", "2 * BLOCK_M * HEAD_DIM"),
    ("do_raw", "float", "2 * BLOCK_M * HEAD_DIM_V"),
    ("q_s", "__half", "(2 if OVERLAP else 1) * 2 * BLOCK_M * HEAD_DIM"),
    ("do_s", "__half", "(2 if OVERLAP else 1) * 2 * BLOCK_M * HEAD_DIM_V"),
    ("lse_s", "float", "2 * BLOCK_M"),
    ("delta_s", "float", "2 * BLOCK_M"),
    ("pf_s", "float4", "BLOCK_M // 8 * 128 if EXCHANGE else 0"),
))
#: attention_bwd_dq_sm90_3xf16: split Q and dO of each warpgroup, two stages of K and V as
#: loaded, their split tiles (one per tile in flight)
DQ_SMEM = Layout("BwdSplit16DqSmem", "int HEAD_DIM, int HEAD_DIM_V, int WARPGROUPS, "
                     "int BLOCK_N, bool OVERLAP", (
    ("q_s", "__half", "WARPGROUPS * 2 * 64 * HEAD_DIM"),
    ("do_s", "__half", "WARPGROUPS * 2 * 64 * HEAD_DIM_V"),
    ("k_raw", "float", "2 * BLOCK_N * HEAD_DIM"),
    ("v_raw", "float", "2 * BLOCK_N * HEAD_DIM_V"),
    ("k_s", "__half", "(2 if OVERLAP else 1) * 2 * BLOCK_N * HEAD_DIM"),
    ("v_s", "__half", "(2 if OVERLAP else 1) * 2 * BLOCK_N * HEAD_DIM_V"),
))


def sm90_3xf16_backward_smem_bytes(tiles: Sm90F16SplitBwdTiles, hd: int,
                                   hdv: int) -> tuple[int, int]:
    """Dynamic shared memory of attention_bwd_dkdv_sm90_3xf16 and attention_bwd_dq_sm90_3xf16
    (DKDV_SMEM, DQ_SMEM)."""
    shared_keys = tiles.dkdv_roles == 3
    return (DKDV_SMEM.bytes(HEAD_DIM=hd, HEAD_DIM_V=hdv, BLOCK_M=tiles.block_m,
                            OWNERS=1 if shared_keys else tiles.dkdv_warpgroups,
                            OVERLAP=tiles.dkdv_overlap, EXCHANGE=shared_keys),
            DQ_SMEM.bytes(HEAD_DIM=hd, HEAD_DIM_V=hdv, WARPGROUPS=tiles.dq_warpgroups,
                          BLOCK_N=tiles.block_n, OVERLAP=tiles.dq_overlap))


def backward(req: Request, tiles: Sm90F16SplitBwdTiles | None = None) -> BackwardChoice:
    hd, hdv = ceil_to(req.head_dim, 64), ceil_to(req.head_dim_v, 64)
    tiles, smem = first_fit(candidates(SM90_3XF16_BACKWARD_TILES, req, tiles),
                            lambda t: sm90_3xf16_backward_smem_bytes(t, hd, hdv), req,
                            "sm90_3xf16 backward")
    common = dict(BiasT=req.bias_dtype, HAS_MASK=req.has_mask, HEAD_DIM=hd, HEAD_DIM_V=hdv,
                  ALIGNED=req.aligned)
    return BackwardChoice(
        "sm90_3xf16", BACKWARD_FILE, DELTA(T=np.dtype("float32")),
        DKDV(**common, BLOCK_M=tiles.block_m, MIN_BLOCKS=tiles.dkdv_min_blocks,
             OVERLAP=tiles.dkdv_overlap, WARPGROUPS=tiles.dkdv_warpgroups,
             ROLES=tiles.dkdv_roles, STAGGER=tiles.dkdv_stagger),
        DQ(**common, BLOCK_N=tiles.block_n, MIN_BLOCKS=tiles.dq_min_blocks,
           OVERLAP=tiles.dq_overlap, WARPGROUPS=tiles.dq_warpgroups, STAGGER=tiles.dq_stagger),
        64 if tiles.dkdv_roles == 3 else 64 * tiles.dkdv_warpgroups, 64 * tiles.dq_warpgroups,
        max(hd, hdv), hd, *smem, threads_dkdv=128 * tiles.dkdv_warpgroups,
        threads_dq=128 * tiles.dq_warpgroups, dkdv_roles=2 if tiles.dkdv_roles == 2 else 1,
        magnitudes=BWD_MAGNITUDES)
