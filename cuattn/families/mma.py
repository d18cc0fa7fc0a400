"""The mma family (``attention_mma.cu``, ``attention_backward_mma.cu``): 16-bit inputs on
the mma.sync m16n8k16 tensor cores of Ampere and newer, head dims to 256 (padded to a
multiple of 64 inside the kernels)."""
from __future__ import annotations

from dataclasses import dataclass

from ._common import (
    DELTA,
    DENSE,
    PACKED,
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

FORWARD_FILE = "mma/attention_mma.cu"
BACKWARD_FILE = "mma/attention_backward_mma.cu"

FWD = Kernel("attention_fwd_mma", "T BiasT HAS_MASK HEAD_DIM HEAD_DIM_V BLOCK_N NUM_WARPS "
                                  "M_TILES ALIGNED MIN_BLOCKS RAGGED", defaults={"RAGGED": DENSE})
DKDV = Kernel("attention_bwd_dkdv_mma", "T G BiasT HAS_MASK HEAD_DIM HEAD_DIM_V COLS BLOCK_M "
                                        "NUM_WARPS ALIGNED MIN_BLOCKS RAGGED",
              defaults={"RAGGED": DENSE})
DQ = Kernel("attention_bwd_dq_mma", "T G BiasT HAS_MASK HEAD_DIM HEAD_DIM_V COLS BLOCK_N "
                                    "NUM_WARPS ALIGNED MIN_BLOCKS RAGGED",
            defaults={"RAGGED": DENSE})


@dataclass(frozen=True)
class MmaTiles:
    block_m: int   # query rows per block: NUM_WARPS = block_m // (16 * m_tiles)
    block_n: int   # keys per tile
    m_tiles: int = 1  # 16-row tiles per warp: K and V fragments are reused this often
    min_blocks: int = 1  # __launch_bounds__ blocks per SM (caps registers)

    @property
    def num_warps(self) -> int:
        return self.block_m // (16 * self.m_tiles)


#: (largest head dim, candidate tiles in order of preference, reason).
MMA_TILES = (
    (64, (MmaTiles(64, 64, 1, 3), MmaTiles(128, 64, 2), MmaTiles(64, 64)),
     "H200 bf16 D64 S4096: 234.1 / 211.0 TFLOP/s, capped at 3 blocks/SM"),
    (128, (MmaTiles(128, 32, 2), MmaTiles(64, 64)),
     "H200 bf16 D128 S4096: 275.4 / 237.1 TFLOP/s, 2 row tiles per warp"),
    (256, (MmaTiles(64, 32), MmaTiles(64, 16)),
     "H200 bf16 D256 S4096: 200.2 / 178.6 TFLOP/s, 248 registers, no spills"),
)


#: attention_fwd_mma: Q, two stages of K and of V (row-swizzled, mma_tiles.cuh)
FWD_SMEM = Layout("FwdMmaSmem", "typename T, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, "
                  "int BLOCK_N", (
    ("q_s", "T", "BLOCK_M * HEAD_DIM"),
    ("k_s", "T", "2 * BLOCK_N * HEAD_DIM"),
    ("v_s", "T", "2 * BLOCK_N * HEAD_DIM_V"),
))


#: a packed call's tiles where they differ from MMA_TILES: its sequence's lengths and rows
#: take registers that the two row tiles per warp at D128 lack (28 bytes spill there)
MMA_PACKED_TILES = (
    (128, (MmaTiles(64, 64),), "D128 packed: one row tile per warp, no spills"),
)


def mma_smem_bytes(tiles: MmaTiles, head_dim: int, head_dim_v: int, itemsize: int = 2) -> int:
    """Dynamic shared memory of attention_fwd_mma (FWD_SMEM)."""
    return FWD_SMEM.bytes(T=itemsize, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
                          BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n)


def forward(req: Request, tiles: MmaTiles | None = None) -> KernelChoice:
    hd, hdv = ceil_to(req.head_dim, 64), ceil_to(req.head_dim_v, 64)
    table = MMA_TILES
    if req.ragged == PACKED and tiles is None:
        table = tuple(next((r for r in MMA_PACKED_TILES if r[0] == row[0]), row)
                      for row in MMA_TILES)
    tiles, smem = first_fit(candidates(table, req, tiles),
                            lambda t: mma_smem_bytes(t, hd, hdv), req, "mma")
    expr = FWD(T=req.dtype, BiasT=req.bias_dtype, HAS_MASK=req.has_mask, HEAD_DIM=hd,
               HEAD_DIM_V=hdv, BLOCK_N=tiles.block_n, NUM_WARPS=tiles.num_warps,
               M_TILES=tiles.m_tiles, ALIGNED=req.aligned, MIN_BLOCKS=tiles.min_blocks,
               RAGGED=req.ragged)
    return KernelChoice("mma", FORWARD_FILE, expr,
                        BlockTiles(tiles.block_m, tiles.block_n, hd, hdv, 1), hd, hdv, smem,
                        threads=tiles.num_warps * 32, ragged=req.ragged)


# ---- backward -------------------------------------------------------------------------

@dataclass(frozen=True)
class MmaBwdTiles:
    dkdv_warps: int  # keys per dK/dV block: 16 per warp
    block_m: int     # query tile of the dK/dV kernel
    dq_warps: int    # query rows per dQ block: 16 per warp
    block_n: int     # key tile of the dQ kernel
    dkdv_min_blocks: int = 1  # __launch_bounds__ blocks per SM (caps registers)
    dq_min_blocks: int = 1


#: (largest head dim, oldest compute capability, candidate tiles, reason). A call takes the
#: first row whose head dim and capability it meets (ptxas allocates registers differently
#: for sm_8x: the Hopper rows spill there), then the first candidate that fits.
MMA_BACKWARD_TILES = (
    (64, (9, 0), (MmaBwdTiles(4, 32, 4, 32, 3, 3),),
     "H200 bf16 D64 B4 H32 S4096: 102.1 / 94.2 TFLOP/s, capped at 3 blocks/SM"),
    (64, (8, 0), (MmaBwdTiles(4, 32, 4, 32, 2, 3),),
     "sm_8x: dK/dV at 2 blocks/SM (3 spill 4 bytes there), not timed"),
    (128, (9, 0), (MmaBwdTiles(4, 64, 4, 32, 2, 3),),
     "H200 bf16 D128 S4096: 128.3 / 114.9 TFLOP/s, dQ capped at 3 blocks/SM"),
    (128, (8, 0), (MmaBwdTiles(4, 32, 4, 32, 2, 3),),
     "sm_8x: 32-query dK/dV tiles (64 spill there), 120.6 / 108.9 TFLOP/s on H200"),
    (256, (8, 0),
     (MmaBwdTiles(8, 32, 4, 16), MmaBwdTiles(4, 32, 4, 32), MmaBwdTiles(2, 16, 2, 16)),
     "H200 bf16 D256 S4096: 73.8 / 67.8 TFLOP/s, 8-warp dK/dV, 16-key dQ"),
)


#: attention_bwd_dkdv_mma: the block's K and V, two stages of Q, dO, lse and delta
DKDV_SMEM = Layout("BwdMmaDkdvSmem", "typename T, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, "
                   "int BLOCK_N", (
    ("k_s", "T", "BLOCK_N * HEAD_DIM"),
    ("v_s", "T", "BLOCK_N * HEAD_DIM_V"),
    ("q_s", "T", "2 * BLOCK_M * HEAD_DIM"),
    ("do_s", "T", "2 * BLOCK_M * HEAD_DIM_V"),
    ("lse_s", "float", "2 * BLOCK_M"),
    ("delta_s", "float", "2 * BLOCK_M"),
))
#: attention_bwd_dq_mma: the block's Q and dO, two stages of K and V
DQ_SMEM = Layout("BwdMmaDqSmem", "typename T, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, "
                 "int BLOCK_N", (
    ("q_s", "T", "BLOCK_M * HEAD_DIM"),
    ("do_s", "T", "BLOCK_M * HEAD_DIM_V"),
    ("k_s", "T", "2 * BLOCK_N * HEAD_DIM"),
    ("v_s", "T", "2 * BLOCK_N * HEAD_DIM_V"),
))


def mma_backward_smem_bytes(tiles: MmaBwdTiles, hd: int, hdv: int) -> tuple[int, int]:
    """Dynamic shared memory of attention_bwd_dkdv_mma and attention_bwd_dq_mma."""
    return (DKDV_SMEM.bytes(T=2, HEAD_DIM=hd, HEAD_DIM_V=hdv, BLOCK_M=tiles.block_m,
                            BLOCK_N=16 * tiles.dkdv_warps),
            DQ_SMEM.bytes(T=2, HEAD_DIM=hd, HEAD_DIM_V=hdv, BLOCK_M=16 * tiles.dq_warps,
                          BLOCK_N=tiles.block_n))


def backward(req: Request, tiles: MmaBwdTiles | None = None) -> BackwardChoice:
    hd, hdv = ceil_to(req.head_dim, 64), ceil_to(req.head_dim_v, 64)
    cands = (tiles,) if tiles is not None else next(
        c for max_d, min_cc, c, _ in MMA_BACKWARD_TILES if req.head <= max_d and req.cc >= min_cc)
    tiles, smem = first_fit(cands, lambda t: mma_backward_smem_bytes(t, hd, hdv), req,
                            "mma backward")
    # output columns per block: all up to 128, else 128- or 64-column tiles that divide
    # both padded head dims (64 for a packed call: its sequence's registers and 128 columns
    # of dK and dV spill 8 to 28 bytes)
    if max(hd, hdv) <= 128:
        cols = max(hd, hdv)
    else:
        cols = 128 if hd % 128 == 0 and hdv % 128 == 0 and req.ragged != PACKED else 64
    g_kv, g_q = req.grad_dtypes
    common = dict(T=req.dtype, BiasT=req.bias_dtype, HAS_MASK=req.has_mask, HEAD_DIM=hd,
                  HEAD_DIM_V=hdv, COLS=cols, ALIGNED=req.aligned,
                  RAGGED=PACKED if req.ragged == PACKED else DENSE)  # key lengths: dense
    return BackwardChoice(
        "mma", BACKWARD_FILE, DELTA(T=req.dtype),
        DKDV(**common, G=g_kv, BLOCK_M=tiles.block_m, NUM_WARPS=tiles.dkdv_warps,
             MIN_BLOCKS=tiles.dkdv_min_blocks),
        DQ(**common, G=g_q, BLOCK_N=tiles.block_n, NUM_WARPS=tiles.dq_warps,
           MIN_BLOCKS=tiles.dq_min_blocks),
        16 * tiles.dkdv_warps, 16 * tiles.dq_warps, cols, min(cols, hd), *smem,
        threads_dkdv=32 * tiles.dkdv_warps, threads_dq=32 * tiles.dq_warps,
        ragged=common["RAGGED"])
