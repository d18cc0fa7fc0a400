"""``multi_head_attention``: the self-attention layer of a Transformer around ``attention``.

A call works on the tokens flattened to a 2-D ``(M, E)`` array, M the product of x's
leading dims, in three steps: the Q, K and V projections into the column blocks of one
``(M, 3E)`` array; :func:`~cuattn.attention` on per-head views of those blocks, written
through ``out=`` into an ``(..., N, H, Dh)`` buffer; the output projection of that buffer,
which is already the ``(M, E)`` matrix it needs. A product is a backend object
(:class:`_CublasProducts` for CuPy arrays, :class:`_NumpyProducts` for NumPy arrays) with
the same two methods, so the layer reads the same on both.
"""
from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import numpy as np

from ._checks import (
    FLOAT_DTYPES,
    MAX_HEAD_DIM,
    as_array,
    broadcasts_to,
    check_attention,
    check_flag,
    check_precision,
    loaded_cupy,
    mixed_kinds,
)
from .attention import attention

__all__ = ["multi_head_attention"]


def multi_head_attention(x, w_q, w_k, w_v, w_o, *, num_heads, b_q=None, b_k=None, b_v=None,
                         b_o=None, causal=False, mask=None, precision=None):
    """The self-attention layer of a Transformer / Vision Transformer (``x @ w`` convention).

    Parameters
    ----------
    x : (..., N, E) ndarray
        Tokens (numpy or cupy): float16, bfloat16, float32 or float64.
    w_q, w_k, w_v, w_o : (E, E) ndarray
        Projections, applied as ``x @ w``; dtype of x. Any layout with one axis of unit
        stride is read in place (``w.T`` of a PyTorch ``(out, in)`` weight included).
    num_heads : int
        E is split into ``num_heads`` heads of ``E // num_heads``.
    b_q, b_k, b_v, b_o : (E,) ndarray, optional
        Projection biases, dtype of x.
    causal : bool, optional
        Causal self-attention.
    mask : bool ndarray, optional
        True where a key is allowed; broadcastable to ``(..., num_heads, N, N)``.
    precision : {"highest", "tf32"}, optional
        float32 only, as for :func:`cuattn.attention`, which receives it: "highest"
        (default) computes the projections and attention as accurately as float32
        arithmetic; "tf32" allows TF32 tensor cores for both on CuPy arrays.

    Returns
    -------
    (..., N, E) ndarray
        C-contiguous, dtype and kind of x.

    Raises
    ------
    TypeError
        An unsupported array kind or dtype, a weight or bias whose dtype differs from x's,
        a non-int ``num_heads``, a non-bool ``causal`` or ``mask``.
    ValueError
        A weight or bias of the wrong shape, E not divisible by ``num_heads``, a head dim
        above 1024, a mask that does not broadcast, arrays on different devices, a bad
        ``precision``.

    Notes
    -----
    On CuPy arrays each projection is one cuBLAS ``cublasGemmEx`` call in the input dtype
    with float32 accumulation (float64 for float64), on tensor cores for 16-bit dtypes, on
    CuPy's cuBLAS handle and current stream. A bias is written into the output
    first and the product added onto it, so ``x @ w + b`` is rounded once. float32
    products are exact unless ``precision="tf32"``; the choice is an argument of each call
    (CuPy's ``CUPY_TF32`` setting does not apply), so threads may differ.

    When ``w_q``, ``w_k`` and ``w_v`` lie side by side in memory, as the column blocks of
    one ``(E, 3E)`` array (``w[:, :E]``, ``w[:, E:2 * E]``, ``w[:, 2 * E:]``) or as the
    transposed row blocks of PyTorch's ``(3E, E)`` ``in_proj_weight``, Q, K and V are one
    product against that matrix; otherwise three products write the three column blocks.
    Biases side by side likewise take one write. A weight is read where it lies, unless
    neither of its axes has unit stride (then a contiguous copy is multiplied). What is
    kept between calls is layout, never data: a CuPy call whose arrays have the shapes,
    strides, dtypes and devices of an earlier valid call (and the same other arguments)
    skips validation and launches the attention plan of that call; every array, weights
    changed in place included, is read anew.

    Device memory besides the result: the ``(M, 3E)`` projections and the ``(M, E)``
    attention output, M = ``prod(x.shape[:-1])``; x is copied only when it has no 2-D view
    ``(M, E)`` with one axis of unit stride.

    On NumPy arrays the products are NumPy's matmul; 16-bit ones run on float32 copies of
    the operands and are rounded once; ``precision`` applies to attention only (float32
    products are exact).

    Examples
    --------
    >>> import numpy as np, cuattn
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    >>> w = [rng.standard_normal((16, 16)).astype(np.float32) / 4 for _ in range(4)]
    >>> cuattn.multi_head_attention(x, *w, num_heads=4).shape
    (2, 5, 16)

    Q, K and V weights packed side by side take one product:

    >>> w_qkv = np.concatenate(w[:3], axis=1)               # (E, 3E)
    >>> y = cuattn.multi_head_attention(x, w_qkv[:, :16], w_qkv[:, 16:32], w_qkv[:, 32:],
    ...                                 w[3], num_heads=4, causal=True)
    >>> y.shape, y.dtype
    ((2, 5, 16), dtype('float32'))
    """
    params = (w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o)
    key = _signature(x, params, num_heads, causal, mask, precision)
    kept = None if key is None else _kept.get(key)
    if kept is not None and kept.xp.cuda.runtime.getDevice() == kept.device:
        args = _Args(params[:3], params[4:7], w_o, b_o, mask, precision)
        return _layer(x, args, num_heads, causal,
                      _CublasProducts.current(x.dtype, precision), kept)
    x, xp = as_array(x, "x")
    args = _check_layer(x, xp, dict(zip(_PARAMS, params)), num_heads, mask, precision)
    causal = check_flag(causal, "causal")
    if xp is np:
        return _layer(x, args, num_heads, causal, _NumpyProducts(x.dtype))
    device = x.data.device_id
    if xp.cuda.runtime.getDevice() != device:  # cuBLAS's handle is the current device's
        with xp.cuda.Device(device):
            return _layer(x, args, num_heads, causal,
                          _CublasProducts.current(x.dtype, args.precision))
    kept = _KeptAttention(xp, device)
    y = _layer(x, args, num_heads, causal, _CublasProducts.current(x.dtype, args.precision),
               kept)
    if key is not None and kept.plan is not None:
        if len(_kept) >= 256:
            _kept.clear()
        _kept[key] = kept
    return y


