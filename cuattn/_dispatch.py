"""Which kernel family serves a call: two short tables, read top to bottom.

``FAMILIES`` (forward) and ``BACKWARD_FAMILIES`` list the kernel families in order of
preference, each with its conditions (compute capability, dtypes, largest head dim, float32
precision); the first row whose conditions a call meets serves it, and the family module
(``cuattn.families``) picks the instance and its tiles. ``CUATTN_KERNEL`` (or the private
``kernel=`` argument) forces a family for every call, so tests can run each family on one
GPU; a forced family that cannot serve a call raises ``NotImplementedError``.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from ._checks import AttentionCall
from .families import mma, mma_wide, portable, sm90, sm90_3xf16, sm90_tf32
from .families._common import DENSE, BackwardChoice, KernelChoice, Request

__all__ = ["FAMILIES", "BACKWARD_FAMILIES", "Family", "forward_kernel", "backward_kernels",
           "with_prepared_operands", "mma_aligned"]

HALF = ("float16", "bfloat16")
HOPPER = ((9, 0),)


@dataclass(frozen=True)
class Family:
    """One row of a dispatch table: a family's name, the function of its module that picks
    the instance (``build(request, tiles)``), and the calls it serves."""
    name: str
    build: Callable
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


#: Forward families, most preferred first.
FAMILIES = (
    Family("sm90", sm90.forward, (9, 0), HALF, 256,
           "Hopper wgmma (sm_90a), 16-bit inputs; head dims to 128, to 256 where the copy "
           "engine reads q, k and v (the piped instance)", archs=HOPPER),
    Family("mma", mma.forward, (8, 0), HALF, 256,
           "mma.sync m16n8k16 tensor cores (Ampere and newer), 16-bit inputs"),
    Family("sm90_tf32", sm90_tf32.forward, (9, 0), ("float32",), 128,
           "float32 'tf32' on Hopper wgmma .tf32 (sm_90a); head dims to 128 (registers)",
           precisions=("tf32",), archs=HOPPER),
    Family("sm90_3xf16", sm90_3xf16.forward, (9, 0), ("float32",), 128,
           "float32 'highest' on Hopper f16 wgmma: the 3xTF32 split scaled into float16",
           precisions=("highest",), archs=HOPPER),
    Family("mma_f32", mma_wide.forward_f32, (8, 0), ("float32",), 256,
           "float32 'tf32' on mma.sync m16n8k8 TF32 tensor cores", precisions=("tf32",)),
    Family("mma_f64", mma_wide.forward_f64, (8, 0), ("float64",), 128,
           "float64 on the DMMA tensor cores of A100, H100/H200, B200; head dims to 128",
           archs=((8, 0), (9, 0), (10, 0))),
    Family("portable", portable.forward, (5, 0), (*HALF, "float32", "float64"), 1024,
           "CUDA cores, every dtype and feature, head dims to 1024: the reference kernel"),
)

#: Backward families, most preferred first (the same rules as FAMILIES).
BACKWARD_FAMILIES = (
    Family("sm90", sm90.backward, (9, 0), HALF, 128,
           "Hopper wgmma (sm_90a), 16-bit inputs; head dims to 128 (registers of dK, dV)",
           archs=HOPPER),
    Family("mma", mma.backward, (8, 0), HALF, 256,
           "mma.sync m16n8k16 tensor cores, 16-bit inputs; above 128, column tiles of dK, dV"),
    Family("sm90_3xf16", sm90_3xf16.backward, (9, 0), ("float32",), 128,
           "float32 'highest' on Hopper f16 wgmma, with the sm90_3xf16 forward's scores",
           precisions=("highest",), archs=HOPPER),
    Family("mma_f32", mma_wide.backward_f32, (8, 0), ("float32",), 128,
           "float32 'tf32' on mma.sync m16n8k8 TF32 tensor cores; head dims to 128",
           precisions=("tf32",)),
    Family("portable", portable.backward, (5, 0), (*HALF, "float32", "float64"), 1024,
           "CUDA cores, every dtype and feature, deterministic (no atomics)"),
)


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


def _first_family(families, req: Request, forced: str | None, tiles):
    """The instance of the first family (or only the forced one) that serves ``req``; a
    family may decline a request it accepts by its table (sm90 past 128 without the copy
    engine). A piped instance without a fallback of its own falls back to the next
    family's."""
    for i, family in enumerate(families):
        if forced is not None and family.name != forced:
            continue
        if family.accepts(req.cc, req.dtype, req.head, req.precision):
            choice = family.build(req, tiles)
            if choice is None:
                continue
            if getattr(choice, "tma", False) and choice.fallback is None:
                choice = replace(choice, fallback=_first_family(families[i + 1:], req,
                                                                 forced, None))
            return choice
    return None


def forward_kernel(call: AttentionCall, cc: tuple[int, int], smem_limit: int,
                   kernel: str | None = None, tiles=None, ragged: int = DENSE,
                   keys: int | None = None) -> KernelChoice:
    """The kernel instance that serves a validated forward call on a GPU of capability cc
    with ``smem_limit`` bytes of shared memory per block (after opt-in). ``tiles``
    overrides the table's tile sizes (tile sweeps, tools/sweep_tiles.py). ``ragged``: the
    call's RAGGED mode, PACKED or KEY_LENGTHS (KernelChoice.ragged says whether the
    instance runs it; else it is a dense instance), and ``keys`` a typical key count in
    place of the call's Sk (the packed total, or the longest length)."""
    forced = _forced_family(kernel, FAMILIES, "is not in this build")
    bias_dtype = None if call.bias is None else call.bias.dtype
    choice = _choose(call.dtype, call.head_dim, call.head_dim_v, bias_dtype,
                     call.mask is not None, mma_aligned(call), cc, smem_limit, forced, tiles,
                     call.precision, ragged)
    if choice is not None:
        banded = call.window_left >= 0 or call.window_right >= 0
        keys = call.seqlen_k if keys is None else keys
        if choice.tma and choice.fallback is not None and (
                keys < choice.tma_from * (2 if banded else 1)
                or (call.mask is not None and not side_staged(call.mask))):
            # too few keys to pay for the piped blocks, or a mask their producer cannot
            # stage (its softmax would read it from global memory, far slower)
            choice = choice.fallback
        return with_prepared_operands(choice, call.seqlen_q, banded)
    raise _no_family("kernel family", call, cc, forced)


