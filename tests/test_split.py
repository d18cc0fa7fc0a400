"""The split-key forward (cuattn._split), run through the NumPy backend: every split equals
the one-pass result, and the split is chosen only where it is exact and pays."""
import sys

import ml_dtypes
import numpy as np
import pytest
from _accuracy import assert_accurate

from cuattn import _cpu, _split
from cuattn._checks import check_attention
from cuattn.reference import attention_backward_reference, attention_reference, naive_attention

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16, np.dtype(np.float32),
                                   np.dtype(np.float64)], ids=str)
@pytest.mark.parametrize("sq, sk, n, kw", [
    (1, 4099, 2, {}),
    (1, 4096, 8, {"causal": True}),
    (5, 3001, 3, {"causal": True}),
    (4, 2500, 4, {"window": (None, 2)}),
    (3, 2048, 2, {"softcap": 5.0, "scale": 0.2}),
    (2, 3001, 3, {"mask": (2, 1, 1, 1, 3001), "bias": (2, 1, 1, 3001), "causal": True}),
    (1, 2500, 4, {"mask": (3, 1, 1), "bias": (1, 2500)}),  # broadcast along the keys
])
def test_split_forward_equals_one_pass(dtype, sq, sk, n, kw):
    rng = np.random.default_rng(sq * sk + n)
    q = rng.standard_normal((2, 2, 3, sq, 16)).astype(dtype)   # GQA: keys broadcast
    k = rng.standard_normal((2, 2, 1, sk, 16)).astype(dtype)
    v = rng.standard_normal((2, 2, 1, sk, 8)).astype(dtype)
    kw = dict(kw)
    if "mask" in kw:  # shapes given: about a fifth of the keys masked, a float32 bias
        kw["mask"] = rng.random(kw["mask"]) > 0.2
        kw["bias"] = rng.standard_normal(kw["bias"]).astype(np.float32)
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
    assert _split.split_count(_call((1, 32), 1, 32768), sms) == 9     # decode: 32 blocks
    assert _split.split_count(_call((1, 32), 1, 4096), sms) == 4      # chunks >= 1024 keys
    assert _split.split_count(_call((8, 32), 1, 32768), sms) == 1     # 256 blocks: enough
    assert _split.split_count(_call((1, 32), 1, 1500), sms) == 1      # too few keys
    assert _split.split_count(_call((1, 4), 16, 65536, causal=True), sms) == 64  # at most
    assert _split.split_count(_call((1, 8), 4, 131072), sms) == 33    # GQA B1 Hk8 folded
    mask = np.ones((1, 32768), bool)  # cut into chunks with the keys
    assert _split.split_count(_call((1, 32), 1, 32768, mask=mask), sms) == 9
    assert _split.split_count(_call((1, 32), 1, 32768, window=(100, 0)), sms) == 1
    # the last chunk must hold the band of every row: 1500 rows, chunks of 1024 keys
    assert _split.split_count(_call((1, 1), 1500, 2500, causal=True), sms) == 1


@pytest.mark.parametrize("sk, page", [(32768, 256), (8192, 256), (4096, 128), (2304, 256),
                                      (131072, 128), (5120, 1024)])
