"""Per-step GPU times of ``multi_head_attention`` on the ViT-B/16 shape against the same
layer in PyTorch, to find where the layer's time goes.

    PYTHONPATH=. python tools/layer_times.py [float16 bfloat16 float32]

For B = 1 and 64 (N 197, E 768, 12 heads, biases on all four projections) it prints the
whole layer (separate and side-by-side Q/K/V weights) and each of its steps as the layer
runs them: the bias copies, the cuBLAS products (``cublasGemmEx`` on CuPy's handle, beta 1
and 0, one packed product or three, with the layer's algorithm and with each of cuBLAS's
default (-1) and tensor-op (99) algorithms), CuPy's own 2-D
matmul of the same product, attention on the layer's strided views and on contiguous
copies; then PyTorch's layer, its ``addmm`` of the packed product, one projection, and
SDPA on the same views. Each time is the median over 5 batches of 50 calls between CUDA
events, so host-bound steps show their host time at B = 1. It also prints the math mode of
CuPy's cuBLAS handle.
"""
import sys

import cupy as cp
import ml_dtypes
import numpy as np
import torch

import cuattn
from cuattn import layers


def per_call_us(fn, reps=50):
    for _ in range(5):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(5):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / reps * 1e3)
    return float(np.median(times))


def steps(batch, dtype):
    embed, heads, tokens = 768, 12, 197
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal((batch, tokens, embed)).astype(dtype))
    ws = [cp.asarray((rng.standard_normal((embed, embed)) * embed ** -0.5).astype(dtype))
          for _ in range(4)]
    bs = [cp.asarray((rng.standard_normal(embed) * 0.1).astype(dtype)) for _ in range(4)]
    w_qkv, b_qkv = cp.concatenate(ws[:3], axis=1), cp.concatenate(bs[:3])
    pw = [w_qkv[:, i * embed:(i + 1) * embed] for i in range(3)]
    pb = [b_qkv[i * embed:(i + 1) * embed] for i in range(3)]
    rows, dh = batch * tokens, embed // heads
    products = layers._CublasProducts.current(np.dtype(dtype), "highest")
    x2 = x.reshape(rows, embed)
    qkv, y = cp.empty((rows, 3 * embed), dtype), cp.empty((rows, embed), dtype)
    blocks = [qkv[:, i * embed:(i + 1) * embed] for i in range(3)]
    q, k, v = (b.reshape(batch, tokens, heads, dh).swapaxes(1, 2) for b in blocks)
    qc, kc, vc = (cp.ascontiguousarray(t) for t in (q, k, v))
    out = cp.empty((batch, tokens, heads, dh), dtype)
    packed = layers._matrix(w_qkv)

    def gemm(algo):
        saved, products.algo = products.algo, algo
        try:
            products(x2, packed, qkv, accumulate=True)
        finally:
            products.algo = saved

    tx, tq, tk, tv = (torch.from_dlpack(t) for t in (x, q, k, v))
    tws, tbs = [torch.from_dlpack(w) for w in ws], [torch.from_dlpack(b) for b in bs]
    tw_qkv, tb_qkv = torch.from_dlpack(w_qkv), torch.from_dlpack(b_qkv)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def torch_layer():
        with torch.inference_mode():
            qq, kk, vv = ((tx @ w + b).view(batch, tokens, heads, dh).transpose(1, 2)
                          for w, b in zip(tws[:3], tbs[:3]))
            o = sdpa(qq, kk, vv)
            return o.transpose(1, 2).reshape(batch, tokens, embed) @ tws[3] + tbs[3]

    return {
        "layer, separate weights": lambda: cuattn.multi_head_attention(
            x, *ws, num_heads=heads, b_q=bs[0], b_k=bs[1], b_v=bs[2], b_o=bs[3]),
        "layer, packed weights": lambda: cuattn.multi_head_attention(
            x, *pw, ws[3], num_heads=heads, b_q=pb[0], b_k=pb[1], b_v=pb[2], b_o=bs[3]),
        "copy qkv bias": lambda: cp.copyto(qkv, b_qkv),
        "gemm qkv packed, beta 1": lambda: gemm(products.algo),
        "gemm qkv packed, algo -1": lambda: gemm(layers._GEMM_DEFAULT),
        "gemm qkv packed, algo 99": lambda: gemm(layers._GEMM_TENSOR_OP),
        "gemm qkv packed, beta 0": lambda: products(x2, packed, qkv, accumulate=False),
        "gemm qkv as 3, beta 1": lambda: [products(x2, w, b, accumulate=True)
                                         for w, b in zip(ws[:3], blocks)],
        "cupy matmul qkv (2-D)": lambda: cp.matmul(x2, w_qkv),
        "attention on the views": lambda: cuattn.attention(q, k, v, out=out.swapaxes(1, 2)),
        "attention contiguous": lambda: cuattn.attention(qc, kc, vc),
        "copy out bias": lambda: cp.copyto(y, bs[3]),
        "gemm out, beta 1": lambda: products(out.reshape(rows, embed), ws[3], y,
                                             accumulate=True),
        "torch layer": torch_layer,
        "torch addmm qkv": lambda: torch.addmm(tb_qkv, tx.view(rows, embed), tw_qkv),
        "torch x @ w + b, one": lambda: tx @ tws[0] + tbs[0],
        "torch sdpa on the views": lambda: sdpa(tq, tk, tv),
    }, products


def main():
    from cupy_backends.cuda.libs import cublas
    names = sys.argv[1:] or ["float16", "bfloat16", "float32"]
    for batch in (1, 64):
        for name in names:
            dtype = np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name)
            table, products = steps(batch, dtype)
            print(f"B{batch} {name}: CuPy's cuBLAS math mode "
                  f"{cublas.getMathMode(products.handle)}", flush=True)
            for label, fn in table.items():
                print(f"  {label:28s} {per_call_us(fn):9.1f} us", flush=True)


if __name__ == "__main__":
    main()
