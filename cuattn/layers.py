"""``multi_head_attention``: the self-attention layer of a Transformer around ``attention``."""
from __future__ import annotations

import numpy as np

from ._checks import FLOAT_DTYPES, as_array, check_flag, mixed_kinds
from .attention import attention

__all__ = ["multi_head_attention"]


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
