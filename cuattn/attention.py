"""``attention``, ``attention_backward`` and ``attention_vjp``.

Each public function validates its arguments (``_checks``), then hands NumPy calls to the
blocked NumPy backend (``_cpu``) and CuPy calls to the GPU backend (``_gpu``), which runs
the kernels that ``_dispatch`` picks on the current stream.
"""
from __future__ import annotations

import numpy as np

from . import _cpu, _gpu, _gpu_backward, _paged, _ragged
from ._checks import AttentionCall, check_attention, check_backward
from ._checks_ragged import check_paged, check_ragged

__all__ = ["attention", "attention_backward", "attention_vjp"]


def attention(q, k, v, *, scale=None, causal=False, window=None, mask=None, bias=None,
              softcap=None, return_lse=False, precision=None, out=None, q_offsets=None,
              k_offsets=None, max_q_len=None, max_k_len=None, k_lengths=None,
              block_table=None):
    """Exact scaled dot-product attention, ``softmax(scale · q kᵀ + bias) v``, in O(S) memory.

    Parameters
    ----------
    q : (..., Sq, D) ndarray
        Queries: numpy, cupy, or a CUDA array (PyTorch, JAX, Numba) taken zero-copy
        through DLPack / ``__cuda_array_interface__``. float16, bfloat16, float32 or float64.
    k : (..., Sk, D) ndarray
        Keys, same dtype as q.
    v : (..., Sk, Dv) ndarray
        Values, same dtype as q. The leading dims of q, k, v, mask and bias broadcast
        together into the batch shape (heads are a batch axis; GQA is broadcasting).
    scale : float, optional
        Score scale, default ``1 / sqrt(D)``; finite and positive.
    causal : bool, optional
        Key j is allowed for row i when ``j <= i + (Sk - Sq)`` (bottom-right aligned).
    window : (int or None, int or None), optional
        Local attention band ``(left, right)`` around ``i + (Sk - Sq)``; -1 or None is
        unbounded. Combined with ``causal``, both must hold.
    mask : (..., Sq, Sk) bool ndarray, optional
        True where a key is allowed; broadcast like NumPy (e.g. ``(B, 1, 1, Sk)`` padding).
    bias : (..., Sq, Sk) floating ndarray, optional
        Added to the scores after softcap, before masking.
    softcap : float, optional
        Scores become ``softcap · tanh(s / softcap)`` before the bias.
    return_lse : bool, optional
        Also return the natural-log row log-sum-exp.
    precision : {"highest", "tf32"}, optional
        float32 only. "highest" (default) is as accurate as plain float32 arithmetic;
        "tf32" allows TF32 tensor cores.
    out : (..., Sq, Dv) ndarray, optional
        Where to write the result; dtype of q, not overlapping any input.
    q_offsets, k_offsets : (n + 1,) int ndarray, optional
        Packed sequences: q and k (and v) hold n sequences one after another along the
        sequence axis; sequence s has rows ``q_offsets[s]:q_offsets[s+1]`` and keys
        ``k_offsets[s]:k_offsets[s+1]`` and sees only its own keys, with causal and window
        aligned to its own bottom-right corner. Non-decreasing, from 0 to Sq (Sk). Given
        together; not with mask or bias.
    max_q_len, max_k_len : int, optional
        The longest sequence's rows and keys; computed from host offsets.
    k_lengths : int ndarray, optional
        Broadcastable to the batch shape: entry b has only its first ``k_lengths[b]`` keys,
        and causal and window align to that length. NumPy, or CuPy for a CuPy call: then
        not read on the host, but made a mask on the device (the keys and values past
        each length are then read with weight 0, so they must be finite).
    block_table : (B, max_pages) int ndarray, optional
        Paged keys and values: k and v are pools of pages ``(num_pages, ..., page_size,
        D)`` and row b lists the pages of batch entry b in order; the call is the dense
        call on keys ``(B, ..., max_pages · page_size, D)`` made of those pages. Needs
        ``k_lengths``; the columns past an entry's length do not count (they may hold -1).

    Returns
    -------
    out : (..., Sq, Dv) ndarray
        Same kind and device as the inputs, dtype of q. A row with no allowed key is 0.
    lse : (..., Sq) ndarray
        Only with ``return_lse``: float32 (float64 for float64 inputs); -inf for a row with
        no allowed key.

    Raises
    ------
    TypeError
        Unsupported array kind or dtype, mixed host/device arrays, non-bool mask.
    ValueError
        Mismatched or non-broadcasting shapes, bad scale/softcap/window/precision/out.

    Notes
    -----
    CuPy inputs run the CUDA kernels on the current stream without synchronising; NumPy
    inputs run the same blocked online softmax in NumPy. Accumulation is float32 for
    16-bit and float32 inputs, float64 for float64.

    Examples
    --------
    >>> import numpy as np, cuattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 16, 8)).astype(np.float32) for _ in range(3))
    >>> out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, lse.shape, out.dtype
    ((2, 4, 16, 8), (2, 4, 16), dtype('float32'))
    """
    ragged_args = (q_offsets, k_offsets, max_q_len, max_k_len, k_lengths)
    plain = all(x is None for x in ragged_args) and block_table is None
    unseen = None
    if all(x is None for x in ragged_args[:4]):  # dense, or key lengths (and pages)
        result = _gpu.repeated_call(q, k, v, mask, bias, window, scale, causal, softcap,
                                    return_lse, precision, out, k_lengths, block_table)
        if isinstance(result, _gpu.Unseen):
            unseen = result
        elif result is not None:
            return result
    if _any_dask(q, k, v, mask, bias):
        if not plain:
            raise NotImplementedError(_NO_DASK)
        from . import _dask
        return _dask.attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                               bias=bias, softcap=softcap, return_lse=return_lse,
                               precision=precision, out=out)
    paged = None
    if block_table is not None:
        if k_lengths is None:
            raise ValueError("block_table needs k_lengths (the keys of each batch entry)")
        paged = check_paged(q, k, v, block_table, out)
        k, v = paged.k, paged.v  # validated as the dense call the pages make
    call = check_attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                           bias=bias, softcap=softcap, return_lse=return_lse,
                           precision=precision, out=out)
    ragged = None if plain else _check_ragged(call, *ragged_args)
    if paged is not None:
        call = _paged.prepared(call, paged, ragged)
    with _gpu.remember(unseen) as learnt:
        out, lse = _forward(call) if ragged is None else _ragged.forward(call, ragged)
    learnt.keep(call, out, lse)
    return (out, lse) if call.return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, scale=None, causal=False, window=None,
                       mask=None, bias=None, softcap=None, precision=None, q_offsets=None,
                       k_offsets=None, max_q_len=None, max_k_len=None, k_lengths=None):
    """Gradients of :func:`attention` with respect to q, k and v.

    FlashAttention-2's algorithm: the attention probabilities are recomputed tile by tile
    from q, k and the forward's ``lse``, so nothing of size Sq × Sk is stored.

    Parameters
    ----------
    dout : (..., Sq, Dv) ndarray
        Gradient of the loss with respect to the forward's output; dtype of q.
    q, k, v : ndarray
        The forward's inputs (see :func:`attention`).
    out : (..., Sq, Dv) ndarray
        The forward's output.
    lse : (..., Sq) ndarray
        The forward's ``lse`` (``return_lse=True``): float32, or float64 for float64.
    scale, causal, window, mask, bias, softcap, precision
        As given to the forward. ``bias`` is treated as a constant.
    q_offsets, k_offsets, max_q_len, max_k_len, k_lengths
        As given to the forward.

    Returns
    -------
    dq, dk, dv : ndarray
        Shapes and dtypes of q, k and v: where an input was broadcast, its gradient is summed
        over the broadcast axes (NumPy's rule), so GQA gives dk and dv of k's and v's shape.
        A row with no allowed key contributes zero. Repeated calls are bit-identical.

    Raises
    ------
    TypeError, ValueError
        As for :func:`attention`, and when dout, out or lse do not match the call.

    Notes
    -----
    On CuPy arrays three kernels run on the current stream: ``delta = rowsum(dout ∘ out)``,
    then dK and dV per key block and dQ per query block, each gradient element written once
    (no atomics). A gradient of a broadcast input is computed per batch entry in float32
    (float64 for float64) and summed over the broadcast axes, which takes that much extra
    memory; otherwise the extra memory is ``delta``, one number per query row.

    Examples
    --------
    >>> import numpy as np, cuattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 8, 4)) for _ in range(3))
    >>> out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    >>> dq, dk, dv = cuattn.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True)
    >>> dq.shape, dk.shape, dv.shape
    ((2, 8, 4), (2, 8, 4), (2, 8, 4))
    """
    ragged_args = (q_offsets, k_offsets, max_q_len, max_k_len, k_lengths)
    plain = all(x is None for x in ragged_args)
    if _any_dask(dout, q, k, v, out, lse, mask, bias):
        if not plain:
            raise NotImplementedError(_NO_DASK)
        from . import _dask
        return _dask.attention_backward(dout, q, k, v, out, lse, scale=scale, causal=causal,
                                        window=window, mask=mask, bias=bias, softcap=softcap,
                                        precision=precision)
    call = check_attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                           bias=bias, softcap=softcap, precision=precision)
    dout, out, lse = check_backward(call, dout, out, lse)
    ragged = None if plain else _check_ragged(call, *ragged_args)
    if ragged is not None:
        return _ragged.backward(call, ragged, dout, out, lse)
    return _backward(call, dout, out, lse)


