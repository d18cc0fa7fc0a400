"""cuattn.accuracy: its dense float64 reference against cuattn.reference, the coverage of
its grid, its one-allowed-key check, and a quick run end to end on the NumPy backend (and,
with a GPU, on CuPy)."""
import doctest
import json
from collections import Counter

import ml_dtypes
import numpy as np
import pytest
from _gpu_matrix import cupy as _cp

from cuattn import accuracy
from cuattn._accuracy_grid import (
    HALF_DTYPES,
    HEAD_DIMS,
    HEADS_KV,
    LAYOUTS,
    ONE_KEY_CASES,
    ONE_KEY_DTYPES,
    QUANTITIES,
    QUICK_CASES,
    SEQLENS,
    AccuracyCase,
    dense_attention,
    dense_attention_grads,
    half_grid,
)
from cuattn.reference import attention_backward_reference, attention_reference

DENSE_SHAPES = [  # q shape, k and v shape, causal
    ((2, 3, 17, 8), (2, 3, 17, 8), False),
    ((2, 3, 13, 8), (2, 3, 29, 8), True),   # Sq < Sk: row i sees keys up to i + 16
    ((2, 3, 29, 8), (2, 3, 13, 8), True),   # Sq > Sk: the first 16 rows see no key
    ((2, 2, 3, 11, 16), (2, 2, 1, 19, 16), True),   # GQA: 2 K/V heads, 3 query heads each
    ((2, 1, 6, 19, 16), (2, 1, 1, 11, 16), False),  # MQA
]
DENSE_IDS = ["mha", "causal-sq<sk", "causal-sq>sk", "gqa-causal", "mqa"]


def _draw(rng, shapes, dtype):
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


@pytest.mark.parametrize("dtype", [np.float64, ml_dtypes.bfloat16])
@pytest.mark.parametrize("q_shape,kv_shape,causal", DENSE_SHAPES, ids=DENSE_IDS)
def test_dense_forward_matches_the_reference(q_shape, kv_shape, causal, dtype):
    q, k, v = _draw(np.random.default_rng(1), (q_shape, kv_shape, kv_shape), dtype)
    out, lse = dense_attention(q, k, v, causal=causal)
    ref, ref_lse = attention_reference(q, k, v, causal=causal)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-13)  # -inf where ref's is


def test_dense_causal_is_bottom_right_aligned():
    q, k, v = _draw(np.random.default_rng(2), ((1, 29, 8), (1, 13, 8), (1, 13, 8)), np.float64)
    out, lse = dense_attention(q, k, v, causal=True)
    assert np.all(out[:, :16] == 0) and np.all(np.isneginf(lse[:, :16]))
    np.testing.assert_allclose(out[:, 16], v[:, 0], rtol=0, atol=0)  # its only key: the first
    np.testing.assert_allclose(out[:, -1], dense_attention(q[:, -1:], k, v)[0][:, 0],
                               rtol=1e-14)  # the last row sees every key


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
@pytest.mark.parametrize("q_shape,kv_shape,causal", DENSE_SHAPES, ids=DENSE_IDS)
def test_dense_gradients_match_the_reference(q_shape, kv_shape, causal, dtype):
    rng = np.random.default_rng(3)
    q, k, v = _draw(rng, (q_shape, kv_shape, kv_shape), dtype)
    dout = rng.standard_normal(np.broadcast_shapes(q_shape[:-1], kv_shape[:-2] + (1,))
                               + (kv_shape[-1],)).astype(dtype)
    out, dq, dk, dv = dense_attention_grads(dout, q, k, v, causal=causal)
    np.testing.assert_allclose(out, attention_reference(q, k, v, causal=causal)[0],
                               rtol=1e-12, atol=1e-13)
    for got, ref in zip((dq, dk, dv),
                        attention_backward_reference(dout, q, k, v, causal=causal)):
        assert got.shape == ref.shape  # GQA: dk and dv summed over each group's heads
        np.testing.assert_allclose(got, ref, rtol=1e-11, atol=1e-12)


