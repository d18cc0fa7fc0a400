"""Attention on Dask arrays: a lazy graph of in-memory calls, one per chunk pair.

The graph follows the three independent directions of attention. Chunks along the batch
axes map block to block; chunks of query rows are independent; chunks of keys give partial
results with their ``lse``, combined by :func:`cuattn.merge_attention` in a fixed tree
(``SPLIT_EVERY`` parts per merge task, intermediate results in the accumulation dtype,
rounded to the input dtype once at the root). The backward sums per-chunk gradients in the
same kind of tree. A key chunk that no row of a query chunk can see (``causal``,
``window``) makes no task; one that some rows see only in part is first cut to the columns
any row sees, which keeps the band expressible as a window of the smaller call.

Each task holds one chunk of each input (and a merge task at most ``SPLIT_EVERY`` partial
outputs of one query chunk), never the whole of K or V. Validation runs on the arrays'
shapes and dtypes when the graph is built, before anything is computed. Only this module
imports Dask, and only :mod:`cuattn.attention` imports it, when a Dask array is passed.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import partial
from operator import getitem

import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from ._checks import (
    AttentionCall,
    as_array,
    check_attention,
    check_backward,
    loaded_cupy,
    lse_dtype,
)
from .merge import merge_attention

__all__ = ["attention", "attention_backward", "attention_vjp"]

#: Partial results combined by one merge (or gradient-sum) task: it bounds such a task's
#: memory to this many query chunks and fixes the order of the combination.
SPLIT_EVERY = 8


def _kind(meta) -> str:
    if isinstance(meta, np.ndarray):
        return "numpy"
    cupy = loaded_cupy()
    if cupy is not None and isinstance(meta, cupy.ndarray):
        return "cupy"
    return type(meta).__module__.split(".")[0] + "." + type(meta).__name__


def _to_dask(named: dict) -> dict:
    """The given arrays as Dask arrays of one chunk kind (numpy or cupy chunks); an
    in-memory array becomes a single chunk. Mixed kinds are the TypeError of a mixed call."""
    result, kinds = {}, {}
    for name, x in named.items():
        if x is None:
            result[name] = None
            continue
        if not isinstance(x, da.Array):
            x, xp = as_array(x, name)
            # name=False: no hash of the data (that would read all of it) for the key
            x = da.from_array(x, chunks=x.shape or (), asarray=False, name=False)
        kind = _kind(x._meta)
        if kind not in ("numpy", "cupy"):
            raise TypeError(f"{name} is a Dask array of {kind} chunks; cuattn takes Dask arrays "
                            f"of numpy or cupy chunks")
        if any(math.isnan(n) for c in x.chunks for n in c):
            raise ValueError(f"{name} has unknown chunk sizes {x.chunks}; call "
                             f"{name}.compute_chunk_sizes() first")
        result[name], kinds[name] = x, kind
    first = next(iter(kinds))
    if any(kind != kinds[first] for kind in kinds.values()):
        raise TypeError("host and device arrays cannot be mixed in one call: "
                        + ", ".join(f"{n} has {kind} chunks" for n, kind in kinds.items()))
    return result


def _stand_in(x):
    """A NumPy array of ``x``'s shape and dtype that holds one element: enough for the
    validation, which reads shapes and dtypes only."""
    return None if x is None else np.broadcast_to(np.zeros((), x.dtype), x.shape)


@dataclass
class _Grid:
    """The aligned inputs of one call and its blocks: every input has the call's rank (batch
    axes, then two), with size-1 axes where it broadcasts, and shares the chunks of the
    others along each axis where it is not broadcast."""
    arrays: dict            # name -> aligned dask array (or None)
    batch_chunks: tuple     # per batch axis, the chunk sizes
    row_chunks: tuple       # chunk sizes of the query rows (Sq)
    col_chunks: tuple       # chunk sizes of the keys (Sk)
    added: dict             # name -> leading size-1 axes added to the user's array

    def batch_blocks(self):
        return itertools.product(*(range(len(c)) for c in self.batch_chunks))

    def block_index(self, name, bt, row=0, col=0):
        """The block of input ``name`` that serves batch block ``bt``, query chunk ``row``
        and key chunk ``col`` (a broadcast axis has one block, block 0)."""
        x = self.arrays[name]
        index = tuple(0 if x.shape[t] == 1 else b for t, b in enumerate(bt))
        nb = len(bt)
        if name == "lse":
            return index + (row,)
        if name in ("k", "v"):
            return index + (col, 0)
        if name in ("mask", "bias"):
            return index + (0 if x.shape[nb] == 1 else row, 0 if x.shape[nb + 1] == 1 else col)
        return index + (row, 0)  # q, dout, out

    def visible(self, call):
        """Per batch block and query chunk: ``(bt, i, rows, cuts)``, where ``cuts`` lists
        ``(j, c0, cut)`` for the key chunks that some row of the query chunk sees."""
        for bt in self.batch_blocks():
            for i, (r0, sq) in enumerate(zip(_starts(self.row_chunks), self.row_chunks)):
                cuts = []
                for j, (c0, sk) in enumerate(zip(_starts(self.col_chunks), self.col_chunks)):
                    cut = _cut(call, r0, sq, c0, sk)
                    if cut is not None:
                        cuts.append((j, c0, cut))
                yield bt, i, sq, cuts

    def keys(self, names, bt, row, col):
        """The graph keys of the blocks of ``names`` for one task (None for an absent
        input)."""
        return [None if self.arrays[n] is None
                else (self.arrays[n].name, *self.block_index(n, bt, row, col)) for n in names]


def _starts(chunks):
    return tuple(itertools.accumulate((0,) + tuple(chunks[:-1])))


def _align(call: AttentionCall, named: dict, lse_like=()) -> _Grid:
    """Bring every input to the call's rank and common chunks (see _Grid); the arrays
    named in ``lse_like`` have the rank of lse (batch axes, Sq)."""
    nb = len(call.batch_shape)
    rank = nb + 2
    aligned, added = {}, {}
    for name, x in named.items():
        if x is None:
            aligned[name] = None
            continue
        if name in ("mask", "bias") and x.ndim < 2:
            x = x.reshape((1,) * (2 - x.ndim) + x.shape)
        want = rank - 1 if name in lse_like else rank
        added[name] = want - x.ndim
        if x.ndim < want:
            x = x[(None,) * (want - x.ndim)]
        aligned[name] = x

    def chunks_of(axis_of, size):
        for name, x in aligned.items():
            if x is not None and x.shape[axis_of(name)] == size and size != 1:
                return x.chunks[axis_of(name)]
        return (size,)

    batch_chunks = tuple(chunks_of(lambda _n, t=t: t, call.batch_shape[t]) for t in range(nb))
    row_chunks = aligned["q"].chunks[nb]
    col_chunks = aligned["k"].chunks[nb]
    for name, x in aligned.items():
        if x is None:
            continue
        target = [batch_chunks[t] if x.shape[t] != 1 else (1,) for t in range(nb)]
        if name in ("q", "k", "v", "dout", "out"):
            rows = col_chunks if name in ("k", "v") else row_chunks
            target += [rows, (x.shape[nb + 1],)]
        elif name in ("mask", "bias"):
            target += [row_chunks if x.shape[nb] != 1 else (1,),
                       col_chunks if x.shape[nb + 1] != 1 else (1,)]
        else:  # lse
            target += [row_chunks]
        target = tuple(target)
        if x.chunks != target:
            aligned[name] = x.rechunk(target)
    return _Grid(aligned, batch_chunks, row_chunks, col_chunks, added)


@dataclass(frozen=True)
class _Cut:
    """What one (query chunk, key chunk) pair computes: the key columns ``[lo, hi)`` of the
    chunk that any of its rows sees, and the band of the smaller call, as a window
    ``(left, right)`` (-1: unbounded) or, where a window cannot say it, as ``band``:
    allowed when ``band[0] <= j - i <= band[1]`` (None: unbounded) in the call's own
    coordinates."""
    lo: int
    hi: int
    window: tuple | None
    band: tuple | None


def _cut(call: AttentionCall, r0: int, sq: int, c0: int, sk: int) -> _Cut | None:
    """The part of key chunk [c0, c0+sk) that query rows [r0, r0+sq) see, or None."""
    left, right = call.window_left, call.window_right
    off = call.seqlen_k - call.seqlen_q  # bottom-right alignment of the whole call
    lo, hi = c0, c0 + sk
    if right >= 0:
        hi = min(hi, r0 + sq + off + right)
    if left >= 0:
        lo = max(lo, r0 + off - left)
    if hi <= lo or sq == 0:
        return None
    # global row i = r0 + i', key j = lo + j': the call's band in local coordinates
    first = r0 + off - left - lo if left >= 0 else None   # j' - i' >= first
    last = r0 + off + right - lo if right >= 0 else None  # j' - i' <= last
    width = hi - lo
    left_free = first is None or first <= -(sq - 1)  # the left bound cuts no (row, key)
    right_free = last is None or last >= width - 1   # the right bound cuts none
    if left_free and right_free:
        return _Cut(lo, hi, None, None)
    local_off = width - sq  # the smaller call's own bottom-right alignment
    w_left = -1 if left_free else local_off - first
    w_right = -1 if right_free else last - local_off
    if (left_free or w_left >= 0) and (right_free or w_right >= 0):
        return _Cut(lo, hi, (w_left, w_right), None)
    return _Cut(lo, hi, None, (None if left_free else first, None if right_free else last))


def _slice_cols(x, lo, hi):
    """Columns [lo, hi) of a mask or bias block (one that broadcasts along them as it is)."""
    return x if x is None or x.shape[-1] == 1 else x[..., lo:hi]


def _band(xp, rows, cols, band):
    d = xp.arange(cols)[None, :] - xp.arange(rows)[:, None]
    ok = xp.ones((rows, cols), dtype=bool)
    if band[0] is not None:
        ok &= d >= band[0]
    if band[1] is not None:
        ok &= d <= band[1]
    return ok


def _restrict(q, k, v, mask, bias, cut: _Cut, c0: int):
    """The inputs of one cut: its key columns, its mask and bias columns, and its band."""
    a, b = cut.lo - c0, cut.hi - c0
    k, v = k[..., a:b, :], v[..., a:b, :]
    mask = _slice_cols(mask, a, b)
    bias = _slice_cols(bias, a, b)
    window = None
    if cut.window is not None:
        window = tuple(None if side < 0 else side for side in cut.window)
    if cut.band is not None:
        _, xp = as_array(q, "q")
        band = _band(xp, q.shape[-2], b - a, cut.band)
        mask = band if mask is None else mask & band
    return k, v, mask, bias, window


def _forward_part(q, k, v, mask, bias, *, cut, c0, kwargs):
    from .attention import attention
    k, v, mask, bias, window = _restrict(q, k, v, mask, bias, cut, c0)
    return attention(q, k, v, mask=mask, bias=bias, window=window, return_lse=True, **kwargs)


def _merge_parts(parts, *, dtype):
    """One merge of the tree: ``parts`` are (out, lse) pairs; ``dtype`` is the input dtype at
    the root, which rounds once, and None below it, where results stay in the accumulation
    dtype (float32, float64 for float64), as inside :func:`cuattn.merge_attention`. The
    parts of one merge share a dtype: all leaves, or all results of the level below."""
    outs, lses = [o for o, _ in parts], [lse for _, lse in parts]
    if dtype is None:  # keep the accumulation dtype for the next level
        outs = [o.astype(lses[0].dtype, copy=False) for o in outs]
    out, lse = merge_attention(outs, lses)
    return (out if dtype is None else out.astype(dtype, copy=False)), lse


def _backward_part(dout, q, k, v, out, lse, mask, bias, *, cut, c0, kwargs):
    from .attention import attention_backward
    k, v, mask, bias, window = _restrict(q, k, v, mask, bias, cut, c0)
    return attention_backward(dout, q, k, v, out, lse, mask=mask, bias=bias, window=window,
                              **kwargs)


def _sum_parts(items, like, *, dtype):
    """One sum of the gradient tree. ``items`` are [value, which, first]: the gradient
    ``value[which]`` of a part's (dq, dk, dv) (or ``value`` itself when ``which`` is None)
    covers rows [first, first + n) of the block ``like``; ``dtype`` as in
    :func:`_merge_parts`."""
    _, xp = as_array(like, "like")
    acc = xp.zeros(like.shape, lse_dtype(like.dtype))
    for value, which, first in items:
        g = value if which is None else value[which]
        acc[..., first:first + g.shape[-2], :] += g
    return acc if dtype is None else acc.astype(dtype)


def _tree(name, index, leaves, combine, final, lift=lambda key: key):
    """Tasks that combine ``leaves`` ``SPLIT_EVERY`` at a time, level by level, in their
    order: ``combine(group, dtype)`` makes a task of a group (``final`` at the root, None
    below), and ``lift(key)`` is how a combined group enters the next level. Returns the
    tasks and the root's key (a single leaf is its own root)."""
    tasks = {}
    if len(leaves) == 1:
        return tasks, leaves[0]
    level = 0
    while len(leaves) > SPLIT_EVERY:
        grouped = []
        for g in range(0, len(leaves), SPLIT_EVERY):
            key = (name, *index, level, g)
            tasks[key] = combine(leaves[g:g + SPLIT_EVERY], None)
            grouped.append(lift(key))
        leaves, level = grouped, level + 1
    root = (name, *index)
    tasks[root] = combine(leaves, final)
    return tasks, root


