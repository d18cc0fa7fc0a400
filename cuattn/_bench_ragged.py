"""Benchmark rows of the ragged and decoding suites: Dask chunks, decoding (contiguous
and paged caches) and packed sequences."""
from __future__ import annotations

import math

import numpy as np

from ._bench_core import Case, Row, _timed_rows, _torch_backends

#: the chunkings of the dask suite's rows: (label, query chunks, key chunks)
DASK_SPLITS = (("dask 4 key chunks", 1, 4), ("dask 4 query chunks", 4, 1),
               ("dask 2x2 chunks", 2, 2))


def _dask_rows(case: Case, cupy):
    """One attention call against the same call on Dask arrays of CuPy chunks (threaded
    scheduler), the graph built and computed inside each timed call. Needs Dask."""
    import cuattn
    dtype = np.dtype(case.dtype)
    shape = (case.batch, case.heads, case.seqlen, case.head_dim)
    q, k, v = (cupy.random.standard_normal(shape, dtype=cupy.float32).astype(dtype)
               for _ in range(3))
    impls = {"cuattn": lambda: cuattn.attention(q, k, v, causal=case.causal)}
    try:
        import dask.array as da
    except ImportError:
        da = None
    for label, q_parts, k_parts in DASK_SPLITS:
        def chunked(x, parts):
            return da.from_array(x, chunks=shape[:2] + (case.seqlen // parts, case.head_dim),
                                 asarray=False)
        if da is not None:
            dq, dk, dv = chunked(q, q_parts), chunked(k, k_parts), chunked(v, k_parts)
            impls[label] = (lambda dq=dq, dk=dk, dv=dv: cuattn.attention(
                dq, dk, dv, causal=case.causal).compute(scheduler="threads"))
    rows = _timed_rows(impls, case, cupy, None)
    if da is None:
        rows.append(Row("dask", note="Dask is not installed (pip install \"cuattn[dask]\")"))
    return rows


def _paged_impls(case: Case, q, k, v, cupy) -> dict:
    """A paged decode case: the cache's pages shuffled in pools, a device block table and
    every entry at full length; against the same call on the contiguous cache."""
    import cuattn
    b, page = case.batch, case.page_size
    per_entry = case.seqlen_k // page
    order = np.random.default_rng(0).permutation(b * per_entry)
    # the table and lengths of a decoding loop: on the device, as the kernels read them
    table = cupy.asarray(order.reshape(b, per_entry).astype(np.int32))
    pools = []
    for x in (k, v):  # (b, hk, 1, sk, d) -> pages (b * per_entry, hk, 1, page, d), shuffled
        pages = x.reshape(b, x.shape[1], 1, per_entry, page, x.shape[-1])
        pages = cupy.ascontiguousarray(pages.transpose(0, 3, 1, 2, 4, 5))
        pool = cupy.empty_like(pages.reshape((b * per_entry,) + pages.shape[2:]))
        pool[cupy.asarray(order)] = pages.reshape(pool.shape)
        pools.append(pool)
    lengths = cupy.full((b, 1, 1), case.seqlen_k, cupy.int32)
    return {"cuattn": lambda: cuattn.attention(q, *pools, k_lengths=lengths,
                                               block_table=table),
            "cuattn contiguous": lambda: cuattn.attention(q, k, v, k_lengths=lengths)}


def _decode_rows(case: Case, cupy, torch):
    """Decoding: q (B, Hkv, G, Sq, D) against k, v (B, Hkv, 1, Sk, D) for cuattn (GQA is
    broadcasting), the same memory as (B, Hq, Sq, D) and (B, Hkv, Sk, D) for PyTorch's SDPA
    with ``enable_gqa``; no causal band (for one query row it allows every key). The rate
    is the bytes of K and V read per second. A key-length case: cuattn with device key
    lengths (every entry ``k_length`` of the Sk keys), against cuattn's and the peers' dense
    calls on those keys."""
    import cuattn
    dtype = np.dtype(case.dtype)
    groups = case.heads // case.heads_kv
    b, hk, d = case.batch, case.heads_kv, case.head_dim
    q = cupy.random.standard_normal((b, hk, groups, case.seqlen, d),
                                    dtype=cupy.float32).astype(dtype)
    k, v = (cupy.random.standard_normal((b, hk, 1, case.seqlen_k, d),
                                        dtype=cupy.float32).astype(dtype) for _ in range(2))
    if case.page_size:
        return _timed_rows(_paged_impls(case, q, k, v, cupy), case, cupy, None)
    impls = {"cuattn": lambda: cuattn.attention(q, k, v)}
    if case.k_length:  # key lengths in a longer cache, against the dense call on those keys
        lengths = cupy.full((b, hk, 1), case.k_length, cupy.int32)
        impls = {"cuattn": lambda: cuattn.attention(q, k, v, k_lengths=lengths)}
        k, v = (x[..., :case.k_length, :] for x in (k, v))
        impls["cuattn dense"] = lambda: cuattn.attention(q, k, v)
    if torch is not None:
        from torch.nn.attention import sdpa_kernel
        tq = torch.from_dlpack(q.reshape(b, case.heads, case.seqlen, d))
        tk, tv = (torch.from_dlpack(x.reshape(b, hk, x.shape[-2], d)) for x in (k, v))
        for name, backend in _torch_backends(torch)[:2]:  # flash, cudnn

            def call(backend=backend):
                with sdpa_kernel([backend]):
                    return torch.nn.functional.scaled_dot_product_attention(
                        tq, tk, tv, enable_gqa=groups > 1)
            impls[name] = call
    return _timed_rows(impls, case, cupy, torch)


def _varlen_rows(case: Case, cupy, torch):
    """Packed sequences: cuattn with ``q_offsets``/``k_offsets`` on (H, T, D) views of
    (T, H, D) tokens; cuattn's dense call on B sequences of the length that does the same
    work (the root mean square length); PyTorch's SDPA on nested (jagged) tensors of the
    same tokens with its flash and cuDNN backends."""
    import cuattn
    dtype = np.dtype(case.dtype)
    lengths = case.lengths
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    h, d = case.heads, case.head_dim
    tokens = [cupy.random.standard_normal((int(offsets[-1]), h, d), dtype=cupy.float32)
              .astype(dtype) for _ in range(3)]
    q, k, v = (x.swapaxes(0, 1) for x in tokens)          # (H, T, D) views
    side = math.isqrt(sum(n * n for n in lengths) // case.batch)
    dq, dk, dv = (cupy.random.standard_normal((case.batch, h, side, d), dtype=cupy.float32)
                  .astype(dtype) for _ in range(3))
    impls = {"cuattn": lambda: cuattn.attention(q, k, v, causal=case.causal,
                                                q_offsets=offsets, k_offsets=offsets),
             "cuattn dense": lambda: cuattn.attention(dq, dk, dv, causal=case.causal)}
    if torch is not None:
        from torch.nn.attention import sdpa_kernel
        t_offsets = torch.as_tensor(offsets, device="cuda")
        tq, tk, tv = (torch.nested.nested_tensor_from_jagged(torch.from_dlpack(x), t_offsets)
                      .transpose(1, 2) for x in tokens)
        for name, backend in _torch_backends(torch)[:2]:  # flash, cudnn

            def call(backend=backend):
                with sdpa_kernel([backend]):
                    return torch.nn.functional.scaled_dot_product_attention(
                        tq, tk, tv, is_causal=case.causal)
            impls[f"{name} nested"] = call
    return _timed_rows(impls, case, cupy, torch)
