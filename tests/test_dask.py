"""Attention on Dask arrays: every chunking equals one in-memory call, lazily, per chunk."""
import subprocess
import sys
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuattn
from cuattn.reference import attention_reference

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (5, 3)},
    "left_window": {"window": (2, None)},
    "mask": {"mask": "mask"},
    "bias_softcap": {"bias": "bias", "softcap": 4.0},
}
# (query rows, keys) per chunk: one chunk, keys split, rows split, both, few rows
CHUNKINGS = [(40, 90), (40, 17), (7, 90), (13, 9), (3, 31)]


def _inputs(dtype, rng, sq=40, sk=90):
    q = rng.standard_normal((2, 3, sq, 16)).astype(dtype)
    k = rng.standard_normal((2, 1, sk, 16)).astype(dtype)  # shared by the 3 heads (GQA)
    v = rng.standard_normal((2, 1, sk, 8)).astype(dtype)
    extras = {"mask": rng.random((3, sq, sk)) > 0.3,
              "bias": rng.standard_normal((sq, 1)).astype(dtype)}
    return q, k, v, extras


def _kwargs(feature, extras, chunked=None):
    kw = dict(FEATURES[feature])
    for name in ("mask", "bias"):
        if name in kw:
            kw[name] = extras[name] if chunked is None else chunked(extras[name])
    return kw


def _ulp(dtype, ref):
    return float(ml_dtypes.finfo(dtype).eps) * float(np.max(np.abs(ref)))


def _check_forward(got, one, ref, dtype):
    """Within 2 ulp of the in-memory call for 16-bit outputs. float32 and float64 results
    carry several ulp of accumulation error that depends on the order of the sums, in the
    in-memory call as in each chunk's: there the error against the float64 reference is
    within 1.5 times the in-memory call's, plus 2 ulp."""
    got, one = got.astype(np.float64), one.astype(np.float64)
    ulp = _ulp(dtype, ref)
    if dtype.itemsize == 2:
        assert np.max(np.abs(got - one)) <= 2 * ulp
    else:
        assert np.max(np.abs(got - ref)) <= 1.5 * np.max(np.abs(one - ref)) + 2 * ulp


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_every_chunking_matches_one_call(dtype, feature):
    rng = np.random.default_rng(1)
    q, k, v, extras = _inputs(dtype, rng)
    kw = _kwargs(feature, extras)
    one, one_lse = cuattn.attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = attention_reference(q, k, v, **kw)
    for rows, keys in CHUNKINGS:
        dq = da.from_array(q, chunks=(1, 2, rows, 16))
        dk = da.from_array(k, chunks=(2, 1, keys, 16))
        dv = da.from_array(v, chunks=(1, 1, keys, 8))
        # masks and biases in chunks of their own, which the call aligns with q's and k's
        chunked = _kwargs(feature, extras, lambda x, rows=rows: da.from_array(
            x, chunks=(2,) * (x.ndim - 2) + (rows, 30 if x.shape[-1] != 1 else 1)))
        out, lse = cuattn.attention(dq, dk, dv, return_lse=True, **chunked)
        assert isinstance(out, da.Array) and out.chunks[2] == dq.chunks[2]
        got, got_lse = dask.compute(out, lse, scheduler="sync")
        assert got.dtype == dtype and got.shape == one.shape
        _check_forward(got, one, ref, dtype)
        assert np.array_equal(np.isinf(got_lse), np.isinf(one_lse))
        finite = np.isfinite(ref_lse)
        tol = 1e-12 if dtype == np.float64 else 2e-5
        np.testing.assert_allclose(got_lse[finite], one_lse[finite], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64), BF16], ids=str)
