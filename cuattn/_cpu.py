"""The NumPy backend: attention on the CPU by the kernels' blocked online softmax, and its
backward by FlashAttention-2's recomputation from ``lse``.

The algorithm and its names are those of the kernels and of
:func:`cuattn.reference.attention_blocked` (``BLOCK_M``, ``BLOCK_N``, ``m``, ``l``,
``acc``, ``alpha``, ``scale_log2``, ``exp2``), written here for speed: BLAS for the tile
products into reused buffers, in-place elementwise work, and no masking pass over tiles that
lie wholly inside the causal/window band when there is no mask. ``cuattn.reference`` is the
test oracle and is not imported here.

Accumulation is float32 for 16-bit and float32 inputs and float64 for float64.

Tiling: when one batch entry's Sq x Sk scores number at most ``_WHOLE``, a tile holds whole
rows (one key tile, so no rescaling) and as many batch entries as keep the tile within
``_WHOLE`` scores: a small call is a single tile (with a causal/window band, the outer loop
is cut into ``_BAND_BLOCKS`` blocks so that the scores outside the band are skipped).
Longer sequences take tiles of ``_BLOCK_N`` keys and about ``_TILE`` scores per batch entry,
for as many entries as fit in ``_TILE``. Besides the inputs' own size (converted copies, the
scaled q, the output and the gradients), memory is O(tile) whatever the sequence length.
"""
from __future__ import annotations

import math

import numpy as np

from . import _split
from ._checks import AttentionCall, lse_dtype

