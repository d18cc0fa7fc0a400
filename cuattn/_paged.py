"""Paged keys and values: ``attention(q, k_pages, v_pages, k_lengths=..., block_table=...)``.

The pools hold fixed-size pages, ``(num_pages, ..., page_size, D)``; row b of the table
lists the pages of batch entry b in order, so that its keys are the rows of those pages
one after another: the keys and values of a dense call ``(B, ..., max_pages · page_size,
D)``, which is how the call is validated (``_checks_ragged.check_paged``, then the dense checks
on zero-stride stand-ins of that shape). It runs on the table columns that the entries'
lengths reach: their pages are gathered into one array for the keys and one for the values
(one indexed copy each), and the call goes on as a call with key lengths (``_ragged``).
With key lengths in device memory, which are not read on the host, every column of the
table is gathered.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ._checks import AttentionCall
from ._checks_ragged import Paged, Ragged, check_pages_used

__all__ = ["gathered"]


def gathered(call: AttentionCall, paged: Paged, ragged: Ragged) -> AttentionCall:
    """The call validated on ``paged``'s stand-ins, on the gathered keys and values of the
    pages its key lengths reach (host lengths; every column of the table for device
    lengths), its mask and bias cut to those keys."""
    lengths = ragged.k_lengths
    on_host = isinstance(lengths, np.ndarray)
    # device lengths are not read on the host: every column of the table, then
    used = check_pages_used(paged, lengths) if on_host else paged.table.shape[1]
    keys = used * paged.page_size
    mask, bias = (None if x is None else x[..., :keys] if x.shape[-1] > 1 else x
                  for x in (call.mask, call.bias))
    xp = call.xp
    v = _gather(xp, paged.v_pages, paged.table, used)
    if not on_host:
        v = _zero_past(xp, v, lengths, paged)
    return dataclasses.replace(call, k=_gather(xp, paged.k_pages, paged.table, used), v=v,
                               mask=mask, bias=bias, seqlen_k=keys)


def _zero_past(xp, v, lengths, paged: Paged):
    """The gathered values ``v`` (B, ..., keys, Dv) with the rows past the longest device
    length of each table row set to 0. Device lengths run as a mask, which gives those
    keys weight 0 but still reads their values: the columns past a length may name any
    page (a -1 wraps), whose rows need not be finite, and 0 times them must stay 0."""
    if lengths.size == 0:
        return v
    longest = paged.longest_per_row(lengths)
    keys = v.shape[-2]
    valid = xp.arange(keys) < longest.astype(xp.int64)[:, None]
    valid = valid.reshape((valid.shape[0],) + (1,) * (v.ndim - 3) + (keys, 1))
    # selected on the bits (all zero is +0 in every float dtype): CuPy 14.2's where of a
    # bfloat16 array and a 0-d bfloat16 zero returns float32
    bits = v.view(f"u{v.dtype.itemsize}")
    return xp.where(valid, bits, xp.zeros((), bits.dtype)).view(v.dtype)


def _gather(xp, pool, table, used: int):
    """``(B, ..., used · page_size, D)``: the pages of the first ``used`` table columns of
    each row, in order, copied out of ``pool`` ``(num_pages, ..., page_size, D)``."""
    num_pages, mid = pool.shape[0], pool.shape[1:-2]
    table = table[:, :used]
    if isinstance(table, np.ndarray):
        # a column past an entry's length may hold anything (it is not read): page 0 there
        table = np.where((table >= 0) & (table < num_pages), table, 0)
        if xp is not np:
            table = xp.asarray(table)
    # one index array per leading axis, broadcasting to (B, *mid, used): one copy, already
    # in the order of the keys
    lead = len(mid)
    index = [table.reshape((table.shape[0],) + (1,) * lead + (used,))]
    for a, n in enumerate(mid):
        index.append(xp.arange(n).reshape((1,) * (a + 1) + (n,) + (1,) * (lead - a)))
    pages = pool[tuple(index)]  # (B, *mid, used, page_size, D)
    return pages.reshape(pages.shape[:-3] + (used * pool.shape[-2], pool.shape[-1]))

