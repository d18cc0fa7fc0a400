"""Validation of the arguments beyond one dense call: the parts of a merge, packed
offsets and key lengths, paged keys and values, and cache appends.

As in ``_checks``, everything is found before any launch or allocation and raised with
the documented exception types; the functions return records the backends consume.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._checks import (
    FLOAT_DTYPES,
    AttentionCall,
    _device_id,
    _writeable,
    as_array,
    broadcasts_to,
    lse_dtype,
    may_overlap,
    mixed_kinds,
)

__all__ = ["check_merge", "Ragged", "check_ragged", "Paged", "check_paged",
           "check_pages_used", "CacheAppend", "check_cache_append"]


def check_merge(outs, lses):
    """Validate the partial results of :func:`cuattn.merge_attention`; returns
    ``(outs, lses, xp)`` as arrays of one kind, shape and dtype, on one device."""
    for name, parts in (("outs", outs), ("lses", lses)):
        # an array is not a list of parts (its rows would be taken for parts)
        if (isinstance(parts, (str, bytes)) or not hasattr(parts, "__len__")
                or hasattr(parts, "shape")):
            raise TypeError(f"{name} must be a list of arrays, one per part, got "
                            f"{type(parts).__name__}")
    if len(outs) != len(lses):
        raise ValueError(f"outs and lses must have one entry per part, got {len(outs)} outs "
                         f"and {len(lses)} lses")
    if len(outs) == 0:
        raise ValueError("merge_attention needs at least one part, got none")
    named = ([(f"outs[{i}]", x) for i, x in enumerate(outs)]
             + [(f"lses[{i}]", x) for i, x in enumerate(lses)])
    arrays = [as_array(x, name) for name, x in named]
    xp = arrays[0][1]
    for (name, _), (_, xm) in zip(named, arrays):
        if xm is not xp:
            raise mixed_kinds(name, xm, "outs[0]", xp)
    outs = [x for x, _ in arrays[:len(outs)]]
    lses = [x for x, _ in arrays[len(outs):]]
    first = outs[0]
    if first.dtype not in FLOAT_DTYPES:
        raise TypeError(f"outs[0] has dtype {first.dtype}; supported dtypes are float16, "
                        f"bfloat16, float32 and float64")
    if first.ndim < 2:
        raise ValueError(f"outs[0] must have at least 2 dims (..., Sq, Dv), got shape "
                         f"{first.shape}")
    want = lse_dtype(first.dtype)
    device = _device_id(first, xp)
    for i, (o, lse) in enumerate(zip(outs, lses)):
        if o.dtype != first.dtype:
            raise TypeError(f"outs[{i}] has dtype {o.dtype} but outs[0] has {first.dtype} "
                            f"(they must match)")
        if o.shape != first.shape:
            raise ValueError(f"outs[{i}] has shape {o.shape} but outs[0] has {first.shape} "
                             f"(they must match)")
        if lse.dtype != want:
            raise TypeError(f"lses[{i}] must have dtype {want} (the lse of {first.dtype} "
                            f"attention), got {lse.dtype}")
        if lse.shape != first.shape[:-1]:
            raise ValueError(f"lses[{i}] must have shape {first.shape[:-1]} (outs' shape "
                             f"without its last axis), got {lse.shape}")
        for name, x in ((f"outs[{i}]", o), (f"lses[{i}]", lse)):
            if _device_id(x, xp) != device:
                raise ValueError(f"{name} is on device {_device_id(x, xp)} but outs[0] is on "
                                 f"device {device}")
    return outs, lses, xp


@dataclass(slots=True)
class Ragged:
    """The packed sequences or the per-entry key lengths of a validated call. Host
    (NumPy) metadata is int64, and host ``k_lengths`` are broadcast to the batch shape (a
    view); device (CuPy) metadata is as given."""
    q_offsets: Any = None
    k_offsets: Any = None
    max_q_len: int | None = None
    max_k_len: int | None = None
    k_lengths: Any = None

    @property
    def on_host(self) -> bool:
        """Whether the metadata is host memory (readable without touching the device)."""
        arrays = (self.q_offsets, self.k_offsets, self.k_lengths)
        return all(x is None or isinstance(x, np.ndarray) for x in arrays)


def _index_array(x, name: str, xp, ref, ref_name: str):
    """An integer array argument in host memory, or (for a CuPy call, ``xp`` cupy) in the
    device memory of ``ref``."""
    x, xm = as_array(x, name)
    if xm is not np and xm is not xp:
        raise mixed_kinds(name, xm, ref_name, xp)
    if x.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}")
    if xm is np:
        return x.astype(np.int64, copy=False)
    if x.data.device_id != ref.data.device_id:
        raise ValueError(f"{name} is on device {x.data.device_id} but {ref_name} is on device "
                         f"{ref.data.device_id}")
    return x


@dataclass(slots=True)
class Paged:
    """Validated paged keys and values (``block_table``): the pools ``(num_pages, ...,
    page_size, D)``, the table ``(B, max_pages)`` (int64 NumPy, or a CuPy integer array),
    and the stand-ins: zero-stride views of the pools with the shape of the keys and values
    the table describes, ``(B, ..., max_pages · page_size, D)``, under which the call is
    validated as a dense one."""
    k_pages: Any
    v_pages: Any
    table: Any
    k: Any
    v: Any

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[-2]

    def longest_per_row(self, lengths):
        """The longest of the (non-empty) key ``lengths`` on each table row: ``(rows,)``,
        or ``(1,)`` where one value serves every row. The lengths are right-aligned to the
        batch shape, whose table axis stands in front of the pools' leading dims."""
        axis = lengths.ndim - (self.k_pages.ndim - 2)
        if self.table.shape[0] == 1 or axis < 0 or lengths.shape[axis] == 1:
            return lengths.max().reshape(1)
        return lengths.max(axis=tuple(a for a in range(lengths.ndim) if a != axis))