def test_split_count_paged(sk, page):
    """Paged keys split into chunks of whole pages, each of the first n - 1 as wide as
    rounding an n-th up to pages gives, the last the rest: never empty, never the widest
    (so no chunk's blocks run longer than the contiguous split's by more than a page)."""
    import dataclasses

    from cuattn._paged import Pages
    call = _call((1, 32), 1, sk)
    table = np.zeros((1, 1, -(-sk // page)), np.int32)
    call = dataclasses.replace(call, pages=Pages(table, page, table.size, 0, 0, 0, 0))
    n = _split.split_count(call, 132)
    assert n >= 2
    width = _split.chunk_width(call, n)
    last = sk - (n - 1) * width
    assert width % page == 0 and 0 < last <= width
    assert width - page < sk // n <= width  # n chunks of about Sk / n keys
    if (sk, page) == (32768, 256):  # 128 pages: 9 chunks, eight of 15 pages and one of 8
        assert (n, width, last) == (9, 3840, 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16, np.dtype(np.float32)], ids=str)
@pytest.mark.parametrize("sq, kw", [(1, {}), (1, {"causal": True}), (4, {"causal": True})])
def test_gpu_decode_shapes_split(dtype, sq, kw, monkeypatch):
    """A decode-shaped call on the GPU takes the split path, and is accurate; so is the
    same signature's next call on other data (the kept plan replayed)."""
    import cupy as cp

    import cuattn
    chunks = []
    real = _split.split_count
    monkeypatch.setattr(_split, "split_count", lambda call, sms: chunks.append(
        real(call, sms)) or chunks[-1])
    rng = np.random.default_rng(3)
    for _ in range(2):
        q = rng.standard_normal((1, 4, 2, sq, 64)).astype(dtype)
        k = rng.standard_normal((1, 4, 1, 8192, 64)).astype(dtype)
        v = rng.standard_normal((1, 4, 1, 8192, 64)).astype(dtype)
        out, lse = cuattn.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v),
                                    return_lse=True, **kw)
        ref, ref_lse = attention_reference(q, k, v, **kw)
        assert_accurate(cp.asnumpy(out), ref, naive_attention(q, k, v, **kw))
        np.testing.assert_allclose(cp.asnumpy(lse), ref_lse, rtol=1e-5, atol=1e-5)
    assert chunks and chunks[0] > 1


