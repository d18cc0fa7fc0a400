"""Which kernel family and tile sizes serve a call: one table, read top to bottom.

``FAMILIES`` lists the attention kernel families in order of preference; the first row
whose conditions a call meets serves it. ``PORTABLE_TILES`` holds the tile sizes of the
portable family, each row with the measurement behind it. ``CUATTN_KERNEL`` (or the private
``kernel=`` argument) forces a family for every call, so tests can run each family on one
GPU; a forced family that cannot serve a call raises ``NotImplementedError``.
"""
from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass, replace

import numpy as np

from ._checks import AttentionCall
from ._kernels import c_type_name

__all__ = ["FAMILIES", "PORTABLE_TILES", "MMA_TILES", "MMA_F32_TILES", "MMA_F64_TILES", "Tiles",
           "MmaTiles", "SM90_TILES", "Sm90Tiles", "PipedTiles", "SM90_TF32_TILES",
           "sm90_piped_smem_bytes", "sm90_smem_bytes", "sm90_tf32_smem_bytes", "KernelChoice",
           "mma_wide_smem_bytes", "forward_kernel", "portable_smem_bytes", "mma_smem_bytes",
           "forward_instances",
           "BACKWARD_FAMILIES", "BACKWARD_TILES", "MMA_BACKWARD_TILES", "BwdTiles",
           "MmaBwdTiles", "BackwardChoice", "mma_backward_smem_bytes", "MMA_F32_BACKWARD_TILES",
           "MmaF32BwdTiles", "mma_f32_backward_smem_bytes", "SM90_BACKWARD_TILES",
           "Sm90BwdTiles", "sm90_backward_smem_bytes", "SM90_3XF16_BACKWARD_TILES",
           "Sm90F16SplitBwdTiles", "sm90_3xf16_backward_smem_bytes",
           "backward_kernels", "backward_smem_bytes", "backward_instances"]

THREADS = 256


@dataclass(frozen=True)
class Family:
    name: str
    filename: str
    min_cc: tuple[int, int]
    dtypes: tuple[str, ...]
    max_head_dim: int
    reason: str
    precisions: tuple[str, ...] | None = None  # float32 precisions served (None: all)
    archs: tuple[tuple[int, int], ...] | None = None  # capabilities served (None: >= min_cc)

    def serves(self, cc: tuple[int, int]) -> bool:
        return cc >= self.min_cc and (self.archs is None or cc in self.archs)

    def accepts(self, cc: tuple[int, int], dtype, head: int, precision=None) -> bool:
        """Does this family serve dtype with largest head dim ``head`` (and, for float32,
        ``precision``) on compute capability cc?"""
        return (self.serves(cc) and np.dtype(dtype).name in self.dtypes
                and head <= self.max_head_dim
                and (self.precisions is None or precision in self.precisions))


#: Attention families, most preferred first. A call takes the first row whose compute
#: capability, dtype, precision and head dims it meets.
FAMILIES = (
    Family("sm90", "attention_sm90.cu", (9, 0), ("float16", "bfloat16"), 128,
           "Hopper wgmma (sm_90a), 16-bit inputs; head dims to 128 (registers)",
           archs=((9, 0),)),
    Family("mma", "attention_mma.cu", (8, 0), ("float16", "bfloat16"), 256,
           "mma.sync m16n8k16 tensor cores (Ampere and newer), 16-bit inputs"),
    Family("sm90_tf32", "attention_sm90_tf32.cu", (9, 0), ("float32",), 128,
           "float32 'tf32' on Hopper wgmma .tf32 (sm_90a); head dims to 128 (registers)",
           precisions=("tf32",), archs=((9, 0),)),
    Family("sm90_3xf16", "attention_sm90_3xf16.cu", (9, 0), ("float32",), 128,
           "float32 'highest' on Hopper f16 wgmma: the 3xTF32 split scaled into float16",
           precisions=("highest",), archs=((9, 0),)),
    Family("mma_f32", "attention_mma_wide.cu", (8, 0), ("float32",), 256,
           "float32 'tf32' on mma.sync m16n8k8 TF32 tensor cores", precisions=("tf32",)),
    Family("mma_f64", "attention_mma_wide.cu", (8, 0), ("float64",), 128,
           "float64 on the DMMA tensor cores of A100, H100/H200, B200; head dims to 128",
           archs=((8, 0), (9, 0), (10, 0))),
    Family("portable", "attention_portable.cu", (5, 0),
           ("float16", "bfloat16", "float32", "float64"), 1024,
           "CUDA cores, every dtype and feature, head dims to 1024: the reference kernel"),
)


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


#: Portable family: (dtypes, largest head dim, candidate tiles in order of preference, the
#: measurement behind the order). A call takes the first row that matches its dtype and head
#: dims, then the first candidate whose shared memory fits the device; the last candidate of
#: each row fits 48 KB, so every GPU gets one. Reasons: H200, B4 H16 S4096 (fp32) and
#: B1 H16 S4096 (fp64), TFLOP/s non-causal / causal of the first candidate.
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


@dataclass(frozen=True)
class MmaTiles:
    block_m: int   # query rows per block: NUM_WARPS = block_m // (16 * m_tiles)
    block_n: int   # keys per tile
    m_tiles: int = 1  # 16-row tiles per warp: K and V fragments are reused this often
    min_blocks: int = 1  # __launch_bounds__ blocks per SM (caps registers)

    @property
    def num_warps(self) -> int:
        return self.block_m // (16 * self.m_tiles)


#: mma family: (largest head dim, candidate tiles in order of preference, measured reason).
#: Head dims are padded to a multiple of 64 inside the kernel (zero-filled in shared memory).
MMA_TILES = (
    (64, (MmaTiles(64, 64, 1, 3), MmaTiles(128, 64, 2), MmaTiles(64, 64)),
     "H200 bf16 D64 S4096: 234.1 / 211.0 TFLOP/s, capped at 3 blocks/SM"),
    (128, (MmaTiles(128, 32, 2), MmaTiles(64, 64)),
     "H200 bf16 D128 S4096: 275.4 / 237.1 TFLOP/s, 2 row tiles per warp"),
    (256, (MmaTiles(64, 32), MmaTiles(64, 16)),
     "H200 bf16 D256 S4096: 200.2 / 178.6 TFLOP/s, 248 registers, no spills"),
)


@dataclass(frozen=True)
class KernelChoice:
    family: str
    filename: str
    name_expression: str
    tiles: Tiles
    d_tile: int
    dv_tile: int
    shared_mem: int
    threads: int = THREADS
    #: sm90_tf32: the instance that reads prepared operands (prepare is True there), and
    #: the query length from which it is chosen (Sm90Tiles.prepare_from)
    prepared: KernelChoice | None = None
    prepare_from: int = 0
    prepare: bool = False
    #: a kernel run first that writes the largest magnitudes of each batch entry's q, k and
    #: v into a zeroed float[batch][5] (sm90_3xf16: the split's scales)
    magnitudes: str | None = None


def _pow2_at_least(n: int, lo: int) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def _first_fit(candidates, smem_of, smem_limit: int, family: str, request: str):
    """The first candidate tiles whose shared memory fits, with that shared memory.
    ``smem_of(tiles)`` is a byte count, or a tuple of counts (one per kernel) that must all
    fit; ``family`` and ``request`` name what did not fit in the error."""
    for tiles in candidates:
        smem = smem_of(tiles)
        if max(smem if isinstance(smem, tuple) else (smem,)) <= smem_limit:
            return tiles, smem
    raise NotImplementedError(f"no {family} tile configuration fits {smem_limit} bytes of "
                              f"shared memory for {request}")


