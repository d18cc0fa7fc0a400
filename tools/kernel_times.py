"""Per-kernel times of one backward: delta, dK/dV and dQ timed apart with CUDA events.

    PYTHONPATH=. python tools/kernel_times.py FAMILY D DTYPE [causal] [TILES]

e.g. ``sm90_3xf16 64 float32``, ``sm90 64 bfloat16 causal``,
``sm90_3xf16 128 float32 "Sm90F16SplitBwdTiles(32, 32, dkdv_roles=2)"`` (TILES: a tiles
expression over the tile classes of cuattn.families; without it the dispatch table's choice).
The shape is the backward sweep's: B·S = 16k tokens, H·D = 2048, S = 4096. float32 runs
with precision "highest". Prints each kernel's median milliseconds and the rate of the
matrix products it does, each of the size of one of the forward's two: dK/dV recomputes S,
then dP, dV and dK (4); dQ recomputes S and dP, then dQ (3). The backward's own rate counts
2.5x the forward's FLOPs, as the bench does.
"""
import sys

import cupy as cp
import ml_dtypes
import numpy as np

import cuattn
from cuattn import _gpu_backward
from cuattn.attention import _attention_backward
from cuattn.families import mma, mma_wide, portable, sm90, sm90_3xf16, sm90_tf32


def main():
    family, d, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    causal = "causal" in sys.argv[4:]
    exprs = [a for a in sys.argv[4:] if a != "causal"]
    names = {k: v for m in (mma, mma_wide, portable, sm90, sm90_3xf16, sm90_tf32)
             for k, v in vars(m).items() if isinstance(v, type)}
    tiles = eval(exprs[0], names) if exprs else None  # noqa: S307 - a tool
    kw = {"precision": "highest"} if name == "float32" else {}
    dtype = ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)
    s = 4096
    b, h = 16384 // s, 2048 // d
    q, k, v = (cp.random.standard_normal((b, h, s, d), dtype=cp.float32).astype(dtype)
               for _ in range(3))
    out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True, **kw)
    dout = cp.random.standard_normal(out.shape, dtype=cp.float32).astype(dtype)
    times = {}
    names = {}  # kernel handle -> name expression
    real_get_kernel, real_launch = _gpu_backward.get_kernel, _gpu_backward.Launch

    def named_get_kernel(filename, expr, **options):
        fn = real_get_kernel(filename, expr, **options)
        names[fn.kernel.ptr] = expr
        return fn

    class TimedLaunch(real_launch):
        def __call__(self, *args, **kwargs):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            super().__call__(*args, **kwargs)
            stop.record()
            times.setdefault(names[self._function], []).append((start, stop))

    _gpu_backward.get_kernel, _gpu_backward.Launch = named_get_kernel, TimedLaunch
    try:
        for _ in range(3):
            _attention_backward(dout, q, k, v, out, lse, causal=causal, kernel=family,
                                tiles=tiles, **kw)
        cp.cuda.Device().synchronize()
        times.clear()
        for _ in range(10):
            _attention_backward(dout, q, k, v, out, lse, causal=causal, kernel=family,
                                tiles=tiles, **kw)
        cp.cuda.Device().synchronize()
    finally:
        _gpu_backward.get_kernel, _gpu_backward.Launch = real_get_kernel, real_launch
    fwd = 4.0 * b * h * s * s * d / (2 if causal else 1)  # the forward's FLOPs
    print(f"{family} D{d} {name} causal={causal} shape {(b, h, s, d)} tiles {tiles}")
    total = 0.0
    for expr, events in times.items():
        ms = float(np.median([cp.cuda.get_elapsed_time(a, z) for a, z in events]))
        total += ms
        # products of the forward's size: dK/dV recomputes S, then dP, dV, dK (4);
        # dQ recomputes S and dP, then dQ (3); delta none
        n = 4 if "dkdv" in expr else 3 if "_dq" in expr else 0
        rate = f"{n * fwd / 2 / ms / 1e9:7.1f} TFLOP/s" if n else ""
        print(f"  {ms:8.3f} ms {rate:16s} {expr}")
    print(f"  {total:8.3f} ms total; backward at 2.5x forward FLOPs: "
          f"{2.5 * fwd / total / 1e9:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