__all__ = ["attention_forward", "attention_backward"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Few large BLAS calls beat many small ones (each threaded gemm has a start-up cost), while
# a tile that stays in cache beats one that does not: 16 MiB of float32 scores at most.
_WHOLE = 1 << 22  # scores per tile when tiles hold whole rows
_TILE = 1 << 20  # scores per tile for longer sequences
_BLOCK_N = 512  # keys per tile for longer sequences
_MIN_BLOCK = 16  # fewest query rows (or keys) per block
_BAND_BLOCKS = 8  # whole-row calls with a causal/window band: blocks of the outer loop


class _Tiling:
    """How a call is cut: a group of batch entries (consecutive indices of one batch axis,
    ``chunk`` of them, with the axes after it whole) at a time, and each group's scores
    ``block_m`` query rows by ``block_n`` keys at a time. ``outer`` is the axis of the outer
    loop: ``"rows"`` (forward) or ``"keys"`` (backward)."""

    __slots__ = ("axis", "chunk", "block_m", "block_n")

    def __init__(self, call: AttentionCall, block_m: int | None, block_n: int | None,
                 outer: str):
        batch = call.batch_shape
        sq, sk = max(call.seqlen_q, 1), max(call.seqlen_k, 1)
        if block_m is None and block_n is None and sq * sk <= _WHOLE:
            block_m, block_n, budget = sq, sk, _WHOLE  # whole rows: no rescaling at all
            if call.window_left >= 0 or call.window_right >= 0:
                # blocks of the outer loop take only the keys (or rows) of their band: a
                # causal call then does a little over half the work of a whole tile
                if outer == "rows":
                    block_m = max(_MIN_BLOCK, -(-sq // _BAND_BLOCKS))
                else:
                    block_n = max(_MIN_BLOCK, -(-sk // _BAND_BLOCKS))
        else:
            block_n = min(sk, block_n or _BLOCK_N)
            if block_m is None:
                block_m = max(_MIN_BLOCK, _TILE // block_n)
            budget = _TILE
        self.block_m, self.block_n = min(sq, block_m), block_n
        group = max(1, budget // (self.block_m * self.block_n))
        # the axis to cut: the last one whose trailing product exceeds the group size
        self.axis, self.chunk, rest = -1, 1, 1
        for a in range(len(batch) - 1, -1, -1):
            if rest * batch[a] > group:
                self.axis, self.chunk = a, max(1, group // rest)
                break
            rest *= batch[a]

    def groups(self, batch_shape):
        """Index tuples into the batch: integers before the cut axis, a slice on it."""
        if self.axis < 0:
            yield ()
            return
        n = batch_shape[self.axis]
        for outer in np.ndindex(*batch_shape[:self.axis]):
            for c0 in range(0, n, self.chunk):
                yield outer + (slice(c0, min(c0 + self.chunk, n)),)


def _grad_index(idx, shape):
    """Where a group's gradient goes in the gradient of an input of ``shape`` (padded to the
    batch rank): the input's broadcast axes are taken at 0 (an integer) or whole (a slice)."""
    return tuple(i if n != 1 else (0 if isinstance(i, int) else slice(None))
                 for i, n in zip(idx, shape))


def _tile(x, rows: slice, cols: slice):
    """``x[..., rows, cols]`` where a size-1 (broadcast) axis is kept whole instead of being
    sliced to nothing."""
    return x[..., rows if x.shape[-2] != 1 else slice(None),
             cols if x.shape[-1] != 1 else slice(None)]


def _full(x, batch_shape):
    """``x`` viewed with the whole batch shape (stride 0 on its broadcast axes)."""
    return np.broadcast_to(x, batch_shape + x.shape[-2:])


def _to_acc(x, acc_dtype):
    """``x`` in the accumulator dtype, C-contiguous so that BLAS takes every matrix of it."""
    return np.ascontiguousarray(x, dtype=acc_dtype)


class _Band:
    """The causal/window band of a call and the inverted mask of the current group of batch
    entries: which keys each query row may see."""

    def __init__(self, call: AttentionCall):
        self.left, self.right = call.window_left, call.window_right
        self.off = call.seqlen_k - call.seqlen_q  # bottom-right alignment
        self.sq, self.sk = call.seqlen_q, call.seqlen_k
        self.not_mask = None

    def keys(self, rows: slice) -> tuple[int, int]:
        """The key range ``[lo, hi)`` that some row of ``rows`` may see."""
        lo, hi = 0, self.sk
        if self.left >= 0:
            lo = max(lo, rows.start + self.off - self.left)
        if self.right >= 0:
            hi = min(hi, rows.stop - 1 + self.off + self.right + 1)
        return lo, hi

    def queries(self, cols: slice) -> tuple[int, int]:
        """The query range ``[lo, hi)`` whose band reaches some key of ``cols``."""
        lo, hi = 0, self.sq
        if self.right >= 0:
            lo = max(lo, cols.start - self.off - self.right)
        if self.left >= 0:
            hi = min(hi, cols.stop - 1 - self.off + self.left + 1)
        return lo, hi

    def blocked(self, rows: slice, cols: slice):
        """Bool array broadcastable to the tile's scores, True where a key is not allowed;
        None when every key of the tile is allowed (the fast path)."""
        out = None
        top, bottom = rows.start + self.off, rows.stop - 1 + self.off
        if self.left >= 0 and cols.start < bottom - self.left:
            i = np.arange(top, bottom + 1)[:, None]
            out = np.arange(cols.start, cols.stop)[None, :] < i - self.left
        if self.right >= 0 and cols.stop - 1 > top + self.right:
            i = np.arange(top, bottom + 1)[:, None]
            late = np.arange(cols.start, cols.stop)[None, :] > i + self.right
            out = late if out is None else out | late
        if self.not_mask is not None:
            tile = _tile(self.not_mask, rows, cols)
            out = tile if out is None else tile | out
        return out


class _Scratch:
    """Flat buffers reused from tile to tile, so that a call allocates its tile memory once;
    ``view(i, shape)`` is a C-contiguous array (as BLAS wants it) over buffer ``i``."""

    def __init__(self, dtype, count: int):
        self.dtype = dtype
        self.buffers = [np.empty(0, dtype) for _ in range(count)]

    def view(self, i: int, shape):
        n = math.prod(shape)
        if self.buffers[i].size < n:
            self.buffers[i] = np.empty(n, self.dtype)
        return self.buffers[i][:n].reshape(shape)


def _scores(call: AttentionCall, q_blk, k_blk, bias, rows, cols, band, scratch):
    """Scores of a tile in log2 units, ``-inf`` where a key is not allowed, in scratch
    buffer 0 (1 under softcap); ``q_blk`` is q times ``scale_log2`` (or ``scale / softcap``).
    Returns ``(s, t)`` with ``t = tanh(...)`` under softcap (for the backward), else None."""
    shape = np.broadcast_shapes(q_blk.shape[:-2], k_blk.shape[:-2]) + (
        q_blk.shape[-2], k_blk.shape[-2])
    s = np.matmul(q_blk, np.swapaxes(k_blk, -1, -2), out=scratch.view(0, shape))
    t = None
    if call.softcap:
        t = np.tanh(s, out=s)
        s = np.multiply(t, call.softcap * LOG2E, out=scratch.view(1, shape))
    if bias is not None:
        s += np.multiply(_tile(bias, rows, cols), LOG2E, dtype=s.dtype)
    blocked = band.blocked(rows, cols)
    if blocked is not None:
        np.copyto(s, -np.inf, where=blocked)
    return s, t


def _prepared(call: AttentionCall, acc_dtype):
    """q, k and v in the accumulator dtype, q also scaled for log2 scores (by
    ``scale_log2``, or by ``scale / softcap`` under softcap, where the cap's own factor
    follows the tanh), and the mask inverted (True where a key is not allowed)."""
    q, k, v = (_to_acc(x, acc_dtype) for x in (call.q, call.k, call.v))
    scale_log2 = call.scale * LOG2E
    factor = call.scale / call.softcap if call.softcap else scale_log2
    q_s = q * acc_dtype.type(factor)
    not_mask = None if call.mask is None else ~call.mask
    return q, q_s, k, v, not_mask


def attention_forward(call: AttentionCall, *, block_m: int | None = None,
                      block_n: int | None = None):
    """``(out, lse)`` for a validated NumPy call.

    Parameters
    ----------
    call : AttentionCall
        A validated call with NumPy arrays; ``out`` is written into ``call.out`` when given.
    block_m, block_n : int, optional
        Query rows and keys per tile (``BLOCK_M``, ``BLOCK_N``); chosen from the call's
        size when omitted.

    Returns
    -------
    out : ndarray
        ``call.out_shape`` in the dtype of q.
    lse : ndarray or None
        Natural-log row log-sum-exp in float32 (float64 for float64), only when
        ``call.return_lse``.
    """
    # query groups as rows: one product per key head, not one per group; copied where the
    # strides do not fold, since BLAS rounds a row differently in products of other shapes
    # and a call's result must not depend on its layout
    result = _split.run_folded(call, lambda folded: attention_forward(
        folded, block_m=block_m, block_n=block_n), copy=True)
    if result is not None:
        return result
    acc_dtype = lse_dtype(call.dtype)
    out = call.out if call.out is not None else np.empty(call.out_shape, call.dtype)
    lse = np.empty(call.lse_shape, acc_dtype) if call.return_lse else None
    if out.size == 0:
        return out, lse
    batch = call.batch_shape
    _, q_s, k, v, not_mask = _prepared(call, acc_dtype)
    band = _Band(call)
    tiling = _Tiling(call, block_m, block_n, "rows")
    scratch = _Scratch(acc_dtype, 3)
    arrays = [_full(x, batch) if x is not None else None
              for x in (q_s, k, v, not_mask, call.bias)]
    for idx in tiling.groups(batch):
        qg, kg, vg, nmg, bg = (x[idx] if x is not None else None for x in arrays)
        band.not_mask = nmg
        _forward_group(call, tiling, band, scratch, qg, kg, vg, bg, out[idx],
                       None if lse is None else lse[idx])
    return out, lse


def _forward_group(call, tiling, band, scratch, q, k, v, bias, out, lse):
    """The online softmax over the query blocks of one group of batch entries."""
    BLOCK_M, BLOCK_N = tiling.block_m, tiling.block_n
    acc_dtype = q.dtype
    for m0 in range(0, call.seqlen_q, BLOCK_M):
        rows = slice(m0, min(m0 + BLOCK_M, call.seqlen_q))
        n_lo, n_hi = band.keys(rows)
        if n_lo >= n_hi:  # no row of the block sees a key
            out[..., rows, :] = 0
            if lse is not None:
                lse[..., rows] = -np.inf
            continue
        q_blk = q[..., rows, :]
        m = l = acc = None
        for n0 in range(n_lo, n_hi, BLOCK_N):
            cols = slice(n0, min(n0 + BLOCK_N, n_hi))
            s, _ = _scores(call, q_blk, k[..., cols, :], bias, rows, cols, band, scratch)
            m_tile = s.max(axis=-1)
            m_new = m_tile if m is None else np.maximum(m, m_tile)
            # a row with nothing allowed so far has m = -inf: shift by 0 so exp2 gives 0
            m_use = np.where(np.isneginf(m_new), acc_dtype.type(0), m_new)
            s -= m_use[..., None]
            p = np.exp2(s, out=s)
            if m is None:
                l = p.sum(axis=-1)
                acc = np.matmul(p, v[..., cols, :])
            else:
                alpha = np.exp2(m - m_use)
                l *= alpha
                l += p.sum(axis=-1)
                acc *= alpha[..., None]
                acc += np.matmul(p, v[..., cols, :], out=scratch.view(2, acc.shape))
            m = m_new
        empty = l == 0  # no allowed key: out 0 and lse -inf
        if empty.any():
            l_div = np.where(empty, acc_dtype.type(1), l)
        else:
            empty, l_div = None, l
        acc /= l_div[..., None]
        out[..., rows, :] = acc
        if lse is not None:
            m_use = np.where(np.isneginf(m), acc_dtype.type(0), m)
            lse_blk = m_use * acc_dtype.type(LN2) + np.log(l_div)
            if empty is not None:
                lse_blk[empty] = -np.inf
            lse[..., rows] = lse_blk


def _reduce_to(x, shape):
    """Sum ``x`` over the axes (same count as ``shape``) on which ``shape`` has size 1 and
    ``x`` does not: the gradient of a broadcast input. The order of the sums is fixed."""
    axes = tuple(a for a, (n, m) in enumerate(zip(shape, x.shape)) if n == 1 and m != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def attention_backward(call: AttentionCall, dout, out, lse, *, block_m: int | None = None,
                       block_n: int | None = None):
    """``(dq, dk, dv)`` for a validated NumPy call.

    FlashAttention-2's backward: ``delta = rowsum(dout ∘ out)``; then for each key tile
    (``BLOCK_N`` keys) and each query tile (``BLOCK_M`` rows) that its band reaches, P is
    recomputed from q, k and ``lse``, and ``dV += Pᵀ dO``, ``dS = P ∘ (dO Vᵀ - delta)``
    (times ``1 - tanh²`` under softcap), ``dK += dSᵀ Q``, ``dQ += dS K`` (both times
    ``scale``). Gradients of broadcast inputs are summed over their broadcast axes tile by
    tile; the order of every sum is fixed, so repeated calls give identical bits.

    Parameters
    ----------
    call : AttentionCall
        The validated forward call (NumPy arrays).
    dout, out : ndarray
        ``call.out_shape`` in the dtype of q.
    lse : ndarray
        ``call.lse_shape``, float32 (float64 for float64 inputs).
    block_m, block_n : int, optional
        As for :func:`attention_forward`.

    Returns
    -------
    dq, dk, dv : ndarray
        The shapes and dtype of q, k and v.
    """
    acc_dtype = lse_dtype(call.dtype)
    batch, nb = call.batch_shape, len(call.batch_shape)
    padded = [(1,) * (nb + 2 - x.ndim) + x.shape for x in (call.q, call.k, call.v)]
    dq, dk, dv = (np.zeros(shape, acc_dtype) for shape in padded)
    if min(call.seqlen_q, call.seqlen_k, math.prod(batch)) > 0:
        q, q_s, k, v, not_mask = _prepared(call, acc_dtype)
        do = _to_acc(dout, acc_dtype)
        delta = np.einsum("...d,...d->...", do, np.asarray(out, dtype=acc_dtype))
        # a row with no allowed key has lse = -inf: exp2(s - inf) = 0 leaves it out
        lse2 = np.where(np.isneginf(lse), np.inf, lse) * acc_dtype.type(LOG2E)
        band = _Band(call)
        tiling = _Tiling(call, block_m, block_n, "keys")
        scratch = _Scratch(acc_dtype, 3)
        arrays = [_full(x, batch) if x is not None else None
                  for x in (q, q_s, k, v, not_mask, call.bias)]
        for idx in tiling.groups(batch):
            qg, qsg, kg, vg, nmg, bg = (x[idx] if x is not None else None for x in arrays)
            band.not_mask = nmg
            # where this group's gradients go: index 0 on an input's broadcast axes
            grads = [g[_grad_index(idx, g.shape)] for g in (dq, dk, dv)]
            _backward_group(call, tiling, band, scratch, qg, qsg, kg, vg, bg, do[idx],
                            delta[idx], lse2[idx], *grads)
        dq *= acc_dtype.type(call.scale)
        dk *= acc_dtype.type(call.scale)
    return tuple(g.reshape(x.shape).astype(call.dtype, copy=False)
                 for g, x in zip((dq, dk, dv), (call.q, call.k, call.v)))


def _backward_group(call, tiling, band, scratch, q, q_s, k, v, bias, do, delta, lse2,
                    dq, dk, dv):
    """Key tiles outside, query tiles of the band inside, for one group of batch entries;
    the group's gradients are added to ``dq``, ``dk``, ``dv`` (shaped as its inputs)."""
    BLOCK_M, BLOCK_N = tiling.block_m, tiling.block_n
    for n0 in range(0, call.seqlen_k, BLOCK_N):
        cols = slice(n0, min(n0 + BLOCK_N, call.seqlen_k))
        m_lo, m_hi = band.queries(cols)
        if m_lo >= m_hi:
            continue
        k_blk, v_blk = k[..., cols, :], v[..., cols, :]
        dk_blk = dv_blk = None
        for m0 in range(m_lo, m_hi, BLOCK_M):
            rows = slice(m0, min(m0 + BLOCK_M, m_hi))
            s, t = _scores(call, q_s[..., rows, :], k_blk, bias, rows, cols, band, scratch)
            s -= lse2[..., rows, None]
            p = np.exp2(s, out=s)
            do_blk = do[..., rows, :]
            part = _reduce_to(np.matmul(np.swapaxes(p, -1, -2), do_blk), dv.shape)
            dv_blk = part if dv_blk is None else np.add(dv_blk, part, out=dv_blk)
            ds = np.matmul(do_blk, np.swapaxes(v_blk, -1, -2), out=scratch.view(2, p.shape))
            ds -= delta[..., rows, None]
            ds *= p
            if t is not None:  # d softcap·tanh(x / softcap) = 1 - tanh²
                np.multiply(t, t, out=t)
                np.subtract(1, t, out=t)
                ds *= t
            part = _reduce_to(np.matmul(np.swapaxes(ds, -1, -2), q[..., rows, :]), dk.shape)
            dk_blk = part if dk_blk is None else np.add(dk_blk, part, out=dk_blk)
            dq[..., rows, :] += _reduce_to(np.matmul(ds, k_blk), dq.shape)
        dk[..., cols, :] += dk_blk
        dv[..., cols, :] += dv_blk
