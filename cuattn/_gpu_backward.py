"""The GPU backward: delta, then the dK/dV and dQ kernels of a validated CuPy call, through
the forward's parameter block (:mod:`cuattn._gpu_plan`) and the same
:class:`~cuattn._launch.Launch`."""
from __future__ import annotations

import math

import numpy as np

from . import _dispatch, _split
from ._checks import AttentionCall, lse_dtype, sum_to_shape
from ._gpu_plan import (
    FORWARD_SLOTS,
    MAGNITUDE_ROWS,
    _attn_fields,
    _forward_tensors,
    packed_table,
)
from ._kernels import get_kernel
from ._launch import Launch, broadcast_strides, device_limits, layout, sm_count, stride_fields
from ._params import new_block
from .families._common import DENSE, PACKED

__all__ = ["backward"]

#: the backward's own slots (AttnBwdParams, after its forward block ``f``)
BACKWARD_SLOTS = ("dout", "delta", "dq", "dk", "dv")


def backward(call: AttentionCall, dout, out, lse, kernel: str | None = None, tiles=None,
             packed=None):
    """dq, dk, dv of a validated CuPy call: delta, then the dK/dV and dQ kernels (after the
    magnitudes kernel where the family has one). A gradient of an input that was broadcast
    over batch axes is computed per batch entry in the accumulator type and summed over
    those axes (a deterministic CuPy reduction). ``packed``: a packed call's (q_offsets,
    k_offsets) in host memory, run in one grid per kernel by the family's packed instances;
    None where the family has none (the caller runs the sequences as dense calls).
    ``kernel`` and ``tiles`` force a family and its tiles (tests). Query groups that share
    their keys run folded into rows (:func:`cuattn._split.fold_backward`) unless a family,
    tiles or a packed call is given."""
    cupy = call.xp
    if kernel is None and tiles is None and packed is None:
        folded = _split.fold_backward(call, dout, out, lse, sm_count(call.q.device.id))
        if folded is not None:
            grads = backward(*folded)
            return tuple(g.reshape(x.shape) for g, x in zip(grads, (call.q, call.k, call.v)))
    acc = lse_dtype(call.dtype)
    batch = call.batch_shape
    nbatch = math.prod(batch)
    inputs = (call.q, call.k, call.v)
    with call.q.device:
        if nbatch == 0 or call.seqlen_q == 0 or call.seqlen_k == 0:
            return tuple(cupy.zeros(x.shape, call.dtype) for x in inputs)
        # a gradient the kernels can write in place has no broadcast batch axis
        direct = [math.prod(x.shape[:-2]) == nbatch for x in inputs]
        direct[1] = direct[2] = direct[1] and direct[2]  # dK and dV share one kernel
        kv_dtype = call.dtype if direct[1] else acc
        q_dtype = call.dtype if direct[0] else acc
        cc, smem_limit = device_limits(call.q.device.id)
        ragged = DENSE if packed is None else PACKED
        choice = _dispatch.backward_kernels(call, cc, smem_limit, (kv_dtype, q_dtype), dout,
                                            kernel, tiles, ragged)
        if choice.ragged != ragged:
            return None
        targets = [cupy.empty(x.shape if d else batch + x.shape[-2:], g)
                   for x, d, g in zip(inputs, direct, (q_dtype, kv_dtype, kv_dtype))]
        delta = cupy.empty(call.lse_shape, acc)
        tensors = _forward_tensors(call, out, lse) + [
            (dout, broadcast_strides(dout, dout.shape)),
            (delta, broadcast_strides(delta, delta.shape) + [0]),
        ] + [(g, broadcast_strides(g, batch + g.shape[-2:])) for g in targets]
        extents, strides, pointer_sets = layout(batch, tensors)
        inner = math.prod(extents)
        # (kernel, shared memory, threads, grid rows, grid column tiles, blocks)
        rows_q = inner * call.seqlen_q
        dkdv_rows = -(-call.seqlen_k // choice.dkdv_rows)
        dkdv_cols = choice.dkdv_roles * -(-max(call.head_dim, call.head_dim_v) // choice.col_tile)
        dq_rows = -(-call.seqlen_q // choice.dq_rows)
        dq_cols = -(-call.head_dim // choice.dq_col_tile)
        launches = [
            (choice.delta, 0, choice.threads_delta, rows_q, 1,
             -(-rows_q // (choice.threads_delta // 32))),
            (choice.dkdv, choice.smem_dkdv, choice.threads_dkdv, dkdv_rows, dkdv_cols,
             dkdv_rows * dkdv_cols * inner),
            (choice.dq, choice.smem_dq, choice.threads_dq, dq_rows, dq_cols,
             dq_rows * dq_cols * inner),
        ]
        if choice.magnitudes is not None:
            # the largest magnitudes of each batch entry's operands (attention_bwd_magnitudes:
            # MAGNITUDE_ROWS rows per block), zeroed before each pointer set's launches
            chunks = -(-max(call.seqlen_q, call.seqlen_k) // MAGNITUDE_ROWS)
            magnitudes = cupy.empty(inner * 5, np.float32)
            launches.insert(0, (choice.magnitudes, 0, 256, chunks, 1, chunks * inner))
        kernels = [get_kernel(choice.filename, expr, shared_mem=smem)
                   for expr, smem, *_ in launches]
        # a packed call's dK/dV and dQ grids: the key or query blocks of every sequence, and
        # their tables (packed_table); the uploaded tables live until the launches are done
        tables = {}
        if packed is not None:
            for expr, rows, per_block, keys in (
                    (choice.dkdv, choice.dkdv_rows, dkdv_cols * inner, True),
                    (choice.dq, choice.dq_rows, dq_cols * inner, False)):
                table, blocks, units = packed_table(
                    *packed, rows, per_block, keys, (call.window_left, call.window_right))
                table = cupy.asarray(table)
                tables[expr] = (table, blocks, units)
        forward_fields = _attn_fields(call, extents, 0, 0, strides)
        if choice.magnitudes is not None:
            forward_fields["magnitudes"] = magnitudes.data.ptr
        stream = cupy.cuda.get_current_stream().ptr
        slots = len(FORWARD_SLOTS)
        for pointers in pointer_sets:
            block = new_block("AttnBwdParams", f={**forward_fields,
                                                  **dict(zip(FORWARD_SLOTS, pointers[:slots]))},
                              **dict(zip(BACKWARD_SLOTS, pointers[slots:])),
                              **stride_fields(BACKWARD_SLOTS, strides[5 * slots:]))
            if choice.magnitudes is not None:
                magnitudes.fill(0)
            for fn, (expr, smem, threads, rows, cols, blocks) in zip(kernels, launches):
                block["f"]["packed"] = block["f"]["num_packed"] = 0
                if expr in tables:
                    table, rows, blocks = tables[expr]
                    block["f"]["packed"] = table.data.ptr
                    block["f"]["num_packed"] = rows
                block["num_row_blocks"], block["num_col_tiles"] = rows, cols
                if blocks:
                    Launch(fn, (blocks, 1), threads, smem, block)((), stream)
        grads = []
        for x, d, g in zip(inputs, direct, targets):
            if not d:
                g = sum_to_shape(g, x.shape).reshape(x.shape).astype(call.dtype, copy=False)
            grads.append(g)
    return tuple(grads)