def _group_inputs(dtype, sq, sk, layout="bhsd", seed=0):
    """q (2, 3, G=4, Sq, 16) against k, v (2, 3, 1, Sk, ·): keys broadcast over the groups;
    ``bshd`` stores q as (2, Sq, 3, 4, 16) and passes the transposed view."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 3, 4, sq, 16)).astype(dtype)
    if layout == "bshd":
        q = np.ascontiguousarray(q.transpose(0, 3, 1, 2, 4)).transpose(0, 2, 3, 1, 4)
    k = rng.standard_normal((2, 3, 1, sk, 16)).astype(dtype)
    v = rng.standard_normal((2, 3, 1, sk, 8)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), np.dtype(np.float64)], ids=str)
@pytest.mark.parametrize("sq, sk, layout, kw", [
    (1, 300, "bhsd", {}),
    (1, 300, "bshd", {"causal": True}),          # one row: the causal band allows every key
    (3, 300, "bhsd", {"window": (None, 2)}),     # right >= Sq - 1: every key
    (5, 0, "bhsd", {}),                          # no keys: rows of 0, lse -inf
    (7, 129, "bhsd", {"softcap": 5.0, "scale": 0.3, "window": (128, None)}),
])
def test_fold_groups_equals_unfolded(dtype, sq, sk, layout, kw):
    q, k, v = _group_inputs(dtype, sq, sk, layout)
    call = check_attention(q, k, v, return_lse=True, **kw)
    folded = _split.fold_groups(call)
    assert folded is not None and folded.seqlen_q == 4 * sq
    assert folded.batch_shape == (2, 3, 1) and (folded.window_left, folded.window_right) == (-1, -1)
    assert np.shares_memory(folded.q, q)
    out, lse = _cpu.attention_forward(folded)
    out, lse = out.reshape(call.out_shape), lse.reshape(call.lse_shape)
    ref, ref_lse = attention_reference(q, k, v, **kw)
    assert_accurate(out, ref, naive_attention(q, k, v, **kw))
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)
    buf = np.full(call.out_shape, np.nan, dtype)           # out= is written in place
    folded = _split.fold_groups(check_attention(q, k, v, out=buf, **kw))
    got, _ = _cpu.attention_forward(folded)
    assert np.shares_memory(got, buf)
    np.testing.assert_array_equal(buf, out)


@pytest.mark.parametrize("sq", [1, 3])
def test_fold_groups_with_a_mask_and_bias_per_key(sq):
    """A mask and a bias that hold per key (key lengths as a mask, one query row) fold with
    the groups, and the folded call equals the unfolded one."""
    q, k, v = _group_inputs(np.float64, sq, 300)
    rng = np.random.default_rng(sq)
    mask = rng.random((2, 1, 1, 1, 300)) > 0.3
    mask[0, ..., :] = False                                   # entry 0: no key at all
    bias = rng.standard_normal((3, 1, 1, 300))
    call = check_attention(q, k, v, mask=mask, bias=bias, return_lse=True)
    folded = _split.fold_groups(call)
    assert folded is not None and folded.seqlen_q == 4 * sq
    out, lse = _cpu.attention_forward(folded)
    out, lse = out.reshape(call.out_shape), lse.reshape(call.lse_shape)
    ref, ref_lse = attention_reference(q, k, v, mask=mask, bias=bias)
    assert_accurate(out, ref, naive_attention(q, k, v, mask=mask, bias=bias))
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)) and np.isneginf(lse[0]).all()
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-12)


def test_run_folded_into_a_given_lse():
    """A given lse (a view into a larger array, as a ragged call's parts get) takes the
    folded rows' lse in place; one whose G and Sq axes are not one run does not fold."""
    q, k, v = _group_inputs(np.float64, 3, 300)
    call = check_attention(q, k, v, return_lse=True)
    ref_out, ref_lse = attention_reference(q, k, v)

    def run(folded, target):
        out, lse = _cpu.attention_forward(folded)
        target[...] = lse
        return out, target

    whole = np.full((2,) + call.lse_shape, np.nan)
    out, lse = _split.run_folded(call, run, whole[1])
    assert lse is whole[1] or np.shares_memory(lse, whole)
    np.testing.assert_allclose(whole[1], ref_lse, rtol=1e-12)
    assert np.isnan(whole[0]).all()
    assert_accurate(out, ref_out, naive_attention(q, k, v))
    rows_apart = np.zeros(call.lse_shape[:-1] + (4,))[..., :3]   # G stride 4, Sq 3
    assert _split.run_folded(call, run, rows_apart) is None


def test_fold_groups_only_where_exact_and_useful():
    q, k, v = _group_inputs(np.float32, 3, 300)
    fold = _split.fold_groups
    assert fold(check_attention(q, k, v)) is not None
    assert fold(check_attention(q, k, v, causal=True)) is None       # rows see different keys
    assert fold(check_attention(q, k, v, window=(100, None))) is None
    assert fold(check_attention(q, k, v, mask=np.ones((3, 300), bool))) is None  # per row
    assert fold(check_attention(q, k, v, mask=np.ones((4, 1, 300), bool))) is None  # per group
    assert fold(check_attention(q, k, v, bias=np.ones((2, 3, 4, 1, 300), np.float32))) is None
    assert fold(check_attention(q, k, v, mask=np.ones((2, 1, 1, 1, 300), bool))) is not None
    assert fold(check_attention(q, k, v, bias=np.ones((1, 300), np.float32))) is not None
    assert fold(check_attention(q, np.broadcast_to(k, (2, 3, 4, 300, 16)), v)) is None
    wide, kw, vw = _group_inputs(np.float32, 64, 300)                 # a full block of rows
    assert fold(check_attention(wide, kw, vw)) is None
    strided, _, _ = _group_inputs(np.float32, 3, 300, layout="bshd")  # groups not a run
    assert fold(check_attention(strided, k, v)) is None
    copied = fold(check_attention(strided, k, v), copy=True)          # unless copied
    assert copied is not None and not np.shares_memory(copied.q, strided)
    assert fold(check_attention(q[:, :, :1], k, v)) is None           # one group
    one_row = check_attention(q[..., :1, :], k, v, out=np.empty((2, 3, 4, 1, 8),
                                                                np.float32)[..., ::1, :])
    assert fold(one_row) is not None


def test_fold_backward_folds_groups_at_any_length():
    """The backward folds query groups at any Sq (views where the strides allow, copies
    where not), only where exact and where the folded dK/dV grid fills the GPU twice; the
    folded call's gradients, shaped back, are the call's."""
    import cuattn
    q, k, v = _group_inputs(np.float64, 100, 300)          # Sq beyond one block of rows
    rng = np.random.default_rng(9)
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    dout = rng.standard_normal(out.shape)
    call = check_attention(q, k, v)
    folded = _split.fold_backward(call, dout, out, lse, sm_count=9)  # 6 x 3 tiles >= 2 x 9
    assert folded is not None
    fcall, fdout, fout, flse = folded
    assert fcall.seqlen_q == 400 and fcall.batch_shape == (2, 3, 1)
    assert fdout.shape == fout.shape == (2, 3, 1, 400, 8) and flse.shape == (2, 3, 1, 400)
    assert all(np.shares_memory(a, b) for a, b in ((fdout, dout), (fout, out), (flse, lse)))
    grads = _cpu.attention_backward(fcall, fdout, fout, flse)
    want = attention_backward_reference(dout, q, k, v)
    for g, x, w in zip(grads, (q, k, v), want):
        np.testing.assert_allclose(g.reshape(x.shape), w, rtol=1e-10, atol=1e-12)
    strided = np.ascontiguousarray(dout.transpose(0, 3, 1, 2, 4)).transpose(0, 2, 3, 1, 4)
    fdout = _split.fold_backward(call, strided, out, lse, sm_count=9)[1]   # copied
    assert not np.shares_memory(fdout, strided) and np.array_equal(fdout.ravel(), dout.ravel())
    assert _split.fold_backward(call, dout, out, lse, sm_count=10) is None    # 18 < 2 x 10
    causal = check_attention(q, k, v, causal=True)                             # not exact
    assert _split.fold_backward(causal, dout, out, lse, sm_count=1) is None


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64)], ids=str)
@pytest.mark.parametrize("sq", [3, 11])
def test_cpu_result_does_not_depend_on_strides(dtype, sq):
    """Query groups whose strides do not fold (a bshd q, an out= of another layout, a view
    of a larger q) give bit for bit the result of the contiguous call: Dask chunks arrive
    as views in one scheduler and as copies in another."""
    import cuattn
    q, k, v = _group_inputs(dtype, sq, 300, layout="bshd")
    want, want_lse = cuattn.attention(np.ascontiguousarray(q), k, v, return_lse=True)
    got, got_lse = cuattn.attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_lse, want_lse)
    buf = np.full((2, sq, 3, 4, 8), np.nan, dtype).transpose(0, 2, 3, 1, 4)
    assert cuattn.attention(q, k, v, out=buf) is buf
    np.testing.assert_array_equal(buf, want)
    wide = np.repeat(np.ascontiguousarray(q), 2, axis=2)[:, :, ::2]  # G stride 2
    np.testing.assert_array_equal(cuattn.attention(wide, k, v), want)
    ref = attention_reference(q, k, v)[0]
    assert_accurate(got, ref, naive_attention(q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16, np.dtype(np.float32),
                                   np.dtype(np.float64)], ids=str)
