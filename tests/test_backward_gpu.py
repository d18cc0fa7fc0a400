"""GPU backward families against the float64 reference gradients (accuracy rule at 3×),
float64 finite differences, determinism, broadcasting reductions and every mask kind.

Outputs are poisoned: before each backward the memory pool is handed NaN-filled blocks of
the gradients' sizes, so an element that a kernel fails to write shows up as NaN.
"""
import dataclasses

import numpy as np
import pytest
from _accuracy import assert_accurate, to_host
from _gpu_matrix import DTYPES, SIDE_LAYOUTS, SIDE_SHAPES, combos, shape_params, side_layout
from _gpu_matrix import cupy as _cp
from _gpu_matrix import rand as _rand

import cuattn
from cuattn._dispatch import BACKWARD_FAMILIES
from cuattn.attention import _attention_backward
from cuattn.families.sm90 import Sm90BwdTiles
from cuattn.families.sm90_3xf16 import Sm90F16SplitBwdTiles
from cuattn.reference import attention_backward_reference, naive_attention_backward

pytestmark = pytest.mark.gpu
COMBOS = combos(BACKWARD_FAMILIES)
#: keyword arguments a family needs to serve a call (mma_f32 serves precision="tf32" only);
#: the same keywords go to the forward, the reference and the naive yardstick
FAMILY_KW = {f.name: {"precision": f.precisions[0]} for f in BACKWARD_FAMILIES
             if f.precisions and "highest" not in f.precisions}


def _family_kw(family, dtype):
    return FAMILY_KW.get(family, {}) if np.dtype(dtype) == np.float32 else {}


def _poison_pool(*shapes_and_dtypes):
    """Leave NaN-filled blocks of these sizes in CuPy's memory pool for the next allocations."""
    cp = _cp()
    blocks = [cp.full(shape, np.nan, dtype) for shape, dtype in shapes_and_dtypes]
    cp.cuda.get_current_stream().synchronize()
    del blocks


def _backward(family, dout, q, k, v, tiles=None, **kw):
    """Forward on the GPU (default dispatch), then the backward of ``family`` (with
    ``tiles`` instead of its table's when given); host arrays."""
    cp = _cp()
    dev = {n: cp.asarray(x) for n, x in (("q", q), ("k", k), ("v", v))}
    extra = {n: cp.asarray(kw[n]) for n in ("mask", "bias") if n in kw}
    plain = {n: x for n, x in kw.items() if n not in extra}
    out, lse = cuattn.attention(dev["q"], dev["k"], dev["v"], return_lse=True, **plain, **extra)
    _poison_pool(*((x.shape, x.dtype) for x in (q, k, v)),
                 *((np.broadcast_shapes(out.shape[:-2], x.shape[:-2]) + x.shape[-2:],
                    np.float64 if q.dtype == np.float64 else np.float32) for x in (q, k, v)))
    grads = _attention_backward(cp.asarray(dout), dev["q"], dev["k"], dev["v"], out, lse,
                                kernel=family, tiles=tiles, **plain, **extra)
    return [to_host(g) for g in grads]


def _check(family, q, k, v, rng, tiles=None, **kw):
    kw = {**_family_kw(family, q.dtype), **kw}
    shape = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]) + \
        (q.shape[-2], v.shape[-1])
    dout = rng.standard_normal(shape).astype(q.dtype)
    got = _backward(family, dout, q, k, v, tiles, **kw)
    want = attention_backward_reference(dout, q, k, v, **kw)
    naive = naive_attention_backward(dout, q, k, v, **kw)
    for name, x, g, w, n in zip("qkv", (q, k, v), got, want, naive):
        assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
        assert_accurate(g, w, n, factor=3.0, what=f"d{name}")
    return got


@pytest.mark.parametrize("family,dtype,shape", shape_params(BACKWARD_FAMILIES))
def test_shapes(family, dtype, shape):
    sq, sk, d, dv = shape
    rng = np.random.default_rng(sq * 7 + sk)
    b = (1, 2) if sq * sk > 500_000 else (2, 3)
    _check(family, _rand(rng, b + (sq, d), dtype), _rand(rng, b + (sk, d), dtype),
           _rand(rng, b + (sk, dv), dtype), rng)


