"""``merge_attention``: attention over disjoint key sets, combined exactly."""
from __future__ import annotations

import math

import numpy as np

from ._checks import check_merge, lse_dtype

__all__ = ["merge_attention", "merge_instances"]

#: parts one launch of cuda/merge.cu combines (MergeParams holds this many pointers)
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


def _merge_cupy(outs, lses):
    """The merge of up to KERNEL_PARTS CuPy parts in one launch of cuda/merge.cu."""
    import cupy

    from ._kernels import c_type_name, get_kernel
    from ._launch import Launch, broadcast_strides, layout, stride_fields
    from ._params import new_block
    first = outs[0]
    # the kernel reads every part through one layout
    if any(o.strides != first.strides for o in outs):
        outs = [cupy.ascontiguousarray(o) for o in outs]
    if any(x.strides != lses[0].strides for x in lses):
        lses = [cupy.ascontiguousarray(x) for x in lses]
    shape = first.shape
    batch, (rows, cols) = shape[:-2], shape[-2:]
    out = cupy.empty(shape, first.dtype)
    lse = cupy.empty(shape[:-1], lse_dtype(first.dtype))
    if rows == 0 or math.prod(batch) == 0:
        return out, lse

    def matrix(x):
        return x, broadcast_strides(x, batch + x.shape[-2:])

    def rows_of(x):
        return x, broadcast_strides(x, batch + x.shape[-1:]) + [0]

    missing = [(None, None)] * (KERNEL_PARTS - len(outs))
    tensors = ([matrix(out), rows_of(lse)] + [matrix(o) for o in outs] + missing
               + [rows_of(x) for x in lses] + missing)
    extents, strides, pointer_sets = layout(batch, tensors)
    entries = math.prod(extents)
    block = new_block("MergeParams", parts=len(outs), entries=entries, batch1=extents[1],
                      batch2=extents[2], rows=rows, cols=cols,
                      **stride_fields(("out", "lse", "part_out"), strides[:15]),
                      part_lse_s=tuple(strides[5 * (2 + KERNEL_PARTS):][:5]))
    names = (("out", "lse") + tuple(f"part_out{i}" for i in range(KERNEL_PARTS))
             + tuple(f"part_lse{i}" for i in range(KERNEL_PARTS)))
    fn = get_kernel("merge.cu", f"merge_parts<{c_type_name(first.dtype)}>")
    grid = (min(-(-rows * cols // _THREADS), 2**31 - 1), min(entries, 65535))
    launch = Launch(fn, grid, _THREADS, 0, block, pointers=names)
    stream = cupy.cuda.get_current_stream().ptr
    for pointers in pointer_sets:
        launch(pointers, stream)
    return out, lse
