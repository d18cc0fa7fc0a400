"""The references against independent formulas (SciPy) and finite differences."""
import numpy as np
import pytest
from scipy.special import logsumexp, softmax

from cuattn._checks import check_attention
from cuattn.reference import (
    attention_backward_blocked,
    attention_backward_reference,
    attention_blocked,
    attention_reference,
)

rng = np.random.default_rng(1)


def _rand(*shape):
    return rng.standard_normal(shape)


def _scipy_attention(q, k, v, allowed, scale, bias=0.0, softcap=None):
    s = scale * q @ np.swapaxes(k, -1, -2)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    s = np.where(allowed, s + bias, -np.inf)
    with np.errstate(invalid="ignore"):
        p = np.nan_to_num(softmax(s, axis=-1))
    return p @ v, logsumexp(s, axis=-1)


@pytest.mark.parametrize("sq,sk", [(5, 5), (3, 7), (7, 3)])
def test_causal_is_bottom_right(sq, sk):
    q, k, v = _rand(2, sq, 4), _rand(2, sk, 4), _rand(2, sk, 3)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    allowed = j <= i + (sk - sq)
    out, lse = attention_reference(q, k, v, causal=True)
    want_out, want_lse = _scipy_attention(q, k, v, allowed, 0.5)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


def test_window_mask_bias_softcap():
    q, k, v = _rand(2, 3, 9, 8), _rand(2, 3, 11, 8), _rand(2, 3, 11, 5)
    mask = rng.random((2, 1, 9, 11)) > 0.3
    bias = _rand(3, 9, 11)
    i, j = np.arange(9)[:, None], np.arange(11)[None, :]
    c = i + 2
    allowed = (j >= c - 3) & (j <= c + 1) & mask
    out, lse = attention_reference(q, k, v, window=(3, 1), mask=mask, bias=bias, softcap=1.5,
                                   scale=0.3)
    want_out, want_lse = _scipy_attention(q, k, v, allowed, 0.3, bias, 1.5)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


def test_fully_masked_rows_and_empty_keys():
    q, k, v = _rand(4, 8), _rand(6, 8), _rand(6, 2)
    mask = np.ones((4, 6), bool)
    mask[1] = False
    out, lse = attention_reference(q, k, v, mask=mask)
    assert np.all(out[1] == 0) and lse[1] == -np.inf and np.isfinite(out).all()
    out, lse = attention_reference(q, k[:0], v[:0])
    assert out.shape == (4, 2) and np.all(out == 0) and np.all(lse == -np.inf)


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (2, 3)}, {"softcap": 0.7},
                                {"window": (None, 1), "causal": True}])
def test_blocked_loop_matches_dense(kw):
    q, k, v = _rand(2, 1, 37, 6), _rand(2, 3, 29, 6), _rand(1, 3, 29, 5)
    mask = rng.random((37, 29)) > 0.2
    bias = _rand(2, 1, 37, 29)
    call = check_attention(q, k, v, mask=mask, bias=bias, **kw)
    out, lse = attention_blocked(call, acc_dtype=np.float64, block_m=16, block_n=8)
    ref_out, ref_lse = attention_reference(q, k, v, mask=mask, bias=bias, **kw)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"softcap": 0.9, "window": (2, 1)}])
def test_backward_matches_finite_differences(kw):
    q, k, v = _rand(2, 1, 5, 3), _rand(1, 2, 6, 3), _rand(2, 2, 6, 4)  # broadcast batch
    mask = rng.random((5, 6)) > 0.2
    dout = _rand(2, 2, 5, 4)
    grads = attention_backward_reference(dout, q, k, v, mask=mask, **kw)

    def loss(qq, kk, vv):
        return float((attention_reference(qq, kk, vv, mask=mask, **kw)[0] * dout).sum())

    eps = 1e-6
    for which, (x, g) in enumerate(zip((q, k, v), grads)):
        assert g.shape == x.shape
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            args = [q.copy(), k.copy(), v.copy()]
            args[which][idx] += eps
            plus = loss(*args)
            args[which][idx] -= 2 * eps
            num[idx] = (plus - loss(*args)) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-7)


MASK_BIAS_SHAPES = [((2, 1, 1, 29), (1, 1, 37, 1)), ((37, 1), (2, 3, 1, 29)),
                    ((1, 3, 37, 1), (29,)), ((2, 3, 1, 1), (3, 1, 1))]


@pytest.mark.parametrize("mask_shape,bias_shape", MASK_BIAS_SHAPES, ids=str)
@pytest.mark.parametrize("kw", [{}, {"causal": True, "softcap": 0.8}, {"window": (4, 2)}])
def test_blocked_loops_with_size_one_mask_and_bias_axes(mask_shape, bias_shape, kw):
    """Size-1 axes of a mask or bias are broadcast, not sliced, by the blocked loops, across
    query and key blocks beyond the first."""
    q, k, v = _rand(2, 1, 37, 6), _rand(2, 3, 29, 6), _rand(1, 3, 29, 5)
    mask = rng.random(mask_shape) > 0.2
    bias = _rand(*bias_shape)
    call = check_attention(q, k, v, mask=mask, bias=bias, **kw)
    out, lse = attention_blocked(call, acc_dtype=np.float64, block_m=16, block_n=8)
    ref_out, ref_lse = attention_reference(q, k, v, mask=mask, bias=bias, **kw)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-12)
    dout = _rand(*out.shape)
    grads = attention_backward_blocked(call, dout, out, lse, acc_dtype=np.float64,
                                       block_m=16, block_n=8)
    want = attention_backward_reference(dout, q, k, v, mask=mask, bias=bias, **kw)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_mask_with_more_batch_axes_than_q_and_k():
    q, k, v = _rand(5, 4), _rand(6, 4), _rand(6, 3)
    mask = rng.random((2, 3, 5, 6)) > 0.3
    out, lse = attention_reference(q, k, v, mask=mask)
    assert out.shape == (2, 3, 5, 3) and lse.shape == (2, 3, 5)
    for idx in np.ndindex(2, 3):
        o, l_ = attention_reference(q, k, v, mask=mask[idx])
        np.testing.assert_allclose(out[idx], o, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(l_, lse[idx], rtol=1e-12)
    dout = _rand(2, 3, 5, 3)
    dq, dk, dv = attention_backward_reference(dout, q, k, v, mask=mask)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