FEATURES = {
    "causal": lambda rng, sq, sk: {"causal": True},
    "window": lambda rng, sq, sk: {"window": (37, 5)},
    "causal_window": lambda rng, sq, sk: {"causal": True, "window": (64, None)},
    "softcap": lambda rng, sq, sk: {"softcap": 2.5, "scale": 0.3},
    "mask_full": lambda rng, sq, sk: {"mask": rng.random((2, 3, sq, sk)) > 0.4},
    "mask_keypad": lambda rng, sq, sk: {"mask": rng.random((2, 1, 1, sk)) > 0.2},
    "mask_rows_empty": lambda rng, sq, sk: {  # every fifth row sees no key
        "mask": np.broadcast_to((np.arange(sq) % 5 != 0)[:, None], (sq, sk)).copy()},
    "bias_f32": lambda rng, sq, sk: {"bias": rng.standard_normal((3, sq, sk)).astype(np.float32)},
    "bias_bcast_rows": lambda rng, sq, sk: {
        "bias": rng.standard_normal((2, 1, 1, sk)).astype(np.float32)},
    "everything": lambda rng, sq, sk: {
        "causal": True, "window": (90, None), "softcap": 3.0,
        "mask": rng.random((1, 3, sq, sk)) > 0.3,
        "bias": rng.standard_normal((sq, sk)).astype(np.float32)},
}


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("family,dtype", COMBOS)
@pytest.mark.parametrize("sq,sk", [(150, 150), (97, 230), (230, 97)])
def test_features(family, dtype, feature, sq, sk):
    rng = np.random.default_rng(sq + 3 * sk + list(FEATURES).index(feature))
    kw = FEATURES[feature](rng, sq, sk)
    if "bias" in kw and dtype != np.float32:
        kw["bias"] = kw["bias"].astype(dtype)
    _check(family, _rand(rng, (2, 3, sq, 64), dtype), _rand(rng, (2, 3, sk, 64), dtype),
           _rand(rng, (2, 3, sk, 64), dtype), rng, **kw)


@pytest.mark.parametrize("family,dtype", COMBOS)
@pytest.mark.parametrize("layout", SIDE_LAYOUTS)
@pytest.mark.parametrize("sq,sk", SIDE_SHAPES)
def test_mask_and_bias_layouts(family, dtype, layout, sq, sk):
    """Masks and biases staged by 16-byte copies at and off a 16-byte boundary, and one
    loaded element by element (the sm90 kernels' two paths; the others read them in place)."""
    rng = np.random.default_rng(sq + sk + SIDE_LAYOUTS.index(layout))
    host, dev = side_layout(layout, rng, sq, sk, dtype)
    q, k, v = (_rand(rng, (2, 3, s, 64), dtype) for s in (sq, sk, sk))
    kw = _family_kw(family, dtype)
    dout = rng.standard_normal((2, 3, sq, 64)).astype(dtype)
    got = _backward(family, dout, q, k, v, **kw, **dev)
    want = attention_backward_reference(dout, q, k, v, **kw, **host)
    naive = naive_attention_backward(dout, q, k, v, **kw, **host)
    for name, g, w, n in zip("qkv", got, want, naive):
        assert_accurate(g, w, n, factor=3.0, what=f"d{name}")


#: backward families that serve float32 with precision="tf32"
TF32_FAMILIES = [f.name for f in BACKWARD_FAMILIES if "float32" in f.dtypes
                 and (f.precisions is None or "tf32" in f.precisions)]


@pytest.mark.parametrize("family", TF32_FAMILIES)
@pytest.mark.parametrize("feature", ["causal", "window", "softcap", "mask_full", "bias_f32",
                                     "everything"])
