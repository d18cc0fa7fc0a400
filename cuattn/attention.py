"""``attention``, ``attention_backward``, ``attention_vjp`` and ``multi_head_attention``.

Each public function validates its arguments (``_checks``), then hands NumPy calls to the
blocked NumPy backend (``_cpu``) and CuPy calls to the kernel that ``_dispatch`` picks,
launched here on the current stream with a parameter block of pointers and strides.
"""
from __future__ import annotations

import functools
import math
import os

import numpy as np

from . import _cpu, _dispatch
from ._checks import (
    FLOAT_DTYPES,
    AttentionCall,
    as_array,
    check_attention,
    check_backward,
    check_flag,
    loaded_cupy,
    lse_dtype,
)
from ._kernels import (
    ForwardLaunch,
    Tf32PrepLaunch,
    attn_params_tail,
    get_kernel,
    pack_attn_bwd_params,
)
from .reference import sum_to_shape

__all__ = ["attention", "attention_backward", "attention_vjp", "multi_head_attention"]


def attention(q, k, v, *, scale=None, causal=False, window=None, mask=None, bias=None,
              softcap=None, return_lse=False, precision=None, out=None):
    """Exact scaled dot-product attention, ``softmax(scale · q kᵀ + bias) v``, in O(S) memory.

    Parameters
    ----------
    q : (..., Sq, D) ndarray
        Queries: numpy, cupy, or a CUDA array (PyTorch, JAX, Numba) taken zero-copy
        through DLPack / ``__cuda_array_interface__``. float16, bfloat16, float32 or float64.
    k : (..., Sk, D) ndarray
        Keys, same dtype as q.
    v : (..., Sk, Dv) ndarray
        Values, same dtype as q. The leading dims of q, k, v, mask and bias broadcast
        together into the batch shape (heads are a batch axis; GQA is broadcasting).
    scale : float, optional
        Score scale, default ``1 / sqrt(D)``; finite and positive.
    causal : bool, optional
        Key j is allowed for row i when ``j <= i + (Sk - Sq)`` (bottom-right aligned).
    window : (int or None, int or None), optional
        Local attention band ``(left, right)`` around ``i + (Sk - Sq)``; -1 or None is
        unbounded. Combined with ``causal``, both must hold.
    mask : (..., Sq, Sk) bool ndarray, optional
        True where a key is allowed; broadcast like NumPy (e.g. ``(B, 1, 1, Sk)`` padding).
    bias : (..., Sq, Sk) floating ndarray, optional
        Added to the scores after softcap, before masking.
    softcap : float, optional
        Scores become ``softcap · tanh(s / softcap)`` before the bias.
    return_lse : bool, optional
        Also return the natural-log row log-sum-exp.
    precision : {"highest", "tf32"}, optional
        float32 only. "highest" (default) is as accurate as plain float32 arithmetic;
        "tf32" allows TF32 tensor cores.
    out : (..., Sq, Dv) ndarray, optional
        Where to write the result; dtype of q, not overlapping any input.

    Returns
    -------
    out : (..., Sq, Dv) ndarray
        Same kind and device as the inputs, dtype of q. A row with no allowed key is 0.
    lse : (..., Sq) ndarray
        Only with ``return_lse``: float32 (float64 for float64 inputs); -inf for a row with
        no allowed key.

    Raises
    ------
    TypeError
        Unsupported array kind or dtype, mixed host/device arrays, non-bool mask.
    ValueError
        Mismatched or non-broadcasting shapes, bad scale/softcap/window/precision/out.

    Notes
    -----
    CuPy inputs run the CUDA kernels on the current stream without synchronising; NumPy
    inputs run the same blocked online softmax in NumPy. Accumulation is float32 for
    16-bit and float32 inputs, float64 for float64.

    Examples
    --------
    >>> import numpy as np, cuattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 16, 8)).astype(np.float32) for _ in range(3))
    >>> out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, lse.shape, out.dtype
    ((2, 4, 16, 8), (2, 4, 16), dtype('float32'))
    """
    if out is None:
        result = _repeated_call(q, k, v, mask, bias, window, scale, causal, softcap,
                                return_lse, precision)
        if result is not None:
            return result
    call = check_attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                           bias=bias, softcap=softcap, return_lse=return_lse,
                           precision=precision, out=out)
    out, lse = _forward(call)
    return (out, lse) if call.return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, scale=None, causal=False, window=None,
                       mask=None, bias=None, softcap=None, precision=None):
    """Gradients of :func:`attention` with respect to q, k and v.

    FlashAttention-2's algorithm: the attention probabilities are recomputed tile by tile
    from q, k and the forward's ``lse``, so nothing of size Sq × Sk is stored.

    Parameters
    ----------
    dout : (..., Sq, Dv) ndarray
        Gradient of the loss with respect to the forward's output; dtype of q.
    q, k, v : ndarray
        The forward's inputs (see :func:`attention`).
    out : (..., Sq, Dv) ndarray
        The forward's output.
    lse : (..., Sq) ndarray
        The forward's ``lse`` (``return_lse=True``): float32, or float64 for float64.
    scale, causal, window, mask, bias, softcap, precision
        As given to the forward. ``bias`` is treated as a constant.

    Returns
    -------
    dq, dk, dv : ndarray
        Shapes and dtypes of q, k and v: where an input was broadcast, its gradient is summed
        over the broadcast axes (NumPy's rule), so GQA gives dk and dv of k's and v's shape.
        A row with no allowed key contributes zero. Repeated calls are bit-identical.

    Raises
    ------
    TypeError, ValueError
        As for :func:`attention`, and when dout, out or lse do not match the call.

    Notes
    -----
    On CuPy arrays three kernels run on the current stream: ``delta = rowsum(dout ∘ out)``,
    then dK and dV per key block and dQ per query block, each gradient element written once
    (no atomics). A gradient of a broadcast input is computed per batch entry in float32
    (float64 for float64) and summed over the broadcast axes, which takes that much extra
    memory; otherwise the extra memory is ``delta``, one number per query row.

    Examples
    --------
    >>> import numpy as np, cuattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 8, 4)) for _ in range(3))
    >>> out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    >>> dq, dk, dv = cuattn.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True)
    >>> dq.shape, dk.shape, dv.shape
    ((2, 8, 4), (2, 8, 4), (2, 8, 4))
    """
    call = check_attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                           bias=bias, softcap=softcap, precision=precision)
    dout, out, lse = check_backward(call, dout, out, lse)
    return _backward(call, dout, out, lse)


