"""The mma_f32 and mma_f64 families (``attention_mma_wide.cu``,
``attention_backward_mma_f32.cu``): float32 "tf32" on the mma.sync m16n8k8 TF32 tensor
cores, and float64 on the DMMA tensor cores of A100, H100/H200 and B200. The forward
pads head dims to multiples of 32, the backward to multiples of 64."""
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
from .mma import MmaBwdTiles, MmaTiles

FORWARD_FILE = "mma/attention_mma_wide.cu"
BACKWARD_FILE = "mma/attention_backward_mma_f32.cu"

FWD = Kernel("attention_fwd_mma_wide", "T BiasT HAS_MASK HEAD_DIM HEAD_DIM_V BLOCK_N NUM_WARPS "
                                       "M_TILES MIN_BLOCKS ALIGNED")
DKDV = Kernel("attention_bwd_dkdv_mma_f32", "BiasT HAS_MASK HEAD_DIM HEAD_DIM_V BLOCK_M "
                                            "NUM_WARPS PRE ALIGNED MIN_BLOCKS")
DQ = Kernel("attention_bwd_dq_mma_f32", "BiasT HAS_MASK HEAD_DIM HEAD_DIM_V BLOCK_N NUM_WARPS "
                                        "PRE ALIGNED MIN_BLOCKS")

#: mma_f32: (largest head dim, candidate tiles, reason). TFLOP/s of float32 "tf32" on the
#: H200, B4 H16 S4096, non-causal / causal, tools/sweep_tiles.py --f32.
MMA_F32_TILES = (
    (64, (MmaTiles(128, 64, 2), MmaTiles(64, 64), MmaTiles(64, 32), MmaTiles(32, 16)),
     "115.2 / 105.1, 2 row tiles per warp (109 KB, 2 blocks/SM)"),
    (128, (MmaTiles(64, 32), MmaTiles(128, 16, 2), MmaTiles(64, 16), MmaTiles(32, 16)),
     "86.1 / 83.4, 64x32"),
    (256, (MmaTiles(64, 32), MmaTiles(32, 16), MmaTiles(32, 8)),
     "not swept: 64x32 needs 202 KB; the others fit 164 KB and 99 KB"),
)

#: mma_f64, as MMA_F32_TILES (double operands: twice the shared memory per tile). TFLOP/s
#: on the H200, non-causal / causal, tools/sweep_tiles.py --f64.
MMA_F64_TILES = (
    (64, (MmaTiles(64, 16, 1, 3), MmaTiles(64, 32), MmaTiles(32, 32), MmaTiles(32, 16)),
     "B1 H16 S4096: 35.6 / 34.2, capped at 3 blocks/SM (168 registers)"),
    (128, (MmaTiles(128, 16), MmaTiles(64, 16), MmaTiles(32, 16)),
     "B1 H16 S4096: 41.1 / 38.2, 128x16"),
)


#: attention_fwd_mma_wide: Q as row pairs, two stages of K and of V, each row padded so that
#: the fragment loads spread over the banks (the .cu header)
FWD_SMEM = Layout("FwdMmaWideSmem", "typename T, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, "
                  "int BLOCK_N", (
    ("q_s", "T", "BLOCK_M // 2 * (2 * HEAD_DIM + (2 if T_SIZE == 8 else 16))"),
    ("k_s", "T", "2 * BLOCK_N * (HEAD_DIM + 8)"),
    ("v_s", "T", "2 * BLOCK_N * (HEAD_DIM_V + 16 // T_SIZE)"),
))


def mma_wide_smem_bytes(tiles: MmaTiles, head_dim: int, head_dim_v: int, itemsize: int) -> int:
    """Dynamic shared memory of attention_fwd_mma_wide (FWD_SMEM)."""
    return FWD_SMEM.bytes(T=itemsize, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
                          BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n)


def _forward(family: str, table, req: Request, tiles: MmaTiles | None) -> KernelChoice:
    hd, hdv = ceil_to(req.head_dim, 32), ceil_to(req.head_dim_v, 32)
    size = np.dtype(req.dtype).itemsize
    tiles, smem = first_fit(candidates(table, req, tiles),
                            lambda t: mma_wide_smem_bytes(t, hd, hdv, size), req, family)
    expr = FWD(T=req.dtype, BiasT=req.bias_dtype, HAS_MASK=req.has_mask, HEAD_DIM=hd,
               HEAD_DIM_V=hdv, BLOCK_N=tiles.block_n, NUM_WARPS=tiles.num_warps,
               M_TILES=tiles.m_tiles, MIN_BLOCKS=tiles.min_blocks, ALIGNED=req.aligned)
    return KernelChoice(family, FORWARD_FILE, expr,
                        BlockTiles(tiles.block_m, tiles.block_n, hd, hdv, 1), hd, hdv, smem,
                        threads=tiles.num_warps * 32)


