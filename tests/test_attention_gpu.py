"""GPU kernel families against the float64 reference, with the accuracy rule.

Every family × dtype × feature, on ragged shapes, with the output poisoned (NaN) first.
"""
import dataclasses

import ml_dtypes
import numpy as np
import pytest
from _accuracy import assert_accurate, poison, to_host
from _gpu_matrix import SIDE_LAYOUTS, SIDE_SHAPES, combos, shape_params, side_layout
from _gpu_matrix import cupy as _cp
from _gpu_matrix import rand as _rand

from cuattn import _dispatch
from cuattn._checks import check_attention
from cuattn._dispatch import FAMILIES
from cuattn._launch import device_limits as _device_limits
from cuattn.attention import _attention
from cuattn.families import portable, sm90, sm90_tf32
from cuattn.families._common import Request
from cuattn.reference import attention_reference, naive_attention

pytestmark = pytest.mark.gpu
FAMILY_NAMES = [f.name for f in FAMILIES]
COMBOS = combos(FAMILIES)
MAX_HEAD = {f.name: f.max_head_dim for f in FAMILIES}


#: keyword arguments a family needs to serve a call (mma_f32 serves precision="tf32" only);
#: the same keywords go to the reference and to the naive yardstick
FAMILY_KW = {f.name: {"precision": f.precisions[0]} for f in FAMILIES
             if f.precisions and "highest" not in f.precisions}


def _dtype_for(family):
    """float32 where the family serves it, else float16, else float64: for the
    feature-agnostic tests."""
    dtypes = next(f.dtypes for f in FAMILIES if f.name == family)
    return next(d for d in (np.float32, np.float16, np.float64) if np.dtype(d).name in dtypes)


def _run(family, q, k, v, tiles=None, **kw):
    kw = {**FAMILY_KW.get(family, {}), **kw}
    cp = _cp()
    dev = [cp.asarray(x) for x in (q, k, v)]
    extra = {n: cp.asarray(kw.pop(n)) for n in ("mask", "bias") if n in kw}
    out = poison(cp.empty(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
                          + (q.shape[-2], v.shape[-1]), q.dtype))
    got, lse = _attention(*dev, kernel=family, tiles=tiles, out=out, return_lse=True, **kw,
                          **extra)
    assert got is out
    return to_host(got), to_host(lse)


def _check(family, q, k, v, tiles=None, **kw):
    kw = {**FAMILY_KW.get(family, {}), **kw}
    got, lse = _run(family, q, k, v, tiles=tiles, **dict(kw))
    ref, ref_lse = attention_reference(q, k, v, **kw)
    assert_accurate(got, ref, naive_attention(q, k, v, **kw))
    # lse from TF32-rounded q and k carries about 2^-11 of each score's size
    tol = 1e-10 if q.dtype == np.float64 else 1e-2 if kw.get("precision") == "tf32" else 2e-3
    np.testing.assert_allclose(lse, ref_lse, rtol=tol, atol=tol)


@pytest.mark.parametrize("family,dtype,shape", shape_params(FAMILIES))
def test_shapes(family, dtype, shape):
    sq, sk, d, dv = shape
    rng = np.random.default_rng(sq * 7 + sk)
    b = (1, 2) if sq * sk > 500_000 else (2, 3)
    q, k, v = _rand(rng, b + (sq, d), dtype), _rand(rng, b + (sk, d), dtype), \
        _rand(rng, b + (sk, dv), dtype)
    _check(family, q, k, v)


FEATURES = {
    "causal": lambda rng, sq, sk: {"causal": True},
    "window": lambda rng, sq, sk: {"window": (37, 5)},
    "causal_window": lambda rng, sq, sk: {"causal": True, "window": (64, None)},
    "softcap": lambda rng, sq, sk: {"softcap": 2.5, "scale": 0.3},
    "mask_full": lambda rng, sq, sk: {"mask": rng.random((2, 3, sq, sk)) > 0.4},
    "mask_keypad": lambda rng, sq, sk: {"mask": rng.random((2, 1, 1, sk)) > 0.2},
    "mask_rows": lambda rng, sq, sk: {"mask": rng.random((sq, 1)) > 0.2},
    "bias_f32": lambda rng, sq, sk: {"bias": rng.standard_normal((3, sq, sk)).astype(np.float32)},
    "bias_f16": lambda rng, sq, sk: {"bias": rng.standard_normal((sq, sk)).astype(np.float16)},
    "all": lambda rng, sq, sk: {"causal": True, "softcap": 5.0, "window": (90, 0),
                                "mask": rng.random((2, 1, sq, sk)) > 0.1,
                                "bias": rng.standard_normal((1, 3, 1, sk)).astype(np.float64)},
}


@pytest.mark.parametrize("family,dtype", COMBOS)
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("sq,sk", [(203, 203), (113, 257)])
def test_features(family, dtype, feature, sq, sk):
    rng = np.random.default_rng(sq + sk)
    d = 64
    q, k, v = _rand(rng, (2, 3, sq, d), dtype), _rand(rng, (2, 3, sk, d), dtype), \
        _rand(rng, (2, 3, sk, d), dtype)
    _check(family, q, k, v, **FEATURES[feature](rng, sq, sk))


