"""Threads and streams: 8 threads, each on its own non-blocking stream, running mixed forward
and backward calls give bits identical to the same calls run serially; repeated calls are
bit-identical."""
import threading

import ml_dtypes
import numpy as np
import pytest
from _gpu_matrix import cupy as _cp

import cuattn

pytestmark = pytest.mark.gpu

#: (dtype, (B, H, Sq, Sk, D, Dv), keywords): one call per family the H200 dispatches to
CALLS = [
    (np.float16, (2, 3, 130, 257, 64, 64), {"causal": True}),
    (ml_dtypes.bfloat16, (1, 4, 77, 200, 128, 128), {"window": (30, 10)}),
    (np.float16, (1, 2, 90, 90, 160, 160), {"softcap": 20.0}),
    (np.float32, (2, 2, 100, 150, 64, 64), {"precision": "highest"}),
    (np.float32, (1, 2, 120, 99, 128, 128), {"precision": "tf32", "causal": True}),
    (np.float32, (1, 2, 60, 70, 200, 200), {}),
    (np.float64, (1, 3, 80, 111, 96, 96), {"causal": True}),
    (np.float64, (1, 1, 50, 60, 300, 300), {}),
]


def _inputs(i):
    cp = _cp()
    dtype, (b, h, sq, sk, d, dv), kw = CALLS[i % len(CALLS)]
    rng = np.random.default_rng(i)
    arrays = [cp.asarray(rng.standard_normal(s).astype(dtype))
              for s in ((b, h, sq, d), (b, h, sk, d), (b, h, sk, dv), (b, h, sq, dv))]
    if i % 3 == 0:
        arrays.append(cp.asarray(rng.random((b, 1, 1, sk)) > 0.2))
    return arrays, kw


def _call(i):
    """Forward, then backward, of call i: host copies of out, lse, dq, dk, dv."""
    (q, k, v, dout, *mask), kw = _inputs(i)
    if mask:
        kw = dict(kw, mask=mask[0])
    out, lse = cuattn.attention(q, k, v, return_lse=True, **kw)
    grads = cuattn.attention_backward(dout, q, k, v, out, lse, **kw)
    return [x.get() for x in (out, lse, *grads)]


def _same(a, b):
    return all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


def test_threads_on_their_own_streams_match_serial_calls():
    cp = _cp()
    n_calls = 24
    serial = [_call(i) for i in range(n_calls)]
    results = [None] * n_calls
    errors = []

    def worker(t):
        try:
            with cp.cuda.Stream(non_blocking=True) as stream:
                for i in range(t, n_calls, 8):
                    results[i] = _call(i)  # .get() synchronizes this thread's stream
                stream.synchronize()
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(n_calls):
        assert _same(results[i], serial[i]), f"call {i} differs from its serial run"


def test_repeated_calls_are_bit_identical():
    for i in range(len(CALLS)):
        first = _call(i)
        for _ in range(2):
            assert _same(_call(i), first), f"call {i} is not deterministic"
