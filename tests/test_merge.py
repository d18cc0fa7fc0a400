"""merge_attention: partial results over disjoint key sets combine into the whole."""
import ml_dtypes
import numpy as np
import pytest
from _accuracy import to_host
from _hostdev import batch_offset, fields

import cuattn
from cuattn.reference import attention_reference

BF16 = np.dtype(ml_dtypes.bfloat16)


def _parts(q, k, v, bounds, mask=None):
    """attention over k[..., a:b, :] for consecutive bounds, each with its lse and its
    columns of ``mask``."""
    outs, lses = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        part = None if mask is None else mask[..., a:b]
        out, lse = cuattn.attention(q, k[..., a:b, :], v[..., a:b, :], mask=part,
                                    return_lse=True)
        outs.append(out)
        lses.append(lse)
    return outs, lses


@pytest.mark.parametrize("bounds", [(0, 40), (0, 1, 40), (0, 13, 14, 27, 40), (0, 20, 40)])
def test_float64_merge_equals_one_call_over_all_keys(bounds):
    rng = np.random.default_rng(len(bounds))
    q = rng.standard_normal((2, 3, 11, 16))
    k, v = rng.standard_normal((2, 3, 40, 16)), rng.standard_normal((2, 3, 40, 8))
    out, lse = cuattn.merge_attention(*_parts(q, k, v, bounds))
    ref, ref_lse = cuattn.attention(q, k, v, return_lse=True)
    ulp = np.spacing(np.max(np.abs(ref)))
    assert np.max(np.abs(out - ref)) <= 8 * ulp
    assert np.max(np.abs(lse - ref_lse)) <= 8 * np.spacing(np.max(np.abs(ref_lse)))
    assert out.dtype == np.float64 and lse.dtype == np.float64


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_low_precision_merge_is_as_accurate_as_one_call(dtype):
    """Against the float64 reference, the merged result of 16-bit or float32 parts is within
    the error of one call, rounded once more."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 9 if i == 0 else 70, 32)).astype(dtype)
               for i in range(3))
    out, lse = cuattn.merge_attention(*_parts(q, k, v, (0, 30, 31, 70)))
    one, one_lse = cuattn.attention(q, k, v, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v)
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.float32
    err_one = np.max(np.abs(one.astype(np.float64) - ref))
    ulp = float(ml_dtypes.finfo(dtype).eps) * np.max(np.abs(ref))
    assert np.max(np.abs(out.astype(np.float64) - ref)) <= err_one + 2 * ulp
    assert np.max(np.abs(lse - ref_lse)) <= 1e-5


def test_causal_parts_with_empty_rows_and_all_empty_rows():
    """A causal key chunk after a row's last key gives that row -inf and 0; merged, the row
    takes the other parts. A row with no allowed key anywhere is 0 with lse -inf."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((3, 24, 8)) for _ in range(3))
    causal = np.tril(np.ones((24, 24), bool))
    outs, lses = _parts(q, k, v, (0, 8, 16, 24), mask=causal)
    assert np.isneginf(lses[2][:, :16]).all() and (outs[2][:, :16] == 0).all()
    out, lse = cuattn.merge_attention(outs, lses)
    ref, ref_lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-14)
    mask = np.ones((24, 24), bool)
    mask[:5] = False  # rows 0-4 see no key in any part
    out, lse = cuattn.merge_attention(*_parts(q, k, v, (0, 12, 24), mask=mask))
    assert (out[:, :5] == 0).all() and np.isneginf(lse[:, :5]).all()
    assert np.isfinite(out).all()


def test_one_part_is_returned_unchanged():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((4, 6)).astype(np.float32) for _ in range(3))
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    merged, merged_lse = cuattn.merge_attention([out], [lse])
    np.testing.assert_array_equal(merged, out)
    np.testing.assert_array_equal(merged_lse, lse)