def _bias_type(bias_dtype) -> str:
    return "cuattn::NoBias" if bias_dtype is None else c_type_name(bias_dtype)


def portable_smem_bytes(tiles: Tiles, d_tile: int, dv_tile: int, acc_itemsize: int,
                        pipelined: bool) -> int:
    """Dynamic shared memory of attention_fwd_portable (see the .cu header)."""
    pad = 16 // acc_itemsize
    if tiles.warps:  # Q, two stages of K, three of V (one each in lockstep), P
        k_stages, v_stages = (1, 1) if tiles.lockstep else (2, 3)
        return (tiles.block_m * (d_tile + pad) + k_stages * tiles.block_n * (d_tile + pad)
                + v_stages * tiles.block_n * (dv_tile + pad)
                + tiles.block_m * (tiles.block_n + pad)) * acc_itemsize
    if pipelined:
        kv = 2 * tiles.block_n * (d_tile + pad) + tiles.block_n * (dv_tile + pad)
    else:
        kv = tiles.block_n * (max(d_tile, dv_tile) + pad)
    elems = tiles.block_m * (d_tile + pad) + kv + tiles.block_m * (tiles.block_n + pad)
    return elems * acc_itemsize


def _portable(call_dtype, head_dim: int, head_dim_v: int, bias_dtype, has_mask: bool,
              aligned: bool, cc: tuple[int, int], smem_limit: int, tiles: Tiles | None = None):
    name = np.dtype(call_dtype).name
    head = max(head_dim, head_dim_v)
    acc_itemsize = 8 if name == "float64" else 4
    vec = 16 // acc_itemsize
    if tiles is None:
        candidates = next(c for dtypes, max_d, c, _ in PORTABLE_TILES
                          if name in dtypes and head <= max_d)
    else:
        candidates = (tiles,)

    if name not in ("float32", "float64") or cc < (8, 0) or head > 64:
        # the warp-tiled form copies float tiles as they are by cp.async, head dims to 64
        candidates = tuple(t for t in candidates if not t.warps)

    def layout(tiles):  # (d_tile, dv_tile, pipelined) of a candidate
        if tiles.warps:
            return _pow2_at_least(head_dim, 32), _pow2_at_least(head_dim_v, 32), True
        d_tile = min(_pow2_at_least(head_dim, 32), tiles.d_tile)
        dv_tile = min(_pow2_at_least(head_dim_v, 16 * vec), tiles.dv_tile)
        # cp.async double buffering (sm_80+) copies float32/float64 tiles as they are, when
        # Q fits one chunk; 16-bit inputs are converted to float on their way into shared memory
        pipelined = name in ("float32", "float64") and head_dim <= d_tile and cc >= (8, 0)
        return d_tile, dv_tile, pipelined

    def smem_of(tiles):
        d_tile, dv_tile, pipelined = layout(tiles)
        return portable_smem_bytes(tiles, d_tile, dv_tile, acc_itemsize, pipelined)

    tiles, smem = _first_fit(candidates, smem_of, smem_limit, "portable",
                             f"{name} with head dims {head_dim}, {head_dim_v}")
    d_tile, dv_tile, pipelined = layout(tiles)
    bias_t = _bias_type(bias_dtype)
    if tiles.warps:
        expr = (f"attention_fwd_portable_warps<{c_type_name(call_dtype)}, {bias_t}, "
                f"{str(has_mask).lower()}, {d_tile}, {dv_tile}, {tiles.block_n}, "
                f"{str(aligned).lower()}, {str(tiles.lockstep).lower()}>")
        return KernelChoice("portable", "attention_portable.cu", expr, tiles, d_tile, dv_tile,
                            smem)
    expr = (f"attention_fwd_portable<{c_type_name(call_dtype)}, {bias_t}, "
            f"{str(has_mask).lower()}, {tiles.block_m}, {tiles.block_n}, {d_tile}, "
            f"{dv_tile}, {tiles.min_blocks}, {str(pipelined).lower()}, "
            f"{str(pipelined and aligned).lower()}>")
    return KernelChoice("portable", "attention_portable.cu", expr, tiles, d_tile, dv_tile, smem)


def mma_smem_bytes(tiles: MmaTiles, head_dim: int, head_dim_v: int, itemsize: int = 2) -> int:
    """Dynamic shared memory of attention_fwd_mma (see the .cu header)."""
    return (tiles.block_m * head_dim + 2 * tiles.block_n * (head_dim + head_dim_v)) * itemsize