def attention_vjp(q, k, v, *, scale=None, causal=False, window=None, mask=None, bias=None,
                  softcap=None, precision=None, q_offsets=None, k_offsets=None, max_q_len=None,
                  max_k_len=None, k_lengths=None):
    """The forward and a function that computes its vector-Jacobian product.

    Returns ``(out, vjp)``: ``out`` is ``attention(q, k, v, ...)`` and ``vjp(dout)`` returns
    ``(dq, dk, dv)`` by :func:`attention_backward`, reusing the saved ``out`` and ``lse``.

    Examples
    --------
    >>> import numpy as np, cuattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((3, 5, 4)).astype(np.float32) for _ in range(3))
    >>> out, vjp = cuattn.attention_vjp(q, k, v)
    >>> [g.shape for g in vjp(np.ones_like(out))]
    [(3, 5, 4), (3, 5, 4), (3, 5, 4)]
    """
    kwargs = dict(scale=scale, causal=causal, window=window, mask=mask, bias=bias,
                  softcap=softcap, precision=precision)
    ragged_kw = dict(q_offsets=q_offsets, k_offsets=k_offsets, max_q_len=max_q_len,
                     max_k_len=max_k_len, k_lengths=k_lengths)
    plain = all(x is None for x in ragged_kw.values())
    if _any_dask(q, k, v, mask, bias):
        if not plain:
            raise NotImplementedError(_NO_DASK)
        from . import _dask
        return _dask.attention_vjp(q, k, v, **kwargs)
    if not plain:
        out, lse = attention(q, k, v, return_lse=True, **kwargs, **ragged_kw)

        def ragged_vjp(dout):
            return attention_backward(dout, q, k, v, out, lse, **kwargs, **ragged_kw)

        return out, ragged_vjp
    call = check_attention(q, k, v, return_lse=True, **kwargs)
    out, lse = _forward(call)

    def vjp(dout):
        return attention_backward(dout, q, k, v, out, lse, **kwargs)

    return out, vjp