def attention_vjp(q, k, v, *, scale=None, causal=False, window=None, mask=None, bias=None,
                  softcap=None, precision=None):
    """The forward and a function that computes its vector-Jacobian product.

    Returns ``(out, vjp)``: ``out`` is ``attention(q, k, v, ...)`` and ``vjp(dout)`` returns
    ``(dq, dk, dv)`` by :func:`attention_backward`, reusing the saved ``out`` and ``lse``.

    Examples
    --------
    >>> import numpy as np, cuattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((3, 5, 4)).astype(np.float32) for _ in range(3))
    >>> out, vjp = cuattn.attention_vjp(q, k, v)
    >>> [g.shape for g in vjp(np.ones_like(out))]
    [(3, 5, 4), (3, 5, 4), (3, 5, 4)]
    """
    kwargs = dict(scale=scale, causal=causal, window=window, mask=mask, bias=bias,
                  softcap=softcap, precision=precision)
    call = check_attention(q, k, v, return_lse=True, **kwargs)
    out, lse = _forward(call)

    def vjp(dout):
        return attention_backward(dout, q, k, v, out, lse, **kwargs)

    return out, vjp


def _forward(call: AttentionCall, kernel: str | None = None, tiles=None):
    """Run a validated call on its backend; ``kernel`` forces a GPU family (tests) and
    ``tiles`` overrides the dispatch table's tile sizes (sweeps)."""
    if call.xp is np:
        return _cpu.attention_forward(call)
    return _forward_gpu(call, kernel, tiles)


def _backward(call: AttentionCall, dout, out, lse, kernel: str | None = None, tiles=None):
    """Gradients of a validated call on its backend (``kernel``, ``tiles`` as for
    :func:`_forward`)."""
    if call.xp is np:
        return _cpu.attention_backward(call, dout, out, lse)
    return _backward_gpu(call, dout, out, lse, kernel, tiles)


def _attention_backward(dout, q, k, v, out, lse, *, kernel=None, tiles=None, **kwargs):
    """The private backward dispatcher: :func:`attention_backward` with a forced kernel
    family or tiles."""
    call = check_attention(q, k, v, **kwargs)
    dout, out, lse = check_backward(call, dout, out, lse)
    return _backward(call, dout, out, lse, kernel, tiles)


def _attention(q, k, v, *, kernel=None, tiles=None, **kwargs):
    """The private dispatcher: :func:`attention` with a forced kernel family or tiles."""
    call = check_attention(q, k, v, **kwargs)
    out, lse = _forward(call, kernel, tiles)
    return (out, lse) if call.return_lse else out


