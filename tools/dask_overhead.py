"""What a Dask call costs besides its kernels: a trivial 4-chunk sum against cuattn on Dask
arrays of CuPy chunks (threaded scheduler), the graph built alone and built and computed.

    PYTHONPATH=. python tools/dask_overhead.py

For bf16 (1, 8, S, 64) attention with S 256 (the fixed cost dominates) and 4096, one key
chunk and four: milliseconds of the direct call, of building the lazy result, and of
building and computing it (medians of 30, each ended by a device synchronization). The
difference between the last and the direct call is the per-call cost of Dask and of the
per-chunk calls and merge; the trivial sum shows Dask's own share.
"""
import time

import cupy as cp
import dask
import dask.array as da
import ml_dtypes
import numpy as np

import cuattn


def median_ms(fn, n=30):
    fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main():
    dask.config.set(scheduler="threads")
    a = da.from_array(cp.ones((4, 1024), np.float32), chunks=(1, 1024), asarray=False)
    print(f"trivial 4-chunk sum: {median_ms(lambda: a.sum().compute()):.3f} ms")
    rng = np.random.default_rng(0)
    for s in (256, 4096):
        q = cp.asarray(rng.standard_normal((1, 8, s, 64)).astype(ml_dtypes.bfloat16))
        direct = median_ms(lambda q=q: cuattn.attention(q, q, q))
        for chunk in (s, s // 4):
            dq = da.from_array(q, chunks=(1, 8, s, 64), asarray=False)
            dk = da.from_array(q, chunks=(1, 8, chunk, 64), asarray=False)
            build = median_ms(lambda dq=dq, dk=dk: cuattn.attention(dq, dk, dk))
            full = median_ms(lambda dq=dq, dk=dk: cuattn.attention(dq, dk, dk).compute())
            print(f"S{s}, {s // chunk} key chunks: direct {direct:.3f} ms, graph "
                  f"{build:.3f} ms, graph and compute {full:.3f} ms")


if __name__ == "__main__":
    main()
