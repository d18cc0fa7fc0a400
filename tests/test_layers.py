"""``multi_head_attention`` and the ViT encoder block of docs/vit.rst against float64.

The CPU tests run the layer on the NumPy backend, and its cuBLAS path on host memory with
an emulated ``cublasGemmEx`` (column-major, leading dims, transposes, beta), so that the
arguments the GPU receives are checked where no GPU is. The GPU tests run it on CuPy.
"""
import ctypes
import doctest
import re
import sys
import textwrap
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from _accuracy import assert_accurate, to_host

import cuattn
from cuattn import layers
from cuattn.reference import attention_reference, naive_attention, round_tf32

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
ROOT = Path(__file__).resolve().parents[1]
VIT_PAGE = ROOT / "docs" / "vit.rst"


def _dtype_id(d):
    return np.dtype(d).name


def _inputs(rng, dtype, batch=(2,), n=13, embed=24, biases="all"):
    x = rng.standard_normal(batch + (n, embed)).astype(dtype)
    ws = [(rng.standard_normal((embed, embed)) / np.sqrt(embed)).astype(dtype) for _ in range(4)]
    bs = [(0.5 * rng.standard_normal(embed)).astype(dtype) for _ in range(4)]
    if biases == "none":
        bs = [None] * 4
    elif biases == "some":
        bs = [bs[0], None, bs[2], None]
    return x, ws, bs


def _bias_kw(bs):
    return {n: b for n, b in zip(("b_q", "b_k", "b_v", "b_o"), bs) if b is not None}


