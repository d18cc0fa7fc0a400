"""Decoding shapes: few query rows against many keys.

Grouped queries (:func:`fold_groups`): where q's innermost batch axis (the query groups of
GQA) meets keys and values broadcast along it, the groups become query rows of one batch
entry, so that one block reads each key once for all of them instead of once per group.

Split keys (:func:`split_count`, :func:`parts`): calls whose grid would leave most SMs
idle (a few query rows, in few batch entries) cut their keys into chunks that become one
more batch axis of the same launch, and merge the chunks' partial results.

The first ``n - 1`` chunks hold ``L = Sk // n`` keys each and are one launch over the
views ``k[..., :(n-1) L, :]`` reshaped to ``(..., n - 1, L, D)`` (q broadcast over the new
axis); the last chunk, the remaining keys, is a second launch that keeps the causal band,
which the earlier chunks lie wholly inside (see :func:`split_count`). Both write their
outputs and lses into one ``(..., n, Sq, Dv)`` and one ``(..., n, Sq)`` buffer
(:func:`buffers`), and :func:`cuattn.merge.merge_stacked` (the merge of
:func:`cuattn.merge_attention`, reading the parts in place) combines the n parts in order
(one kernel launch on CuPy), so the result is deterministic. The partial outputs are
rounded to the input dtype before the merge rounds once more. The GPU backend keeps these
launches per call signature, so a repeated decoding call replays them.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ._checks import AttentionCall, lse_dtype

__all__ = ["fold_groups", "run_folded", "split_count", "buffers", "parts", "forward"]

#: fewest keys per chunk: shorter chunks cost more in merging than they gain in blocks
MIN_CHUNK = 1024
#: most chunks: enough for two blocks per SM of an H200 from 4 blocks of rows; the merge
#: (one launch, any number of stacked parts) reads each part once
MAX_CHUNKS = 64
#: query rows per block that the count of blocks assumes (the forward tiles' BLOCK_M)
ROWS_PER_BLOCK = 64


def fold_groups(call: AttentionCall, copy: bool = False,
                rows: int | None = ROWS_PER_BLOCK) -> AttentionCall | None:
    """The call with q's innermost batch axis (G entries) folded into its query rows, or
    None where that is not exact or does not pay.

    Folding needs keys and values broadcast along that axis, a mask and bias (if any) the
    same for every folded row (size 1 on that axis and on the query axis: per key, as key
    lengths make for one query row), a band that allows every key to every row
    (bottom-right aligned: ``window_right >= Sq - 1`` and ``window_left >= Sk - 1``, e.g.
    causal with one query row), and q and ``out`` whose G and Sq axes are one run of rows
    (always so for Sq = 1). It pays while Sq is under ``rows``, one block of rows (None: at
    any Sq): each block then reads its keys for G times as many rows. The folded call's q
    and out are views of the call's: (..., 1, G * Sq, D); so are its results. With
    ``copy``, a q whose G and Sq axes are not one run is copied into one, and an out that
    is not is left out of the folded call (:func:`run_folded` copies the result into it),
    so that whether a call folds never depends on its strides.
    """
    batch, sq, sk = call.batch_shape, call.seqlen_q, call.seqlen_k
    lengths = call.k_lengths
    table = None if call.pages is None else call.pages.table  # (..., pages)
    if (not batch or batch[-1] == 1 or sq == 0 or rows is not None and sq >= rows
            or not all(_per_key(x) for x in (call.mask, call.bias))
            or lengths is not None and lengths.ndim and lengths.shape[-1] != 1
            or table is not None and table.ndim > 1 and table.shape[-2] != 1):
        return None
    if any(x.ndim >= 3 and x.shape[-3] != 1 for x in (call.k, call.v)):
        return None
    if call.q.ndim < 3 or call.q.shape[-3] != batch[-1]:
        return None
    left, right = call.window_left, call.window_right
    if 0 <= left < sk - 1 or 0 <= right < sq - 1:
        return None
    q = _rows_folded_or_copied(call.q, sq) if copy else _rows_folded(call.q, sq)
    out = None if call.out is None else _rows_folded(call.out, sq)
    if q is None or (call.out is not None and out is None and not copy):
        return None
    return dataclasses.replace(call, q=q, out=out, batch_shape=batch[:-1] + (1,),
                               seqlen_q=batch[-1] * sq, window_left=-1, window_right=-1)


def fold_backward(call: AttentionCall, dout, out, lse, sm_count: int):
    """``(call, dout, out, lse)`` of a validated backward call with its query groups folded
    into rows (:func:`fold_groups`, at any Sq, with copies where strides do not fold), or
    None where that is not exact or does not pay. Folded, the dK/dV kernel of each key
    head accumulates over the rows of all its groups, so dK and dV are written once in the
    input dtype, instead of once per group in the accumulator dtype and then summed; it
    pays while the folded dK/dV grid (batch entries x tiles of 128 keys) still fills the
    GPU twice over."""
    batch = call.batch_shape
    if not batch or math.prod(batch[:-1]) * -(-call.seqlen_k // 128) < 2 * sm_count:
        return None
    folded = fold_groups(call, copy=True, rows=None)
    if folded is None:
        return None
    dout, out, lse = (_rows_folded_or_copied(x, call.seqlen_q)
                      for x in (dout, out, lse[..., None]))
    return folded, dout, out, lse[..., 0]


def _per_key(x) -> bool:
    """Is a mask or bias (None: none) the same for every query row and every entry of the
    innermost batch axis?"""
    return x is None or (x.shape[-2] == 1 and (x.ndim < 3 or x.shape[-3] == 1))


def run_folded(call: AttentionCall, run, lse=None, copy: bool = False):
    """``(out, lse)`` of a validated call computed by ``run`` on its folded form
    (:func:`fold_groups`), as arrays of the call's shapes, followed by whatever else
    ``run`` returns; None where it does not fold. ``lse``: an array of the call's lse
    shape to write the lse into; ``run`` is called with the folded call and the view
    (..., 1, G * Sq) of it where its G and Sq axes are one run, else (with ``copy``) with
    the folded call alone and the result copied into it, or (without) None is returned.
    ``copy`` as for :func:`fold_groups`."""
    folded = fold_groups(call, copy)
    if folded is None:
        return None
    target = None if lse is None else _rows_folded(lse[..., None], call.seqlen_q)
    if lse is not None and target is None and not copy:
        return None
    if target is None:
        out, got, *rest = run(folded)
        if lse is None:
            lse = None if got is None else got.reshape(call.lse_shape)
        else:
            lse[...] = got.reshape(call.lse_shape)
    else:
        out, _, *rest = run(folded, target[..., 0])
    if call.out is None:
        return (out.reshape(call.out_shape), lse, *rest)
    if folded.out is None:  # an out= whose rows do not fold: the result is copied in
        call.out[...] = out.reshape(call.out_shape)
    return (call.out, lse, *rest)


def _rows_folded(x, sq: int):
    """The view (..., 1, G * Sq, D) of x (..., G, Sq, D), or None where x's G and Sq axes
    are not one run of rows."""
    *lead, g, _, d = x.shape
    *lead_strides, g_stride, row_stride, col_stride = x.strides
    if sq == 1:
        row_stride = g_stride
    elif g_stride != sq * row_stride:
        return None
    return _strided(x, (*lead, 1, g * sq, d), (*lead_strides, 0, row_stride, col_stride))


def _rows_folded_or_copied(x, sq: int):
    """:func:`_rows_folded` of x, or of a C-contiguous copy of x where its G and Sq axes
    are not one run."""
    y = _rows_folded(x, sq)
    return y if y is not None else _rows_folded(x.copy(order="C"), sq)


def _strided(x, shape: tuple, strides: tuple):
    """The view of x's memory (from its first element) with these shape and byte strides,
    a NumPy or CuPy array like x."""
    if isinstance(x, np.ndarray):
        return np.lib.stride_tricks.as_strided(x, shape, strides, subok=True)
    return type(x)(shape, x.dtype, memptr=x.data, strides=strides)


def split_count(call: AttentionCall, sm_count: int) -> int:
    """How many key chunks a call runs in (1: no split). Only calls whose blocks would fill
    under half of the SMs, without a left window bound, with enough keys for two chunks of
    MIN_CHUNK; the last chunk must hold the rows' causal or right-window band, so every
    earlier key is seen by every row (a mask or bias is cut into chunks with the keys)."""
    if call.window_left >= 0:
        return 1
    if call.k_lengths is not None and 0 <= call.window_right < call.seqlen_q - 1:
        return 1  # a band aligned to each key length: the earlier chunks may lie outside it
    blocks = math.prod(call.batch_shape) * -(-call.seqlen_q // ROWS_PER_BLOCK)
    if blocks == 0 or 2 * blocks > sm_count:
        return 1
    n = min(MAX_CHUNKS, -(-2 * sm_count // blocks), call.seqlen_k // MIN_CHUNK)
    if call.pages is not None:  # chunks of whole pages, as few as hold them at that width
        pages = -(-call.seqlen_k // call.pages.page_size)
        n = min(n, pages)
        if n >= 2:
            width = -(-pages // n)   # pages per chunk (chunk_width)
            n = -(-pages // width)
    if n < 2:
        return 1
    tail = call.seqlen_k - (n - 1) * chunk_width(call, n)
    if call.window_right >= 0 and tail < call.seqlen_q - call.window_right:
        return 1
    return n


def chunk_width(call: AttentionCall, n: int) -> int:
    """Keys in each of the first ``n - 1`` chunks: ``Sk // n``, or, for paged keys and
    values, the whole pages of an n-th of them rounded up (a key tile lies in one page:
    key_rows in common.cuh), so that the last chunk is the shortest rather than the
    longest; :func:`split_count` takes the n for which it still holds keys."""
    if call.pages is None:
        return call.seqlen_k // n
    page = call.pages.page_size
    pages = -(-call.seqlen_k // page)
    return page * -(-pages // n)


def buffers(call: AttentionCall, n: int):
    """The partial results of a call in ``n`` key chunks, uninitialised: outs
    (..., n, Sq, Dv) of the input dtype and lses (..., n, Sq) of the lse dtype."""
    xp, batch = call.xp, call.batch_shape
    return (xp.empty(batch + (n, call.seqlen_q, call.head_dim_v), call.dtype),
            xp.empty(batch + (n, call.seqlen_q), lse_dtype(call.dtype)))


def parts(call: AttentionCall, n: int, outs, lses) -> list:
    """The two calls whose results are a call's ``n`` partial results (:func:`buffers`),
    each with the view of ``lses`` its lse goes to: views of the call's arrays and of the
    buffers, derived without validating them again. The first runs the ``n - 1`` equal
    chunks as one more batch axis (q broadcast over it), with no band: every row sees every
    key there (:func:`split_count`); the second runs the last chunk with the call's band."""
    sk = call.seqlen_k
    width = chunk_width(call, n)
    head = (n - 1) * width  # keys of the first n - 1 chunks
    batch = call.batch_shape

    def chunked(x):  # (..., Sk, D) -> (..., n - 1, L, D): a view
        if call.pages is not None:  # the pools' stand-ins: the kernels find each chunk's pages
            return call.xp.broadcast_to(x[..., None, :width, :],
                                        x.shape[:-2] + (n - 1, width, x.shape[-1]))
        return x[..., :head, :].reshape(x.shape[:-2] + (n - 1, width, x.shape[-1]))

    first = dict(q=call.q[..., None, :, :], k=chunked(call.k), v=chunked(call.v),
                 mask=_chunked_cols(call.mask, n - 1, width),
                 bias=_chunked_cols(call.bias, n - 1, width))
    last = dict(q=call.q, k=call.k[..., head:, :], v=call.v[..., head:, :],
                mask=_last_cols(call.mask, head), bias=_last_cols(call.bias, head))
    if call.k_lengths is not None:
        # each chunk's keys are its entries' lengths less its first key: the chunk axis
        # (the first part's last batch axis, kernel batch axis 2 where it has more than one
        # entry) steps them by the chunk width
        first.update(k_lengths=call.k_lengths[..., None], k_lengths_from=call.k_lengths_from,
                     k_lengths_step=width if n > 2 else 0)
        last.update(k_lengths_from=call.k_lengths_from + head)
    if call.pages is not None:  # the page table: its rows as the lengths' (no key offset)
        first.update(pages=dataclasses.replace(call.pages,
                                               table=call.pages.table[..., None, :]))
    return [(_part(call, first, outs[..., :n - 1, :, :], batch + (n - 1,), width, -1),
             lses[..., :n - 1, :]),
            (_part(call, last, outs[..., n - 1, :, :], batch, sk - head, call.window_right),
             lses[..., n - 1, :])]


