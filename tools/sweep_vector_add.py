"""vector_add against its ceilings, several rounds interleaved so that drift shows.

    PYTHONPATH=. python tools/sweep_vector_add.py

Times the kernel at several UNROLL depths next to a device copy and cupy.add on 2^28
float32 elements; GB/s count bytes read plus bytes written.
"""
import cupy as cp
import numpy as np

from cuattn._kernels import get_kernel
from cuattn.bench import _time
from cuattn.elementwise import vector_add_instance

N = 1 << 28


def main():
    a, b = (cp.random.standard_normal(N, dtype=cp.float32) for _ in range(2))
    c = cp.empty_like(a)
    nbytes = a.nbytes
    impls = {"device copy": (lambda: cp.cuda.runtime.memcpyAsync(
        c.data.ptr, a.data.ptr, nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
        cp.cuda.get_current_stream().ptr), 2 * nbytes),
        "cupy.add": (lambda: cp.add(a, b, out=c), 3 * nbytes)}
    for unroll in (2, 4, 8):
        fn = get_kernel("vector_add.cu", vector_add_instance(np.float32, unroll))
        blocks = -(-N // 4 // (256 * unroll))
        impls[f"unroll {unroll}"] = (
            lambda fn=fn, blocks=blocks: fn((blocks,), (256,), (a, b, c, np.int64(N))), 3 * nbytes)
    rates = {name: [] for name in impls}
    for _ in range(3):
        for name, (fn, moved) in impls.items():
            rates[name].append(moved / _time(fn, cp) / 1e6)
    copy = np.median(rates["device copy"])
    for name, r in rates.items():
        print(f"{name:12s} " + " ".join(f"{x:7.1f}" for x in r)
              + f"   median {np.median(r):7.1f} GB/s = {100 * np.median(r) / copy:5.1f} % of copy")


if __name__ == "__main__":
    main()
