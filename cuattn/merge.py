"""``merge_attention``: attention over disjoint key sets, combined exactly."""
from __future__ import annotations

import math

import numpy as np

from ._checks import loaded_cupy, lse_dtype
from ._checks_ragged import check_merge

__all__ = ["merge_attention", "merge_instances", "merge_stacked"]

#: parts at addresses of their own that one launch of cuda/merge.cu combines (MergeParams
#: holds this many pointers; parts stacked on one axis have no such limit)
KERNEL_PARTS = 8
_THREADS = 256


def merge_attention(outs, lses):
    """Combine attention results computed over disjoint key sets into the result over all.

    Each part is ``attention(q, k_i, v_i, return_lse=True, ...)`` for one set of keys; the
    merge is exact up to rounding: ``lse = logsumexp_i(lse_i)`` and
    ``out = sum_i exp(lse_i - lse) * out_i``, accumulated in float32 (float64 for float64)
    in the order of the parts and rounded once. It is the building block of split-key
    decoding and of sequence parallelism across devices or Dask chunks. On CuPy arrays up
    to eight parts are combined by one kernel launch (``cuda/merge.cu``), which reads each
    part once.

    Parameters
    ----------
    outs : sequence of (..., Sq, Dv) ndarray
        The parts' outputs: one kind (numpy or cupy), dtype and shape, on one device.
    lses : sequence of (..., Sq) ndarray
        The parts' ``lse``: float32 (float64 for float64 outputs), -inf for a row with no
        allowed key in that part.

    Returns
    -------
    out : (..., Sq, Dv) ndarray
        dtype of the outputs; 0 in a row with no allowed key in any part.
    lse : (..., Sq) ndarray
        -inf in such a row.

    Raises
    ------
    TypeError, ValueError
        No parts, parts of different kinds, dtypes, shapes or devices, or lses that do not
        match the outputs.

    Examples
    --------
    >>> import numpy as np, cuattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 16)) for _ in range(3))
    >>> parts = [cuattn.attention(q, k[:, :2], v[:, :2], return_lse=True),
    ...          cuattn.attention(q, k[:, 2:], v[:, 2:], return_lse=True)]
    >>> out, lse = cuattn.merge_attention(*zip(*parts))
    >>> np.allclose(out, cuattn.attention(q, k, v), rtol=0, atol=1e-14)
    True
    """
    outs, lses, xp = check_merge(outs, lses)
    if xp is not np and len(outs) <= KERNEL_PARTS and outs[0].size:
        return _merge_cupy(outs, lses)
    acc = lse_dtype(outs[0].dtype)
    m = lses[0].astype(acc, copy=True)
    for lse in lses[1:]:
        m = xp.maximum(m, lse)
    empty = m == -xp.inf  # no allowed key in any part
    m = xp.where(empty, acc.type(0), m)
    total = xp.zeros(m.shape, acc)
    weights = []
    for lse in lses:
        w = xp.exp(lse.astype(acc, copy=False) - m)  # exp(-inf) = 0 for an empty part
        weights.append(w)
        total += w
    total = xp.where(empty, acc.type(1), total)
    out = xp.zeros(outs[0].shape, acc)
    for w, o in zip(weights, outs):
        out += (w / total)[..., None] * o.astype(acc, copy=False)
    lse = xp.where(empty, acc.type(-xp.inf), m + xp.log(total))
    return out.astype(outs[0].dtype), lse


def merge_instances() -> list[str]:
    """The name expressions of every merge_parts instance (for the NVRTC gate)."""
    from ._checks import FLOAT_DTYPES
    from ._kernels import c_type_name
    return [f"merge_parts<{c_type_name(d)}>" for d in FLOAT_DTYPES]


def merge_stacked(parts, lses, out=None):
    """:func:`merge_attention` of parts stacked on one axis, for callers that made them:
    ``parts`` (..., n, Sq, Dv) and ``lses`` (..., n, Sq) of the lse dtype; the result goes
    into ``out`` when given. Unvalidated: the split-key composition calls it on its own
    buffers; on CuPy one launch reads the n parts in place, stepping along their axis."""
    n = parts.shape[-3]
    cupy = loaded_cupy()
    if cupy is None or not isinstance(parts, cupy.ndarray) or parts.size == 0:
        merged, lse = merge_attention([parts[..., i, :, :] for i in range(n)],
                                      [lses[..., i, :] for i in range(n)])
        if out is None:
            return merged, lse
        out[...] = merged
        return out, lse
    if out is None:
        out = cupy.empty(parts.shape[:-3] + parts.shape[-2:], parts.dtype)
    lse = cupy.empty(lses.shape[:-2] + lses.shape[-1:], lses.dtype)
    stacked_plan(parts, lses, out, lse)(out.data.ptr, lse.data.ptr, parts.data.ptr,
                                        lses.data.ptr, cupy.cuda.get_current_stream().ptr)
    return out, lse


class _StackedMerge:
    """The merge launch of any number of parts stacked on one axis (the kernel steps from
    one part to the next), planned for one layout of parts, lses, out and lse
    (:func:`stacked_plan`); called with the addresses of out, lse, parts and lses and the
    stream."""

    def __init__(self, loop):
        self._loop = loop
        self._missing = [0] * (KERNEL_PARTS - 1)

    def __call__(self, out_ptr: int, lse_ptr: int, parts_ptr: int, lses_ptr: int,
                 stream_ptr: int) -> None:
        missing = self._missing
        self._loop([out_ptr, lse_ptr, parts_ptr, *missing, lses_ptr, *missing], stream_ptr)


