"""One attention forward for ncu, after warm-up calls:

    PYTHONPATH=. ncu -k regex:attention_fwd ... python tools/profile_forward.py [D] [dtype] [causal]

D defaults to 128 and dtype to bfloat16 ("tf32": float32 with precision="tf32"); "causal"
as the third word makes it causal. The shape is the bench's: B4 H16 S4096 (B1 for float64).
"""
import sys

import cupy as cp
import ml_dtypes
import numpy as np

import cuattn

d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
name = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
causal = len(sys.argv) > 3 and sys.argv[3] == "causal"
kw = {"precision": "tf32"} if name == "tf32" else {}
dtype = (ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype("float32") if name == "tf32"
         else np.dtype(name))
b = 1 if name == "float64" else 4
q, k, v = (cp.random.standard_normal((b, 16, 4096, d), dtype=cp.float32).astype(dtype)
           for _ in range(3))
for _ in range(3):
    cuattn.attention(q, k, v, causal=causal, **kw)
cp.cuda.Device().synchronize()