_PARAMS = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")


def _signature(x, params, num_heads, causal, mask, precision):
    """The signature of a CuPy call: everything validation reads (the arrays' exact type,
    shapes, dtypes and devices, the arguments with their types) and what the attention
    plan depends on besides (x's and the mask's strides, the variables that choose a
    kernel family or the sources); None for other calls."""
    cupy = loaded_cupy()
    if cupy is None or type(x) is not cupy.ndarray:
        return None
    ndarray = cupy.ndarray
    arrays = []
    for a in (x, *params, mask):
        if a is None:
            arrays.append(None)
        elif type(a) is not ndarray:
            return None
        else:
            arrays.append((a.shape, a.strides, a.dtype, a.data.device_id))
    key = (*arrays, type(num_heads), num_heads, type(causal), causal, type(precision),
           precision, os.environ.get("CUATTN_KERNEL"), os.environ.get("CUATTN_KERNEL_DIR"))
    try:
        hash(key)
    except TypeError:  # an unhashable argument: validation says what is wrong with it
        return None
    return key


#: CuPy layer calls by signature (:func:`_signature`) whose arguments were validated: the
#: attention step's kept plan (:class:`_KeptAttention`). A matching call skips validation
#: and attention's own validation and planning; everything else runs per call.
_kept: dict = {}


class _KeptAttention:
    """The attention step of a CuPy layer call: the first call validates it and keeps the
    plan that ran it; a call of the same layer signature (same views of new buffers)
    launches that plan with its own pointers."""

    def __init__(self, xp, device: int):
        self.xp, self.device, self.plan = xp, device, None

    def __call__(self, q, k, v, out, causal, mask, precision):
        if self.plan is None:
            from ._gpu import _run
            from ._gpu_plan import FORWARD_SLOTS
            call = check_attention(q, k, v, causal=causal, mask=mask, precision=precision,
                                   out=out)
            self.plan = _run(call, None, None, True)[2]
            # the forward's slots past q, k, v, out, lse and mask: no bias, key lengths or
            # page table
            self.rest = [0] * (len(FORWARD_SLOTS) - 6)
            return
        self.plan([q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, 0,
                   0 if mask is None else mask.data.ptr, *self.rest],
                  self.xp.cuda.get_current_stream().ptr)


