"""The NumPy backend: attention on the CPU with the kernels' blocked online softmax, and
its backward with recomputation.

It runs :func:`cuattn.reference.attention_blocked` (BLAS for the tile products) with
float32 accumulation for 16-bit and float32 inputs and float64 for float64, choosing the
tile sizes so that one tile of scores holds at most ``_TILE_ELEMENTS`` numbers across the
whole batch: memory is O(block), whatever the sequence length.
"""
from __future__ import annotations

import numpy as np

from ._checks import AttentionCall, lse_dtype
from .reference import attention_backward_blocked, attention_blocked

_TILE_ELEMENTS = 1 << 22  # 32 MiB of float64 scores per tile at most


def _blocks(call: AttentionCall) -> tuple[int, int]:
    batch = max(1, int(np.prod(call.batch_shape, dtype=np.int64)))
    block = 256
    while block > 16 and batch * block * block > _TILE_ELEMENTS:
        block //= 2
    return block, block


def attention_forward(call: AttentionCall):
    """``(out, lse)`` for a validated NumPy call; ``out`` is written into ``call.out`` when
    given. ``lse`` is None unless ``call.return_lse``."""
    acc_dtype = lse_dtype(call.dtype)
    block_m, block_n = _blocks(call)
    if min(call.seqlen_q, *call.batch_shape, 1) == 0:
        out_acc = np.empty(call.out_shape, acc_dtype)
        lse = np.empty(call.lse_shape, acc_dtype)
    else:
        out_acc, lse = attention_blocked(call, acc_dtype=acc_dtype, block_m=block_m,
                                         block_n=block_n)
    out = call.out if call.out is not None else np.empty(call.out_shape, call.dtype)
    out[...] = out_acc.astype(call.dtype)
    return out, (lse if call.return_lse else None)


def attention_backward(call: AttentionCall, dout, out, lse):
    """``(dq, dk, dv)`` for a validated NumPy call, in the dtypes and shapes of q, k, v."""
    acc_dtype = lse_dtype(call.dtype)
    block_m, block_n = _blocks(call)
    grads = attention_backward_blocked(call, dout, out, lse, acc_dtype=acc_dtype,
                                       block_m=block_m, block_n=block_n)
    return tuple(g.astype(call.dtype) for g in grads)
