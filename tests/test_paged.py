"""Paged keys and values (block_table) against the dense call on the keys and values the
pages make, and against the float64 reference with the key-length mask."""
import ml_dtypes
import numpy as np
import pytest
from _accuracy import assert_accurate, to_host

import cuattn
from cuattn.reference import attention_reference, lengths_mask, naive_attention

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
PAGE = 4


def _pool(rng, dtype, pages=24, heads=2, d=16, dv=8):
    """Pools of ``pages`` pages, each ``(heads, PAGE, d)`` (values: ``dv``)."""
    return (rng.standard_normal((pages, heads, PAGE, d)).astype(dtype),
            rng.standard_normal((pages, heads, PAGE, dv)).astype(dtype))


def _dense(pool, table):
    """(B, ..., max_pages * PAGE, D): the keys or values each table row names, with zeros
    for the columns that name no page (past the entry's length)."""
    rows = []
    for row in table:
        rows.append(np.concatenate([pool[p] if 0 <= p < len(pool) else np.zeros_like(pool[0])
                                    for p in row], axis=-2))
    return np.stack(rows)


# the columns past each entry's length hold -1 or pages outside the pools: not read
TABLE = np.array([[3, 7, 1, -1, 99],
                  [0, 2, 9, 11, 4],
                  [5, -1, -1, -1, -1],
                  [8, 6, 10, 12, -7]])
LENGTHS = np.array([10, 17, 3, 0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (3, 1), "softcap": 5.0},
                                {"scale": 0.2}], ids=["full", "causal", "window", "scale"])
def test_paged_equals_dense(dtype, kw):
    rng = np.random.default_rng(0)
    kp, vp = _pool(rng, dtype)
    q = rng.standard_normal((4, 2, 3, 16)).astype(dtype)
    lengths = LENGTHS[:, None]  # per table row, broadcast over the heads
    out, lse = cuattn.attention(q, kp, vp, k_lengths=lengths, block_table=TABLE,
                                return_lse=True, **kw)
    k, v = _dense(kp, TABLE), _dense(vp, TABLE)
    dense, dense_lse = cuattn.attention(q, k, v, k_lengths=lengths, return_lse=True, **kw)
    np.testing.assert_array_equal(out, dense)
    np.testing.assert_array_equal(lse, dense_lse)
    window = (-1, 0) if kw.get("causal") else kw.get("window", (-1, -1))
    full = lengths_mask(lengths, (4, 2), 3, k.shape[-2], window)
    ref_kw = {n: x for n, x in kw.items() if n in ("scale", "softcap")}
    ref, ref_lse = attention_reference(q, k, v, mask=full, **ref_kw)
    assert_accurate(out, ref, naive_attention(q, k, v, mask=full, **ref_kw))
    assert not np.any(out[3]) and np.all(lse[3] == -np.inf)  # length 0: rows of 0, -inf


def test_paged_grouped_queries_mask_bias_and_out():
    rng = np.random.default_rng(1)
    kp, vp = (x[:, :, None] for x in _pool(rng, np.float64))  # (pages, Hk, 1, PAGE, D)
    q = rng.standard_normal((4, 2, 3, 1, 16))  # 3 query heads per key head, one row
    keys = TABLE.shape[1] * PAGE
    mask = rng.random((4, 1, 1, 1, keys)) > 0.3
    bias = rng.standard_normal((1, 2, 1, 1, keys))
    lengths = LENGTHS.reshape(4, 1, 1)
    buf = np.full((4, 2, 3, 1, 8), np.nan)
    got = cuattn.attention(q, kp, vp, k_lengths=lengths, block_table=TABLE, mask=mask,
                           bias=bias, causal=True, out=buf)
    assert got is buf
    k, v = _dense(kp, TABLE), _dense(vp, TABLE)
    dense = cuattn.attention(q, k, v, k_lengths=lengths, mask=mask, bias=bias, causal=True)
    np.testing.assert_array_equal(buf, dense)


