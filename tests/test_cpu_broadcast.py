"""The NumPy backend with masks and biases that broadcast (size-1 axes in every position,
fewer dims than q) and with broadcast k/v, at sequence lengths of many tiles, forward and
backward, against the float64 references."""
import ml_dtypes
import numpy as np
import pytest
from _accuracy import assert_accurate

import cuattn
from cuattn import _cpu
from cuattn.reference import (
    attention_backward_reference,
    attention_reference,
    naive_attention,
    naive_attention_backward,
)

B, H = 2, 3
SMALL = [(333, 97), (97, 333)]  # with tiny tiles: many tiles and groups, cheap references
LARGE = [(1100, 300), (300, 1100)]
# mask/bias shapes for (B, H, Sq, Sk) scores, written with q = Sq and k = Sk
SHAPES = [
    ("B", 1, "q", "k"),  # per batch entry, shared by heads
    (1, "H", "q", "k"),  # per head
    ("B", "H", 1, "k"),  # key padding per entry and head
    ("B", "H", "q", 1),  # per query row
    ("B", 1, 1, "k"),  # the usual padding mask
    (1, 1, "q", 1),
    ("B", "H", 1, 1),
    ("q", "k"),  # fewer dims than q
    ("q", 1),
    (1, "k"),
    ("H", 1, "k"),
    ("k",),  # one dim: a key mask for every row
    (),  # a scalar
]
DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]


def _shape(spec, sq, sk):
    return tuple({"B": B, "H": H, "q": sq, "k": sk}.get(n, n) for n in spec)


def _tiles(monkeypatch, whole, tile, block_n):
    monkeypatch.setattr(_cpu, "_WHOLE", whole)
    monkeypatch.setattr(_cpu, "_TILE", tile)
    monkeypatch.setattr(_cpu, "_BLOCK_N", block_n)


