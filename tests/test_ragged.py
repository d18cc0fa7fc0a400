"""Packed sequences (q_offsets, k_offsets) and key lengths (k_lengths) against the float64
reference with the equivalent mask (cuattn.reference.packed_mask / lengths_mask)."""
import ml_dtypes
import numpy as np
import pytest
from _accuracy import assert_accurate, to_host

import cuattn
from cuattn.families._common import PACKED
from cuattn.reference import (
    attention_backward_reference,
    attention_reference,
    lengths_mask,
    naive_attention,
    packed_mask,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
WINDOWS = {"full": (-1, -1), "causal": (-1, 0), "window": (3, 1), "left": (2, -1)}


def _window_kw(window):
    if window == (-1, 0):
        return {"causal": True}
    if window == (-1, -1):
        return {}
    return {"window": tuple(None if w < 0 else w for w in window)}


def _offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _packed(rng, dtype, lens_q, lens_k, heads=3, kv_heads=1, d=16, dv=12):
    qo, ko = _offsets(lens_q), _offsets(lens_k)
    q = rng.standard_normal((2, heads, qo[-1], d)).astype(dtype)
    k = rng.standard_normal((2, kv_heads, ko[-1], d)).astype(dtype)  # GQA: broadcast heads
    v = rng.standard_normal((2, kv_heads, ko[-1], dv)).astype(dtype)
    return q, k, v, qo, ko


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", list(WINDOWS))
def test_packed_forward_and_backward(dtype, window):
    rng = np.random.default_rng(0)
    # empty sequences on either side, a sequence with no keys, one longer than the others
    q, k, v, qo, ko = _packed(rng, dtype, [3, 0, 17, 1, 40, 5], [4, 2, 0, 9, 33, 0])
    band = WINDOWS[window]
    kw = dict(_window_kw(band), softcap=6.0, scale=0.3)
    out, lse = cuattn.attention(q, k, v, q_offsets=qo, k_offsets=ko, return_lse=True, **kw)
    mask = packed_mask(qo, ko, band)
    ref, ref_lse = attention_reference(q, k, v, mask=mask, softcap=6.0, scale=0.3)
    naive = naive_attention(q, k, v, mask=mask, softcap=6.0, scale=0.3)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_accurate(out, ref, naive)
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    assert not np.any(out[..., 3:20, :])  # the 17 rows of the sequence with no keys: 0

    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = cuattn.attention_backward(dout, q, k, v, out, lse, q_offsets=qo, k_offsets=ko,
                                      **kw)
    refs = attention_backward_reference(dout, q, k, v, mask=mask, softcap=6.0, scale=0.3)
    for g, r, x in zip(grads, refs, (q, k, v)):
        assert g.shape == x.shape and g.dtype == dtype
        tol = {2: 3e-2, 4: 1e-4, 8: 1e-11}[dtype.itemsize] * max(1.0, np.max(np.abs(r)))
        assert np.max(np.abs(g.astype(np.float64) - r)) <= tol


def test_packed_vjp_out_and_one_sequence():
    rng = np.random.default_rng(1)
    q, k, v, qo, ko = _packed(rng, np.float64, [7], [9])
    dense = cuattn.attention(q, k, v, causal=True)
    buf = np.full(dense.shape, np.nan)
    got = cuattn.attention(q, k, v, causal=True, q_offsets=qo, k_offsets=ko, out=buf)
    assert got is buf
    np.testing.assert_array_equal(buf, dense)  # one sequence is the dense call
    out, vjp = cuattn.attention_vjp(q, k, v, causal=True, q_offsets=qo, k_offsets=ko)
    for g, w in zip(vjp(np.ones_like(out)),
                    cuattn.attention_vjp(q, k, v, causal=True)[1](np.ones_like(out))):
        np.testing.assert_array_equal(g, w)


def test_ten_thousand_sequences_and_a_long_one():
    rng = np.random.default_rng(2)
    lens = rng.integers(0, 4, 10_000)
    q, k, v, qo, ko = _packed(rng, np.float32, lens, lens[::-1], heads=1, d=4, dv=4)
    out = cuattn.attention(q, k, v, q_offsets=qo, k_offsets=ko, causal=True)
    sel = slice(0, int(qo[300]))  # the first 300 sequences against the reference
    sel_k = slice(0, int(ko[300]))
    ref, _ = attention_reference(q[:, :, sel], k[:, :, sel_k], v[:, :, sel_k],
                                 mask=packed_mask(qo[:301], ko[:301], (-1, 0)))
    np.testing.assert_allclose(out[:, :, sel], ref, rtol=2e-5, atol=2e-5)
    # lengths up to 8k: one sequence of 8192 keys beside short ones
    q, k, v, qo, ko = _packed(rng, np.float32, [5, 64, 1], [3, 8192, 1], heads=1, d=8, dv=8)
    out = cuattn.attention(q, k, v, q_offsets=qo, k_offsets=ko, causal=True)
    ref, _ = attention_reference(q, k, v, mask=packed_mask(qo, ko, (-1, 0)))
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", list(WINDOWS))
def test_key_lengths(dtype, window):
    rng = np.random.default_rng(3)
    lengths = np.array([[9], [0], [4]])  # per batch entry, broadcast over 2 heads
    q = rng.standard_normal((3, 2, 5, 16)).astype(dtype)
    k = rng.standard_normal((3, 1, 12, 16)).astype(dtype)
    v = rng.standard_normal((3, 2, 12, 8)).astype(dtype)
    mask = rng.random((1, 12)) > 0.2
    band = WINDOWS[window]
    kw = _window_kw(band)
    out, lse = cuattn.attention(q, k, v, mask=mask, k_lengths=lengths, return_lse=True, **kw)
    full = lengths_mask(lengths, (3, 2), 5, 12, band) & mask
    ref, ref_lse = attention_reference(q, k, v, mask=full)
    assert_accurate(out, ref, naive_attention(q, k, v, mask=full))
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    assert not np.any(out[1]) and np.all(lse[1] == -np.inf)  # length 0: rows of 0, -inf
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = cuattn.attention_backward(dout, q, k, v, out, lse, mask=mask, k_lengths=lengths,
                                      **kw)
    refs = attention_backward_reference(dout, q, k, v, mask=full)
    for g, r, x in zip(grads, refs, (q, k, v)):
        assert g.shape == x.shape and g.dtype == dtype
        tol = {2: 3e-2, 4: 1e-4, 8: 1e-11}[dtype.itemsize] * max(1.0, np.max(np.abs(r)))
        assert np.max(np.abs(g.astype(np.float64) - r)) <= tol
    assert not np.any(grads[1][:, :, 9:])  # keys past every length get no gradient


@pytest.mark.parametrize("kind", ["packed", "lengths"])
def test_gpu_parts_side_by_side_on_host_memory(kind, monkeypatch):
    """The GPU path of packed sequences and of key lengths under a family without packed
    or key-length instances, through a CuPy stand-in on host memory (emulated forward
    kernel): each
    dense part writes its rows of out and lse in place; the parts run in turn on the part
    streams, which wait for the caller's stream, which then waits for each of them; the
    results are the float64 reference's."""
    import sys

    from _hostdev import fake_gpu

    from cuattn import _gpu
    arrays, launches = [], []
    device = fake_gpu(monkeypatch, arrays, launches, np.float16)

    def on_device(a):
        d = device(a.shape, a.dtype)
        d[...] = a
        return d

    rng = np.random.default_rng(11)
    monkeypatch.setenv("CUATTN_KERNEL", "portable")  # no packed or key-length instances
    if kind == "packed":
        q, k, v, qo, ko = _packed(rng, np.float16, [3, 0, 17, 1, 40, 5], [4, 2, 0, 9, 33, 0])
        args, mask, parts = {"q_offsets": qo, "k_offsets": ko}, packed_mask(qo, ko, (-1, 0)), 5
        given_mask = None
    else:
        lengths = np.array([[9], [0], [4]])
        q = rng.standard_normal((3, 2, 5, 16)).astype(np.float16)
        k = rng.standard_normal((3, 1, 12, 16)).astype(np.float16)
        v = rng.standard_normal((3, 2, 12, 8)).astype(np.float16)
        given_mask = rng.random((1, 12)) > 0.2
        args = {"k_lengths": lengths, "mask": on_device(given_mask)}
        mask, parts = lengths_mask(lengths, (3, 2), 5, 12, (-1, 0)) & given_mask, 3
    out, lse = cuattn.attention(on_device(q), on_device(k), on_device(v), causal=True,
                                return_lse=True, **args)
    ref, ref_lse = attention_reference(q, k, v, mask=mask)
    assert type(out) is device and type(lse) is device
    assert_accurate(np.asarray(out), ref, naive_attention(q, k, v, mask=mask))
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    caller, *side = sys.modules["cupy"].streams
    assert len(side) == _gpu.PART_STREAMS
    assert [s.waited for s in side] == [caller.recorded[:1]] * len(side)   # the fork
    assert caller.waited == [s.recorded[0] for s in side]                  # the join
    used = [stream for *_, stream in launches]
    assert len(used) == parts and set(used) <= {s.ptr for s in side}
    assert len(set(used)) == min(parts, _gpu.PART_STREAMS)


@pytest.mark.parametrize("d, family", [(64, "sm90"), (128, "sm90"), (256, "sm90"), (80, "mma")])
def test_gpu_packed_call_is_one_grid(d, family, monkeypatch):
    """A packed call that a family with packed instances serves is one launch over every
    sequence, through a CuPy stand-in on host memory (emulated forward kernel): its table
    holds every query block of every sequence once, costliest first (the keys its causal
    band reaches), and the grid has a block per query block and batch entry; the results
    are the float64 reference's."""
    from _hostdev import Memory, fake_gpu, fields, packed_blocks

    from cuattn import _gpu
    if family != "sm90":
        monkeypatch.setenv("CUATTN_KERNEL", family)
    arrays, launches = [], []
    device = fake_gpu(monkeypatch, arrays, launches, BF16)
    blocks = []
    real_plan = _gpu._forward_plan

    def plan(*args, **kw):
        launch, loop = real_plan(*args, **kw)
        blocks.append((args[1], launch.block, launch.grid))
        return launch, loop
    monkeypatch.setattr(_gpu, "_forward_plan", plan)

    def on_device(a):
        x = device(a.shape, a.dtype)
        x[...] = a
        return x

    rng = np.random.default_rng(3)
    lens_q, lens_k = [3, 0, 130, 1, 70, 9], [4, 2, 0, 2500, 65, 9]
    q, k, v, qo, ko = _packed(rng, BF16, lens_q, lens_k, heads=4, kv_heads=1, d=d, dv=d)
    out, lse = cuattn.attention(on_device(q), on_device(k), on_device(v), q_offsets=qo,
                                k_offsets=ko, causal=True, softcap=5.0, return_lse=True)
    assert len(launches) == 1 and len(blocks) == 1
    choice, block, grid = blocks[0]
    assert choice.ragged == PACKED and choice.family == family
    assert choice.name_expression.endswith(", 1>")
    f = fields(block)
    blocks = packed_blocks(Memory(arrays), f)
    bm = choice.tiles.block_m
    want = {(qo[s], ko[s], lens_q[s], lens_k[s], r)
            for s in range(6) for r in range(-(-lens_q[s] // bm))}
    assert sorted(blocks) == sorted(want)  # each query block once

    def reach(q0, k0, sq, sk, r):  # keys of the causal band from the block's last row
        return min(sk, min(sq, (r + 1) * bm) - 1 + sk - sq + 1)
    costs = [max(0, reach(*x)) for x in blocks]
    assert costs == sorted(costs, reverse=True)
    assert grid[0] == len(blocks) * 2 * 4 and f["num_m_blocks"] == len(blocks)  # x 2 x 4
    mask = packed_mask(qo, ko, (-1, 0))
    ref, ref_lse = attention_reference(q, k, v, mask=mask, softcap=5.0)
    assert_accurate(np.asarray(out), ref, naive_attention(q, k, v, mask=mask, softcap=5.0))
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", ["host", "device int32", "device int64", "device uint16"])
@pytest.mark.parametrize("window", ["full", "causal", "window"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_gpu_key_lengths_read_by_the_kernels(where, window, with_mask, monkeypatch):
    """Key lengths that the kernels read (KEY_LENGTHS instances), through a CuPy stand-in on
    host memory: one launch of the key-lengths instance with the lengths' address and no
    mask but the call's own (query groups sharing their keys folded into rows where the
    band allows); the results are the float64 reference's under the lengths' mask joined
    to the call's, each band aligned to its entry's length."""
    from _hostdev import fake_gpu

    arrays, launches = [], []
    device = fake_gpu(monkeypatch, arrays, launches, BF16)

    def on_device(a):
        x = device(a.shape, a.dtype)
        x[...] = a
        return x

    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 3, 5, 64)).astype(BF16)
    k, v = (rng.standard_normal((2, 1, 300, 64)).astype(BF16) for _ in range(2))
    lengths = np.array([[170], [0]])
    if where != "host":
        lengths = on_device(lengths.astype(where.split()[1]))
    band = WINDOWS[window]
    given = rng.random(300) > 0.3 if with_mask else None  # a key-padding mask of its own
    kw = {"mask": on_device(given)} if with_mask else {}
    out, lse = cuattn.attention(on_device(q), on_device(k), on_device(v), k_lengths=lengths,
                                return_lse=True, **_window_kw(band), **kw)
    assert len(launches) == 1
    fn, pointers, _ = launches[0]
    assert fn.startswith("attention_fwd_sm90<") and fn.endswith(", 2>")
    assert (pointers[5] != 0) == with_mask and pointers[7] != 0  # the lengths' address
    host = np.asarray(lengths).astype(np.int64)
    mask = lengths_mask(host, (2, 3), 5, 300, band)
    if with_mask:
        mask = mask & given
    ref, ref_lse = attention_reference(q, k, v, mask=mask)
    assert_accurate(np.asarray(out), ref, naive_attention(q, k, v, mask=mask))
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


def test_split_parts_shift_key_lengths():
    """A call with key lengths in key chunks (cuattn._split): the first part's entries
    along its chunk axis step the lengths by the chunk width, the last part's start at its
    first key; each part's entries then have the lengths' keys of their chunk, and the
    merged parts equal the whole call's reference."""
    import dataclasses

    from cuattn import _split
    from cuattn._checks import check_attention
    from cuattn.merge import merge_stacked

    rng = np.random.default_rng(9)
    q = rng.standard_normal((3, 2, 1, 16))
    k, v = (rng.standard_normal((3, 2, 5000, 16)) for _ in range(2))
    lengths = np.array([[4999], [1200], [0]])  # (3, 1): per batch entry
    call = dataclasses.replace(check_attention(q, k, v, causal=True, return_lse=True),
                               k_lengths=lengths)
    n = 4
    outs, lses = _split.buffers(call, n)
    first, last = _split.parts(call, n, outs, lses)
    width = 5000 // n
    assert (first[0].k_lengths_from, first[0].k_lengths_step) == (0, width)
    assert (last[0].k_lengths_from, last[0].k_lengths_step) == (3 * width, 0)

    def run(part):  # a part's entries: their lengths, less the chunk's first key
        b = part.batch_shape
        chunk = np.arange(b[-1]) if len(b) == 3 else 0  # the first part's chunk axis
        keys = np.clip(np.broadcast_to(part.k_lengths, b) - part.k_lengths_from
                       - chunk * part.k_lengths_step, 0, part.seqlen_k)
        mask = lengths_mask(keys, b, part.seqlen_q, part.seqlen_k,
                            (part.window_left, part.window_right))
        return attention_reference(np.broadcast_to(part.q, b + part.q.shape[-2:]), part.k,
                                   part.v, mask=mask)
    for part, lse in (first, last):
        lse[...] = run(part)[1]
        part.out[...] = run(part)[0]
    out, lse = merge_stacked(outs, lses)
    mask = lengths_mask(lengths, (3, 2), 1, 5000, (-1, 0))
    ref, ref_lse = attention_reference(q, k, v, mask=mask)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))


def test_equal_neighbouring_lengths_share_a_call():
    """Runs of equal lengths along the last varying batch axis are one dense call each, and
    the result is the masked call's whatever the runs (lengths varying on two axes)."""
    from cuattn._checks import check_attention
    from cuattn._checks_ragged import check_ragged
    from cuattn._ragged import _groups
    rng = np.random.default_rng(6)
    lengths = np.array([[5, 5, 9], [0, 0, 0], [9, 2, 2], [7, 7, 7]])  # (B 4, H 3)
    q = rng.standard_normal((4, 3, 3, 8))
    k = rng.standard_normal((4, 3, 9, 8))
    v = rng.standard_normal((4, 3, 9, 8))
    call = check_attention(q, k, v, causal=True)
    runs = [(sel, n) for sel, n in _groups(call, check_ragged(call, k_lengths=lengths))]
    assert [n for _, n in runs] == [5, 9, 0, 9, 2, 7]
    assert runs[0][0] == (slice(0, 1), slice(0, 2)) and runs[-1][0] == (slice(3, 4), slice(0, 3))
    out, lse = cuattn.attention(q, k, v, k_lengths=lengths, causal=True, return_lse=True)
    full = lengths_mask(lengths, (4, 3), 3, 9, (-1, 0))
    ref, ref_lse = attention_reference(q, k, v, mask=full)
    assert_accurate(out, ref, naive_attention(q, k, v, mask=full))
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    dout = rng.standard_normal(out.shape)
    grads = cuattn.attention_backward(dout, q, k, v, out, lse, k_lengths=lengths, causal=True)
    for g, r in zip(grads, attention_backward_reference(dout, q, k, v, mask=full)):
        np.testing.assert_allclose(g, r, atol=1e-10)


def test_key_lengths_equal_to_a_shorter_dense_call():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for n in (4, 10, 10))
    got = cuattn.attention(q, k, v, k_lengths=np.array(7), causal=True)
    np.testing.assert_array_equal(got, cuattn.attention(q, k[..., :7, :], v[..., :7, :],
                                                        causal=True))


@pytest.mark.parametrize("kw, exc, text", [
    ({"q_offsets": [0, 2, 5]}, ValueError, "given together"),
    ({"q_offsets": [0, 2, 5], "k_offsets": [0, 3, 6, 6]}, ValueError, "one length"),
    ({"q_offsets": [0, 2, 4], "k_offsets": [0, 3, 6]}, ValueError, "end at Tq=5"),
    ({"q_offsets": [1, 2, 5], "k_offsets": [0, 3, 6]}, ValueError, "start at 0"),
    ({"q_offsets": [0, 4, 2, 5], "k_offsets": [0, 3, 3, 6]}, ValueError, "non-decreasing"),
    ({"q_offsets": [0.0, 5.0], "k_offsets": [0, 6]}, TypeError, "integer array"),
    ({"q_offsets": [[0, 5]], "k_offsets": [[0, 6]]}, ValueError, "1-D array"),
    ({"q_offsets": [0, 5], "k_offsets": [0, 6], "max_q_len": 3}, ValueError, "longest"),
    ({"q_offsets": [0, 5], "k_offsets": [0, 6], "max_k_len": 7}, ValueError, "between 0"),
    ({"q_offsets": [0, 5], "k_offsets": [0, 6], "max_k_len": 6.0}, TypeError, "an int"),
    ({"max_q_len": 5}, ValueError, "go with q_offsets"),
    ({"q_offsets": [0, 5], "k_offsets": [0, 6], "k_lengths": [3]}, ValueError, "combined"),
    ({"q_offsets": [0, 5], "k_offsets": [0, 6], "mask": np.ones((5, 6), bool)},
     NotImplementedError, "mask and bias"),
    ({"k_lengths": [7]}, ValueError, "between 0 and Sk=6"),
    ({"k_lengths": [-1]}, ValueError, "between 0 and Sk=6"),
    ({"k_lengths": np.ones((4,), int)}, ValueError, "does not broadcast"),
    ({"k_lengths": [2.5]}, TypeError, "integer array"),
])
def test_errors(kw, exc, text):
    q = np.ones((2, 5, 4), np.float32)
    k = v = np.ones((2, 6, 4), np.float32)
    kw = {n: (np.asarray(x) if isinstance(x, list) else x) for n, x in kw.items()}
    with pytest.raises(exc, match=text):
        cuattn.attention(q, k, v, **kw)


def test_dask_arrays_with_offsets_are_refused():
    da = pytest.importorskip("dask.array")
    q = da.ones((5, 4), dtype=np.float32)
    with pytest.raises(NotImplementedError, match="Dask"):
        cuattn.attention(q, q, q, k_lengths=np.array(3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_packed_and_key_lengths(dtype):
    import cupy as cp
    rng = np.random.default_rng(5)
    q, k, v, qo, ko = _packed(rng, dtype, [3, 0, 130, 1, 70], [4, 2, 0, 200, 65], d=64, dv=64)
    dq, dk, dv = (cp.asarray(x) for x in (q, k, v))
    out, lse = cuattn.attention(dq, dk, dv, q_offsets=qo, k_offsets=ko, causal=True,
                                return_lse=True)
    mask = packed_mask(qo, ko, (-1, 0))
    ref, _ = attention_reference(q, k, v, mask=mask)
    assert isinstance(out, cp.ndarray)
    assert_accurate(to_host(out), ref, naive_attention(q, k, v, mask=mask))
    grads = cuattn.attention_backward(cp.asarray(np.ones(out.shape, dtype)), dq, dk, dv, out,
                                      lse, q_offsets=qo, k_offsets=ko, causal=True)
    refs = attention_backward_reference(np.ones(out.shape, dtype), q, k, v, mask=mask)
    for g, r in zip(grads, refs):
        tol = {2: 3e-2, 4: 1e-4, 8: 1e-11}[dtype.itemsize] * max(1.0, np.max(np.abs(r)))
        assert np.max(np.abs(to_host(g).astype(np.float64) - r)) <= tol
    lengths = np.array([150, 0])[:, None]
    out = cuattn.attention(dq, dk, dv, k_lengths=lengths, causal=True)
    full = lengths_mask(lengths, (2, 3), q.shape[-2], k.shape[-2], (-1, 0))
    ref, _ = attention_reference(q, k, v, mask=full)
    assert_accurate(to_host(out), ref, naive_attention(q, k, v, mask=full))
    # device lengths: the same call as a mask built on the device, forward and backward
    out_d, lse_d = cuattn.attention(dq, dk, dv, k_lengths=cp.asarray(lengths), causal=True,
                                    return_lse=True)
    assert_accurate(to_host(out_d), ref, naive_attention(q, k, v, mask=full))
    dout = cp.asarray(np.ones(out_d.shape, dtype))
    grads = cuattn.attention_backward(dout, dq, dk, dv, out_d, lse_d, causal=True,
                                      k_lengths=cp.asarray(lengths))
    refs = attention_backward_reference(np.ones(out_d.shape, dtype), q, k, v, mask=full)
    for g, r in zip(grads, refs):
        tol = {2: 3e-2, 4: 1e-4, 8: 1e-11}[dtype.itemsize] * max(1.0, np.max(np.abs(r)))
        assert np.max(np.abs(to_host(g).astype(np.float64) - r)) <= tol
    with pytest.raises(NotImplementedError, match="device memory"):
        cuattn.attention(dq, dk, dv, q_offsets=cp.asarray(qo), k_offsets=cp.asarray(ko),
                         max_q_len=130, max_k_len=200)


def _packed_on_gpu(q, k, v, qo, ko, kernel=None, tiles=None, **kw):
    """out and lse of a packed call run by cuattn._gpu.forward_packed with a forced family
    and tiles; asserts that the instance ran it in one grid."""
    import cupy as cp

    from cuattn import _gpu
    from cuattn._checks import check_attention, lse_dtype
    from cuattn._checks_ragged import check_ragged
    call = check_attention(*(cp.asarray(x) for x in (q, k, v)), return_lse=True, **kw)
    ragged = check_ragged(call, qo, ko)
    out = cp.full(call.out_shape, np.nan, call.dtype)
    lse = cp.full(call.lse_shape, np.nan, lse_dtype(call.dtype))
    assert _gpu.forward_packed(call, ragged, out, lse, kernel, tiles)
    return to_host(out), to_host(lse)


def _packed_tiles():
    from cuattn.families.mma import MmaTiles
    from cuattn.families.sm90 import Sm90PipedTiles, Sm90Tiles
    return {"sm90 piped 128x2": ("sm90", Sm90PipedTiles(128, 2)),
            "sm90 piped 64x2": ("sm90", Sm90PipedTiles(64, 2)),
            "sm90 per-block": ("sm90", Sm90Tiles(64, 64)),
            "mma": ("mma", MmaTiles(64, 64))}


@pytest.mark.gpu
@pytest.mark.parametrize("instance", ["sm90 piped 128x2", "sm90 piped 64x2", "sm90 per-block",
                                      "mma"])
@pytest.mark.parametrize("d", [16, 64, 72, 128, 256])
@pytest.mark.parametrize("window", ["full", "causal", "window"])
def test_gpu_packed_grid_against_the_reference(instance, d, window):
    """The packed instances in one grid: empty sequences, sequences without keys, one
    query row, lengths across tile edges, a broadcast (GQA) key head; each sequence against
    the float64 reference of its own rows and keys, its band aligned to its own corner."""
    family, tiles = _packed_tiles()[instance]
    if d > 128 and instance in ("sm90 per-block", "sm90 piped 128x2"):
        pytest.skip("the per-block sm90 instance and 128-key piped tiles hold D <= 128")
    if instance.startswith("sm90 piped") and d % 8:
        pytest.skip("tensor maps need 16-byte rows")
    rng = np.random.default_rng(d)
    lens_q = [3, 0, 130, 1, 70, 129, 64, 200]
    lens_k = [4, 2, 0, 300, 65, 129, 1, 128]
    q, k, v, qo, ko = _packed(rng, BF16, lens_q, lens_k, heads=3, kv_heads=1, d=d, dv=d)
    band = WINDOWS[window]
    kw = dict(_window_kw(band), softcap=8.0, scale=0.2)
    out, lse = _packed_on_gpu(q, k, v, qo, ko, family, tiles, **kw)
    mask = packed_mask(qo, ko, band)
    ref, ref_lse = attention_reference(q, k, v, mask=mask, softcap=8.0, scale=0.2)
    assert_accurate(out, ref, naive_attention(q, k, v, mask=mask, softcap=8.0, scale=0.2))
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("instance", ["sm90 piped 128x2", "sm90 piped 64x2", "sm90 per-block",
                                      "mma"])
def test_gpu_packed_sequences_do_not_read_their_neighbours(instance):
    """A sequence's last key tile reaches into the next sequence's rows (the piped
    instance's tensor maps span every sequence): inf and NaN in the next sequence's keys
    and values leave the sequence's output and lse exact."""
    family, tiles = _packed_tiles()[instance]
    rng = np.random.default_rng(7)
    lens = [100, 37, 250]
    q, k, v, qo, ko = _packed(rng, BF16, lens, lens, heads=2, d=64, dv=64)
    k[..., 100:137, :] = np.inf
    v[..., 100:110, :] = np.nan
    v[..., 110:137, :] = -np.inf
    out, lse = _packed_on_gpu(q, k, v, qo, ko, family, tiles, causal=True)
    keep = np.r_[0:100, 137:387]
    sub_q, sub_kv = q[..., keep, :], (k[..., keep, :], v[..., keep, :])
    offsets = np.array([0, 100, 350])
    mask = packed_mask(offsets, offsets, (-1, 0))
    ref, ref_lse = attention_reference(sub_q, *sub_kv, mask=mask)
    assert np.all(np.isfinite(out[..., keep, :]))
    assert_accurate(out[..., keep, :], ref, naive_attention(sub_q, *sub_kv, mask=mask))
    np.testing.assert_allclose(lse[..., keep], ref_lse, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm90", "mma"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window", ["full", "causal", "window"])
def test_gpu_packed_backward_in_one_grid(family, d, window):
    """The packed backward's dK/dV and dQ kernels, one grid each over every sequence (keys
    without query rows get zero gradients; rows without keys too), with a broadcast key
    head (its gradients summed): against the float64 reference of the packed mask."""
    import cupy as cp

    from cuattn import _gpu_backward
    from cuattn._checks import check_attention
    if family == "sm90" and d > 128:
        pytest.skip("the sm90 backward holds head dims to 128")
    rng = np.random.default_rng(30 + d)
    lens_q = [3, 0, 130, 1, 70, 129, 64, 200, 5]
    lens_k = [4, 2, 0, 300, 65, 129, 1, 128, 0]
    q, k, v, qo, ko = _packed(rng, BF16, lens_q, lens_k, heads=3, kv_heads=1, d=d, dv=d)
    band = WINDOWS[window]
    kw = dict(_window_kw(band), softcap=8.0, scale=0.2)
    dq_, dk_, dv_ = (cp.asarray(x) for x in (q, k, v))
    out, lse = cuattn.attention(dq_, dk_, dv_, q_offsets=qo, k_offsets=ko, return_lse=True,
                                **kw)
    dout = rng.standard_normal(out.shape).astype(BF16)
    call = check_attention(dq_, dk_, dv_, **kw)
    grads = _gpu_backward.backward(call, cp.asarray(dout), out, lse, kernel=family,
                                   packed=(qo, ko))
    assert grads is not None
    mask = packed_mask(qo, ko, band)
    refs = attention_backward_reference(dout, q, k, v, mask=mask, softcap=8.0, scale=0.2)
    for g, r, x in zip(grads, refs, (q, k, v)):
        g = to_host(g)
        assert g.shape == x.shape and g.dtype == BF16
        tol = 3e-2 * max(1.0, np.max(np.abs(r)))
        assert np.max(np.abs(g.astype(np.float64) - r)) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("instance", ["sm90 piped 128x2", "sm90 piped 64x2", "sm90 per-block",
                                      "mma"])
@pytest.mark.parametrize("window", ["full", "causal", "window"])
def test_gpu_key_lengths_in_the_kernels(instance, window):
    """Key lengths read by the forced instances: each batch entry against the float64
    reference on its first keys, its band aligned to its length; NaN and inf past the
    lengths (a cache's unwritten rows) leave the results exact."""
    import cupy as cp

    from cuattn import _gpu
    from cuattn._checks import check_attention
    family, tiles = _packed_tiles()[instance]
    rng = np.random.default_rng(21)
    q = rng.standard_normal((2, 3, 70, 64)).astype(BF16)
    k, v = (rng.standard_normal((2, 3, 600, 64)).astype(BF16) for _ in range(2))
    lengths = np.array([[600, 0, 1], [129, 300, 64]])
    for b, h in np.ndindex(2, 3):
        k[b, h, lengths[b, h]:] = np.inf
        v[b, h, lengths[b, h]:] = np.nan
    band = WINDOWS[window]
    call = check_attention(*(cp.asarray(x) for x in (q, k, v)), return_lse=True,
                           **_window_kw(band))
    out, lse = (to_host(x) for x in _gpu.forward_lengths(call, cp.asarray(lengths), family,
                                                         tiles))
    for b, h in np.ndindex(2, 3):
        n = lengths[b, h]
        ref, ref_lse = attention_reference(q[b, h], k[b, h, :n], v[b, h, :n],
                                           window=None if band == (-1, -1) else tuple(
                                               None if w < 0 else w for w in band))
        assert_accurate(out[b, h], ref, naive_attention(
            q[b, h], k[b, h, :n], v[b, h, :n], window=None if band == (-1, -1) else tuple(
                None if w < 0 else w for w in band)))
        assert np.array_equal(np.isinf(lse[b, h]), np.isinf(ref_lse))
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[b, h][finite], ref_lse[finite], rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
def test_gpu_key_lengths_of_a_decoding_call(dtype):
    """A GQA decoding call with device key lengths through dispatch: its query groups fold
    into rows and its keys split into chunks, each shifting the lengths; unwritten cache
    rows (NaN) past the lengths stay unread; equal to the float64 reference."""
    import cupy as cp
    rng = np.random.default_rng(22)
    q = rng.standard_normal((2, 4, 3, 1, 128)).astype(dtype)
    k, v = (rng.standard_normal((2, 4, 1, 20000, 128)).astype(dtype) for _ in range(2))
    lengths = np.array([19999, 0, 4097, 1, 20000, 12345, 8191, 640]).reshape(2, 4, 1)
    for b, h in np.ndindex(2, 4):
        v[b, h, 0, lengths[b, h, 0]:] = np.nan
    out, lse = cuattn.attention(*(cp.asarray(x) for x in (q, k, v)), causal=True,
                                k_lengths=cp.asarray(lengths.astype(np.int32)),
                                return_lse=True)
    mask = lengths_mask(lengths, (2, 4, 3), 1, 20000, (-1, 0))
    clean = np.where(np.isnan(v), 0, v).astype(dtype)
    ref, ref_lse = attention_reference(q, k, clean, mask=mask)
    assert_accurate(to_host(out), ref, naive_attention(q, k, clean, mask=mask))
    assert np.array_equal(np.isinf(to_host(lse)), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(to_host(lse)[finite], ref_lse[finite], rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
def test_gpu_packed_ten_thousand_sequences():
    """10,000 sequences of 1 to 40 rows, a few long ones, through dispatch's own choice:
    one grid, every row equal to the reference's of its sequence."""
    rng = np.random.default_rng(12)
    lens = rng.integers(0, 41, 10_000)
    lens[[5, 5000, 9999]] = [1500, 1, 2100]
    q, k, v, qo, ko = _packed(rng, np.float16, lens, lens, heads=2, d=64, dv=64)
    import cupy as cp
    out, lse = cuattn.attention(*(cp.asarray(x) for x in (q, k, v)), q_offsets=qo,
                                k_offsets=ko, causal=True, return_lse=True)
    out, lse = to_host(out), to_host(lse)
    for s in [0, 1, 5, 17, 4999, 5000, 9998, 9999]:
        rows = slice(qo[s], qo[s + 1])
        ref, ref_lse = attention_reference(q[..., rows, :], k[..., rows, :], v[..., rows, :],
                                           causal=True)
        assert_accurate(out[..., rows, :], ref, naive_attention(
            q[..., rows, :], k[..., rows, :], v[..., rows, :], causal=True))
        np.testing.assert_allclose(lse[..., rows], ref_lse, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("window", list(WINDOWS) + ["both"])
def test_lengths_as_a_mask(window):
    """Device key lengths run as a mask built with the array module's operations: the same
    mask as the reference's, and (on NumPy) the same results as host lengths."""
    from cuattn._checks import check_attention
    from cuattn._checks_ragged import check_ragged
    from cuattn._cpu import attention_forward
    from cuattn._ragged import as_masked
    from cuattn._ragged import lengths_mask as built
    band = (2, 1) if window == "both" else WINDOWS[window]
    lengths = np.array([[0], [3], [9], [12]])
    want = lengths_mask(lengths, (4, 2), 5, 12, band)
    for dtype in (np.int64, np.uint32, np.int8):  # unsigned or narrow: no wrap in L - Sq
        got = built(np, lengths.astype(dtype), 5, 12, *band)
        assert np.array_equal(np.broadcast_to(got, want.shape), want), dtype
    # lengths clip to 0 .. Sk
    clipped = built(np, np.array([[-3], [20]]), 5, 12, *band)
    assert np.array_equal(clipped, built(np, np.array([[0], [12]]), 5, 12, *band))
    rng = np.random.default_rng(8)
    q = rng.standard_normal((4, 2, 5, 8))
    k, v = rng.standard_normal((2, 4, 1, 12, 8))
    mask = rng.random((1, 12)) > 0.2
    kw = dict(_window_kw(band), mask=mask) if window != "both" else dict(window=band,
                                                                          mask=mask)
    call = check_attention(q, k, v, return_lse=True, **kw)
    masked = as_masked(call, check_ragged(call, k_lengths=lengths).k_lengths)
    assert masked.window_left == masked.window_right == -1
    out, lse = attention_forward(masked)
    ref, ref_lse = cuattn.attention(q, k, v, k_lengths=lengths, return_lse=True, **kw)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))


def test_empty_batch_with_key_lengths():
    q = np.zeros((0, 2, 3, 8))
    k = np.zeros((0, 1, 6, 8))
    out, lse = cuattn.attention(q, k, k, k_lengths=np.zeros((0, 1), int), return_lse=True)
    assert out.shape == (0, 2, 3, 8) and lse.shape == (0, 2, 3)
    grads = cuattn.attention_backward(out, q, k, k, out, lse, k_lengths=np.zeros((0, 1), int))
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]


def test_docs_page_examples():
    import doctest
    import pathlib
    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "ragged.rst"
    result = doctest.testfile(str(page), module_relative=False,
                              optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 8 and result.failed == 0
