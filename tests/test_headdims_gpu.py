"""Every head dim from 1 to 256 on every dtype, on the family dispatch picks: the forward at
each D (= Dv), at D != Dv pairs across the padding classes, and the backward at every
padded-tile boundary, against the float64 reference with the output poisoned."""
import itertools

import ml_dtypes
import numpy as np
import pytest
from _accuracy import assert_accurate, to_host
from _gpu_matrix import cupy as _cp

import cuattn
from cuattn.reference import (
    attention_backward_reference,
    attention_reference,
    naive_attention,
    naive_attention_backward,
)

pytestmark = pytest.mark.gpu

#: (id, dtype, precision)
CONFIGS = [("float16", np.float16, None), ("bfloat16", ml_dtypes.bfloat16, None),
           ("float32", np.float32, "highest"), ("tf32", np.float32, "tf32"),
           ("float64", np.float64, None)]
#: every tile boundary of every family's padding (multiples of 8, 16, 32 and 64) and one
#: either side
BOUNDARIES = sorted({1, 2, 3, 7, 8, 9} | {b + e for b in range(16, 257, 16) for e in (-1, 0, 1)
                                          if 1 <= b + e <= 256})
PAIRS = [(d, dv) for d, dv in itertools.product((1, 24, 33, 64, 65, 100, 128, 129, 192, 193,
                                                 256), repeat=2) if d != dv]


def _inputs(rng, dtype, d, dv, sq=37, sk=45):
    q = rng.standard_normal((1, 2, sq, d)).astype(dtype)
    k = rng.standard_normal((1, 2, sk, d)).astype(dtype)
    v = rng.standard_normal((1, 2, sk, dv)).astype(dtype)
    return q, k, v


def _forward_checked(dtype, precision, d, dv, seed, **kw):
    cp = _cp()
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, dtype, d, dv)
    if precision is not None:
        kw["precision"] = precision
    out = cp.full((1, 2, q.shape[-2], dv), np.nan, dtype)  # poisoned: every element written
    res = cuattn.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), out=out, **kw)
    assert res is out
    ref, _ = attention_reference(q, k, v, **kw)
    assert_accurate(to_host(out), ref, naive_attention(q, k, v, **kw), what=f"out D{d} Dv{dv}")


@pytest.mark.parametrize("name,dtype,precision", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("d", range(1, 257))
def test_forward_every_head_dim(name, dtype, precision, d):
    _forward_checked(dtype, precision, d, d, seed=d)


@pytest.mark.parametrize("name,dtype,precision", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("d,dv", PAIRS, ids=[f"{d}x{dv}" for d, dv in PAIRS])
def test_forward_unequal_head_dims(name, dtype, precision, d, dv):
    _forward_checked(dtype, precision, d, dv, seed=1000 * d + dv, causal=True)


@pytest.mark.parametrize("name,dtype,precision", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("d", BOUNDARIES)
def test_backward_at_every_tile_boundary(name, dtype, precision, d):
    cp = _cp()
    rng = np.random.default_rng(d)
    dv = d if d % 3 else max(1, d - 5)  # a third of them with Dv != D
    q, k, v = _inputs(rng, dtype, d, dv)
    kw = {} if precision is None else {"precision": precision}
    dout = rng.standard_normal((1, 2, q.shape[-2], dv)).astype(dtype)
    _, vjp = cuattn.attention_vjp(cp.asarray(q), cp.asarray(k), cp.asarray(v), **kw)
    grads = vjp(cp.asarray(dout))
    refs = attention_backward_reference(dout, q, k, v, **kw)
    naive = naive_attention_backward(dout, q, k, v, **kw)
    for g, r, n, what in zip(grads, refs, naive, ("dq", "dk", "dv")):
        assert g.dtype == dtype
        assert_accurate(to_host(g), r, n, factor=3.0, what=f"{what} D{d} Dv{dv}")
