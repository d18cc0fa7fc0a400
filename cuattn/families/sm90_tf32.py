"""The sm90_tf32 family (``attention_sm90_tf32.cu``): float32 "tf32" on the Hopper
warpgroup MMA (wgmma .tf32, sm_90a), head dims to 128. Long calls take the piped instance,
which reads K and V^T prepared once per call as tile images."""
from __future__ import annotations

from dataclasses import dataclass

from ._common import BlockTiles, Kernel, KernelChoice, Request, candidates, ceil_to, first_fit
from ._layout import Layout
from .sm90 import Sm90Tiles

FORWARD_FILE = "sm90/attention_sm90_tf32.cu"

FWD = Kernel("attention_fwd_sm90_tf32", "BiasT HAS_MASK HEAD_DIM HEAD_DIM_V BLOCK_N NUM_WG "
                                        "ALIGNED MIN_BLOCKS")
FWD_PIPED = Kernel("attention_fwd_sm90_tf32_piped", "BiasT HAS_MASK HEAD_DIM HEAD_DIM_V BLOCK_N "
                                                    "NUM_WG STAGES QREG ALIGNED")
#: the piped instance's preparation kernels (plain kernels of the same file)
PREPARATIONS = ("tf32_image_k", "tf32_image_vt")


@dataclass(frozen=True)
class PipedTiles:
    """Tiles of attention_fwd_sm90_tf32_piped: block_m query rows (two or three consumer
    warpgroups of 64, taking turns to issue their products) and one producer warpgroup,
    block_n keys per tile, ``slots`` K/V^T slots; the consumers hold their Q as register
    fragments when ``qreg``."""
    block_m: int
    block_n: int
    slots: int
    qreg: bool = False

    @property
    def num_warps(self) -> int:
        return self.block_m // 16 + 4


#: Query rows from which the piped instance serves a call (Sm90Tiles.prepare_from),
#: measured at B8 H16 S2048 and B4 H16 S4096.
PIPED_FROM_D64 = 2048
PIPED_FROM_D128 = 2048

#: (largest head dim, candidate tiles in order of preference, reason: TFLOP/s non-causal /
#: causal at B4 H16, of the per-block and the piped instance).
SM90_TF32_TILES = (
    (64, (Sm90Tiles(128, 128, prepare_from=PIPED_FROM_D64, piped=PipedTiles(192, 64, 4, qreg=True)),
          Sm90Tiles(128, 64), Sm90Tiles(64, 64)),
     "H200 fp32 D64 S4096: 141.8 / 126.8 TFLOP/s per block, 198.3 / 142.4 piped"),
    (128, (Sm90Tiles(128, 64, prepare_from=PIPED_FROM_D128, piped=PipedTiles(192, 32, 4)),
           Sm90Tiles(128, 32), Sm90Tiles(64, 32)),
     "H200 fp32 D128 S4096: 166.2 / 152.1 TFLOP/s per block, 230.2 / 167.7 piped"),
)


#: attention_fwd_sm90_tf32: Q, two stages of K, the V staging tile and V^T
FWD_SMEM = Layout("FwdSm90Tf32Smem", "int HEAD_DIM, int HEAD_DIM_V, int NUM_WG, int BLOCK_N", (
    ("q_s", "float", "NUM_WG * 64 * HEAD_DIM"),
    ("k_s", "float", "2 * BLOCK_N * HEAD_DIM"),
    ("v_s", "float", "BLOCK_N * HEAD_DIM_V"),
    ("vt_s", "float", "HEAD_DIM_V * BLOCK_N"),
))
#: attention_fwd_sm90_tf32_piped: Q, STAGES slots of a K tile and a V^T tile, and each
#: slot's two 8-byte barriers (full, then empty)
PIPED_SMEM = Layout("FwdSm90PipedSmem", "int HEAD_DIM, int HEAD_DIM_V, int NUM_WG, "
                        "int BLOCK_N, int STAGES", (
    ("q_s", "float", "NUM_WG * 64 * HEAD_DIM"),
    ("slots", "float", "STAGES * (BLOCK_N * HEAD_DIM + HEAD_DIM_V * BLOCK_N)"),
    ("full", "unsigned char", "8 * STAGES"),
    ("empty", "unsigned char", "8 * STAGES"),
))


def sm90_tf32_smem_bytes(tiles: Sm90Tiles, head_dim: int, head_dim_v: int) -> int:
    """Dynamic shared memory of attention_fwd_sm90_tf32 (FWD_SMEM)."""
    return FWD_SMEM.bytes(HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, NUM_WG=tiles.block_m // 64,
                          BLOCK_N=tiles.block_n)


def sm90_piped_smem_bytes(tiles: PipedTiles, head_dim: int, head_dim_v: int) -> int:
    """Dynamic shared memory of attention_fwd_sm90_tf32_piped (PIPED_SMEM)."""
    return PIPED_SMEM.bytes(HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
                            NUM_WG=tiles.block_m // 64, BLOCK_N=tiles.block_n,
                            STAGES=tiles.slots)


def forward(req: Request, tiles: Sm90Tiles | None = None) -> KernelChoice:
    hd, hdv = ceil_to(req.head_dim, 64), ceil_to(req.head_dim_v, 64)
    tiles, smem = first_fit(candidates(SM90_TF32_TILES, req, tiles),
                            lambda t: sm90_tf32_smem_bytes(t, hd, hdv), req, "sm90_tf32")
    common = dict(BiasT=req.bias_dtype, HAS_MASK=req.has_mask, HEAD_DIM=hd, HEAD_DIM_V=hdv,
                  ALIGNED=req.aligned)
    expr = FWD(**common, BLOCK_N=tiles.block_n, NUM_WG=tiles.block_m // 64,
               MIN_BLOCKS=tiles.min_blocks)
    prepared, piped = None, tiles.piped
    if piped is not None and tiles.prepare_from:
        piped_smem = sm90_piped_smem_bytes(piped, hd, hdv)
        if piped_smem <= req.smem_limit:
            piped_expr = FWD_PIPED(**common, BLOCK_N=piped.block_n, NUM_WG=piped.block_m // 64,
                                   STAGES=piped.slots, QREG=piped.qreg)
            prepared = KernelChoice("sm90_tf32", FORWARD_FILE, piped_expr,
                                    BlockTiles(piped.block_m, piped.block_n, hd, hdv, 1), hd, hdv,
                                    piped_smem, threads=piped.num_warps * 32, prepare=True)
    return KernelChoice("sm90_tf32", FORWARD_FILE, expr,
                        BlockTiles(tiles.block_m, tiles.block_n, hd, hdv, 1), hd, hdv, smem,
                        threads=tiles.num_warps * 32, prepared=prepared,
                        prepare_from=tiles.prepare_from)