def test_half_grid_covers_every_option():
    cases = half_grid()
    assert len(cases) == len(SEQLENS) * len(HEAD_DIMS) == 120
    assert len({c.label for c in cases}) == len(cases)
    assert all(c.batch == 2 and c.heads_q == 6 for c in cases)
    assert {(c.seqlen_q, c.seqlen_k) for c in cases} == set(SEQLENS)
    assert {(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256),
            (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048)} == set(SEQLENS)
    assert {(c.seqlen_q, c.seqlen_k, c.head_dim) for c in cases} == {
        (sq, sk, d) for sq, sk in SEQLENS for d in HEAD_DIMS}
    assert {32, 40, 59, 64, 80, 96, 111, 128, 256} <= set(HEAD_DIMS)
    assert min(HEAD_DIMS) == 32 and max(HEAD_DIMS) == 256
    options = {"dtype": set(HALF_DTYPES), "causal": {False, True},
               "heads_kv": set(HEADS_KV), "layout": set(LAYOUTS)}
    assert options["dtype"] == {"float16", "bfloat16"} and options["heads_kv"] == {6, 2, 1}
    assert options["layout"] == {"bhsd", "bshd"}
    assert {c.grouping for c in cases} == {"mha", "gqa", "mqa"}
    # every (Sq, Sk) and every head dim meets every value of every option
    for axis in (lambda c: (c.seqlen_q, c.seqlen_k), lambda c: c.head_dim):
        for value in {axis(c) for c in cases}:
            group = [c for c in cases if axis(c) == value]
            for name, values in options.items():
                assert {getattr(c, name) for c in group} == values, (value, name)
    # and the four options occur in all 24 combinations, 4 to 6 times each
    combos = Counter(tuple(getattr(c, n) for n in options) for c in cases)
    assert len(combos) == 24 and 4 <= min(combos.values()) <= max(combos.values()) <= 6


def test_quick_cases_are_small_and_cover_the_options():
    half = QUICK_CASES["half"]
    assert {c.dtype for c in half} == set(HALF_DTYPES)
    assert {c.causal for c in half} == {False, True}
    assert {c.grouping for c in half} == {"mha", "gqa", "mqa"}
    assert {c.layout for c in half} == set(LAYOUTS)
    assert any(c.causal and c.seqlen_q > c.seqlen_k for c in half)  # rows with no key
    cases = [c for section in QUICK_CASES.values() for c in section]
    assert all(c.seqlen_q * c.seqlen_k <= 256 * 256 for c in cases)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inputs_are_views_of_one_layout(layout):
    case = AccuracyCase("float16", 7, 9, 8, heads_kv=2, layout=layout)
    (q4, k4, v4, dout4), (q5, k5, v5, dout5) = accuracy._inputs(case, np)
    assert q4.shape == (2, 6, 7, 8) and k4.shape == v4.shape == (2, 2, 9, 8)
    assert q5.shape == (2, 2, 3, 7, 8) and k5.shape == v5.shape == (2, 2, 1, 9, 8)
    assert np.shares_memory(q4, q5) and np.shares_memory(k4, k5)
    np.testing.assert_array_equal(q5.reshape(q4.shape), q4)  # query head h = 3 * kv + g
    np.testing.assert_array_equal(dout5.reshape(dout4.shape), dout4)
    assert q4.flags.c_contiguous == (layout == "bhsd")  # BSHD: a strided (B, H, S, D) view
    # element steps of (B, H, S, D): BSHD memory steps over heads by D, over rows by H * D
    steps = (7 * 6 * 8, 8, 6 * 8, 1) if layout == "bshd" else (6 * 7 * 8, 7 * 8, 8, 1)
    assert tuple(s // q4.itemsize for s in q4.strides) == steps


def _exact_forward(q, k, v, *, return_lse, causal, **kw):
    out, lse = dense_attention(q, k, v, causal=causal)
    return out.astype(q.dtype), lse


def _zero_backward(dout, q, k, v, out, lse, **kw):
    return np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)


@pytest.mark.parametrize("dtype", ["float16", "float64"])
@pytest.mark.parametrize("kind", ONE_KEY_CASES)
def test_one_key_check_tells_exact_from_inexact(kind, dtype):
    entry = accuracy._one_key(kind, dtype, np, _exact_forward, _zero_backward)
    assert entry == {"dtype": dtype, "case": kind, "out_exact": True, "dk_zero": True,
                     "dq_zero": True, "dk_max": 0.0}

    def off_forward(q, k, v, **kw):
        out, lse = _exact_forward(q, k, v, **kw)
        out[0, 0, 0, 0] = np.nextafter(out[0, 0, 0, 0], np.inf, dtype=out.dtype)
        return out, lse

    def off_backward(*args, **kw):
        dq, dk, dv = _zero_backward(*args, **kw)
        dk[1, 2, 0, 3] = 2.0**-20
        return dq, dk, dv

    entry = accuracy._one_key(kind, dtype, np, off_forward, off_backward)
    assert not entry["out_exact"] and not entry["dk_zero"] and entry["dq_zero"]
    assert entry["dk_max"] == 2.0**-20

    def failing(*args, **kw):
        raise NotImplementedError("not served")

    entry = accuracy._one_key(kind, dtype, np, failing, _zero_backward)
    assert entry["error"] == "NotImplementedError: not served"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    path = tmp_path_factory.mktemp("accuracy") / "accuracy.json"
    lines = []
    result = accuracy.run(quick=True, json_path=path, progress=lines.append, xp=np)
    return result, path, lines