@pytest.mark.parametrize("shape", [(203, 203, 64, 64), (113, 257, 128, 128), (40, 50, 64, 24),
                                   (130, 70, 100, 100), (17, 1, 59, 59)])
def test_tf32_precision(family, feature, shape):
    """precision="tf32" gradients against the naive yardstick whose product operands are
    rounded to TF32 (reference.naive_attention_backward), at 3x, on every float32 family."""
    sq, sk, d, dv = shape
    if max(d, dv) > next(f.max_head_dim for f in BACKWARD_FAMILIES if f.name == family):
        pytest.skip(f"head dim beyond the {family} family")
    rng = np.random.default_rng(sq + sk + d + list(FEATURES).index(feature))
    kw = FEATURES[feature](rng, sq, sk)
    _check(family, _rand(rng, (2, 3, sq, d), np.float32), _rand(rng, (2, 3, sk, d), np.float32),
           _rand(rng, (2, 3, sk, dv), np.float32), rng, precision="tf32", **kw)


@pytest.mark.parametrize("family,dtype", COMBOS)
def test_gqa_and_broadcast_gradients_are_summed(family, dtype):
    rng = np.random.default_rng(11)
    q = _rand(rng, (2, 2, 3, 70, 64), dtype)   # (B, Hkv, G, S, D)
    k = _rand(rng, (2, 2, 1, 90, 64), dtype)
    v = _rand(rng, (1, 2, 1, 90, 32), dtype)   # also broadcast over B
    _check(family, q, k, v, rng, causal=True)
    # q broadcast over the batch (one query set against many key sets)
    q = _rand(rng, (1, 40, 64), dtype)
    k, v = _rand(rng, (3, 50, 64), dtype), _rand(rng, (3, 50, 64), dtype)
    _check(family, q, k, v, rng)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gqa_backward_folds_groups_into_rows(dtype, layout, monkeypatch):
    """Default dispatch folds the query groups of a GQA backward into rows (dK and dV
    written once per key head, no reduction), here with a mask per key and a dout of
    another layout (copied to fold), and matches the reference."""
    from cuattn import _split
    cp = _cp()
    rng = np.random.default_rng(21)
    q = _rand(rng, (2, 8, 4, 150, 64), dtype)                # (B, Hkv, G, S, D)
    k, v = _rand(rng, (2, 8, 1, 2200, 64), dtype), _rand(rng, (2, 8, 1, 2200, 48), dtype)
    mask = rng.random((2, 1, 1, 1, 2200)) > 0.2
    dout = _rand(rng, (2, 8, 4, 150, 48), dtype)
    kw = {"precision": "highest"} if np.dtype(dtype) == np.float32 else {}
    qd, kd, vd, maskd = (cp.asarray(x) for x in (q, k, v, mask))
    out, lse = cuattn.attention(qd, kd, vd, mask=maskd, return_lse=True, **kw)
    doutd = cp.asarray(dout)
    if layout == "bshd":
        doutd = cp.ascontiguousarray(doutd.transpose(0, 3, 1, 2, 4)).transpose(0, 2, 3, 1, 4)
    folds = []
    real = _split.fold_backward
    monkeypatch.setattr(_split, "fold_backward",
                        lambda *a: folds.append(real(*a)) or folds[-1])
    got = [to_host(g) for g in cuattn.attention_backward(doutd, qd, kd, vd, out, lse,
                                                         mask=maskd, **kw)]
    assert folds and folds[0] is not None
    want = attention_backward_reference(dout, q, k, v, mask=mask, **kw)
    naive = naive_attention_backward(dout, q, k, v, mask=mask, **kw)
    for name, x, g, w, n in zip("qkv", (q, k, v), got, want, naive):
        assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
        assert_accurate(g, w, n, factor=3.0, what=f"d{name}")