def layer_reference(x, ws, bs, heads, **kw):
    """The layer in float64 from the given (already rounded) inputs."""
    x = np.asarray(x, np.float64)
    ws = [np.asarray(w, np.float64) for w in ws]
    bs = [None if b is None else np.asarray(b, np.float64) for b in bs]
    lead, embed = x.shape[:-1], x.shape[-1]

    def linear(a, w, b):
        return a @ w if b is None else a @ w + b

    q, k, v = (linear(x, w, b).reshape(lead + (heads, embed // heads)).swapaxes(-2, -3)
               for w, b in zip(ws[:3], bs[:3]))
    out, _ = attention_reference(q, k, v, **kw)
    return linear(out.swapaxes(-2, -3).reshape(x.shape), ws[3], bs[3])


def naive_layer(x, ws, bs, heads, precision=None, **kw):
    """The yardstick: the layer computed plainly in the input dtype, each product and each
    bias addition rounded to it (16-bit products accumulate in float32), attention by
    ``naive_attention``; with ``precision="tf32"`` the product operands are TF32."""
    dtype = x.dtype
    work = np.float32 if dtype.itemsize == 2 else dtype
    op = round_tf32 if precision == "tf32" else (lambda a: a)
    lead, embed = x.shape[:-1], x.shape[-1]

    def linear(a, w, b):
        y = (op(a.astype(work)) @ op(w.astype(work))).astype(dtype)
        return y if b is None else (y.astype(work) + b.astype(work)).astype(dtype)

    q, k, v = (linear(x, w, b).reshape(lead + (heads, embed // heads)).swapaxes(-2, -3)
               for w, b in zip(ws[:3], bs[:3]))
    out = naive_attention(q, k, v, precision=precision, **kw)
    return linear(out.swapaxes(-2, -3).reshape(x.shape), ws[3], bs[3])


def _check(got, x, ws, bs, heads, precision=None, factor=2.0, **kw):
    got = to_host(got)
    host = [to_host(a) for a in (x, *ws)]
    bs = [None if b is None else to_host(b) for b in bs]
    kw = {n: to_host(m) for n, m in kw.items()} if "mask" in kw else kw
    assert got.dtype == host[0].dtype and got.shape == host[0].shape
    assert_accurate(got, layer_reference(host[0], host[1:], bs, heads, **kw),
                    naive_layer(host[0], host[1:], bs, heads, precision=precision, **kw),
                    factor=factor)


LAYER_FEATURES = {
    "plain": lambda rng, b, n: {},
    "causal": lambda rng, b, n: {"causal": True},
    "mask": lambda rng, b, n: {"mask": rng.random((b, 1, n, n)) > 0.3},
}


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("biases", ["none", "all", "some"])
@pytest.mark.parametrize("feature", list(LAYER_FEATURES))
def test_numpy_layer_matches_float64(dtype, biases, feature):
    rng = np.random.default_rng(list(LAYER_FEATURES).index(feature) * 10 + len(biases))
    x, ws, bs = _inputs(rng, dtype, biases=biases)
    kw = LAYER_FEATURES[feature](rng, 2, 13)
    got = cuattn.multi_head_attention(x, *ws, num_heads=3, **_bias_kw(bs), **kw)
    assert isinstance(got, np.ndarray) and got.flags.c_contiguous
    _check(got, x, ws, bs, 3, **kw)


def test_numpy_layer_shapes_precision_and_empty():
    rng = np.random.default_rng(1)
    x, ws, bs = _inputs(rng, np.float32, batch=(), n=9, embed=16)  # x of shape (N, E)
    got = cuattn.multi_head_attention(x, *ws, num_heads=2, precision="tf32", **_bias_kw(bs))
    _check(got, x, ws, bs, 2)  # NumPy products stay exact under tf32
    x, ws, bs = _inputs(rng, np.float32, batch=(2, 3), n=5, embed=16)
    mask = rng.random((5, 5)) > 0.5
    got = cuattn.multi_head_attention(x, *ws, num_heads=4, mask=mask, **_bias_kw(bs))
    _check(got, x, ws, bs, 4, mask=mask)
    for shape in ((0, 5, 16), (2, 0, 16)):
        empty = np.zeros(shape, np.float32)
        assert cuattn.multi_head_attention(empty, *ws, num_heads=4).shape == shape


# ---- the cuBLAS path on host memory ---------------------------------------------------

_CUDA_TYPES = {2: np.float16, 14: ml_dtypes.bfloat16, 0: np.float32, 1: np.float64}


def _host_matrix(ptr, rows, cols, ld, dtype):
    """The column-major (rows, cols) matrix with leading dim ``ld`` at host address ptr."""
    dtype = np.dtype(dtype)
    size = ((cols - 1) * ld + rows) * dtype.itemsize
    buffer = (ctypes.c_char * size).from_address(ptr)
    return np.ndarray((rows, cols), dtype, buffer=buffer,
                      strides=(dtype.itemsize, ld * dtype.itemsize))


class EmulatedGemmEx:
    """cublasGemmEx on host memory: C = alpha op(A) op(B) + beta C, column-major, products
    in float64 (TF32 operands for CUBLAS_COMPUTE_32F_FAST_TF32), rounded once to C's type;
    it checks what cuBLAS requires of the leading dims."""

    def __init__(self):
        self.calls = []

    def __call__(self, handle, transa, transb, m, n, k, alpha, a, atype, lda, b, btype, ldb,
                 beta, c, ctype, ldc, compute, algo):
        assert atype == btype == ctype and transa in (0, 1) and transb in (0, 1)
        dtype = _CUDA_TYPES[ctype]
        assert compute == {2: 68, 14: 68, 0: 68, 1: 70}[ctype] or (ctype, compute) == (0, 77)
        self.calls.append({"m": m, "n": n, "k": k, "compute": compute, "algo": algo})
        scalar = np.float64 if compute == 70 else np.float32
        alpha, beta = (float(_host_matrix(p, 1, 1, 1, scalar)[0, 0]) for p in (alpha, beta))
        assert lda >= max(1, m if transa == 0 else k) and ldb >= max(1, k if transb == 0 else n)
        assert ldc >= max(1, m)
        op_a = _host_matrix(a, m, k, lda, dtype) if transa == 0 else \
            _host_matrix(a, k, m, lda, dtype).T
        op_b = _host_matrix(b, k, n, ldb, dtype) if transb == 0 else \
            _host_matrix(b, n, k, ldb, dtype).T
        op_a, op_b = op_a.astype(np.float64), op_b.astype(np.float64)
        if compute == 77:
            op_a, op_b = round_tf32(op_a).astype(np.float64), round_tf32(op_b).astype(np.float64)
        result = _host_matrix(c, m, n, ldc, dtype)
        acc = alpha * (op_a @ op_b)
        if beta:
            acc += beta * result.astype(np.float64)
        result[...] = acc.astype(dtype)


def _weight_layouts(ws, bs, layout):
    """The same weights and biases in the memory layout ``layout``: separate C arrays,
    Fortran arrays, column blocks of one (E, 3E) array, transposed row blocks of a (3E, E)
    array (PyTorch's in_proj_weight), or with no unit stride (copied before the product)."""
    e = ws[0].shape[0]
    if layout == "fortran":
        return [np.asfortranarray(w) for w in ws], bs
    if layout == "packed_columns":
        w = np.concatenate(ws[:3], axis=1)
        b = np.concatenate(bs[:3])
        return [w[:, :e], w[:, e:2 * e], w[:, 2 * e:], ws[3]], [b[:e], b[e:2 * e], b[2 * e:], bs[3]]
    if layout == "in_proj_rows":
        w = np.concatenate([m.T for m in ws[:3]], axis=0)  # (3E, E), rows are outputs
        return [w[:e].T, w[e:2 * e].T, w[2 * e:].T, ws[3]], bs
    if layout == "strided":
        wide = [np.repeat(w, 2, axis=1)[:, ::2] for w in ws]  # column stride 2 elements
        return wide, bs
    return ws, bs


LAYOUTS = ["separate", "fortran", "packed_columns", "in_proj_rows", "strided"]


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cublas_path_on_emulated_gemm(dtype, layout):
    rng = np.random.default_rng(LAYOUTS.index(layout))
    x, ws, bs = _inputs(rng, dtype, batch=(2,), n=11, embed=24)
    ws2, bs2 = _weight_layouts(ws, bs, layout)
    gemm = EmulatedGemmEx()
    products = layers._CublasProducts(np.dtype(dtype), None, gemm, 0, np)
    params = dict(zip(("w_q", "w_k", "w_v", "w_o"), ws2)) | dict(
        zip(("b_q", "b_k", "b_v", "b_o"), bs2))
    args = layers._check_layer(x, np, params, 3, None, None)
    got = layers._layer(x, args, 3, True, products)
    _check(got, x, ws, bs, 3, causal=True)
    packed = layout in ("packed_columns", "in_proj_rows")
    assert len(gemm.calls) == (2 if packed else 4)
    if packed:
        assert gemm.calls[0]["m"] == 3 * 24 and gemm.calls[0]["n"] == 22


@pytest.mark.parametrize("biases", ["none", "some"])
def test_cublas_path_packed_weights_with_some_or_no_biases(biases):
    rng = np.random.default_rng(7)
    x, ws, bs = _inputs(rng, np.float16, batch=(3,), n=6, embed=16, biases=biases)
    ws2, _ = _weight_layouts(ws, [np.zeros(16, np.float16)] * 4, "packed_columns")
    gemm = EmulatedGemmEx()
    products = layers._CublasProducts(np.dtype(np.float16), None, gemm, 0, np)
    params = dict(zip(("w_q", "w_k", "w_v", "w_o"), ws2)) | dict(
        zip(("b_q", "b_k", "b_v", "b_o"), bs))
    got = layers._layer(x, layers._check_layer(x, np, params, 2, None, None), 2, False,
                        products)
    _check(got, x, ws, bs, 2)
    assert len(gemm.calls) == (2 if biases == "none" else 4)  # one product needs every bias


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("cols", [1, 3, 4, 6, 768])
def test_bias_rows_copy_the_bits(dtype, cols):
    """Bias rows, copied as wider integers where a row allows it, hold the bias's bits in
    every row (NaN payloads and -0 included), in a contiguous output and in a column block
    of a wider one."""
    rng = np.random.default_rng(cols)
    bits = rng.integers(0, 2 ** (8 * np.dtype(dtype).itemsize), cols, dtype=np.uint64)
    row = bits.astype(f"u{np.dtype(dtype).itemsize}").view(dtype)
    want = np.broadcast_to(row, (5, cols)).view(f"u{np.dtype(dtype).itemsize}")
    out = np.zeros((5, cols), dtype)
    layers._fill_rows(np, out, row)
    assert np.array_equal(out.view(want.dtype), want)
    wide = np.zeros((5, 3 * cols), dtype)
    layers._fill_rows(np, wide[:, cols:2 * cols], row)
    assert np.array_equal(wide[:, cols:2 * cols].view(want.dtype), want)
    assert not wide[:, :cols].view(want.dtype).any() and not wide[:, 2 * cols:].view(
        want.dtype).any()


def test_gemm_algorithm_takes_tensor_ops_for_16_bit_products():
    """16-bit products pass the tensor-op algorithm where CuPy's matmul does (compute
    capability 8.0 on, 7.0 for float16); float32 and float64 keep cuBLAS's own choice, and
    every product of a layer passes the products' algorithm."""
    f16, bf16, f32, f64 = (np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16,
                                                  np.float32, np.float64))
    assert [layers._gemm_algo(d, 90) for d in (f16, bf16, f32, f64)] == [99, 99, -1, -1]
    assert [layers._gemm_algo(d, 75) for d in (f16, bf16)] == [99, -1]
    assert layers._gemm_algo(f16, 61) == -1
    rng = np.random.default_rng(9)
    x, ws, bs = _inputs(rng, np.float16, batch=(2,), n=5, embed=16)
    gemm = EmulatedGemmEx()
    products = layers._CublasProducts(f16, None, gemm, 0, np, algo=99)
    params = dict(zip(("w_q", "w_k", "w_v", "w_o"), ws)) | dict(
        zip(("b_q", "b_k", "b_v", "b_o"), bs))
    got = layers._layer(x, layers._check_layer(x, np, params, 2, None, None), 2, False,
                        products)
    assert {c["algo"] for c in gemm.calls} == {99}
    _check(got, x, ws, bs, 2)


def test_cublas_path_tf32_uses_the_tf32_compute_type():
    rng = np.random.default_rng(8)
    x, ws, bs = _inputs(rng, np.float32, batch=(2,), n=9, embed=16)
    gemm = EmulatedGemmEx()
    products = layers._CublasProducts(np.dtype(np.float32), "tf32", gemm, 0, np)
    params = dict(zip(("w_q", "w_k", "w_v", "w_o"), ws)) | dict(
        zip(("b_q", "b_k", "b_v", "b_o"), bs))
    got = layers._layer(x, layers._check_layer(x, np, params, 2, None, "tf32"), 2, False,
                        products)
    assert {c["compute"] for c in gemm.calls} == {77}
    _check(got, x, ws, bs, 2, precision="tf32")


@pytest.mark.parametrize("feature", list(LAYER_FEATURES))
def test_kept_layer_calls_on_host_memory(feature, monkeypatch):
    """The CuPy layer path through a CuPy stand-in on host memory (emulated cuBLAS and
    attention kernel): the first call of a signature validates and plans, later calls
    (new x, weights changed in place, new biases and mask) skip both and launch the kept
    attention plan at their own buffers; each result is the float64 layer's."""
    from _hostdev import fake_gpu

    arrays, launches = [], []
    device = fake_gpu(monkeypatch, arrays, launches, np.float16)
    gemm = EmulatedGemmEx()
    monkeypatch.setattr(layers._CublasProducts, "current", classmethod(
        lambda cls, dtype, precision: cls(dtype, precision, gemm, 0, sys.modules["cupy"])))
    monkeypatch.setattr(layers, "_kept", {})
    checks = []
    real = layers.check_attention
    monkeypatch.setattr(layers, "check_attention",
                        lambda *a, **k: checks.append(1) or real(*a, **k))

    def on_device(a):
        d = device(a.shape, a.dtype)
        d[...] = a
        return d

    rng = np.random.default_rng(70 + list(LAYER_FEATURES).index(feature))
    dws = None
    for _ in range(3):
        x, ws, bs = _inputs(rng, np.float16, batch=(2,), n=9, embed=16)
        kw = LAYER_FEATURES[feature](rng, 2, 9)
        if dws is None:
            dws = [on_device(w) for w in ws]
        else:
            for d, w in zip(dws, ws):
                d[...] = w
        dev_kw = {n: on_device(m) if n == "mask" else m for n, m in kw.items()}
        launches.clear()
        got = cuattn.multi_head_attention(on_device(x), *dws, num_heads=2, **dev_kw,
                                          **{n: on_device(b) for n, b in _bias_kw(bs).items()})
        assert type(got) is device and len(launches) == 1
        _check(np.asarray(got), x, ws, bs, 2, **kw)
    assert len(checks) == 1 and len(layers._kept) == 1


def test_blas_view_reads_rows_or_columns_and_refuses_the_rest():
    m = layers._Matrix
    assert layers._blas_view(m(64, 3, 5, 40, 4), 4) == (64, layers._OP_N, 10)
    assert layers._blas_view(m(64, 3, 5, 4, 12), 4) == (64, layers._OP_T, 3)
    assert layers._blas_view(m(64, 1, 5, 0, 4), 4) == (64, layers._OP_N, 5)
    assert layers._blas_view(m(64, 3, 5, 40, 8), 4) is None      # no unit stride
    assert layers._blas_view(m(64, 3, 5, 12, 4), 4) is None      # rows overlap
    assert layers._blas_view(m(64, 3, 5, -20, 4), 4) is None     # reversed rows


# ---- the ViT encoder block of docs/vit.rst ---------------------------------------------

def _page_module():
    """The code block of docs/vit.rst named ``vit-block``, as the module ``vit_block``."""
    blocks = re.findall(r"^\.\. code-block:: python\n((?:   :.*\n)*)\n((?:   .*\n|\n)+)",
                        VIT_PAGE.read_text(), re.M)
    source = next((body for options, body in blocks if ":name: vit-block" in options), None)
    assert source, "docs/vit.rst has no code block named vit-block"
    module = types.ModuleType("vit_block")
    exec(compile(textwrap.dedent(source), str(VIT_PAGE), "exec"), module.__dict__)
    return module


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def vit_block_reference(x, p, heads):
    """The pre-norm encoder block in float64, written apart from the page's code."""
    p = {n: np.asarray(a, np.float64) for n, a in p.items()}
    x = np.asarray(x, np.float64)
    e = x.shape[-1]

    def norm(a, g, b):
        mu = a.mean(-1, keepdims=True)
        return (a - mu) / np.sqrt(((a - mu) ** 2).mean(-1, keepdims=True) + 1e-6) * g + b

    ws = [p["w_qkv"][:, i * e:(i + 1) * e] for i in range(3)] + [p["w_o"]]
    bs = [p["b_qkv"][i * e:(i + 1) * e] for i in range(3)] + [p["b_o"]]
    x = x + layer_reference(norm(x, p["ln1_g"], p["ln1_b"]), ws, bs, heads)
    h = _gelu_tanh(norm(x, p["ln2_g"], p["ln2_b"]) @ p["w_fc1"] + p["b_fc1"])
    return x + h @ p["w_fc2"] + p["b_fc2"]


needs_page = pytest.mark.skipif(not VIT_PAGE.is_file(), reason="not a source checkout")


@needs_page
def test_vit_page_examples_run():
    module = _page_module()
    sys.modules["vit_block"] = module  # the page imports the block as users who saved it
    try:
        parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(
            optionflags=doctest.NORMALIZE_WHITESPACE)
        test = parser.get_doctest(VIT_PAGE.read_text(), {}, "docs/vit.rst", str(VIT_PAGE), 0)
        assert test.examples, "docs/vit.rst has no >>> examples"
        runner.run(test)
        assert runner.summarize(verbose=False).failed == 0
    finally:
        del sys.modules["vit_block"]


@needs_page
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 1e-5),
                                       (np.float16, 5e-3), (ml_dtypes.bfloat16, 4e-2)],
                         ids=["float64", "float32", "float16", "bfloat16"])