#: max |error| cuattn's NumPy backend stays under, per section (sanity, not the rule)
SANE = {"half": 0.05, "float32": 1e-4, "float64": 1e-12}


def test_quick_run_on_numpy(quick):
    result, path, lines = quick
    assert {"environment", "half", "float32", "float64", "one_key", "within",
            "ulps"} <= set(result)
    assert result["environment"]["backend"] == "numpy"
    assert result["environment"]["torch"] is None
    assert len(lines) == sum(len(cases) for cases in QUICK_CASES.values())
    for key, cases in QUICK_CASES.items():
        section = result[key]
        assert section["peers"] == []
        assert [c["label"] for c in section["cases"]] == [c.label for c in cases]
        for c in section["cases"]:
            assert c["notes"] == {} and set(c["errors"]) == {"cuattn"}
            for q in QUANTITIES:
                err = c["errors"]["cuattn"][q]
                assert 0 < err["mean"] <= err["max"] < SANE[key], (c["label"], q)
    for key in ("half", "float32"):
        summary = result[key]["summary"]
        assert summary["note"] == "no peer was available"
        assert all(summary[q] == {"count": 0} for q in QUANTITIES)
        assert all(r is None for c in result[key]["cases"] for r in c["ratios"].values())
    for c in result["float64"]["cases"]:
        assert set(c["ulp_ratios"]) == {"cuattn"}
        assert all(r > 0 for r in c["ulp_ratios"]["cuattn"].values())
    assert [(e["dtype"], e["case"]) for e in result["one_key"]] == [
        (d, k) for d in ONE_KEY_DTYPES for k in ONE_KEY_CASES]
    for e in result["one_key"]:
        assert all(isinstance(e[n], bool) for n in ("out_exact", "dk_zero", "dq_zero"))
        assert e["dk_max"] >= 0
    assert json.loads(path.read_text()) == json.loads(json.dumps(result, allow_nan=False))


def test_quick_report_has_every_section_and_case(quick):
    result, _, _ = quick
    report = accuracy.format_report(result)
    for title in ("16-bit grid", 'float32, precision="highest"', "float64",
                  "One allowed key", "no peer was available"):
        assert title in report
    for key in QUICK_CASES:
        for c in result[key]["cases"]:
            assert c["label"] in report
    widths = {line.count("|") for line in report.splitlines() if line.startswith("| case")}
    assert widths == {2 + 4 * 2, 7}  # case + (cuattn, ratio) x 4; case, impl + 4


def test_docstring_examples():
    result = doctest.testmod(accuracy, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.gpu
def test_quick_run_on_cupy(tmp_path):
    cp = _cp()
    rng = np.random.default_rng(4)
    q, k, v = _draw(rng, ((2, 2, 3, 33, 40), (2, 2, 1, 47, 40), (2, 2, 1, 47, 40)), np.float32)
    dout = rng.standard_normal((2, 2, 3, 33, 40)).astype(np.float32)
    host = dense_attention_grads(dout, q, k, v, causal=True)
    device = dense_attention_grads(*(cp.asarray(x) for x in (dout, q, k, v)), causal=True)
    for h, d in zip(host, device):
        assert isinstance(d, cp.ndarray)
        np.testing.assert_allclose(d.get(), h, rtol=1e-12, atol=1e-13)

    path = tmp_path / "accuracy.json"
    result = accuracy.run(quick=True, json_path=path, progress=lambda line: None, xp=cp)
    assert result["environment"]["backend"] == "cupy" and result["environment"]["gpu"]
    for key in QUICK_CASES:
        for c in result[key]["cases"]:
            assert c["errors"]["cuattn"] is not None, c["notes"].get("cuattn")
            for q in QUANTITIES:
                assert c["errors"]["cuattn"][q]["max"] < SANE[key], (c["label"], q)
    assert all("error" not in e for e in result["one_key"])
    if result["environment"]["torch"] is not None:
        assert result["half"]["peers"] == ["torch flash", "torch cudnn"]
        assert any(c["ratios"]["out"] is not None for c in result["half"]["cases"])
    json.loads(path.read_text())
    assert accuracy.format_report(result)
