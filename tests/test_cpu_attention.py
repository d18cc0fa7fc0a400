"""The NumPy backend against the float64 reference, every feature, with the accuracy rule."""
import ml_dtypes
import numpy as np
import pytest
from _accuracy import assert_accurate, poison
from _features import FEATURES, feature_kwargs, seed
from hypothesis import given, settings
from hypothesis import strategies as st

import cuattn
from cuattn.reference import attention_reference, naive_attention

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
def _inputs(rng, dtype, batch=(2, 3), sq=37, sk=45, d=24, dv=16):
    q = rng.standard_normal(batch + (sq, d)).astype(dtype)
    k = rng.standard_normal(batch + (sk, d)).astype(dtype)
    v = rng.standard_normal(batch + (sk, dv)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("feature", FEATURES)
def test_cpu_backend_matches_reference(dtype, feature):
    rng = np.random.default_rng(seed(feature))
    q, k, v = _inputs(rng, dtype)
    kw = feature_kwargs(rng, feature, 37, 45)
    out = poison(np.empty((2, 3, 37, 16), dtype))
    got, lse = cuattn.attention(q, k, v, return_lse=True, out=out, **kw)
    assert got is out and lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    ref, ref_lse = attention_reference(q, k, v, **kw)
    naive = naive_attention(q, k, v, **kw)
    assert_accurate(got, ref, naive)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-3 if dtype != np.float64 else 1e-10,
                               atol=1e-3 if dtype != np.float64 else 1e-10)


def test_empty_and_degenerate_shapes():
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, np.float32, batch=(0, 2))
    assert cuattn.attention(q, k, v).shape == (0, 2, 37, 16)
    q, k, v = _inputs(rng, np.float32, sq=0)
    assert cuattn.attention(q, k, v).shape == (2, 3, 0, 16)
    q, k, v = _inputs(rng, np.float32, sk=0)
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_nan_stays_in_its_row():
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng, np.float32)
    q[0, 1, 5, 3] = np.nan
    out = cuattn.attention(q, k, v)
    assert np.isnan(out[0, 1, 5]).all()
    rows = np.isnan(out).any(axis=-1)
    assert rows.sum() == 1


def test_gqa_by_broadcasting_and_bshd_views():
    rng = np.random.default_rng(5)
    b, hkv, g, s, d = 2, 2, 3, 20, 8
    q = rng.standard_normal((b, s, hkv * g, d)).astype(np.float32)  # (B, S, H, D)
    k = rng.standard_normal((b, hkv, 1, s, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, 1, s, d)).astype(np.float32)
    qv = q.swapaxes(-2, -3).reshape(b, hkv, g, s, d)
    out = cuattn.attention(qv, k, v, causal=True)
    ref, _ = attention_reference(qv, k, v, causal=True)
    assert_accurate(out, ref, naive_attention(qv, k, v, causal=True))


def test_multi_head_attention_matches_manual_heads():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 7, 12))
    w = [rng.standard_normal((12, 12)) / 3 for _ in range(4)]
    bias = [rng.standard_normal(12) for _ in range(4)]
    y = cuattn.multi_head_attention(x, *w, num_heads=3, b_q=bias[0], b_k=bias[1],
                                    b_v=bias[2], b_o=bias[3])
    heads = [(x @ w[i] + bias[i]).reshape(2, 7, 3, 4).transpose(0, 2, 1, 3) for i in range(3)]
    att, _ = attention_reference(*heads)
    want = att.transpose(0, 2, 1, 3).reshape(2, 7, 12) @ w[3] + bias[3]
    np.testing.assert_allclose(y, want, rtol=1e-10, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_property_random_shapes_strides_features(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    dtype = data.draw(st.sampled_from([np.float32, np.float64, np.float16]))
    sq, sk = data.draw(st.integers(1, 70)), data.draw(st.integers(0, 70))
    d, dv = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 40))
    hq = data.draw(st.sampled_from([1, 2]))
    q = rng.standard_normal((2, hq, sq, d)).astype(dtype)
    k = rng.standard_normal((1, 2, sk, d)).astype(dtype)
    v_big = rng.standard_normal((2, sk, 1, 2 * dv)).astype(dtype)
    v = v_big[..., ::2].swapaxes(-2, -3)  # strided view (2, 1, sk, dv) with a strided last axis
    kw = {}
    if data.draw(st.booleans()):
        kw["causal"] = True
    if data.draw(st.booleans()):
        kw["window"] = (data.draw(st.integers(-1, 20)), data.draw(st.integers(-1, 20)))
    if data.draw(st.booleans()):
        kw["mask"] = rng.random((sq, 1 if data.draw(st.booleans()) else sk)) > 0.3
    if data.draw(st.booleans()):
        kw["bias"] = rng.standard_normal((2, 1, 1, sk)).astype(np.float32)
    if data.draw(st.booleans()):
        kw["softcap"] = data.draw(st.floats(0.5, 20))
    out = cuattn.attention(q, k, v, **kw)
    ref, _ = attention_reference(q, k, v, **kw)
    assert_accurate(out, ref, naive_attention(q, k, v, **kw))
