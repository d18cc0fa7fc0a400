"""One mma-family forward for ncu: PYTHONPATH=. ncu ... python tools/profile_mma.py [D]"""
import sys

import cupy as cp
import ml_dtypes

import cuattn

d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
q, k, v = (cp.random.standard_normal((4, 16, 4096, d), dtype=cp.float32).astype(ml_dtypes.bfloat16)
           for _ in range(3))
for _ in range(3):
    cuattn.attention(q, k, v)
cp.cuda.Device().synchronize()