def test_one_table_row_for_every_entry():
    rng = np.random.default_rng(2)
    kp, vp = _pool(rng, np.float32)
    q = rng.standard_normal((3, 2, 2, 16)).astype(np.float32)
    table = np.array([[4, 2, 7]])  # broadcast over the 3 batch entries
    lengths = np.array([12, 5, 9])[:, None]
    out = cuattn.attention(q, kp, vp, k_lengths=lengths, block_table=table)
    k, v = _dense(kp, table), _dense(vp, table)
    np.testing.assert_array_equal(out, cuattn.attention(q, k, v, k_lengths=lengths))


@pytest.mark.parametrize("kw, exc, text", [
    ({"k_lengths": None}, ValueError, "needs k_lengths"),
    ({"block_table": np.zeros((4,), int)}, ValueError, "2-D"),
    ({"block_table": np.zeros((4, 5), np.float32)}, TypeError, "integer array"),
    ({"block_table": np.where(TABLE == 99, 24, TABLE)}, ValueError,
     r"block_table\[0, 3\] = -1 is not a page"),
    ({"k_lengths": np.array([10, 21, 3, 0])[:, None]}, ValueError, "between 0 and Sk=20"),
    ({"block_table": np.zeros((3, 5), int)}, ValueError,
     r"the table's rows and the pools' leading dims \(3, 2\) .* do not broadcast"),
])
def test_errors(kw, exc, text):
    rng = np.random.default_rng(3)
    kp, vp = _pool(rng, np.float32)
    q = np.ones((4, 2, 1, 16), np.float32)
    table = TABLE.copy()
    table[0, 3] = -1
    args = {"k_lengths": np.array([13, 17, 3, 0])[:, None], "block_table": table}
    args.update(kw)
    if args["k_lengths"] is None:
        del args["k_lengths"]
    with pytest.raises(exc, match=text):
        cuattn.attention(q, kp, vp, **args)


def test_pool_errors():
    rng = np.random.default_rng(4)
    kp, vp = _pool(rng, np.float32)
    q = np.ones((4, 2, 1, 16), np.float32)
    kw = {"k_lengths": LENGTHS[:, None], "block_table": TABLE}
    with pytest.raises(ValueError, match="at least 3 dims"):
        cuattn.attention(q, kp[0, 0], vp, **kw)
    with pytest.raises(ValueError, match="same pages"):
        cuattn.attention(q, kp, vp[:5], **kw)
    with pytest.raises(TypeError, match="v_pages has dtype float64 but q has float32"):
        cuattn.attention(q, kp, vp.astype(np.float64), **kw)
    with pytest.raises(ValueError, match="k_pages has head dim 8 but q has 16"):
        cuattn.attention(q, kp[..., :8], vp, **kw)
    with pytest.raises(ValueError, match="out overlaps v_pages"):
        cuattn.attention(q, kp, vp, out=vp[:4, :, :1, :], **kw)
    with pytest.raises(ValueError, match="at least one page"):
        cuattn.attention(q, kp[:0], vp[:0], k_lengths=np.zeros((4, 1), int),
                         block_table=np.full((4, 2), -1))


