"""The sm90 family (``attention_sm90.cu``, ``attention_backward_sm90.cu``): 16-bit inputs
on the Hopper warpgroup MMA (wgmma, sm_90a), head dims to 128 (padded to a multiple of 64
inside the kernels)."""
from __future__ import annotations

from dataclasses import dataclass, replace

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
    itemsize,
    resident_cap,
)
from ._layout import Layout

FORWARD_FILE = "sm90/attention_sm90.cu"
BACKWARD_FILE = "sm90/attention_backward_sm90.cu"

FWD = Kernel("attention_fwd_sm90", "T BiasT HAS_MASK HEAD_DIM HEAD_DIM_V BLOCK_N NUM_WG STAGES "
                                   "ALIGNED MIN_BLOCKS RAGGED", defaults={"RAGGED": DENSE})
FWD_PIPED = Kernel("attention_fwd_sm90_piped",
                   "T BiasT HAS_MASK HEAD_DIM HEAD_DIM_V BLOCK_N STAGES STAGE_SIDE OVERLAP "
                   "PERSISTENT RAGGED", defaults={"STAGE_SIDE": True, "OVERLAP": False,
                                                  "PERSISTENT": False, "RAGGED": DENSE})
DKDV = Kernel("attention_bwd_dkdv_sm90", "T G BiasT HAS_MASK HEAD_DIM HEAD_DIM_V BLOCK_M ALIGNED "
                                         "MIN_BLOCKS OVERLAP STATS_AHEAD RAGGED",
              defaults={"STATS_AHEAD": False, "RAGGED": DENSE})
DQ = Kernel("attention_bwd_dq_sm90", "T G BiasT HAS_MASK HEAD_DIM HEAD_DIM_V BLOCK_N ALIGNED "
                                     "MIN_BLOCKS OVERLAP RAGGED", defaults={"RAGGED": DENSE})


@dataclass(frozen=True)
class Sm90Tiles:
    block_m: int   # query rows per block: one warpgroup (128 threads) per 64 rows
    block_n: int   # keys per tile (the N of the S = Q K^T instruction): 64 or 128
    min_blocks: int = 1  # __launch_bounds__ blocks per SM (caps registers)
    stages: int = 2  # K and V tile buffers of the 16-bit kernel (the float kernels have two)
    #: sm90_tf32: from this many query rows on (0: never; under a causal or window band half
    #: the rows count, since each key tile then serves about half the query blocks) the
    #: piped instance with tiles ``piped`` serves the call: K and V^T are prepared once per
    #: call as tile images (tf32_image_k, tf32_image_vt), which the preparation's fixed cost
    #: must win back
    prepare_from: int = 0
    piped: object = None  # sm90_tf32.PipedTiles

    @property
    def num_warps(self) -> int:
        return self.block_m // 16


@dataclass(frozen=True)
class Sm90PipedTiles:
    """Tiles of attention_fwd_sm90_piped: 128 query rows (two consumer warpgroups of 64,
    taking turns to issue their products) and one producer warpgroup, ``block_n`` keys per
    tile, ``stages`` K/V slots. Needs q, k and v as the copy engine reads them (unit
    column strides, 16-byte aligned starts and strides: Request.aligned). ``overlap``: each
    consumer's softmax also runs under its own previous P V (pingpong_tiles' OVERLAP).
    ``persistent``: a block per SM takes the call's 128-row work units in turn, loading the
    next unit's tiles while it stores the last one's rows."""
    block_n: int
    stages: int
    block_m: int = 128
    overlap: bool = False
    persistent: bool = False

    @property
    def num_warps(self) -> int:
        return 12