class _Args(NamedTuple):
    """The validated arrays of a call."""
    w_qkv: tuple
    b_qkv: tuple
    w_o: Any
    b_o: Any
    mask: Any
    precision: str | None


def _check_layer(x, xp, params: dict, num_heads, mask, precision) -> _Args:
    """Validate a call (docs/semantics.rst, "Errors") before anything is allocated."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; supported dtypes are float16, bfloat16, "
                        f"float32 and float64")
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dims (..., N, E), got shape {x.shape}")
    embed = x.shape[-1]
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)):
        raise TypeError(f"num_heads must be an int, got num_heads={num_heads!r}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got num_heads={num_heads!r}")
    if embed % num_heads or embed == 0:
        raise ValueError(f"embedding dim {embed} is not divisible by num_heads={num_heads}")
    if embed // num_heads > MAX_HEAD_DIM:
        raise ValueError(f"head dim E // num_heads = {embed // num_heads}; supported head "
                         f"dims are 1 to {MAX_HEAD_DIM}")
    device = None if xp is np else x.data.device_id
    arrays = {}
    for name, w in params.items():
        shape = (embed, embed) if name.startswith("w") else (embed,)
        if w is None:
            if name.startswith("w"):
                raise TypeError(f"{name} must be an array, got None")
            arrays[name] = None
            continue
        w, xw = as_array(w, name)
        if xw is not xp:
            raise mixed_kinds(name, xw, "x", xp)
        if w.dtype != x.dtype:
            raise TypeError(f"{name} must have the dtype of x ({x.dtype}), got {w.dtype}")
        if w.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {w.shape}")
        if device is not None and w.data.device_id != device:
            raise ValueError(f"all arrays must be on one device, got x on device {device}, "
                             f"{name} on device {w.data.device_id}")
        arrays[name] = w
    if mask is not None:
        mask = _check_mask(mask, x, xp, num_heads, device)
    check_precision(precision, x.dtype)
    return _Args((arrays["w_q"], arrays["w_k"], arrays["w_v"]),
                 (arrays["b_q"], arrays["b_k"], arrays["b_v"]), arrays["w_o"], arrays["b_o"],
                 mask, precision)


def _check_mask(mask, x, xp, num_heads, device):
    mask, xm = as_array(mask, "mask")
    if xm is not xp:
        raise mixed_kinds("mask", xm, "x", xp)
    if mask.dtype != np.bool_:
        raise TypeError(f"mask must be a bool array, got dtype {mask.dtype}")
    n = x.shape[-2]
    target = x.shape[:-2] + (num_heads, n, n)
    # a mask may not add batch axes: the result keeps x's shape
    if not broadcasts_to(mask.shape, target):
        raise ValueError(f"mask of shape {mask.shape} does not broadcast to "
                         f"(..., num_heads, N, N) = {target}")
    if device is not None and mask.data.device_id != device:
        raise ValueError(f"all arrays must be on one device, got x on device {device}, "
                         f"mask on device {mask.data.device_id}")
    return mask


def _attention(q, k, v, out, causal, mask, precision):
    attention(q, k, v, causal=causal, mask=mask, precision=precision, out=out)


def _layer(x, args: _Args, num_heads: int, causal: bool, products, attend=_attention):
    """The layer of a validated call, its products computed by ``products``, its attention
    by ``attend(q, k, v, out, causal, mask, precision)``."""
    xp, dtype = products.xp, x.dtype
    lead, embed = x.shape[:-1], x.shape[-1]
    rows, head_dim = math.prod(lead), embed // num_heads
    y = xp.empty((rows, embed), dtype)
    if rows == 0:
        return y.reshape(x.shape)
    x2d = products.operand(x.reshape(rows, embed))

    qkv = xp.empty((rows, 3 * embed), dtype)
    blocks = [qkv[:, i * embed:(i + 1) * embed] for i in range(3)]
    w_qkv, b_qkv = args.w_qkv, args.b_qkv
    given = [b is not None for b in b_qkv]
    packed_b = products.side_by_side(b_qkv) if all(given) else None
    if packed_b is not None:
        _fill_rows(xp, qkv, packed_b)
    else:
        for block, b in zip(blocks, b_qkv):
            if b is not None:
                _fill_rows(xp, block, b)
    # one product needs every block's bias written, or none
    packed_w = products.side_by_side(w_qkv) if all(given) or not any(given) else None
    if packed_w is not None:
        products(x2d, packed_w, qkv, accumulate=all(given))
    else:
        for block, w, has_bias in zip(blocks, w_qkv, given):
            products(x2d, products.operand(w), block, accumulate=has_bias)

    # (M, E) blocks -> (..., H, N, Dh) views; the output buffer (..., N, H, Dh) is the
    # out-projection's (M, E) input as it stands
    q, k, v = (b.reshape(lead + (num_heads, head_dim)).swapaxes(-2, -3) for b in blocks)
    heads = xp.empty(lead + (num_heads, head_dim), dtype)
    attend(q, k, v, heads.swapaxes(-2, -3), causal, args.mask, args.precision)

    if args.b_o is not None:
        _fill_rows(xp, y, args.b_o)
    products(heads.reshape(rows, embed), products.operand(args.w_o), y,
             accumulate=args.b_o is not None)
    return y.reshape(x.shape)


def _fill_rows(xp, out, row) -> None:
    """Every row of ``out`` (M, N) set to ``row`` (N,), the bias that a product then adds
    to. A broadcasting copy costs about one elementwise step per element, so where both
    are contiguous and aligned it copies the same bits as the widest unsigned integers (to
    8 bytes) that a row divides into: a quarter of the steps for 16-bit data."""
    nbytes = row.shape[-1] * row.itemsize
    for width in (8, 4):
        if (width > row.itemsize and nbytes % width == 0 and out.flags.c_contiguous
                and row.flags.c_contiguous and _pointer(out) % width == 0
                and _pointer(row) % width == 0):
            xp.copyto(out.view(f"u{width}"), row.view(f"u{width}"))
            return
    xp.copyto(out, row)


class _NumpyProducts:
    """``out = a @ b`` (``+ out`` when accumulating) with NumPy's matmul: 16-bit operands in
    float32 (NumPy has no 16-bit BLAS) and the result rounded once. float32 products are
    exact whatever the precision."""

    xp = np

    def __init__(self, dtype):
        self.work = np.dtype(np.float32) if dtype.itemsize == 2 else dtype

    def operand(self, a):
        return a.astype(self.work, copy=False)

    def side_by_side(self, parts):
        return None  # three BLAS calls cost NumPy nothing more than one

    def __call__(self, a, b, out, accumulate: bool) -> None:
        a, b = self.operand(a), self.operand(b)
        if accumulate:
            out[...] = a @ b + out.astype(self.work, copy=False)
        elif out.dtype == self.work:
            np.matmul(a, b, out=out)
        else:
            out[...] = a @ b


#: per dtype: cudaDataType_t (CUDA's library_types.h), then the cublasComputeType_t
#: (cublas_api.h) of its products, exact and with precision="tf32"
_CUBLAS_TYPES = {
    "float16": (2, 68, 68),      # CUDA_R_16F; CUBLAS_COMPUTE_32F
    "bfloat16": (14, 68, 68),    # CUDA_R_16BF; CUBLAS_COMPUTE_32F
    "float32": (0, 68, 77),      # CUDA_R_32F; CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32
    "float64": (1, 70, 70),      # CUDA_R_64F; CUBLAS_COMPUTE_64F
}
_OP_N, _OP_T = 0, 1              # cublasOperation_t
#: cublasGemmAlgo_t: cuBLAS's own choice, and its tensor-op variant, which CuPy's own matmul
#: passes for 16-bit products (compute capability 8.0 on; 7.0 for float16), as here
_GEMM_DEFAULT, _GEMM_TENSOR_OP = -1, 99
#: alpha and beta (1 and 0), which cuBLAS reads from host memory during the call: float32
#: for the 32F compute types, float64 for 64F
_ONE_ZERO = {np.dtype(t): (np.ones(1, t), np.zeros(1, t)) for t in (np.float32, np.float64)}


class _Matrix(NamedTuple):
    """A row-major matrix in memory: its first element's address and byte strides."""
    ptr: int
    rows: int
    cols: int
    row_stride: int
    col_stride: int


