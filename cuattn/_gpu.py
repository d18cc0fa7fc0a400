"""The GPU backend: CuPy calls planned and launched on the current stream.

A forward call's plan (:func:`forward`) is its dispatch choice (``_dispatch``), its layout
and its parameter block (``_launch``), kept per call signature, so that a repeated call
skips validation, dispatch and packing and only writes its pointers
(:func:`repeated_call`); a decoding call's plan is its split into key chunks and their
merge, replayed the same way. The backward is :mod:`cuattn._gpu_backward`.
"""
from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from . import _dispatch, _split
from ._checks import (
    AttentionCall,
    byte_span,
    check_attention,
    loaded_cupy,
    lse_dtype,
)
from ._kernels import get_kernel
from ._launch import (
    Launch,
    LaunchLoop,
    broadcast_strides,
    device_limits,
    layout,
    offset_sets,
    sm_count,
    stride_fields,
)
from ._params import block_dtype, new_block
from ._tma import TensorMaps, map_shape
from .families._common import DENSE, KEY_LENGTHS, PACKED, PAGED
from .merge import stacked_plan

__all__ = ["forward", "forward_parts", "repeated_call"]

#: the forward's parameter-block slots (AttnParams), in order: a call writes their pointers
FORWARD_SLOTS = ("q", "k", "v", "out", "lse", "mask", "bias", "k_lengths", "pages")


def _forward_arrays(call: AttentionCall, out, lse) -> tuple:
    """The arrays of the forward's nine parameter-block slots, in slot order: q, k, v, out,
    lse, mask, bias, k_lengths, pages (the page table; None where absent)."""
    return (call.q, call.k, call.v, out, lse, call.mask, call.bias, call.k_lengths,
            None if call.pages is None else call.pages.table)


def _forward_tensors(call: AttentionCall, out, lse, prepared=None):
    """The forward's nine parameter-block slots: (array, strides over batch + its two last
    axes), in :func:`_forward_arrays` order (key lengths: the batch axes and two of size
    1; the page table: the batch axes, one of size 1 and its pages). ``prepared``: the (k,
    v) slots' entries of prepared operands (:func:`_prepared_plan`) in place of call.k and
    call.v. Paged keys and values (call.pages): k and v with the row strides of their
    pools' pages."""
    batch, sq_sk = call.batch_shape, (call.seqlen_q, call.seqlen_k)
    q, k, v, out, lse, mask, bias, lengths, table = _forward_arrays(call, out, lse)
    kv = prepared or [(k, broadcast_strides(k, batch + k.shape[-2:])),
                      (v, broadcast_strides(v, batch + v.shape[-2:]))]
    if table is not None:
        pages = call.pages
        for (_, strides), row in zip(kv, (pages.k_row, pages.v_row)):
            strides[-2] = row
    return [
        (q, broadcast_strides(q, batch + q.shape[-2:])),
        *kv,
        (out, broadcast_strides(out, out.shape)),
        (lse, None if lse is None else broadcast_strides(lse, lse.shape) + [0]),
        (mask, mask is not None and broadcast_strides(mask, batch + sq_sk)),
        (bias, bias is not None and broadcast_strides(bias, batch + sq_sk)),
        (lengths, lengths is not None and broadcast_strides(lengths[..., None, None],
                                                            batch + (1, 1))),
        (table, table is not None and broadcast_strides(table[..., None, :],
                                                        batch + (1, table.shape[-1]))),
    ]


def _attn_fields(call: AttentionCall, extents, num_m: int, num_dv: int, strides) -> dict:
    """The fields of AttnParams other than its pointers and ``magnitudes``, by name:
    ``extents`` and ``strides`` from :func:`~cuattn._launch.layout`, ``num_m`` query blocks
    and ``num_dv`` output-column tiles of the grid."""
    lengths, pages = call.k_lengths, call.pages
    paging = {} if pages is None else dict(page_size=pages.page_size, num_pages=pages.num_pages,
                                           k_page=pages.k_page, v_page=pages.v_page)
    return dict(batch1=extents[1], batch2=extents[2], seqlen_q=call.seqlen_q,
                seqlen_k=call.seqlen_k, head_dim=call.head_dim, head_dim_v=call.head_dim_v,
                window_left=call.window_left, window_right=call.window_right,
                num_m_blocks=num_m, num_dv_tiles=num_dv, scale=call.scale, softcap=call.softcap,
                **stride_fields(FORWARD_SLOTS, strides[:5 * len(FORWARD_SLOTS)]),
                k_lengths_size=0 if lengths is None else lengths.itemsize,
                k_lengths_from=call.k_lengths_from, k_lengths_step=call.k_lengths_step,
                **paging)