def test_vit_block_matches_float64(dtype, tol):
    module = _page_module()
    rng = np.random.default_rng(11)
    p = module.init_block(rng, embed=32, hidden=128, dtype=dtype)
    x = rng.standard_normal((2, 9, 32)).astype(dtype)
    got = module.vit_block(x, p, num_heads=4)
    assert got.dtype == np.dtype(dtype) and got.shape == x.shape
    want = vit_block_reference(x, p, 4)
    err = np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want))
    assert err <= tol, err


@needs_page
def test_bench_block_is_the_page_block():
    from cuattn._bench_layers import _vit_block
    module = _page_module()
    rng = np.random.default_rng(12)
    p = module.init_block(rng, embed=32, hidden=128)
    x = rng.standard_normal((2, 7, 32)).astype(np.float32)
    np.testing.assert_array_equal(_vit_block(x, p, 4), module.vit_block(x, p, num_heads=4))


# ---- GPU ------------------------------------------------------------------------------

def _cp():
    import cupy
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("biases", ["none", "all", "some"])
@pytest.mark.parametrize("feature", list(LAYER_FEATURES))
def test_gpu_layer_matches_float64(dtype, biases, feature):
    cp = _cp()
    rng = np.random.default_rng(100 + list(LAYER_FEATURES).index(feature) * 10 + len(biases))
    x, ws, bs = _inputs(rng, dtype, batch=(2,), n=197, embed=192, biases=biases)
    kw = LAYER_FEATURES[feature](rng, 2, 197)
    dev_kw = {n: cp.asarray(m) for n, m in kw.items() if n == "mask"} | {
        n: m for n, m in kw.items() if n != "mask"}
    got = cuattn.multi_head_attention(cp.asarray(x), *map(cp.asarray, ws), num_heads=3,
                                      **{n: cp.asarray(b) for n, b in _bias_kw(bs).items()},
                                      **dev_kw)
    assert isinstance(got, cp.ndarray) and got.dtype == np.dtype(dtype)
    _check(got, x, ws, bs, 3, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("feature", list(LAYER_FEATURES))
def test_gpu_repeated_layer_calls_read_their_own_data(feature, monkeypatch):
    """Calls of one signature after the first skip validation and reuse its attention plan,
    and still compute each call's own x, weights (changed in place between calls), biases
    and mask; a changed signature is validated again."""
    from cuattn import _checks
    cp = _cp()
    rng = np.random.default_rng(60 + list(LAYER_FEATURES).index(feature))
    layers._kept.clear()
    checks = []
    real = _checks.check_attention
    monkeypatch.setattr(layers, "check_attention",
                        lambda *a, **k: checks.append(1) or real(*a, **k))
    dws = None
    for _ in range(3):
        x, ws, bs = _inputs(rng, np.float16, batch=(2,), n=197, embed=192)
        kw = LAYER_FEATURES[feature](rng, 2, 197)
        if dws is None:
            dws = [cp.asarray(w) for w in ws]
        else:  # the same weight arrays, new values
            for d, w in zip(dws, ws):
                d[...] = cp.asarray(w)
        dev_kw = {n: cp.asarray(m) if n == "mask" else m for n, m in kw.items()}
        got = cuattn.multi_head_attention(cp.asarray(x), *dws, num_heads=3,
                                          **{n: cp.asarray(b) for n, b in _bias_kw(bs).items()},
                                          **dev_kw)
        _check(got, x, ws, bs, 3, **kw)
    assert len(checks) == 1 and len(layers._kept) == 1
    with pytest.raises(ValueError, match="num_heads"):
        cuattn.multi_head_attention(cp.asarray(x), *dws, num_heads=5)
    got = cuattn.multi_head_attention(cp.asarray(x), *dws, num_heads=6)  # a new signature
    _check(got, x, ws, [None] * 4, 6)
    assert len(checks) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["highest", "tf32"])
