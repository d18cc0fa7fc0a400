"""Packed sequences and key lengths, as dense calls.

On the GPU, a packed call whose kernel family has packed instances is one grid over every
sequence (``_gpu.forward_packed``; its backward too, ``_gpu_backward.backward``), and a
call with key lengths whose family has instances that read them is one dense call
(``_gpu.forward_lengths``). Otherwise a packed call is one dense call per sequence:
rows ``q_offsets[s]:q_offsets[s+1]`` against keys ``k_offsets[s]:k_offsets[s+1]``, written
into its rows of the output and of the lse.
A call with ``k_lengths`` is one dense call per run of equal entries of the lengths array
(neighbours along one batch axis): the batch entries of the run, against their first
``k_lengths[b]`` keys. Each dense call is
a view of the validated call, run on its backend without validating it again (on the GPU,
side by side on a few streams); it aligns causal and window masking to its own
bottom-right corner, which is the per-sequence (per-length) alignment of the contract.

Key lengths in device memory are not read on the host: they become a bool mask built on
the device (:func:`lengths_mask`), joined to the call's own mask, with the band folded
into it, and the call runs as one dense masked call.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ._checks import AttentionCall, lse_dtype
from ._checks_ragged import Ragged

__all__ = ["forward", "backward", "lengths_mask"]


def _sequences(ragged: Ragged):
    """(query rows, key rows) of each packed sequence with at least one query row."""
    q_off, k_off = ragged.q_offsets.tolist(), ragged.k_offsets.tolist()
    for a, b, c, d in zip(q_off[:-1], q_off[1:], k_off[:-1], k_off[1:]):
        if b > a:
            yield slice(a, b), slice(c, d)


def _groups(call: AttentionCall, ragged: Ragged):
    """(batch selection, key count) per run of equal key lengths: the selection takes
    ``i:j`` along the last batch axis on which the lengths vary, where entries i .. j-1 of
    it share a length, ``i:i+1`` on the other such axes, and whole axes elsewhere. Equal
    neighbours make one call, so a batch of equal lengths is one dense call."""
    lengths = ragged.k_lengths
    if lengths.size == 0:  # an empty batch: no call
        return
    vary = [a for a, (n, st) in enumerate(zip(lengths.shape, lengths.strides))
            if n > 1 and st != 0]
    if not vary:
        yield (slice(None),) * len(call.batch_shape), int(lengths.flat[0])
        return
    *outer, last = vary
    for idx in np.ndindex(*(lengths.shape[a] for a in outer)):
        sel = [slice(None)] * len(call.batch_shape)
        at = [0] * len(call.batch_shape)
        for a, i in zip(outer, idx):
            sel[a], at[a] = slice(i, i + 1), i
        along = lengths[tuple(slice(None) if a == last else i for a, i in enumerate(at))]
        start = 0
        for i in range(1, len(along) + 1):
            if i == len(along) or along[i] != along[start]:
                sel[last] = slice(start, i)
                yield tuple(sel), int(along[start])
                start = i


def _select(x, sel: tuple):
    """The batch entries ``sel`` (over the whole batch rank) of an input whose leading dims
    are right-aligned to the batch axes and may be fewer or broadcast (size 1)."""
    if x is None:
        return None
    lead = x.ndim - 2
    skip = len(sel) - lead
    index = tuple(s if x.shape[a - skip] != 1 else slice(None)
                  for a, s in enumerate(sel) if a >= skip)
    return x[index]


def _keys(x, n: int, axis: int):
    """The first ``n`` keys of an input whose key axis is ``axis``: -2 for k and v (and
    their gradients), -1 for a mask or bias, which stays whole where it broadcasts (size 1)
    along the keys."""
    if x is None or axis == -1 and x.shape[-1] == 1:
        return x
    return x[..., :n] if axis == -1 else x[..., :n, :]


def _sequence(call: AttentionCall, out, rows: slice, keys: slice) -> AttentionCall:
    """One packed sequence of a validated call: views of its arrays, valid as they are (the
    call's band and scalars hold per sequence), into its rows of ``out``, with its lse."""
    return dataclasses.replace(call, q=call.q[..., rows, :], k=call.k[..., keys, :],
                               v=call.v[..., keys, :], out=out[..., rows, :],
                               seqlen_q=rows.stop - rows.start,
                               seqlen_k=keys.stop - keys.start, return_lse=True)


def lengths_mask(xp, lengths, seqlen_q: int, seqlen_k: int, window_left: int,
                 window_right: int):
    """The bool mask ``lengths.shape + (Sq or 1, Sk)`` that says the same as key lengths
    ``lengths`` (an integer array of ``xp``, any integer dtype, broadcastable to the batch
    shape; each clipped to 0 .. Sk) under the band (left, right) (-1: unbounded) aligned to
    each length; its query axis is 1 without a band. Built with ``xp``'s array operations,
    so device lengths stay on the device."""
    # int64 first: an unsigned or narrow dtype would wrap in length - Sq
    length = xp.clip(lengths.astype(xp.int64), 0, seqlen_k)[..., None, None]
    j = xp.arange(seqlen_k)
    allowed = j < length
    if window_left >= 0 or window_right >= 0:
        centre = xp.arange(seqlen_q)[:, None] + (length - seqlen_q)
        if window_right >= 0:
            allowed = allowed & (j <= centre + window_right)
        if window_left >= 0:
            allowed = allowed & (j >= centre - window_left)
    return allowed


def as_masked(call: AttentionCall, lengths) -> AttentionCall:
    """A validated call with key ``lengths`` as the dense call whose mask says the same:
    the lengths' mask (band included) and the call's own mask, and no band."""
    mask = lengths_mask(call.xp, lengths, call.seqlen_q, call.seqlen_k, call.window_left,
                        call.window_right)
    if call.mask is not None:
        mask = mask & call.mask
    return dataclasses.replace(call, mask=mask, window_left=-1, window_right=-1)


def forward(call: AttentionCall, ragged: Ragged):
    """``(out, lse)`` of a validated call with ``ragged`` metadata."""
    if ragged.k_lengths is not None and call.xp is not np:
        from ._gpu import forward_lengths
        result = forward_lengths(call, ragged.k_lengths)  # the kernels read the lengths
        if result is not None:
            return result
    if not ragged.on_host:  # device key lengths
        from .attention import _forward
        return _forward(dataclasses.replace(as_masked(call, ragged.k_lengths),
                                            return_lse=True))
    xp = call.xp
    out = call.out if call.out is not None else xp.empty(call.out_shape, call.dtype)
    lse = xp.empty(call.lse_shape, lse_dtype(call.dtype))
    if ragged.k_lengths is None and xp is not np:
        from ._gpu import forward_packed
        if forward_packed(call, ragged, out, lse):  # one grid over every sequence
            return out, lse
    if ragged.k_lengths is None:
        parts = [(_sequence(call, out, rows, keys), lse[..., rows])
                 for rows, keys in _sequences(ragged)]
    else:
        parts = [(_group(call, out, sel, n), lse[sel]) for sel, n in _groups(call, ragged)]
    if xp is np:
        from ._cpu import attention_forward
        for part, part_lse in parts:
            _, part_lse[...] = attention_forward(part)
    else:
        from ._gpu import forward_parts
        forward_parts(parts)
    return out, lse


def _group(call: AttentionCall, out, sel: tuple, n: int) -> AttentionCall:
    """The batch entries ``sel`` of a validated call against their first ``n`` keys: views
    of its arrays, valid as they are, into their entries of ``out``, with their lse."""
    batch = tuple(len(range(m)[s]) for s, m in zip(sel, call.batch_shape))
    return dataclasses.replace(
        call, q=_select(call.q, sel), k=_keys(_select(call.k, sel), n, -2),
        v=_keys(_select(call.v, sel), n, -2), mask=_keys(_select(call.mask, sel), n, -1),
        bias=_keys(_select(call.bias, sel), n, -1), out=out[sel], batch_shape=batch,
        seqlen_k=n, return_lse=True)


def backward(call: AttentionCall, ragged: Ragged, dout, out, lse):
    """``(dq, dk, dv)`` of a validated call with ``ragged`` metadata. Host metadata: each
    dense part's gradients added into float32 (float64 for float64) arrays of the inputs'
    shapes, rounded once; device key lengths: the dense masked call's."""
    from .attention import _backward, attention_backward
    if ragged.k_lengths is None and call.xp is not np:
        from ._gpu_backward import backward as gpu_backward
        offsets = tuple(x if isinstance(x, np.ndarray) else x.get()
                        for x in (ragged.q_offsets, ragged.k_offsets))
        grads = gpu_backward(call, dout, out, lse, packed=offsets)  # one grid per kernel
        if grads is not None:
            return grads
    if not ragged.on_host:
        return _backward(as_masked(call, ragged.k_lengths), dout, out, lse)
    xp, kw = call.xp, {**call.keywords(), "window": call.window}
    acc = lse_dtype(call.dtype)
    q, k, v = call.q, call.k, call.v
    grads = [xp.zeros(x.shape, acc) for x in (q, k, v)]
    dq, dk, dv = grads
    if ragged.k_lengths is None:
        for rows, keys in _sequences(ragged):
            parts = attention_backward(dout[..., rows, :], q[..., rows, :], k[..., keys, :],
                                       v[..., keys, :], out[..., rows, :], lse[..., rows], **kw)
            dq[..., rows, :] += parts[0]
            dk[..., keys, :] += parts[1]
            dv[..., keys, :] += parts[2]
        return tuple(g.astype(call.dtype) for g in grads)
    for sel, n in _groups(call, ragged):
        parts = attention_backward(dout[sel], _select(q, sel), _keys(_select(k, sel), n, -2),
                                   _keys(_select(v, sel), n, -2), out[sel], lse[sel],
                                   mask=_keys(_select(call.mask, sel), n, -1),
                                   bias=_keys(_select(call.bias, sel), n, -1), **kw)
        _select(dq, sel)[...] += parts[0]
        _keys(_select(dk, sel), n, -2)[...] += parts[1]
        _keys(_select(dv, sel), n, -2)[...] += parts[2]
    return tuple(g.astype(call.dtype) for g in grads)