def side_staged(x) -> bool:
    """Whether the 16-bit sm90 kernels stage tiles of mask or bias ``x`` by rows
    (SideTiles::stages, mma_tiles.cuh): unit column stride, and rows 16 bytes apart or one
    row for every query (an axis of size 1 broadcasts: stride 0)."""
    shape, strides = (1, 1) + tuple(x.shape), (0, 0) + tuple(x.strides)
    col = 0 if shape[-1] == 1 else strides[-1]
    row = 0 if shape[-2] == 1 else strides[-2]
    return col == x.itemsize and row % 16 == 0


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
            forced, tiles, precision=None, ragged=DENSE) -> KernelChoice | None:
    """The table lookup proper, cached: a call's choice depends on these values only."""
    req = Request(dtype, head_dim, head_dim_v, bias_dtype, has_mask, aligned, cc, smem_limit,
                  precision, ragged=ragged)
    return _first_family(FAMILIES, req, forced, tiles)


def backward_kernels(call: AttentionCall, cc: tuple[int, int], smem_limit: int,
                     grad_dtypes, dout, kernel: str | None = None, tiles=None,
                     ragged: int = DENSE) -> BackwardChoice:
    """The kernels that serve a validated backward call. ``grad_dtypes`` are the storage
    types the kernels write (dK and dV, dQ): the input dtype, or the accumulator type for a
    gradient that is summed over broadcast axes afterwards. ``tiles`` overrides the table.
    ``ragged``: PACKED for a packed call (BackwardChoice.ragged says whether the kernels
    run it in one grid each)."""
    forced = _forced_family(kernel, BACKWARD_FAMILIES, "has no backward in this build")
    bias_dtype = None if call.bias is None else call.bias.dtype
    aligned = mma_aligned(call) and _aligned(dout)
    choice = _choose_backward(call.dtype, call.head_dim, call.head_dim_v, bias_dtype,
                              call.mask is not None, tuple(np.dtype(g) for g in grad_dtypes),
                              aligned, cc, smem_limit, forced, tiles, call.precision,
                              _tf32_forward(call, cc, smem_limit,
                                            os.environ.get("CUATTN_KERNEL") or None), ragged)
    if choice is not None:
        return choice
    raise _no_family("backward kernel family", call, cc, forced)


@functools.lru_cache(maxsize=1024)
def _choose_backward(dtype, head_dim, head_dim_v, bias_dtype, has_mask, grad_dtypes, aligned,
                     cc, smem_limit, forced, tiles, precision=None,
                     tf32_forward=False, ragged=DENSE) -> BackwardChoice | None:
    req = Request(dtype, head_dim, head_dim_v, bias_dtype, has_mask, aligned, cc, smem_limit,
                  precision, grad_dtypes, tf32_forward, ragged)
    return _first_family(BACKWARD_FAMILIES, req, forced, tiles)


#: forward families whose products read TF32 operands
TF32_FAMILIES = frozenset(f.name for f in FAMILIES if f.precisions == ("tf32",))


def _tf32_forward(call: AttentionCall, cc: tuple[int, int], smem_limit: int,
                  forced: str | None) -> bool:
    """Did a TF32 family serve this call's forward? Dispatch's pick for it, with
    ``forced`` (CUATTN_KERNEL, which forces the forward as well) as the forward saw it; a
    backward forced by ``kernel=`` (tests, tools) still takes the forward to be dispatch's.
    The backward's lse comes from those scores, and P = exp(s - lse) holds only for scores
    recomputed from the same operands."""
    if call.precision != "tf32":
        return False
    bias_dtype = None if call.bias is None else call.bias.dtype
    return tf32_forward(call.dtype, call.head_dim, call.head_dim_v, bias_dtype,
                        call.mask is not None, mma_aligned(call), cc, smem_limit, forced)


def tf32_forward(dtype, head_dim, head_dim_v, bias_dtype, has_mask, aligned, cc, smem_limit,
                 forced=None) -> bool:
    """Does a TF32 family serve the forward of a float32 "tf32" call with these values?"""
    choice = _choose(dtype, head_dim, head_dim_v, bias_dtype, has_mask, aligned, cc,
                     smem_limit, forced, None, "tf32")
    return choice is not None and choice.family in TF32_FAMILIES


def mma_aligned(call: AttentionCall) -> bool:
    """May the mma families (and the pipelined portable kernel) copy q, k, v in 16-byte
    chunks? Unit column strides, every other stride a multiple of 16 bytes, 16-byte aligned
    pointers, head dims multiples of 16 bytes (8 elements of 16 bits, 4 of float32); paged
    keys and values (call.pages): their pools' page and row strides too."""
    vec = 16 // call.dtype.itemsize
    if call.head_dim % vec or call.head_dim_v % vec:
        return False
    pages = call.pages
    if pages is not None and any(s % vec for s in (pages.k_page, pages.v_page, pages.k_row,
                                                   pages.v_row)):
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
