"""The vit suite's shape timed without the host: 20 calls back to back between two events,
so that each implementation's per-call time is its kernels' (PyTorch's backend context is
entered once, outside the timing). The bench's vit rows time one call at a time and so
include each side's host time; this separates the two.

    PYTHONPATH=. python tools/vit_kernels.py
"""
import cupy as cp

import cuattn
from cuattn.bench import _time

SHAPE = (64, 12, 197, 64)
CALLS = 20


def main():
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    flops = 4.0 * SHAPE[0] * SHAPE[1] * SHAPE[2] ** 2 * SHAPE[3]
    print(f"{'dtype':9s} {'implementation':16s} {'us per call':>12s} {'TFLOP/s':>8s}")
    for dtype in ("float16", "bfloat16"):
        q, k, v = (cp.random.standard_normal(SHAPE, dtype=cp.float32).astype(dtype)
                   for _ in range(3))
        tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
        rows = {"cuattn": lambda q=q, k=k, v=v: [cuattn.attention(q, k, v)
                                                 for _ in range(CALLS)]}
        for name, backend in (("torch flash", SDPBackend.FLASH_ATTENTION),
                              ("torch cudnn", SDPBackend.CUDNN_ATTENTION)):
            def call(backend=backend, tq=tq, tk=tk, tv=tv):
                with sdpa_kernel([backend]):
                    return [sdpa(tq, tk, tv) for _ in range(CALLS)]
            rows[name] = call
        for name, fn in rows.items():
            us = _time(fn, cp, max_reps=30, budget_s=1.0) * 1000 / CALLS
            print(f"{dtype:9s} {name:16s} {us:12.1f} {flops / us / 1e6:8.1f}")


if __name__ == "__main__":
    main()
