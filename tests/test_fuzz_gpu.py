"""Seeded fuzz test: 2,000 random valid calls per dtype (float16, bfloat16, float32 in both
precisions, float64) on the GPU against the float64 reference, and the first 100 per dtype
on the NumPy backend (which CI runs).

Each call draws ragged lengths (0-300), a head dim (1-256; float32 and float64 to 512),
causal / window / mask / bias / softcap / scale, GQA broadcasting, BSHD and strided
views, ``out=`` (poisoned with NaN) and, for a quarter of the calls, the backward. Every
call also checks that its inputs are unchanged, that rows with no allowed key give 0 and
an lse of -inf, and (where a NaN is planted in one query row) that the NaN stays in its
row. A failure names the seed and the case, so ``_case(seed)`` rebuilds it.
"""
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

CALLS_PER_DTYPE = 2000
CPU_CALLS_PER_DTYPE = 100
CHUNK = 50  # calls per test item, so that pytest-xdist spreads them
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
          "float64": np.float64}
#: head-dim ranges, one per chunk in turn: a chunk compiles the instances of one range
BUCKETS = ((1, 64), (65, 128), (129, 256), (257, 512))


def _head_dim(rng, lo, hi):
    return int(rng.integers(lo, hi + 1))


def _case(dtype_name: str, seed: int) -> dict:
    """The arguments of one fuzz call, drawn from ``seed`` alone."""
    rng = np.random.default_rng(seed)
    wide = dtype_name in ("float32", "float64")
    lo, hi = BUCKETS[(seed // CHUNK) % (4 if wide else 3)]
    d = _head_dim(rng, lo, hi)
    dv = d if rng.random() < 0.6 else _head_dim(rng, lo, hi)
    sq = 0 if rng.random() < 0.03 else int(rng.integers(1, 301))
    sk = 0 if rng.random() < 0.03 else int(rng.integers(1, 301))
    case = {"dtype": dtype_name, "seed": seed, "sq": sq, "sk": sk, "d": d, "dv": dv,
            "batch": int(rng.integers(1, 3)), "heads": int(rng.integers(1, 4)),
            "gqa": rng.random() < 0.3, "layout": str(rng.choice(["bhsd", "bshd", "strided"])),
            "kw": {}, "mask": None, "bias": None, "out": rng.random() < 0.3,
            "backward": rng.random() < 0.25, "nan_row": None}
    kw = case["kw"]
    if dtype_name == "float32":
        kw["precision"] = str(rng.choice(["highest", "tf32"]))
    if rng.random() < 0.3:
        kw["causal"] = True
    if rng.random() < 0.2:
        kw["window"] = (int(rng.choice([-1, 0, 3, 40])), int(rng.choice([-1, 0, 5, 70])))
    if rng.random() < 0.2:
        kw["softcap"] = float(rng.choice([5.0, 20.0, 50.0]))
    if rng.random() < 0.2:
        kw["scale"] = float(rng.uniform(0.02, 0.5))
    if rng.random() < 0.3:
        case["mask"] = str(rng.choice(["keys", "full", "rows", "queries"]))
    if rng.random() < 0.3:
        case["bias"] = (str(rng.choice(["full", "keys", "heads"])),
                        str(rng.choice(["same", "float32"])))
    if not case["backward"] and sq > 2 and rng.random() < 0.1:
        case["nan_row"] = int(rng.integers(0, sq))
    return case


def _xp(gpu: bool):
    return _cp() if gpu else np


def _arrays(case, gpu):
    """Host arrays (the values) and the call's arrays (a separate copy, in the layout the
    case names, on the GPU when ``gpu``) of q, k, v, mask and bias."""
    xp = _xp(gpu)
    rng = np.random.default_rng(case["seed"] + 1)
    dtype = DTYPES[case["dtype"]]
    b, h, sq, sk, d, dv = (case[n] for n in ("batch", "heads", "sq", "sk", "d", "dv"))
    groups = 2 if case["gqa"] else 1
    q_shape = (b, h, groups, sq, d)
    kv_lead = (b, h, 1)

    def make(shape):
        x = rng.standard_normal(shape).astype(dtype)
        if case["layout"] == "bshd":  # stored (..., S, H-like, D), passed as a swapped view
            stored = np.ascontiguousarray(np.swapaxes(x, -2, -3))
            return x, xp.array(stored).swapaxes(-2, -3)
        if case["layout"] == "strided":  # every other row of a longer sequence
            wide = np.zeros(shape[:-2] + (2 * shape[-2], shape[-1]), dtype)
            wide[..., ::2, :] = x
            return x, xp.array(wide)[..., ::2, :]
        return x, xp.array(x)

    q, qd = make(q_shape)
    if case["nan_row"] is not None:
        q[..., case["nan_row"], :] = np.nan
        qd[..., case["nan_row"], :] = np.nan
    k, kd = make(kv_lead + (sk, d))
    v, vd = make(kv_lead + (sk, dv))
    host, dev = {}, {}
    if case["mask"] is not None:
        shape = {"keys": (b, 1, 1, 1, sk), "full": (b, h, groups, sq, sk),
                 "rows": (sq, sk), "queries": (sq, 1)}[case["mask"]]
        m = rng.random(shape) > 0.25
        host["mask"], dev["mask"] = m, xp.array(m)
    if case["bias"] is not None:
        kind, bdt = case["bias"]
        shape = {"full": (b, h, groups, sq, sk), "keys": (b, 1, 1, 1, sk),
                 "heads": (h, 1, sq, sk)}[kind]
        bias = rng.standard_normal(shape).astype(dtype if bdt == "same" else np.float32)
        host["bias"], dev["bias"] = bias, xp.array(bias)
    return (q, k, v), (qd, kd, vd), host, dev


def _same_bits(dev, host):
    a, b = to_host(dev), np.ascontiguousarray(host)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def _run(case, gpu=True):
    xp = _xp(gpu)
    (q, k, v), (qd, kd, vd), host, dev = _arrays(case, gpu)
    kw = case["kw"]
    out_shape = np.broadcast_shapes(q.shape[:-2], k.shape[:-2]) + (case["sq"], case["dv"])
    out_arg = xp.full(out_shape, np.nan, q.dtype) if case["out"] else None
    out, lse = cuattn.attention(qd, kd, vd, return_lse=True, out=out_arg, **kw, **dev)
    if out_arg is not None:
        assert out is out_arg
    for x, xh in ((qd, q), (kd, k), (vd, v), *((dev[n], host[n]) for n in dev)):
        assert _same_bits(x, xh), "an input changed"
    ref, ref_lse = attention_reference(q, k, v, **kw, **host)
    out_h, lse_h = to_host(out), to_host(lse)
    assert_accurate(out_h, ref, naive_attention(q, k, v, **kw, **host))
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse_h), empty), "rows without keys: lse"
    assert (out_h[empty] == 0).all(), "rows without keys: out"
    if case["nan_row"] is not None:
        rows = np.isnan(out_h).any(axis=-1)
        assert not np.delete(rows, case["nan_row"], axis=-1).any(), "NaN left its row"
    if case["backward"]:
        rng = np.random.default_rng(case["seed"] + 2)
        dout = rng.standard_normal(out.shape).astype(q.dtype)
        grads = cuattn.attention_backward(xp.asarray(dout), qd, kd, vd, out, lse, **kw, **dev)
        refs = attention_backward_reference(dout, q, k, v, **kw, **host)
        naive = naive_attention_backward(dout, q, k, v, **kw, **host)
        for g, r, n, x, what in zip(grads, refs, naive, (q, k, v), ("dq", "dk", "dv")):
            assert g.shape == x.shape and g.dtype == x.dtype, what
            assert_accurate(to_host(g), r, n, factor=3.0, what=what)


def _run_chunk(dtype_name, seeds, gpu):
    failures = []
    for seed in seeds:
        case = _case(dtype_name, seed)
        try:
            _run(case, gpu)
        except Exception as err:  # noqa: BLE001 - collect every failing case of the chunk
            failures.append(f"seed {seed} {case}: {type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''}")
    assert not failures, (f"{len(failures)} of {len(seeds)} calls failed:\n"
                          + "\n".join(failures))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("chunk", range(CALLS_PER_DTYPE // CHUNK))
def test_fuzz_gpu(dtype_name, chunk):
    _run_chunk(dtype_name, range(chunk * CHUNK, (chunk + 1) * CHUNK), gpu=True)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_fuzz_numpy(dtype_name):
    _run_chunk(dtype_name, range(CPU_CALLS_PER_DTYPE), gpu=False)
