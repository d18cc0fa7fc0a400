"""Paged keys and values: ``attention(q, k_pages, v_pages, k_lengths=..., block_table=...)``.

The pools hold fixed-size pages, ``(num_pages, ..., page_size, D)``; row b of the table
lists the pages of batch entry b in order, so that its keys are the rows of those pages
one after another: the keys and values of a dense call ``(B, ..., max_pages · page_size,
D)``, which is how the call is validated (``_checks_ragged.check_paged``, then the dense checks
on zero-stride stand-ins of that shape). It runs on the table columns that the entries'
lengths reach (every column with key lengths in device memory, which are not read on the
host), as a call with key lengths (``_ragged``), in one of two ways (:func:`prepared`):

- in place (:func:`in_place`), on the GPU where the page size is a multiple of
  PAGE_ROWS and dispatch's family has instances that read pages (PAGED in common.cuh;
  16-bit inputs): the kernels look each key tile's page up in the table, so the call reads
  the pools as a dense call reads its keys;
- gathered (:func:`gathered`) otherwise: the pages are copied into one array for the keys
  and one for the values (one indexed copy each).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._checks import AttentionCall
from ._checks_ragged import Paged, Ragged, check_pages_used

__all__ = ["prepared", "in_place", "gathered", "Pages", "PAGE_ROWS"]

#: rows per page that the kernels read in place: a multiple of every key tile of the
#: instances that read pages, so that a tile lies inside one page (key_rows in common.cuh)
PAGE_ROWS = 128


@dataclass(frozen=True, slots=True)
class Pages:
    """Paged keys and values as the GPU kernels read them in place (AttnParams.pages and
    the page fields): the table (int32 on the device, the call's batch axes with the table's
    rows on the pools' page axis' place, then its columns), rows per page, pages in the
    pools, and the element strides from page to page and from row to row of each pool."""
    table: Any
    page_size: int
    num_pages: int
    k_page: int
    v_page: int
    k_row: int
    v_row: int

    def key(self) -> tuple:
        """What a launch plan depends on (the table's address aside)."""
        t = self.table
        return (t.shape, t.strides, self.page_size, self.num_pages, self.k_page, self.v_page,
                self.k_row, self.v_row)


def prepared(call: AttentionCall, paged: Paged, ragged: Ragged) -> AttentionCall:
    """The validated call (on ``paged``'s stand-ins) as the call with key lengths that runs
    it: :func:`in_place` where the kernels read the pages, else :func:`gathered`."""
    return in_place(call, paged, ragged) or gathered(call, paged, ragged)


def in_place(call: AttentionCall, paged: Paged, ragged: Ragged) -> AttentionCall | None:
    """The call that reads the pools in place (call.pages), its keys cut to the table
    columns that host key lengths reach; None where the kernels cannot read them: NumPy, a
    page size that is not a multiple of PAGE_ROWS, or a family without such instances."""
    if call.xp is np or paged.page_size % PAGE_ROWS:
        return None
    from ._gpu import serves_paged
    if not serves_paged(call):
        return None
    lengths = ragged.k_lengths
    used = (check_pages_used(paged, lengths) if isinstance(lengths, np.ndarray)
            else paged.table.shape[1])
    keys = used * paged.page_size
    xp, table = call.xp, call.xp.asarray(paged.table)
    if table.dtype != np.int32:  # the kernels clamp a page outside the pools: so may this
        table = xp.clip(table, -1, paged.k_pages.shape[0]).astype(np.int32)
    # the table's rows stand on the pools' page axis, followed by one of size 1 per other
    # leading axis of the pools, then its columns
    mid = paged.k_pages.ndim - 3
    table = table.reshape((table.shape[0],) + (1,) * mid + (table.shape[1],))
    kp, vp = paged.k_pages, paged.v_pages
    pages = Pages(table=table, page_size=paged.page_size, num_pages=kp.shape[0],
                  k_page=kp.strides[0] // kp.itemsize, v_page=vp.strides[0] // vp.itemsize,
                  k_row=kp.strides[-2] // kp.itemsize, v_row=vp.strides[-2] // vp.itemsize)
    mask, bias = (None if x is None else x[..., :keys] if x.shape[-1] > 1 else x
                  for x in (call.mask, call.bias))
    # the stand-ins' rows have stride 0: cutting them keeps their address (the pools')
    return dataclasses.replace(call, k=call.k[..., :keys, :], v=call.v[..., :keys, :],
                               mask=mask, bias=bias, seqlen_k=keys, pages=pages)


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