def test_device_lengths_zero_the_values_past_them():
    """With device lengths the paged call runs as one masked call over every column: the
    values past each row's longest length are zeroed after the gather, so a column that
    names a page of non-finite values (or -1) cannot reach the output."""
    from cuattn import _paged
    from cuattn._checks_ragged import check_paged
    rng = np.random.default_rng(6)
    kp, vp = _pool(rng, np.float64)
    vp[5] = np.nan  # a page only past the lengths
    table = np.array([[3, 7, 5], [0, 2, 5]])
    q = np.zeros((2, 2, 1, 16))
    paged = check_paged(q, kp, vp, table)
    v = _paged._gather(np, vp, table, 3)
    for lengths in (np.array([[6], [8]]), np.array(8)):
        zeroed = _paged._zero_past(np, v, lengths, paged)
        assert np.isfinite(zeroed).all()
        np.testing.assert_array_equal(zeroed[..., :6, :], v[..., :6, :])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_paged(dtype):
    import cupy as cp
    rng = np.random.default_rng(5)
    pages, page = 40, 64
    kp = rng.standard_normal((pages, 4, page, 64)).astype(dtype)
    vp = rng.standard_normal((pages, 4, page, 64)).astype(dtype)
    table = rng.permutation(pages)[:30].reshape(3, 10)
    lengths = np.array([600, 1, 129])[:, None]
    q = rng.standard_normal((3, 4, 2, 64)).astype(dtype)
    dq, dkp, dvp = (cp.asarray(x) for x in (q, kp, vp))
    k = kp[table].transpose(0, 2, 1, 3, 4).reshape(3, 4, 10 * page, 64)
    v = vp[table].transpose(0, 2, 1, 3, 4).reshape(3, 4, 10 * page, 64)
    full = lengths_mask(lengths, (3, 4), 2, k.shape[-2], (-1, 0))
    ref, _ = attention_reference(q, k, v, mask=full)
    # a host or a device table, host or device lengths
    for t, n in ((table, lengths), (cp.asarray(table), lengths), (table, cp.asarray(lengths))):
        out = cuattn.attention(dq, dkp, dvp, k_lengths=n, block_table=t, causal=True)
        assert isinstance(out, cp.ndarray)
        assert_accurate(to_host(out), ref, naive_attention(q, k, v, mask=full))