def _pointer(a) -> int:
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


def _matrix(a) -> _Matrix:
    return _Matrix(_pointer(a), *a.shape, *a.strides)


def _blas_view(m: _Matrix, itemsize: int):
    """(pointer, op, leading dim) under which cuBLAS, which is column-major, reads the
    transpose of the row-major matrix ``m``; None when neither axis has unit stride."""
    if m.row_stride % itemsize or m.col_stride % itemsize:
        return None
    s0, s1 = m.row_stride // itemsize, m.col_stride // itemsize
    if m.cols == 1 or s1 == 1:  # rows contiguous: the column-major memory of m's transpose
        ld = s0 if m.rows > 1 else m.cols
        if ld >= m.cols:
            return m.ptr, _OP_N, ld
    if m.rows == 1 or s0 == 1:  # columns contiguous: column-major m, transposed by cuBLAS
        ld = s1 if m.cols > 1 else m.rows
        if ld >= m.rows:
            return m.ptr, _OP_T, ld
    return None


def _gemm_algo(dtype, capability: int) -> int:
    """The algorithm of a product of ``dtype`` operands on a GPU of compute capability
    ``capability`` (e.g. 90): the tensor-op one for 16-bit operands where CuPy uses it,
    cuBLAS's own choice otherwise (float32 products stay exact)."""
    if dtype.itemsize == 2 and (capability >= 80 or capability >= 70 and dtype == np.float16):
        return _GEMM_TENSOR_OP
    return _GEMM_DEFAULT