def _meta(x, ndim, dtype):
    return da.utils.meta_from_array(x._meta, ndim=ndim, dtype=dtype)


def _graph(inputs, layers: dict, deps: dict) -> HighLevelGraph:
    """The inputs' graphs with ``layers`` added; ``deps`` names each new layer's inputs
    among the other new layers (the Dask inputs are dependencies of every one)."""
    merged = HighLevelGraph.merge(*(x.__dask_graph__() for x in inputs))
    all_layers, all_deps = dict(merged.layers), dict(merged.dependencies)
    input_layers = {name for x in inputs for name in x.__dask_layers__()}
    for name, tasks in layers.items():
        all_layers[name] = tasks
        all_deps[name] = set(deps.get(name, ())) | input_layers
    return HighLevelGraph(all_layers, all_deps)


def _prepare(named, check):
    """Dask inputs, their validation on stand-ins, the aligned grid."""
    arrays = _to_dask(named)
    call = check({name: _stand_in(x) for name, x in arrays.items()})
    return call, arrays


def attention(q, k, v, *, scale=None, causal=False, window=None, mask=None, bias=None,
              softcap=None, return_lse=False, precision=None, out=None):
    """:func:`cuattn.attention` on Dask arrays (see the module docstring)."""
    if out is not None:
        raise TypeError(f"out is not supported with Dask arrays (the result is a new Dask "
                        f"array), got out of type {type(out).__name__}")
    call, arrays = _prepare(
        {"q": q, "k": k, "v": v, "mask": mask, "bias": bias},
        lambda s: check_attention(s["q"], s["k"], s["v"], scale=scale, causal=causal,
                                  window=window, mask=s["mask"], bias=s["bias"],
                                  softcap=softcap, return_lse=return_lse,
                                  precision=precision))
    out, lse = _forward(call, _align(call, arrays))
    return (out, lse) if call.return_lse else out


