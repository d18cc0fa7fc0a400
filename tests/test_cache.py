"""kv_cache_append and decoding over a cache with k_lengths."""
import sys

import ml_dtypes
import numpy as np
import pytest
from _accuracy import to_host
from _hostdev import batch_offset, fields

import cuattn

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]


def _loop_append(k_cache, v_cache, k_new, v_new, lengths):
    """The append written as a loop over batch entries (the specification)."""
    batch = k_cache.shape[:-2]
    lengths = np.broadcast_to(lengths, batch)
    k_new = np.broadcast_to(k_new, batch + k_new.shape[-2:])
    v_new = np.broadcast_to(v_new, batch + v_new.shape[-2:])
    n = k_new.shape[-2]
    for b in np.ndindex(*batch):
        k_cache[b][lengths[b]:lengths[b] + n] = k_new[b]
        v_cache[b][lengths[b]:lengths[b] + n] = v_new[b]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_append_matches_the_loop(dtype):
    rng = np.random.default_rng(0)
    k_cache = rng.standard_normal((2, 3, 10, 8)).astype(dtype)
    v_cache = rng.standard_normal((2, 3, 10, 5)).astype(dtype)
    k_new = rng.standard_normal((2, 1, 3, 8)).astype(dtype)   # broadcast over the heads
    v_new = rng.standard_normal((2, 3, 3, 5)).astype(dtype)
    lengths = np.array([[0], [7]])                            # per batch entry
    want_k, want_v = k_cache.copy(), v_cache.copy()
    _loop_append(want_k, want_v, k_new, v_new, lengths)
    assert cuattn.kv_cache_append(k_cache, v_cache, k_new, v_new, lengths) is None
    np.testing.assert_array_equal(k_cache, want_k)
    np.testing.assert_array_equal(v_cache, want_v)


def test_strided_caches_and_nothing_to_append():
    rng = np.random.default_rng(1)
    store = np.zeros((3, 12, 2, 4), np.float32)        # (B, S, H, D): caches as BSHD views
    k_cache = store.swapaxes(1, 2)
    v_cache = np.zeros((3, 2, 12, 4), np.float32)
    k_new = rng.standard_normal((3, 2, 2, 4)).astype(np.float32)
    lengths = np.array([1, 0, 10])[:, None]
    want = k_cache.copy()
    _loop_append(want, v_cache.copy(), k_new, k_new, lengths)
    cuattn.kv_cache_append(k_cache, v_cache, k_new, k_new, lengths)
    np.testing.assert_array_equal(k_cache, want)
    before = store.copy()
    cuattn.kv_cache_append(k_cache, v_cache, k_new[..., :0, :], k_new[..., :0, :], lengths)
    np.testing.assert_array_equal(store, before)


