"""float64 NumPy references: the executable specification of cuattn.

Three things live here, following docs/semantics.rst and the names of
docs/design/shared.rst:

* :func:`attention_reference` and :func:`attention_backward_reference`: the plain float64
  formulas (every score materialised), which every kernel is compared against;
* :func:`attention_blocked` and :func:`attention_backward_blocked`: the tiled loops that
  the CUDA kernels and the NumPy backend (``cuattn._cpu``, its own faster code) run, written
  plainly in NumPy with the same names (``m``, ``l``, ``acc``, ``alpha``, ``scale_log2``,
  ``BLOCK_M``, ``BLOCK_N``), so the algorithm can be debugged apart from CUDA;
* :func:`naive_attention` and :func:`accuracy_bound`: the accuracy rule of
  docs/semantics.rst (an implementation may err at most twice as much as plain
  softmax(q kᵀ) v computed in the input dtype).
"""
from __future__ import annotations

import numpy as np

from ._checks import AttentionCall, check_attention, sum_to_shape

__all__ = ["attention_reference", "attention_backward_reference", "attention_blocked",
           "attention_backward_blocked", "allowed_keys", "naive_attention",
           "naive_attention_backward", "accuracy_bound", "sum_to_shape", "packed_mask",
           "lengths_mask"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _host(x):
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else x


def _block(x, rows: slice, cols: slice):
    """``x[..., rows, cols]`` for a mask or bias that broadcasts to (..., Sq, Sk): a size-1
    axis is kept whole (slicing it with a later block would leave nothing)."""
    return x[..., rows if x.shape[-2] != 1 else slice(None),
             cols if x.shape[-1] != 1 else slice(None)]


def allowed_keys(call: AttentionCall, rows: slice, cols: slice, mask=None):
    """Bool array, broadcastable to (batch..., rows, cols): may query row i attend to key j?

    Combines the causal/window band (aligned to the bottom-right corner, so the last query
    sees every key) with the bool ``mask``.
    """
    i = np.arange(rows.start, rows.stop)[:, None]
    j = np.arange(cols.start, cols.stop)[None, :]
    center = i + (call.seqlen_k - call.seqlen_q)
    ok = np.ones((i.shape[0], j.shape[1]), dtype=bool)
    if call.window_left >= 0:
        ok &= j >= center - call.window_left
    if call.window_right >= 0:
        ok &= j <= center + call.window_right
    if mask is not None:
        ok = ok & _block(_host(mask), rows, cols)
    return ok


def _band(i, j, off, window):
    """Is key j allowed for row i under the band ``window`` = (left, right) (-1: unbounded,
    causal is right = 0) centred on ``i + off``?"""
    left, right = (-1 if w is None else w for w in window)
    ok = np.ones(np.broadcast_shapes(np.shape(i), np.shape(j), np.shape(off)), dtype=bool)
    if left >= 0:
        ok &= j >= i + off - left
    if right >= 0:
        ok &= j <= i + off + right
    return ok


def packed_mask(q_offsets, k_offsets, window=(-1, -1)):
    """The (Tq, Tk) bool mask that says the same as packed sequences: row i of sequence s
    sees key j of sequence s inside the band aligned to the bottom-right corner of the
    sequence's own block (``causal`` is ``window=(-1, 0)``)."""
    q_off, k_off = np.asarray(_host(q_offsets)), np.asarray(_host(k_offsets))
    tq, tk = int(q_off[-1]), int(k_off[-1])
    seq_q = np.searchsorted(q_off, np.arange(tq), side="right") - 1
    seq_k = np.searchsorted(k_off, np.arange(tk), side="right") - 1
    i = np.arange(tq)[:, None] - q_off[seq_q][:, None]   # row within its sequence
    j = np.arange(tk)[None, :] - k_off[seq_k][None, :]   # key within its sequence
    sq, sk = np.diff(q_off)[seq_q][:, None], np.diff(k_off)[seq_k][None, :]
    same = seq_q[:, None] == seq_k[None, :]
    return same & _band(i, j, np.where(same, sk - sq, 0), window)


def lengths_mask(k_lengths, batch_shape, seqlen_q, seqlen_k, window=(-1, -1)):
    """The (batch..., Sq, Sk) bool mask that says the same as ``k_lengths``: entry b sees its
    first ``k_lengths[b]`` keys, inside the band aligned to that length."""
    lengths = np.broadcast_to(np.asarray(_host(k_lengths)), batch_shape)[..., None, None]
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    return (j < lengths) & _band(i, j, lengths - seqlen_q, window)


def _scores(call: AttentionCall, q, k, bias, rows: slice, cols: slice):
    """Scores in natural units: scale * q kᵀ, then softcap, then bias (docs/semantics.rst,
    steps 1-3)."""
    s = call.scale * (q @ np.swapaxes(k, -1, -2))
    if call.softcap:
        s = call.softcap * np.tanh(s / call.softcap)
    if bias is not None:
        s = s + _block(_host(bias), rows, cols).astype(s.dtype)
    return s


def _prepare(q, k, v, mask, bias, kwargs):
    call = check_attention(q, k, v, mask=mask, bias=bias, **kwargs)
    full_mask = None if call.mask is None else np.broadcast_to(
        _host(call.mask), call.batch_shape + (call.seqlen_q, call.seqlen_k))
    full_bias = None if call.bias is None else np.broadcast_to(
        _host(call.bias), call.batch_shape + (call.seqlen_q, call.seqlen_k))
    f64 = [_host(x).astype(np.float64) for x in (call.q, call.k, call.v)]
    return call, f64, full_mask, full_bias


def _dense_probabilities(call, q, k, mask, bias):
    rows, cols = slice(0, call.seqlen_q), slice(0, call.seqlen_k)
    s = _scores(call, q, k, bias, rows, cols)
    allowed = np.broadcast_to(allowed_keys(call, rows, cols, mask),
                              call.batch_shape + (call.seqlen_q, call.seqlen_k))
    s = np.where(allowed, s, -np.inf)
    if call.seqlen_k:
        s_max = s.max(axis=-1, keepdims=True)
    else:
        s_max = np.full(s.shape[:-1] + (1,), -np.inf)
    shift = np.where(np.isneginf(s_max), 0.0, s_max)  # a fully masked row: exp(-inf) = 0
    e = np.exp(s - shift)
    total = e.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(total == 0, 0.0, e / total)
        lse = np.where(total[..., 0] == 0, -np.inf, shift[..., 0] + np.log(total[..., 0]))
    return p, lse


def attention_reference(q, k, v, *, mask=None, bias=None, **kwargs):
    """float64 attention by the plain formula: returns ``(out, lse)`` as float64 arrays.

    Takes :func:`cuattn.attention`'s arguments (``scale``, ``causal``, ``window``, ``mask``,
    ``bias``, ``softcap``). Every score is materialised: use it for tests, not for long
    sequences.

    Examples
    --------
    >>> import numpy as np
    >>> from cuattn.reference import attention_reference
    >>> q = k = v = np.eye(2)[None]
    >>> out, lse = attention_reference(q, k, v, causal=True)
    >>> out[0, 0].tolist(), bool(np.isfinite(lse).all())
    ([1.0, 0.0], True)
    """
    kwargs.pop("return_lse", None)
    call, (q, k, v), mask, bias = _prepare(q, k, v, mask, bias, kwargs)
    p, lse = _dense_probabilities(call, q, k, mask, bias)
    out = np.broadcast_to(p @ v, call.out_shape)
    return np.array(out), np.array(np.broadcast_to(lse, call.lse_shape))


def attention_backward_reference(dout, q, k, v, *, mask=None, bias=None, **kwargs):
    """float64 gradients ``(dq, dk, dv)`` of ``attention(q, k, v)`` against ``dout``.

    ``dS = P ∘ (dP - delta)`` with ``dP = dout vᵀ`` and ``delta = rowsum(dout ∘ out)``; the
    softcap derivative ``1 - tanh²`` is applied where ``softcap`` is set; gradients of
    broadcast inputs are summed over the broadcast axes, so they have the inputs' shapes.
    """
    shapes = (np.shape(q), np.shape(k), np.shape(v))
    call, (q, k, v), mask, bias = _prepare(q, k, v, mask, bias, kwargs)
    dout = _host(dout).astype(np.float64)
    p, _ = _dense_probabilities(call, q, k, mask, bias)
    out = p @ v
    dv = np.swapaxes(p, -1, -2) @ dout
    dp = dout @ np.swapaxes(v, -1, -2)
    delta = (dout * out).sum(axis=-1, keepdims=True)
    ds = p * (dp - delta)
    if call.softcap:
        t = np.tanh(call.scale * (q @ np.swapaxes(k, -1, -2)) / call.softcap)
        ds = ds * (1.0 - t * t)
    dq = ds @ k * call.scale
    dk = np.swapaxes(ds, -1, -2) @ q * call.scale
    return tuple(np.ascontiguousarray(sum_to_shape(g, s)) for g, s in zip((dq, dk, dv), shapes))


def attention_blocked(call: AttentionCall, *, acc_dtype, block_m: int = 64, block_n: int = 64):
    """The kernels' online-softmax loop in NumPy, for a validated NumPy call.

    Query rows are taken ``BLOCK_M`` at a time; each block walks the key tiles of
    ``BLOCK_N`` keys that its causal/window band reaches, keeping the running row max ``m``
    (log2 units), row sum ``l`` and unnormalised output ``acc`` in ``acc_dtype``, and
    rescaling by ``alpha = exp2(m_old - m_new)`` as each tile arrives. Memory is
    O(batch · BLOCK_M · BLOCK_N). Returns ``(out, lse)`` in ``acc_dtype``.
    """
    BLOCK_M, BLOCK_N = block_m, block_n
    scale_log2 = call.scale * LOG2E
    off = call.seqlen_k - call.seqlen_q
    out = np.empty(call.out_shape, acc_dtype)
    lse = np.empty(call.lse_shape, acc_dtype)
    for m0 in range(0, call.seqlen_q, BLOCK_M):
        rows = slice(m0, min(m0 + BLOCK_M, call.seqlen_q))
        q_blk = call.q[..., rows, :].astype(acc_dtype)
        n_rows = rows.stop - rows.start
        m = np.full(call.batch_shape + (n_rows,), -np.inf, acc_dtype)
        l = np.zeros(call.batch_shape + (n_rows,), acc_dtype)
        acc = np.zeros(call.batch_shape + (n_rows, call.head_dim_v), acc_dtype)
        n_lo, n_hi = 0, call.seqlen_k  # key tiles outside the band are skipped, as in CUDA
        if call.window_left >= 0:
            n_lo = max(0, m0 + off - call.window_left) // BLOCK_N * BLOCK_N
        if call.window_right >= 0:
            n_hi = min(n_hi, rows.stop - 1 + off + call.window_right + 1)
        for n0 in range(n_lo, n_hi, BLOCK_N):
            cols = slice(n0, min(n0 + BLOCK_N, call.seqlen_k))
            k_blk = call.k[..., cols, :].astype(acc_dtype)
            v_blk = call.v[..., cols, :].astype(acc_dtype)
            qk = q_blk @ np.swapaxes(k_blk, -1, -2)
            if call.softcap:
                s = (call.softcap * LOG2E) * np.tanh(qk * (call.scale / call.softcap))
            else:
                s = qk * scale_log2
            if call.bias is not None:
                s = s + _block(call.bias, rows, cols).astype(acc_dtype) * LOG2E
            s = np.where(allowed_keys(call, rows, cols, call.mask), s, -np.inf).astype(acc_dtype)
            m_new = np.maximum(m, s.max(axis=-1))
            m_use = np.where(np.isneginf(m_new), 0, m_new)  # all masked so far: exp2 -> 0
            alpha = np.exp2(m - m_use)
            p = np.exp2(s - m_use[..., None])
            l = l * alpha + p.sum(axis=-1)
            acc = acc * alpha[..., None] + p @ v_blk
            m = m_new
        with np.errstate(invalid="ignore", divide="ignore"):
            out[..., rows, :] = np.where(l[..., None] == 0, 0, acc / l[..., None])
            lse[..., rows] = np.where(l == 0, -np.inf, m * LN2 + np.log(l))
    return out, lse


def attention_backward_blocked(call: AttentionCall, dout, out, lse, *, acc_dtype,
                               block_m: int = 64, block_n: int = 64):
    """FlashAttention-2's backward in NumPy, for a validated NumPy call.

    ``delta = rowsum(dout ∘ out)``; then for each key tile (``BLOCK_N`` keys) and each
    query tile (``BLOCK_M`` rows) that its band reaches, P is recomputed from q, k and the
    forward's ``lse`` (nothing of size Sq × Sk is kept), and ``dV += Pᵀ dO``,
    ``dS = P ∘ (dO Vᵀ - delta)`` (times ``1 - tanh²`` under softcap), ``dK += dSᵀ Q · scale``,
    ``dQ += dS K · scale``. Each tile's gradients are summed over the axes along which its
    input was broadcast before they are accumulated, so memory is O(inputs + tiles). The
    order of the sums is fixed: repeated calls give identical bits. Returns ``(dq, dk, dv)``
    in ``acc_dtype`` with the shapes of q, k and v.
    """
    BLOCK_M, BLOCK_N = block_m, block_n
    q, k, v = call.q, call.k, call.v
    dq = np.zeros(q.shape, acc_dtype)
    dk = np.zeros(k.shape, acc_dtype)
    dv = np.zeros(v.shape, acc_dtype)
    delta = (dout.astype(acc_dtype) * out.astype(acc_dtype)).sum(axis=-1)
    off = call.seqlen_k - call.seqlen_q
    for n0 in range(0, call.seqlen_k, BLOCK_N):
        cols = slice(n0, min(n0 + BLOCK_N, call.seqlen_k))
        k_blk = k[..., cols, :].astype(acc_dtype)
        v_blk = v[..., cols, :].astype(acc_dtype)
        dk_blk = np.zeros(k_blk.shape, acc_dtype)
        dv_blk = np.zeros(v_blk.shape, acc_dtype)
        # query rows whose band reaches these keys: j <= i + off + right, j >= i + off - left
        m_lo, m_hi = 0, call.seqlen_q
        if call.window_right >= 0:
            m_lo = max(0, n0 - off - call.window_right) // BLOCK_M * BLOCK_M
        if call.window_left >= 0:
            m_hi = min(m_hi, cols.stop - 1 - off + call.window_left + 1)
        for m0 in range(m_lo, max(m_lo, m_hi), BLOCK_M):
            rows = slice(m0, min(m0 + BLOCK_M, call.seqlen_q))
            q_blk = q[..., rows, :].astype(acc_dtype)
            do_blk = dout[..., rows, :].astype(acc_dtype)
            lse_blk = lse[..., rows].astype(acc_dtype)[..., None]
            qk = q_blk @ np.swapaxes(k_blk, -1, -2)
            s = call.scale * qk
            if call.softcap:
                t = np.tanh(s / call.softcap)
                s = call.softcap * t
            if call.bias is not None:
                s = s + _block(call.bias, rows, cols).astype(acc_dtype)
            allowed = allowed_keys(call, rows, cols, call.mask)
            with np.errstate(invalid="ignore", over="ignore"):
                # a row with no allowed key has lse = -inf and contributes nothing
                p = np.where(allowed & ~np.isneginf(lse_blk), np.exp(s - lse_blk), 0)
            p = p.astype(acc_dtype)
            dv_blk += sum_to_shape(np.swapaxes(p, -1, -2) @ do_blk, dv_blk.shape)
            ds = p * (do_blk @ np.swapaxes(v_blk, -1, -2) - delta[..., rows, None])
            if call.softcap:
                ds = ds * (1 - t * t)
            dq[..., rows, :] += sum_to_shape(ds @ k_blk * call.scale, dq[..., rows, :].shape)
            dk_blk += sum_to_shape(np.swapaxes(ds, -1, -2) @ q_blk * call.scale, dk_blk.shape)
        dk[..., cols, :] = dk_blk
        dv[..., cols, :] = dv_blk
    return dq, dk, dv


def round_tf32(x):
    """float32 values rounded to TF32 (10 explicit mantissa bits), to nearest with ties away
    from zero, as PTX's ``cvt.rna.tf32.f32``; infinities and NaN pass unchanged."""
    x = np.asarray(x, np.float32)
    bits = np.ascontiguousarray(x).view(np.uint32)
    rounded = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(np.isfinite(x), rounded, x).astype(np.float32)


def _naive_setup(q, k, v, mask, bias, kwargs):
    """Validated call, work-precision q/k/v, the rounding function and the rounded P of the
    naive yardstick: S and P rounded to the input dtype (16-bit inputs work in float32).
    With ``precision="tf32"`` the operands of both products (q, k, P, v) are rounded to
    TF32, as TF32 tensor cores see them."""
    kwargs.pop("return_lse", None)
    call = check_attention(q, k, v, mask=mask, bias=bias, **kwargs)
    kwargs.pop("precision", None)
    dtype = call.dtype
    work = np.float64 if dtype == np.float64 else np.float32
    tf32 = call.precision == "tf32"

    def rnd(x):
        return x.astype(dtype).astype(work)

    q, k, v = (_host(x).astype(work) for x in (call.q, call.k, call.v))
    if tf32:
        q, k, v = round_tf32(q), round_tf32(k), round_tf32(v)
    rows, cols = slice(0, call.seqlen_q), slice(0, call.seqlen_k)
    s = rnd(_scores(call, q, k, call.bias, rows, cols))
    s = np.where(allowed_keys(call, rows, cols, call.mask), s, -np.inf)
    s_max = s.max(axis=-1, keepdims=True) if call.seqlen_k else np.zeros(s.shape[:-1] + (1,))
    with np.errstate(invalid="ignore", divide="ignore"):
        e = np.exp(s - np.where(np.isneginf(s_max), 0, s_max))
        total = e.sum(axis=-1, keepdims=True)
        p = rnd(np.where(total == 0, 0, e / total))
    if tf32:
        p = round_tf32(p)
    return call, (q, k, v), rnd, p


def naive_attention_backward(dout, q, k, v, *, mask=None, bias=None, **kwargs):
    """Gradients by the plain formula in the input dtype: the yardstick of the gradient
    accuracy rule (3 × its error). 16-bit inputs compute in float32 and round P, dP, dS and
    the gradients to the input dtype; float32 and float64 run in their own precision. With
    ``precision="tf32"`` every product operand (q, k, v, P, dout, dS) is rounded to TF32."""
    tf32 = kwargs.get("precision") == "tf32"
    call, (q, k, v), rnd, p = _naive_setup(q, k, v, mask, bias, kwargs)
    dout = _host(dout).astype(q.dtype)
    out = rnd(p @ v)
    delta = (dout * out).sum(axis=-1, keepdims=True)
    if tf32:
        dout = round_tf32(dout)
    dv = np.swapaxes(p, -1, -2) @ dout
    dp = rnd(dout @ np.swapaxes(v, -1, -2))
    ds = rnd(p * (dp - delta))
    if call.softcap:
        t = np.tanh(call.scale * (q @ np.swapaxes(k, -1, -2)) / call.softcap)
        ds = rnd(ds * (1 - t * t))
    if tf32:
        ds = round_tf32(ds)
    dq = ds @ k * call.scale
    dk = np.swapaxes(ds, -1, -2) @ q * call.scale
    shapes = (call.q.shape, call.k.shape, call.v.shape)
    return tuple(sum_to_shape(g, sh).astype(call.dtype) for g, sh in zip((dq, dk, dv), shapes))


def naive_attention(q, k, v, *, mask=None, bias=None, **kwargs):
    """softmax(q kᵀ) v computed plainly in the input dtype: the yardstick of the accuracy
    rule. 16-bit inputs accumulate in float32 and S, P and out are rounded to the input
    dtype; float32 and float64 run in their own precision."""
    call, (q, k, v), _, p = _naive_setup(q, k, v, mask, bias, kwargs)
    out = (p @ v).astype(call.dtype)
    return np.array(np.broadcast_to(out, call.out_shape))


def accuracy_bound(naive, ref64) -> float:
    """The accuracy rule of docs/semantics.rst: an implementation passes when
    ``max|out - ref64| <= bound`` with ``bound = 2 * max|naive - ref64| + 1e-6`` (use 3×
    for gradients)."""
    naive = np.asarray(naive, dtype=np.float64)
    finite = np.isfinite(ref64)
    if not finite.any():
        return 1e-6
    return 2.0 * float(np.max(np.abs(naive[finite] - ref64[finite]), initial=0.0)) + 1e-6