#: the piped instance's tiles, by largest head dim: candidates in order of preference, the
#: first whose slots fit with the staged mask and bias tiles (128 query rows each)
SM90_PIPED_TILES = (
    (64, (Sm90PipedTiles(128, 4), Sm90PipedTiles(128, 2), Sm90PipedTiles(64, 2)),
     "D64: four K/V slots fit in 144 KB"),
    (128, (Sm90PipedTiles(128, 2), Sm90PipedTiles(64, 2)),
     "D128: two K/V slots of 64 KB, with Q 160 KB; 64-key tiles beside a float32 bias"),
    (256, (Sm90PipedTiles(64, 2),), "D256: 64-key tiles (128 spill), with Q 192 KB"),
)
#: the largest head dim of the per-block instance (its 64-row warpgroup's registers)
PER_BLOCK_HEAD = 128
#: Up to PER_BLOCK_HEAD dispatch takes the piped instance only past head dim 64, without a
#: bias, with a mask only where its tiles are staged (forward_kernel: mask rows 16 bytes
#: apart) and from this many keys (a band: twice). H100 float16, 16K tokens, H16 D128,
#: piped / per-block TFLOP/s: S1024 361 / 360, S2048 418 / 410, S4096 431 / 405; causal
#: S2048 320 / 339, S4096 416 / 392; D64 H32 S4096 310 / 349 (the per-block 64 x 128
#: tiles). H100 bfloat16 B4 H16 S4096 D128: a staged full mask 304.6 / 279.0, a mask read
#: from global memory 109 / 282, a staged bfloat16 bias 233.4 / 248.6 (64-key tiles).
PIPED_MIN_HEAD, PIPED_MIN_KEYS = 64, 2048

#: (largest head dim, candidate tiles in order of preference, reason).
SM90_TILES = (
    (64, (Sm90Tiles(64, 64, 4), Sm90Tiles(64, 64), Sm90Tiles(64, 128), Sm90Tiles(128, 128)),
     "H200 bf16 D64 S4096: 315.4 / 287.5 TFLOP/s, capped at 4 blocks/SM"),
    (128, (Sm90Tiles(64, 64), Sm90Tiles(128, 128), Sm90Tiles(128, 64)),
     "H200 bf16 D128 S4096: 398.1 / 323.8 TFLOP/s, one warpgroup"),
)


#: the staged mask and bias tiles of STAGES stages of ROWS x COLS (mma_tiles.cuh SideTiles;
#: BIAS_SIZE 0: no bias)
SIDE = ("STAGES * ((ROWS * side_pitch(1, COLS) if HAS_MASK else 0) "
        "+ (ROWS * side_pitch(BIAS_SIZE, COLS) if BIAS_SIZE > 0 else 0))")

#: attention_fwd_sm90: Q, STAGES stages of K and V, and of the mask and bias tiles
FWD_SMEM = Layout("FwdSm90Smem", "typename T, int HEAD_DIM, int HEAD_DIM_V, int ROWS, int COLS, "
                  "int STAGES, bool HAS_MASK, int BIAS_SIZE", (
    ("q_s", "T", "ROWS * HEAD_DIM"),
    ("k_s", "T", "STAGES * COLS * HEAD_DIM"),
    ("v_s", "T", "STAGES * COLS * HEAD_DIM_V"),
    ("side_s", "unsigned char", SIDE),
))

#: attention_fwd_sm90_piped: Q of the NUM_WG consumer warpgroups, STAGES slots of a K and a
#: V tile, each slot's mask and bias tiles (the masks' first), Q's barrier and each slot's
#: two (full, then empty), and Q's second (empty: the consumers are done with it)
PIPED_SMEM = Layout("FwdSm90TmaSmem", "typename T, int HEAD_DIM, int HEAD_DIM_V, int NUM_WG, "
                    "int BLOCK_N, int STAGES, bool HAS_MASK, int BIAS_SIZE", (
    ("q_s", "T", "NUM_WG * 64 * HEAD_DIM"),
    ("slots", "T", "STAGES * BLOCK_N * (HEAD_DIM + HEAD_DIM_V)"),
    ("side_s", "unsigned char", SIDE.replace("ROWS", "NUM_WG * 64").replace("COLS", "BLOCK_N")),
    ("q_full", "unsigned char", "8"),
    ("full", "unsigned char", "8 * STAGES"),
    ("empty", "unsigned char", "8 * STAGES"),
    ("q_empty", "unsigned char", "8"),
))