def _token(kind, call: AttentionCall, grid: _Grid) -> str:
    return tokenize(kind, [None if x is None else x.name for x in grid.arrays.values()],
                    call.scale, call.softcap, call.window_left, call.window_right,
                    call.precision, SPLIT_EVERY)


def _forward(call: AttentionCall, grid: _Grid):
    token = _token("forward", call, grid)
    part, merge = f"cuattn-part-{token}", f"cuattn-merge-{token}"
    out_name, lse_name = f"cuattn-attention-{token}", f"cuattn-lse-{token}"
    kwargs = call.keywords()
    names = ("q", "k", "v", "mask", "bias")
    pairs, outs, lses = {}, {}, {}

    def combine(group, dtype):
        return (partial(_merge_parts, dtype=dtype), list(group))

    for bt, i, _, cuts in grid.visible(call):
        leaves = []
        for j, c0, cut in cuts:
            key = (part, *bt, i, j)
            pairs[key] = (partial(_forward_part, cut=cut, c0=c0, kwargs=kwargs),
                          *grid.keys(names, bt, i, j))
            leaves.append(key)
        if not leaves:  # no key of any chunk is visible: attention over no keys
            key = (part, *bt, i, -1)
            pairs[key] = (partial(_forward_part, cut=_Cut(0, 0, None, None), c0=0,
                                  kwargs=kwargs), *grid.keys(names, bt, i, 0))
            leaves.append(key)
        tasks, root = _tree(merge, (*bt, i), leaves, combine, call.dtype)
        pairs.update(tasks)
        outs[(out_name, *bt, i, 0)] = (getitem, root, 0)
        lses[(lse_name, *bt, i)] = (getitem, root, 1)
    inputs = [x for x in grid.arrays.values() if x is not None]
    graph = _graph(inputs, {part: pairs, out_name: outs, lse_name: lses},
                   {out_name: {part}, lse_name: {part}})
    q = grid.arrays["q"]
    out = da.Array(graph, out_name, chunks=grid.batch_chunks + (grid.row_chunks,
                                                                (call.head_dim_v,)),
                   meta=_meta(q, q.ndim, call.dtype))
    lse = da.Array(graph, lse_name, chunks=grid.batch_chunks + (grid.row_chunks,),
                   meta=_meta(q, q.ndim - 1, lse_dtype(call.dtype)))
    return out, lse