def test_gpu_layer_float32_precision(precision):
    cp = _cp()
    rng = np.random.default_rng(21)
    x, ws, bs = _inputs(rng, np.float32, batch=(2,), n=197, embed=768)
    got = cuattn.multi_head_attention(cp.asarray(x), *map(cp.asarray, ws), num_heads=12,
                                      precision=precision,
                                      **{n: cp.asarray(b) for n, b in _bias_kw(bs).items()})
    # cuBLAS may convert operands to TF32 by truncation: up to twice the error of the
    # yardstick's rounding to nearest
    _check(got, x, ws, bs, 12, precision=precision, factor=4.0 if precision == "tf32" else 2.0)
    if precision == "highest":  # exact float32 products: far inside TF32's error
        want = layer_reference(x, ws, bs, 12)
        err = np.max(np.abs(to_host(got) - want)) / np.max(np.abs(want))
        assert err < 1e-5, err


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=_dtype_id)
def test_gpu_weight_layouts(layout, dtype):
    cp = _cp()
    rng = np.random.default_rng(30 + LAYOUTS.index(layout))
    x, ws, bs = _inputs(rng, dtype, batch=(3,), n=50, embed=128)
    ws2, bs2 = _weight_layouts(ws, bs, layout)
    # device copies keep each layout: the same strides, views of one array where packed
    if layout == "packed_columns":
        w, b = cp.asarray(ws2[0].base), cp.asarray(bs2[0].base)
        dws = [w[:, :128], w[:, 128:256], w[:, 256:], cp.asarray(ws2[3])]
        dbs = [b[:128], b[128:256], b[256:], cp.asarray(bs2[3])]
    elif layout == "in_proj_rows":
        w = cp.asarray(ws2[0].T.base)
        dws = [w[:128].T, w[128:256].T, w[256:].T, cp.asarray(ws2[3])]
        dbs = [cp.asarray(b) for b in bs2]
    elif layout == "strided":
        dws = [cp.repeat(cp.asarray(w), 2, axis=1)[:, ::2] for w in ws]
        dbs = [cp.asarray(b) for b in bs2]
    else:
        dws = [cp.asarray(w, order="F" if layout == "fortran" else "C") for w in ws2]
        dbs = [cp.asarray(b) for b in bs2]
    got = cuattn.multi_head_attention(cp.asarray(x), *dws, num_heads=2,
                                      **_bias_kw(dbs), causal=True)
    _check(got, x, ws, bs, 2, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=_dtype_id)
