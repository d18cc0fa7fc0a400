"""Elementwise operations: ``vector_add``, the teaching kernel of ``cuda/vector_add.cu``."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ._checks import as_array, may_overlap
from ._kernels import c_type_name, get_kernel

__all__ = ["vector_add", "vector_add_instance", "VECTOR_ADD_UNROLL"]

VECTOR_ADD_DTYPES = tuple(np.dtype(d) for d in ("float16", "float32", "float64", "int32",
                                                "int64")) + (np.dtype(ml_dtypes.bfloat16),)
_THREADS = 256
#: 16-byte packs per thread per step. H200, 2^28 float32, one run: 4 packs reached 3874 GB/s
#: (92 % of a 4191 GB/s device copy) where 1 pack reached 3581; tools/sweep_vector_add.py.
VECTOR_ADD_UNROLL = 4


def vector_add_instance(dtype, unroll: int = VECTOR_ADD_UNROLL) -> str:
    """The name expression of the vector_add kernel for ``dtype``."""
    return f"vector_add<{c_type_name(dtype)}, {unroll}>"


def vector_add(a, b, out=None):
    """Elementwise ``a + b`` with :func:`numpy.add` semantics, on the GPU for CuPy arrays.

    Parameters
    ----------
    a, b : ndarray
        numpy or cupy arrays (or CUDA arrays taken zero-copy) of float16, bfloat16,
        float32, float64, int32 or int64; they broadcast together.
    out : ndarray, optional
        Where to write the result; NumPy's ``same_kind`` casting rule applies.

    Returns
    -------
    ndarray
        Of dtype ``numpy.result_type(a, b)`` (or out's), same kind as the inputs.

    Notes
    -----
    CuPy inputs of one dtype and shape that are contiguous go straight to the kernel
    (16-byte vector loads and stores, a scalar tail). Otherwise the operands are first
    broadcast and cast into contiguous temporaries of the result dtype on the device.

    Examples
    --------
    >>> import numpy as np, cuattn
    >>> cuattn.vector_add(np.arange(3, dtype=np.float32), np.float32(1) + np.zeros(3, np.float32))
    array([1., 2., 3.], dtype=float32)
    """
    (a, xa), (b, xb) = as_array(a, "a"), as_array(b, "b")
    arrays = {"a": (a, xa), "b": (b, xb)}
    if out is not None:
        out, xo = as_array(out, "out")
        arrays["out"] = (out, xo)
    if len({mod for _, mod in arrays.values()}) > 1:
        raise TypeError("host and device arrays cannot be mixed in one call: "
                        + ", ".join(f"{n} is {'numpy' if m is np else 'cupy'}"
                                    for n, (_, m) in arrays.items()))
    supported = VECTOR_ADD_DTYPES
    for name, (x, _) in arrays.items():
        if x.dtype not in supported:
            raise TypeError(f"{name} has dtype {x.dtype}; vector_add supports "
                            + ", ".join(str(d) for d in supported))
    dtype = np.result_type(a.dtype, b.dtype)
    try:
        shape = np.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise ValueError(f"a of shape {a.shape} and b of shape {b.shape} do not "
                         f"broadcast together") from None
    if out is not None:
        if out.shape != shape:
            raise ValueError(f"out must have shape {shape}, got {out.shape}")
        if not np.can_cast(dtype, out.dtype, "same_kind"):
            raise TypeError(f"cannot cast the result dtype {dtype} to out's dtype {out.dtype} "
                            f"under the 'same_kind' rule")
    xp = xa
    if xp is np:
        return np.add(a, b, out=out)
    if out is not None and any(may_overlap(out, x) and out.data.ptr != x.data.ptr
                               for x in (a, b)):
        raise ValueError("out partially overlaps an input; it must be separate or identical")

    with a.device:
        # the common case goes straight to the kernel: same dtype, same shape, contiguous
        ops = [x if x.dtype == dtype and x.shape == shape and x.flags.c_contiguous
               else xp.ascontiguousarray(xp.broadcast_to(x, shape), dtype=dtype) for x in (a, b)]
        direct = out is not None and out.dtype == dtype and out.flags.c_contiguous
        c = out if direct else xp.empty(shape, dtype)
        n = c.size
        if n:
            fn = get_kernel("vector_add.cu", vector_add_instance(dtype))
            packs = -(-n // (16 // dtype.itemsize))  # 16-byte packs, UNROLL per thread
            blocks = max(1, min(-(-packs // (_THREADS * VECTOR_ADD_UNROLL)), 2**31 - 1))
            fn((blocks,), (_THREADS,), (ops[0], ops[1], c, np.int64(n)))
        if out is not None and not direct:
            out[...] = c
            return out
        return c
