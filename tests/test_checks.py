"""Every row of the error table (docs/semantics.rst), on the NumPy path (validation is shared
by all backends)."""
import ml_dtypes
import numpy as np
import pytest

import cuattn

f32 = np.float32
q = np.zeros((2, 3, 8, 16), f32) + 0.5
k = np.ones((2, 3, 10, 16), f32)
v = np.ones((2, 3, 10, 12), f32)


@pytest.mark.parametrize("args,kw,exc,text", [
    ((q.tolist(), k, v), {}, TypeError, "q must be a numpy.ndarray"),
    ((q.astype(np.int32), k, v), {}, TypeError, "q has dtype int32"),
    ((q, k.astype(np.float64), v), {}, TypeError, "must share one dtype"),
    ((q, k, v), {"mask": np.ones((8, 10), np.int8)}, TypeError, "mask must be a bool"),
    ((q, k, v), {"bias": np.ones((8, 10), np.int32)}, TypeError, "bias must be a floating"),
    ((q[0, 0, 0], k, v), {}, ValueError, "at least 2 dims"),
    ((q, k[..., :8], v), {}, ValueError, "k has head dim 8 but q has 16"),
    ((q, k, v[..., :9, :]), {}, ValueError, "v has 9 keys"),
    ((q, k[:, :2], v), {}, ValueError, "do not broadcast"),
    ((q, k, v), {"mask": np.ones((8, 9), bool)}, ValueError, "does not broadcast"),
    ((np.zeros((8, 2048), f32),) * 3, {}, ValueError, "supported head dims are 1 to 1024"),
    ((q, k, v), {"scale": 0.0}, ValueError, "scale must be finite and positive"),
    ((q, k, v), {"scale": float("nan")}, ValueError, "scale must be finite"),
    ((q, k, v), {"softcap": -1.0}, ValueError, "softcap must be finite and positive"),
    ((q, k, v), {"window": (1,)}, ValueError, "window must be a pair"),
    ((q, k, v), {"window": (-2, 0)}, ValueError, "window left must be >= 0"),
    ((q, k, v), {"window": (1.5, 0)}, ValueError, "must be an int"),
    ((q, k, v), {"precision": "fast"}, ValueError, "precision must be"),
    ((q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)),
     {"precision": "tf32"}, ValueError, "precision applies to float32 only"),
    ((q, k, v), {"out": np.empty((2, 3, 8, 16), f32)}, ValueError, "out must have shape"),
    ((q, k, v), {"out": np.empty((2, 3, 8, 12), np.float64)}, ValueError, "dtype float32"),
    ((q, k, v), {"causal": "no"}, TypeError, "causal must be a bool"),
    ((q, k, v), {"causal": 1}, TypeError, "causal must be a bool"),
    ((q, k, v), {"causal": None}, TypeError, "causal must be a bool"),
    ((q, k, v), {"return_lse": "yes"}, TypeError, "return_lse must be a bool"),
    ((q, k, v), {"scale": "0.5"}, TypeError, "scale must be a real number"),
    ((q, k, v), {"scale": True}, TypeError, "scale must be a real number"),
    ((q, k, v), {"softcap": "30"}, TypeError, "softcap must be a real number"),
    ((q, k, v), {"softcap": 1j}, TypeError, "softcap must be a real number"),
    ((q, k, v), {"softcap": np.asarray(True)}, TypeError, "softcap must be a real number"),
    ((q, k, v), {"scale": np.ones(1)}, TypeError, "scale must be a real number"),
    ((q, k, v), {"scale": np.asarray(-0.5)}, ValueError, "scale must be finite and positive"),
])
def test_errors(args, kw, exc, text):
    with pytest.raises(exc, match=text):
        cuattn.attention(*args, **kw)


def test_out_overlapping_an_input_is_refused_and_left_untouched():
    qq = np.random.default_rng(0).standard_normal((4, 8, 12)).astype(f32)
    kk = np.ones((4, 10, 12), f32)
    vv = np.ones((4, 10, 12), f32)
    before = qq.copy()
    with pytest.raises(ValueError, match="out overlaps q"):
        cuattn.attention(qq, kk, vv, out=qq)
    np.testing.assert_array_equal(qq, before)


def test_numpy_scalars_and_bools_are_accepted():
    out = cuattn.attention(q, k, v, causal=np.bool_(True), return_lse=np.bool_(False),
                           scale=np.float32(0.25), softcap=np.int64(5))
    assert out.shape == (2, 3, 8, 12)


def test_zero_d_arrays_are_scalars():
    got = cuattn.attention(q, k, v, scale=np.asarray(0.25), softcap=np.asarray(5.0))
    want = cuattn.attention(q, k, v, scale=0.25, softcap=5.0)
    np.testing.assert_array_equal(got, want)