def check_paged(q, k_pages, v_pages, block_table, out=None) -> Paged:
    """Validate the pools and the page table of a paged call (docs/semantics.rst, "Paged
    keys and values"), and that ``out`` does not overlap the pools; the rest is validated
    as the dense call of its stand-ins."""
    q, xp = as_array(q, "q")
    pools = []
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        x, xm = as_array(x, name)
        if xm is not xp:
            raise mixed_kinds(name, xm, "q", xp)
        if x.ndim < 3:
            raise ValueError(f"{name} must have at least 3 dims (num_pages, ..., page_size, "
                             f"D), got shape {x.shape}")
        pools.append(x)
    k_pages, v_pages = pools
    if k_pages.shape[:-1] != v_pages.shape[:-1]:
        raise ValueError(f"k_pages and v_pages must have the same pages, page size and "
                         f"leading dims (all but the head dim), got {k_pages.shape} and "
                         f"{v_pages.shape}")
    if k_pages.shape[-2] < 1:
        raise ValueError(f"the page size (k_pages.shape[-2]) must be at least 1, got shape "
                         f"{k_pages.shape}")
    if k_pages.shape[0] < 1:
        raise ValueError(f"k_pages and v_pages must hold at least one page, got shape "
                         f"{k_pages.shape}")
    if out is not None:
        out, xo = as_array(out, "out")
        for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
            if xo is xp and may_overlap(out, x):
                raise ValueError(f"out overlaps {name}; it must be a separate array")
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but q has {q.dtype} (they must "
                            f"match; cuattn does not promote silently)")
    if q.ndim >= 1 and k_pages.shape[-1] != q.shape[-1]:
        raise ValueError(f"k_pages has head dim {k_pages.shape[-1]} but q has {q.shape[-1]} "
                         f"(they must match)")
    table = _index_array(block_table, "block_table", xp, q, "q")
    if table.ndim != 2:
        raise ValueError(f"block_table must be 2-D (B, max_pages), got shape {table.shape}")
    entries = (table.shape[0],) + k_pages.shape[1:-2]
    if not _broadcasts(entries, q.shape[:-2]):
        raise ValueError(f"the table's rows and the pools' leading dims {entries} "
                         f"(block_table {table.shape}, k_pages {k_pages.shape}) do not "
                         f"broadcast with q's leading dims {q.shape[:-2]}")
    stand_ins = []
    for x in pools:
        rows = table.shape[1] * x.shape[-2]
        shape = (table.shape[0],) + x.shape[1:-2] + (rows, x.shape[-1])
        stand_ins.append(xp.broadcast_to(x[:1, ..., :1, :], shape))
    return Paged(k_pages=k_pages, v_pages=v_pages, table=table, k=stand_ins[0],
                 v=stand_ins[1])


def _broadcasts(a: tuple, b: tuple) -> bool:
    try:
        np.broadcast_shapes(a, b)
    except ValueError:
        return False
    return True