#: stacked merges by layout (:func:`stacked_plan`)
_stacked_plans: dict = {}


def stacked_plan(parts, lses, out, lse) -> _StackedMerge:
    """The merge launch of CuPy parts (..., n, Sq, Dv) and lses (..., n, Sq) into out and
    lse, kept per layout; at least one row and one column."""
    key = (parts.data.device_id, parts.shape, parts.dtype, parts.strides, lses.strides,
           out.strides, lse.strides)
    plan = _stacked_plans.get(key)
    if plan is None:
        from ._launch import LaunchLoop
        steps = (parts.strides[-3] // parts.itemsize, lses.strides[-2] // lses.itemsize)
        launch, offset_sets = _merge_plan(parts[..., 0, :, :], lses[..., 0, :],
                                          parts.shape[-3], out, lse, steps)
        plan = _StackedMerge(LaunchLoop(launch, offset_sets))
        if len(_stacked_plans) >= 256:
            _stacked_plans.clear()
        _stacked_plans[key] = plan
    return plan


def _merge_cupy(outs, lses):
    """The merge of up to KERNEL_PARTS CuPy parts in one launch of cuda/merge.cu."""
    import cupy
    first = outs[0]
    # the kernel reads every part through one layout
    if any(o.strides != first.strides for o in outs):
        outs = [cupy.ascontiguousarray(o) for o in outs]
    if any(x.strides != lses[0].strides for x in lses):
        lses = [cupy.ascontiguousarray(x) for x in lses]
    return _merge_parts(outs[0], lses[0], [o.data.ptr for o in outs],
                        [x.data.ptr for x in lses])


#: merge launches by layout (:func:`_merge_parts`): a Launch and, per launch of its batch
#: loop, each slot's byte offset from its array's first element
_merge_plans: dict = {}


def _merge_parts(part, part_lse, part_ptrs, lse_ptrs, out=None):
    """The merge launch over parts at ``part_ptrs`` and their lse at ``lse_ptrs``, every
    part laid out as ``part`` and every lse as ``part_lse`` (read for shapes and strides);
    the result into ``out`` when given. The launch and its layout are kept per layout."""
    import cupy
    shape = part.shape
    batch, rows = shape[:-2], shape[-2]
    if out is None:
        out = cupy.empty(shape, part.dtype)
    lse = cupy.empty(shape[:-1], lse_dtype(part.dtype))
    if rows == 0 or math.prod(batch) == 0:
        return out, lse
    key = (part.data.device_id, shape, part.dtype, part.strides, part_lse.strides,
           out.strides, len(part_ptrs))
    plan = _merge_plans.get(key)
    if plan is None:
        plan = _merge_plan(part, part_lse, len(part_ptrs), out, lse)
        if len(_merge_plans) >= 256:
            _merge_plans.clear()
        _merge_plans[key] = plan
    launch, offset_sets = plan
    missing = [0] * (KERNEL_PARTS - len(part_ptrs))
    bases = [out.data.ptr, lse.data.ptr, *part_ptrs, *missing, *lse_ptrs, *missing]
    stream = cupy.cuda.get_current_stream().ptr
    for offsets in offset_sets:
        launch([b and b + o for b, o in zip(bases, offsets)], stream)
    return out, lse


def _merge_plan(part, part_lse, parts: int, out, lse, steps=None):
    """(Launch, byte offsets of each slot per launch) of a merge of ``parts`` parts laid
    out as ``part`` and ``part_lse`` into ``out`` and ``lse``: up to KERNEL_PARTS parts at
    addresses of their own, or, with ``steps`` (elements from one part's output and lse to
    the next), any number stacked, addressed by the first part's slots."""
    from ._kernels import c_type_name, get_kernel
    from ._launch import Launch, broadcast_strides, layout, stride_fields
    from ._params import new_block
    batch, (rows, cols) = part.shape[:-2], part.shape[-2:]

    def matrix(x):
        return x, broadcast_strides(x, batch + x.shape[-2:])

    def rows_of(x):
        return x, broadcast_strides(x, batch + x.shape[-1:]) + [0]

    slots = 1 if steps else parts
    missing = [(None, None)] * (KERNEL_PARTS - slots)
    tensors = ([matrix(out), rows_of(lse)] + [matrix(part)] * slots + missing
               + [rows_of(part_lse)] * slots + missing)
    extents, strides, pointer_sets = layout(batch, tensors)
    bases = [0 if x is None else x.data.ptr for x, _ in tensors]
    offset_sets = [[p - b for p, b in zip(pointers, bases)] for pointers in pointer_sets]
    entries = math.prod(extents)
    part_out_step, part_lse_step = steps or (0, 0)
    block = new_block("MergeParams", parts=parts, entries=entries, batch1=extents[1],
                      batch2=extents[2], rows=rows, cols=cols, part_out_step=part_out_step,
                      part_lse_step=part_lse_step,
                      **stride_fields(("out", "lse", "part_out"), strides[:15]),
                      part_lse_s=tuple(strides[5 * (2 + KERNEL_PARTS):][:5]))
    names = (("out", "lse") + tuple(f"part_out{i}" for i in range(KERNEL_PARTS))
             + tuple(f"part_lse{i}" for i in range(KERNEL_PARTS)))
    fn = get_kernel("merge.cu", f"merge_parts<{c_type_name(part.dtype)}>")
    grid = (min(-(-rows * cols // _THREADS), 2**31 - 1), min(entries, 65535))
    return Launch(fn, grid, _THREADS, 0, block, pointers=names), offset_sets