@pytest.mark.parametrize("family,dtype", COMBOS)
def test_strided_views(family, dtype):
    cp = _cp()
    rng = np.random.default_rng(12)
    # (B, S, H, D) arrays passed as (B, H, S, D) views; dout a transposed view too
    qh, kh, vh = (_rand(rng, (2, 77, 3, 64), dtype) for _ in range(3))
    q, k, v = (x.swapaxes(-2, -3) for x in (qh, kh, vh))
    dout_h = _rand(rng, (2, 77, 3, 64), dtype)
    qd, kd, vd = (cp.asarray(x).swapaxes(-2, -3) for x in (qh, kh, vh))
    kw = _family_kw(family, dtype)
    out, lse = cuattn.attention(qd, kd, vd, return_lse=True, causal=True, **kw)
    got = _attention_backward(cp.asarray(dout_h).swapaxes(-2, -3), qd, kd, vd, out, lse,
                              kernel=family, causal=True, **kw)
    dout = dout_h.swapaxes(-2, -3)
    want = attention_backward_reference(dout, q, k, v, causal=True, **kw)
    naive = naive_attention_backward(dout, q, k, v, causal=True, **kw)
    for g, w, n in zip(got, want, naive):
        assert_accurate(g, w, n, factor=3.0)


@pytest.mark.parametrize("family,dtype", COMBOS)
def test_repeated_calls_are_bit_identical(family, dtype):
    cp = _cp()
    rng = np.random.default_rng(13)
    q, k, v = (cp.asarray(_rand(rng, (2, 2, 300, 64), dtype)) for _ in range(3))
    kv = (k[:, :1], v[:, :1])  # broadcast: the reduction path too
    kw = _family_kw(family, dtype)
    for kk, vv in ((k, v), kv):
        out, lse = cuattn.attention(q, kk, vv, return_lse=True, causal=True, **kw)
        dout = cp.asarray(_rand(rng, out.shape, dtype))
        first = [to_host(g) for g in _attention_backward(dout, q, kk, vv, out, lse,
                                                         kernel=family, causal=True, **kw)]
        for _ in range(20):
            again = _attention_backward(dout, q, kk, vv, out, lse, kernel=family, causal=True,
                                        **kw)
            for a, b in zip(first, again):
                assert a.tobytes() == to_host(b).tobytes()


@pytest.mark.parametrize("band", [{"causal": True}, {"window": (100, 30)}])
@pytest.mark.parametrize("family,dtype", COMBOS)
def test_banded_grids_cover_every_block(family, dtype, band):
    """Under a band the backward grids deal their row blocks (query blocks for dQ, key
    blocks for dK and dV) costliest first within groups of batch entries (block_coords,
    common.cuh): 600 entries of 256 rows make several groups and a partial last one. Every
    gradient element is written (the pool poisoned first), and each entry's gradients are
    bit for bit those of a call on 100 entries."""
    cp = _cp()
    kw = {**_family_kw(family, dtype), **band}
    rng = np.random.default_rng(23)
    q, k, v, dout = (cp.asarray(_rand(rng, (6, 100, 256, 64), dtype)) for _ in range(4))
    out, lse = cuattn.attention(q, k, v, return_lse=True, **kw)
    _poison_pool(*((x.shape, x.dtype) for x in (q, k, v)),
                 *((x.shape, np.float64 if dtype == np.float64 else np.float32)
                   for x in (q, k, v)))
    grads = _attention_backward(dout, q, k, v, out, lse, kernel=family, **kw)
    for g in grads:
        assert not bool(cp.isnan(g).any())
    for i in range(6):
        part = _attention_backward(dout[i:i + 1], q[i:i + 1], k[i:i + 1], v[i:i + 1],
                                   out[i:i + 1], lse[i:i + 1], kernel=family, **kw)
        for a, b in zip(part, grads):
            assert bool(cp.array_equal(a, b[i:i + 1])), i
    sl = (5, slice(90, None))
    host = [to_host(x[sl]) for x in (dout, q, k, v)]
    want = attention_backward_reference(*host, **kw)
    naive = naive_attention_backward(*host, **kw)
    for g, w, n in zip(grads, want, naive):
        assert_accurate(to_host(g[sl]), w, n, factor=3.0)


