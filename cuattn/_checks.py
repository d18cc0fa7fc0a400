"""Argument validation shared by every backend and the references.

Everything a call can get wrong is found here, before any launch or allocation, and raised
with the documented exception types: ``TypeError`` for kinds and dtypes, ``ValueError`` for
shapes and values. The functions return small records of normalised arguments that the backends
consume without re-checking.
"""
from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["AttentionCall", "check_attention", "check_backward", "as_array", "may_overlap",
           "FLOAT_DTYPES", "MAX_HEAD_DIM", "lse_dtype", "check_flag", "loaded_cupy",
           "sum_to_shape", "mixed_kinds", "check_precision", "broadcasts_to"]

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32),
                np.dtype(np.float64))
#: The largest head dim any kernel family serves (the portable one).
MAX_HEAD_DIM = 1024
PRECISIONS = ("highest", "tf32")


_CUPY: list = []  # the cupy module (or None), imported once


def _cupy_or_none():
    if not _CUPY:
        try:
            import cupy
        except ImportError:
            cupy = None
        _CUPY.append(cupy)
    return _CUPY[0]


def loaded_cupy():
    """CuPy if something has imported it, else None: an array can only be a cupy.ndarray
    once CuPy is imported, so NumPy-only calls never pay for the import."""
    return sys.modules.get("cupy")


def as_array(x: Any, name: str):
    """Return ``(array, xp)``: NumPy arrays as they are, CuPy arrays as they are, and CUDA
    ``__cuda_array_interface__`` / ``__dlpack__`` objects as zero-copy CuPy views."""
    if isinstance(x, np.ndarray):
        return x, np
    cupy = loaded_cupy()
    if cupy is not None and isinstance(x, cupy.ndarray):
        return x, cupy
    on_cuda = hasattr(x, "__cuda_array_interface__")
    if not on_cuda and hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        try:
            on_cuda = int(x.__dlpack_device__()[0]) in (2, 3, 13)  # CUDA, CUDA host, managed
        except Exception:  # noqa: BLE001 - an exotic object: not an array we take
            on_cuda = False
    if on_cuda:
        cupy = _cupy_or_none()
        if cupy is None:
            from ._kernels import require_cupy
            require_cupy()
        if hasattr(x, "__dlpack__"):
            return cupy.from_dlpack(x), cupy
        return cupy.asarray(x), cupy
    raise TypeError(f"{name} must be a numpy.ndarray, a cupy.ndarray or a CUDA array "
                    f"(DLPack / __cuda_array_interface__), got {type(x).__name__}")


def lse_dtype(dtype) -> np.dtype:
    """lse is float32, or float64 for float64 inputs."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


@dataclass(slots=True)
class AttentionCall:
    """One validated attention call. ``window_left``/``window_right`` are -1 when unbounded
    and already include ``causal``; ``softcap`` is 0.0 when absent."""
    xp: Any
    q: Any
    k: Any
    v: Any
    mask: Any
    bias: Any
    out: Any
    batch_shape: tuple
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    scale: float
    softcap: float
    window_left: int
    window_right: int
    precision: str | None
    return_lse: bool
    #: key lengths that the GPU kernels read (cuattn._ragged, KEY_LENGTHS in common.cuh): a
    #: CuPy int32 or int64 array broadcastable to the batch shape; batch entry b has keys
    #: k_lengths[b] - k_lengths_from - (its index along the last batch axis) x
    #: k_lengths_step of this call's, within 0 .. Sk (a split call's chunks shift them)
    k_lengths: Any = None
    k_lengths_from: int = 0
    k_lengths_step: int = 0
    #: paged keys and values that the GPU kernels read in place (cuattn._paged.Pages; PAGED
    #: in common.cuh), with key lengths: k and v are then zero-stride stand-ins at the pools'
    #: first element, of the shape of the keys and values the table describes
    pages: Any = None

    @property
    def dtype(self) -> np.dtype:
        return self.q.dtype

    @property
    def out_shape(self) -> tuple:
        return self.batch_shape + (self.seqlen_q, self.head_dim_v)

    @property
    def lse_shape(self) -> tuple:
        return self.batch_shape + (self.seqlen_q,)

    @property
    def window(self) -> tuple | None:
        """The band as the ``window`` argument that says it (causal included), or None."""
        sides = (self.window_left, self.window_right)
        return None if sides == (-1, -1) else tuple(None if w < 0 else w for w in sides)

    def keywords(self) -> dict:
        """The call's scalar arguments, as keywords of another call (on parts of its
        arrays): scale, softcap, precision."""
        return {"scale": self.scale, "softcap": self.softcap or None,
                "precision": self.precision}


def byte_span(x) -> tuple[int, int]:
    """[low, high) byte offsets from its first element that the array ``x`` can touch: a
    function of its shape, strides and itemsize only."""
    if x.size == 0:
        return 0, 0
    lo = hi = 0
    for n, st in zip(x.shape, x.strides):
        lo += min(0, (n - 1) * st)
        hi += max(0, (n - 1) * st)
    return lo, hi + x.itemsize


def byte_bounds(x) -> tuple[int, int]:
    """[low, high) device or host addresses that the array ``x`` can touch."""
    ptr = x.__array_interface__["data"][0] if isinstance(x, np.ndarray) else x.data.ptr
    lo, hi = byte_span(x)
    return ptr + lo, ptr + hi


def may_overlap(x, y) -> bool:
    """Whether two arrays' address ranges intersect (NumPy's may_share_memory, cheaply)."""
    (a0, a1), (b0, b1) = byte_bounds(x), byte_bounds(y)
    return a0 < b1 and b0 < a1


def mixed_kinds(name: str, xp, ref: str, ref_xp) -> TypeError:
    """The error for array ``name`` of another kind (numpy / cupy) than ``ref``."""
    kind = {True: "numpy", False: "cupy"}
    return TypeError(f"host and device arrays cannot be mixed in one call: {name} is "
                     f"{kind[xp is np]}, {ref} is {kind[ref_xp is np]}")


def _device_id(x, xp):
    return None if xp is np else x.data.device_id


def _real_scalar(value) -> bool:
    """A Python or NumPy real number, or a 0-d NumPy/CuPy array of one; not a bool (an int)
    nor a str (float() would convert it)."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, numbers.Real):
        return True
    dtype = getattr(value, "dtype", None)
    return (getattr(value, "ndim", None) == 0 and dtype is not None
            and np.dtype(dtype).kind in "iuf")