def _forward_launch(fn, grid: int, threads: int, shared_mem: int, fields: dict) -> Launch:
    """A forward kernel's Launch: a call writes its nine pointers (FORWARD_SLOTS) and may
    write ``magnitudes``."""
    return Launch(fn, (grid, 1), threads, shared_mem, new_block("AttnParams", **fields),
                  pointers=FORWARD_SLOTS, per_call="magnitudes")


#: Forward launch plans by call signature (:func:`_plan_key`): callables of the call's
#: pointers (:func:`_plan`) holding kernels, grids, shared memory and parameter blocks. A
#: repeated signature skips dispatch, layout and packing, which is most of the Python time
#: of a call; a split call's plan holds its parts' plans and the merge.
_forward_plans: dict = {}
_MAX_PLANS = 512


def _signature(x):
    return None if x is None else (x.shape, x.strides, x.dtype)


def _plan_key(call: AttentionCall, device_id: int, kernel, tiles, chunks: int, lse):
    """Everything a forward launch plan depends on, pointers aside: shapes, strides and
    dtypes of every array (``lse``, the array the lse goes to, included), the scalar
    arguments, where q, k and v start within 16 bytes (the aligned copy path, also of a
    split call's views at offsets), the device, the forced family and tiles, the key
    chunks, and the environment variables that choose a family or the kernel sources."""
    q, k, v = call.q, call.k, call.v
    return (device_id, _signature(q), _signature(k), _signature(v), _signature(call.mask),
            _signature(call.bias), _signature(call.out), _signature(lse),
            _signature(call.k_lengths), call.k_lengths_from, call.k_lengths_step,
            None if call.pages is None else call.pages.key(), call.scale,
            call.softcap, call.window_left, call.window_right, call.precision, call.return_lse,
            q.data.ptr % 16, k.data.ptr % 16, v.data.ptr % 16, kernel, tiles, chunks,
            os.environ.get("CUATTN_KERNEL"), os.environ.get("CUATTN_KERNEL_DIR"))