@pytest.mark.parametrize("family,dtype", COMBOS)
def test_fully_masked_rows_and_empty_inputs(family, dtype):
    cp = _cp()
    rng = np.random.default_rng(14)
    q, k, v = (_rand(rng, (2, 40, 32), dtype) for _ in range(3))
    mask = np.ones((40, 40), bool)
    mask[[3, 17, 39]] = False
    got = _check(family, q, k, v, rng, mask=mask)
    for g in got:
        assert np.isfinite(g.astype(np.float64)).all()
    assert np.all(got[0][:, [3, 17, 39]] == 0)
    # Sk == 0, Sq == 0 and an empty batch: zero gradients of the inputs' shapes
    for qs, ks in (((2, 5, 32), (2, 0, 32)), ((2, 0, 32), (2, 5, 32)), ((0, 5, 32), (1, 5, 32))):
        qd, kd = cp.asarray(_rand(rng, qs, dtype)), cp.asarray(_rand(rng, ks, dtype))
        out, vjp = cuattn.attention_vjp(qd, kd, kd)
        grads = vjp(cp.ones_like(out))
        for g, x in zip(grads, (qd, kd, kd)):
            assert g.shape == x.shape and g.dtype == x.dtype and not cp.any(g)


@pytest.mark.parametrize("family,dtype", COMBOS)
def test_vjp_matches_backward_on_a_stream(family, dtype):
    cp = _cp()
    rng = np.random.default_rng(15)
    q, k, v = (cp.asarray(_rand(rng, (3, 90, 64), dtype)) for _ in range(3))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out, vjp = cuattn.attention_vjp(q, k, v, window=(20, 20))
        dout = cp.ones_like(out)
        a = vjp(dout)
        out2, lse = cuattn.attention(q, k, v, window=(20, 20), return_lse=True)
        b = cuattn.attention_backward(dout, q, k, v, out2, lse, window=(20, 20))
    stream.synchronize()
    for x, y in zip(a, b):
        assert to_host(x).tobytes() == to_host(y).tobytes()


