"""The accuracy comparison's grid (its constants and cases) and its float64 reference
(``dense_attention``, ``dense_attention_grads``); :mod:`cuattn.accuracy` runs it."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

from ._checks import sum_to_shape

QUANTITIES = ("out", "dq", "dk", "dv")


HALF_DTYPES = ("float16", "bfloat16")


SEQLENS = ((113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256),
           (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048))


HEAD_DIMS = (32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)


HEADS_Q = 6


HEADS_KV = (6, 2, 1)


LAYOUTS = ("bhsd", "bshd")


#: a ratio at most this counts as "within" in the summaries
WITHIN = 1.05


#: the float64 section's bound, in units in the last place
ULPS = 4


ONE_KEY_DTYPES = ("float16", "bfloat16", "float32", "float64")


ONE_KEY_CASES = ("Sk=1", "causal first row")


@dataclass(frozen=True)
class AccuracyCase:
    """One input configuration: q is (batch, heads_q, Sq, D), k and v (batch, heads_kv,
    Sk, D), stored as BHSD or BSHD."""

    dtype: str
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool = False
    heads_kv: int = HEADS_Q
    layout: str = "bhsd"
    heads_q: int = HEADS_Q
    batch: int = 2

    @property
    def groups(self) -> int:
        """Query heads per K/V head."""
        return self.heads_q // self.heads_kv

    @property
    def grouping(self) -> str:
        """"mha", "gqa" or "mqa"."""
        return ("mha" if self.heads_kv == self.heads_q else
                "mqa" if self.heads_kv == 1 else "gqa")

    @property
    def label(self) -> str:
        return (f"{self.dtype} B{self.batch} H{self.heads_q}/{self.heads_kv} "
                f"{self.seqlen_q}x{self.seqlen_k} D{self.head_dim} {self.layout}"
                + (" causal" if self.causal else ""))


def half_grid() -> list[AccuracyCase]:
    """The 16-bit grid: every (Sq, Sk) of ``SEQLENS`` with every head dim of ``HEAD_DIMS``.

    The other options (dtype, causal, K/V heads, layout: 2 · 2 · 3 · 2 = 24 combinations)
    are cycled: pair ``i`` and head dim ``j`` take combination
    ``c = (5 i + 7 j) mod 24``, read in mixed radix as dtype ``c mod 2``, causal
    ``c // 2 mod 2``, K/V heads ``HEADS_KV[c // 4 mod 3]``, layout ``LAYOUTS[c // 12]``.
    With these strides every pair and every head dim meets every value of every option,
    and all 24 combinations occur, 4 to 6 times each.

    Returns
    -------
    list of AccuracyCase
        120 cases, batch 2, 6 query heads.

    Examples
    --------
    >>> from cuattn.accuracy import half_grid
    >>> cases = half_grid()
    >>> len(cases), cases[0].label
    (120, 'float16 B2 H6/6 113x203 D32 bhsd')
    """
    cases = []
    for i, (sq, sk) in enumerate(SEQLENS):
        for j, d in enumerate(HEAD_DIMS):
            c = (5 * i + 7 * j) % 24
            cases.append(AccuracyCase(HALF_DTYPES[c % 2], sq, sk, d, causal=bool(c // 2 % 2),
                                      heads_kv=HEADS_KV[c // 4 % 3], layout=LAYOUTS[c // 12]))
    return cases


FLOAT32_CASES = (
    AccuracyCase("float32", 2048, 2048, 128, causal=True, heads_q=8, heads_kv=8),
    AccuracyCase("float32", 512, 512, 256),
    AccuracyCase("float32", 113, 203, 59, heads_kv=2, layout="bshd"),
    AccuracyCase("float32", 1023, 1024, 64, causal=True, heads_kv=1),
)
FLOAT64_CASES = (
    AccuracyCase("float64", 113, 203, 64),
    AccuracyCase("float64", 1024, 1024, 128, causal=True),
    AccuracyCase("float64", 256, 512, 256, heads_kv=2),
    AccuracyCase("float64", 1023, 1024, 59, causal=True, heads_kv=1, layout="bshd"),
)


#: ``run(quick=True)``: small cases that still take both dtypes, causal both ways (one
#: with Sq > Sk, so rows with no allowed key), every grouping and both layouts
QUICK_CASES = {
    "half": (
        AccuracyCase("float16", 113, 203, 59, causal=True, heads_kv=2, layout="bshd"),
        AccuracyCase("bfloat16", 128, 217, 64, heads_kv=1),
        AccuracyCase("bfloat16", 256, 128, 32, causal=True, heads_q=2, heads_kv=2),
        AccuracyCase("float16", 108, 256, 40, heads_q=2, heads_kv=2, layout="bshd"),
    ),
    "float32": (AccuracyCase("float32", 128, 128, 64, causal=True, heads_q=2, heads_kv=2),),
    "float64": (AccuracyCase("float64", 113, 203, 59, heads_q=2, heads_kv=1, layout="bshd"),),
}


SECTIONS = {  # key: (title, peers)
    "half": ("16-bit grid", ("torch flash", "torch cudnn")),
    "float32": ('float32, precision="highest"', ("torch math", "torch efficient")),
    "float64": ("float64", ("torch math",)),
}


SDPA_BACKENDS = {"torch flash": "FLASH_ATTENTION", "torch cudnn": "CUDNN_ATTENTION",
                 "torch efficient": "EFFICIENT_ATTENTION", "torch math": "MATH"}


# ---- the float64 reference --------------------------------------------------------------


def _module_of(x):
    cupy = sys.modules.get("cupy")
    return cupy if cupy is not None and isinstance(x, cupy.ndarray) else np


def _probabilities(q, k, causal: bool, scale: float):
    """``(P, lse)``: softmax(scale · q kᵀ) over the keys cuattn's bottom-right causal band
    allows (``j <= i + Sk - Sq``); a row with no allowed key is zero, its lse -inf."""
    xp = _module_of(q)
    s = q @ k.swapaxes(-1, -2)
    s *= scale
    if causal:
        sq, sk = s.shape[-2:]
        allowed = xp.arange(sk)[None, :] <= xp.arange(sq)[:, None] + (sk - sq)
        s += xp.where(allowed, 0.0, -xp.inf)
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isneginf(m), 0.0, m)  # an empty row: exp(-inf - 0) = 0
    s -= m
    xp.exp(s, out=s)
    total = s.sum(axis=-1, keepdims=True)
    s /= xp.where(total == 0, 1.0, total)
    with np.errstate(divide="ignore"):
        lse = (m + xp.log(total))[..., 0]
    return s, lse


def _scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def dense_attention(q, k, v, *, causal=False, scale=None):
    """float64 attention by the plain formula, on the arrays' device (NumPy or CuPy).

    Parameters
    ----------
    q : (..., Sq, D) ndarray
    k : (..., Sk, D) ndarray
    v : (..., Sk, Dv) ndarray
        Upcast to float64; leading dims broadcast (GQA: q (B, Hkv, G, Sq, D), k and v
        (B, Hkv, 1, Sk, D)).
    causal : bool, optional
        Bottom-right aligned, as in :func:`cuattn.attention`.
    scale : float, optional
        Default ``1 / sqrt(D)``.

    Returns
    -------
    out : (..., Sq, Dv) float64 ndarray
        0 on a row with no allowed key.
    lse : (..., Sq) float64 ndarray
        Natural-log row log-sum-exp; -inf on a row with no allowed key.

    Examples
    --------
    >>> import numpy as np
    >>> from cuattn.accuracy import dense_attention
    >>> q = k = v = np.eye(2)[None]
    >>> out, lse = dense_attention(q, k, v, causal=True)
    >>> out[0, 0].tolist()
    [1.0, 0.0]
    """
    xp = _module_of(q)
    q, k, v = (x.astype(xp.float64) for x in (q, k, v))
    p, lse = _probabilities(q, k, causal, _scale(q, scale))
    return p @ v, lse


def dense_attention_grads(dout, q, k, v, *, causal=False, scale=None):
    """float64 output and gradients by the plain formulas, from one softmax.

    ``P = softmax(S)``, ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P ∘ (dP - rowsum(dO ∘ O))``,
    ``dQ = scale · dS K``, ``dK = scale · dSᵀ Q``; the gradient of a broadcast input is
    summed over its broadcast axes (GQA: dk and dv over the query heads of a group).

    Parameters
    ----------
    dout : (..., Sq, Dv) ndarray
        Gradient of the loss with respect to the output.
    q, k, v, causal, scale
        As for :func:`dense_attention`.

    Returns
    -------
    out, dq, dk, dv : float64 ndarray
        ``out`` of the broadcast shape; the gradients of q's, k's and v's shapes.

    Examples
    --------
    >>> import numpy as np
    >>> from cuattn.accuracy import dense_attention_grads
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 3, 5, 4))           # 2 K/V heads of 3 query heads
    >>> k, v = (rng.standard_normal((2, 1, 7, 4)) for _ in range(2))
    >>> out, dq, dk, dv = dense_attention_grads(np.ones((2, 3, 5, 4)), q, k, v)
    >>> out.shape, dq.shape, dk.shape, dv.shape
    ((2, 3, 5, 4), (2, 3, 5, 4), (2, 1, 7, 4), (2, 1, 7, 4))
    """
    xp = _module_of(q)
    dout, q, k, v = (x.astype(xp.float64) for x in (dout, q, k, v))
    scale = _scale(q, scale)
    p, _ = _probabilities(q, k, causal, scale)
    out = p @ v
    dv = sum_to_shape(p.swapaxes(-1, -2) @ dout, v.shape)
    ds = dout @ v.swapaxes(-1, -2)
    ds -= (dout * out).sum(axis=-1, keepdims=True)
    ds *= p
    dq = sum_to_shape(ds @ k, q.shape) * scale
    dk = sum_to_shape(ds.swapaxes(-1, -2) @ q, k.shape) * scale
    return out, dq, dk, dv