@pytest.mark.parametrize("sq, layout, kw", [(1, "bshd", {"causal": True}), (3, "bhsd", {}),
                                            (1, "bhsd", {"softcap": 5.0})])
def test_gpu_folded_groups(dtype, sq, layout, kw):
    """Query groups folded into rows on the GPU: accurate, into out= in place, and the same
    again through the repeated-call path."""
    import cupy as cp

    import cuattn
    q, k, v = _group_inputs(dtype, sq, 300, layout, seed=5)
    assert _split.fold_groups(check_attention(q, k, v, **kw)) is not None
    qd = cp.asarray(np.ascontiguousarray(q.transpose(0, 3, 1, 2, 4))).transpose(0, 2, 3, 1, 4) \
        if layout == "bshd" else cp.asarray(q)
    kd, vd = cp.asarray(k), cp.asarray(v)
    ref, ref_lse = attention_reference(q, k, v, **kw)
    naive = naive_attention(q, k, v, **kw)
    for _ in range(2):  # the second call takes the repeated-call plan
        out, lse = cuattn.attention(qd, kd, vd, return_lse=True, **kw)
        assert out.shape == ref.shape and lse.shape == ref_lse.shape
        assert_accurate(cp.asnumpy(out), ref, naive)
        np.testing.assert_allclose(cp.asnumpy(lse), ref_lse, rtol=1e-5, atol=1e-5)
    buf = cp.full(ref.shape, cp.nan, dtype)
    assert cuattn.attention(qd, kd, vd, out=buf, **kw) is buf
    assert_accurate(cp.asnumpy(buf), ref, naive)


