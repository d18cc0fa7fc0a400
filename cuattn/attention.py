"""``attention``, ``attention_backward``, ``attention_vjp`` and ``multi_head_attention``.

Each public function validates its arguments (``_checks``), then hands NumPy calls to the
blocked NumPy backend (``_cpu``) and CuPy calls to the GPU backend (``_gpu``), which runs
the kernels that ``_dispatch`` picks on the current stream.
"""
from __future__ import annotations

import numpy as np

from . import _cpu, _gpu
from ._checks import (
    FLOAT_DTYPES,
    AttentionCall,
    as_array,
    check_attention,
    check_backward,
    check_flag,
    mixed_kinds,
)

__all__ = ["attention", "attention_backward", "attention_vjp", "multi_head_attention"]


def attention(q, k, v, *, scale=None, causal=False, window=None, mask=None, bias=None,
              softcap=None, return_lse=False, precision=None, out=None):
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
    if out is None:
        result = _gpu.repeated_call(q, k, v, mask, bias, window, scale, causal, softcap,
                                return_lse, precision)
        if result is not None:
            return result
    call = check_attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                           bias=bias, softcap=softcap, return_lse=return_lse,
                           precision=precision, out=out)
    out, lse = _forward(call)
    return (out, lse) if call.return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, scale=None, causal=False, window=None,
                       mask=None, bias=None, softcap=None, precision=None):
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
    call = check_attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                           bias=bias, softcap=softcap, precision=precision)
    dout, out, lse = check_backward(call, dout, out, lse)
    return _backward(call, dout, out, lse)


def attention_vjp(q, k, v, *, scale=None, causal=False, window=None, mask=None, bias=None,
                  softcap=None, precision=None):
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
    call = check_attention(q, k, v, return_lse=True, **kwargs)
    out, lse = _forward(call)

    def vjp(dout):
        return attention_backward(dout, q, k, v, out, lse, **kwargs)

    return out, vjp


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
    return _gpu.backward(call, dout, out, lse, kernel, tiles)


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


def multi_head_attention(x, w_q, w_k, w_v, w_o, *, num_heads, b_q=None, b_k=None, b_v=None,
                         b_o=None, causal=False, mask=None):
    """The self-attention layer of a Transformer / Vision Transformer (``x @ w`` convention).

    Parameters
    ----------
    x : (..., N, E) ndarray
        Tokens (numpy or cupy).
    w_q, w_k, w_v, w_o : (E, E) ndarray
        Projections, applied as ``x @ w``.
    num_heads : int
        E is split into ``num_heads`` heads of ``E // num_heads``.
    b_q, b_k, b_v, b_o : (E,) ndarray, optional
        Projection biases.
    causal : bool, optional
        Causal self-attention.
    mask : bool ndarray, optional
        Broadcastable to ``(..., num_heads, N, N)``.

    Returns
    -------
    (..., N, E) ndarray

    Notes
    -----
    The projections use the array library's matmul; for bfloat16 CuPy arrays, which CuPy
    cannot multiply, they are computed in float32 and rounded to bfloat16 once.

    Examples
    --------
    >>> import numpy as np, cuattn
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    >>> w = [rng.standard_normal((16, 16)).astype(np.float32) / 4 for _ in range(4)]
    >>> cuattn.multi_head_attention(x, *w, num_heads=4).shape
    (2, 5, 16)
    """
    x, xp = as_array(x, "x")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; supported dtypes are float16, bfloat16, "
                        f"float32 and float64")
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dims (..., N, E), got shape {x.shape}")
    embed = x.shape[-1]
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)):
        raise TypeError(f"num_heads must be an int, got num_heads={num_heads!r}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got num_heads={num_heads!r}")
    if embed % num_heads:
        raise ValueError(f"embedding dim {embed} is not divisible by num_heads={num_heads}")
    params = {}
    for name, w, shape in (("w_q", w_q, (embed, embed)), ("w_k", w_k, (embed, embed)),
                           ("w_v", w_v, (embed, embed)), ("w_o", w_o, (embed, embed)),
                           ("b_q", b_q, (embed,)), ("b_k", b_k, (embed,)),
                           ("b_v", b_v, (embed,)), ("b_o", b_o, (embed,))):
        if w is None:
            if name.startswith("w"):
                raise TypeError(f"{name} must be an array, got None")
            params[name] = None
            continue
        w, xw = as_array(w, name)
        if xw is not xp:
            raise mixed_kinds(name, xw, "x", xp)
        if w.dtype != x.dtype:
            raise TypeError(f"{name} must have the dtype of x ({x.dtype}), got {w.dtype}")
        if w.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {w.shape}")
        params[name] = w
    w_q, w_k, w_v, w_o = (params[n] for n in ("w_q", "w_k", "w_v", "w_o"))
    b_q, b_k, b_v, b_o = (params[n] for n in ("b_q", "b_k", "b_v", "b_o"))
    causal = check_flag(causal, "causal")
    head_dim = embed // num_heads

    def matmul(a, w):
        # CuPy has no bfloat16 matmul: such projections run in float32, rounded back once
        if a.dtype.name == "bfloat16" and not isinstance(a, np.ndarray):
            return (a.astype(np.float32) @ w.astype(np.float32)).astype(a.dtype)
        return a @ w

    def project(w, b):
        y = matmul(x, w)
        if b is not None:
            y = y + b
        # (..., N, E) -> (..., H, N, Dh): a view, no copy
        return y.reshape(y.shape[:-1] + (num_heads, head_dim)).swapaxes(-2, -3)

    heads = attention(project(w_q, b_q), project(w_k, b_k), project(w_v, b_v),
                      causal=causal, mask=mask)
    merged = heads.swapaxes(-2, -3).reshape(x.shape)
    y = matmul(merged, w_o)
    return y if b_o is None else y + b_o