def test_float64_gradients_match_finite_differences():
    """d/dx of L = sum(dout * attention(...)) by central differences in float64."""
    cp = _cp()
    rng = np.random.default_rng(16)
    q, k, v = (rng.standard_normal((2, 6, 5)) for _ in range(3))
    mask = rng.random((6, 6)) > 0.3
    mask[:, 0] = True
    kw = dict(softcap=2.0, scale=0.7, causal=True, window=(3, None))
    dout = rng.standard_normal((2, 6, 5))

    def loss(q_, k_, v_):
        o = cuattn.attention(cp.asarray(q_), cp.asarray(k_), cp.asarray(v_),
                             mask=cp.asarray(mask), **kw)
        return float((to_host(o) * dout).sum())

    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    out, lse = cuattn.attention(qd, kd, vd, mask=cp.asarray(mask), return_lse=True, **kw)
    grads = cuattn.attention_backward(cp.asarray(dout), qd, kd, vd, out, lse,
                                      mask=cp.asarray(mask), **kw)
    eps = 1e-6
    for which, g in enumerate(grads):
        args = [q, k, v]
        numeric = np.zeros_like(args[which])
        for idx in np.ndindex(*args[which].shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            numeric[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(to_host(g), numeric, rtol=1e-6, atol=1e-8)


def test_lse_of_the_wrong_call_is_refused_before_launch():
    cp = _cp()
    q = cp.ones((2, 8, 4), cp.float32)
    out, lse = cuattn.attention(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match="lse must have shape"):
        cuattn.attention_backward(out, q, q, q, out, lse[:, :3])
    with pytest.raises(TypeError, match="host and device arrays cannot be mixed"):
        cuattn.attention_backward(to_host(out), q, q, q, out, lse)


#: Band and mask cases of the sm90 families' forms: short sequences, rows no key reaches,
#: windows, every feature together, a random mask.
BAND_CASES = {
    "plain": (97, 300, {}),
    "causal_rows_without_keys": (300, 97, {"causal": True}),  # query tiles no key reaches
    "window": (300, 300, {"window": (37, 5)}),
    "everything": (150, 260, {"causal": True, "window": (90, None), "softcap": 3.0}),
    "mask": (200, 200, {"mask": "random"}),
}


def _needs_sm90():
    if _cp().cuda.Device().compute_capability != "90":
        pytest.skip("the sm90 family runs on sm_90 only")


#: The sm90 family's overlapped forms (three stages; the next tile's S and dP issued before
#: this tile's gradient products), forced through explicit tiles, beside the same tiles
#: without them.
OVERLAP_TILES = {64: (Sm90BwdTiles(64, 64, 2, 3, dkdv_overlap=True, dq_overlap=True),
                      Sm90BwdTiles(64, 64, 2, 3)),
                 128: (Sm90BwdTiles(32, 64, dkdv_overlap=True, dq_overlap=True),
                       Sm90BwdTiles(32, 64))}
OVERLAP_CASES = {**BAND_CASES, "long": (1100, 1100, {}),
                 "long_causal": (1100, 1300, {"causal": True})}


@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("case", OVERLAP_CASES)
@pytest.mark.parametrize("dtype", [p for p in DTYPES if np.dtype(p).itemsize == 2],
                         ids=lambda d: np.dtype(d).name)
def test_sm90_overlapped_forms(dtype, head, case):
    """Accurate, and the gradients of the same tiles without the overlap to within two units
    in the last place of T (the same products in the same order; the two instances' code
    may contract a multiply and an add differently: at bf16 B4 H32 S4096 D64, 4 to 25 of
    33 million elements differed, by at most 2.4e-4 in gradients up to 0.41), over the
    band and mask cases and long ones (many query and key tiles: every stage
    of the ring refilled many times)."""
    _needs_sm90()
    overlap, plain = OVERLAP_TILES[head]
    _check_sm90_form(dtype, head, case, overlap, plain, seed=1)


def _check_sm90_form(dtype, head, case, tiles, base, seed):
    """One OVERLAP_CASES case of the sm90 backward at ``tiles``: accurate, and its gradients
    within two units in the last place of T of those at ``base`` (tiles that do the same
    arithmetic)."""
    sq, sk, kw = OVERLAP_CASES[case]
    rng = np.random.default_rng(sq + sk + head + seed)
    kw = dict(kw)
    if kw.get("mask") == "random":
        kw["mask"] = rng.random((2, 1, sq, sk)) > 0.3
    q, k, v = (_rand(rng, (2, 3, s, head), dtype) for s in (sq, sk, sk))
    _check("sm90", q, k, v, rng, tiles=tiles, **kw)
    dout = rng.standard_normal((2, 3, sq, head)).astype(dtype)
    got = _backward("sm90", dout, q, k, v, tiles, **kw)
    want = _backward("sm90", dout, q, k, v, base, **kw)
    ulp = 2.0 ** (-10 if np.dtype(dtype) == np.float16 else -7)
    for name, g, w in zip("qkv", got, want):
        g, w = g.astype(np.float32), w.astype(np.float32)
        assert np.abs(g - w).max() <= 2 * ulp * np.abs(w).max(), f"d{name}"


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "plain"])
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("case", OVERLAP_CASES)
@pytest.mark.parametrize("dtype", [p for p in DTYPES if np.dtype(p).itemsize == 2],
                         ids=lambda d: np.dtype(d).name)
def test_sm90_dkdv_stats_ahead(dtype, case, head, overlap):
    """The dK/dV kernel that loads each query tile's lse and delta a request ahead
    (dkdv_stats_ahead): accurate, and the gradients of the same tiles without it to within
    two units in the last place of T (the same arithmetic; as for the overlapped forms, the
    two instances' code may contract differently), over the band and mask cases and the
    long ones (both forms' stages refilled many times)."""
    _needs_sm90()
    base = OVERLAP_TILES[head][0 if overlap else 1]
    _check_sm90_form(dtype, head, case, dataclasses.replace(base, dkdv_stats_ahead=True), base,
                     seed=7)


