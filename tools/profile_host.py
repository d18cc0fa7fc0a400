"""Host overhead of cuattn.attention: microseconds of Python per call on tiny shapes, then a
cProfile of the same loop (the functions that cost the time).

    PYTHONPATH=. python tools/profile_host.py [calls]

PERF.md's target: <= 25 us of Python per call. The GPU work of these shapes is a few
microseconds, so calls issued back to back without synchronisation measure the host side.
"""
import cProfile
import pstats
import sys
import time

import cupy as cp
import ml_dtypes

import cuattn

calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
cases = {
    "bf16 (1, 1, 16, 64)": dict(dtype=ml_dtypes.bfloat16, shape=(1, 1, 16, 64)),
    "bf16 (2, 8, 16, 64) causal": dict(dtype=ml_dtypes.bfloat16, shape=(2, 8, 16, 64),
                                       causal=True),
    "float32 (1, 1, 16, 64)": dict(dtype="float32", shape=(1, 1, 16, 64)),
}
for name, case in cases.items():
    q, k, v = (cp.random.standard_normal(case["shape"], dtype=cp.float32).astype(case["dtype"])
               for _ in range(3))
    kwargs = {"causal": case.get("causal", False)}
    for _ in range(20):
        cuattn.attention(q, k, v, **kwargs)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        cuattn.attention(q, k, v, **kwargs)
    t1 = time.perf_counter()
    cp.cuda.Device().synchronize()
    print(f"{name:30s} {(t1 - t0) / calls * 1e6:7.1f} us per call (host)")

q, k, v = (cp.random.standard_normal((1, 1, 16, 64), dtype=cp.float32).astype(ml_dtypes.bfloat16)
           for _ in range(3))
prof = cProfile.Profile()
prof.enable()
for _ in range(calls):
    cuattn.attention(q, k, v)
prof.disable()
cp.cuda.Device().synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
