"""Benchmark rows of whole layers: ``multi_head_attention`` and the ViT encoder block,
against the same computations in PyTorch."""
from __future__ import annotations

import functools
import math

import numpy as np

from ._bench_core import Case, _timed_rows


def _layer_rows(case: Case, cupy, torch):
    """cuattn's layer or block and the same computation in PyTorch, timed as the attention
    rows are (float32 PyTorch products without TF32, as cuattn's)."""
    dtype = np.dtype(case.dtype)
    rng = np.random.default_rng(0)
    e = case.heads * case.head_dim
    x = cupy.asarray(rng.standard_normal((case.batch, case.seqlen, e)).astype(dtype))
    impls = (_layer_impls if case.kind == "layer" else _block_impls)(case, cupy, torch, x, rng)
    return _timed_rows(impls, case, cupy, torch)


def _normal(xp, rng, shape, scale, dtype, mean=0.0):
    return xp.asarray((mean + scale * rng.standard_normal(shape)).astype(dtype))


def _layer_impls(case: Case, cupy, torch, x, rng):
    import cuattn
    e, heads = x.shape[-1], case.heads
    ws = [_normal(cupy, rng, (e, e), e ** -0.5, x.dtype) for _ in range(4)]
    bs = [_normal(cupy, rng, e, 0.1, x.dtype) for _ in range(4)]
    w_qkv, b_qkv = cupy.concatenate(ws[:3], axis=1), cupy.concatenate(bs[:3])
    pw = [w_qkv[:, i * e:(i + 1) * e] for i in range(3)]
    pb = [b_qkv[i * e:(i + 1) * e] for i in range(3)]
    impls = {
        "cuattn": lambda: cuattn.multi_head_attention(
            x, *ws, num_heads=heads, b_q=bs[0], b_k=bs[1], b_v=bs[2], b_o=bs[3]),
        "cuattn packed qkv": lambda: cuattn.multi_head_attention(
            x, *pw, ws[3], num_heads=heads, b_q=pb[0], b_k=pb[1], b_v=pb[2], b_o=bs[3]),
    }
    if torch is not None:
        tx, tws, tbs = (torch.from_dlpack(x), [torch.from_dlpack(w) for w in ws],
                        [torch.from_dlpack(b) for b in bs])

        def torch_layer():
            with torch.inference_mode():
                return _torch_layer(torch, tx, tws, tbs, heads)
        impls["torch layer"] = torch_layer
    return impls


def _torch_layer(torch, x, ws, bs, heads):
    """multi_head_attention in PyTorch: ``x @ w + b`` projections, SDPA, ``@ w_o + b_o``."""
    b, n, e = x.shape
    q, k, v = ((x @ w + bias).view(b, n, heads, e // heads).transpose(1, 2)
               for w, bias in zip(ws[:3], bs[:3]))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(b, n, e) @ ws[3] + bs[3]


def _block_impls(case: Case, cupy, torch, x, rng):
    e = x.shape[-1]
    p = _block_params(cupy, rng, e, 4 * e, x.dtype)
    impls = {"cuattn": lambda: _vit_block(x, p, case.heads)}
    if torch is not None:
        tx = torch.from_dlpack(x)
        layer = torch.nn.TransformerEncoderLayer(
            e, case.heads, 4 * e, activation="gelu", batch_first=True, norm_first=True,
            device=tx.device, dtype=tx.dtype).eval()

        def torch_block():
            with torch.inference_mode():
                return layer(tx)
        impls["torch TransformerEncoderLayer"] = torch_block
    return impls


def _block_params(xp, rng, embed, hidden, dtype):
    """Random parameters of the docs' ViT block (its ``init_block``)."""
    n = functools.partial(_normal, xp, rng, dtype=dtype)
    return {"ln1_g": n(embed, 0.1, mean=1.0), "ln1_b": n(embed, 0.1),
            "w_qkv": n((embed, 3 * embed), embed ** -0.5), "b_qkv": n(3 * embed, 0.1),
            "w_o": n((embed, embed), embed ** -0.5), "b_o": n(embed, 0.1),
            "ln2_g": n(embed, 0.1, mean=1.0), "ln2_b": n(embed, 0.1),
            "w_fc1": n((embed, hidden), embed ** -0.5), "b_fc1": n(hidden, 0.1),
            "w_fc2": n((hidden, embed), hidden ** -0.5), "b_fc2": n(embed, 0.1)}


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy
    return cupy


def _work_dtype(dtype):
    return np.float64 if dtype == np.float64 else np.float32


def _layer_norm(x, gamma, beta, eps=1e-6):
    a = x.astype(_work_dtype(x.dtype))
    mean = a.mean(axis=-1, keepdims=True)
    var = ((a - mean) ** 2).mean(axis=-1, keepdims=True)
    return ((a - mean) / _xp(x).sqrt(var + eps) * gamma + beta).astype(x.dtype)


def _gelu_tanh(a):
    return 0.5 * a * (1 + _xp(a).tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))


def _vit_block(x, p, num_heads):
    """The pre-norm encoder block of docs/vit.rst (``vit_block``), step for step; the tests
    hold the two to the same bits."""
    import cuattn
    e = x.shape[-1]
    w, b = p["w_qkv"], p["b_qkv"]
    h = _layer_norm(x, p["ln1_g"], p["ln1_b"])
    x = x + cuattn.multi_head_attention(
        h, w[:, :e], w[:, e:2 * e], w[:, 2 * e:], p["w_o"], num_heads=num_heads,
        b_q=b[:e], b_k=b[e:2 * e], b_v=b[2 * e:], b_o=p["b_o"])
    work = _work_dtype(x.dtype)
    h = _layer_norm(x, p["ln2_g"], p["ln2_b"]).reshape(-1, e)
    h = _gelu_tanh((h @ p["w_fc1"]).astype(work) + p["b_fc1"]).astype(x.dtype)
    h = ((h @ p["w_fc2"]).astype(work) + p["b_fc2"]).astype(x.dtype)
    return x + h.reshape(x.shape)