def test_read_only_out_is_refused_before_any_work():
    out = np.full((2, 3, 8, 12), 7.0, f32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        cuattn.attention(q, k, v, out=out)
    assert (out == 7.0).all()


def test_backward_validates_flags_too():
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        cuattn.attention_backward(out, q, k, v, out, lse, causal="yes")


def test_a_numpy_call_does_not_import_cupy():
    import subprocess
    import sys
    code = ("import sys, numpy as np, cuattn; x = np.ones((2, 8, 4), np.float32); "
            "cuattn.attention(x, x, x, causal=True); "
            "cuattn.attention_vjp(x, x, x)[1](x); "
            "cuattn.multi_head_attention(np.ones((1, 3, 8), np.float32), "
            "*[np.eye(8, dtype=np.float32)] * 4, num_heads=2); "
            "print('cupy' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert res.stdout.strip() == "False"


def test_bfloat16_is_accepted_and_message_style():
    b = q.astype(ml_dtypes.bfloat16)
    assert cuattn.attention(b, b, b).dtype == ml_dtypes.bfloat16
    with pytest.raises(ValueError) as info:
        cuattn.attention(q, k[..., :8], v)
    message = str(info.value)
    assert message[0].islower() and "16" in message and "8" in message


def test_multi_head_attention_errors():
    x = np.ones((2, 5, 12), f32)
    w = np.ones((12, 12), f32)
    with pytest.raises(ValueError, match="not divisible by num_heads=5"):
        cuattn.multi_head_attention(x, w, w, w, w, num_heads=5)
    with pytest.raises(ValueError, match="w_o must have shape"):
        cuattn.multi_head_attention(x, w, w, w, w[:5], num_heads=3)
    with pytest.raises(TypeError, match="w_q must be a numpy.ndarray"):
        cuattn.multi_head_attention(x, w.tolist(), w, w, w, num_heads=3)
    with pytest.raises(TypeError, match="b_k must have the dtype of x"):
        cuattn.multi_head_attention(x, w, w, w, w, num_heads=3, b_k=np.ones(12))
    with pytest.raises(ValueError, match="b_v must have shape"):
        cuattn.multi_head_attention(x, w, w, w, w, num_heads=3, b_v=np.ones(11, f32))
    with pytest.raises(TypeError, match="num_heads must be an int"):
        cuattn.multi_head_attention(x, w, w, w, w, num_heads=3.0)
    with pytest.raises(TypeError, match="causal must be a bool"):
        cuattn.multi_head_attention(x, w, w, w, w, num_heads=3, causal="no")
    with pytest.raises(TypeError, match="x has dtype int64"):
        cuattn.multi_head_attention(np.ones((2, 5, 12), np.int64), w, w, w, w, num_heads=3)
    with pytest.raises(TypeError, match="w_k must be an array, got None"):
        cuattn.multi_head_attention(x, w, None, w, w, num_heads=3)
    with pytest.raises(ValueError, match="num_heads must be a positive int, got num_heads=0"):
        cuattn.multi_head_attention(x, w, w, w, w, num_heads=0)
    with pytest.raises(ValueError, match="head dim E // num_heads = 1026"):
        big = np.ones((1026, 1026), f32)
        cuattn.multi_head_attention(np.ones((1, 2, 1026), f32), big, big, big, big, num_heads=1)


def test_multi_head_attention_mask_errors():
    x = np.ones((2, 5, 12), f32)
    w = np.ones((12, 12), f32)
    with pytest.raises(TypeError, match="mask must be a bool array, got dtype float32"):
        cuattn.multi_head_attention(x, w, w, w, w, num_heads=3, mask=np.ones((5, 5), f32))
    with pytest.raises(ValueError, match=r"mask of shape \(2, 5, 4\) does not broadcast to "
                                         r"\(\.\.\., num_heads, N, N\) = \(2, 3, 5, 5\)"):
        cuattn.multi_head_attention(x, w, w, w, w, num_heads=3, mask=np.ones((2, 5, 4), bool))
    with pytest.raises(ValueError, match="does not broadcast"):  # no new batch axes
        cuattn.multi_head_attention(x, w, w, w, w, num_heads=3,
                                    mask=np.ones((4, 2, 3, 5, 5), bool))
    with pytest.raises(TypeError, match="mask must be a numpy.ndarray"):
        cuattn.multi_head_attention(x, w, w, w, w, num_heads=3, mask=[[True] * 5] * 5)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64],
                         ids=lambda d: np.dtype(d).name)
def test_multi_head_attention_precision_errors(dtype):
    x = np.ones((2, 5, 12), f32)
    w = np.ones((12, 12), f32)
    with pytest.raises(ValueError, match="precision must be 'highest' or 'tf32', got "
                                         "precision='fast'"):
        cuattn.multi_head_attention(x, w, w, w, w, num_heads=3, precision="fast")
    with pytest.raises(ValueError, match="precision must be 'highest' or 'tf32', got "
                                         "precision=32"):
        cuattn.multi_head_attention(x, w, w, w, w, num_heads=3, precision=32)
    x, w = x.astype(dtype), w.astype(dtype)
    with pytest.raises(ValueError, match=f"precision applies to float32 only, got "
                                         f"precision='tf32' for {np.dtype(dtype).name} inputs"):
        cuattn.multi_head_attention(x, w, w, w, w, num_heads=3, precision="tf32")
    assert cuattn.multi_head_attention(x, w, w, w, w, num_heads=3).dtype == dtype


def test_mixing_host_and_device_is_a_type_error():
    cupy = pytest.importorskip("cupy")
    try:
        qd = cupy.asarray(q)
    except Exception:  # noqa: BLE001 - CuPy without a device cannot make an array
        pytest.skip("no GPU to make a device array")
    with pytest.raises(TypeError, match="host and device arrays cannot be mixed"):
        cuattn.attention(qd, k, v)
