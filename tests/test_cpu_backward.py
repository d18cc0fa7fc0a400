"""The NumPy backend's backward against the float64 reference gradients (accuracy rule at
3×), its determinism, broadcasting reductions and errors."""
import ml_dtypes
import numpy as np
import pytest
from _accuracy import assert_accurate
from _features import FEATURES, feature_kwargs, seed

import cuattn
from cuattn import _cpu
from cuattn._checks import check_attention
from cuattn.reference import attention_backward_reference, naive_attention_backward

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
def _grads(dtype, sq, sk, kw, rng, batch_q=(2, 3), batch_kv=(2, 3)):
    q = rng.standard_normal(batch_q + (sq, 24)).astype(dtype)
    k = rng.standard_normal(batch_kv + (sk, 24)).astype(dtype)
    v = rng.standard_normal(batch_kv + (sk, 16)).astype(dtype)
    out, lse = cuattn.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    got = cuattn.attention_backward(dout, q, k, v, out, lse, **kw)
    want = attention_backward_reference(dout, q, k, v, **kw)
    naive = naive_attention_backward(dout, q, k, v, **kw)
    return (q, k, v), got, want, naive


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("feature", FEATURES)
def test_backward_matches_reference(dtype, feature):
    rng = np.random.default_rng(seed(feature))
    kw = feature_kwargs(rng, feature, 37, 45)
    inputs, got, want, naive = _grads(dtype, 37, 45, kw, rng)
    for name, x, g, w, n in zip("qkv", inputs, got, want, naive):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert_accurate(g, w, n, factor=3.0, what=f"d{name}")


def test_gqa_gradients_are_summed_over_the_group():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 2, 3, 30, 16)).astype(np.float32)  # (B, Hkv, G, S, D)
    k = rng.standard_normal((2, 2, 1, 30, 16)).astype(np.float32)
    v = rng.standard_normal((2, 2, 1, 30, 16)).astype(np.float32)
    out, vjp = cuattn.attention_vjp(q, k, v, causal=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = vjp(dout)
    assert dk.shape == k.shape and dv.shape == v.shape
    want = attention_backward_reference(dout, q, k, v, causal=True)
    naive = naive_attention_backward(dout, q, k, v, causal=True)
    for g, w, n in zip((dq, dk, dv), want, naive):
        assert_accurate(g, w, n, factor=3.0)


def test_repeated_calls_are_bit_identical():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 70, 32)).astype(np.float32) for _ in range(3))
    out, lse = cuattn.attention(q, k, v, return_lse=True, causal=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    first = cuattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    for _ in range(20):
        again = cuattn.attention_backward(dout, q, k, v, out, lse, causal=True)
        for a, b in zip(first, again):
            assert a.tobytes() == b.tobytes()


def test_fully_masked_rows_and_empty_keys_give_zero_gradients():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((20, 8)) for _ in range(3))
    mask = np.ones((20, 20), bool)
    mask[4] = False
    out, vjp = cuattn.attention_vjp(q, k, v, mask=mask)
    dq, dk, dv = vjp(np.ones_like(out))
    assert np.all(dq[4] == 0) and all(np.isfinite(g).all() for g in (dq, dk, dv))
    out, vjp = cuattn.attention_vjp(q, k[:0], v[:0])
    dq, dk, dv = vjp(np.ones_like(out))
    assert np.all(dq == 0) and dk.shape == (0, 8) and dv.shape == (0, 8)


def test_vjp_matches_backward():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((3, 25, 8)) for _ in range(3))
    out, vjp = cuattn.attention_vjp(q, k, v, window=(5, 5))
    out2, lse = cuattn.attention(q, k, v, window=(5, 5), return_lse=True)
    dout = rng.standard_normal(out.shape)
    np.testing.assert_array_equal(out, out2)
    for a, b in zip(vjp(dout), cuattn.attention_backward(dout, q, k, v, out2, lse,
                                                          window=(5, 5))):
        np.testing.assert_array_equal(a, b)


def test_backward_errors():
    q = np.ones((2, 8, 4), np.float32)
    out, lse = cuattn.attention(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match="dout must have shape"):
        cuattn.attention_backward(out[:, :4], q, q, q, out, lse)
    with pytest.raises(TypeError, match="lse must have dtype float32"):
        cuattn.attention_backward(out, q, q, q, out, lse.astype(np.float64))
    with pytest.raises(ValueError, match="lse must have shape"):
        cuattn.attention_backward(out, q, q, q, out, lse[:, :3])
    with pytest.raises(TypeError, match="dout must be a numpy.ndarray"):
        cuattn.attention_backward(out.tolist(), q, q, q, out, lse)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_many_tiles_match_one_tile_and_the_reference(dtype):
    """Forced tiles (partial ones, tiles on the band's edges and outside it) give the
    gradients of the single-tile run, with a broadcast mask and bias and GQA-style k/v."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 2, 3, 90, 16)).astype(dtype)
    k = rng.standard_normal((2, 2, 1, 70, 16)).astype(dtype)
    v = rng.standard_normal((2, 2, 1, 70, 8)).astype(dtype)
    kw = {"mask": rng.random((2, 1, 1, 1, 70)) > 0.2, "window": (30, 5), "softcap": 2.5,
          "bias": rng.standard_normal((90, 1)).astype(np.float32)}
    call = check_attention(q, k, v, return_lse=True, **kw)
    out, lse = _cpu.attention_forward(call)
    dout = rng.standard_normal(out.shape).astype(dtype)
    want = attention_backward_reference(dout, q, k, v, **kw)
    naive = naive_attention_backward(dout, q, k, v, **kw)
    one = _cpu.attention_backward(call, dout, out, lse)
    for block_m, block_n in [(16, 8), (7, 33), (90, 1)]:
        many = _cpu.attention_backward(call, dout, out, lse, block_m=block_m, block_n=block_n)
        for name, g, g1, w, n in zip("qkv", many, one, want, naive):
            assert_accurate(g, w, n, factor=3.0, what=f"d{name} {block_m} x {block_n}")
            tol = 1e-12 if dtype == np.float64 else 1e-4
            np.testing.assert_allclose(g, g1, rtol=tol, atol=tol)


def test_grouped_broadcast_gradients_are_bit_identical(monkeypatch):
    """Batch groups and tiles with gradients summed over broadcast axes: the same bits
    on every call."""
    monkeypatch.setattr(_cpu, "_WHOLE", 1 << 10)
    monkeypatch.setattr(_cpu, "_TILE", 1 << 9)
    monkeypatch.setattr(_cpu, "_BLOCK_N", 16)
    rng = np.random.default_rng(6)
    q = rng.standard_normal((3, 4, 50, 8)).astype(np.float32)
    k = rng.standard_normal((3, 1, 40, 8)).astype(np.float32)
    v = rng.standard_normal((1, 4, 40, 8)).astype(np.float32)
    kw = {"causal": True, "bias": rng.standard_normal((1, 4, 1, 40)).astype(np.float32)}
    out, lse = cuattn.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    first = cuattn.attention_backward(dout, q, k, v, out, lse, **kw)
    for g, w, n in zip(first, attention_backward_reference(dout, q, k, v, **kw),
                       naive_attention_backward(dout, q, k, v, **kw)):
        assert_accurate(g, w, n, factor=3.0)
    for _ in range(5):
        again = cuattn.attention_backward(dout, q, k, v, out, lse, **kw)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(first, again))