def _positive_finite(value, name):
    if not _real_scalar(value):
        raise TypeError(f"{name} must be a real number, got {name}={value!r} "
                        f"({type(value).__name__})")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and positive, got {name}={value}")
    return value


def check_flag(value, name: str) -> bool:
    """A bool argument: Python's or NumPy's bool only (``causal="no"`` is not False)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {name}={value!r} ({type(value).__name__})")
    return bool(value)


def _window(window, causal: bool) -> tuple[int, int]:
    left = right = -1
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(f"window must be a pair (left, right), got window={window!r}")
        sides = []
        for side_name, side in zip(("left", "right"), window):
            if side is None:
                side = -1
            if isinstance(side, bool) or not isinstance(side, (int, np.integer)):
                raise ValueError(f"window {side_name} must be an int, -1 or None, got {side!r}")
            if side < -1:
                raise ValueError(f"window {side_name} must be >= 0, or -1/None for unbounded, "
                                 f"got window={tuple(window)!r}")
            sides.append(int(side))
        left, right = sides
    if causal:  # causal is the window (left, 0); with a window given both must hold
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _trailing_broadcasts(shape, target, name):
    """True when the last two dims of ``shape`` broadcast to ``target`` (Sq, Sk)."""
    tail = tuple(shape[-2:]) if len(shape) >= 2 else tuple(shape)
    tail = (1,) * (2 - len(tail)) + tail
    for have, want in zip(tail, target):
        if have not in (1, want):
            raise ValueError(f"{name} of shape {tuple(shape)} does not broadcast to "
                             f"(..., Sq, Sk) = (..., {target[0]}, {target[1]})")


def check_attention(q, k, v, *, scale=None, causal=False, window=None, mask=None, bias=None,
                    softcap=None, return_lse=False, precision=None, out=None) -> AttentionCall:
    """Validate an attention call and normalise its arguments (docs/semantics.rst, "Errors")."""
    # plain lists and loops: this runs on every call (the host-overhead budget)
    (q, xp), (k, xk), (v, xv) = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    arrays = [("q", q, xp), ("k", k, xk), ("v", v, xv)]
    if mask is not None:
        mask, xm = as_array(mask, "mask")
        arrays.append(("mask", mask, xm))
    if bias is not None:
        bias, xb = as_array(bias, "bias")
        arrays.append(("bias", bias, xb))
    if out is not None:
        out, xo = as_array(out, "out")
        arrays.append(("out", out, xo))
    if any(mod is not xp for _, _, mod in arrays):
        raise TypeError("host and device arrays cannot be mixed in one call: "
                        + ", ".join(f"{n} is {'numpy' if mod is np else 'cupy'}"
                                    for n, _, mod in arrays))

    for name, x, _ in arrays[:3]:
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; supported dtypes are float16, "
                            f"bfloat16, float32 and float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, "
                        f"v={v.dtype} (cuattn does not promote silently)")
    if mask is not None and mask.dtype != np.bool_:
        raise TypeError(f"mask must be a bool array, got dtype {mask.dtype}")
    if bias is not None and bias.dtype not in FLOAT_DTYPES:
        raise TypeError(f"bias must be a floating array (float16, bfloat16, float32, float64), "
                        f"got dtype {bias.dtype}")

    for name, x, _ in arrays[:3]:
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., S, D), got shape "
                             f"{x.shape}")
    seqlen_q, head_dim = q.shape[-2:]
    seqlen_k, head_dim_v = v.shape[-2:]
    if k.shape[-1] != head_dim:
        raise ValueError(f"k has head dim {k.shape[-1]} but q has {head_dim} (they must match)")
    if k.shape[-2] != seqlen_k:
        raise ValueError(f"v has {seqlen_k} keys (Sk) but k has {k.shape[-2]} (they must match)")
    for name, dim in (("q and k", head_dim), ("v", head_dim_v)):
        if dim < 1 or dim > MAX_HEAD_DIM:
            raise ValueError(f"head dim of {name} is {dim}; supported head dims are 1 to "
                             f"{MAX_HEAD_DIM}")

    # masks and biases of fewer than 2 dims broadcast like NumPy: give them the missing
    # leading axes as size-1 views, so every backend can index [..., rows, cols]
    if mask is not None and mask.ndim < 2:
        mask = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)
    if bias is not None and bias.ndim < 2:
        bias = bias.reshape((1,) * (2 - bias.ndim) + bias.shape)
    if max(seqlen_q, seqlen_k) >= 2**31:
        raise ValueError(f"sequence lengths must be below 2**31, got Sq={seqlen_q}, "
                         f"Sk={seqlen_k}")
    leading = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    for name, extra in (("mask", mask), ("bias", bias)):
        if extra is not None:
            _trailing_broadcasts(extra.shape, (seqlen_q, seqlen_k), name)
            leading.append(extra.shape[:-2])
    try:
        first = leading[0]
        batch_shape = (first if all(shape == first for shape in leading) else
                       tuple(int(n) for n in np.broadcast_shapes(*leading)))
    except ValueError:
        shapes = ", ".join(f"{n}={x.shape}" for n, x, _ in arrays if n != "out")
        raise ValueError(f"the leading (batch) dims do not broadcast together: {shapes}") from None

    if xp is not np:
        device = q.data.device_id
        if any(x.data.device_id != device for _, x, _ in arrays):
            raise ValueError("all arrays must be on one device, got " + ", ".join(
                f"{n} on device {x.data.device_id}" for n, x, _ in arrays))

    scale = 1.0 / math.sqrt(head_dim) if scale is None else _positive_finite(scale, "scale")
    softcap = 0.0 if softcap is None else _positive_finite(softcap, "softcap")
    causal = check_flag(causal, "causal")
    return_lse = check_flag(return_lse, "return_lse")
    window_left, window_right = _window(window, causal)

    check_precision(precision, q.dtype)
    if precision is None and q.dtype == np.float32:
        precision = "highest"

    out_shape = batch_shape + (seqlen_q, head_dim_v)
    if out is not None:
        if out.shape != out_shape or out.dtype != q.dtype:
            raise ValueError(f"out must have shape {out_shape} and dtype {q.dtype}, got shape "
                             f"{out.shape} and dtype {out.dtype}")
        if not _writeable(out):
            raise ValueError("out is read-only; it must be a writeable array")
        for name, x, _ in arrays:
            if name != "out" and may_overlap(out, x):
                raise ValueError(f"out overlaps {name}; it must be a separate array")

    return AttentionCall(xp=xp, q=q, k=k, v=v, mask=mask, bias=bias, out=out,
                         batch_shape=batch_shape, seqlen_q=int(seqlen_q),
                         seqlen_k=int(seqlen_k), head_dim=int(head_dim),
                         head_dim_v=int(head_dim_v), scale=scale, softcap=softcap,
                         window_left=window_left, window_right=window_right,
                         precision=precision, return_lse=bool(return_lse))


def check_precision(precision, dtype) -> None:
    """``precision``: None, or "highest" / "tf32" for float32 inputs only."""
    if precision is None:
        return
    if dtype != np.float32:
        raise ValueError(f"precision applies to float32 only, got precision={precision!r} "
                         f"for {dtype} inputs")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be 'highest' or 'tf32', got precision={precision!r}")


def broadcasts_to(shape, target) -> bool:
    """Whether an array of ``shape`` broadcasts to ``target`` without changing it."""
    try:
        return np.broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
    except ValueError:
        return False


def _writeable(x) -> bool:
    """NumPy's writeable flag (a read-only view or buffer); CuPy arrays are always writeable."""
    return bool(getattr(x.flags, "writeable", True))


def check_backward(call: AttentionCall, dout, out, lse):
    """Validate the extra arrays of a backward call against a validated forward call."""
    converted = []
    for name, x, shape, dtype in (("dout", dout, call.out_shape, call.dtype),
                                  ("out", out, call.out_shape, call.dtype),
                                  ("lse", lse, call.lse_shape, lse_dtype(call.dtype))):
        x, xm = as_array(x, name)
        if xm is not call.xp:
            raise mixed_kinds(name, xm, "q", call.xp)
        if x.dtype != dtype:
            raise TypeError(f"{name} must have dtype {dtype}, got {x.dtype}")
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
        if _device_id(x, xm) != _device_id(call.q, call.xp):
            raise ValueError(f"{name} is on device {_device_id(x, xm)} but q is on "
                             f"device {_device_id(call.q, call.xp)}")
        converted.append(x)
    return tuple(converted)


def sum_to_shape(grad, shape):
    """Sum ``grad`` over the axes along which an input of ``shape`` was broadcast."""
    extra = grad.ndim - len(shape)
    grad = grad.sum(axis=tuple(range(extra))) if extra else grad
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and grad.shape[a] != 1)
    return grad.sum(axis=axes, keepdims=True) if axes else grad