def test_bad_parts_are_refused_before_any_work():
    o = np.zeros((2, 3, 4), np.float32)
    lse = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="at least one part"):
        cuattn.merge_attention([], [])
    with pytest.raises(ValueError, match="one entry per part"):
        cuattn.merge_attention([o, o], [lse])
    with pytest.raises(TypeError, match="list of arrays"):
        cuattn.merge_attention(o, lse)
    with pytest.raises(TypeError, match=r"outs\[1\] has dtype float64"):
        cuattn.merge_attention([o, o.astype(np.float64)], [lse, lse])
    with pytest.raises(ValueError, match=r"outs\[1\] has shape"):
        cuattn.merge_attention([o, o[:, :2]], [lse, lse])
    with pytest.raises(TypeError, match=r"lses\[0\] must have dtype float32"):
        cuattn.merge_attention([o], [lse.astype(np.float64)])
    with pytest.raises(ValueError, match=r"lses\[0\] must have shape \(2, 3\)"):
        cuattn.merge_attention([o], [lse[:, :2]])
    with pytest.raises(TypeError, match="supported dtypes"):
        cuattn.merge_attention([o.astype(np.int32)], [lse])
    with pytest.raises(TypeError, match="must be a numpy.ndarray"):
        cuattn.merge_attention([o.tolist()], [lse])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.float64])
def test_gpu_merge_matches_the_host_merge(dtype):
    import cupy as cp
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((2, 4, 33 if i == 0 else 300, 64)).astype(dtype)
               for i in range(3))
    dq, dk, dv = (cp.asarray(x) for x in (q, k, v))
    causal = np.tril(np.ones((33, 300), bool), 300 - 33)  # bottom-right aligned
    outs, lses = _parts(dq, dk, dv, (0, 100, 101, 300), mask=cp.asarray(causal))
    out, lse = cuattn.merge_attention(outs, lses)
    assert isinstance(out, cp.ndarray) and out.dtype == np.dtype(dtype)
    one, one_lse = cuattn.attention(dq, dk, dv, causal=True, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=True)
    err_one = np.max(np.abs(to_host(one).astype(np.float64) - ref))
    ulp = float(ml_dtypes.finfo(dtype).eps) * np.max(np.abs(ref))
    assert np.max(np.abs(to_host(out).astype(np.float64) - ref)) <= err_one + 2 * ulp
    assert np.max(np.abs(to_host(lse) - ref_lse)) <= (1e-12 if dtype == np.float64 else 1e-5)