@pytest.mark.parametrize("q_lead, sq, sk, kw", [
    ((1, 2), 1, 4100, {}),                    # decode: 2 blocks on 8 SMs, 4 chunks
    ((1, 2, 3), 1, 4100, {"causal": True}),   # GQA: the 3 query groups fold into rows
    ((1, 2), 4, 4100, {"causal": True, "softcap": 20.0}),
    ((1, 1), 1, 9300, {}),                    # 9 chunks: more than 8 parts in one merge
    ((1, 2), 3, 4100, {"causal": True, "mask": (1, 1, 3, 4100)}),  # a mask in chunks
])
def test_split_plan_replays_on_host_memory(q_lead, sq, sk, kw, monkeypatch):
    """The GPU backend's split-key plan (two part launches and the merge), through a CuPy
    stand-in on host memory: the first call plans it, a repeated call on new arrays replays
    it without validating or planning again, at the new arrays' addresses, and both equal
    the float64 reference; out= takes the same plan's parts into a strided output."""
    from _hostdev import Memory, fake_gpu
    from test_merge import _emulate_merge_parts

    import cuattn
    import cuattn._checks
    import cuattn._gpu

    arrays, launches = [], []
    device = fake_gpu(monkeypatch, arrays, launches, np.float16,
                      {"merge": _emulate_merge_parts(Memory(arrays), np.float16)})
    d = 8
    kv_lead = q_lead[:2] + (1,) * (len(q_lead) - 2)
    rng = np.random.default_rng(sq)

    mask_shape = kw.pop("mask", None)

    def inputs():
        host = [rng.standard_normal(lead + (s, d)).astype(np.float16)
                for lead, s in ((q_lead, sq), (kv_lead, sk), (kv_lead, sk))]
        dev = [x.copy().view(device) for x in host]
        arrays.extend(dev)
        if mask_shape is not None:
            mask = rng.random(mask_shape) > 0.3
            kw["mask"] = mask.copy().view(device)
            arrays.append(kw["mask"])
        return host, dev

    checks = []
    real_check = cuattn._checks.check_attention
    monkeypatch.setattr(sys.modules["cuattn.attention"], "check_attention",
                        lambda *a, **k: checks.append(1) or real_check(*a, **k))
    runs = []
    for _ in range(2):
        launches.clear()
        host, dev = inputs()
        out, lse = cuattn.attention(*dev, return_lse=True, **kw)
        host_kw = {n: np.asarray(x) if n == "mask" else x for n, x in kw.items()}
        ref, ref_lse = attention_reference(*host, **host_kw)
        assert out.shape == ref.shape and out.dtype == np.float16
        assert_accurate(out, ref, naive_attention(*host, **host_kw))
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
        runs.append(([fn for fn, *_ in launches], {p for _, ptrs, _ in launches for p in ptrs}))
    assert len(checks) == 1                     # the second call: no validation, no planning
    names, first_pointers = runs[0]
    assert runs[1][0] == names and len(names) == 3 and names[-1].startswith("merge")
    # the replay's pointers are its own arrays' (and new buffers'), not the first call's
    assert not (runs[1][1] - {0}) & (first_pointers - {0})
    buf = np.full(ref.shape[:-1] + (2 * d,), np.nan, np.float16).view(device)[..., ::2]
    arrays.append(buf.base)
    got = cuattn.attention(*dev, out=buf, **kw)
    assert got is buf
    assert_accurate(np.asarray(buf), ref, naive_attention(*host, **host_kw))


def test_remember_counts_the_plans_of_nested_calls():
    """A call made inside another's long way records its plans for the outer call too, so
    the outer call (which then ran more than one plan) is not kept; outside any long way
    nothing is recorded."""
    from cuattn import _gpu

    def record(name):
        _gpu._recorded.runs.append((name, [0] * 9))

    with _gpu.remember(_gpu.Unseen(("outer",), (None,) * 9)) as outer:
        record("first")
        with _gpu.remember(_gpu.Unseen(("inner",), (None,) * 9)) as inner:
            record("second")
        with _gpu.remember(None):  # a call that learns nothing records into the outer's
            record("third")
    assert [name for name, _ in inner.runs] == ["second"]
    assert [name for name, _ in outer.runs] == ["first", "second", "third"]
    assert getattr(_gpu._recorded, "runs", None) is None