# ---- GPU launch ----------------------------------------------------------------------

def _broadcast_strides(x, shape) -> list[int]:
    """Element strides of ``x`` viewed as broadcast to ``shape`` (0 on broadcast axes),
    computed without making the view."""
    itemsize = x.itemsize
    return [0] * (len(shape) - x.ndim) + [0 if n == 1 else st // itemsize
                                          for n, st in zip(x.shape, x.strides)]


def _collapse_batch(batch_shape, strides_per_array):
    """Merge adjacent batch axes that every array walks contiguously; drop size-1 axes.
    Returns [(extent, [stride of each array])], outermost first."""
    merged = []
    for axis, extent in enumerate(batch_shape):
        if extent == 1:
            continue
        strides = [s[axis] for s in strides_per_array]
        if merged:
            prev_extent, prev_strides = merged[-1]
            if all(ps == s * extent for ps, s in zip(prev_strides, strides)):
                merged[-1] = (prev_extent * extent, strides)
                continue
        merged.append((extent, strides))
    return merged


@functools.cache
def _device_limits(device_id: int) -> tuple[tuple[int, int], int]:
    """(compute capability, opt-in shared memory per block) of a device."""
    import cupy
    dev = cupy.cuda.Device(device_id)
    cc = dev.compute_capability  # e.g. "90"
    return (int(cc[:-1]), int(cc[-1])), int(dev.attributes["MaxSharedMemoryPerBlockOptin"])


def _layout(batch, tensors):
    """Collapse the batch axes of every present tensor into at most three kernel axes.

    ``tensors`` holds ``(array or None, strides over batch + its two last axes)`` per slot of
    the parameter block. Returns the three inner extents (outermost first), the flat list of
    5 strides per slot (b0, b1, b2, row, col; zeros for an absent array) and one list of slot
    pointers per launch: batch axes that did not collapse into three are a loop here."""
    nb = len(batch)
    present = [i for i, (x, _) in enumerate(tensors) if x is not None]
    groups = _collapse_batch(batch, [tensors[i][1][:nb] for i in present])
    outer, inner = groups[:-3], groups[-3:]
    inner = [(1, [0] * len(present))] * (3 - len(inner)) + inner
    strides = [0] * (5 * len(tensors))
    for slot, i in enumerate(present):
        strides[5 * i:5 * i + 5] = [g[1][slot] for g in inner] + list(tensors[i][1][nb:])

    base = [0] * len(tensors)
    for i in present:
        base[i] = tensors[i][0].data.ptr
    if not outer:  # the common case: one launch
        return [g[0] for g in inner], strides, [base]

    def pointer_sets():
        for index in np.ndindex(*(g[0] for g in outer)):
            pointers = list(base)
            for slot, i in enumerate(present):
                offset = sum(ix * g[1][slot] for ix, g in zip(index, outer))
                pointers[i] += offset * tensors[i][0].itemsize
            yield pointers

    return [g[0] for g in inner], strides, pointer_sets()


def _forward_arrays(call: AttentionCall, out, lse) -> tuple:
    """The arrays of the forward's seven parameter-block slots, in slot order: q, k, v, out,
    lse, mask, bias (None where absent)."""
    return call.q, call.k, call.v, out, lse, call.mask, call.bias


def _forward_tensors(call: AttentionCall, out, lse, prepared=None):
    """The forward's seven parameter-block slots: (array, strides over batch + its two last
    axes), in :func:`_forward_arrays` order. ``prepared``: the (k, v) slots' entries of
    prepared operands (:func:`_prepared_plan`) in place of call.k and call.v."""
    batch, sq_sk = call.batch_shape, (call.seqlen_q, call.seqlen_k)
    q, k, v, out, lse, mask, bias = _forward_arrays(call, out, lse)
    kv = prepared or [(k, _broadcast_strides(k, batch + k.shape[-2:])),
                      (v, _broadcast_strides(v, batch + v.shape[-2:]))]
    return [
        (q, _broadcast_strides(q, batch + q.shape[-2:])),
        *kv,
        (out, _broadcast_strides(out, out.shape)),
        (lse, None if lse is None else _broadcast_strides(lse, lse.shape) + [0]),
        (mask, mask is not None and _broadcast_strides(mask, batch + sq_sk)),
        (bias, bias is not None and _broadcast_strides(bias, batch + sq_sk)),
    ]


def _sizes(call: AttentionCall, extents, num_m: int, num_dv: int) -> list[int]:
    """The integer fields of AttnParams after the seven pointers."""
    return [extents[1], extents[2], call.seqlen_q, call.seqlen_k, call.head_dim,
            call.head_dim_v, call.window_left, call.window_right, num_m, num_dv]