def test_gpu_16bit_layer_makes_no_float32_copy(dtype):
    """The projections run in the input dtype: the call's device memory is the (M, 3E)
    projections, the (M, E) attention output and the (M, E) result, far below what one
    float32 copy of x (M x E x 4 bytes) would add."""
    cp = _cp()
    rng = np.random.default_rng(40)
    x, ws, bs = _inputs(rng, dtype, batch=(4,), n=197, embed=768)
    dx, dws = cp.asarray(x), [cp.asarray(w) for w in ws]
    dbs = {n: cp.asarray(b) for n, b in _bias_kw(bs).items()}
    cuattn.multi_head_attention(dx, *dws, num_heads=12, **dbs)  # kernels, handles, plans
    cp.cuda.Device().synchronize()
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc):
        y = cuattn.multi_head_attention(dx, *dws, num_heads=12, **dbs)
        cp.cuda.Device().synchronize()
    rows, itemsize = 4 * 197, np.dtype(dtype).itemsize
    needed = rows * 768 * (3 + 1 + 1) * itemsize
    assert pool.total_bytes() < needed + rows * 768 * 4 // 2, (pool.total_bytes(), needed)
    _check(y, x, ws, bs, 12)


@pytest.mark.gpu
def test_gpu_layer_checks_devices_and_kinds():
    cp = _cp()
    x = cp.ones((2, 5, 16), np.float32)
    w = cp.eye(16, dtype=np.float32)
    with pytest.raises(TypeError, match="host and device arrays cannot be mixed"):
        cuattn.multi_head_attention(x, w, w, w, np.eye(16, dtype=np.float32), num_heads=2)
    with pytest.raises(TypeError, match="host and device arrays cannot be mixed"):
        cuattn.multi_head_attention(x, w, w, w, w, num_heads=2,
                                    mask=np.ones((5, 5), bool))
    if cp.cuda.runtime.getDeviceCount() > 1:
        with cp.cuda.Device(1):
            w1 = cp.eye(16, dtype=np.float32)
        with pytest.raises(ValueError, match="on one device"):
            cuattn.multi_head_attention(x, w, w1, w, w, num_heads=2)