@pytest.fixture
def tiny_tiles(monkeypatch):
    """Tiles of 40 keys and 51 rows, one batch entry per group: a call of a few hundred keys
    runs many tiles and groups, with partial tiles at both ends."""
    _tiles(monkeypatch, 1 << 12, 1 << 11, 40)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 96 keys and 170 rows: the default thresholds would take 1100 x 300 whole."""
    _tiles(monkeypatch, 1 << 15, 1 << 14, 96)


def _qkv(rng, dtype, sq, sk, batch_q=(B, H), batch_kv=(B, H), d=16, dv=8):
    q = rng.standard_normal(batch_q + (sq, d)).astype(dtype)
    k = rng.standard_normal(batch_kv + (sk, d)).astype(dtype)
    v = rng.standard_normal(batch_kv + (sk, dv)).astype(dtype)
    return q, k, v


def _check(q, k, v, kw, rng, what=""):
    """Forward (out and lse) and backward of the NumPy backend against the references."""
    out, lse = cuattn.attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = attention_reference(q, k, v, **kw)
    assert_accurate(out, ref, naive_attention(q, k, v, **kw), what=f"out {what}")
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite) and np.all(lse[~finite] == -np.inf)
    tol = 1e-10 if q.dtype == np.float64 else 2e-4
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=tol, atol=tol)
    dout = rng.standard_normal(out.shape).astype(q.dtype)
    got = cuattn.attention_backward(dout, q, k, v, out, lse, **kw)
    want = attention_backward_reference(dout, q, k, v, **kw)
    naive = naive_attention_backward(dout, q, k, v, **kw)
    for name, x, g, w, n in zip("qkv", (q, k, v), got, want, naive):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert_accurate(g, w, n, factor=3.0, what=f"d{name} {what}")


@pytest.mark.usefixtures("tiny_tiles")
@pytest.mark.parametrize("sq,sk", SMALL, ids=lambda s: str(s))
@pytest.mark.parametrize("spec", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
@pytest.mark.parametrize("kind", ["mask", "bias"])
def test_broadcast_mask_and_bias(kind, spec, sq, sk):
    rng = np.random.default_rng(SHAPES.index(spec) + 100 * SMALL.index((sq, sk)))
    q, k, v = _qkv(rng, np.float32, sq, sk)
    shape = _shape(spec, sq, sk)
    if kind == "mask":
        extra = np.asarray(rng.random(shape) > 0.2)
        if extra.ndim == 0:
            extra = np.asarray(True)  # a False scalar would mask everything
    else:
        extra = np.asarray(rng.standard_normal(shape)).astype(np.float32)
    _check(q, k, v, {kind: extra}, rng, what=f"{kind} {shape}")


BANDS = [{"causal": True}, {"window": (200, 50)}, {"causal": True, "window": (300, None)},
         {"window": (None, 10)}, {"window": (0, 0)}, {"softcap": 3.0, "window": (90, 90)}]


@pytest.mark.usefixtures("tiny_tiles")
@pytest.mark.parametrize("sq,sk", SMALL, ids=lambda s: str(s))
@pytest.mark.parametrize("band", BANDS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_bands_with_mask_and_bias(band, sq, sk):
    rng = np.random.default_rng(BANDS.index(band))
    q, k, v = _qkv(rng, np.float32, sq, sk)
    kw = dict(band, mask=rng.random((B, 1, 1, sk)) > 0.1,
              bias=rng.standard_normal((1, H, sq, 1)).astype(np.float16))
    _check(q, k, v, kw, rng)


@pytest.mark.usefixtures("tiny_tiles")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_dtypes_with_broadcast_mask_bias_and_gqa(dtype):
    rng = np.random.default_rng(7)
    sq, sk, g = 333, 97, 2
    q, k, v = _qkv(rng, dtype, sq, sk, batch_q=(B, H, g), batch_kv=(B, H, 1))  # GQA
    kw = {"mask": rng.random((B, 1, 1, 1, sk)) > 0.2, "causal": True,
          "bias": rng.standard_normal((sq, 1)).astype(dtype)}
    _check(q, k, v, kw, rng, what=np.dtype(dtype).name)


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("sq,sk", LARGE, ids=lambda s: str(s))
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_long_sequences_with_padding_mask_and_row_bias(dtype, sq, sk):
    rng = np.random.default_rng(LARGE.index((sq, sk)))
    q, k, v = _qkv(rng, dtype, sq, sk, batch_q=(2, 2), batch_kv=(2, 1))
    kw = {"mask": rng.random((2, 1, 1, sk)) > 0.2, "window": (400, 0),
          "bias": rng.standard_normal((1, 2, sq, 1)).astype(np.float32)}
    _check(q, k, v, kw, rng)


@pytest.mark.usefixtures("tiny_tiles")
def test_broadcast_batch_of_q_and_kv_with_wider_mask():
    """q and k/v broadcast against each other, and the mask adds a batch axis of its own."""
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, H, 97, 16)).astype(np.float32)
    k = rng.standard_normal((B, 1, 333, 16)).astype(np.float32)
    v = rng.standard_normal((1, 1, 333, 8)).astype(np.float32)
    mask = rng.random((2, 1, 1, 1, 333)) > 0.3
    _check(q, k, v, {"mask": mask, "window": (250, 30)}, rng)


def test_default_tiles_beyond_one_tile():
    """At the real thresholds: one batch entry's scores exceed ``_WHOLE``, so rows and keys
    are tiled, with a key-padding mask and a per-row bias of size-1 axes (forward only: the
    backward runs the same tiles)."""
    sq, sk = 2100, 2000
    assert sq * sk > _cpu._WHOLE
    rng = np.random.default_rng(9)
    q, k, v = _qkv(rng, np.float32, sq, sk, batch_q=(1,), batch_kv=(1,), d=8, dv=4)
    kw = {"mask": rng.random((1, 1, sk)) > 0.2,
          "bias": rng.standard_normal((sq, 1)).astype(np.float32)}
    out = cuattn.attention(q, k, v, **kw)
    ref, _ = attention_reference(q, k, v, **kw)
    assert_accurate(out, ref, naive_attention(q, k, v, **kw))