_NO_DASK = ("packed sequences, k_lengths and block_table are not supported with Dask "
            "arrays")


def _check_ragged(call: AttentionCall, *ragged_args):
    """The validated ragged metadata of a call; device metadata is not served."""
    ragged = check_ragged(call, *ragged_args)
    if ragged is not None and ragged.q_offsets is not None and not ragged.on_host:
        raise NotImplementedError("q_offsets and k_offsets in device memory are not "
                                  "supported; pass them as NumPy arrays")
    return ragged


def _any_dask(*arrays) -> bool:
    """Whether any argument is a Dask array (by its collection protocol: Dask stays
    unimported unless the caller uses it)."""
    return any(hasattr(x, "__dask_graph__") for x in arrays)


def _forward(call: AttentionCall, kernel: str | None = None, tiles=None):
    """Run a validated call on its backend; ``kernel`` forces a GPU family (tests) and
    ``tiles`` overrides the dispatch table's tile sizes (sweeps)."""
    if call.xp is np:
        return _cpu.attention_forward(call)
    return _gpu.forward(call, kernel, tiles)


def _backward(call: AttentionCall, dout, out, lse, kernel: str | None = None, tiles=None):
    """Gradients of a validated call on its backend (``kernel``, ``tiles`` as for
    :func:`_forward`)."""
    if call.xp is np:
        return _cpu.attention_backward(call, dout, out, lse)
    return _gpu_backward.backward(call, dout, out, lse, kernel, tiles)


def _attention_backward(dout, q, k, v, out, lse, *, kernel=None, tiles=None, **kwargs):
    """The private backward dispatcher: :func:`attention_backward` with a forced kernel
    family or tiles."""
    call = check_attention(q, k, v, **kwargs)
    dout, out, lse = check_backward(call, dout, out, lse)
    return _backward(call, dout, out, lse, kernel, tiles)


def _attention(q, k, v, *, kernel=None, tiles=None, **kwargs):
    """The private dispatcher: :func:`attention` with a forced kernel family or tiles."""
    call = check_attention(q, k, v, **kwargs)
    out, lse = _forward(call, kernel, tiles)
    return (out, lse) if call.return_lse else out
