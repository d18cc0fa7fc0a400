"""The split-key forward (cuattn._split), run through the NumPy backend: every split equals
the one-pass result, and the split is chosen only where it is exact and pays."""
import ml_dtypes
import numpy as np
import pytest
from _accuracy import assert_accurate

from cuattn import _cpu, _split
from cuattn._checks import check_attention
from cuattn.reference import attention_reference, naive_attention

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16, np.dtype(np.float32),
                                   np.dtype(np.float64)], ids=str)
@pytest.mark.parametrize("sq, sk, n, kw", [
    (1, 4099, 2, {}),
    (1, 4096, 8, {"causal": True}),
    (5, 3001, 3, {"causal": True}),
    (4, 2500, 4, {"window": (None, 2)}),
    (3, 2048, 2, {"softcap": 5.0, "scale": 0.2}),
])
def test_split_forward_equals_one_pass(dtype, sq, sk, n, kw):
    rng = np.random.default_rng(sq * sk + n)
    q = rng.standard_normal((2, 2, 3, sq, 16)).astype(dtype)   # GQA: keys broadcast
    k = rng.standard_normal((2, 2, 1, sk, 16)).astype(dtype)
    v = rng.standard_normal((2, 2, 1, sk, 8)).astype(dtype)
    call = check_attention(q, k, v, return_lse=True, **kw)
    out, lse = _split.forward(call, n, _cpu.attention_forward)
    ref, ref_lse = attention_reference(q, k, v, **kw)
    assert out.shape == ref.shape and out.dtype == dtype
    assert_accurate(out, ref, naive_attention(q, k, v, **kw))
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    buf = np.full(out.shape, np.nan, dtype)               # out= of the caller
    call = check_attention(q, k, v, out=buf, **kw)
    got, _ = _split.forward(call, n, _cpu.attention_forward)
    assert got is buf
    np.testing.assert_array_equal(buf, out)


def _call(batch, sq, sk, **kw):
    q = np.zeros(batch + (sq, 8), np.float32)
    k = np.zeros(batch[:-1] + (1, sk, 8), np.float32)
    return check_attention(q, k, k, **kw)


def test_split_count():
    sms = 132
    assert _split.split_count(_call((1, 32), 1, 32768), sms) == 8     # decode: 32 blocks
    assert _split.split_count(_call((1, 32), 1, 4096), sms) == 4      # chunks >= 1024 keys
    assert _split.split_count(_call((8, 32), 1, 32768), sms) == 1     # 256 blocks: enough
    assert _split.split_count(_call((1, 32), 1, 1500), sms) == 1      # too few keys
    assert _split.split_count(_call((1, 4), 16, 65536, causal=True), sms) == 8
    mask = np.ones((1, 32768), bool)
    assert _split.split_count(_call((1, 32), 1, 32768, mask=mask), sms) == 1
    assert _split.split_count(_call((1, 32), 1, 32768, window=(100, 0)), sms) == 1
    # the last chunk must hold the band of every row: 1500 rows, chunks of 1024 keys
    assert _split.split_count(_call((1, 1), 1500, 2500, causal=True), sms) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16, np.dtype(np.float32)], ids=str)
@pytest.mark.parametrize("sq, kw", [(1, {}), (1, {"causal": True}), (4, {"causal": True})])
def test_gpu_decode_shapes_split(dtype, sq, kw, monkeypatch):
    """A decode-shaped call on the GPU takes the split path, and is accurate."""
    import cupy as cp

    import cuattn
    chunks = []
    real = _split.forward
    monkeypatch.setattr(_split, "forward", lambda call, n, run: chunks.append(n) or real(
        call, n, run))
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 4, 2, sq, 64)).astype(dtype)
    k = rng.standard_normal((1, 4, 1, 8192, 64)).astype(dtype)
    v = rng.standard_normal((1, 4, 1, 8192, 64)).astype(dtype)
    out, lse = cuattn.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), return_lse=True,
                                **kw)
    assert chunks and chunks[0] > 1
    ref, ref_lse = attention_reference(q, k, v, **kw)
    assert_accurate(cp.asnumpy(out), ref, naive_attention(q, k, v, **kw))
    np.testing.assert_allclose(cp.asnumpy(lse), ref_lse, rtol=1e-5, atol=1e-5)
