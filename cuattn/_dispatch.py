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


#: Portable family: (dtypes, largest head dim, candidate tiles in order of preference, the
#: measurement behind the order). A call takes the first row that matches its dtype and head
#: dims, then the first candidate whose shared memory fits the device; the last candidate of
#: each row fits 48 KB, so every GPU gets one. Timings: H200, B4 H16 S4096 (fp32) and
#: B1 H16 S4096 (fp64), TFLOP/s non-causal / causal, tools/sweep_portable.py.
PORTABLE_TILES = (
    (("float16", "bfloat16", "float32"), 64,
     (Tiles(128, 64, 64, 64, 1), Tiles(64, 64, 64, 64, 2), Tiles(32, 32, 64, 64, 2)),
     "fp32 D64 pipelined, unroll 2: 128x64 30.7 / 28.3, 64x64 28.7 / 26.9, 64x128 28.2 / 25.9"),
    (("float16", "bfloat16", "float32"), 1024,
     (Tiles(128, 32, 128, 128, 1), Tiles(64, 64, 128, 128, 1), Tiles(32, 32, 64, 64, 2)),
     "fp32 D128 pipelined, unroll 2: 128x32 31.3 / 28.1, 64x64 28.7 / 27.5, 64x32 28.0 / 26.1"),
    (("float64",), 64,
     (Tiles(64, 64, 64, 64, 1), Tiles(32, 32, 64, 64, 1)),
     "fp64 D64 pipelined, unroll 2: 64x64 12.0 / 10.8, 128x32 11.5 / 8.6, 64x32 10.4 / 9.2"),
    (("float64",), 1024,
     (Tiles(64, 32, 128, 128, 1), Tiles(32, 32, 32, 32, 1)),
     "fp64 D128 pipelined, unroll 2: 64x32 12.7 / 11.4, 32x32 8.8 / 8.6; 64x64 needs 358 KB"),
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


def _portable(call_dtype, head_dim: int, head_dim_v: int, bias_dtype, has_mask: bool,
              cc: tuple[int, int], smem_limit: int, tiles: Tiles | None = None):
    name = np.dtype(call_dtype).name
    head = max(head_dim, head_dim_v)
    acc_itemsize = 8 if name == "float64" else 4
    vec = 16 // acc_itemsize
    # cp.async double buffering (sm_80+) copies float32/float64 tiles as they are, when Q
    # fits one chunk; 16-bit inputs are converted to float on their way into shared memory
    if tiles is None:
        candidates = next(c for dtypes, max_d, c, _ in PORTABLE_TILES
                          if name in dtypes and head <= max_d)
    else:
        candidates = (tiles,)
    for tiles in candidates:
        d_tile = min(_pow2_at_least(head_dim, 32), tiles.d_tile)
        dv_tile = min(_pow2_at_least(head_dim_v, 16 * vec), tiles.dv_tile)
        pipelined = name in ("float32", "float64") and head_dim <= d_tile and cc >= (8, 0)
        smem = portable_smem_bytes(tiles, d_tile, dv_tile, acc_itemsize, pipelined)
        if smem <= smem_limit:
            break
    else:
        raise NotImplementedError(f"no portable tile configuration fits {smem_limit} bytes of "
                                  f"shared memory for {name} with head dims {head_dim}, "
                                  f"{head_dim_v}")
    bias_t = "cuattn::NoBias" if bias_dtype is None else c_type_name(bias_dtype)
    expr = (f"attention_fwd_portable<{c_type_name(call_dtype)}, {bias_t}, "
            f"{str(has_mask).lower()}, {tiles.block_m}, {tiles.block_n}, {d_tile}, "
            f"{dv_tile}, {tiles.min_blocks}, {str(pipelined).lower()}>")
    return KernelChoice("portable", "attention_portable.cu", expr, tiles, d_tile, dv_tile, smem)


def _family_serves(family: Family, call: AttentionCall, cc: tuple[int, int]) -> bool:
    return (cc >= family.min_cc and call.dtype.name in family.dtypes
            and max(call.head_dim, call.head_dim_v) <= family.max_head_dim)


def forward_kernel(call: AttentionCall, cc: tuple[int, int], smem_limit: int,
                   kernel: str | None = None, tiles: Tiles | None = None):
    """The kernel instance that serves a validated forward call on a GPU of capability cc
    with ``smem_limit`` bytes of shared memory per block (after opt-in). ``tiles``
    overrides the table's tile sizes (tile sweeps, tools/sweep_portable.py)."""
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
                             call.mask is not None, cc, smem_limit, tiles)
    raise NotImplementedError(
        f"no kernel family serves {call.dtype} with head dims ({call.head_dim}, "
        f"{call.head_dim_v}) on compute capability {cc[0]}.{cc[1]}"
        + (f" (forced: {forced!r})" if forced else ""))


#: (compute capability, opt-in shared memory per block) of the GPUs the gate compiles for
GATE_TARGETS = {"sm_80": ((8, 0), 166912), "sm_90": ((9, 0), 232448)}


def forward_instances(arch: str):
    """Every (filename, name expression, fast) that dispatch can pick on ``arch``, for the
    NVRTC gate: each dtype × bias dtype × mask × head-dim class × tile candidate that fits.
    Instances without mask and bias are the fast path: they must not spill."""
    cc, limit = GATE_TARGETS[arch]
    seen = {}
    for dtypes, max_d, candidates, _ in PORTABLE_TILES:
        for name in dtypes:
            for head in sorted({32, 64, 128, max_d}):
                if head > max_d:
                    continue
                for bias in (None, name, "float32"):
                    for has_mask in (False, True):
                        for tiles in candidates:
                            try:
                                choice = _portable(np.dtype(_np_name(name)), head, head,
                                                   bias and np.dtype(_np_name(bias)), has_mask,
                                                   cc, limit, tiles)
                            except NotImplementedError:
                                continue
                            fast = bias is None and not has_mask
                            seen[(choice.filename, choice.name_expression)] = fast
    return [(f, e, fast) for (f, e), fast in seen.items()]


def _np_name(name: str):
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return name
