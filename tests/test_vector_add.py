"""vector_add: numpy.add semantics on both backends."""
import ml_dtypes
import numpy as np
import pytest
from _accuracy import poison, to_host

import cuattn

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int32, np.int64]


def _rand(rng, shape, dtype):
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(-1000, 1000, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def test_numpy_inputs_give_numpy_results():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.ones(3, np.float64)
    c = cuattn.vector_add(a, b)
    assert isinstance(c, np.ndarray) and c.dtype == np.float64
    np.testing.assert_array_equal(c, np.add(a, b))


def test_errors():
    a = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="a has dtype bool"):
        cuattn.vector_add(a.astype(bool), a)
    with pytest.raises(ValueError, match="do not broadcast"):
        cuattn.vector_add(a, np.ones(3, np.float32))
    with pytest.raises(TypeError, match="same_kind"):
        cuattn.vector_add(a, a, out=np.empty(4, np.int32))
    with pytest.raises(TypeError, match="must be a numpy.ndarray"):
        cuattn.vector_add([1.0], a)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 1000, 1 << 20, (1 << 20) + 3])
def test_gpu_matches_numpy_bitwise(dtype, n):
    import cupy as cp
    rng = np.random.default_rng(n)
    a, b = _rand(rng, n, dtype), _rand(rng, n, dtype)
    out = poison(cp.empty(n, dtype))
    got = cuattn.vector_add(cp.asarray(a), cp.asarray(b), out=out)
    assert got is out
    np.testing.assert_array_equal(to_host(got), np.add(a, b))


@pytest.mark.gpu
def test_gpu_unaligned_views_broadcast_and_promotion():
    import cupy as cp
    rng = np.random.default_rng(0)
    a = _rand(rng, 1001, np.float32)
    b = _rand(rng, 1001, np.float32)
    got = cuattn.vector_add(cp.asarray(a)[1:], cp.asarray(b)[:-1])  # offsets of 4 bytes
    np.testing.assert_array_equal(to_host(got), a[1:] + b[:-1])
    x, y = _rand(rng, (3, 1, 5), np.float16), _rand(rng, (4, 1), np.float32)
    got = cuattn.vector_add(cp.asarray(x), cp.asarray(y))
    assert got.dtype == np.float32 and got.shape == (3, 4, 5)
    np.testing.assert_array_equal(to_host(got), np.add(x, y))
    out = cp.empty((5, 4), np.float64)[:, ::2]  # non-contiguous out
    got = cuattn.vector_add(cp.ones((5, 2), np.float32), cp.ones((5, 2), np.float32), out=out)
    assert got is out and np.all(to_host(out) == 2)