def _ceil64(n: int) -> int:
    return -(-n // 64) * 64


def _mma(call_dtype, head_dim: int, head_dim_v: int, bias_dtype, has_mask: bool,
         aligned: bool, smem_limit: int, tiles: MmaTiles | None = None):
    head = max(head_dim, head_dim_v)
    hd, hdv = _ceil64(head_dim), _ceil64(head_dim_v)
    candidates = (tiles,) if tiles is not None else next(
        c for max_d, c, _ in MMA_TILES if head <= max_d)
    tiles, smem = _first_fit(candidates, lambda t: mma_smem_bytes(t, hd, hdv), smem_limit,
                             "mma", f"head dims {head_dim}, {head_dim_v}")
    bias_t = _bias_type(bias_dtype)
    expr = (f"attention_fwd_mma<{c_type_name(call_dtype)}, {bias_t}, {str(has_mask).lower()}, "
            f"{hd}, {hdv}, {tiles.block_n}, {tiles.num_warps}, {tiles.m_tiles}, "
            f"{str(aligned).lower()}, {tiles.min_blocks}>")
    return KernelChoice("mma", "attention_mma.cu", expr,
                        Tiles(tiles.block_m, tiles.block_n, hd, hdv, 1), hd, hdv, smem,
                        threads=tiles.num_warps * 32)


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
    piped: PipedTiles | None = None

    @property
    def num_warps(self) -> int:
        return self.block_m // 16


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


#: sm90 family: (largest head dim, candidate tiles in order of preference, measured reason).
SM90_TILES = (
    (64, (Sm90Tiles(64, 64, 4), Sm90Tiles(64, 64), Sm90Tiles(64, 128), Sm90Tiles(128, 128)),
     "H200 bf16 D64 S4096: 315.4 / 287.5 TFLOP/s, capped at 4 blocks/SM"),
    (128, (Sm90Tiles(64, 64), Sm90Tiles(128, 128), Sm90Tiles(128, 64)),
     "H200 bf16 D128 S4096: 398.1 / 323.8 TFLOP/s, one warpgroup"),
)


#: Query rows from which the sm90_tf32 family takes its piped instance (Sm90Tiles.prepare_from),
#: measured at B8 H16 S2048 and B4 H16 S4096.
PIPED_FROM_D64 = 2048
PIPED_FROM_D128 = 2048

#: sm90_tf32 family: (largest head dim, candidate tiles in order of preference, measured reason:
#: TFLOP/s non-causal / causal at B4 H16, of the per-block and the piped instance).
SM90_TF32_TILES = (
    (64, (Sm90Tiles(128, 128, prepare_from=PIPED_FROM_D64, piped=PipedTiles(192, 64, 4, qreg=True)),
          Sm90Tiles(128, 64), Sm90Tiles(64, 64)),
     "H200 fp32 D64 S4096: 141.8 / 126.8 TFLOP/s per block, 198.3 / 142.4 piped"),
    (128, (Sm90Tiles(128, 64, prepare_from=PIPED_FROM_D128, piped=PipedTiles(192, 32, 4)),
           Sm90Tiles(128, 32), Sm90Tiles(64, 32)),
     "H200 fp32 D128 S4096: 166.2 / 152.1 TFLOP/s per block, 230.2 / 167.7 piped"),
)


def side_pitch(itemsize: int, cols: int) -> int:
    """Row pitch in bytes of a staged mask or bias tile of ``cols`` elements (mma_tiles.cuh
    side_pitch: its 16-byte chunks, one more for a misaligned start)."""
    return 16 * (cols * itemsize // 16 + 1)


def side_bytes(rows: int, cols: int, has_mask: bool, bias_itemsize: int) -> int:
    """Shared memory of one stage of a kernel's mask and bias tiles (rows x cols elements;
    bias_itemsize 0: no bias)."""
    return rows * ((side_pitch(1, cols) if has_mask else 0)
                   + (side_pitch(bias_itemsize, cols) if bias_itemsize else 0))


#: shared memory of an sm_90 SM (228 KB), of which each resident block also takes 1 KB
SM90_SMEM_PER_SM = 233472


def _resident_cap(min_blocks: int, smem: int) -> int:
    """A kernel's register cap for ``min_blocks`` blocks per SM buys only as many blocks as
    their shared memory lets in together (a staged mask or bias can lower that): the
    smaller of the two, at least 1."""
    return max(1, min(min_blocks, SM90_SMEM_PER_SM // (smem + 1024)))


def sm90_smem_bytes(tiles: Sm90Tiles, head_dim: int, head_dim_v: int, has_mask: bool = False,
                    bias_itemsize: int = 0) -> int:
    """Dynamic shared memory of attention_fwd_sm90 (16-bit elements; see the .cu header):
    Q and tiles.stages stages of K and of V, and of the mask and bias tiles."""
    return ((tiles.block_m * head_dim + tiles.stages * tiles.block_n * (head_dim + head_dim_v)) * 2
            + tiles.stages * side_bytes(tiles.block_m, tiles.block_n, has_mask, bias_itemsize))


def sm90_tf32_smem_bytes(tiles: Sm90Tiles, head_dim: int, head_dim_v: int) -> int:
    """Dynamic shared memory of attention_fwd_sm90_tf32 (float elements; see the .cu
    header): Q, two stages of K, the V staging tile and V^T."""
    return (tiles.block_m * head_dim + 2 * tiles.block_n * (head_dim + head_dim_v)) * 4


def sm90_piped_smem_bytes(tiles: PipedTiles, head_dim: int, head_dim_v: int) -> int:
    """Dynamic shared memory of attention_fwd_sm90_tf32_piped (see the .cu header): Q,
    tiles.slots slots of a K tile and a V^T tile, and two 8-byte barriers per slot."""
    return ((tiles.block_m * head_dim + tiles.slots * tiles.block_n * (head_dim + head_dim_v))
            * 4 + 16 * tiles.slots)


def _sm90(family: str, call_dtype, head_dim: int, head_dim_v: int, bias_dtype,
          has_mask: bool, aligned: bool, smem_limit: int, tiles: Sm90Tiles | None = None):
    """The sm90 and sm90_tf32 families: attention_fwd_sm90<T, ...> or
    attention_fwd_sm90_tf32<...> (float, with its piped instance)."""
    head = max(head_dim, head_dim_v)
    hd, hdv = _ceil64(head_dim), _ceil64(head_dim_v)
    table = SM90_TILES if family == "sm90" else SM90_TF32_TILES
    candidates = (tiles,) if tiles is not None else next(
        c for max_d, c, _ in table if head <= max_d)
    bias_size = 0 if bias_dtype is None else np.dtype(bias_dtype).itemsize
    smem_of = ((lambda t: sm90_smem_bytes(t, hd, hdv, has_mask, bias_size)) if family == "sm90"
               else (lambda t: sm90_tf32_smem_bytes(t, hd, hdv)))
    tiles, smem = _first_fit(candidates, smem_of, smem_limit, family,
                             f"head dims {head_dim}, {head_dim_v}")
    head_args = f"{_bias_type(bias_dtype)}, {str(has_mask).lower()}, {hd}, {hdv}, "
    common = f"{head_args}{tiles.block_n}, {tiles.block_m // 64}, "
    tail = f"{str(aligned).lower()}, {tiles.min_blocks}>"
    layout = Tiles(tiles.block_m, tiles.block_n, hd, hdv, 1)
    if family == "sm90":  # the 16-bit kernel takes T
        tail = f"{str(aligned).lower()}, {_resident_cap(tiles.min_blocks, smem)}>"
        expr = f"attention_fwd_sm90<{c_type_name(call_dtype)}, {common}{tiles.stages}, {tail}"
        return KernelChoice(family, "attention_sm90.cu", expr, layout, hd, hdv, smem,
                            threads=tiles.num_warps * 32)
    # the float kernel, with the piped instance for long calls
    expr = "attention_fwd_sm90_tf32<" + common + tail
    prepared, piped = None, tiles.piped
    if piped is not None and tiles.prepare_from:
        piped_smem = sm90_piped_smem_bytes(piped, hd, hdv)
        piped_expr = (f"attention_fwd_sm90_tf32_piped<{head_args}{piped.block_n}, "
                      f"{piped.block_m // 64}, {piped.slots}, {str(piped.qreg).lower()}, "
                      f"{str(aligned).lower()}>")
        if piped_smem <= smem_limit:
            prepared = KernelChoice(family, "attention_sm90_tf32.cu", piped_expr,
                                    Tiles(piped.block_m, piped.block_n, hd, hdv, 1), hd, hdv,
                                    piped_smem, threads=piped.num_warps * 32, prepare=True)
    return KernelChoice(family, "attention_sm90_tf32.cu", expr, layout, hd, hdv, smem,
                        threads=tiles.num_warps * 32, prepared=prepared,
                        prepare_from=tiles.prepare_from)


#: sm90_3xf16 forward: (largest head dim, candidate tiles, reason). ptxas (sm_90a), no
#: spills: D64 64-key tiles, two warpgroups 213 registers; D128 32-key tiles 225.
SM90_3XF16_TILES = (
    (64, (Sm90Tiles(128, 64), Sm90Tiles(64, 64)),
     "H200 fp32 D64 S4096: 94.0 / 88.7 TFLOP/s, two warpgroups, not swept"),
    (128, (Sm90Tiles(128, 32), Sm90Tiles(64, 32)),
     "H200 fp32 D128 S4096: 106.9 / 98.4 TFLOP/s, two warpgroups, not swept"),
)


def sm90_3xf16_smem_bytes(tiles: Sm90Tiles, hd: int, hdv: int) -> int:
    """Dynamic shared memory of attention_fwd_sm90_3xf16 (the .cu header)."""
    bn = tiles.block_n
    return ((tiles.block_m // 64) * 2 * 64 * hd + 2 * bn * (hd + hdv)) * 2 + 2 * bn * (hd + hdv) * 4


def _sm90_3xf16(head_dim: int, head_dim_v: int, bias_dtype, has_mask: bool, aligned: bool,
                smem_limit: int, tiles: Sm90Tiles | None = None):
    head = max(head_dim, head_dim_v)
    hd, hdv = _ceil64(head_dim), _ceil64(head_dim_v)
    candidates = (tiles,) if tiles is not None else next(
        c for max_d, c, _ in SM90_3XF16_TILES if head <= max_d)
    tiles, smem = _first_fit(candidates, lambda t: sm90_3xf16_smem_bytes(t, hd, hdv),
                             smem_limit, "sm90_3xf16", f"head dims {head_dim}, {head_dim_v}")
    expr = (f"attention_fwd_sm90_3xf16<{_bias_type(bias_dtype)}, {str(has_mask).lower()}, "
            f"{hd}, {hdv}, {tiles.block_n}, {tiles.block_m // 64}, {str(aligned).lower()}, "
            f"{tiles.min_blocks}>")
    return KernelChoice("sm90_3xf16", "attention_sm90_3xf16.cu", expr,
                        Tiles(tiles.block_m, tiles.block_n, hd, hdv, 1), hd, hdv, smem,
                        threads=tiles.num_warps * 32, magnitudes="attention_fwd_magnitudes")


def mma_aligned(call: AttentionCall) -> bool:
    """May the mma families (and the pipelined portable kernel) copy q, k, v in 16-byte
    chunks? Unit column strides, every other
    stride a multiple of 16 bytes, 16-byte aligned pointers, head dims multiples of 16 bytes
    (8 elements of 16 bits, 4 of float32)."""
    vec = 16 // call.dtype.itemsize
    if call.head_dim % vec or call.head_dim_v % vec:
        return False
    return all(_aligned(x) for x in (call.q, call.k, call.v))


def _aligned(x) -> bool:
    """One array's part of :func:`mma_aligned` (the head dims are the caller's check):
    16-byte aligned pointer, unit column stride, other strides multiples of 16 bytes. Plain
    loops: this runs on every call."""
    if x.data.ptr % 16:
        return False
    shape, strides = x.shape, x.strides
    if shape[-1] > 1 and strides[-1] != x.itemsize:
        return False
    for n, st in zip(shape[:-1], strides[:-1]):
        if n > 1 and st % 16:
            return False
    return True


#: mma_f32 family: (largest head dim, candidate tiles, reason). Head dims are padded to
#: multiples of 32. TFLOP/s of float32 "tf32" on the H200, B4 H16 S4096, non-causal / causal,
#: tools/sweep_tiles.py --f32.
MMA_F32_TILES = (
    (64, (MmaTiles(128, 64, 2), MmaTiles(64, 64), MmaTiles(64, 32), MmaTiles(32, 16)),
     "115.2 / 105.1, 2 row tiles per warp (109 KB, 2 blocks/SM)"),
    (128, (MmaTiles(64, 32), MmaTiles(128, 16, 2), MmaTiles(64, 16), MmaTiles(32, 16)),
     "86.1 / 83.4, 64x32"),
    (256, (MmaTiles(64, 32), MmaTiles(32, 16), MmaTiles(32, 8)),
     "not swept: 64x32 needs 202 KB; the others fit 164 KB and 99 KB"),
)

#: mma_f64 family, as MMA_F32_TILES (double operands: twice the shared memory per tile).
#: TFLOP/s on the H200, non-causal / causal, tools/sweep_tiles.py --f64.
MMA_F64_TILES = (
    (64, (MmaTiles(64, 16, 1, 3), MmaTiles(64, 32), MmaTiles(32, 32), MmaTiles(32, 16)),
     "B1 H16 S4096: 35.6 / 34.2, capped at 3 blocks/SM (168 registers)"),
    (128, (MmaTiles(128, 16), MmaTiles(64, 16), MmaTiles(32, 16)),
     "B1 H16 S4096: 41.1 / 38.2, 128x16"),
)


def mma_wide_smem_bytes(tiles: MmaTiles, head_dim: int, head_dim_v: int, itemsize: int) -> int:
    """Dynamic shared memory of attention_fwd_mma_wide (see the .cu header)."""
    q_pair_pitch = 2 * head_dim + (2 if itemsize == 8 else 16)
    return (tiles.block_m // 2 * q_pair_pitch + 2 * tiles.block_n * (head_dim + 8)
            + 2 * tiles.block_n * (head_dim_v + 16 // itemsize)) * itemsize


def _mma_wide(family: str, call_dtype, head_dim: int, head_dim_v: int, bias_dtype,
              has_mask: bool, aligned: bool, smem_limit: int, tiles: MmaTiles | None = None):
    """The mma_f32 and mma_f64 families: attention_fwd_mma_wide<float or double, ...>."""
    head = max(head_dim, head_dim_v)
    hd, hdv = -(-head_dim // 32) * 32, -(-head_dim_v // 32) * 32
    table = MMA_F32_TILES if family == "mma_f32" else MMA_F64_TILES
    candidates = (tiles,) if tiles is not None else next(
        c for max_d, c, _ in table if head <= max_d)
    tiles, smem = _first_fit(
        candidates, lambda t: mma_wide_smem_bytes(t, hd, hdv, call_dtype.itemsize),
        smem_limit, family, f"head dims {head_dim}, {head_dim_v}")
    expr = (f"attention_fwd_mma_wide<{c_type_name(call_dtype)}, {_bias_type(bias_dtype)}, "
            f"{str(has_mask).lower()}, {hd}, {hdv}, {tiles.block_n}, {tiles.num_warps}, "
            f"{tiles.m_tiles}, {tiles.min_blocks}, "
            f"{str(aligned).lower()}>")
    return KernelChoice(family, "attention_mma_wide.cu", expr,
                        Tiles(tiles.block_m, tiles.block_n, hd, hdv, 1), hd, hdv, smem,
                        threads=tiles.num_warps * 32)


def _forced_family(kernel: str | None, families, absent: str) -> str | None:
    """The family forced by ``kernel`` or CUATTN_KERNEL (None: dispatch chooses); a name
    that ``families`` lacks raises NotImplementedError with ``absent`` in the message."""
    forced = kernel or os.environ.get("CUATTN_KERNEL") or None
    names = [f.name for f in families]
    if forced is not None and forced not in names:
        raise NotImplementedError(f"kernel family {forced!r} {absent}; "
                                  f"available: {', '.join(names)}")
    return forced


def _no_family(what: str, call, cc: tuple[int, int], forced: str | None):
    return NotImplementedError(
        f"no {what} serves {call.dtype} with head dims ({call.head_dim}, "
        f"{call.head_dim_v}) on compute capability {cc[0]}.{cc[1]}"
        + (f" (forced: {forced!r})" if forced else ""))


def forward_kernel(call: AttentionCall, cc: tuple[int, int], smem_limit: int,
                   kernel: str | None = None, tiles: Tiles | None = None):
    """The kernel instance that serves a validated forward call on a GPU of capability cc
    with ``smem_limit`` bytes of shared memory per block (after opt-in). ``tiles``
    overrides the table's tile sizes (tile sweeps, tools/sweep_tiles.py)."""
    forced = _forced_family(kernel, FAMILIES, "is not in this build")
    bias_dtype = None if call.bias is None else call.bias.dtype
    aligned = mma_aligned(call)
    choice = _choose(call.dtype, call.head_dim, call.head_dim_v, bias_dtype,
                     call.mask is not None, aligned, cc, smem_limit, forced, tiles,
                     call.precision)
    if choice is not None:
        banded = call.window_left >= 0 or call.window_right >= 0
        return with_prepared_operands(choice, call.seqlen_q, banded)
    raise _no_family("kernel family", call, cc, forced)


def with_prepared_operands(choice: KernelChoice, seqlen_q: int, banded: bool) -> KernelChoice:
    """The instance that reads prepared operands when the choice has one and the call has
    enough query rows for it (Sm90Tiles.prepare_from; a causal or window band counts half
    of them), else the choice itself."""
    rows = seqlen_q // 2 if banded else seqlen_q
    if choice.prepared is not None and rows >= choice.prepare_from:
        return choice.prepared
    return choice


@functools.lru_cache(maxsize=1024)
def _choose(dtype, head_dim, head_dim_v, bias_dtype, has_mask, aligned, cc, smem_limit,
            forced, tiles, precision=None):
    """The table lookup proper, cached: a call's choice depends on these values only."""
    for family in FAMILIES:
        if forced is not None and family.name != forced:
            continue
        if not family.accepts(cc, dtype, max(head_dim, head_dim_v), precision):
            continue
        if family.name in ("sm90", "sm90_tf32"):
            return _sm90(family.name, dtype, head_dim, head_dim_v, bias_dtype, has_mask,
                         aligned, smem_limit, tiles)
        if family.name == "sm90_3xf16":
            return _sm90_3xf16(head_dim, head_dim_v, bias_dtype, has_mask, aligned, smem_limit,
                               tiles)
        if family.name == "mma":
            return _mma(dtype, head_dim, head_dim_v, bias_dtype, has_mask, aligned,
                        smem_limit, tiles)
        if family.name in ("mma_f32", "mma_f64"):
            return _mma_wide(family.name, dtype, head_dim, head_dim_v, bias_dtype, has_mask,
                             aligned, smem_limit, tiles)
        return _portable(dtype, head_dim, head_dim_v, bias_dtype, has_mask, aligned, cc,
                         smem_limit, tiles)
    return None


# ---- backward ---------------------------------------------------------------------

#: Backward families, most preferred first (the same rules as FAMILIES).
BACKWARD_FAMILIES = (
    Family("sm90", "attention_backward_sm90.cu", (9, 0), ("float16", "bfloat16"), 128,
           "Hopper wgmma (sm_90a), 16-bit inputs; head dims to 128 (registers of dK, dV)",
           archs=((9, 0),)),
    Family("mma", "attention_backward_mma.cu", (8, 0), ("float16", "bfloat16"), 256,
           "mma.sync m16n8k16 tensor cores, 16-bit inputs; above 128, column tiles of dK, dV"),
    Family("sm90_3xf16", "attention_backward_sm90_3xf16.cu", (9, 0), ("float32",), 128,
           "float32 'highest' on Hopper f16 wgmma, with the sm90_3xf16 forward's scores",
           precisions=("highest",), archs=((9, 0),)),
    Family("mma_f32", "attention_backward_mma_f32.cu", (8, 0), ("float32",), 128,
           "float32 'tf32' on mma.sync m16n8k8 TF32 tensor cores; head dims to 128",
           precisions=("tf32",)),
    Family("portable", "attention_backward_portable.cu", (5, 0),
           ("float16", "bfloat16", "float32", "float64"), 1024,
           "CUDA cores, every dtype and feature, deterministic (no atomics)"),
)


@dataclass(frozen=True)
class BwdTiles:
    block_m: int   # query rows per tile
    block_n: int   # keys per tile
    d_tile: int    # largest contraction chunk and output-column tile
    min_blocks: int = 1


#: Portable backward: (dtypes, largest head dim, candidate tiles in order of preference,
#: reason). Both kernels (dK/dV and dQ) use the chosen tiles; a call takes the first row that
#: matches, then the first candidate whose shared memory fits; the last fits 48 KB.
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


@dataclass(frozen=True)
class MmaBwdTiles:
    dkdv_warps: int  # keys per dK/dV block: 16 per warp
    block_m: int     # query tile of the dK/dV kernel
    dq_warps: int    # query rows per dQ block: 16 per warp
    block_n: int     # key tile of the dQ kernel
    dkdv_min_blocks: int = 1  # __launch_bounds__ blocks per SM (caps registers)
    dq_min_blocks: int = 1


#: mma backward: (largest head dim, oldest compute capability, candidate tiles, reason). A call
#: takes the first row whose head dim and capability it meets (ptxas allocates registers
#: differently for sm_8x: the Hopper rows spill there), then the first candidate that fits.
#: Head dims are padded to a multiple of 64 inside the kernels.
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


@dataclass(frozen=True)
class MmaF32BwdTiles(MmaBwdTiles):
    """MmaBwdTiles of the float32 backward (attention_backward_mma_f32.cu), with:"""
    preround: bool = False  # streamed tiles rounded to TF32 once in shared memory


F = MmaF32BwdTiles
#: mma_f32 backward ("tf32"): (largest head dim, candidate tiles, reason). A call takes the
#: first row whose head dim it meets, then the first candidate that fits. Head dims are
#: padded to a multiple of 64 inside the kernels.
MMA_F32_BACKWARD_TILES = (
    (64, (F(4, 32, 4, 32, 2, 3, preround=True), F(4, 16, 4, 16, 2, 3)),
     "H200 fp32 D64 B4 H32 S4096: 71.5 / 66.9 TFLOP/s, tiles rounded once"),
    (128, (F(4, 16, 4, 16, 2, 2, preround=True),),
     "H200 fp32 D128 S4096: 56.6 / 54.0 TFLOP/s, tiles rounded once, 2 blocks/SM"),
)
del F


@dataclass(frozen=True)
class BackwardChoice:
    family: str
    filename: str
    delta: str        # name expressions of the three kernels
    dkdv: str
    dq: str
    dkdv_rows: int    # keys per dK/dV block
    dq_rows: int      # query rows per dQ block
    col_tile: int     # output columns per dK/dV block (the grid splits wider head dims)
    dq_col_tile: int  # output columns per dQ block
    smem_dkdv: int
    smem_dq: int
    threads_dkdv: int = THREADS
    threads_dq: int = THREADS
    threads_delta: int = THREADS
    # blocks per dK/dV column tile: 2 when dK and dV run in separate blocks (sm90_3xf16's
    # dkdv_roles=2 form; blocks own every column: grid column tile 0 dV, 1 dK)
    dkdv_roles: int = 1
    # a kernel run before delta that writes the largest magnitudes of each batch entry's q,
    # k, v, dout and out into a zeroed float[batch][5] (sm90_3xf16: the split's scales)
    magnitudes: str | None = None


def backward_smem_bytes(tiles: BwdTiles, d_tile: int, acc_itemsize: int) -> tuple[int, int]:
    """Dynamic shared memory of attention_bwd_dkdv and attention_bwd_dq (the .cu header)."""
    pad = 16 // acc_itemsize
    bm, bn = tiles.block_m, tiles.block_n
    dkdv = 2 * bn * (d_tile + pad) + 2 * bm * (d_tile + pad) + 2 * bn * (bm + pad)
    dq = 2 * bm * (d_tile + pad) + 2 * bn * (d_tile + pad) + bm * (bn + pad)
    return dkdv * acc_itemsize, dq * acc_itemsize


def mma_backward_smem_bytes(tiles: MmaBwdTiles, hd: int, hdv: int) -> tuple[int, int]:
    """Dynamic shared memory of attention_bwd_dkdv_mma and attention_bwd_dq_mma."""
    dkdv = (16 * tiles.dkdv_warps * (hd + hdv) + 2 * tiles.block_m * (hd + hdv)) * 2 \
        + 2 * 2 * tiles.block_m * 4
    dq = (16 * tiles.dq_warps + 2 * tiles.block_n) * (hd + hdv) * 2
    return dkdv, dq


def mma_f32_backward_smem_bytes(tiles: MmaF32BwdTiles, hd: int, hdv: int) -> tuple[int, int]:
    """Dynamic shared memory of attention_bwd_dkdv_mma_f32 and attention_bwd_dq_mma_f32."""
    dkdv = (16 * tiles.dkdv_warps * (hd + hdv) + 2 * tiles.block_m * (hd + hdv + 8)
            + 2 * 2 * tiles.block_m) * 4
    dq = (16 * tiles.dq_warps * (hd + hdv) + 2 * tiles.block_n * (hd + hdv + 8)) * 4
    return dkdv, dq


def _portable_backward(dtype, head_dim: int, head_dim_v: int, bias_dtype, has_mask: bool,
                       grad_dtypes, smem_limit: int, tiles: BwdTiles | None = None):
    name = np.dtype(dtype).name
    head = max(head_dim, head_dim_v)
    acc_itemsize = 8 if name == "float64" else 4
    vec = 16 // acc_itemsize
    candidates = (tiles,) if tiles is not None else next(
        c for dtypes, max_d, c, _ in BACKWARD_TILES if name in dtypes and head <= max_d)

    def d_tile_of(tiles):
        return min(_pow2_at_least(head, 16 * vec), tiles.d_tile)

    tiles, smem = _first_fit(
        candidates, lambda t: backward_smem_bytes(t, d_tile_of(t), acc_itemsize), smem_limit,
        "portable backward", f"{name} with head dims {head_dim}, {head_dim_v}")
    d_tile = d_tile_of(tiles)
    resident = head <= d_tile
    t = c_type_name(dtype)
    common = (f"{_bias_type(bias_dtype)}, {str(has_mask).lower()}, {tiles.block_m}, "
              f"{tiles.block_n}, {d_tile}, {str(resident).lower()}, {tiles.min_blocks}")
    g_kv, g_q = (c_type_name(g) for g in grad_dtypes)
    return BackwardChoice(
        "portable", "attention_backward_portable.cu", f"attention_bwd_delta<{t}>",
        f"attention_bwd_dkdv<{t}, {g_kv}, {common}>", f"attention_bwd_dq<{t}, {g_q}, {common}>",
        tiles.block_n, tiles.block_m, d_tile, d_tile, *smem)


def _mma_backward(dtype, head_dim: int, head_dim_v: int, bias_dtype, has_mask: bool,
                  grad_dtypes, aligned: bool, cc: tuple[int, int], smem_limit: int,
                  tiles: MmaBwdTiles | None = None):
    head = max(head_dim, head_dim_v)
    hd, hdv = _ceil64(head_dim), _ceil64(head_dim_v)
    candidates = (tiles,) if tiles is not None else next(
        c for max_d, min_cc, c, _ in MMA_BACKWARD_TILES if head <= max_d and cc >= min_cc)
    tiles, smem = _first_fit(candidates, lambda t: mma_backward_smem_bytes(t, hd, hdv),
                             smem_limit, "mma backward", f"head dims {head_dim}, {head_dim_v}")
    # output columns per block: all up to 128, else 128- or 64-column tiles that divide
    # both padded head dims
    if max(hd, hdv) <= 128:
        cols = max(hd, hdv)
    else:
        cols = 128 if hd % 128 == 0 and hdv % 128 == 0 else 64
    t = c_type_name(dtype)
    g_kv, g_q = (c_type_name(g) for g in grad_dtypes)
    flags = f"{_bias_type(bias_dtype)}, {str(has_mask).lower()}, {hd}, {hdv}, {cols}"
    al = str(aligned).lower()
    return BackwardChoice(
        "mma", "attention_backward_mma.cu", f"attention_bwd_delta<{t}>",
        f"attention_bwd_dkdv_mma<{t}, {g_kv}, {flags}, {tiles.block_m}, {tiles.dkdv_warps}, "
        f"{al}, {tiles.dkdv_min_blocks}>",
        f"attention_bwd_dq_mma<{t}, {g_q}, {flags}, {tiles.block_n}, {tiles.dq_warps}, {al}, "
        f"{tiles.dq_min_blocks}>",
        16 * tiles.dkdv_warps, 16 * tiles.dq_warps, cols, min(cols, hd), *smem,
        threads_dkdv=32 * tiles.dkdv_warps, threads_dq=32 * tiles.dq_warps)


def _mma_f32_backward(head_dim: int, head_dim_v: int, bias_dtype, has_mask: bool,
                      aligned: bool, smem_limit: int, tiles: MmaF32BwdTiles | None = None):
    head = max(head_dim, head_dim_v)
    hd, hdv = _ceil64(head_dim), _ceil64(head_dim_v)
    candidates = (tiles,) if tiles is not None else next(
        c for max_d, c, _ in MMA_F32_BACKWARD_TILES if head <= max_d)
    tiles, smem = _first_fit(candidates, lambda t: mma_f32_backward_smem_bytes(t, hd, hdv),
                             smem_limit, "mma_f32 backward",
                             f"head dims {head_dim}, {head_dim_v}")
    flags = f"{_bias_type(bias_dtype)}, {str(has_mask).lower()}, {hd}, {hdv}"
    pre, al = (str(x).lower() for x in (tiles.preround, aligned))
    return BackwardChoice(
        "mma_f32", "attention_backward_mma_f32.cu", "attention_bwd_delta<float>",
        f"attention_bwd_dkdv_mma_f32<{flags}, {tiles.block_m}, {tiles.dkdv_warps}, {pre}, "
        f"{al}, {tiles.dkdv_min_blocks}>",
        f"attention_bwd_dq_mma_f32<{flags}, {tiles.block_n}, {tiles.dq_warps}, {pre}, {al}, "
        f"{tiles.dq_min_blocks}>",
        16 * tiles.dkdv_warps, 16 * tiles.dq_warps, max(hd, hdv), hd, *smem,
        threads_dkdv=32 * tiles.dkdv_warps, threads_dq=32 * tiles.dq_warps)


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


#: sm90 backward: (largest head dim, candidate tiles, measured reason).
SM90_BACKWARD_TILES = (
    (64, (Sm90BwdTiles(64, 64, 2, 3, dkdv_overlap=True, dq_overlap=True,
                       dkdv_stats_ahead=True),),
     "H200 bf16 D64 B4 H32 S4096: 291.4 / 248.6 TFLOP/s, overlapped, stats ahead"),
    (128, (Sm90BwdTiles(64, 64, dkdv_stats_ahead=True),),
     "H200 bf16 D128 S4096: 350.4 / 294.0 TFLOP/s, stats ahead (overlapped spills here)"),
)


def sm90_backward_smem_bytes(tiles: Sm90BwdTiles, hd: int, hdv: int, has_mask: bool = False,
                             bias_itemsize: int = 0) -> tuple[int, int]:
    """Dynamic shared memory of attention_bwd_dkdv_sm90 and attention_bwd_dq_sm90 (with
    their staged mask and bias tiles)."""
    dkdv_stages = 3 if tiles.dkdv_overlap else 2
    dq_stages = 3 if tiles.dq_overlap else 2
    dkdv = ((64 * (hd + hdv) + dkdv_stages * tiles.block_m * (hd + hdv)) * 2
            + dkdv_stages * 2 * tiles.block_m * 4
            + dkdv_stages * side_bytes(tiles.block_m, 64, has_mask, bias_itemsize))
    dq = ((64 + dq_stages * tiles.block_n) * (hd + hdv) * 2
          + dq_stages * side_bytes(64, tiles.block_n, has_mask, bias_itemsize))
    return dkdv, dq


def _sm90_backward(dtype, head_dim: int, head_dim_v: int, bias_dtype, has_mask: bool,
                   grad_dtypes, aligned: bool, smem_limit: int,
                   tiles: Sm90BwdTiles | None = None):
    head = max(head_dim, head_dim_v)
    hd, hdv = _ceil64(head_dim), _ceil64(head_dim_v)
    candidates = (tiles,) if tiles is not None else next(
        c for max_d, c, _ in SM90_BACKWARD_TILES if head <= max_d)
    if tiles is None and (bias_dtype is not None or has_mask):
        # the table's lse and delta a request ahead only where measured faster: with a mask
        # and a bias both its D64 and D128 forms run 2-3 % slower, their instances spilling
        # more (D128: 168 / 228 bytes against 68 / 108)
        candidates = tuple(replace(c, dkdv_stats_ahead=False) for c in candidates)
    bias_size = 0 if bias_dtype is None else np.dtype(bias_dtype).itemsize
    tiles, smem = _first_fit(candidates,
                             lambda t: sm90_backward_smem_bytes(t, hd, hdv, has_mask, bias_size),
                             smem_limit, "sm90 backward", f"head dims {head_dim}, {head_dim_v}")
    t = c_type_name(dtype)
    g_kv, g_q = (c_type_name(g) for g in grad_dtypes)
    flags = f"{_bias_type(bias_dtype)}, {str(has_mask).lower()}, {hd}, {hdv}"
    al = str(aligned).lower()
    return BackwardChoice(
        "sm90", "attention_backward_sm90.cu", f"attention_bwd_delta<{t}>",
        f"attention_bwd_dkdv_sm90<{t}, {g_kv}, {flags}, {tiles.block_m}, {al}, "
        f"{_resident_cap(tiles.dkdv_min_blocks, smem[0])}, {str(tiles.dkdv_overlap).lower()}"
        f"{', true' if tiles.dkdv_stats_ahead else ''}>",
        f"attention_bwd_dq_sm90<{t}, {g_q}, {flags}, {tiles.block_n}, {al}, "
        f"{_resident_cap(tiles.dq_min_blocks, smem[1])}, {str(tiles.dq_overlap).lower()}>",
        64, 64, max(hd, hdv), hd, *smem, threads_dkdv=128, threads_dq=128)


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


#: sm90_3xf16 backward: (largest head dim, candidate tiles, reason). ptxas (sm_90a, the
#: staggered forms), no spills: D64 dK/dV (32-query tiles, two warpgroups, overlapped) 241
#: registers, dQ (64-key tiles, two warpgroups, overlapped) 251; D128 dK/dV (warpgroup
#: roles, overlapped) 237, dQ (32-key tiles) 228. Reasons: backward ms non-causal / causal
#: (tools/kernel_times.py). One-warpgroup forms follow as fallbacks for smaller shared memory.
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


def sm90_3xf16_backward_smem_bytes(tiles: Sm90F16SplitBwdTiles, hd: int,
                                   hdv: int) -> tuple[int, int]:
    """Dynamic shared memory of attention_bwd_dkdv_sm90_3xf16 and attention_bwd_dq_sm90_3xf16
    (the .cu header)."""
    bm, bn = tiles.block_m, tiles.block_n
    bufs = (2 if tiles.dkdv_overlap else 1, 2 if tiles.dq_overlap else 1)
    wk = 1 if tiles.dkdv_roles == 3 else tiles.dkdv_warpgroups  # warpgroups with own keys
    wq = tiles.dq_warpgroups
    dkdv = (wk * 2 * 64 * (hd + hdv) * 2 + 2 * bm * (hd + hdv) * 4
            + bufs[0] * 2 * bm * (hd + hdv) * 2 + 2 * 2 * bm * 4
            + (64 * bm * 4 if tiles.dkdv_roles == 3 else 0))  # the exchanged P^T
    dq = wq * 2 * 64 * (hd + hdv) * 2 + 2 * bn * (hd + hdv) * 4 + bufs[1] * 2 * bn * (hd + hdv) * 2
    return dkdv, dq


def _sm90_3xf16_backward(head_dim: int, head_dim_v: int, bias_dtype, has_mask: bool,
                         aligned: bool, smem_limit: int,
                         tiles: Sm90F16SplitBwdTiles | None = None):
    head = max(head_dim, head_dim_v)
    hd, hdv = _ceil64(head_dim), _ceil64(head_dim_v)
    candidates = (tiles,) if tiles is not None else next(
        c for max_d, c, _ in SM90_3XF16_BACKWARD_TILES if head <= max_d)
    tiles, smem = _first_fit(candidates, lambda t: sm90_3xf16_backward_smem_bytes(t, hd, hdv),
                             smem_limit, "sm90_3xf16 backward",
                             f"head dims {head_dim}, {head_dim_v}")
    flags = f"{_bias_type(bias_dtype)}, {str(has_mask).lower()}, {hd}, {hdv}"
    al = str(aligned).lower()
    return BackwardChoice(
        "sm90_3xf16", "attention_backward_sm90_3xf16.cu", "attention_bwd_delta<float>",
        f"attention_bwd_dkdv_sm90_3xf16<{flags}, {tiles.block_m}, {al}, "
        f"{tiles.dkdv_min_blocks}, {str(tiles.dkdv_overlap).lower()}, {tiles.dkdv_warpgroups}, "
        f"{tiles.dkdv_roles}, {str(tiles.dkdv_stagger).lower()}>",
        f"attention_bwd_dq_sm90_3xf16<{flags}, {tiles.block_n}, {al}, {tiles.dq_min_blocks}, "
        f"{str(tiles.dq_overlap).lower()}, {tiles.dq_warpgroups}, "
        f"{str(tiles.dq_stagger).lower()}>",
        64 if tiles.dkdv_roles == 3 else 64 * tiles.dkdv_warpgroups, 64 * tiles.dq_warpgroups,
        max(hd, hdv), hd, *smem, threads_dkdv=128 * tiles.dkdv_warpgroups,
        threads_dq=128 * tiles.dq_warpgroups, dkdv_roles=2 if tiles.dkdv_roles == 2 else 1,
        magnitudes="attention_bwd_magnitudes")


def backward_kernels(call: AttentionCall, cc: tuple[int, int], smem_limit: int,
                     grad_dtypes, dout, kernel: str | None = None, tiles=None):
    """The kernels that serve a validated backward call. ``grad_dtypes`` are the storage
    types the kernels write (dK and dV, dQ): the input dtype, or the accumulator type for a
    gradient that is summed over broadcast axes afterwards. ``tiles`` overrides the table."""
    forced = _forced_family(kernel, BACKWARD_FAMILIES, "has no backward in this build")
    bias_dtype = None if call.bias is None else call.bias.dtype
    aligned = mma_aligned(call) and _aligned(dout)
    choice = _choose_backward(call.dtype, call.head_dim, call.head_dim_v, bias_dtype,
                              call.mask is not None, tuple(np.dtype(g) for g in grad_dtypes),
                              aligned, cc, smem_limit, forced, tiles, call.precision)
    if choice is not None:
        return choice
    raise _no_family("backward kernel family", call, cc, forced)


@functools.lru_cache(maxsize=1024)
def _choose_backward(dtype, head_dim, head_dim_v, bias_dtype, has_mask, grad_dtypes, aligned,
                     cc, smem_limit, forced, tiles, precision=None):
    for family in BACKWARD_FAMILIES:
        if forced is not None and family.name != forced:
            continue
        if not family.accepts(cc, dtype, max(head_dim, head_dim_v), precision):
            continue
        if family.name == "sm90":
            return _sm90_backward(dtype, head_dim, head_dim_v, bias_dtype, has_mask,
                                  grad_dtypes, aligned, smem_limit, tiles)
        if family.name == "mma":
            return _mma_backward(dtype, head_dim, head_dim_v, bias_dtype, has_mask,
                                 grad_dtypes, aligned, cc, smem_limit, tiles)
        if family.name == "mma_f32":
            return _mma_f32_backward(head_dim, head_dim_v, bias_dtype, has_mask, aligned,
                                     smem_limit, tiles)
        if family.name == "sm90_3xf16":
            return _sm90_3xf16_backward(head_dim, head_dim_v, bias_dtype, has_mask, aligned,
                                        smem_limit, tiles)
        return _portable_backward(dtype, head_dim, head_dim_v, bias_dtype, has_mask,
                                  grad_dtypes, smem_limit, tiles)
    return None


#: (compute capability, opt-in shared memory per block) of the GPUs the gate compiles for:
#: A100, the 99 KB parts of Ampere/Ada (which take the fallback tiles), H100/H200
GATE_TARGETS = {"sm_80": ((8, 0), 166912), "sm_86": ((8, 6), 101376),
                "sm_90": ((9, 0), 232448)}


#: Head dims the gate enumerates: every D (= Dv) from 1 to 256, each dispatch's padding and
#: tile rows crossed, and the portable kernel's wider classes. D != Dv pairs take the
#: boundaries of every padding class (multiples of 16, 32 and 64 and one past them).
GATE_HEAD_DIMS = tuple(range(1, 257)) + (257, 384, 512, 513, 1024)
GATE_PAIR_DIMS = (1, 16, 17, 32, 33, 48, 64, 65, 96, 97, 128, 129, 160, 192, 193, 224, 256)


def _gate_calls(family, precision_of):
    """(dtype, head_dim, head_dim_v, bias dtype, mask, aligned, precision, fast) of the gate's
    calls for ``family``: every feature combination at every D = Dv of GATE_HEAD_DIMS, and
    every D != Dv pair of GATE_PAIR_DIMS without mask or bias (the head dims and the
    features are independent template arguments)."""
    aligned_both = (family.name.startswith(("mma", "sm90"))
                    or any(n in ("float32", "float64") for n in family.dtypes))
    for name in family.dtypes:
        dtype = np.dtype(_np_name(name))
        precisions = precision_of(name)
        heads = [(d, d) for d in GATE_HEAD_DIMS if d <= family.max_head_dim]
        pairs = [(d, dv) for d, dv in itertools.product(GATE_PAIR_DIMS, repeat=2)
                 if d != dv and max(d, dv) <= family.max_head_dim]
        for (d, dv), bias, has_mask, aligned, precision in itertools.product(
                heads, (None, name, "float32"), (False, True),
                (True, False) if aligned_both else (True,), precisions):
            bias_dtype = bias and np.dtype(_np_name(bias))
            yield dtype, d, dv, bias_dtype, has_mask, aligned, precision, \
                bias is None and not has_mask and aligned
        for (d, dv), aligned, precision in itertools.product(
                pairs, (True, False) if aligned_both else (True,), precisions):
            yield dtype, d, dv, None, False, aligned, precision, aligned


def _float32_precisions(name: str):
    return ("highest", "tf32") if name == "float32" else (None,)


def forward_instances(arch: str):
    """Every (filename, name expression, fast) that dispatch picks on ``arch``, each family
    forced in turn as the tests do, for the NVRTC gate (see :func:`_gate_calls`). Fast:
    without mask and bias, aligned, and dispatch's own pick (not only a forced family's):
    these must not spill."""
    cc, limit = GATE_TARGETS[arch]
    seen = {}
    for family in FAMILIES:
        for dtype, d, dv, bias_dtype, has_mask, aligned, precision, fast in _gate_calls(
                family, _float32_precisions):
            choice = _choose(dtype, d, dv, bias_dtype, has_mask, aligned, cc, limit,
                             family.name, None, precision)
            if choice is None:
                continue
            # fast where dispatch itself picks it; a family reached only by forcing it
            # (the tests) must compile, and its speed there is not the product's
            fast = fast and choice == _choose(dtype, d, dv, bias_dtype, has_mask, aligned,
                                              cc, limit, None, None, precision)
            variants = [choice]
            if choice.prepared is not None:  # and its preparation kernels
                variants.append(choice.prepared)
                for kernel in ("tf32_image_k", "tf32_image_vt"):
                    seen[(choice.filename, kernel)] = True
            if choice.magnitudes is not None:
                seen[(choice.filename, choice.magnitudes)] = True
            for c in variants:
                key = (c.filename, c.name_expression)
                seen[key] = seen.get(key, False) or fast
    return [(f, e, fast) for (f, e), fast in seen.items()]


def _np_name(name: str):
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return name


def backward_instances(arch: str):
    """Every (filename, name expression, fast) of the backward that dispatch picks on
    ``arch``, each family forced in turn, for the NVRTC gate (see :func:`_gate_calls`), with
    either gradient storage (the input dtype, or the accumulator type for broadcast
    inputs). Fast: no bias, no mask, gradients in place, aligned, dispatch's own pick."""
    cc, limit = GATE_TARGETS[arch]
    seen = {}
    for family in BACKWARD_FAMILIES:
        for dtype, d, dv, bias_dtype, has_mask, aligned, precision, fast in _gate_calls(
                family, _float32_precisions):
            acc = np.dtype("float64" if dtype == np.float64 else "float32")
            for grads in ((dtype, dtype), (acc, acc)):
                choice = _choose_backward(dtype, d, dv, bias_dtype, has_mask, grads, aligned,
                                          cc, limit, family.name, None, precision)
                if choice is None:  # the family does not serve arch
                    continue
                picked = choice == _choose_backward(dtype, d, dv, bias_dtype, has_mask, grads,
                                                    aligned, cc, limit, None, None, precision)
                for expr in (choice.magnitudes, choice.delta, choice.dkdv, choice.dq):
                    if expr is None:  # no magnitudes kernel
                        continue
                    key = (choice.filename, expr)
                    seen[key] = seen.get(key, False) or (fast and picked
                                                          and grads[0] == dtype)
    return [(f, e, fast) for (f, e), fast in seen.items()]
