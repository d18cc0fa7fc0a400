"""``kv_cache_append``: new keys and values written into a batch of key/value caches."""
from __future__ import annotations

import math

import numpy as np

from ._checks_ragged import CacheAppend, check_cache_append

__all__ = ["kv_cache_append", "kv_cache_instances"]

_THREADS = 128  # kv_cache_append's block (cuda/kv_cache.cu)


def _instance(dtype, index_dtype) -> str:
    from ._kernels import c_type_name
    index_type = "int" if np.dtype(index_dtype) == np.int32 else "long long"
    return f"kv_cache_append<{c_type_name(dtype)}, {index_type}>"


def kv_cache_instances() -> list[str]:
    """The name expressions of every kv_cache_append instance (for the NVRTC gate)."""
    from ._checks import FLOAT_DTYPES
    return [_instance(d, i) for d in FLOAT_DTYPES for i in (np.int32, np.int64)]


def kv_cache_append(k_cache, v_cache, k_new, v_new, lengths) -> None:
    """Write new keys and values into caches at per-entry positions, in place.

    For every batch entry b, ``k_new[b]`` (n rows) goes to rows ``lengths[b]`` ..
    ``lengths[b] + n - 1`` of ``k_cache[b]``, and ``v_new[b]`` likewise into ``v_cache``;
    the whole batch in one kernel launch on CuPy arrays. ``lengths`` is not changed (the
    caller adds n); attention over the valid prefix is
    ``cuattn.attention(q, k_cache, v_cache, k_lengths=lengths + n)``.

    Parameters
    ----------
    k_cache, v_cache : (..., S, D) and (..., S, Dv) ndarray
        The caches: writeable, not broadcast views, one dtype, one batch shape and S.
    k_new, v_new : (..., n, D) and (..., n, Dv) ndarray
        The new rows, dtype of the caches; leading dims broadcast to the caches' batch shape.
    lengths : int ndarray
        Broadcastable to the batch shape: the rows already in each entry's cache. NumPy
        for either kind of cache, or CuPy for CuPy caches.

    Raises
    ------
    TypeError
        Unsupported kinds or dtypes, dtypes that differ, non-integer lengths.
    ValueError
        Shapes that do not match or broadcast; a read-only or broadcast cache; new rows
        overlapping a cache; host lengths below 0 or whose append overflows the cache.

    Notes
    -----
    Host lengths are checked before anything is written. Device lengths are not read on
    the host (no synchronisation): a row whose position falls outside the cache is dropped
    by the kernel, never written out of bounds.

    Examples
    --------
    >>> import numpy as np, cuattn
    >>> k_cache, v_cache = np.zeros((2, 6, 4), np.float32), np.zeros((2, 6, 4), np.float32)
    >>> lengths = np.array([0, 3])
    >>> cuattn.kv_cache_append(k_cache, v_cache, np.ones((2, 2, 4), np.float32),
    ...                        np.ones((2, 2, 4), np.float32), lengths)
    >>> k_cache[:, :, 0]
    array([[1., 1., 0., 0., 0., 0.],
           [0., 0., 0., 1., 1., 0.]], dtype=float32)
    """
    call = check_cache_append(k_cache, v_cache, k_new, v_new, lengths)
    if call.k_new.shape[-2] == 0 or math.prod(call.batch_shape) == 0:
        return
    if call.xp is np:
        _append_numpy(call)
    else:
        _append_cupy(call)


def _append_numpy(call: CacheAppend) -> None:
    n = call.k_new.shape[-2]
    rows = np.broadcast_to(call.lengths, call.batch_shape)[..., None] + np.arange(n)
    for cache, new in ((call.k_cache, call.k_new), (call.v_cache, call.v_new)):
        values = np.broadcast_to(new, call.batch_shape + new.shape[-2:])
        np.put_along_axis(cache, rows[..., None], values, axis=-2)


def _append_cupy(call: CacheAppend) -> None:
    import cupy

    from ._kernels import get_kernel
    from ._launch import Launch, broadcast_strides, layout, stride_fields
    from ._params import new_block
    lengths = call.lengths
    if isinstance(lengths, np.ndarray) or lengths.dtype not in (np.int32, np.int64):
        # host lengths go to the device with the launch (a few bytes, on the stream)
        lengths = cupy.asarray(lengths, dtype=np.int64)
    batch = call.batch_shape
    tensors = [(x, broadcast_strides(x, batch + x.shape[-2:]))
               for x in (call.k_cache, call.v_cache, call.k_new, call.v_new)]
    tensors.append((lengths, broadcast_strides(lengths, batch) + [0, 0]))
    extents, strides, pointer_sets = layout(batch, tensors)
    entries = math.prod(extents)
    new_rows = call.k_new.shape[-2]
    fn = get_kernel("kv_cache.cu", _instance(call.k_cache.dtype, lengths.dtype))
    block = new_block("KvAppend", entries=entries, batch1=extents[1], batch2=extents[2],
                      cache_rows=call.k_cache.shape[-2], new_rows=new_rows,
                      head_dim=call.k_cache.shape[-1], head_dim_v=call.v_cache.shape[-1],
                      **stride_fields(("kc", "vc", "kn", "vn", "len"), strides))
    grid = (min(new_rows, 2**31 - 1), min(entries, 65535))
    launch = Launch(fn, grid, _THREADS, 0, block,
                    pointers=("k_cache", "v_cache", "k_new", "v_new", "lengths"))
    stream = cupy.cuda.get_current_stream().ptr
    for pointers in pointer_sets:
        launch(pointers, stream)