def check_pages_used(paged: Paged, lengths) -> int:
    """The table columns that the host key ``lengths`` (validated, broadcast to the batch
    shape) reach; for a host table, checks that each of them names a page of the pools
    wherever an entry reaches it (the columns past an entry's length are not read)."""
    if lengths.size == 0:
        return 0
    pages = -(-paged.longest_per_row(lengths) // paged.page_size)
    used = int(pages.max())
    if isinstance(paged.table, np.ndarray) and used:
        table = paged.table[:, :used]
        bad = (np.arange(used) < pages[:, None]) & ((table < 0)
                                                    | (table >= paged.k_pages.shape[0]))
        if bad.any():
            b, p = np.argwhere(bad)[0]
            raise ValueError(f"block_table[{b}, {p}] = {table[b, p]} is not a page of the "
                             f"pools (0 to {paged.k_pages.shape[0] - 1}), and k_lengths "
                             f"reach that column of row {b}")
    return used


def _length(value, name: str, limit: int, longest: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {name}={value!r}")
    if not 0 <= value <= limit:
        raise ValueError(f"{name} must be between 0 and {limit}, got {name}={value}")
    if longest is not None and value < longest:
        raise ValueError(f"{name}={value} is less than the longest sequence ({longest})")
    return int(value)


def check_ragged(call: AttentionCall, q_offsets=None, k_offsets=None, max_q_len=None,
                 max_k_len=None, k_lengths=None) -> Ragged | None:
    """Validate the packed-sequence arguments (``q_offsets``, ``k_offsets``, ``max_q_len``,
    ``max_k_len``) or the key lengths (``k_lengths``) of a validated call; None when none
    is given (docs/semantics.rst, "Packed sequences" and "Key lengths")."""
    if q_offsets is None and k_offsets is None and k_lengths is None:
        if max_q_len is not None or max_k_len is not None:
            raise ValueError("max_q_len and max_k_len go with q_offsets and k_offsets")
        return None
    if k_lengths is not None:
        if q_offsets is not None or k_offsets is not None:
            raise ValueError("k_lengths cannot be combined with q_offsets and k_offsets "
                             "(the offsets give every sequence its keys)")
        if max_q_len is not None or max_k_len is not None:
            raise ValueError("max_q_len and max_k_len go with q_offsets and k_offsets")
        lengths = _index_array(k_lengths, "k_lengths", call.xp, call.q, "q")
        if not broadcasts_to(lengths.shape, call.batch_shape):
            raise ValueError(f"k_lengths of shape {lengths.shape} does not broadcast to the "
                             f"batch shape {call.batch_shape}")
        if isinstance(lengths, np.ndarray):
            if lengths.size and (lengths.min() < 0 or lengths.max() > call.seqlen_k):
                raise ValueError(f"k_lengths must be between 0 and Sk={call.seqlen_k}, got "
                                 f"values from {lengths.min()} to {lengths.max()}")
            lengths = np.broadcast_to(lengths, call.batch_shape)
        return Ragged(k_lengths=lengths)
    if q_offsets is None or k_offsets is None:
        raise ValueError("q_offsets and k_offsets are given together (got only "
                         f"{'q_offsets' if k_offsets is None else 'k_offsets'})")
    if call.mask is not None or call.bias is not None:
        raise NotImplementedError("mask and bias cannot be combined with q_offsets and "
                                  "k_offsets")
    offsets = []
    for name, x, total in (("q_offsets", q_offsets, call.seqlen_q),
                           ("k_offsets", k_offsets, call.seqlen_k)):
        x = _index_array(x, name, call.xp, call.q, "q")
        if x.ndim != 1 or x.shape[0] < 1:
            raise ValueError(f"{name} must be a 1-D array of n + 1 offsets (n sequences), "
                             f"got shape {x.shape}")
        if isinstance(x, np.ndarray):
            what = "Tq" if name == "q_offsets" else "Tk"
            if x[0] != 0 or x[-1] != total:
                raise ValueError(f"{name} must start at 0 and end at {what}={total}, got "
                                 f"{x[0]} .. {x[-1]}")
            if np.any(np.diff(x) < 0):
                raise ValueError(f"{name} must be non-decreasing")
        offsets.append(x)
    q_off, k_off = offsets
    if q_off.shape != k_off.shape:
        raise ValueError(f"q_offsets and k_offsets must have one length (n + 1 for n "
                         f"sequences), got {q_off.shape[0]} and {k_off.shape[0]}")
    lengths = []
    for name, x, given, total in (("max_q_len", q_off, max_q_len, call.seqlen_q),
                                  ("max_k_len", k_off, max_k_len, call.seqlen_k)):
        if isinstance(x, np.ndarray):
            longest = int(np.diff(x).max()) if x.shape[0] > 1 else 0
            lengths.append(longest if given is None else _length(given, name, total, longest))
        elif given is None:
            raise ValueError(f"device offsets need {name} (an int): it is not read from the "
                             f"device behind the caller's back")
        else:
            lengths.append(_length(given, name, total, None))
    return Ragged(q_offsets=q_off, k_offsets=k_off, max_q_len=lengths[0],
                  max_k_len=lengths[1])


@dataclass(slots=True)
class CacheAppend:
    """A validated :func:`cuattn.kv_cache_append`: the caches, the new rows, the lengths
    (int64 NumPy, or a CuPy integer array) and the batch shape of the caches."""
    xp: Any
    k_cache: Any
    v_cache: Any
    k_new: Any
    v_new: Any
    lengths: Any
    batch_shape: tuple


def check_cache_append(k_cache, v_cache, k_new, v_new, lengths) -> CacheAppend:
    """Validate a cache append (docs/semantics.rst, "Key/value caches")."""
    named = {"k_cache": k_cache, "v_cache": v_cache, "k_new": k_new, "v_new": v_new}
    arrays = {name: as_array(x, name) for name, x in named.items()}
    xp = arrays["k_cache"][1]
    for name, (_, xm) in arrays.items():
        if xm is not xp:
            raise mixed_kinds(name, xm, "k_cache", xp)
    k_cache, v_cache, k_new, v_new = (x for x, _ in arrays.values())
    for name, x in zip(named, (k_cache, v_cache, k_new, v_new)):
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; supported dtypes are float16, "
                            f"bfloat16, float32 and float64")
        if x.dtype != k_cache.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but k_cache has {k_cache.dtype} "
                            f"(they must match)")
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., S, D), got shape "
                             f"{x.shape}")
    batch = k_cache.shape[:-2]
    if v_cache.shape[:-1] != k_cache.shape[:-1]:
        raise ValueError(f"v_cache of shape {v_cache.shape} does not match k_cache of shape "
                         f"{k_cache.shape} (batch dims and cache rows must match)")
    if k_new.shape[-1] != k_cache.shape[-1] or v_new.shape[-1] != v_cache.shape[-1]:
        raise ValueError(f"head dims differ: k_new {k_new.shape[-1]} vs k_cache "
                         f"{k_cache.shape[-1]}, v_new {v_new.shape[-1]} vs v_cache "
                         f"{v_cache.shape[-1]}")
    if k_new.shape[-2] != v_new.shape[-2]:
        raise ValueError(f"k_new has {k_new.shape[-2]} new rows but v_new has "
                         f"{v_new.shape[-2]} (they must match)")
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if not broadcasts_to(x.shape[:-2], batch):
            raise ValueError(f"{name} of shape {x.shape} does not broadcast to the caches' "
                             f"batch shape {batch}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not _writeable(x):
            raise ValueError(f"{name} is read-only; it must be a writeable array")
        if any(n > 1 and st == 0 for n, st in zip(x.shape, x.strides)):
            raise ValueError(f"{name} is a broadcast view (a zero stride); a cache must own "
                             f"its rows")
    pairs = [("k_cache", k_cache, "v_cache", v_cache)] + [
        (a, x, b, y) for a, x in (("k_new", k_new), ("v_new", v_new))
        for b, y in (("k_cache", k_cache), ("v_cache", v_cache))]
    for a, x, b, y in pairs:
        if may_overlap(x, y):
            raise ValueError(f"{a} overlaps {b}; they must be separate arrays")
    if xp is not np:
        device = k_cache.data.device_id
        for name, x in zip(named, (k_cache, v_cache, k_new, v_new)):
            if x.data.device_id != device:
                raise ValueError(f"{name} is on device {x.data.device_id} but k_cache is on "
                                 f"device {device}")
    lengths = _index_array(lengths, "lengths", xp, k_cache, "k_cache")
    if not broadcasts_to(lengths.shape, batch):
        raise ValueError(f"lengths of shape {lengths.shape} does not broadcast to the caches' "
                         f"batch shape {batch}")
    rows, new = k_cache.shape[-2], k_new.shape[-2]
    if isinstance(lengths, np.ndarray) and lengths.size:
        if lengths.min() < 0:
            raise ValueError(f"lengths must be >= 0, got {lengths.min()}")
        if lengths.max() + new > rows:
            raise ValueError(f"the cache has {rows} rows: appending {new} after a length of "
                             f"{lengths.max()} overflows it")
    return CacheAppend(xp, k_cache, v_cache, k_new, v_new, lengths, batch)