def _chunked_cols(x, chunks: int, width: int):
    """A mask or bias (..., Sq, Sk) as the view (..., chunks, Sq, width) of its first
    ``chunks * width`` key columns; one that broadcasts along the keys (Sk axis 1) gets a
    chunk axis of 1. None stays None."""
    if x is None:
        return None
    if x.shape[-1] == 1:
        return x[..., None, :, :]
    *lead, rows, _ = x.shape
    *lead_strides, row_stride, col_stride = x.strides
    return _strided(x, (*lead, chunks, rows, width),
                    (*lead_strides, width * col_stride, row_stride, col_stride))


def _last_cols(x, head: int):
    """A mask or bias from key column ``head`` on (itself where it broadcasts along the
    keys)."""
    return x if x is None or x.shape[-1] == 1 else x[..., head:]


def forward(call: AttentionCall, n: int, run):
    """``(out, lse)`` of a validated call in ``n`` key chunks: :func:`parts` computed by
    ``run(call)`` (a validated call's ``(out, lse)``, without splitting it again), then
    merged in order. The NumPy composition of the split that the GPU backend plans as one
    launch sequence (``cuattn._gpu``)."""
    from .merge import merge_stacked
    outs, lses = buffers(call, n)
    for part, lse in parts(call, n, outs, lses):
        lse[...] = run(part)[1]
    return merge_stacked(outs, lses, out=call.out)


def _part(call: AttentionCall, arrays: dict, out, batch: tuple, seqlen_k: int, right: int):
    """The call on views of its arrays (``arrays``: q, k, v, mask, bias): no left bound
    (split_count), the right bound ``right`` (-1: none), and its lse."""
    return dataclasses.replace(call, **arrays, out=out, batch_shape=batch, seqlen_k=seqlen_k,
                               window_left=-1, window_right=right, return_lse=True)