@pytest.mark.parametrize("feature", ["plain", "causal", "window", "mask"])
def test_backward_and_vjp_match_one_call(dtype, feature):
    rng = np.random.default_rng(2)
    q, k, v, extras = _inputs(dtype, rng, sq=24, sk=50)
    kw = _kwargs(feature, extras)
    dout = rng.standard_normal((2, 3, 24, 8)).astype(dtype)
    out, lse = cuattn.attention(q, k, v, return_lse=True, **kw)
    want = cuattn.attention_backward(dout, q, k, v, out, lse, **kw)
    for rows, keys in [(24, 50), (7, 13), (24, 9)]:
        dq = da.from_array(q, chunks=(2, 1, rows, 16))
        dk = da.from_array(k, chunks=(1, 1, keys, 16))
        dv = da.from_array(v, chunks=(2, 1, keys, 8))
        lazy_out, vjp = cuattn.attention_vjp(dq, dk, dv, **kw)
        grads = vjp(da.from_array(dout, chunks=(1, 3, 11, 8)))
        got = dask.compute(*grads, scheduler="threads")
        for g, w, x in zip(got, want, (q, k, v)):
            assert g.shape == x.shape and g.dtype == dtype
            # a gradient is a sum of per-chunk gradients, each rounded to the dtype once
            scale = float(np.max(np.abs(w.astype(np.float64))))
            tol = {2: 8, 4: 16, 8: 16}[dtype.itemsize] * float(ml_dtypes.finfo(dtype).eps)
            assert np.max(np.abs(g.astype(np.float64) - w.astype(np.float64))) <= tol * scale
        # attention_backward on Dask arrays, given the lazy forward's out and lse
        lazy_out, lazy_lse = cuattn.attention(dq, dk, dv, return_lse=True, **kw)
        again = cuattn.attention_backward(da.from_array(dout), dq, dk, dv, lazy_out, lazy_lse,
                                          **kw)
        for g, h in zip(got, dask.compute(*again, scheduler="sync")):
            np.testing.assert_array_equal(g, h)  # deterministic: a fixed tree order


def test_results_are_deterministic_across_schedulers():
    rng = np.random.default_rng(3)
    q, k, v, _ = _inputs(np.float32, rng, sq=33, sk=260)
    dq = da.from_array(q, chunks=(1, 3, 11, 16))
    dk = da.from_array(k, chunks=(2, 1, 20, 16))  # 13 key chunks: a two-level merge tree
    dv = da.from_array(v, chunks=(2, 1, 20, 8))
    out = cuattn.attention(dq, dk, dv, causal=True)
    first = out.compute(scheduler="sync")
    for scheduler in ("threads", "processes"):
        np.testing.assert_array_equal(out.compute(scheduler=scheduler), first)


def test_distributed_local_cluster_of_processes():
    distributed = pytest.importorskip("distributed")
    rng = np.random.default_rng(4)
    q, k, v, extras = _inputs(np.float64, rng)
    dq = da.from_array(q, chunks=(1, 3, 20, 16))
    dk = da.from_array(k, chunks=(2, 1, 30, 16))
    dv = da.from_array(v, chunks=(2, 1, 30, 8))
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        out, lse = cuattn.attention(dq, dk, dv, causal=True, return_lse=True)
        got, got_lse = client.compute([out, lse], sync=True)
        dout = da.ones_like(out)
        grads = client.compute(list(cuattn.attention_vjp(dq, dk, dv, causal=True)[1](dout)),
                               sync=True)
    one, one_lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(got, one, rtol=0, atol=1e-14)
    np.testing.assert_allclose(got_lse, one_lse, rtol=1e-14, atol=0)
    want = cuattn.attention_backward(np.ones_like(one), q, k, v, one, one_lse, causal=True)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-13)