#: Forward launch plans by call signature (:func:`_plan_key`): a ForwardLaunch (kernel,
#: grid, shared memory and the parameter block without its pointers). A repeated signature
#: skips dispatch, layout and packing, which is most of the Python time of a call.
_forward_plans: dict = {}
_MAX_PLANS = 512


def _signature(x):
    return None if x is None else (x.shape, x.strides, x.dtype)


def _plan_key(call: AttentionCall, device_id: int, kernel, tiles):
    """Everything a forward launch plan depends on, pointers aside: shapes, strides and
    dtypes of every array, the scalar arguments, whether q, k and v start on 16-byte
    boundaries (the aligned copy path), the device, the forced family and tiles, and the
    environment variables that choose a family or the kernel sources."""
    q, k, v = call.q, call.k, call.v
    return (device_id, _signature(q), _signature(k), _signature(v), _signature(call.mask),
            _signature(call.bias), _signature(call.out), call.scale, call.softcap,
            call.window_left, call.window_right, call.precision, call.return_lse,
            (q.data.ptr | k.data.ptr | v.data.ptr) % 16 == 0, kernel, tiles,
            os.environ.get("CUATTN_KERNEL"), os.environ.get("CUATTN_KERNEL_DIR"))


def _forward_plan(call: AttentionCall, choice, out, lse, prepared=None):
    """(launch, pointer sets): the dispatch choice and layout of a call as a
    :class:`~cuattn._kernels.ForwardLaunch`; the pointer sets are None when the batch axes
    collapse into the kernel's three (one launch, pointers straight from the arrays), else
    the list of the launches' pointers. ``prepared``: as for :func:`_forward_tensors`."""
    fn = get_kernel(choice.filename, choice.name_expression, shared_mem=choice.shared_mem)
    extents, strides, pointer_sets = _layout(call.batch_shape,
                                             _forward_tensors(call, out, lse, prepared))
    num_m = -(-call.seqlen_q // choice.tiles.block_m)
    num_dv = -(-call.head_dim_v // choice.dv_tile)  # the mma family: always 1
    grid = num_m * num_dv * math.prod(extents)
    tail = attn_params_tail(_sizes(call, extents, num_m, num_dv), call.scale, call.softcap,
                            strides)
    launch = ForwardLaunch(fn, grid, choice.threads, choice.shared_mem, tail)
    return launch, (None if isinstance(pointer_sets, list) else list(pointer_sets))


#: Repeated calls: the signature of a CuPy call without ``out`` whose arguments were
#: validated and whose launch plan exists -> (out shape, lse shape, dtypes, ForwardLaunch).
#: The signature holds everything validation and dispatch read: the arrays' type, shapes,
#: strides, dtypes and devices (q, k, v, and mask and bias when given), whether q, k, v
#: start on 16-byte boundaries, the scalar arguments as given (window sides with their
#: types, since (1.0, 2) is refused where (1, 2) is not) and the environment variables that
#: choose a family or the sources; so a call that matches one needs neither.
_repeated: dict = {}


def _repeated_call(q, k, v, mask, bias, window, scale, causal, softcap, return_lse, precision):
    """The result of ``attention(q, k, v, ...)`` by a known signature's plan, or None (an
    unseen signature is validated and planned the long way, then remembered)."""
    cupy = loaded_cupy()
    if cupy is None:  # nothing has imported CuPy: q is no cupy.ndarray
        return None
    ndarray = cupy.ndarray
    if type(q) is not ndarray or type(k) is not ndarray or type(v) is not ndarray:
        return None
    qd, kd, vd = q.data, k.data, v.data
    device = qd.device_id
    extra, pointers = [], [0, 0]
    for slot, x in enumerate((mask, bias)):
        if x is None:
            extra.append(None)
            continue
        if type(x) is not ndarray:
            return None
        xd = x.data
        extra.append((x.shape, x.strides, x.dtype, xd.device_id))
        pointers[slot] = xd.ptr
    if window is not None:
        if type(window) is not tuple:
            return None
        window_key = tuple((type(side), side) for side in window)
    else:
        window_key = None
    key = (q.shape, q.strides, q.dtype, k.shape, k.strides, k.dtype, v.shape, v.strides,
           v.dtype, device, kd.device_id, vd.device_id, (qd.ptr | kd.ptr | vd.ptr) % 16 == 0,
           *extra, window_key, type(scale), scale, type(causal), causal, type(softcap), softcap,
           type(return_lse), return_lse, precision,
           os.environ.get("CUATTN_KERNEL"), os.environ.get("CUATTN_KERNEL_DIR"))
    try:
        entry = _repeated.get(key)
    except TypeError:  # an unhashable argument: the long way
        return None
    if entry is None:
        call = check_attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                               bias=bias, softcap=softcap, return_lse=return_lse,
                               precision=precision)
        out, lse = _forward(call)
        plan = _forward_plans.get(_plan_key(call, device, None, None))
        if plan is not None and plan[1] is None:  # one launch, plan kept
            if len(_repeated) >= _MAX_PLANS:
                _repeated.clear()
            _repeated[key] = (call.out_shape, call.dtype, call.lse_shape,
                              lse_dtype(call.dtype), plan[0])
        return (out, lse) if call.return_lse else out
    if cupy.cuda.runtime.getDevice() != device:
        return None  # another device is current: the long way enters q's
    out_shape, dtype, lse_shape, lse_dt, launch = entry
    out = ndarray(out_shape, dtype)
    lse = ndarray(lse_shape, lse_dt) if return_lse else None
    launch([qd.ptr, kd.ptr, vd.ptr, out.data.ptr, 0 if lse is None else lse.data.ptr,
            *pointers], cupy.cuda.get_current_stream().ptr)
    return (out, lse) if return_lse else out


def _forward_gpu(call: AttentionCall, kernel: str | None, tiles):
    cupy = call.xp
    device_id = call.q.data.device_id
    if cupy.cuda.runtime.getDevice() != device_id:
        with cupy.cuda.Device(device_id):
            return _forward_gpu(call, kernel, tiles)
    # cupy.ndarray rather than cupy.empty: the same allocation, one Python call less
    out = call.out if call.out is not None else cupy.ndarray(call.out_shape, call.dtype)
    lse = cupy.ndarray(call.lse_shape, lse_dtype(call.dtype)) if call.return_lse else None
    if call.seqlen_q == 0 or 0 in call.batch_shape:
        return out, lse
    key = _plan_key(call, device_id, kernel, tiles)
    plan = _forward_plans.get(key)
    stream = cupy.cuda.get_current_stream().ptr
    if plan is None:
        cc, smem_limit = _device_limits(device_id)
        choice = _dispatch.forward_kernel(call, cc, smem_limit, kernel, tiles)
        if choice.prepare:  # operands prepared per call (tile images), then the kernel
            plan = _prepared_plan(call, choice, out, lse)
        else:
            plan = _forward_plan(call, choice, out, lse)
            if choice.magnitudes is not None:  # every launch after its magnitudes kernel
                plan = (_MagnitudesLaunch(call, choice, plan[0], out, lse), plan[1])
        if plan[1] is None:  # plans with a launch loop hold pointers: not kept
            if len(_forward_plans) >= _MAX_PLANS:
                _forward_plans.clear()
            _forward_plans[key] = plan
    launch, pointer_sets = plan
    if pointer_sets is None:  # one launch: the pointers are the arrays' own
        launch([0 if x is None else x.data.ptr for x in _forward_arrays(call, out, lse)], stream)
    else:
        for pointers in pointer_sets:
            launch(pointers, stream)
    return out, lse


def _prepared_plan(call: AttentionCall, choice, out, lse):
    """(launch, pointer sets) of the piped sm90_tf32 instance (attention_sm90_tf32.cu,
    attention_fwd_sm90_tf32_piped), which reads K and V prepared per call: per batch entry
    of k, its tile images (tf32_image_k: each tile of block_n keys rounded to TF32 in the
    shared-memory layout), per batch entry of v its V^T tile images (tf32_image_vt). As for
    :func:`_forward_plan`, the pointer sets are None when every launch is one: the launch
    (a :class:`_PreparedLaunch`) then allocates the images, prepares them and runs the
    kernel from the call's seven pointers, and the plan is kept. Otherwise the images are
    prepared here, and the pointer sets are the kernel's launches over them."""
    cupy = call.xp
    sk, bn = call.seqlen_k, choice.tiles.block_n
    tiles = -(-sk // bn)
    entries, preps = [], []
    for name, x, cols, src_cols in (("k", call.k, choice.d_tile, call.head_dim),
                                    ("vt", call.v, choice.dv_tile, call.head_dim_v)):
        own = x.shape[:-2]  # the input's own batch axes (1 where broadcast)
        images = cupy.empty(own + (tiles, bn * cols), np.float32)
        preps.append(_tf32_prep_plan(f"tf32_image_{name}", x, images, bn, cols, sk, src_cols))
        strides = [0 if n == 1 else st // images.itemsize for n, st in zip(own, images.strides)]
        entries.append((images, [0] * (len(call.batch_shape) - len(own)) + strides
                        + [images.shape[-1], 1]))
    launch, pointer_sets = _forward_plan(call, choice, out, lse, entries)
    if pointer_sets is None and all(p is not None and p[1] is None for p in preps):
        return _PreparedLaunch(cupy, [x.shape for x, _ in entries],
                               [p[0] for p in preps], launch), None
    # launch loops, or no keys: everything runs here, while the images are alive
    stream = cupy.cuda.get_current_stream().ptr
    for x, (images, _), prep in zip((call.k, call.v), entries, preps):
        if prep is not None:
            prep_launch, prep_sets = prep
            for pointers in prep_sets or [(x.data.ptr, images.data.ptr)]:
                prep_launch(pointers, stream)
    if pointer_sets is None:
        arrays = list(_forward_arrays(call, out, lse))
        arrays[1:3] = [x for x, _ in entries]
        pointer_sets = [[0 if x is None else x.data.ptr for x in arrays]]
    for pointers in pointer_sets:
        launch(pointers, stream)
    return launch, []  # launched: nothing left for the caller, and not kept


class _MagnitudesLaunch:
    """A forward launch that needs its call's largest magnitudes (sm90_3xf16): per call, a
    zeroed float[entries][5] (CuPy's pool, on the stream of the launches), the magnitudes
    kernel (MAGNITUDE_ROWS rows of q, k and v per block), then the forward, each with the
    buffer's address in its parameter block. Called as a ForwardLaunch."""

    def __init__(self, call: AttentionCall, choice, launch, out, lse):
        cupy = call.xp
        extents, strides, _ = _layout(call.batch_shape, _forward_tensors(call, out, lse))
        self._entries = math.prod(extents)
        chunks = -(-max(call.seqlen_q, call.seqlen_k) // MAGNITUDE_ROWS)
        tail = attn_params_tail(_sizes(call, extents, chunks, 1), call.scale, call.softcap,
                                strides)
        fn = get_kernel(choice.filename, choice.magnitudes)
        self._magnitudes = ForwardLaunch(fn, chunks * self._entries, 256, 0, tail)
        self._zeros, self._launch = cupy.zeros, launch

    def __call__(self, pointers, stream_ptr: int) -> None:
        buf = self._zeros(self._entries * 5, np.float32)
        self._magnitudes(pointers, stream_ptr, buf.data.ptr)
        self._launch(pointers, stream_ptr, buf.data.ptr)


class _PreparedLaunch:
    """The launches of one call signature of a piped instance (:func:`_prepared_plan`),
    called as a :class:`~cuattn._kernels.ForwardLaunch` with the call's seven pointers: new
    K and V^T images (from CuPy's pool, on the stream of the launches, so reused only after
    the kernel that reads them), their two preparations, the kernel."""

    def __init__(self, cupy, shapes, preps, launch):
        self._ndarray, self._shapes, self._preps, self._launch = cupy.ndarray, shapes, preps, launch

    def __call__(self, pointers, stream_ptr: int) -> None:
        k_images = self._ndarray(self._shapes[0], np.float32)
        vt_images = self._ndarray(self._shapes[1], np.float32)
        k_ptr, vt_ptr = k_images.data.ptr, vt_images.data.ptr
        self._preps[0]((pointers[1], k_ptr), stream_ptr)
        self._preps[1]((pointers[2], vt_ptr), stream_ptr)
        self._launch([pointers[0], k_ptr, vt_ptr, *pointers[3:]], stream_ptr)


def _tf32_prep_plan(expr: str, src, images, rows: int, cols: int, src_rows: int,
                    src_cols: int):
    """(launch, pointer sets) of one tf32_image_k / tf32_image_vt preparation: the pointer
    sets are None when it is one launch (source and images from the arrays' own pointers),
    else the (source, images) pointers of each launch, when the input's batch axes do not
    collapse into three. ``rows`` keys per tile, ``cols`` the padded head dim. None when
    there are no keys: nothing to prepare."""
    if src_rows == 0:
        return None
    own = src.shape[:-2]
    src_strides = _broadcast_strides(src, src.shape)
    dst_strides = _broadcast_strides(images, images.shape)
    nb = len(own)
    extents, strides, pointer_sets = _layout(
        own, [(src, src_strides), (images, dst_strides[:nb] + [images.shape[-1], 1])])
    count = math.prod(extents)
    key_tiles = -(-src_rows // rows)
    if expr.startswith("tf32_image_k"):  # one thread per 16-byte chunk of a tile's keys
        size = key_tiles * rows * cols
        grid = (max(1, min(-(-size // 1024), 4096)), min(count, 65535))
    else:  # one block per 32 keys x 32 columns
        grid = (key_tiles * rows // 32 * (cols // 32), min(count, 65535))
    fn = get_kernel("attention_sm90_tf32.cu", expr)
    launch = Tf32PrepLaunch(fn, grid, [0, 0, count, extents[1], extents[2], rows, cols,
                                       src_rows, src_cols] + strides[:5])
    if isinstance(pointer_sets, list):  # one launch
        return launch, None
    return launch, [(p[0], p[1]) for p in pointer_sets]


#: Rows of q (and of k) per block of attention_bwd_magnitudes (MAG_ROWS in
#: cuda/attention_backward_sm90_3xf16.cu)
MAGNITUDE_ROWS = 16


def _backward_gpu(call: AttentionCall, dout, out, lse, kernel: str | None = None, tiles=None):
    """dq, dk, dv of a validated CuPy call: delta, then the dK/dV and dQ kernels (after the
    magnitudes kernel where the family has one). A gradient of an input that was broadcast
    over batch axes is computed per batch entry in the accumulator type and summed over
    those axes (a deterministic CuPy reduction)."""
    cupy = call.xp
    acc = lse_dtype(call.dtype)
    batch = call.batch_shape
    nbatch = math.prod(batch)
    inputs = (call.q, call.k, call.v)
    with call.q.device:
        if nbatch == 0 or call.seqlen_q == 0 or call.seqlen_k == 0:
            return tuple(cupy.zeros(x.shape, call.dtype) for x in inputs)
        # a gradient the kernels can write in place has no broadcast batch axis
        direct = [math.prod(x.shape[:-2]) == nbatch for x in inputs]
        direct[1] = direct[2] = direct[1] and direct[2]  # dK and dV share one kernel
        kv_dtype = call.dtype if direct[1] else acc
        q_dtype = call.dtype if direct[0] else acc
        cc, smem_limit = _device_limits(call.q.device.id)
        choice = _dispatch.backward_kernels(call, cc, smem_limit, (kv_dtype, q_dtype), dout,
                                            kernel, tiles)
        targets = [cupy.empty(x.shape if d else batch + x.shape[-2:], g)
                   for x, d, g in zip(inputs, direct, (q_dtype, kv_dtype, kv_dtype))]
        delta = cupy.empty(call.lse_shape, acc)
        tensors = _forward_tensors(call, out, lse) + [
            (dout, _broadcast_strides(dout, dout.shape)),
            (delta, _broadcast_strides(delta, delta.shape) + [0]),
        ] + [(g, _broadcast_strides(g, batch + g.shape[-2:])) for g in targets]
        extents, strides, pointer_sets = _layout(batch, tensors)
        sizes = _sizes(call, extents, 0, 0)
        inner = math.prod(extents)
        # (kernel, shared memory, threads, grid rows, grid column tiles, blocks)
        rows_q = inner * call.seqlen_q
        dkdv_rows = -(-call.seqlen_k // choice.dkdv_rows)
        dkdv_cols = choice.dkdv_roles * -(-max(call.head_dim, call.head_dim_v) // choice.col_tile)
        dq_rows = -(-call.seqlen_q // choice.dq_rows)
        dq_cols = -(-call.head_dim // choice.dq_col_tile)
        launches = [
            (choice.delta, 0, choice.threads_delta, rows_q, 1,
             -(-rows_q // (choice.threads_delta // 32))),
            (choice.dkdv, choice.smem_dkdv, choice.threads_dkdv, dkdv_rows, dkdv_cols,
             dkdv_rows * dkdv_cols * inner),
            (choice.dq, choice.smem_dq, choice.threads_dq, dq_rows, dq_cols,
             dq_rows * dq_cols * inner),
        ]
        kernels = [get_kernel(choice.filename, expr, shared_mem=smem)
                   for expr, smem, *_ in launches]
        magnitudes = None
        if choice.magnitudes is not None:
            # the largest magnitudes of each batch entry's operands (attention_bwd_magnitudes:
            # MAGNITUDE_ROWS rows per block), zeroed before each pointer set's launch
            chunks = -(-max(call.seqlen_q, call.seqlen_k) // MAGNITUDE_ROWS)
            magnitudes = (get_kernel(choice.filename, choice.magnitudes),
                          cupy.empty(inner * 5, np.float32), chunks)
        mag_ptr = 0 if magnitudes is None else magnitudes[1].data.ptr

        def launch(fn, smem, threads, rows, cols, blocks, pointers):
            params = pack_attn_bwd_params(pointers[:7] + sizes, call.scale, call.softcap,
                                          strides[:35], pointers[7:] + [rows, cols],
                                          strides[35:], mag_ptr)
            fn((blocks,), (threads,), (params,), shared_mem=smem)

        for pointers in pointer_sets:
            if magnitudes is not None:
                fn, buf, chunks = magnitudes
                buf.fill(0)
                launch(fn, 0, 256, chunks, 1, chunks * inner, pointers)
            for fn, (_, *rest) in zip(kernels, launches):
                launch(fn, *rest, pointers)
        grads = []
        for x, d, g in zip(inputs, direct, targets):
            if not d:
                g = sum_to_shape(g, x.shape).reshape(x.shape).astype(call.dtype, copy=False)
            grads.append(g)
    return tuple(grads)


def multi_head_attention(x, w_q, w_k, w_v, w_o, *, num_heads, b_q=None, b_k=None, b_v=None,
                         b_o=None, causal=False, mask=None):
    """The self-attention layer of a Transformer / Vision Transformer (``x @ w`` convention).

    Parameters
    ----------
    x : (..., N, E) ndarray
        Tokens (numpy or cupy).
    w_q, w_k, w_v, w_o : (E, E) ndarray
        Projections, applied as ``x @ w``.
    num_heads : int
        E is split into ``num_heads`` heads of ``E // num_heads``.
    b_q, b_k, b_v, b_o : (E,) ndarray, optional
        Projection biases.
    causal : bool, optional
        Causal self-attention.
    mask : bool ndarray, optional
        Broadcastable to ``(..., num_heads, N, N)``.

    Returns
    -------
    (..., N, E) ndarray

    Notes
    -----
    The projections use the array library's matmul; for bfloat16 CuPy arrays, which CuPy
    cannot multiply, they are computed in float32 and rounded to bfloat16 once.

    Examples
    --------
    >>> import numpy as np, cuattn
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    >>> w = [rng.standard_normal((16, 16)).astype(np.float32) / 4 for _ in range(4)]
    >>> cuattn.multi_head_attention(x, *w, num_heads=4).shape
    (2, 5, 16)
    """
    x, xp = as_array(x, "x")
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
    if embed % num_heads:
        raise ValueError(f"embedding dim {embed} is not divisible by num_heads={num_heads}")
    params = {}
    for name, w, shape in (("w_q", w_q, (embed, embed)), ("w_k", w_k, (embed, embed)),
                           ("w_v", w_v, (embed, embed)), ("w_o", w_o, (embed, embed)),
                           ("b_q", b_q, (embed,)), ("b_k", b_k, (embed,)),
                           ("b_v", b_v, (embed,)), ("b_o", b_o, (embed,))):
        if w is None:
            if name.startswith("w"):
                raise TypeError(f"{name} must be an array, got None")
            params[name] = None
            continue
        w, xw = as_array(w, name)
        if xw is not xp:
            raise TypeError(f"host and device arrays cannot be mixed in one call: {name} is "
                            f"{'numpy' if xw is np else 'cupy'}, x is "
                            f"{'numpy' if xp is np else 'cupy'}")
        if w.dtype != x.dtype:
            raise TypeError(f"{name} must have the dtype of x ({x.dtype}), got {w.dtype}")
        if w.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {w.shape}")
        params[name] = w
    w_q, w_k, w_v, w_o = (params[n] for n in ("w_q", "w_k", "w_v", "w_o"))
    b_q, b_k, b_v, b_o = (params[n] for n in ("b_q", "b_k", "b_v", "b_o"))
    causal = check_flag(causal, "causal")
    head_dim = embed // num_heads

    def matmul(a, w):
        # CuPy has no bfloat16 matmul: such projections run in float32, rounded back once
        if a.dtype.name == "bfloat16" and not isinstance(a, np.ndarray):
            return (a.astype(np.float32) @ w.astype(np.float32)).astype(a.dtype)
        return a @ w

    def project(w, b):
        y = matmul(x, w)
        if b is not None:
            y = y + b
        # (..., N, E) -> (..., H, N, Dh): a view, no copy
        return y.reshape(y.shape[:-1] + (num_heads, head_dim)).swapaxes(-2, -3)

    heads = attention(project(w_q, b_q), project(w_k, b_k), project(w_v, b_v),
                      causal=causal, mask=mask)
    merged = heads.swapaxes(-2, -3).reshape(x.shape)
    y = matmul(merged, w_o)
    return y if b_o is None else y + b_o