def _paged_case(rng, dtype, page, batch, heads_kv, groups, sq, d, pages_per_entry, lengths):
    """Shuffled pools of ``page``-row pages for ``batch`` entries (Hk heads, GQA groups of
    query heads), NaN in every page no entry reaches and in the rows of an entry's last page
    past its length, and the dense keys and values."""
    pages = batch * pages_per_entry + 3
    kp = rng.standard_normal((pages, heads_kv, 1, page, d)).astype(dtype)
    vp = rng.standard_normal((pages, heads_kv, 1, page, d)).astype(dtype)
    table = rng.permutation(pages)[:batch * pages_per_entry].reshape(batch, pages_per_entry)
    unused = np.ones(pages, bool)
    for b, n in enumerate(lengths):
        unused[table[b, :-(-n // page)]] = False
        if n % page:
            kp[table[b, n // page], ..., n % page:, :] = np.nan
            vp[table[b, n // page], ..., n % page:, :] = np.nan
    kp[unused], vp[unused] = np.nan, np.nan
    q = rng.standard_normal((batch, heads_kv, groups, sq, d)).astype(dtype)
    k = np.concatenate([kp[table[:, j]] for j in range(pages_per_entry)], axis=-2)
    v = np.concatenate([vp[table[:, j]] for j in range(pages_per_entry)], axis=-2)
    return q, kp, vp, table, k, v


def _zeroed(x):
    """x with its NaN entries set to 0 (np.nan_to_num leaves bfloat16 NaN as it is)."""
    y = x.copy()
    y[np.isnan(y)] = 0
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES[:2], ids=str)
@pytest.mark.parametrize("page, d, groups, sq, causal", [
    (128, 128, 4, 1, False),    # GQA decoding: folded groups, split keys
    (256, 64, 1, 1, False),
    (128, 80, 2, 3, True),      # the mma family (head dim past the sm90 per-block's)
    (256, 256, 1, 1, False),
    (128, 128, 1, 200, True),   # prefill against a paged prefix
    (512, 128, 8, 1, False),
])
def test_gpu_paged_in_place(dtype, page, d, groups, sq, causal):
    """Pages of a multiple of 128 rows are read in place by the 16-bit kernels (PAGED):
    shuffled pages, NaN in every page past the lengths (never read), host and device
    lengths and tables (int32 and int64), a length of 0, against the float64 reference on
    the dense keys the table makes."""
    import cupy as cp

    from cuattn import _paged
    rng = np.random.default_rng(page + d + groups + sq)
    per_entry = -(-5000 // page)
    lengths = np.array([5000, 1, 0, page * 2 + 7, 4096])[:, None, None]
    batch = lengths.shape[0]
    q, kp, vp, table, k, v = _paged_case(rng, dtype, page, batch, 2, groups, sq, d, per_entry,
                                         lengths.ravel())
    full = lengths_mask(lengths, (batch, 2, groups), sq, k.shape[-2],
                        (-1, 0) if causal else (-1, -1))
    ref, ref_lse = attention_reference(q, _zeroed(k), _zeroed(v), mask=full)
    dq, dkp, dvp = (cp.asarray(x) for x in (q, kp, vp))
    seen = []
    real = _paged.in_place
    for t, n in ((table, lengths), (cp.asarray(table, cp.int32), lengths),
                 (table, cp.asarray(lengths, cp.int32)), (cp.asarray(table), cp.asarray(lengths))):
        _paged.in_place = lambda *a: seen.append(real(*a)) or seen[-1]
        try:
            out, lse = cuattn.attention(dq, dkp, dvp, k_lengths=n, block_table=t, causal=causal,
                                        return_lse=True)
        finally:
            _paged.in_place = real
        assert seen[-1] is not None and seen[-1].pages is not None  # read in place
        out, lse = to_host(out), cp.asnumpy(lse)
        assert np.isfinite(out).all()
        assert_accurate(out, ref, naive_attention(q, _zeroed(k), _zeroed(v),
                                                  mask=full))
        assert not np.any(out[2]) and np.all(lse[2] == -np.inf)
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
def test_gpu_paged_small_pages_are_gathered():
    """A page size the kernels do not read in place (not a multiple of 128) runs gathered,
    with the same results."""
    import cupy as cp

    from cuattn import _paged
    rng = np.random.default_rng(9)
    lengths = np.array([300, 17, 64])[:, None, None]
    q, kp, vp, table, k, v = _paged_case(rng, np.float16, 64, 3, 2, 4, 1, 128, 5,
                                         lengths.ravel())
    full = lengths_mask(lengths, (3, 2, 4), 1, k.shape[-2], (-1, -1))
    ref, _ = attention_reference(q, _zeroed(k), _zeroed(v), mask=full)
    seen = []
    real = _paged.in_place
    _paged.in_place = lambda *a: seen.append(real(*a)) or seen[-1]
    try:
        out = cuattn.attention(*(cp.asarray(x) for x in (q, kp, vp)), k_lengths=lengths,
                               block_table=table)
    finally:
        _paged.in_place = real
    assert seen == [None]
    assert_accurate(to_host(out), ref, naive_attention(q, _zeroed(k), _zeroed(v),
                                                       mask=full))


@pytest.mark.parametrize("page, lengths, groups, sq, d, causal, device_table", [
    (128, [4000, 0], 4, 1, 16, False, True),     # folded groups, keys split in 4 chunks
    (256, [700, 256], 1, 5, 16, True, False),    # a host table, no split
    (128, [1, 2100], 2, 1, 16, False, False),    # split in 2 (one chunk axis entry)
    (256, [2500, 0, 300, 2100, 1], 2, 1, 128, False, True),  # the piped instance
])
def test_in_place_on_host_memory(page, lengths, groups, sq, d, causal, device_table,
                                 monkeypatch):
    """Pages of a multiple of 128 rows on the GPU path, through a CuPy stand-in on host
    memory (emulated kernels, tests/_hostdev.py): one launch of a PAGED instance per part
    (and the merge of a split call) reads the pools through the table, NaN in the pages
    past every length; the results are the float64 reference's on the dense keys. The
    piped instance's maps of k and v span the pools: rows within a page, and the pages on
    the batch axis that the parameter block names."""
    from _hostdev import Memory, fake_gpu
    from test_merge import _emulate_merge_parts
    arrays, launches = [], []
    device = fake_gpu(monkeypatch, arrays, launches, np.float16,
                      {"merge": _emulate_merge_parts(Memory(arrays), np.float16)})

    def on_device(a):
        d = device(a.shape, a.dtype)
        d[...] = a
        return d

    rng = np.random.default_rng(page + sq)
    per_entry = -(-max(lengths) // page) + 1
    n = np.array(lengths)
    q, kp, vp, table, k, v = _paged_case(rng, np.float16, page, len(lengths), 2, groups, sq,
                                         d, per_entry, n)
    given = n[:, None, None]
    pools = on_device(kp), on_device(vp)
    out, lse = cuattn.attention(on_device(q), *pools, k_lengths=given,
                                block_table=on_device(table.astype(np.int32))
                                if device_table else table, causal=causal, return_lse=True)
    names = [fn for fn, *_ in launches]
    kernels = [x for x in names if x.startswith("attention_fwd")]
    assert kernels and all(x.endswith(", 3>") for x in kernels), names  # PAGED instances
    assert any("piped" in x for x in kernels) == (d == 128)
    if d == 128:  # the maps of k and v: the pools', (D, page rows, pages on a batch axis)
        for (address, dims, strides, box), pool in zip(device.maps[-2:], pools):
            assert address == pool.__array_interface__["data"][0]
            axis = dims.index(pool.shape[0])
            assert dims[:2] == (d, page) and axis >= 2 and box[1] <= page
            assert strides[0] == pool.strides[-2] and strides[axis - 1] == pool.strides[0]
    full = lengths_mask(given, (len(lengths), 2, groups), sq, k.shape[-2],
                        (-1, 0) if causal else (-1, -1))
    k, v = _zeroed(k), _zeroed(v)
    ref, ref_lse = attention_reference(q, k, v, mask=full)
    assert np.isfinite(np.asarray(out)).all()
    assert_accurate(np.asarray(out), ref, naive_attention(q, k, v, mask=full))
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=1e-4,
                               atol=1e-4)



@pytest.mark.gpu
@pytest.mark.parametrize("paged, table_dtype, lengths_dtype, kept", [
    (True, np.int32, np.int32, True),     # device lengths and table read in place
    (False, None, np.int64, True),        # device lengths over a contiguous cache
    (True, np.int64, np.int32, False),    # a table converted per call: the long way
    (False, None, np.uint16, False),      # lengths converted per call: the long way
])
def test_gpu_repeated_device_lengths(paged, table_dtype, lengths_dtype, kept, monkeypatch):
    """A decoding call with device key lengths (and a device table) whose plan reads them in
    place is validated once: a repeat of its signature replays the plan with its own
    pointers and reads the lengths' new values; where the long way converts the lengths or
    the table, every call takes it. Against the float64 reference at each call's
    lengths."""
    import sys

    import cupy
    module = sys.modules["cuattn.attention"]
    checks = []
    real_check = module.check_attention
    monkeypatch.setattr(module, "check_attention",
                        lambda *a, **k: checks.append(1) or real_check(*a, **k))
    monkeypatch.setattr(sys.modules["cuattn._gpu"], "_repeated", {})
    rng = np.random.default_rng(5)
    page, first = 256, np.array([2100, 300, 1])
    q, kp, vp, table, k, v = _paged_case(rng, np.float16, page, len(first), 2, 4, 1, 128,
                                         -(-first.max() // page) + 1, first)
    lengths = cupy.asarray(first[:, None, None].astype(lengths_dtype))
    if paged:
        args = (cupy.asarray(kp), cupy.asarray(vp))
        kw = {"block_table": cupy.asarray(table.astype(table_dtype))}
    else:
        args = (cupy.asarray(k), cupy.asarray(v))
        kw = {}
    k, v = _zeroed(k), _zeroed(v)
    for n in (first, np.array([1500, 0, 1]), np.array([7, 290, 0])):
        lengths[...] = cupy.asarray(n[:, None, None])  # the cache's lengths, in place
        got = cuattn.attention(cupy.asarray(q), *args, k_lengths=lengths, **kw)
        full = lengths_mask(n[:, None, None], (len(n), 2, 4), 1, k.shape[-2], (-1, -1))
        ref, _ = attention_reference(q, k, v, mask=full)
        assert_accurate(np.nan_to_num(to_host(got).astype(np.float64)), ref,
                        naive_attention(q, k, v, mask=full))
    assert len(checks) == (1 if kept else 3)