def test_nothing_runs_until_compute_and_errors_come_first():
    calls = []

    def source(shape):
        calls.append(shape)
        return np.ones(shape, np.float32)

    q = da.from_delayed(dask.delayed(source)((4, 8)), (4, 8), dtype=np.float32)
    k = da.from_delayed(dask.delayed(source)((6, 8)), (6, 8), dtype=np.float32)
    out, lse = cuattn.attention(q, k, k, return_lse=True)
    dq, dk, dv = cuattn.attention_vjp(q, k, k)[1](da.ones((4, 8), dtype=np.float32))
    assert calls == []
    assert out.compute().shape == (4, 8) and len(calls) == 2
    # bad calls fail when the graph is built, with the in-memory call's errors
    with pytest.raises(ValueError, match="k has head dim 7 but q has 8"):
        cuattn.attention(q, da.ones((6, 7), dtype=np.float32), k)
    with pytest.raises(TypeError, match="share one dtype"):
        cuattn.attention(q, k.astype(np.float64), k)
    with pytest.raises(ValueError, match="window"):
        cuattn.attention(q, k, k, window=(-3, 0))
    with pytest.raises(TypeError, match="out is not supported with Dask arrays"):
        cuattn.attention(q, k, k, out=np.empty((4, 8), np.float32))
    with pytest.raises(ValueError, match="lse must have shape"):
        cuattn.attention_backward(q, q, k, k, q, lse[:2])
    unknown = q[q[:, 0] > 0]
    with pytest.raises(ValueError, match="unknown chunk sizes"):
        cuattn.attention(unknown, k, k)
    assert len(calls) == 2


def test_in_memory_arguments_join_dask_ones():
    rng = np.random.default_rng(5)
    q, k, v, extras = _inputs(np.float64, rng)
    dq = da.from_array(q, chunks=(1, 3, 13, 16))
    out = cuattn.attention(dq, k, v, mask=extras["mask"])
    np.testing.assert_allclose(out.compute(), cuattn.attention(q, k, v, mask=extras["mask"]),
                               rtol=0, atol=1e-14)


def test_causal_skips_key_chunks_no_row_sees():
    q = da.ones((256, 32), chunks=(64, 32), dtype=np.float32)
    k = da.ones((256, 32), chunks=(64, 32), dtype=np.float32)
    graph = dict(cuattn.attention(q, k, k, causal=True).__dask_graph__())
    parts = [key for key in graph if "cuattn-part-" in str(key)]
    assert len(parts) == 10  # query chunk i sees key chunks 0..i: 1 + 2 + 3 + 4
    graph = dict(cuattn.attention(q, k, k, window=(10, 0)).__dask_graph__())
    parts = [key for key in graph if "cuattn-part-" in str(key)]
    assert len(parts) == 7  # the diagonal chunk, and the one before it for chunks 1..3


def test_memory_per_task_is_of_the_chunks():
    """No task of a key-chunked call holds the whole K or V: each allocates a small multiple
    of one chunk's bytes (tracemalloc sees NumPy's allocations)."""
    from dask.callbacks import Callback
    rng = np.random.default_rng(6)
    sk, chunk = 16384, 512
    q = rng.standard_normal((64, 64)).astype(np.float32)
    k = rng.standard_normal((sk, 64)).astype(np.float32)
    dq = da.from_array(q, chunks=(64, 64))
    dk = da.from_array(k, chunks=(chunk, 64))
    out, lse = cuattn.attention(dq, dk, dk, return_lse=True)
    grads = cuattn.attention_vjp(dq, dk, dk)[1](da.ones((64, 64), dtype=np.float32, chunks=64))

    peaks = {}

    class Peak(Callback):
        def _pretask(self, key, dsk, state):
            tracemalloc.reset_peak()
            self.start = tracemalloc.get_traced_memory()[0]

        def _posttask(self, key, result, dsk, state, worker_id):
            peaks[key] = tracemalloc.get_traced_memory()[1] - self.start

    tracemalloc.start()
    try:
        with Peak():
            dask.compute(out, lse, *grads, scheduler="sync")
    finally:
        tracemalloc.stop()
    # the finalize tasks join the results the caller asked for (dK is as large as K)
    tasks = {key: peak for key, peak in peaks.items() if not str(key).startswith("finalize")}
    chunk_bytes = chunk * 64 * 4  # 128 KiB; K is 4 MiB
    worst = max(tasks.values())
    assert worst < 8 * chunk_bytes < k.nbytes, sorted(tasks.items(), key=lambda x: x[1])[-3:]