def _emulate_merge_parts(memory, dtype):
    """cuda/merge.cu's kernel, element by element, on host memory (accumulating in the
    kernel's type, exp as exp2 of x·log2 e as the kernel computes it)."""
    acc = np.float64 if dtype == np.float64 else np.float32
    log2e = acc(1.4426950408889634)

    def run(block, pointers, grid):
        f = fields(block)
        out, lse = pointers[:2]
        item, acc_item = np.dtype(dtype).itemsize, np.dtype(acc).itemsize
        part_out, part_lse = pointers[2:2 + 8], pointers[10:18]
        if f["part_out_step"]:  # stacked parts: the first address and a step
            part_out = [part_out[0] + i * f["part_out_step"] * item for i in range(f["parts"])]
            part_lse = [part_lse[0] + i * f["part_lse_step"] * acc_item
                        for i in range(f["parts"])]
        for b in range(f["entries"]):
            for row in range(f["rows"]):
                at = batch_offset(f["part_lse_s"], b, f) + row * f["part_lse_s"]["row"]
                lses = [memory.read(part_lse[i] + at * acc_item, acc)
                        for i in range(f["parts"])]
                m = max(lses)
                empty = m == -np.inf
                weights = [np.exp2((x - (0 if empty else m)) * log2e) for x in lses]
                total = acc(sum(weights, acc(0)))
                for col in range(f["cols"]):
                    o_at = (batch_offset(f["part_out_s"], b, f) + row * f["part_out_s"]["row"]
                            + col * f["part_out_s"]["col"])
                    s = acc(0)
                    for i, w in enumerate(weights):
                        s += w * acc(memory.read(part_out[i] + o_at * item, dtype))
                    value = 0 if empty else s / total
                    to = (batch_offset(f["out_s"], b, f) + row * f["out_s"]["row"]
                          + col * f["out_s"]["col"])
                    memory.write(out + to * item, value, dtype)
                to = batch_offset(f["lse_s"], b, f) + row * f["lse_s"]["row"]
                memory.write(lse + to * acc_item, -np.inf if empty else m + np.log(total), acc)
    return run


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=str)
def test_device_merge_launch_on_host_memory(dtype, monkeypatch):
    """The CuPy path's parameter block, grid and pointers through an emulation of
    cuda/merge.cu on host memory: strided parts over four batch axes that do not collapse
    (a launch loop), parts of different layouts (copied to one), rows with no allowed key
    in some or in every part."""
    from _hostdev import Memory, fake_cupy, on_device

    from cuattn import merge
    rng = np.random.default_rng(9)
    acc = np.float64 if dtype == np.float64 else np.float32

    def strided(shape, dtype):  # batch axes in reverse memory order: none of them merge
        base = rng.standard_normal(shape[:4][::-1] + shape[4:]).astype(dtype)
        return base.transpose((3, 2, 1, 0) + tuple(range(4, base.ndim)))

    shape = (2, 3, 2, 4, 5, 6)
    outs = [strided(shape, dtype) for _ in range(3)]
    lses = [strided(shape[:-1], acc) for _ in range(3)]
    lses[0][0, 0, 0, 0, 1] = -np.inf                  # one part without keys in a row
    for x in lses:
        x[1, 2, 1, 3, 4] = -np.inf                     # no part has keys in this row
    names = (("out", "lse") + tuple(f"part_out{i}" for i in range(8))
             + tuple(f"part_lse{i}" for i in range(8)))
    arrays = list(outs) + list(lses)
    grids = fake_cupy(monkeypatch, _emulate_merge_parts(Memory(arrays), dtype), names, 256,
                      arrays)
    monkeypatch.setattr(merge, "_merge_plans", {})  # plans made with the stand-in Launch
    # twice as given (the second call reuses the kept plan), then with one part copied
    for parts_of in (list, list, lambda xs: xs[:2] + [np.asfortranarray(xs[2])]):
        grids.clear()
        parts = parts_of(outs)
        arrays += parts
        want, want_lse = merge.merge_attention(parts, lses)  # the NumPy merge
        got, got_lse = merge._merge_cupy([on_device(x) for x in parts],
                                         [on_device(x) for x in lses])
        assert grids == [(1, 24), (1, 24)]  # a launch per index of the outer batch axis
        assert got.dtype == dtype and got_lse.dtype == acc
        assert not got[1, 2, 1, 3, 4].any() and got_lse[1, 2, 1, 3, 4] == -np.inf
        ulp = float(ml_dtypes.finfo(dtype).eps) * float(np.max(np.abs(want)))
        np.testing.assert_allclose(np.asarray(got, np.float64), want.astype(np.float64),
                                   rtol=0, atol=2 * ulp)
        np.testing.assert_allclose(got_lse, want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32], ids=str)
@pytest.mark.parametrize("n", [5, 19])
def test_device_merge_of_stacked_parts_on_host_memory(dtype, n, monkeypatch):
    """merge_stacked on CuPy: n parts read in place along their axis (as the split-key
    forward makes them; more than the kernel's eight addresses too), written into a strided
    out=, through the emulation of cuda/merge.cu, in one launch."""
    from _hostdev import Memory, fake_cupy, on_device

    from cuattn import merge
    rng = np.random.default_rng(4)
    parts = rng.standard_normal((2, 3, n, 7, 6)).astype(dtype)      # (..., n, Sq, Dv)
    lses = rng.standard_normal((2, 3, n, 7)).astype(np.float32)
    lses[1, 2, :, 3] = -np.inf                                       # a row without keys
    out = np.full((2, 3, 7, 12), np.nan, dtype)[..., ::2]            # strided out=
    names = (("out", "lse") + tuple(f"part_out{i}" for i in range(8))
             + tuple(f"part_lse{i}" for i in range(8)))
    arrays = [parts, lses, out]
    grids = fake_cupy(monkeypatch, _emulate_merge_parts(Memory(arrays), dtype), names, 256,
                      arrays)
    monkeypatch.setattr(merge, "_stacked_plans", {})  # plans made with the stand-in Launch
    want, want_lse = merge.merge_attention([parts[..., i, :, :] for i in range(n)],
                                           [lses[..., i, :] for i in range(n)])
    got, got_lse = merge.merge_stacked(on_device(parts), on_device(lses), out=on_device(out))
    assert len(grids) == 1
    assert np.shares_memory(got, out)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-6, atol=1e-6)
    host, host_lse = merge.merge_stacked(parts, lses)                # the NumPy path
    np.testing.assert_array_equal(host, want)
    np.testing.assert_array_equal(host_lse, want_lse)