@pytest.mark.parametrize("family,dtype", COMBOS)
@pytest.mark.parametrize("layout", SIDE_LAYOUTS)
@pytest.mark.parametrize("sq,sk", SIDE_SHAPES)
def test_mask_and_bias_layouts(family, dtype, layout, sq, sk):
    """Masks and biases staged by 16-byte copies at and off a 16-byte boundary, and one
    loaded element by element (the sm90 kernels' two paths; the others read them in place)."""
    rng = np.random.default_rng(sq + sk + SIDE_LAYOUTS.index(layout))
    host, dev = side_layout(layout, rng, sq, sk, dtype)
    q, k, v = (_rand(rng, (2, 3, s, 64), dtype) for s in (sq, sk, sk))
    kw = FAMILY_KW.get(family, {})
    got, _ = _run(family, q, k, v, **kw, **dev)
    ref, _ = attention_reference(q, k, v, **kw, **host)
    assert_accurate(got, ref, naive_attention(q, k, v, **kw, **host))


#: the portable family's warp-tiled forms (attention_fwd_portable_warps: two groups of
#: warps half a tile apart, and all warps in step with 64-key tiles), forced through their
#: tiles for both float types (the table gives them float64 with head dims to 64)
WARPS_TILES = [portable.Tiles(128, 32, 64, 64, 1, warps=True),
               portable.Tiles(128, 64, 64, 64, 1, warps=True, lockstep=True)]


