"""Which kernel family and tile sizes serve a call: one table, read top to bottom.

``FAMILIES`` lists the attention kernel families in order of preference; the first row
whose conditions a call meets serves it. ``PORTABLE_TILES`` holds the tile sizes of the
portable family, each row with the measurement behind it. ``CUATTN_KERNEL`` (or the private
``kernel=`` argument) forces a family for every call, so tests can run each family on one
GPU; a forced family that cannot serve a call raises ``NotImplementedError``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ._checks import AttentionCall
from ._kernels import c_type_name

__all__ = ["FAMILIES", "PORTABLE_TILES", "Tiles", "KernelChoice", "forward_kernel",
           "portable_smem_bytes", "forward_instances"]

THREADS = 256


@dataclass(frozen=True)
class Family:
    name: str
    filename: str
    min_cc: tuple[int, int]
    dtypes: tuple[str, ...]
    max_head_dim: int
    reason: str


#: Attention families, most preferred first. A call takes the first row whose compute
#: capability, dtype and head dims it meets.
FAMILIES = (
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


#: Portable family: (dtypes, largest head dim, tiles, measured reason). First match wins.
PORTABLE_TILES = (
    (("float16", "bfloat16", "float32"), 64, Tiles(128, 128, 64, 64, 1),
     "H200 fp32 B4 H16 S4096 D64: 26.7 TFLOP/s vs 24.0 for 64x64 at 2 blocks/SM "
     "(causal 23.0 vs 22.9); 254 registers, no spills"),
    (("float16", "bfloat16", "float32"), 1024, Tiles(64, 64, 128, 128, 1),
     "H200 fp32 D128: 26.6 TFLOP/s, as fast as 2 blocks/SM (which spills 24 B with mask+bias) "
     "and than 128x64 (27.2, but 23.6 causal vs 26.1)"),
    (("float64",), 64, Tiles(64, 64, 64, 64, 1),
     "H200 fp64 B1 H16 S4096 D64: 9.8 TFLOP/s; 128x64 reaches 11.6 but spills 32 B at 255 "
     "registers"),
    (("float64",), 1024, Tiles(64, 64, 128, 128, 1),
     "H200 fp64 D128: 11.2 TFLOP/s vs 9.3 for 64x32 and 7.0 with 64-wide chunks"),
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


def _pow2_at_least(n: int, lo: int) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def portable_smem_bytes(tiles: Tiles, d_tile: int, dv_tile: int, acc_itemsize: int,
                        pipelined: bool) -> int:
    """Dynamic shared memory of attention_fwd_portable (see the .cu header)."""
    pad = 16 // acc_itemsize
    if pipelined:
        kv = 2 * tiles.block_n * (d_tile + pad) + 2 * tiles.block_n * (dv_tile + pad)
    else:
        kv = tiles.block_n * (max(d_tile, dv_tile) + pad)
    elems = tiles.block_m * (d_tile + pad) + kv + tiles.block_m * (tiles.block_n + pad)
    return elems * acc_itemsize


def _portable(call_dtype: np.dtype, head_dim: int, head_dim_v: int, bias_dtype, has_mask,
              tiles: Tiles | None = None):
    name = np.dtype(call_dtype).name
    head = max(head_dim, head_dim_v)
    if tiles is None:
        tiles = next(t for dtypes, max_d, t, _ in PORTABLE_TILES
                     if name in dtypes and head <= max_d)
    acc_itemsize = 8 if name == "float64" else 4
    vec = 16 // acc_itemsize
    d_tile = min(_pow2_at_least(head_dim, 32), tiles.d_tile)
    dv_tile = min(_pow2_at_least(head_dim_v, 16 * vec), tiles.dv_tile)
    # cp.async double buffering copies float32/float64 tiles as they are, when Q fits one
    # chunk; 16-bit inputs are converted to float on their way into shared memory
    pipelined = name in ("float32", "float64") and head_dim <= d_tile
    bias_t = "cuattn::NoBias" if bias_dtype is None else c_type_name(bias_dtype)
    expr = (f"attention_fwd_portable<{c_type_name(call_dtype)}, {bias_t}, "
            f"{str(has_mask).lower()}, {tiles.block_m}, {tiles.block_n}, {d_tile}, "
            f"{dv_tile}, {tiles.min_blocks}, {str(pipelined).lower()}>")
    return KernelChoice("portable", "attention_portable.cu", expr, tiles, d_tile, dv_tile,
                        portable_smem_bytes(tiles, d_tile, dv_tile, acc_itemsize, pipelined))


def _family_serves(family: Family, call: AttentionCall, cc: tuple[int, int]) -> bool:
    return (cc >= family.min_cc and call.dtype.name in family.dtypes
            and max(call.head_dim, call.head_dim_v) <= family.max_head_dim)


def forward_kernel(call: AttentionCall, cc: tuple[int, int], kernel: str | None = None,
                   tiles: Tiles | None = None):
    """The kernel instance that serves a validated forward call on a GPU of capability cc.
    ``tiles`` overrides the table's tile sizes (tile sweeps, tools/sweep_portable.py)."""
    forced = kernel or os.environ.get("CUATTN_KERNEL") or None
    names = [f.name for f in FAMILIES]
    if forced is not None and forced not in names:
        raise NotImplementedError(f"kernel family {forced!r} is not in this build; "
                                  f"available: {', '.join(names)}")
    for family in FAMILIES:
        if forced is not None and family.name != forced:
            continue
        if _family_serves(family, call, cc):
            bias_dtype = None if call.bias is None else call.bias.dtype
            return _portable(call.dtype, call.head_dim, call.head_dim_v, bias_dtype,
                             call.mask is not None, tiles)
    raise NotImplementedError(
        f"no kernel family serves {call.dtype} with head dims ({call.head_dim}, "
        f"{call.head_dim_v}) on compute capability {cc[0]}.{cc[1]}"
        + (f" (forced: {forced!r})" if forced else ""))


def forward_instances():
    """Every (filename, name expression, fast) the dispatch table can pick, for the NVRTC
    gate: each dtype × bias dtype × mask × head-dim class of each family."""
    seen = {}
    for dtypes, max_d, _, _ in PORTABLE_TILES:
        for name in dtypes:
            for head in (32, 64, 128, max_d):
                if head > max_d:
                    continue
                for bias in (None, name, "float32"):
                    for has_mask in (False, True):
                        choice = _portable(np.dtype(_np_name(name)), head, head, bias and
                                           np.dtype(_np_name(bias)), has_mask)
                        seen[(choice.filename, choice.name_expression)] = False
    return [(f, e, fast) for (f, e), fast in seen.items()]


def _np_name(name: str):
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return name