@pytest.mark.parametrize("lengths", [[[[4000]]], [[[4000]], [[3000]]]])
def test_key_lengths_fold_query_groups_on_host_memory(lengths, monkeypatch):
    """A GQA decoding call with host key lengths runs each run of equal lengths as a dense
    part whose lse goes into the call's lse array; the part's query groups still fold into
    rows (the launches see G query rows of one batch entry), through a CuPy stand-in on host
    memory, and the result equals the float64 reference."""
    from _hostdev import Memory, emulate_forward, fake_gpu, fields
    from test_merge import _emulate_merge_parts

    import cuattn
    from cuattn.reference import lengths_mask

    arrays, launches, rows = [], [], []
    forward = emulate_forward(Memory(arrays), np.float16)

    def seen(block, pointers, grid):
        rows.append(int(fields(block)["seqlen_q"]))
        forward(block, pointers, grid)

    device = fake_gpu(monkeypatch, arrays, launches, np.float16,
                      {"merge": _emulate_merge_parts(Memory(arrays), np.float16),
                       "attention_fwd": seen})
    lengths = np.array(lengths)                       # (B, 1, 1)
    b = lengths.shape[0]
    rng = np.random.default_rng(b)
    host = [rng.standard_normal(shape).astype(np.float16)
            for shape in ((b, 2, 3, 1, 8), (b, 2, 1, 4100, 8), (b, 2, 1, 4100, 8))]
    dev = [x.copy().view(device) for x in host]
    arrays.extend(dev)
    out, lse = cuattn.attention(*dev, k_lengths=lengths, return_lse=True)
    assert rows and set(rows) == {3}                  # three query groups as rows
    full = lengths_mask(lengths, (b, 2, 3), 1, 4100, (-1, -1))
    ref, ref_lse = attention_reference(*host, mask=full)
    assert_accurate(np.asarray(out), ref, naive_attention(*host, mask=full))
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)


def test_repeated_calls_with_out_replay_on_host_memory(monkeypatch):
    """A repeated call given ``out`` (the same layout, new memory) replays its signature's
    plan without validating again and writes into that out; an out that overlaps an input
    takes the long way, which refuses it."""
    from _hostdev import Memory, fake_gpu
    from test_merge import _emulate_merge_parts

    import cuattn
    import cuattn._checks
    import cuattn._gpu

    arrays, launches = [], []
    device = fake_gpu(monkeypatch, arrays, launches, np.float16,
                      {"merge": _emulate_merge_parts(Memory(arrays), np.float16)})
    checks = []
    real_check = cuattn._checks.check_attention
    monkeypatch.setattr(sys.modules["cuattn.attention"], "check_attention",
                        lambda *a, **k: checks.append(1) or real_check(*a, **k))
    rng = np.random.default_rng(9)
    host = [rng.standard_normal((1, 2, n, 8)).astype(np.float16) for n in (5, 40, 40)]
    dev = [x.copy().view(device) for x in host]
    arrays.extend(dev)
    ref, _ = attention_reference(*host, causal=True)
    for _ in range(2):
        wide = np.full((1, 2, 5, 16), np.nan, np.float16).view(device)
        arrays.append(wide)
        got = cuattn.attention(*dev, causal=True, out=wide[..., ::2])
        assert np.shares_memory(got, wide) and np.isnan(np.asarray(wide[..., 1::2])).all()
        assert_accurate(np.asarray(got), ref, naive_attention(*host, causal=True))
    assert len(checks) == 1
    fresh = np.empty((1, 2, 5, 8), np.float16).view(device)   # q's layout, own memory
    arrays.append(fresh)
    cuattn.attention(*dev, causal=True, out=fresh)
    assert len(checks) == 2
    with pytest.raises(ValueError, match="overlaps q"):           # that signature, on q
        cuattn.attention(*dev, causal=True, out=dev[0])
    np.testing.assert_array_equal(np.asarray(dev[0]), host[0])    # nothing ran
