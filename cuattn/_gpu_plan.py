"""One forward launch of a call from its dispatch choice: the slots and named fields of the
forward's parameter block (AttnParams), the layout of its arrays, the packed table, the
tensor maps of the piped instance, and the launches of the instances that prepare their
operands or their magnitudes per call. :mod:`cuattn._gpu` keeps these plans per call
signature; the backward (:mod:`cuattn._gpu_backward`) fills the same forward block."""
from __future__ import annotations

import math

import numpy as np

from ._checks import AttentionCall
from ._kernels import get_kernel
from ._launch import (
    Launch,
    LaunchLoop,
    broadcast_strides,
    layout,
    offset_sets,
    sm_count,
    stride_fields,
)
from ._params import block_dtype, new_block
from ._tma import TensorMaps, map_shape

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
