"""Every row of API.md's error table, on the NumPy path (validation is shared by all)."""
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


def test_mixing_host_and_device_is_a_type_error():
    cupy = pytest.importorskip("cupy")
    try:
        qd = cupy.asarray(q)
    except Exception:  # noqa: BLE001 - CuPy without a device cannot make an array
        pytest.skip("no GPU to make a device array")
    with pytest.raises(TypeError, match="host and device arrays cannot be mixed"):
        cuattn.attention(qd, k, v)