#: The sm90_3xf16 backward's forms: one and two warpgroups, plain and overlapped, dK and dV
#: in one block, in separate blocks (roles 2) or in the two warpgroups of one block (roles
#: 3, P^T handed from one to the other), with and without the staggered score products, at
#: head dims 64 and 128 (where the table takes the role forms), over the band and mask cases
#: and long ones.
SM90_3XF16_TILES = [
    Sm90F16SplitBwdTiles(32, 64, dkdv_overlap=True, dq_overlap=True, dkdv_warpgroups=2,
                         dq_warpgroups=2),
    Sm90F16SplitBwdTiles(32, 32),
    Sm90F16SplitBwdTiles(32, 32, dkdv_warpgroups=2, dq_warpgroups=2, dkdv_roles=2),
    Sm90F16SplitBwdTiles(32, 32, dkdv_overlap=True, dkdv_warpgroups=2, dq_warpgroups=2,
                         dkdv_roles=3),
    Sm90F16SplitBwdTiles(32, 32, dkdv_warpgroups=2, dkdv_roles=3),
    Sm90F16SplitBwdTiles(32, 64, dkdv_overlap=True, dq_overlap=True, dkdv_warpgroups=2,
                         dq_warpgroups=2, dkdv_stagger=True, dq_stagger=True),
    Sm90F16SplitBwdTiles(32, 32, dkdv_overlap=True, dkdv_warpgroups=2, dq_warpgroups=2,
                         dkdv_roles=3, dkdv_stagger=True, dq_stagger=True)]


@pytest.mark.parametrize("case", OVERLAP_CASES)
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("tiles", SM90_3XF16_TILES, ids=str)
def test_sm90_3xf16_tiles(tiles, head, case):
    _needs_sm90()
    if head == 128 and tiles.dkdv_roles == 1:
        pytest.skip("dK and dV of one block exceed the registers at head dim 128")
    sq, sk, kw = OVERLAP_CASES[case]
    rng = np.random.default_rng(sq + sk + head)
    if kw.get("mask") == "random":
        kw = {**kw, "mask": rng.random((2, 3, sq, sk)) > 0.3}
    _check("sm90_3xf16", _rand(rng, (2, 3, sq, head), np.float32),
           _rand(rng, (2, 3, sk, head), np.float32), _rand(rng, (2, 3, sk, head), np.float32),
           rng, tiles=tiles, **kw)


@pytest.mark.parametrize("magnitude", [2.0**-60, 1e-3, 1e4, 2.0**60])
def test_sm90_3xf16_scales_follow_the_magnitudes(magnitude):
    """The split's power-of-two scales come from each batch entry's largest magnitudes: q, k,
    v and dout far from 1 (the logits kept of order 1: q scaled by m, k by 1/m), entries of
    different magnitudes in one call and a k of zeros (scale 1) are as accurate as inputs
    of order 1."""
    _needs_sm90()
    rng = np.random.default_rng(11)
    q, k, v = (_rand(rng, (2, 2, 100, 64), np.float32) for _ in range(3))
    m = np.float32(magnitude)
    q[0] *= m
    k[0] /= m
    v[1] *= m
    k[1, 1] = 0.0
    _check("sm90_3xf16", q, k, v, rng)


@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("logits", [16.0, 64.0, 256.0])
def test_sm90_3xf16_pair_with_large_logits(logits, head):
    """The default float32 "highest" pair on Hopper (the sm90_3xf16 forward's out and lse,
    then its backward): q scaled by ``logits`` (peaked softmax rows) stays within the
    accuracy rule, since the backward recomputes the forward's products summed the same way
    (given the lse of a forward that sums them otherwise, it exceeds the bound at these
    sizes)."""
    _needs_sm90()
    rng = np.random.default_rng(3)
    q, k, v = (_rand(rng, (1, 2, 200, head), np.float32) for _ in range(3))
    q *= np.float32(logits)
    _check("sm90_3xf16", q, k, v, rng)