@pytest.mark.parametrize("tiles", WARPS_TILES, ids=["groups32", "lockstep64"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("feature", ["plain", *FEATURES])
@pytest.mark.parametrize("shape", [(203, 203, 64, 64), (113, 257, 32, 32), (40, 50, 64, 24),
                                   (17, 1, 59, 59), (1025, 1023, 64, 64), (300, 5, 64, 32)])
def test_portable_warps(tiles, dtype, feature, shape):
    """The warp-tiled forms over every feature on ragged shapes: accurate against the float64
    reference (output poisoned first), and a NaN in one query row stays in that row."""
    sq, sk, d, dv = shape
    rng = np.random.default_rng(sq + 7 * sk + d)
    kw = FEATURES[feature](rng, sq, sk) if feature != "plain" else {}
    q, k, v = _rand(rng, (2, 3, sq, d), dtype), _rand(rng, (2, 3, sk, d), dtype), \
        _rand(rng, (2, 3, sk, dv), dtype)
    _check("portable", q, k, v, tiles=tiles, **kw)
    if feature == "plain":
        q[1, 2, sq // 2, 3] = np.nan
        got, _ = _run("portable", q, k, v, tiles=tiles)
        bad = np.isnan(got).any(axis=-1)
        assert bad[1, 2, sq // 2] and bad.sum() == 1


@pytest.mark.parametrize("tiles", WARPS_TILES, ids=["groups32", "lockstep64"])
@pytest.mark.parametrize("profile", ["rising", "falling", "mixed", "huge"])
@pytest.mark.parametrize("causal", [False, True])
def test_portable_warps_stale_max(tiles, profile, causal):
    """float64's stale row max (LAZY_LOG2 in attention_portable.cu): keys that drift along
    one dimension raise a row's max tile after tile (the exact step each time) or keep the
    first tile's max (the stale path throughout), by the sign of the query there; mixed rows
    take both paths within one warp, and queries scaled by 100 give scores whose maxima
    jump past the stale range often."""
    rng = np.random.default_rng(len(profile) + causal)
    sq, sk, d = 300, 1000, 64
    q, k, v = (rng.standard_normal((1, 2, s, d)) for s in (sq, sk, sk))
    # keys drift along dimension 0 (about 20 log2 units of score per 64-key tile); a query's
    # sign there says whether its scores rise or fall along the keys
    k[..., 0] += np.linspace(0.0, 600.0, sk)
    sign = {"rising": 1.0, "falling": -1.0, "mixed": np.where(np.arange(sq) % 3, 1.0, -1.0),
            "huge": 0.0}[profile]
    q[..., 0] = 3.0 * sign
    if profile == "huge":
        q = q * 100.0
    _check("portable", q, k, v, tiles=tiles, causal=causal)


#: families that serve float32 with precision="tf32" (sm90_3xf16 serves "highest" only)
TF32_FAMILIES = [f.name for f in FAMILIES if "float32" in f.dtypes
                 and (f.precisions is None or "tf32" in f.precisions)]


@pytest.mark.parametrize("family", TF32_FAMILIES)
@pytest.mark.parametrize("feature", ["plain", "causal", "window", "softcap", "mask_full",
                                     "bias_f32", "all"])
@pytest.mark.parametrize("shape", [(203, 203, 64, 64), (113, 257, 128, 128),
                                   (130, 70, 256, 256), (40, 50, 64, 24), (17, 1, 59, 59)])
def test_tf32_precision(family, feature, shape):
    """precision="tf32" against the naive yardstick whose product operands are rounded to
    TF32 (reference.naive_attention), on every float32 family."""
    sq, sk, d, dv = shape
    if max(d, dv) > MAX_HEAD[family]:
        pytest.skip(f"head dim beyond the {family} family")
    rng = np.random.default_rng(sq + sk + d)
    kw = FEATURES[feature](rng, sq, sk) if feature != "plain" else {}
    q, k, v = _rand(rng, (2, 3, sq, d), np.float32), _rand(rng, (2, 3, sk, d), np.float32), \
        _rand(rng, (2, 3, sk, dv), np.float32)
    _check(family, q, k, v, precision="tf32", **kw)


#: variants of the piped sm90_tf32 instance besides the table's: other warpgroups, key
#: tiles and slots, Q from shared memory
PIPED_VARIANTS = [{}, {"block_m": 128, "block_n": 64, "slots": 2, "qreg": True},
                  {"block_m": 192, "block_n": 64, "slots": 2, "qreg": False}]


@pytest.mark.parametrize("variant", PIPED_VARIANTS)
@pytest.mark.parametrize("feature", ["plain", "causal", "window", "softcap", "mask_full",
                                     "bias_f32", "all"])
@pytest.mark.parametrize("shape", [(203, 203, 64, 64), (113, 257, 128, 128), (40, 50, 64, 24),
                                   (17, 1, 59, 59), (300, 5, 128, 64), (70, 1030, 64, 64)])
def test_piped_operands(variant, feature, shape):
    """The piped sm90_tf32 instance (K and V^T as tile images made once per call, copied by
    the copy engine for a producer warpgroup) forced through the table's tiles and their
    variants: accurate, and out and lse bit for bit those of the per-block instance with the
    same key tiles and 128-row blocks. With another block height the band (causal, window)
    can make a tile masked for one block and interior for the other, whose score scaling
    rounds differently (mask_scores), so there it is checked for accuracy only."""
    cp = _cp()
    sq, sk, d, dv = shape
    rng = np.random.default_rng(sq + 3 * sk + d)
    kw = {"precision": "tf32", **(FEATURES[feature](rng, sq, sk) if feature != "plain"
                                  else {})}
    q, k, v = _rand(rng, (2, 3, sq, d), np.float32), _rand(rng, (2, 3, sk, d), np.float32), \
        _rand(rng, (2, 3, sk, dv), np.float32)
    tiles = next(c for max_d, c, _ in sm90_tf32.SM90_TF32_TILES if max(d, dv) <= max_d)[0]
    piped = dataclasses.replace(tiles.piped, **variant)
    per_block = dataclasses.replace(tiles, block_m=128, block_n=piped.block_n, prepare_from=0)
    dev = {n: cp.asarray(x) for n, x in kw.items() if n in ("mask", "bias")}
    results = [_attention(*(cp.asarray(x) for x in (q, k, v)), kernel="sm90_tf32",
                          return_lse=True, tiles=t, **{**kw, **dev})
               for t in (per_block, dataclasses.replace(tiles, prepare_from=1, piped=piped))]
    banded = feature in ("causal", "window", "all")
    if piped.block_m == 128 or not banded:
        for a, b in zip(*results):
            assert bool(cp.array_equal(a, b, equal_nan=True))
    ref, _ = attention_reference(q, k, v, **kw)
    assert_accurate(to_host(results[1][0]), ref, naive_attention(q, k, v, **kw))


def test_piped_plans_repeat_and_loop():
    """The piped instance's plans: a repeated signature runs from its kept plan (new tile
    images per call) and gives each call its own result; batch axes that do not collapse
    into three (k and v transposed among four batch axes) run as launch loops, preparation
    included. Each result bit for bit the per-block instance's with the same tiles."""
    cp = _cp()
    family, kw = "sm90_tf32", {"precision": "tf32"}
    per_block = sm90.Sm90Tiles(128, 32)
    piped = dataclasses.replace(per_block, prepare_from=1,
                                piped=sm90_tf32.PipedTiles(128, 32, 2))
    rng = np.random.default_rng(11)
    for attempt in range(3):  # the first call plans, the others repeat it
        q, k, v = (cp.asarray(_rand(rng, (2, 3, 150, 64), np.float32)) for _ in range(3))
        want = _attention(q, k, v, kernel=family, tiles=per_block, causal=True, **kw)
        got = _attention(q, k, v, kernel=family, tiles=piped, causal=True, **kw)
        assert bool(cp.array_equal(want, got)), attempt
    q = cp.asarray(_rand(rng, (2, 3, 2, 3, 70, 64), np.float32))
    k, v = (cp.asarray(_rand(rng, (3, 2, 3, 2, 90, 64), np.float32)).transpose(1, 0, 3, 2, 4, 5)
            for _ in range(2))
    want = _attention(q, k, v, kernel=family, tiles=per_block, **kw)
    got = _attention(q, k, v, kernel=family, tiles=piped, **kw)
    assert bool(cp.array_equal(want, got))
    ref, _ = attention_reference(*(to_host(x) for x in (q, k, v)), **kw)
    assert_accurate(to_host(got), ref, naive_attention(*(to_host(x) for x in (q, k, v)), **kw))


def _fits(tiles, d, dv, mask=None, bias=None):
    """Do the per-block sm90 ``tiles`` fit this device's shared memory with a mask and
    bias like these?"""
    cp = _cp()
    smem = sm90.sm90_smem_bytes(tiles, -(-d // 64) * 64, -(-dv // 64) * 64, mask is not None,
                                0 if bias is None else bias.dtype.itemsize)
    return smem <= cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]


def _sm90_piped_pair(d, dv, mask=None, bias=None):
    """The sm90 piped tiles for head dims (d, dv) as the family picks them (the table's
    first that fit beside this mask and bias staged, else the first that fit without them),
    and the per-block tiles with the same 128-row blocks and key tiles (None past 128,
    where the per-block instance stops)."""
    limit = _cp().cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
    req = Request(np.dtype(np.float16), d, dv, None if bias is None else bias.dtype,
                  mask is not None, True, (9, 0), limit)
    piped, _, _ = sm90.piped_tiles(req)
    per_block = sm90.Sm90Tiles(128, piped.block_n) if max(d, dv) <= 128 else None
    return piped, per_block


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("feature", ["plain", "causal", "window", "softcap", "mask_full",
                                     "mask_keypad", "mask_rows", "bias_f32", "all"])
@pytest.mark.parametrize("shape", [(203, 203, 64, 64), (113, 257, 128, 128), (40, 50, 64, 24),
                                   (300, 5, 128, 64), (70, 1030, 64, 64), (130, 70, 256, 256),
                                   (33, 77, 192, 64), (1, 333, 128, 128)])
def test_sm90_piped_forward(dtype, feature, shape):
    """The piped sm90 instance (tiles by the copy engine through tensor maps, two consumer
    warpgroups taking turns) forced through its table's tiles: accurate on ragged shapes
    with every feature, K and V broadcast over the heads (tensor maps of extent 1 there);
    masks and biases staged by the producer warpgroup (one row of a key-padding mask), or
    read from global memory (a mask of column stride 0; a D256 float32 bias, whose staged
    tiles do not fit);
    where a per-block instance has the same 128-row blocks and key tiles and no short last
    tile (a head dim past 64), out and lse bit for bit its own."""
    cp = _cp()
    sq, sk, d, dv = shape
    rng = np.random.default_rng(sq + 5 * sk + d + dv)
    kw = FEATURES[feature](rng, sq, sk) if feature != "plain" else {}
    q = _rand(rng, (2, 3, sq, d), dtype)
    k, v = _rand(rng, (2, 1, sk, d), dtype), _rand(rng, (2, 1, sk, dv), dtype)
    dev = [cp.asarray(x) for x in (q, k, v)]
    side = {n: cp.asarray(x) for n, x in kw.items() if n in ("mask", "bias")}
    piped, per_block = _sm90_piped_pair(d, dv, **side)
    got = _attention(*dev, kernel="sm90", tiles=piped, return_lse=True, **{**kw, **side})
    ref, ref_lse = attention_reference(q, k, v, **kw)
    assert_accurate(to_host(got[0]), ref, naive_attention(q, k, v, **kw))
    np.testing.assert_allclose(to_host(got[1]), ref_lse, rtol=2e-3, atol=2e-3)
    if per_block is not None and max(d, dv) > 64 and _fits(per_block, d, dv, **side):
        want = _attention(*dev, kernel="sm90", tiles=per_block, return_lse=True,
                          **{**kw, **side})
        for a, b in zip(want, got):
            assert bool(cp.array_equal(a, b, equal_nan=True))


#: the persistent-grid test's features, for its (4, 16) batch: masks and biases staged
#: (rows 16 bytes apart) or read where they lie (a D256 float32 bias)
PERSISTENT_FEATURES = {
    "plain": lambda rng, sq, sk: {},
    "causal": lambda rng, sq, sk: {"causal": True},
    "window": lambda rng, sq, sk: {"window": (37, 5)},
    "mask": lambda rng, sq, sk: {"mask": rng.random((4, 1, sq, sk)) > 0.4},
    "bias": lambda rng, sq, sk: {"bias": rng.standard_normal((16, sq, sk)).astype(np.float32)},
    "all": lambda rng, sq, sk: {"causal": True, "softcap": 5.0, "window": (90, 0),
                                "mask": rng.random((4, 1, sq, sk)) > 0.1,
                                "bias": rng.standard_normal((1, 16, 1, sk)).astype(np.float32)},
}


@pytest.mark.parametrize("feature", list(PERSISTENT_FEATURES))
@pytest.mark.parametrize("shape, tiles", [
    ((600, 352, 64, 64), sm90.Sm90PipedTiles(128, 4, persistent=True)),
    ((600, 352, 128, 128), sm90.Sm90PipedTiles(128, 2, persistent=True)),
    ((600, 352, 128, 128), sm90.Sm90PipedTiles(64, 4, overlap=True, persistent=True)),
    ((300, 200, 256, 256), sm90.Sm90PipedTiles(64, 2, persistent=True))])
def test_sm90_piped_persistent_grid(feature, shape, tiles):
    """The piped sm90 instance on a persistent grid (a block per SM taking the work units
    in turn: 64 entries of 3 to 5 query blocks, several units per block, each unit's Q and
    key tiles continuing the block's ring of slots): the same operations per unit as a
    block per unit, so out and lse bit for bit its own, every row written, and accurate."""
    cp = _cp()
    sq, sk, d, dv = shape
    rng = np.random.default_rng(sq + sk + d + 1)
    kw = PERSISTENT_FEATURES[feature](rng, sq, sk)
    q = _rand(rng, (4, 16, sq, d), ml_dtypes.bfloat16)
    k = _rand(rng, (4, 16, sk, d), ml_dtypes.bfloat16)
    v = _rand(rng, (4, 16, sk, dv), ml_dtypes.bfloat16)
    dev = [cp.asarray(x) for x in (q, k, v)]
    side = {n: cp.asarray(x) for n, x in kw.items() if n in ("mask", "bias")}
    per_unit = dataclasses.replace(tiles, persistent=False)
    want = _attention(*dev, kernel="sm90", tiles=per_unit, return_lse=True, **{**kw, **side})
    out = poison(cp.empty((4, 16, sq, dv), dev[0].dtype))
    got = _attention(*dev, kernel="sm90", tiles=tiles, return_lse=True, out=out,
                     **{**kw, **side})
    for a, b in zip(want, got):
        assert bool(cp.array_equal(a, b, equal_nan=True))
    sel = (3, 15)
    one = {n: np.broadcast_to(x, (4, 16) + x.shape[-2:])[sel] if n in side else x
           for n, x in kw.items()}
    ref, _ = attention_reference(q[sel], k[sel], v[sel], **one)
    assert_accurate(to_host(got[0][sel]), ref, naive_attention(q[sel], k[sel], v[sel], **one))


@pytest.mark.parametrize("feature", ["plain", "causal", "mask_full", "bias_f32", "all"])
@pytest.mark.parametrize("shape, tiles", [
    ((203, 203, 64, 64), sm90.Sm90PipedTiles(128, 4, overlap=True)),
    ((113, 300, 128, 128), sm90.Sm90PipedTiles(64, 4, overlap=True)),
    ((113, 300, 128, 128), sm90.Sm90PipedTiles(128, 2, overlap=True)),
    ((130, 70, 256, 256), sm90.Sm90PipedTiles(64, 2, overlap=True))])
def test_sm90_piped_overlapped_schedule(feature, shape, tiles):
    """The piped sm90 instance with each warpgroup's softmax under its own previous P V
    (pingpong_tiles' OVERLAP): the same operations in the same order as the plain
    schedule, so out and lse bit for bit its own, and accurate."""
    cp = _cp()
    sq, sk, d, dv = shape
    rng = np.random.default_rng(sq + sk + d)
    kw = FEATURES[feature](rng, sq, sk) if feature != "plain" else {}
    q = _rand(rng, (2, 3, sq, d), np.float16)
    k, v = _rand(rng, (2, 3, sk, d), np.float16), _rand(rng, (2, 3, sk, dv), np.float16)
    dev = [cp.asarray(x) for x in (q, k, v)]
    side = {n: cp.asarray(x) for n, x in kw.items() if n in ("mask", "bias")}
    plain = dataclasses.replace(tiles, overlap=False)
    want = _attention(*dev, kernel="sm90", tiles=plain, return_lse=True, **{**kw, **side})
    got = _attention(*dev, kernel="sm90", tiles=tiles, return_lse=True, **{**kw, **side})
    for a, b in zip(want, got):
        assert bool(cp.array_equal(a, b, equal_nan=True))
    ref, _ = attention_reference(q, k, v, **kw)
    assert_accurate(to_host(got[0]), ref, naive_attention(q, k, v, **kw))


def test_sm90_piped_plans_follow_new_addresses_and_loop():
    """The piped sm90 instance's plans: a repeated signature re-encodes the tensor map of
    each input whose address changed (new q, k and v; then a new q beside the same k and
    v) and gives each call its own result; batch axes that do not collapse into three (k
    and v transposed among four batch axes) run as launch loops with maps per launch. Each
    result bit for bit the per-block instance's with the same tiles."""
    cp = _cp()
    piped, per_block = _sm90_piped_pair(128, 128)
    rng = np.random.default_rng(12)
    k = v = None
    for attempt in range(4):  # the first call plans, the others repeat it
        q = cp.asarray(_rand(rng, (2, 3, 150, 128), np.float16))
        if attempt < 3:
            k, v = (cp.asarray(_rand(rng, (2, 3, 190, 128), np.float16)) for _ in range(2))
        want = _attention(q, k, v, kernel="sm90", tiles=per_block, causal=True)
        got = _attention(q, k, v, kernel="sm90", tiles=piped, causal=True)
        assert bool(cp.array_equal(want, got)), attempt
    q = cp.asarray(_rand(rng, (2, 3, 2, 3, 70, 128), np.float16))
    k, v = (cp.asarray(_rand(rng, (3, 2, 3, 2, 90, 128), np.float16)).transpose(1, 0, 3, 2, 4, 5)
            for _ in range(2))
    want = _attention(q, k, v, kernel="sm90", tiles=per_block)
    got = _attention(q, k, v, kernel="sm90", tiles=piped)
    assert bool(cp.array_equal(want, got))
    ref, _ = attention_reference(*(to_host(x) for x in (q, k, v)))
    assert_accurate(to_host(got), ref, naive_attention(*(to_host(x) for x in (q, k, v))))


#: the banded-grid test's variants: every family with its table's tiles, the piped
#: sm90_tf32 instance forced at its short sequences, and the persistent piped sm90 one
BANDED_VARIANTS = [(f, None) for f in FAMILY_NAMES] + [
    ("sm90_tf32", dataclasses.replace(sm90.Sm90Tiles(128, 64), prepare_from=1,
                                      piped=sm90_tf32.PipedTiles(192, 64, 2))),
    ("sm90", sm90.Sm90PipedTiles(128, 4, persistent=True))]


@pytest.mark.parametrize("band", [{"causal": True}, {"window": (100, 30)}])
@pytest.mark.parametrize("family,tiles", BANDED_VARIANTS)
def test_banded_grids_cover_every_block(family, tiles, band):
    """Under a band the grid deals the row blocks costliest first within groups of batch
    entries (block_coords, common.cuh: groups of about 1024 blocks). 600 entries of 256
    query rows make several groups and a partial last one for every row-block height the
    families use (16 to 192 rows): every output row is written (the output poisoned first),
    and each entry's out and lse are bit for bit those of a call on 100 entries (other
    groups, other grid positions)."""
    cp = _cp()
    if tiles is not None and cp.cuda.Device().compute_capability != "90":
        pytest.skip("the piped instances are Hopper's (sm_90)")
    dtype = _dtype_for(family)
    kw = {**FAMILY_KW.get(family, {}), **band}
    rng = np.random.default_rng(21)
    q, k, v = (cp.asarray(_rand(rng, (6, 100, 256, 64), dtype)) for _ in range(3))
    out = poison(cp.empty(q.shape, q.dtype))
    got, lse = _attention(q, k, v, kernel=family, tiles=tiles, out=out, return_lse=True, **kw)
    assert not bool(cp.isnan(got).any()) and not bool(cp.isnan(lse).any())
    for i in range(6):
        part, part_lse = _attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], kernel=family,
                                    tiles=tiles, return_lse=True, **kw)
        assert bool(cp.array_equal(part, got[i:i + 1])), i
        assert bool(cp.array_equal(part_lse, lse[i:i + 1])), i
    ref, _ = attention_reference(*(to_host(x[5, 90:]) for x in (q, k, v)), **kw)
    assert_accurate(to_host(got[5, 90:]), ref,
                    naive_attention(*(to_host(x[5, 90:]) for x in (q, k, v)), **kw))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_long_float32_calls_take_the_piped_instance(causal, d):
    """A float32 "tf32" call with enough query rows for the table's threshold
    (PIPED_FROM_D64 / _D128; twice as many under a band) takes the piped instance of
    sm90_tf32 on Hopper and is accurate."""
    cp = _cp()
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the piped instances are Hopper's (sm_90)")
    precision = "tf32"
    rows = sm90_tf32.PIPED_FROM_D64 if d == 64 else sm90_tf32.PIPED_FROM_D128
    sq = 2 * rows if causal else rows
    rng = np.random.default_rng(sq + d)
    q, k, v = (_rand(rng, (1, 2, sq, d), np.float32) for _ in range(3))
    call = check_attention(*(cp.asarray(x) for x in (q, k, v)), causal=causal,
                              precision=precision)
    cc, limit = _device_limits(cp.cuda.Device().id)
    choice = _dispatch.forward_kernel(call, cc, limit, None, None)
    assert choice.prepare, choice.name_expression
    got = _attention(*(cp.asarray(x) for x in (q, k, v)), causal=causal, precision=precision)
    ref, _ = attention_reference(q, k, v, causal=causal)
    naive = naive_attention(q, k, v, causal=causal, precision=precision)
    assert_accurate(to_host(got), ref, naive)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_fully_masked_rows_give_zero_and_minus_inf(family):
    rng = np.random.default_rng(0)
    q, k, v = (_rand(rng, (2, 70, 64), _dtype_for(family)) for _ in range(3))
    mask = np.ones((70, 70), bool)
    mask[5] = False
    mask[66] = False
    got, lse = _run(family, q, k, v, mask=mask)
    assert np.all(got[:, [5, 66]] == 0) and np.all(lse[:, [5, 66]] == -np.inf)
    assert np.isfinite(got).all()
    got, lse = _run(family, q, k[:, :0], v[:, :0])  # Sk == 0
    assert np.all(got == 0) and np.all(lse == -np.inf)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_nan_input_is_confined_to_its_row(family):
    rng = np.random.default_rng(1)
    q, k, v = (_rand(rng, (2, 130, 64), _dtype_for(family)) for _ in range(3))
    q[1, 77, 3] = np.nan
    rows = [(1, 77)]
    if q.dtype == np.float32:  # NaNs whose bits wrap under a rounding add (0x7fffffff: CUDA's)
        q[0, 5, 3] = np.array(0x7FFFFFFF, np.uint32).view(np.float32)
        q[0, 9, 60] = np.array(0xFFFFFFFF, np.uint32).view(np.float32)
        rows += [(0, 5), (0, 9)]
    got, _ = _run(family, q, k, v)
    bad = np.isnan(got).any(axis=-1)
    assert all(bad[r] for r in rows) and bad.sum() == len(rows)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_strided_views_gqa_and_bshd(family):
    cp = _cp()
    rng = np.random.default_rng(2)
    b, s, hkv, g, d = 2, 150, 2, 4, 64
    dt = _dtype_for(family)
    q_bshd = cp.asarray(_rand(rng, (b, s, hkv * g, d), dt))
    kv = cp.asarray(_rand(rng, (b, s, 2, hkv, d), dt))  # packed k and v
    q = q_bshd.swapaxes(-2, -3).reshape(b, hkv, g, s, d)  # a view? reshape keeps strides
    k = kv[:, :, 0].swapaxes(-2, -3)[:, :, None]  # (b, hkv, 1, s, d), no copy
    v = kv[:, :, 1].swapaxes(-2, -3)[:, :, None]
    assert k.base is not None
    kw = {"causal": True, **FAMILY_KW.get(family, {})}
    got = _attention(q, k, v, kernel=family, **kw)
    qh, kh, vh = (to_host(x) for x in (q, k, v))
    ref, _ = attention_reference(qh, kh, vh, **kw)
    assert_accurate(got, ref, naive_attention(qh, kh, vh, **kw))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_many_batch_axes_and_empty(family):
    cp = _cp()
    rng = np.random.default_rng(3)
    dt = _dtype_for(family)
    q = _rand(rng, (2, 1, 3, 1, 2, 20, 32), dt)
    k = _rand(rng, (1, 2, 1, 2, 1, 30, 32), dt)
    v = _rand(rng, (2, 2, 3, 2, 2, 60, 32), dt)[..., ::2, :]  # strided rows
    kw = FAMILY_KW.get(family, {})
    got = _attention(*(cp.asarray(x) for x in (q, k, v)), kernel=family, **kw)
    ref, _ = attention_reference(q, k, v, **kw)
    assert_accurate(got, ref, naive_attention(q, k, v, **kw))
    empty = _attention(cp.zeros((0, 4, 8, 32), dt), cp.zeros((0, 4, 9, 32), dt),
                       cp.zeros((0, 4, 9, 32), dt), kernel=family, **kw)
    assert empty.shape == (0, 4, 8, 32)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_unaligned_rows_and_offsets(family):
    cp = _cp()
    rng = np.random.default_rng(7)
    dt = _dtype_for(family)
    big = _rand(rng, (2, 3, 140, 72), dt)
    q = cp.asarray(big)[:, :, 1:101, 3:67]  # offset rows and columns: unaligned pointers
    k = cp.asarray(big)[:, :, 2:122, 5:69]
    v = cp.asarray(big)[:, :, 10:130, 1:65]
    kw = {"causal": True, **FAMILY_KW.get(family, {})}
    got = _attention(q, k, v, kernel=family, **kw)
    qh, kh, vh = (to_host(x) for x in (q, k, v))
    ref, _ = attention_reference(qh, kh, vh, **kw)
    assert_accurate(got, ref, naive_attention(qh, kh, vh, **kw))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_runs_on_the_current_stream(family):
    cp = _cp()
    rng = np.random.default_rng(4)
    q, k, v = (_rand(rng, (2, 300, 64), _dtype_for(family)) for _ in range(3))
    stream = cp.cuda.Stream(non_blocking=True)
    kw = FAMILY_KW.get(family, {})
    with stream:
        dq, dk, dv = (cp.asarray(x) for x in (q, k, v))
        got = _attention(dq, dk, dv, kernel=family, **kw)
        host = cp.asnumpy(got, stream=stream)
    stream.synchronize()
    ref, _ = attention_reference(q, k, v, **kw)
    assert_accurate(host, ref, naive_attention(q, k, v, **kw))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_repeated_signature_from_threads(family):
    """Calls of one signature reuse one launch plan (its parameter block with the pointers
    rewritten per call): calls from eight threads on distinct inputs, each thread on its own
    stream, all get their own inputs' result."""
    from concurrent.futures import ThreadPoolExecutor
    cp = _cp()
    rng = np.random.default_rng(5)
    dtype = _dtype_for(family)
    kw = {"causal": True, **FAMILY_KW.get(family, {})}
    inputs = [[_rand(rng, (2, 130, 64), dtype) for _ in range(3)] for _ in range(8)]

    def run(qkv):
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            dev = [cp.asarray(x) for x in qkv]
            results = [_attention(*dev, kernel=family, **kw) for _ in range(20)]
            host = [cp.asnumpy(r, stream=stream) for r in results[-2:]]
        stream.synchronize()
        return host

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(run, inputs))
    for (q, k, v), host in zip(inputs, outs):
        ref, _ = attention_reference(q, k, v, **kw)
        for got in host:
            assert_accurate(got, ref, naive_attention(q, k, v, **kw))


def test_repeated_calls_take_the_short_path():
    """A plain CuPy call whose signature was validated and planned before skips both: its
    results match the long way bit for bit, other data of the signature get their own
    results, and a changed stride, dtype, lse request or bad scalar is not mistaken for it."""
    import cuattn
    from cuattn import _gpu as module
    cp = _cp()
    rng = np.random.default_rng(6)
    q, k, v = (_rand(rng, (2, 3, 70, 64), np.float16) for _ in range(3))
    dq, dk, dv = (cp.asarray(x) for x in (q, k, v))
    module._repeated.clear()
    first = cuattn.attention(dq, dk, dv, causal=True)
    assert len(module._repeated) == 1
    again = cuattn.attention(dq, dk, dv, causal=True)
    np.testing.assert_array_equal(to_host(again), to_host(first))
    long_way = _attention(dq, dk, dv, causal=True)
    np.testing.assert_array_equal(to_host(again), to_host(long_way))
    # other data of the same signature
    q2 = _rand(rng, (2, 3, 70, 64), np.float16)
    got = cuattn.attention(cp.asarray(q2), dk, dv, causal=True)
    ref, _ = attention_reference(q2, k, v, causal=True)
    assert_accurate(to_host(got), ref, naive_attention(q2, k, v, causal=True))
    # lse asked for: a signature of its own
    out, lse = cuattn.attention(dq, dk, dv, causal=True, return_lse=True)
    out2, lse2 = cuattn.attention(dq, dk, dv, causal=True, return_lse=True)
    np.testing.assert_array_equal(to_host(lse2), to_host(lse))
    _, ref_lse = attention_reference(q, k, v, causal=True)
    np.testing.assert_allclose(to_host(lse2), ref_lse, rtol=2e-3, atol=2e-3)
    # the same shape with other strides (a transposed copy viewed back)
    qt = cp.ascontiguousarray(dq.swapaxes(1, 2)).swapaxes(1, 2)
    assert qt.strides != dq.strides
    got = cuattn.attention(qt, dk, dv, causal=True)
    np.testing.assert_array_equal(to_host(got), to_host(first))
    # bad scalars are still refused, before anything runs
    cuattn.attention(dq, dk, dv, scale=0.5)
    with pytest.raises(ValueError, match="scale"):
        cuattn.attention(dq, dk, dv, scale=-0.5)
    with pytest.raises(ValueError, match="precision"):
        cuattn.attention(dq, dk, dv, precision="tf32")
    # an unhashable argument takes the long way
    got = cuattn.attention(dq, dk, dv, causal=True, softcap=cp.asarray(30.0))
    assert got.shape == first.shape
    # masks, biases and windows: their own signatures, their own data per call
    for _ in range(3):
        mask = rng.random((2, 1, 1, 70)) > 0.3
        bias = rng.standard_normal((3, 70, 70)).astype(np.float32)
        kw = {"window": (20, 3), "softcap": 4.0}
        got = cuattn.attention(dq, dk, dv, mask=cp.asarray(mask), bias=cp.asarray(bias), **kw)
        ref, _ = attention_reference(q, k, v, mask=mask, bias=bias, **kw)
        assert_accurate(to_host(got), ref, naive_attention(q, k, v, mask=mask, bias=bias, **kw))
    with pytest.raises(ValueError, match="window"):
        cuattn.attention(dq, dk, dv, mask=cp.asarray(mask), bias=cp.asarray(bias),
                         window=(20.0, 3), softcap=4.0)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_dlpack_inputs_from_torch(family):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    bf16 = "bfloat16" in next(f.dtypes for f in FAMILIES if f.name == family)
    dtype = ml_dtypes.bfloat16 if bf16 else _dtype_for(family)
    tdtype = getattr(torch, np.dtype(dtype).name)
    q, k, v = (torch.randn(2, 4, 100, 64, device="cuda", dtype=tdtype) for _ in range(3))
    kw = {"causal": True, **FAMILY_KW.get(family, {})}
    got = _attention(q, k, v, kernel=family, **kw)
    assert got.dtype == dtype
    qh, kh, vh = (x.double().cpu().numpy().astype(dtype) for x in (q, k, v))
    ref, _ = attention_reference(qh, kh, vh, **kw)
    assert_accurate(got, ref, naive_attention(qh, kh, vh, **kw))


def test_memory_is_out_and_lse_only():
    cp = _cp()
    import cuattn
    q = cp.random.standard_normal((1, 4, 16384, 64), dtype=cp.float32).astype(ml_dtypes.bfloat16)
    pool = cp.cuda.MemoryPool()  # keeps freed blocks: its size is the call's high-water mark
    with cp.cuda.using_allocator(pool.malloc):
        out, lse = cuattn.attention(q, q, q, causal=True, return_lse=True)
        cp.cuda.Device().synchronize()
    assert pool.total_bytes() <= 1.05 * (out.nbytes + lse.nbytes)
    del out, lse


def test_public_attention_on_cupy_is_cupy():
    cp = _cp()
    import cuattn
    x = cp.ones((2, 8, 16), cp.float32)
    y = cuattn.attention(x, x, x)
    assert isinstance(y, cp.ndarray) and y.shape == (2, 8, 16)
    np.testing.assert_allclose(to_host(y), 1.0, rtol=1e-6)