def _forward_plan(call: AttentionCall, choice, out, lse, prepared=None, packed=None):
    """(launch, offset sets): the dispatch choice and layout of a call as a
    :class:`~cuattn._launch.Launch`; the offset sets are None when the batch axes collapse
    into the kernel's three (one launch), else each launch's offsets from the slots' base
    pointers (:class:`~cuattn._launch.LaunchLoop`). ``prepared``: as for
    :func:`_forward_tensors`. ``packed``: a packed call's (q_offsets, k_offsets) in host
    memory, for an instance that runs them in one grid (KernelChoice.ragged); its table
    (:func:`packed_table`) is uploaded here and the Launch holds it."""
    tensors = _forward_tensors(call, out, lse, prepared)
    extents, strides, pointer_sets = layout(call.batch_shape, tensors)
    maps = page_axis = None
    if choice.tma:  # the piped kernel, where the driver encodes the maps of q, k and v
        maps, page_axis = _tensor_maps(call, choice, extents, strides)
        if maps is None or not maps.check([x.data.ptr for x, _ in tensors[:3]]):
            if choice.fallback is None:
                why = maps.refusal if maps is not None else \
                    "the copy engine cannot read q, k or v with these strides"
                raise NotImplementedError(
                    f"no tensor maps for {choice.name_expression} ({why}) and no other "
                    f"instance serves the call (a forced family?)")
            return _forward_plan(call, choice.fallback, out, lse, prepared, packed)
    fn = get_kernel(choice.filename, choice.name_expression, shared_mem=choice.shared_mem)
    num_dv = -(-call.head_dim_v // choice.dv_tile)  # the mma family: always 1
    table = None
    if packed is None:
        num_m = -(-call.seqlen_q // choice.tiles.block_m)
        units = num_m * num_dv * math.prod(extents)
    else:
        table, num_m, units = packed_table(*packed, choice.tiles.block_m,
                                           num_dv * math.prod(extents),
                                           window=(call.window_left, call.window_right))
    # a persistent instance: a block per SM (one fits), each taking units in turn
    grid = min(units, sm_count(call.q.data.device_id)) if choice.persistent else units
    fields = _attn_fields(call, extents, num_m, num_dv, strides)
    if table is not None:
        table = call.xp.asarray(table)
        fields.update(packed=table.data.ptr, num_packed=num_m)
    if maps is None:
        launch = _forward_launch(fn, grid, choice.threads, choice.shared_mem, fields)
    else:
        launch = Launch(fn, (grid, 1), choice.threads, choice.shared_mem,
                        new_block("FwdTmaParams", p=fields, units=units,
                                  page_axis=page_axis or 0),
                        pointers=tuple(f"p.{slot}" for slot in FORWARD_SLOTS),
                        per_call="p.magnitudes", maps=maps)
    if table is not None:
        launch.table = table  # the packed call's table lives as long as its launch
    return launch, offset_sets(tensors, pointer_sets)


def packed_table(q_offsets, k_offsets, rows: int, per_block: int, keys: bool = False,
                 window: tuple[int, int] = (-1, -1)):
    """(table, row blocks, work units) of a packed call whose kernel's blocks take ``rows``
    query rows (``keys``: ``rows`` keys, the backward's dK/dV kernels) and ``per_block``
    work units per row block (its output-column tiles x batch entries): the int32 table
    of common.cuh's sequence_unit, a PackedBlock (the sequence's first query row, first
    key, query rows, keys; the row block) for each row block of every sequence, costliest
    first (the keys, or query rows, that the band (left, right) lets the block see, as
    aligned to its sequence: the last wave then holds only cheap blocks)."""
    q_offsets, k_offsets = np.asarray(q_offsets, np.int64), np.asarray(k_offsets, np.int64)
    sq, sk = np.diff(q_offsets), np.diff(k_offsets)
    length = sk if keys else sq
    counts = -(-length // rows)
    seq = np.repeat(np.arange(len(sq)), counts)          # each row block's sequence
    block = np.arange(seq.size) - np.repeat(np.cumsum(counts) - counts, counts)
    first = block * rows
    last = np.minimum(first + rows, length[seq]) - 1
    off = (sk - sq)[seq]
    left, right = window
    if keys:  # the query rows that reach keys first .. last
        lo = np.maximum(0, first - off - right) if right >= 0 else np.zeros_like(first)
        hi = np.minimum(sq[seq], last - off + left + 1) if left >= 0 else sq[seq]
    else:  # the keys that query rows first .. last reach
        lo = np.maximum(0, first + off - left) if left >= 0 else np.zeros_like(first)
        hi = np.minimum(sk[seq], last + off + right + 1) if right >= 0 else sk[seq]
    order = np.argsort(-np.maximum(hi - lo, 0), kind="stable")
    seq, block = seq[order], block[order]
    table = np.zeros((seq.size, 8), np.int64)
    table[:, :5] = np.stack([q_offsets[seq], k_offsets[seq], sq[seq], sk[seq], block], axis=1)
    units = seq.size * per_block
    if units >= 2 ** 31:
        raise ValueError(f"a packed call of {units} blocks: a grid holds fewer than 2^31")
    return table.astype(np.int32).ravel(), int(seq.size), units


def forward_packed(call: AttentionCall, ragged, out, lse, kernel: str | None = None,
                   tiles=None) -> bool:
    """Run a validated packed CuPy call (``ragged``: its offsets; ``out``, ``lse``: its
    arrays) in one grid where the family that serves it has a packed instance; False
    where none does (the caller runs its sequences as dense calls). ``kernel`` and
    ``tiles`` force a family and its tiles (tests), as for :func:`forward`."""
    cupy = call.xp
    device_id = call.q.data.device_id
    if cupy.cuda.runtime.getDevice() != device_id:
        with cupy.cuda.Device(device_id):
            return forward_packed(call, ragged, out, lse, kernel, tiles)
    q_off, k_off = (x if isinstance(x, np.ndarray) else x.get()
                    for x in (ragged.q_offsets, ragged.k_offsets))
    sq, sk = np.diff(q_off), np.diff(k_off)
    # the key count of a typical unit of work: the piped instance's threshold reads it
    keys = int((sq * sk).sum() // max(1, int(sq.sum())))
    cc, smem_limit = device_limits(device_id)
    choice = _dispatch.forward_kernel(call, cc, smem_limit, kernel, tiles, ragged=PACKED,
                                      keys=keys)
    if choice.ragged != PACKED:
        return False
    if call.seqlen_q == 0 or 0 in call.batch_shape:
        return True
    launch, loop = _forward_plan(call, choice, out, lse, packed=(q_off, k_off))
    plan = launch if loop is None else LaunchLoop(launch, loop)
    plan([0 if x is None else x.data.ptr for x in _forward_arrays(call, out, lse)],
         cupy.cuda.get_current_stream().ptr)
    return True


def _ragged_mode(call: AttentionCall) -> int:
    """The RAGGED mode of a dense call's instance: KEY_LENGTHS with key lengths, PAGED with
    paged keys and values read in place, else DENSE."""
    if call.k_lengths is None:
        return DENSE
    return KEY_LENGTHS if call.pages is None else PAGED


def serves_paged(call: AttentionCall, kernel: str | None = None) -> bool:
    """Whether dispatch's family for a validated CuPy call has an instance that reads paged
    keys and values in place (PAGED)."""
    cc, smem_limit = device_limits(call.q.data.device_id)
    return _dispatch.forward_kernel(call, cc, smem_limit, kernel, None, PAGED).ragged == PAGED


def forward_lengths(call: AttentionCall, lengths, kernel: str | None = None, tiles=None):
    """``(out, lse)`` of a validated CuPy call whose batch entries have key lengths
    (``lengths``: host, broadcast to the batch shape, within 0 .. Sk; or a CuPy integer
    array broadcastable to it, clipped by the kernels), read by the kernels
    (KEY_LENGTHS, or PAGED for paged keys and values, call.pages): one dense call, folded
    and split as any other; None where dispatch's family has no such instance (never for
    paged keys, which :func:`serves_paged` checked). ``kernel`` and ``tiles`` as for
    :func:`forward`."""
    cupy = call.xp
    device_id = call.q.data.device_id
    if cupy.cuda.runtime.getDevice() != device_id:
        with cupy.cuda.Device(device_id):
            return forward_lengths(call, lengths, kernel, tiles)
    cc, smem_limit = device_limits(device_id)
    mode = KEY_LENGTHS if call.pages is None else PAGED
    choice = _dispatch.forward_kernel(call, cc, smem_limit, kernel, tiles, mode)
    if choice.ragged != mode:
        if mode == PAGED:
            raise NotImplementedError(f"no instance reads paged keys and values in place "
                                      f"for this call ({choice.name_expression})")
        return None
    if isinstance(lengths, np.ndarray):
        # the entries as given (the axes broadcast to the batch shape back to size 1), so
        # that query groups of one length still fold into rows
        given = lengths[tuple(slice(None, 1) if st == 0 else slice(None)
                              for st in lengths.strides)]
        lengths = cupy.asarray(np.ascontiguousarray(given, np.int32))
    elif lengths.dtype not in (np.int32, np.int64):  # unsigned or narrow: as int64
        lengths = lengths.astype(np.int64)
    call = dataclasses.replace(call, k_lengths=lengths, return_lse=True)
    split = kernel is None and tiles is None
    return _run(call, kernel, tiles, split)[:2]


def _tensor_maps(call: AttentionCall, choice, extents, strides):
    """(maps, page axis): the TensorMaps of q, k and v for the piped kernel (FwdTmaParams),
    or None where the copy engine cannot read one of them (cuattn/_tma.py); for paged keys
    and values (call.pages), the maps of k and v span the pools, and the page axis is the
    map dimension of their pages (FwdTmaParams.page_axis), else None."""
    rows = (64, choice.tiles.block_n, choice.tiles.block_n)
    sizes = ((call.head_dim, call.seqlen_q), (call.head_dim, call.seqlen_k),
             (call.head_dim_v, call.seqlen_k))
    slots = [strides[5 * i:5 * i + 5] for i in range(3)]
    slot_extents = [extents] * 3
    pages, page_axis = call.pages, None
    if pages is not None:
        # the pages on a batch axis that neither k nor v walks (map dimension 2, 3, 4 for
        # batch axes 2, 1, 0), rows within a page
        free = [axis for axis in (2, 1, 0)
                if extents[axis] == 1 or slots[1][axis] == slots[2][axis] == 0]
        if not free:
            return None, None
        page_axis = 4 - free[0]
        sizes = (sizes[0], (call.head_dim, pages.page_size), (call.head_dim_v, pages.page_size))
        paged_extents = list(extents)
        paged_extents[free[0]] = pages.num_pages
        for i, step in ((1, pages.k_page), (2, pages.v_page)):
            slots[i] = list(slots[i])
            slots[i][free[0]] = step
            slot_extents[i] = paged_extents
    shapes = [map_shape(cols, n, slot_extents[i], slots[i], call.dtype.itemsize, r)
              for i, ((cols, n), r) in enumerate(zip(sizes, rows))]
    if None in shapes:
        return None, None
    dtype = block_dtype("FwdTmaParams")
    try:
        return TensorMaps(shapes, [dtype.fields[f"{x}_map"][1] for x in "qkv"]), page_axis
    except (OSError, AttributeError):  # no driver library, or one without tensor maps
        return None, None


def _plan(call: AttentionCall, device_id: int, kernel, tiles, out, lse, chunks: int):
    """The launch plan of a call's signature in ``chunks`` key chunks (1: no split), kept
    per signature (:func:`_plan_key`): a callable with the call's nine slot pointers
    (FORWARD_SLOTS; 0 for an absent one) and the stream, which runs everything the call
    needs. ``out`` and ``lse``: this call's, for their layout."""
    key = _plan_key(call, device_id, kernel, tiles, chunks, lse)
    plan = _forward_plans.get(key)
    if plan is not None:
        return plan
    if chunks > 1:
        plan = _SplitLaunch(call, chunks, device_id, out, lse)
    else:
        cc, smem_limit = device_limits(device_id)
        ragged = _ragged_mode(call)
        choice = _dispatch.forward_kernel(call, cc, smem_limit, kernel, tiles, ragged)
        if choice.prepare:  # operands prepared per call (tile images), then the kernel
            plan = _prepared_plan(call, choice, out, lse)
        else:
            launch, loop = _forward_plan(call, choice, out, lse)
            if choice.magnitudes is not None:  # every launch after its magnitudes kernel
                launch = _MagnitudesLaunch(call, choice, launch, out, lse)
            plan = launch if loop is None else LaunchLoop(launch, loop)
    if len(_forward_plans) >= _MAX_PLANS:
        _forward_plans.clear()
    _forward_plans[key] = plan
    return plan


#: Repeated calls: the signature of a plain CuPy call whose arguments were validated and
#: whose launch plan exists -> (out shape, dtype, lse shape and dtype, plan). The signature
#: holds everything validation and dispatch read: the arrays' type, shapes, strides,
#: dtypes and devices (q, k, v, and mask, bias and out when given), where q, k, v
#: start within 16 bytes, the scalar arguments as given (window sides with their
#: types, since (1.0, 2) is refused where (1, 2) is not) and the environment variables that
#: choose a family or the sources; so a call that matches one needs neither.
_repeated: dict = {}


def repeated_call(q, k, v, mask, bias, window, scale, causal, softcap, return_lse, precision,
                  out=None):
    """The result of ``attention(q, k, v, ...)`` by a known signature's plan, or None (an
    unseen signature is validated and planned the long way, then remembered). A given
    ``out`` is part of the signature (shape, strides, dtype, device); that it overlaps no
    input is checked per call, on its addresses."""
    cupy = loaded_cupy()
    if cupy is None:  # nothing has imported CuPy: q is no cupy.ndarray
        return None
    ndarray = cupy.ndarray
    if type(q) is not ndarray or type(k) is not ndarray or type(v) is not ndarray:
        return None
    qd, kd, vd = q.data, k.data, v.data
    device = qd.device_id
    extra, pointers = [], [0, 0]
    for slot, x in enumerate((mask, bias)):
        if x is None:
            extra.append(None)
            continue
        if type(x) is not ndarray:
            return None
        xd = x.data
        extra.append((x.shape, x.strides, x.dtype, xd.device_id))
        pointers[slot] = xd.ptr
    out_key = None
    if out is not None:
        if type(out) is not ndarray:
            return None
        out_key = (out.shape, out.strides, out.dtype, out.data.device_id)
    if window is not None:
        if type(window) is not tuple:
            return None
        window_key = tuple((type(side), side) for side in window)
    else:
        window_key = None
    key = (q.shape, q.strides, q.dtype, k.shape, k.strides, k.dtype, v.shape, v.strides,
           v.dtype, device, kd.device_id, vd.device_id, qd.ptr % 16, kd.ptr % 16, vd.ptr % 16,
           *extra, out_key, window_key, type(scale), scale, type(causal), causal,
           type(softcap), softcap,
           type(return_lse), return_lse, precision,
           os.environ.get("CUATTN_KERNEL"), os.environ.get("CUATTN_KERNEL_DIR"))
    try:
        entry = _repeated.get(key)
    except TypeError:  # an unhashable argument: the long way
        return None
    if entry is None:
        call = check_attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                               bias=bias, softcap=softcap, return_lse=return_lse,
                               precision=precision, out=out)
        # the plan of a folded call takes the same pointers (views of the same arrays)
        out, lse, plan = _run(call, None, None, True)
        if plan is not None:
            if len(_repeated) >= _MAX_PLANS:
                _repeated.clear()
            # a given out's address range against the inputs', per call: their spans
            # from the first element (fixed by the signature), and out's
            spans = None if out_key is None else (
                byte_span(out), [byte_span(x) for x in (q, k, v, mask, bias) if x is not None])
            _repeated[key] = (call.out_shape, call.dtype, call.lse_shape,
                              lse_dtype(call.dtype), plan, spans)
        return (out, lse) if call.return_lse else out
    if cupy.cuda.runtime.getDevice() != device:
        return None  # another device is current: the long way enters q's
    out_shape, dtype, lse_shape, lse_dt, launch, spans = entry
    if out is None:
        out = ndarray(out_shape, dtype)
    else:
        at = out.data.ptr
        lo, hi = at + spans[0][0], at + spans[0][1]
        for ptr, (x_lo, x_hi) in zip(
                [qd.ptr, kd.ptr, vd.ptr] + [p for p in pointers if p], spans[1]):
            if ptr + x_lo < hi and lo < ptr + x_hi:
                return None  # the long way names the overlap
    lse = ndarray(lse_shape, lse_dt) if return_lse else None
    launch([qd.ptr, kd.ptr, vd.ptr, out.data.ptr, 0 if lse is None else lse.data.ptr,
            *pointers, 0, 0], cupy.cuda.get_current_stream().ptr)  # no lengths, no pages
    return (out, lse) if return_lse else out


def forward(call: AttentionCall, kernel: str | None = None, tiles=None, split: bool = True,
            lse=None):
    """out and lse of a validated CuPy call; ``kernel`` forces a family (tests) and
    ``tiles`` overrides the dispatch table's tile sizes (sweeps); a call that would leave
    most SMs idle runs in key chunks, and query groups that share their keys run as the
    rows of one batch entry (``cuattn._split``), unless ``split`` is False or a family or
    tiles are forced. ``lse``: an array of the call's lse shape and dtype (a view, say) to
    write the lse into, for a call with ``return_lse``."""
    return _run(call, kernel, tiles, split, lse)[:2]


def _run(call: AttentionCall, kernel, tiles, split: bool, lse=None):
    """(out, lse, plan) of :func:`forward`: plan is the kept plan (:func:`_plan`) that ran
    the call, with the call's own pointers, or None where nothing ran (no rows)."""
    cupy = call.xp
    device_id = call.q.data.device_id
    if cupy.cuda.runtime.getDevice() != device_id:
        with cupy.cuda.Device(device_id):
            return _run(call, kernel, tiles, split, lse)
    chunks = 1
    if split and kernel is None and tiles is None:
        # query groups as rows: each block reads its keys once for the whole group (its
        # lse folds too: a given lse must take the folded rows' view)
        result = _split.run_folded(
            call, lambda folded, target=None: _run(folded, None, None, True, target), lse)
        if result is not None:
            return result
        if call.seqlen_q and call.seqlen_k:
            chunks = _split.split_count(call, sm_count(device_id))
    # cupy.ndarray rather than cupy.empty: the same allocation, one Python call less
    out = call.out if call.out is not None else cupy.ndarray(call.out_shape, call.dtype)
    if lse is None and call.return_lse:
        lse = cupy.ndarray(call.lse_shape, lse_dtype(call.dtype))
    if call.seqlen_q == 0 or 0 in call.batch_shape:
        return out, lse, None
    plan = _plan(call, device_id, kernel, tiles, out, lse, chunks)
    plan([0 if x is None else x.data.ptr for x in _forward_arrays(call, out, lse)],
         cupy.cuda.get_current_stream().ptr)
    return out, lse, plan


#: streams per device on which the dense parts of a packed or key-length call run side by
#: side (:func:`forward_parts`)
PART_STREAMS = 4
_part_streams: dict = {}  # device id -> its PART_STREAMS streams


def forward_parts(parts) -> None:
    """Run the dense parts of one validated CuPy call, each ``(call, lse)`` writing its
    part of the call's out (``call.out``) and of its lse, side by side: in turn on
    PART_STREAMS streams that first wait for the current stream's work so far, and which
    the current stream then waits for. Parts with few blocks (short sequences, one batch
    entry of a key length) so overlap; the current stream sees one call."""
    if len(parts) < 2:
        for part, lse in parts:
            forward(part, lse=lse)
        return
    cupy = parts[0][0].xp
    device = parts[0][0].q.data.device_id
    if cupy.cuda.runtime.getDevice() != device:
        with cupy.cuda.Device(device):
            return forward_parts(parts)
    streams = _part_streams.get(device)
    if streams is None:
        streams = _part_streams[device] = [cupy.cuda.Stream(non_blocking=True)
                                           for _ in range(PART_STREAMS)]
    current = cupy.cuda.get_current_stream()
    forked = current.record()
    for stream in streams:
        stream.wait_event(forked)
    for i, (part, lse) in enumerate(parts):
        with streams[i % len(streams)]:
            forward(part, lse=lse)
    for stream in streams:
        current.wait_event(stream.record())


class _SplitLaunch:
    """The plan of a call in key chunks (``cuattn._split``), called as a Launch with the
    call's nine pointers: new buffers for the partial results (CuPy's pool, on the stream
    of the launches, so reused only after the merge that reads them), the plans of the two
    part calls over offsets of q, k, v and those buffers, then the merge into out and lse
    (a new lse where the call returns none). A mask or bias is read in place, in chunks
    with the keys; key lengths in place too, each part shifting them to its chunks."""

    def __init__(self, call: AttentionCall, n: int, device_id: int, out, lse):
        cupy = call.xp
        outs, lses = _split.buffers(call, n)
        if lse is None:  # the layout of the scratch lse of each call
            lse = cupy.ndarray(call.lse_shape, lses.dtype)
        bases = _forward_arrays(call, outs, lses)
        self._parts = []
        for part, part_lse in _split.parts(call, n, outs, lses):
            arrays = _forward_arrays(part, part.out, part_lse)
            plan = _plan(part, device_id, None, None, part.out, part_lse, 1)
            self._parts.append((plan, [None if x is None else x.data.ptr - b.data.ptr
                                       for x, b in zip(arrays, bases)]))
        self._merge = stacked_plan(outs, lses, out, lse)
        self._shapes = (outs.shape, outs.dtype, lses.shape, lses.dtype, lse.shape)
        self._ndarray = cupy.ndarray

    def __call__(self, pointers, stream_ptr: int) -> None:
        outs_shape, dtype, lses_shape, lse_dt, lse_shape = self._shapes
        outs, lses = self._ndarray(outs_shape, dtype), self._ndarray(lses_shape, lse_dt)
        q, k, v, out, lse, mask, bias, lengths, table = pointers
        if not lse:
            scratch = self._ndarray(lse_shape, lse_dt)
            lse = scratch.data.ptr
        bases = (q, k, v, outs.data.ptr, lses.data.ptr, mask, bias, lengths, table)
        for plan, offsets in self._parts:
            plan([0 if o is None else b + o for b, o in zip(bases, offsets)], stream_ptr)
        self._merge(out, lse, outs.data.ptr, lses.data.ptr, stream_ptr)


def _prepared_plan(call: AttentionCall, choice, out, lse):
    """The plan (a :class:`_PreparedLaunch`) of the piped sm90_tf32 instance
    (attention_sm90_tf32.cu, attention_fwd_sm90_tf32_piped), which reads K and V prepared
    per call: per batch entry of k, its tile images (tf32_image_k: each tile of block_n keys
    rounded to TF32 in the shared-memory layout), per batch entry of v its V^T tile images
    (tf32_image_vt)."""
    cupy = call.xp
    sk, bn = call.seqlen_k, choice.tiles.block_n
    tiles = -(-sk // bn)
    entries, preps = [], []
    for name, x, cols, src_cols in (("k", call.k, choice.d_tile, call.head_dim),
                                    ("vt", call.v, choice.dv_tile, call.head_dim_v)):
        own = x.shape[:-2]  # the input's own batch axes (1 where broadcast)
        images = cupy.empty(own + (tiles, bn * cols), np.float32)
        preps.append(_tf32_prep_plan(choice.filename, f"tf32_image_{name}", x, images, bn,
                                     cols, sk, src_cols))
        strides = [0 if n == 1 else st // images.itemsize for n, st in zip(own, images.strides)]
        entries.append((images, [0] * (len(call.batch_shape) - len(own)) + strides
                        + [images.shape[-1], 1]))
    launch, loop = _forward_plan(call, choice, out, lse, entries)
    return _PreparedLaunch(cupy, [x.shape for x, _ in entries], preps,
                           launch if loop is None else LaunchLoop(launch, loop))


class _MagnitudesLaunch:
    """A forward launch that needs its call's largest magnitudes (sm90_3xf16): per call, a
    zeroed float[entries][5] (CuPy's pool, on the stream of the launches), the magnitudes
    kernel (MAGNITUDE_ROWS rows of q, k and v per block), then the forward, each with the
    buffer's address in its parameter block. Called as a Launch."""

    def __init__(self, call: AttentionCall, choice, launch, out, lse):
        cupy = call.xp
        extents, strides, _ = layout(call.batch_shape, _forward_tensors(call, out, lse))
        self._entries = math.prod(extents)
        chunks = -(-max(call.seqlen_q, call.seqlen_k) // MAGNITUDE_ROWS)
        fn = get_kernel(choice.filename, choice.magnitudes)
        self._magnitudes = _forward_launch(fn, chunks * self._entries, 256, 0,
                                           _attn_fields(call, extents, chunks, 1, strides))
        self._zeros, self._launch = cupy.zeros, launch

    def __call__(self, pointers, stream_ptr: int) -> None:
        buf = self._zeros(self._entries * 5, np.float32)
        self._magnitudes(pointers, stream_ptr, buf.data.ptr)
        self._launch(pointers, stream_ptr, buf.data.ptr)


class _PreparedLaunch:
    """The launches of one call signature of a piped instance (:func:`_prepared_plan`),
    called as a :class:`~cuattn._launch.Launch` with the call's nine pointers: new
    K and V^T images (from CuPy's pool, on the stream of the launches, so reused only after
    the kernel that reads them), their two preparations (none without keys), the kernel."""

    def __init__(self, cupy, shapes, preps, launch):
        self._ndarray, self._shapes, self._preps, self._launch = cupy.ndarray, shapes, preps, launch

    def __call__(self, pointers, stream_ptr: int) -> None:
        k_images = self._ndarray(self._shapes[0], np.float32)
        vt_images = self._ndarray(self._shapes[1], np.float32)
        k_ptr, vt_ptr = k_images.data.ptr, vt_images.data.ptr
        for prep, src, dst in zip(self._preps, pointers[1:3], (k_ptr, vt_ptr)):
            if prep is not None:
                prep((src, dst), stream_ptr)
        self._launch([pointers[0], k_ptr, vt_ptr, *pointers[3:]], stream_ptr)


def _tf32_prep_plan(filename: str, expr: str, src, images, rows: int, cols: int, src_rows: int,
                    src_cols: int):
    """One tf32_image_k / tf32_image_vt preparation, called with the (source, images)
    pointers: a Launch, or a LaunchLoop where the input's batch axes do not collapse into
    three. ``rows`` keys per tile, ``cols`` the padded head dim. None when there are no
    keys: nothing to prepare."""
    if src_rows == 0:
        return None
    own = src.shape[:-2]
    src_strides = broadcast_strides(src, src.shape)
    dst_strides = broadcast_strides(images, images.shape)
    nb = len(own)
    tensors = [(src, src_strides), (images, dst_strides[:nb] + [images.shape[-1], 1])]
    extents, strides, pointer_sets = layout(own, tensors)
    count = math.prod(extents)
    key_tiles = -(-src_rows // rows)
    if expr.startswith("tf32_image_k"):  # one thread per 16-byte chunk of a tile's keys
        size = key_tiles * rows * cols
        grid = (max(1, min(-(-size // 1024), 4096)), min(count, 65535))
    else:  # one block per 32 keys x 32 columns
        grid = (key_tiles * rows // 32 * (cols // 32), min(count, 65535))
    fn = get_kernel(filename, expr)
    block = new_block("Tf32Prep", entries=count, batch1=extents[1], batch2=extents[2],
                      rows=rows, cols=cols, src_rows=src_rows, src_cols=src_cols,
                      src_s=tuple(strides[:5]))
    launch = Launch(fn, grid, 256, 0, block, pointers=("src", "dst"))
    loop = offset_sets(tensors, pointer_sets)
    return launch if loop is None else LaunchLoop(launch, loop)


#: Rows of q (and of k) per block of attention_bwd_magnitudes (MAG_ROWS in
#: cuda/sm90/attention_backward_sm90_3xf16.cu)
MAGNITUDE_ROWS = 16
