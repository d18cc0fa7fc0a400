"""The GPU test matrix shared by the forward and backward kernel tests: the dtypes, the
ragged shapes, the (family, dtype) pairs a dispatch table serves, and two small helpers."""
import ml_dtypes
import numpy as np
import pytest

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
SHAPES = [  # (Sq, Sk, D, Dv)
    (1, 17, 32, 32), (17, 1, 59, 59), (113, 203, 64, 64), (203, 113, 111, 111),
    (1023, 1025, 128, 128), (1025, 1023, 64, 64), (130, 70, 256, 256), (33, 65, 512, 512),
    (40, 50, 64, 24),
]


def combos(families):
    """Every (family, dtype) that the table ``families`` says the family serves."""
    return [pytest.param(f.name, d, id=f"{f.name}-{np.dtype(d).name}")
            for f in families for d in DTYPES if np.dtype(d).name in f.dtypes]


def shape_params(families):
    """combos(families) × SHAPES, within each family's head dims."""
    max_head = {f.name: f.max_head_dim for f in families}
    return [pytest.param(*c.values, s, id=f"{c.id}-{'x'.join(map(str, s))}")
            for c in combos(families) for s in SHAPES if max(s[2:]) <= max_head[c.values[0]]]


def cupy():
    import cupy
    return cupy


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


#: masks and biases in the layouts the sm90 kernels stage by 16-byte copies (unit column
#: stride, rows 16 bytes apart), at a 16-byte boundary and off it, and one (a transposed
#: view) that they load element by element; Sk a multiple of 16 in SIDE_SHAPES
SIDE_LAYOUTS = ("mask", "mask_shifted", "bias_shifted", "mask_and_bias_causal",
                "mask_transposed")
SIDE_SHAPES = [(200, 256), (77, 144)]


def side_layout(name, rng, sq, sk, dtype):
    """(host keywords for the reference, device keywords for the call) of one of
    SIDE_LAYOUTS: the device arrays are views of the same values, laid out as named."""
    cp = cupy()
    bias_dtype = dtype if np.dtype(dtype).itemsize == 2 else np.float32
    if name == "mask":
        m = rng.random((2, 3, sq, sk)) > 0.3
        return {"mask": m}, {"mask": cp.asarray(m)}
    if name == "mask_shifted":  # element (q, 0) five bytes past a 16-byte boundary
        wide = rng.random((2, 1, sq, sk + 48)) > 0.3
        return ({"mask": wide[..., 5:5 + sk]}, {"mask": cp.asarray(wide)[..., 5:5 + sk]})
    if name == "bias_shifted":  # float32, 12 bytes past a boundary
        wide = rng.standard_normal((3, sq, sk + 16)).astype(np.float32)
        return ({"bias": wide[..., 3:3 + sk]}, {"bias": cp.asarray(wide)[..., 3:3 + sk]})
    if name == "mask_and_bias_causal":
        m = rng.random((2, 1, sq, sk)) > 0.2
        bias = rng.standard_normal((sq, sk)).astype(bias_dtype)
        host = {"mask": m, "bias": bias, "causal": True}
        return host, {"mask": cp.asarray(m), "bias": cp.asarray(bias), "causal": True}
    if name == "mask_transposed":  # column stride Sq: loaded element by element
        wide = rng.random((2, 3, sk, sq)) > 0.3
        return ({"mask": wide.swapaxes(-1, -2)}, {"mask": cp.asarray(wide).swapaxes(-1, -2)})
    raise KeyError(name)
