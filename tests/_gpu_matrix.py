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