def sm90_smem_bytes(tiles: Sm90Tiles, head_dim: int, head_dim_v: int, has_mask: bool = False,
                    bias_itemsize: int = 0) -> int:
    """Dynamic shared memory of attention_fwd_sm90 (16-bit elements, FWD_SMEM)."""
    return FWD_SMEM.bytes(T=2, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, ROWS=tiles.block_m,
                          COLS=tiles.block_n, STAGES=tiles.stages, HAS_MASK=has_mask,
                          BIAS_SIZE=bias_itemsize)


def sm90_piped_smem_bytes(tiles: Sm90PipedTiles, head_dim: int, head_dim_v: int,
                          has_mask: bool = False, bias_itemsize: int = 0) -> int:
    """Dynamic shared memory of attention_fwd_sm90_piped (PIPED_SMEM)."""
    return PIPED_SMEM.bytes(T=2, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
                            NUM_WG=tiles.block_m // 64, BLOCK_N=tiles.block_n,
                            STAGES=tiles.stages, HAS_MASK=has_mask, BIAS_SIZE=bias_itemsize)


def forward(req: Request,
            tiles: Sm90Tiles | Sm90PipedTiles | None = None) -> KernelChoice | None:
    """The piped instance where the copy engine reads q, k and v (with the per-block one
    as its fallback), else the per-block instance; None for head dims past 128 that the
    piped instance cannot take (another family serves them)."""
    hd, hdv = ceil_to(req.head_dim, 64), ceil_to(req.head_dim_v, 64)
    wide = req.head > PER_BLOCK_HEAD  # beyond the per-block instance
    if isinstance(tiles, Sm90PipedTiles) and not req.aligned:
        raise NotImplementedError(f"the sm90 piped instance reads q, k and v through tensor "
                                  f"maps: unit column strides, 16-byte aligned starts, "
                                  f"strides and head dims ({req.what()})")
    if isinstance(tiles, Sm90Tiles) and wide:
        raise NotImplementedError(f"the sm90 per-block instance holds head dims to "
                                  f"{PER_BLOCK_HEAD} ({req.what()})")
    if isinstance(tiles, Sm90PipedTiles) and tiles.persistent and req.ragged != DENSE:
        raise NotImplementedError("packed sequences and key lengths run a block per work "
                                  "unit: no persistent sm90 piped tiles")
    per_block = None if wide or isinstance(tiles, Sm90PipedTiles) else \
        _per_block(req, tiles, hd, hdv)
    if not req.aligned or isinstance(tiles, Sm90Tiles):
        return per_block
    if tiles is None and not wide and (req.head <= PIPED_MIN_HEAD
                                       or req.bias_dtype is not None):
        return per_block
    fit = piped_tiles(req, tiles)
    if fit is None:
        if tiles is not None:
            raise NotImplementedError(f"the sm90 piped tiles {tiles} need more than "
                                      f"{req.smem_limit} bytes of shared memory here")
        return per_block
    piped, staged, smem = fit
    expr = FWD_PIPED(T=req.dtype, BiasT=req.bias_dtype, HAS_MASK=req.has_mask, HEAD_DIM=hd,
                     HEAD_DIM_V=hdv, BLOCK_N=piped.block_n, STAGES=piped.stages,
                     STAGE_SIDE=staged, OVERLAP=piped.overlap, PERSISTENT=piped.persistent,
                     RAGGED=req.ragged)
    # past 128, dispatch gives the fallback: the next family's instance
    return KernelChoice("sm90", FORWARD_FILE, expr,
                        BlockTiles(piped.block_m, piped.block_n, hd, hdv, 1), hd, hdv, smem,
                        threads=piped.num_warps * 32, tma=True, fallback=per_block,
                        tma_from=0 if wide or tiles else PIPED_MIN_KEYS,
                        persistent=piped.persistent, ragged=req.ragged)