class _CublasProducts:
    """``out = a @ b`` (``+ out`` when accumulating: beta = 1) as one ``cublasGemmEx`` in
    the dtype of the operands, accumulated in float32 (float64 for float64). cuBLAS is
    column-major, so C = A B runs as Cᵀ = Bᵀ Aᵀ with each operand passed as the transpose
    its memory already holds (:func:`_blas_view`). ``gemm_ex`` is CuPy's binding
    ``cupy_backends.cuda.libs.cublas.gemmEx``, which sets the handle's stream to the current
    one before each call."""

    def __init__(self, dtype, precision, gemm_ex, handle: int, xp, algo=_GEMM_DEFAULT):
        self.xp, self.algo = xp, algo
        self.itemsize = dtype.itemsize
        self.type, exact, tf32 = _CUBLAS_TYPES[dtype.name]
        self.compute = tf32 if precision == "tf32" else exact
        one, zero = _ONE_ZERO[np.dtype(np.float64 if dtype == np.float64 else np.float32)]
        self.one, self.zero = one.ctypes.data, zero.ctypes.data
        self.gemm_ex, self.handle = gemm_ex, handle

    @classmethod
    def current(cls, dtype, precision):
        """Products on CuPy's cuBLAS handle of the current device (one per thread)."""
        import cupy
        from cupy.cuda import device
        from cupy_backends.cuda.libs import cublas
        return cls(dtype, precision, cublas.gemmEx, device.get_cublas_handle(), cupy,
                   _gemm_algo(dtype, int(device.get_compute_capability())))

    def operand(self, a):
        """``a`` itself when cuBLAS can read it, else a C-contiguous copy."""
        if _blas_view(_matrix(a), self.itemsize) is None:
            return self.xp.ascontiguousarray(a)
        return a

    def side_by_side(self, parts):
        """``parts`` (weights or biases) as one array whose column blocks they are, when
        they lie side by side in memory, else None: a :class:`_Matrix` for weights that
        cuBLAS can read, a view for biases."""
        first = parts[0]
        step = first.shape[-1] * first.strides[-1]
        ptr = _pointer(first)
        if first.strides[-1] <= 0 or any(
                p.strides != first.strides or _pointer(p) != ptr + i * step
                for i, p in enumerate(parts)):
            return None
        if first.ndim == 1:
            return self.xp.lib.stride_tricks.as_strided(first, (3 * first.size,),
                                                        first.strides)
        whole = _Matrix(ptr, first.shape[0], 3 * first.shape[1], *first.strides)
        return whole if _blas_view(whole, self.itemsize) is not None else None

    def __call__(self, a, b, out, accumulate: bool) -> None:
        a = a if isinstance(a, _Matrix) else _matrix(a)
        b = b if isinstance(b, _Matrix) else _matrix(b)
        ptr_a, op_a, ld_a = _blas_view(a, self.itemsize)
        ptr_b, op_b, ld_b = _blas_view(b, self.itemsize)
        # the layer's outputs have unit column stride: Cᵀ's column-major memory
        ld_c = max(out.strides[0] // self.itemsize, out.shape[1])
        self.gemm_ex(self.handle, op_b, op_a, b.cols, a.rows, a.cols,
                     self.one, ptr_b, self.type, ld_b, ptr_a, self.type, ld_a,
                     self.one if accumulate else self.zero, _pointer(out), self.type, ld_c,
                     self.compute, self.algo)