def attention_backward(dout, q, k, v, out, lse, *, scale=None, causal=False, window=None,
                       mask=None, bias=None, softcap=None, precision=None):
    """:func:`cuattn.attention_backward` on Dask arrays (see the module docstring)."""
    def check(s):
        call = check_attention(s["q"], s["k"], s["v"], scale=scale, causal=causal,
                               window=window, mask=s["mask"], bias=s["bias"],
                               softcap=softcap, precision=precision)
        check_backward(call, s["dout"], s["out"], s["lse"])
        return call

    call, arrays = _prepare({"q": q, "k": k, "v": v, "mask": mask, "bias": bias,
                             "dout": dout, "out": out, "lse": lse}, check)
    return _backward(call, _align(call, arrays, lse_like=("lse",)))


def _backward(call: AttentionCall, grid: _Grid):
    token = _token("backward", call, grid)
    part = f"cuattn-grad-part-{token}"
    kwargs = call.keywords()
    names = ("dout", "q", "k", "v", "out", "lse", "mask", "bias")
    parts = {}
    # block index of q, k or v -> [[part key, which gradient, first row, rows]], in order
    shares = {"q": {}, "k": {}, "v": {}}
    for bt, i, sq, cuts in grid.visible(call):
        for j, c0, cut in cuts:
            key = (part, *bt, i, j)
            parts[key] = (partial(_backward_part, cut=cut, c0=c0, kwargs=kwargs),
                          *grid.keys(names, bt, i, j))
            shares["q"].setdefault(grid.block_index("q", bt, i, j), []).append(
                [key, 0, 0, sq])
            for which, name in ((1, "k"), (2, "v")):
                shares[name].setdefault(grid.block_index(name, bt, i, j), []).append(
                    [key, which, cut.lo - c0, cut.hi - cut.lo])
    layers, deps, results = {part: parts}, {}, []
    for name in ("q", "k", "v"):
        x = grid.arrays[name]
        sums, grads = f"cuattn-grad-sum-{name}-{token}", f"cuattn-grad-{name}-{token}"
        sum_tasks, grad_tasks = {}, {}
        for index in itertools.product(*(range(n) for n in x.numblocks)):
            rows = x.chunks[-2][index[-2]]
            like = (x.name, *index)
            items = shares[name].get(index, [])
            if len(items) == 1 and items[0][2] == 0 and items[0][3] == rows:
                grad_tasks[(grads, *index)] = (getitem, items[0][0], items[0][1])
                continue  # one share that covers the block: its gradient as it is

            def combine(group, dtype, like=like):
                return (partial(_sum_parts, dtype=dtype), list(group), like)

            leaves = [[key, which, first] for key, which, first, _ in items]
            if len(leaves) <= 1:  # no share (zeros) or one that covers part of the block
                sum_tasks[(sums, *index)] = combine(leaves, call.dtype)
                root = (sums, *index)
            else:
                tasks, root = _tree(sums, index, leaves, combine, call.dtype,
                                    lift=lambda key: [key, None, 0])
                sum_tasks.update(tasks)
            grad_tasks[(grads, *index)] = (_identity, root)
        layers[sums], layers[grads] = sum_tasks, grad_tasks
        deps[sums], deps[grads] = {part}, {part, sums}
        results.append((name, grads, x))
    inputs = [x for x in grid.arrays.values() if x is not None]
    graph = _graph(inputs, layers, deps)
    grads_out = []
    for name, grads, x in results:
        g = da.Array(graph, grads, chunks=x.chunks, meta=_meta(x, x.ndim, call.dtype))
        if grid.added[name]:  # back to the rank of the array the user passed
            g = g[(0,) * grid.added[name]]
        grads_out.append(g)
    return tuple(grads_out)


def _identity(x):
    return x


def attention_vjp(q, k, v, **kwargs):
    """:func:`cuattn.attention_vjp` on Dask arrays: the lazy output and a function that
    builds the lazy gradients from it (they share the forward's graph)."""
    out, lse = attention(q, k, v, return_lse=True, **kwargs)

    def vjp(dout):
        return attention_backward(dout, q, k, v, out, lse, **kwargs)

    return out, vjp