def piped_tiles(req: Request, tiles: Sm90PipedTiles | None = None):
    """(tiles, staged, shared memory) of the piped instance for ``req``: the table's first
    (or the given) tiles that fit with the mask and bias tiles staged in each slot, else the
    first that fit without them (the softmax reads them from global memory); None where
    none fits."""
    hd, hdv = ceil_to(req.head_dim, 64), ceil_to(req.head_dim_v, 64)
    bias_size = itemsize(req.bias_dtype)
    cands = (tiles,) if tiles else next(c for max_d, c, _ in SM90_PIPED_TILES
                                        if req.head <= max_d)
    side = req.has_mask or bias_size > 0
    for staged in (True, False) if side else (True,):
        for t in cands:
            smem = sm90_piped_smem_bytes(t, hd, hdv, req.has_mask and staged,
                                         bias_size if staged else 0)
            if smem <= req.smem_limit:
                return t, staged, smem
    return None


def _per_block(req: Request, tiles: Sm90Tiles | None, hd: int, hdv: int) -> KernelChoice:
    """The instance whose blocks copy their own tiles (attention_fwd_sm90)."""
    bias_size = itemsize(req.bias_dtype)
    tiles, smem = first_fit(candidates(SM90_TILES, req, tiles),
                            lambda t: sm90_smem_bytes(t, hd, hdv, req.has_mask, bias_size),
                            req, "sm90")
    expr = FWD(T=req.dtype, BiasT=req.bias_dtype, HAS_MASK=req.has_mask, HEAD_DIM=hd,
               HEAD_DIM_V=hdv, BLOCK_N=tiles.block_n, NUM_WG=tiles.block_m // 64,
               STAGES=tiles.stages, ALIGNED=req.aligned,
               MIN_BLOCKS=resident_cap(tiles.min_blocks, smem), RAGGED=req.ragged)
    return KernelChoice("sm90", FORWARD_FILE, expr,
                        BlockTiles(tiles.block_m, tiles.block_n, hd, hdv, 1), hd, hdv, smem,
                        threads=tiles.num_warps * 32, ragged=req.ragged)


# ---- backward -------------------------------------------------------------------------

@dataclass(frozen=True)
class Sm90BwdTiles:
    block_m: int   # query tile of the dK/dV kernel (64 keys per block)
    block_n: int   # key tile of the dQ kernel (64 query rows per block)
    dkdv_min_blocks: int = 1
    dq_min_blocks: int = 1
    #: the overlapped forms (three stages): the next tile's S and dP are issued before this
    #: tile's gradient products, so the element-wise part runs under them
    dkdv_overlap: bool = False
    dq_overlap: bool = False
    #: the dK/dV kernel loads each query tile's lse and delta one request earlier into
    #: registers (the plain loads make the storing warps wait for global memory before the
    #: tile's S and dP products are issued)
    dkdv_stats_ahead: bool = False


#: (largest head dim, candidate tiles, reason).
SM90_BACKWARD_TILES = (
    (64, (Sm90BwdTiles(64, 64, 2, 3, dkdv_overlap=True, dq_overlap=True,
                       dkdv_stats_ahead=True),),
     "H200 bf16 D64 B4 H32 S4096: 291.4 / 248.6 TFLOP/s, overlapped, stats ahead"),
    (128, (Sm90BwdTiles(64, 64, dkdv_stats_ahead=True),),
     "H200 bf16 D128 S4096: 350.4 / 294.0 TFLOP/s, stats ahead (overlapped spills here)"),
)