def test_dask_is_not_imported_without_dask_arrays():
    code = ("import sys, numpy as np, cuattn; x = np.ones((3, 4), np.float32); "
            "cuattn.attention(x, x, x); "
            "assert not any(m == 'dask' or m.startswith('dask.') for m in sys.modules), "
            "[m for m in sys.modules if m.startswith('dask')]")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16, np.dtype(np.float32)], ids=str)
def test_gpu_cupy_chunks_threaded(dtype):
    import cupy as cp
    rng = np.random.default_rng(7)
    q, k, v, extras = _inputs(dtype, rng, sq=300, sk=1000)
    one = cuattn.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=True)
    dq = da.from_array(cp.asarray(q), chunks=(1, 3, 128, 16), asarray=False)
    dk = da.from_array(cp.asarray(k), chunks=(2, 1, 250, 16), asarray=False)
    dv = da.from_array(cp.asarray(v), chunks=(2, 1, 250, 8), asarray=False)
    out = cuattn.attention(dq, dk, dv, causal=True)
    got = out.compute(scheduler="threads")
    assert isinstance(got, cp.ndarray) and got.dtype == dtype
    ref, _ = attention_reference(q, k, v, causal=True)
    _check_forward(cp.asnumpy(got), cp.asnumpy(one), ref, dtype)
    grads = cuattn.attention_vjp(dq, dk, dv, causal=True)[1](da.ones_like(out))
    for g, x in zip(dask.compute(*grads, scheduler="threads"), (q, k, v)):
        assert isinstance(g, cp.ndarray) and g.shape == x.shape


def test_docs_page_examples():
    import doctest
    import pathlib
    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "dask.rst"
    result = doctest.testfile(str(page), module_relative=False,
                              optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 5 and result.failed == 0


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_random_chunkings_and_features(data):
    """Random batch shapes (with broadcast keys), random chunk sizes on every axis, random
    features: the Dask result equals the in-memory call (float64), forward and backward."""
    draw = data.draw
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    k_batch = tuple(n if draw(st.booleans()) else 1 for n in batch)
    sq, sk = draw(st.integers(1, 24)), draw(st.integers(0, 30))
    q = rng.standard_normal(batch + (sq, 8))
    k = rng.standard_normal(k_batch + (sk, 8))
    v = rng.standard_normal(k_batch + (sk, 5))
    kw = {}
    if draw(st.booleans()):
        kw["causal"] = True
    if draw(st.booleans()):
        kw["window"] = (draw(st.sampled_from([None, 0, 2, 7])),
                        draw(st.sampled_from([None, 0, 3])))
    if draw(st.booleans()):
        kw["mask"] = rng.random((sq, sk)) > 0.3
    if draw(st.booleans()):
        kw["softcap"] = 3.0

    def chunks(shape):
        return tuple(draw(st.integers(1, max(n, 1))) for n in shape)

    dq = da.from_array(q, chunks=chunks(q.shape))
    dk = da.from_array(k, chunks=chunks(k.shape))
    dv = da.from_array(v, chunks=chunks(v.shape))
    dkw = dict(kw)
    if "mask" in kw:
        dkw["mask"] = da.from_array(kw["mask"], chunks=chunks(kw["mask"].shape))
    out, lse = cuattn.attention(q, k, v, return_lse=True, **kw)
    got, got_lse = dask.compute(*cuattn.attention(dq, dk, dv, return_lse=True, **dkw),
                                scheduler="sync")
    np.testing.assert_allclose(got, out, rtol=0, atol=1e-13)
    np.testing.assert_array_equal(np.isinf(got_lse), np.isinf(lse))
    finite = np.isfinite(lse)
    np.testing.assert_allclose(got_lse[finite], lse[finite], rtol=1e-13, atol=1e-13)
    dout = rng.standard_normal(out.shape)
    want = cuattn.attention_backward(dout, q, k, v, out, lse, **kw)
    grads = dask.compute(*cuattn.attention_backward(
        da.from_array(dout, chunks=chunks(dout.shape)), dq, dk, dv,
        da.from_array(out, chunks=chunks(out.shape)), da.from_array(lse, chunks=chunks(
            lse.shape)), **dkw), scheduler="sync")
    for g, w in zip(grads, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)
