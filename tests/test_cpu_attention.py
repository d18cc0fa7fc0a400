"""The NumPy backend against the float64 reference, every feature, with the accuracy rule."""
import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from _accuracy import assert_accurate, poison
from _features import FEATURES, feature_kwargs, seed
from hypothesis import given, settings
from hypothesis import strategies as st

import cuattn
from cuattn import _cpu
from cuattn._checks import check_attention
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


def test_one_tile_and_many_tiles_agree_with_the_reference():
    """float32 with the default tiles (this call is one tile) and with forced tiles of every
    kind of edge (partial tiles, tiles wholly inside or outside the band, masked rows)."""
    rng = np.random.default_rng(7)
    q, k, v = _inputs(rng, np.float32, sq=150, sk=200)
    kw = {"mask": rng.random((2, 1, 1, 200)) > 0.2, "causal": True, "window": (90, None),
          "bias": rng.standard_normal((1, 3, 150, 1)).astype(np.float32)}
    ref, ref_lse = attention_reference(q, k, v, **kw)
    naive = naive_attention(q, k, v, **kw)
    call = check_attention(q, k, v, return_lse=True, **kw)
    outs = []
    for block_m, block_n in [(None, None), (64, 48), (7, 5), (150, 1), (1, 200)]:
        out, lse = _cpu.attention_forward(call, block_m=block_m, block_n=block_n)
        assert_accurate(out, ref, naive, what=f"out with tiles {block_m} x {block_n}")
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
        outs.append(out)
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], rtol=1e-5, atol=1e-6)


def test_batch_groups_and_strided_out(monkeypatch):
    """A batch cut into groups (slices of one batch axis), written into a strided ``out``."""
    monkeypatch.setattr(_cpu, "_WHOLE", 4000)  # 37 x 45 scores: two batch entries a group
    rng = np.random.default_rng(8)
    q, k, v = _inputs(rng, np.float32, batch=(3, 5))
    kw = {"mask": rng.random((3, 1, 37, 1)) > 0.1, "softcap": 4.0}
    big = poison(np.empty((3, 5, 37, 32), np.float32))
    out = big[..., ::2]
    got = cuattn.attention(q, k, v, out=out, **kw)
    assert got is out and np.isnan(big[..., 1::2]).all()
    ref, _ = attention_reference(q, k, v, **kw)
    assert_accurate(got, ref, naive_attention(q, k, v, **kw))


def test_numpy_backend_does_not_use_the_reference():
    """The float64 oracle stays off the production path: ``cuattn._cpu`` imports nothing
    from ``cuattn.reference`` and runs with that module made unimportable."""
    source = Path(_cpu.__file__).read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        assert not any("reference" in n for n in names), ast.dump(node)
    script = textwrap.dedent("""
        import importlib, sys
        import numpy as np
        import cuattn, cuattn._cpu
        from cuattn._checks import check_attention
        vars(cuattn).pop("reference", None)
        sys.modules["cuattn.reference"] = None  # any import of it now fails
        cpu = importlib.reload(cuattn._cpu)
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((2, 40, 8)).astype(np.float32) for _ in range(3))
        call = check_attention(q, k, v, causal=True, return_lse=True)
        out, lse = cpu.attention_forward(call, block_m=16, block_n=16)
        grads = cpu.attention_backward(call, np.ones_like(out), out, lse)
        assert all(np.isfinite(g).all() for g in grads)
        print("ok")
    """)
    root = Path(cuattn.__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=root, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