#: attention_bwd_dkdv_sm90: the block's 64 keys of K and V, STAGES stages of Q, dO, lse,
#: delta and of the mask and bias tiles (ROWS queries x COLS = 64 keys)
DKDV_SMEM = Layout("BwdSm90DkdvSmem", "typename T, int HEAD_DIM, int HEAD_DIM_V, int ROWS, "
                   "int COLS, int STAGES, bool HAS_MASK, int BIAS_SIZE", (
    ("k_s", "T", "COLS * HEAD_DIM"),
    ("v_s", "T", "COLS * HEAD_DIM_V"),
    ("q_s", "T", "STAGES * ROWS * HEAD_DIM"),
    ("do_s", "T", "STAGES * ROWS * HEAD_DIM_V"),
    ("lse_s", "float", "STAGES * ROWS"),
    ("delta_s", "float", "STAGES * ROWS"),
    ("side_s", "unsigned char", SIDE),
))
#: attention_bwd_dq_sm90: the block's 64 rows of Q and dO, STAGES stages of K, V and of
#: the mask and bias tiles (ROWS = 64 queries x COLS keys)
DQ_SMEM = Layout("BwdSm90DqSmem", "typename T, int HEAD_DIM, int HEAD_DIM_V, int ROWS, int COLS, "
                 "int STAGES, bool HAS_MASK, int BIAS_SIZE", (
    ("q_s", "T", "ROWS * HEAD_DIM"),
    ("do_s", "T", "ROWS * HEAD_DIM_V"),
    ("k_s", "T", "STAGES * COLS * HEAD_DIM"),
    ("v_s", "T", "STAGES * COLS * HEAD_DIM_V"),
    ("side_s", "unsigned char", SIDE),
))


def sm90_backward_smem_bytes(tiles: Sm90BwdTiles, hd: int, hdv: int, has_mask: bool = False,
                             bias_itemsize: int = 0) -> tuple[int, int]:
    """Dynamic shared memory of attention_bwd_dkdv_sm90 and attention_bwd_dq_sm90."""
    side = dict(T=2, HEAD_DIM=hd, HEAD_DIM_V=hdv, HAS_MASK=has_mask, BIAS_SIZE=bias_itemsize)
    return (DKDV_SMEM.bytes(**side, ROWS=tiles.block_m, COLS=64,
                            STAGES=3 if tiles.dkdv_overlap else 2),
            DQ_SMEM.bytes(**side, ROWS=64, COLS=tiles.block_n,
                          STAGES=3 if tiles.dq_overlap else 2))


def backward(req: Request, tiles: Sm90BwdTiles | None = None) -> BackwardChoice:
    hd, hdv = ceil_to(req.head_dim, 64), ceil_to(req.head_dim_v, 64)
    cands = candidates(SM90_BACKWARD_TILES, req, tiles)
    if tiles is None and (req.bias_dtype is not None or req.has_mask or req.ragged == PACKED):
        # lse and delta a request ahead only where measured faster: with a mask and a bias
        # both its D64 and D128 forms run 2-3 % slower, their instances spilling more
        # (D128: 168 / 228 bytes against 68 / 108); a packed call's sequence takes the
        # registers (D128: 32 bytes spill with them)
        cands = tuple(replace(c, dkdv_stats_ahead=False) for c in cands)
    bias_size = itemsize(req.bias_dtype)
    tiles, smem = first_fit(
        cands, lambda t: sm90_backward_smem_bytes(t, hd, hdv, req.has_mask, bias_size), req,
        "sm90 backward")
    g_kv, g_q = req.grad_dtypes
    common = dict(T=req.dtype, BiasT=req.bias_dtype, HAS_MASK=req.has_mask, HEAD_DIM=hd,
                  HEAD_DIM_V=hdv, ALIGNED=req.aligned)
    ragged = PACKED if req.ragged == PACKED else DENSE  # key lengths: dense kernels
    return BackwardChoice(
        "sm90", BACKWARD_FILE, DELTA(T=req.dtype),
        DKDV(**common, G=g_kv, BLOCK_M=tiles.block_m,
             MIN_BLOCKS=resident_cap(tiles.dkdv_min_blocks, smem[0]),
             OVERLAP=tiles.dkdv_overlap, STATS_AHEAD=tiles.dkdv_stats_ahead, RAGGED=ragged),
        DQ(**common, G=g_q, BLOCK_N=tiles.block_n,
           MIN_BLOCKS=resident_cap(tiles.dq_min_blocks, smem[1]), OVERLAP=tiles.dq_overlap,
           RAGGED=ragged),
        64, 64, max(hd, hdv), hd, *smem, threads_dkdv=128, threads_dq=128, ragged=ragged)