def forward_f32(req: Request, tiles: MmaTiles | None = None) -> KernelChoice:
    return _forward("mma_f32", MMA_F32_TILES, req, tiles)


def forward_f64(req: Request, tiles: MmaTiles | None = None) -> KernelChoice:
    return _forward("mma_f64", MMA_F64_TILES, req, tiles)


# ---- backward ("tf32") ----------------------------------------------------------------

@dataclass(frozen=True)
class MmaF32BwdTiles(MmaBwdTiles):
    """MmaBwdTiles of the float32 backward (attention_backward_mma_f32.cu), with:"""
    preround: bool = False  # streamed tiles rounded to TF32 once in shared memory


F = MmaF32BwdTiles
#: (largest head dim, candidate tiles, reason). A call takes the first row whose head dim
#: it meets, then the first candidate that fits.
MMA_F32_BACKWARD_TILES = (
    (64, (F(4, 32, 4, 32, 2, 3, preround=True), F(4, 16, 4, 16, 2, 3)),
     "H200 fp32 D64 B4 H32 S4096: 71.5 / 66.9 TFLOP/s, tiles rounded once"),
    (128, (F(4, 16, 4, 16, 2, 2, preround=True),),
     "H200 fp32 D128 S4096: 56.6 / 54.0 TFLOP/s, tiles rounded once, 2 blocks/SM"),
)
del F


#: attention_bwd_dkdv_mma_f32: the block's K and V in fragment order, two stages of Q and
#: dO (rows padded by 4), lse and delta
DKDV_SMEM = Layout("BwdMmaF32DkdvSmem", "int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, int BLOCK_N", (
    ("k_f", "float", "BLOCK_N * HEAD_DIM"),
    ("v_f", "float", "BLOCK_N * HEAD_DIM_V"),
    ("q_s", "float", "2 * BLOCK_M * (HEAD_DIM + 4)"),
    ("do_s", "float", "2 * BLOCK_M * (HEAD_DIM_V + 4)"),
    ("lse_s", "float", "2 * BLOCK_M"),
    ("delta_s", "float", "2 * BLOCK_M"),
))
#: attention_bwd_dq_mma_f32: the block's Q and dO in fragment order, two stages of K and V
DQ_SMEM = Layout("BwdMmaF32DqSmem", "int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, int BLOCK_N", (
    ("q_f", "float", "BLOCK_M * HEAD_DIM"),
    ("do_f", "float", "BLOCK_M * HEAD_DIM_V"),
    ("k_s", "float", "2 * BLOCK_N * (HEAD_DIM + 4)"),
    ("v_s", "float", "2 * BLOCK_N * (HEAD_DIM_V + 4)"),
))


def mma_f32_backward_smem_bytes(tiles: MmaF32BwdTiles, hd: int, hdv: int) -> tuple[int, int]:
    """Dynamic shared memory of attention_bwd_dkdv_mma_f32 and attention_bwd_dq_mma_f32."""
    return (DKDV_SMEM.bytes(HEAD_DIM=hd, HEAD_DIM_V=hdv, BLOCK_M=tiles.block_m,
                            BLOCK_N=16 * tiles.dkdv_warps),
            DQ_SMEM.bytes(HEAD_DIM=hd, HEAD_DIM_V=hdv, BLOCK_M=16 * tiles.dq_warps,
                          BLOCK_N=tiles.block_n))


def backward_f32(req: Request, tiles: MmaF32BwdTiles | None = None) -> BackwardChoice:
    hd, hdv = ceil_to(req.head_dim, 64), ceil_to(req.head_dim_v, 64)
    tiles, smem = first_fit(candidates(MMA_F32_BACKWARD_TILES, req, tiles),
                            lambda t: mma_f32_backward_smem_bytes(t, hd, hdv), req,
                            "mma_f32 backward")
    common = dict(BiasT=req.bias_dtype, HAS_MASK=req.has_mask, HEAD_DIM=hd, HEAD_DIM_V=hdv,
                  PRE=tiles.preround, ALIGNED=req.aligned)
    return BackwardChoice(
        "mma_f32", BACKWARD_FILE, DELTA(T=np.dtype("float32")),
        DKDV(**common, BLOCK_M=tiles.block_m, NUM_WARPS=tiles.dkdv_warps,
             MIN_BLOCKS=tiles.dkdv_min_blocks),
        DQ(**common, BLOCK_N=tiles.block_n, NUM_WARPS=tiles.dq_warps,
           MIN_BLOCKS=tiles.dq_min_blocks),
        16 * tiles.dkdv_warps, 16 * tiles.dq_warps, max(hd, hdv), hd, *smem,
        threads_dkdv=32 * tiles.dkdv_warps, threads_dq=32 * tiles.dq_warps)
