"""The portable family (``attention_portable.cu``, ``attention_backward_portable.cu``):
CUDA cores, every dtype and feature, head dims to 1024; the reference kernel and the
fallback of every GPU."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import lse_dtype
from ._common import (
    DELTA,
    BackwardChoice,
    Kernel,
    KernelChoice,
    Request,
    first_fit,
    pow2_at_least,
)
from ._layout import Layout

FORWARD_FILE = "portable/attention_portable.cu"
BACKWARD_FILE = "portable/attention_backward_portable.cu"

FWD = Kernel("attention_fwd_portable",
             "T BiasT HAS_MASK BLOCK_M BLOCK_N D_TILE DV_TILE MIN_BLOCKS PIPELINED ALIGNED CHUNKED",
             defaults={"CHUNKED": False})
FWD_WARPS = Kernel("attention_fwd_portable_warps",
                   "T BiasT HAS_MASK HEAD_DIM HEAD_DIM_V BLOCK_N ALIGNED LOCKSTEP")
DKDV = Kernel("attention_bwd_dkdv",
              "T G BiasT HAS_MASK BLOCK_M BLOCK_N D_TILE RESIDENT MIN_BLOCKS TF32",
              defaults={"TF32": False})
DQ = Kernel("attention_bwd_dq",
            "T G BiasT HAS_MASK BLOCK_M BLOCK_N D_TILE RESIDENT MIN_BLOCKS TF32",
            defaults={"TF32": False})


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    d_tile: int    # largest contraction chunk; D <= d_tile keeps Q in shared memory
    dv_tile: int   # largest output-column tile; Dv > dv_tile splits the grid over Dv
    min_blocks: int
    #: the warp-tiled form (attention_fwd_portable_warps: eight warps of 16 rows, block_m
    #: 128; float32/float64 on sm_80+, head dims to 64, d_tile and dv_tile 64)
    warps: bool = False
    #: the warp-tiled form with one K and one V buffer, all warps in step (two barriers per
    #: key tile): the shared memory of 64-key tiles
    lockstep: bool = False


#: (dtypes, largest head dim, candidate tiles in order of preference, reason). A call takes
#: the first row that matches its dtype and head dims, then the first candidate whose
#: shared memory fits the device; the last candidate of each row fits 48 KB, so every GPU
#: gets one. Reasons: H200, B4 H16 S4096 (fp32) and B1 H16 S4096 (fp64), TFLOP/s
#: non-causal / causal of the first candidate.
PORTABLE_TILES = (
    (("float16", "bfloat16", "float32"), 64,
     (Tiles(128, 128, 64, 64, 1), Tiles(128, 64, 64, 64, 1), Tiles(64, 64, 64, 64, 1),
      Tiles(32, 32, 64, 64, 2)),
     "fp32 D64: 36.5 / 32.6, 128x128"),
    (("float16", "bfloat16", "float32"), 1024,
     (Tiles(128, 64, 128, 128, 1), Tiles(128, 32, 128, 128, 1), Tiles(64, 64, 128, 128, 1),
      Tiles(32, 32, 64, 64, 2)),
     "fp32 D128: 37.7 / 33.9, 128x64"),
    (("float64",), 64,
     (Tiles(128, 64, 64, 64, 1, warps=True, lockstep=True),
      Tiles(128, 32, 64, 64, 1, warps=True), Tiles(64, 64, 64, 64, 1),
      Tiles(32, 32, 64, 64, 1)),
     "fp64 D64: 20.0 / 19.0, warp-tiled, 64-key tiles in step (198 KB: sm_90)"),
    (("float64",), 1024,
     (Tiles(64, 32, 128, 128, 1), Tiles(32, 32, 32, 32, 1)),
     "fp64 D128: 13.0 / 11.8, 64x32; 64x64 does not fit"),
)


def _acc_itemsize(dtype) -> int:
    """Bytes of the accumulator type (Acc<T>)."""
    return lse_dtype(dtype).itemsize


#: attention_fwd_portable, in elements of the accumulator type A with rows padded by 16
#: bytes: Q, then (pipelined) two stages of K and one V buffer, or one buffer that holds K
#: and then V, then P
FWD_SMEM = Layout("FwdPortableSmem", "typename A, int BLOCK_M, int BLOCK_N, int D_TILE, "
                  "int DV_TILE, bool PIPELINED", (
    ("q_s", "A", "BLOCK_M * (D_TILE + 16 // A_SIZE)"),
    ("kv_s", "A", "2 * BLOCK_N * (D_TILE + 16 // A_SIZE) + BLOCK_N * (DV_TILE + 16 // A_SIZE) "
                  "if PIPELINED else BLOCK_N * (max(D_TILE, DV_TILE) + 16 // A_SIZE)"),
    ("p_s", "A", "BLOCK_M * (BLOCK_N + 16 // A_SIZE)"),
))
#: attention_fwd_portable_warps: Q, two stages of K and three of V (one each in lockstep), P
FWD_WARPS_SMEM = Layout("FwdPortableWarpsSmem", "typename A, int HEAD_DIM, int HEAD_DIM_V, "
                        "int BLOCK_M, int BLOCK_N, bool LOCKSTEP", (
    ("q_s", "A", "BLOCK_M * (HEAD_DIM + 16 // A_SIZE)"),
    ("k_s", "A", "(1 if LOCKSTEP else 2) * BLOCK_N * (HEAD_DIM + 16 // A_SIZE)"),
    ("v_s", "A", "(1 if LOCKSTEP else 3) * BLOCK_N * (HEAD_DIM_V + 16 // A_SIZE)"),
    ("p_s", "A", "BLOCK_M * (BLOCK_N + 16 // A_SIZE)"),
))


def portable_smem_bytes(tiles: Tiles, d_tile: int, dv_tile: int, acc_itemsize: int,
                        pipelined: bool) -> int:
    """Dynamic shared memory of attention_fwd_portable or, for warp tiles,
    attention_fwd_portable_warps (FWD_SMEM, FWD_WARPS_SMEM)."""
    if tiles.warps:
        return FWD_WARPS_SMEM.bytes(A=acc_itemsize, HEAD_DIM=d_tile, HEAD_DIM_V=dv_tile,
                                    BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                                    LOCKSTEP=tiles.lockstep)
    return FWD_SMEM.bytes(A=acc_itemsize, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                          D_TILE=d_tile, DV_TILE=dv_tile, PIPELINED=pipelined)


def _layout(tiles: Tiles, req: Request) -> tuple[int, int, bool]:
    """(d_tile, dv_tile, pipelined) of a candidate for a request."""
    if tiles.warps:
        return pow2_at_least(req.head_dim, 32), pow2_at_least(req.head_dim_v, 32), True
    vec = 16 // _acc_itemsize(req.dtype)
    d_tile = min(pow2_at_least(req.head_dim, 32), tiles.d_tile)
    dv_tile = min(pow2_at_least(req.head_dim_v, 16 * vec), tiles.dv_tile)
    # cp.async double buffering (sm_80+) copies float32/float64 tiles as they are, when Q
    # fits one chunk; 16-bit inputs are converted to float on their way into shared memory
    pipelined = (np.dtype(req.dtype).name in ("float32", "float64")
                 and req.head_dim <= d_tile and req.cc >= (8, 0))
    return d_tile, dv_tile, pipelined


def forward(req: Request, tiles: Tiles | None = None) -> KernelChoice:
    name = np.dtype(req.dtype).name
    if tiles is None:
        cands = next(c for dtypes, max_d, c, _ in PORTABLE_TILES
                     if name in dtypes and req.head <= max_d)
    else:
        cands = (tiles,)
    if name not in ("float32", "float64") or req.cc < (8, 0) or req.head > 64:
        # the warp-tiled form copies float tiles as they are by cp.async, head dims to 64
        cands = tuple(t for t in cands if not t.warps)

    def smem_of(t):
        d_tile, dv_tile, pipelined = _layout(t, req)
        return portable_smem_bytes(t, d_tile, dv_tile, _acc_itemsize(req.dtype), pipelined)

    tiles, smem = first_fit(cands, smem_of, req, "portable")
    d_tile, dv_tile, pipelined = _layout(tiles, req)
    common = dict(T=req.dtype, BiasT=req.bias_dtype, HAS_MASK=req.has_mask)
    if tiles.warps:
        expr = FWD_WARPS(**common, HEAD_DIM=d_tile, HEAD_DIM_V=dv_tile, BLOCK_N=tiles.block_n,
                         ALIGNED=req.aligned, LOCKSTEP=tiles.lockstep)
    else:
        expr = FWD(**common, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, D_TILE=d_tile,
                   DV_TILE=dv_tile, MIN_BLOCKS=tiles.min_blocks, PIPELINED=pipelined,
                   ALIGNED=pipelined and req.aligned, CHUNKED=req.head_dim > d_tile)
    return KernelChoice("portable", FORWARD_FILE, expr, tiles, d_tile, dv_tile, smem)


# ---- backward -------------------------------------------------------------------------

@dataclass(frozen=True)
class BwdTiles:
    block_m: int   # query rows per tile
    block_n: int   # keys per tile
    d_tile: int    # largest contraction chunk and output-column tile
    min_blocks: int = 1


#: (dtypes, largest head dim, candidate tiles in order of preference, reason). Both kernels
#: (dK/dV and dQ) use the chosen tiles; a call takes the first row that matches, then the
#: first candidate whose shared memory fits; the last fits 48 KB.
BACKWARD_TILES = (
    (("float16", "bfloat16", "float32"), 64,
     (BwdTiles(64, 64, 64), BwdTiles(16, 32, 64)),
     "not swept: H200 fp32 D64 S4096 16.9 / 15.6 TFLOP/s"),
    (("float16", "bfloat16", "float32"), 1024,
     (BwdTiles(64, 64, 128), BwdTiles(32, 32, 128), BwdTiles(16, 32, 64)),
     "not swept: H200 fp32 D128 S4096 19.3 / 17.8 TFLOP/s"),
    (("float64",), 1024,
     (BwdTiles(32, 32, 64), BwdTiles(16, 16, 32)),
     "not swept: 32x32 keeps D64 resident in 83 KB"),
)


#: attention_bwd_dkdv (elements of A, rows padded by 16 bytes): K, V, Q, dO, P^T, dS^T
DKDV_SMEM = Layout("BwdPortableDkdvSmem", "typename A, int BLOCK_M, int BLOCK_N, int D_TILE", (
    ("k_s", "A", "BLOCK_N * (D_TILE + 16 // A_SIZE)"),
    ("v_s", "A", "BLOCK_N * (D_TILE + 16 // A_SIZE)"),
    ("q_s", "A", "BLOCK_M * (D_TILE + 16 // A_SIZE)"),
    ("do_s", "A", "BLOCK_M * (D_TILE + 16 // A_SIZE)"),
    ("p_s", "A", "BLOCK_N * (BLOCK_M + 16 // A_SIZE)"),
    ("ds_s", "A", "BLOCK_N * (BLOCK_M + 16 // A_SIZE)"),
))
#: attention_bwd_dq: Q, dO, K, V, dS
DQ_SMEM = Layout("BwdPortableDqSmem", "typename A, int BLOCK_M, int BLOCK_N, int D_TILE", (
    ("q_s", "A", "BLOCK_M * (D_TILE + 16 // A_SIZE)"),
    ("do_s", "A", "BLOCK_M * (D_TILE + 16 // A_SIZE)"),
    ("k_s", "A", "BLOCK_N * (D_TILE + 16 // A_SIZE)"),
    ("v_s", "A", "BLOCK_N * (D_TILE + 16 // A_SIZE)"),
    ("ds_s", "A", "BLOCK_M * (BLOCK_N + 16 // A_SIZE)"),
))


def backward_smem_bytes(tiles: BwdTiles, d_tile: int, acc_itemsize: int) -> tuple[int, int]:
    """Dynamic shared memory of attention_bwd_dkdv and attention_bwd_dq (DKDV_SMEM,
    DQ_SMEM)."""
    sizes = dict(A=acc_itemsize, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, D_TILE=d_tile)
    return DKDV_SMEM.bytes(**sizes), DQ_SMEM.bytes(**sizes)


def backward(req: Request, tiles: BwdTiles | None = None) -> BackwardChoice:
    name = np.dtype(req.dtype).name
    acc = _acc_itemsize(req.dtype)
    vec = 16 // acc
    cands = (tiles,) if tiles is not None else next(
        c for dtypes, max_d, c, _ in BACKWARD_TILES if name in dtypes and req.head <= max_d)

    def d_tile_of(t):
        return min(pow2_at_least(req.head, 16 * vec), t.d_tile)

    tiles, smem = first_fit(cands, lambda t: backward_smem_bytes(t, d_tile_of(t), acc), req,
                            "portable backward")
    d_tile = d_tile_of(tiles)
    common = dict(T=req.dtype, BiasT=req.bias_dtype, HAS_MASK=req.has_mask,
                  BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, D_TILE=d_tile,
                  RESIDENT=req.head <= d_tile, MIN_BLOCKS=tiles.min_blocks,
                  TF32=req.tf32_forward)
    g_kv, g_q = req.grad_dtypes
    return BackwardChoice("portable", BACKWARD_FILE, DELTA(T=req.dtype),
                          DKDV(G=g_kv, **common), DQ(G=g_q, **common),
                          tiles.block_n, tiles.block_m, d_tile, d_tile, *smem)