def test_decode_loop_equals_attention_over_the_whole_sequence():
    """Prefill, then one token at a time: attention over the cache's valid prefix with
    k_lengths equals causal attention over the sequence so far, entry by entry."""
    rng = np.random.default_rng(2)
    batch, heads, dim, cap = 3, 2, 16, 40
    prompt = [5, 9, 1]                                  # ragged prompts
    keys = rng.standard_normal((batch, heads, cap, dim))
    values = rng.standard_normal((batch, heads, cap, dim))
    queries = rng.standard_normal((batch, heads, cap, dim))
    k_cache, v_cache = np.zeros_like(keys), np.zeros_like(values)
    lengths = np.zeros((batch, 1), np.int64)
    for b, n in enumerate(prompt):                     # prefill entry by entry
        cuattn.kv_cache_append(k_cache[b:b + 1], v_cache[b:b + 1], keys[b:b + 1, :, :n],
                               values[b:b + 1, :, :n], lengths[b:b + 1])
        lengths[b] = n
    for _ in range(6):                                  # decode: one new key per entry
        pos = lengths[:, 0]
        take = np.arange(batch)
        k_step = keys[take, :, pos][:, :, None]         # (B, H, 1, D)
        v_step = values[take, :, pos][:, :, None]
        q_step = queries[take, :, pos][:, :, None]
        cuattn.kv_cache_append(k_cache, v_cache, k_step, v_step, lengths)
        lengths += 1
        out = cuattn.attention(q_step, k_cache, v_cache, k_lengths=lengths, causal=True)
        for b in range(batch):
            n = int(lengths[b, 0])
            want = cuattn.attention(queries[b, :, :n], keys[b, :, :n], values[b, :, :n],
                                    causal=True)[:, -1:]
            np.testing.assert_allclose(out[b], want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("args, exc, text", [
    ({"lengths": np.array([8, 0])}, ValueError, "overflows"),
    ({"lengths": np.array([-1, 0])}, ValueError, ">= 0"),
    ({"lengths": np.array([0.5, 0])}, TypeError, "integer array"),
    ({"lengths": np.array([0, 0, 0])}, ValueError, "does not broadcast"),
    ({"k_new": np.ones((2, 3, 4), np.float64)}, TypeError, "must match"),
    ({"k_new": np.ones((2, 3, 5), np.float32)}, ValueError, "head dims differ"),
    ({"v_new": np.ones((2, 2, 4), np.float32)}, ValueError, "new rows"),
    ({"k_new": np.ones((3, 3, 4), np.float32)}, ValueError, "does not broadcast"),
    ({"v_cache": np.zeros((2, 9, 4), np.float32)}, ValueError, "does not match"),
    ({"k_cache": np.broadcast_to(np.zeros((1, 10, 4), np.float32), (2, 10, 4))}, ValueError,
     "read-only"),
    ({"k_cache": np.ones((2, 10, 4), np.int32)}, TypeError, "supported dtypes"),
    ({"k_cache": [[1.0]]}, TypeError, "must be a numpy.ndarray"),
])
def test_errors_leave_the_caches_untouched(args, exc, text):
    kw = {"k_cache": np.zeros((2, 10, 4), np.float32), "v_cache": np.zeros((2, 10, 4), np.float32),
          "k_new": np.ones((2, 3, 4), np.float32), "v_new": np.ones((2, 3, 4), np.float32),
          "lengths": np.array([0, 7])}
    kw.update(args)
    with pytest.raises(exc, match=text):
        cuattn.kv_cache_append(**kw)
    for name in ("k_cache", "v_cache"):
        if isinstance(kw[name], np.ndarray) and kw[name].dtype == np.float32:
            assert not kw[name].any()


def test_overlap_and_broadcast_caches_are_refused():
    cache = np.zeros((2, 10, 4), np.float32)
    with pytest.raises(ValueError, match="k_new overlaps k_cache"):
        cuattn.kv_cache_append(cache, np.zeros_like(cache), cache[:, :2], cache[:, :2] * 0,
                               np.array([0, 0]))
    shared = np.zeros((1, 10, 4), np.float32)
    view = np.lib.stride_tricks.as_strided(shared, (2, 10, 4), (0, 16, 4))
    with pytest.raises(ValueError, match="broadcast view"):
        cuattn.kv_cache_append(view, np.zeros_like(cache), np.ones((2, 1, 4), np.float32),
                               np.ones((2, 1, 4), np.float32), np.array([0, 0]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_append_host_and_device_lengths(dtype):
    import cupy as cp
    rng = np.random.default_rng(3)
    k_cache = rng.standard_normal((2, 3, 50, 64)).astype(dtype)
    v_cache = rng.standard_normal((2, 3, 50, 32)).astype(dtype)
    k_new = rng.standard_normal((2, 1, 4, 64)).astype(dtype)
    v_new = rng.standard_normal((2, 3, 4, 32)).astype(dtype)
    lengths = np.array([[3], [46]])
    want_k, want_v = k_cache.copy(), v_cache.copy()
    _loop_append(want_k, want_v, k_new, v_new, lengths)
    for as_lengths in (np.asarray, cp.asarray,
                       lambda x: cp.asarray(x, dtype=cp.int32),
                       lambda x: cp.asarray(x, dtype=cp.uint8)):
        dk, dv = cp.asarray(k_cache), cp.asarray(v_cache)
        cuattn.kv_cache_append(dk, dv, cp.asarray(k_new), cp.asarray(v_new),
                               as_lengths(lengths))
        np.testing.assert_array_equal(to_host(dk), want_k)
        np.testing.assert_array_equal(to_host(dv), want_v)
    # device lengths that overflow: the rows past the end are dropped, nothing else written
    dk, dv = cp.asarray(k_cache), cp.asarray(v_cache)
    cuattn.kv_cache_append(dk, dv, cp.asarray(k_new), cp.asarray(v_new),
                           cp.asarray([[48], [-2]]))
    want_k, want_v = k_cache.copy(), v_cache.copy()
    want_k[0, :, 48:50] = k_new[0, :, :2]
    want_v[0, :, 48:50] = v_new[0, :, :2]
    want_k[1, :, 0:2] = k_new[1, :, 2:]
    want_v[1, :, 0:2] = v_new[1, :, 2:]
    np.testing.assert_array_equal(to_host(dk), want_k)
    np.testing.assert_array_equal(to_host(dv), want_v)


def _emulate_kv_cache_append(memory, dtype, index):
    """cuda/kv_cache.cu's kernel, element by element, on host memory."""
    def run(block, pointers, grid):
        kc, vc, kn, vn, ln = pointers
        f = fields(block)
        item = np.dtype(dtype).itemsize
        for b in range(f["entries"]):
            length = int(memory.read(ln + batch_offset(f["len_s"], b, f) * index.itemsize,
                                     index))
            for i in range(f["new_rows"]):
                pos = length + i
                if not 0 <= pos < f["cache_rows"]:
                    continue
                for dst, ds, src, ss, cols in ((kc, f["kc_s"], kn, f["kn_s"], f["head_dim"]),
                                               (vc, f["vc_s"], vn, f["vn_s"], f["head_dim_v"])):
                    for c in range(cols):
                        to = batch_offset(ds, b, f) + pos * ds["row"] + c * ds["col"]
                        fro = batch_offset(ss, b, f) + i * ss["row"] + c * ss["col"]
                        memory.copy(dst + to * item, src + fro * item, item)
    return run


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), np.dtype(np.float64)], ids=str)
def test_device_launch_parameters_on_host_memory(dtype, monkeypatch):
    """The CuPy path's parameter block, grid and pointers, run through an emulation of the
    kernel on host memory: strided caches, broadcast new rows and lengths, 4 batch axes
    (one launch loop), and lengths that overflow (rows dropped)."""
    from _hostdev import Memory, fake_cupy, on_device

    from cuattn import cache
    from cuattn._checks_ragged import CacheAppend
    rng = np.random.default_rng(4)
    store = rng.standard_normal((2, 3, 4, 12, 2, 6)).astype(dtype)  # (a, b, c, S, d, D)
    k_cache = store.swapaxes(-2, -3).swapaxes(2, 3)                   # (a, b, d, c, S, D)
    v_cache = rng.standard_normal((2, 3, 2, 4, 12, 5)).astype(dtype)
    k_new = rng.standard_normal((2, 1, 2, 1, 3, 6)).astype(dtype)
    v_new = rng.standard_normal((2, 3, 2, 4, 3, 5)).astype(dtype)[..., ::-1, :]
    lengths = rng.integers(0, 10, (3, 1, 4))
    lengths[0, 0, 0] = 11                                             # two rows dropped
    want_k, want_v = k_cache.copy(), v_cache.copy()
    batch = k_cache.shape[:-2]
    n = k_new.shape[-2]
    for b in np.ndindex(*batch):
        at = int(np.broadcast_to(lengths, batch)[b])
        stop = min(at + n, 12)
        want_k[b][at:stop] = np.broadcast_to(k_new, batch + k_new.shape[-2:])[b][:stop - at]
        want_v[b][at:stop] = np.broadcast_to(v_new, batch + v_new.shape[-2:])[b][:stop - at]
    arrays = [k_cache, v_cache, k_new, v_new]
    grids = fake_cupy(monkeypatch,
                      _emulate_kv_cache_append(Memory(arrays), dtype, np.dtype(np.int64)),
                      ("k_cache", "v_cache", "k_new", "v_new", "lengths"), 128, arrays)
    call = CacheAppend(sys.modules["cupy"], *(on_device(x) for x in arrays), lengths, batch)
    cache._append_cupy(call)
    assert grids == [(3, 24), (3, 24)]  # a launch per index of the outer batch axis
    np.testing.assert_array_equal(k_cache, want_k)
    np.testing.assert_array_equal(v_cache, want_v)
